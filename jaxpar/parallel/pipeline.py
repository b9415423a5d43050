"""Pipeline parallelism: GPipe, 1F1B, interleaved 1F1B and zero-bubble (ZB-H1) as one static
schedule and one shard_map.

The layer stack is cut into `stages * virtual_stages` chunks. Chunk c lives on pipe device
c % stages (Megatron-LM's interleaved placement; with virtual_stages=1 chunk c is stage c). The
batch is split into `microbatches`. A schedule is a table built in Python before tracing. Time
advances in ticks; in one tick every stage runs up to one action in each of the schedule's slots,
in order -- F (forward of one microbatch through one chunk), then B (its backward), then, for the
zero-bubble schedule, W -- and then one exchange passes activations to the next device and
gradients to the previous one (`jax.lax.ppermute`, both hand-offs at the same point). In steady
state each stage runs a forward and a backward every tick, so a tick lasts F + B, not two
backwards as when a tick held one action. (Stage-dependent zero-bubble, below, runs one action of
any phase per stage per tick instead.)

Backward is explicit, not autodiff of a scanned forward: a forward runs `jax.vjp` of the chunk and
stashes the pullback's residuals in a slot of a buffer; the matching backward rebuilds the pullback
from that slot. Zero-bubble splits the backward in two: B applies the pullback for the input
gradient only (what the previous stage waits for), W applies it again, later, for the weight
gradient only; XLA drops the unused half of each. Buffer sizes come from the schedule (a slot is
reused as soon as its last reader has run), so 1F1B stashes a bounded number of microbatches per
device whatever `microbatches` is, while GPipe stashes all of them. What a stash holds is whatever
`jax.vjp(stage_fn)` saves: wrap `stage_fn` (or its layers) in `jax.checkpoint` to stash less;
numpy constants among those residuals (ring attention's layout positions) are not stashed but
put back as they are. A chunk may add a loss of its own (`stage_losses`: an MoE router's aux and
z losses): its forward adds the value, and its backward runs the pullback with cotangent 1 for it
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
every tick). Then a tick is one slot in which
each device runs the action of its own table row (`lax.axis_index` of `pipe` picks the row)
through `lax.switch` over idle / F / F with the head / B / W, and then the same exchange. The
table is ZB-H1's (`_build_zb_h1`). MoE chunks with data > 1 stay uniform: their router losses are
not sums over rows.

Cost and bubble (GPipe, Huang et al. 2019; Megatron-LM, Narayanan et al. 2021; zero-bubble, Qi et
al. 2023): a forward costs 1, a backward 2 (zero-bubble: B 1 and W 1). With uniform control flow
every device runs a slot when any stage does, so a tick costs the sum of its running slots'
costs; with stage-dependent control flow a tick costs its dearest action (1). The idle fraction is
1 - (work of all actions) / (stages * sum of tick costs), computed from the lowered table the
runtime scans (`bubble_fraction`). With the tick order above it is exactly (p-1)/(m+p-1) for GPipe
and 1F1B and (p-1)/(v*m+p-1) for interleaved. Uniform zero-bubble reaches (p-1)(F+B)/(m(F+B+W) +
(p-1)(F+B)) = 2(p-1)/(3m+2(p-1)): the weight gradients leave the bubble entirely, which is the
least uniform control flow allows (F runs on m+p-1 ticks, B on m+p-1, W on m). Stage-dependent
zero-bubble lets one stage run a W while another runs an F or B and reaches the paper's ZB-H1,
(p-1)(F+B-W)/(m(F+B+W) + (p-1)(F+B-W)) = (p-1)/(3m+p-1), for m >= p (with fewer microbatches
the dependencies leave more idle ticks, e.g. 2p+1 ticks for one microbatch's 3 actions), holding
at most p stashes per stage (1F1B's stage 0) where uniform zero-bubble holds up to 2p-1.
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

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb")


class Action(NamedTuple):
    """One slot of work: phase "F" (forward), "B" (backward; zero-bubble: the input gradient
    only) or "W" (zero-bubble: the weight gradient) of `microbatch` through `chunk`.

    `chunk` is the virtual chunk on its stage, 0..virtual_stages-1; the model chunk it holds is
    chunk * stages + stage.
    """

    phase: str
    microbatch: int
    chunk: int


@dataclasses.dataclass(frozen=True)
class Schedule:
    """A static pipeline schedule: `ticks[t][k][stage]` is the Action that `stage` runs in slot k
    (phase `slots[k]`) of tick t, or None (idle)."""

    kind: str
    stages: int
    microbatches: int
    virtual_stages: int
    slots: tuple[str, ...]
    ticks: tuple[tuple[tuple[Action | None, ...], ...], ...]
    # False: uniform control flow, a tick runs its slots in order on every device and lasts their
    # summed cost. True (zero-bubble on a collective-free chunk, `schedule_for_mesh`): a stage runs
    # at most one action per tick, whichever phase, and a tick lasts the dearest of them.
    stage_dependent: bool = False

    @property
    def actions(self) -> tuple[tuple[Action | None, ...], ...]:
        """The slots that run, in execution order: `actions[n][stage]`, an Action or None. With
        stage-dependent control flow a tick is one slot: each stage's action, whatever its phase."""
        if self.stage_dependent:
            merged = (tuple(next((row[s] for row in tick if row[s] is not None), None)
                            for s in range(self.stages)) for tick in self.ticks)
            return tuple(row for row in merged if any(row))
        return tuple(row for tick in self.ticks for row in tick if any(row))


def phase_costs(kind: str) -> dict[str, int]:
    """Cost of one chunk's action, in forwards: B = 2F; zero-bubble splits it into B = W = F."""
    return {"F": 1, "B": 1, "W": 1} if kind == "zb" else {"F": 1, "B": 2}


def textbook_bubble(kind: str, stages: int, microbatches: int, virtual_stages: int = 1) -> float:
    """The published idle fraction: (p-1)/(m+p-1) for GPipe and 1F1B, (p-1)/(v*m+p-1) for
    interleaved, (p-1)(F+B-W)/(m(F+B+W) + (p-1)(F+B-W)) = (p-1)/(3m+p-1) for ZB-H1."""
    p, m, v = stages, microbatches, virtual_stages
    if kind == "zb":
        return (p - 1) / (3 * m + p - 1)
    return (p - 1) / (v * m + p - 1)


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


def _phase_order(p: int, m: int, v: int, phase: str) -> list[Action]:
    """The order in which a stage runs its m*v actions of one phase: microbatches in groups of p,
    every chunk of a group before the next group (Megatron-LM's interleaved order; with v=1
    simply 0..m-1); backward phases visit the chunks in reverse."""
    def order(k: int) -> Action:
        group, within = divmod(k, p * v)
        chunk = within // p
        return Action(phase, group * p + within % p, chunk if phase == "F" else v - 1 - chunk)
    return [order(k) for k in range(m * v)]


def stash_limit(kind: str, stages: int, virtual_stages: int = 1) -> int | None:
    """How many microbatch-chunks a stage may hold stashed before its next forward waits (None:
    no limit, GPipe). 2p-1 (+ p per extra chunk) is what the textbook bubble needs when a hand-off
    takes a tick: a microbatch returns to stage 0 2p-2 ticks after it left."""
    if kind == "gpipe":
        return None
    return 2 * stages - 1 + (virtual_stages - 1) * stages


def build_schedule(kind: str, stages: int, microbatches: int, virtual_stages: int = 1, *,
                   stage_dependent: bool = False) -> Schedule:
    """Schedule `kind` ('gpipe', '1f1b', 'interleaved', 'zb') as ticks of slots of Actions.

    `stage_dependent` (zero-bubble only) builds the ZB-H1 table for stage-dependent control flow
    (`_build_zb_h1`); only a collective-free chunk may run it (`schedule_for_mesh` decides).
    The rest of this docstring is about the uniform tables.

    Every tick, each stage runs, slot by slot, the next action of that phase in its order
    (`_phase_order`) when its inputs are there: a forward needs the previous chunk's forward from
    an earlier tick (the exchange between ticks delivers it), a backward needs its own forward (an
    earlier slot; the last chunk's backward can run in the tick of its forward) and the next
    chunk's backward from an earlier tick. GPipe starts a stage's backwards after all its
    forwards; 1F1B, interleaved and zero-bubble hold at most `stash_limit` stashes. Zero-bubble's
    W slot runs on the ticks where stage 0 runs a B -- every stage then takes its oldest pending
    weight gradient -- so W costs m slots in all and none of the warm-up or cool-down.
    """
    validate_pipeline(kind, stages, microbatches, virtual_stages)
    if stage_dependent:
        if kind != "zb":
            raise ValueError(f"stage-dependent control flow is built for 'zb' only, not {kind!r}")
        return _build_zb_h1(stages, microbatches)
    p, m, v = stages, microbatches, virtual_stages
    last, n = p * v - 1, m * v
    slots = ("F", "B", "W") if kind == "zb" else ("F", "B")
    queues = {phase: _phase_order(p, m, v, phase) for phase in slots}
    cursor = {phase: [0] * p for phase in slots}
    limit = stash_limit(kind, p, v)
    stashed = [0] * p
    finished: dict[tuple[str, int, int], tuple[int, int]] = {}  # (phase, mb, chunk) -> (tick, slot)
    ticks = []

    def done(key, when) -> bool:
        return key in finished and finished[key] < when

    while any(cursor[phase][s] < n for phase in slots for s in range(p)):
        t, tick = len(ticks), []
        for k, phase in enumerate(slots):
            row = []
            for s in range(p):
                if cursor[phase][s] == n:
                    row.append(None)
                    continue
                a = queues[phase][cursor[phase][s]]
                c = a.chunk * p + s
                if phase == "F":
                    ok = ((c == 0 or done(("F", a.microbatch, c - 1), (t, 0)))
                          and (limit is None or stashed[s] < limit))
                elif phase == "B":
                    ok = (done(("F", a.microbatch, c), (t, k))
                          and (c == last or done(("B", a.microbatch, c + 1), (t, 0)))
                          and (kind != "gpipe" or cursor["F"][s] == n))
                else:
                    ok = done(("B", a.microbatch, c), (t, k)) and tick[1][0] is not None
                row.append(a if ok else None)
            for s, a in enumerate(row):
                if a is not None:
                    finished[(phase, a.microbatch, a.chunk * p + s)] = (t, k)
                    cursor[phase][s] += 1
                    stashed[s] += phase == "F"
            tick.append(tuple(row))
        for s, a in enumerate(tick[-1]):  # the last slot frees the stash (B, or zero-bubble's W)
            stashed[s] -= a is not None
        if not any(a for row in tick for a in row):
            raise RuntimeError(f"{kind} schedule deadlocked at tick {t}")  # a bug here
        ticks.append(tuple(tick))
    return Schedule(kind, p, m, v, slots, tuple(ticks))


def _build_zb_h1(p: int, m: int) -> Schedule:
    """Zero-bubble ZB-H1 (Qi et al. 2023) for stage-dependent control flow: one action per stage
    per tick, whichever phase, then the exchange; F = B = W = 1, so every tick costs 1.

    A unit-time simulation. An action is ready when its inputs are: F(s, i) once F(s-1, i) ran in
    an earlier tick (the exchange delivered it) and the stage holds fewer than p stashes (a stash
    lives from F to W; p is 1F1B's stage 0, so peak activation memory stays 1F1B's); B(s, i) once
    F(s, i) and, but on the last stage, B(s+1, i) ran in earlier ticks; W(s, i) once B(s, i) did.
    Each phase takes microbatches in order. A stage picks, among its ready phases: right after an
    F, B before F; otherwise F before B; W only when neither can run -- so warm-up runs as many
    forwards as the stash allows, the steady state alternates F and B as 1F1B does, and W is
    deferred into what would otherwise be bubbles (or runs to free a stash for the next F). For
    m >= p every stage idles exactly p-1 ticks: the idle fraction is (p-1)/(3m+p-1), the paper's
    (p-1)(F+B-W)/(m(F+B+W) + (p-1)(F+B-W)).
    """
    nxt = {phase: [0] * p for phase in "FBW"}  # next microbatch of each phase, per stage
    finished: dict[tuple[str, int, int], int] = {}  # (phase, microbatch, stage) -> tick
    stashed, previous = [0] * p, [None] * p
    ticks = []
    while any(n < m for n in nxt["W"]):
        t = len(ticks)
        before = lambda key: finished.get(key, t) < t  # noqa: E731 -- ran in an earlier tick

        def ready(phase: str, s: int) -> bool:
            i = nxt[phase][s]
            if i == m:
                return False
            if phase == "F":
                return (s == 0 or before(("F", i, s - 1))) and stashed[s] < p
            if phase == "B":
                return before(("F", i, s)) and (s == p - 1 or before(("B", i, s + 1)))
            return before(("B", i, s))

        row = []
        for s in range(p):
            phase = next((ph for ph in ("BFW" if previous[s] == "F" else "FBW") if ready(ph, s)),
                         None)
            row.append(None if phase is None else Action(phase, nxt[phase][s], 0))
        if not any(row):
            raise RuntimeError(f"zb (stage-dependent) schedule deadlocked at tick {t}")  # a bug
        for s, a in enumerate(row):
            if a is not None:
                finished[a.phase, a.microbatch, s] = t
                nxt[a.phase][s] += 1
                stashed[s] += {"F": 1, "B": 0, "W": -1}[a.phase]
                previous[s] = a.phase
        ticks.append(tuple(tuple(a if a is not None and a.phase == phase else None for a in row)
                           for phase in "FBW"))
    return Schedule("zb", p, m, 1, ("F", "B", "W"), tuple(ticks), stage_dependent=True)


def row_axes_for(model_cfg, zero_stage: int) -> tuple[str, ...]:
    """The mesh axes that, inside a pipelined chunk of this model, only split the rows of a
    microbatch: `data`, and `fsdp` below ZeRO-2 (parameters and gradients whole on it; ZeRO-2/3
    split gradients or weights over fsdp). The pipeline makes them manual and sums over them once,
    after its loop (`pipeline_value_and_grad`). None where the chunk couples its rows: MoE layers
    (router losses and statistics over the whole microbatch) and float8 matmuls (per-tensor scales
    from the whole activation's amax) keep those axes automatic, so GSPMD reduces over them."""
    if model_cfg.moe.num_experts or model_cfg.fp8:
        return ()
    return ("data", "fsdp") if zero_stage <= 1 else ("data",)


def collective_free(sizes: dict[str, int], axis_name: str = "pipe",
                    row_axes: tuple[str, ...] = ("data",)) -> bool:
    """Whether a chunk's forward and backward run without collectives on a mesh of these axis
    sizes: every axis but `axis_name` and the row axes (`row_axes_for`) has size 1.

    A row axis splits the batch and keeps the parameters whole, and the pipeline makes it manual,
    so a chunk computes on its own rows; the gradient reduction over it happens after the
    pipeline loop. Any other axis puts collectives inside the chunk: fsdp at ZeRO-2/3 (gradient
    reduce-scatters, weight gathers), tensor (Megatron's all-reduces), context (ring attention's
    permutes), expert (MoE all-to-alls), and a row axis the model couples (MoE, float8). A
    collective inside a branch that only some stages take waits for devices that never arrive
    (module docstring), so only a collective-free chunk may branch per stage.
    """
    return all(size == 1 for name, size in sizes.items() if name not in (axis_name, *row_axes))


def schedule_for_mesh(schedule: Schedule, sizes: dict[str, int], axis_name: str = "pipe", *,
                      row_axes: tuple[str, ...] = ("data",)) -> Schedule:
    """The schedule the runtime executes on a mesh of these axis sizes, with these row axes
    (`row_axes_for`): zero-bubble becomes the stage-dependent ZB-H1 table where the chunk is
    collective-free (`collective_free`); every other schedule and layout runs as built."""
    if (schedule.kind == "zb" and not schedule.stage_dependent
            and collective_free(sizes, axis_name, row_axes)):
        return build_schedule("zb", schedule.stages, schedule.microbatches, stage_dependent=True)
    return schedule


def tick_costs(schedule: Schedule) -> list[int]:
    """The time of every tick, in forwards of one chunk: uniform control flow runs every slot
    that any stage runs, so a tick lasts their summed cost; stage-dependent control flow runs
    each stage's own action, so it lasts the dearest one."""
    cost = phase_costs(schedule.kind)
    if schedule.stage_dependent:
        return [max((cost[a.phase] for row in tick for a in row if a is not None), default=0)
                for tick in schedule.ticks]
    return [sum(cost[phase] for phase, row in zip(schedule.slots, tick) if any(row))
            for tick in schedule.ticks]


def bubble_fraction(schedule: Schedule) -> float:
    """Idle fraction of the program the runtime executes (`lower_schedule`'s table): 1 - the
    cost of all actions / (stages * the time of all ticks), where a tick lasts the summed cost of
    the slots that run in it (`phase_costs`: F=1, B=2; zero-bubble B=1, W=1) -- with
    stage-dependent control flow, the dearest action any stage runs in it (`tick_costs`)."""
    lowered = lower_schedule(schedule)
    cost = np.array([phase_costs(schedule.kind)[phase] for phase in schedule.slots])
    work_per = lowered.table[:, :, [_ON[phase] for phase in schedule.slots]] * cost  # [t, s, k]
    if schedule.stage_dependent:  # what each device's lax.switch runs: its own row's phase
        time = float(np.sum(np.max(np.sum(work_per, axis=2), axis=1)))
    else:  # what every device's lax.conds run: the tick's running slots
        time = float(np.sum(lowered.running * cost))
    return 1.0 - float(np.sum(work_per)) / (schedule.stages * time)


def schedule_time(schedule: Schedule) -> int:
    """Length of the step in forwards of one chunk: the summed time of its ticks (`tick_costs`)."""
    return sum(tick_costs(schedule))


def format_schedule(schedule: Schedule) -> str:
    """Cost-weighted text timeline: one row per stage, one column per unit of time (a forward of
    one chunk). An action is its label (F3 / B1 / W1; F3.1 = chunk 1) in its first column and '='
    in the rest; '.' is idle; '|' marks the exchange at the end of each tick. With
    stage-dependent control flow a tick is one column (each stage's own action) followed by the
    exchange, so no '|' is drawn."""
    costs = phase_costs(schedule.kind)

    def label(a: Action | None) -> str:
        return "." if a is None else f"{a.phase}{a.microbatch}" + (
            f".{a.chunk}" if schedule.virtual_stages > 1 else "")

    width = max(len(label(a)) for tick in schedule.ticks for row in tick for a in row)
    lines = []
    for s in range(schedule.stages):
        cells = []
        for tick, tick_cost in zip(schedule.ticks, tick_costs(schedule)):
            if schedule.stage_dependent:
                a = next((row[s] for row in tick if row[s] is not None), None)
                length = 0 if a is None else costs[a.phase]
                cells += [label(a).ljust(width)] + ["=" * width] * (length - 1) + (
                    ["." * width] * (tick_cost - max(length, 1)))
                continue
            for phase, row in zip(schedule.slots, tick):
                if any(row):
                    a = row[s]
                    rest = "." if a is None else "=" * width
                    cells += [label(a).ljust(width)] + [rest.ljust(width)] * (costs[phase] - 1)
            cells.append("|")
        lines.append((f"stage {s} | " + " ".join(cells)).rstrip())
    cost_text = " ".join(f"{phase}={costs[phase]}" for phase in schedule.slots)
    flow = "stage-dependent" if schedule.stage_dependent else "uniform"
    lines.append(f"bubble {bubble_fraction(schedule):.4f} (idle / stages x time, {cost_text}; "
                 f"{schedule.kind}, stages={schedule.stages}, microbatches={schedule.microbatches}, "
                 f"virtual_stages={schedule.virtual_stages}, {flow} control flow; "
                 f"time {schedule_time(schedule)}, {len(schedule.ticks)} ticks)")
    return "\n".join(lines)


def describe_schedule(schedule: Schedule) -> dict[str, Any]:
    """The schedule as `inspect --schedule` reports it (JSON): the cost-weighted bubble of the
    lowered program, the published one, the control flow that runs it ("uniform" or
    "stage-dependent"), time, ticks, buffer slots and the timeline."""
    lowered = lower_schedule(schedule)
    p, m, v = schedule.stages, schedule.microbatches, schedule.virtual_stages
    return {"schedule": schedule.kind, "stages": p, "microbatches": m, "virtual_stages": v,
            "costs": phase_costs(schedule.kind), "bubble": bubble_fraction(schedule),
            "textbook_bubble": textbook_bubble(schedule.kind, p, m, v),
            "control_flow": "stage-dependent" if schedule.stage_dependent else "uniform",
            "time": schedule_time(schedule), "ticks": len(schedule.ticks),
            "stash_slots": lowered.stash_slots, "activation_slots": lowered.activation_slots,
            "gradient_slots": lowered.gradient_slots,
            "timeline": format_schedule(schedule).splitlines()}


# ----------------------------------------------------------------------------- lowering


class Lowered(NamedTuple):
    """A schedule as the runtime reads it: int32 `table[tick, stage, field]` (fields: FIELDS; with
    stage-dependent control flow at most one of f_on / b_on / w_on is set per row, and the row
    alone picks the device's branch), `running[tick, k]` = 1 when any stage runs slot k (phase
    `slots[k]`) in that tick -- the predicate every device's `lax.cond` reads (uniform) -- and
    `heads[tick]` = 1 when some stage's forward is the last chunk's (the head runs), and how
    many slots each buffer needs. Activation and
    gradient slot n (one past the last) is a scratch slot for writes that mean nothing; a stash
    slot is written by a forward and read by the matching backward (zero-bubble: and its W)."""

    table: np.ndarray
    running: np.ndarray
    heads: np.ndarray
    activation_slots: int
    stash_slots: int
    gradient_slots: int


FIELDS = (
    "f_on", "f_microbatch", "f_chunk", "f_first", "f_head", "f_act_slot", "f_stash_slot",
    "f_grad_slot",  # forward: input from act slot (or the inputs if first), head cotangent here
    "b_on", "b_microbatch", "b_chunk", "b_first", "b_stash_slot", "b_grad_slot",  # backward / B
    "w_on", "w_chunk", "w_stash_slot", "w_grad_slot",  # zero-bubble's weight gradient
    "recv_act_slot", "recv_grad_slot")  # where this tick's exchange writes what arrives
_F = {name: k for k, name in enumerate(FIELDS)}
_ON = {"F": _F["f_on"], "B": _F["b_on"], "W": _F["w_on"]}
# Positions within a tick, for buffer lifetimes: the slots in order, then the exchange.
_AT = {"F": 0, "B": 1, "W": 2, "exchange": 3}


def _allocate(lifetimes: dict[Any, tuple[tuple[int, int], tuple[int, int]]]) -> tuple[dict[Any, int], int]:
    """Slots for values written at (tick, position) w and last read at r > w, greedily; a slot is
    free again for a write strictly after its last read."""
    busy_until: list[tuple[int, int]] = []
    slot_of = {}
    for key, (w, r) in sorted(lifetimes.items(), key=lambda kv: kv[1]):
        slot = next((k for k, until in enumerate(busy_until) if until < w), len(busy_until))
        busy_until[slot:slot + 1] = [r]
        slot_of[key] = slot
    return slot_of, len(busy_until)


def lower_schedule(schedule: Schedule) -> Lowered:
    """Turn a Schedule into the int tables the shard_map scans over, with buffer slots assigned."""
    p, v = schedule.stages, schedule.virtual_stages
    last = p * v - 1
    zb = "W" in schedule.slots
    when = {(a.phase, a.microbatch, a.chunk * p + s): t
            for t, tick in enumerate(schedule.ticks) for row in tick
            for s, a in enumerate(row) if a is not None}
    freed_by = "W" if zb else "B"  # the stash's and the cotangent's last reader
    acts, stash, grads = ([{} for _ in range(p)] for _ in range(3))
    for (phase, i, c), t in when.items():
        if phase != "F":
            continue
        s, end = c % p, (when[freed_by, i, c], _AT[freed_by])
        if c > 0:
            acts[s][i, c] = ((when["F", i, c - 1], _AT["exchange"]), (t, _AT["F"]))
        stash[s][i, c] = ((t, _AT["F"]), end)
        grads[s][i, c] = ((t, _AT["F"]) if c == last else (when["B", i, c + 1], _AT["exchange"]), end)
    allocated = [[_allocate(per_stage) for per_stage in kind] for kind in (acts, stash, grads)]
    act_slot, stash_slot, grad_slot = ([slots for slots, _ in kind] for kind in allocated)
    n_act, n_stash, n_grad = (max(n for _, n in kind) for kind in allocated)

    table = np.zeros((len(schedule.ticks), p, len(FIELDS)), np.int32)
    for name, scratch in [("f_act_slot", n_act), ("f_grad_slot", n_grad), ("b_grad_slot", n_grad),
                          ("w_grad_slot", n_grad), ("recv_act_slot", n_act),
                          ("recv_grad_slot", n_grad)]:
        table[..., _F[name]] = scratch
    running = np.zeros((len(schedule.ticks), len(schedule.slots)), np.int32)
    heads = np.zeros((len(schedule.ticks),), np.int32)
    for t, tick in enumerate(schedule.ticks):
        for k, (phase, row) in enumerate(zip(schedule.slots, tick)):
            running[t, k] = any(row)
            for s, a in enumerate(row):
                if a is None:
                    continue
                i, c = a.microbatch, a.chunk * p + s
                e = table[t, s]
                if phase == "F":
                    e[[_F["f_on"], _F["f_microbatch"], _F["f_chunk"], _F["f_first"],
                       _F["f_head"]]] = 1, i, a.chunk, c == 0, c == last
                    e[_F["f_stash_slot"]] = stash_slot[s][i, c]
                    if c > 0:
                        e[_F["f_act_slot"]] = act_slot[s][i, c]
                    if c == last:
                        e[_F["f_grad_slot"]] = grad_slot[s][i, c]
                        heads[t] = 1
                    else:  # the activation goes to the next chunk's device
                        table[t, (s + 1) % p, _F["recv_act_slot"]] = act_slot[(s + 1) % p][i, c + 1]
                elif phase == "B":
                    e[[_F["b_on"], _F["b_microbatch"], _F["b_chunk"], _F["b_first"]]] = (
                        1, i, a.chunk, c == 0)
                    e[_F["b_stash_slot"]], e[_F["b_grad_slot"]] = stash_slot[s][i, c], grad_slot[s][i, c]
                    if c > 0:  # the gradient goes to the previous chunk's device
                        table[t, (s - 1) % p, _F["recv_grad_slot"]] = grad_slot[(s - 1) % p][i, c - 1]
                else:
                    e[[_F["w_on"], _F["w_chunk"]]] = 1, a.chunk
                    e[_F["w_stash_slot"]], e[_F["w_grad_slot"]] = stash_slot[s][i, c], grad_slot[s][i, c]
    return Lowered(table, running, heads, n_act, n_stash, n_grad)


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
    step), CONSTANT (kept, in the returned {leaf index: constant}) or STASHED, with its shape
    (stashed per microbatch)."""
    found = {}

    def trace(params, h):
        _, pullback = _chunk_vjp(stage_fn, params, h, side)
        leaves, found["treedef"] = jax.tree.flatten(pullback)
        if not all(isinstance(leaf, (jax.Array, np.ndarray)) for leaf in leaves):
            raise RuntimeError("jax.vjp's pullback is not a pytree of arrays in this jax "
                                      f"{jax.__version__}; the pipeline stashes those arrays")
        found["source"] = _param_sources(leaves, params)
        found["constants"] = {k: leaf for k, (leaf, src) in enumerate(zip(leaves, found["source"]))
                              if src == CONSTANT}
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


def _chunk_vjp(stage_fn, params, h, side):
    """jax.vjp of one chunk as the runtime runs it: stage_fn(params, h, side) -> (h, loss,
    stats); the pullback takes (dh, dloss), stats are not differentiated. Returns ((h, loss,
    stats), pullback)."""
    def chunk(p_, h_):
        y, loss, stats = stage_fn(p_, h_, side)
        return (y, loss), stats

    (y, loss), pullback, stats = jax.vjp(chunk, params, h, has_aux=True)
    return (y, loss, stats), pullback


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
    stage_losses: bool = False,
    row_axes: tuple[str, ...] = ("data",),
):
    """Loss and gradients of a pipelined layer stack followed by a head.

    loss = sum over microbatches i of head_fn(head_params, stack(inputs[i]), targets[i]);
    make head_fn divide by the number of microbatches (or tokens) to get a mean. With
    `stage_losses`, every chunk's own loss of every microbatch is added too.

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
    stage_losses: stage_fn returns (h, loss, stats) instead of h: loss a float32 scalar that
        enters the objective beside the head's (differentiated with cotangent 1, e.g. an MoE
        router's auxiliary losses), stats a pytree of arrays, summed over microbatches per chunk
        and not differentiated (e.g. router statistics).

    Returns (loss, (stage_grads, head_grads, input_grads)), shaped like stage_params, head_params,
    inputs; with `stage_losses` also the stats, as a third element with leaves [stages*v, ...] in
    `stack_stages` order. `axis_name` is manual inside the shard_map, and so is `data` when it
    is > 1 (below); the other mesh axes stay automatic, so GSPMD keeps fsdp / tensor / context /
    expert shardings of the arguments. Collectives: per tick one ppermute of an activation to
    stage+1 and one of a gradient to stage-1 (around the ring when v > 1); at the end a psum
    over `axis_name` of loss, head grads and input grads (each of which only one stage
    computed), and over data of the loss, head and stage grads.

    row_axes: mesh axes that split only the rows of a microbatch here, the parameters replicated
    over them (`row_axes_for`: `data`, and `fsdp` where ZeRO shards no parameters or gradients).
    Those of size > 1 (unless `stage_losses`) are manual too, and each microbatch's rows (dim 1
    of inputs, targets, side) are split over them, in this order: head_fn then sees one device's
    rows, so its loss must be a sum over rows times constants (the model's summed NLL, a sum
    divided by the whole batch size), and the data-parallel sums run once, after the loop. Left
    automatic, XLA's GPU compiler all-reduced every backward's weight gradients over them inside
    the loop (the H100 program, jax 0.12.0.1; XLA:CPU's does not). With `stage_losses` (MoE
    router losses, not sums over rows) they stay automatic. A stage_fn that couples rows in
    another way (float8 per-tensor scales) must be given no row axes.

    A stage-dependent schedule (`schedule.stage_dependent`, see `schedule_for_mesh`) needs a
    collective-free chunk: every mesh axis but `axis_name` and the manual row axes of size 1
    (else ValueError).
    """
    p, m, v = schedule.stages, schedule.microbatches, schedule.virtual_stages
    if mesh.shape[axis_name] != p:
        raise ValueError(
            f"mesh axis {axis_name}={mesh.shape[axis_name]} but schedule has stages={p}")
    # The row axes of size > 1 are manual too: a device computes on its own rows of each
    # microbatch and the data-parallel sums of the loss and the gradients run once, after the
    # loop. Left automatic, GSPMD all-reduced each backward's weight gradients and the head's
    # over them inside the loop, every tick (m + p - 1 all-reduces of a stage's gradients per
    # step instead of one), and inside a stage-dependent switch such a collective would hang.
    # Not with `stage_losses` (an MoE router's losses are not sums over rows).
    rows_axes = () if stage_losses else tuple(a for a in row_axes if mesh.shape.get(a, 1) > 1)
    if schedule.stage_dependent and not collective_free(dict(mesh.shape), axis_name, rows_axes):
        raise ValueError(
            f"a stage-dependent schedule needs a collective-free chunk: every mesh axis but "
            f"{axis_name!r} and the row axes {rows_axes} of size 1 (stage_losses: no row axes), "
            f"got {dict(mesh.shape)}")
    row_devices = int(np.prod([mesh.shape[a] for a in rows_axes]))
    if inputs.shape[1] % row_devices:
        raise ValueError(f"microbatch rows={inputs.shape[1]} do not split over "
                         f"{'x'.join(rows_axes)}={row_devices}")
    for leaf in jax.tree.leaves(stage_params):
        if leaf.shape[0] != p * v:
            raise ValueError(f"stage_params leading dim {leaf.shape[0]} != "
                             f"stages*virtual_stages={p}*{v}; lay them out with stack_stages")
    if inputs.shape[0] != m:
        raise ValueError(f"inputs leading dim {inputs.shape[0]} != microbatches={m}; "
                         "reshape to [microbatches, microbatch, ...]")
    if side is None:
        sideless_stage_fn = stage_fn
        stage_fn = lambda params, h, _: sideless_stage_fn(params, h)  # noqa: E731
        side = jnp.zeros(inputs.shape[:2], jnp.int32)  # [microbatches, rows]: splits as inputs do
    if not stage_losses:
        plain_stage_fn = stage_fn
        stage_fn = lambda params, h, s: (  # noqa: E731
            plain_stage_fn(params, h, s), jnp.zeros((), jnp.float32), {})
    body = functools.partial(_pipeline_body, stage_fn, head_fn, schedule, axis_name, rows_axes)
    rows = P(None, rows_axes or None)  # [microbatches, rows, ...]: rows split over rows_axes
    mapped = jax.shard_map(
        body, mesh=mesh, axis_names={axis_name, *rows_axes},
        in_specs=(P(axis_name), P(), rows, rows, rows),
        out_specs=(P(), (P(axis_name), P(), rows), P(axis_name)),
        # The carried buffers start equal on every stage and become per-stage after the first
        # ppermute; skipping the replication check avoids pvary/pcast, whose API moves in 0.10-0.12.
        check_vma=False)
    loss, grads, stats = mapped(
        _split_over(stage_params, mesh, axis_name), head_params,
        *(_split_over(tree, mesh, rows_axes, dim=1) for tree in (inputs, targets, side)))
    return (loss, grads, stats) if stage_losses else (loss, grads)


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
        return jax.sharding.reshard(leaf, NamedSharding(mesh, P(*spec[:leaf.ndim])))

    return jax.tree.map(put, tree)


def _pipeline_body(stage_fn, head_fn, schedule, axis_name, rows_axes,
                   stage_params, head_params, inputs, targets, side):
    """One device: stage_params leaves [v, layers_per_chunk, ...]; scans the schedule's ticks.
    With `rows_axes` (manual too) the microbatches hold this device's rows only: the loss and
    the gradients of the head and the stages are partial sums until the psums at the end."""
    p, lowered = schedule.stages, lower_schedule(schedule)
    zb = "W" in schedule.slots
    stage = jax.lax.axis_index(axis_name)
    index = functools.partial(jax.lax.dynamic_index_in_dim, axis=0, keepdims=False)
    update = functools.partial(jax.lax.dynamic_update_index_in_dim, axis=0)
    chunk_params = lambda j: jax.tree.map(lambda a: index(a, j), stage_params)  # noqa: E731
    h_zeros = jnp.zeros_like(inputs[0])  # [microbatch, ...]; zeros_like keeps explicit shardings
    side_of = lambda mb: jax.tree.map(lambda a: index(a, mb), side)  # noqa: E731
    treedef, sources, constants, stash_shapes = _residual_layout(stage_fn, chunk_params(0), h_zeros,
                                                                 side_of(0))
    stats_shapes = jax.eval_shape(stage_fn, chunk_params(0), h_zeros, side_of(0))[2]
    stats_zeros = lambda: jax.tree.map(  # noqa: E731
        lambda s: jnp.zeros(s.shape, s.dtype), stats_shapes)
    one = jnp.ones((), jnp.float32)  # the cotangent of a chunk's own loss
    ring = schedule.virtual_stages > 1  # chunk j*p + p-1 (last device) feeds (j+1)*p (device 0)
    to_next = [(s, (s + 1) % p) for s in range(p if ring else p - 1)]
    to_prev = [(b, a) for a, b in to_next]
    param_zeros = lambda: jax.tree.map(jnp.zeros_like, chunk_params(0))  # noqa: E731
    head_zeros = lambda: jax.tree.map(jnp.zeros_like, head_params)  # noqa: E731

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
        loss=jnp.zeros((), jnp.float32),
        stats=jax.tree.map(lambda s: jnp.zeros((schedule.virtual_stages, *s.shape), s.dtype),
                           stats_shapes))

    def pullback_of(carry, j, slot):
        """The pullback of chunk j, rebuilt from stash slot `slot` and the chunk's params."""
        param_leaves, rest = jax.tree.leaves(chunk_params(j)), iter(
            [index(b, slot) for b in carry["stash"]])
        leaves = [param_leaves[src] if src >= 0 else constants[k] if src == CONSTANT else next(rest)
                  for k, src in enumerate(sources)]
        return jax.tree.unflatten(treedef, leaves)

    def chunk_forward(carry, f):
        """The forward a row's F fields name: (its input, its microbatch, the chunk's (output,
        own loss, stats), the pullback's leaves)."""
        h = jnp.where(f["f_first"] == 1, index(inputs, f["f_microbatch"]),
                      index(carry["acts"], f["f_act_slot"]))
        mb, params = f["f_microbatch"], chunk_params(f["f_chunk"])
        out, pullback = _chunk_vjp(stage_fn, params, h, side_of(mb))
        leaves = jax.tree.leaves(pullback)
        if _param_sources(leaves, params) != sources:
            raise RuntimeError("stage_fn's vjp residuals changed between traces")
        return h, mb, out, leaves

    def forward_slot(carry, f, head_runs):
        """Every stage runs a forward (an idle one on a scratch input, its results dropped). Small
        outputs only; the buffers are written outside the cond (inside, XLA copied them whole)."""
        on = f["f_on"] == 1
        h, mb, (y, own_loss, stats), leaves = chunk_forward(carry, f)
        kept = [index(b, f["f_stash_slot"]) for b in carry["stash"]]
        new = [x for x, src in zip(leaves, sources) if src == STASHED]
        stash = [jnp.where(on, x, old) for x, old in zip(new, kept)]

        def head():
            tgt = jax.tree.map(lambda a: index(a, mb), targets)
            loss, (dhead, dy) = jax.value_and_grad(head_fn, argnums=(0, 1))(head_params, y, tgt)
            return loss.astype(jnp.float32), dhead, dy.astype(h.dtype)

        def no_head():
            return jnp.zeros((), jnp.float32), head_zeros(), h_zeros

        loss, dhead, dy = jax.lax.cond(head_runs, head, no_head)
        mine = on & (f["f_head"] == 1)
        loss = jnp.where(mine, loss, 0.0) + jnp.where(on, own_loss.astype(jnp.float32), 0.0)
        return dict(send_act=y.astype(h.dtype), stash=stash, loss=loss,
                    stats=jax.tree.map(lambda x: jnp.where(on, x, 0), stats),
                    dhead=jax.tree.map(lambda d: jnp.where(mine, d, 0), dhead), head_cotangent=dy)

    def no_forward(carry, f, head_runs):
        return dict(send_act=h_zeros, stash=[index(b, f["f_stash_slot"]) for b in carry["stash"]],
                    loss=jnp.zeros((), jnp.float32), stats=stats_zeros(), dhead=head_zeros(),
                    head_cotangent=h_zeros)

    def backward_slot(carry, b):
        """B: the chunk's input gradient (to the previous stage), and unless zero-bubble defers
        it to W, its weight gradient."""
        pullback = pullback_of(carry, b["b_chunk"], b["b_stash_slot"])
        dparams, dh = pullback((index(carry["grads"], b["b_grad_slot"]), one))
        on = b["b_on"] == 1
        dparams = param_zeros() if zb else jax.tree.map(lambda d: jnp.where(on, d, 0), dparams)
        return dict(send_grad=dh.astype(h_zeros.dtype), dparams=dparams)

    def no_backward(carry, b):
        return dict(send_grad=h_zeros, dparams=param_zeros())

    def weight_slot(carry, w):
        """Zero-bubble's W: the weight gradient from the same stash and cotangent as its B."""
        pullback = pullback_of(carry, w["w_chunk"], w["w_stash_slot"])
        dparams, _ = pullback((index(carry["grads"], w["w_grad_slot"]), one))
        return jax.tree.map(lambda d: jnp.where(w["w_on"] == 1, d, 0), dparams)

    def add_to_chunk(grads, j, d):
        return jax.tree.map(lambda g, x: update(g, index(g, j) + x, j), grads, d)

    def add_forward(carry, r, fo):
        """Row r's forward results written into the carry (both control flows): its stash slot,
        loss, chunk statistics, head gradients, and the head's cotangent into the gradient slot
        its backward reads (a scratch slot when this forward ran no head)."""
        head_cotangent_to = jnp.where((r["f_on"] == 1) & (r["f_head"] == 1), r["f_grad_slot"],
                                      lowered.gradient_slots)
        return dict(
            carry,
            stash=[update(buf, x, r["f_stash_slot"]) for buf, x in zip(carry["stash"], fo["stash"])],
            loss=carry["loss"] + fo["loss"],
            stats=add_to_chunk(carry["stats"], r["f_chunk"], fo["stats"]),
            head_grads=jax.tree.map(jnp.add, carry["head_grads"], fo["dhead"]),
            grads=update(carry["grads"], fo["head_cotangent"], head_cotangent_to))

    # Stage-dependent control flow (zero-bubble on a collective-free chunk): each device runs
    # the one action its own row names, through `lax.switch`. The branches return small values
    # only; the buffers are written after the switch, as in the uniform tick.
    def idle(carry, r):
        return dict(send_act=h_zeros, send_grad=h_zeros,
                    stash=[index(b, r["f_stash_slot"]) for b in carry["stash"]],
                    loss=jnp.zeros((), jnp.float32), stats=stats_zeros(), dhead=head_zeros(),
                    head_cotangent=h_zeros, dparams=param_zeros())

    def forward(carry, r, with_head):
        h, mb, (y, own_loss, stats), leaves = chunk_forward(carry, r)
        out = dict(idle(carry, r), send_act=y.astype(h.dtype), loss=own_loss.astype(jnp.float32),
                   stats=stats, stash=[x for x, src in zip(leaves, sources) if src == STASHED])
        if with_head:  # the last chunk: its head's loss, gradient and cotangent
            tgt = jax.tree.map(lambda a: index(a, mb), targets)
            loss, (dhead, dy) = jax.value_and_grad(head_fn, argnums=(0, 1))(head_params, y, tgt)
            out.update(loss=out["loss"] + loss.astype(jnp.float32), dhead=dhead,
                       head_cotangent=dy.astype(h.dtype))
        return out

    def input_gradient(carry, r):  # B
        pullback = pullback_of(carry, r["b_chunk"], r["b_stash_slot"])
        _, dh = pullback((index(carry["grads"], r["b_grad_slot"]), one))
        return dict(idle(carry, r), send_grad=dh.astype(h_zeros.dtype))

    def weight_gradient(carry, r):  # W
        return dict(idle(carry, r), dparams=weight_slot(carry, r))

    branches = [idle, functools.partial(forward, with_head=False),
                functools.partial(forward, with_head=True), input_gradient, weight_gradient]

    def stage_tick(carry, rows):
        r = dict(zip(FIELDS, index(rows, stage)))  # this device's row: its own action
        branch = r["f_on"] * (1 + r["f_head"]) + 3 * r["b_on"] + 4 * r["w_on"]
        o = jax.lax.switch(branch, branches, carry, r)
        input_grad = jnp.where((r["b_on"] == 1) & (r["b_first"] == 1), o["send_grad"],
                               index(carry["input_grads"], r["b_microbatch"]))
        carry = dict(
            add_forward(carry, r, o),
            input_grads=update(carry["input_grads"], input_grad, r["b_microbatch"]),
            stage_grads=add_to_chunk(carry["stage_grads"], r["w_chunk"], o["dparams"]))
        # The exchange, on every device every tick, outside the switch.
        arrived_act = jax.lax.ppermute(o["send_act"], axis_name, to_next)
        arrived_grad = jax.lax.ppermute(o["send_grad"], axis_name, to_prev)
        carry["acts"] = update(carry["acts"], arrived_act, r["recv_act_slot"])
        carry["grads"] = update(carry["grads"], arrived_grad, r["recv_grad_slot"])
        return carry, None

    def tick(carry, xs):
        rows, running, head_runs = xs
        r = dict(zip(FIELDS, index(rows, stage)))  # this device's actions (same on its stage)
        # Slot F. The predicates are the tick's, the same on every device (module docstring).
        fo = jax.lax.cond(running[0] == 1, forward_slot, no_forward, carry, r, head_runs == 1)
        carry = add_forward(carry, r, fo)
        # Slot B.
        bo = jax.lax.cond(running[1] == 1, backward_slot, no_backward, carry, r)
        input_grad = jnp.where((r["b_on"] == 1) & (r["b_first"] == 1), bo["send_grad"],
                               index(carry["input_grads"], r["b_microbatch"]))
        carry = dict(carry, input_grads=update(carry["input_grads"], input_grad, r["b_microbatch"]))
        if not zb:
            carry["stage_grads"] = add_to_chunk(carry["stage_grads"], r["b_chunk"], bo["dparams"])
        else:  # Slot W.
            dw = jax.lax.cond(running[2] == 1, weight_slot, lambda *_: param_zeros(), carry, r)
            carry["stage_grads"] = add_to_chunk(carry["stage_grads"], r["w_chunk"], dw)
        # The exchange: activations forward, gradients backward, every tick on every device.
        arrived_act = jax.lax.ppermute(fo["send_act"], axis_name, to_next)
        arrived_grad = jax.lax.ppermute(bo["send_grad"], axis_name, to_prev)
        carry["acts"] = update(carry["acts"], arrived_act, r["recv_act_slot"])
        carry["grads"] = update(carry["grads"], arrived_grad, r["recv_grad_slot"])
        return carry, None

    if schedule.stage_dependent:
        carry, _ = jax.lax.scan(stage_tick, carry, jnp.asarray(lowered.table))
    else:
        carry, _ = jax.lax.scan(tick, carry, (jnp.asarray(lowered.table), jnp.asarray(
            lowered.running), jnp.asarray(lowered.heads)))
    # Summed in float32: a bfloat16 all-reduce here aborts XLA:CPU's AllReducePromotion pass
    # ("Invalid binary instruction opcode copy", jax 0.12.0.1) once data and tensor are > 1.
    def psum(x, axes):
        return jax.lax.psum(x.astype(jnp.float32), axes).astype(x.dtype) if axes else x

    everywhere = (axis_name, *rows_axes)  # one stage, all rows
    input_grads = psum(carry["input_grads"], axis_name)  # rows stay on their device
    stage_grads = jax.tree.map(lambda g: psum(g, rows_axes), carry["stage_grads"])
    head_grads = jax.tree.map(lambda g: psum(g, everywhere), carry["head_grads"])
    return psum(carry["loss"], everywhere), (stage_grads, head_grads, input_grads), carry["stats"]


# ----------------------------------------------------------------------------- a model, pipelined


def model_value_and_grad(model, params, batch, *, schedule: Schedule, mesh: jax.sharding.Mesh,
                         loss_chunks: int, axis_name: str = "pipe",
                         row_axes: tuple[str, ...] = ("data",)):
    """The language-model loss of `model` with its blocks pipelined over `axis_name`.

    model: a jaxpar Transformer (abstract is enough: only its structure and config are read);
        its pieces do the work -- `embed` before the pipeline, `run_blocks` for a stage's chunk
        of layers, `head_loss` (final norm, output projection, loss in model.dtype) on the last
        stage.
    params: the model's parameters as a pure dict; batch: {inputs, targets, positions,
        segment_ids, loss_mask}, each [batch, seq] (already in ring attention's layout when the
        model has one: positions and segment ids travel with their tokens).
    row_axes: the mesh axes that split only the batch rows, parameters replicated over them
        (`row_axes_for`; `pipeline_value_and_grad`); none for MoE and float8 models whatever given.

    Returns (gradients of the summed objective, shaped like params; {"nll": summed NLL, "count":
    tokens}, and for MoE models the router statistics). Activations and their gradients travel
    between stages in model.dtype.

    MoE: the objective is what the unpipelined step minimises when it accumulates one microstep
    per pipeline microbatch (jaxpar.train's `loss_sum`): per microbatch i, NLL_i + count_i *
    (aux_loss_weight * aux_i + z_loss_weight * z_i), aux_i and z_i the means over the model's
    MoE layers of that microbatch's router losses. A stage adds its own layers' share, count_i *
    weight * (its layers' sum) / (MoE layers), as its chunk's loss. The statistics are those the
    step reports for accumulated microsteps: aux_loss, z_loss, dropped_fraction summed over
    microbatches and divided by their number (so the step's division by parallel.grad_accum
    gives the mean), expert_load [MoE layers, experts] summed over microbatches.
    """
    moe = model.cfg.moe
    moe_layers = 0 if moe.num_experts == 0 else model.cfg.n_layers // moe.every
    if moe_layers or model.cfg.fp8:
        row_axes = ()  # the chunk couples its rows (`row_axes_for`)
    # Zero-bubble reaches ZB-H1's bubble where the chunk is collective-free (schedule_for_mesh);
    # `inspect --schedule` and the planner make the same choice.
    schedule = schedule_for_mesh(schedule, dict(mesh.shape), axis_name, row_axes=row_axes)
    p, m, v = schedule.stages, schedule.microbatches, schedule.virtual_stages
    graphdef = nnx.graphdef(model)

    def stage_fn(chunk_params, h, side):
        positions, segment_ids, loss_mask = side
        h, stats = model.run_blocks(chunk_params, h, positions, segment_ids)
        if not moe_layers:
            return h
        count = jax.lax.stop_gradient(jnp.sum(loss_mask))
        penalty = count * (moe.aux_loss_weight * jnp.sum(stats["aux_loss"])
                           + moe.z_loss_weight * jnp.sum(stats["z_loss"])) / moe_layers
        stats = {k: jax.lax.stop_gradient(x) for k, x in stats.items()}
        return h, penalty.astype(jnp.float32), {**stats, "penalty": jax.lax.stop_gradient(penalty)}

    def head_fn(head_params, h, targets):
        return model.head_loss(head_params, h, targets["targets"], targets["loss_mask"],
                               chunks=loss_chunks)[0]

    def embed(table):
        return nnx.merge(graphdef, {**params, "embedding": table}).embed(batch["inputs"])

    x, embed_vjp = jax.vjp(embed, params["embedding"])
    micro = split_microbatches(batch, m)
    objective, (stage_grads, head_grads, input_grads), *stats = pipeline_value_and_grad(
        stage_fn, head_fn, stack_stages(params["blocks"], p, v), model.head_params(params),
        split_microbatches(x, m), {k: micro[k] for k in ("targets", "loss_mask")},
        schedule=schedule, mesh=mesh, axis_name=axis_name,
        side=(micro["positions"], micro["segment_ids"], micro["loss_mask"]),
        stage_losses=bool(moe_layers), row_axes=row_axes)
    (embedding_grad,) = embed_vjp(merge_microbatches(input_grads))
    grads = {**head_grads, "blocks": unstack_stages(stage_grads, p, v)}
    grads["embedding"] = embedding_grad + head_grads.get("embedding", 0.0)  # tied: both uses
    aux = {"nll": objective, "count": jnp.sum(batch["loss_mask"])}
    if moe_layers:
        per_layer = unstack_stages(stats[0], p, v)  # [MoE layers, ...], summed over microbatches
        aux["nll"] = objective - jnp.sum(per_layer["penalty"])
        aux.update({k: jnp.mean(per_layer[k]) / m
                    for k in ("aux_loss", "z_loss", "dropped_fraction")})
        aux["expert_load"] = per_layer["expert_load"]
    return grads, aux
