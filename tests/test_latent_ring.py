"""The ring that passes latent attention's latent (model.mla.ring_latent,
jaxpar/parallel/latent_ring.py) trains as one device does, and moves only the latents.

Parity: tests/test_mla_layouts.py's MLA settings (a query latent, YaRN with both mscale keys) on
a ring over `context` through the real trainer, per-leaf gradients, losses and updated state
within tests/parity.py's RTOL of the single device's run, on context2 x data2 x tensor2 (heads
and wkv_b split over tensor, the latent whole there) and on context2 x fsdp2 x tensor2 under
ZeRO-3 (wkv_b's latent dim split over fsdp too), and on context4 x data2 (three hops).

Structure: on the compiled program of one attention layer's forward and backward, the bytes
the collective-permutes move are the latent block's, not the expanded keys and values'.

Planted and seen failing (each patched into jaxpar/parallel/latent_ring.py, then reverted):
- the visiting block expanded with the wrong heads' slice of wkv_b (its heads rolled by one):
  all three parity tests;
- one hop skipped (the scan one step short): all three parity tests and the structural test;
- the positions kept home instead of travelling with their latent (the visiting block's causal
  mask read from the local positions): all three parity tests;
- the rotated key left out of the scores: all three parity tests;
- the last block passed on once more (c ppermutes, its arrival unused; the numbers unchanged):
  the structural test alone.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

from jaxpar import checks as checks_lib
from jaxpar.compiled import hlo
from jaxpar.inspect import compile_step
from jaxpar.parallel.latent_ring import latent_ring_attention
from jaxpar.parallel.ring_attention import ring_attention_permuted
from tests.parity import assert_same_steps, parity_trainer, random_batches, run_parity, tiny_config
from tests.test_mla_layouts import MLA

ACCUM = ["parallel.grad_accum=2"]
ZERO3 = ACCUM + ["parallel.zero_stage=3"]
SETTINGS = MLA + ["train.seq_len=16", "model.mla.ring_latent=true"]
LAYOUTS = {
    "context2_data2_tensor2": ({"context": 2, "data": 2, "tensor": 2}, ACCUM),
    "context2_fsdp2_tensor2_zero3": ({"context": 2, "fsdp": 2, "tensor": 2}, ZERO3),
    "context4_data2": ({"context": 4, "data": 2}, ACCUM),  # 3 hops of the scan, 2-token chunks
}


def _run(mesh, extra=(), along=None):
    trainer = parity_trainer(SETTINGS + list(extra), mesh)
    compiled = compile_step(trainer)
    init = None if along is None else along.init
    return run_parity(trainer, compiled, random_batches(trainer.cfg), init=init, along=along)


@pytest.fixture(scope="module")
def single_device():
    return _run({}, ACCUM)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_latent_ring_matches_single_device(layout, single_device):
    mesh, extra = LAYOUTS[layout]
    got = _run(mesh, extra, along=single_device)
    assert single_device.losses[-1] < single_device.losses[0] - 0.05, single_device.losses
    assert_same_steps(got, single_device)


# One layer's shapes for the structural test, MLA's proportions in small: heads N, latent R,
# un-rotated C and rotated P query/key widths, value width D.
B, T, N, R, C, P, D = 2, 32, 8, 32, 16, 8, 16


def _permuted_bytes(latent_ring: bool, grad: bool) -> int:
    """collective-permute bytes of one layer's attention, forward (and with `grad` backward), on
    context4 x tensor2: the latent ring, or the shared ring over the keys and values expanded
    first, as `LatentAttention` does without model.mla.ring_latent."""
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("context", "tensor"))
    scale = (C + P) ** -0.5

    def attention(q, latent, k_rope, wkv_b):
        if latent_ring:
            return latent_ring_attention(q, latent, k_rope, wkv_b, scale=scale, mesh=mesh)
        kv = jnp.einsum("bsr,rnh->bsnh", latent, wkv_b)
        k = jnp.concatenate([kv[..., :C], jnp.broadcast_to(k_rope[:, :, None], (B, T, N, P))], -1)
        v = jnp.pad(kv[..., C:], ((0, 0), (0, 0), (0, 0), (0, C + P - D)))
        return ring_attention_permuted(q, k, v, mesh=mesh)[..., :D]

    loss = lambda *args: jnp.sum(attention(*args) ** 2)
    step = jax.grad(loss, argnums=(0, 1, 2, 3)) if grad else attention
    shapes = [(B, T, N, C + P), (B, T, R), (B, T, P), (R, N, C + D)]
    args = [jax.ShapeDtypeStruct(s, jnp.float32) for s in shapes]
    text = jax.jit(step).lower(*args).compile().as_text()
    return hlo.collectives(text)["collective-permute"]["bytes"]


def test_latent_ring_permutes_the_latent_not_the_keys_and_values():
    """Per device: 3 hops (4 devices) of a block of 8 tokens (of 32) x batch 2, each hop with 8
    int32 segment ids and 8 positions. Measured on the CPU-compiled program: forward 7,872 bytes
    with the latent ring against 73,920 with the shared ring over expanded keys and values; less
    the ids, 7,680 against 73,728, the ratio (R + P) / (2 N (C + P)) = 40 / 384 = 0.104.
    Forward and backward: 15,552 against 246,144 (the latent ring's backward sends the latent's
    cotangent back 3 hops; the shared ring's runs K/V round again and takes float32 dK/dV home
    in 4)."""
    hops, tokens, f32, ids = 3, B * T // 4, 4, 2 * (T // 4) * 4
    latent, expanded = _permuted_bytes(True, grad=False), _permuted_bytes(False, grad=False)
    assert latent == hops * (tokens * (R + P) * f32 + ids), latent  # only the latent block travels
    assert expanded == hops * (tokens * 2 * N * (C + P) * f32 + ids), expanded
    np.testing.assert_allclose((latent - hops * ids) / (expanded - hops * ids), (R + P) / (2 * N * (C + P)))
    both = _permuted_bytes(True, grad=True)
    assert both == latent + hops * tokens * (R + P) * f32, both  # + the latent's cotangent, home
    assert both < _permuted_bytes(False, grad=True) / 15


def test_ring_latent_without_a_latent_is_refused():
    with pytest.raises(checks_lib.ConfigError, match="model.mla.ring_latent with model.mla.kv_lora_rank=0"):
        settings = ["model.mla.ring_latent=true", "mesh.data=8", "mesh.fsdp=1", "mesh.tensor=1"]
        checks_lib.validate(tiny_config(settings), 8)


def test_bfloat16_ring_compiles_and_stays_close():
    """bfloat16 inputs and weight, forward and gradients against the float32 ring (XLA:CPU once
    failed to compile the bfloat16 sum of wkv_b's gradient over the ring)."""
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("context", "tensor"))
    keys = jax.random.split(jax.random.key(0), 4)
    shapes = [(B, T, N, C + P), (B, T, R), (B, T, P), (R, N, C + D)]
    args = [jax.random.normal(key, s) * 0.5 for key, s in zip(keys, shapes)]

    def grads(*args):
        loss = lambda *a: jnp.sum(latent_ring_attention(*a, scale=0.2, mesh=mesh).astype(jnp.float32) ** 2)
        return jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(*args)

    got = grads(*(x.astype(jnp.bfloat16) for x in args))
    want = grads(*args)
    for g, w in zip(got, want):
        assert g.dtype == jnp.bfloat16
        err = np.linalg.norm(np.asarray(g, np.float32) - w) / np.linalg.norm(w)
        assert err < 3e-2, err
