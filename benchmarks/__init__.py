"""Throughput benchmarks of jaxpar's train step: `python -m benchmarks.bench CONFIG [overrides]`."""
