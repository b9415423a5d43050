"""The H100 program, compiled on this GPU-less machine (jaxpar.compiled.targets) and checked for structure.

Nothing here runs on a GPU: XLA's GPU compiler builds the real sm_90a program from the CUDA
plugin's embedded H100 description, and these tests read facts of that program: which library
kernels it calls (cuDNN flash attention, with no dense mask), which element types its
collectives move, whether the train state is donated, whether a float32 [tokens x vocab] logits
buffer exists. (Memory targets: test_gpu_memory.py.)
"""

from __future__ import annotations

import functools
import re

import pytest

from jaxpar.checks import validate
from jaxpar.compiled import hlo
from jaxpar.compiled import targets as targets_lib
from jaxpar.config import load_config
from jaxpar.inspect import compile_step, report
from jaxpar.run.train import build_trainer

pytest.importorskip("jax_plugins.xla_cuda12", reason="needs the gpu-compile extra")

# Small enough to compile in seconds, shaped like the real thing: head_dim 64 (cuDNN's flash
# path wants 64 or 128), a vocabulary that dwarfs the model. The loss is split into 4 chunks
# explicitly (its automatic choice keeps whole logits below 256 MiB, which these are).
SMALL = {
    "model.vocab_size": 8192,
    "model.d_model": 256,
    "model.n_layers": 2,
    "model.n_heads": 4,
    "model.n_kv_heads": 2,
    "model.d_ff": 512,
    "train.batch_size": 8,
    "train.seq_len": 256,
    "train.loss_chunks": 4,
}
GIB = 2**30


def compiled_for(devices: int, **overrides):
    """(trainer, compiled step, report) for `devices` H100s, as `inspect --target h100:N` does."""
    settings = {**SMALL, "runtime.cpu_devices": devices, **overrides}
    cfg = load_config(None, [f"{k}={v}" for k, v in settings.items()])
    target = targets_lib.resolve(f"h100:{devices}")
    trainer = build_trainer(cfg, validate(cfg, devices), devices=targets_lib.devices(target))
    compiled = compile_step(trainer)
    return trainer, compiled, report(trainer, compiled, target=target)


@pytest.fixture(scope="module")
def one_gpu():
    return compiled_for(1, **{"mesh.data": 1, "mesh.fsdp": 1, "mesh.tensor": 1, "parallel.zero_stage": 0})


@functools.cache
def fsdp4_at(stage: int, reduce_dtype: str = "null"):
    # XLA's attention here: the collectives are the point, and it compiles faster. A vocabulary
    # of 512 keeps the head a small part of the parameters (see the ZeRO-2 memory test).
    return compiled_for(
        4,
        **{
            "mesh.data": 1,
            "mesh.fsdp": 4,
            "mesh.tensor": 1,
            "parallel.zero_stage": stage,
            "parallel.grad_reduce_dtype": reduce_dtype,
            "model.attention": "xla",
            "model.vocab_size": 512,
        },
    )


@pytest.fixture(scope="module", params=[1, 2, 3], ids=["zero1", "zero2", "zero3"])
def fsdp4(request):
    return fsdp4_at(request.param)


def _custom_calls(text: str, target_prefix: str) -> list[str]:
    return [
        line
        for line in text.splitlines()
        if "custom-call(" in line and f'custom_call_target="{target_prefix}' in line
    ]


def test_attention_is_cudnn_flash_without_a_dense_mask(one_gpu):
    trainer, compiled, r = one_gpu
    kernels = r["kernels"]
    forward = [k for k in kernels if k.startswith("__cudnn$fmha") and "Backward" not in k]
    backward = [k for k in kernels if k.startswith("__cudnn$fmha") and "Backward" in k]
    layers = trainer.cfg.model.n_layers
    assert sum(kernels[k] for k in forward) == layers, kernels
    assert sum(kernels[k] for k in backward) == layers, kernels
    assert not any("Bias" in k or "Mask" in k for k in kernels), kernels
    # No operand of the attention calls is a [batch, 1 or heads, seq, seq] mask or bias.
    t = trainer.cfg.train.seq_len
    for line in _custom_calls(compiled.as_text(), "__cudnn$fmha"):
        operands = line.split("custom-call(", 1)[1]
        assert not re.search(
            rf"\[\d+,\d+,{t},{t}\]", line.split(" = ", 1)[1].split("custom-call(")[0] + operands
        )


def test_no_float32_logits_for_every_token(one_gpu):
    trainer, compiled, _ = one_gpu
    t, m = trainer.cfg.train, trainer.cfg.model
    tokens, vocab = t.batch_size * t.seq_len, m.vocab_size
    for dtype, dims in hlo._ARRAY.findall(compiled.as_text()):
        if dtype == "f32" and dims:
            sizes = [int(d) for d in dims.split(",")]
            count = 1
            for d in sizes:
                count *= d
            assert not (vocab in sizes and count >= tokens * vocab), f"f32[{dims}]"


def test_train_state_is_donated(one_gpu):
    from jaxpar.sharding import shard_bytes

    trainer, compiled, _ = one_gpu
    state_bytes = shard_bytes(trainer.state_shape, trainer.state_shardings)  # counters included
    assert compiled.memory_analysis().alias_size_in_bytes == state_bytes


def test_zero1_to_3_reduce_scatter_the_gradients(fsdp4):
    """Every stage that shards the optimizer state reduce-scatters the gradients to its shards;
    ZeRO-1 all-reduced them whole and sliced them (twice the bytes) before."""
    trainer, _, r = fsdp4
    scatters = r["collectives"]["reduce-scatter"]
    assert scatters["count"] >= trainer.cfg.model.n_layers
    assert "as_all_reduce" not in scatters  # a real reduce-scatter, not all-reduce + slice
    # No gradient is all-reduced whole: what all-reduces remains is scalars (loss, norms).
    assert r["collectives"].get("all-reduce", {"bytes": 0})["bytes"] < 1024


def test_zero1_keeps_a_quarter_of_the_gradients_among_the_temporaries():
    """ZeRO-0 -> ZeRO-1 on 4 GPUs: the gradients are reduce-scattered to the optimizer shards,
    layer by layer in the backward, so the float32 gradients (4 bytes per parameter) shrink to
    their shard among XLA's temporaries: by the formula's 4 psi (1 - 1/4). ZeRO-2 shards the
    gradients the same way, so its program keeps exactly as much (ZeRO-1 used to all-reduce
    whole gradients, keeping all of them: 4.33 MB more here). This is a fact of the GPU program:
    XLA:CPU computes each reduce-scatter as an all-reduce of the whole gradient followed by a
    slice (jaxpar.compiled.hlo).

    One gradient is whole per device on purpose under every stage: the output weight's, whose
    partial sums the chunked loss keeps per device until its one reduction after the chunk loop
    (jaxpar.models.loss); here it is 9% of the parameters (vocabulary 512)."""
    (_, zero0, r0), (_, zero1, _), (_, zero2, _) = fsdp4_at(0), fsdp4_at(1), fsdp4_at(2)
    temp = {stage: c.memory_analysis().temp_size_in_bytes for stage, c in enumerate((zero0, zero1, zero2))}
    assert temp[1] == temp[2], temp
    # Within 25%: the rest of the temporaries move between the two programs too (the optimizer
    # update of whole tensors at ZeRO-0, and how XLA packs the buffers; measured: 0.85 of the
    # formula, 0.80 since `wo` and `w_down` split on their first dim, jax 0.12.0.1). Whole
    # gradients at ZeRO-1 would make the difference about 0.
    assert temp[0] - temp[1] == pytest.approx(4 * r0["params"] * (1 - 1 / 4), rel=0.25)


def test_zero3_gathers_weights_in_bf16_zero2_the_updated_float32_masters(fsdp4):
    trainer, compiled, _ = fsdp4
    # ZeRO-3 gathers each layer's weights for its matmuls: model.dtype. ZeRO-2 gathers the
    # updated shards of the float32 master weights after the optimizer step.
    wanted = "bf16" if trainer.cfg.parallel.zero_stage == 3 else "f32"
    gathers = [
        line for line in compiled.as_text().splitlines() if re.search(r"= .* all-gather(-start)?\(", line)
    ]
    assert gathers
    for line in gathers:
        result = line.split(" = ", 1)[1].split(" all-gather", 1)[0]
        for dtype, dims in hlo._ARRAY.findall(result):
            # A weight matrix; the norm scales are float32 vectors, the token ids (s32) are
            # gathered for the embedding's gradient (jaxpar.models.llama.lookup).
            if dims.count(",") >= 1 and dtype != "s32":
                assert dtype == wanted, line[:300]


def test_zero3_keeps_no_float32_copy_of_a_weight_stack_in_another_order():
    """Each ZeRO-3 weight is split over fsdp on its first dim after the layers' (`wo` and
    `w_down` on their input dim, `jaxpar.sharding.OUTER_NAMES`), so a layer's slice is gathered
    along its outermost dim. Split on their last dim (`embed`, as before), XLA:GPU copied each
    of the two whole float32 stacks with that dim first before the layer loop and kept the copy
    for the step: 0.99 GB per device on the Llama-2-7B shape over 8 H100s. Four layers here:
    with the SMALL model's two, XLA:GPU made no such copy with either split."""
    import jax

    trainer, compiled, _ = compiled_for(
        4,
        **{
            "mesh.data": 1,
            "mesh.fsdp": 4,
            "mesh.tensor": 1,
            "parallel.zero_stage": 3,
            "model.attention": "xla",
            "model.vocab_size": 512,
            "model.n_layers": 4,
        },
    )
    layers = trainer.cfg.model.n_layers
    blocks = trainer.state_shardings["params"]["blocks"]
    stacks = [
        tuple(sharding.shard_shape(leaf.shape))
        for leaf, sharding in zip(
            jax.tree.leaves(trainer.state_shape["params"]["blocks"]), jax.tree.leaves(blocks)
        )
        if len(leaf.shape) >= 3
    ]
    assert stacks
    (entry,) = [comp for comp in hlo.parse(compiled.as_text()).values() if comp.is_entry]
    arguments = {ins.name for ins in entry.instrs if ins.op == "parameter"}
    for ins in entry.instrs:  # what the step makes of its arguments before and between loops
        if ins.op == "bitcast" or not set(ins.operands) & arguments:
            continue
        for dtype, found in hlo._ARRAY.findall(ins.shape):
            dims = tuple(int(d) for d in found.split(",") if d)
            for stack in stacks:  # the same dims in another order, the layers' not first
                assert not (dtype == "f32" and sorted(dims) == sorted(stack) and dims[0] != layers), ins.text[
                    :200
                ]


# --- The head and loss under ZeRO-3 ------------------------------------------------------------


@pytest.fixture(scope="module")
def fsdp8_tied():
    """The SMALL model tied (as Llama-3.2-1B), ZeRO-3 over 8 H100s, the loss in 4 chunks."""
    return compiled_for(
        8,
        **{
            "mesh.data": 1,
            "mesh.fsdp": 8,
            "mesh.tensor": 1,
            "parallel.zero_stage": 3,
            "model.tie_embeddings": "true",
        },
    )


def _whole_buffers_per_step(text: str, kind: str, dims: set[int]) -> int:
    """How many buffers with exactly the dims `dims` (in any order) collectives of `kind` work on
    per step, counting each element of a combined (tuple-shaped) collective: the results of an
    all-gather, the operands of the others (the whole arrays either way)."""
    comps = hlo.parse(text)
    times = hlo.multiplicities(comps)
    count = 0
    for comp in comps.values():
        shapes = {ins.name: ins.shape for ins in comp.instrs}
        for ins in comp.instrs:
            if ins.op not in (kind, f"{kind}-start"):
                continue
            if kind == "all-gather":  # an async start's shape is (operands, results)
                whole = hlo.tuple_elements(ins.shape)[1] if ins.op.endswith("-start") else ins.shape
            else:
                whole = ", ".join(shapes[name] for name in ins.operands)
            for _, found in hlo._ARRAY.findall(whole):
                if {int(d) for d in found.split(",") if d} == dims:
                    count += times.get(comp.name, 0)
    return count


def test_head_weight_is_gathered_and_reduce_scattered_once_per_step(fsdp8_tied):
    """The tied [vocab, d_model] table is gathered twice per step, once for the embedding lookup
    and once for the head (before the chunk loop, kept for the backward), and its gradient is
    reduce-scattered once: the head's (summed over the chunks on each device first). The
    lookup's gradient is not a whole table: the tokens' row gradients go to the devices owning
    their columns by an all-to-all (jaxpar.models.llama.lookup; pinning it whole made a second
    reduce-scatter of the table). Autodiff through the checkpointed chunk loop gathered it three
    times per chunk (forward, recompute, backward) and reduce-scattered its float32 gradient once
    per chunk: 1 + 3 x 4 gathers and 1 + 4 reduce-scatters here."""
    trainer, compiled, _ = fsdp8_tied
    m = trainer.cfg.model
    assert trainer.cfg.train.loss_chunks == 4 and m.tie_embeddings
    text, table = compiled.as_text(), {m.vocab_size, m.d_model}
    assert _whole_buffers_per_step(text, "all-gather", table) == 2
    assert _whole_buffers_per_step(text, "reduce-scatter", table) == 1
    assert _whole_buffers_per_step(text, "all-reduce", table) == 0
    assert re.search(r"all-to-all(-start)?\(", text)


def _float32_dots(text: str, allowed=lambda operand_shapes: False) -> list[str]:
    """Matrix multiplications with two float32 operands: `dot`s (fused or not) and cuBLAS GEMM
    custom calls, their operands' types looked up in their computation; those whose operand
    shapes `allowed` accepts left out."""
    found = []
    for comp in hlo.parse(text).values():
        shapes = {ins.name: ins.shape for ins in comp.instrs}
        for ins in comp.instrs:
            gemm = ins.op == "custom-call" and re.search(r'custom_call_target="__cublas', ins.text)
            if ins.op == "dot" or gemm:
                types = [shapes[name].split("[")[0].lstrip("(") for name in ins.operands[:2]]
                if types == ["f32", "f32"] and not allowed([shapes[name] for name in ins.operands[:2]]):
                    found.append(f"{comp.name}: {ins.text.strip()[:160]}")
    return found


def test_no_matmul_takes_two_float32_operands(fsdp8_tied):
    """bfloat16 operands, float32 accumulation, in every GEMM of the step: the head's forward and
    both of its gradient GEMMs included (the gradient of the logits is rounded to bfloat16;
    autodiff had multiplied the float32 gradient of the logits by an upcast weight)."""
    _, compiled, _ = fsdp8_tied
    text = compiled.as_text()
    assert re.search(r" dot\(", text)  # the search below does see the GEMMs
    assert not _float32_dots(text)


# --- parallel.grad_reduce_dtype ------------------------------------------------------------------


def _reduced_matrices(text: str) -> list[tuple[str, str]]:
    """(dtype, dims) of every matrix (2+ dims) a reduce-scatter or all-reduce works on: the
    operands of the sync and async forms, combined ones element by element."""
    found = []
    for comp in hlo.parse(text).values():
        shapes = {ins.name: ins.shape for ins in comp.instrs}
        for ins in comp.instrs:
            if ins.op.removesuffix("-start") in ("reduce-scatter", "all-reduce"):
                operands = ", ".join(shapes[name] for name in ins.operands)
                found += [(d, dims) for d, dims in hlo._ARRAY.findall(operands) if dims.count(",") >= 1]
    return found


@pytest.mark.parametrize("reduce_dtype, wanted", [("null", "bf16"), ("float32", "f32")])
def test_gradients_are_reduced_in_grad_reduce_dtype(reduce_dtype, wanted):
    """ZeRO-3 over 4 H100s with a bfloat16 model: every weight gradient's reduce-scatter moves
    parallel.grad_reduce_dtype -- the blocks' (their weight-gradient GEMMs write it,
    jaxpar.ops.fp8.einsum) and the head's (summed over the loss chunks in float32, reduced in it).
    Before the setting the blocks' moved bfloat16 and the head's float32 whatever was asked.
    Unset (null), it follows model.dtype: this bfloat16 model keeps bfloat16's halved bytes.
    (The float32 model's float32 reductions: tests/test_layouts.py's byte counts, on XLA:CPU.)"""
    trainer, compiled, _ = fsdp4_at(3, reduce_dtype)
    reduced = _reduced_matrices(compiled.as_text())
    m = trainer.cfg.model
    assert (wanted, f"{m.d_model},{m.vocab_size}") in reduced  # the head's [embed, vocab]
    assert len(reduced) >= 3 * m.n_layers  # the blocks' (combined or not, one per layer at least)
    assert {dtype for dtype, _ in reduced} == {wanted}, reduced


def test_moe_gemms_take_no_two_float32_operands():
    """The experts' down projection writes float32 (its partial sums over `tensor` are added in
    float32); autodiff then multiplied the float32 gradient by upcast bfloat16 operands in both
    of its gradient GEMMs. jaxpar.parallel.experts.float32_out rounds that gradient first. The
    ragged dispatch (grouped GEMMs), 4 experts over 4 H100s, as the GPU's `auto` picks it."""
    trainer, compiled, _ = compiled_for(
        4,
        **{
            "mesh.data": 1,
            "mesh.fsdp": 1,
            "mesh.expert": 4,
            "mesh.tensor": 1,
            "parallel.zero_stage": 0,
            "model.vocab_size": 512,
            "model.moe.num_experts": 4,
            "model.moe.top_k": 2,
            "model.moe.d_ff": 256,
        },
    )
    text = compiled.as_text()
    assert "ragged-all-to-all" in text
    assert re.search(r" dot\(", text)

    # The router's own GEMMs (an operand [tokens or d_model, experts = 4]) are float32 on
    # purpose: routing decides in float32 (jaxpar.parallel.experts.route), at 2 x tokens x
    # d_model x experts FLOPs a pass. (cuDNN's attention, the default, here: XLA's attention
    # backward has float32 GEMMs of its own.)
    def router(shapes):
        return any(re.fullmatch(r"f32\[\d+,4\].*", shape) for shape in shapes)

    assert not _float32_dots(text, allowed=router)


# --- The command line: `python -m jaxpar.inspect ... --target NAME[:N]` ----------------------


def test_the_plugin_carries_the_h100_description():
    have = targets_lib.available()
    assert have["h100"] == "NVIDIA H100 80GB HBM3"
    target = targets_lib.resolve("h100:8")
    assert target.count == 8 and 79 * GIB < target.memory_bytes < 80 * GIB


def test_unknown_target_lists_the_known_ones(capsys):
    from jaxpar.inspect import main

    assert main(["--target", "h1000:8"]) == 2
    err = capsys.readouterr().err
    assert "unknown GPU type 'h1000'" in err and "h100, " in err and "Traceback" not in err


def test_without_the_extra_one_line_names_it(monkeypatch, capsys):
    import importlib.util

    from jaxpar.inspect import main

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name.startswith("jax_plugins") else real(name, *a),
    )
    assert main(["--target", "h100"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and 'pip install -e ".[gpu-compile]"' in err


def test_target_counts_past_8_come_in_hosts_of_8(capsys):
    from jaxpar.config import ConfigError
    from jaxpar.inspect import main

    with pytest.raises(ConfigError, match="multiple of 8"):
        targets_lib.resolve("h100:12")
    assert targets_lib.resolve("h100:16").count == 16
    assert main(["--target", "--human"]) == 2  # the type is missing, not "--human"
    assert "--target needs a GPU type" in capsys.readouterr().err


def test_pipeline_sums_over_data_once_per_step_not_every_tick():
    """pipe x data x fsdp at ZeRO-1: the data-parallel sums of the pipelined loss and gradients
    are a fixed number of all-reduces per step, whatever the number of microbatches (ticks).
    With `data` and `fsdp` left automatic inside the pipeline's shard_map, XLA's GPU compiler
    all-reduced a stage's weight gradients over them in every backward (pipe 2 x data 4: 16
    all-reduces at 2 microbatches, 22 at 4; XLA:CPU's program has none in the loop either way,
    so only the GPU program shows it). The uniform runtime is the same for every schedule: 1F1B
    speaks for all."""
    counts = {}
    for microbatches in (2, 4):
        _, _, r = compiled_for(
            8,
            **{
                "mesh.pipe": 2,
                "mesh.data": 2,
                "mesh.fsdp": 2,
                "mesh.tensor": 1,
                "parallel.zero_stage": 1,
                "parallel.pipeline_schedule": "1f1b",
                "parallel.microbatches": microbatches,
                "train.batch_size": 16,
                "model.d_model": 64,
                "model.d_ff": 128,
                "model.vocab_size": 512,
                "train.seq_len": 64,
                "train.loss_chunks": 1,
            },
        )
        counts[microbatches] = r["collectives"]["all-reduce"]["count"]
    assert counts[2] == counts[4], counts


GEMMA3 = {  # Gemma 3's block on SMALL: the first layer slides over 64 of 256 positions, the second is global
    "mesh.data": 1,
    "mesh.fsdp": 1,
    "mesh.tensor": 1,
    "parallel.zero_stage": 0,
    "model.sliding_window": 64,
    "model.global_every": 2,
    "model.qk_norm": True,
    "model.post_norms": True,
    "model.norm_offset": True,
    "model.embed_scale": True,
    "model.mlp_activation": "gelu_tanh",
    "model.head_dim": 64,
    "model.attn_scale_dim": 48,
    "model.rope_local_theta": 10000.0,
    "model.tie_embeddings": True,
}


def test_sliding_window_layers_run_cudnn_with_the_window_and_no_dense_mask():
    """Gemma 3's layers on the H100 program: each layer's attention is a cuDNN flash call, the
    sliding layers' with the window (sliding_window_length 64), the global ones' without (0),
    forward and backward, with the query scale of model.attn_scale_dim, and no [T, T] operand."""
    trainer, compiled, _ = compiled_for(1, **GEMMA3)
    t = trainer.cfg.train.seq_len
    calls = _custom_calls(compiled.as_text(), "__cudnn$fmha")
    windows = {"fwd": set(), "bwd": set()}
    for line in calls:
        kind = "bwd" if "Backward" in line else "fwd"
        windows[kind].update(re.findall(r'"sliding_window_length":\s*"?(\d+)', line))
        assert re.search(r'"mask_type":\s*"CAUSAL"', line)
        scale = float(re.search(r'"fmha_scale":\s*([0-9.e-]+)', line).group(1))
        assert abs(scale - 48**-0.5) < 1e-9
        head, operands = line.split(" = ", 1)[1].split("custom-call(", 1)
        assert not re.search(rf"\[\d+,\d+,{t},{t}\]", head + operands)
    assert windows == {"fwd": {"0", "64"}, "bwd": {"0", "64"}}, windows
