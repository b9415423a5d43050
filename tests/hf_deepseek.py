"""The `transformers` side of tests/test_deepseek_v3.py, run in the sidecar environment `.venv-hf`
(as tests/hf_reference.py is):

    .venv-hf/bin/python tests/hf_deepseek.py OUT_DIR
        Builds each tiny DeepseekV3ForCausalLM of VARIANTS from a config alone (random weights, no
        download), with every norm weight and every router correction bias drawn at random (a
        swapped norm or an ignored bias changes the logits), saves it in float32 with a tokenizer
        into OUT_DIR/<variant>, and writes OUT_DIR/reference.npz: its float32 logits on
        hf_reference.TOKENS, the tokens greedy `generate` (transformers' own latent cache) adds to
        hf_reference.PROMPT, and the smallest top-1 / top-2 logit gap over those steps.
"""

from __future__ import annotations

import os
import sys

import numpy as np
from hf_reference import NEW_TOKENS, PROMPT, SEED, TOKENS, VOCAB, make_tokenizer

COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=4,
    kv_lora_rank=16,
    qk_nope_head_dim=8,
    qk_rope_head_dim=8,
    v_head_dim=12,
    max_position_embeddings=64,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    num_mtp_layers=0,
    initializer_range=0.3,  # large weights: peaked logits, greedy choices far from ties
)
# YaRN over a context 4x its original 16: the correction band falls inside the rotated width,
# and the two mscale keys differ, so the rotated parts are scaled (1.0277 / 1.0416) and so are the
# logits (1.0416^2).
YARN = dict(
    rope_type="yarn",
    rope_theta=10000.0,
    factor=4.0,
    original_max_position_embeddings=16,
    beta_fast=8.0,
    beta_slow=1.0,
    mscale=0.2,
    mscale_all_dim=0.3,
)
MOE = dict(
    first_k_dense_replace=0,
    n_routed_experts=8,
    n_group=2,
    topk_group=1,
    num_experts_per_tok=2,
    n_shared_experts=1,
    moe_intermediate_size=32,
    routed_scaling_factor=2.5,
    norm_topk_prob=True,
)
VARIANTS = {
    # A query latent, YaRN with both mscale keys, interleaved rotary pairs; all layers dense.
    "dsv3-dense-qlora-yarn": dict(
        q_lora_rank=24, rope_parameters=YARN, rope_interleave=True, first_k_dense_replace=2
    ),
    # One query projection (q_lora_rank null), plain rotary, rotary pairs as Llama's.
    "dsv3-dense-plain": dict(
        q_lora_rank=None,
        rope_parameters=dict(rope_type="default", rope_theta=10000.0),
        rope_interleave=False,
        first_k_dense_replace=2,
    ),
    # Every layer MoE: 8 experts in 2 groups (the best 1 group kept), top-2, one shared expert;
    # YaRN with mscale alone (no logit scale, the rotated parts scaled by mscale(4)).
    "dsv3-moe": dict(
        q_lora_rank=24,
        rope_parameters={**{k: v for k, v in YARN.items() if k != "mscale_all_dim"}, "mscale": 1.0},
        rope_interleave=True,
        **MOE,
    ),
    # A dense layer (its MLP intermediate_size 96 wide) before an MoE one (experts 32 wide):
    # first_k_dense_replace 1, jaxpar's model.moe.first_dense; one query projection.
    "dsv3-moe-dense-prefix": dict(
        q_lora_rank=None,
        rope_parameters=dict(rope_type="default", rope_theta=10000.0),
        rope_interleave=True,
        **{**MOE, "first_k_dense_replace": 1},
    ),
}


def build(out: str) -> None:
    import torch
    import transformers

    torch.manual_seed(SEED)
    results = {}
    for name, settings in VARIANTS.items():
        config = transformers.DeepseekV3Config(**{**COMMON, **settings})
        model = transformers.DeepseekV3ForCausalLM(config).eval()
        with torch.no_grad():
            for pname, p in model.named_parameters():
                if "norm" in pname:
                    p.copy_(1.0 + 0.2 * torch.randn_like(p))
            for bname, b in model.named_buffers():
                if bname.endswith("e_score_correction_bias"):
                    b.copy_(0.3 * torch.randn_like(b))
        where = os.path.join(out, name)
        model.save_pretrained(where)
        make_tokenizer("<|endoftext|>").save(os.path.join(where, "tokenizer.json"))
        model = transformers.AutoModelForCausalLM.from_pretrained(where, dtype=torch.float32).eval()
        with torch.no_grad():
            results[f"{name}/logits"] = model(torch.tensor(TOKENS)).logits.float().numpy()
            gen = model.generate(
                torch.tensor([PROMPT]),
                max_new_tokens=NEW_TOKENS,
                min_new_tokens=NEW_TOKENS,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
                output_scores=True,
                return_dict_in_generate=True,
            )
        top2 = torch.stack(gen.scores)[:, 0].float().topk(2, dim=-1).values
        results[f"{name}/greedy"] = gen.sequences[0, len(PROMPT) :].numpy()
        results[f"{name}/margin"] = np.float32((top2[:, 0] - top2[:, 1]).min())
    np.savez(os.path.join(out, "reference.npz"), tokens=TOKENS, prompt=np.array(PROMPT), **results)


if __name__ == "__main__":
    build(sys.argv[1])
