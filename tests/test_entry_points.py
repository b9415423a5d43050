"""Every command-line entry point on a machine with only the `test` extra.

A new user's first environment is what `make train` builds: no CUDA plugin, so no `jax_plugins`
namespace. tests/bare_python/sitecustomize.py makes a Python look like that (the plugin's packages
cannot be imported, its entry points are not advertised) even where the suite's own environment
has the `gpu-compile` extra. Each entry point then runs in a subprocess and must either do its
job (exit 0) or say in one line which extra to install (exit 2) -- never a traceback.
"""

from __future__ import annotations

import os
import subprocess
import sys

from tests.test_train import ROOT

BARE = os.path.join(ROOT, "tests", "bare_python")
# train.steps=2 for every command (the train run's length): train, inspect and bench then compile
# the same step program, and the later ones load it from the session's compilation cache.
TINY = [
    os.path.join(ROOT, "configs", "tiny.yaml"),
    "runtime.cpu_devices=1",
    "data.max_documents=8",
    "train.steps=2",
]


def _bare_env() -> dict[str, str]:
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join(filter(None, [BARE, ROOT, os.environ.get("PYTHONPATH")]))
    )
    env.pop("JAX_PLATFORMS", None)  # as a user's shell has it: jaxpar picks the platform itself
    return env


def _start(*args: str, cwd=ROOT) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, *args],
        cwd=cwd,
        env=_bare_env(),
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )


def _finish(proc: subprocess.Popen, code: int, timeout: float = 240) -> str:
    """Waits for `proc`; asserts its exit code and no traceback; returns its stderr."""
    out, err = proc.communicate(timeout=timeout)
    proc.out = out
    command = " ".join(proc.args[1:])
    assert "Traceback" not in err + out, f"{command}:\n{err[-3000:]}"
    assert proc.returncode == code, f"{command}: exit {proc.returncode}, wanted {code}\n{err[-3000:]}"
    return err


def _one_line_naming_the_extra(err: str) -> None:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "gpu-compile" in lines[0], err


def test_the_bare_python_hides_the_cuda_plugin():
    """The premise: under tests/bare_python the old question `find_spec("jax_plugins.xla_cuda12")`
    fails as it does on a bare machine, JAX starts on the CPU, and jaxpar sees no plugin."""
    code = (
        "import importlib.util, jax\n"
        "from jaxpar import mesh\n"
        "try:\n    importlib.util.find_spec('jax_plugins.xla_cuda12')\n"
        "except ModuleNotFoundError:\n    print('no jax_plugins')\n"
        "print(jax.default_backend(), mesh.cuda_plugin_folders())\n"
    )
    proc = _start("-c", code)
    _finish(proc, 0)
    assert proc.out.split() == ["no", "jax_plugins", "cpu", "[]"], proc.out


def test_every_entry_point_runs_or_names_the_extra_without_a_plugin(tmp_path):
    run, exported, corpus = tmp_path / "run", tmp_path / "hf", tmp_path / "corpus.jsonl"
    corpus.write_text("".join(f'{{"text": "document {i}: {"abc " * (20 + i)}"}}\n' for i in range(40)))
    # What needs no trained run goes first, all at once.
    waiting = [
        (_start("-m", "jaxpar.train", *TINY, f"train.run_dir={run}"), 0),
        (_start("-m", "jaxpar.inspect", *TINY, "--target", "h100"), 2),
        (_start("-m", "jaxpar.plan", "configs/tiny.yaml", "--gpus", "8xh100", "--verify", "1"), 2),
        (_start("-m", "benchmarks.bench", *TINY, "--target", "h100"), 2),
        (_start("-m", "jaxpar.data", "prepare", str(corpus), "--out", str(tmp_path / "shards")), 0),
    ]
    errors = [_finish(proc, code) for proc, code in waiting]
    for err in errors[1:4]:
        _one_line_naming_the_extra(err)
    assert (tmp_path / "shards" / "manifest.json").exists()
    # Then what reads the run, and inspect and bench, which load the run's step program from the
    # compilation cache instead of compiling it beside the run (inspect: 6.2 s of CPU, not 10.3).
    _finish(_start("-m", "jaxpar.export", str(run), "--out", str(exported)), 0)
    waiting = [
        (_start("-m", "jaxpar.inspect", *TINY), 0),
        (_start("-m", "jaxpar.sample", str(run), "--prompt", "def ", "--max-tokens", "4"), 0),
        (_start("-m", "jaxpar.convert", "from-hf", str(exported), "--out", str(tmp_path / "back")), 0),
        (
            _start(
                "-m",
                "benchmarks.bench",
                *TINY,
                "--steps",
                "1",
                "--warmup",
                "0",
                "--json",
                str(tmp_path / "bench.json"),
            ),
            0,
        ),
    ]
    for proc, code in waiting:
        _finish(proc, code)
    assert (tmp_path / "back" / "config.yaml").exists() and (tmp_path / "bench.json").exists()


def test_launch_runs_its_workers_without_a_plugin(tmp_path):
    proc = _start(
        "-m",
        "jaxpar.launch",
        "--nproc",
        "2",
        *TINY,
        "mesh.data=2",
        "mesh.fsdp=1",
        "mesh.tensor=1",
        f"train.run_dir={tmp_path / 'run'}",
    )
    _finish(proc, 0)
    assert (tmp_path / "run" / "metrics.jsonl").exists()
