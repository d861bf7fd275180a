"""Hybrid-EP (hybrid-ep) through `epbench run`, after `make baselines DEEPEP_FLAVOR=hybrid-ep
DEEPEP_SRC=...`. On GPU 0: bf16 and fp8 at world 1, bf16 with 2 ranks sharing it (its code refuses
neither: epbench/backends/hybrid_ep.py), and expert_major. On a host with 2 or more GPUs: one rank
per GPU (up to 4), swept over two SM counts. Every run times both call modes (``call``: the whole
call; ``kernel``: the cached handle), each point verified (#wrong 0), and every row records the
block counts the library's handle says its kernels ran with, which must be the point's SM count."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Sequence

import pytest
from epbench.results import load_run
from gpu_launch import GPUS, ROOT, flavor_reachable, safe_env, shares_gpus

pytestmark = shares_gpus()

QUICK = ["--iters", "5", "--warmup", "1", "--no-ceilings", "--call-modes", "call,kernel"]


@pytest.fixture(scope="module")
def built() -> None:
    if not flavor_reachable("hybrid-ep"):
        pytest.skip("Hybrid-EP is not built here nor recorded in a venv (make baselines [VENV=...] "
                    "DEEPEP_FLAVOR=hybrid-ep)")


def _run(tmp_path: Path, scenario_file: str, nproc: int, backends: str, sms: Sequence[int] = (24,),
         gpu0: bool = True):
    """`epbench run` (on GPU 0 only where ``gpu0``); the hybrid-ep rows of its results, which must
    not have been skipped, hold both call modes at every SM count, and record the point's count
    as what ran."""
    env = dict(safe_env(), CUDA_VISIBLE_DEVICES="0") if gpu0 else safe_env()
    r = subprocess.run([sys.executable, "-m", "epbench", "run", f"scenarios/{scenario_file}", "--nproc",
                        str(nproc), "--backends", backends, "--sms", ",".join(map(str, sms)), *QUICK,
                        "--results", str(tmp_path / "r")],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    log = r.stdout[-4000:] + r.stderr[-4000:]
    assert r.returncode == 0, log
    assert "backend hybrid-ep skipped" not in r.stdout, log
    (run,) = list((tmp_path / "r").iterdir())
    df = load_run(run)[1]
    rows = df[df["backend"] == "hybrid-ep"]
    assert set(rows["op"]) == {"dispatch", "combine"}, log
    assert set(rows["call_mode"]) == {"call", "kernel"}, log
    assert sorted(set(int(n) for n in rows["sms"])) == sorted(sms), log
    for _, row in rows.iterrows():
        ran = json.loads(row["options"])
        assert ran["num_sms_dispatch"] == ran["num_sms_combine"] == int(row["sms"]), (row.to_dict(), log)
    return rows, log


@pytest.mark.parametrize("scenario_file, nproc", [("dsv3x2.yaml", 1), ("dsv3x4-fp8.yaml", 1),
                                                  ("dsv3x2.yaml", 2)])
def test_runs_verified(built: None, tmp_path: Path, scenario_file: str, nproc: int) -> None:
    rows, log = _run(tmp_path, scenario_file, nproc, "hybrid-ep,reference")
    assert int(rows["wrong"].sum()) == 0, log


@pytest.mark.parametrize("nproc", [1, 2])
def test_expert_major_verified(built: None, tmp_path: Path, nproc: int) -> None:
    """layout expert_major (dispatch_with_permute / combine_with_unpermute, align 128, fp8): the
    segments bit-exact, combine within its three bf16 roundings (HybridEPBackend.combine_roundings)."""
    rows, log = _run(tmp_path, "em-2gpu.yaml", nproc, "hybrid-ep")
    assert int(rows["wrong"].sum()) == 0, log


@pytest.mark.parametrize("scenario_file", ["dsv3x4.yaml", "h200x4-fp8.yaml", "em-2gpu.yaml"])
@pytest.mark.skipif(GPUS < 2, reason="needs >= 2 CUDA GPUs (one rank per GPU)")
def test_one_rank_per_gpu_sm_sweep(built: None, tmp_path: Path, scenario_file: str) -> None:
    """One rank per GPU (2 to 4), SM counts 8 and 24, both call modes: every point verified and
    recording its count; the times are printed (pytest -s) for a look beside Hybrid-EP's own test."""
    rows, log = _run(tmp_path, scenario_file, min(GPUS, 4), "hybrid-ep", sms=(8, 24), gpu0=False)
    assert int(rows["wrong"].sum()) == 0, log
    cols = [c for c in ("rank", "sms", "call_mode", "op", "time_us", "busbw_nvlink_gbps", "options") if c in rows]
    print(f"\n{scenario_file} on {min(GPUS, 4)} GPUs:\n{rows[cols].to_string(index=False)}")
