"""Pipeline parallelism, one device's loop inside the shard_map of `jaxpar.parallel.pipeline`:
the schedule's lowered table (`jaxpar.parallel.schedule`) run tick by tick.

Backward is explicit, not autodiff of a scanned forward: a forward runs `jax.vjp` of the chunk and
stashes the pullback's residuals in a slot of a buffer; the matching backward rebuilds the pullback
from that slot. Zero-bubble splits the backward in two: B applies the pullback for the input
gradient only (what the previous stage waits for), W applies it again, later, for the weight
gradient only; XLA drops the unused half of each. Buffer sizes come from the schedule (a slot is
reused as soon as its last reader has run). What a stash holds is whatever `jax.vjp(stage_fn)`
saves: wrap `stage_fn` (or its layers) in `jax.checkpoint` to stash less; numpy constants among
those residuals (ring attention's layout positions) are not stashed but put back as they are. A
chunk may add a loss of its own (`pipeline.pipeline_value_grad_and_stats`: an MoE router's aux and z
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
manual (in both control flows, see `pipeline.pipeline_value_and_grad`), so each device computes on its own
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

from jaxpar.parallel.schedule import Lowered, Row, Schedule, Work, lower_schedule

# ----------------------------------------------------------------------------- what a pass runs


class Program(NamedTuple):
    """What a pipelined pass runs, the same on every device: chunk_fn(chunk_params, h, side_i)
    -> (h, own loss, stats), the head, the schedule, the pipe axis, and the row axes asked for
    (`pipeline.pipeline_value_and_grad`; `pipeline._run` keeps those of size > 1)."""

    chunk_fn: Callable[..., Any]
    head_fn: Callable[..., Any]
    schedule: Schedule
    axis_name: str
    rows_axes: tuple[str, ...]
    head_aux: bool = False  # head_fn returns (loss, aux): `pipeline.pipeline_value_and_grad`


# ----------------------------------------------------------------------------- the stashed residuals


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

    program: Program
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
    def build(cls, program: Program, stage_params, head_params, inputs, targets, side):
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


def device_loop(program: Program, stage_params, head_params, inputs, targets, side):
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
