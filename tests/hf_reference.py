"""The `transformers` side of tests/test_convert.py. It runs in the sidecar environment
`.venv-hf` (CPU torch + transformers, `make .venv-hf`), never in jaxpar's own: jaxpar's venv has no
torch, and PyPI's Linux torch for its Python needs the CUDA libraries.

    .venv-hf/bin/python tests/hf_reference.py build OUT_DIR
        Builds every tiny model of VARIANTS with transformers itself (random weights, no
        download), saves each with save_pretrained into OUT_DIR/<variant> (in the variant's
        dtype, with a tokenizer.json), and writes OUT_DIR/reference.npz: for each variant the
        float32 logits of the weights as saved on TOKENS (`<variant>/logits`), the 20 tokens
        greedy `generate` adds to PROMPT (`<variant>/greedy`) and the smallest gap between the
        best and the second-best logit over those steps (`<variant>/margin`).
    .venv-hf/bin/python tests/hf_reference.py logits OUT.npz NAME=DIR ...
        Loads each directory with AutoModelForCausalLM (as a user would: the class comes from
        its config.json) and writes its float32 logits on TOKENS to OUT.npz under NAME.
    .venv-hf/bin/python tests/hf_reference.py train OUT.npz NAME=DIR ...
        Loads each directory in float32 and takes TRAIN_STEPS steps of torch.optim.AdamW (ADAMW,
        no clipping) on TRAIN_BATCHES, the loss transformers' causal LM loss with labels = the
        inputs; writes to OUT.npz each step's loss before its update (`<NAME>/losses`) and the
        global norm of its gradient (`<NAME>/grad_norms`), the losses with weight decay on every
        parameter (`<NAME>/losses_decay_all`), and ADAMW (`adamw/<key>`) and TRAIN_BATCHES
        (`batches`) for the jaxpar side to read.
    .venv-hf/bin/python tests/hf_reference.py peft OUT.npz NAME=BASE_DIR,ADAPTER_DIR ...
        Loads each BASE_DIR with AutoModelForCausalLM in float32, puts the PEFT adapter in
        ADAPTER_DIR (a jaxpar `to-hf --adapter-only` export) on it with peft's
        PeftModel.from_pretrained, and writes its float32 logits on TOKENS to OUT.npz under
        `<NAME>/logits` (and the base's alone under `<NAME>/base_logits`).
    .venv-hf/bin/python tests/hf_reference.py tokenizer DIR CASES.json OUT.json
        Loads DIR (a jaxpar export) with AutoTokenizer and AutoModelForCausalLM and writes to
        OUT.json what they give on CASES.json (see `tokenizer` below).
    .venv-hf/bin/python tests/hf_reference.py chat CASES.json OUT_DIR
        For each chat template of CASES.json, saves a tokenizer carrying it into OUT_DIR/<name>
        (save_pretrained, as transformers writes one), loads it back with AutoTokenizer and writes
        to OUT_DIR/rendered.json what apply_chat_template(tokenize=False) renders (see `chat`).

Every norm weight and bias is drawn at random too (transformers starts them at 1 and 0), so a
swapped norm or a missing bias changes the logits.
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np

# The sidecar's interpreter, as `make .venv-hf` builds it at the repository root.
HF_PYTHON = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), ".venv-hf", "bin", "python"
)


def require_sidecar(why: str) -> None:
    """In a test: skip with `why` when there is no .venv-hf; fail instead under
    JAXPAR_TESTS_REQUIRE_HF=1 (CI), which must run the transformers checks."""
    import pytest

    if os.path.exists(HF_PYTHON):
        return
    if os.environ.get("JAXPAR_TESTS_REQUIRE_HF") == "1":
        pytest.fail(f"no .venv-hf (make .venv-hf builds it): {why}, and JAXPAR_TESTS_REQUIRE_HF=1")
    pytest.skip(f"no .venv-hf (make .venv-hf builds it): {why}")


VOCAB = 320  # the tokenizer's 256 bytes, merges and special tokens fit; even (mesh.tensor = 2)
SEED = 0
BATCH, SEQ = 2, 24
TOKENS = np.random.default_rng(1).integers(0, VOCAB, (BATCH, SEQ)).astype(np.int64)
PROMPT = [int(t) for t in TOKENS[0, :6]]
NEW_TOKENS = 20
# `train`: TRAIN_STEPS batches of TRAIN_ROWS rows of SEQ + 1 ids (inputs, and the next-token
# targets), four rows for a mesh's four batch shards. The ids come from the first fifth of the
# vocabulary, which the models learn to predict: ten steps at this constant learning rate lower the
# loss by over half a nat. With ids from the whole vocabulary, a token seen in one batch only left
# entries of its embedding's gradient near zero, where Adam's update (about lr times the sign)
# turns on float32 rounding: Mixtral at lr 1e-2 ended 1e-3 from torch on the mesh (7e-6 on one
# device). Id 0 becomes 1: 0 is Gemma 3's pad_token_id, and torch's nn.Embedding(padding_idx)
# gives that row no gradient from the lookup, where jaxpar trains every row.
TRAIN_STEPS, TRAIN_ROWS = 10, 4
TRAIN_BATCHES = np.maximum(
    np.random.default_rng(2).integers(0, VOCAB // 5, (TRAIN_STEPS, TRAIN_ROWS, SEQ + 1)), 1
)
ADAMW = dict(lr=5e-3, b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1)
COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=128,
    rms_norm_eps=1e-5,
    initializer_range=0.3,
)  # large weights: peaked logits, greedy choices far from ties

# name -> (transformers config class, its settings, saved dtype, eos token, max shard size)
VARIANTS = {
    # Llama 3.2 style: GQA, tied head, non-default theta, llama3 rope scaling whose band edges
    # (original_max_len 32 / 4 and / 1) fall inside the head's wavelengths; saved in bfloat16.
    "llama3-tied-scaled": (
        "LlamaConfig",
        dict(
            num_key_value_heads=2,
            tie_word_embeddings=True,
            rope_parameters=dict(
                rope_type="llama3",
                rope_theta=500000.0,
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=32,
            ),
        ),
        "bfloat16",
        "<|endoftext|>",
        None,
    ),
    # Llama 2 / TinyLlama style: untied head, GQA, default theta, "</s>" ends documents (named
    # by tokenizer_config.json), sharded safetensors with an index; float32.
    "llama2-gqa-sharded": (
        "LlamaConfig",
        dict(num_key_value_heads=2, tie_word_embeddings=False),
        "float32",
        "</s>",
        60_000,
    ),
    # Mistral: multi-head (kv heads = heads), theta 1e6, no sliding window; float16.
    "mistral": (
        "MistralConfig",
        dict(
            num_key_value_heads=4,
            sliding_window=None,
            rope_parameters=dict(rope_type="default", rope_theta=1e6),
            tie_word_embeddings=False,
        ),
        "float16",
        "<|endoftext|>",
        None,
    ),
    # Qwen2: q/k/v biases, tied head, GQA, theta 1e6; float32.
    "qwen2-bias-tied": (
        "Qwen2Config",
        dict(
            num_key_value_heads=2,
            tie_word_embeddings=True,
            rope_parameters=dict(rope_type="default", rope_theta=1e6),
        ),
        "float32",
        "<|endoftext|>",
        None,
    ),
    # Qwen3: per-head q/k norms, heads wider than hidden_size / heads (24 > 16), GQA; float32.
    "qwen3-wide-heads": (
        "Qwen3Config",
        dict(num_key_value_heads=2, head_dim=24, tie_word_embeddings=False),
        "float32",
        "<|endoftext|>",
        None,
    ),
    # Mixtral: 4 experts, top-2, GQA, theta 1e6; one safetensors tensor per expert; float32.
    "mixtral": (
        "MixtralConfig",
        dict(num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, sliding_window=None),
        "float32",
        "<|endoftext|>",
        None,
    ),
    # Qwen3-MoE: a dense layer then an MoE layer (decoder_sparse_step 2), experts narrower than
    # the dense MLP, norm_topk_prob, heads narrower than hidden_size / heads (12 < 16); float32.
    "qwen3-moe": (
        "Qwen3MoeConfig",
        dict(
            num_key_value_heads=2,
            head_dim=12,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=40,
            decoder_sparse_step=2,
            norm_topk_prob=True,
            tie_word_embeddings=False,
        ),
        "float32",
        "<|endoftext|>",
        None,
    ),
    # Qwen3-MoE with mlp_only_layers [0]: a dense layer (intermediate_size) before an MoE one
    # (decoder_sparse_step 1), jaxpar's model.moe.first_dense = 1; float32. Only
    # tests/test_convert.py's test_qwen3_moe_dense_prefix_* reads it.
    "qwen3-moe-dense-prefix": (
        "Qwen3MoeConfig",
        dict(
            num_key_value_heads=2,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=40,
            decoder_sparse_step=1,
            mlp_only_layers=[0],
            norm_topk_prob=False,
            tie_word_embeddings=False,
        ),
        "float32",
        "<|endoftext|>",
        None,
    ),
    # Qwen3-MoE with dense layers between MoE ones: 6 layers, decoder_sparse_step 2 (experts in
    # layers 1, 3, 5) and mlp_only_layers [0, 3] (0 dense anyway, 3 taken from the experts): dense,
    # MoE, dense x 3, MoE, jaxpar's model.moe.dense_layers (an irregular model); float32. Only
    # tests/test_convert.py's test_qwen3_moe_dense_layers_* reads it.
    "qwen3-moe-dense-between": (
        "Qwen3MoeConfig",
        dict(
            num_hidden_layers=6,
            num_key_value_heads=2,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=40,
            decoder_sparse_step=2,
            mlp_only_layers=[0, 3],
            norm_topk_prob=False,
            tie_word_embeddings=False,
        ),
        "float32",
        "<|endoftext|>",
        None,
    ),
    # Gemma 3 (text): 4 layers, the third global and the others sliding over 6 positions (the
    # sequence is 24), heads wider than hidden / heads, a query scale of its own, linear rope
    # scaling on the global layer, tied embeddings; float32.
    "gemma3-windows": (
        "Gemma3TextConfig",
        dict(
            num_hidden_layers=4,
            num_key_value_heads=2,
            head_dim=24,
            query_pre_attn_scalar=20,
            sliding_window=6,
            layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
            rope_parameters={
                "full_attention": dict(rope_type="linear", factor=4.0, rope_theta=1e6),
                "sliding_attention": dict(rope_type="default", rope_theta=1e4),
            },
            tie_word_embeddings=True,
        ),
        "float32",
        "<|endoftext|>",
        None,
    ),
}
MODELS = {
    "LlamaConfig": "LlamaForCausalLM",
    "MistralConfig": "MistralForCausalLM",
    "Qwen2Config": "Qwen2ForCausalLM",
    "Qwen3Config": "Qwen3ForCausalLM",
    "MixtralConfig": "MixtralForCausalLM",
    "Qwen3MoeConfig": "Qwen3MoeForCausalLM",
    "Gemma3TextConfig": "Gemma3ForCausalLM",
}


def tensor_bytes(hf_dir) -> dict[str, tuple[str, tuple, bytes]]:
    """Each tensor of the checkpoint in `hf_dir`: (dtype, shape, its bytes as stored), for
    bit-identical round trips. Run by jaxpar's tests, not in the sidecar (it reads the files
    with jaxpar's own reader)."""
    from jaxpar.hf import hf_load

    out = {}
    for name, info in hf_load.checkpoint_tensors(str(hf_dir)).items():
        with open(info.file, "rb") as f:
            f.seek(info.offset)
            n = int(np.prod(info.shape, dtype=np.int64)) * hf_load._np_dtype(info.dtype).itemsize
            out[name] = (info.dtype, tuple(info.shape), f.read(n))
    return out


def make_tokenizer(eos: str):
    """A byte-level BPE tokenizer trained on a little text, with `eos` as its one special token."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=[eos],
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    text = ["the quick brown fox jumps over the lazy dog", "def main():\n    return 0\n"] * 50
    tok.train_from_iterator(text, trainer)
    assert tok.get_vocab_size() <= VOCAB
    return tok


def build(out: str) -> None:
    import torch
    import transformers

    torch.manual_seed(SEED)
    results = {}
    for name, (config_cls, settings, dtype, eos, shard) in VARIANTS.items():
        config = getattr(transformers, config_cls)(**{**COMMON, **settings})
        model = getattr(transformers, MODELS[config_cls])(config).eval()
        # Norm scales near 1: Gemma stores scale - 1, so its weights are drawn near 0.
        unit = 0.0 if config.model_type.startswith("gemma") else 1.0
        with torch.no_grad():
            for pname, p in model.named_parameters():
                if "norm" in pname:
                    p.copy_(unit + 0.2 * torch.randn_like(p))
                elif pname.endswith(".bias"):
                    p.copy_(0.3 * torch.randn_like(p))
        where = os.path.join(out, name)
        model.to(getattr(torch, dtype)).save_pretrained(where, **({"max_shard_size": shard} if shard else {}))
        make_tokenizer(eos).save(os.path.join(where, "tokenizer.json"))
        if eos != "<|endoftext|>":
            with open(os.path.join(where, "tokenizer_config.json"), "w") as f:
                json.dump({"eos_token": eos}, f)
        # The reference is the saved weights in float32 (what jaxpar reads, upcast).
        model = transformers.AutoModelForCausalLM.from_pretrained(where, dtype=torch.float32).eval()
        with torch.no_grad():
            moe = hasattr(config, "num_experts_per_tok")
            output = model(torch.tensor(TOKENS), **({"output_router_logits": True} if moe else {}))
            results[f"{name}/logits"] = output.logits.float().numpy()
            if moe:  # each MoE layer's (token, choice) pairs per expert, as jaxpar's expert_load
                results[f"{name}/expert_load"] = expert_load(output.router_logits, config)
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
        scores = torch.stack(gen.scores)[:, 0].float()
        top2 = scores.topk(2, dim=-1).values
        results[f"{name}/greedy"] = gen.sequences[0, len(PROMPT) :].numpy()
        results[f"{name}/margin"] = np.float32((top2[:, 0] - top2[:, 1]).min())
    np.savez(os.path.join(out, "reference.npz"), tokens=TOKENS, prompt=np.array(PROMPT), **results)


def expert_load(router_logits, config) -> np.ndarray:
    """[MoE layers, experts] int32: how many (token, choice) pairs each layer's router sends to
    each expert (the top num_experts_per_tok of each token's logits)."""
    experts = router_logits[0].shape[-1]
    loads = []
    for layer_logits in router_logits:
        chosen = layer_logits.float().topk(config.num_experts_per_tok, dim=-1).indices.reshape(-1)
        loads.append(np.bincount(chosen.numpy(), minlength=experts))
    return np.stack(loads).astype(np.int32)


def logits(out: str, pairs: list[str]) -> None:
    import torch
    import transformers

    results = {}
    for pair in pairs:
        name, where = pair.split("=", 1)
        model = transformers.AutoModelForCausalLM.from_pretrained(where, dtype=torch.float32).eval()
        results[f"{name}/class"] = np.array(type(model).__name__)
        with torch.no_grad():
            results[f"{name}/logits"] = model(torch.tensor(TOKENS)).logits.float().numpy()
    np.savez(out, **results)


def peft_logits(out: str, pairs: list[str]) -> None:
    import peft
    import torch
    import transformers

    results = {}
    for pair in pairs:
        name, dirs = pair.split("=", 1)
        base_dir, adapter_dir = dirs.split(",")
        model = transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32).eval()
        with torch.no_grad():
            results[f"{name}/base_logits"] = model(torch.tensor(TOKENS)).logits.float().numpy()
        adapted = peft.PeftModel.from_pretrained(model, adapter_dir).eval()
        with torch.no_grad():
            results[f"{name}/logits"] = adapted(torch.tensor(TOKENS)).logits.float().numpy()
    np.savez(out, **results)


def train(out: str, pairs: list[str]) -> None:
    import torch
    import transformers

    results = {"batches": TRAIN_BATCHES, **{f"adamw/{k}": np.float64(v) for k, v in ADAMW.items()}}
    for pair in pairs:
        name, where = pair.split("=", 1)
        for decay_all in (False, True):
            model = transformers.AutoModelForCausalLM.from_pretrained(where, dtype=torch.float32).train()
            losses, norms = adamw_steps(model, decay_all)
            if decay_all:
                results[f"{name}/losses_decay_all"] = losses
            else:
                results[f"{name}/losses"], results[f"{name}/grad_norms"] = losses, norms
    np.savez(out, **results)


def adamw_steps(model, decay_all: bool) -> tuple[np.ndarray, np.ndarray]:
    """([TRAIN_STEPS] float64 each) each step's loss, before its update, and the global norm of
    the gradient the update applies (AdamW hides a gradient's scale). Weight decay on every
    parameter whose name has no "norm" (jaxpar.training.optim's mask), or with `decay_all` on every one
    (torch's AdamW on model.parameters()). named_parameters() gives a tied embedding once."""
    import torch

    decay, keep = [], []
    for pname, p in model.named_parameters():
        (keep if "norm" in pname and not decay_all else decay).append(p)
    groups = [{"params": decay}, {"params": keep, "weight_decay": 0.0}]
    a = ADAMW
    opt = torch.optim.AdamW(
        groups, lr=a["lr"], betas=(a["b1"], a["b2"]), eps=a["eps"], weight_decay=a["weight_decay"]
    )
    losses, norms = [], []
    for ids in torch.tensor(TRAIN_BATCHES):
        # labels = inputs: transformers shifts them, the mean cross-entropy of the next tokens.
        loss = model(input_ids=ids, labels=ids, output_router_logits=False).loss
        opt.zero_grad()
        loss.backward()
        norms.append(torch.stack([p.grad.norm() for p in model.parameters()]).norm().item())
        opt.step()
        losses.append(loss.item())
    return np.array(losses), np.array(norms)


def tokenizer(where: str, cases_path: str, out: str) -> None:
    """CASES.json: {"texts": [str], "ids": [[int]], "logits_text": str}. OUT.json: each text's
    input_ids (`encoded`) and those decoded (`decoded_texts`), each id list decoded with
    skip_special_tokens (`decoded_ids`), the tokenizer's and the model config's eos_token_id,
    the model's class and its float32 logits [seq, vocab] on the ids of logits_text."""
    import torch
    import transformers

    with open(cases_path) as f:
        cases = json.load(f)
    tok = transformers.AutoTokenizer.from_pretrained(where)
    model = transformers.AutoModelForCausalLM.from_pretrained(where, dtype=torch.float32).eval()
    encoded = [tok(text)["input_ids"] for text in cases["texts"]]
    with torch.no_grad():
        ids = tok(cases["logits_text"], return_tensors="pt")["input_ids"]
        logits = model(ids).logits[0].float().numpy()
    result = {
        "encoded": encoded,
        "decoded_texts": [tok.decode(ids) for ids in encoded],
        "decoded_ids": [tok.decode(ids, skip_special_tokens=True) for ids in cases["ids"]],
        "eos_token_id": tok.eos_token_id,
        "model_eos_token_id": model.config.eos_token_id,
        "model_class": type(model).__name__,
        "logits": logits.tolist(),
    }
    with open(out, "w") as f:
        json.dump(result, f)


def chat(cases_path: str, out: str) -> None:
    """CASES.json: {"templates": {name: {"source": jinja, "special": {bos_token: ...}}},
    "cases": [{"messages": [...], "add_generation_prompt": bool, "variables": {...}}]}.
    OUT_DIR/rendered.json: {name: [the rendering of each case]}, and for a template with
    `{% generation %}` blocks {name/assistant: [the text of the tokens transformers'
    return_assistant_tokens_mask marks, per case]}; OUT_DIR/<name> the saved tokenizer
    (tokenizer.json, tokenizer_config.json, chat_template.jinja)."""
    import transformers

    with open(cases_path) as f:
        cases = json.load(f)
    rendered = {}
    for name, template in cases["templates"].items():
        where = os.path.join(out, name)
        tok = transformers.PreTrainedTokenizerFast(
            tokenizer_object=make_tokenizer("<|endoftext|>"), **template["special"]
        )
        tok.chat_template = template["source"]
        tok.save_pretrained(where)
        tok = transformers.AutoTokenizer.from_pretrained(where)
        rendered[name] = [
            tok.apply_chat_template(
                case["messages"],
                tokenize=False,
                add_generation_prompt=case["add_generation_prompt"],
                **case["variables"],
            )
            for case in cases["cases"]
        ]
        if "{% generation %}" in template["source"]:  # the tokens return_assistant_tokens_mask marks
            for case in cases["cases"]:
                encoded = tok.apply_chat_template(
                    case["messages"], return_dict=True, return_assistant_tokens_mask=True, **case["variables"]
                )
                marked = [i for i, m in zip(encoded["input_ids"], encoded["assistant_masks"]) if m]
                rendered.setdefault(f"{name}/assistant", []).append(tok.decode(marked))
    with open(os.path.join(out, "rendered.json"), "w") as f:
        json.dump(rendered, f)


if __name__ == "__main__":
    command, *args = sys.argv[1:]
    {
        "build": lambda: build(args[0]),
        "logits": lambda: logits(args[0], args[1:]),
        "train": lambda: train(args[0], args[1:]),
        "peft": lambda: peft_logits(args[0], args[1:]),
        "tokenizer": lambda: tokenizer(*args),
        "chat": lambda: chat(*args),
    }[command]()
