"""The ruler: an offline cost model of a compiled GPU step, read from its optimized HLO.

Every kernel the program launches per step is listed (`kernels`): fusions, library calls (cuBLAS
GEMMs, cuDNN attention), copies, collectives; an instruction inside a `while` body counts once per
trip (`jaxpar.compiled.hlo.launched`). Each launch costs

    max(FLOPs / attainable rate, bytes / attainable bandwidth) + a launch overhead

plus, for cuDNN's packed (document-masked) attention backward, a cost per empty (row, document
slot, head): it works through all `max_seg_per_batch` slots of every row whatever they hold; the
caller says how many documents the rows hold (`documents_per_row`, default one, as the measured
benchmark batches had). This is
roofline arithmetic with two constants fitted on measured H100 steps
(`benchmarks/ruler_fit.py`, `benchmarks/RESULTS.md`); it knows nothing of L2 caches, per-shape
GEMM efficiency or the overlap of collectives with compute.

What a launch counts:

- bytes of a fusion: its parameters and its root's outputs. A parameter used only through
  slices or dynamic-slices is charged the slices it reads (a layer's weights out of a stacked
  [L, ...] array, in a scanned or an unrolled layer loop); a buffer updated in place by a
  dynamic-update-slice at the root is charged the update only (a layer's residual written into
  the stacked buffer), not the whole buffer, and one updated by a scatter the elements its
  updates touch, read and written;
- FLOPs: 2 x output elements x contracted size for every dot (in a fusion, a Triton GEMM or a
  cuBLAS call); cuDNN attention 4*B*N*Tq*Tk*H, halved when causal, its backward 2.5 x that;
- a copy reads and writes its operand; a collective moves `hlo.moved_bytes` over the NVLink
  bandwidth of `jaxpar.compiled.targets` (no overlap assumed);
- a custom call the ruler cannot cost (a Pallas / Triton kernel) is charged its operand and
  result bytes and the FLOPs its backend config declares, if any, and is marked `costed: False`.
"""

from __future__ import annotations

import os
import re
from collections import defaultdict
from dataclasses import dataclass, replace

from jaxpar.compiled import hlo
from jaxpar.compiled.targets import GPUS


@dataclass(frozen=True)
class Rates:
    """What one GPU sustains, and the two fitted constants (seconds)."""

    peak_flops: float  # datasheet dense bf16 FLOP/s: MFU's denominator
    gemm_flops: float  # a dot, in a fusion or a library call
    bandwidth: float  # HBM bytes/s
    attention_forward: float  # cuDNN flash attention, FLOP/s
    attention_backward: float
    link_bandwidth: float  # collectives, bytes/s
    launch: float  # per kernel launch
    empty_slot: float  # per empty (row, document slot, head) of cuDNN's packed backward


def _h100() -> Rates:
    gpu = GPUS["h100"]  # NVIDIA's datasheet numbers (jaxpar.compiled.targets)
    return Rates(
        peak_flops=gpu.bf16_flops,
        # XLA's bf16 matmul of 8192^3 ran at 800 TFLOP/s on one H100 (0.81 of peak); 0.75 is
        # assumed for the model's smaller GEMMs (one efficiency for every shape).
        gemm_flops=0.75 * gpu.bf16_flops,
        # Assumed, not measured here: a streaming kernel reaches 85% of HBM3's 3.35 TB/s.
        bandwidth=0.85 * gpu.hbm_bandwidth,
        # jax.nn.dot_product_attention through cuDNN, causal forward B8 T4096 H16 D128, measured
        # 564 TFLOP/s on one H100. The backward's 400 is assumed (~0.7 of the forward), not
        # measured; the 12-step fit below held it fixed.
        attention_forward=560e12,
        attention_backward=400e12,
        link_bandwidth=gpu.nvlink_bandwidth,
        # Fitted by least squares (relative error) on 12 steps measured on one H100, 2026-11-22
        # and 2026-11-27: benchmarks/ruler_fit.py, benchmarks/RESULTS.md (second fit of
        # 2026-12-02, static slices charged their slice).
        launch=4.42e-6,
        empty_slot=105e-9,
    )


RATES = {"h100": _h100()}

_LIBRARY_GEMMS = ("__cublas$", "__cudnn$fusion")
_ATTENTION = "__cudnn$fmha"


@dataclass(frozen=True)
class Kernel:
    """One launch site: an instruction the GPU runs `runs` times per step."""

    kind: str  # gemm, attention, attention-backward, fusion, copy, collective, custom, other
    name: str  # the HLO instruction
    source: str  # the Python line that made it ("jaxpar/models/llama.py:261"), else its op_name
    runs: int  # launches per step
    flops: float = 0.0  # per launch
    bytes: int = 0  # per launch
    empty_slots: int = 0  # per launch: empty (row, document slot, head) of a packed backward
    costed: bool = True  # False: a kernel the ruler cannot see into, charged what it declares

    def seconds(self, rates: Rates) -> tuple[float, str]:
        """Seconds of one launch, and what bounds it: compute, memory or launch."""
        rate = {
            "attention": rates.attention_forward,
            "attention-backward": rates.attention_backward,
        }.get(self.kind, rates.gemm_flops)
        compute = self.flops / rate
        memory = self.bytes / (rates.link_bandwidth if self.kind == "collective" else rates.bandwidth)
        slots = self.empty_slots * rates.empty_slot  # a packed backward's work on empty slots
        bound = "compute" if compute + slots >= memory else "memory"
        bound = "launch" if rates.launch >= max(compute + slots, memory) else bound
        return max(compute, memory) + slots + rates.launch, bound


def kernels(text: str, documents_per_row: int = 1) -> list[Kernel]:
    """Every launch site of compiled GPU HLO `text`, with its launches per step.
    `documents_per_row`: what the rows hold, for the empty slots of a packed attention."""
    comps = hlo.parse(text)
    frames = hlo.source_lines(text)
    out = []
    for name, runs in hlo.launched(comps).items():
        comp = comps[name]
        shapes = {ins.name: ins.shape for ins in comp.instrs}
        for ins in comp.instrs:
            if runs and hlo.is_launch(ins):
                kernel = _kernel(ins, shapes, comps, documents_per_row)
                out.append(replace(kernel, name=ins.name, source=_source(ins, frames, comps), runs=runs))
    return out


def _kernel(
    ins: hlo.Instr, shapes: dict[str, str], comps: dict[str, hlo.Computation], documents_per_row: int
) -> Kernel:
    """The cost of one launch of `ins` (name, source and runs left for the caller)."""
    blank = Kernel("other", "", "", 0)
    if ins.op in ("fusion", "fusion-start"):
        body = comps[re.search(r"calls=%([\w.\-]+)", ins.text).group(1)]
        flops = _dot_flops(body, comps)
        return replace(blank, kind="gemm" if flops else "fusion", flops=flops, bytes=fusion_bytes(body))
    operands = sum(b for name in ins.operands for b in hlo.shape_bytes(shapes.get(name, "")))
    if ins.op in ("copy", "copy-start"):
        return replace(blank, kind="copy", bytes=2 * operands)
    if ins.op.removesuffix("-start") in hlo.KINDS:
        return replace(blank, kind="collective", bytes=sum(hlo.moved_bytes(ins, shapes)))
    results = _results_bytes(ins.shape)
    if ins.op != "custom-call":
        return replace(blank, bytes=operands + results)
    target = re.search(r'custom_call_target="([^"]+)"', ins.text).group(1)
    if target.startswith(_ATTENTION):
        return _attention(ins, target, shapes, operands + results, documents_per_row)
    if target.startswith(_LIBRARY_GEMMS):
        return replace(blank, kind="gemm", flops=_library_gemm_flops(ins, shapes), bytes=operands + results)
    declared = re.search(r'"flops"\s*:\s*"?(\d+)', ins.text)
    flops = float(declared.group(1)) if declared else 0.0
    return replace(blank, kind="custom", flops=flops, bytes=operands + results, costed=False)


def _results_bytes(shape: str) -> int:
    """Bytes of a call's results, less the scratch (u8/s8 workspace) that libraries ask for."""
    return sum(
        b
        for element in hlo.tuple_elements(shape)
        if not element.startswith(("u8[", "s8["))
        for b in hlo.shape_bytes(element)
    )


def _dims(shape: str) -> list[int]:
    found = hlo._ARRAY.search(shape)
    return [int(d) for d in found.group(2).split(",") if d] if found else []


def _elements(shape: str) -> int:
    count = 1
    for d in _dims(shape):
        count *= d
    return count


def _contracted(dims: list[int], contracting: str) -> int:
    """The product of `dims` at the comma-separated (or JSON-quoted) indices `contracting`."""
    size = 1
    for index in re.findall(r"\d+", contracting):
        size *= dims[int(index)]
    return size


def _dot_flops(comp: hlo.Computation, comps: dict[str, hlo.Computation]) -> float:
    """2 x output elements x contracted size, summed over the dots of a fused computation and of
    the fusions nested in it (a Triton GEMM's operands are fusions of their own)."""
    shapes = {ins.name: ins.shape for ins in comp.instrs}
    flops = 0.0
    for ins in comp.instrs:
        if ins.op == "dot":
            contracting = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", ins.text)
            lhs = _dims(shapes[ins.operands[0]])
            flops += 2 * _elements(ins.shape) * _contracted(lhs, contracting.group(1) if contracting else "")
        elif ins.op == "fusion":
            nested = re.search(r"calls=%([\w.\-]+)", ins.text)
            if nested and nested.group(1) in comps:
                flops += _dot_flops(comps[nested.group(1)], comps)
    return flops


def _library_gemm_flops(ins: hlo.Instr, shapes: dict[str, str]) -> float:
    """A cuBLAS call's FLOPs: its result (the first element) and the contracted dimensions of its
    left operand, from the call's dot_dimension_numbers."""
    contracting = re.search(r'"lhs_contracting_dimensions":\s*\[([^\]]*)\]', ins.text)
    lhs = _dims(shapes.get(ins.operands[0], "")) if ins.operands else []
    result = hlo.tuple_elements(ins.shape)[0]
    return 2.0 * _elements(result) * _contracted(lhs, contracting.group(1) if contracting else "")


def _attention(
    ins: hlo.Instr, target: str, shapes: dict[str, str], moved: int, documents_per_row: int
) -> Kernel:
    """cuDNN flash attention: 4*B*N*Tq*Tk*H FLOPs (B, N, Tq, Tk from the call's
    intermediate_tensor_shape, H from q), halved when causal; the backward 2.5x that, plus its
    empty document slots: B x (max_seg_per_batch - documents_per_row) x N. (The FLOPs stay those
    of whole rows: an upper bound where rows hold several documents.)"""
    dims = re.search(r'"intermediate_tensor_shape":\s*\{[^{}]*?"dimensions":\s*\[([^\]]*)\]', ins.text)
    batch, heads, tq, tk = (int(d) for d in re.findall(r"\d+", dims.group(1)))
    head_dim = _dims(shapes[ins.operands[0]])[-1]
    flops = 4.0 * batch * heads * tq * tk * head_dim
    mask = re.search(r'"mask_type":\s*"([A-Z_]+)"', ins.text)
    if mask and "CAUSAL" in mask.group(1):
        flops /= 2
    segments = re.search(r'"max_seg_per_batch":\s*"?(\d+)', ins.text)
    slots = int(segments.group(1)) if segments else 1
    if "Backward" not in target:
        return Kernel("attention", "", "", 0, flops=flops, bytes=moved)
    empty = batch * max(slots - documents_per_row, 0) * heads if slots > 1 else 0
    return Kernel("attention-backward", "", "", 0, flops=2.5 * flops, bytes=moved, empty_slots=empty)


# --- Bytes of a fusion -------------------------------------------------------------------------

_VIEWS = ("bitcast", "reshape", "get-tuple-element")
# Root ops that update a parameter's buffer in place, and the operand holding the update: a
# dynamic-update-slice writes its update; a (single-operand) scatter reads and writes the elements
# its updates touch, e.g. a token's row of an embedding gradient, not the whole buffer.
_IN_PLACE = {"dynamic-update-slice": 1, "scatter": 2}


def _root(comp: hlo.Computation) -> hlo.Instr:
    return next((i for i in comp.instrs if i.text.lstrip().startswith("ROOT ")), comp.instrs[-1])


def _through_views(name: str, defs: dict[str, hlo.Instr]) -> hlo.Instr:
    """The instruction `name` is a view of (bitcasts and reshapes followed back)."""
    ins = defs[name]
    while ins.op in ("bitcast", "reshape") and ins.operands and ins.operands[0] in defs:
        ins = defs[ins.operands[0]]
    return ins


def fusion_bytes(body: hlo.Computation) -> int:
    """Bytes one launch of the fusion `body` reads and writes: its parameters and its root's
    outputs, a dynamic-sliced parameter charged its slices, an in-place dynamic-update-slice its
    update, an in-place scatter the elements it touches (see the module docstring)."""
    defs = {ins.name: ins for ins in body.instrs}
    root = _root(body)
    outputs = [defs[n] for n in root.operands] if root.op == "tuple" else [root]
    in_place = set()
    written = 0
    for out in outputs:
        source = _through_views(out.name, defs)
        buffer = _through_views(source.operands[0], defs) if source.op in _IN_PLACE else None
        if buffer is not None and buffer.op == "parameter":
            in_place.add(source.name)
            update = _elements(defs[source.operands[_IN_PLACE[source.op]]].shape) * _itemsize(source.shape)
            # a scatter combines (reads) the elements it writes; an update overwrites them
            written += update * (2 if source.op == "scatter" else 1)
        else:
            written += sum(hlo.shape_bytes(out.shape))
    users = defaultdict(list)
    for ins in body.instrs:
        for operand in set(ins.operands):
            users[operand].append(ins)
    read = sum(_read_bytes(p, users, in_place) for p in body.instrs if p.op == "parameter")
    return read + written


def _itemsize(shape: str) -> int:
    found = hlo._ARRAY.search(shape)
    return hlo.DTYPE_BYTES.get(found.group(1), 0) if found else 0


def _read_bytes(param: hlo.Instr, users: dict[str, list[hlo.Instr]], in_place: set[str]) -> int:
    """Bytes a fusion reads of `param`: the slices where every use (through views) is a slice
    or dynamic-slice of it or the buffer of an in-place update or scatter, else the whole
    parameter."""
    whole = sum(hlo.shape_bytes(param.shape))
    itemsize = _itemsize(param.shape)
    read, pending = 0, [param.name]
    while pending:
        name = pending.pop()
        for user in users.get(name, []):
            if user.op in ("dynamic-slice", "slice") and user.operands[0] == name:
                read += _elements(user.shape) * itemsize
            elif user.op in _IN_PLACE and user.operands[0] == name and user.name in in_place:
                continue
            elif user.op in _VIEWS:
                pending.append(user.name)
            else:
                return whole
    return min(read, whole)


# --- Sources, the estimate, the table ------------------------------------------------------------

_PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the checkout


def _source(ins: hlo.Instr, frames: dict[int, tuple[str, int]], comps: dict[str, hlo.Computation]) -> str:
    """The Python line behind `ins` as "file:line" (a jaxpar file relative to the checkout, an
    installed library's from its package, any other by its base name), else its op_name, else
    "-". A fusion whose own metadata names no line takes the first its body names."""
    found = hlo.source_of(ins, frames)
    called = re.search(r"calls=%([\w.\-]+)", ins.text) if ins.op.startswith("fusion") else None
    if found is None and called and called.group(1) in comps:
        inner = (hlo.source_of(i, frames) for i in comps[called.group(1)].instrs)
        found = next((f for f in inner if f is not None), None)
    if found is not None:
        path, line = found
        if "site-packages" in path:  # an installed library: from its package on
            shown = path.split("site-packages" + os.sep, 1)[1]
        elif os.path.abspath(path).startswith(_PACKAGE_ROOT + os.sep):
            shown = os.path.relpath(path, _PACKAGE_ROOT)
        else:
            shown = os.path.basename(path)
        return f"{shown}:{line}"
    op_name = re.search(r'op_name="([^"]*)"', ins.text)
    return op_name.group(1) if op_name else "-"


@dataclass(frozen=True)
class Estimate:
    """A program's kernels, split the way the fit needs: `work` (the roofline seconds, which no
    fitted constant touches), `launches` and `empty_slots` (what the two constants multiply)."""

    kernels: list[Kernel]
    work: float  # seconds of max(FLOPs / rate, bytes / bandwidth), over all launches
    launches: int
    empty_slots: int

    def step_seconds(self, launch: float, empty_slot: float) -> float:
        return self.work + self.launches * launch + self.empty_slots * empty_slot


def estimate(text: str, rates: Rates, documents_per_row: int = 1) -> Estimate:
    """The ruler's reading of compiled GPU HLO `text` under `rates`, for rows holding
    `documents_per_row` documents (what the measured steps' random tokens were: one)."""
    found = kernels(text, documents_per_row)
    free = replace(rates, launch=0.0, empty_slot=0.0)
    return Estimate(
        found,
        work=sum(k.runs * k.seconds(free)[0] for k in found),
        launches=sum(k.runs for k in found),
        empty_slots=sum(k.runs * k.empty_slots for k in found),
    )


def table(found: list[Kernel], rates: Rates) -> list[dict]:
    """One row per (kind, source line), launches and costs summed, slowest first. A row's bound
    is the one that holds most of its time."""
    rows: dict[tuple[str, str], dict] = {}
    for k in found:
        seconds, bound = k.seconds(rates)
        row = rows.setdefault(
            (k.kind, k.source),
            {
                "kind": k.kind,
                "source": k.source,
                "count": 0,
                "flops": 0.0,
                "bytes": 0,
                "seconds": 0.0,
                "costed": True,
                "_bounds": defaultdict(float),
                "example": k.name,
            },
        )
        row["count"] += k.runs
        row["flops"] += k.runs * k.flops
        row["bytes"] += k.runs * k.bytes
        row["seconds"] += k.runs * seconds
        row["costed"] &= k.costed
        row["_bounds"][bound] += k.runs * seconds
    out = []
    for row in rows.values():
        bounds = row.pop("_bounds")
        out.append({**row, "bound": max(bounds, key=bounds.get)})
    return sorted(out, key=lambda r: -r["seconds"])


def summary(text: str, rates: Rates, model_flops: float, devices: int, documents_per_row: int = 1) -> dict:
    """The estimate for one device's program of a step (all devices run it at once) on rows of
    `documents_per_row` documents: step time, launches per step, MFU (`model_flops` of the whole
    step over step time x peak x devices), and the per-kernel table."""
    found = estimate(text, rates, documents_per_row)
    step = found.step_seconds(rates.launch, rates.empty_slot)
    rows = table(found.kernels, rates)
    return {
        "step_seconds": step,
        "launches": found.launches,
        "mfu": model_flops / (step * rates.peak_flops * devices),
        "model_flops_per_step": model_flops,
        "uncosted_kernels": sum(r["count"] for r in rows if not r["costed"]),
        "rates": {key: value for key, value in vars(rates).items()},
        "kernels": rows,
    }
