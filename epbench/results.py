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
from typing import Any, Dict, List, Optional, Tuple

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


MEASURED = "ok"  # the status column of a measured row; others say "skipped: ..." / "failed: ..."


def unmeasured_rows(scenario: str, backend: str, points: List[Tuple[int, int]],
                    status: str) -> List[Dict[str, Any]]:
    """Rows for points that were not measured, one per (op, SM count, tokens per rank): the
    table and results.csv say why (``status``: "skipped: <reason>" or "failed: <reason>")."""
    return [{"scenario": scenario, "backend": backend, "op": op, "sms": sms,
             "tokens_per_rank": tokens, "status": status}
            for sms, tokens in points for op in ("dispatch", "combine")]


def _read_csv_rows(path: Path) -> List[Dict[str, Any]]:
    if not path.is_file() or not path.stat().st_size:
        return []
    return pd.read_csv(path).to_dict("records")


class RunWriter:
    """Rank 0's writer. The tables are rewritten whole (to a temporary file, renamed into
    place) after each point, so a reader or a killed run never sees half a line. ``append``:
    the launcher runs one job per backend into the same folder; each continues the tables and
    notes of the jobs before it, and the launcher writes the final status (finish_run)."""

    def __init__(self, run_dir: Path, meta: Dict[str, Any], append: bool = False) -> None:
        self.dir = run_dir
        self.dir.mkdir(parents=True, exist_ok=True)
        self.rows: List[Dict[str, Any]] = []
        self.samples: List[Dict[str, Any]] = []
        earlier: Dict[str, Any] = {}
        if append and (self.dir / META).is_file():
            earlier = json.loads((self.dir / META).read_text())
            self.rows = _read_csv_rows(self.dir / RESULTS)
            self.samples = _read_csv_rows(self.dir / SAMPLES)
        elif (self.dir / RESULTS).exists():
            raise UserError(f"{run_dir}: already holds results; refusing to overwrite them")
        self.meta = dict(meta, status="running")
        self.meta["notes"] = list(earlier.get("notes", []))
        self.meta["wrong"] = int(earlier.get("wrong", 0))
        self._write_meta()

    def _write_meta(self) -> None:
        _atomic_write(self.dir / META, json.dumps(self.meta, indent=2, default=str) + "\n")

    def add(self, rows: List[Dict[str, Any]], samples: List[Dict[str, Any]]) -> None:
        self.rows += [dict(r, status=r.get("status", MEASURED)) for r in rows]
        self.samples += samples
        _atomic_write(self.dir / RESULTS, pd.DataFrame(self.rows).to_csv(index=False))
        if samples:
            _atomic_write(self.dir / SAMPLES, pd.DataFrame(self.samples).to_csv(index=False))

    def note(self, notes: List[str], wrong: int = 0) -> None:
        """This job's notes and wrong rows, added to the earlier jobs'; the status stays."""
        self.meta["notes"] += [n for n in notes if n not in self.meta["notes"]]
        self.meta["wrong"] += wrong
        self._write_meta()

    def finish(self, status: str, **extra: Any) -> None:
        self.meta.update(extra, status=status,
                         finished_utc=datetime.datetime.now(datetime.timezone.utc).isoformat())
        self._write_meta()


def finish_run(run_dir: Path, status: str, error: Optional[str] = None, **extra: Any) -> Dict[str, Any]:
    """The launcher's last word on a run: status complete, failed, timeout or interrupted, with
    the first error line. Returns the meta written."""
    path = run_dir / META
    meta = json.loads(path.read_text()) if path.is_file() else {}
    meta.update(extra, status=status,
                finished_utc=datetime.datetime.now(datetime.timezone.utc).isoformat())
    if error:
        meta["error"] = error
    _atomic_write(path, json.dumps(meta, indent=2, default=str) + "\n")
    return meta


def measured_points(run_dir: Path, backend: str) -> set:
    """(sms, tokens per rank) of the points of ``backend`` already in results.csv."""
    return {(int(r["sms"]), int(r["tokens_per_rank"])) for r in _read_csv_rows(run_dir / RESULTS)
            if r.get("backend") == backend}


def add_rows(run_dir: Path, rows: List[Dict[str, Any]]) -> None:
    """Appends rows to results.csv (the launcher's rows for points a failed job left out)."""
    RunWriter(run_dir, json.loads((run_dir / META).read_text()), append=True).add(rows, [])


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
    if "status" in df:  # rows of points not measured (skipped, failed) carry no figures
        df = df[df["status"].fillna(MEASURED) == MEASURED].drop(columns="status").reset_index(drop=True)
        for col in df.columns:  # integer columns read as float where unmeasured rows left gaps
            if df[col].dtype == float and df[col].notna().all() and (df[col] % 1 == 0).all():
                df[col] = df[col].astype("int64")
    return meta, df


def load_unmeasured(path: Path) -> pd.DataFrame:
    """The rows of points that were not measured, with the reason in ``status``."""
    csv = path / RESULTS
    df = pd.read_csv(csv) if csv.is_file() and csv.stat().st_size else pd.DataFrame()
    return df[df["status"].fillna(MEASURED) != MEASURED] if "status" in df else pd.DataFrame()


def load_samples(path: Path) -> pd.DataFrame:
    csv = path / SAMPLES
    return pd.read_csv(csv) if csv.is_file() and csv.stat().st_size else pd.DataFrame()
