"""Results folders: ``results/<UTC time>_<scenario>/`` holding

- ``results.csv``: one row per backend x op x SMs x rank, raw numbers, units in column names;
- ``samples.csv``: every timed iteration (backend, op, sms, rank, iter, time_us);
- ``meta.json``: scenario, command line, versions, host, status.

Every write goes to a temporary file first and is renamed into place, and the tables are
rewritten after each measured point, so a sweep that dies keeps what it finished. A folder is
created exclusively: nothing ever overwrites an earlier run.
"""

from __future__ import annotations

import datetime
import json
import os
from pathlib import Path
from typing import Any, Dict, List, Tuple

import pandas as pd

from epbench.errors import UserError

RESULTS = "results.csv"
SAMPLES = "samples.csv"
META = "meta.json"


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def new_run_dir(root: Path, scenario_name: str) -> Path:
    """Creates and returns a fresh folder; never reuses an existing name."""
    root.mkdir(parents=True, exist_ok=True)
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    base = f"{stamp}_{scenario_name}"
    for i in range(1000):
        path = root / (base if i == 0 else f"{base}-{i}")
        try:
            path.mkdir()
            return path
        except FileExistsError:
            continue
    raise UserError(f"{root}: could not create a new run folder for {scenario_name}")


class RunWriter:
    def __init__(self, run_dir: Path, meta: Dict[str, Any]) -> None:
        self.dir = run_dir
        self.dir.mkdir(parents=True, exist_ok=True)
        if (self.dir / RESULTS).exists():
            raise UserError(f"{run_dir}: already holds results; refusing to overwrite them")
        self.meta = dict(meta, status="running")
        self.rows: List[Dict[str, Any]] = []
        self.samples: List[Dict[str, Any]] = []
        self._write_meta()

    def _write_meta(self) -> None:
        _atomic_write(self.dir / META, json.dumps(self.meta, indent=2, default=str) + "\n")

    def add(self, rows: List[Dict[str, Any]], samples: List[Dict[str, Any]]) -> None:
        self.rows += rows
        self.samples += samples
        _atomic_write(self.dir / RESULTS, pd.DataFrame(self.rows).to_csv(index=False))
        _atomic_write(self.dir / SAMPLES, pd.DataFrame(self.samples).to_csv(index=False))

    def finish(self, status: str, **extra: Any) -> None:
        self.meta.update(extra, status=status,
                         finished_utc=datetime.datetime.now(datetime.timezone.utc).isoformat())
        self._write_meta()


def is_run_dir(path: Path) -> bool:
    return (path / META).is_file()


def find_runs(paths: List[Path]) -> List[Path]:
    """Each path is a run folder or a folder of run folders."""
    runs: List[Path] = []
    for p in paths:
        if not p.exists():
            raise UserError(f"{p}: no such file or folder")
        if is_run_dir(p):
            runs.append(p)
        elif p.is_dir():
            runs += sorted(d for d in p.iterdir() if d.is_dir() and is_run_dir(d))
    if not runs:
        raise UserError(f"{', '.join(map(str, paths))}: no results folders (with {META}) found")
    return runs


def load_run(path: Path) -> Tuple[Dict[str, Any], pd.DataFrame]:
    if not is_run_dir(path):
        raise UserError(f"{path}: not a results folder (no {META})")
    try:
        meta = json.loads((path / META).read_text())
    except json.JSONDecodeError as e:
        raise UserError(f"{path / META}: not valid JSON ({e.msg} at line {e.lineno})") from None
    csv = path / RESULTS
    df = pd.read_csv(csv) if csv.is_file() and csv.stat().st_size else pd.DataFrame()
    return meta, df


def load_samples(path: Path) -> pd.DataFrame:
    csv = path / SAMPLES
    return pd.read_csv(csv) if csv.is_file() and csv.stat().st_size else pd.DataFrame()
