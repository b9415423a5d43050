"""Test setup, before any JAX backend starts: 8 emulated CPU devices, and one persistent
compilation cache for the whole test session."""

import atexit
import gc
import os
import shutil
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")

# One JAX compilation cache per test session, in a fresh temporary directory (every session starts
# cold, as a clean clone in CI does) that the session's first process -- the xdist controller, or
# pytest without xdist -- makes and removes at exit. The xdist workers and every process a test
# starts (train/inspect/bench CLIs, resume and launch runs, notebook kernels: they all pass
# os.environ on) inherit it through the environment, so a program compiled once -- the same train
# step in a reference, a killed and a resumed run, or rebuilt by another test -- is loaded from the
# cache instead of compiled again. A cached executable is XLA's serialized compilation of the same
# HLO under the same options and flags (the cache key), so results, memory analyses and HLO text
# are those of a fresh compile.
SESSION_CACHE = "JAXPAR_TESTS_COMPILATION_CACHE"
if not os.environ.get(SESSION_CACHE):
    os.environ[SESSION_CACHE] = tempfile.mkdtemp(prefix="jaxpar-tests-jax-cache-")
    atexit.register(shutil.rmtree, os.environ[SESSION_CACHE], ignore_errors=True)
os.environ["JAX_COMPILATION_CACHE_DIR"] = os.environ[SESSION_CACHE]
# Every program is written, however fast it compiled (jax's default writes only those over 1 s).
# The small ones add up: a 12-step run of the tiny model with 4 checkpoints compiles 66 programs
# (orbax's slicing of replicated arrays for saving, initialisation, the step), 10 s of compiling;
# a second run with all of them cached took 7.6 s in all instead of 13.5 s (minimum 0.5 s).
os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = os.environ.get(
    "JAXPAR_TESTS_CACHE_MIN_COMPILE_SECS", "0"
)
# No size limit (JAX_COMPILATION_CACHE_MAX_SIZE unset): with one, jax's cache scans the whole
# directory under a file lock at every write (a stat and a read of every entry's access-time file,
# to find what to evict), which grows with the session: with 811 entries already there,
# tests/test_any_mesh.py took 56.6 CPU-s and 93 s instead of 33.6 CPU-s and 44 s, and a
# session writes thousands. Unbounded, there is no lock either: a process that reads an entry
# another is still writing (both compiling the same program at once) gets a warning and compiles
# it itself. The directory is the session's own and removed at its end.
os.environ.pop("JAX_COMPILATION_CACHE_MAX_SIZE", None)

# XLA flags for every program the session compiles, in this process and in the processes tests
# start (they pass os.environ on; each sets its own device count through runtime.cpu_devices, so
# the count is not a flag here but jax_num_cpu_devices below):
# --xla_backend_optimization_level=0: LLVM compiles the CPU programs without optimisation. The
# tests' programs are tiny and run a few steps; their compile time is the cost: at level 0 the
# suite's CPU time for tests/test_layouts.py + test_gpu_program.py fell from 116 s to 71 s
# (jax 0.12.0.1), and a 12-step tiny run gives the same losses. Same HLO, same fusions, same
# collectives and buffers: only the machine code is less tuned.
# --xla_gpu_autotune_level=0: the H100 programs the tests compile without a GPU (jaxpar.compiled.targets)
# cannot be autotuned -- there is nothing to time -- yet the default level still spends half of
# each compile in XLA's config-assigner building candidate kernels, and then keeps the defaults.
# Level 0 gives the same program (measured, jax 0.12.0.1: the same instructions, fusions, tiles,
# kernels, collectives and memory analysis, for the tests' programs and the gpt2-124m and llama-1b
# presets; only empty per-fusion annotations are missing) in half the time. The CPU programs do
# not read it.
# --xla_gpu_disable_gpuasm_optimizations: ptxas assembles each kernel at -O0. The tests read the
# H100 program's HLO, its kernels and collectives, and its memory analysis, all fixed before ptxas
# runs; only the machine code of each kernel is less tuned. test_gpu_program.py + test_gpu_memory.py
# compiled in 118 s instead of 144 s with it (the kernel cache below on in both), same results.
# --xla_gpu_kernel_cache_file: XLA's GPU compiler keeps the kernels it built (PTX assembled by
# ptxas, half of an H100 compile here) in this file, keyed by a fingerprint of the fusion and its
# arguments, and takes a kernel from it instead of building it again. The suite's H100 programs
# share most of their kernels (the same small model on other layouts; llama-1b twice, with and
# without a chunked loss): tests/test_gpu_program.py + test_gpu_memory.py, run alone in one
# process on the idle 2-core machine, compiled in 144 s instead of 174 s (178 s of wall instead of
# 208), and passed the same. One file for the whole session, read by every process that compiles
# for the GPU; XLA writes it whole to a temporary file renamed over it (an atomic replace), so
# two processes that add kernels at once lose one's additions, never the file. One file, because
# the flag is part of every program's persistent-cache key (jax hashes XLA's debug options, which
# hold it): a path of each worker's own split the cache by worker, and the CPU programs one
# worker compiled were compiled again by the other. (H100 programs are never loaded from that
# cache: jax 0.12 cannot load a program for devices that are not here. Those share kernels only.)
KERNEL_CACHE = "--xla_gpu_kernel_cache_file="
_flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if not f.startswith(KERNEL_CACHE)]
os.environ["XLA_FLAGS"] = " ".join(
    _flags
    + ["--xla_backend_optimization_level=0", "--xla_gpu_autotune_level=0"]
    + ["--xla_gpu_disable_gpuasm_optimizations=true"]
    + [KERNEL_CACHE + os.path.join(os.environ[SESSION_CACHE], "gpu-kernels.bin")]
)

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_enable_x64", False)


# --- Scheduling on xdist workers (`make test`: -n 2 --dist loadfile) --------------------------
#
# Each worker takes a whole file at a time, the next one in collection order once it is nearly
# done with its last. xdist's default queues the files with the most tests first, which leaves
# the few-but-slow ones (subprocess runs, H100 compiles) to the end, where one worker runs the last
# of them alone. Longest first instead: the files below in decreasing cost, any file not listed
# (a new one, of unknown cost) before them all, the cheap ones last to fill in the end.
# Seconds of each file (the sum of its tests' --durations in a whole `-n 2` run on the 2-core
# machine, 2026-12-02, halved for the other jobs that loaded it then). Rough is fine: only the
# order matters. A file listed at 0 is cheap and runs last.
FILE_SECONDS = {
    "test_pipeline_training.py": 194,
    "test_lora.py": 172,
    "test_mla_layouts.py": 142,
    "test_multiprocess.py": 100,
    "test_ragged_moe.py": 86,
    "test_gpu_program.py": 85,
    "test_resume.py": 85,
    "test_moe_training.py": 83,
    "test_convert.py": 81,
    "test_notebooks.py": 73,
    "test_deepseek_moe.py": 72,
    "test_pipeline.py": 71,
    "test_context_training.py": 68,
    "test_mesh_auto.py": 67,
    "test_ring_attention.py": 67,
    "test_gpu_check.py": 63,
    "test_pipeline_grid.py": 55,
    "test_faults.py": 53,
    "test_gpu_memory.py": 43,
    "test_layouts.py": 43,
    "test_fp8.py": 35,
    "test_mtp.py": 34,
    "test_deepseek_v3.py": 28,
    "test_first_run.py": 24,
    "test_train.py": 22,
    "test_dense_prefix.py": 20,
    "test_entry_points.py": 20,
    "test_sample.py": 19,
    "test_any_mesh.py": 18,
    "test_compile_cache.py": 16,
    "test_chat.py": 14,
    "test_loss.py": 14,
    "test_plan.py": 14,
    "test_ruler.py": 12,
    "test_slot_buckets.py": 11,
    "test_wandb.py": 10,
    "test_prepare.py": 9,
    "test_seam.py": 9,
    "test_export_tokenizer.py": 8,
    "test_bench.py": 7,
    "test_experts.py": 7,
    "test_memory.py": 6,
    "test_checkpoint.py": 4,
    "test_hlo.py": 4,
    "test_integrity.py": 4,
    "test_model.py": 4,
    "test_config.py": 3,
    "test_attention.py": 2,
    "test_eval.py": 2,
    "test_hf_failsafe.py": 2,
    "test_hub.py": 2,
    "test_moe_bf16.py": 2,
    "test_plan_failsafe.py": 2,
    "test_data.py": 1,
    "test_chat_failsafe.py": 0,
    "test_chat_task.py": 0,
    "test_dense_layers.py": 50,  # new since that run: measured alone
    "test_latent_ring.py": 50,  # new since that run: measured alone
    "test_suite_costs.py": 5,  # new: measured alone
    "test_docs.py": 0,
    "test_house.py": 0,
    "test_maxtext_compare.py": 0,
    "test_mixture.py": 0,
    "test_plan_deepseek.py": 0,
}


def pytest_configure(config):
    if hasattr(config.option, "loadscopereorder"):  # xdist installed
        config.option.loadscopereorder = False  # keep the order set below


# Python's cyclic garbage collector, in a test process: a collection of the oldest generation
# walks every object alive, and a test process holds millions (jax, flax, the collected tests,
# compiled programs), while tracing and lowering make new containers by the million. Collected
# once the imports and the collection are done, the objects alive then are frozen out of every
# later walk, and the youngest generation is collected after 20,000 new container objects (net of
# those freed) instead of 700.
# tests/test_lora.py spent 3.6 s of its 97 CPU-s in 2,544 collections under the defaults, 1.0 s in
# 439 with these (jax 0.12.0.1, Python 3.12). Garbage is still collected, later: cycles that hold
# arrays live a little longer (that file's process peaked at 1.4 GB).
GC_THRESHOLDS = (20_000, 20, 10)


def pytest_collection_finish(session):
    gc.collect()
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)


def pytest_collection_modifyitems(config, items):
    unknown = max(FILE_SECONDS.values()) + 1
    # A stable sort: each file's tests stay together and in their order.
    items.sort(key=lambda item: -FILE_SECONDS.get(item.path.name, unknown))
