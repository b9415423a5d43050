"""jaxpar: a JAX/Flax NNX training stack for language models, every parallelism on one mesh."""

__version__ = "0.1.0"
