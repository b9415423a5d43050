"""What every family file builds on: how a jaxpar array and its Hugging Face tensors correspond
(`Layout`, `Tensor`), the tensors every decoder has (`attention_tensors`, `dense_mlp_tensors`,
`norm_tensors`), the config.json keys every family reads and writes alike (`CONFIG_KEYS`,
`base_settings`, `base_config`), and how a config.json value is read (`read_int`, `read_float`,
`read_bool`: of its kind and range, or refused naming the key, the file and the value).

Each tensor's layout pair (`Layout`) says how jaxpar's einsum weight [in..., out...] and the
torch `Linear` weight [out, in] correspond, both ways: `read` converts one device's shard of a
layer on import (from a reader of the Hugging Face tensor's rows, see `jaxpar.convert`), `write`
a whole layer on export.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from typing import NamedTuple

from jaxpar.config import ConfigError, ModelConfig

# --- Tensors: one table, both directions ---------------------------------------------------


def span(index: slice, size: int) -> tuple[int, int]:
    """(start, stop) of a slice of an axis of `size`, whose step must be 1."""
    start, stop, step = index.indices(size)
    assert step == 1, index
    return start, stop


class Layout(NamedTuple):
    """How a jaxpar array and its Hugging Face tensor correspond. `read(rows, idx, shape)`: the
    shard `idx` (an index into jaxpar's array of `shape`, the stacked axes removed) from `rows(r0,
    r1, cols)`, rows r0..r1 of the Hugging Face tensor (its first axis), only the columns `cols`
    (a slice of its second axis) of a matrix. `write(array)`: the Hugging Face tensor of one
    whole jaxpar array (one layer's, one expert's)."""

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
    """One jaxpar parameter and the Hugging Face tensor(s) it is.

    Unstacked: one tensor, `hf_name`. Stacked: jaxpar's array has a leading axis of scan units,
    unit g being Hugging Face layer first + g * every + offset (`hf_name` has {l}), `units` of
    them (None: as many as the layers from `first` on make); with `experts`, a second axis of
    that many experts, one tensor each ({e} in `hf_name`). With `layers` (an irregular model's
    stacks, `irregular_tensors`) unit g is Hugging Face layer layers[g] instead."""

    hf_name: str
    stacked: bool
    layout: Layout
    hf_shape: tuple  # one tensor's shape (one layer's, one expert's)
    every: int = 1
    offset: int = 0
    experts: int = 0
    first: int = 0  # the Hugging Face layer of unit 0's first block (past a dense prefix)
    units: int | None = None  # the stack's length; None: (n_layers - first) // every
    layers: tuple[int, ...] | None = None  # each unit's Hugging Face layer, where not by the above

    def instances(self, n_layers: int) -> list[tuple[tuple, int | None, str]]:
        """(index of the tensor's slice of jaxpar's array, its Hugging Face layer or None, its
        name) for every Hugging Face tensor this parameter is."""
        if not self.stacked:
            return [((), None, self.hf_name)]
        out = []
        units = (n_layers - self.first) // self.every if self.units is None else self.units
        for unit in range(units if self.layers is None else len(self.layers)):
            layer = self.first + unit * self.every + self.offset if self.layers is None else self.layers[unit]
            for x in range(self.experts) if self.experts else [None]:
                index = (unit,) if x is None else (unit, x)
                out.append((index, layer, self.hf_name.format(l=layer, e=x)))
        return out

    @property
    def stacked_axes(self) -> int:
        """Leading axes of jaxpar's array that enumerate tensors (units, then experts)."""
        return int(self.stacked) + int(self.experts > 0)


def llama_block(m: ModelConfig) -> bool:
    """The block has none of Gemma's changes (GeGLU, scaled embeddings, offset norms, output
    norms, a query scale of its own, sliding windows): the other families' block."""
    return not (
        m.embed_scale
        or m.norm_offset
        or m.post_norms
        or m.mlp_activation != "silu"
        or m.attn_scale_dim is not None
        or m.sliding_window is not None
    )


def block_prefix(m: ModelConfig, position: int) -> str:
    """The jaxpar path of block `position` of a scan unit: `blocks.` for one block a unit,
    `blocks.blocks.{position}.` when MoE layers come every model.moe.every blocks."""
    grouped = m.moe.num_experts and m.moe.every > 1 and not m.irregular_moe()
    return f"blocks.blocks.{position}." if grouped else "blocks."


def attention_tensors(m: ModelConfig, position: int = 0, every: int = 1) -> dict[str, Tensor]:
    """The attention of block `position` of each scan unit of `every` blocks: q/k/v/o, the
    q/k/v biases (model.qkv_bias), the per-head q/k norms (model.qk_norm), the two norms around
    it as Llama has them (input_layernorm, post_attention_layernorm: the MLP's input norm)."""
    e, n, k, h = m.d_model, m.n_heads, m.n_kv_heads, m.head_width
    at, attn, layer = block_prefix(m, position), "model.layers.{l}.self_attn.", "model.layers.{l}."

    def stacked(name, layout, shape):
        return Tensor(name, True, layout, shape, every, position)

    table = {
        at + "attn.wq": stacked(attn + "q_proj.weight", HEADS_IN, (n * h, e)),
        at + "attn.wk": stacked(attn + "k_proj.weight", HEADS_IN, (k * h, e)),
        at + "attn.wv": stacked(attn + "v_proj.weight", HEADS_IN, (k * h, e)),
    }
    if m.qkv_bias:
        table[at + "attn.bq"] = stacked(attn + "q_proj.bias", HEAD_BIAS, (n * h,))
        table[at + "attn.bk"] = stacked(attn + "k_proj.bias", HEAD_BIAS, (k * h,))
        table[at + "attn.bv"] = stacked(attn + "v_proj.bias", HEAD_BIAS, (k * h,))
    if m.qk_norm:
        table[at + "attn.q_norm.scale"] = stacked(attn + "q_norm.weight", SAME, (h,))
        table[at + "attn.k_norm.scale"] = stacked(attn + "k_norm.weight", SAME, (h,))
    table[at + "attn.wo"] = stacked(attn + "o_proj.weight", HEADS_OUT, (e, n * h))
    table[at + "attn_norm.scale"] = stacked(layer + "input_layernorm.weight", SAME, (e,))
    table[at + "mlp_norm.scale"] = stacked(layer + "post_attention_layernorm.weight", SAME, (e,))
    return table


def dense_mlp_tensors(m: ModelConfig, position: int = 0, every: int = 1) -> dict[str, Tensor]:
    """The SwiGLU MLP of block `position` of each scan unit (gate_proj, up_proj, down_proj)."""
    e, f, at, mlp = m.d_model, m.d_ff, block_prefix(m, position), "model.layers.{l}.mlp."
    return {
        at + "mlp.w_gate": Tensor(mlp + "gate_proj.weight", True, TRANSPOSED, (f, e), every, position),
        at + "mlp.w_up": Tensor(mlp + "up_proj.weight", True, TRANSPOSED, (f, e), every, position),
        at + "mlp.w_down": Tensor(mlp + "down_proj.weight", True, TRANSPOSED, (e, f), every, position),
    }


def dense_prefix(m: ModelConfig) -> int:
    """The leading dense blocks of an MoE model (model.moe.first_dense; `jaxpar.models.moe`)."""
    return m.moe.first_dense if m.moe.num_experts else 0


def prefix_tensors(m: ModelConfig, block: dict[str, Tensor]) -> dict[str, Tensor]:
    """The dense prefix's tensors (Hugging Face layers 0 .. first_dense - 1, jaxpar's
    `dense_blocks` stack) from the table of one plain block with a dense MLP (paths `blocks.`,
    one block a unit)."""
    count = dense_prefix(m)
    return {
        "dense_blocks." + path.removeprefix("blocks."): t._replace(units=count) for path, t in block.items()
    }


def irregular_tensors(m: ModelConfig, dense: dict[str, Tensor], moe: dict[str, Tensor]) -> dict[str, Tensor]:
    """An irregular model's layer tensors (model.moe.dense_layers, `ModelConfig.irregular_moe`)
    from the tables of one plain block with a dense MLP and one with the MoE MLP (paths
    `blocks.`, one block a unit): the dense blocks' stack `dense_blocks` and the MoE blocks'
    `blocks`, each unit the Hugging Face layer of its place in layer order."""
    kinds = m.moe_kinds()
    at = {kind: tuple(i for i, k in enumerate(kinds) if k == kind) for kind in (False, True)}
    table = {
        "dense_blocks." + path.removeprefix("blocks."): t._replace(layers=at[False])
        for path, t in dense.items()
    }
    return {**table, **{path: t._replace(layers=at[True]) for path, t in moe.items()}}


def after_prefix(m: ModelConfig, table: dict[str, Tensor]) -> dict[str, Tensor]:
    """`table`'s stacked tensors counted from the first layer after the dense prefix."""
    return {path: t._replace(first=dense_prefix(m)) if t.stacked else t for path, t in table.items()}


def embedding_tensors(m: ModelConfig) -> dict[str, Tensor]:
    return {"embedding": Tensor("model.embed_tokens.weight", False, SAME, (m.vocab_size, m.d_model))}


def head_tensors(m: ModelConfig) -> dict[str, Tensor]:
    """The final norm, and the output head unless it is the embedding."""
    table = {"final_norm.scale": Tensor("model.norm.weight", False, SAME, (m.d_model,))}
    if not m.tie_embeddings:
        table["lm_head"] = Tensor("lm_head.weight", False, TRANSPOSED, (m.vocab_size, m.d_model))
    return table


# --- config.json <-> ModelConfig ---------------------------------------------------------------

# config.json key, ModelConfig field, type, the value transformers assumes when the key is absent
# (None: required). Read and written alike by every family.
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
DTYPES = ("float32", "bfloat16", "float16")


def refuse(where: str, what: str) -> ConfigError:
    return ConfigError(f"{where}: {what}; jaxpar converts a model exactly or not at all")


def _invalid(where: str, key: str, value, what: str) -> ConfigError:
    return ConfigError(f"{where}: {key}={json.dumps(value)} is not {what}; fix the file or use another model")


def read_int(hf: dict, key: str, where: str, default: int | None = None, least: int = 1) -> int | None:
    """config.json's `key` as an int of at least `least` (`default` where it is absent or null),
    else a ConfigError naming the key, the file and the value. A float of a whole value is
    read as that int (files written by hand); a bool or a string is refused."""
    value = hf.get(key)
    if value is None:
        return default
    whole = isinstance(value, int) or (isinstance(value, float) and value.is_integer())
    if isinstance(value, bool) or not whole or value < least:
        raise _invalid(where, key, value, f"a whole number of at least {least}")
    return int(value)


def read_float(
    hf: dict, key: str, where: str, default: float | None = None, positive: bool = False
) -> float | None:
    """config.json's `key` as a finite float, 0 or more (above 0 with `positive`; `default` where
    it is absent or null), else a ConfigError naming the key, the file and the value."""
    value = hf.get(key)
    if value is None:
        return default
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not number or not math.isfinite(value) or value < 0 or (positive and value == 0):
        raise _invalid(where, key, value, "a finite number " + ("above 0" if positive else "of 0 or more"))
    return float(value)


def read_bool(hf: dict, key: str, where: str, default: bool = False) -> bool:
    """config.json's `key`, true or false (`default` where it is absent or null), else a
    ConfigError naming the key, the file and the value (a string "false" would read as true)."""
    value = hf.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise _invalid(where, key, value, "true or false")
    return value


def check_fixed(hf: dict, fixed: tuple, where: str) -> None:
    """Refuses a config.json whose keys in `fixed` ((key, the value jaxpar computes)) differ."""
    for key, want in fixed:
        if key in hf and hf[key] != want:
            raise refuse(where, f"{key}={hf[key]!r}, jaxpar has {want!r}")


def check_full_attention(hf: dict, where: str, window_applies: bool = False) -> None:
    """Refuses sliding-window attention and layer types other than full attention. The window
    is on where use_sliding_window says so (Qwen), or, with `window_applies` (Mistral, Mixtral,
    which have no switch), wherever sliding_window is shorter than the context."""
    max_len = read_int(hf, "max_position_embeddings", where, 2048)
    window = read_int(hf, "sliding_window", where)
    if read_bool(hf, "use_sliding_window", where):
        raise refuse(
            where, f"use_sliding_window=true (sliding_window={window}): jaxpar attends to the whole context"
        )
    if window_applies and window is not None and window < max_len:
        raise refuse(
            where,
            f"sliding_window={window} < max_position_embeddings={max_len}: "
            "jaxpar attends to the whole context",
        )
    layer_types = hf.get("layer_types") or []
    if any(t != "full_attention" for t in layer_types):
        raise refuse(
            where, f"layer_types={sorted(set(layer_types))}: jaxpar has full attention in every layer"
        )
    if hf.get("partial_rotary_factor", 1.0) != 1.0:
        raise refuse(
            where, f"partial_rotary_factor={hf['partial_rotary_factor']}, jaxpar rotates whole heads"
        )


def rope_from_hf(
    hf: dict, where: str, rope: dict | None = None, theta: float = 10000.0
) -> tuple[float, dict]:
    """(rope_theta, the model.rope_scaling settings) of config.json, or of its `rope` entry
    (one layer type's, Gemma 3) with `theta` the base when it names none."""
    if rope is None:
        rope = {}
        for key in ("rope_scaling", "rope_parameters"):  # transformers >= 5 keeps everything in the second
            if not isinstance(hf.get(key) or {}, dict):
                raise _invalid(where, key, hf[key], "an object (or null)")
            rope.update(hf.get(key) or {})
        theta = read_float(hf, "rope_theta", where, theta, positive=True)
    theta = read_float(rope, "rope_theta", where, theta, positive=True)
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type == "default":
        return theta, {"type": "none"}
    if rope_type == "linear":
        return theta, {"type": "linear", "factor": _required(rope, "factor", float, where)}
    if rope_type == "llama3":
        return theta, {
            "type": "llama3",
            **{field: _required(rope, key, cast, where) for key, field, cast in LLAMA3_ROPE_KEYS},
        }
    if rope_type == "yarn":
        return theta, _yarn_from_hf(rope, where)
    raise refuse(where, f"rope scaling {rope_type!r}: jaxpar has none, linear, llama3 or yarn")


def _yarn_from_hf(rope: dict, where: str) -> dict:
    """model.rope_scaling of a rope_type "yarn" entry: transformers' defaults for what it leaves
    out (beta_fast 32, beta_slow 1, no mscale keys); an explicit attention_factor or
    truncate=false, which jaxpar does not compute, refused."""
    shown = f"{where} (rope scaling)"
    if rope.get("attention_factor") is not None:
        raise refuse(
            where, f"yarn attention_factor={rope['attention_factor']}: jaxpar derives it from mscale"
        )
    if rope.get("truncate", True) is not True:
        raise refuse(where, f"yarn truncate={rope['truncate']!r}: jaxpar truncates the correction range")
    settings = {"type": "yarn", **{f: _required(rope, k, c, where) for k, f, c in LLAMA3_ROPE_KEYS[::3]}}
    for key, default in (("beta_fast", 32.0), ("beta_slow", 1.0), ("mscale", None), ("mscale_all_dim", None)):
        settings[key] = read_float(rope, key, shown, default, positive=True) if rope.get(key) else default
    return settings


def _required(rope: dict, key: str, cast: type, where: str):
    """A rope scaling entry that its type needs: present and a positive number."""
    if rope.get(key) is None:
        raise refuse(where, f"rope scaling {rope.get('rope_type', rope.get('type'))!r} without its {key}")
    shown = f"{where} (rope scaling)"
    return read_int(rope, key, shown) if cast is int else read_float(rope, key, shown, positive=True)


def rope_scaling_config(m: ModelConfig) -> dict | None:
    """config.json's rope_scaling for model.rope_scaling (the inverse of `rope_from_hf`)."""
    rs = m.rope_scaling
    if rs.type == "none":
        return None
    if rs.type == "linear":
        return {"rope_type": "linear", "factor": rs.factor}
    if rs.type == "yarn":
        keys = {"factor": rs.factor, "original_max_position_embeddings": rs.original_max_len}
        extra = {k: getattr(rs, k) for k in ("beta_fast", "beta_slow", "mscale", "mscale_all_dim")}
        return {"rope_type": "yarn", **keys, **{k: v for k, v in extra.items() if v is not None}}
    return {"rope_type": rs.type, **{key: getattr(rs, field) for key, field, _ in LLAMA3_ROPE_KEYS}}


def base_settings(hf: dict, where: str) -> dict:
    """The model.* settings every family reads alike: shape, norm, rotary, dtype; head_dim when
    config.json gives one other than hidden_size / num_attention_heads."""
    readers = {int: read_int, float: read_float, bool: read_bool}
    settings = {}
    for key, field, cast, default in CONFIG_KEYS:
        settings[field] = readers[cast](hf, key, where, default)
        if settings[field] is None and key != "num_key_value_heads":
            raise ConfigError(f"{where}: {key} is not set; a model's config.json gives it")
    if settings["n_kv_heads"] is None:
        settings["n_kv_heads"] = settings["n_heads"]
    head_dim = read_int(hf, "head_dim", where)
    if head_dim is not None and head_dim * settings["n_heads"] != settings["d_model"]:
        settings["head_dim"] = head_dim
    settings["rope_theta"], settings["rope_scaling"] = rope_from_hf(hf, where)
    dtype = hf.get("dtype") or hf.get("torch_dtype") or "float32"
    if dtype not in DTYPES:
        raise refuse(where, f"dtype={dtype!r}: jaxpar reads {', '.join(DTYPES[:-1])} or {DTYPES[-1]}")
    settings["param_dtype"] = dtype
    return settings


def base_config(m: ModelConfig, architecture: str, model_type: str) -> dict:
    """The config.json keys every family writes alike (the inverse of `base_settings`)."""
    return {
        "architectures": [architecture],
        "model_type": model_type,
        **{key: getattr(m, field) for key, field, _, _ in CONFIG_KEYS},
        "head_dim": m.head_width,
        "rope_theta": m.rope_theta,
        "rope_scaling": rope_scaling_config(m),
        "hidden_act": "silu",
        "torch_dtype": m.param_dtype,
    }


# The Hugging Face names of an MoE MLP's router and of each expert's gate, up and down
# projections where the block's MLP is `mlp` (Qwen3-MoE and DeepSeek-V3; Mixtral has its own).
MLP_EXPERTS = (
    "model.layers.{l}.mlp.gate.weight",
    "model.layers.{l}.mlp.experts.{e}.gate_proj.weight",
    "model.layers.{l}.mlp.experts.{e}.up_proj.weight",
    "model.layers.{l}.mlp.experts.{e}.down_proj.weight",
)


def moe_tensors(m: ModelConfig, names: tuple[str, str, str, str], position: int = 0, every: int = 1) -> dict:
    """The MoE MLP of block `position` of each scan unit: the router and every expert's three
    matrices, one Hugging Face tensor per expert. `names`: the Hugging Face names of the router
    and of an expert's gate, up and down projections ({l} the layer, {e} the expert)."""
    e, f, x, at = m.d_model, m.moe.d_ff or m.d_ff, m.moe.num_experts, block_prefix(m, position)
    router, gate, up, down = names
    return {
        at + "mlp.router": Tensor(router, True, TRANSPOSED, (x, e), every, position),
        at + "mlp.gate": Tensor(gate, True, TRANSPOSED, (f, e), every, position, x),
        at + "mlp.up": Tensor(up, True, TRANSPOSED, (f, e), every, position, x),
        at + "mlp.down": Tensor(down, True, TRANSPOSED, (e, f), every, position, x),
    }


def moe_settings(hf: dict, where: str) -> dict:
    """model.moe.* from the keys MoE families share: experts (num_local_experts, or
    num_experts), experts per token, the load-balancing loss weight. transformers' routers have
    no z-loss, so it is off."""
    key = "num_local_experts" if hf.get("num_local_experts") is not None else "num_experts"
    experts = read_int(hf, key, where)
    if experts is None:
        raise refuse(where, "neither num_local_experts nor num_experts is set")
    top_k = read_int(hf, "num_experts_per_tok", where, 2)
    if top_k > experts:
        raise ConfigError(
            f"{where}: num_experts_per_tok={top_k} is more than the {key}={experts} there are; "
            "fix the file or use another model"
        )
    return {
        "num_experts": experts,
        "top_k": top_k,
        "aux_loss_weight": read_float(hf, "router_aux_loss_coef", where, 0.001),
        "z_loss_weight": 0.0,
    }


def moe_config(m: ModelConfig) -> dict:
    """The inverse of `moe_settings`."""
    return {
        "num_local_experts": m.moe.num_experts,
        "num_experts_per_tok": m.moe.top_k,
        "router_aux_loss_coef": m.moe.aux_loss_weight,
        "output_router_logits": False,
    }
