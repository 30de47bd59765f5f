"""``python -m jaxtrain.train``: see ``jaxtrain.cli.train``."""
import sys

from jaxtrain.cli.train import main

sys.exit(main())
