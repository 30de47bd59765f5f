"""``python -m jaxtrain.plan``: the command line of ``jaxtrain.cli.plan``."""
import sys

from jaxtrain.cli.plan import main

if __name__ == "__main__":
    sys.exit(main())
