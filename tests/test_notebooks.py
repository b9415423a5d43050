"""The example notebooks run top to bottom, and are committed as their generator writes them.

Each notebook executes in a fresh Jupyter kernel of this Python (the venv) with
JAXPAR_NOTEBOOK_SMALL=1, which shrinks steps and sizes for CI. The kernel inherits the session's
XLA_FLAGS (compile options only, conftest.py) but not its JAX_PLATFORMS, and sets up its own 8
devices, as it does on Colab or on a user's machine.
"""

import ast
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import nbformat
import pytest
from jupyter_client.kernelspec import KernelSpecManager, NoSuchKernel
from nbclient import NotebookClient

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(ROOT, "examples")
NOTEBOOKS = [
    "01_quickstart",
    "02_data_fsdp_tensor",
    "03_pipeline",
    "04_ring_attention",
    "05_experts",
    "06_chat_finetune",
]
CELL_TIMEOUT_S = 300  # a generous bound per cell; a whole notebook takes ~15-60 s on 2 cores


def read(name: str) -> nbformat.NotebookNode:
    return nbformat.read(os.path.join(EXAMPLES, f"{name}.ipynb"), as_version=4)


def _runs_this_python(argv: list[str]) -> bool:
    """Whether a kernel spec's command starts this interpreter. jupyter_client replaces a bare
    'python', 'python3' or 'python3.X' with sys.executable; an absolute path must be this one
    (compared unresolved: a venv's python is a symlink to the base interpreter)."""
    names = {"python", f"python{sys.version_info[0]}", f"python{sys.version_info[0]}.{sys.version_info[1]}"}
    if not argv:
        return False
    if argv[0] in names:
        return True
    found = shutil.which(argv[0]) or argv[0]
    return os.path.abspath(found) == os.path.abspath(sys.executable)


@pytest.fixture(scope="module")
def kernel_env(tmp_path_factory):
    """The kernel's environment; a kernel spec of this Python on JUPYTER_PATH where the
    installed `python3` spec would start another interpreter."""
    # JAX_PLATFORMS (cpu, conftest.py) left out: the notebook's first cell picks the backend, as
    # on a user's machine.
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    env["JAXPAR_NOTEBOOK_SMALL"] = "1"
    try:
        spec = KernelSpecManager().get_kernel_spec("python3")
        ok = _runs_this_python(spec.argv)
    except NoSuchKernel:
        ok = False
    with pytest.MonkeyPatch.context() as patch:
        if not ok:
            jupyter_dir = tmp_path_factory.mktemp("jupyter")
            kernel_dir = jupyter_dir / "kernels" / "python3"
            kernel_dir.mkdir(parents=True)
            (kernel_dir / "kernel.json").write_text(
                json.dumps(
                    {
                        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
                        "display_name": "Python 3 (jaxpar tests)",
                        "language": "python",
                    }
                )
            )
            path = os.pathsep.join(p for p in (str(jupyter_dir), os.environ.get("JUPYTER_PATH")) if p)
            patch.setenv("JUPYTER_PATH", path)  # read here, where the kernel spec is looked up
            env["JUPYTER_PATH"] = path
        yield env


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_runs_top_to_bottom(name, kernel_env, tmp_path):
    nb = read(name)
    client = NotebookClient(
        nb, timeout=CELL_TIMEOUT_S, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
    )
    client.execute(env=kernel_env)  # raises CellExecutionError, with the traceback, on any error
    outputs = [o for cell in nb.cells for o in cell.get("outputs", [])]
    assert not [o for o in outputs if o.output_type == "error"]
    # With the CUDA plugin installed and no driver (the gpu-compile extra on a CPU machine), a
    # backend started without jaxpar.mesh.emulate_cpu_devices logs a cuInit(0) traceback first.
    # Without the plugin nothing is tried, and this holds either way.
    logged = "".join(o.get("text", "") for o in outputs if o.output_type == "stream")
    assert "cuInit" not in logged and "Traceback" not in logged, logged[-2000:]


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_is_committed_without_outputs(name):
    for cell in read(name).cells:
        if cell.cell_type == "code":
            assert cell.outputs == [], f"{name}: cell {cell.id} has outputs; strip them"
            assert cell.execution_count is None, f"{name}: cell {cell.id} has an execution count"


def load_generator():
    spec = importlib.util.spec_from_file_location(
        "make_notebooks", os.path.join(EXAMPLES, "make_notebooks.py")
    )
    generator = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(generator)
    return generator


def pyproject_url() -> str:
    """`[project.urls] Repository` of pyproject.toml, as written there."""
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        return tomllib.load(f)["project"]["urls"]["Repository"]


URL = re.compile(r"https?://[^\s\"'()<>\]]+")
BADGE_IMAGE = "https://colab.research.google.com/assets/colab-badge.svg"


def assert_urls_are(nb: nbformat.NotebookNode, name: str, repo_url: str) -> None:
    """Every URL in the notebook's cells is `repo_url` (https://github.com/OWNER/NAME, in the
    install cell), its Colab badge for that repository, or the badge's image; all three are
    there."""
    owner_name = load_generator().github_path(repo_url)
    opens = f"https://colab.research.google.com/github/{owner_name}/blob/main/examples/{name}.ipynb"
    allowed = {f"https://github.com/{owner_name}", BADGE_IMAGE, opens}
    found = set(URL.findall("\n".join(cell.source for cell in nb.cells)))
    assert found == allowed, f"{name}: {sorted(found - allowed)} not from {repo_url}"
    assert f"({BADGE_IMAGE})]({opens})" in nb.cells[0].source  # the badge, first
    setup = next(cell.source for cell in nb.cells if cell.cell_type == "code")
    assert f'REPO_URL = "https://github.com/{owner_name}"' in setup


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_every_url_in_the_notebooks_is_the_repository_of_pyproject(name):
    assert_urls_are(read(name), name, pyproject_url())


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_opens_with_a_colab_badge_and_the_device_setup(name):
    cells = read(name).cells
    assert cells[0].cell_type == "markdown" and "colab-badge.svg" in cells[0].source
    setup = next(cell.source for cell in cells if cell.cell_type == "code")
    assert 'if importlib.util.find_spec("jaxpar") is None:' in setup
    assert "emulate_cpu_devices(RuntimeConfig(cpu_devices=8))" in setup
    assert 'os.environ.get("JAXPAR_NOTEBOOK_SMALL") == "1"' in setup
    assert setup.index('os.environ["XLA_FLAGS"]') < setup.index("import jax")


def test_notebooks_equal_their_generator():
    """examples/make_notebooks.py writes exactly the committed files (edit it, then rerun it)."""
    generator = load_generator()
    assert sorted(generator.NOTEBOOKS) == NOTEBOOKS
    url = generator.repository_url()
    for name in NOTEBOOKS:
        with open(os.path.join(EXAMPLES, f"{name}.ipynb")) as f:
            committed = f.read()
        assert nbformat.writes(generator.build(name, url)).rstrip() == committed.rstrip(), (
            f"examples/{name}.ipynb differs from examples/make_notebooks.py; run "
            "python examples/make_notebooks.py"
        )


FORK = "https://github.com/someone/jaxpar-fork"


def write_pyproject(path, urls: str) -> str:
    path.write_text(f'[project]\nname = "jaxpar"\n\n{urls}\n')
    return str(path)


@pytest.mark.parametrize("written", [FORK, FORK + ".git", FORK + "/"])
def test_the_generator_takes_the_repository_from_pyproject(written, tmp_path, monkeypatch):
    generator = load_generator()
    monkeypatch.setattr(
        generator,
        "PYPROJECT",
        write_pyproject(tmp_path / "pyproject.toml", f'[project.urls]\nRepository = "{written}"'),
    )
    assert generator.main([str(tmp_path / "out")]) == 0
    for name in NOTEBOOKS:
        nb = nbformat.read(tmp_path / "out" / f"{name}.ipynb", as_version=4)
        assert_urls_are(nb, name, FORK)


@pytest.mark.parametrize(
    "urls,message",
    [
        (
            '[project.urls]\nRepository = "https://gitlab.com/someone/jaxpar"',
            "is not of the form https://github.com/OWNER/NAME",
        ),
        (
            '[project.urls]\nHomepage = "https://github.com/someone/jaxpar"',
            "has no [project.urls] Repository",
        ),
    ],
)
def test_the_generator_refuses_a_repository_colab_cannot_open(urls, message, tmp_path, capsys, monkeypatch):
    generator = load_generator()
    monkeypatch.setattr(generator, "PYPROJECT", write_pyproject(tmp_path / "pyproject.toml", urls))
    assert generator.main([str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and err.count("\n") == 1, err
    assert not (tmp_path / "out").exists()


# --- The install cell ---------------------------------------------------------------------------


def setup_functions(**names) -> dict:
    """find_checkout and install_jaxpar as the first notebook's first cell defines them, run
    against `names` (REPO_URL, subprocess, sys, ... stand-ins) for their globals."""
    setup = next(cell.source for cell in read(NOTEBOOKS[0]).cells if cell.cell_type == "code")
    tree = ast.parse(setup)
    functions = [node for node in tree.body if isinstance(node, ast.FunctionDef)]
    assert [f.name for f in functions] == ["find_checkout", "install_jaxpar"]
    namespace = {"importlib": importlib, "os": os, **names}
    code = compile(ast.Module(body=functions, type_ignores=[]), "setup", "exec")
    exec(code, namespace)  # noqa: S102 (the notebook's own cell)
    return namespace


def make_checkout(folder: Path) -> Path:
    (folder / "jaxpar").mkdir(parents=True)
    (folder / "jaxpar" / "__init__.py").write_text("")
    (folder / "pyproject.toml").write_text('[project]\nname = "jaxpar"\n')
    (folder / "examples").mkdir()
    return folder


def test_the_install_cell_finds_the_checkout_above_or_beside_the_notebook(tmp_path):
    find_checkout = setup_functions()["find_checkout"]
    repo = make_checkout(tmp_path / "clone")
    assert find_checkout(repo / "examples") == repo  # opened from a checkout
    content = tmp_path / "content"  # Colab's folder: the repository uploaded beside the notebook
    (content / "sample_data").mkdir(parents=True)
    uploaded = make_checkout(content / "jaxpar-main")
    assert find_checkout(content) == uploaded
    (tmp_path / "alone").mkdir()
    assert find_checkout(tmp_path / "alone") is None
    assert find_checkout(Path(EXAMPLES)) == Path(ROOT)  # this repository's own notebooks


class Recorder:
    """A stand-in for the subprocess module: records each command, and makes `git clone` lay a
    checkout (or fail, with `clone_fails`)."""

    def __init__(self, clone_fails: bool = False):
        self.commands, self.clone_fails = [], clone_fails

    def run(self, command, check=False, env=None):
        self.commands.append(command)
        if command[:2] == ["git", "clone"]:
            assert env["GIT_TERMINAL_PROMPT"] == "0"  # never waits for a password
            if not self.clone_fails:
                make_checkout(Path(command[-1]))
        return subprocess.CompletedProcess(command, 128 if self.clone_fails else 0)


class FakeSys:
    executable = "/the/kernel/python"

    def __init__(self):
        self.path = []


@pytest.mark.parametrize("where", ["checkout", "uploaded beside", "nowhere: clone"])
def test_the_install_cell_installs_the_checkout_or_a_clone_of_the_repository(where, tmp_path):
    content = tmp_path / "content"
    content.mkdir()
    if where == "checkout":  # the notebook in examples/ of a clone
        want = make_checkout(tmp_path / "repo")
        start = want / "examples"
    elif where == "uploaded beside":
        start, want = content, make_checkout(content / "jaxpar-upload")
    else:
        start, want = content, content / "jaxpar"
    runner, fake_sys = Recorder(), FakeSys()
    functions = setup_functions(REPO_URL=FORK, subprocess=runner, sys=fake_sys)
    functions["install_jaxpar"](start)
    pip = ["/the/kernel/python", "-m", "pip", "install", "-q", "-e", str(want)]
    if where == "nowhere: clone":
        assert runner.commands == [["git", "clone", "--quiet", "--depth=1", FORK, str(want)], pip]
    else:
        assert runner.commands == [pip]
    assert fake_sys.path == [str(want)]


def test_the_install_cell_says_what_to_do_when_the_clone_fails(tmp_path):
    runner = Recorder(clone_fails=True)
    functions = setup_functions(REPO_URL=FORK, subprocess=runner, sys=FakeSys())
    with pytest.raises(RuntimeError, match=f"git could not clone {FORK}: upload the repository"):
        functions["install_jaxpar"](tmp_path)
    assert len(runner.commands) == 1  # no pip install after it
