"""A conversation task a tiny model can learn on a CPU, and its held-out check.

Every conversation has a system prompt and one to three user turns, each asking for one of two
things: reverse a made-up word, or add two numbers. The system prompt decides the style of every
answer in the conversation (as written, or in capitals), so an answer depends on the system
message, on its own question and, for "again" questions, on an earlier turn:

    system:    Be terse. Answer in capitals.
    user:      reverse: kelbo
    assistant: OBLEK
    user:      add 14 and 7
    assistant: 21
    user:      the first word again, reversed
    assistant: OBLEK

Once a word has been reversed, a later turn asks for it again with probability AGAIN (15% of the
turns). Words are random lowercase strings of 3 to 5 letters; numbers are 0 to 19. Held-out
words and number pairs never occur in the training conversations (a hash of the word or the
pair decides the split), so a correct held-out answer is not recall of a training answer.
"""

from __future__ import annotations

import hashlib
import json
import random

LETTERS = "abcdefghijklmnopqrstuvwxyz"
STYLES = {
    "plain": "Be terse.",
    "upper": "Be terse. Answer in capitals.",
}
HELD_OUT_PERCENT = 10
NUMBERS = 20  # numbers to add are 0 .. NUMBERS - 1
AGAIN = 0.5  # the chance that a turn after a reversal asks for the first word again


def held_out(key: str) -> bool:
    """Whether a word or a number pair (its text) belongs to the held-out split."""
    return int(hashlib.sha256(key.encode()).hexdigest(), 16) % 100 < HELD_OUT_PERCENT


def _draw(rng: random.Random, want_held_out: bool, make):
    while True:
        key, value = make(rng)
        if held_out(key) == want_held_out:
            return value


def _word(rng: random.Random) -> tuple[str, str]:
    word = "".join(rng.choice(LETTERS) for _ in range(rng.randint(3, 5)))
    return word, word


def _pair(rng: random.Random) -> tuple[str, tuple[int, int]]:
    a, b = rng.randint(0, NUMBERS - 1), rng.randint(0, NUMBERS - 1)
    return f"{a}+{b}", (a, b)


def conversation(rng: random.Random, split: str) -> list[dict[str, str]]:
    """One conversation of `split` ("train" or "held_out") as chat messages."""
    want = split == "held_out"
    style = rng.choice(sorted(STYLES))
    shape = (lambda s: s.upper()) if style == "upper" else (lambda s: s)
    messages = [{"role": "system", "content": STYLES[style]}]
    first_word = None
    for _ in range(rng.randint(1, 3)):
        if first_word is not None and rng.random() < AGAIN:
            question, answer = "the first word again, reversed", first_word[::-1]
        elif rng.random() < 0.5:
            word = _draw(rng, want, _word)
            first_word = first_word or word
            question, answer = f"reverse: {word}", word[::-1]
        else:
            a, b = _draw(rng, want, _pair)
            question, answer = f"add {a} and {b}", str(a + b)
        messages += [
            {"role": "user", "content": question},
            {"role": "assistant", "content": shape(answer)},
        ]
    return messages


def conversations(n: int, split: str, seed: int) -> list[list[dict[str, str]]]:
    rng = random.Random(f"{split}-{seed}")
    return [conversation(rng, split) for _ in range(n)]


def write_jsonl(path: str, rows: list[list[dict[str, str]]]) -> None:
    with open(path, "w") as f:
        for messages in rows:
            f.write(json.dumps({"messages": messages}) + "\n")


def questions(rows: list[list[dict[str, str]]]) -> list[tuple[list[dict[str, str]], str]]:
    """Each conversation as (the messages before its last answer, that answer): what a held-out
    check asks the model and expects back."""
    return [(messages[:-1], messages[-1]["content"]) for messages in rows]
