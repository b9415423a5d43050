"""benchmarks/maxtext_compare.py without MaxText: its counting on a hand-written program whose
collectives and matmuls are known by construction, its table, and its exit without a MaxText
environment (code 2, the install hint, no traceback). The comparison itself needs MaxText's own
environment and is recorded in benchmarks/RESULTS.md."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from benchmarks import maxtext_compare as mc
from tests.test_train import ROOT

# A while loop run 3 times around an all-gather of a bf16 [16, 8] shard to [64, 8] over groups
# of 4 (iota form) and a float32 dot of the gathered [64, 8] with itself, contracting 64; an async
# combined all-gather of float32[4] and bf16[2, 8] to [16] and [8, 8] over 4; a reduce-scatter of
# float32[16] over groups of 4 (explicit form); an all-reduce of float32[10] over the 'data' axis
# of a 2 x 4 mesh (2 devices); and a cuBLAS GEMM of bf16[4,16] x bf16[16,2].
FIXTURE = """HloModule fixture

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%cond (cp: (s32[], bf16[16,8])) -> pred[] {
  %cp = (s32[], bf16[16,8]{1,0}) parameter(0)
  %ci = s32[] get-tuple-element(%cp), index=0
  %three = s32[] constant(3)
  ROOT %lt = pred[] compare(%ci, %three), direction=LT
}

%body (p: (s32[], bf16[16,8])) -> (s32[], bf16[16,8]) {
  %p = (s32[], bf16[16,8]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %w = bf16[16,8]{1,0} get-tuple-element(%p), index=1
  %ag = bf16[64,8]{1,0} all-gather(%w), channel_id=1, replica_groups=[2,4]<=[8], dimensions={0}
  %x = f32[64,8]{1,0} convert(%ag)
  %y = f32[8,8]{1,0} dot(%x, %x), lhs_contracting_dims={0}, rhs_contracting_dims={0}
  %one = s32[] constant(1)
  %next = s32[] add(%i, %one)
  ROOT %t = (s32[], bf16[16,8]{1,0}) tuple(%next, %w)
}

ENTRY %main (w0: bf16[16,8], ...) -> f32[4] {
  %w0 = bf16[16,8]{1,0} parameter(0)
  %g = f32[16]{0} parameter(1)
  %h = f32[10]{0} parameter(2)
  %l = bf16[4,16]{1,0} parameter(3)
  %r = bf16[16,2]{1,0} parameter(4)
  %a1 = f32[4]{0} parameter(5)
  %b1 = bf16[2,8]{1,0} parameter(6)
  %ags = ((f32[4]{0}, bf16[2,8]{1,0}), (f32[16]{0}, bf16[8,8]{1,0})) all-gather-start(%a1, %b1), GROUPS
  %agd = (f32[16]{0}, bf16[8,8]{1,0}) all-gather-done(%ags)
  %zero = s32[] constant(0)
  %init = (s32[], bf16[16,8]{1,0}) tuple(%zero, %w0)
  %loop = (s32[], bf16[16,8]{1,0}) while(%init), condition=%cond, body=%body, backend_config=TRIPS
  %rs = f32[4]{0} reduce-scatter(%g), replica_groups={{0,1,2,3},{4,5,6,7}}, dimensions={0}, to_apply=%add
  %ar = f32[10]{0} all-reduce(%h), replica_groups=mesh['data'=2,'fsdp'=4] {'data'}, to_apply=%add
  %gemm = (bf16[4,2], s8[64]) custom-call(%l, %r), custom_call_target="__cublas$gemm", backend_config=GEMM
  %use = f32[10]{0} add(%ar, %ar)
  ROOT %out = f32[4]{0} add(%rs, %rs)
}
"""
GEMM = '{"gemm_backend_config":{"dot_dimension_numbers":{"lhs_contracting_dimensions":["1"],'
GEMM += '"rhs_contracting_dimensions":["0"]}}}'
FIXTURE = FIXTURE.replace("GROUPS", "replica_groups=[2,4]<=[8], dimensions={0}")
FIXTURE = FIXTURE.replace("TRIPS", '{"known_trip_count":{"n":"3"}}').replace("=GEMM", "=" + GEMM)
MEMORY = {"argument": 1000, "output": 600, "alias": 500, "temp": 2_000_000_000}


@pytest.fixture(scope="module")
def summary():
    return mc.program_summary(FIXTURE, MEMORY, devices=8)


def test_collectives_by_kind_and_dtype(summary):
    c = summary["collectives"]
    gathered = 3 * 64 * 8 * 2 + 16 * 4 + 8 * 8 * 2  # the loop's, then the combined one's
    assert c["all-gather"] == {"calls": 4, "bytes": gathered, "by_dtype": {"bf16": 3072 + 128, "f32": 64}}
    assert c["reduce-scatter"] == {"calls": 1, "bytes": 16 * 4, "by_dtype": {"f32": 64}}
    assert c["all-reduce"] == {"calls": 1, "bytes": 10 * 4, "by_dtype": {"f32": 40}}
    assert summary["collective_bytes"] == gathered + 64 + 40


def test_wire_bytes_follow_each_group_size(summary):
    # all-gathers over 4: 3/4 of 3072 + 192; reduce-scatter over 4: 3/4 of 64; all-reduce over
    # 2: 2 x 1/2 of 40.
    assert summary["wire_bytes"] == 2448 + 48 + 40


@pytest.mark.parametrize(
    "groups, size",
    [
        ("replica_groups={{0,1},{2,3},{4,5},{6,7}}", 2),
        ("replica_groups=[1,8]<=[8]", 8),
        ("replica_groups=mesh['data'=2,'fsdp'=4] {'fsdp'}", 4),
        ("replica_groups=mesh['data'=2,'fsdp'=4] {'data','fsdp'}", 8),
        ("replica_groups=mesh['axis_0'=8]", 8),
        ("replica_groups={}", 8),
    ],
)
def test_group_size_in_each_spelling(groups, size):
    ins = mc.hlo.Instr("ar", "f32[4]", "all-reduce", ["x"], f"%ar = f32[4] all-reduce(%x), {groups}")
    assert mc.group_size(ins, devices=8) == size


def test_matmul_flops_by_operand_types(summary):
    # The loop's dot: 2 x (8 x 8) x 64, three times; the GEMM: 2 x (4 x 2) x 16 once.
    assert summary["matmul_flops_by_operands"] == {"f32 x f32": 3 * 2 * 64 * 64, "bf16 x bf16": 256}
    assert summary["matmul_flops"] == 3 * 8192 + 256


def test_memory_total_is_arguments_plus_outputs_less_aliases_plus_temp(summary):
    assert summary["memory"] == {"total": 1000 + 600 - 500 + 2_000_000_000, "temp": 2_000_000_000}


def test_table(summary):
    table = mc.format_table({"jaxpar": summary, "MaxText": summary})
    lines = table.splitlines()
    assert lines[0] == "| per device per step | jaxpar | MaxText |"
    rows = {line.split(" | ")[0].strip("| "): line for line in lines[2:]}
    assert list(rows) == [
        "total memory (temp)",
        "all-gather",
        "reduce-scatter",
        "all-reduce",
        "collective bytes in all",
        "wire bytes (ring)",
        "matmul TFLOP",
    ]
    assert "| 2.00 GB (2.00) |" in rows["total memory (temp)"]
    assert "4 calls, 3.26 KB (bf16 3.20 KB, f32 64 B)" in rows["all-gather"]
    assert "(f32 x f32: 0.0, 99%)" in rows["matmul TFLOP"]


def test_without_maxtext_it_exits_2_with_the_install_hint():
    """jaxpar's own Python has no maxtext: one line saying how to build an environment."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.maxtext_compare", "--maxtext-python", sys.executable],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "maxtext==0.2.5" in lines[0] and sys.executable in lines[0], done.stderr


def test_maxtext_gets_jaxpars_model_dimensions():
    from jaxpar.config import load_config

    cfg = load_config(os.path.join(ROOT, "configs", "llama-1b.yaml"), ["train.seq_len=1024"])
    settings = dict(s.split("=", 1) for s in mc.maxtext_model(cfg))
    assert settings["base_emb_dim"] == "2048" and settings["head_dim"] == "64"
    assert (settings["base_num_query_heads"], settings["base_num_kv_heads"]) == ("32", "8")
    assert (settings["base_mlp_dim"], settings["base_num_decoder_layers"]) == ("8192", "16")
    assert (settings["vocab_size"], settings["logits_via_embedding"]) == ("128256", "true")
    assert (settings["rope_max_timescale"], settings["max_target_length"]) == ("500000", "1024")
    gemma_like = load_config(os.path.join(ROOT, "configs", "llama-1b.yaml"), ["model.embed_scale=true"])
    with pytest.raises(ValueError, match="plain Llama"):
        mc.maxtext_model(gemma_like)


def test_the_maxtext_side_imports_nothing_until_asked():
    """benchmarks/maxtext_step.py runs under MaxText's Python, where jaxpar is not installed: with
    bad arguments it prints its usage and exits 2 before importing jax, maxtext or jaxpar."""
    code = (
        "import runpy, sys\nsys.argv = ['maxtext_step.py']\n"
        "try:\n    runpy.run_path('benchmarks/maxtext_step.py', run_name='__main__')\n"
        "except SystemExit as e:\n"
        "    print(e.code, sorted(m for m in ('jax', 'maxtext', 'jaxpar') if m in sys.modules))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.stdout.split() == ["2", "[]"], done.stdout + done.stderr
    assert "SPEC_FILE DEVICES OUT_DIR" in done.stderr
