"""Evaluation (train.eval_every, train.eval_batches) on the val split, and a mixture's training run.

Two prepared sources whose training documents and validation documents use different letters
(each document is kept only if the preparation's hash sends it to the split its letters are for),
so every packed row says which source and which split it came from.
"""

import glob
import json
import struct
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx

from jaxpar import checks as checks_lib
from jaxpar import config as config_lib
from jaxpar.config import ConfigError, DataConfig, SourceConfig
from jaxpar.corpus import data, prepare, reader
from jaxpar.corpus.data import make_iterator
from jaxpar.corpus.documents import ByteTokenizer
from jaxpar.run.train import build_trainer, train

TINY = str(Path(__file__).resolve().parents[1] / "configs" / "tiny.yaml")
VAL_FRACTION = 0.3
# source -> (the letters of its training documents, of its validation documents)
LETTERS = {"a": ("abcdefgh", "ijklmnop"), "b": ("qrstuvwx", "ABCDEFGH")}
SEQ, BATCH = 32, 8


def split_documents(train_letters: str, val_letters: str, count: int, seed: int) -> list[str]:
    """`count` documents that prepare() puts in the train split, written in train_letters, and
    about count / 5 (30% drawn, of which the hash keeps 30%) that it puts in the val split, in
    val_letters, interleaved."""
    rng = np.random.default_rng(seed)
    docs, kept = [], {"train": 0, "val": 0}
    while kept["train"] < count:
        split = "val" if rng.random() < 0.3 else "train"
        letters = val_letters if split == "val" else train_letters
        text = "".join(rng.choice(list(letters), size=rng.integers(10, 120)))
        if prepare._is_val(text, VAL_FRACTION) == (split == "val"):
            docs.append(text)
            kept[split] += 1
    return docs


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    root = tmp_path_factory.mktemp("eval")
    out = {}
    for n, (name, (train_letters, val_letters)) in enumerate(LETTERS.items()):
        jsonl = root / f"{name}.jsonl"
        jsonl.write_text(
            "".join(
                json.dumps({"text": d}) + "\n" for d in split_documents(train_letters, val_letters, 150, n)
            )
        )
        out[name] = root / name
        prepare.prepare(
            [str(jsonl)], str(out[name]), val_fraction=VAL_FRACTION, log=lambda m: None, progress=False
        )
    out["no-val"] = root / "no-val"
    prepare.prepare([str(root / "a.jsonl")], str(out["no-val"]), log=lambda m: None, progress=False)
    return out


def mixture_sources(prepared) -> str:
    return f"[{{path: {prepared['a']}, weight: 0.75}}, {{path: {prepared['b']}, weight: 0.25}}]"


def row_origin(row: np.ndarray) -> tuple[str, str]:
    """(source, split) of a packed row, from its letters."""
    found = set()
    for source, letters in LETTERS.items():
        for split, alphabet in zip(("train", "val"), letters):
            if np.isin(row, np.frombuffer(alphabet.encode(), np.uint8)).any():
                found.add((source, split))
    assert len(found) == 1, row
    return found.pop()


def test_eval_batches_are_the_val_splits_the_same_every_time(prepared):
    """Only val rows, in the mixture's proportions; a fresh iterator gives the same batches; the
    processes' shares make up the global batches; too many batches or no val split are refused."""
    cfg = DataConfig(sources=[SourceConfig(str(prepared["a"]), 0.75), SourceConfig(str(prepared["b"]), 0.25)])
    dataset = data.eval_dataset(cfg, SEQ, global_batch=BATCH, batches=4)
    first, again = list(make_iterator(dataset)), list(make_iterator(dataset))
    assert len(first) == 4
    for x, y in zip(first, again, strict=True):
        np.testing.assert_array_equal(x["inputs"], y["inputs"])
    origins = [row_origin(row) for batch in first for row in batch["inputs"]]
    assert {split for _, split in origins} == {"val"}
    assert [sum(s == name for s, _ in origins) for name in "ab"] == data.mixture_counts((300, 100), 32)
    assert len({tuple(row) for batch in first for row in batch["inputs"]}) == 32  # none twice
    shares = [
        list(
            make_iterator(
                data.eval_dataset(cfg, SEQ, global_batch=BATCH, batches=4, process_index=p, process_count=2)
            )
        )
        for p in range(2)
    ]
    for s in range(4):
        joined = np.concatenate([shares[0][s]["inputs"], shares[1][s]["inputs"]])
        np.testing.assert_array_equal(joined, first[s]["inputs"])
    single = data.eval_dataset(DataConfig(source=str(prepared["b"])), SEQ, global_batch=BATCH, batches=2)
    assert {row_origin(row) for batch in make_iterator(single) for row in batch["inputs"]} == {("b", "val")}

    held = len(reader.PreparedSequences(str(prepared["b"]), "byte", SEQ, split="val"))
    with pytest.raises(
        ConfigError,
        match=rf"train.eval_batches=99: .* from the val split of "
        rf"data.source='{prepared['b']}', which holds {held}; use "
        rf"train.eval_batches={held // BATCH} or fewer",
    ):
        data.eval_dataset(DataConfig(source=str(prepared["b"])), SEQ, global_batch=BATCH, batches=99)
    no_val = DataConfig(
        sources=[SourceConfig(str(prepared["a"]), 1.0), SourceConfig(str(prepared["no-val"]), 1.0)]
    )
    with pytest.raises(
        ConfigError,
        match=rf"data.sources\[1\].path='{prepared['no-val']}' has none "
        r"\(.*manifest.json: prepared without --val-fraction\)",
    ):
        data.eval_dataset(no_val, SEQ, global_batch=BATCH, batches=1)
    for source in ("stdlib", str(prepared["a"] / "*.bin")):
        cfg = config_lib.load_config(TINY, [f"data.source={source}", "train.eval_every=10"])
        with pytest.raises(
            ConfigError,
            match=r"train.eval_every=10 evaluates on a validation split, "
            r"and data.source=.* has none: prepare it with one",
        ):
            checks_lib.validate(cfg, 8)


def test_whole_packing_reaches_a_mixtures_sources_and_the_val_splits(prepared):
    """data.packing=whole: every source of data.sources, and every val split evaluation reads,
    is packed whole: the batches hold exactly their whole rows."""
    sources = [SourceConfig(str(prepared["a"]), 0.75), SourceConfig(str(prepared["b"]), 0.25)]
    cfg = DataConfig(sources=sources, packing="whole")

    def whole(name, split):
        rows = reader.PreparedSequences(str(prepared[name]), "byte", SEQ, split=split, packing="whole")
        assert rows.rows is not None
        return {tuple(rows[i]["inputs"]) for i in range(len(rows))}

    mixed = data.batch_dataset(data.training_source(cfg, ByteTokenizer(), SEQ), global_batch=BATCH, seed=0)
    evaluated = data.eval_dataset(cfg, SEQ, global_batch=BATCH, batches=2)
    for dataset, split in ((mixed, "train"), (evaluated, "val")):
        batches = list(make_iterator(dataset[:2]))
        rows = {tuple(row) for batch in batches for row in batch["inputs"]}
        assert rows <= whole("a", split) | whole("b", split)
        assert any(batch["loss_mask"][:, -1].min() == 0 for batch in batches)


def tensorboard_scalars(run_dir) -> dict[str, list[tuple[int, float]]]:
    """The scalars of the run's event files (TFRecord framing: length, crc, Event, crc)."""
    from tensorboardX.proto.event_pb2 import Event

    scalars = {}
    for path in glob.glob(str(run_dir / "events.out.tfevents.*")):
        blob = open(path, "rb").read()
        at = 0
        while at < len(blob):
            (length,) = struct.unpack("<Q", blob[at : at + 8])
            event = Event.FromString(blob[at + 12 : at + 12 + length])
            at += 12 + length + 4
            for value in event.summary.value:
                scalars.setdefault(value.tag, []).append((event.step, value.simple_value))
    return scalars


RUN = [
    f"train.seq_len={SEQ}",
    f"train.batch_size={BATCH}",
    "train.steps=5",
    "train.log_every=1",
    "data.max_documents=null",
    "checkpoint.every=0",
    "mesh.data=8",
    "mesh.fsdp=1",
    "mesh.tensor=1",
]


@pytest.fixture(scope="module")
def runs(prepared, tmp_path_factory):
    """The same mixture trained 5 steps with evaluation every 2 steps (2 batches) and without."""
    out = {}
    for name, extra in (("eval", ["train.eval_every=2", "train.eval_batches=2"]), ("plain", [])):
        run_dir = tmp_path_factory.mktemp(name)
        cfg = config_lib.load_config(
            TINY, RUN + extra + [f"data.sources={mixture_sources(prepared)}", f"train.run_dir={run_dir}"]
        )
        summary = train(cfg, checks_lib.validate(cfg, 8))
        records = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
        out[name] = (run_dir, cfg, summary, records)
    return out


def test_evaluation_leaves_training_alone_and_logs_eval_loss(runs):
    run_dir, cfg, summary, records = runs["eval"]
    _, _, plain_summary, plain = runs["plain"]
    assert [r["step"] for r in records] == [r["step"] for r in plain] == [1, 2, 3, 4, 5]
    for key in ("loss", "grad_norm"):  # bit for bit: evaluating changed nothing in training
        assert [r[key] for r in records] == [r[key] for r in plain], key
    assert [r["step"] for r in records if "eval_loss" in r] == [2, 4, 5]  # and the last step
    assert not any("eval_loss" in r for r in plain)
    evals = [r["eval_loss"] for r in records if "eval_loss" in r]
    assert len(set(evals)) == 3  # the weights changed between evaluations
    assert summary["eval_loss"] == evals[-1] and plain_summary["eval_loss"] is None
    assert tensorboard_scalars(run_dir)["eval/loss"] == [
        (2, pytest.approx(evals[0])),
        (4, pytest.approx(evals[1])),
        (5, pytest.approx(evals[2])),
    ]
    assert (run_dir / "loss.png").stat().st_size > 1000


def test_eval_loss_is_the_final_weights_loss_on_the_val_batches(runs):
    """Recomputed here: the checkpoint's params, the plain model on one device, the val batches."""
    from jaxpar.sample import load_model

    run_dir, cfg, summary, records = runs["eval"]
    _, model, step = load_model(str(run_dir))
    assert step == 5
    loss = nnx.jit(lambda m, b: m.loss(b, chunks=1))
    nll = count = 0.0
    for batch in make_iterator(data.eval_dataset(cfg.data, SEQ, global_batch=BATCH, batches=2)):
        origins = {row_origin(row)[1] for row in batch["inputs"]}
        assert origins == {"val"}
        got_nll, got_count, _ = loss(model, batch)
        nll, count = nll + float(got_nll), count + float(got_count)
    assert records[-1]["eval_loss"] == pytest.approx(nll / count, rel=1e-5)
    # The train split's loss under the same weights is another number: the letters differ.
    train_batch = next(
        make_iterator(
            data.batch_dataset(data.training_source(cfg.data, None, SEQ), global_batch=BATCH, seed=0)
        )
    )
    train_nll, train_count, _ = loss(model, train_batch)
    assert abs(float(train_nll / train_count) - nll / count) > 0.5


def test_a_mixture_run_reports_the_tokens_it_saw_per_source(runs):
    run_dir, cfg, summary, records = runs["eval"]
    for r in records:
        a, b = data.mixture_counts((300, 100), r["step"] * BATCH)
        assert r["tokens_seen"] == {"a": a * SEQ, "b": b * SEQ}
    assert summary["tokens_seen"] == records[-1]["tokens_seen"] == {"a": 30 * SEQ, "b": 10 * SEQ}
    scalars = tensorboard_scalars(run_dir)
    assert scalars["train/tokens_seen/a"][-1] == (5, 30 * SEQ)
    from jaxpar.run.records import format_summary

    assert "| eval loss " in format_summary(summary)
    assert f"tokens seen: a {30 * SEQ:,} (75%), b {10 * SEQ:,} (25%)" in format_summary(summary)


def test_a_pipelined_layout_evaluates_the_same_loss():
    """mesh.pipe=2 (the pipeline's own loss, gradients unused) against data parallelism, on the
    same weights and batch."""
    cfg = config_lib.load_config(TINY, ["parallel.microbatches=2"])
    rng = np.random.default_rng(0)
    batch = {
        "inputs": rng.integers(0, 256, (8, 32)),
        "targets": rng.integers(0, 256, (8, 32)),
        "positions": np.tile(np.arange(32), (8, 1)),
        "segment_ids": np.ones((8, 32)),
        "loss_mask": (rng.random((8, 32)) < 0.9),
    }
    batch = {k: v.astype(np.float32 if k == "loss_mask" else np.int32) for k, v in batch.items()}
    results = []
    params = None
    for mesh in (
        ["mesh.data=8", "mesh.fsdp=1", "mesh.tensor=1"],
        ["mesh.pipe=2", "mesh.data=4", "mesh.fsdp=1", "mesh.tensor=1"],
    ):
        layout_cfg = config_lib.load_config(TINY, ["parallel.microbatches=2"] + mesh)
        trainer = build_trainer(layout_cfg, checks_lib.validate(layout_cfg, 8))
        if params is None:
            params = jax.device_get(trainer.init()["params"])
        placed = jax.device_put(params, trainer.state_shardings["params"])
        nll, count = trainer.evaluate(placed, trainer.shard_batch(batch))
        results.append((float(nll), float(count)))
    assert cfg.model.n_layers == 2  # one layer per stage
    assert results[1][1] == results[0][1] == batch["loss_mask"].sum()
    assert results[1][0] == pytest.approx(results[0][0], rel=1e-5)
