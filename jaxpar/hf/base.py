"""The weights a run starts from (train.init_from), and what a checkpoint holds over them.

`train.init_from` names a run directory, a Hugging Face model directory or a Hub model id (resolved
to a local directory by `jaxpar.hf.convert.apply_init_from`); `init_state` puts its weights onto a
run's shardings with a fresh optimizer state at step 0.

A LoRA run (finetune.lora) trains adapters over a frozen base, so its checkpoints hold only what
changes (`Trainer.stored`): the adapters, their optimizer state, the step counters and the data
position, and name their base beside the data position (`BASE_KEY`: the train.init_from directory,
or null for the random init of train.seed, and where that is a jaxpar run the checkpoint step of it
that serves as the base). That step is pinned when the LoRA run starts -- the step `init_state`
loaded, its newest intact one then -- and a resume takes it from the checkpoint it restores
(`restore`); every later checkpoint records the pinned step (`record`), so the base run training
on changes nothing. Beside that step a checkpoint records the base checkpoint's identity
(`IDENTITY_KEY`: `checkpoint.params_identity`, a digest of its manifest's entries for the params),
so that a base checkpoint saved again at that step (a base run started over) is refused rather than
loaded; records written before the identity was recorded are read as before. Restoring one
(`restore`, `params_of`) loads that base the way init_from does and lays the adapters over it. The
base must still be there, unchanged: a checkpoint holds no copy of it.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp

from jaxpar import config as config_lib
from jaxpar.config import ConfigError
from jaxpar.hf.hf_load import is_hf_dir, load_hf_params
from jaxpar.training.checkpoint import Checkpointer, CheckpointNotFoundError, checkpoint_dir, params_identity
from jaxpar.training.optim import make_optimizer

BASE_KEY = "lora_base"  # in a LoRA checkpoint's data item: the base it was trained over

IDENTITY_KEY = "checkpoint"  # beside a jaxpar base's step: `params_identity` of that checkpoint

# The base of each LoRA run this process started or resumed (`init_state`, `restore`), by its
# absolute run_dir: {"init_from": ..., "step": ..., and for a jaxpar run's checkpoint
# IDENTITY_KEY: ...}, what `record` writes into its checkpoints. `record` is handed the config
# alone, so the pin lives here rather than in the trainer.
_PINNED: dict[str, dict] = {}


def _pin(cfg, init_from: str | None, step: int | None, identity: str | None = None) -> None:
    pinned = {"init_from": init_from, "step": step}
    if identity is not None:
        pinned[IDENTITY_KEY] = identity
    _PINNED[os.path.abspath(cfg.train.run_dir)] = pinned


def _base_identity(init_from: str | None, step: int | None) -> str | None:
    """`params_identity` of checkpoint `step` of the base run `init_from` (None without one)."""
    if init_from is None or step is None:
        return None
    return params_identity(os.path.join(checkpoint_dir(init_from), str(step)))


def _check_identity(init_from: str, step: int, identity: str | None) -> None:
    """Refuses checkpoint `step` of the base run `init_from` when it is not the one whose
    `params_identity` a LoRA checkpoint recorded (it was saved again since: another model).
    A record without an identity (written before this was recorded) is taken as it is; a
    checkpoint without a readable manifest is left to the restore, which names what is wrong."""
    if identity is None:
        return
    now = _base_identity(init_from, step)
    if now is not None and now != identity:
        raise ConfigError(
            f"checkpoint step {step} of the base run train.init_from={init_from} is not the one "
            "these adapters were trained over: it was replaced (saved again, e.g. by a run with "
            "train.resume=never, which moved the earlier run's files into its replaced-* "
            "directory); a LoRA checkpoint holds no copy of its base: put that checkpoint back "
            "in its place, or train new adapters over the base as it is now"
        )


def _check_run_base(path: str) -> None:
    """A run directory serves as a base when its checkpoints hold whole models: not a LoRA run."""
    src = config_lib.load_config(os.path.join(path, "config.yaml"))
    if src.finetune.lora.rank > 0:
        raise ConfigError(
            f"train.init_from={path} is a LoRA run, whose checkpoints hold its adapters alone; "
            f"write its merged model first (python -m jaxpar.convert to-hf {path} --out DIR) "
            "and start from DIR"
        )


def load_weights(
    trainer, path: str, shapes: dict, shardings: dict, step: int | None = None
) -> tuple[dict, int | None]:
    """(params, step): the params of `shapes` (a part of the model's) from train.init_from=`path`,
    on `shardings` and cast to their dtypes, and the checkpoint step they come from: a Hugging Face
    directory's tensors (step None), or a run's checkpoint `step` (default: its newest intact
    one)."""
    if is_hf_dir(path):
        return load_hf_params(path, trainer.cfg.model, shapes, shardings), None
    _check_run_base(path)
    ckpt = Checkpointer(checkpoint_dir(path), read_only=True)
    try:
        state, _, step = ckpt.restore({"params": shapes}, {"params": shardings}, step)
        return state["params"], step
    finally:
        ckpt.close()


def frozen_params(
    trainer, init_from: str | None, step: int | None = None, identity: str | None = None
) -> tuple[dict, int | None]:
    """(frozen weights, base step) of a LoRA trainer on its shardings: those of `init_from` (a
    run's checkpoint `step`, default its newest intact one, and that step; refused when
    `identity`, the checkpoint's `params_identity` a LoRA checkpoint recorded, no longer matches
    it), or without one the random init of train.seed (the same every time; step None)."""
    lora = trainer.trainable
    if init_from is None:
        return lora.split(trainer.init()["params"])[1], None
    shapes = lora.split(trainer.state_shape["params"])[1]
    try:
        if step is not None:
            _check_identity(init_from, step, identity)
        return load_weights(
            trainer, init_from, shapes, lora.split(trainer.state_shardings["params"])[1], step
        )
    except CheckpointNotFoundError as e:
        if step is None:
            raise
        raise ConfigError(
            f"these adapters were trained over checkpoint step {step} of the base run "
            f"train.init_from={init_from}, which is gone ({e}); a LoRA checkpoint holds no copy of "
            "its base: keep that checkpoint of the base run (its checkpoint.keep), or train new adapters"
        ) from None


def init_state(trainer, path: str):
    """The train state at step 0 of a run started from train.init_from=`path`: its weights on
    the trainer's param shardings (cast to model.param_dtype), a fresh optimizer state; with
    finetune.lora those weights are the frozen base, whose step (and for a run's checkpoint its
    `params_identity`) is pinned for `record`, and the adapters start fresh."""
    lora = trainer.trainable
    if lora is None:
        shapes, shardings = trainer.state_shape["params"], trainer.state_shardings["params"]
        params = load_weights(trainer, path, shapes, shardings)[0]
    else:
        frozen, step = frozen_params(trainer, path)
        _pin(trainer.cfg, path, step, _base_identity(path, step))
        params = lora.join(trainer.init_adapters(), frozen)
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
    {"init_from": train.init_from, "step": the base run's checkpoint step pinned when this run
    started or resumed (`init_state`, `restore`), or null for a Hugging Face directory or no
    init_from; with a step, IDENTITY_KEY: that checkpoint's `params_identity` where it was
    pinned with one}."""
    if cfg.finetune.lora.rank == 0:
        return {}
    path = cfg.train.init_from
    pinned = _PINNED.get(os.path.abspath(cfg.train.run_dir))
    if pinned is not None and pinned["init_from"] == path:
        return {BASE_KEY: dict(pinned)}
    if path is None or is_hf_dir(path):
        return {BASE_KEY: {"init_from": path, "step": None}}
    raise RuntimeError(
        f"no base step pinned for the LoRA run {cfg.train.run_dir} over the jaxpar run {path}: "
        "base.init_state or base.restore starts such a run"
    )


def recorded_base(data_state: dict | None, cfg, where: str) -> tuple[str | None, int | None, str | None]:
    """(init_from, step, identity) of the base a LoRA checkpoint names (`record`; identity None
    in a checkpoint written before it was recorded), checked against the run's
    train.init_from: overlaying adapters on another base would be a different model."""
    if data_state is None or BASE_KEY not in data_state:
        raise ConfigError(f"{where} names no LoRA base; it was not written by a LoRA run")
    base = data_state[BASE_KEY]
    if base["init_from"] != cfg.train.init_from:
        raise ConfigError(
            f"train.init_from={cfg.train.init_from}, but {where} holds adapters trained over "
            f"{base['init_from'] or 'the random init of train.seed'}; resume with "
            f"train.init_from={base['init_from']}"
        )
    return base["init_from"], base["step"], base.get(IDENTITY_KEY)


def restore(trainer, ckpt: Checkpointer, step: int) -> tuple[dict, dict | None, int]:
    """(train state, data position, step) of checkpoint `step` on the trainer's shardings: what
    `Trainer.stored` keeps, and for a LoRA run the base it names under the adapters."""
    state, data_state, step = ckpt.restore(
        trainer.stored(trainer.state_shape), trainer.stored(trainer.state_shardings), step=step
    )
    if trainer.trainable is not None:
        base = recorded_base(data_state, trainer.cfg, f"checkpoint step {step} in {ckpt.directory}")
        _pin(trainer.cfg, *base)  # the checkpoints after this one name the same base
        state["params"] = trainer.trainable.join(state["params"], frozen_params(trainer, *base)[0])
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
        params = trainer.trainable.join(params, frozen_params(trainer, *base)[0])
    return params, step
