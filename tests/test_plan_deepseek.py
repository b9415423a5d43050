"""The planner on DeepSeek-V3's shape (configs/deepseek-v3-671b.yaml): the preset loads and
validates with the 671B's parameter counts, and the memory and step-time models count what
that model has and a Llama does not -- latent attention's latents and expanded keys and values,
the shared expert, the dropless dispatch's rows, the multi-token module kept whatever the remat
policy, its attention backward, host time and collectives. Arithmetic only: nothing compiles."""

from __future__ import annotations

import dataclasses

import pytest

from jaxpar import checks as checks_lib
from jaxpar import config as config_lib
from jaxpar.compiled.targets import DEVICES
from jaxpar.config import MESH_AXES
from jaxpar.planning import memory, params, search, step_time

PRESET = "configs/deepseek-v3-671b.yaml"
ONE = {a: 1 for a in MESH_AXES}


@pytest.fixture(scope="module")
def cfg():
    return config_lib.load_config(PRESET, [])


def _shape(cfg, **sizes):
    return memory.shape_for(cfg, ONE | sizes, rows=1)


def test_the_671b_preset_validates_with_the_published_counts(cfg):
    search.check_config(cfg)  # as `python -m jaxpar.plan` checks it, on one device
    m = cfg.model
    total = params.state_elements(m, ONE, 0)["total"]
    without_mtp = params.state_elements(dataclasses.replace(m, mtp=config_lib.MTPConfig()), ONE, 0)["total"]
    assert without_mtp == pytest.approx(671e9, rel=0.005)  # DeepSeek-V3's 671B
    assert 10e9 < total - without_mtp < 13e9  # the module: a projection and an MoE block
    from jaxpar.models.llama import active_matmul_params

    no_mtp = dataclasses.replace(m, mtp=config_lib.MTPConfig())
    assert active_matmul_params(no_mtp) == pytest.approx(37e9, rel=0.02)  # 37B activated a token


def test_the_presets_validate_on_their_own_meshes():
    """The 671B on its 2048 GPUs (the planner's first layout), the 8-GPU one on 8, each as
    `jaxpar.checks.validate` sees a run of them; the small one has the 671B's block widths."""
    big = config_lib.load_config(PRESET, [])
    small = config_lib.load_config("configs/deepseek-v3-8xh100.yaml", [])
    assert checks_lib.validate(big, 2048)["fsdp"] * checks_lib.validate(big, 2048)["expert"] == 2048
    assert checks_lib.validate(small, 8)["tensor"] == 8
    same = ("d_model", "n_heads", "d_ff", "vocab_size", "mla", "rope_scaling", "mtp")
    assert all(getattr(small.model, k) == getattr(big.model, k) for k in same)
    assert dataclasses.replace(small.model.moe, first_dense=3) == big.model.moe


def test_latent_attention_residuals_are_its_latents_and_expanded_heads(cfg):
    """Per token, tensor=2: the latents (1536 + 512 + 64) whole on each device, the queries
    (64 heads of 192) and the expanded keys and values (64 heads of 128 + 128); not three
    grouped-query arrays of 64 heads of 192."""
    m, s = cfg.model, _shape(cfg, tensor=2)
    got = memory.projection_residuals(m, s)
    latents, queries, expanded = 1536 + 512 + 64, 64 * 192, 64 * 256
    assert got["dots"] == 2 * 4096 * (latents + queries + expanded)
    # no remat: the latents and their norms, q before and after the rotation, the expanded
    # keys and values, the keys and zero-padded values the kernel reads
    assert got["none"] == 2 * 4096 * (2 * latents + 2 * queries + expanded + 2 * queries)


def test_shared_experts_and_dropless_rows_are_counted(cfg):
    m = cfg.model
    s = _shape(cfg, tensor=1)
    ff, proj = s.tokens * s.d_ff * 2, s.tokens * m.d_model * 2
    backend = memory.BACKENDS["gpu"]
    share = 58 / 61  # MoE layers among the 61
    with_shared = memory._moe_or_dense(m, s, ff, proj, backend)
    none = dataclasses.replace(m, moe=dataclasses.replace(m.moe, shared_experts=0))
    without = memory._moe_or_dense(none, s, ff, proj, backend)
    shared = 4096 * 2048 * 2  # one [tokens, 2048] bfloat16 array
    assert with_shared["none"] - without["none"] == pytest.approx(3 * shared * share)
    assert with_shared["dots"] - without["dots"] == pytest.approx(2 * shared * share)
    # Dropless without a buffer factor: the padded dispatch's 256 x tokens rows, not top_k x tokens
    dropless = dataclasses.replace(m, moe=dataclasses.replace(m.moe, capacity_factor=None))
    routed = memory._moe_or_dense(dropless, s, ff, proj, backend)["dots"] - with_shared["dots"]
    rows = 4096 * (256 - 8 * 1.25)
    per_row = 2.0 * 2048 * 2 + 2 * 7168 * 2 + 7168 * 4  # the routed hidden (x2) and the buffers
    assert routed == pytest.approx(share * rows * per_row)


def test_the_multi_token_module_is_kept_whatever_the_remat(cfg):
    """Under remat full a block keeps its input alone, but the module runs outside the layer
    loop's remat: one MoE block's no-remat residuals (gigabytes a row here) and its own arrays."""
    sizes = ONE | {"fsdp": 2048}
    c = dataclasses.replace(
        cfg, parallel=dataclasses.replace(cfg.parallel, remat="full", zero_stage=3, grad_accum=1)
    )
    off = dataclasses.replace(c, model=dataclasses.replace(c.model, mtp=config_lib.MTPConfig()))
    got = memory.predict_memory(c, sizes, "cudnn")["activations"]
    base = memory.predict_memory(off, sizes, "cudnn")["activations"]
    s = memory.shape_for(c, sizes, rows=8)
    one_layer_full = memory.layer_residuals(c.model, s, "full", "cudnn", False)
    assert got - base > 100 * 8 * one_layer_full
    # the loss comes in pieces here (no device memory given), so no logits are kept beside
    assert got - base == pytest.approx(8 * memory.mtp_residuals(c.model, s, "cudnn", False), rel=1e-9)
    logits = memory.mtp_bytes(c.model, s, "cudnn", False, "gpu", 1) - memory.mtp_bytes(
        c.model, s, "cudnn", False, "gpu", 2
    )
    assert logits == 8 * 4096 * 129280 * 2  # one piece: the module's bfloat16 logits' gradient


def test_step_time_counts_the_module_as_a_layer(cfg):
    sizes = ONE | {"fsdp": 256, "expert": 8}
    c = dataclasses.replace(
        cfg, parallel=dataclasses.replace(cfg.parallel, remat="full", zero_stage=3, grad_accum=1)
    )
    off = dataclasses.replace(c, model=dataclasses.replace(c.model, mtp=config_lib.MTPConfig()))
    h100 = DEVICES["h100"]
    got, base = (step_time.predict_time(x, sizes, h100, 8, kernel="cudnn") for x in (c, off))
    assert got["host_s"] == pytest.approx(base["host_s"] * 62 / 61)
    assert got["comm_s"]["expert"] == pytest.approx(base["comm_s"]["expert"] * 59 / 58)
    # the module's attention backward at the flash backward's rate, as the 61 layers'
    per_layer = base["attention_s"] / 61
    assert got["attention_s"] == pytest.approx(per_layer * 62, rel=1e-6)


def test_state_elements_remembers_by_value():
    m = config_lib.load_config(PRESET, []).model
    first = params.state_elements(m, ONE, 0)
    first["total"] = -1  # a caller's edit does not reach the cache
    assert params.state_elements(m, ONE, 0)["total"] > 0
    wider = dataclasses.replace(m, d_model=m.d_model + 128)
    assert params.state_elements(wider, ONE, 0)["total"] > params.state_elements(m, ONE, 0)["total"]


def test_a_pipeline_stage_holds_its_blocks_the_whole_dense_prefix_and_the_module(cfg):
    """With mesh.pipe = 2 the 671B's 58 pipelined blocks are 29 a stage, and the dense prefix's 3
    blocks run before the pipeline on every stage, on all of the pass's microbatches at once
    (one `jax.vjp`), their residuals kept through the pipeline: per stage, the preset without
    its prefix (58 blocks, all MoE) plus 3 dense blocks' residuals for every row of the pass.
    The old count spread the prefix over the stages (61 // 2 = 30 averaged blocks a stage, a
    microbatch's rows). The multi-token module runs on the last stage with the head and is
    charged whole, for a microbatch's rows, as that stage holds it."""
    par = dataclasses.replace(cfg.parallel, remat="dots", zero_stage=1, grad_accum=1, microbatches=8)
    c = dataclasses.replace(cfg, parallel=par)
    sizes = ONE | {"pipe": 2, "fsdp": 1024}
    moe = dataclasses.replace(c.model.moe, first_dense=0)
    stack = dataclasses.replace(c, model=dataclasses.replace(c.model, n_layers=58, moe=moe))
    local_batch = c.train.batch_size // 1024  # 16 rows a pass, 2 a microbatch
    s = memory.shape_for(c, sizes, rows=local_batch // 8)

    def stage(x):  # the stash and the prefix (the working set is one layer's, either way)
        el = params.state_elements(x.model, sizes, 1)
        return memory.pipeline_stage(x, sizes, el, s, "cudnn", "gpu")

    (got, _, held), (without, _, _) = stage(c), stage(stack)
    assert held == 29 + 3  # blocks whose weights a stage holds: its own and the prefix
    dense = dataclasses.replace(c.model, moe=dataclasses.replace(c.model.moe, num_experts=0))
    prefix = memory.layer_residuals(dense, s, "dots", "cudnn", False, stashed=True)
    assert got - without == pytest.approx(3 * local_batch * prefix, rel=1e-9)
    off = dataclasses.replace(c, model=dataclasses.replace(c.model, mtp=config_lib.MTPConfig()))
    predicted = (memory.predict_memory(x, sizes, "cudnn")["activations"] for x in (c, off))
    module = next(predicted) - next(predicted)
    assert module == pytest.approx(s.rows * memory.mtp_residuals(c.model, s, "cudnn", False), rel=1e-9)
