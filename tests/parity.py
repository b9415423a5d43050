"""Shared pieces of the parity tests: the tiny preset, a trainer on a sub-mesh of the 8 host
devices, batches, and the parity check itself.

A parity test trains one config twice -- on a layout and on one device -- with plain SGD, no
clipping and no warm-up. The layout's run follows the reference's trajectory: every step after
the first starts from the reference's state before that step (`run_parity(along=...)`), so that
every comparison is of one step from the same inputs, where the layouts differ only in the order
of float32 sums. (Carried on from its own state, the layout's run would compare rounding noise
amplified by every step: at SGD's rate 1 the reference's gradient norm grows 0.63 -> 1.56 -> 16.4
in three steps, and one CPU's order of summation put step 3's norm 1.25e-5 away from another's.)
At every step it compares
- the gradients leaf by leaf (relative error ||got - want|| / ||want|| per leaf): a gradient
  scaled by a constant, or missing a contribution, in any one parameter group shows here, where
  the loss after a clipped Adam step would not;
- the loss and the gradient norm;
- the state after the update, leaf by leaf: a wrong update (a shard applied to the wrong rows,
  an optimizer state not carried) shows here;
and that the state the layout's step returns is laid out as its input, so that a run could carry
it on. One compiled step (`Trainer.step_with_grads`) serves both, and the structural checks of
the same layout.

RTOL, the tolerance: one step from the same state, on a tiny float32 model at SGD's rate 0.3
(where the reference's gradient norm stays near 1 over the three steps: 0.63, 0.94, 1.26 for
configs/tiny.yaml, so no step is ill-conditioned). The layouts reorder sums of a few hundred to a
few thousand float32 terms (a reduction over 8 devices, chunks of the loss, ring-attention
blocks); float32's unit roundoff is 6e-8, and a reordered sum of n terms moves by about
sqrt(n) * 6e-8 of its size, a few 1e-7. Measured over every parity test of the suite (jax
0.12.0.1, x86-64): gradients and losses within 4e-7 to 6e-7 per leaf at every step, at most
1.2e-6 (Gemma-style sliding layers on a ring), the updated state within 1.4e-7 (1.0e-6 there).
1e-5 is 8x above the worst of these, and below a real bug's size: a gradient off by a factor
1 + 1e-4 fails (tests/test_loss.py checks that on a layout's run).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

import jax
import numpy as np

from jaxpar import checks as checks_lib
from jaxpar import config as config_lib
from jaxpar.config import MESH_AXES
from jaxpar.run.train import build_trainer

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
    "optimizer.lr=0.3",
    "optimizer.min_lr_ratio=1.0",
]

# The two forms of the layer loop (model.scan_layers), each checked against the one reference, the
# single device's scanned run. Every layout's parity test runs scanned. The unrolled form
# (jaxpar.models.llama.unrolled: one lax.split of each stacked weight, the layer written out once
# per slice, the stacked gradient one concatenate) is one function whatever the layout: test_model
# checks on one device that it trains exactly as the scan, and each parity file runs it on the
# layouts that take it down a path of its own (each file's UNROLLED says which, and why), not on
# every layout (that doubled the parity files' compiles).
LAYER_FORMS = {"scanned": [], "unrolled": ["model.scan_layers=false"]}
# What an unrolled parity run catches, and was shown to catch by planting each bug (monkeypatching
# llama.unrolled in the test process) and seeing the run fail: "reversed", the split's slices taken
# in the wrong order (layer i run with layer L-1-i's weights); "twice", one layer's slice used for
# two layers (the last never); "sliding", the per-layer sliding-window flags taken in the wrong
# order while the weights are right. A chunk of one layer (or one MoE group) hides the first two:
# every UNROLLED layout runs chunks of at least two.


def tiny_config(overrides: list[str] = ()) -> config_lib.Config:
    """configs/tiny.yaml with `overrides` (not validated)."""
    return config_lib.load_config(TINY_YAML, list(overrides))


def trainer_on(overrides: list[str], mesh: dict[str, int]):
    """A Trainer for configs/tiny.yaml + `overrides` on the first prod(mesh) devices, unlisted
    axes of size 1."""
    axes = [f"mesh.{a}={mesh.get(a, 1)}" for a in MESH_AXES]
    cfg = tiny_config(list(overrides) + axes)
    n = int(np.prod(list(mesh.values()) or [1]))
    return build_trainer(cfg, checks_lib.validate(cfg, n), devices=jax.devices()[:n])


def parity_trainer(overrides: list[str], mesh: dict[str, int]):
    """`trainer_on` with plain SGD (SGD) whose step also returns the gradients it applied (its
    `step` is `Trainer.step_with_grads`, so that compiling it compiles that one)."""
    trainer = trainer_on(SGD + list(overrides), mesh)
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
    """What a parity test compares: every step's gradients (numpy, like state["params"]) and
    metrics, and the states the steps started from and ended in (numpy): `starts[k]` before step
    k, `ends[k]` after it. A run of its own carries each end on as the next start; a run `along`
    another starts each step after the first from the other's end."""

    step_grads: list[dict]
    history: list[dict[str, float]]
    starts: list[dict]
    ends: list[dict]

    @property
    def grads(self) -> dict:
        """The first step's gradients."""
        return self.step_grads[0]

    @property
    def init(self) -> dict:
        """The state the run started from."""
        return self.starts[0]

    @property
    def losses(self) -> list[float]:
        return [h["loss"] for h in self.history]


def _assert_laid_out_as(state, shardings) -> None:
    """The state a step returned is laid out as the step's input (so that a run could carry it on
    into the next step): the same sharding for every leaf."""
    flat = jax.tree_util.tree_flatten_with_path(state)[0]
    wanted = jax.tree.leaves(shardings)
    assert len(flat) == len(wanted)
    for (path, leaf), sharding in zip(flat, wanted, strict=True):
        assert leaf.sharding.is_equivalent_to(sharding, leaf.ndim), (
            f"{jax.tree_util.keystr(path)}: the step returned {leaf.sharding}, its input is {sharding}"
        )


def run_parity(trainer, compiled, batches, init=None, along: Run | None = None) -> Run:
    """Trains (a `parity_trainer`'s compiled step) through `batches`. The first step starts from
    `init` (a host copy of a train state, e.g. another run's `Run.init`, put onto this trainer's
    shardings), or else from the trainer's own born-sharded init; with `along` (the reference
    `Run` of the same batches) every later step starts from `along`'s state before it, else from
    this run's own state."""
    state = trainer.init() if init is None else jax.device_put(init, trainer.state_shardings)
    run = Run([], [], [], [])
    for k, batch in enumerate(batches):
        if k and along is not None:
            state = jax.device_put(along.ends[k - 1], trainer.state_shardings)
        run.starts.append(jax.device_get(state))
        state, metrics, step_grads = compiled(state, trainer.shard_batch(batch))
        _assert_laid_out_as(state, trainer.state_shardings)
        run.step_grads.append(jax.device_get(step_grads))
        run.ends.append(jax.device_get(state))
        run.history.append({k: float(v) for k, v in metrics.items()})
    return run


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


def assert_grads_match(got, want, rtol: float = RTOL, what: str = "gradient leaves") -> None:
    """Per leaf, ||got - want|| / ||want|| <= rtol; the message names every leaf that is off."""
    errors = relative_errors(got, want)
    bad = {name: e for name, e in errors.items() if not e <= rtol}
    assert not bad, (
        f"{len(bad)} of {len(errors)} {what} differ by more than {rtol:g} "
        "(relative): " + ", ".join(f"{n}: {e:.3g}" for n, e in sorted(bad.items()))
    )


def assert_parity(got: Run, want: Run, rtol: float = RTOL) -> None:
    """`got` (a layout, run `along` `want`) trained exactly like `want` (one device): the
    reference is a real test (non-zero gradients, a loss that falls), and `assert_same_steps`."""
    assert_nonzero(want.grads)
    assert want.losses[-1] < want.losses[0] - 0.05, f"the reference loss barely moves: {want.losses}"
    assert_same_steps(got, want, rtol)


def assert_same_steps(got: Run, want: Run, rtol: float = RTOL) -> None:
    """At every step, from the same state (`got` ran `along` `want`), the gradients match leaf
    by leaf, so do the loss and the gradient norm, and the state after the update leaf by leaf
    (module docstring)."""
    assert len(got.history) == len(want.history) > 1
    for k in range(len(want.history)):
        if k:  # (the first step's start: the layout's own init, or the reference's put onto it)
            errors = relative_errors(got.starts[k], want.starts[k])
            assert max(errors.values()) == 0.0, f"step {k + 1} did not start from the reference's state"
        try:
            assert_grads_match(got.step_grads[k], want.step_grads[k], rtol)
            assert_grads_match(got.ends[k], want.ends[k], rtol, what="state leaves after the update")
        except AssertionError as e:
            raise AssertionError(f"step {k + 1}: {e}") from None
    for key in ("loss", "grad_norm"):
        np.testing.assert_allclose(
            [h[key] for h in got.history],
            [h[key] for h in want.history],
            rtol=rtol,
            err_msg=f"{key} per step",
        )
