"""The Hugging Face bridge fails safe (jaxpar.export, jaxpar.convert, jaxpar.hf.hf_load,
jaxpar.models.families): no export mixed with another's files, no config.json value read as
something else, no traceback for a malformed file or a full disk.

The models are tiny random Llamas written by jaxpar's own exporter functions (tests/test_hub.py's
`_tiny_hf`, no torch): one in a single file, one in shards with an index. Everything runs in this
process: the commands' `main` functions, with their exit codes and their stderr.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import stat

import pytest

from jaxpar import config as config_lib
from jaxpar.config import ConfigError
from jaxpar.hf import convert, hf_load
from jaxpar.hf import export as export_lib
from jaxpar.models.families import registry as families
from tests.test_hub import _tiny_hf


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(root, run): root/single and root/sharded, Hugging Face directories of one tiny Llama,
    and run, that model imported by from-hf."""
    root = tmp_path_factory.mktemp("failsafe")
    _tiny_hf(root / "single", seed=1, max_shard_bytes=10**9)
    _tiny_hf(root / "sharded", seed=1, max_shard_bytes=20_000)
    convert.from_hf(str(root / "single"), str(root / "run"))
    return root, root / "run"


def _one_line(capsys, prefix: str) -> str:
    err = capsys.readouterr().err
    assert err.startswith(prefix) and err.count("\n") == 1, err
    return err


def _contents(directory) -> dict[str, bytes]:
    """Every file under `directory` (by its path in it) -> its bytes."""
    out = {}
    for parent, _, files in os.walk(directory):
        for name in files:
            path = os.path.join(parent, name)
            with open(path, "rb") as f:
                out[os.path.relpath(path, directory)] = f.read()
    return out


# --- to-hf --out -----------------------------------------------------------------------------


def test_a_second_export_into_its_own_previous_export_leaves_exactly_the_new_one(tiny, tmp_path):
    """Guards the bug where a re-export into the same --out left the first export's index and
    shards beside the new model.safetensors: from-hf then read the old weights, transformers
    the new file."""
    _, run = tiny
    out = tmp_path / "hf"
    export_lib.export(str(run), str(out), max_shard_bytes=20_000)
    assert (out / "model.safetensors.index.json").exists()
    export_lib.export(str(run), str(out))
    assert sorted(os.listdir(out)) == [
        "config.json",
        export_lib.EXPORT_RECORD,
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    assert os.listdir(tmp_path) == ["hf"]  # nothing left beside it
    tensors = hf_load.checkpoint_tensors(str(out))
    assert {info.file for info in tensors.values()} == {str(out / "model.safetensors")}
    # Built in a temporary directory, the export was left 0700 with model.safetensors 0600:
    # unreadable to every other user. It has the modes mkdir and open give.
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE(os.stat(out).st_mode) == 0o777 & ~umask
    assert {stat.S_IMODE(os.stat(out / f).st_mode) for f in os.listdir(out)} == {0o666 & ~umask}


def _previous_model_export(tiny, out) -> None:
    export_lib.export(str(tiny[1]), str(out))


def _another_model(tiny, out) -> None:
    shutil.copytree(tiny[0] / "sharded", out)


def _an_added_file(tiny, out) -> None:
    export_lib.export(str(tiny[1]), str(out))
    (out / "README.md").write_text("mine")


TO_HF_REFUSED = {  # case -> (what --out holds, to-hf's extra arguments, what the line names)
    "another Hugging Face model": (_another_model, [], ["is not a jaxpar export", "new or empty directory"]),
    "a run directory": (lambda tiny, out: shutil.copytree(tiny[1], out), [], ["config.yaml", "not a jaxpar"]),
    "a model export, for an adapter": (_previous_model_export, ["--adapter-only"], ["PEFT adapter"]),
    "a file added to an export": (_an_added_file, [], ["README.md", "did not write"]),
}


@pytest.mark.parametrize("case", TO_HF_REFUSED)
def test_to_hf_refuses_an_out_that_holds_something_else_and_writes_nothing(tiny, tmp_path, capsys, case):
    """Guards the bug where to-hf into a directory holding another Hugging Face model wrote its
    config.json and tokenizer over the model's and left that model's shards: a mix of two."""
    hold, extra, fragments = TO_HF_REFUSED[case]
    out = tmp_path / "out"
    hold(tiny, out)
    before = _contents(out)
    capsys.readouterr()
    assert export_lib.main([str(tiny[1]), "--out", str(out), *extra]) == 2
    err = _one_line(capsys, f"config error: --out {out} ")
    for fragment in fragments:
        assert fragment in err, (fragment, err)
    assert _contents(out) == before
    assert os.listdir(tmp_path) == ["out"]


def _no_space(monkeypatch, after: int = 0) -> None:
    """safetensors' save_file writes part of its file, then meets a full disk; `after` files
    are written whole first."""
    import safetensors.numpy

    calls = []

    def save_file(tensors, filename, metadata=None):
        calls.append(filename)
        with open(filename, "wb") as f:
            f.write(b"\0" * 100)
        if len(calls) > after:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), filename)

    monkeypatch.setattr(safetensors.numpy, "save_file", save_file)


@pytest.mark.parametrize("previous", [False, True])
def test_a_full_disk_on_to_hf_is_one_line_and_leaves_out_as_it_was(
    tiny, tmp_path, monkeypatch, capsys, previous
):
    """Guards the traceback a full disk gave (an OSError out of safetensors), and the export it
    left half written in --out: config.json-less shards, or a previous export partly
    overwritten. Now: one line naming the path, exit 1, --out as it was."""
    out = tmp_path / "hf"
    if previous:
        export_lib.export(str(tiny[1]), str(out), max_shard_bytes=20_000)
    before = _contents(out) if previous else None
    _no_space(monkeypatch, after=1)
    capsys.readouterr()
    assert export_lib.main([str(tiny[1]), "--out", str(out), "--max-shard-bytes", "20000"]) == 1
    err = _one_line(capsys, "error: to-hf could not write ")
    assert f"{out}/model-00002-of-00007.safetensors" in err and "no space left" in err, err
    assert (_contents(out) if previous else None) == before
    assert os.listdir(tmp_path) == (["hf"] if previous else [])


def test_a_full_disk_on_from_hf_is_one_line_and_leaves_no_run(tiny, tmp_path, monkeypatch, capsys):
    """Guards the traceback from-hf gave when a write into its new run directory failed."""

    def dump_yaml(cfg, path):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)

    monkeypatch.setattr(config_lib, "dump_yaml", dump_yaml)
    out = tmp_path / "run"
    capsys.readouterr()
    assert convert.main(["from-hf", str(tiny[0] / "single"), "--out", str(out)]) == 1
    err = _one_line(capsys, f"error: from-hf could not write {out}/config.yaml: no space left")
    assert f"{out} is as it was" in err, err
    assert os.listdir(tmp_path) == []


# --- config.json -----------------------------------------------------------------------------

LLAMA = config_lib.ModelConfig(n_layers=2)
MIXTRAL = config_lib.ModelConfig(
    n_layers=2, moe=config_lib.MoEConfig(num_experts=4, top_k=2, z_loss_weight=0.0)
)
QWEN3_MOE = config_lib.ModelConfig(
    n_layers=2,
    qk_norm=True,
    moe=config_lib.MoEConfig(num_experts=4, top_k=2, norm_topk=False, z_loss_weight=0.0),
)
CONFIG_REFUSED = {  # case -> (model, config.json changes, what the message names)
    "no context": (LLAMA, {"max_position_embeddings": 0}, ["max_position_embeddings=0", "at least 1"]),
    "a fractional width": (LLAMA, {"hidden_size": 512.5}, ["hidden_size=512.5", "whole number"]),
    "a string for a flag": (LLAMA, {"tie_word_embeddings": "false"}, ['tie_word_embeddings="false"']),
    "a string for a number": (LLAMA, {"rms_norm_eps": "1e-5"}, ['rms_norm_eps="1e-5"', "finite number"]),
    "no rotary base": (LLAMA, {"rope_theta": 0}, ["rope_theta=0", "above 0"]),
    "no head width": (LLAMA, {"head_dim": 0}, ["head_dim=0"]),
    "a scaling without its factor": (
        LLAMA,
        {"rope_scaling": {"rope_type": "linear"}},
        ["without its factor"],
    ),
    "a scaling that is a string": (LLAMA, {"rope_scaling": "linear"}, ['rope_scaling="linear"', "an object"]),
    "a width left out": (LLAMA, {"hidden_size": None}, ["hidden_size is not set"]),
    "two architectures": (
        LLAMA,
        {"architectures": ["LlamaForCausalLM", "MistralForCausalLM"]},
        ["lists one model class"],
    ),
    "more experts per token than experts": (
        MIXTRAL,
        {"num_experts_per_tok": 5},
        ["num_experts_per_tok=5 is more than the num_local_experts=4"],
    ),
    "no experts per token": (QWEN3_MOE, {"num_experts_per_tok": 0}, ["num_experts_per_tok=0"]),
    "more experts per token than Qwen3-MoE's experts": (
        QWEN3_MOE,
        {"num_experts_per_tok": 8},
        ["num_experts_per_tok=8 is more than the num_local_experts=4"],
    ),
}


@pytest.mark.parametrize("case", CONFIG_REFUSED)
def test_a_config_json_value_jaxpar_would_misread_is_refused_by_key_and_value(case):
    """Guards imports that went through with max_position_embeddings 0, top-k above the expert
    count, 512.5 read as 512, the string "false" read as true, and others; and the tracebacks
    of a string where a number or an object belongs."""
    model, changes, fragments = CONFIG_REFUSED[case]
    hf = {**families.hf_config(model), **changes}
    with pytest.raises(ConfigError) as err:
        families.settings_from_hf(hf, "/models/x/config.json")
    assert str(err.value).startswith("/models/x/config.json: "), str(err.value)
    for fragment in fragments:
        assert fragment in str(err.value), (fragment, str(err.value))


def test_architectures_given_as_a_string_is_that_one_architecture():
    """Guards the message that called `"architectures": "LlamaForCausalLM"` unsupported (it read
    the string's first letter)."""
    hf = families.hf_config(LLAMA)
    assert families.settings_from_hf({**hf, "architectures": "LlamaForCausalLM"}, "config.json") == (
        families.settings_from_hf(hf, "config.json")
    )


def test_from_hf_refuses_a_config_json_value_with_one_line_and_writes_nothing(tiny, tmp_path, capsys):
    broken = tmp_path / "broken"
    shutil.copytree(tiny[0] / "single", broken)
    config = json.loads((broken / "config.json").read_text())
    (broken / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 0}))
    (tmp_path / "out").mkdir()
    capsys.readouterr()
    assert convert.main(["from-hf", str(broken), "--out", str(tmp_path / "out" / "run")]) == 2
    err = _one_line(capsys, f"config error: {broken}/config.json: max_position_embeddings=0 ")
    assert os.listdir(tmp_path / "out") == [], err


# --- safetensors headers and the index ---------------------------------------------------------


def _rewrite_header(directory, change) -> None:
    """model.safetensors in `directory` with its header passed through `change` (the header,
    its first tensor's name) -> the new header."""
    path = directory / "model.safetensors"
    data = path.read_bytes()
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + n])
    first = next(name for name in header if name != "__metadata__")
    new = json.dumps(change(header, first)).encode()
    path.write_bytes(len(new).to_bytes(8, "little") + new + data[8 + n :])


def _entry(**changes):
    def change(header, first):
        header[first] = {**header[first], **changes}
        return {k: v for k, v in header.items() if not (k == first and v is None)}

    return change


def _before_the_data(header, first):
    """The first tensor's offsets 8 bytes earlier, its size kept: its first bytes would be the
    header's last."""
    start, end = header[first]["data_offsets"]
    header[first]["data_offsets"] = [start - 8, end - 8]
    return header


def _overlap(header, first):
    second = next(name for name in header if name not in ("__metadata__", first))
    start = header[second]["data_offsets"][0]
    size = header[first]["data_offsets"][1] - header[first]["data_offsets"][0]
    header[first]["data_offsets"] = [start, start + size]
    return header


HEADERS = {  # case -> (the change, what the message names)
    "a list": (lambda header, first: [1, 2], ["header is not a JSON object"]),
    "an entry that is a list": (lambda header, first: {**header, first: [1]}, ["is not an object"]),
    "no offsets": (_entry(data_offsets=None), ["data_offsets=None"]),
    "a negative offset": (_before_the_data, ["data_offsets=[-8, "]),
    "three offsets": (_entry(data_offsets=[0, 1, 2]), ["data_offsets=[0, 1, 2]"]),
    "a string shape": (_entry(shape="abc"), ["shape='abc'"]),
    "overlapping tensors": (_overlap, ["overlap"]),
}


@pytest.mark.parametrize("case", HEADERS)
def test_a_malformed_safetensors_header_is_refused_by_file_and_tensor(tiny, tmp_path, case):
    """Guards the tracebacks (KeyError, TypeError, AttributeError) such headers gave, and the
    negative offset that was read, header bytes and all, as weights."""
    change, fragments = HEADERS[case]
    broken = tmp_path / "broken"
    shutil.copytree(tiny[0] / "single", broken)
    _rewrite_header(broken, change)
    with pytest.raises(ConfigError) as err:
        hf_load.checkpoint_tensors(str(broken))
    assert str(err.value).startswith(f"{broken}/model.safetensors"), str(err.value)
    for fragment in fragments:
        assert fragment in str(err.value), (fragment, str(err.value))


WEIGHT_MAPS = {  # model.safetensors.index.json's weight_map -> what the message names
    "a list": ([1, 2], "weight_map=[1, 2] is not an object"),
    "a list for a file": (
        {"model.embed_tokens.weight": ["a"]},
        "weight_map['model.embed_tokens.weight']=['a']",
    ),
    "a number for a file": ({"model.norm.weight": 3}, "weight_map['model.norm.weight']=3"),
    "a path out of the directory": ({"model.norm.weight": "../single/model.safetensors"}, "beside the index"),
}


@pytest.mark.parametrize("case", WEIGHT_MAPS)
def test_a_malformed_index_is_refused_by_entry(tiny, tmp_path, capsys, case):
    """Guards the tracebacks a weight_map that is not {tensor: file name} gave, on from-hf and
    train.init_from alike (both read the files with `hf_load.checkpoint_tensors`)."""
    weight_map, fragment = WEIGHT_MAPS[case]
    broken = tmp_path / "broken"
    shutil.copytree(tiny[0] / "sharded", broken)
    (broken / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    capsys.readouterr()
    assert convert.main(["from-hf", str(broken), "--out", str(tmp_path / "run")]) == 2
    err = _one_line(capsys, f"config error: {broken}/model.safetensors.index.json: ")
    assert fragment in err, err
    assert not (tmp_path / "run").exists()
