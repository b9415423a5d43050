"""Multi-head latent attention (MLA, DeepSeek-V2/V3), in place of grouped-query attention when
model.mla.kv_lora_rank > 0.

Per token, keys and values come from one shared latent: `wkv_a` projects the residual stream to
kv_lora_rank + qk_rope_dim values; the first kv_lora_rank are normalised (`kv_norm`) and
expanded by `wkv_b` into every head's un-rotated key part (qk_nope_dim) and value (v_head_dim);
the last qk_rope_dim are one rotated key head shared by all heads. Queries are `wq` [E, N,
qk_nope_dim + qk_rope_dim], or with model.mla.q_lora_rank a latent of their own (`wq_a` ->
`q_norm` -> `wq_b`); their last qk_rope_dim values per head are rotated. Query/key heads are
qk_nope_dim + qk_rope_dim wide, values v_head_dim: the attention kernels (XLA's, cuDNN's, the
ring) take one head width, so the values are padded with zeros to the query/key width and the
padding cut from the output, which changes no number. The logits are scaled by
1/sqrt(qk_nope_dim + qk_rope_dim), times YaRN's mscale^2 (`layers.yarn_logit_scale`).

Tensor parallelism: the down-projections (`wq_a`, `wkv_a`) and the latents are whole on every
device of the `tensor` axis, the up-projections (`wq_b`, `wkv_b`) and `wo` split by heads; under
ZeRO-3 the latent axis of the up-projections is split over fsdp (the `latent` rule).

Generation (`KVCache`, one layer's slice): the cache keeps what MLA is for, each token's latent
(normalised, kv_lora_rank) and its rotated key head (qk_rope_dim), not the expanded keys and
values (N x (qk_nope_dim + qk_rope_dim + v_head_dim)); a decoding step expands the cached
latents with `wkv_b`.

Parameters (E = d_model, N = n_heads, R = kv_lora_rank, Q = q_lora_rank, C = qk_nope_dim,
P = qk_rope_dim, D = v_head_dim), stacked over layers like every block weight:

| jaxpar              | shape          | when            |
| ------------------- | -------------- | --------------- |
| attn.wq             | [E, N, C + P]  | no q_lora_rank  |
| attn.wq_a           | [E, Q]         | q_lora_rank     |
| attn.q_norm.scale   | [Q]            | q_lora_rank     |
| attn.wq_b           | [Q, N, C + P]  | q_lora_rank     |
| attn.wkv_a          | [E, R + P]     |                 |
| attn.kv_norm.scale  | [R]            |                 |
| attn.wkv_b          | [R, N, C + D]  |                 |
| attn.wo             | [N, D, E]      |                 |

The rotary pairing is jaxpar's (i with i + P/2); DeepSeek's checkpoints pair neighbours
(rope_interleave), which the family file maps by permuting the rotated weight columns.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx

from jaxpar.config import ModelConfig
from jaxpar.models.layers import Attention, KVCache, RMSNorm, rotate, yarn_logit_scale
from jaxpar.models.params import param as _param
from jaxpar.ops.fp8 import einsum as block_einsum
from jaxpar.parallel.latent_ring import latent_ring_attention as latent_ring
from jaxpar.sharding import constrain, ring_axis, rules_in_force

# transformers builds the two latent norms with RMSNorm's default epsilon, not config.rms_norm_eps.
LATENT_NORM_EPS = 1e-6


def weights(cfg: ModelConfig) -> list[tuple[str, tuple[int, ...], tuple[str, ...]]]:
    """(name, shape, logical names) of one layer's MLA weights, the table above: what
    `LatentAttention` makes, the FLOPs count (`matmul_params`) and the planner's table read."""
    a, e, n, qk = cfg.mla, cfg.d_model, cfg.n_heads, cfg.head_width
    if a.q_lora_rank:
        q = [
            ("wq_a", (e, a.q_lora_rank), ("embed", "latent")),
            ("q_norm", (a.q_lora_rank,), ("latent",)),
            ("wq_b", (a.q_lora_rank, n, qk), ("latent", "heads", "head_dim")),
        ]
    else:
        q = [("wq", (e, n, qk), ("embed", "heads", "head_dim"))]
    return q + [
        ("wkv_a", (e, a.kv_lora_rank + a.qk_rope_dim), ("embed", "latent")),
        ("kv_norm", (a.kv_lora_rank,), ("latent",)),
        ("wkv_b", (a.kv_lora_rank, n, a.qk_nope_dim + a.v_head_dim), ("latent", "heads", "head_dim")),
        ("wo", (n, a.v_head_dim, e), ("heads_in", "head_dim", "embed")),
    ]


def matmul_params(cfg: ModelConfig) -> int:
    """One layer's MLA weights that take part in a matmul (all but the two latent norms)."""
    return sum(math.prod(shape) for name, shape, _ in weights(cfg) if not name.endswith("norm"))


def logit_scale(cfg: ModelConfig) -> float:
    """The attention logits' scale: 1/sqrt(query/key head width), times YaRN's mscale^2."""
    return cfg.head_width**-0.5 * yarn_logit_scale(cfg)


class LatentAttention(Attention):
    """MLA (module docstring). Shares `Attention`'s ring and its document slots; its own weights."""

    def __init__(
        self,
        cfg: ModelConfig,
        rngs: nnx.Rngs,
        context_layout: str | None = None,
        grad_dtype: str | None = None,
    ):
        self.cfg, self.context_layout, self.grad_dtype = cfg, context_layout, grad_dtype
        self.document_slots = None  # as `Attention`'s (cuDNN's packed attention)
        for name, shape, names in weights(cfg):
            if name.endswith("norm"):
                setattr(self, name, RMSNorm(cfg, "latent", shape[0], LATENT_NORM_EPS))
            else:  # the output projection scaled down with depth, as `Attention`'s
                std = cfg.init_std / (2 * cfg.n_layers) ** 0.5 if name == "wo" else None
                setattr(self, name, _param(rngs, shape, names, cfg, std))

    def _latent_ring(self, segment_ids, scale):
        """Settings of `jaxpar.parallel.latent_ring` (model.mla.ring_latent) for this layer."""
        axis, layout, matmul = ring_axis(rules_in_force()), self.context_layout, self._matmul()
        return dict(scale=scale, segment_ids=segment_ids, axis_name=axis, layout=layout, matmul=matmul)

    def _matmul(self):
        dtype = jnp.dtype(self.cfg.dtype)
        return functools.partial(block_einsum, fp8=self.cfg.fp8, dtype=dtype, grad_dtype=self.grad_dtype)

    def queries(self, x, positions):
        """[batch, seq, N, C + P]: the un-rotated part, then the rotated."""
        matmul, a = self._matmul(), self.cfg.mla
        if a.q_lora_rank:
            latent = matmul("bse,eq->bsq", x, self.wq_a[...])
            q = matmul("bsq,qnh->bsnh", self.q_norm(latent), self.wq_b[...])
        else:
            q = matmul("bse,enh->bsnh", x, self.wq[...])
        nope, rope = jnp.split(q, [a.qk_nope_dim], axis=-1)
        return jnp.concatenate([nope, rotate(self.cfg, rope, positions)], axis=-1)

    def latents(self, x, positions):
        """(the normalised key/value latent [batch, seq, 1, R], the rotated key head [batch,
        seq, 1, P]): what the cache keeps per token."""
        a = self.cfg.mla
        both = self._matmul()("bse,er->bsr", x, self.wkv_a[...])
        latent, rope = jnp.split(both[:, :, None], [a.kv_lora_rank], axis=-1)
        return self.kv_norm(latent), rotate(self.cfg, rope, positions)

    def expand(self, latent, k_rope):
        """Latents [batch, T, 1, R] and rotated key heads [batch, T, 1, P] -> keys [batch, T, N,
        C + P] and values padded to that width [batch, T, N, C + P] (the module docstring)."""
        a = self.cfg.mla
        kv = self._matmul()("bsr,rnh->bsnh", latent[:, :, 0], self.wkv_b[...])
        k_nope, v = jnp.split(kv, [a.qk_nope_dim], axis=-1)
        k_rope = jnp.broadcast_to(k_rope, (*k_nope.shape[:3], a.qk_rope_dim)).astype(k_nope.dtype)
        k = jnp.concatenate([k_nope, k_rope], axis=-1)
        v = jnp.pad(v, ((0, 0), (0, 0), (0, 0), (0, self.cfg.head_width - a.v_head_dim)))
        return k, v

    def __call__(self, x, positions, segment_ids, cache: KVCache | None = None, sliding=None, noise=None):
        """As `Attention.__call__` (no sliding window, no LoRA adapters: config refuses both)."""
        cfg = self.cfg
        q = constrain(self.queries(x, positions), ("batch", "seq", "heads", None))
        latent, k_rope = self.latents(x, positions)
        scale = logit_scale(cfg)
        if cache is not None:  # generation: the cache holds latents; expand all filled slots
            cache = cache.append(latent, k_rope)
            k, v = self.expand(cache.k, cache.v)
            mask = cache.causal_mask(q.shape[1])
            out = jax.nn.dot_product_attention(q, k, v.astype(q.dtype), mask=mask, scale=scale)
        elif cfg.mla.ring_latent and self.context_layout is not None:  # the ring passes latents
            out = latent_ring(q, latent, k_rope, self.wkv_b[...], **self._latent_ring(segment_ids, scale))
        else:
            k, v = self.expand(latent, k_rope)
            k = constrain(k, ("batch", "seq", "heads", None))
            v = constrain(v, ("batch", "seq", "heads", None))
            out = self._attend(q, k, v, segment_ids, scale)
        out = constrain(out[..., : cfg.mla.v_head_dim], ("batch", "seq", "heads", None))
        out = self._matmul()("bsnh,nhe->bse", out, self.wo[...])
        return out if cache is None else (out, cache)
