"""The example notebooks run top to bottom, and are committed as their generator writes them.

Each notebook executes in a fresh Jupyter kernel of this Python (the venv) with
JAXPAR_NOTEBOOK_SMALL=1, which shrinks steps and sizes for CI. The kernel inherits the session's
XLA_FLAGS (compile options only, conftest.py) and sets up its own 8 devices, as it does on Colab.
"""

import importlib.util
import json
import os
import re
import shutil
import sys

import nbformat
import pytest
from jupyter_client.kernelspec import KernelSpecManager, NoSuchKernel
from nbclient import NotebookClient

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(ROOT, "examples")
NOTEBOOKS = ["01_quickstart", "02_data_fsdp_tensor", "03_pipeline", "04_ring_attention",
             "05_experts"]
CELL_TIMEOUT_S = 300  # a generous bound per cell; a whole notebook takes ~10-25 s on 2 cores


def read(name: str) -> nbformat.NotebookNode:
    return nbformat.read(os.path.join(EXAMPLES, f"{name}.ipynb"), as_version=4)


def _runs_this_python(argv: list[str]) -> bool:
    """Whether a kernel spec's command starts this interpreter. jupyter_client replaces a bare
    'python', 'python3' or 'python3.X' with sys.executable; an absolute path must be this one
    (compared unresolved: a venv's python is a symlink to the base interpreter)."""
    names = {"python", f"python{sys.version_info[0]}", "python%d.%d" % sys.version_info[:2]}
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
    env = dict(os.environ, JAXPAR_NOTEBOOK_SMALL="1")
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
            (kernel_dir / "kernel.json").write_text(json.dumps({
                "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
                "display_name": "Python 3 (jaxpar tests)", "language": "python"}))
            path = os.pathsep.join(p for p in (str(jupyter_dir), os.environ.get("JUPYTER_PATH")) if p)
            patch.setenv("JUPYTER_PATH", path)  # read here, where the kernel spec is looked up
            env["JUPYTER_PATH"] = path
        yield env


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_runs_top_to_bottom(name, kernel_env, tmp_path):
    nb = read(name)
    client = NotebookClient(nb, timeout=CELL_TIMEOUT_S, kernel_name="python3",
                            resources={"metadata": {"path": str(tmp_path)}})
    client.execute(env=kernel_env)  # raises CellExecutionError, with the traceback, on any error
    errors = [o for cell in nb.cells for o in cell.get("outputs", []) if o.output_type == "error"]
    assert not errors


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_is_committed_without_outputs(name):
    for cell in read(name).cells:
        if cell.cell_type == "code":
            assert cell.outputs == [], f"{name}: cell {cell.id} has outputs; strip them"
            assert cell.execution_count is None, f"{name}: cell {cell.id} has an execution count"


def load_generator():
    spec = importlib.util.spec_from_file_location("make_notebooks",
                                                  os.path.join(EXAMPLES, "make_notebooks.py"))
    generator = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(generator)
    return generator


INSTALL = re.compile(r'"jaxpar @ git\+(https://github\.com/([\w.-]+/[\w.-]+))"')


def installed_from(name: str) -> re.Match:
    """The install line of the notebook's first code cell: (repository URL, OWNER/NAME)."""
    setup = next(cell.source for cell in read(name).cells if cell.cell_type == "code")
    match = INSTALL.search(setup)
    assert match, f"{name}: no 'jaxpar @ git+https://github.com/OWNER/NAME' in the first code cell"
    return match


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_opens_with_a_colab_badge_and_the_device_setup(name):
    cells = read(name).cells
    assert cells[0].cell_type == "markdown"
    repo = installed_from(name)[2]  # the badge opens the notebook from the repository it installs
    assert (f"https://colab.research.google.com/github/{repo}/blob/main/examples/{name}.ipynb"
            in cells[0].source)
    setup = next(cell.source for cell in cells if cell.cell_type == "code")
    assert 'if "google.colab" in sys.modules' in setup
    assert 'jax.config.update("jax_num_cpu_devices", 8)' in setup
    assert setup.index("xla_force_host_platform_device_count=8") < setup.index("import jax")
    assert 'os.environ.get("JAXPAR_NOTEBOOK_SMALL") == "1"' in setup


def test_notebooks_equal_their_generator():
    """examples/make_notebooks.py writes exactly the committed files (edit it, then rerun it),
    all of them for one repository URL: its REPO_URL, or the --repo-url they were written with."""
    generator = load_generator()
    assert sorted(generator.NOTEBOOKS) == NOTEBOOKS
    urls = {installed_from(name)[1] for name in NOTEBOOKS}
    assert len(urls) == 1, f"the notebooks name different repositories: {sorted(urls)}"
    (url,) = urls
    for name in NOTEBOOKS:
        with open(os.path.join(EXAMPLES, f"{name}.ipynb")) as f:
            committed = f.read()
        assert nbformat.writes(generator.build(name, url)).rstrip() == committed.rstrip(), (
            f"examples/{name}.ipynb differs from examples/make_notebooks.py; run "
            f"python examples/make_notebooks.py --repo-url {url}")


FORK = "https://github.com/someone/jaxpar-fork"


def assert_written_for_fork(out_dir, generator) -> None:
    for name in NOTEBOOKS:
        written = nbformat.read(os.path.join(out_dir, f"{name}.ipynb"), as_version=4)
        setup = next(cell.source for cell in written.cells if cell.cell_type == "code")
        assert INSTALL.search(setup)[1] == FORK
        assert (f"https://colab.research.google.com/github/someone/jaxpar-fork/blob/main/examples/"
                f"{name}.ipynb") in written.cells[0].source
        text = nbformat.writes(written)
        assert generator.github_path(generator.REPO_URL) not in text  # the setting's one use
        assert generator._REPO not in text


@pytest.mark.parametrize("url", [FORK, FORK + ".git", FORK + "/"])
def test_the_repository_url_flag_reaches_the_badge_and_the_install_cell(url, tmp_path):
    generator = load_generator()
    generator.main([str(tmp_path), "--repo-url", url])
    assert_written_for_fork(tmp_path, generator)


def test_the_repository_url_comes_from_the_environment_too(tmp_path, monkeypatch):
    generator = load_generator()
    monkeypatch.setenv(generator.REPO_URL_ENV, FORK)
    generator.main([str(tmp_path)])
    assert_written_for_fork(tmp_path, generator)


def test_the_generator_refuses_a_repository_colab_cannot_open(tmp_path):
    generator = load_generator()
    with pytest.raises(SystemExit) as info:
        generator.main([str(tmp_path), "--repo-url", "https://gitlab.com/someone/jaxpar"])
    assert info.value.code == 2
    assert not list(tmp_path.iterdir())
