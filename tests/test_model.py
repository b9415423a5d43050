"""The NNX model against an independent plain-jax.numpy forward of the same weights."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxpar.config import ModelConfig
from jaxpar.models.llama import Transformer, matmul_params


def reference_forward(p, tokens, positions, segment_ids, cfg):
    """Llama forward written from the paper, loops over layers, no Flax."""
    n, k, hd = cfg.n_heads, cfg.n_kv_heads, cfg.head_width

    def rmsnorm(x, w):
        return x / np.sqrt(np.mean(x**2, -1, keepdims=True) + cfg.norm_eps) * w

    def rope(x):  # [b, s, h, hd], pairs (i, i + hd/2)
        freqs = cfg.rope_theta ** (-np.arange(hd // 2) / (hd // 2))
        ang = positions[:, :, None, None] * freqs
        a, b = x[..., : hd // 2], x[..., hd // 2 :]
        return np.concatenate([a * np.cos(ang) - b * np.sin(ang), b * np.cos(ang) + a * np.sin(ang)], -1)

    seq = tokens.shape[1]
    allowed = np.tril(np.ones((seq, seq), bool))[None] & (segment_ids[:, :, None] == segment_ids[:, None, :])
    x = p["embedding"][tokens]
    b = p["blocks"]
    for layer in range(cfg.n_layers):
        h = rmsnorm(x, b["attn_norm"]["scale"][layer])
        q = rope(np.einsum("bse,enh->bsnh", h, b["attn"]["wq"][layer]))
        kk = rope(np.einsum("bse,ekh->bskh", h, b["attn"]["wk"][layer]))
        v = np.einsum("bse,ekh->bskh", h, b["attn"]["wv"][layer])
        kk = np.repeat(kk, n // k, axis=2)  # each kv head serves n/k query heads
        v = np.repeat(v, n // k, axis=2)
        scores = np.einsum("bqnh,bknh->bnqk", q, kk) / np.sqrt(hd)
        scores = np.where(allowed[:, None], scores, -np.inf)
        weights = np.exp(scores - scores.max(-1, keepdims=True))
        weights /= weights.sum(-1, keepdims=True)
        attn = np.einsum("bnqk,bknh->bqnh", weights, v)
        x = x + np.einsum("bsnh,nhe->bse", attn, b["attn"]["wo"][layer])
        h = rmsnorm(x, b["mlp_norm"]["scale"][layer])
        gate = h @ b["mlp"]["w_gate"][layer]
        x = x + (gate / (1 + np.exp(-gate)) * (h @ b["mlp"]["w_up"][layer])) @ b["mlp"]["w_down"][layer]
    x = rmsnorm(x, p["final_norm"]["scale"])
    head = p["embedding"].T if cfg.tie_embeddings else p["lm_head"]
    return x @ head


@pytest.mark.parametrize("tie", [False, True])
def test_model_matches_plain_numpy_forward(tie):
    cfg = ModelConfig(
        vocab_size=64,
        d_model=32,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        d_ff=48,
        tie_embeddings=tie,
        dtype="float32",
    )
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    params = jax.tree.map(lambda a: np.asarray(a, np.float64), nnx.to_pure_dict(nnx.state(model)))
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, cfg.vocab_size, (2, 12))
    # Two packed documents in row 0 (positions restart), one in row 1.
    segment_ids = np.array([[1] * 5 + [2] * 7, [1] * 12])
    positions = np.array([list(range(5)) + list(range(7)), list(range(12))])
    logits, stats = model(jnp.asarray(tokens), jnp.asarray(positions), jnp.asarray(segment_ids))
    assert stats == {}
    expected = reference_forward(params, tokens, positions, segment_ids, cfg)
    assert logits.shape == (2, 12, cfg.vocab_size)
    np.testing.assert_allclose(np.asarray(logits), expected, rtol=2e-4, atol=2e-5)


def test_documents_do_not_see_each_other():
    cfg = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=4, d_ff=48)
    model = Transformer(cfg, rngs=nnx.Rngs(1))
    tokens = np.arange(10)[None] % 64
    other = tokens.copy()
    other[0, :4] = 7  # change only the first document
    segments = np.array([[1] * 4 + [2] * 6])
    positions = np.array([list(range(4)) + list(range(6))])
    a, _ = model(jnp.asarray(tokens), jnp.asarray(positions), jnp.asarray(segments))
    b, _ = model(jnp.asarray(other), jnp.asarray(positions), jnp.asarray(segments))
    np.testing.assert_array_equal(np.asarray(a[0, 4:]), np.asarray(b[0, 4:]))
    assert not np.allclose(np.asarray(a[0, :4]), np.asarray(b[0, :4]))


def test_every_parameter_has_logical_names_with_layers_axis():
    cfg = ModelConfig(vocab_size=64, d_model=32, n_layers=3, n_heads=4, n_kv_heads=2, d_ff=48)
    state = nnx.state(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0))))
    specs = nnx.to_pure_dict(nnx.get_partition_spec(state))
    shapes = nnx.to_pure_dict(state)
    flat_specs = jax.tree_util.tree_leaves_with_path(
        specs, is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec)
    )
    flat_shapes = dict(jax.tree_util.tree_leaves_with_path(shapes))
    for path, spec in flat_specs:
        shape = flat_shapes[path].shape
        assert len(spec) == len(shape), (path, spec, shape)
        if "blocks" in jax.tree_util.keystr(path):
            assert spec[0] == "layers" and shape[0] == 3
    count = sum(x.size for x in jax.tree.leaves(shapes))
    norms = cfg.d_model * (2 * cfg.n_layers + 1)
    assert count == matmul_params(cfg) + cfg.vocab_size * cfg.d_model + norms


def test_unrolled_layers_train_exactly_as_the_scanned_layers():
    """model.scan_layers=false writes the layer loop out over the same stacked weights: on one
    device the same gradients and updated state as the scan at every step (a layer given
    another's weights, or the stacked gradient assembled in the wrong order, is off by O(1)
    here: the layers' weights differ), and the compiled step keeps no loop over the layers
    (the layers' forward and backward loops are what it removes)."""
    from jaxpar.inspect import compile_step
    from tests.parity import LAYER_FORMS, assert_parity, parity_trainer, random_batches, run_parity

    runs, loops = {}, {}
    for form, extra in LAYER_FORMS.items():
        trainer = parity_trainer(["model.n_layers=3", *extra], {})
        compiled = compile_step(trainer)
        loops[form] = compiled.as_text().count(" while(")
        init = runs["scanned"].init if runs else None
        runs[form] = run_parity(
            trainer, compiled, random_batches(trainer.cfg), init, along=runs.get("scanned")
        )
    # The parity tolerance (tests/parity.py): the two programs fuse differently, so on another
    # x86-64 machine their float32 sums may be ordered differently (0.0 apart here, jax 0.12.0.1).
    assert_parity(runs["unrolled"], runs["scanned"])
    assert loops["scanned"] >= 2 and loops["unrolled"] == loops["scanned"] - 2, loops
