"""Results folders: ``results/<UTC time>_<scenario>/`` holding

- ``results.csv``: one row per backend x op x SMs x rank, raw numbers, units in column names;
- ``samples.csv``: every timed iteration (backend, op, sms, rank, iter, time_us);
- ``meta.json``: scenario, command line, versions, host, status.

Every write goes to a temporary file first and is renamed into place, and the tables are
rewritten after each measured point, so a sweep that dies keeps what it finished. A folder is
created exclusively (os.mkdir of its final name) and meta.json in it is created exclusively too:
nothing ever overwrites an earlier run, and two runs never share a folder.

Reading never trusts a folder: a corrupt meta.json, a truncated or malformed CSV or an unreadable
file makes that run a UserError naming it, which the commands that walk many runs report as one
warning line before going on with the rest.
"""

from __future__ import annotations

import csv
import datetime
import io
import json
import os
import re
import sys
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import pandas as pd

from epbench.errors import UserError

RESULTS = "results.csv"
SAMPLES = "samples.csv"
META = "meta.json"


def _why(e: OSError) -> str:
    return e.strerror or type(e).__name__


def _atomic_write(path: Path, text: str) -> None:
    """``path`` holds ``text`` whole or keeps what it held: a write that fails (a full disk, a
    read-only file system) leaves no temporary file and is a UserError naming ``path``."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    except OSError as e:
        try:
            tmp.unlink(missing_ok=True)
        except OSError:
            pass
        raise UserError(f"{_shown(path)}: cannot write ({_why(e)})") from None


def _shown(path: Path) -> str:
    from epbench.scenario import short_path

    return short_path(path)


def _make_root(root: Path) -> None:
    if root.exists() and not root.is_dir():
        raise UserError(f"{_shown(root)}: not a folder; results need a folder")
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"{_shown(root)}: cannot hold results ({_why(e)})") from None


def check_new_run_dir(root: Path, run_dir: Optional[Path]) -> None:
    """Refuses, before anything starts, a results root that is not a folder or cannot be written
    (a read-only file system, no permission, a full disk), or a --run-dir that exists
    (claim_run_dir / new_run_dir still claim the folder atomically later), or a new run's folder
    inside a run folder at any depth: report and plot stop at a run folder (_walk), so a run
    nested in one would never be found."""
    for p in (root,) + ((run_dir.parent,) if run_dir else ()):
        if p.exists() and not p.is_dir():
            raise UserError(f"{_shown(p)}: not a folder; results need a folder")
    if run_dir is not None and (run_dir.exists() or run_dir.is_symlink()):
        raise UserError(f"{_shown(run_dir)}: exists already; a run never writes into an existing "
                        f"folder (give a new --run-dir)")
    holder = run_dir.parent if run_dir is not None else root

    def a_run(p: Path) -> bool:  # a folder it cannot look into is left to check_writable
        try:
            return is_run_dir(p)
        except OSError:
            return False

    run = next((p for p in (holder, *holder.resolve().parents) if a_run(p)), None)
    if run is not None:
        where = f"is a run folder (it holds {META})" if run is holder else f"is inside the run folder {_shown(run)}"
        raise UserError(f"{_shown(holder)}: {where}; a new run there would be hidden from report and plot "
                        f"(give a folder outside it)")
    check_writable(holder)


def refuse_existing(path: Path, opt: str) -> None:
    """A UserError naming ``path`` (given by option ``opt``) where it exists already."""
    if path.exists():
        raise UserError(f"{opt} {path}: already exists; refusing to overwrite it")


def write_new(path: Path, text: str, opt: str) -> None:
    """``text`` into the new file ``path`` (given by option ``opt``): never overwrites a file,
    not even one that appeared after it was checked; a file it could not finish is removed, and
    what stopped it is one line (UserError)."""
    try:
        f = open(path, "x")  # exclusive: a file that appeared meanwhile is not clobbered
    except FileExistsError:
        raise UserError(f"{opt} {path}: already exists; refusing to overwrite it") from None
    except OSError as e:
        raise UserError(f"{opt} {path}: {e.strerror or e}") from None
    try:
        with f:
            f.write(text)
    except OSError as e:  # a full disk, a quota: leave no half-written file
        path.unlink(missing_ok=True)
        raise UserError(f"{opt} {path}: {e.strerror or e}") from None


def check_writable(folder: Path) -> None:
    """Creates and removes a small file in ``folder`` (or in its nearest existing parent, where
    the folder is still to be made): the run would otherwise measure for minutes and then fail
    to record anything."""
    here = folder
    while not here.exists() and here.parent != here:
        here = here.parent
    probe = here / f".epbench-write-check-{os.getpid()}"
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.write(fd, b"epbench\n")
        finally:
            os.close(fd)
            probe.unlink()
    except OSError as e:
        raise UserError(f"{_shown(folder)}: cannot write there ({_why(e)})") from None


def claim_run_dir(path: Path) -> Path:
    """Creates the folder a run was told to use (--run-dir); one that exists is refused, so that
    two runs never write into one folder."""
    _make_root(path.parent)
    try:
        path.mkdir()
    except FileExistsError:
        raise UserError(f"{_shown(path)}: exists already; a run never writes into an existing "
                        f"folder (give a new --run-dir)") from None
    except OSError as e:
        raise UserError(f"{_shown(path)}: cannot create ({_why(e)})") from None
    return path


def run_name(scenario: Any, tokens: Optional[Sequence[int]] = None) -> str:
    """The part of a run folder's name after the time: the scenario's name, its world size, and
    what changes the measurement beyond the name: a dispatch dtype other than bf16, the
    expert-major layout, and --tokens (one count, or first-last of a sweep). A plain string is
    taken as the name alone. Only [A-Za-z0-9._-], at most 80 characters: safe on any file system.
    e.g. dsv3x4_w4_fp8_t128."""
    if isinstance(scenario, str):
        parts = [scenario]
    else:
        name, m = scenario.name, scenario.model
        parts = [name, f"w{scenario.world}"]
        if m.dispatch_dtype != "bf16" and m.dispatch_dtype not in name:
            parts.append(m.dispatch_dtype)
        if m.layout == "expert_major" and "expert" not in name:
            parts.append("expert")
        if tokens:
            parts.append(f"t{tokens[0]}" if len(tokens) == 1 else f"t{min(tokens)}-{max(tokens)}")
    return re.sub(r"[^A-Za-z0-9._-]", "-", "_".join(parts))[:80]


def new_run_dir(root: Path, scenario: Any, tokens: Optional[Sequence[int]] = None) -> Path:
    """Creates and returns a fresh folder named by the time and run_name(); never reuses an
    existing name."""
    _make_root(root)
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    scenario_name = run_name(scenario, tokens)
    base = f"{stamp}_{scenario_name}"
    for i in range(1000):
        path = root / (base if i == 0 else f"{base}-{i}")
        try:
            path.mkdir()
            return path
        except FileExistsError:
            continue
        except OSError as e:
            raise UserError(f"{_shown(path)}: cannot create ({_why(e)})") from None
    raise UserError(f"{root}: could not create a new run folder for {scenario_name}")


MEASURED = "ok"  # the status column of a measured row; others say "skipped: ..." / "failed: ..."


def unmeasured_rows(scenario: str, backend: str, points: List[Tuple[int, int]],
                    status: str, variants: Optional[List[Dict[str, Any]]] = None,
                    rank: Optional[int] = None) -> List[Dict[str, Any]]:
    """Rows for points that were not measured, one per (op, SM count, tokens per rank, variant):
    the table and results.csv say why (``status``: "skipped: <reason>" or "failed: <reason>").
    ``variants``: the ways each point is timed (driver.point_variants; None: not known, one row per
    op then stands for all of them); ``rank``: the rank the reason blames (None: not one)."""
    return [{"scenario": scenario, "backend": backend, "op": op, "sms": sms, "rank": rank,
             "tokens_per_rank": tokens, **v, "time_us": None, "status": status}
            for sms, tokens in points for v in (variants or [{}]) for op in ("dispatch", "combine")]


WHOLE_TEXT = re.compile(r"-?\d+")


def _read_csv_rows(path: Path) -> List[Dict[str, Any]]:
    """The rows of a table this module wrote; a column written as whole numbers reads as ints
    (None where empty), not floats, so that writing the rows again keeps it so."""
    if not path.is_file() or not path.stat().st_size:
        return []
    df = pd.read_csv(path)
    text = pd.read_csv(path, dtype=str)
    whole = [c for c in df.columns if df[c].dtype == float and text[c].notna().any()
             and text[c].dropna().str.fullmatch(WHOLE_TEXT).all()]
    rows = df.to_dict("records")
    for c in whole:  # from the text: a byte count past 2**53 stays exact
        for r, v in zip(rows, text[c]):
            r[c] = None if pd.isna(v) else int(v)
    return rows


def _is_whole(v: Any) -> bool:
    import numbers

    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def _absent(v: Any) -> bool:
    return v is None or (isinstance(v, float) and v != v)


def _table(rows: List[Dict[str, Any]]) -> str:
    """``rows`` as CSV; a column whose values are all whole numbers (ints, not bools) is written
    as such where some rows leave it empty too (pandas would make it float: rank 0.0, world 4.0)."""
    df = pd.DataFrame(rows)
    for col in df.columns:
        if df[col].dtype != float:
            continue
        given = [r[col] for r in rows if not _absent(r.get(col))]
        if given and all(_is_whole(v) for v in given):
            df[col] = df[col].astype("Int64")
    return df.to_csv(index=False)


VARIANT_KEYS = ("call_mode", "timing", "input_sets")  # what tells a point's rows timed one way from another


def _plain(v: Any) -> Any:
    """A cell as written, for comparing: None where empty, 4 for 4.0."""
    if _absent(v):
        return None
    return int(v) if isinstance(v, float) and v.is_integer() else v


def _variant_key(row: Dict[str, Any], variant: Dict[str, Any]) -> tuple:
    return tuple(_plain(row.get(k)) for k in VARIANT_KEYS if k in variant)


def missing_variants(rows: List[Dict[str, Any]], backend: str, sms: int, tokens: int,
                     variants: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """The ``variants`` of point (``backend``, ``sms``, ``tokens``) that ``rows`` hold no measured
    row of."""
    here = [r for r in rows if r.get("backend") == backend and _plain(r.get("sms")) == sms
            and _plain(r.get("tokens_per_rank")) == tokens and r.get("status", MEASURED) == MEASURED]
    return [v for v in variants if not any(_variant_key(r, v) == _variant_key(v, v) for r in here)]


class RunWriter:
    """Rank 0's writer. The tables are rewritten whole (to a temporary file, renamed into
    place) after each point, so a reader or a killed run never sees half a line. ``append``:
    the launcher runs one job per backend into the same folder; each continues the tables and
    notes of the jobs before it, and the launcher writes the final status (finish_run)."""

    def __init__(self, run_dir: Path, meta: Dict[str, Any], append: bool = False) -> None:
        self.dir = run_dir
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise UserError(f"{_shown(run_dir)}: cannot create ({_why(e)})") from None
        # the first write that failed: it is the error the run ends with, and a later write that
        # fails the same way (the notes written on the way out) does not replace it
        self.failed: Optional[UserError] = None
        self.rows: List[Dict[str, Any]] = []
        self.samples: List[Dict[str, Any]] = []
        earlier: Dict[str, Any] = {}
        if append and (self.dir / META).is_file():
            earlier = json.loads((self.dir / META).read_text())
            self.rows = _read_csv_rows(self.dir / RESULTS)
            self.samples = _read_csv_rows(self.dir / SAMPLES)
        else:
            claim_run(self.dir)
        self.meta = dict(meta, status="running")
        self.meta["notes"] = list(earlier.get("notes", []))
        self.meta["wrong"] = int(earlier.get("wrong", 0))
        self.meta["backend_runtime"] = {**earlier.get("backend_runtime", {}), **meta.get("backend_runtime", {})}
        # how each backend's points are timed (driver.point_variants), kept for the launcher: it
        # records every variant of the points a failed job lost
        variants = {**earlier.get("variants", {}), **meta.get("variants", {})}
        if variants:
            self.meta["variants"] = variants
        self._write_meta()

    def _write(self, path: Path, text: str) -> None:
        try:
            _atomic_write(path, text)
        except UserError as e:
            if self.failed is None:
                self.failed = e
                raise
            if path.name != META:
                raise

    def _write_meta(self) -> None:
        self._write(self.dir / META, json.dumps(self.meta, indent=2, default=str) + "\n")

    def add(self, rows: List[Dict[str, Any]], samples: List[Dict[str, Any]]) -> None:
        self.rows += [dict(r, status=r.get("status", MEASURED)) for r in rows]
        self.samples += samples
        self._write(self.dir / RESULTS, _table(self.rows))
        if samples:
            self._write(self.dir / SAMPLES, _table(self.samples))

    def variants(self, backend: str, variants: List[Dict[str, Any]]) -> None:
        """How each point of ``backend`` is timed (driver.point_variants), into meta.json."""
        known = self.meta.setdefault("variants", {})
        if known.get(backend) != variants:
            known[backend] = variants
            self._write_meta()

    def note(self, notes: List[str], wrong: int = 0) -> None:
        """This job's notes and wrong rows, added to the earlier jobs'; the status stays."""
        self.meta["notes"] += [n for n in notes if n not in self.meta["notes"]]
        self.meta["wrong"] += wrong
        self._write_meta()

    def finish(self, status: str, **extra: Any) -> None:
        self.meta.update(extra, status=status,
                         finished_utc=datetime.datetime.now(datetime.timezone.utc).isoformat())
        self._write_meta()


def claim_run(run_dir: Path, meta: Optional[Dict[str, Any]] = None) -> None:
    """Makes ``run_dir`` this run's: whoever creates meta.json owns the folder (a second run
    into it is refused). ``meta``: what to write there now (the launcher's claim)."""
    try:  # the claim: whoever creates meta.json owns the folder
        with open(run_dir / META, "x") as f:
            if meta is not None:
                f.write(json.dumps(meta, indent=2, default=str) + "\n")
    except FileExistsError:
        raise UserError(f"{run_dir}: already holds results; refusing to overwrite them") from None
    except OSError as e:
        try:  # a claim left empty by a full disk: no other run made it
            (run_dir / META).unlink(missing_ok=True)
        except OSError:
            pass
        raise UserError(f"{_shown(run_dir / META)}: cannot write ({_why(e)})") from None


def finish_run(run_dir: Path, status: str, error: Optional[str] = None, **extra: Any) -> Dict[str, Any]:
    """The launcher's last word on a run: status complete, failed, timeout or interrupted, with
    the first error line. Returns the meta written."""
    path = run_dir / META
    meta = json.loads(path.read_text()) if path.is_file() else {}
    meta.update(extra, status=status,
                finished_utc=datetime.datetime.now(datetime.timezone.utc).isoformat())
    if error:
        meta["error"] = error
    try:
        _atomic_write(path, json.dumps(meta, indent=2, default=str) + "\n")
    except UserError as e:
        if not error:
            raise
        # the run's own error stays the news; the line adds that meta.json does not record it
        raise UserError(f"{error} (and {e}: its status was not recorded)") from None
    return meta


def run_status(meta: Dict[str, Any]) -> Any:
    """meta.json's status, except that a run left "running" by a launcher that has exited since
    (as seen on its host) is "abandoned": nothing is left to finish it."""
    from epbench.launch import launcher_gone

    status = meta.get("status")
    return "abandoned" if status == "running" and launcher_gone(meta.get("launcher")) else status


def _recorded_variants(run_dir: Path, backend: str) -> Optional[List[Dict[str, Any]]]:
    """How the job timed each point of ``backend`` (meta.json's ``variants``; None: not recorded,
    as by a job that ended before it built the backend, or by an older epbench)."""
    try:
        found = json.loads((run_dir / META).read_text()).get("variants", {}).get(backend)
    except (OSError, ValueError, AttributeError):
        return None
    return found if isinstance(found, list) and found and all(isinstance(v, dict) for v in found) else None


def measured_points(run_dir: Path, backend: str) -> set:
    """(sms, tokens per rank) of the points of ``backend`` that results.csv holds whole: a row
    saying why it was not measured, or a measured row for every variant the job recorded
    (_recorded_variants; where none were, any row). A point whose job died in one of its
    variants is not among them: add_rows then records the variants it lacks."""
    rows = [r for r in _read_csv_rows(run_dir / RESULTS) if r.get("backend") == backend]
    variants = _recorded_variants(run_dir, backend)
    points = {(int(r["sms"]), int(r["tokens_per_rank"])) for r in rows}
    said = {(int(r["sms"]), int(r["tokens_per_rank"])) for r in rows if r.get("status", MEASURED) != MEASURED}
    return {pt for pt in points if pt in said or variants is None
            or not missing_variants(rows, backend, *pt, variants)}


def lost_rows(run_dir: Path, rows: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """The launcher's rows for points a failed job left out (unmeasured_rows, one per op), made
    whole from the run folder: a row without a call mode becomes one per variant of its point
    that the job recorded (_recorded_variants) and results.csv does not hold measured (the point
    the job died in keeps the variants it finished); the rank column names the rank the reason
    blames (launch.blamed_rank), where it blames one."""
    from epbench.launch import blamed_rank

    have = _read_csv_rows(run_dir / RESULTS)
    made: List[Tuple[int, int, Dict[str, Any]]] = []
    for n, r in enumerate(rows):
        kind, _, line = str(r.get("status") or "").partition(": ")
        if _absent(r.get("rank")) and kind in ("failed", "timeout"):
            r = dict(r, rank=blamed_rank(line))
        variants = _recorded_variants(run_dir, r["backend"]) if _absent(r.get("call_mode")) else None
        if variants is None:
            made.append((n, 0, r))
            continue
        point = (r["backend"], _plain(r["sms"]), _plain(r["tokens_per_rank"]))
        first = next(i for i, o in enumerate(rows) if (o["backend"], _plain(o["sms"]),
                                                      _plain(o["tokens_per_rank"])) == point)
        made += [(first, variants.index(v), dict(r, **v)) for v in missing_variants(have, *point, variants)]
    return [r for _, _, r in sorted(made, key=lambda m: (m[0], m[1]))]  # a point's variants in turn, ops within


def add_rows(run_dir: Path, rows: List[Dict[str, Any]]) -> None:
    """Appends rows to results.csv (the launcher's rows for points a failed job left out, made
    whole by lost_rows). Where they cannot be written (a full disk), meta.json records the run as
    failed before the UserError naming the file goes up."""
    try:
        RunWriter(run_dir, json.loads((run_dir / META).read_text()), append=True).add(lost_rows(run_dir, rows), [])
    except UserError as e:
        finish_run(run_dir, "failed", str(e))
        raise


def is_run_dir(path: Path) -> bool:
    return (path / META).is_file()


Warn = Callable[[str], None]


def _stderr_warning(text: str) -> None:
    print(f"epbench: warning: {text}", file=sys.stderr)


def _walk(root: Path, warn: Warn) -> Iterator[Path]:
    """Run folders under ``root`` at any depth, sorted; a run's own sub-folders (plots/) are not
    searched, symbolic links to folders are not followed (no loops)."""
    def complain(e: OSError) -> None:
        warn(f"{_shown(Path(e.filename or root))}: skipped, cannot list ({e.strerror or type(e).__name__})")

    for here, dirs, files in os.walk(root, onerror=complain):
        dirs.sort()
        if is_run_dir(Path(here)):
            dirs.clear()
            yield Path(here)
        elif META in files:  # a link to nothing, a link loop
            warn(f"skipped: {_shown(Path(here) / META)}: not a readable file")
        elif RESULTS in files or SAMPLES in files:  # tables whose run record is gone
            table = RESULTS if RESULTS in files else SAMPLES
            warn(f"skipped: {_shown(Path(here))}: holds {table} but no {META} (not a complete "
                 f"results folder)")


def find_runs(paths: List[Path], warn: Optional[Warn] = None) -> List[Path]:
    """The readable runs named by ``paths``: each a run folder (it must be readable) or a folder
    searched recursively for runs (an unreadable one found there is skipped with one warning)."""
    return [d for d, _meta, _df in load_runs(paths, warn)]


def load_runs(paths: List[Path], warn: Optional[Warn] = None
              ) -> List[Tuple[Path, Dict[str, Any], pd.DataFrame]]:
    """(folder, meta, results) of every readable run under ``paths`` (see find_runs)."""
    warn = warn or _stderr_warning
    runs: List[Tuple[Path, Dict[str, Any], pd.DataFrame]] = []
    skipped: List[str] = []  # said once the walk is done: where nothing else was found, the one reason is the error
    for p in paths:
        if not p.exists():
            raise UserError(f"{_shown(p)}: no such file or folder")
        if is_run_dir(p):
            runs.append((p, *load_run(p)))
            continue
        if not p.is_dir():
            raise UserError(f"{_shown(p)}: not a results folder (a file, not a folder)")
        for d in _walk(p, skipped.append):
            try:
                runs.append((d, *load_run(d)))
            except UserError as e:
                skipped.append(f"skipped: {e}")
    if not runs and len(skipped) == 1:
        raise UserError(skipped[0].replace("skipped: ", "", 1))
    for text in skipped:
        warn(text)
    if not runs:
        raise UserError(f"{_shown(', '.join(map(str, paths)))}: no readable results folders "
                        f"(with {META}) found")
    return runs


def _read_text(path: Path) -> str:
    try:
        return path.read_text()
    except UnicodeDecodeError:
        raise UserError(f"{_shown(path)}: not UTF-8 text (corrupt)") from None
    except OSError as e:
        raise UserError(f"{_shown(path)}: cannot read ({e.strerror or type(e).__name__})") from None


def read_table(path: Path, need: Tuple[str, ...] = ()) -> pd.DataFrame:
    """A CSV this module wrote: empty when absent or empty; a UserError when it was cut short
    (no final newline, a row with fewer fields than the header) or lacks a ``need`` column."""
    try:
        path.stat()
    except FileNotFoundError:
        if path.is_symlink():  # a link to nothing: the table was there once
            raise UserError(f"{_shown(path)}: a symbolic link to nothing (corrupt run)") from None
        return pd.DataFrame()
    except OSError as e:  # a link loop (ELOOP), a folder without search permission
        raise UserError(f"{_shown(path)}: cannot read ({_why(e)})") from None
    if not path.is_file():
        raise UserError(f"{_shown(path)}: not a file (corrupt run)")
    text = _read_text(path)
    if not text:
        return pd.DataFrame()
    if not text.endswith("\n"):
        raise UserError(f"{_shown(path)}: truncated (its last line is incomplete)")
    try:
        rows = csv.reader(io.StringIO(text))
        header = next(rows)
        for n, row in enumerate(rows, start=2):
            if len(row) != len(header):
                raise UserError(f"{_shown(path)}: line {n} has {len(row)} fields, the header "
                                f"{len(header)} (truncated or corrupt)")
        df = pd.read_csv(io.StringIO(text))
    except (csv.Error, ValueError) as e:  # pandas' ParserError and EmptyDataError are ValueErrors
        from epbench.scenario import cut

        raise UserError(f"{_shown(path)}: not a readable CSV ({cut(str(e))})") from None
    missing = [c for c in need if c not in df.columns]
    if missing:
        raise UserError(f"{_shown(path)}: lacks the column {missing[0]} (corrupt)")
    return df


RESULT_COLUMNS = ("backend", "op", "sms", "rank", "time_us")
MEASURED_COLUMNS = ("scenario", "world", "wrong")  # every measured row's too (metrics.summarize reads them)
OVERLAP_COLUMNS = ("backend", "sms", "rank")  # `epbench overlap` rows: kept %, per (backend, SMs)
PROBE_COLUMNS = ("sms", "op", "variant")  # `epbench probe` rows: a kernel's parts, per (SMs, op, variant)

# What the readers (report, plot, compare, predict) take from a run, by type: a run whose files
# hold something else (a number where text belongs, two tables appended into one) is skipped with
# one line rather than ending a command that shows many runs in a traceback.
META_TYPES: Dict[str, Tuple[type, ...]] = {
    "scenario": (dict,), "notes": (list,), "world": (int,), "wrong": (int,), "device": (str,),
    "status": (str,), "verb": (str,), "functional": (str,), "topology": (str,), "env": (dict,),
    "gpus": (list,), "overlap": (dict,), "options": (dict,), "started_utc": (str,),
}
SCENARIO_TYPES: Dict[str, Tuple[type, ...]] = {
    "name": (str,), "model": (dict,), "topology": (dict,), "routing": (dict,), "bench": (dict,),
    "backend_options": (dict,), "mode": (str,),
}
WHOLE_COLUMNS = ("sms", "rank", "node", "world", "nodes", "hidden", "tokens_per_rank", "topk",
                 "experts_per_rank", "iters", "wrong", "chain", "align", "padding_rows", "input_sets")
NUMBER_SUFFIXES = ("_us", "_gbps", "_bytes", "_pct", "_ratio", "_efficiency", "_measured",
                   "_tflops", "_flops", "_p99", "_us_min", "_us_max", "_us_mean")
TEXT_COLUMNS = ("scenario", "backend", "op", "timing", "call_mode")


def load_run(path: Path) -> Tuple[Dict[str, Any], pd.DataFrame]:
    if not is_run_dir(path):
        raise UserError(f"{_shown(path)}: not a results folder (no {META})")
    text = _read_text(path / META)
    try:
        meta = json.loads(text)
    except json.JSONDecodeError as e:
        raise UserError(f"{_shown(path / META)}: not valid JSON ({e.msg}, line {e.lineno} column {e.colno})") from None
    except (ValueError, RecursionError) as e:  # a 5000-digit number, nesting 100,000 deep
        from epbench.scenario import cut

        raise UserError(f"{_shown(path / META)}: unreadable ({cut(str(e) or type(e).__name__)})") from None
    if not isinstance(meta, dict):
        raise UserError(f"{_shown(path / META)}: not a JSON object")
    _check_meta(meta, path / META)
    need = {"overlap": OVERLAP_COLUMNS, "probe": PROBE_COLUMNS}.get(meta.get("verb"), RESULT_COLUMNS)
    df = _typed(read_table(path / RESULTS, need), path / RESULTS)
    if "status" in df:  # rows of points not measured (skipped, failed) carry no figures
        df = df[df["status"].fillna(MEASURED) == MEASURED].drop(columns="status").reset_index(drop=True)
    if need is RESULT_COLUMNS and not df.empty:  # what the readers' summary takes of every measured row
        df = _defaulted(df, meta)
        for col in RESULT_COLUMNS + MEASURED_COLUMNS + tuple(c for c in READ_WHOLE if c in df):
            if col not in df or df[col].isna().any():
                raise UserError(f"{_shown(path / RESULTS)}: a measured row lacks its {col} (corrupt)")
    _check_whole(df, path / RESULTS)
    for col in df.columns:  # integer columns read as float where unmeasured rows left gaps (a figure
        # past WHOLE_LIMIT, e.g. a hand-edited 1e300 busbw, stays a float: int64 would wrap it)
        if (df[col].dtype == float and df[col].notna().all() and (df[col] % 1 == 0).all()
                and (df[col].abs() < WHOLE_LIMIT).all()):
            df[col] = df[col].astype("int64")
    if "world" not in meta and need is RESULT_COLUMNS and not df.empty and df["world"].nunique() == 1:
        meta["world"] = int(df["world"].iloc[0])  # a folder whose meta.json lost it: its rows say it
    if "world" not in meta:
        raise UserError(f"{_shown(path / META)}: lacks world (corrupt or hand-edited)")
    return meta, df


# Whole-number columns the readers take as int() from every measured row where the table has
# them (a table's tokens column, the floor and bound lines): a gap there would end them. Absent,
# the scenario's value stands in (_defaulted), else the readers show '-'.
READ_WHOLE = ("tokens_per_rank",)
WHOLE_LIMIT = 2 ** 53  # past it a float no longer holds every whole number (and int64 is near)


def _defaulted(df: pd.DataFrame, meta: Dict[str, Any]) -> pd.DataFrame:
    """Measured rows of a folder from before a READ_WHOLE column was written: the scenario's own
    value (meta.json), where it records one."""
    model = (meta.get("scenario") or {}).get("model") or {}
    tokens = model.get("tokens_per_rank")
    if "tokens_per_rank" not in df and _is_whole(tokens):
        df = df.assign(tokens_per_rank=tokens)
    return df


def _check_whole(df: pd.DataFrame, path: Path) -> None:
    """WHOLE_COLUMNS hold whole numbers the readers can int(): not inf, not 1e20 (astype("int64")
    would make it -9223372036854775808), not 2.5; a UserError naming the column and the value."""
    for col in WHOLE_COLUMNS:
        if col not in df or not pd.api.types.is_numeric_dtype(df[col]):
            continue
        values = df[col].dropna().astype(float)
        bad = values[(values.abs() >= WHOLE_LIMIT) | (values % 1 != 0)]
        if len(bad):
            v = bad.iloc[0]
            said = "an infinite value" if v in (float("inf"), float("-inf")) else f"{v:g}"
            raise UserError(f"{_shown(path)}: column {col} holds {said} where a whole number "
                            f"belongs (corrupt or hand-edited)")


TYPE_WORDS = {dict: "an object", list: "a list", int: "a whole number", str: "text"}


def _check_types(data: Dict[str, Any], types: Dict[str, Tuple[type, ...]], where: str,
                 prefix: str = "") -> None:
    from epbench.scenario import shown

    for key, allowed in types.items():
        value = data.get(key)
        wrong_bool = isinstance(value, bool) and bool not in allowed
        if value is not None and (wrong_bool or not isinstance(value, allowed)):
            want = " or ".join(TYPE_WORDS[t] for t in allowed)
            raise UserError(f"{where}: {prefix}{key} must be {want}, got {shown(value, 40)} "
                            f"(corrupt or hand-edited)")


def _check_meta(meta: Dict[str, Any], path: Path) -> None:
    """The fields of meta.json that readers use have the types the writer gives them; an object
    or list field that is null is taken as absent (readers fall back to their defaults). The
    scenario and its name must be there (a title of '?' says nothing); world too (load_run:
    where meta.json lost it, the rows may still say it)."""
    from epbench.scenario import shown

    where = _shown(path)
    for key, allowed in META_TYPES.items():
        if key in meta and meta[key] is None and set(allowed) & {dict, list}:
            del meta[key]
    _check_types(meta, META_TYPES, where)
    _check_types(meta.get("scenario") or {}, SCENARIO_TYPES, where, "scenario.")
    if not (meta.get("scenario") or {}).get("name"):  # every writer records it: what the run measured
        raise UserError(f"{where}: lacks {'scenario.name' if meta.get('scenario') else 'scenario'} "
                        f"(corrupt or hand-edited)")
    odd = [n for n in meta.get("notes") or [] if not isinstance(n, str)]
    if odd:
        raise UserError(f"{where}: notes must be a list of text, got {shown(odd[0], 40)} in it "
                        f"(corrupt or hand-edited)")


def _number_column(name: str) -> bool:
    return name in WHOLE_COLUMNS or name.endswith(NUMBER_SUFFIXES)


def _typed(df: pd.DataFrame, path: Path) -> pd.DataFrame:
    """results.csv with its number columns as numbers and its key columns as text; text in a
    number column (a second header line where two tables were appended, a hand edit) is a
    UserError naming the column and the row."""
    df = df.copy()
    for col in df.columns:
        if _number_column(col) and not pd.api.types.is_numeric_dtype(df[col]):
            values = pd.to_numeric(df[col], errors="coerce")
            bad = values.isna() & df[col].notna()
            if bad.any():
                from epbench.scenario import cut

                row = int(bad.to_numpy().nonzero()[0][0])
                raise UserError(f"{_shown(path)}: column {col} holds text where a number belongs "
                                f"({cut(repr(df[col].iloc[row]), 30)} in data row {row + 1}; two "
                                f"tables appended, or a hand edit?)")
            df[col] = values
    for col in TEXT_COLUMNS:
        if col in df and pd.api.types.is_numeric_dtype(df[col]):  # a backend named 5: keys compare as text
            df[col] = df[col].astype(object).where(df[col].isna(), df[col].astype(str))
    return df


def load_unmeasured(path: Path) -> pd.DataFrame:
    """The rows of points that were not measured, with the reason in ``status``."""
    df = read_table(path / RESULTS)
    return df[df["status"].fillna(MEASURED) != MEASURED] if "status" in df else pd.DataFrame()


def load_samples(path: Path) -> pd.DataFrame:
    return read_table(path / SAMPLES)
