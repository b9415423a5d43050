"""Packed-document attention: segment offsets against numpy, the XLA path against a plain
reference, and the cuDNN path compiled for H100s (compile-only devices: nothing runs on a GPU
here, so the cuDNN numbers themselves are not checked -- the program's structure is)."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxpar.compiled import targets as targets_lib
from jaxpar.config import MESH_AXES
from jaxpar.models.attention import (
    assume_compute_capability,
    attend,
    attention_mask,
    documents_per_row,
    poison_overflow,
    segment_offsets,
)
from jaxpar.sharding import Layout, make_rules

# --- References ---------------------------------------------------------------------------


def random_segment_ids(rng, batch, seq, max_docs):
    """Rows packed like jaxpar.data: ids 1, 2, ... in contiguous runs, 1..max_docs runs a row."""
    rows = []
    for _ in range(batch):
        docs = int(rng.integers(1, max_docs + 1))
        cuts = np.sort(rng.choice(np.arange(1, seq), size=docs - 1, replace=False))
        is_start = np.zeros(seq, bool)
        is_start[0] = True
        is_start[cuts] = True
        rows.append(np.cumsum(is_start))
    return np.stack(rows).astype(np.int32)


def reference_offsets(segment_ids, max_segments):
    """Loops: the start and length of each run of equal ids, -1 beyond the row's runs; and the
    number of runs of each row."""
    batch, seq = segment_ids.shape
    offsets = np.full((batch, max_segments + 1), -1, np.int32)
    lengths = np.full((batch, max_segments), -1, np.int32)
    counts = []
    for b in range(batch):
        starts = [t for t in range(seq) if t == 0 or segment_ids[b, t] != segment_ids[b, t - 1]]
        ends = starts[1:] + [seq]
        counts.append(len(starts))
        for j, (s, e) in enumerate(zip(starts, ends)):
            if j < max_segments:
                offsets[b, j], lengths[b, j] = s, e - s
    return offsets, lengths, np.array(counts)


def mask_from_offsets(offsets, lengths, seq):
    """The causal & same-document mask [B, 1, T, T] that (offsets, lengths) describe."""
    pos = np.arange(seq)
    doc = np.full((offsets.shape[0], seq), -1)
    for b in range(offsets.shape[0]):
        for j in range(lengths.shape[1]):
            if lengths[b, j] >= 0:
                doc[b, offsets[b, j] : offsets[b, j] + lengths[b, j]] = j
    assert (doc >= 0).all(), "a token is in no described document"
    same = doc[:, :, None] == doc[:, None, :]
    return (same & (pos[None, None, :] <= pos[None, :, None]))[:, None]


def reference_attention(q, k, v, segment_ids, window=None, scale=None):
    """float64 numpy: softmax(q k^T * scale) v over earlier tokens of the same document (scale
    1/sqrt(H) by default); with `window`, only the `window` latest of them (itself included)."""
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    _, seq, n, h = q.shape
    k, v = np.repeat(k, n // k.shape[2], axis=2), np.repeat(v, n // v.shape[2], axis=2)
    allowed = np.tril(np.ones((seq, seq), bool))[None]
    if window is not None:
        allowed = allowed & (np.arange(seq)[:, None] - np.arange(seq)[None, :] < window)[None]
    if segment_ids is not None:
        allowed = allowed & (segment_ids[:, :, None] == segment_ids[:, None, :])
    scores = np.einsum("bqnh,bknh->bnqk", q, k) * (1 / np.sqrt(h) if scale is None else scale)
    scores = np.where(allowed[:, None], scores, -np.inf)
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    weights /= weights.sum(-1, keepdims=True)
    return np.einsum("bnqk,bknh->bqnh", weights, v)


# --- Segment offsets ------------------------------------------------------------------------


EDGE_ROWS = np.array(
    [
        [1] * 16,  # one document
        list(range(1, 17)),  # sixteen documents of one token: the most a row can hold
        [1] + [2] * 14 + [3],  # one-token documents at both ends
        [7] * 5 + [3] * 5 + [9] * 6,  # ids need not start at 1 or increase
    ],
    np.int32,
)


@pytest.mark.parametrize("max_segments", [16, 5, 1])
def test_segment_offsets_match_numpy(max_segments):
    rng = np.random.default_rng(max_segments)
    ids = np.concatenate([EDGE_ROWS, random_segment_ids(rng, 20, 16, 16)])
    offsets, lengths = jax.jit(segment_offsets, static_argnums=1)(ids, max_segments)
    want_offsets, want_lengths, want_counts = reference_offsets(ids, max_segments)
    np.testing.assert_array_equal(offsets, want_offsets)
    np.testing.assert_array_equal(lengths, want_lengths)
    assert offsets.dtype == lengths.dtype == jnp.int32
    assert (np.asarray(offsets)[:, -1] == -1).all()  # never an end offset in the last column
    np.testing.assert_array_equal(documents_per_row(ids), want_counts)  # numpy, on the host
    np.testing.assert_array_equal(jax.jit(documents_per_row)(ids), want_counts)


def test_offsets_rebuild_the_dense_mask_exactly():
    """Offsets and lengths describe the same attention as attention_mask: an off-by-one
    in either would move a token into a neighbouring document."""
    rng = np.random.default_rng(1)
    seq = 64
    ids = np.concatenate(
        [
            random_segment_ids(rng, 30, seq, 12),
            np.ones((1, seq), np.int32),
            np.arange(seq, dtype=np.int32)[None],
        ]
    )
    offsets, lengths = segment_offsets(jnp.asarray(ids), seq)
    rebuilt = mask_from_offsets(np.asarray(offsets), np.asarray(lengths), seq)
    np.testing.assert_array_equal(rebuilt, np.asarray(attention_mask(jnp.asarray(ids))))


def test_rows_with_too_many_documents_are_poisoned():
    ids = np.stack([np.repeat([1, 2, 3], [3, 3, 2]), np.repeat([1, 2], [4, 4])]).astype(np.int32)
    out = poison_overflow(jnp.ones((2, 8, 2, 4), jnp.bfloat16), jnp.asarray(ids), 2)
    assert np.isnan(np.asarray(out[0], np.float32)).all()
    assert (np.asarray(out[1], np.float32) == 1).all()
    np.testing.assert_array_equal(documents_per_row(ids), [3, 2])  # the host-side check


# --- The XLA path, run here -------------------------------------------------------------------


@pytest.mark.parametrize("packed", [True, False])
def test_xla_path_matches_reference(packed):
    rng = np.random.default_rng(2)
    b, t, n, kv, h = 3, 32, 4, 2, 16
    q, k, v = (
        rng.standard_normal(s).astype(np.float32) for s in [(b, t, n, h), (b, t, kv, h), (b, t, kv, h)]
    )
    ids = random_segment_ids(rng, b, t, 6) if packed else None
    out = jax.jit(lambda q, k, v, s: attend(q, k, v, s, implementation="xla"))(q, k, v, ids)
    np.testing.assert_allclose(out, reference_attention(q, k, v, ids), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("packed", [True, False])
def test_sliding_window_over_packed_documents_matches_reference(packed):
    """A window of 3 inside packed documents (a query sees its own document's 3 latest tokens),
    with a query scale of its own; `sliding` false (a global layer) is the plain attention."""
    rng = np.random.default_rng(3)
    b, t, n, kv, h = 3, 32, 4, 2, 16
    q, k, v = (
        rng.standard_normal(s).astype(np.float32) for s in [(b, t, n, h), (b, t, kv, h), (b, t, kv, h)]
    )
    ids = random_segment_ids(rng, b, t, 6) if packed else None

    @jax.jit
    def windowed(q, k, v, s, sliding):
        return attend(q, k, v, s, implementation="xla", window=3, sliding=sliding, scale=0.2)

    want = reference_attention(q, k, v, ids, window=3, scale=0.2)
    np.testing.assert_allclose(windowed(q, k, v, ids, True), want, atol=1e-5, rtol=1e-5)
    full = reference_attention(q, k, v, ids, scale=0.2)
    np.testing.assert_allclose(windowed(q, k, v, ids, False), full, atol=1e-5, rtol=1e-5)
    assert np.abs(want - full).max() > 0.1  # the window matters on these rows


def test_cudnn_rejects_what_cudnn_cannot_take():
    x = jnp.zeros((1, 16, 2, 16), jnp.float32)
    with pytest.raises(ValueError, match="bfloat16 or float16"):
        attend(x, x, x, None, implementation="cudnn")
    y = jnp.zeros((1, 16, 2, 12), jnp.bfloat16)
    with pytest.raises(ValueError, match="multiple of 8"):
        attend(y, y, y, None, implementation="cudnn")
    with pytest.raises(ValueError, match="implementation"):
        attend(y, y, y, None, implementation="flash")


def test_packed_cudnn_refuses_offsets_past_int32():
    big = jax.ShapeDtypeStruct((64, 8192, 32, 128), jnp.bfloat16)  # 2**31 elements
    ids = jax.ShapeDtypeStruct((64, 8192), jnp.int32)
    with pytest.raises(ValueError, match="int32"):
        jax.eval_shape(lambda q, s: attend(q, q, q, s, implementation="cudnn"), big, ids)


# --- The cuDNN path, compiled for H100s ------------------------------------------------------


def _h100_devices(count):
    """`count` compile-only H100 devices (jaxpar.compiled.targets), or a skip without the CUDA plugin."""
    pytest.importorskip("jax_plugins.xla_cuda12", reason="needs the gpu-compile extra")
    return targets_lib.devices(targets_lib.resolve(f"h100:{count}"))


def _mesh(devices, **sizes):
    shape = [sizes.get(axis, 1) for axis in MESH_AXES]
    return Mesh(np.array(devices).reshape(shape), MESH_AXES)


def _compile_grad(mesh, shapes, specs, segmented, max_segments):
    """HLO text of jit(grad(sum(attend(..., "cudnn")))) for q, k, v (and segment ids)."""
    layout = Layout(mesh, {"activations": make_rules(shard_embed=False, sequence_parallel=False)})

    def loss(q, k, v, ids):
        with layout.scope():
            out = attend(
                q, k, v, ids if segmented else None, implementation="cudnn", max_segments=max_segments
            )
        return out.astype(jnp.float32).sum()

    args = [
        jax.ShapeDtypeStruct(s, d, sharding=NamedSharding(mesh, p))
        for s, d, p in zip(shapes, [jnp.bfloat16] * 3 + [jnp.int32], specs)
    ]
    with assume_compute_capability("9.0"):
        lowered = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(*args)
    return lowered.compile().as_text()


def _custom_calls(hlo):
    """[(target, [operand shapes])] of the cuDNN custom calls in compiled HLO text."""
    calls = []
    for line in hlo.splitlines():
        found = re.search(r'custom_call_target="(__cudnn\$[^"]+)"', line)
        if not found:
            continue
        layouts = re.search(r"operand_layout_constraints=\{(.*?)\}, api_version", line).group(1)
        calls.append((found.group(1), re.findall(r"\w+\[[\d,]*\]", layouts)))
    return calls


def _no_square_buffers(hlo, seq):
    """No array anywhere in the program has two dimensions of the sequence length."""
    return not re.search(rf"\w+\[(?:\d+,)*{seq},{seq}\]", hlo)


B, T, N, K, H, M = 2, 256, 4, 2, 64, 4


def test_packed_cudnn_compiles_to_flash_attention_without_a_mask():
    mesh = _mesh(_h100_devices(1))
    shapes = [(B, T, N, H), (B, T, K, H), (B, T, K, H), (B, T)]
    hlo = _compile_grad(mesh, shapes, [PartitionSpec()] * 4, True, M)
    calls = dict(_custom_calls(hlo))
    assert set(calls) == {"__cudnn$fmhaSoftmax", "__cudnn$fmhaSoftmaxBackward"}
    # q, k, v (GQA: k, v keep their K heads), lengths [B, M] twice, offsets [B, M+1] twice
    assert calls["__cudnn$fmhaSoftmax"] == [
        f"bf16[{B},{T},{N},{H}]",
        f"bf16[{B},{T},{K},{H}]",
        f"bf16[{B},{T},{K},{H}]",
        f"s32[{B},{M}]",
        f"s32[{B},{M}]",
        f"s32[{B},{M + 1}]",
        f"s32[{B},{M + 1}]",
    ]
    # ... plus the softmax statistics [B*M, N, T], the output and its cotangent
    assert calls["__cudnn$fmhaSoftmaxBackward"][3] == f"f32[{B * M},{N},{T}]"
    assert calls["__cudnn$fmhaSoftmaxBackward"][-4:] == calls["__cudnn$fmhaSoftmax"][-4:]
    assert '"mask_type":"CAUSAL"' in hlo.replace(" ", "")
    assert _no_square_buffers(hlo, T)


def test_one_document_per_row_is_plain_causal_cudnn():
    mesh = _mesh(_h100_devices(1))
    shapes = [(B, T, N, 128), (B, T, K, 128), (B, T, K, 128), (B, T)]
    hlo = _compile_grad(mesh, shapes, [PartitionSpec()] * 4, False, M)
    calls = dict(_custom_calls(hlo))
    assert set(calls) == {"__cudnn$fmhaSoftmax", "__cudnn$fmhaSoftmaxBackward"}
    assert calls["__cudnn$fmhaSoftmax"] == [f"bf16[{B},{T},{N},128]"] + [f"bf16[{B},{T},{K},128]"] * 2
    assert '"mask_type":"CAUSAL"' in hlo.replace(" ", "")
    assert _no_square_buffers(hlo, T)


@pytest.mark.parametrize(
    "ids_spec", [PartitionSpec("data", None), PartitionSpec()], ids=["ids-batch-split", "ids-replicated"]
)
def test_packed_cudnn_partitions_over_batch_and_heads(ids_spec):
    """4 H100s as data=2 x tensor=2: every device runs the call on its own rows and heads, with
    the offsets of its own rows -- even when the segment ids arrive replicated -- and nothing is
    gathered."""
    batch = 4
    mesh = _mesh(_h100_devices(4), data=2, tensor=2)
    qkv = PartitionSpec("data", None, "tensor", None)
    shapes = [(batch, T, N, H), (batch, T, K, H), (batch, T, K, H), (batch, T)]
    hlo = _compile_grad(mesh, shapes, [qkv] * 3 + [ids_spec], True, M)
    calls = dict(_custom_calls(hlo))
    local = batch // 2
    assert calls["__cudnn$fmhaSoftmax"] == [
        f"bf16[{local},{T},{N // 2},{H}]",
        f"bf16[{local},{T},{K // 2},{H}]",
        f"bf16[{local},{T},{K // 2},{H}]",
        f"s32[{local},{M}]",
        f"s32[{local},{M}]",
        f"s32[{local},{M + 1}]",
        f"s32[{local},{M + 1}]",
    ]
    assert calls["__cudnn$fmhaSoftmaxBackward"][-4:] == calls["__cudnn$fmhaSoftmax"][-4:]
    assert not re.search(r"= \S+ (all-gather|all-reduce|all-to-all|collective-permute)", hlo)
    assert _no_square_buffers(hlo, T)


# --- The cuDNN path's numbers: only where a GPU is present ------------------------------------


def _gpus():
    try:
        return jax.devices("gpu")
    except RuntimeError:
        return []


@pytest.mark.skipif(not _gpus(), reason="needs a GPU (run with JAX_PLATFORMS=cuda,cpu)")
@pytest.mark.parametrize("packed", [True, False])
def test_cudnn_matches_xla_on_a_gpu(packed):
    """The numbers nothing above checks: per-document causal attention and its gradients from
    cuDNN against the dense-mask XLA path, on a Hopper GPU."""
    gpu = _gpus()[0]
    rng = np.random.default_rng(3)
    b, t, n, kv, h, m = 4, 256, 8, 2, 64, 8
    q, k, v, cot = (
        jax.device_put(jnp.asarray(rng.standard_normal(s), jnp.bfloat16), gpu)
        for s in [(b, t, n, h), (b, t, kv, h), (b, t, kv, h), (b, t, n, h)]
    )
    ids = np.concatenate(
        [
            random_segment_ids(rng, b - 2, t, m),
            np.ones((1, t), np.int32),
            np.repeat(np.arange(m, dtype=np.int32), t // m)[None],
        ]
    )
    ids = jax.device_put(ids, gpu) if packed else None

    def run(impl):
        def loss(q, k, v):
            out = attend(q, k, v, ids, implementation=impl, max_segments=m)
            return (out.astype(jnp.float32) * cot.astype(jnp.float32)).sum(), out

        (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)
        return [np.asarray(a, np.float32) for a in (out, *grads)]

    for got, want in zip(run("cudnn"), run("xla")):
        np.testing.assert_allclose(got, want, atol=5e-2, rtol=5e-2)
    if packed:  # one document more than described: that row is NaN, the others are not
        over = np.concatenate(
            [np.asarray(ids)[:-1], np.arange(m + 1, dtype=np.int32).repeat(-(-t // (m + 1)))[None, :t]]
        )
        out = jax.jit(lambda q, k, v, s: attend(q, k, v, s, implementation="cudnn", max_segments=m))(
            q, k, v, jax.device_put(over, gpu)
        )
        out = np.asarray(out, np.float32)
        assert np.isnan(out[-1]).all() and np.isfinite(out[:-1]).all()


@pytest.mark.skipif(not _gpus(), reason="needs a GPU (run with JAX_PLATFORMS=cuda,cpu)")
@pytest.mark.parametrize("most", [1, 3, 4])
def test_a_checked_bucket_matches_xla_on_a_gpu(most):
    """The training loop's attention (checked for k documents: k slots, no poison; k = 1 the plain
    causal call) on rows of at most `most` documents: cuDNN's output and gradients are XLA's."""
    gpu = _gpus()[0]
    rng = np.random.default_rng(most)
    b, t, n, kv, h = 4, 256, 8, 2, 64
    q, k, v, cot = (
        jax.device_put(jnp.asarray(rng.standard_normal(s), jnp.bfloat16), gpu)
        for s in [(b, t, n, h), (b, t, kv, h), (b, t, kv, h), (b, t, n, h)]
    )
    ids = jax.device_put(random_segment_ids(rng, b, t, most), gpu)
    bucket = {1: 1, 3: 4, 4: 4}[most]

    def run(impl):
        def loss(q, k, v):
            out = attend(q, k, v, ids, implementation=impl, max_segments=bucket, checked=True)
            return (out.astype(jnp.float32) * cot.astype(jnp.float32)).sum(), out

        (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)
        return [np.asarray(a, np.float32) for a in (out, *grads)]

    for got, want in zip(run("cudnn"), run("xla")):
        np.testing.assert_allclose(got, want, atol=5e-2, rtol=5e-2)
