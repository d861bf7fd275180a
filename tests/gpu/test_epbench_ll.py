"""GPU checks of the low-latency kernels (backend epbench-ll): tests/gpu/ll_worker.py checks every edge
case against epbench.verify and the NCCL reference (launches and CUDA-graph replays) and a missing
peer against the timeout, and the combine's two push orders against each other (bit-equal), for both
ll_sync values on 2 and 4 ranks: one launch per world size for all of them, shared with
test_epbench_kernels' suites of that world (gpu_launch.KERNEL_SUITES); each test reads its own
suite's line. Then the whole pipeline through `epbench sweep --tokens` with both backends, every
timing verified, and at world 1 the chain rows (K calls per op in one graph)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from typing import Iterator, Optional

import pytest
from epbench.results import load_run
from gpu_launch import EARLY_RUNS, GPUS, KERNEL_SUITES, GpuRuns, ll_kernels_built, shared, shares_gpus, world

torch = pytest.importorskip("torch")

pytestmark = shares_gpus()

SYNCS = ["grid", "token"]
for _nproc in (2, 4):
    for _sync in SYNCS:
        KERNEL_SUITES.add(_nproc, "ll", f"ll-check-{_sync}",
                          ["check", "--sync", _sync, *(["--quick"] if _nproc == 2 or shared(_nproc) else [])],
                          when=ll_kernels_built)
    for _sync in SYNCS:
        KERNEL_SUITES.add(_nproc, "ll", f"ll-orders-{_sync}",
                          ["orders", "--sync", _sync, *(["--quick"] if shared(_nproc) else [])], when=ll_kernels_built)
    KERNEL_SUITES.add(_nproc, "ll", "ll-lines", ["lines", "--sync", "token"], when=ll_kernels_built)


@pytest.fixture(scope="module")
def built(kernels_built: None) -> None:
    if not ll_kernels_built():
        pytest.skip("low-latency kernels not built: the epbench library has no ep_ll_create (make build)")


@pytest.mark.parametrize("sync", SYNCS)
@pytest.mark.parametrize("nproc", [2, 4])
def test_ll_kernels_match_verification(built: None, nproc: int, sync: str) -> None:
    KERNEL_SUITES.assert_passed(nproc, f"suite ll-check-{sync} world={nproc}",
                                f"missing peer world={nproc} ll_sync={sync}")


@pytest.mark.parametrize("sync", SYNCS)
@pytest.mark.parametrize("nproc", [2, 4])
def test_combine_push_orders_give_bit_equal_outputs(built: None, nproc: int, sync: str) -> None:
    """combine_order rotated against source on the same dispatch, launched and replayed, every case
    (uneven and empty batches included: the rotated order skips units past a short rank's tokens);
    with token sync also dispatch_units chunk, combine_release batch and dispatch_place slot (every dispatch
    verified, the combines bit-equal)."""
    KERNEL_SUITES.assert_passed(nproc, f"suite ll-orders-{sync} world={nproc}")


@pytest.mark.parametrize("nproc", [2, 4])
def test_line_placement_never_reads_a_torn_line(built: None, nproc: int) -> None:
    """dispatch_place line, many calls, each after an inline one and with fresh token values, at 4 and 32 SMs:
    every dispatch and combine verified. The same loop found hundreds of wrong rows with 128-byte lines on 2 x H200
    (notes/LATENCY-NEXT.md); it checks the 64-byte lines' assumption on every machine the suite runs on."""
    KERNEL_SUITES.assert_passed(nproc, f"suite ll-lines world={nproc}")


def test_stand_in_expert_synchronises_the_host_only_on_its_first_call(monkeypatch: pytest.MonkeyPatch) -> None:
    """The untimed fill between every timed dispatch and combine (verify.ll_expert_output,
    em_expert_output): after the first call it makes no synchronising CUDA call; EPBENCH_FILL_SYNC=1
    (the uncached factors) makes one every call, which this check must see."""
    from epbench import verify
    from epbench.layout import ExpertMajor

    dev = torch.device("cuda", torch.cuda.current_device())
    x = torch.randn(4, 8, 256, device=dev).to(torch.float8_e4m3fn)
    scales = torch.rand(4, 8, 2, device=dev)
    table = ExpertMajor(torch.tensor([3, 2], device=dev), torch.tensor([0, 4], device=dev), 8, 4)

    def fills() -> None:
        verify.ll_expert_output(x, scales, 8)
        verify.em_expert_output(x[0], scales[0], table, 8)

    for sync in (False, True):
        monkeypatch.setattr(verify, "_factors", {})
        monkeypatch.setattr(verify, "_fill_sync", sync)
        fills()  # the first call makes the factors
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            if sync:
                with pytest.raises(RuntimeError, match="synchroniz"):
                    fills()
            else:
                fills()
        finally:
            torch.cuda.set_sync_debug_mode(0)
        torch.cuda.synchronize()


SCENARIO = """
mode: low_latency
model: {{hidden: 7168, tokens_per_rank: 128, topk: 8, experts_per_rank: {epr}, dispatch_dtype: {dtype}}}
topology: {{nodes: 1, gpus_per_node: {world}}}
routing: {{kind: {routing}, seed: 3}}
bench: {{warmup: 3, iters: 10, backends: [reference, epbench-ll], sms: [8, 32], device: cuda}}
"""
SWEEPS = [("fp8", "uniform"), ("bf16", "hot")]


def sweep_tokens(dtype: str, routing: str, sync: str):
    def command(folder: Path) -> list:
        path = folder / f"ll-{dtype}.yaml"
        path.write_text(SCENARIO.format(epr=256 // world(), dtype=dtype, routing=routing, world=world()))
        return [sys.executable, "-m", "epbench", "sweep", str(path), "--tokens", "1,32,128",
                "--option", f"epbench-ll.ll_sync={sync}", "--results", str(folder / "r")]
    return command


def corrupted(folder: Path) -> list:
    path = folder / "ll-fault.yaml"
    path.write_text(SCENARIO.format(epr=8, dtype="bf16", routing="uniform", world=world()))
    return [sys.executable, "-m", "epbench", "run", str(path), "--backends", "epbench-ll",
            "--inject-fault", "dispatch", "--results", str(folder / "r")]


def chain_sweep(sync: str):
    def command(folder: Path) -> list:
        path = folder / "ll-chain.yaml"
        path.write_text(SCENARIO.format(epr=64, dtype="fp8", routing="uniform", world=1))
        return [sys.executable, "-m", "epbench", "sweep", str(path), "--tokens", "1,128", "--backends", "epbench-ll",
                "--graph-chain", "4", "--no-ceilings", "--option", f"epbench-ll.ll_sync={sync}",
                "--results", str(folder / "r")]
    return command


def _pipeline_runs(base: Path) -> Optional[GpuRuns]:
    """Every `epbench` run of the tests below: the token sweeps of both dtypes and syncs and the
    corrupted run on world() ranks, two of them at a time on each GPU (they check what a run verifies
    and prints, never a time: the GPU time-slices between them), and the world-1 chain sweeps of both
    syncs on a GPU each. Started as the session's tests begin (gpu_launch.EARLY_RUNS): one after
    another the sweeps took most of this module's time on 4 x H200 (2026-11-27)."""
    if not ll_kernels_built():
        return None
    ranks_gpus = min(world(), max(GPUS, 1))
    runs = {f"sweep/{d}/{r}/{s}": sweep_tokens(d, r, s) for d, r in SWEEPS for s in SYNCS}
    runs["corrupted"] = corrupted
    runs.update({f"chain/{s}": chain_sweep(s) for s in SYNCS})
    gpus = {name: (1 if name.startswith("chain/") else ranks_gpus) for name in runs}
    return GpuRuns(base, runs, gpus=gpus, per_gpu=2, timeout=900)


EARLY_RUNS.add(__file__, _pipeline_runs, "pipeline_runs")


@pytest.fixture(scope="module")
def pipeline_runs(built: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[GpuRuns]:
    with EARLY_RUNS.set_of(__file__, tmp_path_factory) as started:
        yield started


@pytest.mark.parametrize("sync", SYNCS)
@pytest.mark.parametrize("dtype,routing", SWEEPS)
def test_sweep_tokens_verifies_both_timings(pipeline_runs: GpuRuns, dtype: str, routing: str, sync: str) -> None:
    ranks = world()
    r, folder = pipeline_runs.get(f"sweep/{dtype}/{routing}/{sync}")
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]

    (run,) = list((folder / "r").iterdir())
    df = load_run(run)[1]  # measured rows (skipped / failed ones aside)
    # the NCCL reference needs a GPU per rank; where ranks share one it is skipped with a note
    assert set(df["backend"]) == {"epbench-ll"} | (set() if shared(ranks) else {"reference"})
    assert shared(ranks) == ("backend reference skipped" in r.stdout)
    ll = df[df["backend"] == "epbench-ll"]
    assert set(ll["timing"]) == {"launch", "graph"}  # ranks > 1: no chain rows, and a note says why
    assert "backend epbench-ll: no chain rows" in r.stdout
    assert all(json.loads(o)["ll_sync"] == sync for o in ll["options"])  # what ran is recorded
    assert sorted(set(ll["tokens_per_rank"])) == [1, 32, 128]
    assert len(ll) == 3 * 2 * 2 * 2 * ranks  # tokens x SM counts x timings x ops x ranks
    assert int(df["wrong"].sum()) == 0
    assert (df["time_us_p99"] >= df["time_us"]).all()
    assert "p99 us" in r.stdout


def test_corrupted_ll_output_fails(pipeline_runs: GpuRuns) -> None:
    r, _ = pipeline_runs.get("corrupted")
    assert r.returncode != 0
    assert "VERIFICATION FAILED" in r.stdout


@pytest.mark.parametrize("sync", SYNCS)
def test_world_1_chain_rows_are_verified_and_labelled(pipeline_runs: GpuRuns, sync: str) -> None:
    """At world 1 a third timing: 4 back-to-back calls per op in one graph, the last call's output
    verified; rows say chain 4 and the table 'graph x4'; the floor line names both figures."""
    r, folder = pipeline_runs.get(f"chain/{sync}")
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    (run,) = list((folder / "r").iterdir())
    meta, df = load_run(run)
    assert meta["options"]["graph_chain"] == 4
    assert set(df["timing"]) == {"launch", "graph", "chain"}
    assert set(df[df["timing"] == "chain"]["chain"]) == {4} and set(df[df["timing"] != "chain"]["chain"]) == {1}
    assert len(df) == 2 * 2 * 3 * 2  # tokens x SM counts x timings x ops (one rank)
    assert int(df["wrong"].sum()) == 0
    assert "graph x4" in r.stdout and "in-graph" in r.stdout
