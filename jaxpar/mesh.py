"""The device mesh: six named axes from the config, outermost first (docs/design.md says why)."""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import math
import os
import socket
import sys
import threading
from collections.abc import Sequence

import jax
import numpy as np
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
