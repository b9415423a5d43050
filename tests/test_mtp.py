"""DeepSeek-V3 multi-token prediction (model.mtp, jaxpar/models/mtp.py): D modules after the
model, module k predicting t[i+k+1] at position i from the previous depth's hidden state and the
embedding of t[i+k].

- The depth losses: on packed rows (two documents a row, tests/parity.py's batches), each
  depth's reported loss equals a cross entropy computed here in numpy from the model's depth-k
  logits (the modules fed tokens shifted here by hand) and targets shifted here by hand, valid
  only inside position i's document and row and where the loss mask at i + k is on; on one
  device and on a ring (context 2, zigzag: the shifted tokens cross the shard boundary).
- Per-leaf gradient parity with one device (tests/parity.py's RTOL): a dense model (D = 2) on
  data x fsdp x tensor under ZeRO-3, context x data x tensor (ring), pipe x data x tensor and
  pipe x fsdp x tensor under ZeRO-3 (the modules on the last stage, with the head); an MoE
  model (D = 1, an MoE block per module) with DeepSeek's sigmoid router, sequence-wise loss and
  loss-free bias on expert x fsdp x tensor under ZeRO-3 and pipe x expert x data.
- The planner's and the FLOP count's parameters; DeepSeek-V3's MTP layers written and read
  back (Hugging Face); the refused settings.

Planted and seen failing (each once, then removed):
- `mtp.with_fields` shifting the targets by k - 1 (depth k predicting t[i+k]): the numpy test,
  5.560 against 5.585 at depth 1.
- the document test dropped (a target in the next document counts): the numpy test, 5.587
  against 5.585.
- the modules fed the tokens shifted by k - 1 instead of k: the numpy test, 5.595 against 5.585.
- the weights' scale count / count_k left out: the numpy test, 4.84 against 5.59.
- the shifted fields made after ring attention's permutation (`StepParts.prepare` in the other
  order): the ring's numpy test, 5.5841 against 5.5851.
- the pipeline's head aux kept from the last microbatch instead of summed (`_add_forward`): the
  pipeline parity run, its loss per step 1.40 against 5.59.
- the pipeline's lookups from the split table (`whole_table` off): XLA:CPU aborts compiling the
  pipe x fsdp x tensor ZeRO-3 step (spmd_partitioner_util.cc: Check failed).
- `param_table` without the modules' rows; `matmul_params` without their passes through the
  head: the planner test (57,312 against 92,704 elements; 83,712 against 100,608).
- the deepseek_v3 table without `mtp_tensors`; `ignored_tensors` empty: the Hugging Face test
  (no layer-3 enorm written; the head's copy refused by name).
- the modules' routers moved by the model's loads (`mtp.update_router_bias` with one load
  table): the MoE expert run fails (router_bias [1, 4] updated to [2, 4]).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import numpy as np
import pytest
from flax import nnx

from jaxpar import checks as checks_lib
from jaxpar.config import MESH_AXES, ConfigError, MLAConfig, ModelConfig, MoEConfig, MTPConfig, build_config
from jaxpar.hf import hf_load
from jaxpar.inspect import compile_step
from jaxpar.models import mtp as mtp_lib
from jaxpar.models.families import registry as families
from jaxpar.models.llama import Transformer, matmul_params
from jaxpar.planning import params as plan_params
from tests.parity import (
    assert_nonzero,
    assert_parity,
    assert_same_steps,
    parity_trainer,
    random_batches,
    relative_errors,
    run_parity,
    tiny_config,
)

DENSE = ["model.mtp.depth=2", "model.mtp.weight=0.3", "train.seq_len=16"]
DENSE_LAYOUTS = {
    "data2_fsdp2_tensor2_zero3": ({"data": 2, "fsdp": 2, "tensor": 2}, ["parallel.zero_stage=3"]),
    "context2_data2_tensor2": ({"context": 2, "data": 2, "tensor": 2}, []),
    "pipe2_data2_tensor2": ({"pipe": 2, "data": 2, "tensor": 2}, ["parallel.microbatches=4"]),
    # ZeRO-3 inside the stages: the modules' lookups from an embedding split over fsdp and tensor
    # (`mtp._depths`' whole_table; without it XLA:CPU's partitioner aborts the process).
    "pipe2_fsdp2_tensor2_zero3": (
        {"pipe": 2, "fsdp": 2, "tensor": 2},
        ["parallel.microbatches=4", "parallel.zero_stage=3"],
    ),
}
# An MoE model with DeepSeek-V3's routing: each module's block is an MoE block too. Two
# microsteps per step everywhere (accumulated, or two pipeline microbatches: a microbatch is
# routed on its own), so one reference serves both layouts.
MOE = [
    "model.mtp.depth=1",
    "model.mtp.weight=0.1",
    "train.seq_len=16",
    "model.moe.num_experts=4",
    "model.moe.top_k=2",
    "model.moe.d_ff=32",
    "model.moe.score=sigmoid",
    "model.moe.seq_aux_loss_weight=0.01",
    "model.moe.bias_update_rate=0.01",
    "parallel.grad_accum=2",
]
MOE_LAYOUTS = {
    "expert2_fsdp2_tensor2_zero3": ({"expert": 2, "fsdp": 2, "tensor": 2}, ["parallel.zero_stage=3"]),
    "pipe2_expert2_data2": (
        {"pipe": 2, "expert": 2, "data": 2},
        ["parallel.microbatches=2", "parallel.grad_accum=1"],
    ),
}


def _run(overrides, mesh, along=None):
    trainer = parity_trainer(list(overrides), mesh)
    init = None if along is None else along.init
    return run_parity(trainer, compile_step(trainer), random_batches(trainer.cfg), init=init, along=along)


@functools.cache
def _reference(kind: str):
    return _run(DENSE if kind == "dense" else MOE, {})


@functools.cache
def _layout(kind: str, layout: str):
    base, layouts = (DENSE, DENSE_LAYOUTS) if kind == "dense" else (MOE, MOE_LAYOUTS)
    mesh, extra = layouts[layout]
    return _run(base + extra, mesh, along=_reference(kind))


def _without_bias(tree):  # the router's correction bias is no trained weight: no gradient
    return jax.tree_util.tree_map_with_path(
        lambda path, x: None if "router_bias" in jax.tree_util.keystr(path) else x, tree
    )


def _max_error(got, want) -> float:
    return max(max(relative_errors(g, w).values()) for g, w in zip(got.step_grads, want.step_grads))


# --- The depth losses against numpy -----------------------------------------------------------


def _numpy_depth_losses(cfg, params, batch) -> list[float]:
    """Each depth's mean cross entropy over its valid targets, shifted and masked here."""
    inputs, targets = batch["inputs"], batch["targets"]
    seg, mask = batch["segment_ids"], batch["loss_mask"]
    rows, seq = inputs.shape
    shifted_inputs, wanted = [], []
    for k in range(1, cfg.model.mtp.depth + 1):
        tokens, target, valid = np.zeros_like(inputs), np.zeros_like(targets), np.zeros((rows, seq))
        for r in range(rows):
            for i in range(seq - k):
                tokens[r, i] = inputs[r, i + k]
                target[r, i] = targets[r, i + k]  # t[i+k+1]
                valid[r, i] = float(seg[r, i + k] == seg[r, i] and mask[r, i + k] > 0)
        shifted_inputs.append(tokens)
        wanted.append((target, valid))
    model = nnx.merge(nnx.graphdef(nnx.eval_shape(lambda: Transformer(cfg.model, rngs=nnx.Rngs(0)))), params)
    logits = mtp_lib.logits(model, {k: np.asarray(v) for k, v in batch.items()}, shifted_inputs)
    out = []
    for (target, valid), z in zip(wanted, logits):
        z = np.asarray(z, np.float64)
        log_probs = z - z.max(-1, keepdims=True)
        log_probs -= np.log(np.exp(log_probs).sum(-1, keepdims=True))
        nll = -np.take_along_axis(log_probs, target[..., None], -1)[..., 0]
        assert 0 < valid.sum() < valid.size  # some targets cross a document end
        out.append(float((nll * valid).sum() / valid.sum()))
    return out


@pytest.mark.parametrize("where", ["one_device", "context2_data2_tensor2"])
def test_depth_losses_equal_numpy_shifted_targets_on_packed_rows(where):
    ref = _reference("dense")
    run = ref if where == "one_device" else _layout("dense", where)
    cfg = tiny_config(DENSE)
    batch = next(random_batches(parity_trainer(DENSE, {}).cfg))
    want = _numpy_depth_losses(cfg, ref.init["params"], batch)
    got = [run.history[0][f"mtp_loss_{k}"] for k in (1, 2)]
    np.testing.assert_allclose(got, want, rtol=1e-5)


# --- Gradient parity with one device ----------------------------------------------------------


@pytest.mark.parametrize("layout", list(DENSE_LAYOUTS))
def test_mtp_trains_as_on_one_device(layout):
    ref, got = _reference("dense"), _layout("dense", layout)
    assert {"mtp", "blocks"} <= set(got.grads)
    assert got.grads["mtp"]["eh_proj"].shape == (2, 64, 32)
    assert_parity(got, ref)
    for k in (1, 2):
        key = f"mtp_loss_{k}"
        np.testing.assert_allclose([h[key] for h in got.history], [h[key] for h in ref.history], rtol=1e-5)
    print(f"{layout}: max relative gradient error {_max_error(got, ref):.3g}")


@pytest.mark.parametrize("layout", list(MOE_LAYOUTS))
def test_mtp_with_deepseek_routing_trains_as_on_one_device(layout):
    ref, got = _reference("moe"), _layout("moe", layout)
    assert "router" in got.grads["mtp"]["block"]["mlp"]  # each module's block is an MoE block
    assert_nonzero(_without_bias(ref.grads))
    assert_same_steps(got, ref)
    for key in ("mtp_loss_1", "seq_aux_loss", "expert_load_min", "expert_load_max"):
        np.testing.assert_allclose([h[key] for h in got.history], [h[key] for h in ref.history], rtol=1e-5)
    # The modules' routers move their own bias (loss-free balancing), from their own loads.
    assert np.any(ref.ends[0]["params"]["mtp"]["block"]["mlp"]["router_bias"])
    print(f"{layout}: max relative gradient error {_max_error(got, ref):.3g}")


# --- What counts the parameters ----------------------------------------------------------------


def test_the_planner_and_the_flop_count_count_the_modules():
    moe = ["model.moe.num_experts=4", "model.moe.top_k=2", "model.moe.d_ff=32", "model.moe.first_dense=1"]
    cfg = tiny_config(["model.mtp.depth=2", "model.n_layers=3"] + moe).model
    state = nnx.to_pure_dict(nnx.state(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))))
    total = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(state))
    assert plan_params.state_elements(cfg, {a: 1 for a in MESH_AXES}, 0)["total"] == total
    flat = jax.tree_util.tree_leaves_with_path(state)
    matmul = sum(
        int(np.prod(x.shape))
        for p, x in flat
        if not any(k in jax.tree_util.keystr(p) for k in ("norm", "embedding", "router_bias"))
    )
    # The head counts once per depth too: each module's prediction is a pass through it.
    assert matmul_params(cfg) == matmul + 2 * cfg.d_model * cfg.vocab_size


# --- Settings that cannot run --------------------------------------------------------------------

ONE_DEVICE = ["mesh.data=1", "mesh.fsdp=1", "mesh.tensor=1"]


@pytest.mark.parametrize(
    "change, named",
    [
        (["model.mtp.depth=16"], r"model.mtp.depth=16 with train.seq_len=16: the depth must be between 0"),
        (["model.mtp.depth=-1"], r"model.mtp.depth=-1 with train.seq_len=16"),
        (["model.mtp.weight=-0.1"], r"model.mtp.weight=-0.1: the multi-token loss's weight must be finite"),
        (["finetune.lora.rank=4"], r"finetune.lora.rank=4 with model.mtp.depth=2: the multi-token modules"),
        (["model.fp8=true"], r"model.fp8 with model.mtp.depth=2: float8 matmuls are not tested"),
    ],
)
def test_settings_that_cannot_run_are_refused(change, named):
    with pytest.raises(ConfigError, match=named):
        checks_lib.validate(tiny_config(DENSE + change + ONE_DEVICE), 1)


# --- Hugging Face: DeepSeek-V3's MTP layers ----------------------------------------------------

HF_MTP = {
    "n_kv_heads": 4,
    "mla": MLAConfig(kv_lora_rank=16, qk_nope_dim=8, qk_rope_dim=8, v_head_dim=8),
    "moe": MoEConfig(
        num_experts=4,
        top_k=2,
        first_dense=1,
        d_ff=24,
        score="sigmoid",
        aux_loss_weight=0.0,
        z_loss_weight=0.0,
    ),
    "mtp": MTPConfig(depth=2),
}


def test_deepseek_v3_reads_back_the_mtp_layers_it_writes():
    """config.json's num_mtp_layers and the modules' tensors at model.layers.{L + k - 1}, written
    and read back shard by shard as the import reads them (tests/test_convert.py's round trip,
    with the modules); their copies of the shared embedding and head are ignored on import."""
    m = dataclasses.replace(ModelConfig(n_layers=3), **HF_MTP)
    hf = families.hf_config(m)
    assert hf["num_mtp_layers"] == 2
    back = build_config({"model": families.settings_from_hf(hf, "config.json")}).model
    assert back == m
    renamed = {k if k != "num_mtp_layers" else "num_nextn_predict_layers": v for k, v in hf.items()}
    assert families.settings_from_hf(renamed, "config.json")["mtp"] == {"depth": 2}  # DeepSeek's key

    shapes = nnx.to_pure_dict(nnx.state(nnx.eval_shape(lambda: Transformer(m, rngs=nnx.Rngs(0)))))
    rng = np.random.default_rng(0)
    params = {
        path: rng.standard_normal(s.shape).astype(np.float32) for path, s in families.flatten(shapes).items()
    }
    tensors = families.hf_tensors(params, m)
    assert {name: t.shape for name, t in tensors.items()} == hf_load.expected_tensors(m)
    for k in (3, 4):  # layers num_hidden_layers + k - 1
        for name in ("enorm", "hnorm", "eh_proj", "shared_head.norm", "self_attn.kv_b_proj", "mlp.gate"):
            assert f"model.layers.{k}.{name}.weight" in tensors
    assert "model.layers.5.enorm.weight" not in tensors
    table = families.tensor_table(m)
    assert {p for p in params if p.startswith("mtp.")} == {p for p in table if p.startswith("mtp.")}
    for path, t in table.items():
        for index, _, name in t.instances(m.n_layers):
            want = params[path][index] if index else params[path]

            def rows(r0, r1, cols=None, hf=tensors[name]):
                return hf[r0:r1] if cols is None else hf[r0:r1, cols]

            idx = tuple(slice(d // 2, d) if d % 2 == 0 else slice(None) for d in want.shape)
            np.testing.assert_array_equal(t.layout.read(rows, idx, want.shape), want[idx])

    infos = {n: hf_load.TensorInfo("x", "float32", t.shape, 0) for n, t in tensors.items()}
    copies = {"model.layers.3.embed_tokens.weight", "model.layers.4.shared_head.head.weight"}
    hf_load.check_tensors({**infos, **{n: infos["model.embed_tokens.weight"] for n in copies}}, m, "d")
    with pytest.raises(ConfigError, match="model.layers.5.enorm.weight is not part of"):
        hf_load.check_tensors({**infos, "model.layers.5.enorm.weight": infos["model.norm.weight"]}, m, "d")
