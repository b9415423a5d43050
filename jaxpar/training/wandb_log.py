"""Weights & Biases beside metrics.jsonl and TensorBoard: `train.wandb.*` (jaxpar.config.WandbConfig).

`start` opens the W&B run on process 0 (the caller's choice: the loop makes its writer there
alone); `MetricsWriter` hands the sink every record it writes into metrics.jsonl, which the
sink logs unchanged (the same keys, nested `tokens_seen` included) at W&B step = the record's
`step`. The run's config is the whole resolved config, plus a `layout` entry: the mesh sizes as
resolved for the devices and the parallel settings, with `chosen_by` saying who chose them (today
always the config's mesh.* settings; an automatic layout would put its reasoning there).

One run directory, one W&B run: the W&B run id is kept in `<run_dir>/wandb-run-id` (ID_FILE),
written before the W&B run starts, and every later start in the directory (a resume) continues
that run (`resume="allow"`). `train.resume=never` moves the file aside with the earlier run's
other files (jaxpar.run.rundir), so the new run gets a new id. W&B's own files go under
`<run_dir>/wandb/` unless WANDB_DIR names another directory.

W&B's steps only go forward: on resuming an online run whose history already reaches past the
checkpoint, the rerun steps' records are not sent again (one line says so); metrics.jsonl and
TensorBoard replace theirs. Offline runs know no history and log every record.

W&B never stops training: without the wandb package, without a login in online mode (checked
without a prompt and without the network), or when W&B fails to start or to log, one line on
stderr says so and what to do, and the run goes on without it. W&B's own console messages are
silenced (`silent`), its console capture is off, and its start and final upload wait at most
INIT_TIMEOUT_S and FINISH_TIMEOUT_S (what is not uploaded stays on disk for `wandb sync`).
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
import math
import os
import secrets
import string
import sys

from jaxpar.config import Config, to_dict

MIN_VERSION = "0.31"  # wandb.login(prompt=False): a login check that never prompts
ID_FILE = "wandb-run-id"  # in the run directory: the W&B run id every start there continues
INIT_TIMEOUT_S = 30.0  # the longest wandb.init waits for the server
FINISH_TIMEOUT_S = 60.0  # the longest the final upload may take; the rest stays on disk


def layout(cfg: Config, sizes: dict[str, int]) -> dict:
    """The layout entry of the W&B config: the mesh axis sizes as resolved for the devices (a -1
    filled in), the device count, the parallel settings, and who chose them."""
    return {
        "mesh": dict(sizes),
        "devices": math.prod(sizes.values()),
        "parallel": dataclasses.asdict(cfg.parallel),
        "chosen_by": "the config's mesh.* settings",
    }


def _say(text: str) -> None:
    print(f"W&B: {text}", file=sys.stderr, flush=True)


def _run_id(run_dir: str) -> tuple[str, bool]:
    """(the W&B run id kept in the run directory, whether it was there already); a new one (8
    lowercase letters and digits, as W&B makes them) is written first."""
    path = os.path.join(run_dir, ID_FILE)
    try:
        with open(path) as f:
            kept = f.read().strip()
    except FileNotFoundError:
        kept = ""
    if kept:
        return kept, True
    new = "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(8))
    with open(path, "w") as f:
        f.write(new + "\n")
    return new, False


def _logged_in(wandb) -> bool:
    """Whether W&B has credentials for online mode (WANDB_API_KEY, ~/.netrc, its settings, an
    identity token file): W&B's own lookup, with no prompt and no request to the server. W&B's
    messages are silenced for the process first (the lookup would otherwise ask the server who
    is logged in, to say so)."""
    wandb.setup(settings=wandb.Settings(silent=True))
    return bool(wandb.login(prompt=False, verify=False))


def start(cfg: Config, sizes: dict[str, int]) -> WandbSink | None:
    """The W&B run of `cfg` (a resolved config: train.run_dir absolute), or None where
    train.wandb.project is empty, mode is disabled, or W&B cannot start (one line says why)."""
    w, run_dir = cfg.train.wandb, cfg.train.run_dir
    if not w.project or w.mode == "disabled":
        return None
    try:
        import wandb
    except ImportError:
        _say(
            f"train.wandb.project={w.project} is set, but the wandb package is not installed: "
            "pip install wandb (or jaxpar's extra: pip install -e '.[wandb]'); training goes on "
            "without W&B"
        )
        return None
    if "prompt" not in inspect.signature(wandb.login).parameters:
        _say(
            f"wandb {wandb.__version__} is older than {MIN_VERSION}, whose login check never prompts: "
            "pip install -U wandb; training goes on without W&B"
        )
        return None
    try:
        if w.mode == "online" and not _logged_in(wandb):
            _say(
                "no login for train.wandb.mode=online: run `wandb login` (or set WANDB_API_KEY), or "
                "log to files with train.wandb.mode=offline; training goes on without W&B"
            )
            return None
        run_id, resumed = _run_id(run_dir)
        run = wandb.init(
            project=w.project,
            entity=w.entity or None,
            name=w.name or os.path.basename(os.path.normpath(run_dir)),
            tags=list(w.tags) or None,
            mode=w.mode,
            id=run_id,
            resume="allow",
            dir=None if os.environ.get("WANDB_DIR") else run_dir,
            config={**to_dict(cfg), "layout": layout(cfg, sizes)},
            allow_val_change=True,  # a resume may change settings (train.steps raised)
            settings=wandb.Settings(
                silent=True,
                console="off",
                init_timeout=INIT_TIMEOUT_S,
                finish_timeout=FINISH_TIMEOUT_S,
            ),
        )
        where = (
            f"at {run.url}"
            if w.mode == "online"
            else f"offline in {run.settings.sync_dir} (upload it with `wandb sync {run.settings.sync_dir}`)"
        )
    except Exception as e:  # W&B's failures are many kinds of error; none may stop training
        _say(f"could not start ({_first_line(e)}); training goes on without W&B")
        return None
    _say(f"{'continuing' if resumed else 'started'} run {run.id} {where}")
    return WandbSink(run)


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0]}" if text else type(error).__name__


class WandbSink:
    """Logs each metrics.jsonl record to a W&B run, at W&B step = the record's step."""

    def __init__(self, run):
        self.run = run
        # An online run resumed from the server: the next step its history accepts.
        self.first_step = run.starting_step
        self._said_behind = False

    def write(self, record: dict) -> None:
        if self.run is None:
            return
        step = record["step"]
        if step < self.first_step:
            if not self._said_behind:
                self._said_behind = True
                _say(
                    f"run {self.run.id} already holds steps up to {self.first_step - 1}: the "
                    f"records of the rerun steps before {self.first_step} are not sent again "
                    "(W&B's steps only go forward)"
                )
            return
        try:
            self.run.log(copy.deepcopy(record), step=step)  # the writer's record stays its own
        except Exception as e:  # any failure: W&B stops, training goes on
            _say(f"logging failed ({_first_line(e)}); training goes on without W&B")
            self._stop(exit_code=1)

    def close(self) -> None:
        """Finishes the W&B run: failed (exit code 1) when called while an exception is on its way
        out (the loop's `finally`), else finished."""
        self._stop(exit_code=0 if sys.exception() is None else 1)

    def _stop(self, exit_code: int) -> None:
        run, self.run = self.run, None
        if run is None:
            return
        try:
            run.finish(exit_code=exit_code)
        except Exception as e:
            _say(f"could not finish run {run.id} ({_first_line(e)})")
