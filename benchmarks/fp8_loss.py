"""`python -m benchmarks.fp8_loss [--steps N] [overrides ...]`: the default job trained twice,
bfloat16 and `model.fp8=true` (same seed, same data order), and the final losses compared.

Each run is `python -m jaxpar.train` in its own process, into a temporary run directory, with
checkpoints off; the losses are read from its metrics.jsonl. Prints one JSON object (and writes
it to benchmarks/results/fp8_loss.json): each run's loss at every logged step, its wall time,
the final losses and their relative difference (fp8 - bf16) / bf16. On a CPU, XLA emulates the
float8 GEMMs (rounding as float8, computing in float32): the numbers are float8's, not the speed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def train(run_dir: str, overrides: list[str]) -> dict:
    start = time.time()
    subprocess.run(
        [
            sys.executable,
            "-m",
            "jaxpar.train",
            f"train.run_dir={run_dir}",
            "train.progress=false",
            "checkpoint.every=0",
            *overrides,
        ],
        cwd=ROOT,
        check=True,
    )
    wall = time.time() - start
    rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    return {"wall_s": round(wall, 1), "loss": {r["step"]: r["loss"] for r in rows if "loss" in r}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("overrides", nargs="*", help="dotted.key=value, for both runs")
    args = parser.parse_args(argv)
    common = [f"train.steps={args.steps}", *args.overrides]
    out = {"steps": args.steps, "overrides": args.overrides, "runs": {}}
    with tempfile.TemporaryDirectory(prefix="jaxpar-fp8-loss-") as tmp:
        for name, extra in (("bf16", ["model.fp8=false"]), ("fp8", ["model.fp8=true"])):
            out["runs"][name] = train(os.path.join(tmp, name), common + extra)
    final = {name: run["loss"][max(run["loss"])] for name, run in out["runs"].items()}
    out["final_loss"] = final
    out["relative_difference"] = (final["fp8"] - final["bf16"]) / final["bf16"]
    text = json.dumps(out, indent=1)
    print(text)
    results = ROOT / "benchmarks" / "results"
    results.mkdir(exist_ok=True)
    (results / "fp8_loss.json").write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
