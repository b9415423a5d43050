"""`python -m jaxpar.train [CONFIG.yaml] [dotted.key=value ...]`: the training loop.

The data path is one way: config -> mesh -> sharded state (born sharded, inside a jitted init)
-> jitted train step (state, batch) -> (state, metrics) -> writers. Everything up to the compiled
step is jaxpar.training.trainer's `build_trainer`; this module runs it: data, resume, checkpoints,
evaluation, metrics, stopping on a signal, and the command line.
"""

from __future__ import annotations

import dataclasses
import errno
import functools
import json
import os
import shutil
import signal
import sys
import threading
import time
from typing import Any

import jax
import numpy as np

from jaxpar import cli
from jaxpar import config as config_lib
from jaxpar.config import Config, ConfigError
from jaxpar.hf import base as base_lib
from jaxpar.hf import convert as convert_lib
from jaxpar.models.attention import documents_per_row
from jaxpar.planning import host as host_lib
from jaxpar.run import rundir as rundir_lib
from jaxpar.run.startup import load_and_validate
from jaxpar.training import checkpoint as checkpoint_lib
from jaxpar.training import metrics as metrics_lib
from jaxpar.training.optim import lr_schedule
from jaxpar.training.trainer import Trainer, build_trainer

# --- The learning-rate schedule on resume ------------------------------------------------


SCHEDULE_KEYS = ("train.steps", "optimizer.lr", "optimizer.warmup_steps", "optimizer.min_lr_ratio")


def _schedule_change(cfg: Config, run_dir: str, start: int) -> str | None:
    """On resume: a note when the learning-rate schedule's settings differ from those the run was
    saved with (its config.yaml, read before it is rewritten). The schedule is a function of them,
    so raising train.steps after a finished run restarts the cosine from higher up; say so."""
    try:
        saved = config_lib.load_config(os.path.join(run_dir, "config.yaml"))
    except (ConfigError, OSError):
        return None
    value = lambda c, key: getattr(getattr(c, key.split(".")[0]), key.split(".")[1])
    changed = [
        f"{key} {value(saved, key)} -> {value(cfg, key)}"
        for key in SCHEDULE_KEYS
        if value(saved, key) != value(cfg, key)
    ]
    if not changed or start >= cfg.train.steps:  # nothing to train: nothing to say
        return None
    before, after = float(lr_schedule(saved)(start)), float(lr_schedule(cfg)(start))
    if f"{before:.2e}" == f"{after:.2e}":
        return None
    return (
        f"note: {', '.join(changed)} since the run was saved: the learning-rate schedule is "
        f"recomputed for the new settings, so update {start + 1} runs at {after:.2e} where the "
        f"saved schedule had {before:.2e}"
    )


# --- The loop -------------------------------------------------------------------------------


def make_data(cfg: Config):
    from jaxpar.corpus import data as data_lib  # grain stays out of compile-only users (inspect, bench)

    tokenizer = data_lib.make_tokenizer(cfg.data)
    if tokenizer.vocab_size > cfg.model.vocab_size:
        raise ConfigError(
            f"model.vocab_size={cfg.model.vocab_size} is smaller than the tokenizer's vocabulary "
            f"({tokenizer.vocab_size}); raise model.vocab_size"
        )
    # Prepared shards (a directory, or the whole stdlib, cached) are memory-mapped; other sources
    # are read and packed in memory. Either way the same documents give the same batches. A
    # mixture (data.sources) interleaves several prepared directories.
    packed = data_lib.training_source(cfg.data, tokenizer, cfg.train.seq_len)
    return data_lib.batch_dataset(
        packed,
        global_batch=cfg.train.batch_size,
        seed=cfg.train.seed,
        shuffle=cfg.data.shuffle,
        process_index=jax.process_index(),
        process_count=jax.process_count(),
    )


def make_eval_data(cfg: Config):
    """The evaluation batches (train.eval_every > 0; else None): this process's rows of
    train.eval_batches batches from the validation split (jaxpar.corpus.data.eval_dataset)."""
    if not cfg.train.eval_every:
        return None
    from jaxpar.corpus import data as data_lib

    return data_lib.eval_dataset(
        cfg.data,
        cfg.train.seq_len,
        global_batch=cfg.train.batch_size,
        batches=cfg.train.eval_batches,
        process_index=jax.process_index(),
        process_count=jax.process_count(),
    )


class Preemption:
    """SIGTERM or SIGINT asks the run to stop: during start-up before the first step (nothing is
    written), in the loop after the current step, with a checkpoint. A second SIGINT stops at
    once: with `exit_at_once` (the command line) the process exits 130 on the spot, without
    unwinding (a crash-free stop even inside a compile or a save; the last committed checkpoint
    is intact), otherwise KeyboardInterrupt is raised.

    With `exit_at_once`, a SIGINT is also seen by a watcher thread the moment it arrives (through
    `signal.set_wakeup_fd`): Python runs its handlers only between bytecodes, so while the main
    thread waits on a step, a handler would wait out the step. When the wait for the next safe
    point (`expected_wait_s`: the forecast or measured time of a step) is longer than `PROMPT_S`,
    the watcher answers the first SIGINT at once: it exits when nothing would be lost (no step
    since the last checkpoint was issued, `unsaved_steps`, as in start-up), else says that the
    run stops after the step with a checkpoint and that a second SIGINT stops now. It exits on a
    second SIGINT whatever the main thread is doing."""

    PROMPT_S = 5.0
    POLL_EVERY = 10  # steps between stop agreements of a multi-process run (see `poll`)

    def __init__(self, exit_at_once: bool = False):
        self.requested: str | None = None
        self.exit_at_once = exit_at_once
        self.expected_wait_s = 0.0
        self.polls = self.agreements = 0  # loop steps polled; all-gathers they made
        self.unsaved_steps = 0  # steps dispatched since the last checkpoint was issued (the loop counts)
        self._previous = {}
        self._wakeup = None  # (read end, write end, the wakeup fd it replaced)

    def _handle(self, signum, frame):
        if self.requested is not None and signum == signal.SIGINT:
            if self.exit_at_once:
                _exit_at_once(
                    b"\ninterrupted again: stopped at once, without a checkpoint (the "
                    b"last complete one, if any, is intact)\n"
                )
            raise KeyboardInterrupt
        self.requested = signal.Signals(signum).name

    def _watch(self, read_end: int) -> None:
        interrupts = 0
        while chunk := os.read(read_end, 64):  # b"" once __exit__ closes the write end
            interrupts += chunk.count(signal.SIGINT)
            if interrupts >= 2:
                _exit_at_once(
                    b"\ninterrupted again: stopped at once, without a checkpoint (the "
                    b"last complete one, if any, is intact)\n"
                )
            if interrupts == 1 and self.expected_wait_s > self.PROMPT_S:
                self._answer_long_wait()
        os.close(read_end)

    def _answer_long_wait(self) -> None:
        """The first Ctrl-C while a step-sized wait is ahead: with nothing to lose (no step since
        the last checkpoint was issued, as in start-up) stop at once; otherwise say at once what
        waiting saves and that a second Ctrl-C stops now."""
        wait = f"about {self.expected_wait_s:.0f} s"
        if self.unsaved_steps == 0:
            _exit_at_once(
                f"\nstopped at once: a step takes {wait} here and no step had run since the last "
                "checkpoint (if any), so nothing was lost; the same command resumes from it, or "
                "starts over with train.resume=never where there is none\n".encode()
            )
        os.write(
            2,
            f"\nCtrl-C: stopping after the step in flight ({wait} per step) with a "
            f"checkpoint of the {self.unsaved_steps} step(s) since the last one; Ctrl-C "
            "again stops at once and loses them\n".encode(),
        )

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._previous[sig] = signal.signal(sig, self._handle)
            if self.exit_at_once:
                read_end, write_end = os.pipe()
                os.set_blocking(write_end, False)
                replaced = signal.set_wakeup_fd(write_end, warn_on_full_buffer=False)
                self._wakeup = (read_end, write_end, replaced)
                threading.Thread(
                    target=self._watch, args=(read_end,), daemon=True, name="jaxpar-interrupt-watcher"
                ).start()
        return self

    def __exit__(self, *exc):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        if self._wakeup is not None:
            read_end, write_end, replaced = self._wakeup
            signal.set_wakeup_fd(replaced)
            os.close(write_end)  # the watcher's read returns b"": it closes the read end and ends
            self._wakeup = None

    def agreed(self) -> str | None:
        """The stop request, agreed by every process (signals reach nodes at different times; all
        must stop after the same step, or one waits forever in the next step's collectives)."""
        if jax.process_count() == 1:
            return self.requested
        from jax.experimental import multihost_utils

        anyone = multihost_utils.process_allgather(np.int32(self.requested is not None)).any()
        return (self.requested or "SIGTERM (on another process)") if anyone else None

    def poll(self, step: int, host_waits: bool) -> str | None:
        """The agreed stop request after `step`. One process: every step (nothing to agree on).
        Several: agreeing is a blocking all-gather, a host sync that would drain the queue of
        dispatched steps, so it is made only where the host waits on the device anyway
        (`host_waits`: a logged or saved step) and every `POLL_EVERY` steps; every process
        takes the same decision at the same steps. A signal waits at most that many steps."""
        self.polls += 1
        if jax.process_count() == 1 or host_waits or step % self.POLL_EVERY == 0:
            self.agreements += jax.process_count() > 1
            return self.agreed()
        return None

    def check_startup(self, before_step: int) -> None:
        """Raises `Interrupted` if a stop was asked for during start-up (on any process: every
        process passes the same checks in the same order)."""
        if (signame := self.agreed()) is not None:
            raise Interrupted(signame, before_step)


_EXITING = threading.Lock()  # the watcher and the signal handler may both decide to exit


def _exit_at_once(message: bytes) -> None:
    if _EXITING.acquire(blocking=False):  # one message: the other caller waits to be ended
        os.write(2, message)
        os._exit(130)
    time.sleep(60)


class Interrupted(Exception):
    """A signal stopped the run during start-up, before its first step: nothing was trained."""

    def __init__(self, signame: str, before_step: int):
        super().__init__(
            f"stopped by {signame} during start-up, before step {before_step}: "
            f"nothing trained or saved; run the same command to start again"
        )
        self.signame = signame


class NonFiniteLoss(RuntimeError):
    """The loss became NaN or infinite (train.on_nan=stop)."""


class DiskFull(RuntimeError):
    """No space left where the run writes; the message is one line that says what to do."""


def _no_space(error: BaseException) -> bool:
    """Whether `error` (or what caused it) is ENOSPC: an OSError, or the message orbax's writers
    (tensorstore) pass on from the file system."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, OSError) and error.errno == errno.ENOSPC:
            return True
        if "No space left on device" in str(error) or "os_error_code='28'" in str(error):
            return True
        error = error.__cause__ or error.__context__
    return False


def _megabytes(n: float) -> str:
    return f"{n / 2**20:,.1f} MB"


def _on_main(fn, what: str):
    """Runs `fn` (an int or None, or a ConfigError) on process 0 only; every process returns its
    outcome: the run directory is decided once, by the process that writes its files."""
    result = error = None
    if jax.process_index() == 0:
        try:
            result = fn()
        except ConfigError as e:
            error = e
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        code = -2 if error is not None else (-1 if result is None else int(result))
        code = int(multihost_utils.broadcast_one_to_all(np.int32(code)))
        if jax.process_index() != 0:
            if code == -2:
                raise ConfigError(f"{what}: process 0 refused it (its output says why)")
            result = None if code == -1 else code
    if error is not None:
        raise error
    return result


def _data_iterator(dataset, data_state: dict | None, start: int):
    """The batch stream from step `start`: grain's own state when it was saved by as many
    processes as there are now, else the position (the global sample order is the same)."""
    from jaxpar.corpus import data as data_lib

    if data_state and data_state.get("process_count") == jax.process_count():
        return data_lib.make_iterator(dataset, data_state["grain"])
    return data_lib.make_iterator(dataset[start:])


def _check_documents_per_row(segment_ids: np.ndarray, limit: int, step: int) -> int:
    """The most documents a row of the batch holds, over every process's rows (all processes
    must run the step of the same slot bucket, `Trainer.step_for`, and all must stop together).
    cuDNN's packed attention describes at most `limit` documents per row; refuse a batch with a
    fuller row, with the numbers, before the step."""
    most = int(documents_per_row(segment_ids).max())
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        most = int(multihost_utils.process_allgather(np.int32(most)).max())
    if most > limit:
        raise ConfigError(
            f"the batch of step {step} has a row of {most} documents, more than "
            f"model.max_documents_per_row={limit} (cuDNN attention takes each row's documents as "
            f"offsets; under data.packing=whole a row's padding counts as one); set "
            f"model.max_documents_per_row={most} or more, or model.attention=xla"
        )
    return most


def _keep_metrics_until(run_dir: str, step: int) -> None:
    """On resume, drop metrics.jsonl lines of steps after the checkpoint (they are rerun).

    A line that does not parse (what a crash in the middle of a write leaves, normally the last)
    is dropped with a warning instead of stopping the resume. The file is rewritten atomically:
    a crash here leaves either the old file or the new one."""
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.exists(path):
        return
    kept, garbled = [], []
    with open(path) as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                keep = record["step"] <= step
            except (json.JSONDecodeError, KeyError, TypeError):
                garbled.append(number)
                continue
            if keep:
                kept.append(line if line.endswith("\n") else line + "\n")
    if garbled:
        print(
            f"warning: {path}: dropped {len(garbled)} unreadable line(s) ({', '.join(map(str, garbled[:5]))}"
            f"{', ...' if len(garbled) > 5 else ''}), e.g. a write cut short by a crash",
            file=sys.stderr,
        )
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.writelines(kept)
    os.replace(tmp, path)


def _check_data_position(cfg: Config, saved: dict | None, step: int) -> None:
    """The data position saved with checkpoint `step` (a count of global batches) means the same
    sequences only with the same batch size and sequence length, and the same data and seed as
    the run's config.yaml records (jaxpar.run.rundir.DATA_KEYS): refuse a resume that changes them,
    unless data.allow_source_change, which keeps the earlier record beside the new one.
    (Checkpoints from before batch size and length were saved carry neither: not checked.)"""
    t = cfg.train
    for key, now in (("batch_size", t.batch_size), ("seq_len", t.seq_len)):
        was = (saved or {}).get(key)
        if was is not None and was != now:
            raise ConfigError(
                f"train.{key}={now}, but checkpoint step {step} was written with train.{key}="
                f"{was}: its data position (the first {step} global batches) would no longer name "
                f"the same data; resume with train.{key}={was}, or start a new run (another "
                f"train.run_dir, or train.resume=never)"
            )
    if changes := rundir_lib.data_changes(t.run_dir, config_lib.to_dict(cfg)):
        if not cfg.data.allow_source_change:
            raise rundir_lib.data_change_error(changes, t.run_dir, step)
        kept = rundir_lib.keep_record(t.run_dir, step)
        print(
            f"data.allow_source_change: resuming step {step} on other data "
            f"({', '.join(key for key, _, _ in changes)}); the earlier config.yaml is kept as "
            f"{kept}",
            file=sys.stderr,
        )


def _checkpoint_bytes(ckpt: checkpoint_lib.Checkpointer, state_shape) -> int:
    """What one more checkpoint takes on disk: the newest committed one's size, else the train
    state's bytes (an upper bound: orbax may compress)."""
    for step in reversed(ckpt.all_steps()):
        root = os.path.join(ckpt.directory, str(step))
        return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(root) for f in files)
    return sum(x.size * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(state_shape))


def _disk_full(ckpt, trainer, run_dir: str, at: int | None = None) -> DiskFull:
    """The one-line report of a full disk: where, how much a checkpoint needs, what is intact."""
    if ckpt is None:
        return DiskFull(
            f"no space left on the device of {run_dir}; free some space and run the same command again"
        )
    needed = _checkpoint_bytes(ckpt, trainer.stored(trainer.state_shape))
    free = shutil.disk_usage(ckpt.directory).free
    intact = ckpt.latest_intact_step()
    kept = (
        f"the previous checkpoint (step {intact}) is intact"
        if intact is not None
        else "no checkpoint was complete yet"
    )
    what = "a checkpoint" if at is None else f"checkpoint step {at}"
    return DiskFull(
        f"no space left on the device of {ckpt.directory}: {what} needs about "
        f"{_megabytes(needed)}, {_megabytes(free)} is free; {kept}; free some space "
        f"and run the same command to resume"
    )


def train(cfg: Config, sizes: dict[str, int], preemption: Preemption | None = None) -> dict:
    """Runs training (resuming from run_dir's checkpoints); returns a summary. Writes config.yaml,
    metrics.jsonl, TensorBoard events, loss.png and checkpoints into train.run_dir, whose rules
    (one run's history, one run at a time) are jaxpar.run.rundir's. `preemption`: the signal handler
    the caller installed (the CLI, from its first moment); by default one is installed here."""
    if preemption is None:
        with Preemption() as preemption:
            return train(cfg, sizes, preemption)
    cfg = config_lib.resolve_paths(cfg)  # config.yaml stores absolute paths
    t = cfg.train
    config_lib.check_run_dir(t.run_dir)
    dataset = make_data(cfg)  # before compiling: data errors are config errors
    eval_data = make_eval_data(cfg)
    preemption.check_startup(1)
    trainer = build_trainer(cfg, sizes)
    preemption.check_startup(1)
    is_main = jax.process_index() == 0
    if is_main:
        print(config_lib.precision_line(cfg), file=sys.stderr, flush=True)
    lock = rundir_lib.RunLock(t.run_dir)
    ckpt, finished = None, False
    no_space_logs = checkpoint_lib.DropNoSpace().__enter__()
    try:
        _on_main(lock.acquire, f"train.run_dir={t.run_dir}")
        resume = _on_main(lambda: _resume_step(cfg), f"train.run_dir={t.run_dir}")
        ckpt = checkpoint_lib.Checkpointer(
            checkpoint_lib.checkpoint_dir(t.run_dir),
            keep=cfg.checkpoint.keep,
            every=cfg.checkpoint.every,
            verified={} if resume is None else {resume: None},
        )
        state, data_state, start = _initial_state(cfg, trainer, ckpt, resume, is_main)
        preemption.check_startup(start + 1)
        if is_main and start < t.steps:  # a run with nothing to do keeps the record it has
            config_lib.dump_yaml(cfg, os.path.join(t.run_dir, "config.yaml"))
            from jaxpar.corpus import data as data_lib

            data_lib.save_run_template(cfg.data, t.run_dir)  # what `sample --chat` renders with
        summary = _loop(cfg, sizes, trainer, ckpt, dataset, state, data_state, start, preemption, eval_data)
        finished = True
        return summary
    except Exception as e:
        if _no_space(e) and not isinstance(e, DiskFull):
            raise _disk_full(ckpt, trainer, t.run_dir) from None
        raise
    finally:
        try:
            if ckpt is not None:
                _close(ckpt, trainer, t.run_dir, report=finished)
        finally:
            if is_main:  # no collective here: this also runs when only this process failed
                lock.release()
            no_space_logs.__exit__()


def _resume_step(cfg: Config) -> int | None:
    """The checkpoint step this run resumes from, or None for a new run (train.resume and the run
    directory's history, jaxpar.run.rundir); what is not resumed is moved aside first. Run on
    process 0 alone: it is refused before anything is moved, and without an orbax manager, whose
    opening waits for every process."""
    t = cfg.train
    history = rundir_lib.survey(t.run_dir)
    start = rundir_lib.plan(
        t.resume,
        history,
        lambda step: checkpoint_lib.manifest_problem(
            os.path.join(checkpoint_lib.checkpoint_dir(t.run_dir), str(step))
        ),
    )
    if start.step is not None:
        _check_data_position(
            cfg,
            checkpoint_lib.Checkpointer.saved_data_state(
                checkpoint_lib.checkpoint_dir(t.run_dir), start.step
            ),
            start.step,
        )
    if (aside := rundir_lib.set_aside(t.run_dir, start)) is not None:
        what = (
            "the earlier run's files"
            if start.step is None
            else f"the checkpoints after step {start.step} (and a copy of metrics.jsonl)"
        )
        print(f"train.resume={t.resume}: moved {what} into {aside}", file=sys.stderr)
    return start.step


def _initial_state(
    cfg: Config, trainer: Trainer, ckpt, resume: int | None, is_main: bool
) -> tuple[Any, dict | None, int]:
    """(train state, saved data position, first step): checkpoint `resume` restored onto this
    run's shardings (from any mesh); else train.init_from's weights on this mesh with a fresh
    optimizer at step 0; else a fresh init."""
    t = cfg.train
    if resume is not None and convert_lib.holds_imported_weights(t.run_dir, resume):
        raise ConfigError(
            f"train.run_dir={t.run_dir} holds imported weights (python -m jaxpar.convert "
            f"from-hf), not a run to resume; train from them in a new run directory with "
            f"train.init_from={t.run_dir}"
        )
    if resume is not None:
        state, data_state, start = base_lib.restore(trainer, ckpt, resume)
        if is_main:
            _keep_metrics_until(t.run_dir, start)
            print(f"resumed from step {start} ({ckpt.directory})", file=sys.stderr)
            if (note := _schedule_change(cfg, t.run_dir, start)) is not None:
                print(note, file=sys.stderr)
        return state, data_state, start
    if t.init_from is not None:
        state = base_lib.init_state(trainer, t.init_from)
        if is_main:
            print(f"initialised from {t.init_from}", file=sys.stderr)
        return state, None, 0
    if trainer.trainable is not None and is_main:
        print(
            "finetune.lora without train.init_from: the frozen base is this run's random init "
            f"(train.seed={t.seed}); only the adapters train",
            file=sys.stderr,
        )
    return trainer.init(), None, 0


def _close(ckpt, trainer: Trainer, run_dir: str, report: bool) -> None:
    """Closes the checkpointer, waiting for a save in flight. A save that failed only now (orbax
    writes in the background) is raised when `report` (the run finished: nothing else is on its
    way out), as a full disk where it is one; otherwise the error already leaving wins."""
    try:
        ckpt.close()
    except Exception as e:
        if not report:
            return
        if _no_space(e):
            raise _disk_full(ckpt, trainer, run_dir) from None
        raise


def _evaluate(trainer: Trainer, params, eval_data) -> float:
    """eval_loss: the summed NLL over all tokens of the evaluation batches, read from a fresh
    iterator (the same batches every time), divided by their token count."""
    from jaxpar.corpus import data as data_lib

    sums = None
    for local in data_lib.make_iterator(eval_data):
        out = trainer.evaluate(params, trainer.shard_batch(local))
        sums = out if sums is None else tuple(a + b for a, b in zip(sums, out))  # on the devices
    nll, count = (float(x) for x in sums)
    return nll / max(count, 1.0)


class _StepClock:
    """Time per step over the window since the last logged step, with the first step (which holds
    the compilation), the compilation of a later slot bucket's step (`compiling`) and any
    evaluation or checkpoint save kept out: each is its own figure."""

    def __init__(self):
        self.started = self.ended = time.perf_counter()
        self.compile_s: float | None = None
        self.window_start, self.window_steps = self.started, 0
        self.eval_s = self.save_s = 0.0  # in all, for the summary

    def stepped(self, metrics) -> None:
        self.window_steps += 1
        if self.compile_s is None:  # the first step holds the compilation: time the rest
            jax.block_until_ready(metrics)
            now = time.perf_counter()
            self.compile_s, self.window_start, self.window_steps = now - self.started, now, 0

    def compiling(self, fn, *args):
        """fn(*args), a step whose program compiles in this call (a new slot bucket,
        `Trainer.step_for`): after the first step, its time (the compilation: the step itself
        runs asynchronously) counts as compile time, kept out of the step window."""
        if self.compile_s is None:  # the first step: `stepped` times its compilation
            return fn(*args)
        start = time.perf_counter()
        result = fn(*args)
        spent = time.perf_counter() - start
        self.window_start += spent
        self.compile_s += spent
        return result

    def timed(self, what: str, fn, *args):
        """Runs fn(*args) with its time kept out of the step window; returns (result, seconds)."""
        start = time.perf_counter()
        result = fn(*args)
        spent = time.perf_counter() - start
        self.window_start += spent
        setattr(self, what, getattr(self, what) + spent)
        return result, spent

    def step_time(self) -> float | None:
        """Mean seconds per step since the last call (None when no step was timed); restarts."""
        now = time.perf_counter()
        mean = (now - self.window_start) / self.window_steps if self.window_steps else None
        self.window_start, self.window_steps = now, 0
        return mean


class _Profiler:
    """`train.profile_steps` [first, last]: a jax.profiler trace from before step `first` to
    after step `last` has run (waited for, so its device work is in the trace), written under
    run_dir/profile/plugins/profile/<time>/ (TensorBoard's layout; Perfetto opens the
    .trace.json.gz). A run stopped inside the window ends the trace there."""

    def __init__(self, steps: list[int] | None, run_dir: str):
        self.first, self.last = steps if steps else (None, None)
        self.directory = os.path.join(run_dir, "profile")
        self.tracing = False

    def before(self, step: int) -> None:
        if step == self.first:
            jax.profiler.start_trace(self.directory)
            self.tracing = True

    def after(self, step: int, metrics) -> None:
        if self.tracing and step == self.last:
            jax.block_until_ready(metrics)
            self.close()

    def close(self) -> None:
        if self.tracing:
            self.tracing = False
            jax.profiler.stop_trace()


def _read_device(metrics, t, step: int, ckpt) -> tuple[float, int]:
    """The step's loss and skipped-step count, read from the device; NonFiniteLoss if the state
    froze on a non-finite value since the last read."""
    loss, first_bad = float(metrics["loss"]), int(metrics["first_bad_step"])
    if first_bad:  # the state is frozen since that step
        what = (
            "the loss, a gradient or the updated weights' norm"
            if t.on_nan == "stop"
            else "the updated weights' norm"
        )
        raise NonFiniteLoss(
            f"{what} became non-finite at step {first_bad} (train.on_nan={t.on_nan}; seen at step "
            f"{step}, the first read of the device since; no later update reached the weights); "
            + _last_good(ckpt)
        )
    return loss, int(metrics["skipped_steps"])


def _last_good(ckpt) -> str:
    """Where a run stopped by a non-finite value can go back to: its newest intact checkpoint."""
    step = ckpt.latest_valid_step()
    if step is None:
        return f"there is no checkpoint yet in {ckpt.directory} (checkpoint.every)"
    return f"the last good checkpoint is step {step} in {ckpt.directory}"


def _record(
    step: int, loss: float, metrics, step_time: float | None, tokens_per_step: int, flops_tok: float, devices
) -> dict:
    """One metrics.jsonl line: the step's figures (the device's extra metrics included)."""
    tokens_per_sec = tokens_per_step / step_time if step_time else None
    return {
        "step": step,
        "loss": loss,
        "tokens_per_sec": tokens_per_sec,
        "mfu": tokens_per_sec and metrics_lib.mfu(tokens_per_sec, flops_tok, devices),
        "step_time_s": step_time,
        "memory_bytes": metrics_lib.device_memory_bytes(jax.local_devices()[0]),
        **{k: float(v) for k, v in metrics.items() if k not in ("loss", "tokens", "first_bad_step")},
    }


def _saver(cfg: Config, trainer: Trainer, ckpt, iterator):
    """save(step, state, force): a checkpoint when `checkpoint.every` (or `force`) says so;
    returns whether one was written."""
    t = cfg.train

    def save(at: int, state, force: bool = False) -> bool:
        if not (force or ckpt.should_save(at)):
            return False
        # Checked before the save starts: orbax's own failure would come later, from a
        # background thread (the previous checkpoint intact, but pages of tracebacks).
        if shutil.disk_usage(ckpt.directory).free < _checkpoint_bytes(
            ckpt, trainer.stored(trainer.state_shape)
        ):
            raise _disk_full(ckpt, trainer, t.run_dir, at)
        data = {
            "grain": iterator.get_state(),
            "process_count": jax.process_count(),
            "seed": t.seed,  # training draws no random numbers: the seed fixes init and data
            "batch_size": t.batch_size,
            "seq_len": t.seq_len,
            **base_lib.record(cfg),  # a LoRA run: the base under its adapters
        }  # what the data position means
        ckpt.save(at, trainer.stored(state), data, force=force)
        return True

    return save


@dataclasses.dataclass
class _Outcome:
    """What a run's loop learned, for its summary."""

    step: int
    first_loss: float | None = None
    loss: float | None = None
    eval_loss: float | None = None
    tokens_seen: dict | None = None
    stopped_by: str | None = None
    skipped_steps: int = 0


def _loop(
    cfg: Config, sizes, trainer: Trainer, ckpt, dataset, state, data_state, start, preemption, eval_data=None
) -> dict:
    """Steps from `start` to train.steps: log, evaluate, save, stop on a signal. Returns the
    summary."""
    from jaxpar.corpus import data as data_lib

    t = cfg.train
    is_main = jax.process_index() == 0
    devices = list(trainer.mesh.devices.flat)
    flops_tok = metrics_lib.flops_per_token(cfg.model, t.seq_len)
    iterator = _data_iterator(dataset, data_state, start)
    # A mixture's samples per source are a function of the global sample count (the mixing is
    # a fixed interleave), so the tokens seen per source need no bookkeeping, and survive a resume.
    source_counts = data_lib.source_counter(cfg.data)
    clock, save = _StepClock(), _saver(cfg, trainer, ckpt, iterator)
    profiler = _Profiler(t.profile_steps, t.run_dir)
    run = _Outcome(step=start)
    writer = metrics_lib.MetricsWriter(t.run_dir, purge_after=start) if is_main else None
    progress = metrics_lib.Progress(t.steps, initial=start, enabled=is_main and t.progress)
    try:
        for run.step in range(start + 1, t.steps + 1):
            step, local = run.step, next(iterator)
            profiler.before(step)
            state, metrics = _step(trainer, clock, state, local, step)
            preemption.unsaved_steps += 1  # dispatched (a first step's compile is not counted)
            clock.stepped(metrics)
            profiler.after(step, metrics)
            evaluated = eval_data is not None and (step % t.eval_every == 0 or step == t.steps)
            logged = step % t.log_every == 0 or step == t.steps or evaluated
            stop = preemption.poll(step, logged or ckpt.should_save(step))
            # The host reads the device only here (logging, saving, stopping), never per step.
            if logged or ckpt.should_save(step) or stop:
                run.loss, run.skipped_steps = _read_device(metrics, t, step, ckpt)
            saved, save_s = clock.timed("save_s", save, step, state, step == t.steps or stop is not None)
            if saved:
                preemption.unsaved_steps = 0
            if not logged:
                progress.update(step, None)
            else:
                step_time = clock.step_time()  # before evaluating: its time is its own figure
                preemption.expected_wait_s = step_time or preemption.expected_wait_s
                record = _record(
                    step, run.loss, metrics, step_time, t.batch_size * t.seq_len, flops_tok, devices
                )
                if saved:
                    record["checkpoint_time_s"] = save_s
                if evaluated:
                    run.eval_loss, record["eval_time_s"] = clock.timed(
                        "eval_s", _evaluate, trainer, state["params"], eval_data
                    )
                    record["eval_loss"] = run.eval_loss
                if source_counts is not None:
                    seen = source_counts(step * t.batch_size)
                    record["tokens_seen"] = run.tokens_seen = {
                        name: n * t.seq_len for name, n in seen.items()
                    }
                run.first_loss = run.loss if run.first_loss is None else run.first_loss
                if writer is not None:
                    writer.write(record)
                progress.update(step, record)
            if stop:
                run.stopped_by = stop
                break
    finally:
        clock.ended = time.perf_counter()  # the plot and the last flush are not training time
        profiler.close()
        preemption.expected_wait_s = 0.0  # the final save's wait is not a step's: no early exit
        progress.close()
        if writer is not None:
            writer.close()
    return _summary(cfg, clock, run, start, devices, sizes, flops_tok)


def _step(trainer: Trainer, clock: _StepClock, state, local: dict, step: int):
    """Dispatches train step `step` on this process's rows `local`: where the step depends on
    the documents per row (`Trainer.bucketed`), checked here first and run by the step of their
    slot bucket, whose first call compiles it (that time is the clock's compile time)."""
    if not trainer.bucketed:
        return trainer.step(state, trainer.shard_batch(local))
    most = _check_documents_per_row(local["segment_ids"], trainer.cfg.model.max_documents_per_row, step)
    made = len(trainer.bucket_steps)
    fn = trainer.step_for(most)
    batch = trainer.shard_batch(local)
    if len(trainer.bucket_steps) > made:
        return clock.compiling(fn, state, batch)
    return fn(state, batch)


def _summary(cfg: Config, clock: _StepClock, run: _Outcome, start: int, devices, sizes, flops_tok) -> dict:
    t = cfg.train
    total_s = clock.ended - clock.started
    run_steps = run.step - start - 1
    run_s = total_s - (clock.compile_s or 0.0) - clock.eval_s - clock.save_s
    tokens_per_sec = t.batch_size * t.seq_len * run_steps / run_s if run_steps > 0 else None
    return {
        "steps": run.step,
        "start_step": start,
        "first_loss": run.first_loss,
        "final_loss": run.loss,
        "seconds": total_s,
        "compile_seconds": clock.compile_s or 0.0,
        "tokens_per_sec": tokens_per_sec,
        "mfu": tokens_per_sec and metrics_lib.mfu(tokens_per_sec, flops_tok, devices),
        "devices": len(devices),
        "mesh": {a: s for a, s in sizes.items() if s > 1} or {"data": 1},
        "run_dir": t.run_dir,
        "stopped_by": run.stopped_by,
        "skipped_steps": run.skipped_steps,
        "eval_loss": run.eval_loss,
        "eval_seconds": clock.eval_s,
        "checkpoint_seconds": clock.save_s,
        "tokens_seen": run.tokens_seen,
    }


def format_summary(s: dict) -> str:
    mesh = " ".join(f"{a}={n}" for a, n in s["mesh"].items())
    if s["stopped_by"]:
        return (
            f"stopped by {s['stopped_by']} after step {s['steps']}: checkpoint written to "
            f"{checkpoint_lib.checkpoint_dir(s['run_dir'])}; run the same command to resume"
        )
    if s["first_loss"] is None:
        return f"nothing to do: {s['run_dir']} is already at step {s['steps']} (train.steps)"
    rate = metrics_lib.format_rate(s["tokens_per_sec"], s["mfu"])
    data = "" if s.get("eval_loss") is None else f" | eval loss {s['eval_loss']:.3f}"
    if seen := s.get("tokens_seen"):
        total = max(sum(seen.values()), 1)
        data += " | tokens seen: " + ", ".join(
            f"{name} {n:,} ({100 * n / total:.0f}%)" for name, n in seen.items()
        )
    return (
        f"done: {s['steps']} steps in {s['seconds']:.1f} s (compile {s['compile_seconds']:.1f} s)"
        f" | loss {s['first_loss']:.3f} -> {s['final_loss']:.3f}{data} | {rate}"
        f" | {s['devices']} devices ({mesh}) | {s['run_dir']}"
        + (f" | {s['skipped_steps']} non-finite steps skipped" if s.get("skipped_steps") else "")
    )


USAGE = """usage: python -m jaxpar.train [CONFIG.yaml] [dotted.key=value ...]

Trains with the defaults below, then CONFIG.yaml (presets in configs/), then the overrides,
written without dashes, e.g.
  python -m jaxpar.train configs/tiny.yaml train.steps=20 mesh.data=2 mesh.fsdp=2 mesh.tensor=2
  python -m jaxpar.train configs/gpt2-124m.yaml train.steps=100 mesh.data=-1
Exit codes: 0 done, 1 a failure during training, 2 bad settings, 3 too big for this machine's
memory (on a CPU), 130 stopped by Ctrl-C.

Settings (key, default, meaning):"""


def _preflight(cfg: Config, sizes: dict[str, int], preemption: Preemption) -> None:
    """On a CPU: jaxpar.planning.host.DoesNotFit for a run predicted not to fit in the host's memory; a
    warning with the expected time per step for a slow one. Before anything compiles."""
    forecast = host_lib.check(cfg, sizes)
    if forecast is None:
        return
    preemption.expected_wait_s = forecast.step_seconds  # until a step is measured
    if forecast.slow and jax.process_index() == 0:
        print(host_lib.warning(forecast, cfg), file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if {"-h", "--help"} & set(argv):
        try:
            print(USAGE + "\n" + config_lib.settings_help(), flush=True)
        except BrokenPipeError:  # `--help | head`: the reader has what it wanted
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    # From the first moment, a signal only asks for a stop (Preemption): start-up checks for it
    # between its phases, the loop after each step; nothing is interrupted half-way.
    # For the process's lifetime: orbax's leftovers are logged at its end.
    checkpoint_lib.DropNoSpace().__enter__()
    sys.unraisablehook = functools.partial(checkpoint_lib.quiet_closed_loop, sys.unraisablehook)
    with Preemption(exit_at_once=True) as preemption:
        try:
            return cli.run(
                lambda: _run(argv, preemption),
                failures={host_lib.DoesNotFit: 3, NonFiniteLoss: 1, DiskFull: 1},
            )
        except Interrupted as e:
            print(e, file=sys.stderr)
            return 128 + signal.Signals[e.signame].value
        except KeyboardInterrupt:  # a second Ctrl-C where the handler could not run (exit_at_once)
            print("interrupted again: stopped at once, without a checkpoint", file=sys.stderr)
            return 130


def _run(argv: list[str], preemption: Preemption) -> int:
    """The command's work: settings, the host check, training, the summary line."""
    cfg, sizes = load_and_validate(argv)
    _preflight(cfg, sizes, preemption)
    preemption.check_startup(1)
    summary = train(cfg, sizes, preemption)
    if jax.process_index() == 0:
        print(format_summary(summary))
    # A Ctrl-C stop exits 130 (the shell's convention), after its checkpoint; SIGTERM, which
    # schedulers send to preempt, exits 0 so that a requeued job simply resumes.
    return 130 if summary["stopped_by"] == "SIGINT" else 0
