"""Cross-entropy of the language-model head without a full float32 [tokens, vocab] logits buffer.

The plain head computes logits = h @ W for every token at once: a float32 [batch, seq, vocab]
array that, with a large vocabulary, is often the biggest activation of the whole train step,
and autodiff keeps it (or the softmax made from it) alive until the backward pass.

`chunked_cross_entropy` instead walks over the tokens in `chunks` pieces with `jax.lax.scan`.
Each piece's body is wrapped in `jax.checkpoint`, so the only thing the scan saves for the
backward pass is the piece's inputs (the hidden states, targets and mask, which exist anyway);
the backward recomputes the piece's logits. At any moment only one piece's float32 logits (and
its gradient) are alive: [batch, seq / chunks, vocab] instead of [batch, seq, vocab]. The price
is one more head matmul per token (the recomputation in the backward).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

FLOAT32_BYTES = 4


def _strided_chunks(x, chunks: int):
    """[batch, seq, ...] -> [chunks, batch, seq / chunks, ...], token t going to chunk t % chunks.

    Under context parallelism the sequence axis is cut into contiguous blocks, one per device.
    Contiguous chunks would line up with those blocks: each chunk would sit on one device, and
    scanning over them means either the other devices idle or (what GSPMD actually compiles)
    every device all-gathers the hidden states first. With a stride, the row index t // chunks
    keeps the order of the blocks, so each device holds its own slice of every chunk (when
    seq / chunks is a multiple of the number of blocks), every device works on every step of
    the scan, and the only collectives left are the sums over a sharded vocab.
    """
    batch, seq = x.shape[:2]
    x = jnp.moveaxis(x.reshape(batch, seq // chunks, chunks, *x.shape[2:]), 2, 0)
    # On a mesh with explicit axes, the reshape carries the sequence sharding onto the chunk axis
    # when seq / chunks is not a multiple of the number of sequence shards; scan needs that axis
    # whole, so gather it (slower, still correct). Auto-axis (GSPMD) meshes report no spec here.
    sharding = jax.typeof(x).sharding
    if sharding.spec and sharding.spec[0] is not None:
        x = jax.sharding.reshard(x, NamedSharding(sharding.mesh, P(None, *sharding.spec[1:])))
    return x


def chunked_cross_entropy(h, weight, targets, mask, *, dtype, chunks: int):
    """Summed next-token negative log-likelihood over unmasked tokens, and their count.

    h: [batch, seq, embed] hidden states, already through the final norm.
    weight: [embed, vocab] output projection (normally the float32 parameter); it is cast to
        `dtype` for the matmul, whose products are accumulated and returned in float32.
    targets: int [batch, seq] next-token ids. mask: float [batch, seq] per-token weights.
    dtype: the matmul input dtype (the model dtype, e.g. bfloat16).
    chunks: how many pieces the sequence is split into; must divide seq. 1 means one piece (the
        whole sequence at once, still through the same code path).

    Returns (sum over tokens of mask * nll, float32 scalar; sum(mask)): the summed next-token
    negative log-likelihood of logits = h.astype(dtype) @ weight.astype(dtype), accumulated in
    float32, as a log_softmax over all the logits at once would give it.

    Gradients with respect to h and weight come from autodiff through the scan. The weight is
    cast to `dtype` inside each checkpointed piece, so the weight gradient is summed over the
    pieces in float32 (the scan's accumulator has the dtype of `weight`, not of the cast copy).

    The per-token NLL is logsumexp(logits) - logits[target], the target logit taken by comparing
    a vocabulary iota with the target rather than by a gather: only elementwise operations and
    reductions over vocab, which GSPMD partitions directly when vocab is sharded over `tensor`
    (a cross-device sum of partial results, no gathering of logits).
    """
    batch, seq, _ = h.shape
    if chunks < 1 or seq % chunks:
        raise ValueError(f"chunks={chunks} must be a positive divisor of the sequence length {seq}")
    if targets.shape != (batch, seq) or mask.shape != (batch, seq):
        raise ValueError(f"targets {targets.shape} and mask {mask.shape} must be [batch, seq] = "
                         f"{(batch, seq)}")

    @jax.checkpoint
    def piece_nll(weight, h_c, targets_c, mask_c):
        # h_c: [batch, seq / chunks, embed]; the float32 logits below are the peak buffer.
        logits = jnp.einsum("bse,ev->bsv", h_c.astype(dtype), weight.astype(dtype),
                            preferred_element_type=jnp.float32)
        lse = jax.nn.logsumexp(logits, axis=-1)
        vocab_ids = jax.lax.broadcasted_iota(targets_c.dtype, logits.shape, 2)
        target_logit = jnp.sum(jnp.where(vocab_ids == targets_c[..., None], logits, 0.0), axis=-1)
        return jnp.sum((lse - target_logit) * mask_c)

    def step(total, piece):
        return total + piece_nll(weight, *piece), None

    pieces = tuple(_strided_chunks(x, chunks) for x in (h, targets, mask))
    total, _ = jax.lax.scan(step, jnp.zeros((), jnp.float32), pieces)
    return total, jnp.sum(mask)


def pick_chunks(seq: int, tokens_per_device: int, vocab_per_device: int,
                budget_bytes: int = 256 * 2**20, seq_shards: int = 1) -> int:
    """The smallest number of chunks for `chunked_cross_entropy` whose per-chunk float32 logits
    fit in `budget_bytes` on one device.

    seq: the (global) sequence length; the result always divides it.
    tokens_per_device: batch * seq tokens that one device holds (after data/fsdp/context splits).
    vocab_per_device: vocabulary columns per device (vocab / tensor when vocab is sharded).
    seq_shards: how many devices split the sequence axis of h (context, times tensor with
        sequence parallelism); the count is
        chosen so that seq / chunks stays a multiple of it, keeping each chunk evenly split.

    One chunk's logits take tokens_per_device / chunks * vocab_per_device * 4 bytes; the backward
    briefly holds about as much again for their gradient, so the budget is the size of one copy.
    If no divisor fits, the finest valid split is returned.
    """
    if seq < 1 or seq % seq_shards:
        raise ValueError(f"seq={seq} must be a positive multiple of seq_shards={seq_shards}")
    full = tokens_per_device * vocab_per_device * FLOAT32_BYTES
    small = [d for d in range(1, math.isqrt(seq) + 1) if seq % d == 0]
    divisors = sorted(set(small + [seq // d for d in small]))
    valid = [c for c in divisors if (seq // c) % seq_shards == 0]
    for c in valid:
        if full / c <= budget_bytes:
            return c
    return valid[-1]
