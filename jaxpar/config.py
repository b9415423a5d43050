"""Every setting of a run: typed dataclasses, YAML presets, dotted overrides, validation.

A run's config is built in three layers: the dataclass defaults (the embedded default job), an
optional YAML file, then `dotted.key=value` overrides whose values are parsed as YAML scalars.
Every setting is annotated with its type; a setting with a fixed set of values is a `Literal`,
and loading checks each value against its annotation (`_coerce`), so a wrong type or an unknown
choice stops with a `ConfigError` that names the key, the value and the choices.

`validate` then checks the config against itself and the device count, before anything is
compiled: it re-checks the types (for configs built or changed in Python), the mesh, the
divisibility of every split dimension, MoE routing, ring attention's sequence cut and the loss
chunks, that the data and tokenizer files exist, and the pipeline, whose schedule rules live
with the schedules in `jaxpar.parallel.schedule.validate_pipeline` and are called from here.
Some checks cannot be made here and raise the same `ConfigError` later: the distributed keys
when the processes start (`jaxpar.mesh.start_distributed`), what only the data shows (the
tokenizer's vocabulary against model.vocab_size, a corpus shorter than one sequence, malformed
JSONL, documents per packed row for cuDNN attention, prepared shards that differ from their
manifest) when the trainer reads it, a resume step whose checkpoint is unusable or whose data
differs from the run's record when the run directory is opened (`jaxpar.run.rundir`),
`train.init_from`'s model directory when it is read (`jaxpar.convert`), and `model.fp8` against
the devices' compute capability when the trainer is built (`jaxpar.training.trainer`). A CPU run that will
not fit in the host's memory is refused before compiling too, but as its own error (exit code 3,
`jaxpar.planning.host`), not a ConfigError.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import glob
import inspect
import io
import math
import os
import tempfile
import textwrap
import tokenize
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Literal

import yaml

from jaxpar.parallel.schedule import validate_pipeline

MESH_AXES = ("pipe", "data", "fsdp", "expert", "context", "tensor")

# The settings with a fixed set of values: each a Literal, checked by `_coerce` when loaded and
# again by `validate`; these annotations are the config's only list of the choices.
Dtype = Literal["float32", "bfloat16", "float16"]
Attention = Literal["auto", "xla", "cudnn"]
MLPActivation = Literal["silu", "gelu_tanh"]
Remat = Literal["none", "dots", "full"]
ContextLayout = Literal["zigzag", "contiguous"]
PipelineSchedule = Literal["gpipe", "1f1b", "interleaved", "zb"]
ZeroStage = Literal[0, 1, 2, 3]
GradReduceDtype = Literal["float32", "bfloat16"]
DataFormat = Literal["auto", "text", "jsonl", "parquet"]
DataErrors = Literal["strict", "replace", "skip"]
TrainOn = Literal["assistant", "all"]
Packing = Literal["wrap", "whole"]
CHAT_TEMPLATES = ("simple",)  # jaxpar's own chat templates: jaxpar/corpus/templates/<name>.jinja
OptimizerName = Literal["adamw", "sgd"]
OnNaN = Literal["stop", "skip"]
RopeScaling = Literal["none", "llama3", "linear"]
MoEDispatch = Literal["auto", "padded", "ragged"]
LoRATarget = Literal["q", "k", "v", "o", "gate", "up", "down"]


class ConfigError(ValueError):
    """A problem with the user's configuration; the CLI prints it and exits with code 2."""


@dataclass
class MoEConfig:
    num_experts: int = 0  # 0 = dense model (no MoE layers)
    top_k: int = 2  # experts per token
    norm_topk: bool = True  # top_k > 1: the chosen experts' probs renormalised to sum 1 (Mixtral)
    every: int = 1  # an MoE MLP every n-th block (1 = all blocks), dense MLP elsewhere
    capacity_factor: float | None = None  # None = dropless; else slots = cf * tokens * top_k / E
    shared_experts: int = 0  # always-on experts (DeepSeek style), added to the routed output
    d_ff: int | None = None  # expert hidden size; None = model.d_ff
    aux_loss_weight: float = 0.01  # load-balancing loss (Switch Transformer)
    z_loss_weight: float = 0.001  # router z-loss (ST-MoE)
    dispatch: MoEDispatch = (
        "auto"  # auto (ragged on GPU if dropless, no costlier: experts.py) | padded | ragged
    )
    ragged_buffer_factor: float | None = (
        None  # ragged: receive rows / (tokens*top_k); None: worst case, no drops
    )


@dataclass
class RopeScalingConfig:
    """Rotary frequencies rescaled for long context, as Llama 3.1+ checkpoints ship them
    (Hugging Face rope_type "llama3"): wavelengths above original_max_len / low_freq_factor are
    divided by `factor`, those below original_max_len / high_freq_factor kept, the ones between
    interpolated. "linear" (Gemma 3's global layers): every frequency divided by `factor`."""

    type: RopeScaling = "none"  # none | llama3 | linear
    factor: float = 8.0  # llama3, linear: how much longer the context became
    low_freq_factor: float = 1.0  # llama3: low-frequency band edge
    high_freq_factor: float = 4.0  # llama3: high-frequency band edge
    original_max_len: int = 8192  # llama3: the context length the model was pre-trained with


@dataclass
class ModelConfig:
    vocab_size: int = 512  # >= the tokenizer's vocabulary; divisible by mesh.tensor
    d_model: int = 128  # residual stream width; divisible by model.n_heads (head_dim even)
    n_layers: int = 4  # transformer blocks
    n_heads: int = 4  # query heads; divisible by mesh.tensor
    n_kv_heads: int = 2  # grouped-query attention: n_heads % n_kv_heads == 0
    d_ff: int = 384  # SwiGLU hidden size
    max_seq_len: int = 2048  # longest train.seq_len the model accepts
    rope_theta: float = 10000.0  # rotary embedding base
    rope_scaling: RopeScalingConfig = field(default_factory=RopeScalingConfig)  # long-context rotary (llama3)
    norm_eps: float = 1e-5  # RMSNorm epsilon
    init_std: float = 0.02  # weights ~ N(0, init_std^2); output projections / sqrt(2 * n_layers)
    tie_embeddings: bool = False  # output head shares the embedding table
    qkv_bias: bool = False  # biases on the q, k and v projections (Qwen2)
    head_dim: int | None = None  # one attention head's width; None = d_model / n_heads
    qk_norm: bool = False  # RMSNorm over each head of q and k before the rotation (Qwen3)
    mlp_activation: MLPActivation = "silu"  # silu (SwiGLU) | gelu_tanh (GeGLU, Gemma)
    embed_scale: bool = False  # embeddings times sqrt(d_model) on the way in (Gemma)
    norm_offset: bool = False  # RMSNorm scales by 1 + weight, the weights starting at 0 (Gemma)
    post_norms: bool = False  # RMSNorm also on the attention's and the MLP's outputs (Gemma 3)
    attn_scale_dim: float | None = None  # logits scaled by 1/sqrt(this); None = head width (Gemma 3)
    sliding_window: int | None = None  # sliding layers attend to the last n positions; None = none
    global_every: int = 0  # with sliding_window: every n-th layer attends globally; 0 = all slide
    rope_local_theta: float | None = None  # sliding layers' rotary base, unscaled; None = as global
    dtype: Dtype = "bfloat16"  # matmul / activation dtype; the loss and softmax stay float32
    param_dtype: Dtype = "float32"  # parameters and optimizer state
    fp8: bool = (
        False  # block matmuls (attention projections, MLP, experts) in float8: e4m3 forward, e5m2 grads
    )
    # auto: cudnn where its packed kernel runs (Hopper+ GPU, 16-bit, not pipelined, no ring), else
    # xla; models/attention.py (kernel_for) has the rule.
    attention: Attention = "auto"  # auto | xla | cudnn
    # cudnn: the most documents a packed row may hold (a fuller row stops the run). Training runs
    # each batch with the step compiled for its fullest row's slot bucket (1, 2, 4, ... up to this);
    # a slot costs 4*B*N*T bytes of softmax statistics per layer.
    max_documents_per_row: int = 16  # cudnn: documents a packed row may hold (see above)
    # true: the layers run in one lax.scan over their stacked weights (compile time flat in depth);
    # false: unrolled, one copy of the block per layer in the program (no stacked residual buffers
    # to save into and load from, no while loop; compiles longer). The weights are stacked either way.
    scan_layers: bool = True  # true: one lax.scan over the layers | false: unrolled (see above)
    moe: MoEConfig = field(default_factory=MoEConfig)  # mixture of experts (off by default)

    @property
    def head_width(self) -> int:
        """The width of one attention head, model.head_dim or else d_model / n_heads: every use
        reads it here."""
        return self.head_dim or self.d_model // self.n_heads

    def slides(self, layer: int) -> bool:
        """Whether layer `layer` (from 0) attends within model.sliding_window: all but every
        model.global_every-th layer (the last of each run) when there is a window; every use
        reads it here."""
        every = self.global_every
        return self.sliding_window is not None and (every == 0 or (layer + 1) % every != 0)


@dataclass
class MeshConfig:
    """Device mesh, outermost axis first. One axis may be -1: it takes the remaining devices."""

    pipe: int = 1  # pipeline stages, each holding a contiguous run of layers
    data: int = 2  # data-parallel replicas: whole batch rows, gradients all-reduced
    fsdp: int = 2  # data parallelism that also shards training state (parallel.zero_stage)
    expert: int = 1  # MoE experts split over this axis; it also splits the batch
    context: int = 1  # ring attention: the sequence split into chunks (parallel.context_layout)
    tensor: int = 2  # Megatron tensor parallelism: heads, d_ff and vocab split


@dataclass
class ParallelConfig:
    zero_stage: ZeroStage = 3  # 0 DDP | 1 optimizer state | 2 + grads | 3 + params, over fsdp
    sequence_parallel: bool = False  # shard activations between blocks along seq over tensor
    remat: Remat = "none"  # none | dots | full: what each block keeps for the backward pass
    grad_accum: int = 1  # microsteps per optimizer step (the global batch is split into these)
    # The dtype the weight gradients leave their GEMMs in, so the dtype of their reduce-scatter /
    # all-reduce across devices (bfloat16: half the bytes, each device's partial sum rounded;
    # float32: exact sums). Summed over microsteps and applied in float32 either way. null: the
    # compute dtype's (`reduce_dtype`): bfloat16 for a bfloat16 model, float32 for a float32 or
    # float16 one, so that a float32 model is float32 throughout unless this is set.
    grad_reduce_dtype: GradReduceDtype | None = None  # null | bfloat16 | float32 (see above)
    context_layout: ContextLayout = "zigzag"  # ring attention's sequence cut; zigzag evens causal work
    pipeline_schedule: PipelineSchedule = "1f1b"  # gpipe | 1f1b | interleaved | zb (when mesh.pipe > 1)
    microbatches: int = 4  # pipeline microbatches per step (when mesh.pipe > 1)
    virtual_stages: int = 1  # chunks per pipeline stage (interleaved schedule)


@dataclass
class SourceConfig:
    """One prepared dataset of a mixture (`data.sources`)."""

    path: str  # a directory of prepared token shards (python -m jaxpar.data prepare)
    # Relative: sources [{weight: 0.7}, {weight: 0.3}] and [{weight: 7}, {weight: 3}] draw the same
    # shares of the training sequences, held to 1% of the smallest weight.
    weight: float  # its share of the training sequences (see above); positive and finite
    name: str | None = None  # its name in the metrics (tokens_seen); None = the directory's name


@dataclass
class DataConfig:
    # stdlib (this Python's own .py files; whole, it is prepared once into a cache) | a path or
    # glob of text/JSONL/Parquet files (read into memory) | a directory of prepared token shards
    # (python -m jaxpar.data prepare; read a sequence at a time)
    source: str = "stdlib"  # stdlib | a path or glob | a directory of prepared shards (see above)
    # A mixture of prepared datasets instead of data.source (which then stays unset, at stdlib):
    # [{path: DIR, weight: 0.7}, {path: DIR2, weight: 0.3}]. Every global batch draws its rows from
    # them in these proportions (grain's MapDataset.mix), each dataset shuffled and repeated on its
    # own; data.max_documents applies to each. Metrics report the tokens seen per source.
    sources: list[SourceConfig] | None = None  # a mixture (see above); None = data.source alone
    format: DataFormat = "auto"  # auto (by extension) | text | jsonl | parquet
    text_field: str = "text"  # the JSONL field (Parquet column) that holds a document
    tokenizer: str = "byte"  # byte | path to a Hugging Face tokenizer.json
    # Records without data.text_field: conversations {"messages": [{role, content}, ...]} rendered
    # with a chat template, and {"prompt": ..., "completion": ...} pairs (jaxpar.corpus.chat). assistant:
    # only the assistant replies (with their end-of-turn marker) and completions are targets;
    # all: every token is, as for plain text. Plain text documents are all targets either way.
    train_on: TrainOn = "assistant"  # assistant | all (see above)
    # The chat template of conversations: null = the tokenizer's own (chat_template.jinja or
    # tokenizer_config.json beside its tokenizer.json) | a .jinja file | simple (jaxpar's own,
    # jaxpar/corpus/templates/simple.jinja, e.g. for the byte tokenizer, which has none). Never chosen
    # silently: a conversation source without a template is an error.
    chat_template: str | None = None  # null | FILE.jinja | simple (see above)
    # How documents become rows of train.seq_len + 1 tokens. wrap: one stream cut every seq_len
    # tokens, documents split wherever a row ends (pre-training). whole: each row takes whole
    # documents in order while the next one fits, then is padded (padding is no target and no
    # real token attends to it), so a document that fits in a row is never split (fine-tuning
    # on conversations); a longer one starts a row and is split as wrap splits (jaxpar.data).
    packing: Packing = "wrap"  # wrap | whole (see above)
    max_documents: int | None = None  # read at most this many documents (None = all)
    shuffle: bool = True  # shuffle the packed sequences with train.seed (a new order every epoch)
    # A document that is not text (invalid UTF-8, NUL bytes, a JSONL text that is null or not a
    # string): strict stops naming the file and line; replace turns bad bytes into U+FFFD and
    # leaves the rest out; skip leaves the document out. Both say how many in a warning.
    errors: DataErrors = "strict"  # strict | replace | skip (see above)
    allow_source_change: bool = (
        False  # resume onto other data (source(s), tokenizer, seed); config.yaml keeps it
    )


@dataclass
class OptimizerConfig:
    # adamw: AdamW (b1, b2, eps; weight_decay, not on norm scales). sgd: plain SGD (no momentum,
    # no weight decay, no clipping unless clip_norm > 0): what parity tests use to see gradient
    # scale errors, which AdamW's normalisation hides.
    name: OptimizerName = "adamw"  # the update rule: adamw | sgd (see above)
    lr: float = 3e-3  # peak learning rate
    warmup_steps: int = 20  # update n <= warmup_steps runs at lr * n / warmup_steps
    min_lr_ratio: float = 0.1  # cosine decay ends at lr * min_lr_ratio
    weight_decay: float = 0.1  # AdamW's decoupled weight decay (norm scales excluded)
    b1: float = 0.9  # AdamW first-moment decay
    b2: float = 0.95  # AdamW second-moment decay
    eps: float = 1e-8  # AdamW denominator epsilon
    clip_norm: float = 1.0  # global-norm gradient clipping (0 = off)


@dataclass
class TrainConfig:
    steps: int = 300  # optimizer steps; the learning-rate schedule ends here
    seed: int = 0  # fixes the initial parameters and the data order
    batch_size: int = 16  # global batch, in sequences
    seq_len: int = 256  # tokens per sequence (packed documents)
    log_every: int = 10  # a metrics.jsonl / TensorBoard record every n steps (and the last)
    run_dir: str = "runs/default"  # config.yaml, metrics, checkpoints and plots go here
    progress: bool = True  # a line per logged step on stderr (above a live bar on a terminal); false = quiet
    resume: str = "auto"  # auto (latest complete checkpoint in run_dir) | never | a step number
    on_nan: OnNaN = "stop"  # stop (error naming the step) | skip (drop that step's update)
    loss_chunks: int = 0  # the loss's logits in this many vocabulary pieces (at least); 0 = auto
    # Evaluation: the loss on the validation split of prepared shards (prepare --val-fraction),
    # without gradients, on the training mesh; the same batches every time, logged as eval_loss.
    eval_every: int = 0  # evaluate every n steps and at the last step (0 = never)
    eval_batches: int = 8  # batches of train.batch_size sequences per evaluation
    # A jax.profiler trace of steps first..last (both included) into run_dir/profile, for
    # TensorBoard's profile plugin or Perfetto (ui.perfetto.dev); null = no trace.
    profile_steps: list[int] | None = None  # [first, last] steps to trace (see above)
    # Start from existing weights: a run directory (its newest intact checkpoint's params) or a
    # Hugging Face model directory (python -m jaxpar.convert), or a Hub model id ORG/NAME (its
    # default branch, through huggingface_hub's cache: jaxpar.hf.hub; the run records the snapshot's
    # directory); the model's shape and tokenizer come from there, the optimizer state is fresh and
    # the run starts at step 0. Ignored on resume.
    init_from: str | None = None  # a run directory, a Hugging Face model directory or Hub id (see above)


@dataclass
class LoRAConfig:
    """Low-rank adapters (Hu et al. 2021, "LoRA"): each targeted projection W becomes
    y = x W + (alpha / rank) * x A B, A [in, rank], B [rank, out]; B starts at zero, so
    step 0 computes the base model. Only A and B train: the base weights get no gradient and no
    optimizer state (jaxpar/models/lora.py), and checkpoints hold the adapters alone, naming the
    base (jaxpar/hf/base.py). Meant with train.init_from (the base); without it the frozen base is
    the random init of train.seed, which is allowed (tests do it) but learns only through the
    adapters."""

    rank: int = 0  # adapter rank r; 0 = no LoRA (every weight trains)
    alpha: float = 16.0  # the adapters' output is scaled by alpha / rank (as PEFT's lora_alpha)
    dropout: float = 0.0  # on the adapters' input, training only (PEFT's); [0, 1), 0 with mesh.pipe > 1
    # q, k, v, o: attention projections; gate, up, down: the dense MLP's (not MoE experts)
    targets: list[LoRATarget] = field(
        default_factory=lambda: ["q", "k", "v", "o"]
    )  # projections adapted (see above)


@dataclass
class FinetuneConfig:
    lora: LoRAConfig = field(default_factory=LoRAConfig)  # low-rank adapters (off while rank = 0)


@dataclass
class CheckpointConfig:
    every: int = 100  # save every n steps and at the end (0 = only on preemption)
    keep: int = 3  # newest checkpoints to keep


@dataclass
class DistributedConfig:
    """Multi-process runs (jax.distributed). Each key also comes from the environment:
    JAXPAR_COORDINATOR, JAXPAR_NUM_PROCESSES, JAXPAR_PROCESS_ID (set by `python -m jaxpar.launch`)."""

    coordinator: str | None = None  # host:port of process 0; None = single process
    num_processes: int | None = None  # processes in the run (with coordinator)
    process_id: int | None = None  # this process's index, 0 .. num_processes - 1
    auto: bool = False  # let JAX detect the cluster (SLURM, Kubernetes, Cloud TPU, MPI)
    # How long a process waits at start for the coordinator and every other process to join;
    # then it stops with one line and exit code 2 (jaxpar/mesh.py).
    timeout_s: float = 300.0  # seconds to wait for the coordinator and the other processes


@dataclass
class RuntimeConfig:
    cpu_devices: int = 8  # on a CPU-only machine, emulate this many devices (1 = plain run)
    # On a CPU, a run predicted to need more host memory than this is refused (exit 3) before it
    # compiles (jaxpar/planning/host.py); None = what the kernel reports as available (MemAvailable).
    host_memory_gib: float | None = None  # GiB of RAM this run may take on a CPU (see above)


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)  # the network
    mesh: MeshConfig = field(default_factory=MeshConfig)  # device mesh axis sizes
    parallel: ParallelConfig = field(default_factory=ParallelConfig)  # how the axes are used
    data: DataConfig = field(default_factory=DataConfig)  # corpus and tokenizer
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)  # update rule and schedule
    train: TrainConfig = field(default_factory=TrainConfig)  # the loop
    finetune: FinetuneConfig = field(default_factory=FinetuneConfig)  # parameter-efficient fine-tuning
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)  # saving
    distributed: DistributedConfig = field(default_factory=DistributedConfig)  # multi-process
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)  # the local machine


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


def _trailing_comments(cls) -> dict[str, str]:
    """{field name: the comment on its line(s)} in the source of dataclass `cls`."""
    source = textwrap.dedent(inspect.getsource(cls))
    at_line = {
        tok.start[0]: tok.string.lstrip("#").strip()
        for tok in tokenize.generate_tokens(io.StringIO(source).readline)
        if tok.type == tokenize.COMMENT
    }

    def comment(node):
        return " ".join(at_line[n] for n in range(node.lineno, node.end_lineno + 1) if n in at_line)

    return {
        node.target.id: comment(node)
        for node in ast.parse(source).body[0].body
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
    }


def settings_help(cls=None, prefix: str = "") -> str:
    """Every setting, one line each: `dotted.key=default  comment`, read from the dataclasses
    here (their defaults and the comment on each field's line): what `--help` prints."""
    cls = Config if cls is None else cls
    comments, lines = _trailing_comments(cls), []
    defaults = cls()
    for f in dataclasses.fields(cls):
        sub = _dataclass_type(cls, f)
        if sub is not None:
            lines.append(f"{prefix}{f.name}: {comments.get(f.name, '')}".rstrip(": "))
            lines.append(settings_help(sub, f"{prefix}{f.name}."))
            continue
        default = getattr(defaults, f.name)
        shown = "null" if default is None else str(default).lower() if isinstance(default, bool) else default
        comment = comments.get(f.name, "").replace("(see above)", "(see jaxpar/config.py)")
        lines.append(f"  {prefix}{f.name}={shown}".ljust(44) + f"  {comment}".rstrip())
    return "\n".join(lines)


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


def _keeps_text(hint: Any) -> bool:
    """Whether a command-line value for `hint` stays as typed ("on", "2024", "1f1b") instead of
    being read as a YAML scalar: str settings, and Literals whose choices are all strings."""
    if typing.get_origin(hint) is Literal:
        return all(isinstance(choice, str) for choice in typing.get_args(hint))
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        return any(_keeps_text(option) for option in typing.get_args(hint))
    return hint is str


def _coerce(key: str, value: Any, hint: Any) -> Any:
    """Checks `value` against the annotation `hint`: int, float, str, bool, Literal, X | None."""
    if isinstance(value, _Override):
        value = value.text if _keeps_text(hint) and value.value is not None else value.value
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        options = typing.get_args(hint)
        if value is None and type(None) in options:
            return None
        (inner,) = [t for t in options if t is not type(None)]
        return _coerce(key, value, inner)
    if typing.get_origin(hint) is list:
        if not isinstance(value, list):
            raise ConfigError(f"{key}: expected a list, got {value!r} ({type(value).__name__})")
        (item,) = typing.get_args(hint)
        return [_coerce_item(f"{key}[{i}]", v, item) for i, v in enumerate(value)]
    if typing.get_origin(hint) is Literal:
        choices = typing.get_args(hint)
        # Compared with the type: True == 1 and 1.0 == 1, but neither is the choice 1.
        if any(type(value) is type(choice) and value == choice for choice in choices):
            return value
        raise ConfigError(f"{key}={value!r}: choose one of {', '.join(map(str, choices))}")
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if hint is float and isinstance(value, str):
        try:  # YAML 1.1 reads "3e-4" as a string
            return float(value)
        except ValueError:
            pass
    if isinstance(value, hint) and not (hint is int and isinstance(value, bool)):
        return value
    raise ConfigError(f"{key}: expected {hint.__name__}, got {value!r} ({type(value).__name__})")


def _coerce_item(key: str, value: Any, item: Any) -> Any:
    """One element of a list setting: a plain value, or a dataclass given as a mapping of its
    fields (data.sources' {path, weight}); errors name the element, e.g. data.sources[1].weight."""
    if not dataclasses.is_dataclass(item):
        return _coerce(key, value, item)
    fields = dataclasses.fields(item)
    takes = ", ".join(f.name for f in fields)
    if isinstance(value, item):  # built in Python
        check_types(value, key + ".")
        return value
    if not isinstance(value, dict):
        raise ConfigError(f"{key}: expected a mapping of {takes}, got {value!r}")
    for name in value:
        if name not in {f.name for f in fields}:
            raise ConfigError(f"{key}: unknown key '{name}'; it takes {takes}")
    for f in fields:
        required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        if required and f.name not in value:
            raise ConfigError(f"{key}: '{f.name}' is missing; it takes {takes}")
    hints = typing.get_type_hints(item)
    return item(**{name: _coerce(f"{key}.{name}", v, hints[name]) for name, v in value.items()})


def check_types(obj: Any, prefix: str = "") -> None:
    """Every setting of `obj` (a Config or one of its sections) against its annotation, as
    loading checks them: for configs built or changed in Python rather than loaded."""
    hints = typing.get_type_hints(type(obj))
    for f in dataclasses.fields(obj):
        value, key = getattr(obj, f.name), prefix + f.name
        if dataclasses.is_dataclass(hints[f.name]):
            if not isinstance(value, hints[f.name]):
                raise ConfigError(f"{key}: expected {hints[f.name].__name__}, got {value!r}")
            check_types(value, key + ".")
        else:
            _coerce(key, value, hints[f.name])


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
    if isinstance(value, dict) and isinstance(node.get(parts[-1]), dict):
        return  # an empty section={} adds nothing to what is already set
    node[parts[-1]] = value


def _merge(base: dict, extra: dict) -> dict:
    out = dict(base)
    for k, v in extra.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def load_yaml(path: str) -> dict:
    if os.path.isdir(path):
        raise ConfigError(f"config file '{path}' is a directory; give a YAML file, e.g. configs/tiny.yaml")
    if not os.path.isfile(path):
        raise ConfigError(f"config file '{path}' does not exist{_similar_config(path)}")
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


def _similar_config(path: str) -> str:
    """ "; did you mean 'configs/gpt2-124m.yaml'?" for a missing YAML file with a close name in its
    folder or in the presets folder beside the package; "" when none is close."""
    folder = os.path.dirname(path) or "."
    presets = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs")
    for where in (folder, presets):
        if not os.path.isdir(where):
            continue
        names = sorted(n for n in os.listdir(where) if n.endswith((".yaml", ".yml")))
        close = difflib.get_close_matches(os.path.basename(path), names, n=1, cutoff=0.7)
        if close:
            shown = os.path.join(folder if where == folder else os.path.relpath(where), close[0])
            return f"; did you mean '{shown}'?"
    return ""


def _dashed(arg: str) -> ConfigError:
    bare = arg.lstrip("-")
    return ConfigError(
        f"argument '{arg}': settings are written without dashes, as dotted.key=value "
        f"(e.g. {bare if '=' in bare else 'train.steps=10'}); --help lists them all"
    )


def parse_overrides(overrides: list[str]) -> dict:
    """`["train.steps=20", "mesh.data=-1"]` -> nested dict, values parsed as YAML scalars."""
    tree: dict = {}
    for item in overrides:
        if item.startswith("-"):
            raise _dashed(item)
        if "=" not in item:
            raise ConfigError(f"override '{item}' is not of the form dotted.key=value")
        key, raw = item.split("=", 1)
        try:
            value = yaml.safe_load(raw) if raw else None
        except yaml.YAMLError as e:
            raise ConfigError(f"override '{item}': value does not parse: {e}") from None
        if isinstance(value, dict):  # section={key: value, ...}: merged key by key, in order
            _set_mapping(tree, key.strip(), value)
        else:
            _set_dotted(tree, key.strip(), _Override(raw, value))
    return tree


def _set_mapping(tree: dict, key: str, mapping: dict) -> None:
    """`train={steps: 5}` sets train.steps like `train.steps=5` would, keeping the other train.*
    overrides given before or after it (the values are typed as in a YAML file)."""
    if not mapping:
        _set_dotted(tree, key, {})
    for name, value in mapping.items():
        if isinstance(value, dict):
            _set_mapping(tree, f"{key}.{name}", value)
        else:
            _set_dotted(tree, f"{key}.{name}", value)


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


def reduce_dtype(cfg: Config) -> str:
    """The dtype the weight gradients are reduced across devices in: parallel.grad_reduce_dtype
    when set, else bfloat16 for a bfloat16 model and float32 for any other (float16 sums of
    gradients overflow, and a float32 model is asked for to be exact)."""
    chosen = cfg.parallel.grad_reduce_dtype
    if chosen is not None:
        return chosen
    return "bfloat16" if cfg.model.dtype == "bfloat16" else "float32"


def precision_line(cfg: Config) -> str:
    """The start-up line's account of precision: compute and weights, and the dtype the weight
    gradients are reduced across devices in, with where that came from."""
    m, reduced = cfg.model, reduce_dtype(cfg)
    why = "parallel.grad_reduce_dtype" if cfg.parallel.grad_reduce_dtype else f"model.dtype={m.dtype}'s"
    return f"precision: compute {m.dtype}, weights {m.param_dtype}, gradients reduced in {reduced} ({why})"


def resolve_paths(cfg: Config) -> Config:
    """The config with its file paths made absolute (data.source, data.sources' paths,
    data.tokenizer, train.run_dir, train.init_from), as the run's config.yaml stores them:
    `sample`, `export` or a reused config then find the same files from any directory."""
    d, t = cfg.data, cfg.train
    absolute = lambda path: os.path.abspath(os.path.expanduser(path))
    sources = (
        None if d.sources is None else [dataclasses.replace(s, path=absolute(s.path)) for s in d.sources]
    )
    data = dataclasses.replace(
        d,
        source=d.source if d.source == "stdlib" else absolute(d.source),
        sources=sources,
        tokenizer=d.tokenizer if d.tokenizer == "byte" else absolute(d.tokenizer),
        chat_template=(
            d.chat_template if d.chat_template in (None, *CHAT_TEMPLATES) else absolute(d.chat_template)
        ),
    )
    init_from = None if t.init_from is None else absolute(t.init_from)
    return dataclasses.replace(
        cfg, data=data, train=dataclasses.replace(t, run_dir=absolute(t.run_dir), init_from=init_from)
    )


def to_dict(cfg: Config) -> dict:
    return dataclasses.asdict(cfg)


def dump_yaml(cfg: Config, path: str) -> None:
    with open(path, "w") as f:
        yaml.safe_dump(to_dict(cfg), f, sort_keys=False)


def parse_cli(argv: list[str]) -> tuple[str | None, list[str]]:
    """`[CONFIG.yaml] [key=value ...]` -> (config path or None, overrides)."""
    path = None
    for arg in argv:
        if arg.startswith("-"):
            raise _dashed(arg)
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


def data_files(data: DataConfig) -> list[str]:
    """The files a non-stdlib source names (a path or a glob), sorted; error if there are none."""
    source = os.path.expanduser(data.source)
    if os.path.isdir(source):
        text, jsonl = os.path.join(data.source, "*.txt"), os.path.join(data.source, "**", "*.jsonl")
        raise ConfigError(
            f"data.source='{data.source}' is a directory; name its files with a glob, e.g. "
            f"data.source='{text}' or '{jsonl}'"
            ", or give a directory of prepared shards (python -m jaxpar.data prepare SOURCES --out DIR)"
        )
    files = sorted(p for p in glob.glob(source, recursive=True) if os.path.isfile(p))
    if not files:
        raise ConfigError(f"data.source='{data.source}': no such file (or nothing matches the glob)")
    return files


def source_names(data: DataConfig) -> list[str]:
    """The metrics' name of each of data.sources: its `name`, else its directory's name."""
    return [
        s.name if s.name is not None else os.path.basename(os.path.normpath(s.path))
        for s in data.sources or []
    ]


def _prepared(path: str, key: str) -> bool:
    """Whether `path` (setting `key`) is a finished directory of prepared shards; an unfinished
    one is an error (resume it). Their contents are checked when opened (jaxpar.corpus.shards)."""
    path = os.path.expanduser(path)
    if os.path.isfile(os.path.join(path, "manifest.json")):
        return True
    if os.path.isfile(os.path.join(path, "prepare.json")):
        raise ConfigError(
            f"{key}='{path}' has no manifest.json: its preparation did not finish; run the same "
            "`python -m jaxpar.data prepare` command again, it resumes"
        )
    return False


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


def _validate_moe(cfg: Config, sizes: dict[str, int]) -> None:
    moe, m = cfg.model.moe, cfg.model
    if moe.num_experts == 0:
        return
    if moe.num_experts < 0 or not 1 <= moe.top_k <= moe.num_experts:
        raise ConfigError(
            f"model.moe.top_k={moe.top_k} must be between 1 and model.moe.num_experts={moe.num_experts}"
        )
    if moe.every < 1 or m.n_layers % moe.every:
        raise ConfigError(
            f"model.moe.every={moe.every} must divide model.n_layers={m.n_layers} (an MoE MLP in "
            f"every {moe.every}-th block); try every in {_divisors(m.n_layers)}"
        )
    _require_divides("mesh.expert", sizes["expert"], "model.moe.num_experts", moe.num_experts)
    _require_divides("mesh.tensor", sizes["tensor"], "model.moe.d_ff", moe.d_ff or m.d_ff)
    if moe.capacity_factor is not None and moe.capacity_factor <= 0:
        raise ConfigError(
            f"model.moe.capacity_factor={moe.capacity_factor}: use a positive "
            "number, or null for dropless routing"
        )
    if moe.shared_experts < 0:
        raise ConfigError(f"model.moe.shared_experts={moe.shared_experts} must be 0 or more")
    if moe.dispatch == "ragged" and moe.capacity_factor is not None:
        raise ConfigError(
            f"model.moe.dispatch=ragged is dropless but model.moe.capacity_factor="
            f"{moe.capacity_factor}: set model.moe.capacity_factor=null, or use "
            "model.moe.dispatch=padded for capacity routing"
        )
    if moe.dispatch == "ragged" and m.fp8:
        raise ConfigError(
            "model.moe.dispatch=ragged has no float8 grouped GEMM: with model.fp8=true "
            "use model.moe.dispatch=padded (or auto, which picks it)"
        )
    if moe.ragged_buffer_factor is not None:
        if not moe.ragged_buffer_factor >= 1:
            raise ConfigError(
                f"model.moe.ragged_buffer_factor={moe.ragged_buffer_factor}: use a number >= 1 "
                "(1 = the balanced load tokens * top_k), or null for the worst case"
            )
        if moe.dispatch == "padded" or moe.capacity_factor is not None:
            raise ConfigError(
                f"model.moe.ragged_buffer_factor={moe.ragged_buffer_factor} sizes the ragged "
                f"dispatch's buffer, but model.moe.dispatch={moe.dispatch} and "
                f"model.moe.capacity_factor={moe.capacity_factor} route padded; set it to null, "
                "or use model.moe.dispatch=ragged (or auto on GPU) with capacity_factor=null"
            )


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
    try:
        validate_pipeline(
            par.pipeline_schedule, p, par.microbatches, par.virtual_stages, layers=cfg.model.n_layers
        )
    except ValueError as e:
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
    if moe.num_experts and (cfg.model.n_layers // moe.every) % chunks:
        # The layer scan repeats groups of model.moe.every blocks (one MoE block each); a
        # pipeline chunk holds whole groups.
        layers = cfg.model.n_layers
        fits = [e for e in _divisors(layers) if (layers // e) % chunks == 0]
        raise ConfigError(
            f"model.n_layers={layers} / model.moe.every={moe.every} = {layers // moe.every} "
            f"MoE groups do not split over mesh.pipe={p} x parallel.virtual_stages="
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


INT32_MAX = 2**31 - 1  # the train state's step counters are int32


def validate_runtime(cfg: Config) -> None:
    """What must hold before the backend starts (`jaxpar.mesh.emulate_cpu_devices` uses it)."""
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


def validate(cfg: Config, num_devices: int) -> dict[str, int]:
    """Checks the whole config against itself and the device count; returns the mesh sizes.
    The checks run in a fixed order (the first failure is the one reported): types, the mesh,
    the run's own settings, the optimizer, counts, the model's shape, how the layout splits it,
    MoE routing, the pipeline, ring attention and the loss chunks, then the data."""
    check_types(cfg)  # the Literal choices included: the annotations are their only list
    validate_runtime(cfg)
    sizes = resolve_mesh(cfg.mesh, num_devices)
    _validate_run(cfg)
    _validate_optimizer(cfg.optimizer)
    _validate_counts(cfg)
    _validate_model(cfg)
    _validate_window(cfg, sizes)
    _validate_splits(cfg, sizes)
    _validate_moe(cfg, sizes)
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


def _validate_model(cfg: Config) -> None:
    """The model's shape on its own: heads, head width, rotary scaling, sequence length."""
    m, t = cfg.model, cfg.train
    if m.n_heads % m.n_kv_heads:
        raise ConfigError(
            f"model.n_heads={m.n_heads} is not divisible by model.n_kv_heads={m.n_kv_heads}; "
            f"try n_kv_heads in {_divisors(m.n_heads)}"
        )
    for key, value in (
        ("model.attn_scale_dim", m.attn_scale_dim),
        ("model.rope_local_theta", m.rope_local_theta),
    ):
        if value is not None and not value > 0:
            raise ConfigError(f"{key}={value}: must be positive (or null)")
    if m.head_dim is None:
        _require_divides("model.n_heads", m.n_heads, "model.d_model", m.d_model)
    elif m.head_dim < 2:
        raise ConfigError(f"model.head_dim={m.head_dim}: must be at least 2 (or null: d_model / n_heads)")
    if m.head_width % 2:
        what = "model.head_dim" if m.head_dim else "model.d_model/model.n_heads"
        raise ConfigError(f"{what} = {m.head_width} is odd; rotary embeddings need an even head dimension")
    rs = m.rope_scaling
    if rs.type == "linear" and not rs.factor > 0:
        raise ConfigError(f"model.rope_scaling: factor={rs.factor}; linear scaling needs factor > 0")
    if rs.type == "llama3" and not (
        rs.factor >= 1 and 0 < rs.low_freq_factor < rs.high_freq_factor and rs.original_max_len >= 1
    ):
        raise ConfigError(
            f"model.rope_scaling: factor={rs.factor}, low_freq_factor={rs.low_freq_factor}, "
            f"high_freq_factor={rs.high_freq_factor}, original_max_len={rs.original_max_len}; "
            "llama3 scaling needs factor >= 1, 0 < low_freq_factor < high_freq_factor and "
            "original_max_len >= 1"
        )
    if t.seq_len > m.max_seq_len:
        raise ConfigError(
            f"train.seq_len={t.seq_len} is above model.max_seq_len={m.max_seq_len}; "
            f"lower train.seq_len or raise model.max_seq_len"
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
        _require_divides("mesh.tensor", tensor, dim_key, dim)
    if p.zero_stage > 0:
        _require_divides("mesh.fsdp", sizes["fsdp"], "model.d_model", m.d_model)
    if p.sequence_parallel:
        _require_divides("mesh.tensor", tensor * sizes["context"], "train.seq_len", t.seq_len)


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
