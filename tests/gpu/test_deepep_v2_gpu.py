"""DeepEP V2 (deepep-v2) through `epbench run`, after `make baselines DEEPEP_FLAVOR=v2
NCCL_CARRY=...`: at world 1 it runs verified with the NCCL it was built against preloaded into its
job only, in both layouts (expert_major through V2's expanding dispatch); ranks sharing the GPU get a
skipped row saying it needs one GPU per rank. On 2 and 4 GPUs (one rank each, gin off within the
node) both call modes run verified in both layouts: ``kernel`` times V2's cached handle. The runs go
side by side on this host's GPUs where they fit (gpu_launch.GpuRuns), from the session's start
(gpu_launch.EARLY_RUNS)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Iterator, Optional

import pytest
from epbench.backends import deepep_v2_env
from epbench.results import load_run
from gpu_launch import EARLY_RUNS, GPUS, GpuRuns, flavor_reachable, needs_gpus, shares_gpus

pytestmark = shares_gpus()

QUICK = ["--sms", "16", "--iters", "5", "--warmup", "1"]
KERNEL_MODE = [(2, "scenarios/dsv3x2.yaml"), (2, "scenarios/em-2gpu.yaml"), (4, "scenarios/dsv3x4-fp8.yaml"),
               (4, "scenarios/dsv3x4-expert.yaml")]
# Each run's name -> (ranks, scenario, GPUs, backends, extra arguments); they start together at the
# first test, side by side on this host's GPUs, two at a time on a GPU (gpu_launch.GpuRuns: they check
# what a run verifies, never a time; one after another the 4-GPU runs took ~20 s each). A run needing more
# GPUs than the host has is left out (its test skips).
RUNS = {
    "world 1": (1, "scenarios/dsv3x2.yaml", 1, "deepep-v2,reference", ()),
    **{f"expert-major {sc}": (1, sc, 1, "deepep-v2,reference", ())
       for sc in ("scenarios/em-2gpu.yaml", "scenarios/dsv3x4-expert.yaml")},
    "sharing": (2, "scenarios/dsv3x2.yaml", 1, "deepep-v2,reference", ()),
    **{f"kernel {w} {sc}": (w, sc, w, "deepep-v2", ("--call-modes", "call,kernel"))
       for w, sc in KERNEL_MODE if w <= GPUS},
}


@pytest.fixture(scope="module")
def v2_built() -> None:
    if not flavor_reachable("deepep-v2"):
        pytest.skip("DeepEP V2 is not built here nor recorded in a venv (make baselines [VENV=...] DEEPEP_FLAVOR=v2 "
                    "NCCL_CARRY=...)")


def _command(nproc: int, scenario: str, backends: str, extra: tuple):
    return lambda folder: [sys.executable, "-m", "epbench", "run", scenario, "--nproc", str(nproc),
                           "--backends", backends, *QUICK, *extra, "--results", str(folder / "r")]


def _runs(base: Path) -> Optional[GpuRuns]:
    if not flavor_reachable("deepep-v2"):
        return None
    return GpuRuns(base, {n: _command(w, sc, b, extra) for n, (w, sc, _, b, extra) in RUNS.items()},
                   gpus={n: r[2] for n, r in RUNS.items()}, per_gpu=2, timeout=300)


EARLY_RUNS.add(__file__, _runs, "runs")


@pytest.fixture(scope="module")
def runs(v2_built: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[GpuRuns]:
    with EARLY_RUNS.set_of(__file__, tmp_path_factory) as runs:
        yield runs


def run_v2(runs: GpuRuns, name: str):
    r, folder = runs.get(name)
    found = sorted((folder / "r").iterdir()) if (folder / "r").is_dir() else []
    assert len(found) == 1, (f"{name}: {len(found)} results folders (exit {r.returncode})\n"
                             f"{r.stdout[-4000:]}\n{r.stderr[-4000:]}")
    run = found[0]
    return r, load_run(run)[1], json.loads((run / "meta.json").read_text())


def test_world_1_runs_verified_with_its_own_nccl(runs: GpuRuns) -> None:
    r, df, meta = run_v2(runs, "world 1")
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    v2 = df[df["backend"] == "deepep-v2"]
    assert set(v2["op"]) == {"dispatch", "combine"} and int(v2["wrong"].sum()) == 0
    runtime = meta["backend_runtime"]
    assert deepep_v2_env.version_tuple(runtime["deepep-v2"]["nccl"]) >= deepep_v2_env.MIN_NCCL
    if deepep_v2_env.v2_nccl():  # built against a carry: preloaded into its job, not the reference's
        assert runtime["deepep-v2"]["ld_preload"] and not runtime["reference"]["ld_preload"]


@pytest.mark.parametrize("scenario", ["scenarios/em-2gpu.yaml", "scenarios/dsv3x4-expert.yaml"])
def test_expert_major_world_1_runs_verified(runs: GpuRuns, scenario: str) -> None:
    """fp8 and mxfp8 segments aligned to 128 rows, checked as epbench's own expert-major layout."""
    r, df, _ = run_v2(runs, f"expert-major {scenario}")
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    v2 = df[df["backend"] == "deepep-v2"]
    assert set(v2["op"]) == {"dispatch", "combine"} and int(v2["wrong"].sum()) == 0, r.stdout[-4000:]


def test_ranks_sharing_the_gpu_get_a_skipped_row(runs: GpuRuns) -> None:
    r, _, _ = run_v2(runs, "sharing")
    # the skip names the rank that found it (every skip note does: "skipped: rank N: why")
    assert "backend deepep-v2 skipped: rank 0: needs 2 GPUs, one per rank" in r.stdout, r.stdout[-4000:]


@pytest.mark.parametrize("world, scenario", [
    pytest.param(w, sc, marks=needs_gpus(w, "one rank per GPU")) for w, sc in KERNEL_MODE])
def test_kernel_mode_runs_verified_one_rank_per_gpu(runs: GpuRuns, world: int, scenario: str) -> None:
    """Both call modes at 16 SMs: the cached-handle rows (kernel) and the whole call, every row
    verified (last timed call and the verification run), the options recorded."""
    r, df, _ = run_v2(runs, f"kernel {world} {scenario}")
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    v2 = df[df["backend"] == "deepep-v2"]
    rows = {(m, op) for m in ("call", "kernel") for op in ("dispatch", "combine")}
    assert set(zip(v2["call_mode"], v2["op"])) == rows
    assert int(v2["wrong"].sum()) == 0, r.stdout[-4000:]
    for opts in v2["options"]:
        assert json.loads(opts) == {"gin": "off", "prefer_overlap": "off"}
    times = {(m, op): float(t) for m, op, t in zip(v2["call_mode"], v2["op"], v2["time_us"])}
    print(f"{scenario} world {world}: {times}")
