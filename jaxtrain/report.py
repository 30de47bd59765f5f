"""``python -m jaxtrain.report``: the command line of ``jaxtrain.analysis.report``."""
import sys

from jaxtrain.analysis.report import main

if __name__ == "__main__":
    sys.exit(main())
