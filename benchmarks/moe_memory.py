"""`python -m benchmarks.moe_memory [--target h100[:N]]`: the compiled GPU program's memory per
device for configs/moe-tiny.yaml scaled up (8 experts, top-2, d_model 2048, seq 4096, one
expert per GPU), padded against ragged expert dispatch, compiled without a GPU as
`python -m jaxpar.inspect CONFIG --target ...` does.

Each variant is `python -m jaxpar.inspect configs/moe-tiny.yaml SCALE... VARIANT... --target T`
in its own process (XLA_FLAGS gets --xla_gpu_autotune_level=0 unless set: nothing can be timed
without a GPU, and the program is the same). The variants (`model.moe.*`):

  padded        dispatch=padded: [experts, capacity = local tokens] buffers, all_to_all
  ragged        dispatch=ragged, ragged_buffer_factor=null: the worst-case receive buffer
                (expert devices * local tokens * min(top_k, local experts) rows), never drops
  ragged-x2     dispatch=ragged, ragged_buffer_factor=2: 2 * local tokens * top_k rows received,
                rows past that dropped and counted in dropped_fraction

Prints one JSON object and writes it to benchmarks/results/moe_memory-<gpu type>.json: per
variant the memory per device (bytes), the collectives and the library kernels. (That the
ragged program holds ragged-all-to-all and the grouped GEMMs, and no padded exchange, is
asserted by tests/test_ragged_moe.py on a small model's program.) No timings: those need a GPU
(benchmarks/RESULTS.md has the commands).
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
CONFIG = "configs/moe-tiny.yaml"
# moe-tiny scaled: 8 experts of 5632 hidden units (SwiGLU), top-2, an MoE MLP every second of 4
# blocks, d_model 2048, 4096-token sequences, 8 sequences a step: 4096 tokens per GPU, one
# expert per GPU (mesh.expert=8).
SCALE = [
    "model.d_model=2048",
    "model.n_heads=16",
    "model.n_kv_heads=8",
    "model.d_ff=5632",
    "model.moe.d_ff=5632",
    "model.n_layers=4",
    "model.max_seq_len=4096",
    "train.seq_len=4096",
    "train.batch_size=8",
    "mesh.data=1",
    "mesh.expert=8",
]
VARIANTS = {
    "padded": ["model.moe.dispatch=padded"],
    "ragged": ["model.moe.dispatch=ragged"],
    "ragged-x2": ["model.moe.dispatch=ragged", "model.moe.ragged_buffer_factor=2"],
}


def inspect(variant: list[str], target: str) -> dict:
    env = dict(os.environ)
    if "xla_gpu_autotune_level" not in env.get("XLA_FLAGS", ""):
        env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_gpu_autotune_level=0").strip()
    done = subprocess.run(
        [sys.executable, "-m", "jaxpar.inspect", CONFIG, *SCALE, *variant, "--target", target],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
    )
    if done.returncode not in (0, 3):  # 3: does not fit, still a report
        raise SystemExit(f"inspect {' '.join(variant)} failed:\n{done.stderr[-3000:]}")
    report = json.loads(done.stdout)
    return {
        "memory_per_device": report["memory_per_device"],
        "fits": report.get("fits"),
        "collectives": report["collectives"],
        "kernels": report["kernels"],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="h100:8")
    args = parser.parse_args(argv)
    out = {"target": args.target, "config": CONFIG, "overrides": SCALE, "variants": {}}
    for name, variant in VARIANTS.items():
        run = inspect(variant, args.target)
        memory = run["memory_per_device"]
        out["variants"][name] = {
            "overrides": variant,
            **run,
            "gib": {k: round(v / 2**30, 2) for k, v in memory.items() if isinstance(v, int)},
        }
    text = json.dumps(out, indent=1)
    print(text)
    name = re.sub(r"[^\w.-]", "-", args.target.split(":")[0])  # the GPU type; the count is inside
    (ROOT / "benchmarks" / "results" / f"moe_memory-{name}.json").write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
