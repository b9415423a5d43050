"""Qwen3-MoE: `Qwen3MoeForCausalLM`. Qwen3's attention (per-head q/k norms, head_dim of its
own) and a mixture of SwiGLU experts of width moe_intermediate_size in every
decoder_sparse_step-th block (the last of each group, as model.moe.every places them), dense
MLPs of width intermediate_size in the others. norm_topk_prob is model.moe.norm_topk.

Refused: mlp_only_layers (dense layers off the every-k-th pattern), a layer count the step does
not divide, top-1 routing with norm_topk_prob, attention biases, a sliding window.
"""

from __future__ import annotations

from jaxpar.config import ModelConfig
from jaxpar.models.families import common

ARCHITECTURES = ("Qwen3MoeForCausalLM",)
FIXED_KEYS = (("hidden_act", "silu"), ("attention_bias", False))
DEFAULTS = {
    "Qwen3MoeForCausalLM": {
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "moe_intermediate_size": 768,
        "decoder_sparse_step": 1,
        "norm_topk_prob": False,
        "max_position_embeddings": 32768,
    }
}
EXPERTS = (
    "model.layers.{l}.mlp.gate.weight",
    "model.layers.{l}.mlp.experts.{e}.gate_proj.weight",
    "model.layers.{l}.mlp.experts.{e}.up_proj.weight",
    "model.layers.{l}.mlp.experts.{e}.down_proj.weight",
)


def writes(m: ModelConfig) -> bool:
    moe = m.moe
    top1_ok = moe.top_k > 1 or not moe.norm_topk
    return (
        moe.num_experts > 0
        and m.qk_norm
        and top1_ok
        and not moe.shared_experts
        and not m.qkv_bias
        and common.llama_block(m)
    )


def tensor_table(m: ModelConfig) -> dict[str, common.Tensor]:
    every = m.moe.every
    table = common.embedding_tensors(m)
    for position in range(every):
        table.update(common.attention_tensors(m, position, every))
        if position == every - 1:
            table.update(common.moe_tensors(m, EXPERTS, position, every))
        else:
            table.update(common.dense_mlp_tensors(m, position, every))
    return {**table, **common.head_tensors(m)}


def settings_from_hf(hf: dict, where: str) -> dict:
    common.check_fixed(hf, FIXED_KEYS, where)
    if hf.get("mlp_only_layers"):  # absent, null and [] alike: none
        raise common.refuse(where, f"mlp_only_layers={hf['mlp_only_layers']}, jaxpar has []")
    common.check_full_attention(hf, where)
    settings = common.base_settings(hf, where)
    step, layers = common.read_int(hf, "decoder_sparse_step", where, 1), settings["n_layers"]
    if layers % step:
        raise common.refuse(where, f"decoder_sparse_step={step} does not divide num_hidden_layers={layers}")
    moe = common.moe_settings(hf, where)
    norm = common.read_bool(hf, "norm_topk_prob", where)
    if norm and moe["top_k"] < 2:
        raise common.refuse(
            where,
            "norm_topk_prob=true with one expert per token: its weight is 1, "
            "jaxpar's top-1 router weighs it by its probability",
        )
    moe.update(every=step, norm_topk=norm, d_ff=common.read_int(hf, "moe_intermediate_size", where, 768))
    return {**settings, "qk_norm": True, "moe": moe}


def hf_config(m: ModelConfig) -> dict:
    return {
        **common.base_config(m, "Qwen3MoeForCausalLM", "qwen3_moe"),
        **common.moe_config(m),
        "num_experts": m.moe.num_experts,
        "moe_intermediate_size": m.moe.d_ff or m.d_ff,
        "decoder_sparse_step": m.moe.every,
        "mlp_only_layers": [],
        "norm_topk_prob": m.moe.norm_topk,
        "attention_bias": False,
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": m.n_layers,
    }
