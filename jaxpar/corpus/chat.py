"""Chat templates and the loss mask of conversations.

A conversation (`{"messages": [{"role": ..., "content": ...}, ...]}`) becomes text through a chat
template: the Jinja2 program a Hugging Face tokenizer carries (`chat_template` in its
`tokenizer_config.json`, or `chat_template.jinja` beside it, as transformers 5 saves it), or one
given with `--chat-template FILE` / data.chat_template, or `simple`, the small template shipped in
jaxpar/corpus/templates/ for tokenizers without one (the byte tokenizer; never chosen silently). It is
rendered the way transformers' `apply_chat_template(..., tokenize=False)` renders it -- a sandboxed
environment with trim_blocks and lstrip_blocks, `raise_exception`, `strftime_now`, a `tojson`
that does not escape HTML, the tokenizer's named special tokens (bos_token, eos_token, ...) as
variables -- so the text is byte for byte what transformers gives (tests/test_chat.py checks it
against transformers on the Llama 3.2, Qwen3 and Gemma 3 templates).

What is a target. Only assistant replies are, by default (data.train_on=assistant): for each
assistant message, the text from the end of the generation prompt (what `add_generation_prompt`
renders after the conversation before it) through the template's end-of-turn marker
(`<|eot_id|>`, `<|im_end|>`, `<end_of_turn>`). The end-of-turn marker is a target -- the model
must learn to stop -- and the whitespace a template writes after it is not (the next turn's
header); the role header is not. This is the span a `{% generation %}` block marks in the
templates that have one (transformers' `return_assistant_tokens_mask`, TRL's
`assistant_only_loss`); most templates lack the block, so the span is found by rendering: the
conversation before the reply with the generation prompt must be a prefix of the whole rendering
(else a ConfigError says the template cannot be split), and the reply ends at the first end-of-turn
marker after it. The marker itself is read off the template (`ChatTemplate.end_of_turn`): what a
one-reply conversation renders after the reply, less trailing whitespace. Qwen3's template writes
an empty `<think>\\n\\n</think>\\n\\n` before the last reply; that belongs to the reply (the model
generates it). Prompt/completion records (`{"prompt": ..., "completion": ...}`, strings) are the
prompt's text followed by the completion's, the completion and the end-of-document token after it
the targets (TRL's prompt-completion format); lists of messages in both fields are a conversation
whose targets are the completion's assistant messages.

Pieces are tokenized one by one, without the tokenizer's own added tokens (the template writes
them): a reply's tokens are those the model produces after the prompt's, as at sampling time.

What is refused, before a template sees it (`check_messages`, for training's records and
`sample --messages` alike; a ConfigError naming the record, the message and the field): a role
outside ROLES (a misspelt "assitant" would leave a conversation without targets), a content that
is null, missing or not text (null or missing is allowed only beside tool_calls), a content part
that is not text. A content given as a list of text parts (`[{"type": "text", "text": ...}]`, as
Hugging Face chat datasets give it) is read as their text, concatenated. A record without an
assistant message (`has_target`) is left out by its reader, with a count (jaxpar.corpus.documents). A
template's error -- its raise_exception, a Jinja error, a Python error of its code -- is a
ConfigError naming the template, and the record being rendered (`Record.where`), with where the
conversation's turns do not alternate (`explained`); a template file that is not UTF-8 is one too.
"""

from __future__ import annotations

import functools
import json
import os
from dataclasses import dataclass
from datetime import datetime

import numpy as np

from jaxpar.config import CHAT_TEMPLATES, ConfigError

# transformers 5's file for a tokenizer's chat template, beside its tokenizer.json; a run keeps the
# template it trained with in its run directory under the same name, and exports it so.
TEMPLATE_FILE = "chat_template.jinja"
TEMPLATES = os.path.join(os.path.dirname(__file__), "templates")  # CHAT_TEMPLATES, as <name>.jinja
# The named special tokens transformers passes to a template as variables (its special_tokens_map).
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
# The roles of transformers' chat format. Another role is refused (`check_messages`): templates
# differ on what they do with one (Llama's writes it as a header, Qwen3's drops the message,
# Gemma's raises), and a misspelt "assitant" would silently leave a conversation without targets.
ROLES = ("system", "user", "assistant", "tool")
_REASONING = ("reasoning_content", "thinking", "reasoning")  # transformers' aliases of a reply's reasoning
_PROBE = "\ue000jaxpar reply\ue001"  # a reply no template changes (private-use characters)


# --- The Jinja2 environment ---------------------------------------------------------------------


def _raise(message):
    import jinja2

    raise jinja2.exceptions.TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    """Jinja's own tojson escapes <, >, & and ' for HTML; chat templates want plain JSON."""
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _make_dict(*args, **kwargs) -> dict:
    return dict(*args, **kwargs)


@functools.cache
def _environment():
    """The sandboxed environment, with what transformers gives templates (see the docstring)."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(jinja2.ext.Extension):
        """`{% generation %}...{% endgeneration %}`: rendered as its body (spans come from
        rendering, see the module docstring); parsed so that templates that have it load."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    class Namespace(jinja2.utils.Namespace):
        """jinja2's namespace, refusing underscore names (no way to CPython internals)."""

        def __init__(*args, **kwargs):
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                Namespace._check(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            Namespace._check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check(name):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(
                    f"a chat template may not set namespace attribute {name!r}"
                )

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[Generation, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals.update(
        raise_exception=_raise, strftime_now=_strftime_now, dict=_make_dict, namespace=Namespace
    )
    return env


@functools.lru_cache(maxsize=16)
def _compiled(source: str):
    return _environment().from_string(source)


# --- Templates ----------------------------------------------------------------------------------


# What a template's Jinja code can raise besides jinja2's TemplateError: the Python errors of the
# operations it runs on the conversation's values (a concatenation of text and a number, a missing
# key or index, a bad number format, a template calling itself without end).
_TEMPLATE_FAULTS = (TypeError, ValueError, LookupError, AttributeError, ArithmeticError, RecursionError)


def read_text(path: str, name: str, hint: str = "") -> str:
    """The text of a file; ConfigError naming `name` (the setting or argument that named it, or
    where it was found) when it cannot be read or is not UTF-8, with `hint` after the cause."""
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as e:
        raise ConfigError(f"{name}: cannot read {path} ({e.strerror})") from None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(
            f"{name}: {path} is not UTF-8 text (byte {raw[e.start : e.start + 1]!r} at offset "
            f"{e.start}){hint}"
        ) from None


def _read_template(path: str, name: str) -> str:
    """The text of a template file (`read_text`)."""
    return read_text(path, name, "; a chat template is a Jinja2 text file, save it as UTF-8")


def _token_text(value) -> str | None:
    """A special token as tokenizer_config.json writes it: a string, or an AddedToken dict."""
    value = value.get("content") if isinstance(value, dict) else value
    return value if isinstance(value, str) else None


def _tokenizer_files(tokenizer: str) -> tuple[dict, str | None]:
    """(tokenizer_config.json as a dict, the path of chat_template.jinja) beside a tokenizer.json;
    ({}, None) for the byte tokenizer or where they are not there."""
    if tokenizer == "byte":
        return {}, None
    directory = os.path.dirname(os.path.abspath(tokenizer))
    config: dict = {}
    try:
        with open(os.path.join(directory, "tokenizer_config.json"), encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError):
        pass
    jinja = os.path.join(directory, TEMPLATE_FILE)
    return (config if isinstance(config, dict) else {}), (jinja if os.path.isfile(jinja) else None)


@dataclass(frozen=True)
class ChatTemplate:
    """A chat template: its Jinja source, where it came from, and the special tokens it sees."""

    source: str
    origin: str  # for messages: "the chat_template of DIR/tokenizer_config.json", a path, "simple"
    special_tokens: tuple[tuple[str, str], ...] = ()  # (name, text): bos_token, eos_token, ...

    def render(self, messages: list[dict], *, add_generation_prompt: bool = False, **variables) -> str:
        """The conversation as text, as transformers' apply_chat_template(tokenize=False) gives
        it. A template's raise_exception (or any template error) is a ConfigError naming it."""
        import jinja2

        try:
            return _compiled(self.source).render(
                **dict(self.special_tokens),
                **variables,
                messages=_normalized(messages),
                tools=None,
                documents=None,
                add_generation_prompt=add_generation_prompt,
            )
        except jinja2.exceptions.TemplateError as e:
            raise ConfigError(f"chat template ({self.origin}): {e}") from None
        except _TEMPLATE_FAULTS as e:  # the template's own Python errors, e.g. `'text' + 1`
            raise ConfigError(
                f"chat template ({self.origin}) failed while rendering: {type(e).__name__}: {e}"
            ) from None

    @functools.cached_property
    def end_of_turn(self) -> str:
        """The text that closes an assistant reply (`<|eot_id|>`, `<|im_end|>`, ...): what the
        template writes after a reply, less trailing whitespace. Generation stops at it."""
        chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": _PROBE}]
        whole = self.render(chat)
        after = whole[whole.find(_PROBE) + len(_PROBE) :].rstrip() if _PROBE in whole else ""
        if not after:
            raise ConfigError(
                f"chat template ({self.origin}) writes nothing after an assistant reply: no "
                "end-of-turn marker for the model to learn to stop at; use a template that closes "
                "each turn (e.g. --chat-template simple)"
            )
        return after

    def pieces(self, messages: list[dict], first_target: int = 0, **variables) -> list[tuple[str, bool]]:
        """The rendered conversation cut into (text, is a target) pieces: the assistant replies
        of messages[first_target:] with their end-of-turn markers are targets (see the module
        docstring), the rest is not. The texts joined are `render(messages, **variables)`."""
        whole, eot = self.render(messages, **variables), self.end_of_turn
        pieces, at = [], 0
        for k, message in enumerate(messages):
            if k < first_target or message.get("role") != "assistant":
                continue
            prompt = self.render(messages[:k], add_generation_prompt=True, **variables)
            end = whole.find(eot, len(prompt))
            if not whole.startswith(prompt) or len(prompt) < at or end < 0:
                raise ConfigError(
                    f"chat template ({self.origin}): cannot find assistant message {k} in the "
                    "rendered conversation (the conversation before it, with the generation "
                    f"prompt, is not a prefix of the whole, or no {eot!r} follows it); this "
                    "template cannot be split into prompt and reply"
                )
            pieces += [(whole[at : len(prompt)], False), (whole[len(prompt) : end + len(eot)], True)]
            at = end + len(eot)
        pieces.append((whole[at:], False))
        return [(text, target) for text, target in pieces if text]

    def prompt_pieces(self, messages: list[dict], **variables) -> list[str]:
        """The conversation with the generation prompt after it, as texts to tokenize one by
        one: the `pieces` of the conversation (cut where training cuts it, so that its tokens are
        those training saw), then the generation prompt; one text where the template renders the
        conversation otherwise once a generation prompt follows."""
        prompt = self.render(messages, add_generation_prompt=True, **variables)
        texts = [text for text, _ in self.pieces(messages, **variables)] if messages else []
        joined = "".join(texts)
        return [*texts, prompt[len(joined) :]] if prompt.startswith(joined) else [prompt]


def _normalized(messages: list[dict]) -> list[dict]:
    """Messages as transformers hands them to a template: keys whose value is None dropped, and
    a reply's reasoning under each of its names (reasoning_content, thinking)."""
    out = []
    for message in messages:
        message = {k: v for k, v in message.items() if v is not None}
        reasoning = next((message[k] for k in _REASONING if message.get(k) is not None), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        out.append(message)
    return out


def special_tokens(tokenizer: str) -> tuple[tuple[str, str], ...]:
    """The named special tokens of the tokenizer_config.json beside a tokenizer.json, as a
    template sees them (none for the byte tokenizer)."""
    config, _ = _tokenizer_files(tokenizer)
    return tuple((name, text) for name in SPECIAL_TOKENS if (text := _token_text(config.get(name))))


def load_template(spec: str | None, tokenizer: str, setting: str | None = None) -> ChatTemplate:
    """The chat template a run or a preparation uses: `spec` (a .jinja file, or a CHAT_TEMPLATES name),
    else the tokenizer's own (chat_template.jinja beside its tokenizer.json, else the
    chat_template of its tokenizer_config.json). The tokenizer's special tokens come with it.
    ConfigError when there is none, naming what would work, or when the file is missing or not
    UTF-8 text (naming `setting`: by default data.chat_template)."""
    config, jinja = _tokenizer_files(tokenizer)
    special = special_tokens(tokenizer)
    if spec is not None:
        setting = setting or f"data.chat_template={spec} (--chat-template)"
        path = (
            os.path.join(TEMPLATES, f"{spec}.jinja") if spec in CHAT_TEMPLATES else os.path.expanduser(spec)
        )
        if not os.path.isfile(path):
            raise ConfigError(
                f"{setting} is neither a file nor one of jaxpar's templates ({', '.join(CHAT_TEMPLATES)})"
            )
        return ChatTemplate(_read_template(path, setting), spec, special)
    own = config.get("chat_template")
    if isinstance(own, list):  # several named templates: transformers' default is "default"
        own = next(
            (t.get("template") for t in own if isinstance(t, dict) and t.get("name") == "default"), None
        )
    if jinja is not None:
        text = _read_template(jinja, f"the chat template of data.tokenizer={tokenizer}")
        return ChatTemplate(text, f"chat_template.jinja beside {tokenizer}", special)
    if isinstance(own, str):
        return ChatTemplate(own, f"the chat_template of {tokenizer}'s tokenizer_config.json", special)
    raise ConfigError(
        f"the source holds conversations, and data.tokenizer={tokenizer} has no chat template "
        "(no chat_template.jinja, nor a chat_template in a tokenizer_config.json beside it); "
        "give one with --chat-template FILE (data.chat_template), or --chat-template simple "
        f"(jaxpar's {os.path.join(TEMPLATES, 'simple.jinja')})"
    )


# --- Records: conversations, prompt/completion ------------------------------------------------------


class Record(dict):
    """A conversation or prompt/completion record (its fields, as a dict), with `where` it was
    read ("FILE:LINE", "FILE: row N"), which the errors of rendering it name."""

    where: str | None = None


def _shown(value, limit: int = 60) -> str:
    text = json.dumps(value, default=repr, ensure_ascii=False)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _content_text(content, where: str) -> str:
    """A message's content given as a list of parts (Hugging Face's form, `[{"type": "text",
    "text": ...}, ...]`) read as its text parts, concatenated; ConfigError for any other part."""
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str):
            texts.append(part["text"])
            continue
        if kind == "text":  # the right type, with a text that is not a string
            raise ConfigError(
                f"{where}: content part {j}'s 'text' is {_shown(part.get('text'), 40)}, not a string"
            )
        what = f"of type {kind!r}" if isinstance(kind, str) else f"{_shown(part, 40)}"
        raise ConfigError(
            f"{where}: content part {j} is {what}; jaxpar reads text only, parts of the form "
            '{"type": "text", "text": "..."}; remove the others'
        )
    return "".join(texts)


def check_messages(messages, where: str, key: str = "messages") -> list[dict]:
    """The messages of a record, checked: a list of {"role": one of ROLES, "content": text}
    (content may be null or absent in a message that has tool_calls); a content given
    as a list of text parts becomes their text, concatenated. ConfigError naming `where`, the
    message and the field otherwise."""
    if not isinstance(messages, list):
        raise ConfigError(
            f"{where}: '{key}' is {_shown(messages)}, not a list of "
            '{"role": ..., "content": ...} messages'
        )
    checked = []
    for i, message in enumerate(messages):
        at = f"{where}: {key}[{i}]"
        if not isinstance(message, dict):
            raise ConfigError(f'{at} is {_shown(message)}, not a {{"role": ..., "content": ...}} message')
        role = message.get("role")
        if not isinstance(role, str):
            raise ConfigError(f"{at} has {'no role' if role is None else f'role {_shown(role)}'}")
        if role not in ROLES:
            raise ConfigError(
                f"{at} has role {role!r}, which is none of {', '.join(ROLES)} (the roles chat "
                "templates know; a conversation's targets are its 'assistant' messages)"
            )
        content = message.get("content")
        if isinstance(content, list):
            message = {**message, "content": _content_text(content, f"{at} ({role})")}
        elif content is None and not message.get("tool_calls"):
            state = "is null" if "content" in message else "is missing"
            raise ConfigError(f"{at} ({role}): its 'content' {state}; give the message's text (a string)")
        elif content is not None and not isinstance(content, str):
            raise ConfigError(
                f"{at} ({role}): 'content' is {_shown(content)}, not a string (nor a list of "
                '{"type": "text", "text": ...} parts)'
            )
        checked.append(message)
    return checked


def has_target(record: dict) -> bool:
    """Whether a (checked) record has anything to train on: an assistant message (in the
    completion, for a prompt/completion of messages), or a completion that is a string."""
    if "messages" in record:
        messages = record["messages"]
    elif isinstance(record["completion"], str):
        return True
    else:
        messages = record["completion"]
    return any(m["role"] == "assistant" for m in messages)


def _alternation(messages: list[dict]) -> str | None:
    """Where a conversation's user and assistant turns do not alternate (after a leading system
    message), which many templates refuse; None where they do."""
    turns = [(i, m["role"]) for i, m in enumerate(messages) if m.get("role") in ("user", "assistant")]
    if turns and turns[0][1] != "user":
        return f"the first turn is message {turns[0][0]}, an {turns[0][1]!r} one, not a user message"
    for (i, a), (j, b) in zip(turns, turns[1:]):
        if a == b:
            return f"messages {i} and {j} are both {a!r}: its user and assistant turns do not alternate"
    return None


def record_pieces(record: dict, template) -> tuple[list[tuple[str, bool]], bool]:
    """(pieces, whether the end-of-document token after them is a target) of a conversation or
    prompt/completion record (see the module docstring). `template`: a ChatTemplate, or a
    function returning one (called only for records that need it). A template's error names the
    record (`Record.where`) and says where its turns do not alternate."""
    get = template if callable(template) else (lambda: template)
    if "messages" in record:
        messages, first = record["messages"], 0
    else:
        prompt, completion = record["prompt"], record["completion"]
        if isinstance(prompt, str) and isinstance(completion, str):
            pieces = [(text, target) for text, target in ((prompt, False), (completion, True)) if text]
            return pieces, True
        messages, first = list(prompt) + list(completion), len(prompt)
    chosen = get()
    try:
        return chosen.pieces(messages, first_target=first), False
    except ConfigError as e:
        raise explained(e, messages, getattr(record, "where", None)) from None


def explained(error: ConfigError, messages: list[dict], where: str | None) -> ConfigError:
    """A template's error on a conversation, naming where the conversation was read and saying
    where its user and assistant turns do not alternate (which many templates refuse)."""
    why = _alternation(messages)
    prefix, suffix = f"{where}: " if where else "", f"; in this conversation {why}" if why else ""
    return ConfigError(f"{prefix}{error}{suffix}")


def encode_record(record: dict, tokenizer, template) -> tuple[np.ndarray, np.ndarray, bool]:
    """(token ids, target mask uint8, end-of-document target) of a record: its pieces tokenized one
    by one without the tokenizer's added special tokens (`encode_plain`)."""
    pieces, eod_target = record_pieces(record, template)
    encoded = tokenizer.encode_plain([text for text, _ in pieces]) if pieces else []
    ids = [np.asarray(e, dtype=np.int32) for e in encoded]
    masks = [np.full(len(e), target, dtype=np.uint8) for e, (_, target) in zip(ids, pieces)]
    if not ids:
        return np.zeros(0, np.int32), np.zeros(0, np.uint8), eod_target
    return np.concatenate(ids), np.concatenate(masks), eod_target


def record_text(record: dict) -> str:
    """The words of a record, without a template: its messages' text contents (or its prompt and
    completion), one a line. What `train-tokenizer` learns its merges from."""
    messages = record.get("messages") or [
        {"content": part} if isinstance(part, str) else part
        for part in (record.get("prompt"), record.get("completion"))
        for part in (part if isinstance(part, list) else [part])
    ]
    return "\n".join(m["content"] for m in messages if isinstance(m.get("content"), str))
