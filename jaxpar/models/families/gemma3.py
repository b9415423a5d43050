"""Gemma 3 (text): `Gemma3ForCausalLM`. Against Llama's block it adds: embeddings scaled by
sqrt(hidden_size) (model.embed_scale), RMSNorm by (1 + weight) (model.norm_offset), norms on the
attention's and the MLP's outputs too (model.post_norms: post_attention_layernorm and
post_feedforward_layernorm; the MLP's input norm is pre_feedforward_layernorm), GeGLU with
tanh-approximated GELU (model.mlp_activation), per-head q/k norms, a query scale of its own
(query_pre_attn_scalar: model.attn_scale_dim), and sliding-window layers interleaved with global
ones (layer_types: model.sliding_window, model.global_every), each kind with its own rotary base
(rope_parameters' sliding_attention: model.rope_local_theta; full_attention: model.rope_theta and
its scaling, linear in the larger Gemma 3 models). Tied embeddings as the checkpoints ship them.

transformers' embedding gives the pad token's row (pad_token_id) no gradient from the input
lookup; jaxpar trains every row alike, so fine-tuning on inputs that hold the pad token differs
there (and only there).

Refused: attention or final-logit soft-capping, bidirectional attention, another activation,
layer types that do not repeat as every n-th layer global, sliding layers with no window, a rope
scaling on the sliding layers other than the global ones'.
"""

from __future__ import annotations

from jaxpar.config import ModelConfig
from jaxpar.models.families import common

ARCHITECTURES = ("Gemma3ForCausalLM",)
FIXED_KEYS = (
    ("hidden_activation", "gelu_pytorch_tanh"),
    ("hidden_act", "gelu_pytorch_tanh"),
    ("attention_bias", False),
    ("attn_logit_softcapping", None),
    ("final_logit_softcapping", None),
    ("use_bidirectional_attention", False),
)
LAYER = "model.layers.{l}."
DEFAULTS = {
    "Gemma3ForCausalLM": {
        "head_dim": 256,
        "num_key_value_heads": 4,
        "query_pre_attn_scalar": 256,
        "sliding_window": 4096,
        "max_position_embeddings": 131072,
        "tie_word_embeddings": True,
    }
}


def writes(m: ModelConfig) -> bool:
    gemma = m.embed_scale and m.norm_offset and m.post_norms and m.mlp_activation == "gelu_tanh"
    return gemma and m.qk_norm and not m.qkv_bias and not m.moe.num_experts


def tensor_table(m: ModelConfig) -> dict[str, common.Tensor]:
    e = m.d_model

    def norm(name):
        return common.Tensor(LAYER + name + ".weight", True, common.SAME, (e,))

    attention = common.attention_tensors(m)
    attention["blocks.mlp_norm.scale"] = norm("pre_feedforward_layernorm")
    attention["blocks.post_attn_norm.scale"] = norm("post_attention_layernorm")
    attention["blocks.post_mlp_norm.scale"] = norm("post_feedforward_layernorm")
    return {
        **common.embedding_tensors(m),
        **attention,
        **common.dense_mlp_tensors(m),
        **common.head_tensors(m),
    }


def layer_types(m: ModelConfig) -> list[str]:
    return ["sliding_attention" if m.slides(i) else "full_attention" for i in range(m.n_layers)]


def _window(hf: dict, layers: int, where: str) -> dict:
    """model.sliding_window and global_every from sliding_window and layer_types (or the
    sliding_window_pattern older config.json files give instead)."""
    window = common.read_int(hf, "sliding_window", where)
    key = "sliding_window_pattern" if "sliding_window_pattern" in hf else "_sliding_window_pattern"
    pattern = common.read_int(hf, key, where, 6)
    types = hf.get("layer_types") or [
        "sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)
    ]
    if not isinstance(types, list):
        raise common.refuse(where, f"layer_types={types!r}: a list of one type per layer")
    if "sliding_attention" not in types:
        return {}  # every layer global, whatever sliding_window says
    if window is None:
        raise common.refuse(where, f"sliding_window=null with sliding layers (layer_types={types})")
    every = types.index("full_attention") + 1 if "full_attention" in types else 0
    settings = {"sliding_window": window, "global_every": every}
    expected = layer_types(ModelConfig(n_layers=layers, sliding_window=window, global_every=every))
    if list(types) != expected:
        raise common.refuse(
            where, f"layer_types={types}: jaxpar's layers are global every n-th and sliding otherwise"
        )
    return settings


def _rope(hf: dict, where: str) -> dict:
    """rope_theta and scaling of the global layers, rope_local_theta of the sliding ones."""
    params = _object(hf, "rope_parameters", where)
    if "full_attention" in params or "sliding_attention" in params:  # transformers >= 5
        full = _object(params, "full_attention", where)
        local = _object(params, "sliding_attention", where)
    else:
        full = _object(hf, "rope_scaling", where)
        local = {"rope_theta": hf.get("rope_local_base_freq", 10000.0)}
    theta, scaling = common.rope_from_hf(
        hf, where, full, common.read_float(hf, "rope_theta", where, 1e6, positive=True)
    )
    local_theta, local_scaling = common.rope_from_hf(hf, where, local, 10000.0)
    if (local_theta, local_scaling) == (theta, scaling):  # one rotary for both kinds of layer
        return {"rope_theta": theta, "rope_scaling": scaling}
    if local_scaling["type"] != "none":
        raise common.refuse(
            where,
            f"rope scaling {local_scaling['type']!r} on the sliding layers differs from the global ones'",
        )
    return {"rope_theta": theta, "rope_scaling": scaling, "rope_local_theta": local_theta}


def _object(hf: dict, key: str, where: str) -> dict:
    """config.json's `key`, an object ({} where absent or null), else refused naming it."""
    value = hf.get(key) or {}
    if not isinstance(value, dict):
        raise common.refuse(where, f"{key}={value!r} where an object belongs")
    return dict(value)


def settings_from_hf(hf: dict, where: str) -> dict:
    common.check_fixed(hf, FIXED_KEYS, where)
    settings = common.base_settings({**hf, "rope_parameters": None, "rope_scaling": None}, where)
    head = settings.get("head_dim") or settings["d_model"] // settings["n_heads"]
    scalar = common.read_float(hf, "query_pre_attn_scalar", where, 256.0, positive=True)
    return {
        **settings,
        **_rope(hf, where),
        **_window(hf, settings["n_layers"], where),
        "tie_embeddings": common.read_bool(hf, "tie_word_embeddings", where, True),
        "qk_norm": True,
        "mlp_activation": "gelu_tanh",
        "embed_scale": True,
        "norm_offset": True,
        "post_norms": True,
        "attn_scale_dim": None if scalar == head else scalar,
    }


def hf_config(m: ModelConfig) -> dict:
    hf = common.base_config(m, "Gemma3ForCausalLM", "gemma3_text")
    for key in ("rope_theta", "rope_scaling", "hidden_act"):
        del hf[key]
    full = {"rope_type": "default", **(common.rope_scaling_config(m) or {}), "rope_theta": m.rope_theta}
    # model.rope_local_theta None: the sliding layers rotate as the global ones, scaling included.
    local = full if m.rope_local_theta is None else {"rope_type": "default", "rope_theta": m.rope_local_theta}
    scalar = m.head_width if m.attn_scale_dim is None else m.attn_scale_dim
    return {
        **hf,
        "hidden_activation": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": int(scalar) if float(scalar).is_integer() else scalar,  # transformers: int
        # transformers needs a window even where no layer slides (then every type is full)
        "sliding_window": m.max_seq_len if m.sliding_window is None else m.sliding_window,
        "layer_types": layer_types(m),
        "rope_parameters": {
            "full_attention": full,
            "sliding_attention": local,
        },
        "attention_bias": False,
        "attn_logit_softcapping": None,
        "final_logit_softcapping": None,
        "use_bidirectional_attention": False,
    }
