"""Reading prepared token shards (jaxpar.corpus.shards) a sequence at a time: `PreparedSequences`,
the grain data source a run trains on, verified (jaxpar.corpus.verify) before it reads.
"""

from __future__ import annotations

import bisect
import os

import numpy as np

from jaxpar.config import ConfigError
from jaxpar.corpus.documents import packed_rows, pad_rows, row_index, split_rows
from jaxpar.corpus.shards import MANIFEST, map_index, read_manifest, shard_files, tokenizer_identity
from jaxpar.corpus.verify import check_tokenizer, verify_shards


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
            (bin_path, _), (idx_path, _), *mask_file = shard_files(directory, record, dtype)
            n_docs, n_tokens = record["documents"], record["tokens"]
            if n_docs == 0:
                continue
            ends = map_index(idx_path, "<i8")
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
