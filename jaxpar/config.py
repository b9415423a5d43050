"""Every setting of a run: typed dataclasses, YAML presets, dotted overrides, validation.

A run's config is built in three layers: the dataclass defaults (the embedded default job), an
optional YAML file, then `dotted.key=value` overrides whose values are parsed as YAML scalars.
All checks that can be made without compiling anything live here, so bad input stops early with
a `ConfigError` that names the key, the numbers and what would work.
"""

from __future__ import annotations

import dataclasses
import difflib
import glob
import math
import os
import types
import typing
from dataclasses import dataclass, field
from typing import Any

import yaml

MESH_AXES = ("pipe", "data", "fsdp", "expert", "context", "tensor")


class ConfigError(ValueError):
    """A problem with the user's configuration; the CLI prints it and exits with code 2."""


@dataclass
class MoEConfig:
    num_experts: int = 0  # 0 = dense model (no MoE layers)
    top_k: int = 2  # experts per token
    every: int = 1  # an MoE MLP every n-th block (1 = all blocks), dense MLP elsewhere
    capacity_factor: float | None = None  # None = dropless; else slots = cf * tokens * top_k / E
    shared_experts: int = 0  # always-on experts (DeepSeek style), added to the routed output
    d_ff: int | None = None  # expert hidden size; None = model.d_ff
    aux_loss_weight: float = 0.01  # load-balancing loss (Switch Transformer)
    z_loss_weight: float = 0.001  # router z-loss (ST-MoE)


@dataclass
class ModelConfig:
    vocab_size: int = 512  # >= the tokenizer's vocabulary; divisible by mesh.tensor
    d_model: int = 128
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int = 2  # grouped-query attention: n_heads % n_kv_heads == 0
    d_ff: int = 384  # SwiGLU hidden size
    max_seq_len: int = 2048  # longest train.seq_len the model accepts
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    init_std: float = 0.02
    tie_embeddings: bool = False  # output head shares the embedding table
    dtype: str = "bfloat16"  # matmul / activation dtype; the loss and softmax stay float32
    param_dtype: str = "float32"  # parameters and optimizer state
    attention: str = "auto"  # auto (cudnn on GPUs, else xla) | xla | cudnn: see models/attention.py
    max_documents_per_row: int = 16  # cudnn: documents a packed row may hold (costs 4*B*N*T bytes each)
    moe: MoEConfig = field(default_factory=MoEConfig)


@dataclass
class MeshConfig:
    """Device mesh, outermost axis first. One axis may be -1: it takes the remaining devices."""

    pipe: int = 1
    data: int = 2
    fsdp: int = 2
    expert: int = 1
    context: int = 1
    tensor: int = 2


@dataclass
class ParallelConfig:
    zero_stage: int = 3  # 0 DDP | 1 optimizer state | 2 + gradients | 3 + parameters, over fsdp
    sequence_parallel: bool = False  # shard activations between blocks along seq over tensor
    remat: str = "none"  # none | dots | full: what each block keeps for the backward pass
    grad_accum: int = 1  # microsteps per optimizer step (the global batch is split into these)
    context_layout: str = "zigzag"  # zigzag | contiguous: sequence split for ring attention
    pipeline_schedule: str = "1f1b"  # gpipe | 1f1b | interleaved (when mesh.pipe > 1)
    microbatches: int = 4  # pipeline microbatches per step (when mesh.pipe > 1)
    virtual_stages: int = 1  # chunks per pipeline stage (interleaved schedule)


@dataclass
class DataConfig:
    source: str = "stdlib"  # stdlib (this Python's own .py files) | a path or glob of text/JSONL
    format: str = "auto"  # auto (by extension) | text | jsonl
    text_field: str = "text"  # the JSONL field that holds a document
    tokenizer: str = "byte"  # byte | path to a Hugging Face tokenizer.json
    max_documents: int | None = None  # read at most this many documents (None = all)
    shuffle: bool = True


@dataclass
class OptimizerConfig:
    lr: float = 3e-3  # peak learning rate
    warmup_steps: int = 20  # linear warmup from 0 to lr
    min_lr_ratio: float = 0.1  # cosine decay ends at lr * min_lr_ratio
    weight_decay: float = 0.1
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    clip_norm: float = 1.0  # global-norm gradient clipping (0 = off)


@dataclass
class TrainConfig:
    steps: int = 300
    seed: int = 0
    batch_size: int = 16  # global batch, in sequences
    seq_len: int = 256
    log_every: int = 10
    run_dir: str = "runs/default"
    progress: bool = True  # live progress bar on the terminal
    resume: str = "auto"  # auto (latest complete checkpoint in run_dir) | never | a step number
    on_nan: str = "stop"  # stop (error naming the step) | skip (drop that step's update)
    loss_chunks: int = 0  # the loss computes logits for seq/loss_chunks positions at a time; 0 = auto


@dataclass
class CheckpointConfig:
    every: int = 100  # save every n steps and at the end (0 = only on preemption)
    keep: int = 3  # newest checkpoints to keep


@dataclass
class DistributedConfig:
    """Multi-process runs (jax.distributed). Each key also comes from the environment:
    JAXPAR_COORDINATOR, JAXPAR_NUM_PROCESSES, JAXPAR_PROCESS_ID (set by `python -m jaxpar.launch`)."""

    coordinator: str | None = None  # host:port of process 0; None = single process
    num_processes: int | None = None
    process_id: int | None = None
    auto: bool = False  # let JAX detect the cluster (SLURM, Kubernetes, Cloud TPU, MPI)


@dataclass
class RuntimeConfig:
    cpu_devices: int = 8  # on a CPU-only machine, emulate this many devices (1 = plain run)


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    mesh: MeshConfig = field(default_factory=MeshConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)


# ---------------------------------------------------------------------------------------------
# Loading: YAML file + dotted overrides -> nested dict -> typed dataclasses


def _all_keys(cls, prefix: str = "") -> list[str]:
    keys = []
    for f in dataclasses.fields(cls):
        sub = _dataclass_type(cls, f)
        keys.append(prefix + f.name)
        if sub is not None:
            keys += _all_keys(sub, prefix + f.name + ".")
    return keys


def _dataclass_type(cls, f) -> type | None:
    hint = typing.get_type_hints(cls)[f.name]
    return hint if dataclasses.is_dataclass(hint) else None


def _unknown_key(key: str) -> ConfigError:
    close = difflib.get_close_matches(key, _all_keys(Config), n=1, cutoff=0.5)
    hint = f"; did you mean '{close[0]}'?" if close else ""
    return ConfigError(f"unknown config key '{key}'{hint}")


@dataclass(frozen=True)
class _Override:
    """A command-line value: its text, and that text read as a YAML scalar."""

    text: str
    value: Any


def _coerce(key: str, value: Any, hint: Any) -> Any:
    """Checks `value` against the annotation `hint` (int, float, str, bool, X | None)."""
    if isinstance(value, _Override):  # a str setting keeps the text as typed ("on", "2024")
        wants_str = hint is str or str in typing.get_args(hint)
        value = value.text if wants_str and value.value is not None else value.value
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        options = typing.get_args(hint)
        if value is None and type(None) in options:
            return None
        (inner,) = [t for t in options if t is not type(None)]
        return _coerce(key, value, inner)
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if hint is float and isinstance(value, str):
        try:  # YAML 1.1 reads "3e-4" as a string
            return float(value)
        except ValueError:
            pass
    if isinstance(value, hint) and not (hint is int and isinstance(value, bool)):
        return value
    raise ConfigError(
        f"{key}: expected {hint.__name__}, got {value!r} ({type(value).__name__})"
    )


def _build(cls, values: dict, prefix: str = ""):
    kwargs = {}
    names = {f.name: f for f in dataclasses.fields(cls)}
    for name, value in values.items():
        key = prefix + str(name)
        if name not in names:
            raise _unknown_key(key)
        sub = _dataclass_type(cls, names[name])
        if sub is not None:
            if isinstance(value, _Override):
                value = value.value
            if not isinstance(value, dict):
                raise ConfigError(f"{key}: expected a mapping of settings, got {value!r}")
            kwargs[name] = _build(sub, value, key + ".")
        else:
            kwargs[name] = _coerce(key, value, typing.get_type_hints(cls)[name])
    return cls(**kwargs)


def _set_dotted(tree: dict, key: str, value: Any) -> None:
    parts = key.split(".")
    node = tree
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"{key}: '{part}' is a value, not a section")
    node[parts[-1]] = value


def _merge(base: dict, extra: dict) -> dict:
    out = dict(base)
    for k, v in extra.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def load_yaml(path: str) -> dict:
    if not os.path.isfile(path):
        raise ConfigError(f"config file '{path}' does not exist")
    try:
        with open(path) as f:
            loaded = yaml.safe_load(f)
    except yaml.YAMLError as e:
        raise ConfigError(f"config file '{path}' is not valid YAML: {e}") from None
    if loaded is None:
        return {}
    if not isinstance(loaded, dict):
        raise ConfigError(f"config file '{path}' must hold a mapping, got {type(loaded).__name__}")
    return loaded


def parse_overrides(overrides: list[str]) -> dict:
    """`["train.steps=20", "mesh.data=-1"]` -> nested dict, values parsed as YAML scalars."""
    tree: dict = {}
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override '{item}' is not of the form dotted.key=value")
        key, raw = item.split("=", 1)
        try:
            value = yaml.safe_load(raw) if raw else None
        except yaml.YAMLError as e:
            raise ConfigError(f"override '{item}': value does not parse: {e}") from None
        _set_dotted(tree, key.strip(), _Override(raw, value))
    return tree


def user_settings(path: str | None = None, overrides: list[str] = ()) -> dict:
    """What the user set: the YAML file (if any) with the overrides merged over it."""
    values = load_yaml(path) if path else {}
    return _merge(values, parse_overrides(list(overrides)))


def build_config(settings: dict) -> Config:
    """The defaults with `settings` (from `user_settings`) applied; type-checked, not validated."""
    return _build(Config, settings)


def load_config(path: str | None = None, overrides: list[str] = ()) -> Config:
    """Defaults, then the YAML file (if any), then the overrides; type-checked, not yet validated."""
    return build_config(user_settings(path, overrides))


def fit_default_mesh(num_devices: int) -> MeshConfig:
    """The default layout (data x fsdp x tensor = 2 x 2 x 2) where there are 8 devices; plain data
    parallelism over whatever exists otherwise (one GPU, a 4-GPU box), so `python -m
    jaxpar.train` with no arguments runs anywhere."""
    default = MeshConfig()
    size = default.data * default.fsdp * default.tensor
    return default if num_devices == size else MeshConfig(data=num_devices, fsdp=1, tensor=1)


def to_dict(cfg: Config) -> dict:
    return dataclasses.asdict(cfg)


def dump_yaml(cfg: Config, path: str) -> None:
    with open(path, "w") as f:
        yaml.safe_dump(to_dict(cfg), f, sort_keys=False)


def parse_cli(argv: list[str]) -> tuple[str | None, list[str]]:
    """`[CONFIG.yaml] [key=value ...]` -> (config path or None, overrides)."""
    path = None
    if argv and "=" not in argv[0]:
        path, argv = argv[0], argv[1:]
    for arg in argv:
        if "=" not in arg:
            raise ConfigError(
                f"argument '{arg}' is neither a config file (only the first argument may be one) "
                "nor a dotted.key=value override"
            )
    return path, list(argv)


# ---------------------------------------------------------------------------------------------
# Validation: everything that can be checked before compiling


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


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _require_divides(axis_key: str, axis: int, dim_key: str, dim: int) -> None:
    if dim % axis:
        raise ConfigError(
            f"{axis_key}={axis} does not divide {dim_key}={dim}; "
            f"try {axis_key.split('.')[-1]} in {_divisors(dim)}"
        )


def _check_choice(key: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ConfigError(f"{key}={value!r}: choose one of {', '.join(choices)}")


def data_files(data: DataConfig) -> list[str]:
    """The files a non-stdlib source names (a path or a glob), sorted; error if there are none."""
    files = sorted(p for p in glob.glob(os.path.expanduser(data.source), recursive=True)
                   if os.path.isfile(p))
    if not files:
        raise ConfigError(f"data.source='{data.source}': no such file (or nothing matches the glob)")
    return files


def _validate_moe(cfg: Config, sizes: dict[str, int]) -> None:
    moe, m = cfg.model.moe, cfg.model
    if moe.num_experts == 0:
        return
    if moe.num_experts < 0 or not 1 <= moe.top_k <= moe.num_experts:
        raise ConfigError(
            f"model.moe.top_k={moe.top_k} must be between 1 and model.moe.num_experts={moe.num_experts}")
    if moe.every < 1 or m.n_layers % moe.every:
        raise ConfigError(
            f"model.moe.every={moe.every} must divide model.n_layers={m.n_layers} (an MoE MLP in "
            f"every {moe.every}-th block); try every in {_divisors(m.n_layers)}")
    _require_divides("mesh.expert", sizes["expert"], "model.moe.num_experts", moe.num_experts)
    _require_divides("mesh.tensor", sizes["tensor"], "model.moe.d_ff", moe.d_ff or m.d_ff)
    if moe.capacity_factor is not None and moe.capacity_factor <= 0:
        raise ConfigError(f"model.moe.capacity_factor={moe.capacity_factor}: use a positive "
                          "number, or null for dropless routing")
    if moe.shared_experts < 0:
        raise ConfigError(f"model.moe.shared_experts={moe.shared_experts} must be 0 or more")


def _validate_pipeline(cfg: Config, sizes: dict[str, int]) -> None:
    p, par, t = sizes["pipe"], cfg.parallel, cfg.train
    if p == 1:
        return
    from jaxpar.parallel.pipeline import validate_pipeline  # jax-free schedule checks

    try:
        validate_pipeline(par.pipeline_schedule, p, par.microbatches, par.virtual_stages,
                          layers=cfg.model.n_layers, batch=t.batch_size)
    except ValueError as e:
        raise ConfigError(f"mesh.pipe={p}, parallel.pipeline_schedule={par.pipeline_schedule}: {e}") from None
    data_parallel = sizes["data"] * sizes["fsdp"] * sizes["expert"]
    if t.batch_size % (par.microbatches * data_parallel):
        raise ConfigError(
            f"train.batch_size={t.batch_size} must split into parallel.microbatches={par.microbatches} "
            f"microbatches that each split over data*fsdp*expert={data_parallel}; "
            f"try a multiple of {par.microbatches * data_parallel}")
    for key, value, why in [
        ("parallel.grad_accum", par.grad_accum != 1, "microbatches already accumulate; set it to 1"),
        ("model.moe.num_experts", cfg.model.moe.num_experts != 0, "MoE layers are not pipelined yet"),
        ("mesh.context", sizes["context"] != 1, "ring attention is not pipelined yet"),
        ("model.attention=cudnn", cfg.model.attention == "cudnn",
         "cuDNN's attention call does not compile inside the pipeline's shard_map (jax 0.12); "
         "use auto (XLA attention when pipelined) or xla"),
    ]:
        if value:
            raise ConfigError(f"{key} with mesh.pipe={p}: {why}")


def validate(cfg: Config, num_devices: int) -> dict[str, int]:
    """Checks the whole config against itself and the device count; returns the mesh sizes."""
    m, t, p = cfg.model, cfg.train, cfg.parallel
    sizes = resolve_mesh(cfg.mesh, num_devices)

    for key, value in [("model.dtype", m.dtype), ("model.param_dtype", m.param_dtype)]:
        _check_choice(key, value, ("float32", "bfloat16", "float16"))
    _check_choice("model.attention", m.attention, ("auto", "xla", "cudnn"))
    if m.attention == "cudnn" and m.dtype == "float32":
        raise ConfigError("model.attention=cudnn takes bfloat16 or float16 activations, but "
                          "model.dtype=float32; use model.dtype=bfloat16, or attention auto or xla")
    _check_choice("parallel.remat", p.remat, ("none", "dots", "full"))
    _check_choice("parallel.context_layout", p.context_layout, ("zigzag", "contiguous"))
    _check_choice("parallel.pipeline_schedule", p.pipeline_schedule, ("gpipe", "1f1b", "interleaved"))
    _check_choice("data.format", cfg.data.format, ("auto", "text", "jsonl"))
    _check_choice("train.on_nan", t.on_nan, ("stop", "skip"))
    if t.resume not in ("auto", "never") and not t.resume.isdigit():
        raise ConfigError(f"train.resume={t.resume!r}: use auto, never, or a checkpoint step number")
    if cfg.checkpoint.every < 0:
        raise ConfigError(f"checkpoint.every={cfg.checkpoint.every}: use 0 (never) or a step count")
    if p.zero_stage not in (0, 1, 2, 3):
        raise ConfigError(f"parallel.zero_stage={p.zero_stage}: choose 0, 1, 2 or 3")

    positive = {
        "model.vocab_size": m.vocab_size, "model.d_model": m.d_model, "model.n_layers": m.n_layers,
        "model.n_heads": m.n_heads, "model.n_kv_heads": m.n_kv_heads, "model.d_ff": m.d_ff,
        "model.max_seq_len": m.max_seq_len, "train.steps": t.steps, "train.batch_size": t.batch_size,
        "train.seq_len": t.seq_len, "train.log_every": t.log_every,
        "parallel.grad_accum": p.grad_accum, "runtime.cpu_devices": cfg.runtime.cpu_devices,
        "model.max_documents_per_row": m.max_documents_per_row,
    }
    if cfg.data.max_documents is not None:
        positive["data.max_documents"] = cfg.data.max_documents
    for key, value in positive.items():
        if value < 1:
            raise ConfigError(f"{key}={value}: must be at least 1")

    if m.n_heads % m.n_kv_heads:
        raise ConfigError(
            f"model.n_heads={m.n_heads} is not divisible by model.n_kv_heads={m.n_kv_heads}; "
            f"try n_kv_heads in {_divisors(m.n_heads)}"
        )
    _require_divides("model.n_heads", m.n_heads, "model.d_model", m.d_model)
    if (m.d_model // m.n_heads) % 2:
        raise ConfigError(
            f"model.d_model/model.n_heads = {m.d_model // m.n_heads} is odd; rotary embeddings "
            "need an even head dimension"
        )
    if t.seq_len > m.max_seq_len:
        raise ConfigError(
            f"train.seq_len={t.seq_len} is above model.max_seq_len={m.max_seq_len}; "
            f"lower train.seq_len or raise model.max_seq_len"
        )

    data_parallel = sizes["data"] * sizes["fsdp"] * sizes["expert"]
    if t.batch_size % (data_parallel * p.grad_accum):
        raise ConfigError(
            f"train.batch_size={t.batch_size} is not divisible by the data-parallel size "
            f"data*fsdp*expert={data_parallel} times parallel.grad_accum={p.grad_accum}; "
            f"try a multiple of {data_parallel * p.grad_accum}"
        )

    tensor = sizes["tensor"]
    for dim_key, dim in [("model.n_heads", m.n_heads), ("model.n_kv_heads", m.n_kv_heads),
                         ("model.d_ff", m.d_ff), ("model.vocab_size", m.vocab_size)]:
        _require_divides("mesh.tensor", tensor, dim_key, dim)
    if p.zero_stage > 0:
        _require_divides("mesh.fsdp", sizes["fsdp"], "model.d_model", m.d_model)
    if p.sequence_parallel:
        _require_divides("mesh.tensor", tensor * sizes["context"], "train.seq_len", t.seq_len)
    _validate_moe(cfg, sizes)
    _validate_pipeline(cfg, sizes)
    if sizes["context"] > 1:
        pieces = sizes["context"] * (2 if p.context_layout == "zigzag" else 1)
        if t.seq_len % pieces:
            raise ConfigError(
                f"train.seq_len={t.seq_len} is not divisible by {pieces}: ring attention with "
                f"mesh.context={sizes['context']} and parallel.context_layout={p.context_layout} cuts "
                f"the sequence into {pieces} chunks; try a multiple of {pieces}")

    seq_shards = sizes["context"] * (tensor if p.sequence_parallel else 1)
    if t.loss_chunks < 0 or (t.loss_chunks and (t.seq_len % t.loss_chunks
                                                or (t.seq_len // t.loss_chunks) % seq_shards)):
        fits = [c for c in _divisors(t.seq_len) if (t.seq_len // c) % seq_shards == 0]
        raise ConfigError(
            f"train.loss_chunks={t.loss_chunks} must divide train.seq_len={t.seq_len} into pieces "
            f"that split evenly over the {seq_shards} devices holding the sequence; use 0 (auto) "
            f"or one of {fits}")
    if cfg.data.source != "stdlib":
        data_files(cfg.data)
    if cfg.data.tokenizer != "byte" and not os.path.isfile(cfg.data.tokenizer):
        raise ConfigError(
            f"data.tokenizer='{cfg.data.tokenizer}' does not exist; use 'byte' or the path of a "
            "tokenizer.json (python -m jaxpar.data train-tokenizer makes one)"
        )
    return sizes
