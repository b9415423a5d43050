"""What every command line of jaxpar shares: how a command ends on an error.

A `ConfigError` is a setting or an argument to change, and its message says which and what would
work: the command ends with that message on one line of stderr (no traceback) and exit code 2,
which launchers and schedulers read as "do not restart, it would fail the same way"
(`jaxpar.launch`). Other errors a command expects (a full disk, a run too big for the machine)
end the same way with their own exit codes; anything else is a bug and keeps its traceback.

Each `main` parses its arguments, then hands the work to a library function through `run`.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping

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
