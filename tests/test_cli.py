"""The command line as users type it: bad input and the commands that start no ranks run
in-process through cli.main (support.epbench_here: what ``python -m epbench ...`` runs, without
a process start that imports torch); real runs are ``python -m epbench ...`` in a subprocess.

Bad input: exit 2, one line on stderr naming the file (or option) and the key, no traceback.
Real runs: 4 (or 2) CPU ranks over gloo under torchrun; the smoke run happens once per session
(conftest.smoke_run) and several tests read its folder. Every run writes under a temporary
results root, never into the repository's results/."""

import json
import os
import signal
import sys
import time
from pathlib import Path

import pytest
import torch

from support import (SCENARIOS, DROP, assert_one_line_error, epbench_here, run_cli, scenario_dict)

SHIPPED = sorted(SCENARIOS.glob("*.yaml"))
SMOKE = "scenarios/smoke.yaml"
NO_GPU = not torch.cuda.is_available()


# -- bad input -------------------------------------------------------------------------------

BAD_FILES = {
    # name: (file contents, text the one line must contain besides the file name)
    "malformed": ("model:\n  hidden: [256,\n", "malformed YAML"),
    "unknown-key": (scenario_dict(model={"hiden": 256}), "model.hiden: unknown key"),
    "missing-key": (scenario_dict(model={"topk": DROP}), "model.topk: missing"),
    "wrong-type": (scenario_dict(model={"hidden": "large"}), "model.hidden: must be an integer"),
    "topk-too-big": (scenario_dict(model={"topk": 17}), "model.topk: must not exceed"),
    "zero-tokens": (scenario_dict(model={"tokens_per_rank": 0}),
                    "model.tokens_per_rank: must be positive"),
    "hidden-not-x8": (scenario_dict(model={"hidden": 260}), "model.hidden: must be a multiple of 8"),
    "fp8-not-x128": (scenario_dict(model={"hidden": 264, "dispatch_dtype": "fp8"}),
                     "model.hidden: must be a multiple of 128"),
    "own-rows-ce-expert-major": ({**scenario_dict(model={"layout": "expert_major"}),
                                  "backend_options": {"epbench": {"own_rows": "ce"}}},
                                 "epbench.own_rows=ce needs model.layout rank_major"),
}


@pytest.mark.parametrize("case", BAD_FILES)
def test_bad_scenario_file(case, write_scenario, tmp_path):
    data, needle = BAD_FILES[case]
    path = write_scenario(case, data)
    r = epbench_here("run", path, "--results", tmp_path / "res")
    line = assert_one_line_error(r, str(path), needle)
    assert line.startswith("epbench: error: ")
    assert not (tmp_path / "res").exists() or not any((tmp_path / "res").iterdir())


@pytest.mark.skipif(not NO_GPU, reason="the host has GPUs")
def test_shipped_gpu_scenario_on_a_cpu_host(tmp_path):
    path = "scenarios/h200x4.yaml"
    r = epbench_here("run", path, "--results", tmp_path / "res")
    assert_one_line_error(r, path, "topology.gpus_per_node", "needs 4 GPUs")
    assert not (tmp_path / "res").exists() or not any((tmp_path / "res").iterdir())


@pytest.mark.skipif(not NO_GPU, reason="the host has GPUs")
def test_more_gpus_than_the_host_has(write_scenario, tmp_path):
    path = write_scenario("eight", scenario_dict(topology={"gpus_per_node": 8},
                                                 bench={"device": "cuda"}))
    assert_one_line_error(epbench_here("run", path, "--results", tmp_path), str(path),
                          "topology.gpus_per_node", "needs 8 GPUs")
    assert_one_line_error(epbench_here("run", SMOKE, "--device", "cuda", "--results", tmp_path),
                          SMOKE, "topology.gpus_per_node")


def test_several_nodes_need_the_multi_node_flags(write_scenario, tmp_path):
    path = write_scenario("two-nodes", scenario_dict(topology={"nodes": 2, "gpus_per_node": 2}))
    assert_one_line_error(epbench_here("run", path, "--results", tmp_path), str(path),
                          "topology.nodes", "--nnodes 2")


@pytest.mark.parametrize("args, needles", [
    (("run", SMOKE, "--sms", "0"), ("--sms", "positive")),
    (("sweep", SMOKE, "--sms", "8,x"), ("--sms", "8,x")),
    (("run", SMOKE, "--backends", "reference,nope"), ("backend 'nope'", "unknown")),
    (("run", SMOKE, "--nproc", "0"), ("--nproc",)),
    (("run", SMOKE, "--iters", "0"), ("--iters", "positive")),
    (("run", SMOKE, "--device", "tpu"), ("--device", "tpu")),
    (("run", SMOKE, "--inject-fault", "gather"), ("--inject-fault", "gather")),
    (("run", "scenarios/no-such-scenario.yaml"), ("scenarios/no-such-scenario.yaml",
                                                   "no such scenario file")),
], ids=["sms-zero", "sweep-sms-text", "backend", "nproc", "iters", "device", "fault",
        "no-file"])
def test_bad_options(args, needles, tmp_path):
    assert_one_line_error(epbench_here(*args, "--results", tmp_path / "res"), *needles)
    assert not (tmp_path / "res").exists() or not any((tmp_path / "res").iterdir())


@pytest.mark.parametrize("model, needle", [({"layout": "expert_major"}, "needs model.layout rank_major"),
                                            ({"dispatch_dtype": "mxfp8", "quantize": "fused"},
                                             "needs model.quantize before")])
def test_own_rows_ce_refused_where_a_copy_cannot_serve(model, needle, write_scenario, tmp_path):
    """own_rows=ce from --option (or EPBENCH_OWN_ROWS) against the scenario's payload: exit 2 in one line before any
    rank starts, and only where the epbench backend is asked for."""
    path = write_scenario("ce", scenario_dict(model=model))
    assert_one_line_error(epbench_here("run", path, "--backends", "reference,epbench", "--option",
                                       "epbench.own_rows=ce", "--results", tmp_path / "res"),
                          str(path), needle)
    assert not (tmp_path / "res").exists() or not any((tmp_path / "res").iterdir())


def test_nproc_too_small_for_topk(write_scenario, tmp_path):
    path = write_scenario("topk8", scenario_dict(model={"topk": 8, "experts_per_rank": 2}))
    assert_one_line_error(epbench_here("run", path, "--nproc", "3", "--results", tmp_path),
                          "--nproc 3", "topk 8")


def test_debug_shows_the_traceback(write_scenario, tmp_path):
    path = write_scenario("bad", scenario_dict(model={"hidden": 260}))
    r = epbench_here("--debug", "run", path, "--results", tmp_path)
    assert r.code == 2
    assert "Traceback (most recent call last)" in r.err
    assert "UserError" in r.err
    assert r.err.strip().splitlines()[-1].startswith(f"epbench: error: {path}: model.hidden")


# -- validate --------------------------------------------------------------------------------

def test_validate_every_shipped_scenario():
    names = [f"scenarios/{p.name}" for p in SHIPPED]
    r = epbench_here("validate", *names)
    assert r.code == 0, r.both
    assert r.err == ""
    for n in names:
        assert f"ok {n}:" in r.out


def test_validate_reports_each_bad_file_on_one_line(write_scenario):
    bad = write_scenario("unknown", scenario_dict(model={"hiden": 256}))
    bad2 = write_scenario("fp8", scenario_dict(model={"hidden": 264, "dispatch_dtype": "fp8"}))
    r = epbench_here("validate", SMOKE, bad, bad2)
    assert r.code == 2
    assert "Traceback" not in r.both
    assert f"ok {SMOKE}:" in r.out
    lines = r.err.strip().splitlines()
    assert len(lines) == 2, r.err
    assert str(bad) in lines[0] and "model.hiden" in lines[0]
    assert str(bad2) in lines[1] and "model.hidden" in lines[1]


# -- real runs: 4 CPU ranks over gloo --------------------------------------------------------


@pytest.mark.slow
def test_smoke_run_succeeds_and_prints_the_table(smoke_run):
    r = smoke_run.result
    assert r.code == 0, r.both
    assert "Traceback" not in r.both
    assert smoke_run.dir is not None
    out = r.out
    assert "smoke on 4 ranks (cpu)" in out
    for header in ("time us", "algbw", "busbw", "#wrong"):
        assert header in out
    assert any("dispatch" in ln and "reference" in ln for ln in out.splitlines())
    assert any("combine" in ln and "reference" in ln for ln in out.splitlines())
    assert f"results: {smoke_run.dir}" in out
    assert "VERIFICATION FAILED" not in out


@pytest.mark.slow
def test_smoke_results_csv(smoke_run):
    df = smoke_run.rows()
    # one row per backend x call mode x op x SMs x rank: the reference backend (no SM knob) in its
    # two call modes, 2 ops, 4 ranks
    assert len(df) == 16 and sorted(set(df["call_mode"])) == ["call", "kernel"]
    assert set(df["backend"]) == {"reference"}
    assert sorted(df.groupby(["op", "call_mode"])["rank"].apply(sorted).tolist()) == [[0, 1, 2, 3]] * 4
    assert set(df["world"]) == {4}
    assert (df["wrong"] == 0).all()
    assert (df["time_us"] > 0).all() and (df["algbw_gbps"] > 0).all()
    assert (df["iters"] == 5).all()
    # raw numbers with units in the column names
    for col in ("time_us", "algbw_gbps", "busbw_nvlink_gbps", "algo_bytes", "nvlink_bytes"):
        assert col in df.columns and df[col].dtype.kind in "fi"
    # the byte counts follow from the routing
    from epbench import metrics
    from epbench.routing import route_all, traffic
    from epbench.scenario import load

    s = load(SCENARIOS / "smoke.yaml")
    t = traffic(route_all(s), s.model.experts_per_rank, 4, hierarchical=False)
    want = metrics.rank_bytes(t, "dispatch", metrics.row_bytes("bf16", s.model.hidden))
    got = df[(df["op"] == "dispatch") & (df["call_mode"] == "call")].sort_values("rank")
    assert got["algo_bytes"].tolist() == want["algo"].tolist()
    assert got["nvlink_bytes"].isna().all() and got["busbw_nvlink_gbps"].isna().all()  # CPU ranks cross no link
    row = got.iloc[0]
    assert row["algbw_gbps"] == pytest.approx(row["algo_bytes"] / (row["time_us"] * 1e3))


@pytest.mark.slow
def test_smoke_samples_csv(smoke_run):
    samples = smoke_run.samples()
    assert len(samples) == 5 * 2 * 4 * 2  # iters x ops x ranks x call modes
    assert sorted(samples["iter"].unique()) == list(range(5))
    df = smoke_run.rows()
    for (op, rank, mode), g in samples.groupby(["op", "rank", "call_mode"]):
        row = df[(df["op"] == op) & (df["rank"] == rank) & (df["call_mode"] == mode)].iloc[0]
        assert row["time_us"] == pytest.approx(g["time_us"].median())
        assert row["time_us_max"] == pytest.approx(g["time_us"].max())


@pytest.mark.slow
def test_smoke_meta_json(smoke_run):
    meta = smoke_run.meta()
    assert meta["status"] == "complete"
    assert meta["argv"][0] == "run" and "scenarios/smoke.yaml" in meta["argv"]
    assert meta["scenario"]["name"] == "smoke"
    assert meta["scenario"]["model"]["hidden"] == 256
    assert meta["world"] == 4
    assert "git_commit" in meta
    assert meta["torch"] == torch.__version__
    assert meta["wrong"] == 0
    # the compiled-kernel backend needs GPUs: skipped, with the reason kept
    notes = meta.get("notes", [])
    assert any(n.startswith("backend epbench skipped") for n in notes), notes
    assert any("backend epbench skipped" in ln for ln in smoke_run.result.out.splitlines())


@pytest.mark.slow
def test_report_reprints_the_table(smoke_run):
    r = epbench_here("report", smoke_run.dir)
    assert r.code == 0, r.both
    assert str(smoke_run.dir.name) in r.out
    assert "smoke on 4 ranks (cpu)" in r.out and "#wrong" in r.out
    table = [ln for ln in r.out.splitlines() if "reference" in ln]
    assert len(table) == 2 * 2  # ops x call modes
    # the same numbers the run printed
    printed = [ln for ln in smoke_run.result.out.splitlines() if "reference" in ln]
    assert table == printed


def test_report_of_a_folder_that_is_not_a_run(tmp_path):
    (tmp_path / "x").mkdir()
    assert_one_line_error(epbench_here("report", tmp_path / "x"), str(tmp_path / "x"))


@pytest.fixture(scope="module")
def fault_runs(results_root, smoke_run):
    """Verification must fail when one output row is corrupted on every rank (2 ranks: cheaper,
    and it exercises --nproc; the reference backend alone: the scenario's other one, epbench, is
    skipped on CPU, test_smoke_meta_json, and would only cost a second job)."""
    return {op: run_cli(results_root, "run", SMOKE, "--inject-fault", op, "--nproc", "2",
                        "--iters", "2", "--warmup", "0", "--backends", "reference", "--call-modes", "call")
            for op in ("dispatch", "combine")}


@pytest.mark.slow
@pytest.mark.parametrize("op", ["dispatch", "combine"])
def test_a_corrupted_result_fails_verification(fault_runs, op):
    run = fault_runs[op]
    assert run.result.code != 0, run.result.both
    assert "VERIFICATION FAILED" in run.result.out
    df = run.rows()
    by_op = df.groupby("op")["wrong"].sum()
    assert by_op[op] >= 2  # one corrupted row on each of the 2 ranks
    other = "combine" if op == "dispatch" else "dispatch"
    assert by_op[other] == 0  # the checks do not bleed into the other operation
    assert (df[df["op"] == op]["problem"].fillna("") != "").all()
    meta = run.meta()
    assert meta["wrong"] == by_op[op] and meta["world"] == 2
    # the table carries the count in its #wrong column
    line = next(ln for ln in run.result.out.splitlines() if op in ln and "reference" in ln)
    assert line.rstrip(" │").split()[-1] == str(by_op[op])


@pytest.fixture(scope="module")
def sweep_run(results_root, smoke_run):
    return run_cli(results_root, "sweep", SMOKE, "--sms", "2,4", "--nproc", "2", "--iters", "3",
                   "--warmup", "1")


@pytest.mark.slow
def test_sweep_on_two_ranks(sweep_run):
    r = sweep_run.result
    assert r.code == 0, r.both
    assert "smoke on 2 ranks (cpu)" in r.out
    meta = sweep_run.meta()
    assert meta["argv"][0] == "sweep"
    assert meta["world"] == 2  # --nproc: the results record the real world size
    assert meta["options"]["sms"] == [2, 4]
    df = sweep_run.rows()
    assert set(df["world"]) == {2} and sorted(set(df["rank"])) == [0, 1]
    # the reference backend has no SM knob: one point per call mode; epbench is skipped on CPU
    assert len(df) == 2 * 2 * 2
    assert len(sweep_run.samples()) == 3 * 2 * 2 * 2


@pytest.mark.slow
def test_runs_never_share_a_folder(results_root, smoke_run, fault_runs, sweep_run):
    runs = [smoke_run, *fault_runs.values(), sweep_run]
    dirs = [r.dir for r in runs]
    assert None not in dirs
    assert len(set(dirs)) == len(runs)
    assert set(dirs) <= set(results_root.iterdir())
    # each folder still holds its own run: later runs overwrote nothing
    argvs = [tuple(json.loads((d / "meta.json").read_text())["argv"]) for d in dirs]
    assert len(set(argvs)) == len(runs)
    assert smoke_run.meta()["wrong"] == 0 and (smoke_run.rows()["wrong"] == 0).all()


def test_a_rank_error_names_the_rank_literally(monkeypatch, capsys):
    """Under torchrun the one-line error starts with [rank N] (not eaten as console markup), for a
    start-up failure too (exit 1), and brackets inside the message survive."""
    from epbench import cli
    from epbench.errors import StartupError

    def boom(**_click_options) -> None:
        raise StartupError("NVSHMEM could not start on rank 3: [uid] refused")

    monkeypatch.setattr(cli, "app", boom)
    # a rank leaves through os._exit (launch.leave), which would end this test process too
    monkeypatch.setattr(cli.launch, "leave", lambda code: sys.exit(code))
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_RANK", "3")
    with pytest.raises(SystemExit) as e:
        cli.main()
    assert e.value.code == 1
    err = capsys.readouterr().err
    assert "epbench: error: [rank 3] NVSHMEM could not start on rank 3: [uid] refused" in err
    assert len(err.strip().splitlines()) == 1


# -- reading a results root that holds broken runs ---------------------------------------------

def _measured_rows(backend="epbench", sms=8, scale=1.0):
    """Rows as a 2-GPU CUDA run writes them, enough for report, plot, compare and predict."""
    return [{"scenario": "s", "backend": backend, "op": op, "sms": sms, "rank": r, "world": 2,
             "time_us": 500.0 * scale + r, "algbw_gbps": 300.0, "busbw_nvlink_gbps": 250.0 / scale,
             "busbw_nic_gbps": None, "nvlink_bytes": 125_000_000, "wrong": 0, "problem": ""}
            for op in ("dispatch", "combine") for r in range(2)]


RUN_META = {"device": "cuda", "world": 2, "env": {},
            "scenario": dict(scenario_dict(topology={"gpus_per_node": 2, "nvlink_gbps": 450.0}), name="s")}


@pytest.fixture
def broken_root(tmp_path):
    """results/ with a good run, a good run three levels down, a corrupt meta.json and a
    truncated results.csv."""
    from epbench.results import RunWriter

    root = tmp_path / "results"
    made = {}
    for name, where in (("good", root / "good"), ("nested", root / "x" / "y" / "nested"),
                        ("corrupt", root / "corrupt"), ("truncated", root / "x" / "truncated")):
        w = RunWriter(where, RUN_META)
        scale = 2.0 if name == "nested" else 1.0  # two SM counts: a bandwidth-vs-SMs curve
        w.add(_measured_rows(scale=scale) + _measured_rows(sms=16, scale=scale), [])
        w.finish("complete")
        made[name] = where
    (made["corrupt"] / "meta.json").write_text('{"device": "cu')
    csv = made["truncated"] / "results.csv"
    csv.write_text(csv.read_text()[:-20])
    return root, made


def _warned(err: str, made) -> None:
    """Exactly one warning line for each broken run, naming it; nothing else on stderr."""
    lines = err.strip().splitlines()
    assert len(lines) == 2, err
    assert all(ln.startswith("epbench: warning: skipped: ") for ln in lines), err
    assert str(made["corrupt"] / "meta.json") in lines[0] and "not valid JSON" in lines[0]
    assert str(made["truncated"] / "results.csv") in lines[1] and "truncated" in lines[1]


def test_report_skips_broken_runs_with_a_warning(broken_root):
    root, made = broken_root
    r = epbench_here("report", root)
    assert r.code == 0 and "Traceback" not in r.both, r.both
    _warned(r.err, made)
    shown = [ln for ln in r.out.splitlines() if ln.startswith(str(root))]
    assert shown == [str(made["good"]), str(made["nested"])]


def test_plot_skips_broken_runs_and_never_overwrites(broken_root, tmp_path):
    root, made = broken_root
    r = epbench_here("plot", root)
    assert r.code == 0 and "Traceback" not in r.both, r.both
    _warned(r.err, made)
    wrote = sorted(ln.split(" ", 1)[1] for ln in r.out.splitlines() if ln.startswith("wrote "))
    want = sorted(str(made[n] / "plots" / f) for n in ("good", "nested")
                  for f in ("bandwidth_vs_sms.png", "per_rank.png", "expert_load.png"))
    assert wrote == want and all(Path(p).is_file() for p in wrote)
    before = {p: Path(p).stat().st_mtime_ns for p in wrote}
    again = epbench_here("plot", made["good"])  # the plots exist: kept, one warning, exit 0
    assert again.code == 0 and "wrote" not in again.out
    assert len(again.err.strip().splitlines()) == 1 and "--force" in again.err
    assert {p: Path(p).stat().st_mtime_ns for p in wrote} == before
    forced = epbench_here("plot", made["good"], "--force")
    assert forced.code == 0 and forced.out.count("wrote ") == 3, forced.both


def test_compare_reads_good_runs_and_refuses_broken_ones_in_one_line(broken_root, tmp_path):
    root, made = broken_root
    out = tmp_path / "ab"
    r = epbench_here("compare", made["good"], made["nested"], "--plot", out)
    assert r.code == 0, r.both
    assert f"wrote {out}.png" in r.out and (tmp_path / "ab.png").is_file()  # the path written
    assert r.out.count("0.500") == 4  # B/A busbw of the nested run (half): dispatch and combine at 8 and 16 SMs
    again = epbench_here("compare", made["good"], made["nested"], "--plot", f"{out}.png")
    assert_one_line_error(again, f"{out}.png", "exists; --force overwrites it")
    assert "wrote" not in again.out
    assert epbench_here("compare", made["good"], made["nested"], "--plot", out, "--force").code == 0
    for broken, needle in (("corrupt", "not valid JSON"), ("truncated", "truncated")):
        assert_one_line_error(epbench_here("compare", made["good"], made[broken]), str(made[broken]), needle)
    assert_one_line_error(epbench_here("compare", made["good"], root / "nope"), "no such results folder")


def test_predict_calibrates_from_a_root_with_broken_runs(broken_root):
    root, made = broken_root
    r = epbench_here("predict", "scenarios/h100x32.yaml", "--calibrate", root)
    assert r.code == 0 and "Traceback" not in r.both, r.both
    _warned(r.err, made)
    assert "calibration:" in r.out and "MEASURED" in r.out


# -- hosts of every size (issue 18) ----------------------------------------------------------

@pytest.mark.parametrize("gpus, names", [
    (0, ("smoke",)), (1, ("dsv3x4-1gpu",)), (2, ("dsv3x2", "h8192x2", "dsv3x2x1-virtual")),
    (3, ("dsv3x2", "h8192x2", "dsv3x2x1-virtual")), (4, ("h200x4",)), (7, ("h200x4",)),
    (8, ("h100x8",)), (16, ("h100x8",)),
])
def test_default_scenarios_per_gpu_count(gpus, names):
    from epbench import cli, scenario

    assert cli.default_names(gpus) == names
    for name in names:  # each default fits its host: ranks per host <= GPUs, or shares one GPU
        s = scenario.load(SCENARIOS / f"{name}.yaml")
        assert s.topology.ranks_per_host <= gpus or gpus <= 1, name  # CPU ranks, or sharing one GPU
        assert (s.bench.device == "cuda") == (gpus > 0), name


def test_ranks_share_gpus_with_a_loud_note_but_never_without_a_gpu(monkeypatch, capsys):
    from epbench import cli, scenario
    from epbench.errors import UserError

    s = scenario.load(SCENARIOS / "dsv3x4.yaml")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert cli.resolve_device(s, None) == "cuda"
    out = capsys.readouterr().out
    assert "4 ranks on 1 GPU: ranks share GPUs, so this is a functional run" in out
    with pytest.raises(UserError, match="needs 4 GPUs on this host but it has 1"):
        cli.resolve_device(s, None, share=False)  # `epbench ceiling` needs separate GPUs
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    assert cli.resolve_device(s, None) == "cuda" and "share" not in capsys.readouterr().out
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(UserError, match="needs 4 GPUs on this host but it has 0"):
        cli.resolve_device(s, None)


@pytest.mark.parametrize("verb, where, args", [
    ("predict", "epbench.predict.predict", ("scenarios/h100x32.yaml",)),
    ("plot", "epbench.plot.plot_run", ("results",)),
])
def test_ctrl_c_outside_a_run_is_one_line_and_exit_130(monkeypatch, tmp_path, verb, where, args):
    """typer >= 0.29 turns a KeyboardInterrupt into a silent exit 130: a Ctrl-C in predict or plot
    says so in one line, as a run's does."""
    def interrupted(*_a, **_k):
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(5)

    monkeypatch.setattr(where, interrupted)
    if verb == "plot":
        monkeypatch.setattr("epbench.results.load_runs", lambda *a, **k: iter([(tmp_path, {}, None)]))
    r = epbench_here(verb, *args)
    assert r.code == 130 and r.err == "epbench: interrupted (SIGINT)\n", r.both


def test_options_that_change_nothing_get_a_note_each_and_the_run_goes_on():
    """--mps with CPU ranks, --graph-chain outside a low-latency GPU run, --sms where no backend takes an SM
    count and an --option for a backend not in the run each get one note; where they apply, none."""
    from types import SimpleNamespace

    from epbench import cli, scenario as sc

    normal = sc.load(SCENARIOS / "smoke.yaml")
    ll = sc.load(SCENARIOS / "smoke-ll.yaml")
    ref = SimpleNamespace(backends=("reference",))
    notes = cli.ineffective_options(normal, ref, "cpu", mps=True, graph_chain=4, sms="4,8",
                                    option=["own_rows=ce"])
    assert [n.split(":")[0] for n in notes] == ["--mps", "--graph-chain 4", "--sms 4,8", "--option epbench.own_rows"]
    assert all("no effect" in n for n in notes)
    both = SimpleNamespace(backends=("reference", "epbench-ll"))
    assert cli.ineffective_options(ll, both, "cuda", mps=True, graph_chain=4, sms="4,8",
                                   option=["epbench-ll.combine_chunk=2"]) == []
    assert cli.ineffective_options(normal, ref, "cpu") == []


def test_report_goes_on_past_a_run_that_lost_its_results_file(tmp_path):
    """A completed run whose results.csv is gone is one warning in a tree's report, the other runs still
    shown (exit 0); given alone it is the error (exit 2)."""
    from epbench.results import RunWriter

    meta = {"scenario": {"name": "smoke"}, "world": 2, "device": "cpu", "status": "complete"}
    measured = [{"scenario": "s", "backend": "reference", "op": op, "sms": 0, "rank": r, "world": 2,
                 "time_us": 100.0, "algbw_gbps": 10.0, "wrong": 0} for op in ("dispatch", "combine") for r in (0, 1)]
    for name in ("a_gone", "b_ok"):
        w = RunWriter(tmp_path / "tree" / name, meta)
        w.add(measured, [])
        w.finish("complete")
    (tmp_path / "tree" / "a_gone" / "results.csv").unlink()
    r = epbench_here("report", tmp_path / "tree")
    assert r.code == 0 and "b_ok" in r.out and "dispatch" in r.out, r.both
    assert "warning" in r.err and "a_gone" in r.err and "results.csv: missing" in r.err, r.both
    assert_one_line_error(epbench_here("report", tmp_path / "tree" / "a_gone"), "results.csv: missing")


def test_predict_refuses_a_scenario_of_cpu_ranks_before_reading_any_calibration(tmp_path):
    """The refusal comes first: not a calibration error about the folder given (nothing is read)."""
    assert_one_line_error(epbench_here("predict", SMOKE, "--calibrate", tmp_path / "nowhere"),
                          "bench.device: cpu", "nothing to predict")


# -- empty paths, backends that cannot run the scenario ----------------------------------------

EMPTY_PATHS = {
    "run-path": ("run", ""),
    "run-results": ("run", SMOKE, "--results", ""),
    "run-run-dir": ("run", SMOKE, "--run-dir", ""),
    "sweep-results": ("sweep", SMOKE, "--sms", "4", "--results", ""),
    "overlap-results": ("overlap", SMOKE, "--results", ""),
    "probe-csv": ("probe", "--csv", ""),
    "validate": ("validate", SMOKE, ""),
    "report": ("report", ""),
    "plot": ("plot", ""),
    "plot-out": ("plot", "results", "--out", ""),
    "ceiling-csv": ("ceiling", SMOKE, "--csv", ""),
    "compare": ("compare", "", "results"),
    "predict-json": ("predict", "scenarios/h100x32.yaml", "--json", ""),
    "predict-calibrate": ("predict", "scenarios/h100x32.yaml", "--calibrate", ""),
}


@pytest.mark.parametrize("case", EMPTY_PATHS)
def test_an_empty_path_is_refused_not_taken_as_the_current_folder(case, tmp_path, monkeypatch):
    """Path('') is '.': `--results ''` wrote a run into the current folder, `report ''` read it."""
    monkeypatch.chdir(tmp_path)  # where an accepted '' would write
    r = epbench_here(*[str(SCENARIOS.parent / a) if a.startswith("scenarios/") else a for a in EMPTY_PATHS[case]])
    assert_one_line_error(r, "must name a file or folder, got an empty string")
    assert list(tmp_path.iterdir()) == [] and r.out == ""


def test_compare_plot_into_an_empty_name_is_refused(tmp_path):
    r = epbench_here("compare", tmp_path, tmp_path, "--plot", "")
    assert_one_line_error(r, "--plot: must name a file or folder, got an empty string")


def test_every_path_parameter_refuses_an_empty_string():
    """One rule for every command's path arguments and options, those added later included."""
    import typing

    from typer.models import ParameterInfo

    from epbench import cli

    for command in cli.app.registered_commands:
        for name, hint in typing.get_type_hints(command.callback, include_extras=True).items():
            if typing.get_origin(hint) is not typing.Annotated or "Path" not in str(typing.get_args(hint)[0]):
                continue
            infos = [i for i in typing.get_args(hint)[1:] if isinstance(i, ParameterInfo)]
            assert infos and all(i.parser is cli._given_path for i in infos), \
                f"epbench {command.callback.__name__} {name}: use cli.path_argument / path_option"


@pytest.mark.parametrize("path, backends, needles", [
    (SMOKE, "epbench-ll", ("epbench-ll does not implement mode normal (it implements: low_latency)",)),
    ("scenarios/smoke-ll.yaml", "epbench", ("epbench cannot run on CPU ranks: needs CUDA GPUs",)),
    (SMOKE, "epbench,epbench-ll", ("epbench cannot run on CPU ranks", "epbench-ll does not implement mode normal")),
])
def test_named_backends_none_of_which_can_run_are_refused_before_launch(path, backends, needles, tmp_path):
    """The ranks would skip each one, measure nothing and exit 0 with a complete run."""
    r = epbench_here("run", path, "--device", "cpu", "--backends", backends, "--results", tmp_path / "res")
    assert_one_line_error(r, "--backends: nothing would be measured in", *needles)
    assert not (tmp_path / "res").exists()


def test_a_backend_that_cannot_run_beside_one_that_can_is_left_to_its_skip_row(monkeypatch):
    """Some of the named backends run: the others keep their skip rows (the ranks' rule); a
    normal-mode backend in a low-latency run times its normal path; the defaults are not checked."""
    from epbench import cli, scenario

    smoke, ll = scenario.load(Path(SMOKE)), scenario.load(Path("scenarios/smoke-ll.yaml"))
    cli.check_named_backends(smoke, ("reference", "epbench-ll"), "cpu")
    cli.check_named_backends(ll, ("epbench-ll", "reference"), "cpu")
    assert cli.unrunnable_reason(ll, "epbench", "cuda") is None  # runs_as_normal; GPUs judged by the ranks
    assert cli.unrunnable_reason(smoke, "epbench-ll", "cuda").startswith("does not implement mode normal")
    assert cli.unrunnable_reason(smoke, "deepep", "cpu") is None  # its flavor's venv judges it


def test_the_default_backends_are_not_checked(monkeypatch, tmp_path):
    from epbench import cli

    def refused(*_args):
        raise AssertionError("default backends checked")

    monkeypatch.setattr(cli, "check_named_backends", refused)
    monkeypatch.setattr(cli.sys, "argv", ["epbench", "run", SMOKE])
    p = cli._plan("run", Path(SMOKE), device="cpu", results=tmp_path / "res")
    assert p.options.backends == ("reference", "epbench")
