"""Reading Hugging Face model directories: config.json into a ModelConfig, the safetensors
tensors (headers checked against the files, every tensor the config implies present), and
`load_hf_params`, which places each parameter onto its sharding on a mesh, reading for each device
shard only the rows that shard covers (`jaxpar.convert`'s docstring describes it).

Its own module so that what reads a base model -- `python -m jaxpar.convert from-hf`,
train.init_from and a LoRA run's base (`jaxpar.hf.base`) -- imports no command line.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os

import numpy as np

from jaxpar import config as config_lib
from jaxpar.config import ConfigError, ModelConfig
from jaxpar.models.families import common as family_common
from jaxpar.models.families import registry as families

SAFETENSORS_DTYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}
# Tensors some checkpoints carry that hold no weights: old Llama-2 conversions store RoPE's
# inverse frequencies, which jaxpar (and transformers) recompute from the config.
IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)


def is_hf_dir(path: str) -> bool:
    return os.path.isfile(os.path.join(path, "config.json")) and not os.path.isfile(
        os.path.join(path, "config.yaml")
    )


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

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * _np_dtype(self.dtype).itemsize


def read_safetensors_header(path: str, shown: str) -> dict[str, TensorInfo]:
    """The tensors of one .safetensors file (name -> TensorInfo), checked against the file's
    size: a truncated file is named with the first tensor it cuts, a header that is not what
    the format says (an object of {dtype, shape, data_offsets}, the tensors' bytes apart from
    each other) with the tensor and the entry. `shown` names it in errors."""
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
    if not isinstance(header, dict):
        raise ConfigError(f"{shown}: its safetensors header is not a JSON object; is it a safetensors file?")
    tensors = {
        name: _tensor_info(name, info, shown) for name, info in header.items() if name != "__metadata__"
    }
    spans = sorted((info.offset, info.offset + info.nbytes, name) for name, info in tensors.items())
    for (_, end, name), (start, _, other) in zip(spans, spans[1:]):
        if start < end:
            raise ConfigError(f"{shown}: tensors {name} and {other} overlap in its safetensors header")
    data = size - 8 - n
    for start, end, name in spans:
        if end > data:
            raise ConfigError(
                f"{shown} is truncated: tensor {name} ends at byte {8 + n + end}, the file has {size}"
            )
    return {
        name: dataclasses.replace(info, file=os.path.abspath(path), offset=8 + n + info.offset)
        for name, info in tensors.items()
    }


def _tensor_info(name: str, info, shown: str) -> TensorInfo:
    """One entry of a safetensors header as a TensorInfo (its offset from the data's start, the
    file not yet set), or a ConfigError naming the tensor and what is wrong."""
    if not isinstance(info, dict):
        raise ConfigError(f"{shown}: tensor {name}: its header entry {info!r} is not an object")
    dtype = SAFETENSORS_DTYPES.get(info.get("dtype")) if isinstance(info.get("dtype"), str) else None
    if dtype is None:
        raise ConfigError(
            f"{shown}: tensor {name} has dtype {info.get('dtype')}; "
            f"jaxpar reads {', '.join(SAFETENSORS_DTYPES)}"
        )
    shape, offsets = info.get("shape"), info.get("data_offsets")
    if not _counts(shape):
        raise ConfigError(
            f"{shown}: tensor {name}: shape={shape!r} is not a list of sizes (whole numbers >= 0)"
        )
    if not (_counts(offsets) and len(offsets) == 2 and offsets[0] <= offsets[1]):
        raise ConfigError(
            f"{shown}: tensor {name}: data_offsets={offsets!r} is not [start, end] with 0 <= start <= end"
        )
    start, end = offsets
    if end - start != int(np.prod(shape, dtype=np.int64)) * _np_dtype(dtype).itemsize:
        raise ConfigError(
            f"{shown}: tensor {name}: {end - start} bytes do not hold shape {tuple(shape)} of {dtype}"
        )
    return TensorInfo("", dtype, tuple(shape), start)


def _counts(value) -> bool:
    """Whether `value` is a JSON list of whole numbers >= 0."""
    return isinstance(value, list) and all(type(v) is int and v >= 0 for v in value)


def read_weight_map(index: str) -> dict[str, str]:
    """model.safetensors.index.json's weight_map (tensor name -> the file in the same directory
    that holds it), or a ConfigError naming the index and the first entry that is not one."""
    try:
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"{index} is not a readable index ({e!r})") from None
    if not isinstance(weight_map, dict):
        raise ConfigError(f"{index}: weight_map={weight_map!r} is not an object of tensor name -> file")
    for name, file in weight_map.items():
        if not isinstance(file, str) or not file or os.path.basename(file) != file or file in (".", ".."):
            raise ConfigError(
                f"{index}: weight_map[{name!r}]={file!r} is not the name of a file beside the index"
            )
    return weight_map


def checkpoint_tensors(hf_dir: str) -> dict[str, TensorInfo]:
    """Every tensor of the model directory's safetensors (one file, or the shards that
    model.safetensors.index.json lists), each read from its header only."""
    index = os.path.join(hf_dir, "model.safetensors.index.json")
    single = os.path.join(hf_dir, "model.safetensors")
    if os.path.isfile(index):
        weight_map = read_weight_map(index)
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
    # DeepSeek-V3's MTP layers repeat the shared embedding and head (read from the model's own)
    copies = families.family_of_model(m).ignored_tensors(m) if m.mtp.depth else set()
    for name, info in tensors.items():
        known = (
            name in want
            or name.endswith(IGNORED_SUFFIXES)
            or (m.tie_embeddings and name == "lm_head.weight")
            or name in copies  # a family's copies of shared weights (DeepSeek-V3's MTP layers)
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


def _shaped_like(tree: dict, flat: dict, prefix: str = "") -> dict:
    """`tree`'s nesting, its keys as they are (a grouped model's integer block keys stay
    integers), with the leaf at each of `families.flatten`'s paths taken from `flat`."""
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
    flat_shapes, flat_shardings = families.flatten(shapes), families.flatten(shardings)
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
