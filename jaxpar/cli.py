"""What every command line of jaxpar shares: how a command ends on an error.

A `ConfigError` is a setting or an argument to change, and its message says which and what would
work: the command ends with that message on one line of stderr (no traceback) and exit code 2,
which launchers and schedulers read as "do not restart, it would fail the same way"
(`jaxpar.launch`). Other errors a command expects (a full disk, a run too big for the machine)
end the same way with their own exit codes; anything else is a bug and keeps its traceback.

Each `main` parses its arguments, then hands the work to a library function through `run`.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import io
import sys
import textwrap
import tokenize
from collections.abc import Callable, Mapping

from jaxpar import config as config_lib
from jaxpar.config import ConfigError

CONFIG_ERROR = 2  # the exit code of a configuration error: a restart would repeat it


def fail(error: BaseException, code: int, prefix: str = "error") -> int:
    """Prints `prefix: error` as one line on stderr; returns `code` (the command's exit code)."""
    print(f"{prefix}: {error}", file=sys.stderr)
    return code


def run(
    command: Callable[[], int],
    prefix: str = "config error",
    failures: Mapping[type[BaseException], int] | None = None,
) -> int:
    """`command()`, the body of a command line, returning its exit code. A ConfigError ends it
    as `prefix: message` on stderr with exit code CONFIG_ERROR; an exception of one of the types
    in `failures` (checked in order, after ConfigError) as `error: message` with the code given
    for it. Anything else propagates."""
    try:
        return command()
    except ConfigError as e:
        return fail(e, CONFIG_ERROR, prefix)
    except tuple(failures or ()) as e:
        code = next(code for kind, code in failures.items() if isinstance(e, kind))
        return fail(e, code)


# --- --help: every setting, read from the dataclasses of jaxpar.config ------------------------


def _trailing_comments(cls) -> dict[str, str]:
    """{field name: the comment on its line(s)} in the source of dataclass `cls`."""
    source = textwrap.dedent(inspect.getsource(cls))
    at_line = {
        tok.start[0]: tok.string.lstrip("#").strip()
        for tok in tokenize.generate_tokens(io.StringIO(source).readline)
        if tok.type == tokenize.COMMENT
    }

    def comment(node):
        return " ".join(at_line[n] for n in range(node.lineno, node.end_lineno + 1) if n in at_line)

    return {
        node.target.id: comment(node)
        for node in ast.parse(source).body[0].body
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
    }


def settings_help(cls=None, prefix: str = "") -> str:
    """Every setting, one line each: `dotted.key=default  comment`, read from the dataclasses
    of `jaxpar.config` (their defaults and the comment on each field's line): what `--help` prints."""
    cls = config_lib.Config if cls is None else cls
    comments, lines = _trailing_comments(cls), []
    defaults = cls()
    for f in dataclasses.fields(cls):
        sub = config_lib.dataclass_type(cls, f)
        if sub is not None:
            lines.append(f"{prefix}{f.name}: {comments.get(f.name, '')}".rstrip(": "))
            lines.append(settings_help(sub, f"{prefix}{f.name}."))
            continue
        default = getattr(defaults, f.name)
        shown = "null" if default is None else str(default).lower() if isinstance(default, bool) else default
        comment = comments.get(f.name, "").replace("(see above)", "(see jaxpar/config.py)")
        lines.append(f"  {prefix}{f.name}={shown}".ljust(44) + f"  {comment}".rstrip())
    return "\n".join(lines)
