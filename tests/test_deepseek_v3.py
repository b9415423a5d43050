"""DeepSeek-V3 in and out of the Hugging Face format (jaxpar/models/families/deepseek_v3.py), with
multi-head latent attention (jaxpar/models/mla.py) and YaRN: tiny `DeepseekV3ForCausalLM`s that
transformers builds from a config alone (tests/hf_deepseek.py, in the .venv-hf sidecar) import
with transformers' float32 logits, on one device and on a mesh that splits heads and latents;
greedy decoding through jaxpar's latent cache gives transformers' tokens; export -> import is
bit-identical and transformers loads the export; and the traps of the format are refused by name.
One model has a dense layer before its MoE one (first_k_dense_replace 1: model.moe.first_dense).
"""

from __future__ import annotations

import os
import subprocess

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxpar import config as config_lib
from jaxpar import sharding as sharding_lib
from jaxpar.config import ConfigError
from jaxpar.hf import convert, hf_load
from jaxpar.hf import export as export_lib
from jaxpar.models.families import registry as families
from jaxpar.models.layers import KVCache
from jaxpar.models.llama import Transformer
from jaxpar.sample import generate
from tests.hf_reference import HF_PYTHON, require_sidecar, tensor_bytes

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VARIANTS = ["dsv3-dense-qlora-yarn", "dsv3-dense-plain", "dsv3-moe", "dsv3-moe-dense-prefix"]
# Float32 logits up to 11 in size: 1.9e-5 at worst measured (jax 0.12.0.1, torch 2.13 CPU).
ATOL = 5e-5
MESH = {"fsdp": 2, "tensor": 2}  # heads and the up-projections split, latents whole per device
MOE_MESH = {"expert": 2, "tensor": 2}  # the two rows split over expert


def _sidecar(*args: str, script: str = "hf_deepseek.py") -> None:
    proc = subprocess.run(
        [HF_PYTHON, os.path.join(ROOT, "tests", script), *args],
        capture_output=True,
        cwd=ROOT,
        timeout=300,
        env=dict(os.environ, TOKENIZERS_PARALLELISM="false"),
    )
    assert proc.returncode == 0, proc.stderr.decode()[-3000:]


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    """(directory of the tiny DeepSeek-V3 models, their reference.npz)."""
    require_sidecar("no transformers reference to compare with")
    out = tmp_path_factory.mktemp("deepseek")
    _sidecar(str(out))
    return out, dict(np.load(out / "reference.npz"))


def _config(hf_dir) -> config_lib.Config:
    settings = config_lib.user_settings(
        None, ["model.dtype=float32", "model.param_dtype=float32", f"train.init_from={hf_dir}"]
    )
    return convert.apply_init_from(config_lib.build_config(settings), settings)


def _loaded(cfg, hf_dir, mesh: dict[str, int]):
    """(the layout of `mesh`, the params read from `hf_dir` onto it)."""
    sizes = {a: mesh.get(a, 1) for a in config_lib.MESH_AXES}
    devices = jax.devices()[: int(np.prod(list(sizes.values())))]
    layout = sharding_lib.Layout.build(sizes, zero_stage=3, sequence_parallel=False, devices=devices)
    shapes, shardings = convert.param_targets(cfg, sizes, devices)
    return layout, hf_load.load_hf_params(str(hf_dir), cfg.model, shapes, shardings)


def _graphdef(cfg):
    return nnx.split(nnx.eval_shape(lambda: Transformer(cfg.model, rngs=nnx.Rngs(0))))[0]


def test_the_latent_ring_stays_the_users_setting_over_imported_weights(hf):
    # Bug this catches: model.mla taken whole from the checkpoint, which has no ring_latent, so
    # the setting was refused as disagreeing with the weights (or, unset, reset to false).
    root, _ = hf
    for given in (["model.mla.ring_latent=true"], []):
        settings = config_lib.user_settings(None, [*given, f"train.init_from={root / VARIANTS[0]}"])
        cfg = convert.apply_init_from(config_lib.build_config(settings), settings)
        assert cfg.model.mla.ring_latent is bool(given) and cfg.model.mla.kv_lora_rank > 0


@pytest.mark.parametrize("variant", VARIANTS)
def test_logits_match_transformers_on_one_device_and_on_a_mesh(hf, variant):
    """Guards: the interleaved rotary pairs not permuted (or permuted on one of q, k), the
    rotated key head not shared, YaRN's frequencies or either mscale wrong, the latent norm on
    the rotated part, the correction bias ignored or used in the weights, the groups' score from
    their top 1, routed_scaling_factor not applied, the shared expert missing."""
    root, ref = hf
    cfg = _config(root / variant)
    tokens = jnp.asarray(ref["tokens"])
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
    for mesh in ({}, MOE_MESH if cfg.model.moe.num_experts else MESH):
        layout, params = _loaded(cfg, root / variant, mesh)
        graphdef = _graphdef(cfg)

        @jax.jit
        def logits(params, tokens):
            with layout.scope():
                return nnx.merge(graphdef, params)(tokens, positions, jnp.ones_like(tokens))[0]

        got = np.asarray(logits(params, tokens))
        assert np.max(np.abs(got - ref[f"{variant}/logits"])) <= ATOL, (variant, mesh)


@pytest.mark.parametrize("variant", VARIANTS)
def test_greedy_decoding_through_the_latent_cache_gives_transformers_tokens(hf, variant):
    """Decoding reads keys and values back from cached latents (kv_lora_rank + qk_rope_head_dim
    per token, not the expanded heads): a latent cached before its norm, or a rotated key cached
    at the wrong position, changes the tokens."""
    root, ref = hf
    assert ref[f"{variant}/margin"] > 1e-3  # no near-ties: the choices are well defined
    cfg = _config(root / variant)
    cache = KVCache.create(cfg.model, 1, 8)
    a = cfg.model.mla
    assert cache.k.shape[-2:] == (1, a.kv_lora_rank) and cache.v.shape[-2:] == (1, a.qk_rope_dim)
    _, params = _loaded(cfg, root / variant, {})
    got = generate(nnx.merge(_graphdef(cfg), params), ref["prompt"].tolist(), 20)
    assert got == ref[f"{variant}/greedy"].tolist()


def test_export_then_import_is_bit_identical_and_transformers_loads_the_export(hf, tmp_path_factory):
    """The export writes transformers' layout (one tensor per expert, the correction bias, the
    rotated rows back in interleaved order) byte for byte, and transformers' logits on it are the
    source's."""
    root, ref = hf
    work = tmp_path_factory.mktemp("converted")
    for variant in VARIANTS:
        convert.from_hf(str(root / variant), str(work / variant / "run"), ["model.dtype=float32"])
        export_lib.export(str(work / variant / "run"), str(work / variant / "hf"))
        source, back = tensor_bytes(root / variant), tensor_bytes(work / variant / "hf")
        assert set(back) == set(source), variant
        for name in source:
            assert back[name] == source[name], f"{variant}: {name}"
    pairs = [f"{v}={work / v / 'hf'}" for v in VARIANTS]
    _sidecar("logits", str(work / "exported.npz"), *pairs, script="hf_reference.py")
    exported = np.load(work / "exported.npz")
    for variant in VARIANTS:
        assert str(exported[f"{variant}/class"]) == "DeepseekV3ForCausalLM"
        assert np.max(np.abs(exported[f"{variant}/logits"] - ref[f"{variant}/logits"])) <= 1e-5


# --- The format's traps, refused by name (no sidecar needed) ---------------------------------

BASE = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "vocab_size": 320,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "q_lora_rank": 24,
    "kv_lora_rank": 16,
    "qk_nope_head_dim": 8,
    "qk_rope_head_dim": 8,
    "v_head_dim": 12,
    "first_k_dense_replace": 0,
    "n_routed_experts": 8,
    "n_group": 2,
    "topk_group": 1,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
}
REFUSED = {
    "q-lora-zero": ({"q_lora_rank": 0}, "q_lora_rank=0"),
    "default-groups-too-few-experts": ({"n_group": 8}, "n_group=8 with n_routed_experts=8"),
    "top-k-past-the-groups": ({"num_experts_per_tok": 6}, "num_experts_per_tok=6 from topk_group=1"),
    "top-1-normalised": ({"num_experts_per_tok": 1}, "norm_topk_prob=true with one expert per token"),
    "grouped-kv-heads": ({"num_key_value_heads": 2}, "num_key_value_heads=2"),
    "yarn-attention-factor": (
        {
            "rope_parameters": {
                "rope_type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 16,
                "attention_factor": 1.2,
            }
        },
        "attention_factor=1.2",
    ),
}


@pytest.mark.parametrize("case", REFUSED)
def test_the_formats_traps_are_refused_naming_the_key(case):
    change, named = REFUSED[case]
    with pytest.raises(ConfigError, match=named.replace("(", r"\(")):
        families.settings_from_hf({**BASE, **change}, "config.json")


def test_a_dense_prefix_is_model_moe_first_dense_both_ways():
    """first_k_dense_replace between 0 and num_hidden_layers is a dense prefix: its layers'
    MLPs are `dense_blocks` of intermediate_size, the MoE tensors start at layer k (the logits
    against transformers: dsv3-moe-dense-prefix above); k >= num_hidden_layers stays a dense
    model. A prefix read as 0 (all MoE) or written back as 0 fails here."""
    m = families.settings_from_hf({**BASE, "num_hidden_layers": 3, "first_k_dense_replace": 1}, "c")
    assert (m["moe"]["first_dense"], m["d_ff"], m["moe"]["d_ff"]) == (1, 96, 32)
    model = config_lib.build_config({"model": m}).model
    assert families.hf_config(model)["first_k_dense_replace"] == 1
    names = hf_load.expected_tensors(model)
    assert names["model.layers.0.mlp.gate_proj.weight"] == (96, 64)
    assert "model.layers.0.mlp.gate.weight" not in names and "model.layers.1.mlp.gate.weight" in names
    dense = families.settings_from_hf({**BASE, "first_k_dense_replace": 2}, "c")
    assert dense["moe"] == {"num_experts": 0}


def test_kimi_style_and_default_keys_read_as_transformers_reads_them():
    """Kimi K2's config.json is DeepseekV3ForCausalLM with its own model_type, one expert group
    and more experts; the head_dim it writes is the rotated width, not read as a head's. Keys a
    file leaves out take transformers' defaults (n_group 8, topk_group 4, rope_interleave true)."""
    kimi = {**BASE, "model_type": "kimi_k2", "n_routed_experts": 16, "n_group": 1, "topk_group": 1}
    kimi.update(num_experts_per_tok=4, head_dim=8, n_shared_experts=1, routed_scaling_factor=2.827)
    m = families.settings_from_hf(kimi, "config.json")
    assert m["mla"]["rope_interleave"] is True and "head_dim" not in m
    assert (m["moe"]["groups"], m["moe"]["topk_groups"], m["moe"]["routed_scale"]) == (1, 1, 2.827)
    model = config_lib.build_config({"model": m}).model
    assert families.family_of_model(model).__name__.endswith("deepseek_v3")
    assert families.hf_config(model)["head_dim"] == 8
    defaults = {k: v for k, v in BASE.items() if k not in ("n_group", "topk_group")}
    m = families.settings_from_hf({**defaults, "n_routed_experts": 16}, "config.json")
    assert (m["moe"]["groups"], m["moe"]["topk_groups"]) == (8, 4)
