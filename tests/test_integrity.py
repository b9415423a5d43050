"""Nothing trains on wrong data (issue 33): prepared shards are verified before a run reads them,
a resume onto other data is refused, damaged compressed input and a full disk are one line, and
the launcher, the converter and the planner refuse what they cannot do before doing any of it.

Each test starts from a reproducer of the issue. Most run in this process; the few that must see
a command's exit code and output start it as a subprocess.
"""

import gzip
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from jaxpar.config import ConfigError, DataConfig
from jaxpar.corpus import data, prepare, reader, verify
from jaxpar.corpus.documents import ByteTokenizer
from tests.test_faults import mount_tmpfs

ROOT = Path(__file__).resolve().parents[1]
TINY_YAML = str(ROOT / "configs" / "tiny.yaml")


def quiet(message):
    pass


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    """Every test records its verified shards in a cache of its own."""
    monkeypatch.setenv("JAXPAR_CACHE", str(tmp_path / "cache"))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    rng = np.random.default_rng(0)
    words = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "iota"]
    root = tmp_path_factory.mktemp("corpus")
    lines = (
        json.dumps({"text": " ".join(rng.choice(words, size=rng.integers(5, 60)))}) + "\n"
        for _ in range(1500)
    )
    (root / "docs.jsonl").write_text("".join(lines))
    return root / "docs.jsonl"


@pytest.fixture(scope="module")
def prepared(corpus, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("prepared") / "set"
    assert (
        data.main(
            ["prepare", str(corpus), "--out", str(out), "--val-fraction", "0.1", "--shard-tokens", "60000"]
        )
        == 0
    )
    return out


def copy_of(prepared: Path, tmp_path: Path) -> Path:
    shutil.copytree(prepared, tmp_path / "set")
    return tmp_path / "set"


def open_for_training(directory: Path):
    return data.packed_source(DataConfig(source=str(directory)), ByteTokenizer(), 32)


# --- Item 1: training verifies what is in the shards ------------------------------------------------


def overwrite_ids(path: Path, fraction: float, value=None, seed=0) -> None:
    """Overwrites `fraction` of the uint16 ids of a shard in place (its size unchanged): with
    `value`, or with other valid byte ids (end-of-document tokens left where they are)."""
    ids = np.fromfile(path, dtype="<u2")
    rng = np.random.default_rng(seed)
    where = rng.choice(len(ids), size=max(1, int(fraction * len(ids))), replace=False)
    if value is None:
        where = where[ids[where] != 256]
    ids[where] = value if value is not None else (ids[where] + 1 + rng.integers(0, 200, len(where))) % 256
    ids.tofile(path)


def swap_two_ends(path: Path) -> None:
    ends = np.fromfile(path, dtype="<i8")
    ends[[3, 4]] = ends[[4, 3]]
    ends.tofile(path)


def edit_manifest(directory: Path, key: str, value) -> None:
    manifest = json.loads((directory / "manifest.json").read_text())
    manifest["tokenizer"][key] = value
    (directory / "manifest.json").write_text(json.dumps(manifest))


CORRUPTIONS = {
    # what the probe did -> what the refusal must say
    "30% of ids 65535": (
        lambda d: overwrite_ids(d / "train-00000.bin", 0.3, 0xFFFF),
        r"train-00000.bin: token \d+ is id 65535, beyond the tokenizer's 257 ids",
    ),
    "25,000 valid ids": (
        lambda d: overwrite_ids(d / "train-00001.bin", 25000 / 60000),
        r"train-00001.bin: its SHA-256 is \w+\.\.\., but manifest.json records",
    ),
    "one valid id": (
        lambda d: overwrite_ids(d / "train-00001.bin", 1 / 50000, seed=3),
        r"train-00001.bin: its SHA-256 is",
    ),
    "two ends swapped": (
        lambda d: swap_two_ends(d / "train-00000.idx"),
        r"train-00000.idx: document 4 ends at token \d+, not after the one before",
    ),
    "vocab_size 100": (
        lambda d: edit_manifest(d, "vocab_size", 100),
        (
            r"manifest.json: tokenizer.vocab_size is 100, but the tokenizer it names "
            r"\('byte', the same file\) has 257"
        ),
    ),
}


@pytest.mark.parametrize("corruption", list(CORRUPTIONS))
def test_shards_that_differ_from_their_manifest_are_refused_naming_the_file(prepared, tmp_path, corruption):
    directory = copy_of(prepared, tmp_path)
    corrupt, message = CORRUPTIONS[corruption]
    corrupt(directory)
    with pytest.raises(ConfigError, match=message) as refused:
        open_for_training(directory)
    assert "prepare the corpus again" in str(refused.value) or "manifest" in str(refused.value)
    # The full check says the same.
    with pytest.raises(ConfigError, match=message):
        verify.verify(str(directory), log=quiet)


def test_a_later_shard_and_the_val_split_are_verified_too(prepared, tmp_path):
    directory = copy_of(prepared, tmp_path)
    last = max(directory.glob("train-*.bin"))
    overwrite_ids(last, 0.01)
    with pytest.raises(ConfigError, match=f"{last.name}: its SHA-256"):
        open_for_training(directory)
    directory = copy_of(prepared, tmp_path / "b")
    overwrite_ids(directory / "val-00000.bin", 0.01)
    open_for_training(directory)  # training reads the train split alone
    with pytest.raises(ConfigError, match="val-00000.bin: its SHA-256"):
        reader.PreparedSequences(str(directory), "byte", 32, split="val")


def test_verification_is_cached_by_file_identity(prepared, tmp_path, monkeypatch):
    directory = copy_of(prepared, tmp_path)
    read = []
    real = verify.verify_shard
    monkeypatch.setattr(verify, "verify_shard", lambda d, r, *a: read.append(r["name"]) or real(d, r, *a))
    open_for_training(directory)
    names = [
        r["name"] for r in json.loads((directory / "manifest.json").read_text())["splits"]["train"]["shards"]
    ]
    assert read == names  # first use: every shard of the split read whole
    read.clear()
    open_for_training(directory)
    assert read == []  # a second start: nothing read again
    # A shard rewritten in place, its modification time set back: its change time tells.
    shard = directory / "train-00001.bin"
    st = os.stat(shard)
    overwrite_ids(shard, 0.001, seed=5)
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert os.stat(shard).st_size == st.st_size and os.stat(shard).st_mtime_ns == st.st_mtime_ns
    with pytest.raises(ConfigError, match="train-00001.bin: its SHA-256"):
        open_for_training(directory)
    assert read == ["train-00001.bin"[:-4]]  # only the changed shard was read again


def test_verify_command_checks_everything_and_exits_2_naming_the_file(prepared, tmp_path, capsys):
    directory = copy_of(prepared, tmp_path)
    assert data.main(["verify", str(directory)]) == 0
    out = capsys.readouterr().out
    assert f"{directory}: " in out and "shard(s) verified" in out and "MiB read in" in out
    overwrite_ids(directory / "val-00000.bin", 0.3, 0xFFFF)
    assert data.main(["verify", str(directory)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "val-00000.bin: token" in err[0] and "beyond the tokenizer's" in err[0]
    assert data.main(["verify", str(tmp_path / "nothing")]) == 2
    assert f"{tmp_path / 'nothing'}: no such directory" in capsys.readouterr().err


def drop_first_train_shard_from_manifest(directory: Path) -> None:
    manifest = json.loads((directory / "manifest.json").read_text())
    del manifest["splits"]["train"]["shards"][0]
    (directory / "manifest.json").write_text(json.dumps(manifest))


def drop_last_train_shard_from_manifest_and_totals(directory: Path) -> None:
    manifest = json.loads((directory / "manifest.json").read_text())
    split = manifest["splits"]["train"]
    gone = split["shards"].pop()
    split["tokens"] -= gone["tokens"]
    split["documents"] -= gone["documents"]
    (directory / "manifest.json").write_text(json.dumps(manifest))


def edit_manifest_entry(directory: Path, edit) -> None:
    manifest = json.loads((directory / "manifest.json").read_text())
    edit(manifest)
    (directory / "manifest.json").write_text(json.dumps(manifest))


UNLISTED = {
    # what the probe did -> what verify must say
    "a shard the manifest does not list": (
        lambda d: shutil.copy(d / "train-00000.bin", d / "train-00042.bin"),
        r"train-00042.bin is a shard file that manifest.json does not list",
    ),
    "an entry removed from the manifest": (
        drop_first_train_shard_from_manifest,
        r"manifest.json: the \d+ shard\(s\) it lists for the train split hold \d+ tokens, but it "
        r"records \d+ for the split: a shard is missing from its list",
    ),
    "an entry and its totals removed": (
        drop_last_train_shard_from_manifest_and_totals,
        r"train-0000\d.bin is a shard file that manifest.json does not list",
    ),
    "a shard's entry without its token count": (
        lambda d: edit_manifest_entry(d, lambda m: m["splits"]["train"]["shards"][0].pop("tokens")),
        r"manifest.json has no valid 'splits.train.shards\[0\].tokens': it is damaged or was edited",
    ),
    "a listed shard's file deleted": (
        lambda d: os.unlink(d / "train-00001.idx"),
        r"train-00001.idx is missing",
    ),
}


@pytest.mark.parametrize("change", list(UNLISTED))
def test_verify_fails_where_the_manifest_and_the_files_disagree(prepared, tmp_path, capsys, change):
    """Bug (issue 40): a shard file the manifest does not list, or a manifest that lost a
    shard's entry, passed `python -m jaxpar.data verify`; an entry without a key it needs ended
    in a KeyError traceback."""
    import re

    directory = copy_of(prepared, tmp_path)
    alter, message = UNLISTED[change]
    alter(directory)
    assert data.main(["verify", str(directory)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and re.search(message, err[0]), err


def test_verify_of_a_file_says_it_wants_a_directory(prepared, tmp_path, capsys):
    """Bug (issue 40): `verify DIR/train-00000.bin` said 'data.source=... has no manifest.json ...
    for raw files give a glob, e.g. DIR/train-00000.bin/*.txt'."""
    directory = copy_of(prepared, tmp_path)
    assert data.main(["verify", str(directory / "train-00000.bin")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        f"error: {directory / 'train-00000.bin'} is a file; verify takes a directory of prepared "
        f"shards (python -m jaxpar.data verify {directory} checks the set it belongs to)"
    ]
    (tmp_path / "notes.txt").write_text("not a shard")
    assert data.main(["verify", str(tmp_path / "notes.txt")]) == 2
    assert "notes.txt is a file; verify takes a directory of prepared shards (python -m jaxpar.data " in (
        capsys.readouterr().err
    )


def test_training_on_overwritten_ids_exits_2_before_the_first_step(prepared, tmp_path):
    """The issue's reproducer, as a user runs it."""
    directory = copy_of(prepared, tmp_path)
    overwrite_ids(directory / "train-00000.bin", 0.3, 0xFFFF)
    run = tmp_path / "run"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "jaxpar.train",
            TINY_YAML,
            f"data.source={directory}",
            "data.max_documents=null",
            "train.steps=3",
            "runtime.cpu_devices=1",
            "checkpoint.every=100",
            f"train.run_dir={run}",
        ],
        cwd=ROOT,
        env=dict(os.environ, JAX_PLATFORMS="cpu"),
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 2, done.stderr[-2000:]
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr[-2000:]
    assert "train-00000.bin: token" in lines[0] and "beyond the tokenizer's 257 ids" in lines[0]
    assert not (run / "metrics.jsonl").exists()


def write_text_corpus(directory: Path, megabytes: float) -> None:
    """Text files of printable bytes, 256 KiB each: a byte-tokenized set of twice the size."""
    directory.mkdir()
    rng = np.random.default_rng(1)
    for n in range(int(megabytes * 4)):
        (directory / f"{n:04d}.txt").write_bytes((rng.integers(32, 127, 1 << 18, dtype=np.uint8)).tobytes())


def test_a_25_mb_set_verifies_in_seconds_and_a_second_start_reads_nothing(tmp_path, monkeypatch):
    write_text_corpus(tmp_path / "text", 12.5)
    out = tmp_path / "set"
    prepare.prepare(
        [str(tmp_path / "text" / "*.txt")], str(out), log=quiet, progress=False, shard_tokens=1 << 22
    )
    size = sum(p.stat().st_size for p in out.glob("*-*.*"))
    assert 25 << 20 <= size < 27 << 20
    clock = time.perf_counter()
    open_for_training(out)
    first = time.perf_counter() - clock
    read = []
    monkeypatch.setattr(verify, "verify_shard", lambda *a: read.append(a) or None)
    clock = time.perf_counter()
    open_for_training(out)
    second = time.perf_counter() - clock
    assert read == [] and first < 10, (first, second)
    print(f"25 MiB set: first use {first:.2f} s, second start {second:.3f} s")


# --- Item 2: a resume onto other data is refused ----------------------------------------------------


ONE_LAYOUT = ["mesh.data=8", "mesh.fsdp=1", "mesh.tensor=1"]


def tiny(run_dir, *extra):
    from jaxpar import checks as checks_lib
    from jaxpar import config as config_lib

    cfg = config_lib.load_config(TINY_YAML, ONE_LAYOUT + [f"train.run_dir={run_dir}", *extra])
    return cfg, checks_lib.validate(cfg, 8)


@pytest.fixture(scope="module")
def other_set(corpus, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("other") / "set"
    prepare.prepare([str(corpus)], str(out), log=quiet, progress=False, shard_tokens=100000)
    return out


@pytest.fixture(scope="module")
def base_run(prepared, tmp_path_factory) -> Path:
    """4 steps on `prepared`, checkpoints at 2 and 4 (a template: tests copy it)."""
    from jaxpar.run.train import train

    run = tmp_path_factory.mktemp("base") / "run"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("JAXPAR_CACHE", str(run.parent / "cache"))
        train(
            *tiny(run, "train.steps=4", "checkpoint.every=2", "checkpoint.keep=0", f"data.source={prepared}")
        )
    return run


def everything_in(run: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(run)): p.read_bytes()
        for p in sorted(run.rglob("*"))
        if p.is_file() and p.name != "jaxpar.lock"
    }


@pytest.mark.parametrize("change", ["data.source", "train.seed", "data.max_documents"])
def test_a_resume_onto_other_data_is_refused_naming_both_values(
    base_run, prepared, other_set, tmp_path, change
):
    from jaxpar.run.train import train

    run = tmp_path / "run"
    shutil.copytree(base_run, run)
    before = everything_in(run)
    setting, was, now = {
        "data.source": (f"data.source={other_set}", repr(str(prepared)), repr(str(other_set))),
        "train.seed": ("train.seed=1", "0", "1"),
        "data.max_documents": ("data.max_documents=20", "30", "20"),
    }[change]
    with pytest.raises(ConfigError) as refused:
        train(*tiny(run, "train.steps=6", f"data.source={prepared}", setting))
    message = str(refused.value)
    assert f"{change}={now} (the run trained on {was})" in message, message
    assert "checkpoint step 4" in message and "data.allow_source_change=true" in message
    assert "train.resume=never" in message
    assert everything_in(run) == before  # config.yaml still says what the run trained on


def test_allow_source_change_goes_on_and_the_record_keeps_both(base_run, prepared, other_set, tmp_path):
    import yaml

    from jaxpar.run import rundir
    from jaxpar.run.train import train

    run = tmp_path / "run"
    shutil.copytree(base_run, run)
    train(*tiny(run, "train.steps=6", f"data.source={other_set}", "data.allow_source_change=true"))
    record = yaml.safe_load((run / "config.yaml").read_text())
    assert record["data"]["source"] == str(other_set) and record["data"]["allow_source_change"] is True
    earlier = yaml.safe_load((run / "config.until-step-4.yaml").read_text())
    assert earlier["data"]["source"] == str(prepared)
    assert max(json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()) == 6
    # The record now names the new data: resuming on it needs nothing more.
    assert rundir.data_changes(str(run), yaml.safe_load((run / "config.yaml").read_text())) == []
    assert "config.until-step-4.yaml" in rundir.survey(str(run)).files  # resume=never moves it aside


def test_a_mixture_s_paths_and_weights_are_its_data_but_not_its_names(tmp_path):
    from jaxpar.run import rundir

    def settings(*sources):
        return {"data": {"sources": [dict(s) for s in sources]}, "train": {"seed": 0}}

    a, b = {"path": "/a", "weight": 0.7, "name": "web"}, {"path": "/b", "weight": 0.3, "name": "code"}
    (tmp_path / "config.yaml").write_text(json.dumps(settings(a, b)))
    assert rundir.data_changes(str(tmp_path), settings(a, b)) == []
    assert rundir.data_changes(str(tmp_path), settings(a, dict(b, name="other"))) == []
    ((key, was, now),) = rundir.data_changes(str(tmp_path), settings(a, dict(b, weight=0.5)))
    assert key == "data.sources" and was[1]["weight"] == 0.3 and now[1]["weight"] == 0.5
    assert rundir.data_changes(str(tmp_path), settings(b, a))[0][0] == "data.sources"
    assert rundir.data_changes(str(tmp_path / "nowhere"), settings(a)) == []  # no record: no check
    # A record of relative paths (an older config.yaml) names the same files as absolute ones.
    (tmp_path / "config.yaml").write_text(
        json.dumps({"data": {"source": "corpus/*.txt", "tokenizer": "byte"}})
    )
    here = {"data": {"source": os.path.abspath("corpus/*.txt"), "tokenizer": "byte"}}
    assert rundir.data_changes(str(tmp_path), here) == []
    assert rundir.data_changes(str(tmp_path), {"data": {"source": "stdlib", "tokenizer": "byte"}})


# --- Item 3: damaged compressed input and a full disk are one line ----------------------------------


def jsonl(first: int, count: int) -> bytes:
    return "".join(
        json.dumps({"text": f"document {n} " + "words " * 20}) + "\n" for n in range(first, first + count)
    ).encode()


def zst(data: bytes, checksum: bool = False) -> bytes:
    import zstandard

    return zstandard.ZstdCompressor(write_checksum=checksum).compress(data)


def flip(blob: bytes, at: int) -> bytes:
    return blob[:at] + bytes([blob[at] ^ 0x55]) + blob[at + 1 :]


BIG_DOCUMENT = b"the same sentence again and again. " * 123000  # 4.3 MB of text, 1 document
TWO_FRAMES = zst(jsonl(0, 200), checksum=True) + zst(jsonl(200, 200))
DAMAGED = {
    # file name -> (its bytes, what the one line says)
    "big.txt.zst": (zst(BIG_DOCUMENT)[:-40], "is cut short: its zstd frame 1 runs past the end"),
    "two.jsonl.zst": (TWO_FRAMES[:-100], "is cut short: its zstd frame 2 runs past the end"),
    "tail.jsonl.zst": (TWO_FRAMES + b"junk", "after its 2 whole zstd frame(s), begins no other"),
    "plain.jsonl.zst": (jsonl(0, 5), "is not a zstd file"),
    "cut.jsonl.gz": (gzip.compress(jsonl(0, 400))[:-200], "is not a whole gzip file (Compressed file ended"),
    "flipped.jsonl.gz": (flip(gzip.compress(jsonl(0, 400)), 300), "is not a whole gzip file"),
    "plain.jsonl.gz": (jsonl(0, 5), "is not a whole gzip file (Not a gzipped file"),
}


@pytest.mark.parametrize("name", list(DAMAGED))
def test_damaged_compressed_input_is_one_line_naming_the_file_and_leaves_nothing(name, tmp_path, capsys):
    blob, message = DAMAGED[name]
    (tmp_path / name).write_bytes(blob)
    out = tmp_path / "out"
    assert data.main(["prepare", str(tmp_path / name), "--out", str(out)]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {tmp_path / name}"), lines
    assert message in lines[0], lines
    assert not out.exists()


def test_every_frame_of_a_zst_is_read(tmp_path):
    (tmp_path / "two.jsonl.zst").write_bytes(TWO_FRAMES)
    documents = data.read_documents(DataConfig(source=str(tmp_path / "two.jsonl.zst")))
    assert len(documents) == 400 and documents[-1].startswith("document 399 ")


@pytest.fixture
def small_disk(tmp_path):
    yield mount_tmpfs(tmp_path / "disk", "size=600k")
    subprocess.run(["umount", "-l", str(tmp_path / "disk")], check=False)


def test_a_full_disk_during_prepare_is_one_line_and_the_rerun_resumes(small_disk, tmp_path, capsys):
    (tmp_path / "docs.jsonl").write_bytes(jsonl(0, 6000))  # 1.2 MB of shards
    command = ["prepare", str(tmp_path / "docs.jsonl"), "--shard-tokens", "40000"]
    assert data.main([*command, "--out", str(tmp_path / "whole")]) == 0
    capsys.readouterr()
    out = small_disk / "set"
    assert data.main([*command, "--out", str(out)]) == 1
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in lines[0], lines
    assert lines[0].startswith(f"error: no space left on the device of {out}: ")
    assert "complete shard(s)" in lines[0] and "run the same command to resume" in lines[0]
    assert not [n for n in os.listdir(out) if ".tmp-" in n]  # nothing half-written kept
    subprocess.run(["mount", "-o", "remount,size=4m", str(small_disk)], check=True)
    assert data.main([*command, "--out", str(out)]) == 0
    assert "already complete; resuming at document" in capsys.readouterr().err
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.name != ".lock"} == {
        p.name: p.read_bytes() for p in (tmp_path / "whole").iterdir() if p.name != ".lock"
    }


# --- Item 5: a launch is checked before the first fork, and stops on SIGTERM at any time -----------


def no_fork(*args, **kwargs):
    raise AssertionError("the launcher started a process")


@pytest.mark.parametrize(
    "args, overrides, message",
    [
        (["--nproc", "100000"], [], r"--nproc 100000: this machine holds about \d+ processes \("),
        (["--nproc", "2", "--port", "70000"], [], r"--port=70000: a TCP port is 1-65535"),
        (["--nproc", "0"], [], r"--nproc=0: need at least 1 process"),
        (
            ["--nproc", "3"],
            ["runtime.cpu_devices=1", "mesh.data=2", "mesh.fsdp=1", "mesh.tensor=1"],
            (
                r"config error: mesh: .* multiplies to 2 .*\(the run has --nproc 3 x "
                r"runtime.cpu_devices=1 = 3 devices\)"
            ),
        ),
        (
            ["--nproc", "2"],
            ["runtime.cpu_devices=0"],
            r"config error: runtime.cpu_devices=0: must be at least 1",
        ),
        (["--nproc", "2"], ["train.steps=0"], r"config error: train.steps=0: must be at least 1"),
        (["--nproc", "2"], ["train.stepz=4"], r"config error: unknown config key 'train.stepz'"),
    ],
)
def test_a_launch_that_cannot_work_is_refused_before_any_process_starts(
    args, overrides, message, monkeypatch, capsys
):
    import re

    from jaxpar import launch

    monkeypatch.setattr(launch.subprocess, "Popen", no_fork)
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    assert launch.main([*args, TINY_YAML, *overrides]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("jaxpar.launch: error: "), lines
    assert re.search(message, lines[0]), lines


def test_a_port_in_use_is_refused_and_the_count_follows_the_memory(monkeypatch, capsys):
    import socket

    from jaxpar import launch

    monkeypatch.setattr(launch.subprocess, "Popen", no_fork)
    with socket.socket() as taken:
        taken.bind(("", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert launch.main(["--nproc", "2", "--port", str(port), TINY_YAML]) == 2
    assert f"--port={port} cannot be the coordinator's (Address already in use)" in capsys.readouterr().err
    monkeypatch.setattr(launch, "_machine_memory", lambda: 5 * 2**30 + 1)
    most, _ = launch.most_processes()
    assert most == min(5, (os.cpu_count() or 1) * launch.PROCESSES_PER_CORE)
    assert launch.launch_problem(most + 1, [], None, config=False).startswith(f"--nproc {most + 1}: ")
    assert launch.launch_problem(most, [], None, config=False) is None


@pytest.mark.filterwarnings("ignore:os.fork:RuntimeWarning")  # the sleepers import no JAX
def test_sigterm_while_the_processes_start_stops_the_starting(monkeypatch, capsys):
    import signal

    from jaxpar import launch

    started = []
    real = launch.subprocess.Popen

    def popen(*args, **kwargs):  # SIGTERM arrives while the third process is being started
        if len(started) == 2:
            os.kill(os.getpid(), signal.SIGTERM)
        started.append(real(*args, **kwargs))
        return started[-1]

    monkeypatch.setattr(launch.subprocess, "Popen", popen)
    monkeypatch.setattr(launch, "most_processes", lambda: (12, "whatever the memory is now"))
    sleeper = [
        sys.executable,
        "-c",
        ("import signal, sys, time; signal.signal(signal.SIGTERM, lambda *a: sys.exit(0)); time.sleep(60)"),
    ]
    clock = time.monotonic()
    # 0 where a process had set its handler, 143 (killed by SIGTERM) where one was still starting
    assert launch.launch(12, [], command=sleeper, grace=10) in (0, 143)
    assert time.monotonic() - clock < 10
    assert len(started) == 3 and all(p.poll() is not None for p in started)
    assert "(a stop was requested before the other 9 started)" in capsys.readouterr().err


# --- Item 7: a checkpoint step that is not there, another optimizer --------------------------------


def test_to_hf_of_a_step_that_does_not_exist_exits_2_listing_the_steps(base_run, tmp_path, capsys):
    from jaxpar.hf import convert

    assert convert.main(["to-hf", str(base_run), "--out", str(tmp_path / "hf"), "--step", "3"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("config error: checkpoint step 3 in ") and "\n" not in err, err
    assert "there is no such checkpoint; its usable checkpoints are steps [2, 4]" in err
    assert not (tmp_path / "hf").exists() or not os.listdir(tmp_path / "hf")


def test_resuming_with_another_optimizer_says_it_is_the_optimizer(base_run, prepared, tmp_path):
    from jaxpar.run.train import train

    run = tmp_path / "run"
    shutil.copytree(base_run, run)
    with pytest.raises(
        ConfigError,
        match=r"holds the state of another optimizer \(the model's "
        r"parameters match\)",
    ) as refused:
        train(*tiny(run, "train.steps=6", f"data.source={prepared}", "optimizer.name=sgd"))
    assert "another shape" not in str(refused.value)
    assert "optimizer.name it was trained with" in str(refused.value)
    with pytest.raises(ConfigError, match="holds a model of another shape"):  # a model change still says so
        train(*tiny(run, "train.steps=6", f"data.source={prepared}", "model.d_ff=96"))


# --- Item 6: plan answers within seconds whatever the count ----------------------------------------


def brute_force_meshes(m, t, n: int) -> list[dict]:
    """Every 6-factorisation of n that passes the divisibility rules, in lexicographic order: the
    enumeration the planner made before it was pruned."""
    import itertools

    from jaxpar.config import MESH_AXES

    divisors = [d for d in range(1, n + 1) if n % d == 0]
    found = []
    for sizes in itertools.product(divisors, repeat=6):
        pipe, data, fsdp, expert, context, tensor = sizes
        if np.prod(sizes) != n:
            continue
        if (
            m.n_layers % pipe
            or m.n_heads % tensor
            or m.n_kv_heads % tensor
            or m.d_ff % tensor
            or m.vocab_size % tensor
            or t.seq_len % (2 * context if context > 1 else 1)
            or (expert > 1 and (m.moe.num_experts == 0 or m.moe.num_experts % expert))
            or t.batch_size % (data * fsdp * expert)
            or (fsdp > 1 and m.d_model % fsdp)
        ):
            continue
        found.append(dict(zip(MESH_AXES, sizes)))
    return found


@pytest.mark.parametrize(
    "preset, n", [("gpt2-124m", 12), ("llama-1b", 32), ("moe-tiny", 16), ("tiny", 16), ("llama-1b", 7)]
)
def test_the_pruned_mesh_enumeration_is_the_whole_one(preset, n):
    from jaxpar import config as config_lib
    from jaxpar.planning import search

    cfg = config_lib.load_config(str(ROOT / "configs" / f"{preset}.yaml"))
    assert list(search._meshes(cfg.model, cfg.train, n)) == brute_force_meshes(cfg.model, cfg.train, n)


@pytest.mark.parametrize("gpus", ["1000000xh100", "64000000xh100", "65536xh100"])
def test_plan_answers_a_huge_count_within_seconds(gpus, capsys):
    from jaxpar.planning import plan

    clock = time.perf_counter()
    code = plan.main([str(ROOT / "configs" / "llama-1b.yaml"), "--gpus", gpus])
    seconds = time.perf_counter() - clock
    assert code in (0, 3) and seconds < 20, (code, seconds)
    result = json.loads(capsys.readouterr().out)
    assert result["plans"] or "no layout of" in result["error"]


def test_data_packing_is_data_and_an_older_record_trained_with_wrap(tmp_path):
    """data.packing decides which rows global batch k holds: a resume onto the other value is a
    change of data, also from a record written before the setting (which trained with wrap, then
    the only packing)."""
    import yaml

    from jaxpar import config as config_lib
    from jaxpar.run import rundir

    record = config_lib.to_dict(config_lib.load_config(None, []))
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(record))
    whole = config_lib.to_dict(config_lib.load_config(None, ["data.packing=whole"]))
    assert rundir.data_changes(str(tmp_path), whole) == [("data.packing", "wrap", "whole")]
    del record["data"]["packing"]
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(record))
    assert rundir.data_changes(str(tmp_path), whole) == [("data.packing", "wrap", "whole")]
    assert rundir.data_changes(str(tmp_path), config_lib.to_dict(config_lib.load_config(None, []))) == []
