"""`python -m jaxpar.sample RUN_DIR --prompt TEXT --max-tokens N [--temperature T] [--top-k K]
[--seed S] [--step N] [model.dtype=... model.fp8=...]`: text from a run's newest intact checkpoint.

`--chat TEXT` (a user message) or `--messages FILE` (a conversation), with `--system TEXT`: the
assistant's reply instead. The conversation is rendered with the run's chat template
(RUN_DIR/chat_template.jinja, which training writes when data.chat_template or its prepared data
named one, else the tokenizer's own: jaxpar.corpus.data.run_template) and its generation prompt;
generation stops at the template's end-of-turn marker (`ChatTemplate.end_of_turn`: a token such as
<|eot_id|> where the tokenizer has it, else the text) or the end-of-document token, and only the
reply is printed. The --messages file is checked as training checks a record
(`chat.check_messages`: known roles, contents that are text or lists of text parts).

Ctrl-C ends the command with one line and exit code 130 at any moment from its first import on:
it writes nothing that could be left half done.

The params are restored alone onto one device (`jaxpar.hf.export.load_params`), the prompt is
tokenized with the run's tokenizer (data.tokenizer), and generation runs under one `nnx.jit`:
a prefill of the whole prompt into a `KVCache` sized prompt + max_tokens (at most
model.max_seq_len), then a `lax.scan` of single-token decode steps (`Transformer.decode`). At
temperature 0 each token is the argmax; otherwise it is drawn from softmax(logits / temperature)
over the top-k logits, with a key folded from --seed and the step, so a seed always gives the same
text. Generation stops early at the tokenizer's end-of-document token. The prompt is printed,
followed by the generated text.

The model is the run's (RUN_DIR/config.yaml). Dotted `key=value` overrides, parsed and checked as
`python -m jaxpar.train` reads them, may change how it computes: SAMPLING_KEYS, e.g.
model.dtype=float32 for a model imported in float32, which bfloat16 would round at every layer.
Any other setting is refused with exit 2: those that decide the weights
(`convert.ARCHITECTURE_KEYS`, `MOE_ARCHITECTURE_KEYS`: the shapes, rotary, norms, routing) because
the checkpoint holds weights for the run's values only, the rest because sampling does not read them
(model.attention among them: decoding attends over the KV cache with XLA's attention whatever it
says).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import typing
from functools import partial

INTERRUPTED = 130  # the exit code of a command stopped by Ctrl-C (128 + SIGINT), as the shells give


def _interrupted(signum, frame):
    """Ctrl-C on `python -m jaxpar.sample`, at any moment: sampling writes nothing, so it ends at
    once, one line and exit 130 (a KeyboardInterrupt would print a traceback where it lands in
    an import, a compiled extension, or jax's plugin set-up, which logs it and goes on)."""
    print("\ninterrupted", file=sys.stderr, flush=True)
    os._exit(INTERRUPTED)


if __name__ == "__main__":  # set before the seconds of imports below
    signal.signal(signal.SIGINT, _interrupted)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from jaxpar import cli  # noqa: E402
from jaxpar import config as config_lib  # noqa: E402
from jaxpar.config import ConfigError  # noqa: E402
from jaxpar.corpus import chat  # noqa: E402
from jaxpar.corpus.documents import make_tokenizer  # noqa: E402
from jaxpar.hf.convert import ARCHITECTURE_KEYS, MOE_ARCHITECTURE_KEYS  # noqa: E402
from jaxpar.hf.export import load_params  # noqa: E402
from jaxpar.models.llama import KVCache, Transformer  # noqa: E402
from jaxpar.ops import fp8 as fp8_lib  # noqa: E402


def sample_token(logits, key, temperature=1.0, top_k: int | None = None):
    """logits float32 [..., vocab] -> int32 token ids [...], drawn from softmax(logits /
    temperature) (temperature > 0), restricted to the `top_k` largest logits when top_k is given
    (ties with the k-th largest are kept)."""
    logits = logits / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth_largest = jax.lax.top_k(logits, top_k)[0][..., -1:]
        logits = jnp.where(logits < kth_largest, -jnp.inf, logits)
    return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)


@partial(nnx.jit, static_argnames=("max_tokens", "greedy", "top_k", "vocab_limit"))
def _generate_ids(
    model: Transformer,
    prompt,
    temperature,
    key,
    *,
    max_tokens: int,
    greedy: bool,
    top_k: int | None,
    vocab_limit: int | None,
):
    """prompt int32 [1, prompt_len] -> int32 [max_tokens]: prefill, then max_tokens - 1 decode
    steps of one token each, all on a cache of prompt_len + max_tokens slots."""
    prompt_len = prompt.shape[1]
    allowed = jnp.arange(model.cfg.vocab_size) < (vocab_limit or model.cfg.vocab_size)

    def pick(logits, step):  # logits [1, seq, vocab] -> [1], from the last position
        last = jnp.where(allowed, logits[:, -1], -jnp.inf)
        if greedy:
            return jnp.argmax(last, axis=-1).astype(jnp.int32)
        return sample_token(last, jax.random.fold_in(key, step), temperature, top_k)

    cache = KVCache.create(model.cfg, 1, prompt_len + max_tokens)
    logits, cache = model.decode(prompt, jnp.arange(prompt_len)[None], cache)
    first = pick(logits, 0)

    def step(carry, index):
        token, cache = carry
        logits, cache = model.decode(token[:, None], cache.length[None, None], cache)
        return (pick(logits, index), cache), token[0]

    (last, _), tokens = jax.lax.scan(step, (first, cache), jnp.arange(1, max_tokens))
    return jnp.append(tokens, last[0])


def check_prompt(prompt_len: int, max_seq_len: int) -> None:
    """ValueError unless a prompt of `prompt_len` tokens leaves room for one more token."""
    if prompt_len == 0:
        raise ValueError("the prompt is empty; give at least one token")
    if prompt_len >= max_seq_len:
        raise ValueError(
            f"the prompt has {prompt_len} tokens, too long for model.max_seq_len="
            f"{max_seq_len}; shorten it to at most {max_seq_len - 1} tokens"
        )


def generate(
    model: Transformer,
    prompt_ids,
    max_tokens: int,
    temperature: float = 0.0,
    top_k: int | None = None,
    seed: int = 0,
    *,
    vocab_limit: int | None = None,
    stop_token: int | None = None,
) -> list[int]:
    """The token ids that follow `prompt_ids` (a non-empty sequence of ints), at most `max_tokens`
    of them: fewer when prompt + max_tokens would pass model.max_seq_len, or when `stop_token` is
    generated (it ends the list and is left out).

    temperature 0 is greedy (argmax); otherwise tokens are sampled with temperature and top_k from
    `jax.random.key(seed)`. `vocab_limit` forbids ids at and above it (the model's vocabulary is
    often padded past the tokenizer's). Raises ValueError for an empty prompt or one that leaves
    no room under model.max_seq_len."""
    cfg = model.cfg
    prompt = np.asarray(prompt_ids, dtype=np.int32).reshape(-1)
    check_prompt(prompt.size, cfg.max_seq_len)
    if temperature < 0:
        raise ValueError(f"temperature={temperature} is negative; use 0 (greedy) or more")
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k={top_k}; use a positive number, or None for the whole vocabulary")
    max_tokens = min(max_tokens, cfg.max_seq_len - prompt.size)
    if max_tokens <= 0:
        return []
    ids = _generate_ids(
        model,
        jnp.asarray(prompt)[None],
        jnp.float32(temperature),
        jax.random.key(seed),
        max_tokens=max_tokens,
        greedy=temperature == 0,
        top_k=top_k,
        vocab_limit=vocab_limit,
    )
    ids = [int(i) for i in np.asarray(ids)]
    return ids[: ids.index(stop_token)] if stop_token in ids else ids


# --- The command line ------------------------------------------------------------------------


# The settings a sample command line may override: how the run's model computes, not what it is.
SAMPLING_KEYS = {
    "model.dtype": f"matmul / activation dtype ({' | '.join(typing.get_args(config_lib.Dtype))})",
    "model.fp8": "float8 block matmuls (true | false)",
}


def run_config(run_dir: str, overrides: list[str] = ()):
    """The run's config (RUN_DIR/config.yaml) with `overrides` (`dotted.key=value`, read as
    `python -m jaxpar.train` reads them) applied. ConfigError if there is no config.yaml, for an
    unknown key or a bad value (as training reports them), for a key outside SAMPLING_KEYS, and
    for model.fp8=true on a device without float8 matmuls (`jaxpar.ops.fp8.check_device`)."""
    path = os.path.join(run_dir, "config.yaml")
    if not os.path.isfile(path):
        raise ConfigError(f"{run_dir} has no config.yaml; is it a run directory (train.run_dir)?")
    cfg = config_lib.load_config(path, overrides)
    run = config_lib.load_config(path) if overrides else cfg
    for key in _dotted_keys(config_lib.parse_overrides(list(overrides))):
        if key not in SAMPLING_KEYS:
            raise _not_for_sampling(key, cfg, run, path)
    if cfg.model.fp8:
        fp8_lib.check_device(jax.devices()[0])
    return cfg


def _dotted_keys(tree: dict, prefix: str = "") -> list[str]:
    """The dotted keys of the settings in a nested dict of overrides (`parse_overrides`')."""
    keys = []
    for name, value in tree.items():
        if isinstance(value, dict):
            keys += _dotted_keys(value, f"{prefix}{name}.")
        else:
            keys.append(prefix + str(name))
    return keys


def _not_for_sampling(key: str, cfg, run, path: str) -> ConfigError:
    """The error for an override of `key`, a setting sampling does not take; `cfg` has the
    overrides, `run` is the run's own config (read from `path`)."""
    mine, theirs = cfg, run
    for part in key.split("."):
        mine, theirs = getattr(mine, part), getattr(theirs, part)
    takes = ", ".join(SAMPLING_KEYS)
    section, _, name = key.partition(".")
    first, _, sub = name.partition(".")
    if section == "model" and (
        first in ARCHITECTURE_KEYS or (first == "moe" and sub in MOE_ARCHITECTURE_KEYS)
    ):
        return ConfigError(
            f"{key}={mine}: the checkpoint holds weights for {key}={theirs} ({path}) and sampling "
            f"runs that model; leave it unset (sampling may override {takes})"
        )
    return ConfigError(f"{key}={mine} is not a sampling setting; sampling may override {takes}")


def load_model(run_dir: str, step: int | None = None, overrides: list[str] = ()):
    """(config, Transformer with the checkpoint's params on the default device, step) from the
    run's newest intact checkpoint (or `step`), the config with the sampling `overrides`
    (`run_config`) and the model built from it. Raises ConfigError without config.yaml or for a
    bad override, and FileNotFoundError without a usable checkpoint."""
    cfg = run_config(run_dir, overrides)  # a clear error before load_params reads config.yaml
    _, params, step = load_params(run_dir, step)  # the shapes are the run's: SAMPLING_KEYS keep them
    abstract = nnx.eval_shape(lambda: Transformer(cfg.model, rngs=nnx.Rngs(0)))
    graphdef = nnx.split(abstract)[0]
    return cfg, nnx.merge(graphdef, jax.tree.map(jnp.asarray, params)), step


EPILOG = (
    "settings: the model is the run's (RUN_DIR/config.yaml); dotted key=value overrides, written\n"
    "as for python -m jaxpar.train, may change how it computes, and only these:\n"
    + "\n".join(f"  {key:<14}{meaning}" for key, meaning in SAMPLING_KEYS.items())
    + "\ne.g. python -m jaxpar.sample runs/llama --prompt 'The capital of France is' model.dtype=float32\n"
    "(a model imported in float32 then samples in float32, not in bfloat16, the default).\n"
    "Exit codes: 0 done, 2 a bad argument or setting, or no usable checkpoint, 130 interrupted\n"
    "(Ctrl-C)."
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m jaxpar.sample",
        description="Generate text from a run's newest intact checkpoint (KV-cache decoding).",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("run_dir", help="the run directory (holds config.yaml and checkpoints/)")
    given = parser.add_mutually_exclusive_group(required=True)
    given.add_argument("--prompt", help="text to continue")
    given.add_argument(
        "--chat",
        metavar="TEXT",
        help="a user message: the assistant's reply, through the run's chat template",
    )
    given.add_argument(
        "--messages",
        metavar="FILE",
        help='a conversation (JSON list of {role, content}, or {"messages": [...]}, or JSONL, one '
        "message a line): the assistant's next reply",
    )
    parser.add_argument("--system", default=None, help="with --chat/--messages: a system message first")
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens to generate (default 64)")
    parser.add_argument(
        "--temperature", type=float, default=0.0, help="0 = greedy (default); higher = more random"
    )
    parser.add_argument(
        "--top-k", type=int, default=None, help="sample from the k most likely tokens only (default: all)"
    )
    parser.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    parser.add_argument("--step", type=int, default=None, help="checkpoint step (default: newest)")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="sampling settings (below)")
    args = parser.parse_intermixed_args(argv)
    logging.getLogger("absl").setLevel(logging.ERROR)  # orbax's notes on read-only restores
    try:
        return cli.run(
            lambda: _sample_command(args),
            prefix="error",
            failures={ValueError: cli.CONFIG_ERROR, FileNotFoundError: cli.CONFIG_ERROR},
        )
    except (
        KeyboardInterrupt
    ):  # Ctrl-C where `main` is called in-process (the command exits in `_interrupted`)
        print("\ninterrupted", file=sys.stderr)
        return INTERRUPTED


def _sample_command(args) -> int:
    """The command's work: the prompt checked against the model before the slower restore, then
    its continuation printed."""
    for flag, value, ok, want in [
        ("--max-tokens", args.max_tokens, args.max_tokens >= 1, "at least 1"),
        ("--temperature", args.temperature, args.temperature >= 0, "0 (greedy) or more"),
        ("--top-k", args.top_k, args.top_k is None or args.top_k >= 1, "at least 1"),
    ]:
        if not ok:
            raise ConfigError(f"{flag}={value}: must be {want}")
    cfg = run_config(args.run_dir, args.overrides)
    tokenizer = make_tokenizer(cfg.data)
    if args.prompt is None:
        return _chat_command(args, cfg, tokenizer)
    prompt_ids = tokenizer.encode(args.prompt)
    max_seq_len = cfg.model.max_seq_len
    check_prompt(len(prompt_ids), max_seq_len)  # before the slower restore
    _, model, _ = load_model(args.run_dir, args.step, args.overrides)
    if len(prompt_ids) + args.max_tokens > max_seq_len:
        print(
            f"note: generating {max_seq_len - len(prompt_ids)} tokens, not {args.max_tokens}:"
            f" model.max_seq_len={max_seq_len}",
            file=sys.stderr,
        )
    ids = generate(
        model,
        prompt_ids,
        args.max_tokens,
        args.temperature,
        args.top_k,
        args.seed,
        vocab_limit=tokenizer.vocab_size,
        stop_token=tokenizer.eod_id,
    )
    print(args.prompt + tokenizer.decode(ids))
    return 0


def chat_messages(args) -> list[dict]:
    """The conversation of --messages FILE (and --chat, a user message after it), with --system
    first."""
    messages: list[dict] = []
    if args.messages is not None:
        text = chat.read_text(args.messages, f"--messages={args.messages}")
        try:
            loaded = json.loads(text)
        except json.JSONDecodeError:
            try:
                loaded = [json.loads(line) for line in text.splitlines() if line.strip()]
            except json.JSONDecodeError as e:
                raise ConfigError(f"--messages={args.messages} is neither JSON nor JSONL: {e}") from None
        messages = loaded.get("messages") if isinstance(loaded, dict) else loaded
        where = f"--messages={args.messages}"
        if (
            isinstance(messages, list)
            and len(messages) > 1
            and all(isinstance(m, dict) and "messages" in m for m in messages)
        ):
            raise ConfigError(
                f"{where} holds {len(messages)} conversations (records with 'messages'); give one: "
                'a {"messages": [...]} object or a list of {"role": ..., "content": ...} messages'
            )
        # Checked as training checks a record: roles, and contents that are text (a list of text
        # parts is read as their text).
        messages = chat.check_messages(messages, where)
        if not messages:
            raise ConfigError(f"{where} holds no messages; give the conversation to reply to")
    if args.chat is not None:
        messages.append({"role": "user", "content": args.chat})
    if args.system is not None:
        messages.insert(0, {"role": "system", "content": args.system})
    return messages


def chat_reply(
    model: Transformer,
    tokenizer,
    template,
    messages: list[dict],
    max_tokens: int,
    temperature: float = 0.0,
    top_k: int | None = None,
    seed: int = 0,
) -> str:
    """The assistant's next reply to `messages`: rendered with `template` (a jaxpar.corpus.chat
    template) and its generation prompt, generated until the template's end of turn (its token
    where the tokenizer has one, else its text, or the end-of-document token), the marker left
    out. Raises ValueError for a conversation too long for the model."""
    prompt = template.render(messages, add_generation_prompt=True)
    prompt_ids = tokenizer.encode_plain([prompt])[0]
    check_prompt(len(prompt_ids), model.cfg.max_seq_len)
    eot = template.end_of_turn
    stop = tokenizer.token_id(eot)
    ids = generate(
        model,
        prompt_ids,
        max_tokens,
        temperature,
        top_k,
        seed,
        vocab_limit=tokenizer.vocab_size,
        stop_token=tokenizer.eod_id if stop is None else stop,
    )
    if stop is not None and tokenizer.eod_id in ids:  # the end of the document ends the reply too
        ids = ids[: ids.index(tokenizer.eod_id)]
    return tokenizer.decode(ids).split(eot)[0]


def _chat_command(args, cfg, tokenizer) -> int:
    """--chat / --messages: the run's chat template (`data.run_template`) and `chat_reply`,
    printed alone."""
    from jaxpar.corpus import data as data_lib  # grain: only for --chat

    template = data_lib.run_template(args.run_dir, cfg.data)
    messages = chat_messages(args)
    # The prompt's length is checked before the slower restore.
    try:
        prompt = template.render(messages, add_generation_prompt=True)
    except ConfigError as e:
        raise chat.explained(e, messages, args.messages and f"--messages={args.messages}") from None
    check_prompt(len(tokenizer.encode_plain([prompt])[0]), cfg.model.max_seq_len)
    _, model, _ = load_model(args.run_dir, args.step, args.overrides)
    reply = chat_reply(
        model, tokenizer, template, messages, args.max_tokens, args.temperature, args.top_k, args.seed
    )
    print(reply)
    return 0


if __name__ == "__main__":
    from jaxpar.config import RuntimeConfig
    from jaxpar.mesh import emulate_cpu_devices, use_compile_cache

    # As jaxpar.train starts: one CPU device on a CPU machine, and the CPU directly where the CUDA
    # plugin is installed without a driver (no cuInit traceback); before the backend starts.
    emulate_cpu_devices(RuntimeConfig(cpu_devices=1))
    use_compile_cache(RuntimeConfig())  # runtime.compile_cache's default: auto (jaxpar/mesh.py)
    sys.exit(main())
