"""Every named error of jaxtrain and the exit code it ends a command with.

A module raises these by name and imports them from here, never from a heavy module, so an
exception class drags in no dependencies and causes no import cycle. The commands catch
:class:`JaxtrainError` once (``jaxtrain.cli.common``): ``error: <key>: <message>`` on stderr,
then ``exit_code``.

Exit codes of ``python -m jaxtrain.train`` (the others use 0, 1 and 2):

====  ==================================================================================
0     done, or stopped cleanly by SIGTERM/SIGINT (also during start-up)
1     a remote service failed (:class:`SubmitError`, :class:`RegistryError`), or a bug
2     bad input (:class:`InputError` and its subclasses); nothing saved was damaged
3     the run diverged (:class:`NonFiniteError`)
4     a checkpoint save stuck past ``checkpoint.save_timeout_s`` (:class:`SaveTimeoutError`)
5     a multi-process job whose processes did not all join, or one stopped answering
      (:data:`PEER_EXIT`); a step or collective stuck past ``train.hang_timeout_s``
      (:data:`HANG_EXIT`)
75    the preemption grace period (``checkpoint.grace_period_s``) expired (:data:`GRACE_EXIT`)
====  ==================================================================================
"""
from __future__ import annotations

PEER_EXIT = 5  # a peer did not join in time, or stopped answering
HANG_EXIT = 5  # alive but stuck: the job cannot go on, as when a peer is lost
GRACE_EXIT = 75  # EX_TEMPFAIL: the job may be retried
NO_RETRY_EXITS = {2: "bad input", 3: "the run diverged"}  # exit codes a restart cannot fix (launchers end the job)


class JaxtrainError(Exception):
    """Base of the errors a run reports by name instead of a traceback."""

    exit_code = 1


class InputError(JaxtrainError):
    """Bad input (config, data, checkpoint, path, environment): nothing was trained or damaged."""

    exit_code = 2


class ConfigError(InputError, ValueError):
    """A config key, type or value is wrong. The message names the key."""


class ShardingError(InputError, ValueError):
    """A logical->mesh mapping that cannot be honoured without silent replication."""


class DataError(InputError, ValueError):
    """Bad input data: a missing path, a corpus too short, a malformed record, a tokenizer mismatch."""


class CheckpointError(InputError, RuntimeError):
    """A checkpoint cannot be saved or restored into the current run."""


class CorruptCheckpointError(InputError, RuntimeError):
    """A committed checkpoint step's files differ from what its commit marker recorded."""


class LaunchError(InputError):
    """Bad launcher input (a flag, the config, a missing client library): nothing was submitted. Exit 2."""


class AttentionBackendError(ConfigError):
    """An explicit ``model.attention`` choice cannot run on the current backend."""


class NonFiniteError(JaxtrainError):
    """The run diverged: ``train.max_nonfinite_steps`` steps in a row had a non-finite loss or
    gradient, every step of the run was skipped, or the validation loss is not finite."""

    exit_code = 3


class SaveTimeoutError(JaxtrainError, RuntimeError):
    """A save did not finish within ``checkpoint.save_timeout_s``. The process should exit at once
    (``hard_exit``): Orbax's writer thread may never return."""

    exit_code = 4
    hard_exit = True


class SubmitError(JaxtrainError):
    """The scheduler or API refused or failed the submission (an HTTP 4xx/5xx, sbatch failing). Exit 1."""

    exit_code = 1


class RegistryError(JaxtrainError):
    """The model registry did not take a version as exported: it ended FAILED_REGISTRATION, was not
    READY in time, or its files differ from the export. The alias was not moved. Exit 1: the service
    failed, not the input (as :class:`SubmitError`)."""

    exit_code = 1


class StorageError(RuntimeError):
    """The checkpoint location cannot be used (missing library, missing bucket, bad URL)."""


class PeerSaveError(RuntimeError):
    """Another process of the job failed its part of a save (its own log says why)."""


class RingAttentionError(ValueError):
    """Ring attention cannot run with these shapes/rules (names the dimension and axis)."""


class StartupInterrupted(BaseException):
    """SIGTERM/SIGINT arrived while a training run was starting (before its first step).

    Raised at the start-up's phase boundaries (``jaxtrain.runtime.signals.check_startup``), never
    from inside the signal handler (an exception there can land inside a native import). A
    BaseException, so no ``except Exception`` on the way swallows it; the command line turns it
    into exit code 0 with a line saying nothing was trained.
    """

    def __init__(self, signum: int):
        import signal
        super().__init__(signum)
        self.signum = signum
        self.name = signal.Signals(signum).name
