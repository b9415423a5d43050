"""LoRA (Hu et al. 2021): low-rank adapters on a frozen model (`finetune.lora`).

Each targeted projection W (an einsum weight [in..., out...]) gets an adapter, Flax NNX's own
`nnx.LoRA` module, whose A [in, rank] and B [rank, out] are `nnx.LoRAParam`s (a subclass of
`nnx.Param`, so a filter tells them from the base weights), and computes

    y = x W + (alpha / rank) * x A B

with the in-dims of W flattened into A's rows and the out-dims into B's columns, in jaxpar's
order (heads major, as Hugging Face lays out q_proj's rows). B starts at zero, so the adapted
model at step 0 is the base model; A is drawn uniform in +-1/sqrt(in) (PEFT's default: torch's
kaiming_uniform_ with a = sqrt(5) on lora_A.weight [rank, in]).

Sharding: A carries the base weight's logical name of its first in-dim on its rows, B that of
its first out-dim on its columns (the flattened dims are that name's major axis, so a split over
it is the base weight's split); the rank dim is whole, and the stacked layers keep their
`layers` axis. Every layout that places W places its adapter the same way.

Adapters are added to a built model (`add_lora`): the blocks' modules gain an attribute
`<weight>_lora` (e.g. `blocks.attn.wq_lora.lora_a`), stacked over layers like the blocks. The
model's projection sites call `project`, which adds the adapter where there is one.

Dropout (finetune.lora.dropout = p, training only) is on the adapter's input, as PEFT's: y = x W
+ scale * (drop(x) A B), drop(x) = x * keep / (1 - p), keep ~ Bernoulli(1 - p) per element. The
randomness is passed explicitly, never held in a global: the train step draws one 32-bit seed per
token of the global batch, `token_seeds(train.seed, step, shape)`, from (train.seed, step) with
partitionable threefry (the same numbers whatever the sharding), and the batch carries them as
`SEEDS`; they travel with their tokens through gradient accumulation and ring attention's
permutation. The model hands them down (`Noise`) with the scan step's layer, the block within a
group and the target folded in, and each token's mask row comes from its own seed
(`Noise.drop`): no mask depends on how the batch is split. A batch without seeds (evaluation,
sampling, export) drops nothing. The pipelined step does not carry them yet (config refuses
dropout with mesh.pipe > 1).

Training: `Trainable` splits the pure-dict params into the adapters (what the step
differentiates and the optimizer holds state for) and the frozen rest; a checkpoint holds the
adapters alone over the base it names (`jaxpar.hf.base`). Export: `merged` folds
the adapters into their weights (W + alpha/rank * A B); `peft_tensors` names them as PEFT does.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxpar.config import LoRAConfig
from jaxpar.ops.swiglu import swiglu
from jaxpar.sharding import constrain

# finetune.lora.targets -> (the block's submodule, its weight): the one table of what LoRA adapts.
TARGETS = {
    "q": ("attn", "wq"),
    "k": ("attn", "wk"),
    "v": ("attn", "wv"),
    "o": ("attn", "wo"),
    "gate": ("mlp", "w_gate"),
    "up": ("mlp", "w_up"),
    "down": ("mlp", "w_down"),
}
# Each weight's number, folded into its adapter's dropout key (`Noise.at`).
WEIGHT_NUMBER = {weight: i for i, (_, weight) in enumerate(TARGETS.values())}
SEEDS = "lora_seeds"  # the batch key of the per-token dropout seeds (uint32 [batch, seq])
SUFFIX = "_lora"  # the adapter of weight `wq` is the attribute `wq_lora`
# How many leading dims of each weight are its input (the rest are its output).
IN_DIMS = {"wq": 1, "wk": 1, "wv": 1, "wo": 2, "w_gate": 1, "w_up": 1, "w_down": 1}


def enabled(lora: LoRAConfig) -> bool:
    return lora.rank > 0


def scale(lora: LoRAConfig) -> float:
    """What the adapters' output is multiplied by: alpha / rank (PEFT's `scaling`, without rsLoRA)."""
    return lora.alpha / lora.rank


# --- Building -------------------------------------------------------------------------------


def _units(model) -> list:
    """The stacked blocks' modules that hold the weights: the Block, or each Block of a group;
    first the dense prefix's Block (model.moe.first_dense) where the model has one."""
    blocks = model.blocks
    prefix = [model.dense_blocks] if hasattr(model, "dense_blocks") else []
    return prefix + (list(blocks.blocks) if hasattr(blocks, "blocks") else [blocks])


def _adapter(shape, names, in_dims: int, lora: LoRAConfig, dtypes, rngs: nnx.Rngs) -> nnx.LoRA:
    """One layer's nnx.LoRA for a weight of one layer's `shape` and logical `names`; `dtypes`:
    (compute, parameter) dtypes."""
    fan_in, fan_out = int(np.prod(shape[:in_dims])), int(np.prod(shape[in_dims:]))
    adapter = nnx.LoRA(
        fan_in,
        lora.rank,
        fan_out,
        dtype=dtypes[0],
        param_dtype=dtypes[1],
        # uniform in +-sqrt(3 * scale / fan_in) = +-1/sqrt(fan_in): PEFT's A
        a_initializer=nnx.initializers.variance_scaling(1 / 3, "fan_in", "uniform"),
        a_metadata={"out_sharding": (names[0], None), "eager_sharding": False},
        b_metadata={"out_sharding": (None, names[in_dims]), "eager_sharding": False},
        rngs=rngs,
    )
    adapter.scale = scale(lora)
    adapter.dropout = lora.dropout
    return adapter


def add_lora(model, lora: LoRAConfig, seed: int) -> None:
    """Adds the adapters of finetune.lora.targets to a built jaxpar Transformer, in place,
    stacked over its layers (their own random stream, from `seed`)."""
    dtypes = (jnp.dtype(model.cfg.dtype), jnp.dtype(model.cfg.param_dtype))
    rngs = nnx.Rngs(params=jax.random.fold_in(jax.random.key(seed), 0x10A))
    for unit in _units(model):
        for target in lora.targets:
            module_name, weight_name = TARGETS[target]
            module = getattr(unit, module_name)
            if not hasattr(module, weight_name):  # an MoE MLP: config refuses gate/up/down there
                raise ValueError(f"LoRA target {target}: this block's {module_name} has no {weight_name}")
            stacked = getattr(module, weight_name)  # [layers, ...], names ("layers", ...)
            names = stacked.get_metadata()["out_sharding"]  # the prefix's: ("dense_layers", ...)
            one = (stacked.shape[1:], names[1:], IN_DIMS[weight_name])
            adapter = _stacked_adapter(stacked.shape[0], one, lora, dtypes, rngs, names[0])
            setattr(module, weight_name + SUFFIX, adapter)


def _stacked_adapter(
    layers: int, one: tuple, lora: LoRAConfig, dtypes, rngs: nnx.Rngs, axis: str = "layers"
) -> nnx.LoRA:
    """`layers` adapters stacked on a leading axis of logical name `axis` (as their blocks are),
    each for a weight `one` = (shape, logical names, in-dims)."""

    @nnx.split_rngs(splits=layers)
    @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: axis})
    def make(rngs):
        return _adapter(*one, lora, dtypes, rngs)

    return make(rngs)


# --- Dropout ------------------------------------------------------------------------------


def dropping(lora: LoRAConfig) -> bool:
    return enabled(lora) and lora.dropout > 0


def token_seeds(train_seed: int, step, shape: tuple):
    """uint32 `shape` [batch, seq]: one dropout seed per token of the global batch at train
    step `step` (a traced int), from (train.seed, step). Partitionable threefry gives every
    element the same value whatever the sharding of the result."""
    key = jax.random.fold_in(jax.random.fold_in(jax.random.key(train_seed), 0xD20), step)
    return jax.random.bits(key, shape, jnp.uint32)


class Noise(NamedTuple):
    """What an adapter's dropout reads: the batch's per-token seeds and the numbers folded into
    them on the way down (the scan step's layer, the block within a group, the weight)."""

    seeds: jax.Array  # uint32 [batch, seq]
    path: tuple = ()

    def at(self, number) -> Noise:
        return Noise(self.seeds, (*self.path, number))

    def drop(self, x, rate: float):
        """x [batch, seq, width] with each element zeroed with probability `rate`, the rest
        divided by 1 - rate; a token's mask comes from its seed and the path alone."""

        def keep_row(seed):
            key = jax.random.key(seed)
            for number in self.path:
                key = jax.random.fold_in(key, number)
            return jax.random.bernoulli(key, 1.0 - rate, (x.shape[-1],))

        keep = jax.vmap(jax.vmap(keep_row))(self.seeds)
        return jnp.where(keep, x / jnp.asarray(1.0 - rate, x.dtype), jnp.zeros((), x.dtype))


def noise_of(batch: dict) -> Noise | None:
    """The dropout seeds a batch carries (a train step's with finetune.lora.dropout), or None."""
    return Noise(batch[SEEDS]) if SEEDS in batch else None


# --- Running --------------------------------------------------------------------------------


def project(module, weight_name: str, matmul, spec: str, x, noise: Noise | None = None):
    """matmul(spec, x, W) for the weight `weight_name` of `module`, plus its adapter's
    (alpha / rank) * drop(x) A B where it has one (dropout only with `noise`). x [batch, seq, in...]."""
    y = matmul(spec, x, getattr(module, weight_name)[...])
    adapter = getattr(module, weight_name + SUFFIX, None)
    if adapter is None:
        return y
    flat = x.reshape(*x.shape[:2], -1)
    rate = getattr(adapter, "dropout", 0.0)
    if noise is not None and rate > 0:
        flat = noise.at(WEIGHT_NUMBER[weight_name]).drop(flat, rate)
    low = adapter(flat).reshape(y.shape)
    return y + (low * jnp.asarray(adapter.scale, low.dtype)).astype(y.dtype)


def has_adapters(mlp) -> bool:
    return any(hasattr(mlp, name + SUFFIX) for name in ("w_gate", "w_up", "w_down"))


def adapted_swiglu(mlp, x, matmul, noise: Noise | None = None):
    """The dense MLP's SwiGLU (`jaxpar.ops.swiglu`) with each projection through `project`; the
    hidden activation pinned as `block_swiglu` pins it."""

    def project_in(x, name):
        return project(mlp, name, matmul, "bse,ef->bsf", x, noise)

    def project_out(hidden, name):
        hidden = constrain(hidden, ("batch", "seq", "mlp"))
        return project(mlp, name, matmul, "bsf,fe->bse", hidden, noise)

    act = mlp.cfg.mlp_activation
    return swiglu(
        x, "w_gate", "w_up", "w_down", project_in=project_in, project_out=project_out, activation=act
    )


# --- Training: the adapters apart from the frozen weights -----------------------------------


def _flat(tree: dict, prefix: tuple = ()) -> dict:
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(_flat(value, prefix + (key,)))
        else:
            out[prefix + (key,)] = value
    return out


def _nest(flat: dict) -> dict:
    out: dict = {}
    for path, value in flat.items():
        node = out
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = value
    return out


@dataclasses.dataclass(frozen=True)
class Trainable:
    """Which leaves of a pure-dict params tree train: the paths of the model's `nnx.LoRAParam`s
    (found with that filter). `split` and `join` move between the whole tree and (adapters,
    frozen)."""

    paths: frozenset

    @classmethod
    def of(cls, abstract_model) -> Trainable:
        state = nnx.to_pure_dict(nnx.state(abstract_model, nnx.LoRAParam))
        return cls(frozenset(_flat(state)))

    def split(self, params: dict) -> tuple[dict, dict]:
        flat = _flat(params)
        train = {p: v for p, v in flat.items() if p in self.paths}
        return _nest(train), _nest({p: v for p, v in flat.items() if p not in self.paths})

    def join(self, train: dict, frozen: dict) -> dict:
        return _nest({**_flat(frozen), **_flat(train)})


def grads_of_adapters(fn, trainable: Trainable):
    """fn(params, batch) -> (grads, aux), a gradient of the whole params, made into one that
    differentiates the adapters alone: (params, batch) -> (grads of the adapters, aux); the frozen
    weights enter as constants."""

    def adapted(params, batch):
        train, frozen = trainable.split(params)
        return jax.grad(lambda t: fn(trainable.join(t, frozen), batch), has_aux=True)(train)

    return adapted


# --- Export ---------------------------------------------------------------------------------


def _adapted_weights(flat: dict):
    """(weight path, its adapter's lora_a, lora_b paths) for each adapter in a flat params tree."""
    for path in flat:
        if path[-1] == "lora_a" and path[-2].endswith(SUFFIX):
            parent = path[:-2]
            yield parent + (path[-2][: -len(SUFFIX)],), path, parent + (path[-2], "lora_b")


def delta(a: np.ndarray, b: np.ndarray, shape: tuple, scale: float) -> np.ndarray:
    """scale * A B laid out as a weight of `shape` [layers, in..., out...], A [layers, in, r],
    B [layers, r, out], in float32."""
    ab = np.einsum("lir,lro->lio", a.astype(np.float32), b.astype(np.float32))
    return scale * ab.reshape(shape)


def merged(params: dict, lora: LoRAConfig) -> dict:
    """The params with every adapter folded into its weight, W + (alpha / rank) A B (computed in
    float32, cast to W's dtype), and the adapters removed: the base model's tree."""
    flat = {p: np.asarray(v) for p, v in _flat(params).items()}
    for weight, a, b in list(_adapted_weights(flat)):
        w = flat[weight]
        change = delta(flat.pop(a), flat.pop(b), w.shape, scale(lora))
        flat[weight] = (w.astype(np.float32) + change).astype(w.dtype)
    return _nest(flat)


def jaxpar_path(flat_key: tuple) -> str:
    return ".".join(str(k) for k in flat_key)


def peft_tensors(params: dict, table: dict, n_layers: int) -> dict[str, np.ndarray]:
    """{PEFT name: tensor} of the adapters in `params`: for the Hugging Face weight
    `model.layers.N.self_attn.q_proj.weight` (from the family's tensor `table`), lora_A.weight =
    A.T [rank, in] and lora_B.weight = B.T [out, rank] under base_model.model.<module>: torch
    Linear weights are [out, in], so PEFT's lora_B(lora_A(x)) is x A B."""
    flat = {p: np.asarray(v) for p, v in _flat(params).items()}
    out = {}
    for weight, a, b in _adapted_weights(flat):
        tensor = table[jaxpar_path(weight)]
        for index, _, hf_name in tensor.instances(n_layers):
            module = "base_model.model." + hf_name.removesuffix(".weight")
            out[f"{module}.lora_A.weight"] = np.ascontiguousarray(flat[a][index].T)
            out[f"{module}.lora_B.weight"] = np.ascontiguousarray(flat[b][index].T)
    return out
