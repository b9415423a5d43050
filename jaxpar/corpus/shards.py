"""Prepared token shards: tokenize a corpus once, then train reading a sequence at a time.

`python -m jaxpar.data prepare SOURCES --tokenizer T --out DIR` reads text files, globs, JSONL
(also .gz/.zst) and Parquet (column `--text-field`), tokenizes them on all cores (the tokenizers
library's batch encoding) and writes, into DIR:

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
  first step (`verify_shards`: sizes, hashes, the document index, the token ids, the tokenizer),
  and reads a shard again only when its files' identity changed; `python -m jaxpar.data verify
  DIR` checks every shard whole.

Why flat token files and not ArrayRecord: packing cuts sequences at any token, across documents,
so the unit of random access is a token range, not a record. A flat file gives any window with
one positioned read of exactly its bytes (no decompression, nothing else read), and the document
index, memory-mapped, gives its segment ids and positions by binary search; ArrayRecord would need
several record reads per window (or records of pre-cut sequences, fixing train.seq_len at
preparation). The files are plain arrays (nanoGPT's and llm.c's .bin, Megatron's .bin/.idx), numpy
maps them without another dependency, and they hold no headers or timestamps: the same input
gives the same bytes. The cost is no compression (2 bytes a token below 65536 ids). Tokens are
read, not memory-mapped: see PreparedSequences.

Preparation keeps memory bounded (one batch of text and a few MiB of tokens at a time) and
resumes: shards are cut at document boundaries once they hold `--shard-tokens` tokens; each is
written under a temporary name, synced and renamed, then recorded in `part-NNNNN.json` (which
also says where in the sources the next shard starts). Interrupted, the same command skips the
complete shards and goes on from there; the manifest is written last, under a temporary name
then renamed (the part files and prepare.json, the preparation's own record of its input, are
removed then), and training refuses a directory without one. A second run on a finished
directory with the same input does nothing; on another input it refuses. Bad input (an error
naming the file) leaves nothing behind: the input has to change, and changed input starts over.

The default source (`stdlib`, whole) prepares itself on first use into a cache directory
($JAXPAR_CACHE, else $XDG_CACHE_HOME/jaxpar or ~/.cache/jaxpar), keyed by the interpreter, its
standard library's files and the tokenizer.
"""

from __future__ import annotations

import bisect
import contextlib
import functools
import hashlib
import json
import os
import re
import shutil
import socket
import sys
import time

import numpy as np

from jaxpar.config import ConfigError, DataConfig
from jaxpar.corpus import chat
from jaxpar.corpus.documents import (
    Skipped,
    iter_documents,
    make_tokenizer,
    packed_rows,
    pad_rows,
    parquet_file,
    row_index,
    source_entries,
    split_rows,
    stdlib_files,
)

FORMAT = "jaxpar-token-shards"
VERSION = 1
MASKED_VERSION = 2  # shards with target masks (.msk): a reader of VERSION alone would ignore them
MANIFEST = "manifest.json"
PLAN = "prepare.json"
DEFAULT_SHARD_TOKENS = 1 << 26  # 64 Mi tokens: 128 MiB shards of uint16
_BATCH_BYTES = 4 << 20  # text per batch handed to the tokenizer
_BATCH_DOCS = 4096
_FLUSH_TOKENS = 1 << 20  # tokens held before a write


# --- Identity -----------------------------------------------------------------------------------


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


def _write_json(path: str, obj) -> None:
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


def _read_json(path: str) -> dict:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise ConfigError(
            f"{path} is not readable ({e}); prepare the corpus again (python -m jaxpar.data prepare)"
        ) from None


@contextlib.contextmanager
def _locked(directory: str):
    """One preparation of a directory at a time (processes of one run share the stdlib cache)."""
    import fcntl

    with open(os.path.join(directory, ".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


# --- Writing ------------------------------------------------------------------------------------


class _SplitWriter:
    """One shard of one split: tokens to `<name>.bin`, document ends to `<name>.idx` and, from the
    first document that has one, the target mask to `<name>.msk` (the tokens before it all
    targets), all under temporary names until `close` renames them."""

    def __init__(self, directory: str, name: str, dtype: str, eod_id: int):
        self.directory, self.name, self.dtype = directory, name, np.dtype(dtype)
        self.eod = np.array([eod_id], dtype=self.dtype)
        self.suffix = f".tmp-{os.getpid()}"
        self.paths = {ext: os.path.join(directory, f"{name}.{ext}") for ext in ("bin", "idx")}
        self.tmp = {ext: path + self.suffix for ext, path in self.paths.items()}
        self.files = {ext: open(path, "wb") for ext, path in self.tmp.items()}
        self.hashes = {ext: hashlib.sha256() for ext in self.paths}
        self.tokens = self.documents = self._written = 0
        self._pieces, self._ends, self._masks, self._held = [], [], [], 0

    def add(self, ids: np.ndarray, mask: np.ndarray | None = None, eod_target: bool = True) -> None:
        """A document: its ids, their target mask (None: all targets) and whether the
        end-of-document token after them is a target."""
        if mask is not None and "msk" not in self.files:
            self._open_mask()
        self._pieces += [ids, self.eod]
        self._masks.append(None if mask is None else np.append(mask, np.uint8(eod_target)))
        self.tokens += len(ids) + 1
        self.documents += 1
        self._ends.append(self.tokens)
        self._held += len(ids) + 1
        if self._held >= _FLUSH_TOKENS:
            self._flush()

    def _open_mask(self) -> None:
        """Starts `<name>.msk`: the tokens already written are all targets."""
        self.paths["msk"] = os.path.join(self.directory, f"{self.name}.msk")
        self.tmp["msk"] = self.paths["msk"] + self.suffix
        self.files["msk"] = open(self.tmp["msk"], "wb")
        self.hashes["msk"] = hashlib.sha256()
        for at in range(0, self._written, _FLUSH_TOKENS):
            ones = np.ones(min(_FLUSH_TOKENS, self._written - at), np.uint8).tobytes()
            self.files["msk"].write(ones)
            self.hashes["msk"].update(ones)

    def _flush(self) -> None:
        if self._pieces:
            arrays = [
                ("bin", np.concatenate(self._pieces).astype(self.dtype)),
                ("idx", np.asarray(self._ends, dtype="<i8")),
            ]
            if "msk" in self.files:
                masks = [
                    np.ones(len(ids) + 1, np.uint8) if m is None else m
                    for ids, m in zip(self._pieces[::2], self._masks)
                ]
                arrays.append(("msk", np.concatenate(masks)))
            for ext, array in arrays:
                data = array.tobytes()
                self.files[ext].write(data)
                self.hashes[ext].update(data)
            self._written = self.tokens
        self._pieces, self._ends, self._masks, self._held = [], [], [], 0

    def close(self) -> dict:
        self._flush()
        for ext, f in self.files.items():
            f.flush()
            os.fsync(f.fileno())
            f.close()
            os.replace(self.tmp[ext], self.paths[ext])
        return {
            "name": self.name,
            "documents": self.documents,
            "tokens": self.tokens,
            "sha256": {ext: h.hexdigest() for ext, h in self.hashes.items()},
        }

    def abort(self) -> None:
        for ext, f in self.files.items():
            with contextlib.suppress(OSError):  # closing writes what is buffered: on a full
                f.close()  # disk that fails again, and the file goes anyway
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.tmp[ext])


def _shard_files(directory: str, record: dict, dtype: str) -> list[tuple[str, int]]:
    """(path, expected size in bytes) of a shard's files: .bin and .idx, and .msk where it has a
    target mask (one byte a token)."""
    base = os.path.join(directory, record["name"])
    files = [
        (base + ".bin", record["tokens"] * np.dtype(dtype).itemsize),
        (base + ".idx", record["documents"] * 8),
    ]
    return files + ([(base + ".msk", record["tokens"])] if "msk" in record["sha256"] else [])


def _shard_problem(directory: str, record: dict, dtype: str) -> str | None:
    for path, size in _shard_files(directory, record, dtype):
        if not os.path.isfile(path):
            return f"{path} is missing"
        if (have := os.path.getsize(path)) != size:
            return (
                f"{path} is {have} bytes, but {record['tokens']} tokens and {record['documents']} "
                f"documents make {size}: it is truncated or was changed"
            )
    return None


# --- Verification -------------------------------------------------------------------------------


AGAIN = "prepare the corpus again (python -m jaxpar.data prepare, into a new directory)"
_VERIFY_CHUNK = 1 << 22  # bytes read at a time when hashing and checking a shard


class _Scan:
    """One pass over a file: its SHA-256, in chunks of whole items of `dtype`."""

    def __init__(self, path: str, dtype: np.dtype):
        self.path, self.dtype, self.digest = path, np.dtype(dtype), hashlib.sha256()

    def chunks(self):
        """Yields (index of the chunk's first item, the chunk as an array)."""
        step = _VERIFY_CHUNK - _VERIFY_CHUNK % self.dtype.itemsize
        at = 0
        with open(self.path, "rb") as f:
            while chunk := f.read(step):
                self.digest.update(chunk)
                array = np.frombuffer(chunk, dtype=self.dtype)
                yield at, array
                at += len(array)


def _index_problem(scan: _Scan, tokens: int) -> str | None:
    """Hashes a document index (into `scan`); the first way it is not one, or None: its ends
    must rise strictly (every document holds at least its end-of-document token) up to `tokens`."""
    previous, problem = 0, None
    for at, ends in scan.chunks():
        if problem is None and len(ends):
            steps = np.diff(ends, prepend=previous)
            if (bad := np.flatnonzero(steps <= 0)).size:
                k = int(bad[0])
                problem = (
                    f"{scan.path}: document {at + k} ends at token {int(ends[k])}, not after "
                    f"the one before (at {int(ends[k] - steps[k])}): the document index does "
                    "not rise"
                )
            previous = int(ends[-1])
    if problem is None and previous != tokens:
        problem = (
            f"{scan.path}: the last document ends at token {previous}, but the shard holds {tokens} tokens"
        )
    return problem


def _tokens_problem(scan: _Scan, ends: np.ndarray, vocab_size: int, eod_id: int) -> str | None:
    """Hashes a shard's tokens (into `scan`); the first way they do not fit the tokenizer or the
    (rising) document `ends`, or None: every id below `vocab_size`, `eod_id` at each end."""
    problem = None
    for at, ids in scan.chunks():
        if problem is not None:
            continue
        if (over := np.flatnonzero(ids >= vocab_size)).size:
            problem = (
                f"{scan.path}: token {at + int(over[0])} is id {int(ids[over[0]])}, beyond the "
                f"tokenizer's {vocab_size} ids ({over.size} such tokens in its {len(ids)} "
                f"from token {at})"
            )
            continue
        first, last = ends.searchsorted((at + 1, at + len(ids) + 1))  # ends in (at, at + len]
        closing = ends[first:last] - 1 - at
        if (wrong := np.flatnonzero(ids[closing] != eod_id)).size:
            k = int(wrong[0])
            problem = (
                f"{scan.path}: token {at + int(closing[k])} closes document {first + k} "
                f"(says the .idx) but is id {int(ids[closing[k]])}, not the end-of-document "
                f"id {eod_id}"
            )
    return problem


def verify_shard(directory: str, record: dict, dtype: str, tokenizer: dict) -> str | None:
    """Reads a shard's files whole: None when they are what the manifest's `record` says
    (sizes, SHA-256), a document index that rises to the shard's end, every token id below the
    tokenizer's vocabulary and its end-of-document id closing every document, a target mask (if
    any) of 0s and 1s; else the first problem, naming the file."""
    if (problem := _shard_problem(directory, record, dtype)) is not None:
        return problem
    (bin_path, _), (idx_path, _), *mask_file = _shard_files(directory, record, dtype)
    index = _Scan(idx_path, np.dtype("<i8"))
    problem = _index_problem(index, record["tokens"])
    tokens = _Scan(bin_path, np.dtype(dtype))
    ends = _map(idx_path, "<i8") if record["documents"] else np.zeros(0, np.int64)
    problem = problem or _tokens_problem(tokens, ends, tokenizer["vocab_size"], tokenizer["eod_id"])
    scans = [(tokens, "bin"), (index, "idx")]
    if mask_file:
        scans.append((_Scan(mask_file[0][0], np.dtype(np.uint8)), "msk"))
        for at, mask in scans[-1][0].chunks():
            if problem is None and (bad := np.flatnonzero(mask > 1)).size:
                problem = (
                    f"{scans[-1][0].path}: token {at + int(bad[0])} has mask {int(mask[bad[0]])}, not 0 or 1"
                )
    if problem is not None:
        return problem
    for scan, ext in scans:
        if (have := scan.digest.hexdigest()) != (want := record["sha256"][ext]):
            return (
                f"{scan.path}: its SHA-256 is {have[:16]}..., but {MANIFEST} records "
                f"{want[:16]}...: the file changed after it was prepared"
            )
    return None


def _file_identity(path: str) -> list[int]:
    """What tells a file from a changed one without reading it: size, modification and change
    times (ns), inode and device. Rewriting it in place changes the change time, even when the
    modification time is set back."""
    st = os.stat(path)
    return [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev]


def _verified_path(directory: str) -> str:
    """Where the shards of `directory` that passed are recorded: one file per directory and host
    (a home directory shared by a cluster's nodes, whose file systems number devices and inodes
    their own way, keeps each node's record apart)."""
    key = hashlib.sha256(f"{socket.gethostname()}:{os.path.realpath(directory)}".encode())
    return os.path.join(cache_root(), "verified", f"{key.hexdigest()[:16]}.json")


def _verified_key(directory: str, record: dict, dtype: str, tokenizer: dict) -> dict:
    """What a verification of one shard vouches for: the manifest's record of it, the
    tokenizer's ids and the identity of both files as they were read."""
    files = [path for path, _ in _shard_files(directory, record, dtype)]
    return {
        "record": record,
        "dtype": dtype,
        "vocab_size": tokenizer["vocab_size"],
        "eod_id": tokenizer["eod_id"],
        "files": [_file_identity(path) for path in files],
    }


def verify_shards(
    directory: str, records: list[dict], dtype: str, tokenizer: dict, *, cached: bool = True, log=None
) -> int:
    """Verifies the shards `records` of `directory` (`verify_shard`), raising a ConfigError that
    names the file at the first problem. A shard whose files have the identity they had when they
    last passed (recorded under `cache_root()/verified/`) is not read again, unless `cached` is
    False. Returns the bytes read."""
    cache_path = _verified_path(directory)
    try:
        with open(cache_path) as f:
            passed = json.load(f)
    except (OSError, ValueError):
        passed = {}
    passed = passed if isinstance(passed, dict) else {}
    read, changed = 0, False
    for record in records:
        try:
            key = _verified_key(directory, record, dtype, tokenizer)
        except OSError:  # a file is missing: verify_shard names it
            key = None
        if cached and key is not None and passed.get(record["name"]) == key:
            continue
        if (problem := verify_shard(directory, record, dtype, tokenizer)) is not None:
            passed.pop(record["name"], None)
            with contextlib.suppress(OSError):
                _write_json(cache_path, passed)
            raise ConfigError(f"{problem}; {AGAIN}")
        read += sum(size for _, size in _shard_files(directory, record, dtype))
        passed[record["name"]], changed = _verified_key(directory, record, dtype, tokenizer), True
    if changed:
        try:
            os.makedirs(os.path.dirname(cache_path), exist_ok=True)
            _write_json(cache_path, passed)
        except OSError as e:
            (log or (lambda m: print(m, file=sys.stderr)))(
                f"warning: cannot record the verified shards in {cache_path} ({e.strerror}); "
                "they will be hashed again at the next start"
            )
    return read


def verify(directory: str, log=None) -> str:
    """`python -m jaxpar.data verify DIR`: every shard of every split of `directory` read whole
    and checked (`verify_shard`), whatever was verified before; the tokenizer checked against the
    manifest where its file is still there. Returns the line that says what passed; raises a
    ConfigError naming the file at the first problem."""
    log = log or (lambda message: print(message, file=sys.stderr))
    clock = time.perf_counter()
    _check_verify_target(directory)
    manifest = read_manifest(directory)
    if (problem := listing_problem(directory, manifest)) is not None:
        raise ConfigError(f"{problem}; {AGAIN}")
    spec = manifest.get("tokenizer", {}).get("spec")
    if spec == "byte" or (isinstance(spec, str) and os.path.isfile(spec)):
        tokenizer = tokenizer_identity(spec)
        check_tokenizer(directory, manifest, tokenizer)
    else:
        tokenizer = manifest["tokenizer"]
        log(
            f"warning: {os.path.join(directory, MANIFEST)} names tokenizer '{spec}', which is not "
            "there: the token ids are checked against the vocabulary the manifest records"
        )
    read = shards = 0
    for split in manifest["splits"].values():
        read += verify_shards(directory, split["shards"], manifest["dtype"], tokenizer, cached=False, log=log)
        shards += len(split["shards"])
    seconds = time.perf_counter() - clock
    counts = ", ".join(
        f"{name} {split['tokens']} tokens in {split['documents']} documents"
        for name, split in manifest["splits"].items()
    )
    return (
        f"{directory}: {shards} shard(s) verified ({counts}); {read / 2**20:.1f} MiB read in {seconds:.1f} s"
    )


def _check_verify_target(directory: str) -> None:
    """A ConfigError when what `verify` was given is not a directory of prepared shards: a
    path that does not exist, a file (the directory it is in, where that is one, named), a
    directory without a manifest."""
    make = "python -m jaxpar.data prepare SOURCES --out DIR makes one"
    if not os.path.exists(directory):
        raise ConfigError(
            f"{directory}: no such directory; verify takes a directory of prepared shards ({make})"
        )
    if not os.path.isdir(directory):
        parent = os.path.dirname(os.path.abspath(directory))
        hint = (
            f"python -m jaxpar.data verify {os.path.dirname(directory) or '.'} checks the set it belongs to"
            if os.path.isfile(os.path.join(parent, MANIFEST))
            else make
        )
        raise ConfigError(f"{directory} is a file; verify takes a directory of prepared shards ({hint})")
    if not os.path.isfile(os.path.join(directory, MANIFEST)):
        why = (
            "its preparation did not finish; run the same `python -m jaxpar.data prepare` command "
            "again, it resumes"
            if os.path.isfile(os.path.join(directory, PLAN))
            else f"not a directory of prepared shards ({make})"
        )
        raise ConfigError(f"{directory} has no {MANIFEST}: {why}")


_SHARD_FILE = re.compile(r"[a-z]+-\d{5}\.(bin|idx|msk)")  # the names `prepare` gives shard files


def listing_problem(directory: str, manifest: dict) -> str | None:
    """Where the manifest's list of shards and the directory disagree (None: nowhere): a split
    whose shards do not add up to its totals or skip a number (an entry lost from the list), a
    shard file in the directory that no entry names (a leftover, or an entry's file whose entry
    was removed). A listed file that is missing is `verify_shard`'s to report."""
    path, listed = os.path.join(directory, MANIFEST), set()
    for name, split in manifest["splits"].items():
        records = split["shards"]
        for key in ("tokens", "documents"):
            if (total := sum(r[key] for r in records)) != split[key]:
                return (
                    f"{path}: the {len(records)} shard(s) it lists for the {name} split hold {total} "
                    f"{key}, but it records {split[key]} for the split: a shard is missing from its list"
                )
        for k, record in enumerate(records):
            if record["name"] != f"{name}-{k:05d}":
                return (
                    f"{path}: the {name} split's shard {k} is {record['name']}, not {name}-{k:05d}: "
                    "a shard is missing from its list"
                )
            listed.update(os.path.basename(p) for p, _ in _shard_files(directory, record, manifest["dtype"]))
    for entry in sorted(os.listdir(directory)):
        if _SHARD_FILE.fullmatch(entry) and entry not in listed:
            return (
                f"{os.path.join(directory, entry)} is a shard file that {MANIFEST} does not list "
                "(left from another preparation, or its entry was removed from the manifest)"
            )
    return None


def check_tokenizer(directory: str, manifest: dict, have: dict) -> None:
    """The manifest's tokenizer is `have` (`tokenizer_identity` of the one a run uses), and its
    token dtype the one that vocabulary takes."""
    path = os.path.join(directory, MANIFEST)
    want = manifest["tokenizer"]
    if want.get("sha256") != have["sha256"]:
        raise ConfigError(
            f"{path}: the shards were prepared with tokenizer '{want.get('spec')}' (sha256 "
            f"{str(want.get('sha256'))[:12]}), but data.tokenizer='{have['spec']}' is another one "
            f"(sha256 {have['sha256'][:12]}); train with the tokenizer they were made with, or "
            f"prepare them again with --tokenizer {have['spec']}"
        )
    for key in ("vocab_size", "eod_id"):
        if want.get(key) != have[key]:
            raise ConfigError(
                f"{path}: tokenizer.{key} is {want.get(key)}, but the tokenizer it names "
                f"('{have['spec']}', the same file) has {have[key]}: the manifest was changed; "
                f"{AGAIN}"
            )
    if manifest.get("dtype") != token_dtype(have["vocab_size"]):
        raise ConfigError(
            f"{path}: dtype is {manifest.get('dtype')!r}, but a vocabulary of "
            f"{have['vocab_size']} ids is stored as "
            f"{token_dtype(have['vocab_size'])!r}: the manifest was changed; {AGAIN}"
        )


def _complete_parts(out: str, plan: dict) -> list[dict]:
    """The shards a previous run finished (consecutive from 0, files of the recorded sizes); the
    files of any others, and temporary files, are removed."""
    parts = []
    while os.path.isfile(path := os.path.join(out, f"part-{len(parts):05d}.json")):
        try:
            part = _read_json(path)
        except ConfigError:
            break
        if any(_shard_problem(out, r, plan["dtype"]) for r in part["splits"].values()):
            break
        parts.append(part)
    keep = {MANIFEST, PLAN, ".lock"} | {f"part-{k:05d}.json" for k in range(len(parts))}
    keep |= {f"{r['name']}.{ext}" for p in parts for r in p["splits"].values() for ext in r["sha256"]}
    for name in os.listdir(out):
        if name not in keep:
            os.unlink(os.path.join(out, name))
    return parts


def _different(a: dict, b: dict) -> str:
    keys = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))
    return ", ".join(keys)


def _is_val(text: str, fraction: float) -> bool:
    if fraction <= 0:
        return False
    h = hashlib.blake2b(text.encode("utf-8", errors="surrogatepass"), digest_size=8).digest()
    return int.from_bytes(h, "little") < fraction * 2.0**64


def prepare(
    sources: list[str],
    out: str,
    *,
    tokenizer: str = "byte",
    fmt: str = "auto",
    text_field: str = "text",
    errors: str = "strict",
    val_fraction: float = 0.0,
    max_documents: int | None = None,
    shard_tokens: int = DEFAULT_SHARD_TOKENS,
    chat_template: str | None = None,
    progress: bool | None = None,
    log=None,
) -> dict:
    """Tokenizes `sources` (paths, globs or `stdlib`, read in the order given) into shards in
    `out` (see the module docstring); returns the manifest. Bad input is a ConfigError naming the
    file, raised before anything is written where it can be checked up front."""
    log = log or (lambda message: print(message, file=sys.stderr))
    clock = time.perf_counter()
    if not 0 <= val_fraction < 1:
        raise ConfigError(f"--val-fraction={val_fraction}: use a fraction in [0, 1), e.g. 0.01")
    if shard_tokens < 1:
        raise ConfigError(f"--shard-tokens={shard_tokens}: must be at least 1")
    if max_documents is not None and max_documents < 1:
        raise ConfigError(f"--max-documents={max_documents}: must be at least 1")
    entries = [entry for source in sources for entry in source_entries(source, fmt)]
    for path, kind in entries:
        if kind == "parquet":
            parquet_file(path, text_field)  # the column is there: checked before any work
    tok = make_tokenizer(DataConfig(tokenizer=tokenizer))
    identity = tokenizer_identity(tokenizer, tok)
    dtype = token_dtype(identity["vocab_size"])
    template = _chat_template(chat_template, tokenizer)
    plan = {
        "format": FORMAT,
        "version": VERSION,
        "tokenizer": identity,
        "chat_template": (
            {"origin": template.origin, "source": template.source}
            if isinstance(template, chat.ChatTemplate)
            else None
        ),
        "dtype": dtype,
        "options": {
            "sources": list(sources),
            "format": fmt,
            "text_field": text_field,
            "errors": errors,
            "val_fraction": val_fraction,
            "max_documents": max_documents,
            "shard_tokens": shard_tokens,
        },
        "sources": _describe(entries, progress),
    }
    if os.path.exists(out) and not os.path.isdir(out):
        raise ConfigError(f"--out={out} is a file; give a directory")
    created = not os.path.exists(out)
    os.makedirs(out, exist_ok=True)
    with _locked(out):
        if (manifest := _finished(out, plan, log)) is not None:
            return manifest
        _write_json(os.path.join(out, PLAN), plan)
        parts = _complete_parts(out, plan)
        try:
            manifest = _prepare_parts(out, plan, entries, tok, template, parts, progress, log, clock)
        except BaseException as e:
            # Bad input (a ConfigError) must change before a rerun, which then starts over: nothing
            # is kept. An interruption keeps the complete shards, for the rerun to resume from.
            if isinstance(e, ConfigError) or not os.path.exists(os.path.join(out, "part-00000.json")):
                if created:
                    shutil.rmtree(out, ignore_errors=True)
                else:
                    _clear(out)
            raise
        return manifest


def _chat_template(spec: str | None, tokenizer: str):
    """The chat template of conversations: `spec`'s, else the tokenizer's own, loaded up front
    (the plan records it, so a changed template is changed input); without either, a function
    that raises the error naming what would work, called at the first conversation."""
    try:
        return chat.load_template(spec, tokenizer)
    except ConfigError:
        if spec is not None:
            raise
        return functools.partial(chat.load_template, None, tokenizer)


def _finished(out, plan, log) -> dict | None:
    """The manifest in `out` if it holds this `plan`'s finished, intact shards (a ConfigError if
    it holds others); None when preparation is to run, with an unfinished preparation of other
    input cleared first."""
    manifest_path, plan_path = os.path.join(out, MANIFEST), os.path.join(out, PLAN)
    if os.path.isfile(manifest_path):
        manifest = _read_json(manifest_path)
        old = {k: manifest.get(k) for k in plan if k != "version"}  # a masked one's is MASKED_VERSION
        if old == {k: v for k, v in plan.items() if k != "version"}:
            for split in manifest["splits"].values():
                for record in split["shards"]:
                    if (problem := _shard_problem(out, record, plan["dtype"])) is not None:
                        raise ConfigError(f"{problem}; remove {out} and prepare it again")
            log(f"{out} is up to date ({manifest['splits']['train']['tokens']} training tokens)")
            return manifest
        raise ConfigError(
            f"{manifest_path}: {out} already holds shards prepared from other input "
            f"({_different(old, plan)} differ); remove it or give another --out"
        )
    if os.path.isfile(plan_path):
        if (old := _read_json(plan_path)) != plan:
            log(
                f"{out}: the input changed since the unfinished preparation there "
                f"({_different(old, plan)}); starting over"
            )
            _clear(out)
    elif any(not name.startswith(".") for name in os.listdir(out)):
        raise ConfigError(
            f"--out={out} holds other files and no jaxpar preparation; give a new or empty directory"
        )
    return None


def _clear(out):
    """Everything in `out` removed but its lock."""
    for name in os.listdir(out):
        if name != ".lock":
            os.unlink(os.path.join(out, name))


def no_space_message(out: str) -> str:
    """The one line of a preparation stopped by a full disk: where, what is free, what is kept
    (the complete shards, which a rerun resumes from)."""
    existing = os.path.abspath(out)
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    free = shutil.disk_usage(existing).free
    parts = (
        len([n for n in os.listdir(out) if n.startswith("part-") and n.endswith(".json")])
        if os.path.isdir(out)
        else 0
    )
    kept = (
        f"the {parts} complete shard(s) in {out} are kept"
        if parts
        else "no shard was complete, nothing is kept"
    )
    return (
        f"no space left on the device of {out}: {free / 2**20:.1f} MiB is free; {kept}; free "
        "some space and run the same command to resume"
    )


def _describe(entries: list[tuple[str, str]], progress: bool | None) -> list[dict]:
    """Path, kind, size and SHA-256 of every source file (what names the input, for a resume)."""
    from tqdm import tqdm

    sizes = [os.path.getsize(path) for path, _ in entries]
    described = []
    with tqdm(
        total=sum(sizes),
        unit="B",
        unit_scale=True,
        desc="hash",
        file=sys.stderr,
        disable=None if progress is None else not progress,
    ) as bar:
        for (path, kind), size in zip(entries, sizes):
            described.append({"path": path, "kind": kind, "bytes": size, "sha256": file_sha256(path)})
            bar.update(size)
    return described


def _progress_bar(total_bytes, done_bytes, progress):
    """tqdm's bar over the sources' bytes on stderr; `progress` None: only on a terminal."""
    from tqdm import tqdm

    return tqdm(
        total=total_bytes,
        initial=done_bytes,
        unit="B",
        unit_scale=True,
        desc="prepare",
        disable=None if progress is None else not progress,
        file=sys.stderr,
    )


def _document_text(doc) -> str:
    """A document's text, or a record's (conversation, prompt/completion) JSON: what decides its
    split and counts towards a batch's size."""
    return doc if isinstance(doc, str) else json.dumps(doc, sort_keys=True, ensure_ascii=False)


def _encode(tok, docs: list, template) -> list[tuple[np.ndarray, np.ndarray | None, bool]]:
    """(ids, target mask or None for all, end-of-document target) of each document: the texts
    on all cores (the tokenizer's batch encoding), the records with `chat.encode_record`."""
    texts = iter(tok.encode_batch([d for d in docs if isinstance(d, str)]))
    return [
        (next(texts), None, True) if isinstance(d, str) else chat.encode_record(d, tok, template)
        for d in docs
    ]


def _prepare_parts(out, plan, entries, tok, template, parts, progress, log, clock) -> dict:
    options = plan["options"]
    val_fraction, shard_tokens = options["val_fraction"], options["shard_tokens"]
    max_documents = options["max_documents"]
    splits = ["train", "val"] if val_fraction > 0 else ["train"]
    start = tuple(parts[-1]["end"]) if parts else (0, 0)
    total = parts[-1]["documents_total"] if parts else 0
    if parts:
        log(f"{out}: {len(parts)} shard(s) already complete; resuming at document {total}")
    sizes = [s["bytes"] for s in plan["sources"]]
    before = [sum(sizes[:i]) for i in range(len(sizes) + 1)]
    bar = _progress_bar(before[-1], before[start[0]], progress)
    new_tokens = 0
    skipped = Skipped()
    raw = [0]
    state = {"chunk": None, "end": start, "total": total}

    def chunk():
        if state["chunk"] is None:
            k = len(parts)
            state["chunk"] = {s: _SplitWriter(out, f"{s}-{k:05d}", plan["dtype"], tok.eod_id) for s in splits}
        return state["chunk"]

    def finish():
        k = len(parts)
        closed = {s: w.close() for s, w in state["chunk"].items()}  # failing: aborted below
        state["chunk"] = None
        part = {"index": k, "end": list(state["end"]), "documents_total": state["total"], "splits": closed}
        _write_json(os.path.join(out, f"part-{k:05d}.json"), part)
        parts.append(part)

    def encode(batch) -> bool:
        """Tokenizes and writes a batch; True once max_documents are in."""
        nonlocal new_tokens
        for (i, records, doc), (ids, mask, eod_target) in zip(
            batch, _encode(tok, [d for _, _, d in batch], template)
        ):
            writers = chunk()
            writers["val" if _is_val(_document_text(doc), val_fraction) else "train"].add(
                ids, mask, eod_target
            )
            new_tokens += len(ids) + 1
            state["total"] += 1
            state["end"] = (i, records)
            if sum(w.tokens for w in writers.values()) >= shard_tokens:
                finish()
            if max_documents is not None and state["total"] >= max_documents:
                return True
        return False

    batch, held, full = [], 0, max_documents is not None and total >= max_documents
    try:
        if not full:
            for item in iter_documents(
                entries, options["text_field"], options["errors"], skipped, start, raw
            ):
                batch.append(item)
                held += len(_document_text(item[2]))
                if held >= _BATCH_BYTES or len(batch) >= _BATCH_DOCS:
                    full = encode(batch)
                    batch, held = [], 0
                    bar.update(max(0, before[item[0]] + raw[0] - bar.n))
                    bar.set_postfix(tokens=new_tokens, refresh=False)
                    if full:
                        break
            if batch and not full:
                encode(batch)
        if state["chunk"] is not None and any(w.documents for w in state["chunk"].values()):
            finish()
        bar.update(bar.total - bar.n)
    except BaseException:
        if state["chunk"] is not None:
            for w in state["chunk"].values():
                w.abort()
        raise
    finally:
        bar.close()
    skipped.warn(options["errors"])
    return _write_manifest(out, plan, parts, splits, new_tokens, clock, log)


def _write_manifest(
    out: str, plan: dict, parts: list[dict], splits: list[str], new_tokens: int, clock: float, log
) -> dict:
    """The finished preparation's manifest (the plan, and each split's shards from the part
    files), written last; the part files and the plan are removed then, and the preparation
    logged. Refused when the sources held no text."""
    options = plan["options"]
    manifest = dict(plan)
    manifest["splits"] = {}
    for s in splits:
        shards = [p["splits"][s] for p in parts]
        manifest["splits"][s] = {
            "documents": sum(r["documents"] for r in shards),
            "tokens": sum(r["tokens"] for r in shards),
            "shards": shards,
        }
    if any("msk" in r["sha256"] for split in manifest["splits"].values() for r in split["shards"]):
        manifest["version"] = MASKED_VERSION  # older readers, which would ignore the masks, refuse it
    train = manifest["splits"]["train"]
    if train["tokens"] <= train["documents"]:  # nothing but end-of-document tokens
        files = ", ".join(f"{s['path']} ({s['bytes']} bytes)" for s in plan["sources"][:5])
        raise ConfigError(
            f"no text to train on in {', '.join(options['sources'])} ({files}"
            f"{', ...' if len(plan['sources']) > 5 else ''}): the files are empty, or "
            "every document was left out"
        )
    _write_json(os.path.join(out, MANIFEST), manifest)
    for k in range(len(parts)):
        os.unlink(os.path.join(out, f"part-{k:05d}.json"))
    os.unlink(os.path.join(out, PLAN))
    seconds = time.perf_counter() - clock
    counts = "; ".join(
        f"{s}: {manifest['splits'][s]['documents']} documents, {manifest['splits'][s]['tokens']} tokens"
        for s in splits
    )
    log(
        f"prepared {out}: {counts}; {len(parts)} shard(s) of {plan['dtype'][1:]}; "
        f"{new_tokens} tokens in {seconds:.1f} s ({new_tokens / max(seconds, 1e-9):,.0f} tokens/s)"
    )
    return manifest


# --- Reading ------------------------------------------------------------------------------------


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
    manifest = _read_json(path)
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


def _map(path: str, dtype: str) -> np.ndarray:
    """A document index as a read-only array, memory-mapped (no read-ahead: a binary search
    brings in the pages it probes, not the 128 KiB around each)."""
    import mmap

    with open(path, "rb") as f:
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    if hasattr(mapped, "madvise"):
        mapped.madvise(mmap.MADV_RANDOM)
    return np.frombuffer(mapped, dtype=dtype)


def _read_into(fd: int, path: str, out: np.ndarray, lo: int) -> None:
    """Tokens [lo, lo + len(out)) of a shard into `out`: one positioned read (from the page
    cache, once warm)."""
    if os.preadv(fd, [out], lo * out.itemsize) != out.nbytes:
        raise ConfigError(
            f"{path} is shorter than when the run opened it: a shard was changed under a running job"
        )


class PreparedSequences:
    """Packed sequences over prepared shards (a grain data source): the same samples as
    `data.pack` over the same documents, with only the windows read in memory. Under
    data.packing=whole the rows are computed on load from the document index
    (`documents.whole_rows`, 16 bytes a row) and each row reads its range of the stream.

    A window's tokens come with one positioned read (preadv, straight into the batch's array)
    and its documents by binary search in the memory-mapped document index; grain asks for a
    batch's rows at once (`_getitems`), which are packed together. Tokens are not read through a
    memory map on purpose: every page a map touches (and the kernel maps up to 64 KiB around each
    fault) stays in the process's resident memory: a 200 MiB corpus added 390 MiB of resident
    memory within 3 steps that way, when grain read 500 batches ahead (nanoGPT recreates its
    np.memmap every batch for the same reason). The document index is 8 bytes a document. Pickled
    (for grain's worker processes), it is its arguments: the shards are opened again there."""

    def __init__(
        self,
        directory: str,
        tokenizer: str,
        seq_len: int,
        max_documents: int | None = None,
        split: str = "train",
        train_on: str = "assistant",
        packing: str = "wrap",
    ):
        self._args = (directory, tokenizer, seq_len, max_documents, split, train_on, packing)
        self.directory, self.seq_len = directory, seq_len
        manifest = read_manifest(directory)
        path = os.path.join(directory, MANIFEST)
        identity = tokenizer_identity(tokenizer)
        check_tokenizer(directory, manifest, identity)
        if split not in manifest["splits"]:
            raise ConfigError(f"{path} has no '{split}' split (it has {sorted(manifest['splits'])})")
        dtype = manifest["dtype"]
        self.dtype = np.dtype(dtype)
        # The shards this run reads (the first ones, under max_documents), verified whole on
        # first use and again whenever a file's identity changes (`verify_shards`).
        used, wanted = [], max_documents
        for record in manifest["splits"][split]["shards"]:
            if wanted is not None and wanted <= 0:
                break
            used.append(record)
            wanted = None if wanted is None else wanted - record["documents"]
        verify_shards(directory, used, dtype, identity)
        self.paths, self.ends, self.masks, counts, docs = [], [], [], [], []
        left = max_documents
        for record in used:
            (bin_path, _), (idx_path, _), *mask_file = _shard_files(directory, record, dtype)
            n_docs, n_tokens = record["documents"], record["tokens"]
            if n_docs == 0:
                continue
            ends = _map(idx_path, "<i8")
            if left is not None and left < n_docs:
                n_docs, n_tokens = left, int(ends[left - 1])
            self.paths.append(bin_path)
            self.masks.append(mask_file[0][0] if mask_file and train_on == "assistant" else None)
            self.ends.append(ends)
            counts.append(n_tokens)
            docs.append(n_docs)
            left = None if left is None else left - n_docs
        self.starts = np.concatenate([[0], np.cumsum(counts, dtype=np.int64)])
        self._shard_starts = self.starts.tolist()  # for bisect: faster than numpy on a few items
        self.doc_base = np.concatenate([[0], np.cumsum(docs, dtype=np.int64)])
        # data.packing=whole: each row's stream offset and token count, from the document index
        # (`documents.whole_rows`: one binary search per row); its padding is the end-of-document
        # token. wrap: None, row r begins at r * seq_len.
        parts = (base + ends[:n] for base, ends, n in zip(self.starts, self.ends, docs))
        self.rows, self.pad_id = row_index(packing, parts, seq_len + 1), identity["eod_id"]
        if len(self) == 0:
            raise ConfigError(
                f"data: the {'corpus' if split == 'train' else split + ' split'} in {directory} has "
                f"{int(self.starts[-1])} tokens, fewer than one sequence of train.seq_len={seq_len}"
            )

    @property
    def num_tokens(self) -> int:
        return int(self.starts[-1])

    @property
    def num_documents(self) -> int:
        return int(self.doc_base[-1])

    def __len__(self) -> int:
        if self.rows is not None:
            return len(self.rows)
        return max(self.num_tokens - 1, 0) // self.seq_len

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        return self._getitems([index])[0]

    def _getitems(self, indices) -> list[dict[str, np.ndarray]]:
        """Several sequences at once (grain's batched read; see `data.batch_dataset`): each
        window's tokens read straight into one array, its document starts from the index (the
        ends of the documents inside it, two binary searches per shard it spans), then packed
        for all rows together (`documents.packed_rows`)."""
        width = self.seq_len + 1
        tokens = np.empty((len(indices), width), dtype=self.dtype)
        starts = np.zeros((len(indices), width), dtype=bool)
        targets = np.ones((len(indices), width), np.uint8) if any(self.masks) else None
        if self.rows is None:
            begins, lengths = np.asarray(indices, np.int64) * self.seq_len, np.full(len(indices), width)
        else:
            begins, lengths = self.rows[np.asarray(indices, np.int64)].T
        fds: dict[str, int] = {}
        try:
            for row, (begin, length) in enumerate(zip(begins.tolist(), lengths.tolist())):
                shard = bisect.bisect_right(self._shard_starts, begin) - 1
                at = 0
                while at < length:
                    base = self._shard_starts[shard]
                    lo = begin + at - base
                    hi = min(begin + length, self._shard_starts[shard + 1]) - base
                    if hi > lo:
                        self._read(fds, self.paths[shard], tokens[row, at : at + hi - lo], lo)
                        if targets is not None and self.masks[shard] is not None:
                            self._read(fds, self.masks[shard], targets[row, at : at + hi - lo], lo)
                        # A document starts at each end of one inside the piece, and (documents
                        # never cross shards) where a later shard's piece begins.
                        ends = self.ends[shard]
                        first, last = ends.searchsorted((lo + 1, hi))  # the ends in (lo, hi)
                        inside = ends[first:last]
                        starts[row, inside - lo + at] = True
                        starts[row, at] = at > 0
                        at += hi - lo
                    shard += 1
        finally:
            for fd in fds.values():
                os.close(fd)
        if self.rows is not None:
            tokens, starts, targets = pad_rows(tokens, starts, targets, lengths, self.pad_id)
        return split_rows(packed_rows(tokens, starts, targets))

    @staticmethod
    def _read(fds: dict[str, int], path: str, out: np.ndarray, lo: int) -> None:
        """Items [lo, lo + len(out)) of a shard's file into `out`, the file opened once a batch."""
        if path not in fds:
            fds[path] = os.open(path, os.O_RDONLY)
        _read_into(fds[path], path, out, lo)

    def __getstate__(self) -> dict:
        """What a grain worker process (spawned) needs to open the shards again, rather than a
        copy of every document index."""
        return {"args": self._args}

    def __setstate__(self, state: dict) -> None:
        self.__init__(*state["args"])

    def __repr__(self) -> str:
        return (
            f"PreparedSequences({self.directory!r}, {self.num_documents} documents, "
            f"{self.num_tokens} tokens, seq_len={self.seq_len})"
        )


# --- The default source, prepared on first use ---------------------------------------------------


def cache_root() -> str:
    if root := os.environ.get("JAXPAR_CACHE"):
        return os.path.expanduser(root)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "jaxpar")


def stdlib_prepared(tokenizer: str, log=None) -> str | None:
    """The directory of the whole stdlib source prepared with `tokenizer`, preparing it on first
    use; None (with a warning) where the cache cannot be written."""
    log = log or (lambda message: print(message, file=sys.stderr))
    files = stdlib_files()
    key = hashlib.sha256(
        json.dumps(
            [
                VERSION,
                sys.version,
                tokenizer_identity(tokenizer)["sha256"],
                [(path, (st := os.stat(path)).st_size, st.st_mtime_ns) for path in files],
            ]
        ).encode()
    ).hexdigest()[:16]
    out = os.path.join(cache_root(), f"stdlib-{key}")
    if os.path.isfile(os.path.join(out, MANIFEST)):
        return out
    log(f"data.source=stdlib: preparing it once into {out}")
    try:
        prepare(["stdlib"], out, tokenizer=tokenizer, log=log)
    except OSError as e:
        log(
            f"warning: cannot prepare data.source=stdlib into {out} ({e}); reading it into memory "
            "(set JAXPAR_CACHE to a writable directory)"
        )
        return None
    return out
