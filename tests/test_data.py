"""Data: sources -> tokens -> packed sequences -> per-process batches, and tokenizer training.

The references are built here from the documents alone (bytes, then one end-of-document token per
document), never from the packer's own arrays. Nothing here touches JAX.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from jaxpar.config import ConfigError, DataConfig
from jaxpar.corpus import data
from jaxpar.corpus.data import batch_dataset, make_iterator, pack
from jaxpar.corpus.documents import ByteTokenizer, HFTokenizer

REPO_ROOT = Path(__file__).resolve().parents[1]
EOD = ByteTokenizer.eod_id  # 256
KEYS = ("inputs", "targets", "positions", "segment_ids", "loss_mask")

# Varied on purpose: a one-character document, multi-byte UTF-8, documents longer than a sequence.
DOCUMENTS = ["abc", "d", "efgh", "héllo wörld", "x", "the quick brown fox", "yz"]


def reference_stream(documents: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """(token of each stream position, document of each stream position), built by hand."""
    tokens, owners = [], []
    for n, doc in enumerate(documents):
        doc_tokens = list(doc.encode("utf-8")) + [EOD]
        tokens += doc_tokens
        owners += [n] * len(doc_tokens)
    return np.array(tokens), np.array(owners)


def random_documents(count: int, seed: int = 0) -> list[str]:
    """Documents of random lowercase letters: no two 8-token windows coincide in practice."""
    rng = np.random.default_rng(seed)
    return [
        "".join(rng.choice(list("abcdefghijklmnopqrstuvwxyz"), size=rng.integers(5, 40)))
        for _ in range(count)
    ]


def take(dataset, steps: int, state=None) -> list[dict]:
    iterator = make_iterator(dataset, state=state)
    return [next(iterator) for _ in range(steps)]


def assert_same_batches(a: list[dict], b: list[dict]) -> None:
    assert len(a) == len(b)
    for batch_a, batch_b in zip(a, b):
        for key in KEYS:
            np.testing.assert_array_equal(batch_a[key], batch_b[key], err_msg=key)


# --- Packing --------------------------------------------------------------------------------


def test_packing_a_hand_written_example():
    # Stream: a b c <eod> d <eod> e f g h <eod>  (11 tokens -> (11 - 1) // 3 = 3 sequences)
    packed = pack(["abc", "d", "efgh"], ByteTokenizer(), seq_len=3)
    a, b, c, d, e, f, g, h = (ord(ch) for ch in "abcdefgh")
    expected = [
        {
            "inputs": [a, b, c],
            "targets": [b, c, EOD],
            "segment_ids": [1, 1, 1],
            "positions": [0, 1, 2],
            "loss_mask": [1, 1, 1],
        },
        # <eod> of "abc" carries on from the last sequence; "d" is a whole document here.
        {
            "inputs": [EOD, d, EOD],
            "targets": [d, EOD, e],
            "segment_ids": [1, 2, 2],
            "positions": [0, 0, 1],
            "loss_mask": [0, 1, 0],
        },
        {
            "inputs": [e, f, g],
            "targets": [f, g, h],
            "segment_ids": [1, 1, 1],
            "positions": [0, 1, 2],
            "loss_mask": [1, 1, 1],
        },
    ]
    assert len(packed) == 3
    for index, want in enumerate(expected):
        got = packed[index]
        for key in KEYS:
            np.testing.assert_array_equal(got[key], want[key], err_msg=f"sequence {index} {key}")


@pytest.mark.parametrize("seq_len", [1, 3, 5, 16])
def test_targets_are_the_inputs_shifted_by_one(seq_len):
    stream, _ = reference_stream(DOCUMENTS)
    packed = pack(DOCUMENTS, ByteTokenizer(), seq_len)
    assert len(packed) == (len(stream) - 1) // seq_len
    for i in range(len(packed)):
        window = slice(i * seq_len, (i + 1) * seq_len)
        shifted = slice(i * seq_len + 1, (i + 1) * seq_len + 1)
        np.testing.assert_array_equal(packed[i]["inputs"], stream[window])
        np.testing.assert_array_equal(packed[i]["targets"], stream[shifted])


@pytest.mark.parametrize("seq_len", [1, 3, 5, 16])
def test_segment_ids_change_exactly_at_document_boundaries(seq_len):
    _, owners = reference_stream(DOCUMENTS)
    packed = pack(DOCUMENTS, ByteTokenizer(), seq_len)
    for i in range(len(packed)):
        docs = owners[i * seq_len : (i + 1) * seq_len]
        segments = packed[i]["segment_ids"]
        assert segments[0] == 1
        np.testing.assert_array_equal(np.diff(segments) != 0, np.diff(docs) != 0)
        assert np.all(np.diff(segments) >= 0)


@pytest.mark.parametrize("seq_len", [1, 3, 5, 16])
def test_positions_restart_at_each_document_start_and_at_the_sequence_start(seq_len):
    _, owners = reference_stream(DOCUMENTS)
    packed = pack(DOCUMENTS, ByteTokenizer(), seq_len)
    for i in range(len(packed)):
        docs = owners[i * seq_len : (i + 1) * seq_len]
        expected, position = [], 0
        for j in range(seq_len):
            position = 0 if j == 0 or docs[j] != docs[j - 1] else position + 1
            expected.append(position)
        np.testing.assert_array_equal(packed[i]["positions"], expected)


@pytest.mark.parametrize("seq_len", [1, 3, 5, 16])
def test_loss_mask_is_zero_exactly_where_the_target_is_from_another_document(seq_len):
    _, owners = reference_stream(DOCUMENTS)
    packed = pack(DOCUMENTS, ByteTokenizer(), seq_len)
    masked = 0
    for i in range(len(packed)):
        docs = owners[i * seq_len : (i + 1) * seq_len]
        target_docs = owners[i * seq_len + 1 : (i + 1) * seq_len + 1]
        mask = packed[i]["loss_mask"]
        np.testing.assert_array_equal(mask, (docs == target_docs).astype(np.float32))
        # ...which is where the input is an end-of-document token (predicting the next doc).
        np.testing.assert_array_equal(mask == 0, packed[i]["inputs"] == EOD)
        masked += int(np.sum(mask == 0))
    assert masked > 0


def test_packed_arrays_have_the_model_dtypes():
    sample = pack(DOCUMENTS, ByteTokenizer(), seq_len=4)[0]
    assert {k: sample[k].dtype for k in KEYS} == {
        "inputs": np.int32,
        "targets": np.int32,
        "positions": np.int32,
        "segment_ids": np.int32,
        "loss_mask": np.float32,
    }
    assert all(sample[k].shape == (4,) for k in KEYS)


def test_corpus_shorter_than_one_sequence_is_a_config_error():
    # "ab" + <eod> = 3 tokens: a sequence of 3 inputs needs 4 tokens.
    with pytest.raises(ConfigError, match=r"3 tokens.*train.seq_len=3"):
        pack(["ab"], ByteTokenizer(), seq_len=3)
    assert len(pack(["ab"], ByteTokenizer(), seq_len=2)) == 1


# --- data.packing=whole ---------------------------------------------------------------------


def reference_whole_rows(documents: list[str], seq_len: int) -> list[list[tuple[int, int]]]:
    """data.packing=whole written out a document at a time: each row's (token, document) pairs,
    padding left out. A document that fits in the rest of the row joins it; one that fits in a
    row starts the next; a longer one starts a row and fills rows of seq_len + 1 tokens, each
    beginning with the last token of the one before, its rest opening the next row."""
    width = seq_len + 1
    rows, row = [], []
    for n, doc in enumerate(documents):
        tokens = [(t, n) for t in list(doc.encode("utf-8")) + [EOD]]
        if len(tokens) <= width - len(row):
            row += tokens
            continue
        if row:
            rows.append(row)
        at = 0
        while len(tokens) - at > width:
            rows.append(tokens[at : at + width])
            at += seq_len
        row = tokens[at:]
    return rows + [row] if row else rows


WHOLE_DOCUMENTS = DOCUMENTS + random_documents(30, seed=4)


@pytest.mark.parametrize("seq_len", [1, 3, 5, 16, 40])
def test_whole_packing_is_the_reference_row_by_row_padding_apart(seq_len):
    """Tokens, positions, segment ids and loss mask of every row against the reference; the
    padding (end-of-document tokens) is no target and a segment of its own."""
    expected = reference_whole_rows(WHOLE_DOCUMENTS, seq_len)
    packed = pack(WHOLE_DOCUMENTS, ByteTokenizer(), seq_len, packing="whole")
    assert len(packed) == len(expected)
    padded = 0
    for i, want in enumerate(expected):
        got, n = packed[i], len(want)
        tokens = np.append(got["inputs"], got["targets"][-1])
        docs = np.array([d for _, d in want])
        np.testing.assert_array_equal(tokens[:n], [t for t, _ in want], err_msg=f"row {i}")
        assert np.all(tokens[n:] == EOD), i
        starts = np.concatenate([[True], docs[1:] != docs[:-1]])
        np.testing.assert_array_equal(got["segment_ids"][: min(n, seq_len)], np.cumsum(starts)[:seq_len])
        positions = [j - max(k for k in range(j + 1) if starts[k]) for j in range(min(n, seq_len))]
        np.testing.assert_array_equal(got["positions"][: min(n, seq_len)], positions)
        mask = np.zeros(seq_len, np.float32)
        mask[: n - 1] = ~starts[1:]
        np.testing.assert_array_equal(got["loss_mask"], mask, err_msg=f"row {i}")
        if n < seq_len:  # padding among the inputs: one segment, none of the documents'
            pad = got["segment_ids"][n:]
            assert np.all(pad == pad[0]) and pad[0] not in got["segment_ids"][:n], i
        padded += n <= seq_len
    assert padded > 0 or seq_len == 1  # (rows of two tokens: never padded here)


@pytest.mark.parametrize("seq_len", [3, 5, 16, 40])
def test_whole_packing_keeps_every_document_that_fits_in_one_row_in_order(seq_len):
    """Counted on the stream: each document of at most seq_len + 1 tokens lies inside exactly
    one row and meets no other; rows follow the stream; every token but a document's first is
    a target exactly once (a long document's rows overlap by one token), padding never."""
    stream, owners = reference_stream(WHOLE_DOCUMENTS)
    packed = pack(WHOLE_DOCUMENTS, ByteTokenizer(), seq_len, packing="whole")
    begins, lengths = packed.rows.T
    assert begins[0] == 0 and np.all(np.diff(begins) > 0) and np.all(lengths <= seq_len + 1)
    ends = begins + lengths
    for n in range(len(WHOLE_DOCUMENTS)):
        first, last = np.flatnonzero(owners == n)[[0, -1]]
        meets = np.flatnonzero((begins <= last) & (ends > first))
        if last - first + 1 <= seq_len + 1:
            assert len(meets) == 1 and begins[meets[0]] <= first and last < ends[meets[0]], n
    counted = np.concatenate([packed[i]["targets"][packed[i]["loss_mask"] == 1] for i in range(len(packed))])
    not_first = np.concatenate([[False], owners[1:] == owners[:-1]])
    np.testing.assert_array_equal(counted, stream[not_first])


def test_whole_packing_fit_boundary():
    """A row holds seq_len + 1 tokens: a document of exactly the room left joins the row, one
    token more starts the next; a document of seq_len + 1 tokens fills a row alone, one of
    seq_len + 2 takes two rows that share a token."""
    tok = ByteTokenizer()

    def rows(documents):
        return pack(documents, tok, seq_len=7, packing="whole").rows.tolist()

    assert rows(["ab", "abcd"]) == [[0, 8]]  # 3 + 5 = 8 tokens: exactly the room left
    assert rows(["ab", "abcde"]) == [[0, 3], [3, 6]]  # 3 + 6: one token too many
    assert rows(["abcdefg", "x"]) == [[0, 8], [8, 2]]
    assert rows(["abcdefgh", "x"]) == [[0, 8], [7, 4]]  # 9 tokens: the last two with "x"
    full = pack(["abcdefg"], tok, seq_len=7, packing="whole")[0]
    assert full["loss_mask"].tolist() == [1] * 7 and full["targets"][-1] == EOD
    one_more = pack(["ab", "abcde"], tok, seq_len=7, packing="whole")[0]
    assert one_more["inputs"].tolist() == [ord("a"), ord("b"), EOD] + [EOD] * 4
    assert one_more["loss_mask"].tolist() == [1, 1, 0, 0, 0, 0, 0]
    assert one_more["segment_ids"].tolist() == [1, 1, 1, 2, 2, 2, 2]


def test_whole_packing_iterator_restores_and_wrap_stays_the_default():
    packed = pack(random_documents(40), ByteTokenizer(), seq_len=8, packing="whole")
    iterator = make_iterator(batch_dataset(packed, global_batch=4, seed=3))
    for _ in range(3):
        next(iterator)
    state = json.loads(json.dumps(iterator.get_state()))
    expected = [next(iterator) for _ in range(4)]
    assert_same_batches(take(batch_dataset(packed, global_batch=4, seed=3), 4, state=state), expected)
    wrap = pack(random_documents(40), ByteTokenizer(), seq_len=8, packing="wrap")
    assert wrap.rows is None and len(wrap) == len(pack(random_documents(40), ByteTokenizer(), seq_len=8))


# --- Batches: order, determinism, restore, process shares -------------------------------------


@pytest.fixture(scope="module")
def packed():
    """About 60 distinct sequences of 8 tokens."""
    return pack(random_documents(20), ByteTokenizer(), seq_len=8)


def test_unshuffled_batch_s_holds_samples_s_times_b_to_s_plus_one_times_b(packed):
    global_batch, steps = 8, len(packed) // 8 + 3  # runs past the end of the first epoch
    batches = take(batch_dataset(packed, global_batch=global_batch, seed=0, shuffle=False), steps)
    for s, batch in enumerate(batches):
        for r in range(global_batch):
            sample = packed[(s * global_batch + r) % len(packed)]
            for key in KEYS:
                np.testing.assert_array_equal(batch[key][r], sample[key], err_msg=f"{s},{r},{key}")


def test_every_epoch_is_a_fresh_permutation_of_all_sequences(packed):
    n = len(packed)
    steps = -(-2 * n // 4)  # enough batches of 4 to cover two epochs
    rows = np.concatenate([b["inputs"] for b in take(batch_dataset(packed, global_batch=4, seed=0), steps)])
    everything = sorted(tuple(packed[i]["inputs"]) for i in range(n))
    first, second = rows[:n], rows[n : 2 * n]
    assert sorted(map(tuple, first)) == everything
    assert sorted(map(tuple, second)) == everything
    assert not np.array_equal(first, second)


def test_same_seed_gives_identical_batches_and_another_seed_different_ones(packed):
    def batches(seed):
        return take(batch_dataset(packed, global_batch=4, seed=seed), 5)

    assert_same_batches(batches(0), batches(0))
    assert not all(np.array_equal(a["inputs"], b["inputs"]) for a, b in zip(batches(0), batches(1)))


def test_restored_iterator_state_continues_identically(packed):
    iterator = make_iterator(batch_dataset(packed, global_batch=4, seed=3))
    for _ in range(3):
        next(iterator)
    state = json.loads(json.dumps(iterator.get_state()))  # as a checkpoint would store it
    expected = [next(iterator) for _ in range(4)]
    # A fresh dataset, as after a restart of the program.
    restored = take(batch_dataset(packed, global_batch=4, seed=3), 4, state=state)
    assert_same_batches(restored, expected)


@pytest.mark.parametrize("process_count", [2, 4])
def test_process_shares_tile_the_global_batch(packed, process_count):
    global_batch, steps = 8, 6
    local = global_batch // process_count
    single = take(batch_dataset(packed, global_batch=global_batch, seed=0), steps)
    shares = [
        take(
            batch_dataset(
                packed, global_batch=global_batch, seed=0, process_index=p, process_count=process_count
            ),
            steps,
        )
        for p in range(process_count)
    ]
    for s in range(steps):
        local_batches = [shares[p][s] for p in range(process_count)]
        for key in KEYS:
            assert all(b[key].shape == (local, 8) for b in local_batches)
            joined = np.concatenate([b[key] for b in local_batches])
            np.testing.assert_array_equal(joined, single[s][key], err_msg=f"step {s} {key}")
        rows = [set(map(tuple, b["inputs"])) for b in local_batches]
        assert sum(len(r) for r in rows) == len(set().union(*rows)) == global_batch  # disjoint


def test_global_batch_must_split_over_the_processes(packed):
    with pytest.raises(ConfigError, match=r"train.batch_size=6 .* 4 processes"):
        batch_dataset(packed, global_batch=6, seed=0, process_count=4)


# --- Sources ----------------------------------------------------------------------------------


def test_stdlib_source_reads_the_interpreters_own_python_files():
    docs = data.read_documents(DataConfig(max_documents=5))
    files = data.stdlib_files()[:5]
    assert len(docs) == 5
    assert all(path.endswith(".py") and "site-packages" not in path for path in files)
    for doc, path in zip(docs, files):
        assert doc == Path(path).read_text(encoding="utf-8", errors="replace")


def test_jsonl_source_reads_one_document_per_line(tmp_path):
    path = tmp_path / "corpus.jsonl"
    lines = [{"text": "first doc"}, {"text": "second doc", "id": 2}, {"text": "third\nline"}]
    path.write_text("\n".join(json.dumps(x) for x in lines[:2]) + "\n\n" + json.dumps(lines[2]))
    docs = data.read_documents(DataConfig(source=str(path)))
    assert docs == ["first doc", "second doc", "third\nline"]  # the blank line is skipped


def test_jsonl_source_reads_the_configured_text_field(tmp_path):
    path = tmp_path / "corpus.jsonl"
    path.write_text('{"body": "one", "text": "not this"}\n{"body": "two"}\n')
    assert data.read_documents(DataConfig(source=str(path), text_field="body")) == ["one", "two"]


def test_jsonl_line_without_the_text_field_is_named(tmp_path):
    path = tmp_path / "corpus.jsonl"
    path.write_text('{"text": "fine"}\n{"body": "no text here", "id": 1}\n')
    with pytest.raises(ConfigError) as info:
        data.read_documents(DataConfig(source=str(path)))
    message = str(info.value)
    assert f"{path}:2" in message
    assert "no field 'text'" in message and "['body', 'id']" in message


def test_jsonl_line_that_is_not_json_is_named(tmp_path):
    path = tmp_path / "corpus.jsonl"
    path.write_text('{"text": "fine"}\n{"text": oops}\n')
    with pytest.raises(ConfigError, match=rf"{path}:2 is not valid JSON"):
        data.read_documents(DataConfig(source=str(path)))


def test_text_glob_reads_one_document_per_file_in_sorted_order(tmp_path):
    for name, text in [("b.txt", "second"), ("a.txt", "first\nfile"), ("c.txt", "third")]:
        (tmp_path / name).write_text(text)
    (tmp_path / "skip.md").write_text("not matched")
    source = str(tmp_path / "*.txt")
    assert data.read_documents(DataConfig(source=source)) == ["first\nfile", "second", "third"]
    assert data.read_documents(DataConfig(source=source, max_documents=2)) == ["first\nfile", "second"]


def test_format_auto_goes_by_extension_and_an_explicit_format_overrides_it(tmp_path):
    (tmp_path / "a.txt").write_text('{"text": "raw"}')
    (tmp_path / "b.jsonl").write_text('{"text": "parsed"}\n')
    source = str(tmp_path / "*")
    assert data.read_documents(DataConfig(source=source)) == ['{"text": "raw"}', "parsed"]
    assert data.read_documents(DataConfig(source=source, format="jsonl")) == ["raw", "parsed"]
    assert data.read_documents(DataConfig(source=source, format="text")) == [
        '{"text": "raw"}',
        '{"text": "parsed"}\n',
    ]


def test_glob_matching_nothing_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="no such file"):
        data.read_documents(DataConfig(source=str(tmp_path / "*.txt")))


# --- Tokenizers -------------------------------------------------------------------------------

CORPUS = [
    "the cat sat on the mat. the cat ate the rat.",
    "a dog and a cat and a rat sat together on the mat.",
    "def add(a, b):\n    return a + b\n",
    "the the the cat cat cat mat mat mat",
]
UNSEEN = "Ünïcode ✓ and numbers 12345\n\ttabs, never seen in training"


def test_byte_tokenizer_round_trips_and_reserves_256_for_end_of_document():
    tok = ByteTokenizer()
    ids = tok.encode(UNSEEN)
    assert ids.dtype == np.int32 and ids.max() < 256
    assert tok.decode(ids) == UNSEEN
    assert tok.decode(list(ids) + [EOD]) == UNSEEN  # the end-of-document token decodes to nothing
    assert (tok.vocab_size, tok.eod_id) == (257, 256)


@pytest.fixture(scope="module")
def hf_tokenizer_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("tokenizer") / "tokenizer.json"
    data.train_tokenizer(CORPUS, vocab_size=300, out=str(path))
    return str(path)


def test_trained_tokenizer_round_trips_and_has_the_end_of_document_token(hf_tokenizer_path):
    tok = HFTokenizer(hf_tokenizer_path)
    assert 257 < tok.vocab_size <= 300  # 256 byte symbols + <|endoftext|> + learned merges
    assert tok._tok.id_to_token(tok.eod_id) == data.EOD_TOKEN
    for text in CORPUS + [UNSEEN]:
        ids = tok.encode(text)
        assert ids.dtype == np.int32
        assert tok.eod_id not in ids
        assert tok.decode(ids) == text
    assert len(tok.encode(CORPUS[0])) < len(CORPUS[0].encode())  # merges were learned


def test_trained_tokenizer_packs_with_its_end_of_document_token(hf_tokenizer_path):
    tok = data.make_tokenizer(DataConfig(tokenizer=hf_tokenizer_path))
    assert isinstance(tok, HFTokenizer)
    packed = pack(CORPUS, tok, seq_len=8)
    for i in range(len(packed)):
        sample = packed[i]
        np.testing.assert_array_equal(sample["loss_mask"] == 0, sample["inputs"] == tok.eod_id)


def test_train_tokenizer_cli_writes_a_usable_tokenizer(tmp_path):
    for n, text in enumerate(CORPUS):
        (tmp_path / f"doc{n}.txt").write_text(text)
    out = tmp_path / "out" / "tokenizer.json"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "jaxpar.data",
            "train-tokenizer",
            "--out",
            str(out),
            "--vocab-size",
            "300",
            "--source",
            str(tmp_path / "*.txt"),
        ],
        cwd=REPO_ROOT,
        env=dict(os.environ),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert f"trained on {len(CORPUS)} documents" in result.stdout
    tok = HFTokenizer(str(out))
    assert tok.vocab_size <= 300
    assert tok.decode(tok.encode(CORPUS[1])) == CORPUS[1]


def test_train_tokenizer_cli_reports_a_bad_source_with_exit_code_2(tmp_path, capsys):
    code = data.main(
        ["train-tokenizer", "--out", str(tmp_path / "t.json"), "--source", str(tmp_path / "*.txt")]
    )
    assert code == 2
    assert "no such file" in capsys.readouterr().err
    assert not (tmp_path / "t.json").exists()
