"""Errors that the command boundary turns into one line and an exit code."""

from __future__ import annotations

import signal


class InputError(Exception):
    """Bad input from the user: one line naming the input, the value and what is allowed.

    The CLI prints ``error: <message>`` and exits with code 2 (traceback only with verbose=true).
    """

    exit_code = 2


class DriftError(Exception):
    """A verification found a difference (hash drift, corrupt block): exit code 1."""

    exit_code = 1


class NumericFailure(Exception):
    """A computation gave values that must not be published (a NaN or Inf scale): exit code 1.

    The message names the module; nothing is published and the run is recorded as failed.
    """

    exit_code = 1


class EnvironmentFailure(Exception):
    """The machine, not the input, stopped the run (disk, permissions, database): exit code 1.

    The message names the path involved; the run is recorded as failed.
    """

    exit_code = 1


class Interrupted(KeyboardInterrupt):
    """A termination signal (SIGTERM from Slurm preemption, SIGINT) raised in the main thread.

    A KeyboardInterrupt so that ``except Exception`` does not swallow it and ``finally`` blocks
    (staging cleanup) run. Exit code 128 + the signal number.
    """

    def __init__(self, signum: int) -> None:
        self.signum = signum
        self.exit_code = 128 + signum
        super().__init__(signal.Signals(signum).name)
