"""The README and the pages under docs/ against the code, so that the docs cannot drift from it.

Every command line in a fenced code block is read as a shell would split it and checked without
running anything that compiles or trains:

- `python -m jaxpar.<command> ...`: the command exists; its flags parse with the command's own
  parser (argparse's, or the hand-written one of `train`, `inspect` and `plan`); its config file
  exists and loads, every `key=value` override names a real setting with a value of the right
  type, and the whole config passes the validation a run does before compiling, for the devices
  the command would have (`runtime.cpu_devices`, `--target h100:N`, `--nproc` x devices, one
  device for `plan`). Paths a command names as examples (`data.source=my_text/*.txt`,
  `train.init_from=runs/...`) are placeholders: their settings are checked, their files are not.
- a console line `$ python -m jaxpar.train ...` followed by `config error: ...` must fail with
  exactly that message; any other `$` line must pass.
- `python -m benchmarks.<name> ...`: the module exists and its flags parse with its parser.
- `make <target>`: the target is in the Makefile; `pip install -e ".[extra]"`: the extra is in
  pyproject.toml; `python <path>`: the script exists.

And in the prose: every relative link resolves to a file (and a `#fragment` to a heading of the
page it names), every repository path in inline code (`jaxpar/...`, `tests/...`) exists, every
dotted `jaxpar.` name in inline code imports (the README's "What moved" table excepted: it names
the old homes on purpose), and every `python -m MODULE` in inline code names a jaxpar command or
a benchmark module that exists.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import dataclasses
import importlib
import importlib.util
import io
import re
import shlex
import tomllib
from pathlib import Path

import pytest

from jaxpar import config as config_lib
from jaxpar.config import ConfigError

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SHELL_FENCES = {"", "bash", "sh", "shell", "console"}
PYTHONS = {"python", "python3", "python3.12", ".venv/bin/python"}
# Sections whose inline code names modules that no longer exist, on purpose.
HISTORY_SECTIONS = {"What moved"}
# Settings that name files; in a doc's example command they are placeholders.
PATH_SETTINGS = {
    "data": {"source": "stdlib", "sources": None, "tokenizer": "byte", "chat_template": None},
    "train": {"init_from": None},
}


# --- Reading the docs --------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Command:
    doc: Path
    line: int
    text: str  # the command as written, continuation lines joined
    expected: str | None = None  # the output a console block shows under it, first line

    @property
    def where(self) -> str:
        return f"{self.doc.relative_to(ROOT)}:{self.line}"

    def argv(self) -> list[str]:
        return shlex.split(self.text, comments=True)


def fences(text: str) -> list[tuple[int, str, list[str]]]:
    """(line number of the first line inside, language, lines) of each fenced code block."""
    blocks, lang, start, body = [], None, 0, []
    for number, line in enumerate(text.splitlines(), 1):
        if line.startswith("```"):
            if lang is None:
                lang, start, body = line[3:].strip().lower(), number + 1, []
            else:
                blocks.append((start, lang, body))
                lang = None
        elif lang is not None:
            body.append(line)
    return blocks


def commands_in(doc: Path) -> list[Command]:
    """The command lines of a doc's shell blocks: in `bash`/`sh` blocks every line that is not a
    comment (a trailing backslash joins the next); in plain and `console` blocks the lines after
    `$ `, each with the first line of output shown under it."""
    found = []
    for start, lang, body in fences(doc.read_text()):
        if lang not in SHELL_FENCES:
            continue
        prompted = lang in ("", "console")
        i = 0
        while i < len(body):
            line, number = body[i], start + i
            i += 1
            if prompted:
                if not line.startswith("$ "):
                    continue
                line = line[2:]
            elif not line.strip() or line.lstrip().startswith("#"):
                continue
            while line.rstrip().endswith("\\") and i < len(body):
                line = line.rstrip()[:-1] + " " + body[i].strip()
                i += 1
            expected = body[i] if prompted and i < len(body) and not body[i].startswith("$ ") else None
            found.append(Command(doc, number, line.strip(), expected))
    return found


COMMANDS = [c for doc in DOCS for c in commands_in(doc)]


def _module_of(argv: list[str]) -> str | None:
    """`jaxpar.train` of `python -m jaxpar.train ...`; None for other command lines."""
    if len(argv) >= 3 and argv[0] in PYTHONS and argv[1] == "-m":
        return argv[2]
    return None


def _kind(command: Command) -> str:
    argv = command.argv()
    module = _module_of(argv)
    if module is not None:
        return module.split(".")[0]
    if argv[:1] == ["make"]:
        return "make"
    if argv[:2] == ["pip", "install"]:
        return "pip"
    if argv and argv[0] in PYTHONS and len(argv) > 1 and argv[1].endswith(".py"):
        return "script"
    return "other"


# --- Settings, as a run loads and validates them -----------------------------------------------


def _library(name: str):
    """A settings function from wherever it lives now: jaxpar.checks (validation), else
    jaxpar.config."""
    for module in ("jaxpar.checks", "jaxpar.config"):
        with contextlib.suppress(ImportError):
            found = getattr(importlib.import_module(module), name, None)
            if found is not None:
                return found
    raise AssertionError(f"neither jaxpar.checks nor jaxpar.config has {name}")


def _without_placeholders(cfg):
    """`cfg` with the settings that name files set back to their defaults."""
    for section, fields in PATH_SETTINGS.items():
        values = {k: v for k, v in fields.items() if hasattr(getattr(cfg, section), k)}
        cfg = dataclasses.replace(cfg, **{section: dataclasses.replace(getattr(cfg, section), **values)})
    return cfg


def check_settings(argv: list[str], devices: int | None = None, processes: int = 1, planner=False):
    """`[CONFIG.yaml] [key=value ...]` loaded and validated as the command would: the file and
    every key and value for real, the file-naming settings as placeholders. `devices` defaults
    to `processes` x runtime.cpu_devices (the CPU machine the docs' commands run on)."""
    path, overrides = config_lib.parse_cli(argv)
    settings = config_lib.user_settings(path, overrides)
    cfg = config_lib.build_config(settings)
    if planner:  # the planner checks the config on one device; the layout is its to choose
        cfg = dataclasses.replace(
            cfg,
            mesh=config_lib.MeshConfig(**{a: 1 for a in config_lib.MESH_AXES}),
            parallel=dataclasses.replace(cfg.parallel, zero_stage=0),
        )
        devices = 1
    if devices is None:
        devices = processes * cfg.runtime.cpu_devices
    if "mesh" not in settings and not planner:
        cfg = dataclasses.replace(cfg, mesh=_library("fit_default_mesh")(devices))
    _library("validate")(_without_placeholders(cfg), devices)


def check_overrides(overrides: list[str]) -> None:
    """Dotted settings alone (for convert's config.yaml, sample's computation): real keys, values
    of the right type."""
    config_lib.build_config(config_lib.parse_overrides(overrides))


# --- The commands' own parsers -----------------------------------------------------------------


class _Parsed(Exception):
    def __init__(self, namespace: argparse.Namespace):
        self.namespace = namespace


def parse_with_argparse(main, argv: list[str]) -> argparse.Namespace | None:
    """The namespace the command's `main` gets from its argparse parser, stopping right there
    (None for `--help`); an argument the parser refuses fails with argparse's message."""
    originals = {m: getattr(argparse.ArgumentParser, m) for m in ("parse_args", "parse_intermixed_args")}

    def stopping(method):
        def parse(self, args=None, namespace=None):
            raise _Parsed(originals[method](self, args, namespace))

        return parse

    err = io.StringIO()
    try:
        for method in originals:
            setattr(argparse.ArgumentParser, method, stopping(method))
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            main(argv)
    except _Parsed as parsed:
        return parsed.namespace
    except SystemExit as e:
        if e.code == 0:
            return None
        raise AssertionError(f"the command's parser refuses {argv}: {err.getvalue().strip()}") from None
    finally:
        for method, original in originals.items():
            setattr(argparse.ArgumentParser, method, original)
    raise AssertionError(f"{main.__module__}.main returned without parsing its arguments with argparse")


def main_module(command: str) -> str:
    """Where `python -m jaxpar.<command>` keeps its `main`: the module itself, or the one its
    thin shim imports `main` from."""
    spec = importlib.util.find_spec(f"jaxpar.{command}")
    assert spec is not None and spec.origin, f"there is no jaxpar/{command}.py"
    tree = ast.parse(Path(spec.origin).read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and any(a.name == "main" for a in node.names):
            return node.module
    return f"jaxpar.{command}"


def _main(command: str):
    return importlib.import_module(main_module(command)).main


def check_train(argv):
    if {"-h", "--help"} & set(argv):
        return
    check_settings(argv)


def check_inspect(argv):
    flags, values, rest = importlib.import_module("jaxpar.inspect")._split_flags(argv)
    devices = None
    if "--target" in values:
        devices = _library_targets().parse_target(values["--target"])[1]
    if "--documents" in values:
        assert values["--documents"].isdigit(), f"--documents {values['--documents']!r}"
    check_settings(rest, devices=devices)


def _library_targets():
    return importlib.import_module("jaxpar.compiled.targets")


def check_plan(argv):
    args = importlib.import_module(main_module("plan")).parse_args(argv)
    check_settings([args.path, *args.overrides] if args.path else list(args.overrides), planner=True)


def check_launch(argv):
    args = parse_with_argparse(_main("launch"), argv)
    if args is not None:
        check_settings(args.train_args, processes=args.nproc)


def check_data(argv):
    parse_with_argparse(_main("data"), argv)


def check_convert(argv):
    args = parse_with_argparse(_main("convert"), argv)
    if args is not None and getattr(args, "overrides", None):
        check_overrides(args.overrides)


def check_export(argv):
    parse_with_argparse(_main("export"), argv)


def check_sample(argv):
    args = parse_with_argparse(_main("sample"), argv)
    if args is not None and args.overrides:
        check_overrides(args.overrides)
        allowed = getattr(importlib.import_module("jaxpar.sample"), "SAMPLING_KEYS", None)
        for item in args.overrides:
            key = item.split("=", 1)[0]
            assert allowed is None or key in allowed, f"sample refuses {key}: it takes {sorted(allowed)}"


CHECKS = {
    "train": check_train,
    "inspect": check_inspect,
    "plan": check_plan,
    "launch": check_launch,
    "data": check_data,
    "convert": check_convert,
    "export": check_export,
    "sample": check_sample,
}


def check_jaxpar(command: Command) -> None:
    argv = command.argv()
    name = _module_of(argv).removeprefix("jaxpar.")
    assert name in CHECKS, f"python -m jaxpar.{name} is not a command ({', '.join(CHECKS)})"
    if command.expected and command.expected.startswith("config error: "):
        with pytest.raises(ConfigError) as refused:
            CHECKS[name](argv[3:])
        assert f"config error: {refused.value}" == command.expected
    else:
        CHECKS[name](argv[3:])


def check_benchmark(command: Command) -> None:
    argv = command.argv()
    module = _module_of(argv)
    assert importlib.util.find_spec(module) is not None, f"there is no {module.replace('.', '/')}.py"
    main = getattr(importlib.import_module(module), "main", None)
    if main is not None:
        parse_with_argparse(main, argv[3:])


def make_targets() -> set[str]:
    return set(re.findall(r"^([\w.-]+)\s*:(?!=)", (ROOT / "Makefile").read_text(), re.M))


def check_make(command: Command) -> None:
    targets = [a for a in command.argv()[1:] if not a.startswith("-") and "=" not in a]
    missing = sorted(set(targets) - make_targets())
    assert not missing, f"the Makefile has no target {missing}"


def check_pip(command: Command) -> None:
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    for arg in command.argv():
        if m := re.fullmatch(r"\.\[([\w,-]+)\]", arg):
            missing = sorted(set(m.group(1).split(",")) - set(extras))
            assert not missing, f"pyproject.toml has no extra {missing}"


def check_script(command: Command) -> None:
    script = command.argv()[1]
    assert (ROOT / script).is_file(), f"{script} does not exist"


KINDS = {
    "jaxpar": check_jaxpar,
    "benchmarks": check_benchmark,
    "make": check_make,
    "pip": check_pip,
    "script": check_script,
}


@pytest.mark.parametrize("command", [c for c in COMMANDS if _kind(c) in KINDS], ids=lambda c: c.where)
def test_a_documented_command_exists_and_its_arguments_are_valid(command, monkeypatch):
    monkeypatch.chdir(ROOT)  # the docs' paths (configs/...) are the repository's
    try:
        KINDS[_kind(command)](command)
    except (ConfigError, AssertionError) as e:
        raise AssertionError(f"{command.where}: {command.text}\n  {e}") from None


def test_the_readme_starts_with_make_train_then_make_test_as_ci_runs_them():
    first = [c.text.split("#")[0].strip() for c in commands_in(ROOT / "README.md")[:2]]
    assert first == ["make train", "make test"]
    ci = (ROOT / ".ci" / "run").read_text()
    assert 0 <= ci.index("make train ARGS=") < ci.index("\nmake test")


def test_every_kind_of_command_is_checked_somewhere():
    """The extraction still finds the docs' commands (a change of fence style would hide them)."""
    kinds = {_kind(c) for c in COMMANDS}
    assert {"jaxpar", "benchmarks", "make", "pip"} <= kinds
    names = {_module_of(c.argv()) for c in COMMANDS if _kind(c) == "jaxpar"}
    assert {f"jaxpar.{name}" for name in CHECKS} <= names, "a command has no example in the docs"
    assert sum(1 for c in COMMANDS if (c.expected or "").startswith("config error: ")) >= 3


# --- Links, paths and names in the prose -------------------------------------------------------


def prose(doc: Path) -> list[tuple[int, str, str]]:
    """(line number, line, the heading it is under) of each line outside code blocks."""
    lines, inside, heading = [], False, ""
    for number, line in enumerate(doc.read_text().splitlines(), 1):
        if line.startswith("```"):
            inside = not inside
        elif not inside:
            if m := re.match(r"#+ (.*)", line):
                heading = m.group(1).strip()
            lines.append((number, line, heading))
    return lines


def slugs(doc: Path) -> set[str]:
    """The anchors GitHub gives a page's headings."""
    seen: dict[str, int] = {}
    for _, line, _ in prose(doc):
        if m := re.match(r"#+ (.*)", line):
            slug = re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-")
            count = seen.get(slug, 0)
            seen[slug] = count + 1
            if count:
                seen[f"{slug}-{count}"] = 1
    return set(seen)


LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
CODE = re.compile(r"`([^`\n]+)`")
REPO_PATH = re.compile(r"(?:jaxpar|tests|benchmarks|configs|examples|docs|\.ci)/[\w./-]*")
DOTTED = re.compile(r"jaxpar(?:\.\w+)+")


def broken_links(doc: Path) -> list[str]:
    broken = []
    for number, line, _ in prose(doc):
        for target in LINK.findall(line):
            if re.match(r"[a-z]+:", target):  # https:, mailto:
                continue
            path, _, fragment = target.partition("#")
            resolved = (doc.parent / path).resolve() if path else doc
            if not resolved.exists():
                broken.append(f"{doc.name}:{number}: {target} (no {resolved.relative_to(ROOT)})")
            elif fragment and resolved.suffix == ".md" and fragment not in slugs(resolved):
                broken.append(f"{doc.name}:{number}: {target} (no heading #{fragment} there)")
    return broken


def missing_paths(doc: Path) -> list[str]:
    missing = []
    for number, line, _ in prose(doc):
        for code in CODE.findall(line):
            path = code.split("::")[0]
            if REPO_PATH.fullmatch(path) and not (ROOT / path).exists():
                missing.append(f"{doc.name}:{number}: `{code}`")
    return missing


def _resolves(name: str) -> bool:
    """Whether `jaxpar.a.b.c` is a module, or an attribute of the longest module prefix."""
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        module = ".".join(parts[:cut])
        try:
            found = importlib.util.find_spec(module) is not None
        except ModuleNotFoundError:
            found = False
        if found:
            obj = importlib.import_module(module)
            for attr in parts[cut:]:
                if not hasattr(obj, attr):
                    return False
                obj = getattr(obj, attr)
            return True
    return False


def unknown_names(doc: Path) -> list[str]:
    unknown = []
    for number, line, heading in prose(doc):
        if heading in HISTORY_SECTIONS:
            continue
        for code in CODE.findall(line):
            name = code.split("(")[0].split("'")[0]
            if DOTTED.fullmatch(name) and not _resolves(name):
                unknown.append(f"{doc.name}:{number}: `{code}`")
    return unknown


def unknown_modules(doc: Path) -> list[str]:
    """`python -m MODULE ...` in inline code (a synopsis, or the command's name alone): the module
    exists, and a jaxpar one is a command."""
    unknown = []
    for number, line, _ in prose(doc):
        for code in CODE.findall(line):
            if not (m := re.match(r"python -m ([\w.]+)(?=\s|$)", code)):
                continue
            module = m.group(1)
            command = module.startswith("jaxpar.") and module.removeprefix("jaxpar.") in CHECKS
            if not (command or module.startswith("benchmarks.") and importlib.util.find_spec(module)):
                unknown.append(f"{doc.name}:{number}: `{code}`")
    return unknown


@pytest.mark.parametrize("doc", DOCS, ids=lambda d: d.name)
def test_links_and_paths_in_the_prose_resolve(doc):
    problems = broken_links(doc) + missing_paths(doc) + unknown_names(doc) + unknown_modules(doc)
    assert not problems, "\n".join(problems)


def test_every_docs_page_is_linked_from_the_readme():
    linked = {Path(t.partition("#")[0]).name for t in LINK.findall((ROOT / "README.md").read_text())}
    pages = {d.name for d in DOCS[1:]}
    assert pages <= linked, f"not linked from the README: {sorted(pages - linked)}"
