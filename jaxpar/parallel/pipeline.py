"""Pipeline parallelism, the runtime: one shard_map that runs a schedule's lowered table
(`jaxpar.parallel.schedule`: GPipe, 1F1B, interleaved 1F1B, zero-bubble) tick by tick.

A tick runs each stage's actions from its row of the table, then one exchange passes activations
to the next device and gradients to the previous one (`jax.lax.ppermute`, both hand-offs at the
same point).

The loop each device runs, its buffers, stashes and control flow, is
`jaxpar.parallel.pipeline_loop`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpar.parallel.pipeline_loop import Program, device_loop
from jaxpar.parallel.schedule import Schedule, collective_free

# ----------------------------------------------------------------------------- layouts


def stack_stages(layer_params, stages: int, virtual_stages: int = 1):
    """[layers, ...] leaves -> [stages*v, layers/(stages*v), ...]; row s*v + j is model chunk j*p+s.

    Sharding dim 0 over the pipe axis then puts chunk c on device c % stages, as the interleaved
    schedule expects (for v=1 this is a plain reshape). Lay params out this way once, at init;
    `unstack_stages` is the inverse.
    """
    p, v = stages, virtual_stages

    def stack(a):
        if a.shape[0] % (p * v):
            raise ValueError(f"layers={a.shape[0]} is not divisible by stages*virtual_stages={p}*{v}={p * v}")
        chunks = a.reshape(v, p, a.shape[0] // (p * v), *a.shape[1:])
        return chunks.swapaxes(0, 1).reshape(p * v, *chunks.shape[2:])

    return jax.tree.map(stack, layer_params)


def unstack_stages(stage_params, stages: int, virtual_stages: int = 1):
    """Inverse of `stack_stages`: [stages*v, layers_per_chunk, ...] -> [layers, ...]."""

    def unstack(a):
        chunks = a.reshape(stages, virtual_stages, *a.shape[1:]).swapaxes(0, 1)
        return chunks.reshape(-1, *a.shape[2:])

    return jax.tree.map(unstack, stage_params)


def split_microbatches(batch, microbatches: int):
    """[batch, ...] leaves -> [microbatches, batch/microbatches, ...].

    Microbatch i holds rows i, i+m, i+2m, ...: a batch dim sharded over data/fsdp in blocks stays
    sharded the same way on the microbatch dim, without communication.
    """

    def split(a):
        if a.shape[0] % microbatches:
            raise ValueError(f"batch={a.shape[0]} does not split into microbatches={microbatches}")
        return a.reshape(a.shape[0] // microbatches, microbatches, *a.shape[1:]).swapaxes(0, 1)

    return jax.tree.map(split, batch)


def merge_microbatches(microbatched):
    """Inverse of `split_microbatches`: [microbatches, microbatch, ...] -> [batch, ...]."""
    return jax.tree.map(lambda a: a.swapaxes(0, 1).reshape(-1, *a.shape[2:]), microbatched)


# ----------------------------------------------------------------------------- entry points


def pipeline_value_and_grad(
    stage_fn: Callable[..., jax.Array],
    head_fn: Callable[[Any, jax.Array, Any], jax.Array],
    stage_params: Any,
    head_params: Any,
    inputs: jax.Array,
    targets: Any,
    *,
    schedule: Schedule,
    mesh: jax.sharding.Mesh,
    axis_name: str = "pipe",
    side: Any = None,
    row_axes: tuple[str, ...] = ("data",),
    head_aux: bool = False,
):
    """Loss and gradients of a pipelined layer stack followed by a head.

    loss = sum over microbatches i of head_fn(head_params, stack(inputs[i]), targets[i]);
    make head_fn divide by the number of microbatches (or tokens) to get a mean.

    stage_fn(chunk_params, h) -> h: one chunk; chunk_params leaves are [layers_per_chunk, ...],
        h is [microbatch, ...] and keeps its shape and dtype.
    head_fn(head_params, h, targets_i) -> scalar float32 loss of one microbatch (last stage).
    stage_params: leaves [stages*v, layers_per_chunk, ...] in `stack_stages` order, dim 0 sharded
        over `axis_name`.
    head_params: any pytree, replicated over `axis_name`.
    inputs: [microbatches, microbatch, ...] activations: the caller embeds (split_microbatches)
        and backprops input_grads through its embedding.
    targets: pytree with leaves [microbatches, microbatch, ...].
    side: optional pytree with leaves [microbatches, microbatch, ...] that every stage reads and
        nobody differentiates (token positions, document ids); with it, stage_fn is called as
        stage_fn(chunk_params, h, side_i).

    Returns (loss, (stage_grads, head_grads, input_grads)), shaped like stage_params, head_params,
    inputs. `axis_name` is manual inside the shard_map, and so are the row axes of size > 1
    (below); the other mesh axes stay automatic, so GSPMD keeps fsdp / tensor / context /
    expert shardings of the arguments. Collectives: per tick one ppermute of an activation to
    stage+1 and one of a gradient to stage-1 (around the ring when v > 1); at the end a psum
    over `axis_name` of loss, head grads and input grads (each of which only one stage
    computed), and over the row axes of the loss, head and stage grads.

    row_axes: mesh axes that split only the rows of a microbatch here, the parameters replicated
    over them (`row_axes_for`: `data`, and `fsdp` where ZeRO shards no parameters or gradients).
    Those of size > 1 are manual too, and each microbatch's rows (dim 1 of inputs, targets, side)
    are split over them, in this order: head_fn then sees one device's rows, so its loss must be
    a sum over rows times constants (the model's summed NLL, a sum divided by the whole batch
    size), and the data-parallel sums run once, after the loop. Left automatic, XLA's GPU
    compiler all-reduced every backward's weight gradients over them inside the loop (the H100
    program, jax 0.12.0.1; XLA:CPU's does not). A stage_fn that couples rows (float8 per-tensor
    scales) must be given no row axes.

    A stage-dependent schedule (`schedule.stage_dependent`, see `schedule_for_mesh`) needs a
    collective-free chunk: every mesh axis but `axis_name` and the manual row axes of size 1
    (else ValueError).

    head_aux: head_fn returns (loss, aux), aux a pytree of float arrays (not differentiated)
    summed over microbatches and devices like the loss; the result's loss is then (loss, aux).
    """
    if side is None:
        side = jnp.zeros(inputs.shape[:2], jnp.int32)  # [microbatches, rows]: splits as inputs do

        def chunk_fn(params, h, _):  # no loss of its own, no statistics
            return stage_fn(params, h), jnp.zeros((), jnp.float32), {}
    else:

        def chunk_fn(params, h, side_i):
            return stage_fn(params, h, side_i), jnp.zeros((), jnp.float32), {}

    loss, grads, _ = _run(
        Program(chunk_fn, head_fn, schedule, axis_name, row_axes, head_aux),
        mesh,
        stage_params,
        head_params,
        inputs,
        targets,
        side,
    )
    return loss, grads


def pipeline_value_grad_and_stats(
    chunk_fn: Callable[..., tuple[jax.Array, jax.Array, Any]],
    head_fn: Callable[[Any, jax.Array, Any], jax.Array],
    stage_params: Any,
    head_params: Any,
    inputs: jax.Array,
    targets: Any,
    *,
    schedule: Schedule,
    mesh: jax.sharding.Mesh,
    side: Any,
    axis_name: str = "pipe",
    head_aux: bool = False,
):
    """`pipeline_value_and_grad` for chunks with a loss of their own (an MoE router's
    auxiliary and z losses) and statistics: chunk_fn(chunk_params, h, side_i) -> (h, loss,
    stats), loss a float32 scalar that enters the objective beside the head's (differentiated
    with cotangent 1), stats a pytree of arrays, summed over microbatches per chunk and not
    differentiated (router statistics).

    Returns (loss, (stage_grads, head_grads, input_grads), stats), the stats with leaves
    [stages*v, ...] in `stack_stages` order. No row axes: a chunk's own loss is not a sum over
    rows, so every mesh axis but `axis_name` stays automatic (GSPMD reduces over data inside).
    head_aux: as `pipeline_value_and_grad`'s.
    """
    return _run(
        Program(chunk_fn, head_fn, schedule, axis_name, (), head_aux),
        mesh,
        stage_params,
        head_params,
        inputs,
        targets,
        side,
    )


def _check(program: Program, mesh, stage_params, inputs) -> None:
    """ValueError, naming the numbers, unless the arguments fit the schedule and the mesh."""
    schedule, axis_name, rows_axes = program.schedule, program.axis_name, program.rows_axes
    p, m, v = schedule.stages, schedule.microbatches, schedule.virtual_stages
    if mesh.shape[axis_name] != p:
        raise ValueError(f"mesh axis {axis_name}={mesh.shape[axis_name]} but schedule has stages={p}")
    if schedule.stage_dependent and not collective_free(dict(mesh.shape), axis_name, rows_axes):
        raise ValueError(
            f"a stage-dependent schedule needs a collective-free chunk: every mesh axis but "
            f"{axis_name!r} and the row axes {rows_axes} of size 1 (a chunk with its own loss: "
            f"no row axes), got {dict(mesh.shape)}"
        )
    row_devices = int(np.prod([mesh.shape[a] for a in rows_axes]))
    if inputs.shape[1] % row_devices:
        raise ValueError(
            f"microbatch rows={inputs.shape[1]} do not split over {'x'.join(rows_axes)}={row_devices}"
        )
    for leaf in jax.tree.leaves(stage_params):
        if leaf.shape[0] != p * v:
            raise ValueError(
                f"stage_params leading dim {leaf.shape[0]} != "
                f"stages*virtual_stages={p}*{v}; lay them out with stack_stages"
            )
    if inputs.shape[0] != m:
        raise ValueError(
            f"inputs leading dim {inputs.shape[0]} != microbatches={m}; "
            "reshape to [microbatches, microbatch, ...]"
        )


def _run(program: Program, mesh, stage_params, head_params, inputs, targets, side):
    """The shard_map over `program.axis_name` and the row axes of size > 1: (loss, (stage_grads,
    head_grads, input_grads), stats)."""
    # The row axes of size > 1 are manual too: a device computes on its own rows of each
    # microbatch and the data-parallel sums of the loss and the gradients run once, after the
    # loop. Left automatic, GSPMD all-reduced each backward's weight gradients and the head's
    # over them inside the loop, every tick (m + p - 1 all-reduces of a stage's gradients per
    # step instead of one), and inside a stage-dependent switch such a collective would hang.
    rows_axes = tuple(a for a in program.rows_axes if mesh.shape.get(a, 1) > 1)
    program = program._replace(rows_axes=rows_axes)
    _check(program, mesh, stage_params, inputs)
    axis_name = program.axis_name
    rows = P(None, rows_axes or None)  # [microbatches, rows, ...]: rows split over rows_axes
    mapped = jax.shard_map(
        functools.partial(device_loop, program),
        mesh=mesh,
        axis_names={axis_name, *rows_axes},
        in_specs=(P(axis_name), P(), rows, rows, rows),
        out_specs=(P(), (P(axis_name), P(), rows), P(axis_name), P()),
        # The carried buffers start equal on every stage and become per-stage after the first
        # ppermute; skipping the replication check avoids pvary/pcast, whose API moves in 0.10-0.12.
        check_vma=False,
    )
    loss, grads, stats, head_aux = mapped(
        _split_over(stage_params, mesh, axis_name),
        head_params,
        *(_split_over(tree, mesh, rows_axes, dim=1) for tree in (inputs, targets, side)),
    )
    return (loss, head_aux) if program.head_aux else loss, grads, stats


def _split_over(tree, mesh, axis_name: str | tuple[str, ...], dim: int = 0):
    """On a mesh whose `axis_name` (one axis or several) is Explicit, shard_map wants its inputs
    already laid out as its in_specs say: put dim `dim` of every leaf on that axis; dim 0 (the
    stages) keeps the other dims as they were, dim 1 (microbatch rows over the row axes) leaves
    the other dims whole. (On Auto axes the shard_map's in_specs place them; no axis: nothing to
    place.)"""
    axes = (axis_name,) if isinstance(axis_name, str) else tuple(axis_name)
    types = dict(zip(mesh.axis_names, mesh.axis_types))
    if not axes or not any(types[a] == jax.sharding.AxisType.Explicit for a in axes):
        return tree
    axis_name = axes[0] if len(axes) == 1 else axes

    def put(leaf):
        spec = (list(jax.typeof(leaf).sharding.spec) if dim == 0 else []) + [None] * leaf.ndim
        spec[dim] = axis_name
        return jax.sharding.reshard(leaf, NamedSharding(mesh, P(*spec[: leaf.ndim])))

    return jax.tree.map(put, tree)
