"""Training data on grain: documents -> tokens -> packed fixed-length sequences -> batches.

Packing. All documents are tokenized, each followed by an end-of-document token, and laid end to
end in one stream that is cut into sequences of `seq_len` inputs (targets are the inputs shifted
by one). Every token carries the id of its document, which gives, per sequence:

- `segment_ids`: tokens attend only to earlier tokens of the same segment (the model builds a
  causal, same-document mask from them), so packed documents never see each other;
- `positions`: restart at 0 at every document start (and at the sequence start, for a document
  that began in the previous sequence), so rotary positions are positions within the document;
- `loss_mask`: 0 where the target belongs to another document (the end-of-document token
  predicting the next document's first token), 1 elsewhere.

Order and shares. Sequences are shuffled with `train.seed` (a fresh order every epoch) and the
global batch of step s is the global samples [s*B, (s+1)*B). Process p of P reads only rows
[p*B/P, (p+1)*B/P) of each global batch -- its share -- so the stream is the same whatever the
number of processes, and a run can continue at any step. The iterator's state is grain's, so a
checkpoint can store and restore it.

Sources: `stdlib` (the running interpreter's own standard library `.py` files: real text on every
machine, no download), a plain-text file or glob (one document per file), JSONL (one document
per line, in `data.text_field`) or Parquet (column `data.text_field`), `.gz`/`.zst` decompressed;
these are read and packed in memory. A directory of prepared token shards (`python -m jaxpar.data
prepare`, jaxpar.shards) is read a sequence at a time instead, and the whole `stdlib` prepares
itself into a cache on first use: the same samples as packing the same documents here, with memory
that does not grow with the corpus. Tokenizers: bytes (ids 0-255, end-of-document 256) or a local
Hugging Face `tokenizer.json` (`python -m jaxpar.data train-tokenizer` trains one).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import grain
import numpy as np

from jaxpar.config import ConfigError, DataConfig, data_files

EOD_TOKEN = "<|endoftext|>"


# --- Tokenizers ---------------------------------------------------------------------------


class ByteTokenizer:
    """UTF-8 bytes as tokens 0-255; 256 marks the end of a document."""

    vocab_size = 257
    eod_id = 256

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int32)

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        return [np.frombuffer(text.encode("utf-8"), dtype=np.uint8) for text in texts]

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """A Hugging Face `tokenizer.json`, read from disk (never fetched)."""

    def __init__(self, path: str):
        from tokenizers import Tokenizer

        try:
            self._tok = Tokenizer.from_file(path)
        except Exception as e:  # the tokenizers library raises a bare Exception for a bad file
            first = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise ConfigError(f"data.tokenizer='{path}' is not a readable tokenizer.json ({first}); "
                              "give a Hugging Face tokenizer.json, or 'byte'") from None
        self.vocab_size = self._tok.get_vocab_size()
        eod = self._tok.token_to_id(EOD_TOKEN)
        if eod is None:
            raise ConfigError(f"data.tokenizer='{path}' has no '{EOD_TOKEN}' token to end documents")
        self.eod_id = eod

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self._tok.encode(text).ids, dtype=np.int32)

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        """The same ids as `encode`, on all cores (the library's batch encoding)."""
        encode = getattr(self._tok, "encode_batch_fast", self._tok.encode_batch)  # fast: no offsets
        encodings = encode(texts)
        return [np.asarray(e.ids, dtype=np.int32) for e in encodings]

    def decode(self, ids) -> str:
        return self._tok.decode([int(i) for i in ids])


def make_tokenizer(cfg: DataConfig):
    return ByteTokenizer() if cfg.tokenizer == "byte" else HFTokenizer(cfg.tokenizer)


# --- Documents ----------------------------------------------------------------------------


def stdlib_files() -> list[str]:
    root = Path(sysconfig.get_paths()["stdlib"])
    return sorted(str(p) for p in root.rglob("*.py") if "site-packages" not in p.parts)


class _Skipped:
    """Counts the documents data.errors=replace/skip changed or left out, for one warning."""

    def __init__(self):
        self.replaced: list[str] = []
        self.skipped: list[str] = []

    def warn(self, errors: str) -> None:
        for what, places in (("read with U+FFFD for invalid bytes", self.replaced),
                             ("left out", self.skipped)):
            if places:
                shown = ", ".join(places[:3]) + (", ..." if len(places) > 3 else "")
                print(f"warning: data.errors={errors}: {len(places)} document(s) {what} ({shown})",
                      file=sys.stderr)


def _text(raw: bytes, path: str, line: int | None, errors: str, skipped: _Skipped) -> str | None:
    """`raw` (a whole file, or JSONL line `line`) as text under data.errors; None when the
    document is left out. Errors name the file and line."""
    if b"\0" in raw:
        where = path if line is None else f"{path}:{line}"
        problem = "holds NUL bytes (a binary file?)"
    else:
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as e:
            where = f"{path}:{line if line is not None else raw[:e.start].count(b'\n') + 1}"
            problem = f"is not valid UTF-8 (byte {raw[e.start:e.start + 1]!r})"
    if errors == "strict":
        raise ConfigError(f"{where} {problem}; fix or remove it, or set data.errors=replace "
                          "(bad bytes become U+FFFD) or data.errors=skip (leave such documents out)")
    if errors == "skip" or b"\0" in raw:  # NUL bytes are no text to repair: left out either way
        skipped.skipped.append(where)
        return None
    skipped.replaced.append(where)
    return raw.decode("utf-8", errors="replace")


def file_kind(path: str, fmt: str = "auto") -> str:
    """How a source file holds its documents: `fmt`, or by extension under auto (a .gz or .zst
    suffix is looked through): .jsonl/.json -> jsonl, .parquet -> parquet, anything else text."""
    if fmt != "auto":
        return fmt
    name = path.lower()
    for suffix in (".gz", ".zst"):
        name = name.removesuffix(suffix)
    if name.endswith((".jsonl", ".json")):
        return "jsonl"
    return "parquet" if name.endswith(".parquet") else "text"


def source_entries(source: str, fmt: str = "auto") -> list[tuple[str, str]]:
    """(path, kind) of each file of a source, in reading order: `stdlib` (kind "stdlib": taken as
    it is, undecodable bytes replaced) or a path/glob (sorted; error if nothing matches)."""
    if source == "stdlib":
        return [(path, "stdlib") for path in stdlib_files()]
    return [(path, file_kind(path, fmt)) for path in data_files(DataConfig(source=source))]


class _Counted(io.RawIOBase):
    """A file that counts the bytes read from it (compressed ones, under a decompressor)."""

    def __init__(self, path: str):
        self._file = open(path, "rb", buffering=0)
        self.consumed = 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        n = self._file.readinto(buffer) or 0
        self.consumed += n
        return n

    def close(self) -> None:
        self._file.close()
        super().close()


def open_source_file(path: str):
    """(binary stream of the file's contents, its raw reader) -- .gz and .zst are decompressed;
    `raw.consumed` counts the bytes read from disk so far."""
    raw = _Counted(path)
    name = path.lower()
    if name.endswith(".gz"):
        import gzip

        return gzip.GzipFile(fileobj=raw, mode="rb"), raw
    if name.endswith(".zst"):
        try:
            import zstandard
        except ImportError:  # a dependency of jaxpar; missing only in a hand-made environment
            raise ConfigError(f"{path}: reading .zst needs the zstandard package (pip install zstandard)") from None
        return io.BufferedReader(zstandard.ZstdDecompressor().stream_reader(raw, closefd=True)), raw
    return io.BufferedReader(raw, buffer_size=1 << 20), raw


def file_documents(path: str, kind: str, field: str, errors: str, skipped: _Skipped,
                   start: int = 0, raw_position: list | None = None):
    """Yields (records read so far, document text) for each document of one file, in order. A
    record is the unit a preparation resumes at: the file (text), a line (JSONL), a row (Parquet);
    the first `start` records are passed over unread. `raw_position[0]`, when given, follows the
    bytes read from disk."""
    if kind == "parquet":
        yield from _parquet_documents(path, field, errors, skipped, start, raw_position)
        return
    stream, raw = open_source_file(path)
    with stream:
        if kind in ("text", "stdlib"):
            if start == 0:
                data = stream.read()
                if raw_position is not None:
                    raw_position[0] = raw.consumed
                if kind == "stdlib":  # a few stdlib files are Latin-1 on purpose: taken as they are
                    yield 1, data.decode("utf-8", errors="replace")
                elif (text := _text(data, path, None, errors, skipped)) is not None:
                    yield 1, text
            return
        for n, line_bytes in enumerate(stream, 1):
            if n <= start or not line_bytes.strip():
                continue
            if raw_position is not None:
                raw_position[0] = raw.consumed
            text = _jsonl_text(line_bytes, path, n, field, errors, skipped)
            if text is not None:
                yield n, text


def iter_documents(entries: list[tuple[str, str]], field: str, errors: str, skipped: _Skipped,
                   start: tuple[int, int] = (0, 0), raw_position: list | None = None):
    """Yields (file index, records read in that file, text) for the documents of `entries` (see
    `source_entries`), from position `start` = (file index, records read in it)."""
    for i in range(start[0], len(entries)):
        path, kind = entries[i]
        for records, text in file_documents(path, kind, field, errors, skipped,
                                            start[1] if i == start[0] else 0, raw_position):
            yield i, records, text


def read_documents(cfg: DataConfig) -> list[str]:
    """The source's documents, in a fixed order (sorted file names, then line order). A document
    that is not text is handled as data.errors says."""
    docs: list[str] = []
    skipped = _Skipped()
    entries = source_entries(cfg.source, cfg.format)
    for _, _, text in iter_documents(entries, cfg.text_field, cfg.errors, skipped):
        if cfg.max_documents is not None and len(docs) >= cfg.max_documents:
            break
        docs.append(text)
    skipped.warn(cfg.errors)
    return docs


def _not_a_string(value, path: str, n: int, field: str, errors: str, skipped: _Skipped) -> None:
    if errors == "strict":
        raise ConfigError(
            f"{path}:{n}: '{field}' (data.text_field) is {json.dumps(value, default=repr)[:40]}, "
            "not a string; fix the record, or set data.errors=skip to leave such records out")
    skipped.skipped.append(f"{path}:{n}")


def _jsonl_text(line_bytes: bytes, path: str, n: int, field: str, errors: str,
                skipped: _Skipped) -> str | None:
    """The document of JSONL line `n`, or None when data.errors leaves it out."""
    line = _text(line_bytes, path, n, errors, skipped)
    if line is None:
        return None
    try:
        record = json.loads(line)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}:{n} is not valid JSON: {e}") from None
    if not isinstance(record, dict):
        raise ConfigError(f"{path}:{n} is not a JSON object (one document per line, in '{field}')")
    if field not in record:
        raise ConfigError(f"{path}:{n} has no field '{field}' (data.text_field); it has {sorted(record)}")
    text = record[field]
    if not isinstance(text, str):
        return _not_a_string(text, path, n, field, errors, skipped)
    return text


def parquet_file(path: str, field: str):
    """The opened Parquet file, after checking it has the text column (ConfigError naming it)."""
    try:
        import pyarrow.parquet as pq
    except ImportError:  # a dependency of jaxpar; missing only in a hand-made environment
        raise ConfigError(f"{path}: reading Parquet needs the pyarrow package (pip install pyarrow)") from None
    try:
        pf = pq.ParquetFile(path)
    except Exception as e:  # pyarrow's errors (ArrowInvalid, OSError) for a file that is not Parquet
        raise ConfigError(f"{path} is not a readable Parquet file ({str(e).splitlines()[0]})") from None
    names = pf.schema_arrow.names
    if field not in names:
        raise ConfigError(f"{path} has no column '{field}' (data.text_field); it has {names}")
    return pf


def _parquet_documents(path, field, errors, skipped, start, raw_position):
    pf = parquet_file(path, field)
    row, total, size = 0, max(pf.metadata.num_rows, 1), os.path.getsize(path)
    for group in range(pf.num_row_groups):
        rows = pf.metadata.row_group(group).num_rows
        if row + rows <= start:
            row += rows
            continue
        for batch in pf.iter_batches(batch_size=4096, row_groups=[group], columns=[field]):
            for value in batch.column(0).to_pylist():
                row += 1
                if row <= start:
                    continue
                if isinstance(value, bytes):  # a binary column: text under data.errors
                    value = _text(value, path, row, errors, skipped)
                    if value is None:
                        continue
                if not isinstance(value, str):
                    _not_a_string(value, path, row, field, errors, skipped)
                    continue
                yield row, value
        if raw_position is not None:
            raw_position[0] = size * row // total


# --- Packing --------------------------------------------------------------------------------


@dataclass
class PackedSequences:
    """Random access to packed sequences of one token stream (a grain data source)."""

    tokens: np.ndarray  # [stream] int32
    doc_ids: np.ndarray  # [stream] int32, the document of each token
    seq_len: int

    def __len__(self) -> int:
        return (len(self.tokens) - 1) // self.seq_len

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        start = int(index) * self.seq_len
        window = slice(start, start + self.seq_len + 1)
        return packed_sample(self.tokens[window], self.doc_ids[window])


def packed_sample(tokens: np.ndarray, docs: np.ndarray) -> dict[str, np.ndarray]:
    """One packed sequence from seq_len + 1 consecutive stream tokens and their documents' ids
    (any increasing numbering): inputs, targets (shifted by one), positions, segment ids, mask."""
    seq_len = len(tokens) - 1
    input_docs, target_docs = docs[:-1], docs[1:]
    # Position within the document: distance from the latest document start in the window.
    is_start = np.concatenate([[True], input_docs[1:] != input_docs[:-1]])
    starts = np.maximum.accumulate(np.where(is_start, np.arange(seq_len), 0))
    return {
        "inputs": tokens[:-1].astype(np.int32, copy=False),
        "targets": tokens[1:].astype(np.int32, copy=False),
        "positions": (np.arange(seq_len) - starts).astype(np.int32),
        "segment_ids": np.cumsum(is_start).astype(np.int32),
        "loss_mask": (input_docs == target_docs).astype(np.float32),
    }


def pack(documents: list[str], tokenizer, seq_len: int) -> PackedSequences:
    if not documents:
        raise ConfigError("data: the source has no documents")
    pieces, ids = [], []
    for n, doc in enumerate(documents):
        toks = np.append(tokenizer.encode(doc), np.int32(tokenizer.eod_id))
        pieces.append(toks)
        ids.append(np.full(len(toks), n, dtype=np.int32))
    tokens = np.concatenate(pieces).astype(np.int32)
    packed = PackedSequences(tokens, np.concatenate(ids), seq_len)
    if len(packed) == 0:
        raise ConfigError(
            f"data: the corpus has {len(tokens)} tokens, fewer than one sequence of "
            f"train.seq_len={seq_len}"
        )
    return packed


def packed_source(cfg: DataConfig, tokenizer, seq_len: int):
    """What a run trains on: prepared shards (data.source a directory; the whole stdlib, prepared
    into a cache on first use), memory-mapped; else the source's documents, packed in memory."""
    from jaxpar import shards

    source = os.path.expanduser(cfg.source)
    if cfg.source != "stdlib" and os.path.isdir(source):
        return shards.PreparedSequences(source, cfg.tokenizer, seq_len, cfg.max_documents)
    if cfg.source == "stdlib" and cfg.max_documents is None:
        if (directory := shards.stdlib_prepared(cfg.tokenizer)) is not None:
            return shards.PreparedSequences(directory, cfg.tokenizer, seq_len)
    return pack(read_documents(cfg), tokenizer, seq_len)


# --- The per-process batch stream ---------------------------------------------------------


def batch_dataset(packed: PackedSequences, *, global_batch: int, seed: int, shuffle: bool = True,
                  process_index: int = 0, process_count: int = 1) -> grain.MapDataset:
    """Batches of this process's share: element s is its rows of global batch s.

    Row r of global batch s is global sample s*global_batch + r of the (shuffled, repeated)
    sequence stream; process p holds rows [p*b, (p+1)*b) with b = global_batch / process_count.
    """
    if global_batch % process_count:
        raise ConfigError(f"train.batch_size={global_batch} does not split over {process_count} processes")
    local = global_batch // process_count
    stream = grain.MapDataset.source(packed)
    if shuffle:
        stream = stream.shuffle(seed=seed)
    stream = stream.repeat()  # a new shuffle order every epoch

    def local_sample(k: int):
        step, row = divmod(int(k), local)
        return stream[step * global_batch + process_index * local + row]

    return grain.MapDataset.range(0, sys.maxsize // global_batch).map(local_sample).batch(local)


def make_iterator(dataset: grain.MapDataset, state: dict | None = None):
    """A grain iterator over `dataset`; `it.get_state()` / `state=` save and restore its place."""
    iterator = iter(dataset.to_iter_dataset())
    if state is not None:
        iterator.set_state(state)
    return iterator


# --- Tokenizer training ---------------------------------------------------------------------


def train_tokenizer(documents: list[str], vocab_size: int, out: str) -> None:
    """Byte-level BPE on the documents, with the end-of-document token reserved."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[EOD_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(documents, trainer=trainer)
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    tok.save(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jaxpar.data")
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train-tokenizer", help="train a byte-level BPE tokenizer.json")
    train.add_argument("--out", required=True, help="where to write tokenizer.json")
    train.add_argument("--vocab-size", type=int, default=4096)
    train.add_argument("--source", default="stdlib", help="stdlib, or a path/glob of .txt/.jsonl")
    train.add_argument("--text-field", default="text")
    train.add_argument("--max-documents", type=int, default=None)
    train.add_argument("--errors", default="strict", choices=["strict", "replace", "skip"],
                       help="a document that is not text: stop, replace bad bytes, or skip it")
    prep = sub.add_parser("prepare", help="tokenize sources into memory-mapped token shards "
                                          "(train on them with data.source=DIR)")
    prep.add_argument("sources", nargs="+", metavar="SOURCE",
                      help="stdlib, or a file or glob: text (one document per file), JSONL (.jsonl/"
                           ".json, one per line), Parquet; .gz and .zst are decompressed")
    prep.add_argument("--out", required=True, help="the directory of shards (resumed if unfinished)")
    prep.add_argument("--tokenizer", default="byte", help="byte, or a tokenizer.json")
    prep.add_argument("--text-field", default="text", help="the JSONL field / Parquet column")
    prep.add_argument("--format", default="auto", choices=["auto", "text", "jsonl", "parquet"])
    prep.add_argument("--errors", default="strict", choices=["strict", "replace", "skip"],
                      help="a document that is not text: stop, replace bad bytes, or skip it")
    prep.add_argument("--val-fraction", type=float, default=0.0,
                      help="documents carved off into the val split (chosen by a hash of the text)")
    prep.add_argument("--max-documents", type=int, default=None)
    prep.add_argument("--shard-tokens", type=int, default=None,
                      help="tokens per shard (cut at a document end); default 2**26")
    args = parser.parse_args(argv)
    if args.command == "prepare":
        return _prepare_command(args)
    try:
        if args.vocab_size < 258:
            raise ConfigError(f"--vocab-size={args.vocab_size}: a byte-level BPE needs at least 258 "
                              "(256 bytes, the end-of-document token, one merge); e.g. 4096")
        if args.max_documents is not None and args.max_documents < 1:
            raise ConfigError(f"--max-documents={args.max_documents}: must be at least 1")
        cfg = DataConfig(source=args.source, text_field=args.text_field,
                         max_documents=args.max_documents, errors=args.errors)
        docs = read_documents(cfg)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    train_tokenizer(docs, args.vocab_size, args.out)
    print(f"wrote {args.out}: vocabulary {args.vocab_size}, trained on {len(docs)} documents")
    return 0


def _prepare_command(args) -> int:
    from jaxpar import shards

    if args.tokenizer != "byte" and not os.path.isfile(args.tokenizer):
        print(f"error: --tokenizer={args.tokenizer} does not exist; use 'byte' or the path of a "
              "tokenizer.json", file=sys.stderr)
        return 2
    try:
        shards.prepare(args.sources, args.out, tokenizer=args.tokenizer, fmt=args.format,
                       text_field=args.text_field, errors=args.errors,
                       val_fraction=args.val_fraction, max_documents=args.max_documents,
                       shard_tokens=args.shard_tokens or shards.DEFAULT_SHARD_TOKENS)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"\ninterrupted: the complete shards in {args.out} are kept; the same command "
              "resumes from them", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
