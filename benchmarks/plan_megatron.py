"""`python -m benchmarks.plan_megatron`: the planner's step-time model against Megatron-LM's
published H100 results (Megatron-LM README: H100, bf16, seq 4096, vocab 131,072), which it was
not calibrated on.

The README gives the parameter count, GPU count and layout (TP, PP; the rest data parallel) and
the MFU; the shapes below are Llama-style approximations of those sizes made here (the runs'
exact shapes are not used). Global batch: 192 for the 1.7B and 384 for the 70B as published;
the 7.1B and 16B rows assume 192 (all four runs have 48 data-parallel replicas).

For each, the layout is fixed to the published one (tensor = TP, pipe = PP, the rest `data` or
`fsdp`), and the planner picks the fastest ZeRO stage, remat policy and schedule that fit on
80 GB H100s, 8 per node. Its own best layout for the same model and GPUs is printed beside it.
"""

from __future__ import annotations

import sys

from jaxpar import config as config_lib
from jaxpar import plan

PUBLISHED = [
    # (name, model shape, GPUs, batch, TP, PP, published MFU)
    ("1.7B", dict(d_model=2048, n_layers=24, n_heads=16, n_kv_heads=8, d_ff=5632), 48, 192, 1, 1, 0.41),
    ("7.1B", dict(d_model=4096, n_layers=32, n_heads=32, n_kv_heads=8, d_ff=12288), 96, 192, 2, 1, 0.47),
    ("16B", dict(d_model=6144, n_layers=38, n_heads=48, n_kv_heads=8, d_ff=16384), 192, 192, 4, 1, 0.49),
    ("70B", dict(d_model=8192, n_layers=80, n_heads=64, n_kv_heads=8, d_ff=28672), 768, 384, 8, 2, 0.42),
]
SEQ, VOCAB = 4096, 131072


def config(shape: dict, batch: int):
    overrides = [f"model.{k}={v}" for k, v in shape.items()]
    overrides += [
        f"model.vocab_size={VOCAB}",
        f"model.max_seq_len={SEQ}",
        "model.dtype=bfloat16",
        f"train.seq_len={SEQ}",
        f"train.batch_size={batch}",
    ]
    return config_lib.load_config(None, overrides), overrides


def main() -> int:
    device = plan.DEVICES["h100"]
    print(
        "| model | params | GPUs | batch | published layout | published MFU | predicted MFU "
        "(same layout) | predicted / published | settings picked | planner's own best (MFU) |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for name, shape, gpus, batch, tp, pp, mfu in PUBLISHED:
        cfg, _ = config(shape, batch)
        plans = plan.enumerate_plans(cfg, gpus, device, 8)
        same = [
            p
            for p in plans
            if p.fits
            and p.sizes["tensor"] == tp
            and p.sizes["pipe"] == pp
            and p.sizes["context"] == 1
            and plan.runnable(p, gpus)
        ]
        best = next(p for p in plans if p.fits and not p.crosses and plan.runnable(p, gpus))
        params = plan.state_elements(cfg.model, {a: 1 for a in config_lib.MESH_AXES}, 0)["total"]
        if not same:
            print(
                f"| {name} | {params / 1e9:.2f} B | {gpus} | {batch} | TP{tp} PP{pp} | {mfu:.0%} | "
                "nothing fits | | | |"
            )
            continue
        p = same[0]
        par = p.cfg.parallel
        picked = (
            f"data {p.sizes['data']}, fsdp {p.sizes['fsdp']}, ZeRO-{par.zero_stage}, "
            f"remat {par.remat}"
            + (f", {par.pipeline_schedule} m={par.microbatches}" if pp > 1 else "")
            + (f", grad_accum {par.grad_accum}" if par.grad_accum > 1 else "")
        )
        bs = best.sizes
        own = " ".join(f"{a}={bs[a]}" for a in config_lib.MESH_AXES if bs[a] > 1)
        own += (
            f" ZeRO-{best.cfg.parallel.zero_stage} remat {best.cfg.parallel.remat} ({best.time['mfu']:.1%})"
        )
        print(
            f"| {name} | {params / 1e9:.2f} B | {gpus} | {batch} | TP{tp} PP{pp} | {mfu:.0%} | "
            f"{p.time['mfu']:.1%} | {p.time['mfu'] / mfu:.2f} | {picked} | {own} |"
        )
    print()
    print("Calibration (one H100; the first row solved the model's only free constant):")
    print("| run | measured step | predicted step | predicted / measured |")
    print("| --- | --- | --- | --- |")
    for run in plan.calibration_runs():
        pred = plan.calibrated_step_s(run)
        tag = " (calibration)" if run.used_for_calibration else ""
        print(
            f"| {run.what}{tag} | {run.step_s * 1e3:.1f} ms | {pred * 1e3:.1f} ms | {pred / run.step_s:.2f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
