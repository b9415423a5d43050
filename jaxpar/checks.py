"""A config checked against itself and the device count, before anything compiles.

`validate` re-checks the types (loading checks them, `jaxpar.config`; this is for configs built
or changed in Python), the mesh, the divisibility of every split dimension, MoE routing, LoRA,
ring attention's sequence cut and the loss chunks, that the data and tokenizer files exist, and
the pipeline, whose schedule rules live with the schedules in
`jaxpar.parallel.schedule.validate_pipeline` and are called from here, as are the model's own
settings' (shape, latent attention, multi-token prediction, MoE: `jaxpar.model_checks`); every failure is a
`jaxpar.config.ConfigError` that names the setting. `validate_runtime` checks the runtime
settings alone, before the backend starts, and `check_writable_dir` a directory a command will
write.

Some checks cannot be made here and raise the same `ConfigError` later: the distributed keys
when the processes start (`jaxpar.mesh.start_distributed`), what only the data shows (the
tokenizer's vocabulary against model.vocab_size, a corpus shorter than one sequence, malformed
JSONL, documents per packed row for cuDNN attention, prepared shards that differ from their
manifest) when the trainer reads it, a resume step whose checkpoint is unusable or whose data
differs from the run's record when the run directory is opened (`jaxpar.run.rundir`),
`train.init_from`'s model directory when it is read (`jaxpar.convert`), and `model.fp8` against
the devices' compute capability when the trainer is built (`jaxpar.training.trainer`). A CPU run
that will not fit in the host's memory is refused before compiling too, but as its own error
(exit code 3, `jaxpar.planning.host`), not a ConfigError.
"""

from __future__ import annotations

import dataclasses
import math
import os
import tempfile
import typing

from jaxpar import model_checks
from jaxpar.config import (
    CHAT_TEMPLATES,
    MESH_AXES,
    Config,
    ConfigError,
    LoRAConfig,
    LoRATarget,
    MeshConfig,
    OptimizerConfig,
    WandbConfig,
    check_types,
)
from jaxpar.corpus.sources import data_files, source_names
from jaxpar.mesh import compile_cache
from jaxpar.model_checks import divisors, require_divides
from jaxpar.parallel.schedule import validate_pipeline

INT32_MAX = 2**31 - 1  # the train state's step counters are int32
WANDB_FORBIDDEN = "/\\#?%:"  # characters W&B refuses in a project name


def validate(cfg: Config, num_devices: int) -> dict[str, int]:
    """Checks the whole config against itself and the device count; returns the mesh sizes.
    The checks run in a fixed order (the first failure is the one reported): types, the mesh,
    the run's own settings, the optimizer, counts, the model's shape, how the layout splits it,
    MoE routing, the pipeline, ring attention and the loss chunks, then the data."""
    check_types(cfg)  # the Literal choices included: the annotations are their only list
    validate_runtime(cfg)
    sizes = resolve_mesh(cfg.mesh, num_devices)
    _validate_run(cfg)
    _validate_wandb(cfg.train.wandb)
    _validate_optimizer(cfg.optimizer)
    _validate_counts(cfg)
    model_checks.validate_model(cfg)
    model_checks.validate_latent(cfg)
    model_checks.validate_mtp(cfg)
    _validate_window(cfg, sizes)
    _validate_splits(cfg, sizes)
    model_checks.validate_moe(cfg, sizes)
    _validate_lora(cfg, sizes)
    _validate_pipeline(cfg, sizes)
    _validate_sequence_splits(cfg, sizes)
    _validate_data(cfg)
    if cfg.data.tokenizer != "byte" and not os.path.isfile(cfg.data.tokenizer):
        raise ConfigError(
            f"data.tokenizer='{cfg.data.tokenizer}' does not exist; use 'byte' or the path of a "
            "tokenizer.json (python -m jaxpar.data train-tokenizer makes one)"
        )
    template = cfg.data.chat_template
    if template is not None and template not in CHAT_TEMPLATES and not os.path.isfile(template):
        raise ConfigError(
            f"data.chat_template='{template}' does not exist; use null (the tokenizer's own), the "
            f"path of a .jinja chat template, or one of jaxpar's: {', '.join(CHAT_TEMPLATES)}"
        )
    return sizes


def validate_runtime(cfg: Config) -> None:
    """What must hold before the backend starts (`jaxpar.mesh.emulate_cpu_devices` uses it) and
    before anything compiles: the compilation cache's size, and that a directory the settings or
    JAX_COMPILATION_CACHE_DIR name for it can be written (`jaxpar.mesh.compile_cache`)."""
    check_types(cfg.runtime, "runtime.")
    if cfg.runtime.cpu_devices < 1:
        raise ConfigError(
            f"runtime.cpu_devices={cfg.runtime.cpu_devices}: must be at least 1 "
            "(1 = a plain single-device run; 8 emulates the default mesh)"
        )
    memory = cfg.runtime.host_memory_gib
    if memory is not None and not (math.isfinite(memory) and memory > 0):
        raise ConfigError(
            f"runtime.host_memory_gib={memory}: give the GiB of RAM the run may take "
            "(a positive number, e.g. 16), or null for what the machine has available"
        )
    size = cfg.runtime.compile_cache_gib
    if not (math.isfinite(size) and size > 0):
        raise ConfigError(
            f"runtime.compile_cache_gib={size:g}: give the GiB the compilation cache may hold "
            "(a positive number, e.g. 4); runtime.compile_cache=off turns the cache off"
        )
    cache = compile_cache(cfg.runtime)
    if cache.directory is not None and not cache.default:  # the default: use_compile_cache
        check_writable_dir(cache.directory, cache.key)


def resolve_mesh(mesh: MeshConfig, num_devices: int) -> dict[str, int]:
    """Mesh axis sizes with the one -1 filled in; the product must equal the device count."""
    sizes = {axis: getattr(mesh, axis) for axis in MESH_AXES}
    shown = " ".join(f"{a}={s}" for a, s in sizes.items())
    for axis, size in sizes.items():
        if size == 0 or size < -1:
            raise ConfigError(f"mesh.{axis}={size}: axis sizes are positive, or -1 for 'the rest'")
    fill = [a for a, s in sizes.items() if s == -1]
    if len(fill) > 1:
        raise ConfigError(f"mesh: only one axis may be -1, got {', '.join(fill)} ({shown})")
    known = math.prod(s for s in sizes.values() if s != -1)
    if fill:
        if num_devices % known:
            raise ConfigError(
                f"mesh: {shown} cannot fill {num_devices} devices: the other axes multiply to "
                f"{known}, which does not divide {num_devices}"
            )
        sizes[fill[0]] = num_devices // known
    elif known != num_devices:
        raise ConfigError(
            f"mesh: {shown} multiplies to {known} but there are {num_devices} devices; "
            "make the product equal the device count or set one axis to -1"
        )
    return sizes


def check_writable_dir(path: str, key: str) -> None:
    """`path` (the setting `key`) is a directory this process can write, or can be created:
    checked by writing (and removing) a probe file, since permission bits do not show read-only
    mounts (nor what root may do)."""
    path_abs = os.path.abspath(os.path.expanduser(path))
    existing = path_abs
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        what = "is a file" if existing == path_abs else f"is under '{existing}', which is a file"
        raise ConfigError(f"{key}='{path}' {what}; give a directory")
    try:
        fd, probe = tempfile.mkstemp(prefix=".jaxpar-write-probe-", dir=existing)
        os.close(fd)
        os.remove(probe)
    except OSError as e:
        where = "" if existing == path_abs else f" (it would be created in '{existing}')"
        raise ConfigError(
            f"{key}='{path}' is not writable{where}: {e.strerror}; choose a directory you can write"
        ) from None


def check_run_dir(run_dir: str) -> None:
    """train.run_dir is a directory this process can write, or can be created."""
    check_writable_dir(run_dir, "train.run_dir")


def _validate_run(cfg: Config) -> None:
    """Settings of the run that stand alone: kernel and dtype, fp8's master weights, resume,
    step counter, seed, checkpoint interval, the profiler's window."""
    m, t = cfg.model, cfg.train
    if m.attention == "cudnn" and m.dtype == "float32":
        raise ConfigError(
            "model.attention=cudnn takes bfloat16 or float16 activations, but "
            "model.dtype=float32; use model.dtype=bfloat16, or attention auto or xla"
        )
    if m.fp8 and m.param_dtype != "float32":
        raise ConfigError(
            f"model.fp8 quantizes each step from float32 master weights, but "
            f"model.param_dtype={m.param_dtype}; use model.param_dtype=float32"
        )
    if t.resume not in ("auto", "never") and not t.resume.isdigit():
        raise ConfigError(f"train.resume={t.resume!r}: use auto, never, or a checkpoint step number")
    if t.steps > INT32_MAX:
        raise ConfigError(f"train.steps={t.steps} is beyond the int32 step counter; use at most {INT32_MAX}")
    if not 0 <= t.seed < 2**32:
        raise ConfigError(f"train.seed={t.seed}: use a seed in [0, 2**32) = [0, {2**32 - 1}]")
    if cfg.checkpoint.every < 0:
        raise ConfigError(f"checkpoint.every={cfg.checkpoint.every}: use 0 (never) or a step count")
    window = t.profile_steps
    if window is not None and not (len(window) == 2 and 1 <= window[0] <= window[1] <= t.steps):
        raise ConfigError(
            f"train.profile_steps={window}: give [first, last] with "
            f"1 <= first <= last <= train.steps={t.steps}, e.g. [5, 7]"
        )


def _validate_wandb(w: WandbConfig) -> None:
    """train.wandb.*: a project name W&B accepts (at most 128 characters, none of
    WANDB_FORBIDDEN), tags of 1 to 64 characters, and no W&B setting without a project (which
    would log nothing) unless the mode is disabled. (The mode is a Literal: loading and
    `check_types` check it.)"""
    bad = sorted(set(w.project) & set(WANDB_FORBIDDEN))
    if bad or len(w.project) > 128:
        why = f"it holds {' '.join(bad)}" if bad else f"{len(w.project)} characters, more than 128"
        raise ConfigError(
            f"train.wandb.project={w.project!r}: {why}; W&B takes a name of at most 128 characters, "
            f"none of {' '.join(WANDB_FORBIDDEN)}"
        )
    for tag in w.tags:
        if not 1 <= len(tag) <= 64:
            raise ConfigError(f"train.wandb.tags: {tag!r} has {len(tag)} characters; W&B takes 1 to 64")
    unused = [k for k in ("entity", "name", "tags") if getattr(w, k)] + (
        ["mode"] if w.mode == "offline" else []
    )
    if unused and not w.project and w.mode != "disabled":
        raise ConfigError(
            f"train.wandb.{unused[0]} is set but train.wandb.project is empty, so nothing goes to "
            "W&B; set train.wandb.project=NAME, or train.wandb.mode=disabled to keep W&B off"
        )


def _validate_optimizer(o: OptimizerConfig) -> None:
    for key, value, ok, want in [
        ("optimizer.lr", o.lr, o.lr > 0 and math.isfinite(o.lr), "a positive, finite learning rate"),
        ("optimizer.eps", o.eps, o.eps > 0 and math.isfinite(o.eps), "a small positive number"),
        ("optimizer.weight_decay", o.weight_decay, 0 <= o.weight_decay < math.inf, "0 or more"),
        ("optimizer.warmup_steps", o.warmup_steps, o.warmup_steps >= 0, "0 or more steps"),
        ("optimizer.min_lr_ratio", o.min_lr_ratio, 0 <= o.min_lr_ratio <= 1, "a ratio in [0, 1]"),
        ("optimizer.b1", o.b1, 0 <= o.b1 < 1, "a decay in [0, 1)"),
        ("optimizer.b2", o.b2, 0 <= o.b2 < 1, "a decay in [0, 1)"),
        ("optimizer.clip_norm", o.clip_norm, o.clip_norm >= 0, "0 (off) or a positive norm"),
    ]:
        if not ok:
            raise ConfigError(f"{key}={value}: use {want}")


def _validate_counts(cfg: Config) -> None:
    """Every size and count that must be at least 1 (train.eval_every: at least 0)."""
    m, t, p = cfg.model, cfg.train, cfg.parallel
    if t.eval_every < 0:
        raise ConfigError(f"train.eval_every={t.eval_every}: use 0 (no evaluation) or a step count")
    positive = {
        "model.vocab_size": m.vocab_size,
        "model.d_model": m.d_model,
        "model.n_layers": m.n_layers,
        "model.n_heads": m.n_heads,
        "model.n_kv_heads": m.n_kv_heads,
        "model.d_ff": m.d_ff,
        "model.max_seq_len": m.max_seq_len,
        "train.steps": t.steps,
        "train.batch_size": t.batch_size,
        "train.seq_len": t.seq_len,
        "train.log_every": t.log_every,
        "parallel.grad_accum": p.grad_accum,
        "runtime.cpu_devices": cfg.runtime.cpu_devices,
        "model.max_documents_per_row": m.max_documents_per_row,
        "train.eval_batches": t.eval_batches,
    }
    if cfg.data.max_documents is not None:
        positive["data.max_documents"] = cfg.data.max_documents
    for key, value in positive.items():
        if value < 1:
            raise ConfigError(f"{key}={value}: must be at least 1")


def _validate_window(cfg: Config, sizes: dict[str, int]) -> None:
    """Sliding-window attention: positive sizes, and the layouts that run it."""
    m = cfg.model
    if m.sliding_window is None:
        return
    if m.sliding_window < 1 or m.global_every < 0:
        raise ConfigError(
            f"model.sliding_window={m.sliding_window}, model.global_every={m.global_every}: the window "
            "must be at least 1 (or null: every layer global), global_every at least 0 (0: all slide)"
        )
    chunks = sizes["pipe"] * cfg.parallel.virtual_stages if sizes["pipe"] > 1 else 1
    per_chunk = m.n_layers // chunks
    if chunks > 1 and m.global_every and per_chunk % m.global_every:
        raise ConfigError(
            f"model.sliding_window with mesh.pipe={sizes['pipe']} x parallel.virtual_stages="
            f"{cfg.parallel.virtual_stages}: each pipeline chunk holds {per_chunk} layers, not a multiple "
            f"of model.global_every={m.global_every}, so the chunks' window patterns differ; use a "
            "layout whose chunks hold whole patterns, or mesh.pipe=1"
        )
    if m.moe.num_experts and m.moe.every > 1:
        raise ConfigError(
            f"model.sliding_window with model.moe.every={m.moe.every}: MoE groups and window patterns "
            "do not combine yet; use moe.every=1"
        )
    if m.moe.num_experts and m.moe.first_dense:
        raise ConfigError(
            f"model.sliding_window with model.moe.first_dense={m.moe.first_dense}: a dense prefix and "
            "window patterns do not combine yet; use model.moe.first_dense=0"
        )


def _validate_splits(cfg: Config, sizes: dict[str, int]) -> None:
    """The batch over the data-parallel axes and accumulation; heads, MLP and vocabulary over
    tensor; d_model over fsdp (ZeRO); the sequence over tensor with sequence parallelism."""
    m, t, p = cfg.model, cfg.train, cfg.parallel
    data_parallel = sizes["data"] * sizes["fsdp"] * sizes["expert"]
    if t.batch_size % (data_parallel * p.grad_accum):
        raise ConfigError(
            f"train.batch_size={t.batch_size} is not divisible by the data-parallel size "
            f"data*fsdp*expert={data_parallel} times parallel.grad_accum={p.grad_accum}; "
            f"try a multiple of {data_parallel * p.grad_accum}"
        )
    tensor = sizes["tensor"]
    for dim_key, dim in [
        ("model.n_heads", m.n_heads),
        ("model.n_kv_heads", m.n_kv_heads),
        ("model.d_ff", m.d_ff),
        ("model.vocab_size", m.vocab_size),
    ]:
        require_divides("mesh.tensor", tensor, dim_key, dim)
    if p.zero_stage > 0:
        require_divides("mesh.fsdp", sizes["fsdp"], "model.d_model", m.d_model)
    if p.sequence_parallel:
        require_divides("mesh.tensor", tensor * sizes["context"], "train.seq_len", t.seq_len)


def _validate_lora(cfg: Config, sizes: dict[str, int]) -> None:
    """finetune.lora: a rank of 0 (off, and then no other finetune.lora setting) or more, below
    the smaller side of every adapted matrix, a positive alpha, a dropout in [0, 1) (none with a
    pipeline), targets named once each, none of them MoE experts."""
    lora, moe = cfg.finetune.lora, cfg.model.moe
    if lora.rank < 0:
        raise ConfigError(f"finetune.lora.rank={lora.rank}: use a positive rank (e.g. 8), or 0 for no LoRA")
    if lora.rank == 0:
        set_alone = [
            f"finetune.lora.{f.name}={getattr(lora, f.name)}"
            for f in dataclasses.fields(lora)
            if getattr(lora, f.name) != getattr(LoRAConfig(), f.name)
        ]
        if set_alone:  # adapter settings without adapters: the whole model would train, silently
            raise ConfigError(
                f"{', '.join(set_alone)} set, but finetune.lora.rank=0 means no LoRA (every weight "
                "trains); set finetune.lora.rank (e.g. 8) to train adapters, or leave the other "
                "finetune.lora settings unset"
            )
        return
    if not (lora.alpha > 0 and math.isfinite(lora.alpha)):
        raise ConfigError(f"finetune.lora.alpha={lora.alpha}: use a positive, finite scale (e.g. 16)")
    if not 0 <= lora.dropout < 1:
        raise ConfigError(
            f"finetune.lora.dropout={lora.dropout}: use a rate in [0, 1) (e.g. 0.05), or 0 for none"
        )
    if lora.dropout > 0 and sizes["pipe"] > 1:
        raise ConfigError(
            f"finetune.lora.dropout={lora.dropout} with mesh.pipe={sizes['pipe']}: the pipelined step "
            "does not carry the dropout seeds to its stages; use finetune.lora.dropout=0 or mesh.pipe=1"
        )
    choices = typing.get_args(LoRATarget)
    if not lora.targets or len(set(lora.targets)) != len(lora.targets):
        raise ConfigError(
            f"finetune.lora.targets={lora.targets}: name each projection once, at least one, "
            f"from {', '.join(choices)}"
        )
    mlp = [t for t in lora.targets if t in ("gate", "up", "down")]
    if moe.num_experts and mlp:
        raise ConfigError(
            f"finetune.lora.targets={lora.targets} with model.moe.num_experts={moe.num_experts}: "
            f"LoRA does not adapt MoE experts ({', '.join(mlp)}); use attention targets only "
            "(q, k, v, o)"
        )
    # A rank at or above a matrix's smaller side gives its adapter more parameters than the matrix
    # and no change that training the matrix itself could not make.
    m = cfg.model
    heads = (f"n_heads x head width = {m.n_heads * m.head_width}", m.n_heads * m.head_width)
    kv_heads = (f"n_kv_heads x head width = {m.n_kv_heads * m.head_width}", m.n_kv_heads * m.head_width)
    mlp = (f"d_ff = {m.d_ff}", m.d_ff)
    other = {"q": heads, "k": kv_heads, "v": kv_heads, "o": heads, "gate": mlp, "up": mlp, "down": mlp}
    side, target = min((min(m.d_model, other[t][1]), t) for t in lora.targets)
    if lora.rank >= side:
        raise ConfigError(
            f"finetune.lora.rank={lora.rank} is not below the smaller side ({side}) of the {target} "
            f"projection (d_model = {m.d_model} by {other[target][0]}): such an adapter has more "
            "parameters than the weight and can change it no more than training it does; use a "
            f"rank below {side}, or finetune.lora.rank=0 to train the whole model"
        )


def _validate_pipeline(cfg: Config, sizes: dict[str, int]) -> None:
    p, par, t = sizes["pipe"], cfg.parallel, cfg.train
    if p == 1:
        return
    # The schedule's own rules live beside the schedules (jaxpar.parallel.schedule: plain Python,
    # importing nothing of jaxpar's).
    piped = cfg.model.n_layers - (cfg.model.moe.first_dense if cfg.model.moe.num_experts else 0)
    try:  # the dense prefix (model.moe.first_dense) runs before the pipeline, on every stage
        validate_pipeline(par.pipeline_schedule, p, par.microbatches, par.virtual_stages, layers=piped)
    except ValueError as e:
        if piped != cfg.model.n_layers:
            e = f"{e} (the layers after model.moe.first_dense={cfg.model.moe.first_dense}, run before it)"
        raise ConfigError(f"mesh.pipe={p}, parallel.pipeline_schedule={par.pipeline_schedule}: {e}") from None
    data_parallel = sizes["data"] * sizes["fsdp"] * sizes["expert"]
    # Each of parallel.grad_accum pipelined passes takes batch / grad_accum rows, in microbatches.
    per_row = par.grad_accum * par.microbatches * data_parallel
    if t.batch_size % per_row:
        raise ConfigError(
            f"train.batch_size={t.batch_size} must split into parallel.grad_accum={par.grad_accum} "
            f"x parallel.microbatches={par.microbatches} microbatches that each split over "
            f"data*fsdp*expert={data_parallel}; try a multiple of {per_row}"
        )
    moe, chunks = cfg.model.moe, p * par.virtual_stages
    if moe.num_experts and (piped // moe.every) % chunks:
        # The layer scan repeats groups of model.moe.every blocks (one MoE block each); a
        # pipeline chunk holds whole groups.
        fits = [e for e in divisors(piped) if (piped // e) % chunks == 0]
        after = f" - model.moe.first_dense={moe.first_dense}" if moe.first_dense else ""
        raise ConfigError(
            f"model.n_layers={cfg.model.n_layers}{after} / model.moe.every={moe.every} = "
            f"{piped // moe.every} MoE groups do not split over mesh.pipe={p} x parallel.virtual_stages="
            f"{par.virtual_stages} = {chunks} pipeline chunks (a chunk holds whole groups); "
            f"try model.moe.every in {fits}"
        )
    for key, value, why in [
        (
            "model.attention=cudnn",
            cfg.model.attention == "cudnn",
            "cuDNN's attention call does not compile inside the pipeline's shard_map (jax 0.12); "
            "use auto (XLA attention when pipelined) or xla",
        ),
    ]:
        if value:
            raise ConfigError(f"{key} with mesh.pipe={p}: {why}")


def _validate_sequence_splits(cfg: Config, sizes: dict[str, int]) -> None:
    """Ring attention's cut of the sequence (zigzag: two chunks per device), and the loss's
    chunks, which each split evenly over the devices holding the sequence."""
    t, p = cfg.train, cfg.parallel
    if sizes["context"] > 1:
        pieces = sizes["context"] * (2 if p.context_layout == "zigzag" else 1)
        if t.seq_len % pieces:
            raise ConfigError(
                f"train.seq_len={t.seq_len} is not divisible by {pieces}: ring attention with "
                f"mesh.context={sizes['context']} and parallel.context_layout={p.context_layout} cuts "
                f"the sequence into {pieces} chunks; try a multiple of {pieces}"
            )
    vocab_per_device = cfg.model.vocab_size // sizes["tensor"]
    if not 0 <= t.loss_chunks <= vocab_per_device:
        raise ConfigError(
            f"train.loss_chunks={t.loss_chunks}: the loss cuts each device's {vocab_per_device} "
            f"vocabulary columns (model.vocab_size={cfg.model.vocab_size} over mesh.tensor="
            f"{sizes['tensor']}) into that many pieces; use 0 (auto) or 1 to {vocab_per_device}"
        )


def _validate_data(cfg: Config) -> None:
    """data.source or data.sources names data that exists; evaluation has a split to read."""
    d, t = cfg.data, cfg.train
    if d.sources is None:
        if d.source != "stdlib" and not _prepared(d.source, "data.source"):
            data_files(d)
        if t.eval_every and (d.source == "stdlib" or not _prepared(d.source, "data.source")):
            what = "the standard library" if d.source == "stdlib" else "raw files"
            raise ConfigError(
                f"train.eval_every={t.eval_every} evaluates on a validation split, and "
                f"data.source='{d.source}' ({what}) has none: prepare it with one (python -m "
                "jaxpar.data prepare SOURCES --out DIR --val-fraction 0.01) and train on "
                "data.source=DIR, or set train.eval_every=0"
            )
        return
    if d.source != "stdlib":
        raise ConfigError(
            f"data.source='{d.source}' and data.sources are both set; a run reads one of them: "
            "put that directory into data.sources (with a weight), or remove data.sources"
        )
    if not d.sources:
        raise ConfigError(
            "data.sources is empty: give at least one {path: DIR, weight: W} "
            "(a directory from python -m jaxpar.data prepare), or remove data.sources "
            "to train on data.source"
        )
    for i, s in enumerate(d.sources):
        key = f"data.sources[{i}]"
        if not (s.weight > 0 and math.isfinite(s.weight)):
            raise ConfigError(
                f"{key}.weight={s.weight}: use a positive, finite weight (weights are "
                "relative: 0.7 and 0.3 draw as 7 and 3 do)"
            )
        if not _prepared(s.path, f"{key}.path"):
            raise ConfigError(
                f"{key}.path='{s.path}' is not a directory of prepared shards (no manifest.json): "
                f"make one with python -m jaxpar.data prepare SOURCES --out {s.path}"
            )
    names = source_names(d)
    for i, name in enumerate(names):
        if names.index(name) != i:
            raise ConfigError(
                f"data.sources[{names.index(name)}] and data.sources[{i}] are both named '{name}' "
                f"in the metrics; give one of them another name (data.sources[{i}].name)"
            )


def _prepared(path: str, key: str) -> bool:
    """Whether `path` (setting `key`) is a finished directory of prepared shards; an unfinished
    one is an error (resume it). Their contents are checked when opened (jaxpar.corpus.verify)."""
    path = os.path.expanduser(path)
    if os.path.isfile(os.path.join(path, "manifest.json")):
        return True
    if os.path.isfile(os.path.join(path, "prepare.json")):
        raise ConfigError(
            f"{key}='{path}' has no manifest.json: its preparation did not finish; run the same "
            "`python -m jaxpar.data prepare` command again, it resumes"
        )
    return False
