"""benchmarks/chat_task.py, the conversation task behind benchmarks/chat_sft.py's held-out figure:
a held-out answer must not be recall of a training answer, and every answer must follow from
the conversation."""

import re

from benchmarks import chat_task


def _keys(rows):
    """The words reversed and the number pairs added in `rows`."""
    words, pairs = set(), set()
    for messages in rows:
        for m in messages:
            if m["role"] != "user":
                continue
            if found := re.fullmatch(r"reverse: (\w+)", m["content"]):
                words.add(found[1])
            elif found := re.fullmatch(r"add (\d+) and (\d+)", m["content"]):
                pairs.add(f"{found[1]}+{found[2]}")
    return words, pairs


def test_held_out_words_and_pairs_never_occur_in_training():
    train_words, train_pairs = _keys(chat_task.conversations(3000, "train", seed=0))
    held_words, held_pairs = _keys(chat_task.conversations(300, "held_out", seed=0))
    assert held_words and held_pairs and train_words and train_pairs
    assert not held_words & train_words
    assert not held_pairs & train_pairs


def test_every_answer_follows_from_its_conversation():
    kinds = set()
    for messages in chat_task.conversations(500, "held_out", seed=1):
        system, turns = messages[0], messages[1:]
        assert system["role"] == "system" and system["content"] in chat_task.STYLES.values()
        shape = str.upper if "capitals" in system["content"] else str
        first = None
        for question, answer in zip(turns[::2], turns[1::2]):
            q = question["content"]
            if q.startswith("reverse: "):
                first = first or q.removeprefix("reverse: ")
                want = q.removeprefix("reverse: ")[::-1]
            elif q.startswith("add "):
                a, b = map(int, re.findall(r"\d+", q))
                want = str(a + b)
            else:
                assert q == "the first word again, reversed" and first is not None
                want = first[::-1]
            kinds.add(q.split(" ")[0])
            assert answer == {"role": "assistant", "content": shape(want)}
    assert kinds == {"reverse:", "add", "the"}
    questions = chat_task.questions(chat_task.conversations(5, "held_out", seed=1))
    assert all(m[-1]["role"] == "user" and want for m, want in questions)
