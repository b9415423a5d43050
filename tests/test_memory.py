"""ZeRO memory as XLA measures it, against the ZeRO formula (`jaxpar.inspect.zero_formula`).

Backend: XLA:CPU, 8 host devices, the train step compiled (never run) for fsdp=8 at each stage.
The numbers come from the compiled program's own memory analysis -- argument bytes (the train
state and the batch) and temporaries -- never from the shardings jaxpar declares, which would
agree with the formula by construction. (Gradients live among the temporaries; their ZeRO-2
saving is checked on the H100 program, tests/test_gpu_program.py: XLA:CPU reduce-scatters as an
all-reduce of the whole gradient and a slice, so its temporaries say little about it.)
"""

import numpy as np
import pytest

from jaxpar.inspect import compile_step, report
from tests.parity import trainer_on

FSDP = 8
MODEL = []  # configs/tiny.yaml as it is (d_model 32 splits over fsdp=8)


@pytest.fixture(scope="module")
def reports():
    """The inspect report (with --compare) of each ZeRO stage's compiled step."""
    out = {}
    for stage in (0, 1, 2, 3):
        trainer = trainer_on(MODEL + [f"parallel.zero_stage={stage}"], {"fsdp": FSDP})
        out[stage] = report(trainer, compile_step(trainer), compare=True)
    return out


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_state_arguments_match_the_formula(reports, stage):
    """Params + Adam state per device in XLA's argument buffers = the formula's, at each stage."""
    compare = reports[stage]["compare"]
    assert compare["ratio"] == pytest.approx(1.0, rel=0.01)


def test_each_stage_saves_what_the_formula_says(reports):
    """Differences between stages, from XLA's arguments: ZeRO-1 shards Adam's moments, ZeRO-3
    the parameters; ZeRO-2 keeps both as ZeRO-1 does."""
    psi = reports[0]["params"]
    state = {s: r["compare"]["measured"]["params_and_optimizer"] for s, r in reports.items()}
    shard_saving = 1 - 1 / FSDP
    assert state[0] - state[1] == pytest.approx(8 * psi * shard_saving, rel=0.01)
    assert state[1] == state[2]
    assert state[2] - state[3] == pytest.approx(4 * psi * shard_saving, rel=0.01)


def test_sgd_has_no_optimizer_state():
    """optimizer.name=sgd: the formula's optimizer term is 0 and XLA's arguments agree."""
    trainer = trainer_on(MODEL + ["parallel.zero_stage=1", "optimizer.name=sgd"], {"fsdp": FSDP})
    r = report(trainer, compile_step(trainer), compare=True)
    assert r["compare"]["predicted"]["optimizer"] == 0
    assert r["compare"]["ratio"] == pytest.approx(1.0, rel=0.01)
    assert np.isclose(r["compare"]["measured"]["params_and_optimizer"], 4 * r["params"], rtol=0.01)
