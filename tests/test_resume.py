"""A run survives interruption: exact resume, another mesh, preemption, NaN, wrong shapes."""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from jaxpar import checks as checks_lib
from jaxpar import config as config_lib
from jaxpar.run.stopping import NonFiniteLoss
from jaxpar.run.train import train
from jaxpar.training.checkpoint import CheckpointMismatchError
from tests.test_train import ROOT

TINY_YAML = os.path.join(ROOT, "configs", "tiny.yaml")
TINY = ["parallel.zero_stage=3"]  # configs/tiny.yaml; the runs resume across ZeRO-3 layouts


def losses(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return {r["step"]: r["loss"] for r in map(json.loads, f)}


def cli(run_dir, *extra, devices=8):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    args = [
        sys.executable,
        "-m",
        "jaxpar.train",
        TINY_YAML,
        *TINY,
        f"train.run_dir={run_dir}",
        f"runtime.cpu_devices={devices}",
        *extra,
    ]
    return subprocess.Popen(
        args, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def wait_for(predicate, proc, timeout=240):
    deadline = time.time() + timeout
    while not predicate():
        assert proc.poll() is None, proc.communicate()[1][-2000:]
        assert time.time() < deadline, "timed out"
        time.sleep(0.2)


def committed_steps(run_dir):
    path = os.path.join(run_dir, "checkpoints")
    names = os.listdir(path) if os.path.isdir(path) else []
    return [
        int(n) for n in names if n.isdigit() and os.path.exists(os.path.join(path, n, "jaxpar_manifest.json"))
    ]


def test_sigkill_then_resume_gives_the_same_losses(tmp_path):
    args = ["train.steps=12", "checkpoint.every=3", "mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2"]
    straight = cli(tmp_path / "straight", *args)
    # The killed run starts once the straight one has committed a checkpoint: by then every
    # program both compile (init, step, checkpoint saving's) is in the session's compilation
    # cache, and the killed run loads them instead of compiling them beside it (a cold run of
    # this config took 20 s of CPU, a warm one 11 s).
    wait_for(lambda: committed_steps(tmp_path / "straight"), straight)
    killed = cli(tmp_path / "killed", *args)
    wait_for(lambda: any(s >= 6 for s in committed_steps(tmp_path / "killed")), killed)
    killed.send_signal(signal.SIGKILL)
    killed.wait()
    assert straight.wait(timeout=300) == 0
    resumed = cli(tmp_path / "killed", *args)
    out, err = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, err[-2000:]
    assert "resumed from step" in err
    # Killed mid-run (not after its last step): the resumed run trains steps again.
    assert 6 <= int(re.search(r"resumed from step (\d+) ", err).group(1)) < 12, err[-2000:]
    want, got = losses(tmp_path / "straight"), losses(tmp_path / "killed")
    assert sorted(got) == list(range(1, 13))
    assert [got[s] for s in range(7, 13)] == [want[s] for s in range(7, 13)]  # bit-identical


def test_sigterm_finishes_the_step_checkpoints_and_exits_zero(tmp_path):
    proc = cli(
        tmp_path, "train.steps=100000", "checkpoint.every=0", "mesh.data=8", "mesh.fsdp=1", "mesh.tensor=1"
    )
    wait_for(lambda: os.path.exists(tmp_path / "metrics.jsonl") and len(losses(tmp_path)) >= 2, proc)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-2000:]
    last = out.strip().splitlines()[-1]
    assert last.startswith("stopped by SIGTERM after step")
    step = int(last.split("after step ")[1].split(":")[0])
    assert step in committed_steps(tmp_path)


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("reference")
    cfg = config_lib.load_config(
        TINY_YAML,
        TINY
        + [
            "train.steps=12",
            "checkpoint.every=6",
            f"train.run_dir={run_dir}",
            "mesh.data=8",
            "mesh.fsdp=1",
            "mesh.tensor=1",
        ],
    )
    train(cfg, checks_lib.validate(cfg, 8))
    return run_dir


def test_restore_onto_another_mesh_continues_the_run(reference_run, tmp_path):
    shutil.copytree(reference_run / "checkpoints" / "6", tmp_path / "checkpoints" / "6")
    cfg = config_lib.load_config(
        TINY_YAML,
        TINY
        + [
            "train.steps=12",
            "checkpoint.every=6",
            f"train.run_dir={tmp_path}",
            "mesh.data=1",
            "mesh.fsdp=4",
            "mesh.tensor=2",
        ],
    )
    summary = train(cfg, checks_lib.validate(cfg, 8))
    assert summary["start_step"] == 6
    want, got = losses(reference_run), losses(tmp_path)
    # Six AdamW steps of the float32 tiny model from the same state on another layout: only sums
    # in another order differ, and the loss falls smoothly (4.11 -> 3.67), so nothing amplifies
    # them: 1.3e-7 apart at most (jax 0.12.0.1). With gradients reduced in bfloat16 (the default
    # for every model before parallel.grad_reduce_dtype followed model.dtype), 2.1e-6 apart.
    np.testing.assert_allclose([got[s] for s in range(7, 13)], [want[s] for s in range(7, 13)], rtol=1e-6)


def test_checkpoint_of_another_shape_is_a_clear_error(reference_run, tmp_path):
    shutil.copytree(reference_run / "checkpoints", tmp_path / "checkpoints")
    cfg = config_lib.load_config(
        TINY_YAML,
        TINY
        + [
            "train.steps=12",
            f"train.run_dir={tmp_path}",
            "model.d_model=64",
            "mesh.data=8",
            "mesh.fsdp=1",
            "mesh.tensor=1",
        ],
    )
    with pytest.raises(
        CheckpointMismatchError,
        match=r"params.blocks.attn.wq: checkpoint has shape \(2, 32, 4, 8\), "
        r"the model has shape \(2, 64, 4, 16\)",
    ):
        train(cfg, checks_lib.validate(cfg, 8))


@pytest.mark.parametrize("on_nan", ["stop", "skip"])
def test_weights_blown_up_by_the_lr_stop_the_run_unsaved(on_nan, tmp_path):
    cfg = config_lib.load_config(
        TINY_YAML,
        TINY
        + [
            "train.steps=4",
            "checkpoint.every=1",
            f"train.run_dir={tmp_path}",
            f"train.on_nan={on_nan}",
            "optimizer.lr=1e30",
            "optimizer.clip_norm=0",
            "optimizer.warmup_steps=0",
            "mesh.data=8",
            "mesh.fsdp=1",
            "mesh.tensor=1",
        ],
    )
    sizes = checks_lib.validate(cfg, 8)
    if on_nan == "stop":  # lr 1e30 blows step 1's weights up to ~1e30: their norm overflows
        with pytest.raises(NonFiniteLoss, match=r"at step (\d+)") as info:
            train(cfg, sizes)
        assert int(info.value.args[0].split("at step ")[1].split(" ")[0]) == 1
        assert committed_steps(tmp_path) == []  # nothing non-finite was ever saved
    else:  # skipping cannot undo an applied update: weights that blew up stop the run too
        with pytest.raises(NonFiniteLoss, match=r"weights' norm became non-finite at step 1 "):
            train(cfg, sizes)
        assert committed_steps(tmp_path) == []


def test_the_host_reads_the_guard_every_log_every_steps_not_every_step(tmp_path):
    """lr 1e30 (step 1 warms up to 5e29) overflows the weights at step 1. The device records
    that; the host, reading only at step 5 (log_every, no checkpoint before), stops then and
    names step 1."""
    cfg = config_lib.load_config(
        TINY_YAML,
        TINY
        + [
            "train.steps=8",
            "train.log_every=5",
            "checkpoint.every=0",
            f"train.run_dir={tmp_path}",
            "optimizer.lr=1e30",
            "optimizer.clip_norm=0",
            "optimizer.warmup_steps=2",
            "mesh.data=8",
            "mesh.fsdp=1",
            "mesh.tensor=1",
        ],
    )
    with pytest.raises(NonFiniteLoss, match=r"at step 1 \(train.on_nan=stop; seen at step 5,"):
        train(cfg, checks_lib.validate(cfg, 8))
    metrics = tmp_path / "metrics.jsonl"
    assert committed_steps(tmp_path) == [] and (not metrics.exists() or not metrics.read_text())


def test_a_second_sigint_stops_at_once():
    from jaxpar.run.stopping import Preemption

    before = signal.getsignal(signal.SIGINT)  # SIG_IGN in a shell's background job
    with Preemption() as preemption:
        os.kill(os.getpid(), signal.SIGINT)  # the first asks for a checkpoint and a clean stop
        time.sleep(0.1)
        assert preemption.requested == "SIGINT" and preemption.agreed() == "SIGINT"
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)  # the second interrupts
            time.sleep(0.1)
    assert signal.getsignal(signal.SIGINT) is before  # handlers restored


def test_resume_drops_a_truncated_metrics_line_and_says_so(tmp_path, capsys):
    """A crash in the middle of a metrics write leaves half a JSON line; resuming keeps the
    readable lines up to the checkpoint and warns about the rest."""
    from jaxpar.run.records import keep_metrics_until

    path = tmp_path / "metrics.jsonl"
    path.write_text(
        '{"step": 1, "loss": 5.0}\n{"step": 2, "loss": 4.0}\n{"step": 3, "loss": 3.0}\n{"step": 4, "lo'
    )
    keep_metrics_until(str(tmp_path), 2)
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1, 2]
    err = capsys.readouterr().err
    assert "dropped 1 unreadable line(s) (4)" in err and str(path) in err
    assert not (tmp_path / "metrics.jsonl.tmp").exists()
