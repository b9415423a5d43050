"""Cross-entropy of the language-model head without a full float32 [tokens, vocab] logits buffer.

The plain head computes logits = h @ W for every token at once: a float32 [batch, seq, vocab]
array that, with a large vocabulary, is often the biggest activation of the whole train step,
and autodiff keeps it (or the softmax made from it) alive until the backward pass.

`chunked_cross_entropy` instead walks over the tokens in `chunks` pieces with `jax.lax.scan`,
forward and backward, keeping nothing per piece for the backward but its inputs (the hidden
states, targets and mask, which exist anyway): the backward recomputes each piece's logits. At
any moment only one piece's float32 logits (and their gradient) are alive: [batch, seq / chunks,
vocab] instead of [batch, seq, vocab]. The price is one more head matmul per token.

The output weight is the other large thing here. The loss casts it to the model dtype and
gathers it whole (over the data-like axes, under ZeRO-3) once per step, before the chunk loop;
its gradient is summed over the pieces in float32 on each device and reduced across devices
once, after the loop, in parallel.grad_reduce_dtype. Left to autodiff through a checkpointed
scan, every piece gathered the weight forward, again to recompute and again backward, and
reduce-scattered a whole float32 weight gradient (16 chunks of Llama-3.2-1B on 8 H100s: 48
gathers and 16 reduce-scatters of the 128256 x 2048 weight per step).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

# The rule of which axes a constraint may name (Auto ones) is the sharding module's own.
from jaxpar.config import Config
from jaxpar.sharding import _free_auto_axes, constrain, current_scope

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


def _unstrided(x):
    """The inverse of `_strided_chunks`: [chunks, batch, seq / chunks, ...] -> [batch, seq, ...]."""
    chunks, batch, rows = x.shape[:3]
    return jnp.moveaxis(x, 0, 2).reshape(batch, rows * chunks, *x.shape[3:])


def chunked_cross_entropy(h, weight, targets, mask, *, dtype, chunks: int, grad_dtype=None):
    """Summed next-token negative log-likelihood over unmasked tokens, and their count.

    h: [batch, seq, embed] hidden states, already through the final norm.
    weight: [embed, vocab] output projection (normally the float32 parameter); it is cast to
        `dtype` for the matmuls, whose products are accumulated in float32.
    targets: int [batch, seq] next-token ids. mask: float [batch, seq] per-token weights (not
        differentiated: its cotangent is zero).
    dtype: the matmul operand dtype (the model dtype, e.g. bfloat16).
    chunks: how many pieces the sequence is split into; must divide seq. 1 means one piece (the
        whole sequence at once, still through the same code path).
    grad_dtype: the dtype the weight gradient is reduced across devices in
        (parallel.grad_reduce_dtype; None: float32), then cast to the weight's.

    Returns (sum over tokens of mask * nll, float32 scalar; sum(mask)): the summed next-token
    negative log-likelihood of logits = h.astype(dtype) @ weight.astype(dtype), accumulated in
    float32, as a log_softmax over all the logits at once would give it.

    The weight is cast to `dtype` and gathered whole (over the data-like axes; vocab stays split
    over `tensor`) once, before the chunk loop, and kept for the backward. The backward is
    written out (`_summed_nll_bwd`): each chunk's logits are recomputed, the gradient of the
    logits is rounded to `dtype`, and both gradient GEMMs take `dtype` operands with float32
    accumulation. The weight gradient is summed over the chunks in float32 on each device, for
    its own rows, and reduced across devices once, after the loop: under ZeRO-3 one all-gather
    and one reduce-scatter of the weight per step, whatever the number of chunks.
    """
    batch, seq, _ = h.shape
    if chunks < 1 or seq % chunks:
        raise ValueError(f"chunks={chunks} must be a positive divisor of the sequence length {seq}")
    if targets.shape != (batch, seq) or mask.shape != (batch, seq):
        raise ValueError(
            f"targets {targets.shape} and mask {mask.shape} must be [batch, seq] = {(batch, seq)}"
        )
    # The weight gradient's partial sums are kept apart per device holding a part of the rows:
    # [batch parts, seq parts, embed, vocab], each device one [embed, vocab] slice.
    parts = tuple(
        n if size % n == 0 else 1
        for n, size in ((_axis_shards("batch"), batch), (_axis_shards("seq"), seq // chunks))
    )
    grad_dtype = jnp.dtype(grad_dtype or jnp.float32)
    total = _summed_nll(h, weight, targets, mask, jnp.dtype(dtype), chunks, parts, grad_dtype)
    return total, jnp.sum(mask)


def _axis_shards(name: str) -> int:
    """How many devices split logical axis `name` under the current mesh and rules, counting the
    axes `jaxpar.sharding.constrain` may name (Auto, size > 1); 1 outside such a scope."""
    scope = current_scope()
    if scope is None:
        return 1
    mesh, rules = scope
    free = _free_auto_axes(mesh)
    return math.prod(mesh.shape[axis] for axis in rules.get(name, ()) if axis in free)


def _token_nll(logits, targets):
    """logsumexp(logits) - logits[target] per token, float32 [batch, seq]. The target logit is
    taken by comparing a vocabulary iota with the target rather than by a gather: elementwise
    operations and reductions over vocab only, which GSPMD partitions directly when vocab is
    sharded over `tensor` (a cross-device sum of partial results, no gathering of logits)."""
    vocab_ids = jax.lax.broadcasted_iota(targets.dtype, logits.shape, 2)
    target_logit = jnp.sum(jnp.where(vocab_ids == targets[..., None], logits, 0.0), axis=-1)
    return jax.nn.logsumexp(logits, axis=-1) - target_logit


def _logits(h_c, w):
    """[batch, s, embed] x [embed, vocab] in w's dtype, accumulated in float32."""
    return jnp.einsum("bse,ev->bsv", h_c.astype(w.dtype), w, preferred_element_type=jnp.float32)


def _typed_mesh(x):
    """The mesh of x's type when its axes are Explicit (arrays carry their sharding in their
    type), else None."""
    mesh = getattr(jax.typeof(x).sharding, "mesh", None)
    if mesh is None or mesh.empty or AxisType.Explicit not in mesh.axis_types:
        return None
    return mesh


def _typed_out(x, spec) -> dict:
    """`out_sharding` for a contraction over sharded dims where JAX asks for it (x's mesh has
    Explicit axes); {} on other meshes, where GSPMD places the result."""
    mesh = _typed_mesh(x)
    return {} if mesh is None else {"out_sharding": NamedSharding(mesh, spec)}


def _split_rows(x, parts: tuple[int, int]):
    """[batch, s, ...] -> [batch parts, batch / parts, seq parts, s / parts, ...]."""
    (nb, ns), (batch, s) = parts, x.shape[:2]
    return x.reshape(nb, batch // nb, ns, s // ns, *x.shape[2:])


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7))
def _summed_nll(h, weight, targets, mask, dtype, chunks, parts, grad_dtype):
    return _summed_nll_fwd(h, weight, targets, mask, dtype, chunks, parts, grad_dtype)[0]


def _summed_nll_fwd(h, weight, targets, mask, dtype, chunks, parts, grad_dtype):
    # The output weight in `dtype`, whole over the data-like axes (vocab stays split over
    # `tensor`): under ZeRO-3 this is the step's one all-gather of it; the backward reuses it.
    w = constrain(jax.lax.optimization_barrier(weight.astype(dtype)), (None, "vocab"))

    def step(total, piece):
        h_c, targets_c, mask_c = piece
        return total + jnp.sum(_token_nll(_logits(h_c, w), targets_c) * mask_c), None

    pieces = tuple(_strided_chunks(x, chunks) for x in (h, targets, mask))
    total, _ = jax.lax.scan(step, jnp.zeros((), jnp.float32), pieces)
    # The loss value feeds only the step's metrics, and XLA:GPU's scheduler ran this loop last,
    # after the layers' backward, keeping `w` alive through it (Llama-3.2-1B, 8 H100s: 0.5 GB).
    # The barrier makes the backward's use of `w` wait for the loop.
    total, w = jax.lax.optimization_barrier((total, w))
    return total, (h, w, targets, mask, jnp.zeros((), weight.dtype))


def _summed_nll_bwd(dtype, chunks, parts, grad_dtype, residuals, g):
    """Per chunk: the logits again, d nll / d logits = softmax - onehot (times the mask and g),
    rounded to `dtype`; d/dh and the weight gradient from GEMMs on `dtype` operands accumulated
    in float32. The weight gradient is summed over chunks in float32 per part of the token rows
    (`parts`: the devices the batch and sequence are split over), so no device needs another's
    partial sums inside the loop; the one sum over parts after it is the weight gradient's one
    reduce-scatter (or all-reduce, where the gradient is kept whole), in `grad_dtype`."""
    h, w, targets, mask, weight_zero = residuals

    def step(grad_parts, piece):
        h_c, targets_c, mask_c = piece
        logits = _logits(h_c, w)
        onehot = jax.lax.broadcasted_iota(targets_c.dtype, logits.shape, 2) == targets_c[..., None]
        d_logits = (jax.nn.softmax(logits, axis=-1) - onehot) * (g * mask_c)[..., None]
        d_logits = constrain(d_logits.astype(w.dtype), ("batch", "seq", "vocab"))
        d_h = jnp.einsum(
            "bsv,ev->bse",
            d_logits,
            w,
            preferred_element_type=jnp.float32,
            **_typed_out(h_c, jax.typeof(h_c).sharding.spec),
        )
        rows, d_rows = _split_rows(h_c.astype(w.dtype), parts), _split_rows(d_logits, parts)
        vocab_spec = P(None, None, None, *jax.typeof(d_logits).sharding.spec[2:])
        grad_parts = grad_parts + jnp.einsum(
            "mbnse,mbnsv->mnev",
            rows,
            d_rows,
            preferred_element_type=jnp.float32,
            **_typed_out(h_c, vocab_spec),
        )
        return grad_parts, d_h.astype(h.dtype)

    pieces = tuple(_strided_chunks(x, chunks) for x in (h, targets, mask))
    names = ("batch" if parts[0] > 1 else None, "seq" if parts[1] > 1 else None, None, "vocab")
    zeros = constrain(jnp.zeros(parts + w.shape, jnp.float32), names)
    grad_parts, d_h = jax.lax.scan(step, zeros, pieces)
    d_h = _unstrided(d_h)
    if _typed_mesh(h) is not None:  # a type that carries a sharding must come back as it came
        d_h = jax.sharding.reshard(d_h, jax.typeof(h).sharding)
    # The sum over parts as a contraction with ones that writes `grad_dtype`, so that the
    # cross-device sum it becomes moves that dtype. Not jnp.sum: it adds bfloat16 in float32
    # and rounds after (a float32 reduce-scatter); nor a bfloat16 lax.reduce, which stopped
    # XLA:CPU's compiler with a failed check in a pipelined layout (jax 0.12.0.1).
    ones = jnp.ones(parts, grad_dtype)
    d_weight = jnp.einsum(
        "mnev,mn->ev",
        grad_parts.astype(grad_dtype),
        ones,
        preferred_element_type=grad_dtype,
        **_typed_out(h, P(*jax.typeof(grad_parts).sharding.spec[2:])),
    ).astype(weight_zero.dtype)
    # The layers' backward (which takes d_h) waits for the weight gradient's reduction: left to
    # itself, XLA:GPU's scheduler reduced it after them, keeping the float32 partial sums alive
    # through the whole backward (1B, 8 H100s: temp 9.34 GB without the two barriers, 8.42 with).
    d_h, d_weight = jax.lax.optimization_barrier((d_h, d_weight))
    return d_h, d_weight, None, None


_summed_nll.defvjp(_summed_nll_fwd, _summed_nll_bwd)


def pick_chunks(
    seq: int,
    tokens_per_device: int,
    vocab_per_device: int,
    budget_bytes: int = 256 * 2**20,
    seq_shards: int = 1,
) -> int:
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


def loss_chunks(cfg: Config, sizes: dict[str, int], rows: int | None = None) -> int:
    """train.loss_chunks, or (0 = auto) the fewest sequence chunks whose float32 logits stay
    within 256 MiB per device (`pick_chunks`) on a mesh of `sizes`. `rows`: the batch rows the
    loss sees at once (a pipeline microbatch), default the whole batch."""
    t = cfg.train
    if t.loss_chunks:
        return t.loss_chunks
    # The hidden states' sequence is split over context (and tensor with sequence parallelism),
    # the output weight's vocabulary over tensor; one axis cannot split both dims of the logits,
    # so a device holds at least tokens / context by vocab / tensor of them.
    seq_shards = sizes["context"] * (sizes["tensor"] if cfg.parallel.sequence_parallel else 1)
    rows = (rows or t.batch_size // cfg.parallel.grad_accum) // (
        sizes["data"] * sizes["fsdp"] * sizes["expert"]
    )
    return pick_chunks(
        t.seq_len,
        max(rows, 1) * t.seq_len // sizes["context"],
        cfg.model.vocab_size // sizes["tensor"],
        seq_shards=seq_shards,
    )
