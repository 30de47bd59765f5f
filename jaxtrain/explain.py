"""``python -m jaxtrain.explain``: the command line of ``jaxtrain.cli.explain``."""
import sys

from jaxtrain.cli.explain import main

if __name__ == "__main__":
    sys.exit(main())
