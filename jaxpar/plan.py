"""`python -m jaxpar.plan [CONFIG.yaml] --gpus NxKIND [key=value ...]`: rank the layouts of a run
before anything compiles. The planner is `jaxpar.planning`."""

if __name__ == "__main__":
    import sys

    from jaxpar.planning.plan import main

    sys.exit(main())
