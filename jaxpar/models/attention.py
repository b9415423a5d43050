"""Causal attention over packed documents, with a cuDNN path that never builds a [T, T] mask.

A training row holds several documents end to end (`jaxpar.data`): `segment_ids` [batch, seq]
gives every token its document, and a token may attend only to earlier tokens of its own
document. Two implementations compute exactly that:

- "xla": the dense causal & same-document mask of `attention_mask` handed to
  `jax.nn.dot_product_attention` -- O(T^2) memory, runs anywhere;
- "cudnn": cuDNN flash attention in its packed ("ragged") form. Each row is described by the
  start offset and length of each of its first `max_segments` documents (`segment_offsets`), and
  cuDNN runs a causal attention inside every document on its own. No [T, T] operand exists: the
  custom calls are `__cudnn$fmhaSoftmax` / `__cudnn$fmhaSoftmaxBackward` with q, k, v, the
  lengths [B, M] and the offsets [B, M + 1] as operands.

`jax.nn.dot_product_attention` cannot say this: its `query_seq_lengths` describe one valid prefix
per row ([batch] lengths), not several documents. The packed form is reached through
`jax._src.cudnn.fused_attention_stablehlo.dot_product_attention` (private in jax 0.12).

The number of documents described per row, M = `max_segments`, is static, and it is not free:
cuDNN treats every (row, document slot) as a sequence of length T, so the softmax statistics that
the forward saves for the backward are float32 [B * M, N, T] -- 4*B*M*N*T bytes per layer, i.e.
M times the statistics of a one-document call -- and the packed backward works through every
slot whatever it holds (on an H100 about 117 ns per empty row x slot x head, `jaxpar.compiled.ruler`, plus
small kernels that prepare the offsets: GPT-2 124M took 53.3 ms a step at M = 32 and 47.0 ms at
M = 1 on rows of one document). M = T (which could never be exceeded) would make the statistics
4*B*N*T^2 bytes, as large as the dense float32 logits this path exists to avoid. So M is chosen
per batch where the caller can check its rows:

- checked (`attend(..., max_segments=k, checked=True)`): the caller has counted every row's
  documents on the host (`documents_per_row`) and promises at most k; the call describes k slots
  (k = 1 is the plain causal call, no offsets) and makes no row NaN. The training loop does this: it compiles
  one step per bucket of `slot_buckets` (1, 2, 4, ... up to model.max_documents_per_row) and
  runs each batch with the smallest bucket that holds its fullest row (`jaxpar.training.trainer.Trainer.
  step_for`), so a batch of one-document rows costs what plain causal attention costs;
- unchecked (everything else: `Trainer.step`, the evaluation step, a model run on its own): M =
  `max_segments`, and a row with more documents than M is made loud instead of wrong: its
  attention output is NaN (`poison_overflow`, a select over every output, forward and backward),
  so the loss is NaN (`train.on_nan` then stops or skips the step).

Caller's constraints for "cudnn" (checked here where they can be):
- q, k, v in bfloat16 or float16, layout [batch, seq, heads, head_dim]; k, v with K heads
  where K divides N (grouped-query attention is native, k/v are not repeated);
- head_dim a multiple of 8, at most 256 on Hopper (128 before it);
- packed documents (`segment_ids` given) need a Hopper or newer GPU (sm_90+) and cuDNN >= 9.6;
- under a mesh: batch and heads may be sharded, the sequence and head_dim may not (XLA's custom
  partitioning of the call refuses); q, k and v must have the same sharding spec;
- packed: per device, B_local * T * N_local * head_dim < 2**31 (jax turns the offsets into
  element offsets in int32).
"""

from __future__ import annotations

import contextlib
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

from jaxpar.sharding import constrain, current_scope, logical_to_spec

# Documents described per row on the cuDNN path when the caller does not say. The softmax
# statistics cost 4*B*M*N*T bytes per layer (for B=12, T=1024, N=12: 9.4 MB at M=16).
DEFAULT_MAX_SEGMENTS = 16

IMPLEMENTATIONS = ("xla", "cudnn")


def _fused():
    # Imported lazily: the module is private and only the "cudnn" path needs it.
    from jax._src.cudnn import fused_attention_stablehlo

    return fused_attention_stablehlo


# --- Documents of a row -----------------------------------------------------------------------


def document_index(segment_ids):
    """int32 [batch, seq]: the number of each token's document within its row, from 0.

    A document is a maximal run of equal ids (ids need not start at any value or be
    consecutive, but a document's tokens must be contiguous -- as `jaxpar.data` packs them)."""
    boundary = segment_ids[:, 1:] != segment_ids[:, :-1]
    return jnp.concatenate(
        [jnp.zeros_like(segment_ids[:, :1], dtype=jnp.int32), jnp.cumsum(boundary, axis=1, dtype=jnp.int32)],
        axis=1,
    )


def documents_per_row(segment_ids):
    """[batch]: how many documents each row holds. Works on numpy arrays (on the host, e.g. to
    check a batch before the step) and on jax arrays (in a jitted function)."""
    xp = np if isinstance(segment_ids, np.ndarray) else jnp
    return 1 + xp.sum(segment_ids[:, 1:] != segment_ids[:, :-1], axis=1)


def segment_offsets(segment_ids, max_segments: int):
    """(offsets int32 [batch, M + 1], lengths int32 [batch, M]) of each row's first M =
    `max_segments` documents, in the form cuDNN's packed attention takes.

    offsets[b, j] is the position where document j of row b starts and lengths[b, j] its number
    of tokens, for j < the row's document count; the other entries are -1, and the last column
    of offsets is always -1 (jax's packed call pairs the k-th non-negative offset with the k-th
    non-negative length over the whole batch, so no end offset may appear). A row with more than
    M documents is described only up to its M-th document (`documents_per_row` tells).

    Document j ends where the tokens of documents 0..j end, i.e. at the count of tokens whose
    document index is <= j: a [batch, seq, M] comparison, reduced over seq, that partitions along
    batch like any elementwise op (no scatter, no sort)."""
    if max_segments < 1:
        raise ValueError(f"max_segments must be >= 1, got {max_segments}")
    batch = segment_ids.shape[0]
    doc = document_index(segment_ids)
    count = doc[:, -1:] + 1  # [batch, 1]
    slot = jnp.arange(max_segments, dtype=jnp.int32)
    ends = jnp.sum(doc[:, :, None] <= slot, axis=1, dtype=jnp.int32)  # [batch, M]
    starts = jnp.concatenate([jnp.zeros((batch, 1), jnp.int32), ends[:, :-1]], axis=1)
    present = slot[None, :] < count
    offsets = jnp.where(present, starts, -1)
    lengths = jnp.where(present, ends - starts, -1)
    offsets = jnp.concatenate([offsets, jnp.full((batch, 1), -1, jnp.int32)], axis=1)
    return offsets, lengths


def slot_buckets(limit: int) -> tuple[int, ...]:
    """The document-slot counts a checked caller compiles for, up to `limit` (model.
    max_documents_per_row): the powers of two below it, then `limit` itself -- (1, 2, 4, 8, 16,
    32) for 32, (1, 2, 4, 8, 16, 24) for 24. A batch runs with the smallest that holds its fullest
    row (`slot_bucket`): at most twice the slots it needs, and at most log2(limit) + 1 programs."""
    if limit < 1:
        raise ValueError(f"the document-slot limit must be >= 1, got {limit}")
    ladder = []
    while (1 << len(ladder)) < limit:
        ladder.append(1 << len(ladder))
    return (*ladder, limit)


def slot_bucket(documents: int, limit: int) -> int:
    """The smallest of `slot_buckets(limit)` that is >= `documents` (the most documents a row of
    the batch holds, `documents_per_row(...).max()`)."""
    if not 1 <= documents <= limit:
        raise ValueError(
            f"a row of {documents} documents does not fit any slot bucket of 1..{limit} documents "
            f"(model.max_documents_per_row={limit}); check batches with documents_per_row first"
        )
    return next(b for b in slot_buckets(limit) if b >= documents)


# --- Attention ----------------------------------------------------------------------------------


def kernel_for(cfg, device, *, pipelined: bool = False, ring: bool = False) -> str:
    """`model.attention` (a ModelConfig's) made concrete for `device`: an explicit choice stands;
    "auto" is "cudnn" where its packed form runs -- a Hopper or newer GPU (compute capability
    >= 9.0), bfloat16 or float16 activations, head_dim a multiple of 8 up to 256, not inside the
    pipeline (the call does not compile in its shard_map, jax 0.12) and not under ring attention
    -- and "xla" everywhere else."""
    if cfg.attention != "auto":
        return cfg.attention
    head_dim = cfg.head_width
    capability = getattr(device, "compute_capability", None) or "0"
    fits = (
        device.platform in ("gpu", "cuda")
        and float(capability) >= 9.0
        and cfg.dtype in ("bfloat16", "float16")
        and head_dim % 8 == 0
        and head_dim <= 256
        and not pipelined
        and not ring
    )
    return "cudnn" if fits else "xla"


def attention_mask(segment_ids, window: int | None = None, sliding=None):
    """Causal and same-document mask [batch, 1, q, k] from segment ids [batch, seq]; with
    `window`, a query sees only the `window` latest positions (itself included) -- where
    `sliding` (a traced bool, or None for always) holds."""
    return _mask(segment_ids.shape[1], segment_ids, window, sliding)


def _mask(seq, segment_ids, window, sliding):
    """`attention_mask`; segment_ids None: one document per row, [1, 1, q, k]."""
    causal = jnp.tril(jnp.ones((seq, seq), dtype=bool))
    if window is not None:
        offset = jnp.arange(seq)[:, None] - jnp.arange(seq)[None, :]
        near = offset < window
        causal = causal & (near if sliding is None else near | ~sliding)
    if segment_ids is None:
        return causal[None, None]
    same_doc = segment_ids[:, :, None] == segment_ids[:, None, :]
    return (causal[None] & same_doc)[:, None]


def attend(
    q,
    k,
    v,
    segment_ids,
    *,
    implementation: str,
    max_segments=None,
    checked: bool = False,
    scale=None,
    window=None,
    sliding=None,
):
    """Causal attention of each token to the earlier tokens of its own document.

    q [B, T, N, H], k/v [B, T, K, H] (K divides N); segment_ids int [B, T], or None for one
    document per row. Returns [B, T, N, H] in q's dtype. `implementation`: "xla" (dense mask) or
    "cudnn" (packed flash attention, see the module doc); `max_segments` (cudnn only): documents
    described per row, DEFAULT_MAX_SEGMENTS when None; rows holding more come out NaN -- unless
    `checked`: the caller counted every row's documents on the host and none holds more, so
    nothing is poisoned (the training loop's slot buckets). `scale`:
    of the logits, None for 1/sqrt(H). `window` (static): a query sees its `window` latest
    positions only, in the layers where `sliding` (a traced bool; None: every call) holds -- on
    cuDNN both forms are compiled and `lax.cond` picks one per layer."""
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation must be one of {IMPLEMENTATIONS}, got {implementation!r}")
    _check_shapes(q, k, v, segment_ids)
    if implementation == "xla":
        if segment_ids is None and window is None:
            return jax.nn.dot_product_attention(q, k, v, scale=scale, is_causal=True, implementation="xla")
        mask = _mask(q.shape[1], segment_ids, window, sliding)
        return jax.nn.dot_product_attention(q, k, v, scale=scale, mask=mask, implementation="xla")
    _check_cudnn(q, k)
    max_segments = DEFAULT_MAX_SEGMENTS if max_segments is None else max_segments

    def cudnn(q, k, v, window):
        if segment_ids is None:
            local = None if window is None else (window - 1, 0)
            return jax.nn.dot_product_attention(
                q, k, v, scale=scale, is_causal=True, local_window_size=local, implementation="cudnn"
            )
        return _packed_cudnn(q, k, v, segment_ids, max_segments, scale, window, poison=not checked)

    if window is None or sliding is None:
        return cudnn(q, k, v, window)
    return jax.lax.cond(
        sliding, functools.partial(cudnn, window=window), functools.partial(cudnn, window=None), q, k, v
    )


def _packed_cudnn(q, k, v, segment_ids, max_segments: int, scale=None, window=None, poison=True):
    """cuDNN's packed call over `max_segments` document slots; `poison`: rows holding more
    documents come out NaN (`poison_overflow`), else the caller has ruled them out."""
    fa = _fused()
    # jax turns token offsets into element offsets (x N * H) in int32, on each device's shard.
    b, t, n, h = _local_shape(q.shape, ("batch", "seq", "heads", None))
    if b * t * n * h >= 2**31:
        raise ValueError(
            f"attend(implementation='cudnn'): q holds {b}x{t}x{n}x{h} elements on "
            f"one device, past the int32 offsets of cuDNN's packed attention; use "
            f"fewer rows per device"
        )
    max_segments = min(max_segments, q.shape[1])  # a row cannot hold more documents than tokens
    common = dict(
        scale=1.0 / math.sqrt(q.shape[-1]) if scale is None else scale,
        mask_type=fa.MaskType.CAUSAL,
        sliding_window_length=window,
    )
    if max_segments == 1:
        # One slot means one document per row: jax's packed form needs M > 1, and a plain causal
        # call is the same thing (unchecked rows with more documents are poisoned below).
        out = fa.dot_product_attention(q, k, v, **common)
    else:
        offsets, lengths = segment_offsets(segment_ids, max_segments)
        # The call's partitioner hands every operand to the per-device program with its own
        # sharding, and jax there reads offsets/lengths as describing the local rows of q. They
        # must therefore be split over batch exactly like q; say so rather than leave it to
        # propagation.
        offsets = constrain(offsets, ("batch", None))
        lengths = constrain(lengths, ("batch", None))
        out = fa.dot_product_attention(
            q, k, v, q_seqlen=lengths, kv_seqlen=lengths, q_offsets=offsets, kv_offsets=offsets, **common
        )
    return poison_overflow(out, segment_ids, max_segments) if poison else out


def poison_overflow(out, segment_ids, max_segments: int):
    """out [B, T, ...] with the rows that hold more than `max_segments` documents set to NaN:
    their attention saw only the first `max_segments` documents, so it must not pass for a
    result."""
    overflow = documents_per_row(segment_ids) > max_segments
    overflow = overflow.reshape(overflow.shape + (1,) * (out.ndim - 1))
    return jnp.where(overflow, jnp.array(jnp.nan, out.dtype), out)


def _check_shapes(q, k, v, segment_ids):
    if q.ndim != 4 or k.shape != v.shape or k.ndim != 4:
        raise ValueError(
            f"attend: q [B,T,N,H] and k, v [B,T,K,H] expected, got {q.shape}, {k.shape}, {v.shape}"
        )
    (b, t, n, h), (kb, kt, kn, kh) = q.shape, k.shape
    if (kb, kt, kh) != (b, t, h) or n % kn:
        raise ValueError(f"attend: k/v {k.shape} do not match q {q.shape} (K heads must divide N)")
    if segment_ids is not None and segment_ids.shape != (b, t):
        raise ValueError(f"attend: segment_ids {segment_ids.shape} should be {(b, t)}")


def _check_cudnn(q, k):
    if not (q.dtype == k.dtype and q.dtype in (jnp.bfloat16, jnp.float16)):
        raise ValueError(
            f"attend(implementation='cudnn') takes bfloat16 or float16 q/k/v, got "
            f"{q.dtype}/{k.dtype} (set model.dtype, or use 'xla')"
        )
    h = q.shape[-1]
    if h % 8 or h > 256:
        raise ValueError(
            f"attend(implementation='cudnn'): head_dim must be a multiple of 8 and at most 256, got {h}"
        )


def _local_shape(shape, names):
    """The per-device shape of an activation with these logical names under the current mesh
    and rules (`jaxpar.sharding.constrain`'s contexts); the whole shape outside them."""
    scope = current_scope()
    if scope is None:
        return tuple(shape)
    mesh, rules = scope
    return NamedSharding(mesh, logical_to_spec(names, rules, mesh)).shard_shape(tuple(shape))


# --- Compiling for a GPU that is not here -----------------------------------------------------


@contextlib.contextmanager
def assume_compute_capability(capability: str):
    """Trace the cuDNN path as if the default backend were a GPU of this compute capability
    (e.g. "9.0" for an H100).

    jax decides whether the packed form (and head_dim up to 256) is supported by asking the
    *default* backend's first device for its compute capability; on a CPU-only host compiling
    for compile-only GPU devices (`jaxpar.compiled.targets`) there is none, and the packed call is refused
    as "requires Hopper". Inside this block jax's two capability queries answer for `capability`
    instead. Use it only around lowering for such devices; a real GPU answers for itself."""
    fa = _fused()
    target = tuple(int(x) for x in capability.split("."))

    def at_least(c):
        return target >= tuple(int(x) for x in c.split("."))

    def equal(c):
        return target == tuple(int(x) for x in c.split("."))

    saved = fa.check_compute_capability, fa.is_cuda_compute_capability_equal
    fa.check_compute_capability, fa.is_cuda_compute_capability_equal = at_least, equal
    try:
        yield
    finally:
        fa.check_compute_capability, fa.is_cuda_compute_capability_equal = saved
