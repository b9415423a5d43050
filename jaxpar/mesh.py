"""The device mesh: six named axes from the config, outermost first (docs/design.md says why);
and what a process sets before its backend starts and before it compiles: the emulated CPU
devices, the multi-process run, the persistent compilation cache (`use_compile_cache`, with the
record of what each program cost, `COMPILED`)."""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import math
import os
import socket
import sys
import tempfile
import threading
from collections.abc import Sequence

import jax
import numpy as np
from jax.experimental.compilation_cache import compilation_cache
from jax.sharding import Mesh

from jaxpar.cli import CONFIG_ERROR
from jaxpar.config import MESH_AXES, ConfigError, DistributedConfig, RuntimeConfig


def cuda_plugin_folders() -> list[str]:
    """The folders of the installed CUDA plugin package (`jax_plugins.xla_cuda12`); [] without it.

    `importlib.util.find_spec("a.b")` imports `a` first and raises ModuleNotFoundError when `a`
    is missing, and the `jax_plugins` namespace exists only while some plugin is installed: a
    machine with only the `test` extra has none. Every question "is the plugin here?" comes here."""
    try:
        spec = importlib.util.find_spec("jax_plugins.xla_cuda12")
    except ImportError:
        return []
    return list(spec.submodule_search_locations or []) if spec is not None else []


def emulate_cpu_devices(runtime: RuntimeConfig) -> None:
    """On a CPU-only machine, present `runtime.cpu_devices` devices. Must run before the backend
    starts (before the first `jax.devices()`); it has no effect on GPUs.

    With the CUDA plugin installed but no NVIDIA driver (the `gpu-compile` extra on a CPU
    machine), JAX would try the plugin first, log a long cuInit traceback and fall back to the
    CPU; start on the CPU directly instead. A JAX_PLATFORMS the user set wins."""
    no_driver = not any(
        os.path.exists(p) for p in ("/dev/nvidiactl", "/proc/driver/nvidia", "/dev/dxg")
    )  # dxg: WSL2's GPU
    if (
        no_driver
        and not os.environ.get("JAX_PLATFORMS")
        and not jax.config.jax_platforms
        and cuda_plugin_folders()
    ):
        jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", runtime.cpu_devices)


# --- The persistent compilation cache ----------------------------------------------------------

# The least compile time of a program that jaxpar's cache keeps (jax's
# jax_persistent_cache_min_compile_time_secs, whose own default is 1 s); see use_compile_cache.
COMPILE_CACHE_MIN_SECONDS = 0.0
COMPILE_CACHE_ENV = "JAX_COMPILATION_CACHE_DIR"


@dataclasses.dataclass(frozen=True)
class CompileCache:
    """Where this process keeps and finds compiled programs: `directory` (None: no cache), `why`
    that one (for the start-up line), and `key`, the setting or variable that names it (for
    errors). `own`: jaxpar sets the cache's size and threshold (runtime.compile_cache_gib,
    COMPILE_CACHE_MIN_SECONDS); not for JAX_COMPILATION_CACHE_DIR's, left as JAX reads them.
    `default`: the per-user default, which nobody named."""

    directory: str | None
    why: str
    key: str = "runtime.compile_cache"
    own: bool = True
    default: bool = False


def compile_cache(runtime: RuntimeConfig) -> CompileCache:
    """The cache runtime.compile_cache names, read from the settings and the environment alone
    (nothing is created or written). off: none. A directory: that one. auto: none where the
    environment turns JAX's cache off (JAX_ENABLE_COMPILATION_CACHE=false), else its
    JAX_COMPILATION_CACHE_DIR when set (so JAX's own cache, the tests' one per session, is kept),
    else the per-user default, $JAXPAR_CACHE/compile or $XDG_CACHE_HOME/jaxpar/compile
    (~/.cache/jaxpar/compile). An explicit setting wins over the environment."""
    choice = runtime.compile_cache
    if choice == "off":
        return CompileCache(None, "runtime.compile_cache=off")
    if choice != "auto":
        return CompileCache(os.path.abspath(os.path.expanduser(choice)), "runtime.compile_cache")
    if os.environ.get("JAX_ENABLE_COMPILATION_CACHE", "").strip().lower() in ("0", "false", "no", "off"):
        return CompileCache(None, "JAX_ENABLE_COMPILATION_CACHE, which runtime.compile_cache=auto defers to")
    if env := os.environ.get(COMPILE_CACHE_ENV):
        return CompileCache(
            os.path.abspath(os.path.expanduser(env)),
            f"{COMPILE_CACHE_ENV}, which runtime.compile_cache=auto defers to",
            key=COMPILE_CACHE_ENV,
            own=False,
        )
    from jaxpar.corpus.shards import cache_root

    return CompileCache(os.path.join(cache_root(), "compile"), "runtime.compile_cache=auto", default=True)


_in_use: CompileCache | None = None


def use_compile_cache(runtime: RuntimeConfig, devices_here: bool = True) -> CompileCache:
    """Sets JAX's persistent compilation cache for this whole process as runtime.compile_cache
    asks (`compile_cache`), before its first compile: every program it compiles after this (the
    train step, the init, inspect's program, a restart's, checkpoint saving's small ones) is
    looked up there first and written there after compiling. Returns the cache in use.

    A directory set or named by JAX_COMPILATION_CACHE_DIR was checked to be writable before
    (`jaxpar.checks.validate_runtime`: exit 2); the per-user default is created here, and where
    it cannot be, the run goes on without a cache and says why. jaxpar's own caches keep every
    program however fast it compiled (COMPILE_CACHE_MIN_SECONDS = 0: the small ones add up;
    benchmarks/RESULTS.md) and are bounded by runtime.compile_cache_gib once, here, at the start
    (`trim_cache`), not by jax at every write: jax's bound scans the whole directory under a
    file lock at each program it writes, a cost that grows with the cache (measured: 65 ms a
    write at 615 entries, so about 2 s a write at 20,000). What one run writes goes above the
    bound until the next start trims it.

    `devices_here=False` (compiling for GPUs that are not here, `jaxpar.compiled.targets`): no
    cache of jaxpar's. jax 0.12 writes such programs but cannot read them back ("PjRtCompiler
    must be constructed with a Client to call DeserializeLoadedExecutable"): every entry would be
    a wasted write, and every later lookup a warning and a compile anyway. A cache the
    environment configured (JAX_COMPILATION_CACHE_DIR under auto) is left as it is, as always."""
    global _in_use
    cache = compile_cache(runtime)
    if not devices_here and cache.directory is not None and cache.own:
        cache = CompileCache(
            None, "compiling for devices that are not here, which jax cannot load from a cache"
        )
    if cache.default:
        try:
            os.makedirs(cache.directory, exist_ok=True)
            fd, probe = tempfile.mkstemp(prefix=".jaxpar-write-probe-", dir=cache.directory)
            os.close(fd)
            os.remove(probe)
        except OSError as e:
            cache = CompileCache(
                None,
                f"runtime.compile_cache=auto: {cache.directory} is not writable ({e.strerror}); "
                "set runtime.compile_cache to a writable directory",
            )
    wanted = {"jax_enable_compilation_cache": cache.directory is not None}
    if cache.directory is not None:
        wanted["jax_compilation_cache_dir"] = cache.directory
    if cache.directory is not None and cache.own:
        trim_cache(cache.directory, int(runtime.compile_cache_gib * 2**30))
        wanted["jax_compilation_cache_max_size"] = -1  # (jax: no bound of its own, no lock)
        wanted["jax_persistent_cache_min_compile_time_secs"] = COMPILE_CACHE_MIN_SECONDS
    changed = {name: value for name, value in wanted.items() if getattr(jax.config, name) != value}
    for name, value in changed.items():
        jax.config.update(name, value)
    if changed:  # jax opens its cache once, at the first compile: a caller that compiled before
        compilation_cache.reset_cache()  # (a test, a notebook) has it opened again
    _watch_compiles()
    _in_use = cache
    return cache


CACHE_SUFFIX, ATIME_SUFFIX = "-cache", "-atime"  # jax's names: a program, its last use (bounded caches)


def trim_cache(directory: str, bound_bytes: int) -> int:
    """Removes the least recently used programs from a compile cache `directory` until its
    programs (jax's `<key>-cache` files) hold at most `bound_bytes`; returns how many went. A
    program's last use is the later of its file's access and write times (a cache hit reads the
    file; Linux's relatime moves the access time at most once a day, which is the resolution
    here). A `-atime` file that jax's own bound wrote goes with its program. A program another
    process is reading as it goes is compiled again there (jax warns)."""
    try:
        entries = [e for e in os.scandir(directory) if e.name.endswith(CACHE_SUFFIX) and e.is_file()]
    except OSError:
        return 0
    stats = []
    for entry in entries:
        try:
            st = entry.stat()
        except OSError:  # removed meanwhile
            continue
        stats.append((max(st.st_atime_ns, st.st_mtime_ns), st.st_size, entry.path))
    total, removed = sum(size for _, size, _ in stats), 0
    for _, size, path in sorted(stats):
        if total <= bound_bytes:
            break
        for victim in (path, path.removesuffix(CACHE_SUFFIX) + ATIME_SUFFIX):
            with contextlib.suppress(OSError):
                os.remove(victim)
        total, removed = total - size, removed + 1
    return removed


def compile_cache_in_use() -> CompileCache:
    """The cache `use_compile_cache` set; where it was not called (a library caller), JAX's."""
    if _in_use is not None:
        return _in_use
    on = jax.config.jax_enable_compilation_cache and jax.config.jax_compilation_cache_dir
    return CompileCache(jax.config.jax_compilation_cache_dir if on else None, "JAX's settings", own=False)


@dataclasses.dataclass
class Compiled:
    """One program XLA compiled, or loaded from the persistent cache, in this process."""

    name: str  # the jitted function's name
    seconds: float  # XLA's compile, or the cache's read and load
    loaded: bool = False  # read from the persistent cache
    written: bool = False  # compiled and written to it


# Every program of this process, in order (`_watch_compiles`); `compiled_since` reads a stretch.
COMPILED: list[Compiled] = []
_BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"  # jax._src.dispatch's, per program
_pending: dict[int, Compiled] = {}  # by thread: what the cache said of the program compiling there
_watching = False


def _on_event(event: str, **kwargs) -> None:
    """jax's cache events come before the program's compile event, on the thread compiling it."""
    flag = {"/jax/compilation_cache/cache_hits": "loaded", "/jax/compilation_cache/cache_misses": "written"}
    if event in flag:
        setattr(_pending.setdefault(threading.get_ident(), Compiled("", 0.0)), flag[event], True)


def _on_duration(event: str, seconds: float, **kwargs) -> None:
    if event == _BACKEND_COMPILE:
        done = _pending.pop(threading.get_ident(), Compiled("", 0.0))
        COMPILED.append(dataclasses.replace(done, name=str(kwargs.get("fun_name", "")), seconds=seconds))


def _watch_compiles() -> None:
    """Records every program compiled from now on into COMPILED, once per process: jax.monitoring's
    events say, for each, whether it came from the persistent cache or was written to it."""
    global _watching
    if not _watching:
        jax.monitoring.register_event_listener(_on_event)
        jax.monitoring.register_event_duration_secs_listener(_on_duration)
        _watching = True


def compiled_since(mark: int) -> list[Compiled]:
    """The programs compiled (or loaded) since `len(COMPILED)` was `mark`."""
    return COMPILED[mark:]


def cache_line(cache: CompileCache, runtime: RuntimeConfig) -> str:
    """The start-up line: which cache the process uses, and why that one."""
    if cache.directory is None:
        return f"compile cache: off ({cache.why})"
    bound = f", up to {runtime.compile_cache_gib:g} GiB" if cache.own else ""
    return f"compile cache: {cache.directory} ({cache.why}{bound})"


def compile_line(programs: list[Compiled], cache: CompileCache, what: str, scope: str = "") -> str | None:
    """Whether `what` (`programs`, e.g. those up to a run's first step) was compiled or loaded
    from the persistent cache, as jax's cache events said of each program, and in how long:
    XLA's time, compiling or reading and loading (tracing and lowering are not counted). None
    where nothing compiled (this process had them all already)."""
    if not programs:
        return None
    seconds = sum(p.seconds for p in programs)
    loaded, written = sum(p.loaded for p in programs), sum(p.written for p in programs)
    names = list(dict.fromkeys(p.name.removeprefix("jit(").removesuffix(")") for p in programs))
    shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
    counted = f"{len(programs)} program{'s' if len(programs) > 1 else ''}{scope}: {shown}"
    if loaded == len(programs):
        return f"loaded {what} from the compile cache in {seconds:.1f} s ({counted}; {cache.directory})"
    if cache.directory is None:
        return f"compiled {what} in {seconds:.1f} s ({counted}; compile cache off: {cache.why})"
    if loaded:
        kept = f"{loaded} of them loaded from the compile cache {cache.directory}"
    elif written:
        kept = f"written to the compile cache {cache.directory}"
    else:
        least = jax.config.jax_persistent_cache_min_compile_time_secs
        kept = (
            f"none written to the compile cache {cache.directory}, which keeps those of {least:g} s or more"
        )
    return f"compiled {what} in {seconds:.1f} s ({counted}; {kept})"


def distributed_settings(dist: DistributedConfig) -> DistributedConfig:
    """The config's distributed keys, each filled from the JAXPAR_* environment when unset."""
    env = os.environ
    coordinator = dist.coordinator or env.get("JAXPAR_COORDINATOR")
    num = dist.num_processes if dist.num_processes is not None else env.get("JAXPAR_NUM_PROCESSES")
    pid = dist.process_id if dist.process_id is not None else env.get("JAXPAR_PROCESS_ID")
    try:
        num = None if num is None else int(num)
        pid = None if pid is None else int(pid)
    except ValueError:
        raise ConfigError(
            f"JAXPAR_NUM_PROCESSES={num!r} / JAXPAR_PROCESS_ID={pid!r} must be integers"
        ) from None
    return dataclasses.replace(dist, coordinator=coordinator, num_processes=num, process_id=pid)


def _check_distributed(dist: DistributedConfig) -> None:
    """The settings of a multi-process start that cannot work, as a ConfigError."""
    if dist.coordinator is not None and (dist.num_processes is None or dist.process_id is None):
        raise ConfigError(
            f"distributed.coordinator={dist.coordinator} needs distributed.num_processes and "
            f"distributed.process_id (got {dist.num_processes} and {dist.process_id})"
        )
    if dist.num_processes is not None and not 0 <= (dist.process_id or 0) < dist.num_processes:
        raise ConfigError(
            f"distributed.process_id={dist.process_id} is not in "
            f"[0, {dist.num_processes}) (distributed.num_processes)"
        )
    if not (math.isfinite(dist.timeout_s) and dist.timeout_s > 0):
        raise ConfigError(
            f"distributed.timeout_s={dist.timeout_s}: give the seconds a process may wait for the "
            "coordinator and the other processes (a positive number, e.g. 300)"
        )


def _answers(address: str, seconds: float = 1.0) -> bool:
    """Whether something accepts a TCP connection at `address` (host:port) within `seconds`."""
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=seconds):
            return True
    except (OSError, ValueError):
        return False


def waiting_line(dist: DistributedConfig) -> str:
    """What a process says as it starts to wait for the run to form."""
    limit = f"up to {dist.timeout_s:g} s (distributed.timeout_s)"
    if dist.auto:
        return f"jaxpar: waiting {limit} for the processes JAX's cluster detection finds"
    me = f"jaxpar: process {dist.process_id} of {dist.num_processes}"
    if dist.process_id == 0:
        others = dist.num_processes - 1
        if not others:
            return f"{me} is the coordinator at {dist.coordinator} (no other process)"
        return (
            f"{me} is the coordinator at {dist.coordinator}; waiting {limit} for the other "
            f"{others} process{'' if others == 1 else 'es'} to join"
        )
    return f"{me}: waiting {limit} for the coordinator at {dist.coordinator} and the other processes"


def timeout_message(dist: DistributedConfig) -> str:
    """The one line of a start that timed out: who was not there, and what to check."""
    waited = f"within {dist.timeout_s:g} s (distributed.timeout_s)"
    more = "or raise distributed.timeout_s"
    if dist.auto:
        return f"the processes JAX's cluster detection found did not all join {waited}; {more}"
    me = f"process {dist.process_id} of {dist.num_processes}"
    if dist.process_id == 0:
        me += f" (the coordinator, at {dist.coordinator}):"
    elif not _answers(dist.coordinator):
        return (
            f"{me}: nothing answered at the coordinator's address {dist.coordinator} {waited} "
            "(distributed.coordinator, or JAXPAR_COORDINATOR): start process 0 there, check the "
            f"address and port, {more}"
        )
    else:
        me += f": the coordinator at {dist.coordinator} is up, but"
    return (
        f"{me} not all {dist.num_processes} processes (distributed.num_processes) joined "
        f"{waited}: start every process with the same coordinator, check "
        f"distributed.num_processes, {more}"
    )


@contextlib.contextmanager
def _deadline(seconds: float, message):
    """Ends the process with `message()` on one line of stderr and exit code 2 (a config error)
    if the block is still running after `seconds`. jax.distributed.initialize aborts the process
    from C++ when its own timeout passes (SIGABRT, a stack trace, exit 134), which Python cannot
    catch; a timer thread runs while it waits (it releases the GIL) and stops first."""

    def expire():
        print(f"config error: {message()}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(CONFIG_ERROR)  # the main thread is inside C++, and would not see an exception

    timer = threading.Timer(seconds, expire)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


# What jax.distributed.initialize is given beyond distributed.timeout_s: its own timeout must
# not come first (it aborts the process), `_deadline` must.
INITIALIZE_MARGIN_S = 30


def start_distributed(dist: DistributedConfig) -> bool:
    """Joins the multi-process run if one is configured; returns whether it did. Must run before
    the backend starts. On CPU, collectives between processes go over gloo (loopback or TCP).
    Says at once what it waits for, and stops after distributed.timeout_s with one line and
    exit code 2 if the run has not formed (`timeout_message`)."""
    dist = distributed_settings(dist)
    if dist.coordinator is None and not dist.auto:
        return False
    _check_distributed(dist)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    print(waiting_line(dist), file=sys.stderr, flush=True)
    limit = math.ceil(dist.timeout_s) + INITIALIZE_MARGIN_S
    with _deadline(dist.timeout_s, lambda: timeout_message(dist)):
        if dist.auto:
            jax.distributed.initialize(initialization_timeout=limit)
            how = "found by jax's cluster detection"
        else:
            # Explicit settings win: without "deactivate", jax still runs its SLURM detection
            # inside srun and restricts each process to the GPU of SLURM_LOCALID.
            jax.distributed.initialize(
                dist.coordinator,
                num_processes=dist.num_processes,
                process_id=dist.process_id,
                cluster_detection_method="deactivate",
                initialization_timeout=limit,
            )
            how = f"coordinator {dist.coordinator}"
    print(
        f"jaxpar: process {jax.process_index()} of {jax.process_count()} ({how}), "
        f"{jax.local_device_count()} local devices",
        file=sys.stderr,
        flush=True,
    )
    return True


def make_mesh(sizes: dict[str, int], devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A Mesh with axes (pipe, data, fsdp, expert, context, tensor) of the given sizes.

    Devices are laid out in `jax.devices()` order, so the innermost axes (tensor, context) land
    on neighbouring devices -- on a GPU node, the ones joined by NVLink.
    """
    devices = list(jax.devices() if devices is None else devices)
    shape = tuple(sizes[axis] for axis in MESH_AXES)
    return Mesh(np.array(devices).reshape(shape), MESH_AXES)
