"""PNG plots drawn from results folders only (never from a live run)."""

from __future__ import annotations

import math
import os
import re
import sys
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402
from matplotlib.backend_bases import FigureCanvasBase  # noqa: E402

from matplotlib.patches import Rectangle  # noqa: E402
from matplotlib.ticker import FuncFormatter, LogLocator  # noqa: E402

from epbench.errors import UserError  # noqa: E402
from epbench.metrics import CALIBRATIONS, summarize  # noqa: E402
from epbench.plot_source import Sources, metadata as _metadata, stamp as _stamp  # noqa: E402
from epbench.report import link_figures, missing_results, transport  # noqa: E402
from epbench.results import load_run  # noqa: E402
from epbench.scenario import cut, short_path  # noqa: E402

OPS = ("dispatch", "combine")
CALIBRATION_LABELS = {"copy": "plain copy (calibration)", "copy-link": "plain copy across the links (calibration)"}


Warn = Callable[[str], None]
# a CPU run's ranks are gloo processes: no byte crosses a link, so these mean nothing (older folders still hold them)
BUS_COLUMNS = ("busbw_nvlink_gbps", "busbw_nic_gbps", "busbw_nvlink_measured_gbps", "busbw_nic_measured_gbps")
# the figures drawn, or drawn from: an infinite one (a hand edit, a corrupt file) would stretch an axis to nothing
FIGURE_COLUMNS = ("algbw_gbps",) + BUS_COLUMNS + ("nvlink_capacity_gbps", "ceiling_copy_engine_us", "nvlink_bytes")
MAX_GBPS = 1e6  # 1 PB/s per rank: a bandwidth beyond it is a corrupt figure, not a measurement
FAILED = "verification failed (wrong > 0)"  # the legend entry of the red marks on a wrong point


def _stderr(text: str) -> None:
    """A warning where the caller passed no ``warn``: one line on stderr, as the CLI writes them."""
    print(f"epbench: warning: {text}", file=sys.stderr)


def _warning_lines(caught: Sequence[warnings.WarningMessage]) -> List[str]:
    """What matplotlib or numpy warned about while drawing, one line each (never Python's warning
    with its source line): the characters the font lacks together, anything else by its message."""
    glyphs: List[str] = []
    lines: List[str] = []
    for w in caught:
        text = str(w.message)
        m = re.match(r"Glyph (\d+) ", text)
        if m:
            char = chr(int(m.group(1)))
            glyphs += [] if char in glyphs else [char]
            continue
        line = f"{type(w.message).__name__} while drawing: {text.splitlines()[0] if text else '?'}"
        lines += [] if line in lines else [line]
    if glyphs:
        lines.insert(0, "characters the plot font lacks, drawn as boxes: "
                        + " ".join(f"{c} (U+{ord(c):04X})" for c in glyphs))
    return lines


@contextmanager
def _drawing(where: str, warn: Optional[Warn]) -> Iterator[None]:
    """Draws with Python's warnings caught: each said once in one line after (``warn``), naming
    ``where``, instead of matplotlib's multi-line warning with its source line."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield
    for line in _warning_lines(caught):
        (warn or _stderr)(f"{where}: {line}")


def failed_rows(df: pd.DataFrame) -> int:
    """Rows whose verification failed (wrong > 0): their figures time a wrong result."""
    if "wrong" not in df:
        return 0
    return int((pd.to_numeric(df["wrong"], errors="coerce").fillna(0) > 0).sum())


def failed_note(failed: int) -> str:
    """The figure's loud mark of a run that failed verification ('' where none did)."""
    return f"VERIFICATION FAILED: {failed} row(s) with wrong > 0, marked in red" if failed else ""


def _wrong(frame: pd.DataFrame) -> pd.Series:
    """Which rows (or summary points) failed verification."""
    if "wrong" not in frame:
        return pd.Series(False, index=frame.index)
    return pd.to_numeric(frame["wrong"], errors="coerce").fillna(0) > 0


def _mark_wrong(ax, x: pd.Series, y: pd.Series) -> None:
    """Red crosses over the points whose verification failed (one legend entry per axes)."""
    if not len(x):
        return
    shown = FAILED in ax.get_legend_handles_labels()[1]
    ax.plot(x, y, "x", color="red", markersize=11, markeredgewidth=2.5, zorder=5,
            label="_nolegend_" if shown else FAILED)


def drawable(meta: Dict[str, Any], df: pd.DataFrame, warn: Optional[Warn] = None,
             where: str = "") -> pd.DataFrame:
    """The rows as the figures may show them: a CPU run's bus bandwidths dropped (gloo crosses
    no link; older CPU folders still hold figures for it), an infinite or NaN-producing figure
    column blanked with one line each (matplotlib would warn and draw an axis to nowhere)."""
    if df.empty:
        return df
    df = link_figures(df, meta)  # as the tables show them: a CPU run's '-'
    for col in FIGURE_COLUMNS:
        if col not in df:
            continue
        values = pd.to_numeric(df[col], errors="coerce").astype(float)
        bad = values.isin([math.inf, -math.inf])
        rate = col.endswith("_gbps")
        bad |= (values.abs() > MAX_GBPS) if rate else False
        if bad.any():
            (warn or _stderr)(f"{where + ': ' if where else ''}{col} is infinite"
                              f"{' or beyond 1 PB/s' if rate else ''} in {int(bad.sum())} row(s) "
                              f"(corrupt or hand-edited): not drawn")
            df = df.assign(**{col: values.where(~bad)})
    return df


def _label(backend: str) -> str:
    return "reference (NCCL / gloo)" if backend == "reference" else backend


def _tags(cols: Sequence[str], values: Sequence[Any]) -> List[str]:
    """A point's keys as legend tags: "64 tok", "4 input sets", a call or timing mode, a run
    (none for a key the rows left empty)."""
    shown = {"tokens_per_rank": "{} tok", "input_sets": "{} input sets"}
    return [shown.get(c, "{}").format(v) for c, v in zip(cols, values) if not pd.isna(v)]


def _varying(frame: pd.DataFrame, cols: Sequence[str]) -> List[str]:
    """The point keys among ``cols`` whose rows hold more than one value."""
    return [c for c in cols if c in frame and frame[c].nunique() > 1]


def _series(summary: pd.DataFrame):
    """Lines to draw: one per backend, split further by run (several runs drawn together), token
    count, timing mode, input sets and call mode where they differ, so that points of different
    runs or sweeps never join."""
    extra = _varying(summary, ("run", "tokens_per_rank", "timing", "input_sets", "call_mode"))
    for i, (key, g) in enumerate(summary.groupby(["backend"] + extra, sort=False, dropna=False)):
        key = key if isinstance(key, tuple) else (key,)
        tags = _tags(extra, key[1:])
        yield i, key[0], _label(key[0]) + (f" [{', '.join(tags)}]" if tags else ""), g


class PlotsKept(UserError):
    """A run's plots exist and --force was not given: they are kept (news, not a failure)."""


def compare_output(text: str, a_dir: Path, b_dir: Path) -> Path:
    """The file ``compare --plot TEXT`` writes: TEXT itself, or a file named after both runs
    inside TEXT where TEXT is a folder or is written as one (a trailing slash)."""
    path = Path(text)
    if text.endswith(("/", os.sep)) or path.is_dir():
        names = [d.resolve().name or "run" for d in (a_dir, b_dir)]
        path = path / f"compare_{names[0]}_vs_{names[1]}.png"
    return path


def output_path(path: Path, force: bool) -> Path:
    """The file a plot will be written to: ``.png`` added where the name has no suffix (what
    matplotlib would do silently), an existing file refused unless ``force``."""
    if not path.suffix:
        path = path.with_name(path.name + ".png")
    fmt = path.suffix[1:].lower()
    if fmt not in FigureCanvasBase.get_supported_filetypes():
        raise UserError(f"{short_path(path)}: unknown image type {fmt!r} (use .png, .svg or .pdf)")
    if path.is_dir():
        raise UserError(f"{short_path(path)}: is a folder; give a file name")
    if path.exists() and not force:
        raise PlotsKept(f"{short_path(path)}: exists; --force overwrites it")
    return path


def _save_figure(fig, path: Path, force: bool) -> Path:
    """Writes the figure next to ``path`` and moves it into place: an existing file is replaced
    only with ``force`` (os.link refuses an existing name, so a file that appeared meanwhile is
    kept too). The figure is closed whatever happens."""
    try:
        path = output_path(path, force)
    except BaseException:
        plt.close(fig)
        raise
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
        fmt = path.suffix[1:].lower()
        # bbox "tight": a legend placed beside the axes, and the footer below them, saved whole
        fig.savefig(tmp, dpi=120, format=fmt, bbox_inches="tight", metadata=_metadata(fig, fmt))
    except OSError as e:
        raise UserError(f"{short_path(path)}: cannot write ({e.strerror or type(e).__name__})") from None
    finally:
        plt.close(fig)
    try:
        if force:
            os.replace(tmp, path)
        else:
            os.link(tmp, path)
    except FileExistsError:
        raise PlotsKept(f"{short_path(path)}: exists; --force overwrites it") from None
    except OSError as e:
        raise UserError(f"{short_path(path)}: cannot write ({e.strerror or type(e).__name__})") from None
    finally:
        tmp.unlink(missing_ok=True)
    return path


def _save(fig, title: str, path: Path, force: bool = False, failed: int = 0) -> Path:
    """Titles, lays out and writes the figure; a run whose verification failed gets its title in
    bold red, the failure said at its end (failed_note), in the file's metadata title too."""
    note = failed_note(failed)
    fig.suptitle(title + (f"\n{note}" if note else ""), **({"color": "red", "fontweight": "bold"} if note else {}))
    fig.tight_layout()
    return _save_figure(fig, path, force)


def _has(frame: pd.DataFrame, col: str) -> bool:
    return col in frame and pd.to_numeric(frame[col], errors="coerce").notna().any()


def bus_tiers(summary: pd.DataFrame, virtual: bool = False,
              link: str = "NVLink") -> List[Tuple[str, str, str]]:
    """(column, label, line style) of each bus tier with numbers: the intranode tier (named by
    the transport that carried it) where bytes crossed a link, the NIC tier where the run had one
    (labelled virtual when the nodes were virtual: it crossed NVLink)."""
    tiers = [("busbw_nvlink_gbps_min", f"{link} busbw", "-")] if _has(summary, "busbw_nvlink_gbps_min") else []
    col = "busbw_nic_gbps_min"
    if _has(summary, col):
        tiers.append((col, "NIC busbw (virtual)" if virtual else "NIC busbw", ":"))
    return tiers


def link_limit(meta: Dict[str, Any], df: pd.DataFrame) -> Optional[Tuple[float, str]]:
    """(GB/s per direction, where it comes from) of the links a run crossed: the GPUs' NVLink
    capacity read from NVML, else the scenario's nominal topology.nvlink_gbps; None for runs
    whose bytes crossed no NVLink (CPU, functional, PCIe)."""
    if _has(df, "nvlink_capacity_gbps"):
        cap = float(pd.to_numeric(df["nvlink_capacity_gbps"], errors="coerce").max())
        if math.isfinite(cap) and cap > 0:
            return cap, "NVML"
    nominal = ((meta.get("scenario") or {}).get("topology") or {}).get("nvlink_gbps")
    try:
        nominal = float(nominal) if nominal else None
    except (TypeError, ValueError):
        return None
    return (nominal, "scenario, nominal") if nominal and math.isfinite(nominal) and nominal > 0 else None


def ceiling_gbps(df: pd.DataFrame, op: str) -> Optional[float]:
    """The copy-engine ceiling of ``op`` as a bus bandwidth: the slowest-bandwidth rank's NVLink
    bytes over the ideal copy's time measured in this run (None where not measured, or where the
    time is too small for a finite figure: a corrupt row, no line to draw)."""
    from epbench.metrics import bandwidth_gbps

    part = df[(df["op"] == op)] if "op" in df else df.iloc[0:0]
    if not _has(part, "ceiling_copy_engine_us") or not _has(part, "nvlink_bytes"):
        return None
    part = part[pd.to_numeric(part["ceiling_copy_engine_us"], errors="coerce") > 0]
    gbps = [bandwidth_gbps(float(b), float(t)) for b, t in zip(part["nvlink_bytes"], part["ceiling_copy_engine_us"])]
    best = min((g for g in gbps if g is not None and g == g), default=None)
    return best if best is not None and math.isfinite(best) and best <= MAX_GBPS else None


def ceilings_of(df: pd.DataFrame, where: str, warn: Optional[Warn] = None) -> Dict[str, Optional[float]]:
    """Each op's copy-engine ceiling line (ceiling_gbps); one whose rows hold a time but no
    plausible figure (a time so small the bandwidth is infinite or beyond 1 PB/s) is left out
    in one line, not drawn off the axis."""
    out = {op: ceiling_gbps(df, op) for op in OPS}
    lost = []
    for op, value in out.items():
        part = df[df["op"] == op] if "op" in df else df.iloc[0:0]
        times = pd.to_numeric(part["ceiling_copy_engine_us"], errors="coerce") \
            if "ceiling_copy_engine_us" in part else pd.Series([], dtype=float)
        lost += [op] if value is None and (times > 0).any() and _has(part, "nvlink_bytes") else []
    if lost:
        (warn or _stderr)(f"{where}: no copy-engine ceiling line for {', '.join(lost)} (ceiling_copy_engine_us "
                          f"too small for a plausible bandwidth: corrupt or hand-edited)")
    return out


def bandwidth_vs_sms(summary: pd.DataFrame, title: str, path: Path, virtual: bool = False,
                     force: bool = False, transport: str = "NVLink",
                     limit: Optional[Tuple[float, str]] = None,
                     ceilings: Optional[Dict[str, float]] = None, algbw: bool = True,
                     source: Optional[Sources] = None, failed: int = 0) -> Path:
    """Slowest rank's bus bandwidth per tier (solid; NIC dotted where there is one) and
    algorithm bandwidth (dashed; ``algbw`` False: bus only, where the bus figures exist) against
    the SM count; a backend whose SM count epbench does not control is a horizontal line. Grey
    lines: the link's limit and this run's copy-engine ceiling, labelled with their values. A
    functional run has no bus figures: algbw only. Points whose verification failed: red crosses
    (``failed`` rows: the title says so, _save)."""
    fig, axes = plt.subplots(1, len(OPS), figsize=(15, 4.5), sharey=True)
    swept = sorted({int(s) for s in summary["sms"] if s})
    tiers = bus_tiers(summary, virtual, transport)
    series = tiers + ([("algbw_gbps_min", "algbw", "--")] if algbw or not tiers else [])
    markers = {"-": "o", ":": "^", "--": "s"}
    colour = _colours(max(sum(1 for _ in _series(summary[summary["op"] == op])) for op in OPS))
    for ax, op in zip(axes, OPS):
        part = summary[summary["op"] == op]
        for i, _backend, name, g in _series(part):
            color = colour(i)
            g = g.sort_values("sms")
            wrong = _wrong(g)
            for col, what, style in series:
                if (g["sms"] == 0).all():
                    ax.axhline(g[col].iloc[0], color=color, linestyle=style, linewidth=1.2,
                               label=f"{name} {what} (auto SMs)" + (f" - {FAILED.upper()}" if wrong.any() else ""))
                else:
                    ax.plot(g["sms"], g[col], markers[style] + style, color=color,
                            alpha=0.7 if style == "--" else 1.0, label=f"{name} {what}")
                    _mark_wrong(ax, g["sms"][wrong], g[col][wrong])
        for value, style, label in (((limit or (None,))[0], "-.", f"link limit ({(limit or ('', ''))[1]})"),
                                    ((ceilings or {}).get(op), (0, (1, 1)), "copy-engine ceiling (measured)")):
            if value:
                ax.axhline(value, color="0.35", linestyle=style, linewidth=1.3, label=label)
                ax.annotate(f"{value:.0f}", (1.0, value), xycoords=("axes fraction", "data"),
                            xytext=(-4, 3), textcoords="offset points", ha="right", fontsize=8)
        ax.set_title(op)
        ax.set_xlabel("SMs")
        if swept:
            ax.set_xticks(swept)
        ax.grid(alpha=0.3)
    axes[0].set_ylim(bottom=0)  # bandwidth axes start at zero: no exaggerated gaps
    axes[0].set_ylabel(f"GB/s over {transport} (slowest rank)" if tiers else
                       f"algbw GB/s, {transport} (slowest rank)")
    _legend_beside(axes[-1])
    _stamp(fig, source)
    return _save(fig, title, path, force, failed)


def _legend_beside(ax) -> None:
    entries = len(ax.get_legend_handles_labels()[0])
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.02, 1.0),  # beside the data, never on it
              ncol=1 if entries <= 14 else 2)


def _colours(count: int) -> Callable[[int], Any]:
    """The i-th line's colour: no two of one colour up to 20 lines."""
    palette = plt.get_cmap("tab20") if count > 10 else None
    return (lambda i: palette(i % 20)) if palette else (lambda i: f"C{i % 10}")


def _token_lines(part: pd.DataFrame):
    """(label, rows) of each line against tokens: one per backend, SM count, input sets and call
    mode; of a low-latency run's timing modes, CUDA-graph replays where a backend has them, else
    its one mode (named in the label)."""
    keys = _varying(part, ("input_sets", "call_mode"))
    for backend, g in part.groupby("backend", sort=False):
        timing = None
        if "timing" in g and g["timing"].notna().any():
            timing = "graph" if (g["timing"] == "graph").any() else g["timing"].dropna().iloc[0]
            g = g[g["timing"] == timing]
        for key, h in g.groupby(["sms"] + keys, sort=True, dropna=False):
            key = key if isinstance(key, tuple) else (key,)
            tags = ([f"{int(key[0])} SMs"] if key[0] else []) + _tags(keys, key[1:])
            yield ", ".join([_label(backend)] + tags + ([str(timing)] if timing else [])), h


def latency_vs_tokens(summary: pd.DataFrame, title: str, path: Path, force: bool = False,
                      source: Optional[Sources] = None, failed: int = 0) -> Path:
    """A --tokens sweep (normal or low-latency): p50 time of the slowest rank against tokens per
    rank, one line per backend, SM count, input sets and call mode (_token_lines). Log axes: the
    NCCL reference and the kernels sit orders of magnitude apart. Failed points: red crosses."""
    fig, axes = plt.subplots(1, len(OPS), figsize=(12, 4.5), sharey=True)
    colour = _colours(max(sum(1 for _ in _token_lines(summary[summary["op"] == op])) for op in OPS))
    for ax, op in zip(axes, OPS):
        part = summary[summary["op"] == op]
        for i, (label, h) in enumerate(_token_lines(part)):
            h = h.sort_values("tokens_per_rank")
            ax.plot(h["tokens_per_rank"], h["time_us"], "o-", color=colour(i), label=label)
            _mark_wrong(ax, h["tokens_per_rank"][_wrong(h)], h["time_us"][_wrong(h)])
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ticks = sorted(int(t) for t in part["tokens_per_rank"].unique())
        ax.set_xticks(ticks, [str(t) for t in ticks])
        # plain microseconds at 1-2-5 steps: no 10^x labels, no unlabelled minor ticks
        ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _pos: f"{v:g}"))
        ax.minorticks_off()
        ax.set_title(op)
        ax.set_xlabel("tokens per rank")
        ax.grid(alpha=0.3, which="both")
    axes[0].set_ylabel("p50 latency, us (slowest rank)")
    _legend_beside(axes[-1])
    _stamp(fig, source)
    return _save(fig, title, path, force, failed)


def per_rank(df: pd.DataFrame, title: str, path: Path, force: bool = False,
             transport: str = "NVLink", source: Optional[Sources] = None, failed: int = 0) -> Path:
    """Each rank's bus bandwidth over ``transport`` at every backend's largest SM count, one bar
    per point measured there (timing mode, input sets, call mode where the run has several):
    imbalance shows. A --tokens sweep: each backend's largest measured token count only (one that
    died or was skipped at the run's largest keeps its bars), said under the title, or in each
    backend's labels where they differ. A functional or CPU run has no bus bandwidth: its algbw
    instead. A bar whose row failed verification: red edge, hatched."""
    col, what = (("busbw_nvlink_gbps", f"{transport} busbw") if _has(df, "busbw_nvlink_gbps")
                 else ("algbw_gbps", f"algbw ({transport})"))
    own_tokens = False
    if "tokens_per_rank" in df and df["tokens_per_rank"].nunique() > 1:
        counted = df["tokens_per_rank"].nunique()
        df = df[df["tokens_per_rank"] == df.groupby("backend")["tokens_per_rank"].transform("max")]
        own_tokens = df["tokens_per_rank"].nunique() > 1
        title += (f"\nat each backend's largest token count per rank (in its labels) of the {counted} measured"
                  if own_tokens else
                  f"\nat {int(df['tokens_per_rank'].iloc[0])} tokens per rank, the largest of the {counted} measured")
    keys = _varying(df, ("timing", "input_sets", "call_mode"))

    def bars(part: pd.DataFrame):
        top = part[part["sms"] == part.groupby("backend", sort=False)["sms"].transform("max")]
        return list(top.groupby(["backend"] + keys, sort=False, dropna=False))

    fig, axes = plt.subplots(1, len(OPS), figsize=(12, 4.5), sharey=True)
    colour = _colours(max(len(bars(df[df["op"] == op])) for op in OPS))
    for ax, op in zip(axes, OPS):
        part = df[df["op"] == op]
        groups = bars(part)
        width = 0.8 / max(len(groups), 1)
        for i, (key, g) in enumerate(groups):
            key = key if isinstance(key, tuple) else (key,)
            g = g.sort_values("rank")
            sms = int(g["sms"].iloc[0])
            tags = (([f"{int(g['tokens_per_rank'].iloc[0])} tokens"] if own_tokens else []) + _tags(keys, key[1:])
                    + ([f"{sms} SMs"] if sms else []))
            drawn = ax.bar(g["rank"] + (i - (len(groups) - 1) / 2) * width, g[col], width=width, color=colour(i),
                           label=_label(key[0]) + (f" [{', '.join(tags)}]" if tags else ""))
            for patch, wrong in zip(drawn.patches, _wrong(g)):
                if wrong:
                    patch.set(edgecolor="red", hatch="xx", linewidth=2)

        ax.set_title(op)
        ax.set_xticks(sorted(part["rank"].unique()))
        ax.set_xlabel("rank")
        ax.grid(alpha=0.3, axis="y")
    if failed_rows(df):  # the hatched bars' legend entry (an empty patch at the origin, which both axes hold)
        axes[-1].add_patch(Rectangle((0, 0), 0, 0, facecolor="white", edgecolor="red", hatch="xx", label=FAILED))
    axes[0].set_ylim(bottom=0)
    axes[0].set_ylabel(f"{what}, GB/s")
    _legend_beside(axes[-1])
    _stamp(fig, source)
    return _save(fig, title, path, force, failed)


def run_scenario(meta: dict):
    """The run's scenario rebuilt from meta.json (UserError where it no longer validates)."""
    from epbench.scenario import parse

    data = dict(meta.get("scenario") or {})
    data.pop("source", None)
    return parse(data, "meta.json scenario")


def measured_tokens(df: pd.DataFrame) -> List[int]:
    """The token counts per rank the run measured, fewest first (none where its rows hold none)."""
    if df.empty or "tokens_per_rank" not in df:
        return []
    from epbench.scenario import MAX_SHAPE  # a hand-edited count beyond it would route for minutes

    counts = pd.to_numeric(df["tokens_per_rank"], errors="coerce").dropna()
    return sorted({int(t) for t in counts if 1 <= t <= MAX_SHAPE["tokens_per_rank"]})


def expert_load(meta: dict, path: Path, force: bool = False,
                source: Optional[Sources] = None, tokens: Sequence[int] = (),
                failed: int = 0) -> Optional[Path]:
    """Tokens routed to each expert (regenerated from the run's scenario and seed) at the largest
    token count the run measured (``tokens``; a --tokens sweep measured others than the
    scenario's own), named in the title; the scenario's own count where no rows say."""
    from epbench.routing import expert_load as load_of, route_all

    if not meta.get("scenario"):
        return None
    s = run_scenario(meta)
    if tokens:
        s = s.with_tokens(max(tokens))
    load = load_of(route_all(s), s.num_experts).numpy()
    fig, ax = plt.subplots(figsize=(10, 3.5))
    epr = s.model.experts_per_rank
    ax.bar(range(len(load)), load, width=1.0,
           color=[f"C{(e // epr) % 10}" for e in range(len(load))])
    ax.axhline(load.mean(), color="k", linestyle="--", linewidth=1, label="average")
    ax.set_xlabel(f"expert (colour = rank, {epr} per rank)")
    ax.set_ylabel("tokens")
    counted = f" (the largest of the {len(tokens)} token counts measured)" if len(tokens) > 1 else ""
    note = failed_note(failed)
    ax.set_title(f"{s.name}: expert load at {s.model.tokens_per_rank} tokens per rank x {s.world} ranks{counted}, "
                 f"{s.routing.kind} routing (max/avg {load.max() / max(load.mean(), 1e-9):.2f})"
                 + (f"\n{note}" if note else ""), **({"color": "red", "fontweight": "bold"} if note else {}))
    ax.legend()
    fig.tight_layout()
    _stamp(fig, source)
    return _save_figure(fig, path, force)


def sm_counts(df: pd.DataFrame) -> List[int]:
    """The SM counts the run set (0: a backend chose its own, not counted)."""
    if df.empty or "sms" not in df:
        return []
    return sorted({int(s) for s in pd.to_numeric(df["sms"], errors="coerce").dropna() if s > 0})


def why_no_sms_plot(df: pd.DataFrame) -> Optional[str]:
    """Why a run gets no bandwidth_vs_sms.png (None: it does): a curve against SMs needs two or
    more SM counts; with one, every point sits on one x (per_rank.png shows them)."""
    counts = sm_counts(df)
    if not counts:
        return "no SM count was set: every backend chose its own"
    if len(counts) < 2:
        return (f"one SM count ({counts[0]}) was measured: a curve against SMs needs two or more "
                f"(--sms A,B); per_rank.png shows the run")
    return None


def plot_run(run_dir: Path, out_dir: Optional[Path] = None, force: bool = False,
             loaded: Optional[Tuple[Dict[str, Any], pd.DataFrame]] = None,
             warn: Optional[Callable[[str], None]] = None) -> List[Path]:
    """Every plot of one run (``loaded``: its meta and results, when the caller read them).
    Plots that exist are kept unless ``force``: then nothing of this run is drawn (UserError).
    A scenario in meta.json that no longer validates costs only the expert-load plot; a figure
    that would mean nothing is left out; a run that failed verification is marked in every
    figure: each said in one line (``warn``)."""
    warn = warn or _stderr
    meta, df = loaded or load_run(run_dir)
    if meta.get("verb") == "overlap":  # its rows are GEMM and communication kept %, not bandwidths
        return [overlap_plot(run_dir, out_dir, force, (meta, df))]
    if meta.get("verb") == "probe":
        raise UserError(f"{short_path(run_dir)}: an `epbench probe` run draws no plot (its figures "
                        f"are its table: `epbench report`)")
    lost = missing_results(run_dir, meta)  # complete, but results.csv deleted or cut short since
    if lost:
        raise UserError(lost)
    where = short_path(run_dir)
    if meta.get("scenario"):
        try:
            run_scenario(meta)
        except UserError as e:
            warn(f"{where}: no expert-load plot ({e})")
            meta = {k: v for k, v in meta.items() if k != "scenario"}
    out_dir = out_dir or run_dir / "plots"
    failed = failed_rows(df)
    df = drawable(meta, df, warn, where)
    summary = summarize(df) if not df.empty else df
    no_sms = why_no_sms_plot(df) if not df.empty else None
    by_sms = not df.empty and not no_sms
    names = (["bandwidth_vs_sms.png"] if by_sms else []) + (["per_rank.png"] if not df.empty else [])
    # a --tokens sweep, normal or low-latency: its time against tokens
    tokens_sweep = not df.empty and "tokens_per_rank" in summary and summary["tokens_per_rank"].nunique() > 1
    names += ["latency_vs_tokens.png"] if tokens_sweep else []
    names += ["expert_load.png"] if meta.get("scenario") else []
    there = [n for n in names if (out_dir / n).exists()]
    if there and not force:
        raise PlotsKept(f"{short_path(out_dir)}: holds {', '.join(there)} already; --force redraws them")
    if no_sms:
        warn(f"{where}: no bandwidth_vs_sms.png ({no_sms})")
    if failed:
        warn(f"{where}: VERIFICATION FAILED in {failed} of {len(df)} row(s) (wrong > 0): their figures time "
             f"wrong results; every figure is marked")
    how = transport(meta)
    note = ": times, not link speed" if "functional" in how or meta.get("device") == "cpu" else ""
    title = f"{run_dir.name} ({meta.get('world', '?')} ranks, {how}{note})"
    source = [(run_dir.name, meta)]
    written: List[Path] = []
    try:
        with _drawing(where, warn):
            if not df.empty:
                virtual = "nic_virtual" in df and bool(df["nic_virtual"].fillna(False).astype(bool).any())
                crossed = how in ("NVLink", "PCIe")
                limit = link_limit(meta, df) if how == "NVLink" and by_sms else None
                ceilings = ceilings_of(df, where, warn) if crossed and by_sms else None
                if by_sms:
                    written.append(bandwidth_vs_sms(summary, title, out_dir / "bandwidth_vs_sms.png", virtual,
                                                    force, how, limit, ceilings, source=source, failed=failed))
                written.append(per_rank(df, title, out_dir / "per_rank.png", force, how, source, failed))
                if tokens_sweep:
                    written.append(latency_vs_tokens(summary, title, out_dir / "latency_vs_tokens.png", force,
                                                     source, failed))
            load_png = expert_load(meta, out_dir / "expert_load.png", force, source, measured_tokens(df), failed)
    except (KeyError, TypeError, ValueError) as e:  # columns of the wrong kind in a hand-edited file
        plt.close("all")
        raise UserError(f"{where}: cannot plot ({type(e).__name__}: {cut(str(e), 60)})") from None
    if load_png:
        written.append(load_png)
    return written


def why_not_together(runs: List[Tuple[Path, Dict[str, Any], pd.DataFrame]]) -> Optional[str]:
    """Why runs cannot share one bandwidth-vs-SMs figure (None: they can): they must measure the
    same scenario on the same number of ranks over the same transport, and have rows."""
    if len(runs) < 2:
        return f"--together needs two or more runs ({len(runs)} found)"
    other = [(d, m.get("verb")) for d, m, _ in runs if m.get("verb") in ("overlap", "probe")]
    if other:  # their rows are kept % or a kernel's parts, not bandwidths
        return f"--together draws bandwidths: {short_path(other[0][0])} is an `epbench {other[0][1]}` run"
    keys = {(str((m.get("scenario") or {}).get("name")), m.get("world"), transport(m)) for _, m, _ in runs}
    if len(keys) > 1:
        shown = "; ".join(f"{name} on {world} ranks over {how}" for name, world, how in sorted(keys, key=str))
        return f"--together: the runs measure different things ({shown})"
    empty = [short_path(d) for d, _, df in runs if df.empty]
    if empty:
        return f"--together: no measured rows in {', '.join(empty)}"
    if not any((pd.to_numeric(df["sms"], errors="coerce").fillna(0) > 0).any() for _, _, df in runs):
        # as plain `plot` and `compare --plot`: no curve, only each backend's one point
        return "--together: no run set an SM count (every backend chose its own): no bandwidth-vs-SMs curve"
    return None


def _run_names(dirs: List[Path]) -> List[str]:
    """Each run's name in a legend: its folder's name, its path where two folders share a name."""
    names = [d.name for d in dirs]
    return names if len(set(names)) == len(names) else [short_path(d) for d in dirs]


def plot_together(runs: List[Tuple[Path, Dict[str, Any], pd.DataFrame]], out: Path,
                  force: bool = False, warn: Optional[Warn] = None) -> Path:
    """One bandwidth-vs-SMs figure of several runs of the same scenario, ranks and transport
    (e.g. one run per DeepEP flavor, each from its own venv): each run's lines of its own, labelled
    with the run (a backend in two runs may be two builds of it), bus bandwidth only (algbw is the
    same multiple of it for every backend of one scenario), the link limit read by any of them,
    each op's lowest copy-engine ceiling measured. A run that failed verification: one line
    (``warn``), the title and its points marked red."""
    why = why_not_together(runs)
    if why:
        raise UserError(why)
    failed = 0
    for d, meta, df in runs:
        failed += failed_rows(df)
        if failed_rows(df):
            (warn or _stderr)(f"{short_path(d)}: VERIFICATION FAILED in {failed_rows(df)} of {len(df)} row(s) "
                              f"(wrong > 0): marked in the figure")
    runs = [(d, m, drawable(m, df, warn, short_path(d))) for d, m, df in runs]
    names = _run_names([d for d, _, _ in runs])
    summary = pd.concat([summarize(d).assign(run=name) for name, (_, _, d) in zip(names, runs)],
                        ignore_index=True)
    metas = [m for _, m, _ in runs]
    how = transport(metas[0])
    limits = [lim for m, (_, _, d) in zip(metas, runs) for lim in [link_limit(m, d)] if lim] if how == "NVLink" else []
    ceilings = ({op: min((c for c in (ceiling_gbps(d, op) for _, _, d in runs) if c), default=None) for op in OPS}
                if how in ("NVLink", "PCIe") else None)  # an implausible one: None (ceiling_gbps), no line
    scenario = (metas[0].get("scenario") or {}).get("name", "?")
    title = (f"{scenario} ({metas[0].get('world', '?')} ranks, {how}), {len(runs)} runs: "
             f"{', '.join(d.name.split('_')[0] for d, _, _ in runs)}")
    with _drawing(short_path(out), warn):
        return bandwidth_vs_sms(summary, title, out, False, force, how, max(limits) if limits else None,
                                ceilings, algbw=False, source=list(zip(names, metas)), failed=failed)


def _compare_links(metas: List[Dict[str, Any]]) -> str:
    """What carried the compared runs' bytes, for the axis: one transport, or A's and B's."""
    links = [transport(m) for m in metas]
    return links[0] if links[0] == links[1] else f"A {links[0]} / B {links[1]}"


def why_no_compare_plot(a_dir: Path, b_dir: Path) -> Optional[str]:
    """Why ``compare --plot`` would draw empty axes (None: it has curves to draw): neither run
    set an SM count, or neither has a bus bandwidth (nothing crossed a link)."""
    from epbench.compare import load

    frames = [drawable(meta, df, lambda _text: None) for meta, df in (load(d) for d in (a_dir, b_dir))]
    if not any(not df.empty and (pd.to_numeric(df["sms"], errors="coerce").fillna(0) > 0).any()
               for df in frames):
        return "neither run set an SM count (every backend chose its own): no bandwidth-vs-SMs curve"
    if not any(_has(df, "busbw_nvlink_gbps") for df in frames):
        return "neither run has a bus bandwidth (nothing crossed a link)"
    return None


def compare_plot(a_dir: Path, b_dir: Path, out: Path, force: bool = False,
                 warn: Optional[Warn] = None) -> Path:
    """Both runs' slowest-rank bus bandwidth against the SM count, per op and backend: A
    solid, B dashed, one colour per backend; the axis names the transport that carried it. A run
    that failed verification: one line (``warn``), the title and its points marked red. Runs of
    different shapes (compare.shape_differences): the title names the fields (`compare`, which
    draws it, names each in a warning line above its table)."""
    from epbench.compare import load, shape_differences

    runs = [(a_dir, "A", "o-"), (b_dir, "B", "s--")]
    frames, metas, loaded = [], [], [load(d) for d in (a_dir, b_dir)]
    unlike = [field for field, _, _ in shape_differences(*loaded[0], *loaded[1])]
    failed = 0
    for (d, tag, style), (meta, df) in zip(runs, loaded):
        metas.append(meta)
        failed += failed_rows(df)
        if failed_rows(df):
            (warn or _stderr)(f"{short_path(d)}: VERIFICATION FAILED in {failed_rows(df)} of {len(df)} row(s) "
                              f"(wrong > 0): marked in the figure")
        df = drawable(meta, df, warn, short_path(d))
        frames.append((tag, style, summarize(df) if not df.empty else df))
    backends = list(dict.fromkeys(b for _, _, s in frames if not s.empty for b in s["backend"]))
    fig, axes = plt.subplots(1, len(OPS), figsize=(12, 4.5), sharey=True)
    for ax, op in zip(axes, OPS):
        for tag, style, summary in frames:
            if summary.empty:
                continue
            for _, backend, name, g in _series(summary[summary["op"] == op]):
                color = f"C{backends.index(backend) % 10}"
                g = g.sort_values("sms")
                label = f"{tag}: {name}"
                if (g["sms"] == 0).all():
                    ax.axhline(g["busbw_nvlink_gbps_min"].iloc[0], color=color,
                               linestyle=style[1:], label=f"{label} (auto SMs)")
                else:
                    ax.plot(g["sms"], g["busbw_nvlink_gbps_min"], style, color=color, label=label)
                    _mark_wrong(ax, g["sms"][_wrong(g)], g["busbw_nvlink_gbps_min"][_wrong(g)])
        ax.set_title(op)
        ax.set_xlabel("SMs")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel(f"busbw GB/s over {_compare_links(metas)} (slowest rank)")
    if axes[-1].get_legend_handles_labels()[0]:
        axes[-1].legend(fontsize=8, loc="lower right")
    _stamp(fig, [(a_dir.name, metas[0]), (b_dir.name, metas[1])])
    with _drawing(short_path(out), warn):
        unlike_said = f"\ndifferent shapes: {', '.join(unlike)}" if unlike else ""
        return _save(fig, f"A = {a_dir.name}  vs  B = {b_dir.name}{unlike_said}", out, force, failed)


def overlap_plot(run_dir: Path, out_dir: Optional[Path] = None, force: bool = False,
                 loaded: Optional[Tuple[Dict[str, Any], pd.DataFrame]] = None) -> Path:
    """An ``epbench overlap`` folder: the GEMM's kept % (left) and the communication's kept %
    (right, dispatch + combine, or the calibration copy) against the communication's SMs, one
    line per backend, the worst rank of each point."""
    from epbench.metrics import summarize_overlap as overlap_summary

    meta, df = loaded or load_run(run_dir)
    out_dir = out_dir or run_dir / "plots"
    summary = overlap_summary(df) if not df.empty else df
    panels = (("GEMM kept % (of alone on all SMs)", "gemm_kept_pct"),
              ("communication kept % (of alone)", "comm_kept_pct"))
    lacking = [col for _, col in panels if not summary.empty and col not in summary]
    if lacking:  # rows with no kept % (hand-made or cut short): nothing to draw
        raise UserError(f"{short_path(run_dir)}: no overlap plot (results.csv has no {lacking[0]})")
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    for ax, (name, col) in zip(axes, panels):
        for i, (name, g) in enumerate(summary.groupby("label", sort=False) if not summary.empty else []):
            g = g.sort_values("sms")
            backend = g["backend"].iloc[0]
            style = "s--" if backend in CALIBRATIONS else "o-"
            label = (CALIBRATION_LABELS[backend] if backend in CALIBRATIONS
                     else _label(backend) + name[len(backend):])  # the call mode where the run has several
            if (g["sms"] == 0).all():
                ax.axhline(g[col].iloc[0], color=f"C{i % 10}", linestyle=":", label=f"{label} (auto SMs)")
            else:
                ax.plot(g["sms"], g[col], style, color=f"C{i % 10}", label=label)
        ax.set_title(name)
        ax.set_xlabel("communication SMs (the GEMM has the rest)")
        ax.axhline(100, color="grey", linewidth=0.8)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("% of its own speed alone")
    if axes[-1].get_legend_handles_labels()[0]:
        axes[-1].legend(fontsize=8, loc="lower right")
    o = meta.get("overlap", {})
    _stamp(fig, [(run_dir.name, meta)])
    with _drawing(short_path(run_dir), None):  # a backend named with a glyph the font lacks: one line
        return _save(fig, f"{run_dir.name}: {o.get('gemm', 'GEMM')} beside the communication "
                          f"({meta.get('world', '?')} ranks)", out_dir / "overlap_vs_sms.png", force,
                     failed_rows(df))
