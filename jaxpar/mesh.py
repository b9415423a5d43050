"""The device mesh: six named axes from the config, outermost first (DESIGN.md)."""

from __future__ import annotations

from typing import Sequence

import jax
import numpy as np
from jax.sharding import Mesh

from jaxpar.config import MESH_AXES, RuntimeConfig


def emulate_cpu_devices(runtime: RuntimeConfig) -> None:
    """On a CPU-only machine, present `runtime.cpu_devices` devices. Must run before the backend
    starts (before the first `jax.devices()`); it has no effect on GPUs."""
    jax.config.update("jax_num_cpu_devices", runtime.cpu_devices)


def make_mesh(sizes: dict[str, int], devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A Mesh with axes (pipe, data, fsdp, expert, context, tensor) of the given sizes.

    Devices are laid out in `jax.devices()` order, so the innermost axes (tensor, context) land
    on neighbouring devices -- on a GPU node, the ones joined by NVLink.
    """
    devices = list(jax.devices() if devices is None else devices)
    shape = tuple(sizes[axis] for axis in MESH_AXES)
    return Mesh(np.array(devices).reshape(shape), MESH_AXES)
