"""Document-slot buckets: the training loop counts each batch's documents per row on the host and
runs the train step compiled for the smallest slot bucket that holds its fullest row, without the
NaN poison that guards unchecked callers (jaxpar.models.attention, `Trainer.step_for`).

Checked here: the ladder and the bucket a count picks; the count taken over every process; the
loop's dispatch; what cuDNN's packed call is handed, in and out of a bucket, against the XLA path
(a stand-in for cuDNN computes the attention the offsets describe: nothing here has a GPU); and
the H100 programs themselves (compiled here, jaxpar.compiled.targets): a bucket's call has that many slots
and no poison, a one-document bucket is the plain causal call, and the unchecked evaluation step
keeps the poison."""

from __future__ import annotations

import inspect as pyinspect
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpar.checks import validate
from jaxpar.compiled import hlo
from jaxpar.compiled import targets as targets_lib
from jaxpar.config import ConfigError, load_config
from jaxpar.models import attention
from jaxpar.models.attention import attend, slot_bucket, slot_buckets
from jaxpar.run import train as train_lib
from jaxpar.training.trainer import build_trainer, compile_step
from tests.test_attention import random_segment_ids

# --- The ladder -----------------------------------------------------------------------------------


def test_the_ladder_is_powers_of_two_then_the_limit():
    assert slot_buckets(32) == (1, 2, 4, 8, 16, 32)
    assert slot_buckets(24) == (1, 2, 4, 8, 16, 24)
    assert slot_buckets(16) == (1, 2, 4, 8, 16)
    assert slot_buckets(3) == (1, 2, 3)
    assert slot_buckets(1) == (1,)


@pytest.mark.parametrize("limit", [1, 2, 5, 16, 24, 32])
def test_a_batch_gets_the_smallest_bucket_that_holds_its_fullest_row(limit):
    """Guards a bucket one short of the row (an off-by-one in the ladder or the comparison) and
    a bucket larger than needed."""
    ladder = slot_buckets(limit)
    for documents in range(1, limit + 1):
        bucket = slot_bucket(documents, limit)
        assert bucket in ladder and bucket >= documents, (documents, bucket)
        assert not [b for b in ladder if documents <= b < bucket], (documents, bucket)
    assert [slot_bucket(d, 32) for d in (1, 2, 3, 4, 5, 9, 16, 17, 24, 32)] == [
        1,
        2,
        4,
        4,
        8,
        16,
        16,
        32,
        32,
        32,
    ]


def test_no_bucket_for_rows_beyond_the_limit():
    with pytest.raises(ValueError, match="a row of 33 documents .* 1..32 .*max_documents_per_row=32"):
        slot_bucket(33, 32)
    with pytest.raises(ValueError, match="a row of 0 documents"):
        slot_bucket(0, 32)


# --- The host's count -------------------------------------------------------------------------------


def _rows(*documents: int, seq: int = 32) -> np.ndarray:
    """Segment ids [len(documents), seq]: row i holds documents[i] documents."""
    return np.stack(
        [np.repeat(np.arange(1, d + 1), np.diff(np.linspace(0, seq, d + 1).astype(int))) for d in documents]
    ).astype(np.int32)


def test_the_count_is_the_fullest_row_over_every_process(monkeypatch):
    """Guards the count of this process's rows alone: another process's fuller row (9 documents,
    here) would make it run another bucket's program (a hang in the step's collectives) and a
    bucket too small for that row (a wrong attention, unpoisoned)."""
    from jax.experimental import multihost_utils

    gathered = []

    def allgather(x):
        gathered.append(int(x))
        return np.array([int(x), 9], np.int32)  # process 1's fullest row holds 9

    monkeypatch.setattr(jax, "process_count", lambda: 2)
    monkeypatch.setattr(multihost_utils, "process_allgather", allgather)
    assert train_lib._check_documents_per_row(_rows(1, 3, 2), 32, step=5) == 9
    assert gathered == [3]
    with pytest.raises(
        ConfigError,
        match=r"step 7 has a row of 9 documents, more than model.max_documents_per_row=8.*=9 or more",
    ):
        train_lib._check_documents_per_row(_rows(1, 3, 2), 8, step=7)


def test_one_process_counts_its_rows():
    assert train_lib._check_documents_per_row(_rows(1, 4, 2), 4, step=1) == 4
    with pytest.raises(
        ConfigError, match="has a row of 5 documents, more than model.max_documents_per_row=4"
    ):
        train_lib._check_documents_per_row(_rows(5, 1), 4, step=1)


# --- The loop's dispatch -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny():
    """The tiny model's trainer on one CPU (XLA attention: one step, no buckets)."""
    one = ["runtime.cpu_devices=1", "mesh.data=1", "mesh.fsdp=1", "mesh.tensor=1"]
    cfg = load_config("configs/tiny.yaml", one)
    return build_trainer(cfg, validate(cfg, 1), devices=jax.devices()[:1])


class _Clock:
    def __init__(self):
        self.compiled = 0

    def compiling(self, fn, *args):
        self.compiled += 1
        return fn(*args)


def test_the_loop_runs_each_batch_with_its_buckets_step(tiny):
    """`train._step` (the loop's dispatch) with a trainer whose bucket steps record what they are
    given: each batch reaches the step of slot_bucket(its fullest row), each bucket's step is
    made once (its first call is the clock's compile time), and the plain step is never used."""
    import dataclasses

    made, ran = [], []

    def checked_step(bucket):
        made.append(bucket)

        def step(state, batch):
            ran.append((bucket, int(train_lib.documents_per_row(np.asarray(batch["segment_ids"])).max())))
            return state, {}

        return step

    trainer = dataclasses.replace(tiny, checked_step=checked_step, bucket_steps={}, step=None)
    trainer.cfg = dataclasses.replace(
        tiny.cfg, model=dataclasses.replace(tiny.cfg.model, max_documents_per_row=16)
    )
    clock = _Clock()
    rows = [(1, 1), (3, 1), (2, 4), (5, 2), (16, 1), (1, 2)]
    for step, documents in enumerate(rows, 1):
        local = {
            k: np.zeros((8, 32), np.float32 if k == "loss_mask" else np.int32)
            for k in ("inputs", "targets", "positions", "loss_mask")
        }
        local["segment_ids"] = np.concatenate([_rows(*documents)] * 4)
        train_lib._step(trainer, clock, None, local, step)
    assert ran == [(1, 1), (4, 3), (4, 4), (8, 5), (16, 16), (2, 2)]
    assert made == [1, 4, 8, 16, 2] and clock.compiled == 5


def test_where_nothing_depends_on_the_documents_one_step_serves(tiny):
    assert not tiny.bucketed and tiny.checked_step is None
    assert tiny.step_for(1) is tiny.step_for(7) is tiny.step
    assert tiny.bucket(3) is None


# --- What cuDNN's packed call is handed (a stand-in computes it, on the CPU) ------------------------


class _FakeCudnn:
    """jax's cuDNN attention module as `attention._fused()` returns it, computing on the CPU the
    attention that the offsets and lengths describe (causal inside each described document; the
    plain call: causal over the row), and recording the slots of each call (None: plain)."""

    MaskType = types.SimpleNamespace(CAUSAL="CAUSAL")

    def __init__(self):
        self.slots = []

    def dot_product_attention(
        self,
        q,
        k,
        v,
        q_seqlen=None,
        kv_seqlen=None,
        q_offsets=None,
        kv_offsets=None,
        *,
        scale,
        mask_type,
        sliding_window_length,
    ):
        assert mask_type == "CAUSAL" and sliding_window_length is None
        seq = q.shape[1]
        pos = jnp.arange(seq)
        causal = pos[None, :] <= pos[:, None]
        if q_seqlen is None:
            self.slots.append(None)
            mask = causal[None, None]
        else:
            self.slots.append(q_seqlen.shape[1])
            starts, lengths = q_offsets[:, :-1, None], q_seqlen[:, :, None]  # [B, M, 1]
            inside = (lengths > 0) & (pos >= starts) & (pos < starts + lengths)  # [B, M, T]
            same = jnp.einsum("bjq,bjk->bqk", inside.astype(jnp.int32), inside.astype(jnp.int32)) > 0
            mask = (same & causal[None])[:, None]
        return jax.nn.dot_product_attention(q, k, v, mask=mask, scale=scale, implementation="xla")


@pytest.fixture
def fake_cudnn(monkeypatch):
    fake = _FakeCudnn()
    monkeypatch.setattr(attention, "_fused", lambda: fake)
    return fake


def _qkv(batch, seq=64, heads=4, kv_heads=2, head_dim=16):
    rng = np.random.default_rng(0)
    shapes = [(batch, seq, heads, head_dim)] + [(batch, seq, kv_heads, head_dim)] * 2
    return [jnp.asarray(rng.standard_normal(s), jnp.bfloat16) for s in shapes]


def _traced(checked: int | None, q, k, v, ids) -> str:
    """The jaxpr of the cuDNN path, checked for `checked` documents per row (None: unchecked, 32
    slots)."""

    def run(q, k, v, ids):
        return attend(q, k, v, ids, implementation="cudnn", max_segments=checked or 32, checked=bool(checked))

    return str(jax.make_jaxpr(run)(q, k, v, ids))


def test_a_bucket_describes_every_document_of_its_rows_and_poisons_nothing(fake_cudnn):
    """Checked for k documents, the call describes k slots and leaves out the poison; the
    attention is the XLA path's where every row fits (a bucket one short would move a document's
    tokens out of it)."""
    ids = np.concatenate([random_segment_ids(np.random.default_rng(1), 5, 64, 4), _rows(4, seq=64)])
    q, k, v = _qkv(len(ids))
    want = np.asarray(attend(q, k, v, jnp.asarray(ids), implementation="xla"), np.float32)
    got = attend(q, k, v, jnp.asarray(ids), implementation="cudnn", max_segments=4, checked=True)
    assert fake_cudnn.slots == [4]
    np.testing.assert_allclose(np.asarray(got, np.float32), want, atol=2e-2)
    assert "nan" not in _traced(4, q, k, v, ids) and "nan" in _traced(None, q, k, v, ids)  # the poison
    assert fake_cudnn.slots == [4, 4, 32]
    one = _rows(1, 1, 1, seq=64)
    got = attend(*_qkv(3), jnp.asarray(one), implementation="cudnn", max_segments=1, checked=True)
    assert fake_cudnn.slots[-1] is None  # one slot: the plain causal call
    want = attend(*_qkv(3), jnp.asarray(one), implementation="xla")
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), atol=2e-2)


def test_unchecked_rows_beyond_the_slots_come_out_nan(fake_cudnn):
    """Guards the poison dropped for everyone: outside a bucket, max_segments slots are
    described and a row with more documents is NaN, the others exact."""
    ids = _rows(1, 3, 4, 2, seq=64)
    q, k, v = _qkv(len(ids))
    got = np.asarray(attend(q, k, v, jnp.asarray(ids), implementation="cudnn", max_segments=3), np.float32)
    assert fake_cudnn.slots == [3]
    assert np.isnan(got[2]).all() and np.isfinite(got[[0, 1, 3]]).all()
    want = np.asarray(attend(q, k, v, jnp.asarray(ids), implementation="xla"), np.float32)
    np.testing.assert_allclose(got[[0, 1, 3]], want[[0, 1, 3]], atol=2e-2)


# --- The H100 programs, compiled here -------------------------------------------------------------


SMALL = {
    "model.vocab_size": 1024,
    "model.d_model": 128,
    "model.n_layers": 2,
    "model.n_heads": 2,
    "model.n_kv_heads": 1,
    "model.d_ff": 256,
    "model.max_documents_per_row": 8,
    "train.batch_size": 4,
    "train.seq_len": 128,
    "train.loss_chunks": 1,
    "runtime.cpu_devices": 1,
    "mesh.data": 1,
    "mesh.fsdp": 1,
    "mesh.tensor": 1,
    "parallel.zero_stage": 0,
}
B, T = SMALL["train.batch_size"], SMALL["train.seq_len"]


@pytest.fixture(scope="module")
def h100():
    """The SMALL model's trainer on one compile-only H100: cuDNN attention, buckets 1, 2, 4, 8."""
    pytest.importorskip("jax_plugins.xla_cuda12", reason="needs the gpu-compile extra")
    cfg = load_config(None, [f"{k}={v}" for k, v in SMALL.items()])
    trainer = build_trainer(cfg, validate(cfg, 1), devices=targets_lib.devices(targets_lib.resolve("h100:1")))
    assert trainer.cfg.model.attention == "cudnn" and trainer.bucketed
    return trainer


def _attention_operands(text: str) -> dict[str, list[str]]:
    """{cuDNN custom-call target: the shapes of its operands} of compiled HLO text."""
    calls = {}
    for line in text.splitlines():
        found = hlo_target(line)
        if found:
            layouts = line.split("operand_layout_constraints={", 1)[1].split("}, api_version", 1)[0]
            calls[found] = [s.split("{")[0] for s in layouts.split(", ")]
    return calls


def hlo_target(line: str) -> str | None:
    marker = 'custom_call_target="__cudnn$fmha'
    if "custom-call(" not in line or marker not in line:
        return None
    return "__cudnn$fmha" + line.split(marker, 1)[1].split('"', 1)[0]


def _poison_ops(text: str) -> list[str]:
    """The instructions of compiled HLO text made by `attention.poison_overflow`'s lines."""
    lines, first = pyinspect.getsourcelines(attention.poison_overflow)
    body = range(first, first + len(lines))
    frames = hlo.source_lines(text)
    return [
        ins.name
        for comp in hlo.parse(text).values()
        for ins in comp.instrs
        if (found := hlo.source_of(ins, frames)) and found[0].endswith("attention.py") and found[1] in body
    ]


def test_a_bucket_compiles_its_slots_and_no_poison(h100):
    """The train step for rows of at most 3 documents: bucket 4, so lengths [B, 4] and offsets
    [B, 5] in the forward and backward calls (guards the bucket's program keeping
    max_documents_per_row slots) and no instruction of the poison (guards it left in)."""
    text = compile_step(h100, documents=3).as_text()
    calls = _attention_operands(text)
    slots = [f"s32[{B},4]", f"s32[{B},4]", f"s32[{B},5]", f"s32[{B},5]"]
    assert calls["__cudnn$fmhaSoftmax"][3:] == slots, calls
    assert calls["__cudnn$fmhaSoftmaxBackward"][-4:] == slots, calls
    assert not _poison_ops(text) and "nan" not in text.lower()
    assert h100.step_for(3) is h100.step_for(4) is h100.bucket_steps[4]  # made once


def test_a_one_document_bucket_is_the_plain_causal_call(h100):
    text = compile_step(h100, documents=1).as_text()
    calls = _attention_operands(text)
    assert set(calls) == {"__cudnn$fmhaSoftmax", "__cudnn$fmhaSoftmaxBackward"}
    assert not any(s.startswith("s32") for shapes in calls.values() for s in shapes), calls
    assert not _poison_ops(text) and "nan" not in text.lower()


def test_the_unchecked_evaluation_keeps_every_slot_and_the_poison(h100):
    """The evaluation step's batches are not checked on the host: its program describes
    model.max_documents_per_row slots and makes a fuller row NaN (guards the poison dropped
    everywhere, and `_poison_ops` finding nothing whatever the program)."""
    params = h100.state_shape["params"]
    with targets_lib.lowering_context(h100.mesh):
        text = h100.evaluate.lower(params, h100.batch_shape()).compile().as_text()
    assert _attention_operands(text)["__cudnn$fmhaSoftmax"][3:] == [f"s32[{B},8]"] * 2 + [f"s32[{B},9]"] * 2
    assert _poison_ops(text) and "nan" in text.lower()
