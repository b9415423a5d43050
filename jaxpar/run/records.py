"""What a run records: each logged step's line of metrics.jsonl (`step_record`), timed by the
step clock (`StepClock`: compilation, evaluation and checkpoint saves kept out of the time per
step; at the first step, whether its programs were compiled or loaded from the compile cache), a
profiler trace of train.profile_steps (`Profiler`), the run's summary and its one line
(`summary`, `format_summary`), and on resume the metrics of the steps to be rerun dropped
(`keep_metrics_until`). The loop that writes them is jaxpar.run.train's.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time

import jax

from jaxpar import mesh as mesh_lib
from jaxpar.config import Config
from jaxpar.training import checkpoint as checkpoint_lib
from jaxpar.training import metrics as metrics_lib

_run_start = 0  # len(jaxpar.mesh.COMPILED) where the current run began


def mark_run_start() -> None:
    """Marks where the current run's programs begin in `jaxpar.mesh.COMPILED`: the StepClock of
    its loop reports those compiled up to its first step (`jaxpar.run.train.train` calls this
    first)."""
    global _run_start
    _run_start = len(mesh_lib.COMPILED)


class StepClock:
    """Time per step over the window since the last logged step, with the first step (which holds
    the compilation), the compilation of a later slot bucket's step (`compiling`) and any
    evaluation or checkpoint save kept out: each is its own figure.

    At the first step it also takes the programs XLA compiled, or loaded from the persistent
    compilation cache, since the run began (`mark_run_start`; a new run's init among them), and with
    `report` says on stderr whether they were compiled or loaded."""

    def __init__(self, report: bool = False):
        self.started = self.ended = time.perf_counter()
        self.compile_s: float | None = None
        self.compiled_from = _run_start
        self.programs: list[mesh_lib.Compiled] = []  # up to the first step
        self.report = report
        self.window_start, self.window_steps = self.started, 0
        self.eval_s = self.save_s = 0.0  # in all, for the summary

    def stepped(self, metrics) -> None:
        self.window_steps += 1
        if self.compile_s is None:  # the first step holds the compilation: time the rest
            jax.block_until_ready(metrics)
            now = time.perf_counter()
            self.compile_s, self.window_start, self.window_steps = now - self.started, now, 0
            self.programs = mesh_lib.compiled_since(self.compiled_from)
            line = mesh_lib.compile_line(
                self.programs, mesh_lib.compile_cache_in_use(), "the train step", " up to the first step"
            )
            if self.report and line is not None:
                from tqdm import tqdm  # above the progress bar, if one is shown

                tqdm.write(line, file=sys.stderr)

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


class Profiler:
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


def step_record(
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


@dataclasses.dataclass
class Outcome:
    """What a run's loop learned, for its summary."""

    step: int
    first_loss: float | None = None
    loss: float | None = None
    eval_loss: float | None = None
    tokens_seen: dict | None = None
    stopped_by: str | None = None
    skipped_steps: int = 0


def summary(cfg: Config, clock: StepClock, run: Outcome, start: int, devices, sizes, flops_tok) -> dict:
    """What `train` returns: the steps, losses, times and throughput of the run's loop (`run`,
    timed by `clock`; compilation, evaluation and saves kept out of tokens_per_sec) and what
    stopped it."""
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
        "compile_cache": compile_record(clock.programs),
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


def compile_record(programs: list[mesh_lib.Compiled]) -> dict:
    """The summary's account of the programs up to the first step: the compilation cache's
    directory (None: off), how many programs there were, how many were loaded from the cache and
    how many written to it, and XLA's seconds on them (compiling, or reading and loading)."""
    return {
        "directory": mesh_lib.compile_cache_in_use().directory,
        "programs": len(programs),
        "loaded": sum(p.loaded for p in programs),
        "written": sum(p.written for p in programs),
        "xla_seconds": sum(p.seconds for p in programs),
    }


def format_summary(s: dict) -> str:
    """The summary's one line, as `python -m jaxpar.train` prints it at the end. Its first-step
    figure is the wall time to the first step's result (tracing, compiling or loading, running:
    `compile_seconds`); the start-up line "compiled the train step in ..." counts XLA's own
    seconds on every program since the run began (initialisation and any `mesh: auto`
    candidates among them), so the two differ."""
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
        f"done: {s['steps']} steps in {s['seconds']:.1f} s (first step {s['compile_seconds']:.1f} s, "
        "compiling included)"
        f" | loss {s['first_loss']:.3f} -> {s['final_loss']:.3f}{data} | {rate}"
        f" | {s['devices']} devices ({mesh}) | {s['run_dir']}"
        + (f" | {s['skipped_steps']} non-finite steps skipped" if s.get("skipped_steps") else "")
    )


def keep_metrics_until(run_dir: str, step: int) -> None:
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
