"""Memory of H100 programs compiled on this GPU-less machine (jaxpar.compiled.targets): the presets meet
their targets, and a model that cannot fit is refused with exit code 3. (Apart from
test_gpu_program.py so that the two files compile on different test workers.)"""

from __future__ import annotations

import os

import pytest

from jaxpar.checks import validate
from jaxpar.compiled import targets as targets_lib
from jaxpar.config import load_config
from jaxpar.inspect import compile_step, report
from jaxpar.run.train import build_trainer

pytest.importorskip("jax_plugins.xla_cuda12", reason="needs the gpu-compile extra")

GIB = 2**30


# --- Memory targets of the presets on one H100 (compiled; plain-JAX steps of the same shapes
# compile to 9.0 GiB for GPT-2 124M with a chunked loss and 31.6 GiB for the 1B with dots remat).
# On an H100 the presets' loss keeps its logits whole (they fit a sixth of the memory,
# jaxpar.models.loss.loss_chunks): the 1B's float32 logits and their bfloat16 gradient, 12.6 GB,
# for the step's fastest loss. In 32 vocabulary pieces it holds the plain step's 31.6 GiB.


@pytest.mark.parametrize(
    "preset, overrides, limit_gib",
    [("gpt2-124m", [], 9.0), ("llama-1b", [], 38.5), ("llama-1b", ["train.loss_chunks=32"], 32.0)],
)
def test_preset_fits_its_memory_target_on_one_h100(preset, overrides, limit_gib):
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    cfg = load_config(os.path.join(root, "configs", f"{preset}.yaml"), overrides)
    target = targets_lib.resolve("h100")
    trainer = build_trainer(cfg, validate(cfg, 1), devices=targets_lib.devices(target))
    r = report(trainer, compile_step(trainer), target=target)
    assert r["memory_per_device"]["total"] <= limit_gib * GIB, r["memory_per_device"]
    assert any(k.startswith("__cudnn$fmha") for k in r["kernels"])


def test_a_model_too_big_for_one_h100_exits_3(capsys):
    from jaxpar.inspect import main

    # 5.4 B parameters, nearly all in an untied 2.6M-entry vocabulary (one small layer compiles
    # fast): 16 bytes each (float32 params, grads, Adam) is 80 GiB > 90% of 79 GiB.
    big = [
        "model.vocab_size=2621440",
        "model.d_model=1024",
        "model.n_layers=1",
        "model.n_heads=8",
        "model.n_kv_heads=8",
        "model.d_ff=1024",
        "train.batch_size=1",
        "train.seq_len=128",
        "mesh.data=1",
        "mesh.fsdp=1",
        "mesh.tensor=1",
        "parallel.zero_stage=0",
    ]
    assert main([*big, "--target", "h100"]) == 3
    out, err = capsys.readouterr()
    assert '"fits": false' in out and "does not fit" in err and "GiB" in err


def test_plan_verify_costs_the_compiled_program_with_the_ruler(capsys):
    """`plan --verify 1` compiles the best plan for the target and sets the ruler's step time
    and MFU of that program beside the planner's prediction (a plan whose numbers came from
    nowhere would not match the ruler's reading of the same text)."""
    import json

    from jaxpar.compiled import ruler
    from jaxpar.planning import plan

    assert plan.main(["configs/tiny.yaml", "--gpus", "8xh100", "--top", "1", "--verify", "1"]) == 0
    (best,) = json.loads(capsys.readouterr().out)["plans"]
    assert best["compiled_memory_per_device"] > 0
    assert best["compiled_step_time_s"] > 0 and 0 < best["compiled_mfu"] < 1
    # The same program's model FLOPs over the ruler's step: the MFU is consistent with its time.
    flops = best["mfu"] * best["step_time_s"] * 8 * ruler.RATES["h100"].peak_flops
    assert best["compiled_mfu"] == pytest.approx(
        flops / (best["compiled_step_time_s"] * 8 * ruler.RATES["h100"].peak_flops), rel=1e-2
    )
