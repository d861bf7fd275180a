"""Rich consoles: rich assumes 80 columns when output is not a terminal (logs, CI), which
folds the results table; give such output room."""

from rich.console import Console


def wide_console(stderr: bool = False) -> Console:
    c = Console(stderr=stderr)
    return c if c.is_terminal else Console(stderr=stderr, width=200)
