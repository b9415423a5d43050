"""Weights & Biases beside metrics.jsonl (train.wandb.*, jaxpar/training/wandb_log.py): the
offline run's own file holds every record at its step and the config with the layout; a resume
continues the same W&B run; without the package or a login, one line and the run goes on.

Hermetic: W&B runs offline, its configuration, cache and data directories are the test's, no
credentials are visible (WANDB_API_KEY unset, NETRC an absent file), and nothing reaches the
network. The offline run is read back from its `.wandb` file, the record log W&B syncs from
(`records`): the only offline file that holds the history and the config. The test extra
installs wandb (pyproject.toml); without it the tests that need it fail rather than skip."""

import glob
import json
import os
import struct
import subprocess
import sys

import pytest

from jaxpar import checks as checks_lib
from jaxpar import config as config_lib
from jaxpar.run import rundir
from jaxpar.run.train import train
from jaxpar.training import wandb_log
from tests.test_train import ROOT, TINY_YAML

# A short run: records at steps 2, 4 and 5 (the last), a checkpoint at the end to resume from.
RUN = ["train.log_every=2"]  # on the 8 emulated devices: the default mesh, data x fsdp x tensor
W_AND_B = ["train.wandb.project=jaxpar-tests", "train.wandb.mode=offline", "train.wandb.tags=[ci]"]


@pytest.fixture(scope="module", autouse=True)
def wandb_env(tmp_path_factory):
    """W&B's directories in a temporary one, no credentials, no network, no messages; W&B's
    service process ended after the module's tests."""
    home = tmp_path_factory.mktemp("wandb-home")
    with pytest.MonkeyPatch.context() as mp:
        for name in ("CONFIG_DIR", "CACHE_DIR", "DATA_DIR", "ARTIFACT_DIR"):
            mp.setenv(f"WANDB_{name}", str(home / name.lower()))
        mp.setenv("NETRC", str(home / "no-netrc"))
        mp.setenv("WANDB_SILENT", "true")
        mp.setenv("WANDB_ERROR_REPORTING", "false")
        for name in (
            "WANDB_API_KEY",
            "WANDB_DIR",
            "WANDB_MODE",
            "WANDB_BASE_URL",
            "WANDB_IDENTITY_TOKEN_FILE",
        ):
            mp.delenv(name, raising=False)
        yield
        if "wandb" in sys.modules and sys.modules["wandb"] is not None:
            sys.modules["wandb"].teardown()


def run(run_dir, *overrides):
    cfg = config_lib.load_config(TINY_YAML, [*RUN, f"train.run_dir={run_dir}", *overrides])
    return train(cfg, checks_lib.validate(cfg, 8))


def records(path):
    """The protobuf records of a W&B `.wandb` file: a 7-byte header (":W&B", magic, version), then
    LevelDB-log blocks of 32 KiB, each record in chunks of (crc32c, length, type: 1 full, 2 first,
    3 middle, 4 last) and its bytes."""
    from wandb.proto import wandb_internal_pb2

    data = open(path, "rb").read()
    assert data[:4] == b":W&B", f"{path}: not a W&B record log (header {data[:7]!r})"
    pos, block, pending = 7, 32768, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # too little left in the block for a chunk header: padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0:  # zero padding to the block's end
            pos += block - pos % block
            continue
        pending += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            yield record
            pending = b""


def value(item):
    return ".".join(item.nested_key) or item.key, json.loads(item.value_json)


def session(path):
    """(run id, config, history rows) of one offline session's `.wandb` file."""
    run_id, config, rows = None, {}, []
    for record in records(path):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run_id = record.run.run_id
            config.update(value(item) for item in record.run.config.update)
        elif kind == "config":
            config.update(value(item) for item in record.config.update)
        elif kind == "history":
            rows.append(dict(value(item) for item in record.history.item))
    return run_id, config, rows


def sessions(run_dir):
    """Each offline session under run_dir/wandb, oldest first."""
    paths = sorted(glob.glob(os.path.join(run_dir, "wandb", "offline-run-*", "run-*.wandb")))
    return [session(path) for path in paths]


def flat(record):
    """A metrics.jsonl record with its mappings flattened as W&B keys them (tokens_seen.NAME)."""
    out = {}
    for key, v in record.items():
        if isinstance(v, dict):
            out.update({f"{key}.{name}": x for name, x in v.items()})
        else:
            out[key] = v
    return out


def metrics(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def w_and_b_lines(text):
    return [line for line in text.splitlines() if line.startswith("W&B:")]


def test_an_offline_run_holds_every_record_and_the_config_and_a_resume_continues_it(tmp_path, capsys):
    run_dir = tmp_path / "run"
    run(run_dir, "train.steps=5", *W_AND_B)
    run_id = (run_dir / wandb_log.ID_FILE).read_text().strip()
    (line,) = w_and_b_lines(capsys.readouterr().err)
    assert line.startswith(f"W&B: started run {run_id} offline in {run_dir / 'wandb'}"), line
    ((first_id, config, rows),) = sessions(run_dir)
    assert first_id == run_id
    # Every metrics.jsonl record, at W&B step = its step, with the same keys and values.
    written = metrics(run_dir)
    assert [r["step"] for r in written] == [2, 4, 5]
    assert [row["_step"] for row in rows] == [2, 4, 5]
    for row, record in zip(rows, written):
        logged = {k: v for k, v in row.items() if k not in ("_step", "_timestamp", "_runtime")}
        expected = flat(record)
        assert logged.keys() == expected.keys()
        for key, v in expected.items():
            assert logged[key] == (v if v is None else pytest.approx(v, rel=1e-12)), key
    # The whole resolved config, and the layout.
    cfg = config_lib.load_config(str(run_dir / "config.yaml"))
    assert {k: config[k] for k in config_lib.to_dict(cfg)} == json.loads(json.dumps(config_lib.to_dict(cfg)))
    mesh = {"pipe": 1, "data": 2, "fsdp": 2, "expert": 1, "context": 1, "tensor": 2}
    assert config["layout"]["mesh"] == mesh
    assert config["layout"]["devices"] == 8 and config["layout"]["parallel"]["zero_stage"] == 0

    # The resume (from the checkpoint of step 5) continues the same W&B run from step 6.
    run(run_dir, "train.steps=7", *W_AND_B)
    assert (run_dir / wandb_log.ID_FILE).read_text().strip() == run_id
    (_, _, _), (second_id, config, rows) = sessions(run_dir)
    assert second_id == run_id
    assert [row["_step"] for row in rows] == [6, 7] == [r["step"] for r in metrics(run_dir)[3:]]
    assert config["train"]["steps"] == 7
    (line,) = w_and_b_lines(capsys.readouterr().err)
    assert line.startswith(f"W&B: continuing run {run_id} offline in "), line


def test_a_new_run_in_the_directory_moves_the_w_and_b_run_aside(tmp_path):
    """train.resume=never moves the earlier run's W&B id and files aside with its other files, so
    that the new run starts a new W&B run (the first test: a resume keeps them)."""
    (tmp_path / "metrics.jsonl").write_text('{"step": 2, "loss": 1.0}\n')
    (tmp_path / wandb_log.ID_FILE).write_text("abc12345\n")
    (tmp_path / "wandb").mkdir()
    history = rundir.survey(str(tmp_path))
    assert {wandb_log.ID_FILE, "wandb"} <= set(history.files)
    start = rundir.plan("never", history, lambda step: None)
    assert {wandb_log.ID_FILE, "wandb"} <= set(start.move)
    rundir.set_aside(str(tmp_path), start)
    assert not (tmp_path / wandb_log.ID_FILE).exists() and not (tmp_path / "wandb").exists()
    (aside,) = glob.glob(str(tmp_path / "replaced-*"))
    assert open(os.path.join(aside, wandb_log.ID_FILE)).read() == "abc12345\n"


def test_without_the_package_one_line_and_the_run_finishes(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` raises ImportError
    summary = run(tmp_path / "run", "train.steps=2", "checkpoint.every=0", *W_AND_B)
    assert summary["steps"] == 2 and [r["step"] for r in metrics(tmp_path / "run")] == [2]
    err = capsys.readouterr().err
    (line,) = w_and_b_lines(err)
    assert "not installed" in line and "pip install wandb" in line and "goes on" in line
    assert "Traceback" not in err
    assert not (tmp_path / "run" / wandb_log.ID_FILE).exists() and not (tmp_path / "run" / "wandb").exists()


def test_online_without_a_login_one_line_and_the_run_finishes(tmp_path, capsys):
    summary = run(tmp_path / "run", "train.steps=2", "checkpoint.every=0", "train.wandb.project=jaxpar-tests")
    assert summary["steps"] == 2 and [r["step"] for r in metrics(tmp_path / "run")] == [2]
    err = capsys.readouterr().err
    (line,) = w_and_b_lines(err)
    assert "no login" in line and "wandb login" in line and "train.wandb.mode=offline" in line
    assert "Traceback" not in err and not (tmp_path / "run" / "wandb").exists()


class FakeRun:
    """What WandbSink uses of a W&B run: an online run resumed where its history reaches step 4."""

    id, starting_step = "abc12345", 5

    def __init__(self):
        self.logged, self.finished = [], None

    def log(self, data, step):
        self.logged.append((step, data))

    def finish(self, exit_code):
        self.finished = exit_code


def test_a_resumed_online_run_is_sent_only_the_steps_its_history_lacks(capsys):
    """W&B drops a step below its history's next one; the sink says so once and sends the rest."""
    fake = FakeRun()
    sink = wandb_log.WandbSink(fake)
    for step in (3, 4, 5, 6):
        sink.write({"step": step, "loss": 1.0 / step, "tokens_seen": {"a": step}})
    sink.close()
    assert [step for step, _ in fake.logged] == [5, 6]
    assert fake.logged[0][1] == {"step": 5, "loss": 0.2, "tokens_seen": {"a": 5}}
    assert fake.finished == 0
    (line,) = w_and_b_lines(capsys.readouterr().err)
    assert "steps up to 4" in line


def test_a_run_that_fails_marks_its_w_and_b_run_failed():
    fake = FakeRun()
    sink = wandb_log.WandbSink(fake)
    try:
        raise RuntimeError("the step failed")
    except RuntimeError:
        sink.close()  # as the loop's `finally` does, with the error on its way out
    assert fake.finished == 1


def test_a_wrong_mode_is_one_config_error_line_exit_2():
    proc = subprocess.run(
        [sys.executable, "-m", "jaxpar.train", "train.wandb.mode=online-ish"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=dict(os.environ, JAX_PLATFORMS="cpu"),
        timeout=120,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "config error: train.wandb.mode='online-ish': choose one of online, offline, disabled"
    ]
