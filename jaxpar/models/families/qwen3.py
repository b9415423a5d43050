"""Qwen3 (dense): `Qwen3ForCausalLM`. Llama's block with an RMSNorm over each head of q and k
before the rotation (model.qk_norm), no q/k/v biases, and head_dim set on its own (wider or
narrower than hidden_size / heads).

Refused: attention biases, a sliding window, rope scaling other than llama3 or linear.
"""

from __future__ import annotations

from jaxpar.config import ModelConfig
from jaxpar.models.families import common

ARCHITECTURES = ("Qwen3ForCausalLM",)
FIXED_KEYS = (("hidden_act", "silu"), ("attention_bias", False))
DEFAULTS = {"Qwen3ForCausalLM": {"head_dim": 128, "max_position_embeddings": 32768}}


def writes(m: ModelConfig) -> bool:
    return not m.moe.num_experts and m.qk_norm and not m.qkv_bias and common.llama_block(m)


def tensor_table(m: ModelConfig) -> dict[str, common.Tensor]:
    return {
        **common.embedding_tensors(m),
        **common.attention_tensors(m),
        **common.dense_mlp_tensors(m),
        **common.head_tensors(m),
    }


def settings_from_hf(hf: dict, where: str) -> dict:
    common.check_fixed(hf, FIXED_KEYS, where)
    common.check_full_attention(hf, where)
    return {**common.base_settings(hf, where), "qk_norm": True}


def hf_config(m: ModelConfig) -> dict:
    return {
        **common.base_config(m, "Qwen3ForCausalLM", "qwen3"),
        "attention_bias": False,
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": m.n_layers,
    }
