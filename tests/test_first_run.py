"""What a new user meets first: a GPU preset on a CPU, Ctrl-C, the log, --help and typos."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import time

import jax
import pytest

from jaxpar import checks as checks_lib
from jaxpar import config as config_lib
from jaxpar.config import ConfigError
from jaxpar.planning import host as host_lib
from jaxpar.run import stopping
from jaxpar.run import train as train_lib
from jaxpar.training.metrics import Progress
from tests.test_train import ROOT, TINY_YAML

GPT2 = os.path.join(ROOT, "configs", "gpt2-124m.yaml")
GIB = 2**30


def _cli(*args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "jaxpar.train", *args],
        cwd=ROOT,
        text=True,
        env=dict(os.environ, JAX_PLATFORMS="cpu"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )


# --- A GPU preset on a CPU -----------------------------------------------------------------------


def test_the_host_forecast_matches_the_measured_gpt2_and_default_runs():
    """Measured on the 2-core machines (jax 0.12.0.1): the README's gpt2-124m example on one CPU
    device peaked at 22.0 GB resident and took 254-278 s a step with the float32 matmul probe
    at about 195 GFLOP/s; the default job peaked at 1.7 GB and ran 5,641 tokens/s."""
    cfg = config_lib.load_config(GPT2, ["mesh.data=1"])
    gpt2 = host_lib.forecast(cfg, checks_lib.validate(cfg, 1), local_devices=1, rate=195e9)
    assert gpt2.memory_bytes == pytest.approx(22.0e9, rel=0.1)
    assert 200 < gpt2.step_seconds < 340 and gpt2.slow
    # Refused on an idle machine of 24 GiB, all of it available: it would leave the rest ~2 GiB.
    assert host_lib.limit_bytes(cfg, 24 * GIB) < gpt2.memory_bytes
    cfg = config_lib.load_config(None, [])
    default = host_lib.forecast(cfg, checks_lib.validate(cfg, 8), local_devices=8, rate=195e9)
    assert default.memory_bytes == pytest.approx(1.7e9, rel=0.15)
    assert 16 * 256 / default.step_seconds == pytest.approx(5641, rel=0.3) and not default.slow


def test_the_readme_gpt2_example_on_a_cpu_is_refused_at_once_with_the_numbers(tmp_path):
    """The README's own example, with what the run may take pinned (runtime.host_memory_gib), so
    that the test does not depend on this machine's free memory."""
    start = time.monotonic()
    proc = _cli(
        GPT2,
        "train.steps=100",
        "mesh.data=-1",
        "runtime.host_memory_gib=16",
        f"train.run_dir={tmp_path / 'run'}",
    )
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 3, err
    assert time.monotonic() - start < 60 and "Traceback" not in err
    line = err.strip().splitlines()[-1]
    assert line.startswith("error: this run needs about ") and "GiB of host memory" in line
    assert "runtime.host_memory_gib=16 allows 16.0 GiB" in line and "train.batch_size=12" in line
    assert not (tmp_path / "run").exists()  # refused before anything was written


def test_a_slow_run_says_how_slow_and_the_first_ctrl_c_stops_it_within_seconds(tmp_path):
    proc = _cli(
        GPT2,
        "train.batch_size=4",
        "train.steps=100",
        "runtime.host_memory_gib=64",
        f"train.run_dir={tmp_path / 'run'}",
    )
    seen = ""
    while "warning: on this CPU" not in seen:  # printed before the model is built
        line = proc.stderr.readline()
        assert line, proc.communicate()
        seen += line
    assert "one step is expected to take about" in seen and "100 steps about" in seen
    time.sleep(2)  # building the state or compiling: a step-sized wait is ahead
    proc.send_signal(signal.SIGINT)
    sent = time.monotonic()
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130 and time.monotonic() - sent < 8, err
    assert "stopped at once" in err and "Traceback" not in err


_BLOCKED_IN_XLA = (
    "import os, signal, threading\n"
    "import jax, jax.numpy as jnp\n"
    "from jaxpar.run.stopping import Preemption\n"
    "step = jax.jit(lambda x: jax.lax.fori_loop(0, 100000, lambda i, y: jnp.tanh(y @ x), x))\n"
    "x = jnp.ones((256, 256)) / 256\n"
    "with Preemption(exit_at_once=True) as p:\n"
    "    p.expected_wait_s, p.unsaved_steps = 300.0, {unsaved}\n"
    "    for at in {sigints}:\n"
    "        threading.Timer(at, os.kill, (os.getpid(), signal.SIGINT)).start()\n"
    "    step(x).block_until_ready()\n"
    "    print('waited for the step', flush=True)\n"
)


def test_with_steps_to_lose_the_first_ctrl_c_answers_at_once_and_the_second_stops():
    """3 steps since the last checkpoint: the first Ctrl-C says at once that the run stops after
    the step with a checkpoint (and does not stop); the second stops at once, one message."""
    start = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-c", _BLOCKED_IN_XLA.format(unsaved=3, sigints=(1.0, 3.0))],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
        env=dict(os.environ, JAX_PLATFORMS="cpu"),
    )
    assert done.returncode == 130 and "waited for the step" not in done.stdout, done
    assert (
        "Ctrl-C: stopping after the step in flight (about 300 s per step) with a checkpoint of the 3 step(s)"
        in done.stderr
    )
    assert done.stderr.count("interrupted again: stopped at once") == 1
    assert time.monotonic() - start < 25


def test_the_first_ctrl_c_does_not_wait_out_a_step_blocked_in_xla():
    """The main thread waits inside XLA (a long computation), where Python cannot run a signal
    handler; the watcher thread still stops the process within a few seconds."""
    code = _BLOCKED_IN_XLA.format(unsaved=0, sigints=(1.0,))
    start = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
        env=dict(os.environ, JAX_PLATFORMS="cpu"),
    )
    assert done.returncode == 130 and "waited for the step" not in done.stdout, done
    assert "stopped at once: a step takes about 300 s here and no step had run" in done.stderr
    assert time.monotonic() - start < 20


# --- Output a user can trust --------------------------------------------------------------------


def test_checkpoint_and_eval_time_are_their_own_figures_not_the_steps(tmp_path, monkeypatch):
    """A slow save (1 s) at steps 4 and 8 must not show as a slow training step."""
    real_save = train_lib.checkpoint_lib.Checkpointer.save

    def slow_save(self, *args, **kwargs):
        time.sleep(1.0)
        return real_save(self, *args, **kwargs)

    monkeypatch.setattr(train_lib.checkpoint_lib.Checkpointer, "save", slow_save)
    cfg = config_lib.load_config(
        TINY_YAML,
        [
            "runtime.cpu_devices=8",
            "mesh.data=8",
            "mesh.fsdp=1",
            "mesh.tensor=1",
            "train.steps=12",
            "train.log_every=2",
            "checkpoint.every=4",
            f"train.run_dir={tmp_path}",
        ],
    )
    summary = train_lib.train(cfg, checks_lib.validate(cfg, 8))
    records = {r["step"]: r for r in map(json.loads, open(tmp_path / "metrics.jsonl"))}
    plain = sorted(records[s]["step_time_s"] for s in (2, 6, 10))
    for step in (4, 8, 12):
        assert records[step]["checkpoint_time_s"] >= 1.0
        assert records[step]["step_time_s"] < 0.5 + 5 * plain[1], (step, records[step], plain)
    assert "checkpoint_time_s" not in records[6]
    assert summary["checkpoint_seconds"] >= 3.0
    assert summary["tokens_per_sec"] > 12 * 8 * 32 / summary["seconds"]  # the saves left out


def _records(n: int):
    return [
        {
            "step": s,
            "loss": 5.0 - s / 10,
            "tokens_per_sec": 1000.0,
            "mfu": None,
            "step_time_s": 0.5,
            **({"eval_loss": 4.0} if s == 4 else {}),
        }
        for s in range(2, n + 1, 2)
    ]


def test_off_a_terminal_the_log_is_plain_lines_one_per_logged_step():
    stream = io.StringIO()  # isatty() is False: a log file, Slurm, nohup
    progress = Progress(10, stream=stream)
    for step in range(1, 11):
        progress.update(step, next((r for r in _records(10) if r["step"] == step), None))
    progress.close()
    lines = stream.getvalue().splitlines()
    assert "\r" not in stream.getvalue() and len(lines) == 5
    assert lines[1].startswith("step 4/10 | loss 4.6000 | eval loss 4.0000 | 1,000 tok/s")
    # The ETA waits for TIMED_STEPS (3) steps after the compiling one (step 1).
    assert lines[0].endswith("ETA after a few steps")
    assert lines[1].endswith("ETA 3 s") and lines[2].endswith("ETA 2 s")  # 6, 4 steps of 0.5 s


class _Terminal(io.StringIO):
    def isatty(self):
        return True


def test_on_a_terminal_the_loss_history_stays_on_screen_above_the_bar():
    stream = _Terminal()
    progress = Progress(10, stream=stream)
    for record in _records(10):
        progress.update(record["step"], record)
    progress.close()
    screen = stream.getvalue()
    for step in (2, 4, 6, 8, 10):
        assert f"step {step}/10 | loss" in screen
    assert "\r" in screen and "10/10" in screen  # the live bar, redrawn


def test_a_raised_train_steps_after_a_finished_run_says_the_schedule_restarts(tmp_path, capsys):
    overrides = [
        "runtime.cpu_devices=8",
        "mesh.data=8",
        "mesh.fsdp=1",
        "mesh.tensor=1",
        "checkpoint.every=0",
        f"train.run_dir={tmp_path}",
    ]
    cfg = config_lib.load_config(TINY_YAML, overrides + ["train.steps=4"])
    train_lib.train(cfg, checks_lib.validate(cfg, 8))
    capsys.readouterr()
    cfg = config_lib.load_config(TINY_YAML, overrides + ["train.steps=6"])
    train_lib.train(cfg, checks_lib.validate(cfg, 8))
    err = capsys.readouterr().err
    # tiny.yaml: lr 1e-2, warm-up 2, min ratio 0.1. Update 5 of 4 was past the end of the
    # cosine (1e-2 * 0.1); of 6 it is 3/4 of the way down: 1e-3 + 9e-3 * (1 + cos(0.75 pi)) / 2.
    assert "note: train.steps 4 -> 6 since the run was saved" in err, err
    assert "update 5 runs at 2.32e-03 where the saved schedule had 1.00e-03" in err
    # A run with nothing to do keeps the record: the next note still compares with lr 1e-2.
    cfg = config_lib.load_config(TINY_YAML, overrides + ["train.steps=6", "optimizer.lr=0.05"])
    assert train_lib.train(cfg, checks_lib.validate(cfg, 8))["first_loss"] is None
    assert config_lib.load_config(str(tmp_path / "config.yaml")).optimizer.lr == 1e-2


# --- Settings that can be found -----------------------------------------------------------------


def test_help_lists_every_setting_with_its_default_and_comment():
    done = subprocess.run(
        [sys.executable, "-m", "jaxpar.train", "--help"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=dict(os.environ, JAX_PLATFORMS="cpu"),
        timeout=60,
    )
    assert done.returncode == 0
    listed = {
        line.split("=")[0].strip()
        for line in done.stdout.splitlines()
        if line.startswith("  ") and "=" in line.split()[0]
    }
    keys = config_lib._all_keys(config_lib.Config)
    leaves = {k for k in keys if not any(other.startswith(k + ".") for other in keys)}
    assert leaves - listed == set() and len(leaves) > 60
    assert any(
        line.split()[:1] == ["train.steps=300"] and "optimizer steps" in line
        for line in done.stdout.splitlines()
    )
    assert "runtime.host_memory_gib=null" in done.stdout


def test_host_memory_gib_must_be_a_positive_number():
    for bad in ("0", "-1", ".nan"):
        cfg = config_lib.load_config(TINY_YAML, [f"runtime.host_memory_gib={bad}"])
        with pytest.raises(ConfigError, match="runtime.host_memory_gib=.*a positive number"):
            checks_lib.validate(cfg, 8)


def test_a_launch_too_big_for_the_machine_together_is_refused_before_any_process_starts():
    """Each of 2 processes would fit alone; together they do not (exit 3, nothing started)."""
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "jaxpar.launch",
            "--nproc",
            "2",
            TINY_YAML,
            "runtime.cpu_devices=1",
            "mesh.data=2",
            "mesh.fsdp=1",
            "mesh.tensor=1",
            "runtime.host_memory_gib=2.5",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
        env=dict(os.environ, JAX_PLATFORMS="cpu"),
    )
    assert done.returncode == 3, done.stderr
    assert "error: the 2 processes need about 2.8 GiB of host memory together" in done.stderr
    assert "process 0" not in done.stderr  # refused before the first fork


@pytest.mark.parametrize("argv", [["--train.steps=10"], ["configs/tiny.yaml", "--train.steps", "10"]])
def test_a_dashed_setting_is_told_to_drop_the_dashes(argv):
    with pytest.raises(ConfigError, match="settings are written without dashes") as e:
        config_lib.parse_cli(argv)
    assert "did you mean" not in str(e.value)
    if argv == ["--train.steps=10"]:
        assert "(e.g. train.steps=10)" in str(e.value)


def test_a_missing_preset_suggests_the_closest_one():
    with pytest.raises(
        ConfigError,
        match=r"configs/gpt2.yaml' does not exist; did you mean "
        r"'configs/gpt2-124m.yaml'\?",
    ):
        _in_root(lambda: config_lib.user_settings("configs/gpt2.yaml"))


def _in_root(fn):
    cwd = os.getcwd()
    os.chdir(ROOT)
    try:
        return fn()
    finally:
        os.chdir(cwd)


# --- inspect's FLOPs say what they count --------------------------------------------------------


def test_inspect_says_its_xla_flops_count_a_loop_body_once(tmp_path):
    """The note's claim, checked: doubling the layers (one scanned loop) doubles the model's
    FLOPs but barely moves XLA's count, whose figures are per device x devices."""
    from jaxpar.inspect import compile_step, format_human, report
    from jaxpar.run.train import build_trainer

    reports = {}
    for layers in (2, 4):
        cfg = config_lib.load_config(
            TINY_YAML, [f"model.n_layers={layers}", "mesh.data=2", "mesh.fsdp=1", "mesh.tensor=1"]
        )
        trainer = build_trainer(cfg, checks_lib.validate(cfg, 2), devices=jax.devices()[:2])
        reports[layers] = report(trainer, compile_step(trainer))
    two, four = reports[2], reports[4]
    assert four["model_flops_per_step"] > 1.5 * two["model_flops_per_step"]
    assert four["xla_flops_per_step"] < 1.2 * two["xla_flops_per_step"]
    assert two["xla_flops_per_step"] == 2 * two["xla_flops_per_device"]
    assert "counts a while loop's body once" in two["flops_note"]
    human = format_human(two)
    assert "FLOPs per step, all 2 device(s) together" in human and "per device;" in human


def test_profile_steps_write_a_trace_and_the_run_goes_on(tmp_path):
    import glob
    import gzip

    cfg = config_lib.load_config(
        TINY_YAML,
        [
            "runtime.cpu_devices=8",
            "mesh.data=8",
            "mesh.fsdp=1",
            "mesh.tensor=1",
            "train.steps=5",
            "train.profile_steps=[2, 3]",
            f"train.run_dir={tmp_path}",
        ],
    )
    summary = train_lib.train(cfg, checks_lib.validate(cfg, 8))
    assert summary["steps"] == 5
    traces = glob.glob(str(tmp_path / "profile" / "plugins" / "profile" / "*" / "*.trace.json.gz"))
    assert len(traces) == 1 and glob.glob(
        str(tmp_path / "profile" / "plugins" / "profile" / "*" / "*.xplane.pb")
    )
    events = json.load(gzip.open(traces[0]))["traceEvents"]
    assert any(e.get("name", "").startswith("PjitFunction(") for e in events)  # jitted calls traced
    with pytest.raises(ConfigError, match=r"train.profile_steps=\[4, 9\]: give \[first, last\]"):
        checks_lib.validate(
            config_lib.load_config(TINY_YAML, ["train.steps=5", "train.profile_steps=[4, 9]"]), 8
        )


def test_a_save_that_fails_only_when_the_checkpointer_closes_fails_the_run(tmp_path, monkeypatch):
    """orbax writes in the background: a failure can surface only at the final close. It must
    fail the run (here as a full disk, the one-line DiskFull), not end as a success."""
    import errno

    def failing_close(self):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(train_lib.checkpoint_lib.Checkpointer, "close", failing_close)
    cfg = config_lib.load_config(
        TINY_YAML,
        [
            "runtime.cpu_devices=8",
            "mesh.data=8",
            "mesh.fsdp=1",
            "mesh.tensor=1",
            "train.steps=2",
            f"train.run_dir={tmp_path}",
        ],
    )
    with pytest.raises(stopping.DiskFull):
        train_lib.train(cfg, checks_lib.validate(cfg, 8))
    assert not (tmp_path / "jaxpar.lock").exists()  # released all the same
