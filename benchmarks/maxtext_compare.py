"""`python -m benchmarks.maxtext_compare [--workload NAME|all] [--maxtext-python PY] [--json OUT]`

Compiles MaxText's train step and jaxpar's on the same work (model shape, tokens per step, layout)
for 8 H100s on a machine without a GPU, counts both compiled programs with the same counter and
prints one table: memory per device, collectives (calls and bytes by element type), collective
bytes in all, ring wire bytes, and matmul TFLOP with the share whose operands are both float32.
Nothing runs; no timings. Workloads (WORKLOADS), each the Llama-3.2-1B shape at 32 x 2048 tokens
per step on 8 H100s: `1b-fsdp8` (the default; FSDP, ZeRO-3), `tp8` (tensor parallelism), `zero1`
(optimizer state sharded over 8 data-parallel devices); `all` runs them one after another and
`--json` then holds {workload: result}.

Two processes. MaxText's step is compiled by `benchmarks/maxtext_step.py` under MaxText's own
Python (`--maxtext-python`), which writes the compiled HLO text and XLA's memory analysis to a
temporary folder; jaxpar's step is compiled here, as `python -m jaxpar.inspect --target h100:8`
does. Both use the CUDA plugin's H100 description (`jaxpar.compiled.targets`), the same XLA_FLAGS (yours,
plus `--xla_gpu_autotune_level=0` unless you set a level: nothing can be timed without a GPU, and
tests/conftest.py records that level 0 compiles the same program) and the same jax. Both programs
are then counted here by `jaxpar.compiled.hlo` (`collectives`: calls and bytes per kind; `multiplicities`:
while-loop trip counts) and by `program_summary` below, which splits those bytes by element type,
adds ring wire bytes and counts matmul FLOPs, and checks that its per-kind totals are
`jaxpar.compiled.hlo.collectives`'s.

This script installs nothing. MaxText's environment, as built for the figures in
benchmarks/RESULTS.md (Python 3.12; jax must be the version jaxpar's environment has; MaxText's
import path needs the packages of the last command, found by trial; no TensorFlow, no torch):

    python3.12 -m venv ../.venv-maxtext
    ../.venv-maxtext/bin/pip install "maxtext==0.2.5" --no-deps
    ../.venv-maxtext/bin/pip install "jax[cuda12]==0.12.0.1" flax optax orbax-checkpoint
    ../.venv-maxtext/bin/pip install omegaconf packaging pathwaysutils jinja2 qwix aqtp tokamax \\
        huggingface_hub transformers grain drjax pillow tiktoken sentencepiece sympy \\
        "jax==0.12.0.1" "jaxlib==0.12.0.1"

Without `--maxtext-python`, the first of $MAXTEXT_PYTHON, this Python, `.venv-maxtext/bin/python`
at the repository root and `../.venv-maxtext/bin/python` beside it that imports `maxtext` is used;
none: exit code 2 with these instructions.

MaxText's settings follow its GPU recipe (configs/gpu/models/llama3_8b.yml): cuDNN flash
attention through jax (`cudnn_flash_jax`: the same `__cudnn$fmhaSoftmax` call jaxpar makes; its
`cudnn_flash_te` needs Transformer Engine), `remat_policy=minimal_with_context`,
`use_iota_embed=true`, scanned layers; the model's dimensions are jaxpar's config's, set one by
one (`maxtext_model`; MaxText 0.2.5 names no llama3.2-1b), and its batch is jaxpar's divided over
the devices (`per_device_batch_size`).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import re
import subprocess
import sys
import tempfile
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from jaxpar.compiled import hlo

ROOT = Path(__file__).resolve().parent.parent
STEP_SCRIPT = Path(__file__).resolve().parent / "maxtext_step.py"
TARGET = "h100:8"
GB = 1e9


def maxtext_model(cfg) -> list[str]:
    """jaxpar's model and sequence length (a Config with a Llama-shaped model: SwiGLU, RMSNorm,
    plain rotary) as MaxText settings: the same dimensions, tied or untied head, norm epsilon and
    rotary base. Only what configs/llama-1b.yaml uses is carried over; anything else is refused."""
    m = cfg.model
    plain = m.rope_scaling.type == "none" and m.mlp_activation == "silu" and not (m.qkv_bias or m.qk_norm)
    if not plain or m.embed_scale or m.post_norms or m.sliding_window:
        raise ValueError("maxtext_model carries over a plain Llama shape only")
    return [
        "decoder_block=llama2",
        f"base_emb_dim={m.d_model}",
        f"base_num_query_heads={m.n_heads}",
        f"base_num_kv_heads={m.n_kv_heads}",
        f"head_dim={m.head_dim or m.d_model // m.n_heads}",
        f"base_mlp_dim={m.d_ff}",
        f"base_num_decoder_layers={m.n_layers}",
        f"vocab_size={m.vocab_size}",
        "mlp_activations=[silu,linear]",
        f"logits_via_embedding={str(m.tie_embeddings).lower()}",
        f"normalization_layer_epsilon={m.norm_eps}",
        f"rope_max_timescale={int(m.rope_theta)}",
        "enable_dropout=false",
        f"max_target_length={cfg.train.seq_len}",
    ]


# MaxText's GPU recipe (see the module docstring).
MAXTEXT_RECIPE = (
    "hardware=gpu",
    "attention=cudnn_flash_jax",
    "remat_policy=minimal_with_context",
    "use_iota_embed=true",
    "scan_layers=true",
    "dataset_type=synthetic",
    "enable_checkpointing=false",
    "run_name=maxtext_compare",
)
JAXPAR_MESH = ("mesh.pipe=1", "mesh.data=1", "mesh.expert=1", "mesh.context=1")


@dataclass(frozen=True)
class Workload:
    description: str
    jaxpar: tuple[str, ...]  # config file, then overrides
    maxtext: tuple[str, ...]  # pyconfig settings beyond maxtext_model's and MAXTEXT_RECIPE


WORKLOADS = {
    "1b-fsdp8": Workload(
        "Llama-3.2-1B shape, FSDP (ZeRO-3) over 8 H100s, 32 x 2048 tokens per step",
        ("configs/llama-1b.yaml", *JAXPAR_MESH, "mesh.fsdp=8", "mesh.tensor=1", "parallel.zero_stage=3"),
        ("ici_fsdp_parallelism=8",),
    ),
    "tp8": Workload(
        "Llama-3.2-1B shape, tensor parallelism over 8 H100s, 32 x 2048 tokens per step",
        ("configs/llama-1b.yaml", *JAXPAR_MESH, "mesh.fsdp=1", "mesh.tensor=8", "parallel.zero_stage=0"),
        ("ici_fsdp_parallelism=1", "ici_tensor_parallelism=8"),
    ),
    "zero1": Workload(
        "Llama-3.2-1B shape, ZeRO-1 (optimizer state sharded) over 8 H100s, 32 x 2048 tokens per step",
        ("configs/llama-1b.yaml", *JAXPAR_MESH, "mesh.fsdp=8", "mesh.tensor=1", "parallel.zero_stage=1"),
        ("ici_fsdp_parallelism=1", "ici_data_parallelism=8", "shard_optimizer_over_data=true"),
    ),
}
JAXPAR_WORK = ("train.batch_size=32", "train.seq_len=2048")

# --- Counting ---------------------------------------------------------------------------------

_DIMS = re.compile(r"^\s*([a-z]+\d*[a-z0-9]*)\[([\d,]*)\]")


def _dims(shape: str) -> tuple[str, list[int]]:
    """("f32", [4, 8]) for "f32[4,8]{1,0}" (a tuple shape: its first element)."""
    found = _DIMS.match(hlo.tuple_elements(shape)[0])
    if found is None:
        raise ValueError(f"not an array shape: {shape!r}")
    return found.group(1), [int(d) for d in found.group(2).split(",") if d]


def group_size(ins: hlo.Instr, devices: int) -> int:
    """How many devices take part in one group of collective `ins`: from its replica groups in
    any of XLA's spellings (`{{0,1},{2,3}}`, `[2,4]<=[8]`, `mesh['data'=2,'fsdp'=4] {'fsdp'}`);
    `devices` where it names none (every device)."""
    text = ins.text
    if (found := re.search(r"replica_groups=mesh\[([^\]]*)\](?: \{([^}]*)\})?", text)) is not None:
        sizes = {name: int(n) for name, n in re.findall(r"'([^']+)'=(\d+)", found.group(1))}
        axes = re.findall(r"'([^']+)'", found.group(2)) if found.group(2) else list(sizes)
        return math.prod(sizes[a] for a in axes)
    if (found := re.search(r"replica_groups=\[(\d+),(\d+)\]<=", text)) is not None:
        return int(found.group(2))
    if (found := re.search(r"replica_groups=\{\{([\d,]*)\}", text)) is not None:
        return len(found.group(1).split(","))
    return devices


def ring_factor(kind: str, n: int) -> float:
    """What a ring over `n` devices sends per device, as a multiple of hlo's counted bytes (see
    jaxpar/compiled/hlo.py): an all-reduce is a reduce-scatter and an all-gather."""
    if kind == "collective-permute":
        return 1.0
    share = (n - 1) / n if n > 1 else 0.0
    return 2 * share if kind == "all-reduce" else share


_ARRAY = re.compile(r"\b([a-z]+\d*[a-z0-9]*)\[[\d,]*\]")


def _arrays(shape: str) -> list[tuple[str, int]]:
    """(element type, bytes) of each array in an HLO shape, nested tuples flattened, in the order
    `hlo.shape_bytes` gives their bytes."""
    return [(m.group(1), b) for m in _ARRAY.finditer(shape) for b in hlo.shape_bytes(m.group(0))]


def _buffers(ins: hlo.Instr, shapes: dict[str, str]) -> list[tuple[str, int]]:
    """(element type, bytes) of each buffer `hlo.moved_bytes` counts for `ins`: an all-gather's
    results (an all-gather-start's shape is (operands, results)), else its operands, the first
    ones where hlo counts only those (ragged-all-to-all)."""
    counted = hlo.moved_bytes(ins, shapes)
    if ins.op.removesuffix("-start") == "all-gather":
        out = _arrays(hlo.tuple_elements(ins.shape)[1] if ins.op.endswith("-start") else ins.shape)
    else:
        out = [a for name in ins.operands for a in _arrays(shapes[name])][: len(counted)]
    if [b for _, b in out] != counted:
        raise RuntimeError(f"{ins.op} %{ins.name}: buffers disagree with jaxpar.compiled.hlo.moved_bytes")
    return out


def collective_calls(text: str, devices: int):
    """(kind, times per step, [(dtype, bytes)], group size) for each collective of compiled HLO
    `text`, kinds as `jaxpar.compiled.hlo.collectives` reports them (an XLA:CPU all-reduce feeding only
    slices is a reduce-scatter; a tuple all-reduce of both sorts reports its dtype as "mixed")."""
    comps = hlo.parse(text)
    times = hlo.multiplicities(comps)
    for comp in comps.values():
        if not (n := times.get(comp.name, 0)):
            continue
        shapes = {ins.name: ins.shape for ins in comp.instrs}
        for ins in comp.instrs:
            kind = ins.op.removesuffix("-start")
            if kind not in hlo.KINDS:
                continue
            buffers, size = _buffers(ins, shapes), group_size(ins, devices)
            if kind != "all-reduce":
                yield kind, n, buffers, size
                continue
            parts = hlo._split_all_reduce(comp, comps, ins, [b for _, b in buffers])
            dtypes = {d for d, _ in buffers}
            for part, part_bytes in parts.items():
                dtype = dtypes.pop() if len(parts) == 1 and len(dtypes) == 1 else "mixed"
                yield part, n, [(dtype, part_bytes)], size


_CONTRACT = re.compile(r"lhs_contracting_dims=\{([\d,]*)\}")
_CUBLAS_CONTRACT = re.compile(r'"lhs_contracting_dimensions":\[([^\]]*)\]')


def _dot_flops(ins: hlo.Instr, shapes: dict[str, str]) -> tuple[float, str] | None:
    """(FLOPs, "lhs x rhs" element types) of a dot or a cuBLAS GEMM call; None for anything else.
    FLOPs = 2 x result elements x the contracted size."""
    if ins.op == "dot":
        found = _CONTRACT.search(ins.text)
    elif ins.op == "custom-call" and '"__cublas' in ins.text:
        found = _CUBLAS_CONTRACT.search(ins.text)
    else:
        return None
    if found is None or len(ins.operands) < 2:
        return None
    lhs_type, lhs = _dims(shapes[ins.operands[0]])
    rhs_type, _ = _dims(shapes[ins.operands[1]])
    contracted = math.prod(lhs[int(d.strip('" '))] for d in found.group(1).split(",") if d.strip('" '))
    return 2.0 * math.prod(_dims(ins.shape)[1]) * contracted, f"{lhs_type} x {rhs_type}"


def matmul_flops(text: str) -> dict[str, float]:
    """{"lhs x rhs" element types: FLOPs per step per device} over every dot and cuBLAS GEMM of
    compiled HLO `text`, counted once per run (while-loop trip counts applied; a GEMM fused into
    a Triton fusion counts where it runs). cuDNN attention is not a matmul here."""
    comps = hlo.parse(text)
    times = hlo.multiplicities(comps)
    out: dict[str, float] = defaultdict(float)
    for comp in comps.values():
        if not (n := times.get(comp.name, 0)):
            continue
        shapes = {ins.name: ins.shape for ins in comp.instrs}
        for ins in comp.instrs:
            if (found := _dot_flops(ins, shapes)) is not None:
                out[found[1]] += n * found[0]
    return dict(out)


def program_summary(text: str, memory: dict[str, int], devices: int) -> dict:
    """The comparison's figures for one compiled program (HLO `text`, XLA's memory analysis as
    {"argument", "output", "alias", "temp"} bytes), per device per step."""
    kinds: dict[str, dict] = {}
    wire = 0.0
    for kind, n, buffers, size in collective_calls(text, devices):
        entry = kinds.setdefault(kind, {"calls": 0, "bytes": 0, "by_dtype": defaultdict(int)})
        entry["calls"] += n
        for dtype, nbytes in buffers:
            entry["bytes"] += n * nbytes
            entry["by_dtype"][dtype] += n * nbytes
            wire += n * nbytes * ring_factor(kind, size)
    counted = hlo.collectives(text)
    for kind, entry in kinds.items():
        entry["by_dtype"] = dict(sorted(entry["by_dtype"].items(), key=lambda kv: -kv[1]))
        if (entry["calls"], entry["bytes"]) != (counted[kind]["count"], counted[kind]["bytes"]):
            raise RuntimeError(f"{kind}: the breakdown disagrees with jaxpar.compiled.hlo.collectives")
    flops = matmul_flops(text)
    total = memory["argument"] + memory["output"] - memory["alias"] + memory["temp"]
    return {
        "memory": {"total": total, "temp": memory["temp"]},
        "collectives": kinds,
        "collective_bytes": sum(e["bytes"] for e in kinds.values()),
        "wire_bytes": round(wire),
        "matmul_flops": sum(flops.values()),
        "matmul_flops_by_operands": flops,
        "kernels": hlo.kernels(text),
    }


# --- The table --------------------------------------------------------------------------------


ROW_ORDER = (
    "all-gather",
    "reduce-scatter",
    "all-reduce",
    "all-to-all",
    "ragged-all-to-all",
    "collective-permute",
)


def _size(nbytes: float) -> str:
    """GB (1e9 bytes) to two places; MB below 10 MB, KB below 10 KB, bytes below 1 KB, so that
    small is not shown as zero."""
    for unit, scale, least in (("GB", 1e9, 1e7), ("MB", 1e6, 1e4), ("KB", 1e3, 1e3)):
        if nbytes >= least:
            return f"{nbytes / scale:.2f} {unit}"
    return f"{nbytes:.0f} B"


def _collective_cell(entry: dict | None) -> str:
    if not entry:
        return "-"
    split = entry["by_dtype"]
    if len(split) == 1:
        return f"{entry['calls']} calls, {_size(entry['bytes'])} {next(iter(split))}"
    parts = ", ".join(f"{d} {_size(b)}" for d, b in split.items())
    return f"{entry['calls']} calls, {_size(entry['bytes'])} ({parts})"


def _flops_cell(s: dict) -> str:
    f32 = s["matmul_flops_by_operands"].get("f32 x f32", 0.0)
    total = s["matmul_flops"]
    share = f"{f32 / total:.0%}" if total else "-"
    return f"{total / 1e12:.1f} (f32 x f32: {f32 / 1e12:.1f}, {share})"


def format_table(summaries: dict[str, dict]) -> str:
    """A markdown table, one column per program ({name: program_summary(...)})."""
    names = list(summaries)
    kinds = [k for k in ROW_ORDER if any(k in s["collectives"] for s in summaries.values())]
    rows = [
        (
            "total memory (temp)",
            [
                f"{s['memory']['total'] / GB:.2f} GB ({s['memory']['temp'] / GB:.2f})"
                for s in summaries.values()
            ],
        ),
        *[
            (kind, [_collective_cell(s["collectives"].get(kind)) for s in summaries.values()])
            for kind in kinds
        ],
        ("collective bytes in all", [_size(s["collective_bytes"]) for s in summaries.values()]),
        ("wire bytes (ring)", [_size(s["wire_bytes"]) for s in summaries.values()]),
        ("matmul TFLOP", [_flops_cell(s) for s in summaries.values()]),
    ]
    lines = ["| per device per step | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
    lines += [f"| {label} | " + " | ".join(cells) + " |" for label, cells in rows]
    return "\n".join(lines)


# --- Compiling both ---------------------------------------------------------------------------

INSTALL_HINT = (
    "no Python with MaxText found (tried {tried}); build one as this script's docstring says "
    "(python -m benchmarks.maxtext_compare --help), e.g. python3.12 -m venv ../.venv-maxtext && "
    '../.venv-maxtext/bin/pip install "maxtext==0.2.5" --no-deps && ...; then pass '
    "--maxtext-python ../.venv-maxtext/bin/python"
)


def _imports_maxtext(python: str) -> bool:
    try:
        done = subprocess.run([python, "-c", "import maxtext"], capture_output=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0


def find_maxtext_python(explicit: str | None) -> str:
    """The Python to compile MaxText's step with: `explicit`, else the first candidate (see the
    module docstring) that imports maxtext; a ConfigError with the install hint if none does."""
    from jaxpar.config import ConfigError

    env = os.environ.get("MAXTEXT_PYTHON")
    candidates = [explicit] if explicit else [env, sys.executable]
    if not explicit:
        candidates += [str(ROOT / ".venv-maxtext/bin/python"), str(ROOT.parent / ".venv-maxtext/bin/python")]
    tried = [c for c in candidates if c]
    for python in tried:
        if _imports_maxtext(python):
            return python
    raise ConfigError(INSTALL_HINT.format(tried=", ".join(tried)))


def _xla_flags() -> str:
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_gpu_autotune_level" not in flags:
        flags = f"{flags} --xla_gpu_autotune_level=0".strip()
    return flags


def compile_maxtext(python: str, settings: list[str], target, folder: Path) -> tuple[str, dict]:
    """(HLO text, memory analysis) of MaxText's step with these pyconfig `settings` for
    `target`'s devices, compiled by `python` running maxtext_step.py."""
    (folder / "target.spec").write_text(target.spec)
    settings = [*settings, f"base_output_directory={folder / 'maxtext_output'}"]
    env = {**os.environ, "XLA_FLAGS": _xla_flags()}
    out = folder / "maxtext"
    command = [python, str(STEP_SCRIPT), str(folder / "target.spec"), str(target.count), str(out), *settings]
    done = subprocess.run(command, cwd=folder, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"MaxText's compile failed ({' '.join(command)}):\n{done.stderr[-4000:]}")
    return (out / "hlo.txt").read_text(), json.loads((out / "memory.json").read_text())


def compile_jaxpar(cfg, sizes: dict[str, int], target) -> tuple[str, dict]:
    """(HLO text, memory analysis) of jaxpar's step for `target`'s devices, as inspect compiles it."""
    from jaxpar.compiled import targets as targets_lib
    from jaxpar.training.trainer import build_trainer, compile_step

    compiled = compile_step(build_trainer(cfg, sizes, devices=targets_lib.devices(target)))
    mem = compiled.memory_analysis()
    memory = {k: int(getattr(mem, f"{k}_size_in_bytes")) for k in ("argument", "output", "alias", "temp")}
    return compiled.as_text(), memory


def _commit() -> str:
    """The checkout's commit, "+dirty" where a tracked file other than a result differs from it."""
    done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    dirty = subprocess.run(
        ["git", "status", "--porcelain", "--untracked-files=no", "--", ".", ":(exclude)benchmarks/results"],
        cwd=ROOT,
        capture_output=True,
    )
    return done.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")


def compare(name: str, python: str) -> dict:
    """Both programs of workload `name`, compiled (MaxText's first, then jaxpar's) and counted."""
    from jaxpar.compiled import targets as targets_lib
    from jaxpar.run.startup import load_and_validate

    os.environ["XLA_FLAGS"] = _xla_flags()  # before this process's backend starts
    target = targets_lib.resolve(TARGET)
    targets_lib.use_cpu_backend()
    workload = WORKLOADS[name]
    cfg, sizes = load_and_validate([*workload.jaxpar, *JAXPAR_WORK], num_devices=target.count)
    per_device, left = divmod(cfg.train.batch_size, target.count)
    assert per_device and not left, "the workloads' batches divide over the devices"
    maxtext_settings = [
        *maxtext_model(cfg),
        *MAXTEXT_RECIPE,
        f"per_device_batch_size={per_device}",
        *workload.maxtext,
    ]
    with tempfile.TemporaryDirectory(prefix="maxtext_compare-") as folder:
        maxtext = compile_maxtext(python, maxtext_settings, target, Path(folder))
    jaxpar = compile_jaxpar(cfg, sizes, target)
    import jax

    return {
        "workload": name,
        "description": workload.description,
        "target": f"{target.count} x {target.description} (compile-only, nothing ran)",
        "when": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "jaxpar_commit": _commit(),
        "jax": jax.__version__,
        "xla_flags": os.environ["XLA_FLAGS"],
        "settings": {
            "jaxpar": [*workload.jaxpar, *JAXPAR_WORK],
            "maxtext": maxtext_settings,
        },
        "summary": {
            "jaxpar": program_summary(*jaxpar, target.count),
            "MaxText": program_summary(*maxtext, target.count),
        },
    }


def _run(args) -> int:
    python = find_maxtext_python(args.maxtext_python)
    names = list(WORKLOADS) if args.workload == "all" else [args.workload]
    results = {}
    for name in names:  # one compile at a time
        result = results[name] = compare(name, python)
        print(f"\n{result['description']}; {result['target']}")
        print(f"jaxpar {result['jaxpar_commit']}, MaxText 0.2.5, jax {result['jax']}, {result['when']}")
        print("GB = 1e9 bytes, counted by jaxpar/compiled/hlo.py (all-gather: result; reduce-scatter: input)")
        print(format_table(result["summary"]))
        if args.json:  # {workload: result}, rewritten after each
            Path(args.json).write_text(json.dumps(results, indent=1) + "\n")
    return 0


def main(argv: list[str] | None = None) -> int:
    from jaxpar import cli

    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__,
    )
    parser.add_argument("--workload", choices=[*WORKLOADS, "all"], default="1b-fsdp8")
    parser.add_argument("--maxtext-python", help="a Python that imports maxtext (default: see below)")
    parser.add_argument("--json", help="also write the result as JSON here")
    args = parser.parse_args(argv)
    return cli.run(lambda: _run(args))


if __name__ == "__main__":
    sys.exit(main())
