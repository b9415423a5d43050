"""Every pipeline schedule against every pair of the data / fsdp / tensor axes and every ZeRO
stage, on 8 devices (pipe 2 x the pair), with a time limit: a collective that not every device
reaches (a stuck collective-permute) is a failure here, not a hung suite.

The grid runs the toy model of tests/test_pipeline.py in one child process (one import, one
compilation cache), with the shardings a ZeRO stage gives the model: stages 0 and 1 keep
parameters and gradients whole on data / fsdp (the optimizer state, which stage 1 splits, is not
part of the pipeline; the pipeline splits the rows over both itself, as the train step has it),
stage 2 pins the gradients split over fsdp, stage 3 the parameters too; the
`tensor` axis splits the hidden dim as Megatron's MLP does; the batch is split over data and
fsdp. Each cell must give the single device's loss and gradients, leaf by leaf. The real model
runs a representative subset of the same grid (tests/test_pipeline_training.py).

Each cell runs the schedule `schedule_for_mesh` picks, as the train step does: zero-bubble runs
stage-dependent (ZB-H1) only on data x fsdp below ZeRO-2, where both are row axes and the chunk is
collective-free; with tensor, or fsdp at ZeRO-2/3, it stays uniform (stage-dependent branches
would hang on the chunk's collectives).
"""

import json
import os
import subprocess
import sys
import time

import pytest

SCHEDULES = [("gpipe", 1, 4), ("1f1b", 1, 4), ("interleaved", 2, 4), ("zb", 1, 4)]  # kind, v, m
PAIRS = [("fsdp", "tensor"), ("data", "tensor"), ("data", "fsdp")]
ZERO_STAGES = [0, 1, 2, 3]
TIME_LIMIT_S = 420  # the grid takes about 100 s alone on 2 cores; a hang waits for this


def cells():
    return [(kind, v, m, pair, zero) for kind, v, m in SCHEDULES for pair in PAIRS for zero in ZERO_STAGES]


def run_grid() -> list[dict]:
    """In the child: run every cell, return {cell, loss error, worst leaf error, finite}."""
    import functools

    import jax
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from jaxpar.parallel.pipeline import pipeline_value_and_grad, split_microbatches, stack_stages
    from jaxpar.parallel.schedule import build_schedule, schedule_for_mesh
    from tests.test_pipeline import MICROBATCH, head_loss, make_mesh, single_device, stage_fn, toy_problem

    layer_params, head_params, x, y = toy_problem(4 * MICROBATCH, layers=8)
    reference = {}  # the single device's loss and grads, per schedule's layout
    compiled = {}  # one program per distinct set of shardings: ZeRO 0 and 1 share one, and
    # without fsdp every stage does (the cell still runs its own step)
    results = []
    for kind, v, m, pair, zero in cells():
        sizes = {"pipe": 2, "data": 1, "fsdp": 1, "tensor": 1, **{axis: 2 for axis in pair}}
        mesh = make_mesh((sizes["pipe"], sizes["data"], sizes["fsdp"], 1, 1, sizes["tensor"]))
        fsdp = "fsdp" if sizes["fsdp"] > 1 else None
        tensor = "tensor" if sizes["tensor"] > 1 else None
        put = lambda a, *spec: jax.device_put(a, NamedSharding(mesh, P(*spec)))
        # Megatron's MLP over tensor; ZeRO-3 splits the other weight dim over fsdp.
        p_fsdp = fsdp if zero == 3 else None
        specs = {"w1": (None, p_fsdp, tensor), "w2": (None, tensor, p_fsdp)}
        g_fsdp = fsdp if zero >= 2 else None
        grad_specs = {"w1": P("pipe", None, g_fsdp, tensor), "w2": P("pipe", None, tensor, g_fsdp)}
        # As the train step (`row_axes_for`): below ZeRO-2 parameters and gradients are whole on
        # fsdp, so the pipeline splits the rows over it itself, like data's.
        row_axes = ("data", "fsdp") if zero <= 1 else ("data",)
        schedule = schedule_for_mesh(build_schedule(kind, 2, m, v), sizes, row_axes=row_axes)
        args = (
            {k: put(a, *specs[k]) for k, a in layer_params.items()},
            head_params,
            put(x, ("data", "fsdp")),
            put(y, ("data", "fsdp")),
        )
        key = (kind, pair, str(specs), str(grad_specs), row_axes)
        if key not in compiled:

            def run(
                layer_params,
                head_params,
                x,
                y,
                schedule=schedule,
                mesh=mesh,
                grad_specs=grad_specs,
                v=v,
                m=m,
                row_axes=row_axes,
            ):
                loss, (stage_grads, head_grads, x_grads) = pipeline_value_and_grad(
                    stage_fn,
                    functools.partial(head_loss, batch=m * MICROBATCH),
                    stack_stages(layer_params, 2, v),
                    head_params,
                    split_microbatches(x, m),
                    split_microbatches(y, m),
                    schedule=schedule,
                    mesh=mesh,
                    row_axes=row_axes,
                )
                stage_grads = {
                    k: jax.lax.with_sharding_constraint(g, NamedSharding(mesh, grad_specs[k]))
                    for k, g in stage_grads.items()
                }
                return loss, (stage_grads, head_grads, x_grads)

            compiled[key] = jax.jit(run)
        if kind not in reference:
            reference[kind] = single_device(schedule, args)

        start = time.perf_counter()
        got = jax.device_get(compiled[key](*args))
        errors = [
            float(np.linalg.norm(np.asarray(a, np.float64) - b) / np.linalg.norm(b))
            for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(reference[kind]))
        ]
        results.append(
            {
                "cell": [kind, v, m, list(pair), zero],
                "loss": float(got[0]),
                "max_error": max(errors),
                "leaves": len(errors),
                "finite": all(bool(np.all(np.isfinite(a))) for a in jax.tree.leaves(got)),
                "stage_dependent": schedule.stage_dependent,
                "seconds": round(time.perf_counter() - start, 2),
            }
        )
        print(json.dumps(results[-1]), flush=True)
    return results


def test_every_schedule_with_every_axis_pair_and_zero_stage_matches_single_device():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        proc = subprocess.run(
            [sys.executable, os.path.abspath(__file__)],
            cwd=root,
            capture_output=True,
            text=True,
            timeout=TIME_LIMIT_S,
        )
    except subprocess.TimeoutExpired as e:
        done = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        pytest.fail(
            f"the pipeline grid did not finish in {TIME_LIMIT_S} s (a hung collective?); "
            f"finished cells:\n{done[-3000:]}"
        )
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert [r["cell"] for r in results] == [[k, v, m, list(pair), z] for k, v, m, pair, z in cells()]
    bad = [r for r in results if not (r["finite"] and r["max_error"] <= 1e-5 and r["loss"] > 0.1)]
    assert not bad, bad
    # Stage-dependent exactly where the chunk is collective-free: zero-bubble on data x fsdp
    # below ZeRO-2 (both row axes); with tensor, or fsdp at ZeRO-2/3, uniform.
    assert [r["cell"] for r in results if r["stage_dependent"]] == [
        ["zb", 1, 4, ["data", "fsdp"], 0],
        ["zb", 1, 4, ["data", "fsdp"], 1],
    ]


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import jax

    jax.config.update("jax_num_cpu_devices", 8)
    run_grid()
