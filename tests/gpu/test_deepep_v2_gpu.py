"""DeepEP V2 (deepep-v2) through `epbench run`, after `make baselines DEEPEP_FLAVOR=v2
NCCL_CARRY=...`: at world 1 it runs verified with the NCCL it was built against preloaded into its
job only, in both layouts (expert_major through V2's expanding dispatch); ranks sharing the GPU get a
skipped row saying it needs one GPU per rank. On 2 and 4 GPUs (one rank each, gin off within the
node) both call modes run verified in both layouts: ``kernel`` times V2's cached handle."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from epbench.backends import deepep_v2_env
from epbench.results import load_run
from gpu_launch import ROOT, flavor_reachable, needs_gpus, safe_env, shares_gpus

pytestmark = shares_gpus()

QUICK = ["--sms", "16", "--iters", "5", "--warmup", "1"]


@pytest.fixture(scope="module")
def v2_built() -> None:
    if not flavor_reachable("deepep-v2"):
        pytest.skip("DeepEP V2 is not built here nor recorded in a venv (make baselines [VENV=...] DEEPEP_FLAVOR=v2 "
                    "NCCL_CARRY=...)")


def run_v2(tmp_path: Path, nproc: int, scenario: str = "scenarios/dsv3x2.yaml", gpus: int = 1,
           backends: str = "deepep-v2,reference", extra: tuple = ()):
    env = dict(safe_env(), CUDA_VISIBLE_DEVICES=",".join(map(str, range(gpus))))
    r = subprocess.run([sys.executable, "-m", "epbench", "run", scenario, "--nproc", str(nproc),
                        "--backends", backends, *QUICK, *extra, "--results", str(tmp_path / "r")],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    (run,) = list((tmp_path / "r").iterdir())
    return r, load_run(run)[1], json.loads((run / "meta.json").read_text())


def test_world_1_runs_verified_with_its_own_nccl(v2_built: None, tmp_path: Path) -> None:
    r, df, meta = run_v2(tmp_path, 1)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    v2 = df[df["backend"] == "deepep-v2"]
    assert set(v2["op"]) == {"dispatch", "combine"} and int(v2["wrong"].sum()) == 0
    runtime = meta["backend_runtime"]
    assert deepep_v2_env.version_tuple(runtime["deepep-v2"]["nccl"]) >= deepep_v2_env.MIN_NCCL
    if deepep_v2_env.v2_nccl():  # built against a carry: preloaded into its job, not the reference's
        assert runtime["deepep-v2"]["ld_preload"] and not runtime["reference"]["ld_preload"]


@pytest.mark.parametrize("scenario", ["scenarios/em-2gpu.yaml", "scenarios/dsv3x4-expert.yaml"])
def test_expert_major_world_1_runs_verified(v2_built: None, tmp_path: Path, scenario: str) -> None:
    """fp8 and mxfp8 segments aligned to 128 rows, checked as epbench's own expert-major layout."""
    r, df, _ = run_v2(tmp_path, 1, scenario)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    v2 = df[df["backend"] == "deepep-v2"]
    assert set(v2["op"]) == {"dispatch", "combine"} and int(v2["wrong"].sum()) == 0, r.stdout[-4000:]


def test_ranks_sharing_the_gpu_get_a_skipped_row(v2_built: None, tmp_path: Path) -> None:
    r, _, _ = run_v2(tmp_path, 2)
    assert "backend deepep-v2 skipped: needs 2 GPUs, one per rank" in r.stdout, r.stdout[-4000:]


@pytest.mark.parametrize("world, scenario", [
    pytest.param(2, "scenarios/dsv3x2.yaml", marks=needs_gpus(2, "one rank per GPU")),
    pytest.param(2, "scenarios/em-2gpu.yaml", marks=needs_gpus(2, "one rank per GPU")),
    pytest.param(4, "scenarios/dsv3x4-fp8.yaml", marks=needs_gpus(4, "one rank per GPU")),
    pytest.param(4, "scenarios/dsv3x4-expert.yaml", marks=needs_gpus(4, "one rank per GPU"))])
def test_kernel_mode_runs_verified_one_rank_per_gpu(v2_built: None, tmp_path: Path, world: int,
                                                    scenario: str) -> None:
    """Both call modes at 16 SMs: the cached-handle rows (kernel) and the whole call, every row
    verified (last timed call and the verification run), the options recorded."""
    r, df, _ = run_v2(tmp_path, world, scenario, gpus=world, backends="deepep-v2",
                      extra=("--call-modes", "call,kernel"))
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    v2 = df[df["backend"] == "deepep-v2"]
    rows = {(m, op) for m in ("call", "kernel") for op in ("dispatch", "combine")}
    assert set(zip(v2["call_mode"], v2["op"])) == rows
    assert int(v2["wrong"].sum()) == 0, r.stdout[-4000:]
    for opts in v2["options"]:
        assert json.loads(opts) == {"gin": "off", "prefer_overlap": "off"}
    times = {(m, op): float(t) for m, op, t in zip(v2["call_mode"], v2["op"], v2["time_us"])}
    print(f"{scenario} world {world}: {times}")
