"""Compile for GPUs that are not here: N devices of a named type, on a machine with no GPU.

The CUDA plugin (`pip install -e ".[gpu-compile]"`) carries XLA's whole GPU compiler and, inside
its shared library, the target descriptions (`GpuTargetConfigProto`, text form) of the GPUs its
XLA build knows. Given one of them, `jax.experimental.topologies.get_topology_desc` returns
compile-only devices: `Mesh(devices, ...)` and `jax.jit(f).lower(...).compile()` then build the
real program (sm_90a code for an H100), whose `memory_analysis()` and HLO text are facts of what
the GPU would run. Nothing executes; timings still need a real GPU.

Two conditions, both handled here: the backend must be the CPU (otherwise the plugin calls
`cuInit`, fails without a driver, and the topology call fails after it), so `use_cpu_backend()`
runs before JAX starts; and the description must come from the installed plugin, because a file
from a newer XLA may not parse.
"""

from __future__ import annotations

import mmap
import os
import re
from dataclasses import dataclass

from jaxpar.config import ConfigError
from jaxpar.mesh import cuda_plugin_folders

# The share of device memory a program may use and still be said to fit (here, in `jaxpar.plan`
# and `jaxpar.inspect`). The rest is kept for the CUDA context, cuDNN/cuBLAS workspaces and
# allocator fragmentation. JAX preallocates 75% of the device by default; a run that needs more
# sets XLA_PYTHON_CLIENT_MEM_FRACTION (e.g. 0.9).
USABLE_FRACTION = 0.9


def device_memory(device) -> int | None:
    """The bytes a program may use on `device`: a real GPU's allocator limit (`memory_stats`),
    or for a compile-only device of a type jaxpar knows (GPUS) its usable share; None where
    neither is known (CPU devices)."""
    try:
        stats = device.memory_stats()
    except Exception:  # compile-only devices have no runtime to ask
        stats = None
    if stats and stats.get("bytes_limit"):
        return int(stats["bytes_limit"])
    kind = getattr(device, "device_kind", None)
    known = [gpu for gpu in GPUS.values() if gpu.description == kind and gpu.memory_bytes]
    return known[0].usable_bytes if known else None


def usable_bytes(memory_bytes: int) -> int:
    """The bytes of a device of `memory_bytes` that a program may use (USABLE_FRACTION)."""
    return int(memory_bytes * USABLE_FRACTION)


@dataclass(frozen=True)
class DeviceSpec:
    """One GPU type: the CUDA plugin's description of it (what `--target` compiles for) and,
    where jaxpar has them, the datasheet numbers `jaxpar.plan` predicts with (None: a type
    that can be compiled for but is not planned for)."""

    key: str  # the short name (inspect's --target, plan's --gpus)
    description: str  # the `device_description_str` of the plugin's embedded description
    name: str | None = None  # as the planner shows it
    bf16_flops: float | None = None  # dense bf16 tensor-core peak, FLOP/s
    memory_bytes: int | None = None  # HBM per GPU
    hbm_bandwidth: float | None = None  # bytes/s
    nvlink_bandwidth: float | None = None  # bytes/s per GPU, one direction
    network_bandwidth: float | None = None  # bytes/s per GPU to other nodes, one direction
    compute_capability: str | None = None

    @property
    def usable_bytes(self) -> int:
        return usable_bytes(self.memory_bytes)


# Every GPU type jaxpar names, by short name: what `--target` compiles for, and with datasheet
# numbers what `python -m jaxpar.plan --gpus` plans for (DEVICES).
GPUS = {
    gpu.key: gpu
    for gpu in (
        # NVIDIA H100 Tensor Core GPU datasheet (SXM5): BF16 1,979 TFLOPS with sparsity (989.4
        # dense), 80 GB HBM3 at 3.35 TB/s, NVLink 900 GB/s (both directions together); NVIDIA DGX
        # H100 datasheet: 8 x ConnectX-7 400 Gb/s InfiniBand, one per GPU (50 GB/s). Memory: the
        # device_memory_size of the CUDA plugin's "NVIDIA H100 80GB HBM3" target description.
        DeviceSpec(
            "h100",
            "NVIDIA H100 80GB HBM3",
            "NVIDIA H100 80GB HBM3 (SXM)",
            989.4e12,
            85_520_809_984,
            3.35e12,
            450e9,
            50e9,
            "9.0",
        ),
        DeviceSpec("h100-pcie", "NVIDIA H100 PCIe"),
        # The H800 SXM: the H100 SXM's die, 80 GB HBM3 at 3.35 TB/s and bf16 peak, with NVLink cut
        # from 900 to 400 GB/s (both directions together) for export rules. DeepSeek, "Insights
        # into DeepSeek-V3: Scaling Challenges and Reflections on Hardware for AI Architectures"
        # (ISCA 2025, arXiv 2505.09343): H800 nodes with NVLink at 400 GB/s and a 400 Gb/s
        # InfiniBand NIC a GPU; the DeepSeek-V3 report (arXiv 2412.19437, section 3.1): 2048 H800s,
        # 8 a node; philisun.com, "NVIDIA H800 vs H100" (specification table): the same memory and
        # low-precision compute, NVLink 400 against 900 GB/s. Memory bytes as the H100's (the same
        # 80 GB part). The CUDA plugin embeds no H800 description: planned for (--gpus), not
        # compiled for (--target); "NVIDIA H800" is the device kind `mesh: auto` matches.
        DeviceSpec(
            "h800",
            "NVIDIA H800",
            "NVIDIA H800 80GB HBM3 (SXM)",
            989.4e12,
            85_520_809_984,
            3.35e12,
            200e9,
            50e9,
            "9.0",
        ),
        # NVIDIA H200 Tensor Core GPU datasheet (SXM): BF16 1,979 TFLOPS with sparsity, 141 GB
        # HBM3e at 4.8 TB/s, NVLink 900 GB/s; NVIDIA DGX H200 datasheet: 8 x ConnectX-7 400 Gb/s.
        DeviceSpec(
            "h200",
            "NVIDIA H200 141GB HBM3e",
            "NVIDIA H200 141GB HBM3e (SXM)",
            989.4e12,
            141 * 10**9,
            4.8e12,
            450e9,
            50e9,
            "9.0",
        ),
        # NVIDIA A100 Tensor Core GPU datasheet (SXM4 80GB): BF16 312 TFLOPS dense, 80 GB HBM2e at
        # 2,039 GB/s, NVLink 600 GB/s; NVIDIA DGX A100 datasheet: 8 x ConnectX-6 200 Gb/s HDR.
        DeviceSpec(
            "a100",
            "NVIDIA A100-SXM4-80GB",
            "NVIDIA A100-SXM4-80GB",
            312e12,
            80 * 10**9,
            2.039e12,
            300e9,
            25e9,
            "8.0",
        ),
        DeviceSpec("a100-40gb", "NVIDIA A100-SXM4-40GB"),
        # NVIDIA HGX B200 datasheet: FP16/BF16 36 PFLOPS with sparsity for 8 GPUs (2.25 PFLOPS
        # dense each), 1.4 TB HBM3e for 8 (180 GB each) at 8 TB/s each, NVLink 1.8 TB/s per GPU;
        # NVIDIA DGX B200 datasheet: 8 x ConnectX-7 400 Gb/s.
        DeviceSpec("b200", "NVIDIA B200", "NVIDIA B200", 2.25e15, 180 * 10**9, 8e12, 900e9, 50e9, "10.0"),
        DeviceSpec("gb200", "NVIDIA GB200"),
    )
}

# Views of GPUS: short name -> the plugin's description; short name -> the GPUs with datasheet
# numbers (what the planner plans for).
TARGETS = {key: gpu.description for key, gpu in GPUS.items()}
DEVICES = {key: gpu for key, gpu in GPUS.items() if gpu.bf16_flops is not None}

INSTALL_HINT = 'pip install -e ".[gpu-compile]"'


class MissingExtra(ConfigError):
    """The CUDA plugin is not installed: compiling for a GPU needs the `gpu-compile` extra."""


@dataclass(frozen=True)
class Target:
    name: str  # short name, e.g. "h100"
    description: str  # the plugin's device description, e.g. "NVIDIA H100 80GB HBM3"
    count: int  # how many devices
    memory_bytes: int  # memory of one device
    spec: str  # GpuTargetConfigProto text

    @property
    def usable_bytes(self) -> int:
        return usable_bytes(self.memory_bytes)


def parse_target(text: str) -> tuple[str, int]:
    """`h100` -> ("h100", 1); `h100:8` -> ("h100", 8). Unknown names list the known ones."""
    name, _, count = text.partition(":")
    name = name.strip().lower()
    if name not in TARGETS:
        raise ConfigError(
            f"--target {text!r}: unknown GPU type {name!r}; known: {', '.join(TARGETS)} "
            "(optionally with :N devices, e.g. h100:8)"
        )
    if count and not (count.isdigit() and int(count) >= 1):
        raise ConfigError(f"--target {text!r}: the device count after ':' must be a positive integer")
    return name, int(count) if count else 1


def plugin_library() -> str:
    """Path of the CUDA plugin's shared library, or MissingExtra naming the extra to install."""
    folders = cuda_plugin_folders()
    if not folders:
        raise MissingExtra(f"compiling for a GPU needs the CUDA plugin: {INSTALL_HINT}")
    for folder in folders:
        path = os.path.join(folder, "xla_cuda_plugin.so")
        if os.path.isfile(path):
            return path
    raise MissingExtra(f"the CUDA plugin has no xla_cuda_plugin.so; reinstall it: {INSTALL_HINT}")


def embedded_specs(library: str | None = None) -> dict[str, str]:
    """{device description: GpuTargetConfigProto text} for every description the plugin embeds.

    Each is a NUL-terminated string constant in the library that contains `gpu_device_info {`."""
    specs = {}
    with (
        open(library or plugin_library(), "rb") as f,
        mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data,
    ):
        at = 0
        while (found := data.find(b"gpu_device_info {", at)) >= 0:
            start, end = data.rfind(b"\0", 0, found) + 1, data.find(b"\0", found)
            text = data[start:end].decode("utf-8", "replace")
            name = re.search(r'device_description_str: "([^"]*)"', text)
            if name:
                specs[name.group(1)] = text
            at = end
    return specs


def available() -> dict[str, str]:
    """{short name: description} of the targets the installed plugin can compile for."""
    specs = embedded_specs()
    return {name: desc for name, desc in TARGETS.items() if desc in specs}


def resolve(text: str) -> Target:
    """The Target for `--target` text such as `h100:8` (a ConfigError for bad input)."""
    name, count = parse_target(text)
    specs = embedded_specs()
    spec = specs.get(TARGETS[name])
    if spec is None:
        have = [n for n, d in TARGETS.items() if d in specs]
        raise ConfigError(
            f"--target {name}: the installed CUDA plugin has no description of "
            f"{TARGETS[name]!r}; it has {', '.join(have) or 'none'}"
        )
    memory = re.search(r"device_memory_size: (\d+)", spec)
    if memory is None:
        raise ConfigError(
            f"--target {name}: the plugin's description of {TARGETS[name]!r} gives no device_memory_size"
        )
    if count > 8 and count % 8:
        raise ConfigError(
            f"--target {text!r}: above 8, GPUs come in hosts of 8; use a multiple "
            f"of 8 (e.g. {name}:{count + 8 - count % 8})"
        )
    return Target(name, TARGETS[name], count, int(memory.group(1)), spec)


def use_cpu_backend() -> None:
    """Keeps JAX off the CUDA plugin's runtime (no driver here). Call before JAX starts."""
    import jax

    os.environ["JAX_PLATFORMS"] = "cpu"
    if jax.config.jax_platforms != "cpu":
        jax.config.update("jax_platforms", "cpu")


def devices(target: Target) -> list:
    """`target.count` compile-only devices of the target's type (hosts of 8 above 8 devices)."""
    from jax.experimental import topologies

    n = target.count
    shape = f"1x{n // 8}x8" if n > 8 else f"1x1x{n}"  # resolve() keeps n > 8 a multiple of 8
    topology = topologies.get_topology_desc(platform="cuda", target_config=target.spec, topology=shape)
    return list(topology.devices)


def lowering_context(mesh):
    """What tracing for `mesh` needs: for compile-only GPU devices on a CPU-only host, jax's
    cuDNN attention asks the (CPU) default backend for a compute capability; answer with the
    target's own (jaxpar.models.attention.assume_compute_capability). Otherwise nothing."""
    import contextlib

    import jax

    device = mesh.devices.flat[0]
    capability = getattr(device, "compute_capability", None)
    if device.platform not in ("gpu", "cuda") or jax.default_backend() != "cpu" or not capability:
        return contextlib.nullcontext()
    from jaxpar.models.attention import assume_compute_capability

    return assume_compute_capability(capability)
