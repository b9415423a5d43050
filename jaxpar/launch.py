"""`python -m jaxpar.launch --nproc N [--port P] [--max-restarts R] [train arguments...]`: N
training processes on this machine, joined into one multi-process JAX run (like `torchrun
--standalone`).

    python -m jaxpar.launch --nproc 2 train.steps=100 runtime.cpu_devices=4 \\
        mesh.data=2 mesh.fsdp=2 mesh.tensor=2

starts `python -m jaxpar.train <train arguments>` N times, process i with

    JAXPAR_COORDINATOR=127.0.0.1:<P>   (a free port unless --port is given)
    JAXPAR_NUM_PROCESSES=N
    JAXPAR_PROCESS_ID=i
    JAXPAR_RESTART_COUNT=k             (0, then 1, 2, ... for the restarts; like torchrun's
                                        TORCHELASTIC_RESTART_COUNT)

which `jaxpar.mesh.start_distributed` turns into `jax.distributed.initialize`. Every setting is
per process: on CPU `runtime.cpu_devices=4` gives each process 4 devices, so the run above has
2 x 4 = 8 devices and the same mesh -- and the same losses -- as one process with
`runtime.cpu_devices=8`. The launcher is how the multi-process code path is exercised on one
machine; on a cluster, start one `python -m jaxpar.train` per node yourself with the same three
variables (examples/slurm/ shows SLURM and Kubernetes).

What crosses processes (here over loopback, on a cluster over the network):
- start-up: the coordinator service runs in process 0; every process registers with it and
  learns the global device list (`jax.devices()` is the same everywhere, `jax.local_devices()`
  differs). It also watches heartbeats and serves the key-value store the collectives use to
  meet;
- every step: the collectives of the mesh axes that span processes (gloo on CPU, NCCL on GPUs).
  Devices are numbered process by process and the innermost mesh axes take neighbours, so in the
  example above only `data` spans the two processes (its gradient all-reduce), while fsdp x
  tensor = 2 x 2, the 4 devices of one process, never leave it. `mesh.data=1 mesh.fsdp=4` would
  send fsdp's parameter all-gathers and gradient reduce-scatters across instead;
- data: nothing. Each process reads the dataset itself and keeps only its rows of every global
  batch (jaxpar.data);
- checkpoints: every process writes the shards it owns into the same directory (orbax), which
  on a cluster must be a shared file system; process 0 commits. Only process 0 writes
  metrics.jsonl, the plots, and shows progress.

Before the first process starts, the launch is checked, and refused in one line (exit code 2)
when it cannot work: a negative --tail, --grace or --max-restarts; a distributed.* setting the
launcher makes itself (distributed.timeout_s passes through: how long each process waits for the
others at start); --port outside 1-65535 or taken; more processes than the machine holds
(`most_processes`: about PROCESS_BYTES of the machine's memory for each, at most
PROCESSES_PER_CORE per core); and, for `python -m jaxpar.train`, the config every process would
refuse -- on the CPU checked for the devices of all of them, nproc x runtime.cpu_devices (on
GPUs, each process counts its own). On the CPU the processes' forecast memory together
(`jaxpar.planning.host`) is checked against what the machine allows too, and a launch too big for it is
refused with exit code 3. A stop asked for while the processes are being started ends the
starting there.

Output: process 0's stdout and stderr pass through live; the others are kept as a rolling tail.

Failure: when a process exits non-zero or is killed, the launcher asks the others to stop
(SIGTERM; SIGKILL after --grace seconds), prints the failed process's exit code and last lines,
and exits with that code (128 + the signal number for a signal, as a shell reports it). SIGINT
and SIGTERM sent to the launcher are forwarded once to every process: training stops after the
step, checkpoints and exits (0 after SIGTERM, 130 after SIGINT: `jaxpar.run.stopping.Preemption`); the
launcher then exits with the same code, and
the same command resumes. Children sit in their own process group, so a Ctrl-C at the terminal
reaches them once, through the launcher; on Linux they are killed if the launcher itself dies.
Every wait is bounded by --grace: once one process has stopped (or been asked to), the others
have that long to follow.

Restarts (--max-restarts R, default 0; torchrun's elastic agent does the same): after a failure,
once every process has stopped, all N start again -- with a new free coordinator port (the same
one with --port) and JAXPAR_RESTART_COUNT one higher -- and resume from the newest complete
checkpoint in train.run_dir (`train.resume=auto`), up to R times. Each restart prints one line:
which restart of R, which process failed and how, and the step it resumes from (the newest
`<run_dir>/checkpoints/<step>/` holding jaxpar_manifest.json, read without JAX; the processes
then also check the checksums, and fall back to an older checkpoint if that one is damaged). A
restart never starts over from a setting: if the command says `train.resume=never` or a step, the
restarts say `train.resume=auto` instead (and the line says so), since the checkpoints now in the
run dir are this run's. If no checkpoint was complete yet, the restart starts over with
`train.resume=never` (what the first start did). Not restarted: exit code 2 (a configuration
error, which would only recur) or 3 (too big for this machine's memory, likewise), a stop asked for with
SIGINT/SIGTERM, and a process that is still running after SIGKILL. When the restarts are used up, the
launcher exits with the last failure's code; the last line says how many restarts were used.
"""

from __future__ import annotations

import argparse
import codecs
import collections
import ctypes
import dataclasses
import math
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import IO

from jaxpar import checks as checks_lib
from jaxpar import config as config_lib
from jaxpar.cli import CONFIG_ERROR  # a restart would repeat it: not restarted
from jaxpar.planning import host as host_lib

POLL_S = 0.1  # how often the launcher looks at its queue of exits and signals
KILL_WAIT_S = 10.0  # after SIGKILL, how long to wait for the process table to show the exit
FORWARDED = (signal.SIGINT, signal.SIGTERM)
MANIFEST = "jaxpar_manifest.json"  # jaxpar.training.checkpoint.MANIFEST: in a checkpoint once committed
PR_SET_PDEATHSIG = 1  # linux/prctl.h
# What one process takes, for the count a machine can hold: a `python -m jaxpar.train` of
# configs/tiny.yaml on one CPU device peaked at 1.2 GB resident (jax 0.12.0.1); a real model
# takes more, which its own memory check reports.
PROCESS_BYTES = 1 << 30
PROCESSES_PER_CORE = 8  # beyond this, start-up alone (imports, compiles) takes the machine


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on `host` now (the kernel's pick); the coordinator binds it moments later."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def exit_code(returncode: int) -> int:
    """Popen's returncode as a shell reports it: -N (killed by signal N) -> 128 + N."""
    return 128 - returncode if returncode < 0 else returncode


def describe_exit(returncode: int) -> str:
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        return f"killed by {name} (exit code {exit_code(returncode)})"
    return f"exit code {returncode}"


# --- One child: its process, its output ----------------------------------------------------


@dataclass
class Child:
    """Process `index` of the run, with a rolling tail of its combined stdout and stderr."""

    index: int
    proc: subprocess.Popen
    tail: collections.deque = field(default_factory=collections.deque)
    readers: list[threading.Thread] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def running(self) -> bool:
        return self.proc.poll() is None

    def signal(self, sig: int) -> None:
        if self.running():
            try:
                self.proc.send_signal(sig)
            except ProcessLookupError:  # exited between poll and send
                pass

    def tail_text(self) -> str:
        with self.lock:
            return "\n".join(self.tail)


def _pump(child: Child, pipe: IO[bytes], echo: IO | None, partial: list[str]) -> None:
    """Copies `pipe` into the child's tail (and to `echo`, as it comes) until end of file.
    Progress bars redraw with carriage returns: the tail keeps only a line's last redraw."""
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    fd = pipe.fileno()
    while chunk := os.read(fd, 65536):
        if echo is not None:
            try:
                target = getattr(echo, "buffer", None)
                (target or echo).write(chunk if target else chunk.decode("utf-8", "replace"))
                echo.flush()
            except (OSError, ValueError):  # our stdout went away (a closed pipe): keep draining
                echo = None
        text = partial[0] + decoder.decode(chunk)
        *lines, partial[0] = text.split("\n")
        with child.lock:
            child.tail.extend(line.rsplit("\r", 1)[-1] for line in lines)
    if partial[0]:
        with child.lock:
            child.tail.append(partial[0].rsplit("\r", 1)[-1])
        partial[0] = ""
    pipe.close()


def _child_setup(libc) -> None:
    """Runs in the child between fork and exec: its own process group (a terminal's Ctrl-C
    reaches only the launcher, which forwards it once), and death with the launcher (Linux)."""
    os.setpgid(0, 0)
    if libc is not None:
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def _start_children(
    command: list[str],
    nproc: int,
    coordinator: str,
    tail_lines: int,
    restart: int = 0,
    requested: list[int] = (),
) -> list[Child]:
    """Starts the processes; a stop asked for meanwhile (a signal in `requested`) ends the
    starting there: the ones started are returned, to be stopped."""
    libc = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None
    children = []
    for index in range(nproc):  # all forks happen before any thread starts (preexec_fn)
        if requested:
            break
        env = dict(
            os.environ,
            JAXPAR_COORDINATOR=coordinator,
            JAXPAR_NUM_PROCESSES=str(nproc),
            JAXPAR_PROCESS_ID=str(index),
            JAXPAR_RESTART_COUNT=str(restart),
            PYTHONUNBUFFERED="1",
        )
        proc = subprocess.Popen(
            command,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE if index == 0 else subprocess.STDOUT,
            preexec_fn=lambda: _child_setup(libc),
        )
        children.append(Child(index, proc, collections.deque(maxlen=tail_lines)))
    for child in children:
        # Process 0 keeps stdout and stderr apart, echoed live; the others' are one stream.
        pipes = [(child.proc.stdout, sys.stdout if child.index == 0 else None)]
        if child.index == 0:
            pipes.append((child.proc.stderr, sys.stderr))
        for pipe, echo in pipes:
            thread = threading.Thread(target=_pump, args=(child, pipe, echo, [""]), daemon=True)
            thread.start()
            child.readers.append(thread)
    return children


def _watch_exits(children: list[Child], exits: queue.Queue) -> None:
    """One waiter thread per child puts (index, returncode) on `exits` as it dies, so the
    queue's order is the order of the deaths."""
    for child in children:
        threading.Thread(target=lambda c=child: exits.put((c.index, c.proc.wait())), daemon=True).start()


# --- Restarts: where the run resumes ------------------------------------------------------


def _train_settings(train_args: list[str]) -> tuple[str | None, str]:
    """(train.run_dir, train.resume) as `python -m jaxpar.train *train_args` would see them; run
    dir None when the arguments do not parse (the processes then report that, with exit code 2).
    jaxpar.config reads YAML only: the launcher stays free of JAX."""
    try:
        path, overrides = config_lib.parse_cli(list(train_args))
        t = config_lib.load_config(path, overrides).train
    except Exception:  # whatever is wrong, the processes report it (the launcher must not fail)
        return None, "auto"
    return t.run_dir, str(t.resume)


def newest_complete_checkpoint(run_dir: str) -> int | None:
    """The newest committed checkpoint step in `<run_dir>/checkpoints`, read from the directory
    names alone: orbax renames `<step>.orbax-checkpoint-tmp...` to `<step>` on commit, with
    jaxpar's manifest already inside (jaxpar.training.checkpoint, not imported here: it imports JAX).
    The checksums are left to the resuming processes."""
    directory = os.path.join(os.path.abspath(run_dir), "checkpoints")
    try:
        names = os.listdir(directory)
    except OSError:
        return None
    steps = [int(n) for n in names if n.isdigit() and os.path.isfile(os.path.join(directory, n, MANIFEST))]
    return max(steps, default=None)


@dataclass
class Resumption:
    """What restart k does: the step it resumes from (None: starts over, or unknown) and the
    arguments it adds to the command."""

    step: int | None
    extra_args: list[str]
    where: str  # for the restart line

    @classmethod
    def plan(cls, run_dir: str | None, resume: str) -> Resumption:
        if run_dir is None:  # a command whose arguments the launcher does not know
            return cls(None, [], "from the newest complete checkpoint (if any)")
        directory = os.path.join(os.path.abspath(run_dir), "checkpoints")
        step = newest_complete_checkpoint(run_dir)
        if step is None:
            # Nothing to resume from: start over, as the first start did (train.resume=auto would
            # refuse a run dir that holds metrics but no checkpoint).
            extra = [] if resume == "never" else ["train.resume=never"]
            return cls(
                None,
                extra,
                f"from step 0: no complete checkpoint in {directory} yet"
                + (" (train.resume=never)" if extra else ""),
            )
        where = f"from step {step}, the newest complete checkpoint in {directory}"
        if resume == "auto":
            return cls(step, [], where)
        return cls(
            step,
            ["train.resume=auto"],
            where + f" (train.resume=auto instead of the command's train.resume={resume}: "
            "a restart continues from the last checkpoint)",
        )


# --- Before the first fork: what the launch asks for, checked -----------------------------------


def _machine_memory() -> int | None:
    """MemTotal of /proc/meminfo in bytes (None off Linux). The machine's whole memory, not what
    is free at the moment: the bound must not move with what other jobs hold."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def most_processes() -> tuple[int, str]:
    """How many processes this machine holds, and why: PROCESS_BYTES each of its memory,
    PROCESSES_PER_CORE per core."""
    cores = os.cpu_count() or 1
    most, why = cores * PROCESSES_PER_CORE, f"{cores} cores x {PROCESSES_PER_CORE}"
    memory = _machine_memory()
    if memory is not None and memory // PROCESS_BYTES < most:
        most = max(1, memory // PROCESS_BYTES)
        why = f"{memory / 2**30:.1f} GiB of memory, about {PROCESS_BYTES / 2**30:.0f} GiB a process"
    return most, why


def _on_cpu() -> bool:
    """Whether the processes will run on the CPU (runtime.cpu_devices each): JAX_PLATFORMS says
    so, or there is no NVIDIA driver (jaxpar.mesh.emulate_cpu_devices decides the same way)."""
    if os.environ.get("JAX_PLATFORMS"):
        return os.environ["JAX_PLATFORMS"].split(",")[0] == "cpu"
    return not any(os.path.exists(p) for p in ("/dev/nvidiactl", "/proc/driver/nvidia", "/dev/dxg"))


def _cpu_config(nproc: int, train_args: list[str]):
    """(config, devices) of the run as the processes will read it, for the devices of all of them
    together on the CPU (nproc x runtime.cpu_devices); a ConfigError as they would raise it."""
    path, overrides = config_lib.parse_cli(list(train_args))
    settings = config_lib.user_settings(path, overrides)
    cfg = config_lib.build_config(settings)
    checks_lib.validate_runtime(cfg)
    devices = nproc * cfg.runtime.cpu_devices
    if "mesh" not in settings:  # as jaxpar.train does: the default layout, fitted to the devices
        cfg = dataclasses.replace(cfg, mesh=config_lib.fit_default_mesh(devices))
    return cfg, devices


def memory_problem(nproc: int, train_args: list[str]) -> str | None:
    """On the CPU: the processes' forecast memory together against what this machine allows
    (`jaxpar.planning.host`; each process checks only its own share); None when it fits or cannot be told
    (GPUs, a config error that `_config_problem` reports, train.init_from's shape)."""
    if not _on_cpu():
        return None
    try:
        cfg, devices = _cpu_config(nproc, train_args)
        if cfg.train.init_from is not None:
            return None
        sizes = checks_lib.validate(cfg, devices)
    except config_lib.ConfigError:
        return None
    need = nproc * host_lib.memory_bytes(cfg, sizes, cfg.runtime.cpu_devices)
    available = host_lib.available_bytes()
    limit = host_lib.limit_bytes(cfg, available)
    if limit is None or need <= limit:
        return None
    return (
        f"the {nproc} processes need about {need / host_lib.GIB:.1f} GiB of host memory "
        f"together and {host_lib.room(cfg, limit, available)}; {host_lib.ADVICE}, or fewer "
        "processes"
    )


def _config_problem(nproc: int, train_args: list[str]) -> str | None:
    """The config error every process would stop with, checked here once, for the devices of
    all the processes together where they run on the CPU (nproc x runtime.cpu_devices); None
    when there is none (or only the processes can tell: their devices on GPUs)."""
    try:
        cfg, devices = _cpu_config(nproc, train_args)
    except config_lib.ConfigError as e:
        return f"config error: {e}"
    if not _on_cpu():
        return None
    try:
        if cfg.train.init_from is None:
            checks_lib.validate(cfg, devices)
        else:  # the model's shape comes from train.init_from, which the processes read
            checks_lib.resolve_mesh(cfg.mesh, devices)
    except config_lib.ConfigError as e:
        return (
            f"config error: {e} (the run has --nproc {nproc} x runtime.cpu_devices="
            f"{cfg.runtime.cpu_devices} = {devices} devices)"
        )
    return None


def launch_problem(nproc: int, train_args: list[str], port: int | None, config: bool) -> str | None:
    """What makes the launch fail before any process starts (None: nothing): the port, more
    processes than the machine holds (`most_processes`), and with `config` (the command is
    jaxpar.train) the config for nproc processes (`_config_problem`)."""
    if nproc < 1:
        return f"--nproc={nproc}: need at least 1 process"
    if port is not None and not 1 <= port <= 65535:
        return f"--port={port}: a TCP port is 1-65535; e.g. --port 29500, or leave it out for a free one"
    if port is not None:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(("", port))
            except OSError as e:
                return (
                    f"--port={port} cannot be the coordinator's ({e.strerror}); give another, "
                    "or leave --port out for a free one"
                )
    most, why = most_processes()
    if nproc > most:
        return (
            f"--nproc {nproc}: this machine holds about {most} processes ({why}); use "
            f"--nproc {most} or fewer, with more devices each (runtime.cpu_devices) on the CPU"
        )
    return _config_problem(nproc, train_args) if config else None


# --- The launcher -------------------------------------------------------------------------


def _say(message: str) -> None:
    print(f"jaxpar.launch: {message}", file=sys.stderr, flush=True)


def _stop_all(children: list[Child], grace: float) -> None:
    """SIGTERM to every running child; SIGKILL to those still running after `grace` seconds."""
    for child in children:
        child.signal(signal.SIGTERM)
    _wait_all(children, grace)
    for child in children:
        if child.running():
            _say(f"process {child.index} (pid {child.proc.pid}) is still running; sending SIGKILL")
            child.signal(signal.SIGKILL)
    _wait_all(children, KILL_WAIT_S)


def _wait_all(children: list[Child], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    for child in children:
        try:
            child.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass


def _report_failure(child: Child, returncode: int, tail_lines: int) -> None:
    _say(f"process {child.index} (pid {child.proc.pid}) failed: {describe_exit(returncode)}")
    for reader in child.readers:  # the pipe closes at exit; bounded in case a grandchild holds it
        reader.join(timeout=2.0)
    if child.index == 0:
        _say("its output is above")
    else:
        _say(f"last {tail_lines} lines of process {child.index}:")
        print(child.tail_text(), file=sys.stderr, flush=True)


def _run_once(
    command: list[str],
    nproc: int,
    coordinator: str,
    restart: int,
    grace: float,
    tail_lines: int,
    requested: list[int],
) -> tuple[list[Child], tuple[Child, int] | None]:
    """One attempt: starts the processes, forwards the signals that arrive in `requested`, and
    stops them all at the first failure. Returns the children (all stopped, unless one survived
    SIGKILL) and the first failure (child, Popen returncode), or None when all exited 0."""
    children = _start_children(command, nproc, coordinator, tail_lines, restart, requested)
    _say(
        f"{len(children)} processes, coordinator {coordinator}: "
        + ", ".join(f"process {c.index} pid {c.proc.pid}" for c in children)
        + (
            f" (a stop was requested before the other {nproc - len(children)} started)"
            if len(children) < nproc
            else ""
        )
    )
    nproc = len(children)
    exits: queue.Queue = queue.Queue()
    _watch_exits(children, exits)
    failed: tuple[Child, int] | None = None
    forwarded: set[int] = set()
    deadline = None  # set once a process has stopped or a stop was requested
    done = 0
    try:
        while done < nproc:
            while requested:
                sig = requested.pop(0)
                forwarded.add(sig)
                _say(f"forwarding {signal.Signals(sig).name} to the running processes")
                for child in children:
                    child.signal(sig)
                deadline = deadline or time.monotonic() + grace
            try:
                index, returncode = exits.get(timeout=POLL_S)
            except queue.Empty:
                late = [c for c in children if c.running()]
                if deadline is not None and time.monotonic() > deadline and late:
                    _say(
                        f"process {late[0].index} still running {grace:g} s after the first "
                        "process stopped or a stop was requested; stopping all"
                    )
                    _stop_all(late, 0.0)
                    failed = (late[0], late[0].proc.poll() or -signal.SIGKILL)
                    break
                continue
            done += 1
            deadline = deadline or time.monotonic() + grace
            # A forwarded Ctrl-C: jaxpar.train stops after its step and checkpoint, exit 130.
            if returncode == 128 + signal.SIGINT and signal.SIGINT in forwarded:
                returncode = 0
            if returncode != 0:
                failed = (children[index], returncode)
                _stop_all(children, grace)
                break
    finally:
        _stop_all([c for c in children if c.running()], grace)  # e.g. on KeyboardInterrupt
    for child in children:
        for reader in child.readers:
            reader.join(timeout=2.0)
    return children, failed


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def launch(
    nproc: int, train_args=(), *, port=None, grace=30.0, tail_lines=40, command=None, max_restarts=0
) -> int:
    """Runs `command + train_args` (default command: `python -m jaxpar.train`) as `nproc`
    processes of one distributed run on 127.0.0.1, restarting all of them up to `max_restarts`
    times after a failure; returns the exit code: 0 when all exit 0, else the last attempt's first
    failed process's (128 + signal for a signal). See the module docstring."""
    if (problem := launch_problem(nproc, list(train_args), port, config=command is None)) is not None:
        _say(f"error: {problem}")  # before any process starts
        return CONFIG_ERROR
    if command is None and (problem := memory_problem(nproc, list(train_args))) is not None:
        _say(f"error: {problem}")
        return host_lib.DOES_NOT_FIT
    base = [*(command or [sys.executable, "-m", "jaxpar.train"]), *train_args]
    # The run dir of a custom command is known only from the train arguments it is given.
    run_dir, resume = _train_settings(train_args) if command is None or train_args else (None, "auto")
    requested: list[int] = []  # signals not yet forwarded (by _run_once)
    received: list[int] = []  # every signal received: the user asked to stop, no restart

    def on_signal(signum, frame):
        requested.append(signum)
        received.append(signum)

    main_thread = threading.current_thread() is threading.main_thread()
    previous = {sig: signal.signal(sig, on_signal) for sig in FORWARDED} if main_thread else {}
    restarts, extra_args = 0, []
    try:
        while True:
            coordinator = f"127.0.0.1:{port or free_port()}"
            children, failed = _run_once(
                base + extra_args, nproc, coordinator, restarts, grace, tail_lines, requested
            )
            if failed is None:
                if max_restarts:
                    _say(
                        f"all {nproc} processes finished after "
                        f"{_plural(restarts, 'restart')} (--max-restarts {max_restarts})"
                    )
                # Stopped by a Ctrl-C (each process checkpointed): 130, as jaxpar.train exits.
                return 128 + signal.SIGINT if signal.SIGINT in received else 0
            child, returncode = failed
            _report_failure(child, returncode, tail_lines)
            code = exit_code(returncode)
            if not max_restarts:
                return code
            why_not = _no_restart(children, received, returncode, restarts, max_restarts)
            if why_not is not None:
                _say(
                    f"not restarting: {why_not} ({restarts} of --max-restarts {max_restarts} "
                    f"used); exit code {code}"
                )
                return code
            restarts += 1
            plan = Resumption.plan(run_dir, resume)
            extra_args = plan.extra_args
            _say(
                f"restart {restarts} of {max_restarts}: process {child.index} (pid "
                f"{child.proc.pid}) failed: {describe_exit(returncode)}; starting all {nproc} processes "
                f"again {plan.where}"
            )
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _no_restart(children, received, returncode, restarts, max_restarts) -> str | None:
    """Why a failed attempt is not restarted (a stop was asked for, a failure a restart would
    repeat, a process that would not die, no restarts left); None to restart."""
    survivors = [c for c in children if c.running()]
    if received:
        return f"a stop was requested ({signal.Signals(received[0]).name})"
    if returncode in (CONFIG_ERROR, host_lib.DOES_NOT_FIT):
        what = (
            "a configuration error"
            if returncode == CONFIG_ERROR
            else "a run too big for this machine's memory"
        )
        return f"exit code {exit_code(returncode)} is {what}, which a restart would repeat"
    if survivors:
        return f"process {survivors[0].index} (pid {survivors[0].proc.pid}) is still running after SIGKILL"
    if restarts >= max_restarts:
        return "no restarts are left"
    return None


USAGE_EPILOG = """examples:
  python -m jaxpar.launch --nproc 2 runtime.cpu_devices=4 mesh.data=2 mesh.fsdp=2 mesh.tensor=2
  python -m jaxpar.launch --nproc 4 configs/default.yaml runtime.cpu_devices=2 mesh.data=4 \\
      mesh.fsdp=1 mesh.tensor=2
  python -m jaxpar.launch --nproc 2 --max-restarts 3 runtime.cpu_devices=4 mesh.data=2 \\
      mesh.fsdp=2 mesh.tensor=2 checkpoint.every=100"""


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m jaxpar.launch",
        epilog=USAGE_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Starts N local processes of `python -m jaxpar.train` as one distributed run.",
    )
    parser.add_argument("--nproc", type=int, required=True, help="number of processes (>= 1)")
    parser.add_argument(
        "--port", type=int, default=None, help="coordinator port on 127.0.0.1 (default: a free one)"
    )
    parser.add_argument(
        "--grace",
        type=float,
        default=30.0,
        help="seconds the others get to stop once one has stopped or a stop was "
        "requested, before SIGKILL (default 30)",
    )
    parser.add_argument(
        "--max-restarts",
        type=int,
        default=0,
        help="after a failure, restart all processes from the newest complete "
        "checkpoint, up to this many times (default 0: exit with the "
        "failure's code)",
    )
    parser.add_argument(
        "--tail", type=int, default=40, help="lines of a failed process's output to print (default 40)"
    )
    parser.add_argument(
        "train_args",
        nargs=argparse.REMAINDER,
        help="[CONFIG.yaml] [dotted.key=value ...], as for jaxpar.train",
    )
    args = parser.parse_args(argv)
    if args.train_args[:1] == ["--"]:
        args.train_args = args.train_args[1:]
    if (problem := argument_problem(args)) is not None:
        _say(f"error: {problem}")  # one line, before any process starts
        raise SystemExit(CONFIG_ERROR)
    return args


# The distributed settings the launcher gives every process itself (through the environment).
OWN_SETTINGS = (
    "distributed.coordinator",
    "distributed.num_processes",
    "distributed.process_id",
    "distributed.auto",
)


def argument_problem(args: argparse.Namespace) -> str | None:
    """A count or duration on the command line that cannot work, or a distributed setting the
    launcher makes itself (None: nothing)."""
    if args.max_restarts < 0:
        return f"--max-restarts={args.max_restarts}: need a count >= 0"
    if not (math.isfinite(args.grace) and args.grace >= 0):
        return f"--grace={args.grace}: need a duration >= 0 in seconds, e.g. --grace 30"
    if args.tail < 0:
        return f"--tail={args.tail}: need a count of lines >= 0, e.g. --tail 40"
    given = [a for a in args.train_args if a.split("=", 1)[0].strip() in OWN_SETTINGS]
    if given:
        return (
            f"{' '.join(given)}: the launcher sets the distributed settings itself "
            "(JAXPAR_COORDINATOR, JAXPAR_NUM_PROCESSES, JAXPAR_PROCESS_ID); drop them"
        )
    return None


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    return launch(
        args.nproc,
        args.train_args,
        port=args.port,
        grace=args.grace,
        tail_lines=args.tail,
        max_restarts=args.max_restarts,
    )


if __name__ == "__main__":
    sys.exit(main())
