"""`python -m benchmarks.plan_fit [--check]`: fits the planner's step-time constants to the "fit"
results of `jaxpar.planning.published` and checks the fitted model against the "check" results.

The fit: least squares on log(predicted / measured step time) over the fitted results, by a grid
search refined three times around its best point (deterministic, no dependencies). It prints the
constants to write into `jaxpar.planning.step_time.FITTED`, the band its residuals support
(`jaxpar.planning.step_time.step_time_band`), and a table of every result: measured and predicted
tokens/s per GPU, the residual, and whether a checked result falls inside the band. `--check`
skips the fit and prints the table for the constants in `jaxpar.planning.step_time` (seconds
instead of a minute).
"""

from __future__ import annotations

import itertools
import math
import sys

from jaxpar import config as config_lib
from jaxpar.compiled.targets import DEVICES
from jaxpar.planning import published, search, step_time

# Llama-3-8B at seq 8192 on 16 H100s (2 nodes of 8), 2 sequences per GPU as torchtitan runs it.
LLAMA3_8B_16 = [f"model.{k}={v}" for k, v in published.LLAMA31_8B.items()] + [
    "model.max_seq_len=8192",
    "train.seq_len=8192",
    "train.batch_size=32",
]


def loss(constants: step_time.StepTimeConstants) -> float:
    return sum(step_time.predict_published(r, constants)["log_residual"] ** 2 for r in published.fitted())


def fit() -> step_time.StepTimeConstants:
    """The constants minimising `loss`: a 3-D grid, then three finer grids around the best."""
    names = ("d_half", "host_s_per_layer", "exposed_fraction", "attention_backward")
    centre = (2000.0, 4e-4, 0.5, 0.6)
    span = (1800.0, 4e-4, 0.5, 0.4)  # +- around the centre
    bounds = ((100.0, 1e5), (0.0, 1.0), (0.0, 1.0), (0.1, 1.0))
    for _ in range(4):
        grids = [
            sorted({min(max(c + s * k / 3, lo), hi) for k in range(-3, 4)})
            for c, s, (lo, hi) in zip(centre, span, bounds)
        ]
        best = min(itertools.product(*grids), key=lambda c: loss(step_time.StepTimeConstants(*c)))
        centre, span = best, tuple(s / 3 for s in span)
    return step_time.StepTimeConstants(**dict(zip(names, _polish(list(centre), list(span), bounds))))


def _polish(x: list[float], step: list[float], bounds) -> list[float]:
    """A pattern search from the grid's best point: each constant moved by its step either way
    while that lowers the loss, the steps halved when nothing does, down to 0.1% of the value
    (3 significant digits kept)."""

    def f(v):
        return loss(step_time.StepTimeConstants(*(float(f"{c:.3g}") for c in v)))

    best = f(x)
    while any(s > 1e-3 * max(abs(c), 1e-3) for s, c in zip(step, x)):
        moved = False
        for i, (lo, hi) in enumerate(bounds):
            for sign in (1, -1):
                y = list(x)
                y[i] = min(max(x[i] + sign * step[i], lo), hi)
                if (value := f(y)) < best:
                    x, best, moved = y, value, True
        if not moved:
            step = [s / 2 for s in step]
    return [float(f"{c:.3g}") for c in x]


def table(constants: step_time.StepTimeConstants, band: float) -> list[str]:
    lines = [
        "| role | result | GPUs | layout | measured tok/s/GPU | predicted | predicted/measured step "
        "| in band |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in published.RESULTS:
        out = step_time.predict_published(r, constants)
        ratio = math.exp(out["log_residual"])
        layout = " ".join(f"{a}={n}" for a, n in r.mesh.items()) or "1 GPU"
        layout += f" ZeRO-{r.zero_stage} remat {r.remat}"
        inside = "yes" if abs(out["log_residual"]) <= math.log(band) else "NO"
        lines.append(
            f"| {r.role} | {r.name} | {r.gpus} | {layout} | {r.measured_tokens_per_s():,.0f} | "
            f"{out['tokens_per_s_per_gpu']:,.0f} | {ratio:.2f} | {inside} |"
        )
    return lines


def llama3_8b_16(constants: step_time.StepTimeConstants) -> str:
    cfg = config_lib.load_config(None, LLAMA3_8B_16)
    plans = search.enumerate_plans(cfg, 16, DEVICES["h100"], 8)
    top = next(p for p in plans if p.fits and not p.crosses and search.runnable(p, 16))
    t = top.time
    lo, hi = t["mfu_range"]
    return (
        f"Llama-3-8B, seq 8192, batch 32 on 16 H100s: top plan {top.sizes} "
        f"ZeRO-{top.cfg.parallel.zero_stage} remat {top.cfg.parallel.remat}: "
        f"MFU {t['mfu']:.1%} ({lo:.1%}-{hi:.1%}), "
        f"{t['tokens_per_s_per_gpu']:,.0f} tokens/s per GPU"
    )


def main(argv: list[str]) -> int:
    constants = step_time.FITTED if "--check" in argv else fit()
    residuals = [step_time.predict_published(r, constants)["log_residual"] for r in published.fitted()]
    band = step_time.step_time_band(residuals)
    print(f"constants: {constants}")
    print(
        f"fit residuals log(pred/meas): {', '.join(f'{x:+.3f}' for x in residuals)}; "
        f"RMS {math.sqrt(sum(x * x for x in residuals) / len(residuals)):.3f}; band x{band:.2f}"
    )
    print("\n".join(table(constants, band)))
    print(llama3_8b_16(constants))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
