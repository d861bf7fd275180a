"""Tables for people: formatting happens here and nowhere earlier."""

from __future__ import annotations

import math
from typing import Any, Dict, Optional

import pandas as pd
from rich.console import Console

from epbench.console import wide_console
from rich.table import Table

from epbench.metrics import summarize


def _num(v: Any) -> str:
    """Three significant figures at most, none wasted on big numbers (327, 41.2, 0.0123)."""
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    v = float(v)
    if abs(v) >= 100:
        return f"{v:.0f}"
    return f"{v:.1f}" if abs(v) >= 10 else f"{v:.3g}"


def _spread(row: pd.Series, col: str) -> str:
    lo, med, hi = (row.get(f"{col}_{s}") for s in ("min", "median", "max"))
    if lo is None or (isinstance(lo, float) and math.isnan(lo)):
        return "-"
    if abs(hi - lo) < 0.05 * max(abs(med), 1e-9):
        return _num(med)
    return f"{_num(lo)} / {_num(med)} / {_num(hi)}"


def _ceiling_pct(row: pd.Series) -> str:
    vals = [row.get(f"pct_of_{k}_ceiling") for k in ("copy_engine", "sm_store")]
    if all(v is None or v != v for v in vals):
        return "-"
    return " / ".join(_num(v) for v in vals)


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


def low_latency_table(df: pd.DataFrame, title: str = "") -> Table:
    """Latency first: p50 and p99 over iterations (each the slowest rank's), then bandwidth."""
    summary = summarize(df)
    table = Table(title=title or None, caption="p50 / p99 = percentiles of the per-iteration times, "
                  "slowest rank; timing: plain launches or CUDA-graph replays of the low-latency path "
                  "(bytes: one row per (token, expert) pair), or 'normal': a normal-mode backend on the "
                  "same batch (one row per (token, rank)); GB/s, 'a / b / c' = min / median / max over ranks")
    for col, just in (("tokens", "right"), ("op", "left"), ("backend", "left"), ("SMs", "right"),
                      ("timing", "left"), ("p50 us", "right"), ("p99 us", "right"), ("algbw", "right"),
                      ("NVLink busbw", "right"), ("slow rank", "right"), ("#wrong", "right")):
        table.add_column(col, justify=just)
    for _, r in summary.iterrows():
        wrong = int(r["wrong"])
        table.add_row(str(int(r["tokens_per_rank"])), r["op"], r["backend"],
                      str(int(r["sms"])) if r["sms"] else "auto", str(r["timing"]),
                      _num(r["time_us"]), _num(r.get("time_us_p99")), _spread(r, "algbw_gbps"),
                      _spread(r, "busbw_nvlink_gbps"), str(int(r["slowest_rank"])),
                      f"[bold red]{wrong}[/]" if wrong else "0")
    return table


def results_table(df: pd.DataFrame, title: str = "") -> Table:
    if _low_latency(df):
        return low_latency_table(df, title)
    summary = summarize(df)
    tokens = _swept_tokens(df)
    table = Table(title=title or None, caption="GB/s; 'a / b / c' = min / median / max over ranks; time = slowest "
                  "rank's median. NVML: NVLink busbw from the GPUs' own counters ('!' = >10% off the "
                  "computed). links %: the busier direction's NVLink traffic, protocol included "
                  "(NVML raw counters), over the links' raw capacity for the op's time. % ceil: this "
                  "run's ideal copy of the same bytes by copy engines (CE) / by plain SM stores at the "
                  "same SMs (SM), time over the op's time")
    if tokens:
        table.add_column("tokens", justify="right")
    for col, just in (("op", "left"), ("backend", "left"), ("SMs", "right"), ("time us", "right"),
                      ("algbw", "right"), ("NVLink busbw", "right"), ("NVML", "right"), ("links %", "right"),
                      ("NIC busbw (virtual)" if _virtual(df) else "NIC busbw", "right"), ("% ceil CE / SM", "right"),
                      ("slow rank", "right"), ("#wrong", "right")):
        table.add_column(col, justify=just)
    for _, r in summary.iterrows():
        wrong = int(r["wrong"])
        table.add_row(*([str(int(r["tokens_per_rank"]))] if tokens else []),
                      r["op"], r["backend"], str(int(r["sms"])) if r["sms"] else "auto",
                      _num(r["time_us"]), _spread(r, "algbw_gbps"),
                      _spread(r, "busbw_nvlink_gbps"), _counted(r, "nvlink"),
                      _spread(r, "nvlink_link_use_pct"), _spread(r, "busbw_nic_gbps"), _ceiling_pct(r),
                      str(int(r["slowest_rank"])),
                      f"[bold red]{wrong}[/]" if wrong else "0")
    return table


def print_run(df: pd.DataFrame, meta: Dict[str, Any], console: Optional[Console] = None) -> None:
    console = console or wide_console()
    scenario = meta.get("scenario", {})
    functional = " - functional, no link figures" if meta.get("functional") else ""
    title = (f"{scenario.get('name', '?')} on {meta.get('world', '?')} ranks "
             f"({meta.get('device', '?')}{functional})")
    if df.empty:
        console.print(f"{title}: no measured points")
    else:
        console.print(results_table(df, title))
    for note in meta.get("notes", []):
        console.print(f"note: {note}")
    wrong = int(df["wrong"].sum()) if not df.empty else 0
    if wrong:
        bad = df[df["wrong"] > 0].iloc[0]
        console.print(f"[bold red]VERIFICATION FAILED: {wrong} wrong rows[/] (first: {bad['backend']} "
                      f"{bad['op']} sms={bad['sms']} rank {bad['rank']}: {bad['problem']})")
    if meta.get("status") not in (None, "complete"):
        console.print(f"[yellow]run status: {meta.get('status')}[/]")


def per_rank_table(df: pd.DataFrame, title: str = "") -> Table:
    """One row per (backend, op, SMs, rank): that rank's median time and bandwidths, the spread
    of its iterations, and a mark on the slowest rank of each point."""
    table = Table(title=title or None, caption="time = the rank's median over iterations "
                  "(min - max in brackets); bandwidths in GB/s; * = slowest rank of the point")
    for col, just in (("op", "left"), ("backend", "left"), ("SMs", "right"), ("rank", "right"),
                      ("time us", "right"), ("algbw", "right"), ("NVLink busbw", "right"),
                      ("NIC busbw (virtual)" if _virtual(df) else "NIC busbw", "right"), ("#wrong", "right")):
        table.add_column(col, justify=just)
    keys = ["backend", "op", "sms"] + [k for k in ("tokens_per_rank", "timing") if k in df]
    for _, g in df.groupby(keys, sort=False, dropna=False):
        slowest = g["time_us"].idxmax()
        for i, r in g.sort_values("rank").iterrows():
            spread = ""
            if "time_us_min" in r and "time_us_max" in r:
                spread = f" ({_num(r['time_us_min'])} - {_num(r['time_us_max'])})"
            wrong = int(r["wrong"]) if "wrong" in r else 0
            table.add_row(r["op"], r["backend"], str(int(r["sms"])) if r["sms"] else "auto",
                          f"{int(r['rank'])}{' *' if i == slowest else ''}",
                          _num(r["time_us"]) + spread, _num(r.get("algbw_gbps")),
                          _num(r.get("busbw_nvlink_gbps")), _num(r.get("busbw_nic_gbps")),
                          f"[bold red]{wrong}[/]" if wrong else "0")
    return table


def print_per_rank(df: pd.DataFrame, console: Optional[Console] = None) -> None:
    console = console or wide_console()
    if df.empty:
        console.print("per rank: no measured points")
        return
    console.print(per_rank_table(df, "per rank"))
