"""Context parallelism: ring attention over one mesh axis (default ``context``).

Q, K and V are split along the sequence over the ``c`` devices of the axis. Each device keeps its
Q block; K/V blocks, with their segment ids and token positions, travel round the ring with
``jax.lax.ppermute`` (``c - 1`` steps, device ``i`` sends to ``i + 1``; per step
``2 * (seq / c) * kv_heads * head_dim`` elements of K and V). Partial results are merged in float32
by the log-sum-exp rule (online softmax; Liu et al. 2023, "Ring Attention with Blockwise
Transformers"). The backward pass is a second ring (``jax.custom_vjp``): dK/dV accumulators travel
with their K/V blocks and reach home after one extra hop; dQ stays put. The block kernel recomputes
probabilities from the saved log-sum-exp, as in FlashAttention-2 (Dao 2023). No device holds the
whole K/V or a ``seq x seq`` score matrix: the largest score tile is
``[batch, heads, seq / (c * chunks), seq / (c * chunks)]`` float32.

Layouts. ``zigzag`` cuts the sequence into ``2c`` chunks and gives device ``i`` chunks ``i`` and
``2c - 1 - i``, so every device does the same causal work; ``contiguous`` gives device ``i``
chunk ``i``. Token positions travel with K, so the causal mask is right in either layout, and a
(query chunk, key chunk) pair that the causal mask hides entirely is skipped with ``lax.cond``.

Sharding. The ``shard_map`` is manual over ``axis_name``. Other *auto* mesh axes stay auto (XLA
keeps batch over data/fsdp/expert and heads over tensor as they come); other *explicit* axes that
shard an argument are made manual with that argument's own spec. Either way nothing is gathered.
"""

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

LAYOUT_CHUNKS = {"zigzag": 2, "contiguous": 1}  # sequence chunks per device


# ----------------------------------------------------------------------------- layouts


def _check_layout(seq_len, context, layout):
    if layout not in LAYOUT_CHUNKS:
        raise ValueError(f"layout={layout!r} is unknown; use one of {sorted(LAYOUT_CHUNKS)}")
    pieces = LAYOUT_CHUNKS[layout] * context
    if seq_len % pieces:
        raise ValueError(f"seq={seq_len} is not divisible by {pieces} (= {LAYOUT_CHUNKS[layout]} "
                         f"x context={context}), as layout={layout!r} needs")


def _chunk_order(context, layout):
    """Which chunk of the ordinary sequence fills each chunk slot of the layout."""
    if layout == "zigzag":  # device i holds chunks i and 2c - 1 - i
        return [j for i in range(context) for j in (i, 2 * context - 1 - i)]
    return list(range(context))


def layout_indices(seq_len: int, context: int, layout: str) -> np.ndarray:
    """Token order of a layout, [seq] int: ``x_in_layout = x[:, layout_indices(...)]``."""
    _check_layout(seq_len, context, layout)
    order = _chunk_order(context, layout)
    return np.arange(seq_len).reshape(len(order), -1)[order].reshape(-1)


def permute_to_layout(x, *, context: int, layout: str, axis: int = 1):
    """Reorder the sequence ``axis`` of ``x`` from ordinary order into ``layout`` order.

    Zigzag: view the sequence as [2, c, n] (halves, chunks, tokens), reverse the chunks of the
    second half and interleave: [c, 2, n]. Reshapes and a flip, no gather, so XLA partitions it
    cheaply on sharded arrays.
    """
    _check_layout(x.shape[axis], context, layout)
    if layout == "contiguous" or context == 1:  # the identity order
        return x
    x = jnp.moveaxis(x, axis, 0)
    halves = x.reshape(2, context, -1, *x.shape[1:])
    x = jnp.stack([halves[0], jnp.flip(halves[1], axis=0)], axis=1).reshape(x.shape)
    return jnp.moveaxis(x, 0, axis)


def permute_from_layout(x, *, context: int, layout: str, axis: int = 1):
    """Inverse of :func:`permute_to_layout`: from ``layout`` order back to ordinary order."""
    _check_layout(x.shape[axis], context, layout)
    if layout == "contiguous" or context == 1:  # the identity order
        return x
    x = jnp.moveaxis(x, axis, 0)
    pairs = x.reshape(context, 2, -1, *x.shape[1:])
    x = jnp.concatenate([pairs[:, 0], jnp.flip(pairs[:, 1], axis=0)], axis=0).reshape(x.shape)
    return jnp.moveaxis(x, 0, axis)


# ----------------------------------------------------------------------------- block kernel
# Queries are grouped by their K/V head: q [b, q_len, kv_heads, group, d]; k, v [b, k_len,
# kv_heads, d]; mask [b, q_len, k_len] bool; lse and delta [b, q_len, kv_heads, group] float32.


def _mask(q_pos, k_pos, q_seg, k_seg, causal):
    """Same segment and, if causal, key position not after query position."""
    mask = q_seg[:, :, None] == k_seg[:, None, :]
    return mask & (q_pos[:, None] >= k_pos[None, :]) if causal else mask


def _scores(q, k, mask, scale):
    """Scaled scores [b, kv_heads, group, q_len, k_len] float32, -inf where masked."""
    s = jnp.einsum("bqhgd,bkhd->bhgqk", q, k, preferred_element_type=jnp.float32) * scale
    return jnp.where(mask[:, None, None], s, -jnp.inf)


def _rows(x):
    """[b, q_len, h, g] -> [b, h, g, q_len, 1], to broadcast against scores."""
    return x.transpose(0, 2, 3, 1)[..., None]


def _block_forward(q, k, v, mask, scale):
    """Softmax attention of one block: out [b, q_len, h, g, d] and lse, both float32."""
    s = _scores(q, k, mask, scale)
    m = jnp.max(s, axis=-1)
    m = jnp.where(jnp.isfinite(m), m, 0.0)  # a row with no visible key: p = 0, lse = -inf
    p = jnp.exp(s - m[..., None])
    total = jnp.sum(p, axis=-1)
    out = jnp.einsum("bhgqk,bkhd->bqhgd", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    out = out / jnp.where(total > 0, total, 1.0).transpose(0, 3, 1, 2)[..., None]
    return out, (jnp.log(total) + m).transpose(0, 3, 1, 2)


def _block_backward(q, k, v, mask, dout, lse, delta, scale):
    """(dq, dk, dv) of one block, float32, from the final lse and delta = rowsum(dout * out)."""
    p = jnp.exp(_scores(q, k, mask, scale) - _rows(lse))
    ds = p * (jnp.einsum("bqhgd,bkhd->bhgqk", dout, v, preferred_element_type=jnp.float32)
              - _rows(delta)) * scale
    dq = jnp.einsum("bhgqk,bkhd->bqhgd", ds, k, preferred_element_type=jnp.float32)
    dk = jnp.einsum("bhgqk,bqhgd->bkhd", ds, q, preferred_element_type=jnp.float32)
    dv = jnp.einsum("bhgqk,bqhgd->bkhd", p, dout, preferred_element_type=jnp.float32)
    return dq, dk, dv


def _merge(out_a, lse_a, out_b, lse_b):
    """Log-sum-exp merge of two partial softmax results over disjoint key sets."""
    lse = jnp.logaddexp(lse_a, lse_b)
    safe = jnp.where(jnp.isfinite(lse), lse, 0.0)
    weight_a, weight_b = jnp.exp(lse_a - safe)[..., None], jnp.exp(lse_b - safe)[..., None]
    return out_a * weight_a + out_b * weight_b, lse


# ----------------------------------------------------------------------------- per-device rings


@dataclasses.dataclass(frozen=True)
class _Ring:
    """Static settings of one ring (hashable: a custom_vjp nondiff argument)."""

    mesh: jax.sharding.Mesh
    axis_name: str
    causal: bool
    chunks: int  # sequence chunks per device: 2 for zigzag, 1 for contiguous

    @property
    def size(self):
        return self.mesh.shape[self.axis_name]

    def pass_on(self, *blocks):
        """ppermute each block to the next device of the ring (i -> i + 1)."""
        perm = [(i, (i + 1) % self.size) for i in range(self.size)]
        return tuple(jax.lax.ppermute(x, self.axis_name, perm) for x in blocks)

    def split(self, x):
        """Chunks of a local block along its sequence dim (1; 0 for 1-D positions)."""
        return jnp.split(x, self.chunks, axis=min(1, x.ndim - 1))

    def pairs(self, q_pos, k_pos, compute, skip):
        """{(a, b): compute(a, b)} over query chunks a and key chunks b.

        A pair the causal mask hides entirely (first key after last query) runs ``skip``.
        """
        results = {}
        for (a, q_at), (b, k_at) in ((qa, kb) for qa in enumerate(self.split(q_pos))
                                     for kb in enumerate(self.split(k_pos))):
            run, hidden = functools.partial(compute, a, b), functools.partial(skip, a, b)
            visible = jnp.min(k_at) <= jnp.max(q_at)
            results[a, b] = jax.lax.cond(visible, run, hidden) if self.causal else run()
        return results


def _group(x, kv_heads):
    """[b, L, heads, ...] -> [b, L, kv_heads, heads // kv_heads, ...]."""
    return x.reshape(*x.shape[:2], kv_heads, x.shape[2] // kv_heads, *x.shape[3:])


def _forward_shard(ring, q, k, v, seg, pos):
    """One device: q [b, L, heads, d]; k, v [b, L, kv_heads, d]; seg [b, L]; pos [L].

    Returns out [b, L, heads, d] (q's dtype) and lse [b, L, heads] (float32).
    Collectives: ``c - 1`` ppermutes of the (k, v, seg, pos) block.
    """
    scale, q_chunks = 1.0 / math.sqrt(q.shape[-1]), ring.split(_group(q, k.shape[2]))
    q_segs, q_pos = ring.split(seg), ring.split(pos)

    def accumulate(kv, acc):
        k_chunks, v_chunks, k_segs, k_pos = map(ring.split, kv)

        def compute(a, b):
            mask = _mask(q_pos[a], k_pos[b], q_segs[a], k_segs[b], ring.causal)
            return _block_forward(q_chunks[a], k_chunks[b], v_chunks[b], mask, scale)

        def skip(a, b):
            return jnp.zeros_like(acc[a][0]), jnp.full_like(acc[a][1], -jnp.inf)

        merged = list(acc)
        for (a, _), (out, lse) in ring.pairs(pos, kv[3], compute, skip).items():
            merged[a] = _merge(*merged[a], out, lse)
        return tuple(merged)

    def step(_, carry):
        kv, acc = carry
        return ring.pass_on(*kv), accumulate(kv, acc)

    acc = tuple((jnp.zeros_like(x, jnp.float32), jnp.full_like(x[..., 0], -jnp.inf, jnp.float32))
                for x in q_chunks)
    kv, acc = jax.lax.fori_loop(0, ring.size - 1, step, ((k, v, seg, pos), acc))
    out, lse = (jnp.concatenate(x, axis=1) for x in zip(*accumulate(kv, acc)))
    return out.reshape(q.shape).astype(q.dtype), lse.reshape(q.shape[:3])


def _backward_shard(ring, q, k, v, seg, pos, out, lse, dout):
    """One device's backward: (dq, dk, dv) like (q, k, v); out, dout like q; lse [b, L, heads].

    Collectives: ``c - 1`` ppermutes of the (k, v, seg, pos) block and ``c`` of the float32
    (dk, dv) accumulators, which travel with their block and land on the device that owns it.
    """
    scale, kv_heads = 1.0 / math.sqrt(q.shape[-1]), k.shape[2]
    delta = jnp.sum(dout.astype(jnp.float32) * out.astype(jnp.float32), axis=-1)
    q_chunks, do_chunks, lse_chunks, delta_chunks = (
        ring.split(_group(x, kv_heads)) for x in (q, dout, lse, delta))
    q_segs, q_pos = ring.split(seg), ring.split(pos)

    def accumulate(kv, grads):
        k_chunks, v_chunks, k_segs, k_pos = map(ring.split, kv)

        def compute(a, b):
            mask = _mask(q_pos[a], k_pos[b], q_segs[a], k_segs[b], ring.causal)
            return _block_backward(q_chunks[a], k_chunks[b], v_chunks[b], mask,
                                   do_chunks[a], lse_chunks[a], delta_chunks[a], scale)

        def skip(a, b):
            return tuple(jnp.zeros_like(x, jnp.float32)
                         for x in (q_chunks[a], k_chunks[b], v_chunks[b]))

        dq, dk, dv = (list(ring.split(x)) for x in grads)
        for (a, b), (dq_ab, dk_ab, dv_ab) in ring.pairs(pos, kv[3], compute, skip).items():
            dq[a], dk[b], dv[b] = dq[a] + dq_ab, dk[b] + dk_ab, dv[b] + dv_ab
        return tuple(jnp.concatenate(x, axis=1) for x in (dq, dk, dv))

    def step(_, carry):
        kv, grads = carry
        dq, dk, dv = accumulate(kv, grads)
        return ring.pass_on(*kv), (dq, *ring.pass_on(dk, dv))

    grads = tuple(jnp.zeros_like(x, jnp.float32) for x in (_group(q, kv_heads), k, v))
    kv, grads = jax.lax.fori_loop(0, ring.size - 1, step, ((k, v, seg, pos), grads))
    dq, dk, dv = accumulate(kv, grads)
    dk, dv = ring.pass_on(dk, dv)  # the last hop home
    return dq.reshape(q.shape).astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


# ----------------------------------------------------------------------------- global wiring


def _seq_spec(x, axis_name):
    """x's own spec (it names explicit mesh axes only) with its sequence dim over ``axis_name``."""
    spec = list(jax.typeof(x).sharding.spec) + [None] * x.ndim
    spec[min(1, x.ndim - 1)] = axis_name
    return P(*spec[:x.ndim])


def _sharded(ring, fn, args, out_specs):
    """Run ``fn(ring, *args)`` per device: shard_map manual over the ring axis and the explicit
    axes named in the arguments' specs; auto axes stay auto."""
    in_specs = tuple(_seq_spec(x, ring.axis_name) for x in args)
    args = tuple(_reshard(x, spec, ring.mesh) for x, spec in zip(args, in_specs))
    manual = {name for spec in in_specs for dim in spec if dim is not None
              for name in (dim if isinstance(dim, tuple) else (dim,))}
    return jax.shard_map(functools.partial(fn, ring), mesh=ring.mesh, in_specs=in_specs,
                         out_specs=out_specs, axis_names=manual, check_vma=False)(*args)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _ring_attention(ring, q, k, v, segment_ids, positions):
    return _ring_forward(ring, q, k, v, segment_ids, positions)[0]


def _ring_forward(ring, q, k, v, segment_ids, positions):
    args = (q, k, v, segment_ids, positions)
    out_spec = _seq_spec(q, ring.axis_name)  # lse [b, seq, heads] shares its first three dims
    out, lse = _sharded(ring, _forward_shard, args, (out_spec, P(*out_spec[:3])))
    return out, (*args, out, lse)


def _ring_backward(ring, residuals, dout):
    primals = residuals[:3]
    out_specs = tuple(_seq_spec(x, ring.axis_name) for x in primals)
    grads = _sharded(ring, _backward_shard, (*residuals, dout), out_specs)
    # on explicit axes a cotangent must carry its primal's sharding (e.g. seq not sharded)
    grads = (_reshard(grad, jax.typeof(x).sharding.spec, ring.mesh) for grad, x in zip(grads, primals))
    return *grads, None, None


def _reshard(x, spec, mesh):
    """x moved to ``spec`` if its type (which names explicit axes only) says otherwise."""
    explicit = {name for name, kind in zip(mesh.axis_names, mesh.axis_types)
                if kind == jax.sharding.AxisType.Explicit}
    spec = P(*(dim if set(dim if isinstance(dim, tuple) else (dim,)) <= explicit else None
               for dim in spec))
    if jax.typeof(x).sharding.spec == spec:
        return x
    return jax.sharding.reshard(x, jax.sharding.NamedSharding(mesh, spec))


_ring_attention.defvjp(_ring_forward, _ring_backward)


def _context(q, k, mesh, axis_name, layout):
    """Validate the arguments; return the ring size."""
    if axis_name not in mesh.shape:
        raise ValueError(f"axis_name={axis_name!r} is not a mesh axis; the mesh has "
                         f"{dict(mesh.shape)}")
    context = mesh.shape[axis_name]
    _check_layout(q.shape[1], context, layout)
    if q.shape[2] % k.shape[2]:
        raise ValueError(f"heads={q.shape[2]} is not divisible by kv_heads={k.shape[2]}")
    return context


def ring_attention_permuted(q, k, v, *, mesh, axis_name="context", causal=True, layout="zigzag",
                            segment_ids=None):
    """Ring attention on sequences already in ``layout`` order (see :func:`permute_to_layout`).

    q [batch, seq, heads, head_dim]; k, v [batch, seq, kv_heads, head_dim], kv_heads dividing
    heads (GQA); segment_ids [batch, seq] int or None (a token attends only within its segment).
    Global arrays in layout order; returns [batch, seq, heads, head_dim] in q's dtype, in layout
    order, with the sequence sharded over ``axis_name``. Scale 1/sqrt(head_dim).
    Collectives: ppermute over ``axis_name`` only (see the module docstring).
    """
    context = _context(q, k, mesh, axis_name, layout)
    if segment_ids is None:
        segment_ids = jnp.zeros(q.shape[:2], jnp.int32)
    positions = jnp.asarray(layout_indices(q.shape[1], context, layout), jnp.int32)
    ring = _Ring(mesh, axis_name, bool(causal), LAYOUT_CHUNKS[layout])
    return _ring_attention(ring, q, k, v, segment_ids.astype(jnp.int32), positions)


def ring_attention(q, k, v, *, mesh, axis_name="context", causal=True, layout="zigzag",
                   segment_ids=None):
    """Full softmax attention of q, k, v (and segment_ids), computed as a ring over ``axis_name``.

    Same arguments and result as :func:`ring_attention_permuted`, in ordinary sequence order:
    permutes the inputs into ``layout``, runs the ring, permutes the output back.
    """
    context = _context(q, k, mesh, axis_name, layout)
    to_layout = functools.partial(permute_to_layout, context=context, layout=layout)
    if segment_ids is not None:
        segment_ids = to_layout(segment_ids)
    out = ring_attention_permuted(to_layout(q), to_layout(k), to_layout(v), mesh=mesh,
                                  axis_name=axis_name, causal=causal, layout=layout,
                                  segment_ids=segment_ids)
    return permute_from_layout(out, context=context, layout=layout)
