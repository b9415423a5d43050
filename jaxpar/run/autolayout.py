"""`mesh: auto` at the start of a run: process 0 plans and compiles the candidates
(`jaxpar.planning.auto.resolve`), prints the choice and its reasons, and every process takes the
same layout (broadcast, so that the processes cannot choose apart on a timing or a memory
reading); the run writes them into its directory (`write`, as `layout.json`) beside its
`config.yaml`, which records the resolved mesh and settings. A first step that runs out of
memory is explained (`out_of_memory`): which prediction was wrong, by how much, and the next
candidate."""

from __future__ import annotations

import json
import os
import sys

import jax
import numpy as np

from jaxpar.config import MESH_AXES, Config, ConfigError
from jaxpar.planning import auto as auto_lib

_CHOSEN: dict = {}  # this process's choice: "json" (what layout.json keeps), "choice"
REMAT = ("none", "dots", "full")
SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb")


def _encode(cfg: Config) -> np.ndarray:
    p = cfg.parallel
    return np.array(
        [getattr(cfg.mesh, a) for a in MESH_AXES]
        + [
            p.zero_stage,
            REMAT.index(p.remat),
            p.grad_accum,
            int(p.sequence_parallel),
            SCHEDULES.index(p.pipeline_schedule),
            p.microbatches,
            p.virtual_stages,
        ],
        np.int32,
    )


def _decode(cfg: Config, v: np.ndarray) -> Config:
    mesh = dict(zip(MESH_AXES, (int(x) for x in v[:6])))
    zero, remat, accum, sp, schedule, mb, virtual = (int(x) for x in v[6:])
    parallel = dict(
        zero_stage=zero,
        remat=REMAT[remat],
        grad_accum=accum,
        sequence_parallel=bool(sp),
        pipeline_schedule=SCHEDULES[schedule],
        microbatches=mb,
        virtual_stages=virtual,
    )
    return auto_lib.applied(cfg, mesh, parallel)


def _broadcast(vector: np.ndarray) -> np.ndarray:
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.broadcast_one_to_all(vector.astype(np.int32)))


def choose(cfg: Config, settings: dict, auto: list[str], n: int) -> Config:
    """The config with the layout process 0 planned (`jaxpar.planning.auto.resolve`), on every
    process; process 0 prints the report. Every process plans and compiles the candidates alike
    (unless process 0 keeps a recorded layout), so that all reach the broadcast together: one
    waiting there alone for long gives up (Gloo's context waits 30 s)."""
    _CHOSEN.clear()
    main, many = jax.process_index() == 0, jax.process_count() > 1
    keeps = main and auto_lib.keeps(cfg, n)
    if many:
        keeps = bool(_broadcast(np.array([int(keeps)]))[0])
    error, chosen = None, cfg
    if main or not keeps:
        try:
            chosen, choice, lines = auto_lib.resolve(cfg, settings, auto, n)
        except ConfigError as e:
            error = e
        else:
            if main:
                for line in lines:
                    print(line, file=sys.stderr, flush=True)
                _CHOSEN["choice"] = choice
                _CHOSEN["json"] = None if choice is None else auto_lib.to_json(choice)
    if many:
        failed = main and error is not None
        vector = _broadcast(np.zeros(14) if failed else np.concatenate([[1], _encode(chosen)]))
        if not vector[0]:
            raise error or ConfigError("mesh: auto: process 0 found no layout (its output says why)")
        return _decode(cfg, vector[1:])
    if error is not None:
        raise error
    return chosen


def write(run_dir: str) -> None:
    """Process 0: the choice and its reasons into the run directory (`layout.json`), where this
    start planned one (a resume that kept the recorded layout leaves the record as it is)."""
    record = _CHOSEN.get("json")
    if record is None:
        return
    path = os.path.join(run_dir, auto_lib.LAYOUT_FILE)
    with open(path + ".tmp", "w") as f:
        json.dump(record, f, indent=2)
    os.replace(path + ".tmp", path)


def out_of_memory(error: BaseException) -> str | None:
    """For a run whose planned layout ran out of device memory: which prediction was wrong, by
    how much, and the next candidate; None for any other error or a layout not planned here."""
    choice = _CHOSEN.get("choice")
    text = str(error)
    if (
        choice is None
        or choice.chosen is None
        or not ("RESOURCE_EXHAUSTED" in text or "Out of memory" in text)
    ):
        return None
    c = choice.chosen
    predicted, compiled = c.plan.memory["total"], c.compiled
    line = (
        f"mesh: auto: the chosen layout ({auto_lib.layout_text(c.plan)}) ran out of memory: "
        f"predicted {auto_lib.size(predicted)} per device, compiled {auto_lib.size(compiled)} "
        f"({predicted / compiled - 1:+.0%} off), {auto_lib.size(choice.here.usable)} usable: the compiled "
        "total was wrong by at least what the run lacked"
    )
    after = auto_lib.next_candidate(choice)
    if after is None:
        return (
            line
            + "; no other candidate fitted once compiled: set a lower runtime.host_memory_gib or pin the mesh"
        )
    keys = " ".join(f"mesh.{a}={after.plan.sizes[a]}" for a in MESH_AXES)
    return line + f"; the next candidate: {auto_lib.layout_text(after.plan)} ({keys})"
