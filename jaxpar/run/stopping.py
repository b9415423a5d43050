"""How a run stops: a signal (`Preemption`: SIGTERM or SIGINT asks for a stop after the step,
a second Ctrl-C exits at once; `Interrupted` during start-up), a non-finite loss (`read_device`,
`NonFiniteLoss`, with the newest intact checkpoint to go back to) and a full disk (`no_space`,
`disk_full`: one line that says where, what a checkpoint needs and what is intact). The loop they
stop is jaxpar.run.train's.
"""

from __future__ import annotations

import errno
import os
import shutil
import signal
import threading
import time

import jax
import numpy as np

from jaxpar.training import checkpoint as checkpoint_lib

# --- A signal -----------------------------------------------------------------------------------


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


# --- A non-finite loss --------------------------------------------------------------------------


class NonFiniteLoss(RuntimeError):
    """The loss became NaN or infinite (train.on_nan=stop)."""


def read_device(metrics, t, step: int, ckpt) -> tuple[float, int]:
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


# --- A full disk --------------------------------------------------------------------------------


class DiskFull(RuntimeError):
    """No space left where the run writes; the message is one line that says what to do."""


def no_space(error: BaseException) -> bool:
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


def checkpoint_bytes(ckpt: checkpoint_lib.Checkpointer, state_shape) -> int:
    """What one more checkpoint takes on disk: the newest committed one's size, else the train
    state's bytes (an upper bound: orbax may compress)."""
    for step in reversed(ckpt.all_steps()):
        root = os.path.join(ckpt.directory, str(step))
        return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(root) for f in files)
    return sum(x.size * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(state_shape))


def disk_full(ckpt, trainer, run_dir: str, at: int | None = None) -> DiskFull:
    """The one-line report of a full disk: where, how much a checkpoint needs, what is intact."""
    if ckpt is None:
        return DiskFull(
            f"no space left on the device of {run_dir}; free some space and run the same command again"
        )
    needed = checkpoint_bytes(ckpt, trainer.stored(trainer.state_shape))
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
