"""Logical axis names -> mesh axes, and the `Layout` that carries them through a run.

Parameters and activations carry logical names (`embed`, `heads`, `mlp`, ...). A rules table maps
each name to zero or more mesh axes; the explicit techniques (ring attention over `seq`'s axis,
the expert all-to-all over `experts`, `batch`, `seq` and `mlp`) take their mesh axes from the
rules in force (`rules_in_force`: the layout's inside `Layout.scope`). The ZeRO stage picks
between two tables for the three kinds of training state:

| stage | params      | grads       | optimizer state |
| ----- | ----------- | ----------- | --------------- |
| 0     | replicated  | all-reduced | replicated      |
| 1     | replicated  | replicated (reduce-scattered to the optimizer shards, see below) | sharded (fsdp) |
| 2     | replicated  | reduce-scattered (sharded) | sharded |
| 3     | sharded     | reduce-scattered (sharded) | sharded |

The step reduces the gradients to the optimizer state's layout at every stage
(`jaxpar.training.trainer.StepParts.reduce_shardings`), so ZeRO-1 reduce-scatters them as ZeRO-2 does and
its compiled program is ZeRO-2's: nothing in it keeps a whole gradient, and the gradients the step
can return (`Trainer.step_with_grads`) live there too. The `grads` rules keep the ZeRO paper's
table; they still decide which axes a pipeline's rows split over (`row_axes`).

"Replicated" means: not split over `data`/`fsdp`; tensor parallelism (`heads`, `mlp`, `vocab`
over `tensor`) applies at every stage. On XLA:CPU a "reduce-scatter" is compiled as an
all-reduce followed by a slice (see `jaxpar.compiled.hlo`); GPU compilers emit a real reduce-scatter.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx
from flax.core import spmd as flax_spmd
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from jaxpar.mesh import make_mesh

Rules = dict[str, tuple[str, ...]]

# Logical name -> mesh axes: the default table. `embed` is the one name whose placement depends
# on the ZeRO stage (`make_rules`).
BASE_RULES: Rules = {
    "batch": ("data", "fsdp", "expert"),
    "seq": ("context",),
    "act_seq": ("context",),  # sequence between blocks; + tensor with sequence parallelism
    "layers": ("pipe",),  # pipeline stages own contiguous runs of layers
    "dense_layers": (),  # an MoE model's dense prefix (model.moe.first_dense) or dense blocks: whole
    "mtp_layers": (),  # multi-token prediction's modules (model.mtp.depth): on the pipeline's last stage
    "mtp_concat": (),  # the input dim [2 x embed] of an MTP module's projection `eh_proj`
    "vocab": ("tensor",),
    "embed": (),
    "heads": ("tensor",),
    "kv_heads": ("tensor",),
    "head_dim": (),
    # Latent attention's latents (`jaxpar.models.mla`): whole on every tensor device; under ZeRO-3
    # the up-projections' latent dim is split over fsdp (`make_rules`).
    "latent": (),
    "mlp": ("tensor",),
    # The input dims of the two output projections (attention's `wo`, the MLP's `w_down`): over
    # tensor like `heads` and `mlp`; where the state is split over fsdp (`make_rules`), over fsdp
    # too, in place of their `embed` dim (`OUTER_NAMES`).
    "heads_in": ("tensor",),
    "mlp_in": ("tensor",),
    "experts": ("expert",),
}

# A stacked weight [layers, rows, cols] split over fsdp on its last dim makes XLA:GPU gather a
# layer's slice along a minor dim; it then copies the whole float32 stack, transposed, before the
# layer loop and keeps it for the step (Llama-2-7B shape, FSDP 8: 0.99 GB for `wo` and
# `w_down`). So fsdp splits those two weights on their first dim (`heads_in`, `mlp_in`) where it
# divides, and on `embed` as the others where it does not (`fitted_names`): the name to fall
# back to.
OUTER_NAMES = {"heads_in": "heads", "mlp_in": "mlp"}


def make_rules(*, shard_embed: bool, sequence_parallel: bool) -> Rules:
    rules = dict(BASE_RULES)
    if shard_embed:
        rules["embed"] = ("fsdp",)
        rules["latent"] = ("fsdp",)
        for name in OUTER_NAMES:
            rules[name] = (*rules[name], "fsdp")
    if sequence_parallel:
        rules["act_seq"] = ("context", "tensor")
    return rules


def logical_to_spec(names: Sequence[str | None], rules: Rules, mesh: Mesh | None = None) -> PartitionSpec:
    """(`batch`, `seq`, `embed`) -> PartitionSpec(('data','fsdp','expert'), 'context', None).

    With a mesh, its axes of size 1 (and axes it lacks) are dropped; a mesh axis is used at most
    once (first name wins), so one table serves every mesh shape.
    """
    used: set[str] = set()
    out = []
    for name in names:
        axes = []
        for axis in rules.get(name, ()) if name is not None else ():
            if axis in used or (mesh is not None and mesh.shape.get(axis, 1) == 1):
                continue
            used.add(axis)
            axes.append(axis)
        out.append(None if not axes else axes[0] if len(axes) == 1 else tuple(axes))
    return PartitionSpec(*out)


# --- Shardings of the training state --------------------------------------------------------


def logical_names(abstract_state: Any, sizes: dict[str, int] | None = None) -> Any:
    """The logical-name tuple of every parameter of an (abstract) nnx state, as a plain nested
    dict shaped like `nnx.to_pure_dict(state)`: what `tree_shardings` turns into shardings. With
    the mesh's `sizes`, each fitted to its shape (`fitted_names`)."""
    specs = nnx.to_pure_dict(nnx.get_partition_spec(abstract_state))
    names = jax.tree.map(lambda spec: tuple(spec), specs, is_leaf=lambda x: isinstance(x, PartitionSpec))
    if sizes is None:
        return names
    shapes = nnx.to_pure_dict(abstract_state)
    return jax.tree.map(
        lambda n, leaf: fitted_names(n, leaf.shape, sizes),
        names,
        shapes,
        is_leaf=lambda x: isinstance(x, tuple),
    )


def fitted_names(names: Sequence[str | None], shape: Sequence[int], sizes: dict[str, int]) -> tuple:
    """`names` with each of `OUTER_NAMES` whose dim the devices of its sharded rule (tensor x
    fsdp) do not divide replaced by the name it falls back to (fsdp then splits `embed`)."""
    sharded = make_rules(shard_embed=True, sequence_parallel=False)

    def fits(name, dim):
        return dim % int(np.prod([sizes.get(a, 1) for a in sharded[name]])) == 0

    return tuple(
        OUTER_NAMES[n] if n in OUTER_NAMES and not fits(n, dim) else n for n, dim in zip(names, shape)
    )


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


def zero_state_bytes(
    psi: float, n: int, stage: int, param_bytes: float = 4, grad_bytes: float = 4, optimizer_bytes: float = 8
) -> dict[str, float]:
    """Model-state bytes per device of psi parameters data-parallel over n = mesh.fsdp devices
    at a ZeRO stage, as `state_rules` places each kind (split over fsdp or whole): the ZeRO
    paper's formula (Rajbhandari et al. 2020). jaxpar's own dtypes are the defaults (float32
    params and grads, Adam's two float32 moments); the paper's mixed-precision Adam is
    param_bytes=2, grad_bytes=2, optimizer_bytes=K=12."""
    rules = state_rules(stage, sequence_parallel=False)

    def per_device(kind: str, nbytes: float) -> float:
        return nbytes * psi / (n if "fsdp" in rules[kind]["embed"] else 1)

    out = {
        "params": per_device("params", param_bytes),
        "gradients": per_device("grads", grad_bytes),
        "optimizer": per_device("opt_state", optimizer_bytes),
    }
    out["total"] = sum(out.values())
    return out


def opt_state_shardings(opt_state_shape: Any, params_logical: Any, mesh: Mesh, rules: Rules) -> Any:
    """Optimizer state leaves shaped like a parameter take its sharding; scalars are replicated.

    optax states (Adam's mu and nu) hold trees with the parameters' structure; they are matched by
    key path suffix, so the state tree need not be spelled out here.
    """
    by_path = {}
    for path, names in jax.tree_util.tree_flatten_with_path(
        params_logical, is_leaf=lambda x: isinstance(x, tuple)
    )[0]:
        by_path[tuple(str(k) for k in path)] = names

    def pick(path, leaf):
        keys = tuple(str(k) for k in path)
        for start in range(len(keys)):
            names = by_path.get(keys[start:])
            if names is not None and len(names) == len(leaf.shape):
                return NamedSharding(mesh, logical_to_spec(names, rules, mesh))
        return NamedSharding(mesh, PartitionSpec())

    return jax.tree_util.tree_map_with_path(pick, opt_state_shape)


# --- Activation constraints: JAX's mesh context and Flax's logical-axis rules ---------------
#
# The model pins activations by logical name only (`constrain(x, ("batch", "seq", "embed"))`).
# What those names mean comes from two contexts that belong to the libraries, not to jaxpar:
# the mesh from `jax.sharding.use_abstract_mesh` (what `jax.set_mesh` sets outside `jit`), and
# the name -> axes table from Flax's `nnx.logical_axis_rules`. `Layout.scope()` enters both; a
# model called with neither (one device, `python -m jaxpar.sample`) runs unconstrained.


def rule_pairs(rules: Rules) -> tuple[tuple[str, tuple[str, ...]], ...]:
    """Our table in Flax's format for `nnx.logical_axis_rules`: ((name, mesh axes), ...)."""
    return tuple(rules.items())


def active_rules() -> Rules:
    """The rules Flax's `logical_axis_rules` context holds, as a table ({} when none)."""
    rules = {}
    for name, axes in flax_spmd.get_logical_axis_rules():
        rules[name] = () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)
    return rules


def rules_in_force() -> Rules:
    """The activation rules a step runs under: the active ones inside a scope that set them
    (`Layout.scope`), else BASE_RULES, the documented default (for the `parallel/` functions
    called directly on a mesh). What the explicit techniques read their mesh axes from."""
    return active_rules() or BASE_RULES


def current_scope() -> tuple[Any, Rules] | None:
    """(the current abstract mesh, the active rules) inside a scope that set both (as
    `Layout.scope` does); None when either context is missing."""
    mesh, rules = jax.sharding.get_abstract_mesh(), active_rules()
    return None if mesh.empty or not rules else (mesh, rules)


def _free_auto_axes(mesh) -> set[str]:
    """Axes a sharding constraint may name: Auto axes of size > 1 (not Manual inside a
    shard_map, not Explicit, whose arrays carry their sharding in their type)."""
    return {
        name
        for name, kind in zip(mesh.axis_names, mesh.axis_types)
        if kind == AxisType.Auto and mesh.shape[name] > 1
    }


def constrain(x: jax.Array, names: Sequence[str | None]) -> jax.Array:
    """`with_sharding_constraint` of x by logical names under the current mesh and rules (only
    its Auto axes); x as it is when either context is missing."""
    scope = current_scope()
    if scope is None or AxisType.Auto not in scope[0].axis_types:
        return x  # no mesh, no rules, or only Explicit / Manual axes: nothing to constrain
    mesh, rules = scope
    free = _free_auto_axes(mesh)
    usable = {name: tuple(a for a in axes if a in free) for name, axes in rules.items()}
    # A spec of Nones still says something: "whole on every device" (e.g. gather a ZeRO-3
    # weight before a lookup), so it is applied like any other.
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, logical_to_spec(names, usable)))


# --- Which explicit techniques a layout runs: read from the rules, never from axis names ------


def varying_axes(a) -> frozenset:
    """The manual mesh axes (of the shard_maps around) along which `a` differs by device."""
    manual = getattr(jax.typeof(a), "manual_axis_type", None)
    return manual.varying if manual is not None else frozenset()


def pipe_axis(rules: Rules) -> str | None:
    """The mesh axis the pipeline's stages run over: the first of the `layers` rule's axes."""
    return next(iter(rules.get("layers", ())), None)


def ring_axis(rules: Rules) -> str | None:
    """The mesh axis ring attention goes round: the first of the `seq` rule's axes (what
    `jaxpar.models.llama` reads from the rules in force)."""
    return next(iter(rules.get("seq", ())), None)


def is_pipelined(sizes: dict[str, int], rules: Rules = BASE_RULES) -> bool:
    """Whether a mesh of these axis sizes pipelines the blocks: the pipeline axis (`pipe_axis`
    of these activation rules; `pipe` by default) has more than one device. For callers with
    axis sizes and no `Layout` (the planner, the command lines); a Layout answers `pipelined`."""
    axis = pipe_axis(rules)
    return axis is not None and sizes.get(axis, 1) > 1


def is_ring(sizes: dict[str, int], rules: Rules = BASE_RULES) -> bool:
    """Whether attention is a ring on a mesh of these axis sizes: the ring axis (`ring_axis` of
    these activation rules; `context` by default) has more than one device."""
    axis = ring_axis(rules)
    return axis is not None and sizes.get(axis, 1) > 1


def row_axes(rules: dict[str, Rules]) -> tuple[str, ...]:
    """The mesh axes that only split batch rows: the activation rules' `batch` axes that no
    other name of the params, grads or activations rules uses (no parameter, gradient or
    sequence is split over them; the optimizer state is updated outside the pipeline).
    Inside a pipelined chunk they are manual and summed over once, after the loop
    (`jaxpar.parallel.pipeline`). Default rules: `data`, and `fsdp` below ZeRO-2 (ZeRO-2/3 split
    gradients or weights over it) -- `jaxpar.parallel.schedule.row_axes_for` for a dense model.
    The model may still couple its rows (MoE, float8): the pipeline adapter then uses none."""
    others = {
        axis
        for kind in ("params", "grads", "activations")
        for name, axes in rules.get(kind, {}).items()
        if name != "batch"
        for axis in axes
    }
    return tuple(a for a in rules["activations"].get("batch", ()) if a not in others)


# --- The layout: one value that says where everything lives ----------------------------------


@dataclasses.dataclass(frozen=True)
class Layout:
    """The mesh, its axis sizes, and the rules of every kind of array: built once per run
    (`Layout.build`) and passed wherever placement matters. `scope()` is the one place a traced
    step learns the mesh and the activation rules. It answers which explicit techniques run and
    over which axes (`pipelined`, `ring`, `row_axes`), from its rules: the trainer permutes the
    batch for the ring the `seq` rule names, the ring goes round it (tests/test_seam.py moves it
    to another axis), and the pipeline runs over the `layers` rule's axis."""

    mesh: Mesh
    rules: dict[str, Rules]  # params, grads, opt_state, activations (see `state_rules`)

    @classmethod
    def build(
        cls,
        sizes: dict[str, int],
        *,
        zero_stage: int,
        sequence_parallel: bool,
        devices: Sequence[jax.Device] | None = None,
    ) -> Layout:
        return cls(make_mesh(sizes, devices), state_rules(zero_stage, sequence_parallel))

    @property
    def sizes(self) -> dict[str, int]:
        """Mesh axis -> number of devices."""
        return dict(self.mesh.shape)

    @property
    def pipe_axis(self) -> str | None:
        return pipe_axis(self.rules["activations"])

    @property
    def stages(self) -> int:
        """Pipeline stages: the size of the pipeline axis (1 without one)."""
        return self.sizes.get(self.pipe_axis, 1)

    @property
    def pipelined(self) -> bool:
        return is_pipelined(self.sizes, self.rules["activations"])

    @property
    def ring_axis(self) -> str | None:
        return ring_axis(self.rules["activations"])

    @property
    def ring_size(self) -> int:
        """Devices in attention's ring: the size of the ring axis (1: no ring)."""
        return self.sizes.get(self.ring_axis, 1)

    @property
    def ring(self) -> bool:
        return is_ring(self.sizes, self.rules["activations"])

    @property
    def row_axes(self) -> tuple[str, ...]:
        """The axes a pipelined chunk splits only rows over (`row_axes`)."""
        return row_axes(self.rules)

    def shardings(self, logical_tree: Any, kind: str) -> Any:
        """NamedShardings of a tree of logical-name tuples, for `kind` (params, grads, ...)."""
        return tree_shardings(logical_tree, self.mesh, self.rules[kind])

    def batch_sharding(self) -> NamedSharding:
        """Batch rows over the activation rules' `batch` axes; the sequence stays whole."""
        rules = self.rules["activations"]
        return NamedSharding(self.mesh, logical_to_spec(("batch", None), rules, self.mesh))

    @contextlib.contextmanager
    def scope(self):
        """The mesh (JAX's abstract-mesh context) and the activation rules (Flax's logical-axis
        rules) that `constrain`, ring attention and the MoE all-to-all read. Enter it inside the
        traced function (as `train_step` does), not around a jitted call: Flax's rules are not
        part of jit's cache key, so a cached trace would not see other rules."""
        with (
            jax.sharding.use_abstract_mesh(self.mesh.abstract_mesh),
            flax_spmd.logical_axis_rules(rule_pairs(self.rules["activations"])),
        ):
            yield


def shard_bytes(shape_tree: Any, sharding_tree: Any) -> int:
    """Bytes one device holds for a tree of arrays (or ShapeDtypeStructs) under these shardings."""
    total = 0
    for leaf, sharding in zip(jax.tree.leaves(shape_tree), jax.tree.leaves(sharding_tree)):
        shard = sharding.shard_shape(leaf.shape)
        total += int(np.prod(shard, dtype=np.int64)) * np.dtype(leaf.dtype).itemsize
    return total
