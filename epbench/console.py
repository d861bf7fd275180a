"""Rich consoles: rich assumes 80 columns when output is not a terminal (logs, CI), which
folds the results table; give such output room unless COLUMNS says how wide it is."""

import os

from rich.console import Console


def wide_console(stderr: bool = False) -> Console:
    c = Console(stderr=stderr)
    if c.is_terminal or os.environ.get("COLUMNS", "").isdigit():
        return c
    return Console(stderr=stderr, width=200)
