"""Mixtures of prepared datasets (data.sources): grain's MapDataset.mix in fixed proportions.

Two sources whose documents use disjoint letters, so every packed row tells which source it came
from. No JAX here: the training run with a mixture (tokens seen per source in metrics.jsonl) is
in tests/test_eval.py, which shares its compile with the evaluation tests.
"""

import json
from pathlib import Path

import grain
import numpy as np
import pytest

from jaxpar import checks as checks_lib
from jaxpar import config as config_lib
from jaxpar.config import ConfigError, DataConfig, SourceConfig
from jaxpar.corpus import data, prepare
from jaxpar.corpus.data import batch_dataset, make_iterator
from jaxpar.corpus.documents import ByteTokenizer
from jaxpar.corpus.sources import source_names

KEYS = ("inputs", "targets", "positions", "segment_ids", "loss_mask")
LETTERS = {"a": "abcdefgh", "b": "qrstuvwx"}  # source -> its alphabet (bytes 97-104, 113-120)
SEQ = 16


def documents(alphabet: str, count: int, seed: int) -> list[str]:
    rng = np.random.default_rng(seed)
    return ["".join(rng.choice(list(alphabet), size=rng.integers(5, 80))) for _ in range(count)]


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    """Source a (about 5,000 tokens) and source b (about 3,000): b comes round sooner."""
    root = tmp_path_factory.mktemp("mixture")
    out = {}
    for (name, alphabet), count in zip(LETTERS.items(), (120, 70)):
        jsonl = root / f"{name}.jsonl"
        jsonl.write_text(
            "".join(json.dumps({"text": d}) + "\n" for d in documents(alphabet, count, seed=len(out)))
        )
        out[name] = root / name
        prepare.prepare([str(jsonl)], str(out[name]), log=lambda m: None, progress=False, shard_tokens=1000)
    return out


def mixture(prepared, wa=0.7, wb=0.3):
    cfg = DataConfig(sources=[SourceConfig(str(prepared["a"]), wa), SourceConfig(str(prepared["b"]), wb)])
    return data.training_source(cfg, ByteTokenizer(), SEQ)


def source_of(row: np.ndarray) -> str:
    """The source of a packed row, from its letters (every row holds some)."""
    found = {
        name
        for name, alphabet in LETTERS.items()
        if np.isin(row, np.frombuffer(alphabet.encode(), np.uint8)).any()
    }
    assert len(found) == 1, row
    return found.pop()


def take(dataset, steps, state=None):
    iterator = make_iterator(dataset, state=state)
    return [next(iterator) for _ in range(steps)]


def assert_same_batches(a, b) -> None:
    for batch_a, batch_b in zip(a, b, strict=True):
        for key in KEYS:
            np.testing.assert_array_equal(batch_a[key], batch_b[key], err_msg=key)


def test_counts_per_source_are_the_ones_grain_draws():
    """`mixture_counts` (what the metrics report) against the source of each sample that grain's
    MapDataset.mix actually gives, for random weights and lengths."""
    rng = np.random.default_rng(0)
    for _ in range(40):
        weights = rng.uniform(0.05, 5.0, size=rng.integers(1, 5)).tolist()
        proportions = data.mixture_proportions(weights)
        tagged = [grain.MapDataset.range(10**6).map(lambda _, i=i: i) for i in range(len(weights))]
        mixed = grain.MapDataset.mix(tagged, weights=list(proportions))
        n = int(rng.integers(0, 2000))
        drawn = np.bincount([mixed[k] for k in range(n)], minlength=len(weights)).tolist()
        assert data.mixture_counts(proportions, n) == drawn, (weights, n)
        shares = np.array(drawn) / max(n, 1)
        np.testing.assert_allclose(shares, np.array(weights) / sum(weights), atol=1.5 / max(n, 1) + 0.01)


def test_a_mixture_draws_its_weights_from_each_sources_own_stream(prepared):
    """0.7 / 0.3 of the rows, every global batch within a row of its share; source a's rows are
    exactly its own shuffled stream (what data.source=a would read), and source b's first
    len(b) rows one whole epoch of b, each sequence once."""
    mix = mixture(prepared)
    a, b = mix.sources
    steps = len(b) // 2 + 1  # 4 * len(b) rows: b's 30% of them pass its first epoch
    batches = take(batch_dataset(mix, global_batch=8, seed=5), steps)
    rows = {"a": [], "b": []}
    for batch in batches:
        names = [source_of(row) for row in batch["inputs"]]
        assert abs(names.count("a") - 0.7 * 8) <= 1, names  # within each batch, too
        for name, row in zip(names, batch["inputs"]):
            rows[name].append(row)
    total = steps * 8
    assert [len(rows["a"]), len(rows["b"])] == data.mixture_counts(mix.proportions, total)
    assert mix.counts(total) == {"a": len(rows["a"]), "b": len(rows["b"])}
    assert abs(len(rows["a"]) / total - 0.7) < 0.01
    own = data.sample_stream(a, seed=5)
    for k, row in enumerate(rows["a"]):
        np.testing.assert_array_equal(row, own[k]["inputs"])
    assert len(rows["b"]) > len(b)
    epoch = {tuple(row) for row in rows["b"][: len(b)]}
    assert epoch == {tuple(b[i]["inputs"]) for i in range(len(b))}  # all of b, none twice
    # A mixture of one source reads what data.source reads.
    one = data.training_source(
        DataConfig(sources=[SourceConfig(str(prepared["a"]), 2.0)]), ByteTokenizer(), SEQ
    )
    plain = data.packed_source(DataConfig(source=str(prepared["a"])), ByteTokenizer(), SEQ)
    assert_same_batches(
        take(batch_dataset(one, global_batch=8, seed=5), 6),
        take(batch_dataset(plain, global_batch=8, seed=5), 6),
    )


def test_seeds_process_shares_and_a_restored_iterator(prepared):
    """Same seed, same batches (the sources opened again); another seed, others; two processes'
    shares disjoint and together the global batch; a restored iterator continues identically."""
    steps = 12
    single = take(batch_dataset(mixture(prepared), global_batch=8, seed=5), steps)
    assert_same_batches(single, take(batch_dataset(mixture(prepared), global_batch=8, seed=5), steps))
    other = take(batch_dataset(mixture(prepared), global_batch=8, seed=6), 1)[0]
    assert not np.array_equal(other["inputs"], single[0]["inputs"])
    shares = [
        take(
            batch_dataset(mixture(prepared), global_batch=8, seed=5, process_index=p, process_count=2), steps
        )
        for p in range(2)
    ]
    for s in range(steps):
        for key in KEYS:
            joined = np.concatenate([shares[0][s][key], shares[1][s][key]])
            np.testing.assert_array_equal(joined, single[s][key], err_msg=f"step {s} {key}")
        rows = [set(map(tuple, shares[p][s]["inputs"])) for p in range(2)]
        assert not rows[0] & rows[1]
    iterator = make_iterator(batch_dataset(mixture(prepared), global_batch=8, seed=5))
    for _ in range(5):
        next(iterator)
    state = json.loads(json.dumps(iterator.get_state()))  # as a checkpoint stores it
    expected = [next(iterator) for _ in range(5)]
    restored = take(batch_dataset(mixture(prepared), global_batch=8, seed=5), 5, state=state)
    assert_same_batches(restored, expected)
    assert_same_batches(expected, single[5:10])


def test_weights_are_relative_and_the_config_round_trips(prepared, tmp_path):
    assert mixture(prepared, 7, 3).proportions == mixture(prepared, 0.7, 0.3).proportions == (233, 100)
    sources = f"[{{path: {prepared['a']}, weight: 0.7}}, {{path: {prepared['b']}, weight: 0.3, name: web}}]"
    cfg = config_lib.load_config(None, [f"data.sources={sources}"])
    assert cfg.data.sources == [
        SourceConfig(str(prepared["a"]), 0.7),
        SourceConfig(str(prepared["b"]), 0.3, "web"),
    ]
    assert source_names(cfg.data) == ["a", "web"]
    checks_lib.validate(cfg, 8)
    config_lib.dump_yaml(cfg, str(tmp_path / "config.yaml"))
    assert config_lib.load_config(str(tmp_path / "config.yaml")) == cfg


def test_bad_mixtures_are_refused_naming_the_key(prepared, tmp_path, capsys):
    a, b = prepared["a"], prepared["b"]
    unfinished = tmp_path / "unfinished"
    unfinished.mkdir()
    (unfinished / "prepare.json").write_text("{}")
    cases = [
        ("[]", "data.sources is empty: give at least one {path: DIR, weight: W}"),
        (f"[{{path: {a}, weight: 0}}]", "data.sources[0].weight=0.0: use a positive, finite weight"),
        (
            f"[{{path: {a}, weight: 1}}, {{path: {b}, weight: -0.5}}]",
            "data.sources[1].weight=-0.5: use a positive",
        ),
        (f"[{{path: {a}, weight: .nan}}]", "data.sources[0].weight=nan: use a positive, finite"),
        (f"[{{path: {a}, weight: .inf}}]", "data.sources[0].weight=inf: use a positive, finite"),
        (
            f"[{{path: {tmp_path}, weight: 1}}]",
            f"data.sources[0].path='{tmp_path}' is not a directory of prepared shards (no manifest.json): "
            f"make one with python -m jaxpar.data prepare SOURCES --out {tmp_path}",
        ),
        (f"[{{path: {unfinished}, weight: 1}}]", "its preparation did not finish; run the same"),
        (
            f"[{{path: {a}, weight: 1}}, {{path: {a}/, weight: 1}}]",
            "data.sources[0] and data.sources[1] are both named 'a' in the metrics",
        ),
        (f"[{{path: {a}, wieght: 1}}]", "data.sources[0]: unknown key 'wieght'; it takes path, weight, name"),
        ("[{weight: 1}]", "data.sources[0]: 'path' is missing"),
        (f"[{{path: {a}, weight: heavy}}]", "data.sources[0].weight: expected float, got 'heavy'"),
        (f"{{path: {a}, weight: 1}}", "data.sources: expected a list, got {'path':"),
    ]
    for sources, message in cases:
        with pytest.raises(ConfigError) as info:
            checks_lib.validate(config_lib.load_config(None, [f"data.sources={sources}"]), 8)
        assert message in str(info.value), (sources, str(info.value))
    both = config_lib.load_config(None, [f"data.source={a}", f"data.sources=[{{path: {b}, weight: 1}}]"])
    with pytest.raises(ConfigError, match=f"data.source='{a}' and data.sources are both set"):
        checks_lib.validate(both, 8)
    # The command line: exit 2 with the message, before anything compiles.
    from jaxpar.run.train import main

    tiny = str(Path(__file__).resolve().parents[1] / "configs" / "tiny.yaml")
    assert main([tiny, "runtime.cpu_devices=8", f"data.sources=[{{path: {a}, weight: -1}}]"]) == 2
    assert (
        "config error: data.sources[0].weight=-1.0: use a positive, finite weight" in capsys.readouterr().err
    )
    # Shards of another tokenizer: refused when the run opens them, before anything compiles.
    tokenizer = tmp_path / "tokenizer.json"
    data.train_tokenizer(documents(LETTERS["a"], 20, 0), vocab_size=300, out=str(tokenizer))
    other = DataConfig(tokenizer=str(tokenizer), sources=[SourceConfig(str(a), 1.0)])
    with pytest.raises(
        ConfigError, match=f"{a}/manifest.json: the shards were prepared with tokenizer 'byte'"
    ):
        data.training_source(other, None, SEQ)
