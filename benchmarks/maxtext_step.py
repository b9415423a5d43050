"""MaxText's train step compiled for GPUs that are not here; run by MaxText's own Python.

    MAXTEXT_PYTHON benchmarks/maxtext_step.py SPEC_FILE DEVICES OUT_DIR [key=value ...]

`benchmarks/maxtext_compare.py` runs this in the environment where `maxtext` is installed (it
imports nothing of jaxpar, which is not installed there). SPEC_FILE is the GpuTargetConfigProto
text of the GPU (the CUDA plugin's own description, as `jaxpar.compiled.targets.resolve` finds it),
DEVICES how many of them (one host: at most 8); the key=value settings go to MaxText's
`pyconfig` on top of its packaged `configs/base.yml`.

MaxText's own ahead-of-time path (`train_compile compile_topology=a3`) asks `jax.devices()` for
GPUs; on a machine without one the CUDA plugin's `cuInit` fails and jax falls back to one CPU
device, so what it compiles is a CPU program. Here the devices are compile-only ones from
`jax.experimental.topologies.get_topology_desc(platform="cuda", ...)` instead, and everything
else is MaxText's: `pyconfig`, `train_compile.get_shaped_inputs` (its model, logical-axis rules
and optimizer), its ZeRO-1 shardings, `get_functional_train_with_signature(train.train_step)` and
`train_compile.jit_and_compile`. The config is built while the CPU backend shows as many
(emulated) devices as the target has, so that MaxText's batch and mesh arithmetic see them.

Writes OUT_DIR/hlo.txt (the compiled program) and OUT_DIR/memory.json (XLA's memory analysis)
and prints nothing else of note.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import sys


def _start_cpu_backend(count: int) -> None:
    """Before jax starts: the CPU backend (the CUDA plugin would look for a driver) with `count`
    emulated devices, so that MaxText's config arithmetic (global batch, mesh) sees `count`."""
    os.environ["JAX_PLATFORMS"] = "cpu"
    flags = os.environ.get("XLA_FLAGS", "")
    flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "", flags)
    os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={count}".strip()


def _assume_compute_capability(capability: str):
    """jax's cuDNN attention asks the default backend (here the CPU) for a compute capability
    and refuses the packed (segment ids) form without Hopper; answer for the target instead,
    only while tracing (the same workaround jaxpar's attention module documents)."""
    from jax._src.cudnn import fused_attention_stablehlo as fa

    target = tuple(int(x) for x in capability.split("."))

    @contextlib.contextmanager
    def block():
        saved = fa.check_compute_capability, fa.is_cuda_compute_capability_equal
        fa.check_compute_capability = lambda c: target >= tuple(int(x) for x in c.split("."))
        fa.is_cuda_compute_capability_equal = lambda c: target == tuple(int(x) for x in c.split("."))
        try:
            yield
        finally:
            fa.check_compute_capability, fa.is_cuda_compute_capability_equal = saved

    return block()


def _mesh(config, devices):
    """MaxText's mesh (its `create_device_mesh` and axis names) over the compile-only devices."""
    import jax
    from jax.sharding import AxisType, Mesh
    from maxtext.common.common_types import ShardMode
    from maxtext.utils import maxtext_utils

    jax.config.update("jax_remove_size_one_mesh_axis_from_type", config.remove_size_one_mesh_axis_from_type)
    axis_type = AxisType.Explicit if config.shard_mode == ShardMode.EXPLICIT else AxisType.Auto
    grid = maxtext_utils.create_device_mesh(config, devices)
    return Mesh(grid, config.mesh_axes, axis_types=(axis_type,) * len(config.mesh_axes))


def compile_step(spec: str, settings: list[str], count: int):
    """MaxText's compiled train step for `count` devices described by `spec`."""
    from flax.core.spmd import logical_axis_rules
    from jax.experimental import topologies
    from maxtext.configs import pyconfig
    from maxtext.trainers.pre_train import train, train_compile
    from maxtext.utils import maxtext_utils, sharding

    base = os.path.join(os.path.dirname(pyconfig.__file__), "base.yml")
    config = pyconfig.initialize(["maxtext_step", base, *settings])
    topology = topologies.get_topology_desc(platform="cuda", target_config=spec, topology=f"1x1x{count}")
    devices = list(topology.devices)
    mesh = _mesh(config, devices)
    args, kwargs, state_shardings, _, model = train_compile.get_shaped_inputs(mesh, config)
    params_shardings, state_shardings = sharding.maybe_update_params_sharding_with_opt(
        config, state_shardings
    )
    input_shardings = sharding.build_zero1_input_state_mesh_shardings(
        config, state_shardings, params_shardings
    )
    data_sharding = sharding.get_input_data_sharding(config, mesh)
    func, in_shard, out_shard, static, donate = maxtext_utils.get_functional_train_with_signature(
        train.train_step, data_sharding, input_shardings, model, config, params_shardings
    )
    with _assume_compute_capability(devices[0].compute_capability):
        return train_compile.jit_and_compile(
            func,
            args,
            kwargs,
            mesh,
            in_shard,
            out_shard,
            static,
            donate,
            config,
            logical_axis_rules(config.logical_axis_rules),
        )


def main(argv: list[str]) -> int:
    if len(argv) < 3 or not argv[1].isdigit():
        print("usage:" + __doc__.split("\n\n")[1], file=sys.stderr)
        return 2
    spec_file, count, out_dir, settings = argv[0], int(argv[1]), argv[2], argv[3:]
    with open(spec_file) as f:
        spec = f.read()
    _start_cpu_backend(count)
    compiled = compile_step(spec, settings, count)
    mem = compiled.memory_analysis()
    memory = {
        key: int(getattr(mem, f"{key}_size_in_bytes"))
        for key in ("argument", "output", "alias", "temp", "generated_code")
    }
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "hlo.txt"), "w") as f:
        f.write(compiled.as_text())
    with open(os.path.join(out_dir, "memory.json"), "w") as f:
        json.dump(memory, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
