"""Verification of prepared token shards (their format: jaxpar.corpus.shards): a shard read
whole and checked against its manifest (`verify_shard`: sizes, SHA-256, the document index, the
token ids, the target mask), the shards a run reads verified before its first step and again only
when their files' identity changed (`verify_shards`, recorded under the cache), every shard of a
directory (`verify`, `python -m jaxpar.data verify DIR`), the manifest's list against the
directory (`listing_problem`) and its tokenizer against the one a run uses (`check_tokenizer`).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import socket
import sys
import time

import numpy as np

from jaxpar.config import ConfigError
from jaxpar.corpus.shards import (
    AGAIN,
    MANIFEST,
    PLAN,
    cache_root,
    map_index,
    read_manifest,
    shard_files,
    shard_problem,
    token_dtype,
    tokenizer_identity,
    write_json,
)

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
    if (problem := shard_problem(directory, record, dtype)) is not None:
        return problem
    (bin_path, _), (idx_path, _), *mask_file = shard_files(directory, record, dtype)
    index = _Scan(idx_path, np.dtype("<i8"))
    problem = _index_problem(index, record["tokens"])
    tokens = _Scan(bin_path, np.dtype(dtype))
    ends = map_index(idx_path, "<i8") if record["documents"] else np.zeros(0, np.int64)
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
    files = [path for path, _ in shard_files(directory, record, dtype)]
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
                write_json(cache_path, passed)
            raise ConfigError(f"{problem}; {AGAIN}")
        read += sum(size for _, size in shard_files(directory, record, dtype))
        passed[record["name"]], changed = _verified_key(directory, record, dtype, tokenizer), True
    if changed:
        try:
            os.makedirs(os.path.dirname(cache_path), exist_ok=True)
            write_json(cache_path, passed)
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
            listed.update(os.path.basename(p) for p, _ in shard_files(directory, record, manifest["dtype"]))
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
