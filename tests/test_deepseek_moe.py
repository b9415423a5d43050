"""DeepSeek-V3 routing (model.moe.score=sigmoid, groups, routed_scale, seq_aux_loss_weight) and
loss-free balancing (model.moe.bias_update_rate): the router against a numpy transcription of
its rules, gradient parity with one device on every kind of layout, and the correction bias --
no gradient, no weight decay, moved by hand-countable loads on one device and on an expert mesh,
narrowing the load spread in training, and exact across a checkpoint resume.

The bias tests start from a crafted state whose routing numpy can count: attention's output
projection zeroed, so the one MoE layer's input is the normed embedding of each token, and the
embedding a shared direction plus per-token noise, so that the router's loads start skewed but
every token can be moved by a small bias."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpar import checks as checks_lib
from jaxpar.config import ConfigError
from jaxpar.inspect import compile_step
from jaxpar.parallel.routing import RouterSpec, route
from jaxpar.training.checkpoint import Checkpointer
from tests.parity import (
    assert_nonzero,
    assert_same_steps,
    parity_trainer,
    random_batches,
    run_parity,
    tiny_config,
    trainer_on,
)

E, K, GROUPS, KEEP, SCALE = 8, 2, 4, 2, 2.5
DS = [
    f"model.moe.num_experts={E}",
    f"model.moe.top_k={K}",
    "model.moe.shared_experts=1",
    "model.moe.score=sigmoid",
    f"model.moe.groups={GROUPS}",
    f"model.moe.topk_groups={KEEP}",
    f"model.moe.routed_scale={SCALE}",
    "model.moe.aux_loss_weight=0",
    "train.batch_size=16",
    "train.seq_len=16",
]


# --- The router against its rules, in numpy ---------------------------------------------------


def numpy_route(x, w, bias, rows):
    """DeepSeek-V3's router, written from the rules: (expert index, weights, sequence loss)."""
    scores = 1 / (1 + np.exp(-(x.astype(np.float64) @ w)))  # [T, E]
    choice = (scores + bias).reshape(len(x), GROUPS, E // GROUPS)
    group_score = np.sort(choice, axis=-1)[..., -2:].sum(-1)  # the sum of each group's top 2
    kept = np.argsort(-group_score, axis=-1, kind="stable")[:, :KEEP]
    masked = np.full_like(choice, -np.inf)
    for t in range(len(x)):
        masked[t, kept[t]] = choice[t, kept[t]]
    index = np.argsort(-masked.reshape(len(x), E), axis=-1, kind="stable")[:, :K]
    top = np.take_along_axis(scores, index, -1)
    weights = top / top.sum(-1, keepdims=True) * SCALE
    affinity = (scores / scores.sum(-1, keepdims=True)).reshape(rows, -1, E)
    chosen = np.zeros((len(x), E))
    np.put_along_axis(chosen, index, 1.0, -1)
    seq = affinity.shape[1]
    f = E / (K * seq) * chosen.reshape(rows, seq, E).sum(1)
    return index, weights, np.mean(np.sum(f * affinity.mean(1), -1))


def test_sigmoid_group_router_follows_the_rules():
    """Bugs it catches: the bias added to the weights too, a group scored by its top 1 instead of
    its top 2, the weights not renormalised or not scaled, the sequence loss from a softmax or
    over the batch instead of per sequence."""
    rng = np.random.default_rng(0)
    rows, seq = 4, 16
    x = rng.normal(size=(rows * seq, 16)).astype(np.float32)
    w = (0.5 * rng.normal(size=(16, E))).astype(np.float32)
    bias = (0.3 * rng.normal(size=E)).astype(np.float32)  # large enough to change choices
    spec = RouterSpec(True, "sigmoid", GROUPS, KEEP, SCALE, True)
    got = jax.jit(lambda x, w, b: route(x, w, top_k=K, spec=spec, bias=b, rows=rows))(x, w, bias)
    index, weights, seq_aux = numpy_route(x, w, bias, rows)
    np.testing.assert_array_equal(np.asarray(got.expert_index), index)
    np.testing.assert_allclose(got.expert_weight, weights, rtol=1e-5)
    np.testing.assert_allclose(got.seq_aux_loss, seq_aux, rtol=1e-5)
    np.testing.assert_array_equal(got.expert_load, np.bincount(index.reshape(-1), minlength=E))
    # The bias moves choices but not weights: without it, other experts for some tokens.
    unbiased = route(jnp.asarray(x), jnp.asarray(w), top_k=K, spec=spec, rows=rows)
    assert np.any(np.asarray(unbiased.expert_index) != index)


@pytest.mark.parametrize(
    "override, fragment",
    [
        ("model.moe.groups=3", "model.moe.groups=3 must divide model.moe.num_experts=8"),
        ("model.moe.groups=8", "groups of at least 2 experts"),
        ("model.moe.topk_groups=5", "model.moe.topk_groups=5 must be between 1 and model.moe.groups=4"),
        ("model.moe.top_k=6", "model.moe.top_k=6 exceeds the 4 experts of model.moe.topk_groups=2"),
        ("model.moe.score=softmax", "set model.moe.score=sigmoid or the rate to 0"),
    ],
)
def test_router_settings_are_checked(override, fragment):
    cfg = tiny_config(DS + ["model.moe.bias_update_rate=0.01", override])
    with pytest.raises(ConfigError, match=fragment):
        checks_lib.validate(cfg, 8)


# --- Gradient parity with one device ----------------------------------------------------------

# Every mesh axis is in one of the two (the bias test below has an expert mesh of its own too).
# Every layout runs two microsteps per step (accumulated, or two pipeline microbatches), so one
# single-device reference serves all; the bias moves (rate 0.01, beyond the router's initial
# score differences), so the second step routes on a non-zero bias.
PARITY = DS + ["model.moe.seq_aux_loss_weight=0.01", "model.moe.bias_update_rate=0.01"]
LAYOUTS = {
    "data2_fsdp2_tensor2": ({"data": 2, "fsdp": 2, "tensor": 2}, ["parallel.grad_accum=2"]),
    "pipe2_context2_expert2": ({"pipe": 2, "context": 2, "expert": 2}, ["parallel.microbatches=2"]),
}
BIAS_GRAD = ("blocks", "mlp", "router_bias")


def _without_bias(tree):
    return {
        **tree,
        "blocks": {
            **tree["blocks"],
            "mlp": {k: v for k, v in tree["blocks"]["mlp"].items() if k != "router_bias"},
        },
    }


@pytest.fixture(scope="module")
def single_device():
    trainer = parity_trainer(PARITY + ["parallel.grad_accum=2"], {})
    return run_parity(trainer, compile_step(trainer), random_batches(trainer.cfg, steps=2))


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_deepseek_routing_trains_as_on_one_device(layout, single_device):
    """Bugs it catches: a statistic (loads, the sequence loss's counts or affinities) summed over
    too few or too many axes, the bias update from one device's counts."""
    mesh, extra = LAYOUTS[layout]
    trainer = parity_trainer(PARITY + extra, mesh)
    got = run_parity(
        trainer,
        compile_step(trainer),
        random_batches(trainer.cfg, steps=2),
        single_device.init,
        along=single_device,
    )
    assert_nonzero(_without_bias(single_device.grads))
    assert_same_steps(got, single_device)
    for key in ("seq_aux_loss", "expert_load_min", "expert_load_max"):
        np.testing.assert_allclose(
            [h[key] for h in got.history], [h[key] for h in single_device.history], rtol=1e-5, err_msg=key
        )
    assert np.any(single_device.ends[0]["params"]["blocks"]["mlp"]["router_bias"])


# --- The correction bias ----------------------------------------------------------------------

RATE = 0.05
BIASED = DS + [
    "model.n_layers=1",
    f"model.moe.bias_update_rate={RATE}",
    "optimizer.lr=1e-4",
    "optimizer.warmup_steps=0",
    "optimizer.weight_decay=1.0",
]


def skewed_batch(cfg, seed=1):
    rng = np.random.default_rng(seed)
    shape = (cfg.train.batch_size, cfg.train.seq_len)
    return {
        "inputs": rng.integers(0, 264, shape).astype(np.int32),
        "targets": rng.integers(0, 264, shape).astype(np.int32),
        "positions": np.broadcast_to(np.arange(shape[1], dtype=np.int32), shape).copy(),
        "segment_ids": np.ones(shape, np.int32),
        "loss_mask": np.ones(shape, np.float32),
    }


def crafted_state(trainer, seed=2):
    """The trainer's initial state (numpy) with the MoE layer's input made countable (module
    docstring) and a small non-zero bias (which no optimizer may move)."""
    state = jax.device_get(trainer.init())
    rng = np.random.default_rng(seed)
    params = state["params"]
    shared = rng.normal(size=32)
    params["embedding"] = (shared + 0.7 * rng.normal(size=params["embedding"].shape)).astype(np.float32)
    params["blocks"]["attn"]["wo"] = np.zeros_like(params["blocks"]["attn"]["wo"])
    params["blocks"]["mlp"]["router"] = (0.4 * rng.normal(size=(1, 32, E))).astype(np.float32)
    params["blocks"]["mlp"]["router_bias"] = (1e-3 * rng.normal(size=(1, E))).astype(np.float32)
    return state


def hand_load(state, batch, cfg):
    """Each expert's (token, choice) pairs, counted in numpy from the crafted state."""
    params = state["params"]
    emb = params["embedding"][batch["inputs"]].reshape(-1, 32).astype(np.float64)
    x = emb / np.sqrt(np.mean(emb**2, -1, keepdims=True) + cfg.model.norm_eps)
    x = x * params["blocks"]["mlp_norm"]["scale"][0]
    index = numpy_route(
        x, params["blocks"]["mlp"]["router"][0], params["blocks"]["mlp"]["router_bias"][0], 1
    )[0]
    return np.bincount(index.reshape(-1), minlength=E)


@pytest.fixture(scope="module")
def one_device():
    return trainer_on(BIASED, {})


def step_once(trainer, state):
    batch = skewed_batch(trainer.cfg)
    new, metrics, grads = trainer.step_with_grads(
        jax.device_put(state, trainer.state_shardings), trainer.shard_batch(batch)
    )
    return jax.device_get(new), metrics, jax.device_get(grads)


def expected_bias(state, cfg):
    load = hand_load(state, skewed_batch(cfg), cfg).astype(np.float32)
    assert load.max() > 1.2 * load.mean(), load  # skewed: the update has work to do
    bias = state["params"]["blocks"]["mlp"]["router_bias"]
    return bias + np.float32(RATE) * np.sign(load.mean() - load)


def test_bias_update_matches_a_hand_count_on_one_device(one_device):
    """Bugs it catches: the update's sign flipped, the step not applied, loads not those routed."""
    trainer = one_device
    state = crafted_state(trainer)
    new, _, _ = step_once(trainer, state)
    np.testing.assert_array_equal(
        new["params"]["blocks"]["mlp"]["router_bias"], expected_bias(state, trainer.cfg)
    )


def test_bias_gets_no_gradient_and_no_weight_decay(one_device):
    """AdamW at weight decay 1 and a zero gradient leave the bias exactly where the update puts
    it. Bugs it catches: the bias in the weights (a gradient, so Adam moves it by ~lr), the bias
    not masked from weight decay."""
    trainer = one_device
    state = crafted_state(trainer)
    new, _, grads = step_once(trainer, state)
    assert not np.any(grads["blocks"]["mlp"]["router_bias"])
    assert np.any(grads["blocks"]["mlp"]["router"])
    np.testing.assert_array_equal(
        new["params"]["blocks"]["mlp"]["router_bias"], expected_bias(state, trainer.cfg)
    )


def test_bias_update_on_an_expert_mesh_matches_the_hand_count(one_device):
    """The loads summed over every device that routed tokens. Bug it catches: a device's own (or
    its expert group's own) counts."""
    trainer = trainer_on(BIASED, {"expert": 4, "data": 2})
    state = crafted_state(one_device)
    new, _, _ = step_once(trainer, state)
    np.testing.assert_array_equal(
        new["params"]["blocks"]["mlp"]["router_bias"], expected_bias(state, trainer.cfg)
    )


def spread(trainer, state, steps):
    """max / mean expert load at each of `steps` steps on the same skewed batch."""
    batch = trainer.shard_batch(skewed_batch(trainer.cfg))
    state, out = jax.device_put(state, trainer.state_shardings), []
    mean = trainer.cfg.train.batch_size * trainer.cfg.train.seq_len * K / E
    for _ in range(steps):
        state, metrics = trainer.step_with_grads(state, batch)[:2]  # (one compile for all tests)
        out.append(float(metrics["expert_load_max"]) / mean)
    return out, jax.device_get(state)


def test_loss_free_balancing_narrows_the_load_spread(one_device):
    """Bugs it catches: the sign flipped (the spread grows), no update (it stays)."""
    on = spread(one_device, crafted_state(one_device), 16)[0]
    off_trainer = trainer_on([*BIASED, "model.moe.bias_update_rate=0"], {})
    off = spread(off_trainer, crafted_state(off_trainer), 16)[0]
    assert on[0] == off[0] > 1.3, (on, off)
    assert max(on[-6:]) < 0.8 * on[0], on
    assert min(off[-6:]) > 0.95 * off[0], off


def test_resume_carries_the_bias_exactly(one_device, tmp_path):
    """Bug it catches: a resumed run starting from another bias than the one saved."""
    trainer = one_device
    _, saved = spread(trainer, crafted_state(trainer), 2)
    assert np.any(
        saved["params"]["blocks"]["mlp"]["router_bias"]
        != crafted_state(trainer)["params"]["blocks"]["mlp"]["router_bias"]
    )
    checkpointer = Checkpointer(str(tmp_path))
    checkpointer.save(2, jax.device_put(saved, trainer.state_shardings), {}, force=True)
    checkpointer.close()
    restored, _, step = Checkpointer(str(tmp_path)).restore(trainer.state_shape, trainer.state_shardings)
    assert step == 2
    for name in ("router_bias", "router"):
        np.testing.assert_array_equal(
            jax.device_get(restored)["params"]["blocks"]["mlp"][name], saved["params"]["blocks"]["mlp"][name]
        )
    straight = spread(trainer, saved, 2)
    resumed = spread(trainer, jax.device_get(restored), 2)
    assert straight[0] == resumed[0]
    for a, b in zip(jax.tree.leaves(straight[1]), jax.tree.leaves(resumed[1]), strict=True):
        np.testing.assert_array_equal(a, b)
