"""``python -m jaxtrain.train``: see ``jaxtrain.cli.train``."""
import sys

from jaxtrain.train import preempt

preempt.during_startup()  # before anything heavy is imported: a SIGTERM from now on is a clean exit 0

from jaxtrain.cli.train import main  # noqa: E402

sys.exit(main())
