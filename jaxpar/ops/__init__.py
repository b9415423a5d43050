"""Matmul pieces that the model and the expert exchange both call: float8 matmuls (`fp8`) and the
SwiGLU feed-forward kernel (`swiglu`)."""
