"""Dense MLP layers at any places of an MoE model (model.moe.dense_layers: Qwen3-MoE's
mlp_only_layers). `ModelConfig.moe_kinds` says which layers have experts, for every reader. A
model whose dense layers still make the first_dense / every pattern keeps that pattern's stacks;
an irregular one (`ModelConfig.irregular_moe`) stacks its dense blocks (`dense_blocks`) and its
MoE blocks (`blocks`) apart and runs them in runs of one kind, in layer order (`moe.segments`).

The model here is 5 layers: MoE, dense, MoE, dense, dense. Its forward is the layers applied one
at a time in order, each with its own weights; generation through the KV cache gives the full
forward's logits and greedy tokens; it trains as on one device (per-leaf gradients, losses and
updated state within tests/parity.py's RTOL) on expert x fsdp x tensor under ZeRO-3, scanned and
unrolled; the planner's tables, the FLOP count and LoRA's adapters count its stacks; what cannot
run is refused by name. Against transformers: tests/test_convert.py's
test_qwen3_moe_dense_layers_between_moe_ones_match_transformers_and_round_trip.

Planted and seen failing (each once, then removed):
- `run_segments` running the runs in reverse order: the forward test (every logit off), the
  decode test, the transformers test.
- a run's slice of its stack off by one (`a[start + 1 : stop + 1]`, clipped): the forward test,
  the transformers test.
- `moe_kinds` reading dense_layers one layer late (`i - 1 not in dense`): the kinds test, the
  forward test (a layer given the other kind's weights), the transformers test (tensor names).
- `_decode_segments` reading every run's cache from layer 0: the decode test.
- `irregular_tensors` giving the MoE stack the dense layers' numbers: the transformers test and
  the family round trip.
- `scan_unit` keeping `BlockGroup`s for an irregular model with model.moe.every > 1: the
  transformers test (the MoE stack's params have another shape).
- `dense_prefix` giving first_dense for an irregular model (the dense stack too short): every
  test that builds the model.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxpar import checks as checks_lib
from jaxpar.config import MESH_AXES, ConfigError, LoRAConfig, ModelConfig, MoEConfig, TrainConfig
from jaxpar.inspect import compile_step
from jaxpar.models import lora as lora_lib
from jaxpar.models.families import registry as families
from jaxpar.models.llama import KVCache, Transformer, active_matmul_params, matmul_params
from jaxpar.models.moe import segments
from jaxpar.planning import params as plan_params
from jaxpar.planning import search
from jaxpar.sample import generate
from tests.parity import LAYER_FORMS, assert_parity, parity_trainer, random_batches, run_parity, tiny_config
from tests.test_sample import TINY, decode, padded_full_logits, random_model

# MoE, dense, MoE, dense, dense: runs of one and two layers, one stack's runs between the other's.
MODEL = dataclasses.replace(
    TINY, n_layers=5, moe=MoEConfig(num_experts=4, top_k=2, d_ff=32, dense_layers=[1, 3, 4])
)
IRREGULAR = [
    "model.n_layers=5",
    "model.moe.num_experts=4",
    "model.moe.top_k=2",
    "model.moe.d_ff=32",
    "model.moe.dense_layers=[1,3,4]",
    "train.seq_len=16",
    "parallel.grad_accum=2",
]


@pytest.mark.parametrize(
    "layers, first_dense, every, dense, kinds",
    [
        (5, 0, 1, [1, 3, 4], "MDMDD"),
        (6, 0, 2, [0, 3], "DMDDDM"),  # Qwen3-MoE: (i + 1) % 2 == 0 and i not in [0, 3]
        (5, 1, 1, [3], "DMMDM"),
        (4, 0, 2, [], "DMDM"),
    ],
)
def test_moe_kinds_follow_transformers_rule(layers, first_dense, every, dense, kinds):
    m = ModelConfig(
        n_layers=layers,
        moe=MoEConfig(num_experts=4, every=every, first_dense=first_dense, dense_layers=dense),
    )
    assert "".join("M" if k else "D" for k in m.moe_kinds()) == kinds
    if first_dense == 0:  # Qwen3-MoE's own rule
        assert m.moe_kinds() == tuple(i not in dense and (i + 1) % every == 0 for i in range(layers))
    assert m.irregular_moe() == (dense not in ([], [0]))


def test_segments_are_the_runs_of_one_kind_in_order():
    assert segments(MODEL) == [(True, 0, 1), (False, 0, 1), (True, 1, 2), (False, 1, 3)]


# --- The forward and generation ------------------------------------------------------------------


@pytest.fixture(scope="module")
def model():
    return random_model(MODEL, seed=1)


def _layer_by_layer(model, tokens, positions):
    """The reference: every layer in order, each merged alone with its own slice of its kind's
    stack (the k-th MoE layer with blocks[k], the k-th dense one with dense_blocks[k])."""
    stacks = {True: model.blocks, False: model.dense_blocks}
    params = {kind: nnx.to_pure_dict(nnx.state(stack)) for kind, stack in stacks.items()}
    seen, x = {True: 0, False: 0}, model.embed(tokens)
    for kind in model.cfg.moe_kinds():
        one = jax.tree.map(lambda a, k=seen[kind]: a[k], params[kind])
        x, _ = nnx.merge(nnx.graphdef(stacks[kind]), one)(x, positions, jnp.ones_like(tokens))
        seen[kind] += 1
    return model.head(x)


def _tokens(batch, total):
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 256, (batch, total)), jnp.int32)
    return tokens, jnp.broadcast_to(jnp.arange(total), (batch, total))


def test_the_forward_runs_each_layer_with_its_own_weights_in_order(model):
    state = nnx.to_pure_dict(nnx.state(model))
    assert state["dense_blocks"]["mlp"]["w_gate"].shape == (3, 32, 64)  # the three dense layers
    assert state["blocks"]["mlp"]["gate"].shape == (2, 4, 32, 32)  # the two MoE layers, no groups
    tokens, positions = _tokens(2, 10)
    got, stats = nnx.jit(lambda m: m(tokens, positions, jnp.ones_like(tokens)))(model)
    want = nnx.jit(_layer_by_layer)(model, tokens, positions)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert stats["expert_load"].shape == (2, 4)  # per MoE layer


def test_kv_cache_decode_of_an_irregular_model_matches_the_full_forward(model):
    batch, prompt_len, total = 2, 5, 10
    tokens, positions = _tokens(batch, total)
    expected, _ = nnx.jit(lambda m: m(tokens, positions, jnp.ones_like(tokens)))(model)
    cache = KVCache.create(MODEL, batch, max_len=12)
    logits, cache = decode(model, tokens[:, :prompt_len], positions[:, :prompt_len], cache)
    steps = [logits]
    for i in range(prompt_len, total):
        logits, cache = decode(model, tokens[:, i : i + 1], positions[:, i : i + 1], cache)
        steps.append(logits)
    assert int(cache.length) == total and cache.k.shape[0] == 5
    np.testing.assert_allclose(np.concatenate(steps, axis=1), expected, rtol=1e-5, atol=1e-5)

    prompt, new = [100, 101, 102, 32], 6  # greedy generation: the full forward's argmax
    got, sequence = generate(model, prompt, new), list(prompt)
    for _ in range(new):
        sequence.append(int(np.argmax(padded_full_logits(model, sequence, len(prompt) + new)[-1])))
    assert got == sequence[len(prompt) :]


# --- Training on a mesh --------------------------------------------------------------------------

LAYOUT = ({"expert": 2, "fsdp": 2, "tensor": 2}, ["parallel.zero_stage=3"])


def _run(overrides, mesh, along=None):
    trainer = parity_trainer(IRREGULAR + list(overrides), mesh)
    init = None if along is None else along.init
    return run_parity(trainer, compile_step(trainer), random_batches(trainer.cfg), init=init, along=along)


@pytest.fixture(scope="module")
def single_device():
    return _run([], {})


@pytest.mark.parametrize("form", LAYER_FORMS)
def test_an_irregular_model_trains_as_on_one_device(form, single_device):
    mesh, extra = LAYOUT
    got = _run(list(extra) + LAYER_FORMS[form], mesh, along=single_device)
    assert got.grads["dense_blocks"]["mlp"]["w_gate"].shape == (3, 32, 64)
    assert "router" not in got.grads["dense_blocks"]["mlp"]
    assert_parity(got, single_device)


# --- What counts the parameters ------------------------------------------------------------------


def test_the_planner_the_flop_count_and_lora_count_both_stacks():
    state = nnx.to_pure_dict(nnx.state(nnx.eval_shape(lambda: Transformer(MODEL, rngs=nnx.Rngs(0)))))
    total = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(state))
    assert plan_params.state_elements(MODEL, {a: 1 for a in MESH_AXES}, 0)["total"] == total
    flat = jax.tree_util.tree_leaves_with_path(state)
    matmul = sum(
        int(np.prod(x.shape))
        for p, x in flat
        if not any(k in jax.tree_util.keystr(p) for k in ("norm", "embedding"))
    )
    assert matmul_params(MODEL) == matmul
    assert active_matmul_params(MODEL) == matmul - 2 * (4 - 2) * 3 * MODEL.d_model * 32

    lora = LoRAConfig(rank=2, targets=["q", "v", "gate"])  # gate: the dense blocks' MLPs only
    with pytest.raises(ValueError, match="this block's mlp has no w_gate"):
        lora_lib.add_lora(nnx.eval_shape(lambda: Transformer(MODEL, rngs=nnx.Rngs(0))), lora, seed=0)
    lora = LoRAConfig(rank=2, targets=["q", "v"])
    abstract = nnx.eval_shape(lambda: Transformer(MODEL, rngs=nnx.Rngs(0)))
    lora_lib.add_lora(abstract, lora, seed=0)
    adapters = nnx.to_pure_dict(nnx.state(abstract, nnx.LoRAParam))
    assert adapters["dense_blocks"]["attn"]["wq_lora"]["lora_a"].shape[0] == 3
    count = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(adapters))
    assert count == sum(int(np.prod(shape)) for _, shape, _ in plan_params.lora_table(MODEL, lora))
    # The search proposes no pipeline the config would refuse (it used to count the layers a
    # pipeline splits as n_layers less every dense one: 2 here, so pipe=2 came up).
    train = dataclasses.replace(TrainConfig(), batch_size=8)
    assert {mesh["pipe"] for mesh in search._meshes(MODEL, train, 8)} == {1}
    regular = dataclasses.replace(MODEL, n_layers=4, moe=dataclasses.replace(MODEL.moe, dense_layers=[]))
    assert {mesh["pipe"] for mesh in search._meshes(regular, train, 8)} == {1, 2, 4}


# --- Settings that cannot run --------------------------------------------------------------------

ONE_DEVICE = ["mesh.data=1", "mesh.fsdp=1", "mesh.tensor=1"]
PIPE = ["mesh.pipe=2", "mesh.data=4", "mesh.fsdp=1", "mesh.tensor=1", "parallel.microbatches=2"]


@pytest.mark.parametrize(
    "change, named",
    [
        (["model.moe.num_experts=0"], r"dense_layers=\[1, 3, 4\] with model.moe.num_experts=0"),
        (["model.moe.dense_layers=[1,5]"], r"dense_layers=\[1, 5\]: list each dense layer once, .* = 4"),
        (["model.moe.dense_layers=[-1]"], r"dense_layers=\[-1\]: list each dense layer once"),
        (["model.moe.dense_layers=[3,1,3]"], r"dense_layers=\[3, 1, 3\]: list each dense layer once"),
        (["model.moe.dense_layers=[0,1,2,3,4]"], r"leaves no layer with experts"),
        (["model.sliding_window=4"], r"model.sliding_window with model.moe.dense_layers=\[1, 3, 4\]"),
        (
            PIPE,
            r"dense_layers=\[1, 3, 4\] with mesh.pipe=2: .* use mesh.pipe=1, or for a pipeline .* "
            r"model.moe.first_dense=3 model.moe.dense_layers=\[\]",
        ),
    ],
)
def test_dense_layers_that_cannot_run_are_refused(change, named):
    with pytest.raises(ConfigError, match=named):
        checks_lib.validate(tiny_config(IRREGULAR + ONE_DEVICE + change), 8 if PIPE == change else 1)


def test_dense_layers_that_keep_the_pattern_keep_its_stacks_and_pipeline():
    # Layer 0 is dense anyway with every=2: the grouped layout, which a pipeline splits.
    cfg = tiny_config(
        IRREGULAR[:-1] + ["model.n_layers=4", "model.moe.every=2", "model.moe.dense_layers=[0]"] + PIPE
    )
    checks_lib.validate(cfg, 8)
    assert not cfg.model.irregular_moe()
    state = nnx.to_pure_dict(nnx.state(nnx.eval_shape(lambda: Transformer(cfg.model, rngs=nnx.Rngs(0)))))
    assert "dense_blocks" not in state and set(state["blocks"]["blocks"]) == {0, 1}


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


@pytest.mark.parametrize(
    "dense, step, read",
    [
        ([1], 1, (0, 1, [1])),
        ([2, 0], 1, (0, 1, [0, 2])),
        ([1, 0], 1, (2, 1, [])),  # a prefix: model.moe.first_dense
        ([0], 2, (0, 2, [0])),
        ([0, 1, 2, 3], 1, "leaves none of the 4 layers with experts"),
        ([1, 3], 2, "leaves none of the 4 layers with experts"),
        ([4], 1, r"mlp_only_layers=\[4\] is not a list of layers 0 to 3"),
        ([1], 3, "decoder_sparse_step=3 does not divide num_hidden_layers=4"),
    ],
)
def test_qwen3_moe_mlp_only_layers_read_as_dense_layers_or_are_refused(dense, step, read):
    hf = {**QWEN3_MOE, "mlp_only_layers": dense, "decoder_sparse_step": step}
    if isinstance(read, str):
        with pytest.raises(ConfigError, match=read):
            families.settings_from_hf(hf, "config.json")
        return
    moe = families.settings_from_hf(hf, "config.json")["moe"]
    assert (moe["first_dense"], moe["every"], moe["dense_layers"]) == read
