"""Training end to end: the loss falls, the run directory is complete, the CLIs work."""

import glob
import json
import math
import os
import subprocess
import sys

import pytest

from jaxpar import checks as checks_lib
from jaxpar import config as config_lib
from jaxpar.run.train import train

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY_YAML = os.path.join(ROOT, "configs", "tiny.yaml")
# configs/tiny.yaml with the default job's dtype and ZeRO stage.
TINY = ["model.dtype=bfloat16", "parallel.zero_stage=3"]


def test_twenty_steps_lower_the_loss_and_write_the_run_dir(tmp_path):
    cfg = config_lib.load_config(
        TINY_YAML, TINY + ["train.steps=20", "train.log_every=5", f"train.run_dir={tmp_path}"]
    )
    summary = train(cfg, checks_lib.validate(cfg, 8))
    # first_loss is the loss logged at step 5, after four updates
    assert summary["final_loss"] < summary["first_loss"] - 0.5
    records = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert [r["step"] for r in records] == [5, 10, 15, 20]
    for key in ("step", "loss", "grad_norm", "lr", "tokens_per_sec", "mfu", "step_time_s"):
        assert key in records[-1]
    assert records[-1]["tokens_per_sec"] > 0 and records[-1]["mfu"] is None  # no peak for CPUs
    assert config_lib.load_config(str(tmp_path / "config.yaml")) == cfg
    assert (tmp_path / "loss.png").stat().st_size > 1000
    assert glob.glob(str(tmp_path / "events.out.tfevents.*"))


def _run(module, *args, devices=2):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    return subprocess.run(
        [sys.executable, "-m", module, *args, f"runtime.cpu_devices={devices}"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=300,
    )


def test_train_cli_end_to_end(tmp_path):
    run_dir = tmp_path / "run"
    proc = _run(
        "jaxpar.train",
        TINY_YAML,
        *TINY,
        "train.steps=3",
        "train.log_every=1",
        f"train.run_dir={run_dir}",
        "mesh.data=2",
        "mesh.fsdp=1",
        "mesh.tensor=1",
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    precision = (
        "precision: compute bfloat16, weights float32, gradients reduced in bfloat16 (model.dtype=bfloat16's)"
    )
    assert precision in proc.stderr.splitlines(), proc.stderr[-2000:]
    summary = proc.stdout.strip().splitlines()[-1]
    assert summary.startswith("done: 3 steps") and "2 devices (data=2)" in summary
    assert len(open(run_dir / "metrics.jsonl").readlines()) == 3
    assert (run_dir / "config.yaml").exists() and (run_dir / "loss.png").exists()


@pytest.mark.parametrize("flag", ["", "--human"])
def test_inspect_cli_prints_the_report(flag):
    args = [
        TINY_YAML,
        *TINY,
        "mesh.data=1",
        "mesh.fsdp=2",
        "mesh.tensor=1",
        "parallel.zero_stage=3",
        "--compare",
    ]
    proc = _run("jaxpar.inspect", *args, *([flag] if flag else []))
    assert proc.returncode == 0, proc.stderr[-2000:]
    if flag:
        assert "memory per device" in proc.stdout and "all-gather" in proc.stdout
        return
    report = json.loads(proc.stdout)
    assert report["devices"] == 2 and report["mesh"]["fsdp"] == 2
    assert set(report["memory_per_device"]) >= {"params", "optimizer", "gradients", "temp", "total"}
    assert report["xla_flops_per_step"] == report["xla_flops_per_device"] * 2 > 0
    assert report["collectives"]["all-gather"]["count"] > 0
    assert report["compare"]["ratio"] == pytest.approx(1.0, rel=0.1)
    # bfloat16 matmuls (TINY): the gradients are still reduce-scattered, not all-reduced; all but
    # the embedding's [264, 32], whose token rows go to the devices owning their columns by an
    # all-to-all. XLA:CPU runs bfloat16 collectives in float32, so the bytes are float32's
    # whatever parallel.grad_reduce_dtype is (the H100 program's dtypes: test_gpu_program.py).
    param_bytes, embedding_bytes = 4 * report["params"], 4 * 264 * 32
    rs_bytes = report["collectives"]["reduce-scatter"]["bytes"]
    assert rs_bytes == pytest.approx(param_bytes - embedding_bytes, rel=0.1)
    assert report["collectives"]["all-to-all"]["count"] == 1
    assert report["collectives"]["all-reduce"]["bytes"] < 0.01 * param_bytes


def test_default_yaml_is_the_embedded_default():
    assert config_lib.load_config(os.path.join(ROOT, "configs", "default.yaml")) == config_lib.Config()


@pytest.mark.parametrize("preset", sorted(glob.glob(os.path.join(ROOT, "configs", "*.yaml"))))
def test_presets_load_and_validate(preset):
    """On the devices each is for: runtime.cpu_devices, or the product of a mesh that names
    every axis (a cluster's preset, e.g. the DeepSeek-V3 671B on 2048 GPUs)."""
    cfg = config_lib.load_config(preset)
    sizes = [getattr(cfg.mesh, axis) for axis in config_lib.MESH_AXES]
    devices = (
        math.prod(sizes) if all(isinstance(n, int) and n > 0 for n in sizes) else cfg.runtime.cpu_devices
    )
    sizes = checks_lib.validate(cfg, devices)
    assert (
        sizes["pipe"] * sizes["data"] * sizes["fsdp"] * sizes["tensor"] * sizes["expert"] * sizes["context"]
        == devices
    )


def test_no_cuda_plugin_traceback_on_a_machine_without_a_driver():
    """The gpu-compile extra installs the CUDA plugin; without a driver the CLIs start on the CPU
    instead of letting JAX log a cuInit traceback first."""
    pytest.importorskip("jax_plugins.xla_cuda12", reason="needs the gpu-compile extra")
    if os.path.exists("/dev/nvidiactl"):
        pytest.skip("this machine has an NVIDIA driver")
    # The session's XLA_FLAGS (conftest.py: compile options, -O0) stay: they start no plugin,
    # and with them a bare `import jax; jax.devices()` still logs the cuInit traceback here.
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "jaxpar.inspect",
            TINY_YAML,
            *TINY,
            "runtime.cpu_devices=1",
            "mesh.data=1",
            "mesh.fsdp=1",
            "mesh.tensor=1",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "cuInit" not in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-2000:]


@pytest.mark.parametrize("on_nan", ["skip", "stop"])
def test_the_guard_keeps_a_non_finite_step_out_of_the_weights(on_nan):
    """Step 2's batch has a NaN loss weight, so its loss and gradients are NaN. `skip`: the
    weights after step 2 are those after step 1 and step 3 trains again; `stop`: the state
    stays frozen from step 2 on and first_bad_step says 2."""
    import jax
    import numpy as np

    from tests.parity import random_batches, trainer_on

    trainer = trainer_on(TINY + ["model.dtype=float32", f"train.on_nan={on_nan}"], {})
    batches = list(random_batches(trainer.cfg, steps=3))
    batches[1]["loss_mask"] = batches[1]["loss_mask"].copy()
    batches[1]["loss_mask"][0, 0] = np.nan
    state, seen = trainer.init(), []
    for batch in batches:
        state, metrics = trainer.step(state, trainer.shard_batch(batch))
        seen.append((jax.device_get(state["params"]), jax.device_get(metrics)))
    flat = [np.concatenate([np.ravel(x) for x in jax.tree.leaves(p)]) for p, _ in seen]
    assert np.array_equal(flat[1], flat[0]) and np.isfinite(flat[1]).all()
    assert [float(m["skipped"]) for _, m in seen] == [0.0, 1.0, 0.0]
    if on_nan == "skip":
        assert not np.array_equal(flat[2], flat[1])
        assert int(seen[2][1]["first_bad_step"]) == 0 and int(seen[2][1]["skipped_steps"]) == 1
    else:
        assert np.array_equal(flat[2], flat[1])  # frozen until the host stops the run
        assert int(seen[2][1]["first_bad_step"]) == 2


def test_auto_attention_is_cudnn_only_where_its_packed_form_runs():
    from types import SimpleNamespace

    import jax

    from jaxpar.sharding import Layout
    from jaxpar.training.trainer import resolve_attention

    sizes = {a: 1 for a in config_lib.MESH_AXES}
    h100, a100 = (SimpleNamespace(platform="gpu", compute_capability=c) for c in ("9.0", "8.0"))
    cpu = SimpleNamespace(platform="cpu")

    def kernel(device, overrides=(), **mesh):
        cfg = config_lib.load_config(TINY_YAML, TINY + list(overrides))
        layout = Layout.build(
            {**sizes, **mesh},
            zero_stage=0,
            sequence_parallel=False,
            devices=jax.devices()[: max(mesh.values(), default=1)],
        )
        return resolve_attention(cfg, layout, device).model.attention

    assert kernel(h100) == "cudnn"
    assert kernel(a100) == "xla"  # packed documents need Hopper
    assert kernel(cpu) == "xla"
    assert kernel(h100, ["model.dtype=float32"]) == "xla"
    assert kernel(h100, pipe=2) == "xla" and kernel(h100, context=2) == "xla"
    assert kernel(a100, ["model.attention=cudnn"]) == "cudnn"  # an explicit choice stands


def test_automatic_loss_chunks_keep_float32_logits_within_256_mib():
    """Where the device's memory is unknown (CPU devices): pieces of the vocabulary whose float32
    logits stay within 256 MiB."""
    from jaxpar.compiled.targets import device_memory
    from jaxpar.models.loss import loss_chunks

    def chunks(cfg, device):
        return loss_chunks(cfg, sizes, memory=device_memory(device))

    gpt2 = os.path.join(ROOT, "configs", "gpt2-124m.yaml")
    sizes = {a: 1 for a in config_lib.MESH_AXES}
    cfg = config_lib.load_config(gpt2)
    # 12 x 1024 tokens x 50304 x 4 bytes = 2.47 GB: 9.2 x 256 MiB -> 12, the next divisor of 50304
    assert loss_chunks(cfg, sizes) == 12
    # tensor=2 with sequence parallelism halves the vocabulary per device, not the tokens too:
    # 4.6 x 256 MiB -> 6, the next divisor of 25152
    sp = config_lib.load_config(gpt2, ["parallel.sequence_parallel=true"])
    assert loss_chunks(sp, {**sizes, "tensor": 2}) == 6
    assert loss_chunks(config_lib.load_config(gpt2, ["train.loss_chunks=4"]), sizes) == 4


class _Device:
    """A device as targets.device_memory sees one: a GPU's allocator limit, or (compile-only) none to ask."""

    def __init__(self, kind, bytes_limit=None):
        self.device_kind, self.bytes_limit = kind, bytes_limit

    def memory_stats(self):
        if self.bytes_limit is None:
            raise RuntimeError("compile-only device")
        return {"bytes_limit": self.bytes_limit}


def test_automatic_loss_chunks_follow_the_devices_memory():
    """On one 80 GB H100 the presets' logits come whole (GPT-2 124M 2.5 GB, the 1B 8.4 GB): a
    real one at JAX's default 75% (64 GB) and a compile-only one (its usable 90%). On a device
    with 30 GB to use, the 1B's logits come in 2 pieces (4.2 GB each, within a sixth of it)."""
    from jaxpar.compiled.targets import device_memory
    from jaxpar.models.loss import loss_chunks

    def chunks(cfg, device):
        return loss_chunks(cfg, sizes, memory=device_memory(device))

    sizes = {a: 1 for a in config_lib.MESH_AXES}
    gpt2, llama = (
        config_lib.load_config(os.path.join(ROOT, "configs", f"{n}.yaml")) for n in ("gpt2-124m", "llama-1b")
    )
    h100, compile_only = _Device("NVIDIA H100 80GB HBM3", 64 * 10**9), _Device("NVIDIA H100 80GB HBM3")
    for device in (h100, compile_only):
        assert chunks(gpt2, device) == 1 and chunks(llama, device) == 1
    assert chunks(llama, _Device("smaller", 30 * 10**9)) == 2
    assert chunks(llama, _Device("unknown")) == 32  # 256 MiB
