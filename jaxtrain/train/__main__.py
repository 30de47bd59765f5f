"""``python -m jaxtrain.train``: see ``jaxtrain.cli.train``."""
import sys

from jaxtrain.train import preempt

preempt.during_startup()  # before anything heavy is imported: a SIGTERM now is a clean exit 0
try:
    from jaxtrain.cli.train import main
except preempt.StartupInterrupted as stop:
    sys.exit(preempt.report_startup_stop(stop))

sys.exit(main())
