"""A launch, validated once: what the launcher decided and every rank reads (plan.json in the run
folder, also the record of what was started). The ranks get no command line to parse again.

Written by the launcher after the scenario file and the options were checked; read by
``python -m epbench.rank PLAN JOB`` on every rank of the node. Across nodes each node's launcher
writes its own plan into its own run folder and its ranks read that one (their folders need not be
shared); the ranks then check that every node planned the same scenario and options
(session.check_same_scenario). Nothing from the environment goes in: only the scenario, the
options, paths and the command line the user typed."""

from __future__ import annotations

import dataclasses
import json
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Optional, Tuple

from epbench.errors import UserError
from epbench.scenario import Scenario, parse

PLAN = "plan.json"
FORMAT = 1  # the layout of plan.json; a rank refuses a plan of another layout
VERBS = ("run", "sweep", "overlap", "probe", "ceiling")


@dataclass(frozen=True)
class Plan:
    """One launch. ``options``: RunOptions (run, sweep, ceiling), OverlapOptions (overlap) or
    ProbeOptions (probe);
    ``jobs``: one torchrun job per entry, the backends it measures (a backend that kills its
    processes costs only its own job's points)."""

    verb: str
    scenario: Scenario
    options: Any
    device: str  # cuda | cpu (auto: torchrun started by hand, resolved on the rank)
    argv: Tuple[str, ...]  # the command line as typed, for meta.json
    results: Optional[Path] = None  # the results root (None: ceiling, which writes none)
    run_dir: Optional[Path] = None  # None: ceiling, or rank 0 makes one (torchrun by hand)
    control_timeout_s: Optional[float] = None  # None: the verb's worker keeps its own (overlap, ceiling)
    jobs: Tuple[Tuple[str, ...], ...] = ((),)
    columns: Optional[Tuple[str, ...]] = None  # the table's columns (None: the default ones)
    nnodes: int = 1
    node_rank: Optional[int] = None
    rdzv_endpoint: Optional[str] = None
    rdzv_timeout_s: Optional[int] = None
    mps: bool = False  # a private MPS daemon for the ranks (CUDA)
    ranks_per_node: Optional[int] = None  # ranks each job starts here (None: the scenario's per host)
    csv: Optional[Path] = None  # ceiling --csv: its figures also into this file (and provenance beside it)

    def job_options(self, job: int) -> Any:
        """The options of job ``job``: the run's, with that job's backends (overlap: the copy
        calibration in one job only, calibration_job, so that the run folder holds it once)."""
        if not 0 <= job < len(self.jobs):
            raise UserError(f"job {job}: this plan has {len(self.jobs)} job(s)")
        if not hasattr(self.options, "backends") or self.verb == "ceiling":
            return self.options
        opts = dataclasses.replace(self.options, backends=self.jobs[job])
        if hasattr(opts, "calibrate"):
            opts = dataclasses.replace(opts, calibrate=opts.calibrate and job == self.calibration_job())
        return opts

    def calibration_job(self) -> int:
        """overlap: the job that measures the copy rows: the first that needs no DeepEP flavor (it runs
        from this venv, beside the GEMM this venv's torch runs), else the first."""
        from epbench.flavors import flavor_of

        return next((i for i, job in enumerate(self.jobs) if flavor_of(job) is None), 0)


def _options_class(verb: str) -> type:
    if verb == "overlap":
        from epbench.overlap import OverlapOptions

        return OverlapOptions
    if verb == "probe":
        from epbench.llprobe import ProbeOptions

        return ProbeOptions
    from epbench.driver import RunOptions

    return RunOptions


def to_dict(plan: Plan) -> Dict[str, Any]:
    data = dataclasses.asdict(plan)
    data.update(format=FORMAT, **{k: str(getattr(plan, k)) if getattr(plan, k) is not None else None
                                  for k in ("results", "run_dir", "csv")})
    return data


def from_dict(data: Any) -> Plan:
    """The plan ``data`` holds (as to_dict wrote it); UserError naming what is wrong."""
    if not isinstance(data, dict):
        raise UserError(f"must be a mapping, got {type(data).__name__}")
    if data.get("format") != FORMAT:
        raise UserError(f"format {data.get('format')!r}, this epbench reads format {FORMAT}")
    data = dict(data)
    data.pop("format")
    verb = data.get("verb")
    if verb not in VERBS:
        raise UserError(f"verb: must be one of {', '.join(VERBS)}, got {verb!r}")
    sc = data.get("scenario")
    if not isinstance(sc, dict):
        raise UserError("scenario: missing")
    sc = dict(sc)
    data["scenario"] = parse(sc, str(sc.pop("source", "") or "<plan>"))
    data["options"] = _build(_options_class(verb), data.get("options"), "options")
    return _build(Plan, data, "plan", done=("scenario", "options"))


def _build(cls: type, data: Any, where: str, done: Tuple[str, ...] = ()) -> Any:
    """``cls`` from its asdict() form: lists back to tuples, nested dataclasses, paths."""
    if not isinstance(data, dict):
        raise UserError(f"{where}: must be a mapping, got {type(data).__name__}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise UserError(f"{where}.{unknown[0]}: unknown key")
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for name, value in data.items():
        kwargs[name] = value if name in done else _value(hints[name], value, f"{where}.{name}")
    try:
        return cls(**kwargs)
    except TypeError as e:  # a required field missing
        raise UserError(f"{where}: {e}") from None


def _value(tp: Any, value: Any, where: str) -> Any:
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    if typing.get_origin(tp) is typing.Union:  # Optional[X]
        return None if value is None else _value(args[0], value, where)
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, where)
    if typing.get_origin(tp) is tuple:
        if not isinstance(value, list):
            raise UserError(f"{where}: must be a list, got {type(value).__name__}")
        return tuple(_value(args[0], v, where) for v in value)
    if tp is Path:
        return Path(_value(str, value, where))
    want = {float: (int, float), int: (int,), str: (str,), bool: (bool,)}.get(tp)
    if want is not None and (not isinstance(value, want) or (tp is not bool and isinstance(value, bool))):
        raise UserError(f"{where}: must be {tp.__name__}, got {type(value).__name__}")
    return value


def write(plan: Plan, folder: Path) -> Path:
    """plan.json in ``folder`` (written whole: a rank never reads half of it)."""
    import os

    path = folder / PLAN
    tmp = folder / f".{PLAN}.tmp{os.getpid()}"
    try:
        tmp.write_text(json.dumps(to_dict(plan), indent=2) + "\n")
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise UserError(f"{path}: cannot write ({e.strerror or type(e).__name__})") from None
    return path


def read(path: Path) -> Plan:
    """The plan in ``path``; UserError (one line) for a file that is missing or not a plan."""
    try:
        text = path.read_text()
    except OSError as e:
        raise UserError(f"{path}: cannot read the plan ({e.strerror or type(e).__name__})") from None
    try:
        return from_dict(json.loads(text))
    except ValueError as e:
        raise UserError(f"{path}: not a plan (not JSON: {e})") from None
    except (UserError, TypeError, KeyError) as e:
        raise UserError(f"{path}: not a plan epbench can run ({e})") from None
