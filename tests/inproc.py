"""`epbench ARGS` run inside the test process through cli.main (the one-line error handling
included): a fraction of the cost of a subprocess, for commands that start no ranks."""

from __future__ import annotations

import sys

from support import Result


def epbench_here(monkeypatch, capsys, *args: object) -> Result:
    """Exit code, stdout and stderr of ``epbench ARGS`` as main() leaves them."""
    from epbench import cli

    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "EPBENCH_DEBUG"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(sys, "argv", ["epbench", *map(str, args)])
    capsys.readouterr()
    try:
        cli.main()
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    out, err = capsys.readouterr()
    return Result(code, out, err)
