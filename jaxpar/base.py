"""The weights a run starts from (train.init_from), and what a checkpoint holds over them.

`train.init_from` names a run directory, a Hugging Face model directory or a Hub model id (resolved
to a local directory by `jaxpar.convert.apply_init_from`); `init_state` puts its weights onto a
run's shardings with a fresh optimizer state at step 0.

A LoRA run (finetune.lora) trains adapters over a frozen base, so its checkpoints hold only what
changes (`Trainer.stored`): the adapters, their optimizer state, the step counters and the data
position, and name their base beside the data position (`BASE_KEY`: the train.init_from directory,
or null for the random init of train.seed, and where that is a jaxpar run the checkpoint step of it
that serves as the base: its newest when the checkpoint is saved). Restoring one (`restore`,
`params_of`) loads that base the way init_from does and lays the adapters over it. The base must
still be there, unchanged: a checkpoint holds no copy of it.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp

from jaxpar import config as config_lib
from jaxpar.checkpoint import Checkpointer, checkpoint_dir, list_steps
from jaxpar.config import ConfigError
from jaxpar.hf_load import is_hf_dir, load_hf_params
from jaxpar.optim import make_optimizer

BASE_KEY = "lora_base"  # in a LoRA checkpoint's data item: the base it was trained over


def _check_run_base(path: str) -> None:
    """A run directory serves as a base when its checkpoints hold whole models: not a LoRA run."""
    src = config_lib.load_config(os.path.join(path, "config.yaml"))
    if src.finetune.lora.rank > 0:
        raise ConfigError(
            f"train.init_from={path} is a LoRA run, whose checkpoints hold its adapters alone; "
            f"write its merged model first (python -m jaxpar.convert to-hf {path} --out DIR) "
            "and start from DIR"
        )


def load_weights(trainer, path: str, shapes: dict, shardings: dict, step: int | None = None) -> dict:
    """The params of `shapes` (a part of the model's) from train.init_from=`path`, on `shardings`
    and cast to their dtypes: a Hugging Face directory's tensors, or a run's checkpoint `step`
    (default: its newest intact one)."""
    if is_hf_dir(path):
        return load_hf_params(path, trainer.cfg.model, shapes, shardings)
    _check_run_base(path)
    ckpt = Checkpointer(checkpoint_dir(path), read_only=True)
    try:
        return ckpt.restore({"params": shapes}, {"params": shardings}, step)[0]["params"]
    finally:
        ckpt.close()


def frozen_params(trainer, init_from: str | None, step: int | None = None) -> dict:
    """A LoRA trainer's frozen weights on its shardings: those of `init_from` (a run's checkpoint
    `step`, default its newest), or without one the random init of train.seed (the same every
    time)."""
    lora = trainer.trainable
    if init_from is None:
        return lora.split(trainer.init()["params"])[1]
    shapes = lora.split(trainer.state_shape["params"])[1]
    return load_weights(trainer, init_from, shapes, lora.split(trainer.state_shardings["params"])[1], step)


def init_state(trainer, path: str):
    """The train state at step 0 of a run started from train.init_from=`path`: its weights on
    the trainer's param shardings (cast to model.param_dtype), a fresh optimizer state; with
    finetune.lora those weights are the frozen base and the adapters start fresh."""
    lora = trainer.trainable
    if lora is None:
        params = load_weights(trainer, path, trainer.state_shape["params"], trainer.state_shardings["params"])
    else:
        params = lora.join(trainer.init_adapters(), frozen_params(trainer, path))
    optimizer = make_optimizer(trainer.cfg)

    def fresh(params):
        zero = jnp.zeros((), jnp.int32)
        return {
            "params": params,
            "opt_state": optimizer.init(params if lora is None else lora.split(params)[0]),
            "step": zero,
            "skipped_steps": zero,
            "first_bad_step": zero,
        }

    return jax.jit(fresh, out_shardings=trainer.state_shardings, donate_argnums=0)(params)


def record(cfg) -> dict:
    """What a checkpoint of this run notes beside its data position: for a LoRA run its base,
    {"init_from": train.init_from, "step": the newest committed checkpoint of that run, or null
    for a Hugging Face directory or no init_from}."""
    if cfg.finetune.lora.rank == 0:
        return {}
    path = cfg.train.init_from
    committed = [] if path is None or is_hf_dir(path) else list_steps(checkpoint_dir(path))[0]
    return {BASE_KEY: {"init_from": path, "step": committed[-1] if committed else None}}


def recorded_base(data_state: dict | None, cfg, where: str) -> tuple[str | None, int | None]:
    """(init_from, step) of the base a LoRA checkpoint names (`record`), checked against the
    run's train.init_from: overlaying adapters on another base would be a different model."""
    if data_state is None or BASE_KEY not in data_state:
        raise ConfigError(f"{where} names no LoRA base; it was not written by a LoRA run")
    base = data_state[BASE_KEY]
    if base["init_from"] != cfg.train.init_from:
        raise ConfigError(
            f"train.init_from={cfg.train.init_from}, but {where} holds adapters trained over "
            f"{base['init_from'] or 'the random init of train.seed'}; resume with "
            f"train.init_from={base['init_from']}"
        )
    return base["init_from"], base["step"]


def restore(trainer, ckpt: Checkpointer, step: int) -> tuple[dict, dict | None, int]:
    """(train state, data position, step) of checkpoint `step` on the trainer's shardings: what
    `Trainer.stored` keeps, and for a LoRA run the base it names under the adapters."""
    state, data_state, step = ckpt.restore(
        trainer.stored(trainer.state_shape), trainer.stored(trainer.state_shardings), step=step
    )
    if trainer.trainable is not None:
        base = recorded_base(data_state, trainer.cfg, f"checkpoint step {step} in {ckpt.directory}")
        state["params"] = trainer.trainable.join(state["params"], frozen_params(trainer, *base))
    return state, data_state, step


def params_of(trainer, run_dir: str, step: int | None) -> tuple[dict, int]:
    """(params, step) of a run's checkpoint `step` (default: the newest intact one) on the
    trainer's shardings, without the optimizer state; a LoRA run's with its base under them."""
    shapes = trainer.stored(trainer.state_shape)["params"]
    shardings = trainer.stored(trainer.state_shardings)["params"]
    ckpt = Checkpointer(checkpoint_dir(run_dir), read_only=True)
    try:
        state, _, step = ckpt.restore({"params": shapes}, {"params": shardings}, step)
        data_state = ckpt.data_state(step) if trainer.trainable is not None else None
    finally:
        ckpt.close()
    params = state["params"]
    if trainer.trainable is not None:
        base = recorded_base(data_state, trainer.cfg, f"checkpoint step {step} of {run_dir}")
        params = trainer.trainable.join(params, frozen_params(trainer, *base))
    return params, step
