"""The benchmark CLI: runs without grain, writes a complete JSON, quotes the H100 reference runs correctly.

No timing thresholds: the numbers depend on the machine; only their sanity is checked."""

import json
import math
import os
import shlex
import subprocess
import sys
import textwrap

from jaxpar import config as config_lib
from jaxpar.training import metrics as metrics_lib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# configs/tiny.yaml in bfloat16 (the default dtype), 4 rows, data parallel over 2 CPU devices.
TINY = [
    os.path.join(ROOT, "configs", "tiny.yaml"),
    "model.dtype=bfloat16",
    "train.batch_size=4",
    "runtime.cpu_devices=2",
    "mesh.data=2",
    "mesh.fsdp=1",
    "mesh.tensor=1",
]

# As on the GPU machine, `import grain` fails; afterwards, report whether jaxpar.data was imported.
WITHOUT_GRAIN = textwrap.dedent("""
    import json, sys
    sys.modules["grain"] = None  # makes `import grain` raise ImportError
    from benchmarks.bench import main
    code = main(sys.argv[1:])
    print(json.dumps({"data_module_ran": "jaxpar.data" in sys.modules}))
    sys.exit(code)
""")


def test_bench_runs_without_grain_and_writes_sane_json(tmp_path):
    out = tmp_path / "bench.json"
    # The session's XLA flags (conftest.py: -O0, compiling in about half the time) stay in force:
    # the bench records them, and after them its own.
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            WITHOUT_GRAIN,
            *TINY,
            "--steps",
            "3",
            "--warmup",
            "1",
            "--json",
            str(out),
            "--tag",
            "smoke",
            "--xla-flag=--xla_cpu_enable_fast_math=false",
            "--compare-reference",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == {"data_module_ran": False}
    assert "tokens/s" in proc.stdout and "none for this config" in proc.stdout

    r = json.loads(out.read_text())
    assert r["steps"] == 3 and r["warmup"] == 1 and r["tag"] == "smoke"
    assert len(r["step_time_s"]["all"]) == 3
    assert 0 < r["step_time_s"]["min"] <= r["step_time_s"]["median"] <= r["step_time_s"]["max"]
    assert r["tokens_per_step"] == 4 * 32
    assert math.isclose(r["tokens_per_sec"], 128 / r["step_time_s"]["median"])
    assert r["compile_seconds"] > 0 and r["init_seconds"] > 0
    cfg = config_lib.load_config(TINY[0], TINY[1:])
    assert r["flops_per_token"] == metrics_lib.flops_per_token(cfg.model, 32)
    assert r["mfu"] is None and r["peak_flops_per_device"] is None  # no peak for CPUs
    assert r["memory"]["device"]["peak_bytes_in_use"] is None  # CPUs keep no allocator stats
    assert r["memory"]["compiled"]["temp"] > 0 and r["memory"]["compiled"]["argument"] > 0
    assert r["device"] == {**r["device"], "platform": "cpu", "count": 2, "process_count": 1}
    assert r["software"]["jax"] and r["mesh"] == {"data": 2}
    assert r["xla_flags_set_by_bench"] == ["--xla_cpu_enable_fast_math=false"]
    assert r["xla_flags"] == shlex.split(env.get("XLA_FLAGS", "")) + r["xla_flags_set_by_bench"]
    # Random tokens: the loss starts and stays near ln(vocab) (one fresh batch per step).
    assert abs(r["loss"]["first"] - math.log(264)) < 0.5 and math.isfinite(r["loss"]["last"])
    assert r["reference"] is None


def test_reference_numbers_agree_with_the_flops_formula():
    """The hardcoded H100 reference rows are self-consistent: step = batch * 1024 / (tokens/s), and
    MFU = (6·N_matmul + 12·L·d·T) * tokens/s / 989e12 for configs/gpt2-124m.yaml's model."""
    from benchmarks.bench import reference_for

    cfg = config_lib.load_config(os.path.join(ROOT, "configs/gpt2-124m.yaml"))
    rows = reference_for(cfg)
    assert len(rows) == 6 and {r["batch_size"] for r in rows} == {12, 32}
    flops = metrics_lib.flops_per_token(cfg.model, cfg.train.seq_len)
    for r in rows:
        step_s = r["batch_size"] * 1024 / r["tokens_per_sec"]
        assert math.isclose(r["step_ms"] / 1e3, step_s, rel_tol=0.01), r
        assert abs(r["mfu"] - flops * r["tokens_per_sec"] / 989e12) < 0.006, r
    assert reference_for(config_lib.load_config(None)) is None
    assert reference_for(config_lib.load_config(None, ["model.d_model=64"])) is None


def test_default_json_path_names_config_device_and_tag():
    from benchmarks.bench import RESULTS_DIR, default_json_path

    h100 = {"kind": "NVIDIA H100 80GB HBM3", "count": 1}
    cpus = {"kind": "cpu", "count": 8}
    assert (
        default_json_path("configs/gpt2-124m.yaml", h100, "").name == "gpt2-124m-nvidia-h100-80gb-hbm3.json"
    )
    assert default_json_path(None, cpus, "remat dots") == RESULTS_DIR / "default-cpu-x8-remat-dots.json"


def test_target_prints_the_compiled_memory_without_timing(capsys):
    import pytest

    pytest.importorskip("jax_plugins.xla_cuda12", reason="needs the gpu-compile extra")
    from benchmarks.bench import main

    small = [a for a in TINY if not a.startswith(("runtime.", "mesh.data"))] + ["mesh.data=2"]
    assert main([*small, "model.d_model=128", "model.n_heads=2", "--target", "h100:2"]) == 0
    out = capsys.readouterr().out
    assert "NVIDIA H100 80GB HBM3" in out
    row = out.strip().splitlines()[-1]
    assert "yes" in row and "__cudnn$fmhaSoftmax" in row  # head_dim 64: cuDNN's flash path
    assert main([*small, "--target", "v100"]) == 2
    assert "unknown GPU type 'v100'" in capsys.readouterr().err
