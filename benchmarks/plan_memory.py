"""`python -m benchmarks.plan_memory [--compile] [--only NAME ...] [--target h100]`: the
planner's predicted memory per device (`jaxpar.planning.memory.predict_memory`) against XLA's
compiled total for the layouts of `benchmarks/plan_layouts.py` and the pipelined ones of `EXTRA`
below, on 8 emulated CPU devices (or, with `--target h100`, for 8 H100s compiled without a GPU).
The prediction is for the backend that compiled (`jaxpar.planning.memory.BACKENDS`: "cpu" or
"gpu") with the attention kernel the trainer picks there.

Compiled numbers are cached in benchmarks/results/plan_memory-<backend>.json (`--compile`
recompiles the named or all layouts); the table (markdown) goes to stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"

from benchmarks.plan_layouts import LAYOUTS as BASE_LAYOUTS  # noqa: E402
from benchmarks.plan_layouts import layout  # noqa: E402

# Pipelines with the other axes and with grad accumulation, which the trainer now runs: MoE
# and ring attention inside pipeline stages, and accumulation over whole pipelined passes.
# The MoE row is float32 like the other MoE rows (bfloat16 MoE with data > 1 aborts
# XLA:CPU's compiler).
EXTRA = [
    layout(
        "p2-e2-d2-1f1b-moe",
        {"pipe": 2, "data": 2, "expert": 2},
        "parallel.zero_stage=0",
        "parallel.pipeline_schedule=1f1b",
        "parallel.microbatches=4",
        moe=True,
    ),
    layout(
        "p2-f2-c2-zb-z3-dots",
        {"pipe": 2, "fsdp": 2, "context": 2},
        "parallel.zero_stage=3",
        "parallel.pipeline_schedule=zb",
        "parallel.microbatches=4",
        "parallel.remat=dots",
    ),
    layout(
        "p2-d4-1f1b-accum2",
        {"pipe": 2, "data": 4},
        "parallel.zero_stage=0",
        "parallel.pipeline_schedule=1f1b",
        "parallel.microbatches=2",
        "parallel.grad_accum=2",
    ),
]
LAYOUTS = BASE_LAYOUTS + EXTRA


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.plan_memory")
    parser.add_argument("--compile", action="store_true", help="compile (else read the cache)")
    parser.add_argument("--only", nargs="*", default=None, help="layout names")
    parser.add_argument("--target", default=None, help="e.g. h100: compile for 8 of them")
    args = parser.parse_args(argv)
    if args.target:
        from jaxpar.compiled import targets as targets_lib

        target = targets_lib.resolve(f"{args.target}:8")
        targets_lib.use_cpu_backend()
    else:
        target = None
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
        os.environ["XLA_FLAGS"] = (
            os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
        ).strip()
    import jax

    if target is None:
        jax.config.update("jax_num_cpu_devices", 8)
    from benchmarks.plan_layouts import MODEL
    from jaxpar.planning import memory

    cache_path = RESULTS / f"plan_memory-{args.target or 'cpu'}.json"
    cache = json.loads(cache_path.read_text()) if cache_path.exists() else {}
    chosen = [row for row in LAYOUTS if args.only is None or row["name"] in args.only]
    rows = []
    for row in chosen:
        overrides = MODEL + row["overrides"]
        if args.compile or row["name"] not in cache:
            start = time.time()
            cache[row["name"]] = memory.compiled_memory(overrides, row["mesh"], target=target)
            cache[row["name"]]["compile_s"] = round(time.time() - start, 1)
            RESULTS.mkdir(exist_ok=True)
            cache_path.write_text(json.dumps(cache, indent=1, sort_keys=True))
            print(f"compiled {row['name']}: {cache[row['name']]}", file=sys.stderr, flush=True)
        compiled = cache[row["name"]]
        predicted = memory.predict_memory_for(overrides, row["mesh"], backend="gpu" if target else "cpu")
        rows.append((row, predicted, compiled))
    mib = 2**20
    print("| layout | mesh | settings | predicted MiB | compiled MiB | error |")
    print("| --- | --- | --- | --- | --- | --- |")
    errors = []
    for row, p, c in rows:
        err = p["total"] / c["total"] - 1
        errors.append(abs(err))
        mesh = " ".join(f"{a}={s}" for a, s in row["mesh"].items())
        settings = " ".join(o.split(".", 1)[1] for o in row["overrides"] if not o.startswith("model.moe"))
        settings += " (MoE)" if any(o.startswith("model.moe") for o in row["overrides"]) else ""
        print(
            f"| {row['name']} | {mesh} | {settings} | {p['total'] / mib:.1f} | "
            f"{c['total'] / mib:.1f} | {err:+.1%} |"
        )
    if errors:
        print(
            f"\n{len(errors)} layouts, {sum(e <= 0.10 for e in errors)} within 10%; largest "
            f"error {max(errors):.1%}, mean {sum(errors) / len(errors):.1%}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
