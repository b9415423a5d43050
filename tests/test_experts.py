"""Expert parallelism: every layout equals one device and a dense loop over experts."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpar.parallel.experts import moe_mlp, route, slot_positions

AXES = ("pipe", "data", "fsdp", "expert", "context", "tensor")
BATCH, SEQ, EMBED, MLP, EXPERTS, TOP_K = 8, 8, 16, 32, 8, 2
AUX_WEIGHT, Z_WEIGHT = 0.1, 0.01
TOLERANCE = 1e-5  # float32 relative error


def make_mesh(**sizes):
    shape = tuple(sizes.get(name, 1) for name in AXES)
    devices = np.array(jax.devices()[: int(np.prod(shape))]).reshape(shape)
    return Mesh(devices, AXES)


def make_inputs(num_experts=EXPERTS, router_bias=None, seed=0):
    keys = jax.random.split(jax.random.key(seed), 6)
    x = jax.random.normal(keys[0], (BATCH, SEQ, EMBED), jnp.float32)
    router = 0.3 * jax.random.normal(keys[1], (EMBED, num_experts), jnp.float32)
    if router_bias is not None:  # a constant input feature steers every token the same way
        x = x.at[..., 0].set(1.0)
        router = router.at[0].add(jnp.asarray(router_bias, jnp.float32))
    params = {
        "router": router,
        "gate": jax.random.normal(keys[2], (num_experts, EMBED, MLP)) / np.sqrt(EMBED),
        "up": jax.random.normal(keys[3], (num_experts, EMBED, MLP)) / np.sqrt(EMBED),
        "down": jax.random.normal(keys[4], (num_experts, MLP, EMBED)) / np.sqrt(MLP),
    }
    cotangent = jax.random.normal(keys[5], (BATCH, SEQ, EMBED), jnp.float32)
    return x, params, cotangent


INPUTS = make_inputs()
SKEWED = make_inputs(router_bias=[6.0, 5.0, 0, 0, 0, 0, 0, 0])  # nearly all tokens -> experts 0, 1


def dense_reference(x, params, top_k=TOP_K):
    """Every expert on every token, a Python loop over experts, weighted by the top-k router."""
    tokens = x.reshape(-1, EMBED)
    logits = tokens @ params["router"]
    probs = jax.nn.softmax(logits, axis=-1)
    top_probs, top_index = jax.lax.top_k(probs, top_k)
    weights = top_probs / top_probs.sum(-1, keepdims=True)
    y = jnp.zeros_like(tokens)
    for e in range(params["router"].shape[1]):
        hidden = jax.nn.silu(tokens @ params["gate"][e]) * (tokens @ params["up"][e])
        weight_e = jnp.sum(jnp.where(top_index == e, weights, 0.0), axis=-1)
        y = y + weight_e[:, None] * (hidden @ params["down"][e])
    return y.reshape(x.shape), aux_and_z(logits, top_index)


def aux_and_z(logits, top_index):
    """Switch aux loss E * sum_e f_e p_e (f_e without gradient) and z-loss mean(lse^2)."""
    num_experts = logits.shape[-1]
    probs = jax.nn.softmax(logits, axis=-1)
    routed = jnp.zeros(num_experts).at[top_index.reshape(-1)].add(1.0) / top_index.size
    aux = num_experts * jnp.sum(jax.lax.stop_gradient(routed) * probs.mean(0))
    z = jnp.mean(jax.nn.logsumexp(logits, axis=-1) ** 2)
    return aux, z


def objective(y, aux, z, cotangent):
    return jnp.sum(y * cotangent) + AUX_WEIGHT * aux + Z_WEIGHT * z


def shard_inputs(mesh, x, params):
    """x split over the batch axes; expert weights over expert, fsdp (embed) and tensor (mlp)."""
    specs = {
        "router": P("fsdp", None),
        "gate": P("expert", "fsdp", "tensor"),
        "up": P("expert", "fsdp", "tensor"),
        "down": P("expert", "tensor", "fsdp"),
    }
    x = jax.device_put(x, NamedSharding(mesh, P(("data", "fsdp", "expert"), "context")))
    params = {k: jax.device_put(v, NamedSharding(mesh, specs[k])) for k, v in params.items()}
    return x, params


@functools.cache
def compiled_step(layout, capacity_factor=None, compute_dtype=jnp.float32, inputs="random"):
    """Jitted value-and-grad of the objective for a layout given as sorted (axis, size) pairs."""
    mesh = make_mesh(**dict(layout))
    x, params, cotangent = {"random": INPUTS, "skewed": SKEWED}[inputs]
    x, params = shard_inputs(mesh, x, params)

    def loss(x, params):
        y, stats = moe_mlp(
            x, params, mesh=mesh, top_k=TOP_K, capacity_factor=capacity_factor, compute_dtype=compute_dtype
        )
        return objective(y, stats["aux_loss"], stats["z_loss"], cotangent), (y, stats)

    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))
    compiled = step.lower(x, params).compile()
    (value, (y, stats)), grads = compiled(x, params)
    return compiled, jax.tree.map(np.asarray, (value, y, stats, grads))


def run(capacity_factor=None, compute_dtype=jnp.float32, inputs="random", **sizes):
    layout = tuple(sorted(sizes.items()))
    return compiled_step(layout, capacity_factor, compute_dtype, inputs)[1]


@functools.cache
def reference(inputs="random"):
    """The dense loop's value, output, losses and gradients, on one device. Jitted: run op by op,
    its few hundred eager dispatches took a minute on a 2-core machine."""
    x, params, cotangent = {"random": INPUTS, "skewed": SKEWED}[inputs]

    def loss(x, params):
        y, (aux, z) = dense_reference(x, params)
        return objective(y, aux, z, cotangent), (y, aux, z)

    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))
    (value, (y, aux, z)), grads = step(x, params)
    return jax.tree.map(np.asarray, (value, y, {"aux_loss": aux, "z_loss": z}, grads))


def assert_close(actual, expected, tolerance=TOLERANCE, what=""):
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    error = np.max(np.abs(actual - expected)) / max(np.max(np.abs(expected)), 1e-30)
    assert error <= tolerance, f"{what}: relative error {error:.2e} > {tolerance:.0e}"


def assert_same_run(actual, expected, tolerance=TOLERANCE):
    _, y, stats, grads = actual
    _, y_ref, stats_ref, grads_ref = expected
    assert_close(y, y_ref, tolerance, "y")
    for name in ("aux_loss", "z_loss"):
        assert_close(stats[name], stats_ref[name], tolerance, name)
    assert_close(grads[0], grads_ref[0], tolerance, "grad x")
    for name in grads_ref[1]:
        assert_close(grads[1][name], grads_ref[1][name], tolerance, f"grad {name}")


@pytest.mark.parametrize("inputs", ["random", "skewed"])
def test_single_device_matches_dense_loop(inputs):
    assert_same_run(run(inputs=inputs), reference(inputs))


LAYOUTS = [
    {"expert": 2},
    {"expert": 4},
    {"expert": 8},
    {"expert": 4, "data": 2},
    {"expert": 2, "tensor": 2, "fsdp": 2},
]


@pytest.mark.parametrize("sizes", LAYOUTS, ids=lambda s: "-".join(f"{k}{v}" for k, v in s.items()))
def test_dropless_expert_parallel_matches_single_device(sizes):
    actual, single = run(**sizes), run()
    assert_same_run(actual, single)
    assert_same_run(actual, reference())
    stats = actual[2]
    assert stats["dropped_fraction"] == 0.0
    np.testing.assert_array_equal(stats["expert_load"], single[2]["expert_load"])
    assert stats["expert_load"].sum() == BATCH * SEQ * TOP_K


def test_dropless_drops_nothing_when_routing_is_skewed():
    actual = run(inputs="skewed", expert=4)
    load = actual[2]["expert_load"]
    assert load[0] + load[1] > 0.9 * BATCH * SEQ * TOP_K, load  # the worst case is exercised
    assert actual[2]["dropped_fraction"] == 0.0
    assert_same_run(actual, reference("skewed"))


def test_aux_and_z_losses_match_formula():
    x, params, _ = INPUTS
    logits = np.asarray(x, np.float64).reshape(-1, EMBED) @ np.asarray(params["router"], np.float64)
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    top_index = np.argsort(-probs, axis=-1)[:, :TOP_K]
    routed_fraction = np.bincount(top_index.reshape(-1), minlength=EXPERTS) / top_index.size
    aux = EXPERTS * np.sum(routed_fraction * probs.mean(0))
    lse = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
    z = np.mean(lse**2)
    for stats in (run()[2], run(expert=4, data=2)[2]):
        assert_close(stats["aux_loss"], aux, 1e-5, "aux_loss")
        assert_close(stats["z_loss"], z, 1e-5, "z_loss")
        np.testing.assert_array_equal(stats["expert_load"], np.bincount(top_index.reshape(-1)))


def numpy_positions(expert_index, num_experts):
    """Choice-major first come first served: all first choices in token order, then seconds."""
    tokens, top_k = expert_index.shape
    position = np.zeros_like(expert_index)
    filled = np.zeros(num_experts, np.int64)
    for choice in range(top_k):
        for token in range(tokens):
            e = expert_index[token, choice]
            position[token, choice] = filled[e]
            filled[e] += 1
    return position


def test_slot_positions_are_choice_major_first_come_first_served():
    expert_index = np.array([[0, 1], [1, 0], [0, 2], [1, 0], [3, 2]], np.int32)
    expected = numpy_positions(expert_index, 4)
    np.testing.assert_array_equal(slot_positions(jnp.asarray(expert_index), 4), expected)
    # expert 1: the first choices of tokens 1 and 3 come before token 0's second choice
    assert expected[1, 0] == 0 and expected[3, 0] == 1 and expected[0, 1] == 2


def numpy_capacity_reference(x, params, token_shards, capacity_factor):
    """Each batch shard routes its own tokens with per-expert capacity, in float64."""
    x = np.asarray(x, np.float64)
    p = {k: np.asarray(v, np.float64) for k, v in params.items()}
    outputs, kept_total = [], 0
    for block in np.split(x, token_shards):
        tokens = block.reshape(-1, EMBED)
        logits = tokens @ p["router"]
        probs = np.exp(logits - logits.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        top_index = np.argsort(-probs, axis=-1)[:, :TOP_K]
        top_probs = np.take_along_axis(probs, top_index, -1)
        weights = top_probs / top_probs.sum(-1, keepdims=True)
        capacity = int(np.ceil(capacity_factor * len(tokens) * TOP_K / EXPERTS))
        kept = numpy_positions(top_index, EXPERTS) < capacity
        kept_total += kept.sum()
        y = np.zeros_like(tokens)
        for t, k in zip(*np.nonzero(kept)):
            e = top_index[t, k]
            silu_gate = tokens[t] @ p["gate"][e]
            silu_gate = silu_gate / (1 + np.exp(-silu_gate))
            y[t] += weights[t, k] * ((silu_gate * (tokens[t] @ p["up"][e])) @ p["down"][e])
        outputs.append(y.reshape(block.shape))
    return np.concatenate(outputs), 1 - kept_total / (x.shape[0] * x.shape[1] * TOP_K)


@pytest.mark.parametrize("capacity_factor", [0.5, 1.0])
def test_capacity_mode_drops_exactly_the_slots_beyond_capacity(capacity_factor):
    _, y, stats, _ = run(capacity_factor=capacity_factor, expert=4, data=2)
    x, params, _ = INPUTS
    y_ref, dropped_ref = numpy_capacity_reference(x, params, 8, capacity_factor)
    assert 0 < dropped_ref < 1
    assert_close(stats["dropped_fraction"], dropped_ref, 1e-6, "dropped_fraction")
    assert_close(y, y_ref, TOLERANCE, "y")


def test_bfloat16_compute_close_to_float32():
    actual = run(compute_dtype=jnp.bfloat16, expert=4)
    assert actual[1].dtype == np.float32
    assert_same_run(actual, run(), tolerance=3e-2)


def test_route_weights_are_renormalised_top_k():
    x, params, _ = INPUTS
    routing = route(x.reshape(-1, EMBED), params["router"], top_k=TOP_K)
    np.testing.assert_allclose(np.asarray(routing.expert_weight).sum(-1), 1.0, rtol=1e-6)
    probs = np.asarray(jax.nn.softmax(x.reshape(-1, EMBED) @ params["router"]))
    chosen = np.take_along_axis(probs, np.asarray(routing.expert_index), -1)
    assert np.all(chosen.min(-1) >= np.sort(probs, -1)[:, -TOP_K])


def test_num_experts_not_divisible_by_expert_axis_raises():
    x, params, _ = make_inputs(num_experts=6)
    with pytest.raises(ValueError, match=r"num_experts=6.*'expert' of size 4"):
        moe_mlp(x, params, mesh=make_mesh(expert=4), top_k=TOP_K)


def test_expert_parallel_step_issues_all_to_all():
    compiled, _ = compiled_step((("expert", 4), ("data", 2)))
    assert "all-to-all" in compiled.as_text()
