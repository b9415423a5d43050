"""Context parallelism: ring attention over one mesh axis (default ``context``, size c).

Each device keeps its sequence block of Q; the K/V block, with its segment ids and positions,
goes round the ring by ``jax.lax.ppermute`` (i -> i + 1; c - 1 hops of 2 * (seq / c) * kv_heads
* head_dim elements). Partial results merge in float32 by the log-sum-exp rule (Liu et al. 2023,
"Ring Attention with Blockwise Transformers"). The backward (``jax.custom_vjp``) is a second ring,
FlashAttention-2 style (Dao 2023): probabilities are recomputed from the saved log-sum-exp, dQ
stays home, dK/dV accumulators travel with their K/V block and take one more hop to its owner.
Largest score array: [batch, heads, seq / (c * chunks)]^2 -- never seq x seq, never all of K/V.

Layouts: ``zigzag`` cuts the sequence into 2c chunks and gives device i chunks i and 2c - 1 - i
(equal causal work everywhere); ``contiguous`` gives device i chunk i. Positions travel with K so
the causal mask is right in either; a (query chunk, key chunk) pair it hides is skipped (lax.cond).

Sliding window (``window``: a query sees its ``window`` latest positions, itself included): the
pairs outside the window are skipped alike, and so are the hops that bring no visible block.
Which devices' blocks a device needs follows from the layout alone (`needed_shifts`); when that
is not all of them, each needed block comes straight from its owner (one ppermute by its ring
distance, and in the backward one more taking its dK/dV home) instead of going round the ring.
With a window no longer than a chunk, a zigzag ring of c devices needs the blocks of its two
neighbours only: 2 ppermutes forward instead of c - 1.

Mesh: any mesh with an ``axis_name`` axis, passed as ``mesh=`` or, by default, the one set with
``jax.set_mesh``; its other axes may have any names, Explicit or Auto. The shard_map is manual
over ``axis_name``; other Auto axes stay auto (batch over data/fsdp/expert, heads over tensor
keep their sharding, GSPMD propagates it); Explicit axes that shard q's batch or heads become
manual with q's spec, and k, v, segment_ids and the output cotangent are moved to it. Inputs
sharded alike are not gathered (a head_dim split over an Explicit axis is: scores need all of
it). The shard_maps are jitted, so a call outside ``jax.jit`` compiles each ring once.
"""

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

LAYOUT_CHUNKS = {"zigzag": 2, "contiguous": 1}  # sequence chunks per device


# ----------------------------------------------------------------------------- layouts


def _check_layout(seq_len, context, layout):
    if layout not in LAYOUT_CHUNKS:
        raise ValueError(f"layout={layout!r} is unknown; use one of {sorted(LAYOUT_CHUNKS)}")
    pieces = LAYOUT_CHUNKS[layout] * context
    if seq_len % pieces:
        raise ValueError(
            f"seq={seq_len} is not divisible by {pieces} (= {LAYOUT_CHUNKS[layout]} "
            f"x context={context}), as layout={layout!r} needs"
        )


def layout_indices(seq_len: int, context: int, layout: str) -> np.ndarray:
    """Token order of a layout, [seq] int: ``x_in_layout = x[:, layout_indices(...)]``."""
    _check_layout(seq_len, context, layout)
    chunks = np.arange(seq_len).reshape(LAYOUT_CHUNKS[layout] * context, -1)
    if layout == "zigzag":  # device i holds chunks i and 2c - 1 - i
        chunks = chunks[[j for i in range(context) for j in (i, 2 * context - 1 - i)]]
    return chunks.reshape(-1)


def _zigzag(x, context, axis, inverse):
    """Sequence [2, c, n] (halves, chunks, tokens) -> second half reversed, interleaved [c, 2, n].
    Reshapes and a flip, not a gather: XLA partitions it cheaply."""
    x = jnp.moveaxis(x, axis, 0)
    if inverse:
        pairs = x.reshape(context, 2, -1, *x.shape[1:])
        y = jnp.concatenate([pairs[:, 0], jnp.flip(pairs[:, 1], axis=0)])
    else:
        halves = x.reshape(2, context, -1, *x.shape[1:])
        y = jnp.stack([halves[0], jnp.flip(halves[1], axis=0)], axis=1)
    return jnp.moveaxis(y.reshape(x.shape), 0, axis)


def _permute(x, context, layout, axis, inverse):
    axis = axis % x.ndim
    _check_layout(x.shape[axis], context, layout)
    if layout == "contiguous" or context == 1:
        return x
    spec = _explicit_spec(x)
    if spec[axis] is None:
        return _zigzag(x, context, axis, inverse)
    # The sequence is split over Explicit mesh axes: JAX types no reshape or slice of it that
    # moves tokens between devices, so gather it (all-gather), reorder, and split it again.
    mesh = jax.typeof(x).sharding.mesh
    whole = P(*spec[:axis], None, *spec[axis + 1 :])
    y = _zigzag(jax.sharding.reshard(x, NamedSharding(mesh, whole)), context, axis, inverse)
    return jax.sharding.reshard(y, NamedSharding(mesh, P(*spec)))


def permute_to_layout(x, *, context: int, layout: str, axis: int = 1):
    """Reorder the sequence ``axis`` of ``x`` from ordinary order into ``layout`` order.

    Any sharding of ``x`` is kept. On Auto mesh axes GSPMD moves the tokens; when ``axis`` is
    sharded over Explicit axes the sequence is gathered, reordered and split again."""
    return _permute(x, context, layout, axis, inverse=False)


def permute_from_layout(x, *, context: int, layout: str, axis: int = 1):
    """Inverse of :func:`permute_to_layout`: from ``layout`` order back to ordinary order."""
    return _permute(x, context, layout, axis, inverse=True)


# ----------------------------------------------------------------------------- block kernel
# Queries are grouped by their K/V head: q [b, q_len, kv_heads, group, d]; k, v [b, k_len,
# kv_heads, d]; mask [b, q_len, k_len] bool; lse and delta [b, q_len, kv_heads, group] float32.


def ring_mask(q_pos, k_pos, q_seg, k_seg, causal, window=None):
    """Same segment and, if causal, key position not after query position; with `window`, the
    key among the query's `window` latest positions."""
    mask = q_seg[:, :, None] == k_seg[:, None, :]
    if causal:
        mask = mask & (q_pos[:, None] >= k_pos[None, :])
    if window is not None:
        mask = mask & (q_pos[:, None] - k_pos[None, :] < window)
    return mask


def _scores(q, k, mask, scale):
    """Scaled scores [b, kv_heads, group, q_len, k_len] float32, -inf where masked."""
    s = jnp.einsum("bqhgd,bkhd->bhgqk", q, k, preferred_element_type=jnp.float32) * scale
    return jnp.where(mask[:, None, None], s, -jnp.inf)


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
    rows = lambda x: x.transpose(0, 2, 3, 1)[..., None]  # [b, q, h, g] -> [b, h, g, q, 1]
    p = jnp.exp(_scores(q, k, mask, scale) - rows(lse))
    dp = jnp.einsum("bqhgd,bkhd->bhgqk", dout, v, preferred_element_type=jnp.float32)
    ds = p * (dp - rows(delta)) * scale
    dq = jnp.einsum("bhgqk,bkhd->bqhgd", ds, k, preferred_element_type=jnp.float32)
    dk = jnp.einsum("bhgqk,bqhgd->bkhd", ds, q, preferred_element_type=jnp.float32)
    dv = jnp.einsum("bhgqk,bqhgd->bkhd", p, dout, preferred_element_type=jnp.float32)
    return dq, dk, dv


def _merge(out_a, lse_a, out_b, lse_b):
    """Log-sum-exp merge of two partial softmax results over disjoint key sets."""
    lse = jnp.logaddexp(lse_a, lse_b)
    safe = jnp.where(jnp.isfinite(lse), lse, 0.0)
    return out_a * jnp.exp(lse_a - safe)[..., None] + out_b * jnp.exp(lse_b - safe)[..., None], lse


# ----------------------------------------------------------------------------- per-device rings


@dataclasses.dataclass(frozen=True)
class Ring:
    """Static settings of one ring (hashable: a custom_vjp nondiff argument)."""

    mesh: jax.sharding.Mesh
    axis_name: str
    causal: bool
    chunks: int  # sequence chunks per device: 2 for zigzag, 1 for contiguous
    window: int | None = None  # sliding window (causal only); None: the whole sequence
    shifts: tuple | None = None  # ring distances of the blocks needed (`needed_shifts`); None: all

    size = property(lambda self: self.mesh.shape[self.axis_name])

    def pass_on(self, tree):
        """ppermute every array of ``tree`` to the next device of the ring (i -> i + 1)."""
        perm = [(i, (i + 1) % self.size) for i in range(self.size)]
        return jax.tree.map(lambda x: jax.lax.ppermute(x, self.axis_name, perm), tree)

    def split(self, x):
        """Chunks of a local block along its sequence dim (1; 0 for 1-D positions)."""
        return tuple(jnp.split(x, self.chunks, axis=min(1, x.ndim - 1)))

    def run(self, kv, home, travel, accumulate):
        """At steps t = 0 .. c-1: ``home, travel = accumulate(kv, home, travel)`` with ``kv`` the
        (k, v, seg, pos) block of device i - t. ``travel`` moves with ``kv`` and one hop more.
        With `shifts`, only those t, each block fetched from its owner and its ``travel`` sent
        back to it (`run_shifts`)."""
        if self.shifts is not None:
            return self.run_shifts(kv, home, travel, accumulate)

        def step(_, carry):
            kv, home, travel = carry
            home, travel = accumulate(kv, home, travel)
            return self.pass_on(kv), home, self.pass_on(travel)

        kv, home, travel = jax.lax.fori_loop(0, self.size - 1, step, (kv, home, travel))
        home, travel = accumulate(kv, home, travel)
        return home, self.pass_on(travel)

    def shift(self, tree, t):
        """ppermute every array of ``tree`` t places along the ring (i -> i + t)."""
        perm = [(i, (i + t) % self.size) for i in range(self.size)]
        return jax.tree.map(lambda x: jax.lax.ppermute(x, self.axis_name, perm), tree)

    def run_shifts(self, kv, home, travel, accumulate):
        """`run` over the blocks of devices i - t, t in `shifts` only: each fetched with one
        ppermute, its ``travel`` (started at zero) returned with one more and summed at home."""
        home, total = accumulate(kv, home, travel)
        for t in self.shifts:
            if t:
                home, back = accumulate(self.shift(kv, t), home, jax.tree.map(jnp.zeros_like, travel))
                total = jax.tree.map(jnp.add, total, self.shift(back, -t))
        return home, total

    def over_pairs(self, q_pos, k_pos, update, state):
        """``state = update(a, b, state)`` for each query chunk a and key chunk b; a pair the
        causal mask hides entirely (first key after last query), or the window does (last key
        `window` or more before the first query), is skipped by ``lax.cond``."""
        for a, q_at in enumerate(self.split(q_pos)):
            for b, k_at in enumerate(self.split(k_pos)):
                step, visible = functools.partial(update, a, b), jnp.min(k_at) <= jnp.max(q_at)
                if self.window is not None:
                    visible = visible & (jnp.max(k_at) > jnp.min(q_at) - self.window)
                keep = lambda state: state
                state = jax.lax.cond(visible, step, keep, state) if self.causal else step(state)
        return state


@functools.lru_cache(maxsize=64)
def needed_shifts(seq_len: int, context: int, layout: str, window: int) -> tuple[int, ...] | None:
    """The ring distances t (device i needs the block of device i - t) at which some query sees
    some key through a causal `window` in `layout`; None when that is every distance. Each
    device holds whole chunks, runs of consecutive positions: a query chunk [a0, a1] sees a key
    chunk [b0, b1] iff b0 <= a1 (causal) and b1 > a0 - window."""
    chunks = LAYOUT_CHUNKS[layout]
    runs = layout_indices(seq_len, context, layout).reshape(context, chunks, -1)[:, :, [0, -1]]
    needed = set()
    for i in range(context):
        for t in range(context):
            pairs = ((q, k) for q in runs[i] for k in runs[(i - t) % context])
            if any(b0 <= a1 and b1 > a0 - window for (a0, a1), (b0, b1) in pairs):
                needed.add(t)
    return None if len(needed) == context else tuple(sorted(needed))


def _group(x, kv_heads):
    """[b, L, heads, ...] -> [b, L, kv_heads, heads // kv_heads, ...]."""
    return x.reshape(*x.shape[:2], kv_heads, x.shape[2] // kv_heads, *x.shape[3:])


def _add(chunks, index, value):
    return chunks[:index] + (chunks[index] + value,) + chunks[index + 1 :]


def _forward_shard(ring, q, k, v, seg, pos):
    """One device: q [b, L, heads, d]; k, v [b, L, kv_heads, d]; seg [b, L]; pos [L].

    Returns out [b, L, heads, d] (q's dtype) and lse [b, L, heads] (float32).
    Collectives: c - 1 ppermutes of the (k, v, seg, pos) block.
    """
    scale, q_chunks = 1.0 / math.sqrt(q.shape[-1]), ring.split(_group(q, k.shape[2]))
    q_segs, q_pos = ring.split(seg), ring.split(pos)

    def accumulate(kv, acc, travel):
        k_chunks, v_chunks, k_segs, k_pos = map(ring.split, kv)

        def update(a, b, acc):  # acc: (out, lse) so far, per query chunk
            mask = ring_mask(q_pos[a], k_pos[b], q_segs[a], k_segs[b], ring.causal, ring.window)
            block = _block_forward(q_chunks[a], k_chunks[b], v_chunks[b], mask, scale)
            return acc[:a] + (_merge(*acc[a], *block),) + acc[a + 1 :]

        return ring.over_pairs(pos, kv[3], update, acc), travel

    acc = tuple(
        (jnp.zeros_like(x, jnp.float32), jnp.full_like(x[..., 0], -jnp.inf, jnp.float32)) for x in q_chunks
    )
    acc, _ = ring.run((k, v, seg, pos), acc, (), accumulate)
    out, lse = (jnp.concatenate(x, axis=1) for x in zip(*acc))
    return out.reshape(q.shape).astype(q.dtype), lse.reshape(q.shape[:3])


def _backward_shard(ring, q, k, v, seg, pos, out, lse, dout):
    """One device's backward: (dq, dk, dv) like (q, k, v); out, dout like q; lse [b, L, heads].

    Collectives: c - 1 ppermutes of the (k, v, seg, pos) block and c of the float32 (dk, dv)
    accumulators, which travel with their block and end on the device that owns it.
    """
    scale, kv_heads = 1.0 / math.sqrt(q.shape[-1]), k.shape[2]
    delta = jnp.sum(dout.astype(jnp.float32) * out.astype(jnp.float32), axis=-1)
    q_chunks, do_chunks, lse_chunks, delta_chunks = (
        ring.split(_group(x, kv_heads)) for x in (q, dout, lse, delta)
    )
    q_segs, q_pos = ring.split(seg), ring.split(pos)

    def accumulate(kv, dq, dkv):
        k_chunks, v_chunks, k_segs, k_pos = map(ring.split, kv)

        def update(a, b, grads):  # grads: chunks of dq (stays home), dk and dv (travel)
            mask = ring_mask(q_pos[a], k_pos[b], q_segs[a], k_segs[b], ring.causal, ring.window)
            dq_ab, dk_ab, dv_ab = _block_backward(
                q_chunks[a],
                k_chunks[b],
                v_chunks[b],
                mask,
                do_chunks[a],
                lse_chunks[a],
                delta_chunks[a],
                scale,
            )
            dq, dk, dv = grads
            return _add(dq, a, dq_ab), _add(dk, b, dk_ab), _add(dv, b, dv_ab)

        dq, dk, dv = ring.over_pairs(pos, kv[3], update, (dq, *dkv))
        return dq, (dk, dv)

    zeros = lambda x: tuple(jnp.zeros_like(chunk, jnp.float32) for chunk in ring.split(x))
    dq, dkv = ring.run((k, v, seg, pos), zeros(_group(q, kv_heads)), (zeros(k), zeros(v)), accumulate)
    dq, dk, dv = (jnp.concatenate(x, axis=1) for x in (dq, *dkv))
    return dq.reshape(q.shape).astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


# ----------------------------------------------------------------------------- global wiring


def _names(dim):
    """Mesh axis names of one PartitionSpec entry."""
    return () if dim is None else dim if isinstance(dim, tuple) else (dim,)


def _explicit_spec(x):
    """x's own spec, padded to x.ndim (it names explicit mesh axes only; auto axes never)."""
    spec = tuple(jax.typeof(x).sharding.spec)
    return spec + (None,) * (x.ndim - len(spec))


@dataclasses.dataclass(frozen=True)
class _Specs:
    """Per-device layout of every array the rings take: the sequence over the ring axis, batch
    and heads as q's explicit sharding says, head_dim whole (the scores need all of it)."""

    batch: object  # a PartitionSpec entry: q's batch dim
    heads: object  # q's (and k's) heads dim
    axis_name: str

    @property
    def rows(self):
        """[b, seq, heads, d]: q, k, v, out, dout, dq, dk, dv."""
        return P(self.batch, self.axis_name, self.heads, None)

    @property
    def lse(self):
        """[b, seq, heads]."""
        return P(self.batch, self.axis_name, self.heads)

    def segments(self, segment_ids):
        """[b, seq], or [1, seq] broadcast over the batch."""
        return P(self.batch if segment_ids.shape[0] > 1 else None, self.axis_name)


def _reshard(x, spec, mesh):
    """x moved to ``spec`` on the explicit mesh axes (shard_map moves auto axes itself)."""
    explicit = {
        name for name, kind in zip(mesh.axis_names, mesh.axis_types) if kind == jax.sharding.AxisType.Explicit
    }
    spec = P(*(dim if dim and set(_names(dim)) <= explicit else None for dim in spec))
    if P(*_explicit_spec(x)) == spec:
        return x
    return jax.sharding.reshard(x, NamedSharding(mesh, spec))


@functools.lru_cache(maxsize=64)
def _per_device(ring, fn, in_specs, out_specs):
    """``fn(ring, ...)`` as a jitted shard_map, manual over the ring axis and the explicit axes
    named in ``in_specs``; auto axes stay auto. Jitted (and cached) so that a call outside
    ``jax.jit`` compiles the ring once rather than running its body op by op."""
    manual = {name for spec in in_specs for dim in spec for name in _names(dim)}
    return jax.jit(
        jax.shard_map(
            functools.partial(fn, ring),
            mesh=ring.mesh,
            in_specs=in_specs,
            out_specs=out_specs,
            axis_names=manual,
            check_vma=False,
        )
    )


def _sharded(ring, fn, args, in_specs, out_specs):
    """``fn(ring, *args)`` per device. The arguments are first moved to ``in_specs`` on the
    explicit axes: the per-device code needs every array blocked alike (a cotangent, say, may
    arrive laid out unlike its primal)."""
    args = tuple(_reshard(x, spec, ring.mesh) for x, spec in zip(args, in_specs))
    return _per_device(ring, fn, tuple(in_specs), out_specs)(*args)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _ring_attention(ring, specs, q, k, v, segment_ids, positions):
    return _ring_forward(ring, specs, q, k, v, segment_ids, positions)[0]


def _forward_specs(specs, segment_ids):
    """in_specs of (q, k, v, segment_ids, positions)."""
    return (specs.rows, specs.rows, specs.rows, specs.segments(segment_ids), P(specs.axis_name))


def _ring_forward(ring, specs, q, k, v, segment_ids, positions):
    args = (q, k, v, segment_ids, positions)
    out, lse = _sharded(
        ring, _forward_shard, args, _forward_specs(specs, segment_ids), (specs.rows, specs.lse)
    )
    return out, (*args, out, lse)


def _ring_backward(ring, specs, residuals, dout):
    primals = residuals[:3]
    in_specs = (*_forward_specs(specs, residuals[3]), specs.rows, specs.lse, specs.rows)
    grads = _sharded(ring, _backward_shard, (*residuals, dout), in_specs, (specs.rows,) * 3)
    # on explicit axes a cotangent must carry its primal's sharding (e.g. seq not sharded)
    grads = (_reshard(g, _explicit_spec(x), ring.mesh) for g, x in zip(grads, primals))
    return *grads, None, None


_ring_attention.defvjp(_ring_forward, _ring_backward)


def resolve_mesh(mesh):
    """``mesh``, or the mesh of JAX's context (``jax.set_mesh``) when it is None."""
    if mesh is None:
        mesh = jax.sharding.get_abstract_mesh()
        if mesh.empty:
            raise ValueError("ring attention needs a mesh: pass mesh=... or set one with jax.set_mesh(mesh)")
    return mesh


def _context(q, k, mesh, axis_name, layout):
    """Validate the arguments; return the ring size."""
    if axis_name not in mesh.shape:
        raise ValueError(f"axis_name={axis_name!r} is not a mesh axis of {dict(mesh.shape)}")
    _check_layout(q.shape[1], mesh.shape[axis_name], layout)
    if q.shape[2] % k.shape[2]:
        raise ValueError(f"heads={q.shape[2]} is not divisible by kv_heads={k.shape[2]}")
    q_heads, k_heads = (_explicit_spec(x)[2] for x in (q, k))  # explicit axes only
    if q_heads != k_heads:
        raise ValueError(
            f"heads are sharded over {q_heads} but kv_heads over {k_heads}; on "
            "explicit mesh axes shard both alike (or use auto axes)"
        )
    if axis_name in _names(_explicit_spec(q)[0]) + _names(q_heads):
        raise ValueError(f"q's batch or heads are sharded over the ring axis {axis_name!r}")
    return mesh.shape[axis_name]


def ring_attention_permuted(
    q, k, v, *, mesh=None, axis_name="context", causal=True, layout="zigzag", segment_ids=None, window=None
):
    """Ring attention on sequences already in ``layout`` order (see :func:`permute_to_layout`).

    q [batch, seq, heads, head_dim]; k, v [batch, seq, kv_heads, head_dim], kv_heads dividing
    heads (GQA); segment_ids [batch, seq] int or None (a token attends only within its segment).
    Global arrays in layout order; returns [batch, seq, heads, head_dim] in q's dtype, in layout
    order, with the sequence sharded over ``axis_name``. Scale 1/sqrt(head_dim). ``window``
    (causal only): a query sees its ``window`` latest positions; the hops to blocks no query
    sees are left out (`needed_shifts`).
    Collectives: ppermute over ``axis_name`` only (see the module docstring).

    mesh: a ``jax.sharding.Mesh`` or ``AbstractMesh`` with an axis ``axis_name``; None (the
    default): the mesh set with ``jax.set_mesh``, a ValueError when none is set. Other axes
    of any name and number, Explicit or Auto. Batch and heads keep their sharding: on Auto
    axes as GSPMD propagates it; on Explicit axes as q's (k, v and segment_ids are moved to
    q's batch sharding, heads and kv_heads must be sharded alike, a sharded head_dim is
    gathered). On Explicit axes the result's type names the mesh, so JAX wants the mesh set
    (``jax.set_mesh``) around ``jax.grad``/``jax.vjp`` run outside ``jax.jit``, as for any
    explicitly sharded array; without it JAX raises "Length of device assignment 1 is not
    equal to the size of the mesh ... Please enter your `jit` into a mesh context via
    `jax.set_mesh`". Under ``jax.jit`` no mesh context is needed.
    """
    mesh = resolve_mesh(mesh)
    context = _context(q, k, mesh, axis_name, layout)
    if segment_ids is None:  # one segment; [1, seq] broadcasts over the batch
        segment_ids = jnp.zeros((1, q.shape[1]), jnp.int32)
    positions = jnp.asarray(layout_indices(q.shape[1], context, layout), jnp.int32)
    if window is not None and not causal:
        raise ValueError("a sliding window needs causal=True")
    shifts = None if window is None else needed_shifts(q.shape[1], context, layout, window)
    ring = Ring(mesh, axis_name, bool(causal), LAYOUT_CHUNKS[layout], window, shifts)
    q_spec = _explicit_spec(q)
    specs = _Specs(q_spec[0], q_spec[2], axis_name)
    return _ring_attention(ring, specs, q, k, v, segment_ids.astype(jnp.int32), positions)


def ring_attention(
    q, k, v, *, mesh=None, axis_name="context", causal=True, layout="zigzag", segment_ids=None, window=None
):
    """Full softmax attention of q, k, v (and segment_ids), computed as a ring over ``axis_name``.

    Same arguments and result as :func:`ring_attention_permuted`, in ordinary sequence order:
    permutes the inputs into ``layout``, runs the ring, permutes the output back. Equals
    ``jax.nn.dot_product_attention(q, k, v, is_causal=causal)`` (with a segment mask).
    """
    mesh = resolve_mesh(mesh)
    context = _context(q, k, mesh, axis_name, layout)
    to_layout = functools.partial(permute_to_layout, context=context, layout=layout)
    if segment_ids is not None:
        segment_ids = to_layout(segment_ids)
    out = ring_attention_permuted(
        to_layout(q),
        to_layout(k),
        to_layout(v),
        mesh=mesh,
        axis_name=axis_name,
        causal=causal,
        layout=layout,
        segment_ids=segment_ids,
        window=window,
    )
    return permute_from_layout(out, context=context, layout=layout)
