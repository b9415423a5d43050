"""DeepSeek-V3 (and Kimi K2, the same architecture): `DeepseekV3ForCausalLM`. Multi-head latent
attention (`jaxpar.models.mla`: q_lora_rank null or a width, kv_lora_rank, qk_nope_head_dim,
qk_rope_head_dim, v_head_dim), YaRN rotary with mscale, and a mixture of routed SwiGLU experts
(moe_intermediate_size) plus n_shared_experts always-on ones, with sigmoid scores, a correction
bias and group-limited routing (n_group, topk_group), weights normalised over the top-k
(norm_topk_prob) and times routed_scaling_factor.

DeepSeek's checkpoints pair the rotated dimensions as neighbours (rope_interleave, the default);
jaxpar pairs i with i + P/2. Both q and k are rotated alike, so the import permutes the rotated
output rows of the query and key projections (evens, then odds), which gives the same logits,
and the export permutes them back; model.mla.rope_interleave keeps which layout the checkpoint had.

config.json's head_dim is the rotated width here, not a head's; num_key_value_heads must be
num_attention_heads (every head has its own expanded keys and values).

first_k_dense_replace = k dense layers (MLPs of intermediate_size) before the MoE ones are
model.moe.first_dense = k, their weights jaxpar's `dense_blocks` stack; k >= num_hidden_layers
is a dense model (model.moe.num_experts = 0).

num_nextn_predict_layers = D (transformers' num_mtp_layers; absent: 0) multi-token prediction
modules are model.mtp.depth = D, their weights at model.layers.{num_hidden_layers + k - 1} (enorm,
hnorm, eh_proj, shared_head.norm and the block's usual attention and MLP names) jaxpar's `mtp`
stack (`mtp_tensors`). Their copies of the shared embedding and output head (embed_tokens,
shared_head.head) are ignored on import and not written on export. transformers drops these
layers on load (its model has no MTP modules), so its logits are unaffected.

Refused: q_lora_rank = 0 (transformers then
multiplies the queries by zero; null means no query latent), groups that do not divide the
experts or hold fewer than two (the group score is its top two), a top-k more than the chosen
groups hold, top-1 routing with norm_topk_prob, attention biases, other activations.
"""

from __future__ import annotations

import numpy as np

from jaxpar.config import ConfigError, ModelConfig
from jaxpar.models.families import common

ARCHITECTURES = ("DeepseekV3ForCausalLM",)
FIXED_KEYS = (("hidden_act", "silu"), ("attention_bias", False))
# transformers' DeepseekV3Config defaults for the keys a config.json may leave out.
DEFAULTS = {
    "DeepseekV3ForCausalLM": {
        "q_lora_rank": 1536,
        "kv_lora_rank": 512,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
        "n_routed_experts": 256,
        "n_shared_experts": 1,
        "num_experts_per_tok": 8,
        "moe_intermediate_size": 2048,
        "n_group": 8,
        "topk_group": 4,
        "first_k_dense_replace": 3,
        "norm_topk_prob": True,
        "routed_scaling_factor": 2.5,
        "rope_interleave": True,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6,
    }
}
EXPERTS = common.MLP_EXPERTS


def writes(m: ModelConfig) -> bool:
    moe = m.moe
    routed = moe.num_experts == 0 or (moe.score == "sigmoid" and moe.every == 1)
    routed = routed and not m.moe.dense_layers  # DeepSeek-V3 has a dense prefix only
    return m.mla.kv_lora_rank > 0 and routed and not m.qk_norm and not m.qkv_bias and common.llama_block(m)


# --- Tensors ------------------------------------------------------------------------------------


def rope_order(m: ModelConfig) -> np.ndarray:
    """jaxpar's rotated dimension i is the checkpoint's rope_order[i]: evens then odds when the
    checkpoint pairs neighbours (rope_interleave), else the identity."""
    p = m.mla.qk_rope_dim
    return np.concatenate([np.arange(0, p, 2), np.arange(1, p, 2)]) if m.mla.rope_interleave else np.arange(p)


def _heads_in(order: np.ndarray) -> common.Layout:
    """jaxpar [in, N, H] = Hugging Face [N*H, in], each head's H rows taken in `order`."""
    back = np.argsort(order)

    def read(rows, idx, shape):
        _, n, h = shape
        r0, r1 = common.span(idx[1], n)
        block = rows(r0 * h, r1 * h, idx[0])
        return block.reshape(r1 - r0, h, block.shape[1])[:, order][:, idx[2]].transpose(2, 0, 1)

    return common.Layout(read, lambda w: w[:, :, back].reshape(w.shape[0], -1).T)


def _rows_in(order: np.ndarray) -> common.Layout:
    """jaxpar [in, R] = Hugging Face [R, in] (a Linear), its rows taken in `order`."""
    back = np.argsort(order)

    def read(rows, idx, shape):
        return rows(0, shape[1], idx[0])[order][idx[1]].T

    return common.Layout(read, lambda w: w[:, back].T)


def attention_tensors(m: ModelConfig) -> dict[str, common.Tensor]:
    """Latent attention and the two norms around it (`jaxpar.models.mla`'s table)."""
    a, e, n = m.mla, m.d_model, m.n_heads
    c, p, qk = a.qk_nope_dim, a.qk_rope_dim, m.head_width
    q_order = np.concatenate([np.arange(c), c + rope_order(m)])
    kv_order = np.concatenate([np.arange(a.kv_lora_rank), a.kv_lora_rank + rope_order(m)])
    attn, layer = "model.layers.{l}.self_attn.", "model.layers.{l}."

    def stacked(name, layout, shape):
        return common.Tensor(name, True, layout, shape)

    table = {}
    if a.q_lora_rank:
        table["blocks.attn.wq_a"] = stacked(attn + "q_a_proj.weight", common.TRANSPOSED, (a.q_lora_rank, e))
        table["blocks.attn.q_norm.scale"] = stacked(
            attn + "q_a_layernorm.weight", common.SAME, (a.q_lora_rank,)
        )
        table["blocks.attn.wq_b"] = stacked(
            attn + "q_b_proj.weight", _heads_in(q_order), (n * qk, a.q_lora_rank)
        )
    else:
        table["blocks.attn.wq"] = stacked(attn + "q_proj.weight", _heads_in(q_order), (n * qk, e))
    kv_a = (a.kv_lora_rank + p, e)
    table["blocks.attn.wkv_a"] = stacked(attn + "kv_a_proj_with_mqa.weight", _rows_in(kv_order), kv_a)
    table["blocks.attn.kv_norm.scale"] = stacked(
        attn + "kv_a_layernorm.weight", common.SAME, (a.kv_lora_rank,)
    )
    kv_b = (n * (c + a.v_head_dim), a.kv_lora_rank)
    table["blocks.attn.wkv_b"] = stacked(attn + "kv_b_proj.weight", common.HEADS_IN, kv_b)
    table["blocks.attn.wo"] = stacked(attn + "o_proj.weight", common.HEADS_OUT, (e, n * a.v_head_dim))
    table["blocks.attn_norm.scale"] = stacked(layer + "input_layernorm.weight", common.SAME, (e,))
    table["blocks.mlp_norm.scale"] = stacked(layer + "post_attention_layernorm.weight", common.SAME, (e,))
    return table


def moe_tensors(m: ModelConfig) -> dict[str, common.Tensor]:
    """Routed experts (one tensor each), the router and its correction bias, the shared experts."""
    e, f, mlp = m.d_model, m.moe.d_ff or m.d_ff, "model.layers.{l}.mlp."
    table = common.moe_tensors(m, EXPERTS)
    bias = mlp + "gate.e_score_correction_bias"
    table["blocks.mlp.router_bias"] = common.Tensor(bias, True, common.SAME, (m.moe.num_experts,))
    if m.moe.shared_experts:
        s = m.moe.shared_experts * f
        for name, hf_name, shape in (
            ("gate", "gate_proj", (s, e)),
            ("up", "up_proj", (s, e)),
            ("down", "down_proj", (e, s)),
        ):
            hf = f"{mlp}shared_experts.{hf_name}.weight"
            table[f"blocks.mlp.shared_{name}"] = common.Tensor(hf, True, common.TRANSPOSED, shape)
    return table


def mtp_tensors(m: ModelConfig) -> dict[str, common.Tensor]:
    """The multi-token prediction modules (model.mtp.depth D): module k at Hugging Face layer
    num_hidden_layers + k - 1, its block of the model's last kind (MoE with experts)."""
    e, layer = m.d_model, "model.layers.{l}."
    mlp = moe_tensors(m) if m.moe.num_experts else common.dense_mlp_tensors(m)
    block = {"mtp.block." + k.removeprefix("blocks."): t for k, t in {**attention_tensors(m), **mlp}.items()}
    table = {
        "mtp.enorm.scale": common.Tensor(layer + "enorm.weight", True, common.SAME, (e,)),
        "mtp.hnorm.scale": common.Tensor(layer + "hnorm.weight", True, common.SAME, (e,)),
        "mtp.eh_proj": common.Tensor(layer + "eh_proj.weight", True, common.TRANSPOSED, (e, 2 * e)),
        "mtp.norm.scale": common.Tensor(layer + "shared_head.norm.weight", True, common.SAME, (e,)),
        **block,
    }
    return {k: t._replace(first=m.n_layers, units=m.mtp.depth, every=1, offset=0) for k, t in table.items()}


def ignored_tensors(m: ModelConfig) -> set[str]:
    """The modules' copies of the shared embedding and output head: read from the model's own."""
    names = ("embed_tokens.weight", "shared_head.head.weight")
    return {f"model.layers.{m.n_layers + k}.{n}" for k in range(m.mtp.depth) for n in names}


def tensor_table(m: ModelConfig) -> dict[str, common.Tensor]:
    table = common.embedding_tensors(m)
    if m.mtp.depth:
        table.update(mtp_tensors(m))
    if not m.moe.num_experts:
        table.update({**attention_tensors(m), **common.dense_mlp_tensors(m)})
    else:  # the dense prefix (first_k_dense_replace layers), then the MoE layers after it
        if common.dense_prefix(m):
            dense = {**attention_tensors(m), **common.dense_mlp_tensors(m)}
            table.update(common.prefix_tensors(m, dense))
        table.update(common.after_prefix(m, {**attention_tensors(m), **moe_tensors(m)}))
    return {**table, **common.head_tensors(m)}


# --- config.json <-> ModelConfig ---------------------------------------------------------------


def _mla_settings(hf: dict, where: str) -> dict:
    q_rank = hf.get("q_lora_rank")
    if q_rank == 0:
        raise common.refuse(
            where,
            "q_lora_rank=0: transformers builds all-zero queries from it; null means no query latent",
        )
    return {
        "kv_lora_rank": common.read_int(hf, "kv_lora_rank", where),
        "q_lora_rank": common.read_int(hf, "q_lora_rank", where),
        "qk_nope_dim": common.read_int(hf, "qk_nope_head_dim", where),
        "qk_rope_dim": common.read_int(hf, "qk_rope_head_dim", where),
        "v_head_dim": common.read_int(hf, "v_head_dim", where),
        "rope_interleave": common.read_bool(hf, "rope_interleave", where, True),
    }


def _moe_settings(hf: dict, layers: int, where: str) -> dict:
    """model.moe.*: none when every layer is dense (first_k_dense_replace >= the layers), else
    the layers after the first first_k_dense_replace (model.moe.first_dense) are MoE layers."""
    dense = common.read_int(hf, "first_k_dense_replace", where, 3, least=0)
    if dense >= layers:
        return {"num_experts": 0}
    experts = common.read_int(hf, "n_routed_experts", where)
    top_k = common.read_int(hf, "num_experts_per_tok", where)
    groups = common.read_int(hf, "n_group", where, 1)
    topk_groups = common.read_int(hf, "topk_group", where, 1)
    per_group = experts // groups
    if experts % groups or per_group < 2:
        raise ConfigError(
            f"{where}: n_group={groups} with n_routed_experts={experts}: each group needs an equal "
            f"share of at least 2 experts (its score is the sum of its best two); try n_group="
            f"{max(g for g in range(1, experts // 2 + 1) if experts % g == 0)} or fewer"
        )
    norm = common.read_bool(hf, "norm_topk_prob", where, True)
    if norm and top_k < 2:
        raise common.refuse(
            where,
            "norm_topk_prob=true with one expert per token: its weight is routed_scaling_factor, "
            "jaxpar's top-1 router weighs it by its score",
        )
    if topk_groups > groups or top_k > topk_groups * per_group:
        raise ConfigError(
            f"{where}: num_experts_per_tok={top_k} from topk_group={topk_groups} of n_group={groups} "
            f"groups of {per_group} experts: a token can pick from at most "
            f"{min(topk_groups, groups) * per_group} (transformers accepts it and routes wrongly)"
        )
    return {
        "num_experts": experts,
        "first_dense": dense,
        "top_k": top_k,
        "shared_experts": common.read_int(hf, "n_shared_experts", where, 0, least=0),
        "d_ff": common.read_int(hf, "moe_intermediate_size", where),
        "score": "sigmoid",
        "groups": groups,
        "topk_groups": topk_groups,
        "norm_topk": norm,
        "routed_scale": common.read_float(hf, "routed_scaling_factor", where, 1.0, positive=True),
        "aux_loss_weight": 0.0,
        "z_loss_weight": 0.0,
    }


def settings_from_hf(hf: dict, where: str) -> dict:
    common.check_fixed(hf, FIXED_KEYS, where)
    heads, kv_heads = hf.get("num_attention_heads"), hf.get("num_key_value_heads")
    if kv_heads is not None and kv_heads != heads:
        raise common.refuse(
            where,
            f"num_key_value_heads={kv_heads} with num_attention_heads={heads}: latent attention has one each",
        )
    # head_dim names the rotated width here, which base_settings would read as a head's.
    settings = common.base_settings({k: v for k, v in hf.items() if k != "head_dim"}, where)
    settings["mla"] = _mla_settings(hf, where)
    settings["moe"] = _moe_settings(hf, settings["n_layers"], where)
    key = "num_nextn_predict_layers" if "num_nextn_predict_layers" in hf else "num_mtp_layers"
    settings["mtp"] = {"depth": common.read_int(hf, key, where, 0, least=0)}
    return settings


def hf_config(m: ModelConfig) -> dict:
    a, moe = m.mla, m.moe
    config = {
        **common.base_config(m, "DeepseekV3ForCausalLM", "deepseek_v3"),
        "head_dim": a.qk_rope_dim,
        "q_lora_rank": a.q_lora_rank,
        "kv_lora_rank": a.kv_lora_rank,
        "qk_nope_head_dim": a.qk_nope_dim,
        "qk_rope_head_dim": a.qk_rope_dim,
        "v_head_dim": a.v_head_dim,
        "rope_interleave": a.rope_interleave,
        "attention_bias": False,
        "num_mtp_layers": m.mtp.depth,
    }
    if not moe.num_experts:
        return {
            **config,
            "first_k_dense_replace": m.n_layers,
            "n_routed_experts": 1,
            "n_group": 1,
            "topk_group": 1,
        }
    return {
        **config,
        "first_k_dense_replace": moe.first_dense,
        "n_routed_experts": moe.num_experts,
        "num_experts_per_tok": moe.top_k,
        "n_shared_experts": moe.shared_experts,
        "moe_intermediate_size": moe.d_ff or m.d_ff,
        "n_group": moe.groups,
        "topk_group": moe.topk_groups,
        "norm_topk_prob": moe.norm_topk,
        "routed_scaling_factor": moe.routed_scale,
    }
