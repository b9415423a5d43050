"""The optimizer and its learning-rate schedule, from the config: what a run applies to its
gradients (jaxpar.train) and what a run started from other weights begins with
(jaxpar.convert)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from jaxpar.config import Config
from jaxpar.models.moe import BIAS


def lr_schedule(cfg: Config) -> optax.Schedule:
    """The learning rate of each update, from optax's count of updates already applied (0 for
    the first): update n = count + 1 warms up linearly to optimizer.lr at n = warmup_steps (the
    first update already moves, at lr / warmup_steps), then decays along a cosine to
    lr * min_lr_ratio at n = train.steps. With warmup_steps >= train.steps the run ends inside
    the warm-up."""
    o = cfg.optimizer
    warmup = max(o.warmup_steps, 0)
    decay = max(cfg.train.steps - warmup, 1)
    end = o.lr * o.min_lr_ratio

    def schedule(count):
        n = jnp.asarray(count, jnp.float32) + 1.0
        rising = o.lr * n / max(warmup, 1)
        progress = jnp.clip((n - warmup) / decay, 0.0, 1.0)
        falling = end + (o.lr - end) * 0.5 * (1.0 + jnp.cos(jnp.pi * progress))
        return jnp.where(n <= warmup, rising, falling)

    return schedule


def make_optimizer(cfg: Config) -> optax.GradientTransformation:
    """optimizer.name: AdamW (no weight decay on norm scales nor on the MoE router's correction
    bias, which has no gradient either and moves only by `moe.update_router_bias`), or plain SGD
    (what parity tests use: its update is the gradient times the learning rate, so a wrong
    gradient scale shows in the loss); either after global-norm clipping when clip_norm > 0."""
    o = cfg.optimizer

    def decay_mask(params):
        return jax.tree_util.tree_map_with_path(
            lambda path, _: not any("norm" in str(k) or BIAS in str(k) for k in path), params
        )

    if o.name == "sgd":
        update = optax.sgd(lr_schedule(cfg))
    else:
        update = optax.adamw(
            lr_schedule(cfg), b1=o.b1, b2=o.b2, eps=o.eps, weight_decay=o.weight_decay, mask=decay_mask
        )
    return optax.chain(optax.clip_by_global_norm(o.clip_norm), update) if o.clip_norm > 0 else update
