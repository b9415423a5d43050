"""The mixture-of-experts MLP: parameters and logical names here, the routing and the expert
all-to-all in `jaxpar.parallel.experts` (one shard_map over the mesh)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxpar.config import ModelConfig
from jaxpar.models.params import param
from jaxpar.ops.swiglu import block_swiglu
from jaxpar.parallel.experts import moe_mlp
from jaxpar.parallel.routing import RouterSpec

BIAS = "router_bias"  # the MoE MLP's attribute (and params key) holding the correction bias


class RouterBias(nnx.Variable):
    """The router's per-expert correction bias (model.moe.score=sigmoid): not an `nnx.Param`,
    and the model reads it through `stop_gradient`, so it gets no gradient; the optimizer masks
    it (`jaxpar.training.optim`), and the train step moves it (`update_router_bias`)."""


def router_spec(cfg: ModelConfig) -> RouterSpec:
    m = cfg.moe
    return RouterSpec(
        m.norm_topk, m.score, m.groups, m.topk_groups, m.routed_scale, m.seq_aux_loss_weight > 0
    )


def update_router_bias(params: dict, expert_load, rate: float) -> dict:
    """Loss-free balancing (DeepSeek-V3, Wang et al. 2024): every correction bias leaf
    [MoE layers, E] moved by rate * sign(mean load - load), `expert_load` [MoE layers, E] the
    step's (token, choice) pairs per expert, summed over all devices and microsteps: an
    underloaded expert's bias rises, an overloaded one's falls."""
    load = expert_load.astype(jnp.float32)
    step = rate * jnp.sign(jnp.mean(load, axis=-1, keepdims=True) - load)

    def update(path, leaf):
        return leaf + step.astype(leaf.dtype) if getattr(path[-1], "key", None) == BIAS else leaf

    return jax.tree_util.tree_map_with_path(update, params)


def expert_d_ff(cfg: ModelConfig) -> int:
    return cfg.moe.d_ff or cfg.d_ff


def dense_prefix(cfg: ModelConfig) -> int:
    """The length of the model's `dense_blocks` stack: the leading dense blocks before the MoE
    pattern starts (model.moe.first_dense), or in an irregular model (model.moe.dense_layers,
    `ModelConfig.irregular_moe`) every dense block; none in a dense model."""
    if cfg.moe.num_experts and cfg.irregular_moe():
        return cfg.n_layers - moe_layers(cfg)
    return cfg.moe.first_dense if cfg.moe.num_experts else 0


def moe_layers(cfg: ModelConfig) -> int:
    """How many blocks have an MoE MLP (`ModelConfig.moe_kinds`: after the dense prefix, every
    `model.moe.every`-th one, the last of each group the layer scan repeats, but for
    model.moe.dense_layers); none in a dense model."""
    if cfg.moe.num_experts and not cfg.moe.dense_layers:  # the pattern's count, without a walk
        return max(cfg.n_layers - cfg.moe.first_dense, 0) // max(cfg.moe.every, 1)
    return sum(cfg.moe_kinds())


def segments(cfg: ModelConfig) -> list[tuple[bool, int, int]]:
    """An irregular model's layers (`ModelConfig.irregular_moe`) as runs of consecutive layers
    of one kind, in layer order: (MoE or not, start, stop), the run's slice of its kind's stack
    (`blocks` holds the MoE blocks, `dense_blocks` the dense ones, each in layer order)."""
    out, count = [], {True: 0, False: 0}
    for kind in cfg.moe_kinds():
        if out and out[-1][0] == kind:
            out[-1] = (kind, out[-1][1], out[-1][2] + 1)
        else:
            out.append((kind, count[kind], count[kind] + 1))
        count[kind] += 1
    return out


def moe_matmul_params(cfg: ModelConfig) -> int:
    """Matmul weights of one MoE MLP: router, every routed expert, the shared experts."""
    e, f, m = cfg.d_model, expert_d_ff(cfg), cfg.moe
    return e * m.num_experts + (m.num_experts + m.shared_experts) * 3 * e * f


class MoEMLP(nnx.Module):
    """Top-k routed SwiGLU experts (+ optional always-on shared experts, DeepSeek-MoE style).

    Weights: router [embed, experts] (stored like any `embed` weight, sharded over fsdp under
    ZeRO-3, and handed whole to every device inside the all-to-all: each routes its own tokens), experts
    gate/up [experts, embed, mlp] and down [experts, mlp, embed], split over `expert` along the
    experts dim (and over `tensor` / `fsdp` like a dense MLP)."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, grad_dtype: str | None = None):
        self.cfg = cfg
        self.grad_dtype = grad_dtype  # the shared experts' weight gradients (`jaxpar.ops.fp8.einsum`)
        e, f, n = cfg.d_model, expert_d_ff(cfg), cfg.moe.num_experts
        out_std = cfg.init_std / (2 * cfg.n_layers) ** 0.5
        self.router = param(rngs, (e, n), ("embed", None), cfg)
        self.gate = param(rngs, (n, e, f), ("experts", "embed", "mlp"), cfg)
        self.up = param(rngs, (n, e, f), ("experts", "embed", "mlp"), cfg)
        self.down = param(rngs, (n, f, e), ("experts", "mlp", "embed"), cfg, out_std)
        shared = cfg.moe.shared_experts * f
        if shared:
            self.shared_gate = param(rngs, (e, shared), ("embed", "mlp"), cfg)
            self.shared_up = param(rngs, (e, shared), ("embed", "mlp"), cfg)
            self.shared_down = param(rngs, (shared, e), ("mlp", "embed"), cfg, out_std)
        if cfg.moe.score == "sigmoid":  # float32 whatever param_dtype: its steps are ~1e-3
            self.router_bias = RouterBias(
                jnp.zeros((n,), jnp.float32), out_sharding=(None,), eager_sharding=False
            )

    def __call__(self, x):
        """x [batch, seq, embed] -> (y [batch, seq, embed], router statistics)."""
        dtype = jnp.dtype(self.cfg.dtype)
        weights = {
            "router": self.router[...],
            "gate": self.gate[...],
            "up": self.up[...],
            "down": self.down[...],
        }
        if self.cfg.moe.score == "sigmoid":
            weights["bias"] = jax.lax.stop_gradient(self.router_bias[...])
        # The mesh is the one the step runs under (`Layout.scope`); none: one device.
        y, stats = moe_mlp(
            x,
            weights,
            top_k=self.cfg.moe.top_k,
            capacity_factor=self.cfg.moe.capacity_factor,
            compute_dtype=dtype,
            fp8=self.cfg.fp8,
            dispatch=self.cfg.moe.dispatch,
            buffer_factor=self.cfg.moe.ragged_buffer_factor,
            normalize=self.cfg.moe.norm_topk,
            router=router_spec(self.cfg),
        )
        if self.cfg.moe.shared_experts:
            y = y + block_swiglu(
                x,
                self.shared_gate[...],
                self.shared_up[...],
                self.shared_down[...],
                fp8=self.cfg.fp8,
                dtype=dtype,
                grad_dtype=self.grad_dtype,
            )
        return y, stats
