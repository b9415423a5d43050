"""`python -m benchmarks.ruler_fit --plain PLAIN.py [--cache DIR] [--out JSON]`: checks the ruler
(`jaxpar.compiled.ruler`) against twelve train steps measured on one H100, and fits its two constants.

Each program is compiled here, on a machine without a GPU, for one H100 (`jaxpar.compiled.targets`), one
at a time in a child process with a time limit (the presets' compiles take minutes and GBs):

- nine jaxpar steps: `configs/gpt2-124m.yaml` and `configs/llama-1b.yaml` with the settings of
  `benchmarks/RESULTS.md`'s H100 session of 2026-11-27;
- three steps of a plain-JAX GPT-2 (no framework: scanned layers, float32 parameters cast to
  bfloat16, cuDNN attention, optax AdamW, float32 logits), measured on an H100 on 2026-11-22. Its
  program is not part of jaxpar: `--plain` names a script that takes `BATCH SEQ` as arguments, reads
  a GpuTargetConfigProto from the file `$H100_SPEC`, compiles its step and leaves the compiled
  program in its global `c`. Its XLA-attention row is the same script with
  `implementation="cudnn"` replaced by `implementation="xla"`.

The ruler splits each estimate into its roofline seconds W (no constant in it), its kernel launches
K and the empty document slots S of cuDNN's packed backward; the estimate is W + launch x K +
slot x S, linear in the two constants. They are fitted by least squares on the relative error
(minimising the sum of ((estimate - measured) / measured)^2) over the twelve rows; the script prints
them, the rms and worst relative error, the leave-one-out rms and worst (each row predicted by the
constants fitted on the other eleven), the rows, and the estimates of the presets as shipped, with
rows holding 24 documents, and compiled with `model.max_documents_per_row=24`.

Child processes compile with `--xla_gpu_autotune_level=0` (nothing to autotune without a GPU; the
same program in half the time, see tests/conftest.py). `--cache DIR` keeps each row's reading so
that a rerun compiles only what is missing.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

import numpy as np

# Measured on one H100 80GB HBM3: jaxpar's rows in benchmarks/RESULTS.md (session of 2026-11-27,
# jax 0.11.2, median of 10-20 timed steps, random tokens: one document per row); the plain
# program's rows in the session of 2026-11-22 (jax 0.11.2, mean of 20 steps).


@dataclass(frozen=True)
class Row:
    name: str
    source: str  # a config file, or "plain" (the --plain script)
    settings: tuple[str, ...]  # config overrides, or the plain script's arguments
    measured_ms: float | None  # None: estimated only
    xla_attention: bool = False  # plain only: implementation="xla"


GPT2, LLAMA = "configs/gpt2-124m.yaml", "configs/llama-1b.yaml"
CHUNKS1, DOCS1 = "train.loss_chunks=1", "model.max_documents_per_row=1"
MEASURED = (
    Row("gpt2-124m", GPT2, (), 53.26),
    Row("gpt2-124m chunks=1", GPT2, (CHUNKS1,), 50.07),
    Row("gpt2-124m docs=1", GPT2, (DOCS1,), 46.95),
    Row("gpt2-124m chunks=1 docs=1", GPT2, (CHUNKS1, DOCS1), 43.93),
    Row("gpt2-124m attention=xla", GPT2, ("model.attention=xla",), 95.25),
    Row("gpt2-124m batch=32", GPT2, ("train.batch_size=32",), 121.64),
    Row("llama-1b", LLAMA, (), 347.66),
    Row("llama-1b chunks=1", LLAMA, (CHUNKS1,), 322.14),
    Row("llama-1b docs=1", LLAMA, (DOCS1,), 334.61),
    Row("plain gpt2 12x1024", "plain", ("12", "1024"), 40.6),
    Row("plain gpt2 12x1024 attention=xla", "plain", ("12", "1024"), 88.1, xla_attention=True),
    Row("plain gpt2 32x1024", "plain", ("32", "1024"), 100.4),
)
DOCS24 = "model.max_documents_per_row=24"
ESTIMATED = (
    Row("gpt2-124m docs=24", GPT2, (DOCS24,), None),
    Row("llama-1b docs=24", LLAMA, (DOCS24,), None),
)
# Rows of the same program family, for the ordering check.
FAMILIES = ("gpt2-124m", "llama-1b", "plain")


def _jaxpar_text(row: Row) -> tuple[str, float]:
    """(compiled HLO, model FLOPs per step) of a jaxpar row, as `inspect --target h100` compiles."""
    from jaxpar.checks import validate
    from jaxpar.compiled import targets as targets_lib
    from jaxpar.config import load_config
    from jaxpar.training import metrics
    from jaxpar.training.trainer import build_trainer, compile_step

    cfg = load_config(row.source, list(row.settings))
    target = targets_lib.resolve("h100")
    trainer = build_trainer(cfg, validate(cfg, 1), devices=targets_lib.devices(target))
    t = cfg.train
    flops = metrics.flops_per_token(cfg.model, t.seq_len) * t.batch_size * t.seq_len
    return compile_step(trainer).as_text(), flops


def _plain_text(row: Row, script: str) -> tuple[str, None]:
    """The plain program's compiled HLO (its model FLOPs are not computed here)."""
    from jaxpar.compiled import targets as targets_lib

    source = open(script).read()
    if row.xla_attention:
        if source.count('implementation="cudnn"') != 1:
            raise SystemExit(f'{script}: expected one implementation="cudnn" to switch to "xla"')
        source = source.replace('implementation="cudnn"', 'implementation="xla"')
    with tempfile.NamedTemporaryFile("w", suffix=".txtpb", delete=False) as spec:
        spec.write(targets_lib.resolve("h100").spec)
    os.environ["H100_SPEC"] = spec.name
    sys.argv = [script, *row.settings]
    scope = {"__name__": "__main__", "__file__": script}
    exec(compile(source, script, "exec"), scope)
    os.unlink(spec.name)
    return scope["c"].as_text(), None


def read_row(row: Row, script: str | None) -> dict:
    """The ruler's reading of one row's compiled program (run in a child process)."""
    from jaxpar.compiled import ruler

    started = time.time()
    text, flops = _plain_text(row, script) if row.source == "plain" else _jaxpar_text(row)
    compile_seconds = time.time() - started
    rates = ruler.RATES["h100"]
    one, many = ruler.estimate(text, rates), ruler.estimate(text, rates, documents_per_row=24)
    uncosted = sum(k.runs for k in one.kernels if not k.costed)
    return {
        "work_s": one.work,
        "launches": one.launches,
        "empty_slots": one.empty_slots,
        "empty_slots_24_documents": many.empty_slots,
        "uncosted_launches": uncosted,
        "model_flops_per_step": flops,
        "compile_seconds": compile_seconds,
    }


def _child(row: Row, script: str | None, timeout: int) -> dict:
    """`read_row` in a fresh process: one compile's memory at a time, and a time limit."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_gpu_autotune_level=0").strip()
    command = [sys.executable, "-m", "benchmarks.ruler_fit", "--row", row.name]
    try:
        done = subprocess.run(
            command + (["--plain", script] if script else []),
            capture_output=True,
            text=True,
            timeout=timeout,
            env=env,
        )
    except subprocess.TimeoutExpired:
        raise SystemExit(f"{row.name}: the compile ran past {timeout} s (--timeout)") from None
    if done.returncode != 0:
        raise SystemExit(f"{row.name}: the compile failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def readings(rows, script: str | None, cache: str, timeout: int) -> dict[str, dict]:
    """{row name: its reading}, from `cache` where a previous run left it, else compiled now."""
    os.makedirs(cache, exist_ok=True)
    out = {}
    for row in rows:
        path = os.path.join(cache, row.name.replace(" ", "_").replace("=", "-") + ".json")
        if os.path.exists(path):
            out[row.name] = json.load(open(path))
            continue
        print(f"compiling {row.name} ...", file=sys.stderr, flush=True)
        out[row.name] = _child(row, script, timeout)
        print(f"  {out[row.name]['compile_seconds']:.0f} s", file=sys.stderr, flush=True)
        with open(path, "w") as f:
            json.dump(out[row.name], f)
    return out


def fit(points: list[tuple[dict, float]]) -> np.ndarray:
    """(launch seconds, empty-slot seconds) minimising the relative squared error of
    W + launch x K + slot x S against the measured seconds."""
    a = np.array([[r["launches"] / m, r["empty_slots"] / m] for r, m in points])
    b = np.array([1 - r["work_s"] / m for r, m in points])
    return np.linalg.lstsq(a, b, rcond=None)[0]


def _estimate(reading: dict, constants, slots_key: str = "empty_slots") -> float:
    launch, slot = constants
    return reading["work_s"] + launch * reading["launches"] + slot * reading[slots_key]


def _errors(points, constants) -> np.ndarray:
    return np.array([_estimate(r, constants) / m - 1 for r, m in points])


def _ordered_pairs(names: list[str], measured: dict, estimated: dict) -> tuple[int, int]:
    """(pairs of rows of one family whose estimates order as their measurements, all such pairs)."""
    good = total = 0
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            if next(f for f in FAMILIES if a.startswith(f)) != next(f for f in FAMILIES if b.startswith(f)):
                continue
            total += 1
            good += int((measured[a] - measured[b]) * (estimated[a] - estimated[b]) > 0)
    return good, total


def analyse(found: dict[str, dict]) -> dict:
    """The fit, its errors and leave-one-out errors, and every row's estimate."""
    from jaxpar.compiled import ruler

    names = [r.name for r in MEASURED]
    points = [(found[r.name], r.measured_ms / 1e3) for r in MEASURED]
    constants = fit(points)
    errors = _errors(points, constants)
    held_out = np.array(
        [_errors([points[i]], fit(points[:i] + points[i + 1 :]))[0] for i in range(len(points))]
    )
    table = ruler.RATES["h100"]
    tabled = (table.launch, table.empty_slot)
    estimated = {n: _estimate(found[n], constants) for n in names}
    good, total = _ordered_pairs(names, {r.name: r.measured_ms for r in MEASURED}, estimated)
    rows = [
        {
            "name": r.name,
            "measured_ms": r.measured_ms,
            "estimated_ms": 1e3 * estimated[r.name],
            "estimated_ms_table_constants": 1e3 * _estimate(found[r.name], tabled),
            "leave_one_out_error": float(held_out[i]),
            **found[r.name],
        }
        for i, r in enumerate(MEASURED)
    ]
    return {
        "launch_s": float(constants[0]),
        "empty_slot_s": float(constants[1]),
        "points": len(points),
        "rms_error": float(np.sqrt(np.mean(errors**2))),
        "worst_error": float(np.max(np.abs(errors))),
        "leave_one_out_rms_error": float(np.sqrt(np.mean(held_out**2))),
        "leave_one_out_worst_error": float(np.max(np.abs(held_out))),
        "table_constants": {"launch_s": tabled[0], "empty_slot_s": tabled[1]},
        "rms_error_table_constants": float(np.sqrt(np.mean(_errors(points, tabled) ** 2))),
        "pairs_in_measured_order": [good, total],
        "rows": rows,
        "presets": _presets(found, constants),
    }


def _presets(found: dict[str, dict], constants) -> list[dict]:
    """The presets as shipped (one document per row, as measured; and rows holding 24 documents,
    the same program) and compiled with model.max_documents_per_row=24, by the fitted constants."""
    from jaxpar.compiled import ruler

    peak = ruler.RATES["h100"].peak_flops  # MFU's denominator
    out = []
    for name, reading, slots_key in (
        ("gpt2-124m as shipped, 1 document per row", found["gpt2-124m"], "empty_slots"),
        ("gpt2-124m as shipped, 24 documents per row", found["gpt2-124m"], "empty_slots_24_documents"),
        ("gpt2-124m max_documents_per_row=24, 1 document per row", found["gpt2-124m docs=24"], "empty_slots"),
        ("llama-1b as shipped, 1 document per row", found["llama-1b"], "empty_slots"),
        ("llama-1b as shipped, 24 documents per row", found["llama-1b"], "empty_slots_24_documents"),
        ("llama-1b max_documents_per_row=24, 1 document per row", found["llama-1b docs=24"], "empty_slots"),
    ):
        step = _estimate(reading, constants, slots_key)
        out.append(
            {
                "name": name,
                "estimated_ms": 1e3 * step,
                "launches": reading["launches"],
                "mfu": reading["model_flops_per_step"] / (step * peak),
            }
        )
    return out


def report(result: dict) -> str:
    lines = [
        f"fitted on {result['points']} measured H100 steps: launch {result['launch_s'] * 1e6:.2f} us "
        f"per kernel, {result['empty_slot_s'] * 1e9:.1f} ns per empty (row, document slot, head)",
        f"rms error {result['rms_error']:.1%} (worst {result['worst_error']:.1%}); leave-one-out rms "
        f"{result['leave_one_out_rms_error']:.1%} (worst {result['leave_one_out_worst_error']:.1%})",
        "with the table's constants (jaxpar.compiled.ruler.RATES): "
        f"rms {result['rms_error_table_constants']:.1%}; "
        f"same-family pairs in the measured order: {result['pairs_in_measured_order'][0]} of "
        f"{result['pairs_in_measured_order'][1]}",
        "",
        f"{'program':<36} {'measured ms':>11} {'estimated':>9} {'error':>7} {'held out':>8} {'kernels':>8}",
    ]
    for r in result["rows"]:
        lines.append(
            f"{r['name']:<36} {r['measured_ms']:>11.2f} {r['estimated_ms']:>9.2f} "
            f"{r['estimated_ms'] / r['measured_ms'] - 1:>+7.1%} {r['leave_one_out_error']:>+8.1%} "
            f"{r['launches']:>8,}"
        )
    lines += ["", f"{'preset (estimated, fitted constants)':<56} {'ms':>8} {'kernels':>8} {'MFU':>6}"]
    for p in result["presets"]:
        lines.append(f"{p['name']:<56} {p['estimated_ms']:>8.2f} {p['launches']:>8,} {p['mfu']:>6.1%}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--plain", help="the plain-JAX GPT-2 program (see the module docstring)")
    parser.add_argument("--cache", default=os.path.join(tempfile.gettempdir(), "jaxpar-ruler-fit"))
    parser.add_argument("--out", default="benchmarks/results/ruler_fit-h100.json")
    parser.add_argument("--timeout", type=int, default=1800, help="seconds per compile")
    parser.add_argument("--row", help=argparse.SUPPRESS)  # a child process: one row's reading
    args = parser.parse_args(argv)
    rows = {r.name: r for r in MEASURED + ESTIMATED}
    if args.row:
        print(json.dumps(read_row(rows[args.row], args.plain)))
        return 0
    if not args.plain:
        parser.error("--plain PATH is needed for the three plain-JAX rows")
    found = readings(MEASURED + ESTIMATED, args.plain, args.cache, args.timeout)
    result = analyse(found)
    print(report(result))
    import jax

    result["measured_on"] = "one NVIDIA H100 80GB HBM3, jax 0.11.2 (2026-11-22 and 2026-11-27 sessions)"
    result["compiled_on"] = {
        "date": datetime.date.today().isoformat(),
        "jax": jax.__version__,
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, no GPU",
        "xla_flags": "--xla_gpu_autotune_level=0",
    }
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
