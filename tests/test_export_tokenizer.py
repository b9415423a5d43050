"""`python -m jaxpar.export` writes the byte-level run's tokenizer (jaxpar.hf.export.byte_tokenizer):
the `tokenizers` library and `transformers.AutoTokenizer` load it, encode text to jaxpar's ids
(jaxpar.corpus.documents.ByteTokenizer: UTF-8 bytes 0-255, end of document 256) and decode them back to the
same text.

The transformers side runs in the .venv-hf sidecar (tests/hf_reference.py `tokenizer`), as in
tests/test_convert.py: without .venv-hf that test skips with one line; with
JAXPAR_TESTS_REQUIRE_HF=1 (CI) it fails instead.
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from tokenizers import Tokenizer

from jaxpar import config as config_lib
from jaxpar.corpus.documents import EOD_TOKEN, ByteTokenizer
from jaxpar.hf.export import write_tokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HF_PYTHON = os.path.join(ROOT, ".venv-hf", "bin", "python")
REFERENCE = os.path.join(ROOT, "tests", "hf_reference.py")

TEXTS = [
    "def f(x):\n\treturn x  # two spaces , and a space before the comma\r\n",
    "naïve café, Größe, ½ — “quotes” ¿qué? ñ",  # Latin-1 and beyond: one to three bytes
    "日本語のテキスト、한국어, Ελληνικά, русский, עברית, العربية",
    "emoji 🙂👍🏽 and a zero-width joiner 👩‍💻, soft\u00adhyphen, nbsp\u00a0here",
    "\x00\x01\x1f\x7f\x80\x9f control characters",
    " leading and trailing spaces  ",
    f"the literal {EOD_TOKEN} inside a text is 13 bytes to jaxpar",
    "",
]
# Every byte UTF-8 uses (all but 0xC0, 0xC1 and 0xF5-0xFF): ASCII, every continuation byte
# (U+0080-U+00BF end in 0x80-0xBF), and every lead byte (one code point in 64 outside the
# surrogates starts with each of 0xC2-0xF4). 17,000 characters.
ALL_VALID_BYTES = "".join(
    chr(c) for c in [*range(0xC0), *range(0xC0, 0x110000, 64)] if not 0xD800 <= c < 0xE000
)
INVALID_UTF8 = [
    [0xFF],
    [0xE6, 0x97],
    [0xE6, 0x97, 0x41, 0xF0, 0x9F],
    [0xED, 0xA0, 0x80],
    [0xC0, 0xAF],
    list(range(256)),
]


def byte_run_config():
    cfg = config_lib.load_config(None, ["model.max_seq_len=512"])
    assert cfg.data.tokenizer == "byte"  # the default run's
    return cfg


def test_the_byte_tokenizer_files_give_jaxpar_ids_in_the_tokenizers_library(tmp_path):
    assert write_tokenizer(byte_run_config(), str(tmp_path)) == ByteTokenizer.eod_id
    assert sorted(os.listdir(tmp_path)) == ["tokenizer.json", "tokenizer_config.json"]
    settings = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert settings["eos_token"] == EOD_TOKEN and settings["model_max_length"] == 512
    assert settings["split_special_tokens"] is True  # "<|endoftext|>" in a text stays bytes

    tok = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    ours = ByteTokenizer()
    assert tok.get_vocab_size() == ours.vocab_size == 257
    assert tok.token_to_id(EOD_TOKEN) == ours.eod_id
    tok.encode_special_tokens = True  # what split_special_tokens sets in transformers
    for text in [*TEXTS, ALL_VALID_BYTES]:
        ids = tok.encode(text).ids
        assert ids == ours.encode(text).tolist(), text
        assert tok.decode(ids) == ours.decode(ids) == text, text
    assert set(ALL_VALID_BYTES.encode()) == set(range(256)) - {0xC0, 0xC1, *range(0xF5, 256)}
    for ids in INVALID_UTF8:  # U+FFFD where jaxpar puts one
        assert tok.decode(ids) == ours.decode(ids), ids
    # The end-of-document id and ids past the tokenizer (a padded model.vocab_size) are dropped.
    assert tok.decode([104, 256, 105, 300]) == ours.decode([104, 256, 105, 300]) == "hi"


def _export(run_dir, out, **env):
    return subprocess.run(
        [sys.executable, "-m", "jaxpar.export", str(run_dir), "--out", str(out)],
        check=False,
        capture_output=True,
        cwd=ROOT,
        timeout=300,
        env=env,
    )


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """A 3-step byte-level run of a tiny model, exported by the command line: (run, out, stderr)."""
    work = tmp_path_factory.mktemp("export")
    run_dir, out = work / "run", work / "hf"
    train = subprocess.run(
        [
            sys.executable,
            "-m",
            "jaxpar.train",
            "model.vocab_size=264",
            "model.d_model=32",
            "model.n_layers=2",
            "model.n_heads=4",
            "model.n_kv_heads=2",
            "model.d_ff=64",
            "model.dtype=float32",
            "train.batch_size=8",
            "train.seq_len=32",
            "train.steps=3",
            "checkpoint.every=3",
            "data.max_documents=20",
            "train.progress=false",
            "runtime.cpu_devices=1",
            "mesh.data=1",
            "mesh.fsdp=1",
            "mesh.tensor=1",
            f"train.run_dir={run_dir}",
        ],
        check=False,
        capture_output=True,
        cwd=ROOT,
        timeout=300,
        env=dict(os.environ, JAX_PLATFORMS="cpu"),
    )
    assert train.returncode == 0, train.stderr.decode()[-2000:]
    # JAX_PLATFORMS unset (conftest.py sets it to cpu), as on a user's machine: with the CUDA
    # plugin installed and no driver, JAX left to itself would log a cuInit(0) traceback.
    proc = _export(run_dir, out, **{k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"})
    assert proc.returncode == 0, proc.stderr.decode()[-2000:]
    return run_dir, out, proc.stderr.decode()


def test_export_cli_writes_the_tokenizer_and_starts_without_a_cuinit_traceback(exported):
    _, out, err = exported
    assert "cuInit" not in err and "Traceback" not in err, err[-2000:]
    assert {"tokenizer.json", "tokenizer_config.json", "config.json"} <= set(os.listdir(out))
    assert json.loads((out / "config.json").read_text())["eos_token_id"] == ByteTokenizer.eod_id
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    assert tok.encode(TEXTS[2]).ids == ByteTokenizer().encode(TEXTS[2]).tolist()


def test_transformers_loads_the_exported_byte_run_with_its_tokenizer(exported, tmp_path):
    if not os.path.exists(HF_PYTHON):
        why = "no .venv-hf (make hf-reference builds it): no transformers to load the export with"
        if os.environ.get("JAXPAR_TESTS_REQUIRE_HF") == "1":
            pytest.fail(why + ", and JAXPAR_TESTS_REQUIRE_HF=1")
        pytest.skip(why)
    run_dir, out, _ = exported
    ours = ByteTokenizer()
    cases = {
        "texts": [*TEXTS, ALL_VALID_BYTES],
        "ids": [*INVALID_UTF8, [104, 256, 105, 300]],
        "logits_text": TEXTS[1],
    }
    (tmp_path / "cases.json").write_text(json.dumps(cases))
    proc = subprocess.run(
        [
            HF_PYTHON,
            REFERENCE,
            "tokenizer",
            str(out),
            str(tmp_path / "cases.json"),
            str(tmp_path / "got.json"),
        ],
        check=False,
        capture_output=True,
        cwd=ROOT,
        timeout=300,
        env=dict(os.environ, TOKENIZERS_PARALLELISM="false"),
    )
    assert proc.returncode == 0, proc.stderr.decode()[-3000:]
    got = json.loads((tmp_path / "got.json").read_text())
    assert got["model_class"] == "LlamaForCausalLM"
    assert got["eos_token_id"] == got["model_eos_token_id"] == ours.eod_id
    for text, ids, decoded in zip(cases["texts"], got["encoded"], got["decoded_texts"]):
        assert ids == ours.encode(text).tolist(), text
        assert decoded == text, text
    for ids, decoded in zip(cases["ids"], got["decoded_ids"]):
        assert decoded == ours.decode(ids), ids

    # The model and the tokenizer together: transformers' logits on the tokenizer's ids of a
    # text are jaxpar's on jaxpar's ids.
    import jax.numpy as jnp

    from jaxpar.sample import load_model

    _, model, _ = load_model(str(run_dir))
    tokens = jnp.asarray(ours.encode(cases["logits_text"]))[None]
    positions = jnp.arange(tokens.shape[1])[None]
    want = np.asarray(model(tokens, positions, jnp.ones_like(tokens))[0])[0]
    np.testing.assert_allclose(np.asarray(got["logits"]), want, atol=1e-4)
