"""`python -m jaxpar.train [CONFIG.yaml] [dotted.key=value ...]`: the training loop.

The data path is one way: config -> mesh -> sharded state (born sharded, inside a jitted init)
-> jitted train step (state, batch) -> (state, metrics) -> writers. Everything up to the compiled
step is jaxpar.training.trainer's `build_trainer`; this module runs it: data, resume, checkpoints,
evaluation, the loop and the command line. How a run stops (a signal, a non-finite loss, a full
disk) is jaxpar.run.stopping's; what it records (metrics lines, step times, the summary)
jaxpar.run.records'.
"""

from __future__ import annotations

import functools
import os
import shutil
import signal
import sys
import time
from typing import Any

import jax
import numpy as np

from jaxpar import checks as checks_lib
from jaxpar import cli
from jaxpar import config as config_lib
from jaxpar import mesh as mesh_lib
from jaxpar.config import Config, ConfigError
from jaxpar.hf import base as base_lib
from jaxpar.hf import convert as convert_lib
from jaxpar.models.attention import documents_per_row
from jaxpar.planning import host as host_lib
from jaxpar.run import autolayout, records, stopping
from jaxpar.run import rundir as rundir_lib
from jaxpar.run.startup import load_and_validate
from jaxpar.training import checkpoint as checkpoint_lib
from jaxpar.training import metrics as metrics_lib
from jaxpar.training import wandb_log
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


def train(cfg: Config, sizes: dict[str, int], preemption: stopping.Preemption | None = None) -> dict:
    """Runs training (resuming from run_dir's checkpoints); returns a summary. Writes config.yaml,
    metrics.jsonl, TensorBoard events, loss.png and checkpoints into train.run_dir, whose rules
    (one run's history, one run at a time) are jaxpar.run.rundir's. `preemption`: the signal handler
    the caller installed (the CLI, from its first moment); by default one is installed here."""
    if preemption is None:
        with stopping.Preemption() as preemption:
            return train(cfg, sizes, preemption)
    cfg = config_lib.resolve_paths(cfg)  # config.yaml stores absolute paths
    t = cfg.train
    records.mark_run_start()  # the first step's line covers what this run compiles from here
    checks_lib.check_run_dir(t.run_dir)
    dataset = make_data(cfg)  # before compiling: data errors are config errors
    eval_data = make_eval_data(cfg)
    preemption.check_startup(1)
    trainer = build_trainer(cfg, sizes)
    preemption.check_startup(1)
    is_main = jax.process_index() == 0
    if is_main:
        print(config_lib.precision_line(cfg), file=sys.stderr, flush=True)
        print(mesh_lib.cache_line(mesh_lib.compile_cache_in_use(), cfg.runtime), file=sys.stderr, flush=True)
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
            autolayout.write(t.run_dir)  # mesh: auto's choice and its reasons
            from jaxpar.corpus import data as data_lib

            data_lib.save_run_template(cfg.data, t.run_dir)  # what `sample --chat` renders with
        summary = _loop(cfg, sizes, trainer, ckpt, dataset, state, data_state, start, preemption, eval_data)
        finished = True
        return summary
    except Exception as e:
        if stopping.no_space(e) and not isinstance(e, stopping.DiskFull):
            raise stopping.disk_full(ckpt, trainer, t.run_dir) from None
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
            records.keep_metrics_until(t.run_dir, start)
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
        if stopping.no_space(e):
            raise stopping.disk_full(ckpt, trainer, run_dir) from None
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


def _saver(cfg: Config, trainer: Trainer, ckpt, iterator):
    """save(step, state, force): a checkpoint when `checkpoint.every` (or `force`) says so;
    returns whether one was written."""
    t = cfg.train

    def save(at: int, state, force: bool = False) -> bool:
        if not (force or ckpt.should_save(at)):
            return False
        # Checked before the save starts: orbax's own failure would come later, from a
        # background thread (the previous checkpoint intact, but pages of tracebacks).
        if shutil.disk_usage(ckpt.directory).free < stopping.checkpoint_bytes(
            ckpt, trainer.stored(trainer.state_shape)
        ):
            raise stopping.disk_full(ckpt, trainer, t.run_dir, at)
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
    writer = _writer(cfg, sizes, start) if is_main else None  # before the clock: W&B's start is not training
    clock, save = records.StepClock(report=is_main), _saver(cfg, trainer, ckpt, iterator)
    profiler = records.Profiler(t.profile_steps, t.run_dir)
    run = records.Outcome(step=start)
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
                run.loss, run.skipped_steps = stopping.read_device(metrics, t, step, ckpt)
            saved, save_s = clock.timed("save_s", save, step, state, step == t.steps or stop is not None)
            if saved:
                preemption.unsaved_steps = 0
            if not logged:
                progress.update(step, None)
            else:
                step_time = clock.step_time()  # before evaluating: its time is its own figure
                preemption.expected_wait_s = step_time or preemption.expected_wait_s
                record = records.step_record(
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
    return records.summary(cfg, clock, run, start, devices, sizes, flops_tok)


def _writer(cfg: Config, sizes: dict[str, int], start: int) -> metrics_lib.MetricsWriter:
    """Process 0's writer of the logged steps' records: metrics.jsonl, TensorBoard, the plot, and
    the W&B run where train.wandb.project is set and there are steps to train
    (jaxpar.training.wandb_log; started after metrics.jsonl exists, so that its id file is never a
    run directory's only history)."""
    writer = metrics_lib.MetricsWriter(cfg.train.run_dir, purge_after=start)
    if start < cfg.train.steps and (sink := wandb_log.start(cfg, sizes)) is not None:
        writer.sinks.append(sink)
    return writer


def _step(trainer: Trainer, clock: records.StepClock, state, local: dict, step: int):
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


# --- The command line ---------------------------------------------------------------------------


USAGE = """usage: python -m jaxpar.train [CONFIG.yaml] [dotted.key=value ...]

Trains with the defaults below, then CONFIG.yaml (presets in configs/), then the overrides,
written without dashes, e.g.
  python -m jaxpar.train configs/tiny.yaml train.steps=20 mesh.data=2 mesh.fsdp=2 mesh.tensor=2
  python -m jaxpar.train configs/gpt2-124m.yaml train.steps=100 mesh.data=-1
Exit codes: 0 done, 1 a failure during training, 2 bad settings, 3 too big for this machine's
memory (on a CPU), 130 stopped by Ctrl-C.

Settings (key, default, meaning):"""


def _preflight(cfg: Config, sizes: dict[str, int], preemption: stopping.Preemption) -> None:
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
            print(USAGE + "\n" + cli.settings_help(), flush=True)
        except BrokenPipeError:  # `--help | head`: the reader has what it wanted
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    # From the first moment, a signal only asks for a stop (stopping.Preemption): start-up checks for it
    # between its phases, the loop after each step; nothing is interrupted half-way.
    # For the process's lifetime: orbax's leftovers are logged at its end.
    checkpoint_lib.DropNoSpace().__enter__()
    sys.unraisablehook = functools.partial(checkpoint_lib.quiet_closed_loop, sys.unraisablehook)
    with stopping.Preemption(exit_at_once=True) as preemption:
        try:
            return cli.run(
                lambda: _run(argv, preemption),
                failures={host_lib.DoesNotFit: 3, stopping.NonFiniteLoss: 1, stopping.DiskFull: 1},
            )
        except stopping.Interrupted as e:
            print(e, file=sys.stderr)
            return 128 + signal.Signals[e.signame].value
        except KeyboardInterrupt:  # a second Ctrl-C where the handler could not run (exit_at_once)
            print("interrupted again: stopped at once, without a checkpoint", file=sys.stderr)
            return 130


def _run(argv: list[str], preemption: stopping.Preemption) -> int:
    """The command's work: settings, the host check, training, the summary line."""
    cfg, sizes = load_and_validate(argv)
    _preflight(cfg, sizes, preemption)
    preemption.check_startup(1)
    try:
        summary = train(cfg, sizes, preemption)
    except Exception as e:
        if (why := autolayout.out_of_memory(e)) is not None:
            print(why, file=sys.stderr, flush=True)
        raise
    if jax.process_index() == 0:
        print(records.format_summary(summary))
    # A Ctrl-C stop exits 130 (the shell's convention), after its checkpoint; SIGTERM, which
    # schedulers send to preempt, exits 0 so that a requeued job simply resumes.
    return 130 if summary["stopped_by"] == "SIGINT" else 0
