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
