"""``python -m jaxtrain.explain``: the command line of ``jaxtrain.analysis.explain``."""
import sys

from jaxtrain.analysis.explain import main

if __name__ == "__main__":
    sys.exit(main())
