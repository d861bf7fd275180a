"""epbench overlap without a GPU: the arithmetic of kept % and exposed time, the option parsing,
the table, the plot and report of a results folder, and the one-line refusal on a CPU machine."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pandas as pd
import pytest
from rich.console import Console

from epbench import overlap as ov
from epbench.errors import UserError
from epbench.metrics import summarize_overlap
from epbench.plot import plot_run
from epbench.report import print_overlap
from support import SCENARIOS, epbench_here


def test_kept_pct_is_alone_over_beside():
    assert ov.kept_pct(100.0, 125.0) == pytest.approx(80.0)
    assert ov.kept_pct(100.0, 100.0) == pytest.approx(100.0)
    assert ov.kept_pct(None, 5.0) is None and ov.kept_pct(5.0, 0.0) is None


def test_pair_figures_sum_max_and_exposed():
    p = ov.pair_figures(gemm_total_us=1000.0, comm_total_us=400.0, pair_us=1100.0)
    assert p["sum_us"] == 1400.0 and p["max_us"] == 1000.0
    assert p["exposed_us"] == pytest.approx(100.0)  # the GEMMs finished 100 us later
    assert p["hidden_pct"] == pytest.approx(75.0)  # 300 of the 400 us were hidden
    assert ov.pair_figures(1000.0, 400.0, 1400.0)["hidden_pct"] == pytest.approx(0.0)
    assert ov.pair_figures(1000.0, 0.0, 1000.0)["hidden_pct"] is None


def test_kept_in_calls_takes_out_the_gaps_between_calls():
    # alone 100 us, confined 110 us; busy half the loop at a rate that keeps 50 %:
    # per-GEMM time over the loop = 1 / (0.5 / 200 + 0.5 / 110)
    beside = 1.0 / (0.5 / 200.0 + 0.5 / 110.0)
    assert ov.kept_in_calls_pct(100.0, 110.0, beside, 50.0) == pytest.approx(50.0)
    assert ov.kept_in_calls_pct(100.0, 110.0, 110.0, 100.0) == pytest.approx(100 * 100 / 110)
    assert ov.kept_in_calls_pct(100.0, 110.0, beside, None) is None
    assert ov.kept_in_calls_pct(100.0, 110.0, 300.0, 50.0) is None  # slower than the gaps allow


def test_spans_inside_a_window_and_loop_sizing():
    spans = [(0.0, 10.0), (10.0, 20.0), (20.0, 30.0), (30.0, 40.0)]
    assert ov.inside(spans, 5.0, 35.0) == [(10.0, 20.0), (20.0, 30.0)]
    assert ov.gemm_loop_count(1000.0, 100.0) == 17  # 1.5 x 1000 / 100 + 2
    assert ov.gemm_loop_count(1.0, 100.0) == 3
    with pytest.raises(ValueError):
        ov.gemm_loop_count(10.0, 0.0)
    assert ov.busy_pct([50.0, 50.0], 4, 400.0) == pytest.approx(50.0)


def test_window_gemm_beside_and_coverage():
    w = ov.Window(gemm_spans=[(0, 10), (10, 30), (30, 50), (50, 60)], comm_start=5.0, comm_end=55.0,
                  comm_samples={})
    beside, covered = w.gemm_beside_us()
    assert beside == pytest.approx(20.0) and covered  # the two GEMMs wholly inside the loop
    assert w.pair_us == 60
    short = ov.Window(gemm_spans=[(0, 10)], comm_start=2.0, comm_end=30.0, comm_samples={})
    assert short.gemm_beside_us() == (10, False)


def test_parse_gemm_and_sm_counts():
    assert ov.parse_gemm(None) == ov.GemmSpec("square", 8192, 8192, 8192)
    assert ov.parse_gemm("64,128,256") == ov.GemmSpec("square", 64, 128, 256)
    assert ov.parse_gemm("experts") == ov.GemmSpec("experts", intermediate=2048)
    assert ov.parse_gemm("experts:4096").intermediate == 4096
    for bad in ("1,2", "a,b,c", "0,1,1", "experts:x"):
        with pytest.raises(UserError):
            ov.parse_gemm(bad)
    ov.check_sms([4, 8], 132)
    with pytest.raises(UserError, match="leaves the GEMM 0 of 132"):
        ov.check_sms([132], 132)


def _rows():
    """Two ranks at two SM counts and a copy row, built by point_row from raw times."""
    rows = []
    for sms, disp in ((8, 250.0), (16, 150.0)):
        for rank in (0, 1):
            gemm = {"gemm_all_us": 1400.0, "gemm_confined_us": 1500.0,
                    "gemm_beside_us": 1800.0 + 100 * rank, "gemm_count": 10, "pair_us": 15000.0,
                    "comm_busy_pct": 60.0, "gemm_sms": 132 - sms}
            alone = {"dispatch": 180.0, "combine": 290.0, "loop": 20000.0}
            beside = {"dispatch": disp, "combine": 400.0, "loop": 26000.0}
            row = ov.point_row({"backend": "epbench", "sms": sms, "rank": rank}, gemm, alone, beside)
            rows.append(dict(row, wrong=0, gemm_wrong=0))
    gemm = {"gemm_all_us": 1400.0, "gemm_confined_us": 1500.0, "gemm_beside_us": 1750.0,
            "gemm_count": 10, "pair_us": 14500.0, "gemm_sms": 124}
    rows.append(dict(ov.point_row({"backend": "copy", "sms": 8, "rank": 0}, gemm,
                                  {"copy": 100.0, "loop": 9000.0}, {"copy": 150.0, "loop": 9500.0}),
                     wrong=0, gemm_wrong=0))
    return rows


def test_point_row_figures():
    r = _rows()[0]
    assert r["dispatch_kept_pct"] == pytest.approx(72.0)  # 180 / 250
    assert r["comm_kept_pct"] == pytest.approx(100 * 470 / 650)
    assert r["gemm_kept_pct"] == pytest.approx(100 * 1400 / 1800)
    assert r["gemm_kept_of_confined_pct"] == pytest.approx(100 * 1500 / 1800)
    assert r["sum_us"] == 34000.0 and r["max_us"] == 20000.0 and r["exposed_us"] == 1000.0


def test_table_takes_the_worst_rank_and_fits_100_columns():
    df = pd.DataFrame(_rows())
    s = summarize_overlap(df)
    ep8 = s[(s["backend"] == "epbench") & (s["sms"] == 8)].iloc[0]
    assert ep8["gemm_kept_pct"] == pytest.approx(100 * 1400 / 1900)  # rank 1, the slower
    console = Console(width=100, record=True)
    meta = {"scenario": {"name": "t"}, "world": 2, "overlap": {"gemm": "bf16 8192x8192x8192",
                                                                "total_sms": 132},
            "notes": [ov.SHARED_GPU_NOTE]}
    print_overlap(df, meta, console)
    text = console.export_text()
    table_lines = [ln for ln in text.splitlines() if ln.strip().startswith(("epbench", "copy"))]
    assert len(table_lines) == 3
    assert all(len(ln) <= 100 for ln in text.splitlines())
    assert "73.7" in text  # the worst rank's GEMM kept %
    assert "busy" in text and "60.0" in text  # the communication loop's busy share, beside the GEMM columns
    assert "stand-in expert after every dispatch" in text  # a folder from before the expert left the loops
    meta["overlap"]["stand_in_expert"] = ov.EXPERT_IN_LOOP
    console = Console(width=100, record=True)
    print_overlap(df, meta, console)
    assert "stand-in expert" not in console.export_text()
    assert "SMs and HBM only" in text


def _overlap_folder(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "meta.json").write_text(json.dumps({"verb": "overlap", "world": 2, "scenario": {"name": "s"},
                                               "overlap": {"gemm": "bf16 8192x8192x8192"}}))
    pd.DataFrame(_rows()).to_csv(run / "results.csv", index=False)
    return run


def test_plot_of_an_overlap_folder(tmp_path):
    (png,) = plot_run(_overlap_folder(tmp_path))
    assert png.name == "overlap_vs_sms.png" and png.read_bytes()[:4] == b"\x89PNG"


def test_report_prints_an_overlap_folder_and_compare_refuses_it(tmp_path):
    run = _overlap_folder(tmp_path)
    r = epbench_here("report", str(run))
    assert r.code == 0 and "overlap, bf16 8192x8192x8192 beside" in r.out and "73.7" in r.out
    c = epbench_here("compare", str(run), str(run))
    assert c.code == 2 and "compare reads run and sweep" in c.both and len(c.both.strip().splitlines()) == 1


def test_report_of_an_overlap_folder_without_rows_says_so_with_its_notes(tmp_path):
    """Every backend skipped and no copy kernel (or every job failed first): no table, the notes."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "meta.json").write_text(json.dumps({"verb": "overlap", "scenario": {"name": "s"}, "world": 2,
                                               "notes": ["backend deepep skipped: why"]}))
    r = epbench_here("report", str(run))
    assert r.code == 0 and "no measured points" in r.out and "note: backend deepep skipped: why" in r.out


def test_cli_refuses_without_a_gpu():
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a CUDA GPU is present")
    r = epbench_here("overlap", str(SCENARIOS / "dsv3x4.yaml"), "--nproc", "1", "--sms", "8")
    assert r.code == 2
    assert "needs a CUDA GPU" in r.both and len(r.both.strip().splitlines()) == 1


def test_cli_refuses_a_low_latency_scenario_before_any_rank_starts():
    r = epbench_here("overlap", str(SCENARIOS / "dsv3x4-ll.yaml"), "--nproc", "1", "--sms", "8")
    assert r.code == 2 and len(r.both.strip().splitlines()) == 1, r.both
    assert "mode: overlap measures normal mode only (not low_latency)" in r.both


def test_gemm_check_passes_a_rerun_and_fails_a_poisoned_or_wrong_output():
    torch = pytest.importorskip("torch")
    for spec, tokens in ((ov.parse_gemm("32,48,64"), None), (ov.parse_gemm("experts:16"), [5, 0, 7])):
        g = ov.Gemm(spec, torch.device("cpu"), 64, tokens)
        g()
        reference = g.out.clone()
        g.poison()
        assert g.wrong(reference) == reference.numel()  # a GEMM that did not run cannot pass
        g()
        assert g.wrong(reference) == 0
        g.out[0, 0] += 10 * (reference.abs().max() + 1)
        assert g.wrong(reference) == 1
    assert g.groups == [(0, 0, 5), (2, 5, 12)]  # the expert without tokens takes no rows
    assert g.grouped and g.impl == "torch._grouped_mm" and g.launches == 2  # one grouped GEMM and its copy
    g()
    got = g.out.clone()
    g.per_expert()  # one torch.mm per expert gives the same rows
    assert (g.out.float() - got.float()).abs().max() <= 1e-2 * got.float().abs().max()
    assert torch.allclose(g.out[5:].float(), (g.a[5:] @ g.b[2]).float(), rtol=1e-2, atol=1e-2)
    assert g.flops == 2.0 * 12 * 64 * 16
    with pytest.raises(UserError, match="no token"):
        ov.Gemm(ov.parse_gemm("experts"), torch.device("cpu"), 64, [0, 0])


def test_experts_gemm_falls_back_to_one_mm_per_expert_where_grouped_mm_refuses(monkeypatch):
    """2 x H200, 2026-11-26: 128 torch.mm launches per experts GEMM outpaced by the host measured 9.5 us
    per 0.96 TFLOP; one grouped GEMM is the default, the loop only where torch lacks or refuses it."""
    torch = pytest.importorskip("torch")

    def refuse(*a, **k):
        raise RuntimeError("grouped gemm: unsupported")

    monkeypatch.setattr(torch, "_grouped_mm", refuse, raising=False)
    g = ov.Gemm(ov.parse_gemm("experts:16"), torch.device("cpu"), 64, [5, 0, 7])
    assert not g.grouped and g.impl == "torch.mm per expert" and g.launches == 2
    g()
    assert torch.equal(g.out[:5], g.a[:5] @ g.b[0])
    assert ov.Gemm(ov.parse_gemm("8,8,8"), torch.device("cpu"), 64).launches == 1


def test_partition_request_is_lowered_until_it_fits_beside_the_communication(monkeypatch):
    """The driver rounds a green context up to its SM-group size (8 on H100): asking for the
    free SMs must not hand the GEMM SMs that the communication uses."""
    from epbench import overlap as ov

    class Rounding:
        def __init__(self, want: int, device_index: int) -> None:
            self.want, self.sms = want, -(-want // 8) * 8

    monkeypatch.setattr(ov, "Partition", Rounding)
    for k in (4, 8, 16, 32):
        p = ov.disjoint_partition(132 - k, 0)
        assert p.sms <= 132 - k and p.sms > 132 - k - 8


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture
def overlap_on_cpu(monkeypatch):
    """overlap.measure in this process on CPU: the GPU's pieces faked (its SM count, the green
    contexts, the GEMM's timing, the concurrent window's figures, the copy kernel), the
    communication real (the driver's timing loop and checks, at world 1 over gloo)."""
    from types import SimpleNamespace

    import torch

    def point(self, loop):  # the communication loop runs once; the figures are made up
        samples = loop()
        alone = {op: 100.0 for op in samples}
        beside = {op: 125.0 for op in samples}
        alone["loop"], beside["loop"] = 1000.0, 1250.0
        gemm = {"gemm_all_us": self.gemm_all_us, "gemm_confined_us": 110.0, "gemm_beside_us": 130.0,
                "gemm_count": 10, "pair_us": 1400.0,
                "gemm_sms": self.part.sms if self.part is not None else self.total}
        return ov.point_row({}, gemm, alone, beside), {"alone": samples, "beside": samples}

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(multi_processor_count=132))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device: "CPU")
    monkeypatch.setattr(ov, "gpu_shared", lambda comm: False)
    monkeypatch.setattr(ov, "set_carveout", lambda n: None)
    monkeypatch.setattr(ov, "time_gemm", lambda gemm, n, part: 100.0)
    monkeypatch.setattr(ov, "disjoint_partition", lambda free, index: SimpleNamespace(sms=free, want=free))
    monkeypatch.setattr(ov._Point, "measure", point)
    monkeypatch.setattr(ov, "copy_loop", lambda comm, sms, nbytes, opts: (lambda: {"copy": [1.0, 2.0]}, lambda: 0))
    for k, v in dict(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1").items():
        monkeypatch.setenv(k, v)


def test_one_folder_from_a_job_per_python_and_a_failed_job_costs_its_own_points(
        tmp_path, monkeypatch, capsys, overlap_on_cpu):
    """overlap with reference, deepep and deepep-v2, each flavor recorded in its own venv: three
    jobs into one folder. The reference's and deepep's run here through the engine (deepep's
    with the venv's python as sys.executable, the reference's calls standing in for DeepEP at
    each SM count); deepep-v2's crashes. The folder holds every point of the first two, the copy
    rows once per SM count, deepep-v2's points as failed rows, which python ran each backend, and
    the run's status and error line as `run` gives them; report and plot read it."""
    import sys

    from epbench import backends, cli, flavors, launch, launcher, provenance, rank, scenario
    from epbench import plan as plans
    from epbench.backends.reference import ReferenceBackend
    from epbench.results import load_run, load_unmeasured
    from support import fake_venv

    class DeepEPStandIn(ReferenceBackend):  # deep_ep is not installed here
        uses_sms = True

    real_load = backends.load_backend
    monkeypatch.setattr(backends, "load_backend",
                        lambda name: (DeepEPStandIn, None) if name == "deepep" else real_load(name))
    reg = tmp_path / "venvs.json"
    v1, v2 = fake_venv(tmp_path / "venv-v1", "v1"), fake_venv(tmp_path / "venv-v2", "v2")
    flavors.record("v1", v1, reg)
    flavors.record("v2", v2, reg)
    monkeypatch.setenv(flavors.REGISTRY_ENV, str(reg))
    monkeypatch.setattr(provenance, "baselines_build", lambda: {})
    ran = []

    def job_here(torchrun, device, error_dir=None):
        python = torchrun[torchrun.index("--no-python") + 1] if "--no-python" in torchrun else sys.executable
        p, job = plans.read(Path(torchrun[-2])), int(torchrun[-1])
        ran.append((p.jobs[job], python))
        if "deepep-v2" in p.jobs[job]:
            return launch.Outcome("failed", 1, "rank 0 was killed by SIGSEGV")
        monkeypatch.setenv("MASTER_PORT", str(_free_port()))
        with monkeypatch.context() as m:
            m.setattr(sys, "executable", python)  # what the job's ranks run
            assert rank.run_plan(p, job) == 0
        return launch.Outcome("complete")

    monkeypatch.setattr(launch, "run_job", job_here)
    opts = ov.OverlapOptions(("reference", "deepep", "deepep-v2"), (4, 8), 1, 2, ov.parse_gemm("8,8,8"))
    run = tmp_path / "run"
    run.mkdir()
    p = plans.Plan(verb="overlap", scenario=scenario.load(SCENARIOS / "smoke.yaml"), options=opts,
                   device="cpu", argv=("overlap",), results=tmp_path, run_dir=run,
                   jobs=launcher.jobs_by_flavor(opts.backends))
    capsys.readouterr()
    assert launcher.start(p, cli.show_overlap) == 1
    out, err = capsys.readouterr()
    assert ran == [(("reference",), sys.executable), (("deepep",), v1), (("deepep-v2",), v2)]
    assert err == "epbench: error: deepep-v2: rank 0 was killed by SIGSEGV\n"
    meta, df = load_run(run)
    assert meta["status"] == "failed" and meta["error"] == "deepep-v2: rank 0 was killed by SIGSEGV"
    assert meta["options"]["backends"] == ["reference", "deepep", "deepep-v2"] and meta["wrong"] == 0
    assert {b: r["python"] for b, r in meta["backend_runtime"].items()} == {"reference": sys.executable,
                                                                           "deepep": v1}
    points = sorted(zip(df["backend"], df["call_mode"].fillna("-"), df["sms"]))
    assert points == [("copy", "-", 4), ("copy", "-", 8),  # the scenario's call modes, both; copy has none
                      ("deepep", "call", 4), ("deepep", "call", 8), ("deepep", "kernel", 4), ("deepep", "kernel", 8),
                      ("reference", "call", 0), ("reference", "kernel", 0)]
    assert set(load_unmeasured(run)["backend"]) == {"deepep-v2"}
    assert "deepep-v2: failed: rank 0 was killed by SIGSEGV (" in out and "overlap_vs_sms.png" in out
    backends_shown = [ln.split()[0] for ln in out.splitlines()
                      if ln.strip().split(" ")[0] in ("reference", "deepep", "copy")]
    assert backends_shown == ["reference"] * 2 + ["deepep"] * 4 + ["copy"] * 2  # the calibration last
    assert "deepep (kernel)" in out and "reference (call)" in out  # a line per call mode, named
    r = epbench_here("report", str(run))
    assert r.code == 0 and "overlap, bf16 8x8x8 beside" in r.out


def test_schedule_problem_names_a_capped_late_or_uncovered_pair_window():
    assert ov.schedule_problem(120, True, 300.0, 90_000.0) is None
    capped = ov.schedule_problem(ov.GEMM_LOOP_MAX, True, 300.0, 90_000.0)
    assert capped and f"cap of {ov.GEMM_LOOP_MAX}" in capped
    late = ov.schedule_problem(4000, True, 6_251_000.0, 7_251_000.0)  # Hybrid-EP on 2 x H200, 2026-11-26
    assert "cap" in late and "started 6251.0 ms into the pair window" in late
    assert "ended before" in ov.schedule_problem(50, False, 10.0, 90_000.0)
    assert ov.schedule_problem(50, True, 900.0, 2_000.0) is None  # under 1 ms is never late


def test_a_point_runs_its_loop_once_untimed_before_the_alone_loop(monkeypatch):
    """A library that compiles its kernels on first use (Hybrid-EP) must not put that into the alone
    loop, which sizes the GEMM loop and the sum / max figures."""
    import torch

    order = []

    def loop():
        order.append("loop")
        return {"dispatch": [1.0, 1.0], "combine": [1.0, 1.0]}

    def alone(lp):
        order.append("alone")
        return lp(), 500.0

    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: order.append("sync"))
    monkeypatch.setattr(ov, "comm_loop_alone", alone)
    monkeypatch.setattr(ov, "set_carveout", lambda n: None)
    monkeypatch.setattr(ov, "time_gemm", lambda gemm, n, part: 100.0)
    win = ov.Window([(0.0, 100.0 * i + 100.0) for i in range(10)], 5.0, 800.0,
                    {"dispatch": [1.0, 1.0], "combine": [1.0, 1.0]})
    monkeypatch.setattr(ov, "concurrent", lambda gemm, n, part, lp: win)
    gemm = SimpleNamespace(flops=1e9)
    part = SimpleNamespace(sms=120, want=120)
    opts = ov.OverlapOptions(("epbench",), (8,), 1, 1, ov.parse_gemm(None))
    row, _ = ov._Point(gemm, 90.0, part, 132, opts).measure(loop)
    assert order[:4] == ["loop", "sync", "alone", "loop"]
    assert row["schedule_problem"] is None and row["gemm_count"] == ov.gemm_loop_count(500.0, 100.0)


def test_report_lists_each_points_problem_once():
    import pandas as pd

    from epbench.report import overlap_problems

    df = pd.DataFrame([{"backend": "hybrid-ep", "sms": 8, "rank": r, "problem": "GEMM loop at its cap"} for r in (0, 1)]
                      + [{"backend": "epbench", "sms": 8, "rank": 0, "problem": None}])
    assert overlap_problems(df) == ["hybrid-ep at 8 SMs: GEMM loop at its cap"]
    assert overlap_problems(df.drop(columns=["problem"])) == []


def test_summary_lines_name_the_call_mode_only_where_a_backend_has_several():
    df = pd.DataFrame([{"backend": b, "call_mode": m, "sms": 8, "rank": 0, "gemm_kept_pct": 80.0}
                       for b, m in (("epbench", "call"), ("deepep", "call"), ("deepep", "kernel"), ("copy", None))])
    assert list(summarize_overlap(df)["label"]) == ["epbench", "deepep (call)", "deepep (kernel)", "copy"]
    old = df.drop(columns=["call_mode"]).iloc[[0, 3]]  # a folder from before the column: backend names
    assert list(summarize_overlap(old)["label"]) == ["epbench", "copy"]
    link_first = pd.DataFrame([{"backend": b, "sms": 8, "rank": 0, "gemm_kept_pct": 80.0}
                               for b in ("copy-link", "copy", "epbench")])  # as a run may record them
    assert list(summarize_overlap(link_first)["label"]) == ["epbench", "copy-link", "copy"]  # calibrations last


def test_a_pair_window_the_gemms_did_not_cover_is_redone_longer_on_every_rank(monkeypatch):
    """2 x H200, 2026-11-26: the communication loop beside the GEMMs ran twice its span alone (the
    untimed fills between calls get only the SMs the GEMM leaves), so a GEMM loop sized from the
    alone span ended first on every point. The window is redone with more GEMMs, all ranks together."""
    windows, asked = [], []

    def concurrent(gemm, n, part, lp):
        windows.append(n)
        gemm_end = 100.0 * n  # 100 us GEMMs; the communication loop ends at 10 ms
        return ov.Window([(0.0, gemm_end)], 5.0, 10_000.0, {"dispatch": [1.0]})

    def everyone(ok):
        asked.append(ok)
        return ok

    monkeypatch.setattr(ov, "concurrent", concurrent)
    point = ov._Point(SimpleNamespace(), 90.0, None, 132, ov.OverlapOptions(("epbench",), (8,), 1, 1, ov.parse_gemm(None)),
                      everyone)
    n, win, tries = point.pair(50, lambda: {})
    assert windows == [50, ov.regrown_count(50, 5000.0, 10_000.0)] and tries == 2 and asked == [False, True]
    assert win.gemm_end >= win.comm_end and n == windows[-1]
    # another rank not covered: this rank, covered, runs the next window too
    windows.clear()
    point.everyone = lambda ok: False
    n, win, tries = point.pair(200, lambda: {})
    assert tries == ov.PAIR_TRIES and len(windows) == ov.PAIR_TRIES
    assert ov.regrown_count(ov.GEMM_LOOP_MAX, 1.0, 1e9) == ov.GEMM_LOOP_MAX and ov.regrown_count(5, 1000.0, 900.0) == 9
    assert ov.regrown_count(10, 1000.0, 2000.0) == 32  # 10 x 1.5 x 2 + 2


def test_report_per_rank_of_an_overlap_folder_is_one_line(tmp_path):
    from epbench import results

    w = results.RunWriter(tmp_path / "ov", {"verb": "overlap", "scenario": {"name": "s"}, "world": 2})
    w.add([{"backend": "reference", "sms": 0, "rank": 0, "wrong": 0}], [])
    w.finish("complete")
    r = epbench_here("report", str(tmp_path / "ov"), "--per-rank")
    assert r.code == 0 and "per rank: none for an `epbench overlap` run" in r.out and "Traceback" not in r.both


@pytest.mark.parametrize("world, shared", [(4, False), (4, True), (1, False)])
def test_link_calibration_rows_come_after_the_local_ones_where_a_link_is_crossed(monkeypatch, world, shared):
    """The copy rows at every SM count, then (a GPU per rank, world > 1) the copy-link rows, each with the
    bytes this rank sends over the links and the wrong bytes it received; the buffers of each SM count
    freed after it; none of them at world 1 or where ranks share a GPU."""
    from epbench import scenario
    from epbench.routing import route_all

    s = scenario.load(SCENARIOS / "smoke.yaml")
    recorded, closed, plans = [], [], []

    def link(comm, sms, plan, opts):
        plans.append(plan)
        return (lambda: {"copy": [1.0]}), (lambda: 3), (lambda: closed.append(sms))

    monkeypatch.setattr(ov, "copy_loop", lambda comm, sms, nbytes, opts: ((lambda: {"copy": [1.0]}), lambda: 0))
    monkeypatch.setattr(ov, "link_copy_loop", link)
    monkeypatch.setattr(ov, "gpu_shared", lambda comm: shared)
    monkeypatch.setattr(ov._Point, "measure", lambda self, loop: ({"schedule_problem": None}, {"alone": loop()}))

    def record(backend, sms, row, raw):
        recorded.append((backend, sms, row["wrong"], row["copy_bytes"]))
        return row["wrong"]

    opts = ov.OverlapOptions(("epbench",), (4, 8), 1, 2, ov.parse_gemm("8,8,8"))
    job = SimpleNamespace(scenario=s, options=opts, comm=SimpleNamespace(rank=1, world=world), note=print)
    gemm = SimpleNamespace(wrong=lambda reference: 0)
    wrong = ov._calibrate(job, gemm, None, {4: None, 8: None}, route_all(s), record,
                          lambda part: ov._Point(gemm, 1.0, part, 132, opts))
    local = [r for r in recorded if r[0] == "copy"]
    assert [(b, k) for b, k, *_ in local] == [("copy", 4), ("copy", 8)]
    if world == 1 or shared:
        assert len(recorded) == 2 and not plans and wrong == 0
        return
    assert [(b, k, w) for b, k, w, _ in recorded[2:]] == [("copy-link", 4, 3), ("copy-link", 8, 3)] and wrong == 6
    assert closed == [4, 8]
    plan = plans[0]  # whole 16-byte vectors to each peer, nothing to itself; what rank 1 sends is its row's sum
    assert all(plan[r][r] == 0 for r in range(4)) and all(b % 16 == 0 for row in plan for b in row)
    assert recorded[2][3] == sum(plan[1]) > 0


def test_link_plan_keeps_whole_vectors_and_drops_the_rank_itself():
    assert ov.link_plan([[100, 37, 0], [16, 999, 64], [5, 15, 17]]) == [[0, 32, 0], [16, 0, 64], [0, 0, 0]]


def _link_rows(monkeypatch, s, world):
    """(recorded rows, the link plans asked for, the notes) of _calibrate on rank 0 of ``world`` for scenario ``s``."""
    from epbench.routing import route_all

    recorded, plans, notes = [], [], []
    monkeypatch.setattr(ov, "copy_loop", lambda comm, sms, nbytes, opts: ((lambda: {"copy": [1.0]}), lambda: 0))
    monkeypatch.setattr(ov, "link_copy_loop", lambda comm, sms, plan, opts: (
        plans.append(plan) or (lambda: {"copy": [1.0]}), lambda: 0, lambda: None))
    monkeypatch.setattr(ov, "gpu_shared", lambda comm: False)
    monkeypatch.setattr(ov._Point, "measure", lambda self, loop: ({"schedule_problem": None}, {"alone": loop()}))
    opts = ov.OverlapOptions(("epbench",), (8,), 1, 2, ov.parse_gemm("8,8,8"))
    job = SimpleNamespace(scenario=s, options=opts, comm=SimpleNamespace(rank=0, world=world), note=notes.append)
    gemm = SimpleNamespace(wrong=lambda r: 0)
    ov._calibrate(job, gemm, None, {8: None}, route_all(s), lambda b, k, row, raw: recorded.append(b) or 0,
                  lambda part: ov._Point(gemm, 1.0, part, 132, opts))
    return recorded, plans, notes


def test_link_calibration_on_virtual_nodes_moves_the_inter_node_bytes_and_across_real_nodes_none(monkeypatch):
    import dataclasses

    from epbench import scenario

    virtual = scenario.load(SCENARIOS / "dsv3x2x1-virtual.yaml")  # 2 virtual nodes of 1 GPU: every copy between nodes
    recorded, plans, _ = _link_rows(monkeypatch, virtual, 2)
    assert recorded == ["copy", "copy-link"] and plans[0][0][1] > 0 and plans[0][1][0] > 0
    smoke = scenario.load(SCENARIOS / "smoke.yaml")
    two_nodes = dataclasses.replace(smoke, topology=dataclasses.replace(smoke.topology, nodes=2, gpus_per_node=2))
    recorded, plans, notes = _link_rows(monkeypatch, two_nodes, 4)
    assert recorded == ["copy"] and not plans
    assert notes == ["copy-link calibration: within one node only (this run spans 2 nodes)"]
