"""Shared pieces of the parity tests: the tiny preset, a trainer on a sub-mesh of the 8 host
devices, batches, and the parity check itself.

A parity test trains one config twice -- on a layout and on one device -- with plain SGD, no
clipping and no warm-up, and compares
- the first step's gradients leaf by leaf (relative error ||got - want|| / ||want|| per leaf):
  a gradient scaled by a constant, or missing a contribution, in any one parameter group shows
  here, where the loss after a clipped Adam step would not;
- the loss of every step: SGD's update is the gradient times the learning rate, so a wrong
  gradient anywhere also moves the later losses.
One compiled step (`Trainer.step_with_grads`) serves both, and the structural checks of the same
layout.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

import jax
import numpy as np

from jaxpar import config as config_lib
from jaxpar.config import MESH_AXES
from jaxpar.train import build_trainer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY_YAML = os.path.join(ROOT, "configs", "tiny.yaml")
STEPS = 3
RTOL = 1e-5  # float32: the layouts only reorder sums
# Plain SGD at a constant rate: the loss moves visibly in STEPS steps, and a gradient error of any
# scale shows in the losses too (Adam's update is nearly scale-free; clipping rescales everything).
SGD = [
    "optimizer.name=sgd",
    "optimizer.clip_norm=0",
    "optimizer.warmup_steps=0",
    "optimizer.lr=1.0",
    "optimizer.min_lr_ratio=1.0",
]


def tiny_config(overrides: list[str] = ()) -> config_lib.Config:
    """configs/tiny.yaml with `overrides` (not validated)."""
    return config_lib.load_config(TINY_YAML, list(overrides))


def trainer_on(overrides: list[str], mesh: dict[str, int]):
    """A Trainer for configs/tiny.yaml + `overrides` on the first prod(mesh) devices, unlisted
    axes of size 1."""
    axes = [f"mesh.{a}={mesh.get(a, 1)}" for a in MESH_AXES]
    cfg = tiny_config(list(overrides) + axes)
    n = int(np.prod(list(mesh.values()) or [1]))
    return build_trainer(cfg, config_lib.validate(cfg, n), devices=jax.devices()[:n])


def parity_trainer(overrides: list[str], mesh: dict[str, int]):
    """`trainer_on` with plain SGD (SGD) whose step also returns the gradients it applied (its
    `step` is `Trainer.step_with_grads`, so that compiling it compiles that one)."""
    trainer = trainer_on(list(overrides) + SGD, mesh)
    return dataclasses.replace(trainer, step=trainer.step_with_grads)


def random_batches(cfg, steps: int = STEPS, seed: int = 0):
    """Random byte tokens, two documents per row (a boundary at a random place, the loss of the
    first document's last token masked). The tokens follow a skewed (Zipf-like) distribution,
    so that a few steps of learning their frequencies visibly lower the loss."""
    rng = np.random.default_rng(seed)
    batch, seq = cfg.train.batch_size, cfg.train.seq_len
    weights = 1.0 / np.arange(1, 258)
    index = np.arange(seq)[None]
    for _ in range(steps):
        tokens = rng.choice(257, size=(batch, seq + 1), p=weights / weights.sum()).astype(np.int32)
        cut = rng.integers(1, seq, batch)[:, None]
        yield {
            "inputs": tokens[:, :-1],
            "targets": tokens[:, 1:],
            "positions": np.where(index < cut, index, index - cut).astype(np.int32),
            "segment_ids": np.where(index < cut, 1, 2).astype(np.int32),
            "loss_mask": np.where(index == cut - 1, 0.0, 1.0).astype(np.float32),
        }


def run_steps(trainer, compiled, batches) -> list[dict[str, float]]:
    """Trains from the initial state through `batches`; every step's metrics as floats."""
    state, history = trainer.init(), []
    for batch in batches:
        state, metrics = compiled(state, trainer.shard_batch(batch))[:2]
        history.append({k: float(v) for k, v in metrics.items()})
    return history


@dataclass
class Run:
    """What a parity test compares: the first step's gradients (numpy, like state["params"])
    and every step's metrics; and the initial state it started from (numpy)."""

    grads: dict
    history: list[dict[str, float]]
    init: dict

    @property
    def losses(self) -> list[float]:
        return [h["loss"] for h in self.history]


def run_parity(trainer, compiled, batches, init=None) -> Run:
    """Trains (a `parity_trainer`'s compiled step) through `batches`, from `init` (a host copy
    of a train state, e.g. another run's `Run.init`, put onto this trainer's shardings) or
    else from the trainer's own born-sharded init."""
    state = trainer.init() if init is None else jax.device_put(init, trainer.state_shardings)
    start = jax.device_get(state) if init is None else init
    history, grads = [], None
    for batch in batches:
        state, metrics, step_grads = compiled(state, trainer.shard_batch(batch))
        if grads is None:
            grads = jax.device_get(step_grads)
        history.append({k: float(v) for k, v in metrics.items()})
    return Run(grads, history, start)


def _leaves(tree) -> dict[str, np.ndarray]:
    flat, _ = jax.tree_util.tree_flatten_with_path(tree)
    return {jax.tree_util.keystr(path, simple=True, separator="."): np.asarray(leaf) for path, leaf in flat}


def relative_errors(got, want) -> dict[str, float]:
    """{leaf path: ||got - want|| / ||want||}; the two trees must have the same leaves and shapes."""
    g, w = _leaves(got), _leaves(want)
    assert g.keys() == w.keys(), f"different leaves: {sorted(g.keys() ^ w.keys())}"
    errors = {}
    for name in w:
        assert g[name].shape == w[name].shape, f"{name}: shape {g[name].shape} != {w[name].shape}"
        a, b = g[name].astype(np.float64), w[name].astype(np.float64)
        errors[name] = float(np.linalg.norm(a - b) / max(np.linalg.norm(b), np.finfo(np.float64).tiny))
    return errors


def assert_nonzero(grads) -> None:
    """Every leaf of `grads` is finite and not all zero (comparing zeros proves nothing)."""
    dead = [name for name, x in _leaves(grads).items() if not np.any(x) or not np.all(np.isfinite(x))]
    assert not dead, f"reference gradients zero or non-finite in: {dead}"


def assert_grads_match(got, want, rtol: float = RTOL) -> None:
    """Per leaf, ||got - want|| / ||want|| <= rtol; the message names every leaf that is off."""
    errors = relative_errors(got, want)
    bad = {name: e for name, e in errors.items() if not e <= rtol}
    assert not bad, (
        f"{len(bad)} of {len(errors)} gradient leaves differ by more than {rtol:g} "
        "(relative): " + ", ".join(f"{n}: {e:.3g}" for n, e in sorted(bad.items()))
    )


def assert_parity(got: Run, want: Run, rtol: float = RTOL) -> None:
    """`got` (a layout) trained exactly like `want` (one device): the reference is a real test
    (non-zero gradients, a loss that falls), the first-step gradients match leaf by leaf, and the
    loss and the gradient norm step by step."""
    assert_nonzero(want.grads)
    assert want.losses[-1] < want.losses[0] - 0.05, f"the reference loss barely moves: {want.losses}"
    assert_grads_match(got.grads, want.grads, rtol)
    for key in ("loss", "grad_norm"):
        np.testing.assert_allclose(
            [h[key] for h in got.history],
            [h[key] for h in want.history],
            rtol=rtol,
            err_msg=f"{key} per step",
        )
