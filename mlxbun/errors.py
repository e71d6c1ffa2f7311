"""Errors that the command boundary turns into one line and an exit code."""


class InputError(Exception):
    """Bad input from the user: one line naming the input, the value and what is allowed.

    The CLI prints ``error: <message>`` and exits with code 2 (traceback only with verbose=true).
    """

    exit_code = 2


class DriftError(Exception):
    """A verification found a difference (hash drift, corrupt block): exit code 1."""

    exit_code = 1
