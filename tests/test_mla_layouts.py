"""Multi-head latent attention (jaxpar/models/mla.py) trains the single-device model on every kind of
layout: per-leaf gradients, losses and updated state within tests/parity.py's RTOL on data x fsdp
x tensor under ZeRO-3 (heads and the up-projections split over tensor, the latent axis of the
up-projections over fsdp), on a ring over `context` (the values padded to the query/key width, the
rotated key head shared), and in a pipeline. The model has a query latent and YaRN with both
mscale keys, so every piece of MLA is in the gradients compared.

Planted and seen failing: the ring without the MLA logit scale folded into q (the ring scales by
1/sqrt(head width) alone): every gradient leaf off by 1e-4 to 0.2 on the context layout. The
model's own numbers (rotary layout, YaRN, the latent norms) are tests/test_deepseek_v3.py's,
against transformers; here a layout can only differ from one device by how it splits the work.
"""

from __future__ import annotations

import pytest

from jaxpar import checks as checks_lib
from jaxpar.inspect import compile_step
from tests.parity import assert_parity, parity_trainer, random_batches, run_parity, tiny_config

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
LAYOUTS = {
    "data2_fsdp2_tensor2_zero3": ({"data": 2, "fsdp": 2, "tensor": 2}, ["parallel.zero_stage=3"]),
    "context2_data2_tensor2": ({"context": 2, "data": 2, "tensor": 2}, []),
    "pipe2_data2_tensor2": ({"pipe": 2, "data": 2, "tensor": 2}, ["parallel.microbatches=4"]),
}


def _run(mesh, extra=(), along=None):
    trainer = parity_trainer(MLA + list(extra), mesh)
    compiled = compile_step(trainer)
    init = None if along is None else along.init
    return run_parity(trainer, compiled, random_batches(trainer.cfg), init=init, along=along)


@pytest.fixture(scope="module")
def single_device():
    return _run({})


@pytest.mark.parametrize("layout", LAYOUTS)
def test_latent_attention_layout_matches_single_device(layout, single_device):
    mesh, extra = LAYOUTS[layout]
    assert_parity(_run(mesh, extra, along=single_device), single_device)


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
