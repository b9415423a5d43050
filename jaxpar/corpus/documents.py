"""Documents and tokens, the ground floor of the data pipeline: tokenizers (bytes, or a local
Hugging Face `tokenizer.json`), reading a source's documents (the running interpreter's standard
library, text files, JSONL, Parquet; .gz and .zst decompressed; data.errors for what is not text;
a JSONL line or Parquet row without the text field may be a conversation or a prompt/completion
record, checked and kept as a dict for jaxpar.corpus.chat to render, or left out with a count when it
has no assistant message: `record_document`),
and the packed rows a window of the token stream becomes (`packed_rows`; under data.packing=whole,
rows of whole documents, padded: `whole_rows`, `pad_rows`). Both consumers of
documents build on this module: packing in memory and the grain pipeline (jaxpar.data) and the
prepared token shards (jaxpar.corpus.shards)."""

from __future__ import annotations

import array
import bisect
import gzip
import io
import json
import os
import sys
import sysconfig
import typing
import zlib
from pathlib import Path

import numpy as np

from jaxpar.config import ConfigError, DataConfig, Packing
from jaxpar.corpus import chat
from jaxpar.corpus.sources import data_files

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

    def encode_plain(self, texts: list[str]) -> list[np.ndarray]:
        """The same ids as `encode` (bytes add no special tokens)."""
        return [self.encode(text) for text in texts]

    def token_id(self, text: str) -> int | None:
        """The id of a token spelled `text`: None, bytes have no multi-byte tokens."""
        return None

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
            raise ConfigError(
                f"data.tokenizer='{path}' is not a readable tokenizer.json ({first}); "
                "give a Hugging Face tokenizer.json, or 'byte'"
            ) from None
        self.vocab_size = self._tok.get_vocab_size()
        eod = self._tok.token_to_id(EOD_TOKEN)
        if eod is None:  # an imported model's (jaxpar.convert): the eos_token it was trained with
            eod = self._tok.token_to_id(_eos_token(os.path.dirname(path)) or EOD_TOKEN)
        if eod is None:
            raise ConfigError(
                f"data.tokenizer='{path}' has no '{EOD_TOKEN}' token to end documents"
                " (nor an eos_token in a tokenizer_config.json beside it)"
            )
        self.eod_id = eod

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self._tok.encode(text).ids, dtype=np.int32)

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        """The same ids as `encode`, on all cores (the library's batch encoding)."""
        encode = getattr(self._tok, "encode_batch_fast", self._tok.encode_batch)  # fast: no offsets
        encodings = encode(texts)
        return [np.asarray(e.ids, dtype=np.int32) for e in encodings]

    def encode_plain(self, texts: list[str]) -> list[np.ndarray]:
        """Each text's ids without the tokens the tokenizer adds on its own (a BOS): the pieces
        of a rendered conversation, whose chat template writes those itself (jaxpar.corpus.chat)."""
        encodings = self._tok.encode_batch(texts, add_special_tokens=False)
        return [np.asarray(e.ids, dtype=np.int32) for e in encodings]

    def token_id(self, text: str) -> int | None:
        """The id of the token spelled `text` (a special token such as <|eot_id|>), or None."""
        return self._tok.token_to_id(text)

    def decode(self, ids) -> str:
        return self._tok.decode([int(i) for i in ids])


def make_tokenizer(cfg: DataConfig):
    return ByteTokenizer() if cfg.tokenizer == "byte" else HFTokenizer(cfg.tokenizer)


# --- Documents ----------------------------------------------------------------------------


def stdlib_files() -> list[str]:
    root = Path(sysconfig.get_paths()["stdlib"])
    return sorted(str(p) for p in root.rglob("*.py") if "site-packages" not in p.parts)


class Skipped:
    """Counts the documents data.errors=replace/skip changed or left out, and the records left
    out for having nothing to train on, for one warning each."""

    def __init__(self):
        self.replaced: list[str] = []
        self.skipped: list[str] = []
        self.records: dict[str, int] = {}  # file -> conversation / prompt-completion records read
        self.no_target: dict[str, list[str]] = {}  # file -> those left out (`chat.has_target`)

    def warn(self, errors: str) -> None:
        for what, places in (
            ("read with U+FFFD for invalid bytes", self.replaced),
            ("left out", self.skipped),
        ):
            if places:
                print(
                    f"warning: data.errors={errors}: {len(places)} document(s) {what} ({_few(places)})",
                    file=sys.stderr,
                )
        for path, places in self.no_target.items():
            places = [f"line {p}" if p.isdigit() else p for p in places]  # JSONL line, Parquet row
            print(
                f"warning: {path}: left out {len(places)} of its {self.records[path]} conversation "
                f"and prompt/completion records: no assistant message, so nothing to train on "
                f"({_few(places)})",
                file=sys.stderr,
            )


def _few(places: list[str]) -> str:
    return ", ".join(places[:3]) + (", ..." if len(places) > 3 else "")


def _text(raw: bytes, path: str, line: int | None, errors: str, skipped: Skipped) -> str | None:
    """`raw` (a whole file, or JSONL line `line`) as text under data.errors; None when the
    document is left out. Errors name the file and line."""
    if b"\0" in raw:
        where = path if line is None else f"{path}:{line}"
        problem = "holds NUL bytes (a binary file?)"
    else:
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as e:
            where = f"{path}:{line if line is not None else raw[: e.start].count(b'\n') + 1}"
            problem = f"is not valid UTF-8 (byte {raw[e.start : e.start + 1]!r})"
    if errors == "strict":
        raise ConfigError(
            f"{where} {problem}; fix or remove it, or set data.errors=replace "
            "(bad bytes become U+FFFD) or data.errors=skip (leave such documents out)"
        )
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
            raise ConfigError(
                f"{self._path} is not a whole {self._kind} file ({e}): it is cut "
                f"short or damaged; replace it with a good copy"
            ) from None

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
                return (
                    f"{path}: byte {at}, after its {frames} whole zstd frame(s), begins no "
                    "other: the file is damaged"
                )
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
            raise ConfigError(
                f"{path}: reading .zst needs the zstandard package (pip install zstandard)"
            ) from None
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


def file_documents(
    path: str,
    kind: str,
    field: str,
    errors: str,
    skipped: Skipped,
    start: int = 0,
    raw_position: list | None = None,
):
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


def iter_documents(
    entries: list[tuple[str, str]],
    field: str,
    errors: str,
    skipped: Skipped,
    start: tuple[int, int] = (0, 0),
    raw_position: list | None = None,
):
    """Yields (file index, records read in that file, text) for the documents of `entries` (see
    `source_entries`), from position `start` = (file index, records read in it)."""
    for i in range(start[0], len(entries)):
        path, kind = entries[i]
        for records, text in file_documents(
            path, kind, field, errors, skipped, start[1] if i == start[0] else 0, raw_position
        ):
            yield i, records, text


def read_documents(cfg: DataConfig) -> list[str | dict]:
    """The source's documents, in a fixed order (sorted file names, then line order): texts, and
    conversation or prompt/completion records (dicts, `record_document`). A document that is not
    text is handled as data.errors says."""
    docs: list[str | dict] = []
    skipped = Skipped()
    entries = source_entries(cfg.source, cfg.format)
    for _, _, text in iter_documents(entries, cfg.text_field, cfg.errors, skipped):
        if cfg.max_documents is not None and len(docs) >= cfg.max_documents:
            break
        docs.append(text)
    skipped.warn(cfg.errors)
    return docs


def _not_a_string(value, path: str, n: int, field: str, errors: str, skipped: Skipped) -> None:
    if errors == "strict":
        raise ConfigError(
            f"{path}:{n}: '{field}' (data.text_field) is {json.dumps(value, default=repr)[:40]}, "
            "not a string; fix the record, or set data.errors=skip to leave such records out"
        )
    skipped.skipped.append(f"{path}:{n}")


def _jsonl_text(
    line_bytes: bytes, path: str, n: int, field: str, errors: str, skipped: Skipped
) -> str | dict | None:
    """The document of JSONL line `n` (its text, or a `record_document`), or None when
    data.errors leaves it out."""
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
        return record_document(record, f"{path}:{n}", field, skipped, path)
    text = record[field]
    if not isinstance(text, str):
        return _not_a_string(text, path, n, field, errors, skipped)
    return text


RECORD_KINDS = "a text in data.text_field, a 'messages' list, or a 'prompt' and a 'completion'"


def _check_pair(prompt, completion, where: str) -> None:
    """A prompt/completion pair that is not two strings must be two lists of messages: where one
    field is a string or a list and the other neither, name the other (a pair of a string and a
    list is refused naming both)."""
    kinds = {key: type(value) for key, value in (("prompt", prompt), ("completion", completion))}
    if set(kinds.values()) <= {list}:
        return
    bad = [key for key, kind in kinds.items() if kind not in (str, list)]
    shown = ", ".join(
        f"'{key}' is {json.dumps(value, default=repr)[:60]}"
        for key, value in (("prompt", prompt), ("completion", completion))
        if key in bad or not bad
    )
    raise ConfigError(
        f"{where}: {shown}; a prompt/completion record takes two strings, or two lists of "
        '{"role": ..., "content": ...} messages'
    )


def record_document(
    record: dict, where: str, field: str, skipped: Skipped | None = None, path: str | None = None
) -> chat.Record | None:
    """A record without the text field as a document (a `chat.Record`, knowing `where` it was
    read): a conversation (`messages`: a list of {role, content}, `chat.check_messages`, which
    reads a content of text parts as text) or a prompt/completion pair (both strings, or both
    lists of messages); the record's other fields are dropped. ConfigError naming `where` for
    anything else. A record with nothing to train on (no assistant message: `chat.has_target`)
    is None, counted in `skipped` under `path` for its warning, when `skipped` is given."""
    if "messages" in record:
        document = chat.Record(messages=chat.check_messages(record["messages"], where))
    elif "prompt" in record and "completion" in record:
        prompt, completion = record["prompt"], record["completion"]
        if not (isinstance(prompt, str) and isinstance(completion, str)):
            _check_pair(prompt, completion, where)
            prompt = chat.check_messages(prompt, where, "prompt")
            completion = chat.check_messages(completion, where, "completion")
        document = chat.Record(prompt=prompt, completion=completion)
    else:
        raise ConfigError(
            f"{where} has no field '{field}' (data.text_field); it has {sorted(record)} (a record "
            f"holds {RECORD_KINDS})"
        )
    document.where = where
    if skipped is not None:
        path = where if path is None else path
        skipped.records[path] = skipped.records.get(path, 0) + 1
        if not chat.has_target(document):
            skipped.no_target.setdefault(path, []).append(where[len(path) :].lstrip(":").strip())
            return None
    return document


def parquet_file(path: str, field: str):
    """The opened Parquet file, after checking it has the text column or the columns of
    conversations / prompt-completion records (ConfigError naming them)."""
    try:
        import pyarrow.parquet as pq
    except ImportError:  # a dependency of jaxpar; missing only in a hand-made environment
        raise ConfigError(
            f"{path}: reading Parquet needs the pyarrow package (pip install pyarrow)"
        ) from None
    try:
        pf = pq.ParquetFile(path)
    except Exception as e:  # pyarrow's errors (ArrowInvalid, OSError) for a file that is not Parquet
        raise ConfigError(f"{path} is not a readable Parquet file ({str(e).splitlines()[0]})") from None
    parquet_columns(pf, path, field)
    return pf


def parquet_columns(pf, path: str, field: str) -> list[str]:
    """The columns that hold a Parquet file's documents: the text column, else `messages`,
    else `prompt` and `completion`."""
    names = pf.schema_arrow.names
    for columns in ([field], ["messages"], ["prompt", "completion"]):
        if all(c in names for c in columns):
            return columns
    raise ConfigError(
        f"{path} has no column '{field}' (data.text_field); it has {names} (a conversation source "
        "has 'messages', a prompt/completion source 'prompt' and 'completion')"
    )


def _parquet_documents(path, field, errors, skipped, start, raw_position):
    pf = parquet_file(path, field)
    columns = parquet_columns(pf, path, field)
    row, total, size = 0, max(pf.metadata.num_rows, 1), os.path.getsize(path)
    for group in range(pf.num_row_groups):
        rows = pf.metadata.row_group(group).num_rows
        if row + rows <= start:
            row += rows
            continue
        for batch in pf.iter_batches(batch_size=4096, row_groups=[group], columns=columns):
            values = zip(*(batch.column(i).to_pylist() for i in range(len(columns))))
            for value in values:
                row += 1
                if row <= start:
                    continue
                if columns != [field]:  # conversations or prompt/completion records
                    record = dict(zip(columns, value))
                    document = record_document(record, f"{path}: row {row}", field, skipped, path)
                    if document is not None:
                        yield row, document
                    continue
                value = value[0]
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


# --- Packed rows ----------------------------------------------------------------------------


def packed_rows(
    tokens: np.ndarray, starts: np.ndarray, targets: np.ndarray | None = None
) -> dict[str, np.ndarray]:
    """Packed sequences from windows of seq_len + 1 consecutive stream tokens, [rows, seq_len + 1],
    and where documents start in them (starts[r, j]: a document begins at window position j;
    column 0 is not read): inputs, targets (shifted by one), positions, segment ids, loss mask.
    `targets` (same shape, 0/1; None: all 1) says which stream tokens are to be predicted (the
    assistant tokens of a conversation, jaxpar.corpus.chat): the loss mask is 0 where it is 0 too."""
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
        # 0 where the target begins another document (the end-of-document token predicting it),
        # or is not a target token.
        "loss_mask": (~starts[:, 1:] if targets is None else ~starts[:, 1:] & (targets[:, 1:] != 0)).astype(
            np.float32
        ),
    }


def split_rows(batch: dict[str, np.ndarray]) -> list[dict[str, np.ndarray]]:
    return [{key: value[r] for key, value in batch.items()} for r in range(len(batch["inputs"]))]


# --- Rows of whole documents (data.packing=whole) ----------------------------------------------


def row_index(packing: str, parts, width: int) -> np.ndarray | None:
    """The rows data.packing asks for: None under wrap (row r begins at stream offset
    r * (width - 1) and holds `width` tokens), `whole_rows(parts, width)` under whole."""
    if packing not in typing.get_args(Packing):
        raise ValueError(f"packing={packing!r}: choose one of {', '.join(typing.get_args(Packing))}")
    return whole_rows(parts, width) if packing == "whole" else None


def whole_rows(parts, width: int) -> np.ndarray:
    """The rows of data.packing=whole over a token stream, from its document ends alone: [rows, 2]
    int64, each row's first stream offset and the number of stream tokens it holds (at most
    `width` = seq_len + 1; the rest of the row is padding, `pad_rows`).

    `parts`: arrays of document ends (exclusive stream offsets, increasing; the first document
    begins at 0), consecutive pieces of one stream (a prepared split's shards, each its own array:
    nothing is concatenated). Next fit, in order: a row takes the documents that end within it
    (`width` tokens from its start; a document of exactly the room left fits) and is closed,
    padded, at the first that does not; that document begins the next row. A document longer than
    a row fills rows of `width` tokens, each beginning one token before the last one ended (wrap's
    overlap: every token but its first is a target once), and its last piece shares its row with
    the documents after it. One loop step per row, each a binary search: no work per token."""
    rows = array.array("q")  # begin, length, begin, length, ...: 16 bytes a row while it grows
    begin = filled = 0  # the open row's first stream offset; the end of its last whole document
    for part in parts:
        ends = part.tolist()  # bisect on a list: a tenth of numpy's per-call cost
        i = 0
        while i < len(ends):
            j = bisect.bisect_right(ends, begin + width, i)
            if j > i:  # documents i..j-1 end within the open row (which stays open past the part)
                filled, i = ends[j - 1], j
            elif filled > begin:  # document i does not fit: the row ends, padded, before it
                rows.extend((begin, filled - begin))
                begin = filled
            else:  # document i is longer than a row from `begin`: a full row of it
                rows.extend((begin, width))
                begin = filled = begin + width - 1
    if filled > begin:
        rows.extend((begin, filled - begin))
    return np.frombuffer(rows, dtype=np.int64).reshape(-1, 2)


def pad_rows(
    tokens: np.ndarray, starts: np.ndarray, targets: np.ndarray | None, lengths: np.ndarray, pad_id: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Rows of whole documents made whole rows for `packed_rows`: in row r the positions from
    lengths[r] on are padding: token `pad_id`, no target, and a segment of their own (a document
    start at lengths[r]), so no real token attends to them nor they to it."""
    width = tokens.shape[1]
    real = np.arange(width) < lengths[:, None]
    tokens = np.where(real, tokens, np.asarray(pad_id, tokens.dtype))
    starts = starts | (np.arange(width) == lengths[:, None])
    targets = real.astype(np.uint8) if targets is None else targets * real
    return tokens, starts, targets
