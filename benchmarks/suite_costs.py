"""Where the test suite's time goes, file by file: a pytest plugin that records what each test
cost, and a report of those records.

    .venv/bin/python -m pytest -q -n 2 --dist loadfile -p benchmarks.suite_costs --suite-costs /tmp/costs
    .venv/bin/python -m benchmarks.suite_costs /tmp/costs

For every test (its setup, call and teardown together; a module fixture's setup counts towards
the first test that uses it) the plugin records its wall time; the CPU time of its own process
and of the processes it started and waited for (getrusage: a child still running when the test
ends, such as a notebook kernel shut down later, counts towards a later test or none); and what
JAX did in the test's process: the programs XLA compiled and their seconds, the programs loaded
from the persistent compilation cache, and the seconds spent tracing and lowering. Each pytest
process (the xdist controller and each worker) writes `<dir>/<worker>.json` when its session
ends; the report adds them up. Compiles inside the processes a test starts are in their CPU
time, not in the compile columns.

On 2 cores the suite is CPU-bound, so its wall time is about its CPU time over 2: the CPU column
says which files to make cheaper, and the compile, trace and child columns say how.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import resource
import sys
import time
from pathlib import Path

import pytest

# jax.monitoring's names for what the report counts (jax 0.12).
COMPILE = "/jax/core/compile/backend_compile_duration"  # XLA's compile of one program, seconds
TRACE = "/jax/core/compile/jaxpr_trace_duration"
LOWER = "/jax/core/compile/jaxpr_to_mlir_module_duration"
CACHE_HIT = "/jax/compilation_cache/cache_hits"  # a program loaded from the persistent cache
DURATIONS = {COMPILE: "compile_s", TRACE: "trace_s", LOWER: "lower_s"}
# What is recorded per test, as the report's columns: (field, heading, width).
COLUMNS = (
    ("cpu_s", "cpu s", 8),
    ("wall_s", "wall s", 8),
    ("children_cpu_s", "child s", 8),
    ("compile_s", "compile s", 9),  # XLA's compiles and the persistent cache's loads
    ("compiles", "programs", 8),  # programs XLA compiled
    ("cache_hits", "loaded", 6),  # programs loaded from the persistent cache
    ("trace_s", "trace s", 7),
    ("lower_s", "lower s", 7),
)
FIELDS = tuple(field for field, _, _ in COLUMNS)


def pytest_addoption(parser):
    parser.addoption(
        "--suite-costs",
        metavar="DIR",
        help="write each test's wall, CPU, compile and trace costs to DIR/<worker>.json",
    )


class Recorder:
    """Costs per test id, filled by jax.monitoring's listeners while a test runs."""

    def __init__(self, directory: str):
        self.directory = directory
        self.tests: dict[str, dict[str, float]] = {}
        self.current: dict[str, float] | None = None

    def on_duration(self, event: str, seconds: float, **_) -> None:
        if self.current is None:
            return
        if event in DURATIONS:
            self.current[DURATIONS[event]] += seconds
        if event == COMPILE:
            # jax times a program loaded from the persistent cache as a compile too (the load's
            # seconds): compile_s holds both, and the hits are taken out of the count at the end.
            self.current["compiles"] += 1

    def on_event(self, event: str, **_) -> None:
        if self.current is not None and event == CACHE_HIT:
            self.current["cache_hits"] += 1

    def write(self, worker: str) -> None:
        os.makedirs(self.directory, exist_ok=True)
        with open(os.path.join(self.directory, f"{worker}.json"), "w") as f:
            json.dump(self.tests, f, indent=0)


def _cpu() -> tuple[float, float]:
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime, children.ru_utime + children.ru_stime


_recorder: Recorder | None = None


def pytest_configure(config):
    global _recorder
    directory = config.getoption("--suite-costs")
    if directory:
        _recorder = Recorder(os.path.abspath(directory))


def pytest_sessionstart(session):
    # jax is imported here, after the initial conftest files (which may set JAX_PLATFORMS or the
    # device count before jax starts), not when pytest imports this plugin.
    if _recorder is not None:
        import jax.monitoring

        jax.monitoring.register_event_duration_secs_listener(_recorder.on_duration)
        jax.monitoring.register_event_listener(_recorder.on_event)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    if _recorder is None:
        return (yield)
    _recorder.current = costs = dict.fromkeys(FIELDS, 0.0)
    start, (own, children) = time.perf_counter(), _cpu()
    try:
        return (yield)
    finally:
        own2, children2 = _cpu()
        costs["wall_s"] = time.perf_counter() - start
        costs["cpu_s"] = own2 - own + children2 - children
        costs["children_cpu_s"] = children2 - children
        costs["compiles"] -= costs["cache_hits"]
        _recorder.tests[item.nodeid] = costs
        _recorder.current = None


def pytest_sessionfinish(session):
    if _recorder is not None:
        # xdist gives a worker its id in `workerinput`; not from PYTEST_XDIST_WORKER, which a
        # pytest run started inside a worker (as the plugin's own test does) inherits.
        workerinput = getattr(session.config, "workerinput", None)
        _recorder.write(workerinput["workerid"] if workerinput else "main")


# --- The report --------------------------------------------------------------------------------


def load(directory: str) -> dict[str, dict[str, float]]:
    """Every test's costs from the JSON files the plugin wrote in `directory`."""
    tests: dict[str, dict[str, float]] = {}
    for path in sorted(Path(directory).glob("*.json")):
        tests.update(json.loads(path.read_text()))
    if not tests:
        raise SystemExit(
            f"{directory}: no records (run pytest with -p benchmarks.suite_costs --suite-costs {directory})"
        )
    return tests


def by_file(tests: dict[str, dict[str, float]]) -> dict[str, dict[str, float]]:
    files: dict[str, dict[str, float]] = collections.defaultdict(lambda: dict.fromkeys(FIELDS, 0.0))
    for nodeid, costs in tests.items():
        total = files[nodeid.split("::")[0]]
        for field in FIELDS:
            total[field] += costs[field]
    return dict(files)


def table(rows: dict[str, dict[str, float]], limit: int | None = None) -> list[str]:
    lines = [" ".join(f"{heading:>{width}}" for _, heading, width in COLUMNS)]
    ordered = sorted(rows.items(), key=lambda kv: -kv[1]["cpu_s"])
    for name, c in ordered[:limit]:
        cells = [f"{c[f]:{w}.1f}" if f.endswith("_s") else f"{int(c[f]):{w}d}" for f, _, w in COLUMNS]
        lines.append(" ".join(cells) + f"  {name}")
    return lines


def report(tests: dict[str, dict[str, float]], top: int = 15) -> str:
    files = by_file(tests)
    total = {field: sum(c[field] for c in files.values()) for field in FIELDS}
    lines = [f"{len(tests)} tests in {len(files)} files"]
    lines += table({"(all)": total})
    lines += ["", "by file, most CPU first:"] + table(files)
    lines += ["", f"the {top} tests with the most CPU:"] + table(tests, limit=top)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.suite_costs",
        description="Report the test costs pytest -p benchmarks.suite_costs recorded.",
    )
    p.add_argument("directory", help="the --suite-costs directory of a pytest run")
    p.add_argument("--top", type=int, default=15, help="how many of the costliest tests to list (default 15)")
    args = p.parse_args(argv)
    print(report(load(args.directory), top=args.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
