"""Checkpoints on orbax: asynchronous saves, resuming from the newest intact one, any mesh.

One checkpoint is one directory `<checkpoint dir>/<step>/` (`checkpoint_dir(run_dir)` is
`<run_dir>/checkpoints`) holding the train state in two orbax items, and the data iterator's place:

    params/                        the train state's "params", an orbax PyTree (OCDBT + zarr3)
    train_state/                   the rest of the train state (opt_state and the step counters), likewise.
                                   Every process writes the shards it owns; nothing is gathered.
    data/                          JSON: {"step": step, "data": the grain iterator's get_state()}
    jaxpar_manifest.json           every file of the items above with its size and CRC-32

Saving is asynchronous (`CheckpointManager` with async checkpointing): `save` returns once the
arrays are copied to host memory, and the writing goes on in a background thread while training
continues. Orbax writes into `<step>.orbax-checkpoint-tmp` and renames it to `<step>` only when
every process has finished, so a run killed mid-save leaves a temporary directory, never a
half-written `<step>`. Just before that rename our manifest is written into the directory, so the
manifest is part of the same atomic commit.

Corruption. A committed checkpoint can still go bad afterwards (a file deleted, truncated or
garbled on disk). `latest_valid_step` checks every file against the manifest (existence, size,
and a CRC-32 of the bytes) and skips, with a warning that names the step, any checkpoint that
fails, or that has no manifest, or that was never committed; it returns the newest one that
passes. The params are an item of their own so that `python -m jaxpar.export` (or a fine-tune
with a fresh optimizer) reads them alone.

Restoring onto another layout. Every array is restored straight into the sharding it is given
(`jax.ShapeDtypeStruct(shape, dtype, sharding=...)` targets), whatever mesh or device count wrote
it: each process reads only the slices its devices own. Before any array is read, the saved
shapes are checked against the requested ones; a mismatch raises `CheckpointMismatchError` (a
`ConfigError`, so the CLI prints it and exits with code 2) naming the parameter and both shapes.

Manifests use ordinary file-system calls, so the checkpoint directory is a local or network file
system path (not a gs:// URL).
"""

from __future__ import annotations

import functools
import glob
import hashlib
import json
import logging
import os
import re
import warnings
import zlib
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from jaxpar.config import ConfigError

PARAMS_ITEM = "params"  # state["params"]
REST_ITEM = "train_state"  # every other entry: opt_state, step, skipped_steps, first_bad_step
DATA_ITEM = "data"  # JSON: {"step": int, "data": the data iterator's state}
MANIFEST = "jaxpar_manifest.json"
TMP_SUFFIX = ".orbax-checkpoint-tmp"  # orbax's temporary directory, renamed on commit
_CHUNK = 16 << 20


class CheckpointMismatchError(ConfigError):
    """The checkpoint holds a model of another shape (or another set of parameters)."""


class CheckpointNotFoundError(ConfigError, FileNotFoundError):
    """A checkpoint step asked for by name does not exist or cannot be used: a setting to change
    (a ConfigError, exit code 2), and a FileNotFoundError to the code that catches that."""


class CheckpointWarning(UserWarning):
    """A checkpoint was skipped because it is incomplete or corrupted."""


def checkpoint_dir(run_dir: str) -> str:
    """Where a run keeps its checkpoints: `<run_dir>/checkpoints`."""
    return os.path.join(os.path.abspath(run_dir), "checkpoints")


def list_steps(directory: str) -> tuple[list[int], list[int]]:
    """(committed steps, steps whose save never committed) in a checkpoint directory, oldest
    first, read from the directory names alone (orbax renames `<step>.orbax-checkpoint-tmp...`
    to `<step>` on commit)."""
    if not os.path.isdir(directory):
        return [], []
    names = os.listdir(directory)
    committed = sorted(int(n) for n in names if n.isdigit() and os.path.isdir(os.path.join(directory, n)))
    pattern = re.compile(r"^(\d+)" + re.escape(TMP_SUFFIX))
    unfinished = sorted({int(m.group(1)) for n in names if (m := pattern.match(n))})
    return committed, unfinished


# --- Manifests ------------------------------------------------------------------------------


def _crc32(path: str) -> int:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
    return crc


def _item_files(step_dir: str) -> list[str]:
    """Files of the items (sub-directories), relative to `step_dir`. Files at the top level
    (orbax's step metadata, commit marker, our manifest) are rewritten around commit time."""
    files = []
    for root, _, names in os.walk(step_dir):
        if os.path.samefile(root, step_dir):
            continue
        files += [os.path.relpath(os.path.join(root, n), step_dir) for n in names]
    return sorted(files)


def write_manifest(step_dir: str, step: int) -> None:
    """Records the size and CRC-32 of every item file under `step_dir` (written atomically)."""
    files = {}
    for rel in _item_files(step_dir):
        path = os.path.join(step_dir, rel)
        files[rel] = {"size": os.path.getsize(path), "crc32": _crc32(path)}
    tmp = os.path.join(step_dir, MANIFEST + ".tmp")
    with open(tmp, "w") as f:
        json.dump({"format": 1, "step": step, "files": files}, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(step_dir, MANIFEST))


def manifest_problem(step_dir: str, checksums: bool = True) -> str | None:
    """Why the checkpoint in `step_dir` does not match its manifest, or None if it does."""
    try:
        with open(os.path.join(step_dir, MANIFEST)) as f:
            files = json.load(f)["files"]
    except FileNotFoundError:
        return f"it has no {MANIFEST} (its save did not finish)"
    except (OSError, ValueError, KeyError) as e:
        return f"its {MANIFEST} is unreadable ({e})"
    for rel, want in files.items():
        path = os.path.join(step_dir, rel)
        if not os.path.isfile(path):
            return f"{rel} is missing"
        size = os.path.getsize(path)
        if size != want["size"]:
            return f"{rel} has {size} bytes but {want['size']} were written"
        if checksums and _crc32(path) != want["crc32"]:
            return f"{rel} does not match its checksum (garbled)"
    return None


def params_identity(step_dir: str) -> str | None:
    """A digest of what the manifest of the checkpoint in `step_dir` records for its params item
    (each file's name, size and CRC-32): cheap to read, the same for as long as that checkpoint
    is unchanged, and another one for a checkpoint saved again at that step (orbax names the
    files anew, and other weights change their CRCs). None without a readable manifest."""
    try:
        with open(os.path.join(step_dir, MANIFEST)) as f:
            files = json.load(f)["files"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    params = {rel: entry for rel, entry in files.items() if rel.split(os.sep, 1)[0] == PARAMS_ITEM}
    return hashlib.sha256(json.dumps(params, sort_keys=True).encode()).hexdigest()[:16]


# --- Shapes -----------------------------------------------------------------------------------


def _key_name(entry) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(entry, attr):
            return str(getattr(entry, attr))
    return str(entry)


def _leaf_shapes(tree, prefix: str) -> dict[str, tuple]:
    """{"params.blocks.attn.wq": shape, ...} for the array leaves of a tree (values or metadata)."""
    leaves, _ = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: hasattr(x, "shape"))
    return {
        ".".join([*prefix, *map(_key_name, path)]): tuple(leaf.shape)
        for path, leaf in leaves
        if hasattr(leaf, "shape")
    }


def _shape_problems(saved: dict[str, tuple], wanted: dict[str, tuple]) -> list[str]:
    problems = [
        f"{name}: checkpoint has shape {saved[name]}, the model has shape {shape}"
        for name, shape in wanted.items()
        if name in saved and saved[name] != shape
    ]
    problems += [
        f"{name}: the model has shape {shape}, the checkpoint has no such parameter"
        for name, shape in wanted.items()
        if name not in saved
    ]
    problems += [
        f"{name}: the checkpoint has shape {shape}, the model has no such parameter"
        for name, shape in saved.items()
        if name not in wanted
    ]
    return problems


# --- The checkpointer -------------------------------------------------------------------------


@functools.cache
def _whole_array_saves() -> None:
    """Orbax's jax.Array handler, made to write each replicated array whole from replica 0
    instead of splitting its write among the replicas (`use_replica_parallel`). Orbax keeps that
    split on by default, and turns it off itself on GPUs, but only where JAX_PLATFORMS names
    them. In one process it copies a slice of every replicated array off each replica first, one
    compiled slice program per array shape: a 4-step tiny run with two saves (CPU) took 9.1-9.7 s
    with it, 6.8-7.8 s without. Left on on TPU, and in runs of several processes, whose
    checkpoints tests/test_multiprocess.py checks with it (turned off there, a two-process run
    failed on a missing ocdbt.process_1 directory). The handler is process-wide (orbax's
    registry), registered once (functools.cache), and otherwise orbax's default (its array
    metadata store). Should a later orbax move what this needs, its default stays."""
    if jax.process_count() > 1 or jax.devices()[0].platform == "tpu":
        return
    try:
        from orbax.checkpoint._src.metadata.array_metadata_store import Store

        handler = ocp.type_handlers.ArrayHandler(array_metadata_store=Store(), use_replica_parallel=False)
    except (ImportError, TypeError):  # another orbax: keep its default
        return
    absl = logging.getLogger("absl")  # orbax warns of the override it was asked for
    level = absl.level
    absl.setLevel(logging.ERROR)
    try:
        ocp.type_handlers.register_type_handler(jax.Array, handler, override=True)
    finally:
        absl.setLevel(level)


class Checkpointer:
    """Saves the train state every `every` steps (asynchronously), keeps the newest `keep`, and
    restores the newest intact checkpoint onto any mesh.

    `keep <= 0` keeps every checkpoint; `every <= 0` saves only when `save(..., force=True)`.
    `read_only=True` opens an existing directory for restoring only (used by the exporter).
    `checksums=False` checks file sizes only (faster for very large checkpoints).
    """

    def __init__(
        self,
        directory: str,
        *,
        keep: int = 3,
        every: int = 0,
        read_only: bool = False,
        checksums: bool = True,
        verified: dict[int, str | None] | None = None,
    ):
        self.directory = os.path.abspath(directory)
        self.every = every
        self.checksums = checksums
        self._pending_step: int | None = None  # the save orbax is writing now (one at a time)
        self._saved: set[int] = set()  # steps this process saved
        # Verified steps -> problem (None: intact); `verified` passes on checks already made.
        self._problems: dict[int, str | None] = dict(verified or {})
        # Temporary directories of saves that never committed (killed runs); orbax removes them
        # when the manager opens, so they are noted first, for the warnings.
        self._unfinished = self._find_unfinished()
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep if keep > 0 else None,
            enable_async_checkpointing=True,
            async_options=None
            if read_only
            else ocp.AsyncOptions(post_finalization_callback=self._write_pending_manifest),
            cleanup_tmp_directories=not read_only,
            create=not read_only,
            read_only=read_only,
        )
        _whole_array_saves()
        handlers = {
            PARAMS_ITEM: ocp.StandardCheckpointHandler(),
            REST_ITEM: ocp.StandardCheckpointHandler(),
            DATA_ITEM: ocp.JsonCheckpointHandler(),
        }
        self._manager = ocp.CheckpointManager(self.directory, options=options, item_handlers=handlers)

    # Saving --------------------------------------------------------------------------------

    def should_save(self, step: int) -> bool:
        return self.every > 0 and step % self.every == 0

    def save(self, step: int, state: dict, data_state: dict | None, *, force: bool = False) -> bool:
        """Starts saving `state` (params, opt_state, step counters) and the data iterator's state
        at `step` if `step % every == 0` or `force`; returns whether a save started.

        Returns once the arrays are copied off the devices (the state may then be donated to the
        next step); the files are written in the background. A save waits for the previous one.
        A step this run already saved is not saved twice; a step left on disk by an earlier
        run (e.g. the corrupted checkpoint that resuming skipped) is replaced.
        """
        step = int(step)
        if not (force or self.should_save(step)):
            return False
        self._finish_pending()
        if step in self._saved:
            return False
        if step in self._manager.all_steps():
            warnings.warn(
                f"checkpoint step {step} in {self.directory} is from an earlier run; replacing it",
                CheckpointWarning,
                stacklevel=2,
            )
            self._manager.delete(step)
        self._problems.pop(step, None)
        self._pending_step = step
        items = {item: ocp.args.StandardSave(tree) for item, tree in _split(state).items()}
        items[DATA_ITEM] = ocp.args.JsonSave({"step": step, "data": data_state})
        self._manager.save(step, args=ocp.args.Composite(**items), force=True)
        self._saved.add(step)
        return True

    def _write_pending_manifest(self) -> None:
        """Orbax's post-finalization callback: runs in the background thread once every
        process has written its files, before the temporary directory is renamed."""
        step = self._pending_step
        if step is None or jax.process_index() != 0:
            return
        tmp = sorted(glob.glob(os.path.join(self.directory, f"{step}{TMP_SUFFIX}*")), key=os.path.getmtime)
        step_dir = tmp[-1] if tmp else os.path.join(self.directory, str(step))
        if os.path.isdir(step_dir):  # else `_finish_pending` writes it after the commit
            write_manifest(step_dir, step)

    def _finish_pending(self) -> None:
        """Waits for the save in flight; writes its manifest if the callback could not."""
        self._manager.wait_until_finished()
        step, self._pending_step = self._pending_step, None
        step_dir = os.path.join(self.directory, str(step))
        if (
            step is not None
            and jax.process_index() == 0
            and os.path.isdir(step_dir)
            and not os.path.isfile(os.path.join(step_dir, MANIFEST))
        ):
            write_manifest(step_dir, step)

    def close(self) -> None:
        """Waits for pending saves to be written and committed."""
        self._finish_pending()
        self._manager.close()

    # Finding and checking ------------------------------------------------------------------

    def all_steps(self) -> list[int]:
        """Committed checkpoints, oldest first (intact or not)."""
        return sorted(self._manager.all_steps())

    def problem(self, step: int) -> str | None:
        """Why checkpoint `step` cannot be used (missing, uncommitted, corrupted), or None."""
        if step not in self._problems:
            if step not in self._manager.all_steps():
                return "there is no such checkpoint" + (
                    " (its save never committed)" if step in self._unfinished else ""
                )
            self._problems[step] = manifest_problem(os.path.join(self.directory, str(step)), self.checksums)
        return self._problems[step]

    def latest_valid_step(self) -> int | None:
        """The newest checkpoint that is committed and matches its manifest, or None.

        Every newer one is skipped with a `CheckpointWarning` naming its step and what is wrong.
        """
        self._manager.wait_until_finished()
        committed = set(self._manager.all_steps())
        for step in sorted(committed | set(self._unfinished), reverse=True):
            problem = (
                self.problem(step)
                if step in committed
                else ("its save never committed (the run stopped while writing it)")
            )
            if problem is None:
                return step
            warnings.warn(
                f"checkpoint step {step} in {self.directory} is unusable: {problem}; "
                "falling back to the previous one",
                CheckpointWarning,
                stacklevel=2,
            )
        return None

    def latest_intact_step(self) -> int | None:
        """The newest committed checkpoint that matches its manifest, from the directory alone
        (no waiting for a save in flight, no warnings): what a report after a failure names."""
        for step in reversed(list_steps(self.directory)[0]):
            if step not in self._problems:
                self._problems[step] = manifest_problem(
                    os.path.join(self.directory, str(step)), self.checksums
                )
            if self._problems[step] is None:
                return step
        return None

    def _find_unfinished(self) -> list[int]:
        return list_steps(self.directory)[1]

    @staticmethod
    def saved_data_state(directory: str, step: int) -> Any:
        """What `save` stored beside the arrays of checkpoint `step` in `directory`, read from the
        file orbax's JSON handler writes (`<step>/data/metadata`) without opening a manager
        (which would wait for every process): None if it cannot be read."""
        try:
            with open(os.path.join(directory, str(step), DATA_ITEM, "metadata")) as f:
                return json.load(f)["data"]
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def data_state(self, step: int) -> Any:
        """What `save` stored beside the arrays of checkpoint `step` (the data iterator's state
        and the run's data settings); reads that small JSON item only."""
        return self._manager.restore(step, args=ocp.args.Composite(**{DATA_ITEM: ocp.args.JsonRestore()}))[
            DATA_ITEM
        ]["data"]

    def check_shapes(self, step: int, state_shape: dict) -> None:
        """Raises `CheckpointMismatchError` unless checkpoint `step` holds exactly the arrays of
        `state_shape` (same paths, same shapes); reads metadata only."""
        metadata = self._manager.item_metadata(step)
        problems = []
        for item, shapes in _split(state_shape).items():
            saved = metadata.get(item)
            if saved is None:
                problems.append(f"{item}: the checkpoint has no such item")
                continue
            prefix = [item] if item == PARAMS_ITEM else []
            saved = getattr(saved, "tree", saved)
            problems += _shape_problems(_leaf_shapes(saved, prefix), _leaf_shapes(shapes, prefix))
        if problems:
            shown = "\n  ".join(problems[:8]) + (
                f"\n  ... and {len(problems) - 8} more" if len(problems) > 8 else ""
            )
            if not any(p.startswith(f"{PARAMS_ITEM}.") for p in problems) and any(
                p.startswith("opt_state") for p in problems
            ):
                # The parameters match: the optimizer state is what differs (another update rule).
                raise CheckpointMismatchError(
                    f"checkpoint step {step} in {self.directory} holds the state of another "
                    f"optimizer (the model's parameters match):\n  {shown}\nresume with the "
                    "optimizer.name it was trained with (its config.yaml), or keep its weights "
                    "with a fresh optimizer: train.init_from=<that run directory> in a new "
                    "train.run_dir"
                )
            raise CheckpointMismatchError(
                f"checkpoint step {step} in {self.directory} holds a model of another shape:"
                f"\n  {shown}\nrestore it with the model config it was trained with"
            )

    # Restoring -----------------------------------------------------------------------------

    def restore(
        self, state_shape: dict, state_shardings: dict | None, step: int | None = None
    ) -> tuple[dict, Any, int]:
        """(state, data_state, step) from checkpoint `step` (default: `latest_valid_step()`).

        `state_shape` is a tree of `jax.ShapeDtypeStruct` (e.g. `Trainer.state_shape`), or a part
        of it (`{"params": ...}` restores the parameters alone); `state_shardings` the matching
        tree of shardings, on any mesh (None: host numpy arrays). Shapes are checked first
        (`CheckpointMismatchError`); each process then reads only the shards its devices hold.
        Raises FileNotFoundError when there is no usable checkpoint.
        """
        if step is None:
            step = self.latest_valid_step()
            if step is None:
                raise FileNotFoundError(f"no usable checkpoint in {self.directory}")
        elif (problem := self.problem(step)) is not None:
            usable = [s for s in self.all_steps() if self.problem(s) is None]
            raise CheckpointNotFoundError(
                f"checkpoint step {step} in {self.directory} is unusable: {problem}; "
                + (f"its usable checkpoints are steps {usable}" if usable else "it has no usable checkpoint")
            )
        # Checkpoints from before the train state carried the guard's counters (skipped_steps,
        # first_bad_step) lack them: those scalars start at 0 instead.
        missing = self._missing_counters(step, state_shape)
        missing_shardings = {k: (state_shardings or {}).get(k) for k in missing}
        state_shape = {k: v for k, v in state_shape.items() if k not in missing}
        if state_shardings is not None:
            state_shardings = {k: v for k, v in state_shardings.items() if k not in missing}
        self.check_shapes(step, state_shape)
        if state_shardings is None:
            target = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype), state_shape)
        else:
            target = jax.tree.map(
                lambda s, sharding: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding),
                state_shape,
                state_shardings,
            )
        items = {item: ocp.args.StandardRestore(tree) for item, tree in _split(target).items()}
        items[DATA_ITEM] = ocp.args.JsonRestore()
        restored = self._manager.restore(step, args=ocp.args.Composite(**items))
        state = dict(restored.get(REST_ITEM) or {})
        if PARAMS_ITEM in restored.keys():
            state[PARAMS_ITEM] = restored[PARAMS_ITEM]
        for key, like in missing.items():
            zero, sharding = np.zeros(like.shape, like.dtype), missing_shardings[key]
            state[key] = (
                zero
                if sharding is None
                else jax.make_array_from_callback(zero.shape, sharding, lambda index: zero[index])
            )
        meta = restored[DATA_ITEM]
        return state, meta["data"], int(meta["step"])

    def _missing_counters(self, step: int, state_shape: dict) -> dict:
        """Scalar integer entries of `state_shape` (besides params) that checkpoint `step` lacks."""
        saved = self._manager.item_metadata(step).get(REST_ITEM)
        saved = getattr(saved, "tree", saved) or {}
        return {
            k: v
            for k, v in state_shape.items()
            if k != PARAMS_ITEM
            and k not in saved
            and getattr(v, "shape", None) == ()
            and np.issubdtype(np.dtype(v.dtype), np.integer)
        }


def _split(state: dict) -> dict[str, Any]:
    """The train state as orbax items: {"params": ..., "train_state": {every other entry}}."""
    if PARAMS_ITEM not in state:
        raise ValueError(f"the train state has no '{PARAMS_ITEM}' (it has {sorted(state)})")
    rest = {key: value for key, value in state.items() if key != PARAMS_ITEM}
    return {PARAMS_ITEM: state[PARAMS_ITEM], **({REST_ITEM: rest} if rest else {})}


# --- A full disk, said in one line -----------------------------------------------------------


class DropNoSpace(logging.Filter):
    """Orbax's background threads log a disk-full write failure as several pages of tracebacks
    (through absl, and asyncio's "exception was never retrieved" when the process ends); the run
    reports it in one line instead (DiskFull)."""

    LOGGERS = ("absl", "asyncio")

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage() + str(record.exc_info[1] if record.exc_info else "")
        return not ("No space left on device" in text or "os_error_code='28'" in text)

    def __enter__(self):
        for name in self.LOGGERS:
            logging.getLogger(name).addFilter(self)
        return self

    def __exit__(self, *exc):
        for name in self.LOGGERS:
            logging.getLogger(name).removeFilter(self)


def quiet_closed_loop(default_hook, unraisable) -> None:
    """sys.unraisablehook for the command line. After a failed save (a full disk), orbax closes
    its event loop while tensorstore still completes writes into it; each completion becomes an
    unraisable "RuntimeError: Event loop is closed", a page of them. They say nothing the run's
    one-line error does not; every other unraisable error goes to the default hook."""
    error = unraisable.exc_value
    if isinstance(error, RuntimeError) and str(error) == "Event loop is closed":
        return
    default_hook(unraisable)
