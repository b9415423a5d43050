"""Training data on grain: documents -> tokens -> packed fixed-length sequences -> batches.

Packing. All documents are tokenized, each followed by an end-of-document token, and laid end to
end in one stream that is cut into sequences of `seq_len` inputs (targets are the inputs shifted
by one). Every token carries the id of its document, which gives, per sequence:

- `segment_ids`: tokens attend only to earlier tokens of the same segment (the model builds a
  causal, same-document mask from them), so packed documents never see each other;
- `positions`: restart at 0 at every document start (and at the sequence start, for a document
  that began in the previous sequence), so rotary positions are positions within the document;
- `loss_mask`: 0 where the target belongs to another document (the end-of-document token
  predicting the next document's first token), or, under data.train_on=assistant, is no target
  token of a conversation or prompt/completion record (jaxpar.corpus.chat: its prompt); 1 elsewhere.
  A source none of whose sequences holds a target is refused, one where some hold none is
  counted in a warning (`check_targets`).

Whole documents (data.packing=whole; the default, wrap, is the above). The same stream is laid
into rows of seq_len + 1 tokens differently (`documents.whole_rows`): a row takes whole documents,
in order, while the next one fits in the room left (a document of exactly that many tokens fits),
and is then padded; the next document begins the next row. Padding is the end-of-document token,
a segment of its own (no real token attends to it, nor it to them) and no target. A document
longer than a row starts a row and is split as wrap splits the stream, consecutive rows sharing
one token, its last piece sharing a row with the documents after it. Next fit in order rather
than best fit: a row is one range of the stream (one read from prepared shards, an index of 16
bytes a row computed in one pass over the document ends, no sort) and documents keep their
order; the cost is more padding than best-fit-decreasing would leave (the README gives both,
measured on conversations).

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
machine, no download), a plain-text file or glob (one document per file), JSONL (one document per
line, in `data.text_field`) or Parquet (column `data.text_field`), `.gz`/`.zst` decompressed; these
are read and packed in memory. A directory of prepared token shards (`python -m jaxpar.data
prepare`, jaxpar.corpus.prepare) is read a sequence at a time instead (jaxpar.corpus.reader), and
the whole `stdlib` prepares itself into a cache on first use: the same samples as packing the same
documents here, with memory that does not grow with the corpus. Tokenizers: bytes (ids 0-255,
end-of-document 256) or a local Hugging Face `tokenizer.json` (`python -m jaxpar.data
train-tokenizer` trains one). Reading sources and the tokenizers live in jaxpar.corpus.documents,
below both this module and jaxpar.corpus.shards.
"""

from __future__ import annotations

import argparse
import errno
import functools
import os
import sys
from dataclasses import dataclass

import grain
import numpy as np

from jaxpar import cli
from jaxpar.config import ConfigError, DataConfig
from jaxpar.corpus import chat, prepare, reader, shards, verify
from jaxpar.corpus.documents import EOD_TOKEN, packed_rows, pad_rows, read_documents, row_index, split_rows

# Tokenizers and documents live in jaxpar.corpus.documents; the two that users of this module have always
# imported from here stay importable from here (the example notebooks do).
from jaxpar.corpus.documents import make_tokenizer as make_tokenizer
from jaxpar.corpus.documents import stdlib_files as stdlib_files
from jaxpar.corpus.sources import source_names

# --- Packing --------------------------------------------------------------------------------


@dataclass
class PackedSequences:
    """Random access to packed sequences of one token stream (a grain data source)."""

    tokens: np.ndarray  # [stream] int32
    doc_ids: np.ndarray  # [stream] int32, the document of each token
    seq_len: int
    targets: np.ndarray | None = None  # [stream] uint8: 1 where a token is a target (None: all)
    packing: str = "wrap"  # data.packing: wrap | whole
    pad_id: int = 0  # the token of a row's padding (whole)

    def __post_init__(self):
        # whole: each row's stream offset and token count (`documents.whole_rows`); wrap: None.
        def ends():  # the documents' ends, as the one part of the stream (read only under whole)
            yield np.append(np.flatnonzero(self.doc_ids[1:] != self.doc_ids[:-1]) + 1, len(self.doc_ids))

        self.rows = row_index(self.packing, ends(), self.seq_len + 1)

    def __len__(self) -> int:
        if self.rows is not None:
            return len(self.rows)
        return (len(self.tokens) - 1) // self.seq_len

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        return self._getitems([index])[0]

    def _getitems(self, indices) -> list[dict[str, np.ndarray]]:
        """Several sequences at once (grain's batched read; see `batch_dataset`)."""
        indices = np.asarray(indices, dtype=np.int64)
        if self.rows is None:
            window = indices[:, None] * self.seq_len + np.arange(self.seq_len + 1)
        else:
            begins, lengths = self.rows[indices].T
            at = np.arange(self.seq_len + 1)
            # Padding positions read the row's first token: `pad_rows` replaces them.
            window = begins[:, None] + np.where(at < lengths[:, None], at, 0)
        docs = self.doc_ids[window]
        starts = np.zeros(docs.shape, dtype=bool)
        starts[:, 1:] = docs[:, 1:] != docs[:, :-1]
        targets = None if self.targets is None else self.targets[window]
        tokens = self.tokens[window]
        if self.rows is not None:
            tokens, starts, targets = pad_rows(tokens, starts, targets, lengths, self.pad_id)
        return split_rows(packed_rows(tokens, starts, targets))


def packed_sample(
    tokens: np.ndarray, docs: np.ndarray, targets: np.ndarray | None = None
) -> dict[str, np.ndarray]:
    """One packed sequence from seq_len + 1 consecutive stream tokens and their documents' ids
    (any increasing numbering): `packed_rows` of one row."""
    starts = np.concatenate([[False], docs[1:] != docs[:-1]])
    return split_rows(packed_rows(tokens[None], starts[None], None if targets is None else targets[None]))[0]


def pack(
    documents: list,
    tokenizer,
    seq_len: int,
    template=None,
    train_on: str = "assistant",
    packing: str = "wrap",
) -> PackedSequences:
    """The documents (texts, and conversation or prompt/completion records: jaxpar.corpus.chat) as one
    packed stream, each followed by the end-of-document token, cut into rows as `packing`
    (data.packing) says; padding (whole) is the end-of-document token. `template`: the
    ChatTemplate for conversations, or a function returning it (called at the first). With
    train_on=assistant the records' prompt tokens are no targets; texts are all targets."""
    if not documents:
        raise ConfigError("data: the source has no documents")
    pieces, ids, masks = [], [], []
    for n, doc in enumerate(documents):
        if isinstance(doc, str):
            toks = np.append(tokenizer.encode(doc), np.int32(tokenizer.eod_id))
            masks.append(np.ones(len(toks), np.uint8))
        else:
            toks, mask, eod_target = chat.encode_record(doc, tokenizer, template)
            toks = np.append(toks, np.int32(tokenizer.eod_id))
            masks.append(np.append(mask, np.uint8(eod_target)))
        pieces.append(toks)
        ids.append(np.full(len(toks), n, dtype=np.int32))
    tokens = np.concatenate(pieces).astype(np.int32)
    records = train_on == "assistant" and any(not isinstance(doc, str) for doc in documents)
    packed = PackedSequences(
        tokens,
        np.concatenate(ids),
        seq_len,
        np.concatenate(masks) if records else None,
        packing=packing,
        pad_id=int(tokenizer.eod_id),
    )
    if len(packed) == 0:
        raise ConfigError(
            f"data: the corpus has {len(tokens)} tokens, fewer than one sequence of train.seq_len={seq_len}"
        )
    return packed


def packed_source(cfg: DataConfig, tokenizer, seq_len: int):
    """What a run trains on: prepared shards (data.source a directory; the whole stdlib, prepared
    into a cache on first use), memory-mapped; else the source's documents, packed in memory."""
    source = os.path.expanduser(cfg.source)
    if cfg.source != "stdlib" and os.path.isdir(source):
        return reader.PreparedSequences(
            source, cfg.tokenizer, seq_len, cfg.max_documents, train_on=cfg.train_on, packing=cfg.packing
        )
    if cfg.source == "stdlib" and cfg.max_documents is None:
        if (directory := prepare.stdlib_prepared(cfg.tokenizer)) is not None:
            return reader.PreparedSequences(directory, cfg.tokenizer, seq_len, packing=cfg.packing)
    template = functools.partial(chat.load_template, cfg.chat_template, cfg.tokenizer)
    return pack(read_documents(cfg), tokenizer, seq_len, functools.cache(template), cfg.train_on, cfg.packing)


# --- Sequences without a target ------------------------------------------------------------------

TARGET_SAMPLE = 4096  # sequences `check_targets` reads: all of a source with fewer, else this many


def _masked(source) -> bool:
    """Whether some of a source's tokens are no target (conversations under data.train_on=
    assistant); plain text and data.train_on=all have none to check."""
    if isinstance(source, PackedSequences):
        return source.targets is not None
    return any(mask is not None for mask in getattr(source, "masks", ()))


def _any_target(source) -> bool:
    """Whether any token of a source is a target: its target mask read until a 1 (a prepared
    shard without a mask is all targets)."""
    if isinstance(source, PackedSequences):
        return bool(source.targets.any())
    for path in source.masks:
        if path is None:
            return True
        with open(path, "rb") as f:
            while chunk := f.read(1 << 24):
                if np.frombuffer(chunk, np.uint8).any():
                    return True
    return False


def check_targets(source, name: str) -> None:
    """Refuses a source (`name`: its setting) none of whose sequences holds a target token: a
    run on it reads loss 0, gradient 0, and learns nothing. Warns, with a count, where some
    sequences hold none (a batch of only such sequences trains nothing): e.g. a conversation
    longer than train.seq_len whose first rows are all prompt. Reads every sequence of a source
    of at most TARGET_SAMPLE, else that many evenly spaced (the count is then of those), and,
    where none of these has a target, the whole target mask. Sources without a mask (plain text,
    data.train_on=all) are not read."""
    if not _masked(source):
        return
    n = len(source)
    rows = np.arange(n) if n <= TARGET_SAMPLE else np.linspace(0, n - 1, TARGET_SAMPLE).astype(np.int64)
    empty = 0
    for lo in range(0, len(rows), 256):
        empty += sum(not row["loss_mask"].any() for row in source._getitems(rows[lo : lo + 256].tolist()))  # noqa: SLF001
    if empty == len(rows) and (n == len(rows) or not _any_target(source)):
        raise ConfigError(
            f"{name}: none of its {n} sequences of train.seq_len={source.seq_len} holds a target "
            "token: under data.train_on=assistant the targets are the assistant replies, and its "
            "records have none (a conversation without an assistant message, or a role that is "
            "not 'assistant'), so training would read loss 0 and learn nothing; give conversations "
            "with assistant replies (`prepare` leaves out those without one, with a count), or set "
            "data.train_on=all"
        )
    if empty:
        counted = (
            f"{empty} of its {n}" if n == len(rows) else f"{empty} of {len(rows)} evenly spaced of its {n}"
        )
        print(
            f"warning: {name}: {counted} sequences of train.seq_len={source.seq_len} hold no target "
            "token (all prompt: a conversation longer than a sequence, its reply further on); they "
            "add nothing to the loss, and a batch of only such sequences trains nothing",
            file=sys.stderr,
        )


# --- The run's chat template ---------------------------------------------------------------------

RUN_TEMPLATE = chat.TEMPLATE_FILE  # the chat template a run trained with, in its run directory


def training_template(cfg: DataConfig):
    """The chat template a run's conversations are rendered with, where the run must keep a copy
    (RUN_DIR/chat_template.jinja, written at the start): the one prepared data.source /
    data.sources recorded in their manifest (their tokens were rendered with it), else
    data.chat_template's; None otherwise (plain text, or the tokenizer's own template, which the
    run finds beside its tokenizer). ConfigError when data.chat_template is another template
    than the prepared data's."""
    paths = [cfg.source] if cfg.sources is None else [s.path for s in cfg.sources]
    recorded = [
        (path, template)
        for path in map(os.path.expanduser, paths)
        if os.path.isfile(os.path.join(path, shards.MANIFEST))
        and (template := shards.read_manifest(path).get("chat_template")) is not None
    ]
    given = None if cfg.chat_template is None else chat.load_template(cfg.chat_template, cfg.tokenizer)
    for path, template in recorded:
        if given is not None and template["source"] != given.source:
            raise ConfigError(
                f"data.chat_template={cfg.chat_template} is not the chat template {path} was "
                f"prepared with ({template['origin']}); leave data.chat_template unset (the "
                "prepared tokens are what is trained on), or prepare the data again with it"
            )
    if given is None and recorded:
        path, template = recorded[0]
        return chat.ChatTemplate(template["source"], template["origin"], chat.special_tokens(cfg.tokenizer))
    return given


def save_run_template(cfg: DataConfig, run_dir: str) -> None:
    """RUN_DIR/chat_template.jinja: the `training_template`, where there is one; where there is
    none, a copy left there by an earlier start is removed (`sample --chat` would render with
    it). Called once the resume is decided: a copy the earlier steps were rendered with and
    this start changes was refused, or kept aside (jaxpar.run.rundir.keep_record) first."""
    path = os.path.join(run_dir, RUN_TEMPLATE)
    if (template := training_template(cfg)) is not None:
        with open(path, "w", encoding="utf-8") as f:
            f.write(template.source)
    elif os.path.isfile(path):
        os.remove(path)


def run_template(run_dir: str, cfg: DataConfig):
    """The chat template of a trained run (for `sample --chat`): the copy in its run directory,
    else the one its data names (`training_template`), else its tokenizer's own; ConfigError
    when there is none. The tokenizer's special tokens come with it."""
    path = os.path.join(run_dir, RUN_TEMPLATE)
    if os.path.isfile(path):
        return chat.load_template(path, cfg.tokenizer, "the chat template the run kept")
    return training_template(cfg) or chat.load_template(None, cfg.tokenizer)


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
        streams = [
            sample_stream(source, seed=_source_seed(seed, i), shuffle=shuffle)
            for i, source in enumerate(self.sources)
        ]
        return grain.MapDataset.mix(streams, weights=list(self.proportions))

    def counts(self, n: int) -> dict[str, int]:
        """Samples each source gave to the first `n` samples of the stream."""
        return dict(zip(self.names, mixture_counts(self.proportions, n)))


def source_counter(cfg: DataConfig):
    """For a mixture (data.sources): n -> {source name: how many of the first n global samples
    came from it}; None for a single source. Needs only the config, not the data."""
    if cfg.sources is None:
        return None
    proportions = mixture_proportions([s.weight for s in cfg.sources])
    names = source_names(cfg)
    return lambda n: dict(zip(names, mixture_counts(proportions, n)))


def training_source(cfg: DataConfig, tokenizer, seq_len: int):
    """What a run trains on: `packed_source` of data.source, or the Mixture of data.sources."""
    if cfg.chat_template is not None:
        training_template(cfg)  # the prepared data's chat template, if any, is data.chat_template
    if cfg.sources is None:
        packed = packed_source(cfg, tokenizer, seq_len)
        check_targets(packed, f"data.source={cfg.source}")
        return packed
    sources = [
        reader.PreparedSequences(
            os.path.expanduser(s.path),
            cfg.tokenizer,
            seq_len,
            cfg.max_documents,
            train_on=cfg.train_on,
            packing=cfg.packing,
        )
        for s in cfg.sources
    ]
    for i, (s, source) in enumerate(zip(cfg.sources, sources)):
        check_targets(source, f"data.sources[{i}].path={s.path}")
    return Mixture(sources, mixture_proportions([s.weight for s in cfg.sources]), source_names(cfg))


EVAL_SEED = 0  # the validation split's shuffle: the same eval batches whatever train.seed is


def eval_dataset(
    cfg: DataConfig,
    seq_len: int,
    *,
    global_batch: int,
    batches: int,
    process_index: int = 0,
    process_count: int = 1,
) -> grain.MapDataset:
    """The `batches` evaluation batches (this process's rows of each), from the val split of the
    prepared shards (`prepare --val-fraction`; of every source of a mixture, mixed in the same
    proportions): the split's sequences shuffled with a fixed seed, without repeating any. The
    same batches every time it is read from the start."""
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
                "or set train.eval_every=0"
            )
        vals.append(
            reader.PreparedSequences(
                directory, cfg.tokenizer, seq_len, split="val", train_on=cfg.train_on, packing=cfg.packing
            )
        )
        check_targets(vals[-1], f"the val split of {key}={directory}")
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
            + "prepare it again with a larger --val-fraction"
        )
    source = vals[0] if cfg.sources is None else Mixture(vals, proportions, [v.directory for v in vals])
    return batch_dataset(
        source,
        global_batch=global_batch,
        seed=EVAL_SEED,
        shuffle=cfg.shuffle,
        process_index=process_index,
        process_count=process_count,
    )[:batches]


# --- The per-process batch stream ---------------------------------------------------------


def sample_stream(packed, *, seed: int, shuffle: bool = True) -> grain.MapDataset:
    """The endless sequence stream of one source: its sequences shuffled with `seed`, a new
    order every epoch (or in order, without `shuffle`)."""
    stream = grain.MapDataset.source(packed)
    if shuffle:
        stream = stream.shuffle(seed=seed)
    return stream.repeat()


def batch_dataset(
    packed,
    *,
    global_batch: int,
    seed: int,
    shuffle: bool = True,
    process_index: int = 0,
    process_count: int = 1,
) -> grain.MapDataset:
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
        vocab_size=vocab_size,
        special_tokens=[EOD_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(documents, trainer=trainer)
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    tok.save(out)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    commands = {
        "train-tokenizer": _train_tokenizer_command,
        "prepare": _prepare_command,
        "verify": _verify_command,
    }
    return cli.run(lambda: commands[args.command](args), prefix="error")


def _parser() -> argparse.ArgumentParser:
    """The command line: train-tokenizer, prepare and verify."""
    parser = argparse.ArgumentParser(prog="python -m jaxpar.data")
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train-tokenizer", help="train a byte-level BPE tokenizer.json")
    train.add_argument("--out", required=True, help="where to write tokenizer.json")
    train.add_argument("--vocab-size", type=int, default=4096)
    train.add_argument("--source", default="stdlib", help="stdlib, or a path/glob of .txt/.jsonl")
    train.add_argument("--text-field", default="text")
    train.add_argument("--max-documents", type=int, default=None)
    train.add_argument(
        "--errors",
        default="strict",
        choices=["strict", "replace", "skip"],
        help="a document that is not text: stop, replace bad bytes, or skip it",
    )
    prep = sub.add_parser(
        "prepare",
        help="tokenize sources into memory-mapped token shards (train on them with data.source=DIR)",
    )
    prep.add_argument(
        "sources",
        nargs="+",
        metavar="SOURCE",
        help="stdlib, or a file or glob: text (one document per file), JSONL (.jsonl/"
        ".json, one per line), Parquet; .gz and .zst are decompressed. A JSONL line or Parquet "
        "row without the text field may be a conversation ('messages') or a 'prompt' and "
        "'completion' (jaxpar.corpus.chat)",
    )
    prep.add_argument("--out", required=True, help="the directory of shards (resumed if unfinished)")
    prep.add_argument("--tokenizer", default="byte", help="byte, or a tokenizer.json")
    prep.add_argument("--text-field", default="text", help="the JSONL field / Parquet column")
    prep.add_argument("--format", default="auto", choices=["auto", "text", "jsonl", "parquet"])
    prep.add_argument(
        "--errors",
        default="strict",
        choices=["strict", "replace", "skip"],
        help="a document that is not text: stop, replace bad bytes, or skip it",
    )
    prep.add_argument(
        "--val-fraction",
        type=float,
        default=0.0,
        help="documents carved off into the val split (chosen by a hash of the text)",
    )
    prep.add_argument("--max-documents", type=int, default=None)
    prep.add_argument(
        "--chat-template",
        default=None,
        metavar="FILE",
        help="the chat template of conversation records: a .jinja file, or 'simple' (jaxpar's own); "
        "default: the tokenizer's (chat_template.jinja / tokenizer_config.json beside it)",
    )
    prep.add_argument(
        "--shard-tokens",
        type=int,
        default=None,
        help="tokens per shard (cut at a document end); default 2**26",
    )
    check = sub.add_parser(
        "verify",
        help="read prepared shards whole and check them against "
        "their manifest (hashes, document index, token ids)",
    )
    check.add_argument("directories", nargs="+", metavar="DIR", help="a directory of shards")
    return parser


def _train_tokenizer_command(args) -> int:
    if args.vocab_size < 258:
        raise ConfigError(
            f"--vocab-size={args.vocab_size}: a byte-level BPE needs at least 258 "
            "(256 bytes, the end-of-document token, one merge); e.g. 4096"
        )
    if args.max_documents is not None and args.max_documents < 1:
        raise ConfigError(f"--max-documents={args.max_documents}: must be at least 1")
    cfg = DataConfig(
        source=args.source, text_field=args.text_field, max_documents=args.max_documents, errors=args.errors
    )
    docs = [doc if isinstance(doc, str) else chat.record_text(doc) for doc in read_documents(cfg)]
    train_tokenizer(docs, args.vocab_size, args.out)
    print(f"wrote {args.out}: vocabulary {args.vocab_size}, trained on {len(docs)} documents")
    return 0


def _verify_command(args) -> int:
    """`verify`: each directory of shards read whole and checked (jaxpar.corpus.verify.verify)."""
    for directory in args.directories:
        print(verify.verify(directory))
    return 0


def _prepare_command(args) -> int:
    """`prepare`: jaxpar.corpus.prepare.prepare; a full disk is exit 1 and Ctrl-C 130, each one line
    saying what is kept (the same command resumes)."""
    if args.tokenizer != "byte" and not os.path.isfile(args.tokenizer):
        raise ConfigError(
            f"--tokenizer={args.tokenizer} does not exist; use 'byte' or the path of a tokenizer.json"
        )
    try:
        prepare.prepare(
            args.sources,
            args.out,
            tokenizer=args.tokenizer,
            fmt=args.format,
            text_field=args.text_field,
            errors=args.errors,
            val_fraction=args.val_fraction,
            max_documents=args.max_documents,
            shard_tokens=args.shard_tokens or prepare.DEFAULT_SHARD_TOKENS,
            chat_template=args.chat_template,
        )
    except OSError as e:
        if e.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        print(f"error: {prepare.no_space_message(args.out)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(
            f"\ninterrupted: the complete shards in {args.out} are kept; the same command resumes from them",
            file=sys.stderr,
        )
        return 130
    return 0
