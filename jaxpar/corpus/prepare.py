"""Preparing token shards: `python -m jaxpar.data prepare SOURCES --tokenizer T --out DIR` reads
text files, globs, JSONL (also .gz/.zst) and Parquet (column `--text-field`), tokenizes them on
all cores (the tokenizers library's batch encoding) and writes the shards, their document indexes
and target masks, and the manifest into DIR (the format: jaxpar.corpus.shards).

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
standard library's files and the tokenizer (`stdlib_prepared`).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import shutil
import sys
import time

import numpy as np

from jaxpar.config import ConfigError, DataConfig
from jaxpar.corpus import chat
from jaxpar.corpus.documents import (
    Skipped,
    iter_documents,
    make_tokenizer,
    parquet_file,
    source_entries,
    stdlib_files,
)
from jaxpar.corpus.shards import (
    FORMAT,
    MANIFEST,
    MASKED_VERSION,
    PLAN,
    VERSION,
    cache_root,
    file_sha256,
    read_json,
    shard_problem,
    token_dtype,
    tokenizer_identity,
    write_json,
)

DEFAULT_SHARD_TOKENS = 1 << 26  # 64 Mi tokens: 128 MiB shards of uint16
_BATCH_BYTES = 4 << 20  # text per batch handed to the tokenizer
_BATCH_DOCS = 4096
_FLUSH_TOKENS = 1 << 20  # tokens held before a write


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


# --- Preparing ----------------------------------------------------------------------------------


def _complete_parts(out: str, plan: dict) -> list[dict]:
    """The shards a previous run finished (consecutive from 0, files of the recorded sizes); the
    files of any others, and temporary files, are removed."""
    parts = []
    while os.path.isfile(path := os.path.join(out, f"part-{len(parts):05d}.json")):
        try:
            part = read_json(path)
        except ConfigError:
            break
        if any(shard_problem(out, r, plan["dtype"]) for r in part["splits"].values()):
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
    `out` (see the module docstring; the files are jaxpar.corpus.shards'); returns the manifest.
    Bad input is a ConfigError naming the file, raised before anything is written where it can be
    checked up front."""
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
        write_json(os.path.join(out, PLAN), plan)
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
        manifest = read_json(manifest_path)
        old = {k: manifest.get(k) for k in plan if k != "version"}  # a masked one's is MASKED_VERSION
        if old == {k: v for k, v in plan.items() if k != "version"}:
            for split in manifest["splits"].values():
                for record in split["shards"]:
                    if (problem := shard_problem(out, record, plan["dtype"])) is not None:
                        raise ConfigError(f"{problem}; remove {out} and prepare it again")
            log(f"{out} is up to date ({manifest['splits']['train']['tokens']} training tokens)")
            return manifest
        raise ConfigError(
            f"{manifest_path}: {out} already holds shards prepared from other input "
            f"({_different(old, plan)} differ); remove it or give another --out"
        )
    if os.path.isfile(plan_path):
        if (old := read_json(plan_path)) != plan:
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
        write_json(os.path.join(out, f"part-{k:05d}.json"), part)
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
    write_json(os.path.join(out, MANIFEST), manifest)
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


# --- The default source, prepared on first use --------------------------------------------------


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
