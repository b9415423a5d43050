"""Pipeline parallelism: GPipe, 1F1B and interleaved 1F1B as one static schedule and one shard_map.

The layer stack is cut into `stages * virtual_stages` chunks. Chunk c lives on pipe device
c % stages (Megatron-LM's interleaved placement; with virtual_stages=1 chunk c is stage c). The
batch is split into `microbatches`. A schedule is a table built in Python before tracing: for every
tick and every stage, one action -- forward or backward of one microbatch through one chunk -- or
idle. The runtime scans over that table; at the end of every tick each device passes activations to
the next device and gradients to the previous one with `jax.lax.ppermute`.

Backward is explicit, not autodiff of a scanned forward: a forward runs `jax.vjp` of the chunk and
stashes the pullback's residuals in a slot of a buffer; the matching backward rebuilds the pullback
from that slot. Buffer sizes come from the schedule (a slot is reused as soon as its backward has
run), so 1F1B stashes at most `stages` microbatches per device whatever `microbatches` is, while
GPipe stashes all of them. What a stash holds is whatever `jax.vjp(stage_fn)` saves: wrap
`stage_fn` (or its layers) in `jax.checkpoint` to stash less and recompute more.

Bubble (GPipe, Huang et al. 2019; Megatron-LM, Narayanan et al. 2021): one slot is one chunk forward or one chunk backward on
one stage, forward and backward counted as equal. GPipe and 1F1B then idle (p-1)/(m+p-1) of all
slots; interleaved with v virtual stages idles about (p-1)/(v*m+p-1).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

SCHEDULES = ("gpipe", "1f1b", "interleaved")


class Action(NamedTuple):
    """One slot of work: phase "F" (forward) or "B" (backward) of `microbatch` through `chunk`.

    `chunk` is the virtual chunk on its stage, 0..virtual_stages-1; the model chunk it holds is
    chunk * stages + stage.
    """

    phase: str
    microbatch: int
    chunk: int


@dataclasses.dataclass(frozen=True)
class Schedule:
    """A static pipeline schedule: `actions[tick][stage]` is an Action or None (idle)."""

    kind: str
    stages: int
    microbatches: int
    virtual_stages: int
    actions: tuple[tuple[Action | None, ...], ...]


# ----------------------------------------------------------------------------- validation


def validate_pipeline(kind: str, stages: int, microbatches: int, virtual_stages: int = 1,
                      *, layers: int | None = None, batch: int | None = None) -> None:
    """Raise ValueError, naming the numbers, unless the pipeline layout is possible."""
    p, m, v = stages, microbatches, virtual_stages
    if kind not in SCHEDULES:
        raise ValueError(f"pipeline schedule {kind!r} is unknown; choose one of {SCHEDULES}")
    if p < 1 or m < 1 or v < 1:
        raise ValueError(f"stages={p}, microbatches={m}, virtual_stages={v} must all be >= 1")
    if kind == "interleaved" and v < 2:
        raise ValueError(f"interleaved needs virtual_stages >= 2, got {v}; use '1f1b' for v=1")
    if kind != "interleaved" and v != 1:
        raise ValueError(f"{kind} runs one chunk per stage; virtual_stages={v} needs 'interleaved'")
    if kind == "interleaved" and m % p:
        raise ValueError(f"interleaved needs microbatches={m} divisible by stages={p}; "
                         f"try microbatches={max(p, m - m % p)} or {m + p - m % p}")
    if layers is not None and layers % (p * v):
        raise ValueError(f"layers={layers} is not divisible by "
                         f"stages*virtual_stages={p}*{v}={p * v}")
    if batch is not None and batch % m:
        raise ValueError(f"batch={batch} does not split into microbatches={m} equal microbatches")


# ----------------------------------------------------------------------------- schedules


def _stage_program(kind: str, p: int, m: int, v: int, stage: int) -> list[Action]:
    """The order in which one stage runs its 2*m*v actions.

    Forwards visit microbatches in groups of p, every chunk of a group before the next group
    (Megatron-LM's interleaved order; with v=1 simply 0..m-1); backwards do the same with the
    chunks reversed. After `warmup` forwards the stage alternates one forward, one backward.
    """
    def order(k: int, phase: str) -> Action:
        group, within = divmod(k, p * v)
        chunk = within // p
        return Action(phase, group * p + within % p, v - 1 - chunk if phase == "B" else chunk)

    n = m * v
    forwards = [order(k, "F") for k in range(n)]
    backwards = [order(k, "B") for k in range(n)]
    warmup = {"gpipe": n, "1f1b": p - stage - 1, "interleaved": 2 * (p - stage - 1) + (v - 1) * p}
    w = min(warmup[kind], n)
    steady = [a for pair in zip(forwards[w:], backwards) for a in pair]
    return forwards[:w] + steady + backwards[n - w:]


def build_schedule(kind: str, stages: int, microbatches: int, virtual_stages: int = 1) -> Schedule:
    """Schedule `kind` ('gpipe', '1f1b', 'interleaved') as a tick-by-stage table of Actions.

    Each stage runs its program in order, one action per tick, as soon as the inputs are there:
    a forward needs the previous chunk's forward, a backward needs its own forward and the next
    chunk's backward, each finished on an earlier tick (that tick's ppermute delivers it).
    """
    validate_pipeline(kind, stages, microbatches, virtual_stages)
    p, v = stages, virtual_stages
    last = p * v - 1
    programs = [_stage_program(kind, p, microbatches, v, s) for s in range(p)]
    finished: dict[tuple[str, int, int], int] = {}  # (phase, microbatch, model chunk) -> tick
    cursor = [0] * p
    ticks: list[tuple[Action | None, ...]] = []

    def ready(a: Action, c: int, tick: int) -> bool:
        def done(*key):
            return finished.get(key, tick) < tick
        if a.phase == "F":
            return c == 0 or done("F", a.microbatch, c - 1)
        return done("F", a.microbatch, c) and (c == last or done("B", a.microbatch, c + 1))

    while any(cursor[s] < len(programs[s]) for s in range(p)):
        tick = len(ticks)
        row = []
        for s in range(p):
            a = programs[s][cursor[s]] if cursor[s] < len(programs[s]) else None
            row.append(a if a is not None and ready(a, a.chunk * p + s, tick) else None)
        if not any(row):
            raise RuntimeError(f"{kind} schedule deadlocked at tick {tick}")  # a bug here
        for s, a in enumerate(row):
            if a is not None:
                finished[(a.phase, a.microbatch, a.chunk * p + s)] = tick
                cursor[s] += 1
        ticks.append(tuple(row))
    return Schedule(kind, stages, microbatches, virtual_stages, tuple(ticks))


def bubble_fraction(schedule: Schedule) -> float:
    """Idle slots / all slots (ticks * stages); a forward and a backward are one slot each."""
    slots = [a for row in schedule.actions for a in row]
    return sum(a is None for a in slots) / len(slots)


def format_schedule(schedule: Schedule) -> str:
    """Text timeline: one row per stage, one column per tick (F3 / B1 / '.'; F3.1 = chunk 1)."""
    def cell(a: Action | None) -> str:
        if a is None:
            return "."
        return f"{a.phase}{a.microbatch}" + (f".{a.chunk}" if schedule.virtual_stages > 1 else "")

    cells = [[cell(row[s]) for row in schedule.actions] for s in range(schedule.stages)]
    width = max(len(c) for line in cells for c in line)
    lines = [f"stage {s} | " + " ".join(c.ljust(width) for c in line)
             for s, line in enumerate(cells)]
    lines.append(f"bubble {bubble_fraction(schedule):.4f} (idle slots / all slots, "
                 f"{schedule.kind}, stages={schedule.stages}, "
                 f"microbatches={schedule.microbatches}, virtual_stages={schedule.virtual_stages})")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- lowering


class Lowered(NamedTuple):
    """A schedule as the runtime reads it: int32 `table[tick, stage, field]` (fields: FIELDS) and
    how many slots each buffer needs. Activation and gradient slot n (one past the last) is a
    scratch slot for writes that mean nothing; a stash slot is written by a forward and read by
    the matching backward."""

    table: np.ndarray
    activation_slots: int
    stash_slots: int
    gradient_slots: int


FIELDS = ("code", "microbatch", "chunk", "act_slot", "stash_slot", "grad_slot",
          "recv_act_slot", "recv_grad_slot", "first")  # first: 1 if this is model chunk 0
IDLE, FORWARD, FORWARD_HEAD, BACKWARD = 0, 1, 2, 3  # "code"; the head runs after the last chunk


def _allocate(lifetimes: dict[Any, tuple[int, int]]) -> tuple[dict[Any, int], int]:
    """Slots for values written at the end of tick w and read during tick r (w < r), greedily."""
    busy_until: list[int] = []
    slot_of = {}
    for key, (w, r) in sorted(lifetimes.items(), key=lambda kv: kv[1]):
        slot = next((k for k, until in enumerate(busy_until) if until <= w), len(busy_until))
        busy_until[slot:slot + 1] = [r]
        slot_of[key] = slot
    return slot_of, len(busy_until)


def lower_schedule(schedule: Schedule) -> Lowered:
    """Turn a Schedule into the int table the shard_map scans over, with buffer slots assigned."""
    p, v = schedule.stages, schedule.virtual_stages
    last = p * v - 1
    when = {(a.phase, a.microbatch, a.chunk * p + s): t
            for t, row in enumerate(schedule.actions) for s, a in enumerate(row) if a is not None}
    acts, stash, grads = ([{} for _ in range(p)] for _ in range(3))
    for (phase, i, c), t in when.items():
        s = c % p
        if phase == "F" and c > 0:
            acts[s][i, c] = (when["F", i, c - 1], t)
        if phase == "F":
            stash[s][i, c] = (t, when["B", i, c])
        if phase == "B":
            grads[s][i, c] = (when["F", i, c] if c == last else when["B", i, c + 1], t)
    allocated = [[_allocate(per_stage) for per_stage in kind] for kind in (acts, stash, grads)]
    act_slot, stash_slot, grad_slot = ([slots for slots, _ in kind] for kind in allocated)
    n_act, n_stash, n_grad = (max(n for _, n in kind) for kind in allocated)

    table = np.zeros((len(schedule.actions), p, len(FIELDS)), np.int32)
    table[..., [3, 5, 6, 7]] = [n_act, n_grad, n_act, n_grad]  # scratch slots by default
    for t, row in enumerate(schedule.actions):
        for s, a in enumerate(row):
            if a is None:
                continue
            i, c = a.microbatch, a.chunk * p + s
            entry = table[t, s]
            entry[0] = BACKWARD if a.phase == "B" else FORWARD_HEAD if c == last else FORWARD
            entry[1], entry[2], entry[8] = i, a.chunk, c == 0
            entry[4] = stash_slot[s][i, c]
            if a.phase == "F" and c > 0:
                entry[3] = act_slot[s][i, c]
            if a.phase == "B" or c == last:
                entry[5] = grad_slot[s][i, c]
            if a.phase == "F" and c < last:  # activation goes to the next chunk's device
                table[t, (s + 1) % p, 6] = act_slot[(s + 1) % p][i, c + 1]
            if a.phase == "B" and c > 0:  # gradient goes to the previous chunk's device
                table[t, (s - 1) % p, 7] = grad_slot[(s - 1) % p][i, c - 1]
    return Lowered(table, n_act, n_stash, n_grad)


# ----------------------------------------------------------------------------- runtime


def stack_stages(layer_params, stages: int, virtual_stages: int = 1):
    """[layers, ...] leaves -> [stages*v, layers/(stages*v), ...]; row s*v + j is model chunk j*p+s.

    Sharding dim 0 over the pipe axis then puts chunk c on device c % stages, as the interleaved
    schedule expects (for v=1 this is a plain reshape). Lay params out this way once, at init;
    `unstack_stages` is the inverse.
    """
    p, v = stages, virtual_stages

    def stack(a):
        if a.shape[0] % (p * v):
            raise ValueError(f"layers={a.shape[0]} is not divisible by "
                             f"stages*virtual_stages={p}*{v}={p * v}")
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


def _residual_layout(stage_fn, chunk_params, x, side):
    """Trace one chunk's jax.vjp abstractly: the pullback's treedef, and for each residual leaf
    either the index of the chunk-param leaf it is (not stashed: params do not change during the
    step) or -1 together with its shape (stashed per microbatch)."""
    found = {}

    def trace(params, h):
        _, pullback = jax.vjp(lambda p_, h_: stage_fn(p_, h_, side), params, h)
        leaves, found["treedef"] = jax.tree.flatten(pullback)
        if not all(isinstance(leaf, jax.Array) for leaf in leaves):
            raise RuntimeError("jax.vjp's pullback is not a pytree of arrays in this jax "
                                      f"{jax.__version__}; the pipeline stashes those arrays")
        found["source"] = _param_sources(leaves, params)
        return [leaf for leaf, src in zip(leaves, found["source"]) if src < 0]
    shapes = jax.eval_shape(trace, chunk_params, x)
    return found["treedef"], found["source"], shapes


def _param_sources(leaves, params) -> list[int]:
    param_leaves = jax.tree.leaves(params)
    return [next((k for k, q in enumerate(param_leaves) if leaf is q), -1) for leaf in leaves]


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
) -> tuple[jax.Array, tuple[Any, Any, jax.Array]]:
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
    inputs. Only `axis_name` is manual inside the shard_map; other mesh axes stay automatic, so
    GSPMD keeps data / fsdp / tensor shardings of the arguments. Collectives: per tick one
    ppermute of an activation to stage+1 and one of a gradient to stage-1 (around the ring when
    v > 1); at the end a psum over `axis_name` of loss, head grads and input grads (each of which
    only one stage computed).
    """
    p, m, v = schedule.stages, schedule.microbatches, schedule.virtual_stages
    if mesh.shape[axis_name] != p:
        raise ValueError(
            f"mesh axis {axis_name}={mesh.shape[axis_name]} but schedule has stages={p}")
    for leaf in jax.tree.leaves(stage_params):
        if leaf.shape[0] != p * v:
            raise ValueError(f"stage_params leading dim {leaf.shape[0]} != "
                             f"stages*virtual_stages={p}*{v}; lay them out with stack_stages")
    if inputs.shape[0] != m:
        raise ValueError(f"inputs leading dim {inputs.shape[0]} != microbatches={m}; "
                         "reshape to [microbatches, microbatch, ...]")
    if side is None:
        plain_stage_fn = stage_fn
        stage_fn = lambda params, h, _: plain_stage_fn(params, h)  # noqa: E731
        side = jnp.zeros((m,), jnp.int32)
    body = functools.partial(_pipeline_body, stage_fn, head_fn, schedule, axis_name)
    mapped = jax.shard_map(
        body, mesh=mesh, axis_names={axis_name},
        in_specs=(P(axis_name), P(), P(), P(), P()),
        out_specs=(P(), (P(axis_name), P(), P())),
        # The carried buffers start equal on every stage and become per-stage after the first
        # ppermute; skipping the replication check avoids pvary/pcast, whose API moves in 0.10-0.12.
        check_vma=False)
    return mapped(_split_over(stage_params, mesh, axis_name), head_params, inputs, targets, side)


def _split_over(tree, mesh, axis_name: str):
    """On a mesh whose `axis_name` is Explicit, shard_map wants its inputs already laid out as
    its in_specs say: put dim 0 of every leaf on that axis, other dims as they were. (On an Auto
    axis the shard_map's in_specs place them.)"""
    explicit = dict(zip(mesh.axis_names, mesh.axis_types))[axis_name] == jax.sharding.AxisType.Explicit
    if not explicit:
        return tree

    def put(leaf):
        spec = list(jax.typeof(leaf).sharding.spec) + [None] * leaf.ndim
        return jax.sharding.reshard(leaf, NamedSharding(mesh, P(axis_name, *spec[1:leaf.ndim])))

    return jax.tree.map(put, tree)


def _pipeline_body(stage_fn, head_fn, schedule, axis_name,
                   stage_params, head_params, inputs, targets, side):
    """One device: stage_params leaves [v, layers_per_chunk, ...]; scans the schedule's ticks."""
    p, lowered = schedule.stages, lower_schedule(schedule)
    stage = jax.lax.axis_index(axis_name)
    index = functools.partial(jax.lax.dynamic_index_in_dim, axis=0, keepdims=False)
    update = functools.partial(jax.lax.dynamic_update_index_in_dim, axis=0)
    chunk_params = lambda j: jax.tree.map(lambda a: index(a, j), stage_params)  # noqa: E731
    h_zeros = jnp.zeros_like(inputs[0])  # [microbatch, ...]; zeros_like keeps explicit shardings
    side_of = lambda mb: jax.tree.map(lambda a: index(a, mb), side)  # noqa: E731
    treedef, sources, stash_shapes = _residual_layout(stage_fn, chunk_params(0), h_zeros, side_of(0))
    ring = schedule.virtual_stages > 1  # chunk j*p + p-1 (last device) feeds (j+1)*p (device 0)
    to_next = [(s, (s + 1) % p) for s in range(p if ring else p - 1)]
    to_prev = [(b, a) for a, b in to_next]

    def buffer(slots, like):
        return jnp.broadcast_to(jnp.zeros_like(like), (slots, *like.shape))

    # Activation and gradient buffers get one scratch slot for writes that mean nothing.
    carry = dict(
        acts=buffer(lowered.activation_slots + 1, h_zeros),
        grads=buffer(lowered.gradient_slots + 1, h_zeros),
        stash=[buffer(lowered.stash_slots, jnp.zeros(s.shape, s.dtype, out_sharding=s.sharding))
               for s in stash_shapes],
        stage_grads=jax.tree.map(jnp.zeros_like, stage_params),
        head_grads=jax.tree.map(jnp.zeros_like, head_params),
        input_grads=jnp.zeros_like(inputs),
        loss=jnp.zeros((), jnp.float32))

    def tick(carry, rows):
        row = index(rows, stage)  # this device's action, FIELDS
        code, mb, j, act_slot, stash_slot, grad_slot, recv_act, recv_grad, first = row
        params = chunk_params(j)
        h = jnp.where(first, index(inputs, mb), index(carry["acts"], act_slot))
        # Branches return small values, written to the buffers below. Their stash output is
        # rewritten to stash_slot, so branches that do not stash return that slot unchanged
        # (updating the buffers inside lax.switch made XLA copy whole buffers).
        idle = dict(send_act=h_zeros, send_grad=h_zeros, head_cotangent=h_zeros,
                    dparams=jax.tree.map(jnp.zeros_like, params), loss=jnp.zeros((), jnp.float32),
                    dhead=jax.tree.map(jnp.zeros_like, head_params))
        current_stash = lambda: [index(b, stash_slot) for b in carry["stash"]]  # noqa: E731

        def forward(with_head):
            y, pullback = jax.vjp(lambda p_, h_: stage_fn(p_, h_, side_of(mb)), params, h)
            leaves = jax.tree.leaves(pullback)
            if _param_sources(leaves, params) != sources:
                raise RuntimeError("stage_fn's vjp residuals changed between traces")
            out = dict(idle, stash=[x for x, src in zip(leaves, sources) if src < 0])
            if not with_head:
                return dict(out, send_act=y.astype(h.dtype))
            tgt = jax.tree.map(lambda a: index(a, mb), targets)
            loss, (dhead, dy) = jax.value_and_grad(head_fn, argnums=(0, 1))(head_params, y, tgt)
            return dict(out, head_cotangent=dy.astype(h.dtype), loss=loss.astype(jnp.float32),
                        dhead=dhead)

        def backward():
            stashed = current_stash()
            param_leaves, rest = jax.tree.leaves(params), iter(stashed)
            leaves = [param_leaves[src] if src >= 0 else next(rest) for src in sources]
            dparams, dh = jax.tree.unflatten(treedef, leaves)(index(carry["grads"], grad_slot))
            return dict(idle, stash=stashed, send_grad=dh.astype(h.dtype), dparams=dparams)

        out = jax.lax.switch(code, [lambda: dict(idle, stash=current_stash()),
                                    lambda: forward(False), lambda: forward(True), backward])
        input_grad = jnp.where((code == BACKWARD) & (first == 1), out["send_grad"],
                               index(carry["input_grads"], mb))
        new = dict(
            stash=[update(b, x, stash_slot) for b, x in zip(carry["stash"], out["stash"])],
            stage_grads=jax.tree.map(lambda g, d: update(g, index(g, j) + d, j),
                                     carry["stage_grads"], out["dparams"]),
            head_grads=jax.tree.map(jnp.add, carry["head_grads"], out["dhead"]),
            input_grads=update(carry["input_grads"], input_grad, mb),
            loss=carry["loss"] + out["loss"],
            grads=update(carry["grads"], out["head_cotangent"],
                         jnp.where(code == FORWARD_HEAD, grad_slot, lowered.gradient_slots)))
        # The only point-to-point traffic: activations forward, gradients backward.
        arrived_act = jax.lax.ppermute(out["send_act"], axis_name, to_next)
        arrived_grad = jax.lax.ppermute(out["send_grad"], axis_name, to_prev)
        new["acts"] = update(carry["acts"], arrived_act, recv_act)
        new["grads"] = update(new["grads"], arrived_grad, recv_grad)
        return new, None

    carry, _ = jax.lax.scan(tick, carry, jnp.asarray(lowered.table))
    total = lambda x: jax.lax.psum(x, axis_name)  # noqa: E731
    # Summed in float32: a bfloat16 all-reduce here aborts XLA:CPU's AllReducePromotion pass
    # ("Invalid binary instruction opcode copy", jax 0.12.0.1) once data and tensor are > 1.
    input_grads = total(carry["input_grads"].astype(jnp.float32)).astype(inputs.dtype)
    return total(carry["loss"]), (carry["stage_grads"], jax.tree.map(total, carry["head_grads"]),
                                  input_grads)


# ----------------------------------------------------------------------------- a model, pipelined


def model_value_and_grad(model, params, batch, *, schedule: Schedule, mesh: jax.sharding.Mesh,
                         loss_chunks: int, axis_name: str = "pipe"):
    """The language-model loss of `model` with its blocks pipelined over `axis_name`.

    model: a jaxpar Transformer (abstract is enough: only its structure and config are read);
        its pieces do the work -- `embed` before the pipeline, `run_blocks` for a stage's chunk
        of layers, `head_loss` (final norm, output projection, loss in model.dtype) on the last
        stage.
    params: the model's parameters as a pure dict; batch: {inputs, targets, positions,
        segment_ids, loss_mask}, each [batch, seq].

    Returns (gradients of the summed NLL, shaped like params; {"nll": summed NLL, "count":
    tokens}). Activations and their gradients travel between stages in model.dtype.
    """
    p, m, v = schedule.stages, schedule.microbatches, schedule.virtual_stages
    graphdef = nnx.graphdef(model)

    def stage_fn(chunk_params, h, side):
        positions, segment_ids = side
        return model.run_blocks(chunk_params, h, positions, segment_ids)[0]

    def head_fn(head_params, h, targets):
        return model.head_loss(head_params, h, targets["targets"], targets["loss_mask"],
                               chunks=loss_chunks)[0]

    def embed(table):
        return nnx.merge(graphdef, {**params, "embedding": table}).embed(batch["inputs"])

    x, embed_vjp = jax.vjp(embed, params["embedding"])
    micro = split_microbatches(batch, m)
    nll, (stage_grads, head_grads, input_grads) = pipeline_value_and_grad(
        stage_fn, head_fn, stack_stages(params["blocks"], p, v), model.head_params(params),
        split_microbatches(x, m), {k: micro[k] for k in ("targets", "loss_mask")},
        schedule=schedule, mesh=mesh, axis_name=axis_name,
        side=(micro["positions"], micro["segment_ids"]))
    (embedding_grad,) = embed_vjp(merge_microbatches(input_grads))
    grads = {**head_grads, "blocks": unstack_stages(stage_grads, p, v)}
    grads["embedding"] = embedding_grad + head_grads.get("embedding", 0.0)  # tied: both uses
    return grads, {"nll": nll, "count": jnp.sum(batch["loss_mask"])}
