"""Hugging Face interop, checked against `transformers` itself (jaxpar.convert, jaxpar.export).

tests/hf_reference.py builds tiny random Llama / Mistral / Qwen2 models with transformers (GQA and
multi-head, tied and untied heads, non-default rope_theta, llama3 rope scaling, q/k/v biases,
bfloat16 / float16 / float32 files, one sharded with an index) and records their logits and
greedy generations. It runs in the sidecar environment .venv-hf (`make .venv-hf`: CPU torch +
transformers), once per module. Without .venv-hf these tests skip with one line; with
JAXPAR_TESTS_REQUIRE_HF=1 (CI) they fail instead.

Here, jaxpar loads those directories onto one device and onto a data x fsdp x tensor = 2 x 2 x 2
mesh of the 8 emulated devices (ZeRO-3: every weight split over fsdp and tensor; expert x fsdp x
tensor for MoE) and must give transformers' float32 logits to ATOL and its 20 greedy tokens; each
parity check also shows that a plausible conversion bug (biases dropped, q/k in the interleaved
rotary layout, the two norms swapped, rope scaling ignored) would move the logits far past that
tolerance.

Training too: for each variant of TRAINED, ten AdamW steps from the imported weights on the
mesh give, step by step, the losses of the same steps in torch (hf_reference.py `train`: the
same batches and AdamW settings, read from its output) to 1e-4 relative, and their gradient
norms to 1e-3 (AdamW's update all but ignores a gradient's scale, so the losses alone would not
show a wrong one).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxpar import checks as checks_lib
from jaxpar import config as config_lib
from jaxpar import sharding as sharding_lib
from jaxpar.hf import base, convert, hf_load
from jaxpar.hf import export as export_lib
from jaxpar.models.families import registry as families
from jaxpar.models.llama import Transformer
from jaxpar.sample import generate
from tests.hf_reference import HF_PYTHON, require_sidecar, tensor_bytes

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REFERENCE = os.path.join(ROOT, "tests", "hf_reference.py")
VARIANTS = [
    "llama3-tied-scaled",
    "llama2-gqa-sharded",
    "mistral",
    "qwen2-bias-tied",
    "qwen3-wide-heads",
    "mixtral",
    "qwen3-moe",
    "gemma3-windows",
]
MOE_VARIANTS = {"mixtral", "qwen3-moe"}
EXPORTED_AS = {  # the class transformers loads a variant's export with (Mistral is written as Llama)
    "llama3-tied-scaled": "LlamaForCausalLM",
    "llama2-gqa-sharded": "LlamaForCausalLM",
    "mistral": "LlamaForCausalLM",
    "qwen2-bias-tied": "Qwen2ForCausalLM",
    "qwen3-wide-heads": "Qwen3ForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen3-moe": "Qwen3MoeForCausalLM",
    "gemma3-windows": "Gemma3ForCausalLM",
}
MESH = {"data": 2, "fsdp": 2, "tensor": 2}
MOE_MESH = {"expert": 2, "fsdp": 2, "tensor": 2}  # the batch split over fsdp x expert = 4 rows
ATOL = 5e-5  # float32 logits up to 10.5 in size: 4.1e-5 at worst measured (Mixtral on the mesh)


def _hf(*args: str) -> None:
    proc = subprocess.run(
        [HF_PYTHON, REFERENCE, *args],
        capture_output=True,
        cwd=ROOT,
        timeout=300,
        env=dict(os.environ, TOKENIZERS_PARALLELISM="false"),
    )
    assert proc.returncode == 0, proc.stderr.decode()[-3000:]


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    """(directory of the tiny transformers models, their reference.npz)."""
    require_sidecar("no transformers reference to compare with")
    out = tmp_path_factory.mktemp("hf")
    _hf("build", str(out))
    return out, dict(np.load(out / "reference.npz"))


def _config(hf_dir, overrides=()) -> config_lib.Config:
    """A float32 run config with the model of `hf_dir` (as train.init_from=hf_dir gives it)."""
    settings = config_lib.user_settings(
        None,
        [
            "model.dtype=float32",
            "model.param_dtype=float32",
            "parallel.grad_reduce_dtype=float32",  # torch's gradients are float32 throughout
            "parallel.zero_stage=3",
            *overrides,
            f"train.init_from={hf_dir}",
        ],
    )
    return convert.apply_init_from(config_lib.build_config(settings), settings)


def _on_mesh(cfg, mesh: dict[str, int]):
    sizes = {a: mesh.get(a, 1) for a in config_lib.MESH_AXES}
    devices = jax.devices()[: int(np.prod(list(sizes.values())))]
    layout = sharding_lib.Layout.build(
        sizes, zero_stage=cfg.parallel.zero_stage, sequence_parallel=False, devices=devices
    )
    shapes, shardings = convert.param_targets(cfg, sizes, devices)
    return layout, shapes, shardings


def _forward(cfg, layout):
    """jit(params, tokens) -> (float32 logits, MoE statistics or {})."""
    graphdef = nnx.split(nnx.eval_shape(lambda: Transformer(cfg.model, rngs=nnx.Rngs(0))))[0]

    @jax.jit
    def logits(params, tokens):
        with layout.scope():
            positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
            return nnx.merge(graphdef, params)(tokens, positions, jnp.ones_like(tokens))

    return logits


def _max_diff(a, b) -> float:
    return float(np.max(np.abs(np.asarray(a) - np.asarray(b))))


@pytest.mark.parametrize("variant", VARIANTS)
def test_logits_match_transformers_on_an_fsdp_x_tensor_mesh(hf, variant):
    root, ref = hf
    cfg = _config(root / variant)
    moe = variant in MOE_VARIANTS
    layout, shapes, shardings = _on_mesh(cfg, MOE_MESH if moe else MESH)
    params = hf_load.load_hf_params(str(root / variant), cfg.model, shapes, shardings)
    m = cfg.model
    blocks = params["blocks"]
    attn = blocks["attn"] if "attn" in blocks else next(iter(blocks["blocks"].values()))["attn"]
    units = m.n_layers // (m.moe.every if moe else 1)
    want_shard = (units, m.d_model // 2, m.n_heads // 2, m.head_width)  # [L, E/fsdp, N/tensor, H]
    assert attn["wq"].sharding.shard_shape(attn["wq"].shape) == want_shard
    forward = _forward(cfg, layout)
    tokens = jnp.asarray(ref["tokens"], jnp.int32)
    want = ref[f"{variant}/logits"]
    one_layout, one_shapes, one_shardings = _on_mesh(cfg, {})  # and on one device
    one = hf_load.load_hf_params(str(root / variant), cfg.model, one_shapes, one_shardings)
    assert _max_diff(_forward(cfg, one_layout)(one, tokens)[0], want) <= ATOL
    if moe:  # four rows for the four token devices: the reference's two, twice
        got, stats = forward(params, jnp.concatenate([tokens, tokens]))
        assert _max_diff(got, np.concatenate([want, want])) <= ATOL
        # The same expert choices: each MoE layer's (token, choice) pairs per expert.
        np.testing.assert_array_equal(stats["expert_load"], 2 * ref[f"{variant}/expert_load"])
        return
    assert _max_diff(forward(params, tokens)[0], want) <= ATOL

    # The same check catches what a wrong conversion would do.
    n, h = m.n_heads, m.head_width
    interleave = np.concatenate([np.arange(0, h, 2), np.arange(1, h, 2)])  # rotate-half <-> pairs
    wrong = {
        "q/k in the interleaved rotary layout": {
            "wq": attn["wq"][..., interleave],
            "wk": attn["wk"][..., interleave],
        },
        "q heads in the wrong order (a reshape of N*H as H*N)": {
            "wq": attn["wq"].reshape(*attn["wq"].shape[:2], h, n).swapaxes(-1, -2)
        },
    }
    if m.qkv_bias:
        wrong["q/k/v biases dropped"] = {b: jnp.zeros_like(attn[b]) for b in ("bq", "bk", "bv")}
    if m.qk_norm:
        wrong["q and k norms swapped"] = {"q_norm": attn["k_norm"], "k_norm": attn["q_norm"]}
    for what, change in wrong.items():
        bad = {**params, "blocks": {**blocks, "attn": {**attn, **change}}}
        assert _max_diff(forward(bad, tokens)[0], want) > 100 * ATOL, what
    swapped = {**blocks, "attn_norm": blocks["mlp_norm"], "mlp_norm": blocks["attn_norm"]}
    assert _max_diff(forward({**params, "blocks": swapped}, tokens)[0], want) > 100 * ATOL
    model_bugs = {  # what the model would compute if a setting were read wrong or ignored
        "rope scaling ignored": m.rope_scaling.type != "none"
        and {"rope_scaling": config_lib.RopeScalingConfig()},
        "every layer global": m.sliding_window is not None and {"sliding_window": None},
        "every layer sliding": m.global_every > 0 and {"global_every": 0},
        "one rotary base": m.rope_local_theta is not None and {"rope_local_theta": None},
        "the default query scale": m.attn_scale_dim is not None and {"attn_scale_dim": None},
    }
    for what, change in model_bugs.items():
        if change:
            wrong_cfg = dataclasses.replace(cfg, model=dataclasses.replace(m, **change))
            assert _max_diff(_forward(wrong_cfg, layout)(params, tokens)[0], want) > 100 * ATOL, what


@pytest.mark.parametrize("variant", VARIANTS)
def test_greedy_generation_gives_transformers_tokens(hf, variant):
    root, ref = hf
    assert ref[f"{variant}/margin"] > 1e-3  # no near-ties: the choices are well defined
    cfg = _config(root / variant)
    _, shapes, shardings = _on_mesh(cfg, {})
    params = hf_load.load_hf_params(str(root / variant), cfg.model, shapes, shardings)
    graphdef = nnx.split(nnx.eval_shape(lambda: Transformer(cfg.model, rngs=nnx.Rngs(0))))[0]
    got = generate(nnx.merge(graphdef, params), ref["prompt"].tolist(), 20)
    assert got == ref[f"{variant}/greedy"].tolist()


# The variants trained in both (a variant of VARIANTS joins by its name): Llama untied, Qwen2 with a
# tied embedding (one parameter in both, decayed once) and the two MoE families.
TRAINED = ["llama2-gqa-sharded", "qwen2-bias-tied", "mixtral", "qwen3-moe", "gemma3-windows"]
# Thirty AdamW steps in two frameworks (torch's kernels and XLA's order their float32 sums
# differently), the loss falling smoothly by more than 0.5: what rounding reaches there, measured
# (jax 0.12.0.1, torch 2.13 CPU, x86-64), is a relative loss difference of 2e-7 to 1e-6 per family
# and 5.8e-6 for Mixtral (its router's top-2 choice amplifies the differences), and in the
# gradient norm 3e-7 to 2.7e-5, 1.2e-4 for Mixtral. The tolerances sit 8x or more above those,
# below a wrong decay set (> 1e-3 in the losses, checked below) and a wrong gradient (the norms).
LOSS_RTOL = 1e-4
GRAD_NORM_RTOL = 1e-3


@pytest.fixture(scope="module")
def torch_training(hf, tmp_path_factory):
    """transformers + torch.optim.AdamW on each of TRAINED (hf_reference.py `train`)."""
    root, _ = hf
    out = tmp_path_factory.mktemp("torch") / "training.npz"
    _hf("train", str(out), *[f"{v}={root / v}" for v in TRAINED])
    return dict(np.load(out))


def _adamw_steps(hf_dir, ref: dict, moe: bool) -> tuple[np.ndarray, np.ndarray]:
    """Each step's loss (before its update) and gradient norm of jaxpar training from `hf_dir`'s
    weights with the reference's AdamW (constant lr, no clipping, no decay on norm scales, as
    torch's parameter groups) on its batches, ZeRO-3 on data x fsdp x tensor (expert x fsdp x
    tensor for MoE models)."""
    from jaxpar.training.trainer import build_trainer

    batches = ref["batches"]
    steps, rows, length = batches.shape
    adamw = {k: float(ref[f"adamw/{k}"]) for k in ("lr", "b1", "b2", "eps", "weight_decay")}
    mesh = MOE_MESH if moe else MESH
    cfg = _config(
        hf_dir,
        [
            *[f"optimizer.{k}={v!r}" for k, v in adamw.items()],
            "optimizer.name=adamw",
            "optimizer.warmup_steps=0",
            "optimizer.min_lr_ratio=1.0",  # a constant learning rate
            "optimizer.clip_norm=0",
            f"train.steps={steps}",
            f"train.batch_size={rows}",
            f"train.seq_len={length - 1}",
            # transformers' loss with output_router_logits=False is the cross-entropy alone.
            *(["model.moe.aux_loss_weight=0", "model.moe.z_loss_weight=0"] if moe else []),
            *[f"mesh.{a}={mesh.get(a, 1)}" for a in config_lib.MESH_AXES],
        ],
    )
    devices = int(np.prod(list(mesh.values())))
    trainer = build_trainer(cfg, checks_lib.validate(cfg, devices), jax.devices()[:devices])
    state = base.init_state(trainer, str(hf_dir))
    ones = np.ones((rows, length - 1), np.int32)
    losses, norms = [], []
    for ids in batches.astype(np.int32):
        batch = {
            "inputs": ids[:, :-1],
            "targets": ids[:, 1:],
            "positions": np.cumsum(ones, axis=1) - 1,
            "segment_ids": ones,
            "loss_mask": ones.astype(np.float32),
        }
        state, metrics = trainer.step(state, trainer.shard_batch(batch))
        losses.append(float(metrics["loss"]))
        norms.append(float(metrics["grad_norm"]))
    return np.array(losses), np.array(norms)


@pytest.mark.parametrize("variant", TRAINED)
def test_adamw_steps_from_imported_weights_follow_torch(hf, torch_training, variant):
    root, _ = hf
    ref = torch_training
    want = ref[f"{variant}/losses"]
    assert want[-1] < want[0] - 0.5  # the steps move the loss far past the tolerance
    # The tolerance tells the decay set apart: torch decaying the norm scales too ends elsewhere.
    # Not for Gemma, whose norm weights are scale - 1, near 0: decaying them changes little.
    if not variant.startswith("gemma"):
        assert np.max(np.abs(ref[f"{variant}/losses_decay_all"] / want - 1)) > 10 * LOSS_RTOL
    got, norms = _adamw_steps(root / variant, ref, variant in MOE_VARIANTS)
    norm_error = np.max(np.abs(norms / ref[f"{variant}/grad_norms"] - 1))
    print(
        f"{variant}: max relative loss difference {np.max(np.abs(got / want - 1)):.2e}, norm {norm_error:.2e}"
    )
    np.testing.assert_allclose(got, want, rtol=LOSS_RTOL, atol=0)
    # A gradient scaled wrong (x0.5) leaves AdamW's losses within 4e-6: the norms catch it.
    np.testing.assert_allclose(norms, ref[f"{variant}/grad_norms"], rtol=GRAD_NORM_RTOL, atol=0)


@pytest.fixture(scope="module")
def imported(hf, tmp_path_factory):
    """Every variant through from-hf (run directories), then to-hf (Hugging Face directories)."""
    root, _ = hf
    work = tmp_path_factory.mktemp("converted")
    for variant in VARIANTS:
        summary = convert.from_hf(str(root / variant), str(work / variant / "run"), ["model.dtype=float32"])
        assert summary["dtype"] == json.load(open(root / variant / "config.json"))["dtype"]
        export_lib.export(str(work / variant / "run"), str(work / variant / "hf"))
    return work


def test_qwen3_moe_dense_prefix_matches_transformers_and_round_trips(hf, tmp_path):
    """mlp_only_layers [0] with decoder_sparse_step 1 (model.moe.first_dense = 1: layer 0's MLP
    dense and intermediate_size wide, layer 1's the experts): transformers' logits and expert
    choices on one device and on the expert mesh; to-hf writes the same bytes and the same
    mlp_only_layers back. An import that read the dense layer as an MoE one, or counted the MoE
    layers from 0, fails on the tensors' names before any logit."""
    root, ref = hf
    variant = "qwen3-moe-dense-prefix"
    cfg = _config(root / variant)
    assert (cfg.model.moe.first_dense, cfg.model.moe.every) == (1, 1)
    tokens = jnp.asarray(ref["tokens"], jnp.int32)
    for mesh, copies in (({}, 1), (MOE_MESH, 2)):  # the mesh's four token rows: the two, twice
        layout, shapes, shardings = _on_mesh(cfg, mesh)
        params = hf_load.load_hf_params(str(root / variant), cfg.model, shapes, shardings)
        got, stats = _forward(cfg, layout)(params, jnp.concatenate([tokens] * copies))
        assert _max_diff(got, np.concatenate([ref[f"{variant}/logits"]] * copies)) <= ATOL, mesh
        np.testing.assert_array_equal(stats["expert_load"], copies * ref[f"{variant}/expert_load"])
    convert.from_hf(str(root / variant), str(tmp_path / "run"), ["model.dtype=float32"])
    export_lib.export(str(tmp_path / "run"), str(tmp_path / "hf"))
    assert tensor_bytes(tmp_path / "hf") == tensor_bytes(root / variant)
    written = json.load(open(tmp_path / "hf" / "config.json"))
    assert (written["mlp_only_layers"], written["decoder_sparse_step"]) == ([0], 1)


def test_qwen3_moe_dense_layers_between_moe_ones_match_transformers_and_round_trip(hf, tmp_path):
    """mlp_only_layers [0, 3] with decoder_sparse_step 2 in 6 layers (model.moe.dense_layers:
    dense, MoE, three dense, MoE; an irregular model, its dense and MoE blocks in two stacks run
    in runs of one kind): transformers' logits and expert choices on one device and on the
    expert mesh; to-hf writes the same bytes and the same mlp_only_layers back. An import that
    gave a dense layer an MoE layer's place fails on the tensors' names, runs taken out of
    order on the logits."""
    root, ref = hf
    variant = "qwen3-moe-dense-between"
    cfg = _config(root / variant)
    moe = cfg.model.moe
    assert (moe.first_dense, moe.every, moe.dense_layers, cfg.model.irregular_moe()) == (0, 2, [0, 3], True)
    tokens = jnp.asarray(ref["tokens"], jnp.int32)
    for mesh, copies in (({}, 1), (MOE_MESH, 2)):  # the mesh's four token rows: the two, twice
        layout, shapes, shardings = _on_mesh(cfg, mesh)
        assert shapes["dense_blocks"]["mlp"]["w_gate"].shape == (4, 64, 96)
        params = hf_load.load_hf_params(str(root / variant), cfg.model, shapes, shardings)
        got, stats = _forward(cfg, layout)(params, jnp.concatenate([tokens] * copies))
        assert _max_diff(got, np.concatenate([ref[f"{variant}/logits"]] * copies)) <= ATOL, mesh
        np.testing.assert_array_equal(stats["expert_load"], copies * ref[f"{variant}/expert_load"])
    convert.from_hf(str(root / variant), str(tmp_path / "run"), ["model.dtype=float32"])
    export_lib.export(str(tmp_path / "run"), str(tmp_path / "hf"))
    assert tensor_bytes(tmp_path / "hf") == tensor_bytes(root / variant)
    written = json.load(open(tmp_path / "hf" / "config.json"))
    assert (written["mlp_only_layers"], written["decoder_sparse_step"]) == ([0, 3], 2)


def test_round_trip_is_bit_identical_and_transformers_loads_the_export(hf, imported, tmp_path):
    root, ref = hf
    for variant in VARIANTS:
        source, back = tensor_bytes(root / variant), tensor_bytes(imported / variant / "hf")
        assert set(back) == set(source), variant
        for name in source:
            assert back[name] == source[name], f"{variant}: {name}"
        assert os.path.isfile(imported / variant / "hf" / "tokenizer.json")
    _hf("logits", str(tmp_path / "exported.npz"), *[f"{v}={imported / v / 'hf'}" for v in VARIANTS])
    exported = np.load(tmp_path / "exported.npz")
    for variant in VARIANTS:
        assert str(exported[f"{variant}/class"]) == EXPORTED_AS[variant]
        assert _max_diff(exported[f"{variant}/logits"], ref[f"{variant}/logits"]) <= 1e-5, variant


def test_sample_cli_generates_from_an_imported_model(imported):
    from jaxpar.corpus.documents import HFTokenizer

    run = imported / "llama2-gqa-sharded" / "run"  # its tokenizer ends documents with </s>
    cfg = config_lib.load_config(str(run / "config.yaml"))
    assert cfg.data.tokenizer == str(run / "tokenizer.json")
    proc = subprocess.run(
        [sys.executable, "-m", "jaxpar.sample", str(run), "--prompt", "the quick", "--max-tokens", "12"],
        capture_output=True,
        cwd=ROOT,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr.decode()[-2000:]
    tokenizer = HFTokenizer(cfg.data.tokenizer)
    assert tokenizer.eod_id == tokenizer._tok.token_to_id("</s>")
    from jaxpar.sample import load_model

    _, model, step = load_model(str(run))
    assert step == 0
    ids = generate(
        model,
        tokenizer.encode("the quick"),
        12,
        vocab_limit=tokenizer.vocab_size,
        stop_token=tokenizer.eod_id,
    )
    assert proc.stdout.decode() == "the quick" + tokenizer.decode(ids) + "\n"


def test_init_from_starts_a_new_run_on_a_mesh_from_the_imported_weights(imported, tmp_path):
    from jaxpar.run import train as train_lib
    from jaxpar.training.checkpoint import Checkpointer, checkpoint_dir

    source = imported / "llama3-tied-scaled" / "run"  # bfloat16 weights, llama3 rope scaling
    text = tmp_path / "text.txt"
    text.write_text("the quick brown fox jumps over the lazy dog\n" * 200)
    settings = config_lib.user_settings(
        os.path.join(ROOT, "configs", "finetune.yaml"),
        [
            f"train.init_from={source}",
            f"train.run_dir={tmp_path / 'run'}",
            f"data.source={text}",
            "train.steps=2",
            "train.batch_size=4",
            "train.seq_len=32",
            "checkpoint.every=2",
            "optimizer.lr=1e-6",
            "optimizer.warmup_steps=0",
            "train.progress=false",
            "model.dtype=float32",
            "mesh.data=2",
            "mesh.fsdp=2",
            "mesh.tensor=2",
        ],
    )
    cfg = convert.apply_init_from(config_lib.build_config(settings), settings)
    assert cfg.model.rope_scaling.type == "llama3" and cfg.model.tie_embeddings
    assert cfg.model.param_dtype == "float32"  # the run's own: the bfloat16 import is upcast
    assert cfg.data.tokenizer == str(source / "tokenizer.json")
    summary = train_lib.train(cfg, checks_lib.validate(cfg, 8))
    assert summary["start_step"] == 0 and summary["steps"] == 2

    def params_of(run, cfg):
        shapes, _ = convert.param_targets(cfg, {a: 1 for a in config_lib.MESH_AXES}, jax.devices()[:1])
        ckpt = Checkpointer(checkpoint_dir(str(run)), read_only=True)
        try:
            return ckpt.restore({"params": shapes}, None)[0]["params"]
        finally:
            ckpt.close()

    before, after = params_of(source, cfg), params_of(tmp_path / "run", cfg)
    for path, (a, b) in families.flatten(
        jax.tree.map(lambda *x: x, before, after, is_leaf=lambda x: hasattr(x, "shape"))
    ).items():
        # Two AdamW steps at lr 1e-6 move each weight by about 2e-6; a fresh init would differ by O(0.3).
        assert _max_diff(a, b) < 1e-4, path


def test_init_from_takes_the_shape_and_refuses_a_disagreeing_one(hf):
    root, _ = hf
    cfg = _config(root / "qwen2-bias-tied")
    assert (cfg.model.qkv_bias, cfg.model.tie_embeddings, cfg.model.rope_theta) == (True, True, 1e6)
    with pytest.raises(config_lib.ConfigError, match=r"model.d_model=128, but .* has model.d_model=64"):
        _config(root / "qwen2-bias-tied", ["model.d_model=128"])


def _edit_json(path, **changes):
    config = json.load(open(path))
    config.update(changes)
    json.dump(config, open(path, "w"))


def _truncate(path, by: int = 100):
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) - by)


def _put_nan(directory, name: str = "model.layers.1.mlp.down_proj.weight", at: int = 77):
    """Writes a NaN over element `at` of tensor `name` of the checkpoint in `directory`."""
    info = hf_load.checkpoint_tensors(str(directory))[name]
    dtype = hf_load._np_dtype(info.dtype)
    with open(info.file, "r+b") as f:
        f.seek(info.offset + at * dtype.itemsize)
        f.write(np.array([np.nan], dtype=dtype).tobytes())


BAD = {  # case -> (variant, how to break the copy, what the message must name)
    "NaN in a tensor": (
        "llama2-gqa-sharded",
        _put_nan,
        [
            (
                "tensor model.layers.1.mlp.down_proj.weight holds 1 non-finite value(s), "
                "the first nan in row 0"
            ),
            "import an intact checkpoint",
        ],
    ),
    "missing shard": (
        "llama2-gqa-sharded",
        lambda d: os.remove(d / "model-00003-of-00007.safetensors"),
        ["model-00003-of-00007.safetensors is missing", "tensor model."],
    ),
    "truncated file": (
        "mistral",
        lambda d: _truncate(d / "model.safetensors"),
        ["model.safetensors is truncated: tensor ", "ends at byte"],
    ),
    "shape vs config.json": (
        "qwen2-bias-tied",
        lambda d: _edit_json(d / "config.json", intermediate_size=128),
        [
            "model.safetensors: tensor model.layers.0.mlp.",
            "has shape [96, 64]",
            "config.json implies [128, 64]",
        ],
    ),
    "missing tokenizer": ("mistral", lambda d: os.remove(d / "tokenizer.json"), ["has no tokenizer.json"]),
    "unsupported architecture": (
        "mistral",
        lambda d: _edit_json(d / "config.json", architectures=["GemmaForCausalLM"]),
        ["config.json: architectures=['GemmaForCausalLM'] is not supported"],
    ),
    "sliding window": (
        "mistral",
        lambda d: _edit_json(d / "config.json", sliding_window=16),
        ["sliding_window=16 < max_position_embeddings=128"],
    ),
    "mixtral top-1": (
        "mixtral",
        lambda d: _edit_json(d / "config.json", num_experts_per_tok=1),
        ["num_experts_per_tok=1: top-1 Mixtral routing"],
    ),
    "qwen3-moe no layer left with experts": (
        "qwen3-moe",
        lambda d: _edit_json(d / "config.json", mlp_only_layers=[1]),
        ["mlp_only_layers=[1] with decoder_sparse_step=2 leaves none of the 2 layers with experts"],
    ),
    "qwen3 attention biases": (
        "qwen3-wide-heads",
        lambda d: _edit_json(d / "config.json", attention_bias=True),
        ["attention_bias=True, jaxpar has False"],
    ),
    "unknown rope scaling": (
        "llama3-tied-scaled",
        lambda d: _edit_json(
            d / "config.json", rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}
        ),
        ["rope scaling 'yarn'"],
    ),
}


@pytest.mark.parametrize("case", BAD)
def test_bad_input_exits_2_naming_file_and_tensor_and_writes_nothing(hf, tmp_path, capsys, case):
    root, _ = hf
    variant, damage, fragments = BAD[case]
    broken = tmp_path / "broken"
    shutil.copytree(root / variant, broken)
    damage(broken)
    out = tmp_path / "out" / "run"
    out.parent.mkdir()
    assert convert.main(["from-hf", str(broken), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("config error: ") and err.count("\n") == 1, err
    for fragment in fragments:
        assert fragment in err, (fragment, err)
    assert os.listdir(out.parent) == []  # no output directory, nothing half-written beside it


FAMILY_CASES = {  # ModelConfig changes covering every branch of each family's table and config
    "llama-gqa-untied": {},
    "llama3-tied-scaled": {
        "tie_embeddings": True,
        "rope_theta": 5e5,
        "param_dtype": "bfloat16",
        "rope_scaling": config_lib.RopeScalingConfig(type="llama3", factor=32.0),
    },
    "qwen2-bias": {"qkv_bias": True, "n_kv_heads": 4, "norm_eps": 1e-6, "init_std": 0.01},
    "qwen3-wide-heads": {"qk_norm": True, "head_dim": 48, "tie_embeddings": True},
    "mixtral": {"moe": config_lib.MoEConfig(num_experts=4, top_k=2, z_loss_weight=0.0, aux_loss_weight=0.02)},
    "qwen3-moe-grouped": {
        "qk_norm": True,
        "head_dim": 16,
        "n_layers": 4,
        "moe": config_lib.MoEConfig(
            num_experts=4, top_k=2, every=2, d_ff=40, norm_topk=False, z_loss_weight=0.0
        ),
    },
    "qwen3-moe-dense-prefix": {
        "qk_norm": True,
        "moe": config_lib.MoEConfig(num_experts=4, top_k=2, first_dense=2, d_ff=40, z_loss_weight=0.0),
    },
    "qwen3-moe-dense-between": {  # 3 layers: MoE, dense, MoE (mlp_only_layers [1])
        "qk_norm": True,
        "moe": config_lib.MoEConfig(num_experts=4, top_k=2, dense_layers=[1], d_ff=40, z_loss_weight=0.0),
    },
    "deepseek-v3-moe-dense-prefix": {
        "n_kv_heads": 4,
        "mla": config_lib.MLAConfig(kv_lora_rank=16, qk_nope_dim=8, qk_rope_dim=8, v_head_dim=8),
        "moe": config_lib.MoEConfig(
            num_experts=4,
            top_k=2,
            first_dense=1,
            d_ff=24,
            score="sigmoid",
            aux_loss_weight=0.0,
            z_loss_weight=0.0,
        ),
    },
    "gemma3-windows": {
        "qk_norm": True,
        "head_dim": 24,
        "tie_embeddings": True,
        "mlp_activation": "gelu_tanh",
        "embed_scale": True,
        "norm_offset": True,
        "post_norms": True,
        "attn_scale_dim": 20.0,
        "sliding_window": 4,
        "global_every": 3,
        "rope_theta": 1e6,
        "rope_local_theta": 1e4,
        "rope_scaling": config_lib.RopeScalingConfig(type="linear", factor=8.0),
    },
    "gemma3-one-rotary-no-window": {
        "qk_norm": True,
        "tie_embeddings": True,
        "mlp_activation": "gelu_tanh",
        "embed_scale": True,
        "norm_offset": True,
        "post_norms": True,
        "rope_scaling": config_lib.RopeScalingConfig(type="linear", factor=4.0),
    },
    "deepseek-v3-dense-qlora-yarn": {
        "n_kv_heads": 4,
        "mla": config_lib.MLAConfig(
            kv_lora_rank=16, q_lora_rank=12, qk_nope_dim=8, qk_rope_dim=8, v_head_dim=12, rope_interleave=True
        ),
        "rope_scaling": config_lib.RopeScalingConfig(
            type="yarn", factor=4.0, original_max_len=512, mscale=1.0, mscale_all_dim=0.5
        ),
    },
    "deepseek-v3-moe-groups": {
        "n_kv_heads": 4,
        "mla": config_lib.MLAConfig(kv_lora_rank=16, qk_nope_dim=8, qk_rope_dim=8, v_head_dim=8),
        "moe": config_lib.MoEConfig(
            num_experts=8,
            top_k=2,
            shared_experts=1,
            d_ff=24,
            score="sigmoid",
            groups=2,
            topk_groups=1,
            routed_scale=2.5,
            aux_loss_weight=0.0,
            z_loss_weight=0.0,
        ),
    },
}
FAMILY_OF_CASE = {
    "llama-gqa-untied": "llama",
    "llama3-tied-scaled": "llama",
    "qwen2-bias": "llama",
    "qwen3-wide-heads": "qwen3",
    "mixtral": "mixtral",
    "qwen3-moe-grouped": "qwen3_moe",
    "qwen3-moe-dense-prefix": "qwen3_moe",
    "qwen3-moe-dense-between": "qwen3_moe",
    "deepseek-v3-moe-dense-prefix": "deepseek_v3",
    "gemma3-windows": "gemma3",
    "gemma3-one-rotary-no-window": "gemma3",
    "deepseek-v3-dense-qlora-yarn": "deepseek_v3",
    "deepseek-v3-moe-groups": "deepseek_v3",
}


def test_a_model_no_family_writes_is_refused_by_name():
    m = config_lib.ModelConfig(moe=config_lib.MoEConfig(num_experts=4, shared_experts=1))
    with pytest.raises(config_lib.ConfigError, match="moe.shared_experts=1"):
        families.hf_config(m)


def test_every_family_has_a_round_trip_case():
    registered = {family.__name__.rsplit(".", 1)[-1] for family in families.FAMILIES}
    assert set(FAMILY_OF_CASE.values()) == registered


@pytest.mark.parametrize("case", FAMILY_CASES)
def test_the_family_reads_back_what_it_writes(case):
    """One table and one config mapping per family, used both ways (jaxpar.models.families):
    config.json written from a model gives back its settings, and every tensor written, read back
    shard by shard as the import reads it, gives back the parameter. No transformers needed."""
    m = dataclasses.replace(config_lib.ModelConfig(n_layers=3), **FAMILY_CASES[case])
    family = families.family_of_model(m)
    assert family.__name__.endswith("." + FAMILY_OF_CASE[case])
    settings = families.settings_from_hf(families.hf_config(m), "config.json")
    back = config_lib.build_config({"model": settings}).model
    assert back == m  # every setting config.json carries, and the defaults for the rest

    shapes = nnx.to_pure_dict(nnx.state(nnx.eval_shape(lambda: Transformer(m, rngs=nnx.Rngs(0)))))
    rng = np.random.default_rng(0)
    params = {
        path: rng.standard_normal(s.shape).astype(np.float32) for path, s in families.flatten(shapes).items()
    }
    tensors = families.hf_tensors(params, m)
    assert {name: t.shape for name, t in tensors.items()} == hf_load.expected_tensors(m)
    for path, t in families.tensor_table(m).items():
        for index, _, name in t.instances(m.n_layers):
            hf = tensors[name]
            want = params[path][index] if index else params[path]

            def rows(r0, r1, cols=None, hf=hf):
                return hf[r0:r1] if cols is None else hf[r0:r1, cols]

            # The second half of every even axis: a shard as a mesh would ask for it.
            idx = tuple(slice(d // 2, d) if d % 2 == 0 else slice(None) for d in want.shape)
            np.testing.assert_array_equal(t.layout.read(rows, idx, want.shape), want[idx])


LORA_VARIANTS = ["llama2-gqa-sharded", "qwen3-wide-heads"]  # Llama's projections; Qwen3's, with q/k norms


def _lora_run(hf_dir, run_dir) -> tuple:
    """A LoRA run directory over the Hugging Face model `hf_dir` (train.init_from), its
    checkpoint 0 the adapters (random A and B on every projection) over the base's weights
    (`base.init_state`), stored as a LoRA run stores them: the adapters alone, naming the base;
    returns (config, the adapted params on one device)."""
    from jaxpar.training.checkpoint import Checkpointer, checkpoint_dir
    from jaxpar.training.trainer import build_trainer

    lora = ["finetune.lora.rank=4", "finetune.lora.alpha=8", "finetune.lora.targets=[q,k,v,o,gate,up,down]"]
    cfg = dataclasses.replace(
        _config(hf_dir, lora), train=dataclasses.replace(_config(hf_dir).train, run_dir=str(run_dir))
    )
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, init_from=str(hf_dir)))
    sizes = {a: 1 for a in config_lib.MESH_AXES}
    trainer = build_trainer(cfg, sizes, devices=jax.devices()[:1])
    state = jax.device_get(base.init_state(trainer, str(hf_dir)))
    rng = np.random.default_rng(3)
    params = jax.tree_util.tree_map_with_path(
        lambda p, x: (
            rng.normal(0, 0.05, x.shape).astype(x.dtype) if "lora_b" in jax.tree_util.keystr(p) else x
        ),
        state["params"],
    )
    os.makedirs(run_dir)
    config_lib.dump_yaml(cfg, str(run_dir / "config.yaml"))
    ckpt = Checkpointer(checkpoint_dir(str(run_dir)), keep=1)
    try:
        ckpt.save(0, trainer.stored({"params": params}), base.record(cfg), force=True)
    finally:
        ckpt.close()
    return cfg, params


def test_lora_exports_a_merged_model_and_a_peft_adapter_transformers_runs(hf, tmp_path):
    """(b) the merged export, read back by jaxpar, gives the adapted model's logits; (c) the PEFT
    adapter over the base model in transformers + peft gives them too."""
    from jaxpar.training.trainer import new_model

    root, ref = hf
    tokens = jnp.asarray(ref["tokens"], jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
    adapted, pairs = {}, []
    for variant in LORA_VARIANTS:
        run, merged_dir, adapter_dir = (tmp_path / variant / d for d in ("run", "merged", "adapter"))
        cfg, params = _lora_run(root / variant, run)
        graphdef = nnx.graphdef(nnx.eval_shape(lambda: new_model(cfg)))
        adapted[variant] = np.asarray(
            nnx.merge(graphdef, params)(tokens, positions, jnp.ones_like(tokens))[0]
        )
        export_lib.export(str(run), str(merged_dir))
        export_lib.export(str(run), str(adapter_dir), adapter_only=True)
        layout, shapes, shardings = _on_mesh(cfg, {})
        merged = hf_load.load_hf_params(str(merged_dir), cfg.model, shapes, shardings)
        got = _forward(cfg, layout)(merged, tokens)[0]
        # float32 sums in another order (W + s A B formed first): 1e-5 of the largest logit
        assert _max_diff(got, adapted[variant]) <= 1e-5 * np.max(np.abs(adapted[variant])), variant
        settings = json.load(open(adapter_dir / "adapter_config.json"))
        assert settings["r"] == 4 and settings["lora_alpha"] == 8 and settings["peft_type"] == "LORA"
        assert settings["base_model_name_or_path"] == str(root / variant)
        assert sorted(settings["target_modules"]) == sorted(
            f"{m}_proj" for m in ("q", "k", "v", "o", "gate", "up", "down")
        )
        pairs.append(f"{variant}={root / variant},{adapter_dir}")
    _hf("peft", str(tmp_path / "peft.npz"), *pairs)
    hf_logits = np.load(tmp_path / "peft.npz")
    for variant in LORA_VARIANTS:
        assert _max_diff(hf_logits[f"{variant}/base_logits"], ref[f"{variant}/logits"]) <= ATOL
        assert _max_diff(hf_logits[f"{variant}/logits"], adapted[variant]) <= ATOL, variant
        # The adapters matter: the same check fails against the base model's logits.
        assert _max_diff(hf_logits[f"{variant}/base_logits"], adapted[variant]) > 100 * ATOL, variant
