"""Conversations: chat templates render as transformers renders them (the .venv-hf sidecar,
tests/hf_reference.py `chat`, one subprocess for every template), the targets are exactly the
assistant replies with their end-of-turn marker, the masks travel through packing and prepared
shards alike, and `python -m jaxpar.sample --chat` answers and stops at the end of the turn.

The templates are those of Llama 3.2 Instruct, Qwen3 and Gemma 3 (tests/data/chat_templates, see
the README there), jaxpar's own `simple`, and `blocks`, written for these tests in the style
without whitespace control (the rendering depends on trim_blocks and lstrip_blocks)."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from jaxpar.config import ConfigError, DataConfig
from jaxpar.corpus import chat, data, prepare, reader, shards, verify
from jaxpar.corpus.documents import ByteTokenizer
from tests.hf_reference import HF_PYTHON, require_sidecar

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REFERENCE = os.path.join(ROOT, "tests", "hf_reference.py")
FIXTURES = os.path.join(ROOT, "tests", "data", "chat_templates")

# name -> (fixture file, the special tokens its tokenizer_config.json names)
TEMPLATES = {
    "llama-3.2": ("llama-3.2-instruct.jinja", {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}),
    "qwen3": ("qwen3.jinja", {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}),
    "gemma-3": ("gemma-3-it.jinja", {"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>"}),
    "simple": (os.path.join(ROOT, "jaxpar", "corpus", "templates", "simple.jinja"), {}),
    "blocks": ("blocks.jinja", {"bos_token": "<s>", "eos_token": "</s>"}),  # trim_blocks, tojson
}
SYSTEM = {"role": "system", "content": "You answer in one word: 'oui' — <short> & sweet."}
TURNS = [
    {"role": "user", "content": "Capital of France?"},
    {"role": "assistant", "content": "Paris."},
    {"role": "user", "content": " And of Italy?\n"},
    {"role": "assistant", "content": "Rome. \n"},  # whitespace some templates trim
    {"role": "user", "content": "Reverse 'abc' — ünïcode too"},
    {"role": "assistant", "content": "cba"},
]
CONVERSATION = [SYSTEM, *TURNS]
# What each template's targets are, reply by reply (the reply as the template writes it, with its
# end-of-turn marker): Llama and Gemma trim the content, Qwen3 writes an empty think block before
# the reply after the last user message.
REPLIES = {
    "llama-3.2": ["Paris.<|eot_id|>", "Rome.<|eot_id|>", "cba<|eot_id|>"],
    "qwen3": ["Paris.<|im_end|>", "Rome. \n<|im_end|>", "<think>\n\n</think>\n\ncba<|im_end|>"],
    "gemma-3": ["Paris.<end_of_turn>", "Rome.<end_of_turn>", "cba<end_of_turn>"],
    "simple": ["Paris.<|end|>", "Rome. \n<|end|>", "cba<|end|>"],
    "blocks": ["Paris.</s>", "Rome. \n</s>", "cba</s>"],
}
DATE = {"date_string": "26 Jul 2024"}  # Llama's date line; without it, today's (strftime_now)


def template(name: str) -> chat.ChatTemplate:
    path, special = TEMPLATES[name]
    with open(path if os.path.isabs(path) else os.path.join(FIXTURES, path)) as f:
        return chat.ChatTemplate(f.read(), name, tuple(special.items()))


# --- Rendering: transformers' text, byte for byte ------------------------------------------------


CASES = [
    (CONVERSATION, False),
    (CONVERSATION[:-1], True),  # the generation prompt after the last user message
    (TURNS[:2], False),  # no system message
    (TURNS[:1], True),
]


@pytest.fixture(scope="module")
def transformers_rendered(tmp_path_factory):
    """What transformers' apply_chat_template renders for CASES with each template, and the
    tokenizer directories it saved them in (one sidecar call)."""
    require_sidecar("no transformers to render with")
    out = tmp_path_factory.mktemp("chat")
    cases = {
        "templates": {
            name: {"source": template(name).source, "special": dict(template(name).special_tokens)}
            for name in TEMPLATES
        },
        "cases": [{"messages": m, "add_generation_prompt": g, "variables": DATE} for m, g in CASES],
    }
    (out / "cases.json").write_text(json.dumps(cases))
    proc = subprocess.run(
        [HF_PYTHON, REFERENCE, "chat", str(out / "cases.json"), str(out)],
        capture_output=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr.decode()[-3000:]
    return out, json.loads((out / "rendered.json").read_text())


@pytest.mark.parametrize("name", list(TEMPLATES))
def test_rendering_is_transformers_byte_for_byte(transformers_rendered, name):
    """The template read back from the directory transformers saved the tokenizer in (its
    chat_template.jinja and the special tokens of its tokenizer_config.json) renders every case
    as apply_chat_template(tokenize=False) does."""
    out, rendered = transformers_rendered
    loaded = chat.load_template(None, str(out / name / "tokenizer.json"))
    assert loaded.source == template(name).source
    for (messages, generation), expected in zip(CASES, rendered[name], strict=True):
        assert loaded.render(messages, add_generation_prompt=generation, **DATE) == expected


def test_targets_are_what_transformers_marks_in_generation_blocks(transformers_rendered):
    """On a template that marks its replies with {% generation %} blocks, transformers'
    return_assistant_tokens_mask marks the text jaxpar takes as targets (found without the
    blocks, by rendering)."""
    _, rendered = transformers_rendered
    for (messages, _), marked in zip(CASES, rendered["blocks/assistant"], strict=True):
        targets = "".join(text for text, target in template("blocks").pieces(messages) if target)
        assert marked == targets and (targets or not any(m["role"] == "assistant" for m in messages))


def test_template_from_tokenizer_config_and_from_a_file(tmp_path):
    """A chat_template in tokenizer_config.json (transformers 4's way) is found too; a file or
    `simple` given explicitly wins; a tokenizer without one is a clear error."""
    source = template("gemma-3").source
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"chat_template": source, "bos_token": {"content": "<bos>"}, "eos_token": "<eos>"})
    )
    found = chat.load_template(None, str(tmp_path / "tokenizer.json"))
    assert found.source == source and found.render(TURNS[:1]).startswith("<bos><start_of_turn>user\n")
    assert chat.load_template("simple", str(tmp_path / "tokenizer.json")).end_of_turn == "<|end|>"
    with pytest.raises(ConfigError, match="has no chat template.*--chat-template simple"):
        chat.load_template(None, "byte")


def test_llama_date_comes_from_strftime_now():
    from datetime import datetime

    dates = {datetime.now().strftime("%d %b %Y") for _ in range(1)}
    text = template("llama-3.2").render(TURNS[:1])
    dates.add(datetime.now().strftime("%d %b %Y"))  # either side of a midnight
    assert any(f"Today Date: {date}\n" in text for date in dates)


def test_raise_exception_is_a_config_error():
    with pytest.raises(ConfigError, match="roles must alternate"):
        template("gemma-3").render([TURNS[0], TURNS[0]])


# --- Targets: the assistant replies and their end of turn -----------------------------------------


@pytest.mark.parametrize("name", list(TEMPLATES))
def test_targets_are_exactly_the_replies_and_their_end_of_turn(name):
    t = template(name)
    pieces = t.pieces(CONVERSATION, **DATE)
    assert "".join(text for text, _ in pieces) == t.render(CONVERSATION, **DATE)
    assert [text for text, target in pieces if target] == REPLIES[name]
    assert all(not target for _, target in t.pieces(CONVERSATION, first_target=len(CONVERSATION)))


@pytest.mark.parametrize("name", list(TEMPLATES))
def test_sampling_prompt_is_cut_as_training_cuts(name):
    """`sample --chat`'s prompt: the conversation's training pieces, then the generation prompt."""
    t = template(name)
    texts = t.prompt_pieces(CONVERSATION[:-1], **DATE)
    assert "".join(texts) == t.render(CONVERSATION[:-1], add_generation_prompt=True, **DATE)
    assert texts[:-1] == [text for text, _ in t.pieces(CONVERSATION[:-1], **DATE)]


@pytest.mark.parametrize("name", list(TEMPLATES))
def test_token_mask_covers_the_replies(name):
    """Byte tokens of the rendered conversation: the masked-in ones spell the replies and their
    end-of-turn markers, nothing else; the prompt tokens spell the rest."""
    t = template(name)
    if name == "llama-3.2":  # the date line fixed: each render would otherwise call strftime_now
        t = chat.ChatTemplate("{% set date_string = '26 Jul 2024' %}" + t.source, name, t.special_tokens)
    ids, mask, eod_target = chat.encode_record({"messages": CONVERSATION}, ByteTokenizer(), t)
    tok = ByteTokenizer()
    assert not eod_target
    assert tok.decode(ids[mask == 1]) == "".join(REPLIES[name])
    assert tok.decode(ids[mask == 0]) == "".join(
        text for text, target in t.pieces(CONVERSATION) if not target
    )
    assert tok.decode(ids) == t.render(CONVERSATION)


def test_prompt_completion_targets_the_completion_and_the_end_of_document():
    ids, mask, eod_target = chat.encode_record({"prompt": "2+2=", "completion": "4"}, ByteTokenizer(), None)
    assert ids.tolist() == list(b"2+2=4") and mask.tolist() == [0, 0, 0, 0, 1] and eod_target
    listed = {"prompt": TURNS[:1], "completion": TURNS[1:2]}
    ids, mask, eod_target = chat.encode_record(listed, ByteTokenizer(), template("simple"))
    assert ByteTokenizer().decode(ids[mask == 1]) == "Paris.<|end|>" and not eod_target
    assert chat.record_text(listed) == "Capital of France?\nParis."  # what train-tokenizer reads


# --- Packing: the loss mask, in memory and from prepared shards -----------------------------------


RECORDS = [
    {"messages": CONVERSATION},
    {"text": "a plain document, all targets"},
    {"prompt": "2+2=", "completion": "4"},
    {"messages": TURNS[:2]},
]


def expected_loss_mask(tokens: np.ndarray, targets: np.ndarray, docs: np.ndarray, seq_len: int, row: int):
    """The loss mask of one packed row, written out: position j predicts stream token
    row*seq_len + j + 1, which counts when it is a target and of the same document."""
    at = row * seq_len + np.arange(seq_len)
    return ((targets[at + 1] == 1) & (docs[at + 1] == docs[at])).astype(np.float32)


def test_packed_loss_mask_is_targets_of_the_same_document():
    docs = [r["text"] if "text" in r else r for r in RECORDS]
    packed = data.pack(docs, ByteTokenizer(), 16, template("simple"))
    assert packed.targets is not None
    for row in range(len(packed)):
        got = packed[row]["loss_mask"]
        np.testing.assert_array_equal(
            got, expected_loss_mask(packed.tokens, packed.targets, packed.doc_ids, 16, row)
        )
    # The tokens the loss counts, row after row: the replies with their <|end|>, the plain
    # document (but its first token, which the previous end-of-document token does not predict)
    # with its end-of-document token, the completion with its end-of-document token.
    counted = np.concatenate([packed[r]["targets"][packed[r]["loss_mask"] == 1] for r in range(len(packed))])
    eod = [ByteTokenizer.eod_id]
    expected = list("".join(REPLIES["simple"]).encode()) + list(b" plain document, all targets") + eod
    expected += list(b"4") + eod + list(b"Paris.<|end|>")
    assert counted.tolist() == expected[: len(counted)] and len(counted) > len(expected) - 16


def test_train_on_all_is_the_plain_mask():
    """data.train_on=all: every token of the same document counts, as for plain text."""
    docs = [r["text"] if "text" in r else r for r in RECORDS]
    everything = data.pack(docs, ByteTokenizer(), 16, template("simple"), train_on="all")
    assert everything.targets is None
    for row in range(len(everything)):
        at = row * 16 + np.arange(16)
        same = (everything.doc_ids[at + 1] == everything.doc_ids[at]).astype(np.float32)
        np.testing.assert_array_equal(everything[row]["loss_mask"], same)


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


@pytest.mark.parametrize(
    "train_on, packing", [("assistant", "wrap"), ("all", "wrap"), ("assistant", "whole")]
)
def test_prepared_shards_give_the_in_memory_samples_mask_included(tmp_path, train_on, packing, monkeypatch):
    """Also where a shard's first records are plain text written out before its first
    conversation (the .msk then starts with their 1s): writes every 8 tokens. data.packing=whole
    too: the same rows, their padding no target."""
    monkeypatch.setattr(prepare, "_FLUSH_TOKENS", 8)
    source = write_jsonl(tmp_path / "chats.jsonl", RECORDS[1:2] * 2 + RECORDS * 3)
    out = tmp_path / "shards"
    prepare.prepare(
        [str(source)], str(out), chat_template="simple", shard_tokens=300, progress=False, log=print
    )
    manifest = shards.read_manifest(str(out))
    assert manifest["version"] == shards.MASKED_VERSION
    assert all("msk" in r["sha256"] for r in manifest["splits"]["train"]["shards"])
    assert manifest["chat_template"]["origin"] == "simple"
    cfg = DataConfig(source=str(source), chat_template="simple", train_on=train_on, packing=packing)
    in_memory = data.packed_source(cfg, ByteTokenizer(), 24)
    prepared = reader.PreparedSequences(str(out), "byte", 24, train_on=train_on, packing=packing)
    assert len(prepared) == len(in_memory)
    rows = list(range(len(prepared)))
    for a, b in zip(prepared._getitems(rows), in_memory._getitems(rows)):  # noqa: SLF001
        for key in a:
            np.testing.assert_array_equal(a[key], b[key], err_msg=key)
    masked = sum(float(r["loss_mask"].sum()) for r in prepared._getitems(rows))  # noqa: SLF001
    assert (masked < len(rows) * 24 - 20) == (train_on == "assistant")


def test_padding_of_whole_rows_changes_neither_the_loss_nor_any_gradient():
    """data.packing=whole on the tiny model (float32, one device): two conversations padded in
    their row give the loss and every gradient leaf of the same two filling a row exactly (to
    float32 rounding: other shapes sum in another order), and replacing every padding token, as
    input and as target, by other tokens leaves the loss and every leaf bit-identical. Padding
    counted as a target fails both."""
    import jax
    from flax import nnx

    from jaxpar import config as config_lib
    from jaxpar.models.llama import Transformer
    from jaxpar.models.objective import objective

    model_cfg = config_lib.load_config(os.path.join(ROOT, "configs", "tiny.yaml"), []).model
    model = Transformer(model_cfg, rngs=nnx.Rngs(0))
    graphdef, params = nnx.graphdef(model), nnx.to_pure_dict(nnx.state(model))

    @jax.jit
    def loss_and_grads(batch):
        def mean(p):
            nll, aux = objective(graphdef, p, batch, chunks=1)
            return nll / aux["count"]

        return jax.value_and_grad(mean)(params)

    docs = [{"messages": CONVERSATION}, {"prompt": "2+2=", "completion": "4"}]
    exact = data.pack(docs, ByteTokenizer(), 1000, template("simple"), packing="whole")
    (length,) = exact.rows[:, 1]  # both in one row: exactly their tokens
    rows = {}
    for seq_len in (length - 1, length + 8):
        packed = data.pack(docs, ByteTokenizer(), seq_len, template("simple"), packing="whole")
        assert packed.rows.tolist() == [[0, length]]
        rows[seq_len] = {k: v[None] for k, v in packed[0].items()}
    padded = rows[length + 8]
    assert padded["loss_mask"][0, length - 1 :].sum() == 0 and padded["loss_mask"].sum() > 20
    want_loss, want = loss_and_grads(rows[length - 1])
    got_loss, got = loss_and_grads(padded)
    np.testing.assert_allclose(got_loss, want_loss, rtol=1e-6)
    for path, leaf in jax.tree_util.tree_leaves_with_path(got):
        other = want
        for key in path:
            other = other[key.key]
        error = np.linalg.norm(np.asarray(leaf) - np.asarray(other)) / np.linalg.norm(np.asarray(other))
        assert error <= 1e-5, (jax.tree_util.keystr(path), error)
    noise = np.random.default_rng(0).integers(0, 256, padded["inputs"].shape, dtype=np.int32)
    changed = dict(padded)
    changed["inputs"] = np.where(np.arange(length + 8) < length, padded["inputs"], noise)
    changed["targets"] = np.where(np.arange(length + 8) < length - 1, padded["targets"], noise[:, ::-1])
    assert (changed["inputs"] != padded["inputs"]).sum() > 4
    changed_loss, changed_grads = loss_and_grads(changed)
    assert changed_loss == got_loss
    for a, b in zip(jax.tree_util.tree_leaves(changed_grads), jax.tree_util.tree_leaves(got)):
        np.testing.assert_array_equal(a, b)


def test_parquet_messages_column(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"messages": [CONVERSATION, TURNS[:2]]}), tmp_path / "chats.parquet")
    write_jsonl(tmp_path / "chats.jsonl", [{"messages": CONVERSATION}, {"messages": TURNS[:2]}])
    tok, simple = ByteTokenizer(), template("simple")
    from_parquet = data.pack(
        data.read_documents(DataConfig(source=str(tmp_path / "*.parquet"))), tok, 8, simple
    )
    from_jsonl = data.pack(data.read_documents(DataConfig(source=str(tmp_path / "*.jsonl"))), tok, 8, simple)
    np.testing.assert_array_equal(from_parquet.tokens, from_jsonl.tokens)
    np.testing.assert_array_equal(from_parquet.targets, from_jsonl.targets)


def test_verify_catches_a_changed_mask(tmp_path):
    out = tmp_path / "shards"
    prepare.prepare(
        [str(write_jsonl(tmp_path / "c.jsonl", RECORDS))],
        str(out),
        chat_template="simple",
        progress=False,
        log=print,
    )
    mask_path = out / "train-00000.msk"
    mask = bytearray(mask_path.read_bytes())
    mask[3] ^= 1
    mask_path.write_bytes(bytes(mask))
    with pytest.raises(ConfigError, match="msk: its SHA-256"):
        verify.verify(str(out), log=print)
    mask[3] = 7
    mask_path.write_bytes(bytes(mask))
    with pytest.raises(ConfigError, match="has mask 7, not 0 or 1"):
        verify.verify(str(out), log=print)


def test_conversations_without_a_template_exit_2(tmp_path, capsys):
    source = write_jsonl(tmp_path / "c.jsonl", RECORDS)
    assert data.main(["prepare", str(source), "--out", str(tmp_path / "out")]) == 2
    assert "has no chat template" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
    with pytest.raises(ConfigError, match="no field 'text'.*a 'messages' list"):
        data.read_documents(DataConfig(source=str(write_jsonl(tmp_path / "bad.jsonl", [{"msgs": []}]))))


# --- sample --chat ------------------------------------------------------------------------------


def test_sample_chat_reply_stops_at_the_end_of_turn(tmp_path):
    """A tiny model trained on one reply to everything answers --chat with that reply alone: the
    template's generation prompt, the reply, and nothing after its <|end|>."""
    records = [
        {"messages": [{"role": "user", "content": f"question {i}"}, {"role": "assistant", "content": "ok"}]}
        for i in range(40)
    ]
    source = write_jsonl(tmp_path / "chats.jsonl", records)
    run_dir = tmp_path / "run"
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    train = [sys.executable, "-m", "jaxpar.train", "configs/tiny.yaml", f"data.source={source}"]
    settings = ["data.chat_template=simple", "train.steps=60", "train.seq_len=64", "train.batch_size=8"]
    settings += [
        "optimizer.lr=1e-2",
        "optimizer.warmup_steps=5",
        "checkpoint.every=60",
        f"train.run_dir={run_dir}",
    ]
    settings += ["train.log_every=20", "runtime.cpu_devices=1", "mesh.data=1", "mesh.fsdp=1", "mesh.tensor=1"]
    proc = subprocess.run(
        [*train, *settings], cwd=ROOT, env=env, capture_output=True, timeout=600, check=False
    )
    assert proc.returncode == 0, proc.stderr.decode()[-3000:]
    assert (run_dir / data.RUN_TEMPLATE).read_text() == template("simple").source
    sample = [
        sys.executable,
        "-m",
        "jaxpar.sample",
        str(run_dir),
        "--chat",
        "question 99",
        "--max-tokens",
        "24",
    ]
    proc = subprocess.run(sample, cwd=ROOT, env=env, capture_output=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr.decode()[-3000:]
    assert proc.stdout.decode() == "ok\n"
    conversation = tmp_path / "conversation.jsonl"
    write_jsonl(
        conversation, [{"role": "user", "content": "question 1"}, {"role": "assistant", "content": "ok"}]
    )
    more = ["--messages", str(conversation), "--system", "Be brief.", "--max-tokens", "24"]
    proc = subprocess.run(
        [*sample[:4], *more], cwd=ROOT, env=env, capture_output=True, timeout=300, check=False
    )
    assert proc.returncode == 0, proc.stderr.decode()[-3000:]
    assert proc.stdout.decode() == "ok\n"
    # The export carries the template, where transformers 5 reads a tokenizer's chat template.
    from jaxpar.hf.export import write_tokenizer
    from jaxpar.sample import run_config

    write_tokenizer(run_config(str(run_dir)), str(tmp_path))
    assert (tmp_path / "chat_template.jinja").read_text() == template("simple").source


def test_hf_tokenizer_pieces_keep_special_tokens_and_add_no_bos(tmp_path):
    """With a Hugging Face tokenizer: the pieces are encoded without the BOS its post-processor
    adds (the template writes its own), each end-of-turn marker is its one special token, and
    exactly the replies' markers are targets; `token_id` finds the marker sampling stops at."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    from jaxpar.corpus.documents import HFTokenizer

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<bos>"]
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(["Capital of France? Paris. Rome."] * 20, trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<bos> $A", special_tokens=[("<bos>", tok.token_to_id("<bos>"))]
    )
    tok.save(str(tmp_path / "tokenizer.json"))
    hf = HFTokenizer(str(tmp_path / "tokenizer.json"))
    bos, eot = tok.token_to_id("<bos>"), hf.token_id("<|im_end|>")
    assert hf.encode("Paris.")[0] == bos and bos not in hf.encode_plain(["Paris."])[0]
    ids, mask, _ = chat.encode_record({"messages": CONVERSATION}, hf, template("qwen3"))
    assert bos not in ids
    ends = np.flatnonzero(ids == eot)
    assert len(ends) == len(CONVERSATION)  # every turn closes with the one token
    assert mask[ends].tolist() == [0, 0, 1, 0, 1, 0, 1]  # system, user, assistant, ...
    assert hf.decode(ids[mask == 1]) == "".join(r.removesuffix("<|im_end|>") for r in REPLIES["qwen3"])


def test_a_missing_chat_template_file_is_a_config_error():
    from jaxpar import checks as checks_lib
    from jaxpar import config as config_lib

    cfg = config_lib.load_config(
        os.path.join(ROOT, "configs", "tiny.yaml"), ["data.chat_template=/no/such.jinja"]
    )
    with pytest.raises(ConfigError, match="data.chat_template='/no/such.jinja' does not exist"):
        checks_lib.validate(cfg, 8)


def test_the_run_keeps_the_template_its_prepared_data_was_rendered_with(tmp_path):
    out = tmp_path / "shards"
    source = write_jsonl(tmp_path / "c.jsonl", RECORDS)
    prepare.prepare([str(source)], str(out), chat_template="simple", progress=False, log=print)
    kept = data.training_template(DataConfig(source=str(out)))
    assert kept.source == template("simple").source
    other = tmp_path / "other.jinja"
    other.write_text(template("blocks").source)
    with pytest.raises(ConfigError, match="is not the chat template .* was prepared with"):
        data.training_source(DataConfig(source=str(out), chat_template=str(other)), ByteTokenizer(), 16)
    assert data.training_template(DataConfig(source=str(source))) is None  # raw text: the tokenizer's
