"""Tables for people: formatting happens here and nowhere earlier."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import pandas as pd
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from epbench.console import number, wide_console
from epbench.console import table as console_table
from epbench.errors import UserError
from epbench.metrics import summarize, summarize_overlap
from epbench.results import run_status


def _spread(row: pd.Series, col: str) -> str:
    lo, med, hi = (row.get(f"{col}_{s}") for s in ("min", "median", "max"))
    if lo is None or (isinstance(lo, float) and math.isnan(lo)):
        return "-"
    if abs(hi - lo) < 0.05 * max(abs(med), 1e-9):
        return number(med)
    return f"{number(lo)} / {number(med)} / {number(hi)}"


def _ceiling_pct(row: pd.Series) -> str:
    vals = [row.get(f"pct_of_{k}_ceiling") for k in ("copy_engine", "sm_store")]
    if all(v is None or v != v for v in vals):
        return "-"
    return " / ".join(number(v) for v in vals)


def _counted(row: pd.Series, tier: str) -> str:
    text = _spread(row, f"busbw_{tier}_measured_gbps")
    return f"{text} [bold red]![/]" if row.get(f"{tier}_counter_mismatch") is True else text


def _virtual(df: pd.DataFrame) -> bool:
    """Virtual nodes: the NIC tier's bytes crossed NVLink on one host, so the column says so."""
    return "nic_virtual" in df and bool(df["nic_virtual"].fillna(False).astype(bool).any())


def _low_latency(df: pd.DataFrame) -> bool:
    return "timing" in df and bool(df["timing"].notna().any())


def _swept_tokens(df: pd.DataFrame) -> bool:
    return "tokens_per_rank" in df and df["tokens_per_rank"].nunique() > 1


# Columns of the results table: key -> (header, justify, cell(summary row, wide)). The default
# set fits 100 terminal columns; --wide shows every column, --columns picks by key. The full
# data is always in results.csv.
Cell = Callable[[pd.Series, bool], str]


def _bw(col: str) -> Cell:
    """Default: the slowest-bandwidth rank (what compare and plot use); wide: min / median / max."""
    return lambda r, wide: _spread(r, col) if wide else number(r.get(f"{col}_min"))


def _wrong(r: pd.Series, wide: bool) -> str:
    wrong = int(r["wrong"])
    return f"[bold red]{wrong}[/]" if wrong else "0"


def timing_label(timing: Any, chain: Any = None) -> str:
    """A row's timing mode as the tables show it: a chain row is "graph xK" (K calls chained in
    one graph, time per call), never a bare "graph" a reader would take for a standalone call."""
    if timing == "chain":
        return f"graph x{int(chain)}" if chain is not None and chain == chain else "graph xK"
    return str(timing)


def _input_sets(n: Any) -> str:
    """How the timed calls' inputs were chosen: "same" (one set, repeated) or "rot N"."""
    if n is None or pd.isna(n):
        return "-"
    return "same" if int(n) == 1 else f"rot {int(n)}"


def _link_pct(r: pd.Series, wide: bool) -> str:
    return _spread(r, "nvlink_link_use_pct") if wide else number(r.get("nvlink_link_use_pct_max"))


def _sms(n: Any) -> str:
    """An SM count as the tables show it: 0 (the backend chose) is "auto"."""
    return str(int(n)) if n else "auto"


def _whole(n: Any) -> str:
    """A count as the tables show it; '-' where the rows do not record it (a folder from before
    the column: results.load_run refuses a gap in a column that is there)."""
    return "-" if n is None or pd.isna(n) else str(int(n))


COLUMNS: Dict[str, Tuple[str, str, Cell]] = {
    "tokens": ("tokens", "right", lambda r, w: _whole(r.get("tokens_per_rank"))),
    "op": ("op", "left", lambda r, w: str(r["op"])),
    "backend": ("backend", "left", lambda r, w: str(r["backend"])),
    "kernel": ("kernel", "left", lambda r, w: r["impl"] if isinstance(r.get("impl"), str) and r["impl"] else "-"),
    "sms": ("SMs", "right", lambda r, w: _sms(r["sms"])),
    "timing": ("timing", "left", lambda r, w: timing_label(r.get("timing"), r.get("chain"))),
    "call": ("call", "left", lambda r, w: str(r.get("call_mode") or "call")),
    "inputs": ("inputs", "right", lambda r, w: _input_sets(r.get("input_sets"))),
    "time": ("time us", "right", lambda r, w: number(r["time_us"])),
    "p99": ("p99 us", "right", lambda r, w: number(r.get("time_us_p99"))),
    "algbw": ("algbw", "right", _bw("algbw_gbps")),
    "busbw": ("busbw", "right", _bw("busbw_nvlink_gbps")),
    "link": ("link %", "right", _link_pct),
    "nvml": ("NVML busbw", "right", lambda r, w: _counted(r, "nvlink")),
    "nic": ("NIC busbw", "right", _bw("busbw_nic_gbps")),
    "ceiling": ("% ceil CE / SM", "right", lambda r, w: _ceiling_pct(r)),
    "slow_rank": ("slow rank", "right", lambda r, w: str(int(r["slowest_rank"]))),
    "wrong": ("#wrong", "right", _wrong),
}
DEFAULT = ("op", "backend", "sms", "time", "algbw", "busbw", "link", "wrong")
LOW_LATENCY = ("op", "backend", "sms", "timing", "time", "p99", "busbw", "wrong")
WIDE = ("op", "backend", "kernel", "sms", "timing", "time", "p99", "algbw", "busbw", "nvml", "link", "nic",
        "ceiling", "slow_rank", "wrong")


def parse_columns(text: Optional[str], wide: bool = False) -> Optional[Tuple[str, ...]]:
    """``--columns a,b`` (keys of COLUMNS) or ``--wide`` as a column choice; None = the default.
    Both at once, or a key twice, is refused: either would print a table other than the one asked
    for (--wide's columns are a --columns choice of their own)."""
    if text is None:
        return WIDE if wide else None
    if wide:
        raise UserError("--wide and --columns: give one (--wide is --columns " + ",".join(WIDE) + ")")
    keys = tuple(k.strip() for k in text.split(",") if k.strip())
    bad = [k for k in keys if k not in COLUMNS]
    if bad or not keys:
        raise UserError(f"--columns: unknown column {', '.join(bad) or '(none given)'}; "
                        f"choose from {', '.join(COLUMNS)}")
    twice = sorted({k for k in keys if keys.count(k) > 1}, key=keys.index)
    if twice:
        raise UserError(f"--columns: {', '.join(twice)} given twice; name each column once")
    return keys


LL_ONLY = ("timing", "p99")  # columns of low-latency rows: a normal-mode run has no timing kinds or p99


def not_applicable(df: pd.DataFrame, columns: Optional[Sequence[str]]) -> List[str]:
    """The --columns keys this run's table leaves out because they mean nothing for its rows
    (timing and p99 on a normal-mode run): said in a note rather than dropped without a word."""
    if columns is None or tuple(columns) == WIDE or df.empty or _low_latency(df):
        return []
    return [k for k in columns if k in LL_ONLY]


# The columns that tell a table's rows apart (metrics.summarize's keys) -> the rows' column, in the
# order they stand in a table.
ROW_KEYS = (("tokens", "tokens_per_rank"), ("op", "op"), ("backend", "backend"), ("sms", "sms"),
            ("call", "call_mode"), ("timing", "timing"), ("inputs", "input_sets"))


def _varying(df: pd.DataFrame, swept_tokens: bool = False) -> List[str]:
    """The ROW_KEYS whose value differs between the rows (a run that swept tokens: tokens too,
    however many of its token counts were measured)."""
    out = [k for k, col in ROW_KEYS if col in df and df[col].astype(object).nunique(dropna=False) > 1]
    return (["tokens"] if swept_tokens and "tokens" not in out else []) + out


def _insert_key(keys: List[str], key: str) -> None:
    """``key`` into ``keys`` after the row key that comes before it in ROW_KEYS (the kernel column
    stays beside its backend), else first."""
    order = [k for k, _ in ROW_KEYS]
    before = [k for k in order[:order.index(key)] if k in keys]
    at = keys.index(before[-1]) + 1 if before else 0
    keys.insert(at + (1 if at < len(keys) and keys[at] == "kernel" else 0), key)


def _chosen(df: pd.DataFrame, columns: Optional[Sequence[str]], swept_tokens: bool = False
            ) -> Tuple[List[str], bool]:
    """The columns shown and whether bandwidths show their spread over ranks. Whatever the choice
    (default, --wide or --columns), every column that tells the rows apart is kept (a token sweep's
    tokens, both call modes' call, rotated and repeated inputs, ...); the timing and p99 columns
    appear only for low-latency rows. ``swept_tokens``: the run swept tokens (meta.json), though
    its rows may hold one count (a failed run)."""
    wide = columns is not None and tuple(columns) == WIDE
    keys = list(columns or (LOW_LATENCY if _low_latency(df) else DEFAULT))
    if not _low_latency(df):
        keys = [k for k in keys if k not in LL_ONLY]
    nic = "busbw_nic_gbps" in df and pd.to_numeric(df["busbw_nic_gbps"], errors="coerce").notna().any()
    if columns is None and nic and "busbw" in keys:  # a run with a NIC tier: its busbw is a first column too
        keys.insert(keys.index("busbw") + 1, "nic")
    if columns is None and _kernel_varies(df) and "backend" in keys:  # e.g. an auto option taking per SM count
        keys.insert(keys.index("backend") + 1, "kernel")
    for key in _varying(df, swept_tokens) + (["tokens"] if _low_latency(df) else []):
        if key not in keys:
            _insert_key(keys, key)
    return keys, wide


def _kernel_varies(df: pd.DataFrame) -> bool:
    """Whether one backend's op ran more than one kernel over the run's points (the rows' ``impl``, the library's
    own record): then the table names the kernel of each row."""
    if "impl" not in df:
        return False
    impls = df.dropna(subset=["impl"]).groupby(["backend", "op"])["impl"].nunique()
    return bool((impls > 1).any())


CAPTION = ("time = slowest rank's median (us); algbw / busbw in GB/s, the slowest-bandwidth rank "
           "(--wide: min / median / max over ranks); busbw = bus bandwidth over the transport in the "
           "title, '-' where nothing crossed a link; full data: results.csv")
NO_LINK_CAPTION = ("time = slowest rank's median (us); algbw in GB/s, the slowest-bandwidth rank "
                   "(--wide: min / median / max over ranks); busbw: '-', nothing crossed a link (CPU "
                   "ranks over gloo cross no NVLink or NIC; one rank or a shared GPU neither); full "
                   "data: results.csv")
# what only a byte that crossed a link gives: blank ('-') in the rows of CPU ranks (link_figures)
LINK_FIGURES = ("busbw_nvlink_gbps", "busbw_nic_gbps", "busbw_nvlink_measured_gbps", "busbw_nic_measured_gbps",
                "nvlink_link_use_pct", "nvlink_efficiency")


def _cpu_rows(df: pd.DataFrame, meta: Optional[Dict[str, Any]]) -> pd.Series:
    """The rows whose ranks were CPU processes: all of a run whose meta.json says cpu, else those
    whose device column does."""
    if meta is not None and meta.get("device") == "cpu":
        return pd.Series(True, index=df.index)
    return df["device"].eq("cpu") if "device" in df else pd.Series(False, index=df.index)


def link_figures(df: pd.DataFrame, meta: Optional[Dict[str, Any]] = None) -> pd.DataFrame:
    """``df`` with LINK_FIGURES blank on rows of CPU ranks: gloo moved their bytes through host
    memory, no NVLink or NIC, so a bus bandwidth there means nothing (metrics.point_rows files none
    since; folders from before hold one)."""
    cpu = _cpu_rows(df, meta)
    cols = [c for c in LINK_FIGURES if c in df]
    if df.empty or not cols or not cpu.any():
        return df
    df = df.copy()
    for c in cols:
        df[c] = pd.to_numeric(df[c], errors="coerce").astype(float).mask(cpu)
    return df


def _crossed(df: pd.DataFrame) -> bool:
    """Whether some row has a bus bandwidth: else the caption claims no transport for busbw."""
    return any(c in df and pd.to_numeric(df[c], errors="coerce").notna().any()
               for c in ("busbw_nvlink_gbps", "busbw_nic_gbps"))
LINK_CAPTION = "link % = the busiest rank's NVLink traffic (NVML, protocol included) over the links' capacity"
KERNEL_CAPTION = ("kernel: the kernel that ran, as the library records it (an option left at auto may take "
                  "another at another SM count; docs/backends.md)")
WIDE_CAPTION = ("NVML busbw: from the GPUs' counters ('!' = >10% off the computed). % ceil: this "
                "run's ideal copy of the same bytes by copy engines (CE) / plain SM stores (SM), "
                "time over the op's time")
LL_CAPTION = ("p50 / p99: percentiles of the per-iteration times, slowest rank; timing: plain "
              "launches, CUDA-graph replays of one call (graph: a standalone call, graph launch "
              "included), 'graph xK' (in-graph: per call of K chained in one graph, as inside a "
              "decode step's graph; each sample is one replay / K, so its p99 is that of per-replay "
              "averages), or 'normal' (a normal-mode backend on the same batch)")
CALL_CAPTION = ("call: 'call' = as a model's forward pass calls the library (layout, count exchange, "
                "host waits, the weighting a user adds); 'kernel' = its fastest path as its own benchmark "
                "times it (cached layout; the weights folded into the expert output, untimed); "
                "docs/baselines.md")
INPUTS_CAPTION = ("inputs: 'rot N' = the timed calls rotated through N input sets (other values, the "
                  "same routes on other tokens); 'same' = the same tensors and values every call (small "
                  "inputs may then sit in L2)")


# The columns given up first where a table cannot fit the terminal without cutting a number.
DROP_FIRST = ("ceiling", "slow_rank", "nvml", "nic", "link", "p99", "algbw", "inputs", "timing", "kernel", "busbw",
              "tokens")


def _plain_cells(text: str) -> List[int]:
    """The cell widths of a table cell's lines and of its words (markup taken out)."""
    from rich.cells import cell_len
    from rich.text import Text

    plain = Text.from_markup(text).plain
    return [max((cell_len(ln) for ln in plain.splitlines()), default=1),
            max((cell_len(w) for w in plain.split()), default=1)]


def _table_width(widths: Sequence[int]) -> int:
    return sum(w + 2 for w in widths) + len(widths) + 1  # one space each side, a rule between


def _fitted(keys: List[str], texts: Dict[str, List[str]], width: Optional[int], keep: Sequence[str] = ()
            ) -> Tuple[List[str], Dict[str, Optional[int]]]:
    """The keys shown in ``width`` terminal columns and each one's width (None: as rich likes).
    No number is ever cut: a column is at least as wide as its longest word (rich then wraps at
    spaces, "0.0080 / 0.0081 / 0.0090" over three lines); where even that does not fit,
    DROP_FIRST's columns are left out in turn, never one of ``keep`` (those that tell the rows
    apart). The room above those widths goes to the columns that need the least of it first, so
    that most columns keep one line."""
    sizes = {k: [_plain_cells(t) for t in texts[k]] for k in keys}
    natural = {k: max(line for line, _ in sizes[k]) for k in keys}
    least = {k: max(word for _, word in sizes[k]) for k in keys}
    if width is None or _table_width([natural[k] for k in keys]) <= width:
        return list(keys), {k: None for k in keys}
    keys = list(keys)
    for k in DROP_FIRST:
        if _table_width([least[x] for x in keys]) <= width:
            break
        if k in keys and k not in keep:
            keys.remove(k)
    given = {k: least[k] for k in keys}
    room = width - _table_width(list(given.values()))
    for k in sorted(keys, key=lambda x: natural[x] - least[x]):
        more = max(0, min(natural[k] - least[k], room))
        given[k] += more
        room -= more
    return keys, given


def results_table(df: pd.DataFrame, title: str = "",
                  columns: Optional[Sequence[str]] = None, width: Optional[int] = None,
                  swept_tokens: bool = False) -> Table:
    """One row per (backend, SMs, op[, tokens, timing, call mode, input sets]) with the ``columns``
    keys (default: the set that fits 100 terminal columns) and those that tell the rows apart.
    ``width``: the terminal's columns; a table that cannot fit them without cutting a number
    leaves out DROP_FIRST's columns in turn, and says so. ``swept_tokens``: see _chosen."""
    summary = summarize(df)
    keys, wide = _chosen(df, columns, swept_tokens)
    headers = {k: COLUMNS[k][0] for k in keys}
    if "time" in headers and _low_latency(df):
        headers["time"] = "p50 us"
    if "nic" in headers and _virtual(df):
        headers["nic"] = "NIC busbw (virtual)"
    cells = {k: [COLUMNS[k][2](r, wide) for _, r in summary.iterrows()] for k in keys}
    shown, widths = _fitted(keys, {k: [headers[k]] + cells[k] for k in keys}, width, _varying(df, swept_tokens))
    link_said = "link" in shown and any(c.strip() not in ("", "-") for c in cells["link"])  # not on gloo runs
    parts = ((True, CAPTION if _crossed(df) else NO_LINK_CAPTION), (link_said, LINK_CAPTION), ("kernel" in shown, KERNEL_CAPTION), (wide, WIDE_CAPTION),
             (_low_latency(df), LL_CAPTION), ("inputs" in shown, INPUTS_CAPTION), ("call" in shown, CALL_CAPTION))
    caption = ". ".join(text for said, text in parts if said)  # sentences, each ended before the next
    left_out = [headers[k] for k in keys if k not in shown]
    if left_out:
        caption += (f". Left out to fit {width} columns: {', '.join(left_out)} (--columns picks, "
                    f"a wider terminal shows all)")
    table = console_table(title, caption, [])
    for k in shown:
        table.add_column(headers[k], justify=COLUMNS[k][1], width=widths[k], overflow="fold")
    for i in range(len(summary)):
        table.add_row(*(cells[k][i] for k in shown))
    return table


NOT_RECORDED = "link not recorded"


def transport(meta: Dict[str, Any]) -> str:
    """What carried a run's bytes, in a reader's words: "gloo (CPU)", "NVLink", "PCIe", or, where
    nothing crossed a link, "one rank - functional" / "shared GPU - functional"; NOT_RECORDED where
    meta.json holds no GPU topology matrix to tell NVLink from PCIe (never a guess)."""
    import re

    if meta.get("device") == "cpu":
        return "gloo (CPU)"
    why = str(meta.get("functional") or "")
    if why:
        return "one rank - functional" if "one rank" in why else "shared GPU - functional"
    matrix = str(meta.get("topology") or "").split("Legend")[0]
    if re.search(r"\bNV\d+\b", matrix):
        return "NVLink"
    return "PCIe" if matrix.strip() else NOT_RECORDED  # no matrix: no evidence of either


def floor_notes(df: pd.DataFrame) -> List[str]:
    """Low-latency runs: the fixed cost of each backend's op, i.e. the slowest rank's p50 at the
    fewest tokens the run measured (its best SM count and standalone timing), one line each; where
    the run has chain rows, the line adds the in-graph figure (best SM count of the chain rows). A
    decode step pays it whatever its batch; bytes only add to it. Each way of timing a point
    (input sets, call mode) is its own figure, as in the table; the line names the best one's where
    the run timed more than one (never the max over them, a figure no row shows)."""
    if df.empty or "mode" not in df or not (df["mode"] == "low_latency").any() or "tokens_per_rank" not in df:
        return []
    ll = df[df["mode"] == "low_latency"]
    fewest = ll["tokens_per_rank"].min()
    keys = [k for k in ("backend", "op", "sms", "timing", "chain") + VARIANTS if k in ll]
    worst = ll[ll["tokens_per_rank"] == fewest].groupby(keys, dropna=False)["time_us"].max().reset_index()
    chained = worst["timing"] == "chain" if "timing" in worst else pd.Series(False, index=worst.index)
    named = [k for k in VARIANTS if k in ll and ll[k].astype(object).nunique(dropna=False) > 1]
    out = []
    for (backend, op), g in worst[~chained].groupby(["backend", "op"], sort=False):
        best = g.loc[g["time_us"].idxmin()]
        how = f"{_sms(best['sms'])} SMs" + (f", {best['timing']}" if "timing" in best else "") + _variant(best, named)
        line = f"floor: {backend} {op} {number(best['time_us'])} us at {int(fewest)} token(s) per rank ({how})"
        chain = worst[chained & (worst["backend"] == backend) & (worst["op"] == op)]
        if not chain.empty:
            c = chain.loc[chain["time_us"].idxmin()]
            line += (f"; in-graph {number(c['time_us'])} us ({_sms(c['sms'])} SMs, "
                     f"{timing_label('chain', c.get('chain'))}{_variant(c, named)}: per call of a chain in one graph)")
        out.append(line)
    return out


VARIANTS = ("input_sets", "call_mode")  # further ways one point is timed: each its own row in the table


def _variant(row: pd.Series, named: Sequence[str]) -> str:
    """The ``named`` ways of timing (those that vary in the run) of the row a floor or bound line
    quotes, as the table shows them ("rot 4", "kernel"), so that the figure can be found there."""
    said = {"input_sets": lambda v: f"inputs {_input_sets(v)}", "call_mode": lambda v: f"{v} mode"}
    return "".join(f", {said[k](row.get(k))}" for k in named)


def bound_notes(df: pd.DataFrame) -> List[str]:
    """Low-latency runs whose ceilings were measured (the scenario's own batch): per backend and op,
    the best standalone figure (slowest rank's p50, best SM count and timing; chain rows left out)
    against plain SM stores of the scenario's routed bytes into the peers (one row per token and
    rank: what epbench-ll sends) at that SM count, timed the same way (csrc/ceiling.cu): ratio =
    call / stores, so 1.0 is a call that costs no more than moving its rows."""
    need = ("mode", "ceiling_sm_store_us", "tokens_per_rank", "time_us", "backend", "op", "sms")
    if df.empty or any(k not in df for k in need):
        return []
    ceil = pd.to_numeric(df["ceiling_sm_store_us"], errors="coerce")
    ll = df[(df["mode"] == "low_latency") & ceil.notna() & (ceil > 0)].assign(ceil=ceil)
    if "timing" in ll:
        ll = ll[ll["timing"] != "chain"]
    if ll.empty:
        return []
    keys = [k for k in ("backend", "op", "sms", "timing", "tokens_per_rank") + VARIANTS if k in ll]
    worst = ll.groupby(keys, dropna=False)[["time_us", "ceil"]].max().reset_index()
    named = [k for k in VARIANTS if k in ll and ll[k].astype(object).nunique(dropna=False) > 1]
    out = []
    for (backend, op), g in worst.groupby(["backend", "op"], sort=False):
        best = g.loc[g["time_us"].idxmin()]
        how = f"{_sms(best['sms'])} SMs" + (f", {best['timing']}" if "timing" in best else "") + _variant(best, named)
        out.append(f"bound: {backend} {op} {number(best['time_us'])} us at {int(best['tokens_per_rank'])} token(s) "
                   f"per rank ({how}) against {number(best['ceil'])} us for plain SM stores of its routed rows "
                   f"into the peers, timed the same way: {best['time_us'] / best['ceil']:.2f}x")
    return out


def wrong_rows(df: pd.DataFrame, listed: int = 3) -> Optional[str]:
    """Where verification failed, in one line: how many wrong rows, at which points (backend,
    op, SM count; the first ``listed``), and the first one's rank and problem. None: all verified."""
    if df.empty or "wrong" not in df:
        return None
    bad = df[pd.to_numeric(df["wrong"], errors="coerce").fillna(0) > 0]
    if bad.empty:
        return None
    keys = ["backend", "op", "sms"] + (["tokens_per_rank"] if _swept_tokens(df) else [])
    points = bad.groupby(keys, sort=False, dropna=False)["wrong"].sum()
    where = [f"{k[0]} {k[1]} at {int(k[2]) if k[2] else 'auto'} SMs"
             + (f", {int(k[3])} tokens" if len(k) > 3 else "") + f": {int(n)}"
             for k, n in list(points.items())[:listed]]
    if len(points) > listed:
        where.append(f"{len(points) - listed} more point(s)")
    first = bad.iloc[0]
    problem = f": {first['problem']}" if isinstance(first.get("problem"), str) and first["problem"] else ""
    return (f"{int(bad['wrong'].sum())} wrong rows ({'; '.join(where)}; first: rank "
            f"{int(first['rank'])}{problem})")


def missing_results(run_dir: Path, meta: Dict[str, Any]) -> Optional[str]:
    """Why a run that says it completed has no rows to show: its results.csv is missing, empty or
    a header alone (deleted or cut short after the run). None: the file holds rows (measured or
    not), or the run did not complete, or its verb writes other tables."""
    from epbench.results import RESULTS, read_table
    from epbench.scenario import short_path

    if run_status(meta) != "complete" or meta.get("verb") in ("overlap", "probe"):
        return None
    path = run_dir / RESULTS
    if not path.exists():
        what = "missing"
    elif path.is_file() and not path.stat().st_size:
        what = "empty"
    elif read_table(path).empty:  # a corrupt file is read_table's UserError, naming it
        what = "a header and no rows"
    else:
        return None
    return (f"{short_path(path)}: {what}, though meta.json says the run completed "
            f"(the file was deleted or cut short since): no figures to show")


def tokens_given(meta: Dict[str, Any]) -> bool:
    """Whether the run was given token counts (--tokens): its rows are then not at the scenario's
    own count, whatever number of counts a failed run got to measure."""
    return bool((meta.get("options") or {}).get("tokens"))


def status_line(meta: Dict[str, Any], wrong_said: bool = False) -> Optional[str]:
    """The run's status where it did not complete, with the error meta.json records (the first
    failure's line), as one line of markup: red where it failed or timed out. None: complete.
    ``wrong_said``: the VERIFICATION FAILED line is printed, so a verification error points there."""
    status = run_status(meta)
    if status in (None, "complete"):
        return None
    error = meta.get("error")
    if wrong_said and isinstance(error, str) and error.startswith("verification failed"):
        error = "verification failed, above"
    said = f"run status: {status}" + (f" ({error})" if isinstance(error, str) and error else "")
    style = "bold red" if str(status).startswith(("failed", "timeout")) else "yellow"
    return f"[{style}]{escape(said)}[/]"


def unmeasured_lines(run_dir: Path) -> List[str]:
    """One line of markup per backend and reason whose points were not measured (skipped, or lost
    with a job that failed or timed out: red)."""
    from epbench.results import load_unmeasured

    left = load_unmeasured(run_dir)
    out = []
    for (backend, status), g in (left.groupby(["backend", "status"], sort=False) if not left.empty else ()):
        # a point: an SM count at a token count, timed one way (call mode, input sets, timing where the rows
        # record them: a lost point leaves a row per op and per way, results.lost_rows), as the launcher's line
        # counts them
        keys = [k for k in ("sms", "tokens_per_rank", "call_mode", "input_sets", "timing") if k in g]
        n = len(g[keys].astype(str).drop_duplicates())
        said = escape(f"{backend}: {status} ({n} point{'s' if n > 1 else ''} not measured)")
        out.append(f"[bold red]{said}[/]" if str(status).startswith(("failed", "timeout")) else said)
    return out


def print_run(df: pd.DataFrame, meta: Dict[str, Any], console: Optional[Console] = None,
              columns: Optional[Sequence[str]] = None, run_dir: Optional[Path] = None) -> None:
    """The run's table; ``columns``: its columns by key (None: the default ones). An overlap or
    probe run's table is its verb's own (``columns`` apart), its status line after it as a run's.
    ``run_dir``: the folder the run was read from (`epbench report`): a line per backend whose
    points were not measured and why, and a UserError where a run that completed has lost its
    results.csv."""
    console = console or wide_console()
    if meta.get("verb") in ("overlap", "probe"):  # their printers say neither the status nor the lost points
        (print_overlap if meta["verb"] == "overlap" else print_probe)(df, meta, console)
        shown = "wrong" in df and bool(pd.to_numeric(df["wrong"], errors="coerce").fillna(0).gt(0).any())
        return _print_tail(meta, shown, run_dir, console)
    lost = missing_results(run_dir, meta) if run_dir is not None else None
    if lost:
        raise UserError(lost)
    scenario = meta.get("scenario", {})
    functional = ", no link figures" if meta.get("functional") else ""
    title = (f"{scenario.get('name', '?')} on {meta.get('world', '?')} ranks "
             f"({meta.get('device', '?')}) - {transport(meta)}{functional}")
    df = link_figures(df, meta)
    if df.empty:
        console.print(f"{title}: no measured points")
    else:
        console.print(results_table(df, title, columns, console.width, tokens_given(meta)))
    for note in meta.get("notes", []):
        console.print(f"note: {note}")
    unused = not_applicable(df, columns)
    if unused:
        console.print(f"note: --columns {','.join(unused)}: low-latency rows only; this run has none, "
                      f"so {'they are' if len(unused) > 1 else 'it is'} not shown", highlight=False)
    for line in floor_notes(df) + bound_notes(df):
        console.print(line)
    wrong = wrong_rows(df)
    if wrong:
        console.print(f"[bold red]VERIFICATION FAILED:[/] {escape(wrong)}", highlight=False)
    _print_tail(meta, bool(wrong), run_dir, console)


def _print_tail(meta: Dict[str, Any], wrong_said: bool, run_dir: Optional[Path], console: Console) -> None:
    """Below a run's table: its status where it did not complete, and (``run_dir`` given) a line
    per backend and reason whose points were not measured."""
    status = status_line(meta, wrong_said)
    if status:
        console.print(status, highlight=False)
    for line in unmeasured_lines(run_dir) if run_dir is not None else ():
        console.print(line, highlight=False)


# -- `epbench overlap` folders --

OVERLAP_TABLE = (  # an overlap run's table: (header, results.csv column, scale)
    ("SMs", "sms", 1), ("GEMM\nSMs", "gemm_sms", 1), ("GEMM\nkept %", "gemm_kept_pct", 1),
    ("of\nconf. %", "gemm_kept_of_confined_pct", 1), ("disp.\nkept %", "dispatch_kept_pct", 1),
    ("comb.\nkept %", "combine_kept_pct", 1), ("copy\nkept %", "copy_kept_pct", 1),
    ("busy\n%", "comm_busy_pct", 1), ("pair\nms", "pair_us", 1e-3), ("max\nms", "max_us", 1e-3),
    ("exposed\nms", "exposed_us", 1e-3), ("wrong", "wrong", 1),
)


def overlap_table(df: Any, title: str):
    """A rich table, worst rank per point, at most 100 columns wide."""
    from rich import box

    summary = summarize_overlap(df)
    cols = [c for c in OVERLAP_TABLE if c[1] in summary and summary[c[1]].notna().any()]
    t = console_table(title, None, [], box=box.SIMPLE_HEAD, pad_edge=False, padding=(0, 1), collapse_padding=True)
    t.add_column("backend", justify="left", no_wrap=True)
    for head, _, _ in cols:
        t.add_column(head, justify="right", min_width=max(map(len, head.split("\n"))))
    for _, r in summary.iterrows():
        cells = []
        for head, col, scale in cols:
            v = r.get(col)
            if col == "wrong":
                v = int((r.get("wrong") or 0) + (r.get("gemm_wrong") or 0))
                cells.append(f"[bold red]{v}[/]" if v else "0")
            elif col in ("sms", "gemm_sms"):
                cells.append("-" if v is None or v != v else str(int(v)) if v else "auto")
            else:
                cells.append(number(v * scale if v is not None and v == v else None))
        t.add_row(str(r.get("label", r["backend"])), *cells)
    return t


CLOCK_TABLE = (  # the overlap run's clocks: (header, results.csv column, format)
    ("SMs", "sms", "{:.0f}"), ("burst\nMHz", "gemm_confined_sm_mhz", "{:.0f}"),
    ("window\nMHz", "gemm_window_sm_mhz", "{:.0f}"), ("beside\nMHz", "pair_sm_mhz", "{:.0f}"),
    ("clock\nkept %", "gemm_clock_kept_pct", "{:.1f}"), ("GEMM kept\nof win. %", "gemm_kept_of_window_pct", "{:.1f}"),
    ("GEMM kept\naround %", "gemm_kept_of_around_pct", "{:.1f}"),
    ("window\nW", "gemm_window_power_w", "{:.0f}"), ("beside\nW", "pair_power_w", "{:.0f}"),
    ("limit\nW", "power_limit_w", "{:.0f}"), ("reasons beside", "pair_clock_reasons", "{}"),
)


def overlap_clock_table(df: Any):
    """The SM clock and power of each point's phases (clocks.py), the rank whose clock kept least;
    None where no clock was read (no NVML, a CPU run, a folder from before the columns)."""
    from rich import box

    from epbench.metrics import overlap_labels

    if "gemm_clock_kept_pct" not in df.columns or not df["gemm_clock_kept_pct"].notna().any():
        return None
    keys = ["backend", "call_mode", "sms"] if "call_mode" in df.columns else ["backend", "sms"]
    rows = df[df["gemm_clock_kept_pct"].notna()]
    worst = rows.loc[rows.groupby(keys, sort=False, dropna=False)["gemm_clock_kept_pct"].idxmin()].reset_index(drop=True)
    worst["label"] = overlap_labels(worst)
    t = console_table("SM clock and power (NVML)", None, [], box=box.SIMPLE_HEAD, pad_edge=False,
                      padding=(0, 1), collapse_padding=True)
    t.add_column("backend", justify="left", no_wrap=True)
    cols = [c for c in CLOCK_TABLE if c[1] in worst.columns]
    for head, _, _ in cols:
        t.add_column(head, justify="right")
    for _, r in worst.iterrows():
        cells = []
        for _, col, fmt in cols:
            v = r.get(col)
            cells.append("-" if v is None or v != v or v == "" else fmt.format(v))
        t.add_row(str(r["label"]), *cells)
    return t


def overlap_problems(df: Any) -> List[str]:
    """One line per (backend, SMs) whose rows say what went wrong (verification or the pair
    window's schedule: overlap.schedule_problem), ranks with the same words merged."""
    if "problem" not in df.columns:
        return []
    out: List[str] = []
    keys = ["backend", "call_mode", "sms"] if "call_mode" in df.columns else ["backend", "sms"]
    for key, g in df.groupby(keys, sort=False, dropna=False):
        said = sorted({str(p) for p in g["problem"] if isinstance(p, str) and p})
        if said:
            backend, sms = key[0], key[-1]
            mode = f" ({key[1]})" if len(key) == 3 and isinstance(key[1], str) else ""
            out.append(f"{backend}{mode} at {int(sms) if sms else 'auto'} SMs: {' | '.join(said)}")
    return out


def print_overlap(df: Any, meta: Dict[str, Any], console: Any) -> None:
    o = meta.get("overlap", {})
    title = (f"{meta.get('scenario', {}).get('name', '?')}: overlap, {o.get('gemm', '?')} beside "
             f"the communication ({meta.get('world', '?')} ranks, {o.get('total_sms', '?')} SMs)")
    if df.empty:  # every backend skipped and no copy kernel, or every job failed before its first point
        console.print(f"{title}: no measured points")
    else:
        console.print(overlap_table(df, title))
        console.print("kept % = alone time / time beside (worst rank); GEMM kept of all SMs, 'of conf.' of "
                      "its own partition alone (both over the communication loop, gaps included: results.csv's "
                      "gemm_kept_in_calls_pct is the GEMM's kept % while a call ran); busy = share of that loop in which a call ran; "
                      "pair / max: the same work together, perfectly hidden (serially: sum_us in results.csv); exposed = "
                      "pair - GEMMs alone; wrong = communication rows + GEMM elements wrong")
        clock_table = overlap_clock_table(df)
        if clock_table is not None:
            console.print(clock_table)
            console.print("GEMM alone in its partition: burst = the 20 GEMMs of 'of conf.', window = as many GEMMs as the "
                          "pair ran, after it; around = the mean of the window and the same loop right before the pair; SM clock: median of the phase's NVML samples (every 5 ms), the rank whose "
                          "clock fell most; clock kept % = beside / window; GEMM kept of win. / around = window / around GEMM time over beside; "
                          "power: mean of the samples (NVML averages it over its own window, so a short phase reads low); "
                          "reasons: what NVML said limited the clock while both ran", highlight=False)
        for line in overlap_problems(df):
            console.print(f"[bold red]problem:[/] {line}", highlight=False)
        if o and "stand_in_expert" not in o:  # a folder written before the expert left the loops
            console.print("note: measured with the stand-in expert after every dispatch, beside the GEMM "
                          "(before 2026-11-27): its kernels are in the GEMM columns (docs/overlap.md)", highlight=False)
    for note in meta.get("notes", []):
        console.print(f"note: {note}", highlight=False)



# -- `epbench probe` folders --

def print_probe(df: pd.DataFrame, meta: Dict[str, Any], console: Any) -> None:
    """A probe run's table as the probe printed it while measuring: its header line, one line
    per row (us, p50 unless marked)."""
    from epbench.llprobe import extra_columns, format_table, header_line, table_rows

    info = meta.get("probe") or {}
    console.print(header_line(info), markup=False, highlight=False)
    extra = extra_columns(info.get("chains") or [1], int(meta.get("world") or 1))
    console.print(format_table(table_rows(df), extra), markup=False, highlight=False, soft_wrap=True)
    for note in meta.get("notes", []):
        console.print(f"note: {note}", highlight=False)

def _link_words(df: pd.DataFrame, meta: Optional[Dict[str, Any]]) -> Optional[str]:
    """What carried the rows' bus bandwidth, for a caption: the run's transport (meta.json; without
    it, the transport in the run's title); None where nothing crossed a link (a functional run, CPU
    ranks over gloo: their busbw cells are '-')."""
    if meta is not None:
        return None if meta.get("functional") or meta.get("device") == "cpu" else transport(meta)
    if "functional" in df and df["functional"].notna().any():
        return None
    if "device" in df and (df["device"] == "cpu").all():  # gloo: host memory, no link
        return None
    return "the transport in the run's title"


def per_rank_table(df: pd.DataFrame, title: str = "", meta: Optional[Dict[str, Any]] = None) -> Table:
    """One row per (backend, op, SMs[, tokens, call mode, timing, input sets], rank): that rank's
    median time and bandwidths, the spread of its iterations, and a mark on the slowest rank of
    each point. The columns that tell the points apart are those that vary among the rows; the NIC
    column only where a row has a NIC tier. ``meta``: the run's meta.json (names the transport)."""
    df = link_figures(df, meta)
    shown = [k for k in _varying(df, tokens_given(meta or {})) if k not in ("op", "backend", "sms")]
    nic = "busbw_nic_gbps" in df and pd.to_numeric(df["busbw_nic_gbps"], errors="coerce").notna().any()
    link = _link_words(df, meta)
    caption = ("time = the rank's median over iterations (min - max in brackets); bandwidths in GB/s"
               + (f"; busbw = bus bandwidth over {link}" if link else "; busbw: '-', nothing crossed a link")
               + "; * = slowest rank of the point")
    cells = {k: (COLUMNS[k][0], COLUMNS[k][1], lambda r, cell=COLUMNS[k][2]: cell(r, False)) for k in shown}
    table = console_table(title, caption,
                          ((("tokens", "right"),) if "tokens" in shown else ())
                          + (("op", "left"), ("backend", "left"), ("SMs", "right"))
                          + tuple(cells[k][:2] for k in shown if k != "tokens")
                          + (("rank", "right"), ("time us", "right"), ("algbw", "right"), ("busbw", "right"))
                          + ((("NIC busbw (virtual)" if _virtual(df) else "NIC busbw", "right"),) if nic else ())
                          + (("#wrong", "right"),))
    keys = ["backend", "op", "sms"] + [k for k in ("tokens_per_rank", "timing", "input_sets", "call_mode") if k in df]
    for _, g in df.groupby(keys, sort=False, dropna=False):
        slowest = g["time_us"].idxmax()
        for i, r in g.sort_values("rank").iterrows():
            spread = ""
            if "time_us_min" in r and "time_us_max" in r:
                spread = f" ({number(r['time_us_min'])} - {number(r['time_us_max'])})"
            wrong = int(r["wrong"]) if "wrong" in r else 0
            table.add_row(*([cells["tokens"][2](r)] if "tokens" in shown else []),
                          r["op"], r["backend"], _sms(r["sms"]),
                          *(cells[k][2](r) for k in shown if k != "tokens"),
                          f"{int(r['rank'])}{' *' if i == slowest else ''}",
                          number(r["time_us"]) + spread, number(r.get("algbw_gbps")),
                          number(r.get("busbw_nvlink_gbps")), *([number(r.get("busbw_nic_gbps"))] if nic else []),
                          f"[bold red]{wrong}[/]" if wrong else "0")
    return table


def print_per_rank(df: pd.DataFrame, console: Optional[Console] = None,
                   meta: Optional[Dict[str, Any]] = None) -> None:
    console = console or wide_console()
    if df.empty:
        console.print("per rank: no measured points")
        return
    console.print(per_rank_table(df, "per rank", meta))
