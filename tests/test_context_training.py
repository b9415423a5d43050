"""Context parallelism (ring attention over `context`) trains the single-device model: the same
first-step gradients and SGD losses (tests/parity.py), on rows of two documents each."""

import functools

import pytest

from jaxpar import checks as checks_lib
from jaxpar.config import ConfigError
from jaxpar.inspect import compile_step, report
from jaxpar.parallel.ring_attention import needed_shifts
from tests.parity import LAYER_FORMS, assert_parity, parity_trainer, random_batches, run_parity, tiny_config


def run(mesh, extra=(), init=None, along=None):
    trainer = parity_trainer(list(extra), mesh)
    compiled = compile_step(trainer)
    got = run_parity(trainer, compiled, random_batches(trainer.cfg), init=init, along=along)
    return got, report(trainer, compiled)


@pytest.fixture(scope="module")
def single_device():
    return run({})[0]


@pytest.mark.parametrize(
    "mesh, extra, own_init",
    [
        ({"context": 4, "data": 2}, [], False),
        ({"data": 2, "context": 2, "tensor": 2}, [], True),
        ({"context": 8}, ["parallel.context_layout=contiguous"], False),
    ],
)
def test_context_parallel_training_matches_single_device(mesh, extra, own_init, single_device):
    """Scanned layers; unrolled ones: the sliding-window test below."""
    # own_init: the layout's born-sharded init; else the single-device one (one compile fewer).
    got, r = run(mesh, extra, init=None if own_init else single_device.init, along=single_device)
    assert_parity(got, single_device)
    # K/V blocks travel the ring by collective-permute; nothing gathers the sequence.
    assert r["collectives"]["collective-permute"]["count"] > 0


def test_sequence_not_divisible_by_twice_the_context_is_a_config_error():
    cfg = tiny_config(["mesh.context=4", "mesh.data=2", "mesh.fsdp=1", "mesh.tensor=1", "train.seq_len=36"])
    with pytest.raises(ConfigError, match=r"train.seq_len=36 is not divisible by 8"):
        checks_lib.validate(cfg, 8)


GEMMA_STYLE = [  # Gemma 3's block: the first layer slides over 8 positions, the second is global
    "model.sliding_window=8",
    "model.global_every=2",
    "model.rope_local_theta=100.0",
    "model.qk_norm=true",
    "model.post_norms=true",
    "model.norm_offset=true",
    "model.embed_scale=true",
    "model.mlp_activation=gelu_tanh",
    "model.attn_scale_dim=12",
]


@functools.cache
def _gemma_style_reference():
    return run({}, [*GEMMA_STYLE, "train.seq_len=64"])[0]


@pytest.mark.parametrize("form", LAYER_FORMS)
def test_sliding_window_layers_train_the_single_device_model_on_a_ring(form):
    """A sliding layer's ring (masked by the window, its unneeded hops left out: 64 positions in
    8 chunks of 8, a window of 8) and a global layer's full ring, chosen per layer inside the
    layer loop, give the one-device gradients.

    Unrolled, the file's one run of that form (tests/parity.py, LAYER_FORMS): a sliding and a
    global layer, each with its ring, written out on the first layout above (context 4 x data 2,
    zigzag). It fails on a layer run with another's weights or window flag (the bugs "reversed",
    "twice" and "sliding", planted and seen failing). The layouts above ran unrolled too; the
    layer loop does nothing different on them."""
    assert needed_shifts(64, 4, "zigzag", 8) == (0, 1, 3)  # the path taken: not every hop
    extra = [*GEMMA_STYLE, "train.seq_len=64"]
    want = _gemma_style_reference()
    got, r = run({"context": 4, "data": 2}, extra + LAYER_FORMS[form], init=want.init, along=want)
    assert_parity(got, want)
    assert r["collectives"]["collective-permute"]["count"] > 0
