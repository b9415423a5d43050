"""The files and the names the data settings stand for: data.source's files (a path or a glob)
and the metrics' name of each of data.sources."""

from __future__ import annotations

import glob
import os

from jaxpar.config import ConfigError, DataConfig


def data_files(data: DataConfig) -> list[str]:
    """The files a non-stdlib source names (a path or a glob), sorted; error if there are none."""
    source = os.path.expanduser(data.source)
    if os.path.isdir(source):
        text, jsonl = os.path.join(data.source, "*.txt"), os.path.join(data.source, "**", "*.jsonl")
        raise ConfigError(
            f"data.source='{data.source}' is a directory; name its files with a glob, e.g. "
            f"data.source='{text}' or '{jsonl}'"
            ", or give a directory of prepared shards (python -m jaxpar.data prepare SOURCES --out DIR)"
        )
    files = sorted(p for p in glob.glob(source, recursive=True) if os.path.isfile(p))
    if not files:
        raise ConfigError(f"data.source='{data.source}': no such file (or nothing matches the glob)")
    return files


def source_names(data: DataConfig) -> list[str]:
    """The metrics' name of each of data.sources: its `name`, else its directory's name."""
    return [
        s.name if s.name is not None else os.path.basename(os.path.normpath(s.path))
        for s in data.sources or []
    ]
