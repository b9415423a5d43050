"""The seam between the model and the layout: where a traced step learns the mesh and the rules,
what the pipeline shares with the model, and the learning-rate schedule's first step."""

import dataclasses
import functools
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpar import config as config_lib
from jaxpar.config import MoEConfig
from jaxpar.models.llama import Transformer
from jaxpar.models.moe import MoEMLP
from jaxpar.sharding import BASE_RULES, Layout, constrain, make_rules
from jaxpar.training.optim import lr_schedule
from tests.parity import tiny_config, trainer_on

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _layout(shape, names, kind=AxisType.Auto):
    mesh = Mesh(
        np.array(jax.devices()[: int(np.prod(shape))]).reshape(shape), names, axis_types=(kind,) * len(names)
    )
    return Layout(mesh, {"activations": make_rules(shard_embed=False, sequence_parallel=False)})


def _constraints(fn, *args) -> list[str]:
    """The lowered program's sharding constraints that name a mesh axis (jax adds its own,
    open ones, around a shard_map)."""
    return [
        line
        for line in jax.jit(fn).lower(*args).as_text().splitlines()
        if "sharding_constraint" in line and '{"' in line
    ]


def test_constrain_reads_the_mesh_and_rules_of_the_scope():
    layout = _layout((2, 4), ("data", "tensor"))
    x = jnp.zeros((4, 8, 16))

    def scoped(x):
        with layout.scope():
            return constrain(x * 2, ("batch", "seq", "mlp"))

    inside = _constraints(scoped, x)
    assert len(inside) == 1 and '{"data"}' in inside[0] and '{"tensor"}' in inside[0]
    assert _constraints(lambda x: constrain(x * 2, ("batch", "seq", "mlp")), x) == []


def test_constrain_inside_a_shard_map_leaves_manual_axes_alone():
    """Inside the pipeline's shard_map `pipe` is manual: only the other axes are constrained."""
    layout = _layout((2, 4), ("pipe", "tensor"))

    def step(x):
        def body(block):
            return constrain(block * 2, ("layers", "seq", "mlp"))  # layers -> pipe: skipped

        with layout.scope():
            return jax.shard_map(
                body, mesh=layout.mesh, in_specs=P("pipe"), out_specs=P("pipe"), axis_names={"pipe"}
            )(x)

    (line,) = _constraints(step, jnp.zeros((2, 8, 16)))
    assert '{"tensor"}' in line and '"pipe"' not in line.split("sharding_constraint")[1]


def test_no_module_keeps_its_own_context_state():
    """The mesh and rules come from JAX's and Flax's contexts, not from jaxpar globals."""
    for folder, _, files in os.walk(os.path.join(ROOT, "jaxpar")):
        for name in files:
            if name.endswith(".py"):
                text = open(os.path.join(folder, name)).read()
                assert "contextvars" not in text and "ContextVar" not in text, name


def test_pipelined_head_computes_like_the_unpipelined_one():
    """Same model, pipe=2 against data=2: the matmuls that touch the vocabulary have the same
    operand types (bfloat16 into the forward head, as everywhere in the model)."""
    overrides = [
        "model.n_layers=4",
        "model.dtype=bfloat16",
        "parallel.microbatches=2",
        "train.loss_chunks=1",
    ]  # on configs/tiny.yaml (vocab 264, d_model 32)

    def vocab_matmuls(mesh):
        trainer = trainer_on(overrides, mesh)
        text = trainer.step.lower(trainer.state_shape, trainer.batch_shape()).as_text()
        kinds = set()
        for line in text.splitlines():
            if "dot_general" in line and "264" in line:
                operands = re.search(r": \((.*)\) ->", line).group(1)
                if re.search(r"tensor<\d+x\d+x[a-z]+\d*>$", operands):
                    continue  # the loss's sum of the weight gradient's parts (a contraction with
                    # [batch parts, seq parts] ones), which a program whose rows are whole lacks
                # drop the rows (a microbatch in one, the batch in the other)
                kinds.add(re.sub(r"tensor<\d+x", "tensor<Bx", operands))
        return kinds

    pipelined, plain = vocab_matmuls({"pipe": 2}), vocab_matmuls({"data": 2})
    assert pipelined == plain
    assert any(k.count("bf16") == 2 and "x264xbf16" in k for k in pipelined), pipelined


def test_the_first_update_moves_and_the_schedule_ends_where_it_says():
    cfg = config_lib.load_config(
        None, ["optimizer.lr=0.1", "optimizer.warmup_steps=4", "optimizer.min_lr_ratio=0.1", "train.steps=20"]
    )
    lr = lr_schedule(cfg)
    # count = updates already applied; update n = count + 1
    assert float(lr(0)) == pytest.approx(0.1 / 4)
    assert float(lr(3)) == pytest.approx(0.1)
    assert 0.01 < float(lr(10)) < 0.1
    assert float(lr(19)) == pytest.approx(0.01)
    no_warmup = config_lib.load_config(
        None, ["optimizer.lr=0.1", "optimizer.warmup_steps=0", "train.steps=1000"]
    )
    assert float(lr_schedule(no_warmup)(0)) == pytest.approx(0.1, rel=1e-4)


def test_the_train_state_keeps_its_dtypes_across_steps_with_bfloat16_parameters():
    """The step the benchmarks compile ahead of time takes the state it returns: with bfloat16
    parameters, a float32 token count once promoted the gradients, and Adam's moments after
    them, to float32, so the second call of the compiled step refused its own output."""
    trainer = trainer_on(["model.param_dtype=bfloat16"], {"data": 1})
    dtypes = jax.tree.map(lambda s: s.dtype, trainer.state_shape)
    compiled = trainer.step.lower(trainer.state_shape, trainer.batch_shape()).compile()
    state = trainer.init()
    batch = jax.tree.map(lambda s: jnp.ones(s.shape, s.dtype), trainer.batch_shape())
    for _ in range(2):
        state, _ = compiled(state, batch)
    assert jax.tree.map(lambda a: a.dtype, state) == dtypes
    assert jax.tree.leaves(dtypes["opt_state"]).count(jnp.dtype(jnp.bfloat16)) > 10


def test_the_models_choices_are_the_configs():
    """The model's remat policies and ring attention's layouts are the config's Literals."""
    import typing

    from jaxpar.config import ContextLayout, Remat
    from jaxpar.models.llama import REMAT_POLICIES
    from jaxpar.parallel.ring_attention import LAYOUT_CHUNKS

    assert set(typing.get_args(Remat)) == {"none", *REMAT_POLICIES}
    assert set(typing.get_args(ContextLayout)) == set(LAYOUT_CHUNKS)


def test_every_axis_of_the_rules_is_a_mesh_axis():
    from jaxpar.config import MESH_AXES
    from jaxpar.sharding import BASE_RULES

    for stage in (0, 3):
        for sp in (False, True):
            rules = make_rules(shard_embed=stage == 3, sequence_parallel=sp)
            assert {a for axes in rules.values() for a in axes} <= set(MESH_AXES)
    assert {a for axes in BASE_RULES.values() for a in axes} == set(MESH_AXES)


# --- The explicit techniques follow the layout's rules, not a static table ---------------------


def _layout_with_activation_rules(**changes) -> Layout:
    """A layout on mesh data=4 x context=2 (8 devices) whose activation rules differ from
    BASE_RULES by `changes` (logical name -> mesh axes); the state keeps the default rules."""
    sizes = {a: 1 for a in config_lib.MESH_AXES} | {"data": 4, "context": 2}
    layout = Layout.build(sizes, zero_stage=0, sequence_parallel=False)
    activations = {**layout.rules["activations"], **changes}
    return dataclasses.replace(layout, rules={**layout.rules, "activations": activations})


def _on_mesh(layout: Layout, *trees):
    """The arrays replicated over the layout's devices (a jitted step's inputs live there)."""
    return jax.device_put(trees, NamedSharding(layout.mesh, P()))


def test_ring_attention_goes_round_the_axis_of_the_layouts_seq_rule(monkeypatch):
    """Rules that split the sequence over `data` (4 devices) and the batch over `context` (2):
    inside `Layout.scope()` ring attention goes round `data`, on inputs laid out for a ring of
    4, and the logits equal the single-device model's. Read from the static table, the ring
    goes round `context` (2 devices) and the logits come out wrong."""
    import jaxpar.models.layers as layers_lib  # the attention layer, which starts the ring
    from jaxpar.parallel.ring_attention import permute_from_layout, permute_to_layout

    layout = _layout_with_activation_rules(seq=("data",), act_seq=("data",), batch=("context",))
    cfg = tiny_config().model
    tokens = jax.random.randint(jax.random.key(0), (2, 32), 0, cfg.vocab_size)
    positions = jnp.broadcast_to(jnp.arange(32), tokens.shape)
    segments = jnp.broadcast_to((jnp.arange(32) >= 20).astype(jnp.int32), tokens.shape)
    want = Transformer(cfg, rngs=nnx.Rngs(0))(tokens, positions, segments)[0]
    # The same weights (same seed), attention as a ring on inputs in its zigzag order.
    graphdef, params = nnx.split(Transformer(cfg, rngs=nnx.Rngs(0), context_layout="zigzag"))
    ring_order = functools.partial(permute_to_layout, context=4, layout="zigzag")

    def ring_logits():
        @jax.jit
        def forward(params, *batch):
            with layout.scope():
                return nnx.merge(graphdef, params)(*batch)[0]

        out = forward(*_on_mesh(layout, params, *map(ring_order, (tokens, positions, segments))))
        return permute_from_layout(out, context=4, layout="zigzag")

    np.testing.assert_allclose(ring_logits(), want, rtol=1e-4, atol=1e-4)
    monkeypatch.setattr(layers_lib, "rules_in_force", lambda: BASE_RULES)  # the static table
    assert float(jnp.max(jnp.abs(ring_logits() - want))) > 1e-2


def _all_to_all_axes(jaxpr) -> set[tuple[str, ...]]:
    """The mesh axes of every all_to_all in a jaxpr, nested jaxprs included."""
    found = set()
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "all_to_all":
            axes = eqn.params["axis_name"]
            found.add(tuple(axes) if isinstance(axes, (tuple, list)) else (axes,))
        for value in eqn.params.values():
            inner = getattr(value, "jaxpr", value)  # a ClosedJaxpr's jaxpr, or a Jaxpr
            if hasattr(inner, "eqns"):
                found |= _all_to_all_axes(inner)
    return found


def test_moe_exchange_goes_over_the_axis_of_the_layouts_experts_rule(monkeypatch):
    """Rules that put the experts over `data` (4 devices): inside `Layout.scope()` the MoE
    layer's all-to-alls swap tokens over `data` and its output equals the single-device one
    (dropless). Read from the static table, the experts stay on the `expert` axis (size 1
    here) and there is no exchange at all."""
    import jaxpar.parallel.experts as experts_lib

    layout = _layout_with_activation_rules(experts=("data",))
    moe = MoEConfig(num_experts=4, top_k=2, capacity_factor=None, dispatch="padded")
    cfg = dataclasses.replace(tiny_config().model, moe=moe)
    graphdef, params = nnx.split(MoEMLP(cfg, nnx.Rngs(0)))
    x = jax.random.normal(jax.random.key(1), (8, 16, cfg.d_model), jnp.float32)
    want = nnx.merge(graphdef, params)(x)[0]

    def scoped():  # a new function each time: jax caches a function's trace
        def layer(params, x):
            with layout.scope():
                return nnx.merge(graphdef, params)(x)[0]

        return layer

    assert _all_to_all_axes(jax.make_jaxpr(scoped())(params, x).jaxpr) == {("data",)}
    np.testing.assert_allclose(jax.jit(scoped())(*_on_mesh(layout, params, x)), want, rtol=1e-5, atol=1e-5)
    monkeypatch.setattr(experts_lib, "rules_in_force", lambda: BASE_RULES)  # the static table
    assert _all_to_all_axes(jax.make_jaxpr(scoped())(params, x).jaxpr) == set()


def test_the_trainer_follows_a_layout_whose_seq_rule_names_another_axis():
    """Rules that put the sequence over `data` (4 devices) and the batch over `context` (2):
    the layout says the ring goes round `data` with 4 devices, and the trainer built on it
    permutes the batch for that ring and trains as one device does (first-step gradients, leaf
    by leaf). A batch permuted for `context`'s 2 devices, as `sizes["context"]` would say,
    hands the ring tokens in the wrong order: its causal mask and the gradients come out wrong."""
    from jaxpar.training.trainer import trainer_for
    from tests.parity import SGD, assert_grads_match, assert_nonzero, parity_trainer, random_batches

    layout = _layout_with_activation_rules(seq=("data",), act_seq=("data",), batch=("context",))
    assert (layout.ring, layout.ring_axis, layout.ring_size) == (True, "data", 4)
    assert not layout.pipelined and layout.sizes["context"] == 2
    cfg = tiny_config(SGD)
    trainer = trainer_for(cfg, layout)
    want_trainer = parity_trainer([], {})
    batch = next(random_batches(cfg, steps=1))

    def first_grads(trainer):
        return jax.device_get(trainer.step_with_grads(trainer.init(), trainer.shard_batch(batch))[2])

    want = first_grads(want_trainer)
    assert_nonzero(want)
    assert_grads_match(first_grads(trainer), want)


def test_the_layouts_row_axes_are_the_pipelines_under_the_default_rules():
    """Layout.row_axes (from the rules) equals `row_axes_for` (what the planner and
    `inspect --schedule` use) for a dense model at every ZeRO stage, with and without sequence
    parallelism; with a `layers` rule the pipeline axis and its size follow it."""
    from jaxpar.parallel.schedule import row_axes_for

    sizes = {a: 1 for a in config_lib.MESH_AXES} | {"pipe": 2, "data": 2, "context": 2}
    for stage in range(4):
        for sp in (False, True):
            layout = Layout.build(sizes, zero_stage=stage, sequence_parallel=sp)
            assert layout.row_axes == row_axes_for(tiny_config().model, stage), (stage, sp)
            assert (layout.pipelined, layout.pipe_axis, layout.stages) == (True, "pipe", 2)
            assert (layout.ring, layout.ring_axis, layout.ring_size) == (True, "context", 2)
    moved = _layout_with_activation_rules(layers=("context",))
    assert (moved.pipelined, moved.pipe_axis, moved.stages) == (True, "context", 2)


def test_output_projections_split_over_fsdp_on_their_first_dim_where_it_divides():
    """`wo` and `w_down` take fsdp on their input dim (heads, d_ff) with tensor, where tensor x
    fsdp divides it, else on `embed` as the other weights do (`sharding.fitted_names`)."""
    from jax.sharding import PartitionSpec as P

    from jaxpar.sharding import fitted_names, logical_to_spec

    rules = make_rules(shard_embed=True, sequence_parallel=False)
    sizes = {"tensor": 2, "fsdp": 4}
    down = fitted_names(("layers", "mlp_in", "embed"), (3, 64, 32), sizes)  # 64 = 8 x 8
    assert logical_to_spec(down, rules) == P("pipe", ("tensor", "fsdp"), None)
    wo = fitted_names(("layers", "heads_in", "head_dim", "embed"), (3, 4, 8, 32), sizes)  # 4 heads
    assert logical_to_spec(wo, rules) == P("pipe", "tensor", None, "fsdp")
    # Below ZeRO-3 the parameters are whole over fsdp: tensor alone, as `heads` and `mlp`.
    whole = make_rules(shard_embed=False, sequence_parallel=False)
    assert logical_to_spec(down, whole) == logical_to_spec(("layers", "mlp", "embed"), whole)
