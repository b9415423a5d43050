"""jaxpar.compiled.hlo counts what a compiled program moves, checked on programs whose bytes are known by
construction: all-gathers, reduce-scatters, an all-reduce, an all-to-all and a collective-permute
of arrays whose shapes are written here, once or inside nested loops, compiled for 8 CPU devices
and for 8 H100s (jaxpar.compiled.targets; those cases skip without the gpu-compile extra). The H100
programs come in several forms of the same step: each kind of collective async in turn, XLA:GPU's
own choice, and everything synchronous; XLA:GPU combines the two all-gathers and the two
reduce-scatters into one tuple-shaped collective each.

Every expected number is arithmetic on the shapes below, by the module's convention (all-gather:
result bytes; reduce-scatter: input bytes; the others: operand bytes), times the loop trips.
"""

from __future__ import annotations

import functools
import math
import re

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpar.compiled import hlo
from jaxpar.compiled import targets as targets_lib

DEVICES = 8
# Per-device shapes (inside shard_map) of the buffers each collective works on.
GATHERED = [(64, 96), (64, 32)]  # results of two all-gathers (each input: 1/8 of the rows)
SCATTERED = [(128, 40), (64, 24)]  # inputs of two reduce-scatters (each result: 1/8 of the rows)
REDUCED = [(256, 512), (12,)]  # operands of one all-reduce of a pair (psum of a tuple)
EXCHANGED = (64, 8)  # operand of an all-to-all
PERMUTED = (16, 16)  # operand of a collective-permute
WORK = (256, 256)  # matmuls independent of the collectives, for XLA:GPU to overlap them with
LOOPS = (3, 2)  # a lax.scan of 3 around a lax.fori_loop of 2
F32 = 4


def _bytes(shapes, itemsize: int) -> int:
    return sum(math.prod(s) for s in shapes) * itemsize


def step(g1, g2, s1, s2, r1, r2, e, p, w):
    """Each collective once; each result feeds the next step's operand through a nonlinearity,
    so no collective can be hoisted out of a loop (XLA moves an all-reduce whose results are
    only summed over iterations out of the loop, and then it runs once)."""
    work = jnp.tanh(jnp.tanh(jnp.tanh(w @ w) @ w) @ w)

    def gather(x):
        whole = jax.lax.all_gather(x, "x", tiled=True)
        return jnp.sin(whole.reshape(DEVICES, *x.shape).sum(0)).astype(x.dtype)

    def scatter(x):
        return jnp.cos(jnp.tile(jax.lax.psum_scatter(x, "x", tiled=True), (DEVICES, 1)))

    r1, r2 = jax.lax.psum((r1, r2), "x")
    e = jnp.sin(jax.lax.all_to_all(e, "x", 0, 0, tiled=True))
    p = jnp.cos(jax.lax.ppermute(p, "x", [(i, (i + 1) % DEVICES) for i in range(DEVICES)]))
    return gather(g1), gather(g2), scatter(s1), scatter(s2), jnp.tanh(r1), jnp.tanh(r2), e, p, work


def looped(*operands):
    def outer(carry, _):
        return jax.lax.fori_loop(0, LOOPS[1], lambda i, c: step(*c), carry), None

    return jax.lax.scan(outer, operands, None, length=LOOPS[0])[0]


def _devices(backend: str, count: int = DEVICES):
    if backend == "cpu":
        return jax.devices()[:count]
    pytest.importorskip("jax_plugins.xla_cuda12", reason="needs the gpu-compile extra")
    return targets_lib.devices(targets_lib.resolve(f"h100:{count}"))


def _gather_dtype(backend: str):
    # XLA:CPU all-gathers bfloat16 in float32 (it converts around the collective): float32 there
    # keeps the known bytes the bytes written here.
    return jnp.float32 if backend == "cpu" else jnp.bfloat16


@functools.cache
def compiled_text(backend: str, in_loop: bool, sync: str | None) -> str:
    """HLO text of `step` (or `looped`) for 8 devices; `sync`: which async collectives XLA:GPU
    must compile as synchronous (its xla_gpu_disable_async_collectives)."""
    mesh = Mesh(_devices(backend), ("x",))
    gather_dtype = _gather_dtype(backend)
    # Global shapes: the gathered arrays are sharded over x (1/8 of the rows on each device),
    # the others replicated (each device's operand is the whole shape).
    shapes = GATHERED + SCATTERED + REDUCED + [EXCHANGED, PERMUTED, WORK]
    dtypes = [gather_dtype] * 2 + [jnp.float32] * 7
    specs = (P("x"), P("x")) + (P(),) * 7
    args = [
        jax.ShapeDtypeStruct(s, d, sharding=NamedSharding(mesh, spec))
        for s, d, spec in zip(shapes, dtypes, specs)
    ]
    program = jax.shard_map(
        looped if in_loop else step, mesh=mesh, in_specs=specs, out_specs=specs, check_vma=False
    )
    options = {"xla_gpu_disable_async_collectives": sync} if sync else None
    return jax.jit(program).lower(*args).compile(compiler_options=options).as_text()


ASYNC = {
    "all-gather": "ALLGATHER",
    "reduce-scatter": "REDUCESCATTER",
    "all-reduce": "ALLREDUCE",
    "all-to-all": "ALLTOALL",
    "collective-permute": "COLLECTIVEPERMUTE",
}


def _async_only(kind: str) -> str:
    """XLA:GPU's scheduler keeps about one collective async at a time in this small step, and
    which one is its choice; telling it to compile all the others synchronously picks it."""
    return ",".join(flag for other, flag in ASYNC.items() if other != kind)


# name: (backend, the collectives XLA:GPU must compile synchronously, forms expected)
PROGRAMS = {
    "cpu": ("cpu", None, {"all-gather", "reduce-scatter", "all-reduce"}),
    "h100": ("h100", None, {"reduce-scatter-start"}),
    "h100-sync": ("h100", "ALLCOLLECTIVES", {"all-gather", "reduce-scatter", "all-reduce"}),
    **{f"h100-async-{kind}": ("h100", _async_only(kind), {f"{kind}-start"}) for kind in ASYNC},
}
CASES = [(name, True) for name in PROGRAMS] + [(name, False) for name in ("cpu", "h100", "h100-sync")]
_FORM = re.compile(
    r" ((?:all-gather|reduce-scatter|all-reduce|all-to-all|collective-permute)(?:-start)?)"
    r"\((%[\w.\-]+(?:, %[\w.\-]+)*)\)"
)


def _forms(text: str) -> dict[str, int]:
    """{op name: most operands seen} of the collectives in `text`, read with a regex of its own."""
    found: dict[str, int] = {}
    for op, operands in _FORM.findall(text):
        found[op] = max(found.get(op, 0), operands.count("%"))
    return found


@pytest.mark.parametrize(
    "program, in_loop", CASES, ids=[f"{name}-{'in-loops' if loop else 'once'}" for name, loop in CASES]
)
def test_bytes_are_the_known_bytes(program, in_loop):
    backend, sync, _ = PROGRAMS[program]
    text = compiled_text(backend, in_loop, sync)
    trips = math.prod(LOOPS) if in_loop else 1
    gather_bytes = jnp.dtype(_gather_dtype(backend)).itemsize
    expected = {
        "all-gather": trips * _bytes(GATHERED, gather_bytes),
        "reduce-scatter": trips * _bytes(SCATTERED, F32),
        "all-reduce": trips * _bytes(REDUCED, F32),
        "all-to-all": trips * _bytes([EXCHANGED], F32),
        "collective-permute": trips * _bytes([PERMUTED], F32),
    }
    stats = hlo.collectives(text)
    assert {kind: s["bytes"] for kind, s in stats.items()} == expected
    # Counts: each collective instruction of the program (a regex count), once per trip.
    forms = re.findall(
        r" (all-gather|reduce-scatter|all-reduce|all-to-all|collective-permute)"
        r"(?:-start)?\(",
        text,
    )
    assert {kind: s["count"] for kind, s in stats.items()} == {
        kind: trips * forms.count(kind) for kind in expected
    }


@pytest.mark.parametrize("program", list(PROGRAMS))
def test_the_programs_have_the_forms_they_claim(program):
    """The counts above cover the forms named: async starts where XLA:GPU may keep them, none
    where it is told not to, and combined (tuple-shaped) collectives."""
    backend, sync, wanted = PROGRAMS[program]
    forms = _forms(compiled_text(backend, True, sync))
    assert wanted <= set(forms), forms
    if sync == "ALLCOLLECTIVES":
        assert not any(op.endswith("-start") for op in forms), forms
    if sync is not None and sync != "ALLCOLLECTIVES":  # exactly one kind kept async
        assert sum(op.endswith("-start") for op in forms) == 1, forms
    if backend == "h100":  # the two all-gathers and the two reduce-scatters combined
        assert max(forms.get("all-gather", 0), forms.get("all-gather-start", 0)) == 2, forms
        assert max(forms.get("reduce-scatter", 0), forms.get("reduce-scatter-start", 0)) == 2, forms
    else:  # XLA:CPU keeps psum's pair as one tuple-shaped all-reduce
        assert forms["all-reduce"] == 2, forms


# --- A gradient reduce-scatter written by the SPMD partitioner --------------------------------

ROWS, K, N = 256, 64, 48  # x: [ROWS, K], y: [ROWS, N], rows sharded; x.T @ y: [K, N]


@functools.cache
def gradient_text(backend: str, devices: int) -> str:
    mesh = Mesh(_devices(backend, devices), ("x",))

    def gradient(x, y, w):  # a weight gradient: summed over the rows, kept sharded over K;
        # w: local work for XLA:GPU to overlap the reduce-scatter with (async, as in a train step)
        grad = jax.lax.with_sharding_constraint(x.T @ y, NamedSharding(mesh, P("x", None)))
        return grad, jnp.tanh(jnp.tanh(w @ w) @ w)

    args = [
        jax.ShapeDtypeStruct(s, jnp.float32, sharding=NamedSharding(mesh, spec))
        for s, spec in (((ROWS, K), P("x")), ((ROWS, N), P("x")), (WORK, P()))
    ]
    return jax.jit(gradient).lower(*args).compile().as_text()


@pytest.mark.parametrize("backend", ["cpu", "h100"])
def test_a_gradient_reduce_scatter_counts_its_input_whatever_the_device_count(backend):
    """The whole [K, N] float32 gradient is the input of the reduce-scatter on 2 devices as on
    8: its bytes do not grow with the group. XLA:CPU writes it as all-reduce + dynamic-slice."""
    for devices in (2, 8):
        text = gradient_text(backend, devices)
        assert backend == "cpu" or "reduce-scatter-start(" in text
        stats = hlo.collectives(text)
        assert set(stats) == {"reduce-scatter"}, stats
        assert stats["reduce-scatter"]["bytes"] == K * N * F32
        assert stats["reduce-scatter"]["count"] == 1
        assert stats["reduce-scatter"].get("as_all_reduce", 0) == (1 if backend == "cpu" else 0)


# --- Conditionals and shapes -------------------------------------------------------------------


def test_a_collective_in_a_conditional_branch_counts_as_taken():
    mesh = Mesh(jax.devices(), ("x",))
    shape, trips = (32, 16), 3

    def body(i, x):
        return jax.lax.cond(x[0, 0] > 0, lambda v: jnp.sin(jax.lax.psum(v, "x")), jnp.cos, x)

    program = jax.shard_map(
        lambda x: jax.lax.fori_loop(0, trips, body, x),
        mesh=mesh,
        in_specs=P(),
        out_specs=P(),
        check_vma=False,
    )
    arg = jax.ShapeDtypeStruct(shape, jnp.float32, sharding=NamedSharding(mesh, P()))
    text = jax.jit(program).lower(arg).compile().as_text()
    assert "conditional(" in text
    stats = hlo.collectives(text)
    assert stats["all-reduce"] == {"count": trips, "bytes": trips * math.prod(shape) * F32, "dtypes": ["f32"]}


def test_tuple_elements_split_at_the_top_level_only():
    shape = "((bf16[8,96]{1,0}, bf16[8,32]{1,0}), (bf16[64,96]{1,0}, /*index=1*/bf16[64,32]{1,0}))"
    assert hlo.tuple_elements(shape) == [
        "(bf16[8,96]{1,0}, bf16[8,32]{1,0})",
        "(bf16[64,96]{1,0}, bf16[64,32]{1,0})",
    ]
    assert hlo.tuple_elements("f32[4,8]{1,0}") == ["f32[4,8]{1,0}"]
    assert hlo.tuple_elements("(f32[], u32[])") == ["f32[]", "u32[]"]


@pytest.mark.parametrize("sync", [None, "ALLCOLLECTIVES"], ids=["async", "sync"])
def test_a_small_all_reduce_in_a_triton_fusion_counts_once_per_trip(sync):
    """XLA:GPU runs a small all-reduce as a Triton kernel: the all-reduce sits inside a fusion's
    computation (`fusion-start` / `fusion-done` when async), and counts where the fusion runs."""
    mesh = Mesh(_devices("h100"), ("x",))
    shape, trips = (16, 16), 3

    def body(i, carry):
        x, w = carry  # w @ w: work to overlap the all-reduce with
        return jnp.tanh(jax.lax.psum(x, "x")), jnp.tanh(w @ w)

    program = jax.shard_map(
        lambda x, w: jax.lax.fori_loop(0, trips, body, (x, w)),
        mesh=mesh,
        in_specs=(P(), P()),
        out_specs=(P(), P()),
        check_vma=False,
    )
    args = [jax.ShapeDtypeStruct(s, jnp.float32, sharding=NamedSharding(mesh, P())) for s in (shape, WORK)]
    options = {"xla_gpu_disable_async_collectives": sync} if sync else None
    text = jax.jit(program).lower(*args).compile(compiler_options=options).as_text()
    assert "__triton_collective" in text
    stats = hlo.collectives(text)
    assert stats == {
        "all-reduce": {"count": trips, "bytes": trips * math.prod(shape) * F32, "dtypes": ["f32"]}
    }


def test_source_lines_follow_an_instruction_to_its_python_line():
    """The frame tables newer XLA prints before the computations: an instruction's
    stack_frame_id -> its file location -> file name and line. Guards a line read from the
    wrong table (a frame id taken for a location id) or an older metadata form ignored."""
    text = "\n".join(
        [
            "HloModule m",
            "",
            "FileNames",
            '1 "/src/a.py"',
            '2 "/src/b.py"',
            "",
            "FunctionNames",
            '1 "f"',
            "",
            "FileLocations",
            "1 {file_name_id=1 function_name_id=1 line=10 end_line=10 column=1 end_column=2}",
            "2 {file_name_id=2 function_name_id=1 line=20 end_line=20 column=1 end_column=2}",
            "",
            "StackFrames",
            "1 {file_location_id=2 parent_frame_id=1}",
            "2 {file_location_id=1 parent_frame_id=1}",
            "",
            "ENTRY %main (p: f32[4]) -> f32[4] {",
            "  %p = f32[4]{0} parameter(0)",
            '  %a = f32[4]{0} sine(%p), metadata={op_name="sin" stack_frame_id=1}',
            '  ROOT %b = f32[4]{0} cosine(%a), metadata={source_file="/src/c.py" source_line=7}',
            "}",
        ]
    )
    frames = hlo.source_lines(text)
    assert frames == {1: ("/src/b.py", 20), 2: ("/src/a.py", 10)}
    (entry,) = hlo.parse(text).values()
    assert [hlo.source_of(i, frames) for i in entry.instrs] == [None, ("/src/b.py", 20), ("/src/c.py", 7)]
