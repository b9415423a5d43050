"""The chat surfaces fail safe (issue 40): a record, a template or a run directory that would train
on wrong data, or on nothing, is refused or counted with one line; an input error is one line and
exit 2 naming the file, the record and the field; Ctrl-C during `sample` is one line and exit 130.
Every test calls the library or a command's `main` in this process (no subprocess)."""

import argparse
import json
import re

import numpy as np
import pytest
import yaml

from jaxpar import config as config_lib
from jaxpar import sample as sample_lib
from jaxpar.config import ConfigError, DataConfig
from jaxpar.corpus import chat, data, shards
from jaxpar.corpus import prepare as prepare_lib
from jaxpar.corpus.documents import ByteTokenizer
from jaxpar.run import rundir
from tests.test_chat import TURNS, template, write_jsonl

USER, REPLY = TURNS[0], TURNS[1]


def prepare(capsys, source, out, *flags) -> tuple[int, str]:
    """`python -m jaxpar.data prepare SOURCE --out OUT --chat-template simple FLAGS`, in this
    process: (exit code, stderr)."""
    code = data.main(["prepare", str(source), "--out", str(out), "--chat-template", "simple", *flags])
    return code, capsys.readouterr().err


def one_line(err: str) -> str:
    """The one line a refused command printed (no traceback)."""
    assert "Traceback" not in err
    (line,) = err.strip().splitlines()
    return line


# --- Records: what cannot have a target, what is not text -------------------------------------------


def test_records_without_an_assistant_message_are_left_out_with_a_count(tmp_path, capsys):
    """Bug: a conversation with no assistant message (none at all, system only, no messages; a
    prompt/completion whose completion has none) has no target, and was prepared and trained on
    without a word. It is left out, and one line says how many of how many, why, and where."""
    kept = [{"messages": [USER, REPLY]}] * 3
    dropped = [
        {"messages": [USER]},
        {"messages": [{"role": "system", "content": "Be brief."}]},
        {"messages": []},
        {"prompt": [USER], "completion": [USER]},
    ]
    source = write_jsonl(tmp_path / "chats.jsonl", kept + dropped)
    docs = data.read_documents(DataConfig(source=str(source)))
    assert docs == kept
    assert (
        f"{source}: left out 4 of its 7 conversation and prompt/completion records: no assistant "
        "message, so nothing to train on (line 4, line 5, line 6, ...)" in capsys.readouterr().err
    )
    code, err = prepare(capsys, source, tmp_path / "out")
    assert code == 0 and "left out 4 of its 7" in err
    assert shards.read_manifest(str(tmp_path / "out"))["splits"]["train"]["documents"] == 3


@pytest.mark.parametrize(
    "message, expected",
    [
        ({"role": "assitant", "content": "Paris."}, r"messages\[1\] has role 'assitant', which is none of "),
        (
            {"role": "assistant", "content": None},
            r"messages\[1\] \(assistant\): its 'content' is null; give the message's text",
        ),
        ({"role": "assistant"}, r"messages\[1\] \(assistant\): its 'content' is missing"),
        ({"role": "assistant", "content": 5}, r"messages\[1\] \(assistant\): 'content' is 5, not a string"),
        (
            {"role": "assistant", "content": [{"type": "image", "url": "x.png"}]},
            r"messages\[1\] \(assistant\): content part 0 is of type 'image'; jaxpar reads text only",
        ),
        (
            {"role": "assistant", "content": [{"type": "text", "text": 5}]},
            r"messages\[1\] \(assistant\): content part 0's 'text' is 5, not a string",
        ),
    ],
    ids=["misspelt-role", "null-content", "no-content", "number-content", "image-part", "number-text"],
)
def test_a_bad_message_is_one_line_naming_the_record_and_the_field(tmp_path, capsys, message, expected):
    """Bugs: a misspelt role left the conversation without targets, unsaid; a content that is a
    number or a list was a TypeError traceback from inside the template; a null content blamed
    the template ("'dict object' has no attribute 'content'"). Each is now exit 2 and one line
    naming FILE:LINE, the message and the field -- in `prepare`, and in training's reader."""
    source = write_jsonl(
        tmp_path / "chats.jsonl", [{"messages": [USER, REPLY]}, {"messages": [USER, message]}]
    )
    code, err = prepare(capsys, source, tmp_path / "out")
    assert code == 2
    line = one_line(err)
    assert line.startswith(f"error: {source}:2: ") and re.search(expected, line), line
    if "role" in expected:
        assert "system, user, assistant, tool" in line
    with pytest.raises(ConfigError, match=f"{source}:2: {expected}"):
        data.read_documents(DataConfig(source=str(source)))


def test_content_as_a_list_of_text_parts_is_read_as_its_text(tmp_path, capsys):
    """Bug: Hugging Face's form of a content, [{"type": "text", "text": ...}, ...], was a
    TypeError traceback from the template. Its text parts are read, concatenated, wherever
    messages are read: `prepare`, training's reader, `sample --messages`."""
    parts = {
        "role": "user",
        "content": [{"type": "text", "text": "Capital of "}, {"type": "text", "text": "France?"}],
    }
    source = write_jsonl(tmp_path / "chats.jsonl", [{"messages": [parts, REPLY]}])
    (doc,) = data.read_documents(DataConfig(source=str(source)))
    assert doc == {"messages": [USER, REPLY]}
    code, _ = prepare(capsys, source, tmp_path / "out")
    assert code == 0
    tokens = np.fromfile(tmp_path / "out" / "train-00000.bin", np.uint16)
    assert ByteTokenizer().decode(tokens) == template("simple").render([USER, REPLY])
    conversation = tmp_path / "conversation.json"
    conversation.write_text(json.dumps([parts]))
    args = argparse.Namespace(messages=str(conversation), chat=None, system=None)
    assert sample_lib.chat_messages(args) == [USER]
    conversation.write_text(json.dumps([{"role": "user", "content": [{"type": "image"}]}]))
    with pytest.raises(
        ConfigError, match=r"--messages=.*: messages\[0\] \(user\): content part 0 is of type"
    ):
        sample_lib.chat_messages(args)
    conversation.write_bytes(b'[{"role": "user", "content": "\xff"}]')
    with pytest.raises(ConfigError, match="is not UTF-8 text"):
        sample_lib.chat_messages(args)


def test_roles_that_do_not_alternate_say_so_naming_the_record(tmp_path):
    """Bug: a template that requires alternating turns (Gemma 3's) refused two user turns in a
    row without naming the record. The error names FILE:LINE and the two messages."""
    source = write_jsonl(
        tmp_path / "chats.jsonl", [{"messages": [USER, REPLY]}, {"messages": [USER, USER, REPLY]}]
    )
    docs = data.read_documents(DataConfig(source=str(source)))
    with pytest.raises(
        ConfigError,
        match=f"^{source}:2: chat template .*roles must alternate.*; in this conversation messages 0 and 1 "
        "are both 'user'",
    ):
        data.pack(docs, ByteTokenizer(), 16, template("gemma-3"))


# --- Templates ----------------------------------------------------------------------------------


def test_a_template_that_is_not_utf8_or_fails_to_render_is_one_line(tmp_path, capsys):
    """Bugs: a template file that is not UTF-8 was a UnicodeDecodeError traceback, one whose
    code raises a Python error ('text' + 1) a TypeError traceback. Both are exit 2, one line
    naming the file (and, rendering, the record)."""
    source = write_jsonl(tmp_path / "chats.jsonl", [{"messages": [USER, REPLY]}])
    latin = tmp_path / "latin.jinja"
    latin.write_bytes(template("simple").source.replace("jaxpar", "jaxpar\xe9").encode("latin-1"))
    code = data.main(["prepare", str(source), "--out", str(tmp_path / "a"), "--chat-template", str(latin)])
    line = one_line(capsys.readouterr().err)
    assert code == 2 and f"{latin} is not UTF-8 text (byte b'\\xe9'" in line, line
    broken = tmp_path / "broken.jinja"
    broken.write_text("{% for m in messages %}{{ m.content + 1 }}<|end|>{% endfor %}")
    code = data.main(["prepare", str(source), "--out", str(tmp_path / "b"), "--chat-template", str(broken)])
    line = one_line(capsys.readouterr().err)
    assert code == 2 and f"chat template ({broken}) failed while rendering: TypeError" in line, line


def test_an_edited_template_is_a_data_change_and_its_earlier_text_is_kept(tmp_path, capsys):
    """Bug: the template file named by data.chat_template, edited between two starts, was not
    seen by the resume guard (it compares the setting, a path) and the run's copy of it was
    overwritten. The guard compares the text with the run's copy; a resume allowed onto the new
    text keeps the copy the earlier steps used beside the earlier record."""
    jinja = tmp_path / "mine.jinja"
    jinja.write_text(template("simple").source)
    run = tmp_path / "run"
    run.mkdir()
    source = write_jsonl(tmp_path / "chats.jsonl", [{"messages": [USER, REPLY]}])
    cfg = config_lib.resolve_paths(
        config_lib.load_config(
            None, [f"data.source={source}", f"data.chat_template={jinja}", f"train.run_dir={run}"]
        )
    )
    config_lib.dump_yaml(cfg, str(run / "config.yaml"))
    data.save_run_template(cfg.data, str(run))
    settings = config_lib.to_dict(cfg)
    assert rundir.data_changes(str(run), settings) == []
    jinja.write_text(template("simple").source.replace("<|end|>", "<|stop|>"))
    ((key, was, now),) = rundir.data_changes(str(run), settings)
    assert (
        key == "data.chat_template's text" and str(run / "chat_template.jinja") in was and str(jinja) in now
    )
    message = str(rundir.data_change_error([(key, was, now)], str(run), 4))
    assert "data.allow_source_change=true" in message and "chat_template.until-step-4.jinja" in message
    rundir.keep_record(str(run), 4)  # what data.allow_source_change does, before the new start writes
    data.save_run_template(cfg.data, str(run))
    assert "<|end|>" in (run / "chat_template.until-step-4.jinja").read_text()
    assert "<|stop|>" in (run / "chat_template.jinja").read_text()
    assert "chat_template.until-step-4.jinja" in capsys.readouterr().err
    assert {"chat_template.jinja", "chat_template.until-step-4.jinja"} <= set(rundir.survey(str(run)).files)


# --- The run directory's records ------------------------------------------------------------------


def test_a_second_source_change_from_the_same_step_overwrites_no_record(tmp_path):
    """Bug: a second data.allow_source_change resuming from the same step wrote its record over
    config.until-step-N.yaml, the only record of what the first steps read. Each keeps its own
    (-2, -3, ...), and all are in the run's history (train.resume=never moves them aside)."""
    run = tmp_path / "run"
    run.mkdir()
    for source in ("first", "second", "third"):
        (run / "config.yaml").write_text(yaml.safe_dump({"data": {"source": source}}))
        rundir.keep_record(str(run), 4)
    kept = {
        name: yaml.safe_load((run / name).read_text())["data"]["source"]
        for name in ("config.until-step-4.yaml", "config.until-step-4-2.yaml", "config.until-step-4-3.yaml")
    }
    assert list(kept.values()) == ["first", "second", "third"]
    assert set(kept) <= set(rundir.survey(str(run)).files)
    assert set(kept) <= set(rundir.plan("never", rundir.survey(str(run)), lambda step: None).move)


# --- Data with no target ----------------------------------------------------------------------------


def test_data_without_any_target_is_refused_before_training(tmp_path, monkeypatch):
    """Bug: shards whose every target mask is 0 (prepared from conversations without an assistant
    reply) trained to "loss 0.000", gradient 0, exit 0: a perfect-looking run that learnt
    nothing. Training (and evaluation) on them is refused, naming the source, before any step."""
    source = write_jsonl(tmp_path / "chats.jsonl", [{"messages": [USER, REPLY]}] * 8)
    encode = chat.encode_record

    def no_targets(record, tokenizer, template):
        ids, mask, _ = encode(record, tokenizer, template)
        return ids, np.zeros_like(mask), False

    monkeypatch.setattr(chat, "encode_record", no_targets)
    out = tmp_path / "out"
    prepare_lib.prepare([str(source)], str(out), chat_template="simple", progress=False, log=print)
    monkeypatch.undo()
    with pytest.raises(
        ConfigError, match=f"^data.source={out}: none of its \\d+ sequences .* holds a target"
    ):
        data.training_source(DataConfig(source=str(out)), ByteTokenizer(), 16)
    assert len(data.training_source(DataConfig(source=str(out), train_on="all"), ByteTokenizer(), 16)) > 0


def test_sequences_without_a_target_are_counted(tmp_path, capsys):
    """Some sequences with no target (a long prompt before a short reply, cut by wrap) train
    nothing; the run says how many of its sequences are such."""
    long_prompt = {"role": "user", "content": "x" * 100}
    packed = data.pack([{"messages": [long_prompt, REPLY]}] * 2, ByteTokenizer(), 16, template("simple"))
    empty = sum(not packed[r]["loss_mask"].any() for r in range(len(packed)))
    assert 0 < empty < len(packed)
    data.check_targets(packed, "data.source=x")
    assert f"warning: data.source=x: {empty} of its {len(packed)} sequences" in capsys.readouterr().err


# --- sample ---------------------------------------------------------------------------------------


def test_ctrl_c_during_sample_is_one_line_and_exit_130(monkeypatch, capsys):
    """Bug: Ctrl-C during `python -m jaxpar.sample` printed a KeyboardInterrupt traceback."""

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(sample_lib, "_sample_command", interrupted)
    try:
        code = sample_lib.main(["runs/x", "--prompt", "hi"])
    except KeyboardInterrupt:  # not let through: pytest would take it for the user's and stop
        pytest.fail("sample's main let a KeyboardInterrupt through")
    assert code == 130
    assert one_line(capsys.readouterr().err) == "interrupted"


@pytest.mark.parametrize(
    "record, named",
    [
        ({"prompt": "a", "completion": 5}, "'completion' is 5;"),
        ({"prompt": None, "completion": "b"}, "'prompt' is null;"),
        (
            {"prompt": "a", "completion": [{"role": "assistant", "content": "b"}]},
            "'prompt' is \"a\", 'completion' is",
        ),
    ],
)
def test_a_bad_prompt_completion_pair_names_the_bad_field(record, named):
    """{"prompt": "a", "completion": 5} was refused naming the prompt ("'prompt' is "a", not a list
    of messages"), which is fine; the message now names the field that is wrong and the two
    forms a pair takes."""
    from jaxpar.corpus.documents import record_document

    with pytest.raises(ConfigError) as err:
        record_document(record, "f.jsonl:3", "text")
    assert str(err.value).startswith(f"f.jsonl:3: {named}"), str(err.value)
    assert "two strings, or two lists of" in str(err.value)


@pytest.mark.parametrize(
    "text, named",
    [
        ("", "holds no messages"),
        ("[]", "holds no messages"),
        ('{"messages": [{"role": "user", "content": "a"}]}\n' * 2, "holds 2 conversations"),
    ],
    ids=["empty-file", "empty-list", "two-conversations"],
)
def test_sample_messages_that_are_not_one_conversation_are_refused(tmp_path, text, named):
    """`sample --messages` of an empty file (or []) generated from the bare generation prompt,
    unsaid; a chats.jsonl of several conversations was refused as "messages[0] has no role"."""
    path = tmp_path / "m.jsonl"
    path.write_text(text)
    args = argparse.Namespace(messages=str(path), chat=None, system=None)
    with pytest.raises(ConfigError, match=named):
        sample_lib.chat_messages(args)
