"""``python -m jaxtrain.export``: the command line of ``jaxtrain.cli.export``."""
import sys

from jaxtrain.cli.export import main

if __name__ == "__main__":
    sys.exit(main())
