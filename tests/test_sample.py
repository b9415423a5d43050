"""Generation: KV-cache decoding reproduces the full forward, greedy and sampled generation agree
with it, sampling follows softmax(logits / T) over the top k, and `python -m jaxpar.sample` works
end to end on a freshly trained run."""

import dataclasses
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxpar import config as config_lib
from jaxpar import sample as sample_lib
from jaxpar.config import ModelConfig, MoEConfig
from jaxpar.corpus.documents import ByteTokenizer
from jaxpar.hf.export import load_params
from jaxpar.models.llama import KVCache, Transformer
from jaxpar.sample import generate, load_model, main, sample_token

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# init_std 0.3 (not 0.02) gives peaked logits, so the greedy choices are far from ties.
TINY = ModelConfig(
    vocab_size=264, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64, dtype="float32", init_std=0.3
)
PROMPT = [100, 101, 102, 32, 115, 116]  # "def st"
MAX_TOKENS = 10  # one length everywhere: generate compiles once per (model, mode)


def random_model(cfg: ModelConfig, seed: int) -> Transformer:
    """A Transformer whose every weight is N(0, init_std^2), drawn with numpy: any weights do to
    compare two code paths, and this skips compiling the initializers (seconds per model)."""
    graphdef, state = nnx.split(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0))))
    rng = np.random.default_rng(seed)
    params = jax.tree.map(
        lambda s: jnp.asarray(cfg.init_std * rng.standard_normal(s.shape), s.dtype), nnx.to_pure_dict(state)
    )
    return nnx.merge(graphdef, params)


@pytest.fixture(scope="module")
def model():
    return random_model(TINY, seed=0)


@nnx.jit
def full_logits(model, tokens):
    """The training forward on one sequence: tokens [seq] -> float32 logits [seq, vocab]."""
    seq = tokens.shape[0]
    logits, _ = model(tokens[None], jnp.arange(seq)[None], jnp.ones((1, seq), jnp.int32))
    return logits[0]


def padded_full_logits(model, tokens, length):
    """Full-forward logits of `tokens` padded to `length` (one compile for every prefix; the
    causal mask keeps the padding out of the real positions)."""
    padded = np.zeros(length, np.int32)
    padded[: len(tokens)] = tokens
    return np.asarray(full_logits(model, jnp.asarray(padded)))[: len(tokens)]


@nnx.jit
def decode(model, tokens, positions, cache):
    return model.decode(tokens, positions, cache)


@pytest.mark.parametrize(
    "moe", [MoEConfig(), MoEConfig(num_experts=4, top_k=2, every=2)], ids=["dense", "moe-group"]
)
def test_kv_cache_decode_matches_full_forward_at_every_position(moe):
    cfg = dataclasses.replace(TINY, moe=moe)
    model = random_model(cfg, seed=1)
    batch, prompt_len, total = 2, 5, 12
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 256, (batch, total)), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(total), (batch, total))
    expected, _ = nnx.jit(lambda m: m(tokens, positions, jnp.ones_like(tokens)))(model)

    cache = KVCache.create(cfg, batch, max_len=16)
    logits, cache = decode(model, tokens[:, :prompt_len], positions[:, :prompt_len], cache)
    steps = [logits]
    for i in range(prompt_len, total):  # then one token at a time
        logits, cache = decode(model, tokens[:, i : i + 1], positions[:, i : i + 1], cache)
        steps.append(logits)
    assert int(cache.length) == total
    assert cache.k.shape == (cfg.n_layers, batch, 16, cfg.n_kv_heads, cfg.head_width)
    np.testing.assert_allclose(np.concatenate(steps, axis=1), expected, rtol=1e-5, atol=1e-5)


def test_greedy_generate_equals_argmax_of_the_full_forward_on_the_growing_sequence(model):
    got = generate(model, PROMPT, MAX_TOKENS)
    sequence = list(PROMPT)
    for _ in range(MAX_TOKENS):
        logits = padded_full_logits(model, sequence, len(PROMPT) + MAX_TOKENS)
        sequence.append(int(np.argmax(logits[-1])))
    assert got == sequence[len(PROMPT) :]


def test_sampling_is_seeded_and_stays_in_the_top_k(model):
    top_k = 3
    first = generate(model, PROMPT, MAX_TOKENS, temperature=2.0, top_k=top_k, seed=0)
    assert first == generate(model, PROMPT, MAX_TOKENS, temperature=2.0, top_k=top_k, seed=0)
    assert first != generate(model, PROMPT, MAX_TOKENS, temperature=2.0, top_k=top_k, seed=1)
    assert first != generate(model, PROMPT, MAX_TOKENS)  # not the greedy text
    logits = padded_full_logits(model, PROMPT + first, len(PROMPT) + MAX_TOKENS)
    for i, token in enumerate(first):
        before = logits[len(PROMPT) + i - 1]
        kth_largest = np.sort(before)[-top_k]
        assert before[token] >= kth_largest - 1e-5, f"token {i} ({token}) is not in the top {top_k}"


@pytest.mark.parametrize("temperature,top_k", [(1.0, 3), (0.5, None), (2.0, 2)])
def test_sample_token_follows_the_tempered_top_k_softmax(temperature, top_k):
    probs = np.array([0.30, 0.05, 0.25, 0.10, 0.20, 0.10])
    draws = 20_000
    keys = jax.random.split(jax.random.key(0), draws)
    logits = jnp.log(jnp.asarray(probs, jnp.float32))
    tokens = jax.jit(jax.vmap(lambda key: sample_token(logits, key, temperature, top_k)))(keys)
    counts = np.bincount(np.asarray(tokens), minlength=probs.size) / draws

    expected = probs ** (1 / temperature)
    if top_k is not None:
        expected[np.argsort(probs)[:-top_k]] = 0  # never drawn, not even once
    expected /= expected.sum()
    assert np.all(counts[expected == 0] == 0)
    np.testing.assert_allclose(counts, expected, atol=0.015)  # ~4 standard errors


def test_generate_stops_at_max_seq_len_and_the_stop_token(model):
    short = random_model(dataclasses.replace(TINY, max_seq_len=10), seed=0)
    assert len(generate(short, PROMPT, 8)) == 10 - len(PROMPT)
    greedy = generate(model, PROMPT, MAX_TOKENS)
    stop = greedy[2]
    assert generate(model, PROMPT, MAX_TOKENS, stop_token=stop) == greedy[: greedy.index(stop)]
    with pytest.raises(ValueError, match="max_seq_len=10"):
        generate(short, list(range(10)), 1)


# --- The command line ------------------------------------------------------------------------


def _run(module, *args):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    return subprocess.run(
        [sys.executable, "-m", module, *args],
        check=False,
        capture_output=True,
        cwd=ROOT,
        env=env,
        timeout=300,
    )


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A 3-step run of a tiny model on 2 devices, checkpointed at step 3."""
    run_dir = tmp_path_factory.mktemp("sample") / "run"
    proc = _run(
        "jaxpar.train",
        "model.vocab_size=264",
        "model.d_model=32",
        "model.n_layers=2",
        "model.n_heads=4",
        "model.n_kv_heads=2",
        "model.d_ff=64",
        "train.batch_size=8",
        "train.seq_len=32",
        "train.steps=3",
        "checkpoint.every=3",
        "data.max_documents=20",
        "train.progress=false",
        "runtime.cpu_devices=2",
        "mesh.data=2",
        "mesh.fsdp=1",
        "mesh.tensor=1",
        f"train.run_dir={run_dir}",
    )
    assert proc.returncode == 0, proc.stderr.decode()[-2000:]
    assert (run_dir / "checkpoints" / "3").is_dir()
    return run_dir


def test_sample_cli_prints_the_prompt_and_the_greedy_continuation(run_dir):
    proc = _run("jaxpar.sample", str(run_dir), "--prompt", "def ", "--max-tokens", "8")
    assert proc.returncode == 0, proc.stderr.decode()[-2000:]
    _, model, step = load_model(str(run_dir))
    assert step == 3
    ids = generate(model, ByteTokenizer().encode("def "), 8, vocab_limit=257, stop_token=256)
    assert proc.stdout.decode() == "def " + ByteTokenizer().decode(ids) + "\n"


def built_with(cfg: ModelConfig, params) -> Transformer:
    """A Transformer of `cfg` holding `params` (a pure dict, as `load_params` gives them)."""
    graphdef = nnx.split(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0))))[0]
    return nnx.merge(graphdef, jax.tree.map(jnp.asarray, params))


def test_sample_cli_model_dtype_override_computes_in_float32(run_dir, capsys, monkeypatch):
    """The run trained in bfloat16 (config.yaml's model.dtype); with `model.dtype=float32` the
    same weights compute in float32: the logits of a Transformer built in float32, not bfloat16's,
    and the command samples with that model and prints its greedy text."""
    cfg, params, _ = load_params(str(run_dir))
    assert cfg.model.dtype == "bfloat16"
    prompt = ByteTokenizer().encode("def ")
    float32, bfloat16 = (
        built_with(dataclasses.replace(cfg.model, dtype=d), params) for d in ("float32", "bfloat16")
    )
    want = padded_full_logits(float32, prompt, 16)
    assert np.abs(want - padded_full_logits(bfloat16, prompt, 16)).max() > 1e-4  # the dtype shows

    _, model, _ = load_model(str(run_dir), overrides=["model.dtype=float32"])
    assert model.cfg.dtype == "float32"
    np.testing.assert_array_equal(padded_full_logits(model, prompt, 16), want)

    used = []  # the dtype of each model the command generates with

    def generate_recording(model, *args, **kwargs):
        used.append(model.cfg.dtype)
        return generate(model, *args, **kwargs)

    monkeypatch.setattr(sample_lib, "generate", generate_recording)
    argv = [str(run_dir), "model.dtype=float32", "--prompt", "def ", "--max-tokens", str(MAX_TOKENS)]
    assert main(argv) == 0  # the override before the flags: argparse's intermixed parsing
    assert used == ["float32"]
    ids = generate(float32, prompt, MAX_TOKENS, vocab_limit=257, stop_token=256)
    assert capsys.readouterr().out == "def " + ByteTokenizer().decode(ids) + "\n"


def without_jax_platforms() -> dict[str, str]:
    """This environment less JAX_PLATFORMS (conftest.py sets it to cpu): a command then picks its
    backend itself, as on a user's machine."""
    return {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}


def test_sample_cli_starts_on_the_cpu_without_a_cuinit_traceback(run_dir):
    """With the CUDA plugin installed and no driver (the gpu-compile extra on this machine), JAX
    left to itself tries the plugin first and logs a cuInit(0) traceback; jaxpar.sample starts as
    jaxpar.train does (jaxpar.mesh.emulate_cpu_devices). Without the plugin nothing is tried, and
    this passes either way."""
    proc = subprocess.run(
        [sys.executable, "-m", "jaxpar.sample", str(run_dir), "--prompt", "def ", "--max-tokens", "2"],
        check=False,
        capture_output=True,
        cwd=ROOT,
        timeout=300,
        env=without_jax_platforms(),
    )
    err = proc.stderr.decode()
    assert proc.returncode == 0, err[-2000:]
    assert "cuInit" not in err and "Traceback" not in err, err[-2000:]


ERRORS = {  # case -> (RUN_DIR contents, prompt, overrides, what stderr says)
    "no checkpoint": ("config.yaml", "def ", [], "no usable checkpoint"),
    "no config.yaml": ("nothing", "def ", [], "has no config.yaml"),
    "prompt too long": ("the run", "x" * 2048, [], "too long for model.max_seq_len=2048"),
    "unknown key": ("the run", "def ", ["model.dtpye=float32"], "did you mean 'model.dtype'?"),
    "bad value": ("the run", "def ", ["model.dtype=float64"], "choose one of float32, bfloat16"),
    "shape key": (
        "the run",
        "def ",
        ["model.dtype=float32", "model.d_model=64"],
        "model.d_model=64: the checkpoint holds weights for model.d_model=32",
    ),
    "not sampling": ("the run", "def ", ["train.steps=5"], "train.steps=5 is not a sampling setting"),
}


@pytest.mark.parametrize("case", ERRORS)
def test_sample_cli_errors_exit_2_and_name_the_problem(run_dir, tmp_path, capsys, case):
    contents, prompt, overrides, message = ERRORS[case]
    directory = run_dir if contents == "the run" else tmp_path
    if contents == "config.yaml":
        config_lib.dump_yaml(
            config_lib.load_config(str(run_dir / "config.yaml")), str(tmp_path / "config.yaml")
        )
    # main() returns the exit code; an uncaught exception (a traceback) would fail the test.
    assert main([str(directory), "--prompt", prompt, "--max-tokens", "8", *overrides]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err
