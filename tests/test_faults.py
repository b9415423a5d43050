"""Nothing lost, nothing silent: a run directory holds one run, one run at a time; a full disk,
a Ctrl-C at any moment and bad input each end in one clear line and the right exit code."""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid

import pytest

from jaxpar import checks as checks_lib
from jaxpar import config as config_lib
from jaxpar.config import ConfigError
from jaxpar.corpus import data as data_lib
from jaxpar.corpus import sources as sources_lib
from jaxpar.run import rundir
from jaxpar.run.train import train
from jaxpar.training.checkpoint import CheckpointWarning, manifest_problem
from tests.test_train import ROOT

TINY_YAML = os.path.join(ROOT, "configs", "tiny.yaml")
ONE_LAYOUT = ["mesh.data=8", "mesh.fsdp=1", "mesh.tensor=1"]


def metrics_steps(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line)["step"] for line in f]


def losses(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return {r["step"]: r["loss"] for r in map(json.loads, f)}


def tiny(run_dir, *extra):
    cfg = config_lib.load_config(TINY_YAML, ONE_LAYOUT + [f"train.run_dir={run_dir}", *extra])
    return cfg, checks_lib.validate(cfg, 8)


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A 4-step run on a relative data path, checkpoints at 2 and 4 (a template: tests copy it)."""
    work = tmp_path_factory.mktemp("finished")
    (work / "corpus").mkdir()
    for i in range(3):
        (work / "corpus" / f"{i}.txt").write_text(
            open(os.path.join(ROOT, "jaxpar", "train.py")).read()[i * 3000 : (i + 1) * 3000]
        )
    cwd = os.getcwd()
    os.chdir(work)  # the run names its corpus relative to here
    try:
        cfg, sizes = tiny(
            "run", "train.steps=4", "checkpoint.every=2", "checkpoint.keep=0", "data.source=corpus/*.txt"
        )
        train(cfg, sizes)
    finally:
        os.chdir(cwd)
    return work / "run"


def copy_of(finished, tmp_path):
    shutil.copytree(finished, tmp_path / "run")
    return tmp_path / "run"


# --- A run directory is one run's history ---------------------------------------------------------


def history(metrics=None, checkpoints=(), unfinished=(), files=("config.yaml",), run_dir="/r"):
    files = list(files) + (["metrics.jsonl"] if metrics is not None else [])
    return rundir.History(run_dir, files, metrics, list(checkpoints), list(unfinished))


def test_the_rules_of_a_used_run_directory():
    intact = lambda step: None
    # Unused (a config.yaml alone is no history): a fresh run, nothing moved.
    assert rundir.plan("auto", history(), intact) == rundir.Start(None, [], [])
    assert rundir.plan("never", history(), intact) == rundir.Start(None, [], [])
    # auto resumes from the newest intact checkpoint, warning about each newer one it skips.
    with pytest.warns(CheckpointWarning, match="step 30 .* is unusable: garbled"):
        start = rundir.plan("auto", history(35, [10, 20, 30]), lambda s: "garbled" if s == 30 else None)
    assert start == rundir.Start(20, [], [])
    # ... and refuses when there is history but nothing to resume from.
    with pytest.raises(
        ConfigError,
        match=r"metrics up to step 35\) but nothing to resume from: no "
        r"checkpoint was written .*train.resume=never",
    ):
        rundir.plan("auto", history(35), intact)
    with (
        pytest.warns(CheckpointWarning),
        pytest.raises(ConfigError, match=r"step 20: bad; step 10: bad\. To start over"),
    ):
        rundir.plan("auto", history(25, [10, 20]), lambda s: "bad")
    with (
        pytest.warns(CheckpointWarning, match="never committed"),
        pytest.raises(ConfigError, match="step 10: its save never committed"),
    ):
        rundir.plan("auto", history(None, [], [10]), intact)


def test_resume_never_and_resume_at_a_step_move_what_they_replace(tmp_path):
    run = tmp_path / "run"
    (run / "checkpoints" / "10").mkdir(parents=True)
    (run / "checkpoints" / "20").mkdir()
    (run / "checkpoints" / "30.orbax-checkpoint-tmp-123").mkdir()
    (run / "metrics.jsonl").write_text('{"step": 25, "loss": 1.0}\n')
    (run / "events.out.tfevents.1.host").write_text("x")
    (run / "notes.txt").write_text("the user's own file")
    found = rundir.survey(run)
    assert (found.checkpoints, found.unfinished, found.metrics_last_step) == ([10, 20], [30], 25)
    # resume=10: the later checkpoints (committed or not) are moved; metrics.jsonl is copied.
    start = rundir.plan("10", found, lambda s: None)
    assert start.step == 10 and start.copy == ["metrics.jsonl"]
    assert sorted(start.move) == ["checkpoints/20", "checkpoints/30.orbax-checkpoint-tmp-123"]
    aside = rundir.set_aside(str(run), start)
    assert sorted(os.listdir(run / "checkpoints")) == ["10"]
    assert sorted(os.listdir(os.path.join(aside, "checkpoints"))) == ["20", "30.orbax-checkpoint-tmp-123"]
    assert (run / "metrics.jsonl").exists() and os.path.exists(os.path.join(aside, "metrics.jsonl"))
    # resume=never: every file of the earlier run is moved, the user's own files stay.
    start = rundir.plan("never", rundir.survey(run), lambda s: None)
    aside2 = rundir.set_aside(str(run), start)
    assert aside2 != aside and sorted(os.listdir(run)) == sorted(
        [os.path.basename(aside), os.path.basename(aside2), "notes.txt"]
    )
    assert sorted(os.listdir(aside2)) == ["checkpoints", "events.out.tfevents.1.host", "metrics.jsonl"]
    with pytest.raises(
        ConfigError,
        match=r"train.resume=5: that checkpoint cannot be used \(there "
        r"is no such checkpoint\); complete checkpoints: \[10\]",
    ):
        rundir.plan("5", history(25, [10]), lambda s: None)


def test_a_used_run_dir_without_a_usable_checkpoint_is_refused_before_anything_is_written(finished, tmp_path):
    run = copy_of(finished, tmp_path)
    for step in ("2", "4"):  # every checkpoint garbled
        ckpt = run / "checkpoints" / step / "params"
        victim = next(
            os.path.join(d, f)
            for d, _, fs in os.walk(ckpt)
            for f in fs
            if os.path.getsize(os.path.join(d, f)) > 64
        )
        with open(victim, "r+b") as f:
            f.write(b"\xff" * 16)
    before = sorted(os.listdir(run))
    cfg, sizes = tiny(run, "train.steps=6")
    with (
        pytest.warns(CheckpointWarning),
        pytest.raises(
            ConfigError,
            match=r"holds an earlier run \(metrics up to step 4, checkpoints of steps "
            r"\[2, 4\]\) but nothing to resume from: step 4: .*garbled.*; step 2: ",
        ),
    ):
        train(cfg, sizes)
    assert sorted(os.listdir(run)) == before and metrics_steps(run) == [1, 2, 3, 4]


def test_resume_never_starts_over_with_the_old_run_moved_aside(finished, tmp_path, capsys):
    run = copy_of(finished, tmp_path)
    cfg, sizes = tiny(
        run, "train.steps=2", "train.resume=never", "data.source=" + str(finished.parent / "corpus" / "*.txt")
    )
    train(cfg, sizes)
    assert metrics_steps(run) == [1, 2]  # one run's history, not two appended
    (aside,) = [n for n in os.listdir(run) if n.startswith("replaced-")]
    assert sorted(os.listdir(run / aside / "checkpoints")) == ["2", "4"]
    assert metrics_steps(run / aside) == [1, 2, 3, 4]
    assert "train.resume=never: moved the earlier run's files into" in capsys.readouterr().err
    # The same losses as the first run: a fresh start is a fresh start.
    assert losses(run) == {s: loss for s, loss in losses(finished).items() if s <= 2}


def test_resume_at_an_earlier_step_sets_the_later_checkpoints_aside_and_reruns_them(finished, tmp_path):
    run = copy_of(finished, tmp_path)
    source = "data.source=" + str(finished.parent / "corpus" / "*.txt")
    cfg, sizes = tiny(run, "train.steps=4", "train.resume=2", "train.batch_size=16", source)
    with pytest.raises(
        ConfigError,
        match=r"train.batch_size=16, but checkpoint step 2 was written "
        r"with train.batch_size=8.*resume with train.batch_size=8",
    ):
        train(cfg, sizes)
    assert sorted(os.listdir(run / "checkpoints")) == ["2", "4"]  # refused: nothing moved
    cfg, sizes = tiny(
        run, "train.steps=4", "train.resume=2", "checkpoint.every=2", "checkpoint.keep=0", source
    )
    train(cfg, sizes)
    (aside,) = [n for n in os.listdir(run) if n.startswith("replaced-")]
    assert os.listdir(run / aside / "checkpoints") == ["4"]
    assert metrics_steps(run / aside) == [1, 2, 3, 4] and metrics_steps(run) == [1, 2, 3, 4]
    assert losses(run) == losses(finished)  # steps 3 and 4 rerun exactly


def test_config_yaml_stores_the_paths_resolved(finished):
    saved = config_lib.load_config(str(finished / "config.yaml"))
    assert saved.data.source == str(finished.parent / "corpus" / "*.txt")
    assert saved.train.run_dir == str(finished)
    assert len(sources_lib.data_files(saved.data)) == 3  # found from any directory


# --- One run at a time -----------------------------------------------------------------------------


def test_a_live_holder_refuses_a_second_run_and_a_dead_one_is_taken_over(tmp_path, capsys, monkeypatch):
    first = rundir.RunLock(tmp_path)
    first.acquire()
    held = json.load(open(tmp_path / "jaxpar.lock"))
    assert held["pid"] == os.getpid() and held["host"] == socket.gethostname()
    with pytest.raises(
        ConfigError, match=rf"another run is using this directory \(pid {os.getpid()} on host"
    ):
        rundir.RunLock(tmp_path).acquire()
    first.release()
    assert not (tmp_path / "jaxpar.lock").exists()
    # A holder that no longer runs (killed: its lock stayed behind) is taken over, with a warning.
    gone = subprocess.Popen(["true"])
    gone.wait()
    (tmp_path / "jaxpar.lock").write_text(json.dumps({"pid": gone.pid, "host": socket.gethostname()}))
    second = rundir.RunLock(tmp_path)
    second.acquire()
    assert (
        f"taking over the stale lock {tmp_path / 'jaxpar.lock'} (left by pid {gone.pid}"
        in capsys.readouterr().err
    )
    assert json.load(open(tmp_path / "jaxpar.lock"))["pid"] == os.getpid()
    second.release()
    # A pid that is alive but started later than the holder did is someone else: stale.
    (tmp_path / "jaxpar.lock").write_text(
        json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "start_ticks": -1})
    )
    rundir.RunLock(tmp_path).acquire()
    # Another host's process cannot be checked: its lock is live while it is touched...
    elsewhere = {"pid": 1, "host": "elsewhere-" + uuid.uuid4().hex, "slurm_job_id": "77"}
    (tmp_path / "jaxpar.lock").write_text(json.dumps(elsewhere))
    with pytest.raises(ConfigError, match=r"another host \(touched within 300 s.* delete"):
        rundir.RunLock(tmp_path).acquire()
    # ... stale once untouched for STALE_S, or when it is this very Slurm job's earlier run.
    os.utime(tmp_path / "jaxpar.lock", (time.time() - 301, time.time() - 301))
    rundir.RunLock(tmp_path).acquire()
    assert "untouched for 301 s" in capsys.readouterr().err
    (tmp_path / "jaxpar.lock").write_text(json.dumps(elsewhere))
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    beating = rundir.RunLock(tmp_path, heartbeat_s=0.05)
    beating.acquire()
    assert "an earlier run of this Slurm job (77, requeued)" in capsys.readouterr().err
    os.utime(tmp_path / "jaxpar.lock", (0, 0))
    time.sleep(0.3)
    assert time.time() - os.path.getmtime(tmp_path / "jaxpar.lock") < 5  # the holder's heartbeat
    beating.release()


def test_a_second_run_on_a_locked_run_dir_exits_2_and_writes_nothing(finished, tmp_path):
    run = copy_of(finished, tmp_path)
    holder = subprocess.Popen(["sleep", "60"])
    try:
        (run / "jaxpar.lock").write_text(json.dumps({"pid": holder.pid, "host": socket.gethostname()}))
        cfg, sizes = tiny(run, "train.steps=6")
        with pytest.raises(ConfigError, match=f"another run is using this directory \\(pid {holder.pid}"):
            train(cfg, sizes)
        assert metrics_steps(run) == [1, 2, 3, 4]
        assert json.load(open(run / "jaxpar.lock"))["pid"] == holder.pid  # not released by the refused run
    finally:
        holder.kill()


# --- The command line: a full disk, Ctrl-C, one line each ------------------------------------------


def _cli(run_dir, *extra, module="jaxpar.train"):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    args = [sys.executable, "-m", module, TINY_YAML, f"train.run_dir={run_dir}", *ONE_LAYOUT, *extra]
    return subprocess.Popen(
        args, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def mount_tmpfs(where, options):
    """Mounts a tmpfs at `where` (a real small or read-only file system), or skips the test."""
    where.mkdir()
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a tmpfs needs root")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(where)], capture_output=True)
    if done.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    return where


@pytest.fixture
def small_disk(tmp_path):
    """A 1.5 MB file system: room for a couple of the tiny model's checkpoints."""
    yield mount_tmpfs(tmp_path / "disk", "size=1500k")
    subprocess.run(["umount", "-l", str(tmp_path / "disk")])


@pytest.fixture
def read_only(tmp_path):
    yield mount_tmpfs(tmp_path / "ro", "ro,size=64k")
    subprocess.run(["umount", "-l", str(tmp_path / "ro")])


# The run checks the space before each save; "unchecked" hides it (the disk looks empty) so that
# orbax's own write fails, in a background thread, as it did before the check existed.
UNCHECKED = """
import collections, sys
import jaxpar.run.train as train
usage = collections.namedtuple("usage", "total used free")(1 << 50, 0, 1 << 50)
train.shutil = type("shutil", (), {"disk_usage": staticmethod(lambda path: usage)})
sys.exit(train.main(sys.argv[1:]))
"""


@pytest.mark.parametrize("check", ["before the save", "unchecked"])
def test_a_full_disk_is_one_line_and_the_previous_checkpoint_is_intact(small_disk, check):
    run = small_disk / "run"
    args = [
        TINY_YAML,
        f"train.run_dir={run}",
        *ONE_LAYOUT,
        "train.steps=40",
        "checkpoint.every=2",
        "checkpoint.keep=0",
    ]
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    command = ["-m", "jaxpar.train"] if check == "before the save" else ["-c", UNCHECKED]
    proc = subprocess.Popen(
        [sys.executable, *command, *args],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 1, err[-3000:]
    # Beside the start-up lines (precision, the compile cache and the step's compile), one line:
    # the error.
    startup = ("precision: ", "compile cache: ", "compiled the train step", "loaded the train step")
    lines = [line for line in err.splitlines() if line.strip() and not line.startswith(startup)]
    assert len(lines) == 1 and "Traceback" not in err, err[-3000:]
    (line,) = lines
    intact = int(line.split("the previous checkpoint (step ")[1].split(")")[0])
    assert line.startswith(f"error: no space left on the device of {run / 'checkpoints'}")
    assert "needs about" in line and "is free" in line and "run the same command to resume" in line
    assert manifest_problem(str(run / "checkpoints" / str(intact))) is None
    assert max(metrics_steps(run)) >= intact


def test_ctrl_c_at_any_moment_stops_cleanly_with_exit_130(tmp_path):
    # Early (importing, reading the config); in start-up once the lock is taken (building the
    # state, compiling); in training (it stops after the step, with a checkpoint).
    dirs = {"early": tmp_path / "a", "start-up": tmp_path / "b", "training": tmp_path / "c"}
    cases = {
        "early": _cli(dirs["early"]),
        "start-up": _cli(dirs["start-up"]),
        "training": _cli(dirs["training"], "train.steps=100000", "checkpoint.every=0"),
    }
    time.sleep(0.7)
    cases["early"].send_signal(signal.SIGINT)
    deadline = time.time() + 240
    for name, marker in (("start-up", "jaxpar.lock"), ("training", "metrics.jsonl")):
        while not (dirs[name] / marker).exists():
            assert time.time() < deadline and cases[name].poll() is None, cases[name].communicate()
            time.sleep(0.02)
        cases[name].send_signal(signal.SIGINT)
    results = {name: (proc.wait(timeout=120), proc.communicate()[1]) for name, proc in cases.items()}
    for name, (code, err) in results.items():
        assert code == 130 and "Traceback" not in err, (name, code, err[-3000:])
    assert (
        "interrupted during start-up" in results["early"][1]
        or "stopped by SIGINT during start-up, before step 1" in results["early"][1]
    )
    assert "stopped by SIGINT during start-up, before step 1" in results["start-up"][1]
    assert not (dirs["start-up"] / "jaxpar.lock").exists()  # released on the way out
    steps = os.listdir(dirs["training"] / "checkpoints")
    assert len(steps) == 1 and manifest_problem(str(dirs["training"] / "checkpoints" / steps[0])) is None


def test_a_second_ctrl_c_exits_at_once():
    """The command line's handler: the first SIGINT asks for a stop, the second exits 130 on the
    spot (no unwinding through a compile or a save)."""
    code = (
        "import os, signal, time\n"
        "from jaxpar.run.stopping import Preemption\n"
        "with Preemption(exit_at_once=True) as p:\n"
        "    os.kill(os.getpid(), signal.SIGINT); time.sleep(0.2); print(p.requested, flush=True)\n"
        "    os.kill(os.getpid(), signal.SIGINT); time.sleep(5); print('not reached')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert done.returncode == 130 and done.stdout == "SIGINT\n", done
    assert "interrupted again: stopped at once" in done.stderr and "Traceback" not in done.stderr


# --- Bad input: a clear message, exit 2 ------------------------------------------------------------


def test_settings_that_were_accepted_silently_are_refused():
    def refused(*overrides, match):
        with pytest.raises(ConfigError, match=match):
            cfg = config_lib.load_config(TINY_YAML, list(overrides))
            checks_lib.validate(cfg, 8)

    refused("optimizer.lr=.nan", match=r"optimizer.lr=nan: use a positive, finite learning rate")
    refused("optimizer.lr=-1", match=r"optimizer.lr=-1.0: use a positive")
    refused("optimizer.warmup_steps=-3", match=r"optimizer.warmup_steps=-3: use 0 or more")
    refused(
        "train.steps=3000000000",
        match=r"train.steps=3000000000 is beyond the int32 step counter; use at most 2147483647",
    )
    refused("train.seed=-1", match=r"train.seed=-1: use a seed in \[0, 2\*\*32\)")
    refused("train.seed=4294967296", match=r"train.seed=4294967296")
    refused("runtime.cpu_devices=0", match=r"runtime.cpu_devices=0: must be at least 1")
    # A section given as a mapping merges with the dotted overrides around it, in order.
    cfg = config_lib.load_config(
        None, ["train.steps=5", "train={seq_len: 64, log_every: 3}", "train.log_every=4"]
    )
    assert (cfg.train.steps, cfg.train.seq_len, cfg.train.log_every) == (5, 64, 4)
    with pytest.raises(ConfigError, match=r"unknown config key 'train.stepz'"):
        config_lib.load_config(None, ["train={stepz: 5}"])


def test_cpu_devices_is_checked_before_the_backend_starts():
    from jaxpar.run.train import main

    assert main([TINY_YAML, "runtime.cpu_devices=0"]) == 2  # (this process's backend is untouched)


def test_paths_that_are_directories_files_or_read_only_are_named(tmp_path):
    with pytest.raises(ConfigError, match=f"config file '{tmp_path}' is a directory"):
        config_lib.load_yaml(str(tmp_path))
    with pytest.raises(
        ConfigError, match=r"is a directory; name its files with a glob, e\.g\. data.source='.*\*\.txt'"
    ):
        sources_lib.data_files(config_lib.DataConfig(source=str(tmp_path)))
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match=r"train.run_dir='.*file' is a file; give a directory"):
        checks_lib.check_run_dir(str(tmp_path / "file"))
    with pytest.raises(ConfigError, match=r"train.run_dir='.*file/run' is under '.*file', which is a file"):
        checks_lib.check_run_dir(str(tmp_path / "file" / "run"))


def test_a_read_only_run_dir_is_named(read_only):
    """Checked by writing a probe: permission bits do not show a read-only mount."""
    with pytest.raises(
        ConfigError,
        match=r"train.run_dir='.*ro/run' is not writable \(it would be "
        r"created in '.*ro'\): Read-only file system",
    ):
        checks_lib.check_run_dir(str(read_only / "run"))


def test_export_and_sample_and_the_tokenizer_trainer_refuse_bad_arguments(tmp_path, capsys):
    from jaxpar import sample
    from jaxpar.hf import export

    (tmp_path / "file").write_text("x")
    assert export.main([str(tmp_path), "--out", str(tmp_path / "file")]) == 2
    assert "--out='" in capsys.readouterr().err
    assert sample.main([str(tmp_path), "--prompt", "x", "--max-tokens", "-5"]) == 2
    assert "--max-tokens=-5: must be at least 1" in capsys.readouterr().err
    assert data_lib.main(["train-tokenizer", "--out", str(tmp_path / "t.json"), "--vocab-size", "0"]) == 2
    assert "--vocab-size=0: a byte-level BPE needs at least 258" in capsys.readouterr().err


def test_a_corrupt_tokenizer_json_is_named(tmp_path):
    bad = tmp_path / "tokenizer.json"
    bad.write_text('{"version": "1.0", "model": {"type": "BPE", "vocab": ')
    with pytest.raises(ConfigError, match=f"data.tokenizer='{bad}' is not a readable tokenizer.json"):
        data_lib.make_tokenizer(config_lib.DataConfig(tokenizer=str(bad)))


def test_documents_that_are_not_text_are_named_or_handled_as_data_errors_says(tmp_path, capsys):
    (tmp_path / "a.txt").write_text("fine text\n")
    (tmp_path / "b.txt").write_bytes(b"line one\nline two \xff\xfe bad\n")
    (tmp_path / "c.jsonl").write_text('{"text": "ok"}\n{"text": null}\n')
    (tmp_path / "d.bin").write_bytes(b"\x7fELF\x00\x00\x01")

    def read(source, errors="strict"):
        return data_lib.read_documents(config_lib.DataConfig(source=str(tmp_path / source), errors=errors))

    with pytest.raises(ConfigError, match=r"b.txt:2 is not valid UTF-8 .*data.errors=replace"):
        read("b.txt")
    with pytest.raises(ConfigError, match=r"c.jsonl:2: 'text' \(data.text_field\) is null, not a string"):
        read("c.jsonl")
    with pytest.raises(ConfigError, match=r"d.bin holds NUL bytes \(a binary file\?\)"):
        read("d.bin")
    assert read("b.txt", "replace") == ["line one\nline two \ufffd\ufffd bad\n"]
    assert "data.errors=replace: 1 document(s) read with U+FFFD" in capsys.readouterr().err
    assert read("*", "skip") == ["fine text\n", "ok"]
    assert "data.errors=skip: 3 document(s) left out" in capsys.readouterr().err


def test_a_non_finite_loss_before_any_checkpoint_says_there_is_none():
    """A run that went non-finite before its first checkpoint said "the last good checkpoint is
    step None"."""
    from types import SimpleNamespace

    from jaxpar.run.stopping import _last_good

    none = SimpleNamespace(latest_valid_step=lambda: None, directory="/r/checkpoints")
    some = SimpleNamespace(latest_valid_step=lambda: 4, directory="/r/checkpoints")
    assert _last_good(none) == "there is no checkpoint yet in /r/checkpoints (checkpoint.every)"
    assert _last_good(some) == "the last good checkpoint is step 4 in /r/checkpoints"
