"""The Llama family as Hugging Face writes it, once, for both directions: the architectures it
covers, config.json <-> `ModelConfig`, and one table of tensors (`tensor_table`) that
`jaxpar.convert` imports checkpoints with and `jaxpar.export` writes them with.

Architectures: `LlamaForCausalLM` (Llama 2, 3, 3.1, 3.2, TinyLlama), `MistralForCausalLM` and
`Qwen2ForCausalLM` (biases on q/k/v: model.qkv_bias), with grouped-query attention, tied or
untied embeddings, rotary scaling none or `llama3`. A model with q/k/v biases is written as
Qwen2, any other as Llama. What the family cannot represent exactly is refused by name
(`settings_from_hf`).

Each tensor's layout pair (`Layout`) says how jaxpar's einsum weight [in..., out...] and the
torch `Linear` weight [out, in] correspond, both ways: `read` converts one device's shard of a
layer on import (from a reader of the Hugging Face tensor's rows, see `jaxpar.convert`), `write`
a whole layer on export.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import NamedTuple

import numpy as np

from jaxpar.config import ConfigError, ModelConfig

ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")


# --- Tensors: one table, both directions ---------------------------------------------------


def span(index: slice, size: int) -> tuple[int, int]:
    """(start, stop) of a slice of an axis of `size`, whose step must be 1."""
    start, stop, step = index.indices(size)
    assert step == 1, index
    return start, stop


class Layout(NamedTuple):
    """How a jaxpar array and its Hugging Face tensor correspond. `read(rows, idx, shape)`: the
    shard `idx` (an index into jaxpar's array of `shape`, the layer axis removed) from `rows(r0,
    r1, cols)`, rows r0..r1 of the Hugging Face tensor (its first axis), only the columns `cols`
    (a slice of its second axis) of a matrix. `write(array)`: the Hugging Face tensor of one
    whole jaxpar array (one layer's)."""

    read: Callable
    write: Callable


def _read_heads_in(rows, idx, shape):
    e, n, h = shape
    r0, r1 = span(idx[1], n)
    block = rows(r0 * h, r1 * h, idx[0])
    return block.reshape(r1 - r0, h, block.shape[1])[:, idx[2]].transpose(2, 0, 1)


def _read_heads_out(rows, idx, shape):
    n, h, e = shape
    r0, r1 = span(idx[2], e)
    c0, c1 = span(idx[0], n)
    block = rows(r0, r1, slice(c0 * h, c1 * h))
    return block.reshape(r1 - r0, c1 - c0, h)[:, :, idx[1]].transpose(1, 2, 0)


def _read_head_bias(rows, idx, shape):
    n, h = shape
    r0, r1 = span(idx[0], n)
    return rows(r0 * h, r1 * h).reshape(r1 - r0, h)[:, idx[1]]


# jaxpar [A, ...] = Hugging Face [A, ...]
SAME = Layout(lambda rows, idx, shape: rows(*span(idx[0], shape[0]), *idx[1:2]), lambda w: w)
# jaxpar [A, B] = Hugging Face [B, A] (a torch Linear)
TRANSPOSED = Layout(lambda rows, idx, shape: rows(*span(idx[1], shape[1]), idx[0]).T, lambda w: w.T)
# jaxpar [E, N, H] = Hugging Face [N*H, E] (q, k, v projections)
HEADS_IN = Layout(_read_heads_in, lambda w: w.reshape(w.shape[0], -1).T)
# jaxpar [N, H, E] = Hugging Face [E, N*H] (the output projection)
HEADS_OUT = Layout(_read_heads_out, lambda w: w.reshape(-1, w.shape[-1]).T)
# jaxpar [N, H] = Hugging Face [N*H] (q, k, v biases)
HEAD_BIAS = Layout(_read_head_bias, lambda w: w.reshape(-1))


class Tensor(NamedTuple):
    hf_name: str  # with {l} for the layer when stacked
    stacked: bool  # jaxpar's array has a leading [layers] axis: one Hugging Face tensor a layer
    layout: Layout
    hf_shape: tuple  # the Hugging Face tensor's shape (one layer's)


def tensor_table(m: ModelConfig) -> dict[str, Tensor]:
    """jaxpar parameter path -> its Hugging Face tensor, in the order
    `LlamaForCausalLM.state_dict()` lists them (the layers' tensors in layer order)."""
    e, n, k, h = m.d_model, m.n_heads, m.n_kv_heads, m.head_dim
    f, v = m.d_ff, m.vocab_size
    attn, mlp = "model.layers.{l}.self_attn.", "model.layers.{l}.mlp."
    table = {
        "embedding": Tensor("model.embed_tokens.weight", False, SAME, (v, e)),
        "blocks.attn.wq": Tensor(attn + "q_proj.weight", True, HEADS_IN, (n * h, e)),
        "blocks.attn.wk": Tensor(attn + "k_proj.weight", True, HEADS_IN, (k * h, e)),
        "blocks.attn.wv": Tensor(attn + "v_proj.weight", True, HEADS_IN, (k * h, e)),
    }
    if m.qkv_bias:
        table["blocks.attn.bq"] = Tensor(attn + "q_proj.bias", True, HEAD_BIAS, (n * h,))
        table["blocks.attn.bk"] = Tensor(attn + "k_proj.bias", True, HEAD_BIAS, (k * h,))
        table["blocks.attn.bv"] = Tensor(attn + "v_proj.bias", True, HEAD_BIAS, (k * h,))
    table.update(
        {
            "blocks.attn.wo": Tensor(attn + "o_proj.weight", True, HEADS_OUT, (e, n * h)),
            "blocks.mlp.w_gate": Tensor(mlp + "gate_proj.weight", True, TRANSPOSED, (f, e)),
            "blocks.mlp.w_up": Tensor(mlp + "up_proj.weight", True, TRANSPOSED, (f, e)),
            "blocks.mlp.w_down": Tensor(mlp + "down_proj.weight", True, TRANSPOSED, (e, f)),
            "blocks.attn_norm.scale": Tensor("model.layers.{l}.input_layernorm.weight", True, SAME, (e,)),
            "blocks.mlp_norm.scale": Tensor(
                "model.layers.{l}.post_attention_layernorm.weight", True, SAME, (e,)
            ),
            "final_norm.scale": Tensor("model.norm.weight", False, SAME, (e,)),
        }
    )
    if not m.tie_embeddings:
        table["lm_head"] = Tensor("lm_head.weight", False, TRANSPOSED, (v, e))
    return table


def hf_tensors(flat_params: dict[str, np.ndarray], m: ModelConfig) -> dict[str, np.ndarray]:
    """jaxpar params (flat: path -> array) -> {Hugging Face name: array}, through `tensor_table`,
    in its order: the tensors before the layers, then each layer's, then the ones after."""
    out = {}
    for stacked, run in itertools.groupby(tensor_table(m).items(), key=lambda kv: kv[1].stacked):
        run = list(run)
        for layer in range(m.n_layers) if stacked else [None]:
            for path, t in run:
                value = flat_params[path] if layer is None else flat_params[path][layer]
                out[t.hf_name.format(l=layer)] = np.ascontiguousarray(t.layout.write(value))
    return out


# --- config.json <-> ModelConfig ---------------------------------------------------------------

# config.json key, ModelConfig field, type, the value transformers assumes when the key is absent
# (None: required). Read and written alike.
CONFIG_KEYS = (
    ("hidden_size", "d_model", int, None),
    ("intermediate_size", "d_ff", int, None),
    ("num_hidden_layers", "n_layers", int, None),
    ("num_attention_heads", "n_heads", int, None),
    ("num_key_value_heads", "n_kv_heads", int, None),  # absent or null: num_attention_heads
    ("vocab_size", "vocab_size", int, None),
    ("max_position_embeddings", "max_seq_len", int, 2048),
    ("rms_norm_eps", "norm_eps", float, 1e-6),
    ("tie_word_embeddings", "tie_embeddings", bool, False),
    ("initializer_range", "init_std", float, 0.02),
)
# rope_scaling of rope_type "llama3": config.json key, RopeScalingConfig field, type.
LLAMA3_ROPE_KEYS = (
    ("factor", "factor", float),
    ("low_freq_factor", "low_freq_factor", float),
    ("high_freq_factor", "high_freq_factor", float),
    ("original_max_position_embeddings", "original_max_len", int),
)
# What jaxpar's block is: written as these, and a config.json that says otherwise is refused.
FIXED_KEYS = (("hidden_act", "silu"), ("mlp_bias", False), ("attention_bias", False))
DTYPES = ("float32", "bfloat16", "float16")


def _refuse(where: str, what: str) -> ConfigError:
    return ConfigError(f"{where}: {what}; jaxpar converts {', '.join(ARCHITECTURES)} exactly or not at all")


def _check_block(hf: dict, arch: str, where: str) -> None:
    """Refuses what jaxpar's block does not compute: another activation, biases it lacks,
    partial rotary, a sliding window or other layer types that cut attention short."""
    for key, want in FIXED_KEYS + (("partial_rotary_factor", 1.0),):
        if key in hf and hf[key] != want:
            if key == "attention_bias" and arch == "Qwen2ForCausalLM":
                continue  # Qwen2 has q/k/v biases whatever this says (transformers ignores it)
            why = {
                "attention_bias": " (it adds biases to q, k, v and o; jaxpar has q/k/v biases for Qwen2 only)"
            }.get(key, "")
            raise _refuse(where, f"{key}={hf[key]!r}, jaxpar has {want!r}{why}")
    max_len, window = int(hf.get("max_position_embeddings", 2048)), hf.get("sliding_window")
    if arch == "Qwen2ForCausalLM" and hf.get("use_sliding_window", False):
        raise _refuse(
            where, f"use_sliding_window=true (sliding_window={window}): jaxpar attends to the whole context"
        )
    if arch == "MistralForCausalLM" and window is not None and window < max_len:
        raise _refuse(
            where,
            f"sliding_window={window} < max_position_embeddings={max_len}: "
            "jaxpar attends to the whole context",
        )
    layer_types = hf.get("layer_types") or []
    if any(t != "full_attention" for t in layer_types):
        raise _refuse(
            where, f"layer_types={sorted(set(layer_types))}: jaxpar has full attention in every layer"
        )
    d_model, n_heads = int(hf["hidden_size"]), int(hf["num_attention_heads"])
    if hf.get("head_dim") is not None and int(hf["head_dim"]) * n_heads != d_model:
        raise _refuse(
            where,
            f"head_dim={hf['head_dim']} but hidden_size / num_attention_heads = "
            f"{d_model / n_heads:g}; jaxpar's heads are hidden_size / heads wide",
        )


def _rope_from_hf(hf: dict, where: str) -> tuple[float, dict]:
    """(rope_theta, the model.rope_scaling settings) of config.json."""
    rope = dict(hf.get("rope_scaling") or {})
    rope.update(hf.get("rope_parameters") or {})  # transformers >= 5 keeps everything here
    theta = float(rope.get("rope_theta", hf.get("rope_theta", 10000.0)))
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type == "default":
        return theta, {"type": "none"}
    if rope_type == "llama3":
        return theta, {"type": "llama3", **{field: cast(rope[key]) for key, field, cast in LLAMA3_ROPE_KEYS}}
    raise _refuse(where, f"rope scaling {rope_type!r}: jaxpar has none or llama3")


def settings_from_hf(hf: dict, where: str) -> dict:
    """config.json (a dict) -> the model.* settings it implies, or ConfigError naming what jaxpar
    cannot represent exactly. `where` names the file in messages. The inverse of `hf_config`."""
    arch = hf.get("architectures") or []
    if len(arch) != 1 or arch[0] not in ARCHITECTURES:
        raise _refuse(where, f"architectures={arch} is not supported")
    _check_block(hf, arch[0], where)
    settings = {}
    for key, field, cast, default in CONFIG_KEYS:
        value = hf.get(key, default)
        settings[field] = cast(value) if value is not None else None
    if settings["n_kv_heads"] is None:
        settings["n_kv_heads"] = settings["n_heads"]
    settings["rope_theta"], settings["rope_scaling"] = _rope_from_hf(hf, where)
    dtype = hf.get("dtype") or hf.get("torch_dtype") or "float32"
    if dtype not in DTYPES:
        raise _refuse(where, f"dtype={dtype!r}: jaxpar reads {', '.join(DTYPES[:-1])} or {DTYPES[-1]}")
    return {**settings, "qkv_bias": arch[0] == "Qwen2ForCausalLM", "param_dtype": dtype}


def hf_config(m: ModelConfig) -> dict:
    """A `LlamaConfig` (config.json) for the model, a `Qwen2Config` with model.qkv_bias. The
    inverse of `settings_from_hf`."""
    qwen2 = m.qkv_bias
    rs = m.rope_scaling
    rope_scaling = (
        None
        if rs.type == "none"
        else {"rope_type": rs.type, **{key: getattr(rs, field) for key, field, _ in LLAMA3_ROPE_KEYS}}
    )
    hf = {
        "architectures": ["Qwen2ForCausalLM" if qwen2 else "LlamaForCausalLM"],
        "model_type": "qwen2" if qwen2 else "llama",
        **{key: getattr(m, field) for key, field, _, _ in CONFIG_KEYS},
        "head_dim": m.head_dim,
        "rope_theta": m.rope_theta,
        "rope_scaling": rope_scaling,
        **dict(FIXED_KEYS),
        "torch_dtype": m.param_dtype,
    }
    if qwen2:  # Qwen2's q/k/v biases are part of its architecture, not a config.json switch
        del hf["attention_bias"], hf["mlp_bias"]
        hf.update(use_sliding_window=False, sliding_window=None, max_window_layers=m.n_layers)
    return hf
