"""The probe's table arithmetic (epbench/llprobe.py), its options and its results folder; the GPU
part runs on the device machine (tests/gpu/test_llprobe_gpu.py)."""

from __future__ import annotations

import csv
import os
from pathlib import Path

import pytest

from epbench import llprobe, plan
from epbench.errors import UserError
from epbench.results import RunWriter, load_run
from support import epbench_here


def _block(start: int, *marks: int) -> list:
    # LlStamp order: start, staged, sent, released, waited, received, end, (unused)
    return [start, *marks, 0]


def test_parts_add_up_to_the_span_over_the_whole_grid() -> None:
    blocks = [_block(1000, 1500, 3000, 3200, 5000, 6000, 7000),
              _block(1400, 1600, 2500, 4000, 5100, 6500, 6800)]
    p = llprobe.call_parts(blocks)
    # first start 1000; then the last block past each boundary: 1600, 3000, 4000, 5100, 6500, 7000
    assert p["stage"] == pytest.approx(0.6)
    assert p["send"] == pytest.approx(1.4)
    assert p["release"] == pytest.approx(1.0)
    assert p["wait"] == pytest.approx(1.1)
    assert p["receive"] == pytest.approx(1.4)
    assert p["finish"] == pytest.approx(0.5)
    assert p["span"] == pytest.approx(6.0)
    assert sum(p[k] for k in llprobe.PARTS) == pytest.approx(p["span"])
    assert p["skew"] == pytest.approx(0.4)


def test_probe_parts_use_start_sent_and_end() -> None:
    blocks = [_block(0, 0, 800, 0, 0, 0, 2000), _block(300, 0, 1100, 0, 0, 0, 1500)]
    assert llprobe.probe_parts(blocks) == {"span": pytest.approx(2.0), "a": pytest.approx(1.1)}


def test_percentile_interpolates_and_summary_reports_outside_the_stamps() -> None:
    assert llprobe.percentile([4.0, 1.0, 3.0, 2.0], 50) == pytest.approx(2.5)
    assert llprobe.percentile([1.0, 2.0], 100) == 2.0
    per_call = [{"span": 5.0, "a": 1.0}, {"span": 6.0, "a": 2.0}, {"span": 7.0, "a": 3.0}]
    row = llprobe.summarize(per_call, [8.0, 9.0, 100.0])
    assert row["call_p50"] == 9.0 and row["call_max"] == 100.0
    assert row["span_p50"] == 6.0 and row["a_p99"] == pytest.approx(2.98)
    assert row["outside_p50"] == 3.0  # per call: 3, 3, 93


def _probe_folder(path: Path, rows: list, **meta) -> Path:
    """A probe run's folder as the engine writes it (RunWriter, then the status)."""
    w = RunWriter(path, dict({"verb": "probe", "world": 1, "scenario": {"name": "probe"}, "probe": {}}, **meta))
    w.add(rows, [])
    w.finish("complete")
    return path


def test_table_and_csv(tmp_path) -> None:
    rows = [{"sms": 32, "op": "dispatch", "tokens": 1, "variant": "default", "wrong": 0, "call_p50": 4.5,
             "span_p50": float("nan")},
            {"sms": 32, "op": "probe", "tokens": "", "variant": "timer", "wrong": "", "a_p50": 32.0,
             "timer_step_ns": 32}]
    text = llprobe.format_table(rows).splitlines()
    assert len(text) == 3 and "call" in text[0] and "4.50" in text[1] and "32.00" in text[2]
    run = _probe_folder(tmp_path / "run", rows)
    path = llprobe.write_csv(run, tmp_path / "p.csv")
    got = list(csv.DictReader(path.open()))
    assert float(got[1]["timer_step_ns"]) == 32 and got[0]["call_p50"] == "4.5"
    assert got[0]["wrong"] == "0" and got[1]["wrong"] == "" and got[0]["tokens"] == "1"
    # the table read back from the folder is the table printed while measuring
    assert llprobe.format_table(llprobe.table_rows(load_run(run)[1])).splitlines() == text


def test_unknown_variant_is_one_line_and_exit_2() -> None:
    r = epbench_here("probe", "--variants", "default,nope")
    assert r.code == 2 and "nope" in r.both and len(r.both.strip().splitlines()) == 1


def test_a_chain_divides_the_event_pair_by_its_calls() -> None:
    assert llprobe.per_call_us([8.0, 20.0], 8) == [1.0, 2.5]
    assert llprobe.per_call_us([3.0], 1) == [3.0]


def _two_ranks() -> tuple:
    """Two ranks, two calls each, two blocks per rank; rank 1 starts 2 us after rank 0."""
    r0 = [[_block(1000, 1500, 3000, 3200, 5000, 6000, 7000), _block(1200, 1600, 2500, 4000, 5100, 6500, 6800)],
          [_block(0, 100, 200, 300, 400, 500, 600), _block(50, 150, 250, 350, 450, 550, 650)]]
    r1 = [[_block(3000, 3100, 3300, 3500, 5200, 5900, 9000), _block(3500, 3600, 3700, 3800, 5300, 6000, 8500)],
          [_block(100, 200, 300, 400, 500, 600, 1700), _block(400, 500, 600, 700, 800, 900, 1000)]]
    return r0, r1


def test_several_ranks_parts_cover_every_rank_and_call_is_the_slowest_rank() -> None:
    r0, r1 = _two_ranks()
    merged = llprobe.merge_ranks([r0, r1])
    assert len(merged) == 2 and len(merged[0]) == 4 and merged[0][2] == r1[0][0]
    p = llprobe.call_parts(merged[0])
    # first start of any rank 1000; last past each boundary over both ranks: 3600 3700 4000 5300 6500 9000
    assert p["stage"] == pytest.approx(2.6) and p["finish"] == pytest.approx(2.5)
    assert p["span"] == pytest.approx(8.0) and p["skew"] == pytest.approx(2.5)
    assert llprobe.rank_skew_us([r0[0], r1[0]]) == pytest.approx(2.0)  # 3000 - 1000
    row = llprobe.summarize_ranks([r0, r1], [[10.0, 12.0], [11.0, 30.0]], llprobe.call_parts)
    assert row["ranks"] == 2 and row["slow_rank"] == 1
    assert row["call_p50_rank0"] == pytest.approx(11.0) and row["call_p50_rank1"] == pytest.approx(20.5)
    assert row["call_p50"] == pytest.approx(20.5) and row["call_max"] == 30.0  # rank 1's samples
    assert row["span_p50"] == pytest.approx((8.0 + 1.7) / 2)
    assert row["rank_skew_p50"] == pytest.approx((2.0 + 0.1) / 2)
    assert row["outside_p50"] == pytest.approx(((11.0 - 8.0) + (30.0 - 1.7)) / 2)


def test_one_rank_is_the_old_summary() -> None:
    r0, _ = _two_ranks()
    row = llprobe.summarize_ranks([r0], [[10.0, 12.0]], llprobe.call_parts)
    old = llprobe.summarize([llprobe.call_parts(b) for b in r0], [10.0, 12.0])
    assert row == {**old, "ranks": 1}


def test_spread_ranks_keep_their_own_clocks_and_show_the_slowest() -> None:
    """One GPU per rank: rank 1's stamps sit 500 ms off rank 0's (another GPU's clock); each rank's
    parts come from its own blocks, the row is the slowest rank's, no skew between ranks."""
    r0, r1 = _two_ranks()
    far = [[[v + 500_000_000 for v in b] for b in call] for call in r1]
    row = llprobe.summarize_spread([r0, far], [[10.0, 12.0], [11.0, 30.0]], llprobe.call_parts)
    own1 = llprobe.summarize([llprobe.call_parts(b) for b in far], [11.0, 30.0])
    own0 = llprobe.summarize([llprobe.call_parts(b) for b in r0], [10.0, 12.0])
    assert row["slow_rank"] == 1 and row["ranks"] == 2 and "rank_skew_p50" not in row
    assert {k: row[k] for k in own1} == own1  # rank 1's figures, unmoved by its clock's offset
    assert row["span_p50"] == pytest.approx(own1["span_p50"]) and row["span_p50"] < 1000
    assert row["span_p50_rank0"] == own0["span_p50"] and row["wait_p50_rank1"] == own1["wait_p50"]
    assert row["call_p50_rank0"] == pytest.approx(11.0) and row["call_p50_rank1"] == pytest.approx(20.5)
    probe = llprobe.summarize_spread([r0, far], [[1.0, 1.0], [2.0, 2.0]], llprobe.probe_parts)
    assert "wait_p50_rank0" not in probe and probe["span_p50_rank1"] == probe["span_p50"]


def test_spread_needs_ranks_and_is_in_the_header() -> None:
    assert llprobe.probe_options("1", "32", 7168, 8, 64, "fp8", "grid", 1, 1, "1", 4, spread=True).spread
    info = {"device": "H200", "world": 4, "spread": True, "chains": [1],
            "kernels": {"token": {"combine_order": "rotated", "dispatch_units": "chunk", "dispatch_place": "slot",
                                  "combine_release": "unit"},
                        "token-line": {"dispatch_place": "line", "dispatch_units": "row"}}}
    line = llprobe.header_line(info)
    assert "world 4: one GPU per rank" in line
    assert ("combine order rotated, token dispatch units chunk, place slot, release unit, "
            "token-line: dispatch_place line dispatch_units row") in line
    sized = llprobe.header_line({**info, "sized_tokens": 128})
    assert "release unit (resolved once, at 128 tokens, for every row), token-line" in sized


def test_tuned_rows_set_their_options_and_every_other_token_row_the_backends_own() -> None:
    """A token variant after token-line runs with the backend's own units and placement again (a small buffer's
    chunk / inline), never with line's row units; the header names a tuned variant's options."""
    own = {"dispatch_units": "chunk", "dispatch_place": "inline", "warps": 16}
    assert llprobe.tuned_options("token-line", own) == [
        ("dispatch_units", "row"), ("dispatch_place", "line")]  # units before place
    for after in ("token", "token-warps4"):
        assert llprobe.tuned_options(after, own) == [("dispatch_units", "chunk"), ("dispatch_place", "inline")]
    assert llprobe.tuned_label("token-line", dict(own, dispatch_place="line", dispatch_units="row")) == \
        "dispatch_place line dispatch_units row"


def test_ranks_must_have_the_same_calls() -> None:
    r0, r1 = _two_ranks()
    with pytest.raises(ValueError):
        llprobe.merge_ranks([r0, r1[:1]])


def test_default_table_keeps_its_columns_and_extras_come_last() -> None:
    old = ["sms", "op", "tokens", "variant", "wrong", "call", "p99", "max", "outside", "span", "skew",
           *llprobe.PARTS, "partA"]
    assert llprobe.extra_columns([1], 1) == []
    assert llprobe.format_table([], llprobe.extra_columns([1], 1)).split() == old
    assert llprobe.format_table([], llprobe.extra_columns([1, 8], 1)).split() == old + ["chain"]
    extra = llprobe.extra_columns([1], 4)
    row = {"sms": 32, "op": "dispatch", "tokens": 1, "variant": "grid", "wrong": 0, "call_p50": 9.0,
           "ranks": 4, "slow_rank": 3, "rank_skew_p50": 1.25}
    head, line = llprobe.format_table([row], extra).splitlines()
    assert head.split()[-3:] == ["ranks", "slow", "rskew"] and line.split()[-3:] == ["4", "3", "1.25"]


def test_csv_puts_the_new_columns_after_the_old(tmp_path) -> None:
    rows = [{"sms": 32, "op": "probe", "variant": "empty", "wrong": "", "call_p50": 1.0, "ranks": 1, "chain": 8},
            {"sms": 32, "op": "probe", "variant": "timer", "wrong": "", "call_p50": 1.0, "ranks": 2,
             "rank_skew_p50": 0.5, "call_p50_rank1": 1.0, "timer_step_ns": 32, "chain": 1}]
    path = llprobe.write_csv(_probe_folder(tmp_path / "run", rows), tmp_path / "p.csv")
    head = path.read_text().splitlines()[0].split(",")
    assert head == ["sms", "op", "variant", "wrong", "call_p50", "timer_step_ns", "ranks", "chain",
                    "rank_skew_p50", "call_p50_rank1"]


def test_the_ranks_read_every_option_from_the_plan(tmp_path) -> None:
    """What `epbench probe` hands its ranks: every option in the plan (the launcher's own, --nproc
    and --mps, as the plan's ranks per node and MPS), read back equal."""
    o = llprobe.probe_options("1,32", "32", 7168, 8, 64, "fp8", "token", 0, 7, "1", 4)
    assert o.tokens == (1, 32) and o.sms == (32,) and o.variants == ("token",) and o.iters == 7
    s = llprobe.probe_scenario(o, 4)
    assert s.world == 4 and s.mode == "low_latency" and s.model.tokens_per_rank == 32
    p = plan.Plan(verb="probe", scenario=s, options=o, device="cuda", argv=("probe",), results=tmp_path,
                  run_dir=tmp_path, mps=True, ranks_per_node=4)
    back = plan.read(plan.write(p, tmp_path))
    assert back == p and back.job_options(0) == o


def test_ranks_share_the_first_visible_gpu() -> None:
    assert llprobe.one_gpu(None) == "0"
    assert llprobe.one_gpu("3,5") == "3"
    assert llprobe.one_gpu("GPU-ab12, GPU-cd34") == "GPU-ab12"


@pytest.mark.parametrize("argv, says", [
    (["--chain", "0"], "--chain"),
    (["--chain", "1,x"], "--chain"),
    (["--nproc", "0"], "--nproc"),
    (["--nproc", "2", "--chain", "1,8"], "buffer reuse"),
    (["--dtype", "fp4"], "--dtype"),
    (["--iters", "0"], "--iters"),
    (["--spread"], "--nproc 2 or more"),
    (["--spread", "--nproc", "2", "--mps"], "--mps"),
])
def test_bad_chain_or_nproc_is_one_line_and_exit_2(argv, says) -> None:
    r = epbench_here("probe", *argv)
    assert r.code == 2
    assert says in r.both and len(r.both.strip().splitlines()) == 1


def test_a_chain_of_one_rank_and_one_chain_with_ranks_are_accepted() -> None:
    assert llprobe.probe_options("1", "32", 7168, 8, 64, "fp8", "grid", 1, 1, "1,8", 1).chain == (1, 8)
    assert llprobe.probe_options("1", "32", 7168, 8, 64, "fp8", "grid", 1, 1, "1", 4).chain == (1,)


def test_nproc_launches_the_probe_on_one_gpu(monkeypatch, tmp_path) -> None:
    """--nproc 3: one torchrun job of 3 ranks on the first visible GPU, each reading the plan in
    the run folder (the rank entry point, no command line of its own)."""
    import torch
    import typer

    from epbench import cli, launch

    seen = {}

    def fake_job(torchrun, device, error_dir=None):
        seen.update(torchrun=torchrun, visible=os.environ.get("CUDA_VISIBLE_DEVICES"),
                    plan=plan.read(Path(torchrun[-2])))
        return launch.Outcome("complete")

    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(launch, "run_job", fake_job)
    with pytest.raises(typer.Exit) as e:
        cli.probe(tokens="1", sms="32", hidden=7168, topk=8, experts_per_rank=64, dtype="fp8", variants=None,
                  warmup=1, iters=2, chain="1", nproc=3, spread=False, mps=False, csv=None, results=tmp_path / "r",
                  run_dir=None)
    assert e.value.exit_code == 0
    assert seen["visible"] == "2" and os.environ["CUDA_VISIBLE_DEVICES"] == "2,3"
    t = seen["torchrun"]
    assert "--nproc-per-node=3" in t and t[t.index("-m") + 1] == "epbench.rank" and t[-1] == "0"
    p = seen["plan"]
    assert p.verb == "probe" and p.options.tokens == (1,) and p.scenario.world == 3
    assert p.options.variants == tuple(llprobe.DEFAULT_VARIANTS.split(","))
    assert not (tmp_path / "r").exists() or not any((tmp_path / "r").iterdir())  # nothing measured: no folder


def test_report_prints_a_probe_folder_as_the_probe_did(tmp_path) -> None:
    rows = [{"sms": 32, "op": "dispatch", "tokens": 1, "variant": "grid", "wrong": 0, "call_p50": 4.5,
             "chain": 1}]
    info = {"device": "H100", "world": 1, "hidden": 7168, "topk": 8, "experts": 64, "dtype": "fp8",
            "iters": 5, "warmup": 2, "warps": 16, "chains": [1]}
    run = _probe_folder(tmp_path / "run", rows, probe=info)
    r = epbench_here("report", str(run))
    assert r.code == 0, r.both
    assert llprobe.header_line(info) in r.out and llprobe.format_table(rows).splitlines()[1] in r.out
    plotted = epbench_here("plot", str(run))
    assert plotted.code == 2 and "draws no plot" in plotted.both
    compared = epbench_here("compare", str(run), str(run))
    assert compared.code == 2 and "compare reads run and sweep" in compared.both


def test_every_variant_names_a_sync_and_warps_the_kernels_take() -> None:
    from epbench.backends.epbench_ll import SYNCS

    assert set(llprobe.DEFAULT_VARIANTS.split(",")) <= set(llprobe.VARIANTS)
    for name, (warps, sync) in llprobe.VARIANTS.items():
        assert sync in SYNCS, name
        assert warps is None or 2 <= warps <= 16, name  # ll_check_launch: warps 2..16
    # ep_ll_probe: modes 0..6, the pings (5, 6) only with several ranks
    assert sorted(list(llprobe.PROBE_MODES.values()) + list(llprobe.PING_MODES.values())) == list(range(7))


def test_skipping_variants_are_token_dispatches_with_the_kernels_bits() -> None:
    """token-noown / token-norecv / token-peers / the nofence ones: token-sync variants whose bits are LlProbeSkip's;
    the tuned one (token-line) a token-sync variant with option values the backend knows."""
    from pathlib import Path

    from epbench.backends.epbench_ll import PLACES, UNITS, EpbenchLowLatencyBackend

    assert set(llprobe.SKIPS) <= set(llprobe.VARIANTS)
    assert all(llprobe.VARIANTS[v][1] == "token" for v in llprobe.SKIPS)
    assert not set(llprobe.SKIPS) & set(llprobe.DEFAULT_VARIANTS.split(","))  # only when asked for
    header = (Path(__file__).resolve().parents[1] / "csrc" / "ll_common.cuh").read_text()
    assert ("enum LlProbeSkip { kLlSkipOwnRows = 1, kLlSkipReceive = 2, kLlSkipSmallStores = 4, kLlSkipFence = 8, "
            "kLlSkipAll = 15 };") in header
    assert not set(llprobe.SKIPS) & set(llprobe.TUNED)  # the tuned rows are verified
    choices = {"dispatch_place": PLACES, "dispatch_units": UNITS}
    assert all(llprobe.VARIANTS[v][1] == "token" and set(opts) <= set(llprobe.TUNABLE) and
               all(value in choices[k] for k, value in opts.items()) for v, opts in llprobe.TUNED.items())
    assert all(hasattr(EpbenchLowLatencyBackend, f"use_{k}") for k in llprobe.TUNABLE)
    assert llprobe.SKIPS == {"token-noown": 1, "token-norecv": 2, "token-peers": 1 | 2 | 4, "token-nofence": 8,
                             "token-peers-nofence": 1 | 2 | 4 | 8}


def test_probe_refuses_a_line_placement_that_would_get_chunk_units(monkeypatch):
    """The probe's backends read epbench-ll's options from the environment and resolve auto at the largest token
    count: line128 with chunk units (auto at <= 16 tokens) is one line before any rank starts, as in `run`."""
    monkeypatch.setenv("EPBENCH_LL_DISPATCH_PLACE", "line128")
    monkeypatch.setenv("EPBENCH_LL_SYNC", "grid")  # the probe's token rows run token sync whatever it says
    with pytest.raises(UserError, match="epbench probe: epbench-ll.dispatch_place=line128 .*: set "
                                        "EPBENCH_LL_DISPATCH_UNITS=row$") as e:
        llprobe.probe_options("1,8", "32", 7168, 8, 64, "fp8", "grid,token", 1, 1, "1", 4)
    assert "--option" not in str(e.value)
    assert llprobe.probe_options("1,32", "32", 7168, 8, 64, "fp8", "token", 1, 1, "1", 4).tokens == (1, 32)
    # no token-sync variant: no backend that would refuse it is built
    assert llprobe.probe_options("1", "32", 7168, 8, 64, "fp8", "grid,warps4", 1, 1, "1", 4).tokens == (1,)
    monkeypatch.setenv("EPBENCH_LL_DISPATCH_UNITS", "row")
    assert llprobe.probe_options("1", "32", 7168, 8, 64, "fp8", "token", 1, 1, "1", 4).tokens == (1,)
