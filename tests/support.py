"""Helpers the tests import (conftest.py holds the fixtures; a module named conftest cannot be
imported reliably, since tests/gpu has its own)."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional

REPO = Path(__file__).resolve().parent.parent
SCENARIOS = REPO / "scenarios"

# The smoke shape, small enough for in-process tests and for scenario files written by tests.
BASE_SCENARIO: Dict[str, Any] = {
    "description": "test shape",
    "model": {"hidden": 256, "tokens_per_rank": 16, "topk": 4, "experts_per_rank": 4,
              "dispatch_dtype": "bf16"},
    "topology": {"name": "test", "nodes": 1, "gpus_per_node": 4},
    "routing": {"kind": "uniform", "seed": 1},
    "bench": {"warmup": 1, "iters": 2, "backends": ["reference"], "sms": [4], "device": "cpu"},
}

DROP = object()  # in scenario_dict: remove this key


def scenario_dict(**sections: Dict[str, Any]) -> Dict[str, Any]:
    """BASE_SCENARIO with some keys of some sections replaced (a value of ``DROP`` removes it)."""
    data = copy.deepcopy(BASE_SCENARIO)
    for section, changes in sections.items():
        if not isinstance(changes, dict):
            data[section] = changes
            continue
        for key, value in changes.items():
            if value is DROP:
                data[section].pop(key, None)
            else:
                data[section][key] = value
    return data


@dataclass
class Result:
    code: int
    out: str
    err: str

    @property
    def both(self) -> str:
        return self.out + self.err


def epbench(*args: str, timeout: float = 240, env: Optional[Dict[str, str]] = None) -> Result:
    """``python -m epbench ARGS`` from the repository root, as a user would type it."""
    full_env = {k: v for k, v in os.environ.items()
                if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "EPBENCH_DEBUG")}
    full_env.update(env or {})
    p = subprocess.run([sys.executable, "-m", "epbench", *map(str, args)], cwd=REPO,
                       capture_output=True, text=True, timeout=timeout, env=full_env)
    return Result(p.returncode, p.stdout, p.stderr)


def fake_venv(root: Path, flavor: str, python_target: str = "/bin/true", nccl: Optional[dict] = None) -> str:
    """A folder shaped like a venv `make baselines` built a DeepEP flavor into: bin/python (a link
    to ``python_target``) and the build stamp. Returns its python."""
    from epbench import provenance

    (root / "bin").mkdir(parents=True)
    python = root / "bin" / "python"
    python.symlink_to(python_target)
    stamp = {"flavor": flavor, "commit": "c0ffee"}
    if nccl:
        stamp["nccl"] = nccl
    (root / provenance.BASELINES_STAMP).write_text(json.dumps(stamp))
    return str(python)


class StartedRanks(BaseException):
    """An in-process command tried to start ranks (see epbench_here); not an Exception, so that
    epbench's own error handling cannot turn it into an error line."""


def epbench_here(*args: str, env: Optional[Dict[str, str]] = None) -> Result:
    """``epbench ARGS`` in this process, for commands that start no ranks (bad input, validate,
    report, plot, compare, predict): what ``python -m epbench`` runs (cli.main), from the
    repository root, with the same environment as epbench(), and stdout, stderr and exit code
    caught as a child's would be; a traceback that would end a child goes to ``err``. It saves
    the start-up of a process that imports torch. Consoles, environment, working folder, signal
    handlers and warning filters are put back afterwards; warnings and log records reach ``err``
    as they would a child's stderr. A command that gets as far as starting ranks raises
    StartedRanks: such a command needs epbench()."""
    import contextlib
    import io
    import logging
    import signal
    import traceback
    import warnings

    from epbench import cli, console, launch

    def no_ranks(*_args: Any, **_kwargs: Any) -> None:
        raise StartedRanks(f"epbench {' '.join(map(str, args))} started ranks: use epbench()")

    out, err = io.StringIO(), io.StringIO()
    saved_env, saved_cwd, saved_argv = dict(os.environ), os.getcwd(), sys.argv
    saved_signals = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    saved_consoles = cli.console, cli.err
    saved_run_job = launch.run_job
    root = logging.getLogger()
    saved_handlers = root.handlers[:]
    code = 0
    try:
        for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "EPBENCH_DEBUG"):
            os.environ.pop(k, None)
        os.environ.update(env or {})
        os.chdir(REPO)
        sys.argv = ["epbench", *map(str, args)]
        launch.run_job = no_ranks
        root.handlers = []  # records then reach logging's last resort: this stderr
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), \
                warnings.catch_warnings():
            warnings.resetwarnings()  # a fresh interpreter's filters
            for category in (DeprecationWarning, PendingDeprecationWarning, ImportWarning, ResourceWarning):
                warnings.simplefilter("ignore", category)
            warnings.showwarning = _warning_to_stderr
            # made now, as a child makes them at import: its output is a pipe, not this terminal
            cli.console, cli.err = console.wide_console(), console.wide_console(stderr=True)
            try:
                cli.main()
            except SystemExit as e:
                if e.code is None or isinstance(e.code, int):
                    code = e.code or 0
                else:  # sys.exit(text): the interpreter prints the text and exits 1
                    print(e.code, file=sys.stderr)
                    code = 1
            except Exception:
                traceback.print_exc()
                code = 1
    finally:
        cli.console, cli.err = saved_consoles
        launch.run_job = saved_run_job
        root.handlers = saved_handlers
        for s, handler in saved_signals.items():
            signal.signal(s, handler)
        sys.argv = saved_argv
        os.chdir(saved_cwd)
        os.environ.clear()
        os.environ.update(saved_env)
    return Result(code, out.getvalue(), err.getvalue())


def _warning_to_stderr(message, category, filename, lineno, file=None, line=None) -> None:
    import warnings

    sys.stderr.write(warnings.formatwarning(message, category, filename, lineno, line))


def assert_one_line_error(r: Result, *needles: str) -> str:
    """Exit 2, stderr is exactly one line that contains every needle, no traceback."""
    assert r.code == 2, f"exit {r.code}\nstdout:\n{r.out}\nstderr:\n{r.err}"
    assert "Traceback" not in r.both, r.both
    lines = r.err.strip().splitlines()
    assert len(lines) == 1, f"expected one line on stderr, got {len(lines)}:\n{r.err}"
    for n in needles:
        assert n in lines[0], f"{n!r} not in {lines[0]!r}"
    return lines[0]


# -- the real multi-process runs -------------------------------------------------------------

@dataclass
class Run:
    result: Result
    dir: Optional[Path]  # the run folder it wrote (None if it wrote none)

    def meta(self) -> Dict[str, Any]:
        return json.loads((self.dir / "meta.json").read_text())

    def rows(self):
        """The measured rows (as results.load_run gives them to every reader)."""
        from epbench.results import load_run

        return load_run(self.dir)[1]

    def all_rows(self):
        """results.csv as written: with the skipped and failed points' rows."""
        import pandas as pd

        return pd.read_csv(self.dir / "results.csv")

    def samples(self):
        import pandas as pd

        return pd.read_csv(self.dir / "samples.csv")


def _new_dirs(root: Path, before: List[Path]) -> List[Path]:
    return sorted(set(root.iterdir()) - set(before)) if root.exists() else []


def run_cli(root: Path, *args: str) -> Run:
    """Runs an epbench command that writes under ``root``; returns it with the folder it made."""
    before = list(root.iterdir()) if root.exists() else []
    r = epbench(*args, "--results", str(root))
    new = _new_dirs(root, before)
    assert len(new) <= 1, f"one command made several folders: {new}"
    return Run(r, new[0] if new else None)
