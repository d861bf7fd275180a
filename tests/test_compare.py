"""compare.py, the compare command and plot, and the per-rank report, on results folders
written by results.RunWriter into tmp_path."""


import pandas as pd
import pytest
from rich.console import Console

from epbench import compare, report
from epbench.plot import compare_plot
from epbench.results import RunWriter
from support import assert_one_line_error, epbench_here

META = {"scenario": {"name": "s"}, "world": 2, "device": "cuda", "gpus": ["NVIDIA H200"] * 2,
        "driver": "580.159.04", "cuda": "13.0", "torch": "2.11.0+cu130", "nccl": "2.28.9",
        "host": "gpu-host", "topology": "GPU0\tGPU1\nGPU0\t X \tNV18\nGPU1\tNV18\t X \n"}


def rows(backend, op, sms, times, busbw, wrong=0):
    return [{"scenario": "s", "backend": backend, "op": op, "sms": sms, "rank": r, "world": 2,
             "time_us": t, "time_us_min": t * 0.9, "time_us_max": t * 1.2,
             "algbw_gbps": b * 4 / 3, "busbw_nvlink_gbps": b, "busbw_nic_gbps": None,
             "wrong": wrong, "problem": ""} for r, (t, b) in enumerate(zip(times, busbw))]


def write_run(path, meta, row_lists):
    w = RunWriter(path, meta)
    for rs in row_lists:
        w.add(rs, [])
    w.finish("complete")
    return path


@pytest.fixture
def runs(tmp_path):
    a = write_run(tmp_path / "a", META, [
        rows("reference", "dispatch", 0, (800.0, 820.0), (250.0, 240.0)),
        rows("epbench", "dispatch", 8, (500.0, 520.0), (300.0, 290.0)),
        rows("epbench", "dispatch", 16, (450.0, 450.0), (320.0, 330.0)),
    ])
    b = write_run(tmp_path / "b", dict(META, driver="570.86.10", host="other"), [
        rows("reference", "dispatch", 0, (820.0, 861.0), (245.0, 230.0)),
        rows("epbench", "dispatch", 8, (400.0, 416.0), (360.0, 348.0)),
        rows("epbench", "dispatch", 32, (380.0, 390.0), (370.0, 380.0)),
    ])
    return a, b


def test_side_by_side_ratios_and_unmatched_rows(runs):
    a, b = runs
    both = compare.side_by_side(compare.load(a)[1], compare.load(b)[1])
    by = {(r.backend, r.sms): r for r in both.itertuples()}
    ref = by[("reference", 0)]
    assert ref.time_us_a == 820.0 and ref.time_us_b == 861.0  # slowest rank's time
    assert ref.time_us_ratio == pytest.approx(861.0 / 820.0)
    assert ref.busbw_nvlink_gbps_min_ratio == pytest.approx(230.0 / 240.0)
    ep8 = by[("epbench", 8)]
    assert ep8.time_us_ratio == pytest.approx(416.0 / 520.0)
    only_a, only_b = by[("epbench", 16)], by[("epbench", 32)]
    assert only_a.time_us_b is None and only_a.time_us_ratio is None
    assert only_b.time_us_a is None and only_b.busbw_nvlink_gbps_min_ratio is None
    assert len(both) == 4


def test_a_run_whose_call_mode_column_is_empty_still_compares(tmp_path):
    """call_mode left empty in every row (a hand edit) reads as floats: matched as text, no
    pandas merge error ('merge on str and float64 columns')."""
    with_mode = [dict(r, call_mode="call") for r in rows("reference", "dispatch", 0, (800.0, 820.0), (250.0, 240.0))]
    a = write_run(tmp_path / "a", META, [with_mode])
    b = write_run(tmp_path / "b", META, [[dict(r, call_mode=None) for r in with_mode]])
    both = compare.side_by_side(compare.load(a)[1], compare.load(b)[1])
    assert len(both) == 2 and sorted(map(str, both["call_mode"])) == ["None", "call"]
    r = epbench_here("compare", a, b)
    assert r.code == 0 and "Traceback" not in r.err, r.err


def test_provenance_warnings_one_per_difference():
    w = compare.provenance_warnings(META, dict(META, driver="570", nccl=None))
    assert w == ["driver differs: A 580.159.04 vs B 570", "nccl differs: A 2.28.9 vs B missing"]
    assert compare.provenance_warnings(META, dict(META)) == []


def test_print_compare_table_and_warnings(runs):
    a, b = runs
    con = Console(record=True, width=220, color_system=None)
    compare.print_compare(a, b, con)
    text = con.export_text()
    line = next(ln for ln in text.splitlines() if "epbench" in ln and " 8 " in ln)
    assert "520" in line and "416" in line and "0.800" in line
    assert "warning: driver differs: A 580.159.04 vs B 570.86.10" in text
    assert "warning: host differs: A gpu-host vs B other" in text
    assert "gpus differs" not in text


def test_compare_missing_folders_are_user_errors(tmp_path, runs):
    a, _ = runs
    with pytest.raises(compare.UserError, match="no such results folder"):
        compare.load(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(compare.UserError, match="not a results folder"):
        compare.load(tmp_path / "empty")
    r = epbench_here("compare", a, tmp_path / "nope")
    assert_one_line_error(r, "nope", "no such results folder")


def test_compare_command_and_plot(runs, tmp_path):
    a, b = runs
    png = tmp_path / "cmp" / "compare.png"
    r = epbench_here("compare", a, b, "--plot", png)
    assert r.code == 0, r.both
    assert "time B/A" in r.out and "driver differs" in r.out
    assert png.is_file() and png.stat().st_size > 10_000
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_compare_plot_with_an_empty_run(tmp_path, runs):
    a, _ = runs
    empty = tmp_path / "e"
    RunWriter(empty, META).finish("failed")
    out = compare_plot(a, empty, tmp_path / "x.png")
    assert out.is_file()


# -- per-rank report ----------------------------------------------------------------------

def test_per_rank_table_lists_every_rank_and_marks_the_slowest(runs):
    a, _ = runs
    df = pd.read_csv(a / "results.csv")
    con = Console(record=True, width=220, color_system=None)
    report.print_per_rank(df, con)
    text = con.export_text()
    lines = [ln for ln in text.splitlines() if "epbench" in ln and " 8 " in ln]
    assert len(lines) == 2
    slow = next(ln for ln in lines if "1 *" in ln)
    assert "520" in slow and "290" in slow and "(468 - 624)" in slow
    assert not any("0 *" in ln for ln in lines)


def test_report_per_rank_option(runs):
    a, _ = runs
    r = epbench_here("report", a, "--per-rank")
    assert r.code == 0, r.both
    assert "per rank" in r.out and "1 *" in r.out
    r = epbench_here("report", a)
    assert "per rank" not in r.out


def test_option_warnings_from_rows_and_meta():
    import json

    import pandas as pd

    from epbench.compare import option_warnings

    def rows(impl, warps):
        return pd.DataFrame([{"backend": "epbench", "options": json.dumps({"dispatch_impl": impl, "combine_warps": w})}
                             for w in warps] + [{"backend": "reference", "options": None}])

    meta_a = {"scenario": {"backend_options": {"epbench-ll": {"warps": 8}}}}
    meta_b = {"scenario": {"backend_options": {"epbench-ll": {"warps": 16}}}}
    got = option_warnings(meta_a, rows("lean_dyn", [12]), meta_b, rows("lean", [12, 8]))
    assert got == ["epbench option combine_warps differs: A 12 vs B 12, 8",
                   "epbench option dispatch_impl differs: A lean_dyn vs B lean",
                   "epbench-ll option warps differs: A 8 vs B 16"]
    assert option_warnings(meta_a, rows("lean", [12]), meta_a, rows("lean", [12])) == []


# -- --plot into a folder, and nothing drawn where there is nothing to draw (issue 35, items 5, 8) --

@pytest.mark.parametrize("given", ["existing", "slash"])
def test_compare_plot_into_a_folder_writes_inside_it(runs, tmp_path, given, monkeypatch, capsys):
    from inproc import epbench_here

    a, b = runs
    folder = tmp_path / "pngs"
    if given == "existing":
        folder.mkdir()
    arg = str(folder) if given == "existing" else f"{folder}/"
    r = epbench_here(monkeypatch, capsys, "compare", a, b, "--plot", arg)
    assert r.code == 0, r.both
    png = folder / "compare_a_vs_b.png"
    assert f"wrote {png}" in r.out and png.is_file()
    assert not (tmp_path / "pngs.png").exists()


def test_compare_plot_of_runs_without_sm_counts_draws_nothing_and_says_why(tmp_path, monkeypatch, capsys):
    from inproc import epbench_here

    gloo = dict(META, device="cpu")
    a = write_run(tmp_path / "a", gloo, [rows("reference", "dispatch", 0, (800.0, 820.0), (0.1, 0.1))])
    b = write_run(tmp_path / "b", gloo, [rows("reference", "dispatch", 0, (700.0, 720.0), (0.1, 0.1))])
    r = epbench_here(monkeypatch, capsys, "compare", a, b, "--plot", tmp_path / "c.png")
    assert r.code == 0 and "time B/A" in r.out, r.both
    assert r.err.strip().splitlines()[-1] == ("epbench: warning: --plot: nothing drawn: neither run set an "
                                              "SM count (every backend chose its own): no bandwidth-vs-SMs curve")
    assert not (tmp_path / "c.png").exists()


def test_compare_plot_names_the_transport_of_the_runs(runs, tmp_path, monkeypatch):
    from epbench import plot

    a, b = runs
    labels = []
    monkeypatch.setattr(plot, "_save", lambda fig, title, path, force=False, failed=0: labels.append(
        fig.axes[0].get_ylabel()) or path)
    plot.compare_plot(a, b, tmp_path / "x.png")
    gloo = write_run(tmp_path / "g", dict(META, device="cpu"), [rows("reference", "dispatch", 8, (1.0, 1.0), (1.0, 1.0))])
    plot.compare_plot(a, gloo, tmp_path / "y.png")
    assert labels == ["busbw GB/s over NVLink (slowest rank)",
                      "busbw GB/s over A NVLink / B gloo (CPU) (slowest rank)"]


# -- status and transport (new-user audit) --

def test_compare_warns_of_a_run_that_did_not_complete(runs, tmp_path):
    from epbench.results import finish_run

    a, b = runs
    finish_run(b, "failed", "epbench: rank 1 was killed by SIGKILL")
    con = Console(record=True, width=220, color_system=None)
    compare.print_compare(a, b, con)
    text = con.export_text()
    assert (f"warning: B {b}: run status failed (epbench: rank 1 was killed by SIGKILL): its figures "
            f"may be partial") in text
    assert f"warning: A {a}" not in text
    assert compare.status_warnings(a, {"status": "complete"}, b, {}) == []  # no status recorded (older): nothing
    assert compare.status_warnings(a, {"status": "interrupted"}, b, {"status": "complete"}) == [
        f"A {a}: run status interrupted: its figures may be partial"]


def test_compare_names_the_link_each_run_had(runs, tmp_path):
    a, b = runs
    gloo = write_run(tmp_path / "g", dict(META, device="cpu"),
                     [rows("reference", "dispatch", 0, (1.0, 1.0), (1.0, 1.0))])
    # CPU ranks (gloo) cross no link: their busbw is '-', in a folder written before that rule too
    for other, said in ((a, "busbw = bus bandwidth over A '-' (nothing crossed a link) / B NVLink, slowest-bandwidth "
                            "rank (GB/s)"),
                        (gloo, "busbw: '-', nothing crossed a link in either run")):
        con = Console(record=True, width=220, color_system=None)
        compare.print_compare(gloo, other, con)
        text = " ".join(con.export_text().split())
        assert said in text and "NVLink busbw" not in text and "gloo" not in text, text
    assert compare.load(gloo)[1]["busbw_nvlink_gbps"].isna().all()
    functional = dict(META, functional="4 ranks share each GPU")
    assert compare.links(functional, functional) == "busbw: '-', nothing crossed a link in either run"


@pytest.mark.parametrize("results", ["missing", "header"])
def test_compare_of_a_complete_run_without_its_results_is_an_error(runs, results):
    a, b = runs
    csv = b / "results.csv"
    if results == "missing":
        csv.unlink()
    else:
        csv.write_text(csv.read_text().splitlines()[0] + "\n")
    with pytest.raises(compare.UserError, match="results.csv: .*, though meta.json says the run completed"):
        compare.load(b)
    r = epbench_here("compare", a, b)
    assert_one_line_error(r, "results.csv", "though meta.json says the run completed")


# -- paths as text, unlike shapes, software, corrupt options, failed verification (compare audit) --

def _text(a, b, width=220):
    con = Console(record=True, width=width, color_system=None)
    both = compare.print_compare(a, b, con)
    return " ".join(con.export_text().split()), both


@pytest.mark.parametrize("name", ["x[/]y", "ü n[i]", "[bold]b"])
def test_compare_prints_paths_with_brackets_as_they_are(tmp_path, name):
    """A '[' in a folder name is text: rich markup there crashed ('[/]') or vanished ('[i]')."""
    a = write_run(tmp_path / "a", META, [rows("reference", "dispatch", 0, (800.0, 820.0), (250.0, 240.0))])
    b = write_run(tmp_path / name, META, [rows("reference", "dispatch", 0, (700.0, 720.0), (250.0, 240.0))])
    text, _ = _text(a, b, width=400)
    assert f"A = {a} vs B = {b}" in text
    r = epbench_here("compare", a, b)
    assert r.code == 0 and "Traceback" not in r.both, r.both


def _shaped(hidden=256, topk=4, **scenario):
    """META whose scenario records a model, mode and routing (as a run writes them)."""
    model = {"hidden": hidden, "tokens_per_rank": 64, "topk": topk, "experts_per_rank": 4,
             "dispatch_dtype": "bf16", "combine_dtype": "bf16", "quantize": "before", "layout": "rank_major", "align": 1}
    sc = dict({"name": "s", "model": model, "mode": "normal", "routing": {"kind": "uniform", "seed": 1},
               "bench": {"warmup": 2, "iters": 5}}, **scenario)
    return dict(META, scenario=sc)


def test_compare_names_each_shape_difference_and_divides_no_unlike_rows(tmp_path):
    a = write_run(tmp_path / "a", _shaped(), [rows("reference", "dispatch", 0, (800.0, 820.0), (250.0, 240.0))])
    b = write_run(tmp_path / "b", _shaped(hidden=512, topk=2, mode="low_latency"),
                  [rows("reference", "dispatch", 0, (700.0, 720.0), (250.0, 240.0))])
    text, both = _text(a, b)
    assert "warning: shape: hidden differs: A 256 vs B 512" in text
    assert "warning: shape: topk differs: A 4 vs B 2" in text
    assert "warning: shape: mode differs: A normal vs B low_latency" in text
    assert "no ratios: the runs measured different shapes (hidden, topk, mode)" in text
    assert both["time_us_ratio"].tolist() == [None] and both["withheld"].tolist() == ["unlike"]
    con = Console(record=True, width=220, color_system=None)
    compare.print_compare(a, b, con)
    line = next(ln for ln in con.export_text().splitlines() if "dispatch" in ln)
    assert line.count("unlike") == 2 and "0.878" not in line
    same = write_run(tmp_path / "c", _shaped(), [rows("reference", "dispatch", 0, (700.0, 720.0), (250.0, 240.0))])
    text, both = _text(a, same)
    assert "shape:" not in text and "no ratios" not in text
    assert both["time_us_ratio"].tolist() == [pytest.approx(720.0 / 820.0)]


def test_compare_warns_of_each_setting_and_software_difference(tmp_path):
    soft = dict(_shaped(), git_commit="abc", epbench="0.1.0", python="3.11.7", numpy="2.4.6", pandas="3.1.1",
                baselines={"deep_ep": "1.2.1"})
    a = write_run(tmp_path / "a", soft, [rows("reference", "dispatch", 0, (800.0, 820.0), (250.0, 240.0))])
    other = dict(soft, git_commit="def+dirty", epbench="0.2.0", python="3.12.1", numpy="2.0.0", pandas="2.2.0",
                 torch="2.12.0", baselines={"deep_ep": "1.2.2"}, options={"iters": 50, "warmup": 2})
    b = write_run(tmp_path / "b", other, [rows("reference", "dispatch", 0, (700.0, 720.0), (250.0, 240.0))])
    text, both = _text(a, b)
    for line in ("iters differs: A 5 vs B 50", "git_commit differs: A abc vs B def+dirty",
                 "epbench differs: A 0.1.0 vs B 0.2.0", "python differs: A 3.11.7 vs B 3.12.1",
                 "numpy differs: A 2.4.6 vs B 2.0.0", "pandas differs: A 3.1.1 vs B 2.2.0",
                 "torch differs: A 2.11.0+cu130 vs B 2.12.0", "baselines deep_ep differs: A 1.2.1 vs B 1.2.2"):
        assert f"warning: {line}" in text, line
    assert "warmup differs" not in text
    assert both["time_us_ratio"].tolist() == [pytest.approx(720.0 / 820.0)]  # the same work, timed otherwise


@pytest.mark.parametrize("cell", ["abc", "[1]", "{", "7"])
def test_compare_of_a_corrupt_options_cell_is_one_line(runs, cell):
    a, b = runs
    csv = b / "results.csv"
    df = pd.read_csv(csv)
    df["options"] = pd.Series([cell] * len(df), dtype=object)
    df.to_csv(csv, index=False)
    with pytest.raises(compare.UserError, match="options cell is not a JSON object"):
        compare.load(b)
    assert_one_line_error(epbench_here("compare", a, b), "results.csv", "options cell is not a JSON object")


def test_compare_of_corrupt_backend_options_in_meta_is_one_line(tmp_path, runs):
    a, _ = runs
    b = write_run(tmp_path / "bad", dict(META, scenario={"name": "s", "backend_options": {"reference": "x"}}),
                  [rows("reference", "dispatch", 0, (700.0, 720.0), (250.0, 240.0))])
    assert_one_line_error(epbench_here("compare", a, b), "meta.json", "backend_options.reference is not an object")


def test_compare_says_loudly_which_run_failed_verification_and_divides_none_of_it(runs, tmp_path):
    a, _ = runs
    b = write_run(tmp_path / "wrong", META, [
        rows("reference", "dispatch", 0, (820.0, 861.0), (245.0, 230.0)),
        rows("epbench", "dispatch", 8, (400.0, 416.0), (360.0, 348.0), wrong=2)])
    text, both = _text(a, b)
    assert (f"VERIFICATION FAILED: B {b}: 2 of 4 row(s) failed verification (wrong > 0): their figures time "
            f"a wrong result; no ratio for those points (WRONG)") in text
    assert "VERIFICATION FAILED: A" not in text
    by = {(r.backend, r.sms): r for r in both.itertuples()}
    assert by[("epbench", 8)].time_us_ratio is None and by[("epbench", 8)].withheld == "wrong"
    assert by[("reference", 0)].time_us_ratio == pytest.approx(861.0 / 820.0)
    con = Console(record=True, width=220, color_system=None)
    compare.print_compare(a, b, con)
    line = next(ln for ln in con.export_text().splitlines() if "epbench" in ln and " 8 " in ln)
    assert line.count("WRONG") == 2 and "0.800" not in line


def test_no_common_point_names_what_differs(tmp_path):
    def at(tokens, *times):
        return [dict(r, tokens_per_rank=tokens) for r in rows("reference", "dispatch", 0, times, (1.0, 1.0))]

    a = write_run(tmp_path / "a", META, [at(64, 800.0, 820.0)])
    b = write_run(tmp_path / "b", META, [at(t, 700.0, 720.0) for t in (8, 16, 128, 256)])
    text, _ = _text(a, b)
    assert "no point was measured in both runs (tokens per rank: A 64 vs B 8, 16, 128, 256): no ratios" in text
    assert "scenario, backend, op and SMs differ everywhere" not in text
    c = write_run(tmp_path / "c", META, [rows("epbench", "dispatch", 8, (1.0, 1.0), (1.0, 1.0))])
    text, _ = _text(a, c)
    assert "(backend: A reference vs B epbench; SMs: A auto vs B 8)" in text


def test_compare_plot_of_different_shapes_names_them_in_its_title(runs, tmp_path, monkeypatch):
    from epbench import plot

    a, _ = runs
    titles = []
    monkeypatch.setattr(plot, "_save", lambda fig, title, path, force=False, failed=0: titles.append(title) or path)
    wide = write_run(tmp_path / "w", dict(META, scenario={"name": "s", "model": {"hidden": 512}}),
                     [rows("epbench", "dispatch", 8, (500.0, 520.0), (300.0, 290.0))])
    narrow = write_run(tmp_path / "n", dict(META, scenario={"name": "s", "model": {"hidden": 256}}),
                       [rows("epbench", "dispatch", 8, (500.0, 520.0), (300.0, 290.0))])
    plot.compare_plot(a, a, tmp_path / "same.png")
    plot.compare_plot(narrow, wide, tmp_path / "unlike.png")
    assert "different shapes" not in titles[0] and titles[1].endswith("\ndifferent shapes: hidden"), titles
