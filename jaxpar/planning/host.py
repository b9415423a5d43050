"""Before a run compiles on a CPU: will it fit in this machine's RAM, and how long will a step take?

On a CPU every emulated device's buffers live in the host's memory, so a preset written for GPUs
(`configs/gpt2-124m.yaml`: 17.6 GiB of activations at batch 12 x 1024 tokens) can take the whole
machine, and a step that an H100 runs in 40 ms takes minutes. Both are predicted here from the
config alone, before anything compiles:

- memory: the planner's per-device prediction for XLA:CPU's program (`jaxpar.planning.memory.predict_memory`,
  backend "cpu"; with finetune.lora, the adapters and their gradients and Adam state), times the
  emulated devices of this process, times `COMPILER_MARGIN`, plus `PROCESS_BYTES` for the Python
  process, the JAX runtime and the data loader; compared with
  `runtime.host_memory_gib` when set, else with `USABLE_SHARE` of the memory available to this
  process: the kernel's MemAvailable, or less where a cgroup limits the process (Slurm's --mem,
  a container's memory limit).
- time per step: the step's executed FLOPs (`jaxpar.planning.step_time.hardware_flops`,
  recomputation included) over this machine's float32 matmul rate, measured here in a fraction
  of a second, times `STEP_EFFICIENCY`, the share of that rate a whole train step reaches on a CPU.

Calibration (2-core x86-64 machines, jax 0.12.0.1; the matmul probe read 190-200 GFLOP/s there):
the gpt2-124m preset on one device ran 254-278 s per step and peaked at 22.0 GB resident
(predicted here: 20.3 GiB); the default job (0.9 M parameters, 8 emulated devices) ran 5,641
tokens/s and peaked at 1.7 GB. A forecast is a guide, about +-50% on time: the CPU's other load,
its vector units and XLA:CPU's kernels for the shapes at hand all move it.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import jax
import jax.numpy as jnp

from jaxpar.config import Config
from jaxpar.planning import memory as memory_lib
from jaxpar.planning import step_time as step_time_lib
from jaxpar.training.metrics import format_duration

GIB = 2**30
# The Python process, JAX's runtime, compiled code and the data pipeline, beside the program's
# buffers: the default job's 1.7 GB peak less its 0.29 GB of predicted device buffers.
PROCESS_BYTES = 1.4 * GIB
# XLA:CPU's compilation and allocator on top of the compiled program's buffers: gpt2-124m's 22.0 GB
# peak over its 18.9 GB of predicted buffers + PROCESS_BYTES.
COMPILER_MARGIN = 1.08
# A run is refused when its forecast exceeds this share of the available memory: the rest is left
# to the rest of the machine, and to the forecast's error. At 0.9 the gpt2-124m preset (forecast
# 20.4 GiB) started on an idle 23 GB machine and left it 1 GB.
USABLE_SHARE = 0.75
# The share of the float32 matmul probe's rate a whole train step reaches on XLA:CPU: gpt2-124m at
# 266 s per step ran 40.6 GFLOP/s of its step's executed FLOPs against the probe's 195.
STEP_EFFICIENCY = 0.21
# A forecast above this many seconds per step is reported as slow.
SLOW_STEP_S = 10.0


DOES_NOT_FIT = 3  # the exit code of a run refused here: like a config error, a restart would repeat it


class DoesNotFit(Exception):
    """The run is predicted to need more memory than this host has available (exit code 3)."""


@dataclass(frozen=True)
class Forecast:
    memory_bytes: float  # the process's predicted peak resident memory
    limit_bytes: float | None  # what it may take: runtime.host_memory_gib, else a share of what
    # is available (None: unknown)
    available_bytes: float | None  # what the host has for it (None: unknown)
    step_seconds: float  # predicted time of one train step
    step_flops: float  # executed FLOPs of one step, all emulated devices together
    matmul_flops_per_s: float  # this machine's float32 matmul rate, as measured

    @property
    def fits(self) -> bool:
        return self.limit_bytes is None or self.memory_bytes <= self.limit_bytes

    @property
    def slow(self) -> bool:
        return self.step_seconds > SLOW_STEP_S


def _read_number(path: str) -> float | None:
    try:
        with open(path) as f:
            text = f.read().split()[0]
    except (OSError, IndexError):
        return None
    return float(text) if text.isdigit() else None  # cgroup v2 writes "max" for no limit


def _cgroup_room() -> float | None:
    """Bytes this process's memory cgroup has left (limit less usage), v2 then v1; None where no
    limit applies. (The cgroup of PID 1's view: /sys/fs/cgroup, as a container or Slurm job sees it.)"""
    for limit, usage in (
        ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
        ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes"),
    ):
        cap, used = _read_number(limit), _read_number(usage)
        if cap is not None and cap < 2**60:  # v1 writes a huge number for no limit
            return max(cap - (used or 0.0), 0.0)
    return None


def available_bytes() -> float | None:
    """Memory available to this process: the kernel's MemAvailable, or its cgroup's room where
    that is smaller; None where neither is known."""
    meminfo = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    meminfo = float(line.split()[1]) * 1024
    except OSError:
        pass
    known = [x for x in (meminfo, _cgroup_room()) if x is not None]
    return min(known) if known else None


def limit_bytes(cfg: Config, available: float | None) -> float | None:
    """What a run may take: runtime.host_memory_gib as given, else USABLE_SHARE of `available`."""
    if cfg.runtime.host_memory_gib is not None:
        return cfg.runtime.host_memory_gib * GIB
    return None if available is None else USABLE_SHARE * available


def memory_bytes(cfg: Config, sizes: dict[str, int], local_devices: int) -> float:
    """The predicted peak resident memory of one process running `local_devices` of the mesh."""
    kernel = memory_lib.attention_kernel(cfg, sizes, None)
    per_device = memory_lib.predict_memory(cfg, sizes, kernel, backend="cpu")["total"]
    return COMPILER_MARGIN * per_device * local_devices + PROCESS_BYTES


def matmul_rate(n: int = 1024, repeats: int = 5) -> float:
    """This machine's float32 matmul rate (FLOP/s) on JAX's CPU backend: the best of a few
    [n, n] x [n, n] products (about 0.1 s on 2 cores)."""
    cpu = jax.devices("cpu")[0]
    a = jax.device_put(jnp.ones((n, n), jnp.float32), cpu)
    product = jax.jit(lambda x: x @ x)
    product(a).block_until_ready()
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        product(a).block_until_ready()
        best = min(best, time.perf_counter() - start)
    return 2 * n**3 / best


def forecast(cfg: Config, sizes: dict[str, int], local_devices: int, rate: float | None = None) -> Forecast:
    """Predicted peak memory of this process and time per step of `cfg` on this CPU host."""
    memory = memory_bytes(cfg, sizes, local_devices)
    t = cfg.train
    per_token = step_time_lib.hardware_flops(cfg.model, t.seq_len, cfg.parallel.remat, lora=cfg.finetune.lora)
    flops = per_token * t.batch_size * t.seq_len
    rate = matmul_rate() if rate is None else rate
    available = available_bytes()
    return Forecast(
        memory_bytes=memory,
        limit_bytes=limit_bytes(cfg, available),
        available_bytes=available,
        step_seconds=flops / (rate * STEP_EFFICIENCY),
        step_flops=flops,
        matmul_flops_per_s=rate,
    )


def room(cfg: Config, limit: float, available: float | None) -> str:
    """What the limit is, in words: the setting, or a share of what is available."""
    if cfg.runtime.host_memory_gib is not None:
        return f"runtime.host_memory_gib={cfg.runtime.host_memory_gib:g} allows {limit / GIB:.1f} GiB"
    return (
        f"{available / GIB:.1f} GiB is available, of which {USABLE_SHARE:.0%} "
        f"({limit / GIB:.1f} GiB) may be taken"
    )


ADVICE = (
    "use a smaller train.batch_size or train.seq_len, parallel.remat=full, a smaller model, "
    "a GPU, or set runtime.host_memory_gib to the GiB the run may take if the estimate is wrong"
)


def refusal(f: Forecast, cfg: Config) -> str:
    """The one-line message of a run that will not fit."""
    lora = cfg.finetune.lora
    adapters = f", finetune.lora.rank={lora.rank}" if lora.rank > 0 else ""
    return (
        f"this run needs about {f.memory_bytes / GIB:.1f} GiB of host memory on this CPU "
        f"(train.batch_size={cfg.train.batch_size} x train.seq_len={cfg.train.seq_len}{adapters}, "
        f"{cfg.runtime.cpu_devices} emulated device(s)) and "
        f"{room(cfg, f.limit_bytes, f.available_bytes)}; "
        + ("use a smaller finetune.lora.rank, or " if adapters else "")
        + ADVICE
    )


def warning(f: Forecast, cfg: Config) -> str:
    """The one-line notice of a slow run: the expected time per step and for the whole run."""
    return (
        f"warning: on this CPU one step is expected to take about {format_duration(f.step_seconds)} "
        f"({f.step_flops:.2e} FLOPs at about {f.matmul_flops_per_s * STEP_EFFICIENCY / 1e9:.0f} "
        f"GFLOP/s), {cfg.train.steps} steps about {format_duration(f.step_seconds * cfg.train.steps)}; "
        f"memory about {f.memory_bytes / GIB:.1f} GiB. For a quick try on a CPU, a smaller model "
        "or batch (configs/tiny.yaml, or the default job with no arguments)."
    )


def check(cfg: Config, sizes: dict[str, int]) -> Forecast | None:
    """On a CPU backend: raises DoesNotFit when the run is predicted not to fit in the available
    memory; returns the forecast (None on other backends: their devices hold their own memory)."""
    if jax.default_backend() != "cpu":
        return None
    f = forecast(cfg, sizes, jax.local_device_count())
    if not f.fits:
        raise DoesNotFit(refusal(f, cfg))
    return f
