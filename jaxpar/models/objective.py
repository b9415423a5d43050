"""The training objective, written once for the plain step and the pipelined one.

Per microstep i (a gradient-accumulation microstep, or a pipeline microbatch) the step minimises

    NLL_i + count_i * (aux_loss_weight * aux_i + z_loss_weight * z_i)

NLL_i the summed next-token negative log-likelihood over its target tokens, count_i their number,
aux_i and z_i the means over the model's MoE layers of that microstep's router load-balancing
loss (Switch Transformer, Fedus et al. 2021) and router z-loss (ST-MoE, Zoph et al. 2022); dense
models have no second term. With model.mtp.depth = D the multi-token prediction modules add
lambda / D * sum_k NLL_k * count / count_k (`jaxpar.models.mtp`; count_k depth k's valid targets
in the whole batch), and with experts their blocks join the router term's mean. Scaled by the
token count, microsteps add up: the step sums them and divides by the whole batch's count
(jaxpar.train).

`objective` is the whole model on a batch; `pipelined_grads` runs the same objective with the
blocks pipelined (`jaxpar.parallel.pipeline`): the model's own pieces do the work (`embed`
and an MoE model's dense prefix, `apply_prefix`, before the pipeline, `run_blocks` for a stage's
chunk of layers, `head_loss` and the multi-token modules on the last stage), and each stage adds
its own layers' share of the router term (`router_penalty`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxpar.models import mtp as mtp_lib
from jaxpar.models.llama import PREFIX
from jaxpar.models.moe import moe_layers
from jaxpar.parallel.pipeline import (
    merge_microbatches,
    pipeline_value_and_grad,
    pipeline_value_grad_and_stats,
    split_microbatches,
    stack_stages,
    unstack_stages,
)
from jaxpar.parallel.schedule import Schedule, schedule_for_mesh

# Router statistics reported as means (seq_aux_loss: only with model.moe.seq_aux_loss_weight > 0)
MOE_MEANS = ("aux_loss", "z_loss", "dropped_fraction", "seq_aux_loss")


def router_penalty(moe, stats: dict, count, layers: int):
    """count * (aux_loss_weight * aux + z_loss_weight * z [+ seq_aux_loss_weight * seq]), where
    aux, z (and seq, DeepSeek-V3's sequence-wise loss, where the router computes it) are the
    router losses in `stats` (stacked over layers) summed and divided by the model's MoE
    `layers`: the model's means when `stats` holds every MoE layer, a pipeline chunk's share of
    them when it holds the chunk's. `count` carries no gradient (the caller stops it)."""
    aux = jnp.sum(stats["aux_loss"]) / layers
    z = jnp.sum(stats["z_loss"]) / layers
    penalty = moe.aux_loss_weight * aux + moe.z_loss_weight * z
    if "seq_aux_loss" in stats:
        penalty = penalty + moe.seq_aux_loss_weight * jnp.sum(stats["seq_aux_loss"]) / layers
    return count * penalty


def objective(graphdef, params, batch: dict, *, chunks: int):
    """The objective of one microstep (module docstring) and its statistics: (value, {"nll":
    summed NLL, "count": tokens}, and for MoE models the router statistics: aux_loss, z_loss,
    dropped_fraction as means over the MoE layers, expert_load [MoE layers, experts]).

    graphdef, params: the model (a jaxpar Transformer) split; params a pure dict. batch: {inputs,
    targets, positions, segment_ids, loss_mask}, each [batch, seq]. chunks: the loss's sequence
    chunks (jaxpar.models.loss)."""
    model = nnx.merge(graphdef, params)
    cfg = model.cfg
    if cfg.mtp.depth:  # multi-token prediction's modules on the last hidden states
        h, moe_stats = model.hidden(batch)
        nll, count = model.head_loss(
            model.head_params(params), h, batch["targets"], batch["loss_mask"], chunks=chunks
        )
    else:
        nll, count, moe_stats = model.loss(batch, chunks=chunks)
    aux, value = {"nll": nll, "count": count}, nll
    layers = mtp_lib.router_layers(cfg)
    if moe_stats:
        aux.update({k: jnp.mean(moe_stats[k]) for k in MOE_MEANS if k in moe_stats})
        aux["expert_load"] = moe_stats["expert_load"]
        value = value + router_penalty(cfg.moe, moe_stats, jax.lax.stop_gradient(count), layers)
    if cfg.mtp.depth:
        added, mtp_aux = mtp_lib.objective_terms(
            model,
            mtp_lib.head_params(model, params),
            h,
            batch,
            jax.lax.stop_gradient(count),
            chunks=chunks,
            penalty_fn=lambda stats, n: router_penalty(cfg.moe, stats, n, layers),
        )
        value = value + added
        aux.update(mtp_aux)
    return value, aux


def _embed_before_pipeline(graphdef, params, batch):
    """(the pipeline's input [batch, seq, embed], its vjp: cotangent -> (the embedding's
    gradient, the dense prefix's as {"dense_blocks": ...} or {})). The embedding and an MoE
    model's dense prefix (model.moe.first_dense, its weights whole on every stage) run before
    the pipeline, on the whole batch."""
    prefix = {k: params[k] for k in (PREFIX,) if k in params}

    def embed(table, prefix):
        whole = nnx.merge(graphdef, {**params, "embedding": table, **prefix})
        return whole.apply_prefix(whole.embed(batch["inputs"]), batch["positions"], batch["segment_ids"])

    return jax.vjp(embed, params["embedding"], prefix)


def _chunk_fns(model, layers: int):
    """The pipeline's chunk functions: (a dense chunk: h, an MoE chunk: (h, its router term,
    its statistics)); `layers` the MoE layers the router terms are averaged over."""

    def blocks(chunk_params, h, side):
        positions, segment_ids, _ = side
        return model.run_blocks(chunk_params, h, positions, segment_ids)[0]

    def moe_blocks(chunk_params, h, side):
        positions, segment_ids, loss_mask = side
        h, stats = model.run_blocks(chunk_params, h, positions, segment_ids)
        count = jax.lax.stop_gradient(jnp.sum(loss_mask))
        penalty = router_penalty(model.cfg.moe, stats, count, layers)
        stats = {k: jax.lax.stop_gradient(x) for k, x in stats.items()}
        return h, penalty.astype(jnp.float32), {**stats, "penalty": jax.lax.stop_gradient(penalty)}

    return blocks, moe_blocks


def _head_fn(model, layers: int, loss_chunks: int):
    """The last stage's head: the summed NLL of the targets t, or with model.mtp.depth (NLL and
    the modules' terms, {"nll": NLL, the modules' statistics})."""

    def head(head_params, h, t):
        return model.head_loss(head_params, h, t["targets"], t["loss_mask"], chunks=loss_chunks)[0]

    def mtp_head(head_params, h, t):
        nll = head(head_params, h, t)
        count = jax.lax.stop_gradient(jnp.sum(t["loss_mask"]))
        added, aux = mtp_lib.objective_terms(
            model,
            head_params,
            h,
            t,
            count,
            chunks=loss_chunks,
            penalty_fn=lambda stats, n: router_penalty(model.cfg.moe, stats, n, layers),
            whole_table=True,
        )
        return nll + added, {"nll": jax.lax.stop_gradient(nll), **aux}

    return mtp_head if model.cfg.mtp.depth else head


def pipelined_grads(
    model, params, batch, *, schedule: Schedule, mesh, loss_chunks: int, axis_name="pipe", row_axes=("data",)
):
    """The gradients of `objective`, summed over the batch, with `model`'s blocks pipelined
    over `axis_name`.

    model: a jaxpar Transformer (abstract is enough: only its structure and config are read).
    params: the model's parameters as a pure dict; batch: {inputs, targets, positions,
        segment_ids, loss_mask}, each [batch, seq] (already in ring attention's layout when the
        model has one: positions and segment ids travel with their tokens).
    row_axes: the mesh axes that split only the batch rows, parameters replicated over them
        (`Layout.row_axes`; `pipeline_value_and_grad`); none for MoE and float8 models whatever
        given.

    Returns (gradients of the summed objective, shaped like params; {"nll": summed NLL, "count":
    tokens}, and for MoE models the router statistics). Activations and their gradients travel
    between stages in model.dtype.

    MoE: per microbatch, a stage adds its own layers' share of the router term
    (`router_penalty`) as its chunk's loss. The statistics are those the step reports for
    accumulated microsteps: aux_loss, z_loss, dropped_fraction summed over microbatches and
    divided by their number (so the step's division by parallel.grad_accum gives the mean),
    expert_load [MoE layers, experts] summed over microbatches.
    """
    cfg = model.cfg
    layers, depth = mtp_lib.router_layers(cfg), cfg.mtp.depth
    if layers or cfg.fp8:
        row_axes = ()  # the chunk couples its rows (`row_axes_for`)
    # Zero-bubble reaches ZB-H1's bubble where the chunk is collective-free (schedule_for_mesh);
    # `inspect --schedule` and the planner make the same choice.
    schedule = schedule_for_mesh(schedule, dict(mesh.shape), axis_name, row_axes=row_axes)
    p, m, v = schedule.stages, schedule.microbatches, schedule.virtual_stages
    graphdef = nnx.graphdef(model)

    blocks, moe_blocks = _chunk_fns(model, layers)
    head = _head_fn(model, layers, loss_chunks)
    x, embed_vjp = _embed_before_pipeline(graphdef, params, batch)
    micro = split_microbatches(batch, m)
    targets = {k: micro[k] for k in ("targets", "loss_mask")}
    if depth:  # the modules run on the last stage, with the head
        targets.update(mtp_lib.depth_fields(micro, depth))
    args = (
        head,
        stack_stages(params["blocks"], p, v),
        mtp_lib.head_params(model, params) if depth else model.head_params(params),
        split_microbatches(x, m),
        targets,
    )
    side = (micro["positions"], micro["segment_ids"], micro["loss_mask"])
    kwargs = {
        "schedule": schedule,
        "mesh": mesh,
        "side": side,
        "axis_name": axis_name,
        "head_aux": bool(depth),
    }
    if moe_layers(cfg):
        value, (stage_grads, head_grads, input_grads), stats = pipeline_value_grad_and_stats(
            moe_blocks, *args, **kwargs
        )
    else:
        value, (stage_grads, head_grads, input_grads) = pipeline_value_and_grad(
            blocks, *args, row_axes=row_axes, **kwargs
        )
    value, head_aux = value if depth else (value, {})
    embedding_grad, prefix_grads = embed_vjp(merge_microbatches(input_grads))
    grads = {**head_grads, **prefix_grads, "blocks": unstack_stages(stage_grads, p, v)}
    grads["embedding"] = embedding_grad + head_grads.get("embedding", 0.0)  # tied or MTP: both uses
    aux = {"nll": value, "count": jnp.sum(batch["loss_mask"]), **head_aux}
    if moe_layers(cfg):
        per_layer = unstack_stages(stats, p, v)  # [MoE layers, ...], summed over microbatches
        aux["nll"] = head_aux.get("nll", value - jnp.sum(per_layer["penalty"]))
        aux.update({k: jnp.mean(per_layer[k]) / m for k in MOE_MEANS if k in per_layer})
        aux["expert_load"] = per_layer["expert_load"]
    return grads, aux
