"""Hugging Face checkpoints in and out of jaxpar.

    python -m jaxpar.convert from-hf HF_DIR|ORG/NAME [--revision REV] --out RUN_DIR [dotted.key=value ...]
    python -m jaxpar.convert to-hf RUN_DIR --out HF_DIR [--max-shard-bytes N] [--step N]

`from-hf` reads a Hugging Face model directory -- `config.json`, `model.safetensors` (or shards
listed by `model.safetensors.index.json`) and `tokenizer.json` -- a local one, or a Hub model id
ORG/NAME at a revision resolved through huggingface_hub's cache (`jaxpar.hf.hub.model_dir`, which
says where a name is looked for and what is fetched), and writes a jaxpar run
directory: `config.yaml` with the model's shape (the overrides apply on top; a shape setting that
disagrees with the checkpoint is refused), `checkpoints/0` holding the parameters alone, and the
tokenizer (`tokenizer.json`, and `tokenizer_config.json` when there is one: it names the
end-of-document token). Parameters keep the checkpoint's dtype (config.json's `dtype` /
`torch_dtype`: float32, bfloat16 or float16), so `to-hf` gives back the same bytes. `to-hf` is
`python -m jaxpar.export` (which stays as an alias).

What converts: the families of `jaxpar.models.families`, one file each (config.json both ways and
one table of tensors, which `to-hf` writes with as well): Llama (`LlamaForCausalLM`: Llama 2, 3,
3.1, 3.2, TinyLlama; `MistralForCausalLM`; `Qwen2ForCausalLM`), Qwen3, Mixtral, Qwen3-MoE and Gemma
3. What a family cannot represent is refused by name with exit 2 and nothing written: another
architecture, a rope scaling other than llama3 or linear, biases jaxpar lacks, and what each family
file lists (an activation other than the family's, a sliding window outside Gemma 3). The checkpoint
is checked before anything is written: every tensor the config implies present with its shape,
nothing unknown, every byte inside its file; and as it is read, every value finite (a NaN or
infinity names the tensor, and the output is removed).

Loading is sharded, one tensor at a time. `hf_load.load_hf_params` places each parameter with
`jax.make_array_from_callback` onto its sharding on the target mesh; for each device's shard the
callback reads (`os.pread`) only the rows of the Hugging Face tensor(s) that shard covers, one
layer at a time, and converts them (reshape, transpose, cast), reading READ_BYTES at a time.
Beyond what the devices keep, the host holds one device's shard of one parameter (twice where it
is transposed) and one read; never the model. No file is memory-mapped.

`train.init_from=DIR` (a run directory, a Hugging Face directory, or a Hub model id ORG/NAME at its
default branch) starts a run from such weights on any mesh: `apply_init_from` resolves DIR to a
local directory (recorded as train.init_from), takes the model's shape and tokenizer from it before
the config is validated, `jaxpar.hf.base.init_state` loads the weights onto the run's shardings and
adds a fresh optimizer state at step 0. With finetune.lora those weights are the frozen base and the
adapters start fresh (B = 0: step 0 computes the base model). The reading of Hugging Face
directories lives in `jaxpar.hf.hf_load`.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import shutil
import sys

import numpy as np

from jaxpar import checks as checks_lib
from jaxpar import cli
from jaxpar import config as config_lib
from jaxpar.config import ConfigError, ModelConfig
from jaxpar.corpus import chat
from jaxpar.hf import export, hub
from jaxpar.hf.hf_load import (
    check_tensors,
    checkpoint_tensors,
    expected_tensors,
    hf_model_config,
    load_hf_params,
)
from jaxpar.training import checkpoint as checkpoint_lib

# The model settings that decide the weights or what the network computes: taken from the
# checkpoint, and refused when a user's setting disagrees.
ARCHITECTURE_KEYS = (
    "vocab_size",
    "d_model",
    "n_layers",
    "n_heads",
    "n_kv_heads",
    "d_ff",
    "rope_theta",
    "rope_scaling",
    "norm_eps",
    "tie_embeddings",
    "qkv_bias",
    "head_dim",
    "qk_norm",
    "mlp_activation",
    "embed_scale",
    "norm_offset",
    "post_norms",
    "attn_scale_dim",
    "sliding_window",
    "global_every",
    "rope_local_theta",
    "mla",
)
# model.moe.* of the weights' shape and routing; the layer's training settings stay the user's.
MOE_ARCHITECTURE_KEYS = (
    "num_experts",
    "top_k",
    "every",
    "first_dense",
    "dense_layers",
    "d_ff",
    "norm_topk",
    "shared_experts",
    "score",
    "groups",
    "topk_groups",
    "routed_scale",
)


def param_targets(cfg, sizes: dict[str, int], devices) -> tuple[dict, dict]:
    """(shapes, shardings) of the params of `cfg`'s model on a mesh of `sizes` over `devices`,
    laid out as a run with cfg.parallel.zero_stage lays them out."""
    from flax import nnx

    from jaxpar import sharding as sharding_lib
    from jaxpar.models.llama import Transformer

    layout = sharding_lib.Layout.build(
        sizes, zero_stage=cfg.parallel.zero_stage, sequence_parallel=False, devices=devices
    )
    abstract = nnx.eval_shape(lambda: Transformer(cfg.model, rngs=nnx.Rngs(0)))
    state = nnx.split(abstract)[1]
    return nnx.to_pure_dict(state), layout.shardings(
        sharding_lib.logical_names(state, layout.sizes), "params"
    )


# --- from-hf -------------------------------------------------------------------------------------


def _check_out(out: str) -> None:
    if os.path.exists(out) and (not os.path.isdir(out) or os.listdir(out)):
        raise ConfigError(f"--out {out} exists and is not an empty directory; give a new one")
    checks_lib.check_writable_dir(os.path.dirname(os.path.abspath(out)), "--out's parent")


def _user_model_keys(settings: dict) -> dict:
    return settings.get("model", {}) if isinstance(settings.get("model"), dict) else {}


def _set_value(value):
    return getattr(value, "value", value)  # a command-line _Override -> its parsed value


def merge_model(source: ModelConfig, user: ModelConfig, user_keys: dict, where: str) -> ModelConfig:
    """`user`'s model settings with the architecture (ARCHITECTURE_KEYS, MOE_ARCHITECTURE_KEYS)
    and max_seq_len of `source`; a setting the user gave for an architecture key that disagrees
    is refused. The MoE layer's training settings (capacity, losses, dispatch) stay the user's."""
    changes = _architecture(source, user, user_keys, ARCHITECTURE_KEYS, "model.", where)
    user_moe = user_keys.get("moe") if isinstance(user_keys.get("moe"), dict) else {}
    moe = _architecture(source.moe, user.moe, user_moe, MOE_ARCHITECTURE_KEYS, "model.moe.", where)
    changes["moe"] = dataclasses.replace(user.moe, **moe)
    user_mtp = user_keys.get("mtp") if isinstance(user_keys.get("mtp"), dict) else {}
    mtp = _architecture(source.mtp, user.mtp, user_mtp, ("depth",), "model.mtp.", where)
    changes["mtp"] = dataclasses.replace(user.mtp, **mtp)  # the modules' weights: the checkpoint's
    if "max_seq_len" not in user_keys:
        changes["max_seq_len"] = source.max_seq_len
    return dataclasses.replace(user, **changes)


# Fields of an architecture section that say how the run computes, not what the weights are:
# they stay the user's (model.mla.ring_latent: what the context ring sends).
RUN_FIELDS = {"mla": ("ring_latent",)}


def _architecture(source, user, user_keys: dict, keys: tuple, prefix: str, where: str) -> dict:
    """{key: source's value} for `keys`, refusing a user-given value that disagrees (the
    `RUN_FIELDS` of a section are the user's)."""
    changes = {}
    for key in keys:
        theirs, mine = getattr(source, key), getattr(user, key)
        given = key in user_keys
        if key in RUN_FIELDS:
            theirs = dataclasses.replace(theirs, **{f: getattr(mine, f) for f in RUN_FIELDS[key]})
            section = user_keys.get(key)
            given = given and not (isinstance(section, dict) and set(section) <= set(RUN_FIELDS[key]))
        if given and theirs != mine:
            shown = dataclasses.asdict(theirs) if dataclasses.is_dataclass(theirs) else theirs
            raise ConfigError(
                f"{prefix}{key}={_set_value(user_keys[key])!r}, but {where} has "
                f"{prefix}{key}={shown!r}; leave it unset (the weights decide it)"
            )
        changes[key] = theirs
    return changes


def _tokenizer_files(hf_dir: str) -> list[str]:
    path = os.path.join(hf_dir, "tokenizer.json")
    if not os.path.isfile(path):
        raise ConfigError(
            f"{hf_dir} has no tokenizer.json (jaxpar reads Hugging Face's fast-"
            "tokenizer file; tokenizer.model alone is not enough)"
        )
    extra = [os.path.join(hf_dir, name) for name in ("tokenizer_config.json", chat.TEMPLATE_FILE)]
    return [path] + [p for p in extra if os.path.isfile(p)]


def from_hf(hf_dir: str, out: str, overrides: list[str] = (), revision: str | None = None) -> dict:
    """Converts the Hugging Face model in `hf_dir` (a local directory, or a Hub model id at
    `revision`: `jaxpar.hf.hub.model_dir`) into a jaxpar run directory `out` (see the module
    docstring). Everything is checked before anything is written; the directory is built under a
    temporary name beside `out` and renamed into place at the end (`export.staged_directory`), so
    a failure leaves no `out` behind, and a failed write (a full disk) is one line."""
    import jax

    from jaxpar.corpus.documents import HFTokenizer
    from jaxpar.training.checkpoint import Checkpointer

    out = os.path.abspath(out)
    _check_out(out)  # before a download
    hf_dir = hub.model_dir(hf_dir, revision)
    source = hf_model_config(hf_dir)
    tensors = checkpoint_tensors(hf_dir)
    check_tensors(tensors, source, hf_dir)
    tokenizer_files = _tokenizer_files(hf_dir)
    tokenizer = HFTokenizer(tokenizer_files[0])  # readable, with an end-of-document token
    if tokenizer.vocab_size > source.vocab_size:
        raise ConfigError(
            f"{tokenizer_files[0]} has {tokenizer.vocab_size} tokens, more than "
            f"vocab_size={source.vocab_size} in {hf_dir}/config.json"
        )
    settings = config_lib.user_settings(None, list(overrides))
    user = config_lib.build_config(settings)
    model = merge_model(source, user.model, _user_model_keys(settings), f"{hf_dir}/config.json")
    if "param_dtype" not in _user_model_keys(settings):
        model = dataclasses.replace(model, param_dtype=source.param_dtype)
    cfg = dataclasses.replace(
        user,
        model=model,
        data=dataclasses.replace(user.data, tokenizer=os.path.join(out, "tokenizer.json")),
        train=dataclasses.replace(user.train, run_dir=out),
    )
    cfg = config_lib.resolve_paths(cfg)

    devices = jax.devices()
    fsdp = len(devices) if model.d_model % len(devices) == 0 else 1
    sizes = {axis: 1 for axis in config_lib.MESH_AXES} | {"fsdp": fsdp}
    shapes, shardings = param_targets(
        dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, zero_stage=3)),
        sizes,
        devices[:fsdp],
    )
    with export.staged_directory(out, "from-hf") as built:
        params = load_hf_params(hf_dir, model, shapes, shardings, tensors)
        ckpt = Checkpointer(os.path.join(built, "checkpoints"), keep=1)
        try:
            ckpt.save(0, {"params": params}, None, force=True)
        finally:
            ckpt.close()
        del params
        for path in tokenizer_files:
            shutil.copyfile(path, os.path.join(built, os.path.basename(path)))
        config_lib.dump_yaml(cfg, os.path.join(built, "config.yaml"))
    n = sum(int(np.prod(s)) for s in expected_tensors(model).values())
    return {
        "source": hf_dir,
        "out": out,
        "tensors": len(expected_tensors(model)),
        "parameters": n,
        "dtype": model.param_dtype,
    }


# --- train.init_from -----------------------------------------------------------------------------


def init_source(path: str) -> tuple[ModelConfig, str]:
    """(model config, tokenizer) of train.init_from: a run directory's config.yaml, or a Hugging
    Face directory's config.json and tokenizer.json."""
    where = f"train.init_from={path}"
    if os.path.isfile(os.path.join(path, "config.yaml")):
        src = config_lib.load_config(os.path.join(path, "config.yaml"))
        return src.model, src.data.tokenizer
    if os.path.isfile(os.path.join(path, "config.json")):
        return hf_model_config(path), _tokenizer_files(path)[0]
    raise ConfigError(
        f"{where}: neither a run directory (config.yaml) nor a Hugging Face model directory (config.json)"
    )


def apply_init_from(cfg, settings: dict):
    """The config with train.init_from's model shape (ARCHITECTURE_KEYS, and max_seq_len unless
    set) and tokenizer (unless data.tokenizer is set), and train.init_from the local directory it
    names (a Hub model id's snapshot: `jaxpar.hf.hub.model_dir`); no-op without train.init_from."""
    path = cfg.train.init_from
    if path is None:
        return cfg
    path = hub.model_dir(path, where="train.init_from=")
    model, tokenizer = init_source(path)
    merged = merge_model(model, cfg.model, _user_model_keys(settings), f"train.init_from={path}")
    user_data = settings.get("data", {}) if isinstance(settings.get("data"), dict) else {}
    data = cfg.data if "tokenizer" in user_data else dataclasses.replace(cfg.data, tokenizer=tokenizer)
    train = dataclasses.replace(cfg.train, init_from=path)
    return dataclasses.replace(cfg, model=merged, data=data, train=train)


def holds_imported_weights(run_dir: str, step: int) -> bool:
    """Whether checkpoint `step` of `run_dir` holds params alone (from-hf writes such), so that
    there is no training to resume from it."""
    from jaxpar.training.checkpoint import PARAMS_ITEM, REST_ITEM, checkpoint_dir

    step_dir = os.path.join(checkpoint_dir(run_dir), str(step))
    return os.path.isdir(os.path.join(step_dir, PARAMS_ITEM)) and not os.path.isdir(
        os.path.join(step_dir, REST_ITEM)
    )


# --- The command line ----------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["to-hf"]:
        return export.main(argv[1:], prog="python -m jaxpar.convert to-hf")
    parser = argparse.ArgumentParser(
        prog="python -m jaxpar.convert",
        description="Convert Hugging Face checkpoints (Llama, Mistral, Qwen2, Qwen3, Mixtral, Qwen3-MoE, "
        "Gemma 3) to jaxpar runs (from-hf) and back (to-hf RUN_DIR --out HF_DIR).",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser(
        "from-hf",
        help="a Hugging Face model (a directory or a Hub model id) -> a jaxpar run directory",
        description="Convert a Hugging Face model into a jaxpar run directory. HF_DIR is a local "
        "directory (config.json, model.safetensors or shards + index, tokenizer.json) or a Hub "
        "model id ORG/NAME; a path that exists wins over an id of the same name. An id is fetched "
        "through huggingface_hub's cache (HF_HUB_CACHE, or HF_HOME/hub), only the files jaxpar "
        "reads; HF_HUB_OFFLINE=1 reads the cache alone; HF_TOKEN or `hf auth login` for gated "
        "and private models.",
    )
    p.add_argument("hf_dir", metavar="HF_DIR|ORG/NAME", help="a local model directory or a Hub model id")
    p.add_argument(
        "--revision",
        metavar="REV",
        default=None,
        help="of a Hub model id: a branch, tag or commit hash (default: the repository's default branch)",
    )
    p.add_argument("--out", required=True, help="the run directory to write (new or empty)")
    p.add_argument("overrides", nargs="*", help="dotted.key=value settings for config.yaml")
    sub.add_parser("to-hf", help="a run directory -> Hugging Face safetensors (python -m jaxpar.export)")
    args = parser.parse_args(argv)
    _quiet_disk_full()
    return cli.run(lambda: _from_hf_command(args), failures={export.WriteFailed: 1})


@functools.cache  # once a process
def _quiet_disk_full() -> None:
    """For the rest of the process, as `python -m jaxpar.train` does: orbax's pages of tracebacks
    on a full disk (its threads' logs, the closed event loop's unraisable errors) stay out of
    stderr, where from-hf's one line (`export.WriteFailed`) says it."""
    checkpoint_lib.DropNoSpace().__enter__()
    sys.unraisablehook = functools.partial(checkpoint_lib.quiet_closed_loop, sys.unraisablehook)


def _from_hf_command(args) -> int:
    for item in args.overrides:
        if "=" not in item:
            raise ConfigError(f"argument '{item}' is not a dotted.key=value override")
    summary = from_hf(args.hf_dir, args.out, args.overrides, args.revision)
    print(
        f"converted {summary['tensors']} tensors ({summary['parameters']:,} parameters, "
        f"{summary['dtype']}) of {summary['source']} -> {summary['out']}"
    )
    return 0
