"""Checkpoints: bit-exact round trips, restores onto other meshes, retention, corruption fallback,
clear errors for another model, and the Hugging Face export.

One module fixture saves two checkpoints (steps 10 and 20) of a random train state on a data=8
mesh; the tests restore, copy or corrupt that directory. No step is compiled.
"""

import json
import math
import os
import shutil
import subprocess
import sys
import textwrap
import warnings

import jax
import numpy as np
import pytest
from safetensors.numpy import load_file

from jaxpar import checks as checks_lib
from jaxpar import config as config_lib
from jaxpar.config import MESH_AXES, ConfigError
from jaxpar.hf import export as export_lib
from jaxpar.run.train import build_trainer
from jaxpar.training.checkpoint import (
    MANIFEST,
    Checkpointer,
    CheckpointMismatchError,
    CheckpointWarning,
    checkpoint_dir,
)

TINY_YAML = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs", "tiny.yaml")
TINY = ["model.d_model=64", "model.d_ff=128"]  # configs/tiny.yaml, wider (the shapes below)
DATA8 = ({"data": 8}, ["parallel.zero_stage=0"])


def make_trainer(mesh: dict, extra=()):
    """A Trainer on the first prod(mesh) devices (nothing is compiled)."""
    devices = math.prod(mesh.values())
    cfg = config_lib.load_config(
        TINY_YAML, TINY + [f"mesh.{a}={mesh.get(a, 1)}" for a in MESH_AXES] + list(extra)
    )
    return build_trainer(cfg, checks_lib.validate(cfg, devices), devices=jax.devices()[:devices])


def random_state(trainer, seed: int):
    """A train state of random values, placed on the trainer's shardings."""
    rng = np.random.default_rng(seed)

    def leaf(shape, sharding):
        if np.issubdtype(shape.dtype, np.integer):
            value = rng.integers(0, 1000, shape.shape)
        else:
            value = rng.standard_normal(shape.shape)
        return jax.device_put(value.astype(shape.dtype), sharding)

    return jax.tree.map(leaf, trainer.state_shape, trainer.state_shardings)


def assert_equal_trees(got, want):
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert g.dtype == w.dtype and np.array_equal(np.asarray(g), np.asarray(w))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """(checkpoint directory, data=8 trainer, {step: the saved state as numpy})."""
    directory = str(tmp_path_factory.mktemp("ckpt") / "checkpoints")
    trainer = make_trainer(*DATA8)
    host = {}
    checkpointer = Checkpointer(directory, keep=3, every=10)
    for step in (10, 20):
        state = random_state(trainer, seed=step)
        host[step] = jax.tree.map(np.asarray, state)
        assert checkpointer.save(step, state, {"next_index": 8 * step})
        # save() returns once the arrays are off the devices: training may donate them now.
        jax.tree.map(lambda x: x.delete(), state)
    checkpointer.close()
    return directory, trainer, host


def test_round_trip_is_bit_exact(saved):
    directory, trainer, host = saved
    checkpointer = Checkpointer(directory)
    assert checkpointer.latest_valid_step() == 20
    for step in (None, 10):
        state, data_state, restored_step = checkpointer.restore(
            trainer.state_shape, trainer.state_shardings, step=step
        )
        want = step or 20
        assert restored_step == want and data_state == {"next_index": 8 * want}
        assert_equal_trees(state, host[want])
        for leaf, sharding in zip(jax.tree.leaves(state), jax.tree.leaves(trainer.state_shardings)):
            assert leaf.sharding == sharding
    checkpointer.close()


def test_a_replicated_state_is_written_whole_from_one_replica(saved, tmp_path, monkeypatch):
    """On data=8 every array of the state is replicated 8 times. Orbax's replica-parallel save
    (its default unless JAX_PLATFORMS names a GPU) cuts each into 8 slices on 8 devices, a
    compiled slice program per shape, before writing (288 cuts here); jaxpar's handler writes each
    whole from replica 0 (`checkpoint._whole_array_saves`), and the round trip stays bit-exact."""
    _, trainer, _ = saved
    sliced = []
    slice_in_dim = jax.lax.slice_in_dim
    monkeypatch.setattr(jax.lax, "slice_in_dim", lambda *a, **k: sliced.append(a) or slice_in_dim(*a, **k))
    directory = str(tmp_path / "checkpoints")
    checkpointer = Checkpointer(directory, every=1)
    state = random_state(trainer, seed=7)
    host = jax.tree.map(np.asarray, state)
    assert checkpointer.save(1, state, {"next_index": 0})
    checkpointer.close()
    assert not sliced, f"{len(sliced)} replica slices cut for the save"
    restored, _, _ = Checkpointer(directory).restore(trainer.state_shape, trainer.state_shardings)
    assert_equal_trees(restored, host)


@pytest.mark.parametrize(
    "mesh", [{"fsdp": 4, "tensor": 2}, {"fsdp": 2, "tensor": 2}], ids=["fsdp4_tensor2", "4_devices"]
)
def test_restore_onto_another_mesh(saved, mesh):
    directory, _, host = saved
    trainer = make_trainer(mesh, ["parallel.zero_stage=3"])
    state, _, _ = Checkpointer(directory).restore(trainer.state_shape, trainer.state_shardings)
    assert_equal_trees(state, host[20])
    devices = set(jax.devices()[: math.prod(mesh.values())])
    for leaf, sharding in zip(jax.tree.leaves(state), jax.tree.leaves(trainer.state_shardings)):
        assert leaf.sharding == sharding and leaf.sharding.device_set == devices
    wq = state["params"]["blocks"]["attn"]["wq"]  # [layers, embed/fsdp, heads/tensor, head_dim]
    assert wq.addressable_shards[0].data.shape == (2, 64 // mesh["fsdp"], 4 // mesh["tensor"], 16)


def test_keep_n_keeps_the_newest_n(saved, tmp_path):
    _, trainer, _ = saved
    state = random_state(trainer, seed=0)
    checkpointer = Checkpointer(str(tmp_path), keep=2, every=2)
    assert [checkpointer.save(step, state, {}) for step in range(1, 7)] == [False, True] * 3
    assert checkpointer.save(7, state, {}, force=True)  # e.g. the last step of a run
    assert not checkpointer.save(7, state, {}, force=True)  # already saved
    checkpointer.close()
    assert Checkpointer(str(tmp_path)).all_steps() == [6, 7]


def _largest_file(directory: str) -> str:
    files = [os.path.join(root, name) for root, _, names in os.walk(directory) for name in names]
    return max(files, key=os.path.getsize)


def _delete(step_dir):
    os.remove(_largest_file(os.path.join(step_dir, "params")))


def _truncate(step_dir):
    path = _largest_file(os.path.join(step_dir, "train_state"))
    os.truncate(path, os.path.getsize(path) // 2)


def _garble(step_dir):  # same size, other bytes: only the checksum can tell
    path = _largest_file(os.path.join(step_dir, "params"))
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))


def _uncommitted(step_dir):  # what a run killed mid-save leaves: orbax's temporary directory
    os.remove(os.path.join(step_dir, MANIFEST))
    os.rename(step_dir, step_dir + ".orbax-checkpoint-tmp")


@pytest.mark.parametrize(
    "corrupt, reason",
    [
        (_delete, "is missing"),
        (_truncate, "bytes but"),
        (_garble, "checksum"),
        (_uncommitted, "never committed"),
    ],
    ids=["deleted_file", "truncated_file", "garbled_file", "left_uncommitted"],
)
def test_corrupted_latest_falls_back_to_the_previous(saved, tmp_path, corrupt, reason):
    directory, trainer, host = saved
    copy = str(tmp_path / "checkpoints")
    shutil.copytree(directory, copy)
    corrupt(os.path.join(copy, "20"))
    checkpointer = Checkpointer(copy)
    with pytest.warns(CheckpointWarning, match=f"step 20 .*{reason}"):
        assert checkpointer.latest_valid_step() == 10
    with pytest.warns(CheckpointWarning, match="step 20"):
        state, data_state, step = checkpointer.restore(trainer.state_shape, trainer.state_shardings)
    assert step == 10 and data_state == {"next_index": 80}
    assert_equal_trees(state, host[10])
    # The resumed run saves step 20 again, over the bad one.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CheckpointWarning)
        assert checkpointer.save(20, state, data_state, force=True)
    checkpointer.close()
    with warnings.catch_warnings():
        warnings.simplefilter("error", CheckpointWarning)
        assert Checkpointer(copy).latest_valid_step() == 20


KILLED_MID_SAVE = """
import os, signal
import jax.numpy as jnp
from jaxpar.training import checkpoint as checkpoint_lib
state = {"params": {"w": jnp.arange(1000.0)}, "opt_state": {"mu": jnp.zeros(1000)},
         "step": jnp.array(0, jnp.int32)}
checkpointer = checkpoint_lib.Checkpointer(DIRECTORY, keep=3, every=1)
checkpointer.save(1, state, {"next_index": 1})
checkpointer._finish_pending()
# Die in orbax's background thread once step 2's files are written, before it commits.
checkpoint_lib.write_manifest = lambda *_: os.kill(os.getpid(), signal.SIGKILL)
checkpointer.save(2, {**state, "params": {"w": -state["params"]["w"]}}, {"next_index": 2})
checkpointer.close()
"""


def test_run_killed_mid_save_resumes_from_the_previous_checkpoint(tmp_path):
    directory = str(tmp_path / "checkpoints")
    script = KILLED_MID_SAVE.replace("DIRECTORY", repr(directory))
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)], env=env, timeout=120, capture_output=True, text=True
    )
    assert proc.returncode == -9, proc.stderr[-2000:]  # SIGKILL
    assert "2.orbax-checkpoint-tmp" in " ".join(os.listdir(directory))
    checkpointer = Checkpointer(directory)
    with pytest.warns(CheckpointWarning, match="step 2 .*never committed"):
        assert checkpointer.latest_valid_step() == 1
    shape = {"params": {"w": jax.ShapeDtypeStruct((1000,), np.float32)}}
    with pytest.warns(CheckpointWarning, match="step 2"):
        state, data_state, step = checkpointer.restore(shape, None)
    assert step == 1 and data_state == {"next_index": 1}
    assert np.array_equal(state["params"]["w"], np.arange(1000.0, dtype=np.float32))
    checkpointer.close()


@pytest.mark.parametrize(
    "extra, message",
    [
        (
            ["model.d_model=32"],
            r"params\.blocks\.attn\.wq: checkpoint has shape \(2, 64, 4, 16\), "
            r"the model has shape \(2, 32, 4, 8\)",
        ),
        (
            ["model.tie_embeddings=true"],
            r"params\.lm_head: the checkpoint has shape \(64, 264\), "
            r"the model has no such parameter",
        ),
    ],
    ids=["d_model", "tied_embeddings"],
)
def test_model_of_another_shape_is_a_clear_error(saved, extra, message):
    directory, _, _ = saved
    trainer = make_trainer(DATA8[0], DATA8[1] + extra)
    with pytest.raises(CheckpointMismatchError, match=message) as error:
        Checkpointer(directory).restore(trainer.state_shape, trainer.state_shardings)
    assert isinstance(error.value, ConfigError)


# --- Hugging Face export ----------------------------------------------------------------------


def llama_keys(n_layers: int, tied: bool) -> set[str]:
    per_layer = [
        "self_attn.q_proj",
        "self_attn.k_proj",
        "self_attn.v_proj",
        "self_attn.o_proj",
        "mlp.gate_proj",
        "mlp.up_proj",
        "mlp.down_proj",
        "input_layernorm",
        "post_attention_layernorm",
    ]
    keys = {"model.embed_tokens.weight", "model.norm.weight"} | {
        f"model.layers.{layer}.{name}.weight" for layer in range(n_layers) for name in per_layer
    }
    return keys if tied else keys | {"lm_head.weight"}


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_hf_state_dict_has_exactly_the_llama_keys(tied):
    trainer = make_trainer(DATA8[0], [f"model.tie_embeddings={str(tied).lower()}"])
    params = jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), trainer.state_shape["params"])
    tensors = export_lib.hf_state_dict(params, trainer.cfg.model)
    assert set(tensors) == llama_keys(2, tied)
    assert tensors["model.layers.1.self_attn.k_proj.weight"].shape == (2 * 16, 64)  # (K*H, E)


def test_hf_weights_compute_the_same_projections(saved):
    """torch Linear computes x @ W.T: each exported weight must give jaxpar's einsum."""
    _, trainer, host = saved
    p = host[20]["params"]
    hf = export_lib.hf_state_dict(p, trainer.cfg.model)
    x = np.random.default_rng(1).standard_normal(64).astype(np.float32)  # one token [E]
    a = np.random.default_rng(2).standard_normal((4, 16)).astype(np.float32)  # attention out [N, H]
    h = np.random.default_rng(3).standard_normal(128).astype(np.float32)  # MLP hidden [F]
    blocks = p["blocks"]
    attn, mlp = blocks["attn"], blocks["mlp"]

    def close(got, want):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)

    for layer in range(2):

        def linear(name, v):
            return v @ hf[f"model.layers.{layer}.{name}.weight"].T

        close(linear("self_attn.q_proj", x), np.einsum("e,enh->nh", x, attn["wq"][layer]).ravel())
        close(linear("self_attn.k_proj", x), np.einsum("e,ekh->kh", x, attn["wk"][layer]).ravel())
        close(linear("self_attn.v_proj", x), np.einsum("e,ekh->kh", x, attn["wv"][layer]).ravel())
        close(linear("self_attn.o_proj", a.ravel()), np.einsum("nh,nhe->e", a, attn["wo"][layer]))
        close(linear("mlp.gate_proj", x), x @ mlp["w_gate"][layer])
        close(linear("mlp.up_proj", x), x @ mlp["w_up"][layer])
        close(linear("mlp.down_proj", h), h @ mlp["w_down"][layer])
        assert np.array_equal(
            hf[f"model.layers.{layer}.input_layernorm.weight"], blocks["attn_norm"]["scale"][layer]
        )
        assert np.array_equal(
            hf[f"model.layers.{layer}.post_attention_layernorm.weight"], blocks["mlp_norm"]["scale"][layer]
        )
    close(x @ hf["lm_head.weight"].T, x @ p["lm_head"])
    assert np.array_equal(hf["model.embed_tokens.weight"], p["embedding"])
    assert np.array_equal(hf["model.norm.weight"], p["final_norm"]["scale"])


def test_export_cli_writes_sharded_safetensors(saved, tmp_path):
    directory, trainer, host = saved
    run_dir, out = tmp_path / "run", tmp_path / "hf"
    shutil.copytree(directory, checkpoint_dir(str(run_dir)))
    config_lib.dump_yaml(trainer.cfg, str(run_dir / "config.yaml"))
    limit = 100_000  # bytes; the model has ~430 kB of float32 parameters
    assert export_lib.main([str(run_dir), "--out", str(out), f"--max-shard-bytes={limit}"]) == 0

    want = export_lib.hf_state_dict(host[20]["params"], trainer.cfg.model)
    index = json.load(open(out / "model.safetensors.index.json"))
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 2 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    assert set(index["weight_map"]) == set(want)
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in want.values())
    got = {}
    for file in files:
        tensors = load_file(str(out / file))
        assert sum(t.nbytes for t in tensors.values()) <= limit
        assert all(index["weight_map"][name] == file for name in tensors)
        got.update(tensors)
    assert set(got) == set(want)
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype and np.array_equal(got[name], tensor), name

    config = json.load(open(out / "config.json"))
    assert config["architectures"] == ["LlamaForCausalLM"]
    want_config = {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 264,
        "tie_word_embeddings": False,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "max_position_embeddings": 2048,
    }
    assert {key: config[key] for key in want_config} == want_config


def test_export_fits_one_file_when_small(saved, tmp_path):
    _, trainer, host = saved
    tensors = export_lib.hf_state_dict(host[10]["params"], trainer.cfg.model)
    assert export_lib.write_safetensors(tensors, str(tmp_path)) == ["model.safetensors"]
    assert not (tmp_path / "model.safetensors.index.json").exists()
    loaded = load_file(str(tmp_path / "model.safetensors"))
    assert all(np.array_equal(loaded[name], tensors[name]) for name in tensors)


def test_a_checkpoint_without_the_guard_counters_restores_them_as_zero(tmp_path):
    """Checkpoints written before the train state carried skipped_steps and first_bad_step."""
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec

    old = {"params": {"w": jnp.arange(4.0)}, "opt_state": {"m": jnp.ones(4)}, "step": jnp.int32(7)}
    ckpt = Checkpointer(str(tmp_path))
    ckpt.save(7, old, {"position": 7}, force=True)
    ckpt.close()
    scalar = jax.ShapeDtypeStruct((), jnp.int32)
    shape = {**jax.eval_shape(lambda: old), "skipped_steps": scalar, "first_bad_step": scalar}
    replicated = NamedSharding(jax.sharding.Mesh(np.array(jax.devices()[:1]), ("d",)), PartitionSpec())
    state, data, step = Checkpointer(str(tmp_path)).restore(shape, jax.tree.map(lambda _: replicated, shape))
    assert step == 7 and data == {"position": 7} and int(state["step"]) == 7
    assert int(state["skipped_steps"]) == 0 and int(state["first_bad_step"]) == 0
    np.testing.assert_array_equal(state["params"]["w"], np.arange(4.0))
