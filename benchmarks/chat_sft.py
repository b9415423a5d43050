"""`python -m benchmarks.chat_sft [--steps N] [--train-on assistant all] [overrides ...]`: a tiny
model fine-tuned on a generated conversation task (benchmarks/chat_task.py: reverse a word, add
two numbers, in the style the system prompt asks for, over several turns), then asked held-out
questions; the figure is the share answered exactly right.

Everything goes through the commands a user runs: `python -m jaxpar.data prepare` writes the
conversations into shards with jaxpar's `simple` chat template and the byte tokenizer, then
`python -m jaxpar.train configs/sft.yaml` trains a model from scratch (the MODEL overrides below,
on one device) once per `data.train_on` value, each in its own process. The held-out check calls
`jaxpar.sample.chat_reply`, what `python -m jaxpar.sample RUN --messages FILE` prints, greedily,
in this process (one compile per prompt length instead of one process per question); one
question also goes through that command line, and must agree. Prints one JSON object and writes
it to benchmarks/results/chat_sft.json: per run, the accuracy on every kind of question, a few
answers, the final loss and the wall time.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks import chat_task

ROOT = Path(__file__).resolve().parent.parent
# The model trained from scratch: the default job's shape in float32 (XLA:CPU runs bfloat16
# matmuls slower), on one device, with a from-scratch learning rate (configs/sft.yaml's is for
# moving pre-trained weights).
MODEL = [
    "model.vocab_size=264",
    "model.d_model=128",
    "model.n_layers=4",
    "model.n_heads=4",
    "model.n_kv_heads=2",
    "model.d_ff=384",
    "model.max_seq_len=512",
    "model.dtype=float32",
    "mesh.data=1",
    "mesh.fsdp=1",
    "mesh.tensor=1",
    "runtime.cpu_devices=1",
    "parallel.zero_stage=0",
    "parallel.remat=none",
    "train.batch_size=16",
    "train.seq_len=512",
    "optimizer.lr=1e-3",
    "optimizer.warmup_steps=50",
    "optimizer.weight_decay=0.1",
]


def run(*args: str) -> None:
    subprocess.run([sys.executable, "-m", *args], cwd=ROOT, check=True)


def prepare(tmp: str, conversations: int) -> str:
    source, out = os.path.join(tmp, "train.jsonl"), os.path.join(tmp, "shards")
    chat_task.write_jsonl(source, chat_task.conversations(conversations, "train", seed=0))
    run("jaxpar.data", "prepare", source, "--chat-template", "simple", "--out", out)
    return out


def train(run_dir: str, shards: str, train_on: str, steps: int, every: int, overrides: list[str]) -> dict:
    start = time.time()
    run(
        "jaxpar.train",
        "configs/sft.yaml",
        *MODEL,
        f"data.source={shards}",
        f"data.train_on={train_on}",
        f"train.steps={steps}",
        f"checkpoint.every={every}",
        f"checkpoint.keep={steps // every + 1}",
        f"train.run_dir={run_dir}",
        "train.progress=false",
        *overrides,
    )
    rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    losses = [r["loss"] for r in rows if "loss" in r]
    return {"wall_s": round(time.time() - start, 1), "final_loss": losses[-1]}


def kind(question: str) -> str:
    return question.split(" ")[0].rstrip(":")  # reverse | add | the (first word again)


def load(run_dir: str, step: int):
    """The model of the checkpoint of `step`, the run's tokenizer and chat template."""
    from jaxpar.corpus import data as data_lib
    from jaxpar.corpus.documents import make_tokenizer
    from jaxpar.sample import load_model

    cfg, model, _ = load_model(run_dir, step)
    return model, make_tokenizer(cfg.data), data_lib.run_template(run_dir, cfg.data)


def evaluate(run_dir: str, held_out: list, step: int) -> dict:
    """Greedy replies (`chat_reply`) to the held-out questions from the checkpoint of `step`:
    accuracy overall and per kind of question, the first few answers, and whether the one-pass
    check (`forced_replies`) agrees with every reply."""
    from jaxpar.sample import chat_reply

    model, tokenizer, template = load(run_dir, step)
    forced = forced_replies(model, tokenizer, template, held_out)
    right, examples = [], []
    for messages, want in chat_task.questions(held_out):
        got = chat_reply(model, tokenizer, template, messages, max_tokens=16)
        right.append(got == want)
        if len(examples) < 6:
            examples.append({"question": messages[-1]["content"], "want": want, "got": got})
    return {
        **score(held_out, right),
        "examples": examples,
        "one_pass_check_agrees": f"{sum(a == b for a, b in zip(forced, right))}/{len(forced)}",
    }


def score(held_out: list, right: list[bool]) -> dict:
    """The share of held-out questions answered right (`right`, one per question), overall and
    per kind of question."""
    hits, total = {}, {}
    for (messages, _), ok in zip(chat_task.questions(held_out), right):
        k = kind(messages[-1]["content"])
        total[k] = total.get(k, 0) + 1
        hits[k] = hits.get(k, 0) + ok
    return {
        "accuracy": round(sum(right) / len(right), 4),
        "by_kind": {k: f"{hits[k]}/{total[k]}" for k in sorted(total)},
    }


def forced_accuracy(run_dir: str, held_out: list, step: int) -> dict:
    """The held-out accuracy of the checkpoint of `step` by the one-pass check alone, overall and
    per kind of question."""
    return score(held_out, forced_replies(*load(run_dir, step), held_out))


def forced_replies(model, tokenizer, template, held_out: list) -> list[bool]:
    """For each held-out question, whether greedy decoding answers it exactly, read off one
    teacher-forced forward pass: greedy decoding writes `want` followed by the end-of-turn marker
    exactly when, along that text, every next token is the model's argmax (over the tokenizer's
    vocabulary, as `chat_reply` restricts it). One compiled call for every question, where
    `evaluate` compiles `chat_reply` once per prompt length; the two are compared at the end."""
    import jax.numpy as jnp
    import numpy as np

    prompts, answers = [], []
    for messages, want in chat_task.questions(held_out):
        prompt = template.render(messages, add_generation_prompt=True)
        prompts.append(tokenizer.encode_plain([prompt])[0])
        answers.append(tokenizer.encode_plain([want + template.end_of_turn])[0])
    width = model.cfg.max_seq_len
    tokens = np.zeros((len(prompts), width), np.int32)
    for row, (p, a) in enumerate(zip(prompts, answers)):
        tokens[row, : p.size + a.size] = np.concatenate([p, a])
    positions = np.broadcast_to(np.arange(width, dtype=np.int32), tokens.shape)
    logits, _ = model(jnp.asarray(tokens), jnp.asarray(positions), jnp.ones_like(tokens))
    logits = np.asarray(logits[..., : tokenizer.vocab_size])
    return [
        bool(np.all(np.argmax(logits[row, p.size - 1 : p.size + a.size - 1], axis=-1) == a))
        for row, (p, a) in enumerate(zip(prompts, answers))
    ]


def command_line_agrees(run_dir: str, tmp: str, held_out: list, evaluated: dict) -> bool:
    """`python -m jaxpar.sample RUN --messages FILE` prints what `evaluate` got for the first
    held-out question."""
    messages, _ = chat_task.questions(held_out)[0]
    path = os.path.join(tmp, "question.json")
    with open(path, "w") as f:
        json.dump(messages, f)
    printed = subprocess.run(
        [sys.executable, "-m", "jaxpar.sample", run_dir, "--messages", path, "--max-tokens", "16"],
        cwd=ROOT,
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    return printed.rstrip("\n") == evaluated["examples"][0]["got"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--every", type=int, default=250, help="evaluate every this many steps")
    parser.add_argument("--conversations", type=int, default=40000, help="training conversations")
    parser.add_argument("--held-out", type=int, default=300, help="held-out conversations asked")
    parser.add_argument("--train-on", nargs="+", default=["assistant", "all"])
    parser.add_argument(
        "--one-pass-only",
        action="store_true",
        help="skip the greedy replies at the end (to explore settings fast); a recorded figure needs them",
    )
    parser.add_argument(
        "--json", default=str(ROOT / "benchmarks" / "results" / "chat_sft.json"), help="where the result goes"
    )
    parser.add_argument("overrides", nargs="*", help="dotted.key=value, for every run")
    args = parser.parse_args(argv)
    held_out = chat_task.conversations(args.held_out, "held_out", seed=0)
    out = {"steps": args.steps, "conversations": args.conversations, "overrides": args.overrides}
    with tempfile.TemporaryDirectory(prefix="jaxpar-chat-sft-") as tmp:
        shards = prepare(tmp, args.conversations)
        for train_on in args.train_on:
            run_dir = os.path.join(tmp, train_on)
            result = train(run_dir, shards, train_on, args.steps, args.every, args.overrides)
            result["accuracy_by_step"] = {
                s: forced_accuracy(run_dir, held_out, s) for s in range(args.every, args.steps, args.every)
            }
            if args.one_pass_only:
                result["accuracy_by_step"][args.steps] = forced_accuracy(run_dir, held_out, args.steps)
            else:
                result.update(evaluate(run_dir, held_out, args.steps))
                result["accuracy_by_step"][args.steps] = {k: result[k] for k in ("accuracy", "by_kind")}
                result["command_line_agrees"] = command_line_agrees(run_dir, tmp, held_out, result)
            out[f"train_on={train_on}"] = result
            print(json.dumps({train_on: result}), flush=True)
    text = json.dumps(out, indent=1)
    print(text)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
