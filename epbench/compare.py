"""Two results folders side by side: the rows both measured, ratios B/A, and what differs
between the machines and software that produced them. Reads results folders only."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, List, Tuple

import pandas as pd
from rich.markup import escape

from epbench.errors import UserError
from epbench.metrics import summarize
from epbench.results import is_run_dir, load_run, run_status
from epbench.scenario import short_path

KEYS = ["scenario", "backend", "op", "sms"]
PROVENANCE = ("gpus", "driver", "cuda", "torch", "nccl", "host", "world")
# the slowest rank's time, and the NVLink bus bandwidth of the slowest-bandwidth rank
VALUES = ("time_us", "busbw_nvlink_gbps_min")


def load(path: Path) -> Tuple[Dict[str, Any], pd.DataFrame]:
    if not path.exists():
        raise UserError(f"{short_path(path)}: no such results folder")
    if not is_run_dir(path):
        raise UserError(f"{short_path(path)}: not a results folder (no meta.json)")
    meta, df = load_run(path)  # a corrupt or truncated run: UserError naming the file
    from epbench.report import missing_results

    lost = missing_results(path, meta)  # a run that completed, its results.csv gone since
    if lost:
        raise UserError(lost)
    verb = meta.get("verb")
    if verb in ("overlap", "probe"):
        raise UserError(f"{short_path(path)}: an `epbench {verb}` run; compare reads run and sweep "
                        f"folders (`epbench report` shows this one)")
    return meta, df


def ratio(b: Any, a: Any) -> Any:
    if a is None or b is None or pd.isna(a) or pd.isna(b) or a == 0:
        return None
    return float(b) / float(a)


def side_by_side(df_a: pd.DataFrame, df_b: pd.DataFrame) -> pd.DataFrame:
    """One row per (scenario, backend, op, sms) found in either run: each run's time and
    NVLink busbw (None where that run lacks the row) and the ratios B/A."""
    # token-count and timing-mode sweeps (low-latency runs) add to the matching key
    keys = KEYS + [k for k in ("tokens_per_rank", "timing", "input_sets", "call_mode") if k in df_a and k in df_b]
    cols = keys + list(VALUES)
    sa = summarize(df_a)[cols] if not df_a.empty else pd.DataFrame(columns=cols)
    sb = summarize(df_b)[cols] if not df_b.empty else pd.DataFrame(columns=cols)
    for k in ("timing", "call_mode"):  # a run whose column is all empty holds floats there: keys match as text
        if k in keys:
            sa[k], sb[k] = sa[k].astype(object), sb[k].astype(object)
    both = sa.merge(sb, on=keys, how="outer", suffixes=("_a", "_b"), sort=False)
    both = both.astype(object).where(both.notna(), None)
    for v in VALUES:
        both[f"{v}_ratio"] = pd.Series([ratio(b, a) for a, b in zip(both[f"{v}_a"], both[f"{v}_b"])],
                                       index=both.index, dtype=object)
    return both


def status_warnings(a: Path, meta_a: Dict[str, Any], b: Path, meta_b: Dict[str, Any]) -> List[str]:
    """One line per run that did not complete (failed, timed out, interrupted, abandoned, still
    running): its figures may be partial or wrong. A folder without a status (older) says nothing."""
    out = []
    for ab, path, meta in (("A", a, meta_a), ("B", b, meta_b)):
        status = run_status(meta)
        if status not in (None, "complete"):
            error = meta.get("error")
            why = f" ({error})" if isinstance(error, str) and error else ""
            out.append(f"{ab} {short_path(path)}: run status {status}{why}: its figures may be partial")
    return out


def _show(v: Any) -> str:
    if isinstance(v, list):
        return ", ".join(map(str, v))
    return "missing" if v is None else str(v)


def provenance_warnings(meta_a: Dict[str, Any], meta_b: Dict[str, Any]) -> List[str]:
    """One line per hardware / software field that differs between the runs."""
    out = []
    for key in PROVENANCE:
        a, b = meta_a.get(key), meta_b.get(key)
        if a != b:
            out.append(f"{key} differs: A {_show(a)} vs B {_show(b)}")
    return out


def _options_of(meta: Dict[str, Any], df: pd.DataFrame) -> Dict[str, Dict[str, Any]]:
    """backend -> option -> value: what the rows say ran (column ``options``: the union over a backend's rows,
    a value that differs between rows listed), else what the scenario asked for (meta.json)."""
    import json

    out: Dict[str, Dict[str, Any]] = {}
    if "options" in df:
        for backend, opts in df[["backend", "options"]].dropna().itertuples(index=False):
            for k, v in json.loads(opts).items():
                seen = out.setdefault(backend, {}).setdefault(k, [])
                if v not in seen:
                    seen.append(v)
        out = {b: {k: v[0] if len(v) == 1 else v for k, v in o.items()} for b, o in out.items()}
    for backend, opts in ((meta.get("scenario") or {}).get("backend_options") or {}).items():
        for k, v in opts.items():
            out.setdefault(backend, {}).setdefault(k, v)
    return out


def option_warnings(meta_a: Dict[str, Any], df_a: pd.DataFrame,
                    meta_b: Dict[str, Any], df_b: pd.DataFrame) -> List[str]:
    """One line per backend option that differs between the runs (backends both ran)."""
    oa, ob = _options_of(meta_a, df_a), _options_of(meta_b, df_b)
    out = []
    for backend in sorted(set(oa) & set(ob)):
        for key in sorted(set(oa[backend]) | set(ob[backend])):
            a, b = oa[backend].get(key), ob[backend].get(key)
            if a != b:
                out.append(f"{backend} option {key} differs: A {_show(a)} vs B {_show(b)}")
    return out


def links(meta_a: Dict[str, Any], meta_b: Dict[str, Any]) -> str:
    """What the busbw columns measured, for the caption: each run's transport (report.transport),
    one where both had the same; '-' where nothing crossed a link (a functional run)."""
    from epbench.report import transport

    over = [None if m.get("functional") else transport(m) for m in (meta_a, meta_b)]
    if over[0] is None and over[1] is None:
        return "busbw: '-', nothing crossed a link in either run"
    if over[0] == over[1]:
        return f"busbw = bus bandwidth over {over[0]}, slowest-bandwidth rank (GB/s)"
    said = [f"{ab} {o}" if o else f"{ab} '-' (nothing crossed a link)" for ab, o in zip("AB", over)]
    return f"busbw = bus bandwidth over {' / '.join(said)}, slowest-bandwidth rank (GB/s)"


def compare_table(both: pd.DataFrame, title: str, wide: bool = False,
                  link: str = "busbw = bus bandwidth, slowest-bandwidth rank (GB/s)"):
    """The rows side by side; the scenario column only where the runs hold several scenarios
    (or ``wide``): one scenario is in the title, and the table fits 100 columns. ``link``: what
    the busbw columns measured (see links)."""
    from epbench.console import number, table
    from epbench.report import _input_sets

    scenarios = list(dict.fromkeys(str(x) for x in both["scenario"]))
    with_scenario = wide or len(scenarios) > 1
    t = table(title + ("" if with_scenario else f" ({scenarios[0]})"),
              f"time = slowest rank's median (us); {link}; ratio = B / A ('-' where a run lacks the row)",
              ((("scenario", "left"),) if with_scenario else ()) + (
                  ("op", "left"), ("backend", "left"), ("SMs", "right"),
                  ("time A", "right"), ("time B", "right"), ("time B/A", "right"),
                  ("busbw A", "right"), ("busbw B", "right"), ("busbw B/A", "right")))

    def r3(v: Any) -> str:
        return "-" if v is None else f"{v:.3f}"

    vary = [c for c in ("tokens_per_rank", "timing", "input_sets", "call_mode") if c in both and both[c].nunique() > 1]

    def point(r: pd.Series) -> str:
        """SMs, plus the token count / timing mode where the runs swept them."""
        parts = [str(int(r["sms"])) if r["sms"] else "auto"]
        for c in vary:
            if r[c] is not None:
                parts.append(f"{int(r[c])} tok" if c == "tokens_per_rank" else
                             f"inputs {_input_sets(r[c])}" if c == "input_sets" else str(r[c]))
        return " ".join(parts)

    for _, r in both.iterrows():
        t.add_row(*([str(r["scenario"])] if with_scenario else []), str(r["op"]), str(r["backend"]), point(r),
                  number(r["time_us_a"]), number(r["time_us_b"]), r3(r["time_us_ratio"]),
                  number(r["busbw_nvlink_gbps_min_a"]), number(r["busbw_nvlink_gbps_min_b"]),
                  r3(r["busbw_nvlink_gbps_min_ratio"]))
    return t


def print_compare(a: Path, b: Path, console, wide: bool = False) -> pd.DataFrame:
    meta_a, df_a = load(a)
    meta_b, df_b = load(b)
    both = side_by_side(df_a, df_b)
    if both.empty:
        console.print(f"A {a} and B {b}: no measured points in either")
    else:
        console.print(compare_table(both, f"A = {a}  vs  B = {b}", wide, links(meta_a, meta_b)))
        matched = both["time_us_a"].notna() & both["time_us_b"].notna()
        if not matched.any():
            console.print("[yellow]warning:[/] no point was measured in both runs (scenario, backend, "
                          "op and SMs differ everywhere): no ratios", highlight=False)
    for w in (status_warnings(a, meta_a, b, meta_b) + provenance_warnings(meta_a, meta_b)
              + option_warnings(meta_a, df_a, meta_b, df_b)):
        console.print(f"[yellow]warning:[/] {escape(w)}", highlight=False)
    return both
