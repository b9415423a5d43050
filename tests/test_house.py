"""The house rules of jaxpar/, read from the source with `ast` (nothing is imported or run):
no module imports in a circle, counting imports inside functions as well as at the top of a
module (a function-local import hides a circle from Python, not from a reader); and no function
is longer than 80 lines."""

import ast
from pathlib import Path

PACKAGE = "jaxpar"
ROOT = Path(__file__).resolve().parent.parent / PACKAGE
MAX_FUNCTION_LINES = 80


def module_name(path: Path) -> str:
    """The dotted name of a source file under ROOT: jaxpar/models/llama.py -> jaxpar.models.llama,
    jaxpar/models/__init__.py -> jaxpar.models."""
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def sources() -> dict[str, Path]:
    """Every module of the package, by dotted name."""
    return {module_name(path): path for path in sorted(ROOT.rglob("*.py"))}


def imported_modules(name: str, path: Path, modules: set[str]) -> set[str]:
    """The package's modules that `name` imports anywhere in its file (module level, inside
    functions and classes, under `if TYPE_CHECKING` alike). `from a import b` names the module
    `a.b` when that is a module, else `a`; a relative import is resolved against `name`'s package.
    Importing `a.b` also runs `a/__init__.py`, so the package is counted too."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            targets = [
                f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names
            ]
        else:
            continue
        for target in targets:
            parts = target.split(".")
            for end in range(1, len(parts) + 1):  # a.b.c runs a, a.b and a.b.c
                candidate = ".".join(parts[:end])
                if candidate in modules and candidate != name:
                    found.add(candidate)
    return found


def import_graph() -> dict[str, set[str]]:
    """Module -> the package's modules it imports."""
    paths = sources()
    names = set(paths)
    return {name: imported_modules(name, path, names) for name, path in paths.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle as [a, b, ..., a], or None. A depth-first walk that keeps the path it is
    on; an edge back into that path closes a circle. A package importing its own submodules
    (jaxpar.models -> jaxpar.models.llama -> jaxpar.models, through `import jaxpar.models.x`)
    is Python's normal package start, not a circle: the edge from a submodule up to its own
    package is not followed."""
    state: dict[str, str] = {}
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = "open"
        path.append(node)
        for target in sorted(graph[node]):
            if node.startswith(target + "."):
                continue  # a submodule "importing" its own package
            if state.get(target) == "open":
                return path[path.index(target) :] + [target]
            if target not in state:
                cycle = visit(target)
                if cycle:
                    return cycle
        path.pop()
        state[node] = "done"
        return None

    for start in sorted(graph):
        if start not in state:
            cycle = visit(start)
            if cycle:
                return cycle
    return None


def long_functions() -> list[tuple[str, int]]:
    """Every function or method of the package longer than MAX_FUNCTION_LINES, with its length
    (from the `def` line, decorators excluded, to its last line; docstring included)."""
    found = []
    for name, path in sources().items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    found.append((f"{path.relative_to(ROOT.parent)}:{node.lineno} {name}.{node.name}", lines))
    return sorted(found, key=lambda item: -item[1])


def test_no_import_cycle():
    graph = import_graph()
    assert "jaxpar.train" in graph and graph["jaxpar.train"], "the walk found no imports"
    cycle = find_cycle(graph)
    assert cycle is None, "import circle: " + " -> ".join(cycle)


def test_find_cycle_sees_a_circle():
    """The check itself: a circle through three modules is found and printed in order."""
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert find_cycle(graph) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_function_longer_than_80_lines():
    offenders = long_functions()
    assert not offenders, f"functions over {MAX_FUNCTION_LINES} lines:\n" + "\n".join(
        f"  {where}: {lines} lines" for where, lines in offenders
    )
