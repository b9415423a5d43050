"""A run directory holds one run's history; this module decides what a new start does with it.

What a run writes into `train.run_dir`: config.yaml, metrics.jsonl, TensorBoard event files,
loss.png and checkpoints/ (jaxpar.training.checkpoint), and with W&B (train.wandb.project) the W&B
run's id, `wandb-run-id`, and W&B's own files, wandb/ (jaxpar.training.wandb_log). The rules, applied
before anything is written:

- An unused directory (none of those files, no checkpoint) starts a fresh run.
- `train.resume=auto` (the default) continues from the newest intact checkpoint. If the
  directory holds an earlier run but no usable checkpoint (every checkpoint corrupt, or the run
  stopped before its first save), the run is refused (exit 2) with what is there: starting over
  silently would mix two runs' metrics.
- `train.resume=never` starts over. An earlier run's files are moved, not deleted, into
  `<run_dir>/replaced-<UTC time>/`, and the run says so.
- `train.resume=<step>` continues from that checkpoint; checkpoints of later steps (the
  abandoned continuation) are moved likewise, with a copy of the whole metrics.jsonl.

What a run trained on stays on record. `config.yaml` names the data (DATA_KEYS) and
`chat_template.jinja` keeps the text of the chat template its conversations were rendered with
(jaxpar.corpus.data.save_run_template); a resume compares both with what it would read now
(`data_changes`: the settings, and the template's text, since a file edited in place keeps its
path) and is refused on a change unless data.allow_source_change, which first keeps the earlier
two as `config.until-step-<N>.yaml` and `chat_template.until-step-<N>.jinja` (`keep_record`;
`-2`, `-3`, ... after N for a later resume from the same step: none is ever overwritten).

One run at a time: `RunLock` keeps `<run_dir>/jaxpar.lock` (the holder's pid, host, process
start time, Slurm job id) for as long as the run lives, and touches it every `HEARTBEAT_S`
seconds. A second run finds it and is refused (exit 2). A lock is stale, and taken over with a
warning, when its holder no longer exists on this host (killed), when it was left by an earlier
run of the same Slurm job (requeued after a node failure, on another node), or when it comes from
another host and has not been touched for `STALE_S` seconds (a holder there that is alive but
frozen that long would then share the directory: the price of not waiting forever).
"""

from __future__ import annotations

import dataclasses
import datetime
import glob
import hashlib
import json
import os
import shutil
import socket
import sys
import threading
import time
import warnings

import yaml

from jaxpar.config import ConfigError
from jaxpar.training import checkpoint as checkpoint_lib
from jaxpar.training import wandb_log

LOCK = "jaxpar.lock"
HEARTBEAT_S = 30.0  # how often a holder touches its lock
STALE_S = 300.0  # another host's lock untouched this long is stale
METRICS = "metrics.jsonl"
# + events.out.tfevents.*, checkpoints/; layout.json: mesh: auto's choice (jaxpar.planning.auto)
HISTORY = ("config.yaml", METRICS, "loss.png", wandb_log.ID_FILE, "layout.json")
WANDB_FILES = "wandb"  # W&B's own files (unless WANDB_DIR puts them elsewhere)
REPLACED = "replaced-"
RECORD = "config.yaml"  # the run's settings, rewritten at every start
# The record before a resume onto other data; a second such resume from the same step keeps its
# own as config.until-step-<step>-2.yaml, and so on: no record is ever overwritten.
EARLIER_RECORD = "config.until-step-{step}.yaml"
TEMPLATE = "chat_template.jinja"  # the chat template the run renders with (jaxpar.corpus.data.RUN_TEMPLATE)
EARLIER_TEMPLATE = "chat_template.until-step-{step}.jinja"  # kept beside EARLIER_RECORD
# The settings that say which sequences global batch k holds: a checkpoint's data position (a
# count of global batches, train.batch_size and train.seq_len checked beside it) means the same
# data only while these stay the same.
DATA_KEYS = (
    "data.source",
    "data.sources",
    "data.tokenizer",
    "data.max_documents",
    "data.shuffle",
    "data.text_field",
    "data.chat_template",
    "data.train_on",
    "data.packing",
    "train.seed",
)
# What a record that lacks a data key (written before the setting existed) trained with: the
# only behaviour there was then. Other missing keys are no change.
RECORD_BEFORE = {"data.packing": "wrap"}


# --- The lock -------------------------------------------------------------------------------


def _start_ticks(pid: int) -> int | None:
    """When process `pid` started (clock ticks since boot, /proc/<pid>/stat field 22), which
    tells a live holder from a new process that reuses a dead holder's pid; None off Linux."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def _alive(holder: dict) -> bool:
    """Whether the lock's holder still runs (on this host)."""
    pid = holder.get("pid")
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # another user's process: alive
    ticks = _start_ticks(pid)
    return ticks is None or holder.get("start_ticks") in (None, ticks)


class RunLock:
    """`<run_dir>/jaxpar.lock`, created atomically (O_EXCL), touched by a heartbeat thread while
    held, removed on release."""

    def __init__(self, run_dir: str, heartbeat_s: float = HEARTBEAT_S):
        self.path = os.path.join(os.path.abspath(run_dir), LOCK)
        self.held = False
        self._heartbeat_s = heartbeat_s
        self._stop = threading.Event()

    def _describe(self, holder: dict) -> str:
        return f"pid {holder.get('pid')} on host {holder.get('host')} since {holder.get('started', '?')}"

    def _stale(self, holder: dict | None, me: dict) -> str | None:
        """Why the lock's holder is gone (None: it may still run)."""
        if holder is None:
            return "unreadable"
        if holder.get("slurm_job_id") and holder.get("slurm_job_id") == me["slurm_job_id"]:
            return (
                f"left by {self._describe(holder)}, an earlier run of this Slurm job "
                f"({me['slurm_job_id']}, requeued)"
            )
        if holder.get("host") == me["host"]:
            return None if _alive(holder) else f"left by {self._describe(holder)}, which no longer runs"
        try:
            age = time.time() - os.path.getmtime(self.path)
        except FileNotFoundError:
            return "removed meanwhile"
        if age > STALE_S:
            return f"left by {self._describe(holder)}, untouched for {age:.0f} s"
        return None

    def acquire(self) -> None:
        """Takes the lock; raises ConfigError if a live run holds it. Warns on taking over a
        stale one."""
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        me = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "start_ticks": _start_ticks(os.getpid()),
            "slurm_job_id": os.environ.get("SLURM_JOB_ID"),
            "started": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "command": " ".join(sys.argv),
        }
        for attempt in range(2):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                holder = self._read()
                stale = self._stale(holder, me)
                if stale is None and holder.get("host") != me["host"]:
                    raise ConfigError(
                        f"train.run_dir: {self.path} is held by {self._describe(holder)}, another "
                        f"host (touched within {STALE_S:.0f} s, so that run may still be going); "
                        f"if it has ended, delete {self.path} (or use another train.run_dir)"
                    ) from None
                if stale is None:
                    raise ConfigError(
                        f"train.run_dir: another run is using this directory ({self._describe(holder)}, "
                        f"lock {self.path}); wait for it to end, stop it, or use another "
                        f"train.run_dir"
                    ) from None
                if attempt == 0:
                    print(f"warning: taking over the stale lock {self.path} ({stale})", file=sys.stderr)
                    # Two runs taking over the same stale lock at the same instant could both
                    # remove it; the O_EXCL create below then lets only one of them in.
                    try:
                        os.remove(self.path)
                    except FileNotFoundError:
                        pass
                continue
            with os.fdopen(fd, "w") as f:
                json.dump(me, f)
            self.held = True
            self._stop.clear()
            threading.Thread(target=self._beat, name="jaxpar-run-lock", daemon=True).start()
            return
        raise ConfigError(f"train.run_dir: could not take the lock {self.path}; another run took it")

    def _beat(self) -> None:
        while not self._stop.wait(self._heartbeat_s):
            try:
                os.utime(self.path)
            except OSError:
                pass  # removed or unwritable: the next run sees an old lock, which is the truth

    def _read(self) -> dict | None:
        for _ in range(20):  # a holder that has just created the file may not have written it yet
            try:
                with open(self.path) as f:
                    return json.load(f)
            except FileNotFoundError:
                return None
            except (OSError, ValueError):
                time.sleep(0.05)
        return None

    def release(self) -> None:
        if not self.held:
            return
        self.held = False
        self._stop.set()
        holder = self._read()
        if holder is not None and holder.get("pid") == os.getpid():
            os.remove(self.path)


# --- What a run directory holds ----------------------------------------------------------------


@dataclasses.dataclass
class History:
    run_dir: str
    files: list[str]  # history at the top level (config.yaml, metrics, events, plot, W&B's)
    metrics_last_step: int | None  # the last readable step of metrics.jsonl
    checkpoints: list[int]  # committed checkpoint steps, oldest first
    unfinished: list[int]  # steps whose save never committed

    @property
    def used(self) -> bool:
        """Whether an earlier run left anything a new start could mix with or lose."""
        return bool(
            self.metrics_last_step is not None
            or self.checkpoints
            or self.unfinished
            or any(f not in (RECORD, TEMPLATE) for f in self.files)
        )

    def describe(self) -> str:
        parts = []
        if self.metrics_last_step is not None:
            parts.append(f"metrics up to step {self.metrics_last_step}")
        if self.checkpoints:
            parts.append(f"checkpoints of steps {self.checkpoints}")
        if self.unfinished:
            parts.append(f"unfinished saves of steps {self.unfinished}")
        return ", ".join(parts) or ", ".join(self.files)


def _last_metrics_step(path: str) -> int | None:
    last = None
    try:
        with open(path) as f:
            for line in f:
                try:
                    last = int(json.loads(line)["step"])
                except (ValueError, KeyError, TypeError):
                    continue  # a garbled line: resuming drops it with a warning
    except FileNotFoundError:
        return None
    return last


def survey(run_dir: str) -> History:
    run_dir = os.path.abspath(run_dir)
    files = [f for f in (*HISTORY, TEMPLATE) if os.path.isfile(os.path.join(run_dir, f))]
    for pattern in (EARLIER_RECORD, EARLIER_TEMPLATE):
        files += sorted(
            os.path.basename(p) for p in glob.glob(os.path.join(run_dir, pattern.format(step="*")))
        )
    files += sorted(os.path.basename(p) for p in glob.glob(os.path.join(run_dir, "events.out.tfevents.*")))
    files += [WANDB_FILES] if os.path.isdir(os.path.join(run_dir, WANDB_FILES)) else []
    committed, unfinished = checkpoint_lib.list_steps(checkpoint_lib.checkpoint_dir(run_dir))
    return History(run_dir, files, _last_metrics_step(os.path.join(run_dir, METRICS)), committed, unfinished)


# --- Deciding ---------------------------------------------------------------------------------


@dataclasses.dataclass
class Start:
    step: int | None  # the checkpoint to resume from; None: a fresh run
    move: list[str]  # paths relative to run_dir, moved into the `replaced-` directory
    copy: list[str]  # paths relative to run_dir, copied there (metrics.jsonl, before truncation)


def plan(resume: str, history: History, problem) -> Start:
    """What a start with `train.resume=resume` does in a directory holding `history`.
    `problem(step)` says why a committed checkpoint cannot be used (None: intact); it is called
    newest first and only as far as needed (checking a checkpoint reads all of it)."""
    if not history.used:
        return Start(None, [], [])
    ckpt = os.path.basename(checkpoint_lib.checkpoint_dir(history.run_dir))
    if resume == "never":
        has_ckpt = os.path.isdir(os.path.join(history.run_dir, ckpt))
        return Start(None, history.files + ([ckpt] if has_ckpt else []), [])

    def why(step: int) -> str | None:
        if step not in history.checkpoints:
            return (
                "its save never committed (the run stopped while writing it)"
                if step in history.unfinished
                else "there is no such checkpoint"
            )
        return problem(step)

    if resume == "auto":
        problems = {}
        for step in sorted(set(history.checkpoints) | set(history.unfinished), reverse=True):
            problems[step] = why(step)
            if problems[step] is None:
                return Start(step, [], [])
            warnings.warn(
                f"checkpoint step {step} in {checkpoint_lib.checkpoint_dir(history.run_dir)} "
                f"is unusable: {problems[step]}; falling back to the previous one",
                checkpoint_lib.CheckpointWarning,
                stacklevel=2,
            )
        reasons = (
            "; ".join(f"step {s}: {p}" for s, p in problems.items())
            if problems
            else "no checkpoint was written (the earlier run stopped before its first save)"
        )
        raise ConfigError(
            f"train.run_dir={history.run_dir} holds an earlier run ({history.describe()}) but "
            f"nothing to resume from: {reasons}. To start over there, set train.resume=never (the "
            f"earlier run's files are moved into {REPLACED}<time>/ inside it, nothing is deleted), "
            f"or use another train.run_dir"
        )
    step = int(resume)
    if (reason := why(step)) is not None:
        usable = [s for s in history.checkpoints if problem(s) is None]
        raise ConfigError(
            f"train.resume={step}: that checkpoint cannot be used ({reason}); complete checkpoints: {usable}"
        )
    later = sorted(s for s in set(history.checkpoints) | set(history.unfinished) if s > step)
    names = os.listdir(os.path.join(history.run_dir, ckpt)) if later else []
    moved = [
        os.path.join(ckpt, name)
        for s in later
        for name in names
        if name == str(s) or name.startswith(f"{s}{checkpoint_lib.TMP_SUFFIX}")
    ]
    copied = [METRICS] if later and METRICS in history.files else []
    return Start(step, moved, copied)


def set_aside(run_dir: str, start: Start) -> str | None:
    """Moves (and copies) what `start` names into a new `<run_dir>/replaced-<UTC time>/`;
    returns that directory, or None when there was nothing to set aside."""
    if not start.move and not start.copy:
        return None
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%d-%H%M%S")
    target = os.path.join(run_dir, REPLACED + stamp)
    n = 1
    while os.path.exists(target):
        n += 1
        target = os.path.join(run_dir, f"{REPLACED}{stamp}-{n}")
    for rel in start.copy:
        os.makedirs(os.path.dirname(os.path.join(target, rel)), exist_ok=True)
        shutil.copy2(os.path.join(run_dir, rel), os.path.join(target, rel))
    for rel in start.move:
        os.makedirs(os.path.dirname(os.path.join(target, rel)), exist_ok=True)
        os.replace(os.path.join(run_dir, rel), os.path.join(target, rel))
    return target


# --- The data a run trained on --------------------------------------------------------------------


def _path(value, keep: str = ""):
    """A recorded path made absolute as `jaxpar.config.resolve_paths` makes it (a record from
    before config.yaml stored absolute paths: relative to this directory)."""
    if not isinstance(value, str) or value == keep:
        return value
    return os.path.abspath(os.path.expanduser(value))


def _setting(tree, key: str):
    for part in key.split("."):
        if not isinstance(tree, dict) or part not in tree:
            return _ABSENT
        tree = tree[part]
    if key == "data.sources" and isinstance(tree, list):  # a source's name is only its label
        return [
            {"path": _path(s.get("path")), "weight": s.get("weight")} if isinstance(s, dict) else s
            for s in tree
        ]
    if key in ("data.source", "data.tokenizer"):
        return _path(tree, "stdlib" if key == "data.source" else "byte")
    return tree


_ABSENT = object()


def data_changes(run_dir: str, settings: dict) -> list[tuple[str, object, object]]:
    """(key, recorded value, value in `settings`) for each of DATA_KEYS that `settings` (a
    config as `jaxpar.config.to_dict` gives it) sets otherwise than the run's record
    (`<run_dir>/config.yaml`). Keys the record lacks (an older jaxpar's) are no change, except
    those RECORD_BEFORE gives the value of (on either side); no readable record is none. The chat
    template's text is compared too (`_template_change`): a file edited in place keeps its path."""
    try:
        with open(os.path.join(run_dir, RECORD)) as f:
            recorded = yaml.safe_load(f)
    except (OSError, yaml.YAMLError):
        return []
    changes = []
    for key in DATA_KEYS:
        was, now = (_setting(tree, key) for tree in (recorded, settings))
        was, now = (RECORD_BEFORE.get(key, _ABSENT) if v is _ABSENT else v for v in (was, now))
        if was is not _ABSENT and was != now:
            changes.append((key, was, now))
    if all(key != "data.chat_template" for key, _, _ in changes):
        changes += _template_change(run_dir, settings)
    return changes


TEMPLATE_TEXT = "data.chat_template's text"  # the key of a change of the template's text alone


def _digest(text: str) -> str:
    return "sha256 " + hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


def _template_change(run_dir: str, settings: dict) -> list[tuple[str, str, str]]:
    """[(TEMPLATE_TEXT, the kept text's digest, the current one's)] when the chat template the
    run would render with now (`jaxpar.corpus.data.training_template`: data.chat_template's file, or
    the one its prepared data recorded) is not the text kept in `<run_dir>/chat_template.jinja`,
    which the earlier steps were rendered with; [] when it is, or where either is missing."""
    kept_path = os.path.join(run_dir, TEMPLATE)
    if not os.path.isfile(kept_path):
        return []
    from jaxpar import config as config_lib
    from jaxpar.corpus import data as data_lib  # grain: only where a run kept a template

    data = config_lib.build_config({"data": settings.get("data") or {}}).data
    template = data_lib.training_template(data)
    with open(kept_path, encoding="utf-8", errors="replace") as f:
        kept = f.read()
    if template is None or template.source == kept:
        return []
    return [
        (
            TEMPLATE_TEXT,
            f"{_digest(kept)}, kept in {kept_path}",
            f"{_digest(template.source)}, {template.origin}",
        )
    ]


def data_change_error(changes, run_dir: str, step: int) -> ConfigError:
    """The refusal of a resume onto other data: both values of each changed key, what to do."""

    def show(value) -> str:
        return repr(value) if isinstance(value, str) else json.dumps(value)

    what = ", ".join(f"{key}={show(now)} (the run trained on {show(was)})" for key, was, now in changes)
    restore = (
        f" (for the template, its text as {os.path.join(run_dir, TEMPLATE)} keeps it)"
        if any(key == TEMPLATE_TEXT for key, _, _ in changes)
        else ""
    )
    template = (
        f", its chat template as {EARLIER_TEMPLATE.format(step=step)}"
        if os.path.isfile(os.path.join(run_dir, TEMPLATE))
        else ""
    )
    return ConfigError(
        f"{what}: checkpoint step {step} in train.run_dir={run_dir} keeps the position of the "
        f"first {step} global batches in the data its {RECORD} names, which other data would not "
        f"continue; resume with the recorded settings{restore}, start a new run (another "
        f"train.run_dir, or train.resume=never), or set data.allow_source_change=true to go on "
        f"with the new data ({RECORD} then records it, and the earlier one is kept as "
        f"{EARLIER_RECORD.format(step=step)}{template})"
    )


def _earlier_names(run_dir: str, step: int) -> tuple[str, str]:
    """The paths of the copies `keep_record` makes before a resume from `step`: EARLIER_RECORD
    and EARLIER_TEMPLATE, with -2, -3, ... after the step where an earlier resume from the same
    step has kept its own (never overwritten: they are the only record of what those steps
    read)."""
    n = 1
    while True:
        step_name = str(step) if n == 1 else f"{step}-{n}"
        names = [os.path.join(run_dir, p.format(step=step_name)) for p in (EARLIER_RECORD, EARLIER_TEMPLATE)]
        if not any(os.path.lexists(name) for name in names):
            return names[0], names[1]
        n += 1


def keep_record(run_dir: str, step: int) -> str:
    """Copies the run's record to `config.until-step-<step>.yaml`, and its chat template (if it
    kept one) to `chat_template.until-step-<step>.jinja`, before the resume onto other data
    rewrites them (a numbered name where such copies exist: `_earlier_names`); returns the
    record's copy's path, and says where the template's copy is."""
    record, template = _earlier_names(run_dir, step)
    shutil.copy2(os.path.join(run_dir, RECORD), record)
    if os.path.isfile(os.path.join(run_dir, TEMPLATE)):
        shutil.copy2(os.path.join(run_dir, TEMPLATE), template)
        print(
            f"data.allow_source_change: the chat template the first {step} steps were rendered "
            f"with is kept as {template}",
            file=sys.stderr,
        )
    return record
