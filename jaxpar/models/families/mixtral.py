"""Mixtral: `MixtralForCausalLM`. Llama's attention, and in every block a mixture of SwiGLU
experts: softmax router, the top model.moe.top_k experts, their weights renormalised to sum 1.
Each expert is its own Hugging Face tensor (w1 = gate, w3 = up, w2 = down).

Refused: top-1 routing (transformers' weight 1 against jaxpar's router probability), router
jitter, a sliding window, rope scaling other than llama3 or linear.
"""

from __future__ import annotations

from jaxpar.config import ModelConfig
from jaxpar.models.families import common

ARCHITECTURES = ("MixtralForCausalLM",)
FIXED_KEYS = (("hidden_act", "silu"), ("router_jitter_noise", 0.0))
DEFAULTS = {
    "MixtralForCausalLM": {
        "rms_norm_eps": 1e-5,
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
        "max_position_embeddings": 131072,
        "rope_theta": 1e6,
    }
}
EXPERTS = (
    "model.layers.{l}.block_sparse_moe.gate.weight",
    "model.layers.{l}.block_sparse_moe.experts.{e}.w1.weight",
    "model.layers.{l}.block_sparse_moe.experts.{e}.w3.weight",
    "model.layers.{l}.block_sparse_moe.experts.{e}.w2.weight",
)


def writes(m: ModelConfig) -> bool:
    moe = m.moe
    return (
        moe.num_experts > 0
        and moe.every == 1
        and moe.first_dense == 0
        and not moe.dense_layers
        and moe.top_k > 1
        and moe.norm_topk
        and not moe.shared_experts
        and moe.d_ff in (None, m.d_ff)
        and not m.qk_norm
        and not m.qkv_bias
        and common.llama_block(m)
    )


def tensor_table(m: ModelConfig) -> dict[str, common.Tensor]:
    return {
        **common.embedding_tensors(m),
        **common.attention_tensors(m),
        **common.moe_tensors(m, EXPERTS),
        **common.head_tensors(m),
    }


def settings_from_hf(hf: dict, where: str) -> dict:
    common.check_fixed(hf, FIXED_KEYS, where)
    common.check_full_attention(hf, where, window_applies=True)
    moe = common.moe_settings(hf, where)
    if moe["top_k"] < 2:
        raise common.refuse(
            where,
            f"num_experts_per_tok={moe['top_k']}: top-1 Mixtral routing weighs the expert 1, "
            "jaxpar's top-1 router weighs it by its probability",
        )
    return {**common.base_settings(hf, where), "moe": {**moe, "every": 1, "norm_topk": True}}


def hf_config(m: ModelConfig) -> dict:
    return {
        **common.base_config(m, "MixtralForCausalLM", "mixtral"),
        **common.moe_config(m),
        "router_jitter_noise": 0.0,
        "sliding_window": None,
    }
