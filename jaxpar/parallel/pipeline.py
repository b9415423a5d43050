"""Pipeline parallelism, the runtime: one shard_map that runs a schedule's lowered table
(`jaxpar.parallel.schedule`: GPipe, 1F1B, interleaved 1F1B, zero-bubble) tick by tick.

A tick runs each stage's actions from its row of the table, then one exchange passes activations
to the next device and gradients to the previous one (`jax.lax.ppermute`, both hand-offs at the
same point).

Backward is explicit, not autodiff of a scanned forward: a forward runs `jax.vjp` of the chunk and
stashes the pullback's residuals in a slot of a buffer; the matching backward rebuilds the pullback
from that slot. Zero-bubble splits the backward in two: B applies the pullback for the input
gradient only (what the previous stage waits for), W applies it again, later, for the weight
gradient only; XLA drops the unused half of each. Buffer sizes come from the schedule (a slot is
reused as soon as its last reader has run). What a stash holds is whatever `jax.vjp(stage_fn)`
saves: wrap `stage_fn` (or its layers) in `jax.checkpoint` to stash less; numpy constants among
those residuals (ring attention's layout positions) are not stashed but put back as they are. A
chunk may add a loss of its own (`pipeline_value_grad_and_stats`: an MoE router's aux and z
losses): its forward adds the value, and its backward runs the pullback with cotangent 1 for it
beside the activation gradient, so that loss's gradients reach the chunk's weights and, through
the hand-offs, the earlier stages.

Control flow, uniform (every schedule, and zero-bubble wherever a chunk has collectives): the
same on every device. Each slot runs under `lax.cond` whose predicate is the tick's, not the
stage's: "does any stage run an F this tick" (read from the table); a stage with nothing to do in
a slot that runs computes on a scratch slot and its results are dropped with `jnp.where`. So every
device executes the same collectives in the same order. A stage-dependent branch would not: GSPMD
puts the fsdp / tensor (and context, expert) collectives of a chunk inside the branch that runs
it, and XLA:CPU's collective-permute waits for every device its source-target pairs name, those
of the other stages included -- which sit in another branch: the step hung.

Control flow, stage-dependent (zero-bubble on a collective-free chunk; `schedule_for_mesh`): when
every mesh axis but `pipe` and `data` has size 1, a chunk needs no collective -- `data` is
manual (in both control flows, see `pipeline_value_and_grad`), so each device computes on its own
rows of a microbatch and the data-parallel sums of the loss and the head's and stages' gradients
run once, after the loop (left to GSPMD, they sat inside the W and head branches, all-reduced
every tick). Then a tick is one slot in which each device runs the action its own table row
names (`lax.axis_index` of `pipe` picks the row; the row's `work`: idle / F / F with the head /
B / W) through `lax.switch`, and then the same exchange. MoE chunks with data > 1 stay uniform:
their router losses are not sums over rows.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpar.parallel.schedule import Lowered, Row, Schedule, Work, collective_free, lower_schedule

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


def _residual_layout(chunk_fn, chunk_params, x, side):
    """Trace one chunk's jax.vjp abstractly: the pullback's treedef, and for each residual leaf
    either the index of the chunk-param leaf it is (not stashed: params do not change during the
    step), CONSTANT (kept, in the returned {leaf index: constant}) or STASHED, with its shape
    (stashed per microbatch)."""
    found = {}

    def trace(params, h):
        _, pullback = _chunk_vjp(chunk_fn, params, h, side)
        leaves, found["treedef"] = jax.tree.flatten(pullback)
        if not all(isinstance(leaf, (jax.Array, np.ndarray)) for leaf in leaves):
            raise RuntimeError(
                "jax.vjp's pullback is not a pytree of arrays in this jax "
                f"{jax.__version__}; the pipeline stashes those arrays"
            )
        found["source"] = _param_sources(leaves, params)
        found["constants"] = {
            k: leaf for k, (leaf, src) in enumerate(zip(leaves, found["source"])) if src == CONSTANT
        }
        return [leaf for leaf, src in zip(leaves, found["source"]) if src == STASHED]

    shapes = jax.eval_shape(trace, chunk_params, x)
    return found["treedef"], found["source"], found["constants"], shapes


STASHED, CONSTANT = -1, -2  # `_param_sources` codes of residuals that are not chunk params


def _param_sources(leaves, params) -> list[int]:
    """Per pullback leaf: the index of the chunk-param leaf it is, STASHED (a per-microbatch
    array), or CONSTANT (a numpy constant of the trace, e.g. ring attention's layout positions:
    the same in every trace, so the rebuilt pullback takes it as it is)."""
    param_leaves = jax.tree.leaves(params)

    def source(leaf):
        if isinstance(leaf, np.ndarray):
            return CONSTANT
        return next((k for k, q in enumerate(param_leaves) if leaf is q), STASHED)

    return [source(leaf) for leaf in leaves]


def _chunk_vjp(chunk_fn, params, h, side):
    """jax.vjp of one chunk as the runtime runs it: chunk_fn(params, h, side) -> (h, loss,
    stats); the pullback takes (dh, dloss), stats are not differentiated. Returns ((h, loss,
    stats), pullback)."""

    def chunk(p_, h_):
        y, loss, stats = chunk_fn(p_, h_, side)
        return (y, loss), stats

    (y, loss), pullback, stats = jax.vjp(chunk, params, h, has_aux=True)
    return (y, loss, stats), pullback


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
        _Program(chunk_fn, head_fn, schedule, axis_name, row_axes, head_aux),
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
        _Program(chunk_fn, head_fn, schedule, axis_name, (), head_aux),
        mesh,
        stage_params,
        head_params,
        inputs,
        targets,
        side,
    )


class _Program(NamedTuple):
    """What a pipelined pass runs, the same on every device: chunk_fn(chunk_params, h, side_i)
    -> (h, own loss, stats), the head, the schedule, the pipe axis, and the row axes asked for
    (`pipeline_value_and_grad`; `_run` keeps those of size > 1)."""

    chunk_fn: Callable[..., Any]
    head_fn: Callable[..., Any]
    schedule: Schedule
    axis_name: str
    rows_axes: tuple[str, ...]
    head_aux: bool = False  # head_fn returns (loss, aux): `pipeline_value_and_grad`


def _check(program: _Program, mesh, stage_params, inputs) -> None:
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


def _run(program: _Program, mesh, stage_params, head_params, inputs, targets, side):
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
        functools.partial(_device_loop, program),
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


# ----------------------------------------------------------------------------- one device's loop

_index = functools.partial(jax.lax.dynamic_index_in_dim, axis=0, keepdims=False)
_update = functools.partial(jax.lax.dynamic_update_index_in_dim, axis=0)


@dataclasses.dataclass(frozen=True, eq=False)
class _Device:
    """One device inside the shard_map: its chunks' parameters ([v, layers_per_chunk, ...]), the
    head, its rows of every microbatch, and what tracing one chunk told (the pullback's residual
    layout, the statistics' shapes). Nothing here changes from tick to tick. With manual row axes
    the microbatches hold this device's rows only: the loss and the gradients of the head and
    the stages are partial sums until the psums at the end (`_reduce`)."""

    program: _Program
    lowered: Lowered
    stage_params: Any
    head_params: Any
    inputs: jax.Array  # [microbatches, rows, ...]
    targets: Any
    side: Any
    treedef: Any  # the pullback's
    sources: list[int]  # per pullback leaf: a chunk-param leaf's index, STASHED or CONSTANT
    constants: dict[int, np.ndarray]
    stash_shapes: list[jax.ShapeDtypeStruct]
    stats_shapes: Any
    head_aux_shapes: Any  # the head's aux ({} without `head_aux`)

    @classmethod
    def build(cls, program: _Program, stage_params, head_params, inputs, targets, side):
        h, chunk0 = jnp.zeros_like(inputs[0]), jax.tree.map(lambda a: _index(a, 0), stage_params)
        side0 = jax.tree.map(lambda a: _index(a, 0), side)
        treedef, sources, constants, stash_shapes = _residual_layout(program.chunk_fn, chunk0, h, side0)
        stats_shapes = jax.eval_shape(program.chunk_fn, chunk0, h, side0)[2]
        head_aux_shapes = {}
        if program.head_aux:
            targets0 = jax.tree.map(lambda a: _index(a, 0), targets)
            head_aux_shapes = jax.eval_shape(program.head_fn, head_params, h, targets0)[1]
        return cls(
            program,
            lower_schedule(program.schedule),
            stage_params,
            head_params,
            inputs,
            targets,
            side,
            treedef,
            sources,
            constants,
            stash_shapes,
            stats_shapes,
            head_aux_shapes,
        )

    @property
    def stage(self):
        return jax.lax.axis_index(self.program.axis_name)

    @property
    def zero_bubble(self) -> bool:
        return len(self.program.schedule.slots) == 3  # F, B and W

    def row(self, table_rows) -> Row:
        """This device's row of one tick of the table (`table_rows`: [stages, fields])."""
        return Row(*_index(table_rows, self.stage))

    def chunk_params(self, j):
        return jax.tree.map(lambda a: _index(a, j), self.stage_params)

    def side_of(self, microbatch):
        return jax.tree.map(lambda a: _index(a, microbatch), self.side)

    def h_zeros(self):  # [microbatch, ...]; zeros_like keeps explicit shardings
        return jnp.zeros_like(self.inputs[0])

    def param_zeros(self):
        return jax.tree.map(jnp.zeros_like, self.chunk_params(0))

    def head_zeros(self):
        return jax.tree.map(jnp.zeros_like, self.head_params)

    def stats_zeros(self):
        return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), self.stats_shapes)

    def head_aux_zeros(self):
        return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), self.head_aux_shapes)

    def ring_pairs(self) -> tuple[list, list]:
        """(source, target) pairs of the exchange: activations to the next device, gradients to
        the previous one; around the ring when v > 1 (chunk j*p + p-1, on the last device, feeds
        (j+1)*p, on device 0)."""
        p = self.program.schedule.stages
        ring = self.program.schedule.virtual_stages > 1
        to_next = [(s, (s + 1) % p) for s in range(p if ring else p - 1)]
        return to_next, [(b, a) for a, b in to_next]


class _Carry(NamedTuple):
    """The scan's state on one device: the activation, gradient and stash buffers (activation
    and gradient slot n, one past the last, is scratch), and the sums it builds."""

    acts: jax.Array  # [activation slots + 1, microbatch, ...]
    grads: jax.Array  # [gradient slots + 1, microbatch, ...]
    stash: list  # per stashed residual leaf: [stash slots, ...]
    stage_grads: Any
    head_grads: Any
    input_grads: jax.Array  # [microbatches, microbatch, ...]
    loss: jax.Array
    stats: Any  # leaves [v, ...]
    head_aux: Any  # the head's aux, summed


def _initial_carry(dev: _Device) -> _Carry:
    def buffer(slots, like):
        return jnp.broadcast_to(jnp.zeros_like(like), (slots, *like.shape))

    lowered, h = dev.lowered, dev.h_zeros()
    return _Carry(
        acts=buffer(lowered.activation_slots + 1, h),
        grads=buffer(lowered.gradient_slots + 1, h),
        stash=[
            buffer(lowered.stash_slots, jnp.zeros(s.shape, s.dtype, out_sharding=s.sharding))
            for s in dev.stash_shapes
        ],
        stage_grads=jax.tree.map(jnp.zeros_like, dev.stage_params),
        head_grads=jax.tree.map(jnp.zeros_like, dev.head_params),
        input_grads=jnp.zeros_like(dev.inputs),
        loss=jnp.zeros((), jnp.float32),
        head_aux=dev.head_aux_zeros(),
        stats=jax.tree.map(
            lambda s: jnp.zeros((dev.program.schedule.virtual_stages, *s.shape), s.dtype), dev.stats_shapes
        ),
    )


class _ForwardOut(NamedTuple):
    """A forward's small results; the buffers are written outside the cond or switch that
    computed them (inside, XLA copied them whole)."""

    send_act: jax.Array  # to the next chunk's device
    stash: list  # the stash slot's new contents
    loss: jax.Array  # float32: the head's loss (last chunk) plus the chunk's own
    stats: Any
    dhead: Any  # the head's gradients (last chunk), else zeros
    head_cotangent: jax.Array  # the head's gradient for the last chunk's output
    head_aux: Any  # the head's aux (last chunk), else zeros


class _BackwardOut(NamedTuple):
    send_grad: jax.Array  # the chunk's input gradient, to the previous chunk's device
    dparams: Any  # the chunk's weight gradient (zeros where W computes it)


def _no_forward(dev: _Device, carry: _Carry, row: Row) -> _ForwardOut:
    h = dev.h_zeros()
    return _ForwardOut(
        send_act=h,
        stash=[_index(b, row.f_stash_slot) for b in carry.stash],
        loss=jnp.zeros((), jnp.float32),
        stats=dev.stats_zeros(),
        dhead=dev.head_zeros(),
        head_cotangent=h,
        head_aux=dev.head_aux_zeros(),
    )


def _no_backward(dev: _Device) -> _BackwardOut:
    return _BackwardOut(send_grad=dev.h_zeros(), dparams=dev.param_zeros())


def _pullback(dev: _Device, carry: _Carry, chunk, slot):
    """The pullback of `chunk`, rebuilt from stash slot `slot` and the chunk's params."""
    param_leaves = jax.tree.leaves(dev.chunk_params(chunk))
    rest = iter([_index(b, slot) for b in carry.stash])
    leaves = [
        param_leaves[src] if src >= 0 else dev.constants[k] if src == CONSTANT else next(rest)
        for k, src in enumerate(dev.sources)
    ]
    return jax.tree.unflatten(dev.treedef, leaves)


def _chunk_forward(dev: _Device, carry: _Carry, row: Row):
    """The forward a row's F fields name: (its input, its microbatch, the chunk's (output, own
    loss, stats), the pullback's leaves to stash)."""
    h = jnp.where(row.f_first == 1, _index(dev.inputs, row.f_microbatch), _index(carry.acts, row.f_act_slot))
    params = dev.chunk_params(row.f_chunk)
    out, pullback = _chunk_vjp(dev.program.chunk_fn, params, h, dev.side_of(row.f_microbatch))
    leaves = jax.tree.leaves(pullback)
    if _param_sources(leaves, params) != dev.sources:
        raise RuntimeError("the chunk's vjp residuals changed between traces")
    stashed = [x for x, src in zip(leaves, dev.sources) if src == STASHED]
    return h, row.f_microbatch, out, stashed


def _head(dev: _Device, y, microbatch):
    """The head on the last chunk's output y: (float32 loss, head gradients, y's cotangent, the
    head's aux)."""
    targets = jax.tree.map(lambda a: _index(a, microbatch), dev.targets)
    has_aux = dev.program.head_aux
    grad_fn = jax.value_and_grad(dev.program.head_fn, argnums=(0, 1), has_aux=has_aux)
    loss, (dhead, dy) = grad_fn(dev.head_params, y, targets)
    loss, aux = loss if has_aux else (loss, {})
    return loss.astype(jnp.float32), dhead, dy.astype(dev.inputs.dtype), aux


def _forward_slot(dev: _Device, carry: _Carry, row: Row, head_runs) -> _ForwardOut:
    """Uniform control flow: every stage runs a forward (an idle one on a scratch input, its
    results dropped), and the head where any stage's forward is the last chunk's."""
    on = row.f_on == 1
    h, microbatch, (y, own_loss, stats), new = _chunk_forward(dev, carry, row)
    kept = [_index(b, row.f_stash_slot) for b in carry.stash]
    stash = [jnp.where(on, x, old) for x, old in zip(new, kept)]
    loss, dhead, dy, head_aux = jax.lax.cond(
        head_runs,
        lambda: _head(dev, y, microbatch),
        lambda: (jnp.zeros((), jnp.float32), dev.head_zeros(), dev.h_zeros(), dev.head_aux_zeros()),
    )
    mine = on & (row.f_head == 1)
    loss = jnp.where(mine, loss, 0.0) + jnp.where(on, own_loss.astype(jnp.float32), 0.0)
    return _ForwardOut(
        send_act=y.astype(h.dtype),
        stash=stash,
        loss=loss,
        stats=jax.tree.map(lambda x: jnp.where(on, x, 0), stats),
        dhead=jax.tree.map(lambda d: jnp.where(mine, d, 0), dhead),
        head_cotangent=dy,
        head_aux=jax.tree.map(lambda a: jnp.where(mine, a, 0), head_aux),
    )


def _backward_slot(dev: _Device, carry: _Carry, row: Row) -> _BackwardOut:
    """Uniform B: the chunk's input gradient (to the previous stage), and unless zero-bubble
    defers it to W, its weight gradient."""
    pullback = _pullback(dev, carry, row.b_chunk, row.b_stash_slot)
    dparams, dh = pullback((_index(carry.grads, row.b_grad_slot), jnp.ones((), jnp.float32)))
    if dev.zero_bubble:
        dparams = dev.param_zeros()
    else:
        dparams = jax.tree.map(lambda d: jnp.where(row.b_on == 1, d, 0), dparams)
    return _BackwardOut(send_grad=dh.astype(dev.inputs.dtype), dparams=dparams)


def _weight_slot(dev: _Device, carry: _Carry, row: Row):
    """Zero-bubble's W: the weight gradient from the same stash and cotangent as its B (the
    cotangent of the chunk's own loss is 1)."""
    pullback = _pullback(dev, carry, row.w_chunk, row.w_stash_slot)
    dparams, _ = pullback((_index(carry.grads, row.w_grad_slot), jnp.ones((), jnp.float32)))
    return jax.tree.map(lambda d: jnp.where(row.w_on == 1, d, 0), dparams)


# Stage-dependent control flow (zero-bubble on a collective-free chunk): each device runs the
# one action its own row names, through `lax.switch` over the branches below, in `Work` order.


def _idle(dev: _Device, carry: _Carry, row: Row):
    return _no_forward(dev, carry, row), _no_backward(dev)


def _forward(dev: _Device, carry: _Carry, row: Row, with_head: bool):
    h, microbatch, (y, own_loss, stats), stash = _chunk_forward(dev, carry, row)
    out = _no_forward(dev, carry, row)._replace(
        send_act=y.astype(h.dtype), loss=own_loss.astype(jnp.float32), stats=stats, stash=stash
    )
    if with_head:  # the last chunk: its head's loss, gradient and cotangent
        loss, dhead, dy, head_aux = _head(dev, y, microbatch)
        out = out._replace(loss=out.loss + loss, dhead=dhead, head_cotangent=dy, head_aux=head_aux)
    return out, _no_backward(dev)


def _input_gradient(dev: _Device, carry: _Carry, row: Row):  # B
    pullback = _pullback(dev, carry, row.b_chunk, row.b_stash_slot)
    _, dh = pullback((_index(carry.grads, row.b_grad_slot), jnp.ones((), jnp.float32)))
    return (_no_forward(dev, carry, row), _no_backward(dev)._replace(send_grad=dh.astype(dev.inputs.dtype)))


def _weight_gradient(dev: _Device, carry: _Carry, row: Row):  # W
    return (_no_forward(dev, carry, row), _no_backward(dev)._replace(dparams=_weight_slot(dev, carry, row)))


_BRANCHES = {
    Work.IDLE: _idle,
    Work.FORWARD: functools.partial(_forward, with_head=False),
    Work.FORWARD_AND_HEAD: functools.partial(_forward, with_head=True),
    Work.INPUT_GRADIENT: _input_gradient,
    Work.WEIGHT_GRADIENT: _weight_gradient,
}


# What both control flows do with the results of a tick's actions.


def _add_to_chunk(grads, chunk, d):
    return jax.tree.map(lambda g, x: _update(g, _index(g, chunk) + x, chunk), grads, d)


def _add_forward(dev: _Device, carry: _Carry, row: Row, fo: _ForwardOut) -> _Carry:
    """A row's forward results written into the carry: its stash slot, loss, chunk statistics,
    head gradients, and the head's cotangent into the gradient slot its backward reads (a
    scratch slot when this forward ran no head)."""
    head_cotangent_to = jnp.where(
        (row.f_on == 1) & (row.f_head == 1), row.f_grad_slot, dev.lowered.gradient_slots
    )
    return carry._replace(
        stash=[_update(buf, x, row.f_stash_slot) for buf, x in zip(carry.stash, fo.stash)],
        loss=carry.loss + fo.loss,
        head_aux=jax.tree.map(jnp.add, carry.head_aux, fo.head_aux),
        stats=_add_to_chunk(carry.stats, row.f_chunk, fo.stats),
        head_grads=jax.tree.map(jnp.add, carry.head_grads, fo.dhead),
        grads=_update(carry.grads, fo.head_cotangent, head_cotangent_to),
    )


def _add_input_grad(carry: _Carry, row: Row, send_grad) -> _Carry:
    """The first chunk's B: its input gradient is the embedded microbatch's."""
    input_grad = jnp.where(
        (row.b_on == 1) & (row.b_first == 1), send_grad, _index(carry.input_grads, row.b_microbatch)
    )
    return carry._replace(input_grads=_update(carry.input_grads, input_grad, row.b_microbatch))


def _exchange(dev: _Device, carry: _Carry, row: Row, send_act, send_grad) -> _Carry:
    """Activations forward, gradients backward: every tick on every device, outside any branch,
    stored where the row says they arrive."""
    to_next, to_prev = dev.ring_pairs()
    arrived_act = jax.lax.ppermute(send_act, dev.program.axis_name, to_next)
    arrived_grad = jax.lax.ppermute(send_grad, dev.program.axis_name, to_prev)
    return carry._replace(
        acts=_update(carry.acts, arrived_act, row.recv_act_slot),
        grads=_update(carry.grads, arrived_grad, row.recv_grad_slot),
    )


def _uniform_tick(dev: _Device, carry: _Carry, xs):
    """One tick of uniform control flow: slots F, B (and W) under `lax.cond`s whose predicates
    are the tick's, the same on every device (module docstring), then the exchange."""
    table_rows, running, head_runs = xs
    row = dev.row(table_rows)  # this device's actions (the same on its stage)
    fo = jax.lax.cond(
        running[0] == 1,
        lambda c: _forward_slot(dev, c, row, head_runs == 1),
        lambda c: _no_forward(dev, c, row),
        carry,
    )
    carry = _add_forward(dev, carry, row, fo)
    bo = jax.lax.cond(
        running[1] == 1, lambda c: _backward_slot(dev, c, row), lambda c: _no_backward(dev), carry
    )
    carry = _add_input_grad(carry, row, bo.send_grad)
    if dev.zero_bubble:  # slot W
        dw = jax.lax.cond(
            running[2] == 1, lambda c: _weight_slot(dev, c, row), lambda c: dev.param_zeros(), carry
        )
        carry = carry._replace(stage_grads=_add_to_chunk(carry.stage_grads, row.w_chunk, dw))
    else:
        carry = carry._replace(stage_grads=_add_to_chunk(carry.stage_grads, row.b_chunk, bo.dparams))
    return _exchange(dev, carry, row, fo.send_act, bo.send_grad), None


def _stage_tick(dev: _Device, carry: _Carry, table_rows):
    """One tick of stage-dependent control flow: the branch this device's row names (its
    `work`), then the exchange."""
    row = dev.row(table_rows)
    branches = [functools.partial(_BRANCHES[work], dev, row=row) for work in Work]
    fo, bo = jax.lax.switch(row.work, branches, carry)
    carry = _add_input_grad(_add_forward(dev, carry, row, fo), row, bo.send_grad)
    carry = carry._replace(stage_grads=_add_to_chunk(carry.stage_grads, row.w_chunk, bo.dparams))
    return _exchange(dev, carry, row, fo.send_act, bo.send_grad), None


def _reduce(dev: _Device, carry: _Carry):
    """The sums across devices, once, after the loop: (loss, (stage_grads, head_grads,
    input_grads), stats). Each microbatch's head and input gradient came from one stage (a psum
    over the pipe axis gathers them); with manual row axes every device summed its own rows."""

    # Summed in float32: a bfloat16 all-reduce here aborts XLA:CPU's AllReducePromotion pass
    # ("Invalid binary instruction opcode copy", jax 0.12.0.1) once data and tensor are > 1.
    def psum(x, axes):
        return jax.lax.psum(x.astype(jnp.float32), axes).astype(x.dtype) if axes else x

    axis_name, rows_axes = dev.program.axis_name, dev.program.rows_axes
    everywhere = (axis_name, *rows_axes)  # one stage, all rows
    input_grads = psum(carry.input_grads, axis_name)  # rows stay on their device
    stage_grads = jax.tree.map(lambda g: psum(g, rows_axes), carry.stage_grads)
    head_grads = jax.tree.map(lambda g: psum(g, everywhere), carry.head_grads)
    head_aux = jax.tree.map(lambda a: psum(a, everywhere), carry.head_aux)
    return psum(carry.loss, everywhere), (stage_grads, head_grads, input_grads), carry.stats, head_aux


def _device_loop(program: _Program, stage_params, head_params, inputs, targets, side):
    """One device's whole pass: the schedule's ticks scanned (`_uniform_tick` or `_stage_tick`),
    then the sums across devices."""
    dev = _Device.build(program, stage_params, head_params, inputs, targets, side)
    lowered = dev.lowered
    if program.schedule.stage_dependent:
        carry, _ = jax.lax.scan(
            functools.partial(_stage_tick, dev), _initial_carry(dev), jnp.asarray(lowered.table)
        )
    else:
        carry, _ = jax.lax.scan(
            functools.partial(_uniform_tick, dev),
            _initial_carry(dev),
            (jnp.asarray(lowered.table), jnp.asarray(lowered.running), jnp.asarray(lowered.heads)),
        )
    return _reduce(dev, carry)
