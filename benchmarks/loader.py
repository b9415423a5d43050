"""`python -m benchmarks.loader [--corpus-mb 300] [--bpe-mb 30] [--steps 300] [--repeats 3]
[--workers 0,1,2] [--json PATH] [--keep DIR]`: time the data path on this machine's CPU cores -- preparing
token shards (`python -m jaxpar.data prepare`) and the loader that training reads them with.

1. A JSONL corpus of --corpus-mb MiB is written into a temporary directory: this interpreter's
   standard library `.py` files, one document each, repeated until the size is reached (real text,
   no download).
2. Preparation, timed as `jaxpar.corpus.prepare.prepare` reports it (tokens written / seconds, hashing the
   input included): the whole corpus with the byte tokenizer (tokens = bytes, uint16 shards of
   64 Mi tokens), and the first --bpe-mb MiB of it with a 4096-entry byte-level BPE trained here
   on 4 MiB of it (the tokenizers library's batch encoding, on every core).
3. The loader: the batches of one process (`jaxpar.corpus.data.batch_dataset` over
   `jaxpar.corpus.reader.PreparedSequences` of the byte shards: shuffled windows, packing fields, this
   process's rows), read through grain's iterator as `python -m jaxpar.train` reads them
   (`jaxpar.corpus.data.iter_dataset`: workers 0), and with grain's worker processes on top
   (`mp_prefetch`, workers 1 and 2). After 20 warm-up batches (worker start-up included),
   --steps batches are timed; tokens/s = batches x rows x seq_len / seconds, the best of
   --repeats runs (the machine may be shared). Two shapes: seq 1024 x 12 rows
   (configs/gpt2-124m.yaml on one GPU) and seq 256 x 16 rows (the default job). Also the
   batched reads alone (PreparedSequences._getitems of `rows` random sequences, no grain). The
   shards were just written, so they are read from the page cache (a corpus larger than memory
   reads from the disk: 2 bytes a token, one random read of seq_len + 1 tokens a row).

The target: at least 2 million tokens/s per process (an H100 trains configs/gpt2-124m.yaml at
about 0.5 million tokens/s); the bench prints whether the training path (workers 0) reaches it
at each shape. Results: a table on stdout, JSON in benchmarks/results/loader-<cpu>-<N>cores.json;
the machine's load average is recorded with them (numbers from a shared machine are noisy).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

RESULTS_DIR = Path(__file__).resolve().parent / "results"
TARGET_TOKENS_PER_SEC = 2e6  # per process: 4x what an H100 trains GPT-2 124M at (~0.5 M/s)
SHAPES = [(1024, 12), (256, 16)]  # (seq_len, rows per process): gpt2-124m on one GPU; the default job
WARMUP_BATCHES = 20


def cpu_name() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def software_versions() -> dict[str, str]:
    from importlib.metadata import version

    return {
        "python": platform.python_version(),
        **{name: version(name) for name in ("grain", "numpy", "tokenizers")},
    }


def default_json_path(cpu: str) -> Path:
    """benchmarks/results/loader-<cpu>-<cores>cores.json"""
    name = re.sub(r"\((r|tm)\)|\b(cpu|processor)\b", "", cpu.lower())
    slug = re.sub(r"[^a-z0-9]+", "-", name).strip("-")
    return RESULTS_DIR / f"loader-{slug}-{os.cpu_count()}cores.json"


def write_corpus(path: Path, megabytes: int) -> int:
    """JSONL of stdlib files (one document each), repeated up to `megabytes` MiB; returns bytes."""
    from jaxpar.corpus.data import stdlib_files

    texts = [Path(p).read_bytes().decode("utf-8", errors="replace") for p in stdlib_files()]
    lines = [json.dumps({"text": t}) + "\n" for t in texts]
    written, limit = 0, megabytes << 20
    with open(path, "w") as f:
        while written < limit:
            for line in lines:
                f.write(line)
                written += len(line.encode())
                if written >= limit:
                    break
    return written


def timed_prepare(sources: list[str], out: str, tokenizer: str) -> dict:
    from jaxpar.corpus import prepare

    messages = []
    start = time.perf_counter()
    manifest = prepare.prepare(sources, out, tokenizer=tokenizer, progress=False, log=messages.append)
    seconds = time.perf_counter() - start
    tokens = manifest["splits"]["train"]["tokens"]
    text_bytes = sum(s["bytes"] for s in manifest["sources"])
    return {
        "tokenizer": "byte" if tokenizer == "byte" else "bpe-4096",
        "input_bytes": text_bytes,
        "tokens": tokens,
        "shards": len(manifest["splits"]["train"]["shards"]),
        "shard_bytes": sum(
            os.path.getsize(os.path.join(out, f"{r['name']}.bin"))
            for r in manifest["splits"]["train"]["shards"]
        ),
        "seconds": seconds,
        "tokens_per_sec": tokens / seconds,
        "input_megabytes_per_sec": text_bytes / seconds / 2**20,
        "log": messages[-1],
    }


def sample_rate(directory: str, seq_len: int, rows: int, count: int = 4000) -> float:
    """Tokens/s of PreparedSequences' batched reads alone (`rows` random sequences a call, as the
    loader asks for them), after one pass over the same sequences."""
    from jaxpar.corpus.reader import PreparedSequences

    source = PreparedSequences(directory, "byte", seq_len)
    indices = np.random.default_rng(0).integers(0, len(source), count).tolist()
    batches = [indices[i : i + rows] for i in range(0, count - rows + 1, rows)]
    for batch in batches:
        source._getitems(batch)
    start = time.perf_counter()
    for batch in batches:
        source._getitems(batch)
    return len(batches) * rows * seq_len / (time.perf_counter() - start)


def loader_rate(directory: str, seq_len: int, rows: int, steps: int, workers: int) -> float:
    """Tokens/s of one process's batches through grain's iterator (with `workers` processes)."""
    import grain

    from jaxpar.corpus.data import batch_dataset, iter_dataset
    from jaxpar.corpus.reader import PreparedSequences

    dataset = iter_dataset(
        batch_dataset(PreparedSequences(directory, "byte", seq_len), global_batch=rows, seed=0)
    )
    if workers:
        dataset = dataset.mp_prefetch(grain.MultiprocessingOptions(num_workers=workers))
    iterator = iter(dataset)
    for _ in range(WARMUP_BATCHES):
        next(iterator)
    start = time.perf_counter()
    for _ in range(steps):
        batch = next(iterator)
    seconds = time.perf_counter() - start
    assert batch["inputs"].shape == (rows, seq_len)
    del iterator
    return steps * rows * seq_len / seconds


def parse_args(argv):
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.loader",
        description="Time shard preparation and the loader (see the module docstring).",
    )
    parser.add_argument("--corpus-mb", type=int, default=300, help="MiB of JSONL text (default 300)")
    parser.add_argument(
        "--bpe-mb",
        type=int,
        default=30,
        help="MiB of it prepared with the BPE tokenizer (default 30; 0 = skip)",
    )
    parser.add_argument("--steps", type=int, default=300, help="timed batches per loader run")
    parser.add_argument("--repeats", type=int, default=3, help="loader runs per setting; the best counts")
    parser.add_argument("--workers", default="0,1,2", help="grain worker processes to try, e.g. 0,2")
    parser.add_argument(
        "--json", metavar="PATH", help="default benchmarks/results/loader-<cpu>-<N>cores.json"
    )
    parser.add_argument(
        "--keep",
        metavar="DIR",
        help="work in DIR and keep it (default: a temporary directory, removed at the end)",
    )
    args = parser.parse_args(argv)
    if (
        args.corpus_mb < 1
        or args.bpe_mb < 0
        or args.steps < 1
        or args.bpe_mb > args.corpus_mb
        or args.repeats < 1
    ):
        parser.error("--corpus-mb >= 1, 0 <= --bpe-mb <= --corpus-mb, --steps >= 1, --repeats >= 1")
    args.workers = [int(w) for w in args.workers.split(",")]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if any(args.workers):
        from absl import flags

        if not flags.FLAGS.is_parsed():  # grain's worker processes read absl flags
            flags.FLAGS.mark_as_parsed()
    from jaxpar.corpus.data import train_tokenizer

    root = Path(args.keep or tempfile.mkdtemp(prefix="jaxpar-loader-bench-"))
    root.mkdir(parents=True, exist_ok=True)
    result = {
        "machine": {
            "cpu": cpu_name(),
            "cores": os.cpu_count(),
            "platform": platform.platform(),
            "load_average_before": os.getloadavg(),
        },
        "timestamp": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "software": software_versions(),
        "target_tokens_per_sec": TARGET_TOKENS_PER_SEC,
        "settings": {k: getattr(args, k) for k in ("corpus_mb", "bpe_mb", "steps", "repeats", "workers")},
    }
    try:
        corpus = root / "corpus.jsonl"
        print(f"writing {args.corpus_mb} MiB of JSONL into {root} ...", file=sys.stderr)
        write_corpus(corpus, args.corpus_mb)
        byte_dir = str(root / "byte")
        shutil.rmtree(byte_dir, ignore_errors=True)
        result["prepare"] = [timed_prepare([str(corpus)], byte_dir, "byte")]
        if args.bpe_mb:
            sample, part = root / "sample.jsonl", root / "part.jsonl"
            write_corpus(part, args.bpe_mb)
            with open(corpus) as f, open(sample, "w") as out:  # 4 MiB to train the BPE on
                size = 0
                for line in f:
                    out.write(line)
                    size += len(line)
                    if size >= 4 << 20:
                        break
            docs = [json.loads(line)["text"] for line in open(sample)]
            tokenizer = str(root / "tokenizer.json")
            train_tokenizer(docs, 4096, tokenizer)
            bpe_dir = str(root / "bpe")
            shutil.rmtree(bpe_dir, ignore_errors=True)
            result["prepare"].append(timed_prepare([str(part)], bpe_dir, tokenizer))
        result["loader"] = []
        for seq_len, rows in SHAPES:
            entry = {
                "seq_len": seq_len,
                "rows": rows,
                "samples_alone_tokens_per_sec": sample_rate(byte_dir, seq_len, rows),
            }
            for workers in args.workers:
                entry[f"workers_{workers}_tokens_per_sec"] = max(
                    loader_rate(byte_dir, seq_len, rows, args.steps, workers) for _ in range(args.repeats)
                )
            result["loader"].append(entry)
            print(
                f"seq {seq_len} x {rows}: "
                + ", ".join(f"{k} {v / 1e6:.2f} M" for k, v in entry.items() if k.endswith("per_sec")),
                file=sys.stderr,
            )
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    result["machine"]["load_average_after"] = os.getloadavg()
    print(format_table(result, args.workers))
    path = Path(args.json) if args.json else default_json_path(result["machine"]["cpu"])
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {path}")
    return 0


def format_table(r: dict, workers: list[int]) -> str:
    m = r["machine"]
    lines = [
        f"machine: {m['cpu']}, {m['cores']} cores; load average {m['load_average_before'][0]:.1f} "
        f"before, {m['load_average_after'][0]:.1f} after",
        "",
        "preparation (python -m jaxpar.data prepare, all cores):",
        "| tokenizer | input | tokens | shards | seconds | tokens/s | input MiB/s |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for p in r["prepare"]:
        lines.append(
            f"| {p['tokenizer']} | {p['input_bytes'] / 2**20:,.0f} MiB | {p['tokens']:,} | "
            f"{p['shards']} ({p['shard_bytes'] / 2**20:,.0f} MiB) | {p['seconds']:.1f} | "
            f"{p['tokens_per_sec'] / 1e6:.2f} M | {p['input_megabytes_per_sec']:.1f} |"
        )
    lines += [
        "",
        "loader (one process, M tokens/s, best of the repeats; workers = grain worker processes):",
        "| seq x rows | batched reads alone | " + " | ".join(f"workers {w}" for w in workers) + " |",
        "| --- | --- | " + " | ".join("---" for _ in workers) + " |",
    ]
    for e in r["loader"]:
        lines.append(
            f"| {e['seq_len']} x {e['rows']} | {e['samples_alone_tokens_per_sec'] / 1e6:.2f} | "
            + " | ".join(f"{e[f'workers_{w}_tokens_per_sec'] / 1e6:.2f}" for w in workers)
            + " |"
        )
    lines.append("")
    target = r["target_tokens_per_sec"]
    for e in r["loader"]:
        rate = e.get("workers_0_tokens_per_sec")
        if rate is None:
            continue
        verdict = "reaches" if rate >= target else "does NOT reach"
        lines.append(
            f"seq {e['seq_len']}: the training path (grain iterator, no workers) gives "
            f"{rate / 1e6:.2f} M tokens/s per process: {verdict} the target of "
            f"{target / 1e6:.0f} M tokens/s"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
