"""The command-line style of the tools here that a Makefile target runs (baselines.py, fidelity.py):
argparse, and bad input (a malformed option, epbench's UserError) as one line on stderr,
``<tool>: error: ...``, with exit code 2, as epbench's own CLI does."""

from __future__ import annotations

import argparse
import functools
import sys
from typing import Any, Callable, List, NoReturn, Optional

from epbench.errors import UserError


def error_line(tool: str, message: object) -> None:
    print(f"{tool}: error: {' '.join(str(message).split())}", file=sys.stderr)


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose usage errors are one line (``tool``: the name that line starts with)."""

    def __init__(self, tool: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.tool = tool

    def add_subparsers(self, **kwargs: Any) -> Any:  # a subcommand's errors are one line too
        kwargs.setdefault("parser_class", functools.partial(Parser, self.tool))
        return super().add_subparsers(**kwargs)

    def error(self, message: str) -> NoReturn:
        error_line(self.tool, message)
        raise SystemExit(2)


def run(tool: str, parse: Callable[[Optional[List[str]]], argparse.Namespace],
        body: Callable[[argparse.Namespace], int], argv: Optional[List[str]] = None) -> int:
    """``body(parse(argv))``'s exit code; --help is 0, a malformed option or a UserError one line
    and the error's code (2 for bad input)."""
    try:
        args = parse(argv)
    except SystemExit as e:  # --help (0), or a malformed option (2, its line already printed)
        return int(e.code or 0)
    try:
        return body(args)
    except UserError as e:
        error_line(tool, e)
        return e.exit_code
