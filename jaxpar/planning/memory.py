"""The planner's memory model: the bytes per device of jaxpar's compiled train step in a
layout, predicted from the config alone (`predict_memory`, `predict_memory_for`), and XLA's own
memory analysis of that step compiled (`compiled_memory`), which it is checked against. Also
here, as the trainer and the runtime make them: the attention kernel of a layout
(`attention_kernel`) and the pipeline schedule executed (`executed_schedule`), which the
step-time model (`jaxpar.planning.step_time`) reads too.

Memory per device (`predict_memory`), in bytes, for jaxpar's own program:
- params, optimizer state (Adam: two moments) and gradients in param_dtype, each divided as the
  ZeRO stage shards it over `fsdp` and as the rules of `jaxpar.sharding` split it over
  `tensor`, `pipe` and `expert` (the same table the trainer uses: `jaxpar.planning.params.
  param_table` mirrors the model's parameters and their logical names); with finetune.lora, the
  adapters' parameters (`params.lora_table`) beside the frozen model's, and gradients and
  optimizer state for the adapters alone, as the trainer holds them;
- activations: what one layer keeps for the backward under the remat policy (none: every
  residual of the block, XLA attention's float32 probabilities included; dots: the outputs of
  the projection matmuls and the layer input; full: the layer input only), times the layers
  held, times the rows alive at once (the batch share, a grad-accumulation microstep, or the
  pipeline's stashed microbatches: the schedule's own buffer count; a pipeline stage holds its
  own blocks and the whole dense prefix for the pass's rows, `pipeline_stage`), plus the working set of
  one layer's backward (its recomputed residuals and their gradients); LoRA adds each adapter's
  x A (`adapter_residuals`); latent attention has its own projections' residuals
  (`projection_residuals`), an MoE layer its shared experts and, dropless, E x tokens routed
  rows; the multi-token modules keep a no-remat block each, once (`mtp_bytes`);
- loss: the chunked cross-entropy's float32 logits of one piece and their gradient (for a
  backend whose peak never holds them beside a layer's working set, `Backend.loss_beside_work`
  False, only what they need beyond it);
- buffers: the model-dtype copies of the weights the matmuls read (ZeRO-3: one gathered layer
  at a time, kept per layer for the backward when nothing is rematerialised), the pipeline's
  activation, gradient and input-gradient buffers, and the accumulated gradients of grad_accum.
The program is the same on every backend, its layout in memory is the compiler's: `BACKENDS`
holds, for XLA:CPU and XLA:GPU, the few coefficients of what a compiler keeps alive at once
(the backward's working set, ring attention's block arrays, the MoE layer's multiples, whether
weight casts happen inside the layer loop), calibrated on each backend's compiled programs
(benchmarks/plan_memory.py prints predicted against compiled for 28 layouts on both). The
planner predicts for "gpu"; the CPU tests predict for "cpu".
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass
from types import SimpleNamespace

from jaxpar import checks as checks_lib
from jaxpar import config as config_lib
from jaxpar.compiled import targets as targets_lib
from jaxpar.compiled.targets import DEVICES, DeviceSpec
from jaxpar.config import MESH_AXES, Config, ModelConfig
from jaxpar.models.moe import dense_prefix, moe_layers
from jaxpar.planning.params import state_elements
from jaxpar.sharding import is_pipelined, is_ring

GIB = 2**30
# Bytes per element of the dtypes a model computes in and keeps its parameters in.
BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class Backend:
    """How one XLA backend's compiler lays out the same train step: the residuals, state and
    buffers are the program's, but how much of a layer's backward is alive at once, and
    which casts get materialised, is the compiler's. XLA:CPU and XLA:GPU differ there
    (benchmarks/plan_memory.py compiles the same layouts for both)."""

    name: str
    # The working set of one layer's backward (its residuals being consumed plus the
    # gradients flowing through it), in units of that layer's no-remat residuals: without
    # remat, and under remat (dots/full), where the forward is recomputed inside the backward.
    working_set: float
    working_set_remat: float
    # Ring attention's extra working set: this many float32 [rows, heads, seq/context,
    # seq/context] arrays (one hop's block scores, probabilities and their gradients).
    ring_arrays: float
    # An MoE layer's residuals per routed (token, choice) copy, in units of one hidden array
    # of the expert MLP (see `_moe_or_dense`), under remat dots and none, and ("stashed", where
    # given) without remat in a pipeline's stash.
    moe_saved: tuple[tuple[str, float], ...]
    # A dense SwiGLU MLP's residuals without remat, in [rows, tokens, d_ff] model-dtype arrays
    # (the three its backward reads -- gate, up, their product -- and what else the compiler
    # keeps rather than recompute). The working sets above stay in units of the three.
    mlp_saved_none: float
    # True: under remat the model-dtype casts of the (unsharded) block weights are made
    # inside the layer loop, one layer's slice at a time, so no cast copy of the whole stack
    # is held (the per-layer slice is a transient, left out).
    casts_in_loop: bool
    # True: the loss chunk's logits are charged on top of a layer's working set; False: the
    # peak holds the larger of the two (see `predict_memory`).
    loss_beside_work: bool = True


BACKENDS = {
    # Calibrated on XLA:CPU's compiled programs of the 25 layouts of benchmarks/plan_memory.py
    # (8 emulated devices, jax 0.12.0.1): one working set (1.0) for both cases, six ring
    # arrays, and the MoE multiples from its three MoE layouts. XLA:CPU keeps a model-dtype
    # copy of every stacked weight whatever the remat policy.
    "cpu": Backend(
        "cpu",
        working_set=1.0,
        working_set_remat=1.0,
        ring_arrays=6,
        moe_saved=(("dots", 2.0), ("none", 10.0), ("stashed", 7.6)),
        mlp_saved_none=3.0,
        casts_in_loop=False,
        # Kept additive, not refitted: XLA:CPU's peak also sits in the forward layer loop with
        # no logits alive (fsdp8-z3-full: 24.5 MB live there), but its working set there is
        # larger than the model's (two float32 [rows, heads, seq, seq] arrays of XLA attention,
        # 4 MiB each, among it); the loss term stands in for the difference.
        loss_beside_work=True,
    ),
    # XLA:GPU (the H100 program, compiled without a GPU) keeps the CPU's structure where it
    # is the program's own (the state, the saved residuals, the pipeline's stash, the loss
    # chunk: the un-rematerialised rows, pipelines among them, agree with the CPU numbers)
    # and differs where the compiler chooses:
    # - casts_in_loop: under remat its while loop converts each layer's float32 weights as it
    #   reaches them (the H100 program of data8-z0-full holds no bf16[4, ...] weight stack;
    #   with remat none, the stacked casts are saved residuals and it does);
    # - working_set and working_set_remat 0.5: about half of a layer's (three-MLP-array)
    #   residuals are alive at once in its backward, with or without remat; we attribute this
    #   to XLA:GPU fusing the backward's elementwise work (and any recomputation) into its
    #   kernels;
    # - ring_arrays 3: half of XLA:CPU's float32 block arrays per hop (attributed likewise
    #   to fusion of a hop's scale, mask and softmax);
    # - moe_saved none 10 as on XLA:CPU (it was 8 while the model charged float32 MoE models'
    #   XLA attention a float32 copy of its probabilities, which a float32 model does not make),
    #   and "stashed" 7.6 for the residuals `jax.vjp` returns into a pipeline's stash: read off
    #   p2-e2-d2-1f1b-moe's H100 program, whose stash holds per slot six float32 routed hidden
    #   arrays [experts, capacity, d_ff] and two of [experts, tokens, d_ff] (0.8 of one each);
    # - mlp_saved_none 6: without remat its forward layer loop saves six bf16 [rows, seq, d_ff]
    #   arrays per layer where the model had three (read off the loop's outputs in two H100
    #   programs, configs/llama-1b.yaml and benchmarks/plan_layouts.py's MODEL, each at 3
    #   layers, ZeRO-0, no remat: 4 + 3 arrays of [rows, seq, d_model], 2 of the KV width, 6
    #   of d_ff, the attention statistics).
    # The attributions are not traced buffer by buffer, except mlp_saved_none's.
    # working_set (0.5, with mlp_saved_none 6, was 1.0 with 3) was refitted on the 1B's no-remat
    # H100 compiles at 2 and 4 layers (tests/test_plan.py); the rest are calibrated on the H100
    # compiles of the 28 layouts (benchmarks/results/plan_memory-h100.json), one value each.
    "gpu": Backend(
        "gpu",
        working_set=0.5,
        working_set_remat=0.5,
        ring_arrays=3,
        moe_saved=(("dots", 2.0), ("none", 10.0), ("stashed", 7.6)),
        mlp_saved_none=6.0,
        casts_in_loop=True,
        # The H100 programs looked at peak in the last layer's forward (fsdp8-z3, no remat:
        # inside the forward loop, every layer's residuals kept, no logits alive) or in a
        # layer's backward (f2-t4-z3-full), not at the loss beside a layer's working set.
        loss_beside_work=False,
    ),
}


@dataclass(frozen=True)
class Shape:
    """Per-device sizes one layer works on."""

    rows: int  # sequences alive at once (per microstep / microbatch)
    tokens: int  # tokens of a row on this device (seq / context)
    seq: int  # the whole sequence
    between: int  # tokens of a row between blocks (seq / context / tensor with sequence parallel)
    heads: int  # query heads per device
    kv_heads: int
    head_dim: int
    d_ff: int  # per device
    vocab: int  # per device


def layer_residuals(
    m: ModelConfig,
    s: Shape,
    remat: str,
    kernel: str,
    ring: bool,
    stashed: bool = False,
    backend: str = "gpu",
    kept: bool = True,
) -> float:
    """Bytes one layer keeps for its backward, per row, under `remat`. `stashed`: the
    residuals are what `jax.vjp` returns (the pipeline stashes them), which XLA cannot thin
    out: XLA attention's float32 scores before the softmax are among them. `kept`: with the
    MLP intermediates the backend's compiler keeps beyond the three the backward reads
    (`Backend.mlp_saved_none`); False gives the working sets' unit."""
    a = BYTES[m.dtype]
    d = m.d_model
    x = s.between * d * a  # the layer input (and the residual stream after attention)
    if remat == "full":
        return x
    q = s.tokens * s.heads * s.head_dim * a
    ff = s.tokens * s.d_ff * a
    proj = s.tokens * d * a
    mlp = _moe_or_dense(m, s, ff, proj, BACKENDS[backend], stashed)
    qkv = projection_residuals(m, s)
    if remat == "dots":  # the matmuls without batch dims: q, k, v, wo; gate, up, down
        return x + qkv["dots"] + proj + mlp["dots"]
    if ring or kernel == "cudnn":  # output + float32 softmax statistics, no [T, T] array
        slots = 1 if ring else min(m.max_documents_per_row, s.seq)
        attention = q + 4 * slots * s.heads * s.tokens
    else:  # XLA: float32 softmax output, its model-dtype copy for the AV matmul (none in a
        # float32 model: the AV matmul reads the output itself), the mask
        copy = a if a < 4 else 0
        attention = s.heads * s.tokens * s.seq * (4 + copy + (4 if stashed else 0)) + s.tokens * s.seq
    # input, norm output, q/k/v before and after rotary, attention, its output, the stream
    # after attention, the MLP norm output, the MLP
    extra = (BACKENDS[backend].mlp_saved_none - 3) * ff * (1 - moe_layers(m) / m.n_layers) if kept else 0.0
    return 2 * x + 2 * proj + qkv["none"] + attention + q + mlp["none"] + extra


def projection_residuals(m: ModelConfig, s: Shape) -> dict[str, float]:
    """Bytes per row that attention's projections leave for the backward, before the attention
    core: under remat "dots" (the projections' outputs) and "none" (also the rotary's and the
    norms' arrays). Grouped-query attention: q, k, v, and q and k again after the rotation.
    Latent attention (model.mla): the two latents (the query's, Q, and the key/value latent
    with its rotated key head, R + P), whole on every tensor device; the queries [N, C + P]; the
    expanded keys and values [N, C + D]; and without remat the latents' norms, the rotated
    queries, and the keys and zero-padded values [N, C + P] each that the kernel reads."""
    a, t = BYTES[m.dtype], s.tokens
    q = t * s.heads * s.head_dim * a
    if not m.mla.kv_lora_rank:
        kv = t * s.kv_heads * s.head_dim * a
        return {"dots": q + 2 * kv, "none": 2 * (q + 2 * kv) - kv}
    la = m.mla
    latents = t * ((la.q_lora_rank or 0) + la.kv_lora_rank + la.qk_rope_dim) * a
    expanded = t * s.heads * (la.qk_nope_dim + la.v_head_dim) * a
    return {"dots": latents + q + expanded, "none": 2 * latents + 2 * q + expanded + 2 * q}


def adapter_residuals(cfg: Config, s: Shape) -> float:
    """Bytes one layer's LoRA adapters keep for the backward, per row: each adapted weight's
    x A [tokens, rank] (model dtype; the rank is whole on every device), which B's gradient
    reads, unless remat `full` recomputes it. With finetune.lora.dropout the dropped inputs are
    residuals too; they are not counted."""
    lora = cfg.finetune.lora
    if lora.rank <= 0 or cfg.parallel.remat == "full":
        return 0.0
    return len(lora.targets) * s.tokens * lora.rank * BYTES[cfg.model.dtype]


def mtp_residuals(m: ModelConfig, s: Shape, kernel: str, ring: bool, backend: str = "gpu") -> float:
    """Bytes per row the multi-token prediction modules (model.mtp.depth) keep for the backward,
    whatever `parallel.remat` says: the trainer runs them after the layer loop, outside its
    remat. Each module: its block's no-remat residuals (an MoE block in an MoE model) and seven
    [tokens, d_model] arrays of its own (the embedding, its norm and the hidden state's, their
    concatenation (two wide), the projection, the final norm)."""
    if not m.mtp.depth:
        return 0.0
    one = dataclasses.replace(
        m, n_layers=1, moe=dataclasses.replace(m.moe, first_dense=0, every=1, dense_layers=[])
    )
    block = layer_residuals(one, s, "none", kernel, ring, backend=backend)
    return m.mtp.depth * (block + 7 * s.tokens * m.d_model * BYTES[m.dtype])


def mtp_bytes(m: ModelConfig, s: Shape, kernel: str, ring: bool, backend: str, chunks: int) -> float:
    """What the multi-token modules keep on a device, once (after the layers, not per layer):
    `mtp_residuals` for its rows, and with the loss in one piece each module's logits' gradient
    (model dtype), kept for the backward beside the main loss's while the next loss runs."""
    logits = m.mtp.depth * BYTES[m.dtype] * s.tokens * s.vocab if chunks == 1 else 0.0
    return s.rows * (mtp_residuals(m, s, kernel, ring, backend) + logits)


def _moe_or_dense(
    m: ModelConfig, s: Shape, ff: float, proj: float, backend: Backend, stashed: bool = False
) -> dict[str, float]:
    """The MLP's saved bytes per row (averaged over the layers when MoE every n-th); `stashed`:
    without remat, what `jax.vjp` returns (`Backend.moe_saved`'s "stashed", where it has one)."""
    dense = {"dots": 2 * ff + proj, "none": 3 * ff}
    moe = m.moe
    if moe.num_experts == 0:
        return dense
    a = BYTES[m.dtype]
    tokens = s.tokens  # per row; the routed copies of a row's tokens, padded to capacity
    copies = tokens * moe.top_k * (moe.capacity_factor or moe.ragged_buffer_factor or 0.0)
    if not copies:  # dropless without a buffer factor: E x tokens rows (jaxpar.parallel.experts)
        copies = tokens * moe.num_experts
    ff_e = (moe.d_ff or m.d_ff) * s.d_ff // m.d_ff
    routed_ff = copies * ff_e * a
    buffers = 2 * copies * m.d_model * a + copies * m.d_model * 4 + tokens * moe.num_experts * 4
    # The expert MLP keeps more than a dense one (the dispatch gathers, the float32 expert
    # outputs and their masks): multiples of one routed hidden array (`Backend.moe_saved`).
    saved = dict(backend.moe_saved)
    if stashed and "stashed" in saved:
        saved["none"] = saved["stashed"]
    # The shared experts, a dense SwiGLU MLP of shared_experts x the expert width beside them.
    shared = tokens * moe.shared_experts * ff_e * a
    experts = {k: saved[k] * routed_ff + buffers + (2 if k == "dots" else 3) * shared for k in dense}
    share = moe_layers(m) / m.n_layers
    return {k: (1 - share) * dense[k] + share * experts[k] for k in dense}


def shape_for(cfg: Config, sizes: dict[str, int], rows: int) -> Shape:
    m, t = cfg.model, cfg.train
    tensor = sizes["tensor"]
    tokens = t.seq_len // sizes["context"]
    between = tokens // (tensor if cfg.parallel.sequence_parallel else 1)
    return Shape(
        rows=rows,
        tokens=tokens,
        seq=t.seq_len,
        between=between,
        heads=m.n_heads // tensor,
        kv_heads=m.n_kv_heads // tensor,
        head_dim=m.head_width,
        d_ff=m.d_ff // tensor,
        vocab=m.vocab_size // tensor,
    )


def attention_kernel(cfg: Config, sizes: dict[str, int], device: DeviceSpec | None) -> str:
    """`model.attention` made concrete as the trainer would on this device (None: a CPU)."""
    from jaxpar.models.attention import kernel_for

    fake = (
        SimpleNamespace(platform="cpu", compute_capability=None)
        if device is None
        else SimpleNamespace(platform="gpu", compute_capability=device.compute_capability)
    )
    return kernel_for(cfg.model, fake, pipelined=is_pipelined(sizes), ring=is_ring(sizes))


def pipeline_slots(cfg: Config, sizes: dict[str, int]) -> tuple[int, int, int]:
    """(stash, activation, gradient) buffer slots per device of the configured schedule."""
    lowered = _lowered(executed_schedule(cfg, sizes))
    return lowered.stash_slots, lowered.activation_slots, lowered.gradient_slots


def executed_schedule(cfg: Config, sizes: dict[str, int]):
    """The pipeline schedule the runtime runs for this config on a mesh of these sizes: the
    configured one, made stage-dependent where `jaxpar.parallel.schedule.schedule_for_mesh` says
    so (zero-bubble on a collective-free chunk)."""
    p = cfg.parallel
    from jaxpar.parallel import schedule as pipeline_lib

    return _executed(
        p.pipeline_schedule,
        sizes["pipe"],
        p.microbatches,
        p.virtual_stages,
        tuple(sorted(sizes.items())),
        pipeline_lib.row_axes_for(cfg.model, p.zero_stage),
    )


@functools.cache
def _executed(
    kind: str,
    stages: int,
    microbatches: int,
    virtual: int,
    sizes: tuple[tuple[str, int], ...],
    row_axes: tuple[str, ...],
):
    """Many layouts share one schedule: built once (pure Python)."""
    from jaxpar.parallel import schedule as pipeline_lib

    built = pipeline_lib.build_schedule(kind, stages, microbatches, virtual)
    return pipeline_lib.schedule_for_mesh(built, dict(sizes), row_axes=row_axes)


@functools.cache
def _lowered(schedule):
    from jaxpar.parallel import schedule as pipeline_lib

    return pipeline_lib.lower_schedule(schedule)


def predict_memory(cfg: Config, sizes: dict, kernel: str, backend: str = "gpu", memory=None) -> dict:
    """Predicted bytes per device of the compiled train step (module doc), by kind, as the
    `backend`'s compiler ("gpu" or "cpu", `BACKENDS`) lays the program out; `memory`: what a
    program may use on a device (None: unknown), for the loss's automatic pieces."""
    b = BACKENDS[backend]
    m, t, p = cfg.model, cfg.train, cfg.parallel
    pb, a = BYTES[m.param_dtype], BYTES[m.dtype]
    el = state_elements(m, sizes, p.zero_stage, cfg.finetune.lora)
    moments = 2 if cfg.optimizer.name == "adamw" else 0
    dp = sizes["data"] * sizes["fsdp"] * sizes["expert"]
    pipelined, ring = is_pipelined(sizes), is_ring(sizes)
    # Rows one pass works on: a grad-accumulation microstep's share (pipeline: a microbatch's).
    rows = t.batch_size // (dp * p.grad_accum * (p.microbatches if pipelined else 1))
    s = shape_for(cfg, sizes, rows)
    whole = layer_residuals(m, s, "none", kernel, ring, backend=backend, kept=False) * rows
    if ring:  # one hop's float32 block attention: scores, probabilities and their gradients
        whole += b.ring_arrays * 4 * rows * s.heads * s.tokens * s.tokens
    if pipelined:
        activations, buffers, layers = pipeline_stage(cfg, sizes, el, s, kernel, backend)
    else:
        saved = layer_residuals(m, s, p.remat, kernel, ring, backend=backend) + adapter_residuals(cfg, s)
        activations, buffers, layers = m.n_layers * saved * rows, 0.0, m.n_layers
    work = (b.working_set if p.remat == "none" else b.working_set_remat) * whole
    if kernel == "xla" and not ring:
        # However much is fused, the softmax's backward reads XLA attention's float32
        # probabilities whole: one [rows, heads, seq, seq] array is the floor.
        work = max(work, 4 * rows * s.heads * s.tokens * s.seq)
    # The loss: a piece of float32 logits and their gradient (vocabulary pieces, models.loss.
    # loss_chunks), 8 bytes a logit; whole on a GPU, 5 as compiled (llama-1b, tests/test_plan.py).
    from jaxpar.models.loss import loss_chunks

    chunks = loss_chunks(cfg, sizes, rows=rows * dp, memory=memory)
    logits = (5 if chunks == 1 and backend == "gpu" else 8) * rows * s.tokens * s.vocab / chunks
    # A layer's working set and the loss chunk's logits are not alive at once: the loss runs
    # after the last layer's forward and before the first layer's backward, with every layer's
    # residuals kept. Where the backend's peak shows it (`Backend.loss_beside_work` False) the
    # peak holds the larger, and "loss" is what the logits need beyond the working set.
    activations += work + mtp_bytes(m, s, kernel, ring, backend, chunks)
    loss = logits if b.loss_beside_work else max(logits - work, 0.0)
    # Model-dtype copies of the weights the matmuls read: at ZeRO-3 one gathered layer at a
    # time (and the next), kept for every layer when the backward reuses them (no remat);
    # below it the casts of the local weights, which a `casts_in_loop` backend makes inside
    # the layer loop under remat (then only the embedding's and the norms' casts remain).
    per_layer = el["blocks_gathered"] / max(layers, 1) * a
    if p.zero_stage >= 3:
        copies = per_layer * (layers if p.remat == "none" else 2)
        copies += (el["params"] - el["blocks_local"]) * a
    elif b.casts_in_loop and p.remat != "none":
        copies = (el["params"] - el["blocks_local"]) * a
    else:
        copies = el["params"] * a
    buffers += copies if a < pb else 0.0
    # The summed gradients are reduced to where the optimizer state lives (the trainer's
    # StepParts.reduce_shardings): from ZeRO-1 on, each device keeps its shard only.
    gradients = el["optimizer" if p.zero_stage >= 1 else "gradients"] * pb
    if p.grad_accum > 1:
        buffers += gradients  # the accumulator beside one microstep's (or pass's) gradients
    out = {
        "params": el["params"] * pb,
        "gradients": gradients,
        "optimizer": moments * el["optimizer"] * pb,
        "activations": activations,
        "loss": loss,
        "buffers": buffers,
    }
    out["total"] = sum(out.values())
    return {k: float(v) for k, v in out.items()}


def pipeline_stage(cfg: Config, sizes: dict, el: dict, s: Shape, kernel: str, backend: str) -> tuple:
    """(activations, buffers, blocks held) of the worst pipeline stage, per device: its chunk of
    the pipelined blocks ((n_layers - dense prefix) / pipe), stashed for the microbatches the
    schedule keeps in flight; and the dense prefix (model.moe.first_dense), which every stage
    runs whole before the pipeline on all of the pass's microbatches at once (one `jax.vjp`,
    `jaxpar.models.objective`) and whose residuals stay until the pipeline's backward is done
    (its weights are whole on every stage: `jaxpar.sharding`, "dense_layers"). The multi-token
    modules run with the head on the last stage; `predict_memory` charges them (`mtp_bytes`)
    whole on every stage, which is the last stage's charge, and so are their weights."""
    m, p, t = cfg.model, cfg.parallel, cfg.train
    a, pb, ring = BYTES[m.dtype], BYTES[m.param_dtype], is_ring(sizes)
    prefix = dense_prefix(m)

    def per_row(model):  # one layer's residuals as `jax.vjp` returns them (the stash's)
        kept = layer_residuals(model, s, p.remat, kernel, ring, stashed=True, backend=backend)
        return kept + adapter_residuals(cfg, s)

    dense = per_row(dataclasses.replace(m, moe=dataclasses.replace(m.moe, num_experts=0))) if prefix else 0.0
    # A pipelined block's share: the layers' mix of dense and MoE blocks without the prefix's.
    block = (m.n_layers * per_row(m) - prefix * dense) / (m.n_layers - prefix)
    stash, n_act, n_grad = pipeline_slots(cfg, sizes)
    chunk = (m.n_layers - prefix) // sizes["pipe"] // p.virtual_stages
    local_batch = t.batch_size // (sizes["data"] * sizes["fsdp"] * sizes["expert"] * p.grad_accum)
    # The stash, plus the slot a forward fills before it is written into the stash; the prefix
    # on the pass's rows.
    activations = (stash + 1) * chunk * block * s.rows + prefix * dense * local_batch
    stream = s.rows * s.between * m.d_model * a  # one [rows, seq, embed] activation
    buffers = (n_act + n_grad + 2) * stream + 2 * local_batch * s.between * m.d_model * a
    # One chunk's float32 parameter gradients (with LoRA, the adapters' alone), made by each
    # backward before they are added.
    buffers += el["trained_blocks_local"] * pb / p.virtual_stages
    return activations, buffers, chunk * p.virtual_stages + prefix


def predict_memory_for(
    overrides: list[str],
    mesh: dict[str, int],
    kernel: str | None = None,
    path: str | None = None,
    backend: str = "cpu",
) -> dict[str, float]:
    """`predict_memory` of a config file + overrides on a mesh (unlisted axes 1), for the
    `backend`'s compiler: "cpu" (the emulated devices) or "gpu" (an H100, compiled or not);
    the attention kernel, unless given, is the one the trainer picks there."""
    cfg = config_lib.load_config(path, list(overrides) + [f"mesh.{a}={mesh.get(a, 1)}" for a in MESH_AXES])
    sizes = checks_lib.validate(cfg, math.prod(mesh.values()))
    device = None if backend == "cpu" else DEVICES["h100"]
    if kernel is None:
        kernel = attention_kernel(cfg, sizes, device)
    return predict_memory(cfg, sizes, kernel, backend, device and device.usable_bytes)


def compiled_memory(
    overrides: list[str], mesh: dict[str, int], target=None, path: str | None = None
) -> dict[str, int]:
    """XLA's memory analysis of the compiled train step (never run) per device: on the first
    prod(mesh) local devices, or for a `jaxpar.compiled.targets.Target` of that many GPUs."""
    import jax

    from jaxpar.training.trainer import build_trainer, compile_step

    cfg = config_lib.load_config(path, list(overrides) + [f"mesh.{a}={mesh.get(a, 1)}" for a in MESH_AXES])
    n = math.prod(mesh.values())
    sizes = checks_lib.validate(cfg, n)
    devices = (
        jax.devices()[:n] if target is None else targets_lib.devices(dataclasses.replace(target, count=n))
    )
    mem = compile_step(build_trainer(cfg, sizes, devices=devices)).memory_analysis()
    out = {
        "arguments": int(mem.argument_size_in_bytes),
        "outputs": int(mem.output_size_in_bytes),
        "aliased": int(mem.alias_size_in_bytes),
        "temp": int(mem.temp_size_in_bytes),
    }
    out["total"] = out["arguments"] + out["outputs"] - out["aliased"] + out["temp"]
    return out
