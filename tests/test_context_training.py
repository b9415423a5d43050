"""Context parallelism (ring attention over `context`) trains the single-device model."""

import numpy as np
import pytest

from jaxpar import config as config_lib
from jaxpar.config import ConfigError
from jaxpar.inspect import compile_step, report
from tests.parity import STEPS, run_steps, trainer_on
TINY = [
    "model.vocab_size=264", "model.d_model=32", "model.n_layers=2", "model.n_heads=4",
    "model.n_kv_heads=2", "model.d_ff=64", "model.dtype=float32", "train.batch_size=8",
    "train.seq_len=32", "optimizer.warmup_steps=2", "optimizer.lr=1e-2", "parallel.zero_stage=0",
]


def packed_batches(batch, seq):
    """Random tokens in two documents per row (a boundary at a random place)."""
    rng = np.random.default_rng(1)
    for _ in range(STEPS):
        tokens = rng.integers(0, 257, (batch, seq + 1)).astype(np.int32)
        cut = rng.integers(1, seq, batch)[:, None]
        index = np.arange(seq)[None]
        segments = np.where(index < cut, 1, 2).astype(np.int32)
        yield {"inputs": tokens[:, :-1], "targets": tokens[:, 1:],
               "positions": np.where(index < cut, index, index - cut).astype(np.int32),
               "segment_ids": segments,
               "loss_mask": np.where(index == cut - 1, 0.0, 1.0).astype(np.float32)}


def run(mesh, extra=()):
    trainer = trainer_on(TINY + list(extra), mesh)
    compiled = compile_step(trainer)
    batches = packed_batches(trainer.cfg.train.batch_size, trainer.cfg.train.seq_len)
    return [h["loss"] for h in run_steps(trainer, compiled, batches)], report(trainer, compiled)


@pytest.fixture(scope="module")
def single_device():
    return run({})[0]


@pytest.mark.parametrize("mesh, extra", [
    ({"context": 4, "data": 2}, []),
    ({"data": 2, "context": 2, "tensor": 2}, []),
    ({"context": 8}, ["parallel.context_layout=contiguous"]),
])
def test_context_parallel_training_matches_single_device(mesh, extra, single_device):
    losses, r = run(mesh, extra)
    np.testing.assert_allclose(losses, single_device, rtol=1e-5)
    # K/V blocks travel the ring by collective-permute; nothing gathers the sequence.
    assert r["collectives"]["collective-permute"]["count"] > 0


def test_sequence_not_divisible_by_twice_the_context_is_a_config_error():
    cfg = config_lib.load_config(None, TINY + ["mesh.context=4", "mesh.data=2", "mesh.fsdp=1",
                                               "mesh.tensor=1", "train.seq_len=36"])
    with pytest.raises(ConfigError, match=r"train.seq_len=36 is not divisible by 8"):
        config_lib.validate(cfg, 8)
