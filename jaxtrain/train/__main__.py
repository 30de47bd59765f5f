"""``python -m jaxtrain.train``: the command line of ``jaxtrain.cli.train``.

The command line is imported only when this module runs as the program, so nothing in the library
imports ``jaxtrain.cli`` from ``jaxtrain.train`` (the package import graph stays one way).
"""

if __name__ == "__main__":
    from jaxtrain.runtime import signals

    signals.during_startup()  # before anything heavy is imported: a SIGTERM from now on is a clean exit 0

    from jaxtrain.cli.common import exit_now
    from jaxtrain.cli.train import main

    exit_now(main())
