"""Context parallelism for multi-head latent attention: a ring that passes the latent.

`ring_attention` sends each device's expanded keys and values round the ring: 2 x heads x
(qk_nope_dim + qk_rope_dim) values a token (40,960 in DeepSeek-V3). Latent attention computes
them from far less, the normalised latent (kv_lora_rank) and one rotated key head shared by all
heads (qk_rope_dim): 576 values a token in DeepSeek-V3. Here the block that travels is that
(latent, rotated key, segment ids, positions), and each device expands a visiting block with
its own heads' slice of `wkv_b` (the heads stay split over tensor as the rules give; the latent
is whole on every tensor device, so the expansion needs no collective) before attending its
queries to it. Model setting: model.mla.ring_latent (jaxpar/models/mla.py).

One shard_map, manual over the ring axis only (the other axes stay auto: batch and heads keep
their sharding, GSPMD propagates it), whose body is a `lax.scan` over the c - 1 hops: expand
the visiting block, attend every query chunk to every key chunk it can see (the causal and
document mask of `ring_attention`; a pair the causal mask hides wholly is skipped by
`lax.cond`), merge into the running (out, log-sum-exp), ppermute the block on; then the last
block, which goes nowhere. No custom_vjp: each visit is wrapped in `jax.checkpoint`, so the
backward keeps per hop the visiting block and the running (out, lse), and recomputes the
expansion and the scores. JAX's transpose of the ppermute is the backward ring (the latent's
cotangent goes the other way round, c - 1 hops) and the `wkv_b` gradient is summed over the
hops and, shard_map's transpose of a replicated input, over the ring.

The scores are q_nope . k_nope + q_rope . k_rope with the one rotated key head broadcast by the
einsum, not copied per head, and the values keep their own width (v_head_dim, no padding).
Masked scores are a large finite negative, not -inf, so that a row with no visible key in a
block (another document) has a finite log-sum-exp and a finite gradient through plain autodiff.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxpar.parallel.ring_attention import LAYOUT_CHUNKS, Ring, layout_indices, resolve_mesh, ring_mask

NEG = -1e30  # a masked score: exp(NEG - m) is 0 and every sum of it stays finite


def expand(latent, k_rope, wkv_b, nope_dim, matmul):
    """One block's keys and values: latent [b, L, R] and wkv_b [R, heads, C + D] -> k_nope [b, L,
    heads, C], v [b, L, heads, D]; k_rope [b, L, P] stays one head."""
    kv = matmul("bsr,rnh->bsnh", latent, wkv_b)
    return kv[..., :nope_dim], kv[..., nope_dim:], k_rope


def _block(q, keys, mask, scale):
    """Softmax attention of q [b, Lq, n, C + P] to one key chunk: (out [b, Lq, n, D], lse [b, Lq,
    n]), float32; a row with no visible key gives out 0 and lse about NEG."""
    k_nope, v, k_rope = keys
    nope = k_nope.shape[-1]
    f32 = jnp.float32
    s = jnp.einsum("bqnc,bknc->bnqk", q[..., :nope], k_nope, preferred_element_type=f32)
    s = s + jnp.einsum("bqnp,bkp->bnqk", q[..., nope:], k_rope.astype(q.dtype), preferred_element_type=f32)
    s = jnp.where(mask[:, None], s * scale, NEG)
    m = jax.lax.stop_gradient(jnp.max(s, axis=-1))  # the result does not depend on m
    p = jnp.where(mask[:, None], jnp.exp(s - m[..., None]), 0.0)
    total = jnp.sum(p, axis=-1)
    some = total > 0
    out = jnp.einsum("bnqk,bknd->bqnd", p.astype(v.dtype), v, preferred_element_type=f32)
    out = out / jnp.where(some, total, 1.0).transpose(0, 2, 1)[..., None]
    return out, (m + jnp.log(jnp.where(some, total, 1.0))).transpose(0, 2, 1)


def _merge(a, b):
    """Log-sum-exp merge of two partial results (out, lse) over disjoint key sets; finite lse."""
    lse = jnp.logaddexp(a[1], b[1])
    weight = lambda x: jnp.exp(x - lse)[..., None]
    return a[0] * weight(a[1]) + b[0] * weight(b[1]), lse


def _visit(ring, scale, nope_dim, matmul, q, seg, pos, acc, block, wkv_b):
    """Merge into ``acc`` (per query chunk) the attention of the local queries to one visiting
    block (latent, k_rope, seg, pos), expanded here with the local heads of ``wkv_b``."""
    latent, k_rope, k_seg, k_pos = block
    keys = expand(latent, k_rope, wkv_b, nope_dim, matmul)
    key_chunks = [ring.split(x) for x in keys]
    q_chunks, q_segs, q_pos, k_segs, k_at = map(ring.split, (q, seg, pos, k_seg, k_pos))

    def update(a, b, acc):
        mask = ring_mask(q_pos[a], k_at[b], q_segs[a], k_segs[b], ring.causal)
        part = _block(q_chunks[a], tuple(x[b] for x in key_chunks), mask, scale)
        return acc[:a] + (_merge(acc[a], part),) + acc[a + 1 :]

    return ring.over_pairs(pos, k_pos, update, acc)


def _shard(ring, scale, nope_dim, matmul, dtype, q, latent, k_rope, seg, pos, wkv_b):
    """One device: its queries [b, L, n, C + P] against every device's block, the blocks going
    round the ring (c - 1 ppermutes of (latent, k_rope, seg, pos)). Out [b, L, n, D], q's dtype."""
    wkv_b = wkv_b.astype(dtype)  # back to the caller's dtype (see `latent_ring_attention`)
    visit = jax.checkpoint(functools.partial(_visit, ring, scale, nope_dim, matmul, q, seg, pos))
    width = wkv_b.shape[-1] - nope_dim
    acc = tuple(
        (jnp.zeros((*x.shape[:3], width), jnp.float32), jnp.full(x.shape[:3], NEG, jnp.float32))
        for x in ring.split(q)
    )

    def hop(carry, _):
        acc, block = carry
        return (visit(acc, block, wkv_b), ring.pass_on(block)), None

    block = (latent, k_rope, seg, pos)
    (acc, block), _ = jax.lax.scan(hop, (acc, block), length=ring.size - 1)
    acc = visit(acc, block, wkv_b)
    return jnp.concatenate([out for out, _ in acc], axis=1).astype(q.dtype)


def latent_ring_attention(
    q,
    latent,
    k_rope,
    wkv_b,
    *,
    scale,
    segment_ids=None,
    mesh=None,
    axis_name="context",
    causal=True,
    layout="zigzag",
    matmul=None,
):
    """Latent attention of q to the keys and values ``wkv_b`` expands from ``latent``, as a ring
    over ``axis_name`` that passes the latent (module docstring).

    q [batch, seq, heads, C + P] (C = qk_nope_dim, P = qk_rope_dim, rotated part last); latent
    [batch, seq, R] or [batch, seq, 1, R]; k_rope [batch, seq, P] or [batch, seq, 1, P]; wkv_b
    [R, heads, C + D]; segment_ids [batch, seq] or None. Sequences in ``layout`` order (see
    `permute_to_layout`), as `ring_attention_permuted` takes them. ``scale`` multiplies the
    logits (no 1/sqrt(width) of its own). ``matmul(spec, x, w)``: the expansion's einsum
    (default ``jnp.einsum``; the model passes its fp8-aware one). Returns [batch, seq, heads, D]
    in q's dtype, in layout order. Collectives: c - 1 ppermutes of the latent block forward,
    c - 1 of its cotangent backward, none for the expansion.
    """
    mesh = resolve_mesh(mesh)
    context = mesh.shape[axis_name]
    latent, k_rope = (x.reshape(*x.shape[:2], x.shape[-1]) for x in (latent, k_rope))
    if segment_ids is None:
        segment_ids = jnp.zeros((1, q.shape[1]), jnp.int32)
    positions = jnp.asarray(layout_indices(q.shape[1], context, layout), jnp.int32)
    ring = Ring(mesh, axis_name, bool(causal), LAYOUT_CHUNKS[layout])
    nope_dim = q.shape[-1] - k_rope.shape[-1]
    body = functools.partial(_shard, ring, scale, nope_dim, matmul or jnp.einsum, wkv_b.dtype)
    # wkv_b enters at float32 at least (exact): its gradient is summed over the ring there. XLA:CPU
    # (jax 0.12) fails to compile that sum in bfloat16 ("Invalid binary instruction opcode copy").
    wkv_b = wkv_b.astype(jnp.promote_types(wkv_b.dtype, jnp.float32))
    rows = P(None, axis_name)
    sharded = jax.shard_map(
        body,
        mesh=mesh,
        in_specs=(rows, rows, rows, rows, P(axis_name), P()),
        out_specs=rows,
        axis_names={axis_name},
        check_vma=False,
    )
    return sharded(q, latent, k_rope, segment_ids.astype(jnp.int32), positions, wkv_b)
