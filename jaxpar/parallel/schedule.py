"""Pipeline schedules as tables: which stage runs which action in which tick, built in plain
Python before anything is traced (GPipe, 1F1B, interleaved 1F1B and zero-bubble ZB-H1).

The layer stack is cut into `stages * virtual_stages` chunks. Chunk c lives on pipe device
c % stages (Megatron-LM's interleaved placement; with virtual_stages=1 chunk c is stage c). The
batch is split into `microbatches`. Time advances in ticks; in one tick every stage runs up to
one action in each of the schedule's slots, in order -- F (forward of one microbatch through one
chunk), then B (its backward), then, for the zero-bubble schedule, W -- and then one exchange
passes activations to the next device and gradients to the previous one. In steady state each
stage runs a forward and a backward every tick, so a tick lasts F + B, not two backwards as when
a tick held one action. Zero-bubble splits the backward in two: B, the input gradient only (what
the previous stage waits for), and W, later, the weight gradient only. Stage-dependent
zero-bubble (`_build_zb_h1`, below) runs one action of any phase per stage per tick instead; the
runtime (`jaxpar.parallel.pipeline`) may run it only on a collective-free chunk
(`schedule_for_mesh`).

`lower_schedule` turns a schedule into the integer table the runtime scans: one `Row` per tick
and stage, naming the actions and the buffer slots they read and write (a slot is reused as soon
as its last reader has run, so 1F1B holds a bounded number of stashes whatever `microbatches` is,
GPipe all of them).

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

This module imports no JAX: the config checks and the planner read it cheaply.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any, NamedTuple

import numpy as np


class Kind(enum.StrEnum):
    """The schedules (`parallel.pipeline_schedule`)."""

    GPIPE = "gpipe"  # all forwards, then all backwards
    ONE_F_ONE_B = "1f1b"  # after warm-up, one forward and one backward per tick
    INTERLEAVED = "interleaved"  # 1F1B over virtual_stages chunks per device
    ZERO_BUBBLE = "zb"  # 1F1B with the backward split into B (input) and W (weights)


SCHEDULES = tuple(kind.value for kind in Kind)


class Phase(enum.StrEnum):
    """What an action computes for one microbatch through one chunk."""

    FORWARD = "F"
    BACKWARD = "B"  # zero-bubble: the input gradient only
    WEIGHT = "W"  # zero-bubble: the weight gradient


F, B, W = Phase.FORWARD, Phase.BACKWARD, Phase.WEIGHT


class Action(NamedTuple):
    """One slot of work: `phase` of `microbatch` through `chunk`.

    `chunk` is the virtual chunk on its stage, 0..virtual_stages-1; the model chunk it holds is
    chunk * stages + stage.
    """

    phase: Phase
    microbatch: int
    chunk: int


@dataclasses.dataclass(frozen=True)
class Schedule:
    """A static pipeline schedule: `ticks[t][k][stage]` is the Action that `stage` runs in slot k
    (phase `slots[k]`) of tick t, or None (idle)."""

    kind: Kind
    stages: int
    microbatches: int
    virtual_stages: int
    slots: tuple[Phase, ...]
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
            merged = (
                tuple(next((row[s] for row in tick if row[s] is not None), None) for s in range(self.stages))
                for tick in self.ticks
            )
            return tuple(row for row in merged if any(row))
        return tuple(row for tick in self.ticks for row in tick if any(row))


def phase_costs(kind: str) -> dict[Phase, int]:
    """Cost of one chunk's action, in forwards: B = 2F; zero-bubble splits it into B = W = F."""
    return {F: 1, B: 1, W: 1} if kind == Kind.ZERO_BUBBLE else {F: 1, B: 2}


def textbook_bubble(kind: str, stages: int, microbatches: int, virtual_stages: int = 1) -> float:
    """The published idle fraction: (p-1)/(m+p-1) for GPipe and 1F1B, (p-1)/(v*m+p-1) for
    interleaved, (p-1)(F+B-W)/(m(F+B+W) + (p-1)(F+B-W)) = (p-1)/(3m+p-1) for ZB-H1."""
    p, m, v = stages, microbatches, virtual_stages
    if kind == Kind.ZERO_BUBBLE:
        return (p - 1) / (3 * m + p - 1)
    return (p - 1) / (v * m + p - 1)


# ----------------------------------------------------------------------------- validation


def validate_pipeline(
    kind: str,
    stages: int,
    microbatches: int,
    virtual_stages: int = 1,
    *,
    layers: int | None = None,
    batch: int | None = None,
) -> None:
    """Raise ValueError, naming the numbers, unless the pipeline layout is possible."""
    p, m, v = stages, microbatches, virtual_stages
    if kind not in SCHEDULES:
        raise ValueError(f"pipeline schedule {kind!r} is unknown; choose one of {SCHEDULES}")
    if p < 1 or m < 1 or v < 1:
        raise ValueError(f"stages={p}, microbatches={m}, virtual_stages={v} must all be >= 1")
    if kind == Kind.INTERLEAVED and v < 2:
        raise ValueError(f"interleaved needs virtual_stages >= 2, got {v}; use '1f1b' for v=1")
    if kind != Kind.INTERLEAVED and v != 1:
        raise ValueError(f"{kind} runs one chunk per stage; virtual_stages={v} needs 'interleaved'")
    if kind == Kind.INTERLEAVED and m % p:
        raise ValueError(
            f"interleaved needs microbatches={m} divisible by stages={p}; "
            f"try microbatches={max(p, m - m % p)} or {m + p - m % p}"
        )
    if layers is not None and layers % (p * v):
        raise ValueError(f"layers={layers} is not divisible by stages*virtual_stages={p}*{v}={p * v}")
    if batch is not None and batch % m:
        raise ValueError(f"batch={batch} does not split into microbatches={m} equal microbatches")


# ----------------------------------------------------------------------------- schedules


def _phase_order(p: int, m: int, v: int, phase: Phase) -> list[Action]:
    """The order in which a stage runs its m*v actions of one phase: microbatches in groups of p,
    every chunk of a group before the next group (Megatron-LM's interleaved order; with v=1
    simply 0..m-1); backward phases visit the chunks in reverse."""

    def order(k: int) -> Action:
        group, within = divmod(k, p * v)
        chunk = within // p
        return Action(phase, group * p + within % p, chunk if phase == F else v - 1 - chunk)

    return [order(k) for k in range(m * v)]


def stash_limit(kind: str, stages: int, virtual_stages: int = 1) -> int | None:
    """How many microbatch-chunks a stage may hold stashed before its next forward waits (None:
    no limit, GPipe). 2p-1 (+ p per extra chunk) is what the textbook bubble needs when a hand-off
    takes a tick: a microbatch returns to stage 0 2p-2 ticks after it left."""
    if kind == Kind.GPIPE:
        return None
    return 2 * stages - 1 + (virtual_stages - 1) * stages


def build_schedule(
    kind: str, stages: int, microbatches: int, virtual_stages: int = 1, *, stage_dependent: bool = False
) -> Schedule:
    """Schedule `kind` ('gpipe', '1f1b', 'interleaved', 'zb') as ticks of slots of Actions.

    `stage_dependent` (zero-bubble only) builds the ZB-H1 table for stage-dependent control flow
    (`_build_zb_h1`); only a collective-free chunk may run it (`schedule_for_mesh` decides).
    Otherwise the uniform table (`_UniformBuilder`).
    """
    validate_pipeline(kind, stages, microbatches, virtual_stages)
    kind = Kind(kind)
    if stage_dependent:
        if kind != Kind.ZERO_BUBBLE:
            raise ValueError(f"stage-dependent control flow is built for 'zb' only, not {kind.value!r}")
        return _build_zb_h1(stages, microbatches)
    return _UniformBuilder(kind, stages, microbatches, virtual_stages).build()


class _UniformBuilder:
    """The uniform tables. Every tick, each stage runs, slot by slot, the next action of that
    phase in its order (`_phase_order`) when its inputs are there: a forward needs the previous
    chunk's forward from an earlier tick (the exchange between ticks delivers it), a backward
    needs its own forward (an earlier slot; the last chunk's backward can run in the tick of its
    forward) and the next chunk's backward from an earlier tick. GPipe starts a stage's backwards
    after all its forwards; 1F1B, interleaved and zero-bubble hold at most `stash_limit` stashes.
    Zero-bubble's W slot runs on the ticks where stage 0 runs a B -- every stage then takes its
    oldest pending weight gradient -- so W costs m slots in all and none of the warm-up or
    cool-down."""

    def __init__(self, kind: Kind, p: int, m: int, v: int):
        self.kind, self.p, self.m, self.v = kind, p, m, v
        self.last, self.n = p * v - 1, m * v  # the last model chunk; actions per phase and stage
        self.slots = (F, B, W) if kind == Kind.ZERO_BUBBLE else (F, B)
        self.queues = {phase: _phase_order(p, m, v, phase) for phase in self.slots}
        self.cursor = {phase: [0] * p for phase in self.slots}  # next action, per stage
        self.limit = stash_limit(kind, p, v)
        self.stashed = [0] * p
        self.finished: dict[tuple[Phase, int, int], tuple[int, int]] = {}  # -> (tick, slot)

    def _done(self, phase: Phase, microbatch: int, chunk: int, before: tuple[int, int]) -> bool:
        key = (phase, microbatch, chunk)
        return key in self.finished and self.finished[key] < before

    def _ready(self, a: Action, s: int, t: int, k: int, tick: list) -> bool:
        """Whether stage s may run action a in slot k of tick t (`tick`: its slots so far)."""
        c, i = a.chunk * self.p + s, a.microbatch
        if a.phase == F:
            return (c == 0 or self._done(F, i, c - 1, (t, 0))) and (
                self.limit is None or self.stashed[s] < self.limit
            )
        if a.phase == B:
            return (
                self._done(F, i, c, (t, k))
                and (c == self.last or self._done(B, i, c + 1, (t, 0)))
                and (self.kind != Kind.GPIPE or self.cursor[F][s] == self.n)
            )
        return self._done(B, i, c, (t, k)) and tick[1][0] is not None  # W: with stage 0's B

    def _slot(self, t: int, k: int, phase: Phase, tick: list) -> tuple[Action | None, ...]:
        row = []
        for s in range(self.p):
            a = self.queues[phase][self.cursor[phase][s]] if self.cursor[phase][s] < self.n else None
            row.append(a if a is not None and self._ready(a, s, t, k, tick) else None)
        for s, a in enumerate(row):
            if a is not None:
                self.finished[(phase, a.microbatch, a.chunk * self.p + s)] = (t, k)
                self.cursor[phase][s] += 1
                self.stashed[s] += phase == F
        return tuple(row)

    def build(self) -> Schedule:
        ticks = []
        while any(self.cursor[phase][s] < self.n for phase in self.slots for s in range(self.p)):
            t, tick = len(ticks), []
            for k, phase in enumerate(self.slots):
                tick.append(self._slot(t, k, phase, tick))
            for s, a in enumerate(tick[-1]):  # the last slot frees the stash (B, or zb's W)
                self.stashed[s] -= a is not None
            if not any(a for row in tick for a in row):
                raise RuntimeError(f"{self.kind} schedule deadlocked at tick {t}")  # a bug here
            ticks.append(tuple(tick))
        return Schedule(self.kind, self.p, self.m, self.v, self.slots, tuple(ticks))


# How a stage-dependent action changes the number of stashes its stage holds (F to W).
_STASH_CHANGE = {F: 1, B: 0, W: -1}


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
    nxt = {phase: [0] * p for phase in Phase}  # next microbatch of each phase, per stage
    finished: dict[tuple[Phase, int, int], int] = {}  # (phase, microbatch, stage) -> tick
    stashed, previous = [0] * p, [None] * p
    ticks = []
    while any(n < m for n in nxt[W]):
        t = len(ticks)

        def before(key) -> bool:  # ran in an earlier tick
            return finished.get(key, t) < t

        def ready(phase: Phase, s: int) -> bool:
            i = nxt[phase][s]
            if i == m:
                return False
            if phase == F:
                return (s == 0 or before((F, i, s - 1))) and stashed[s] < p
            if phase == B:
                return before((F, i, s)) and (s == p - 1 or before((B, i, s + 1)))
            return before((B, i, s))

        row = []
        for s in range(p):
            preference = (B, F, W) if previous[s] == F else (F, B, W)
            phase = next((ph for ph in preference if ready(ph, s)), None)
            row.append(None if phase is None else Action(phase, nxt[phase][s], 0))
        if not any(row):
            raise RuntimeError(f"zb (stage-dependent) schedule deadlocked at tick {t}")  # a bug
        for s, a in enumerate(row):
            if a is not None:
                finished[a.phase, a.microbatch, s] = t
                nxt[a.phase][s] += 1
                stashed[s] += _STASH_CHANGE[a.phase]
                previous[s] = a.phase
        ticks.append(
            tuple(tuple(a if a is not None and a.phase == phase else None for a in row) for phase in Phase)
        )
    return Schedule(Kind.ZERO_BUBBLE, p, m, 1, (F, B, W), tuple(ticks), stage_dependent=True)


# ----------------------------------------------------------------------------- which table runs


def row_axes_for(model_cfg, zero_stage: int) -> tuple[str, ...]:
    """The mesh axes that, inside a pipelined chunk of this model, only split the rows of a
    microbatch: `data`, and `fsdp` below ZeRO-2 (parameters and gradients whole on it; ZeRO-2/3
    split gradients or weights over fsdp). The runtime makes them manual and sums over them once,
    after its loop (`jaxpar.parallel.pipeline`). None where the chunk couples its rows: MoE layers
    (router losses and statistics over the whole microbatch) and float8 matmuls (per-tensor scales
    from the whole activation's amax) keep those axes automatic, so GSPMD reduces over them."""
    if model_cfg.moe.num_experts or model_cfg.fp8:
        return ()
    return ("data", "fsdp") if zero_stage <= 1 else ("data",)


def collective_free(
    sizes: dict[str, int], axis_name: str = "pipe", row_axes: tuple[str, ...] = ("data",)
) -> bool:
    """Whether a chunk's forward and backward run without collectives on a mesh of these axis
    sizes: every axis but `axis_name` and the row axes (`row_axes_for`) has size 1.

    A row axis splits the batch and keeps the parameters whole, and the pipeline makes it manual,
    so a chunk computes on its own rows; the gradient reduction over it happens after the
    pipeline loop. Any other axis puts collectives inside the chunk: fsdp at ZeRO-2/3 (gradient
    reduce-scatters, weight gathers), tensor (Megatron's all-reduces), context (ring attention's
    permutes), expert (MoE all-to-alls), and a row axis the model couples (MoE, float8). A
    collective inside a branch that only some stages take waits for devices that never arrive
    (`jaxpar.parallel.pipeline`'s docstring), so only a collective-free chunk may branch per stage.
    """
    return all(size == 1 for name, size in sizes.items() if name not in (axis_name, *row_axes))


def schedule_for_mesh(
    schedule: Schedule,
    sizes: dict[str, int],
    axis_name: str = "pipe",
    *,
    row_axes: tuple[str, ...] = ("data",),
) -> Schedule:
    """The schedule the runtime executes on a mesh of these axis sizes, with these row axes
    (`row_axes_for`): zero-bubble becomes the stage-dependent ZB-H1 table where the chunk is
    collective-free (`collective_free`); every other schedule and layout runs as built."""
    if (
        schedule.kind == Kind.ZERO_BUBBLE
        and not schedule.stage_dependent
        and collective_free(sizes, axis_name, row_axes)
    ):
        return build_schedule(Kind.ZERO_BUBBLE, schedule.stages, schedule.microbatches, stage_dependent=True)
    return schedule


# ----------------------------------------------------------------------------- time and bubble


def tick_costs(schedule: Schedule) -> list[int]:
    """The time of every tick, in forwards of one chunk: uniform control flow runs every slot
    that any stage runs, so a tick lasts their summed cost; stage-dependent control flow runs
    each stage's own action, so it lasts the dearest one."""
    cost = phase_costs(schedule.kind)
    if schedule.stage_dependent:
        return [
            max((cost[a.phase] for row in tick for a in row if a is not None), default=0)
            for tick in schedule.ticks
        ]
    return [
        sum(cost[phase] for phase, row in zip(schedule.slots, tick) if any(row)) for tick in schedule.ticks
    ]


def bubble_fraction(schedule: Schedule) -> float:
    """Idle fraction of the program the runtime executes (`lower_schedule`'s table): 1 - the
    cost of all actions / (stages * the time of all ticks), where a tick lasts the summed cost of
    the slots that run in it (`phase_costs`: F=1, B=2; zero-bubble B=1, W=1) -- with
    stage-dependent control flow, the dearest action any stage runs in it (`tick_costs`)."""
    lowered = lower_schedule(schedule)
    cost = np.array([phase_costs(schedule.kind)[phase] for phase in schedule.slots])
    runs = [FIELDS.index(_RUNS[phase]) for phase in schedule.slots]
    work_per = lowered.table[:, :, runs] * cost  # [tick, stage, slot]
    if schedule.stage_dependent:  # what each device's lax.switch runs: its own row's phase
        time = float(np.sum(np.max(np.sum(work_per, axis=2), axis=1)))
    else:  # what every device's lax.conds run: the tick's running slots
        time = float(np.sum(lowered.running * cost))
    return 1.0 - float(np.sum(work_per)) / (schedule.stages * time)


def schedule_time(schedule: Schedule) -> int:
    """Length of the step in forwards of one chunk: the summed time of its ticks (`tick_costs`)."""
    return sum(tick_costs(schedule))


def _timeline_cells(schedule: Schedule, s: int, width: int) -> list[str]:
    """Stage s's row of `format_schedule`: a label and '=' per unit of an action's cost, '.'
    for idle units, '|' after each uniform tick."""
    costs = phase_costs(schedule.kind)
    cells = []
    for tick, tick_cost in zip(schedule.ticks, tick_costs(schedule)):
        if schedule.stage_dependent:
            a = next((row[s] for row in tick if row[s] is not None), None)
            length = 0 if a is None else costs[a.phase]
            cells += (
                [_label(schedule, a).ljust(width)]
                + ["=" * width] * (length - 1)
                + (["." * width] * (tick_cost - max(length, 1)))
            )
            continue
        for phase, row in zip(schedule.slots, tick):
            if any(row):
                a = row[s]
                rest = "." if a is None else "=" * width
                cells += [_label(schedule, a).ljust(width)]
                cells += [rest.ljust(width)] * (costs[phase] - 1)
        cells.append("|")
    return cells


def _label(schedule: Schedule, a: Action | None) -> str:
    return (
        "."
        if a is None
        else f"{a.phase}{a.microbatch}" + (f".{a.chunk}" if schedule.virtual_stages > 1 else "")
    )


def format_schedule(schedule: Schedule) -> str:
    """Cost-weighted text timeline: one row per stage, one column per unit of time (a forward of
    one chunk). An action is its label (F3 / B1 / W1; F3.1 = chunk 1) in its first column and '='
    in the rest; '.' is idle; '|' marks the exchange at the end of each tick. With
    stage-dependent control flow a tick is one column (each stage's own action) followed by the
    exchange, so no '|' is drawn."""
    width = max(len(_label(schedule, a)) for tick in schedule.ticks for row in tick for a in row)
    lines = [
        (f"stage {s} | " + " ".join(_timeline_cells(schedule, s, width))).rstrip()
        for s in range(schedule.stages)
    ]
    costs = phase_costs(schedule.kind)
    cost_text = " ".join(f"{phase}={costs[phase]}" for phase in schedule.slots)
    flow = "stage-dependent" if schedule.stage_dependent else "uniform"
    lines.append(
        f"bubble {bubble_fraction(schedule):.4f} (idle / stages x time, {cost_text}; "
        f"{schedule.kind}, stages={schedule.stages}, microbatches={schedule.microbatches}, "
        f"virtual_stages={schedule.virtual_stages}, {flow} control flow; "
        f"time {schedule_time(schedule)}, {len(schedule.ticks)} ticks)"
    )
    return "\n".join(lines)


def describe_schedule(schedule: Schedule) -> dict[str, Any]:
    """The schedule as `inspect --schedule` reports it (JSON): the cost-weighted bubble of the
    lowered program, the published one, the control flow that runs it ("uniform" or
    "stage-dependent"), time, ticks, buffer slots and the timeline."""
    lowered = lower_schedule(schedule)
    p, m, v = schedule.stages, schedule.microbatches, schedule.virtual_stages
    return {
        "schedule": schedule.kind.value,
        "stages": p,
        "microbatches": m,
        "virtual_stages": v,
        "costs": {phase.value: cost for phase, cost in phase_costs(schedule.kind).items()},
        "bubble": bubble_fraction(schedule),
        "textbook_bubble": textbook_bubble(schedule.kind, p, m, v),
        "control_flow": "stage-dependent" if schedule.stage_dependent else "uniform",
        "time": schedule_time(schedule),
        "ticks": len(schedule.ticks),
        "stash_slots": lowered.stash_slots,
        "activation_slots": lowered.activation_slots,
        "gradient_slots": lowered.gradient_slots,
        "timeline": format_schedule(schedule).splitlines(),
    }


# ----------------------------------------------------------------------------- lowering


class Work(enum.IntEnum):
    """The one action a stage runs in a tick of stage-dependent control flow: the index of the
    runtime's `lax.switch` branch (the order of its branch list)."""

    IDLE = 0
    FORWARD = 1
    FORWARD_AND_HEAD = 2  # the last chunk's forward, then the head's loss and gradient
    INPUT_GRADIENT = 3  # B
    WEIGHT_GRADIENT = 4  # W


@dataclasses.dataclass
class Row:
    """One stage's entry in one tick of the lowered table: the forward (f_*), backward (b_*) and
    weight-gradient (w_*) actions it runs, with the buffer slots they read and write, and where
    the tick's exchange stores what arrives. Flags are 0 or 1. In the runtime the same fields are
    traced int32 scalars (`Row(*table[tick, stage])`)."""

    # Forward: microbatch, chunk (on this stage); first: the input is the embedded microbatch,
    # else activation slot f_act_slot; head: the last chunk, whose head's cotangent goes to
    # gradient slot f_grad_slot; the pullback's residuals go to stash slot f_stash_slot.
    f_on: Any = 0
    f_microbatch: Any = 0
    f_chunk: Any = 0
    f_first: Any = 0
    f_head: Any = 0
    f_act_slot: Any = 0
    f_stash_slot: Any = 0
    f_grad_slot: Any = 0
    # Backward (zero-bubble: B, the input gradient only); first: its gradient is the input's.
    b_on: Any = 0
    b_microbatch: Any = 0
    b_chunk: Any = 0
    b_first: Any = 0
    b_stash_slot: Any = 0
    b_grad_slot: Any = 0
    # Zero-bubble's W: the weight gradient, from the same stash and cotangent slots as its B.
    w_on: Any = 0
    w_chunk: Any = 0
    w_stash_slot: Any = 0
    w_grad_slot: Any = 0
    # Where this tick's exchange writes the activation and the gradient that arrive.
    recv_act_slot: Any = 0
    recv_grad_slot: Any = 0
    # Stage-dependent control flow: the branch this row runs; uniform rows leave it IDLE.
    work: Any = Work.IDLE


FIELDS = tuple(field.name for field in dataclasses.fields(Row))
_RUNS = {F: "f_on", B: "b_on", W: "w_on"}  # the flag of each phase's action
# Positions within a tick, for buffer lifetimes: the slots in order, then the exchange.
_AT = {F: 0, B: 1, W: 2, "exchange": 3}


class Lowered(NamedTuple):
    """A schedule as the runtime reads it: int32 `table[tick, stage, field]` (a `Row` per tick
    and stage, fields in FIELDS order; with stage-dependent control flow at most one of f_on /
    b_on / w_on is set per row and `work` names it), `running[tick, k]` = 1 when any stage runs
    slot k (phase `slots[k]`) in that tick -- the predicate every device's `lax.cond` reads
    (uniform) -- and `heads[tick]` = 1 when some stage's forward is the last chunk's (the head
    runs), and how many slots each buffer needs. Activation and gradient slot n (one past the
    last) is a scratch slot for writes that mean nothing; a stash slot is written by a forward
    and read by the matching backward (zero-bubble: and its W)."""

    table: np.ndarray
    running: np.ndarray
    heads: np.ndarray
    activation_slots: int
    stash_slots: int
    gradient_slots: int


def _allocate(lifetimes: dict[Any, tuple[tuple[int, int], tuple[int, int]]]) -> tuple[dict[Any, int], int]:
    """Slots for values written at (tick, position) w and last read at r > w, greedily; a slot is
    free again for a write strictly after its last read."""
    busy_until: list[tuple[int, int]] = []
    slot_of = {}
    for key, (w, r) in sorted(lifetimes.items(), key=lambda kv: kv[1]):
        slot = next((k for k, until in enumerate(busy_until) if until < w), len(busy_until))
        busy_until[slot : slot + 1] = [r]
        slot_of[key] = slot
    return slot_of, len(busy_until)


class _Slots(NamedTuple):
    """Buffer slots per stage, {(microbatch, model chunk): slot}, and how many each buffer has."""

    act: list[dict]
    stash: list[dict]
    grad: list[dict]
    n_act: int
    n_stash: int
    n_grad: int


def _buffer_slots(schedule: Schedule) -> _Slots:
    """Each value's lifetime from the tick and slot of its writer to those of its last reader,
    and slots allocated for them per stage: activations (written by the exchange after the
    previous chunk's forward, read by this chunk's), stashes (a forward's residuals, read by its
    backward and W) and gradients (the head's cotangent or the exchange after the next chunk's
    backward, read by B and W)."""
    p, v = schedule.stages, schedule.virtual_stages
    last = p * v - 1
    when = {
        (a.phase, a.microbatch, a.chunk * p + s): t
        for t, tick in enumerate(schedule.ticks)
        for row in tick
        for s, a in enumerate(row)
        if a is not None
    }
    freed_by = W if W in schedule.slots else B  # the stash's and the cotangent's last reader
    acts, stash, grads = ([{} for _ in range(p)] for _ in range(3))
    for (phase, i, c), t in when.items():
        if phase != F:
            continue
        s, end = c % p, (when[freed_by, i, c], _AT[freed_by])
        if c > 0:
            acts[s][i, c] = ((when[F, i, c - 1], _AT["exchange"]), (t, _AT[F]))
        stash[s][i, c] = ((t, _AT[F]), end)
        grads[s][i, c] = ((t, _AT[F]) if c == last else (when[B, i, c + 1], _AT["exchange"]), end)
    allocated = [[_allocate(per_stage) for per_stage in kind] for kind in (acts, stash, grads)]
    act, stash_slot, grad = ([slots for slots, _ in kind] for kind in allocated)
    n_act, n_stash, n_grad = (max(n for _, n in kind) for kind in allocated)
    return _Slots(act, stash_slot, grad, n_act, n_stash, n_grad)


def _lower_action(
    rows: list[list[Row]], t: int, s: int, a: Action, schedule: Schedule, slots: _Slots
) -> None:
    """Write action `a` of stage s in tick t into its row, and into the rows of the stage its
    exchange sends to, where the arriving value is stored."""
    p = schedule.stages
    i, c = a.microbatch, a.chunk * p + s
    last = p * schedule.virtual_stages - 1
    row = rows[t][s]
    if a.phase == F:
        row.f_on, row.f_microbatch, row.f_chunk = 1, i, a.chunk
        row.f_first, row.f_head = int(c == 0), int(c == last)
        row.f_stash_slot = slots.stash[s][i, c]
        if c > 0:
            row.f_act_slot = slots.act[s][i, c]
        if c == last:
            row.f_grad_slot = slots.grad[s][i, c]
        else:  # the activation goes to the next chunk's device
            rows[t][(s + 1) % p].recv_act_slot = slots.act[(s + 1) % p][i, c + 1]
    elif a.phase == B:
        row.b_on, row.b_microbatch, row.b_chunk, row.b_first = 1, i, a.chunk, int(c == 0)
        row.b_stash_slot, row.b_grad_slot = slots.stash[s][i, c], slots.grad[s][i, c]
        if c > 0:  # the gradient goes to the previous chunk's device
            rows[t][(s - 1) % p].recv_grad_slot = slots.grad[(s - 1) % p][i, c - 1]
    else:
        row.w_on, row.w_chunk = 1, a.chunk
        row.w_stash_slot, row.w_grad_slot = slots.stash[s][i, c], slots.grad[s][i, c]
    if schedule.stage_dependent:  # the one action of this row
        row.work = {
            F: Work.FORWARD_AND_HEAD if c == last else Work.FORWARD,
            B: Work.INPUT_GRADIENT,
            W: Work.WEIGHT_GRADIENT,
        }[a.phase]


def lower_schedule(schedule: Schedule) -> Lowered:
    """Turn a Schedule into the int tables the shard_map scans over, with buffer slots assigned."""
    p, slots = schedule.stages, _buffer_slots(schedule)
    # Reads and writes that mean nothing go to the scratch slots (one past the last).
    scratch = dict(
        f_act_slot=slots.n_act,
        f_grad_slot=slots.n_grad,
        b_grad_slot=slots.n_grad,
        w_grad_slot=slots.n_grad,
        recv_act_slot=slots.n_act,
        recv_grad_slot=slots.n_grad,
    )
    rows = [[Row(**scratch) for _ in range(p)] for _ in schedule.ticks]
    running = np.zeros((len(schedule.ticks), len(schedule.slots)), np.int32)
    heads = np.zeros((len(schedule.ticks),), np.int32)
    last = p * schedule.virtual_stages - 1
    for t, tick in enumerate(schedule.ticks):
        for k, row in enumerate(tick):
            running[t, k] = any(row)
            for s, a in enumerate(row):
                if a is not None:
                    _lower_action(rows, t, s, a, schedule, slots)
                    if a.phase == F and a.chunk * p + s == last:
                        heads[t] = 1
    table = np.array(
        [[dataclasses.astuple(row) for row in tick_rows] for tick_rows in rows], np.int32
    ).reshape(len(schedule.ticks), p, len(FIELDS))
    return Lowered(table, running, heads, slots.n_act, slots.n_stash, slots.n_grad)
