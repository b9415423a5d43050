"""`python -m jaxpar.inspect [CONFIG] [overrides] [--compare] [--human] [--schedule]`: compile, never run.

`--schedule` prints the pipeline schedule instead, without compiling anything: one JSON object
(`pipeline.describe_schedule`) with `bubble`, the idle fraction of the lowered table the runtime
executes with a forward costing 1 and a backward 2 (zero-bubble: B 1, W 1), the published
`textbook_bubble`, the `control_flow` the step runs it with (zero-bubble is "stage-dependent",
ZB-H1, where the mesh leaves a stage's chunk collective-free, else "uniform"; see
`pipeline.schedule_for_mesh`), the time, ticks, buffer slots and the cost-weighted `timeline`;
with `--human`, the timeline alone (one column per unit of time, '|' at each tick's exchange).

Compiles the train step for the configured mesh and prints one JSON object: the mesh, the
parameter count, the bytes each device holds (parameters, optimizer state and gradients from
their shardings; temporaries and the total from XLA's memory analysis of the compiled program),
the FLOPs XLA counts, and the collectives in the compiled HLO (see `jaxpar.compiled.hlo`).

`--compare` puts the ZeRO formula's prediction for jaxpar's own dtypes next to what XLA's
memory analysis of the compiled step measures (the state's argument bytes; gradients live among
the temporaries): float32 parameters (4 bytes), float32 gradients (4) and Adam's two float32
moments (8; 0 for optimizer.name=sgd), over N = mesh.fsdp devices and divided by mesh.tensor
(Rajbhandari et al. 2020):

    stage 0: 4Ψ + 4Ψ + 8Ψ        stage 2: 4Ψ + 4Ψ/N + 8Ψ/N
    stage 1: 4Ψ + 4Ψ + 8Ψ/N      stage 3: 4Ψ/N + 4Ψ/N + 8Ψ/N

It also shows the paper's mixed-precision formula (2 + 2 + K with K = 12) for reference.

`--target h100[:N]` compiles the same step for N GPUs of that type on a machine with none
(`jaxpar.compiled.targets`; needs the `gpu-compile` extra) and adds what that program holds: `kernels`
(the library calls it makes, e.g. cuDNN attention), the element types each collective moves,
and `fits`: whether the compiled total stays within `targets.USABLE_FRACTION` of the device's
memory. A config that does not fit exits with code 3.

`--kernels` (with `--target h100`) prints instead the ruler's reading of that program
(`jaxpar.compiled.ruler`): every kernel launch per step, grouped by kind and the Python line that made it,
with its FLOPs, bytes, bound and estimated time, slowest first; the estimated step time, the
launches per step, and the MFU that step time gives (`model_flops_per_step` over the time, the
target's peak and its devices).

`--documents K`: the data's rows hold K documents (the most of any row of a batch). Where cuDNN's
packed attention runs, the training loop runs each batch with the step compiled for the slot
bucket of its fullest row (`jaxpar.training.trainer.Trainer.step_for`); this compiles that step, and the
ruler costs its empty slots for rows of K documents. Default with `--kernels`: 1 (random tokens,
what the measured benchmark steps held); without it, `Trainer.step`, which describes
model.max_documents_per_row slots (the largest program, whose memory a run may reach).
"""

from __future__ import annotations

import json
import sys

import jax
import numpy as np

from jaxpar import cli
from jaxpar import mesh as mesh_lib
from jaxpar.compiled import hlo, ruler
from jaxpar.compiled import targets as targets_lib
from jaxpar.config import ConfigError
from jaxpar.parallel import schedule as pipeline_lib
from jaxpar.run.startup import load_and_validate
from jaxpar.sharding import shard_bytes, zero_state_bytes
from jaxpar.training import metrics as metrics_lib
from jaxpar.training.trainer import Trainer, build_trainer, compile_step

FLOPS_NOTE = (
    "model_flops_per_step: (6N + 12LdT) per token x the step's tokens, all devices "
    "together (what MFU counts); xla_flops_per_step: XLA's cost analysis of the "
    "compiled program, per device x devices. XLA counts a while loop's body once, not "
    "per iteration, so the layer scan and the loss chunks make it fall short of the "
    "step's work: do not read it as the step's FLOPs."
)


def _cost(compiled) -> float | None:
    """XLA's FLOP count of the compiled program; None where the backend gives none (GPU
    programs compiled without a GPU)."""
    cost = compiled.cost_analysis()
    return None if not cost or "flops" not in cost else float(cost["flops"])


def zero_formula(
    params: int, stage: int, fsdp: int, tensor: int, optimizer_bytes: int = 8
) -> dict[str, float]:
    """Bytes per device that the ZeRO paper's accounting (`sharding.zero_state_bytes`) predicts
    for jaxpar's dtypes: float32 parameters and gradients, `optimizer_bytes` of state per
    parameter (8: Adam's two float32 moments; 0: plain SGD), over `fsdp` and divided by
    `tensor`; and the paper's own mixed-precision total (2 + 2 + K, K = 12) for reference."""
    own = zero_state_bytes(params, fsdp, stage, optimizer_bytes=optimizer_bytes)
    mixed = zero_state_bytes(params, fsdp, stage, param_bytes=2, grad_bytes=2, optimizer_bytes=12)
    return {
        **{kind: own[kind] / tensor for kind in ("params", "gradients", "optimizer", "total")},
        "paper_mixed_precision_total": mixed["total"] / tensor,
    }


def batch_bytes_per_device(trainer: Trainer) -> int:
    """Bytes of one device's share of the batch (the step's other argument besides the state)."""
    shapes = trainer.batch_shape()
    return int(
        sum(np.prod(s.sharding.shard_shape(s.shape)) * np.dtype(s.dtype).itemsize for s in shapes.values())
    )


def _trained(trainer: Trainer, params_tree):
    """The part of a params-shaped tree that trains (`Trainer.trainable`): all, or the adapters."""
    return params_tree if trainer.trainable is None else trainer.trainable.split(params_tree)[0]


def report(
    trainer: Trainer, compiled, compare: bool = False, target: targets_lib.Target | None = None
) -> dict:
    """The inspect JSON for a trainer and its compiled step."""
    cfg = trainer.cfg
    shapes, shardings = trainer.state_shape, trainer.state_shardings
    sizes = dict(trainer.mesh.shape)
    params = int(sum(np.prod(x.shape) for x in jax.tree.leaves(shapes["params"])))
    mem = compiled.memory_analysis()
    memory = {
        "params": shard_bytes(shapes["params"], shardings["params"]),
        "optimizer": shard_bytes(shapes["opt_state"], shardings["opt_state"]),
        # of what trains: every param, or with finetune.lora the adapters alone
        "gradients": shard_bytes(_trained(trainer, shapes["params"]), trainer.grad_shardings),
        "temp": int(mem.temp_size_in_bytes),
        "total": int(
            mem.argument_size_in_bytes
            + mem.output_size_in_bytes
            - mem.alias_size_in_bytes
            + mem.temp_size_in_bytes
        ),
        "arguments": int(mem.argument_size_in_bytes),
    }
    trained = _trained(trainer, shapes["params"])
    if trainer.trainable is not None:  # LoRA: the adapters' share of "params"
        memory["adapters"] = shard_bytes(trained, _trained(trainer, shardings["params"]))
    flops_device = _cost(compiled)
    devices = trainer.mesh.devices.size
    out = {
        "devices": int(devices),
        "mesh": sizes,
        "zero_stage": cfg.parallel.zero_stage,
        "params": params,
        # what the step updates: every param, or with finetune.lora the adapters
        "trainable_params": int(sum(np.prod(x.shape) for x in jax.tree.leaves(trained))),
        "memory_per_device": memory,
        # Both for the whole step, all devices together; see FLOPS_NOTE.
        "model_flops_per_step": metrics_lib.flops_per_token(cfg.model, cfg.train.seq_len)
        * cfg.train.batch_size
        * cfg.train.seq_len,
        "xla_flops_per_step": None if flops_device is None else flops_device * devices,
        "xla_flops_per_device": flops_device,
        "flops_note": FLOPS_NOTE,
        "collectives": hlo.collectives(text := compiled.as_text()),
        "kernels": hlo.kernels(text),
    }
    if target is not None:
        out["target"] = {
            "name": target.name,
            "device": target.description,
            "count": target.count,
            "device_memory": target.memory_bytes,
            "usable_memory": target.usable_bytes,
            "usable_fraction": targets_lib.USABLE_FRACTION,
        }
        out["fits"] = memory["total"] <= target.usable_bytes
    if compare:
        # Measured by XLA, not from the shardings jaxpar declares (which agree by construction):
        # the compiled step's arguments are the train state and the batch, so the state's bytes
        # are XLA's argument bytes less the batch's (and the three int32 step counters).
        optimizer_bytes = 8 if cfg.optimizer.name == "adamw" else 0
        predicted = zero_formula(
            params, cfg.parallel.zero_stage, sizes["fsdp"], sizes["tensor"], optimizer_bytes
        )
        state = int(mem.argument_size_in_bytes) - batch_bytes_per_device(trainer) - 3 * 4
        out["compare"] = {
            "predicted": predicted,
            "measured": {"params_and_optimizer": state, "temp": memory["temp"]},
            "ratio": state / (predicted["params"] + predicted["optimizer"]),
        }
    return out


def format_human(r: dict) -> str:
    mb = 1 / 2**20
    mesh = " ".join(f"{a}={s}" for a, s in r["mesh"].items())
    lines = [f"devices {r['devices']}  mesh {mesh}  zero_stage {r['zero_stage']}  params {r['params']:,}"]
    if r["trainable_params"] != r["params"]:
        lines[0] += f" (trainable {r['trainable_params']:,})"
    if "target" in r:
        t = r["target"]
        lines.append(f"compiled for {t['count']} x {t['device']} (nothing ran)")
    lines += ["", "memory per device (MiB)"]
    for key, value in r["memory_per_device"].items():
        lines.append(f"  {key:<10} {value * mb:>12.3f}")
    if "target" in r:
        t = r["target"]
        verdict = "fits" if r["fits"] else "DOES NOT FIT"
        lines.append(
            f"  {verdict}: total {r['memory_per_device']['total'] / 2**30:.2f} GiB of "
            f"{t['usable_memory'] / 2**30:.2f} GiB usable ({t['usable_fraction']:.0%} of "
            f"{t['device_memory'] / 2**30:.2f} GiB)"
        )
    if "compare" in r:
        lines.append("")
        lines.append("ZeRO formula for jaxpar's dtypes (MiB)   predicted")
        for key, value in r["compare"]["predicted"].items():
            lines.append(f"  {key:<28} {value * mb:>12.3f}")
        measured = r["compare"]["measured"]["params_and_optimizer"]
        lines.append(
            f"  XLA's state arguments (params+optimizer) {measured * mb:>8.3f}"
            f"  (ratio to params+optimizer {r['compare']['ratio']:.3f})"
        )
    lines += ["", f"{'collective':<20} {'count':>8} {'MiB':>12}  dtypes"]
    for kind, c in sorted(r["collectives"].items()):
        note = f"  ({c['as_all_reduce']} as all-reduce + dynamic-slice)" if "as_all_reduce" in c else ""
        lines.append(f"{kind:<20} {c['count']:>8} {c['bytes'] * mb:>12.3f}  {','.join(c['dtypes'])}{note}")
    if r["kernels"]:
        lines += ["", f"{'kernel (custom call)':<40} {'count':>8}"]
        lines += [f"{name:<40} {count:>8}" for name, count in r["kernels"].items()]
    xla, per_device = r["xla_flops_per_step"], r["xla_flops_per_device"]
    lines += [
        "",
        f"FLOPs per step, all {r['devices']} device(s) together",
        f"  model (6N + 12LdT) x tokens   {r['model_flops_per_step']:.3e}",
        f"  XLA cost analysis             {xla:.3e} ({per_device:.3e} per device; a while "
        "loop's body counted once, not per iteration: not the step's work)"
        if xla
        else "  XLA cost analysis             n/a (none for this backend)",
    ]
    return "\n".join(lines)


def kernels_report(
    result: dict, text: str, target: targets_lib.Target, documents: int = 1, slots: int | None = None
) -> dict:
    """The ruler's estimate for compiled HLO `text` of the step `result` (`report`) describes,
    on rows of `documents` documents (compiled for `slots` document slots; None: the step does
    not depend on them): per-kernel rows, step time, launches, MFU; with the target and whether
    the step fits."""
    rates = ruler.RATES[target.name]
    costs = ruler.summary(text, rates, result["model_flops_per_step"], target.count, documents)
    return {
        "target": result["target"],
        "fits": result["fits"],
        "memory_per_device_total": result["memory_per_device"]["total"],
        "documents_per_row": documents,
        "document_slots": slots,
        **costs,
    }


def format_kernels(r: dict) -> str:
    """`kernels_report` as a table: one line per (kind, source line), slowest first."""
    t = r["target"]
    slots = r.get("document_slots")
    documents = r.get("documents_per_row", 1)
    rows = f"rows of {documents} document{'s' if documents > 1 else ''}" + (
        f", the step for {slots} document slot{'s' if slots > 1 else ''}" if slots else ""
    )
    lines = [
        f"compiled for {t['count']} x {t['device']} (nothing ran); "
        "the ruler's estimate (jaxpar.compiled.ruler)",
        f"step {r['step_seconds'] * 1e3:.2f} ms   kernel launches per step {r['launches']:,}   "
        f"MFU {r['mfu']:.1%}   ({r['model_flops_per_step']:.3e} model FLOPs per step; {rows})",
        "",
        f"{'kind':<19} {'count':>6} {'GFLOP':>10} {'MB':>10} {'bound':<8} {'ms':>8}  source",
    ]
    for row in r["kernels"]:
        mark = "" if row["costed"] else "  (not costed: bytes and declared FLOPs only)"
        lines.append(
            f"{row['kind']:<19} {row['count']:>6} {row['flops'] / 1e9:>10.2f} {row['bytes'] / 1e6:>10.2f} "
            f"{row['bound']:<8} {row['seconds'] * 1e3:>8.3f}  {row['source']}{mark}"
        )
    if r["uncosted_kernels"]:
        lines.append(f"\n{r['uncosted_kernels']} launches of kernels the ruler cannot see into")
    return "\n".join(lines)


USAGE = """usage: python -m jaxpar.inspect [CONFIG.yaml] [dotted.key=value ...] [--compare] [--human]
                                   [--schedule] [--target NAME[:N] [--kernels]] [--documents K]
  --target h100:8   compile for 8 GPUs of that type without having them (gpu-compile extra);
                    exit code 3 when the program does not fit
  --kernels         with --target h100: the ruler's per-kernel table, estimated step time and MFU
  --documents K     the data's rows hold K documents: compile the step training runs for them
                    (cuDNN attention: the slot bucket of K) and cost it so; 1 with --kernels"""


# The flags that take a value: what the value is, and an example.
VALUES = {"--target": ("a GPU type", "h100:8"), "--documents": ("a number of documents", "24")}


def _split_flags(argv: list[str]) -> tuple[set[str], dict[str, str], list[str]]:
    """(flags, the values of --target and --documents given, the config and its overrides)."""
    flags, values, rest = set(), {}, []
    args = iter(argv)
    for arg in args:
        name = arg.split("=", 1)[0]
        if name in VALUES:
            value = arg.split("=", 1)[1] if "=" in arg else next(args, "")
            if value.startswith("--"):  # `--target --human`: the value is missing
                what, example = VALUES[name]
                raise ConfigError(f"{name} needs {what} before {value}, e.g. {name} {example}")
            values[name] = value
        elif arg.startswith("--"):
            flags.add(arg)
        else:
            rest.append(arg)
    unknown = flags - {"--compare", "--human", "--schedule", "--kernels", "--help"}
    if unknown:
        raise ConfigError(
            f"unknown flag(s) {sorted(unknown)}; known: --compare, --human, --schedule, --kernels, "
            "--target NAME[:N], --documents K"
        )
    target = values.get("--target")
    costable = target is not None and targets_lib.parse_target(target)[0] in ruler.RATES
    if "--kernels" in flags and not costable:
        raise ConfigError(
            f"--kernels costs a GPU program: add --target with a GPU the ruler has rates for "
            f"({', '.join(ruler.RATES)}), e.g. --target h100"
        )
    if target == "":
        raise ConfigError(
            f"--target needs a GPU type, e.g. --target h100:8; known: {', '.join(targets_lib.TARGETS)}"
        )
    return flags, values, rest


def _documents(text: str | None, flags: set[str], trainer: Trainer) -> int | None:
    """--documents K as a number of documents per row (with --kernels, 1 when not given; else
    None: `Trainer.step`), or a ConfigError saying what would work."""
    if text is None:
        return 1 if "--kernels" in flags else None
    seq, limit = trainer.cfg.train.seq_len, trainer.cfg.model.max_documents_per_row
    try:
        documents = int(text)
    except ValueError:
        documents = 0
    if not 1 <= documents <= seq:
        raise ConfigError(
            f"--documents {text}: a row of train.seq_len={seq} tokens holds 1 to {seq} documents; "
            "give a whole number in that range, e.g. --documents 24"
        )
    if trainer.bucketed and documents > limit:
        raise ConfigError(
            f"--documents {documents}: more than model.max_documents_per_row={limit}, which a run "
            f"with cuDNN attention refuses; add model.max_documents_per_row={documents}, or give "
            f"--documents {limit} or fewer"
        )
    return documents


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if {"-h", "--help"} & set(argv):
        print(USAGE)
        return 0
    return cli.run(lambda: _inspect(argv))


def _inspect(argv: list[str]) -> int:
    """The command's work: settings (for a --target's devices, before JAX starts), then the
    schedule (--schedule) or the compiled step's report."""
    flags, values, rest = _split_flags(argv)
    target = None
    if "--target" in values:  # before JAX starts: the plugin must not look for a driver
        target = targets_lib.resolve(values["--target"])
        targets_lib.use_cpu_backend()
    cfg, sizes = load_and_validate(rest, num_devices=target and target.count)
    if "--schedule" in flags:  # the pipeline's static timeline; nothing compiles
        p = cfg.parallel
        schedule = pipeline_lib.schedule_for_mesh(  # the control flow the step runs (zb)
            pipeline_lib.build_schedule(p.pipeline_schedule, sizes["pipe"], p.microbatches, p.virtual_stages),
            sizes,
            row_axes=pipeline_lib.row_axes_for(cfg.model, p.zero_stage),
        )
        print(
            pipeline_lib.format_schedule(schedule)
            if "--human" in flags
            else json.dumps(pipeline_lib.describe_schedule(schedule), indent=2)
        )
        return 0
    # A ConfigError here is what the devices cannot run (model.fp8 on an older GPU).
    trainer = build_trainer(cfg, sizes, devices=target and targets_lib.devices(target))
    documents = _documents(values.get("--documents"), flags, trainer)
    mark = len(mesh_lib.COMPILED)
    compiled = compile_step(trainer, documents)
    if line := mesh_lib.compile_line(
        mesh_lib.compiled_since(mark), mesh_lib.compile_cache_in_use(), "the train step"
    ):
        print(line, file=sys.stderr, flush=True)  # stdout holds the report alone
    result = report(trainer, compiled, compare="--compare" in flags, target=target)
    if documents is not None:  # what the program was compiled for
        result.update(documents_per_row=documents, document_slots=trainer.bucket(documents))
    if "--kernels" in flags:
        costs = kernels_report(result, compiled.as_text(), target, documents, result["document_slots"])
        print(format_kernels(costs) if "--human" in flags else json.dumps(costs, indent=2))
    else:
        print(format_human(result) if "--human" in flags else json.dumps(result, indent=2))
    if target is not None and not result["fits"]:
        total, usable = result["memory_per_device"]["total"], target.usable_bytes
        print(
            f"does not fit: {total / 2**30:.2f} GiB per device, {usable / 2**30:.2f} GiB usable on "
            f"{target.description} ({targets_lib.USABLE_FRACTION:.0%} of "
            f"{target.memory_bytes / 2**30:.2f} GiB); try more devices, a higher "
            "parallel.zero_stage, parallel.remat=dots or full, or a smaller train.batch_size",
            file=sys.stderr,
        )
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
