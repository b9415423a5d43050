"""Prepared token shards: their format, and what the writer, the checks and the reader share.

`python -m jaxpar.data prepare` (jaxpar.corpus.prepare) tokenizes a corpus once and writes, into a
directory:

- `train-NNNNN.bin`: the shard's tokens, little-endian uint16 (a vocabulary of at most 65536) or
  uint32, every document followed by the end-of-document token -- the packed stream itself, so a
  training run laying the shards end to end packs exactly what `data.pack` packs from the raw
  source (same documents, order, end-of-document tokens, sequences, shuffle);
- `train-NNNNN.idx`: little-endian int64, the end offset (exclusive) of each document in the shard
  (the document index: segment ids and positions come from it, by binary search, per window);
- `train-NNNNN.msk`, in a shard that holds conversation or prompt/completion records
  (jaxpar.corpus.chat): one byte a token, 1 where the token is a target (an assistant reply, a
  completion), 0 where it is prompt; the tokens of plain-text documents are 1s, and a shard
  without records has no .msk (all targets). A manifest whose shards have masks says version 2
  (MASKED_VERSION), so that a reader that would ignore them refuses it;
- `val-NNNNN.bin/.idx` with `--val-fraction`: the documents carved off for validation (chosen by a
  hash of their text: the same document always falls on the same side);
- `manifest.json`: the tokenizer (spec, SHA-256 of its file, vocabulary, end-of-document id), the
  chat template conversations are rendered with (its origin and text; null without one), the
  token dtype, the options, every source file (path, size, SHA-256) and every shard (documents,
  tokens, SHA-256 of each file). Training checks the shards it reads against it before the
  first step (jaxpar.corpus.verify's `verify_shards`: sizes, hashes, the document index, the
  token ids, the tokenizer), and reads a shard again only when its files' identity changed;
  `python -m jaxpar.data verify DIR` checks every shard whole.

Why flat token files and not ArrayRecord: packing cuts sequences at any token, across documents,
so the unit of random access is a token range, not a record. A flat file gives any window with
one positioned read of exactly its bytes (no decompression, nothing else read), and the document
index, memory-mapped, gives its segment ids and positions by binary search; ArrayRecord would need
several record reads per window (or records of pre-cut sequences, fixing train.seq_len at
preparation). The files are plain arrays (nanoGPT's and llm.c's .bin, Megatron's .bin/.idx), numpy
maps them without another dependency, and they hold no headers or timestamps: the same input
gives the same bytes. The cost is no compression (2 bytes a token below 65536 ids). Tokens are
read, not memory-mapped: see jaxpar.corpus.reader.PreparedSequences.

This module is the bottom of the four: jaxpar.corpus.prepare (the writer) and
jaxpar.corpus.verify (the checks) import it, and jaxpar.corpus.reader (the reader) imports both
it and the checks.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os

import numpy as np

from jaxpar.config import ConfigError, DataConfig
from jaxpar.corpus.documents import make_tokenizer

FORMAT = "jaxpar-token-shards"
VERSION = 1
MASKED_VERSION = 2  # shards with target masks (.msk): a reader of VERSION alone would ignore them
MANIFEST = "manifest.json"
PLAN = "prepare.json"
AGAIN = "prepare the corpus again (python -m jaxpar.data prepare, into a new directory)"


# --- Identity and files -------------------------------------------------------------------------


def file_sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def tokenizer_identity(spec: str, tokenizer=None) -> dict:
    """What names a tokenizer in a manifest: its spec, the SHA-256 of its file (of a fixed string
    for the byte tokenizer), its vocabulary and end-of-document id."""
    tokenizer = tokenizer or make_tokenizer(DataConfig(tokenizer=spec))
    digest = (
        hashlib.sha256(b"jaxpar byte tokenizer: utf-8 bytes, end-of-document 256").hexdigest()
        if spec == "byte"
        else file_sha256(spec)
    )
    return {
        "spec": spec,
        "sha256": digest,
        "vocab_size": int(tokenizer.vocab_size),
        "eod_id": int(tokenizer.eod_id),
    }


def token_dtype(vocab_size: int) -> str:
    return "<u2" if vocab_size <= 1 << 16 else "<u4"


def write_json(path: str, obj) -> None:
    """Written whole under a temporary name, synced, then renamed: never half-written."""
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with open(tmp, "w") as f:
            json.dump(obj, f, indent=1)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):  # e.g. a full disk: nothing half-written left behind
            os.unlink(tmp)
        raise


def read_json(path: str) -> dict:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise ConfigError(
            f"{path} is not readable ({e}); prepare the corpus again (python -m jaxpar.data prepare)"
        ) from None


def shard_files(directory: str, record: dict, dtype: str) -> list[tuple[str, int]]:
    """(path, expected size in bytes) of a shard's files: .bin and .idx, and .msk where it has a
    target mask (one byte a token)."""
    base = os.path.join(directory, record["name"])
    files = [
        (base + ".bin", record["tokens"] * np.dtype(dtype).itemsize),
        (base + ".idx", record["documents"] * 8),
    ]
    return files + ([(base + ".msk", record["tokens"])] if "msk" in record["sha256"] else [])


def shard_problem(directory: str, record: dict, dtype: str) -> str | None:
    """The first way a shard's files are not those its `record` describes, by their sizes alone
    (one missing, truncated or grown), or None; what they hold is jaxpar.corpus.verify's to check."""
    for path, size in shard_files(directory, record, dtype):
        if not os.path.isfile(path):
            return f"{path} is missing"
        if (have := os.path.getsize(path)) != size:
            return (
                f"{path} is {have} bytes, but {record['tokens']} tokens and {record['documents']} "
                f"documents make {size}: it is truncated or was changed"
            )
    return None


# --- The manifest -------------------------------------------------------------------------------


def read_manifest(directory: str) -> dict:
    path = os.path.join(directory, MANIFEST)
    if not os.path.isfile(path):
        unfinished = os.path.isfile(os.path.join(directory, PLAN))
        raise ConfigError(
            f"data.source='{directory}' has no {MANIFEST}: "
            + (
                "its preparation did not finish; run the same `python -m jaxpar.data prepare` "
                "command again, it resumes"
                if unfinished
                else "not a directory of prepared shards (python -m jaxpar.data prepare SOURCES --out DIR "
                "makes one); for raw files give a glob, e.g. " + os.path.join(directory, "*.txt")
            )
        )
    manifest = read_json(path)
    if (
        not isinstance(manifest, dict)
        or manifest.get("format") != FORMAT
        or manifest.get("version") not in (VERSION, MASKED_VERSION)
    ):
        raise ConfigError(
            f"{path} is not a {FORMAT} manifest of version {VERSION} or {MASKED_VERSION}; prepare the "
            "corpus again with this jaxpar"
        )
    if (key := _missing_key(manifest)) is not None:
        raise ConfigError(f"{path} has no valid '{key}': it is damaged or was edited; {AGAIN}")
    return manifest


def _missing_key(manifest: dict) -> str | None:
    """The first setting the readers of a manifest use that it lacks or holds in another kind
    (as a path, e.g. splits.train.shards[0].tokens); None when it has them all."""

    def lacks(mapping: dict, keys: tuple, where: str) -> str | None:
        for key, kind in keys:
            if not isinstance(mapping.get(key), kind):
                return where + key
        return None

    top = (("dtype", str), ("tokenizer", dict), ("splits", dict))
    if (key := lacks(manifest, top, "")) is not None:
        return key
    if (
        key := lacks(manifest["tokenizer"], (("vocab_size", int), ("eod_id", int)), "tokenizer.")
    ) is not None:
        return key
    for name, split in manifest["splits"].items():
        where = f"splits.{name}"
        if not isinstance(split, dict):
            return where
        if (
            key := lacks(split, (("tokens", int), ("documents", int), ("shards", list)), where + ".")
        ) is not None:
            return key
        for k, record in enumerate(split["shards"]):
            at = f"{where}.shards[{k}]."
            if not isinstance(record, dict):
                return at[:-1]
            keys = (("name", str), ("tokens", int), ("documents", int), ("sha256", dict))
            if (
                key := lacks(record, keys, at)
                or lacks(record["sha256"], (("bin", str), ("idx", str)), at + "sha256.")
            ) is not None:
                return key
    return None


def map_index(path: str, dtype: str) -> np.ndarray:
    """A document index as a read-only array, memory-mapped (no read-ahead: a binary search
    brings in the pages it probes, not the 128 KiB around each)."""
    import mmap

    with open(path, "rb") as f:
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    if hasattr(mapped, "madvise"):
        mapped.madvise(mmap.MADV_RANDOM)
    return np.frombuffer(mapped, dtype=dtype)


# --- The cache ----------------------------------------------------------------------------------


def cache_root() -> str:
    """Where jaxpar caches: $JAXPAR_CACHE, else $XDG_CACHE_HOME/jaxpar or ~/.cache/jaxpar (the
    prepared stdlib, jaxpar.corpus.prepare; the record of verified shards, jaxpar.corpus.verify)."""
    if root := os.environ.get("JAXPAR_CACHE"):
        return os.path.expanduser(root)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "jaxpar")
