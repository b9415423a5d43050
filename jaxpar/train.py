"""`python -m jaxpar.train [CONFIG.yaml] [dotted.key=value ...]`: train a model. The loop is
`jaxpar.run.train`."""

if __name__ == "__main__":
    import os
    import signal

    # A Ctrl-C while the imports below load stops quietly, exit 130.
    signal.signal(signal.SIGINT, lambda *_: (os.write(2, b"interrupted during start-up\n"), os._exit(130)))

    import sys

    from jaxpar.run.train import main

    sys.exit(main())
