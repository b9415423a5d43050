"""SwiGLU, the feed-forward of every block, written once: down(silu(x @ gate) * (x @ up))
(Shazeer 2020, "GLU Variants Improve Transformer"); GeGLU (Gemma) is the same with tanh-approximated
GELU in place of SiLU (model.mlp_activation). The dense MLP and the shared experts
(`block_swiglu`) and the routed experts (`jaxpar.parallel.experts`: batched, float8 or grouped
GEMMs) all compute it here; the matmuls are the caller's."""

import functools

import jax

from jaxpar.ops.fp8 import einsum as block_einsum
from jaxpar.sharding import constrain

ACTIVATIONS = {"silu": jax.nn.silu, "gelu_tanh": functools.partial(jax.nn.gelu, approximate=True)}


def swiglu(x, gate, up, down, *, project_in, project_out, activation: str = "silu"):
    """down(act(x @ gate) * (x @ up)), act = ACTIVATIONS[activation]: `project_in(x, w)` computes
    x @ w for gate and up, `project_out(hidden, down)` the down projection (where a caller pins
    the hidden activation's sharding, or accumulates in float32)."""
    act = ACTIVATIONS[activation]
    return project_out(act(project_in(x, gate)) * project_in(x, up), down)


def block_swiglu(x, gate, up, down, *, fp8: bool, dtype, activation: str = "silu", grad_dtype=None):
    """A block's dense SwiGLU (the MLP, the shared experts): x [batch, seq, embed], gate and up
    [embed, mlp], down [mlp, embed], with the block matmuls (`jaxpar.ops.fp8.einsum`: model.dtype
    or float8; the weight gradients written in `grad_dtype`) and the hidden [batch, seq, mlp]
    pinned by its logical names."""
    matmul = functools.partial(block_einsum, fp8=fp8, dtype=dtype, grad_dtype=grad_dtype)

    def project_out(hidden, w):
        return matmul("bsf,fe->bse", constrain(hidden, ("batch", "seq", "mlp")), w)

    project_in = functools.partial(matmul, "bse,ef->bsf")
    return swiglu(x, gate, up, down, project_in=project_in, project_out=project_out, activation=activation)
