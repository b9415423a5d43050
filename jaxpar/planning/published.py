"""Measured training throughputs the planner's step-time model is fitted to and checked against.

One home for every result the model is compared with: each entry names where it comes from
(project, document, table), the model's shape, the GPUs, the parallel layout, the sequence length,
the global batch and the measured throughput. `role` says what the entry is for: "fit" entries
are the ones `benchmarks/plan_fit.py` fits the model's constants to
(`jaxpar.planning.step_time.FITTED`: d_half, host_s_per_layer, exposed_fraction,
attention_backward) and from whose residuals the stated band comes
(`jaxpar.planning.step_time.STEP_TIME_BAND`); "check" entries were used for neither and must fall
inside the band (tests/test_plan.py). "outside" entries were used for neither either, were
compared like the checks, and fell outside the band: they are kept and reported, with the reason
in `note`, not asserted inside it (tests/test_plan.py asserts that they are still outside, so that
a change of the model that brings one in says so). No entry has two roles.

What is and is not the runs' own:
- every published run used a flash-attention kernel: they are predicted at cuDNN's measured rate
  (`kernel`), whatever jaxpar itself would run in that layout;
- shapes named by a release (Llama 3.1 8B and 405B) are the release's; Megatron-LM's README gives
  only parameter counts, so its shapes are Llama-style approximations made here (the same as
  benchmarks of this repository used before), and its remat and ZeRO stage are assumed;
- torchtitan's H100s were 96 GB HBM2e parts at 2.4 TB/s under a 500 W power limit, predicted here
  as the datasheet H100 SXM (989 TFLOP/s, 3.35 TB/s): part of what the band has to absorb;
- torchtitan's 8B tables do not restate the sequence length: 8192 is its Llama 3 default, and
  the throughputs give the 33-39% MFU the same page states only at that length;
- MaxText's runs are NVIDIA's (JAX-Toolbox's MaxText page, and the DGX Cloud benchmarking
  recipes' MaxText Llama 70B pages with their launch scripts): MaxText's FSDP shards the
  parameters and Adam state (ZeRO-3 here), its float32 weights and bf16 compute are jaxpar's, and
  its remat policies are mapped to jaxpar's nearest (`note` says which).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from jaxpar.training.metrics import flops_per_token

JAXPAR_H100 = "measured on one H100 SXM by this project, 2026-11-22 (jax 0.11.2, 20 timed steps)"
JAXPAR_OWN = (
    "jaxpar's own train step on one H100 80GB HBM3, benchmarks/bench.py, 2026-11-27 (jax 0.11.2, "
    "median of 20 timed steps; benchmarks/results/*-h100.json)"
)
TORCHTITAN = "torchtitan benchmarks/llama3_h100_202412_torchtitan.md (docs/performance.md)"
MEGATRON = "Megatron-LM README, 'Performance Benchmarking' model table (H100, bf16, seq 4096)"
MAXTEXT_JT = "NVIDIA/JAX-Toolbox docs/frameworks/maxtext/README.md, 'Configs' / 'LLaMA' table"
MAXTEXT_DGXC = "NVIDIA/dgxc-benchmarking maxtext/README_70b.md ({}), BF16 table; maxtext/configure.sh"

# Shapes. B13 and GPT2 are the single-H100 runs' own; LLAMA31_*, LLAMA2_* and LLAMA3_70B the
# releases'; MEGATRON_* sized here to the README's parameter counts (vocabulary 131,072).
LLAMA_1B = dict(  # configs/llama-1b.yaml
    vocab_size=128256, d_model=2048, n_layers=16, n_heads=32, n_kv_heads=8, d_ff=8192, tie_embeddings=True
)
B13 = dict(
    vocab_size=50304, d_model=2048, n_layers=24, n_heads=16, n_kv_heads=16, d_ff=5464, tie_embeddings=True
)
GPT2 = dict(
    vocab_size=50304, d_model=768, n_layers=12, n_heads=12, n_kv_heads=12, d_ff=2048, tie_embeddings=True
)
LLAMA31_8B = dict(vocab_size=128256, d_model=4096, n_layers=32, n_heads=32, n_kv_heads=8, d_ff=14336)
LLAMA31_405B = dict(vocab_size=128256, d_model=16384, n_layers=126, n_heads=128, n_kv_heads=8, d_ff=53248)
_MV = dict(vocab_size=131072)
MEGATRON_1_7B = dict(_MV, d_model=2048, n_layers=24, n_heads=16, n_kv_heads=8, d_ff=5632)
MEGATRON_7_1B = dict(_MV, d_model=4096, n_layers=32, n_heads=32, n_kv_heads=8, d_ff=12288)
MEGATRON_16B = dict(_MV, d_model=6144, n_layers=38, n_heads=48, n_kv_heads=8, d_ff=16384)
MEGATRON_70B = dict(_MV, d_model=8192, n_layers=80, n_heads=64, n_kv_heads=8, d_ff=28672)
LLAMA2_7B = dict(vocab_size=32000, d_model=4096, n_layers=32, n_heads=32, n_kv_heads=32, d_ff=11008)
LLAMA2_70B = dict(vocab_size=32000, d_model=8192, n_layers=80, n_heads=64, n_kv_heads=8, d_ff=28672)
LLAMA3_70B = dict(LLAMA2_70B, vocab_size=128256)


@dataclass(frozen=True)
class Result:
    name: str
    source: str  # project, document and table
    model: dict  # ModelConfig fields
    mesh: dict  # jaxpar mesh axes > 1 (data, fsdp, tensor, pipe); their product is the GPU count
    seq_len: int
    batch: int  # sequences per optimizer step, all GPUs together
    remat: str  # jaxpar's nearest policy: none | dots (selective) | full
    zero_stage: int
    role: str  # "fit" | "check" | "outside"
    tokens_per_s_per_gpu: float | None = None  # measured, or None where the source gives MFU
    mfu: float | None = None  # as published (its FLOP count: 6N + attention, like jaxpar's)
    pipeline: dict = field(default_factory=dict)  # microbatches, pipeline_schedule
    note: str = ""

    @property
    def gpus(self) -> int:
        n = 1
        for size in self.mesh.values():
            n *= size
        return n

    def measured_tokens_per_s(self) -> float:
        """Tokens/s per GPU: as measured, or from the published MFU with jaxpar's FLOP count
        (989.4 TFLOP/s H100 peak), so that predicted/measured is the same ratio either way."""
        if self.tokens_per_s_per_gpu is not None:
            return self.tokens_per_s_per_gpu
        return self.mfu * 989.4e12 / flops_per_token(_model(self.model, self.seq_len), self.seq_len)

    def overrides(self) -> list[str]:
        """`jaxpar.config` overrides that build this run's config (bfloat16 compute, float32
        parameters and Adam state, as jaxpar runs)."""
        out = [f"model.{k}={v}" for k, v in self.model.items()]
        out += [f"model.max_seq_len={self.seq_len}", f"train.seq_len={self.seq_len}"]
        out += [f"train.batch_size={self.batch}", f"parallel.remat={self.remat}"]
        out += [f"parallel.zero_stage={self.zero_stage}"]
        out += [f"parallel.{k}={v}" for k, v in self.pipeline.items()]
        return out + [f"mesh.{a}={n}" for a, n in self.mesh.items()]


def _model(fields: dict, seq_len: int):
    from jaxpar.config import ModelConfig

    return ModelConfig(**fields, max_seq_len=seq_len)


def _single(name, model, seq, batch, remat, step_s, role, source=JAXPAR_H100, note=""):
    return Result(name, source, model, {}, seq, batch, remat, 0, role, batch * seq / step_s, note=note)


PLAIN_JAX = "plain JAX (scan over layers, float32 params, bf16 compute, cuDNN attention, optax AdamW)"
NANOGPT = "nanoGPT model, PyTorch, torch.compile, bf16 autocast, fused AdamW"

RESULTS = [
    # --- fitted -----------------------------------------------------------------------------
    _single("jax 1.3B b8 dots", B13, 2048, 8, "dots", 0.304, "fit", note=PLAIN_JAX),
    _single("jax 1.3B b4 none", B13, 2048, 4, "none", 0.197, "fit", note=PLAIN_JAX),
    _single("jax 124M b12", GPT2, 1024, 12, "none", 0.0406, "fit", note=PLAIN_JAX),
    _single("jax 124M b32", GPT2, 1024, 32, "none", 0.1004, "fit", note=PLAIN_JAX),
    Result(
        "Megatron 1.7B, 48 GPUs",
        MEGATRON,
        MEGATRON_1_7B,
        {"fsdp": 48},
        4096,
        192,
        "none",
        1,
        "fit",
        mfu=0.41,
        note="TP1 PP1; distributed optimizer = ZeRO-1; no recompute assumed",
    ),
    Result(
        "Megatron 16B, 192 GPUs",
        MEGATRON,
        MEGATRON_16B,
        {"fsdp": 48, "tensor": 4},
        4096,
        192,
        "none",
        1,
        "fit",
        mfu=0.49,
        note="TP4 PP1; batch 192 assumed; ZeRO-1, no recompute assumed",
    ),
    Result(
        "torchtitan 8B, 8 GPUs, eager",
        TORCHTITAN + ", Table 1",
        LLAMA31_8B,
        {"fsdp": 8},
        8192,
        16,
        "dots",
        3,
        "fit",
        tokens_per_s_per_gpu=5762,
        note="FSDP2, local batch 2, selective AC",
    ),
    Result(
        "torchtitan 8B, 8 GPUs, compiled",
        TORCHTITAN + ", Table 1",
        LLAMA31_8B,
        {"fsdp": 8},
        8192,
        16,
        "dots",
        3,
        "fit",
        tokens_per_s_per_gpu=6667,
        note="FSDP2 + torch.compile, local batch 2, selective AC",
    ),
    # --- checked (never fitted) ---------------------------------------------------------------
    # jaxpar itself, the presets as committed (cuDNN packed attention with 32 document slots,
    # the chunked loss), measured after the model's constants were fitted.
    _single(
        "jaxpar 124M b12", GPT2, 1024, 12, "none", 0.05309, "check", JAXPAR_OWN, "configs/gpt2-124m.yaml"
    ),
    _single(
        "jaxpar 124M b32", GPT2, 1024, 32, "none", 0.12164, "check", JAXPAR_OWN, "configs/gpt2-124m.yaml"
    ),
    _single(
        "jaxpar 1B b8 dots", LLAMA_1B, 2048, 8, "dots", 0.34766, "check", JAXPAR_OWN, "configs/llama-1b.yaml"
    ),
    _single("jax 1.3B b4 dots", B13, 2048, 4, "dots", 0.164, "check", note=PLAIN_JAX),
    _single("nanoGPT 1.3B b4", B13, 2048, 4, "none", 0.146, "check", note=NANOGPT),
    Result(
        "torchtitan 8B, 128 GPUs, eager",
        TORCHTITAN + ", Table 3",
        LLAMA31_8B,
        {"fsdp": 128},
        8192,
        256,
        "dots",
        3,
        "check",
        tokens_per_s_per_gpu=5605,
        note="FSDP2, local batch 2, selective AC",
    ),
    Result(
        "torchtitan 8B, 128 GPUs, compiled",
        TORCHTITAN + ", Table 3",
        LLAMA31_8B,
        {"fsdp": 128},
        8192,
        256,
        "dots",
        3,
        "check",
        tokens_per_s_per_gpu=6514,
        note="FSDP2 + torch.compile, local batch 2",
    ),
    Result(
        "torchtitan 405B, 128 GPUs",
        "torchtitan docs/performance.md (2024), Llama 3.1 table",
        LLAMA31_405B,
        {"fsdp": 16, "tensor": 8},
        8192,
        32,
        "full",
        3,
        "check",
        tokens_per_s_per_gpu=109,
        note="FSDP 16 x TP 8 (128 / 16), local batch 2, full AC, bf16, on 94 GB H100s; published MFU "
        "29.0%; seq 8192 assumed (torchtitan's Llama 3 default)",
    ),
    Result(
        "Megatron 7.1B, 96 GPUs",
        MEGATRON,
        MEGATRON_7_1B,
        {"fsdp": 48, "tensor": 2},
        4096,
        192,
        "none",
        1,
        "check",
        mfu=0.47,
        note="TP2 PP1; batch 192 assumed; ZeRO-1, no recompute assumed",
    ),
    Result(
        "Megatron 70B, 768 GPUs",
        MEGATRON,
        MEGATRON_70B,
        {"pipe": 2, "fsdp": 48, "tensor": 8},
        4096,
        384,
        "dots",
        1,
        "check",
        mfu=0.42,
        pipeline={"microbatches": 8, "pipeline_schedule": "1f1b"},
        note="TP8 PP2, batch 384 as published; 8 microbatches, ZeRO-1, selective recompute assumed",
    ),
    Result(
        "MaxText Llama2 7B, 8 GPUs",
        MAXTEXT_JT,
        LLAMA2_7B,
        {"fsdp": 8},
        4096,
        16,
        "dots",
        3,
        "check",
        tokens_per_s_per_gpu=16 * 4096 / 0.721 / 8,
        note="H100 80G SXM, BF16, FSDP 8, 2 a GPU, flash (cuDNN via Transformer Engine), remat "
        "minimal_flash (the dots kept, as jaxpar's dots), scan off; step 0.721 s (22.19 sequences/s)",
    ),
    Result(
        "MaxText Llama3 70B, 128 GPUs",
        MAXTEXT_DGXC.format("v25.02 and v25.04"),
        LLAMA3_70B,
        {"fsdp": 128},
        8192,
        256,
        "full",
        3,
        "check",
        tokens_per_s_per_gpu=256 * 8192 / 15.563 / 128,
        note="FSDP 128 (16 nodes x 8), 2 a GPU, cuDNN flash; remat_policy save_qkv_proj (only the "
        "q, k, v projections kept: nearest jaxpar's full); step 15.563 s, published MFU 51.20%",
    ),
    Result(
        "MaxText Llama2 70B, 64 GPUs",
        MAXTEXT_DGXC.format("v24.11.1 and v25.01"),
        LLAMA2_70B,
        {"fsdp": 64},
        4096,
        128,
        "dots",
        3,
        "outside",
        tokens_per_s_per_gpu=128 * 4096 / 6.999 / 64,
        note="FSDP 64 (8 nodes x 8), 2 a GPU, cuDNN flash; remat custom (the q, k, v, out and MLP "
        "output projections kept: jaxpar's dots); step 6.999 s, published MFU 52.59%. Predicted "
        "1.94x slow, outside the band: the model charges 13.6 s of cross-node FSDP collectives "
        "for it (7.3 s exposed), where the run's whole step took 7.0 s",
    ),
]


def fitted() -> list[Result]:
    return [r for r in RESULTS if r.role == "fit"]


def checked() -> list[Result]:
    return [r for r in RESULTS if r.role == "check"]


def outside() -> list[Result]:
    return [r for r in RESULTS if r.role == "outside"]
