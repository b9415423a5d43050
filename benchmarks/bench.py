"""`python -m benchmarks.bench CONFIG [dotted.key=value ...] [--steps N] [--warmup W] [--json PATH]
[--tag NAME] [--xla-flag=FLAG ...] [--compare-reference] [--target NAME[:N]]`: time jaxpar's
train step, or (with --target) print the memory of its compiled program for GPUs not present.

The config is loaded and validated exactly as `python -m jaxpar.train` does
(`jaxpar.run.startup.load_and_validate`), the trainer is built (`build_trainer`) and its step is
compiled once on abstract shapes (`jaxpar.training.trainer.compile_step`), as the training loop would run
it on rows of one document. Batches are random tokens made here with numpy, one document a row, a
fresh one per step, put on the devices before timing (no data pipeline, no grain). After W
warm-up steps, N steps (default 20) are timed one by one, each ended by `block_until_ready` on the
new state and the metrics, so every step time is one step's device time plus one host round trip.

Reported (table on stdout, JSON in benchmarks/results/<config-stem>-<device>[-xN][-TAG].json):
median / mean / min / max / p90 step time; tokens/s from the median; MFU from
`jaxpar.training.metrics.flops_per_token` (6·N_matmul + 12·L·d·T, PaLM appendix B / nanoGPT)
and the device's peak bf16 FLOP/s (null where jaxpar.training.metrics has no peak: CPUs); compile and
init seconds; peak device memory from `device.memory_stats()` (null on CPU); the compiled
program's memory analysis and XLA's FLOP count (`jaxpar.inspect.report`); device kind and count,
software versions, and the XLA flags in force (XLA_FLAGS before this script, plus --xla-flag).

Examples:
  python -m benchmarks.bench configs/gpt2-124m.yaml --compare-reference
  python -m benchmarks.bench configs/gpt2-124m.yaml model.attention=cudnn --tag cudnn
  python -m benchmarks.bench configs/default.yaml runtime.cpu_devices=1 mesh.data=1 mesh.fsdp=1 \\
      mesh.tensor=1 --steps 20 --warmup 3          # a CPU smoke run
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import re
import shlex
import sys
import time
from pathlib import Path

import jax
import numpy as np

from jaxpar import cli
from jaxpar.config import Config, ConfigError
from jaxpar.inspect import report
from jaxpar.run.startup import load_and_validate
from jaxpar.training import metrics as metrics_lib
from jaxpar.training.trainer import BATCH_KEYS, Trainer, build_trainer, compile_step

RESULTS_DIR = Path(__file__).resolve().parent / "results"
DEFAULT_STEPS = 20
DEFAULT_WARMUP = 3

# Reference runs measured on one NVIDIA H100 80GB HBM3 (SXM), 2026-11-22 (one run each, mean of
# 20 steps after warm-up, random tokens, bf16 compute, seq 1024). MFU against 989 TFLOP/s.
GPT2_124M_REFERENCE = [
    # (what, batch, step ms, tokens/s, MFU)
    ("nanoGPT (torch.compile, bf16 autocast, fused AdamW)", 12, 28.2, 436e3, 0.38),
    ("nanoGPT, timed without a host sync per step", 12, 27.2, 451e3, 0.39),
    ("nanoGPT", 32, 68.8, 477e3, 0.41),
    ("plain JAX (scan, fp32 params cast to bf16, cuDNN attention, fp32 logits)", 12, 40.6, 303e3, 0.26),
    ("plain JAX, XLA attention", 12, 88.1, 140e3, 0.12),
    ("plain JAX, cuDNN attention", 32, 100.4, 327e3, 0.28),
]
# The shape those rows were measured at (configs/gpt2-124m.yaml): only then are they comparable.
GPT2_124M_SHAPE = {
    "vocab_size": 50304,
    "d_model": 768,
    "n_layers": 12,
    "n_heads": 12,
    "d_ff": 2048,
    "tie_embeddings": True,
}
GPT2_124M_SEQ_LEN = 1024

# Environment variables that change what is measured; recorded with every result.
RECORDED_ENV = (
    "XLA_PYTHON_CLIENT_PREALLOCATE",
    "XLA_PYTHON_CLIENT_MEM_FRACTION",
    "XLA_PYTHON_CLIENT_ALLOCATOR",
    "JAX_PLATFORMS",
    "CUDA_DEVICE_MAX_CONNECTIONS",
    "NCCL_NVLS_ENABLE",
    "TF_CPP_MIN_LOG_LEVEL",
)


# --- Command line -----------------------------------------------------------------------------


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.bench",
        description="Time jaxpar's train step on random tokens (see the module docstring).",
    )
    parser.add_argument(
        "config_and_overrides",
        nargs="*",
        metavar="CONFIG / key=value",
        help="as for python -m jaxpar.train: [CONFIG.yaml] [dotted.key=value ...]",
    )
    parser.add_argument(
        "--steps",
        type=int,
        default=DEFAULT_STEPS,
        help=f"timed steps (default {DEFAULT_STEPS}; fewer is a smoke run)",
    )
    parser.add_argument(
        "--warmup",
        type=int,
        default=DEFAULT_WARMUP,
        help=f"untimed steps after compiling (default {DEFAULT_WARMUP})",
    )
    parser.add_argument(
        "--json",
        metavar="PATH",
        help="where to write the JSON result (default "
        "benchmarks/results/<config-stem>-<device>[-xN][-TAG].json)",
    )
    parser.add_argument(
        "--tag",
        default="",
        help="a name for this variant, kept in the JSON and the default file name (e.g. cudnn, remat-dots)",
    )
    parser.add_argument(
        "--xla-flag",
        action="append",
        default=[],
        metavar="FLAG",
        help="append FLAG to XLA_FLAGS before the backend starts; repeatable; "
        "write it as --xla-flag=--xla_gpu_...=true",
    )
    parser.add_argument(
        "--compare-reference",
        action="store_true",
        help="print the H100 reference runs (GPT2_124M_REFERENCE) next to the result (GPT-2 124M shape only)",
    )
    parser.add_argument(
        "--target",
        metavar="NAME[:N]",
        help="time nothing: compile for N GPUs of that type on this machine (no GPU "
        "needed; the gpu-compile extra) and print the memory table of the config "
        "given, or of every preset in TARGET_PRESETS",
    )
    args = parser.parse_intermixed_args(argv)
    if args.steps < 1 or args.warmup < 0:
        parser.error(f"--steps={args.steps} must be >= 1 and --warmup={args.warmup} >= 0")
    return args


def apply_xla_flags(extra: list[str]) -> tuple[list[str], list[str]]:
    """Appends `extra` to XLA_FLAGS (only effective before the backend starts); returns
    (the flags found in the environment, the flags added here)."""
    from_env = shlex.split(os.environ.get("XLA_FLAGS", ""))
    if extra:
        os.environ["XLA_FLAGS"] = " ".join(from_env + list(extra))
    return from_env, list(extra)


# --- Inputs and the timed loop ---------------------------------------------------------------


def random_batch(cfg: Config, rng: np.random.Generator, rows: int) -> dict[str, np.ndarray]:
    """`rows` rows of uniformly random tokens, one document per row: positions 0..T-1, one
    segment, every target counted. Shapes [rows, seq_len], the dtypes of Trainer.batch_shape."""
    seq = cfg.train.seq_len
    tokens = rng.integers(0, cfg.model.vocab_size, size=(rows, seq + 1), dtype=np.int32)
    return {
        "inputs": tokens[:, :-1],
        "targets": tokens[:, 1:],
        "positions": np.broadcast_to(np.arange(seq, dtype=np.int32), (rows, seq)).copy(),
        "segment_ids": np.ones((rows, seq), np.int32),
        "loss_mask": np.ones((rows, seq), np.float32),
    }


def device_batches(trainer: Trainer, count: int, seed: int) -> list[dict[str, jax.Array]]:
    """`count` random global batches, already sharded over the mesh (outside the timed loop).
    One per step, so that the loss stays near ln(vocab) and shows the step is computing."""
    rows = trainer.cfg.train.batch_size // jax.process_count()
    rng = np.random.default_rng(seed + jax.process_index())
    batches = [trainer.shard_batch(random_batch(trainer.cfg, rng, rows)) for _ in range(count)]
    assert set(batches[0]) == set(BATCH_KEYS)
    return jax.block_until_ready(batches)


def timed_steps(compiled, state, batches, warmup: int, steps: int):
    """Runs `warmup` then `steps` steps, blocking after each; returns (the seconds of each timed
    step, the final state, the loss of the first and of the last step)."""
    times, losses = [], []
    for i, batch in enumerate(batches[: warmup + steps]):
        start = time.perf_counter()
        state, metrics = compiled(state, batch)
        jax.block_until_ready((state, metrics))
        if i >= warmup:
            times.append(time.perf_counter() - start)
        if i == 0 or i == warmup + steps - 1:
            losses.append(float(metrics["loss"]))
    return times, state, losses[0], losses[-1]


# --- Measuring -------------------------------------------------------------------------------


def device_memory(device: jax.Device) -> dict[str, int | None]:
    """Allocator statistics of `device` where the backend keeps them (GPUs; CPUs give None).
    The peak counts everything since the process started: init and autotuning included."""
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    stats = stats or {}
    return {
        "peak_bytes_in_use": metrics_lib.device_memory_bytes(device),
        "bytes_in_use": stats.get("bytes_in_use"),
        "bytes_limit": stats.get("bytes_limit"),
    }


def compiled_memory(compiled) -> dict[str, int]:
    """XLA's memory analysis of the compiled step, bytes per device."""
    mem = compiled.memory_analysis()
    fields = {
        "temp": "temp_size_in_bytes",
        "argument": "argument_size_in_bytes",
        "output": "output_size_in_bytes",
        "alias": "alias_size_in_bytes",
        "generated_code": "generated_code_size_in_bytes",
    }
    out = {key: int(getattr(mem, attr, 0) or 0) for key, attr in fields.items()}
    out["total"] = out["argument"] + out["output"] - out["alias"] + out["temp"]
    return out


def step_statistics(times: list[float]) -> dict:
    t = np.asarray(times)
    return {
        "median": float(np.median(t)),
        "mean": float(t.mean()),
        "min": float(t.min()),
        "max": float(t.max()),
        "p90": float(np.percentile(t, 90)),
        "stdev": float(t.std()),
        "all": [float(x) for x in t],
    }


def software_versions() -> dict[str, str]:
    versions = {"python": platform.python_version(), "jax": jax.__version__}
    for name in ("jaxlib", "flax", "optax"):
        try:
            versions[name] = __import__(name).__version__
        except (ImportError, AttributeError):
            versions[name] = None
    return versions


def run_benchmark(cfg: Config, sizes: dict[str, int], steps: int, warmup: int) -> dict:
    """Builds, compiles and times the train step of `cfg`; returns the result (no flags, no
    file names: see `main`)."""
    t, m = cfg.train, cfg.model
    trainer = build_trainer(cfg, sizes)
    start = time.perf_counter()
    # The step the training loop runs on these batches' rows, one document each (with cuDNN's
    # packed attention: the one-slot bucket, `Trainer.step_for`).
    compiled = compile_step(trainer, documents=1)
    compile_s = time.perf_counter() - start
    inspected = report(trainer, compiled)  # parameter count, per-device bytes, XLA FLOPs

    start = time.perf_counter()
    state = jax.block_until_ready(trainer.init())
    init_s = time.perf_counter() - start
    times, state, first_loss, last_loss = timed_steps(
        compiled, state, device_batches(trainer, warmup + steps, t.seed), warmup, steps
    )
    del state

    devices = list(trainer.mesh.devices.flat)
    step_time = step_statistics(times)
    tokens_per_step = t.batch_size * t.seq_len
    tokens_per_sec = tokens_per_step / step_time["median"]
    flops_tok = metrics_lib.flops_per_token(m, t.seq_len)
    peak = metrics_lib.peak_flops(devices[0])
    return {
        "steps": steps,
        "warmup": warmup,
        "model": {
            "params": inspected["params"],
            **{
                k: getattr(m, k)
                for k in (
                    "vocab_size",
                    "d_model",
                    "n_layers",
                    "n_heads",
                    "n_kv_heads",
                    "d_ff",
                    "tie_embeddings",
                    "dtype",
                    "param_dtype",
                    "attention",
                    "scan_layers",
                )
            },
            "moe_experts": m.moe.num_experts,
            # the cuDNN packed step's document slots (one-document rows), None: not bucketed
            "document_slots": trainer.bucket(1),
        },
        "parallel": dataclasses.asdict(cfg.parallel),
        "mesh": {a: s for a, s in sizes.items() if s > 1} or {"data": 1},
        "batch_size": t.batch_size,
        "seq_len": t.seq_len,
        "tokens_per_step": tokens_per_step,
        "compile_seconds": compile_s,
        "init_seconds": init_s,
        "step_time_s": step_time,
        "tokens_per_sec": tokens_per_sec,
        "tokens_per_sec_mean": tokens_per_step / step_time["mean"],
        "flops_per_token": flops_tok,
        "model_flops_per_step": inspected["model_flops_per_step"],
        "xla_flops_per_step": inspected["xla_flops_per_step"],
        "tflops_per_sec_per_device": flops_tok * tokens_per_sec / len(devices) / 1e12,
        "peak_flops_per_device": peak,
        "mfu": metrics_lib.mfu(tokens_per_sec, flops_tok, devices),
        "memory": {
            "device": device_memory(jax.local_devices()[0]),
            "compiled": compiled_memory(compiled),
            "state_per_device": {
                k: inspected["memory_per_device"][k] for k in ("params", "optimizer", "gradients")
            },
        },
        "collectives": inspected["collectives"],
        "loss": {"first": first_loss, "last": last_loss},
        "device": {
            "platform": devices[0].platform,
            "kind": devices[0].device_kind,
            "count": len(devices),
            "local_count": jax.local_device_count(),
            "process_count": jax.process_count(),
            "host_cpus": os.cpu_count(),
        },
        "software": software_versions(),
    }


# --- The reference numbers -------------------------------------------------------------------


def reference_for(cfg: Config) -> list[dict] | None:
    """The H100 reference rows (GPT2_124M_REFERENCE) for this config, or None unless the model
    is GPT-2 124M-shaped at seq 1024 (configs/gpt2-124m.yaml, any batch size, any overrides that
    keep the shape)."""
    shape = {k: getattr(cfg.model, k) for k in GPT2_124M_SHAPE}
    if shape != GPT2_124M_SHAPE or cfg.train.seq_len != GPT2_124M_SEQ_LEN or cfg.model.moe.num_experts:
        return None
    return [
        {"what": what, "batch_size": batch, "step_ms": ms, "tokens_per_sec": tps, "mfu": mfu}
        for what, batch, ms, tps, mfu in GPT2_124M_REFERENCE
    ]


def format_reference(result: dict, rows: list[dict] | None) -> str:
    if rows is None:
        return (
            "--compare-reference: the H100 reference runs cover only the GPT-2 124M "
            "shape at seq 1024 (configs/gpt2-124m.yaml); none for this config"
        )
    ours = result["tokens_per_sec"]
    lines = [
        "",
        f"H100 reference runs (mean of 20 steps) vs this run "
        f"({result['device']['kind']} x{result['device']['count']}, batch {result['batch_size']}, "
        f"median {1e3 * result['step_time_s']['median']:.1f} ms, {ours:,.0f} tok/s)",
        f"  {'reference':<74} {'batch':>5} {'ms':>7} {'tok/s':>9} {'MFU':>5} {'ours/ref':>8}",
    ]
    for r in rows:
        same = "" if r["batch_size"] == result["batch_size"] else "  (other batch)"
        lines.append(
            f"  {r['what']:<74} {r['batch_size']:>5} {r['step_ms']:>7.1f} "
            f"{r['tokens_per_sec']:>9,.0f} {r['mfu']:>5.2f} "
            f"{ours / r['tokens_per_sec']:>8.2f}{same}"
        )
    if "H100" not in result["device"]["kind"]:
        lines.append(f"  note: the references are one H100; this ran on {result['device']['kind']}")
    return "\n".join(lines)


# --- Output ----------------------------------------------------------------------------------


def _bytes(n: int | None) -> str:
    return "n/a (backend keeps no statistics)" if n is None else f"{n / 2**30:.3f} GiB"


def format_table(r: dict) -> str:
    st, mem = r["step_time_s"], r["memory"]
    mesh = " ".join(f"{a}={s}" for a, s in r["mesh"].items())
    mfu = "n/a (no peak FLOP/s for this device)" if r["mfu"] is None else f"{100 * r['mfu']:.1f}%"
    smoke = "  (fewer than 20: a smoke run)" if r["steps"] < DEFAULT_STEPS else ""
    flags = " ".join(r["xla_flags"]) or "(none)"
    rows = [
        ("config", f"{r['config']} {' '.join(r['overrides'])}".strip()),
        (
            "device",
            f"{r['device']['kind']} x{r['device']['count']} ({r['device']['platform']}), "
            f"{r['device']['process_count']} process(es)",
        ),
        ("software", " ".join(f"{k} {v}" for k, v in r["software"].items())),
        ("XLA flags", flags),
        (
            "model",
            f"{r['model']['params']:,} params, {r['model']['n_layers']} layers, "
            f"d {r['model']['d_model']}, attention {r['model']['attention']}, "
            f"remat {r['parallel']['remat']}, {r['model']['dtype']}",
        ),
        ("mesh", f"{mesh}, zero_stage {r['parallel']['zero_stage']}"),
        ("batch", f"{r['batch_size']} x {r['seq_len']} = {r['tokens_per_step']:,} tokens/step"),
        ("steps", f"{r['steps']} timed after {r['warmup']} warm-up{smoke}"),
        ("compile / init", f"{r['compile_seconds']:.2f} s / {r['init_seconds']:.2f} s"),
        (
            "step time",
            f"median {1e3 * st['median']:.2f} ms, mean {1e3 * st['mean']:.2f}, "
            f"min {1e3 * st['min']:.2f}, p90 {1e3 * st['p90']:.2f}, max {1e3 * st['max']:.2f}",
        ),
        ("tokens/s", f"{r['tokens_per_sec']:,.0f} (median step), {r['tokens_per_sec_mean']:,.0f} (mean)"),
        ("FLOPs/token", f"{r['flops_per_token']:.4g} (6·N_matmul + 12·L·d·T)"),
        ("achieved", f"{r['tflops_per_sec_per_device']:.3g} TFLOP/s per device (model FLOPs)"),
        ("MFU", mfu),
        ("peak memory", _bytes(mem["device"]["peak_bytes_in_use"])),
        ("compiled temp", _bytes(mem["compiled"]["temp"])),
        ("compiled args", _bytes(mem["compiled"]["argument"])),
        ("compiled total", _bytes(mem["compiled"]["total"])),
        (
            "loss",
            f"{r['loss']['first']:.3f} -> {r['loss']['last']:.3f} "
            f"(random tokens: ln V = {np.log(r['model']['vocab_size']):.3f})",
        ),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-") or "device"


def default_json_path(config_path: str | None, device: dict, tag: str) -> Path:
    """benchmarks/results/<config-stem>-<device kind>[-x<count>][-<tag>].json"""
    stem = Path(config_path).stem if config_path else "default"
    name = f"{stem}-{_slug(device['kind'])}"
    if device["count"] > 1:
        name += f"-x{device['count']}"
    if tag:
        name += f"-{_slug(tag)}"
    return RESULTS_DIR / f"{name}.json"


# --- Compiled memory on GPUs that are not here (--target) ------------------------------------

# The presets whose compiled-H100 memory the README and benchmarks/RESULTS.md quote, each
# (label, config, overrides, devices); --target h100 prints them all.
TARGET_PRESETS = [
    ("gpt2-124m, 1 GPU", "configs/gpt2-124m.yaml", [], 1),
    ("llama-1b, 1 GPU", "configs/llama-1b.yaml", [], 1),
    ("llama-1b, 8 GPUs, fsdp=8", "configs/llama-1b.yaml", [], 8),
]


def target_memory(config_and_overrides: list[str], target) -> dict:
    """Compile the train step for `target` (a jaxpar.compiled.targets.Target) and summarise it."""
    from jaxpar.compiled import targets as targets_lib

    cfg, sizes = load_and_validate(config_and_overrides, num_devices=target.count)
    trainer = build_trainer(cfg, sizes, devices=targets_lib.devices(target))
    start = time.perf_counter()
    compiled = compile_step(trainer)
    r = report(trainer, compiled, target=target)
    attention = sorted(k for k in r["kernels"] if k.startswith("__cudnn$fmha")) or ["XLA (no cuDNN)"]
    return {
        "total_bytes": r["memory_per_device"]["total"],
        "temp_bytes": r["memory_per_device"]["temp"],
        "fits": r["fits"],
        "attention": attention,
        "compile_seconds": time.perf_counter() - start,
    }


def target_table(args) -> int:
    from jaxpar.compiled import targets as targets_lib

    base = targets_lib.resolve(args.target)
    targets_lib.use_cpu_backend()
    words = args.config_and_overrides
    rows = (
        [
            (
                " ".join(words),
                words[:1] if words and "=" not in words[0] else [],
                [a for a in words if "=" in a],
                base.count,
            )
        ]
        if words
        else [(label, [path], extra, n) for label, path, extra, n in TARGET_PRESETS]
    )
    print(
        f"compiled for {base.description} (nothing ran); usable memory "
        f"{base.usable_bytes / 2**30:.1f} GiB per device\n"
    )
    print(f"{'config':<34} {'total GiB':>10} {'temp GiB':>9}  fits  attention kernel")
    for label, path, extra, count in rows:
        # An explicit :N applies to every row; otherwise each preset row has its own count.
        target = base if ":" in args.target else dataclasses.replace(base, count=count)
        try:
            m = target_memory([*path, *extra], target)  # the presets fill the mesh with -1
        except ConfigError as e:  # which row: the command's one line names it
            raise ConfigError(f"{label}: {e}") from None
        print(
            f"{label:<34} {m['total_bytes'] / 2**30:>10.2f} {m['temp_bytes'] / 2**30:>9.2f}  "
            f"{'yes' if m['fits'] else 'NO':<4}  {', '.join(m['attention'])}"
        )
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.target:
        return cli.run(lambda: target_table(args))
    flags = apply_xla_flags(args.xla_flag)  # before the backend starts
    return cli.run(lambda: bench(args, *flags))


def bench(args, flags_env: list[str], flags_added: list[str]) -> int:
    """The command's work: the benchmark run, its table printed and its JSON written."""
    words = args.config_and_overrides
    cfg, sizes = load_and_validate(words)
    config_path = words[0] if words and "=" not in words[0] else None
    result = {
        "config": config_path,
        "overrides": [a for a in words if "=" in a],
        "tag": args.tag,
        "timestamp": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        **run_benchmark(cfg, sizes, args.steps, args.warmup),
        "xla_flags": flags_env + flags_added,
        "xla_flags_set_by_bench": flags_added,
        "env": {k: os.environ[k] for k in RECORDED_ENV if k in os.environ},
        "jax_config": {
            k: getattr(jax.config, k, None)
            for k in ("jax_default_matmul_precision", "jax_enable_x64", "jax_num_cpu_devices")
        },
    }
    if args.compare_reference:
        result["reference"] = reference_for(cfg)
    if jax.process_index() != 0:
        return 0
    print(format_table(result))
    if args.compare_reference:
        print(format_reference(result, result["reference"]))
    path = Path(args.json) if args.json else default_json_path(config_path, result["device"], args.tag)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
