"""Hybrid-EP (hybrid-ep) through `epbench run` on one GPU, after `make baselines
DEEPEP_FLAVOR=hybrid-ep DEEPEP_SRC=...`: bf16 and fp8 at world 1, and bf16 with 2 ranks sharing the
GPU (its code refuses neither: epbench/backends/hybrid_ep.py), each verified (#wrong 0)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from epbench import baselines
from epbench.results import load_run
from gpu_launch import ROOT, safe_env, shares_gpus

pytestmark = shares_gpus()

QUICK = ["--iters", "5", "--warmup", "1", "--no-ceilings"]


@pytest.fixture(scope="module")
def built() -> None:
    build = baselines.versions().get("deep_ep_build")
    if not isinstance(build, dict) or build.get("flavor") != "hybrid-ep":
        pytest.skip("Hybrid-EP is not built here (make baselines DEEPEP_FLAVOR=hybrid-ep)")


def _run(tmp_path: Path, scenario_file: str, nproc: int, backends: str):
    """`epbench run` on GPU 0; the hybrid-ep rows of its results (it must not have been skipped)."""
    env = dict(safe_env(), CUDA_VISIBLE_DEVICES="0")
    r = subprocess.run([sys.executable, "-m", "epbench", "run", f"scenarios/{scenario_file}", "--nproc",
                        str(nproc), "--backends", backends, *QUICK, "--results", str(tmp_path / "r")],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    assert "backend hybrid-ep skipped" not in r.stdout, r.stdout[-4000:]
    (run,) = list((tmp_path / "r").iterdir())
    df = load_run(run)[1]
    rows = df[df["backend"] == "hybrid-ep"]
    assert set(rows["op"]) == {"dispatch", "combine"}, r.stdout[-4000:]
    return rows, r.stdout[-4000:]


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
    assert set(rows["op"]) == {"dispatch", "combine"} and int(rows["wrong"].sum()) == 0, log
