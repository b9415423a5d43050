"""Pipelined training (GPipe, 1F1B, interleaved, zero-bubble over `pipe`; with gradient
accumulation across pipelined passes, ring attention over `context` and MoE experts over `expert`
inside a stage) equals the single-device run: the same first-step gradients of every parameter
group (stages, head, embedding) and the same SGD losses (tests/parity.py).

MoE: a pipeline microbatch is routed on its own, so the router's aux and z losses (which are not
linear in the tokens) are those of the microbatch, weighted by its token count -- the objective
of the unpipelined step accumulating one microstep per microbatch. The reference is that step
(parallel.grad_accum = microbatches on one device); its gradients differ from the step without
accumulation by about 5% (configs/tiny.yaml, 8 layers, 8 experts), so a pipeline that took the
router losses per batch, or weighted them otherwise, fails here."""

import functools

import numpy as np
import pytest

from jaxpar import checks as checks_lib
from jaxpar.config import ConfigError
from jaxpar.inspect import compile_step, report
from tests.parity import (
    LAYER_FORMS,
    TINY_YAML,
    assert_parity,
    parity_trainer,
    random_batches,
    relative_errors,
    run_parity,
    tiny_config,
)
from tests.test_pipeline import _collectives_in_branches

# 8 layers: up to 8 stages; 16 rows of 16 tokens: up to 8 microbatches of 2 rows.
PIPE = ["model.n_layers=8", "train.batch_size=16", "train.seq_len=16"]
LAYOUTS = {
    "pipe2_interleaved": (
        {"pipe": 2, "data": 4},
        ["parallel.pipeline_schedule=interleaved", "parallel.virtual_stages=2", "parallel.microbatches=4"],
    ),
    # ZeRO-1: fsdp splits only the rows inside the pipeline (manual there, like data).
    "pipe4_fsdp2_1f1b_zero1": (
        {"pipe": 4, "fsdp": 2},
        ["parallel.pipeline_schedule=1f1b", "parallel.microbatches=8", "parallel.zero_stage=1"],
    ),
    "pipe8_gpipe": ({"pipe": 8}, ["parallel.pipeline_schedule=gpipe", "parallel.microbatches=4"]),
    "pipe2_data2_tensor2": ({"pipe": 2, "data": 2, "tensor": 2}, ["parallel.microbatches=4"]),
    "pipe2_fsdp4_zero3": ({"pipe": 2, "fsdp": 4}, ["parallel.zero_stage=3", "parallel.microbatches=2"]),
    # Issue 17's hang: interleaved with fsdp, tensor and ZeRO-3 (its first step never finished).
    "pipe2_fsdp2_tensor2_interleaved_zero3": (
        {"pipe": 2, "fsdp": 2, "tensor": 2},
        [
            "parallel.pipeline_schedule=interleaved",
            "parallel.virtual_stages=2",
            "parallel.microbatches=4",
            "parallel.zero_stage=3",
        ],
    ),
    # Zero-bubble on a collective-free chunk (pipe x data only): stage-dependent ZB-H1.
    "pipe4_data2_zb": ({"pipe": 4, "data": 2}, ["parallel.pipeline_schedule=zb", "parallel.microbatches=8"]),
    "pipe2_data4_zb": ({"pipe": 2, "data": 4}, ["parallel.pipeline_schedule=zb", "parallel.microbatches=4"]),
    # With fsdp: uniform control flow (the chunk has collectives).
    "pipe2_data2_fsdp2_zb_zero2": (
        {"pipe": 2, "data": 2, "fsdp": 2},
        ["parallel.pipeline_schedule=zb", "parallel.microbatches=4", "parallel.zero_stage=2"],
    ),
    # Gradient accumulation across pipelined passes: 2 passes of 8 rows, each in 2 microbatches.
    "pipe2_data4_accum2": ({"pipe": 2, "data": 4}, ["parallel.microbatches=2", "parallel.grad_accum=2"]),
    # Ring attention inside a stage: the batch (positions and segment ids with it) is in the
    # zigzag layout before the pipeline splits it.
    "pipe2_context2_fsdp2": ({"pipe": 2, "context": 2, "fsdp": 2}, ["parallel.microbatches=2"]),
}
# Starts from its own born-sharded init; the others from the single-device initial state put
# onto their shardings (one init compile fewer each).
OWN_INIT = "pipe2_fsdp4_zero3"
# The unrolled layer loop (tests/parity.py, LAYER_FORMS) inside a pipeline stage: a chunk's
# jax.vjp then stashes the split's slices as residuals (the scan's residuals hold the chunk's
# weights themselves), and a layer run with another's weights or the stacked gradient assembled
# out of order (the bugs "reversed" and "twice") shows only where a chunk has two layers or more.
# Each path of the pipeline runtime meets the unrolled chunk once, in chunks of two:
# - here, stage-dependent zero-bubble (the B and W branches of the per-stage switch);
# - test_pipelined_moe_training_matches_single_device, zero-bubble's uniform ticks (B without the
#   weight gradient, W) with MoE groups and their statistics, expert and fsdp inside the chunk;
# - test_pipelined_sliding_window_layers_match_single_device, interleaved virtual stages on
#   uniform ticks (B with the weight gradient), ring attention inside the chunk, and the sliding
#   layers' flags split with the weights (the bug "sliding").
# Each of these fails on each of those bugs (planted, run, seen failing). The other layouts'
# unrolled runs (every layout here ran both forms) checked nothing the layer loop does
# differently there: their schedules, axes and ZeRO stages run the same chunk function.
UNROLLED = {"pipe4_data2_zb"}


# Compiled once and shared by the parity test and the masked-token test below.
SHARED = (None, "pipe2_context2_fsdp2")


def trainer_for(mesh, extra=()):
    return parity_trainer(PIPE + list(extra), mesh)


def _compile(layout: str | None, form: str = "scanned"):
    """(trainer, compiled step) for a layout of LAYOUTS, or None for one device, with its layers
    in `form` (LAYER_FORMS)."""
    mesh, extra = LAYOUTS[layout] if layout else ({}, [])
    trainer = trainer_for(mesh, list(extra) + LAYER_FORMS[form])
    return trainer, compile_step(trainer)


_shared = functools.cache(_compile)


@pytest.fixture(scope="module")
def single_device():
    trainer, compiled = _shared(None, "scanned")
    return run_parity(trainer, compiled, random_batches(trainer.cfg))


@pytest.mark.parametrize(
    "layout, form", [(n, "scanned") for n in LAYOUTS] + [(n, "unrolled") for n in sorted(UNROLLED)]
)
def test_pipelined_training_matches_single_device(layout, form, single_device):
    trainer, compiled = (_shared if layout in SHARED else _compile)(layout, form)
    got = run_parity(
        trainer,
        compiled,
        random_batches(trainer.cfg),
        init=None if layout == OWN_INIT else single_device.init,
        along=single_device,
    )
    assert_parity(got, single_device)
    if layout == "pipe8_gpipe":  # activations and gradients hop between neighbouring stages
        assert report(trainer, compiled)["collectives"]["collective-permute"]["count"] > 0
    if "_zb" in layout:  # the control flow the schedule's bubble assumes is the one compiled
        conditionals, widest, inside = _collectives_in_branches(compiled.as_text())
        if set(LAYOUTS[layout][0]) == {"pipe", "data"}:  # stage-dependent: one 5-way switch
            assert widest == 5 and not inside, (widest, inside)
        else:  # uniform: two-way conds, which may hold the chunk's collectives
            assert widest == 2 and inside, (widest, inside)


def prompt_masked(batches, seed: int = 1):
    """`batches` as fine-tuning on conversations sees them: in every row, runs of 2 to 6 tokens
    alternate between prompt (loss mask 0) and reply (kept as it was), so that about half of the
    targets, at different places in every row, are not trained on."""
    rng = np.random.default_rng(seed)
    for batch in batches:
        rows, seq = batch["loss_mask"].shape
        reply = np.zeros((rows, seq), dtype=bool)
        for row in reply:
            at, is_reply = 0, bool(rng.integers(2))
            while at < seq:
                n = int(rng.integers(2, 7))
                row[at : at + n] = is_reply
                at, is_reply = at + n, not is_reply
        yield {**batch, "loss_mask": np.where(reply, batch["loss_mask"], 0.0).astype(np.float32)}


def test_masked_targets_contribute_exactly_zero_gradient_with_pipeline_and_ring(single_device):
    """Prompt-masked batches (what data.train_on=assistant trains on) on pipe 2 x context 2
    (zigzag ring attention inside each stage) x fsdp 2: the run equals one device's on the same
    batches, per leaf; and replacing every masked target by another token leaves every gradient
    leaf bit-identical, on the layout and on one device (a masked token contributes exactly 0; a
    mask read one position off, or applied after the normalisation only, changes them)."""
    one, one_step = _shared(None, "scanned")
    ring, ring_step = _shared("pipe2_context2_fsdp2", "scanned")
    batches = list(prompt_masked(random_batches(one.cfg)))
    kept = sum(float(b["loss_mask"].sum()) for b in batches) / sum(b["loss_mask"].size for b in batches)
    assert 0.3 < kept < 0.7, kept
    want = run_parity(one, one_step, batches, init=single_device.init)
    assert_parity(run_parity(ring, ring_step, batches, init=single_device.init, along=want), want)
    # The loss is the mean over target tokens: the masked tokens' count does not dilute it.
    assert want.history[0]["loss"] > 0.9 * single_device.history[0]["loss"]
    first = batches[0]
    other = np.where(first["loss_mask"] > 0, first["targets"], (first["targets"] + 7) % 257)
    assert (other != first["targets"]).sum() > 0.3 * other.size
    changed = [{**first, "targets": other.astype(np.int32)}]
    for trainer, step, reference in ((one, one_step, want), (ring, ring_step, None)):
        base = reference or run_parity(trainer, step, batches[:1], init=single_device.init)
        got = run_parity(trainer, step, changed, init=single_device.init)
        errors = relative_errors(got.grads, base.grads)
        assert max(errors.values()) == 0.0, {k: v for k, v in errors.items() if v}


@pytest.mark.parametrize(
    "overrides, match",
    [
        (["model.n_layers=6"], r"layers=6"),
        (["train.batch_size=12", "parallel.microbatches=8"], r"batch=12|batch_size=12"),
        (["parallel.grad_accum=4"], r"parallel.grad_accum=4 x parallel.microbatches=4 .* multiple of 32"),
        (
            ["model.moe.num_experts=8", "model.moe.every=4"],
            r"model.n_layers=8 / model.moe.every=4 = 2 MoE groups do not split over mesh.pipe=4 .* "
            r"try model.moe.every in \[1, 2\]",
        ),
    ],
)
def test_pipeline_config_errors(overrides, match):
    cfg = tiny_config(
        PIPE
        + ["mesh.pipe=4", "mesh.data=2", "mesh.fsdp=1", "mesh.tensor=1", "parallel.microbatches=4"]
        + overrides
    )
    with pytest.raises(ConfigError, match=match):
        checks_lib.validate(cfg, 8)


def test_inspect_prints_the_schedule_and_its_bubble(capsys):
    """In this process, as the test below (its command line is tests/test_entry_points.py's):
    two child processes, each importing JAX, took longer than the rest of the test."""
    import json

    from jaxpar.inspect import main

    args = [
        TINY_YAML,
        *PIPE,
        "mesh.pipe=4",
        "mesh.data=2",
        "mesh.fsdp=1",
        "mesh.tensor=1",
        "parallel.microbatches=8",
        "--schedule",
    ]
    assert main(args) == 0
    described = json.loads(capsys.readouterr().out)
    assert described["bubble"] == pytest.approx(3 / 11)  # (p-1)/(m+p-1) for 1f1b, p=4, m=8
    assert described["costs"] == {"F": 1, "B": 2}
    assert main([*args, "--human"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert sum(line.startswith("stage ") for line in lines) == 4
    assert "F7" in out and "B0 ==" in out
    assert f"bubble {3 / 11:.4f}" in out


def test_inspect_schedule_reports_the_control_flow_zero_bubble_runs(capsys):
    """zb on pipe x data (and pipe x fsdp below ZeRO-2, a row axis) is the stage-dependent ZB-H1
    table; with fsdp at ZeRO-2/3 (or tensor, context, expert) > 1 it stays uniform, and the
    bubble says so (nothing compiles)."""
    import json

    from jaxpar.inspect import main

    for mesh, flow, bubble in [
        (["mesh.data=2", "mesh.fsdp=1"], "stage-dependent", 3 / 27),
        (["mesh.data=1", "mesh.fsdp=2", "parallel.zero_stage=1"], "stage-dependent", 3 / 27),
        (["mesh.data=1", "mesh.fsdp=2", "parallel.zero_stage=2"], "uniform", 6 / 30),
        (["mesh.data=2", "mesh.fsdp=1", "model.fp8=true"], "uniform", 6 / 30),
    ]:
        args = [
            TINY_YAML,
            *PIPE,
            "mesh.pipe=4",
            "mesh.tensor=1",
            *mesh,
            "parallel.pipeline_schedule=zb",
            "parallel.microbatches=8",
            "--schedule",
        ]
        assert main(args) == 0
        described = json.loads(capsys.readouterr().out)
        assert described["control_flow"] == flow
        assert described["bubble"] == pytest.approx(bubble)  # p=4, m=8: 3/(3m+p-1), 2(p-1)/(3m+2(p-1))
        assert described["textbook_bubble"] == pytest.approx(3 / 27)


def test_bf16_pipeline_hands_off_bf16_and_splits_the_vocabulary_over_tensor(single_device):
    """jax 0.10.2 needed float32 hand-offs and a whole vocabulary beside the pipeline; 0.12 not."""
    trainer = trainer_for(
        {"pipe": 2, "data": 2, "tensor": 2}, ["model.dtype=bfloat16", "parallel.microbatches=4"]
    )
    assert "tensor" in str(trainer.state_shardings["params"]["embedding"].spec)
    # The program hands bf16 between stages (XLA:CPU then runs its collectives in float32).
    lowered = trainer.step.lower(trainer.state_shape, trainer.batch_shape())  # (compile_step's, once)
    permutes = [line for line in lowered.as_text().splitlines() if "stablehlo.collective_permute" in line]
    assert permutes and all(line.rstrip().endswith("bf16>") for line in permutes), permutes[:2]
    got = run_parity(
        trainer, lowered.compile(), random_batches(trainer.cfg), single_device.init, along=single_device
    )
    # bf16 matmuls against the float32 single-device run: the same gradients and trajectory, to
    # bf16's precision.
    errors = relative_errors(got.grads, single_device.grads)
    assert max(errors.values()) < 5e-2, errors
    np.testing.assert_allclose(got.losses, single_device.losses, rtol=2e-2)


# MoE inside a stage: 8 layers in 4 groups of a dense and an MoE block, 2 microbatches.
MOE = ["model.moe.num_experts=8", "model.moe.top_k=2", "model.moe.every=2", "model.moe.shared_experts=1"]
MOE_MICROBATCHES = 2
MOE_LAYOUTS = {
    "pipe2_expert2_data2": ({"pipe": 2, "expert": 2, "data": 2}, []),
    # Zero-bubble: a stage's router losses reach its weights in the W slot.
    "pipe2_expert2_fsdp2_zb": ({"pipe": 2, "expert": 2, "fsdp": 2}, ["parallel.pipeline_schedule=zb"]),
}
# Unrolled layers (UNROLLED above): chunks of two MoE groups, on zero-bubble's uniform ticks.
MOE_UNROLLED = {"pipe2_expert2_fsdp2_zb"}
ROUTER_METRICS = ("aux_loss", "z_loss", "dropped_fraction", "expert_load_min", "expert_load_max")


@pytest.fixture(scope="module")
def moe_single_device():
    """One device, one accumulated microstep per pipeline microbatch (the module docstring)."""
    trainer = trainer_for({}, MOE + [f"parallel.grad_accum={MOE_MICROBATCHES}"])
    return run_parity(trainer, compile_step(trainer), random_batches(trainer.cfg))


@pytest.mark.parametrize(
    "layout, form",
    [(n, "scanned") for n in MOE_LAYOUTS] + [(n, "unrolled") for n in sorted(MOE_UNROLLED)],
)
def test_pipelined_moe_training_matches_single_device(layout, form, moe_single_device):
    mesh, extra = MOE_LAYOUTS[layout]
    schedule = [f"parallel.microbatches={MOE_MICROBATCHES}", *extra]
    trainer = trainer_for(mesh, MOE + schedule + LAYER_FORMS[form])
    got = run_parity(
        trainer,
        compile_step(trainer),
        random_batches(trainer.cfg),
        moe_single_device.init,
        along=moe_single_device,
    )
    assert_parity(got, moe_single_device)
    for key in ROUTER_METRICS:
        np.testing.assert_allclose(
            [h[key] for h in got.history], [h[key] for h in moe_single_device.history], rtol=1e-5, err_msg=key
        )
    assert any(h["aux_loss"] > 1.0 for h in got.history)  # the router is not balanced: aux matters


# Gemma 3's attention pattern, what a pipeline chunk must get right: of every two layers the
# first slides over 4 positions with its own rotary base. (Its norms and embedding scale, which
# no chunk sees differently, stall plain SGD at rate 1 on this 8-layer model.)
GEMMA_STYLE = [
    "model.sliding_window=4",
    "model.global_every=2",
    "model.rope_local_theta=100.0",
    "model.qk_norm=true",
]


@functools.cache
def _gemma_style_reference():
    trainer = trainer_for({}, GEMMA_STYLE)
    return run_parity(trainer, compile_step(trainer), random_batches(trainer.cfg))


@pytest.mark.parametrize("form", LAYER_FORMS)
def test_pipelined_sliding_window_layers_match_single_device(form):
    """Interleaved chunks of two layers (each the pattern's slide-then-global), with ring
    attention inside each stage: the one-device gradients and losses. Unrolled, the only
    interleaved (virtual stages) and the only sliding-window pipeline run of that form
    (UNROLLED)."""
    want = _gemma_style_reference()
    schedule = [
        "parallel.pipeline_schedule=interleaved",
        "parallel.virtual_stages=2",
        "parallel.microbatches=2",
    ]
    trainer = trainer_for({"pipe": 2, "context": 2, "data": 2}, GEMMA_STYLE + schedule + LAYER_FORMS[form])
    got = run_parity(trainer, compile_step(trainer), random_batches(trainer.cfg), want.init, along=want)
    assert_parity(got, want)
