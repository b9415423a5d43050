"""The MoE router: scores, top-k choice and the router statistics, in float32.

Two scorings (model.moe.score). "softmax" (the default: Switch, Mixtral, Qwen3-MoE): probs =
softmax(logits), the top_k probs chosen. "sigmoid" (DeepSeek-V3, arXiv 2412.19437 sec. 2.1):
scores s = sigmoid(logits); the experts are chosen on s + b, b the per-expert correction bias of
loss-free balancing (no gradient; `jaxpar.models.moe.update_router_bias` moves it once a step),
and the weights are taken from the unbiased s. Either scoring may be group-limited
(model.moe.groups > 1): the experts fall into `groups` equal groups, each token keeps the
`topk_groups` groups whose two best choice scores sum highest and picks its top_k among their
experts only (the others masked to -inf, as DeepSeek's reference model.py does; Hugging Face's
port masks to 0.0, which differs only when a kept score + bias is negative). The chosen weights
are renormalised over the top_k when top_k > 1 (and `normalize`) and multiplied by
model.moe.routed_scale (DeepSeek's routed_scaling_factor).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


class RouterSpec(NamedTuple):
    """How `route` scores and picks (model.moe.*); hashable, part of the compiled layer's key."""

    normalize: bool = True  # top_k > 1: the chosen weights renormalised to sum 1 (norm_topk)
    score: str = "softmax"  # softmax | sigmoid
    groups: int = 1  # expert groups; > 1: group-limited routing
    topk_groups: int = 1  # groups each token may pick from
    scale: float = 1.0  # the routed weights times this (routed_scaling_factor)
    seq_aux: bool = False  # compute the sequence-wise balance loss (`seq_aux_loss`)


class Routing(NamedTuple):
    """Router output for `tokens` tokens and `num_experts` experts."""

    expert_index: jax.Array  # [tokens, top_k] int32, best first
    expert_weight: jax.Array  # [tokens, top_k] float32: top_k > 1 sums to 1, top_k = 1 the prob
    aux_loss: jax.Array  # [] load-balancing loss, 1.0 when perfectly balanced
    z_loss: jax.Array  # [] mean of logsumexp(logits)^2
    expert_load: jax.Array  # [num_experts] int32, (token, choice) pairs routed to each expert
    seq_aux_loss: jax.Array | None = None  # [] sequence-wise balance loss (RouterSpec.seq_aux)


def limit_groups(choice, groups: int, keep: int):
    """choice [tokens, E] with the experts outside each token's `keep` best groups set to -inf;
    a group's score is the sum of its two highest choice scores (DeepSeek-V3)."""
    tokens, num_experts = choice.shape
    grouped = choice.reshape(tokens, groups, num_experts // groups)
    group_score = jnp.sum(jax.lax.top_k(grouped, 2)[0], axis=-1)  # [tokens, groups]
    _, best = jax.lax.top_k(group_score, keep)
    kept = jnp.zeros((tokens, groups), bool).at[jnp.arange(tokens)[:, None], best].set(True)
    return jnp.where(kept[:, :, None], grouped, -jnp.inf).reshape(tokens, num_experts)


def route(x, router_w, *, top_k, token_axes=(), normalize=True, spec=None, bias=None, rows=1, seq_axes=()):
    """Top-k router, in float32.

    x: [tokens, embed] (`rows` sequences, row-major); router_w: [embed, num_experts]; bias:
    [num_experts] or None, added to the scores for the choice only (no gradient). spec: a
    `RouterSpec` (None: softmax, ungrouped, unscaled; `normalize` is used, spec.normalize not).
    Weights: for top_k > 1 the top_k scores renormalised to sum 1 (Mixtral, DeepSeek-V3;
    `normalize`=False: the scores themselves, Qwen3-MoE's norm_topk_prob=false); for top_k = 1
    the chosen expert's score itself (Switch Transformer), since renormalising would make every
    weight 1 and leave the router without a gradient from the output. Statistics are global over
    `token_axes` (mesh axes the tokens are split over, `seq_axes` among them the ones that split
    the sequence; `psum` when called inside a shard_map, none outside). With p the affinities
    (softmax: the probs; sigmoid: s / sum_j s_j):

      aux_loss = E * sum_e f_e * p_e, f_e = fraction of (token, choice) pairs routed to e,
                 p_e = mean affinity of e (Switch Transformer, Fedus et al. 2021, eq. 4;
                 f_e carries no gradient);
      z_loss   = mean over tokens of logsumexp(logits)^2 (ST-MoE, Zoph et al. 2022, eq. 5);
      seq_aux_loss (spec.seq_aux) = mean over sequences of sum_e f_e * P_e, with per sequence
                 f_e = E / (top_k * T) * (its tokens choosing e; no gradient), P_e = mean over
                 its T tokens of p_e (DeepSeek-V3 eq. 17-20).
    """
    spec = RouterSpec() if spec is None else spec
    num_experts = router_w.shape[-1]
    logits = jnp.dot(x.astype(jnp.float32), router_w.astype(jnp.float32))  # [tokens, E]
    if spec.score == "sigmoid":
        scores = jax.nn.sigmoid(logits)
        affinity = scores / jnp.sum(scores, axis=-1, keepdims=True)
    else:
        scores = affinity = jax.nn.softmax(logits, axis=-1)
    if bias is None and spec.groups == 1:
        top_scores, expert_index = jax.lax.top_k(scores, top_k)  # [tokens, top_k]
    else:
        choice = jax.lax.stop_gradient(scores)
        if bias is not None:
            choice = choice + jax.lax.stop_gradient(bias.astype(jnp.float32))
        if spec.groups > 1:
            choice = limit_groups(choice, spec.groups, spec.topk_groups)
        expert_index = jax.lax.top_k(choice, top_k)[1]
        top_scores = jnp.take_along_axis(scores, expert_index, axis=-1)
    expert_weight = top_scores
    if top_k > 1 and normalize:
        total_score = jnp.sum(top_scores, axis=-1, keepdims=True)
        if spec.score == "sigmoid":
            total_score = total_score + 1e-20  # as Hugging Face's DeepseekV3 does
        expert_weight = top_scores / total_score
    if spec.scale != 1.0:
        expert_weight = expert_weight * spec.scale

    def total(value, axes=token_axes):
        return jax.lax.psum(value, axes) if axes else value

    tokens = total(jnp.float32(x.shape[0]))
    expert_load = total(jnp.zeros(num_experts, jnp.int32).at[expert_index.reshape(-1)].add(1))
    routed_fraction = jax.lax.stop_gradient(expert_load.astype(jnp.float32) / (tokens * top_k))
    mean_prob = total(jnp.sum(affinity, axis=0)) / tokens
    aux_loss = num_experts * jnp.sum(routed_fraction * mean_prob)
    z_loss = total(jnp.sum(jax.nn.logsumexp(logits, axis=-1) ** 2)) / tokens
    routing = Routing(expert_index.astype(jnp.int32), expert_weight, aux_loss, z_loss, expert_load)
    if not spec.seq_aux:
        return routing
    # Per sequence: its tokens lie in this device's row and the same row of its `seq_axes` peers.
    seq_axes = tuple(a for a in seq_axes if a in token_axes)
    batch_axes = tuple(a for a in token_axes if a not in seq_axes)
    chosen = jnp.zeros((x.shape[0], num_experts), jnp.float32)
    chosen = chosen.at[jnp.arange(x.shape[0])[:, None], expert_index].add(1.0)
    counts = total(chosen.reshape(rows, -1, num_experts).sum(1), seq_axes)  # [rows, E]
    seq_len = total(jnp.float32(x.shape[0] // rows), seq_axes)
    fraction = jax.lax.stop_gradient(counts * num_experts / (top_k * seq_len))
    mean_affinity = total(affinity.reshape(rows, -1, num_experts).sum(1), seq_axes) / seq_len
    per_sequence = jnp.sum(fraction * mean_affinity, axis=-1)  # [rows]
    seq_aux = total(jnp.sum(per_sequence), batch_axes) / total(jnp.float32(rows), batch_axes)
    return routing._replace(seq_aux_loss=seq_aux)
