"""benchmarks.suite_costs, the pytest plugin that says where the suite's time goes: a pytest run
of three small test files on two xdist workers, and the report of what it recorded.

Bugs this catches: a compile recorded against the wrong test (the listener's test not switched),
the CPU of a test's child process missed, a program loaded from the persistent cache counted as
compiled, a worker's records not written, the report adding a file's tests up wrong."""

import os
import subprocess
import sys

from benchmarks import suite_costs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

TESTS = """
import subprocess, sys
import jax, numpy as np

X = np.ones(7, np.float32)

def test_compiles():
    jax.jit(lambda x: x * {k})(X).block_until_ready()

def test_child():
    subprocess.run([sys.executable, "-c", "sum(range(2 * 10**7))"], check=True)

def test_loads():
    f = lambda x: x + {k}
    jax.jit(f)(X).block_until_ready()
    jax.clear_caches()  # the next call finds f's program in the persistent cache only
    jax.jit(f)(X).block_until_ready()

def test_nothing():
    pass
"""


def test_each_test_gets_its_compiles_loads_and_child_cpu(tmp_path):
    for k in range(3):  # three files for two workers; each file's programs its own
        (tmp_path / f"test_costs_{k}.py").write_text(TESTS.replace("{k}", str(k + 2)))
    out = tmp_path / "costs"
    env = dict(os.environ, JAX_COMPILATION_CACHE_DIR=str(tmp_path / "jax-cache"))
    env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "2"]
    command += ["--dist", "loadfile", "-p", "benchmarks.suite_costs", "--suite-costs", str(out)]
    command += ["--rootdir", str(tmp_path), str(tmp_path)]
    proc = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert {p.name for p in out.iterdir()} == {"main.json", "gw0.json", "gw1.json"}

    tests = suite_costs.load(str(out))
    assert len(tests) == 12
    for k in range(3):
        costs = {name.split("::")[1]: c for name, c in tests.items() if f"test_costs_{k}.py" in name}
        assert costs["test_compiles"]["compiles"] == 1 and costs["test_compiles"]["cache_hits"] == 0
        assert costs["test_loads"]["compiles"] == 1 and costs["test_loads"]["cache_hits"] == 1
        assert costs["test_child"]["children_cpu_s"] > 0.2  # about 0.5 s of summing
        assert costs["test_compiles"]["children_cpu_s"] == 0
        for name in ("test_child", "test_nothing"):
            assert costs[name]["compiles"] == costs[name]["cache_hits"] == costs[name]["compile_s"] == 0
        for c in costs.values():
            assert c["cpu_s"] >= c["children_cpu_s"] >= 0 and c["wall_s"] > 0

    files = suite_costs.by_file(tests)
    assert len(files) == 3
    for total in files.values():
        assert total["compiles"] == 2 and total["cache_hits"] == 1
    text = suite_costs.report(tests, top=3)
    assert text.startswith("12 tests in 3 files")
    costliest = text.split("the 3 tests with the most CPU:")[1].splitlines()[2:]
    assert len(costliest) == 3 and all(line.endswith("::test_child") for line in costliest), text
