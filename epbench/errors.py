"""One error type for user mistakes: the CLI prints its message as one line and exits 2."""


class UserError(Exception):
    """Bad input from the user (scenario file, option, results folder)."""

    exit_code = 2


class VerificationFailed(Exception):
    """A measured configuration produced wrong results; the run exits non-zero."""

    exit_code = 1
