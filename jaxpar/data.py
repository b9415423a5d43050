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
machine, no download), a plain-text file or glob (one document per file), or JSONL (one document
per line, in `data.text_field`). Tokenizers: bytes (ids 0-255, end-of-document 256) or a local
Hugging Face `tokenizer.json` (`python -m jaxpar.data train-tokenizer` trains one).
"""

from __future__ import annotations

import argparse
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


def read_documents(cfg: DataConfig) -> list[str]:
    """The source's documents, in a fixed order (sorted file names, then line order). A document
    that is not text is handled as data.errors says."""
    if cfg.source == "stdlib":
        files, fmt = stdlib_files(), "text"
    else:
        files = data_files(cfg)
        fmt = cfg.format
    docs: list[str] = []
    skipped = _Skipped()
    errors = cfg.errors
    for path in files:
        kind = fmt if fmt != "auto" else ("jsonl" if path.endswith((".jsonl", ".json")) else "text")
        with open(path, "rb") as f:
            raw = f.read()
        if cfg.source == "stdlib":  # a few stdlib files are Latin-1 on purpose: taken as they are
            docs.append(raw.decode("utf-8", errors="replace"))
        elif kind == "text":
            text = _text(raw, path, None, errors, skipped)
            docs += [] if text is None else [text]
        else:
            docs += _jsonl_texts(raw, path, cfg.text_field, errors, skipped)
        if cfg.max_documents is not None and len(docs) >= cfg.max_documents:
            docs = docs[: cfg.max_documents]
            break
    skipped.warn(errors)
    return docs


def _jsonl_texts(raw: bytes, path: str, field: str, errors: str, skipped: _Skipped) -> list[str]:
    texts = []
    for n, line_bytes in enumerate(raw.split(b"\n"), 1):
        if not line_bytes.strip():
            continue
        line = _text(line_bytes, path, n, errors, skipped)
        if line is None:
            continue
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
            if errors == "strict":
                raise ConfigError(
                    f"{path}:{n}: '{field}' (data.text_field) is {json.dumps(text)[:40]}, not a "
                    "string; fix the line, or set data.errors=skip to leave such records out")
            skipped.skipped.append(f"{path}:{n}")
            continue
        texts.append(text)
    return texts


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
        window = slice(start, start + self.seq_len)
        docs = self.doc_ids[window]
        target_docs = self.doc_ids[start + 1: start + self.seq_len + 1]
        # Position within the document: distance from the latest document start in the window.
        is_start = np.concatenate([[True], docs[1:] != docs[:-1]])
        starts = np.maximum.accumulate(np.where(is_start, np.arange(self.seq_len), 0))
        return {
            "inputs": self.tokens[window],
            "targets": self.tokens[start + 1: start + self.seq_len + 1],
            "positions": (np.arange(self.seq_len) - starts).astype(np.int32),
            "segment_ids": np.cumsum(is_start).astype(np.int32),
            "loss_mask": (docs == target_docs).astype(np.float32),
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
    args = parser.parse_args(argv)
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


if __name__ == "__main__":
    sys.exit(main())
