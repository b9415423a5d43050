"""FP8 block matmuls (`model.fp8`, jaxpar.ops.fp8): one matmul against float32 within the
float8 error bound, the exact e4m3 / e5m2 arithmetic, every layout equal to one device, a few
training steps like bfloat16's, and the H100 program's GEMMs in float8."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpar.checks import validate
from jaxpar.compiled import hlo
from jaxpar.config import ConfigError
from jaxpar.inspect import compile_step
from jaxpar.ops.fp8 import E4M3, E5M2, fp8_einsum, scale_of
from tests.parity import (
    assert_parity,
    parity_trainer,
    random_batches,
    run_parity,
    run_steps,
    tiny_config,
    trainer_on,
)

# Round to nearest: a normal float8 value is within 2^-(mantissa bits + 1) of what it rounds.
UNIT = {E4M3: 2.0**-4, E5M2: 2.0**-3}
# Below the smallest normal (2^-6 for e4m3, 2^-14 for e5m2, in units of the scale) the spacing is
# fixed, 2^-9 and 2^-16: the absolute error there is at most half of it.
SUBNORMAL_HALF_STEP = {E4M3: 2.0**-10, E5M2: 2.0**-17}

SPEC = "bse,ef->bsf"


def operands(seed=0):
    keys = jax.random.split(jax.random.key(seed), 3)
    # Activations with outliers (a heavy tail), weights small: the per-tensor scales matter.
    x = jax.random.t(keys[0], 3.0, (4, 16, 64))
    w = 0.02 * jax.random.normal(keys[1], (64, 48))
    g = 1e-4 * jax.random.normal(keys[2], (4, 16, 48))  # gradients far below 1: e5m2's range
    return x, w, g


def element_error(t, fp8_dtype, scale):
    """What rounding t / scale to fp8_dtype may change each element by, at most."""
    return jnp.maximum(UNIT[fp8_dtype] * jnp.abs(t), SUBNORMAL_HALF_STEP[fp8_dtype] * scale)


def product_bound(spec, a, ea, b, eb):
    """|â·b̂ - a·b| <= |a|·eb + ea·|b| + ea·eb, element by element (â within ea of a, b̂ within eb
    of b), with 1e-5 relative room for the float32 sums."""
    bound = jnp.einsum(spec, jnp.abs(a), eb) + jnp.einsum(spec, ea, jnp.abs(b)) + jnp.einsum(spec, ea, eb)
    return bound * (1 + 1e-5) + 1e-5 * jnp.abs(jnp.einsum(spec, a, b))


def test_forward_within_the_e4m3_bound():
    x, w, _ = operands()
    got = fp8_einsum(SPEC, x, w)
    want = jnp.einsum(SPEC, x, w)
    bound = product_bound(
        SPEC, x, element_error(x, E4M3, scale_of(x, E4M3)), w, element_error(w, E4M3, scale_of(w, E4M3))
    )
    assert bool(jnp.all(jnp.abs(got - want) <= bound))
    # ... and it is float8: far from float32 exactness, near the bound's scale.
    relative = float(jnp.linalg.norm(got - want) / jnp.linalg.norm(want))
    assert 1e-3 < relative < 0.1, relative


def test_gradients_within_the_e5m2_and_e4m3_bounds():
    x, w, g = operands()
    _, vjp = jax.vjp(lambda x, w: fp8_einsum(SPEC, x, w), x, w)
    dx, dw = vjp(g)
    eg = element_error(g, E5M2, scale_of(g, E5M2))
    ex, ew = element_error(x, E4M3, scale_of(x, E4M3)), element_error(w, E4M3, scale_of(w, E4M3))
    dx_spec, dw_spec = "bsf,ef->bse", "bse,bsf->ef"
    assert bool(jnp.all(jnp.abs(dx - jnp.einsum(dx_spec, g, w)) <= product_bound(dx_spec, g, eg, w, ew)))
    assert bool(jnp.all(jnp.abs(dw - jnp.einsum(dw_spec, x, g)) <= product_bound(dw_spec, x, ex, g, eg)))
    assert dx.dtype == x.dtype and dw.dtype == w.dtype


def emulate(t, fp8_dtype):
    """t rounded as the fp8 matmul rounds it, back in float32 (numpy, independent of the code)."""
    amax = np.max(np.abs(np.asarray(t, np.float32)))
    scale = np.float32(2.0 ** np.ceil(np.log2(amax / float(jnp.finfo(fp8_dtype).max))))
    return np.asarray(jnp.asarray(t / scale, jnp.float32).astype(fp8_dtype), np.float32) * scale


def test_the_arithmetic_is_e4m3_forward_e5m2_backward_with_per_tensor_scales():
    """Against numpy on emulated roundings: gradients rounded to e4m3 instead of e5m2, or a
    missing or per-element scale, would be off by far more than float32's sums allow."""
    x, w, g = operands()
    xq, wq, gq = emulate(x, E4M3), emulate(w, E4M3), emulate(g, E5M2)
    y, vjp = jax.vjp(lambda x, w: fp8_einsum(SPEC, x, w), x, w)
    dx, dw = vjp(g)
    np.testing.assert_allclose(y, np.einsum(SPEC, xq, wq), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(dx, np.einsum("bsf,ef->bse", gq, wq), rtol=1e-5, atol=1e-11)
    np.testing.assert_allclose(dw, np.einsum("bse,bsf->ef", xq, gq), rtol=1e-5, atol=1e-9)
    # The rounding of g really is e5m2's: e4m3's would differ (this data tells the two apart).
    assert not np.allclose(emulate(g, E4M3), gq, rtol=1e-3)
    # The backward's GEMM operands are float8 of the two kinds; float32 is only the accumulator.
    jaxpr = jax.make_jaxpr(jax.grad(lambda x, w: fp8_einsum(SPEC, x, w).sum(), (0, 1)))(x, w)
    assert sorted(dot_operand_types(jaxpr.jaxpr)) == [
        ("float8_e4m3fn", "float8_e4m3fn"),
        ("float8_e4m3fn", "float8_e5m2"),
        ("float8_e5m2", "float8_e4m3fn"),
    ]


def dot_operand_types(jaxpr) -> list[tuple[str, str]]:
    """Operand dtypes of every dot_general in a jaxpr, sub-jaxprs included."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            found.append(tuple(str(v.aval.dtype) for v in eqn.invars))
        for param in eqn.params.values():
            for sub in param if isinstance(param, (list, tuple)) else [param]:
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    found += dot_operand_types(inner)
    return found


def test_fp8_needs_float32_master_weights():
    cfg = tiny_config(["model.fp8=true", "model.param_dtype=bfloat16"])
    with pytest.raises(ConfigError, match="model.fp8 .* model.param_dtype=float32"):
        validate(cfg, 8)


def test_fp8_needs_float8_gemms_or_the_cpu_emulation():
    """An A100 (8.0) or a TPU is refused; Ada (8.9), Hopper and the CPU pass."""
    from types import SimpleNamespace as Device

    from jaxpar.ops.fp8 import check_device

    for capability in ("8.9", "9.0", "10.0"):
        check_device(Device(platform="gpu", compute_capability=capability, device_kind="GPU"))
    check_device(Device(platform="cpu", device_kind="cpu"))
    with pytest.raises(ConfigError, match=r"A100.*compute capability 8\.0.*model\.fp8=false"):
        check_device(Device(platform="gpu", compute_capability="8.0", device_kind="A100"))
    with pytest.raises(ConfigError, match="this backend is tpu"):
        check_device(Device(platform="tpu", device_kind="TPU v4"))


def test_inspect_for_an_a100_refuses_fp8_before_compiling():
    """The command a user runs: exit 2, one line naming the GPU, no traceback."""
    pytest.importorskip("jax_plugins.xla_cuda12", reason="needs the gpu-compile extra")
    import os
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-m", "jaxpar.inspect", "configs/tiny.yaml", "model.fp8=true", "--target", "a100"],
        capture_output=True,
        text=True,
        env={**os.environ, "XLA_FLAGS": ""},
        timeout=120,
    )
    assert done.returncode == 2, done.stderr
    assert "A100-SXM4-80GB (compute capability 8.0)" in done.stderr
    assert "Traceback" not in done.stderr


# Dense blocks and an MoE layer (dropless, a shared expert): every block matmul in float8.
FP8 = [
    "model.fp8=true",
    "model.moe.num_experts=4",
    "model.moe.top_k=2",
    "model.moe.every=2",
    "model.moe.shared_experts=1",
]


def test_fsdp_tensor_and_expert_layouts_equal_one_device():
    """ZeRO-3 over fsdp=2, tensor=2 and expert=2 against one device, plain SGD (tests/parity.py):
    the per-tensor scales are global maxima, which no layout changes, so float32 sums in another
    order are all that differ."""
    reference = parity_trainer(FP8, {})
    want = run_parity(reference, compile_step(reference), random_batches(reference.cfg))
    layout = parity_trainer(FP8 + ["parallel.zero_stage=3"], {"fsdp": 2, "tensor": 2, "expert": 2})
    got = run_parity(layout, compile_step(layout), random_batches(layout.cfg), want.init, along=want)
    assert_parity(got, want)


def test_fp8_training_lowers_the_loss_like_bfloat16():
    """A few AdamW steps of the tiny model in bfloat16, with and without fp8, on one device."""
    losses = {}
    for fp8 in ("false", "true"):
        trainer = trainer_on(["model.dtype=bfloat16", f"model.fp8={fp8}", "optimizer.lr=3e-3"], {})
        history = run_steps(trainer, trainer.step, random_batches(trainer.cfg, steps=8))
        losses[fp8] = [h["loss"] for h in history]
    assert losses["true"][-1] < losses["true"][0] - 0.3, losses
    assert losses["true"][-1] == pytest.approx(losses["false"][-1], rel=0.02), losses


def test_remat_dots_keeps_fp8_gemm_outputs_at_bfloat16_size():
    """remat=dots keeps the GEMMs' outputs for the backward: fp8's must be bfloat16 like bf16's
    (a float32 GEMM output, rounded only after its scaling, took 19% more temporary memory here,
    and on llama-1b's H100 program 42.6 instead of 31.6 GiB)."""
    temp = {}
    for fp8 in ("false", "true"):
        trainer = trainer_on(
            [
                "model.dtype=bfloat16",
                f"model.fp8={fp8}",
                "parallel.remat=dots",
                "train.seq_len=128",
                "train.batch_size=8",
            ],
            {},
        )
        temp[fp8] = compile_step(trainer).memory_analysis().temp_size_in_bytes
    assert temp["true"] <= 1.10 * temp["false"], temp


# --- The H100 program ----------------------------------------------------------------------


def layer_loop_dots(text: str, layers: int) -> list[tuple[str, str]]:
    """Operand types of every dot in the layer loops (while loops of `layers` trips, forward and
    backward), fusions included, each counted once per trip."""
    comps = hlo.parse(text)
    found: list[tuple[str, str]] = []

    def walk(name, trips):
        comp = comps[name]
        shapes = {ins.name: ins.shape for ins in comp.instrs}
        for ins in comp.instrs:
            if ins.op == "dot":
                found.extend([tuple(shapes[o].split("[")[0] for o in ins.operands[:2])] * trips)
            for callee in re.findall(r"(?:calls|body|to_apply)=%([\w.\-]+)", ins.text):
                if callee in comps and ins.op != "while":
                    walk(callee, trips)

    for comp in comps.values():
        for ins in comp.instrs:
            trip = re.search(r'"known_trip_count":\{"n":"(\d+)"', ins.text)
            if ins.op == "while" and trip and int(trip.group(1)) == layers:
                walk(re.search(r"body=%([\w.\-]+)", ins.text).group(1), layers)
    return found


def test_h100_program_runs_the_block_matmuls_as_fp8_gemms():
    """The dense model's layer loops on one H100: every GEMM takes float8 operands, e4m3 by
    e4m3 forward and e5m2 gradients by e4m3 backward, as many as bfloat16's program has."""
    pytest.importorskip("jax_plugins.xla_cuda12", reason="needs the gpu-compile extra")
    from tests.test_gpu_program import compiled_for

    single = {"mesh.data": 1, "mesh.fsdp": 1, "mesh.tensor": 1, "parallel.zero_stage": 0}
    trainer, compiled, _ = compiled_for(1, **single, **{"model.fp8": "true"})
    layers = trainer.cfg.model.n_layers
    dots = layer_loop_dots(compiled.as_text(), layers)
    assert dots and all(a.startswith("f8") and b.startswith("f8") for a, b in dots), dots
    assert ("f8e4m3fn", "f8e4m3fn") in dots
    assert all("f8e5m2" in pair for pair in dots if pair != ("f8e4m3fn", "f8e4m3fn"))
    assert ("f8e5m2", "f8e5m2") not in dots  # cuBLASLt has no e5m2 x e5m2 GEMM
    _, bf16, _ = compiled_for(1, **single)
    assert len(dots) == len(layer_loop_dots(bf16.as_text(), layers))


def test_expert_matmuls_scale_by_the_global_amax_on_every_layout():
    """The MoE layer alone, fp8, on expert=2 x data=2 x tensor=2 against one device, with the
    first data shard's tokens 16 times larger than the rest: a scale taken from one device's
    tokens or weights alone (a missing pmax) would round the others differently."""
    from jaxpar.parallel.experts import moe_mlp
    from tests.test_experts import TOP_K, make_inputs, make_mesh, objective, shard_inputs

    x, params, cotangent = make_inputs()
    x = x.at[: x.shape[0] // 2].multiply(16.0)
    results = []
    for sizes in ({}, {"expert": 2, "data": 2, "tensor": 2}):
        mesh = make_mesh(**sizes)
        xs, ps = shard_inputs(mesh, x, params)

        def loss(x, params, mesh=mesh):
            y, stats = moe_mlp(x, params, mesh=mesh, top_k=TOP_K, fp8=True)
            return objective(y, stats["aux_loss"], stats["z_loss"], cotangent), y

        (_, y), grads = jax.jit(jax.value_and_grad(loss, (0, 1), has_aux=True))(xs, ps)
        results.append(jax.tree.map(np.asarray, (y, grads)))
    (y, grads), (y_one, grads_one) = results[1], results[0]
    np.testing.assert_allclose(y, y_one, rtol=1e-5, atol=1e-5 * np.abs(y_one).max())
    for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(grads_one)):
        assert np.linalg.norm(got - want) <= 1e-5 * np.linalg.norm(want)
    # fp8 it is: one device's result is not float32's.
    y32, _ = moe_mlp(x, params, top_k=TOP_K)
    assert np.linalg.norm(y_one - y32) > 1e-3 * np.linalg.norm(y32)
