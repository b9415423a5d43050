"""Reading collectives out of compiled HLO text: what kind, how many times, how many bytes.

Counts are dynamic: a collective inside a `while` body (the scan over layers, a chunk loop) counts
once per iteration, using the trip count XLA records in the loop's backend config; loops nest. A
collective inside a `conditional` branch counts as if its branch were taken each time (an upper
bound: one branch runs). Collectives inside fusions (XLA:GPU's Triton all-reduces) and async
wrappers count where they run, once per start, never again at the matching `-done`.

Bytes are per device and per call, one convention for every backend and for the sync and async
(`-start` / `-done`) forms alike, a tuple-shaped (combined) collective summed over its elements:

| collective | bytes counted |
| --- | --- |
| all-gather | its result (the gathered buffer) |
| reduce-scatter | its input (the unscattered buffer) |
| all-reduce | its operands (= its result) |
| all-to-all, collective-permute | its operands |
| ragged-all-to-all | its input buffer (an upper bound on what it sends) |

These are buffer sizes, not what a link carries. A ring over n devices sends, per device,
(n-1)/n of the counted bytes for an all-gather, a reduce-scatter or an all-to-all, 2(n-1)/n of
them for an all-reduce (a reduce-scatter, then an all-gather) and all of them for a
collective-permute; "wire" bytes follow from these and the group size. This module reports the
buffer sizes only.

XLA:CPU note. The SPMD partitioner writes a gradient reduce-scatter as an all-reduce whose result
is immediately cut to the local shard by a dynamic-slice; GPU and TPU compilers rewrite that pair
into one reduce-scatter, XLA:CPU runs it as it stands. An all-reduce whose every result feeds only
dynamic-slices (possibly through a dtype convert: XLA:CPU all-reduces bfloat16 gradients in
float32 and converts back) is therefore reported as a reduce-scatter, with `as_all_reduce`
counting those pairs, so that one report describes the program on every backend. Its bytes are the
all-reduce's operands: the unscattered input, as for a real reduce-scatter.
"""

from __future__ import annotations

import math
import re
from collections import defaultdict
from dataclasses import dataclass, field

KINDS = (
    "all-reduce",
    "all-gather",
    "reduce-scatter",
    "all-to-all",
    "ragged-all-to-all",
    "collective-permute",
)

DTYPE_BYTES = {
    "pred": 1,
    "s8": 1,
    "u8": 1,
    "s16": 2,
    "u16": 2,
    "f16": 2,
    "bf16": 2,
    "s32": 4,
    "u32": 4,
    "f32": 4,
    "s64": 8,
    "u64": 8,
    "f64": 8,
    "c64": 8,
    "c128": 16,
    "f8e4m3fn": 1,
    "f8e5m2": 1,
}

_INSTR = re.compile(
    r"^\s*(?:ROOT\s+)?%(?P<name>[\w.\-]+) = (?P<shape>.*?) (?P<op>[a-z][\w\-]*)\((?P<args>.*)$"
)
_COMP = re.compile(r"^(?:ENTRY\s+)?%(?P<name>[\w.\-]+) \(.*\{\s*$")
_ARRAY = re.compile(r"\b([a-z]+\d*[a-z0-9]*)\[([\d,]*)\]")
_CALLED = re.compile(r"(?:body|calls|to_apply|condition|true_computation|false_computation)=%([\w.\-]+)")


@dataclass
class Instr:
    name: str
    shape: str
    op: str
    operands: list[str]
    text: str


@dataclass
class Computation:
    name: str
    instrs: list[Instr] = field(default_factory=list)
    is_entry: bool = False


def shape_bytes(shape: str) -> list[int]:
    """Bytes of each array in an HLO shape ("f32[4,8]{1,0}" or a tuple of them)."""
    out = []
    for dtype, dims in _ARRAY.findall(shape):
        if dtype in DTYPE_BYTES:
            size = math.prod(int(d) for d in dims.split(",") if d) if dims else 1
            out.append(size * DTYPE_BYTES[dtype])
    return out


def parse(text: str) -> dict[str, Computation]:
    comps: dict[str, Computation] = {}
    current = None
    for line in text.splitlines():
        head = _COMP.match(line)
        if head:
            current = Computation(head.group("name"), is_entry=line.startswith("ENTRY"))
            comps[current.name] = current
            continue
        m = _INSTR.match(line)
        if m and current is not None:
            args = m.group("args").split("),", 1)[0]
            current.instrs.append(
                Instr(
                    m.group("name"), m.group("shape"), m.group("op"), re.findall(r"%([\w.\-]+)", args), line
                )
            )
    return comps


def _callees(ins: Instr) -> list[str]:
    """Computations `ins` runs: loop bodies and conditions, fusions, async wrappers, reducers,
    conditional branches. An async `-done` or `-update` runs none: its `-start` did."""
    if ins.op.endswith(("-done", "-update")):
        return []
    branches = [
        name
        for group in re.findall(r"branch_computations=\{([^}]*)\}", ins.text)
        for name in re.findall(r"%([\w.\-]+)", group)
    ]
    return _CALLED.findall(ins.text) + branches


def multiplicities(comps: dict[str, Computation]) -> dict[str, int]:
    """How many times each computation runs per call of the entry: a while body its recorded
    trip count (1 where XLA recorded none) per run of the loop; every other callee, conditional
    branches included, once per run of its caller."""
    times: dict[str, int] = defaultdict(int)
    entry = next(c for c in comps.values() if c.is_entry)

    def visit(name: str, n: int) -> None:
        times[name] += n
        for ins in comps[name].instrs:
            trips = 1
            if ins.op == "while":
                found = re.search(r'"known_trip_count":\{"n":"(\d+)"', ins.text)
                trips = int(found.group(1)) if found else 1
            for callee in _callees(ins):
                if callee in comps:
                    visit(callee, n * (trips if callee in _body_of(ins) else 1))

    visit(entry.name, 1)
    return times


def _body_of(ins: Instr) -> set[str]:
    return set(re.findall(r"body=%([\w.\-]+)", ins.text))


def tuple_elements(shape: str) -> list[str]:
    """The top-level elements of a tuple shape: "(f32[4]{0}, (bf16[2], bf16[2]))" gives
    "f32[4]{0}" and "(bf16[2], bf16[2])"; a shape that is not a tuple is its own one element."""
    shape = re.sub(r"/\*.*?\*/", "", shape).strip()
    if not shape.startswith("("):
        return [shape]
    out, depth, start = [], 0, 1
    for at, char in enumerate(shape):
        depth += char in "([{"
        depth -= char in ")]}"
        if (char == "," and depth == 1) or (char == ")" and depth == 0):
            out.append(shape[start:at].strip())
            start = at + 1
    return [e for e in out if e]


def moved_bytes(ins: Instr, shapes: dict[str, str]) -> list[int]:
    """Bytes of each buffer that collective `ins` works on, by the module's convention: an
    all-gather's results, any other kind's operands (`shapes`: instruction name -> shape, in the
    computation of `ins`). An all-gather-start's shape is the pair (operands, results)."""
    kind = ins.op.removesuffix("-start")
    if kind == "all-gather":
        result = tuple_elements(ins.shape)[1] if ins.op.endswith("-start") else ins.shape
        return shape_bytes(result)
    operands = ins.operands
    if kind == "ragged-all-to-all" or "slice_sizes=" in ins.text:
        operands = operands[:1]  # the input; the others are the output buffer and offsets
    missing = [name for name in operands if name not in shapes]
    if missing:
        raise ValueError(f"HLO {ins.op} %{ins.name}: operand {missing[0]} is not defined in its computation")
    return [b for name in operands for b in shape_bytes(shapes[name])]


_PASS_THROUGH = ("get-tuple-element", "bitcast", "copy", "convert")


def _is_pass_through(body: Computation) -> bool:
    """A fusion that only converts / reshapes its single operand (a dtype cast of a gradient)."""
    ops = [i.op for i in body.instrs]
    return ops.count("parameter") == 1 and all(op == "parameter" or op in _PASS_THROUGH for op in ops)


def _feeds_only_slices(comp: Computation, comps: dict[str, Computation], name: str) -> bool:
    """Whether every use of `name` -- through tuple elements, bitcasts, copies and dtype
    converts, fused or not -- is a dynamic-slice, directly or as the first thing a fusion does
    with that operand."""
    users = [i for i in comp.instrs if name in i.operands]
    if not users:
        return False
    for user in users:
        if user.op in _PASS_THROUGH:
            if not _feeds_only_slices(comp, comps, user.name):
                return False
        elif user.op == "dynamic-slice":
            continue
        elif user.op == "fusion":
            callee = re.search(r"calls=%([\w.\-]+)", user.text)
            body = comps.get(callee.group(1)) if callee else None
            if body is None:
                return False
            index = user.operands.index(name)
            param = next(
                (
                    i.name
                    for i in body.instrs
                    if i.op == "parameter" and re.search(rf"parameter\({index}\)", i.text)
                ),
                None,
            )
            if param is not None and _feeds_only_slices(body, comps, param):
                continue
            if not (_is_pass_through(body) and _feeds_only_slices(comp, comps, user.name)):
                return False
        else:
            return False
    return True


def _split_all_reduce(
    comp: Computation, comps: dict[str, Computation], ins: Instr, sizes: list[int]
) -> dict[str, int]:
    """Bytes of an (optionally tuple-shaped) all-reduce that are really all-reduced, and those
    whose result is only sliced (a reduce-scatter in the partitioner's spelling)."""
    parts: dict[str, int] = defaultdict(int)
    if len(sizes) == 1:
        sliced = _feeds_only_slices(comp, comps, ins.name)
        parts["reduce-scatter" if sliced else "all-reduce"] += sizes[0]
        return dict(parts)
    elements = {
        int(re.search(r"index=(\d+)", i.text).group(1)): i.name
        for i in comp.instrs
        if i.op == "get-tuple-element" and i.operands[:1] == [ins.name]
    }
    for index, size in enumerate(sizes):
        sliced = index in elements and _feeds_only_slices(comp, comps, elements[index])
        parts["reduce-scatter" if sliced else "all-reduce"] += size
    return dict(parts)


def collectives(text: str) -> dict[str, dict[str, int]]:
    """{kind: {"count", "bytes", "dtypes"}} for each collective kind found in compiled HLO
    `text`; `dtypes` lists the element types moved (e.g. ["bf16"] for FSDP's gathers).

    A reduce-scatter entry may carry `as_all_reduce`: how many of its count are all-reduce +
    dynamic-slice pairs (see the module docstring).
    """
    comps = parse(text)
    times = multiplicities(comps)
    stats: dict[str, dict[str, int]] = {}
    for comp in comps.values():
        n = times.get(comp.name, 0)
        if n == 0:
            continue
        shapes = {ins.name: ins.shape for ins in comp.instrs}
        for ins in comp.instrs:
            kind = ins.op.removesuffix("-start")
            if kind not in KINDS:
                continue
            sizes = moved_bytes(ins, shapes)
            parts = {kind: sum(sizes)}
            if kind == "all-reduce":
                parts = _split_all_reduce(comp, comps, ins, sizes)
            dtypes = sorted({d for d, _ in _ARRAY.findall(ins.shape) if d in DTYPE_BYTES})
            for part, part_bytes in parts.items():
                entry = stats.setdefault(part, {"count": 0, "bytes": 0, "dtypes": []})
                entry["count"] += n
                entry["bytes"] += n * part_bytes
                entry["dtypes"] = sorted(set(entry["dtypes"]) | set(dtypes))
                if part != kind:
                    entry["as_all_reduce"] = entry.get("as_all_reduce", 0) + n
    return stats


_TARGET = re.compile(r'custom_call_target="([^"]+)"')


def kernels(text: str) -> dict[str, int]:
    """{custom-call target: how many times it runs per call of the entry} in compiled HLO `text`:
    the library kernels a program uses (`__cudnn$fmhaSoftmax` is cuDNN's flash attention,
    `__cublas$lt$matmul` a cuBLASLt GEMM). Calls inside the layer loop count once per layer."""
    comps = parse(text)
    times = multiplicities(comps)
    counts: dict[str, int] = defaultdict(int)
    for comp in comps.values():
        n = times.get(comp.name, 0)
        for ins in comp.instrs:
            if ins.op == "custom-call" and n:
                found = _TARGET.search(ins.text)
                if found:
                    counts[found.group(1)] += n
    return dict(sorted(counts.items()))


# --- What a GPU program launches, and where in Python each launch came from ----------------------

# Instructions that launch nothing on a GPU: buffer plumbing (parameters, tuples, bitcasts,
# constants baked into the program), control flow that runs the computations it calls, and the
# second half of an async pair (its `-start` did the work).
NOT_LAUNCHED = frozenset(
    {
        "parameter",
        "constant",
        "get-tuple-element",
        "tuple",
        "bitcast",
        "while",
        "conditional",
        "call",
        "after-all",
        "add-dependency",
        "opt-barrier",
        "domain",
        "partition-id",
        "replica-id",
        "async-start",
        "async-update",
    }
)


def is_launch(ins: Instr) -> bool:
    """Whether `ins`, in a computation the GPU runs, is a kernel (or library call, copy or
    collective) of its own: not plumbing, control flow or the `-done` of an async pair."""
    return ins.op not in NOT_LAUNCHED and not ins.op.endswith(("-done", "-update"))


def launched(comps: dict[str, Computation]) -> dict[str, int]:
    """{computation: runs per call of the entry} for the computations whose instructions the GPU
    launches one by one: the entry, `while` bodies (x the recorded trip count), conditional
    branches (each as if taken: an upper bound), `call`ed computations and async wrappers. A
    fusion's body is one kernel, not several, and a reducer is part of its caller: neither is
    listed. A loop condition runs only where XLA recorded no trip count (with one, XLA:GPU's
    while thunk runs the body that many times without evaluating the condition)."""
    times: dict[str, int] = defaultdict(int)
    entry = next(c for c in comps.values() if c.is_entry)

    def visit(name: str, n: int) -> None:
        times[name] += n
        for ins in comps[name].instrs:
            for callee, runs in _launched_callees(ins):
                if callee in comps:
                    visit(callee, n * runs)

    visit(entry.name, 1)
    return dict(times)


def _launched_callees(ins: Instr) -> list[tuple[str, int]]:
    """(computation, runs per run of `ins`) for what `ins` runs instruction by instruction."""
    if ins.op == "while":
        found = re.search(r'"known_trip_count":\{"n":"(\d+)"', ins.text)
        body = [(name, int(found.group(1)) if found else 1) for name in _body_of(ins)]
        condition = re.findall(r"condition=%([\w.\-]+)", ins.text)
        return body + ([] if found else [(name, 1) for name in condition])
    if ins.op == "conditional":
        return [(name, 1) for name in _callees(ins)]
    if ins.op in ("call", "async-start"):
        return [(name, 1) for name in re.findall(r"(?:to_apply|calls)=%([\w.\-]+)", ins.text)]
    return []


_FRAME_TABLES = ("FileNames", "FunctionNames", "FileLocations", "StackFrames")


def source_lines(text: str) -> dict[int, tuple[str, int]]:
    """{stack_frame_id: (file, line)} from the tables newer XLA prints before the computations
    (an instruction's `metadata={... stack_frame_id=N}`): the innermost frame, i.e. the Python
    line that made the operation (jax leaves its own frames out)."""
    tables: dict[str, dict[int, str]] = {name: {} for name in _FRAME_TABLES}
    current = None
    for line in text.splitlines():
        if line in _FRAME_TABLES:
            current = tables[line]
            continue
        row = re.match(r"^(\d+) (.*)$", line) if current is not None else None
        if row is None:
            current = None
            continue
        current[int(row.group(1))] = row.group(2)
    files = {i: name.strip('"') for i, name in tables["FileNames"].items()}
    locations = {}
    for i, location in tables["FileLocations"].items():
        file_id = re.search(r"file_name_id=(\d+)", location)
        line_no = re.search(r"\bline=(\d+)", location)
        if file_id and line_no:
            locations[i] = (files.get(int(file_id.group(1)), "?"), int(line_no.group(1)))
    out = {}
    for i, frame in tables["StackFrames"].items():
        location = re.search(r"file_location_id=(\d+)", frame)
        if location and int(location.group(1)) in locations:
            out[i] = locations[int(location.group(1))]
    return out


def source_of(ins: Instr, frames: dict[int, tuple[str, int]]) -> tuple[str, int] | None:
    """(file, line) of the Python that made `ins`: its metadata's source_file/source_line, or
    its stack frame in `frames` (`source_lines`); None where the metadata names neither."""
    file = re.search(r'source_file="([^"]*)"', ins.text)
    line = re.search(r"source_line=(\d+)", ins.text)
    if file and line:
        return file.group(1), int(line.group(1))
    frame = re.search(r"stack_frame_id=(\d+)", ins.text)
    return frames.get(int(frame.group(1))) if frame else None
