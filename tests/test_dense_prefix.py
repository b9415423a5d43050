"""An MoE model's dense prefix (model.moe.first_dense: DeepSeek-V3's first_k_dense_replace,
Qwen3-MoE's mlp_only_layers [0, ..., k-1]): the leading blocks, with dense MLPs of model.d_ff,
are a stack of their own (`dense_blocks`, run before `blocks`).

It trains as on one device on layouts that split it every way a block is split (per-leaf
gradients, losses and updated state within tests/parity.py's RTOL): data x fsdp x tensor under
ZeRO-3, expert x context (ring) x tensor, the unrolled layer loop, and a pipeline, before whose
stages the prefix runs as the embedding does. Generation through the KV cache gives the full
forward's logits and greedy tokens; the planner's tables, the FLOP count and LoRA's adapters
count the prefix; the settings that cannot run are refused by name. The Hugging Face families
are tests/test_deepseek_v3.py's and tests/test_convert.py's. Dense layers at other places
(model.moe.dense_layers) are tests/test_dense_layers.py's.

Planted and seen failing (each once, then removed):
- `apply_blocks` skipping the prefix (the model runs `blocks` alone): the parity runs (the
  prefix's reference gradients all zero) and the decode test (every logit off).
- the pipelined step's prefix output off by a factor 1 + 1e-4: every gradient leaf of the
  pipeline run off by about 1e-4; its prefix gradients dropped (`prefix_grads` not merged): the
  step fails to lay out a gradient tree without `dense_blocks`.
- the unrolled loop running the prefix's two layers in reverse order: the unrolled run, every
  leaf off by 0.07 to 0.3.
- `decode` writing the prefix's keys and values nowhere (the cache's first layer kept as it came
  in): the decode test's one-token steps off by up to 1.1.
- `moe_layers` counting n_layers / every, the prefix included; `param_table` without the prefix's
  rows; `lora._units` without the prefix: the planner / FLOP / LoRA test.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxpar import checks as checks_lib
from jaxpar.config import MESH_AXES, ConfigError, LoRAConfig, ModelConfig, MoEConfig
from jaxpar.inspect import compile_step
from jaxpar.models import lora as lora_lib
from jaxpar.models.families import registry as families
from jaxpar.models.llama import KVCache, Transformer, active_matmul_params, matmul_params
from jaxpar.planning import params as plan_params
from jaxpar.sample import generate
from tests.parity import (
    LAYER_FORMS,
    assert_parity,
    parity_trainer,
    random_batches,
    run_parity,
    tiny_config,
)
from tests.test_sample import TINY, decode, padded_full_logits, random_model

# 4 layers: 2 dense, then 2 MoE (every block after the prefix), the experts narrower than the
# dense MLP (model.d_ff = 64). Two accumulated microsteps: the pipeline's reference (a pipeline
# microbatch is routed on its own: tests/test_pipeline_training.py), and so every layout's.
PREFIX = [
    "model.n_layers=4",
    "model.moe.num_experts=4",
    "model.moe.top_k=2",
    "model.moe.d_ff=32",
    "model.moe.first_dense=2",
    "train.seq_len=16",
    "parallel.grad_accum=2",
]
LAYOUTS = {
    "data2_fsdp2_tensor2_zero3": ({"data": 2, "fsdp": 2, "tensor": 2}, ["parallel.zero_stage=3"]),
    "expert2_context2_tensor2": ({"expert": 2, "context": 2, "tensor": 2}, []),
    # The prefix before the stages, the 2 MoE layers one a stage; 2 microbatches of one pass.
    "pipe2_expert2_data2": (
        {"pipe": 2, "expert": 2, "data": 2},
        ["parallel.microbatches=2", "parallel.grad_accum=1"],
    ),
}
# The unrolled loop runs the prefix's two layers (and the MoE stack's) written out: a layer run
# with another's weights shows on any layout; this one splits the most inside a layer.
UNROLLED = "data2_fsdp2_tensor2_zero3"


def _run(overrides, mesh, along=None):
    trainer = parity_trainer(PREFIX + list(overrides), mesh)
    init = None if along is None else along.init
    return run_parity(trainer, compile_step(trainer), random_batches(trainer.cfg), init=init, along=along)


@pytest.fixture(scope="module")
def single_device():
    return _run([], {})


@pytest.mark.parametrize("layout, form", [(n, "scanned") for n in LAYOUTS] + [(UNROLLED, "unrolled")])
def test_dense_prefix_trains_as_on_one_device(layout, form, single_device):
    mesh, extra = LAYOUTS[layout]
    got = _run(list(extra) + LAYER_FORMS[form], mesh, along=single_device)
    assert {"dense_blocks", "blocks"} <= set(got.grads)
    assert "router" not in got.grads["dense_blocks"]["mlp"]  # the prefix's MLPs are dense
    assert got.grads["dense_blocks"]["mlp"]["w_gate"].shape == (2, 32, 64)
    assert_parity(got, single_device)


# --- Generation ------------------------------------------------------------------------------

# One dense block, then a group of a dense and an MoE block (model.moe.every = 2): the cache's
# first layer is the prefix's, the next two the group's.
DECODE = dataclasses.replace(
    TINY, n_layers=3, moe=MoEConfig(num_experts=4, top_k=2, every=2, first_dense=1, d_ff=32)
)


def test_kv_cache_decode_with_a_dense_prefix_matches_the_full_forward():
    model = random_model(DECODE, seed=1)
    batch, prompt_len, total = 2, 5, 10
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 256, (batch, total)), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(total), (batch, total))
    expected, _ = nnx.jit(lambda m: m(tokens, positions, jnp.ones_like(tokens)))(model)
    cache = KVCache.create(DECODE, batch, max_len=12)
    logits, cache = decode(model, tokens[:, :prompt_len], positions[:, :prompt_len], cache)
    steps = [logits]
    for i in range(prompt_len, total):
        logits, cache = decode(model, tokens[:, i : i + 1], positions[:, i : i + 1], cache)
        steps.append(logits)
    assert int(cache.length) == total and cache.k.shape[0] == 3
    np.testing.assert_allclose(np.concatenate(steps, axis=1), expected, rtol=1e-5, atol=1e-5)

    prompt, new = [100, 101, 102, 32], 6  # greedy generation: the full forward's argmax
    got, sequence = generate(model, prompt, new), list(prompt)
    for _ in range(new):
        sequence.append(int(np.argmax(padded_full_logits(model, sequence, len(prompt) + new)[-1])))
    assert got == sequence[len(prompt) :]


# --- What counts the parameters ----------------------------------------------------------------


def _abstract(m: ModelConfig):
    return nnx.eval_shape(lambda: Transformer(m, rngs=nnx.Rngs(0)))


def test_the_planner_the_flop_count_and_lora_count_the_prefix():
    # Two dense blocks, then one group of a dense and an MoE block: 4 layers, 1 MoE layer (a
    # count of n_layers / every = 2 MoE layers, ignoring the prefix, fails here).
    m = dataclasses.replace(DECODE, n_layers=4, moe=dataclasses.replace(DECODE.moe, first_dense=2))
    state = nnx.to_pure_dict(nnx.state(_abstract(m)))
    assert jax.tree.leaves(state["dense_blocks"])[0].shape[0] == 2
    total = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(state))
    assert plan_params.state_elements(m, {a: 1 for a in MESH_AXES}, 0)["total"] == total
    # Matmul weights: all but the norms and the embedding lookup (the head is untied).
    flat = jax.tree_util.tree_leaves_with_path(state)
    matmul = sum(
        int(np.prod(x.shape))
        for p, x in flat
        if not any(k in jax.tree_util.keystr(p) for k in ("norm", "embedding"))
    )
    assert matmul_params(m) == matmul
    inactive = (4 - 2) * 3 * m.d_model * 32  # one MoE layer's unchosen experts
    assert active_matmul_params(m) == matmul - inactive

    lora = LoRAConfig(rank=2, targets=["q", "v"])
    model = _abstract(m)
    lora_lib.add_lora(model, lora, seed=0)
    adapters = nnx.to_pure_dict(nnx.state(model, nnx.LoRAParam))
    assert "wq_lora" in adapters["dense_blocks"]["attn"]
    count = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(adapters))
    assert count == sum(int(np.prod(shape)) for _, shape, _ in plan_params.lora_table(m, lora))


# --- Settings that cannot run --------------------------------------------------------------------

ONE_DEVICE = ["mesh.data=1", "mesh.fsdp=1", "mesh.tensor=1"]


@pytest.mark.parametrize(
    "change, mesh, named",
    [
        (
            ["model.moe.num_experts=0"],
            ONE_DEVICE,
            r"model.moe.first_dense=2 with model.moe.num_experts=0: every block of a dense model",
        ),
        (["model.moe.first_dense=4"], ONE_DEVICE, r"model.moe.first_dense=4: .* 0 to model.n_layers - 1 = 3"),
        (["model.moe.first_dense=-1"], ONE_DEVICE, r"model.moe.first_dense=-1: .* 0 to model.n_layers - 1"),
        (
            ["model.moe.every=2", "model.moe.first_dense=1"],
            ONE_DEVICE,
            r"model.moe.every=2 must divide the 3 blocks after model.moe.first_dense=1 of "
            r"model.n_layers=4 .* try every in \[1, 3\]",
        ),
        (
            ["model.sliding_window=4"],
            ONE_DEVICE,
            r"model.sliding_window with model.moe.first_dense=2: .* use model.moe.first_dense=0",
        ),
        (
            ["model.moe.first_dense=1", "parallel.microbatches=2", "parallel.grad_accum=1"],
            ["mesh.pipe=2", "mesh.data=4", "mesh.fsdp=1", "mesh.tensor=1"],
            r"layers=3 is not divisible by stages\*virtual_stages=2\*1=2 \(the layers after "
            r"model.moe.first_dense=1, run before it\)",
        ),
    ],
)
def test_dense_prefix_settings_that_cannot_run_are_refused(change, mesh, named):
    with pytest.raises(ConfigError, match=named):
        checks_lib.validate(tiny_config(PREFIX + change + mesh), 8 if "mesh.pipe=2" in mesh else 1)


# --- Qwen3-MoE's mlp_only_layers: a prefix with step 1 reads as model.moe.first_dense ----------
# (other lists read as model.moe.dense_layers: tests/test_dense_layers.py)

QWEN3_MOE = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "vocab_size": 320,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_experts": 4,
    "num_experts_per_tok": 2,
}


@pytest.mark.parametrize("dense, first_dense", [([], 0), (None, 0), ([0], 1), ([0, 1, 2], 3), ([1, 0], 2)])
def test_qwen3_moe_mlp_only_layers_of_a_prefix_read_as_first_dense(dense, first_dense):
    hf = {**QWEN3_MOE, "mlp_only_layers": dense, "decoder_sparse_step": 1}
    moe = families.settings_from_hf(hf, "config.json")["moe"]
    assert (moe["first_dense"], moe["every"], moe["dense_layers"]) == (first_dense, 1, [])
