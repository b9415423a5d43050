"""DeepSeek-V3's whole architecture trains the single-device model on every kind of layout:
multi-head latent attention (jaxpar/models/mla.py) with a query latent and YaRN with both mscale
keys, a dense first layer (model.moe.first_dense), MoE layers with DeepSeek's router (sigmoid
scores, two groups of which a token's experts come from the best one, a shared expert, the
correction bias moved by loss-free balancing, the sequence-wise balance loss) and multi-token
prediction (model.mtp, one module with an MoE block). Per-leaf gradients, losses and updated
state within tests/parity.py's RTOL, on data x fsdp x tensor under ZeRO-3 (heads and the
up-projections split over tensor, the latent axis of the up-projections over fsdp), on expert x
data x tensor, on a ring over `context` (the values padded to the query/key width, the rotated
key head shared; the multi-token targets shifted across the shard boundary) and in a pipeline
(the dense layer and the embedding before it, the modules on the last stage). Every layout runs
two microsteps a step (accumulated, or two pipeline microbatches: a microbatch is routed on its
own), so one single-device reference serves all.

Planted and seen failing: the ring without the MLA logit scale folded into q (the ring scales by
1/sqrt(head width) alone): every gradient leaf off by 1e-4 to 0.2 on the context layout. The
model's own numbers (rotary layout, YaRN, the latent norms, the router) are
tests/test_deepseek_v3.py's and tests/test_deepseek_moe.py's, against transformers and numpy;
here a layout can only differ from one device by how it splits the work.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

from jaxpar import checks as checks_lib
from jaxpar.inspect import compile_step
from tests.parity import (
    assert_nonzero,
    assert_same_steps,
    parity_trainer,
    random_batches,
    run_parity,
    tiny_config,
)

MLA = [
    "model.n_kv_heads=4",
    "model.mla.kv_lora_rank=16",
    "model.mla.q_lora_rank=12",
    "model.mla.qk_nope_dim=8",
    "model.mla.qk_rope_dim=8",
    "model.mla.v_head_dim=12",
    "model.rope_scaling.type=yarn",
    "model.rope_scaling.factor=4",
    "model.rope_scaling.original_max_len=8",
    "model.rope_scaling.beta_fast=8",
    "model.rope_scaling.mscale=0.5",
    "model.rope_scaling.mscale_all_dim=1.0",
]
# The rest of DeepSeek-V3 around the latent attention: 1 dense layer, 2 MoE layers, 1 module.
DEEPSEEK = MLA + [
    "model.n_layers=3",
    "model.moe.num_experts=4",
    "model.moe.top_k=2",
    "model.moe.d_ff=32",
    "model.moe.shared_experts=1",
    "model.moe.score=sigmoid",
    "model.moe.groups=2",
    "model.moe.topk_groups=1",
    "model.moe.routed_scale=2.5",
    "model.moe.seq_aux_loss_weight=0.01",
    "model.moe.bias_update_rate=0.01",
    "model.moe.first_dense=1",
    "model.mtp.depth=1",
    "model.mtp.weight=0.3",
    "train.seq_len=16",
]
ACCUM = ["parallel.grad_accum=2"]
LAYOUTS = {
    "data2_fsdp2_tensor2_zero3": ({"data": 2, "fsdp": 2, "tensor": 2}, ACCUM + ["parallel.zero_stage=3"]),
    "expert2_data2_tensor2": ({"expert": 2, "data": 2, "tensor": 2}, ACCUM),
    "context2_data2_tensor2": ({"context": 2, "data": 2, "tensor": 2}, ACCUM),
    "pipe2_expert2_tensor2": ({"pipe": 2, "expert": 2, "tensor": 2}, ["parallel.microbatches=2"]),
}


def _run(mesh, extra=(), along=None):
    trainer = parity_trainer(DEEPSEEK + list(extra), mesh)
    compiled = compile_step(trainer)
    init = None if along is None else along.init
    return run_parity(trainer, compiled, random_batches(trainer.cfg), init=init, along=along)


@pytest.fixture(scope="module")
def single_device():
    return _run({}, ACCUM)


def _trained(tree):
    """`tree` without the routers' correction biases (no gradient by design: tests/test_deepseek_moe.py)."""
    return jax.tree_util.tree_map_with_path(
        lambda path, x: None if "router_bias" in jax.tree_util.keystr(path) else x, tree
    )


@pytest.mark.parametrize("layout", LAYOUTS)
def test_deepseek_v3_layout_matches_single_device(layout, single_device):
    mesh, extra = LAYOUTS[layout]
    got = _run(mesh, extra, along=single_device)
    assert {"dense_blocks", "blocks", "mtp"} <= set(got.grads)
    assert_nonzero(_trained(single_device.grads))
    assert single_device.losses[-1] < single_device.losses[0] - 0.05, single_device.losses
    assert_same_steps(got, single_device)
    for key in ("mtp_loss_1", "seq_aux_loss", "expert_load_min", "expert_load_max"):
        np.testing.assert_allclose(
            [h[key] for h in got.history], [h[key] for h in single_device.history], rtol=1e-5, err_msg=key
        )
    # The biases moved (loss-free balancing), so the later steps route on non-zero biases.
    assert np.any(single_device.ends[0]["params"]["blocks"]["mlp"]["router_bias"])


@pytest.mark.parametrize(
    "change, named",
    [
        (["model.n_kv_heads=2"], "model.n_kv_heads=2 with model.mla.kv_lora_rank=16"),
        (["model.mla.v_head_dim=20"], "model.mla.v_head_dim=20 is wider than a query/key head"),
        (["model.mla.qk_rope_dim=3"], r"\(model.mla.qk_rope_dim\)"),
        (["model.qk_norm=true"], "model.qk_norm with model.mla.kv_lora_rank=16"),
        (["finetune.lora.rank=4"], "finetune.lora on q, k, v or o with model.mla"),
        (["model.rope_scaling.beta_fast=0.5"], "yarn needs factor >= 1, beta_fast > beta_slow"),
    ],
)
def test_latent_attention_settings_that_cannot_run_are_refused(change, named):
    with pytest.raises(checks_lib.ConfigError, match=named):
        checks_lib.validate(tiny_config(MLA + change + ["mesh.data=8", "mesh.fsdp=1", "mesh.tensor=1"]), 8)
