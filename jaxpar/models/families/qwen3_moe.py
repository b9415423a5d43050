"""Qwen3-MoE: `Qwen3MoeForCausalLM`. Qwen3's attention (per-head q/k norms, head_dim of its
own) and a mixture of SwiGLU experts of width moe_intermediate_size in every
decoder_sparse_step-th block (the last of each group, as model.moe.every places them), dense
MLPs of width intermediate_size in the others. norm_topk_prob is model.moe.norm_topk.
mlp_only_layers [0, 1, ..., k-1] with decoder_sparse_step 1 (k dense layers, then MoE ones) is
model.moe.first_dense = k; any other mlp_only_layers is model.moe.dense_layers (sorted, each
once), written back as it was read (the model is then `irregular` where a listed layer would
have had experts: `jaxpar.models.llama`).

Refused: mlp_only_layers that leave no layer with experts or name a layer the model does not
have, a layer count the step does not divide, top-1 routing with norm_topk_prob, attention
biases, a sliding window.
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
EXPERTS = common.MLP_EXPERTS


def writes(m: ModelConfig) -> bool:
    moe = m.moe
    top1_ok = moe.top_k > 1 or not moe.norm_topk
    return (
        moe.num_experts > 0
        and (moe.first_dense == 0 or moe.every == 1)  # a dense prefix: mlp_only_layers, step 1
        and m.qk_norm
        and top1_ok
        and not moe.shared_experts
        and not m.qkv_bias
        and common.llama_block(m)
    )


def tensor_table(m: ModelConfig) -> dict[str, common.Tensor]:
    every = m.moe.every
    table = common.embedding_tensors(m)
    if m.irregular_moe():  # mlp_only_layers between MoE layers: a dense stack and an MoE stack
        dense = {**common.attention_tensors(m), **common.dense_mlp_tensors(m)}
        moe = {**common.attention_tensors(m), **common.moe_tensors(m, EXPERTS)}
        return {**table, **common.irregular_tensors(m, dense, moe), **common.head_tensors(m)}
    if common.dense_prefix(m):  # mlp_only_layers (every is 1 then: `writes`)
        dense = {**common.attention_tensors(m), **common.dense_mlp_tensors(m)}
        table.update(common.prefix_tensors(m, dense))
    for position in range(every):
        layer = common.attention_tensors(m, position, every)
        if position == every - 1:
            layer.update(common.moe_tensors(m, EXPERTS, position, every))
        else:
            layer.update(common.dense_mlp_tensors(m, position, every))
        table.update(common.after_prefix(m, layer))
    return {**table, **common.head_tensors(m)}


def _dense_layers(hf: dict, step: int, layers: int, where: str) -> tuple[int, list[int]]:
    """(model.moe.first_dense, model.moe.dense_layers) of mlp_only_layers (absent, null and []
    alike: none): a prefix [0, 1, ..., k-1] with decoder_sparse_step 1 is first_dense = k, any
    other list dense_layers; refused where it names a layer the model lacks or leaves none with
    experts (transformers' rule: layer i has them iff i is not listed and (i + 1) % step == 0)."""
    dense = hf.get("mlp_only_layers") or []
    whole = isinstance(dense, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in dense)
    if not whole or not all(0 <= i < layers for i in dense):
        raise common.refuse(where, f"mlp_only_layers={dense} is not a list of layers 0 to {layers - 1}")
    dense = sorted(set(dense))
    if all(i in dense or (i + 1) % step for i in range(layers)):
        raise common.refuse(
            where,
            f"mlp_only_layers={dense} with decoder_sparse_step={step} leaves none of the {layers} "
            "layers with experts; jaxpar's MoE models have at least one",
        )
    if step == 1 and dense == list(range(len(dense))):
        return len(dense), []
    return 0, dense


def settings_from_hf(hf: dict, where: str) -> dict:
    common.check_fixed(hf, FIXED_KEYS, where)
    common.check_full_attention(hf, where)
    settings = common.base_settings(hf, where)
    step, layers = common.read_int(hf, "decoder_sparse_step", where, 1), settings["n_layers"]
    first_dense, dense_layers = _dense_layers(hf, step, layers, where)
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
    moe.update(first_dense=first_dense, dense_layers=dense_layers)
    return {**settings, "qk_norm": True, "moe": moe}


def hf_config(m: ModelConfig) -> dict:
    return {
        **common.base_config(m, "Qwen3MoeForCausalLM", "qwen3_moe"),
        **common.moe_config(m),
        "num_experts": m.moe.num_experts,
        "moe_intermediate_size": m.moe.d_ff or m.d_ff,
        "decoder_sparse_step": m.moe.every,
        "mlp_only_layers": sorted(set(range(m.moe.first_dense)) | set(m.moe.dense_layers)),
        "norm_topk_prob": m.moe.norm_topk,
        "attention_bias": False,
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": m.n_layers,
    }
