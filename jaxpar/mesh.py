"""The device mesh: six named axes from the config, outermost first (docs/design.md says why)."""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import Mesh

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
    return DistributedConfig(coordinator=coordinator, num_processes=num, process_id=pid, auto=dist.auto)


def start_distributed(dist: DistributedConfig) -> bool:
    """Joins the multi-process run if one is configured; returns whether it did. Must run before
    the backend starts. On CPU, collectives between processes go over gloo (loopback or TCP)."""
    dist = distributed_settings(dist)
    if dist.coordinator is None and not dist.auto:
        return False
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
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if dist.auto:
        jax.distributed.initialize()
        how = "found by jax's cluster detection"
    else:
        # Explicit settings win: without "deactivate", jax still runs its SLURM detection inside
        # srun and restricts each process to the GPU of SLURM_LOCALID.
        jax.distributed.initialize(
            dist.coordinator,
            num_processes=dist.num_processes,
            process_id=dist.process_id,
            cluster_detection_method="deactivate",
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
