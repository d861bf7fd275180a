"""Ranks sharing one GPU through `epbench run` (issue 18): CUDA_VISIBLE_DEVICES shows every host as
a 1-GPU host, so these run anywhere with a GPU. The epbench kernels must verify as on separate
GPUs, and the rows and the table must give no link figure for traffic that never left the GPU. The
three runs start as the session's tests begin (gpu_launch.EARLY_RUNS), each on a GPU of its own
where the host has several (gpu_launch.GpuRuns); each test reads its run."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Callable, Iterator, List, Optional

import pytest
from epbench.results import load_run
from gpu_launch import EARLY_RUNS, GpuRuns, shares_gpus

pd = pytest.importorskip("pandas")

pytestmark = shares_gpus()

QUICK = ["--sms", "16", "--iters", "5", "--warmup", "1"]


def epbench_run(*args: str) -> Callable[[Path], List[str]]:
    return lambda folder: [sys.executable, "-m", "epbench", "run", *args, "--results", str(folder / "r")]


RUNS = {"fp8 4 ranks": epbench_run("scenarios/dsv3x4-fp8.yaml", "--nproc", "4", "--tokens", "1024", *QUICK),
        "one rank": epbench_run("scenarios/dsv3x4.yaml", "--nproc", "1", "--tokens", "1024", *QUICK),
        "default": epbench_run(*QUICK)}


def _runs(base: Path) -> Optional[GpuRuns]:
    """None where the kernels are not built (the tests skip at kernels_built)."""
    from epbench import cuda_lib

    try:
        cuda_lib.load()
    except (RuntimeError, AttributeError):
        return None
    return GpuRuns(base, RUNS)


EARLY_RUNS.add(__file__, _runs, "runs")


@pytest.fixture(scope="module")
def runs(kernels_built: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[GpuRuns]:
    with EARLY_RUNS.set_of(__file__, tmp_path_factory) as runs:
        yield runs


def only_run(runs: GpuRuns, name: str):
    """The run, its measured rows and its meta.json."""
    r, folder = runs.get(name)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    (run,) = list((folder / "r").iterdir())
    return r, load_run(run)[1], json.loads((run / "meta.json").read_text())  # measured rows only


def assert_functional(r: subprocess.CompletedProcess, df, meta, why: str, backends: List[str]) -> None:
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    assert sorted(set(df["backend"])) == sorted(backends)
    assert int(df["wrong"].sum()) == 0
    assert df["functional"].str.contains(why).all()
    for col in ("busbw_nvlink_gbps", "ceiling_copy_engine_us", "ceiling_sm_store_us",
                "nvlink_link_use_pct", "busbw_nvlink_measured_gbps"):
        assert df[col].isna().all(), col
    assert why in meta["functional"] and meta["mps"] in ("on", "off")
    assert "functional, no link figures" in r.stdout and "note: functional run" in r.stdout


def assert_shared(r: subprocess.CompletedProcess, meta) -> None:
    """What a run of 4 ranks sharing the GPU says beside its functional rows."""
    assert "ranks share GPUs" in r.stdout and "ceilings: not measured" in r.stdout
    assert meta["ranks_per_gpu"] == 4 and "MPS " + meta["mps"] in r.stdout


def test_four_ranks_on_one_gpu_verify_and_print_no_link_figures(kernels_built: None, runs: GpuRuns) -> None:
    """fp8 on 4 ranks sharing the GPU, the NCCL reference skipped with a note; 1024 tokens per rank
    (the shape is not the point). bf16 on the DeepSeek-V3 shape runs in the default test below."""
    r, df, meta = only_run(runs, "fp8 4 ranks")
    assert_functional(r, df, meta, "4 ranks share each GPU", ["epbench"])
    assert "backend reference skipped" in r.stdout
    assert_shared(r, meta)


def test_one_rank_is_functional_too(kernels_built: None, runs: GpuRuns) -> None:
    """World 1: NCCL runs (one rank, one GPU), but nothing crosses a link for either backend."""
    r, df, meta = only_run(runs, "one rank")
    assert_functional(r, df, meta, "one rank", ["epbench", "reference"])


def test_default_on_a_one_gpu_host_uses_the_gpu(kernels_built: None, runs: GpuRuns) -> None:
    """`make run` on one GPU: the shipped 1-GPU default (bf16, the DeepSeek-V3 shape, 4 ranks sharing
    the GPU), verified, labelled functional; at one SM count and fewer iterations than it ships with."""
    r, df, meta = only_run(runs, "default")
    assert "no scenario given: running scenarios/dsv3x4-1gpu.yaml (1 CUDA GPU found)" in r.stdout
    assert_functional(r, df, meta, "4 ranks share each GPU", ["epbench"])
    assert_shared(r, meta)
