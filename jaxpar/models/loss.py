"""Cross-entropy of the language-model head without a full float32 [tokens, vocab] logits buffer.

The plain head computes logits = h @ W for every token at once: a float32 [batch, seq, vocab]
array that, with a large vocabulary, is often the biggest activation of the whole train step,
and autodiff keeps it (or the softmax made from it) alive until the backward pass.

`chunked_cross_entropy` writes the forward and the backward out (a custom VJP), in one of two
ways:

- One piece (chunks = 1): the forward computes the logits once (one GEMM, float32 out), their
  logsumexp and the loss (two reads of the float32 logits), and d_logits = (softmax - onehot) *
  mask, the gradient of the loss with respect to the logits, rounded to the matmul dtype (a
  third read, fused with taking the target's logit). It keeps d_logits ([batch, seq, vocab],
  bfloat16 for a bfloat16 model) for the backward; the float32 logits die in the forward. The
  backward is two GEMMs, d_h = d_logits @ W^T and the weight gradient h^T @ d_logits, the
  cotangent applied to d_h's float32 product and to h's rows (a [tokens, embed] pass, not a
  vocab-wide one). Memory: float32 logits and d_logits at once, 6 bytes a logit in bfloat16.
- `chunks` > 1 pieces of the vocabulary (for logits that would not fit): the forward walks the
  pieces with `jax.lax.scan` (one GEMM and two reads of the piece's float32 logits each),
  combining each piece's logsumexp into a running one, and keeps only the per-token logsumexp
  ([batch, seq] float32) for the backward. The backward walks the pieces again: it recomputes
  each piece's logits (the one extra head GEMM of this way), takes softmax - onehot of them
  against the saved logsumexp, adds the piece's share of d_h into a float32 [batch, seq, embed]
  accumulator, and writes the piece's columns of the weight gradient once, as a scan output.
  No [embed, vocab] buffer is read and rewritten per piece; the accumulator of d_h is (tokens
  per device x embed, much less than embed x vocab whenever a device holds fewer tokens than
  the vocabulary has columns). One piece's float32 logits are alive at a time, [batch, seq,
  vocab / pieces]. Besides the pieces' work: one copy of the weight into the pieces' order
  (model dtype, [pieces, embed, tensor, vocab / (tensor * pieces)]) and one of the weight
  gradient back (grad dtype), per step.

Where the vocabulary is split over devices (the `tensor` axis), each device's own columns are
cut into the pieces (`_vocab_pieces`), so every device works on every piece; a piece's
logsumexp and d_h are partial over each device's columns, kept apart per device (a dim over
`tensor`) until one combination after the loop: no collective per piece. The sequence is not
cut: hidden states split over `context` stay so, and over `tensor` (sequence parallelism) they
are gathered once, before the loop.

Measured with the ruler (`python -m jaxpar.inspect CONFIG --target h100 --kernels`, one H100,
jax 0.12.0.1): the loss's kernels of GPT-2 124M (12 x 1024 tokens) take 7.0 ms in one piece and
9.2 ms in 12; of Llama-3.2-1B (8 x 2048 tokens) 45.8 ms in one piece and 60.9 ms in 32. Chunking
the tokens instead, with a float32 [embed, vocab] weight gradient read and rewritten by every
chunk and the logits recomputed even in one chunk, they took 13.2 ms (GPT-2, 16 chunks) and
83.0 ms (the 1B, 32 chunks).

The output weight is the other large thing here. The loss casts it to the model dtype and
gathers it whole (over the data-like axes, under ZeRO-3) once per step, before the loop; its
gradient's partial sums are kept per device holding a part of the token rows, written in
parallel.grad_reduce_dtype by the GEMMs, and reduced across devices once, after the loop.
Left to autodiff through a checkpointed scan, every piece gathered the weight forward, again
to recompute and again backward, and reduce-scattered a whole float32 weight gradient (16
chunks of Llama-3.2-1B on 8 H100s: 48 gathers and 16 reduce-scatters of the 128256 x 2048
weight per step).
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
# The float32 logits of one piece, where the device's memory is not known (CPU devices).
DEFAULT_BUDGET = 256 * 2**20
# Where it is known: whole float32 logits up to this share of the memory a program may use are
# computed in one piece (which, at its peak, also holds their gradient in the matmul dtype).
LOGITS_SHARE = 1 / 6


def chunked_cross_entropy(h, weight, targets, mask, *, dtype, chunks: int, grad_dtype=None):
    """Summed next-token negative log-likelihood over unmasked tokens, and their count.

    h: [batch, seq, embed] hidden states, already through the final norm.
    weight: [embed, vocab] output projection (normally the float32 parameter); it is cast to
        `dtype` for the matmuls, whose products are accumulated in float32.
    targets: int [batch, seq] next-token ids. mask: float [batch, seq] per-token weights (not
        differentiated: its cotangent is zero).
    dtype: the matmul operand dtype (the model dtype, e.g. bfloat16).
    chunks: how many pieces the vocabulary (each device's share of it) is cut into, at least:
        the smallest divisor of the vocabulary per device not below `chunks` (`vocab_pieces`).
        1: the whole logits at once, and no recomputation (module docstring).
    grad_dtype: the dtype the weight gradient's GEMMs write and its cross-device sum moves
        (parallel.grad_reduce_dtype; None: float32), then cast to the weight's.

    Returns (sum over tokens of mask * nll, float32 scalar; sum(mask)): the summed next-token
    negative log-likelihood of logits = h.astype(dtype) @ weight.astype(dtype), accumulated in
    float32, as a log_softmax over all the logits at once would give it.

    Both gradient GEMMs take `dtype` operands (the gradient of the logits rounded to `dtype`)
    with float32 accumulation. The weight gradient is reduced across devices once, after the
    loop: under ZeRO-3 one all-gather and one reduce-scatter of the weight per step, whatever
    the number of pieces.
    """
    batch, seq, _ = h.shape
    if chunks < 1:
        raise ValueError(f"chunks={chunks} must be a positive number of vocabulary pieces")
    if targets.shape != (batch, seq) or mask.shape != (batch, seq):
        raise ValueError(
            f"targets {targets.shape} and mask {mask.shape} must be [batch, seq] = {(batch, seq)}"
        )
    vocab = weight.shape[1]
    tensor = _shards(weight, 1, "vocab")
    tensor = tensor if vocab % tensor == 0 else 1
    # The weight gradient's partial sums are kept apart per device holding a part of the rows:
    # [batch parts, seq parts, embed, vocab], each device one [embed, vocab] slice.
    parts = tuple(
        n if size % n == 0 else 1
        for n, size in ((_shards(h, 0, "batch"), batch), (_shards(h, 1, "seq"), seq))
    )
    pieces = vocab_pieces(vocab // tensor, chunks)
    grad_dtype = jnp.dtype(grad_dtype or jnp.float32)
    layout = (pieces, tensor, parts)
    total = _summed_nll(h, weight, targets, mask, jnp.dtype(dtype), layout, grad_dtype)
    return total, jnp.sum(mask)


def _divisors(n: int) -> list[int]:
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


def vocab_pieces(vocab_per_device: int, chunks: int) -> int:
    """The pieces `chunked_cross_entropy` cuts each device's vocabulary into for `chunks`: the
    smallest divisor of vocab_per_device not below chunks (all of it when chunks exceeds it)."""
    return next((d for d in _divisors(vocab_per_device) if d >= chunks), vocab_per_device)


def _axis_shards(name: str) -> int:
    """How many devices split logical axis `name` under the current mesh and rules, counting the
    axes `jaxpar.sharding.constrain` may name (Auto, size > 1); 1 outside such a scope."""
    scope = current_scope()
    if scope is None:
        return 1
    mesh, rules = scope
    free = _free_auto_axes(mesh)
    return math.prod(mesh.shape[axis] for axis in rules.get(name, ()) if axis in free)


def _spec(x, dim: int):
    """The mesh axes dim `dim` of x's type is split over (None when not, or not typed)."""
    spec = jax.typeof(x).sharding.spec
    return spec[dim] if dim < len(spec) else None


def _shards(x, dim: int, name: str) -> int:
    """How many devices split dim `dim` of x: from x's type on a mesh with Explicit axes, else
    those of logical axis `name` under the current rules (`_axis_shards`)."""
    mesh = _typed_mesh(x)
    if mesh is None:
        return _axis_shards(name)
    axes = _spec(x, dim)
    axes = () if axes is None else (axes,) if isinstance(axes, str) else axes
    return math.prod(mesh.shape[a] for a in axes)


def _typed_mesh(x):
    """The mesh of x's type when its axes are Explicit (arrays carry their sharding in their
    type), else None."""
    mesh = getattr(jax.typeof(x).sharding, "mesh", None)
    if mesh is None or mesh.empty or AxisType.Explicit not in mesh.axis_types:
        return None
    return mesh


def _reshape(x, shape, spec):
    """x.reshape(shape); on a mesh with Explicit axes, which asks where a split or merged
    sharded dim goes, laid out as `spec` (the sharding on a split dim's major part)."""
    if _typed_mesh(x) is None:
        return x.reshape(shape)
    return jax.lax.reshape(x, shape, out_sharding=NamedSharding(_typed_mesh(x), spec))


def _typed_out(x, spec) -> dict:
    """`out_sharding` for a contraction over sharded dims where JAX asks for it (x's mesh has
    Explicit axes); {} on other meshes, where GSPMD places the result."""
    mesh = _typed_mesh(x)
    return {} if mesh is None else {"out_sharding": NamedSharding(mesh, spec)}


def _laid_out(x, names, like, spec):
    """x constrained by logical `names` (Auto axes), or on a mesh with Explicit axes (that of
    `like`'s type) resharded to `spec`: a loop carry must come out of the loop body as it went
    in."""
    mesh = _typed_mesh(like)
    if mesh is None:
        return constrain(x, names)
    return jax.sharding.reshard(x, NamedSharding(mesh, spec))


def _vocab_pieces(w, pieces: int, tensor: int):
    """[embed, vocab] -> [pieces, embed, tensor, vocab / (tensor * pieces)]: each of the `tensor`
    devices' contiguous vocabulary cut into `pieces` contiguous runs, piece c holding run c of
    every device. Vocabulary id of [c, :, t, j]: (t * pieces + c) * (vocab / (tensor * pieces))
    + j. With one piece, a reshape without a copy."""
    embed, vocab = w.shape
    shape = (embed, tensor, pieces, vocab // (tensor * pieces))
    return jnp.moveaxis(_reshape(w, shape, P(_spec(w, 0), _spec(w, 1), None, None)), 2, 0)


def _from_pieces(x):
    """The inverse of `_vocab_pieces` on the leading and two last dims: [pieces, ..., tensor,
    run] -> [..., vocab]."""
    x = jnp.moveaxis(x, 0, -2)
    spec = P(*(_spec(x, i) for i in range(x.ndim - 3)), _spec(x, x.ndim - 3))
    return _reshape(x, (*x.shape[:-3], math.prod(x.shape[-3:])), spec)


def _onehot(logits_shape, targets, piece, pieces: int):
    """bool [batch, s, tensor, run]: which column of piece `piece` (`_vocab_pieces`) is each
    token's target. An iota compared with the target, not a gather: elementwise operations
    that GSPMD partitions directly where the vocabulary is split."""
    run = logits_shape[-1]
    t = jax.lax.broadcasted_iota(targets.dtype, logits_shape, 2)
    j = jax.lax.broadcasted_iota(targets.dtype, logits_shape, 3)
    return (t * pieces + piece) * run + j == targets[..., None, None]


def _logits(x, w_c):
    """[batch, s, embed] x [embed, tensor, run] in w's dtype, accumulated in float32."""
    return jnp.einsum("bse,etv->bstv", x, w_c, preferred_element_type=jnp.float32)


def _lse(logits, axes):
    return jax.nn.logsumexp(logits, axis=axes)


def _run_lse_and_target(logits, onehot):
    """(logsumexp, the target's logit) of [batch, s, tensor, run] logits over the run (the last
    dim): two reads of the logits, the max and the target's logit taken by one variadic
    reduction (as two, XLA:GPU read the logits for each), the sum of exponentials by another."""
    hit = jnp.where(onehot, logits, 0.0)
    start = (jnp.array(-jnp.inf, logits.dtype), jnp.array(0, logits.dtype))
    top, target = jax.lax.reduce(
        (logits, hit), start, lambda a, b: (jnp.maximum(a[0], b[0]), a[1] + b[1]), (3,)
    )
    return top + jnp.log(jnp.sum(jnp.exp(logits - top[..., None]), axis=3)), target


def _d_logits(logits, lse, onehot, scale, dtype):
    """(softmax - onehot) * scale per token, from the logits and their logsumexp, in `dtype`."""
    p = jnp.exp(logits - lse[..., None, None])
    d = ((p - onehot) * scale[..., None, None]).astype(dtype)
    return constrain(d, ("batch", "seq", "vocab", None))


def _split_rows(x, parts: tuple[int, int]):
    """[batch, s, ...] -> [batch parts, batch / parts, seq parts, s / parts, ...]."""
    (nb, ns), (batch, s) = parts, x.shape[:2]
    spec = P(_spec(x, 0), None, _spec(x, 1), None, *(_spec(x, i) for i in range(2, x.ndim)))
    return _reshape(x, (nb, batch // nb, ns, s // ns, *x.shape[2:]), spec)


def _weight_grad(x, d, parts, grad_dtype):
    """x^T @ d per part of the token rows, written in grad_dtype: [batch parts, seq parts,
    embed, tensor, run], each device its own part (no cross-device sum)."""
    rows, d_rows = _split_rows(x, parts), _split_rows(d, parts)
    spec = P(_spec(rows, 0), _spec(rows, 2), None, _spec(d_rows, 4), None)
    grad = jnp.einsum(
        "mbnse,mbnstv->mnetv", rows, d_rows, preferred_element_type=grad_dtype, **_typed_out(x, spec)
    )
    names = ("batch" if parts[0] > 1 else None, "seq" if parts[1] > 1 else None, None, "vocab", None)
    return constrain(grad, names)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _summed_nll(h, weight, targets, mask, dtype, layout, grad_dtype):
    return _summed_nll_fwd(h, weight, targets, mask, dtype, layout, grad_dtype)[0]


def _summed_nll_fwd(h, weight, targets, mask, dtype, layout, grad_dtype):
    pieces, tensor, _ = layout
    # The output weight in `dtype`, whole over the data-like axes (vocab stays split over
    # `tensor`): under ZeRO-3 this is the step's one all-gather of it; the backward reuses it.
    w = constrain(jax.lax.optimization_barrier(weight.astype(dtype)), (None, "vocab"))
    w = constrain(_vocab_pieces(w, pieces, tensor), (None, None, "vocab", None))
    # The rows in `dtype`, the sequence split over `seq`'s axes only (under sequence
    # parallelism h's is split over `tensor` too, which splits the vocabulary here): gathered
    # once, here, not per piece.
    x = constrain(h.astype(dtype), ("batch", "seq", None))
    if pieces == 1:
        logits = _logits(x, w[0])
        onehot = _onehot(logits.shape, targets, 0, 1)
        lse = _lse(logits, (2, 3))
        nll = lse - jnp.sum(jnp.where(onehot, logits, 0.0), axis=(2, 3))
        kept = _d_logits(logits, lse, onehot, mask, dtype)  # the backward's d_logits, without g
    else:
        kept, target = _piecewise_lse(x, w, targets, pieces)
        nll = kept - target  # kept: the per-token logsumexp
    total = jnp.sum(nll * mask)
    # The loss value feeds only the step's metrics, and XLA:GPU's scheduler ran its (chunked)
    # forward last, after the layers' backward, keeping `w` alive through it (Llama-3.2-1B, 8
    # H100s: 0.5 GB). The barrier makes the backward's use of `w` and `kept` wait for the loss.
    total, w, kept = jax.lax.optimization_barrier((total, w, kept))
    return total, (x, w, kept, targets, mask, jnp.zeros((), weight.dtype), jnp.zeros((), h.dtype))


def _piecewise_lse(x, w, targets, pieces: int):
    """The forward over the vocabulary's pieces: (logsumexp of each token's logits, its target's
    logit), float32 [batch, seq]. Both are kept per device of the vocabulary's split inside the
    loop ([batch, seq, tensor]: each device its own columns' logsumexp, combined with a running
    one) and summed over devices once after it: no cross-device sum per piece."""
    batch, seq, _ = x.shape

    def step(carry, piece):
        lse, target = carry
        w_c, c = piece
        logits = _logits(x, w_c)
        lse_c, target_c = _run_lse_and_target(logits, _onehot(logits.shape, targets, c, pieces))
        return (jnp.logaddexp(lse, lse_c), target + target_c), None

    zeros = jnp.zeros((batch, seq, w.shape[2]), jnp.float32)
    zeros = _laid_out(zeros, ("batch", "seq", "vocab"), x, P(_spec(x, 0), _spec(x, 1), _spec(w, 2)))
    (lse, target), _ = jax.lax.scan(step, (zeros - jnp.inf, zeros), (w, jnp.arange(pieces)))
    return jax.nn.logsumexp(lse, axis=2), jnp.sum(target, axis=2)


def _summed_nll_bwd(dtype, layout, grad_dtype, residuals, g):
    """d/dh and the weight gradient: from the forward's d_logits (one piece), or per piece of
    the vocabulary from its recomputed logits (`_piecewise_grads`). The weight gradient's
    partial sums over the token rows are kept per part (`parts`: the devices the batch and
    sequence are split over); the one sum over parts after the loop is its one reduce-scatter
    (or all-reduce, where the gradient is kept whole), in `grad_dtype`."""
    pieces, tensor, parts = layout
    x, w, kept, targets, mask, weight_zero, h_zero = residuals
    if pieces == 1:
        # g scales d_h's float32 product and the rows of the weight gradient's GEMM (a
        # [tokens, embed] pass; d_logits, vocab wide, is read by the GEMMs alone).
        d_h = g * jnp.einsum(
            "bstv,etv->bse", kept, w[0], preferred_element_type=jnp.float32, **_typed_out(x, _spec3(x))
        )
        rows = (x.astype(jnp.float32) * g).astype(x.dtype)
        grad_pieces = _weight_grad(rows, kept, parts, grad_dtype)[None]
    else:
        d_h, grad_pieces = _piecewise_grads(x, w, kept, targets, mask * g, layout, grad_dtype)
    d_h = d_h.astype(h_zero.dtype)
    if _typed_mesh(x) is not None:  # a type that carries a sharding must come back as it came
        d_h = jax.sharding.reshard(d_h, jax.typeof(x).sharding)
    d_weight = _sum_parts(_from_pieces(grad_pieces), parts, grad_dtype, x).astype(weight_zero.dtype)
    # The layers' backward (which takes d_h) waits for the weight gradient's reduction: left to
    # itself, XLA:GPU's scheduler reduced it after them, keeping the partial sums alive through
    # the whole backward (1B, 8 H100s: temp 9.34 GB without the two barriers, 8.42 with).
    d_h, d_weight = jax.lax.optimization_barrier((d_h, d_weight))
    return d_h, d_weight, None, None


def _spec3(x):
    """x's [batch, seq, embed] layout as a PartitionSpec (Nones where not typed)."""
    return P(_spec(x, 0), _spec(x, 1), _spec(x, 2))


def _piecewise_grads(x, w, lse, targets, scale, layout, grad_dtype):
    """The backward over the vocabulary's pieces: (d/dh float32 [batch, seq, embed], the weight
    gradient per piece [pieces, batch parts, seq parts, embed, tensor, run] in grad_dtype).
    scale: mask * g per token. Each piece's d_h is kept per device of the vocabulary's split
    (a leading [tensor] dim) and summed after the loop: no cross-device sum per piece."""
    pieces, tensor, parts = layout
    batch, seq, embed = x.shape

    def step(d_h, piece):
        w_c, c = piece
        logits = _logits(x, w_c)
        d = _d_logits(logits, lse, _onehot(logits.shape, targets, c, pieces), scale, x.dtype)
        spec = P(_spec(w_c, 1), *_spec3(x))
        d_h = d_h + jnp.einsum(
            "bstv,etv->tbse", d, w_c, preferred_element_type=jnp.float32, **_typed_out(x, spec)
        )
        return d_h, _weight_grad(x, d, parts, grad_dtype)

    zeros = jnp.zeros((tensor, batch, seq, embed), jnp.float32)
    zeros = _laid_out(zeros, ("vocab", "batch", "seq", None), x, P(_spec(w, 2), *_spec3(x)))
    d_h, grad_pieces = jax.lax.scan(step, zeros, (w, jnp.arange(pieces)))
    return jnp.sum(d_h, axis=0), grad_pieces


def _sum_parts(grad_parts, parts, grad_dtype, x):
    """[batch parts, seq parts, embed, vocab] -> [embed, vocab], in grad_dtype. The sum as a
    contraction with ones that writes `grad_dtype`, so that the cross-device sum it becomes
    moves that dtype. Not jnp.sum: it adds bfloat16 in float32 and rounds after (a float32
    reduce-scatter); nor a bfloat16 lax.reduce, which stopped XLA:CPU's compiler with a failed
    check in a pipelined layout (jax 0.12.0.1)."""
    if parts == (1, 1):
        return grad_parts[0, 0]
    return jnp.einsum(
        "mnev,mn->ev",
        grad_parts,
        jnp.ones(parts, grad_dtype),
        preferred_element_type=grad_dtype,
        **_typed_out(x, P(None, _spec(grad_parts, 3))),
    )


_summed_nll.defvjp(_summed_nll_fwd, _summed_nll_bwd)


def pick_chunks(tokens_per_device: int, vocab_per_device: int, budget_bytes: int = DEFAULT_BUDGET) -> int:
    """The fewest pieces of the vocabulary for `chunked_cross_entropy` whose per-piece float32
    logits fit in `budget_bytes` on one device: a divisor of vocab_per_device.

    tokens_per_device: batch * seq tokens that one device holds (after data/fsdp/context splits).
    vocab_per_device: vocabulary columns per device (vocab / tensor when vocab is sharded).

    One piece's logits take tokens_per_device * vocab_per_device / pieces * 4 bytes; the
    backward briefly holds their gradient beside them (in the matmul dtype), so the budget is
    the size of one copy. If no divisor fits, one column per piece.
    """
    full = tokens_per_device * vocab_per_device * FLOAT32_BYTES
    return next((c for c in _divisors(vocab_per_device) if full / c <= budget_bytes), vocab_per_device)


def loss_chunks(
    cfg: Config, sizes: dict[str, int], rows: int | None = None, memory: int | None = None
) -> int:
    """train.loss_chunks, or (0 = auto) the fewest vocabulary pieces whose float32 logits fit a
    budget (`pick_chunks`) on a mesh of `sizes`: LOGITS_SHARE of `memory`, the bytes a program
    may use on one device (`jaxpar.compiled.targets.device_memory`), else (unknown: CPU devices) 256 MiB.
    `rows`: the batch rows the loss sees at once (a pipeline microbatch), default the whole
    batch. On one 80 GB H100 the presets' logits come whole: GPT-2 124M (12 x 1024 tokens,
    2.5 GB) and Llama-3.2-1B (8 x 2048 tokens, 8.4 GB)."""
    t = cfg.train
    if t.loss_chunks:
        return t.loss_chunks
    # The hidden states' sequence is split over context (and tensor with sequence parallelism),
    # the output weight's vocabulary over tensor; one axis cannot split both dims of the logits
    # (the loss gathers the sequence over tensor), so a device holds tokens / context by
    # vocab / tensor of them.
    rows = (rows or t.batch_size // cfg.parallel.grad_accum) // (
        sizes["data"] * sizes["fsdp"] * sizes["expert"]
    )
    return pick_chunks(
        max(rows, 1) * t.seq_len // sizes["context"],
        cfg.model.vocab_size // sizes["tensor"],
        DEFAULT_BUDGET if memory is None else int(memory * LOGITS_SHARE),
    )
