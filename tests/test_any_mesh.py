"""The public functions of `jaxpar.parallel` on any mesh: meshes built by `jax.make_mesh` with
axes besides the ones a function uses (or without some of them), Explicit and Auto axis types,
inputs unsharded and sharded, inside and outside `jax.jit`, with the mesh passed or set with
`jax.set_mesh`. Each result and gradient must equal a plain single-device computation.

The full product of those dimensions is hundreds of compiles; each list of cases below takes
every value of every dimension at least once, in a few cases. Shapes are tiny, and the
references are computed once (functools.cache). Explicit-axis cases outside jit with the mesh
passed also check JAX's own rule that jax.grad of an explicitly sharded result needs
jax.set_mesh there.
"""

import contextlib
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpar.parallel.experts import moe_mlp, route
from jaxpar.parallel.pipeline import pipeline_value_and_grad, split_microbatches, stack_stages
from jaxpar.parallel.ring_attention import (
    layout_indices,
    permute_from_layout,
    permute_to_layout,
    ring_attention,
    ring_attention_permuted,
)
from jaxpar.parallel.schedule import build_schedule

EXPLICIT, AUTO = AxisType.Explicit, AxisType.Auto
SIX_AXES = ("pipe", "data", "fsdp", "expert", "context", "tensor")
MESHES = {  # name -> (shape, axis names); every one uses all 8 devices
    "data2-context4": ((2, 4), ("data", "context")),
    "data2-context2-tensor2": ((2, 2, 2), ("data", "context", "tensor")),
    "six": ((1, 2, 1, 1, 2, 2), SIX_AXES),  # data 2, context 2, tensor 2
    "data2-expert4": ((2, 4), ("data", "expert")),
    "data2-tensor4": ((2, 4), ("data", "tensor")),  # no expert axis
    "replica2-expert4": ((2, 4), ("replica", "expert")),  # an axis no rule names
    "six-moe": ((1, 2, 1, 2, 1, 2), SIX_AXES),  # data 2, expert 2, tensor 2
    "expert2-context2-tensor2": ((2, 2, 2), ("expert", "context", "tensor")),
    "pipe2-data4": ((2, 4), ("pipe", "data")),
    "data2-pipe2-tensor2": ((2, 2, 2), ("data", "pipe", "tensor")),
}
TOLERANCE = 1e-5  # float32, relative to the largest reference value


def make_mesh(name, axis_type):
    shape, names = MESHES[name]
    return jax.make_mesh(shape, names, axis_types=(axis_type,) * len(names))


def put(mesh, x, *spec):
    """x on `mesh` with `spec`, mesh axes the mesh lacks dropped from it."""

    def keep(dim):
        names = tuple(a for a in ((dim,) if isinstance(dim, str) else dim or ()) if a in mesh.shape)
        return names or None

    return jax.device_put(x, NamedSharding(mesh, P(*map(keep, spec))))


def call(fn, args, *, mesh, jit, set_mesh):
    """fn(*args) under jax.jit or not, within jax.set_mesh(mesh) or not."""
    with jax.set_mesh(mesh) if set_mesh else contextlib.nullcontext():
        return (jax.jit(fn) if jit else fn)(*args)


def assert_close(got, want, tolerance=TOLERANCE):
    """Leaf by leaf (in tree order), error relative to the largest reference value."""
    want_leaves = jax.tree_util.tree_flatten_with_path(want)[0]
    got_leaves = jax.tree.leaves(got)
    assert len(got_leaves) == len(want_leaves)
    for (path, w), g in zip(want_leaves, got_leaves):
        g, w = np.asarray(g, np.float64), np.asarray(w, np.float64)
        assert g.shape == w.shape, jax.tree_util.keystr(path)
        error = np.max(np.abs(g - w)) / max(np.max(np.abs(w)), 1e-30)
        assert error <= tolerance, f"{jax.tree_util.keystr(path)}: relative error {error:.1e}"


def assert_explicit_layout(got, like):
    """On Explicit axes every gradient carries its primal's sharding."""
    for g, x in zip(got, like):
        assert jax.typeof(g).sharding.spec == jax.typeof(x).sharding.spec, (jax.typeof(g), jax.typeof(x))


# ----------------------------------------------------------------------------- ring attention

BATCH, SEQ, HEADS, KV_HEADS, HEAD_DIM = 2, 16, 4, 2, 8


@functools.cache
def attention_problem():
    """q, k, v, segment_ids (three packed documents), a cotangent; float32."""
    rng = np.random.default_rng(0)
    normal = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.float32)
    q, cotangent = normal(BATCH, SEQ, HEADS, HEAD_DIM), normal(BATCH, SEQ, HEADS, HEAD_DIM)
    k, v = normal(BATCH, SEQ, KV_HEADS, HEAD_DIM), normal(BATCH, SEQ, KV_HEADS, HEAD_DIM)
    segment_ids = jnp.asarray(np.sort(rng.integers(0, 3, size=(BATCH, SEQ)), axis=1), jnp.int32)
    return q, k, v, segment_ids, cotangent


def attention_grads(attention, q, k, v, segment_ids, cotangent):
    """(out, dq, dk, dv) of sum(attention(q, k, v, segment_ids) * cotangent)."""

    def loss(q, k, v):
        out = attention(q, k, v, segment_ids)
        return jnp.sum(out * cotangent), out

    (_, out), grads = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(q, k, v)
    return out, *grads


@functools.cache
def attention_reference(packed):
    q, k, v, segment_ids, cotangent = attention_problem()

    def attention(q, k, v, segment_ids):
        mask = (
            None if segment_ids is None else (segment_ids[:, None, :, None] == segment_ids[:, None, None, :])
        )
        return jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=True)

    return jax.jit(attention_grads, static_argnums=0)(
        attention, q, k, v, segment_ids if packed else None, cotangent
    )


def permuted_entry_point(q, k, v, segment_ids, *, layout, **options):
    """ring_attention_permuted between permute_to_layout and permute_from_layout."""
    mesh = options["mesh"] if "mesh" in options else jax.sharding.get_abstract_mesh()
    to_layout, from_layout = (
        functools.partial(permute, context=mesh.shape["context"], layout=layout)
        for permute in (permute_to_layout, permute_from_layout)
    )
    segment_ids = None if segment_ids is None else to_layout(segment_ids)
    out = ring_attention_permuted(
        *map(to_layout, (q, k, v)), segment_ids=segment_ids, layout=layout, **options
    )
    return from_layout(out)


# mesh, axis type, spec of q, k, v (None: unsharded), jit, mesh from jax.set_mesh (mesh=None)
# or passed, layout, packed documents, entry point (ring_attention or the permuted one)
HEADS_SHARDED = ("data", None, "tensor")  # batch over data, heads over tensor
RING_CASES = [
    ("six", EXPLICIT, ("data", "context", "tensor"), True, True, "zigzag", True, "permuted"),
    ("six", AUTO, None, False, False, "contiguous", False, "ring"),
    ("data2-context2-tensor2", EXPLICIT, None, False, False, "contiguous", True, "ring"),
    ("data2-context2-tensor2", AUTO, HEADS_SHARDED, True, False, "contiguous", True, "permuted"),
    ("data2-context4", EXPLICIT, HEADS_SHARDED, True, False, "contiguous", True, "ring"),
    ("data2-context4", AUTO, HEADS_SHARDED, False, True, "contiguous", False, "ring"),
]
SET_MESH_MESSAGE = "Please enter your `jit` into a mesh context via `jax.set_mesh`"


@pytest.mark.parametrize("mesh_name,axis_type,spec,jit,from_context,layout,packed,entry", RING_CASES)
def test_ring_attention_on_any_mesh(mesh_name, axis_type, spec, jit, from_context, layout, packed, entry):
    mesh = make_mesh(mesh_name, axis_type)
    q, k, v, segment_ids, cotangent = attention_problem()
    if spec is not None:
        q, k, v = (put(mesh, x, *spec) for x in (q, k, v))
        segment_ids = put(mesh, segment_ids, *spec[:2])
    options = dict(layout=layout) if from_context else dict(layout=layout, mesh=mesh)
    attention = {"ring": ring_attention, "permuted": permuted_entry_point}[entry]
    fn = functools.partial(attention_grads, lambda q, k, v, s: attention(q, k, v, segment_ids=s, **options))
    args = (q, k, v, segment_ids if packed else None, cotangent)
    if axis_type == EXPLICIT and not jit and not from_context:
        # JAX's rule for any explicitly sharded result (see the next test), not ring
        # attention's: outside jit, jax.grad needs jax.set_mesh.
        with pytest.raises(ValueError, match=SET_MESH_MESSAGE):
            fn(*args)
    got = call(fn, args, mesh=mesh, jit=jit, set_mesh=from_context or (axis_type == EXPLICIT and not jit))
    assert_close(got, attention_reference(packed))
    if axis_type == EXPLICIT and spec is not None:
        assert_explicit_layout(got[1:], (q, k, v))


def test_explicit_grad_outside_jit_needs_set_mesh_in_plain_jax():
    """The rule the ring attention case above meets is JAX's own: `(a * 2).sum()` of an
    explicitly sharded array raises the same outside jit without jax.set_mesh."""
    mesh = make_mesh("data2-context4", EXPLICIT)
    plain = jax.device_put(jnp.ones((2, 4)), NamedSharding(mesh, P("data")))
    with pytest.raises(ValueError, match=SET_MESH_MESSAGE):
        jax.grad(lambda a: (a * 2).sum())(plain)
    with jax.set_mesh(mesh):
        assert float(jax.grad(lambda a: (a * 2).sum())(plain).sum()) == 16.0


def test_ring_attention_without_a_mesh_is_a_value_error():
    q, k, v, _, _ = attention_problem()
    with pytest.raises(ValueError, match=r"pass mesh=\.\.\. or set one with jax\.set_mesh"):
        ring_attention(q, k, v)


@pytest.mark.parametrize("axis_type", [EXPLICIT, AUTO])
def test_permute_layouts_keep_any_sharding(axis_type):
    """Round trip with the sequence unsharded, split over `context`, or over two axes."""
    mesh = make_mesh("data2-context2-tensor2", axis_type)
    x = jnp.arange(2 * 16 * 4, dtype=jnp.float32).reshape(2, 16, 4)
    order = layout_indices(16, 4, "zigzag")

    def round_trip(x):
        permuted = permute_to_layout(x, context=4, layout="zigzag")
        return permuted, permute_from_layout(permuted, context=4, layout="zigzag")

    for spec, jit in [
        (("data",), False),
        (("data", "context"), True),
        ((None, ("context", "tensor")), False),
    ]:
        placed = put(mesh, x, *spec)
        permuted, back = call(round_trip, (placed,), mesh=mesh, jit=jit, set_mesh=False)
        np.testing.assert_array_equal(permuted, x[:, order])
        np.testing.assert_array_equal(back, x)
        for y in (permuted, back):
            assert jax.typeof(y).sharding.spec == jax.typeof(placed).sharding.spec


# ----------------------------------------------------------------------------- experts

TOKENS_BATCH, TOKENS_SEQ, EMBED, MLP, EXPERTS = 8, 4, 8, 16, 4


@functools.cache
def moe_problem():
    rng = np.random.default_rng(1)
    normal = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.float32)
    x = normal(TOKENS_BATCH, TOKENS_SEQ, EMBED)
    params = {
        "router": 0.5 * normal(EMBED, EXPERTS),
        "gate": normal(EXPERTS, EMBED, MLP) / np.sqrt(EMBED),
        "up": normal(EXPERTS, EMBED, MLP) / np.sqrt(EMBED),
        "down": normal(EXPERTS, MLP, EMBED) / np.sqrt(MLP),
    }
    return x, params, normal(*x.shape)


def dense_moe(x, params, top_k):
    """Every expert on every token, weighted by the softmax prob of the chosen experts,
    renormalised over the top k when k > 1 (for k = 1 the prob itself: Switch Transformer)."""
    tokens = x.reshape(-1, EMBED)
    probs = jax.nn.softmax(tokens @ params["router"], axis=-1)
    top_probs, top_index = jax.lax.top_k(probs, top_k)
    weights = top_probs / top_probs.sum(-1, keepdims=True) if top_k > 1 else top_probs
    weight = jnp.einsum("tk,tke->te", weights, jax.nn.one_hot(top_index, EXPERTS))  # [T, E]
    hidden = jax.nn.silu(jnp.einsum("td,edm->tem", tokens, params["gate"])) * jnp.einsum(
        "td,edm->tem", tokens, params["up"]
    )
    y = jnp.einsum("te,tem,emd->td", weight, hidden, params["down"])
    return y.reshape(x.shape)


def moe_grads(layer, x, params, cotangent):
    """(y, dx, dparams) of sum(layer(x, params) * cotangent): no aux or z loss."""

    def loss(x, params):
        y = layer(x, params)
        return jnp.sum(y * cotangent), y

    (_, y), grads = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(x, params)
    return y, grads


@functools.cache
def moe_reference(top_k):
    return jax.jit(moe_grads, static_argnums=0)(functools.partial(dense_moe, top_k=top_k), *moe_problem())


# mesh, axis type, inputs sharded (tokens over data/expert/context, experts over expert, mlp over
# tensor), jit, mesh from jax.set_mesh (or passed)
MOE_CASES = [
    ("six-moe", EXPLICIT, True, True, False),
    ("six-moe", AUTO, False, True, True),
    ("data2-tensor4", EXPLICIT, False, False, False),
    ("replica2-expert4", EXPLICIT, True, False, True),
    ("expert2-context2-tensor2", AUTO, True, False, False),
]


@pytest.mark.parametrize("mesh_name,axis_type,sharded,jit,from_context", MOE_CASES)
def test_moe_mlp_on_any_mesh(mesh_name, axis_type, sharded, jit, from_context):
    mesh = make_mesh(mesh_name, axis_type)
    x, params, cotangent = moe_problem()
    if sharded:
        x = put(mesh, x, ("data", "expert"), "context")
        params = {
            "router": params["router"],
            "gate": put(mesh, params["gate"], "expert", None, "tensor"),
            "up": put(mesh, params["up"], "expert", None, "tensor"),
            "down": put(mesh, params["down"], "expert", "tensor"),
        }
    options = {} if from_context else {"mesh": mesh}
    layer = lambda x, p: moe_mlp(x, p, top_k=2, **options)[0]
    fn = functools.partial(moe_grads, layer)
    if axis_type == EXPLICIT and not jit and not from_context:  # JAX's rule, as for the ring
        with pytest.raises(ValueError, match=SET_MESH_MESSAGE):
            fn(x, params, cotangent)
    got = call(
        fn,
        (x, params, cotangent),
        mesh=mesh,
        jit=jit,
        set_mesh=from_context or (axis_type == EXPLICIT and not jit),
    )
    assert_close(got, moe_reference(top_k=2))
    if axis_type == EXPLICIT:  # y laid out like x, and dx too where x was on the mesh
        assert_explicit_layout([got[0], got[1][0]] if sharded else [got[0]], [x, x])


def test_moe_mlp_without_a_mesh_runs_on_one_device():
    x, params, cotangent = moe_problem()
    layer = lambda x, p: moe_mlp(x, p, top_k=2)[0]
    assert_close(moe_grads(layer, x, params, cotangent), moe_reference(top_k=2))


def test_top1_router_gets_the_output_gradient():
    """top_k=1 weights the expert output by its router probability (Switch Transformer), so
    the router learns from the output alone; were the weight renormalised to 1, the router's
    gradient would be exactly zero."""
    x, params, cotangent = moe_problem()
    tokens = x.reshape(-1, EMBED)
    routing = route(tokens, params["router"], top_k=1)
    probs = jax.nn.softmax(tokens @ params["router"], axis=-1)
    np.testing.assert_allclose(routing.expert_weight[:, 0], probs.max(-1), rtol=1e-6)

    mesh = make_mesh("data2-expert4", AUTO)
    layer = lambda x, p: moe_mlp(x, p, mesh=mesh, top_k=1)[0]
    got = jax.jit(moe_grads, static_argnums=0)(layer, x, params, cotangent)
    want = moe_reference(top_k=1)
    router_grad = np.asarray(got[1][1]["router"])
    assert np.max(np.abs(router_grad)) > 1e-2 * np.max(np.abs(np.asarray(got[1][1]["gate"])))
    assert_close(got, want)


# ----------------------------------------------------------------------------- pipeline

STAGES, MICROBATCHES, ROWS, LAYERS, WIDTH = 2, 4, 4, 4, 4


def toy_stage(chunk_params, h):  # chunk_params: [layers_per_chunk, width, width]
    return jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), h, chunk_params)[0]


def toy_head(head_params, h, targets):
    return jnp.sum((h @ head_params - targets) ** 2)


@functools.cache
def pipeline_problem():
    """Layers, head, x, y as numpy arrays (laid out with numpy: no eager JAX op to compile)."""
    rng = np.random.default_rng(2)
    normal = lambda *shape: rng.normal(size=shape).astype(np.float32)
    return (
        normal(LAYERS, WIDTH, WIDTH) / np.sqrt(WIDTH),
        normal(WIDTH, 2),
        normal(MICROBATCHES * ROWS, WIDTH),
        normal(MICROBATCHES * ROWS, 2),
    )


@functools.cache
def pipeline_reference():
    """The unpipelined loss and gradients, laid out like the pipeline's outputs."""
    layers, head, x, y = pipeline_problem()
    plain = lambda layers, head, x: toy_head(head, toy_stage(layers, x), y)
    loss, grads = jax.jit(jax.value_and_grad(plain, argnums=(0, 1, 2)))(layers, head, x)
    d_layers, d_head, dx = map(np.asarray, grads)
    return loss, (stack_stages(d_layers, STAGES), d_head, split_microbatches(dx, MICROBATCHES))


# mesh, axis type, inputs sharded (stages over pipe, microbatch rows over data), jit, set_mesh
PIPELINE_CASES = [
    ("pipe2-data4", EXPLICIT, True, True, False),
    ("pipe2-data4", AUTO, False, False, False),
    ("data2-pipe2-tensor2", EXPLICIT, False, False, True),
    ("data2-pipe2-tensor2", AUTO, True, True, True),
]


@pytest.mark.parametrize("mesh_name,axis_type,sharded,jit,set_mesh", PIPELINE_CASES)
def test_pipeline_value_and_grad_on_any_mesh(mesh_name, axis_type, sharded, jit, set_mesh):
    mesh = make_mesh(mesh_name, axis_type)
    layers, head, x, y = pipeline_problem()
    args = (
        stack_stages(layers, STAGES),
        head,
        split_microbatches(x, MICROBATCHES),
        split_microbatches(y, MICROBATCHES),
    )
    if sharded:
        args = (
            put(mesh, args[0], "pipe"),
            head,
            put(mesh, args[2], None, "data"),
            put(mesh, args[3], None, "data"),
        )
    run = functools.partial(
        pipeline_value_and_grad,
        toy_stage,
        toy_head,
        schedule=build_schedule("1f1b", STAGES, MICROBATCHES),
        mesh=mesh,
    )
    got = call(run, args, mesh=mesh, jit=jit, set_mesh=set_mesh)
    assert_close(got, pipeline_reference())
    if axis_type == EXPLICIT and sharded:  # input gradients laid out like the inputs
        assert_explicit_layout([got[1][2]], [args[2]])
