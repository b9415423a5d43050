"""Every GSPMD layout trains the single-device model, and holds and moves the bytes it promises.

Each layout is compiled once (module fixture); the compiled step both runs 5 training steps and is
inspected (memory per device, collectives in the HLO).
"""

import jax
import numpy as np
import pytest

from jaxpar import config as config_lib
from jaxpar import data as data_lib
from jaxpar.config import MESH_AXES
from jaxpar.inspect import compile_step, report, zero_formula
from jaxpar.train import build_trainer

STEPS = 5
TINY = [
    "model.vocab_size=264", "model.d_model=64", "model.n_layers=2", "model.n_heads=8",
    "model.n_kv_heads=8", "model.d_ff=128", "model.dtype=float32", "train.batch_size=16",
    "train.seq_len=32", f"train.steps={STEPS}", "optimizer.warmup_steps=2", "optimizer.lr=1e-2",
    "data.max_documents=30",
]
ONE = {axis: 1 for axis in MESH_AXES}

LAYOUTS = {
    "data8": ({"data": 8}, ["parallel.zero_stage=0"]),
    "fsdp8_zero1": ({"fsdp": 8}, ["parallel.zero_stage=1"]),
    "fsdp8_zero2": ({"fsdp": 8}, ["parallel.zero_stage=2"]),
    "fsdp8_zero3": ({"fsdp": 8}, ["parallel.zero_stage=3"]),
    "tensor8": ({"tensor": 8}, ["parallel.zero_stage=0"]),
    "data4_tensor2_sp": ({"data": 4, "tensor": 2}, ["parallel.zero_stage=0", "parallel.sequence_parallel=true"]),
    "data2_fsdp2_tensor2": ({"data": 2, "fsdp": 2, "tensor": 2}, ["parallel.zero_stage=3"]),
    "data2_fsdp2_tensor2_accum2": ({"data": 2, "fsdp": 2, "tensor": 2}, ["parallel.zero_stage=3", "parallel.grad_accum=2"]),
}


def make_config(mesh: dict, extra: list[str]):
    axes = [f"mesh.{a}={mesh.get(a, 1)}" for a in MESH_AXES]
    cfg = config_lib.load_config(None, TINY + axes + extra)
    return cfg, config_lib.validate(cfg, int(np.prod([mesh.get(a, 1) for a in MESH_AXES])))


@pytest.fixture(scope="module")
def batches():
    cfg, _ = make_config({}, [])
    iterator = data_lib.make_iterator(
        data_lib.batch_dataset(
            data_lib.pack(data_lib.read_documents(cfg.data), data_lib.ByteTokenizer(), cfg.train.seq_len),
            global_batch=cfg.train.batch_size, seed=0))
    return [next(iterator) for _ in range(STEPS)]


def run(trainer, compiled, batches):
    state = trainer.init()
    losses = []
    for batch in batches:
        state, metrics = compiled(state, trainer.shard_batch(batch))
        losses.append(float(metrics["loss"]))
    return np.array(losses), state


@pytest.fixture(scope="module")
def single_device(batches):
    cfg, sizes = make_config({}, ["parallel.zero_stage=0"])
    trainer = build_trainer(cfg, sizes, devices=jax.devices()[:1])
    return run(trainer, compile_step(trainer), batches)


@pytest.fixture(scope="module")
def layouts():
    return {}


@pytest.fixture
def layout(request, layouts, batches):
    """(losses, final state, inspect report) of a layout, computed once per module."""
    name = request.param
    if name not in layouts:
        cfg, sizes = make_config(*LAYOUTS[name])
        trainer = build_trainer(cfg, sizes)
        compiled = compile_step(trainer)
        losses, state = run(trainer, compiled, batches)
        layouts[name] = (losses, state, report(trainer, compiled, compare=True))
    return layouts[name]


@pytest.mark.parametrize("layout", list(LAYOUTS), indirect=True)
def test_layout_matches_single_device(layout, single_device):
    losses, state, _ = layout
    ref_losses, ref_state = single_device
    assert ref_losses[-1] < ref_losses[0]
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    for got, want in zip(jax.tree.leaves(state["params"]), jax.tree.leaves(ref_state["params"])):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-4, atol=2e-6)


def _state_bytes(r):
    m = r["memory_per_device"]
    return m["params"] + m["optimizer"]


@pytest.mark.parametrize("layout", ["fsdp8_zero3"], indirect=True)
def test_zero3_holds_an_eighth_of_params_and_optimizer(layout):
    r = layout[2]
    stage0 = zero_formula(r["params"], 0, 1, 1)
    assert _state_bytes(r) <= (stage0["params"] + stage0["optimizer"]) / 8 * 1.1
    # The compiled program's own argument buffers agree (state + batch).
    assert r["memory_per_device"]["arguments"] <= (stage0["params"] + stage0["optimizer"]) / 8 * 1.1 + 16 * 32 * 4 * 5


@pytest.mark.parametrize("layout", ["fsdp8_zero1", "fsdp8_zero2"], indirect=True)
def test_zero1_and_zero2_match_their_formula(layout):
    compare = layout[2]["compare"]
    assert compare["ratio"] == pytest.approx(1.0, rel=0.10)


@pytest.mark.parametrize("layout", ["data8"], indirect=True)
def test_data_parallel_all_reduces_the_gradients_once(layout):
    r = layout[2]
    param_bytes = 4 * r["params"]
    collectives = r["collectives"]
    assert set(collectives) == {"all-reduce"}
    assert collectives["all-reduce"]["bytes"] == pytest.approx(param_bytes, rel=0.10)


@pytest.mark.parametrize("layout", ["fsdp8_zero3"], indirect=True)
def test_zero3_gathers_params_and_reduce_scatters_grads(layout):
    r = layout[2]
    param_bytes = 4 * r["params"]
    c = r["collectives"]
    # Every parameter is gathered for the forward (and again for the backward, under remat or not).
    assert c["all-gather"]["bytes"] >= param_bytes
    assert c["reduce-scatter"]["bytes"] == pytest.approx(param_bytes, rel=0.10)
    assert c.get("all-reduce", {"bytes": 0})["bytes"] < 0.01 * param_bytes


@pytest.mark.parametrize("layout", ["fsdp8_zero2"], indirect=True)
def test_zero2_reduce_scatters_grads_and_gathers_updated_params(layout):
    r = layout[2]
    param_bytes = 4 * r["params"]
    c = r["collectives"]
    assert c["reduce-scatter"]["bytes"] == pytest.approx(param_bytes, rel=0.10)
    assert c["all-gather"]["bytes"] == pytest.approx(param_bytes, rel=0.10)
    assert c.get("all-reduce", {"bytes": 0})["bytes"] < 0.01 * param_bytes


@pytest.mark.parametrize("layout", ["data4_tensor2_sp"], indirect=True)
def test_sequence_parallel_gathers_and_scatters_activations(layout):
    c = layout[2]["collectives"]
    # Megatron-SP: all-gather the sequence before attention / MLP, reduce-scatter after.
    assert c["all-gather"]["count"] >= 2 * 2  # two per layer, forward alone
    assert c["reduce-scatter"]["count"] >= 2 * 2
