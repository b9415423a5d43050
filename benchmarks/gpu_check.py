"""`python -m benchmarks.gpu_check [--nanogpt DIR] [--plain-gpt2 PATH] [--plain-llama PATH]
[--out JSON] [--budget SECONDS] [--dry-run]`: the first thing to run when a GPU is at hand.

One run measures, in this order (cheap and most informative first), each piece in a child
process with a time limit, each written to the JSON as soon as it ends (a run cut short keeps
what finished; a piece that fails or times out costs only itself):

1. `gpt2_b12`, `gpt2_b32`: jaxpar's GPT-2 124M (configs/gpt2-124m.yaml) at batch 12 and 32, each
   `python -m benchmarks.bench` (its timing, its JSON: 20 steps after 3 warm-up);
2. `nanogpt_b12`, `nanogpt_b32`: nanoGPT's step on the same GPU (`benchmarks/nanogpt_step.py`,
   its own process so that torch and jax never share one), when `--torch-python` imports a
   PyTorch that sees a CUDA device and `--nanogpt DIR` holds nanoGPT's model.py;
3. `plain_gpt2_b12`, `plain_gpt2_b32`, `plain_llama_b8`: the plain-JAX reference programs, when
   `--plain-gpt2` / `--plain-llama` name them. Such a script takes `BATCH SEQ`, reads a
   GpuTargetConfigProto from the file `$H100_SPEC`, compiles its step for the devices of
   `jax.experimental.topologies.get_topology_desc` and leaves the compiled step in its global
   `c`, called as c(*state, tokens) -> (*state, loss). Here the topology is this machine's first
   device, so `c` is a program that runs; its inputs are random (floats uniform in [0, 0.02),
   integer arrays in [0, 256), integer scalars 0) and timed with bench.py's loop. Only the
   script's file name and SHA-256 are recorded, never where it lives;
4. `llama_1b`: the 1B preset (configs/llama-1b.yaml), as 1;
5. `command_buffer`: XLA's command buffers (CUDA graphs) on GPT-2 batch 12: the arms in
   COMMAND_BUFFER_ARMS, each a bench child with `--xla-flag` (flags count only before the backend
   starts), beside `gpt2_b12` (the default settings, same child, no flag);
   `scan_layers_scanned`, `scan_layers_unrolled`: the A/B of `model.scan_layers=true|false`
   (SCAN_LAYERS), likewise;
6. `profile`: a `jax.profiler` trace of GPT-2 batch-12 steps, read back from the .xplane.pb jax
   writes (`jax.profiler.ProfileData`) into a per-kernel time table, set beside the ruler's
   estimate (`jaxpar.compiled.ruler`) for the same compiled program, joined by HLO instruction name. XLA
   runs a step op by op while a profiler is active (command buffers are off unless
   --xla_enable_command_buffers_during_profiling), so the table shows every launch.

The JSON (default benchmarks/results/gpu_check-<UTC date and time>-<device>.json) holds each
piece's status (ok, failed, timeout, skipped, or running when the run was cut), its seconds, its
result or its error or skip reason; the device (nvidia-smi's, then the first child's), the
software versions, the XLA flags, the git commit, and `summary`: the ratios the issue's goals are
stated in (GPT-2 tokens/s over nanoGPT's, the 1B's MFU, command-buffer arms over the default).
`--budget` (default 450 s) bounds the whole run: a piece gets at most what is left, and a piece
that cannot start in time is skipped with that reason.

`--dry-run --out PATH` runs the same sequence on CPU with tiny stand-ins (configs/tiny.yaml with
overrides; 1 step; the ruler's side of `profile` compiled for an H100 here, since a CPU program
is not one the ruler costs) so that the code cannot rot; tests/test_gpu_check.py runs it. It
calls the same commands, but in its own process (`launch`) except for those that set XLA flags
(the command-buffer arms) and nanoGPT's, which run as children as on a GPU.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import hashlib
import importlib
import importlib.metadata
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS_DIR = ROOT / "benchmarks" / "results"
BUDGET_S = 450  # of the 8 minutes a GPU check may take, with room for starting and writing
MIN_PIECE_S = 20  # a piece is not started with less time left than this

# The command-buffer A/B: (arm, XLA flag). The flag takes the command types to capture, or
# +TYPE / -TYPE against XLA's default list (its help text in jaxlib says so); issue 41 reads the
# layer scan's while loop as outside the default capture, hence the arm that adds loops.
COMMAND_BUFFER_ARMS = (
    ("off", "--xla_gpu_enable_command_buffer="),
    ("with_loops", "--xla_gpu_enable_command_buffer=+WHILE,+CONDITIONAL"),
)
# The layer loop's A/B (model.scan_layers): (arm, override), each a bench child on GPT-2 batch 12
# as the command-buffer arms are (see `sequence`); both arms are named, whatever the preset's own.
SCAN_LAYERS = (("scanned", "model.scan_layers=true"), ("unrolled", "model.scan_layers=false"))

NANOGPT_PROBE = (
    "import json, torch; print(json.dumps({'torch': torch.__version__, 'cuda': torch.cuda.is_available()}))"
)
# Lines of a profile's planes that jax's profiler derives from other events: not kernels.
DERIVED_LINES = {
    "XLA Ops",
    "XLA Modules",
    "Async XLA Ops",
    "Steps",
    "Framework Ops",
    "Framework Name Scope",
    "Source code",
    "XLA TraceMe",
    "Launch Stats",
}
TABLE_ROWS = 40  # rows kept of the per-instruction table (the slowest)


@dataclass(frozen=True)
class Plan:
    """What each piece runs: configs with overrides, batch sizes, steps."""

    gpt2: tuple[str, ...]
    gpt2_batches: tuple[int, int]
    llama: tuple[str, ...]
    plain_gpt2: tuple[tuple[int, int], ...]  # (batch, seq)
    plain_llama: tuple[tuple[int, int], ...]
    steps: int
    warmup: int
    profile_steps: int
    profile_warmup: int


GPU_PLAN = Plan(
    gpt2=("configs/gpt2-124m.yaml",),
    gpt2_batches=(12, 32),
    llama=("configs/llama-1b.yaml",),
    plain_gpt2=((12, 1024), (32, 1024)),
    plain_llama=((8, 2048),),
    steps=20,
    warmup=3,
    profile_steps=3,
    profile_warmup=2,
)
TINY = (
    "configs/tiny.yaml",
    "model.dtype=bfloat16",
    "runtime.cpu_devices=1",
    "mesh.data=1",
    "mesh.fsdp=1",
    "mesh.tensor=1",
)
DRY_PLAN = Plan(
    gpt2=TINY,
    gpt2_batches=(2, 4),
    llama=(*TINY, "parallel.zero_stage=3", "parallel.remat=dots"),  # the 1B preset's settings
    plain_gpt2=((2, 32),),
    plain_llama=((2, 32),),
    steps=1,
    warmup=0,
    profile_steps=1,
    profile_warmup=1,
)


# --- The record: one JSON, rewritten as each piece starts and ends ---------------------------


class CutShort(Exception):
    """The run was told to stop (SIGTERM)."""


class Skip(Exception):
    """A piece that cannot run here; the message says why."""


class PieceTimeout(Exception):
    pass


class Record:
    def __init__(self, path: Path, header: dict, plan: Plan, budget: float, scrub: list[str]):
        self.path, self.data, self.plan, self.scrub = path, {**header, "pieces": {}}, plan, scrub
        self.budget, self.started = budget, time.monotonic()

    def left(self) -> float:
        return self.budget - (time.monotonic() - self.started)

    def set_piece(self, name: str, fields: dict) -> None:
        self.data["pieces"][name] = fields
        self.write()

    def write(self) -> None:
        self.data["elapsed_seconds"] = round(time.monotonic() - self.started, 1)
        try:
            self.data["summary"] = summary(self.data["pieces"], self.plan)
        except Exception as e:  # noqa: BLE001 - the pieces' record matters more than the ratios
            self.data["summary"] = {"error": f"{type(e).__name__}: {e}"}
        text = json.dumps(self.data, indent=1, default=str) + "\n"
        for path in self.scrub:  # never record where the plain programs or nanoGPT live
            text = text.replace(path, "<dir>")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        partial = self.path.with_name(self.path.name + ".partial")
        partial.write_text(text)
        os.replace(partial, self.path)


def run_piece(record: Record, name: str, work) -> dict | None:
    """Runs `work(seconds left)` as piece `name`; records ok / skipped / timeout / failed. A
    `work` returns the piece's result; raising Skip records the reason."""
    left = record.left()
    if left < MIN_PIECE_S:
        record.set_piece(
            name, {"status": "skipped", "reason": f"the run's budget of {record.budget:.0f} s is spent"}
        )
        return None
    start = time.monotonic()
    record.set_piece(name, {"status": "running"})
    fields: dict
    try:
        fields = {"status": "ok", "result": work(left)}
    except Skip as e:
        fields = {"status": "skipped", "reason": str(e)}
    except PieceTimeout as e:
        fields = {"status": "timeout", "error": str(e)}
    except CutShort:
        record.set_piece(name, {"status": "cut short", "seconds": round(time.monotonic() - start, 1)})
        raise
    except Exception as e:  # noqa: BLE001 - one piece's failure must not lose the others
        fields = {"status": "failed", "error": f"{type(e).__name__}: {e}"[-4000:]}
    record.set_piece(name, {**fields, "seconds": round(time.monotonic() - start, 1)})
    return fields.get("result")


def child(command: list[str], timeout: float, env: dict[str, str], json_path: Path | None) -> dict:
    """Runs `command` in its own process group; returns the JSON it wrote to `json_path` (or
    printed last, when None). The group is killed at `timeout` or when this run is cut short."""
    proc = subprocess.Popen(
        command,
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise PieceTimeout(f"killed after {timeout:.0f} s; stderr ends:\n{err[-2000:]}") from None
    finally:
        if proc.poll() is None:  # cut short: our child and its own children go with us
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    if proc.returncode != 0:
        raise RuntimeError(f"exit code {proc.returncode}; stderr ends:\n{err[-3000:]}")
    if json_path is None:
        return json.loads(out.strip().splitlines()[-1])
    return json.loads(json_path.read_text())


def in_this_process(command: list[str], json_path: Path) -> dict:
    """Runs `python -m MODULE ARGS` (`command`) as `MODULE.main(ARGS)` in this process, its
    stdout sent to stderr; returns the JSON it wrote to `json_path`."""
    module = importlib.import_module(command[2])
    try:
        with contextlib.redirect_stdout(sys.stderr):
            code = module.main(command[3:])
    except SystemExit as e:  # argparse's errors
        code = e.code
    if code != 0:
        raise RuntimeError(f"{' '.join(command[1:3])} in this process: exit code {code}")
    return json.loads(json_path.read_text())


# --- The pieces ------------------------------------------------------------------------------


@dataclass
class Context:
    args: argparse.Namespace
    plan: Plan
    env: dict[str, str]
    work_dir: Path
    # A dry run calls the pieces' `python -m` commands in its own process (`launch`), but for
    # those whose flags need a fresh backend, which run as children as on a GPU: each child
    # would cost its own start (Python, jax, jaxpar: ~4 s of CPU) and compile the programs
    # another piece compiled. The commands and their JSON are the same either way.
    in_process: bool = False


def launch(ctx: Context, command: list[str], timeout: float, json_path: Path) -> dict:
    """A piece's command, `[python, -m, MODULE, ...]`: a child (`child`), or in a dry run for
    a command setting no XLA flag (XLA reads its flags once, when the backend starts), in this
    process."""
    if ctx.in_process and command[1] == "-m" and not any(a.startswith("--xla-flag") for a in command):
        return in_this_process(command, json_path)
    return child(command, timeout, ctx.env, json_path)


def bench_piece(ctx: Context, words: tuple[str, ...], tag: str, flags: tuple[str, ...] = ()):
    """One `python -m benchmarks.bench` child; its JSON is the piece's result."""

    def work(left: float) -> dict:
        out = ctx.work_dir / f"bench-{tag}.json"
        command = [sys.executable, "-m", "benchmarks.bench", *words, "--tag", tag, "--json", str(out)]
        command += ["--steps", str(ctx.plan.steps), "--warmup", str(ctx.plan.warmup)]
        command += [f"--xla-flag={flag}" for flag in flags]
        return launch(ctx, command, min(left, ctx.args.piece_timeout), out)

    return work


def nanogpt_piece(ctx: Context, batch: int):
    def work(left: float) -> dict:
        python = ctx.args.torch_python
        try:
            found = child([python, "-c", NANOGPT_PROBE], min(left, 120), ctx.env, None)
        except (RuntimeError, PieceTimeout) as e:
            raise Skip(f"{python} cannot import PyTorch: {str(e).strip().splitlines()[-1]}") from None
        if not found["cuda"]:
            raise Skip(f"PyTorch {found['torch']} ({python}) sees no CUDA device")
        checkout = ctx.args.nanogpt
        if not checkout or not (Path(checkout) / "model.py").is_file():
            raise Skip(
                "no nanoGPT checkout: pass --nanogpt DIR, DIR holding model.py of github.com/karpathy/nanoGPT"
                + (" (the DIR given has none)" if checkout else "")
            )
        out = ctx.work_dir / f"nanogpt-{batch}.json"
        command = [python, "benchmarks/nanogpt_step.py", "--nanogpt", checkout, "--batch", str(batch)]
        command += ["--steps", str(ctx.plan.steps), "--warmup", str(ctx.plan.warmup), "--json", str(out)]
        return launch(ctx, command, min(left, ctx.args.piece_timeout), out)

    return work


def plain_piece(ctx: Context, script: str | None, option: str, batch: int, seq: int):
    def work(left: float) -> dict:
        if not script:
            raise Skip(f"no {option} PATH given (a plain-JAX reference program; see the module docstring)")
        if not Path(script).is_file():
            raise Skip(f"{option}: no such file")
        out = ctx.work_dir / f"plain-{Path(script).stem}-{batch}.json"
        command = [sys.executable, "-m", "benchmarks.gpu_check", "--worker", "plain", "--json", str(out)]
        command += [
            "--steps",
            str(ctx.plan.steps),
            "--warmup",
            str(ctx.plan.warmup),
            script,
            str(batch),
            str(seq),
        ]
        return launch(ctx, command, min(left, ctx.args.piece_timeout), out)

    return work


def profile_piece(ctx: Context, words: tuple[str, ...]):
    def work(left: float) -> dict:
        out = ctx.work_dir / "profile.json"
        trace_dir = Path(ctx.args.trace_dir) if ctx.args.trace_dir else ctx.work_dir / "trace"
        command = [sys.executable, "-m", "benchmarks.gpu_check", "--worker", "profile", "--json", str(out)]
        command += ["--steps", str(ctx.plan.profile_steps), "--warmup", str(ctx.plan.profile_warmup)]
        command += ["--trace-dir", str(trace_dir), *words]
        return launch(ctx, command, min(left, ctx.args.piece_timeout), out)

    return work


def sequence(ctx: Context) -> list[tuple[str, object]]:
    """(piece name, work) in the order they run; a str instead of work: skipped, for that reason."""
    plan, args = ctx.plan, ctx.args
    b12, b32 = plan.gpt2_batches
    gpt2 = {b: (*plan.gpt2, f"train.batch_size={b}") for b in (b12, b32)}
    pieces: list[tuple[str, object]] = [
        (f"gpt2_b{b}", bench_piece(ctx, gpt2[b], f"gpt2-b{b}")) for b in (b12, b32)
    ]
    pieces += [(f"nanogpt_b{b}", nanogpt_piece(ctx, b)) for b in (b12, b32)]
    pieces += [
        (f"plain_gpt2_b{b}", plain_piece(ctx, args.plain_gpt2, "--plain-gpt2", b, t))
        for b, t in plan.plain_gpt2
    ]
    pieces += [
        (f"plain_llama_b{b}", plain_piece(ctx, args.plain_llama, "--plain-llama", b, t))
        for b, t in plan.plain_llama
    ]
    pieces.append(("llama_1b", bench_piece(ctx, plan.llama, "llama-1b")))
    for arm, flag in COMMAND_BUFFER_ARMS:
        pieces.append(
            (f"command_buffer_{arm}", bench_piece(ctx, gpt2[b12], f"gpt2-b{b12}-cb-{arm}", (flag,)))
        )
    for arm, override in SCAN_LAYERS:
        pieces.append((f"scan_layers_{arm}", bench_piece(ctx, (*gpt2[b12], override), f"gpt2-b{b12}-{arm}")))
    pieces.append(("profile", profile_piece(ctx, gpt2[b12])))
    return pieces


# --- The summary: the goals in ratios ------------------------------------------------


def _bench_numbers(piece: dict | None) -> dict | None:
    if not piece or piece.get("status") != "ok":
        return None
    r = piece["result"]
    if "step_time_s" in r:  # a bench.py result
        return {
            "step_ms": 1e3 * r["step_time_s"]["median"],
            "tokens_per_sec": r["tokens_per_sec"],
            "mfu": r["mfu"],
        }
    if "step_ms" in r:  # nanogpt_step.py's and the plain programs'
        return {"step_ms": r["step_ms"]["median"], "tokens_per_sec": r["tokens_per_sec"], "mfu": r.get("mfu")}
    return None  # the profile


def summary(pieces: dict, plan: Plan) -> dict:
    """Medians of what ran, and the ratios the goals are stated in (null where a side is missing)."""
    n = {name: _bench_numbers(piece) for name, piece in pieces.items()}
    n = {name: v for name, v in n.items() if v}

    def ratio(a: str, b: str) -> float | None:
        return round(n[a]["tokens_per_sec"] / n[b]["tokens_per_sec"], 3) if a in n and b in n else None

    b12, b32 = plan.gpt2_batches
    llama_plain = f"plain_llama_b{plan.plain_llama[0][0]}"
    return {
        "median_step_ms": {name: round(v["step_ms"], 2) for name, v in n.items()},
        "gpt2_over_nanogpt_tokens_per_sec": {
            f"b{b}": ratio(f"gpt2_b{b}", f"nanogpt_b{b}") for b in (b12, b32)
        },
        "gpt2_over_plain_tokens_per_sec": {
            f"b{b}": ratio(f"gpt2_b{b}", f"plain_gpt2_b{b}") for b in (b12, b32)
        },
        "llama_1b_over_plain_tokens_per_sec": ratio("llama_1b", llama_plain),
        "llama_1b_mfu": n["llama_1b"]["mfu"] if "llama_1b" in n else None,
        "command_buffer_over_default_tokens_per_sec": {
            arm: ratio(f"command_buffer_{arm}", f"gpt2_b{b12}") for arm, _ in COMMAND_BUFFER_ARMS
        },
        "unrolled_over_scanned_tokens_per_sec": ratio("scan_layers_unrolled", "scan_layers_scanned"),
        "goals": "issue 41: GPT-2 >= 1.15x nanoGPT's tokens/s on the same GPU; the 1B >= 55% MFU",
    }


# --- The header: device, versions, commit ----------------------------------------------------


def _run_text(command: list[str]) -> str | None:
    try:
        done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def git_commit(given: str | None) -> dict:
    """The checkout's commit and whether tracked files differ from it, or `given` (--commit)
    where this copy of the tree has no git repository."""
    commit = _run_text(["git", "rev-parse", "HEAD"])
    if commit is None:
        return {"commit": given, "source": "--commit" if given else "no git repository here; pass --commit"}
    dirty = subprocess.run(["git", "diff", "--quiet", "HEAD", "--"], cwd=ROOT, capture_output=True).returncode
    return {"commit": commit, "tracked_files_modified": dirty != 0, "source": "git"}


def versions() -> dict:
    from benchmarks.bench import software_versions  # imports jax; starts no backend

    out = software_versions()
    for name in ("jax-cuda12-plugin", "jax-cuda13-plugin", "torch"):
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    return out


def nvidia_smi() -> dict | None:
    text = _run_text(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"])
    if not text:
        return None
    names = [line.split(",")[0].strip() for line in text.splitlines()]
    return {"kind": names[0], "count": len(names), "nvidia_smi": text.splitlines()}


def default_out(device: dict | None, now: datetime.datetime) -> Path:
    from benchmarks.bench import _slug

    kind = device["kind"] if device else "no-gpu-seen"
    return RESULTS_DIR / f"gpu_check-{now:%Y-%m-%dT%H%M}-{_slug(kind)}.json"


def header(args: argparse.Namespace, device: dict | None, now: datetime.datetime) -> dict:
    return {
        "what": "benchmarks/gpu_check.py (issue 41, item 6)",
        "dry_run": args.dry_run,
        "started": now.isoformat(timespec="seconds"),
        "finished": None,
        "device": device,
        "host": {"cpus": os.cpu_count(), "machine": platform.machine()},
        "software": versions(),
        "git": git_commit(args.commit),
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "budget_seconds": args.budget,
        "plan": DRY_PLAN.__dict__ if args.dry_run else GPU_PLAN.__dict__,
        "command_buffer_arms": dict(COMMAND_BUFFER_ARMS),
    }


# --- Worker: a plain-JAX reference program, run and timed ------------------------------------


def _filled(key, info, sharding):
    """A random array of `info`'s shape and dtype on `sharding` (see the module docstring)."""
    import jax
    import jax.numpy as jnp

    shape, dtype = tuple(info.shape), info.dtype
    if jnp.issubdtype(dtype, jnp.floating):
        fill = lambda k: jax.random.uniform(k, shape, jnp.float32, 0.0, 0.02).astype(dtype)
    elif not shape:
        fill = lambda k: jnp.zeros(shape, dtype)
    else:
        fill = lambda k: jax.random.randint(k, shape, 0, 256, dtype)
    return jax.jit(fill, out_shardings=sharding)(key)


def compile_plain(script: str, batch: int, seq: int):
    """Runs the reference script for (batch, seq) with its topology replaced by this machine's
    first device; returns its compiled step `c` and the seconds the script took."""
    import types

    import jax
    from jax.experimental import topologies

    devices = jax.local_devices()[:1]  # the backend starts here, before the script sets JAX_PLATFORMS
    saved_env, saved_argv, saved_topology = dict(os.environ), sys.argv, topologies.get_topology_desc
    topologies.get_topology_desc = lambda *a, **k: types.SimpleNamespace(devices=devices)
    with tempfile.NamedTemporaryFile("w", suffix=".txtpb") as spec:
        spec.write("# unused: the program is compiled for this machine's device\n")
        spec.flush()
        os.environ["H100_SPEC"] = spec.name
        sys.argv = [script, str(batch), str(seq)]
        scope = {"__name__": "__main__", "__file__": script}
        start = time.perf_counter()
        try:
            exec(compile(Path(script).read_text(), Path(script).name, "exec"), scope)
        finally:
            os.environ.clear()
            os.environ.update(saved_env)
            sys.argv, topologies.get_topology_desc = saved_argv, saved_topology
    return scope["c"], time.perf_counter() - start


def run_plain(script: str, batch: int, seq: int, steps: int, warmup: int) -> dict:
    import jax

    from benchmarks.bench import step_statistics, timed_steps

    compiled, compile_s = compile_plain(script, batch, seq)
    (args, _), (shardings, _) = compiled.args_info, compiled.input_shardings
    key = jax.random.key(0)
    infos, tree = jax.tree.flatten(args[:-1])  # the state: every argument before the tokens
    filled = [
        _filled(jax.random.fold_in(key, n), i, s)
        for n, (i, s) in enumerate(zip(infos, jax.tree.leaves(shardings[:-1])))
    ]
    state = jax.tree.unflatten(tree, filled)
    batches = [
        _filled(jax.random.fold_in(key, 1000 + i), args[-1], shardings[-1]) for i in range(warmup + steps)
    ]

    def step(state, tokens):
        *new_state, loss = compiled(*state, tokens)
        return new_state, {"loss": loss}

    times, _, first, last = timed_steps(
        step, jax.block_until_ready(state), jax.block_until_ready(batches), warmup, steps
    )
    stats = step_statistics(times)
    device = jax.local_devices()[0]
    return {
        "script": Path(script).name,
        "script_sha256": hashlib.sha256(Path(script).read_bytes()).hexdigest(),
        "batch": batch,
        "seq_len": seq,
        "steps": steps,
        "warmup": warmup,
        "compile_seconds": compile_s,
        "step_ms": {k: 1e3 * stats[k] for k in ("median", "mean", "min", "max")},
        "tokens_per_sec": batch * seq / stats["median"],
        "loss": {"first": first, "last": last},
        "device": {"platform": device.platform, "kind": device.device_kind},
    }


# --- The profile: trace events into a per-kernel table ----------------------------------------


def trace_events(xplane: Path) -> tuple[list[dict], str]:
    """The kernel events of a jax profile (.xplane.pb) as dicts (op: the HLO instruction or None,
    kernel: the event's name, module, ns), and where they came from: "device" (GPU stream lines,
    the derived lines left out) or, where no device plane has any (a CPU run), "host" (the
    events of XLA's CPU runtime that name an HLO instruction). An event that encloses the next
    one on its line (a CPU while loop around its body's thunks) is left out: its time is theirs."""
    from jax.profiler import ProfileData

    device, host = [], []
    for plane in ProfileData.from_file(str(xplane)).planes:
        on_device = plane.name.startswith("/device:") and "CUSTOM" not in plane.name
        lines = [line for line in plane.lines if line.name not in DERIVED_LINES]
        streams = [line for line in lines if line.name.startswith("Stream")]
        for line in streams or lines if on_device else lines:
            found = []
            for event in line.events:
                stats = dict(event.stats)
                if on_device or "hlo_op" in stats:  # on the host: not Python's or the profiler's
                    start, ns = float(event.start_ns), float(event.duration_ns)
                    row = {
                        "op": stats.get("hlo_op"),
                        "kernel": event.name,
                        "module": stats.get("hlo_module"),
                        "ns": ns,
                    }
                    found.append((start, start + ns, row))
            found.sort(key=lambda f: f[0])
            leaves = [
                r for i, (_, end, r) in enumerate(found) if i + 1 == len(found) or found[i + 1][0] >= end
            ]
            (device if on_device else host).extend(leaves)
    return (device, "device") if device else (host, "host")


def kernel_table(events: list[dict], module: str, steps: int) -> dict:
    """Per-instruction time and launches per step of the step's module (`module`, else the module
    holding most of the time), slowest first."""
    by_module = defaultdict(float)
    for e in events:
        by_module[e["module"]] += e["ns"]
    chosen = module if module in by_module else max(by_module, key=by_module.get, default=None)
    rows: dict[str, dict] = {}
    for e in events:
        if e["module"] != chosen:
            continue
        key = e["op"] or f"kernel:{e['kernel']}"
        row = rows.setdefault(key, {"op": key, "launches": 0, "ns": 0.0, "kernels": []})
        row["launches"] += 1
        row["ns"] += e["ns"]
        if e["kernel"] not in row["kernels"] and len(row["kernels"]) < 2:
            row["kernels"].append(e["kernel"])
    table = [
        {
            "op": r["op"],
            "launches_per_step": r["launches"] / steps,
            "ms_per_step": r["ns"] / steps / 1e6,
            "kernels": r["kernels"],
        }
        for r in sorted(rows.values(), key=lambda r: -r["ns"])
    ]
    return {
        "module": chosen,
        "modules_ms": {str(m): ns / 1e6 for m, ns in by_module.items()},
        "kernel_ms_per_step": sum(r["ms_per_step"] for r in table),
        "launches_per_step": sum(r["launches_per_step"] for r in table),
        "ops": table,
    }


def ruler_rates(kind: str):
    """(rates key, Rates, note) for a device kind: the ruler's own where it has them, else the H100's."""
    from jaxpar.compiled import ruler
    from jaxpar.compiled.targets import GPUS

    for key, rates in ruler.RATES.items():
        if GPUS[key].description == kind:
            return key, rates, None
    return "h100", ruler.RATES["h100"], f"the ruler has no rates for {kind!r}: the H100's are used"


def ruler_side(text: str, kind: str, model_flops: float, devices: int) -> tuple[dict, dict]:
    """The ruler's estimate of compiled GPU HLO `text` (`ruler.summary`, its table cut to the
    slowest rows) and {instruction name: (kind, source)} of its launches, for the join."""
    from jaxpar.compiled import ruler

    key, rates, note = ruler_rates(kind)
    costs = ruler.summary(text, rates, model_flops, devices)
    names = {k.name: (k.kind, k.source) for k in ruler.kernels(text)}
    costs = {**costs, "rates": key, "rates_note": note, "kernels": costs["kernels"][:TABLE_ROWS]}
    return costs, names


def beside(measured: dict, estimate: dict, names: dict) -> dict:
    """The ruler's rows (kind, source) with the measured time of their instructions beside them,
    and how much measured time no ruler launch accounts for."""
    by_row = defaultdict(lambda: [0.0, 0.0])
    unmatched = 0.0
    for row in measured["ops"]:
        found = names.get(row["op"])
        if found is None:
            unmatched += row["ms_per_step"]
            continue
        by_row[found][0] += row["ms_per_step"]
        by_row[found][1] += row["launches_per_step"]
    rows = [
        {
            "kind": r["kind"],
            "source": r["source"],
            "estimated_ms": 1e3 * r["seconds"],
            "estimated_launches": r["count"],
            "measured_ms": by_row[(r["kind"], r["source"])][0],
            "measured_launches": by_row[(r["kind"], r["source"])][1],
        }
        for r in estimate["kernels"]
    ]
    return {
        "estimated_step_ms": 1e3 * estimate["step_seconds"],
        "measured_kernel_ms": measured["kernel_ms_per_step"],
        "estimated_launches": estimate["launches"],
        "measured_launches": measured["launches_per_step"],
        "measured_ms_no_ruler_launch_matches": unmatched,
        "rows": rows,
    }


def _step_and_trace(trainer, compiled, steps: int, warmup: int, trace_dir: Path) -> tuple[list[float], Path]:
    """`warmup` steps, then `steps` traced ones (bench.py's loop); the step times (with the
    profiler running) and the .xplane.pb written."""
    import jax

    from benchmarks.bench import device_batches, timed_steps

    batches = device_batches(trainer, warmup + steps, trainer.cfg.train.seed)
    state = jax.block_until_ready(trainer.init())
    _, state, _, _ = timed_steps(compiled, state, batches[:warmup], 0, warmup)
    shutil.rmtree(trace_dir, ignore_errors=True)
    with jax.profiler.trace(str(trace_dir)):
        times, state, _, _ = timed_steps(compiled, state, batches[warmup:], 0, steps)
    del state
    return times, max(trace_dir.rglob("*.xplane.pb"), key=lambda p: p.stat().st_mtime)


def _ruler_program(words: list[str], compiled, platform_name: str) -> tuple[str, str]:
    """(compiled GPU HLO for the ruler, what it is): the program that ran, on a GPU; else (a dry
    run) the same config compiled here for one H100, which needs the gpu-compile extra."""
    if platform_name in ("gpu", "cuda"):
        return compiled.as_text(), "the program that ran"
    from jaxpar.compiled import targets as targets_lib
    from jaxpar.run.startup import load_and_validate
    from jaxpar.training.trainer import build_trainer, compile_step

    target = targets_lib.resolve("h100")
    cfg, sizes = load_and_validate(words, num_devices=target.count)
    trainer = build_trainer(cfg, sizes, devices=targets_lib.devices(target))
    text = compile_step(trainer).as_text()
    return text, f"the same config compiled here for one {target.description}: not the program that ran"


def run_profile(words: list[str], steps: int, warmup: int, trace_dir: Path) -> dict:
    from jaxpar.inspect import report
    from jaxpar.run.startup import load_and_validate
    from jaxpar.training.trainer import build_trainer, compile_step

    cfg, sizes = load_and_validate(words)
    trainer = build_trainer(cfg, sizes)
    compiled = compile_step(trainer)
    inspected = report(trainer, compiled)
    times, xplane = _step_and_trace(trainer, compiled, steps, warmup, trace_dir)
    events, where = trace_events(xplane)
    module = compiled.as_text().split(",", 1)[0].removeprefix("HloModule ").strip()
    measured = kernel_table(events, module, steps)
    device = trainer.mesh.devices.flat[0]
    out = {
        "config": words,
        "steps_traced": steps,
        "warmup": warmup,
        "step_ms_traced": [1e3 * t for t in times],
        "device": {"platform": device.platform, "kind": device.device_kind},
        "trace": {"file": xplane.name, "events_from": where, "events": len(events)},
        "measured": {**measured, "ops": measured["ops"][:TABLE_ROWS], "ops_total": len(measured["ops"])},
    }
    try:
        text, what = _ruler_program(words, compiled, device.platform)
    except Exception as e:  # noqa: BLE001 - e.g. no gpu-compile extra in a dry run: the trace stands
        out["ruler"] = {"skipped": f"{type(e).__name__}: {e}"}
        return out
    kind = device.device_kind if what == "the program that ran" else "NVIDIA H100 80GB HBM3"
    estimate, names = ruler_side(text, kind, inspected["model_flops_per_step"], trainer.mesh.devices.size)
    out["ruler"] = {"program": what, **estimate}
    if what == "the program that ran":  # instruction names are the same program's: join them
        out["beside"] = beside(measured, estimate, names)
    return out


# --- Command line ----------------------------------------------------------------------------


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.gpu_check", description=__doc__.splitlines()[0])
    p.add_argument(
        "--nanogpt", default=os.environ.get("NANOGPT_DIR"), help="a nanoGPT checkout (its model.py)"
    )
    p.add_argument("--torch-python", default=sys.executable, help="the Python whose torch runs nanoGPT")
    p.add_argument("--plain-gpt2", metavar="PATH", help="the plain-JAX GPT-2 reference program")
    p.add_argument("--plain-llama", metavar="PATH", help="the plain-JAX Llama 1B reference program")
    p.add_argument("--out", metavar="JSON", help="where to write (default benchmarks/results/gpu_check-...)")
    p.add_argument("--budget", type=float, default=BUDGET_S, help=f"seconds for the whole run ({BUDGET_S})")
    p.add_argument("--piece-timeout", type=float, default=240, help="seconds for one piece at most (240)")
    p.add_argument("--trace-dir", help="keep the profile's trace here (default: a temporary folder)")
    p.add_argument("--commit", help="the commit to record where the tree has no git repository")
    p.add_argument("--dry-run", action="store_true", help="on CPU, tiny stand-ins; needs --out")
    # Internal: the child processes this script starts for the plain programs and the profile.
    p.add_argument("--worker", choices=("plain", "profile"), help=argparse.SUPPRESS)
    p.add_argument("--json", help=argparse.SUPPRESS)
    p.add_argument("--steps", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--warmup", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("words", nargs="*", help=argparse.SUPPRESS)
    args = p.parse_intermixed_args(argv)
    if args.dry_run and not args.out:
        p.error("--dry-run writes to --out PATH only (never into benchmarks/results)")
    return args


def worker(args: argparse.Namespace) -> int:
    """A child's work: its result as JSON in --json."""
    if args.worker == "plain":
        script, batch, seq = args.words
        result = run_plain(script, int(batch), int(seq), args.steps, args.warmup)
    else:
        result = run_profile(args.words, args.steps, args.warmup, Path(args.trace_dir))
    Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    return 0


def check(args: argparse.Namespace) -> int:
    """The run: every piece in turn, the JSON rewritten after each."""
    now = datetime.datetime.now(datetime.UTC)
    device = nvidia_smi() if not args.dry_run else None
    out = Path(args.out) if args.out else default_out(device, now)
    plan = DRY_PLAN if args.dry_run else GPU_PLAN
    given = [Path(p).parent for p in (args.plain_gpt2, args.plain_llama) if p]
    given += [Path(args.nanogpt)] if args.nanogpt else []
    scrub = [str(p) for p in given if str(p) != "."] + [str(p.resolve()) for p in given]
    record = Record(
        out, header(args, device, now), plan, args.budget, sorted(set(scrub), key=len, reverse=True)
    )
    if args.dry_run:  # CPUs only, whatever this machine has, here and in the children
        os.environ.update(JAX_PLATFORMS="cpu", CUDA_VISIBLE_DEVICES="")
    env = dict(os.environ)
    signal.signal(signal.SIGTERM, _cut_short)
    with tempfile.TemporaryDirectory(prefix="gpu_check-") as work_dir:
        ctx = Context(args, plan, env, Path(work_dir), in_process=args.dry_run)
        try:
            for name, work in sequence(ctx):
                if isinstance(work, str):
                    record.set_piece(name, {"status": "skipped", "reason": work})
                    continue
                result = run_piece(record, name, work)
                if record.data["device"] is None and result and "device" in result:
                    record.data["device"] = result["device"]
        except CutShort:
            record.data["cut_short"] = "SIGTERM"
        record.data["finished"] = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
        record.write()
    print(json.dumps(record.data["summary"], indent=1))
    print(f"wrote {out}")
    return 0


def _cut_short(signum, frame):
    raise CutShort()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    return worker(args) if args.worker else check(args)


if __name__ == "__main__":
    sys.exit(main())
