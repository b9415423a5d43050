"""`python -m jaxpar.train [CONFIG.yaml] [dotted.key=value ...]`: the training loop and its step.

The data path is one way: config -> mesh -> sharded state (born sharded, inside a jitted init)
-> jitted train step (state, batch) -> (state, metrics) -> writers. `build_trainer` does
everything up to the compiled step and is shared with `python -m jaxpar.inspect`.
"""

from __future__ import annotations

if __name__ == "__main__":  # a Ctrl-C while the imports below load stops quietly, exit 130
    import os as _os
    import signal as _signal

    _signal.signal(_signal.SIGINT, lambda *_: (_os.write(2, b"interrupted during start-up\n"),
                                               _os._exit(130)))

import dataclasses
import errno
import functools
import json
import logging
import os
import shutil
import signal
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxpar import checkpoint as checkpoint_lib
from jaxpar import config as config_lib
from jaxpar import fp8 as fp8_lib
from jaxpar import convert as convert_lib
from jaxpar import host as host_lib
from jaxpar import metrics as metrics_lib
from jaxpar import rundir as rundir_lib
from jaxpar import sharding as sharding_lib
from jaxpar.config import Config, ConfigError
from jaxpar.mesh import emulate_cpu_devices, start_distributed
from jaxpar.models import Transformer
from jaxpar.models.attention import documents_per_row, kernel_for
from jaxpar.models import objective as objective_lib
from jaxpar.models.loss import pick_chunks
from jaxpar.parallel import pipeline as pipeline_lib
from jaxpar.parallel import schedule as schedule_lib
from jaxpar.parallel.ring_attention import permute_to_layout

BATCH_KEYS = ("inputs", "targets", "positions", "segment_ids", "loss_mask")


# --- Optimizer ------------------------------------------------------------------------------


def lr_schedule(cfg: Config) -> optax.Schedule:
    """The learning rate of each update, from optax's count of updates already applied (0 for
    the first): update n = count + 1 warms up linearly to optimizer.lr at n = warmup_steps (the
    first update already moves, at lr / warmup_steps), then decays along a cosine to
    lr * min_lr_ratio at n = train.steps. With warmup_steps >= train.steps the run ends inside
    the warm-up."""
    o = cfg.optimizer
    warmup = max(o.warmup_steps, 0)
    decay = max(cfg.train.steps - warmup, 1)
    end = o.lr * o.min_lr_ratio

    def schedule(count):
        n = jnp.asarray(count, jnp.float32) + 1.0
        rising = o.lr * n / max(warmup, 1)
        progress = jnp.clip((n - warmup) / decay, 0.0, 1.0)
        falling = end + (o.lr - end) * 0.5 * (1.0 + jnp.cos(jnp.pi * progress))
        return jnp.where(n <= warmup, rising, falling)

    return schedule


SCHEDULE_KEYS = ("train.steps", "optimizer.lr", "optimizer.warmup_steps", "optimizer.min_lr_ratio")


def _schedule_change(cfg: Config, run_dir: str, start: int) -> str | None:
    """On resume: a note when the learning-rate schedule's settings differ from those the run was
    saved with (its config.yaml, read before it is rewritten). The schedule is a function of them,
    so raising train.steps after a finished run restarts the cosine from higher up; say so."""
    try:
        saved = config_lib.load_config(os.path.join(run_dir, "config.yaml"))
    except (ConfigError, OSError):
        return None
    value = lambda c, key: getattr(getattr(c, key.split(".")[0]), key.split(".")[1])  # noqa: E731
    changed = [f"{key} {value(saved, key)} -> {value(cfg, key)}" for key in SCHEDULE_KEYS
               if value(saved, key) != value(cfg, key)]
    if not changed:
        return None
    before, after = float(lr_schedule(saved)(start)), float(lr_schedule(cfg)(start))
    return (f"note: {', '.join(changed)} since the run was saved: the learning-rate schedule is "
            f"recomputed for the new settings, so update {start + 1} runs at {after:.2e} where the "
            f"saved schedule had {before:.2e}")


def make_optimizer(cfg: Config) -> optax.GradientTransformation:
    """optimizer.name: AdamW (no weight decay on norm scales), or plain SGD (what parity tests
    use: its update is the gradient times the learning rate, so a wrong gradient scale shows in
    the loss); either after global-norm clipping when clip_norm > 0."""
    o = cfg.optimizer

    def decay_mask(params):
        return jax.tree_util.tree_map_with_path(
            lambda path, _: not any("norm" in str(k) for k in path), params)

    if o.name == "sgd":
        update = optax.sgd(lr_schedule(cfg))
    else:
        update = optax.adamw(lr_schedule(cfg), b1=o.b1, b2=o.b2, eps=o.eps,
                             weight_decay=o.weight_decay, mask=decay_mask)
    return optax.chain(optax.clip_by_global_norm(o.clip_norm), update) if o.clip_norm > 0 else update


# --- Building the sharded state and the step ----------------------------------------------


@dataclass
class Trainer:
    """Everything needed to run (or only compile) training on one mesh."""

    cfg: Config  # resolved: model.attention is concrete for the layout's devices
    layout: sharding_lib.Layout  # the mesh and the rules of params, grads, optimizer state, activations
    graphdef: Any  # the model's structure; params are plain nested dicts of arrays
    state_shape: Any  # tree of ShapeDtypeStructs of the train state
    state_shardings: Any
    grad_shardings: Any  # where the reduced gradients live (sharded over fsdp from ZeRO-2)
    batch_sharding: NamedSharding
    init: Callable[[], Any]  # () -> state, born sharded
    step: Callable[[Any, dict], tuple[Any, dict]]  # jitted (state, batch) -> (state, metrics)
    # The same step, also returning the gradients it applied (averaged over tokens, laid out as
    # grad_shardings): what the parity tests compare leaf by leaf. Compiled only when called.
    step_with_grads: Callable[[Any, dict], tuple[Any, dict, Any]]
    # jitted (params, batch) -> (summed NLL, token count): the step's loss, no update, nothing donated
    evaluate: Callable[[Any, dict], tuple[Any, Any]]

    @property
    def mesh(self) -> Mesh:
        return self.layout.mesh

    def shard_batch(self, local_batch: dict[str, np.ndarray]) -> dict[str, jax.Array]:
        """This process's rows -> global arrays split over (data, fsdp, expert)."""
        return {k: jax.make_array_from_process_local_data(self.batch_sharding, local_batch[k])
                for k in BATCH_KEYS}

    def batch_shape(self) -> dict[str, jax.ShapeDtypeStruct]:
        t = self.cfg.train
        dtypes = {"loss_mask": jnp.float32}
        return {k: jax.ShapeDtypeStruct((t.batch_size, t.seq_len), dtypes.get(k, jnp.int32),
                                        sharding=self.batch_sharding) for k in BATCH_KEYS}


def _new_model(cfg: Config, context_layout: str | None) -> Transformer:
    return Transformer(cfg.model, rngs=nnx.Rngs(cfg.train.seed), remat=cfg.parallel.remat,
                       context_layout=context_layout)


def _logical_names(abstract_state) -> Any:
    specs = nnx.to_pure_dict(nnx.get_partition_spec(abstract_state))
    return jax.tree.map(lambda spec: tuple(spec), specs,
                        is_leaf=lambda x: isinstance(x, PartitionSpec))


def loss_chunks(cfg: Config, sizes: dict[str, int], rows: int | None = None) -> int:
    """train.loss_chunks, or (0 = auto) the fewest sequence chunks whose float32 logits stay
    within 256 MiB per device (jaxpar.models.loss.pick_chunks). `rows`: the batch rows the loss
    sees at once (a pipeline microbatch), default the whole batch."""
    t = cfg.train
    if t.loss_chunks:
        return t.loss_chunks
    # The hidden states' sequence is split over context (and tensor with sequence parallelism),
    # the output weight's vocabulary over tensor; one axis cannot split both dims of the logits,
    # so a device holds at least tokens / context by vocab / tensor of them.
    seq_shards = sizes["context"] * (sizes["tensor"] if cfg.parallel.sequence_parallel else 1)
    rows = (rows or t.batch_size // cfg.parallel.grad_accum) // (sizes["data"] * sizes["fsdp"] * sizes["expert"])
    return pick_chunks(t.seq_len, max(rows, 1) * t.seq_len // sizes["context"],
                       cfg.model.vocab_size // sizes["tensor"], seq_shards=seq_shards)


def resolve_attention(cfg: Config, sizes: dict[str, int], device) -> Config:
    """The config with `model.attention: auto` made concrete for the mesh's devices
    (`jaxpar.models.attention.kernel_for`); the model reads the choice from its config."""
    kernel = kernel_for(cfg.model, device, pipelined=sizes["pipe"] > 1, ring=sizes["context"] > 1)
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


def summed_grads_fn(cfg: Config, sizes: dict[str, int], layout: sharding_lib.Layout,
                    abstract_model) -> Callable:
    """(params, batch) -> (gradients of the objective summed over the batch's tokens, the
    statistics summed likewise), over parallel.grad_accum microsteps (`accumulate`). A microstep
    is the gradient of `objective_lib.objective`, or with mesh.pipe > 1 a pipelined pass of
    parallel.microbatches microbatches (`objective_lib.pipelined_grads`), the same objective."""
    p = cfg.parallel
    if sizes["pipe"] > 1:
        schedule = schedule_lib.build_schedule(p.pipeline_schedule, sizes["pipe"], p.microbatches,
                                               p.virtual_stages)
        rows = cfg.train.batch_size // (p.grad_accum * p.microbatches)  # one pipeline microbatch
        microstep = functools.partial(
            objective_lib.pipelined_grads, abstract_model, schedule=schedule, mesh=layout.mesh,
            axis_name=layout.rules["activations"]["layers"][0],
            loss_chunks=loss_chunks(cfg, sizes, rows=rows),
            # Axes over which parameters and gradients are whole: the pipeline splits rows over
            # them itself and sums once per pass.
            row_axes=schedule_lib.row_axes_for(cfg.model, p.zero_stage))
    else:
        microstep = jax.grad(functools.partial(objective_lib.objective, nnx.graphdef(abstract_model),
                                               chunks=loss_chunks(cfg, sizes)), has_aux=True)
    return functools.partial(accumulate, microstep, microsteps=p.grad_accum)


def summed_nll_fn(cfg: Config, sizes: dict[str, int], abstract_model,
                  summed_grads: Callable) -> Callable:
    """(params, batch) -> {"nll": summed NLL, "count": tokens} of the batch, computed as the
    step computes them (the same microsteps of the same rows), without a gradient."""
    if sizes["pipe"] > 1:
        # The pipeline's loss comes from the call the step makes (its schedules hold backward
        # actions too; jaxpar.parallel.pipeline has no forward-only one). Nothing reads the
        # gradients and XLA removes their work: in the compiled XLA:CPU program of
        # configs/tiny.yaml at mesh.pipe=2 (jax 0.12.0.1) the schedule's backward branch is
        # empty and the program holds 19 dot ops, the train step 40.
        return lambda params, batch: summed_grads(params, batch)[1]
    objective = functools.partial(objective_lib.objective, nnx.graphdef(abstract_model),
                                  chunks=loss_chunks(cfg, sizes))

    def nll_and_count(params, batch):
        aux = objective(params, batch)[1]
        return {"nll": aux["nll"], "count": aux["count"]}

    return functools.partial(accumulate, nll_and_count, microsteps=cfg.parallel.grad_accum)


def to_ring_layout(batch: dict, context: int, context_layout: str | None) -> dict:
    """Ring attention's sequence order over `context` devices (zigzag or contiguous), applied
    once per step to every token array, so positions and segment ids travel with their tokens;
    the batch as it is without ring attention (context_layout None)."""
    if context_layout is None:
        return batch
    return {k: permute_to_layout(x, context=context, layout=context_layout)
            for k, x in batch.items()}


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
    kept = jax.tree.map(lambda new, old: jnp.where(apply, new, old), updated,
                        {"params": state["params"], "opt_state": state["opt_state"]})
    weights_finite = jnp.isfinite(optax.tree.norm(kept["params"]))
    bad = ~weights_finite | (~finite if on_nan == "stop" else False)
    first_bad = jnp.where((state["first_bad_step"] == 0) & bad, step, state["first_bad_step"])
    skipped = state["skipped_steps"] + (~finite).astype(jnp.int32)
    metrics = {**metrics, "skipped": 1.0 - finite.astype(jnp.float32), "skipped_steps": skipped,
               "first_bad_step": first_bad}
    return {**kept, "step": step, "skipped_steps": skipped, "first_bad_step": first_bad}, metrics


@dataclass(frozen=True, eq=False)
class StepParts:
    """What the train step and the evaluation read besides their arguments."""

    cfg: Config
    sizes: dict[str, int]
    layout: sharding_lib.Layout
    optimizer: optax.GradientTransformation
    grad_shardings: Any
    summed_grads: Callable  # `summed_grads_fn`
    summed_nll: Callable  # `summed_nll_fn`

    def prepare(self, batch: dict) -> dict:
        """The batch in ring attention's layout when the mesh has one (`to_ring_layout`)."""
        p = self.cfg.parallel
        context = self.sizes["context"]
        return to_ring_layout(batch, context, p.context_layout if context > 1 else None)


def train_step(parts: StepParts, state: dict, batch: dict) -> tuple[dict, dict, Any]:
    """One update: (new state, metrics, the gradients applied, averaged over tokens)."""
    cfg, batch = parts.cfg, parts.prepare(batch)
    with parts.layout.scope():  # the mesh and activation rules the model's names resolve against
        grads, aux = parts.summed_grads(state["params"], batch)
    count = jnp.maximum(aux["count"], 1.0)
    grads = jax.tree.map(lambda g: g / count, grads)
    # ZeRO-2/3: pinning the gradients to the sharded layout makes XLA reduce-scatter them.
    grads = jax.lax.with_sharding_constraint(grads, parts.grad_shardings)
    updates, opt_state = parts.optimizer.update(grads, state["opt_state"], state["params"])
    params = optax.apply_updates(state["params"], updates)
    metrics = {"loss": aux["nll"] / count, "grad_norm": optax.tree.norm(grads),
               # optax's count of updates
               "lr": lr_schedule(cfg)(state["step"] - state["skipped_steps"]),
               "tokens": count}
    if "expert_load" in aux:
        accum = cfg.parallel.grad_accum
        metrics.update({k: aux[k] / accum for k in objective_lib.MOE_MEANS})
        metrics["expert_load_min"] = jnp.min(aux["expert_load"])
        metrics["expert_load_max"] = jnp.max(aux["expert_load"])
    new_state, metrics = guard_non_finite(state, {"params": params, "opt_state": opt_state},
                                          metrics, cfg.train.on_nan)
    return new_state, metrics, grads


def eval_step(parts: StepParts, params, batch: dict):
    """The training loss of `batch` under these params (train.eval_every), nothing updated:
    (summed NLL, token count)."""
    batch = parts.prepare(batch)
    with parts.layout.scope():
        aux = parts.summed_nll(params, batch)
    return aux["nll"], aux["count"]


def build_trainer(cfg: Config, sizes: dict[str, int], devices=None) -> Trainer:
    """Layout, shardings, born-sharded init and the jitted train step for `cfg` (not compiled)."""
    p = cfg.parallel
    layout = sharding_lib.Layout.build(sizes, zero_stage=p.zero_stage,
                                       sequence_parallel=p.sequence_parallel, devices=devices)
    mesh = layout.mesh
    cfg = resolve_attention(cfg, sizes, mesh.devices.flat[0])
    if cfg.model.fp8:  # before anything compiles: float8 GEMMs on this backend, or exit 2
        fp8_lib.check_device(mesh.devices.flat[0])
    # Ring attention's sequence order; the batch is permuted into it once per step
    # (StepParts.prepare).
    context_layout = p.context_layout if sizes["context"] > 1 else None
    optimizer = make_optimizer(cfg)

    abstract_model = nnx.eval_shape(lambda: _new_model(cfg, context_layout))
    graphdef, abstract_state = nnx.split(abstract_model)
    logical = _logical_names(abstract_state)
    param_shape = nnx.to_pure_dict(abstract_state)
    shardings = {kind: layout.shardings(logical, kind) for kind in ("params", "grads")}
    opt_shape = jax.eval_shape(optimizer.init, param_shape)
    opt_shardings = sharding_lib.opt_state_shardings(opt_shape, logical, mesh,
                                                     layout.rules["opt_state"])
    replicated = NamedSharding(mesh, PartitionSpec())
    counters = ("step", "skipped_steps", "first_bad_step")
    state_shardings = {"params": shardings["params"], "opt_state": opt_shardings,
                       **{k: replicated for k in counters}}
    state_shape = {"params": param_shape, "opt_state": opt_shape,
                   **{k: jax.ShapeDtypeStruct((), jnp.int32) for k in counters}}

    def init():
        params = nnx.to_pure_dict(nnx.state(_new_model(cfg, context_layout)))
        return {"params": params, "opt_state": optimizer.init(params),
                **{k: jnp.zeros((), jnp.int32) for k in counters}}

    summed_grads = summed_grads_fn(cfg, sizes, layout, abstract_model)
    parts = StepParts(cfg, sizes, layout, optimizer, shardings["grads"], summed_grads,
                      summed_nll_fn(cfg, sizes, abstract_model, summed_grads))

    def step(state, batch):
        return train_step(parts, state, batch)[:2]

    batch_sharding = layout.batch_sharding()
    return Trainer(
        cfg=cfg, layout=layout, graphdef=graphdef,
        state_shape=state_shape, state_shardings=state_shardings,
        grad_shardings=shardings["grads"], batch_sharding=batch_sharding,
        init=jax.jit(init, out_shardings=state_shardings),
        step=jax.jit(step, in_shardings=(state_shardings, batch_sharding),
                     out_shardings=(state_shardings, replicated), donate_argnums=0),
        step_with_grads=jax.jit(
            functools.partial(train_step, parts), in_shardings=(state_shardings, batch_sharding),
            out_shardings=(state_shardings, replicated, shardings["grads"]), donate_argnums=0),
        evaluate=jax.jit(functools.partial(eval_step, parts),
                         in_shardings=(shardings["params"], batch_sharding),
                         out_shardings=(replicated, replicated)),
    )


# --- The loop -------------------------------------------------------------------------------


def make_data(cfg: Config):
    from jaxpar import data as data_lib  # grain stays out of compile-only users (inspect, bench)

    tokenizer = data_lib.make_tokenizer(cfg.data)
    if tokenizer.vocab_size > cfg.model.vocab_size:
        raise ConfigError(
            f"model.vocab_size={cfg.model.vocab_size} is smaller than the tokenizer's vocabulary "
            f"({tokenizer.vocab_size}); raise model.vocab_size"
        )
    # Prepared shards (a directory, or the whole stdlib, cached) are memory-mapped; other sources
    # are read and packed in memory. Either way the same documents give the same batches. A
    # mixture (data.sources) interleaves several prepared directories.
    packed = data_lib.training_source(cfg.data, tokenizer, cfg.train.seq_len)
    return data_lib.batch_dataset(
        packed, global_batch=cfg.train.batch_size, seed=cfg.train.seed, shuffle=cfg.data.shuffle,
        process_index=jax.process_index(), process_count=jax.process_count())


def make_eval_data(cfg: Config):
    """The evaluation batches (train.eval_every > 0; else None): this process's rows of
    train.eval_batches batches from the validation split (jaxpar.data.eval_dataset)."""
    if not cfg.train.eval_every:
        return None
    from jaxpar import data as data_lib

    return data_lib.eval_dataset(
        cfg.data, cfg.train.seq_len, global_batch=cfg.train.batch_size,
        batches=cfg.train.eval_batches, process_index=jax.process_index(),
        process_count=jax.process_count())


class Preemption:
    """SIGTERM or SIGINT asks the run to stop: during start-up before the first step (nothing is
    written), in the loop after the current step, with a checkpoint. A second SIGINT stops at
    once: with `exit_at_once` (the command line) the process exits 130 on the spot, without
    unwinding (a crash-free stop even inside a compile or a save; the last committed checkpoint
    is intact), otherwise KeyboardInterrupt is raised.

    With `exit_at_once`, a SIGINT is also seen by a watcher thread the moment it arrives (through
    `signal.set_wakeup_fd`): Python runs its handlers only between bytecodes, so while the main
    thread waits on a step, a handler would wait out the step. The watcher exits at once when the
    wait for the next safe point (`expected_wait_s`: the forecast or measured time of a step) is
    longer than `PROMPT_S`, and on a second SIGINT whatever the main thread is doing."""

    PROMPT_S = 5.0
    POLL_EVERY = 10  # steps between stop agreements of a multi-process run (see `poll`)

    def __init__(self, exit_at_once: bool = False):
        self.requested: str | None = None
        self.exit_at_once = exit_at_once
        self.expected_wait_s = 0.0
        self.polls = self.agreements = 0  # loop steps polled; all-gathers they made
        self._previous = {}
        self._wakeup = None  # (read end, write end, the wakeup fd it replaced)

    def _handle(self, signum, frame):
        if self.requested is not None and signum == signal.SIGINT:
            if self.exit_at_once:
                _exit_at_once(b"\ninterrupted again: stopped at once, without a checkpoint (the "
                              b"last complete one is intact)\n")
            raise KeyboardInterrupt
        self.requested = signal.Signals(signum).name

    def _watch(self, read_end: int) -> None:
        interrupts = 0
        while chunk := os.read(read_end, 64):  # b"" once __exit__ closes the write end
            interrupts += chunk.count(signal.SIGINT)
            if interrupts >= 2:
                _exit_at_once(b"\ninterrupted again: stopped at once, without a checkpoint (the "
                              b"last complete one is intact)\n")
            if interrupts and self.expected_wait_s > self.PROMPT_S:
                _exit_at_once(
                    f"\nstopped at once: a step takes about {self.expected_wait_s:.0f} s here, too "
                    "long to wait for; nothing after the last complete checkpoint was saved (run "
                    "the same command to resume from it)\n".encode())
        os.close(read_end)

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._previous[sig] = signal.signal(sig, self._handle)
            if self.exit_at_once:
                read_end, write_end = os.pipe()
                os.set_blocking(write_end, False)
                replaced = signal.set_wakeup_fd(write_end, warn_on_full_buffer=False)
                self._wakeup = (read_end, write_end, replaced)
                threading.Thread(target=self._watch, args=(read_end,), daemon=True,
                                 name="jaxpar-interrupt-watcher").start()
        return self

    def __exit__(self, *exc):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        if self._wakeup is not None:
            read_end, write_end, replaced = self._wakeup
            signal.set_wakeup_fd(replaced)
            os.close(write_end)  # the watcher's read returns b"": it closes the read end and ends
            self._wakeup = None

    def agreed(self) -> str | None:
        """The stop request, agreed by every process (signals reach nodes at different times; all
        must stop after the same step, or one waits forever in the next step's collectives)."""
        if jax.process_count() == 1:
            return self.requested
        from jax.experimental import multihost_utils

        anyone = multihost_utils.process_allgather(np.int32(self.requested is not None)).any()
        return (self.requested or "SIGTERM (on another process)") if anyone else None

    def poll(self, step: int, host_waits: bool) -> str | None:
        """The agreed stop request after `step`. One process: every step (nothing to agree on).
        Several: agreeing is a blocking all-gather, a host sync that would drain the queue of
        dispatched steps, so it is made only where the host waits on the device anyway
        (`host_waits`: a logged or saved step) and every `POLL_EVERY` steps; every process
        takes the same decision at the same steps. A signal waits at most that many steps."""
        self.polls += 1
        if jax.process_count() == 1 or host_waits or step % self.POLL_EVERY == 0:
            self.agreements += jax.process_count() > 1
            return self.agreed()
        return None

    def check_startup(self, before_step: int) -> None:
        """Raises `Interrupted` if a stop was asked for during start-up (on any process: every
        process passes the same checks in the same order)."""
        if (signame := self.agreed()) is not None:
            raise Interrupted(signame, before_step)


def _exit_at_once(message: bytes) -> None:
    os.write(2, message)
    os._exit(130)


class Interrupted(Exception):
    """A signal stopped the run during start-up, before its first step: nothing was trained."""

    def __init__(self, signame: str, before_step: int):
        super().__init__(f"stopped by {signame} during start-up, before step {before_step}: "
                         f"nothing trained or saved; run the same command to start again")
        self.signame = signame


class NonFiniteLoss(RuntimeError):
    """The loss became NaN or infinite (train.on_nan=stop)."""


class DiskFull(RuntimeError):
    """No space left where the run writes; the message is one line that says what to do."""


def _no_space(error: BaseException) -> bool:
    """Whether `error` (or what caused it) is ENOSPC: an OSError, or the message orbax's writers
    (tensorstore) pass on from the file system."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, OSError) and error.errno == errno.ENOSPC:
            return True
        if "No space left on device" in str(error) or "os_error_code='28'" in str(error):
            return True
        error = error.__cause__ or error.__context__
    return False


class _DropNoSpace(logging.Filter):
    """Orbax's background threads log a disk-full write failure as several pages of tracebacks
    (through absl, and asyncio's "exception was never retrieved" when the process ends); the run
    reports it in one line instead (DiskFull)."""

    LOGGERS = ("absl", "asyncio")

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage() + str(record.exc_info[1] if record.exc_info else "")
        return not ("No space left on device" in text or "os_error_code='28'" in text)

    def __enter__(self):
        for name in self.LOGGERS:
            logging.getLogger(name).addFilter(self)
        return self

    def __exit__(self, *exc):
        for name in self.LOGGERS:
            logging.getLogger(name).removeFilter(self)


def _quiet_closed_loop(default_hook, unraisable) -> None:
    """sys.unraisablehook for the command line. After a failed save (a full disk), orbax closes
    its event loop while tensorstore still completes writes into it; each completion becomes an
    unraisable "RuntimeError: Event loop is closed", a page of them. They say nothing the run's
    one-line error does not; every other unraisable error goes to the default hook."""
    error = unraisable.exc_value
    if isinstance(error, RuntimeError) and str(error) == "Event loop is closed":
        return
    default_hook(unraisable)


def _megabytes(n: float) -> str:
    return f"{n / 2**20:,.1f} MB"


def _on_main(fn, what: str):
    """Runs `fn` (an int or None, or a ConfigError) on process 0 only; every process returns its
    outcome: the run directory is decided once, by the process that writes its files."""
    result = error = None
    if jax.process_index() == 0:
        try:
            result = fn()
        except ConfigError as e:
            error = e
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        code = -2 if error is not None else (-1 if result is None else int(result))
        code = int(multihost_utils.broadcast_one_to_all(np.int32(code)))
        if jax.process_index() != 0:
            if code == -2:
                raise ConfigError(f"{what}: process 0 refused it (its output says why)")
            result = None if code == -1 else code
    if error is not None:
        raise error
    return result


def _data_iterator(dataset, data_state: dict | None, start: int):
    """The batch stream from step `start`: grain's own state when it was saved by as many
    processes as there are now, else the position (the global sample order is the same)."""
    from jaxpar import data as data_lib

    if data_state and data_state.get("process_count") == jax.process_count():
        return data_lib.make_iterator(dataset, data_state["grain"])
    return data_lib.make_iterator(dataset[start:])


def _check_documents_per_row(segment_ids: np.ndarray, limit: int, step: int) -> None:
    """cuDNN's packed attention describes at most `limit` documents per row; a row with more
    would come out NaN (jaxpar.models.attention). Say so, with the numbers, before the step."""
    most = int(documents_per_row(segment_ids).max())
    if jax.process_count() > 1:  # every process must stop, not only the one holding the row
        from jax.experimental import multihost_utils

        most = int(multihost_utils.process_allgather(np.int32(most)).max())
    if most > limit:
        raise ConfigError(
            f"the batch of step {step} has a row of {most} documents, more than "
            f"model.max_documents_per_row={limit} (cuDNN attention takes each row's documents as "
            f"offsets); set model.max_documents_per_row={most} or more, or model.attention=xla")


def _keep_metrics_until(run_dir: str, step: int) -> None:
    """On resume, drop metrics.jsonl lines of steps after the checkpoint (they are rerun).

    A line that does not parse (what a crash in the middle of a write leaves, normally the last)
    is dropped with a warning instead of stopping the resume. The file is rewritten atomically:
    a crash here leaves either the old file or the new one."""
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.exists(path):
        return
    kept, garbled = [], []
    with open(path) as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                keep = record["step"] <= step
            except (json.JSONDecodeError, KeyError, TypeError):
                garbled.append(number)
                continue
            if keep:
                kept.append(line if line.endswith("\n") else line + "\n")
    if garbled:
        print(f"warning: {path}: dropped {len(garbled)} unreadable line(s) ({', '.join(map(str, garbled[:5]))}"
              f"{', ...' if len(garbled) > 5 else ''}), e.g. a write cut short by a crash",
              file=sys.stderr)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.writelines(kept)
    os.replace(tmp, path)


def _check_data_position(cfg: Config, saved: dict | None, step: int) -> None:
    """The data position saved with checkpoint `step` (a count of global batches) means the same
    sequences only with the same batch size and sequence length, and the same data and seed as
    the run's config.yaml records (jaxpar.rundir.DATA_KEYS): refuse a resume that changes them,
    unless data.allow_source_change, which keeps the earlier record beside the new one.
    (Checkpoints from before batch size and length were saved carry neither: not checked.)"""
    t = cfg.train
    for key, now in (("batch_size", t.batch_size), ("seq_len", t.seq_len)):
        was = (saved or {}).get(key)
        if was is not None and was != now:
            raise ConfigError(
                f"train.{key}={now}, but checkpoint step {step} was written with train.{key}="
                f"{was}: its data position (the first {step} global batches) would no longer name "
                f"the same data; resume with train.{key}={was}, or start a new run (another "
                f"train.run_dir, or train.resume=never)")
    if changes := rundir_lib.data_changes(t.run_dir, config_lib.to_dict(cfg)):
        if not cfg.data.allow_source_change:
            raise rundir_lib.data_change_error(changes, t.run_dir, step)
        kept = rundir_lib.keep_record(t.run_dir, step)
        print(f"data.allow_source_change: resuming step {step} on other data "
              f"({', '.join(key for key, _, _ in changes)}); the earlier config.yaml is kept as "
              f"{kept}", file=sys.stderr)


def _checkpoint_bytes(ckpt: checkpoint_lib.Checkpointer, state_shape) -> int:
    """What one more checkpoint takes on disk: the newest committed one's size, else the train
    state's bytes (an upper bound: orbax may compress)."""
    for step in reversed(ckpt.all_steps()):
        root = os.path.join(ckpt.directory, str(step))
        return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(root) for f in files)
    return sum(x.size * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(state_shape))


def _disk_full(ckpt, trainer, run_dir: str, at: int | None = None) -> DiskFull:
    """The one-line report of a full disk: where, how much a checkpoint needs, what is intact."""
    if ckpt is None:
        return DiskFull(f"no space left on the device of {run_dir}; free some space and run the "
                        f"same command again")
    needed = _checkpoint_bytes(ckpt, trainer.state_shape)
    free = shutil.disk_usage(ckpt.directory).free
    intact = ckpt.latest_intact_step()
    kept = (f"the previous checkpoint (step {intact}) is intact" if intact is not None
            else "no checkpoint was complete yet")
    what = "a checkpoint" if at is None else f"checkpoint step {at}"
    return DiskFull(f"no space left on the device of {ckpt.directory}: {what} needs about "
                    f"{_megabytes(needed)}, {_megabytes(free)} is free; {kept}; free some space "
                    f"and run the same command to resume")


def train(cfg: Config, sizes: dict[str, int], preemption: Preemption | None = None) -> dict:
    """Runs training (resuming from run_dir's checkpoints); returns a summary. Writes config.yaml,
    metrics.jsonl, TensorBoard events, loss.png and checkpoints into train.run_dir, whose rules
    (one run's history, one run at a time) are jaxpar.rundir's. `preemption`: the signal handler
    the caller installed (the CLI, from its first moment); by default one is installed here."""
    if preemption is None:
        with Preemption() as preemption:
            return train(cfg, sizes, preemption)
    cfg = config_lib.resolve_paths(cfg)  # config.yaml stores absolute paths
    t = cfg.train
    config_lib.check_run_dir(t.run_dir)
    dataset = make_data(cfg)  # before compiling: data errors are config errors
    eval_data = make_eval_data(cfg)
    preemption.check_startup(1)
    trainer = build_trainer(cfg, sizes)
    preemption.check_startup(1)
    is_main = jax.process_index() == 0
    lock = rundir_lib.RunLock(t.run_dir)
    ckpt = None
    no_space_logs = _DropNoSpace().__enter__()
    try:
        _on_main(lock.acquire, f"train.run_dir={t.run_dir}")

        def decide() -> int | None:
            history = rundir_lib.survey(t.run_dir)
            start = rundir_lib.plan(t.resume, history, lambda step: checkpoint_lib.manifest_problem(
                os.path.join(checkpoint_lib.checkpoint_dir(t.run_dir), str(step))))
            if start.step is not None:  # refused before anything is moved (process 0 alone
                # here: no orbax manager, whose opening waits for every process)
                _check_data_position(cfg, checkpoint_lib.Checkpointer.saved_data_state(
                    checkpoint_lib.checkpoint_dir(t.run_dir), start.step), start.step)
            if (aside := rundir_lib.set_aside(t.run_dir, start)) is not None:
                what = ("the earlier run's files" if start.step is None else
                        f"the checkpoints after step {start.step} (and a copy of metrics.jsonl)")
                print(f"train.resume={t.resume}: moved {what} into {aside}", file=sys.stderr)
            return start.step

        resume = _on_main(decide, f"train.run_dir={t.run_dir}")
        ckpt = checkpoint_lib.Checkpointer(
            checkpoint_lib.checkpoint_dir(t.run_dir), keep=cfg.checkpoint.keep,
            every=cfg.checkpoint.every, verified={} if resume is None else {resume: None})
        start, data_state = 0, None
        if resume is not None and convert_lib.holds_imported_weights(t.run_dir, resume):
            raise ConfigError(
                f"train.run_dir={t.run_dir} holds imported weights (python -m jaxpar.convert "
                f"from-hf), not a run to resume; train from them in a new run directory with "
                f"train.init_from={t.run_dir}")
        if resume is not None:  # any mesh: restored onto this run's shardings
            state, data_state, start = ckpt.restore(trainer.state_shape, trainer.state_shardings, step=resume)
            if is_main:
                _keep_metrics_until(t.run_dir, start)
                print(f"resumed from step {start} ({ckpt.directory})", file=sys.stderr)
                if (note := _schedule_change(cfg, t.run_dir, start)) is not None:
                    print(note, file=sys.stderr)
        elif t.init_from is not None:  # its weights on this mesh; a fresh optimizer, step 0
            state = convert_lib.init_state(trainer, t.init_from)
            if is_main:
                print(f"initialised from {t.init_from}", file=sys.stderr)
        else:
            state = trainer.init()
        preemption.check_startup(start + 1)
        if is_main:
            config_lib.dump_yaml(cfg, os.path.join(t.run_dir, "config.yaml"))
        return _loop(cfg, sizes, trainer, ckpt, dataset, state, data_state, start, preemption,
                     eval_data)
    except Exception as e:
        if _no_space(e) and not isinstance(e, DiskFull):
            raise _disk_full(ckpt, trainer, t.run_dir) from None
        raise
    finally:
        if ckpt is not None:
            try:
                ckpt.close()
            except Exception as e:  # a failed save surfaces here too: report it once, as above
                if sys.exc_info()[1] is None:  # (not while another error is on its way out)
                    if _no_space(e):
                        raise _disk_full(ckpt, trainer, t.run_dir) from None
                    raise
        if is_main:  # no collective here: this also runs when only this process failed
            lock.release()
        no_space_logs.__exit__()


def _evaluate(trainer: Trainer, params, eval_data) -> float:
    """eval_loss: the summed NLL over all tokens of the evaluation batches, read from a fresh
    iterator (the same batches every time), divided by their token count."""
    from jaxpar import data as data_lib

    sums = None
    for local in data_lib.make_iterator(eval_data):
        out = trainer.evaluate(params, trainer.shard_batch(local))
        sums = out if sums is None else tuple(a + b for a, b in zip(sums, out))  # on the devices
    nll, count = (float(x) for x in sums)
    return nll / max(count, 1.0)


class _StepClock:
    """Time per step over the window since the last logged step, with the first step (which holds
    the compilation) and any evaluation or checkpoint save kept out: each is its own figure."""

    def __init__(self):
        self.started = self.ended = time.perf_counter()
        self.compile_s: float | None = None
        self.window_start, self.window_steps = self.started, 0
        self.eval_s = self.save_s = 0.0  # in all, for the summary

    def stepped(self, metrics) -> None:
        self.window_steps += 1
        if self.compile_s is None:  # the first step holds the compilation: time the rest
            jax.block_until_ready(metrics)
            now = time.perf_counter()
            self.compile_s, self.window_start, self.window_steps = now - self.started, now, 0

    def timed(self, what: str, fn, *args):
        """Runs fn(*args) with its time kept out of the step window; returns (result, seconds)."""
        start = time.perf_counter()
        result = fn(*args)
        spent = time.perf_counter() - start
        self.window_start += spent
        setattr(self, what, getattr(self, what) + spent)
        return result, spent

    def step_time(self) -> float | None:
        """Mean seconds per step since the last call (None when no step was timed); restarts."""
        now = time.perf_counter()
        mean = (now - self.window_start) / self.window_steps if self.window_steps else None
        self.window_start, self.window_steps = now, 0
        return mean


class _Profiler:
    """`train.profile_steps` [first, last]: a jax.profiler trace from before step `first` to
    after step `last` has run (waited for, so its device work is in the trace), written under
    run_dir/profile/plugins/profile/<time>/ (TensorBoard's layout; Perfetto opens the
    .trace.json.gz). A run stopped inside the window ends the trace there."""

    def __init__(self, steps: list[int] | None, run_dir: str):
        self.first, self.last = steps if steps else (None, None)
        self.directory = os.path.join(run_dir, "profile")
        self.tracing = False

    def before(self, step: int) -> None:
        if step == self.first:
            jax.profiler.start_trace(self.directory)
            self.tracing = True

    def after(self, step: int, metrics) -> None:
        if self.tracing and step == self.last:
            jax.block_until_ready(metrics)
            self.close()

    def close(self) -> None:
        if self.tracing:
            self.tracing = False
            jax.profiler.stop_trace()


def _read_device(metrics, t, step: int, ckpt) -> tuple[float, int]:
    """The step's loss and skipped-step count, read from the device; NonFiniteLoss if the state
    froze on a non-finite value since the last read."""
    loss, first_bad = float(metrics["loss"]), int(metrics["first_bad_step"])
    if first_bad:  # the state is frozen since that step
        what = ("the loss, a gradient or the updated weights' norm" if t.on_nan == "stop"
                else "the updated weights' norm")
        raise NonFiniteLoss(
            f"{what} became non-finite at step {first_bad} (train.on_nan={t.on_nan}; seen at step "
            f"{step}, the first read of the device since; no later update reached the weights); "
            f"the last good checkpoint is step {ckpt.latest_valid_step()} in {ckpt.directory}")
    return loss, int(metrics["skipped_steps"])


def _record(step: int, loss: float, metrics, step_time: float | None, tokens_per_step: int,
            flops_tok: float, devices) -> dict:
    """One metrics.jsonl line: the step's figures (the device's extra metrics included)."""
    tokens_per_sec = tokens_per_step / step_time if step_time else None
    return {
        "step": step, "loss": loss, "tokens_per_sec": tokens_per_sec,
        "mfu": tokens_per_sec and metrics_lib.mfu(tokens_per_sec, flops_tok, devices),
        "step_time_s": step_time,
        "memory_bytes": metrics_lib.device_memory_bytes(jax.local_devices()[0]),
        **{k: float(v) for k, v in metrics.items() if k not in ("loss", "tokens", "first_bad_step")},
    }


def _saver(cfg: Config, trainer: Trainer, ckpt, iterator):
    """save(step, state, force): a checkpoint when `checkpoint.every` (or `force`) says so;
    returns whether one was written."""
    t = cfg.train

    def save(at: int, state, force: bool = False) -> bool:
        if not (force or ckpt.should_save(at)):
            return False
        # Checked before the save starts: orbax's own failure would come later, from a
        # background thread (the previous checkpoint intact, but pages of tracebacks).
        if shutil.disk_usage(ckpt.directory).free < _checkpoint_bytes(ckpt, trainer.state_shape):
            raise _disk_full(ckpt, trainer, t.run_dir, at)
        data = {"grain": iterator.get_state(), "process_count": jax.process_count(),
                "seed": t.seed,  # training draws no random numbers: the seed fixes init and data
                "batch_size": t.batch_size, "seq_len": t.seq_len}  # what the data position means
        ckpt.save(at, state, data, force=force)
        return True

    return save


def _loop(cfg: Config, sizes, trainer: Trainer, ckpt, dataset, state, data_state, start: int,
          preemption: Preemption, eval_data=None) -> dict:
    """Steps from `start` to train.steps: log, evaluate, save, stop on a signal. Returns the
    summary."""
    from jaxpar import data as data_lib

    t = cfg.train
    is_main = jax.process_index() == 0
    devices = list(trainer.mesh.devices.flat)
    flops_tok = metrics_lib.flops_per_token(cfg.model, t.seq_len)
    iterator = _data_iterator(dataset, data_state, start)
    # A mixture's samples per source are a function of the global sample count (the mixing is
    # a fixed interleave), so the tokens seen per source need no bookkeeping, and survive a resume.
    source_counts = data_lib.source_counter(cfg.data)
    clock, save = _StepClock(), _saver(cfg, trainer, ckpt, iterator)
    profiler = _Profiler(t.profile_steps, t.run_dir)
    first_loss = loss = eval_loss = tokens_seen = None
    step, stopped_by, skipped_steps = start, None, 0
    writer = metrics_lib.MetricsWriter(t.run_dir, purge_after=start) if is_main else None
    progress = metrics_lib.Progress(t.steps, initial=start, enabled=is_main and t.progress)
    try:
        for step in range(start + 1, t.steps + 1):
            local = next(iterator)
            profiler.before(step)
            if trainer.cfg.model.attention == "cudnn" and sizes["context"] == 1:
                _check_documents_per_row(local["segment_ids"], cfg.model.max_documents_per_row, step)
            state, metrics = trainer.step(state, trainer.shard_batch(local))
            clock.stepped(metrics)
            profiler.after(step, metrics)
            evaluated = eval_data is not None and (step % t.eval_every == 0 or step == t.steps)
            logged = step % t.log_every == 0 or step == t.steps or evaluated
            stop = preemption.poll(step, logged or ckpt.should_save(step))
            # The host reads the device only here (logging, saving, stopping), never per step.
            if logged or ckpt.should_save(step) or stop:
                loss, skipped_steps = _read_device(metrics, t, step, ckpt)
            saved, save_s = clock.timed("save_s", save, step, state, step == t.steps or stop is not None)
            if not logged:
                progress.update(step, None)
            else:
                step_time = clock.step_time()  # before evaluating: its time is its own figure
                preemption.expected_wait_s = step_time or preemption.expected_wait_s
                record = _record(step, loss, metrics, step_time, t.batch_size * t.seq_len,
                                 flops_tok, devices)
                if saved:
                    record["checkpoint_time_s"] = save_s
                if evaluated:
                    eval_loss, record["eval_time_s"] = clock.timed(
                        "eval_s", _evaluate, trainer, state["params"], eval_data)
                    record["eval_loss"] = eval_loss
                if source_counts is not None:
                    tokens_seen = {name: count * t.seq_len
                                   for name, count in source_counts(step * t.batch_size).items()}
                    record["tokens_seen"] = tokens_seen
                first_loss = loss if first_loss is None else first_loss
                if writer is not None:
                    writer.write(record)
                progress.update(step, record)
            if stop:
                stopped_by = stop
                break
    finally:
        clock.ended = time.perf_counter()  # the plot and the last flush are not training time
        profiler.close()
        progress.close()
        if writer is not None:
            writer.close()
    return _summary(cfg, clock, step, start, devices, sizes, flops_tok, first_loss, loss,
                    stopped_by, skipped_steps, eval_loss, tokens_seen)


def _summary(cfg: Config, clock: _StepClock, step: int, start: int, devices, sizes, flops_tok,
             first_loss, last_loss, stopped_by, skipped_steps, eval_loss, tokens_seen) -> dict:
    t = cfg.train
    total_s = clock.ended - clock.started
    run_steps = step - start - 1
    run_s = total_s - (clock.compile_s or 0.0) - clock.eval_s - clock.save_s
    tokens_per_sec = t.batch_size * t.seq_len * run_steps / run_s if run_steps > 0 else None
    return {
        "steps": step, "start_step": start, "first_loss": first_loss, "final_loss": last_loss,
        "seconds": total_s, "compile_seconds": clock.compile_s or 0.0, "tokens_per_sec": tokens_per_sec,
        "mfu": tokens_per_sec and metrics_lib.mfu(tokens_per_sec, flops_tok, devices),
        "devices": len(devices), "mesh": {a: s for a, s in sizes.items() if s > 1} or {"data": 1},
        "run_dir": t.run_dir, "stopped_by": stopped_by, "skipped_steps": skipped_steps,
        "eval_loss": eval_loss, "eval_seconds": clock.eval_s, "checkpoint_seconds": clock.save_s,
        "tokens_seen": tokens_seen,
    }


def format_summary(s: dict) -> str:
    mesh = " ".join(f"{a}={n}" for a, n in s["mesh"].items())
    if s["stopped_by"]:
        return (f"stopped by {s['stopped_by']} after step {s['steps']}: checkpoint written to "
                f"{checkpoint_lib.checkpoint_dir(s['run_dir'])}; run the same command to resume")
    if s["first_loss"] is None:
        return f"nothing to do: {s['run_dir']} is already at step {s['steps']} (train.steps)"
    rate = metrics_lib.format_rate(s["tokens_per_sec"], s["mfu"])
    data = "" if s.get("eval_loss") is None else f" | eval loss {s['eval_loss']:.3f}"
    if seen := s.get("tokens_seen"):
        total = max(sum(seen.values()), 1)
        data += " | tokens seen: " + ", ".join(f"{name} {n:,} ({100 * n / total:.0f}%)"
                                               for name, n in seen.items())
    return (f"done: {s['steps']} steps in {s['seconds']:.1f} s (compile {s['compile_seconds']:.1f} s)"
            f" | loss {s['first_loss']:.3f} -> {s['final_loss']:.3f}{data} | {rate}"
            f" | {s['devices']} devices ({mesh}) | {s['run_dir']}"
            + (f" | {s['skipped_steps']} non-finite steps skipped" if s.get("skipped_steps") else ""))


def load_and_validate(argv: list[str], num_devices: int | None = None) -> tuple[Config, dict[str, int]]:
    """Parses the command line, starts the backend with the emulated devices, validates.

    `num_devices` validates for that many devices instead of the ones present (compiling for
    GPUs that are not here: `python -m jaxpar.inspect --target h100:8`)."""
    path, overrides = config_lib.parse_cli(argv)
    settings = config_lib.user_settings(path, overrides)
    cfg = config_lib.build_config(settings)
    if num_devices is None:
        config_lib.validate_runtime(cfg)  # before the backend starts with those devices
        emulate_cpu_devices(cfg.runtime)
        start_distributed(cfg.distributed)
        num_devices = jax.device_count()
    if "mesh" not in settings:  # no layout asked for: the default one, or DP over what exists
        cfg = dataclasses.replace(cfg, mesh=config_lib.fit_default_mesh(num_devices))
    cfg = convert_lib.apply_init_from(cfg, settings)  # train.init_from: its shape and tokenizer
    return cfg, config_lib.validate(cfg, num_devices)


USAGE = """usage: python -m jaxpar.train [CONFIG.yaml] [dotted.key=value ...]

Trains with the defaults below, then CONFIG.yaml (presets in configs/), then the overrides,
written without dashes, e.g.
  python -m jaxpar.train configs/tiny.yaml train.steps=20 mesh.data=2 mesh.fsdp=2 mesh.tensor=2
  python -m jaxpar.train configs/gpt2-124m.yaml train.steps=100 mesh.data=-1
Exit codes: 0 done, 1 a failure during training, 2 bad settings, 3 too big for this machine's
memory (on a CPU), 130 stopped by Ctrl-C.

Settings (key, default, meaning):"""


def _preflight(cfg: Config, sizes: dict[str, int], preemption: Preemption) -> None:
    """On a CPU: jaxpar.host.DoesNotFit for a run predicted not to fit in the host's memory; a
    warning with the expected time per step for a slow one. Before anything compiles."""
    forecast = host_lib.check(cfg, sizes)
    if forecast is None:
        return
    preemption.expected_wait_s = forecast.step_seconds  # until a step is measured
    if forecast.slow and jax.process_index() == 0:
        print(host_lib.warning(forecast, cfg), file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] in (["-h"], ["--help"]):
        print(USAGE + "\n" + config_lib.settings_help())
        return 0
    # From the first moment, a signal only asks for a stop (Preemption): start-up checks for it
    # between its phases, the loop after each step; nothing is interrupted half-way.
    _DropNoSpace().__enter__()  # for the process's lifetime: orbax's leftovers are logged at its end
    sys.unraisablehook = functools.partial(_quiet_closed_loop, sys.unraisablehook)
    with Preemption(exit_at_once=True) as preemption:
        try:
            cfg, sizes = load_and_validate(argv)
            _preflight(cfg, sizes, preemption)
            preemption.check_startup(1)
            summary = train(cfg, sizes, preemption)
        except ConfigError as e:
            print(f"config error: {e}", file=sys.stderr)
            return 2
        except host_lib.DoesNotFit as e:
            print(f"error: {e}", file=sys.stderr)
            return 3
        except (NonFiniteLoss, DiskFull) as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
        except Interrupted as e:
            print(e, file=sys.stderr)
            return 128 + signal.Signals[e.signame].value
        except KeyboardInterrupt:  # a second Ctrl-C where the handler could not run (exit_at_once)
            print("interrupted again: stopped at once, without a checkpoint", file=sys.stderr)
            return 130
    if jax.process_index() == 0:
        print(format_summary(summary))
    # A Ctrl-C stop exits 130 (the shell's convention), after its checkpoint; SIGTERM, which
    # schedulers send to preempt, exits 0 so that a requeued job simply resumes.
    return 130 if summary["stopped_by"] == "SIGINT" else 0


if __name__ == "__main__":
    sys.exit(main())
