"""MoE models train the same under expert parallelism as on one device (dropless routing)."""

import jax
import numpy as np
import pytest

from jaxpar import config as config_lib
from jaxpar.config import ConfigError, MESH_AXES
from jaxpar.inspect import compile_step, report
from jaxpar.train import build_trainer

STEPS = 5
TINY_MOE = [
    "model.vocab_size=264", "model.d_model=32", "model.n_layers=2", "model.n_heads=4",
    "model.n_kv_heads=2", "model.d_ff=64", "model.dtype=float32", "model.moe.num_experts=8",
    "model.moe.top_k=2", "model.moe.every=2", "model.moe.shared_experts=1",
    "train.batch_size=16", "train.seq_len=16", "optimizer.warmup_steps=2", "optimizer.lr=1e-2",
    "parallel.zero_stage=0",
]
LAYOUTS = {
    "expert2": {"expert": 2, "data": 4},
    "expert4_data2": {"expert": 4, "data": 2},
    "expert8": {"expert": 8},
    "expert2_tensor2_fsdp2": {"expert": 2, "tensor": 2, "fsdp": 2},
}


def trainer_for(mesh, extra=()):
    axes = [f"mesh.{a}={mesh.get(a, 1)}" for a in MESH_AXES]
    cfg = config_lib.load_config(None, TINY_MOE + axes + list(extra))
    n = int(np.prod(list(mesh.values()) or [1]))
    return build_trainer(cfg, config_lib.validate(cfg, n), devices=jax.devices()[:n])


def random_batches(cfg):
    rng = np.random.default_rng(0)
    shape = (cfg.train.batch_size, cfg.train.seq_len)
    for _ in range(STEPS):
        tokens = rng.integers(0, 257, (shape[0], shape[1] + 1)).astype(np.int32)
        yield {"inputs": tokens[:, :-1], "targets": tokens[:, 1:],
               "positions": np.broadcast_to(np.arange(shape[1], dtype=np.int32), shape).copy(),
               "segment_ids": np.ones(shape, np.int32), "loss_mask": np.ones(shape, np.float32)}


def run(trainer, compiled):
    state, history = trainer.init(), []
    for batch in random_batches(trainer.cfg):
        state, metrics = compiled(state, trainer.shard_batch(batch))
        history.append({k: float(v) for k, v in metrics.items()})
    return history


@pytest.fixture(scope="module")
def single_device():
    trainer = trainer_for({})
    return run(trainer, compile_step(trainer))


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_expert_parallel_training_matches_single_device(layout, single_device):
    trainer = trainer_for(LAYOUTS[layout])
    compiled = compile_step(trainer)
    history = run(trainer, compiled)
    for key in ("loss", "aux_loss", "z_loss", "grad_norm"):
        np.testing.assert_allclose([h[key] for h in history], [h[key] for h in single_device],
                                   rtol=1e-5, err_msg=key)
    assert all(h["dropped_fraction"] == 0.0 for h in history)
    assert [h["expert_load_max"] for h in history] == [h["expert_load_max"] for h in single_device]
    if layout == "expert8":
        assert report(trainer, compiled)["collectives"]["all-to-all"]["count"] >= 4


def test_num_experts_not_divisible_by_expert_axis_is_a_config_error():
    cfg = config_lib.load_config(None, TINY_MOE + ["mesh.data=1", "mesh.fsdp=1", "mesh.tensor=1",
                                                   "mesh.expert=8", "model.moe.num_experts=6"])
    with pytest.raises(ConfigError, match=r"mesh.expert=8 does not divide model.moe.num_experts=6"):
        config_lib.validate(cfg, 8)
