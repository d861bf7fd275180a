"""epbench plot: PNGs drawn from results folders only (a CPU smoke run and the GPU runs kept in
docs/perf)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from epbench.plot import plot_run
from support import REPO, epbench_here

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
GPU_RUN = sorted((REPO / "docs" / "perf").glob("*_h200x4"))


def _is_png(path: Path) -> bool:
    return path.is_file() and path.stat().st_size > 10_000 and path.read_bytes()[:8] == PNG_MAGIC


def test_plot_command_writes_every_png_of_a_cpu_run(smoke_run, tmp_path):
    out = tmp_path / "pngs"
    r = epbench_here("plot", str(smoke_run.dir), "--out", str(out))
    assert r.code == 0, r.both
    written = sorted(p.name for p in (out / smoke_run.dir.name).iterdir())
    # every backend of a CPU run chose its own SM count: no plot against SMs, one line saying so
    assert written == ["expert_load.png", "per_rank.png"]
    assert "no bandwidth_vs_sms.png (no SM count was set" in r.err
    assert all(_is_png(out / smoke_run.dir.name / name) for name in written)
    assert not (smoke_run.dir / "plots").exists()  # --out keeps the run folder as it was


@pytest.mark.skipif(not GPU_RUN, reason="no GPU run kept in docs/perf")
def test_plot_of_a_gpu_sweep_with_several_sm_counts(tmp_path):
    run = tmp_path / GPU_RUN[-1].name
    shutil.copytree(GPU_RUN[-1], run, ignore=shutil.ignore_patterns("plots"))
    before = {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()}
    pngs = plot_run(run)
    assert [p.name for p in pngs] == ["bandwidth_vs_sms.png", "per_rank.png", "expert_load.png"]
    assert all(_is_png(p) for p in pngs)
    after = {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()}
    assert after == before  # plotting never touches the measured files


def test_plot_of_something_that_is_not_a_results_folder(tmp_path):
    r = epbench_here("plot", str(tmp_path))
    assert r.code == 2
    assert len(r.err.strip().splitlines()) == 1 and "Traceback" not in r.err


LL_RUN = sorted((REPO / "docs" / "perf").glob("*_dsv3x4-ll"))


@pytest.mark.skipif(not LL_RUN, reason="no low-latency GPU run kept in docs/perf")
def test_plot_of_a_low_latency_tokens_sweep_adds_latency_against_tokens(tmp_path):
    run = tmp_path / LL_RUN[0].name
    shutil.copytree(LL_RUN[0], run, ignore=shutil.ignore_patterns("plots", "samples.csv"))
    pngs = plot_run(run)
    names = [p.name for p in pngs]
    assert "latency_vs_tokens.png" in names  # the first kept run swept 1..256 tokens
    assert all(_is_png(p) for p in pngs)


VIRTUAL_RUN = sorted((REPO / "docs" / "perf").glob("*/results/*_h200x2x2-virtual"))


@pytest.mark.skipif(not VIRTUAL_RUN, reason="no virtual-node GPU run kept in docs/perf")
def test_plot_of_a_virtual_node_run_draws_the_nic_tier_labelled_virtual(tmp_path):
    from epbench.metrics import summarize
    from epbench.plot import bus_tiers
    from epbench.results import load_run

    run = tmp_path / VIRTUAL_RUN[-1].name
    shutil.copytree(VIRTUAL_RUN[-1], run, ignore=shutil.ignore_patterns("plots", "samples.csv"))
    _, df = load_run(run)
    labels = [label for _, label, _ in bus_tiers(summarize(df), virtual=True)]
    assert labels == ["NVLink busbw", "NIC busbw (virtual)"]
    assert all(_is_png(p) for p in plot_run(run))
    one_node = summarize(df.assign(busbw_nic_gbps=None))
    assert [label for _, label, _ in bus_tiers(one_node)] == ["NVLink busbw"]


def test_output_path_names_the_file_that_will_be_written(tmp_path):
    from epbench.errors import UserError
    from epbench.plot import output_path

    assert output_path(tmp_path / "ab", False) == tmp_path / "ab.png"  # what matplotlib would write
    assert output_path(tmp_path / "ab.svg", False) == tmp_path / "ab.svg"
    (tmp_path / "old.png").write_bytes(b"kept")
    with pytest.raises(UserError, match="exists; --force overwrites it"):
        output_path(tmp_path / "old.png", False)
    assert output_path(tmp_path / "old.png", True) == tmp_path / "old.png"
    with pytest.raises(UserError, match="unknown image type 'txt'"):
        output_path(tmp_path / "a.txt", False)
    (tmp_path / "d.png").mkdir()
    with pytest.raises(UserError, match="is a folder"):
        output_path(tmp_path / "d.png", True)
    assert (tmp_path / "old.png").read_bytes() == b"kept"


def drawn_figures(monkeypatch, run_dir, meta_edit=None):
    """plot_run's figures as matplotlib objects (labels and lines, not pixels)."""
    import epbench.plot as plot
    from epbench.results import load_run

    figs = {}

    def keep(fig, path, force=False):
        figs[Path(path).name] = fig
        return Path(path)

    monkeypatch.setattr(plot, "_save_figure", keep)
    meta, df = load_run(run_dir)
    plot.plot_run(run_dir, Path("/nonexistent-out"), loaded=((meta_edit or (lambda m: m))(meta), df))
    return figs


def legend_and_lines(ax):
    return list(ax.get_legend_handles_labels()[1]), ax.get_lines()


NVML_RUN = sorted((REPO / "docs" / "perf").glob("*/results/*_h200x4"))


@pytest.mark.skipif(not NVML_RUN or not GPU_RUN, reason="no GPU runs kept in docs/perf")
def test_multi_rank_nvlink_plot_has_link_limit_and_ceiling_lines(monkeypatch):
    from epbench import plot
    from epbench.metrics import bandwidth_gbps
    from epbench.results import load_run

    run = NVML_RUN[-1]  # NVML read the links' capacity in this run
    figs = drawn_figures(monkeypatch, run)
    ax = figs["bandwidth_vs_sms.png"].axes[0]
    labels = ax.get_legend_handles_labels()[1]
    assert ax.get_ylabel() == "GB/s over NVLink (slowest rank)"
    assert "epbench NVLink busbw" in labels and "link limit (NVML)" in labels
    assert "copy-engine ceiling (measured)" in labels
    _, df = load_run(run)
    lines = {ln.get_label(): ln for ln in ax.get_lines()}
    cap = df["nvlink_capacity_gbps"].max()
    assert list(lines["link limit (NVML)"].get_ydata()) == [cap, cap]
    d = df[df["op"] == "dispatch"]
    ceil = min(bandwidth_gbps(b, t) for b, t in zip(d["nvlink_bytes"], d["ceiling_copy_engine_us"]))
    assert lines["copy-engine ceiling (measured)"].get_ydata()[0] == pytest.approx(ceil)
    assert [t.get_text() for t in ax.texts] == [f"{cap:.0f}", f"{ceil:.0f}"]
    # an older run without NVML's capacity: the scenario's nominal rate, said so
    meta, df = load_run(GPU_RUN[-1])
    assert df.get("nvlink_capacity_gbps") is None or df["nvlink_capacity_gbps"].isna().all()
    assert plot.link_limit(meta, df) == (meta["scenario"]["topology"]["nvlink_gbps"], "scenario, nominal")
    labels = drawn_figures(monkeypatch, GPU_RUN[-1])["bandwidth_vs_sms.png"].axes[0].get_legend_handles_labels()[1]
    assert "link limit (scenario, nominal)" in labels


@pytest.mark.parametrize("meta_edit, how", [
    (lambda m: dict(m, world=1, functional="one rank: nothing crosses a link"), "one rank - functional"),
    (lambda m: dict(m, functional="4 ranks share each GPU: their traffic stays"), "shared GPU - functional"),
])
@pytest.mark.skipif(not GPU_RUN, reason="no GPU run kept in docs/perf")
def test_functional_plots_say_so_and_draw_no_link_lines(monkeypatch, meta_edit, how):
    from epbench.results import load_run

    meta, df = load_run(GPU_RUN[-1])
    functional = df.assign(busbw_nvlink_gbps=None, nvlink_capacity_gbps=None, ceiling_copy_engine_us=None)
    import epbench.plot as plot

    figs = {}
    monkeypatch.setattr(plot, "_save_figure", lambda fig, path, force=False: figs.setdefault(Path(path).name, fig) and Path(path))
    plot.plot_run(GPU_RUN[-1], Path("/nonexistent-out"), loaded=(meta_edit(meta), functional))
    fig = figs["bandwidth_vs_sms.png"]
    assert how in fig._suptitle.get_text() and "not link speed" in fig._suptitle.get_text()
    labels = fig.axes[0].get_legend_handles_labels()[1] + fig.axes[1].get_legend_handles_labels()[1]
    assert not any("busbw" in x or "link limit" in x or "ceiling" in x for x in labels)
    assert fig.axes[0].get_ylabel() == f"algbw GB/s, {how} (slowest rank)"
    assert figs["per_rank.png"].axes[0].get_ylabel() == f"algbw ({how}), GB/s"


def test_cpu_run_labels_name_gloo(smoke_run, monkeypatch):
    figs = drawn_figures(monkeypatch, smoke_run.dir)
    assert "bandwidth_vs_sms.png" not in figs
    ax = figs["per_rank.png"].axes[0]
    # gloo crosses no link: no bus bandwidth drawn, even from a folder that still holds one
    assert ax.get_ylabel() == "algbw (gloo (CPU)), GB/s"
    assert "NVLink" not in figs["per_rank.png"]._suptitle.get_text()
    assert "times, not link speed" in figs["per_rank.png"]._suptitle.get_text()


LATENCY_RUN = sorted((REPO / "docs" / "perf").glob("*_dsv3x4-ll"))


@pytest.mark.skipif(not LATENCY_RUN, reason="no low-latency GPU run kept in docs/perf")
def test_latency_ticks_are_plain_microseconds(monkeypatch):
    figs = drawn_figures(monkeypatch, LATENCY_RUN[0])
    ax = figs["latency_vs_tokens.png"].axes[0]
    figs["latency_vs_tokens.png"].canvas.draw()
    ticks = [t.get_text() for t in ax.get_yticklabels() if t.get_text()]
    assert ticks and all(t.replace(".", "").isdigit() for t in ticks), ticks  # no 10^x mathtext


# -- a plot command that writes nothing fails (issue 35, item 5) ---------------------------------

NV_MATRIX = "\tGPU0\tGPU1\nGPU0\t X \tNV18\nGPU1\tNV18\t X \n\nLegend: ..."  # nvidia-smi topo -m


def _cuda_run(path):
    from epbench.results import RunWriter

    w = RunWriter(path, {"device": "cuda", "world": 2, "topology": NV_MATRIX, **_scenario_meta(), "world": 2})
    w.add([{"scenario": "s", "backend": "epbench", "op": op, "sms": sms, "rank": r, "world": 2,
            "time_us": 500.0, "algbw_gbps": 300.0, "busbw_nvlink_gbps": 250.0, "wrong": 0}
           for op in ("dispatch", "combine") for sms in (8, 16) for r in range(2)], [])
    w.finish("complete")
    return path


def test_plot_into_a_folder_that_takes_nothing_fails_in_one_line(tmp_path, monkeypatch, capsys):
    import errno
    import os

    from epbench import results
    from inproc import epbench_here

    run = _cuda_run(tmp_path / "run")

    def read_only(*_args, **_kwargs):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS))

    monkeypatch.setattr(results.os, "open", read_only)
    r = epbench_here(monkeypatch, capsys, "plot", run, "--out", tmp_path / "ro" / "p")
    assert r.code == 2 and r.out == "", r.both
    assert r.err == f"epbench: error: {tmp_path / 'ro' / 'p'}: cannot write there (Read-only file system)\n"


def test_plot_that_could_write_no_png_fails_instead_of_warning(tmp_path, monkeypatch, capsys):
    import errno
    import os

    from matplotlib.figure import Figure

    from inproc import epbench_here

    runs = [_cuda_run(tmp_path / "root" / n) for n in ("a", "b")]

    def full(*_args, **_kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(Figure, "savefig", full)
    r = epbench_here(monkeypatch, capsys, "plot", tmp_path / "root")
    assert r.code == 2 and "wrote" not in r.out, r.both
    lines = r.err.strip().splitlines()
    assert len(lines) == 1 and str(runs[0] / "plots") in lines[0], r.err
    assert "cannot write (No space left on device)" in lines[0] and "1 more run(s)" in lines[0]
    assert not [p for p in tmp_path.rglob("*") if ".tmp" in p.name]


@pytest.mark.skipif(not NVML_RUN, reason="no GPU runs kept in docs/perf")
def test_runs_of_one_scenario_plot_together_bus_only_with_the_limit_lines(monkeypatch, tmp_path):
    import json

    import pandas as pd

    import epbench.plot as plot
    from epbench.results import load_run

    a, b = tmp_path / "a_run", tmp_path / "b_run"
    for d in (a, b):
        shutil.copytree(NVML_RUN[-1], d, ignore=shutil.ignore_patterns("plots"))
    csv = pd.read_csv(b / "results.csv")
    csv["backend"] = "deepep"  # another library's run of the same scenario, from its own venv
    csv.to_csv(b / "results.csv", index=False)
    figs = {}
    monkeypatch.setattr(plot, "_save_figure", lambda fig, path, force=False: figs.setdefault(Path(path).name, fig) and Path(path))
    runs = [(d, *load_run(d)) for d in (a, b)]
    plot.plot_together(runs, tmp_path / "out" / "together.png")
    labels = figs["together.png"].axes[0].get_legend_handles_labels()[1]
    assert "epbench [a_run] NVLink busbw" in labels and "deepep [b_run] NVLink busbw" in labels
    assert not any("algbw" in x for x in labels)  # bus only: algbw is the same multiple for all
    assert "link limit (NVML)" in labels and "copy-engine ceiling (measured)" in labels
    meta = json.loads((b / "meta.json").read_text())
    meta["world"] = 2
    (b / "meta.json").write_text(json.dumps(meta))
    runs = [(d, *load_run(d)) for d in (a, b)]
    assert "the runs measure different things" in plot.why_not_together(runs)
    assert "needs two or more runs" in plot.why_not_together(runs[:1])


def test_plot_together_of_one_run_is_one_line_and_exit_2(smoke_run, tmp_path):
    r = epbench_here("plot", str(smoke_run.dir), "--together", "--out", str(tmp_path / "o"))
    assert r.code == 2 and "--together needs two or more runs (1 found)" in r.err, r.both


def test_plot_together_with_an_overlap_run_names_it(smoke_run, tmp_path):
    from epbench import results

    w = results.RunWriter(tmp_path / "ov", {"verb": "overlap", "world": 1, "scenario": {"name": "smoke"}})
    w.add([{"backend": "reference", "sms": 0, "rank": 0, "wrong": 0, "gemm_kept_pct": 90.0,
            "comm_kept_pct": 80.0}], [])
    w.finish("complete")
    r = epbench_here("plot", str(smoke_run.dir), str(tmp_path / "ov"), "--together", "--out", str(tmp_path / "o"))
    assert r.code == 2 and "is an `epbench overlap` run" in r.err and len(r.err.strip().splitlines()) == 1, r.both


def test_a_plot_of_many_lines_gives_each_its_own_colour_and_the_whole_legend(monkeypatch):
    """Six backends in two call modes (the README's table): twelve lines, no two of one colour, the
    legend in two columns beside the axes, saved whole (bbox tight)."""
    import pandas as pd

    import epbench.plot as plot

    figs = []
    monkeypatch.setattr(plot, "_save_figure", lambda fig, path, force=False: figs.append(fig) or Path(path))
    rows = [dict(op=op, backend=f"b{b}", call_mode=mode, sms=sms, busbw_nvlink_gbps_min=10.0 * b + sms,
                 algbw_gbps_min=20.0 * b + sms)
            for op in plot.OPS for b in range(6) for mode in ("call", "kernel") for sms in (8, 16)]
    plot.bandwidth_vs_sms(pd.DataFrame(rows), "t", Path("/nonexistent/x.png"))
    ax = figs[0].axes[-1]
    busbw = [ln for ln in ax.get_lines() if ln.get_label().endswith("NVLink busbw")]
    assert len(busbw) == 12
    assert len({tuple(ln.get_color()) if not isinstance(ln.get_color(), str) else ln.get_color()
                for ln in busbw}) == 12
    assert ax.get_legend()._ncols == 2 and len(ax.get_legend().get_texts()) == 24
    plot.plt.close(figs[0])


def test_an_overlap_run_without_kept_figures_is_one_line_not_a_traceback(tmp_path):
    from epbench import results
    from epbench.errors import UserError

    w = results.RunWriter(tmp_path / "ov", {"verb": "overlap", "world": 1, "scenario": {"name": "s"}})
    w.add([{"backend": "reference", "sms": 0, "rank": 0, "wrong": 0}], [])
    w.finish("complete")
    with pytest.raises(UserError, match="no overlap plot .results.csv has no gemm_kept_pct"):
        plot_run(tmp_path / "ov", tmp_path / "out")


def test_a_figure_whose_file_is_kept_is_closed_too(tmp_path):
    import matplotlib.pyplot as plt

    from epbench import plot

    path = tmp_path / "x.png"
    path.write_text("an earlier plot")
    before = len(plt.get_fignums())
    for _ in range(3):
        fig, _ax = plt.subplots()
        with pytest.raises(plot.PlotsKept):
            plot._save_figure(fig, path, False)
    assert len(plt.get_fignums()) == before and path.read_text() == "an earlier plot"


# -- runs together, per-rank points, tokens sweeps, --out, provenance (new-user audit) ------------

def _run(path, rows, meta=None):
    """A results folder of ``rows`` (one per op, rank and point) with a commit in its meta.json."""
    from epbench.results import RunWriter

    w = RunWriter(path, {"device": "cuda", "world": 2, "git_commit": "c0ffee1234", "scenario": {"name": "s"},
                         "topology": NV_MATRIX, **(meta or {})})
    w.add([{"scenario": "s", "op": op, "world": 2, "wrong": 0, "algbw_gbps": 1.0, **r}
           for op in ("dispatch", "combine") for r in rows], [])
    w.finish("complete")
    return path


def _keep_figures(monkeypatch):
    import epbench.plot as plot

    figs = {}

    def keep(fig, path, force=False):
        figs[Path(path).name] = fig
        return Path(path)

    monkeypatch.setattr(plot, "_save_figure", keep)
    return figs


def test_runs_plotted_together_keep_one_line_per_run_labelled_with_it(monkeypatch, tmp_path):
    """The same backend in two runs (two builds of one library): two lines, each its own run's
    figures, not one line of the worse of both."""
    from epbench import plot
    from epbench.results import load_run

    runs = []
    for name, gbps in (("run_a", 100.0), ("run_b", 300.0)):
        rows = [dict(backend="deepep", sms=sms, rank=r, time_us=10.0, busbw_nvlink_gbps=gbps + sms)
                for sms in (8, 16) for r in range(2)]
        d = _run(tmp_path / name, rows)
        runs.append((d, *load_run(d)))
    figs = _keep_figures(monkeypatch)
    plot.plot_together(runs, tmp_path / "t.png")
    lines, _ = legend_and_lines(figs["t.png"].axes[0])
    ydata = {ln.get_label(): list(ln.get_ydata()) for ln in figs["t.png"].axes[0].get_lines()}
    assert lines == ["deepep [run_a] NVLink busbw", "deepep [run_b] NVLink busbw"]
    assert ydata["deepep [run_a] NVLink busbw"] == [108.0, 116.0]
    assert ydata["deepep [run_b] NVLink busbw"] == [308.0, 316.0]


def test_plot_together_of_runs_without_sm_counts_is_refused_in_one_line(tmp_path, monkeypatch, capsys):
    from inproc import epbench_here

    rows = [dict(backend="reference", sms=0, rank=r, time_us=10.0, busbw_nvlink_gbps=5.0) for r in range(2)]
    a, b = _run(tmp_path / "a", rows), _run(tmp_path / "b", rows)
    r = epbench_here(monkeypatch, capsys, "plot", "--together", a, b, "--out", tmp_path / "o")
    assert r.code == 2 and r.out == "", r.both
    assert r.err == ("epbench: error: --together: no run set an SM count (every backend chose its own): "
                     "no bandwidth-vs-SMs curve\n")
    assert not (tmp_path / "o").exists()


def test_per_rank_draws_each_point_at_the_largest_sm_count_as_its_own_bars(monkeypatch, tmp_path):
    """A --tokens sweep in two call modes: at the largest SM count four points per rank; the figure
    keeps the largest token count (said under the title) and one labelled bar per call mode."""
    rows = [dict(backend="epbench", sms=16, rank=r, tokens_per_rank=t, call_mode=m, time_us=10.0,
                 busbw_nvlink_gbps=t + (100 if m == "kernel" else 0) + r)
            for t in (8, 64) for m in ("call", "kernel") for r in range(2)]
    rows += [dict(backend="other", sms=8, rank=r, tokens_per_rank=64, time_us=10.0, busbw_nvlink_gbps=7.0)
             for r in range(2)]  # no call mode recorded: no tag for it
    run = _run(tmp_path / "sweep", rows)
    figs = drawn_figures(monkeypatch, run)
    fig = figs["per_rank.png"]
    assert "at 64 tokens per rank, the largest of the 2 measured" in fig._suptitle.get_text()
    ax = fig.axes[0]
    bars = {c.get_label(): [p.get_height() for p in c.patches] for c in ax.containers}
    assert bars == {"epbench [call, 16 SMs]": [64.0, 65.0], "epbench [kernel, 16 SMs]": [164.0, 165.0],
                    "other [8 SMs]": [7.0, 7.0]}
    xs = [p.get_x() for c in ax.containers for p in c.patches]
    assert len(set(xs)) == len(xs)  # no two bars at one place


def test_a_normal_mode_tokens_sweep_draws_time_against_tokens(monkeypatch, tmp_path):
    rows = [dict(backend="epbench", sms=16, rank=r, tokens_per_rank=t, call_mode=m,
                 time_us=t * (2.0 if m == "call" else 1.0), busbw_nvlink_gbps=10.0)
            for t in (8, 16, 32) for m in ("call", "kernel") for r in range(2)]
    figs = drawn_figures(monkeypatch, _run(tmp_path / "sweep", rows))
    labels, lines = legend_and_lines(figs["latency_vs_tokens.png"].axes[1])
    assert labels == ["epbench, 16 SMs, call", "epbench, 16 SMs, kernel"]
    assert [list(ln.get_xdata()) for ln in lines] == [[8, 16, 32]] * 2
    assert [list(ln.get_ydata()) for ln in lines] == [[16.0, 32.0, 64.0], [8.0, 16.0, 32.0]]


def test_plot_out_writes_each_run_into_its_own_subfolder_and_says_so(tmp_path, monkeypatch, capsys):
    """--out DIR with several runs: DIR/<run folder name>/ each (their PNGs share names), every
    file written printed with that path."""
    from inproc import epbench_here

    rows = [dict(backend="epbench", sms=sms, rank=r, time_us=10.0, busbw_nvlink_gbps=50.0)
            for sms in (8, 16) for r in range(2)]
    runs = [_run(tmp_path / "res" / n, rows) for n in ("r1", "r2")]
    r = epbench_here(monkeypatch, capsys, "plot", tmp_path / "res", "--out", tmp_path / "o")
    assert r.code == 0, r.both
    wrote = [line.split(" ", 1)[1] for line in r.out.splitlines()]
    assert wrote == [str(tmp_path / "o" / d.name / n) for d in runs
                     for n in ("bandwidth_vs_sms.png", "per_rank.png")]
    assert all(_is_png(Path(p)) for p in wrote)


def test_plot_out_refuses_two_runs_of_one_folder_name(tmp_path, monkeypatch, capsys):
    """<out>/<run folder name>/: two runs named alike in different parents would share a subfolder (the
    second overwriting, with --force, the first's plots): refused in one line before anything is drawn."""
    from inproc import epbench_here

    rows = [dict(backend="epbench", sms=sms, rank=r, time_us=10.0, busbw_nvlink_gbps=50.0)
            for sms in (8, 16) for r in range(2)]
    for parent in ("a", "b"):
        _run(tmp_path / parent / "same", rows)
    r = epbench_here(monkeypatch, capsys, "plot", tmp_path / "a", tmp_path / "b", "--out", tmp_path / "o",
                     "--force")
    assert r.code == 2 and "share the folder name 'same'" in r.err and len(r.err.splitlines()) == 1, r.both
    assert not (tmp_path / "o" / "same").exists()


def test_every_figure_names_its_run_and_commit_in_a_footer_and_the_file(tmp_path):
    from PIL import Image

    from epbench import plot

    rows = [dict(backend="epbench", sms=sms, rank=r, time_us=10.0, busbw_nvlink_gbps=50.0,
                 tokens_per_rank=t) for sms in (8, 16) for t in (8, 16) for r in range(2)]
    run = _run(tmp_path / "r1", rows, {"git_commit": "abc123+dirty"})
    pngs = plot_run(run, tmp_path / "o")
    assert [p.name for p in pngs] == ["bandwidth_vs_sms.png", "per_rank.png", "latency_vs_tokens.png"]
    for png in pngs:
        text = Image.open(png).text
        assert text["Run"] == "r1" and text["Commit"] == "abc123+dirty", text
        assert text["Source"] == "run r1: epbench commit abc123+dirty"
    other = _run(tmp_path / "r2", rows, {"git_commit": "def456"})
    for suffix in ("svg", "pdf"):  # the keys those formats take; compare --plot writes any of them
        out = plot.compare_plot(run, other, tmp_path / f"c.{suffix}")
        assert b"run r1: epbench commit abc123+dirty; run r2: epbench commit def456" in out.read_bytes()


def test_the_footer_is_drawn_on_the_figure(monkeypatch, tmp_path):
    rows = [dict(backend="epbench", sms=8, rank=r, time_us=10.0, busbw_nvlink_gbps=50.0) for r in range(2)]
    figs = drawn_figures(monkeypatch, _run(tmp_path / "r1", rows))
    assert "run r1: epbench commit c0ffee1234" in [t.get_text() for t in figs["per_rank.png"].texts]


def test_per_rank_keeps_a_backend_not_measured_at_the_largest_token_count(monkeypatch, tmp_path):
    """A --tokens 8,64 sweep whose 'other' job died before 64: its bars at its own largest (8), said in its
    labels, not dropped."""
    rows = [dict(backend="epbench", sms=16, rank=r, tokens_per_rank=t, time_us=10.0, busbw_nvlink_gbps=t + r)
            for t in (8, 64) for r in range(2)]
    rows += [dict(backend="other", sms=16, rank=r, tokens_per_rank=8, time_us=10.0, busbw_nvlink_gbps=7.0)
             for r in range(2)]
    fig = drawn_figures(monkeypatch, _run(tmp_path / "sweep", rows))["per_rank.png"]
    assert "at each backend's largest token count per rank (in its labels) of the 2 measured" in \
        fig._suptitle.get_text()
    bars = {c.get_label(): [p.get_height() for p in c.patches] for c in fig.axes[0].containers}
    assert bars == {"epbench [64 tokens, 16 SMs]": [64.0, 65.0], "other [8 tokens, 16 SMs]": [7.0, 7.0]}


def test_a_complete_run_that_lost_its_results_file_is_refused_not_an_expert_load_alone(tmp_path, monkeypatch,
                                                                                       capsys):
    """meta.json says complete, results.csv deleted since: the report's one line; beside a good run, a
    warning and the good run's plots."""
    import dataclasses
    import json

    from epbench import scenario
    from epbench.errors import UserError
    from inproc import epbench_here

    s = dataclasses.asdict(scenario.load(REPO / "scenarios" / "smoke.yaml"))
    lost = _run(tmp_path / "res" / "lost", [dict(backend="epbench", sms=8, rank=r, time_us=10.0) for r in range(2)],
                {"scenario": json.loads(json.dumps(s, default=str))})
    (lost / "results.csv").unlink()
    with pytest.raises(UserError, match="results.csv: missing, though meta.json says the run completed"):
        plot_run(lost, tmp_path / "o")
    assert not (tmp_path / "o").exists()
    good = _cuda_run(tmp_path / "res" / "good")
    r = epbench_here(monkeypatch, capsys, "plot", tmp_path / "res")
    assert r.code == 0 and "results.csv: missing, though meta.json says the run completed" in r.err, r.both
    assert (good / "plots" / "per_rank.png").exists() and not (lost / "plots").exists()


# -- plot audit: failed verification, measured tokens, leaked warnings, one SM count, CPU busbw, ----
# -- implausible figures ---------------------------------------------------------------------------

def _swept(path, wrong=0, sms=(8, 16), tokens=(8, 16), meta=None, **cols):
    """A --sms and --tokens sweep of two ranks, ``wrong`` in every row of the largest SM count."""
    rows = [{**dict(backend="epbench", sms=s, rank=r, tokens_per_rank=t, time_us=float(t), busbw_nvlink_gbps=50.0 + s,
                    wrong=wrong if s == max(sms) else 0), **cols} for s in sms for t in tokens for r in range(2)]
    return _run(path, rows, meta)


def _scenario_meta(tokens_per_rank=64):
    import dataclasses
    import json

    from epbench import scenario

    s = scenario.load(REPO / "scenarios" / "smoke.yaml")
    assert s.model.tokens_per_rank == tokens_per_rank
    return {"scenario": json.loads(json.dumps(dataclasses.asdict(s), default=str)), "world": s.world}


def test_a_run_that_failed_verification_says_so_loudly_and_marks_every_figure(monkeypatch, tmp_path, capsys):
    from epbench import plot
    from inproc import epbench_here

    run = _swept(tmp_path / "bad", wrong=3, meta=_scenario_meta())
    figs = drawn_figures(monkeypatch, run)
    assert sorted(figs) == ["bandwidth_vs_sms.png", "expert_load.png", "latency_vs_tokens.png", "per_rank.png"]
    for name, fig in figs.items():
        title = fig._suptitle if name != "expert_load.png" else fig.axes[0].title
        assert "VERIFICATION FAILED: 8 row(s) with wrong > 0" in title.get_text(), name
        assert title.get_color() == "red", name
    for name in ("bandwidth_vs_sms.png", "latency_vs_tokens.png"):
        crosses = [ln for ln in figs[name].axes[0].get_lines() if ln.get_label() == plot.FAILED]
        assert len(crosses) == 1 and crosses[0].get_color() == "red", name
    sms_x = [ln for ln in figs["bandwidth_vs_sms.png"].axes[0].get_lines() if ln.get_label() == plot.FAILED][0]
    assert set(sms_x.get_xdata()) == {16}  # only the points that failed
    bars = [p for c in figs["per_rank.png"].axes[0].containers for p in c.patches]
    assert bars and all(p.get_hatch() == "xx" for p in bars)  # the per-rank figure is of the largest SM count
    plot.plt.close("all")
    monkeypatch.undo()
    r = epbench_here(monkeypatch, capsys, "plot", run, "--out", tmp_path / "o")
    assert r.code == 0, r.both
    loud = [line for line in r.err.splitlines() if "VERIFICATION FAILED" in line]
    assert loud == [f"epbench: warning: {run}: VERIFICATION FAILED in 8 of 16 row(s) (wrong > 0): their figures "
                    f"time wrong results; every figure is marked"]


def test_a_run_that_verified_has_no_failure_mark(monkeypatch, tmp_path):
    figs = drawn_figures(monkeypatch, _swept(tmp_path / "good"))
    assert all("VERIFICATION" not in f._suptitle.get_text() for f in figs.values())
    assert all("verification" not in " ".join(f.axes[-1].get_legend_handles_labels()[1]) for f in figs.values())


def test_expert_load_is_drawn_at_the_tokens_the_run_measured_and_says_how_many(monkeypatch, tmp_path):
    """A --tokens 8,16 sweep of smoke.yaml (64 tokens per rank in its scenario): the load of 16 tokens per rank,
    the largest measured, named in the title; a run of its own count says that count."""
    meta = _scenario_meta()
    ax = drawn_figures(monkeypatch, _swept(tmp_path / "sweep", meta=meta))["expert_load.png"].axes[0]
    world, topk = meta["world"], meta["scenario"]["model"]["topk"]
    assert sum(p.get_height() for p in ax.patches) == 16 * world * topk
    assert "expert load at 16 tokens per rank x 4 ranks (the largest of the 2 token counts measured)" in ax.get_title()
    ax = drawn_figures(monkeypatch, _swept(tmp_path / "own", tokens=(64,), meta=meta))["expert_load.png"].axes[0]
    assert sum(p.get_height() for p in ax.patches) == 64 * world * topk
    assert "expert load at 64 tokens per rank x 4 ranks" in ax.get_title()


def test_one_sm_count_draws_no_bandwidth_against_sms_and_says_why(monkeypatch, tmp_path, capsys):
    """A low-latency run at one SM count (132 on an H200): every point on one x, no curve: no figure, one line."""
    from inproc import epbench_here

    run = _swept(tmp_path / "one", sms=(132,))
    assert "bandwidth_vs_sms.png" not in drawn_figures(monkeypatch, run)
    monkeypatch.undo()
    r = epbench_here(monkeypatch, capsys, "plot", run, "--out", tmp_path / "o")
    assert r.code == 0, r.both
    said = [line for line in r.err.splitlines() if "bandwidth_vs_sms" in line]
    assert said == [f"epbench: warning: {run}: no bandwidth_vs_sms.png (one SM count (132) was measured: a curve "
                    f"against SMs needs two or more (--sms A,B); per_rank.png shows the run)"]
    assert sorted(p.name for p in (tmp_path / "o" / "one").iterdir()) == ["latency_vs_tokens.png", "per_rank.png"]


def test_a_cpu_run_draws_no_bus_bandwidth_even_where_its_folder_holds_one(monkeypatch, tmp_path):
    figs = drawn_figures(monkeypatch, _swept(tmp_path / "cpu", meta={"device": "cpu"}))
    for name in ("bandwidth_vs_sms.png", "per_rank.png"):
        labels = [t for ax in figs[name].axes for t in [ax.get_ylabel()] + ax.get_legend_handles_labels()[1]]
        assert not any("busbw" in t for t in labels), (name, labels)
    assert figs["per_rank.png"].axes[0].get_ylabel() == "algbw (gloo (CPU)), GB/s"


@pytest.mark.parametrize("cols, said", [
    (dict(busbw_nvlink_gbps=float("inf")), "busbw_nvlink_gbps is infinite or beyond 1 PB/s in 16 row(s)"),
    (dict(nvlink_capacity_gbps=float("inf")), "nvlink_capacity_gbps is infinite or beyond 1 PB/s in 16 row(s)"),
    (dict(nvlink_bytes=1e6, ceiling_copy_engine_us=1e-300), "no copy-engine ceiling line for dispatch, combine"),
    (dict(backend="\u00dc\u00f1\u00ee\u00e7\u00f8d\u0401\U0001f4a5"),
     "characters the plot font lacks, drawn as boxes: \U0001f4a5 (U+1F4A5)"),
])
def test_figures_matplotlib_would_warn_about_are_one_line_each(tmp_path, cols, said):
    """Infinite figures (hand-edited or corrupt), a ceiling time that makes an infinite bandwidth, a backend named
    with a glyph the font lacks: one line each, no Python warning with its source line."""
    import warnings

    lines = []
    run = _swept(tmp_path / "odd", **cols)
    with warnings.catch_warnings(record=True) as leaked:
        warnings.simplefilter("always")
        pngs = plot_run(run, tmp_path / "o", warn=lines.append)
    assert [str(w.message) for w in leaked] == []
    lines = [line for line in lines if "no expert-load plot" not in line]  # the helper's scenario is a name only
    assert [line for line in lines if said in line] and len(lines) == 1, lines
    assert "bandwidth_vs_sms.png" in [p.name for p in pngs] and all(_is_png(p) for p in pngs)
