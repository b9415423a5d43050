"""`python -m jaxpar.plan CONFIG [overrides] --gpus 64xh100 [--gpus-per-node 8] [--top 5]
[--verify K] [--human]`: the whole layout for a model and a cluster, predicted and ranked.

The model, sequence length and global batch come from the config as usual. The planner
enumerates every layout jaxpar can run on that many GPUs -- the six mesh axes, ZeRO stage, remat
policy, pipeline schedule and microbatches, gradient accumulation (`jaxpar.planning.search`) --
keeps the ones `jaxpar.checks.validate` accepts (so every plan printed is runnable), predicts for
each its memory per device (`jaxpar.planning.memory`) and its step time, hence MFU, with a stated
uncertainty (`jaxpar.planning.step_time`), and prints the fastest ones that fit: JSON by default,
a table with `--human`, each with its breakdown, one line of why, and the `python -m
jaxpar.train` command. `tensor` and `context` stay inside a node unless nothing fits that way
(the plan then says so). This module is the command: its arguments, its output and `--verify`.

Exit codes: 0 with plans; 2 for bad input (a config error -- the config is validated on one
device before any layout is tried, `search.check_config` --, an unknown GPU type, a count that
does not divide into nodes); 3 when no layout fits, with how many GPUs would be needed, or when
no layout divides the batch over that many GPUs, with the batch or the GPU count that would
(`search.no_layout`). `--verify K` compiles the top K for the target (`jaxpar.inspect --target`,
no GPU needed), prints predicted against compiled memory, and drops a plan whose compiled
program does not fit.
"""

from __future__ import annotations

import json
import os
import shlex
import sys
from dataclasses import dataclass

from jaxpar import cli
from jaxpar import config as config_lib
from jaxpar.compiled import targets as targets_lib
from jaxpar.compiled.targets import DEVICES, DeviceSpec
from jaxpar.config import MESH_AXES, Config, ConfigError
from jaxpar.planning import auto as auto_lib
from jaxpar.planning.memory import GIB
from jaxpar.planning.params import state_elements
from jaxpar.planning.search import Plan, check_config, enumerate_plans, explain, fastest_runnable, missing
from jaxpar.planning.step_time import STEP_TIME_BAND, UNCERTAINTY
from jaxpar.sharding import is_pipelined

# --- Output ---------------------------------------------------------------------------------------


def command(plan: Plan, path: str | None, overrides: list[str], gpus_per_node: int, n: int) -> str:
    s, p = plan.sizes, plan.cfg.parallel
    keys = {f"mesh.{a}": s[a] for a in MESH_AXES}
    keys.update(
        {
            "parallel.zero_stage": p.zero_stage,
            "parallel.remat": p.remat,
            "parallel.sequence_parallel": str(p.sequence_parallel).lower(),
        }
    )
    if is_pipelined(s):
        keys.update(
            {
                "parallel.pipeline_schedule": p.pipeline_schedule,
                "parallel.microbatches": p.microbatches,
                "parallel.virtual_stages": p.virtual_stages,
            }
        )
    keys["parallel.grad_accum"] = p.grad_accum
    if n > gpus_per_node:
        keys["distributed.auto"] = "true"
    mine = set(keys)
    kept = [o for o in overrides if o.split("=", 1)[0].strip() not in mine]
    args = ([path] if path else []) + kept + [f"{k}={v}" for k, v in keys.items()]
    return "python -m jaxpar.train " + " ".join(shlex.quote(a) for a in args)


def to_json(plan: Plan, why: str, cmd: str) -> dict:
    p, mem = plan.cfg.parallel, plan.memory
    pipelined = is_pipelined(plan.sizes)
    return {
        "mesh": dict(plan.sizes),
        "zero_stage": p.zero_stage,
        "remat": p.remat,
        "sequence_parallel": p.sequence_parallel,
        "microbatches": p.microbatches if pipelined else None,
        "schedule": p.pipeline_schedule if pipelined else None,
        "virtual_stages": p.virtual_stages if pipelined else None,
        "grad_accum": p.grad_accum,
        "attention": plan.kernel,
        "memory_per_device": {
            k: int(mem[k])
            for k in ("params", "gradients", "optimizer", "activations", "loss", "buffers", "total")
        },
        "step_time_s": plan.time["step_time_s"],
        "step_time_range_s": list(plan.time["step_time_range_s"]),
        "mfu": plan.time["mfu"],
        "mfu_range": list(plan.time["mfu_range"]),
        "tokens_per_s_per_gpu": plan.time["tokens_per_s_per_gpu"],
        "time_breakdown_s": {
            "compute": plan.time["compute_s"],
            "host": plan.time["host_s"],
            **{f"comm_{k}": v for k, v in plan.time["comm_s"].items()},
            "exposed_data_fsdp": plan.time["exposed_data_fsdp_s"],
            "optimizer": plan.time["optimizer_s"],
            "bubble_fraction": plan.time["bubble_fraction"],
        },
        "why": why,
        "command": cmd,
    }


def format_human(result: dict) -> str:
    g = result["gpus"]
    lines = [
        f"{result['model']['params'] / 1e9:.2f} B parameters, batch {result['model']['batch_size']} "
        f"x seq {result['model']['seq_len']} on {g['count']} x {g['name']} ({g['per_node']} per "
        f"node); {result['layouts_considered']} layouts considered, {result['layouts_fitting']} fit "
        f"in {g['usable_gib']:.1f} GiB",
        *([result["model"]["lora"]] if result["model"]["lora"] else []),
        "",
    ]
    head = (
        f"{'#':>2} {'pipe':>4} {'data':>4} {'fsdp':>4} {'exp':>4} {'ctx':>4} {'tp':>4} "
        f"{'zero':>4} {'remat':>5} {'sched':>11} {'mb/acc':>6} {'GiB':>6} {'step s':>8} {'MFU':>5} "
        f"{'MFU range':>11}"
    )
    lines.append(head)
    for i, pl in enumerate(result["plans"], 1):
        m = pl["mesh"]
        sched = (
            f"{pl['schedule']}" + (f"x{pl['virtual_stages']}" if pl["schedule"] == "interleaved" else "")
            if pl["schedule"]
            else "-"
        )
        mb = (
            pl["grad_accum"]
            if not pl["schedule"]
            else (f"{pl['microbatches']}" + (f"x{pl['grad_accum']}" if pl["grad_accum"] > 1 else ""))
        )
        lines.append(
            f"{i:>2} {m['pipe']:>4} {m['data']:>4} {m['fsdp']:>4} {m['expert']:>4} "
            f"{m['context']:>4} {m['tensor']:>4} {pl['zero_stage']:>4} {pl['remat']:>5} "
            f"{sched:>11} {mb:>6} {pl['memory_per_device']['total'] / GIB:>6.2f} "
            f"{pl['step_time_s']:>8.3f} {pl['mfu']:>5.1%} "
            f"{pl['mfu_range'][0]:>5.1%}-{pl['mfu_range'][1]:.1%}"
        )
    lines += ["", result["step_time_uncertainty"]]
    for i, pl in enumerate(result["plans"], 1):
        mem = pl["memory_per_device"]
        lines += [
            "",
            f"#{i}: " + pl["why"],
            "    memory GiB: " + ", ".join(f"{k} {v / GIB:.2f}" for k, v in mem.items()),
            "    time s: " + ", ".join(f"{k} {v:.3g}" for k, v in pl["time_breakdown_s"].items() if v),
            "    " + pl["command"],
        ]
        if "compiled_memory_per_device" in pl:
            c = pl["compiled_memory_per_device"]
            lines.append(
                f"    verified: predicted {mem['total'] / GIB:.2f} GiB, compiled "
                f"{c / GIB:.2f} GiB ({mem['total'] / c - 1:+.1%})"
            )
        if "compiled_step_time_s" in pl:
            lines.append(
                f"    the ruler on the compiled program: step {pl['compiled_step_time_s']:.3f} s, "
                f"MFU {pl['compiled_mfu']:.1%} (predicted {pl['step_time_s']:.3f} s)"
            )
    for w in result.get("warnings", []):
        lines.append("warning: " + w)
    return "\n".join(lines)


# --- Command line ---------------------------------------------------------------------------------


USAGE = (
    """usage: python -m jaxpar.plan [CONFIG.yaml] [dotted.key=value ...] --gpus NxTYPE
                              [--gpus-per-node 8] [--top 5] [--verify K] [--human] [--explain]
  --gpus 64xh100      how many GPUs of which type (known: """
    + ", ".join(DEVICES)
    + """)
  --gpus-per-node 8   GPUs sharing NVLink in one node (default 8)
  --top 5             how many plans to print
  --verify K          compile the top K for the target without a GPU (gpu-compile extra) and
                      show predicted against compiled memory; drop a plan that does not fit
  --human             a table instead of JSON
  --explain           the choice `mesh: auto` would make there, the runners-up (the top 3, or
                      --top) and why each lost, what was passed over, and the uncertainty
exit codes: 0 plans printed, 2 bad input, 3 no layout fits"""
)


@dataclass
class Args:
    path: str | None
    overrides: list[str]
    count: int
    device: DeviceSpec
    per_node: int
    top: int
    verify: int
    human: bool
    explain: bool = False


def parse_gpus(text: str) -> tuple[int, DeviceSpec]:
    count, sep, kind = text.lower().partition("x")
    if sep and count.strip().isdigit() and int(count) < 1:
        raise ConfigError(
            f"--gpus {text!r}: the count must be at least 1, e.g. --gpus 8x{kind.strip() or 'h100'}"
        )
    if not sep or not count.strip().isdigit():
        raise ConfigError(
            f"--gpus {text!r}: write the count and the type, e.g. --gpus 64xh100 "
            f"(known types: {', '.join(DEVICES)})"
        )
    if kind.strip() not in DEVICES:
        raise ConfigError(f"--gpus {text!r}: unknown GPU type {kind.strip()!r}; known: {', '.join(DEVICES)}")
    return int(count), DEVICES[kind.strip()]


def parse_args(argv: list[str]) -> Args:
    flags = {"--gpus": None, "--gpus-per-node": "8", "--top": None, "--verify": "0"}
    human, explain, rest = False, False, []
    it = iter(argv)
    for arg in it:
        name, eq, value = arg.partition("=")
        if name in flags:
            value = value if eq else next(it, None)
            if value is None or value.startswith("--"):
                raise ConfigError(f"{name} needs a value (see --help)")
            flags[name] = value
        elif arg == "--human":
            human = True
        elif arg == "--explain":
            explain = True
        elif arg.startswith("--"):
            raise ConfigError(
                f"unknown flag {arg!r}; known: --gpus, --gpus-per-node, --top, --verify, --human, --explain"
            )
        else:
            rest.append(arg)
    if flags["--gpus"] is None:
        raise ConfigError(f"--gpus is required, e.g. --gpus 64xh100 (known types: {', '.join(DEVICES)})")
    count, device = parse_gpus(flags["--gpus"])
    numbers = {}
    flags["--top"] = flags["--top"] or ("3" if explain else "5")
    for name, least in (("--gpus-per-node", 1), ("--top", 1), ("--verify", 0)):
        value = flags[name]
        if not value.isdigit() or int(value) < least:
            raise ConfigError(f"{name} {value!r}: give a whole number >= {least}")
        numbers[name] = int(value)
    per_node = numbers["--gpus-per-node"]
    if count > per_node and count % per_node:
        raise ConfigError(
            f"--gpus {count} does not divide into nodes of {per_node} GPUs "
            f"(--gpus-per-node); use a multiple of {per_node}, e.g. "
            f"{count - count % per_node} or {count + per_node - count % per_node}"
        )
    path, overrides = config_lib.parse_cli(rest)
    return Args(
        path,
        overrides,
        count,
        device,
        min(per_node, count),
        numbers["--top"],
        numbers["--verify"],
        human,
        explain,
    )


def lora_note(cfg: Config, adapters: int) -> str | None:
    """What the plans assume of finetune.lora, in one line (None without adapters)."""
    lora = cfg.finetune.lora
    if lora.rank <= 0:
        return None
    return (
        f"finetune.lora rank {lora.rank} on {', '.join(lora.targets)}: {adapters / 1e6:.2f} M adapter "
        "parameters train, the model's are frozen; gradients, optimizer state, their reduction "
        "and the update are the adapters' alone, and the frozen weights' gradient matmuls are "
        "not computed"
    )


def plan_main(args: Args) -> tuple[dict, int]:
    cfg = config_lib.load_config(args.path, args.overrides)
    check_config(cfg)
    n, device = args.count, args.device
    plans = enumerate_plans(cfg, n, device, args.per_node)
    fitting = [p for p in plans if p.fits]
    # Layouts keeping tensor and context inside a node first; the others when none of those runs.
    chosen = fastest_runnable([p for p in fitting if not p.crosses], n, args.top)
    chosen = chosen or fastest_runnable(fitting, n, args.top)
    whole = state_elements(cfg.model, {a: 1 for a in MESH_AXES}, 0, cfg.finetune.lora)
    result = {
        "gpus": {
            "count": n,
            "type": device.key,
            "name": device.name,
            "per_node": args.per_node,
            "memory_bytes": device.memory_bytes,
            "usable_gib": device.usable_bytes / GIB,
        },
        "model": {
            "params": whole["total"],
            "trained_params": whole["adapters"] or whole["total"],
            "lora": lora_note(cfg, whole["adapters"]),
            "batch_size": cfg.train.batch_size,
            "seq_len": cfg.train.seq_len,
        },
        "step_time_band": STEP_TIME_BAND,
        "step_time_uncertainty": UNCERTAINTY,
        "layouts_considered": len(plans),
        "layouts_fitting": sum(p.fits for p in plans),
        "plans": [],
        "warnings": [],
    }
    if not chosen:
        result["error"] = missing(cfg, n, device, args.per_node, plans)
        return result, 3
    if args.explain:
        result["explain"] = auto_lib.explain_lines(plans, n, device, args.per_node, args.top)
    for p in chosen:
        result["plans"].append(
            to_json(p, explain(p, plans, device), command(p, args.path, args.overrides, args.per_node, n))
        )
    if args.verify:
        verify(result, chosen, args, device)
        if not result["plans"]:
            result["error"] = "none of the verified plans fits once compiled"
            return result, 3
    return result, 0


def _ruler_time(entry: dict, text: str, device: DeviceSpec, count: int) -> None:
    """The ruler's step time and MFU for the compiled program (optimized HLO `text`), beside the
    planner's own, where the ruler has rates for the device (`jaxpar.compiled.ruler.RATES`)."""
    from jaxpar.compiled import ruler

    if device.key not in ruler.RATES:
        return
    flops = entry["mfu"] * entry["step_time_s"] * count * device.bf16_flops  # the model's, per step
    costs = ruler.summary(text, ruler.RATES[device.key], flops, count)
    entry["compiled_step_time_s"], entry["compiled_mfu"] = costs["step_seconds"], costs["mfu"]


def verify(result: dict, chosen: list[Plan], args: Args, device: DeviceSpec) -> None:
    """Compiles the top `args.verify` plans for the target; adds the compiled total to each and
    drops (with a warning) those whose compiled program does not fit."""
    target = targets_lib.resolve(f"{device.key}:{args.count}")
    targets_lib.use_cpu_backend()
    from jaxpar.training.trainer import build_trainer, compile_step

    kept = []
    for entry, plan in zip(result["plans"], chosen):
        if len(kept) >= args.verify and "compiled_memory_per_device" not in entry:
            kept.append(entry)
            continue
        trainer = build_trainer(plan.cfg, plan.sizes, devices=targets_lib.devices(target))
        compiled = compile_step(trainer, documents=1)  # what the loop runs on one-document rows
        _ruler_time(entry, compiled.as_text(), device, args.count)
        total = auto_lib.compiled_total(compiled)
        entry["compiled_memory_per_device"] = total
        entry["predicted_over_compiled"] = entry["memory_per_device"]["total"] / total
        if total > target.usable_bytes:
            result["warnings"].append(
                f"dropped {entry['command']}: compiled {total / GIB:.2f} GiB per GPU, over the "
                f"{target.usable_bytes / GIB:.2f} GiB usable (predicted "
                f"{entry['memory_per_device']['total'] / GIB:.2f})"
            )
            continue
        kept.append(entry)
    result["plans"] = kept


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if {"-h", "--help"} & set(argv):
        print(USAGE)
        return 0
    return cli.run(lambda: _plan(argv), prefix="plan error")


def _plan(argv: list[str]) -> int:
    """The command's work: the ranked plans printed; exit 3 when none fits."""
    args = parse_args(argv)
    result, code = plan_main(args)
    try:
        shown = "\n".join(result["explain"]) if "explain" in result else None
        shown = shown or (format_human(result) if args.human else json.dumps(result, indent=2))
        print(shown, flush=True)
    except BrokenPipeError:  # `plan ... | head`: the reader has what it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    if code == 3:
        print(f"plan error: {result['error']}", file=sys.stderr)
    return code
