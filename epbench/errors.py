"""Errors the CLI prints as one line: user mistakes (exit 2); failed verification, failed start-up
and timeouts (exit 1)."""


class UserError(Exception):
    """Bad input from the user (scenario file, option, results folder)."""

    exit_code = 2


class VerificationFailed(Exception):
    """A measured configuration produced wrong results; the run exits non-zero."""

    exit_code = 1


class StartupError(RuntimeError):
    """The machinery between ranks could not start (e.g. NVSHMEM's bootstrap); the run exits 1."""

    exit_code = 1


class KernelTimeout(RuntimeError):
    """A kernel gave up waiting on a peer after the scenario's ``bench.timeout_s``."""

    exit_code = 1


class ControlTimeout(RuntimeError):
    """Ranks did not meet at a barrier or gather within the control-plane timeout."""

    exit_code = 1


def first_line(e: BaseException) -> str:
    """An unexpected error as one line: its type and the first line of its message."""
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0] if lines else 'no detail'}"


def one_line(e: BaseException) -> str:
    """What the user reads of ``e``: one of the errors above says its whole message on one line;
    anything else its type and first line."""
    known = (UserError, VerificationFailed, StartupError, ControlTimeout, KernelTimeout)
    return " ".join(str(e).splitlines()) if isinstance(e, known) else first_line(e)
