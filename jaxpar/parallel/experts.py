"""Mixture-of-experts MLP with expert parallelism: route, all-to-all dispatch, experts, combine.

One `jax.shard_map`, manual over the mesh axes the layer uses. Which axes those are comes from
the rules in force (`jaxpar.sharding.rules_in_force`: the layout's inside `Layout.scope()`, the
default `BASE_RULES` outside): tokens are split along the batch over `batch` (by default data,
fsdp, expert) and along the sequence over `seq` (context), the experts over `experts` (expert),
the hidden units over `mlp` (tensor); an axis the mesh lacks is skipped, an axis it has besides
these is left alone. Each device routes its own tokens, packs
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
device holds all experts and the all-to-alls are skipped. Routing (`jaxpar.parallel.routing`):
softmax or DeepSeek-V3's sigmoid with a correction bias and expert groups, top_k experts per
token, weights renormalised over the top_k when top_k > 1 and the plain score when top_k = 1.

Two dispatches (`moe_mlp(dispatch=...)`, model.moe.dispatch). The above is "padded": fixed
shapes, and in dropless mode E x local tokens rows of mostly padding per device. "ragged"
(dropless only) moves and multiplies exactly the routed rows:

    x [T, embed] --route, sort the (token, choice) rows by expert--> send [T * top_k, embed]
        --all_gather(expert) of the rows per expert, [devices, E] int32: every offset below--
        --ragged_all_to_all(expert)--> received [R, embed], grouped by local expert
        --SwiGLU as grouped GEMMs (`jax.lax.ragged_dot`, psum over `tensor`)-->
        --ragged_all_to_all(expert) back--> [T * top_k, embed] --unsort, weight, sum--> y

Inside an expert the rows keep the padded path's choice-major order. Each expert is one slice
of the exchange, so a receiver's buffer comes out with its local expert 0's rows from sources
0, 1, ..., then local expert 1's, ..., which is the layout the grouped GEMM takes (no sort on
the receiving side). Without an expert axis there is no exchange: sort, grouped GEMMs, unsort.

The receive buffer needs a static size R (`ragged_receive_rows`). By default it is the worst
case, expert devices x T x min(top_k, local experts) rows (every source sends all its tokens'
choices of this device's experts), so nothing is dropped, ever; with one expert per device that
equals the padded path's receive buffer, and only the send side, T * top_k rows instead of
E x T, is smaller. `buffer_factor` (model.moe.ragged_buffer_factor) f sizes it
ceil(f x T x top_k) rows instead (f = 1 is the balanced load): a step whose routing sends a
device more rows than that drops the excess, by a fixed rule -- the receiver's buffer fills in
the order above, local expert by expert and source by source, so later experts and sources of
the overfull device lose rows, and inside an expert a slice loses its last rows (second choices
before first ones). Dropped rows contribute zero, as in capacity mode, and `dropped_fraction`
counts them: nothing is dropped silently.

XLA:CPU cannot compile the exchange ("HLO opcode `ragged-all-to-all` is not supported by
XLA:CPU", checked on jax and jaxlib 0.12.0.1); `ragged_dot` it can. So on CPU devices "auto"
is "padded", and an explicit "ragged" with an expert axis is refused before anything compiles
(a ConfigError); without an expert axis ragged runs on CPU too. On GPU (jax 0.12, default XLA
flags) the compiled program has the ragged-all-to-all collective, and XLA turns each
`ragged_dot` into one dense GEMM over the received buffer whose contraction runs over all L
local experts' weights, each row's input zero outside its own expert's block: a plain GEMM with
one expert per device, L times the matmul work (and an L times wider masked input) with L local
experts (read from the compiled H100 program, jax 0.12.0.1). Against the padded path's E x T
rows per device that is min(top_k, L) times its matmul work with the worst-case buffer (equal
with one expert per device, or top-1), f x top_k / expert devices times with a buffer factor f;
"auto" takes ragged only where that is at most 1, or where a buffer factor is set. XLA's cuDNN
grouped-GEMM fusion
(--xla_gpu_experimental_use_ragged_dot_fusion=true) picks its configuration on a real GPU and
does not compile on this GPU-less machine, so it is untested here. "ragged" has no float8 form:
with fp8, "auto" is "padded" and an explicit "ragged" is refused.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpar.ops.fp8 import fp8_einsum
from jaxpar.ops.swiglu import swiglu
from jaxpar.parallel.routing import RouterSpec, Routing, route  # noqa: F401 (route: re-exported)
from jaxpar.sharding import rules_in_force, varying_axes


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
    """Batched SwiGLU (`jaxpar.ops.swiglu`) over a group of experts: down(silu(h @ gate) * (h @ up)).

    h: [experts, slots, embed]; gate, up: [experts, embed, mlp]; down: [experts, mlp, embed].
    Returns [experts, slots, embed] float32 (a partial sum if `mlp` is a slice of the hidden dim).
    fp8: the three matmuls in float8 (jaxpar.ops.fp8), each operand scaled by its amax over
    the whole tensor: `amax_axes` are the manual mesh axes its pieces are spread over.
    """
    if fp8:
        return swiglu(
            h.astype(compute_dtype),
            gate,
            up,
            down,
            project_in=lambda x, w: fp8_einsum("esd,edm->esm", x, w, amax_axes),
            project_out=lambda x, w: fp8_einsum("esm,emd->esd", x, w, amax_axes, jnp.float32),
        )
    h, gate, up, down = _varying_alike(h, gate, up, down)
    h, gate, up, down = (a.astype(compute_dtype) for a in (h, gate, up, down))
    return swiglu(
        h,
        gate,
        up,
        down,
        project_in=functools.partial(jnp.einsum, "esd,edm->esm"),
        project_out=lambda x, w: float32_out(functools.partial(jnp.einsum, "esm,emd->esd"), x, w),
    )


def _varying_alike(*arrays):
    """`arrays` (the tokens and the expert weights) each marked varying (inside a shard_map)
    along every manual axis any of them varies along, in float32 where a mark is added, before
    their cast to compute_dtype -- as the einsums would mark them after it. Each mark's transpose,
    the psum of that array's gradient over those axes, then runs in float32, not in a 16-bit
    compute_dtype: a bfloat16 psum inside a shard_map manual over only some of the mesh's axes
    lowers its reducer with a sharding op (a `copy` root after the partitioner), and XLA:CPU's
    AllReducePromotion (bf16 -> f32) aborts on it ("Invalid binary instruction opcode copy"):
    the weights' gradients over the token axes, the tokens' over tensor. A float32 model is
    unchanged (the same marks, moved before a no-op cast)."""
    axes = frozenset().union(*(varying_axes(a) for a in arrays))

    def mark(a):
        missing = tuple(sorted(axes - varying_axes(a)))
        return jax.lax.pcast(a.astype(jnp.float32), missing, to="varying") if missing else a

    return tuple(mark(a) for a in arrays)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def float32_out(project, x, w, *args):
    """project(x, w, *args, preferred_element_type=float32): a GEMM of x and w (same dtype)
    written in float32 (the down projection, whose partial sums over `tensor` are added in
    float32). Its backward rounds the incoming float32 gradient to x's dtype first, so both
    gradient GEMMs take two x.dtype operands with float32 accumulation; autodiff would have
    multiplied the float32 gradient by the upcast operands (float32 x float32 GEMMs, the
    experts' down projection in the H100 program). `args`: non-differentiable extras (the
    group sizes of a grouped GEMM)."""
    return project(x, w, *args, preferred_element_type=jnp.float32)


def _float32_out_fwd(project, x, w, *args):
    return float32_out(project, x, w, *args), (x, w, args)


def _float32_out_bwd(project, residuals, g):
    x, w, args = residuals
    _, vjp = jax.vjp(lambda a, b: project(a, b, *args), x, w)
    return (*vjp(g.astype(x.dtype)), *(None for _ in args))


float32_out.defvjp(_float32_out_fwd, _float32_out_bwd)


def _mesh_axes(mesh, names):
    """The axes among `names` that the layer splits over: mesh axes of size > 1 that are not
    already manual (an enclosing shard_map's). Others are skipped."""
    names = (names,) if isinstance(names, str) else tuple(names)
    kinds = dict(zip(mesh.axis_names, mesh.axis_types))
    return tuple(
        name
        for name in names
        if name in kinds and mesh.shape[name] > 1 and kinds[name] != jax.sharding.AxisType.Manual
    )


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

    def keep(dim):
        names = (dim,) if isinstance(dim, str) else dim
        return dim if dim is not None and set(names) <= explicit else None

    spec = P(*(keep(dim) for dim in tuple(spec) + (None,) * (x.ndim - len(spec))))
    current = tuple(jax.typeof(x).sharding.spec)
    if current + (None,) * (x.ndim - len(current)) == tuple(spec):
        return x
    return jax.sharding.reshard(x, NamedSharding(mesh, spec))


def _layer_axes(mesh, axis_name, token_axes, seq_axes, tensor_axes):
    """The mesh axes of the experts, the tokens along the batch and the sequence, and the hidden
    units: the names given, else the rules in force; only axes of `mesh` larger than 1 and not
    already manual."""
    if axis_name is not None and axis_name not in mesh.axis_names:
        raise ValueError(f"mesh has no axis {axis_name!r}; its axes are {mesh.axis_names}")
    rules = rules_in_force()
    expert_axes = _mesh_axes(mesh, rules.get("experts", ()) if axis_name is None else axis_name)
    token_axes = _mesh_axes(mesh, rules.get("batch", ()) if token_axes is None else token_axes)
    token_axes += tuple(a for a in expert_axes if a not in token_axes)
    seq_axes = _mesh_axes(mesh, rules.get("seq", ()) if seq_axes is None else seq_axes)
    tensor_axes = _mesh_axes(mesh, rules.get("mlp", ()) if tensor_axes is None else tensor_axes)
    return expert_axes, token_axes, seq_axes, tensor_axes


def _dispatch_on(
    mesh, dispatch, capacity_factor, fp8, top_k, params, expert_axes, expert_devices, buffer_factor
):
    """`dispatch` resolved for the platform of `mesh` (`resolve_dispatch`); ragged exchanges on
    CPU devices are a ConfigError."""
    device = None if mesh.empty else getattr(mesh.abstract_mesh, "abstract_device", None)
    platform = device.platform if device is not None else jax.default_backend()
    dispatch = resolve_dispatch(
        dispatch,
        capacity_factor,
        platform,
        fp8,
        top_k=top_k,
        local_experts=params["router"].shape[-1] // expert_devices,
        buffer_factor=buffer_factor,
    )
    if (
        dispatch == "ragged"
        and expert_devices > 1
        and platform == "cpu"
        and _ragged_all_to_all is jax.lax.ragged_all_to_all
    ):
        from jaxpar.config import ConfigError

        raise ConfigError(
            f"model.moe.dispatch=ragged with {expert_devices} expert devices "
            f"(mesh axes {expert_axes}) on CPU: XLA:CPU cannot compile ragged-all-to-all; use "
            "model.moe.dispatch=padded (or auto, which picks it on CPU), or mesh.expert=1"
        )
    return dispatch


def moe_mlp(
    x,
    params,
    *,
    mesh=None,
    axis_name=None,
    top_k,
    capacity_factor=None,
    compute_dtype=jnp.float32,
    token_axes=None,
    seq_axes=None,
    tensor_axes=None,
    fp8=False,
    dispatch="auto",
    buffer_factor=None,
    normalize=True,
    router=None,
):
    """Mixture-of-experts SwiGLU MLP with the experts split over mesh axis `axis_name`.

    x: GLOBAL [batch, seq, embed]; batch split over `token_axes` and the expert axis, seq over
      `seq_axes`, embed whole (x is moved there if it arrives laid out otherwise).
    params: {"router": [embed, E], "gate": [E, embed, mlp], "up": [E, embed, mlp], "down":
      [E, mlp, embed], "bias": [E] (optional: the router's correction bias, `route`)}, any dtype
      (float32 master weights); experts dim split over the expert axis, mlp over `tensor_axes`.
    mesh: a Mesh or AbstractMesh; None (the default): the mesh set with `jax.set_mesh`, and with
      none set, one device (all experts local, no collectives, the numbers of a one-device mesh).
      Its axes may be Explicit or Auto; axes it has besides the ones below are left alone (on
      Explicit ones the inputs are gathered). Axes already manual (inside an enclosing
      shard_map, such as the pipeline's `pipe`) are the caller's: y and stats are per block of
      them.
    axis_name: the expert axis, None for the `experts` rule in force (by default 'expert'); a
      name that is not a mesh axis is a ValueError, a default that is not one means no expert
      parallelism.
    token_axes, seq_axes, tensor_axes: mesh axes of tokens along the batch, of tokens along the
      sequence, of the hidden units; None for the rules in force for "batch" (by default data,
      fsdp, expert), "seq" (context), "mlp" (tensor). Names the mesh lacks, and axes of size 1,
      are skipped; the three must not share an axis (ValueError).
    capacity_factor: None for dropless, else slots per expert per source device =
      ceil(capacity_factor * local_tokens * top_k / E) (see the module docstring for who drops).
    compute_dtype: dtype of the expert matmuls; routing, combine and statistics are float32.
    fp8: the expert matmuls in float8 instead (`swiglu_experts`), scales global over the mesh.
    dispatch: "padded" ([experts, capacity] buffers, all_to_all, batched einsum), "ragged"
      (exactly the routed rows, ragged_all_to_all, grouped GEMMs; dropless only, no fp8), or
      "auto": ragged on GPU devices when dropless without fp8 and no more matmul work than
      padded (`resolve_dispatch`), padded otherwise. Explicit "ragged" with an expert axis on CPU devices is a
      ConfigError (XLA:CPU has no ragged-all-to-all).
    normalize: top_k > 1: the chosen experts' weights renormalised to sum 1 (`route`); router:
    a `RouterSpec` (scoring, groups, scale, sequence-wise loss), None: softmax.
    buffer_factor: ragged dispatch with an expert axis: the receive buffer's rows, as a multiple
      of the balanced load tokens * top_k; None: the worst case (`ragged_receive_rows`).

    Collectives: all_to_all (padded; ragged: an all_gather of the per-expert row counts, then
    ragged_all_to_all) over the expert axis twice forward (dispatch, return) and twice
    backward; psum over `tensor_axes` of the down projection; psum of router statistics over
    the token axes. Returns (y [batch, seq, embed] in x.dtype, laid out like x on Explicit axes,
    stats) with stats = {aux_loss [], z_loss [], dropped_fraction [] (dropped (token, choice)
    pairs / all pairs), expert_load [E] int32 ((token, choice) pairs routed to each expert,
    before dropping), and with router.seq_aux seq_aux_loss []}, all global.
    """
    mesh = jax.sharding.get_abstract_mesh() if mesh is None else mesh
    expert_axes, token_axes, seq_axes, tensor_axes = _layer_axes(
        mesh, axis_name, token_axes, seq_axes, tensor_axes
    )
    _check_shapes(x, params, dict(mesh.shape), expert_axes, token_axes, seq_axes, tensor_axes)
    expert_devices = math.prod(dict(mesh.shape)[a] for a in expert_axes)
    dispatch = _dispatch_on(
        mesh, dispatch, capacity_factor, fp8, top_k, params, expert_axes, expert_devices, buffer_factor
    )
    layout = (expert_axes, expert_devices, token_axes, seq_axes, tensor_axes)
    options = (top_k, capacity_factor, jnp.dtype(compute_dtype), fp8, dispatch, buffer_factor)
    router = (router or RouterSpec())._replace(normalize=normalize)
    program, in_specs = _moe_program(mesh, *layout, *options, _ragged_all_to_all, router, "bias" in params)
    args = (x, *(params[k] for k in ("router", "gate", "up", "down", "bias") if k in params))
    if mesh.empty:
        return program(*args)
    x_spec = tuple(jax.typeof(x).sharding.spec)
    args = [_on_explicit_axes(a, spec, mesh) for a, spec in zip(args, in_specs)]
    y, stats = program(*args)
    return _on_explicit_axes(y, x_spec, mesh), stats


def _expert_parallel_layer(
    expert_axes,
    expert_devices,
    token_axes,
    seq_axes,
    tensor_axes,
    top_k,
    capacity_factor,
    compute_dtype,
    fp8=False,
    router=RouterSpec(),
):
    """The layer on one device's block of tokens, with all experts' weights for the experts it
    holds (all of them when `expert_axes` is empty)."""
    all_token_axes = token_axes + seq_axes

    def local(x_block, router_w, gate, up, down, bias=None):
        batch, seq, embed = x_block.shape
        num_experts = router_w.shape[-1]
        local_experts = num_experts // expert_devices
        tokens = x_block.reshape(batch * seq, embed)  # [T, embed]
        routing = _route(tokens, router_w, bias, top_k, router, all_token_axes, seq_axes, batch)
        capacity = expert_capacity(batch * seq, num_experts, top_k, capacity_factor)

        # Buffer row of each (token, choice): expert * capacity + position; E * capacity if dropped.
        position = slot_positions(routing.expert_index, num_experts)  # [T, top_k]
        kept = position < capacity
        row = jnp.where(kept, routing.expert_index * capacity + position, num_experts * capacity)
        source_token = jnp.full(num_experts * capacity, batch * seq, jnp.int32)
        source_token = source_token.at[row.reshape(-1)].set(
            jnp.repeat(jnp.arange(batch * seq, dtype=jnp.int32), top_k), mode="drop"
        )
        padded = jnp.concatenate([tokens, jnp.zeros((1, embed), tokens.dtype)])  # empty slot -> 0
        send = padded[source_token].astype(compute_dtype)  # [E * capacity, embed]

        # Dispatch: block j of the experts dim goes to expert device j; rows come back grouped by
        # source device: [sources * local_experts * capacity, embed].
        def swap(a):  # exchange blocks of the leading dim within the expert group
            return jax.lax.all_to_all(a, expert_axes, 0, 0, tiled=True) if expert_axes else a

        received = swap(send).reshape(expert_devices, local_experts, capacity, embed)
        received = received.transpose(1, 0, 2, 3).reshape(local_experts, -1, embed)

        out = swiglu_experts(
            received,
            gate,
            up,
            down,
            compute_dtype,  # [local_E, src * C, embed]
            fp8,
            tuple(dict.fromkeys(all_token_axes + expert_axes + tensor_axes)),
        )
        if tensor_axes:
            out = jax.lax.psum(out, tensor_axes)  # sum the partial products of the mlp slices
        out = out.astype(compute_dtype).reshape(local_experts, expert_devices, capacity, embed)
        out = out.transpose(1, 0, 2, 3).reshape(num_experts * capacity, embed)

        # Return: inverse of the dispatch; rows are in this device's own [E * capacity] layout.
        per_choice = swap(out).at[row].get(mode="fill", fill_value=0)  # [T, top_k, embed]
        y = jnp.einsum("tk,tkd->td", routing.expert_weight, per_choice.astype(jnp.float32))

        stats = _layer_stats(routing, jnp.sum(~kept), all_token_axes)
        return y.astype(x_block.dtype).reshape(batch, seq, embed), stats

    return local


def _route(tokens, router_w, bias, top_k, router, token_axes, seq_axes, rows):
    return route(
        tokens,
        router_w,
        top_k=top_k,
        token_axes=token_axes,
        normalize=router.normalize,
        spec=router,
        bias=bias,
        rows=rows,
        seq_axes=seq_axes,
    )


def _layer_stats(routing, dropped, token_axes):
    """The layer's router statistics (`moe_mlp`'s stats), `dropped` this device's dropped
    (token, choice) rows, summed over the token axes."""
    dropped = dropped.astype(jnp.float32)
    if token_axes:
        dropped = jax.lax.psum(dropped, token_axes)
    stats = {
        "aux_loss": routing.aux_loss,
        "z_loss": routing.z_loss,
        "dropped_fraction": dropped / jnp.sum(routing.expert_load).astype(jnp.float32),
        "expert_load": routing.expert_load,
    }
    return stats if routing.seq_aux_loss is None else {**stats, "seq_aux_loss": routing.seq_aux_loss}


# --- Ragged dispatch: exactly the routed rows, grouped GEMMs ------------------------------------

DISPATCHES = ("auto", "padded", "ragged")

# The ragged exchange. XLA:CPU cannot compile it (see the module docstring); the tests swap in
# an equivalent made of all_gathers to check the offset arithmetic on CPU.
_ragged_all_to_all = jax.lax.ragged_all_to_all


def resolve_dispatch(
    dispatch, capacity_factor, platform, fp8=False, *, top_k=1, local_experts=1, buffer_factor=None
):
    """`dispatch` ("auto" | "padded" | "ragged") made concrete for devices of `platform`.

    auto: "ragged" on GPU in dropless mode without fp8 where XLA's lowering of the grouped GEMM
    does no more matmul work than the padded batched one -- min(top_k, local_experts) == 1
    (one expert per device, or top-1), or a `buffer_factor` set (see the module docstring) --
    and "padded" otherwise. An explicit "ragged" with a capacity factor, or with fp8, is a
    ValueError (ragged is dropless, and its grouped GEMM has no float8 form here)."""
    if dispatch not in DISPATCHES:
        raise ValueError(f"dispatch={dispatch!r}: use one of {DISPATCHES}")
    if dispatch == "auto":
        no_more_work = min(top_k, local_experts) == 1 or buffer_factor is not None
        return (
            "ragged"
            if platform in ("gpu", "cuda") and capacity_factor is None and not fp8 and no_more_work
            else "padded"
        )
    if dispatch == "ragged" and capacity_factor is not None:
        raise ValueError(
            f"dispatch='ragged' is dropless: it takes capacity_factor=None, got "
            f"{capacity_factor}; use dispatch='padded' for capacity routing"
        )
    if dispatch == "ragged" and fp8:
        raise ValueError("dispatch='ragged' has no float8 grouped GEMM: use dispatch='padded' with fp8")
    return dispatch


def ragged_receive_rows(tokens, top_k, num_experts, expert_devices, buffer_factor=None):
    """Static row count of the buffer a device receives its experts' rows into (ragged dispatch
    over `expert_devices` devices, each routing `tokens` tokens).

    None: the worst case, expert_devices * tokens * min(top_k, local experts) -- every source
    sends every token's choices of this device's experts -- so nothing is ever dropped. A
    factor: ceil(factor * tokens * top_k), the balanced load times the factor, capped at the
    worst case; rows past it are dropped (see `_ragged_layer`) and counted in dropped_fraction."""
    local_experts = num_experts // expert_devices
    worst = expert_devices * tokens * min(top_k, local_experts)
    if buffer_factor is None:
        return worst
    return max(1, min(worst, math.ceil(buffer_factor * tokens * top_k)))


def grouped_swiglu(rows, group_sizes, gate, up, down, compute_dtype):
    """SwiGLU of rows grouped by expert, as grouped GEMMs (`jax.lax.ragged_dot`): the first
    group_sizes[0] rows through expert 0, the next group_sizes[1] through expert 1, and so on.

    rows: [rows, embed]; group_sizes: [experts] int32 (summing to at most `rows`; rows past the
    sum are not computed); gate, up: [experts, embed, mlp]; down: [experts, mlp, embed].
    Returns [rows, embed] float32, the same numbers as `swiglu_experts` on the same rows."""
    rows, gate, up, down = _varying_alike(rows, gate, up, down)
    rows, gate, up, down = (a.astype(compute_dtype) for a in (rows, gate, up, down))
    return swiglu(
        rows,
        gate,
        up,
        down,
        project_in=lambda x, w: jax.lax.ragged_dot(x, w, group_sizes),
        project_out=lambda x, w: float32_out(jax.lax.ragged_dot, x, w, group_sizes),
    )


def _exclusive_cumsum(a, axis=-1):
    return jnp.cumsum(a, axis=axis) - a


def _ragged_layer(
    expert_axes,
    expert_devices,
    token_axes,
    seq_axes,
    tensor_axes,
    top_k,
    compute_dtype,
    buffer_factor,
    ragged_all_to_all,
    router=RouterSpec(),
):
    """The ragged (dropless) layer on one device's block of tokens; see the module docstring.
    `ragged_all_to_all`: the exchange, `jax.lax.ragged_all_to_all` or an equivalent."""
    all_token_axes = token_axes + seq_axes

    def local(x_block, router_w, gate, up, down, bias=None):
        batch, seq, embed = x_block.shape
        num_experts = router_w.shape[-1]
        n_tokens = batch * seq
        tokens = x_block.reshape(n_tokens, embed)
        routing = _route(tokens, router_w, bias, top_k, router, all_token_axes, seq_axes, batch)

        # This device's (token, choice) rows sorted by expert; inside an expert, choice-major
        # (all first choices in token order, then the second ones), as the padded path queues them.
        queue = routing.expert_index.T.reshape(-1)  # [top_k * T], entry c * T + t
        order = jnp.argsort(queue, stable=True)
        counts = jnp.zeros(num_experts, jnp.int32).at[queue].add(1)  # rows per expert
        send = tokens[order % n_tokens].astype(compute_dtype)  # [top_k * T, embed]

        if not expert_axes:
            out = grouped_swiglu(send, counts, gate, up, down, compute_dtype)
            if tensor_axes:
                out = jax.lax.psum(out, tensor_axes)
            kept_rows = jnp.sum(counts)
        else:
            out, kept_rows = _ragged_experts(
                send,
                counts,
                (gate, up, down),
                expert_axes,
                expert_devices,
                tensor_axes,
                top_k,
                compute_dtype,
                buffer_factor,
                ragged_all_to_all,
            )
        # Unsort: row i of `out` is queue entry order[i].
        per_choice = jnp.zeros_like(out).at[order].set(out).reshape(top_k, n_tokens, embed)
        y = jnp.einsum("tk,ktd->td", routing.expert_weight, per_choice.astype(jnp.float32))

        stats = _layer_stats(routing, top_k * n_tokens - kept_rows, all_token_axes)
        return y.astype(x_block.dtype).reshape(batch, seq, embed), stats

    return local


def _ragged_experts(
    send,
    counts,
    weights,
    expert_axes,
    expert_devices,
    tensor_axes,
    top_k,
    compute_dtype,
    buffer_factor,
    ragged_all_to_all,
):
    """Rows `send` (sorted by expert, `counts` per expert) through the experts spread over
    `expert_axes` and back: sizes gathered, one ragged exchange there, the grouped GEMMs, one
    back. Returns (the rows in `send`'s order, dropped rows 0; how many were kept)."""
    gate, up, down = weights
    num_experts = counts.shape[0]
    local_experts = num_experts // expert_devices
    n_tokens = send.shape[0] // top_k
    embed = send.shape[1]
    me = jax.lax.axis_index(expert_axes)
    # Sizes first: every device's rows per expert, [source, expert].
    all_counts = jax.lax.all_gather(counts, expert_axes, axis=0, tiled=False)
    sent = all_counts.reshape(expert_devices, expert_devices, local_experts)  # [s, j, l]
    # Receiver j's buffer: its local expert 0's rows from sources 0, 1, ..., then local
    # expert 1's, ...: each expert's rows contiguous, ready for the grouped GEMM.
    expert_start = _exclusive_cumsum(jnp.sum(sent, axis=0), axis=-1)  # [j, l]
    chunk_start = expert_start[None] + _exclusive_cumsum(sent, axis=0)  # [s, j, l]
    rows = ragged_receive_rows(n_tokens, top_k, num_experts, expert_devices, buffer_factor)
    # Rows past the buffer are not sent (only with a buffer factor below the worst case).
    kept = jnp.clip(rows - chunk_start, 0, sent)  # [s, j, l]
    # A slice that starts past the buffer sends nothing; keep its offset in range anyway.
    chunk_start = jnp.minimum(chunk_start, rows)
    source_start = _exclusive_cumsum(all_counts, axis=-1)  # [s, e]: where s's rows start

    def exchange(operand, out_rows, input_offsets, send_sizes, output_offsets, recv_sizes):
        # Zeros varying over the expert axes like `operand`: an unvarying buffer would
        # have to be made varying, whose gradient is a psum of the whole buffer.
        output = jax.lax.full_like(operand, 0, shape=(out_rows, embed))
        return ragged_all_to_all(
            operand,
            output,
            input_offsets,
            send_sizes,
            output_offsets,
            recv_sizes,
            axis_name=expert_axes,
        )

    # One slice per expert: slice e goes to device e // local_experts.
    received = exchange(
        send,
        rows,
        source_start[me],
        kept[me].reshape(-1),
        chunk_start[me].reshape(-1),
        kept[:, me].reshape(-1),
    )
    group_sizes = jnp.sum(kept[:, me], axis=0)  # [local_experts]
    out = grouped_swiglu(received, group_sizes, gate, up, down, compute_dtype)
    if tensor_axes:
        out = jax.lax.psum(out, tensor_axes)  # sum the partial products of the mlp slices
    # Back: each slice to its source, at the place it was sent from; dropped rows stay 0.
    out = exchange(
        out.astype(compute_dtype),
        top_k * n_tokens,
        chunk_start[:, me].reshape(-1),
        kept[:, me].reshape(-1),
        jax.lax.dynamic_slice_in_dim(source_start, me * local_experts, local_experts, axis=1).reshape(-1),
        kept[me].reshape(-1),
    )
    kept_rows = jnp.sum(kept[me])
    return out, kept_rows


@functools.lru_cache(maxsize=64)
def _moe_program(
    mesh,
    expert_axes,
    expert_devices,
    token_axes,
    seq_axes,
    tensor_axes,
    top_k,
    capacity_factor,
    compute_dtype,
    fp8=False,
    dispatch="padded",
    buffer_factor=None,
    exchange=None,
    router=RouterSpec(),
    biased=False,
):
    """(the jitted layer, its in_specs): one shard_map manual over the axes it uses (a plain
    function when it uses none). Jitted and cached, so that a call outside `jax.jit` compiles
    once rather than running the shard_map's body op by op. `exchange`: the ragged exchange the
    layer is traced with (part of the cache key, so that swapping it retraces). `router`: the
    `RouterSpec`; `biased`: the layer takes the router's correction bias as a last argument."""
    if dispatch == "ragged":
        local = _ragged_layer(
            expert_axes,
            expert_devices,
            token_axes,
            seq_axes,
            tensor_axes,
            top_k,
            compute_dtype,
            buffer_factor,
            exchange,
            router,
        )
    else:
        local = _expert_parallel_layer(
            expert_axes,
            expert_devices,
            token_axes,
            seq_axes,
            tensor_axes,
            top_k,
            capacity_factor,
            compute_dtype,
            fp8,
            router,
        )
    tensor = tensor_axes or None
    expert = expert_axes or None
    in_specs = (
        P(token_axes or None, seq_axes or None, None),
        P(),
        P(expert, None, tensor),
        P(expert, None, tensor),
        P(expert, tensor, None),
    ) + ((P(),) if biased else ())
    manual = set(expert_axes + token_axes + seq_axes + tensor_axes)
    if mesh.empty or not manual:
        program = jax.jit(local)
    else:
        stats_spec = dict.fromkeys(["aux_loss", "z_loss", "dropped_fraction", "expert_load"], P())
        stats_spec.update(dict.fromkeys(["seq_aux_loss"] if router.seq_aux else [], P()))
        program = jax.jit(
            jax.shard_map(
                local, mesh=mesh, in_specs=in_specs, out_specs=(in_specs[0], stats_spec), axis_names=manual
            )
        )
    return program, in_specs
