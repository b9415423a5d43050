"""Configuration: defaults, YAML files and dotted overrides, typed loading and up-front validation.

Every bad input stops with a `ConfigError` whose message names the key and the numbers; the CLI
prints that message as one line and exits with code 2. Nothing here compiles a model.
"""

import ast
import dataclasses
import io
import os
import subprocess
import sys
import tokenize
import typing
from pathlib import Path

import pytest

from jaxpar import checks, config
from jaxpar.config import Config, ConfigError, MeshConfig

REPO_ROOT = Path(__file__).resolve().parents[1]
DEVICES = 8  # conftest.py emulates 8 CPU devices; validate() takes the count as an argument


def load(*overrides: str) -> Config:
    return config.load_config(None, list(overrides))


def error_of(fn, *args) -> str:
    """The message of the ConfigError that `fn(*args)` raises."""
    with pytest.raises(ConfigError) as info:
        fn(*args)
    return str(info.value)


def validation_error(*overrides: str, devices: int = DEVICES) -> str:
    return error_of(lambda: checks.validate(load(*overrides), devices))


def assert_names_all(message: str, fragments: tuple[str, ...]) -> None:
    missing = [f for f in fragments if f not in message]
    assert not missing, f"message {message!r} lacks {missing}"


# --- Loading: defaults, YAML file, overrides -----------------------------------------------


def test_no_file_and_no_overrides_gives_the_dataclass_defaults():
    assert load() == Config()


def test_defaults_validate_to_a_2x2x2_mesh_on_8_devices():
    sizes = checks.validate(Config(), DEVICES)
    assert sizes == {"pipe": 1, "data": 2, "fsdp": 2, "expert": 1, "context": 1, "tensor": 2}


@pytest.mark.parametrize(
    "override, section, key, expected",
    [
        ("train.steps=20", "train", "steps", 20),
        ("mesh.data=-1", "mesh", "data", -1),
        ("optimizer.lr=3e-4", "optimizer", "lr", 3e-4),  # YAML 1.1 reads 3e-4 as a string
        ("optimizer.clip_norm=2", "optimizer", "clip_norm", 2.0),  # an int where a float goes
        ("data.max_documents=null", "data", "max_documents", None),
        ("data.max_documents=7", "data", "max_documents", 7),
        ("model.tie_embeddings=true", "model", "tie_embeddings", True),
        ("train.progress=false", "train", "progress", False),
        ("data.source=/tmp/corpus/*.txt", "data", "source", "/tmp/corpus/*.txt"),
    ],
)
def test_overrides_are_parsed_as_yaml_scalars(override, section, key, expected):
    value = getattr(getattr(load(override), section), key)
    assert value == expected
    assert type(value) is type(expected)


def test_nested_override_reaches_the_moe_section():
    cfg = load("model.moe.num_experts=8", "model.moe.capacity_factor=1.25")
    assert (cfg.model.moe.num_experts, cfg.model.moe.capacity_factor) == (8, 1.25)
    assert cfg.model.moe.top_k == 2  # untouched keys keep their defaults


def test_overrides_win_over_the_file_and_the_file_over_the_defaults(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("train:\n  steps: 50\n  seq_len: 64\nmodel:\n  d_model: 256\n")
    cfg = config.load_config(str(path), ["train.steps=7"])
    assert cfg.train.steps == 7  # override
    assert cfg.train.seq_len == 64  # file
    assert cfg.model.d_model == 256  # file
    assert cfg.train.batch_size == 16 and cfg.model.n_layers == 4  # defaults, merged per key


def test_an_empty_yaml_file_gives_the_defaults(tmp_path):
    path = tmp_path / "empty.yaml"
    path.write_text("")
    assert config.load_config(str(path)) == Config()


def test_dumped_config_loads_back_unchanged(tmp_path):
    cfg = load("train.steps=9", "optimizer.lr=1e-3", "mesh.data=-1", "data.max_documents=3")
    path = tmp_path / "config.yaml"
    config.dump_yaml(cfg, str(path))
    assert config.load_config(str(path)) == cfg


# --- Loading errors: unknown keys, wrong types, bad files ----------------------------------


@pytest.mark.parametrize(
    "override, fragments",
    [
        ("train.stepz=5", ("'train.stepz'", "did you mean 'train.steps'")),
        ("model.d_modle=64", ("'model.d_modle'", "did you mean 'model.d_model'")),
        ("model.moe.num_expertz=4", ("'model.moe.num_expertz'", "'model.moe.num_experts'")),
        ("trian.steps=5", ("'trian'", "did you mean 'train'")),  # unknown section
    ],
    ids=["key", "model-key", "nested-key", "section"],
)
def test_unknown_key_is_named_with_the_nearest_known_key(override, fragments):
    assert_names_all(error_of(load, override), ("unknown config key",) + fragments)


@pytest.mark.parametrize(
    "override, fragments",
    [
        ("train.steps=abc", ("train.steps", "expected int", "'abc'")),
        ("train.steps=2.5", ("train.steps", "expected int", "2.5")),
        ("train.steps=true", ("train.steps", "expected int", "True")),  # a bool is not an int
        ("model.tie_embeddings=3", ("model.tie_embeddings", "expected bool", "3")),
        ("optimizer.lr=fast", ("optimizer.lr", "expected float", "'fast'")),
        ("model.moe.capacity_factor=abc", ("model.moe.capacity_factor", "expected float")),
        ("train=5", ("train", "expected a mapping")),
    ],
)
def test_wrong_type_names_the_key_the_expected_type_and_the_value(override, fragments):
    assert_names_all(error_of(load, override), fragments)


def test_override_without_equals_sign_is_rejected():
    assert_names_all(error_of(load, "train.steps"), ("'train.steps'", "dotted.key=value"))


def test_missing_config_file_is_named(tmp_path):
    path = str(tmp_path / "nope.yaml")
    assert_names_all(error_of(config.load_config, path), (path, "does not exist"))


def test_unparsable_yaml_file_is_named(tmp_path):
    path = tmp_path / "broken.yaml"
    path.write_text("train:\n  steps: [1, 2\n  seq_len: 64\n")
    assert_names_all(error_of(config.load_config, str(path)), (str(path), "not valid YAML"))


def test_yaml_file_that_is_not_a_mapping_is_rejected(tmp_path):
    path = tmp_path / "list.yaml"
    path.write_text("- 1\n- 2\n")
    assert_names_all(error_of(config.load_config, str(path)), (str(path), "mapping", "list"))


def test_unknown_key_in_a_yaml_file_is_named_with_its_section(tmp_path):
    path = tmp_path / "typo.yaml"
    path.write_text("optimizer:\n  learning_rate: 0.1\n")
    assert "'optimizer.learning_rate'" in error_of(config.load_config, str(path))


# --- Settings with a fixed set of values (Literal) and the comment on every setting ----------


def sections(cls=Config, prefix: str = ""):
    """(key prefix, dataclass) of Config and of every section below it."""
    yield prefix, cls
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            yield from sections(hints[f.name], prefix + f.name + ".")


def literal_settings() -> dict[str, tuple]:
    """Every Literal setting, read from the dataclasses: dotted key -> its choices."""
    found = {}
    for prefix, cls in sections():
        for name, hint in typing.get_type_hints(cls).items():
            if typing.get_origin(hint) is typing.Literal:
                found[prefix + name] = typing.get_args(hint)
    return found


LITERALS = literal_settings()


def test_the_fixed_choice_settings_are_literals():
    """The walk finds them (so the tests below, generated from it, cover them)."""
    expected = {
        "model.dtype",
        "model.param_dtype",
        "model.attention",
        "parallel.remat",
        "parallel.context_layout",
        "parallel.pipeline_schedule",
        "parallel.zero_stage",
        "data.format",
        "data.packing",
        "optimizer.name",
        "train.on_nan",
    }
    assert expected <= set(LITERALS), expected - set(LITERALS)


def not_a_choice(choices: tuple):
    return 7 if isinstance(choices[0], int) else "bogus"


@pytest.mark.parametrize("key", sorted(LITERALS))
def test_a_value_outside_a_literal_names_the_key_the_value_and_the_choices(key):
    choices = LITERALS[key]
    bad = not_a_choice(choices)
    message = error_of(load, f"{key}={bad}")
    assert_names_all(message, (f"{key}={bad!r}", "choose one of", ", ".join(str(c) for c in choices)))


@pytest.mark.parametrize("key", sorted(LITERALS))
def test_a_value_outside_a_literal_in_a_yaml_file_is_rejected(key, tmp_path):
    section, name = key.rsplit(".", 1)
    path = tmp_path / "run.yaml"
    nested = f"{name}: {not_a_choice(LITERALS[key])}"
    for part in reversed(section.split(".")):
        nested = f"{part}:\n  " + nested.replace("\n", "\n  ")
    path.write_text(nested + "\n")
    assert f"{key}=" in error_of(config.load_config, str(path))


@pytest.mark.parametrize("key, choice", [(k, c) for k in sorted(LITERALS) for c in LITERALS[k]])
def test_every_literal_choice_loads(key, choice):
    value = load(f"{key}={choice}")
    for name in key.split("."):
        value = getattr(value, name)
    assert value == choice and type(value) is type(choice)


@pytest.mark.parametrize(
    "override", ["parallel.zero_stage=true", "parallel.zero_stage=1.0", "parallel.zero_stage='1'"]
)
def test_zero_stage_takes_only_the_integers(override):
    """True == 1 and 1.0 == 1 in Python; neither is the stage 1."""
    assert "parallel.zero_stage=" in error_of(load, override)


@pytest.mark.parametrize(
    "section, key, value",
    [
        ("model", "attention", "flash"),
        ("parallel", "zero_stage", 5),
        ("train", "on_nan", "ignore"),
    ],
)
def test_validate_checks_the_literals_of_a_config_built_in_python(section, key, value):
    cfg = Config()
    setattr(getattr(cfg, section), key, value)
    message = error_of(checks.validate, cfg, DEVICES)
    assert_names_all(message, (f"{section}.{key}={value!r}", "choose one of"))


def test_the_pipeline_schedules_agree_with_the_config_choices():
    from jaxpar.parallel.schedule import SCHEDULES

    assert set(SCHEDULES) == set(LITERALS["parallel.pipeline_schedule"])


def test_the_attention_kernels_agree_with_the_config_choices():
    from jaxpar.models.attention import IMPLEMENTATIONS

    assert set(IMPLEMENTATIONS) | {"auto"} == set(LITERALS["model.attention"])


def test_every_setting_has_a_comment_on_its_line():
    """Each field of each config dataclass, read from config.py's source: its line (all of its
    lines, if it spans several) carries a `#` comment."""
    source = Path(config.__file__).read_text()
    commented = {
        tok.start[0]
        for tok in tokenize.generate_tokens(io.StringIO(source).readline)
        if tok.type == tokenize.COMMENT
    }
    classes = {node.name: node for node in ast.walk(ast.parse(source)) if isinstance(node, ast.ClassDef)}
    checked, missing = 0, []
    for prefix, cls in sections():
        lines = {
            stmt.target.id: range(stmt.lineno, stmt.end_lineno + 1)
            for stmt in classes[cls.__name__].body
            if isinstance(stmt, ast.AnnAssign)
        }
        for f in dataclasses.fields(cls):
            checked += 1
            if not commented.intersection(lines[f.name]):
                missing.append(f"{prefix}{f.name} (config.py line {lines[f.name][0]})")
    assert checked == len(config._all_keys(Config))
    assert not missing, f"settings without a comment: {missing}"


# --- Mesh --------------------------------------------------------------------------------


def test_minus_one_takes_the_remaining_devices():
    sizes = checks.validate(load("mesh.data=-1", "mesh.fsdp=2", "mesh.tensor=2"), DEVICES)
    assert sizes["data"] == 2
    assert (sizes["fsdp"], sizes["tensor"]) == (2, 2)


@pytest.mark.parametrize(
    "overrides, axis, expected",
    [
        (("mesh.fsdp=-1", "mesh.data=1", "mesh.tensor=1"), "fsdp", 8),
        (("mesh.tensor=-1", "mesh.data=4", "mesh.fsdp=1"), "tensor", 2),
    ],
)
def test_minus_one_fills_any_axis(overrides, axis, expected):
    assert checks.validate(load(*overrides), DEVICES)[axis] == expected


def test_mesh_product_must_equal_device_count():
    message = validation_error("mesh.tensor=3")
    assert_names_all(message, ("mesh", "tensor=3", "multiplies to 12", "8 devices"))


def test_only_one_mesh_axis_may_be_minus_one():
    message = validation_error("mesh.data=-1", "mesh.fsdp=-1")
    assert_names_all(message, ("only one axis may be -1", "data, fsdp"))


def test_minus_one_that_cannot_fill_the_devices_is_rejected():
    message = validation_error("mesh.data=-1", "mesh.fsdp=3", "mesh.tensor=2")
    assert_names_all(message, ("multiply to 6", "does not divide 8"))


@pytest.mark.parametrize("size", [0, -2])
def test_mesh_axis_sizes_are_positive_or_minus_one(size):
    assert f"mesh.data={size}" in validation_error(f"mesh.data={size}")


@pytest.mark.parametrize(
    "devices, expected",
    [(8, MeshConfig()), (1, MeshConfig(data=1, fsdp=1, tensor=1)), (4, MeshConfig(data=4, fsdp=1, tensor=1))],
)
def test_default_mesh_fits_any_device_count(devices, expected):
    mesh = config.fit_default_mesh(devices)
    assert mesh == expected
    assert checks.validate(Config(mesh=mesh), devices)["data"] == expected.data


# --- Model, batch and layout checks ------------------------------------------------------


@pytest.mark.parametrize(
    "overrides, fragments",
    [
        (("model.n_kv_heads=3",), ("model.n_heads=4", "not divisible by model.n_kv_heads=3", "[1, 2, 4]")),
        (
            ("train.batch_size=6",),
            ("train.batch_size=6", "data-parallel size", "data*fsdp*expert=4", "multiple of 4"),
        ),
        (
            ("train.batch_size=8", "parallel.grad_accum=4"),
            ("train.batch_size=8", "parallel.grad_accum=4", "multiple of 16"),
        ),
        (("train.seq_len=4096",), ("train.seq_len=4096", "model.max_seq_len=2048")),
        (("model.d_model=130",), ("model.n_heads=4 does not divide model.d_model=130",)),
        (
            ("model.n_heads=2", "model.n_kv_heads=2", "model.d_model=6", "mesh.tensor=1", "mesh.data=4"),
            ("model.d_model/model.n_heads = 3", "even"),
        ),
        (("parallel.remat=sometimes",), ("parallel.remat='sometimes'", "none, dots, full")),
        (("parallel.zero_stage=4",), ("parallel.zero_stage=4", "0, 1, 2, 3")),
        (
            ("parallel.grad_reduce_dtype=float16",),
            ("parallel.grad_reduce_dtype='float16'", "float32, bfloat16"),
        ),
        (("train.steps=0",), ("train.steps=0", "at least 1")),
        (
            ("model.sliding_window=8", "model.global_every=4", "mesh.pipe=2", "mesh.data=1"),
            ("mesh.pipe=2 x parallel.virtual_stages=1", "holds 2 layers", "model.global_every=4"),
        ),
        (("model.sliding_window=0",), ("model.sliding_window=0", "at least 1")),
        (("model.head_dim=7",), ("model.head_dim = 7 is odd",)),
        (("model.rope_scaling.type=linear", "model.rope_scaling.factor=0"), ("factor=0", "factor > 0")),
    ],
    ids=[
        "heads-kv",
        "batch-dp",
        "batch-accum",
        "seq-len",
        "heads-d_model",
        "odd-head-dim",
        "remat",
        "zero-stage",
        "grad-reduce-dtype",
        "steps",
        "window-pipeline",
        "window-size",
        "odd-explicit-head-dim",
        "linear-rope-factor",
    ],
)
def test_model_and_batch_checks_name_the_keys_and_numbers(overrides, fragments):
    assert_names_all(validation_error(*overrides), fragments)


@pytest.mark.parametrize(
    "overrides, fragments",
    [
        (
            ("mesh.tensor=4", "mesh.fsdp=1", "model.n_heads=2", "model.n_kv_heads=2"),
            ("mesh.tensor=4 does not divide model.n_heads=2", "try tensor in [1, 2]"),
        ),
        (
            ("mesh.tensor=4", "mesh.fsdp=1"),
            ("mesh.tensor=4 does not divide model.n_kv_heads=2", "try tensor in [1, 2]"),
        ),
        (
            ("model.d_ff=385",),
            ("mesh.tensor=2 does not divide model.d_ff=385", "[1, 5, 7, 11, 35, 55, 77, 385]"),
        ),
        (("model.vocab_size=257",), ("mesh.tensor=2 does not divide model.vocab_size=257", "[1, 257]")),
    ],
    ids=["n_heads", "n_kv_heads", "d_ff", "vocab_size"],
)
def test_tensor_must_divide_the_dimensions_it_splits(overrides, fragments):
    assert_names_all(validation_error(*overrides), fragments)


# d_model=20 with 2 heads (head_dim 10), all 8 devices on fsdp: 8 does not divide 20.
FSDP_8_D_MODEL_20 = (
    "mesh.data=1",
    "mesh.fsdp=8",
    "mesh.tensor=1",
    "model.n_heads=2",
    "model.n_kv_heads=2",
    "model.d_model=20",
)


@pytest.mark.parametrize("zero_stage", [1, 2, 3])
def test_fsdp_must_divide_d_model_when_zero_shards_state(zero_stage):
    message = validation_error(*FSDP_8_D_MODEL_20, f"parallel.zero_stage={zero_stage}")
    assert_names_all(
        message, ("mesh.fsdp=8 does not divide model.d_model=20", "try fsdp in [1, 2, 4, 5, 10, 20]")
    )


def test_fsdp_need_not_divide_d_model_without_zero():
    sizes = checks.validate(load(*FSDP_8_D_MODEL_20, "parallel.zero_stage=0"), DEVICES)
    assert sizes["fsdp"] == 8


# --- Data and tokenizer paths ------------------------------------------------------------


def test_missing_data_source_is_named():
    message = validation_error("data.source=/nonexistent/*.txt")
    assert_names_all(message, ("data.source='/nonexistent/*.txt'", "no such file"))


def test_existing_data_glob_passes(tmp_path):
    (tmp_path / "a.txt").write_text("hello")
    checks.validate(load(f"data.source={tmp_path}/*.txt"), DEVICES)


def test_missing_tokenizer_file_is_named():
    message = validation_error("data.tokenizer=/nonexistent/tokenizer.json")
    assert_names_all(message, ("data.tokenizer='/nonexistent/tokenizer.json'", "does not exist"))


# --- The command line --------------------------------------------------------------------


def run_train_cli(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    return subprocess.run(
        [sys.executable, "-m", "jaxpar.train", *args],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_cli_config_error_exits_2_with_one_line_and_no_traceback():
    result = run_train_cli("mesh.tensor=3")
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert "mesh" in lines[0] and "tensor=3" in lines[0]
    assert "Traceback" not in result.stderr + result.stdout


def test_cli_unknown_packing_exits_2_naming_the_key_and_the_choices():
    result = run_train_cli("configs/sft.yaml", "data.packing=bfd")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "config error: data.packing='bfd': choose one of wrap, whole"
    ]


def test_cli_missing_config_file_exits_2_with_no_traceback(tmp_path):
    path = str(tmp_path / "missing.yaml")
    result = run_train_cli(path, "train.steps=1")
    assert result.returncode == 2
    assert path in result.stderr
    assert "Traceback" not in result.stderr + result.stdout


def test_parse_cli_takes_only_the_first_argument_as_a_file():
    assert config.parse_cli(["run.yaml", "train.steps=3"]) == ("run.yaml", ["train.steps=3"])
    assert config.parse_cli(["train.steps=3"]) == (None, ["train.steps=3"])
    assert "other.yaml" in error_of(config.parse_cli, ["run.yaml", "other.yaml"])


@pytest.mark.parametrize(
    "override, want",
    [
        ("optimizer.lr=0", "a positive, finite learning rate"),
        ("optimizer.warmup_steps=-1", "0 or more steps"),
        ("optimizer.min_lr_ratio=1.5", "a ratio in [0, 1]"),
        ("optimizer.b1=1.0", "a decay in [0, 1)"),
        ("optimizer.b2=-0.1", "a decay in [0, 1)"),
        ("optimizer.clip_norm=-1", "0 (off) or a positive norm"),
    ],
)
def test_optimizer_numbers_out_of_range_are_refused(override, want):
    assert_names_all(validation_error(override), (override, want))


@pytest.mark.parametrize(
    "overrides, reduced, why",
    [
        (["model.dtype=bfloat16"], "bfloat16", "model.dtype=bfloat16's"),
        (["model.dtype=float32"], "float32", "model.dtype=float32's"),
        (["model.dtype=float16"], "float32", "model.dtype=float16's"),
        (
            ["model.dtype=float32", "parallel.grad_reduce_dtype=bfloat16"],
            "bfloat16",
            "parallel.grad_reduce_dtype",
        ),
        (
            ["model.dtype=bfloat16", "parallel.grad_reduce_dtype=float32"],
            "float32",
            "parallel.grad_reduce_dtype",
        ),
    ],
)
def test_gradients_are_reduced_in_the_compute_dtype_unless_set(overrides, reduced, why):
    """A float32 model reduced its gradients in bfloat16 when parallel.grad_reduce_dtype was left
    at its old default: unset, it now follows model.dtype (bfloat16 stays bfloat16, with its
    halved bytes), an explicit setting wins, and the start-up line says which is in force."""
    cfg = config.load_config(None, overrides)
    assert cfg.parallel.grad_reduce_dtype in (None, "bfloat16", "float32")
    assert config.reduce_dtype(cfg) == reduced
    assert config.precision_line(cfg).endswith(f"gradients reduced in {reduced} ({why})")


@pytest.mark.parametrize(
    "setting", ["finetune.lora.alpha=32", "finetune.lora.alpha=nan", "finetune.lora.targets=[]"]
)
def test_adapter_settings_without_a_rank_are_refused(setting):
    """A finetune.lora setting with the default rank 0 (no LoRA) was ignored: the whole model
    trained, and an alpha of NaN or no targets, refused with a rank, went unremarked."""
    cfg = config.load_config(None, [setting])
    with pytest.raises(ConfigError, match=r"set, but finetune.lora.rank=0 means no LoRA"):
        checks.validate(cfg, 8)


@pytest.mark.parametrize("chunks", [-1, 257])
def test_loss_chunks_beyond_a_devices_vocabulary_columns_is_a_config_error(chunks):
    """The loss cuts each device's vocabulary columns (512 over mesh.tensor=2: 256) into
    train.loss_chunks pieces; a count past them, or negative, names the range that works."""
    message = validation_error(f"train.loss_chunks={chunks}")
    assert_names_all(message, (f"train.loss_chunks={chunks}", "256", "mesh.tensor=2", "1 to 256"))
    checks.validate(load("train.loss_chunks=256"), DEVICES)  # the last that works
