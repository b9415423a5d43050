"""The layouts `benchmarks/plan_memory.py` compiles, and the model they share (also used by
tests/test_plan.py for its handful): a small bfloat16 Llama-shape model on 8 devices."""

from __future__ import annotations

# vocab 2048, d_model 256, 4 layers, 8 heads (4 KV), SwiGLU 768: 4.2 M parameters; batch 16 x 256.
MODEL = [
    "model.vocab_size=2048",
    "model.d_model=256",
    "model.n_layers=4",
    "model.n_heads=8",
    "model.n_kv_heads=4",
    "model.d_ff=768",
    "model.max_seq_len=256",
    "model.dtype=bfloat16",
    "train.batch_size=16",
    "train.seq_len=256",
]
# The same with an MoE MLP in every second block: 4 experts, top-2, capacity factor 1.25, in
# float32: in bfloat16 the expert-parallel step aborts XLA:CPU's compiler ("Invalid binary
# instruction opcode copy", jax 0.12.0.1, the AllReducePromotion crash noted in the pipeline).
MOE = [
    "model.moe.num_experts=4",
    "model.moe.top_k=2",
    "model.moe.every=2",
    "model.moe.capacity_factor=1.25",
    "model.dtype=float32",
]


def layout(name, mesh, *settings, moe=False):
    return {"name": name, "mesh": mesh, "overrides": list(settings) + (MOE if moe else [])}


LAYOUTS = [
    layout("data8-z0", {"data": 8}, "parallel.zero_stage=0"),
    layout("data8-z0-dots", {"data": 8}, "parallel.zero_stage=0", "parallel.remat=dots"),
    layout("data8-z0-full", {"data": 8}, "parallel.zero_stage=0", "parallel.remat=full"),
    layout("fsdp8-z1", {"fsdp": 8}, "parallel.zero_stage=1"),
    layout("fsdp8-z2", {"fsdp": 8}, "parallel.zero_stage=2"),
    layout("fsdp8-z3", {"fsdp": 8}, "parallel.zero_stage=3"),
    layout("fsdp8-z3-full", {"fsdp": 8}, "parallel.zero_stage=3", "parallel.remat=full"),
    layout("d2-f2-t2-z3", {"data": 2, "fsdp": 2, "tensor": 2}, "parallel.zero_stage=3"),
    layout(
        "d2-f2-t2-z3-dots-sp",
        {"data": 2, "fsdp": 2, "tensor": 2},
        "parallel.zero_stage=3",
        "parallel.remat=dots",
        "parallel.sequence_parallel=true",
    ),
    layout("d2-t4-z0", {"data": 2, "tensor": 4}, "parallel.zero_stage=0"),
    layout("f2-t4-z3-full", {"fsdp": 2, "tensor": 4}, "parallel.zero_stage=3", "parallel.remat=full"),
    layout("d4-c2-z0", {"data": 4, "context": 2}, "parallel.zero_stage=0"),
    layout("f2-c4-z3-dots", {"fsdp": 2, "context": 4}, "parallel.zero_stage=3", "parallel.remat=dots"),
    layout("f2-c2-t2-z2", {"fsdp": 2, "context": 2, "tensor": 2}, "parallel.zero_stage=2"),
    layout(
        "p2-d4-1f1b",
        {"pipe": 2, "data": 4},
        "parallel.zero_stage=0",
        "parallel.pipeline_schedule=1f1b",
        "parallel.microbatches=4",
    ),
    layout(
        "p2-d4-gpipe",
        {"pipe": 2, "data": 4},
        "parallel.zero_stage=0",
        "parallel.pipeline_schedule=gpipe",
        "parallel.microbatches=4",
    ),
    layout(
        "p4-d2-1f1b-m8-full",
        {"pipe": 4, "data": 2},
        "parallel.zero_stage=0",
        "parallel.pipeline_schedule=1f1b",
        "parallel.microbatches=8",
        "parallel.remat=full",
    ),
    layout(
        "p2-f2-t2-interleaved-z3-dots",
        {"pipe": 2, "fsdp": 2, "tensor": 2},
        "parallel.zero_stage=3",
        "parallel.pipeline_schedule=interleaved",
        "parallel.virtual_stages=2",
        "parallel.microbatches=4",
        "parallel.remat=dots",
    ),
    layout(
        "p4-f2-gpipe-m8-z1-dots",
        {"pipe": 4, "fsdp": 2},
        "parallel.zero_stage=1",
        "parallel.pipeline_schedule=gpipe",
        "parallel.microbatches=8",
        "parallel.remat=dots",
    ),
    layout("data8-z1-accum2", {"data": 8}, "parallel.zero_stage=1", "parallel.grad_accum=2"),
    layout(
        "f4-d2-z2-accum2-full",
        {"data": 2, "fsdp": 4},
        "parallel.zero_stage=2",
        "parallel.grad_accum=2",
        "parallel.remat=full",
    ),
    layout("moe-e4-d2-z0", {"data": 2, "expert": 4}, "parallel.zero_stage=0", moe=True),
    layout(
        "moe-e2-f4-z3-dots",
        {"fsdp": 4, "expert": 2},
        "parallel.zero_stage=3",
        "parallel.remat=dots",
        moe=True,
    ),
    layout("moe-e4-t2-z1", {"expert": 4, "tensor": 2}, "parallel.zero_stage=1", moe=True),
    layout("single-z0", {"data": 1}, "parallel.zero_stage=0"),
]
