"""`python -m jaxpar.convert ...`: import a Hugging Face model (a directory or a Hub id) as a jaxpar run. The
command is `jaxpar.hf.convert`'s."""

if __name__ == "__main__":
    import sys

    from jaxpar.config import RuntimeConfig
    from jaxpar.mesh import emulate_cpu_devices, use_compile_cache

    # One CPU device on a CPU machine, and the CPU directly where the CUDA plugin is installed
    # without a driver (no cuInit traceback); before the backend starts.
    emulate_cpu_devices(RuntimeConfig(cpu_devices=1))
    use_compile_cache(RuntimeConfig())  # runtime.compile_cache's default: auto (jaxpar/mesh.py)

    from jaxpar.hf.convert import main

    sys.exit(main())
