"""`python -m benchmarks.fp8_memory [--target h100[:N]] [CONFIG ...]`: the compiled GPU program's
memory per device, bfloat16 against `model.fp8=true`, for each preset (default gpt2-124m and
llama-1b), compiled without a GPU as `python -m jaxpar.inspect CONFIG --target ...` does.

Each program is `python -m jaxpar.inspect CONFIG model.fp8=... --target T` in its own process
(XLA_FLAGS gets --xla_gpu_autotune_level=0 unless set: nothing can be timed without a GPU, and
the program is the same). Prints one JSON object and writes it to
benchmarks/results/fp8_memory-<target>.json: per config and dtype, the memory per device
(bytes) and the library kernels. (That the block matmuls are float8 GEMMs is asserted by
tests/test_fp8.py on a small model's program.) No timings: those need a GPU (benchmarks/RESULTS.md has the
commands).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = ["configs/gpt2-124m.yaml", "configs/llama-1b.yaml"]


def inspect(config: str, fp8: bool, target: str) -> dict:
    env = dict(os.environ)
    if "xla_gpu_autotune_level" not in env.get("XLA_FLAGS", ""):
        env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_gpu_autotune_level=0").strip()
    done = subprocess.run(
        [sys.executable, "-m", "jaxpar.inspect", config, f"model.fp8={fp8}", "--target", target],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
    )
    if done.returncode not in (0, 3):  # 3: does not fit, still a report
        raise SystemExit(f"inspect {config} model.fp8={fp8} failed:\n{done.stderr[-3000:]}")
    report = json.loads(done.stdout)
    return {
        "memory_per_device": report["memory_per_device"],
        "kernels": report["kernels"],
        "fits": report.get("fits"),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="h100")
    parser.add_argument("configs", nargs="*", default=CONFIGS)
    args = parser.parse_args(argv)
    out = {"target": args.target, "configs": {}}
    for config in args.configs:
        runs = {name: inspect(config, fp8, args.target) for name, fp8 in (("bf16", False), ("fp8", True))}
        totals = {name: run["memory_per_device"]["total"] for name, run in runs.items()}
        out["configs"][config] = {**runs, "total_gib": {k: round(v / 2**30, 2) for k, v in totals.items()}}
    text = json.dumps(out, indent=1)
    print(text)
    name = re.sub(r"[^\w.-]", "-", args.target)
    (ROOT / "benchmarks" / "results" / f"fp8_memory-{name}.json").write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
