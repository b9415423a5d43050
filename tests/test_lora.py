"""LoRA (finetune.lora, jaxpar/models/lora.py): settings refused by name, the adapters' gradients
on a data x fsdp x tensor mesh equal one device's leaf by leaf, the frozen weights stay
bit-identical and hold no optimizer state; dropout on the adapters' inputs is drawn per token
from (train.seed, step), the same on any layout, and only in training; a checkpoint holds the
adapters and names its base, and a run resumes from it bit-exact. The Hugging Face side
(merged export, PEFT adapter) is in tests/test_convert.py.

The base is configs/tiny.yaml's random init (no train.init_from: allowed, the base is then the
seed's init). B starts at zero, which makes A's gradient zero at step 0; the parity runs start
from random B (`with_random_b`) so that every adapter leaf has a gradient to compare.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil

import jax
import numpy as np
import pytest

from jaxpar import checks as checks_lib
from jaxpar import config as config_lib
from jaxpar.config import ConfigError
from jaxpar.models import lora as lora_lib
from tests import parity

ALL = "[q,k,v,o,gate,up,down]"
LORA = ["finetune.lora.rank=4", "finetune.lora.alpha=8", f"finetune.lora.targets={ALL}"]
MESH = {"data": 2, "fsdp": 2, "tensor": 2}


def with_random_b(state, seed: int = 1):
    """A host copy of `state` with every lora_b drawn N(0, 0.05^2) instead of zero."""
    rng = np.random.default_rng(seed)

    def fill(path, x):
        if "lora_b" in jax.tree_util.keystr(path):
            return rng.normal(0.0, 0.05, x.shape).astype(x.dtype)
        return np.asarray(x)

    return jax.tree_util.tree_map_with_path(fill, jax.device_get(state))


def _flat(tree) -> dict:
    return {jax.tree_util.keystr(p): np.asarray(x) for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


@pytest.mark.parametrize(
    "overrides, words",
    [
        (["finetune.lora.rank=-1"], ["finetune.lora.rank=-1", "positive rank"]),
        (
            ["finetune.lora.rank=4", "finetune.lora.targets=[q,qkv]"],
            ["finetune.lora.targets[1]", "q, k, v, o, gate"],
        ),
        (["finetune.lora.rank=4", "finetune.lora.targets=[q,q]"], ["finetune.lora.targets", "once"]),
        (["finetune.lora.rank=4", "finetune.lora.alpha=0"], ["finetune.lora.alpha=0"]),
        (["finetune.lora.rank=4", "finetune.lora.dropout=1.0"], ["finetune.lora.dropout=1.0", "[0, 1)"]),
        (
            ["finetune.lora.rank=4", "finetune.lora.dropout=0.1", "mesh.pipe=2", "mesh.data=2"],
            ["finetune.lora.dropout=0.1", "mesh.pipe=2", "finetune.lora.dropout=0"],
        ),
        (
            ["finetune.lora.rank=4", "finetune.lora.targets=[q,up]", "model.moe.num_experts=4"],
            ["MoE experts", "up", "q, k, v, o"],
        ),
        (  # tiny.yaml: k and v are 32 x 16 (two kv heads of 8)
            ["finetune.lora.rank=16"],
            ["finetune.lora.rank=16", "smaller side (16) of the k projection", "d_model = 32", "below 16"],
        ),
        (
            ["finetune.lora.rank=4096", "finetune.lora.targets=[q,gate]"],
            ["finetune.lora.rank=4096", "(32) of the gate projection", "d_ff = 64", "rank=0"],
        ),
    ],
)
def test_bad_lora_settings_are_refused_by_name(overrides, words):
    """Among them, a rank at or above a matrix's smaller side (it used to be accepted, even far
    above the model's width): the adapter would outweigh the weight and add nothing to training
    it."""
    with pytest.raises(ConfigError) as err:
        cfg = parity.tiny_config(["mesh.tensor=1", "mesh.fsdp=2", "mesh.data=4", *overrides])
        checks_lib.validate(cfg, 8)
    for word in words:
        assert word in str(err.value), str(err.value)


@pytest.fixture(scope="module")
def parity_runs():
    """The same LoRA training (SGD, 3 steps, from the same state with random B) on one device
    and on data x fsdp x tensor = 2 x 2 x 2."""
    runs, extra = {}, list(LORA)
    init = one = None
    for name, mesh in (("one", {}), ("mesh", MESH)):
        trainer = parity.parity_trainer(extra, mesh)
        init = with_random_b(trainer.init()) if init is None else init
        run = parity.run_parity(trainer, trainer.step, parity.random_batches(trainer.cfg), init, along=one)
        runs[name], one = (trainer, run), one or run
    return runs


def test_adapter_gradients_on_a_mesh_equal_one_device_leaf_by_leaf(parity_runs):
    one, mesh = parity_runs["one"][1], parity_runs["mesh"][1]
    names = set(_flat(one.grads))
    assert len(names) == 2 * 7 and all("lora_a" in n or "lora_b" in n for n in names), names
    parity.assert_nonzero(one.grads)
    parity.assert_same_steps(mesh, one)
    assert one.losses[-1] < one.losses[0], one.losses  # the adapters learn


def test_adapter_gradients_pipelined_with_a_ring_and_zero3_equal_one_device():
    """pipe x fsdp x context = 2 x 2 x 2 at ZeRO-3: the
    pipeline's backward, the ring and the weights split over fsdp give one device's gradients."""
    extra, mesh = [*LORA, "parallel.zero_stage=3"], {"pipe": 2, "fsdp": 2, "context": 2}
    one_trainer = parity.parity_trainer(extra, {})
    init = with_random_b(one_trainer.init())
    one = parity.run_parity(one_trainer, one_trainer.step, parity.random_batches(one_trainer.cfg), init)
    trainer = parity.parity_trainer(extra, mesh)
    got = parity.run_parity(trainer, trainer.step, parity.random_batches(trainer.cfg), init, along=one)
    parity.assert_nonzero(one.grads)
    parity.assert_same_steps(got, one)


def test_frozen_weights_are_bit_identical_after_training(parity_runs):
    trainer, _ = parity_runs["one"]
    init = with_random_b(trainer.init())
    state = jax.device_put(init, trainer.state_shardings)
    for batch in parity.random_batches(trainer.cfg):
        state = trainer.step(state, trainer.shard_batch(batch))[0]
    train0, frozen0 = trainer.trainable.split(init["params"])
    train1, frozen1 = trainer.trainable.split(jax.device_get(state["params"]))
    before, after = _flat(frozen0), _flat(frozen1)
    assert before.keys() == after.keys() and len(before) > 10
    for name in before:
        assert before[name].tobytes() == after[name].tobytes(), name
    moved = [n for n, x in _flat(train1).items() if not np.array_equal(x, _flat(train0)[n])]
    assert len(moved) == 14, moved  # every adapter trained


def test_optimizer_state_is_two_adam_moments_of_the_adapters_only():
    """What `python -m jaxpar.inspect` reports of a LoRA step (AdamW, ZeRO-0): optimizer bytes
    per device = 2 x the adapters' (Adam's two moments, float32), gradients = the adapters'."""
    from jaxpar.inspect import report
    from jaxpar.training.trainer import compile_step

    trainer = parity.trainer_on([*LORA, "parallel.zero_stage=0"], MESH)  # AdamW (tiny.yaml's)
    memory = report(trainer, compile_step(trainer))["memory_per_device"]
    assert 2 * memory["adapters"] <= memory["optimizer"] <= 2 * memory["adapters"] + 16  # + Adam's count
    assert memory["gradients"] == memory["adapters"] and memory["params"] > 5 * memory["adapters"]
    for path, leaf in jax.tree_util.tree_flatten_with_path(trainer.state_shape["opt_state"])[0]:
        assert leaf.ndim == 0 or "_lora" in jax.tree_util.keystr(path), (
            f"optimizer state of a frozen weight: {path}"
        )
    # Adapters shard as their weights: A's rows as wq's embed dim (ZeRO-1: whole), B's columns over
    # tensor as wq's heads.
    shardings = trainer.state_shardings["params"]["blocks"]["attn"]
    assert shardings["wq_lora"]["lora_b"].spec == jax.sharding.PartitionSpec(None, None, "tensor")
    assert shardings["wo_lora"]["lora_a"].spec == jax.sharding.PartitionSpec(None, "tensor", None)


WIDER = ["model.d_model=128", "model.d_ff=512"]  # the weights outweigh a checkpoint's small files


def _lora_train(run_dir, *extra) -> dict:
    """A LoRA run (with dropout, `WIDER`) of four steps on data x fsdp x tensor, checkpoints at
    2 and 4; returns {step: loss} from its metrics.jsonl."""
    from jaxpar.run.train import train

    cfg = parity.tiny_config(
        [
            *LORA,
            *WIDER,
            "finetune.lora.dropout=0.1",
            "train.steps=4",
            f"train.run_dir={run_dir}",
            "checkpoint.every=2",
            "checkpoint.keep=0",
            *[f"mesh.{a}={MESH.get(a, 1)}" for a in config_lib.MESH_AXES],
            *extra,
        ]
    )
    train(cfg, checks_lib.validate(cfg, 8))
    with open(run_dir / "metrics.jsonl") as f:
        return {r["step"]: r["loss"] for r in map(json.loads, f)}


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    """A LoRA run over configs/tiny.yaml's random init: its directory and its losses."""
    run_dir = tmp_path_factory.mktemp("lora") / "run"
    return run_dir, _lora_train(run_dir)


def test_a_lora_run_resumes_bit_exact(lora_run):
    """The same run again from its step-2 checkpoint (train.resume=2): steps 3 and 4 rerun with
    the same losses, bit for bit -- the adapters, their optimizer state and the step come back
    from the checkpoint, the frozen weights from the base it names, and dropout draws the same
    masks."""
    run_dir, straight = lora_run
    rerun = _lora_train(run_dir, "train.resume=2")
    assert sorted(rerun) == [1, 2, 3, 4]
    assert rerun == straight  # steps 3 and 4 bit-identical


def _bytes_under(path) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def test_a_lora_checkpoint_holds_the_adapters_and_names_its_base(lora_run):
    """On disk a LoRA checkpoint is its adapters, their Adam moments and a few small files, far
    less than the model: the frozen weights are not in it; its data item names the base."""
    from jaxpar.hf import base as base_lib
    from jaxpar.training.checkpoint import PARAMS_ITEM, Checkpointer, checkpoint_dir

    run_dir, _ = lora_run
    # Step 2's checkpoint, written once: the resume test reruns steps 3 and 4 into the same run
    # (after that rerun, on a loaded machine, step 4's directory held 1.16 MB for 0.27 MB of
    # arrays; not explained further).
    step_dir = os.path.join(checkpoint_dir(str(run_dir)), "2")
    trainer = parity.trainer_on([*LORA, *WIDER], {})
    adapters = trainer.trainable.split(trainer.state_shape["params"])[0]
    adapter_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(adapters))
    model_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(trainer.state_shape["params"]))
    on_disk = _bytes_under(step_dir)
    assert model_bytes > 10 * adapter_bytes
    assert on_disk < 2 * 3 * adapter_bytes + 256 * 1024, (on_disk, adapter_bytes)  # A, B + 2 moments
    assert on_disk < model_bytes / 2, (on_disk, model_bytes)
    saved = Checkpointer(checkpoint_dir(str(run_dir)), read_only=True)
    try:
        metadata = saved._manager.item_metadata(2)[PARAMS_ITEM]
        names = {jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(dict(metadata))[0]}
        assert names and all("_lora" in n for n in names), names
        # the random init of train.seed
        assert saved.data_state(2)[base_lib.BASE_KEY] == {"init_from": None, "step": None}
    finally:
        saved.close()


def test_a_lora_checkpoint_refuses_another_base(lora_run, tmp_path):
    """Resuming the adapters over another train.init_from than the one they were trained over
    is refused, naming both."""
    run_dir, _ = lora_run
    with pytest.raises(ConfigError) as err:
        _lora_train(run_dir, "train.resume=4", "train.steps=6", f"train.init_from={tmp_path}")
    assert "train.init_from" in str(err.value) and "random init" in str(err.value), str(err.value)


def test_sample_and_export_read_a_lora_checkpoint(lora_run, tmp_path):
    """`load_params` (what sample and to-hf read) rebuilds the model from the adapters over the
    base: the merged weights equal the base's with A B folded in, and the adapters those saved."""
    from jaxpar.hf.export import load_params

    run_dir, _ = lora_run
    cfg, merged, step = load_params(str(run_dir))
    _, params, _ = load_params(str(run_dir), merge_lora=False)
    assert step == 4
    trainer = parity.trainer_on([*LORA, *WIDER], {})
    base = _flat(trainer.trainable.split(jax.device_get(trainer.init()["params"]))[1])
    frozen = _flat(trainer.trainable.split(params)[1])
    assert frozen.keys() == base.keys()
    for name in base:
        assert frozen[name].tobytes() == base[name].tobytes(), name
    want = _flat(lora_lib.merged(params, cfg.finetune.lora))
    got = _flat(merged)
    assert got.keys() == want.keys() and "['blocks']['attn']['wq']" in got
    assert not np.array_equal(got["['blocks']['attn']['wq']"], base["['blocks']['attn']['wq']"])


def test_the_merged_weights_compute_the_adapted_model():
    """`lora.merged` (what to-hf writes): W + alpha/rank A B gives the adapted model's logits."""
    from flax import nnx

    from jaxpar.models.llama import Transformer
    from jaxpar.training.trainer import new_model

    cfg = parity.tiny_config(LORA)
    params = with_random_b(nnx.to_pure_dict(nnx.state(new_model(cfg))))
    tokens = np.random.default_rng(0).integers(0, cfg.model.vocab_size, (2, 16)).astype(np.int32)
    positions, segments = np.broadcast_to(np.arange(16), tokens.shape), np.ones_like(tokens)
    adapted = nnx.merge(nnx.graphdef(nnx.eval_shape(lambda: new_model(cfg))), params)
    base_graph = nnx.graphdef(nnx.eval_shape(lambda: Transformer(cfg.model, rngs=nnx.Rngs(0))))
    merged = nnx.merge(base_graph, lora_lib.merged(params, cfg.finetune.lora))
    unadapted = nnx.merge(base_graph, lora_lib.Trainable.of(adapted).split(params)[1])
    want = np.asarray(adapted(tokens, positions, segments)[0])
    got = np.asarray(merged(tokens, positions, segments)[0])
    base = np.asarray(unadapted(tokens, positions, segments)[0])
    scale = np.max(np.abs(want))
    assert np.max(np.abs(got - want)) <= 1e-5 * scale
    assert np.max(np.abs(base - want)) > 100 * 1e-5 * scale  # the adapters change the logits


# --- Dropout (finetune.lora.dropout) ---------------------------------------------------------

DROPOUT = [*LORA, "finetune.lora.dropout=0.25", "parallel.grad_reduce_dtype=float32"]


def test_noise_drops_at_its_rate_per_token_seed_and_path():
    """`lora.Noise.drop`: about `rate` of the elements zeroed, the rest scaled by 1 / (1 - rate);
    a token's mask depends on its seed and the path alone (equal seeds, equal rows, wherever
    they sit), and another path draws another mask."""
    rate, width = 0.25, 512
    seeds = jax.numpy.asarray(np.arange(8, dtype=np.uint32).reshape(2, 4))
    x = jax.numpy.ones((2, 4, width), jax.numpy.float32)
    noise = lora_lib.Noise(seeds).at(3).at(1)
    dropped = np.asarray(noise.drop(x, rate))
    assert set(np.unique(dropped)) == {0.0, np.float32(1 / (1 - rate))}
    assert abs(np.mean(dropped == 0) - rate) < 0.03
    moved = np.asarray(lora_lib.Noise(seeds[::-1, ::-1]).at(3).at(1).drop(x, rate))
    np.testing.assert_array_equal(moved[::-1, ::-1], dropped)  # the seed decides, not the place
    other = np.asarray(lora_lib.Noise(seeds).at(3).at(2).drop(x, rate))
    assert np.mean(other != dropped) > 0.2
    assert len({dropped[0, i].tobytes() for i in range(4)}) == 4  # the tokens' masks differ


def _grads_at(trainer, init, batch, step: int):
    """The gradients of one step from the host state `init` with its step counter at `step`."""
    state = jax.device_put({**init, "step": np.int32(step)}, trainer.state_shardings)
    return _flat(jax.device_get(trainer.step(state, trainer.shard_batch(batch))[2]))


@pytest.fixture(scope="module")
def dropout_runs():
    """One device's LoRA step (random B) at finetune.lora.dropout = 0.25 and at 0, and the
    dropout step on data x fsdp x tensor = 2 x 2 x 2, all from the same state and batch."""
    one = parity.parity_trainer(DROPOUT, {})
    init = with_random_b(one.init())
    batch = next(parity.random_batches(one.cfg))
    plain = parity.parity_trainer([*LORA, "parallel.grad_reduce_dtype=float32"], {})
    mesh = parity.parity_trainer(DROPOUT, MESH)
    return {"one": one, "plain": plain, "mesh": mesh, "init": init, "batch": batch}


def test_dropout_is_drawn_per_step_and_repeats_within_a_step(dropout_runs):
    r = dropout_runs
    step3 = _grads_at(r["one"], r["init"], r["batch"], 3)
    again = _grads_at(r["one"], r["init"], r["batch"], 3)
    step4 = _grads_at(r["one"], r["init"], r["batch"], 4)
    undropped = _grads_at(r["plain"], r["init"], r["batch"], 3)
    assert len(step3) == 14
    for name in step3:
        assert step3[name].tobytes() == again[name].tobytes(), name  # deterministic given the step
        for other in (step4, undropped):  # another step draws another mask; dropout changes them
            change = np.linalg.norm(step3[name] - other[name]) / np.linalg.norm(other[name])
            assert change > 1e-2, (name, change)


@pytest.mark.parametrize("ring", [False, True])
def test_dropout_gradients_on_a_mesh_equal_one_device_leaf_by_leaf(dropout_runs, ring):
    """The masks come from the tokens' seeds, not from where a device holds them: a data x fsdp
    x tensor step gives one device's adapter gradients under dropout, and so does context x fsdp
    x tensor, whose ring attention reorders the sequence (the seeds move with their tokens)."""
    r = dropout_runs
    want = _grads_at(r["one"], r["init"], r["batch"], 5)
    mesh = parity.parity_trainer(DROPOUT, {"context": 2, "fsdp": 2, "tensor": 2}) if ring else r["mesh"]
    got = _grads_at(mesh, r["init"], r["batch"], 5)
    parity.assert_nonzero(want)
    parity.assert_grads_match(got, want)


def test_evaluation_does_not_drop(dropout_runs):
    """The eval loss of a dropout run equals the same params' without dropout, bit for bit, and
    differs from the dropout step's training loss."""
    r = dropout_runs
    params = r["init"]["params"]
    got = [np.asarray(v) for v in r["one"].evaluate(params, r["one"].shard_batch(r["batch"]))]
    want = [np.asarray(v) for v in r["plain"].evaluate(params, r["plain"].shard_batch(r["batch"]))]
    assert got[0].tobytes() == want[0].tobytes() and got[1] == want[1]
    state = jax.device_put(r["init"], r["one"].state_shardings)
    trained = float(r["one"].step(state, r["one"].shard_batch(r["batch"]))[1]["loss"])
    assert trained != float(got[0] / got[1])


def test_dropout_reaches_the_blocks_of_a_moe_group():
    """model.moe.every=2 (the scan's unit a group of two blocks, the second's MLP an MoE one
    without adapters): dropout on q and o changes every adapter's gradient, step by step."""
    moe = ["model.moe.num_experts=4", "model.moe.every=2", "model.n_layers=4", "finetune.lora.targets=[q,o]"]
    rank = [*LORA[:2], "parallel.grad_reduce_dtype=float32", *moe]
    one = parity.parity_trainer([*rank, "finetune.lora.dropout=0.25"], {})
    init = with_random_b(one.init())
    batch = next(parity.random_batches(one.cfg))
    dropped = _grads_at(one, init, batch, 1)
    plain = _grads_at(parity.parity_trainer(rank, {}), init, batch, 1)
    assert len(dropped) == 2 * 2 * 2  # q and o of each block of the group, A and B
    for name in dropped:
        assert np.all(np.isfinite(dropped[name])), name
        change = np.linalg.norm(dropped[name] - plain[name]) / np.linalg.norm(plain[name])
        assert change > 1e-2, (name, change)


def test_no_dropout_compiles_no_random_numbers():
    """finetune.lora.dropout=0 leaves the step as it was: its program draws no random bits
    (the dropout step's does)."""
    from jaxpar.compiled import targets as targets_lib

    texts = {}
    for rate in ("0", "0.25"):
        trainer = parity.trainer_on([*LORA, f"finetune.lora.dropout={rate}"], {})
        with targets_lib.lowering_context(trainer.mesh):
            texts[rate] = trainer.step.lower(trainer.state_shape, trainer.batch_shape()).as_text()
    assert "threefry" not in texts["0"] and "threefry" in texts["0.25"]


def test_the_peft_adapter_names_a_base_peft_can_load(tmp_path):
    """adapter_config.json's base: a Hub snapshot in huggingface_hub's cache by its model id and
    commit, a Hugging Face directory by its path (a jaxpar run by its path too, with a note from
    the export), null without train.init_from."""
    from jaxpar.hf.export import peft_base

    snapshot = tmp_path / "hub" / "models--org--tiny-llama" / "snapshots" / "0123abcd"
    snapshot.mkdir(parents=True)
    assert peft_base(str(snapshot)) == {"base_model_name_or_path": "org/tiny-llama", "revision": "0123abcd"}
    assert peft_base(str(tmp_path)) == {"base_model_name_or_path": str(tmp_path)}
    assert peft_base(None) == {"base_model_name_or_path": None}


def _save_base(base_dir, step: int, weights) -> None:
    from jaxpar.training.checkpoint import Checkpointer, checkpoint_dir

    ckpt = Checkpointer(checkpoint_dir(str(base_dir)), keep=0)
    try:
        ckpt.save(step, {"params": weights}, None, force=True)
    finally:
        ckpt.close()


def _recorded_base(run_dir, step: int) -> dict:
    from jaxpar.hf import base as base_lib
    from jaxpar.training.checkpoint import Checkpointer, checkpoint_dir

    recorded = Checkpointer(checkpoint_dir(str(run_dir)), read_only=True)
    try:
        return recorded.data_state(step)[base_lib.BASE_KEY]
    finally:
        recorded.close()


def _identity(base_dir, step: int) -> str:
    from jaxpar.training.checkpoint import checkpoint_dir, params_identity

    return params_identity(os.path.join(checkpoint_dir(str(base_dir)), str(step)))


def _base_run(tmp_path):
    """(weights, directory, LoRA overrides over it): a base run directory whose checkpoint 0
    holds the tiny model's initial weights, and the settings of a one-device LoRA run over it."""
    plain = parity.trainer_on([], {})
    weights = jax.device_get(plain.init()["params"])
    base_dir = tmp_path / "base"
    base_dir.mkdir()
    config_lib.dump_yaml(plain.cfg, str(base_dir / "config.yaml"))
    _save_base(base_dir, 0, weights)
    one = [f"mesh.{a}={MESH.get(a, 1)}" for a in config_lib.MESH_AXES]
    overrides = [*LORA, *one, "checkpoint.every=2", "checkpoint.keep=0", f"train.init_from={base_dir}"]
    return weights, base_dir, overrides


def test_a_lora_run_over_a_jaxpar_run_keeps_the_base_step_it_trained_over(tmp_path, monkeypatch):
    """Base: a run directory whose checkpoint 0 holds whole weights (as from-hf writes one). The
    base run trains on while the LoRA run starts (a checkpoint 3 right after the LoRA run loaded
    step 0) and again before the LoRA run resumes (a checkpoint 5): every LoRA checkpoint, the
    resumed run's too, names step 0, and `load_params` rebuilds the model over step 0's weights;
    once that checkpoint is gone it says so. A LoRA run cannot itself be a base.

    Guards the bug where each save recorded the base run's newest step, not the one the adapters
    were trained over (`sample` and `to-hf` then laid them over another model)."""
    from jaxpar.hf import base as base_lib
    from jaxpar.hf.export import load_params
    from jaxpar.run.train import train

    weights, base_dir, overrides = _base_run(tmp_path)
    start = base_lib.init_state

    def base_trains_on(trainer, path):
        state = start(trainer, path)
        _save_base(base_dir, 3, jax.tree.map(lambda x: x + 1, weights))
        return state

    monkeypatch.setattr(base_lib, "init_state", base_trains_on)
    cfg = parity.tiny_config([*overrides, "train.steps=2", f"train.run_dir={tmp_path / 'run'}"])
    train(cfg, checks_lib.validate(cfg, 8))
    monkeypatch.undo()
    pinned = {"init_from": str(base_dir), "step": 0, base_lib.IDENTITY_KEY: _identity(base_dir, 0)}
    assert _recorded_base(tmp_path / "run", 2) == pinned
    _save_base(base_dir, 5, jax.tree.map(lambda x: x + 2, weights))
    cfg = parity.tiny_config([*overrides, "train.steps=4", f"train.run_dir={tmp_path / 'run'}"])
    train(cfg, checks_lib.validate(cfg, 8))  # resumes from step 2
    assert _recorded_base(tmp_path / "run", 4) == pinned
    _, params, step = load_params(str(tmp_path / "run"), merge_lora=False)
    assert step == 4
    trainer = parity.trainer_on(LORA, {})
    frozen = _flat(trainer.trainable.split(params)[1])
    for name, want in _flat(weights).items():
        assert frozen[name].tobytes() == want.tobytes(), name
    shutil.rmtree(base_dir / "checkpoints" / "0")  # the base run's checkpoint.keep dropped it
    with pytest.raises(ConfigError, match="trained over checkpoint step 0 of the base run"):
        load_params(str(tmp_path / "run"))
    again = parity.tiny_config([*overrides, "train.steps=2", f"train.run_dir={tmp_path / 'again'}"])
    again = dataclasses.replace(
        again, train=dataclasses.replace(again.train, init_from=str(tmp_path / "run"))
    )
    with pytest.raises(ConfigError, match="is a LoRA run"):
        train(again, checks_lib.validate(again, 8))


def test_a_lora_checkpoint_refuses_its_base_step_saved_again(tmp_path):
    """The base run's checkpoint 0, the one a LoRA run trained over, is replaced by another
    model saved at the same step (as a base run started over with train.resume=never does):
    `load_params` (sample, to-hf) and a resume refuse it, naming the step and what would work,
    instead of laying the adapters over the new weights. A record without the identity (a
    checkpoint from before it was recorded) is read as before.

    Guards the bug where a LoRA checkpoint named its base by (path, step) alone."""
    from jaxpar.hf import base as base_lib
    from jaxpar.hf.export import load_params
    from jaxpar.run.train import train
    from jaxpar.training.checkpoint import write_manifest

    weights, base_dir, overrides = _base_run(tmp_path)
    run = [*overrides, f"train.run_dir={tmp_path / 'run'}"]
    cfg = parity.tiny_config([*run, "train.steps=2"])
    train(cfg, checks_lib.validate(cfg, 8))
    shutil.move(base_dir / "checkpoints", base_dir / "replaced")  # the earlier run, set aside
    _save_base(base_dir, 0, jax.tree.map(lambda x: x + 1, weights))
    words = "checkpoint step 0 of the base run .* is not the one these adapters were trained over"
    with pytest.raises(ConfigError, match=words) as err:
        load_params(str(tmp_path / "run"))
    assert "train new adapters" in str(err.value) and "\n" not in str(err.value), str(err.value)
    cfg = parity.tiny_config([*run, "train.steps=4"])
    with pytest.raises(ConfigError, match=words):
        train(cfg, checks_lib.validate(cfg, 8))  # resumes from step 2
    # A record without the identity, as written before it was recorded, loads the base at step 0.
    data = tmp_path / "run" / "checkpoints" / "2" / "data" / "metadata"
    saved = json.loads(data.read_text())
    del saved["data"][base_lib.BASE_KEY][base_lib.IDENTITY_KEY]
    data.write_text(json.dumps(saved))
    write_manifest(str(data.parent.parent), 2)  # the edit is not damage
    _, params, step = load_params(str(tmp_path / "run"), merge_lora=False)
    frozen = _flat(parity.trainer_on(LORA, {}).trainable.split(params)[1])
    assert step == 2 and all(frozen[k].tobytes() == (v + 1).tobytes() for k, v in _flat(weights).items())
