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

Mixtures (`data.sources`): several prepared datasets, each shuffled and repeated on its own,
interleaved by grain's MapDataset.mix in fixed proportions; sample k of the mixture is a function
of k alone, so the shares, the saved state and the tokens seen per source (`mixture_counts`)
follow as above. Evaluation (`train.eval_every`) reads the val split of prepared shards
(`prepare --val-fraction`), the same batches every time (`eval_dataset`).

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
import errno
import gzip
import io
import json
import os
import sys
import sysconfig
import zlib
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


def _eos_token(directory: str) -> str | None:
    """The eos_token of a Hugging Face tokenizer_config.json in `directory`, or None."""
    try:
        with open(os.path.join(directory, "tokenizer_config.json")) as f:
            eos = json.load(f).get("eos_token")
    except (OSError, ValueError, AttributeError):
        return None
    eos = eos.get("content") if isinstance(eos, dict) else eos
    return eos if isinstance(eos, str) else None


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
        if eod is None:  # an imported model's (jaxpar.convert): the eos_token it was trained with
            eod = self._tok.token_to_id(_eos_token(os.path.dirname(path)) or EOD_TOKEN)
        if eod is None:
            raise ConfigError(f"data.tokenizer='{path}' has no '{EOD_TOKEN}' token to end documents"
                              " (nor an eos_token in a tokenizer_config.json beside it)")
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


class _Decompressed(io.RawIOBase):
    """A decompressing stream whose errors -- input cut short, damaged or of another format --
    are a ConfigError naming the file (gzip's EOFError or BadGzipFile, zlib's or zstandard's
    error), not a traceback."""

    def __init__(self, stream, path: str, kind: str, errors: tuple, raw=None):
        self._stream, self._path, self._kind, self._errors = stream, path, kind, errors
        self._raw = raw  # closed with the stream (gzip leaves its file object open)

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        try:
            return self._stream.readinto(buffer)
        except self._errors as e:
            raise ConfigError(f"{self._path} is not a whole {self._kind} file ({e}): it is cut "
                              f"short or damaged; replace it with a good copy") from None

    def close(self) -> None:
        self._stream.close()
        if self._raw is not None:
            self._raw.close()
        super().close()


_ZSTD_MAGIC = 0xFD2FB528
_ZSTD_SKIPPABLE = 0x184D2A50  # the 16 magic numbers 0x184D2A50 .. 0x184D2A5F


def zstd_problem(path: str) -> str | None:
    """Why a .zst file is not a sequence of whole frames (None when it is), found by walking its
    frame and block headers (RFC 8878) without decompressing: a file cut short in a frame
    decompresses without an error, to less, in the zstandard library. A file cut exactly
    between two frames is a whole file of fewer frames, which no reader can tell."""
    import zstandard

    size, at, frames = os.path.getsize(path), 0, 0
    cut = f"{path} is cut short: its zstd frame {{}} runs past the end of the file ({size} bytes)"
    with open(path, "rb") as f:
        while at < size:
            f.seek(at)
            head = f.read(18)  # the longest frame header
            magic = int.from_bytes(head[:4], "little")
            if len(head) >= 8 and magic & 0xFFFFFFF0 == _ZSTD_SKIPPABLE:
                at += 8 + int.from_bytes(head[4:8], "little")
            elif magic == _ZSTD_MAGIC:
                try:
                    at += zstandard.frame_header_size(head)
                except zstandard.ZstdError:
                    return cut.format(frames + 1)
                checksum, last = head[4] & 4, 0
                while not last and at < size:
                    f.seek(at)
                    header = int.from_bytes(f.read(3).ljust(3, b"\0"), "little")
                    last, kind, length = header & 1, (header >> 1) & 3, header >> 3
                    at += 3 + (1 if kind == 1 else length)  # an RLE block holds one byte
                if not last:
                    return cut.format(frames + 1)
                at += 4 if checksum else 0
            elif frames:
                return (f"{path}: byte {at}, after its {frames} whole zstd frame(s), begins no "
                        "other: the file is damaged")
            else:
                return f"{path} is not a zstd file (its first bytes begin no zstd frame)"
            frames += 1
    return cut.format(frames) if at > size else None


def open_source_file(path: str):
    """(binary stream of the file's contents, its raw reader) -- .gz and .zst are decompressed
    (every frame of a .zst; a .zst cut short is refused before it is read); `raw.consumed`
    counts the bytes read from disk so far."""
    name = path.lower()
    if name.endswith(".zst"):
        try:
            import zstandard
        except ImportError:  # a dependency of jaxpar; missing only in a hand-made environment
            raise ConfigError(f"{path}: reading .zst needs the zstandard package (pip install zstandard)") from None
        if (problem := zstd_problem(path)) is not None:
            raise ConfigError(f"{problem}; replace it with a good copy")
        raw = _Counted(path)
        reader = zstandard.ZstdDecompressor().stream_reader(raw, closefd=True, read_across_frames=True)
        return io.BufferedReader(_Decompressed(reader, path, "zstd", (zstandard.ZstdError,))), raw
    raw = _Counted(path)
    if name.endswith(".gz"):
        stream = gzip.GzipFile(fileobj=raw, mode="rb")
        errors = (EOFError, gzip.BadGzipFile, zlib.error)
        return io.BufferedReader(_Decompressed(stream, path, "gzip", errors, raw), buffer_size=1 << 20), raw
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

    def _getitems(self, indices) -> list[dict[str, np.ndarray]]:
        """Several sequences at once (grain's batched read; see `batch_dataset`)."""
        window = (np.asarray(indices, dtype=np.int64)[:, None] * self.seq_len
                  + np.arange(self.seq_len + 1))
        docs = self.doc_ids[window]
        starts = np.zeros(docs.shape, dtype=bool)
        starts[:, 1:] = docs[:, 1:] != docs[:, :-1]
        return split_rows(packed_rows(self.tokens[window], starts))


def packed_rows(tokens: np.ndarray, starts: np.ndarray) -> dict[str, np.ndarray]:
    """Packed sequences from windows of seq_len + 1 consecutive stream tokens, [rows, seq_len + 1],
    and where documents start in them (starts[r, j]: a document begins at window position j;
    column 0 is not read): inputs, targets (shifted by one), positions, segment ids, loss mask."""
    seq_len = tokens.shape[1] - 1
    begins = starts[:, :seq_len].copy()  # the inputs' document starts
    begins[:, 0] = True
    index = np.arange(seq_len, dtype=np.int32)
    # Position within the document: distance from the latest document start in the row.
    latest = np.maximum.accumulate(np.where(begins, index, np.int32(0)), axis=1)
    tokens = tokens.astype(np.int32, copy=False)
    return {
        "inputs": tokens[:, :-1],
        "targets": tokens[:, 1:],
        "positions": index - latest,
        "segment_ids": np.cumsum(begins, axis=1, dtype=np.int32),
        # 0 where the target begins another document (the end-of-document token predicting it).
        "loss_mask": (~starts[:, 1:]).astype(np.float32),
    }


def split_rows(batch: dict[str, np.ndarray]) -> list[dict[str, np.ndarray]]:
    return [{key: value[r] for key, value in batch.items()} for r in range(len(batch["inputs"]))]


def packed_sample(tokens: np.ndarray, docs: np.ndarray) -> dict[str, np.ndarray]:
    """One packed sequence from seq_len + 1 consecutive stream tokens and their documents' ids
    (any increasing numbering): `packed_rows` of one row."""
    starts = np.concatenate([[False], docs[1:] != docs[:-1]])
    return split_rows(packed_rows(tokens[None], starts[None]))[0]


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


# --- Mixtures -----------------------------------------------------------------------------


def mixture_proportions(weights: list[float]) -> tuple[int, ...]:
    """data.sources' weights as the integers the mixture interleaves by: the smallest 100, the
    others in proportion (rounded: to 1% of the smallest weight). grain's `MapDataset.mix` scales
    its weights so that the smallest is 100 and truncates the rest to integers; given these, its
    scale is 1 and they are used exactly as they are here, which `mixture_counts` relies on."""
    smallest = min(weights)
    return tuple(max(1, round(100 * w / smallest)) for w in weights)


def mixture_counts(proportions: tuple[int, ...], n: int) -> list[int]:
    """How many of the first `n` samples of the mixture come from each source.

    grain's MapDataset.mix (transformations/mix.py in grain 0.2.18) sends sample k to the source
    whose count of the first k + 1 samples exceeds its count of the first k, where source i's count
    of the first n is what this loop computes: its share of the n, floored, out of what the sources
    before it left. Exact, for any n (tests/test_mixture.py checks it against the samples grain
    actually draws). A source's count stays close to n * weight / total: less than one sample
    off with two sources, a few with more (under 3.2 for six sources, in 10,000 random trials)."""
    counts, remaining, left = [], sum(proportions), n
    for p in proportions:
        rest = left * (remaining - p) // remaining
        counts.append(left - rest)
        left, remaining = rest, remaining - p
    return counts


def _source_seed(seed: int, index: int) -> int:
    """The shuffle seed of a mixture's source `index`: train.seed for the first (a mixture of one
    source draws what data.source would), independent 32-bit seeds for the others."""
    return seed if index == 0 else int(np.random.SeedSequence([seed, index]).generate_state(1)[0])


@dataclass
class Mixture:
    """Several sources (prepared shards, each a grain data source) drawn in fixed proportions."""

    sources: list  # PreparedSequences (or PackedSequences), one per data.sources entry
    proportions: tuple[int, ...]  # `mixture_proportions` of their weights
    names: list[str]  # each source's name in the metrics

    @property
    def seq_len(self) -> int:
        return self.sources[0].seq_len

    def stream(self, *, seed: int, shuffle: bool = True) -> grain.MapDataset:
        """The endless mixed stream: each source's own stream (`sample_stream`: shuffled with its
        seed, repeated, so a small source comes round again sooner), interleaved by grain's
        MapDataset.mix. Sample k of the mixture is a pure function of k -- no state besides the
        position -- so a restored iterator, or any process's share, reads the same samples."""
        streams = [sample_stream(source, seed=_source_seed(seed, i), shuffle=shuffle)
                   for i, source in enumerate(self.sources)]
        return grain.MapDataset.mix(streams, weights=list(self.proportions))

    def counts(self, n: int) -> dict[str, int]:
        """Samples each source gave to the first `n` samples of the stream."""
        return dict(zip(self.names, mixture_counts(self.proportions, n)))


def source_counter(cfg: DataConfig):
    """For a mixture (data.sources): n -> {source name: how many of the first n global samples
    came from it}; None for a single source. Needs only the config, not the data."""
    from jaxpar.config import source_names

    if cfg.sources is None:
        return None
    proportions = mixture_proportions([s.weight for s in cfg.sources])
    names = source_names(cfg)
    return lambda n: dict(zip(names, mixture_counts(proportions, n)))


def training_source(cfg: DataConfig, tokenizer, seq_len: int):
    """What a run trains on: `packed_source` of data.source, or the Mixture of data.sources."""
    from jaxpar import shards
    from jaxpar.config import source_names

    if cfg.sources is None:
        return packed_source(cfg, tokenizer, seq_len)
    sources = [shards.PreparedSequences(os.path.expanduser(s.path), cfg.tokenizer, seq_len,
                                        cfg.max_documents) for s in cfg.sources]
    return Mixture(sources, mixture_proportions([s.weight for s in cfg.sources]), source_names(cfg))


EVAL_SEED = 0  # the validation split's shuffle: the same eval batches whatever train.seed is


def eval_dataset(cfg: DataConfig, seq_len: int, *, global_batch: int, batches: int,
                 process_index: int = 0, process_count: int = 1) -> grain.MapDataset:
    """The `batches` evaluation batches (this process's rows of each), from the val split of the
    prepared shards (`prepare --val-fraction`; of every source of a mixture, mixed in the same
    proportions): the split's sequences shuffled with a fixed seed, without repeating any. The
    same batches every time it is read from the start."""
    from jaxpar import shards

    if cfg.sources is None:
        directories, keys = [os.path.expanduser(cfg.source)], ["data.source"]
    else:
        directories = [os.path.expanduser(s.path) for s in cfg.sources]
        keys = [f"data.sources[{i}].path" for i in range(len(cfg.sources))]
    vals = []
    for directory, key in zip(directories, keys):
        if "val" not in shards.read_manifest(directory)["splits"]:
            raise ConfigError(
                f"train.eval_every evaluates on a validation split, and {key}='{directory}' has "
                f"none ({os.path.join(directory, shards.MANIFEST)}: prepared without "
                "--val-fraction); prepare it again with --val-fraction 0.01 (into a new directory), "
                "or set train.eval_every=0")
        vals.append(shards.PreparedSequences(directory, cfg.tokenizer, seq_len, split="val"))
    proportions = mixture_proportions([s.weight for s in cfg.sources] if cfg.sources else [1.0])

    def taken(n_batches: int) -> list[int]:  # sequences each val split gives to n_batches batches
        return mixture_counts(proportions, n_batches * global_batch)

    def fits(n_batches: int) -> bool:
        return all(count <= len(val) for count, val in zip(taken(n_batches), vals))

    if not fits(batches):
        most = next((b for b in range(batches - 1, 0, -1) if fits(b)), 0)
        count, val, key = next((c, v, k) for c, v, k in zip(taken(batches), vals, keys) if c > len(v))
        raise ConfigError(
            f"train.eval_batches={batches}: {batches} batches of train.batch_size={global_batch} "
            f"take {count} sequences of train.seq_len={seq_len} from the val split of {key}="
            f"'{val.directory}', which holds {len(val)}; "
            + (f"use train.eval_batches={most} or fewer, or " if most else "")
            + "prepare it again with a larger --val-fraction")
    source = vals[0] if cfg.sources is None else Mixture(vals, proportions, [v.directory for v in vals])
    return batch_dataset(source, global_batch=global_batch, seed=EVAL_SEED, shuffle=cfg.shuffle,
                         process_index=process_index, process_count=process_count)[:batches]


# --- The per-process batch stream ---------------------------------------------------------


def sample_stream(packed, *, seed: int, shuffle: bool = True) -> grain.MapDataset:
    """The endless sequence stream of one source: its sequences shuffled with `seed`, a new
    order every epoch (or in order, without `shuffle`)."""
    stream = grain.MapDataset.source(packed)
    if shuffle:
        stream = stream.shuffle(seed=seed)
    return stream.repeat()


def batch_dataset(packed, *, global_batch: int, seed: int, shuffle: bool = True,
                  process_index: int = 0, process_count: int = 1) -> grain.MapDataset:
    """Batches of this process's share: element s is its rows of global batch s.

    Row r of global batch s is global sample s*global_batch + r of the (shuffled, repeated)
    sequence stream -- of one source, or a `Mixture`'s -- and process p holds rows [p*b, (p+1)*b)
    with b = global_batch / process_count.
    """
    if global_batch % process_count:
        raise ConfigError(f"train.batch_size={global_batch} does not split over {process_count} processes")
    local = global_batch // process_count
    if isinstance(packed, Mixture):
        stream = packed.stream(seed=seed, shuffle=shuffle)
    else:
        stream = sample_stream(packed, seed=seed, shuffle=shuffle)

    def local_batch(step: int) -> dict[str, np.ndarray]:
        first = int(step) * global_batch + process_index * local
        # One batched read of the rows (MapDataset._getitems: grain's batch push-down, which its
        # shuffle, repeat and mix pass on to the sources' own `_getitems`): per row, grain's
        # per-element bookkeeping cost more than reading and packing the row
        # (benchmarks/RESULTS.md, "Data loader").
        rows = stream._getitems(list(range(first, first + local)))  # noqa: SLF001
        return {key: np.stack([row[key] for row in rows]) for key in rows[0]}

    return grain.MapDataset.range(0, sys.maxsize // global_batch).map(local_batch)


# How grain's iterator reads ahead: 2 threads, at most 16 batches. grain's default reads 500
# elements ahead with 16 threads; our elements are whole batches (500 of configs/gpt2-124m.yaml's
# 12 x 1024 rows hold 117 MiB, larger batches gigabytes), and on 2 cores its 16 threads contend for
# the GIL: 2.0 M tokens/s at seq 256 x 16 rows against 5.0 M with these (best of 3 each;
# benchmarks/RESULTS.md, "Data loader"): reading a batch is mostly small numpy calls, which hold it.
READ_OPTIONS = grain.ReadOptions(num_threads=2, prefetch_buffer_size=16)


def iter_dataset(dataset: grain.MapDataset) -> grain.IterDataset:
    """`dataset` as the iterable training reads (with READ_OPTIONS)."""
    return dataset.to_iter_dataset(READ_OPTIONS)


def make_iterator(dataset: grain.MapDataset, state: dict | None = None):
    """A grain iterator over `dataset`; `it.get_state()` / `state=` save and restore its place."""
    iterator = iter(iter_dataset(dataset))
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
    check = sub.add_parser("verify", help="read prepared shards whole and check them against "
                                          "their manifest (hashes, document index, token ids)")
    check.add_argument("directories", nargs="+", metavar="DIR", help="a directory of shards")
    args = parser.parse_args(argv)
    if args.command in ("prepare", "verify"):
        return _shards_command(args)
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


def _shards_command(args) -> int:
    """`prepare` and `verify`: jaxpar.shards' commands (it imports this module)."""
    from jaxpar import shards

    if args.command == "verify":
        try:
            for directory in args.directories:
                print(shards.verify(directory))
        except ConfigError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        return 0
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
    except OSError as e:
        if e.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        print(f"error: {shards.no_space_message(args.out)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"\ninterrupted: the complete shards in {args.out} are kept; the same command "
              "resumes from them", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
