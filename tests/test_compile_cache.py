"""The persistent compilation cache (runtime.compile_cache, jaxpar/mesh.py): a first run into an
empty directory compiles and writes it, a second identical run loads every program from it and
writes nothing, `off` writes nowhere, a directory that cannot be one stops the run with one line.

The runs are subprocesses of the tiny model on one CPU device. Each controls the cache's
environment itself: the test session's JAX_COMPILATION_CACHE_DIR (tests/conftest.py) is removed
where the setting is under test, and JAXPAR_CACHE (which the per-user default follows before
XDG_CACHE_HOME) points into the test's own directory, so that a run which ignored its setting and
fell back to that default would write there, where the test looks, and never into the user's
home."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest

from jaxpar import checks as checks_lib
from jaxpar import config as config_lib
from jaxpar import mesh as mesh_lib
from jaxpar.config import ConfigError, RuntimeConfig
from jaxpar.run import records

ROOT = Path(__file__).resolve().parents[1]
TINY = [str(ROOT / "configs" / "tiny.yaml"), "runtime.cpu_devices=1", "train.steps=2"]


def _env(home: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != mesh_lib.COMPILE_CACHE_ENV}
    env.update(JAX_PLATFORMS="cpu", JAXPAR_CACHE=str(home / "jaxpar"))  # before XDG_CACHE_HOME
    return {**env, **extra}


def _train(home: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "jaxpar.train", *TINY, *args],
        cwd=ROOT,
        env=_env(home, **env),
        capture_output=True,
        text=True,
        timeout=300,
    )


def _entries(directory: Path) -> set[str]:
    """The cache's programs (jax keeps `<key>-cache` files)."""
    return {p.name for p in directory.glob("*-cache")} if directory.is_dir() else set()


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory):
    """The same run twice into one cache directory, named by runtime.compile_cache."""
    home = tmp_path_factory.mktemp("home")
    cache = home / "compile-cache"
    first = _train(home, f"runtime.compile_cache={cache}", f"train.run_dir={home / 'run1'}")
    after_first = _entries(cache)
    second = _train(home, f"runtime.compile_cache={cache}", f"train.run_dir={home / 'run2'}")
    return home, cache, first, after_first, second


def test_a_first_run_compiles_and_fills_an_empty_cache(two_runs):
    home, cache, first, after_first, _ = two_runs
    assert first.returncode == 0, first.stderr[-3000:]
    assert after_first, "the first run wrote nothing into runtime.compile_cache"
    assert f"compile cache: {cache} (runtime.compile_cache, up to 4 GiB)" in first.stderr
    lines = [line for line in first.stderr.splitlines() if "the train step" in line]
    assert len(lines) == 1 and lines[0].startswith("compiled the train step in "), first.stderr[-3000:]
    assert f"written to the compile cache {cache}" in lines[0]
    # The bound is jaxpar's, at the start: jax's own (which scans the directory at every write)
    # would have written an access-time file beside each program.
    assert not list(cache.glob("*-atime")), "jax bounded the cache itself"
    # Nothing went to the per-user default (which the setting replaces).
    assert not (home / "jaxpar" / "compile").exists()


def test_a_second_identical_run_loads_everything_and_writes_nothing(two_runs):
    _, cache, first, after_first, second = two_runs
    assert second.returncode == 0, second.stderr[-3000:]
    assert _entries(cache) == after_first  # every program found: none compiled, none written
    lines = [line for line in second.stderr.splitlines() if "the train step" in line]
    assert len(lines) == 1, second.stderr[-3000:]
    assert lines[0].startswith("loaded the train step from the compile cache in "), lines[0]
    assert lines[0].endswith(f"; {cache})") and "compiled" not in lines[0]
    # The same training either way.
    assert first.stdout.split("|")[1] == second.stdout.split("|")[1]  # " loss a -> b "


def test_off_writes_nowhere_even_with_jax_s_variable_set(tmp_path):
    """An explicit `off` wins over JAX_COMPILATION_CACHE_DIR (which `auto` would use)."""
    jax_dir = tmp_path / "jax-env-cache"
    done = _train(
        tmp_path,
        "runtime.compile_cache=off",
        f"train.run_dir={tmp_path / 'run'}",
        **{mesh_lib.COMPILE_CACHE_ENV: str(jax_dir)},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "compile cache: off (runtime.compile_cache=off)" in done.stderr
    assert (
        "compiled the train step in " in done.stderr
        and "; compile cache off: runtime.compile_cache=off)" in done.stderr
    )
    assert "from the compile cache" not in done.stderr
    assert not _entries(jax_dir) and not (tmp_path / "jaxpar" / "compile").exists()


@pytest.mark.parametrize(
    "setting, names",
    [
        ("runtime.compile_cache={file}", "runtime.compile_cache="),
        ("runtime.compile_cache_gib=0", "runtime.compile_cache_gib=0"),
    ],
)
def test_a_bad_setting_is_one_line_and_exit_2_before_anything_compiles(tmp_path, setting, names):
    (tmp_path / "a-file").write_text("not a directory")
    done = _train(tmp_path, setting.format(file=tmp_path / "a-file"), f"train.run_dir={tmp_path / 'run'}")
    assert done.returncode == 2, done.stderr[-3000:]
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("config error: "), done.stderr[-3000:]
    assert names in lines[0] and "Traceback" not in done.stderr
    assert not (tmp_path / "run").exists() and not (tmp_path / "jaxpar" / "compile").exists()


def test_a_start_trims_the_least_recently_used_programs_to_the_bound(tmp_path):
    """mesh.trim_cache: the oldest by last use (the later of access and write) go first, each
    with the access-time file jax's own bound may have left, until the rest fit; other files
    stay. (Trimming the newest first, or past the bound, fails here.)"""
    uses = {"a": 100, "b": 400, "c": 200, "d": 300}  # seconds since the epoch: a, c, d, b
    for key, when in uses.items():
        (tmp_path / f"{key}-cache").write_bytes(b"x" * 1000)
        (tmp_path / f"{key}-atime").write_bytes(b"t")
        os.utime(tmp_path / f"{key}-cache", (when, when))
    os.utime(tmp_path / "a-cache", (500, 100))  # read last (a cache hit), written first
    (tmp_path / "notes.txt").write_text("not a program")
    assert mesh_lib.trim_cache(str(tmp_path), 2500) == 2  # 4000 bytes down to 2000: c and d go
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "a-atime",
        "a-cache",
        "b-atime",
        "b-cache",
        "notes.txt",
    ]
    assert mesh_lib.trim_cache(str(tmp_path), 2000) == 0  # within the bound: nothing goes
    assert mesh_lib.trim_cache(str(tmp_path / "absent"), 0) == 0


# --- Which directory, and why (no JAX: the settings and the environment alone) ---------------


def test_auto_defers_to_jax_s_variable_else_the_per_user_directory(tmp_path, monkeypatch):
    monkeypatch.delenv(mesh_lib.COMPILE_CACHE_ENV, raising=False)
    monkeypatch.delenv("JAX_ENABLE_COMPILATION_CACHE", raising=False)
    monkeypatch.delenv("JAXPAR_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    auto = RuntimeConfig()
    assert mesh_lib.compile_cache(auto).directory == str(tmp_path / "xdg" / "jaxpar" / "compile")
    assert mesh_lib.compile_cache(auto).own and mesh_lib.compile_cache(auto).default
    monkeypatch.setenv("JAXPAR_CACHE", str(tmp_path / "jp"))
    assert mesh_lib.compile_cache(auto).directory == str(tmp_path / "jp" / "compile")
    monkeypatch.setenv(mesh_lib.COMPILE_CACHE_ENV, str(tmp_path / "env"))
    env = mesh_lib.compile_cache(auto)
    assert env.directory == str(tmp_path / "env") and not env.own and env.key == mesh_lib.COMPILE_CACHE_ENV
    # An explicit setting wins over the environment, both ways.
    chosen = mesh_lib.compile_cache(RuntimeConfig(compile_cache=str(tmp_path / "mine")))
    assert chosen.directory == str(tmp_path / "mine") and chosen.own
    assert mesh_lib.compile_cache(RuntimeConfig(compile_cache="off")).directory is None
    monkeypatch.setenv("JAX_ENABLE_COMPILATION_CACHE", "false")
    assert mesh_lib.compile_cache(auto).directory is None


def test_an_unwritable_jax_variable_names_itself(tmp_path, monkeypatch):
    (tmp_path / "a-file").write_text("")
    monkeypatch.setenv(mesh_lib.COMPILE_CACHE_ENV, str(tmp_path / "a-file" / "cache"))
    with pytest.raises(ConfigError, match=f"^{mesh_lib.COMPILE_CACHE_ENV}=.*a-file"):
        checks_lib.validate_runtime(config_lib.Config())


def test_a_bare_off_in_a_yaml_file_is_told_to_quote_it(tmp_path):
    (tmp_path / "run.yaml").write_text("runtime:\n  compile_cache: off\n")
    with pytest.raises(ConfigError, match="runtime.compile_cache: expected str, got False.*quote"):
        config_lib.load_config(str(tmp_path / "run.yaml"))
    (tmp_path / "run.yaml").write_text("runtime:\n  compile_cache: 'off'\n")
    assert config_lib.load_config(str(tmp_path / "run.yaml")).runtime.compile_cache == "off"


# --- What the line and the summary say, from the programs' record ------------------------------


def test_the_line_says_loaded_only_when_every_program_was():
    cache = mesh_lib.CompileCache("/c", "runtime.compile_cache")
    hit, miss = (
        mesh_lib.Compiled("jit(step)", 0.2, loaded=True),
        mesh_lib.Compiled("jit(init)", 3.0, written=True),
    )
    line = mesh_lib.compile_line([hit, dataclasses.replace(hit, name="jit(init)")], cache, "the train step")
    assert line == "loaded the train step from the compile cache in 0.4 s (2 programs: step, init; /c)"
    mixed = mesh_lib.compile_line([miss, hit], cache, "the train step")
    assert mixed.startswith("compiled the train step in 3.2 s") and "1 of them loaded" in mixed
    cold = mesh_lib.compile_line([miss], cache, "the train step", " up to the first step")
    assert cold == (
        "compiled the train step in 3.0 s "
        "(1 program up to the first step: init; written to the compile cache /c)"
    )
    off = mesh_lib.compile_line(
        [mesh_lib.Compiled("jit(step)", 3.0)], mesh_lib.CompileCache(None, "off"), "it"
    )
    assert off == "compiled it in 3.0 s (1 program: step; compile cache off: off)"
    assert mesh_lib.compile_line([], cache, "it") is None  # nothing compiled: nothing to say
    assert records.compile_record([miss, hit])["loaded"] == 1
