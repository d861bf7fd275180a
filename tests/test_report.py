import pandas as pd
import pytest
from rich.console import Console

from epbench import report


def console() -> Console:
    return Console(record=True, width=200, color_system=None)


def rows(op="dispatch", times=(100.0, 200.0), algbw=(10.0, 20.0), wrong=(0, 0), sms=0,
         problem=""):
    return [{"scenario": "s", "backend": "reference", "op": op, "sms": sms, "rank": r, "world": 2,
             "time_us": t, "algbw_gbps": a, "busbw_nvlink_gbps": a * 0.75,
             "busbw_nic_gbps": None, "wrong": w, "problem": problem if w else ""}
            for r, (t, a, w) in enumerate(zip(times, algbw, wrong))]


META = {"scenario": {"name": "smoke"}, "world": 2, "device": "cpu", "status": "complete"}
# two GPUs over NVLink (nvidia-smi's matrix): bus bandwidths and link figures mean something
GPU_META = dict(META, device="cuda", topology="GPU0\tGPU1\nGPU0\t X \tNV18\n\nLegend: ...")


@pytest.mark.parametrize("value, text", [
    (327.4, "327"), (1234.5, "1234"), (41.23, "41.2"), (10.0, "10.0"), (9.876, "9.88"),
    (0.012345, "0.0123"), (None, "-"), (float("nan"), "-"), (-150.2, "-150"),
])
def test_number(value, text):
    from epbench.console import number

    assert number(value) == text


def table_lines(df, meta=META, columns=None):
    c = console()
    report.print_run(pd.DataFrame(df), meta, c, columns)
    return c.export_text()


def line_with(text, *needles):
    hits = [ln for ln in text.splitlines() if all(n in ln for n in needles)]
    assert hits, f"no line with {needles} in:\n{text}"
    return hits[0]


def test_table_shows_slowest_rank_time_and_spread():
    text = table_lines(rows(times=(100.0, 200.0), algbw=(10.0, 20.0)), GPU_META)
    assert "smoke on 2 ranks (cuda) - NVLink" in text
    for header in ("op", "backend", "SMs", "time us", "algbw", "busbw", "link %", "#wrong"):
        assert header in text
    line = line_with(text, "dispatch", "reference")
    assert "200" in line and "auto" in line  # time = the slowest rank's median; sms 0 = auto
    assert " 10.0 " in line and " 7.5 " in line  # the slowest-bandwidth rank by default
    assert "VERIFICATION FAILED" not in text
    wide = table_lines(rows(times=(100.0, 200.0), algbw=(10.0, 20.0)), GPU_META, columns=report.WIDE)
    for header in ("NVML busbw", "NIC busbw", "% ceil CE / SM", "slow rank"):
        assert header in wide
    line = line_with(wide, "dispatch", "reference")
    assert "10.0 / 15.0 / 20.0" in line  # algbw min / median / max over ranks
    assert "7.5 / 11.2 / 15.0" in line


def test_table_collapses_an_even_spread_and_shows_sms():
    text = table_lines(rows(algbw=(30.0, 30.5), sms=24), columns=report.WIDE)
    line = line_with(text, "dispatch")
    assert " 30.2 " in line and "/" not in line
    assert " 24 " in line


def test_one_row_per_op_and_point():
    text = table_lines(rows("dispatch") + rows("combine") + rows("dispatch", sms=8))
    data = [ln for ln in text.splitlines() if "reference" in ln]
    assert len(data) == 3


def test_wrong_rows_fail_verification_loudly():
    text = table_lines(rows("combine", wrong=(0, 3), problem="token 0: got 1234.0"))
    assert "VERIFICATION FAILED: 3 wrong rows" in text
    assert "combine" in line_with(text, "VERIFICATION FAILED") and "rank 1" in text
    assert "token 0: got 1234.0" in text
    assert line_with(text, "combine", "reference").rstrip(" │").endswith("3")


def test_notes_status_and_empty_runs():
    meta = dict(META, notes=["backend epbench skipped: needs CUDA GPUs"], status="failed: boom")
    text = table_lines([], meta)
    assert "no measured points" in text
    assert "note: backend epbench skipped: needs CUDA GPUs" in text
    assert "run status: failed: boom" in text
    assert "run status" not in table_lines(rows())


def test_results_table_rows_match_summary():
    t = report.results_table(pd.DataFrame(rows() + rows("combine")), "title")
    assert t.row_count == 2


def test_link_use_column_from_the_raw_counters():
    df = rows(times=(100.0, 100.0))
    df[0]["nvlink_link_use_pct"], df[1]["nvlink_link_use_pct"] = 91.0, 93.0
    text = table_lines(df, GPU_META, columns=report.WIDE)
    assert "link %" in text
    assert "92.0" in line_with(text, "dispatch", "reference")  # collapsed: min/max within 5%
    # no raw counter read (CPU runs): a dash, never 0
    text = table_lines(rows())
    assert " - " in line_with(text, "dispatch", "reference")


def test_functional_run_prints_dashes_for_link_figures():
    df = [dict(r, busbw_nvlink_gbps=None, functional="4 ranks share each GPU") for r in rows()]
    meta = dict(META, device="cuda", functional="4 ranks share each GPU",
                notes=["functional run (4 ranks share each GPU): ... not given"])
    text = table_lines(df, meta)
    assert "(cuda) - shared GPU - functional, no link figures" in text
    line = line_with(text, "dispatch", "reference")
    cells = [c.strip() for c in line.split("│") if c.strip()]
    # op, backend, SMs, time, algbw, then busbw and link %: "-"
    assert cells[5:7] == ["-"] * 2, cells
    text = table_lines(df, meta, report.WIDE)
    cells = [c.strip() for c in line_with(text, "dispatch", "reference").split("│") if c.strip()]
    # op, backend, kernel ("-": no record), SMs, time, algbw, then busbw, NVML, link %, NIC busbw, % ceil: all "-"
    assert cells[2] == "-" and cells[6:11] == ["-"] * 5, cells
    assert "note: functional run" in text


def gpu_rows(backend, op, sms, world=8, tokens=4096):
    """A multi-rank NVLink run's rows as the driver writes them, counters and ceilings included."""
    return [{"scenario": "h100x8", "backend": backend, "op": op, "sms": sms, "rank": r,
             "world": world, "tokens_per_rank": tokens, "time_us": 1234.5 + 17.0 * r,
             "algbw_gbps": 321.4 + r, "busbw_nvlink_gbps": 281.2 + r,
             "busbw_nvlink_measured_gbps": 290.7 + r, "nvlink_counter_mismatch": False,
             "nvlink_link_use_pct": 71.25 + r, "busbw_nic_gbps": None,
             "ceiling_copy_engine_us": 900.0, "ceiling_sm_store_us": 1000.0 if sms else None,
             "wrong": 0, "problem": ""} for r in range(world)]


def test_default_table_fits_100_columns_without_cutting_anything():
    df = [r for b in ("reference", "epbench", "deepep_v2", "epbench_hier") for op in ("dispatch", "combine")
          for sms in ((0,) if b == "reference" else (8, 24, 132)) for r in gpu_rows(b, op, sms)]
    meta = dict(META, scenario={"name": "h100x8"}, world=8, device="cuda",
                topology="GPU0\tGPU1\nGPU0\t X \tNV18\n\nLegend: ...")
    c = Console(record=True, width=100, color_system=None)
    report.print_run(pd.DataFrame(df), meta, c)
    text = c.export_text()
    assert "h100x8 on 8 ranks (cuda) - NVLink" in text
    header = line_with(text, "op", "backend", "SMs")
    for h in ("op", "backend", "SMs", "time us", "algbw", "busbw", "link %", "#wrong"):
        assert f" {h} " in header, header  # whole, not folded or cut with an ellipsis
    assert "…" not in text
    assert max(len(ln) for ln in text.splitlines()) <= 100
    line = line_with(text, "combine", "epbench_hier", " 132 ")
    cells = [x.strip() for x in line.split("│") if x.strip()]
    # time = slowest rank (rank 7), bandwidths of the slowest-bandwidth rank, busiest link %
    assert cells == ["combine", "epbench_hier", "132", "1354", "321", "281", "78.2", "0"], cells


def test_columns_option_picks_and_rejects():
    assert report.parse_columns("op,busbw") == ("op", "busbw")
    assert report.parse_columns(None, wide=True) == report.WIDE
    assert report.parse_columns(None) is None
    with pytest.raises(report.UserError, match="unknown column nope"):
        report.parse_columns("op,nope")
    text = table_lines(rows(), GPU_META, columns=("backend", "busbw"))
    assert "time us" not in text and " 7.5 " in line_with(text, "reference")


def test_the_run_table_shows_the_columns_the_plan_carries(tmp_path):
    """run / sweep's --wide / --columns travel in the plan to whoever prints the table."""
    from epbench.results import RunWriter
    from epbench.session import show_run

    d = tmp_path / "run"
    RunWriter(d, META).add(rows(), [])
    c = console()
    show_run(d, c, ("op", "time"))
    header = line_with(c.export_text(), "op", "time us")
    assert "algbw" not in header


def test_a_run_with_a_nic_tier_shows_its_busbw_by_default():
    df = [dict(r, busbw_nic_gbps=5.0, nic_virtual=True) for r in rows()]
    c = Console(record=True, width=100, color_system=None)
    report.print_run(pd.DataFrame(df), GPU_META, c)
    header = line_with(c.export_text(), "op", "backend")
    assert " NIC busbw (virtual) " in header and " link % " in header


def test_low_latency_runs_name_the_floor_per_backend_and_op():
    """The fewest tokens' p50 (slowest rank), at the best SM count and timing: the fixed cost."""
    import pandas as pd

    from epbench.report import floor_notes

    rows = []
    for sms, timing, t1, t128 in ((32, "graph", 13.9, 20.7), (32, "launch", 15.0, 22.0), (132, "graph", 14.7, 22.3)):
        for rank, extra in ((0, 0.0), (1, 0.5)):
            rows += [dict(mode="low_latency", backend="epbench-ll", op="dispatch", sms=sms, timing=timing,
                          rank=rank, tokens_per_rank=1, time_us=t1 + extra),
                     dict(mode="low_latency", backend="epbench-ll", op="dispatch", sms=sms, timing=timing,
                          rank=rank, tokens_per_rank=128, time_us=t128 + extra)]
    notes = floor_notes(pd.DataFrame(rows))
    assert notes == ["floor: epbench-ll dispatch 14.4 us at 1 token(s) per rank (32 SMs, graph)"]
    assert floor_notes(pd.DataFrame([dict(backend="epbench", op="dispatch", sms=8, time_us=1.0)])) == []


def _ll_rows(points):
    """Low-latency rows of epbench-ll dispatch at 1 and 128 tokens, 2 ranks (rank 1 0.5 us slower):
    points = (sms, timing, chain, time at 1 token, time at 128)."""
    rows = []
    for sms, timing, chain, t1, t128 in points:
        for rank, extra in ((0, 0.0), (1, 0.5)):
            for tokens, t in ((1, t1), (128, t128)):
                rows.append(dict(mode="low_latency", scenario="x", backend="epbench-ll", op="dispatch",
                                 sms=sms, timing=timing, chain=chain, rank=rank, world=2, wrong=0,
                                 problem="", tokens_per_rank=tokens, time_us=t + extra,
                                 time_us_p99=t + extra + 1.0))
    return rows


def test_low_latency_runs_with_ceilings_name_the_bound_per_backend_and_op():
    """The best standalone figure at the scenario's own batch against plain SM stores of its rows at
    that SM count; rows without ceilings (other batch sizes) and chain rows do not count."""
    import pandas as pd

    from epbench.report import bound_notes

    rows = _ll_rows([(64, "graph", 1, 7.9, 23.0), (132, "graph", 1, 7.5, 21.1), (132, "chain", 8, 2.9, 8.0)])
    for r in rows:  # ceilings measured for the 128-token batch only (the scenario's own)
        r["ceiling_sm_store_us"] = {64: 13.2, 132: 13.1}[r["sms"]] if r["tokens_per_rank"] == 128 else None
    assert bound_notes(pd.DataFrame(rows)) == [
        "bound: epbench-ll dispatch 21.6 us at 128 token(s) per rank (132 SMs, graph) against 13.1 us for plain "
        "SM stores of its routed rows into the peers, timed the same way: 1.65x"]
    assert bound_notes(pd.DataFrame([dict(r, ceiling_sm_store_us=None) for r in rows])) == []
    assert bound_notes(pd.DataFrame([dict(backend="epbench", op="dispatch", sms=8, time_us=1.0)])) == []


def test_the_floor_names_the_standalone_and_the_in_graph_figure():
    import pandas as pd

    from epbench.report import floor_notes

    rows = _ll_rows([(32, "graph", 1, 7.4, 13.6), (32, "launch", 1, 8.0, 14.0), (32, "chain", 8, 3.1, 9.9),
                     (132, "graph", 1, 7.9, 12.0), (132, "chain", 8, 2.9, 8.0)])
    assert floor_notes(pd.DataFrame(rows)) == [
        "floor: epbench-ll dispatch 7.9 us at 1 token(s) per rank (32 SMs, graph); "
        "in-graph 3.4 us (132 SMs, graph x8: per call of a chain in one graph)"]
    # the chain rows never stand for the standalone figure, however fast they are
    no_chain = [r for r in rows if r["timing"] != "chain"]
    assert floor_notes(pd.DataFrame(no_chain)) == [
        "floor: epbench-ll dispatch 7.9 us at 1 token(s) per rank (32 SMs, graph)"]


def test_chain_rows_are_labelled_graph_x_k_and_the_caption_says_what_their_p99_is():
    import pandas as pd

    from epbench.report import results_table, timing_label

    table = results_table(pd.DataFrame(_ll_rows([(32, "graph", 1, 7.4, 13.6), (32, "chain", 8, 3.1, 9.9)])))
    headers = [c.header for c in table.columns]
    assert table.columns[headers.index("timing")]._cells == ["graph", "graph", "graph x8", "graph x8"]
    caption = " ".join(table.caption.split())
    assert "'graph xK' (in-graph: per call of K chained in one graph" in caption
    assert "its p99 is that of per-replay averages" in caption
    assert timing_label("chain", None) == "graph xK" and timing_label("launch", 1) == "launch"


def test_wrong_rows_say_where_in_one_line():
    df = pd.DataFrame(rows("combine", wrong=(0, 3), problem="token 0: got 1234.0", sms=8)
                      + rows("dispatch", wrong=(1, 0), problem="row 2 missing"))
    assert report.wrong_rows(df) == ("4 wrong rows (reference combine at 8 SMs: 3; reference dispatch "
                                     "at auto SMs: 1; first: rank 1: token 0: got 1234.0)")
    assert report.wrong_rows(pd.DataFrame(rows())) is None and report.wrong_rows(pd.DataFrame()) is None
    many = pd.DataFrame([r for n in (2, 4, 6, 8) for r in rows(wrong=(1, 1), sms=n, problem="x")])
    assert "8 wrong rows" in report.wrong_rows(many) and "1 more point(s)" in report.wrong_rows(many)


def test_the_launcher_says_verification_failed_and_where(tmp_path):
    """Not "rank 0 exited with code 1": the failing backend, op and SM count, the count and the folder."""
    from epbench.results import RunWriter
    from epbench.launcher import verification_failure

    d = tmp_path / "run"
    w = RunWriter(d, META)
    w.add(rows("dispatch", wrong=(2, 0), problem="rows from rank 0: payload differs"), [])
    out = verification_failure(d)
    assert out.status == "failed" and out.code == 1
    assert out.line == (f"verification failed: 2 wrong rows (reference dispatch at auto SMs: 2; first: "
                        f"rank 0: rows from rank 0: payload differs); results: {d}")
    clean = tmp_path / "clean"
    RunWriter(clean, META).add(rows(), [])
    assert verification_failure(clean) is None


def test_control_characters_from_a_results_folder_never_reach_the_terminal():
    """A hand-edited meta.json or results.csv: no escape sequence, bell or bidi override is printed."""
    from epbench.console import SafeConsole, printable

    assert printable("a\x1b]0;title\x07b\x1b[2Jc\u202ed\x9be\tf\ng") == "a]0;titleb[2Jcde\tf\ng"
    meta = dict(META, scenario={"name": "evil\x1b[2J"}, notes=["note \x1b]0;pwned\x07"], status="odd\x07")
    c = SafeConsole(record=True, width=200, color_system=None)
    df = pd.DataFrame(rows(wrong=(1, 0), problem="bad \x1b[31mrow"))
    df["backend"] = "ref\x1b[5m"
    report.print_run(df, meta, c)
    text = c.export_text()
    assert "evil[2J on 2 ranks" in text and "note ]0;pwned" in text and "ref[5m" in text
    assert not any(ch in text for ch in "\x1b\x07\x9b\u202e"), repr(text)


@pytest.mark.parametrize("width", [100, 80, 60])
def test_wide_table_never_cuts_a_number(width):
    """--wide on a narrow terminal: spreads wrap at their spaces, columns that cannot fit are left
    out and named; no number is cut or ellipsised."""
    spread = [dict(r, algbw_gbps=0.00801 + 0.003 * r["rank"], busbw_nvlink_gbps=0.00588 + 0.003 * r["rank"])
              for r in gpu_rows("reference", "dispatch", 0, world=4) + gpu_rows("epbench", "combine", 24, world=4)]
    c = Console(record=True, width=width, color_system=None)
    report.print_run(pd.DataFrame(spread), dict(META, device="cuda", world=4), c, report.WIDE)
    text = c.export_text()
    assert "…" not in text and max(len(ln) for ln in text.splitlines()) <= width
    table = text.split(" time = ")[0]
    words = set(table.replace("│", " ").split())
    assert {"0.00588", "0.0104", "0.0149", "1286"} <= words, table  # busbw min / median / max, whole
    if width >= 80:
        assert {"0.00801", "0.0125", "0.017"} <= words, table  # algbw too
    caption = " ".join(text.split())
    assert ("Left out to fit" in caption) == (width < 110), caption


def test_kernel_column_where_a_backends_kernel_varies_over_the_run():
    """An option left at auto (epbench's pull_kernel) may run another kernel at another SM count: the table then
    names each row's kernel (the rows' impl, the library's record), and says what the column means; a run whose
    kernels stay the same keeps the default columns, and --wide always shows it."""
    def impl_rows(op, sms, impl):
        return [dict(r, backend="epbench", impl=impl) for r in rows(op, sms=sms)]

    varied = (impl_rows("dispatch", 4, "lean_dyn") + impl_rows("combine", 4, "bulk")
              + impl_rows("dispatch", 8, "lean_dyn") + impl_rows("combine", 8, "tma"))
    text = table_lines(varied)
    assert "kernel" in text and "kernel: the kernel that ran" in text
    assert "bulk" in line_with(text, "combine", " 4 ") and "tma" in line_with(text, "combine", " 8 ")
    assert "lean_dyn" in line_with(text, "dispatch", " 8 ")
    same = impl_rows("dispatch", 4, "lean_dyn") + impl_rows("combine", 4, "tma") + impl_rows("combine", 8, "tma")
    assert "kernel" not in table_lines(same)
    assert "tma" in line_with(table_lines(same, columns=report.WIDE), "combine", " 8 ")
    mixed = [dict(r, impl="tma" if r["rank"] else "bulk") for r in impl_rows("combine", 4, None)]
    assert "bulk/tma" in line_with(table_lines(mixed, columns=report.WIDE), "combine")  # ranks that differed
    cells = [c.strip() for c in line_with(table_lines(rows(), columns=report.WIDE), "dispatch").split("│") if c.strip()]
    assert cells[1:3] == ["reference", "-"], cells  # no record: the kernel cell is a dash


# -- the columns that tell rows apart; failed and emptied runs; labels (new-user audit) --

def modes_rows(tokens=64):
    """One point timed both ways of calling it and with both input choices: four rows per op."""
    return [dict(r, call_mode=mode, input_sets=sets, tokens_per_rank=tokens)
            for mode in ("call", "kernel") for sets in (1, 4) for r in rows()]


def header_cells(text):
    return [c.strip() for c in line_with(text, "┃", "time us" if "time us" in text else "rank").split("┃") if c.strip()]


@pytest.mark.parametrize("columns", [None, report.WIDE, ("op", "time"), ("time", "busbw")])
def test_every_table_keeps_the_columns_that_tell_its_rows_apart(columns):
    """--wide and --columns too: four dispatch rows are never four identical-looking lines."""
    text = table_lines(modes_rows(), columns=columns)
    heads = header_cells(text)
    assert {"call", "inputs"} <= set(heads), heads
    lines = [ln for ln in text.splitlines() if "kernel" in ln and ("same" in ln or "rot 4" in ln)]
    assert len(lines) == 2 and len(set(lines)) == 2, text
    assert ("op" in heads) == (columns != ("time", "busbw"))  # op does not vary here: not added
    assert "tokens" not in heads and ("backend" in heads) == (columns in (None, report.WIDE))


def test_a_table_that_cannot_fit_keeps_the_columns_that_tell_rows_apart():
    """--wide on an 80-column terminal leaves out the figures it cannot fit, never call or inputs."""
    c = Console(record=True, width=80, color_system=None)
    report.print_run(pd.DataFrame(modes_rows()), META, c, report.WIDE)
    text = c.export_text()
    heads = header_cells(text)
    assert "inputs" in heads and "call" in heads, heads
    assert "Left out to fit 80 columns" in " ".join(text.split())


def test_the_caption_ends_each_sentence_before_the_next():
    caption = " ".join(table_lines(modes_rows()).split())
    assert "full data: results.csv. inputs: 'rot N'" in caption, caption
    assert "L2). call: 'call' = as a model's" in caption, caption
    wide = " ".join(table_lines(rows(), columns=report.WIDE).split())
    assert "results.csv. kernel: the kernel" in wide and "docs/backends.md). NVML busbw:" in wide, wide


def test_the_per_rank_table_keeps_the_columns_that_tell_its_rows_apart_and_names_the_link():
    swept = [dict(r, tokens_per_rank=t, device="cpu") for t in (1, 8) for r in modes_rows()]
    c = console()
    report.print_per_rank(pd.DataFrame(swept), c, META)
    text = c.export_text()
    heads = header_cells(text)
    assert heads[:6] == ["tokens", "op", "backend", "SMs", "call", "inputs"], heads
    assert "NVLink busbw" not in text and "NIC busbw" not in text  # one tier, and not NVLink
    assert "busbw: '-', nothing crossed a link" in " ".join(text.split())  # CPU ranks: no busbw claim
    assert len([ln for ln in text.splitlines() if "dispatch" in ln and " 8 " in ln and "rot 4" in ln]) == 4
    c = console()  # no meta.json at hand: the rows say they ran on CPUs
    report.print_per_rank(pd.DataFrame(swept), c)
    assert "nothing crossed a link" in " ".join(c.export_text().split())
    c = console()  # nothing crossed a link: no transport named
    report.print_per_rank(pd.DataFrame(rows()), c, dict(META, device="cuda", functional="4 ranks share each GPU"))
    caption = " ".join(c.export_text().split())
    assert "nothing crossed a link" in caption and "bus bandwidth over" not in caption


def failed_run(tmp_path, measured, status="failed", error="test-abort: rank 1 was killed by SIGABRT", **options):
    """A run folder as the launcher leaves it: ``measured`` rows, the lost points' failed rows, the final status."""
    from epbench.results import RunWriter, finish_run, unmeasured_rows

    d = tmp_path / "run"
    w = RunWriter(d, META)
    w.add(measured, [])
    if status == "failed":
        w.add(unmeasured_rows("s", "test-abort", [(0, 4), (0, 8)], f"failed: {error.split(': ', 1)[1]}"), [])
    finish_run(d, status, error if status == "failed" else None, options=options)
    return d


def report_text(d, columns=None):
    from epbench.results import load_run

    meta, df = load_run(d)
    c = console()
    report.print_run(df, meta, c, columns, run_dir=d)
    return c.export_text()


def test_a_failed_run_says_why_and_keeps_its_tokens_column(tmp_path):
    """Only the 8-token points were measured of a --tokens 4,8 run: its table still says 8 tokens;
    the status line carries meta.json's error, and each lost backend's rows their reason."""
    d = failed_run(tmp_path, [dict(r, tokens_per_rank=8) for r in rows()], tokens=[4, 8])
    text = report_text(d)
    assert header_cells(text)[0] == "tokens"
    assert line_with(text, "dispatch", "reference").lstrip("│ ").startswith("8 ")
    assert "run status: failed (test-abort: rank 1 was killed by SIGABRT)" in text
    assert "test-abort: failed: rank 1 was killed by SIGABRT (2 points not measured)" in text


def test_a_failed_verification_is_said_once_with_the_status(tmp_path):
    d = failed_run(tmp_path, [dict(r, tokens_per_rank=4) for r in rows(wrong=(2, 0), problem="payload differs")],
                   error="verification failed: 2 wrong rows")
    text = report_text(d)
    assert "VERIFICATION FAILED: 2 wrong rows" in text
    assert "run status: failed (verification failed, above)" in text


@pytest.mark.parametrize("results", ["missing", "empty", "header"])
def test_a_complete_run_without_its_results_file_is_an_error_not_an_empty_table(tmp_path, results):
    d = failed_run(tmp_path, rows(), status="complete")
    csv = d / "results.csv"
    if results == "missing":
        csv.unlink()
    else:
        csv.write_text("" if results == "empty" else csv.read_text().splitlines()[0] + "\n")
    said = {"missing": "missing", "empty": "empty", "header": "a header and no rows"}[results]
    with pytest.raises(report.UserError, match=f"results.csv: {said}, though meta.json says the run completed"):
        report_text(d)
    # a run whose every point was skipped is not that: its rows say why
    from epbench.results import RunWriter, unmeasured_rows

    skipped = tmp_path / "skipped"
    w = RunWriter(skipped, META)
    w.add(unmeasured_rows("s", "epbench", [(4, 64)], "skipped: needs CUDA GPUs"), [])
    w.finish("complete")
    text = report_text(skipped)
    assert "no measured points" in text and "epbench: skipped: needs CUDA GPUs (1 point not measured)" in text


def test_the_floor_says_auto_where_the_backend_chose_its_sms():
    from epbench.report import floor_notes

    ll = [dict(r, backend="reference", sms=0) for r in _ll_rows([(0, "launch", 1, 509.0, 941.0)])]
    assert floor_notes(pd.DataFrame(ll)) == [
        "floor: reference dispatch 510 us at 1 token(s) per rank (auto SMs, launch)"]


def test_unmeasured_points_are_counted_once_whatever_rows_they_left(tmp_path):
    """A lost point leaves a row per op: one point per SM count, token count and way of timing it (call
    mode), as the launcher's closing line counts them."""
    from epbench.results import RunWriter

    lost = [{"scenario": "s", "backend": "epbench", "op": op, "sms": sms, "rank": None, "tokens_per_rank": 64,
             "call_mode": mode, "time_us": None, "status": "failed: rank 1 was killed by SIGKILL"}
            for sms in (4, 8) for mode in ("call", "kernel") for op in ("dispatch", "combine")]
    w = RunWriter(tmp_path / "run", META)
    w.add(rows() + lost, [])
    assert report.unmeasured_lines(tmp_path / "run") == [
        "[bold red]epbench: failed: rank 1 was killed by SIGKILL (4 points not measured)[/]"]


def test_the_link_caption_only_where_the_link_column_has_a_figure():
    """'link % = ... NVLink traffic' explains a column: said where some row has a link figure, not on a run
    whose link column is all '-' (gloo CPU ranks, no NVML counter)."""
    with_link = rows(times=(100.0, 100.0))
    with_link[0]["nvlink_link_use_pct"], with_link[1]["nvlink_link_use_pct"] = 91.0, 93.0
    said = " ".join(table_lines(with_link, GPU_META, columns=report.WIDE).split())
    assert "link % = the busiest rank's NVLink traffic" in said, said
    plain = rows()
    for r in plain:
        r["nvlink_link_use_pct"] = None
    said = " ".join(table_lines(plain, columns=report.WIDE).split())
    assert "link %" in said and "link % = the busiest rank's NVLink traffic" not in said, said


@pytest.mark.parametrize("verb", ["overlap", "probe"])
def test_a_failed_overlap_or_probe_run_says_its_status_and_lost_points_once(tmp_path, verb):
    """Their own printers give the table and notes; the status line and the lost points come once, after."""
    from epbench.results import RunWriter, finish_run, unmeasured_rows

    d = tmp_path / "run"
    measured = ([{"backend": "reference", "sms": 0, "rank": 0, "wrong": 0, "gemm_kept_pct": 90.0}] if verb == "overlap"
                else [{"sms": 32, "op": "dispatch", "tokens": 1, "variant": "default", "wrong": 0, "call_p50": 4.5}])
    w = RunWriter(d, {"verb": verb, "world": 2, "scenario": {"name": "s"}, "probe": {}})
    w.add(measured, [])
    w.note(["a note"])
    w.add(unmeasured_rows("s", "deepep", [(8, 4)], "timeout: no progress for 600 s"), [])
    finish_run(d, "timeout", "no progress for 600 s")
    text = report_text(d)
    said = ["note: a note", "run status: timeout (no progress for 600 s)",
            "deepep: timeout: no progress for 600 s (1 point not measured)"]
    assert [text.count(s) for s in said] == [1, 1, 1], text
    assert text.index(said[0]) < text.index(said[1]) < text.index(said[2])


def test_points_lost_to_a_timeout_are_red_like_failed_ones(tmp_path):
    from epbench.results import RunWriter, unmeasured_rows

    w = RunWriter(tmp_path / "run", META)
    w.add(unmeasured_rows("s", "a", [(0, 4)], "timeout: no progress") +
          unmeasured_rows("s", "b", [(0, 4)], "skipped: needs CUDA GPUs"), [])
    assert report.unmeasured_lines(tmp_path / "run") == [
        "[bold red]a: timeout: no progress (1 point not measured)[/]", "b: skipped: needs CUDA GPUs (1 point not measured)"]


# -- auditors' defects: figures that mean nothing, column choices, huge values --------------------

def test_cpu_ranks_show_no_bus_bandwidth_and_claim_no_transport_for_it():
    """gloo moves CPU ranks' rows through host memory: busbw is '-' (an old folder's figures too) and the
    caption says nothing crossed a link; algbw (bytes received / time) stays."""
    text = table_lines(rows())  # META: device cpu; the rows hold busbw figures, as folders from before did
    cells = [c.strip() for c in line_with(text, "dispatch", "reference").split("│") if c.strip()]
    assert cells[4:6] == ["10.0", "-"], cells  # algbw, busbw
    caption = " ".join(text.split())
    assert "busbw: '-', nothing crossed a link" in caption and "busbw = bus bandwidth" not in caption
    wide = table_lines(rows(), columns=report.WIDE)
    assert " 7.5 " not in wide and "0.75" not in wide
    gpu = " ".join(table_lines(rows(), GPU_META).split())
    assert " 7.5 " in gpu and "busbw = bus bandwidth over the transport in the title" in gpu


def test_the_transport_is_never_a_guess():
    assert report.transport({"device": "cuda"}) == "link not recorded"
    assert report.transport({}) == "link not recorded"
    assert report.transport(GPU_META) == "NVLink" and report.transport(META) == "gloo (CPU)"
    assert report.transport(dict(GPU_META, topology="GPU0\tGPU1\nGPU0\t X \tSYS\n")) == "PCIe"


def test_the_floor_is_one_ways_figure_and_names_its_inputs():
    """A row per input choice, as the table shows them: the floor is the best one's figure (the slowest
    rank's), never the max over the choices, and says which; a run of one choice does not name it."""
    ll = [dict(r, input_sets=sets, time_us=r["time_us"] + (0.2 if sets == 1 else 0.0))
          for sets in (1, 4) for r in _ll_rows([(132, "graph", 1, 10.5, 20.0)])]
    assert report.floor_notes(pd.DataFrame(ll)) == [
        "floor: epbench-ll dispatch 11.0 us at 1 token(s) per rank (132 SMs, graph, inputs rot 4)"]
    rot = [r for r in ll if r["input_sets"] == 4]
    assert report.floor_notes(pd.DataFrame(rot)) == [
        "floor: epbench-ll dispatch 11.0 us at 1 token(s) per rank (132 SMs, graph)"]
    for r in ll:
        r["ceiling_sm_store_us"] = 10.0
    assert "(132 SMs, graph, inputs rot 4) against 10.0 us" in report.bound_notes(pd.DataFrame(ll))[0]


def test_column_choices_that_would_mislead_are_refused_or_said():
    with pytest.raises(report.UserError, match="--columns: time given twice"):
        report.parse_columns("time,op,time")
    with pytest.raises(report.UserError, match="--wide and --columns: give one"):
        report.parse_columns("op,time", wide=True)
    text = table_lines(rows(), columns=("op", "time", "p99"))
    assert "p99" not in header_cells(text)
    assert "note: --columns p99: low-latency rows only; this run has none, so it is not shown" in text
    ll = pd.DataFrame(_ll_rows([(32, "graph", 1, 7.4, 13.6)]))
    c = console()
    report.print_run(ll, META, c, ("op", "time", "p99"))
    assert "p99 us" in c.export_text() and "low-latency rows only" not in c.export_text()


def test_a_huge_figure_takes_an_exponent_not_the_table():
    from epbench.console import number

    assert number(1e308) == "1e+308" and number(-2.5e9) == "-2.5e+09" and number(12345678.0) == "12345678"
    text = table_lines([dict(r, time_us=1e308) for r in rows()])
    assert "1e+308" in line_with(text, "dispatch", "reference") and max(map(len, text.splitlines())) < 200


def test_a_run_without_a_tokens_column_shows_a_dash_where_tokens_are_asked_for():
    text = table_lines(rows(), columns=("tokens", "time"))
    assert line_with(text, "200").strip("│ ").startswith("-")
