"""A command's start: its command line made into a validated config on started devices. What
the training command (jaxpar.train), the compile-only report (jaxpar.inspect) and the benchmark
(benchmarks/bench.py) share before they build a trainer, so that each reads its settings as
`python -m jaxpar.train` does."""

from __future__ import annotations

import dataclasses

import jax

from jaxpar import checks as checks_lib
from jaxpar import config as config_lib
from jaxpar.config import Config
from jaxpar.hf import convert as convert_lib
from jaxpar.mesh import emulate_cpu_devices, start_distributed, use_compile_cache
from jaxpar.run import autolayout


def load_and_validate(argv: list[str], num_devices: int | None = None) -> tuple[Config, dict[str, int]]:
    """Parses the command line, sets the compilation cache (`jaxpar.mesh.use_compile_cache`),
    starts the backend with the emulated devices, validates.

    `num_devices` validates for that many devices instead of the ones present (compiling for
    GPUs that are not here: `python -m jaxpar.inspect --target h100:8`)."""
    path, overrides = config_lib.parse_cli(argv)
    settings = config_lib.user_settings(path, overrides)
    cfg = config_lib.build_config(settings)
    auto = config_lib.auto_axes(settings)[1]
    if auto and num_devices is not None:
        raise config_lib.ConfigError(
            "mesh: auto plans for the devices here; for GPUs that are not here, "
            "python -m jaxpar.plan CONFIG --gpus NxTYPE --explain prints the layout it would choose"
        )
    checks_lib.validate_runtime(cfg)  # before the backend starts with those devices
    use_compile_cache(cfg.runtime, devices_here=num_devices is None)  # before anything compiles
    if num_devices is None:
        emulate_cpu_devices(cfg.runtime)
        start_distributed(cfg.distributed)
        num_devices = jax.device_count()
    if "mesh" not in settings:  # no layout asked for: the default one, or DP over what exists
        cfg = dataclasses.replace(cfg, mesh=config_lib.fit_default_mesh(num_devices))
    cfg = convert_lib.apply_init_from(cfg, settings)  # train.init_from: its shape and tokenizer
    if auto:  # the planner's layout, compiled here first (jaxpar.planning.auto)
        cfg = autolayout.choose(cfg, settings, auto, num_devices)
    return cfg, checks_lib.validate(cfg, num_devices)
