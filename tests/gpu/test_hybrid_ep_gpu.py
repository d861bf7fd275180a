"""Hybrid-EP (hybrid-ep) through `epbench run`, after `make baselines DEEPEP_FLAVOR=hybrid-ep
DEEPEP_SRC=...`. On one GPU each: bf16 and fp8 at world 1, bf16 with 2 ranks sharing it (its code refuses
neither: epbench/backends/hybrid_ep.py), and expert_major. On a host with 2 or more GPUs: one rank
per GPU (up to 4), swept over two SM counts. The runs start together at the first test, side by
side on this host's GPUs, two at a time on a GPU (gpu_launch.GpuRuns), from the session's start
(gpu_launch.EARLY_RUNS). Every run times both call modes (``call``: the whole
call; ``kernel``: the cached handle), each point verified (#wrong 0), and every row records the
block counts the library's handle says its kernels ran with, which must be the point's SM count."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Iterator, Optional, Sequence

import pytest
from epbench.results import load_run
from gpu_launch import EARLY_RUNS, GPUS, GpuRuns, flavor_reachable, shares_gpus

pytestmark = shares_gpus()

QUICK = ["--iters", "5", "--warmup", "1", "--no-ceilings", "--call-modes", "call,kernel"]
SWEEP_GPUS = min(GPUS, 4)
# hidden 8192 with fp8 needs 4 ranks (top-8 over 2 experts a rank); fewer GPUs sweep the 2-rank bf16 one
H8192 = "h200x4-fp8.yaml" if SWEEP_GPUS >= 4 else "h8192x2.yaml"
# Each run's name -> (scenario, ranks, backends, SM counts, GPUs). A Hybrid-EP job compiles its kernels
# with nvcc as it starts (its jit/compiler.cu, per process); one after another these runs took 20-37 s
# each on 4 x H200 (2026-11-26), so they go side by side on this host's GPUs, two at a time on a GPU
# (GpuRuns; side by side on separate GPUs the module took ~140 s on 2026-11-27, the three 4-GPU sweeps
# one after another ~100 s of it). Nothing below checks a time.
RUNS = {
    **{f"runs/{f}/{n}": (f, n, "hybrid-ep,reference", (24,), 1)
       for f, n in (("dsv3x2.yaml", 1), ("dsv3x4-fp8.yaml", 1), ("dsv3x2.yaml", 2))},
    **{f"em/{n}": ("em-2gpu.yaml", n, "hybrid-ep", (24,), 1) for n in (1, 2)},
    **({f"sweep/{f}": (f, SWEEP_GPUS, "hybrid-ep", (8, 24), SWEEP_GPUS)
        for f in ("dsv3x4.yaml", H8192, "em-2gpu.yaml")} if GPUS >= 2 else {}),
}


def _command(scenario_file: str, nproc: int, backends: str, sms: Sequence[int]):
    return lambda folder: [sys.executable, "-m", "epbench", "run", f"scenarios/{scenario_file}", "--nproc",
                           str(nproc), "--backends", backends, "--sms", ",".join(map(str, sms)), *QUICK,
                           "--results", str(folder / "r")]


@pytest.fixture(scope="module")
def built() -> None:
    if not flavor_reachable("hybrid-ep"):
        pytest.skip("Hybrid-EP is not built here nor recorded in a venv (make baselines [VENV=...] "
                    "DEEPEP_FLAVOR=hybrid-ep)")


def _runs(base: Path) -> Optional[GpuRuns]:
    if not flavor_reachable("hybrid-ep"):
        return None
    return GpuRuns(base, {n: _command(*r[:4]) for n, r in RUNS.items()},
                   gpus={n: r[4] for n, r in RUNS.items()}, per_gpu=2, timeout=300)


EARLY_RUNS.add(__file__, _runs, "runs")  # started as the session's tests begin (its jobs are mostly nvcc)


@pytest.fixture(scope="module")
def runs(built: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[GpuRuns]:
    with EARLY_RUNS.set_of(__file__, tmp_path_factory) as runs:
        yield runs


def _rows(runs: GpuRuns, name: str):
    """The run's hybrid-ep rows, which must not have been skipped, hold both call modes at every SM
    count, and record the point's count as what ran."""
    r, folder = runs.get(name)
    sms = RUNS[name][3]
    log = r.stdout[-4000:] + r.stderr[-4000:]
    assert r.returncode == 0, log
    assert "backend hybrid-ep skipped" not in r.stdout, log
    (run,) = list((folder / "r").iterdir())
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
def test_runs_verified(runs: GpuRuns, scenario_file: str, nproc: int) -> None:
    rows, log = _rows(runs, f"runs/{scenario_file}/{nproc}")
    assert int(rows["wrong"].sum()) == 0, log


@pytest.mark.parametrize("nproc", [1, 2])
def test_expert_major_verified(runs: GpuRuns, nproc: int) -> None:
    """layout expert_major (dispatch_with_permute / combine_with_unpermute, align 128, fp8): the
    segments bit-exact, combine within its three bf16 roundings (HybridEPBackend.combine_roundings)."""
    rows, log = _rows(runs, f"em/{nproc}")
    assert int(rows["wrong"].sum()) == 0, log


@pytest.mark.parametrize("scenario_file", ["dsv3x4.yaml", H8192, "em-2gpu.yaml"])
@pytest.mark.skipif(GPUS < 2, reason="needs >= 2 CUDA GPUs (one rank per GPU)")
def test_one_rank_per_gpu_sm_sweep(runs: GpuRuns, scenario_file: str) -> None:
    """One rank per GPU (2 to 4), SM counts 8 and 24, both call modes: every point verified and
    recording its count; the times are printed (pytest -s) for a look only (on a host of more than 4
    GPUs other runs of this module may go beside it)."""
    rows, log = _rows(runs, f"sweep/{scenario_file}")
    assert int(rows["wrong"].sum()) == 0, log
    cols = [c for c in ("rank", "sms", "call_mode", "op", "time_us", "busbw_nvlink_gbps", "options") if c in rows]
    print(f"\n{scenario_file} on {SWEEP_GPUS} GPUs:\n{rows[cols].to_string(index=False)}")
