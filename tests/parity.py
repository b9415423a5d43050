"""Shared pieces of the parity tests: a trainer on a sub-mesh of the 8 host devices, synthetic
batches, and the per-step metrics of a few training steps."""

import jax
import numpy as np

from jaxpar import config as config_lib
from jaxpar.config import MESH_AXES
from jaxpar.train import build_trainer

STEPS = 5


def trainer_on(overrides: list[str], mesh: dict[str, int]):
    """A Trainer for `overrides` on the first prod(mesh) devices, unlisted axes of size 1."""
    axes = [f"mesh.{a}={mesh.get(a, 1)}" for a in MESH_AXES]
    cfg = config_lib.load_config(None, list(overrides) + axes)
    n = int(np.prod(list(mesh.values()) or [1]))
    return build_trainer(cfg, config_lib.validate(cfg, n), devices=jax.devices()[:n])


def random_batches(cfg, steps: int = STEPS):
    """Uniform random byte tokens, one document per row."""
    rng = np.random.default_rng(0)
    shape = (cfg.train.batch_size, cfg.train.seq_len)
    for _ in range(steps):
        tokens = rng.integers(0, 257, (shape[0], shape[1] + 1)).astype(np.int32)
        yield {"inputs": tokens[:, :-1], "targets": tokens[:, 1:],
               "positions": np.broadcast_to(np.arange(shape[1], dtype=np.int32), shape).copy(),
               "segment_ids": np.ones(shape, np.int32), "loss_mask": np.ones(shape, np.float32)}


def run_steps(trainer, compiled, batches) -> list[dict[str, float]]:
    """Trains from the initial state through `batches`; every step's metrics as floats."""
    state, history = trainer.init(), []
    for batch in batches:
        state, metrics = compiled(state, trainer.shard_batch(batch))
        history.append({k: float(v) for k, v in metrics.items()})
    return history
