"""Ragged MoE dispatch (jaxpar.parallel.experts, dispatch="ragged"): the same numbers as the
padded path, and on GPU the ragged collective and the grouped GEMM.

On CPU the ragged compute (sort by expert, `jax.lax.ragged_dot`, unsort) runs for real on one
device and on meshes without an expert axis. XLA:CPU cannot compile `ragged-all-to-all` (checked
on jax 0.12.0.1: "HLO opcode `ragged-all-to-all` is not supported by XLA:CPU"), so on expert
meshes the layer is run with `gathered_ragged_all_to_all` below in its place -- the same
contract made of all_gathers -- which checks the layer's sizes and offsets (and, since a wrong
`recv_sizes` turns the result into NaN, the sizes each side expects). The real collective is
checked in the H100 program, compiled on this machine.
"""

from __future__ import annotations

import functools
import re
import typing

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpar.checks import validate
from jaxpar.config import ConfigError, MoEDispatch, load_config
from jaxpar.parallel import experts
from jaxpar.parallel.experts import moe_mlp, ragged_receive_rows
from tests.test_experts import (
    BATCH,
    EMBED,
    EXPERTS,
    INPUTS,
    SEQ,
    SKEWED,
    TOP_K,
    assert_close,
    make_mesh,
    objective,
    shard_inputs,
)


def gathered_ragged_all_to_all(
    operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *, axis_name
):
    """`jax.lax.ragged_all_to_all`'s contract from all_gathers (runs on XLA:CPU): slice i of
    each device's operand (input_offsets[i], send_sizes[i] rows) goes to device
    i // (slices per device), written there at output_offsets[i]. A recv_sizes entry that
    differs from the size its sender sends makes the whole result NaN."""
    me = jax.lax.axis_index(axis_name)
    operands = jax.lax.all_gather(operand, axis_name)  # [devices, N, ...]
    starts, sizes, targets = (
        jax.lax.all_gather(a, axis_name) for a in (input_offsets, send_sizes, output_offsets)
    )
    devices, slices = starts.shape
    per_device = slices // devices
    rows = jnp.arange(output.shape[0])
    result, mismatch = output, jnp.bool_(False)
    for source in range(devices):
        for q in range(per_device):
            i = me * per_device + q
            start, size, target = starts[source, i], sizes[source, i], targets[source, i]
            inside = (rows >= target) & (rows < target + size)
            taken = jnp.clip(start + rows - target, 0, operand.shape[0] - 1)
            result = jnp.where(inside[:, None], operands[source][taken], result)
            mismatch |= recv_sizes[source * per_device + q] != size
    return jnp.where(mismatch, jnp.nan, result)


@functools.cache
def run(layout, dispatch, inputs="random", buffer_factor=None):
    """(y, stats, grads of the objective w.r.t. x and every weight) for a layout given as sorted
    (axis, size) pairs, in numpy."""
    mesh = make_mesh(**dict(layout))
    x, params, cotangent = {"random": INPUTS, "skewed": SKEWED}[inputs]
    x, params = shard_inputs(mesh, x, params)

    def loss(x, params):
        y, stats = moe_mlp(x, params, mesh=mesh, top_k=TOP_K, dispatch=dispatch, buffer_factor=buffer_factor)
        return objective(y, stats["aux_loss"], stats["z_loss"], cotangent), (y, stats)

    (_, (y, stats)), grads = jax.jit(jax.value_and_grad(loss, (0, 1), has_aux=True))(x, params)
    return jax.tree.map(np.asarray, (y, stats, grads))


def assert_same(actual, expected):
    (y, stats, grads), (y_ref, stats_ref, grads_ref) = actual, expected
    assert_close(y, y_ref, what="y")
    for name in ("aux_loss", "z_loss"):
        assert_close(stats[name], stats_ref[name], what=name)
    np.testing.assert_array_equal(stats["expert_load"], stats_ref["expert_load"])
    assert_close(grads[0], grads_ref[0], what="grad x")
    for name in grads_ref[1]:  # router, gate, up, down
        assert_close(grads[1][name], grads_ref[1][name], what=f"grad {name}")


def key(sizes):
    return tuple(sorted(sizes.items()))


LOCAL_LAYOUTS = [{}, {"data": 2, "tensor": 2}, {"data": 2, "fsdp": 2, "context": 2}]


@pytest.mark.parametrize(
    "sizes", LOCAL_LAYOUTS, ids=lambda s: "-".join(f"{k}{v}" for k, v in s.items()) or "one"
)
def test_ragged_compute_matches_padded_without_an_expert_axis(sizes):
    ragged = run(key(sizes), "ragged")
    assert_same(ragged, run(key(sizes), "padded"))
    assert_same(ragged, run((), "padded"))
    assert ragged[1]["dropped_fraction"] == 0.0


@pytest.fixture
def gathered_exchange(monkeypatch):
    monkeypatch.setattr(experts, "_ragged_all_to_all", gathered_ragged_all_to_all)


EXPERT_LAYOUTS = [{"expert": 2}, {"expert": 8}, {"expert": 2, "data": 2, "tensor": 2}]


@pytest.mark.parametrize("inputs", ["random", "skewed"])
@pytest.mark.parametrize("sizes", EXPERT_LAYOUTS, ids=lambda s: "-".join(f"{k}{v}" for k, v in s.items()))
def test_ragged_exchange_matches_padded_single_device(sizes, inputs, gathered_exchange):
    ragged = run(key(sizes), "ragged", inputs)
    assert_same(ragged, run((), "padded", inputs))
    assert ragged[1]["dropped_fraction"] == 0.0


def numpy_ragged_reference(x, params, devices, buffer_rows):
    """float64 loops: each batch shard routes its tokens; receiver j fills its buffer with its
    local expert 0's rows from sources 0, 1, ... (each source's in choice-major order), then local
    expert 1's, ...; a row at or past `buffer_rows` is dropped. Returns (y, dropped_fraction)."""
    x = np.asarray(x, np.float64)
    p = {k: np.asarray(v, np.float64) for k, v in params.items()}
    local = EXPERTS // devices
    blocks = [b.reshape(-1, EMBED) for b in np.split(x, devices)]
    routed = []
    for tokens in blocks:
        logits = tokens @ p["router"]
        probs = np.exp(logits - logits.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        top = np.argsort(-probs, axis=-1)[:, :TOP_K]
        chosen = np.take_along_axis(probs, top, -1)
        routed.append((top, chosen / chosen.sum(-1, keepdims=True)))
    kept = [np.zeros(top.shape, bool) for top, _ in routed]
    for j in range(devices):
        filled = 0
        for e in range(j * local, (j + 1) * local):
            for s, (top, _) in enumerate(routed):
                for choice in range(TOP_K):
                    for t in np.nonzero(top[:, choice] == e)[0]:
                        kept[s][t, choice] = filled < buffer_rows
                        filled += 1
    outputs = []
    for tokens, (top, weights), keep in zip(blocks, routed, kept):
        y = np.zeros_like(tokens)
        for t, choice in zip(*np.nonzero(keep)):
            e = top[t, choice]
            gate = tokens[t] @ p["gate"][e]
            y[t] += weights[t, choice] * (
                (gate / (1 + np.exp(-gate)) * (tokens[t] @ p["up"][e])) @ p["down"][e]
            )
        outputs.append(y)
    dropped = 1 - sum(k.sum() for k in kept) / (x.shape[0] * x.shape[1] * TOP_K)
    return np.concatenate(outputs).reshape(x.shape), dropped


def test_buffer_factor_drops_past_the_buffer_and_counts_it(gathered_exchange):
    """Below the worst case, a skewed step overflows the receive buffer: the rows past it are
    dropped by the documented rule and counted in dropped_fraction, never lost silently."""
    tokens = BATCH * SEQ // 4
    rows = ragged_receive_rows(tokens, TOP_K, EXPERTS, 4, buffer_factor=1.0)
    assert rows == tokens * TOP_K < ragged_receive_rows(tokens, TOP_K, EXPERTS, 4)
    y, stats, _ = run(key({"expert": 4}), "ragged", "skewed", buffer_factor=1.0)
    x, params, _ = SKEWED
    y_ref, dropped_ref = numpy_ragged_reference(x, params, 4, rows)
    assert dropped_ref > 0.5  # the skew overflows expert 0 and 1's device
    assert_close(stats["dropped_fraction"], dropped_ref, 1e-6, "dropped_fraction")
    assert_close(y, y_ref, what="y")
    # (The worst-case buffer drops nothing on the same skew: test_ragged_exchange_..., skewed.)


def test_ragged_with_an_expert_axis_on_cpu_is_refused_up_front():
    x, params, _ = INPUTS
    with pytest.raises(
        ConfigError,
        match=r"model.moe.dispatch=ragged .*XLA:CPU cannot compile "
        r"ragged-all-to-all; use model.moe.dispatch=padded",
    ):
        moe_mlp(x, params, mesh=make_mesh(expert=2), top_k=TOP_K, dispatch="ragged")


def test_auto_is_ragged_only_on_gpu_when_dropless_without_fp8_and_no_costlier():
    assert set(experts.DISPATCHES) == set(typing.get_args(MoEDispatch))  # the config's choices
    resolve = experts.resolve_dispatch
    one_per_device = {"top_k": 2, "local_experts": 1}
    assert resolve("auto", None, "gpu", **one_per_device) == "ragged"
    assert resolve("auto", None, "gpu", top_k=1, local_experts=4) == "ragged"
    # Two local experts, top-2: XLA's ragged_dot would do twice the padded matmul work.
    assert resolve("auto", None, "gpu", top_k=2, local_experts=2) == "padded"
    assert resolve("auto", None, "gpu", top_k=2, local_experts=2, buffer_factor=1.5) == "ragged"
    assert resolve("auto", None, "cpu", **one_per_device) == "padded"
    assert resolve("auto", 1.25, "gpu", **one_per_device) == "padded"
    assert resolve("auto", None, "gpu", fp8=True, **one_per_device) == "padded"
    assert resolve("padded", None, "gpu", **one_per_device) == "padded"
    assert resolve("ragged", None, "gpu", top_k=2, local_experts=2) == "ragged"
    with pytest.raises(ValueError, match="capacity_factor=None"):
        resolve("ragged", 1.25, "gpu")


MOE = ["model.moe.num_experts=8", "model.moe.top_k=2", "model.moe.every=2"]


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["model.moe.dispatch=ragged", "model.moe.capacity_factor=1.25"],
            r"model.moe.dispatch=ragged is dropless but model.moe.capacity_factor=1.25",
        ),
        (
            ["model.moe.dispatch=ragged", "model.fp8=true"],
            r"model.moe.dispatch=ragged has no float8 grouped GEMM",
        ),
        (["model.moe.ragged_buffer_factor=0.5"], r"model.moe.ragged_buffer_factor=0.5: use a number >= 1"),
        (
            ["model.moe.dispatch=padded", "model.moe.ragged_buffer_factor=2"],
            r"model.moe.ragged_buffer_factor=2.0 sizes the ragged dispatch's buffer, but "
            r"model.moe.dispatch=padded",
        ),
        (["model.moe.dispatch=sorted"], r"model.moe.dispatch"),
    ],
)
def test_bad_dispatch_settings_are_config_errors(overrides, message):
    with pytest.raises(ConfigError, match=message):
        validate(load_config(None, MOE + overrides), 8)


def test_good_dispatch_settings_validate():
    for overrides in (
        ["model.moe.dispatch=ragged", "model.moe.ragged_buffer_factor=2"],
        ["model.moe.dispatch=padded", "model.moe.capacity_factor=1.25"],
        [],
    ):
        validate(load_config(None, MOE + overrides), 8)


# --- The H100 program -------------------------------------------------------------------------


def _instructions(text: str, op: str) -> list[str]:
    """HLO instructions of kind `op` (sync or async start), without their metadata."""
    return [
        line.split(", metadata=")[0] for line in text.splitlines() if re.search(rf" {op}(-start)?\(", line)
    ]


@functools.cache
def h100_program(dispatch: str):
    """(trainer, compiled step, report) of a small MoE model (8 experts, top-2, expert=4: two
    experts per GPU, which "auto" would run padded) for 4 H100s."""
    pytest.importorskip("jax_plugins.xla_cuda12", reason="needs the gpu-compile extra")
    from tests.test_gpu_program import compiled_for

    return compiled_for(
        4,
        **{
            "mesh.data": 1,
            "mesh.fsdp": 1,
            "mesh.tensor": 1,
            "mesh.expert": 4,
            "parallel.zero_stage": 0,
            "model.attention": "xla",
            "model.n_layers": 1,
            "model.d_model": 128,
            "model.d_ff": 256,
            "model.vocab_size": 1024,
            "model.moe.num_experts": 8,
            "model.moe.top_k": 2,
            "model.moe.every": 1,
            "model.moe.dispatch": dispatch,
            "train.seq_len": 128,
        },
    )


def test_h100_program_has_the_ragged_exchange_and_grouped_gemm_not_the_padded_buffers():
    trainer, compiled, report = h100_program("ragged")
    cfg = trainer.cfg
    text = compiled.as_text()
    tokens = cfg.train.batch_size // 4 * cfg.train.seq_len  # per device
    exchanges = _instructions(text, "ragged-all-to-all")
    assert len(exchanges) >= 4, exchanges  # dispatch and return, forward and backward
    assert report["collectives"]["ragged-all-to-all"]["count"] >= 4, report["collectives"]
    # The dispatch sends exactly the routed rows: [tokens * top_k, d_model] in bfloat16.
    assert any(f"(bf16[{tokens * 2},{cfg.model.d_model}]" in line for line in exchanges), exchanges
    # The grouped GEMMs: XLA (jax 0.12) compiles each ragged_dot into GEMMs over the rows it
    # received, named after it; three forward (gate, up, down), more backward.
    grouped = [
        line
        for line in text.splitlines()
        if 'ragged_dot_general"' in line
        and re.search(r" (dot|fusion)\(", line)
        and ("dot(" in line or "gemm_fusion" in line)
    ]
    assert len(grouped) >= 3 * 2, len(grouped)
    # No padded exchange: the only all-to-alls left move integer offsets (the ragged exchange's
    # gradient computes where its slices came from), none the [experts * capacity] buffers ...
    assert not float_all_to_alls(text)
    # ... and the exchange adds no all-reduce: the same all-reduced bytes as the padded program
    # (an exchange into a buffer that does not vary over `expert` would all-reduce its gradient).
    padded = h100_program("padded")[2]
    assert report["collectives"]["all-reduce"]["bytes"] == padded["collectives"]["all-reduce"]["bytes"]


def float_all_to_alls(text: str) -> list[str]:
    return [
        line
        for line in _instructions(text, "all-to-all")
        if set(re.findall(r"\b(bf16|f16|f32|s32|s64)\[", line.split(" all-to-all")[0])) - {"s32", "s64"}
    ]


def test_h100_padded_program_exchanges_the_padded_buffers():
    """The contrast: dispatch=padded all_to_alls [experts * capacity, d_model] bfloat16 buffers."""
    trainer, compiled, _ = h100_program("padded")
    text = compiled.as_text()
    tokens = trainer.cfg.train.batch_size // 4 * trainer.cfg.train.seq_len
    assert not _instructions(text, "ragged-all-to-all")
    buffers = float_all_to_alls(text)
    assert len(buffers) == 4 and all(
        f"bf16[{8 * tokens},{trainer.cfg.model.d_model}]" in line for line in buffers
    ), buffers


@pytest.mark.parametrize("expert, picked", [(8, "ragged"), (4, "padded")])
def test_auto_reads_the_platform_from_the_mesh_devices(expert, picked):
    """H100 devices (compile-only) in the mesh: auto is ragged with one expert per device and
    padded with two (top-2); the same call on this machine's CPU devices is padded."""
    pytest.importorskip("jax_plugins.xla_cuda12", reason="needs the gpu-compile extra")
    from jax.sharding import Mesh

    from jaxpar.compiled import targets as targets_lib
    from tests.test_experts import AXES

    x, params, _ = INPUTS
    shape = tuple(expert if name == "expert" else 1 for name in AXES)
    gpus = targets_lib.devices(targets_lib.resolve("h100:8"))[:expert]
    for devices, want in ((gpus, picked), (jax.devices()[:expert], "padded")):
        mesh = Mesh(np.array(devices).reshape(shape), AXES)
        jaxpr = str(jax.make_jaxpr(lambda x, p: moe_mlp(x, p, mesh=mesh, top_k=TOP_K))(x, params))
        assert ("ragged_all_to_all" in jaxpr) == (want == "ragged"), (devices[0].platform, want)
