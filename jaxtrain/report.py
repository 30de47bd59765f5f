"""``python -m jaxtrain.report``: the command line of ``jaxtrain.cli.report``."""
import sys

from jaxtrain.cli.report import main

if __name__ == "__main__":
    sys.exit(main())
