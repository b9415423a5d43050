"""Hugging Face Hub model ids for `from-hf` and `train.init_from` (jaxpar.hf.hub), with no network.

A tiny random Llama is written as a Hugging Face directory by jaxpar's own exporter functions (no
torch), twice with different weights: A in shards with an index, B in one file. They go into a Hub
cache laid out by hand as huggingface_hub lays it out (models--ORG--NAME/refs/<branch or tag>
holding a commit hash, snapshots/<commit>/<file> a link to blobs/<hash>): main names A, the tag v1
names B. HF_HUB_OFFLINE=1 makes huggingface_hub read that cache alone; it reads HF_HOME,
HF_HUB_CACHE and HF_HUB_OFFLINE when it is imported, so the commands run either in a process of
their own (the environment as a user sets it) or here with those settings patched.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
from flax import nnx

from jaxpar import config as config_lib
from jaxpar.hf import convert, hub
from jaxpar.hf import export as export_lib
from jaxpar.models.families import registry as families
from jaxpar.models.llama import Transformer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REPO = "tiny-org/tiny-llama"
COMMITS = {"A": hashlib.sha1(b"A").hexdigest(), "B": hashlib.sha1(b"B").hexdigest()}
TINY = [
    "model.vocab_size=264",
    "model.d_model=32",
    "model.n_layers=2",
    "model.n_heads=4",
    "model.n_kv_heads=2",
    "model.d_ff=64",
    "model.max_seq_len=64",
]


def _tiny_hf(directory, seed: int, max_shard_bytes: int) -> None:
    """A random tiny Llama with jaxpar's byte-level tokenizer as a Hugging Face directory."""
    cfg = config_lib.load_config(None, TINY)
    abstract = nnx.eval_shape(lambda: Transformer(cfg.model, rngs=nnx.Rngs(0)))
    rng = np.random.default_rng(seed)
    params = {
        path: rng.standard_normal(s.shape).astype(np.float32)
        for path, s in families.flatten(nnx.to_pure_dict(nnx.state(abstract))).items()
    }
    export_lib.write_safetensors(families.hf_tensors(params, cfg.model), str(directory), max_shard_bytes)
    eod = export_lib.write_tokenizer(cfg, str(directory))
    with open(directory / "config.json", "w") as f:
        json.dump({**families.hf_config(cfg.model), "eos_token_id": eod}, f)


def _cache_put(cache, commit: str, source, refs: list[str]) -> None:
    """`source`'s files as the snapshot `commit` of REPO in the Hub cache `cache`, named by `refs`.
    (The Hub names a blob by its git or LFS hash; the name is not checked when reading.)"""
    repo = cache / f"models--{REPO.replace('/', '--')}"
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir(exist_ok=True)
    for name in sorted(os.listdir(source)):
        data = (source / name).read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        os.symlink(os.path.relpath(blob, snapshot), snapshot / name)
    (repo / "refs").mkdir(exist_ok=True)
    for ref in refs:
        (repo / "refs" / ref).write_text(commit)  # no newline, as huggingface_hub writes it


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """(root, HF_HOME): root/A and root/B the two local directories, HF_HOME/hub the cache."""
    root = tmp_path_factory.mktemp("hub")
    _tiny_hf(root / "A", seed=1, max_shard_bytes=20_000)
    _tiny_hf(root / "B", seed=2, max_shard_bytes=10**9)
    assert (root / "A" / "model.safetensors.index.json").exists()
    assert not (root / "B" / "model.safetensors.index.json").exists()
    home = root / "hf_home"
    _cache_put(home / "hub", COMMITS["A"], root / "A", ["main"])
    _cache_put(home / "hub", COMMITS["B"], root / "B", ["v1"])
    return root, home


@pytest.fixture
def offline_cache(models, monkeypatch):
    """This process's huggingface_hub reading the cache of `models` alone."""
    from huggingface_hub import constants

    root, home = models
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(home / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return root, home


def _snapshot(home, label: str) -> str:
    return str(home / "hub" / f"models--{REPO.replace('/', '--')}" / "snapshots" / COMMITS[label])


def _command(home, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE_"))}
    env.update(HF_HOME=str(home), HF_HUB_OFFLINE="1")
    return subprocess.run(
        [sys.executable, "-m", "jaxpar.convert", "from-hf", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=300,
    )


def _params(run) -> dict:
    return families.flatten(export_lib.load_params(str(run))[1])


def _assert_same_run(run, reference) -> None:
    got, want = _params(run), _params(reference)
    assert set(got) == set(want)
    for path in want:
        np.testing.assert_array_equal(got[path], want[path], err_msg=path)
    assert config_lib.load_config(str(run / "config.yaml")).model == (
        config_lib.load_config(str(reference / "config.yaml")).model
    )
    assert (run / "tokenizer.json").read_bytes() == (reference / "tokenizer.json").read_bytes()


def test_from_hf_converts_a_hub_id_from_the_cache_as_its_local_directory(models, tmp_path):
    root, home = models
    proc = _command(home, REPO, "--out", str(tmp_path / "hub_run"))
    assert proc.returncode == 0, proc.stderr
    assert f"of {_snapshot(home, 'A')} -> " in proc.stdout
    convert.from_hf(str(root / "A"), str(tmp_path / "local_run"))
    _assert_same_run(tmp_path / "hub_run", tmp_path / "local_run")


def test_a_revision_picks_its_snapshot(offline_cache, tmp_path, capsys):
    root, home = offline_cache
    assert hub.model_dir(REPO) == _snapshot(home, "A")  # main
    assert hub.model_dir(REPO, "v1") == _snapshot(home, "B")  # a tag
    assert hub.model_dir(REPO, COMMITS["B"]) == _snapshot(home, "B")  # a commit hash
    assert convert.main(["from-hf", REPO, "--revision", "v1", "--out", str(tmp_path / "v1")]) == 0
    convert.from_hf(str(root / "B"), str(tmp_path / "local_b"))
    _assert_same_run(tmp_path / "v1", tmp_path / "local_b")
    assert convert.main(["from-hf", REPO, "--revision", "v2", "--out", str(tmp_path / "v2")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "at revision v2 is not (completely) in the Hugging Face cache" in err
    assert not (tmp_path / "v2").exists()


def test_only_the_files_jaxpar_reads_are_asked_for_at_one_commit(models, monkeypatch):
    """What snapshot_download is asked for (online it fetches just those): config, weights and
    tokenizer files, then the shards the index lists, at the commit the first call resolved."""
    import huggingface_hub

    _, home = models
    calls = []

    def snapshot_download(repo_id, revision=None, allow_patterns=None):
        calls.append((repo_id, revision, allow_patterns))
        return _snapshot(home, "A")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    assert hub.model_dir(REPO, "main") == _snapshot(home, "A")
    with open(os.path.join(_snapshot(home, "A"), "model.safetensors.index.json")) as f:
        shards = sorted(set(json.load(f)["weight_map"].values()))
    assert len(shards) > 1
    assert calls == [(REPO, "main", hub.FILES), (REPO, COMMITS["A"], shards)]
    assert set(hub.FILES) >= {"config.json", "tokenizer.json", "tokenizer_config.json"}


def test_offline_and_not_cached_exits_2_with_one_line(tmp_path):
    (tmp_path / "empty_home").mkdir()
    proc = _command(tmp_path / "empty_home", REPO, "--out", str(tmp_path / "run"))
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1, proc.stderr
    for fragment in ["config error: tiny-org/tiny-llama: no such directory", "is not (completely) in "]:
        assert fragment in proc.stderr
    assert "HF_HUB_OFFLINE=1 is set" in proc.stderr and str(tmp_path / "empty_home" / "hub") in proc.stderr
    assert not (tmp_path / "run").exists()


def test_a_local_directory_wins_over_a_hub_id_of_its_name(offline_cache, tmp_path, monkeypatch, capsys):
    root, _ = offline_cache
    shutil.copytree(root / "B", tmp_path / REPO)
    monkeypatch.chdir(tmp_path)
    assert hub.model_dir(REPO) == str(tmp_path / REPO)
    assert convert.main(["from-hf", REPO, "--revision", "v1", "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "is a local directory (a local path wins over an id)" in err


def test_init_from_takes_a_hub_id_and_records_its_snapshot(offline_cache):
    _, home = offline_cache
    settings = config_lib.user_settings(None, [f"train.init_from={REPO}"])
    cfg = convert.apply_init_from(config_lib.build_config(settings), settings)
    assert cfg.train.init_from == _snapshot(home, "A")
    assert cfg.data.tokenizer == os.path.join(_snapshot(home, "A"), "tokenizer.json")
    assert (cfg.model.d_model, cfg.model.n_layers, cfg.model.vocab_size) == (32, 2, 264)
    assert config_lib.resolve_paths(cfg).train.init_from == _snapshot(home, "A")


def _http_error(kind, status: int):
    import httpx2

    response = httpx2.Response(
        status, request=httpx2.Request("GET", f"https://huggingface.co/api/models/{REPO}")
    )
    return kind("the Hub said no", response=response)


def _unreachable():
    from huggingface_hub import errors

    try:
        raise ConnectionError("no route to host")
    except ConnectionError as cause:
        try:
            raise errors.LocalEntryNotFoundError("not cached") from cause
        except errors.LocalEntryNotFoundError as e:
            return e


HUB_ERRORS = {  # case -> (the error snapshot_download raises, what the one line must say)
    "gated": ("GatedRepoError", 403, ["is gated on the Hugging Face Hub", "hf auth login", "HF_TOKEN"]),
    "private or missing": (
        "RepositoryNotFoundError",
        401,
        ["no model tiny-org/tiny-llama on the Hugging Face Hub", "hf auth login", "HF_TOKEN"],
    ),
    "no such revision": ("RevisionNotFoundError", 404, ["has no revision v9", "a branch, a tag or a commit"]),
    "no network": (
        None,
        None,
        ["is not (completely) in the Hugging Face cache", "(ConnectionError): no network"],
    ),
}


@pytest.mark.parametrize("case", HUB_ERRORS)
def test_what_the_hub_refuses_is_one_line_and_exit_2(case, tmp_path, monkeypatch, capsys):
    import huggingface_hub
    from huggingface_hub import constants, errors

    kind, status, fragments = HUB_ERRORS[case]
    error = _unreachable() if kind is None else _http_error(getattr(errors, kind), status)

    def snapshot_download(*args, **kwargs):
        raise error

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    assert convert.main(["from-hf", REPO, "--revision", "v9", "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("config error: tiny-org/tiny-llama: ") and err.count("\n") == 1, err
    for fragment in fragments:
        assert fragment in err, (fragment, err)


@pytest.mark.parametrize("name", ["no/such/directory", "./missing", "gpt2", "org/na--me"])
def test_a_name_neither_a_directory_nor_an_id_exits_2(name, tmp_path, capsys):
    assert convert.main(["from-hf", name, "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert err == f"config error: {name}: no such directory, and not a Hugging Face Hub model id (ORG/NAME)\n"
