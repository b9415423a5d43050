"""jaxpar.compiled.ruler reads a compiled H100 program (jaxpar.compiled.targets: compiled here,
nothing runs) and costs each kernel launch. Checked on programs whose launches, FLOPs and bytes are known by
construction: one GEMM, the same GEMM in a loop, a stacked weight read a layer at a time, a
stacked output written a layer at a time, an elementwise op, cuDNN attention with and without
packed documents; and the `--kernels` command line end to end.

Every expected number is arithmetic on the shapes written here. The GEMM shapes are ones XLA:GPU
compiles into a single Triton GEMM without a split-K reduction (untuned default tiles: smaller
or skinnier shapes may get a second kernel that sums split-K partials).
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpar.compiled import ruler
from jaxpar.compiled import targets as targets_lib

pytest.importorskip("jax_plugins.xla_cuda12", reason="needs the gpu-compile extra")

M, K, N = 1024, 256, 1024  # one GEMM [M, K] x [K, N] in bfloat16
LAYERS = 5  # loop trips
BF16, F32 = 2, 4
RATES = ruler.RATES["h100"]


@functools.cache
def _mesh() -> Mesh:
    return Mesh(targets_lib.devices(targets_lib.resolve("h100:1")), ("d",))


def h100_text(fn, *shapes) -> str:
    """The optimized HLO of jit(fn) compiled for one H100, on abstract (shape, dtype) arguments."""
    mesh = _mesh()
    args = [jax.ShapeDtypeStruct(s, d, sharding=NamedSharding(mesh, P())) for s, d in shapes]
    with targets_lib.lowering_context(mesh):
        return jax.jit(fn).lower(*args).compile().as_text()


def _of_kind(found, kind):
    return [k for k in found if k.kind == kind]


def test_one_matmul_is_one_gemm_with_its_flops_and_bytes():
    """Guards a GEMM missed (a Triton GEMM fusion costed as a plain fusion, without FLOPs),
    FLOPs counted as output elements only (no contracted size), and bytes other than inputs +
    output; and a kernel with no Python line."""
    text = h100_text(lambda a, b: a @ b, ((M, K), jnp.bfloat16), ((K, N), jnp.bfloat16))
    found = ruler.kernels(text)
    assert [(k.kind, k.runs) for k in found] == [("gemm", 1)], found
    (gemm,) = found
    assert gemm.flops == 2 * M * N * K
    assert gemm.bytes == BF16 * (M * K + K * N + M * N)
    assert "test_ruler.py:" in gemm.source  # the Python line that made it


def test_the_estimate_is_the_roofline_plus_a_launch():
    """Guards the formula: max(FLOPs / GEMM rate, bytes / bandwidth) + one launch overhead,
    neither summed nor missing the launch, and the rates being the ones documented."""
    m, k, n = 4096, 1024, 4096  # 34.4 GFLOP (~46 us at the GEMM rate) against 50 MB (~18 us)
    text = h100_text(lambda a, b: a @ b, ((m, k), jnp.bfloat16), ((k, n), jnp.bfloat16))
    assert RATES.gemm_flops == pytest.approx(0.75 * 989.4e12)
    assert RATES.bandwidth == pytest.approx(0.85 * 3.35e12)
    flops, moved = 2 * m * n * k, BF16 * (m * k + k * n + m * n)
    expected = max(flops / (0.75 * 989.4e12), moved / (0.85 * 3.35e12)) + RATES.launch
    found = ruler.estimate(text, RATES)
    assert found.step_seconds(RATES.launch, RATES.empty_slot) == pytest.approx(expected, rel=1e-12)
    assert found.launches == 1 and found.empty_slots == 0
    (row,) = ruler.table(found.kernels, RATES)
    assert (row["bound"], row["seconds"]) == ("compute", pytest.approx(expected, rel=1e-12))
    # The small GEMM of the test above: ~0.7 us of compute and ~1.1 us of memory, under a launch.
    small = h100_text(lambda a, b: a @ b, ((M, K), jnp.bfloat16), ((K, N), jnp.bfloat16))
    assert [r["bound"] for r in ruler.table(ruler.kernels(small), RATES)] == ["launch"]


def test_a_loop_body_counts_once_per_trip():
    """Guards a while body counted once instead of per trip, and the loop's condition counted
    as a launch (with a known trip count XLA:GPU never evaluates it)."""

    def loop(x, w):
        return jax.lax.fori_loop(0, LAYERS, lambda i, x: jnp.tanh(x @ w), x)

    found = ruler.kernels(h100_text(loop, ((M, K), jnp.bfloat16), ((K, K), jnp.bfloat16)))
    gemms = _of_kind(found, "gemm")
    assert [k.runs for k in gemms] == [LAYERS]
    assert sum(k.runs * k.flops for k in gemms) == LAYERS * 2 * M * K * K
    # Per trip: the GEMM (tanh fused in), the counter's increment and a copy of the result into
    # the loop's carry (the GEMM does not write over its own input); before the loop, the copies
    # of its initial state (counter and x). No compare of the loop's condition.
    assert sum(k.runs for k in found) == 3 * LAYERS + 2, found
    assert not [k for k in found if "compare" in k.name], found
    (row,) = [r for r in ruler.table(found, RATES) if r["kind"] == "gemm"]
    assert row["count"] == LAYERS  # one row for the one source line, its launches summed


def test_a_stacked_weight_read_a_layer_at_a_time_costs_a_layer():
    """Guards the bytes of a whole stacked [L, K, K] buffer charged for each dynamic slice of
    it (L times too much: the layer scan's weights)."""

    def scan(x, ws):
        return jax.lax.scan(lambda x, w: (jnp.tanh(x @ w), None), x, ws)[0]

    found = ruler.kernels(h100_text(scan, ((M, K), jnp.bfloat16), ((LAYERS, K, K), jnp.bfloat16)))
    layer = BF16 * K * K
    per_trip = [k for k in found if k.runs == LAYERS]
    # The slice (read one layer, write it out, read the s32 index), the GEMM (x, the layer's
    # weights, the result), the counter's increment (read and write an s32) and the copy of the
    # result into the carry.
    expected = (2 * layer + 4) + BF16 * (M * K + K * K + M * K) + 8 + 2 * BF16 * M * K
    assert sum(k.bytes for k in per_trip) == expected, per_trip
    # Charged the whole stacked buffer, the slice alone would read LAYERS * layer bytes.
    assert [k.bytes for k in per_trip if k.kind == "fusion" and k.bytes > 8] == [2 * layer + 4]


def test_a_stacked_weight_read_by_an_unrolled_loop_costs_a_layer_per_layer():
    """Guards the whole stacked [L, K, K] buffer charged for each static slice of it (the
    unrolled layer loop's weights, model.scan_layers=false: L times too much)."""

    def unrolled(x, ws):
        for i in range(LAYERS):  # scaled by a number of x's, so that each layer's cast waits for x
            w = ws[i] * jnp.mean(x.astype(jnp.float32))
            x = jnp.tanh(x @ w.astype(jnp.bfloat16))
        return x

    found = ruler.kernels(h100_text(unrolled, ((M, K), jnp.bfloat16), ((LAYERS, K, K), jnp.float32)))
    casts = [k for k in found if k.kind == "fusion" and "convert" in k.name]
    # One per layer: its float32 slice read, a float32 scalar read, its bfloat16 copy written.
    assert [k.bytes for k in casts] == [F32 * K * K + F32 + BF16 * K * K] * LAYERS, casts


def test_a_stacked_output_written_a_layer_at_a_time_costs_a_layer():
    """Guards an in-place dynamic-update-slice charged the whole [L, ...] buffer it updates
    (read and written) instead of the update (the residuals a layer scan saves)."""

    def scan(x):
        return jax.lax.scan(lambda x, _: (jnp.sin(x), x), x, None, length=LAYERS)[1]

    found = ruler.kernels(h100_text(scan, ((M, K), jnp.float32)))
    layer = F32 * M * K
    per_trip = [k for k in found if k.runs == LAYERS]
    # sin (read x, write it), the update (read the layer, write it into the buffer, read the
    # s32 index) and the counter's increment.
    assert sum(k.bytes for k in per_trip) == 2 * layer + (2 * layer + 4) + 8, per_trip


def test_a_scatter_into_a_buffer_costs_the_rows_it_touches():
    """Guards an in-place scatter (an embedding's gradient, a log-softmax's gradient at the
    targets) charged the whole buffer it adds into, read and written, instead of its rows."""
    rows, width, touched = 4096, 256, 64

    def scatter_add(buffer, index, update):
        return buffer.at[index].add(update)

    shapes = ((rows, width), jnp.float32), ((touched,), jnp.int32), ((touched, width), jnp.float32)
    found = ruler.kernels(h100_text(scatter_add, *shapes))
    update = F32 * touched * width
    # XLA copies the (undonated) argument, then scatters into the copy in place: reads the
    # updates and indices, reads and writes the rows they touch.
    assert sorted((k.kind, k.bytes) for k in found) == [
        ("copy", 2 * F32 * rows * width),
        ("fusion", update + 4 * touched + 2 * update),
    ]


def test_an_elementwise_op_is_memory_bound_on_its_input_and_output():
    """Guards FLOPs invented for elementwise work and bytes other than input + output."""
    shape = (2048, 1024)
    found = ruler.kernels(h100_text(lambda x: jnp.sin(x) * 2, (shape, jnp.float32)))
    assert [(k.kind, k.runs, k.flops, k.bytes) for k in found] == [("fusion", 1, 0.0, 2 * F32 * 2048 * 1024)]
    seconds, bound = found[0].seconds(RATES)
    assert bound == "memory"
    assert seconds == pytest.approx(2 * F32 * 2048 * 1024 / RATES.bandwidth + RATES.launch)


ATTENTION = (2, 256, 4, 64)  # B, T, N, H
DOCUMENT_SLOTS = 8


def _attention_text(slots: int | None, grad: bool) -> str:
    from jaxpar.models.attention import attend

    b, t, _, _ = ATTENTION
    segments = None if slots is None else jnp.zeros((b, t), jnp.int32)

    def forward(q, k, v):
        return attend(q, k, v, segments, implementation="cudnn", max_segments=slots)

    def loss(q, k, v):
        return forward(q, k, v).astype(jnp.float32).sum()

    fn = jax.grad(loss, argnums=(0, 1, 2)) if grad else forward
    return h100_text(fn, *[(ATTENTION, jnp.bfloat16)] * 3)


@pytest.mark.parametrize("slots", [None, DOCUMENT_SLOTS], ids=["one-document", "packed"])
def test_cudnn_attention_flops_and_empty_document_slots(slots):
    """Guards cuDNN attention's FLOPs (4*B*N*T*T*H, halved for the causal mask; the backward
    2.5x) and the packed backward's empty (row, slot, head) count, read from the call's
    max_seg_per_batch: B x (slots - 1) x N, one document per row."""
    b, t, n, h = ATTENTION
    forward = 4 * b * n * t * t * h / 2
    found = ruler.kernels(_attention_text(slots, grad=True))
    (fwd,) = _of_kind(found, "attention")
    (bwd,) = _of_kind(found, "attention-backward")
    assert (fwd.flops, fwd.runs, fwd.empty_slots) == (forward, 1, 0)
    assert (bwd.flops, bwd.runs) == (2.5 * forward, 1)
    assert bwd.empty_slots == (0 if slots is None else b * (slots - 1) * n)
    assert ruler.estimate(_attention_text(slots, grad=True), RATES).empty_slots == bwd.empty_slots


def test_a_kernel_it_cannot_see_into_is_charged_its_bytes_and_flagged():
    """Guards an unknown custom call (a Pallas or Triton kernel) costed as zero, or passed off
    as costed: it is charged its operands and results, and marked."""
    from jaxpar.compiled import hlo

    text = "\n".join(
        [
            "ENTRY %main (p: f32[64,32]) -> f32[64,32] {",
            "  %p = f32[64,32]{1,0} parameter(0)",
            '  ROOT %k = f32[64,32]{1,0} custom-call(%p), custom_call_target="__gpu$xla.gpu.triton"',
            "}",
        ]
    )
    assert hlo.kernels(text) == {"__gpu$xla.gpu.triton": 1}
    (kernel,) = ruler.kernels(text)
    assert (kernel.kind, kernel.costed, kernel.bytes, kernel.flops) == (
        "custom",
        False,
        2 * F32 * 64 * 32,
        0.0,
    )
    (row,) = ruler.table([kernel], RATES)
    assert row["costed"] is False


def _inspect(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "jaxpar.inspect", *args],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )


def test_inspect_kernels_without_a_target_is_a_one_line_error(capsys):
    """Guards `--kernels` on a CPU program (nothing to cost) failing with a traceback."""
    from jaxpar.inspect import main

    assert main(["configs/tiny.yaml", "--kernels"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--target" in err


# configs/tiny.yaml in bfloat16 with head_dim 64: cuDNN attention on an H100.
TINY_H100 = ["model.dtype=bfloat16", "model.d_model=128", "model.n_heads=2", "model.n_kv_heads=2"]


def test_inspect_kernels_on_the_tiny_config_for_an_h100():
    """The command line end to end: the table's launches add up to the step's, its time is the
    step's, MFU is the model's FLOPs over that time, and cuDNN attention shows with its line."""
    done = _inspect("configs/tiny.yaml", *TINY_H100, "--target", "h100", "--kernels")
    assert done.returncode == 0, done.stderr
    r = json.loads(done.stdout)
    rows = r["kernels"]
    assert sum(row["count"] for row in rows) == r["launches"]
    assert sum(row["seconds"] for row in rows) == pytest.approx(r["step_seconds"])
    peak = r["rates"]["peak_flops"]
    assert r["mfu"] == pytest.approx(r["model_flops_per_step"] / (r["step_seconds"] * peak))
    assert [row["seconds"] for row in rows] == sorted((row["seconds"] for row in rows), reverse=True)
    attention = [row for row in rows if row["kind"] == "attention"]
    assert attention and attention[0]["source"].startswith("jaxpar/models/attention.py:")
    assert r["uncosted_kernels"] == 0
    # Rows of one document by default: the training loop's one-slot step (the plain causal call).
    assert (r["documents_per_row"], r["document_slots"]) == (1, 1)


def test_inspect_kernels_costs_the_step_for_the_documents_given():
    """`--documents 3` compiles the step the loop runs for rows of 3 documents (slot bucket 4 of
    the default 16: guards the flag ignored, or the bucket one short) and costs its empty slots
    for rows of 3, B x 1 x N: more than the one-document step, less than the 16-slot one."""
    done = _inspect("configs/tiny.yaml", *TINY_H100, "--target", "h100", "--kernels", "--documents", "3")
    assert done.returncode == 0, done.stderr
    r = json.loads(done.stdout)
    assert (r["documents_per_row"], r["document_slots"]) == (3, 4)
    (backward,) = [row for row in r["kernels"] if row["kind"] == "attention-backward"]
    b, n, layers = 8, 2, 2  # configs/tiny.yaml's batch and layers, TINY_H100's heads
    assert backward["count"] == layers
    flops, moved = backward["flops"] / layers, backward["bytes"] / layers  # per launch
    roofline = max(flops / RATES.attention_backward, moved / RATES.bandwidth) + RATES.launch
    empty = b * (4 - 3) * n * RATES.empty_slot  # per launch: one empty slot per row and head
    assert backward["seconds"] == pytest.approx(layers * (roofline + empty), rel=1e-9)


@pytest.mark.parametrize(
    "value, message",
    [
        ("17", "--documents 17: more than model.max_documents_per_row=16"),
        ("0", "--documents 0: a row of train.seq_len=32 tokens holds 1 to 32 documents"),
        ("many", "--documents many: a row of train.seq_len=32 tokens holds 1 to 32 documents"),
    ],
)
def test_inspect_refuses_documents_no_run_would_hold(value, message):
    done = _inspect("configs/tiny.yaml", *TINY_H100, "--target", "h100", "--kernels", f"--documents={value}")
    assert done.returncode == 2 and done.stdout == ""
    assert len(done.stderr.strip().splitlines()) == 1 and message in done.stderr, done.stderr
