"""Mixture-of-experts MLP with expert parallelism: route, all-to-all dispatch, experts, combine.

One `jax.shard_map`, manual over the mesh axes the layer uses. Which axes those are comes from
`jaxpar.sharding.BASE_RULES`, the one table of logical name -> mesh axes: tokens are split along
the batch over `batch` (data, fsdp, expert) and along the sequence over `seq` (context), the
experts over `experts` (expert), the hidden units over `mlp` (tensor); an axis the mesh lacks is
skipped, an axis it has besides these is left alone. Each device routes its own tokens, packs
one copy per (token, choice) into a fixed-size buffer per destination expert, and swaps buffers
with the other devices of its `expert` group:

    x [tokens, embed] --route--> buffer [experts, capacity, embed]
        --all_to_all(expert)--> [local_experts, sources * capacity, embed]
        --SwiGLU experts (batched einsum, psum over `tensor`)-->
        --all_to_all(expert)--> [experts, capacity, embed] --gather, weight, sum--> y [tokens, embed]

Expert weights are sharded with the experts dim over `expert` and the hidden (`mlp`) dim over
`tensor`; each `tensor` rank computes its slice of the hidden units and a `psum` over `tensor`
sums the down projection (Megatron MLP). Any `fsdp` split of the embed dim is gathered at the
shard_map boundary (ZeRO-3: gather per layer), by GSPMD on Auto axes and by `jax.reshard` on
Explicit ones, where every input is first moved to the layout the shard_map takes.

Dropping rule (capacity mode). Each source device gives each expert `capacity` slots. Slots are
handed out first come first served in choice-major order: all first choices of the device's
tokens in token order, then all second choices in token order, and so on, so that a first choice
is never dropped to make room for another token's second choice (GShard, Lepikhin et al. 2020).
A dropped (token, choice) contributes zero; its router weight is not renormalised (the residual
connection around the block carries the token). Token order is row-major over the device's
local `[batch, seq]` block. Dropless mode (`capacity_factor=None`) uses capacity = local tokens,
the worst case since a token picks `top_k` distinct experts, so nothing is ever dropped.

Without a mesh (none passed, none set with `jax.set_mesh`) the layer runs as on one device: no
shard_map, no collectives. On a mesh without an `expert` axis (or with one of size 1) every
device holds all experts and the all-to-alls are skipped. Routing: softmax, top_k experts per
token, weights renormalised over the top_k when top_k > 1 and the plain probability when
top_k = 1 (see `route`).

`jax.lax.ragged_all_to_all` would avoid the padding in dropless mode, but XLA:CPU does not
implement it ("HLO opcode `ragged-all-to-all` is not supported by XLA:CPU", checked on jax and
jaxlib 0.12.0.1), so only the padded path is provided.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpar.sharding import BASE_RULES


class Routing(NamedTuple):
    """Router output for `tokens` tokens and `num_experts` experts."""

    expert_index: jax.Array  # [tokens, top_k] int32, best first
    expert_weight: jax.Array  # [tokens, top_k] float32: top_k > 1 sums to 1, top_k = 1 the prob
    aux_loss: jax.Array  # [] load-balancing loss, 1.0 when perfectly balanced
    z_loss: jax.Array  # [] mean of logsumexp(logits)^2
    expert_load: jax.Array  # [num_experts] int32, (token, choice) pairs routed to each expert


def route(x, router_w, *, top_k, token_axes=()):
    """Top-k softmax router, in float32.

    x: [tokens, embed]; router_w: [embed, num_experts]. logits = x @ router_w, probs = softmax.
    Weights: for top_k > 1 the top_k probs renormalised to sum 1 (Mixtral); for top_k = 1 the
    chosen expert's prob itself (Switch Transformer), since renormalising would make every
    weight 1 and leave the router without a gradient from the output. Statistics are global
    over `token_axes` (mesh axes the tokens are split over; `psum` when called inside a
    shard_map, none outside):

      aux_loss = E * sum_e f_e * p_e, f_e = fraction of (token, choice) pairs routed to e,
                 p_e = mean router prob of e (Switch Transformer, Fedus et al. 2021, eq. 4;
                 f_e carries no gradient);
      z_loss   = mean over tokens of logsumexp(logits)^2 (ST-MoE, Zoph et al. 2022, eq. 5).
    """
    num_experts = router_w.shape[-1]
    logits = jnp.dot(x.astype(jnp.float32), router_w.astype(jnp.float32))  # [tokens, E]
    probs = jax.nn.softmax(logits, axis=-1)
    top_probs, expert_index = jax.lax.top_k(probs, top_k)  # [tokens, top_k]
    if top_k > 1:
        expert_weight = top_probs / jnp.sum(top_probs, axis=-1, keepdims=True)
    else:
        expert_weight = top_probs

    def total(value):
        return jax.lax.psum(value, token_axes) if token_axes else value

    tokens = total(jnp.float32(x.shape[0]))
    expert_load = total(jnp.zeros(num_experts, jnp.int32).at[expert_index.reshape(-1)].add(1))
    routed_fraction = jax.lax.stop_gradient(expert_load.astype(jnp.float32) / (tokens * top_k))
    mean_prob = total(jnp.sum(probs, axis=0)) / tokens
    aux_loss = num_experts * jnp.sum(routed_fraction * mean_prob)
    z_loss = total(jnp.sum(jax.nn.logsumexp(logits, axis=-1) ** 2)) / tokens
    return Routing(expert_index.astype(jnp.int32), expert_weight, aux_loss, z_loss, expert_load)


def slot_positions(expert_index, num_experts):
    """Position of each (token, choice) in its expert's queue, choice-major first come first served.

    expert_index: [tokens, top_k]. Returns [tokens, top_k] int32: among all pairs sent to the same
    expert, first choices of tokens 0..T-1 come first, then second choices, and so on. A pair is
    kept iff its position < capacity.
    """
    tokens, top_k = expert_index.shape
    queue = expert_index.T.reshape(-1)  # [top_k * tokens], choice-major
    order = jnp.argsort(queue, stable=True)  # grouped by expert, queue order kept inside a group
    counts = jnp.zeros(num_experts, jnp.int32).at[queue].add(1)
    group_start = jnp.cumsum(counts) - counts
    rank_in_group = jnp.arange(queue.size, dtype=jnp.int32) - group_start[queue[order]]
    position = jnp.zeros_like(queue).at[order].set(rank_in_group)
    return position.reshape(top_k, tokens).T


def expert_capacity(tokens, num_experts, top_k, capacity_factor):
    """Slots per expert per source device: ceil(capacity_factor * tokens * top_k / E), at most
    `tokens` (a token picks distinct experts); `tokens` when capacity_factor is None (dropless)."""
    if capacity_factor is None:
        return tokens
    return max(1, min(tokens, math.ceil(capacity_factor * tokens * top_k / num_experts)))


def swiglu_experts(h, gate, up, down, compute_dtype, fp8=False, amax_axes=()):
    """Batched SwiGLU over a group of experts: down(silu(h @ gate) * (h @ up)).

    h: [experts, slots, embed]; gate, up: [experts, embed, mlp]; down: [experts, mlp, embed].
    Returns [experts, slots, embed] float32 (a partial sum if `mlp` is a slice of the hidden dim).
    fp8: the three matmuls in float8 (jaxpar.models.fp8), each operand scaled by its amax over
    the whole tensor: `amax_axes` are the manual mesh axes its pieces are spread over.
    """
    if fp8:
        from jaxpar.models.fp8 import fp8_einsum  # (here: jaxpar.models imports this module)

        h = h.astype(compute_dtype)
        hidden = (jax.nn.silu(fp8_einsum("esd,edm->esm", h, gate, amax_axes))
                  * fp8_einsum("esd,edm->esm", h, up, amax_axes))
        return fp8_einsum("esm,emd->esd", hidden, down, amax_axes, jnp.float32)
    h, gate, up, down = (a.astype(compute_dtype) for a in (h, gate, up, down))
    hidden = jax.nn.silu(jnp.einsum("esd,edm->esm", h, gate)) * jnp.einsum("esd,edm->esm", h, up)
    return jnp.einsum("esm,emd->esd", hidden, down, preferred_element_type=jnp.float32)


def _mesh_axes(mesh, names):
    """The axes among `names` that the layer splits over: mesh axes of size > 1 that are not
    already manual (an enclosing shard_map's). Others are skipped."""
    names = (names,) if isinstance(names, str) else tuple(names)
    kinds = dict(zip(mesh.axis_names, mesh.axis_types))
    return tuple(name for name in names if name in kinds and mesh.shape[name] > 1
                 and kinds[name] != jax.sharding.AxisType.Manual)


def _check_shapes(x, params, sizes, expert_axes, token_axes, seq_axes, tensor_axes):
    num_experts = params["router"].shape[-1]
    expert_devices = math.prod(sizes[a] for a in expert_axes)
    if num_experts % expert_devices:
        raise ValueError(
            f"num_experts={num_experts} is not divisible by mesh axis {expert_axes[0]!r} of size "
            f"{expert_devices}; use an expert axis size that divides {num_experts}"
        )
    roles = {"token_axes": token_axes, "seq_axes": seq_axes, "tensor_axes": tensor_axes}
    for role, axes in roles.items():
        for other, other_axes in roles.items():
            if role < other and set(axes) & set(other_axes):
                raise ValueError(f"{role}={axes} and {other}={other_axes} share a mesh axis")
    checks = [
        ("batch", x.shape[0], token_axes),
        ("seq", x.shape[1], seq_axes),
        ("mlp", params["gate"].shape[-1], tensor_axes),
    ]
    for what, size, axes in checks:
        split = math.prod(sizes[a] for a in axes)
        if size % split:
            raise ValueError(f"{what}={size} is not divisible by mesh axes {axes} of total size {split}")


def _on_explicit_axes(x, spec, mesh):
    """x laid out as `spec` says on the mesh's Explicit axes (a shard_map wants its explicit
    inputs already where its in_specs put them; on Auto axes it moves them itself)."""
    explicit = set(mesh.explicit_axes)
    keep = lambda dim: dim if dim is not None and set(  # noqa: E731
        (dim,) if isinstance(dim, str) else dim) <= explicit else None
    spec = P(*(keep(dim) for dim in tuple(spec) + (None,) * (x.ndim - len(spec))))
    current = tuple(jax.typeof(x).sharding.spec)
    if current + (None,) * (x.ndim - len(current)) == tuple(spec):
        return x
    return jax.sharding.reshard(x, NamedSharding(mesh, spec))


def moe_mlp(x, params, *, mesh=None, axis_name=None, top_k, capacity_factor=None,
            compute_dtype=jnp.float32, token_axes=None, seq_axes=None, tensor_axes=None,
            fp8=False):
    """Mixture-of-experts SwiGLU MLP with the experts split over mesh axis `axis_name`.

    x: GLOBAL [batch, seq, embed]; batch split over `token_axes` and the expert axis, seq over
      `seq_axes`, embed whole (x is moved there if it arrives laid out otherwise).
    params: {"router": [embed, E], "gate": [E, embed, mlp], "up": [E, embed, mlp],
      "down": [E, mlp, embed]}, any dtype (float32 master weights); experts dim split over
      the expert axis, mlp over `tensor_axes`.
    mesh: a Mesh or AbstractMesh; None (the default): the mesh set with `jax.set_mesh`, and with
      none set, one device (all experts local, no collectives, the numbers of a one-device mesh).
      Its axes may be Explicit or Auto; axes it has besides the ones below are left alone (on
      Explicit ones the inputs are gathered). Axes already manual (inside an enclosing
      shard_map, such as the pipeline's `pipe`) are the caller's: y and stats are per block of
      them.
    axis_name: the expert axis, None for BASE_RULES["experts"] ('expert'); a name that is not a
      mesh axis is a ValueError, a default that is not one means no expert parallelism.
    token_axes, seq_axes, tensor_axes: mesh axes of tokens along the batch, of tokens along the
      sequence, of the hidden units; None for BASE_RULES "batch" (data, fsdp, expert), "seq"
      (context), "mlp" (tensor). Names the mesh lacks, and axes of size 1, are skipped; the
      three must not share an axis (ValueError).
    capacity_factor: None for dropless, else slots per expert per source device =
      ceil(capacity_factor * local_tokens * top_k / E) (see the module docstring for who drops).
    compute_dtype: dtype of the expert matmuls; routing, combine and statistics are float32.
    fp8: the expert matmuls in float8 instead (`swiglu_experts`), scales global over the mesh.

    Collectives: all_to_all over the expert axis twice forward (dispatch, return) and twice
    backward; psum over `tensor_axes` of the down projection; psum of router statistics over
    the token axes. Returns (y [batch, seq, embed] in x.dtype, laid out like x on Explicit axes,
    stats) with stats = {aux_loss [], z_loss [], dropped_fraction [] (dropped (token, choice)
    pairs / all pairs), expert_load [E] int32 ((token, choice) pairs routed to each expert,
    before dropping)}, all global.
    """
    mesh = jax.sharding.get_abstract_mesh() if mesh is None else mesh
    if axis_name is not None and axis_name not in mesh.axis_names:
        raise ValueError(f"mesh has no axis {axis_name!r}; its axes are {mesh.axis_names}")
    expert_axes = _mesh_axes(mesh, BASE_RULES["experts"] if axis_name is None else axis_name)
    token_axes = _mesh_axes(mesh, BASE_RULES["batch"] if token_axes is None else token_axes)
    token_axes += tuple(a for a in expert_axes if a not in token_axes)
    seq_axes = _mesh_axes(mesh, BASE_RULES["seq"] if seq_axes is None else seq_axes)
    tensor_axes = _mesh_axes(mesh, BASE_RULES["mlp"] if tensor_axes is None else tensor_axes)
    sizes = dict(mesh.shape)
    _check_shapes(x, params, sizes, expert_axes, token_axes, seq_axes, tensor_axes)
    expert_devices = math.prod(sizes[a] for a in expert_axes)
    program, in_specs = _moe_program(mesh, expert_axes, expert_devices, token_axes, seq_axes,
                                     tensor_axes, top_k, capacity_factor, jnp.dtype(compute_dtype),
                                     fp8)
    args = (x, params["router"], params["gate"], params["up"], params["down"])
    if mesh.empty:
        return program(*args)
    x_spec = tuple(jax.typeof(x).sharding.spec)
    args = [_on_explicit_axes(a, spec, mesh) for a, spec in zip(args, in_specs)]
    y, stats = program(*args)
    return _on_explicit_axes(y, x_spec, mesh), stats


def _expert_parallel_layer(expert_axes, expert_devices, token_axes, seq_axes, tensor_axes,
                           top_k, capacity_factor, compute_dtype, fp8=False):
    """The layer on one device's block of tokens, with all experts' weights for the experts it
    holds (all of them when `expert_axes` is empty)."""
    all_token_axes = token_axes + seq_axes

    def local(x_block, router_w, gate, up, down):
        batch, seq, embed = x_block.shape
        num_experts = router_w.shape[-1]
        local_experts = num_experts // expert_devices
        tokens = x_block.reshape(batch * seq, embed)  # [T, embed]
        routing = route(tokens, router_w, top_k=top_k, token_axes=all_token_axes)
        capacity = expert_capacity(batch * seq, num_experts, top_k, capacity_factor)

        # Buffer row of each (token, choice): expert * capacity + position; E * capacity if dropped.
        position = slot_positions(routing.expert_index, num_experts)  # [T, top_k]
        kept = position < capacity
        row = jnp.where(kept, routing.expert_index * capacity + position, num_experts * capacity)
        source_token = jnp.full(num_experts * capacity, batch * seq, jnp.int32)
        source_token = source_token.at[row.reshape(-1)].set(
            jnp.repeat(jnp.arange(batch * seq, dtype=jnp.int32), top_k), mode="drop")
        padded = jnp.concatenate([tokens, jnp.zeros((1, embed), tokens.dtype)])  # empty slot -> 0
        send = padded[source_token].astype(compute_dtype)  # [E * capacity, embed]

        # Dispatch: block j of the experts dim goes to expert device j; rows come back grouped by
        # source device: [sources * local_experts * capacity, embed].
        def swap(a):  # exchange blocks of the leading dim within the expert group
            return jax.lax.all_to_all(a, expert_axes, 0, 0, tiled=True) if expert_axes else a

        received = swap(send).reshape(expert_devices, local_experts, capacity, embed)
        received = received.transpose(1, 0, 2, 3).reshape(local_experts, -1, embed)

        out = swiglu_experts(received, gate, up, down, compute_dtype,  # [local_E, src * C, embed]
                             fp8, tuple(dict.fromkeys(all_token_axes + expert_axes + tensor_axes)))
        if tensor_axes:
            out = jax.lax.psum(out, tensor_axes)  # sum the partial products of the mlp slices
        out = out.astype(compute_dtype).reshape(local_experts, expert_devices, capacity, embed)
        out = out.transpose(1, 0, 2, 3).reshape(num_experts * capacity, embed)

        # Return: inverse of the dispatch; rows are in this device's own [E * capacity] layout.
        per_choice = swap(out).at[row].get(mode="fill", fill_value=0)  # [T, top_k, embed]
        y = jnp.einsum("tk,tkd->td", routing.expert_weight, per_choice.astype(jnp.float32))

        dropped = jnp.sum(~kept).astype(jnp.float32)
        if all_token_axes:
            dropped = jax.lax.psum(dropped, all_token_axes)
        stats = {
            "aux_loss": routing.aux_loss,
            "z_loss": routing.z_loss,
            "dropped_fraction": dropped / jnp.sum(routing.expert_load).astype(jnp.float32),
            "expert_load": routing.expert_load,
        }
        return y.astype(x_block.dtype).reshape(batch, seq, embed), stats

    return local


@functools.lru_cache(maxsize=64)
def _moe_program(mesh, expert_axes, expert_devices, token_axes, seq_axes, tensor_axes, top_k,
                 capacity_factor, compute_dtype, fp8=False):
    """(the jitted layer, its in_specs): one shard_map manual over the axes it uses (a plain
    function when it uses none). Jitted and cached, so that a call outside `jax.jit` compiles
    once rather than running the shard_map's body op by op."""
    local = _expert_parallel_layer(expert_axes, expert_devices, token_axes, seq_axes,
                                   tensor_axes, top_k, capacity_factor, compute_dtype, fp8)
    tensor = tensor_axes or None
    expert = expert_axes or None
    in_specs = (P(token_axes or None, seq_axes or None, None), P(), P(expert, None, tensor),
                P(expert, None, tensor), P(expert, tensor, None))
    manual = set(expert_axes + token_axes + seq_axes + tensor_axes)
    if mesh.empty or not manual:
        program = jax.jit(local)
    else:
        stats_spec = {"aux_loss": P(), "z_loss": P(), "dropped_fraction": P(), "expert_load": P()}
        program = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=in_specs,
                                        out_specs=(in_specs[0], stats_spec), axis_names=manual))
    return program, in_specs
