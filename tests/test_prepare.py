"""Prepared token shards (jaxpar.corpus.shards): `python -m jaxpar.data prepare`, and training from them.

The reference is always the raw path (`data.pack(data.read_documents(...))`, what training on the
source itself packs): prepared shards must give exactly its samples and batches. Only the last
test starts JAX (a training subprocess, for its peak memory).
"""

import gzip
import json
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from jaxpar import checks as checks_lib
from jaxpar import config as config_lib
from jaxpar.config import ConfigError, DataConfig
from jaxpar.corpus import data, prepare, reader
from jaxpar.corpus.data import batch_dataset, make_iterator, pack
from jaxpar.corpus.documents import ByteTokenizer, HFTokenizer

REPO_ROOT = Path(__file__).resolve().parents[1]
KEYS = ("inputs", "targets", "positions", "segment_ids", "loss_mask")


def random_documents(count: int, seed: int = 0) -> list[str]:
    """Varied lengths (1 to 120 characters, some multi-byte), so documents straddle shards."""
    rng = np.random.default_rng(seed)
    alphabet = list("abcdefghij klmnop\nqrstuvwxyzé✓")
    return ["".join(rng.choice(alphabet, size=rng.integers(1, 120))) for _ in range(count)]


DOCUMENTS = random_documents(150)


def quiet(message):  # the log of prepare() in tests
    pass


def run_prepare(sources, out, **options):
    return prepare.prepare([str(s) for s in sources], str(out), log=quiet, progress=False, **options)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """The same 150 documents as JSONL (plain, .gz, .zst, Parquet), plus three text files."""
    root = tmp_path_factory.mktemp("corpus")
    lines = "".join(json.dumps({"text": d, "id": n}) + "\n" for n, d in enumerate(DOCUMENTS))
    (root / "docs.jsonl").write_text(lines)
    (root / "docs.jsonl.gz").write_bytes(gzip.compress(lines.encode()))
    import pyarrow as pa
    import pyarrow.parquet as pq
    import zstandard

    (root / "docs.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(lines.encode()))
    pq.write_table(
        pa.table({"id": list(range(len(DOCUMENTS))), "text": DOCUMENTS}),
        root / "docs.parquet",
        row_group_size=40,
    )
    (root / "texts").mkdir()
    for n, text in enumerate(["first file\n", "", "third ✓ file"]):
        (root / "texts" / f"{n}.txt").write_text(text)
    return root


@pytest.fixture(scope="module")
def prepared(corpus, tmp_path_factory):
    """The JSONL and the text files, in small shards (64 tokens: windows cross many shards)."""
    out = tmp_path_factory.mktemp("prepared") / "shards"
    run_prepare([corpus / "docs.jsonl", corpus / "texts" / "*.txt"], out, shard_tokens=64)
    return out


def raw_documents(corpus) -> list[str]:
    return data.read_documents(DataConfig(source=str(corpus / "docs.jsonl"))) + data.read_documents(
        DataConfig(source=str(corpus / "texts" / "*.txt"))
    )


def assert_same_samples(a, b) -> None:
    assert len(a) == len(b)
    for i in range(len(a)):
        x, y = a[i], b[i]
        for key in KEYS:
            assert x[key].dtype == y[key].dtype, key
            np.testing.assert_array_equal(x[key], y[key], err_msg=f"sample {i} {key}")


def take(dataset, steps, state=None):
    iterator = make_iterator(dataset, state=state)
    return [next(iterator) for _ in range(steps)]


def assert_same_batches(a, b) -> None:
    for batch_a, batch_b in zip(a, b, strict=True):
        for key in KEYS:
            np.testing.assert_array_equal(batch_a[key], batch_b[key], err_msg=key)


def files_of(directory) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(Path(directory).iterdir()) if p.name != ".lock"}


# --- The same stream as the raw source ----------------------------------------------------------


@pytest.mark.parametrize("packing", ["wrap", "whole"])
@pytest.mark.parametrize("seq_len", [2, 7, 64])
def test_prepared_shards_give_exactly_the_raw_sources_samples(corpus, prepared, seq_len, packing):
    """data.packing=whole too: the rows computed from the shards' document index on load are
    the in-memory ones, rows that carry on across shard ends included."""
    manifest = json.loads((prepared / "manifest.json").read_text())
    assert len(manifest["splits"]["train"]["shards"]) > 20  # windows cross shard ends
    expected = pack(raw_documents(corpus), ByteTokenizer(), seq_len, packing=packing)
    got = reader.PreparedSequences(str(prepared), "byte", seq_len, packing=packing)
    assert_same_samples(got, expected)
    if packing == "whole":
        np.testing.assert_array_equal(got.rows, expected.rows)
        assert (expected.rows[:, 1] < seq_len + 1).any()  # padded rows


@pytest.mark.parametrize("packing", ["wrap", "whole"])
def test_max_documents_takes_the_first_documents_of_prepared_shards(corpus, prepared, packing):
    for n in (1, 37, 152):
        expected = pack(raw_documents(corpus)[:n], ByteTokenizer(), 5, packing=packing)
        got = reader.PreparedSequences(str(prepared), "byte", 5, max_documents=n, packing=packing)
        assert_same_samples(got, expected)


@pytest.mark.parametrize("packing", ["wrap", "whole"])
def test_batches_shares_and_restored_iterators_over_prepared_shards(corpus, prepared, packing):
    """Same seed, same batches as the raw source; process shares disjoint and tiling the global
    batch; a restored iterator continues identically (the row index is rebuilt on load)."""
    raw = pack(raw_documents(corpus), ByteTokenizer(), 16, packing=packing)
    source = reader.PreparedSequences(str(prepared), "byte", 16, packing=packing)
    steps = len(raw) // 8 + 3  # into the second epoch
    single = take(batch_dataset(source, global_batch=8, seed=5), steps)
    assert_same_batches(single, take(batch_dataset(raw, global_batch=8, seed=5), steps))
    assert not np.array_equal(
        single[0]["inputs"], take(batch_dataset(source, global_batch=8, seed=6), 1)[0]["inputs"]
    )
    shares = [
        take(batch_dataset(source, global_batch=8, seed=5, process_index=p, process_count=2), steps)
        for p in range(2)
    ]
    for s in range(steps):
        for key in KEYS:
            joined = np.concatenate([shares[0][s][key], shares[1][s][key]])
            np.testing.assert_array_equal(joined, single[s][key], err_msg=f"step {s} {key}")
        rows = [set(map(tuple, shares[p][s]["inputs"])) for p in range(2)]
        assert not rows[0] & rows[1]
    iterator = make_iterator(batch_dataset(source, global_batch=8, seed=5))
    for _ in range(3):
        next(iterator)
    state = json.loads(json.dumps(iterator.get_state()))  # as a checkpoint stores it
    expected = [next(iterator) for _ in range(4)]
    fresh = reader.PreparedSequences(str(prepared), "byte", 16, packing=packing)  # as after a restart
    assert_same_batches(take(batch_dataset(fresh, global_batch=8, seed=5), 4, state=state), expected)
    # As grain's worker processes receive it: its arguments, opened again (no copy of the index).
    pickled = pickle.dumps(source)
    assert len(pickled) < 1000
    assert_same_batches(
        take(batch_dataset(pickle.loads(pickled), global_batch=8, seed=5), 4, state=state), expected
    )


def test_a_trained_tokenizer_prepares_the_same_ids_as_it_encodes(corpus, tmp_path):
    tokenizer = tmp_path / "tokenizer.json"
    data.train_tokenizer(DOCUMENTS, vocab_size=300, out=str(tokenizer))
    run_prepare([corpus / "docs.jsonl"], tmp_path / "shards", tokenizer=str(tokenizer), shard_tokens=100)
    expected = pack(DOCUMENTS, HFTokenizer(str(tokenizer)), 9)
    assert_same_samples(reader.PreparedSequences(str(tmp_path / "shards"), str(tokenizer), 9), expected)


def test_compressed_jsonl_and_parquet_hold_the_same_documents(corpus, tmp_path):
    plain = run_prepare([corpus / "docs.jsonl"], tmp_path / "plain")
    digests = lambda m: [s["sha256"] for s in m["splits"]["train"]["shards"]]
    for name in ("docs.jsonl.gz", "docs.jsonl.zst", "docs.parquet"):
        manifest = run_prepare([corpus / name], tmp_path / name)
        assert manifest["splits"]["train"]["documents"] == len(DOCUMENTS), name
        assert digests(manifest) == digests(plain), name
        assert data.read_documents(DataConfig(source=str(corpus / name))) == DOCUMENTS, name


# --- Deterministic, resumable, split ------------------------------------------------------------


def test_preparing_twice_gives_identical_files_and_a_rerun_changes_nothing(corpus, prepared, tmp_path):
    again = tmp_path / "again"
    run_prepare([corpus / "docs.jsonl", corpus / "texts" / "*.txt"], again, shard_tokens=64)
    assert files_of(again) == files_of(prepared)
    assert set(files_of(again)) == (
        {"manifest.json"}
        | {f"train-{k:05d}.{ext}" for k in range(len(files_of(again)) // 2) for ext in ("bin", "idx")}
    )
    before = {p.name: p.stat().st_mtime_ns for p in again.iterdir()}
    messages = []
    prepare.prepare(
        [str(corpus / "docs.jsonl"), str(corpus / "texts" / "*.txt")],
        str(again),
        shard_tokens=64,
        log=messages.append,
        progress=False,
    )
    assert "up to date" in messages[-1]
    assert {p.name: p.stat().st_mtime_ns for p in again.iterdir()} == before


def test_an_interrupted_preparation_resumes_to_the_same_shards(corpus, prepared, tmp_path, monkeypatch):
    """Interrupted at shard 5 and resumed, in batches of 7 documents for the tokenizer (the fixture
    had one batch): the same files as an uninterrupted run."""
    out = tmp_path / "out"
    write_json = prepare.write_json
    monkeypatch.setattr(prepare, "_BATCH_DOCS", 7)

    def interrupt_at_part_5(path, obj):
        if os.path.basename(path) == "part-00005.json":
            raise KeyboardInterrupt
        write_json(path, obj)

    monkeypatch.setattr(prepare, "write_json", interrupt_at_part_5)
    with pytest.raises(KeyboardInterrupt):
        run_prepare([corpus / "docs.jsonl", corpus / "texts" / "*.txt"], out, shard_tokens=64)
    monkeypatch.setattr(prepare, "write_json", write_json)
    left = sorted(p.name for p in out.iterdir())
    assert "manifest.json" not in left and "part-00004.json" in left
    assert not any(".tmp-" in name for name in left)  # the interrupted shard's files are gone
    with pytest.raises(ConfigError, match="did not finish; run the same .* again, it resumes"):
        reader.PreparedSequences(str(out), "byte", 8)
    cfg = config_lib.load_config(None, [f"data.source={out}"])
    with pytest.raises(ConfigError, match=f"data.source='{out}' has no manifest.json"):
        checks_lib.validate(cfg, 8)

    messages = []
    prepare.prepare(
        [str(corpus / "docs.jsonl"), str(corpus / "texts" / "*.txt")],
        str(out),
        shard_tokens=64,
        log=messages.append,
        progress=False,
    )
    assert "5 shard(s) already complete" in messages[0]
    assert files_of(out) == files_of(prepared)
    checks_lib.validate(cfg, 8)  # a finished directory is a valid data.source


def test_val_fraction_carves_off_whole_documents(corpus, tmp_path):
    out = tmp_path / "split"
    manifest = run_prepare([corpus / "docs.jsonl"], out, val_fraction=0.3, shard_tokens=200)
    texts = {}
    for split in ("train", "val"):
        texts[split] = []
        for record in manifest["splits"][split]["shards"]:
            tokens = np.fromfile(out / f"{record['name']}.bin", dtype="<u2")
            ends = np.fromfile(out / f"{record['name']}.idx", dtype="<i8")
            for begin, end in zip(np.concatenate([[0], ends[:-1]]), ends):
                assert tokens[end - 1] == ByteTokenizer.eod_id
                texts[split].append(bytes(tokens[begin : end - 1].astype(np.uint8)).decode())
    assert sorted(texts["train"] + texts["val"]) == sorted(DOCUMENTS)
    assert 0.15 < len(texts["val"]) / len(DOCUMENTS) < 0.45
    assert texts["train"] == [d for d in DOCUMENTS if d not in set(texts["val"])]  # order kept
    val = reader.PreparedSequences(str(out), "byte", 4, split="val")
    assert val.num_documents == len(texts["val"])


# --- Bad input ----------------------------------------------------------------------------------


def prepare_cli(*args) -> int:
    return data.main(["prepare", *map(str, args)])


def test_bad_sources_exit_2_naming_the_file_and_leave_nothing(corpus, tmp_path, capsys, monkeypatch):
    import pyarrow as pa
    import pyarrow.parquet as pq

    monkeypatch.setattr(prepare, "_BATCH_DOCS", 100)  # shards are complete when the bad line comes

    out = tmp_path / "out"
    pq.write_table(pa.table({"body": ["no text column"]}), tmp_path / "other.parquet")
    (tmp_path / "empty.jsonl").write_text("\n")
    (tmp_path / "bad.jsonl").write_bytes(b'{"text": "fine"}\n' * 3000 + b'{"text": "\xff"}\n')
    cases = [
        (
            [tmp_path / "other.parquet"],
            "other.parquet has no column 'text' (data.text_field); it has ['body']",
        ),
        ([tmp_path / "*.none"], "no such file (or nothing matches the glob)"),
        ([tmp_path / "empty.jsonl"], "empty.jsonl (1 bytes)): the files are empty"),
        ([corpus / "docs.jsonl", tmp_path / "bad.jsonl"], "bad.jsonl:3001 is not valid UTF-8"),
    ]
    for sources, message in cases:
        assert prepare_cli(*sources, "--out", out, "--shard-tokens", 1000) == 2, message
        assert message in capsys.readouterr().err
        assert not out.exists(), message  # nothing half-written, even after complete shards
    assert prepare_cli(tmp_path / "bad.jsonl", "--out", out, "--errors", "skip") == 0
    assert json.loads((out / "manifest.json").read_text())["splits"]["train"]["documents"] == 3000


def test_a_truncated_shard_or_another_tokenizer_is_refused_naming_the_file(prepared, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(prepared, copy)
    tokenizer = tmp_path / "tokenizer.json"
    data.train_tokenizer(DOCUMENTS, vocab_size=300, out=str(tokenizer))
    cfg = DataConfig(source=str(copy), tokenizer=str(tokenizer))
    with pytest.raises(
        ConfigError,
        match=rf"{copy}/manifest.json: the shards were prepared with "
        rf"tokenizer 'byte' .* but data.tokenizer='{tokenizer}'",
    ):
        data.packed_source(cfg, HFTokenizer(str(tokenizer)), 8)
    shard = copy / "train-00007.bin"
    shard.write_bytes(shard.read_bytes()[:-2])  # the last token lost
    with pytest.raises(ConfigError, match=rf"{shard} is \d+ bytes, but .* truncated"):
        data.packed_source(DataConfig(source=str(copy)), ByteTokenizer(), 8)


# --- The default source -------------------------------------------------------------------------


def test_the_whole_stdlib_prepares_itself_once_and_packs_the_same_stream(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("JAXPAR_CACHE", str(tmp_path / "cache"))
    source = data.packed_source(DataConfig(), ByteTokenizer(), 256)
    assert isinstance(source, reader.PreparedSequences)
    assert "preparing it once" in capsys.readouterr().err
    texts = [Path(p).read_bytes().decode("utf-8", errors="replace") for p in data.stdlib_files()]
    expected = pack(texts, ByteTokenizer(), 256)  # the default job's stream, built here
    assert len(source) == len(expected)
    for i in np.random.default_rng(0).integers(0, len(expected), 300).tolist() + [0, len(expected) - 1]:
        for key in KEYS:
            np.testing.assert_array_equal(source[i][key], expected[i][key], err_msg=f"{i} {key}")
    again = data.packed_source(DataConfig(), ByteTokenizer(), 256)
    assert again.directory == source.directory and capsys.readouterr().err == ""
    capped = data.packed_source(DataConfig(max_documents=3), ByteTokenizer(), 8)  # small: in memory
    assert isinstance(capped, data.PackedSequences)


# --- The benchmark ---------------------------------------------------------------------------------


def test_the_loader_benchmark_runs_and_says_whether_it_reaches_the_target(tmp_path, capsys, monkeypatch):
    """A smoke run of benchmarks/loader.py (no timing threshold: the numbers are the machine's)."""
    import tempfile

    from benchmarks import loader

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where its work directory goes
    out = tmp_path / "loader.json"
    assert (
        loader.main(
            [
                "--corpus-mb",
                "2",
                "--bpe-mb",
                "0",
                "--steps",
                "3",
                "--repeats",
                "1",
                "--workers",
                "0",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    printed = capsys.readouterr().out
    for seq in (1024, 256):
        assert f"seq {seq}: the training path (grain iterator, no workers) gives " in printed
    assert "the target of 2 M tokens/s" in printed
    r = json.loads(out.read_text())
    assert r["machine"]["cores"] == os.cpu_count() and r["software"]["grain"]
    (byte,) = r["prepare"]
    assert byte["tokens"] > 1 << 20 and byte["tokens_per_sec"] > 0
    assert [(e["seq_len"], e["rows"]) for e in r["loader"]] == loader.SHAPES
    assert all(e["workers_0_tokens_per_sec"] > 0 for e in r["loader"])
    assert not list(tmp_path.glob("jaxpar-loader-bench-*"))  # its temporary directory is gone


# --- Memory does not grow with the corpus -------------------------------------------------------

# One process prepares both corpora, then trains on each, and prints its peak RSS after each of
# the four: the second corpus is ten times the first, so a step whose memory grows with the corpus
# raises the peak. (The peak is the process's VmHWM: ru_maxrss would start from the forking
# pytest's resident memory.) Training needs no JAX compile the second time (the session's cache).
PEAKS = """
import json, sys
from jaxpar.corpus import prepare

def peak():
    status = dict(line.split(":", 1) for line in open("/proc/self/status"))
    return int(status["VmHWM"].split()[0]) * 1024

corpora, outs = sys.argv[1::2], sys.argv[2::2]
peaks = []
for corpus, out in zip(corpora, outs):
    prepare.prepare([corpus], out, shard_tokens=1 << 24, progress=False)
    peaks.append(peak())
from jaxpar.run.train import main
for out in outs:
    assert main(["configs/tiny.yaml", f"data.source={out}", "data.max_documents=null",
                 "model.n_layers=1", "runtime.cpu_devices=1", "train.steps=2",
                 "checkpoint.every=0", f"train.run_dir={out}-run"]) == 0
    peaks.append(peak())
print("PEAKS", json.dumps(peaks))
"""


def write_corpus(path: Path, megabytes: int) -> None:
    """JSONL of 8 KiB random-letter documents, `megabytes` MiB of text."""
    block = np.random.default_rng(0).integers(97, 123, size=(512, 8192), dtype=np.uint8)
    lines = b"".join(b'{"text": "' + row.tobytes() + b'"}\n' for row in block)  # 4 MiB
    with open(path, "wb") as f:
        for _ in range(megabytes // 4):
            f.write(lines)


def test_memory_does_not_grow_with_the_corpus(tmp_path):
    """20 MiB and 200 MiB corpora: preparation and training peak at the same resident memory
    (the raw path holds the text, its tokens and a document id per token: a 4.2 GB peak for the
    larger one, against 0.9 GB)."""
    small, large = tmp_path / "small", tmp_path / "large"
    write_corpus(tmp_path / "small.jsonl", 20)
    write_corpus(tmp_path / "large.jsonl", 200)
    env = dict(os.environ)  # runtime.cpu_devices sets the device count
    result = subprocess.run(
        [sys.executable, "-c", PEAKS, tmp_path / "small.jsonl", small, tmp_path / "large.jsonl", large],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    line = [x for x in result.stdout.splitlines() if x.startswith("PEAKS")][-1]
    prepare_small, prepare_large, train_small, train_large = json.loads(line.split(" ", 1)[1])
    assert json.loads((large / "manifest.json").read_text())["splits"]["train"]["tokens"] > 200 << 20
    assert prepare_large < 1.1 * prepare_small, (prepare_small, prepare_large)
    assert train_large < 1.1 * train_small, (train_small, train_large)
    print(
        f"peak RSS: prepare {prepare_small / 2**20:.0f} -> {prepare_large / 2**20:.0f} MiB, "
        f"train {train_small / 2**20:.0f} -> {train_large / 2**20:.0f} MiB"
    )
