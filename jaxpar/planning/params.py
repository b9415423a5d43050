"""The planner's parameter tables: (name, shape, logical names) of every parameter of
`jaxpar.models.llama.Transformer` (`param_table`) and of every adapter matrix of finetune.lora
(`lora_table`), and the elements of parameters, gradients and optimizer state one device holds
of them under a ZeRO stage and the rules of `jaxpar.sharding`, as the trainer places them
(`state_elements`). The memory model (`jaxpar.planning.memory`) and the step-time model
(`jaxpar.planning.step_time`) count in these elements."""

from __future__ import annotations

import math

from jaxpar.config import LoRAConfig, ModelConfig
from jaxpar.models import mla
from jaxpar.models.llama import MTP_AXIS, PREFIX_AXIS, scan_length
from jaxpar.models.moe import dense_prefix
from jaxpar.sharding import Rules, fitted_names, make_rules, state_rules


def param_table(m: ModelConfig) -> list[tuple[str, tuple[int, ...], tuple[str | None, ...]]]:
    """(name, shape, logical names) of every parameter of `jaxpar.models.llama.Transformer`,
    stacked blocks with their leading `layers` axis, the dense prefix's (model.moe.first_dense;
    an irregular model's dense blocks, `ModelConfig.irregular_moe`, whose `blocks` are its MoE
    blocks one a unit) with theirs (tests/test_plan.py checks it against the model itself)."""
    e, v = m.d_model, m.vocab_size
    units = scan_length(m)  # the stacked blocks' leading axis: blocks, or groups of moe.every
    out = [("embedding", (v, e), ("vocab", "embed")), ("final_norm", (e,), ("embed",))]
    if not m.tie_embeddings:
        out.append(("lm_head", (e, v), ("embed", "vocab")))
    if dense_prefix(m):
        out += _block_rows(m, "block_prefix", dense_prefix(m), (PREFIX_AXIS,), False)
    per_unit = (m.n_layers - dense_prefix(m)) // units
    for i in range(per_unit):
        is_moe = m.moe.num_experts > 0 and i == per_unit - 1
        out += _block_rows(m, f"block{i}", units, ("layers",), is_moe)
    if m.mtp.depth:  # multi-token prediction: three norms, the projection and a block per module
        d = m.mtp.depth
        out += [
            ("mtp.norms", (d, 3 * e), (MTP_AXIS, "embed")),
            ("mtp.eh_proj", (d, 2 * e, e), (MTP_AXIS, "mtp_concat", "embed")),
        ]
        out += _block_rows(m, "mtp.block", d, (MTP_AXIS,), m.moe.num_experts > 0)
    return out


def _block_rows(m: ModelConfig, name: str, units: int, L: tuple, is_moe: bool) -> list:
    """`param_table`'s rows of one block `name` of each of `units` stacked units (leading axis
    named `L`)."""
    e, n, k, h = m.d_model, m.n_heads, m.n_kv_heads, m.head_width
    f, moe = m.d_ff, m.moe
    out = [(f"{name}.norms", (units, 2 * e), L + ("embed",))]
    if m.mla.kv_lora_rank:  # latent attention's own table
        out += [(f"{name}.{w}", (units, *shape), L + names) for w, shape, names in mla.weights(m)]
    else:
        out += [
            (f"{name}.wq", (units, e, n, h), L + ("embed", "heads", "head_dim")),
            (f"{name}.wkv", (units, e, 2 * k, h), L + ("embed", "kv_heads", "head_dim")),
            (f"{name}.wo", (units, n, h, e), L + ("heads_in", "head_dim", "embed")),
        ]
    if not is_moe:
        return out + [
            (f"{name}.w_gate_up", (units, e, 2 * f), L + ("embed", "mlp")),
            (f"{name}.w_down", (units, f, e), L + ("mlp_in", "embed")),
        ]
    ff, ne = moe.d_ff or f, moe.num_experts
    out += [
        (f"{name}.router", (units, e, ne), L + ("embed", None)),
        (f"{name}.experts_gate_up", (units, ne, e, 2 * ff), L + ("experts", "embed", "mlp")),
        (f"{name}.experts_down", (units, ne, ff, e), L + ("experts", "mlp", "embed")),
    ]
    if moe.shared_experts:
        s = moe.shared_experts * ff
        out += [
            (f"{name}.shared_gate_up", (units, e, 2 * s), L + ("embed", "mlp")),
            (f"{name}.shared_down", (units, s, e), L + ("mlp", "embed")),
        ]
    return out


def _local_elements(shape, names, sizes: dict[str, int], rules: Rules) -> int:
    """Elements one device holds of a parameter under `rules` (jaxpar.sharding's, as the trainer
    places that kind of state: each mesh axis used once, axes of size 1 skipped)."""
    used, total = set(), 1
    for dim, name in zip(shape, names):
        axes = rules.get(name, ()) if name is not None else ()
        split = 1
        for axis in axes:
            if axis not in used and sizes.get(axis, 1) > 1:
                used.add(axis)
                split *= sizes[axis]
        total *= -(-dim // split)
    return total


def lora_table(m: ModelConfig, lora: LoRAConfig) -> list[tuple[str, tuple[int, ...], tuple[str | None, ...]]]:
    """(name, shape, logical names) of every adapter matrix of finetune.lora (none at rank 0), as
    `jaxpar.models.lora` adds them: for each targeted weight of each block, A [in, rank] with the
    weight's first in-dim name on its rows and B [rank, out] with its first out-dim name on its
    columns (in- and out-dims flattened), stacked over the layers as the blocks are."""
    if lora.rank <= 0:
        return []
    e, r, f = m.d_model, lora.rank, m.d_ff
    q, kv = m.n_heads * m.head_width, m.n_kv_heads * m.head_width
    # target -> (in width, its logical name, out width, its logical name)
    dims = {
        "q": (e, "embed", q, "heads"),
        "k": (e, "embed", kv, "kv_heads"),
        "v": (e, "embed", kv, "kv_heads"),
        "o": (q, "heads_in", e, "embed"),
        "gate": (e, "embed", f, "mlp"),
        "up": (e, "embed", f, "mlp"),
        "down": (f, "mlp_in", e, "embed"),
    }
    units, prefix = scan_length(m), dense_prefix(m)
    stacks = [("block_prefix", prefix, PREFIX_AXIS)] if prefix else []
    stacks += [(f"block{i}", units, "layers") for i in range((m.n_layers - prefix) // units)]
    out = []
    for name, count, axis in stacks:
        for target in lora.targets:
            fan_in, in_name, fan_out, out_name = dims[target]
            out += [
                (f"{name}.{target}_lora_a", (count, fan_in, r), (axis, in_name, None)),
                (f"{name}.{target}_lora_b", (count, r, fan_out), (axis, None, out_name)),
            ]
    return out


# `state_elements` answers by (model, adapters, mesh sizes, ZeRO stage): the search asks the same
# question for every remat policy and accumulation of a mesh, three times per layout, and walking
# the table was most of a large cluster's search time (2.8 ms of a layout's ~3 ms for the 671B).
_STATE_CACHE: dict[tuple, dict[str, int]] = {}
_STATE_CACHE_SIZE = 1 << 16


def state_elements(
    m: ModelConfig, sizes: dict[str, int], zero_stage: int, lora: LoRAConfig | None = None
) -> dict[str, int]:
    """`_state_elements`, remembered (a fresh copy each call): the key is the model's and the
    adapters' settings as written out (`repr`), so an edited config is a new question."""
    key = (repr(m), repr(lora), tuple(sorted(sizes.items())), zero_stage)
    if key not in _STATE_CACHE:
        if len(_STATE_CACHE) >= _STATE_CACHE_SIZE:
            _STATE_CACHE.clear()
        _STATE_CACHE[key] = _state_elements(m, sizes, zero_stage, lora)
    return dict(_STATE_CACHE[key])


def _state_elements(
    m: ModelConfig, sizes: dict[str, int], zero_stage: int, lora: LoRAConfig | None = None
) -> dict[str, int]:
    """Elements per device of the parameters, gradients and one optimizer moment; the model's
    parameter count (`total`), the adapters' (`adapters`, with finetune.lora `lora`), and the
    blocks' share of the parameters (`blocks_local`, `blocks_gathered`) and of what trains
    (`trained_blocks_local`). With adapters only they have gradients and optimizer state; the
    parameters are the frozen model's and the adapters'."""
    base, adapters = param_table(m), lora_table(m, lora) if lora is not None else []
    rules = state_rules(zero_stage, sequence_parallel=False)
    gathered = make_rules(shard_embed=False, sequence_parallel=False)
    keys = ("params", "gradients", "optimizer", "total", "adapters")
    out = dict.fromkeys(keys + ("blocks_local", "blocks_gathered", "trained_blocks_local"), 0)
    rows = [(False, row) for row in base] + [(True, row) for row in adapters]
    for is_adapter, (name, shape, names) in rows:
        names = fitted_names(names, shape, sizes)  # as the trainer fits them to this mesh
        local = _local_elements(shape, names, sizes, rules["params"])
        out["params"] += local
        out["adapters" if is_adapter else "total"] += math.prod(shape)
        trains = is_adapter or not adapters
        if trains:
            out["gradients"] += _local_elements(shape, names, sizes, rules["grads"])
            out["optimizer"] += _local_elements(shape, names, sizes, rules["opt_state"])
        if name.startswith("block"):
            out["blocks_local"] += local
            out["blocks_gathered"] += _local_elements(shape, names, sizes, gathered)
            out["trained_blocks_local"] += local if trains else 0
    return out
