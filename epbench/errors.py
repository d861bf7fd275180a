"""Errors the CLI prints as one line: user mistakes (exit 2), failed verification and failed start-up (exit 1)."""


class UserError(Exception):
    """Bad input from the user (scenario file, option, results folder)."""

    exit_code = 2


class VerificationFailed(Exception):
    """A measured configuration produced wrong results; the run exits non-zero."""

    exit_code = 1


class StartupError(RuntimeError):
    """The machinery between ranks could not start (e.g. NVSHMEM's bootstrap); the run exits 1."""

    exit_code = 1
