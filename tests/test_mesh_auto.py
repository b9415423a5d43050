"""`mesh: auto` (jaxpar.planning.auto, jaxpar.run.autolayout) and `python -m jaxpar.plan
--explain`: the settings, the pins, the compile check taking the next candidate when the first
does not fit once compiled, MoE's larger headroom, a resume keeping the recorded layout and
another device count planning again; and one run end to end on 8 emulated CPU devices (a pinned
tensor axis, its loss against one device's, the report in the first lines and in the run
directory, read back by a resume). The compile step of the unit tests is a stand-in returning
chosen bytes, so that they cost the planner's enumeration alone; the rest compile for real: a
small runtime.host_memory_gib refusing the first candidate once compiled, the MoE preset and a
pipeline trained for 2 steps on 8 devices each, and a launcher restart on another device count
(2 processes x 2 devices, then 1 x 2) that plans again and resumes."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import yaml

from jaxpar import checks as checks_lib
from jaxpar import config as config_lib
from jaxpar.config import MESH_AXES
from jaxpar.planning import auto
from jaxpar.planning import plan as plan_cli
from jaxpar.planning.memory import GIB

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "configs", "tiny.yaml")
MOE = os.path.join(ROOT, "configs", "moe-tiny.yaml")


def _settings(overrides, path=TINY):
    return config_lib.user_settings(path, overrides)


def _here(usable=1 * GIB, n=8):
    spec = auto.DeviceSpec("cpu", "cpu", "emulated CPU device", auto.CPU_FLOPS, None, 20e9, 10e9, 10e9)
    return auto.Here(spec, "cpu", n, 8, usable, f"{n} test devices")


def _predicted(plan):  # a stand-in compile: the prediction, exactly
    return int(plan.memory["total"])


def _choose(overrides, path=TINY, k=2, compile_fn=_predicted, usable=1 * GIB):
    settings = _settings(overrides, path)
    cfg = config_lib.build_config(settings)
    axes, pinned = auto.pins(settings, config_lib.auto_axes(settings)[1], cfg)
    return auto.choose(cfg, _here(usable), axes, pinned, k, compile_fn)


def test_auto_in_a_file_or_on_the_command_line_leaves_the_unset_axes_to_the_planner(tmp_path):
    # A bug this catches: `mesh=auto mesh.tensor=2` refused ("'mesh' is a value"), or a file's
    # `mesh: auto` lost under a mesh.<axis> override (the override's mapping replacing it).
    for overrides in (["mesh=auto", "mesh.tensor=2"], ["mesh.data=auto", "mesh.tensor=2"]):
        settings = _settings(overrides)
        _, axes = config_lib.auto_axes(settings)
        assert axes == [a for a in MESH_AXES if a != "tensor"], overrides
        cfg = config_lib.build_config(settings)  # placeholders that validate: data takes the rest
        assert auto.pins(settings, axes, cfg)[0] == {"tensor": 2}
        assert checks_lib.resolve_mesh(cfg.mesh, 8) == dict.fromkeys(MESH_AXES, 1) | {"data": 4, "tensor": 2}
    path = tmp_path / "auto.yaml"
    path.write_text(yaml.safe_dump({**yaml.safe_load(open(TINY)), "mesh": "auto"}))
    settings = _settings(["mesh.pipe=2", "parallel.remat=full"], str(path))
    axes = config_lib.auto_axes(settings)[1]
    assert axes == [a for a in MESH_AXES if a != "pipe"]
    pinned = auto.pins(settings, axes, config_lib.build_config(settings))
    assert pinned == ({"pipe": 2}, {"zero_stage": 0, "remat": "full"})
    assert config_lib.auto_axes(_settings(["mesh.data=8"]))[1] == []


def test_pinned_axes_and_settings_are_kept_in_every_candidate():
    # A bug this catches: the pins read but not applied (`_keeps`), so the fastest layout wins.
    choice = _choose(["mesh=auto", "mesh.tensor=2", "parallel.remat=full"], k=3)
    assert len(choice.candidates) == 3 and choice.chosen is choice.candidates[0]
    for c in choice.candidates:
        assert c.plan.sizes["tensor"] == 2 and c.plan.cfg.parallel.remat == "full"
    assert any("do not keep the pinned mesh.tensor=2" in line for line in choice.skipped)
    piped = _choose(["mesh=auto", "mesh.pipe=2"], k=1).chosen.plan  # the pipeline preset's way
    assert piped.sizes["pipe"] == 2 and checks_lib.validate(piped.cfg, 8)["pipe"] == 2


def test_a_candidate_over_the_memory_once_compiled_gives_way_to_the_next():
    # A bug this catches: the first candidate taken on its prediction, the compile check unread.
    first = []

    def compile_fn(plan):  # the first compiles to 3x its prediction, past the headroom
        first.append(plan)
        return int(plan.memory["total"] * (3 if len(first) == 1 else 1))

    usable = 2.5 * _choose(["mesh=auto"], k=1).candidates[0].plan.memory["total"]
    choice = _choose(["mesh=auto"], k=3, compile_fn=compile_fn, usable=usable)
    assert choice.chosen is choice.candidates[1] and choice.candidates[0].refused
    lines = auto.report_lines(choice)
    assert lines[1].startswith("  refused #1:") and "over the" in lines[1] and "-67%" in lines[1]
    assert lines[2].startswith("  chosen #2:") and "predicted" in lines[2] and "why:" in lines[3]
    assert lines[4].startswith("  runner-up #3:")
    record = auto.to_json(choice)
    assert [c["chosen"] for c in record["candidates"]] == [False, True, False]
    assert record["candidates"][0]["compiled_memory_per_device"] == first[0].memory["total"] * 3 // 1


def test_moe_leaves_more_headroom_than_a_dense_model():
    # A bug this catches: one headroom for both (MoE's uneven routing needs more).
    def at(share):
        return lambda plan: int(share * GIB)

    assert _choose(["mesh=auto"], k=1, compile_fn=at(0.9)).chosen is not None
    small = ["mesh=auto", "train.batch_size=8", "train.seq_len=32", "model.n_layers=2"]
    moe = _choose(small, MOE, k=1, compile_fn=at(0.9))
    assert moe.chosen is None and "80% of 1" in moe.candidates[0].refused


def test_a_resume_keeps_the_recorded_layout_and_another_device_count_plans_again(tmp_path):
    # Bugs this catches: a resume planning again (its layout could move under the checkpoint
    # on a slower or busier start), and a record kept for a device count it was not made for.
    settings = _settings(["mesh=auto", f"train.run_dir={tmp_path}"])
    axes = config_lib.auto_axes(settings)[1]
    cfg = config_lib.build_config(settings)
    kept = {"pipe": 2, "data": 2, "fsdp": 1, "expert": 1, "context": 1, "tensor": 2}
    parallel = dict(zip(auto.CHOSEN_SETTINGS, (0, "dots", 1, True, "gpipe", 4, 1)))
    entry = {"mesh": kept, "parallel": parallel, "layout": "pipe=2 data=2 tensor=2", "chosen": True}
    (tmp_path / auto.LAYOUT_FILE).write_text(json.dumps({"devices": 8, "candidates": [entry]}))
    resumed, choice, lines = auto.resolve(cfg, settings, axes, 8, _predicted)
    assert choice is None and "resuming with the layout" in lines[0]
    assert checks_lib.validate(resumed, 8) == kept and resumed.parallel.pipeline_schedule == "gpipe"
    replanned, choice, lines = auto.resolve(cfg, settings, axes, 4, _predicted)
    assert "planned for 8 devices and now has 4: planned again" in lines[1]
    assert checks_lib.resolve_mesh(replanned.mesh, 4) == choice.chosen.plan.sizes
    fresh = config_lib.build_config(
        _settings(["mesh=auto", f"train.run_dir={tmp_path}", "train.resume=never"])
    )
    assert auto.resolve(fresh, settings, axes, 8, _predicted)[1] is not None  # never: no record read


def test_plan_explain_prints_the_choice_the_runners_up_and_the_uncertainty(capsys):
    # A bug this catches: --explain refused as an unknown flag, or printing the JSON unexplained.
    assert plan_cli.main([TINY, "--gpus", "8xh100", "--explain"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("plan: 8 x NVIDIA H100") and "layouts considered" in out[0]
    assert out[1].startswith("  chosen #1:") and "MFU" in out[1] and out[2].startswith("    why:")
    assert sum(line.startswith("  runner-up #") for line in out) == 2
    assert out[-1].startswith("  uncertainty:") and "x1.55" in out[-1]


# --- End to end: a real start on 8 emulated CPU devices --------------------------------------


def _train(run_dir, *args, path=TINY):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    return subprocess.Popen(
        [sys.executable, "-m", "jaxpar.train", path, "train.steps=2", f"train.run_dir={run_dir}", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env=env,
    )


def _losses(run_dir):
    return [json.loads(line)["loss"] for line in open(os.path.join(run_dir, "metrics.jsonl"))]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("auto")
    planned, single = str(base / "planned"), str(base / "single")
    procs = [
        _train(planned, "mesh=auto", "mesh.tensor=2", "runtime.auto_candidates=1"),
        _train(single, "runtime.cpu_devices=1", "mesh.data=1", "mesh.fsdp=1", "mesh.tensor=1"),
    ]
    outs = [p.communicate(timeout=600) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
    return planned, single, outs[0][1]


def test_a_planned_run_keeps_the_pin_matches_one_device_and_says_why(runs):
    # Bugs this catches: the pinned tensor axis dropped, a layout whose loss departs from one
    # device's, the choice missing from the output's first lines or from the run directory.
    planned, single, err = runs
    assert err.splitlines()[0].startswith("mesh: auto: 8 emulated CPU device(s)"), err[:2000]
    assert err.splitlines()[1].startswith("  chosen #1:") and "tensor=2" in err.splitlines()[1]
    saved = yaml.safe_load(open(os.path.join(planned, "config.yaml")))
    record = json.load(open(os.path.join(planned, auto.LAYOUT_FILE)))
    (chosen,) = [c for c in record["candidates"] if c["chosen"]]
    assert saved["mesh"] == chosen["mesh"] and saved["mesh"]["tensor"] == 2
    assert all(saved["parallel"][k] == v for k, v in chosen["parallel"].items())
    assert record["report"][0] == err.splitlines()[0] and chosen["compiled_memory_per_device"] > 0
    assert _losses(planned)[:2] == pytest.approx(_losses(single), rel=1e-5)


def test_a_resume_of_the_planned_run_reads_its_record(runs):
    # A bug this catches: layout.json written in a form the resume does not read back, so that
    # every resume plans again (in-process, with the stand-in compile: a resume compiles nothing).
    planned, _, _ = runs
    settings = _settings(["mesh=auto", "mesh.tensor=2", f"train.run_dir={planned}"])
    cfg = config_lib.build_config(settings)
    resumed, choice, lines = auto.resolve(cfg, settings, config_lib.auto_axes(settings)[1], 8, _predicted)
    saved = yaml.safe_load(open(os.path.join(planned, "config.yaml")))
    assert choice is None and "resuming with the layout" in lines[0]
    assert checks_lib.validate(resumed, 8) == saved["mesh"]


def test_a_first_step_out_of_memory_names_the_wrong_prediction_and_the_next_candidate():
    # Bugs this catches: the message for every error (or none), or naming a candidate that was
    # itself over the memory once compiled as the next one.
    from jaxpar.run import autolayout

    sizes = iter([3, 1, 3, 1])  # #1 over once compiled, #2 chosen, #3 over, #4 fits

    def compile_fn(plan):
        return int(plan.memory["total"] * next(sizes))

    usable = 2.5 * _choose(["mesh=auto"], k=1).candidates[0].plan.memory["total"]
    choice = _choose(["mesh=auto"], k=4, compile_fn=compile_fn, usable=usable)
    autolayout._CHOSEN.update(choice=choice)
    try:
        assert autolayout.out_of_memory(ValueError("a shape mismatch")) is None
        line = autolayout.out_of_memory(RuntimeError("RESOURCE_EXHAUSTED: Out of memory allocating"))
    finally:
        autolayout._CHOSEN.clear()
    assert choice.chosen is choice.candidates[1]
    assert "ran out of memory: predicted" in line and "+0% off" in line
    assert line.endswith(")") and auto.layout_text(choice.candidates[3].plan) in line


# --- The compile check for real: the planner's first choice over the memory once compiled ------


def test_a_small_host_memory_refuses_the_first_candidate_once_compiled_and_takes_the_second():
    # A bug this catches: the compiled size ignored (the fastest taken on its prediction alone),
    # or compiled_total reading the wrong fields of XLA's analysis (arguments only, say). With
    # runtime.host_memory_gib=1.4084 an emulated device may take ((1.4084 - 1.4) GiB / 1.08) / 8
    # = 1.04 MB; 95% of it is 0.99 MB. The tiny model's fastest layout (data=8) is predicted
    # 0.87 MB and compiles to 1.02 MB (XLA:CPU, this jax), over; the second (context=8) compiles
    # to 0.96 MB, under. Both are predicted to fit, so only the compile check tells them apart.
    settings = _settings(["mesh=auto", "runtime.host_memory_gib=1.4084"])
    cfg = config_lib.build_config(settings)
    axes, pinned = auto.pins(settings, config_lib.auto_axes(settings)[1], cfg)
    choice = auto.choose(cfg, auto.here(cfg, 8), axes, pinned, 2)  # the real compile
    first, second = choice.candidates
    assert first.plan.memory["total"] < first.plan._usable and first.plan.fits
    assert first.refused and "over the" in first.refused and first.compiled > 0.95 * choice.here.usable
    assert choice.chosen is second and 0 < second.compiled <= 0.95 * choice.here.usable
    assert first.plan.time["step_time_s"] <= second.plan.time["step_time_s"]


# --- The presets end to end: MoE and a pipeline, planned, compiled and trained ---------------

PRESET_SMALL = ["train.batch_size=8", "train.seq_len=32", "data.max_documents=30", "train.log_every=1"]


@pytest.fixture(scope="module")
def presets(tmp_path_factory):
    """2 steps each of configs/moe-tiny.yaml and of a 4-layer tiny model with a pinned mesh.pipe=2,
    both with mesh=auto for the rest, side by side on 8 emulated CPU devices each."""
    base = tmp_path_factory.mktemp("presets")
    moe, pipe = str(base / "moe"), str(base / "pipe")
    procs = [
        # In its own bfloat16 (tests/test_moe_bf16.py: this used to abort XLA:CPU's compile).
        _train(
            moe,
            "mesh=auto",
            "runtime.cpu_devices=8",
            "runtime.auto_candidates=1",
            *PRESET_SMALL,
            path=MOE,
        ),
        _train(
            pipe,
            "mesh=auto",
            "runtime.cpu_devices=8",
            "mesh.pipe=2",
            "model.n_layers=4",
            "runtime.auto_candidates=1",
        ),
    ]
    outs = [p.communicate(timeout=600) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
    return {"moe": (moe, outs[0][1]), "pipe": (pipe, outs[1][1])}


def _planned(run_dir, err):
    """(config.yaml, the chosen entry of layout.json, layout.json), after checking that the run
    printed its choice first and that config.yaml holds the chosen mesh and settings."""
    lines = err.splitlines()
    assert lines[0].startswith("mesh: auto: 8 emulated CPU device(s)") and "1 compiled here" in lines[0], err[
        :2000
    ]
    assert lines[1].startswith("  chosen #1:"), err[:2000]
    saved = yaml.safe_load(open(os.path.join(run_dir, "config.yaml")))
    record = json.load(open(os.path.join(run_dir, auto.LAYOUT_FILE)))
    (chosen,) = [c for c in record["candidates"] if c["chosen"]]
    assert saved["mesh"] == chosen["mesh"] and chosen["compiled_memory_per_device"] > 0
    assert all(saved["parallel"][k] == v for k, v in chosen["parallel"].items())
    losses = _losses(run_dir)
    assert len(losses) == 2 and all(0 < x < 10 for x in losses)
    return saved, chosen, record


def test_mesh_auto_plans_compiles_and_trains_the_moe_preset(presets):
    # Bugs this catches: MoE planned with the dense headroom, or the planned layout not the one
    # that trains (config.yaml's mesh apart from layout.json's choice).
    saved, chosen, record = _planned(*presets["moe"])
    assert record["headroom"] == auto.HEADROOM["moe"]
    assert saved["model"]["moe"]["num_experts"] == 8


def test_mesh_auto_plans_compiles_and_trains_a_pipeline_with_a_pinned_pipe_axis(presets):
    # Bugs this catches: the pinned pipe axis lost, or the pipeline settings the planner chose
    # (schedule, microbatches) not applied to the run that trains.
    saved, chosen, _ = _planned(*presets["pipe"])
    assert saved["mesh"]["pipe"] == 2 and saved["model"]["n_layers"] == 4
    assert saved["parallel"]["microbatches"] == chosen["parallel"]["microbatches"] >= 2


# --- A restart with another device count, through the launcher --------------------------------


def _launch(nproc, devices, run_dir, *args):
    command = [sys.executable, "-m", "jaxpar.launch", "--nproc", str(nproc), "--grace", "30", TINY]
    command += ["mesh=auto", "runtime.auto_candidates=1", f"runtime.cpu_devices={devices}"]
    command += [f"train.run_dir={run_dir}", *args]
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    proc = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stderr


def test_a_restart_on_another_device_count_plans_again_and_resumes(tmp_path):
    # Bugs this catches: a restart keeping the recorded layout made for another device count
    # (`keeps` not comparing the count), the new choice not written to layout.json, or the
    # re-planned start training from scratch instead of resuming the checkpoint.
    # 2 processes x 2 devices, each compiling one candidate (runtime.auto_candidates=1), so that
    # neither waits long for the other at the broadcast or the first step (Gloo waits 30 s).
    _launch(2, 2, tmp_path, "train.steps=2")
    first = json.load(open(tmp_path / auto.LAYOUT_FILE))
    assert first["devices"] == 4
    err = _launch(1, 2, tmp_path, "train.steps=3")
    assert "this run was planned for 4 devices and now has 2: planned again" in err, err[-3000:]
    assert "resumed from step 2" in err, err[-3000:]
    record = json.load(open(tmp_path / auto.LAYOUT_FILE))
    (chosen,) = [c for c in record["candidates"] if c["chosen"]]
    assert record["devices"] == 2 and "planned again" in record["note"]
    saved = yaml.safe_load(open(tmp_path / "config.yaml"))
    assert saved["mesh"] == chosen["mesh"] and math.prod(saved["mesh"].values()) == 2
    steps = [json.loads(line)["step"] for line in open(tmp_path / "metrics.jsonl")]
    assert steps == [1, 2, 3]
