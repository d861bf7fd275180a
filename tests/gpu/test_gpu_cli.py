"""The whole pipeline on GPUs: `epbench run` with the NCCL reference and the epbench kernels,
bf16 and fp8, uniform and skewed routing, every point verified, and a corrupted kernel output that
must fail the run (marker gpu; skipped without a CUDA GPU). On a 1-GPU host the 2 ranks share it: a
functional run, the reference skipped. The runs start as the session's tests begin
(gpu_launch.EARLY_RUNS), side by side where the host's GPUs have room (gpu_launch.GpuRuns): nothing
here checks a time."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Iterator

import pytest
from epbench.results import load_run
from gpu_launch import EARLY_RUNS, GPUS, GpuRuns, shares_gpus

pytestmark = shares_gpus()

WORLD = max(2, min(GPUS, 4))  # ranks share the GPU on a 1-GPU host
SHARED = WORLD > GPUS

SCENARIO = """
model: {{hidden: {hidden}, tokens_per_rank: 1000, topk: 6, experts_per_rank: 8, dispatch_dtype: {dtype}}}
topology: {{nodes: 1, gpus_per_node: {world}}}
routing: {{kind: {routing}, seed: 3}}
bench: {{warmup: 2, iters: 5, backends: [reference, epbench], sms: [4, 12], device: cuda}}
"""

# The ceilings (copy engine, SM stores) depend on neither dtype nor routing: the first run measures
# them, the others skip them.
CASES = [("bf16", "uniform", 2048, True), ("fp8", "zipf", 4096, False), ("bf16", "hot", 7168, False)]


def run_command(dtype: str, routing: str, hidden: int, ceilings: bool):
    def command(folder: Path) -> list:
        path = folder / f"gpu-{dtype}-{routing}.yaml"
        path.write_text(SCENARIO.format(hidden=hidden, dtype=dtype, routing=routing, world=WORLD))
        return [sys.executable, "-m", "epbench", "run", str(path), "--results", str(folder / "r"),
                *([] if ceilings else ["--no-ceilings"])]
    return command


def corrupted(folder: Path) -> list:
    path = folder / "gpu-fault.yaml"
    path.write_text(SCENARIO.format(hidden=2048, dtype="bf16", routing="uniform", world=2))
    return [sys.executable, "-m", "epbench", "run", str(path), "--backends", "epbench", "--inject-fault",
            "dispatch", "--no-ceilings", "--results", str(folder / "r")]


def _runs(base: Path) -> GpuRuns:
    runs = {"-".join(map(str, case)): run_command(*case) for case in CASES}
    runs["corrupted"] = corrupted
    gpus = {name: min(2 if name == "corrupted" else WORLD, max(GPUS, 1)) for name in runs}
    return GpuRuns(base, runs, gpus=gpus, per_gpu=2)


EARLY_RUNS.add(__file__, _runs, "runs")


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GpuRuns]:
    with EARLY_RUNS.set_of(__file__, tmp_path_factory) as started:
        yield started


@pytest.mark.parametrize("dtype,routing,hidden,ceilings", CASES)
def test_run_verifies_both_backends(runs: GpuRuns, dtype: str, routing: str, hidden: int, ceilings: bool) -> None:
    r, folder = runs.get("-".join(map(str, (dtype, routing, hidden, ceilings))))
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    (run,) = list((folder / "r").iterdir())
    df = load_run(run)[1]  # measured rows (skipped / failed ones aside)
    assert set(df["backend"]) == {"epbench"} | (set() if SHARED else {"reference"})
    assert sorted(set(df[df["backend"] == "epbench"]["sms"])) == [4, 12]
    # ops x ranks x (reference in its two call modes + epbench at 2 SM counts)
    assert len(df) == 2 * WORLD * ((0 if SHARED else 2) + 2)
    assert int(df["wrong"].sum()) == 0
    if SHARED:  # functional: no bus bandwidth for traffic that stayed in one GPU
        assert df["busbw_nvlink_gbps"].isna().all() and df["functional"].notna().all()
    else:
        assert (df["busbw_nvlink_gbps"] > 0).all() and df["functional"].isna().all()
    if ceilings and not SHARED:  # the combine's local-sum ceiling at each swept SM count, none for dispatch
        ep = df[df["backend"] == "epbench"]
        assert (ep[ep["op"] == "combine"]["ceiling_sm_sum_us"] > 0).all()
        assert ep[ep["op"] == "dispatch"]["ceiling_sm_sum_us"].isna().all()
        # copy engines + SM stores at once: both ops, every swept SM count, one of the measured shares
        assert (ep["ceiling_ce_sm_us"] > 0).all() and ep["ceiling_ce_sm_share"].isin([0.25, 0.5, 0.75]).all()


def test_corrupted_kernel_output_fails(runs: GpuRuns) -> None:
    r, _ = runs.get("corrupted")
    assert r.returncode != 0
    assert "VERIFICATION FAILED" in r.stdout
