"""Creating parameters: initial values plus their logical axis names."""

import jax
import jax.numpy as jnp
from flax import nnx

from jaxpar.config import ModelConfig


def param(rngs: nnx.Rngs, shape, names, cfg: ModelConfig, std: float | None = None) -> nnx.Param:
    """A parameter drawn from N(0, std^2) (std defaults to model.init_std), tagged with its
    logical axis names; `jaxpar.sharding` decides where they live (no eager placement here)."""
    std = cfg.init_std if std is None else std
    value = std * jax.random.normal(rngs.params(), shape, jnp.dtype(cfg.param_dtype))
    return nnx.Param(value, out_sharding=names, eager_sharding=False)
