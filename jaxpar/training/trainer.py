"""The trainer: the layout, the born-sharded state and the jitted train step of a config,
built once (`build_trainer`) and shared by everything that trains, compiles or restores a run:
the training loop (jaxpar.train), compiling without running (jaxpar.inspect, jaxpar.plan's
verification, benchmarks/bench.py) and reading a run's weights (jaxpar.export).

The data path is one way: config -> mesh -> sharded state (born sharded, inside a jitted init)
-> jitted train step (state, batch) -> (state, metrics). Where cuDNN's packed attention runs, the
training loop picks the step per batch instead (`Trainer.step_for`): one compiled for as many
document slots as the batch's fullest row needs, rounded up to a bucket. This module imports no
command line.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxpar import config as config_lib
from jaxpar import sharding as sharding_lib
from jaxpar.compiled import targets as targets_lib
from jaxpar.config import Config
from jaxpar.models import lora as lora_lib
from jaxpar.models import mtp as mtp_lib
from jaxpar.models import objective as objective_lib
from jaxpar.models.attention import kernel_for, slot_bucket
from jaxpar.models.llama import Transformer, check_documents
from jaxpar.models.loss import loss_chunks
from jaxpar.ops import fp8 as fp8_lib
from jaxpar.parallel import pipeline as pipeline_lib
from jaxpar.parallel import schedule as schedule_lib
from jaxpar.parallel.ring_attention import permute_to_layout
from jaxpar.training.optim import lr_schedule, make_optimizer

# --- The learning-rate schedule on resume ------------------------------------------------

BATCH_KEYS = ("inputs", "targets", "positions", "segment_ids", "loss_mask")


# --- Building the sharded state and the step ----------------------------------------------


@dataclass
class Trainer:
    """Everything needed to run (or only compile) training on one mesh."""

    cfg: Config  # resolved: model.attention is concrete for the layout's devices
    layout: sharding_lib.Layout  # the mesh and the rules of params, grads, optimizer state, activations
    graphdef: Any  # the model's structure; params are plain nested dicts of arrays
    state_shape: Any  # tree of ShapeDtypeStructs of the train state
    state_shardings: Any
    grad_shardings: Any  # where the reduced gradients live: the optimizer state's layout (split from ZeRO-1)
    batch_sharding: NamedSharding
    init: Callable[[], Any]  # () -> state, born sharded
    step: Callable[[Any, dict], tuple[Any, dict]]  # jitted (state, batch) -> (state, metrics)
    # The same step, also returning the gradients it applied (averaged over tokens, laid out as
    # grad_shardings): what the parity tests compare leaf by leaf. Compiled only when called.
    step_with_grads: Callable[[Any, dict], tuple[Any, dict, Any]]
    # jitted (params, batch) -> (summed NLL, token count): the step's loss, no update, nothing donated
    evaluate: Callable[[Any, dict], tuple[Any, Any]]
    # finetune.lora: which params train (the adapters; the rest are frozen), else None (all train)
    trainable: lora_lib.Trainable | None = None
    # finetune.lora: () -> the adapters at their initial values, born sharded (else None)
    init_adapters: Callable[[], Any] | None = None
    # Where cuDNN's packed attention runs (model.attention cudnn, no ring): bucket k -> the train
    # step jitted for batches whose rows the host checked to hold at most k documents (k document
    # slots, no NaN poison; `llama.check_documents`). None elsewhere: one step serves all.
    checked_step: Callable[[int], Callable] | None = None
    # The checked steps made so far, by bucket (`step_for`); each compiles at its first call.
    bucket_steps: dict[int, Callable] = field(default_factory=dict)

    @property
    def mesh(self) -> Mesh:
        return self.layout.mesh

    @property
    def bucketed(self) -> bool:
        """Whether the step depends on the documents per row (`step_for`): cuDNN's packed
        attention, whose cost grows with the document slots it describes."""
        return self.checked_step is not None

    def bucket(self, documents: int) -> int | None:
        """The document slots of the step for rows of at most `documents` documents: the
        smallest of `attention.slot_buckets(model.max_documents_per_row)` that holds them; None
        where the step does not depend on them."""
        return slot_bucket(documents, self.cfg.model.max_documents_per_row) if self.bucketed else None

    def step_for(self, documents: int) -> Callable:
        """The train step for a batch whose rows hold at most `documents` documents, counted on
        the host over the whole batch (every process's rows: all must run the same program):
        the step of its slot bucket, made on first use, where the step depends on it
        (`bucketed`), else `step`. Only for batches so checked: a row with more documents than
        the bucket would be attended wrongly, and not made NaN."""
        bucket = self.bucket(documents)
        if bucket is None:
            return self.step
        if bucket not in self.bucket_steps:
            self.bucket_steps[bucket] = self.checked_step(bucket)
        return self.bucket_steps[bucket]

    def stored(self, tree: dict) -> dict:
        """The part of a train-state-shaped tree (a state, its shapes or its shardings) that a
        checkpoint holds: all of it, or with finetune.lora all but the frozen weights, which
        the checkpoint names instead (`jaxpar.hf.base`)."""
        if self.trainable is None:
            return tree
        return {**tree, "params": self.trainable.split(tree["params"])[0]}

    def shard_batch(self, local_batch: dict[str, np.ndarray]) -> dict[str, jax.Array]:
        """This process's rows -> global arrays split over (data, fsdp, expert)."""
        return {
            k: jax.make_array_from_process_local_data(self.batch_sharding, local_batch[k]) for k in BATCH_KEYS
        }

    def batch_shape(self) -> dict[str, jax.ShapeDtypeStruct]:
        t = self.cfg.train
        dtypes = {"loss_mask": jnp.float32}
        return {
            k: jax.ShapeDtypeStruct(
                (t.batch_size, t.seq_len), dtypes.get(k, jnp.int32), sharding=self.batch_sharding
            )
            for k in BATCH_KEYS
        }


def _new_model(cfg: Config, context_layout: str | None) -> Transformer:
    model = Transformer(
        cfg.model,
        rngs=nnx.Rngs(cfg.train.seed),
        remat=cfg.parallel.remat,
        context_layout=context_layout,
        grad_dtype=config_lib.reduce_dtype(cfg),
    )
    if lora_lib.enabled(cfg.finetune.lora):
        lora_lib.add_lora(model, cfg.finetune.lora, cfg.train.seed)
    return model


def new_model(cfg: Config) -> Transformer:
    """The model of `cfg` as a run builds it (with its LoRA adapters), outside any layout."""
    return _new_model(cfg, None)


def resolve_attention(cfg: Config, layout: sharding_lib.Layout, device) -> Config:
    """The config with `model.attention: auto` made concrete for `device` under this layout
    (`jaxpar.models.attention.kernel_for`); the model reads the choice from its config."""
    kernel = kernel_for(cfg.model, device, pipelined=layout.pipelined, ring=layout.ring)
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, attention=kernel))


# --- The train step, in pieces -------------------------------------------------------------


def accumulate(fn: Callable, params, batch: dict, microsteps: int):
    """fn(params, batch) summed over `microsteps` microsteps of the batch, in one `lax.scan`
    (gradient accumulation): microstep k takes rows k, k + microsteps, ... (split_microbatches),
    so every device keeps its own rows. fn's outputs (any pytree) are added leaf by leaf."""
    if microsteps == 1:
        return fn(params, batch)
    micro = pipeline_lib.split_microbatches(batch, microsteps)

    def microstep(total, rows):
        return jax.tree.map(jnp.add, total, fn(params, rows)), None

    first = jax.tree.map(lambda x: x[0], micro)
    zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), jax.eval_shape(fn, params, first))
    total, _ = jax.lax.scan(microstep, zeros, micro)
    return total


def _memory(layout: sharding_lib.Layout) -> int | None:
    """The bytes a program may use on one of the layout's devices (None: unknown), which the
    loss's automatic chunking reads (`loss.loss_chunks`)."""
    return targets_lib.device_memory(layout.mesh.devices.flat[0])


def summed_grads_fn(
    cfg: Config, layout: sharding_lib.Layout, abstract_model, trainable: lora_lib.Trainable | None = None
) -> Callable:
    """(params, batch) -> (gradients of the objective summed over the batch's tokens, the
    statistics summed likewise), over parallel.grad_accum microsteps (`accumulate`). A microstep
    is the gradient of `objective_lib.objective`, or where the layout is pipelined a pass of
    parallel.microbatches microbatches (`objective_lib.pipelined_grads`), the same objective.
    With `trainable` (LoRA) the gradients are the adapters' alone: the plain step differentiates
    only them; the pipeline's backward is written for every weight of a stage, and the frozen
    weights' gradients are dropped here, unread, so XLA removes their work (the compiled XLA:CPU
    step of configs/tiny.yaml with LoRA on all seven projections holds 65 dot ops at mesh.pipe=2
    as at mesh.data=2; jax 0.12)."""
    p = cfg.parallel
    if layout.pipelined:
        schedule = schedule_lib.build_schedule(
            p.pipeline_schedule, layout.stages, p.microbatches, p.virtual_stages
        )
        rows = cfg.train.batch_size // (p.grad_accum * p.microbatches)  # one pipeline microbatch
        microstep = functools.partial(
            objective_lib.pipelined_grads,
            abstract_model,
            schedule=schedule,
            mesh=layout.mesh,
            axis_name=layout.pipe_axis,
            loss_chunks=loss_chunks(cfg, layout.sizes, rows=rows, memory=_memory(layout)),
            # Axes over which parameters and gradients are whole: the pipeline splits rows over
            # them itself and sums once per pass.
            row_axes=layout.row_axes,
        )
        if trainable is not None:
            microstep = _adapter_part(microstep, trainable)
    else:
        objective = functools.partial(
            objective_lib.objective,
            nnx.graphdef(abstract_model),
            chunks=loss_chunks(cfg, layout.sizes, memory=_memory(layout)),
        )
        if trainable is None:
            microstep = jax.grad(objective, has_aux=True)
        else:
            microstep = lora_lib.grads_of_adapters(objective, trainable)
    return functools.partial(accumulate, microstep, microsteps=p.grad_accum)


def _adapter_part(grads_fn: Callable, trainable: lora_lib.Trainable) -> Callable:
    def adapters_only(params, batch):
        grads, aux = grads_fn(params, batch)
        return trainable.split(grads)[0], aux

    return adapters_only


def summed_nll_fn(
    cfg: Config, layout: sharding_lib.Layout, abstract_model, summed_grads: Callable
) -> Callable:
    """(params, batch) -> {"nll": summed NLL, "count": tokens} of the batch, computed as the
    step computes them (the same microsteps of the same rows), without a gradient."""
    if layout.pipelined:
        # The pipeline's loss comes from the call the step makes (its schedules hold backward
        # actions too; jaxpar.parallel.pipeline has no forward-only one). Nothing reads the
        # gradients and XLA removes their work: in the compiled XLA:CPU program of
        # configs/tiny.yaml at mesh.pipe=2 (jax 0.12.0.1) the schedule's backward branch is
        # empty and the program holds 19 dot ops, the train step 40.
        return lambda params, batch: summed_grads(params, batch)[1]
    objective = functools.partial(
        objective_lib.objective,
        nnx.graphdef(abstract_model),
        chunks=loss_chunks(cfg, layout.sizes, memory=_memory(layout)),
    )

    def nll_and_count(params, batch):
        aux = objective(params, batch)[1]
        return {"nll": aux["nll"], "count": aux["count"]}

    return functools.partial(accumulate, nll_and_count, microsteps=cfg.parallel.grad_accum)


def to_ring_layout(batch: dict, layout: sharding_lib.Layout, context_layout: str) -> dict:
    """Ring attention's sequence order (parallel.context_layout: zigzag or contiguous) over the
    devices of the layout's ring axis (`Layout.ring_size`, the axis ring attention goes round),
    applied once per step to every token array, so positions and segment ids travel with their
    tokens; the batch as it is where the layout has no ring."""
    if not layout.ring:
        return batch
    return {
        k: permute_to_layout(x, context=layout.ring_size, layout=context_layout) for k, x in batch.items()
    }


def guard_non_finite(state: dict, updated: dict, metrics: dict, on_nan: str) -> tuple[dict, dict]:
    """The step's guard, on the device: (the new state, metrics with skipped, skipped_steps and
    first_bad_step). `updated`: {params, opt_state} after this step's update.

    A step with a non-finite loss or gradient never reaches the weights: `skip` counts it and
    goes on, `stop` marks it (first_bad_step). Finite gradients can still blow the weights up (a
    huge lr): their float32 norm stops being finite (a weight inf or NaN, or beyond ~1e19 so that
    its square overflows). That is checked after the update -- gating the update on it would
    keep two copies of the weights alive -- and marks the step under both settings, since no
    later step can undo it. Once a step is marked the state stays frozen; the host, which reads
    the counters only when it logs, saves or stops (no sync per step), stops before saving
    anything after it."""
    finite = jnp.isfinite(metrics["loss"]) & jnp.isfinite(metrics["grad_norm"])
    step = state["step"] + 1
    apply = finite & (state["first_bad_step"] == 0)
    kept = jax.tree.map(
        lambda new, old: jnp.where(apply, new, old),
        updated,
        {"params": state["params"], "opt_state": state["opt_state"]},
    )
    weights_finite = jnp.isfinite(optax.tree.norm(kept["params"]))
    bad = ~weights_finite | (~finite if on_nan == "stop" else False)
    first_bad = jnp.where((state["first_bad_step"] == 0) & bad, step, state["first_bad_step"])
    skipped = state["skipped_steps"] + (~finite).astype(jnp.int32)
    metrics = {
        **metrics,
        "skipped": 1.0 - finite.astype(jnp.float32),
        "skipped_steps": skipped,
        "first_bad_step": first_bad,
    }
    return {**kept, "step": step, "skipped_steps": skipped, "first_bad_step": first_bad}, metrics


@dataclass(frozen=True, eq=False)
class StepParts:
    """What the train step and the evaluation read besides their arguments."""

    cfg: Config
    layout: sharding_lib.Layout
    optimizer: optax.GradientTransformation
    # Where the summed gradients are reduced to: the optimizer state's layout, so that ZeRO-1
    # reduce-scatters them to each device's optimizer shard as ZeRO-2/3 do (an all-reduce of
    # whole gradients, then slicing, moved twice the bytes), and ZeRO-0 all-reduces them.
    reduce_shardings: Any
    summed_grads: Callable  # `summed_grads_fn`
    summed_nll: Callable  # `summed_nll_fn`
    trainable: lora_lib.Trainable | None = None  # finetune.lora: the adapters train, the rest is frozen

    def split(self, params) -> tuple[Any, Any]:
        """(what trains, what is frozen) of the params: (all, {}) without LoRA."""
        return (params, {}) if self.trainable is None else self.trainable.split(params)

    def join(self, train, frozen):
        return train if self.trainable is None else self.trainable.join(train, frozen)

    def prepare(self, batch: dict) -> dict:
        """The batch with multi-token prediction's shifted fields (model.mtp.depth: `mtp.
        with_fields`, made in the ordinary order), then in ring attention's layout when the
        layout has a ring (`to_ring_layout`): every field travels with its tokens."""
        batch = mtp_lib.with_fields(batch, self.cfg.model.mtp.depth)
        return to_ring_layout(batch, self.layout, self.cfg.parallel.context_layout)


def with_dropout_seeds(parts: StepParts, step, batch: dict) -> dict:
    """The batch with finetune.lora.dropout's per-token seeds of train step `step` added
    (`lora.token_seeds`, laid out as the tokens), or as it is without LoRA dropout."""
    cfg = parts.cfg
    if not lora_lib.dropping(cfg.finetune.lora):
        return batch
    seeds = lora_lib.token_seeds(cfg.train.seed, step, batch["inputs"].shape)
    seeds = jax.lax.with_sharding_constraint(seeds, parts.layout.batch_sharding())
    return {**batch, lora_lib.SEEDS: seeds}


def train_step(parts: StepParts, state: dict, batch: dict) -> tuple[dict, dict, Any]:
    """One update: (new state, metrics, the gradients applied, averaged over tokens). With LoRA
    dropout the batch gains its per-token seeds here, before ring attention's permutation and
    the microsteps split it, so that they travel with their tokens."""
    cfg = parts.cfg
    batch = parts.prepare(with_dropout_seeds(parts, state["step"], batch))
    with parts.layout.scope():  # the mesh and activation rules the model's names resolve against
        grads, aux = parts.summed_grads(state["params"], batch)
    count = jnp.maximum(aux["count"], 1.0)
    # In the gradient's own dtype: a float32 count would promote bfloat16 gradients (model.
    # param_dtype=bfloat16), and the Adam moments after them, to float32 after the first step.
    grads = jax.tree.map(lambda g: (g / count).astype(g.dtype), grads)
    # ZeRO-1/2/3: pinning the gradients to the sharded layout makes XLA reduce-scatter them.
    grads = jax.lax.with_sharding_constraint(grads, parts.reduce_shardings)
    train, frozen = parts.split(state["params"])  # LoRA: the adapters, and the frozen weights
    updates, opt_state = parts.optimizer.update(grads, state["opt_state"], train)
    params = parts.join(optax.apply_updates(train, updates), frozen)
    if cfg.model.moe.bias_update_rate and "expert_load" in aux:  # loss-free balancing
        params = mtp_lib.update_router_bias(params, aux, cfg.model.moe.bias_update_rate)
    metrics = {
        "loss": aux["nll"] / count,
        "grad_norm": optax.tree.norm(grads),
        # optax's count of updates
        "lr": lr_schedule(cfg)(state["step"] - state["skipped_steps"]),
        "tokens": count,
    }
    if "expert_load" in aux:
        accum = cfg.parallel.grad_accum
        metrics.update({k: aux[k] / accum for k in objective_lib.MOE_MEANS if k in aux})
        metrics["expert_load_min"] = jnp.min(aux["expert_load"])
        metrics["expert_load_max"] = jnp.max(aux["expert_load"])
    for k in range(1, cfg.model.mtp.depth + 1):  # each depth's mean loss over its valid targets
        metrics[f"mtp_loss_{k}"] = aux[f"mtp_nll_{k}"] / count
    new_state, metrics = guard_non_finite(
        state, {"params": params, "opt_state": opt_state}, metrics, cfg.train.on_nan
    )
    return new_state, metrics, grads


def eval_step(parts: StepParts, params, batch: dict):
    """The training loss of `batch` under these params (train.eval_every), nothing updated:
    (summed NLL, token count)."""
    batch = parts.prepare(batch)
    with parts.layout.scope():
        aux = parts.summed_nll(params, batch)
    return aux["nll"], aux["count"]


def build_trainer(cfg: Config, sizes: dict[str, int], devices=None) -> Trainer:
    """Layout, shardings, born-sharded init and the jitted train step for `cfg` (not compiled)
    on a mesh of these axis sizes (checks.validate's) with the default rules (`trainer_for`).
    It keeps taking `(cfg, sizes)`: the command lines, tests and notebooks call it so; past
    here the trainer asks the Layout."""
    p = cfg.parallel
    return trainer_for(
        cfg,
        sharding_lib.Layout.build(
            sizes, zero_stage=p.zero_stage, sequence_parallel=p.sequence_parallel, devices=devices
        ),
    )


COUNTERS = ("step", "skipped_steps", "first_bad_step")


def _state_layout(layout: sharding_lib.Layout, optimizer, param_shape, logical, split: Callable):
    """(shardings of params and grads, the train state's shapes, its shardings). `split(tree)`:
    the part of a params-shaped tree that trains (all of it, or the LoRA adapters): gradients and
    optimizer state exist for that part only."""
    # The summed gradients are reduced to the optimizer state's layout (`StepParts.
    # reduce_shardings`), and live there: from ZeRO-1 on, each device keeps its shard only.
    shardings = {"params": layout.shardings(logical, "params")}
    shardings["grads"] = split(layout.shardings(logical, "opt_state"))
    opt_shape = jax.eval_shape(optimizer.init, split(param_shape))
    opt_shardings = sharding_lib.opt_state_shardings(
        opt_shape, logical, layout.mesh, layout.rules["opt_state"]
    )
    replicated = NamedSharding(layout.mesh, PartitionSpec())
    state_shardings = {
        "params": shardings["params"],
        "opt_state": opt_shardings,
        **{k: replicated for k in COUNTERS},
    }
    state_shape = {
        "params": param_shape,
        "opt_state": opt_shape,
        **{k: jax.ShapeDtypeStruct((), jnp.int32) for k in COUNTERS},
    }
    return shardings, state_shape, state_shardings


def _checked_step(parts: StepParts, context_layout: str | None, jit_step: Callable, bucket: int) -> Callable:
    """The train step, jitted by `jit_step`, for batches whose rows the host has checked to hold
    at most `bucket` documents (`Trainer.step_for`): the same step over a model whose attention
    layers describe `bucket` document slots and poison nothing (`llama.check_documents`)."""
    model = check_documents(nnx.eval_shape(lambda: _new_model(parts.cfg, context_layout)), bucket)
    grads = summed_grads_fn(parts.cfg, parts.layout, model, parts.trainable)
    checked = dataclasses.replace(parts, summed_grads=grads)

    def step(state, batch):
        return train_step(checked, state, batch)[:2]

    return jit_step(step)


def trainer_for(cfg: Config, layout: sharding_lib.Layout) -> Trainer:
    """`build_trainer` on a built layout: which techniques run, and over which axes, is the
    layout's answer (`Layout.pipelined`, `ring`, `ring_size`, `row_axes`), so the step follows
    its rules."""
    mesh = layout.mesh
    cfg = resolve_attention(cfg, layout, mesh.devices.flat[0])
    if cfg.model.fp8:  # before anything compiles: float8 GEMMs on this backend, or exit 2
        fp8_lib.check_device(mesh.devices.flat[0])
    # Ring attention's sequence order; the batch is permuted into it once per step
    # (StepParts.prepare).
    context_layout = cfg.parallel.context_layout if layout.ring else None
    optimizer = make_optimizer(cfg)

    abstract_model = nnx.eval_shape(lambda: _new_model(cfg, context_layout))
    graphdef, abstract_state = nnx.split(abstract_model)
    logical = sharding_lib.logical_names(abstract_state, layout.sizes)
    param_shape = nnx.to_pure_dict(abstract_state)
    lora = lora_lib.enabled(cfg.finetune.lora)
    trainable = lora_lib.Trainable.of(abstract_model) if lora else None
    split = (lambda tree: trainable.split(tree)[0]) if lora else (lambda tree: tree)  # what trains
    shardings, state_shape, state_shardings = _state_layout(layout, optimizer, param_shape, logical, split)
    replicated = NamedSharding(mesh, PartitionSpec())

    def init():
        params = nnx.to_pure_dict(nnx.state(_new_model(cfg, context_layout)))
        return {
            "params": params,
            "opt_state": optimizer.init(split(params)),
            **{k: jnp.zeros((), jnp.int32) for k in COUNTERS},
        }

    def init_adapters():  # XLA leaves out the frozen weights' initialisation
        return split(nnx.to_pure_dict(nnx.state(_new_model(cfg, context_layout))))

    summed_grads = summed_grads_fn(cfg, layout, abstract_model, trainable)
    summed_nll = summed_nll_fn(cfg, layout, abstract_model, summed_grads)
    parts = StepParts(cfg, layout, optimizer, shardings["grads"], summed_grads, summed_nll, trainable)

    def step(state, batch):
        return train_step(parts, state, batch)[:2]

    batch_sharding = layout.batch_sharding()
    jit_step = functools.partial(
        jax.jit,
        in_shardings=(state_shardings, batch_sharding),
        out_shardings=(state_shardings, replicated),
        donate_argnums=0,
    )
    bucketed = cfg.model.attention == "cudnn" and not layout.ring
    return Trainer(
        cfg=cfg,
        layout=layout,
        graphdef=graphdef,
        state_shape=state_shape,
        state_shardings=state_shardings,
        grad_shardings=shardings["grads"],
        batch_sharding=batch_sharding,
        init=jax.jit(init, out_shardings=state_shardings),
        step=jit_step(step),
        step_with_grads=jax.jit(
            functools.partial(train_step, parts),
            in_shardings=(state_shardings, batch_sharding),
            out_shardings=(state_shardings, replicated, shardings["grads"]),
            donate_argnums=0,
        ),
        evaluate=jax.jit(
            functools.partial(eval_step, parts),
            in_shardings=(shardings["params"], batch_sharding),
            out_shardings=(replicated, replicated),
        ),
        trainable=trainable,
        init_adapters=jax.jit(init_adapters, out_shardings=split(shardings["params"])) if lora else None,
        checked_step=functools.partial(_checked_step, parts, context_layout, jit_step) if bucketed else None,
    )


def compile_step(trainer: Trainer, documents: int | None = None):
    """The train step lowered on abstract state and batch, and compiled (nothing runs): `step`,
    or with `documents` the step the training loop runs on rows of at most that many documents
    (`Trainer.step_for`)."""
    step = trainer.step if documents is None else trainer.step_for(documents)
    with targets_lib.lowering_context(trainer.mesh):
        lowered = step.lower(trainer.state_shape, trainer.batch_shape())
    return lowered.compile()
