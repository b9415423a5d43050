"""The planner's search: every layout of a model jaxpar can run on n GPUs -- the six mesh
axes (sizes that divide heads, KV heads, d_ff, vocabulary, layers, batch, sequence, experts),
ZeRO stage, remat policy, pipeline schedule and microbatches, gradient accumulation --, each
predicted by the memory model (`jaxpar.planning.memory`) and the step-time model
(`jaxpar.planning.step_time`) and ranked fastest first, the simpler layout on a tie
(`enumerate_plans`); whether `jaxpar.checks.validate` accepts a plan (`runnable`); one line of
why for a plan (`explain`); and, when no layout fits or none divides the batch, what would
(`missing`, `no_layout`). Each axis takes only divisors of what it splits (`_meshes`), so the
enumeration grows with the model's divisors, not with the GPU count: a million GPUs is answered
in about as long as eight."""

from __future__ import annotations

import dataclasses
import itertools
import math
from dataclasses import dataclass

from jaxpar import checks as checks_lib
from jaxpar import config as config_lib
from jaxpar.compiled.targets import DeviceSpec
from jaxpar.config import MESH_AXES, Config, ConfigError, ModelConfig
from jaxpar.models.moe import dense_prefix
from jaxpar.planning.memory import GIB, attention_kernel, predict_memory
from jaxpar.planning.step_time import crosses_nodes, predict_time
from jaxpar.sharding import is_pipelined, is_ring


def _divisors(n: int) -> list[int]:
    """The divisors of n, ascending, in O(sqrt(n)) steps."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return small + [n // d for d in reversed(small) if d * d != n]


@dataclass
class Plan:
    cfg: Config
    sizes: dict[str, int]
    memory: dict[str, float]
    time: dict[str, float]
    kernel: str
    crosses: list[str]  # tensor / context axes that leave the node

    @property
    def fits(self) -> bool:
        return self.memory["total"] <= self._usable

    _usable: float = 0.0


def _meshes(m: ModelConfig, t, n: int):
    """Mesh sizes whose axes divide what they split (the cheap part of `validate`'s rules), in
    the order of their axes' sizes (pipe first, each ascending). Each axis takes only divisors of
    what it splits and of the devices left, so the work follows the model's divisors, not n: a
    count that no layout divides is answered at once, however large."""
    heads = math.gcd(m.n_heads, m.n_kv_heads, m.d_ff, m.vocab_size)  # what tensor splits
    piped = m.n_layers - dense_prefix(m)  # the layers a pipeline splits (the dense prefix runs before it)
    piped = 1 if m.irregular_moe() else piped  # dense layers between MoE ones: one stage (`checks`)
    for pipe in _divisors(math.gcd(n, piped)):
        for data in _divisors(math.gcd(n // pipe, t.batch_size)):
            left = n // (pipe * data)
            for fsdp in _divisors(math.gcd(left, t.batch_size // data)):
                if fsdp > 1 and m.d_model % fsdp:
                    continue
                rows = t.batch_size // (data * fsdp)
                for expert in _divisors(math.gcd(left // fsdp, rows, m.moe.num_experts or 1)):
                    rest = left // (fsdp * expert)
                    for context in _divisors(math.gcd(rest, max(t.seq_len // 2, 1))):
                        tensor = rest // context
                        if heads % tensor == 0 and (context == 1 or t.seq_len % (2 * context) == 0):
                            yield dict(zip(MESH_AXES, (pipe, data, fsdp, expert, context, tensor)))


def _settings(cfg: Config, sizes: dict[str, int]):
    """ParallelConfig variants for a mesh: ZeRO stage, remat, pipeline schedule and
    microbatches or grad accumulation."""
    t, m = cfg.train, cfg.model
    dp = sizes["data"] * sizes["fsdp"] * sizes["expert"]
    per_replica = t.batch_size // dp
    stages = [0] if sizes["fsdp"] == 1 else [1, 2, 3]
    sp = sizes["tensor"] > 1 and t.seq_len % (sizes["tensor"] * sizes["context"]) == 0
    for zero, remat in itertools.product(stages, ("none", "dots", "full")):
        base = dict(zero_stage=zero, remat=remat, sequence_parallel=sp)
        p = sizes["pipe"]
        if not is_pipelined(sizes):
            for accum in (1, 2, 4, 8, 16):
                if per_replica % accum == 0:
                    yield dict(base, grad_accum=accum)
            continue
        # Every schedule, with grad accumulation over whole pipelined passes (each pass takes
        # batch / grad_accum rows in `microbatches` microbatches).
        for mult, accum in itertools.product((1, 2, 4, 8), (1, 2, 4, 8, 16)):
            mb = p * mult
            if per_replica % (mb * accum):
                continue
            pipelined = dict(base, microbatches=mb, grad_accum=accum)
            for kind in ("1f1b", "gpipe", "zb"):
                yield dict(pipelined, pipeline_schedule=kind)
            if (m.n_layers - dense_prefix(m)) % (2 * p) == 0:
                yield dict(pipelined, pipeline_schedule="interleaved", virtual_stages=2)


def _with(cfg: Config, sizes: dict[str, int], settings: dict) -> Config:
    parallel = dataclasses.replace(
        cfg.parallel,
        **{"pipeline_schedule": "1f1b", "microbatches": 4, "virtual_stages": 1, "grad_accum": 1, **settings},
    )
    return dataclasses.replace(cfg, mesh=config_lib.MeshConfig(**sizes), parallel=parallel)


def enumerate_plans(
    cfg: Config, n: int, device: DeviceSpec, gpus_per_node: int, backend: str = "gpu", usable=None
) -> list[Plan]:
    """Every layout of `cfg`'s model on n GPUs, predicted (fitting or not), fastest first.
    `backend`: the compiler whose layout of the program memory predicts ("cpu": XLA:CPU, whose
    devices the attention kernel is chosen for too); `usable`: bytes a program may take per
    device (default the device's usable share)."""
    usable = device.usable_bytes if usable is None else usable
    plans = []
    for sizes in _meshes(cfg.model, cfg.train, n):
        crosses = [a for a in ("tensor", "context") if crosses_nodes(sizes, (a,), gpus_per_node)]
        for settings in _settings(cfg, sizes):
            c = _with(cfg, sizes, settings)
            kernel = attention_kernel(c, sizes, None if backend == "cpu" else device)
            plan = Plan(
                c,
                sizes,
                predict_memory(c, sizes, kernel, backend, None if backend == "cpu" else usable),
                predict_time(c, sizes, device, gpus_per_node, kernel=kernel),
                kernel,
                crosses,
            )
            plan._usable = usable
            plans.append(plan)
    plans.sort(key=_rank)
    return plans


def _rank(plan: Plan) -> tuple[int, int]:
    """Fastest first; step times within 0.5% of each other count as equal, and then the
    simpler layout wins (fewer axes beyond data, a lower ZeRO stage, less remat, fewer
    microsteps): the same speed is not worth more machinery."""
    p, s = plan.cfg.parallel, plan.sizes
    complexity = (
        sum(s[a] > 1 for a in MESH_AXES if a != "data")
        + p.zero_stage
        + ("none", "dots", "full").index(p.remat)
        + p.grad_accum.bit_length()
        + (p.microbatches.bit_length() if is_pipelined(s) else 0)
    )
    return round(math.log(plan.time["step_time_s"]) / math.log(1.005)), complexity


def runnable(plan: Plan, n: int) -> bool:
    """Whether `jaxpar.checks.validate` accepts the plan's config (every rule, not only the
    divisibility the enumeration checks)."""
    try:
        checks_lib.validate(plan.cfg, n)
    except ConfigError:
        return False
    return True


def check_config(cfg: Config) -> None:
    """The config's own errors, as `jaxpar.checks.validate` finds them on one device (the
    model's shape and counts, LoRA, the data, the tokenizer), as a ConfigError before any layout
    is tried: otherwise every layout would be refused for it, and the planner would answer that
    none fits. The layout (mesh, ZeRO stage, remat, pipeline, accumulation) is the planner's to
    choose and is left out."""
    ones = {a: 1 for a in MESH_AXES}
    checks_lib.validate(_with(cfg, ones, {"zero_stage": 0}), 1)


def fastest_runnable(plans: list[Plan], n: int, top: int) -> list[Plan]:
    """The first `top` of `plans` that `jaxpar.checks.validate` accepts on n GPUs."""
    chosen = []
    for p in plans:
        if len(chosen) >= top:
            break
        if runnable(p, n):
            chosen.append(p)
    return chosen


# --- Explaining a plan ----------------------------------------------------------------------------


def _feature_tests(plan: Plan) -> list[tuple[str, callable, str]]:
    """(what this plan uses, a test for plans without it, how to say it)."""
    s, p = plan.sizes, plan.cfg.parallel
    out = []
    if s["tensor"] > 1:
        where = "across nodes" if "tensor" in plan.crosses else "inside the node"
        out.append((f"tensor={s['tensor']} {where}", lambda q: q.sizes["tensor"] == 1, "tensor parallelism"))
    if is_pipelined(s):
        out.append(
            (
                f"pipe={s['pipe']} ({p.pipeline_schedule}, {p.microbatches} microbatches)",
                lambda q: not is_pipelined(q.sizes),
                "pipelining",
            )
        )
    if is_ring(s):
        out.append((f"context={s['context']}", lambda q: not is_ring(q.sizes), "context parallelism"))
    if s["fsdp"] > 1:
        stage = p.zero_stage
        out.append(
            (
                f"ZeRO-{stage} over fsdp={s['fsdp']}",
                lambda q, st=stage: q.cfg.parallel.zero_stage < st or q.sizes["fsdp"] == 1,
                "a lower ZeRO stage" if stage > 1 else "ZeRO",
            )
        )
    if p.remat != "none":
        out.append((f"remat {p.remat}", lambda q: q.cfg.parallel.remat == "none", "remat"))
    if p.grad_accum > 1:
        out.append(
            (f"grad_accum={p.grad_accum}", lambda q: q.cfg.parallel.grad_accum == 1, "gradient accumulation")
        )
    return out


def explain(plan: Plan, plans: list[Plan], device: DeviceSpec) -> str:
    """One line: for each thing this plan uses, whether anything without it fits, and if so how
    much slower the best such plan is."""
    usable = plan._usable / GIB
    parts = []
    for label, without, name in _feature_tests(plan):
        rivals = [q for q in plans if without(q)]
        fitting = [q for q in rivals if q.fits]
        if not fitting:
            least = min((q.memory["total"] for q in rivals), default=None)
            need = "" if least is None else f" (the smallest needs {least / GIB:.1f} GiB of {usable:.1f})"
            parts.append(f"{label}: no layout without {name} fits{need}")
        else:
            best = fitting[0]
            slower = best.time["step_time_s"] / plan.time["step_time_s"] - 1
            saved = (best.memory["total"] - plan.memory["total"]) / GIB
            if slower > 0.005:
                parts.append(f"{label}: {slower:.1%} faster than the best layout without {name}")
            elif saved > 0:
                parts.append(f"{label}: as fast as without {name}, {saved:.1f} GiB less per GPU")
            else:
                parts.append(f"{label}: as fast as without {name}")
    if not parts:
        state = "its LoRA adapters' gradients" if plan.cfg.finetune.lora.rank > 0 else "its gradients"
        parts.append(
            f"plain data parallelism: the model, {state} and Adam state fit on "
            f"each GPU ({plan.memory['total'] / GIB:.1f} of {usable:.1f} GiB)"
        )
    if plan.crosses:
        parts.append(f"{' and '.join(plan.crosses)} cross nodes: no layout keeping them inside a node fits")
    return "; ".join(parts)


# --- When no layout fits --------------------------------------------------------------------------


def layer_splits(cfg: Config) -> set[int]:
    """The tensor x context sizes the enumeration gives a model (`_meshes`): the axes that split
    each layer's work. Every other axis (data, fsdp, expert, and pipe, whose microbatches are
    rows too) takes whole rows of the global batch."""
    m, t = cfg.model, cfg.train
    heads = math.gcd(m.n_heads, m.n_kv_heads, m.d_ff, m.vocab_size)
    contexts = [c for c in _divisors(max(t.seq_len // 2, 1)) if c == 1 or t.seq_len % (2 * c) == 0]
    return {tensor * context for tensor in _divisors(heads) for context in contexts}


def no_layout(cfg: Config, n: int, device: DeviceSpec, per_node: int) -> str:
    """Why no layout divides n GPUs, with what would: a batch of more rows, or fewer GPUs."""
    batch = cfg.train.batch_size
    splits = layer_splits(cfg)
    split = max(s for s in splits if n % s == 0)
    rows = n // split
    counts = {r * s for r in _divisors(batch) for s in splits}
    fewer = max(c for c in counts if c <= n and (c <= per_node or c % per_node == 0))
    bigger = rows * -(-batch // rows)  # the next multiple of rows
    return (
        f"no layout of {n} x {device.key} divides this model and batch: a layer splits over at most "
        f"{split} of the {n} GPUs (tensor x context, as the heads and train.seq_len="
        f"{cfg.train.seq_len} allow), so the batch must split {rows} ways into whole rows, and "
        f"train.batch_size={batch} does not divide by {rows}; raise train.batch_size to a multiple "
        f"of {rows}" + (f" (e.g. {bigger})" if bigger != rows else "") + f", or use fewer GPUs: "
        f"{fewer} is the most up to {n} that it divides over (--gpus {fewer}x{device.key})"
    )


def missing(cfg: Config, n: int, device: DeviceSpec, per_node: int, plans: list[Plan]) -> str:
    """What a model that fits nowhere lacks: a batch that divides over n GPUs (`no_layout`), a
    setting every layout that fits breaks, or memory: the smallest need now, and how many GPUs
    of this type the planner would need (up to 64 times as many)."""
    if not plans:
        return no_layout(cfg, n, device, per_node)
    if fitting := [p for p in plans if p.fits]:  # they fit, but `validate` refuses each of them
        try:
            checks_lib.validate(fitting[0].cfg, n)
        except ConfigError as e:
            return f"no layout of {n} x {device.key} that fits is runnable; the fastest is refused: {e}"
    least = min(p.memory["total"] for p in plans)
    usable = device.usable_bytes / GIB
    now = (
        f"no layout of {n} x {device.key} fits: the smallest needs "
        f"{least / GIB:.1f} GiB per GPU, {usable:.1f} GiB usable of {device.memory_bytes / 1e9:.0f} GB"
    )
    divided = False  # whether any larger count has a layout at all
    for more in (2, 4, 8, 16, 32, 64):
        bigger = n * more
        if bigger > per_node and bigger % per_node:
            continue
        larger = enumerate_plans(cfg, bigger, device, per_node)
        divided = divided or bool(larger)
        if any(runnable(p, bigger) for p in [p for p in larger if p.fits][:50]):
            return f"{now}; needs >= {bigger} GPUs of {device.memory_bytes / 1e9:.0f} GB"
    if not divided:
        return (
            f"{now}; and no layout of 2 to 64 times as many GPUs divides train.batch_size="
            f"{cfg.train.batch_size}: shrink the model or shorten train.seq_len, or raise the batch "
            "(more rows for more GPUs to share) and plan for more GPUs"
        )
    return (
        f"{now}; even {64 * n} GPUs do not make it fit at train.batch_size="
        f"{cfg.train.batch_size}: lower the batch or the sequence length, or shrink the model"
    )
