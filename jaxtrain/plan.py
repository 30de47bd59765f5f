"""``python -m jaxtrain.plan``: the command line of ``jaxtrain.analysis.plan``."""
import sys

from jaxtrain.analysis.plan import main

if __name__ == "__main__":
    sys.exit(main())
