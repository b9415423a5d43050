"""The bfloat16 MoE layer's gradient compiles on XLA:CPU with the experts split over a mesh that
has axes besides the shard_map's manual ones (the moe-tiny preset: data=2 expert=4, the others of
size 1 and Explicit; or with tensor=2). A bfloat16 psum of the expert weights' gradients inside that partially
manual shard_map lowered its reducer with a sharding op (a `copy` root), and XLA:CPU's
AllReducePromotion aborted the process on it ("Invalid binary instruction opcode copy"), so the
compile runs in a child process and the test reads its exit status."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

PROGRAM = """
import jax, jax.numpy as jnp
jax.config.update("jax_num_cpu_devices", 8)
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
from jaxpar.parallel.experts import moe_mlp

import sys
tensor = int(sys.argv[1])
mesh = jax.make_mesh((2, 1, 4 // tensor, tensor), ("data", "fsdp", "expert", "tensor"),
                     axis_types=(AxisType.Explicit,) * 4)
E, D, F = 8, 16, 24
t = "tensor" if tensor > 1 else None
with jax.set_mesh(mesh):
    x = jax.ShapeDtypeStruct((8, 4, D), jnp.float32, sharding=NamedSharding(mesh, P(("data", "expert"))))
    shapes = {"router": ((D, E), P()), "gate": ((E, D, F), P("expert", None, t)),
              "up": ((E, D, F), P("expert", None, t)), "down": ((E, F, D), P("expert", t))}
    params = {n: jax.ShapeDtypeStruct(s, jnp.float32, sharding=NamedSharding(mesh, p))
              for n, (s, p) in shapes.items()}

    def loss(x, p):
        y, _ = moe_mlp(x.astype(jnp.bfloat16), p, top_k=2, compute_dtype=jnp.bfloat16)
        return jnp.sum(y.astype(jnp.float32) ** 2)

    jax.jit(jax.grad(loss, argnums=(0, 1))).lower(x, params).compile()
print("compiled")
"""


@pytest.mark.parametrize("tensor", [1, 2])
def test_bf16_moe_grad_compiles_on_a_partially_manual_mesh(tensor):
    """tensor=1: the expert weights' gradients summed over the token axes; tensor=2: also the
    tokens' gradient summed over tensor (the experts' hidden dim split there)."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_ENABLE_COMPILATION_CACHE="false")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    done = subprocess.run(
        [sys.executable, "-c", PROGRAM, str(tensor)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0 and "compiled" in done.stdout, (done.returncode, done.stderr[-2000:])
