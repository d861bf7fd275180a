"""Two results folders side by side: the rows both measured, ratios B/A, and what differs
between the machines and software that produced them. Reads results folders only."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import pandas as pd
from rich.markup import escape

from epbench.errors import UserError
from epbench.metrics import summarize
from epbench.results import is_run_dir, load_run, run_status
from epbench.scenario import short_path

KEYS = ["scenario", "backend", "op", "sms"]
# further keys where both runs' rows carry them: a --tokens sweep, low-latency timing kinds, input sets, call modes
SWEPT = ("tokens_per_rank", "timing", "input_sets", "call_mode")
KEY_NAMES = {"sms": "SMs", "tokens_per_rank": "tokens per rank", "input_sets": "input sets", "call_mode": "call mode"}
PROVENANCE = ("gpus", "driver", "cuda", "nccl", "torch", "python", "numpy", "pandas", "epbench", "git_commit",
              "platform", "host")
# what a run measured (meta.json's scenario, ``world``): one that differs makes every B/A a ratio of unlike work.
# tokens per rank is a row key instead (a --tokens sweep's rows match the other run's at equal tokens)
SHAPE_MODEL = ("hidden", "topk", "experts_per_rank", "dispatch_dtype", "combine_dtype", "quantize", "layout", "align")
SHAPE_TOPOLOGY = ("nodes", "gpus_per_node", "virtual_nodes")
# a routing kind's own parameters (routing.py): compared only where a run used that kind
ROUTING_PARAMS = {"zipf": ("zipf_exponent",), "hot": ("hot_fraction", "hot_multiplier")}
# the rows' columns that say the same (an older meta.json that lacks a field): field -> column
SHAPE_COLUMNS = {"hidden": "hidden", "topk": "topk", "experts_per_rank": "experts_per_rank",
                 "dispatch_dtype": "dtype", "quantize": "quantize", "layout": "layout", "align": "align",
                 "routing": "routing", "world": "world"}
# the slowest rank's time, and the NVLink bus bandwidth of the slowest-bandwidth rank
VALUES = ("time_us", "busbw_nvlink_gbps_min")


def load(path: Path) -> Tuple[Dict[str, Any], pd.DataFrame]:
    if not path.exists():
        raise UserError(f"{short_path(path)}: no such results folder")
    if not is_run_dir(path):
        raise UserError(f"{short_path(path)}: not a results folder (no meta.json)")
    meta, df = load_run(path)  # a corrupt or truncated run: UserError naming the file
    from epbench.report import link_figures, missing_results

    lost = missing_results(path, meta)  # a run that completed, its results.csv gone since
    if lost:
        raise UserError(lost)
    verb = meta.get("verb")
    if verb in ("overlap", "probe"):
        raise UserError(f"{short_path(path)}: an `epbench {verb}` run; compare reads run and sweep "
                        f"folders (`epbench report` shows this one)")
    check_options(path, meta, df)
    return meta, link_figures(df, meta)  # a CPU run's busbw is '-', also in folders written before that rule


def check_options(path: Path, meta: Dict[str, Any], df: pd.DataFrame) -> None:
    """The backend options option_warnings reads are objects (name -> value): a hand-edited or
    corrupt cell or meta.json field ends the command with one line naming the file, not a traceback."""
    import json

    from epbench.results import META, RESULTS
    from epbench.scenario import cut, shown

    for cell in (df["options"].dropna() if "options" in df else ()):
        try:
            value = json.loads(cell) if isinstance(cell, str) else cell
        except (ValueError, RecursionError):
            value = None
        if not isinstance(value, dict):
            raise UserError(f"{short_path(path / RESULTS)}: an options cell is not a JSON object "
                            f"(name: value): {shown(cell, 40)} (corrupt or hand-edited)")
    for backend, opts in ((meta.get("scenario") or {}).get("backend_options") or {}).items():
        if not isinstance(opts, dict):
            raise UserError(f"{short_path(path / META)}: scenario.backend_options.{cut(str(backend), 40)} is "
                            f"not an object (name: value): {shown(opts, 40)} (corrupt or hand-edited)")


def ratio(b: Any, a: Any) -> Any:
    if a is None or b is None or pd.isna(a) or pd.isna(b) or a == 0:
        return None
    return float(b) / float(a)


def match_keys(df_a: pd.DataFrame, df_b: pd.DataFrame) -> List[str]:
    """What a row of A must share with a row of B to be divided by it: KEYS, plus the token-count
    and timing-mode sweeps (low-latency runs) where both runs' rows carry them."""
    return KEYS + [k for k in SWEPT if k in df_a and k in df_b]


def side_by_side(df_a: pd.DataFrame, df_b: pd.DataFrame, unlike: bool = False) -> pd.DataFrame:
    """One row per (scenario, backend, op, sms) found in either run: each run's time, NVLink
    busbw and wrong count (None where that run lacks the row) and the ratios B/A. No ratio where
    either point failed verification (its time is of a wrong result; ``withheld``: 'wrong') or,
    ``unlike``, where the runs measured different shapes (a ratio of unlike work; 'unlike')."""
    keys = match_keys(df_a, df_b)
    cols = keys + list(VALUES) + ["wrong"]
    sa = summarize(df_a)[cols] if not df_a.empty else pd.DataFrame(columns=cols)
    sb = summarize(df_b)[cols] if not df_b.empty else pd.DataFrame(columns=cols)
    for k in ("timing", "call_mode"):  # a run whose column is all empty holds floats there: keys match as text
        if k in keys:
            sa[k], sb[k] = sa[k].astype(object), sb[k].astype(object)
    both = sa.merge(sb, on=keys, how="outer", suffixes=("_a", "_b"), sort=False)
    both = both.astype(object).where(both.notna(), None)
    withheld = [withheld_because(wa, wb, unlike) if ta is not None and tb is not None else None
                for wa, wb, ta, tb in zip(both["wrong_a"], both["wrong_b"], both["time_us_a"], both["time_us_b"])]
    both["withheld"] = pd.Series(withheld, index=both.index, dtype=object)
    for v in VALUES:
        both[f"{v}_ratio"] = pd.Series([None if w else ratio(b, a)
                                        for a, b, w in zip(both[f"{v}_a"], both[f"{v}_b"], withheld)],
                                       index=both.index, dtype=object)
    return both


def withheld_because(wrong_a: Any, wrong_b: Any, unlike: bool) -> Optional[str]:
    """Why a point gets no ratio B/A although both runs may hold it (None: it gets one)."""
    if (wrong_a or 0) > 0 or (wrong_b or 0) > 0:
        return "wrong"
    return "unlike" if unlike else None


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
    """A meta.json value as a warning shows it, bounded (a hand-edited field may hold anything)."""
    from epbench.scenario import cut

    if isinstance(v, list):
        return cut(", ".join(map(str, v)))
    return "missing" if v is None else cut(str(v))


def provenance_warnings(meta_a: Dict[str, Any], meta_b: Dict[str, Any]) -> List[str]:
    """One line per hardware / software field that differs between the runs, the baselines'
    versions (meta.json ``baselines``: library -> version or build stamp) one line each."""
    out = []
    for key in PROVENANCE:
        a, b = meta_a.get(key), meta_b.get(key)
        if a != b:
            out.append(f"{key} differs: A {_show(a)} vs B {_show(b)}")
    libs_a, libs_b = (m.get("baselines") if isinstance(m.get("baselines"), dict) else {} for m in (meta_a, meta_b))
    for lib in sorted(set(libs_a) | set(libs_b), key=str):
        a, b = libs_a.get(lib), libs_b.get(lib)
        if a != b:
            out.append(f"baselines {lib} differs: A {_show(a)} vs B {_show(b)}")
    return out


def shape(meta: Dict[str, Any], df: pd.DataFrame) -> Dict[str, Any]:
    """What the run measured, field -> value (meta.json's scenario and world; where an older
    meta.json lacks a field, the value every row gives; None where neither says)."""
    sc = meta.get("scenario") or {}
    model, topo, routing = (sc.get(k) if isinstance(sc.get(k), dict) else {} for k in ("model", "topology", "routing"))
    out: Dict[str, Any] = {f: model.get(f) for f in SHAPE_MODEL}
    out["mode"] = sc.get("mode")
    out["world"] = meta.get("world")
    out.update({f: topo.get(f) for f in SHAPE_TOPOLOGY})
    out["routing"] = routing.get("kind")
    out["routing seed"] = routing.get("seed")
    for kind, params in ROUTING_PARAMS.items():
        out.update({f"routing {p}": routing.get(p) for p in params} if routing.get("kind") == kind else {})
    for field, col in SHAPE_COLUMNS.items():
        if out.get(field) is None and col in df and df[col].nunique(dropna=True) == 1:
            out[field] = df[col].dropna().iloc[0]
    return out


def _as_text(v: Any) -> Any:
    """A field's value as compared: 256 and 256.0 alike (a row column read back as a float)."""
    return int(v) if isinstance(v, float) and v.is_integer() else v


def shape_differences(meta_a: Dict[str, Any], df_a: pd.DataFrame,
                      meta_b: Dict[str, Any], df_b: pd.DataFrame) -> List[Tuple[str, Any, Any]]:
    """(field, A's value, B's value) per shape field the runs both record and differ in; a field
    one run does not record (an older folder) is not a difference, as nothing says it is."""
    sa, sb = shape(meta_a, df_a), shape(meta_b, df_b)
    out = []
    for field in dict.fromkeys(list(sa) + list(sb)):
        a, b = _as_text(sa.get(field)), _as_text(sb.get(field))
        if a is not None and b is not None and a != b:
            out.append((field, a, b))
    return out


def setting_warnings(meta_a: Dict[str, Any], meta_b: Dict[str, Any]) -> List[str]:
    """One line per measurement setting that differs (timed and warm-up calls per point, calls
    per CUDA-graph sample, tokens per rank): the same work, timed differently, or (tokens) other
    points than the other run's: only rows of equal tokens are divided."""
    def settings(meta: Dict[str, Any]) -> Dict[str, Any]:
        sc = meta.get("scenario") or {}
        bench, model = (sc.get(k) if isinstance(sc.get(k), dict) else {} for k in ("bench", "model"))
        opts = meta.get("options") or {}
        tokens = opts.get("tokens")
        tokens = tokens[0] if isinstance(tokens, list) and len(tokens) == 1 else tokens  # [64] is 64
        return {"iters": opts.get("iters") or bench.get("iters"), "warmup": opts.get("warmup") or bench.get("warmup"),
                "graph_chain": opts.get("graph_chain"),
                "tokens per rank": tokens or model.get("tokens_per_rank")}

    sa, sb = settings(meta_a), settings(meta_b)
    return [f"{k} differs: A {_show(sa[k])} vs B {_show(sb[k])}" for k in sa
            if sa[k] is not None and sb[k] is not None and sa[k] != sb[k]]


def failed_rows(df: pd.DataFrame) -> int:
    """Rows whose verification failed (wrong > 0): their figures time a wrong result."""
    if df.empty or "wrong" not in df:
        return 0
    return int((pd.to_numeric(df["wrong"], errors="coerce").fillna(0) > 0).sum())


def verification_warnings(a: Path, df_a: pd.DataFrame, b: Path, df_b: pd.DataFrame) -> List[str]:
    """One line per run with rows that failed verification: the run, how many rows."""
    out = []
    for ab, path, df in (("A", a, df_a), ("B", b, df_b)):
        failed = failed_rows(df)
        if failed:
            out.append(f"{ab} {short_path(path)}: {failed} of {len(df)} row(s) failed verification (wrong > 0): "
                       f"their figures time a wrong result; no ratio for those points (WRONG)")
    return out


def _values(vals: List[Any]) -> str:
    """A key's values in one run, for a line: all of them, or the first three and the last."""
    seen = sorted(set(_as_text(v) for v in vals if v is not None), key=lambda v: (isinstance(v, str), v))
    text = [str(v) for v in seen] or ["none"]
    return ", ".join(text) if len(text) <= 5 else ", ".join(text[:3]) + f", ..., {text[-1]} ({len(text)} values)"


def no_match_reason(both: pd.DataFrame) -> str:
    """Why no point was measured in both runs: each key whose values in A and B do not meet (as
    'tokens per rank: A 64 vs B 8, 16, 128'), else that only their combinations never meet."""
    keys = [k for k in KEYS + list(SWEPT) if k in both]
    in_a, in_b = both[both["time_us_a"].notna()], both[both["time_us_b"].notna()]

    def said(k: str, vals: pd.Series) -> str:  # SMs 0: each backend chose its own (the table's 'auto')
        return _values(["auto" if k == "sms" and v == 0 else v for v in vals])

    apart = [f"{KEY_NAMES.get(k, k)}: A {said(k, in_a[k])} vs B {said(k, in_b[k])}"
             for k in keys if not set(map(_as_text, in_a[k])) & set(map(_as_text, in_b[k]))]
    if apart:
        return "; ".join(apart)
    return f"each of {', '.join(KEY_NAMES.get(k, k) for k in keys)} has values in both, never the same combination"


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
    one where both had the same; '-' where nothing crossed a link (a functional run, CPU ranks)."""
    from epbench.report import transport

    over = [None if m.get("functional") or m.get("device") == "cpu" else transport(m) for m in (meta_a, meta_b)]
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
    the busbw columns measured (see links). ``title``: rich markup (paths in it escaped)."""
    from epbench.console import number, table
    from epbench.report import _input_sets

    scenarios = list(dict.fromkeys(str(x) for x in both["scenario"]))
    with_scenario = wide or len(scenarios) > 1
    t = table(title + ("" if with_scenario else f" ({escape(scenarios[0])})"),
              f"time = slowest rank's median (us); {link}; ratio = B / A ('-' where a run lacks the row; "
              f"WRONG where a run's point failed verification; 'unlike' where the runs measured different shapes)",
              ((("scenario", "left"),) if with_scenario else ()) + (
                  ("op", "left"), ("backend", "left"), ("SMs", "right"),
                  ("time A", "right"), ("time B", "right"), ("time B/A", "right"),
                  ("busbw A", "right"), ("busbw B", "right"), ("busbw B/A", "right")))

    def r3(r: pd.Series, v: str) -> str:
        """Value v's ratio; where it was withheld (side_by_side) from figures both runs have, why:
        red WRONG, or 'unlike'."""
        why, a, b = r["withheld"], r[f"{v}_a"], r[f"{v}_b"]
        if why and a is not None and b is not None:
            return "[bold red]WRONG[/]" if why == "wrong" else why
        return "-" if r[f"{v}_ratio"] is None else f"{r[f'{v}_ratio']:.3f}"

    vary = [c for c in SWEPT if c in both and both[c].nunique() > 1]

    def point(r: pd.Series) -> str:
        """SMs, plus the token count / timing mode where the runs swept them."""
        parts = [str(int(r["sms"])) if r["sms"] else "auto"]
        for c in vary:
            if r[c] is not None:
                parts.append(f"{int(r[c])} tok" if c == "tokens_per_rank" else
                             f"inputs {_input_sets(r[c])}" if c == "input_sets" else str(r[c]))
        return " ".join(parts)

    for _, r in both.iterrows():  # names from the files are text, not rich markup
        t.add_row(*([escape(str(r["scenario"]))] if with_scenario else []), escape(str(r["op"])),
                  escape(str(r["backend"])), escape(point(r)),
                  number(r["time_us_a"]), number(r["time_us_b"]), r3(r, "time_us"),
                  number(r["busbw_nvlink_gbps_min_a"]), number(r["busbw_nvlink_gbps_min_b"]),
                  r3(r, "busbw_nvlink_gbps_min"))
    return t


def print_compare(a: Path, b: Path, console, wide: bool = False) -> pd.DataFrame:
    """The table, then (red) what makes ratios wrong or unlike, then (yellow) every difference in
    what ran and on what. Paths are printed as they are (escaped: a '[' in one is not markup)."""
    meta_a, df_a = load(a)
    meta_b, df_b = load(b)
    unlike = shape_differences(meta_a, df_a, meta_b, df_b)
    both = side_by_side(df_a, df_b, unlike=bool(unlike))
    shown_a, shown_b = escape(short_path(a)), escape(short_path(b))
    if both.empty:
        console.print(f"A {shown_a} and B {shown_b}: no measured points in either", highlight=False)
    else:
        console.print(compare_table(both, f"A = {shown_a}  vs  B = {shown_b}", wide, links(meta_a, meta_b)))
        matched = both["time_us_a"].notna() & both["time_us_b"].notna()
        if not matched.any():
            console.print(f"[yellow]warning:[/] no point was measured in both runs "
                          f"({escape(no_match_reason(both))}): no ratios", highlight=False)
        elif unlike:
            console.print(f"[bold red]no ratios:[/] the runs measured different shapes "
                          f"({escape(', '.join(f for f, _, _ in unlike))}): B / A would divide unlike work",
                          highlight=False)
    for w in verification_warnings(a, df_a, b, df_b):
        console.print(f"[bold red]VERIFICATION FAILED:[/] {escape(w)}", highlight=False)
    for w in ([f"shape: {f} differs: A {_show(va)} vs B {_show(vb)}" for f, va, vb in unlike]
              + status_warnings(a, meta_a, b, meta_b) + setting_warnings(meta_a, meta_b)
              + provenance_warnings(meta_a, meta_b) + option_warnings(meta_a, df_a, meta_b, df_b)):
        console.print(f"[yellow]warning:[/] {escape(w)}", highlight=False)
    return both
