"""Rich consoles: rich assumes 80 columns when output is not a terminal (logs, CI), which
folds the results table; give such output room unless COLUMNS says how wide it is.

Every string they print passes through ``printable``: text from a scenario, a results folder's
files or a folder's name (a hand-edited meta.json, a CSV cell) reaches the terminal without the
control characters that would move its cursor, retitle it or recolour what follows."""

import math
import os
import re
from typing import Any, Optional, Sequence, Tuple

from rich.console import Console
from rich.table import Table

# C0 and C1 controls (ESC and CSI included) except newline and tab, and the bidirectional overrides
# that make text read in another order than it is stored
_CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")


def printable(text: str) -> str:
    """``text`` without control characters (newlines and tabs kept)."""
    return _CONTROL.sub("", text)


class SafeConsole(Console):
    """A rich Console that strips control characters from every string before rendering it:
    printed text, table cells, titles and captions all go through render_str."""

    def render_str(self, text: str, **kwargs):
        return super().render_str(printable(text), **kwargs)


def wide_console(stderr: bool = False) -> Console:
    c = SafeConsole(stderr=stderr)
    if c.is_terminal or os.environ.get("COLUMNS", "").isdigit():
        return c
    return SafeConsole(stderr=stderr, width=200)


# past this a figure is written with an exponent (1.23e+09): a 1e308 from a hand-edited file as 309
# digits would take a table's width; a real time (10 s = 1e7 us) or bandwidth stays plain
PLAIN_BELOW = 1e8


def number(v: object) -> str:
    """A figure as the tables show it: three significant figures at most, none wasted on big
    numbers (327, 41.2, 0.0123), an exponent past PLAIN_BELOW (1.23e+09); "-" where there is none."""
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    v = float(v)  # type: ignore[arg-type]
    if abs(v) >= PLAIN_BELOW:
        return f"{v:.3g}"
    if abs(v) >= 100:
        return f"{v:.0f}"
    return f"{v:.1f}" if abs(v) >= 10 else f"{v:.3g}"


def table(title: Optional[str], caption: Optional[str], columns: Sequence[Tuple[str, str]], **style: Any) -> Table:
    """Every table the tool prints starts here: a title, a caption saying what the figures are, and
    its columns as (header, justification); ``style`` passes rich's layout options (box, padding)."""
    t = Table(title=title or None, caption=caption or None, **style)
    for header, justify in columns:
        t.add_column(header, justify=justify)  # type: ignore[arg-type]
    return t
