"""MoE models train the same under expert parallelism as on one device (dropless routing): the
same first-step gradients and SGD losses (tests/parity.py), and the same router statistics.

The objective compared is the whole one, with the router's load-balancing (aux) and z losses at
their default weights: their gradients reach the router and the experts as the NLL's do, so a
layout that got either part wrong shows in the router's and the experts' gradients."""

import numpy as np
import pytest

from jaxpar import checks as checks_lib
from jaxpar.config import ConfigError
from jaxpar.inspect import compile_step, report
from tests.parity import LAYER_FORMS, assert_parity, parity_trainer, random_batches, run_parity, tiny_config

# 4 layers in 2 groups of a dense and an MoE block (the scanned unit): the unrolled loop below
# then runs two units, which it could run in the wrong order.
MOE = [
    "model.n_layers=4",
    "model.moe.num_experts=8",
    "model.moe.top_k=2",
    "model.moe.every=2",
    "model.moe.shared_experts=1",
]
LAYOUTS = {
    "expert2": {"expert": 2, "data": 4},
    "expert4_data2": {"expert": 4, "data": 2},
    "expert8": {"expert": 8},
    "expert2_tensor2_fsdp2": {"expert": 2, "tensor": 2, "fsdp": 2},
}
# Starts from its own born-sharded init (experts split over `expert`); the others from the
# single-device initial state put onto their shardings (one init compile fewer each).
OWN_INIT = "expert2_tensor2_fsdp2"
# The unrolled layer loop (tests/parity.py, LAYER_FORMS) with MoE groups as its units, each
# unit's router statistics stacked, on the layout with the most axes inside the layer (experts
# over expert, their weights over tensor and fsdp). It fails on a group run with another's
# weights (the bugs "reversed" and "twice", planted and seen failing). The other layouts ran it
# too; they split the experts over fewer axes of the same kinds.
UNROLLED = "expert2_tensor2_fsdp2"


@pytest.fixture(scope="module")
def single_device():
    trainer = parity_trainer(MOE, {})
    return run_parity(trainer, compile_step(trainer), random_batches(trainer.cfg))


@pytest.mark.parametrize("layout, form", [(n, "scanned") for n in LAYOUTS] + [(UNROLLED, "unrolled")])
def test_expert_parallel_training_matches_single_device(layout, form, single_device):
    trainer = parity_trainer(MOE + LAYER_FORMS[form], LAYOUTS[layout])
    compiled = compile_step(trainer)
    got = run_parity(
        trainer,
        compiled,
        random_batches(trainer.cfg),
        init=None if layout == OWN_INIT else single_device.init,
        along=single_device,
    )
    assert_parity(got, single_device)
    for key in ("aux_loss", "z_loss"):  # (loss and grad_norm: assert_parity)
        np.testing.assert_allclose(
            [h[key] for h in got.history], [h[key] for h in single_device.history], rtol=1e-5, err_msg=key
        )
    assert all(h["dropped_fraction"] == 0.0 for h in got.history)
    loads = [[h["expert_load_max"] for h in run.history] for run in (got, single_device)]
    assert loads[0] == loads[1]
    if layout == "expert8":
        assert report(trainer, compiled)["collectives"]["all-to-all"]["count"] >= 4


def test_num_experts_not_divisible_by_expert_axis_is_a_config_error():
    cfg = tiny_config(
        MOE + ["mesh.data=1", "mesh.fsdp=1", "mesh.tensor=1", "mesh.expert=8", "model.moe.num_experts=6"]
    )
    with pytest.raises(ConfigError, match=r"mesh.expert=8 does not divide model.moe.num_experts=6"):
        checks_lib.validate(cfg, 8)
