"""Writes the example notebooks (examples/*.ipynb) from the cells below, without outputs.

    python examples/make_notebooks.py            # rewrite examples/*.ipynb
    python examples/make_notebooks.py OUT_DIR    # write them somewhere else

The repository the notebooks name is set in one place, `[project.urls] Repository` in
pyproject.toml: their Colab badge opens the notebook from it, and their first cell clones it when
jaxpar is not installed and no checkout of it is found beside the notebook. Change it there, then
rerun this script and commit the notebooks.

The notebooks are generated so that a review reads Python, not JSON; edit the cells here and
rerun. `tests/test_notebooks.py` checks that the committed notebooks equal this script's output,
name no other URL than pyproject.toml's, carry no outputs, and run top to bottom with
JAXPAR_NOTEBOOK_SMALL=1.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import textwrap
import tomllib

import nbformat

HERE = os.path.dirname(os.path.abspath(__file__))
PYPROJECT = os.path.join(os.path.dirname(HERE), "pyproject.toml")
BRANCH = "main"  # the branch the Colab badge opens
_REPO = "<<OWNER/NAME>>"  # in the cells below; build() puts the repository's owner/name there


def github_path(repo_url: str) -> str:
    """ "https://github.com/OWNER/NAME" (a trailing ".git" or "/" allowed) -> "OWNER/NAME"."""
    match = re.fullmatch(r"https://github\.com/([\w.-]+)/([\w.-]+?)(?:\.git)?/?", repo_url)
    if not match:
        raise ValueError(
            f"repository URL {repo_url!r} is not of the form "
            "https://github.com/OWNER/NAME (Colab opens notebooks from GitHub only)"
        )
    return f"{match[1]}/{match[2]}"


def repository_url(pyproject: str | None = None) -> str:
    """`[project.urls] Repository` of `pyproject` (default: this repository's) as
    https://github.com/OWNER/NAME; ValueError when it is missing or not a GitHub repository."""
    pyproject = pyproject or PYPROJECT
    with open(pyproject, "rb") as f:
        url = tomllib.load(f).get("project", {}).get("urls", {}).get("Repository")
    if url is None:
        raise ValueError(
            f'{pyproject} has no [project.urls] Repository = "https://github.com/'
            'OWNER/NAME"; the notebooks open from and clone that repository'
        )
    return f"https://github.com/{github_path(str(url))}"


def badge(name: str) -> str:
    url = f"https://colab.research.google.com/github/{_REPO}/blob/{BRANCH}/examples/{name}.ipynb"
    return f"[![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)]({url})"


# The first code cell of every notebook: jaxpar installed (from the checkout the notebook is in or
# was uploaded beside, else from a clone of the repository), then the backend started with 8 CPU
# devices as `python -m jaxpar.train` starts it.
SETUP = """\
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

REPO_URL = "https://github.com/<<OWNER/NAME>>"  # [project.urls] Repository of pyproject.toml


def find_checkout(start):
    \"\"\"The jaxpar repository `start` is in (this notebook in its examples/), or one in a
    folder beside it (the repository uploaded next to the notebook); None if neither.\"\"\"
    beside = sorted(path for path in start.iterdir() if path.is_dir())
    for folder in [start, *start.parents, *beside]:
        if (folder / "pyproject.toml").is_file() and (folder / "jaxpar" / "__init__.py").is_file():
            return folder
    return None


def install_jaxpar(start):
    \"\"\"pip-installs jaxpar (editable) from the repository found from `start`, else from a
    clone of REPO_URL made there, and makes it importable in this kernel.\"\"\"
    checkout = find_checkout(start)
    if checkout is None:
        checkout = start / "jaxpar"
        clone = subprocess.run(["git", "clone", "--quiet", "--depth=1", REPO_URL, str(checkout)],
                               env=dict(os.environ, GIT_TERMINAL_PROMPT="0"))
        if clone.returncode != 0:
            raise RuntimeError(f"jaxpar is not installed, no checkout of it is beside this notebook"
                               f", and git could not clone {REPO_URL}: upload the repository "
                               "next to the notebook, or install jaxpar in this Python")
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "-e", str(checkout)], check=True)
    sys.path.insert(0, str(checkout))  # importable now, without restarting the kernel
    importlib.invalidate_caches()


if importlib.util.find_spec("jaxpar") is None:  # e.g. a fresh Colab runtime
    install_jaxpar(Path.cwd())

SMALL = os.environ.get("JAXPAR_NOTEBOOK_SMALL") == "1"  # CI: fewer steps, smaller sizes
if SMALL:  # CI: skip LLVM's optimizations, which about halves compile times on CPU
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_backend_optimization_level=0").strip()
import jax

from jaxpar.config import RuntimeConfig
from jaxpar.mesh import emulate_cpu_devices

# Eight emulated CPU devices, before JAX starts a backend; as `python -m jaxpar.train` starts, so
# a machine with JAX's CUDA plugin but no GPU driver starts on the CPU without a cuInit error. On
# a GPU runtime the GPUs stay the default backend and the eight CPU devices exist beside them.
emulate_cpu_devices(RuntimeConfig(cpu_devices=8))
"""

# Notebooks 02-05 lay meshes of 8 devices: 8 accelerators where there are, else the CPU devices.
DEVICES = """
# The meshes below need 8 devices: the accelerators where there are 8, else the CPU devices
# (a one-GPU Colab runtime runs this notebook on its CPU). Arrays made here start there too.
DEVICES = jax.devices() if jax.device_count() >= 8 else jax.devices("cpu")[:8]
jax.config.update("jax_default_device", DEVICES[0])
print(f"{len(DEVICES)} {DEVICES[0].platform} devices for the meshes; SMALL={SMALL}")
"""


def md(text: str):
    return nbformat.v4.new_markdown_cell(textwrap.dedent(text).strip())


def code(text: str):
    return nbformat.v4.new_code_cell(textwrap.dedent(text).strip())


def intro(name: str, title: str, paragraph: str):
    return md(f"# {title}\n\n{badge(name)}\n\n{textwrap.dedent(paragraph).strip()}")


# ----------------------------------------------------------------------------------------------
# 01: quickstart


QUICKSTART = [
    intro(
        "01_quickstart",
        "jaxpar quickstart: train, plot, sample",
        """
        jaxpar trains Llama-style language models on one JAX device mesh whose six axes (`pipe`,
        `data`, `fsdp`, `expert`, `context`, `tensor`) each switch on one parallelism. This
        notebook runs the whole path once: a config built from the defaults and a few
        `dotted.key=value` overrides, a short training run on the default 2 x 2 x 2 mesh
        (data x fsdp x tensor) of 8 emulated CPU devices, the loss read back from the run's
        `metrics.jsonl`, and a few tokens sampled from the run's checkpoint. On a GPU runtime
        the same cells train on the GPU instead. The data is this Python's own standard
        library, byte-tokenized, so nothing is downloaded.
    """,
    ),
    code(SETUP),
    md("""
        ## A config

        A run's config is the dataclass defaults (`jaxpar/config.py`), then an optional YAML
        file, then overrides. The cell below is what `python -m jaxpar.train train.steps=60 ...`
        does on the command line. `checkpoint.every` equal to the step count leaves exactly one
        checkpoint, at the end, to sample from. With `JAXPAR_NOTEBOOK_SMALL=1` (CI) the model
        is also made narrower, which compiles several times faster.
    """),
    code("""
        import tempfile

        from jaxpar import checks as checks_lib
        from jaxpar import config as config_lib
        from jaxpar.run.records import format_summary
        from jaxpar.run.train import train

        STEPS = 4 if SMALL else 60
        run_dir = os.path.join(tempfile.mkdtemp(prefix="jaxpar-"), "quickstart")
        overrides = [
            f"train.steps={STEPS}",
            "train.batch_size=16",
            f"train.seq_len={64 if SMALL else 128}",
            "train.log_every=1",  # a metrics.jsonl line every step, for the plot
            f"optimizer.warmup_steps={max(1, STEPS // 10)}",
            f"checkpoint.every={STEPS}",  # one checkpoint, at the last step
            f"data.max_documents={50 if SMALL else 400}",  # the first stdlib files are plenty
            "train.progress=false",
            f"train.run_dir={run_dir}",
        ]
        if SMALL:
            overrides += ["model.d_model=32", "model.n_layers=2", "model.d_ff=64",
                          "model.vocab_size=264", "model.dtype=float32"]
        cfg = config_lib.load_config(None, overrides)
        # data=2 x fsdp=2 x tensor=2 on 8 devices; plain data parallelism on a smaller machine
        cfg.mesh = config_lib.fit_default_mesh(jax.device_count())
        sizes = checks_lib.validate(cfg, jax.device_count())  # ConfigError names any bad key
        print("mesh:", {axis: n for axis, n in sizes.items() if n > 1} or {"data": 1})
        print("model:", {k: v for k, v in vars(cfg.model).items() if k != "moe"})
    """),
    md("""
        ## Train

        `train` builds the mesh, creates the parameters already sharded (ZeRO-3 over `fsdp`,
        Megatron-style over `tensor`), compiles one train step and runs it, writing
        `config.yaml`, `metrics.jsonl`, TensorBoard events and checkpoints into the run
        directory. Most of the first step's time is compilation.
    """),
    code("""
        summary = train(cfg, sizes)
        print(format_summary(summary))
        print(sorted(os.listdir(run_dir)))
    """),
    md("""
        ## The loss

        Each line of `metrics.jsonl` is one logged step. An untrained model predicts every
        token about equally, a loss of ln(vocab_size) nats; the first steps move it below that.
    """),
    code("""
        import json

        import matplotlib.pyplot as plt
        import numpy as np

        # train() drew loss.png with matplotlib's Agg backend, which also switched this kernel's
        # backend; switch back so that figures show below the cells.
        %matplotlib inline

        with open(os.path.join(run_dir, "metrics.jsonl")) as f:
            records = [json.loads(line) for line in f]
        fig, ax = plt.subplots(figsize=(6, 3.5))
        ax.plot([r["step"] for r in records], [r["loss"] for r in records], marker="o")
        ax.axhline(np.log(cfg.model.vocab_size), color="gray", ls="--",
                   label=f"uniform guess, ln({cfg.model.vocab_size})")
        ax.set(xlabel="step", ylabel="loss (nats per token)", title="training loss")
        ax.legend()
        plt.show()
    """),
    md("""
        ## Sample

        `load_model` restores the newest intact checkpoint onto one device; `generate` runs a
        prefill and then one token per step from a KV cache, all under one `jit`. The command
        line does the same: `python -m jaxpar.sample RUN_DIR --prompt "def "`. A model trained
        for a minute on bytes of Python writes indented, Python-looking noise; train longer
        (`STEPS`) for more.
    """),
    code("""
        import logging

        from jaxpar.corpus.data import make_tokenizer
        from jaxpar.sample import generate, load_model

        logging.getLogger("absl").setLevel(logging.ERROR)  # orbax's notes on read-only restores
        run_cfg, model, step = load_model(run_dir)
        tokenizer = make_tokenizer(run_cfg.data)
        prompt = "def "
        ids = generate(model, tokenizer.encode(prompt), max_tokens=16 if SMALL else 64,
                       temperature=0.8, top_k=20, seed=0, vocab_limit=tokenizer.vocab_size,
                       stop_token=tokenizer.eod_id)
        print(f"checkpoint of step {step}:")
        print(prompt + tokenizer.decode(ids))
    """),
]


# ----------------------------------------------------------------------------------------------
# 02: data parallelism, ZeRO and tensor parallelism


DATA_FSDP_TENSOR = [
    intro(
        "02_data_fsdp_tensor",
        "Data, ZeRO and tensor parallelism on one mesh",
        """
        The same tiny model under six layouts of 8 devices: plain data parallelism (`data=8`),
        ZeRO stages 1, 2 and 3 over `fsdp=8`, tensor parallelism (`tensor=8`), and tensor
        parallelism with sequence parallelism (`data=4`, `tensor=2`). The model code is the
        same in all six; only the mesh and a rules table mapping logical axis names (`embed`,
        `vocab`, `mlp`, ...) onto mesh axes change. For each layout we look at where a
        parameter lives, how many bytes of parameters, gradients and optimizer state each
        device holds, and which collectives XLA puts into the compiled step. Nothing here
        runs a training step: `jaxpar.inspect` only compiles.
    """,
    ),
    code(SETUP + DEVICES),
    code("""
        import numpy as np

        from jaxpar import checks as checks_lib
        from jaxpar import config as config_lib
        from jaxpar.config import MESH_AXES
        from jaxpar.inspect import compile_step, report, zero_formula
        from jaxpar.run.train import build_trainer

        TINY = ["model.vocab_size=264", "model.d_model=64", "model.n_layers=2", "model.n_heads=8",
                "model.n_kv_heads=8", "model.d_ff=128", "model.dtype=float32",
                "train.batch_size=16", f"train.seq_len={32 if SMALL else 128}"]
        LAYOUTS = {  # name -> (mesh axes other than 1, overrides)
            "DP": ({"data": 8}, ["parallel.zero_stage=0"]),
            "ZeRO-1": ({"fsdp": 8}, ["parallel.zero_stage=1"]),
            "ZeRO-2": ({"fsdp": 8}, ["parallel.zero_stage=2"]),
            "ZeRO-3": ({"fsdp": 8}, ["parallel.zero_stage=3"]),
            "TP": ({"tensor": 8}, ["parallel.zero_stage=0"]),
            "TP+SP": ({"data": 4, "tensor": 2},
                      ["parallel.zero_stage=0", "parallel.sequence_parallel=true"]),
        }


        def trainer_for(mesh, extra):
            axes = [f"mesh.{axis}={mesh.get(axis, 1)}" for axis in MESH_AXES]
            cfg = config_lib.load_config(None, TINY + axes + extra)
            return build_trainer(cfg, checks_lib.validate(cfg, len(DEVICES)), devices=DEVICES)


        # Builds meshes and shardings; nothing is compiled or allocated yet.
        trainers = {name: trainer_for(*layout) for name, layout in LAYOUTS.items()}
    """),
    md("""
        ## Where a parameter lives

        Each trainer knows the sharding of every parameter, of its gradient after the
        reduction, and of its Adam moments. For the embedding table (`[vocab, embed]`): DP
        replicates all three; ZeRO-1 shards only the optimizer state over `fsdp`, ZeRO-2 also
        the gradient, ZeRO-3 also the parameter; TP cuts the vocabulary over `tensor`.
    """),
    code("""
        def adam_sharding(trainer, name):
            \"\"\"The sharding of Adam's first moment (mu) of the parameter `name`.\"\"\"
            flat = jax.tree_util.tree_flatten_with_path(trainer.state_shardings["opt_state"])[0]
            for path, sharding in flat:
                keys = [getattr(k, "name", getattr(k, "key", None)) for k in path]
                if "mu" in keys and keys[-1] == name:
                    return sharding


        print(f"{'layout':8} {'parameter':22} {'gradient':22} {'Adam mu':22}")
        for name, trainer in trainers.items():
            specs = (trainer.state_shardings["params"]["embedding"], trainer.grad_shardings["embedding"],
                     adam_sharding(trainer, "embedding"))
            print(f"{name:8} " + " ".join(f"{str(s.spec):22}" for s in specs))
    """),
    md("""
        `jax.debug.visualize_array_sharding` draws which device holds which block of a 2-D
        array. Below: the embedding `[264, 64]` and layer 0's MLP up-projection
        `[embed 64, mlp 128]` (the blocks' parameters are stacked over layers; we take one
        layer's slice of the sharding). Tensor parallelism splits the MLP by columns
        (`mlp`), ZeRO-3 by rows (`embed`).
    """),
    code("""
        from jax.sharding import NamedSharding
        from jax.sharding import PartitionSpec as P


        def show(trainer, array_shape, spec):
            placed = jax.device_put(np.zeros(array_shape, np.float32), NamedSharding(trainer.mesh, spec))
            jax.debug.visualize_array_sharding(placed)


        for name in ("DP", "ZeRO-3", "TP", "TP+SP"):
            trainer = trainers[name]
            params, shardings = trainer.state_shape["params"], trainer.state_shardings["params"]
            w_up = shardings["blocks"]["mlp"]["w_up"].spec  # [layers, embed, mlp]
            print(f"{name}: embedding {shardings['embedding'].spec}, w_up[0] {P(*w_up[1:])}")
            show(trainer, params["embedding"].shape, shardings["embedding"].spec)
            show(trainer, params["blocks"]["mlp"]["w_up"].shape[1:], P(*w_up[1:]))
    """),
    md("""
        ## Bytes per device

        `jaxpar.inspect.report` compiles the train step (nothing runs) and reads the bytes each
        device holds from the shardings, and XLA's temporaries and collectives from the
        compiled program. The same numbers come from `python -m jaxpar.inspect mesh.fsdp=8 ...
        --human`. One compile per layout: this is the slow cell.
    """),
    code("""
        reports = {name: report(trainer, compile_step(trainer), compare=True)
                   for name, trainer in trainers.items()}
        print(f"{reports['DP']['params']:,} parameters")
    """),
    md("""
        The stacked bars are what each device holds for the model state, in float32: 4 bytes
        of parameter, 4 of gradient and 8 of Adam moments per parameter. The black ticks are
        the ZeRO formula for those dtypes (`jaxpar.inspect.zero_formula`): stage 1 divides the
        optimizer state by the `fsdp` size N, stage 2 also the gradients, stage 3 everything.
        Tensor parallelism divides the sharded matrices by 8 but keeps the norm scales whole.
    """),
    code("""
        import matplotlib.pyplot as plt

        KIB = 1 / 1024
        names = list(reports)
        fig, ax = plt.subplots(figsize=(7, 3.5))
        bottom = np.zeros(len(names))
        for part in ("params", "gradients", "optimizer"):
            values = np.array([reports[n]["memory_per_device"][part] * KIB for n in names])
            ax.bar(names, values, bottom=bottom, label=part)
            bottom += values
        predicted = [reports[n]["compare"]["predicted"]["total"] * KIB for n in names]
        ax.scatter(names, predicted, marker="_", s=900, color="black", label="ZeRO formula", zorder=3)
        ax.set(ylabel="KiB per device", title="model state per device (8 devices)")
        ax.legend()
        plt.show()
    """),
    md("""
        ## What each layout sends

        Per train step: how many collectives of each kind the compiled program runs (one inside
        the scan over layers counts once per layer) and the bytes they move per device, read
        from the HLO by `jaxpar.compiled.hlo`. What to look for:

        - DP all-reduces the gradients: about one copy of the parameters.
        - ZeRO-1 all-reduces them too, updates only its eighth of the parameters (it holds
          only that eighth of Adam's state) and all-gathers the updated parameters.
        - ZeRO-2 reduce-scatters the gradients instead: each device receives only the eighth it
          updates. (The tiny all-reduces are scalars: loss, token count, gradient norm.)
        - ZeRO-3 all-gathers each layer's parameters where they are used, in the forward and
          again in the backward, and keeps no full copy in between.
        - TP all-reduces activations inside every block, forward and backward: its bytes grow
          with batch x sequence, not with the parameter count.
        - TP+SP moves activations between the tensor-parallel regions with all-gathers and
          reduce-scatters (and a few all-to-alls XLA chooses for resharding), and all-reduces
          the gradients over the 4-way data axis.

        On CPU, XLA writes a reduce-scatter as an all-reduce followed by a slice; `jaxpar.compiled.hlo`
        counts it as the reduce-scatter a GPU or TPU compiler makes of it.
    """),
    code("""
        from IPython.display import Markdown, display

        from jaxpar.compiled.hlo import KINDS

        rows = ["| layout | " + " | ".join(KINDS) + " |", "|---" * (len(KINDS) + 1) + "|"]
        for name, r in reports.items():
            cells = []
            for kind in KINDS:
                c = r["collectives"].get(kind)
                cells.append(f"{c['count']} ops, {c['bytes'] * KIB:,.1f} KiB" if c else "")
            rows.append(f"| {name} | " + " | ".join(cells) + " |")
        display(Markdown("\\n".join(rows)))
    """),
]


# ----------------------------------------------------------------------------------------------
# 03: pipeline parallelism


PIPELINE = [
    intro(
        "03_pipeline",
        "Pipeline parallelism: GPipe, 1F1B and interleaved",
        """
        Pipeline parallelism cuts the layer stack into stages, one per device of the `pipe`
        axis, and the batch into microbatches that flow through them. jaxpar writes each
        schedule as a static table built in Python (for every tick and every stage: forward or
        backward of one microbatch, or idle) and runs it as one `shard_map` whose only
        communication is a `ppermute` to the neighbouring stage per tick. This notebook draws
        the GPipe, 1F1B and interleaved 1F1B tables, compares their idle time (the bubble) and
        activation memory with the formulas, and checks that pipelined training gives the same
        losses as one device.
    """,
    ),
    code(SETUP + DEVICES),
    md("""
        ## A schedule is a table

        `build_schedule(kind, stages, microbatches, virtual_stages)` returns
        `Schedule.actions[tick][stage]`: an `Action(phase, microbatch, chunk)` or `None`.
        `format_schedule` prints it (`F3` = forward of microbatch 3, `.` = idle); this is also
        `python -m jaxpar.inspect mesh.pipe=4 ... --schedule`.
    """),
    code("""
        import matplotlib.pyplot as plt
        import numpy as np

        from jaxpar.parallel.schedule import (bubble_fraction, build_schedule, format_schedule,
                                              lower_schedule)

        print(format_schedule(build_schedule("1f1b", stages=4, microbatches=6)))
    """),
    md("""
        Drawn to scale: one column is one stage's forward (blue) or backward (orange) of one
        microbatch, counted as equally long. GPipe runs all forwards, then all backwards;
        1F1B starts backwards as soon as it can, which keeps the same bubble but frees
        activations early. Interleaved 1F1B gives each device two chunks of half the layers
        (darker = second chunk): its cells take half as long and the bubble shrinks.
    """),
    code("""
        STAGES, MICROBATCHES = 4, 8
        SCHEDULES = {
            "GPipe": build_schedule("gpipe", STAGES, MICROBATCHES),
            "1F1B": build_schedule("1f1b", STAGES, MICROBATCHES),
            "interleaved 1F1B, 2 chunks per device":
                build_schedule("interleaved", STAGES, MICROBATCHES, virtual_stages=2),
        }


        def draw(schedule, ax, title):
            \"\"\"Stage x time; a cell is one action, 1/virtual_stages wide, labelled by microbatch.\"\"\"
            width = 1 / schedule.virtual_stages
            for tick, row in enumerate(schedule.actions):
                for stage, action in enumerate(row):
                    if action is None:
                        continue
                    colors = plt.cm.Blues if action.phase == "F" else plt.cm.Oranges
                    shade = 0.45 + 0.3 * action.chunk
                    ax.add_patch(plt.Rectangle((tick * width, stage), width, 1,
                                               facecolor=colors(shade), edgecolor="white"))
                    ax.text((tick + 0.5) * width, stage + 0.5, action.microbatch,
                            ha="center", va="center", fontsize=7)
            ax.set(xlim=(0, 2 * (MICROBATCHES + STAGES)), ylim=(schedule.stages, 0),
                   yticks=np.arange(schedule.stages) + 0.5, yticklabels=range(schedule.stages),
                   ylabel="stage", title=f"{title}: bubble {bubble_fraction(schedule):.0%}")


        fig, axes = plt.subplots(3, 1, figsize=(10, 6), sharex=True)
        for ax, (title, schedule) in zip(axes, SCHEDULES.items()):
            draw(schedule, ax, title)
        axes[-1].set_xlabel("time (one stage's forward or backward of one microbatch)")
        fig.tight_layout()
        plt.show()
    """),
    md("""
        ## Bubble and memory against microbatches

        With p stages and m microbatches, GPipe and 1F1B idle (p - 1)/(m + p - 1) of all
        slots; interleaved with v chunks per device about (p - 1)/(v m + p - 1). More
        microbatches shrink the bubble, but GPipe must keep every microbatch's activations
        until its backward: the stash `lower_schedule` allocates per device (one slot holds one
        microbatch's residuals of one chunk) grows with m for GPipe and stays at p for 1F1B.
        Interleaved slots hold half a stage each; it keeps more of them than 1F1B, but a
        fixed number.
    """),
    code("""
        p, v = 4, 2
        ms = np.arange(4, 33, 4)  # interleaved needs microbatches divisible by stages
        measured = {
            "GPipe": [build_schedule("gpipe", p, m) for m in ms],
            "1F1B": [build_schedule("1f1b", p, m) for m in ms],
            "interleaved (v=2)": [build_schedule("interleaved", p, m, v) for m in ms],
        }
        fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.5))
        dense = np.linspace(ms[0], ms[-1], 100)
        left.plot(dense, (p - 1) / (dense + p - 1), color="gray", label="(p-1)/(m+p-1)")
        left.plot(dense, (p - 1) / (v * dense + p - 1), color="gray", ls="--", label="(p-1)/(vm+p-1)")
        for (name, schedules), marker in zip(measured.items(), "os^"):
            left.plot(ms, [bubble_fraction(s) for s in schedules], marker, label=name, fillstyle="none")
            right.plot(ms, [lower_schedule(s).stash_slots for s in schedules], marker + "-", label=name)
        right.set_ylim(bottom=0)
        left.set(xlabel="microbatches m", ylabel="bubble fraction", title=f"idle slots, p={p}")
        right.set(xlabel="microbatches m", ylabel="stash slots per device",
                  title="activations kept for the backward")
        left.legend()
        right.legend()
        fig.tight_layout()
        plt.show()
    """),
    md("""
        ## Pipelined training equals one device

        The same tiny 4-layer model, trained on the same batches, once on one device and once
        with `mesh.pipe=4` (one layer per stage, 1F1B, 4 microbatches) times `mesh.data=2`.
        Backward is explicit (each forward stashes its `jax.vjp` residuals), so the gradients
        are the same sums in a different order: the losses agree to float32 rounding.
    """),
    code("""
        import math

        from jaxpar import checks as checks_lib
        from jaxpar import config as config_lib
        from jaxpar.corpus import data as data_lib
        from jaxpar.config import MESH_AXES
        from jaxpar.inspect import compile_step, report
        from jaxpar.run.train import build_trainer, make_data

        STEPS = 3 if SMALL else 10
        TINY = ["model.vocab_size=264", "model.d_model=32", "model.n_layers=4", "model.n_heads=4",
                "model.n_kv_heads=2", "model.d_ff=64", "model.dtype=float32", "train.batch_size=16",
                "train.seq_len=32", "parallel.zero_stage=0", "optimizer.lr=1e-2",
                "optimizer.warmup_steps=2", "data.max_documents=20",
                "parallel.grad_reduce_dtype=float32"]  # float32 gradients: equal to 1e-5


        def trainer_for(mesh, extra=()):
            cfg = config_lib.load_config(None, TINY + [f"mesh.{a}={mesh.get(a, 1)}" for a in MESH_AXES]
                                         + list(extra))
            devices = DEVICES[:math.prod(mesh.values())]
            return build_trainer(cfg, checks_lib.validate(cfg, len(devices)), devices=devices)


        def losses(trainer, compiled, initial, batches):
            \"\"\"Train from a copy of `initial`, laid out on this trainer's mesh.\"\"\"
            state = jax.device_put(initial, trainer.state_shardings, may_alias=False)
            out = []
            for batch in batches:
                state, metrics = compiled(state, trainer.shard_batch(batch))
                out.append(float(metrics["loss"]))
            return out


        single = trainer_for({})
        pipelined = trainer_for({"pipe": 4, "data": 2},
                                ["parallel.pipeline_schedule=1f1b", "parallel.microbatches=4"])
        iterator = data_lib.make_iterator(make_data(single.cfg))
        batches = [next(iterator) for _ in range(STEPS)]
        initial = single.init()  # one initial state for both runs (the same seed gives the same)

        single_losses = losses(single, compile_step(single), initial, batches)
        compiled = compile_step(pipelined)
        pipelined_losses = losses(pipelined, compiled, initial, batches)
        for step, (a, b) in enumerate(zip(single_losses, pipelined_losses), 1):
            print(f"step {step}: one device {a:.6f}   pipe=4 x data=2 {b:.6f}")
        np.testing.assert_allclose(pipelined_losses, single_losses, rtol=1e-5)
        permutes = report(pipelined, compiled)["collectives"]["collective-permute"]
        print(f"collective-permutes per step: {permutes['count']} ({permutes['bytes'] / 1024:.0f} KiB)")
    """),
]


# ----------------------------------------------------------------------------------------------
# 04: ring attention


RING_ATTENTION = [
    intro(
        "04_ring_attention",
        "Context parallelism: ring attention",
        """
        Ring attention splits a long sequence over the `context` axis: each of the c devices
        keeps its block of queries, and the key/value blocks travel round the ring
        (`jax.lax.ppermute`, device i to i + 1) so that after c - 1 hops every query block has
        met every key block. Partial softmax results merge by the log-sum-exp rule, so no device
        ever holds the whole sequence's keys or a seq x seq score matrix. This notebook follows
        the ring step by step, shows why jaxpar's default `zigzag` layout balances causal work
        where the `contiguous` one does not, checks ring attention against plain attention, and
        measures memory per device as the context axis grows.
    """,
    ),
    code(SETUP + DEVICES),
    md("""
        ## Who holds what

        `layout_indices(seq, context, layout)` is the token order a layout gives the sequence;
        device i holds the i-th 1/c of it. `contiguous` gives device i the i-th block of
        tokens. `zigzag` cuts the sequence into 2c chunks and gives device i chunks i and
        2c - 1 - i: an early chunk and a late one.
    """),
    code("""
        import matplotlib.pyplot as plt
        import numpy as np

        from jaxpar.parallel.ring_attention import layout_indices, ring_attention

        CONTEXT, SEQ = 4, 16
        for layout in ("contiguous", "zigzag"):
            held = layout_indices(SEQ, CONTEXT, layout).reshape(CONTEXT, -1)  # [device, tokens]
            print(layout)
            for device, tokens in enumerate(held):
                print(f"  device {device}: tokens {tokens.tolist()}")
    """),
    md("""
        ## The ring, step by step

        At ring step t, device i computes its queries against the key/value block that started
        on device (i - t) mod c, then passes that block on. Each cell below names the block a
        device holds at a step and counts the (query, key) pairs the causal mask leaves
        visible there: the work of that step. With `contiguous`, device 0 has almost nothing
        to do after step 0 while device 3 works at every step; with `zigzag` every device does
        the same work at every step after the first.
    """),
    code("""
        def visible_pairs(seq, context, layout):
            \"\"\"[device, ring step] -> causal (query, key) pairs computed there.\"\"\"
            held = layout_indices(seq, context, layout).reshape(context, -1)
            pairs = np.zeros((context, context), int)
            for device in range(context):
                for step in range(context):
                    queries, keys = held[device], held[(device - step) % context]
                    pairs[device, step] = np.sum(keys[None, :] <= queries[:, None])
            return pairs


        fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
        for ax, layout in zip(axes, ("contiguous", "zigzag")):
            pairs = visible_pairs(SEQ, CONTEXT, layout)
            ax.imshow(pairs, cmap="Greens", vmin=0, vmax=2 * SEQ**2 / CONTEXT**2)
            for device in range(CONTEXT):
                for step in range(CONTEXT):
                    label = f"K/V of {(device - step) % CONTEXT}\\n{pairs[device, step]} pairs"
                    ax.text(step, device, label, ha="center", va="center", fontsize=8)
            ax.set(xlabel="ring step", ylabel="device", title=f"{layout}, seq={SEQ}, context={CONTEXT}",
                   xticks=range(CONTEXT), yticks=range(CONTEXT))
        fig.tight_layout()
        plt.show()
    """),
    md("""
        ## Causal work per device

        Summed over the ring, at a realistic size (seq 4096 over 8 devices): the contiguous
        layout's last device computes 15 times the pairs of its first, and every step waits
        for the slowest device. Zigzag gives every device the same count. (jaxpar skips a
        pair of chunks that the mask hides entirely, so this is also what the devices compute,
        up to chunk granularity.)
    """),
    code("""
        fig, ax = plt.subplots(figsize=(7, 3.2))
        for offset, layout in ((-0.2, "contiguous"), (0.2, "zigzag")):
            work = visible_pairs(4096, 8, layout).sum(axis=1)
            ax.bar(np.arange(8) + offset, work / 1e6, width=0.4, label=layout)
        ax.set(xlabel="device", ylabel="visible pairs (millions)",
               title="causal attention work per device, seq 4096, context 8")
        ax.legend()
        plt.show()
    """),
    md("""
        ## Same numbers as plain attention

        `ring_attention(q, k, v, mesh=...)` takes global arrays in ordinary order (it permutes
        into the layout and back itself) with grouped-query heads, and matches
        `jax.nn.dot_product_attention` to float32 rounding in either layout.
    """),
    code("""
        import jax.numpy as jnp
        from jax.sharding import Mesh

        mesh = Mesh(np.array(DEVICES), ("context",))  # context=8
        rng = np.random.default_rng(0)
        batch, seq, heads, kv_heads, head_dim = 2, 256, 4, 2, 16
        q = jnp.asarray(rng.normal(size=(batch, seq, heads, head_dim)), jnp.float32)
        k, v = (jnp.asarray(rng.normal(size=(batch, seq, kv_heads, head_dim)), jnp.float32)
                for _ in range(2))
        plain = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True))(q, k, v)
        for layout in ("zigzag", "contiguous"):
            ring = jax.jit(lambda q, k, v: ring_attention(q, k, v, mesh=mesh, layout=layout))(q, k, v)
            error = float(jnp.max(jnp.abs(ring - plain)))
            print(f"{layout:10}: max |ring - plain| = {error:.1e}, output sharded {ring.sharding.spec}")
            assert error < 1e-5
    """),
    md("""
        ## Memory per device against the context size

        Compiling forward and backward of one attention layer for context 1, 2, 4 and 8 and
        reading XLA's temporary bytes per device: the largest score tile a device holds is
        `[batch, heads, seq/(2c), seq/(2c)]`, so the temporaries fall roughly as 1/c^2, while
        plain attention materializes the whole `seq x seq` score matrix. (At small sizes the
        fixed costs show and the fall is slower.) Nothing runs; each size is one compile.
    """),
    code("""
        SEQ_MEM = 1024 if SMALL else 4096
        x = jax.ShapeDtypeStruct((1, SEQ_MEM, 2, 16), jnp.float32)  # [batch, seq, heads, head_dim]


        def temp_mib(attention):
            loss = lambda q, k, v: jnp.sum(attention(q, k, v))
            compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(x, x, x).compile()
            return compiled.memory_analysis().temp_size_in_bytes / 2**20


        contexts = [1, 2, 4, 8]
        ring_mib = [temp_mib(lambda q, k, v, c=c: ring_attention(
            q, k, v, mesh=Mesh(np.array(DEVICES[:c]), ("context",)))) for c in contexts]
        plain_mib = temp_mib(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True))
        for c, mib in zip(contexts, ring_mib):
            print(f"context {c}: {mib:8.2f} MiB temporaries per device")

        fig, ax = plt.subplots(figsize=(6, 3.5))
        ax.bar([str(c) for c in contexts], ring_mib, label="ring attention")
        ax.axhline(plain_mib, color="gray", ls="--", label="plain attention, one device")
        ax.set(yscale="log", xlabel="context (devices)", ylabel="temporaries per device (MiB)",
               title=f"forward + backward, seq {SEQ_MEM}")
        ax.legend(loc="lower left")
        plt.show()
    """),
]


# ----------------------------------------------------------------------------------------------
# 05: mixture of experts


EXPERTS = [
    intro(
        "05_experts",
        "Mixture of experts and expert parallelism",
        """
        A mixture-of-experts MLP sends each token to its top-k of E expert MLPs, chosen by a
        small router. With expert parallelism the experts are split over the `expert` mesh
        axis: each device routes its own tokens, packs them into a fixed-size buffer per
        expert, and an `all_to_all` swaps the buffers so every token reaches its expert's
        device (and a second one brings the results back). Fixed-size buffers mean a busy
        expert can overflow: the `capacity_factor` decides how many slots each expert gets,
        and tokens beyond it are dropped. This notebook looks at a router's load, the dropped
        fraction against the capacity factor, and trains a small MoE model over `expert=8`.
    """,
    ),
    code(SETUP + DEVICES),
    md("""
        ## Routing a batch

        `route` computes the router's softmax over experts, each token's top-k experts with
        weights renormalized to sum to 1, the Switch Transformer load-balancing loss (1.0 when
        the load is even, larger when it is not) and the z-loss. Two random routers over the
        same 512 tokens: one without preference, and one whose logits carry a bias from
        +1.5 (expert 0) down to -1.5 (expert 7), as a router early in training might.
    """),
    code("""
        import functools

        import matplotlib.pyplot as plt
        import numpy as np

        from jaxpar.parallel.experts import expert_capacity, moe_mlp, route

        NUM_EXPERTS, TOP_K, EMBED, MLP = 8, 2, 16, 32
        BATCH, SEQ = 8, 64  # 512 tokens: 64 per device once the batch is split over 8 devices
        rng = np.random.default_rng(0)
        x = rng.normal(size=(BATCH, SEQ, EMBED)).astype(np.float32)
        x[..., 0] = 1.0  # a constant feature: router row 0 becomes a per-expert bias


        def expert_params(bias):
            \"\"\"Random experts and router; `bias` [experts] is added to every token's logits.\"\"\"
            normal = lambda *shape: rng.normal(size=shape).astype(np.float32)
            router = 0.3 * normal(EMBED, NUM_EXPERTS)
            router[0] = bias
            return {"router": router,
                    "gate": normal(NUM_EXPERTS, EMBED, MLP) / np.sqrt(EMBED),
                    "up": normal(NUM_EXPERTS, EMBED, MLP) / np.sqrt(EMBED),
                    "down": normal(NUM_EXPERTS, MLP, EMBED) / np.sqrt(MLP)}


        ROUTERS = {"balanced router": expert_params(np.zeros(NUM_EXPERTS, np.float32)),
                   "skewed router": expert_params(np.linspace(1.5, -1.5, NUM_EXPERTS, dtype=np.float32))}
        route_tokens = jax.jit(functools.partial(route, top_k=TOP_K))
        tokens = x.reshape(-1, EMBED)  # [tokens, embed]


        def slots(capacity_factor):
            \"\"\"Slots per expert over all 8 source devices (each routes its 64 tokens).\"\"\"
            return len(DEVICES) * expert_capacity(len(tokens) // len(DEVICES), NUM_EXPERTS, TOP_K,
                                                  capacity_factor)


        fig, ax = plt.subplots(figsize=(7, 3.4))
        for offset, (name, params) in zip((-0.2, 0.2), ROUTERS.items()):
            routing = route_tokens(tokens, params["router"])
            ax.bar(np.arange(NUM_EXPERTS) + offset, np.asarray(routing.expert_load), width=0.4,
                   label=f"{name}: aux_loss {float(routing.aux_loss):.2f}")
        ax.axhline(slots(1.0), color="gray", ls="--", label="even load = slots at capacity_factor 1")
        ax.axhline(slots(1.5), color="red", ls=":", label="slots at capacity_factor 1.5")
        ax.set(xlabel="expert", ylabel="(token, choice) pairs",
               title=f"expert load, {len(tokens)} tokens, top-{TOP_K}")
        ax.legend(fontsize=8)
        plt.show()
    """),
    md("""
        ## Dropped tokens against capacity

        Each source device gives each expert ceil(capacity_factor x tokens x k / E) slots and
        hands them out first come first served, all first choices before any second choice
        (GShard). `moe_mlp` runs the whole layer on the 8-device `expert` mesh, dispatch and
        return `all_to_all`s included, and reports the fraction of (token, choice) pairs it
        dropped. Even a balanced router drops some pairs at capacity factor 1, since the load
        on each device fluctuates; the skewed one needs far more room. `capacity_factor=None`
        (the default) is dropless: every buffer is sized for the worst case.
    """),
    code("""
        from jax.sharding import Mesh

        mesh = Mesh(np.array(DEVICES), ("expert",))  # one expert per device
        factors = [0.5, 1.0, 1.5, 2.0] if SMALL else [0.5, 0.75, 1.0, 1.25, 1.5, 2.0, 3.0]
        dropped = {name: [] for name in ROUTERS}
        for factor in factors:  # one compile per factor: the buffer size is static
            layer = jax.jit(functools.partial(moe_mlp, mesh=mesh, top_k=TOP_K, capacity_factor=factor))
            for name, params in ROUTERS.items():
                _, stats = layer(x, params)
                dropped[name].append(float(stats["dropped_fraction"]))

        fig, ax = plt.subplots(figsize=(6, 3.2))
        for name, values in dropped.items():
            ax.plot(factors, values, marker="o", label=name)
        ax.set(xlabel="capacity_factor", ylabel="dropped fraction", title="pairs dropped by moe_mlp")
        ax.legend()
        plt.show()
    """),
    md("""
        ## Training an MoE model over `expert=8`

        A small model whose second block has an 8-expert MoE MLP (plus one always-on shared
        expert), one expert per device, capacity factor 2. The train step adds the
        load-balancing and z-losses to the objective and reports the dropped fraction and the
        idlest and busiest expert's load, in (token, choice) pairs out of 16 x 32 x 2 = 1024
        (an even share is 128). The compiled step holds the dispatch and return `all_to_all`s,
        forward and backward.

        In byte-level Python a few tokens (spaces above all) are very common, and a young
        router soon sends them to the same expert: the busiest expert's load climbs past
        twice the even share, and what does not fit is dropped. The load-balancing loss
        (`model.moe.aux_loss_weight`) pushes back over a longer run; dropless routing
        (`model.moe.capacity_factor: null`, the default) never drops, at the price of buffers
        sized for the worst case.
    """),
    code("""
        from jaxpar import checks as checks_lib
        from jaxpar import config as config_lib
        from jaxpar.corpus import data as data_lib
        from jaxpar.config import MESH_AXES
        from jaxpar.inspect import compile_step, report
        from jaxpar.run.train import build_trainer, make_data

        STEPS = 3 if SMALL else 20
        overrides = [
            "model.vocab_size=264", "model.d_model=32", "model.n_layers=2", "model.n_heads=4",
            "model.n_kv_heads=2", "model.d_ff=64", "model.dtype=float32",
            "model.moe.num_experts=8", "model.moe.top_k=2", "model.moe.every=2",
            "model.moe.shared_experts=1", "model.moe.capacity_factor=2.0",
            "train.batch_size=16", "train.seq_len=32", f"train.steps={STEPS}",
            "optimizer.warmup_steps=2", "parallel.zero_stage=0",
            "data.max_documents=20",
        ] + [f"mesh.{axis}={8 if axis == 'expert' else 1}" for axis in MESH_AXES]
        cfg = config_lib.load_config(None, overrides)
        trainer = build_trainer(cfg, checks_lib.validate(cfg, len(DEVICES)), devices=DEVICES)
        compiled = compile_step(trainer)
        all_to_all = report(trainer, compiled)["collectives"]["all-to-all"]
        print(f"all-to-alls per step: {all_to_all['count']} ({all_to_all['bytes'] / 1024:.0f} KiB)")

        iterator = data_lib.make_iterator(make_data(cfg))
        state = trainer.init()
        for step in range(1, STEPS + 1):
            state, metrics = compiled(state, trainer.shard_batch(next(iterator)))
            m = {k: float(v) for k, v in metrics.items()}
            print(f"step {step:2}: loss {m['loss']:.3f}  aux {m['aux_loss']:.3f}  "
                  f"dropped {m['dropped_fraction']:5.1%}  expert load {m['expert_load_min']:3.0f}"
                  f"..{m['expert_load_max']:3.0f}")
    """),
]


# ----------------------------------------------------------------------------------------------
# 06: fine-tuning on conversations


CHAT_FINETUNE = [
    intro(
        "06_chat_finetune",
        "Fine-tuning on conversations: prompts masked, a chat template, answers checked",
        """
        Most fine-tuning is on conversations: a system message, user turns, assistant replies,
        and only the replies are trained on. This notebook builds such a task that a tiny
        model learns on a CPU -- reverse a made-up word, add two numbers, in the style the
        system message asks for, over several turns (`benchmarks/chat_task.py`) -- writes it
        as a Hugging Face-style chat dataset, prepares it into shards with a chat template,
        trains a model on the replies alone, and asks it questions it has never seen, before
        and after. `python -m benchmarks.chat_sft` runs the same as a benchmark (its figures
        are in the README). With `JAXPAR_NOTEBOOK_SMALL=1` (CI) it trains a few short steps
        only, asks 3 questions, and the answers stay wrong; the full run is 1500 steps of 16
        rows of 512 tokens (on a 2-core CPU machine about 1.4 s a step on one device, longer on
        the 8 emulated ones).
    """,
    ),
    code(SETUP),
    md("""
        ## The task

        Each conversation is a list of `{"role", "content"}` messages, the format of Hugging
        Face chat datasets. Held-out words and number pairs never occur in training.
    """),
    code("""
        import jaxpar

        # The task's generator lives beside jaxpar in its repository, in benchmarks/: the checkout
        # this notebook is in or beside, else the one jaxpar is installed from (editable).
        checkout = find_checkout(Path.cwd()) or find_checkout(Path(jaxpar.__file__).parent)
        if checkout is None:
            raise RuntimeError("this notebook needs the jaxpar repository (its benchmarks/ folder); "
                               f"clone {REPO_URL} beside it")
        if str(checkout) not in sys.path:
            sys.path.insert(0, str(checkout))
        from benchmarks import chat_task
        from benchmarks.chat_sft import MODEL

        train_rows = chat_task.conversations(2000 if SMALL else 40000, "train", seed=0)
        held_out = chat_task.conversations(3 if SMALL else 200, "held_out", seed=0)
        for message in train_rows[0]:
            print(f"{message['role']:>9}: {message['content']}")
    """),
    md("""
        ## A chat template, and what is a target

        A template turns messages into text. Hugging Face tokenizers carry their own (Jinja2,
        rendered here exactly as `transformers`' `apply_chat_template` renders it); the byte
        tokenizer has none, so this notebook names jaxpar's `simple` one. Below, the targets
        of one conversation are in brackets: each assistant reply and its `<|end|>`, so the
        model learns to stop; system and user text, and the role headers, are only context.
    """),
    code("""
        from jaxpar.corpus import chat

        template = chat.load_template("simple", "byte")
        print(template.render(train_rows[0][:3], add_generation_prompt=False))
        print("".join(f"[{text}]" if target else text for text, target in template.pieces(train_rows[0])))
    """),
    md("""
        ## Shards

        `python -m jaxpar.data prepare` reads the JSONL, renders every conversation, tokenizes
        it and writes the tokens with a loss mask beside them (`train-00000.msk`).
    """),
    code("""
        import tempfile

        work = Path(tempfile.mkdtemp(prefix="jaxpar-sft-"))
        chat_task.write_jsonl(str(work / "chats.jsonl"), train_rows)
        subprocess.run([sys.executable, "-m", "jaxpar.data", "prepare", str(work / "chats.jsonl"),
                        "--chat-template", "simple", "--out", str(work / "shards")], check=True)
        print(sorted(os.listdir(work / "shards")))
    """),
    md("""
        ## Before

        A freshly initialised model of the shape trained below, asked the held-out questions
        through `chat_reply` -- what `python -m jaxpar.sample RUN --chat ...` prints.
    """),
    code("""
        import logging

        from flax import nnx

        from jaxpar import config as config_lib
        from jaxpar.corpus.documents import ByteTokenizer
        from jaxpar.models.llama import Transformer
        from jaxpar.sample import chat_reply

        logging.getLogger("absl").setLevel(logging.ERROR)  # orbax's notes on read-only restores
        STEPS = 3 if SMALL else 1500
        run_dir = str(work / "run")
        overrides = [*MODEL, f"data.source={work / 'shards'}", f"train.steps={STEPS}",
                     f"checkpoint.every={STEPS}", f"train.run_dir={run_dir}", "train.log_every=50",
                     "train.progress=false"]
        if SMALL:  # shorter rows, fewer of them: every conversation here fits in 256 tokens
            overrides += ["train.batch_size=8", "train.seq_len=256"]
        cfg = config_lib.load_config(str(checkout / "configs" / "sft.yaml"), overrides)
        tokenizer = ByteTokenizer()


        def ask(model, rows):
            answers = []
            for messages, want in chat_task.questions(rows):
                answers.append((messages[-1]["content"], want,
                                chat_reply(model, tokenizer, template, messages, max_tokens=16)))
            return answers


        before = ask(Transformer(cfg.model, rngs=nnx.Rngs(0)), held_out[:6])
        for question, want, got in before:
            print(f"{question!r:36} want {want!r:8} got {got!r}")
    """),
    md("""
        ## Train on the replies

        `configs/sft.yaml` with the benchmark's model (`MODEL`: the default job's shape, from
        scratch, a from-scratch learning rate), laid out as the default job is (data x fsdp x
        tensor = 2 x 2 x 2 on 8 devices; one device is the benchmark's). `data.train_on:
        assistant` is the default; `data.train_on=all` would train on every token.
    """),
    code("""
        from jaxpar import checks as checks_lib
        from jaxpar.run.records import format_summary
        from jaxpar.run.train import train

        cfg.mesh = config_lib.fit_default_mesh(jax.device_count())  # 2 x 2 x 2 on 8 devices
        summary = train(cfg, checks_lib.validate(cfg, jax.device_count()))
        print(format_summary(summary))
    """),
    md("""
        ## After

        The trained model, restored from its checkpoint, asked the same held-out questions,
        then the whole held-out set scored.
    """),
    code("""
        from jaxpar.sample import load_model

        _, trained, _ = load_model(run_dir)
        after = ask(trained, held_out)
        for (question, want, got_before), (_, _, got) in zip(before, after):
            print(f"{question!r:36} want {want!r:8} before {got_before!r:18} after {got!r}")
        right = sum(got == want for _, want, got in after)
        print(f"held-out accuracy: {right}/{len(after)} = {right / len(after):.0%}")
    """),
]


NOTEBOOKS = {
    "01_quickstart": QUICKSTART,
    "02_data_fsdp_tensor": DATA_FSDP_TENSOR,
    "03_pipeline": PIPELINE,
    "04_ring_attention": RING_ATTENTION,
    "05_experts": EXPERTS,
    "06_chat_finetune": CHAT_FINETUNE,
}


def build(name: str, repo_url: str) -> nbformat.NotebookNode:
    """The notebook `name`, without outputs, with stable cell ids (reruns give the same file),
    its Colab badge and install cell pointing at `repo_url` (https://github.com/OWNER/NAME)."""
    repo = github_path(repo_url)
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.from_dict(dict(cell)) for cell in NOTEBOOKS[name]]
    for index, cell in enumerate(nb.cells):
        cell["id"] = f"cell-{index:02d}"
        cell["source"] = cell["source"].replace(_REPO, repo)
    nb.metadata = {
        "kernelspec": {"display_name": "Python 3", "language": "python", "name": "python3"},
        "language_info": {"name": "python"},
        "colab": {"provenance": []},
    }
    nbformat.validate(nb)
    return nb


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("out_dir", nargs="?", default=HERE, help="where to write (default: here)")
    args = parser.parse_args(argv)
    try:
        url = repository_url()
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    os.makedirs(args.out_dir, exist_ok=True)
    for name in NOTEBOOKS:
        path = os.path.join(args.out_dir, f"{name}.ipynb")
        nbformat.write(build(name, url), path)
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
