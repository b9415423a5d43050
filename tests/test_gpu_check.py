"""benchmarks/gpu_check.py cannot rot: its dry run (the whole sequence on CPU, tiny stand-ins) runs
in one subprocess and writes a JSON of the structure a GPU run writes, every skipped piece saying
why; the profile's trace parser reads what the CPU run's profiler wrote.

No timing is checked: on CPU the numbers mean nothing, only that they are there and sane."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

from benchmarks.gpu_check import COMMAND_BUFFER_ARMS, SCAN_LAYERS, kernel_table, trace_events

ROOT = Path(__file__).resolve().parent.parent

# A stand-in for a plain-JAX reference program, under the same contract (BATCH SEQ, $H100_SPEC,
# a topology's devices, the compiled step left in `c`): an embedding, one matrix, a tied head.
PLAIN = textwrap.dedent("""
    import os, sys
    os.environ["JAX_PLATFORMS"] = "cpu"
    import jax, jax.numpy as jnp
    from jax.experimental import topologies
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    B, T, V, D = int(sys.argv[1]), int(sys.argv[2]), 256, 16
    spec = open(os.environ["H100_SPEC"]).read()
    topology = topologies.get_topology_desc(platform="cuda", target_config=spec, topology="1x1x1")
    rep = NamedSharding(Mesh(topology.devices, ("d",)), P())
    def loss(p, tok):
        logits = (p["emb"][tok[:, :-1]] @ p["w"]) @ p["emb"].T
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), tok[:, 1:, None], -1))
    def step(p, m, tok):
        l, g = jax.value_and_grad(loss)(p, tok)
        m = jax.tree.map(lambda m, g: 0.9 * m + g, m, g)
        return jax.tree.map(lambda p, m: p - 0.1 * m, p, m), m, l
    s = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32, sharding=rep)
    ps = {"emb": s(V, D), "w": s(D, D)}
    tok = jax.ShapeDtypeStruct((B, T + 1), jnp.int32, sharding=rep)
    c = jax.jit(step, donate_argnums=(0, 1)).lower(ps, ps, tok).compile()
""")

PIECES = [
    "gpt2_b2",
    "gpt2_b4",
    "nanogpt_b2",
    "nanogpt_b4",
    "plain_gpt2_b2",
    "plain_llama_b2",
    "llama_1b",
    *(f"command_buffer_{arm}" for arm, _ in COMMAND_BUFFER_ARMS),
    *(f"scan_layers_{arm}" for arm, _ in SCAN_LAYERS),
    "profile",
]


def test_dry_run_writes_every_piece_or_why_not(tmp_path):
    plain = tmp_path / "plain_standin.py"
    plain.write_text(PLAIN)
    out, trace = tmp_path / "check.json", tmp_path / "trace"
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.gpu_check", "--dry-run", "--out", str(out)]
        + ["--plain-gpt2", str(plain), "--trace-dir", str(trace)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=dict(os.environ, JAX_PLATFORMS="cpu"),
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    text = out.read_text()
    assert str(tmp_path) not in text  # where the plain program lives is never recorded
    r = json.loads(text)
    assert r["dry_run"] is True and r["finished"] and "cut_short" not in r
    assert r["device"]["platform"] == "cpu" and r["software"]["jax"]
    assert r["git"]["commit"] or r["git"]["source"].startswith("no git")
    pieces = r["pieces"]
    assert list(pieces) == PIECES
    failed = {n: p.get("error") for n, p in pieces.items() if p["status"] not in ("ok", "skipped")}
    assert not failed, failed

    for name in ("gpt2_b2", "gpt2_b4", "llama_1b"):  # bench.py's JSON, as its own test checks it
        result = pieces[name]["result"]
        assert result["steps"] == 1 and len(result["step_time_s"]["all"]) == 1
    assert pieces["gpt2_b4"]["result"]["batch_size"] == 4
    assert pieces["llama_1b"]["result"]["parallel"]["zero_stage"] == 3
    for arm, flag in COMMAND_BUFFER_ARMS:
        assert pieces[f"command_buffer_{arm}"]["result"]["xla_flags_set_by_bench"] == [flag]
    assert set(r["summary"]["command_buffer_over_default_tokens_per_sec"]) == {
        a for a, _ in COMMAND_BUFFER_ARMS
    }
    assert all(v > 0 for v in r["summary"]["command_buffer_over_default_tokens_per_sec"].values())

    result = pieces["plain_gpt2_b2"]["result"]
    assert result["script"] == "plain_standin.py" and result["batch"] == 2 and result["seq_len"] == 32
    assert result["step_ms"]["median"] > 0 and result["loss"]["first"] > 0

    # Skipped, each with its reason: no PyTorch with CUDA here (a dry run hides any GPU), no
    # --plain-llama given.
    reasons = {n: p["reason"] for n, p in pieces.items() if p["status"] == "skipped"}
    assert set(reasons) == {"nanogpt_b2", "nanogpt_b4", "plain_llama_b2"}
    assert "PyTorch" in reasons["nanogpt_b2"] or "nanoGPT" in reasons["nanogpt_b2"]
    assert "--plain-llama" in reasons["plain_llama_b2"]
    for arm, override in SCAN_LAYERS:  # each arm ran the model it names
        assert pieces[f"scan_layers_{arm}"]["result"]["model"]["scan_layers"] is (override.endswith("true"))
    assert r["summary"]["unrolled_over_scanned_tokens_per_sec"] > 0

    profile = pieces["profile"]["result"]
    assert profile["trace"]["events_from"] == "host"  # a CPU trace: XLA's CPU runtime on the host
    measured = profile["measured"]
    assert measured["module"] and measured["launches_per_step"] > 0 and measured["kernel_ms_per_step"] > 0
    assert measured["ops"] and all(row["ms_per_step"] >= 0 for row in measured["ops"])
    ruler = profile["ruler"]
    assert "not the program that ran" in ruler["program"] and "beside" not in profile
    assert ruler["step_seconds"] > 0 and ruler["launches"] > 0 and ruler["kernels"]

    # The parser on what the CPU run wrote: the same table as the run recorded.
    xplane = next(trace.rglob("*.xplane.pb"))
    events, where = trace_events(xplane)
    assert where == "host" and events and all(e["op"] and e["ns"] >= 0 for e in events)
    again = kernel_table(events, measured["module"], profile["steps_traced"])
    assert again["launches_per_step"] == measured["launches_per_step"]
    assert [row["op"] for row in again["ops"][:5]] == [row["op"] for row in measured["ops"][:5]]
