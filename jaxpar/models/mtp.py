"""DeepSeek-V3 multi-token prediction (model.mtp): D modules after the model, training only.

Module k (k = 1..D) at position i reads the previous depth's hidden state (depth 0: the model's
last hidden state, before the final norm) and the embedding of token t_{i+k} from the shared
table, and predicts t_{i+k+1} through its own final norm and the shared output head
(`jaxpar.models.llama.MTPModule`). The step minimises, per microstep,

    NLL + lambda / D * sum_k NLL_k * count / count_k

where NLL_k is the summed cross entropy of depth k's valid predictions and count_k their number
over the whole batch (count the main loss's): divided by count, as the step divides, it is the
main mean loss plus lambda times the mean over k of the depth losses, each the mean over its own
valid targets, whatever the microsteps, microbatches or devices.

The shifted tokens, targets and weights are batch fields made inside the step from the batch in
its ordinary order (`with_fields`, before ring attention's permutation and the microbatch split,
which then carry them like the other [batch, seq] fields). Position i's depth-k target is valid
only while t_{i+k+1} belongs to position i's document and lies within the row: i + k < seq, the
segment ids at i and i + k equal, and the loss mask at i + k on (a document's last token, whose
target is the next document's first, has its mask off).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxpar.models import moe as moe_lib
from jaxpar.models.llama import MTP, lookup
from jaxpar.models.loss import chunked_cross_entropy
from jaxpar.models.moe import moe_layers
from jaxpar.sharding import constrain

FIELDS = ("inputs", "targets", "weights")  # the batch fields of each depth: mtp_<field>_<k>


def field(name: str, k: int) -> str:
    """The batch key of depth k's (1-based) `name` (one of FIELDS)."""
    return f"mtp_{name}_{k}"


def shift(a, k: int, fill=0):
    """a [batch, seq] moved k positions to the left along seq: out[:, i] = a[:, i + k], `fill`
    past the row's end."""
    pad = jnp.full((a.shape[0], k), fill, a.dtype)
    return jnp.concatenate([a[:, k:], pad], axis=1)


def with_fields(batch: dict, depth: int) -> dict:
    """The batch (in ordinary sequence order, whole) with each depth's fields added: the tokens
    its module embeds (t_{i+k}), its targets (t_{i+k+1}) and its per-token loss weights, valid
    (module docstring) times count / count_k, so that summing weight * NLL gives the depth's
    mean scaled to the main loss's token count."""
    if not depth:
        return batch
    out, mask = dict(batch), batch["loss_mask"]
    count = jnp.sum(mask)
    for k in range(1, depth + 1):
        same = shift(batch["segment_ids"], k, -1) == batch["segment_ids"]
        valid = jnp.where(same, shift(mask, k), 0.0).astype(mask.dtype)
        scale = count / jnp.maximum(jnp.sum(valid), 1.0)
        out[field("inputs", k)] = shift(batch["inputs"], k)
        out[field("targets", k)] = shift(batch["targets"], k)
        out[field("weights", k)] = valid * scale.astype(mask.dtype)
    return out


def depth_fields(batch: dict, depth: int) -> dict:
    """The part of a batch (or microbatch) the modules read: positions, segment ids and every
    depth's fields."""
    keys = ["positions", "segment_ids"] + [field(f, k) for k in range(1, depth + 1) for f in FIELDS]
    return {key: batch[key] for key in keys}


def router_layers(cfg) -> int:
    """The MoE layers the router terms are averaged over: the model's, and with experts each
    module's block (an MoE block, as in DeepSeek-V3)."""
    return moe_layers(cfg) + (cfg.mtp.depth if cfg.moe.num_experts else 0)


def head_params(model, params: dict) -> dict:
    """What `losses` reads of a pure-dict params tree: the modules, the embedding and the output
    head (`Transformer.head_params`)."""
    return {**model.head_params(params), MTP: params[MTP], "embedding": params["embedding"]}


def _depths(model, params: dict, h, fields: dict, inputs=None, whole_table: bool = False):
    """Runs the modules in turn on the model's last hidden states h [batch, seq, embed]; yields
    (k, depth k's hidden states through its final norm, its block's router statistics or {}).
    inputs: the tokens each depth embeds ([batch, seq] per depth), else the fields'.
    whole_table: the embedding table gathered whole before the lookups (in the pipeline's
    shard_map, a lookup from a table split over tensor and fsdp aborts XLA:CPU's SPMD
    partitioner, jax 0.12: pipe 2 x fsdp 2 x tensor 2 under ZeRO-3)."""
    cfg = model.cfg
    dtype = jnp.dtype(cfg.dtype)
    graphdef = nnx.graphdef(getattr(model, MTP))
    table = constrain(params["embedding"], (None, None)) if whole_table else params["embedding"]
    for k in range(1, cfg.mtp.depth + 1):
        module = nnx.merge(graphdef, jax.tree.map(lambda a, k=k: a[k - 1], params[MTP]))
        tokens = fields[field("inputs", k)] if inputs is None else inputs[k - 1]
        embedded = lookup(table, tokens, dtype, model.grad_dtype)
        if cfg.embed_scale:
            embedded = embedded * jnp.asarray(cfg.d_model**0.5, embedded.dtype)
        embedded = constrain(embedded, ("batch", "act_seq", "embed"))
        h, stats = module(h, embedded, fields["positions"], fields["segment_ids"])
        yield k, module.norm(h), stats


def _output_weight(model, params: dict):
    return params["embedding"].T if model.cfg.tie_embeddings else params["lm_head"]


def losses(model, params: dict, h, fields: dict, *, chunks: int, whole_table: bool = False):
    """The modules on the model's last hidden states h [batch, seq, embed]: ([weighted summed
    NLL of each depth], [each depth's router statistics, or {}]). params: `head_params`; fields:
    `depth_fields` (in the batch's layout: a ring's, a microbatch's); whole_table: `_depths`'."""
    nlls, stats = [], []
    for k, normed, block_stats in _depths(model, params, h, fields, whole_table=whole_table):
        nll, _ = chunked_cross_entropy(
            normed,
            _output_weight(model, params),
            fields[field("targets", k)],
            fields[field("weights", k)],
            dtype=jnp.dtype(model.cfg.dtype),
            chunks=chunks,
            grad_dtype=model.grad_dtype,
        )
        nlls.append(nll)
        stats.append(block_stats)
    return nlls, stats


def logits(model, batch: dict, inputs) -> list:
    """Each depth's float32 logits [batch, seq, vocab] on a batch in ordinary order (inputs,
    positions, segment_ids), depth k's module embedding inputs[k - 1] [batch, seq]: what its
    loss scores (tests/test_mtp.py checks the shifted targets against them)."""
    h, _ = model.hidden(batch)
    params = head_params(model, nnx.to_pure_dict(nnx.state(model)))
    weight = _output_weight(model, params).astype(jnp.dtype(model.cfg.dtype))
    return [
        (normed @ weight).astype(jnp.float32) for _, normed, _ in _depths(model, params, h, batch, inputs)
    ]


def objective_terms(
    model, params: dict, h, fields: dict, count, *, chunks: int, penalty_fn, whole_table: bool = False
):
    """(what the modules add to a microstep's objective, their statistics: mtp_nll_<k> (the
    weighted summed NLL), and with experts mtp_expert_load [D, experts] and mtp_penalty).
    `count`: the microstep's token count (no gradient); penalty_fn(stats, count) the router term
    of stacked statistics (`objective.router_penalty` over `router_layers`)."""
    cfg = model.cfg
    nlls, stats = losses(model, params, h, fields, chunks=chunks, whole_table=whole_table)
    added = cfg.mtp.weight / cfg.mtp.depth * sum(nlls)
    aux = {f"mtp_nll_{k}": jax.lax.stop_gradient(nll) for k, nll in enumerate(nlls, 1)}
    if stats[0]:
        stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *stats)
        penalty = penalty_fn(stacked, count)
        added = added + penalty
        aux["mtp_penalty"] = jax.lax.stop_gradient(penalty)
        aux["mtp_expert_load"] = jax.lax.stop_gradient(stacked["expert_load"])
    return added, aux


def update_router_bias(params: dict, aux: dict, rate: float) -> dict:
    """Loss-free balancing (`moe.update_router_bias`) of the model's routers with the loads of
    its MoE layers (aux["expert_load"]), and of the modules' with theirs (mtp_expert_load)."""
    model = {k: v for k, v in params.items() if k != MTP}
    out = moe_lib.update_router_bias(model, aux["expert_load"], rate)
    if MTP in params:
        out[MTP] = moe_lib.update_router_bias(params[MTP], aux["mtp_expert_load"], rate)
    return out
