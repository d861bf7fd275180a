"""GPU checks of the low-latency kernels (backend epbench-ll): torchrun starts
tests/gpu/ll_worker.py, which checks every edge case against epbench.verify and the NCCL
reference (launches and CUDA-graph replays) and a missing peer against the timeout; then the
whole pipeline through `epbench sweep --tokens` with both backends, both timings verified."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from epbench.results import load_run
from gpu_launch import ROOT, safe_env, shared, shares_gpus, torchrun, world

torch = pytest.importorskip("torch")

WORKER = ROOT / "tests" / "gpu" / "ll_worker.py"

pytestmark = shares_gpus()


@pytest.fixture(scope="module")
def built() -> None:
    from epbench import cuda_lib

    try:
        cuda_lib.load().ep_ll_create
    except (RuntimeError, AttributeError) as e:
        pytest.skip(f"low-latency kernels not built: {e}")


@pytest.mark.parametrize("sync", ["grid", "token"])
@pytest.mark.parametrize("nproc", [2, 4])
def test_ll_kernels_match_verification(built: None, nproc: int, sync: str) -> None:
    r = torchrun(WORKER, nproc, "check", "--sync", sync, *(["--quick"] if nproc == 2 or shared(nproc) else []))
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-6000:]
    assert "PASS" in r.stdout


SCENARIO = """
mode: low_latency
model: {{hidden: 7168, tokens_per_rank: 128, topk: 8, experts_per_rank: {epr}, dispatch_dtype: {dtype}}}
topology: {{nodes: 1, gpus_per_node: {world}}}
routing: {{kind: {routing}, seed: 3}}
bench: {{warmup: 3, iters: 10, backends: [reference, epbench-ll], sms: [8, 32], device: cuda}}
"""


@pytest.mark.parametrize("sync", ["grid", "token"])
@pytest.mark.parametrize("dtype,routing", [("fp8", "uniform"), ("bf16", "hot")])
def test_sweep_tokens_verifies_both_timings(built: None, tmp_path: Path, dtype: str, routing: str, sync: str) -> None:
    ranks = world()
    path = tmp_path / f"ll-{dtype}.yaml"
    path.write_text(SCENARIO.format(epr=256 // ranks, dtype=dtype, routing=routing, world=ranks))
    r = subprocess.run([sys.executable, "-m", "epbench", "sweep", str(path), "--tokens", "1,32,128",
                        "--option", f"epbench-ll.ll_sync={sync}", "--results", str(tmp_path / "r")], cwd=ROOT, env=safe_env(),
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    import pandas as pd

    (run,) = list((tmp_path / "r").iterdir())
    df = load_run(run)[1]  # measured rows (skipped / failed ones aside)
    # the NCCL reference needs a GPU per rank; where ranks share one it is skipped with a note
    assert set(df["backend"]) == {"epbench-ll"} | (set() if shared(ranks) else {"reference"})
    assert shared(ranks) == ("backend reference skipped" in r.stdout)
    ll = df[df["backend"] == "epbench-ll"]
    assert set(ll["timing"]) == {"launch", "graph"}
    assert all(json.loads(o)["ll_sync"] == sync for o in ll["options"])  # what ran is recorded
    assert sorted(set(ll["tokens_per_rank"])) == [1, 32, 128]
    assert len(ll) == 3 * 2 * 2 * 2 * ranks  # tokens x SM counts x timings x ops x ranks
    assert int(df["wrong"].sum()) == 0
    assert (df["time_us_p99"] >= df["time_us"]).all()
    assert "p99 us" in r.stdout


def test_corrupted_ll_output_fails(built: None, tmp_path: Path) -> None:
    path = tmp_path / "ll-fault.yaml"
    path.write_text(SCENARIO.format(epr=8, dtype="bf16", routing="uniform", world=world()))
    r = subprocess.run([sys.executable, "-m", "epbench", "run", str(path), "--backends", "epbench-ll",
                        "--inject-fault", "dispatch", "--results", str(tmp_path / "r")],
                       cwd=ROOT, env=safe_env(), capture_output=True, text=True, timeout=600)
    assert r.returncode != 0
    assert "VERIFICATION FAILED" in r.stdout
