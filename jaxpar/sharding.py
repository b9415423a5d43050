"""Logical axis names -> mesh axes: the only place where the model's names meet the devices.

Parameters and activations carry logical names (`embed`, `heads`, `mlp`, ...). A rules table maps
each name to zero or more mesh axes. The ZeRO stage picks between two tables for the three kinds
of training state (DESIGN.md):

| stage | params      | grads       | optimizer state |
| ----- | ----------- | ----------- | --------------- |
| 0     | replicated  | all-reduced | replicated      |
| 1     | replicated  | all-reduced | sharded (fsdp)  |
| 2     | replicated  | reduce-scattered (sharded) | sharded |
| 3     | sharded     | reduce-scattered (sharded) | sharded |

"Replicated" means: not split over `data`/`fsdp`; tensor parallelism (`heads`, `mlp`, `vocab`
over `tensor`) applies at every stage.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Any, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxpar.config import MESH_AXES

Rules = dict[str, tuple[str, ...]]

# Logical name -> mesh axes. `embed` is the one name whose placement depends on the ZeRO stage.
BASE_RULES: Rules = {
    "batch": ("data", "fsdp", "expert"),
    "seq": ("context",),
    "act_seq": ("context",),  # sequence between blocks; + tensor with sequence parallelism
    "layers": ("pipe",),  # pipeline stages own contiguous runs of layers
    "vocab": ("tensor",),
    "embed": (),
    "heads": ("tensor",),
    "kv_heads": ("tensor",),
    "head_dim": (),
    "mlp": ("tensor",),
    "experts": ("expert",),
}


def make_rules(*, shard_embed: bool, sequence_parallel: bool) -> Rules:
    rules = dict(BASE_RULES)
    if shard_embed:
        rules["embed"] = ("fsdp",)
    if sequence_parallel:
        rules["act_seq"] = ("context", "tensor")
    return rules


def logical_to_spec(names: Sequence[str | None], rules: Rules, mesh: Mesh | None = None) -> PartitionSpec:
    """(`batch`, `seq`, `embed`) -> PartitionSpec(('data','fsdp','expert'), 'context', None).

    Mesh axes of size 1 are dropped, and a mesh axis is used at most once (first name wins), so
    one table serves every mesh shape.
    """
    used: set[str] = set()
    out = []
    for name in names:
        axes = []
        for axis in rules.get(name, ()) if name is not None else ():
            if axis in used or (mesh is not None and mesh.shape[axis] == 1):
                continue
            used.add(axis)
            axes.append(axis)
        out.append(None if not axes else axes[0] if len(axes) == 1 else tuple(axes))
    return PartitionSpec(*out)


# --- Shardings of the training state --------------------------------------------------------


def tree_shardings(logical_tree: Any, mesh: Mesh, rules: Rules) -> Any:
    """A tree of logical-name tuples -> the same tree of NamedShardings."""
    return jax.tree.map(
        lambda names: NamedSharding(mesh, logical_to_spec(names, rules, mesh)),
        logical_tree,
        is_leaf=lambda x: isinstance(x, tuple),
    )


def state_rules(zero_stage: int, sequence_parallel: bool) -> dict[str, Rules]:
    """Rules for params, grads and optimizer state at a ZeRO stage (table in the module doc)."""
    replicated = make_rules(shard_embed=False, sequence_parallel=sequence_parallel)
    sharded = make_rules(shard_embed=True, sequence_parallel=sequence_parallel)
    return {
        "params": sharded if zero_stage >= 3 else replicated,
        "grads": sharded if zero_stage >= 2 else replicated,
        "opt_state": sharded if zero_stage >= 1 else replicated,
        "activations": replicated,
    }


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Batch rows over (data, fsdp, expert); the sequence stays whole (the model splits it)."""
    return NamedSharding(mesh, logical_to_spec(("batch", None), BASE_RULES, mesh))


def opt_state_shardings(opt_state_shape: Any, params_logical: Any, mesh: Mesh, rules: Rules) -> Any:
    """Optimizer state leaves shaped like a parameter take its sharding; scalars are replicated.

    optax states (Adam's mu and nu) hold trees with the parameters' structure; they are matched by
    key path suffix, so the state tree need not be spelled out here.
    """
    by_path = {}
    for path, names in jax.tree_util.tree_flatten_with_path(
            params_logical, is_leaf=lambda x: isinstance(x, tuple))[0]:
        by_path[tuple(str(k) for k in path)] = names

    def pick(path, leaf):
        keys = tuple(str(k) for k in path)
        for start in range(len(keys)):
            names = by_path.get(keys[start:])
            if names is not None and len(names) == len(leaf.shape):
                return NamedSharding(mesh, logical_to_spec(names, rules, mesh))
        return NamedSharding(mesh, PartitionSpec())

    return jax.tree_util.tree_map_with_path(pick, opt_state_shape)


# --- Activation constraints, used by the model through logical names only -------------------

_ACTIVE: contextvars.ContextVar[tuple[Mesh, Rules] | None] = contextvars.ContextVar(
    "jaxpar_sharding", default=None
)
_CONTEXT_LAYOUT = contextvars.ContextVar("jaxpar_context_layout", default="zigzag")


@contextlib.contextmanager
def use_mesh(mesh: Mesh, rules: Rules, context_layout: str = "zigzag"):
    """Within this block, `constrain` pins activations onto `mesh` with `rules`, and attention
    runs as a ring over `context` (sequence in `context_layout` order) when that axis is > 1."""
    layout_token = _CONTEXT_LAYOUT.set(context_layout)
    token = _ACTIVE.set((mesh, rules))
    try:
        yield
    finally:
        _ACTIVE.reset(token)
        _CONTEXT_LAYOUT.reset(layout_token)


@contextlib.contextmanager
def unconstrained():
    """Within this block `constrain` does nothing: for code traced inside a shard_map, where the
    mesh's manual axes cannot appear in sharding constraints (GSPMD propagates from the inputs)."""
    token = _ACTIVE.set(None)
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def current_mesh() -> Mesh | None:
    active = _ACTIVE.get()
    return None if active is None else active[0]


def ring_layout() -> str | None:
    """The sequence layout ring attention should assume, or None when `context` is 1 (or no mesh
    is active): then attention is ordinary attention."""
    mesh = current_mesh()
    return _CONTEXT_LAYOUT.get() if mesh is not None and mesh.shape["context"] > 1 else None


def single_device_mesh() -> Mesh:
    """All six axes of size 1 on the first device: for shard_map code called without a mesh."""
    return Mesh(np.array(jax.devices()[:1]).reshape((1,) * len(MESH_AXES)), MESH_AXES)


def constrain(x: jax.Array, names: Sequence[str | None]) -> jax.Array:
    """`with_sharding_constraint` by logical names; a no-op outside `use_mesh` (single device)."""
    active = _ACTIVE.get()
    if active is None:
        return x
    mesh, rules = active
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, logical_to_spec(names, rules, mesh)))


def shard_bytes(shape_tree: Any, sharding_tree: Any) -> int:
    """Bytes one device holds for a tree of arrays (or ShapeDtypeStructs) under these shardings."""
    total = 0
    for leaf, sharding in zip(jax.tree.leaves(shape_tree), jax.tree.leaves(sharding_tree)):
        shard = sharding.shard_shape(leaf.shape)
        total += int(np.prod(shard, dtype=np.int64)) * np.dtype(leaf.dtype).itemsize
    return total
