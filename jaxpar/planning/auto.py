"""`mesh: auto`: the planner joined to the run. At start, what is here (the device kind and
count, the devices per host, the memory a program may take on each: a GPU's allocator limit, or
on a CPU the host's memory as `jaxpar.planning.host` counts it, shared by the emulated devices)
is read (`here`); the planner (`jaxpar.planning.search`) ranks every layout of this model, batch
and sequence on it, honouring each pinned mesh axis and parallel setting (`pins`); the fastest
`runtime.auto_candidates` that fit by prediction and that `jaxpar.checks.validate` accepts are
compiled on the real backend, nothing run (`compiled_total`), and the fastest whose compiled
program fits with headroom (`HEADROOM`: more for MoE, whose routing is uneven) is chosen
(`choose`). The choice, the runners-up and why each lost, and what was refused before compiling,
are printed and kept (`report_lines`, `to_json`: `layout.json` in the run directory). A resume
in the same run directory on as many devices keeps the recorded layout; on another count it
plans again and says so (`resolve`). `python -m jaxpar.plan --explain` prints the same reasoning
for GPUs that are not here (`explain_lines`)."""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass, field

import jax

from jaxpar import checks as checks_lib
from jaxpar.compiled import targets as targets_lib
from jaxpar.compiled.targets import GPUS, DeviceSpec
from jaxpar.config import MESH_AXES, Config, ConfigError
from jaxpar.planning import host as host_lib
from jaxpar.planning.memory import GIB
from jaxpar.planning.search import Plan, check_config, enumerate_plans, explain, runnable
from jaxpar.planning.step_time import STEP_TIME_BAND
from jaxpar.sharding import is_pipelined

# The share of the memory a program may take (`Here.usable`) that a candidate's compiled
# program may fill and still be chosen: the rest is for what the compiler's analysis does not
# see. MoE leaves more: its experts' buffers follow the routing, which is uneven.
HEADROOM = {"dense": 0.95, "moe": 0.8}
# Parallel settings the planner chooses; one the user set is honoured (kept in every candidate).
CHOSEN_SETTINGS = (
    "zero_stage",
    "remat",
    "grad_accum",
    "sequence_parallel",
    "pipeline_schedule",
    "microbatches",
    "virtual_stages",
)
# A step's FLOP/s on one emulated CPU device, for ranking: the 2-core calibration machine's
# float32 matmul rate (195 GFLOP/s) times the share a train step reaches (host.STEP_EFFICIENCY).
CPU_FLOPS = 195e9 * host_lib.STEP_EFFICIENCY
LAYOUT_FILE = "layout.json"  # the choice and its reasons, in the run directory


@dataclass
class Here:
    """The devices a run plans for."""

    device: DeviceSpec  # the time model's numbers for one device
    backend: str  # "cpu" or "gpu": whose compiler lays out the memory
    count: int  # devices in the run
    per_node: int  # devices of one host (one process's, on a CPU)
    usable: float  # bytes a program may take on one device
    words: str  # what it is, for the report


def here(cfg: Config, count: int) -> Here:
    """The devices present: their kind, count, devices per host and usable memory."""
    dev = jax.devices()[0]
    local = jax.local_device_count()
    if dev.platform == "cpu":
        limit = host_lib.limit_bytes(cfg, host_lib.available_bytes())
        share = math.inf if limit is None else (limit - host_lib.PROCESS_BYTES) / host_lib.COMPILER_MARGIN
        # A nominal rate, not this machine's measured one: the ranking then does not move with
        # the machine's load from one start to the next. Emulated devices share the host: its
        # memory bandwidth and copies stand in for links.
        spec = DeviceSpec("cpu", "cpu", "emulated CPU device", CPU_FLOPS, None, 20e9, 10e9, 10e9)
        where = "" if limit is None else f"; {host_lib.room(cfg, limit, host_lib.available_bytes())}"
        words = f"{count} emulated CPU device(s), {local} per process{where}"
        return Here(spec, "cpu", count, local, max(share, 0.0) / local, words)
    known = [g for g in GPUS.values() if g.description == dev.device_kind and g.bf16_flops]
    if not known:
        raise ConfigError(
            f"mesh: auto: no planning numbers for device kind {dev.device_kind!r} (known: "
            f"{', '.join(g.description for g in GPUS.values() if g.bf16_flops)}); set the mesh.* axes"
        )
    usable = targets_lib.device_memory(dev) or known[0].usable_bytes
    words = f"{count} x {known[0].name}, {local} per host, {usable / GIB:.1f} GiB usable each"
    return Here(known[0], "gpu", count, local, usable, words)


def pins(settings: dict, auto: list[str], cfg: Config) -> tuple[dict[str, int], dict]:
    """(the mesh axes the user fixed, the parallel settings among CHOSEN_SETTINGS the user set),
    their values as `cfg` (built from `settings`) types them."""
    mesh = settings.get("mesh", {})
    axes = {a: getattr(cfg.mesh, a) for a in MESH_AXES if a not in auto and a in mesh}
    parallel = settings.get("parallel", {})
    parallel = parallel if isinstance(parallel, dict) else {}
    return {a: v for a, v in axes.items() if v != -1}, {
        k: getattr(cfg.parallel, k) for k in CHOSEN_SETTINGS if k in parallel
    }


def _keeps(plan: Plan, axes: dict[str, int], settings: dict) -> bool:
    """Whether a plan keeps the pinned axes and settings (ZeRO where fsdp splits, the pipeline's
    where it pipelines)."""
    if any(plan.sizes[a] != int(v) for a, v in axes.items()):
        return False
    p = plan.cfg.parallel
    for key, want in settings.items():
        if key == "zero_stage" and plan.sizes["fsdp"] == 1:
            continue
        if key in ("pipeline_schedule", "microbatches", "virtual_stages") and not is_pipelined(plan.sizes):
            continue
        if getattr(p, key) != want:
            return False
    return True


def size(n: float) -> str:
    """Bytes in words: GiB, or MiB below a tenth of one."""
    return f"{n / GIB:.3g} GiB" if n >= GIB / 10 else f"{n / 2**20:.3g} MiB"


def layout_text(plan: Plan) -> str:
    """A plan's layout in one phrase: the axes over 1 and the settings chosen."""
    s, p = plan.sizes, plan.cfg.parallel
    words = [" ".join(f"{a}={s[a]}" for a in MESH_AXES if s[a] > 1) or "one device"]
    if s["fsdp"] > 1:
        words.append(f"ZeRO-{p.zero_stage}")
    words.append(f"remat {p.remat}")
    if is_pipelined(s):
        virtual = f"x{p.virtual_stages}" if p.pipeline_schedule == "interleaved" else ""
        words.append(f"{p.pipeline_schedule}{virtual} {p.microbatches} microbatches")
    if p.grad_accum > 1:
        words.append(f"grad_accum {p.grad_accum}")
    if p.sequence_parallel:
        words.append("sequence parallel")
    return ", ".join(words)


def time_text(plan: Plan, mfu: bool) -> str:
    t = plan.time
    lo, hi = t["step_time_range_s"]
    text = f"step {t['step_time_s']:.3g} s predicted ({lo:.3g}-{hi:.3g} s)"
    if mfu:
        text += f", MFU {t['mfu']:.1%} ({t['mfu_range'][0]:.1%}-{t['mfu_range'][1]:.1%})"
    return text


def compiled_total(compiled) -> int:
    """Bytes per device of a compiled program, from XLA's memory analysis (what `inspect` and
    `plan --verify` report): arguments and outputs, less what they share, and temporaries."""
    mem = compiled.memory_analysis()
    return int(
        mem.argument_size_in_bytes
        + mem.output_size_in_bytes
        - mem.alias_size_in_bytes
        + mem.temp_size_in_bytes
    )


def compile_here(plan: Plan) -> int:
    """The plan's train step compiled on the devices present (nothing runs); its bytes per device."""
    from jaxpar.training.trainer import build_trainer, compile_step

    trainer = build_trainer(plan.cfg, plan.sizes)
    return compiled_total(compile_step(trainer, documents=1))


@dataclass
class Candidate:
    plan: Plan
    compiled: int | None = None  # bytes per device, once compiled
    refused: str | None = None  # why it was not taken after compiling


@dataclass
class Choice:
    here: Here
    plans: list[Plan]  # every layout, fastest first
    candidates: list[Candidate]
    chosen: Candidate | None
    skipped: list[str] = field(default_factory=list)  # what was refused before compiling
    note: str | None = None  # a resume's or a restart's word on the layout


def headroom(cfg: Config) -> float:
    return HEADROOM["moe" if cfg.model.moe.num_experts else "dense"]


def candidates(plans: list[Plan], n: int, k: int, axes: dict, settings: dict) -> tuple[list[Plan], list[str]]:
    """The fastest k plans that keep the pins, fit by prediction, stay inside a node where any
    does, and that `validate` accepts; and, of the faster ones, why each kind was passed over."""
    kept = [p for p in plans if _keeps(p, axes, settings)]
    inside = any(p.fits and not p.crosses for p in kept)
    chosen, over, crossing, refused = [], [], [], []
    for p in kept:
        if len(chosen) >= k:
            break
        if not p.fits:
            over.append(p)
        elif inside and p.crosses:
            crossing.append(p)
        elif runnable(p, n):
            chosen.append(p)
        else:
            refused.append(p)
    first = plans.index(chosen[0]) if chosen else len(plans)
    pinned = sum(1 for p in plans[:first] if not _keeps(p, axes, settings))
    return chosen, _skipped(over, crossing, refused, pinned, axes, settings, n)


def _skipped(over, crossing, refused, pinned, axes, settings, n) -> list[str]:
    out = []
    if over:
        fastest = over[0]
        out.append(
            f"{len(over)} faster layout(s) predicted not to fit (the fastest, {layout_text(fastest)}, "
            f"needs {size(fastest.memory['total'])} of {size(fastest._usable)})"
        )
    if crossing:
        out.append(f"{len(crossing)} faster layout(s) put tensor or context across nodes")
    if refused:
        try:
            checks_lib.validate(refused[0].cfg, n)
            reason = "refused"
        except ConfigError as e:
            reason = str(e)
        out.append(
            f"{len(refused)} faster layout(s) refused by the checks "
            f"(e.g. {layout_text(refused[0])}: {reason})"
        )
    if pinned:
        shown = " ".join(
            [f"mesh.{a}={v}" for a, v in axes.items()] + [f"parallel.{k}={v}" for k, v in settings.items()]
        )
        out.append(f"{pinned} faster layout(s) do not keep the pinned {shown}")
    return out


def choose(cfg: Config, where: Here, axes: dict, settings: dict, k: int, compile_fn=compile_here) -> Choice:
    """The planner's fastest k candidates on `where`, compiled in order (`compile_fn`: a plan ->
    its bytes per device); the first whose compiled program fits within the headroom is chosen."""
    check_config(cfg)
    plans = enumerate_plans(cfg, where.count, where.device, where.per_node, where.backend, where.usable)
    chosen, skipped = candidates(plans, where.count, k, axes, settings)
    allowed = headroom(cfg) * where.usable
    choice = Choice(where, plans, [Candidate(p) for p in chosen], None, skipped)
    for c in choice.candidates:
        c.compiled = compile_fn(c.plan)
        if c.compiled > allowed:
            c.refused = (
                f"compiled {size(c.compiled)} per device, over the {size(allowed)} "
                f"allowed ({headroom(cfg):.0%} of {size(where.usable)}); predicted "
                f"{size(c.plan.memory['total'])}, {c.plan.memory['total'] / c.compiled - 1:+.0%}"
            )
        elif choice.chosen is None:
            choice.chosen = c
    return choice


def _lost(c: Candidate, best: Plan) -> str:
    """Why a candidate that fits was not taken: how much slower it is predicted to be."""
    slower = c.plan.time["step_time_s"] / best.time["step_time_s"] - 1
    if abs(slower) < 0.005:
        return "as fast, predicted (within 0.5%): the simpler layout was taken"
    inside = "inside" if 1 + slower < STEP_TIME_BAND**2 else "outside"
    return f"predicted {slower:+.1%} slower ({inside} the two layouts' x{STEP_TIME_BAND} bands)"


def report_lines(choice: Choice, mfu: bool = False, prefix: str = "mesh: auto") -> list[str]:
    """The choice, the runners-up and why each lost, and what was passed over before compiling."""
    where, best = choice.here, choice.chosen.plan if choice.chosen else None
    allowed = headroom(choice.plans[0].cfg) if choice.plans else HEADROOM["dense"]
    compiled = sum(c.compiled is not None for c in choice.candidates)
    lines = [
        f"{prefix}: {where.words}; {len(choice.plans)} layouts considered, "
        f"{sum(p.fits for p in choice.plans)} predicted to fit, "
        + (f"{compiled} compiled here" if compiled else f"the best {len(choice.candidates)} not compiled")
    ]
    if choice.note:
        lines.append(f"{prefix}: {choice.note}")
    for i, c in enumerate(choice.candidates, 1):
        mem = f"predicted {size(c.plan.memory['total'])} of {size(where.usable)} usable"
        if c.compiled is not None:
            mem = f"compiled {size(c.compiled)} of {size(where.usable)} ({mem.split(' of')[0]})"
        if c is choice.chosen:
            lines.append(f"  chosen #{i}: {layout_text(c.plan)}; {time_text(c.plan, mfu)}; {mem}")
            lines.append(f"    why: {explain(c.plan, choice.plans, where.device)}")
        elif c.refused:
            lines.append(f"  refused #{i}: {layout_text(c.plan)}: {c.refused}")
        else:
            lines.append(
                f"  runner-up #{i}: {layout_text(c.plan)}; {time_text(c.plan, mfu)}; {mem}; {_lost(c, best)}"
            )
    lines += [f"  passed over: {s}" for s in choice.skipped]
    if compiled:
        lines.append(f"  headroom: a compiled program may take {allowed:.0%} of the usable memory")
    return lines


def explain_lines(plans: list[Plan], n: int, device: DeviceSpec, per_node: int, top: int) -> list[str]:
    """`python -m jaxpar.plan --explain`: what `mesh: auto` would choose on n GPUs that are not
    here, by prediction alone (nothing compiled), and the time model's uncertainty."""
    from jaxpar.planning.step_time import UNCERTAINTY

    usable = device.usable_bytes
    words = f"{n} x {device.name}, {per_node} per node, {usable / GIB:.1f} GiB usable each"
    chosen, skipped = candidates(plans, n, top, {}, {})
    choice = Choice(
        Here(device, "gpu", n, per_node, usable, words), plans, [Candidate(p) for p in chosen], None, skipped
    )
    choice.chosen = choice.candidates[0] if choice.candidates else None
    return report_lines(choice, mfu=True, prefix="plan") + [f"  uncertainty: {UNCERTAINTY}"]


def to_json(choice: Choice) -> dict:
    """The choice as `layout.json` keeps it."""

    def entry(c: Candidate) -> dict:
        p = c.plan
        return {
            "mesh": dict(p.sizes),
            "parallel": {k: getattr(p.cfg.parallel, k) for k in CHOSEN_SETTINGS},
            "layout": layout_text(p),
            "predicted_memory_per_device": int(p.memory["total"]),
            "compiled_memory_per_device": c.compiled,
            "step_time_s": p.time["step_time_s"],
            "step_time_range_s": list(p.time["step_time_range_s"]),
            "refused": c.refused,
            "chosen": c is choice.chosen,
        }

    return {
        "devices": choice.here.count,
        "device": choice.here.device.key,
        "usable_bytes_per_device": choice.here.usable if math.isfinite(choice.here.usable) else None,
        "headroom": headroom(choice.candidates[0].plan.cfg) if choice.candidates else None,
        "layouts_considered": len(choice.plans),
        "candidates": [entry(c) for c in choice.candidates],
        "passed_over": choice.skipped,
        "note": choice.note,
        "report": report_lines(choice),
    }


def applied(cfg: Config, mesh: dict[str, int], parallel: dict) -> Config:
    """`cfg` with a chosen mesh and parallel settings."""
    from jaxpar.config import MeshConfig

    return dataclasses.replace(
        cfg, mesh=MeshConfig(**mesh), parallel=dataclasses.replace(cfg.parallel, **parallel)
    )


def recorded(run_dir: str) -> dict | None:
    """The layout a run directory's run was planned with (None: none recorded, or unreadable)."""
    try:
        with open(os.path.join(run_dir, LAYOUT_FILE)) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def keeps(cfg: Config, n: int) -> bool:
    """Whether a start keeps the layout its run directory records: a resume (train.resume other
    than never) on the device count it was planned for."""
    previous = recorded(cfg.train.run_dir) if cfg.train.resume != "never" else None
    return bool(previous and previous.get("devices") == n)


def resolve(cfg: Config, settings: dict, auto: list[str], n: int, compile_fn=compile_here):
    """(the config with the planner's layout, the Choice or None where a resume keeps the
    recorded one, the lines to print). A ConfigError where nothing fits."""
    axes, pinned = pins(settings, auto, cfg)
    previous = recorded(cfg.train.run_dir) if cfg.train.resume != "never" else None
    if keeps(cfg, n):
        kept = next(c for c in previous["candidates"] if c["chosen"])
        line = (
            f"mesh: auto: resuming with the layout this run was planned with ({kept['layout']}, {n} devices)"
        )
        return applied(cfg, kept["mesh"], kept["parallel"]), None, [line]
    where = here(cfg, n)
    choice = choose(cfg, where, axes, pinned, cfg.runtime.auto_candidates, compile_fn)
    if previous:
        choice.note = (
            f"this run was planned for {previous.get('devices')} devices and now has {n}: planned again"
        )
    if choice.chosen is None:
        raise ConfigError(_nothing(choice, axes, pinned))
    p = choice.chosen.plan
    cfg = applied(cfg, p.sizes, {k: getattr(p.cfg.parallel, k) for k in CHOSEN_SETTINGS})
    return cfg, choice, report_lines(choice)


def _nothing(choice: Choice, axes: dict, pinned: dict) -> str:
    """The one line of a start where no layout is left."""
    where = choice.here
    if choice.candidates:
        worst = "; ".join(f"#{i}: {c.refused}" for i, c in enumerate(choice.candidates, 1))
        count = len(choice.candidates)
        return f"mesh: auto: none of the {count} compiled candidates fits on {where.words}: {worst}"
    least = min((p.memory["total"] for p in choice.plans), default=None)
    need = (
        ""
        if least is None
        else f"; the smallest layout needs {size(least)} per device of {size(where.usable)}"
    )
    pinned_text = (
        " with the pinned " + ", ".join(f"{a}={v}" for a, v in {**axes, **pinned}.items())
        if axes or pinned
        else ""
    )
    return (
        f"mesh: auto: no layout{pinned_text} fits and runs on {where.words}{need}; "
        "use a smaller train.batch_size, train.seq_len or model, parallel.remat=full, or more memory"
    )


def next_candidate(choice: Choice) -> Candidate | None:
    """The candidate after the chosen one that fit once compiled (for a first step that ran out of memory)."""
    rest = choice.candidates[choice.candidates.index(choice.chosen) + 1 :] if choice.chosen else []
    return next((c for c in rest if c.refused is None), None)
