"""Every setting of a run: typed dataclasses, YAML presets, dotted overrides.

A run's config is built in three layers: the dataclass defaults (the embedded default job), an
optional YAML file, then `dotted.key=value` overrides whose values are parsed as YAML scalars.
Every setting is annotated with its type; a setting with a fixed set of values is a `Literal`,
and loading checks each value against its annotation (`_coerce`), so a wrong type or an unknown
choice stops with a `ConfigError` that names the key, the value and the choices.

Loading checks each setting alone; `jaxpar.checks.validate` then checks the config against
itself and the device count, before anything is compiled.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Literal

import yaml

MESH_AXES = ("pipe", "data", "fsdp", "expert", "context", "tensor")

# The settings with a fixed set of values: each a Literal, checked by `_coerce` when loaded and
# again by `jaxpar.checks.validate`; these annotations are the config's only list of the choices.
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
RopeScaling = Literal["none", "llama3", "linear", "yarn"]
MoEDispatch = Literal["auto", "padded", "ragged"]
MoEScore = Literal["softmax", "sigmoid"]
LoRATarget = Literal["q", "k", "v", "o", "gate", "up", "down"]
WandbMode = Literal["online", "offline", "disabled"]


class ConfigError(ValueError):
    """A problem with the user's configuration; the CLI prints it and exits with code 2."""


@dataclass
class MoEConfig:
    num_experts: int = 0  # 0 = dense model (no MoE layers)
    top_k: int = 2  # experts per token
    norm_topk: bool = True  # top_k > 1: the chosen experts' probs renormalised to sum 1 (Mixtral)
    every: int = 1  # an MoE MLP every n-th block (1 = all blocks), dense MLP elsewhere
    first_dense: int = 0  # leading blocks with a dense MLP of model.d_ff before the MoE ones (DeepSeek-V3)
    dense_layers: list[int] = field(default_factory=list)  # more dense-MLP blocks, by index (mlp_only_layers)
    capacity_factor: float | None = None  # None = dropless; else slots = cf * tokens * top_k / E
    shared_experts: int = 0  # always-on experts (DeepSeek style), added to the routed output
    d_ff: int | None = None  # expert hidden size; None = model.d_ff
    aux_loss_weight: float = 0.01  # load-balancing loss (Switch Transformer)
    z_loss_weight: float = 0.001  # router z-loss (ST-MoE)
    score: MoEScore = "softmax"  # router scores: softmax | sigmoid (DeepSeek-V3; docs/experts.md)
    groups: int = 1  # expert groups; > 1: pick from the topk_groups best (top-2 sum) groups
    topk_groups: int = 1  # groups a token may pick from (groups > 1)
    routed_scale: float = 1.0  # routed experts' weights times this (routed_scaling_factor)
    bias_update_rate: float = 0.0  # sigmoid: bias += rate*sign(mean-load) each step; 0 = off
    seq_aux_loss_weight: float = 0.0  # DeepSeek-V3 sequence-wise balance loss (alpha)
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
    interpolated. "linear" (Gemma 3's global layers): every frequency divided by `factor`.
    "yarn" (DeepSeek-V3): frequencies blended between kept and divided by `factor` over the band
    beta_fast..beta_slow rotations in original_max_len, the rotated parts scaled by mscale(factor,
    mscale) / mscale(factor, mscale_all_dim) and the logits by mscale(factor, mscale_all_dim)^2."""

    type: RopeScaling = "none"  # none | llama3 | linear | yarn
    factor: float = 8.0  # llama3, linear, yarn: how much longer the context became
    low_freq_factor: float = 1.0  # llama3: low-frequency band edge
    high_freq_factor: float = 4.0  # llama3: high-frequency band edge
    original_max_len: int = 8192  # llama3, yarn: the context length the model was pre-trained with
    beta_fast: float = 32.0  # yarn: rotations (in original_max_len) above which frequencies are kept
    beta_slow: float = 1.0  # yarn: rotations below which frequencies are divided by factor
    mscale: float | None = None  # yarn: null = the rotated parts scaled by mscale(factor, 1)
    mscale_all_dim: float | None = None  # yarn: null = no logit scale, mscale alone unused


@dataclass
class MLAConfig:
    """Multi-head latent attention (DeepSeek-V2/V3): keys and values through a shared latent."""

    kv_lora_rank: int = 0  # the key/value latent's width (the cache's); 0 = off (GQA attention)
    q_lora_rank: int | None = None  # the query latent's width; null = one q projection
    qk_nope_dim: int = 128  # each head's query/key width without rotation
    qk_rope_dim: int = 64  # each head's rotated query width; the rotated key is one shared head
    v_head_dim: int = 128  # each head's value width
    rope_interleave: bool = False  # only the Hugging Face layout of rotated dims (families/deepseek_v3.py)
    ring_latent: bool = False  # context ring passes latents, expanded on arrival (parallel/latent_ring.py)


@dataclass
class MTPConfig:
    """DeepSeek-V3 multi-token prediction: extra modules after the model, training only."""

    depth: int = 0  # D: modules predicting tokens 2..D+1 ahead; 0 = off (jaxpar/models/mtp.py)
    weight: float = 0.3  # lambda: the loss adds lambda times the mean of the D depth losses


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
    mla: MLAConfig = field(default_factory=MLAConfig)  # latent attention (off by default)
    mtp: MTPConfig = field(default_factory=MTPConfig)  # multi-token prediction (off by default)

    @property
    def head_width(self) -> int:
        """The width of one attention head, model.head_dim or else d_model / n_heads (a query/key
        head's under latent attention, model.mla): every use reads it here."""
        if self.mla.kv_lora_rank:
            return self.mla.qk_nope_dim + self.mla.qk_rope_dim
        return self.head_dim or self.d_model // self.n_heads

    def slides(self, layer: int) -> bool:
        """Whether layer `layer` (from 0) attends within model.sliding_window: all but every
        model.global_every-th layer (the last of each run) when there is a window; every use
        reads it here."""
        every = self.global_every
        return self.sliding_window is not None and (every == 0 or (layer + 1) % every != 0)

    def moe_kinds(self) -> tuple[bool, ...]:
        """Whether each layer has an MoE MLP (else a dense one of model.d_ff): none in a dense
        model; after the model.moe.first_dense leading dense layers, the last of every
        model.moe.every, unless model.moe.dense_layers names it. Every use reads it here."""
        moe, dense = self.moe, set(self.moe.dense_layers)
        if moe.num_experts == 0:
            return (False,) * self.n_layers
        every = max(moe.every, 1)
        return tuple(
            i >= moe.first_dense and (i - moe.first_dense + 1) % every == 0 and i not in dense
            for i in range(self.n_layers)
        )

    def irregular_moe(self) -> bool:
        """Whether model.moe.dense_layers makes a layer dense that the first_dense / every pattern
        gives experts: the model then stacks its dense blocks and its MoE blocks apart and runs
        them in runs of one kind (`jaxpar.models.llama`), where the pattern scans groups."""
        if not (self.moe.num_experts and self.moe.dense_layers):
            return False
        pattern = dataclasses.replace(self, moe=dataclasses.replace(self.moe, dense_layers=[]))
        return self.moe_kinds() != pattern.moe_kinds()


@dataclass
class MeshConfig:
    """Device mesh, outermost axis first. One axis may be -1: it takes the remaining devices.
    `mesh: auto` (or an axis set to auto) leaves the axes to the planner (`auto_axes`)."""

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
class WandbConfig:
    """Weights & Biases beside metrics.jsonl and TensorBoard (jaxpar/training/wandb_log.py): process 0
    logs every metrics.jsonl record at its step, and the config with the layout; a resumed run
    continues its W&B run. Without the wandb package or a login, one line says so and the run
    goes on without it."""

    project: str = ""  # the W&B project to log to; "" = no W&B
    entity: str = ""  # the W&B team or user; "" = the login's default entity
    name: str = ""  # the W&B run's display name; "" = the run directory's name
    # online: to the W&B server (needs `wandb login` or WANDB_API_KEY); offline: files under
    # run_dir/wandb/ (or WANDB_DIR) to upload later with `wandb sync`; disabled: nothing. This
    # setting, not WANDB_MODE, decides.
    mode: WandbMode = "online"  # online | offline | disabled (see above)
    tags: list[str] = field(default_factory=list)  # the W&B run's tags, each 1 to 64 characters


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
    wandb: WandbConfig = field(default_factory=WandbConfig)  # Weights & Biases (off while project is "")


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
    # JAX's persistent compilation cache: programs compiled once are loaded from this directory
    # by later processes (a restart, the next run, inspect). auto: JAX_COMPILATION_CACHE_DIR when
    # set (JAX's cache left as the environment configured it), else $JAXPAR_CACHE/compile
    # (~/.cache/jaxpar/compile); a directory; off. jaxpar/mesh.py (use_compile_cache) sets it. The
    # bound below holds for jaxpar's caches, not for one the environment configured.
    compile_cache: str = "auto"  # auto | a directory | off (see above)
    auto_candidates: int = 3  # mesh: auto compiles this many of the planner's best layouts here first
    compile_cache_gib: float = 4.0  # GiB the cache may hold; the least recently used go first (see above)


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
        sub = dataclass_type(cls, f)
        keys.append(prefix + f.name)
        if sub is not None:
            keys += _all_keys(sub, prefix + f.name + ".")
    return keys


def dataclass_type(cls, f) -> type | None:
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
    quote = (  # YAML 1.1's booleans: `compile_cache: off` in a file reads as False
        "; YAML reads a bare off, on, yes or no as a boolean: quote the word, e.g. 'off'"
        if hint is str and isinstance(value, bool)
        else ""
    )
    raise ConfigError(f"{key}: expected {hint.__name__}, got {value!r} ({type(value).__name__}){quote}")


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
        sub = dataclass_type(cls, names[name])
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
        if key.strip() == "mesh" and value == "auto":  # every axis auto; a later mesh.<axis> pins one
            _set_mapping(tree, "mesh", dict.fromkeys(MESH_AXES, "auto"))
        elif isinstance(value, dict):  # section={key: value, ...}: merged key by key, in order
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
    if values.get("mesh") == "auto":
        values["mesh"] = dict.fromkeys(MESH_AXES, "auto")
    return _merge(values, parse_overrides(list(overrides)))


def auto_axes(settings: dict) -> tuple[dict, list[str]]:
    """(`settings` with the mesh axes left to the planner set to 1 and one of them to -1, a
    placeholder `jaxpar.planning.auto` replaces; those axes). Once one axis is auto, so is every
    axis not set: the defaults' 2 x 2 x 2 is the default job's, not a choice."""
    auto = lambda v: (v.value if isinstance(v, _Override) else v) == "auto"
    mesh = settings.get("mesh")
    if not isinstance(mesh, dict) or not any(auto(v) for v in mesh.values()):
        return settings, []
    axes = [a for a in MESH_AXES if a not in mesh or auto(mesh[a])]
    fill = "data" if "data" in axes else axes[0]
    return {**settings, "mesh": {**mesh, **{a: -1 if a == fill else 1 for a in axes}}}, axes


def build_config(settings: dict) -> Config:
    """The defaults with `settings` (from `user_settings`) applied; type-checked, not validated."""
    return _build(Config, auto_axes(settings)[0])


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
