"""MoE models train the same under expert parallelism as on one device (dropless routing)."""

import numpy as np
import pytest

from jaxpar import config as config_lib
from jaxpar.config import ConfigError
from jaxpar.inspect import compile_step, report
from tests.parity import random_batches, run_steps, trainer_on
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


def trainer_for(mesh):
    return trainer_on(TINY_MOE, mesh)


def run(trainer, compiled):
    return run_steps(trainer, compiled, random_batches(trainer.cfg))


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
