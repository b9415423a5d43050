"""FP8 matmuls with per-tensor current scaling (`model.fp8`): e4m3 forward, e5m2 gradients.

`fp8_einsum(spec, x, w)` is `jnp.einsum(spec, x, w)` computed as a float8 GEMM:

    forward   q_x = e4m3(x / s_x), q_w = e4m3(w / s_w), out = (q_x . q_w) * s_x * s_w
    backward  q_g = e5m2(g / s_g),  dx = (q_g . q_w) * s_g * s_w,  dw = (q_x . q_g) * s_x * s_g

with s_t the power of two at or above amax(|t|) / max(float8 type): each tensor is scaled so
that its largest magnitude lands within a factor 2 below the largest finite float8 value, then
rounded to the nearest float8 (clipped, so that nothing overflows). A power of two, because
dividing by it is exact: a float8 value's relative precision does not depend on where in its
range a number lands (only the subnormals at the bottom lose some), so the factor of range given
up costs nothing above them, and two layouts whose float32 amaxes differ in the last bit (sums
taken in another order) still get the same scale and the same float8 values.

The GEMMs take the float8 operands themselves and accumulate in float32; XLA's GPU compiler keeps
them float8 GEMMs (in an H100 program compiled without autotuning, as `inspect --target` does,
they are Triton GEMM fusions with f8 operands; on a GPU the autotuner may pick cuBLASLt's fp8
GEMM instead). The backward reuses the forward's float8 operands, so what the layer keeps for the
backward is float8 plus two scalars (and, under remat=dots, the GEMMs' outputs, as in bfloat16).

Current scaling, not delayed: the scale is the amax of the tensor at hand, this step, rather than
a history of past steps' amaxes kept as extra state (Transformer Engine's delayed scaling, which
`flax.linen.fp8_ops.Fp8DotGeneralOp` implements). It costs one max-reduction per operand, keeps
no state (the train state, checkpoints and optimizer are those of a bf16 run), and cannot
overflow on a step whose amax jumped. A max is exact in any order, so a layout computes the same
scales as one device: under GSPMD the `max` of a split tensor becomes an all-reduce(max); inside
a shard_map, `amax_axes` names the manual axes to `pmax` over (jaxpar.parallel.experts).

Libraries. Flax's fp8 layers (`flax.linen.fp8_ops`: Fp8DotGeneralOp, Fp8Einsum) scale with that
delayed history, kept as parameters of an "overwrite with gradient" collection that the optimizer
must treat apart; qwix (Google's quantization library) rewrites a model's einsums by module-path
rules and scales each call from the values on the device at hand, which inside the expert
shard_map would be one shard's amax, not the tensor's, and would change the numbers with the
layout. So the custom VJP below is ours, with Flax's `quantize` (divide, clip, cast) as its
rounding step.

Relative error bound (round to nearest, no underflow below the smallest normal): e4m3 keeps 3
mantissa bits, so each element is off by at most 2^-4 of itself; e5m2 keeps 2, 2^-3.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax.linen import fp8_ops

from jaxpar.config import ConfigError
from jaxpar.sharding import varying_axes

E4M3 = jnp.float8_e4m3fn  # forward: activations and weights (max 448)
E5M2 = jnp.float8_e5m2  # backward: incoming gradients (max 57344, more range, less precision)


def _spec_parts(spec: str) -> tuple[str, str, str]:
    inputs, out = spec.replace(" ", "").split("->")
    x, w = inputs.split(",")
    for index in set(x + w + out):
        if (index in x) + (index in w) + (index in out) < 2:
            raise ValueError(
                f"fp8_einsum({spec!r}): every index must appear in at least two of "
                "the operands and the output (a sum over one operand alone has no "
                "einsum transpose here)"
            )
    return x, w, out


def scale_of(t, fp8_dtype, amax_axes=()):
    """Per-tensor scale, float32 []: the power of two at or above amax(|t|) / max(fp8_dtype)
    (1 for an all-zero tensor). `amax_axes`: manual mesh axes t is split (or replicated) over,
    reduced with a pmax. No gradient flows through it."""
    amax = jnp.max(jnp.abs(t)).astype(jnp.float32)
    amax_axes = tuple(a for a in amax_axes if a in varying_axes(amax))  # equal along the others
    if amax_axes:
        amax = jax.lax.pmax(amax, amax_axes)
    amax = jax.lax.stop_gradient(amax)
    ratio = jnp.where(amax > 0, amax / float(jnp.finfo(fp8_dtype).max), 1.0)
    return jnp.exp2(jnp.ceil(jnp.log2(ratio)))


def quantize(t, fp8_dtype, scale):
    """t / scale rounded to the nearest fp8_dtype value, clipped to its finite range (Flax's
    `fp8_ops.quantize`, the divide-clip-cast that its own fp8 layers use, computed in float32)."""
    return fp8_ops.quantize(t.astype(jnp.float32), fp8_dtype, scale, jnp.float32)


def _dot(spec, a, b, scale, out_dtype):
    # The GEMM writes out_dtype itself (it accumulates in float32 inside: cuBLASLt's fp8 GEMM on
    # GPU, XLA:CPU's widened dot here), so that a remat policy keeping dot outputs (remat=dots)
    # keeps them at bfloat16's size, not float32's: llama-1b's H100 program needed 42.6 GiB with a
    # float32 output here against bfloat16's 31.6. The scale, a power of two, multiplies exactly.
    out = jnp.einsum(spec, a, b, preferred_element_type=out_dtype)
    return out * scale.astype(out_dtype)


def fp8_einsum(spec: str, x, w, amax_axes: tuple[str, ...] = (), out_dtype=None, grad_dtype=None):
    """jnp.einsum(spec, x, w) in float8 (module docstring); the result in `out_dtype` (None:
    x's dtype), the gradients in x's and w's dtypes, w's written by its GEMM in `grad_dtype`
    (None: w's dtype; see `einsum`) and cast. Two operands; every index in two or three of x, w
    and the output (three: a batch index). `amax_axes`: see `scale_of`."""
    # Inside a shard_map, an operand that is the same on every device of an axis the other
    # varies along (a weight, along the token axes) is marked varying there first, as jnp.einsum
    # does implicitly: JAX then transposes that mark into the psum of its gradient's pieces.
    both = varying_axes(x) | varying_axes(w)
    x, w = (
        jax.lax.pcast(a, tuple(sorted(both - varying_axes(a))), to="varying") if both - varying_axes(a) else a
        for a in (x, w)
    )
    grad_dtype = None if grad_dtype is None else jnp.dtype(grad_dtype)
    return _fp8_einsum(spec, x, w, tuple(amax_axes), out_dtype, grad_dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 3, 4, 5))
def _fp8_einsum(spec, x, w, amax_axes, out_dtype, grad_dtype):
    return _fp8_forward(spec, x, w, amax_axes, out_dtype, grad_dtype)[0]


def _fp8_forward(spec, x, w, amax_axes, out_dtype, grad_dtype):
    _spec_parts(spec)
    sx, sw = scale_of(x, E4M3, amax_axes), scale_of(w, E4M3, amax_axes)
    qx, qw = quantize(x, E4M3, sx), quantize(w, E4M3, sw)
    out = _dot(spec, qx, qw, sx * sw, out_dtype or x.dtype)
    return out, (qx, qw, sx, sw, jnp.zeros((0,), x.dtype), jnp.zeros((0,), w.dtype))


def _fp8_backward(spec, amax_axes, out_dtype, grad_dtype, residuals, g):
    qx, qw, sx, sw, x_like, w_like = residuals
    x_spec, w_spec, out_spec = _spec_parts(spec)
    sg = scale_of(g, E5M2, amax_axes)
    qg = quantize(g, E5M2, sg)
    dx = _dot(f"{out_spec},{w_spec}->{x_spec}", qg, qw, sg * sw, x_like.dtype)
    dw = _dot(f"{x_spec},{out_spec}->{w_spec}", qx, qg, sx * sg, grad_dtype or w_like.dtype)
    return dx, dw.astype(w_like.dtype)


_fp8_einsum.defvjp(_fp8_forward, _fp8_backward)


# Float8 tensor cores (e4m3 x e4m3, e5m2 x e4m3 GEMMs in cuBLASLt): Ada (8.9), Hopper (9.0) and later.
MIN_COMPUTE_CAPABILITY = 8.9


def check_device(device) -> None:
    """A ConfigError unless `device` runs model.fp8 as intended: an NVIDIA GPU of compute
    capability MIN_COMPUTE_CAPABILITY or more (float8 GEMMs), or a CPU, whose XLA emulates float8
    (the numbers of float8, at no speed: for tests and checks). On an older GPU XLA would widen the
    operands back to 16 bits -- float8's error for none of its speed -- and other platforms are
    not ones this module's types (OCP e4m3fn / e5m2) were checked on."""
    platform = device.platform
    kind = getattr(device, "device_kind", platform)
    if platform == "cpu":
        return
    if platform in ("gpu", "cuda"):
        capability = getattr(device, "compute_capability", None) or "0"
        if float(capability) >= MIN_COMPUTE_CAPABILITY:
            return
        raise ConfigError(
            f"model.fp8=true: the {kind} (compute capability {capability}) has no float8 tensor "
            f"cores; they start at {MIN_COMPUTE_CAPABILITY} (Ada, Hopper, Blackwell). Use "
            "model.fp8=false (bfloat16 matmuls) on this GPU"
        )
    raise ConfigError(
        f"model.fp8=true runs on NVIDIA GPUs of compute capability {MIN_COMPUTE_CAPABILITY}+ (and "
        f"emulated on CPUs); this backend is {platform} ({kind}). Use model.fp8=false"
    )


def einsum(spec: str, x, w, *, fp8: bool, dtype, amax_axes: tuple[str, ...] = (), grad_dtype=None):
    """The block matmuls' einsum: w cast to `dtype` and `jnp.einsum`, or with `fp8` the float8
    GEMM of x and w (w quantized straight from its float32 master copy).

    `grad_dtype` (parallel.grad_reduce_dtype; None: `dtype`, as autodiff gives it): the dtype the
    weight-gradient GEMM writes, accumulating in float32 inside. Where the weight is split or
    replicated over devices that split the tokens, each device's gradient is a partial sum and
    XLA reduces it across them (a reduce-scatter or an all-reduce) in the dtype the GEMM wrote:
    this picks the reduction's dtype. It is cast to w's dtype after."""
    if fp8:
        return fp8_einsum(spec, x, w, tuple(amax_axes), grad_dtype=grad_dtype)
    if grad_dtype is None or jnp.dtype(grad_dtype) == jnp.dtype(dtype):
        return jnp.einsum(spec, x, w.astype(dtype))
    return _einsum_wgrad_in(spec, jnp.dtype(dtype), jnp.dtype(grad_dtype), x, w)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _einsum_wgrad_in(spec, dtype, grad_dtype, x, w):
    return jnp.einsum(spec, x, w.astype(dtype))


def _wgrad_forward(spec, dtype, grad_dtype, x, w):
    # The residuals autodiff of the cast and the einsum would keep: x and the cast weight.
    w_cast = w.astype(dtype)
    return jnp.einsum(spec, x, w_cast), (x, w_cast, jnp.zeros((0,), w.dtype))


def _wgrad_backward(spec, dtype, grad_dtype, residuals, g):
    x, w_cast, w_like = residuals
    x_spec, w_spec, out_spec = _spec_parts(spec)
    dx = jnp.einsum(f"{out_spec},{w_spec}->{x_spec}", g, w_cast, preferred_element_type=x.dtype)
    dw = jnp.einsum(f"{x_spec},{out_spec}->{w_spec}", x, g, preferred_element_type=grad_dtype)
    return dx, dw.astype(w_like.dtype)


_einsum_wgrad_in.defvjp(_wgrad_forward, _wgrad_backward)
