"""Hugging Face model families, one file each: its architecture names, config.json <->
`ModelConfig` both ways (`settings_from_hf`, `hf_config`), one table of tensors used both ways
(`tensor_table`: `jaxpar.convert` imports with it, `jaxpar.export` writes with it), and which
models it writes (`writes`). What a family cannot represent exactly it refuses by name.

Adding a family: its file here, and its line in FAMILIES.
"""

from __future__ import annotations

import itertools
from types import ModuleType

import numpy as np

from jaxpar.config import ConfigError, ModelConfig
from jaxpar.models.families import common, deepseek_v3, gemma3, llama, mixtral, qwen3, qwen3_moe

FAMILIES: tuple[ModuleType, ...] = (deepseek_v3, llama, qwen3, mixtral, qwen3_moe, gemma3)
ARCHITECTURES = tuple(a for family in FAMILIES for a in family.ARCHITECTURES)


def architecture(hf: dict, where: str) -> str:
    """config.json's one architecture: `architectures` is a list of one class name (a lone
    string is read as that one), else ConfigError naming the key."""
    arch = hf.get("architectures")
    if isinstance(arch, str):
        return arch
    if not (isinstance(arch, list) and len(arch) == 1 and isinstance(arch[0], str)):
        raise ConfigError(
            f"{where}: architectures={arch!r}; jaxpar reads a config.json that lists one "
            f"model class, one of {', '.join(ARCHITECTURES)}"
        )
    return arch[0]


def family_of_config(hf: dict, where: str) -> ModuleType:
    """The family that reads config.json `hf` (by its one architecture), else ConfigError."""
    arch = architecture(hf, where)
    for family in FAMILIES:
        if arch in family.ARCHITECTURES:
            return family
    raise ConfigError(
        f"{where}: architectures={[arch]} is not supported; jaxpar converts {', '.join(ARCHITECTURES)}"
    )


def family_of_model(m: ModelConfig) -> ModuleType:
    """The family that writes model `m`, else ConfigError saying what no family has."""
    for family in FAMILIES:
        if family.writes(m):
            return family
    raise ConfigError(
        f"no Hugging Face family jaxpar writes has this model (qk_norm={m.qk_norm}, qkv_bias={m.qkv_bias}, "
        f"moe.num_experts={m.moe.num_experts}, moe.every={m.moe.every}, moe.first_dense={m.moe.first_dense}, "
        f"moe.dense_layers={m.moe.dense_layers}, "
        f"moe.shared_experts={m.moe.shared_experts}, moe.top_k={m.moe.top_k}, "
        f"moe.norm_topk={m.moe.norm_topk}); the families are {', '.join(ARCHITECTURES)}"
    )


def settings_from_hf(hf: dict, where: str) -> dict:
    """config.json (a dict) -> the model.* settings it implies, or ConfigError naming what jaxpar
    cannot represent exactly. `where` names the file in messages. The inverse of `hf_config`."""
    family = family_of_config(hf, where)
    arch = architecture(hf, where)
    # What transformers assumes for the keys a config.json leaves out, by architecture.
    defaults = family.DEFAULTS.get(arch, {})
    return family.settings_from_hf({**defaults, **hf, "architectures": [arch]}, where)


def hf_config(m: ModelConfig) -> dict:
    """config.json for model `m`, written by its family (`family_of_model`)."""
    return family_of_model(m).hf_config(m)


def tensor_table(m: ModelConfig) -> dict[str, common.Tensor]:
    """jaxpar parameter path -> its Hugging Face tensor(s), by the family that writes `m`."""
    return family_of_model(m).tensor_table(m)


def flatten(tree: dict, prefix: str = "") -> dict:
    """A nested parameter dict as {dotted name: leaf}: the names `hf_tensors` maps."""
    flat = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            flat.update(flatten(value, f"{prefix}{key}."))
        else:
            flat[prefix + str(key)] = value
    return flat


def hf_tensors(flat_params: dict[str, np.ndarray], m: ModelConfig) -> dict[str, np.ndarray]:
    """jaxpar params (flat: path -> array) -> {Hugging Face name: array}, through `tensor_table`:
    the tensors before the layers, then each layer's in the table's order, then the ones after."""
    out = {}
    table = tensor_table(m)
    for stacked, run in itertools.groupby(table.items(), key=lambda kv: kv[1].stacked):
        instances = [
            (layer, name, path, t, index) for path, t in run for index, layer, name in t.instances(m.n_layers)
        ]
        for layer, name, path, t, index in sorted(instances, key=lambda i: -1 if i[0] is None else i[0]):
            value = flat_params[path][index] if index else flat_params[path]
            out[name] = np.ascontiguousarray(t.layout.write(value))
    return out
