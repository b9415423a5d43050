"""The house rules of jaxpar/, read from the source with `ast` (nothing is imported or run):
no module imports in a circle, counting imports inside functions as well as at the top of a
module (a function-local import hides a circle from Python, not from a reader) and counting the
package `__init__` that every import of a submodule runs; imports run only down the rooms of
LAYERS; no function is longer than 80 lines and no module longer than 800."""

import ast
from pathlib import Path

PACKAGE = "jaxpar"
ROOT = Path(__file__).resolve().parent.parent / PACKAGE
MAX_FUNCTION_LINES = 80
MAX_MODULE_LINES = 800

# The rooms of jaxpar/, from the ground up. A module may import from its own room and from the
# rooms below it, never from a room above it nor from another room on its own floor. A room is a
# package or a module; a dotted name stands for everything under it. The command lines
# (`python -m jaxpar.<command>`) are the top floor.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("jaxpar.config",),  # settings: typed dataclasses, YAML, overrides
    ("jaxpar.cli",),  # how a command ends on an error (exit 2 for a setting)
    ("jaxpar.corpus",),  # documents, chat templates, prepared shards, batches
    ("jaxpar.mesh",),  # devices -> the six-axis mesh
    ("jaxpar.sharding",),  # logical names -> mesh axes; the Layout
    ("jaxpar.ops",),  # fp8 matmuls, the SwiGLU kernel
    ("jaxpar.parallel",),  # ring attention, the expert exchange, pipelines and their schedules
    ("jaxpar.model_checks",),  # the model's own settings checked against each other
    ("jaxpar.checks",),  # a config checked against itself and the devices, before compiling
    ("jaxpar.models",),  # the blocks, attention, loss, MoE, LoRA, Hugging Face families
    ("jaxpar.compiled",),  # reading compiled programs; compiling for absent GPUs; the ruler
    ("jaxpar.training",),  # the trainer and its step, optimizer, checkpoints, metrics
    ("jaxpar.planning", "jaxpar.hf"),  # the planner; the Hugging Face bridge
    ("jaxpar.run",),  # a run's start, directory and loop
    (  # the command lines
        "jaxpar.train",
        "jaxpar.inspect",
        "jaxpar.plan",
        "jaxpar.data",
        "jaxpar.convert",
        "jaxpar.export",
        "jaxpar.sample",
        "jaxpar.launch",
    ),
)


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
    on; an edge back into that path closes a circle. Every edge counts, that of a submodule to its
    own package too: importing jaxpar.models.llama runs jaxpar/models/__init__.py first, so an
    `__init__` that imports its own children closes a circle through each of them."""
    state: dict[str, str] = {}
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = "open"
        path.append(node)
        for target in sorted(graph[node]):
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


def test_find_cycle_counts_a_package_init():
    """The check itself: a package whose `__init__` imports its child, which imports from the
    package (Python runs the `__init__` first), is a circle."""
    graph = {"p": {"p.child"}, "p.child": {"p"}}
    assert find_cycle(graph) == ["p", "p.child", "p"]


def room(name: str) -> tuple[int, str] | None:
    """(floor, room) of a module by LAYERS: the longest room name that is the module or a package
    above it; None for the root package `jaxpar`, which defines nothing."""
    best = None
    for floor, rooms in enumerate(LAYERS):
        for r in rooms:
            if (name == r or name.startswith(r + ".")) and (best is None or len(r) > len(best[1])):
                best = (floor, r)
    return best


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """Every import that climbs: to a higher floor, or across to another room on the same floor."""
    found = []
    for name, targets in sorted(graph.items()):
        here = room(name)
        for target in sorted(targets):
            there = room(target)
            if here is None or there is None or there[1] == here[1]:
                continue
            if there[0] >= here[0]:
                found.append(
                    f"{name} (floor {here[0]}, {here[1]}) -> {target} (floor {there[0]}, {there[1]})"
                )
    return found


def test_every_module_has_a_room():
    homeless = [name for name in sources() if name != PACKAGE and room(name) is None]
    assert not homeless, f"modules in no room of LAYERS: {homeless}"


def test_imports_run_down_the_rooms():
    offenders = upward_imports(import_graph())
    assert not offenders, "imports that climb:\n" + "\n".join(f"  {o}" for o in offenders)


def test_upward_imports_sees_a_climb_and_a_sideways_step():
    """The check itself: the model importing the trainer climbs; the planner importing the
    Hugging Face bridge steps sideways on its floor; the trainer importing the model is fine."""
    graph = {
        "jaxpar.models.llama": {"jaxpar.training.trainer"},
        "jaxpar.planning.plan": {"jaxpar.hf.convert"},
        "jaxpar.training.trainer": {"jaxpar.models.llama", "jaxpar.training"},
    }
    found = upward_imports(graph)
    assert len(found) == 2
    assert found[0].startswith("jaxpar.models.llama") and found[1].startswith("jaxpar.planning.plan")


def test_no_module_longer_than_800_lines():
    long = {
        str(path.relative_to(ROOT.parent)): n
        for path in sources().values()
        if (n := len(path.read_text().splitlines())) > MAX_MODULE_LINES
    }
    assert not long, f"modules over {MAX_MODULE_LINES} lines: {long}"
