"""Models, written once with logical axis names (no mesh names in here)."""

from jaxpar.models.llama import Transformer, matmul_params

__all__ = ["Transformer", "matmul_params"]
