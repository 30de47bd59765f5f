"""``python -m jaxtrain.train``: the command line of ``jaxtrain.cli.train``."""

from jaxtrain.runtime import signals

signals.during_startup()  # before anything heavy is imported: a SIGTERM from now on is a clean exit 0

from jaxtrain.cli.common import exit_now  # noqa: E402
from jaxtrain.cli.train import main  # noqa: E402

exit_now(main())
