"""The planner, the host-memory forecast and the launcher fail safe (issue 40): LoRA's adapters in
the planner's memory and time and in the host forecast, one line and exit 2 for a config that
cannot work (zero layers, a negative --tail), and advice that helps when no layout divides the
batch. Each test names the defect it guards; all but one run in this process, nothing compiles."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import jax
import pytest

from jaxpar import checks as checks_lib
from jaxpar import config as config_lib
from jaxpar import launch
from jaxpar.compiled.targets import DEVICES
from jaxpar.config import MESH_AXES, ConfigError
from jaxpar.models import lora as lora_lib
from jaxpar.planning import host as host_lib
from jaxpar.planning import memory, params, plan, step_time
from jaxpar.sharding import shard_bytes
from tests.parity import TINY_YAML, tiny_config, trainer_on

EVERY_TARGET = "finetune.lora.targets=[q,k,v,o,gate,up,down]"


# --- 1. The planner's memory and time with LoRA ------------------------------------------------------


@pytest.mark.parametrize(
    "stage, mesh, extra",
    [
        (1, {"fsdp": 4, "tensor": 2}, ["finetune.lora.rank=4", EVERY_TARGET]),
        (3, {"fsdp": 2, "pipe": 2, "tensor": 2}, ["finetune.lora.rank=3"]),
    ],
)
def test_lora_state_per_device_equals_the_trainers_shardings(stage, mesh, extra):
    """Bug: the planner ignored finetune.lora -- no adapters among the parameters, and gradients
    and Adam state for every weight where the trainer holds them for the adapters alone."""
    trainer = trainer_on([f"parallel.zero_stage={stage}", *extra], mesh)
    shapes, shardings = trainer.state_shape, trainer.state_shardings
    predicted = memory.predict_memory(trainer.cfg, dict(trainer.mesh.shape), kernel="xla")
    trained, _ = trainer.trainable.split(shapes["params"])
    assert predicted["params"] == shard_bytes(shapes["params"], shardings["params"])
    assert predicted["gradients"] == shard_bytes(trained, trainer.grad_shardings)
    moments = [
        (x, s)
        for x, s in zip(jax.tree.leaves(shapes["opt_state"]), jax.tree.leaves(shardings["opt_state"]))
        if x.ndim > 0
    ]
    assert predicted["optimizer"] == shard_bytes(*zip(*moments))
    adapters = sum(math.prod(x.shape) for x in jax.tree.leaves(trained))
    assert (
        params.state_elements(trainer.cfg.model, {a: 1 for a in MESH_AXES}, 0, trainer.cfg.finetune.lora)[
            "adapters"
        ]
        == adapters
    )


def test_lora_plans_update_and_reduce_the_adapters_alone_and_say_so(capsys):
    """Bug: a LoRA plan was timed as a full fine-tune (the optimizer step over every weight, every
    gradient reduced, the frozen weights' gradient matmuls computed), and did not say LoRA."""
    cfg = config_lib.load_config(TINY_YAML, ["train.batch_size=16"])
    adapted = config_lib.load_config(TINY_YAML, ["train.batch_size=16", "finetune.lora.rank=2"])
    sizes = {a: 1 for a in MESH_AXES} | {"data": 8}
    full, lora = (step_time.predict_time(c, sizes, DEVICES["h100"], 8, "xla") for c in (cfg, adapted))
    assert lora["optimizer_s"] < full["optimizer_s"] / 10
    assert lora["comm_s"]["data_fsdp"] < full["comm_s"]["data_fsdp"] / 10
    assert lora["compute_s"] < full["compute_s"]
    assert plan.main([TINY_YAML, "finetune.lora.rank=2", "--gpus", "8xh100", "--top", "1"]) == 0
    model = json.loads(capsys.readouterr().out)["model"]
    assert model["trained_params"] < model["params"] / 10
    assert "finetune.lora rank 2 on q, k, v, o" in model["lora"] and "frozen" in model["lora"]


# --- 2. The host forecast with LoRA ------------------------------------------------------------------


# Wide enough that rank 2000 is allowed (below every adapted matrix's smaller side, 2048), and
# that the adapters of all seven projections outweigh the model: 2.4 GiB forecast without them,
# 3.6 GiB with them and their gradients and Adam state, on one CPU device.
LARGE_RANK = [
    "model.d_model=2048",
    "model.d_ff=2048",
    "model.n_heads=16",
    "model.n_kv_heads=16",
    "finetune.lora.rank=2000",
    EVERY_TARGET,
    "mesh.data=1",
    "mesh.fsdp=1",
    "mesh.tensor=1",
    "runtime.cpu_devices=1",
    "runtime.host_memory_gib=3",
]


def test_the_host_forecast_counts_the_adapters_and_refuses_a_large_rank():
    """Bug: jaxpar.planning.host left the adapters out (1.4 GiB forecast for a run that took 36 GB at a
    large rank), so the run went on to an out-of-memory traceback instead of exit 3."""
    cfg = tiny_config(LARGE_RANK)
    sizes = checks_lib.validate(cfg, 1)
    m, rank = cfg.model, cfg.finetune.lora.rank
    per_layer = 4 * m.d_model + 2 * m.n_heads * m.head_width + 2 * m.n_kv_heads * m.head_width
    per_layer += 3 * (m.d_model + m.d_ff)  # the in + out widths of the seven adapted weights
    adapter_bytes = 4 * rank * per_layer * m.n_layers  # float32 A and B
    forecast = host_lib.forecast(cfg, sizes, local_devices=1, rate=1e11)
    # Their params, gradients and Adam's two moments, beside the frozen model's float32 weights.
    assert forecast.memory_bytes > 4 * adapter_bytes + 4 * params.state_elements(m, sizes, 0)["total"]
    assert not forecast.fits  # runtime.host_memory_gib=3: 2.4 GiB without the adapters would fit
    refusal = host_lib.refusal(forecast, cfg)
    assert "finetune.lora.rank=2000, 1 emulated device(s)) and runtime.host_memory_gib=3 allows" in refusal
    assert "use a smaller finetune.lora.rank, or " in refusal


def test_a_large_rank_is_refused_with_exit_3_before_anything_is_written(tmp_path):
    """The same run as a user starts it: exit 3, one line naming the rank, before the model is
    built (nothing written; a few seconds, most of them importing JAX)."""
    run = tmp_path / "run"
    done = subprocess.run(
        [sys.executable, "-m", "jaxpar.train", TINY_YAML, *LARGE_RANK, f"train.run_dir={run}"],
        env=dict(os.environ, JAX_PLATFORMS="cpu"),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 3, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: this run needs about "), lines
    assert "use a smaller finetune.lora.rank" in lines[0] and not run.exists()


# --- 5. Zero layers, and other settings every layout would break ------------------------------------


@pytest.mark.parametrize(
    "override, words",
    [
        ("model.n_layers=0", "model.n_layers=0: must be at least 1"),
        ("model.n_layers=-3", "model.n_layers=-3: must be at least 1"),
        ("data.source=/no/such/dir/*.txt", "data.source='/no/such/dir/*.txt': no such file"),
    ],
)
def test_plan_of_a_config_that_cannot_work_exits_2_naming_the_setting(capsys, override, words):
    """Bug: `plan model.n_layers=0` ended in a ZeroDivisionError traceback (n_layers=-3 in a
    math domain error), and a data.source that does not exist was answered with exit 3 'no
    layout fits: the smallest needs 0.6 GiB' -- every layout refused, for the data."""
    assert plan.main([TINY_YAML, override, "--gpus", "8xh100"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("plan error: ") and err.count("\n") == 1 and words in err, err


@pytest.mark.parametrize("layers", [0, -1])
def test_the_config_refuses_a_model_without_layers(layers):
    """What the planner now checks first: validation refuses zero and negative layer counts in
    one line naming the setting (it did before issue 40; kept so that it stays so)."""
    cfg = tiny_config([f"model.n_layers={layers}"])
    with pytest.raises(ConfigError, match=f"model.n_layers={layers}: must be at least 1"):
        checks_lib.validate(cfg, 8)


# --- 6. launch --tail -5 ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "flag, value, words",
    [
        ("--tail", "-5", "--tail=-5: need a count of lines >= 0"),
        ("--grace", "nan", "--grace=nan: need a duration >= 0"),
        ("--max-restarts", "-1", "--max-restarts=-1: need a count >= 0"),
    ],
)
def test_a_negative_launch_count_is_one_line_and_exit_2(monkeypatch, capsys, flag, value, words):
    """Bug: `launch --tail -5` started the first process, then ended in a ValueError traceback
    (a deque of maxlen -5)."""

    def no_fork(*args, **kwargs):
        raise AssertionError("the launcher started a process")

    monkeypatch.setattr(launch.subprocess, "Popen", no_fork)
    # A launch that would work otherwise: 2 x 4 CPU devices for the default mesh.
    with pytest.raises(SystemExit) as stopped:
        launch.main(["--nproc", "2", flag, value, TINY_YAML, "runtime.cpu_devices=4"])
    assert stopped.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"jaxpar.launch: error: {words}"), lines


def test_the_launcher_passes_the_start_timeout_through(capsys):
    """distributed.timeout_s is each process's own; the other distributed settings are the
    launcher's."""
    assert launch.parse_args(["--nproc", "2", "distributed.timeout_s=5"]).train_args == [
        "distributed.timeout_s=5"
    ]
    with pytest.raises(SystemExit):
        launch.parse_args(["--nproc", "2", "distributed.timeout_s=5", "distributed.process_id=1"])
    assert "error: distributed.process_id=1: the launcher sets" in capsys.readouterr().err


# --- 8. More GPUs than the batch has rows -------------------------------------------------------------


def test_too_many_gpus_for_the_batch_says_raise_the_batch_or_use_fewer(capsys):
    """Bug: `plan --gpus 1000000xh100` advised lowering the batch, when the batch was too small to
    give each GPU whole rows: the opposite of what helps."""
    gpt2 = str(plan_config("gpt2-124m"))
    assert plan.main([gpt2, "--gpus", "1000000xh100"]) == 3
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "lower the batch" not in err, err
    # A layer splits over at most 4 (tensor: d_ff 2048 and 12 heads) x 16 (context, a power of 2
    # that divides 1,000,000) = 64 GPUs; the other 15,625 need whole rows each.
    assert "raise train.batch_size to a multiple of 15625" in err
    assert "24576 is the most up to 1000000 that it divides over (--gpus 24576xh100)" in err
    assert plan.main([gpt2, "--gpus", "24576xh100", "--top", "1"]) == 0  # the count it names works
    capsys.readouterr()
    assert plan.main([gpt2, "train.batch_size=15625", "--gpus", "1000000xh100", "--top", "1"]) == 0


def plan_config(name: str):
    from pathlib import Path

    return Path(TINY_YAML).parent / f"{name}.yaml"


def test_lora_table_follows_the_models_adapters():
    """The adapters the planner counts are those `jaxpar.models.lora` adds, shape for shape."""
    trainer = trainer_on(["finetune.lora.rank=5", EVERY_TARGET], {"data": 1})
    flat = lora_lib._flat(trainer.state_shape["params"])
    shapes = sorted(x.shape for p, x in flat.items() if p[-1] in ("lora_a", "lora_b"))
    table = params.lora_table(trainer.cfg.model, trainer.cfg.finetune.lora)
    assert sorted(shape for _, shape, _ in table) == shapes


def test_a_gpu_count_of_zero_names_the_count():
    """--gpus 0xh100 was answered "write the count and the type": the count was written, it is
    the value that is wrong."""
    from jaxpar.planning.plan import parse_gpus

    with pytest.raises(
        ConfigError, match=r"--gpus '0xh100': the count must be at least 1, e.g. --gpus 8xh100"
    ):
        parse_gpus("0xh100")
