"""The Llama family: `LlamaForCausalLM` (Llama 2, 3, 3.1, 3.2, TinyLlama), `MistralForCausalLM`
and `Qwen2ForCausalLM` (q/k/v biases: model.qkv_bias). Grouped-query attention, tied or untied
embeddings, rotary scaling none, `llama3` or `linear`, head_dim given or hidden_size / heads. Written back
as Qwen2 when the model has q/k/v biases, as Llama otherwise.

Refused: another activation, biases on the output or the MLP, partial rotary, a sliding window
or layer types that cut attention short, rope scaling other than llama3 or linear.
"""

from __future__ import annotations

from jaxpar.config import ModelConfig
from jaxpar.models.families import common

ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
# transformers' values for keys a config.json may leave out, where they differ from common's.
DEFAULTS = {"MistralForCausalLM": {"sliding_window": 4096}}
# What jaxpar's block is: written as these, and a config.json that says otherwise is refused.
FIXED_KEYS = (("hidden_act", "silu"), ("mlp_bias", False), ("attention_bias", False))


def writes(m: ModelConfig) -> bool:
    """This family writes dense models without per-head q/k norms."""
    return not m.moe.num_experts and not m.qk_norm and common.llama_block(m)


def tensor_table(m: ModelConfig) -> dict[str, common.Tensor]:
    """jaxpar parameter path -> its Hugging Face tensor, in `LlamaForCausalLM.state_dict()`'s
    order (the layers' tensors in layer order)."""
    return {
        **common.embedding_tensors(m),
        **common.attention_tensors(m),
        **common.dense_mlp_tensors(m),
        **common.head_tensors(m),
    }


def settings_from_hf(hf: dict, where: str) -> dict:
    """config.json -> model.* settings (the inverse of `hf_config`)."""
    architecture = hf["architectures"][0]
    fixed = FIXED_KEYS
    if architecture == "Qwen2ForCausalLM":  # q/k/v biases whatever attention_bias says
        fixed = tuple(kv for kv in FIXED_KEYS if kv[0] != "attention_bias")
    elif common.read_bool(hf, "attention_bias", where):
        raise common.refuse(
            where,
            "attention_bias=True (it adds biases to q, k, v and o; jaxpar has q/k/v biases for Qwen2 only)",
        )
    common.check_fixed(hf, fixed, where)
    common.check_full_attention(hf, where, window_applies=architecture == "MistralForCausalLM")
    return {**common.base_settings(hf, where), "qkv_bias": architecture == "Qwen2ForCausalLM"}


def hf_config(m: ModelConfig) -> dict:
    """A `LlamaConfig` (config.json) for the model, a `Qwen2Config` with model.qkv_bias."""
    if not m.qkv_bias:
        return {
            **common.base_config(m, "LlamaForCausalLM", "llama"),
            "mlp_bias": False,
            "attention_bias": False,
        }
    return {
        **common.base_config(m, "Qwen2ForCausalLM", "qwen2"),
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": m.n_layers,
    }
