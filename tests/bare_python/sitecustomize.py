"""Put this folder first on PYTHONPATH and Python behaves as on a machine with only the `test`
extra (what `make train` and `pip install -e ".[test]"` build): the CUDA plugin's packages cannot
be imported and its entry points are not advertised, even where the `gpu-compile` extra is
installed. Imported by Python's `site` at start-up (tests/test_entry_points.py)."""

import importlib.abc
import importlib.metadata

# What the `gpu-compile` extra adds to the import system: the PJRT plugin (under the `jax_plugins`
# namespace, which exists only while some plugin is installed), its kernels and NVIDIA's libraries.
HIDDEN = ("jax_plugins", "jax_cuda12_plugin", "jax_cuda12_pjrt", "nvidia")


class _HideGpuExtra(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in HIDDEN:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


_all_entry_points = importlib.metadata.entry_points


def _entry_points(**selection):
    if selection.get("group") == "jax_plugins":
        return importlib.metadata.EntryPoints(())
    return _all_entry_points(**selection)


import sys  # noqa: E402

sys.meta_path.insert(0, _HideGpuExtra())
importlib.metadata.entry_points = _entry_points
