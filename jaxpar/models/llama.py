"""A Llama-style decoder in Flax NNX, written once for every layout.

    tokens -> embedding -> [RMSNorm -> GQA attention (RoPE) -> + -> RMSNorm -> SwiGLU -> +] x L
           -> RMSNorm -> output head (optionally the embedding, transposed) -> logits

Every parameter carries logical axis names, and the activations that matter are pinned with
`constrain(x, names)`; `jaxpar.sharding` turns names into mesh axes under the mesh and rules of
the step (`Layout.scope`). The model names no mesh axis and builds no sharding. Two techniques
need the mesh itself and read it from JAX's mesh context, their axes from the rules in force:
ring attention (when the model was built with a `context_layout`, i.e. mesh.context > 1) over
the `seq` rule's axis, and the MoE all-to-all. Blocks are stacked
along a leading `layers` axis and run with `lax.scan`, so compile time does not grow with depth;
`model.scan_layers: false` writes the same loop out, layer by layer, over the same stacked weights.

Pieces, for callers that run the model in parts (the pipeline, jaxpar.parallel.pipeline):
`embed(tokens)`, `apply_prefix(x, ...)` for an MoE model's dense prefix (model.moe.first_dense),
`run_blocks(layer_params, x, ...)` for any run of the stacked layers, and
`head_loss(head_params(params), h, ...)` for the final norm, output projection and loss.

Parameters, with shapes (E = d_model, N = n_heads, K = n_kv_heads, H = head_dim (model.head_dim,
else E / N), F = d_ff, V = vocab_size, l = layer; their Hugging Face names and layouts are the
families' (`jaxpar.models.families`)):

| jaxpar                        | shape       | when                         |
| ----------------------------- | ----------- | ---------------------------- |
| embedding                     | [V, E]      |                              |
| blocks.attn_norm.scale[l]     | [E]         |                              |
| blocks.attn.wq[l]             | [E, N, H]   |                              |
| blocks.attn.wk[l]             | [E, K, H]   |                              |
| blocks.attn.wv[l]             | [E, K, H]   |                              |
| blocks.attn.bq, bk, bv[l]     | [N or K, H] | model.qkv_bias               |
| blocks.attn.q_norm.scale[l]   | [H]         | model.qk_norm (k_norm alike) |
| blocks.attn.wo[l]             | [N, H, E]   |                              |
| blocks.mlp_norm.scale[l]      | [E]         |                              |
| blocks.post_attn_norm.scale[l]| [E]         | model.post_norms (post_mlp_norm alike) |
| blocks.mlp.w_gate[l]          | [E, F]      | dense MLP                    |
| blocks.mlp.w_up[l]            | [E, F]      | dense MLP                    |
| blocks.mlp.w_down[l]          | [F, E]      | dense MLP                    |
| blocks.mlp.router[l]          | [E, X]      | MoE MLP (X experts)          |
| blocks.mlp.gate, up[l]        | [X, E, F']  | MoE MLP (F' = model.moe.d_ff)|
| blocks.mlp.down[l]            | [X, F', E]  | MoE MLP                      |
| final_norm.scale              | [E]         |                              |
| lm_head                       | [E, V]      | untied                       |
| blocks.attn.wq_lora.lora_a[l] | [E, r]      | finetune.lora (`models.lora`) |
| dense_blocks.<as blocks>[l]   | as blocks   | model.moe.first_dense, dense_layers (below) |
| mtp.enorm, hnorm, norm.scale[k] | [E]       | model.mtp.depth (below)      |
| mtp.eh_proj[k]                | [2E, E]     | model.mtp.depth              |
| mtp.block.<as blocks>[k]      | as blocks   | model.mtp.depth              |

With latent attention (model.mla.kv_lora_rank > 0) `blocks.attn.*` are `jaxpar.models.mla`'s
weights instead. The attention layer itself, RMSNorm, the rotation and the cache are in
`jaxpar.models.layers`.

With model.moe.every = k > 1 the scanned unit is a group of k blocks (`BlockGroup`), the last
with the MoE MLP: `blocks.blocks.{i}.<as above>[g]` is block g * k + i.

With model.moe.first_dense = D > 0 (an MoE model's leading dense blocks, DeepSeek-V3's
first_k_dense_replace) the first D blocks are a stack of their own, `dense_blocks.<as above>[l]`
(dense MLPs of width model.d_ff, leading axis named `dense_layers`), run before `blocks`, which
then holds the other n_layers - D blocks in the pattern above (block g * k + i + D). The prefix
stack is its own scan; in a pipeline it runs before the pipelined `blocks`, as the embedding
does, whole on every stage (`jaxpar.models.objective.pipelined_grads`).

With model.moe.dense_layers making dense a layer the pattern gives experts (an irregular model,
`ModelConfig.irregular_moe`; `ModelConfig.moe_kinds` says which layer has experts) every dense
block is in `dense_blocks.<as above>[l]` (the l-th dense layer) and every MoE block in
`blocks.<as above>[l]` (the l-th MoE layer, plain blocks: no groups). `run_segments` runs each
run of consecutive layers of one kind, in layer order, as a scan over its slice of its stack
(`jaxpar.models.moe.segments`); not in a pipeline (config refuses it).

With model.mtp.depth = D > 0 (DeepSeek-V3's multi-token prediction, training only) `mtp` stacks D
`MTPModule`s (leading axis `mtp_layers`, whole on every device that runs them: the pipeline's
last stage, with the head); `jaxpar.models.mtp` runs them on `hidden`'s output and scores them.
Inference (`__call__`, `decode`) does not run them.

Rotary embeddings use the "rotate half" pairing (dimension i with i + H/2), which is the layout of
Hugging Face's Llama checkpoints, so q/k weights map over without a permutation.

Generation. `Transformer.decode(tokens, positions, cache)` runs the same blocks with a `KVCache`:
each attention layer writes its new keys and values into the cache and attends to every filled
slot up to its own (`python -m jaxpar.sample` drives it: one prefill of the prompt, then one token
at a time). The layer scan is the same scan over the stacked params, also carrying each layer's
slice of the cache.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from jaxpar.config import ModelConfig
from jaxpar.models import lora as lora_lib
from jaxpar.models import mla
from jaxpar.models.layers import Attention, KVCache, RMSNorm
from jaxpar.models.loss import chunked_cross_entropy
from jaxpar.models.mla import LatentAttention
from jaxpar.models.moe import MoEMLP, dense_prefix, expert_d_ff, moe_layers, moe_matmul_params, segments
from jaxpar.models.params import param as _param
from jaxpar.ops.fp8 import einsum as block_einsum
from jaxpar.ops.swiglu import block_swiglu
from jaxpar.sharding import constrain

PREFIX = "dense_blocks"  # the params key (and attribute) of the dense prefix's stack
PREFIX_AXIS = "dense_layers"  # its leading axis' logical name: whole on every pipeline stage
MTP = "mtp"  # the params key (and attribute) of the multi-token prediction modules (jaxpar.models.mtp)
MTP_AXIS = "mtp_layers"  # their leading axis' logical name: whole, with the head, on the last stage
PREFIX_NOISE = 0xDE  # folded into the LoRA dropout path of the prefix's layers (`lora.Noise`)

REMAT_POLICIES = {
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    "full": jax.checkpoint_policies.nothing_saveable,
}


class MLP(nnx.Module):
    """SwiGLU: down(silu(x @ gate) * (x @ up)), or GeGLU with model.mlp_activation (`jaxpar.ops.swiglu`)."""

    def __init__(
        self, cfg: ModelConfig, rngs: nnx.Rngs, d_ff: int | None = None, grad_dtype: str | None = None
    ):
        self.cfg = cfg
        self.grad_dtype = grad_dtype  # the weight gradients' dtype (`jaxpar.ops.fp8.einsum`)
        e, f = cfg.d_model, d_ff or cfg.d_ff
        self.w_gate = _param(rngs, (e, f), ("embed", "mlp"), cfg)
        self.w_up = _param(rngs, (e, f), ("embed", "mlp"), cfg)
        self.w_down = _param(rngs, (f, e), ("mlp_in", "embed"), cfg, cfg.init_std / (2 * cfg.n_layers) ** 0.5)

    def __call__(self, x, noise=None):  # [batch, seq, embed]; noise: LoRA dropout (`lora.Noise`)
        if lora_lib.has_adapters(self):
            matmul = functools.partial(
                block_einsum, fp8=self.cfg.fp8, dtype=jnp.dtype(self.cfg.dtype), grad_dtype=self.grad_dtype
            )
            return lora_lib.adapted_swiglu(self, x, matmul, noise)
        return block_swiglu(
            x,
            self.w_gate[...],
            self.w_up[...],
            self.w_down[...],
            fp8=self.cfg.fp8,
            dtype=jnp.dtype(self.cfg.dtype),
            activation=self.cfg.mlp_activation,
            grad_dtype=self.grad_dtype,
        )


class Block(nnx.Module):
    """Pre-norm transformer block; `moe=True` swaps the dense MLP for a mixture of experts. With
    model.post_norms (Gemma 3) the attention's and the MLP's outputs are normalised too, before
    they join the residual stream."""

    def __init__(
        self,
        cfg: ModelConfig,
        rngs: nnx.Rngs,
        moe: bool = False,
        context_layout: str | None = None,
        grad_dtype: str | None = None,
    ):
        self.attn_norm = RMSNorm(cfg)
        attention = LatentAttention if cfg.mla.kv_lora_rank else Attention
        self.attn = attention(cfg, rngs, context_layout, grad_dtype)
        self.mlp_norm = RMSNorm(cfg)
        self.mlp = MoEMLP(cfg, rngs, grad_dtype) if moe else MLP(cfg, rngs, grad_dtype=grad_dtype)
        if cfg.post_norms:
            self.post_attn_norm = RMSNorm(cfg)
            self.post_mlp_norm = RMSNorm(cfg)

    def __call__(self, x, positions, segment_ids, cache: KVCache | None = None, sliding=None, noise=None):
        """x [batch, seq, embed] -> (x, stats); stats holds the router statistics of an MoE MLP.
        With `cache` (this layer's KVCache): (x, the updated cache) instead. `sliding`: whether
        this layer's attention slides (`Attention`). `noise`: LoRA dropout (`lora.Noise`)."""
        post = hasattr(self, "post_attn_norm")
        if cache is None:
            attn = self.attn(self.attn_norm(x), positions, segment_ids, sliding=sliding, noise=noise)
        else:
            attn, cache = self.attn(self.attn_norm(x), positions, segment_ids, cache, sliding=sliding)
        x = constrain(x + (self.post_attn_norm(attn) if post else attn), ("batch", "act_seq", "embed"))
        h = self.mlp_norm(x)  # an MoE MLP has no adapters (config refuses them there)
        out = self.mlp(h, noise) if noise is not None and lora_lib.has_adapters(self.mlp) else self.mlp(h)
        out, stats = out if isinstance(out, tuple) else (out, {})
        x = constrain(x + (self.post_mlp_norm(out) if post else out), ("batch", "act_seq", "embed"))
        return x, (stats if cache is None else cache)


class BlockGroup(nnx.Module):
    """`model.moe.every` blocks, the last with an MoE MLP: the unit the layer scan repeats when
    MoE layers are interleaved with dense ones."""

    def __init__(
        self,
        cfg: ModelConfig,
        rngs: nnx.Rngs,
        context_layout: str | None = None,
        grad_dtype: str | None = None,
    ):
        every = cfg.moe.every
        self.blocks = nnx.List(
            [Block(cfg, rngs, i == every - 1, context_layout, grad_dtype) for i in range(every)]
        )

    def __call__(self, x, positions, segment_ids, cache: KVCache | None = None, noise=None):
        """Like `Block`; a cache holds the group's layers: k, v [every, batch, max_len, ...]."""
        if cache is not None:
            return self._decode(x, positions, cache)
        stats = {}
        for i, block in enumerate(self.blocks):
            kwargs = {} if noise is None else {"noise": noise.at(i)}
            x, block_stats = block(x, positions, segment_ids, **kwargs)
            stats = block_stats or stats
        return x, stats

    def _decode(self, x, positions, cache: KVCache):
        keys, values = [], []
        for i, block in enumerate(self.blocks):
            x, layer = block(x, positions, None, KVCache(cache.k[i], cache.v[i], cache.length))
            keys.append(layer.k)
            values.append(layer.v)
        return x, KVCache(jnp.stack(keys), jnp.stack(values), layer.length)


class MTPModule(nnx.Module):
    """One multi-token prediction module (DeepSeek-V3, model.mtp): the previous depth's hidden
    states and the embeddings of the tokens k ahead, each RMS-normalised, concatenated (the
    embedding first, as DeepSeek-V3's checkpoints lay out `eh_proj`) and projected from 2E to
    E, then one block of the main model's kind (an MoE block in an MoE model). `norm` is the
    final norm before the shared output head (DeepSeek's `shared_head.norm`)."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, context_layout=None, grad_dtype=None):
        self.cfg = cfg
        self.enorm, self.hnorm, self.norm = RMSNorm(cfg), RMSNorm(cfg), RMSNorm(cfg)
        e = cfg.d_model
        self.eh_proj = _param(rngs, (2 * e, e), ("mtp_concat", "embed"), cfg)
        self.block = Block(cfg, rngs, cfg.moe.num_experts > 0, context_layout, grad_dtype)

    def __call__(self, h, embedded, positions, segment_ids):
        """h: the previous depth's hidden states, embedded: the tokens' embeddings, both [batch,
        seq, embed] -> (this depth's hidden states, the block's router statistics or {})."""
        dtype = jnp.dtype(self.cfg.dtype)
        both = jnp.concatenate([self.enorm(embedded).astype(dtype), self.hnorm(h).astype(dtype)], -1)
        x = constrain(both @ self.eh_proj[...].astype(dtype), ("batch", "act_seq", "embed"))
        return self.block(x, positions, segment_ids)


def check_documents(model: nnx.Module, slots: int) -> nnx.Module:
    """`model` (e.g. an abstract one, for its graphdef) with every attention layer describing
    `slots` document slots per row and making no row NaN: for batches whose rows the host counted
    to hold at most `slots` documents (the training loop's slot buckets, `jaxpar.training.trainer.Trainer.
    step_for`). Only cuDNN's packed attention reads it; the weights are the same."""
    for _, node in nnx.iter_graph(model):
        if isinstance(node, Attention):
            node.document_slots = slots
    return model


def scan_unit(
    cfg: ModelConfig, rngs: nnx.Rngs, context_layout: str | None = None, grad_dtype: str | None = None
) -> nnx.Module:
    """What one step of the layer scan applies: a block, or a group with one MoE block (an
    irregular model's `blocks` are its MoE blocks, one a step)."""
    if cfg.moe.num_experts == 0 or cfg.moe.every == 1 or cfg.irregular_moe():
        return Block(cfg, rngs, cfg.moe.num_experts > 0, context_layout, grad_dtype)
    return BlockGroup(cfg, rngs, context_layout, grad_dtype)


def scan_length(cfg: ModelConfig) -> int:
    """Steps of the layer scan: one per block, or one per group with one MoE block."""
    return moe_layers(cfg) or cfg.n_layers


def sliding_layers(cfg: ModelConfig, count: int | None = None):
    """bool [count]: which of `count` layers (default: all) slide (model.sliding_window: all but
    every model.global_every-th, the last of each run), or None when none does. A run of layers
    that starts at a multiple of global_every (a pipeline chunk, `config` checks) has the same
    pattern as the model's first `count`."""
    if cfg.sliding_window is None:
        return None
    count = cfg.n_layers if count is None else count
    return jnp.asarray([cfg.slides(i) for i in range(count)])


def scan_layers(
    graphdef,
    layer_params,
    x,
    positions,
    segment_ids,
    remat: str = "none",
    sliding=None,
    noise=None,
    scan: bool = True,
    first: int = 0,
):
    """Applies stacked layers (leaves [layers, ...], merged into `graphdef` one at a time) with a
    lax.scan (or, `scan` false, unrolled: `unrolled`), rematerialised per `remat`; `sliding`
    (bool [layers], `sliding_layers`) tells each layer whether its attention slides; `noise`
    (`lora.Noise`, LoRA dropout) reaches each layer with its index in its stack (the first
    here being `first`) folded in. Returns (x, per-layer statistics stacked)."""

    def one_layer(h, scanned):
        params, slides, index = scanned
        kwargs = {} if slides is None else {"sliding": slides}
        if noise is not None:
            kwargs["noise"] = noise.at(index)
        return nnx.merge(graphdef, params)(h, positions, segment_ids, **kwargs)

    if remat != "none":
        one_layer = jax.checkpoint(one_layer, policy=REMAT_POLICIES[remat])
    index = None if noise is None else first + jnp.arange(jax.tree.leaves(layer_params)[0].shape[0])
    if not scan:
        return unrolled(one_layer, x, (layer_params, sliding, index))
    return jax.lax.scan(one_layer, x, (layer_params, sliding, index))


def unrolled(body, carry, xs):
    """`jax.lax.scan(body, carry, xs)` with the loop written out: one copy of `body` per slice
    of xs (leaves [length, ...]; None leaves stay None). The slices come from one `lax.split`
    per leaf, whose transpose is one concatenate: the stacked weights' gradient is assembled
    once, not summed from a padded copy per layer. Returns (carry, body's outputs stacked)."""
    leaves, treedef = jax.tree.flatten(xs)
    length = leaves[0].shape[0]
    pieces = [jax.lax.split(leaf, (1,) * length) for leaf in leaves]
    outputs = []
    for i in range(length):
        carry, out = body(carry, treedef.unflatten([p[i].reshape(p[i].shape[1:]) for p in pieces]))
        outputs.append(out)
    return carry, jax.tree.map(lambda *ys: jnp.stack(ys), *outputs)


def scan_layers_cached(graphdef, layer_params, x, positions, cache: KVCache, sliding=None):
    """`scan_layers` for generation: each scan step also reads and rewrites its layers' slice of
    the cache (k, v [layers, ...], regrouped as [units, layers per unit, ...] when the scanned
    unit is a `BlockGroup`). Returns (x, the cache with x.shape[1] more slots filled)."""
    units = jax.tree.leaves(layer_params)[0].shape[0]
    per_unit = cache.k.shape[0] // units

    def by_unit(a):  # [layers, ...] -> [units, per_unit, ...] (a BlockGroup) or as it is
        return a.reshape(units, per_unit, *a.shape[1:]) if per_unit > 1 else a

    def one_layer(h, scanned):
        params, k, v, slides = scanned
        kwargs = {} if slides is None else {"sliding": slides}
        h, layer = nnx.merge(graphdef, params)(h, positions, None, KVCache(k, v, cache.length), **kwargs)
        return h, (layer.k, layer.v)

    scanned = (layer_params, by_unit(cache.k), by_unit(cache.v), sliding)
    x, (k, v) = jax.lax.scan(one_layer, x, scanned)
    return x, KVCache(k.reshape(cache.k.shape), v.reshape(cache.v.shape), cache.length + x.shape[1])


def lookup(embedding, tokens, dtype, grad_dtype=None):
    """The rows of `embedding` [V, E] (the float32 parameter) for int `tokens`, in `dtype`. The
    table is cast and gathered whole over its embed dim first (a no-op below ZeRO-3).

    The gradient, the rows' gradients added up per token id, is added up in `grad_dtype` (None:
    `dtype`) and cast to the parameter's. Its layout is left to the partitioner: where the
    gradient is split over its embed dim (ZeRO-1 to 3 over fsdp), GSPMD sends each device's
    token rows to the devices owning their columns (one all-to-all of [tokens, E] per step:
    34 MB on 8 H100s for Llama-3.2-1B at 32 x 2048) and each adds up its own columns, where
    pinning it whole made every device build a whole [V, E] table and reduce-scatter it
    (525 MB)."""
    return _lookup(embedding, tokens, jnp.dtype(dtype), jnp.dtype(grad_dtype or dtype))


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _lookup(embedding, tokens, dtype, grad_dtype):
    return constrain(embedding.astype(dtype), ("vocab", None))[tokens]


def _lookup_fwd(embedding, tokens, dtype, grad_dtype):
    # The table's shape and dtype ride along as an empty [V, 0] array.
    like = jnp.zeros((embedding.shape[0], 0), embedding.dtype)
    return _lookup(embedding, tokens, dtype, grad_dtype), (tokens, like)


def _lookup_bwd(dtype, grad_dtype, residuals, g):
    tokens, like = residuals
    table = jnp.zeros((like.shape[0], g.shape[-1]), grad_dtype)
    grad = table.at[tokens].add(g.astype(grad_dtype))
    return grad.astype(like.dtype), None


_lookup.defvjp(_lookup_fwd, _lookup_bwd)


def logits_from(final_norm: RMSNorm, weight, x, dtype):
    """Final norm and output projection: [batch, seq, embed] -> float32 [batch, seq, vocab]."""
    logits = final_norm(x) @ weight.astype(dtype)
    return constrain(logits.astype(jnp.float32), ("batch", "seq", "vocab"))


class Transformer(nnx.Module):
    """The decoder. `remat` (none | dots | full) is what each block keeps for the backward;
    `context_layout` (zigzag | contiguous, or None) makes attention a ring over the mesh's
    `context` axis on inputs already in that layout (the trainer permutes the batch once)."""

    def __init__(
        self,
        cfg: ModelConfig,
        *,
        rngs: nnx.Rngs,
        remat: str = "none",
        context_layout: str | None = None,
        grad_dtype: str | None = None,
    ):
        self.cfg = cfg
        self.remat = remat
        # parallel.grad_reduce_dtype: the dtype the weight gradients are written, and so reduced
        # across devices, in (None: as autodiff gives them: model.dtype, the head's float32).
        self.grad_dtype = grad_dtype
        self.embedding = _param(rngs, (cfg.vocab_size, cfg.d_model), ("vocab", "embed"), cfg)

        @nnx.split_rngs(splits=scan_length(cfg))
        @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
        def stacked_blocks(rngs):
            return scan_unit(cfg, rngs, context_layout, grad_dtype)

        prefix = dense_prefix(cfg)
        if prefix:  # model.moe.first_dense: dense blocks before the MoE pattern, stacked apart

            @nnx.split_rngs(splits=prefix)
            @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: PREFIX_AXIS})
            def stacked_dense(rngs):
                return Block(cfg, rngs, False, context_layout, grad_dtype)

            self.dense_blocks = stacked_dense(rngs)  # leading [dense_layers] axis
        self.blocks = stacked_blocks(rngs)  # every parameter has a leading [layers] axis
        if cfg.mtp.depth:  # model.mtp.depth modules after the model, stacked (jaxpar.models.mtp)

            @nnx.split_rngs(splits=cfg.mtp.depth)
            @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: MTP_AXIS})
            def stacked_mtp(rngs):
                return MTPModule(cfg, rngs, context_layout, grad_dtype)

            self.mtp = stacked_mtp(rngs)  # leading [mtp_layers] axis
        self.final_norm = RMSNorm(cfg)
        if not cfg.tie_embeddings:
            self.lm_head = _param(rngs, (cfg.d_model, cfg.vocab_size), ("embed", "vocab"), cfg)

    def embed(self, tokens):  # [batch, seq] -> [batch, seq, embed]
        # The lookup reads whole rows: gather the table's embed dim first (a no-op below ZeRO-3).
        x = lookup(self.embedding[...], tokens, jnp.dtype(self.cfg.dtype), self.grad_dtype)
        if self.cfg.embed_scale:  # Gemma: x sqrt(d_model), rounded to the activations' dtype
            x = x * jnp.asarray(self.cfg.d_model**0.5, x.dtype)
        return constrain(x, ("batch", "act_seq", "embed"))

    def run_blocks(self, layer_params, x, positions, segment_ids, noise=None):
        """Runs a stack of layers with this model's block structure: `layer_params` is the
        blocks' state as a pure dict, leaves [layers, ...] (all layers, or a pipeline stage's
        run of them). `noise`: LoRA dropout (`lora.Noise`; the whole stack only: the layers are
        numbered from 0). Returns (x, MoE statistics stacked over those layers, or {})."""
        sliding = sliding_layers(self.cfg, jax.tree.leaves(layer_params)[0].shape[0])
        graphdef, remat, scan = nnx.graphdef(self.blocks), self.remat, self.cfg.scan_layers
        return scan_layers(graphdef, layer_params, x, positions, segment_ids, remat, sliding, noise, scan)

    def apply_prefix(self, x, positions, segment_ids, noise=None):
        """Runs the dense prefix (`dense_blocks`, model.moe.first_dense), if the model has one,
        on x [batch, seq, embed]; returns x. `noise`: LoRA dropout (`lora.Noise`), the prefix's
        layers numbered apart from the `blocks` stack's."""
        if not hasattr(self, PREFIX):
            return x
        params = nnx.to_pure_dict(nnx.state(self.dense_blocks))
        noise = None if noise is None else noise.at(PREFIX_NOISE)
        graphdef, remat, scan = nnx.graphdef(self.dense_blocks), self.remat, self.cfg.scan_layers
        return scan_layers(graphdef, params, x, positions, segment_ids, remat, None, noise, scan)[0]

    def apply_blocks(self, x, positions, segment_ids, noise=None):
        """Runs the dense prefix (if any), then the stacked blocks; returns (x, MoE statistics
        stacked over the MoE layers, or {}). An irregular model (model.moe.dense_layers) runs
        its runs of one kind in layer order instead (`run_segments`)."""
        if self.cfg.irregular_moe():
            return self.run_segments(x, positions, segment_ids, noise)
        x = self.apply_prefix(x, positions, segment_ids, noise)
        params = nnx.to_pure_dict(nnx.state(self.blocks))
        return self.run_blocks(params, x, positions, segment_ids, noise)

    def run_segments(self, x, positions, segment_ids, noise=None):
        """An irregular model's layers (`ModelConfig.irregular_moe`): each run of consecutive
        layers of one kind (`moe.segments`) a scan over its slice of its kind's stack, `blocks`
        (the MoE blocks) or `dense_blocks`, in layer order. Returns (x, MoE statistics stacked
        over the MoE layers). `noise`: LoRA dropout, numbered per stack as `apply_blocks` does."""
        stacks = {True: self.blocks, False: self.dense_blocks}
        params = {kind: nnx.to_pure_dict(nnx.state(stack)) for kind, stack in stacks.items()}
        stats = []
        for moe, start, stop in segments(self.cfg):
            run = jax.tree.map(lambda a, start=start, stop=stop: a[start:stop], params[moe])
            run_noise = noise if noise is None or moe else noise.at(PREFIX_NOISE)
            graphdef, remat, scan = nnx.graphdef(stacks[moe]), self.remat, self.cfg.scan_layers
            x, run_stats = scan_layers(
                graphdef, run, x, positions, segment_ids, remat, None, run_noise, scan, start
            )
            stats += [run_stats] if moe else []
        return x, jax.tree.map(lambda *runs: jnp.concatenate(runs), *stats)

    def output_weight(self):
        return self.embedding[...].T if self.cfg.tie_embeddings else self.lm_head[...]

    def head(self, x):  # [batch, seq, embed] -> float32 logits [batch, seq, vocab]
        return logits_from(self.final_norm, self.output_weight(), x, jnp.dtype(self.cfg.dtype))

    def head_params(self, params: dict) -> dict:
        """The part of a pure-dict params tree that `head_loss` reads: the final norm and the
        output projection's weight (the embedding when tied)."""
        out = "embedding" if self.cfg.tie_embeddings else "lm_head"
        return {"final_norm": params["final_norm"], out: params[out]}

    def head_loss(self, head_params: dict, h, targets, loss_mask, *, chunks: int):
        """Final norm, output projection and summed next-token NLL of hidden states h [batch,
        seq, embed], computed in model.dtype with float32 accumulation (jaxpar.models.loss), a
        sequence chunk at a time. Returns (summed NLL, token count)."""
        norm = nnx.merge(nnx.graphdef(self.final_norm), head_params["final_norm"])
        weight = head_params["embedding"].T if self.cfg.tie_embeddings else head_params["lm_head"]
        return chunked_cross_entropy(
            norm(h),
            weight,
            targets,
            loss_mask,
            dtype=jnp.dtype(self.cfg.dtype),
            chunks=chunks,
            grad_dtype=self.grad_dtype,
        )

    def hidden(self, batch: dict):
        """The last hidden states [batch, seq, embed] before the final norm, and the MoE
        statistics (`apply_blocks`), of a batch (inputs, positions, segment_ids)."""
        x = self.embed(batch["inputs"])
        return self.apply_blocks(x, batch["positions"], batch["segment_ids"], lora_lib.noise_of(batch))

    def loss(self, batch: dict, *, chunks: int):
        """The whole model on a batch (inputs, targets, positions, segment_ids, loss_mask):
        (summed NLL, token count, MoE statistics stacked over layers or {}). The logits exist
        for seq / chunks positions at a time (all of them when chunks = 1). A batch that carries
        LoRA dropout seeds (`lora.SEEDS`, a train step's) drops the adapters' inputs."""
        x, stats = self.hidden(batch)
        own = self.head_params(nnx.to_pure_dict(nnx.state(self)))
        nll, count = self.head_loss(own, x, batch["targets"], batch["loss_mask"], chunks=chunks)
        return nll, count, stats

    def __call__(self, tokens, positions, segment_ids):
        """tokens, positions, segment_ids: int [batch, seq] ->
        (float32 logits [batch, seq, vocab], MoE statistics stacked over layers or {})."""
        x, stats = self.apply_blocks(self.embed(tokens), positions, segment_ids)
        return self.head(x), stats

    def decode(self, tokens, positions, cache: KVCache):
        """Generation: tokens, positions int [batch, seq] continue the sequences held in `cache`
        (a whole prompt, or one token at a time; positions normally cache.length + arange(seq))
        -> (float32 logits [batch, seq, vocab], the cache with seq more slots filled).

        One document per row: attention is causal over the cache slots, with no segment ids.
        The same weights and math as `__call__`, so the logits match its logits position by
        position."""
        x, prefix = self.embed(tokens), dense_prefix(self.cfg)
        if self.cfg.irregular_moe():
            return self._decode_segments(x, positions, cache)
        if prefix:  # the cache's first layers are the dense prefix's
            head = KVCache(cache.k[:prefix], cache.v[:prefix], cache.length)
            x, head = scan_layers_cached(*nnx.split(self.dense_blocks), x, positions, head)
            cache = KVCache(cache.k[prefix:], cache.v[prefix:], cache.length)
        graphdef, layer_params = nnx.split(self.blocks)
        sliding = sliding_layers(self.cfg)
        x, cache = scan_layers_cached(graphdef, layer_params, x, positions, cache, sliding)
        if prefix:
            k, v = jnp.concatenate([head.k, cache.k]), jnp.concatenate([head.v, cache.v])
            cache = KVCache(k, v, cache.length)
        return self.head(x), cache

    def _decode_segments(self, x, positions, cache: KVCache):
        """`decode` of an irregular model from the embedded tokens x: each run of one kind
        (`run_segments`) reads and rewrites its layers' slice of the cache."""
        stacks, layer, keys, values = {True: self.blocks, False: self.dense_blocks}, 0, [], []
        for moe, start, stop in segments(self.cfg):
            graphdef, params = nnx.split(stacks[moe])
            run = jax.tree.map(lambda a, start=start, stop=stop: a[start:stop], params)
            span = slice(layer, layer + stop - start)  # the run's layers in the cache's order
            part = KVCache(cache.k[span], cache.v[span], cache.length)
            x, part = scan_layers_cached(graphdef, run, x, positions, part)
            keys, values, layer = keys + [part.k], values + [part.v], span.stop
        return self.head(x), KVCache(jnp.concatenate(keys), jnp.concatenate(values), part.length)


def matmul_params(cfg: ModelConfig) -> int:
    """Weights that take part in a matmul (every weight but the norms and the embedding lookup;
    the output head counts, tied or not) -- the N of the 6N FLOPs-per-token rule."""
    e, n, k, h = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_width
    f, v = cfg.d_ff, cfg.vocab_size
    attention = mla.matmul_params(cfg) if cfg.mla.kv_lora_rank else e * n * h + 2 * e * k * h + n * h * e
    moe = moe_layers(cfg)
    blocks = cfg.n_layers * attention + (cfg.n_layers - moe) * 3 * e * f + moe * moe_matmul_params(cfg)
    # model.mtp.depth modules: each a projection [2E, E], a block (MoE in an MoE model) and a pass
    # through the shared output head
    mlp = moe_matmul_params(cfg) if cfg.moe.num_experts else 3 * e * f
    return blocks + e * v + cfg.mtp.depth * (2 * e * e + attention + mlp + e * v)


def active_matmul_params(cfg: ModelConfig) -> int:
    """Matmul weights one token goes through (an MoE layer counts its top_k experts only)."""
    if cfg.moe.num_experts == 0:
        return matmul_params(cfg)
    inactive = (cfg.moe.num_experts - cfg.moe.top_k) * 3 * cfg.d_model * expert_d_ff(cfg)
    return matmul_params(cfg) - (moe_layers(cfg) + cfg.mtp.depth) * inactive


def attention_layers(cfg: ModelConfig) -> int:
    """Layers with an attention core (the L of the 12LdT FLOPs): the blocks and the
    multi-token prediction modules' blocks."""
    return cfg.n_layers + cfg.mtp.depth
