"""`epbench overlap` at world 1 on one GPU, small sizes: every point verified (communication rows
and the GEMM's output from the concurrent window), the green context's SM count as the driver
reports it, and the table and plot written (marker gpu; skipped without a CUDA GPU). Both runs start
as the session's tests begin (gpu_launch.EARLY_RUNS), each on a GPU of its own where the host has two
(gpu_launch.GpuRuns):
nothing here checks a speed against a figure."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pandas as pd
from typing import Iterator

import pytest
from gpu_launch import EARLY_RUNS, GpuRuns

torch = pytest.importorskip("torch")

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(GPUS < 1, reason="needs a CUDA GPU")]

SCENARIO = """
model: {hidden: 2048, tokens_per_rank: 1024, topk: 4, experts_per_rank: 8, dispatch_dtype: bf16}
topology: {nodes: 1, gpus_per_node: 1}
routing: {kind: uniform, seed: 3}
bench: {warmup: 2, iters: 6, backends: [reference, epbench], sms: [8], device: cuda}
"""


GEMMS = ["2048,2048,2048", "experts:512"]


def overlap_run(gemm: str):
    def command(folder: Path) -> list:
        path = folder / "overlap.yaml"
        path.write_text(SCENARIO)
        return [sys.executable, "-m", "epbench", "overlap", str(path), "--sms", "8,16", "--gemm", gemm,
                "--results", str(folder / "r")]
    return command


def _runs(base: Path) -> GpuRuns:
    return GpuRuns(base, {gemm: overlap_run(gemm) for gemm in GEMMS})


EARLY_RUNS.add(__file__, _runs, "runs")


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GpuRuns]:
    with EARLY_RUNS.set_of(__file__, tmp_path_factory) as runs:
        yield runs


@pytest.mark.parametrize("gemm", GEMMS)
def test_overlap_world_1(runs: GpuRuns, gemm: str) -> None:
    r, folder = runs.get(gemm)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    (run,) = list((folder / "r").iterdir())
    df = pd.read_csv(run / "results.csv")
    meta = json.loads((run / "meta.json").read_text())
    total = torch.cuda.get_device_properties(0).multi_processor_count
    assert meta["status"] == "complete" and meta["verb"] == "overlap"
    assert set(df["backend"]) >= {"reference", "copy"}
    assert set(meta["backend_runtime"]) == {"reference", "epbench"}  # one job: neither needs a DeepEP flavor
    assert len(df[df["backend"] == "copy"]) == 2  # once per SM count (world 1)
    assert int(df["wrong"].sum()) == 0 and int(df["gemm_wrong"].sum()) == 0
    part = df[df["sms"] > 0]
    assert (part["gemm_sms"] <= total - part["sms"] + 8).all()  # the driver's partition granularity
    assert (part["gemm_sms"] < total).all()
    assert (df["gemm_kept_pct"] > 0).all() and (df["comm_kept_pct"] > 0).all()
    # the window GEMM (as many as the pair ran) and the clocks NVML read in each phase (epbench/clocks.py)
    assert (df["gemm_window_us"] > 0).all() and (df["gemm_kept_of_window_pct"] > 0).all()
    assert (df["gemm_before_us"] > 0).all() and (df["gemm_kept_of_around_pct"] > 0).all()
    assert (df["pair_sm_mhz"] > 0).all() and (df["gemm_window_sm_mhz"] > 0).all() and (df["gemm_clock_kept_pct"] > 0).all()
    assert "SM clock and power (NVML)" in r.stdout
    assert "SMs and HBM only" in r.stdout
    # overlap aligns with a one-element all-reduce unless EPBENCH_ALIGN says otherwise (overlap.OVERLAP_ALIGN)
    assert meta["overlap"]["alignment"] == "allreduce" and "NCCL allreduce" in r.stdout
    assert (run / "plots" / "overlap_vs_sms.png").is_file()
