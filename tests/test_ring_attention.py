"""Ring attention (context parallelism) equals plain softmax attention, forward and gradient.

Shapes are tiny so the file compiles quickly on a 2-core CI machine: batch 2, seq 32, heads 4,
head_dim 8. Each case compiles one jitted function returning the output and dq, dk, dv.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpar.compiled import hlo
from jaxpar.config import MESH_AXES
from jaxpar.parallel.ring_attention import (
    layout_indices,
    needed_shifts,
    permute_from_layout,
    permute_to_layout,
    ring_attention,
    ring_attention_permuted,
)
from jaxpar.sharding import BASE_RULES

BATCH, SEQ, HEADS, HEAD_DIM = 2, 32, 4, 8
TOLERANCE = 1e-5  # float32, relative to the largest reference value
BATCH_AXES = BASE_RULES["batch"]


def reference_attention(q, k, v, segment_ids, causal, window=None):
    """Plain softmax attention over the whole sequence (or each query's `window` latest
    positions), float32, GQA by repeating K/V heads."""
    group = q.shape[2] // k.shape[2]
    k, v = jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2)
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(q.shape[-1])
    seq = q.shape[1]
    mask = jnp.ones((q.shape[0], seq, seq), bool)
    if causal:
        mask &= jnp.tril(jnp.ones((seq, seq), bool))
    if segment_ids is not None:
        mask &= segment_ids[:, :, None] == segment_ids[:, None, :]
    if window is not None:
        mask &= (jnp.arange(seq)[:, None] - jnp.arange(seq)[None, :] < window)[None]
    scores = jnp.where(mask[:, None], scores, -jnp.inf)
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, axis=-1), v)


def inputs(kv_heads, packed, seed=0, seq=SEQ):
    """q, k, v, segment_ids (three packed documents of random lengths, or None), cotangent."""
    rng = np.random.default_rng(seed)
    normal = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.float32)
    q, cotangent = normal(BATCH, seq, HEADS, HEAD_DIM), normal(BATCH, seq, HEADS, HEAD_DIM)
    k, v = normal(BATCH, seq, kv_heads, HEAD_DIM), normal(BATCH, seq, kv_heads, HEAD_DIM)
    documents = np.sort(rng.integers(0, 3, size=(BATCH, seq)), axis=1)
    segment_ids = jnp.asarray(documents) if packed else None
    return q, k, v, segment_ids, cotangent


def output_and_grads(attention, q, k, v, segment_ids, cotangent):
    """attention(q, k, v, segment_ids) and the gradients of sum(out * cotangent) in q, k, v."""
    out, vjp = jax.vjp(lambda q, k, v: attention(q, k, v, segment_ids), q, k, v)
    return (out, *vjp(cotangent.astype(out.dtype)))


@functools.partial(jax.jit, static_argnames=("causal", "window"))
def reference(q, k, v, segment_ids, cotangent, *, causal, window=None):
    attention = functools.partial(reference_attention, causal=causal, window=window)
    return output_and_grads(attention, q, k, v, segment_ids, cotangent)


def ring(q, k, v, segment_ids, cotangent, **options):
    attention = lambda q, k, v, s: ring_attention(q, k, v, segment_ids=s, **options)
    return jax.jit(output_and_grads, static_argnums=0)(attention, q, k, v, segment_ids, cotangent)


def relative_error(got, want):
    return float(jnp.max(jnp.abs(got.astype(jnp.float32) - want)) / jnp.max(jnp.abs(want)))


def assert_matches(got, want, tolerance=TOLERANCE):
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
        assert g.shape == w.shape, name
        assert relative_error(g, w) <= tolerance, (name, relative_error(g, w))


def context_mesh(context, axis_type):
    return jax.make_mesh((context,), ("context",), axis_types=(axis_type,), devices=jax.devices()[:context])


def six_axis_mesh(axis_type, data=2, context=2, tensor=2):
    shape = (1, data, 1, 1, context, tensor)
    devices = np.array(jax.devices()[: int(np.prod(shape))]).reshape(shape)
    return Mesh(devices, MESH_AXES, axis_types=(axis_type,) * 6)


# Every value of every dimension meets the reference at least once, without the full product:
# context {1, 2, 4, 8} x causal x layout x kv_heads {4, 2, 1} x packed x axis type.
CASES = [
    # context, causal, layout, kv_heads, packed, axis_type
    (1, True, "zigzag", 2, True, AxisType.Auto),
    (2, True, "zigzag", 4, False, AxisType.Explicit),
    (2, False, "contiguous", 2, True, AxisType.Auto),
    (4, True, "zigzag", 2, True, AxisType.Auto),
    (4, True, "contiguous", 1, False, AxisType.Explicit),
    (8, True, "zigzag", 4, True, AxisType.Explicit),
    (8, False, "zigzag", 1, True, AxisType.Auto),
    (8, True, "contiguous", 2, True, AxisType.Auto),
]


@pytest.mark.parametrize("context,causal,layout,kv_heads,packed,axis_type", CASES)
def test_ring_attention_matches_reference(context, causal, layout, kv_heads, packed, axis_type):
    q, k, v, segment_ids, cotangent = inputs(kv_heads, packed)
    got = ring(
        q, k, v, segment_ids, cotangent, mesh=context_mesh(context, axis_type), causal=causal, layout=layout
    )
    assert_matches(got, reference(q, k, v, segment_ids, cotangent, causal=causal))


# context, layout, window: within a chunk (zigzag: the two neighbours' blocks), past a chunk
# (contiguous: two blocks back), and the whole sequence (every hop).
WINDOW_CASES = [(4, "zigzag", 3), (8, "zigzag", 2), (8, "zigzag", 4), (8, "contiguous", 6), (2, "zigzag", 40)]


@pytest.mark.parametrize("context,layout,window", WINDOW_CASES)
def test_sliding_window_ring_matches_reference(context, layout, window):
    q, k, v, segment_ids, cotangent = inputs(kv_heads=2, packed=True)
    mesh = context_mesh(context, AxisType.Auto)
    got = ring(q, k, v, segment_ids, cotangent, mesh=mesh, layout=layout, window=window)
    want = reference(q, k, v, segment_ids, cotangent, causal=True, window=window)
    assert_matches(got, want)
    full = reference(q, k, v, segment_ids, cotangent, causal=True)
    if window < SEQ:  # the window changes the answer: a ring ignoring it would fail above
        assert relative_error(full[0], want[0]) > 100 * TOLERANCE


def test_sliding_window_ring_skips_the_hops_it_does_not_need():
    """zigzag over 8 devices, a window of one chunk (2 of the 32 positions): each device needs
    its two neighbours' blocks (ring distances 1 and 7), so the program moves far fewer bytes by
    collective-permute than the full ring's 7 hops (jaxpar.compiled.hlo counts the loop's trips)."""
    assert needed_shifts(SEQ, 8, "zigzag", 2) == (0, 1, 7)
    assert needed_shifts(SEQ, 8, "zigzag", 4) == (0, 1, 2, 6, 7)
    assert needed_shifts(SEQ, 8, "contiguous", 6) == (0, 1, 2)
    assert needed_shifts(SEQ, 8, "zigzag", SEQ) is None
    q, k, v, segment_ids, cotangent = inputs(kv_heads=2, packed=True)
    mesh = context_mesh(8, AxisType.Auto)

    def permutes(window):
        attention = lambda q, k, v, s: ring_attention(q, k, v, segment_ids=s, mesh=mesh, window=window)
        step = jax.jit(output_and_grads, static_argnums=0)
        text = step.lower(attention, q, k, v, segment_ids, cotangent).compile().as_text()
        return hlo.collectives(text)["collective-permute"]["bytes"]

    windowed, full = permutes(2), permutes(None)
    # forward: 2 blocks fetched instead of 7 hops; backward: 2 fetched and 2 sent home against
    # 7 hops and 8 of the accumulators (which are float32, twice K/V's bytes here too).
    assert 0 < windowed < full / 2.5, (windowed, full)


def test_bfloat16_keeps_dtype_and_stays_close():
    q, k, v, segment_ids, cotangent = inputs(kv_heads=2, packed=True)
    as_bf16 = lambda x: x.astype(jnp.bfloat16)
    got = ring(
        as_bf16(q), as_bf16(k), as_bf16(v), segment_ids, cotangent, mesh=context_mesh(2, AxisType.Auto)
    )
    assert all(x.dtype == jnp.bfloat16 for x in got)
    want = reference(
        *(x.astype(jnp.float32) for x in map(as_bf16, (q, k, v))), segment_ids, cotangent, causal=True
    )
    assert_matches(got, want, tolerance=2e-2)  # bf16 inputs and outputs: 8 mantissa bits


@pytest.mark.parametrize(
    "axis_type,packed", [(AxisType.Auto, True), (AxisType.Explicit, True), (AxisType.Explicit, False)]
)
def test_six_axis_mesh_with_batch_and_heads_sharded_matches(axis_type, packed):
    mesh = six_axis_mesh(axis_type)  # data=2, context=2, tensor=2
    q, k, v, segment_ids, cotangent = inputs(kv_heads=2, packed=packed)
    heads = NamedSharding(mesh, P(BATCH_AXES, None, "tensor", None))
    placed = [jax.device_put(x, heads) for x in (q, k, v)]
    with jax.set_mesh(mesh):  # segment_ids as they come: ring_attention shards them like q
        got = ring(*placed, segment_ids, cotangent, mesh=mesh)
    assert_matches(got, reference(q, k, v, segment_ids, cotangent, causal=True))
    for x in got:  # batch and heads keep their sharding; no device holds the whole of either
        assert x.addressable_shards[0].data.shape[0] == BATCH // 2
        assert x.addressable_shards[0].data.shape[2] == x.shape[2] // 2


def test_explicit_heads_sharded_unlike_kv_heads_is_a_value_error():
    mesh = six_axis_mesh(AxisType.Explicit)
    q, k, v, _, _ = inputs(kv_heads=1, packed=False)
    q = jax.device_put(q, NamedSharding(mesh, P(BATCH_AXES, None, "tensor", None)))
    with jax.set_mesh(mesh), pytest.raises(ValueError, match="kv_heads over None"):
        ring_attention(q, k, v, mesh=mesh)


def test_permuted_api_issues_only_ppermute_and_matches():
    """On sequences already in zigzag order and sharded over context, the only collectives in
    forward + backward are the ring's collective-permutes; undoing the order gives the reference."""
    mesh = six_axis_mesh(AxisType.Auto)
    q, k, v, segment_ids, cotangent = inputs(kv_heads=2, packed=True)
    to_layout = functools.partial(permute_to_layout, context=2, layout="zigzag")
    seq_sharded = NamedSharding(mesh, P(BATCH_AXES, "context", "tensor", None))
    args = [jax.device_put(to_layout(x), seq_sharded) for x in (q, k, v)]
    segments = jax.device_put(to_layout(segment_ids), NamedSharding(mesh, P(BATCH_AXES, "context")))
    attention = lambda q, k, v, s: ring_attention_permuted(q, k, v, mesh=mesh, segment_ids=s)
    step = jax.jit(output_and_grads, static_argnums=0)
    compiled = step.lower(attention, *args, segments, to_layout(cotangent)).compile()
    hlo = compiled.as_text()
    assert "collective-permute" in hlo
    for collective in ("all-gather", "all-reduce", "all-to-all", "reduce-scatter"):
        assert collective not in hlo, collective
    got = compiled(*args, segments, to_layout(cotangent))
    got = [permute_from_layout(x, context=2, layout="zigzag") for x in got]
    assert_matches(got, reference(q, k, v, segment_ids, cotangent, causal=True))


@pytest.mark.parametrize(
    "layout,context,expected",
    [
        ("zigzag", 2, [0, 1, 6, 7, 2, 3, 4, 5]),
        ("zigzag", 4, [0, 7, 1, 6, 2, 5, 3, 4]),
        ("contiguous", 4, list(range(8))),
    ],
)
def test_layout_order_and_round_trip(layout, context, expected):
    np.testing.assert_array_equal(layout_indices(8, context, layout), expected)
    x = jnp.arange(3 * 8 * 2).reshape(3, 8, 2)
    permuted = permute_to_layout(x, context=context, layout=layout)
    np.testing.assert_array_equal(permuted, x[:, np.array(expected)])
    np.testing.assert_array_equal(permute_from_layout(permuted, context=context, layout=layout), x)


@pytest.mark.parametrize(
    "seq,kv_heads,layout,axis_name,message",
    [
        (36, 2, "zigzag", "context", "seq=36 is not divisible by 8"),
        (30, 2, "contiguous", "context", "seq=30 is not divisible by 4"),
        (32, 3, "zigzag", "context", "heads=4 is not divisible by kv_heads=3"),
        (32, 2, "striped", "context", "layout='striped' is unknown"),
        (32, 2, "zigzag", "sequence", "axis_name='sequence' is not a mesh axis"),
    ],
)
def test_bad_input_is_a_clear_value_error(seq, kv_heads, layout, axis_name, message):
    q = jnp.zeros((BATCH, seq, HEADS, HEAD_DIM))
    k = jnp.zeros((BATCH, seq, kv_heads, HEAD_DIM))
    with pytest.raises(ValueError, match=message):
        ring_attention(q, k, k, mesh=context_mesh(4, AxisType.Auto), axis_name=axis_name, layout=layout)


def test_memory_per_device_shrinks_with_context():
    """Forward + backward at seq 8192: temp bytes per device with context=8 are at most a quarter
    of context=1 (in fact about 1/100: score tiles shrink as (seq / context)^2)."""
    x = jax.ShapeDtypeStruct((1, 8192, 1, 16), jnp.float32)

    def temp_bytes(context):
        mesh = context_mesh(context, AxisType.Auto)
        loss = lambda q, k, v: jnp.sum(ring_attention(q, k, v, mesh=mesh))
        compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(x, x, x).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    single, ring8 = temp_bytes(1), temp_bytes(8)
    assert single >= (8192 // 2) ** 2 * 4  # context=1: one float32 score tile of two chunks
    assert ring8 <= single / 4, (ring8, single)
