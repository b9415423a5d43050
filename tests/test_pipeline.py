"""Pipeline parallelism: schedules, bubble, equality with the single-device model, memory.

Toy model: L layers of h = h + tanh(h @ w1) @ w2 on [batch, d] activations, head
loss = sum((tanh(h @ w) - y)^2) / batch. The pipelined loss and gradients (stack, head, inputs)
must equal jax.value_and_grad of the plain model.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpar.parallel.pipeline import (
    merge_microbatches,
    pipeline_value_and_grad,
    split_microbatches,
    stack_stages,
    unstack_stages,
)
from jaxpar.parallel.schedule import (
    bubble_fraction,
    build_schedule,
    describe_schedule,
    format_schedule,
    lower_schedule,
    schedule_for_mesh,
    schedule_time,
    stash_limit,
    textbook_bubble,
    validate_pipeline,
)

AXES = ("pipe", "data", "fsdp", "expert", "context", "tensor")
LAYERS, WIDTH, HIDDEN, MICROBATCH, OUT = 16, 8, 16, 4, 3


def layer(h, w):
    return h + jnp.tanh(h @ w["w1"]) @ w["w2"], None


def stage_fn(chunk_params, h):  # chunk_params leaves: [layers_per_chunk, ...]
    return jax.lax.scan(layer, h, chunk_params)[0]


def head_loss(head_params, h, y, batch):
    return jnp.sum((jnp.tanh(h @ head_params["w"]) - y) ** 2) / batch


def model_loss(layer_params, head_params, x, y):
    return head_loss(head_params, stage_fn(layer_params, x), y, x.shape[0])


def toy_problem(batch, layers=LAYERS, width=WIDTH, hidden=HIDDEN, seed=0):
    k = jax.random.split(jax.random.key(seed), 5)
    layer_params = {
        "w1": jax.random.normal(k[0], (layers, width, hidden)) / np.sqrt(width),
        "w2": jax.random.normal(k[1], (layers, hidden, width)) / np.sqrt(hidden),
    }
    head_params = {"w": jax.random.normal(k[2], (width, OUT)) / np.sqrt(width)}
    x = jax.random.normal(k[3], (batch, width))
    y = jax.random.normal(k[4], (batch, OUT))
    return layer_params, head_params, x, y


def make_mesh(shape, axis_type=AxisType.Auto):
    devices = jax.devices()[: int(np.prod(shape))]
    return jax.make_mesh(shape, AXES, axis_types=(axis_type,) * len(AXES), devices=devices)


def pipelined(schedule, mesh, batch):
    """Jitted pipeline loss and grads, from the plain model's [layers, ...] params, [batch, d] x."""
    p, m, v = schedule.stages, schedule.microbatches, schedule.virtual_stages

    @jax.jit
    def run(layer_params, head_params, x, y):
        return pipeline_value_and_grad(
            stage_fn,
            functools.partial(head_loss, batch=batch),
            stack_stages(layer_params, p, v),
            head_params,
            split_microbatches(x, m),
            split_microbatches(y, m),
            schedule=schedule,
            mesh=mesh,
        )

    return run


def single_device(schedule, args):
    """The plain model's loss and grads, laid out like the pipeline's outputs."""
    loss, (layer_grads, head_grads, x_grads) = jax.jit(jax.value_and_grad(model_loss, argnums=(0, 1, 2)))(
        *jax.device_get(args)
    )
    p, m, v = schedule.stages, schedule.microbatches, schedule.virtual_stages
    return loss, (stack_stages(layer_grads, p, v), head_grads, split_microbatches(x_grads, m))


def assert_close(actual, expected, rtol=1e-5):
    def check(path, a, b):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        err = np.linalg.norm(a - b) / np.linalg.norm(b)
        assert err <= rtol, f"{jax.tree_util.keystr(path)}: relative error {err:.2e} > {rtol}"

    jax.tree_util.tree_map_with_path(check, actual, expected)


def assert_matches_single_device(schedule, mesh, args):
    actual = pipelined(schedule, mesh, args[2].shape[0])(*args)
    assert float(actual[0]) > 0.1
    assert_close(jax.device_get(actual), single_device(schedule, args))


# Every pipe size with every schedule; microbatches below, at and above the stage count.
CASES = [
    ("gpipe", 2, 3, 1),
    ("1f1b", 2, 5, 1),
    ("interleaved", 2, 4, 2),
    ("gpipe", 4, 6, 1),
    ("1f1b", 4, 3, 1),
    ("interleaved", 4, 4, 2),
    ("gpipe", 8, 2, 1),
    ("1f1b", 8, 9, 1),
    ("interleaved", 8, 8, 2),
    ("zb", 2, 5, 1),
    ("zb", 4, 3, 1),
    ("zb", 8, 9, 1),
]


@pytest.mark.parametrize("kind,stages,microbatches,virtual_stages", CASES)
def test_pipeline_matches_single_device(kind, stages, microbatches, virtual_stages):
    schedule = build_schedule(kind, stages, microbatches, virtual_stages)
    mesh = make_mesh((stages, 1, 1, 1, 1, 1))
    assert_matches_single_device(schedule, mesh, toy_problem(microbatches * MICROBATCH))


@pytest.mark.parametrize("kind,virtual_stages", [("1f1b", 1), ("interleaved", 2)])
def test_pipeline_with_data_and_tensor_axes_matches_single_device(kind, virtual_stages):
    mesh = make_mesh((2, 2, 1, 1, 1, 2))  # pipe=2 data=2 tensor=2, GSPMD (auto) outside 'pipe'
    microbatches = 4
    layer_params, head_params, x, y = toy_problem(microbatches * MICROBATCH)
    put = lambda a, *spec: jax.device_put(a, NamedSharding(mesh, P(*spec)))
    args = (
        {
            "w1": put(layer_params["w1"], None, None, "tensor"),
            "w2": put(layer_params["w2"], None, "tensor", None),
        },
        head_params,
        put(x, ("data", "fsdp")),
        put(y, ("data", "fsdp")),
    )
    schedule = build_schedule(kind, 2, microbatches, virtual_stages)
    assert_matches_single_device(schedule, mesh, args)


def test_pipeline_on_explicit_mesh_matches_single_device():
    mesh = make_mesh((2, 2, 2, 1, 1, 1), AxisType.Explicit)  # jax.make_mesh's default axis type
    layer_params, head_params, x, y = toy_problem(4 * MICROBATCH)
    put = lambda a: jax.device_put(a, NamedSharding(mesh, P(("data", "fsdp"))))
    args = (layer_params, head_params, put(x), put(y))
    assert_matches_single_device(build_schedule("gpipe", 2, 4), mesh, args)


def test_layouts_round_trip():
    layers = {"w": jnp.arange(16 * 3.0).reshape(16, 3)}
    stacked = stack_stages(layers, stages=4, virtual_stages=2)  # [8, 2, 3]
    assert stacked["w"].shape == (8, 2, 3)
    assert float(stacked["w"][1, 0, 0]) == 8 * 3  # device 0, virtual chunk 1 = model chunk 4
    np.testing.assert_array_equal(unstack_stages(stacked, 4, 2)["w"], layers["w"])
    x = jnp.arange(12.0).reshape(6, 2)
    assert split_microbatches(x, 3).shape == (3, 2, 2)
    np.testing.assert_array_equal(merge_microbatches(split_microbatches(x, 3)), x)


# ----------------------------------------------------------------------------- errors


def test_layers_not_divisible_by_stages_times_virtual_stages():
    with pytest.raises(ValueError, match=r"layers=12 .* stages\*virtual_stages=4\*2=8"):
        stack_stages({"w": jnp.zeros((12, 2))}, stages=4, virtual_stages=2)
    with pytest.raises(ValueError, match="layers=6"):
        validate_pipeline("1f1b", 4, 8, layers=6)


def test_batch_not_divisible_into_microbatches():
    with pytest.raises(ValueError, match="batch=10 does not split into microbatches=4"):
        split_microbatches(jnp.zeros((10, 3)), 4)
    with pytest.raises(ValueError, match="batch=10"):
        validate_pipeline("gpipe", 2, 4, batch=10)


def test_schedule_arguments_are_checked():
    with pytest.raises(ValueError, match="microbatches=6 divisible by stages=4"):
        build_schedule("interleaved", 4, 6, 2)
    with pytest.raises(ValueError, match="virtual_stages >= 2"):
        build_schedule("interleaved", 4, 8, 1)
    with pytest.raises(ValueError, match="virtual_stages=2 needs 'interleaved'"):
        build_schedule("1f1b", 4, 8, 2)
    with pytest.raises(ValueError, match="virtual_stages=2 needs 'interleaved'"):
        build_schedule("zb", 4, 8, 2)
    with pytest.raises(ValueError, match="unknown"):
        build_schedule("zero-bubble", 4, 8)


def test_mesh_and_schedule_must_agree():
    layer_params, head_params, x, y = toy_problem(8)
    schedule, mesh = build_schedule("1f1b", 4, 4), make_mesh((2, 4, 1, 1, 1, 1))
    with pytest.raises(ValueError, match="mesh axis pipe=2 but schedule has stages=4"):
        pipeline_value_and_grad(
            stage_fn,
            functools.partial(head_loss, batch=8),
            stack_stages(layer_params, 4),
            head_params,
            split_microbatches(x, 4),
            split_microbatches(y, 4),
            schedule=schedule,
            mesh=mesh,
        )


# ----------------------------------------------------------------------------- schedules

# The cost-weighted idle fraction of the lowered program (F=1, B=2; zero-bubble B=1, W=1) is
# the textbook one, exactly, over a grid of stages, microbatches and chunks per stage.
GRID = [
    (kind, p, m, v)
    for p in (2, 3, 4, 8)
    for m in (1, 2, 3, 4, 5, 8, 16)
    for kind, v in [("gpipe", 1), ("1f1b", 1), ("zb", 1), ("interleaved", 2), ("interleaved", 3)]
    if kind != "interleaved" or m % p == 0
]


@pytest.mark.parametrize("kind,stages,microbatches,virtual_stages", GRID)
def test_cost_weighted_bubble_matches_theory(kind, stages, microbatches, virtual_stages):
    p, m, v = stages, microbatches, virtual_stages
    schedule = build_schedule(kind, p, m, v)
    bubble = bubble_fraction(schedule)
    if kind == "zb":
        # Uniform control flow (build_schedule's default): weight gradients fill the bubble
        # entirely, (p-1)(F+B)/(m(F+B+W) + (p-1)(F+B)), below 1F1B's (p-1)(F+B+W)/... and above
        # the paper's ZB-H1 (p-1)(F+B-W)/..., which needs a stage to run W while another runs F
        # or B: the stage-dependent table (test_stage_dependent_zb_reaches_the_zb_h1_bubble).
        assert bubble == pytest.approx(2 * (p - 1) / (3 * m + 2 * (p - 1)), abs=1e-12)
        paper = textbook_bubble("zb", p, m)
        assert paper == pytest.approx((p - 1) * (1 + 1 - 1) / (m * 3 + (p - 1) * (1 + 1 - 1)))
        assert p == 1 or paper < bubble < textbook_bubble("1f1b", p, m)
    else:
        assert bubble == pytest.approx((p - 1) / (v * m + p - 1), abs=1e-12)
    # The bubble comes from the ticks the runtime scans: a tick lasts its running slots' costs.
    lowered = lower_schedule(schedule)
    costs = [{"F": 1, "B": 1 if kind == "zb" else 2, "W": 1}[phase] for phase in schedule.slots]
    assert schedule_time(schedule) == int(np.sum(lowered.running * np.array(costs)))


def test_issue_17_table():
    """The idle fractions the issue's audit measured for one action per tick, now the textbook's."""
    assert bubble_fraction(build_schedule("1f1b", 4, 8)) == pytest.approx(3 / 11)  # was 0.400
    assert bubble_fraction(build_schedule("1f1b", 4, 16)) == pytest.approx(3 / 19)  # was 0.333
    assert bubble_fraction(build_schedule("interleaved", 4, 8, 2)) == pytest.approx(3 / 19)  # 0.294
    assert bubble_fraction(build_schedule("gpipe", 4, 8)) == pytest.approx(3 / 11)


@pytest.mark.parametrize("kind,virtual_stages", [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zb", 1)])
def test_schedule_runs_every_action_once_in_dependency_order(kind, virtual_stages):
    p, m, v = 4, 8, virtual_stages
    schedule = build_schedule(kind, p, m, v)
    when = {}  # (phase, microbatch, model chunk) -> (tick, slot)
    for t, tick in enumerate(schedule.ticks):
        for k, row in enumerate(tick):
            for s, a in enumerate(row):
                if a is not None:
                    assert a.phase == schedule.slots[k]
                    key = (a.phase, a.microbatch, a.chunk * p + s)
                    assert key not in when
                    when[key] = (t, k)
    assert len(when) == len(schedule.slots) * m * p * v
    for (phase, i, c), (t, k) in when.items():
        if phase == "F" and c > 0:
            assert when["F", i, c - 1][0] < t  # the activation arrives with the exchange
        if phase == "B":
            assert when["F", i, c] < (t, k)  # its own forward: an earlier slot, maybe this tick
            assert c == p * v - 1 or when["B", i, c + 1][0] < t  # the gradient arrives
        if phase == "W":
            assert when["B", i, c] < (t, k)


def test_every_tick_runs_one_forward_and_one_backward_in_steady_state():
    schedule = build_schedule("1f1b", 4, 16)
    steady = schedule.ticks[2 * 4 - 2 : 16]  # after stage 0's first backward, before its last forward
    assert steady and all(f is not None and b is not None for tick in steady for f, b in zip(*tick))


@pytest.mark.parametrize("microbatches", [4, 16])
def test_1f1b_stash_does_not_grow_with_microbatches(microbatches):
    # A hand-off takes a tick, so a microbatch is back at stage 0 2p-2 ticks after it left: the
    # textbook bubble needs 2p-1 stashes there (stash_limit), for any m.
    p = 4
    assert stash_limit("1f1b", p) == 2 * p - 1
    assert lower_schedule(build_schedule("1f1b", p, microbatches)).stash_slots == min(microbatches, 2 * p - 1)
    assert lower_schedule(build_schedule("zb", p, microbatches)).stash_slots == min(microbatches, 2 * p - 1)
    assert lower_schedule(build_schedule("gpipe", p, microbatches)).stash_slots == microbatches


def test_format_schedule():
    text = format_schedule(build_schedule("1f1b", 2, 3))
    lines = text.splitlines()
    # One column per unit of time: a backward is its label and '==' (cost 2); '|' = exchange.
    assert lines[0].split() == [
        "stage",
        "0",
        "|",
        "F0",
        "|",
        "F1",
        ".",
        ".",
        "|",
        "F2",
        "B0",
        "==",
        "|",
        ".",
        "B1",
        "==",
        "|",
        "B2",
        "==",
        "|",
    ]
    assert lines[1].split() == [
        "stage",
        "1",
        "|",
        ".",
        "|",
        "F0",
        "B0",
        "==",
        "|",
        "F1",
        "B1",
        "==",
        "|",
        "F2",
        "B2",
        "==",
        "|",
        ".",
        ".",
        "|",
    ]
    assert lines[2].startswith("bubble 0.2500")  # (p-1)/(m+p-1)
    assert "F0.1" in format_schedule(build_schedule("interleaved", 2, 2, 2))
    assert "W0" in format_schedule(build_schedule("zb", 2, 2))
    described = describe_schedule(build_schedule("interleaved", 4, 8, 2))
    assert described["bubble"] == pytest.approx(3 / 19) and described["timeline"][0].startswith("stage 0")


# ----------------------------------------------------------------------------- memory


@pytest.fixture(scope="module")
def temp_bytes():
    """Compiled temporaries for gpipe / 1f1b / zb at m=4 and m=16, microbatch held fixed.

    Activations ([256, 16], hidden [256, 64]) dwarf the parameters (4 layers of 16x64), so the
    stashed vjp residuals are what grows with m. Compile only; nothing runs.
    """
    p, layers, microbatch, width, hidden = 2, 4, 256, 16, 64
    mesh = make_mesh((p, 1, 1, 1, 1, 1))
    f32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)
    stage_params = {"w1": f32(p, layers // p, width, hidden), "w2": f32(p, layers // p, hidden, width)}
    sizes = {}
    for kind in ("gpipe", "1f1b", "zb"):
        for m in (4, 16):
            schedule = build_schedule(kind, p, m)
            head_fn = functools.partial(head_loss, batch=m * microbatch)
            run = jax.jit(
                functools.partial(pipeline_value_and_grad, stage_fn, head_fn, schedule=schedule, mesh=mesh)
            )
            compiled = run.lower(
                stage_params, {"w": f32(width, OUT)}, f32(m, microbatch, width), f32(m, microbatch, OUT)
            ).compile()
            sizes[kind, m] = compiled.memory_analysis().temp_size_in_bytes
    return sizes


@pytest.mark.parametrize("kind", ["1f1b", "zb"])
def test_memory_flat_in_microbatches(kind, temp_bytes):
    # p=2: at most 2p-1 = 3 stashes, so m=4 and m=16 hold the same (the inputs and their
    # gradients, [m, microbatch, width], grow with m but are arguments and outputs, not temps).
    assert temp_bytes[kind, 16] <= 1.1 * temp_bytes[kind, 4], temp_bytes
    assert temp_bytes["zb", 16] <= 1.25 * temp_bytes["1f1b", 16], temp_bytes  # 1F1B's memory


def test_gpipe_memory_grows_with_microbatches(temp_bytes):
    assert temp_bytes["gpipe", 16] >= 2.5 * temp_bytes["gpipe", 4], temp_bytes
    assert temp_bytes["1f1b", 16] < temp_bytes["gpipe", 16] / 3, temp_bytes


# ----------------------------------------------------------------------------- zero-bubble, ZB-H1

# Stage-dependent control flow (a collective-free chunk): one action per stage per tick.
ZB_H1_GRID = [(p, m) for p in (2, 3, 4) for m in sorted({p, 2 * p, 4 * p, 2 * p + 1, 3 * p - 1})]


def _zb_h1_record(schedule):
    """{(phase, microbatch, stage): tick} and the per-stage peak of stashes held (F run, W not)."""
    p = schedule.stages
    when, held, peak = {}, [0] * p, [0] * p
    for t, tick in enumerate(schedule.ticks):
        for s in range(p):
            mine = [(k, row[s]) for k, row in enumerate(tick) if row[s] is not None]
            assert len(mine) <= 1, f"stage {s} runs {len(mine)} actions in tick {t}"
            for k, a in mine:
                assert a.phase == schedule.slots[k] and a.chunk == 0
                assert (a.phase, a.microbatch, s) not in when
                when[a.phase, a.microbatch, s] = t
                held[s] += {"F": 1, "B": 0, "W": -1}[a.phase]
                peak[s] = max(peak[s], held[s])
    return when, peak


@pytest.mark.parametrize("stages,microbatches", ZB_H1_GRID)
def test_stage_dependent_zb_reaches_the_zb_h1_bubble(stages, microbatches):
    p, m = stages, microbatches
    schedule = build_schedule("zb", p, m, stage_dependent=True)
    assert schedule.stage_dependent
    # The lowered table's bubble, F = B = W = 1 and a tick one unit: the paper's ZB-H1, exactly.
    assert bubble_fraction(schedule) == pytest.approx((p - 1) / (3 * m + p - 1), abs=1e-12)
    assert bubble_fraction(schedule) == pytest.approx(textbook_bubble("zb", p, m), abs=1e-12)
    assert schedule_time(schedule) == len(schedule.ticks) == 3 * m + p - 1
    assert bubble_fraction(schedule) < bubble_fraction(build_schedule("zb", p, m))  # uniform's
    when, peak = _zb_h1_record(schedule)
    assert len(when) == 3 * m * p
    for (phase, i, s), t in when.items():  # the exchange between ticks carries every input
        if phase == "F" and s > 0:
            assert when["F", i, s - 1] < t
        if phase == "B":
            assert when["F", i, s] < t and (s == p - 1 or when["B", i, s + 1] < t)
        if phase == "W":
            assert when["B", i, s] < t
    # Activation memory: no stage holds more than 1F1B's stage 0 (p microbatches), and the
    # lowered buffers are no larger than the uniform 1F1B's.
    assert max(peak) <= p and peak[0] == min(p, m)
    one_f_one_b = lower_schedule(build_schedule("1f1b", p, m)).stash_slots
    assert lower_schedule(schedule).stash_slots <= one_f_one_b


def test_stage_dependent_zb_picture_and_description():
    schedule = build_schedule("zb", 2, 4, stage_dependent=True)
    lines = format_schedule(schedule).splitlines()
    # One column per tick (each stage its own action), the exchange after every column.
    assert lines[0].split() == [
        "stage",
        "0",
        "|",
        "F0",
        "F1",
        ".",
        "B0",
        "W0",
        "F2",
        "B1",
        "W1",
        "F3",
        "B2",
        "W2",
        "B3",
        "W3",
    ]
    assert lines[1].split() == [
        "stage",
        "1",
        "|",
        ".",
        "F0",
        "B0",
        "F1",
        "B1",
        "W0",
        "F2",
        "B2",
        "W1",
        "F3",
        "B3",
        "W2",
        "W3",
    ]
    assert lines[2].startswith("bubble 0.0769") and "stage-dependent control flow" in lines[2]
    described = describe_schedule(schedule)
    assert described["control_flow"] == "stage-dependent" and described["ticks"] == 13
    assert described["bubble"] == pytest.approx(1 / 13) == described["textbook_bubble"]
    assert describe_schedule(build_schedule("zb", 2, 4))["control_flow"] == "uniform"
    with pytest.raises(ValueError, match="'zb' only"):
        build_schedule("1f1b", 2, 4, stage_dependent=True)


def test_schedule_for_mesh_picks_stage_dependent_zb_only_for_a_collective_free_chunk():
    base = {"pipe": 4, "data": 1, "fsdp": 1, "expert": 1, "context": 1, "tensor": 1}
    zb = build_schedule("zb", 4, 8)
    for sizes in ({}, {"data": 2}):
        assert schedule_for_mesh(zb, {**base, **sizes}).stage_dependent
    for axis in ("fsdp", "tensor", "context", "expert"):  # collectives inside the chunk
        assert not schedule_for_mesh(zb, {**base, "data": 2, axis: 2}).stage_dependent
    # fsdp below ZeRO-2 is a row axis (parameters and gradients whole on it): collective-free.
    assert schedule_for_mesh(zb, {**base, "data": 2, "fsdp": 2}, row_axes=("data", "fsdp")).stage_dependent
    # MoE and float8 couple a microbatch's rows (router losses, per-tensor scales): no row axes,
    # so with data > 1 they stay uniform.
    assert not schedule_for_mesh(zb, {**base, "data": 2}, row_axes=()).stage_dependent
    assert schedule_for_mesh(zb, base, row_axes=()).stage_dependent
    for kind, v in [("gpipe", 1), ("1f1b", 1), ("interleaved", 2)]:
        assert not schedule_for_mesh(build_schedule(kind, 4, 8, v), base).stage_dependent
    # The runtime refuses a stage-dependent table on a mesh whose chunk has collectives.
    layer_params, head_params, x, y = toy_problem(8)
    with pytest.raises(ValueError, match="collective-free"):
        pipeline_value_and_grad(
            stage_fn,
            functools.partial(head_loss, batch=8),
            stack_stages(layer_params, 2),
            head_params,
            split_microbatches(x, 2),
            split_microbatches(y, 2),
            schedule=build_schedule("zb", 2, 2, stage_dependent=True),
            mesh=make_mesh((2, 2, 2, 1, 1, 1)),
        )


def _collectives_in_branches(hlo_text):
    """(number of `conditional`s, their widest branch count, the collectives any branch reaches
    through calls, fusions and nested conditionals) in compiled HLO text."""
    import re

    from jaxpar.compiled.hlo import KINDS, parse

    comps = parse(hlo_text)
    called = re.compile(
        r"(?:body|calls|to_apply|condition|true_computation|false_computation)"
        r"=%([\w.\-]+)"
    )

    def branches(ins):
        return [
            name
            for group in re.findall(r"branch_computations=\{([^}]*)\}", ins.text)
            for name in re.findall(r"%([\w.\-]+)", group)
        ]

    found, seen = [], set()

    def visit(name):
        if name in seen or name not in comps:
            return
        seen.add(name)
        for ins in comps[name].instrs:
            if any(ins.op.startswith(kind) for kind in KINDS):
                found.append(f"{ins.op} in {name}")
            for callee in called.findall(ins.text) + branches(ins):
                visit(callee)

    conditionals = [ins for comp in comps.values() for ins in comp.instrs if ins.op == "conditional"]
    for ins in conditionals:
        for name in branches(ins) or called.findall(ins.text):
            visit(name)
    return len(conditionals), max((len(branches(ins)) for ins in conditionals), default=0), found


@pytest.mark.parametrize("stages,data,microbatches", [(2, 4, 4), (4, 2, 8)])
def test_stage_dependent_zb_matches_single_device_without_collectives_in_its_branches(
    stages, data, microbatches
):
    """pipe x data, every other axis 1: each stage switches on its own row; the gradients are
    the single device's, and no collective sits inside the switch (data's sums come after)."""
    mesh = make_mesh((stages, data, 1, 1, 1, 1))
    layer_params, head_params, x, y = toy_problem(microbatches * MICROBATCH, layers=8)
    put = lambda a: jax.device_put(a, NamedSharding(mesh, P(("data", "fsdp"))))
    args = (layer_params, head_params, put(x), put(y))
    sizes = dict(zip(AXES, (stages, data, 1, 1, 1, 1)))
    schedule = schedule_for_mesh(build_schedule("zb", stages, microbatches), sizes)
    assert schedule.stage_dependent
    run = pipelined(schedule, mesh, x.shape[0])
    actual = run(*args)
    assert float(actual[0]) > 0.1
    assert_close(jax.device_get(actual), single_device(schedule, args))
    conditionals, widest, inside = _collectives_in_branches(run.lower(*args).compile().as_text())
    assert conditionals >= 1 and widest == 5, (conditionals, widest)  # idle, F, F+head, B, W
    assert not inside, inside


def test_stage_dependent_zb_on_explicit_mesh_matches_single_device():
    mesh = make_mesh((2, 4, 1, 1, 1, 1), AxisType.Explicit)  # data manual: rows laid out first
    layer_params, head_params, x, y = toy_problem(4 * MICROBATCH, layers=8)
    put = lambda a: jax.device_put(a, NamedSharding(mesh, P(("data", "fsdp"))))
    args = (layer_params, head_params, put(x), put(y))
    assert_matches_single_device(build_schedule("zb", 2, 4, stage_dependent=True), mesh, args)
