"""The attention layer and what it is built from, shared by the decoder's blocks
(`jaxpar.models.llama`) and by multi-head latent attention (`jaxpar.models.mla`): RMSNorm, the
rotary embedding (with Llama 3's, linear and YaRN frequency scaling), the generation cache
(`KVCache`) and grouped-query attention (`Attention`), ordinary, packed or as a ring."""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxpar.config import ModelConfig
from jaxpar.models import lora as lora_lib
from jaxpar.models.attention import attend, kernel_for
from jaxpar.models.params import param as _param
from jaxpar.ops.fp8 import einsum as block_einsum
from jaxpar.parallel.ring_attention import ring_attention_permuted
from jaxpar.sharding import constrain, ring_axis, rules_in_force


class RMSNorm(nnx.Module):
    """RMSNorm over the last axis: the residual stream's (`embed`), one head's (`head_dim`,
    model.qk_norm), or another `width` (a latent of `jaxpar.models.mla`, with its own `eps`)."""

    def __init__(
        self, cfg: ModelConfig, axis: str = "embed", width: int | None = None, eps: float | None = None
    ):
        self.eps, self.offset = cfg.norm_eps if eps is None else eps, cfg.norm_offset
        width = width or (cfg.d_model if axis == "embed" else cfg.head_width)
        # model.norm_offset (Gemma): the weight is stored as scale - 1, so it starts at 0.
        scale = (jnp.zeros if self.offset else jnp.ones)((width,), jnp.dtype(cfg.param_dtype))
        self.scale = nnx.Param(scale, out_sharding=(axis,), eager_sharding=False)

    def __call__(self, x):  # [..., width]
        scale = self.scale[...]
        return rms_norm(x, 1.0 + scale.astype(jnp.float32) if self.offset else scale, self.eps)


# The norm and the rotation compute in float32 from model.dtype inputs. Rematerialised, their
# backward recomputes those float32 intermediates from the (model.dtype) input instead of keeping
# them for every layer: the compiled H100 program of configs/gpt2-124m.yaml went from 9.08 to
# 7.77 GiB per device with this (jax 0.12.0.1, 16 document slots).
@functools.partial(jax.checkpoint, static_argnums=(2,))
def rms_norm(x, scale, eps: float):
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (normed * scale.astype(jnp.float32)).astype(x.dtype)


def rope_scaling_of(cfg: ModelConfig) -> tuple | None:
    """model.rope_scaling as `rotary`'s static argument: None, ("linear", factor), the llama3
    parameters ("llama3", factor, low_freq_factor, high_freq_factor, original_max_len), or the
    YaRN ones ("yarn", factor, beta_fast, beta_slow, original_max_len, rotated-part scale)."""
    rs = cfg.rope_scaling
    if rs.type == "none":
        return None
    if rs.type == "linear":
        return ("linear", rs.factor)
    if rs.type == "yarn":
        return ("yarn", rs.factor, rs.beta_fast, rs.beta_slow, rs.original_max_len, yarn_rotated_scale(rs))
    return ("llama3", rs.factor, rs.low_freq_factor, rs.high_freq_factor, rs.original_max_len)


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature for a context `factor` times longer: 0.1 mscale ln(factor) + 1
    (1 when the context did not grow)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def yarn_rotated_scale(rs) -> float:
    """What YaRN multiplies the rotated parts of q and k by (transformers' attention_factor):
    mscale(factor, mscale) / mscale(factor, mscale_all_dim) when the config names both, else
    mscale(factor). DeepSeek-V3 names both, equal: 1."""
    if rs.mscale and rs.mscale_all_dim:
        return yarn_mscale(rs.factor, rs.mscale) / yarn_mscale(rs.factor, rs.mscale_all_dim)
    return yarn_mscale(rs.factor)


def yarn_logit_scale(cfg: ModelConfig) -> float:
    """The extra factor on the attention logits under YaRN with mscale_all_dim (DeepSeek's
    softmax scale): mscale(factor, mscale_all_dim)^2; 1 otherwise."""
    rs = cfg.rope_scaling
    if rs.type != "yarn" or not rs.mscale_all_dim:
        return 1.0
    return yarn_mscale(rs.factor, rs.mscale_all_dim) ** 2


def yarn_inv_freq(width: int, theta: float, scaling: tuple) -> np.ndarray:
    """YaRN's frequencies for heads of `width` (transformers' rope_type "yarn", truncated
    correction range): the i-th is theta^(-2i/width), kept above beta_fast rotations over the
    original context, divided by factor below beta_slow, blended linearly in i between."""
    factor, fast, slow, original = scaling[1:5]

    def dim_of(rotations):  # the dimension that turns `rotations` times over the original context
        return width * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low = max(math.floor(dim_of(fast)), 0)
    high = min(math.ceil(dim_of(slow)), width - 1)
    high = high + 0.001 if high == low else high
    kept = np.clip((np.arange(width // 2, dtype=np.float32) - low) / (high - low), 0, 1)
    kept = 1 - kept  # 1: the frequency as it was; 0: divided by factor
    base = theta ** (np.arange(0, width, 2, dtype=np.float32) / width)
    return (1 / (factor * base)) * (1 - kept) + (1 / base) * kept


@functools.partial(jax.checkpoint, static_argnums=(2, 3))
def rotary(x, positions, theta: float, scaling: tuple | None = None):
    """Rotates pairs (i, i + H/2) of x [batch, seq, heads, H] by angle position * theta^(-2i/H).

    `scaling` (`rope_scaling_of`): Llama 3.1's long-context frequencies, as `transformers`
    computes them (rope_type "llama3"): frequencies whose wavelength exceeds original_max_len /
    low_freq_factor are divided by factor, those with a wavelength under original_max_len /
    high_freq_factor are kept, and the band between blends the two linearly in original_max_len
    / wavelength; ("linear", factor): every frequency divided by factor (position interpolation,
    rope_type "linear"); or YaRN's (`yarn_inv_freq`), the result scaled by its last entry."""
    half = x.shape[-1] // 2
    inv_freq = theta ** (-jnp.arange(half, dtype=jnp.float32) / half)
    rotated_scale = 1.0
    if scaling is not None and scaling[0] == "linear":
        inv_freq = inv_freq / scaling[1]
    elif scaling is not None and scaling[0] == "yarn":
        inv_freq, rotated_scale = jnp.asarray(yarn_inv_freq(x.shape[-1], theta, scaling)), scaling[5]
    elif scaling is not None:
        factor, low, high, original = scaling[1:]
        wavelength = 2 * jnp.pi / inv_freq
        scaled = jnp.where(wavelength > original / low, inv_freq / factor, inv_freq)
        smooth = (original / wavelength - low) / (high - low)
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        between = (wavelength >= original / high) & (wavelength <= original / low)
        inv_freq = jnp.where(between, blended, scaled)
    angles = positions.astype(jnp.float32)[:, :, None, None] * inv_freq  # [batch, seq, 1, H/2]
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    if rotated_scale != 1.0:
        cos, sin = cos * rotated_scale, sin * rotated_scale
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


def attention_kernel(cfg: ModelConfig) -> str:
    """model.attention made concrete (`attention.kernel_for`) for the default device, when the
    model runs outside a trainer (which resolves it from its mesh's devices beforehand)."""
    return kernel_for(cfg, jax.devices()[0])


class KVCache(NamedTuple):
    """Keys and values of the tokens seen so far, for generation (a pytree).

    For the whole model k, v are [layers, batch, max_len, kv_heads, head_dim] (every layer, in
    order: an MoE model's dense prefix, model.moe.first_dense, first); inside one
    attention layer they are that layer's slice [batch, max_len, kv_heads, head_dim]. `length`
    (int32 []) counts the filled slots; slots from `length` on are masked out.
    """

    k: jax.Array
    v: jax.Array
    length: jax.Array

    @classmethod
    def create(cls, cfg: ModelConfig, batch: int, max_len: int) -> KVCache:
        """An empty cache for `batch` sequences of at most `max_len` tokens, in model.dtype. With
        latent attention (model.mla) k holds each token's key/value latent [.., 1, kv_lora_rank]
        and v its one rotated key head [.., 1, qk_rope_dim] (`jaxpar.models.mla`)."""
        a, lead = cfg.mla, (cfg.n_layers, batch, max_len)
        if a.kv_lora_rank:
            k_shape, v_shape = (*lead, 1, a.kv_lora_rank), (*lead, 1, a.qk_rope_dim)
        else:
            k_shape = v_shape = (*lead, cfg.n_kv_heads, cfg.head_width)
        dtype = jnp.dtype(cfg.dtype)
        return cls(jnp.zeros(k_shape, dtype), jnp.zeros(v_shape, dtype), jnp.zeros((), jnp.int32))

    def append(self, k, v) -> KVCache:
        """One layer's cache with k, v [batch, seq, kv_heads, head_dim] written at slots
        [length, length + seq). The caller keeps length + seq <= max_len."""
        at = (0, self.length, 0, 0)
        return KVCache(
            jax.lax.dynamic_update_slice(self.k, k.astype(self.k.dtype), at),
            jax.lax.dynamic_update_slice(self.v, v.astype(self.v.dtype), at),
            self.length + k.shape[1],
        )

    def causal_mask(self, seq: int, window: int | None = None, sliding=None):
        """[1, 1, seq, max_len]: the last `seq` filled slots are the queries; query i (at slot
        length - seq + i) sees slots 0 .. length - seq + i; with `window`, only the `window` latest
        of those, where `sliding` (a traced bool; None: always) holds."""
        query_slot = (self.length - seq + jnp.arange(seq))[:, None]
        slot = jnp.arange(self.k.shape[-3])[None, :]
        mask = slot <= query_slot
        if window is not None:
            near = query_slot - slot < window
            mask = mask & (near if sliding is None else near | ~sliding)
        return mask[None, None]


class Attention(nnx.Module):
    """GQA attention with RoPE. `context_layout` (zigzag | contiguous) makes it ring attention
    over the mesh's `context` axis, on sequences already in that layout; None: ordinary."""

    def __init__(
        self,
        cfg: ModelConfig,
        rngs: nnx.Rngs,
        context_layout: str | None = None,
        grad_dtype: str | None = None,
    ):
        self.cfg = cfg
        self.context_layout = context_layout
        self.grad_dtype = grad_dtype  # the weight gradients' dtype (`jaxpar.ops.fp8.einsum`)
        # cuDNN's packed attention: the document slots per row of batches the host counted
        # (`check_documents`); None: model.max_documents_per_row, overflowing rows made NaN.
        self.document_slots = None
        e, n, k, h = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_width
        self.wq = _param(rngs, (e, n, h), ("embed", "heads", "head_dim"), cfg)
        self.wk = _param(rngs, (e, k, h), ("embed", "kv_heads", "head_dim"), cfg)
        self.wv = _param(rngs, (e, k, h), ("embed", "kv_heads", "head_dim"), cfg)
        # Output projection scaled down with depth (GPT-2), so the residual stream stays O(1).
        out_std = cfg.init_std / (2 * cfg.n_layers) ** 0.5
        self.wo = _param(rngs, (n, h, e), ("heads_in", "head_dim", "embed"), cfg, out_std)
        if cfg.qkv_bias:  # Qwen2: biases on q, k and v (not on the output), zero at init
            zeros = lambda *shape: jnp.zeros(shape, jnp.dtype(cfg.param_dtype))
            self.bq = nnx.Param(zeros(n, h), out_sharding=("heads", "head_dim"), eager_sharding=False)
            self.bk = nnx.Param(zeros(k, h), out_sharding=("kv_heads", "head_dim"), eager_sharding=False)
            self.bv = nnx.Param(zeros(k, h), out_sharding=("kv_heads", "head_dim"), eager_sharding=False)
        if cfg.qk_norm:  # Qwen3, Gemma 3: each head of q and k normalised before the rotation
            self.q_norm = RMSNorm(cfg, "head_dim")
            self.k_norm = RMSNorm(cfg, "head_dim")

    def __call__(self, x, positions, segment_ids, cache: KVCache | None = None, sliding=None, noise=None):
        """x [batch, seq, embed] -> [batch, seq, embed]. With `cache` (this layer's KVCache; a
        single document, segment_ids unused): (out, the cache with these keys/values added).
        `sliding` (a traced bool, with model.sliding_window): this layer attends to the window
        only, with the sliding layers' rotary base. `noise`: the LoRA adapters' dropout
        (`lora.Noise`, training only)."""
        cfg, dtype = self.cfg, jnp.dtype(self.cfg.dtype)
        matmul = functools.partial(block_einsum, fp8=cfg.fp8, dtype=dtype, grad_dtype=self.grad_dtype)
        # + LoRA adapters, if any
        project = functools.partial(lora_lib.project, self, matmul=matmul, noise=noise)
        q = project("wq", spec="bse,enh->bsnh", x=x)
        k = project("wk", spec="bse,ekh->bskh", x=x)
        v = project("wv", spec="bse,ekh->bskh", x=x)
        if cfg.qkv_bias:
            q, k, v = (y + b[...].astype(dtype) for y, b in ((q, self.bq), (k, self.bk), (v, self.bv)))
        if cfg.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = (rotate(cfg, y, positions, sliding) for y in (q, k))
        q = constrain(q, ("batch", "seq", "heads", None))
        k = constrain(k, ("batch", "seq", "kv_heads", None))
        v = constrain(v, ("batch", "seq", "kv_heads", None))
        scale = None if cfg.attn_scale_dim is None else cfg.attn_scale_dim**-0.5
        window = cfg.sliding_window
        if cache is not None:  # generation: attend to the cached tokens and these
            cache = cache.append(k, v)
            # "auto" rather than model.attention: cuDNN may not take this mask, XLA always does.
            mask = cache.causal_mask(q.shape[1], window, sliding)
            out = jax.nn.dot_product_attention(q, cache.k, cache.v, mask=mask, scale=scale)
        else:
            out = self._attend(q, k, v, segment_ids, scale, window, sliding)
        out = constrain(out, ("batch", "seq", "heads", None))
        out = project("wo", spec="bsnh,nhe->bse", x=out)
        return out if cache is None else (out, cache)

    def _attend(self, q, k, v, segment_ids, scale, window=None, sliding=None):
        """Attention of a training pass ([batch, seq, heads, head_dim]): the ring over `seq`'s
        axis under context parallelism, else the model's kernel (cuDNN's takes documents as
        offsets, not a mask). `scale` None: 1/sqrt(head width). `LatentAttention` shares it."""
        if self.context_layout is not None:
            if scale is not None:  # the ring scales by 1/sqrt(head width): fold the rest into q
                q = q * jnp.asarray(scale * q.shape[-1] ** 0.5, q.dtype)
            return self._ring(q, k, v, segment_ids, window, sliding)
        slots = self.document_slots
        return attend(
            q,
            k,
            v,
            segment_ids,
            implementation=attention_kernel(self.cfg),
            max_segments=slots or self.cfg.max_documents_per_row,
            checked=slots is not None,
            scale=scale,
            window=window,
            sliding=sliding if window is not None else None,
        )

    def _ring(self, q, k, v, segment_ids, window, sliding):
        """Ring attention over the `seq` rule's axis; a sliding layer's ring has the window and
        leaves out the hops it does not need (`lax.cond` on the traced `sliding`)."""
        ring = functools.partial(
            ring_attention_permuted,
            axis_name=ring_axis(rules_in_force()),
            layout=self.context_layout,
            segment_ids=segment_ids,
        )
        if window is None:
            return ring(q, k, v)
        if sliding is None:
            return ring(q, k, v, window=window)
        windowed = functools.partial(ring, window=window)
        return jax.lax.cond(sliding, windowed, ring, q, k, v)


def rotate(cfg: ModelConfig, x, positions, sliding=None):
    """The rotary embedding of q or k: model.rope_theta and its scaling; in a sliding layer
    (`sliding` true, a traced bool) with model.rope_local_theta set, that base without scaling."""
    theta, scaling = cfg.rope_theta, rope_scaling_of(cfg)
    rotated = rotary(x, positions, theta, scaling)
    local = cfg.rope_local_theta
    if sliding is None or cfg.sliding_window is None or local is None:
        return rotated
    return jnp.where(sliding, rotary(x, positions, local, None), rotated)
