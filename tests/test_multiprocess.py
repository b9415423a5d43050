"""Several processes, one run: `python -m jaxpar.launch` against one process with all devices.

Two processes x 4 emulated CPU devices (gloo collectives over loopback) must train, checkpoint
and resume exactly like one process x 8 devices -- the same first-step gradients, leaf by leaf,
and the same losses and gradient norms -- and a process that dies must bring the whole launch
down with its exit code, in bounded time.
"""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from jaxpar.launch import launch
from tests.parity import TINY_YAML, assert_grads_match, assert_nonzero
from tests.test_train import ROOT

# With 4 devices per process, `data` crosses the processes; fsdp x tensor stay inside each.
TINY = [TINY_YAML, "mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2", "parallel.zero_stage=3"]
RUN = TINY + ["train.steps=4", "checkpoint.every=2"]
TRAIN = [sys.executable, "-m", "jaxpar.train"]

# `python -m jaxpar.train NPZ ARGS...` that also writes the gradients of its first step (gathered
# from every process; build_trainer(with_grads=True)) to NPZ, {leaf path: array}, from process 0.
KEEP_FIRST_GRADS = textwrap.dedent("""
    import sys
    import jax
    import numpy as np
    from jax.experimental import multihost_utils
    from jaxpar import train as train_lib

    npz, build = sys.argv[1], train_lib.build_trainer

    def build_keeping_first_grads(cfg, sizes, devices=None):
        trainer = build(cfg, sizes, devices, with_grads=True)
        step, kept = trainer.step, []

        def step_keeping_first_grads(state, batch):
            state, metrics, grads = step(state, batch)
            if not kept:
                kept.append(multihost_utils.process_allgather(grads, tiled=True) if jax.process_count() > 1
                            else jax.device_get(grads))
                flat, _ = jax.tree_util.tree_flatten_with_path(kept[0])
                if jax.process_index() == 0:
                    np.savez(npz, **{jax.tree_util.keystr(path, simple=True, separator="."):
                                     np.asarray(x) for path, x in flat})
            return state, metrics

        trainer.step = step_keeping_first_grads
        return trainer

    train_lib.build_trainer = build_keeping_first_grads
    sys.exit(train_lib.main(sys.argv[2:]))
""")


def keeping_first_grads(npz) -> list[str]:
    return [sys.executable, "-c", KEEP_FIRST_GRADS, str(npz)]


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    """The processes' environment. The compilation cache lets a rerun skip compiling: only
    process 0 of a multi-process run writes and finds entries (jax 0.10.2), which still helps."""
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               JAX_COMPILATION_CACHE_DIR=str(tmp_path_factory.mktemp("jax-cache")))
    env.pop("XLA_FLAGS", None)  # each process sets its own device count (runtime.cpu_devices)
    return env


def one_process(run_dir, *args, train=TRAIN):
    return [*train, *args, f"train.run_dir={run_dir}", "runtime.cpu_devices=8"]


def two_processes(run_dir, *args, grace=30, train=None):
    """`python -m jaxpar.launch --nproc 2`; with `train` (a command instead of `python -m
    jaxpar.train`), the same launch through `jaxpar.launch.launch(command=...)`."""
    tail = [*args, f"train.run_dir={run_dir}", "runtime.cpu_devices=4"]
    if train is None:
        return [sys.executable, "-m", "jaxpar.launch", "--nproc", "2", "--grace", str(grace), *tail]
    script = ("import sys; from jaxpar.launch import launch; "
              f"sys.exit(launch(2, command=sys.argv[1:], grace={grace}))")
    return [sys.executable, "-c", script, *train, *tail]


def run_side_by_side(env, *commands, timeout=300):
    """Runs the commands at once (the machine's cores overlap their start-up); returns stderrs."""
    procs = [subprocess.Popen(c, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for c in commands]
    try:
        errs = []
        for proc in procs:
            _, err = proc.communicate(timeout=timeout)
            assert proc.returncode == 0, err[-3000:]
            errs.append(err)
        return errs
    finally:
        for proc in procs:  # a launcher's processes die with it
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def losses(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return {r["step"]: r["loss"] for r in map(json.loads, f)}


def committed_steps(run_dir):
    path = os.path.join(run_dir, "checkpoints")
    return sorted(int(n) for n in os.listdir(path) if n.isdigit()
                  and os.path.exists(os.path.join(path, n, "jaxpar_manifest.json")))


def grad_norms(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return {r["step"]: r["grad_norm"] for r in map(json.loads, f)}


@pytest.fixture(scope="module")
def runs(tmp_path_factory, env):
    """4 steps (checkpoints at 2 and 4) as 1 process x 8 devices and as 2 processes x 4, each
    keeping its first step's gradients in <run>.npz."""
    root = tmp_path_factory.mktemp("multiprocess")
    run_side_by_side(env, one_process(root / "one", *RUN, train=keeping_first_grads(root / "one.npz")),
                     two_processes(root / "two", *RUN, train=keeping_first_grads(root / "two.npz")))
    return root


def test_two_processes_match_one_process(runs):
    with np.load(runs / "one.npz") as one, np.load(runs / "two.npz") as two:
        want_grads, got_grads = dict(one), dict(two)
    assert_nonzero(want_grads)
    assert_grads_match(got_grads, want_grads)
    want, got = losses(runs / "one"), losses(runs / "two")
    assert sorted(got) == [1, 2, 3, 4]  # written once, by process 0
    np.testing.assert_allclose([got[s] for s in got], [want[s] for s in got], rtol=1e-5)
    want_norms, got_norms = grad_norms(runs / "one"), grad_norms(runs / "two")
    np.testing.assert_allclose([got_norms[s] for s in got], [want_norms[s] for s in got], rtol=1e-5)
    assert committed_steps(runs / "two") == [2, 4]
    for process in (0, 1):  # one checkpoint, written by both processes
        assert any((runs / "two" / "checkpoints" / "4" / "params" / f"ocdbt.process_{process}" / "d").iterdir())


def test_two_process_checkpoint_resumes_on_two_processes_and_on_one(runs, env, tmp_path):
    again, single = tmp_path / "again", tmp_path / "single"
    shutil.copytree(runs / "two", again)
    shutil.rmtree(again / "checkpoints" / "4")  # the launch resumes from step 2
    shutil.copytree(runs / "two" / "checkpoints" / "2", single / "checkpoints" / "2")
    errs = run_side_by_side(env, two_processes(again, *RUN), one_process(single, *RUN))
    assert all("resumed from step 2" in err for err in errs)
    want = losses(runs / "two")
    assert sorted(losses(again)) == [1, 2, 3, 4]
    for run_dir in (again, single):
        got = losses(run_dir)
        np.testing.assert_allclose([got[3], got[4]], [want[3], want[4]], rtol=1e-5)


def _wait_for(predicate, proc, what, timeout=240):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert proc.poll() is None, f"the launcher exited ({proc.returncode}) before {what}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def _child_pids(launcher_err):
    """{process index: pid}, from the launcher's line 'jaxpar.launch: 2 processes, coordinator
    ...: process 0 pid P0, process 1 pid P1'."""
    pairs = re.findall(r"process (\d+) pid (\d+)", launcher_err.read_text())
    return {int(index): int(pid) for index, pid in pairs}


def test_a_killed_process_stops_the_launch_with_its_exit_code(env, tmp_path):
    err_path = tmp_path / "launch.err"
    with open(err_path, "w") as err:
        launcher = subprocess.Popen(
            two_processes(tmp_path / "run", *TINY, "train.steps=100000", "checkpoint.every=0", grace=5),
            cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=err)
    try:
        _wait_for(lambda: (tmp_path / "run" / "metrics.jsonl").exists(), launcher, "training started")
        pids = _child_pids(err_path)
        os.kill(pids[1], signal.SIGKILL)
        killed_at = time.monotonic()
        assert launcher.wait(timeout=60) == 128 + signal.SIGKILL
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert time.monotonic() - killed_at < 60
    report = err_path.read_text()
    assert f"process 1 (pid {pids[1]}) failed: killed by SIGKILL (exit code 137)" in report
    assert "last 40 lines of process 1:" in report
    assert not os.path.exists(f"/proc/{pids[0]}")  # process 0 was stopped too


# The launcher's own bookkeeping, with stand-in processes instead of training (no JAX).

CHILD = textwrap.dedent("""
    import os, pathlib, signal, sys, time
    failing, ready = int(sys.argv[1]), pathlib.Path(sys.argv[2])
    index, count = int(os.environ["JAXPAR_PROCESS_ID"]), int(os.environ["JAXPAR_NUM_PROCESSES"])
    signal.signal(signal.SIGTERM, lambda *_: (print(f"{index}: SIGTERM", flush=True), sys.exit(0)))
    print(f"process {index} of {count} at {os.environ['JAXPAR_COORDINATOR']}", flush=True)
    (ready / str(index)).touch()
    deadline = time.monotonic() + 60
    while len(list(ready.iterdir())) < count and time.monotonic() < deadline:
        time.sleep(0.05)
    if index == failing:
        print("\\n".join(f"line {i}" for i in range(100)), flush=True)
        sys.exit(3)
    time.sleep(60)
""")


def _children(failing, ready_dir):
    """Stand-in processes: each notes it is ready; `failing` then exits 3, the rest wait."""
    ready_dir.mkdir()
    return [sys.executable, "-c", CHILD, str(failing), str(ready_dir)]


def test_the_first_failure_gives_the_exit_code_and_its_last_lines(tmp_path, capsys):
    start = time.monotonic()
    code = launch(3, command=_children(2, tmp_path / "ready"), tail_lines=5, grace=10)
    assert code == 3 and time.monotonic() - start < 30
    out, err = capsys.readouterr()
    assert "process 0 of 3 at 127.0.0.1:" in out and "0: SIGTERM" in out  # process 0 passes through
    assert "process 2 (pid " in err and "failed: exit code 3" in err
    assert err.endswith("last 5 lines of process 2:\nline 95\nline 96\nline 97\nline 98\nline 99\n")


def test_sigterm_to_the_launcher_reaches_every_process_once(tmp_path):
    script = ("import sys; from jaxpar.launch import launch; "
              f"sys.exit(launch(2, command={_children(-1, tmp_path / 'ready')!r}))")
    launcher = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
    _wait_for(lambda: len(os.listdir(tmp_path / "ready")) == 2, launcher, "the processes", timeout=30)
    launcher.send_signal(signal.SIGTERM)
    out, err = launcher.communicate(timeout=30)
    assert launcher.returncode == 0, err
    assert out.count("0: SIGTERM") == 1 and "forwarding SIGTERM" in err
