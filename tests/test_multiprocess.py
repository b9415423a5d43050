"""Several processes, one run: `python -m jaxpar.launch` against one process with all devices.

Two processes x 4 emulated CPU devices (gloo collectives over loopback) must train, checkpoint
and resume exactly like one process x 8 devices -- the same first-step gradients, leaf by leaf,
and the same losses and gradient norms. A process that dies must bring the whole launch down with
its exit code, in bounded time; with --max-restarts, all processes start again from the last
checkpoint and finish with the losses of an unbroken run.
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

from jaxpar import config as config_lib
from jaxpar.launch import Resumption, launch, parse_args
from tests.parity import TINY_YAML, assert_grads_match, assert_nonzero
from tests.test_train import ROOT

# With 4 devices per process, `data` crosses the processes; fsdp x tensor stay inside each.
TINY = [TINY_YAML, "mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2", "parallel.zero_stage=3"]
RUN = TINY + ["train.steps=4", "checkpoint.every=2"]
TRAIN = [sys.executable, "-m", "jaxpar.train"]

# `python -m jaxpar.train NPZ ARGS...` that also writes the gradients of its first step (gathered
# from every process; Trainer.step_with_grads) to NPZ, {leaf path: array}, from process 0.
KEEP_FIRST_GRADS = textwrap.dedent("""
    import sys
    import jax
    import numpy as np
    from jax.experimental import multihost_utils
    from jaxpar.run import train as train_lib

    npz, build = sys.argv[1], train_lib.build_trainer

    def build_keeping_first_grads(cfg, sizes, devices=None):
        trainer = build(cfg, sizes, devices)
        step, kept = trainer.step_with_grads, []

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


# `python -m jaxpar.train HELD ARGS...` whose process 1, on a launch's first attempt
# (JAXPAR_RESTART_COUNT=0), stops before step 3 once checkpoint 2 is committed, touches HELD and
# waits to be killed: a kill between a committed checkpoint and the end of the run, every time.
HOLD_AT_STEP_3 = textwrap.dedent("""
    import os, sys, time
    import jax
    from jaxpar.run import train as train_lib

    held, build = sys.argv[1], train_lib.build_trainer

    def build_holding_at_step_3(cfg, sizes, devices=None):
        trainer = build(cfg, sizes, devices)
        step, calls = trainer.step, []
        committed = os.path.join(cfg.train.run_dir, "checkpoints", "2", "jaxpar_manifest.json")

        def step_holding(state, batch):
            calls.append(1)
            if (len(calls) == 3 and jax.process_index() == 1
                    and os.environ["JAXPAR_RESTART_COUNT"] == "0"):
                while not os.path.exists(committed):
                    time.sleep(0.05)
                open(held, "w").close()
                time.sleep(600)
            return step(state, batch)

        trainer.step = step_holding
        return trainer

    train_lib.build_trainer = build_holding_at_step_3
    sys.exit(train_lib.main(sys.argv[2:]))
""")


def holding_at_step_3(held) -> list[str]:
    return [sys.executable, "-c", HOLD_AT_STEP_3, str(held)]


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    """The processes' environment. The compilation cache lets a rerun skip compiling: only
    process 0 of a multi-process run writes and finds entries (jax 0.10.2), which still helps."""
    env = dict(
        os.environ, JAX_PLATFORMS="cpu", JAX_COMPILATION_CACHE_DIR=str(tmp_path_factory.mktemp("jax-cache"))
    )
    return env


def one_process(run_dir, *args, train=TRAIN):
    return [*train, *args, f"train.run_dir={run_dir}", "runtime.cpu_devices=8"]


def two_processes(run_dir, *args, grace=30, max_restarts=0, train=None):
    """`python -m jaxpar.launch --nproc 2`; with `train` (a command instead of `python -m
    jaxpar.train`), the same launch through `jaxpar.launch.launch(command=...)`."""
    tail = [*args, f"train.run_dir={run_dir}", "runtime.cpu_devices=4"]
    if train is None:
        return [
            sys.executable,
            "-m",
            "jaxpar.launch",
            "--nproc",
            "2",
            "--grace",
            str(grace),
            "--max-restarts",
            str(max_restarts),
            *tail,
        ]
    n = 1 + len(train)  # sys.argv = ["-c", *train, *tail]
    script = (
        "import sys; from jaxpar.launch import launch; "
        f"sys.exit(launch(2, sys.argv[{n}:], command=sys.argv[1:{n}], grace={grace}, "
        f"max_restarts={max_restarts}))"
    )
    return [sys.executable, "-c", script, *train, *tail]


def run_side_by_side(env, *commands, timeout=300):
    """Runs the commands at once (the machine's cores overlap their start-up); returns stderrs."""
    procs = [
        subprocess.Popen(c, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for c in commands
    ]
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
    return sorted(
        int(n)
        for n in os.listdir(path)
        if n.isdigit() and os.path.exists(os.path.join(path, n, "jaxpar_manifest.json"))
    )


def grad_norms(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return {r["step"]: r["grad_norm"] for r in map(json.loads, f)}


@pytest.fixture(scope="module")
def runs(tmp_path_factory, env):
    """4 steps (checkpoints at 2 and 4) as 1 process x 8 devices and as 2 processes x 4, each
    keeping its first step's gradients in <run>.npz."""
    root = tmp_path_factory.mktemp("multiprocess")
    run_side_by_side(
        env,
        one_process(root / "one", *RUN, train=keeping_first_grads(root / "one.npz")),
        two_processes(root / "two", *RUN, train=keeping_first_grads(root / "two.npz")),
    )
    return root


def test_two_processes_match_one_process(runs):
    with np.load(runs / "one.npz") as one, np.load(runs / "two.npz") as two:
        want_grads, got_grads = dict(one), dict(two)
    assert_nonzero(want_grads)
    assert_grads_match(got_grads, want_grads)
    want, got = losses(runs / "one"), losses(runs / "two")
    assert sorted(got) == [1, 2, 3, 4]  # written once, by process 0
    # Four AdamW steps of the float32 tiny model at rate 1e-2, its loss falling smoothly: the
    # same mesh split over two processes changes only the order of the cross-device sums, which
    # such steps do not amplify (another layout of the same run stays within 1.3e-7 over six
    # steps: tests/test_resume.py), so 1e-5 is far from rounding and near any wrong gradient.
    np.testing.assert_allclose([got[s] for s in got], [want[s] for s in got], rtol=1e-5)
    want_norms, got_norms = grad_norms(runs / "one"), grad_norms(runs / "two")
    np.testing.assert_allclose([got_norms[s] for s in got], [want_norms[s] for s in got], rtol=1e-5)
    assert committed_steps(runs / "two") == [2, 4]
    for process in (0, 1):  # one checkpoint, written by both processes
        assert any(
            (runs / "two" / "checkpoints" / "4" / "params" / f"ocdbt.process_{process}" / "d").iterdir()
        )


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


def test_a_killed_process_restarts_the_launch_from_the_last_checkpoint(runs, env, tmp_path):
    """--max-restarts 1, process 1 SIGKILLed at step 3 of 4 (checkpoint 2 committed): the launch
    restarts both processes, which resume from step 2 and end with the unbroken run's losses.
    Equal losses alone would not show a restart that started over (the run is deterministic):
    process 0 must also say it resumed from step 2, and metrics.jsonl hold each step once."""
    run_dir, held, err_path = tmp_path / "run", tmp_path / "held", tmp_path / "launch.err"
    with open(err_path, "w") as err:
        launcher = subprocess.Popen(
            two_processes(run_dir, *RUN, grace=5, max_restarts=1, train=holding_at_step_3(held)),
            cwd=ROOT,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=err,
        )
    try:
        _wait_for(held.exists, launcher, "process 1 to hold before step 3")
        pids = _child_pids(err_path)
        os.kill(pids[1], signal.SIGKILL)
        assert launcher.wait(timeout=240) == 0, err_path.read_text()[-3000:]
    finally:
        if launcher.poll() is None:
            launcher.kill()
    report = err_path.read_text()
    assert f"process 1 (pid {pids[1]}) failed: killed by SIGKILL (exit code 137)" in report
    assert "last 40 lines of process 1:" in report
    assert (
        f"restart 1 of 1: process 1 (pid {pids[1]}) failed: killed by SIGKILL (exit code 137); "
        f"starting all 2 processes again from step 2, the newest complete checkpoint in "
        f"{run_dir / 'checkpoints'}\n"
    ) in report
    assert report.count("resumed from step 2") == 1  # process 0 of the restart, not a fresh start
    assert report.rstrip().endswith("all 2 processes finished after 1 restart (--max-restarts 1)")
    assert not os.path.exists(f"/proc/{pids[0]}")  # the first attempt's process 0 was stopped
    with open(run_dir / "metrics.jsonl") as f:
        assert [json.loads(line)["step"] for line in f] == [1, 2, 3, 4]
    want, got = losses(runs / "two"), losses(run_dir)
    np.testing.assert_allclose([got[s] for s in got], [want[s] for s in got], rtol=1e-5)
    assert committed_steps(run_dir) == [2, 4]


# A real Slurm job: examples/slurm/train.sbatch, submitted to a one-node cluster on this machine.

SBATCH = os.path.join(ROOT, "examples", "slurm", "train.sbatch")


def slurm_problem() -> str | None:
    """Why no Slurm job can run here, or None. `.ci/run` starts a cluster (.ci/slurm-up) and sets
    JAXPAR_TESTS_REQUIRE_SLURM=1, which turns this reason from a skip into a failure."""
    if shutil.which("sbatch") is None or shutil.which("sinfo") is None:
        return "no Slurm here (sbatch, sinfo); .ci/slurm-up starts a one-node cluster (root, apt-get)"
    try:
        states = subprocess.run(
            ["sinfo", "-h", "-o", "%T"], capture_output=True, text=True, timeout=30
        ).stdout.split()
    except subprocess.TimeoutExpired:
        return "sinfo does not answer; .ci/slurm-up starts a one-node cluster"
    if not {"idle", "mixed", "allocated"} & set(states):
        return f"no Slurm node takes jobs (sinfo: {states or 'no answer'}); .ci/slurm-up starts one"
    if not os.path.exists(os.path.join(sys.prefix, "bin", "activate")):
        return f"the tests' Python ({sys.prefix}) is not a virtual environment the job can activate"
    return None


def test_the_slurm_example_matches_one_process(runs, env, tmp_path):
    """`sbatch examples/slurm/train.sbatch` as 2 tasks x 4 CPU devices on one node. Nothing but
    Slurm's environment tells the processes who they are (no JAXPAR_* variables, no coordinator
    setting): each must report joining a 2-process run through jax's cluster detection, and the
    run must give the 1-process 8-device run's losses and gradient norms (a gradient off by a
    factor shows in the norm of step 1, and in every later loss)."""
    problem = slurm_problem()
    if problem:
        if os.environ.get("JAXPAR_TESTS_REQUIRE_SLURM"):
            pytest.fail(problem)
        pytest.skip(problem)
    run_dir, out, name = tmp_path / "run", tmp_path / "job.out", f"jaxpar-test-{os.getpid()}"
    job_env = {k: v for k, v in env.items() if not k.startswith(("JAXPAR_", "SLURM_"))}
    job_env["JAXPAR_VENV"] = sys.prefix
    batch = config_lib.load_config(TINY_YAML, []).train.batch_size
    command = [
        "sbatch",
        "--wait",
        f"--job-name={name}",
        f"--output={out}",
        "--time=10",
        "--nodes=1",
        "--ntasks-per-node=2",
        "--cpus-per-task=1",
        "--gpus-per-node=0",
        SBATCH,
        TINY_YAML,
        "runtime.cpu_devices=4",
        *RUN[1:],
        f"train.batch_size={batch}",
        f"train.run_dir={run_dir}",
    ]
    try:
        job = subprocess.run(command, cwd=ROOT, env=job_env, capture_output=True, text=True, timeout=420)
    except subprocess.TimeoutExpired:
        subprocess.run(["scancel", f"--name={name}"], timeout=30)
        pytest.fail(
            f"the Slurm job did not finish in 420 s:\n{out.read_text()[-3000:] if out.exists() else ''}"
        )
    log = out.read_text() if out.exists() else ""
    assert job.returncode == 0, f"{job.stdout}{job.stderr}\n{log[-3000:]}"
    for process in (0, 1):
        assert f"jaxpar: process {process} of 2 (found by jax's cluster detection), 4 local devices" in log
    assert "8 devices (data=2 fsdp=2 tensor=2)" in log
    want, got = losses(runs / "one"), losses(run_dir)
    assert sorted(got) == [1, 2, 3, 4]
    np.testing.assert_allclose([got[s] for s in got], [want[s] for s in got], rtol=1e-5)
    want_norms, got_norms = grad_norms(runs / "one"), grad_norms(run_dir)
    np.testing.assert_allclose([got_norms[s] for s in got], [want_norms[s] for s in got], rtol=1e-5)
    assert committed_steps(run_dir) == [2, 4]


# The launcher's own bookkeeping, with stand-in processes instead of training (no JAX).

CHILD = textwrap.dedent("""
    import os, pathlib, signal, sys, time
    failing, ready, term_code = int(sys.argv[1]), pathlib.Path(sys.argv[2]), int(sys.argv[3])
    index, count = int(os.environ["JAXPAR_PROCESS_ID"]), int(os.environ["JAXPAR_NUM_PROCESSES"])
    signal.signal(signal.SIGTERM, lambda *_: (print(f"{index}: SIGTERM", flush=True), sys.exit(term_code)))
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


def _children(failing, ready_dir, term_code=0):
    """Stand-in processes: each notes it is ready; `failing` then exits 3, the rest wait (and
    exit `term_code` on SIGTERM)."""
    ready_dir.mkdir()
    return [sys.executable, "-c", CHILD, str(failing), str(ready_dir), str(term_code)]


def test_the_first_failure_gives_the_exit_code_and_its_last_lines(tmp_path, capsys):
    start = time.monotonic()
    code = launch(3, command=_children(2, tmp_path / "ready"), tail_lines=5, grace=10)
    assert code == 3 and time.monotonic() - start < 30
    out, err = capsys.readouterr()
    assert "process 0 of 3 at 127.0.0.1:" in out and "0: SIGTERM" in out  # process 0 passes through
    assert "process 2 (pid " in err and "failed: exit code 3" in err
    assert err.endswith("last 5 lines of process 2:\nline 95\nline 96\nline 97\nline 98\nline 99\n")


@pytest.mark.parametrize("term_code, max_restarts", [(0, 0), (1, 1)])
def test_sigterm_to_the_launcher_reaches_every_process_once(tmp_path, term_code, max_restarts):
    """A stop the user asks for is no failure to restart, even where the processes then exit
    non-zero (term_code): the launcher exits with their code, after one attempt."""
    script = (
        "import sys; from jaxpar.launch import launch; "
        f"sys.exit(launch(2, command={_children(-1, tmp_path / 'ready', term_code)!r}, "
        f"max_restarts={max_restarts}))"
    )
    launcher = subprocess.Popen(
        [sys.executable, "-c", script], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    _wait_for(lambda: len(os.listdir(tmp_path / "ready")) == 2, launcher, "the processes", timeout=30)
    launcher.send_signal(signal.SIGTERM)
    out, err = launcher.communicate(timeout=30)
    assert launcher.returncode == term_code, err
    assert out.count("0: SIGTERM") == 1 and "forwarding SIGTERM" in err
    assert "restart 1" not in err and err.count("processes, coordinator") == 1
    if max_restarts:
        assert err.rstrip().endswith(
            "not restarting: a stop was requested (SIGTERM) (0 of --max-restarts 1 used); exit code 1"
        )


# Stand-in processes for restarts: on attempt k (JAXPAR_RESTART_COUNT), process 0 prints its
# arguments and coordinator, then ends as CODES[k] says (the last entry for later attempts): an
# exit code, or "kill" (SIGKILL). The others wait to be stopped, or exit 0 with process 0.
ATTEMPT = textwrap.dedent("""
    import os, signal, sys, time
    codes = sys.argv[1].split(",")
    index, restart = int(os.environ["JAXPAR_PROCESS_ID"]), int(os.environ["JAXPAR_RESTART_COUNT"])
    code = codes[min(restart, len(codes) - 1)]
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    if index == 0:
        print(f"attempt {restart} at {os.environ['JAXPAR_COORDINATOR']} with {sys.argv[2:]}", flush=True)
        if code == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        sys.exit(int(code))
    if code != "0":
        time.sleep(60)
""")


def _attempts(codes):
    return [sys.executable, "-c", ATTEMPT, codes]


def test_restarts_take_a_new_port_until_used_up_then_give_the_last_failures_code(capsys):
    """Catches: restarting more (or fewer) times than asked, the first failure's code instead of
    the last one's (torchrun returns the last), one coordinator port for every attempt."""
    assert launch(2, command=_attempts("4,kill,5,0"), max_restarts=2, grace=10) == 5
    out, err = capsys.readouterr()
    attempts = re.findall(r"attempt (\d) at 127\.0\.0\.1:(\d+)", out)
    assert [k for k, _ in attempts] == ["0", "1", "2"]
    assert len({port for _, port in attempts}) > 1  # fresh free ports (equal by chance: ~1e-9)
    first, second = re.findall(
        r"restart (\d) of 2: process 0 \(pid \d+\) failed: ([^;]*); "
        r"starting all 2 processes again from the newest complete "
        r"checkpoint \(if any\)\n",
        err,
    )
    assert first == ("1", "exit code 4") and second == ("2", "killed by SIGKILL (exit code 137)")
    assert "restart 3" not in err
    assert err.rstrip().endswith(
        "not restarting: no restarts are left (2 of --max-restarts 2 used); exit code 5"
    )


def test_a_run_too_big_for_the_machine_is_not_restarted(capsys):
    """Exit code 3 is jaxpar.planning.host's refusal: the memory forecast would refuse the restart too."""
    assert launch(2, command=_attempts("3,0"), max_restarts=2, grace=10) == 3
    out, err = capsys.readouterr()
    assert "restart 1" not in err and "attempt 1" not in out
    assert err.rstrip().endswith(
        "not restarting: exit code 3 is a run too big for this machine's "
        "memory, which a restart would repeat (0 of --max-restarts 2 used); exit code 3"
    )


def test_a_configuration_error_is_not_restarted(capsys):
    """Exit code 2 is jaxpar's configuration error: a restart would fail the same way."""
    assert launch(2, command=_attempts("4,2,0"), max_restarts=3, grace=10) == 2
    out, err = capsys.readouterr()
    assert "restart 1 of 3" in err and "restart 2" not in err and "attempt 2" not in out
    assert err.rstrip().endswith(
        "not restarting: exit code 2 is a configuration error, which a "
        "restart would repeat (1 of --max-restarts 3 used); exit code 2"
    )


def test_without_restarts_a_killed_process_stops_the_launch_with_its_exit_code(capsys):
    assert launch(2, command=_attempts("kill,0"), grace=10) == 128 + signal.SIGKILL
    out, err = capsys.readouterr()
    assert "attempt 1" not in out and "restart" not in err
    assert err.endswith("failed: killed by SIGKILL (exit code 137)\njaxpar.launch: its output is above\n")


def test_a_restart_resumes_from_the_newest_complete_checkpoint(tmp_path, capsys):
    """The restart line names the newest committed checkpoint with a manifest (not an unfinished
    save, not a directory without jaxpar's manifest), and a command's train.resume=never or step
    becomes auto for the restarts -- or never while there is no checkpoint to resume from."""
    run_dir = tmp_path / "run"
    for name in ("2", "4", "6.orbax-checkpoint-tmp-1700000000"):
        (run_dir / "checkpoints" / name).mkdir(parents=True)
    for name in ("2", "6.orbax-checkpoint-tmp-1700000000"):
        (run_dir / "checkpoints" / name / "jaxpar_manifest.json").write_text("{}")
    args = [f"train.run_dir={run_dir}", "train.resume=never"]
    assert launch(2, args, command=_attempts("4,0"), max_restarts=1, grace=10) == 0
    out, err = capsys.readouterr()
    assert re.findall(r"attempt \d at \S+ with (.*)", out) == [str(args), str([*args, "train.resume=auto"])]
    assert re.search(
        r"restart 1 of 1: process 0 \(pid \d+\) failed: exit code 4; starting all 2 "
        r"processes again from step 2, the newest complete checkpoint in "
        + re.escape(str(run_dir / "checkpoints"))
        + r" \(train\.resume=auto instead of "
        r"the command's train\.resume=never: ",
        err,
    )
    assert err.rstrip().endswith("all 2 processes finished after 1 restart (--max-restarts 1)")
    for resume, want in [("auto", []), ("2", ["train.resume=auto"])]:
        assert Resumption.plan(str(run_dir), resume).extra_args == want
    empty = tmp_path / "empty"
    for resume, want in [("auto", ["train.resume=never"]), ("never", [])]:
        plan = Resumption.plan(str(empty), resume)
        assert (plan.step, plan.extra_args) == (None, want) and "from step 0" in plan.where
    assert Resumption.plan(None, "never").extra_args == []  # a command the launcher cannot read


def test_the_command_line_takes_max_restarts():
    assert parse_args(["--nproc", "2", "--max-restarts", "3", "train.steps=4"]).max_restarts == 3
    assert parse_args(["--nproc", "2", "train.steps=4"]).max_restarts == 0
    with pytest.raises(SystemExit):
        parse_args(["--nproc", "2", "--max-restarts", "-1"])


# `python -m jaxpar.train OUT ARGS...` that writes, per process, how many loop steps polled for a
# stop and how many of those polls were an all-gather across the processes, to OUT.<process>.
COUNT_STOP_POLLS = textwrap.dedent("""
    import json, sys
    import jax
    from jaxpar.run import stopping
    from jaxpar.run import train as train_lib

    out, leave = sys.argv[1], stopping.Preemption.__exit__

    def leave_recording(self, *exc):
        with open(f"{out}.{jax.process_index()}", "w") as f:
            json.dump({"polls": self.polls, "agreements": self.agreements}, f)
        return leave(self, *exc)

    stopping.Preemption.__exit__ = leave_recording
    sys.exit(train_lib.main(sys.argv[2:]))
""")


def test_steps_that_read_nothing_from_the_device_do_not_wait_on_the_host(env, tmp_path):
    """Agreeing on a stop is a blocking all-gather across processes, which would stall the
    queue of dispatched steps on GPUs: 12 steps, logged and saved only at the last, agree at
    step 10 (Preemption.POLL_EVERY) and 12 only, on both processes."""
    out = tmp_path / "polls"
    command = two_processes(
        tmp_path / "run",
        *TINY,
        "train.steps=12",
        "train.log_every=100",
        "checkpoint.every=0",
        train=[sys.executable, "-c", COUNT_STOP_POLLS, str(out)],
    )
    run_side_by_side(env, command)
    for process in (0, 1):
        assert json.loads((tmp_path / f"polls.{process}").read_text()) == {"polls": 12, "agreements": 2}
    assert sorted(losses(tmp_path / "run")) == [12]


# --- A coordinator that never comes up (issue 40) -------------------------------------------------


def test_a_coordinator_that_never_comes_up_is_one_line_and_exit_2_after_the_timeout(env, tmp_path):
    """Bug: process 1 of a run whose coordinator never came up printed nothing for 300 s, then
    jax.distributed aborted it from C++ (a stack trace, exit 134). Now it says at once what it
    waits for and how long (distributed.timeout_s), and ends after that with one line, exit 2."""
    from jaxpar.launch import free_port

    address = f"127.0.0.1:{free_port()}"  # nobody listens there
    proc = subprocess.Popen(
        [
            *TRAIN,
            TINY_YAML,
            f"distributed.coordinator={address}",
            "distributed.num_processes=2",
            "distributed.process_id=1",
            "distributed.timeout_s=3",
            "runtime.cpu_devices=1",
            f"train.run_dir={tmp_path / 'run'}",
        ],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    first = proc.stderr.readline()
    said = time.monotonic()
    _, rest = proc.communicate(timeout=120)
    assert first.startswith(
        f"jaxpar: process 1 of 2: waiting up to 3 s (distributed.timeout_s) for the coordinator at {address}"
    )
    assert proc.returncode == 2 and time.monotonic() - said > 2.5, rest
    lines = rest.strip().splitlines()
    assert len(lines) == 1 and "Check failure" not in rest and "Traceback" not in rest, rest
    assert lines[0].startswith(
        f"config error: process 1 of 2: nothing answered at the coordinator's address {address} "
        "within 3 s (distributed.timeout_s)"
    )
    assert not (tmp_path / "run").exists()


def test_a_timed_out_start_says_who_was_missing():
    """The timeout's line tells a coordinator that answered from one that did not, and speaks
    for process 0 as the coordinator; distributed.timeout_s must be a positive number."""
    import socket

    from jaxpar import mesh
    from jaxpar.config import ConfigError, DistributedConfig

    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        address = f"127.0.0.1:{listening.getsockname()[1]}"
        dist = DistributedConfig(coordinator=address, num_processes=3, process_id=2, timeout_s=7)
        assert mesh.timeout_message(dist).startswith(
            f"process 2 of 3: the coordinator at {address} is up, but not all 3 processes "
            "(distributed.num_processes) joined within 7 s"
        )
    first = DistributedConfig(coordinator=address, num_processes=3, process_id=0, timeout_s=7)
    assert mesh.timeout_message(first).startswith(
        f"process 0 of 3 (the coordinator, at {address}): not all 3"
    )
    assert "for the other 2 processes to join" in mesh.waiting_line(first)
    with pytest.raises(ConfigError, match="distributed.timeout_s=0: give the seconds"):
        mesh.start_distributed(
            DistributedConfig(coordinator=address, num_processes=2, process_id=1, timeout_s=0)
        )
