"""Hugging Face checkpoints in and out of jaxpar.

    python -m jaxpar.convert from-hf HF_DIR|ORG/NAME [--revision REV] --out RUN_DIR [dotted.key=value ...]
    python -m jaxpar.convert to-hf RUN_DIR --out HF_DIR [--max-shard-bytes N] [--step N]

`from-hf` reads a Hugging Face model directory -- `config.json`, `model.safetensors` (or shards
listed by `model.safetensors.index.json`) and `tokenizer.json` -- a local one, or a Hub model id
ORG/NAME at a revision resolved through huggingface_hub's cache (`jaxpar.hub.model_dir`, which
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

Loading is sharded, one tensor at a time. `load_hf_params` places each parameter with
`jax.make_array_from_callback` onto its sharding on the target mesh; for each device's shard the
callback reads (`os.pread`) only the rows of the Hugging Face tensor(s) that shard covers, one
layer at a time, and converts them (reshape, transpose, cast), reading READ_BYTES at a time.
Beyond what the devices keep, the host holds one device's shard of one parameter (twice where it
is transposed) and one read; never the model. No file is memory-mapped.

`train.init_from=DIR` (a run directory, a Hugging Face directory, or a Hub model id ORG/NAME at its
default branch) starts a run from such weights on any mesh: `apply_init_from` resolves DIR to a
local directory (recorded as train.init_from), takes the model's shape and tokenizer from it before
the config is validated, `init_state` loads the weights onto the run's shardings and adds a fresh
optimizer state at step 0. With finetune.lora those weights are the frozen base and the adapters
start fresh (B = 0: step 0 computes the base model).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import shutil
import sys
import tempfile

import numpy as np

from jaxpar import chat, cli, hub
from jaxpar import config as config_lib
from jaxpar.config import ConfigError, ModelConfig
from jaxpar.models import families
from jaxpar.models.families import common as family_common

SAFETENSORS_DTYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}
# Tensors some checkpoints carry that hold no weights: old Llama-2 conversions store RoPE's
# inverse frequencies, which jaxpar (and transformers) recompute from the config.
IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)
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
)
# model.moe.* of the weights' shape and routing; the layer's training settings stay the user's.
MOE_ARCHITECTURE_KEYS = ("num_experts", "top_k", "every", "d_ff", "norm_topk", "shared_experts")


def _np_dtype(name: str):
    import ml_dtypes

    return np.dtype(ml_dtypes.bfloat16) if name == "bfloat16" else np.dtype(name)


# --- config.json -> ModelConfig ----------------------------------------------------------------


def read_hf_config(hf_dir: str) -> dict:
    path = os.path.join(hf_dir, "config.json")
    if not os.path.isfile(path):
        raise ConfigError(f"{hf_dir} has no config.json; is it a Hugging Face model directory?")
    try:
        with open(path) as f:
            hf = json.load(f)
    except (OSError, ValueError) as e:
        raise ConfigError(f"{path} is not readable JSON ({e})") from None
    if not isinstance(hf, dict):
        raise ConfigError(f"{path} does not hold a JSON object")
    return hf


def hf_model_config(hf_dir: str) -> ModelConfig:
    """The ModelConfig of a Hugging Face model directory (its config.json)."""
    settings = families.settings_from_hf(read_hf_config(hf_dir), os.path.join(hf_dir, "config.json"))
    return config_lib.build_config({"model": settings}).model


# --- The tensors a model has, in Hugging Face's names and layouts -------------------------------


def expected_tensors(m: ModelConfig) -> dict[str, tuple]:
    """Every Hugging Face tensor name the model has -> its shape."""
    return {
        name: t.hf_shape for t in families.tensor_table(m).values() for _, _, name in t.instances(m.n_layers)
    }


# --- safetensors files -------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    file: str  # absolute path
    dtype: str  # float32 | bfloat16 | float16
    shape: tuple
    offset: int  # of the first byte in the file


def read_safetensors_header(path: str, shown: str) -> dict[str, TensorInfo]:
    """The tensors of one .safetensors file (name -> TensorInfo), checked against the file's
    size: a truncated file is named with the first tensor it cuts. `shown` names it in errors."""
    if not os.path.isfile(path):
        raise ConfigError(f"{shown} is missing")
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        n = int.from_bytes(head, "little") if len(head) == 8 else None
        if n is None or 8 + n > size:
            raise ConfigError(
                f"{shown} is truncated or not a safetensors file ({size} bytes; its header does not fit)"
            )
        try:
            header = json.loads(f.read(n))
        except ValueError as e:
            raise ConfigError(f"{shown}: its safetensors header is not valid JSON ({e})") from None
    tensors = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dtype = SAFETENSORS_DTYPES.get(info.get("dtype"))
        if dtype is None:
            raise ConfigError(
                f"{shown}: tensor {name} has dtype {info.get('dtype')}; jaxpar reads "
                f"{', '.join(SAFETENSORS_DTYPES)}"
            )
        start, end = info["data_offsets"]
        shape = tuple(int(d) for d in info["shape"])
        if end - start != int(np.prod(shape, dtype=np.int64)) * _np_dtype(dtype).itemsize:
            raise ConfigError(
                f"{shown}: tensor {name}: {end - start} bytes do not hold shape {shape} of {dtype}"
            )
        if 8 + n + end > size:
            raise ConfigError(
                f"{shown} is truncated: tensor {name} ends at byte {8 + n + end}, the file has {size}"
            )
        tensors[name] = TensorInfo(os.path.abspath(path), dtype, shape, 8 + n + start)
    return tensors


def checkpoint_tensors(hf_dir: str) -> dict[str, TensorInfo]:
    """Every tensor of the model directory's safetensors (one file, or the shards that
    model.safetensors.index.json lists), each read from its header only."""
    index = os.path.join(hf_dir, "model.safetensors.index.json")
    single = os.path.join(hf_dir, "model.safetensors")
    if os.path.isfile(index):
        try:
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ConfigError(f"{index} is not a readable index ({e!r})") from None
        tensors = {}
        for file in sorted(set(weight_map.values())):
            listed = [n for n, fl in weight_map.items() if fl == file]
            shown = os.path.join(hf_dir, file)
            if not os.path.isfile(shown):
                raise ConfigError(
                    f"{shown} is missing (model.safetensors.index.json lists it for "
                    f"tensor {listed[0]}" + (f" and {len(listed) - 1} more)" if len(listed) > 1 else ")")
                )
            in_file = read_safetensors_header(shown, shown)
            for name in listed:
                if name not in in_file:
                    raise ConfigError(
                        f"{shown} has no tensor {name} (model.safetensors.index.json says it is there)"
                    )
                tensors[name] = in_file[name]
        return tensors
    if os.path.isfile(single):
        return read_safetensors_header(single, single)
    others = sorted(n for n in os.listdir(hf_dir) if n.endswith((".bin", ".pt", ".pth")))
    hint = f" (it has {', '.join(others[:3])}: convert those to safetensors first)" if others else ""
    raise ConfigError(f"{hf_dir} has neither model.safetensors nor model.safetensors.index.json{hint}")


def check_tensors(tensors: dict[str, TensorInfo], m: ModelConfig, hf_dir: str) -> None:
    """Every tensor the config implies is there with its shape, and nothing else is (an unknown
    weight means another architecture). Tied models may also carry lm_head.weight (ignored, as
    transformers ties it to the embedding)."""
    want = expected_tensors(m)
    config = os.path.join(hf_dir, "config.json")
    for name, shape in want.items():
        if name not in tensors:
            raise ConfigError(
                f"{hf_dir}: tensor {name} is missing, and {config} implies it (shape {list(shape)})"
            )
        if tensors[name].shape != shape:
            raise ConfigError(
                f"{tensors[name].file}: tensor {name} has shape "
                f"{list(tensors[name].shape)}, but {config} implies {list(shape)}"
            )
    for name, info in tensors.items():
        known = (
            name in want or name.endswith(IGNORED_SUFFIXES) or (m.tie_embeddings and name == "lm_head.weight")
        )
        if not known:
            raise ConfigError(
                f"{info.file}: tensor {name} is not part of a {'/'.join(families.ARCHITECTURES)}"
                " jaxpar can represent; refusing an approximate conversion"
            )


READ_BYTES = 16 << 20  # what one read takes from a file at most


def _rows_reader(info: TensorInfo, dtype: np.dtype, name: str):
    """read(r0, r1, cols=None): rows r0..r1 of the tensor `name` (its first axis), of a matrix
    only the columns `cols` (a slice), as `dtype`: read from disk READ_BYTES at a time into the
    result, so that a shard that splits the columns costs its own size, not the rows'. A NaN or
    infinity among them is a ConfigError naming the tensor: such weights train and sample
    nothing."""
    src = _np_dtype(info.dtype)
    rest = info.shape[1:]
    row = src.itemsize * int(np.prod(rest, dtype=np.int64))
    step = max(1, READ_BYTES // max(row, 1))

    def read(r0: int, r1: int, cols: slice | None = None) -> np.ndarray:
        width = rest if cols is None else (len(range(*cols.indices(rest[0]))), *rest[1:])
        out = np.empty((r1 - r0, *width), dtype)
        fd = os.open(info.file, os.O_RDONLY)
        try:
            for a in range(r0, r1, step):
                b = min(a + step, r1)
                raw = os.pread(fd, (b - a) * row, info.offset + a * row)
                if len(raw) != (b - a) * row:
                    raise ConfigError(
                        f"{info.file} is truncated: short read of {(b - a) * row} "
                        f"bytes at {info.offset + a * row}"
                    )
                rows = np.frombuffer(raw, src).reshape(b - a, *rest)
                out[a - r0 : b - r0] = rows if cols is None else rows[:, cols]
                if not (finite := np.isfinite(out[a - r0 : b - r0])).all():
                    bad = np.argwhere(~finite)[0]
                    raise ConfigError(
                        f"{info.file}: tensor {name} holds {np.count_nonzero(~finite)} non-finite "
                        f"value(s), the first {out[a - r0 + bad[0]][tuple(bad[1:])]} in row "
                        f"{a + bad[0]}: weights with NaN or infinity train and sample nothing; "
                        "import an intact checkpoint"
                    )
        finally:
            os.close(fd)
        return out

    return read


# --- Loading onto a mesh -----------------------------------------------------------------------


def _flat(tree: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[prefix + key] = value
    return out


def _shaped_like(tree: dict, flat: dict, prefix: str = "") -> dict:
    """`tree`'s nesting, its keys as they are (a grouped model's integer block keys stay
    integers), with the leaf at each of `_flat`'s paths taken from `flat`."""
    return {
        key: _shaped_like(value, flat, f"{prefix}{key}.")
        if isinstance(value, dict)
        else flat[f"{prefix}{key}"]
        for key, value in tree.items()
    }


def _shard_reader(t, readers: dict, shape: tuple):
    """shard(idx) of jaxpar's array of `shape` for `t`: the stacked axes (scan units, experts)
    pick Hugging Face tensors, the rest is read from each by the tensor's layout."""
    stacked = t.stacked_axes

    def shard(idx):
        ranges = [range(*family_common.span(i, n)) for i, n in zip(idx[:stacked], shape[:stacked])]
        blocks = {
            index: t.layout.read(readers[index], idx[stacked:], shape[stacked:])
            for index in itertools.product(*ranges)
        }
        if not stacked:
            return np.ascontiguousarray(blocks[()])
        out = np.stack([blocks[index] for index in itertools.product(*ranges)])
        return out.reshape(*(len(r) for r in ranges), *out.shape[1:])

    return shard


def load_hf_params(
    hf_dir: str, m: ModelConfig, shapes: dict, shardings: dict, tensors: dict[str, TensorInfo] | None = None
) -> dict:
    """The model's params (a nested dict like the train state's, each array on its sharding in
    `shardings`, of the dtype in `shapes`) from a Hugging Face directory, placed one parameter
    at a time and read one device shard at a time (the module docstring says how)."""
    import jax

    tensors = tensors if tensors is not None else checkpoint_tensors(hf_dir)
    check_tensors(tensors, m, hf_dir)
    table = families.tensor_table(m)
    flat_shapes, flat_shardings = _flat(shapes), _flat(shardings)
    if set(flat_shapes) != set(table):
        raise ConfigError(
            f"the model's parameters {sorted(flat_shapes)} do not match the conversion table {sorted(table)}"
        )
    out = {}
    for path, t in table.items():
        like = flat_shapes[path]
        dtype = _np_dtype(np.dtype(like.dtype).name)
        readers = {
            index: _rows_reader(tensors[name], dtype, name) for index, _, name in t.instances(m.n_layers)
        }
        out[path] = jax.make_array_from_callback(
            like.shape, flat_shardings[path], _shard_reader(t, readers, like.shape)
        )
    return _shaped_like(shapes, out)


def param_targets(cfg, sizes: dict[str, int], devices) -> tuple[dict, dict]:
    """(shapes, shardings) of the params of `cfg`'s model on a mesh of `sizes` over `devices`,
    laid out as a run with cfg.parallel.zero_stage lays them out."""
    from flax import nnx

    from jaxpar import sharding as sharding_lib
    from jaxpar.models import Transformer

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
    config_lib.check_writable_dir(os.path.dirname(os.path.abspath(out)), "--out's parent")


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
    if "max_seq_len" not in user_keys:
        changes["max_seq_len"] = source.max_seq_len
    return dataclasses.replace(user, **changes)


def _architecture(source, user, user_keys: dict, keys: tuple, prefix: str, where: str) -> dict:
    """{key: source's value} for `keys`, refusing a user-given value that disagrees."""
    changes = {}
    for key in keys:
        theirs, mine = getattr(source, key), getattr(user, key)
        if key in user_keys and theirs != mine:
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
    `revision`: `jaxpar.hub.model_dir`) into a jaxpar run directory `out` (see the module
    docstring). Everything is checked before anything is written; the directory is built under a
    temporary name beside `out` and renamed into place at the end, so a failure leaves no `out`
    behind."""
    import jax

    from jaxpar.checkpoint import Checkpointer
    from jaxpar.documents import HFTokenizer

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
    os.makedirs(os.path.dirname(out), exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(out)}.converting-", dir=os.path.dirname(out))
    try:
        params = load_hf_params(hf_dir, model, shapes, shardings, tensors)
        ckpt = Checkpointer(os.path.join(tmp, "checkpoints"), keep=1)
        try:
            ckpt.save(0, {"params": params}, None, force=True)
        finally:
            ckpt.close()
        del params
        for path in tokenizer_files:
            shutil.copyfile(path, os.path.join(tmp, os.path.basename(path)))
        config_lib.dump_yaml(cfg, os.path.join(tmp, "config.yaml"))
        if os.path.isdir(out):
            os.rmdir(out)  # empty (checked above)
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    n = sum(int(np.prod(s)) for s in expected_tensors(model).values())
    return {
        "source": hf_dir,
        "out": out,
        "tensors": len(expected_tensors(model)),
        "parameters": n,
        "dtype": model.param_dtype,
    }


# --- train.init_from -----------------------------------------------------------------------------


def is_hf_dir(path: str) -> bool:
    return os.path.isfile(os.path.join(path, "config.json")) and not os.path.isfile(
        os.path.join(path, "config.yaml")
    )


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
    names (a Hub model id's snapshot: `jaxpar.hub.model_dir`); no-op without train.init_from."""
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


def init_state(trainer, path: str):
    """The train state at step 0 of a run started from train.init_from=`path`: its weights on
    the trainer's param shardings (cast to model.param_dtype), a fresh optimizer state."""
    import jax
    import jax.numpy as jnp

    from jaxpar.checkpoint import Checkpointer, checkpoint_dir
    from jaxpar.optim import make_optimizer

    shapes, shardings = trainer.state_shape["params"], trainer.state_shardings["params"]
    lora = trainer.trainable
    if lora is not None:  # finetune.lora: the base's weights from `path`, fresh adapters
        shapes, shardings = lora.split(shapes)[1], lora.split(shardings)[1]
    if is_hf_dir(path):
        params = load_hf_params(path, trainer.cfg.model, shapes, shardings)
    else:
        ckpt = Checkpointer(checkpoint_dir(path), read_only=True)
        try:
            params = ckpt.restore({"params": shapes}, {"params": shardings})[0]["params"]
        finally:
            ckpt.close()
    if lora is not None:
        params = lora.join(trainer.init_adapters(), params)
    optimizer = make_optimizer(trainer.cfg)

    def fresh(params):
        zero = jnp.zeros((), jnp.int32)
        return {
            "params": params,
            "opt_state": optimizer.init(params if lora is None else lora.split(params)[0]),
            "step": zero,
            "skipped_steps": zero,
            "first_bad_step": zero,
        }

    return jax.jit(fresh, out_shardings=trainer.state_shardings, donate_argnums=0)(params)


def holds_imported_weights(run_dir: str, step: int) -> bool:
    """Whether checkpoint `step` of `run_dir` holds params alone (from-hf writes such), so that
    there is no training to resume from it."""
    from jaxpar.checkpoint import PARAMS_ITEM, REST_ITEM, checkpoint_dir

    step_dir = os.path.join(checkpoint_dir(run_dir), str(step))
    return os.path.isdir(os.path.join(step_dir, PARAMS_ITEM)) and not os.path.isdir(
        os.path.join(step_dir, REST_ITEM)
    )


# --- The command line ----------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["to-hf"]:
        from jaxpar import export

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
    return cli.run(lambda: _from_hf_command(args))


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


if __name__ == "__main__":
    from jaxpar.config import RuntimeConfig
    from jaxpar.mesh import emulate_cpu_devices

    # One host device on a CPU machine (and the CPU directly where the CUDA plugin is installed
    # without a driver); before the backend starts.
    emulate_cpu_devices(RuntimeConfig(cpu_devices=1))
    sys.exit(main())
