"""Ranks sharing one GPU through `epbench run` (issue 18): CUDA_VISIBLE_DEVICES=0 shows every host
as a 1-GPU host, so these run anywhere with a GPU. The epbench kernels must verify as on separate
GPUs, and the rows and the table must give no link figure for traffic that never left the GPU."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import List

import pytest
from epbench.results import load_run
from gpu_launch import ROOT, safe_env, shares_gpus

pd = pytest.importorskip("pandas")

pytestmark = shares_gpus()

QUICK = ["--sms", "16", "--iters", "5", "--warmup", "1"]


def one_gpu_run(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    env = dict(safe_env(), CUDA_VISIBLE_DEVICES="0")
    return subprocess.run([sys.executable, "-m", "epbench", "run", *args, "--results", str(tmp_path / "r")],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


def only_run(tmp_path: Path):
    (run,) = list((tmp_path / "r").iterdir())
    return load_run(run)[1], json.loads((run / "meta.json").read_text())  # measured rows only


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


def test_four_ranks_on_one_gpu_verify_and_print_no_link_figures(kernels_built: None, tmp_path: Path) -> None:
    """fp8 on 4 ranks sharing the GPU, the NCCL reference skipped with a note; 1024 tokens per rank
    (the shape is not the point). bf16 on the DeepSeek-V3 shape runs in the default test below."""
    r = one_gpu_run(tmp_path, "scenarios/dsv3x4-fp8.yaml", "--nproc", "4", "--tokens", "1024", *QUICK)
    df, meta = only_run(tmp_path)
    assert_functional(r, df, meta, "4 ranks share each GPU", ["epbench"])
    assert "backend reference skipped" in r.stdout
    assert_shared(r, meta)


def test_one_rank_is_functional_too(kernels_built: None, tmp_path: Path) -> None:
    """World 1: NCCL runs (one rank, one GPU), but nothing crosses a link for either backend."""
    r = one_gpu_run(tmp_path, "scenarios/dsv3x4.yaml", "--nproc", "1", "--tokens", "1024", *QUICK)
    df, meta = only_run(tmp_path)
    assert_functional(r, df, meta, "one rank", ["epbench", "reference"])


def test_default_on_a_one_gpu_host_uses_the_gpu(kernels_built: None, tmp_path: Path) -> None:
    """`make run` on one GPU: the shipped 1-GPU default (bf16, the DeepSeek-V3 shape, 4 ranks sharing
    the GPU), verified, labelled functional; at one SM count and fewer iterations than it ships with."""
    r = one_gpu_run(tmp_path, *QUICK)
    assert "no scenario given: running scenarios/dsv3x4-1gpu.yaml (1 CUDA GPU found)" in r.stdout
    df, meta = only_run(tmp_path)
    assert_functional(r, df, meta, "4 ranks share each GPU", ["epbench"])
    assert_shared(r, meta)
