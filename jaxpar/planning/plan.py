"""`python -m jaxpar.plan CONFIG [overrides] --gpus 64xh100 [--gpus-per-node 8] [--top 5]
[--verify K] [--human]`: the whole layout for a model and a cluster, predicted and ranked.

The model, sequence length and global batch come from the config as usual. The planner
enumerates every layout jaxpar can run on that many GPUs -- the six mesh axes (sizes that divide
heads, KV heads, d_ff, vocabulary, layers, batch, sequence, experts), ZeRO stage, remat policy,
pipeline schedule and microbatches, gradient accumulation -- keeps the ones `jaxpar.config.validate`
accepts (so every plan printed is runnable), predicts for each its memory per device and its step
time (hence MFU), and prints the fastest ones that fit: JSON by default, a table with `--human`,
each with its breakdown, one line of why, and the `python -m jaxpar.train` command. `tensor` and
`context` stay inside a node unless nothing fits that way (the plan then says so). Each axis
takes only divisors of what it splits (`_meshes`), so the enumeration grows with the model's
divisors, not with the GPU count: a million GPUs is answered in about as long as eight.

Memory per device (`predict_memory`), in bytes, for jaxpar's own program:
- params, optimizer state (Adam: two moments) and gradients in param_dtype, each divided as the
  ZeRO stage shards it over `fsdp` and as the rules of `jaxpar.sharding` split it over
  `tensor`, `pipe` and `expert` (the same table the trainer uses: `param_table` mirrors the
  model's parameters and their logical names); with finetune.lora, the adapters' parameters
  (`lora_table`) beside the frozen model's, and gradients and optimizer state for the adapters
  alone, as the trainer holds them;
- activations: what one layer keeps for the backward under the remat policy (none: every
  residual of the block, XLA attention's float32 probabilities included; dots: the outputs of
  the projection matmuls and the layer input; full: the layer input only), times the layers
  held, times the rows alive at once (the batch share, a grad-accumulation microstep, or the
  pipeline's stashed microbatches: the schedule's own buffer count), plus the working set of
  one layer's backward (its recomputed residuals and their gradients); LoRA adds each adapter's
  x A (`adapter_residuals`);
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

Step time (`predict_time`), in seconds, with a stated uncertainty:
- compute: the model's FLOPs (6N + 12LdT per token, `jaxpar.training.metrics`) plus what is computed
  twice (remat: the attention core for `dots`, the whole block forward for `full`; the chunked
  loss recomputes the head matmul; with LoRA the frozen weights' gradient matmuls are left out
  and the adapters' added, `hardware_flops`). Matmuls at a fraction of the device's bf16 peak
  that grows with the model width, eff(d) = MATMUL_CEILING * d / (d + d_half) (what narrow models
  lose to memory-bound work); the attention core's forward at its kernel's measured rate, a flash
  kernel's backward at `attention_backward` of it;
- host: a fixed cost per layer per forward+backward pass (launches, dispatch, gaps);
- the optimizer step: AdamW's update, memory-bound, the state a device updates read and written
  at the HBM bandwidth (`optimizer_step_s`; with LoRA, the adapters' state);
- communication per mesh axis, ring formulas (all-reduce 2(n-1)/n of the bytes, all-gather and
  reduce-scatter (n-1)/n, all-to-all (n-1)/n) over NVLink when the axis stays inside a node and
  over the node's network when it does not. data/fsdp traffic (gradient reduction, ZeRO-3
  weight gathers) overlaps the compute: what exceeds the compute shows, and never less than
  `exposed_fraction` of it -- except a pipeline's sum over its row axes, after its loop, exposed
  once per pipelined pass; ring attention's K/V passes overlap that layer's attention;
  tensor-parallel all-reduces, expert all-to-alls and pipeline sends are not overlapped;
- the pipeline bubble of the schedule as the runtime builds it (`schedule_bubble`: the idle
  fraction of `jaxpar.parallel.pipeline`'s own lowered schedule, not a textbook formula).
MFU = model FLOPs per step / (step time * GPUs * peak), the model FLOPs 6N + 12LdT per token
also with LoRA (as the trainer reports its MFU).
The four constants (`FITTED`: d_half 825, host 0.64 ms a layer, exposed_fraction 0, attention
backward at 0.241 of cuDNN's forward rate) are fitted by `benchmarks/plan_fit.py` to the "fit"
results of `jaxpar.planning.published` (4 single-H100 plain-JAX steps measured here, Megatron-LM's 1.7B
and 16B, torchtitan's Llama 3.1 8B on 8 H100s; RMS log residual 0.10, worst 0.20) and checked
against its "check" results, never fitted (torchtitan's 8B on 128 H100s and 405B on 128,
Megatron-LM's 7.1B and 70B, a nanoGPT and a plain-JAX single-H100 step): predicted/measured
step time 0.69-1.41 on those. Every predicted step time and MFU carries STEP_TIME_BAND (x1.55):
the measured value is expected within that factor (how it is derived: STEP_TIME_BAND's comment).

Exit codes: 0 with plans; 2 for bad input (a config error -- the config is validated on one
device before any layout is tried, `check_config` --, an unknown GPU type, a count that does not
divide into nodes); 3 when no layout fits, with how many GPUs would be needed, or when no layout
divides the batch over that many GPUs, with the batch or the GPU count that would (`no_layout`).
`--verify K` compiles the top K for the target (`jaxpar.inspect --target`, no GPU needed),
prints predicted against compiled memory, and drops a plan whose compiled program does not fit.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import json
import math
import os
import shlex
import sys
from dataclasses import dataclass
from types import SimpleNamespace

from jaxpar import cli
from jaxpar import config as config_lib
from jaxpar.compiled import targets as targets_lib
from jaxpar.compiled.targets import DEVICES, DeviceSpec
from jaxpar.config import MESH_AXES, Config, ConfigError, LoRAConfig, ModelConfig
from jaxpar.models.llama import scan_length
from jaxpar.models.moe import moe_layers
from jaxpar.planning import published
from jaxpar.sharding import Rules, fitted_names, is_pipelined, is_ring, make_rules, state_rules
from jaxpar.training.metrics import attention_width

GIB = 2**30

# --- Constants of the step-time model ---------------------------------------------------------
#
# Measured, not fitted: MATMUL_CEILING, a bf16 8192^3 matmul through XLA at 800 TFLOP/s on one
# H100 SXM (0.81 of 989.4): no step runs its FLOPs faster; ATTENTION_EFFICIENCY, the attention
# core (QK^T and AV, 12LdT FLOPs per token with the backward) at its kernel's rate, measured on
# one H100 SXM for a causal forward (batch 8, seq 4096, 16 heads of 128): cuDNN flash attention
# 564 TFLOP/s, XLA's implementation 42 TFLOP/s (what jaxpar runs inside the pipeline and in ring
# attention's blocks).
MATMUL_CEILING = 800e12 / 989.4e12
ATTENTION_EFFICIENCY = {"cudnn": 564e12 / 989.4e12, "xla": 42e12 / 989.4e12}


@dataclass(frozen=True)
class StepTimeConstants:
    """The step-time model's fitted constants (`benchmarks/plan_fit.py` fits them to the "fit"
    entries of `jaxpar.planning.published.RESULTS`, least squares on log(predicted / measured)):
    - d_half: the width at which a step's matmuls reach half of MATMUL_CEILING; what a narrow
      model loses to its memory-bound work (norms, activations, casts: bytes per token that grow
      with L * d, against FLOPs that grow with L * d^2), eff(d) = MATMUL_CEILING * d / (d + d_half);
    - host_s_per_layer: seconds per layer per forward+backward pass that no FLOP count explains
      (kernel launches, host dispatch, gaps between kernels);
    - exposed_fraction: the share of the data/fsdp traffic (gradient reduction, ZeRO-3 weight
      gathers) that shows in the step even when the compute is long enough to hide it;
    - attention_backward: a flash kernel's backward (8LdT of the attention core's 12LdT) runs at
      this fraction of cuDNN's measured forward rate (it recomputes the scores and writes three
      gradients, slower per FLOP than the forward). Every fitted result used a flash kernel, so
      this constant also absorbs whatever else grows with attention's FLOPs in those runs (the
      torchtitan runs' PyTorch kernel against cuDNN's, at seq 8192): 0.241 is a fit, not a
      kernel measurement. XLA's attention (no recompute) is charged its measured rate throughout."""

    d_half: float
    host_s_per_layer: float
    exposed_fraction: float
    attention_backward: float


FITTED = StepTimeConstants(
    d_half=825.0, host_s_per_layer=0.000644, exposed_fraction=0.0, attention_backward=0.241
)

# The stated uncertainty of a predicted step time: the measured step lies within
# [predicted / STEP_TIME_BAND, predicted * STEP_TIME_BAND] (and the MFU within the same factor).
# Derived from the fit's residuals (`step_time_band`): twice the largest |log(predicted /
# measured)| among the fitted results, rounded up to 0.05 (the fit's worst is 0.204: x1.23; twice
# that, x1.504, rounds up to x1.55). Every checked result, never fitted, falls inside it
# (tests/test_plan.py) -- two of them, torchtitan's 405B and Megatron-LM's 70B, only because the
# widening is twice and not 1.5 times the worst residual, a choice made after seeing them.
STEP_TIME_BAND = 1.55


UNCERTAINTY = (
    f"step times and MFU: predicted, no GPU measured; the measured value lies within x{STEP_TIME_BAND} of "
    f"the prediction (fitted to {len(published.fitted())} published or measured H100 results, checked "
    f"against {len(published.checked())} others: jaxpar.planning.published)"
)


def step_time_band(log_residuals: list[float]) -> float:
    """The band factor the residuals of a fit support (see STEP_TIME_BAND)."""
    worst = max(abs(r) for r in log_residuals)
    return math.ceil(math.exp(2 * worst) * 20 - 1e-9) / 20


def matmul_efficiency(d_model: int, constants: StepTimeConstants = FITTED) -> float:
    """The fraction of the bf16 peak a train step of this width runs its matmuls at."""
    return MATMUL_CEILING * d_model / (d_model + constants.d_half)


# --- Parameters: shapes and logical names ----------------------------------------------------


def param_table(m: ModelConfig) -> list[tuple[str, tuple[int, ...], tuple[str | None, ...]]]:
    """(name, shape, logical names) of every parameter of `jaxpar.models.llama.Transformer`,
    stacked blocks with their leading `layers` axis (tests/test_plan.py checks it against the
    model itself)."""
    e, n, k, h = m.d_model, m.n_heads, m.n_kv_heads, m.head_width
    f, v = m.d_ff, m.vocab_size
    moe = m.moe
    units = scan_length(m)  # the stacked blocks' leading axis: blocks, or groups of moe.every
    per_unit = m.n_layers // units
    L = ("layers",)
    out = [("embedding", (v, e), ("vocab", "embed")), ("final_norm", (e,), ("embed",))]
    if not m.tie_embeddings:
        out.append(("lm_head", (e, v), ("embed", "vocab")))
    for i in range(per_unit):
        is_moe = moe.num_experts > 0 and i == per_unit - 1
        out += [
            (f"block{i}.norms", (units, 2 * e), L + ("embed",)),
            (f"block{i}.wq", (units, e, n, h), L + ("embed", "heads", "head_dim")),
            (f"block{i}.wkv", (units, e, 2 * k, h), L + ("embed", "kv_heads", "head_dim")),
            (f"block{i}.wo", (units, n, h, e), L + ("heads_in", "head_dim", "embed")),
        ]
        if not is_moe:
            out += [
                (f"block{i}.w_gate_up", (units, e, 2 * f), L + ("embed", "mlp")),
                (f"block{i}.w_down", (units, f, e), L + ("mlp_in", "embed")),
            ]
            continue
        ff, ne = moe.d_ff or f, moe.num_experts
        out += [
            (f"block{i}.router", (units, e, ne), L + ("embed", None)),
            (f"block{i}.experts_gate_up", (units, ne, e, 2 * ff), L + ("experts", "embed", "mlp")),
            (f"block{i}.experts_down", (units, ne, ff, e), L + ("experts", "mlp", "embed")),
        ]
        if moe.shared_experts:
            s = moe.shared_experts * ff
            out += [
                (f"block{i}.shared_gate_up", (units, e, 2 * s), L + ("embed", "mlp")),
                (f"block{i}.shared_down", (units, s, e), L + ("mlp", "embed")),
            ]
    return out


def _local_elements(shape, names, sizes: dict[str, int], rules: Rules) -> int:
    """Elements one device holds of a parameter under `rules` (jaxpar.sharding's, as the trainer
    places that kind of state: each mesh axis used once, axes of size 1 skipped)."""
    used, total = set(), 1
    for dim, name in zip(shape, names):
        axes = rules.get(name, ()) if name is not None else ()
        split = 1
        for axis in axes:
            if axis not in used and sizes.get(axis, 1) > 1:
                used.add(axis)
                split *= sizes[axis]
        total *= -(-dim // split)
    return total


def lora_table(m: ModelConfig, lora: LoRAConfig) -> list[tuple[str, tuple[int, ...], tuple[str | None, ...]]]:
    """(name, shape, logical names) of every adapter matrix of finetune.lora (none at rank 0), as
    `jaxpar.models.lora` adds them: for each targeted weight of each block, A [in, rank] with the
    weight's first in-dim name on its rows and B [rank, out] with its first out-dim name on its
    columns (in- and out-dims flattened), stacked over the layers as the blocks are."""
    if lora.rank <= 0:
        return []
    e, r, f = m.d_model, lora.rank, m.d_ff
    q, kv = m.n_heads * m.head_width, m.n_kv_heads * m.head_width
    # target -> (in width, its logical name, out width, its logical name)
    dims = {
        "q": (e, "embed", q, "heads"),
        "k": (e, "embed", kv, "kv_heads"),
        "v": (e, "embed", kv, "kv_heads"),
        "o": (q, "heads_in", e, "embed"),
        "gate": (e, "embed", f, "mlp"),
        "up": (e, "embed", f, "mlp"),
        "down": (f, "mlp_in", e, "embed"),
    }
    units = scan_length(m)
    out = []
    for i in range(m.n_layers // units):
        for target in lora.targets:
            fan_in, in_name, fan_out, out_name = dims[target]
            out += [
                (f"block{i}.{target}_lora_a", (units, fan_in, r), ("layers", in_name, None)),
                (f"block{i}.{target}_lora_b", (units, r, fan_out), ("layers", None, out_name)),
            ]
    return out


def state_elements(
    m: ModelConfig, sizes: dict[str, int], zero_stage: int, lora: LoRAConfig | None = None
) -> dict[str, int]:
    """Elements per device of the parameters, gradients and one optimizer moment; the model's
    parameter count (`total`), the adapters' (`adapters`, with finetune.lora `lora`), and the
    blocks' share of the parameters (`blocks_local`, `blocks_gathered`) and of what trains
    (`trained_blocks_local`). With adapters only they have gradients and optimizer state; the
    parameters are the frozen model's and the adapters'."""
    base, adapters = param_table(m), lora_table(m, lora) if lora is not None else []
    rules = state_rules(zero_stage, sequence_parallel=False)
    gathered = make_rules(shard_embed=False, sequence_parallel=False)
    keys = ("params", "gradients", "optimizer", "total", "adapters")
    out = dict.fromkeys(keys + ("blocks_local", "blocks_gathered", "trained_blocks_local"), 0)
    rows = [(False, row) for row in base] + [(True, row) for row in adapters]
    for is_adapter, (name, shape, names) in rows:
        names = fitted_names(names, shape, sizes)  # as the trainer fits them to this mesh
        local = _local_elements(shape, names, sizes, rules["params"])
        out["params"] += local
        out["adapters" if is_adapter else "total"] += math.prod(shape)
        trains = is_adapter or not adapters
        if trains:
            out["gradients"] += _local_elements(shape, names, sizes, rules["grads"])
            out["optimizer"] += _local_elements(shape, names, sizes, rules["opt_state"])
        if name.startswith("block"):
            out["blocks_local"] += local
            out["blocks_gathered"] += _local_elements(shape, names, sizes, gathered)
            out["trained_blocks_local"] += local if trains else 0
    return out


# --- Memory ------------------------------------------------------------------------------------

_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


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
    a = _BYTES[m.dtype]
    d = m.d_model
    x = s.between * d * a  # the layer input (and the residual stream after attention)
    if remat == "full":
        return x
    q = s.tokens * s.heads * s.head_dim * a
    kv = s.tokens * s.kv_heads * s.head_dim * a
    ff = s.tokens * s.d_ff * a
    proj = s.tokens * d * a
    mlp = _moe_or_dense(m, s, ff, proj, BACKENDS[backend], stashed)
    if remat == "dots":  # the matmuls without batch dims: q, k, v, wo; gate, up, down
        return x + q + 2 * kv + proj + mlp["dots"]
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
    return 2 * x + 2 * proj + 2 * (q + 2 * kv) - kv + attention + q + mlp["none"] + extra


def adapter_residuals(cfg: Config, s: Shape) -> float:
    """Bytes one layer's LoRA adapters keep for the backward, per row: each adapted weight's
    x A [tokens, rank] (model dtype; the rank is whole on every device), which B's gradient
    reads, unless remat `full` recomputes it. With finetune.lora.dropout the dropped inputs are
    residuals too; they are not counted."""
    lora = cfg.finetune.lora
    if lora.rank <= 0 or cfg.parallel.remat == "full":
        return 0.0
    return len(lora.targets) * s.tokens * lora.rank * _BYTES[cfg.model.dtype]


def _moe_or_dense(
    m: ModelConfig, s: Shape, ff: float, proj: float, backend: Backend, stashed: bool = False
) -> dict[str, float]:
    """The MLP's saved bytes per row (averaged over the layers when MoE every n-th); `stashed`:
    without remat, what `jax.vjp` returns (`Backend.moe_saved`'s "stashed", where it has one)."""
    dense = {"dots": 2 * ff + proj, "none": 3 * ff}
    moe = m.moe
    if moe.num_experts == 0:
        return dense
    a = _BYTES[m.dtype]
    tokens = s.tokens  # per row; the routed copies of a row's tokens, padded to capacity
    copies = tokens * moe.top_k * (1.0 if moe.capacity_factor is None else moe.capacity_factor)
    ff_e = (moe.d_ff or m.d_ff) * s.d_ff // m.d_ff
    routed_ff = copies * ff_e * a
    buffers = 2 * copies * m.d_model * a + copies * m.d_model * 4 + tokens * moe.num_experts * 4
    # The expert MLP keeps more than a dense one (the dispatch gathers, the float32 expert
    # outputs and their masks): multiples of one routed hidden array (`Backend.moe_saved`).
    saved = dict(backend.moe_saved)
    if stashed and "stashed" in saved:
        saved["none"] = saved["stashed"]
    experts = {k: saved[k] * routed_ff + buffers for k in dense}
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
    configured one, made stage-dependent where `pipeline.schedule_for_mesh` says so (zero-bubble
    on a collective-free chunk)."""
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
    pb, a = _BYTES[m.param_dtype], _BYTES[m.dtype]
    el = state_elements(m, sizes, p.zero_stage, cfg.finetune.lora)
    moments = 2 if cfg.optimizer.name == "adamw" else 0
    dp = sizes["data"] * sizes["fsdp"] * sizes["expert"]
    pipe, pipelined, ring = sizes["pipe"], is_pipelined(sizes), is_ring(sizes)
    layers = m.n_layers // pipe
    # Rows one pass works on: a grad-accumulation microstep's share, and with a pipeline one
    # microbatch of it.
    rows = t.batch_size // (dp * p.grad_accum * (p.microbatches if pipelined else 1))
    s = shape_for(cfg, sizes, rows)
    saved = layer_residuals(m, s, p.remat, kernel, ring, stashed=pipelined, backend=backend) * rows
    saved += adapter_residuals(cfg, s) * rows
    whole = layer_residuals(m, s, "none", kernel, ring, backend=backend, kept=False) * rows
    if ring:  # one hop's float32 block attention: scores, probabilities and their gradients
        whole += b.ring_arrays * 4 * rows * s.heads * s.tokens * s.tokens
    stream = rows * s.between * m.d_model * a  # one [rows, seq, embed] activation
    if pipelined:
        stash, n_act, n_grad = pipeline_slots(cfg, sizes)
        chunk = layers // p.virtual_stages
        # The stash, plus the slot a forward fills before it is written into the stash.
        activations = (stash + 1) * chunk * saved
        local_batch = t.batch_size // (dp * p.grad_accum)  # the rows of one pipelined pass
        buffers = (n_act + n_grad + 2) * stream + 2 * local_batch * s.between * m.d_model * a
        # One chunk's float32 parameter gradients (with LoRA, the adapters' alone), made by
        # each backward before they are added.
        buffers += el["trained_blocks_local"] * pb / p.virtual_stages
    else:
        activations = layers * saved
        buffers = 0.0
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
    activations += work
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
    sizes = config_lib.validate(cfg, math.prod(mesh.values()))
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
    sizes = config_lib.validate(cfg, n)
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


def hardware_flops(
    m: ModelConfig, seq_len: int, remat: str, chunked_loss: bool = True, lora: LoRAConfig | None = None
) -> float:
    """FLOPs per token a train step executes: the model's 6N + 12LdT (`jaxpar.training.metrics`) plus
    what it computes twice -- remat `dots` recomputes the attention core's two matmuls (4LdT),
    `full` the whole block forward (2N_blocks + 4LdT); the chunked loss recomputes the head's
    matmul (2dV). With LoRA adapters (`lora`) the frozen weights get no gradient: their 2N of
    weight-gradient matmuls are not computed, and the adapters' N_A parameters add 6N_A (2N_A
    more under `full`)."""
    from jaxpar.models.llama import active_matmul_params
    from jaxpar.training.metrics import flops_per_token

    flops = flops_per_token(m, seq_len)
    attention_forward = 4 * m.n_layers * m.d_model * seq_len
    head = m.d_model * m.vocab_size
    if remat == "dots":
        flops += attention_forward
    elif remat == "full":
        flops += 2 * (active_matmul_params(m) - head) + attention_forward
    adapters = sum(math.prod(shape) for _, shape, _ in lora_table(m, lora)) if lora is not None else 0
    if adapters:
        flops += (8 if remat == "full" else 6) * adapters - 2 * active_matmul_params(m)
    return flops + (2 * head if chunked_loss else 0)


def attention_flops(m: ModelConfig, seq_len: int, remat: str) -> float:
    """The attention core's share of `hardware_flops` per token: 12LdT, + 4LdT recomputed
    under `dots` and `full`."""
    from jaxpar.training.metrics import attention_width

    return (12 + (4 if remat != "none" else 0)) * m.n_layers * attention_width(m) * seq_len


# --- Step time -----------------------------------------------------------------------------------


def _span(sizes: dict[str, int], axes: tuple[str, ...]) -> int:
    """How many consecutive devices a group over `axes` spans: the mesh is filled innermost
    axis first (`tensor` neighbours share a node), so the span is the outermost axis's stride
    times its size."""
    used = [a for a in axes if sizes[a] > 1]
    if not used:
        return 1
    outer = min(MESH_AXES.index(a) for a in used)
    return math.prod(sizes[a] for a in MESH_AXES[outer:])


def link_bandwidth(
    sizes: dict[str, int], axes: tuple[str, ...], device: DeviceSpec, gpus_per_node: int
) -> tuple[float, str]:
    """(bytes/s per GPU, "nvlink" | "network") for a collective over `axes`."""
    if _span(sizes, axes) <= gpus_per_node:
        return device.nvlink_bandwidth, "nvlink"
    return device.network_bandwidth, "network"


def crosses_nodes(sizes: dict[str, int], axes: tuple[str, ...], gpus_per_node: int) -> bool:
    return _span(sizes, axes) > gpus_per_node


def _collective_bytes(bytes_: float, group: int, kind: str) -> float:
    """Bytes one device sends in a ring collective of `bytes_` per device over `group` devices:
    all-reduce 2(n-1)/n of them, all-gather, reduce-scatter or all-to-all ("gather") (n-1)/n."""
    if group <= 1 or bytes_ == 0:
        return 0.0
    factor = {"all-reduce": 2 * (group - 1) / group, "gather": (group - 1) / group}[kind]
    return factor * bytes_


def _data_parallel_time(cfg: Config, sizes: dict[str, int], bandwidth) -> float:
    """Seconds of data / fsdp traffic per step: gradients reduced over every data-parallel
    replica (float32), and ZeRO's traffic over fsdp. `bandwidth(axes)`: bytes/s per GPU. With
    LoRA adapters only theirs are reduced and, below ZeRO-3, gathered after the update."""
    m, p = cfg.model, cfg.parallel
    ring = _collective_bytes
    dp = sizes["data"] * sizes["fsdp"] * sizes["expert"]
    # What one device computes with: params split by tensor / pipe / expert; what of it trains.
    whole = state_elements(m, sizes, 0, cfg.finetune.lora)
    gathered, trained = whole["params"], whole["gradients"]
    passes = p.grad_accum * (p.microbatches if is_pipelined(sizes) else 1)  # forward+backward passes
    grad_bytes = 4 * trained
    f = sizes["fsdp"]
    if p.zero_stage == 0 or f == 1:
        return ring(grad_bytes, dp, "all-reduce") / bandwidth(("data", "fsdp", "expert"))
    bw_f, bw_d = bandwidth(("fsdp",)), bandwidth(("data", "expert"))
    dp_time = ring(grad_bytes, f, "gather") / bw_f  # reduce-scatter of the gradients
    dp_time += ring(grad_bytes / f, dp // f, "all-reduce") / bw_d  # over the other replicas
    if p.zero_stage >= 3:  # weights gathered in model dtype for the forward and the backward
        gathers = 2 if p.remat == "none" else 3
        dp_time += passes * gathers * ring(_BYTES[m.dtype] * gathered, f, "gather") / bw_f
    else:  # the updated float32 parameters gathered once
        dp_time += ring(4 * trained, f, "gather") / bw_f
    return dp_time


def _model_parallel_times(
    cfg: Config, sizes: dict[str, int], bandwidth, attention_s: float
) -> dict[str, float]:
    """Seconds of tensor, context, expert and pipe traffic per step (what shows: ring
    attention's passes overlap the attention core's `attention_s`)."""
    m, t, p = cfg.model, cfg.train, cfg.parallel
    ring = _collective_bytes
    pipe, tensor, context, expert = sizes["pipe"], sizes["tensor"], sizes["context"], sizes["expert"]
    dp = sizes["data"] * sizes["fsdp"] * sizes["expert"]
    a = _BYTES[m.dtype]
    comm = {}
    # tensor: two all-reduces (or all-gather + reduce-scatter) of the [rows, seq, d] activations
    # per layer in the forward, two in the backward, two more when `full` recomputes the forward.
    layers = m.n_layers // pipe
    act = (t.batch_size // dp) * (t.seq_len // context) * m.d_model * a
    per_layer = 4 + (2 if p.remat == "full" else 0)
    comm["tensor"] = layers * per_layer * ring(act, tensor, "all-reduce") / bandwidth(("tensor",))
    # context: K and V blocks go c - 1 hops forward; K, V, dK, dV backward.
    kv = (t.batch_size // dp) * (t.seq_len // context) * 2 * (m.n_kv_heads // tensor) * m.head_width * a
    ring_time = layers * (context - 1) * 3 * kv / bandwidth(("context",)) if is_ring(sizes) else 0.0
    comm["context"] = max(0.0, ring_time - attention_s)
    # expert: two all-to-alls of the routed tokens per MoE layer forward, two backward.
    comm["expert"] = 0.0
    if m.moe.num_experts and expert > 1:
        routed = act * m.moe.top_k * (m.moe.capacity_factor or 1.0)
        comm["expert"] = moe_layers(m) // pipe * 4 * ring(routed, expert, "gather") / bandwidth(("expert",))
    # pipe: each microbatch's activation forward and its gradient backward, per boundary.
    comm["pipe"] = (
        2 * p.microbatches * (act / max(p.microbatches, 1)) / bandwidth(("pipe",))
        if is_pipelined(sizes)
        else 0.0
    )
    return comm


def predict_time(
    cfg: Config,
    sizes: dict[str, int],
    device: DeviceSpec,
    gpus_per_node: int,
    kernel: str | None = None,
    constants: StepTimeConstants = FITTED,
    chunked_loss: bool = True,
) -> dict[str, float]:
    """Predicted seconds of one optimizer step, by part (module doc), the MFU, and the stated
    band around both (STEP_TIME_BAND). `kernel`: the attention kernel's rate to charge (default:
    the one jaxpar runs in this layout); `chunked_loss`: whether the head's matmul is computed
    twice, as jaxpar's chunked loss does (False for other programs)."""
    m, t, p = cfg.model, cfg.train, cfg.parallel
    n = math.prod(sizes.values())
    tokens = t.batch_size * t.seq_len
    model_flops = tokens * _model_flops_per_token(m, t.seq_len)
    kernel = kernel or attention_kernel(cfg, sizes, device)
    attention = tokens * attention_flops(m, t.seq_len, p.remat)
    matmul = tokens * hardware_flops(m, t.seq_len, p.remat, chunked_loss, cfg.finetune.lora) - attention
    # Scaled from the H100's measured rates by the device's peak.
    # A flash kernel's backward at its own, slower rate (fitted); XLA's at the measured one.
    backward = tokens * 8 * m.n_layers * attention_width(m) * t.seq_len
    slower = constants.attention_backward if kernel == "cudnn" else 1.0
    rate = device.bf16_flops * ATTENTION_EFFICIENCY[kernel]
    attention_s = ((attention - backward) / rate + backward / (rate * slower)) / n
    compute = matmul / n / (device.bf16_flops * matmul_efficiency(m.d_model, constants)) + attention_s

    def bandwidth(axes):
        return link_bandwidth(sizes, axes, device, gpus_per_node)[0]

    comm = {
        "data_fsdp": _data_parallel_time(cfg, sizes, bandwidth),
        **_model_parallel_times(cfg, sizes, bandwidth, attention_s),
    }
    passes = p.grad_accum * (p.microbatches if is_pipelined(sizes) else 1)
    host = constants.host_s_per_layer * passes * (m.n_layers // sizes["pipe"])
    bubble = schedule_bubble(executed_schedule(cfg, sizes)) if is_pipelined(sizes) else 0.0
    busy = (compute + host + comm["tensor"] + comm["context"] + comm["expert"] + comm["pipe"]) / (1 - bubble)
    exposed_dp = _exposed_data_parallel(cfg, sizes, comm["data_fsdp"], busy, constants)
    optimizer = optimizer_step_s(cfg, sizes, device)
    step = busy + exposed_dp + optimizer
    mfu = model_flops / (step * n * device.bf16_flops)
    return {
        "compute_s": compute,
        "attention_s": attention_s,
        "host_s": host,
        "comm_s": comm,
        "exposed_data_fsdp_s": exposed_dp,
        "optimizer_s": optimizer,
        "bubble_fraction": bubble,
        "step_time_s": step,
        "step_time_range_s": (step / STEP_TIME_BAND, step * STEP_TIME_BAND),
        "mfu": mfu,
        "mfu_range": (mfu / STEP_TIME_BAND, mfu * STEP_TIME_BAND),
        "tokens_per_s_per_gpu": tokens / step / n,
    }


def _exposed_data_parallel(
    cfg: Config, sizes: dict[str, int], dp_s: float, busy_s: float, constants: StepTimeConstants
) -> float:
    """Seconds of data/fsdp traffic the step waits for: what exceeds the compute, and never less
    than `exposed_fraction` of it (real overlap is imperfect: the last layer's gradients, the
    first layer's gathers, collectives slowing the kernels they share the GPU with). A pipeline
    sums its gradients over its row axes (data, fsdp below ZeRO-2) after its loop, once per
    pipelined pass, with nothing left to overlap: all exposed, grad_accum times."""
    from jaxpar.parallel import schedule as pipeline_lib

    m, p = cfg.model, cfg.parallel
    if is_pipelined(sizes) and pipeline_lib.row_axes_for(m, p.zero_stage):
        return p.grad_accum * dp_s
    return max(dp_s - busy_s, constants.exposed_fraction * dp_s)


def optimizer_step_s(cfg: Config, sizes: dict[str, int], device: DeviceSpec) -> float:
    """Seconds of the AdamW update, memory-bound: for every element of the optimizer state a
    device updates (its ZeRO shard; with LoRA, of the adapters alone), the parameter, gradient
    and two moments read and the parameter and moments written, in param_dtype, at the HBM
    bandwidth."""
    updated = state_elements(cfg.model, sizes, cfg.parallel.zero_stage, cfg.finetune.lora)["optimizer"]
    return updated * 7 * _BYTES[cfg.model.param_dtype] / device.hbm_bandwidth


_PUBLISHED_CONFIGS: dict[tuple, Config] = {}


def predict_published(result, constants: StepTimeConstants = FITTED) -> dict[str, float]:
    """`predict_time` for one of `jaxpar.planning.published.RESULTS` on datasheet H100s, 8 a node, at
    flash attention's rate (every published run used a flash kernel), without the chunked loss's
    second head matmul (none of them chunks its loss that way), with `log_residual`:
    log(predicted / measured step time)."""
    key = tuple(result.overrides())
    if key not in _PUBLISHED_CONFIGS:
        _PUBLISHED_CONFIGS[key] = config_lib.load_config(None, list(key))
    cfg = _PUBLISHED_CONFIGS[key]
    sizes = {a: 1 for a in MESH_AXES} | result.mesh
    out = predict_time(cfg, sizes, DEVICES["h100"], 8, "cudnn", constants, chunked_loss=False)
    out["log_residual"] = math.log(result.measured_tokens_per_s() / out["tokens_per_s_per_gpu"])
    return out


@functools.cache
def schedule_bubble(schedule) -> float:
    """The idle fraction of the schedule the runtime executes (`executed_schedule`; the
    pipeline module's own `bubble_fraction`: forward 1 and backward 2, zero-bubble's B and W 1
    each), read from the pipeline module rather than a textbook formula so that the planner
    follows any change to a schedule; pure Python, computed once per schedule."""
    from jaxpar.parallel import schedule as pipeline_lib

    return pipeline_lib.bubble_fraction(schedule)


def _model_flops_per_token(m: ModelConfig, seq_len: int) -> float:
    from jaxpar.training.metrics import flops_per_token

    return flops_per_token(m, seq_len)


# --- Enumeration ---------------------------------------------------------------------------------


def _divisors(n: int) -> list[int]:
    """The divisors of n, ascending, in O(sqrt(n)) steps."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return small + [n // d for d in reversed(small) if d * d != n]


@dataclass
class Plan:
    cfg: Config
    sizes: dict[str, int]
    memory: dict[str, float]
    time: dict[str, float]
    kernel: str
    crosses: list[str]  # tensor / context axes that leave the node

    @property
    def fits(self) -> bool:
        return self.memory["total"] <= self._usable

    _usable: float = 0.0


def _meshes(m: ModelConfig, t, n: int):
    """Mesh sizes whose axes divide what they split (the cheap part of `validate`'s rules), in
    the order of their axes' sizes (pipe first, each ascending). Each axis takes only divisors of
    what it splits and of the devices left, so the work follows the model's divisors, not n: a
    count that no layout divides is answered at once, however large."""
    heads = math.gcd(m.n_heads, m.n_kv_heads, m.d_ff, m.vocab_size)  # what tensor splits
    for pipe in _divisors(math.gcd(n, m.n_layers)):
        for data in _divisors(math.gcd(n // pipe, t.batch_size)):
            left = n // (pipe * data)
            for fsdp in _divisors(math.gcd(left, t.batch_size // data)):
                if fsdp > 1 and m.d_model % fsdp:
                    continue
                rows = t.batch_size // (data * fsdp)
                for expert in _divisors(math.gcd(left // fsdp, rows, m.moe.num_experts or 1)):
                    rest = left // (fsdp * expert)
                    for context in _divisors(math.gcd(rest, max(t.seq_len // 2, 1))):
                        tensor = rest // context
                        if heads % tensor == 0 and (context == 1 or t.seq_len % (2 * context) == 0):
                            yield dict(zip(MESH_AXES, (pipe, data, fsdp, expert, context, tensor)))


def _settings(cfg: Config, sizes: dict[str, int]):
    """ParallelConfig variants for a mesh: ZeRO stage, remat, pipeline schedule and
    microbatches or grad accumulation."""
    t, m = cfg.train, cfg.model
    dp = sizes["data"] * sizes["fsdp"] * sizes["expert"]
    per_replica = t.batch_size // dp
    stages = [0] if sizes["fsdp"] == 1 else [1, 2, 3]
    sp = sizes["tensor"] > 1 and t.seq_len % (sizes["tensor"] * sizes["context"]) == 0
    for zero, remat in itertools.product(stages, ("none", "dots", "full")):
        base = dict(zero_stage=zero, remat=remat, sequence_parallel=sp)
        p = sizes["pipe"]
        if not is_pipelined(sizes):
            for accum in (1, 2, 4, 8, 16):
                if per_replica % accum == 0:
                    yield dict(base, grad_accum=accum)
            continue
        # Every schedule, with grad accumulation over whole pipelined passes (each pass takes
        # batch / grad_accum rows in `microbatches` microbatches).
        for mult, accum in itertools.product((1, 2, 4, 8), (1, 2, 4, 8, 16)):
            mb = p * mult
            if per_replica % (mb * accum):
                continue
            pipelined = dict(base, microbatches=mb, grad_accum=accum)
            for kind in ("1f1b", "gpipe", "zb"):
                yield dict(pipelined, pipeline_schedule=kind)
            if m.n_layers % (2 * p) == 0:
                yield dict(pipelined, pipeline_schedule="interleaved", virtual_stages=2)


def _with(cfg: Config, sizes: dict[str, int], settings: dict) -> Config:
    parallel = dataclasses.replace(
        cfg.parallel,
        **{"pipeline_schedule": "1f1b", "microbatches": 4, "virtual_stages": 1, "grad_accum": 1, **settings},
    )
    return dataclasses.replace(cfg, mesh=config_lib.MeshConfig(**sizes), parallel=parallel)


def enumerate_plans(cfg: Config, n: int, device: DeviceSpec, gpus_per_node: int) -> list[Plan]:
    """Every layout of `cfg`'s model on n GPUs, predicted (fitting or not), fastest first."""
    plans = []
    for sizes in _meshes(cfg.model, cfg.train, n):
        crosses = [a for a in ("tensor", "context") if crosses_nodes(sizes, (a,), gpus_per_node)]
        for settings in _settings(cfg, sizes):
            c = _with(cfg, sizes, settings)
            kernel = attention_kernel(c, sizes, device)
            plan = Plan(
                c,
                sizes,
                predict_memory(c, sizes, kernel, memory=device.usable_bytes),
                predict_time(c, sizes, device, gpus_per_node),
                kernel,
                crosses,
            )
            plan._usable = device.usable_bytes
            plans.append(plan)
    plans.sort(key=_rank)
    return plans


def _rank(plan: Plan) -> tuple[int, int]:
    """Fastest first; step times within 0.5% of each other count as equal, and then the
    simpler layout wins (fewer axes beyond data, a lower ZeRO stage, less remat, fewer
    microsteps): the same speed is not worth more machinery."""
    p, s = plan.cfg.parallel, plan.sizes
    complexity = (
        sum(s[a] > 1 for a in MESH_AXES if a != "data")
        + p.zero_stage
        + ("none", "dots", "full").index(p.remat)
        + p.grad_accum.bit_length()
        + (p.microbatches.bit_length() if is_pipelined(s) else 0)
    )
    return round(math.log(plan.time["step_time_s"]) / math.log(1.005)), complexity


def runnable(plan: Plan, n: int) -> bool:
    """Whether `jaxpar.config.validate` accepts the plan's config (every rule, not only the
    divisibility the enumeration checks)."""
    try:
        config_lib.validate(plan.cfg, n)
    except ConfigError:
        return False
    return True


# --- Explaining a plan ---------------------------------------------------------------------------


def _feature_tests(plan: Plan) -> list[tuple[str, callable, str]]:
    """(what this plan uses, a test for plans without it, how to say it)."""
    s, p = plan.sizes, plan.cfg.parallel
    out = []
    if s["tensor"] > 1:
        where = "across nodes" if "tensor" in plan.crosses else "inside the node"
        out.append((f"tensor={s['tensor']} {where}", lambda q: q.sizes["tensor"] == 1, "tensor parallelism"))
    if is_pipelined(s):
        out.append(
            (
                f"pipe={s['pipe']} ({p.pipeline_schedule}, {p.microbatches} microbatches)",
                lambda q: not is_pipelined(q.sizes),
                "pipelining",
            )
        )
    if is_ring(s):
        out.append((f"context={s['context']}", lambda q: not is_ring(q.sizes), "context parallelism"))
    if s["fsdp"] > 1:
        stage = p.zero_stage
        out.append(
            (
                f"ZeRO-{stage} over fsdp={s['fsdp']}",
                lambda q, st=stage: q.cfg.parallel.zero_stage < st or q.sizes["fsdp"] == 1,
                "a lower ZeRO stage" if stage > 1 else "ZeRO",
            )
        )
    if p.remat != "none":
        out.append((f"remat {p.remat}", lambda q: q.cfg.parallel.remat == "none", "remat"))
    if p.grad_accum > 1:
        out.append(
            (f"grad_accum={p.grad_accum}", lambda q: q.cfg.parallel.grad_accum == 1, "gradient accumulation")
        )
    return out


def explain(plan: Plan, plans: list[Plan], device: DeviceSpec) -> str:
    """One line: for each thing this plan uses, whether anything without it fits, and if so how
    much slower the best such plan is."""
    usable = device.usable_bytes / GIB
    parts = []
    for label, without, name in _feature_tests(plan):
        rivals = [q for q in plans if without(q)]
        fitting = [q for q in rivals if q.fits]
        if not fitting:
            least = min((q.memory["total"] for q in rivals), default=None)
            need = "" if least is None else f" (the smallest needs {least / GIB:.1f} GiB of {usable:.1f})"
            parts.append(f"{label}: no layout without {name} fits{need}")
        else:
            best = fitting[0]
            slower = best.time["step_time_s"] / plan.time["step_time_s"] - 1
            saved = (best.memory["total"] - plan.memory["total"]) / GIB
            if slower > 0.005:
                parts.append(f"{label}: {slower:.1%} faster than the best layout without {name}")
            elif saved > 0:
                parts.append(f"{label}: as fast as without {name}, {saved:.1f} GiB less per GPU")
            else:
                parts.append(f"{label}: as fast as without {name}")
    if not parts:
        state = "its LoRA adapters' gradients" if plan.cfg.finetune.lora.rank > 0 else "its gradients"
        parts.append(
            f"plain data parallelism: the model, {state} and Adam state fit on "
            f"each GPU ({plan.memory['total'] / GIB:.1f} of {usable:.1f} GiB)"
        )
    if plan.crosses:
        parts.append(f"{' and '.join(plan.crosses)} cross nodes: no layout keeping them inside a node fits")
    return "; ".join(parts)


# --- Output --------------------------------------------------------------------------------------


def command(plan: Plan, path: str | None, overrides: list[str], gpus_per_node: int, n: int) -> str:
    s, p = plan.sizes, plan.cfg.parallel
    keys = {f"mesh.{a}": s[a] for a in MESH_AXES}
    keys.update(
        {
            "parallel.zero_stage": p.zero_stage,
            "parallel.remat": p.remat,
            "parallel.sequence_parallel": str(p.sequence_parallel).lower(),
        }
    )
    if is_pipelined(s):
        keys.update(
            {
                "parallel.pipeline_schedule": p.pipeline_schedule,
                "parallel.microbatches": p.microbatches,
                "parallel.virtual_stages": p.virtual_stages,
            }
        )
    keys["parallel.grad_accum"] = p.grad_accum
    if n > gpus_per_node:
        keys["distributed.auto"] = "true"
    mine = set(keys)
    kept = [o for o in overrides if o.split("=", 1)[0].strip() not in mine]
    args = ([path] if path else []) + kept + [f"{k}={v}" for k, v in keys.items()]
    return "python -m jaxpar.train " + " ".join(shlex.quote(a) for a in args)


def to_json(plan: Plan, why: str, cmd: str) -> dict:
    p, mem = plan.cfg.parallel, plan.memory
    pipelined = is_pipelined(plan.sizes)
    return {
        "mesh": dict(plan.sizes),
        "zero_stage": p.zero_stage,
        "remat": p.remat,
        "sequence_parallel": p.sequence_parallel,
        "microbatches": p.microbatches if pipelined else None,
        "schedule": p.pipeline_schedule if pipelined else None,
        "virtual_stages": p.virtual_stages if pipelined else None,
        "grad_accum": p.grad_accum,
        "attention": plan.kernel,
        "memory_per_device": {
            k: int(mem[k])
            for k in ("params", "gradients", "optimizer", "activations", "loss", "buffers", "total")
        },
        "step_time_s": plan.time["step_time_s"],
        "step_time_range_s": list(plan.time["step_time_range_s"]),
        "mfu": plan.time["mfu"],
        "mfu_range": list(plan.time["mfu_range"]),
        "tokens_per_s_per_gpu": plan.time["tokens_per_s_per_gpu"],
        "time_breakdown_s": {
            "compute": plan.time["compute_s"],
            "host": plan.time["host_s"],
            **{f"comm_{k}": v for k, v in plan.time["comm_s"].items()},
            "exposed_data_fsdp": plan.time["exposed_data_fsdp_s"],
            "optimizer": plan.time["optimizer_s"],
            "bubble_fraction": plan.time["bubble_fraction"],
        },
        "why": why,
        "command": cmd,
    }


def format_human(result: dict) -> str:
    g = result["gpus"]
    lines = [
        f"{result['model']['params'] / 1e9:.2f} B parameters, batch {result['model']['batch_size']} "
        f"x seq {result['model']['seq_len']} on {g['count']} x {g['name']} ({g['per_node']} per "
        f"node); {result['layouts_considered']} layouts considered, {result['layouts_fitting']} fit "
        f"in {g['usable_gib']:.1f} GiB",
        *([result["model"]["lora"]] if result["model"]["lora"] else []),
        "",
    ]
    head = (
        f"{'#':>2} {'pipe':>4} {'data':>4} {'fsdp':>4} {'exp':>4} {'ctx':>4} {'tp':>4} "
        f"{'zero':>4} {'remat':>5} {'sched':>11} {'mb/acc':>6} {'GiB':>6} {'step s':>8} {'MFU':>5} "
        f"{'MFU range':>11}"
    )
    lines.append(head)
    for i, pl in enumerate(result["plans"], 1):
        m = pl["mesh"]
        sched = (
            f"{pl['schedule']}" + (f"x{pl['virtual_stages']}" if pl["schedule"] == "interleaved" else "")
            if pl["schedule"]
            else "-"
        )
        mb = (
            pl["grad_accum"]
            if not pl["schedule"]
            else (f"{pl['microbatches']}" + (f"x{pl['grad_accum']}" if pl["grad_accum"] > 1 else ""))
        )
        lines.append(
            f"{i:>2} {m['pipe']:>4} {m['data']:>4} {m['fsdp']:>4} {m['expert']:>4} "
            f"{m['context']:>4} {m['tensor']:>4} {pl['zero_stage']:>4} {pl['remat']:>5} "
            f"{sched:>11} {mb:>6} {pl['memory_per_device']['total'] / GIB:>6.2f} "
            f"{pl['step_time_s']:>8.3f} {pl['mfu']:>5.1%} "
            f"{pl['mfu_range'][0]:>5.1%}-{pl['mfu_range'][1]:.1%}"
        )
    lines += ["", result["step_time_uncertainty"]]
    for i, pl in enumerate(result["plans"], 1):
        mem = pl["memory_per_device"]
        lines += [
            "",
            f"#{i}: " + pl["why"],
            "    memory GiB: " + ", ".join(f"{k} {v / GIB:.2f}" for k, v in mem.items()),
            "    time s: " + ", ".join(f"{k} {v:.3g}" for k, v in pl["time_breakdown_s"].items() if v),
            "    " + pl["command"],
        ]
        if "compiled_memory_per_device" in pl:
            c = pl["compiled_memory_per_device"]
            lines.append(
                f"    verified: predicted {mem['total'] / GIB:.2f} GiB, compiled "
                f"{c / GIB:.2f} GiB ({mem['total'] / c - 1:+.1%})"
            )
        if "compiled_step_time_s" in pl:
            lines.append(
                f"    the ruler on the compiled program: step {pl['compiled_step_time_s']:.3f} s, "
                f"MFU {pl['compiled_mfu']:.1%} (predicted {pl['step_time_s']:.3f} s)"
            )
    for w in result.get("warnings", []):
        lines.append("warning: " + w)
    return "\n".join(lines)


# --- Command line --------------------------------------------------------------------------------

USAGE = (
    """usage: python -m jaxpar.plan [CONFIG.yaml] [dotted.key=value ...] --gpus NxTYPE
                              [--gpus-per-node 8] [--top 5] [--verify K] [--human]
  --gpus 64xh100      how many GPUs of which type (known: """
    + ", ".join(DEVICES)
    + """)
  --gpus-per-node 8   GPUs sharing NVLink in one node (default 8)
  --top 5             how many plans to print
  --verify K          compile the top K for the target without a GPU (gpu-compile extra) and
                      show predicted against compiled memory; drop a plan that does not fit
  --human             a table instead of JSON
exit codes: 0 plans printed, 2 bad input, 3 no layout fits"""
)


@dataclass
class Args:
    path: str | None
    overrides: list[str]
    count: int
    device: DeviceSpec
    per_node: int
    top: int
    verify: int
    human: bool


def parse_gpus(text: str) -> tuple[int, DeviceSpec]:
    count, sep, kind = text.lower().partition("x")
    if sep and count.strip().isdigit() and int(count) < 1:
        raise ConfigError(
            f"--gpus {text!r}: the count must be at least 1, e.g. --gpus 8x{kind.strip() or 'h100'}"
        )
    if not sep or not count.strip().isdigit():
        raise ConfigError(
            f"--gpus {text!r}: write the count and the type, e.g. --gpus 64xh100 "
            f"(known types: {', '.join(DEVICES)})"
        )
    if kind.strip() not in DEVICES:
        raise ConfigError(f"--gpus {text!r}: unknown GPU type {kind.strip()!r}; known: {', '.join(DEVICES)}")
    return int(count), DEVICES[kind.strip()]


def parse_args(argv: list[str]) -> Args:
    flags = {"--gpus": None, "--gpus-per-node": "8", "--top": "5", "--verify": "0"}
    human, rest = False, []
    it = iter(argv)
    for arg in it:
        name, eq, value = arg.partition("=")
        if name in flags:
            value = value if eq else next(it, None)
            if value is None or value.startswith("--"):
                raise ConfigError(f"{name} needs a value (see --help)")
            flags[name] = value
        elif arg == "--human":
            human = True
        elif arg.startswith("--"):
            raise ConfigError(
                f"unknown flag {arg!r}; known: --gpus, --gpus-per-node, --top, --verify, --human"
            )
        else:
            rest.append(arg)
    if flags["--gpus"] is None:
        raise ConfigError(f"--gpus is required, e.g. --gpus 64xh100 (known types: {', '.join(DEVICES)})")
    count, device = parse_gpus(flags["--gpus"])
    numbers = {}
    for name, least in (("--gpus-per-node", 1), ("--top", 1), ("--verify", 0)):
        value = flags[name]
        if not value.isdigit() or int(value) < least:
            raise ConfigError(f"{name} {value!r}: give a whole number >= {least}")
        numbers[name] = int(value)
    per_node = numbers["--gpus-per-node"]
    if count > per_node and count % per_node:
        raise ConfigError(
            f"--gpus {count} does not divide into nodes of {per_node} GPUs "
            f"(--gpus-per-node); use a multiple of {per_node}, e.g. "
            f"{count - count % per_node} or {count + per_node - count % per_node}"
        )
    path, overrides = config_lib.parse_cli(rest)
    return Args(
        path, overrides, count, device, min(per_node, count), numbers["--top"], numbers["--verify"], human
    )


def layer_splits(cfg: Config) -> set[int]:
    """The tensor x context sizes the enumeration gives a model (`_meshes`): the axes that split
    each layer's work. Every other axis (data, fsdp, expert, and pipe, whose microbatches are
    rows too) takes whole rows of the global batch."""
    m, t = cfg.model, cfg.train
    heads = math.gcd(m.n_heads, m.n_kv_heads, m.d_ff, m.vocab_size)
    contexts = [c for c in _divisors(max(t.seq_len // 2, 1)) if c == 1 or t.seq_len % (2 * c) == 0]
    return {tensor * context for tensor in _divisors(heads) for context in contexts}


def no_layout(cfg: Config, n: int, device: DeviceSpec, per_node: int) -> str:
    """Why no layout divides n GPUs, with what would: a batch of more rows, or fewer GPUs."""
    batch = cfg.train.batch_size
    splits = layer_splits(cfg)
    split = max(s for s in splits if n % s == 0)
    rows = n // split
    counts = {r * s for r in _divisors(batch) for s in splits}
    fewer = max(c for c in counts if c <= n and (c <= per_node or c % per_node == 0))
    bigger = rows * -(-batch // rows)  # the next multiple of rows
    return (
        f"no layout of {n} x {device.key} divides this model and batch: a layer splits over at most "
        f"{split} of the {n} GPUs (tensor x context, as the heads and train.seq_len="
        f"{cfg.train.seq_len} allow), so the batch must split {rows} ways into whole rows, and "
        f"train.batch_size={batch} does not divide by {rows}; raise train.batch_size to a multiple "
        f"of {rows}" + (f" (e.g. {bigger})" if bigger != rows else "") + f", or use fewer GPUs: "
        f"{fewer} is the most up to {n} that it divides over (--gpus {fewer}x{device.key})"
    )


def missing(cfg: Config, n: int, device: DeviceSpec, per_node: int, plans: list[Plan]) -> str:
    """What a model that fits nowhere lacks: a batch that divides over n GPUs (`no_layout`), a
    setting every layout that fits breaks, or memory: the smallest need now, and how many GPUs
    of this type the planner would need (up to 64 times as many)."""
    if not plans:
        return no_layout(cfg, n, device, per_node)
    if fitting := [p for p in plans if p.fits]:  # they fit, but `validate` refuses each of them
        try:
            config_lib.validate(fitting[0].cfg, n)
        except ConfigError as e:
            return f"no layout of {n} x {device.key} that fits is runnable; the fastest is refused: {e}"
    least = min(p.memory["total"] for p in plans)
    usable = device.usable_bytes / GIB
    now = (
        f"no layout of {n} x {device.key} fits: the smallest needs "
        f"{least / GIB:.1f} GiB per GPU, {usable:.1f} GiB usable of {device.memory_bytes / 1e9:.0f} GB"
    )
    divided = False  # whether any larger count has a layout at all
    for more in (2, 4, 8, 16, 32, 64):
        bigger = n * more
        if bigger > per_node and bigger % per_node:
            continue
        larger = enumerate_plans(cfg, bigger, device, per_node)
        divided = divided or bool(larger)
        if any(runnable(p, bigger) for p in [p for p in larger if p.fits][:50]):
            return f"{now}; needs >= {bigger} GPUs of {device.memory_bytes / 1e9:.0f} GB"
    if not divided:
        return (
            f"{now}; and no layout of 2 to 64 times as many GPUs divides train.batch_size="
            f"{cfg.train.batch_size}: shrink the model or shorten train.seq_len, or raise the batch "
            "(more rows for more GPUs to share) and plan for more GPUs"
        )
    return (
        f"{now}; even {64 * n} GPUs do not make it fit at train.batch_size="
        f"{cfg.train.batch_size}: lower the batch or the sequence length, or shrink the model"
    )


def lora_note(cfg: Config, adapters: int) -> str | None:
    """What the plans assume of finetune.lora, in one line (None without adapters)."""
    lora = cfg.finetune.lora
    if lora.rank <= 0:
        return None
    return (
        f"finetune.lora rank {lora.rank} on {', '.join(lora.targets)}: {adapters / 1e6:.2f} M adapter "
        "parameters train, the model's are frozen; gradients, optimizer state, their reduction "
        "and the update are the adapters' alone, and the frozen weights' gradient matmuls are "
        "not computed"
    )


def check_config(cfg: Config) -> None:
    """The config's own errors, as `jaxpar.config.validate` finds them on one device (the
    model's shape and counts, LoRA, the data, the tokenizer), as a ConfigError before any layout
    is tried: otherwise every layout would be refused for it, and the planner would answer that
    none fits. The layout (mesh, ZeRO stage, remat, pipeline, accumulation) is the planner's to
    choose and is left out."""
    ones = {a: 1 for a in MESH_AXES}
    config_lib.validate(_with(cfg, ones, {"zero_stage": 0}), 1)


def fastest_runnable(plans: list[Plan], n: int, top: int) -> list[Plan]:
    """The first `top` of `plans` that `jaxpar.config.validate` accepts on n GPUs."""
    chosen = []
    for p in plans:
        if len(chosen) >= top:
            break
        if runnable(p, n):
            chosen.append(p)
    return chosen


def plan_main(args: Args) -> tuple[dict, int]:
    cfg = config_lib.load_config(args.path, args.overrides)
    check_config(cfg)
    n, device = args.count, args.device
    plans = enumerate_plans(cfg, n, device, args.per_node)
    fitting = [p for p in plans if p.fits]
    # Layouts keeping tensor and context inside a node first; the others when none of those runs.
    chosen = fastest_runnable([p for p in fitting if not p.crosses], n, args.top)
    chosen = chosen or fastest_runnable(fitting, n, args.top)
    whole = state_elements(cfg.model, {a: 1 for a in MESH_AXES}, 0, cfg.finetune.lora)
    result = {
        "gpus": {
            "count": n,
            "type": device.key,
            "name": device.name,
            "per_node": args.per_node,
            "memory_bytes": device.memory_bytes,
            "usable_gib": device.usable_bytes / GIB,
        },
        "model": {
            "params": whole["total"],
            "trained_params": whole["adapters"] or whole["total"],
            "lora": lora_note(cfg, whole["adapters"]),
            "batch_size": cfg.train.batch_size,
            "seq_len": cfg.train.seq_len,
        },
        "step_time_band": STEP_TIME_BAND,
        "step_time_uncertainty": UNCERTAINTY,
        "layouts_considered": len(plans),
        "layouts_fitting": sum(p.fits for p in plans),
        "plans": [],
        "warnings": [],
    }
    if not chosen:
        result["error"] = missing(cfg, n, device, args.per_node, plans)
        return result, 3
    for p in chosen:
        result["plans"].append(
            to_json(p, explain(p, plans, device), command(p, args.path, args.overrides, args.per_node, n))
        )
    if args.verify:
        verify(result, chosen, args, device)
        if not result["plans"]:
            result["error"] = "none of the verified plans fits once compiled"
            return result, 3
    return result, 0


def _ruler_time(entry: dict, text: str, device: DeviceSpec, count: int) -> None:
    """The ruler's step time and MFU for the compiled program (optimized HLO `text`), beside the
    planner's own, where the ruler has rates for the device (`jaxpar.compiled.ruler.RATES`)."""
    from jaxpar.compiled import ruler

    if device.key not in ruler.RATES:
        return
    flops = entry["mfu"] * entry["step_time_s"] * count * device.bf16_flops  # the model's, per step
    costs = ruler.summary(text, ruler.RATES[device.key], flops, count)
    entry["compiled_step_time_s"], entry["compiled_mfu"] = costs["step_seconds"], costs["mfu"]


def verify(result: dict, chosen: list[Plan], args: Args, device: DeviceSpec) -> None:
    """Compiles the top `args.verify` plans for the target; adds the compiled total to each and
    drops (with a warning) those whose compiled program does not fit."""
    target = targets_lib.resolve(f"{device.key}:{args.count}")
    targets_lib.use_cpu_backend()
    from jaxpar.training.trainer import build_trainer, compile_step

    kept = []
    for entry, plan in zip(result["plans"], chosen):
        if len(kept) >= args.verify and "compiled_memory_per_device" not in entry:
            kept.append(entry)
            continue
        trainer = build_trainer(plan.cfg, plan.sizes, devices=targets_lib.devices(target))
        compiled = compile_step(trainer, documents=1)  # what the loop runs on one-document rows
        _ruler_time(entry, compiled.as_text(), device, args.count)
        mem = compiled.memory_analysis()
        total = int(
            mem.argument_size_in_bytes
            + mem.output_size_in_bytes
            - mem.alias_size_in_bytes
            + mem.temp_size_in_bytes
        )
        entry["compiled_memory_per_device"] = total
        entry["predicted_over_compiled"] = entry["memory_per_device"]["total"] / total
        if total > target.usable_bytes:
            result["warnings"].append(
                f"dropped {entry['command']}: compiled {total / GIB:.2f} GiB per GPU, over the "
                f"{target.usable_bytes / GIB:.2f} GiB usable (predicted "
                f"{entry['memory_per_device']['total'] / GIB:.2f})"
            )
            continue
        kept.append(entry)
    result["plans"] = kept


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if {"-h", "--help"} & set(argv):
        print(USAGE)
        return 0
    return cli.run(lambda: _plan(argv), prefix="plan error")


def _plan(argv: list[str]) -> int:
    """The command's work: the ranked plans printed; exit 3 when none fits."""
    args = parse_args(argv)
    result, code = plan_main(args)
    try:
        print(format_human(result) if args.human else json.dumps(result, indent=2), flush=True)
    except BrokenPipeError:  # `plan ... | head`: the reader has what it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    if code == 3:
        print(f"plan error: {result['error']}", file=sys.stderr)
    return code
