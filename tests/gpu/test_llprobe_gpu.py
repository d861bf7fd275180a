"""The low-latency probe on one GPU (`epbench probe`, epbench/llprobe.py): a chain at world 1 and
ranks sharing the GPU must verify (exit 0, every row's `wrong` 0), print the columns they add and
write a results folder (results.csv, samples.csv) that `epbench report` prints again."""

from __future__ import annotations

import csv
import subprocess
import sys
from pathlib import Path

from gpu_launch import ROOT, safe_env, shares_gpus

pytestmark = shares_gpus()

QUICK = ["--tokens", "1,32", "--sms", "16", "--variants", "grid,token", "--warmup", "2", "--iters", "5"]


def probe(tmp_path: Path, *args: str) -> tuple:
    path = tmp_path / "p.csv"
    env = dict(safe_env(), CUDA_VISIBLE_DEVICES="0")
    r = subprocess.run([sys.executable, "-m", "epbench", "probe", *QUICK, "--csv", str(path),
                        "--results", str(tmp_path / "r"), *args], cwd=ROOT,
                       env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    (run,) = list((tmp_path / "r").iterdir())
    assert (run / "results.csv").is_file() and (run / "samples.csv").is_file()
    again = subprocess.run([sys.executable, "-m", "epbench", "report", str(run)], cwd=ROOT, env=env,
                           capture_output=True, text=True, timeout=120)
    assert again.returncode == 0 and "call" in again.stdout, again.stdout + again.stderr
    return r.stdout, list(csv.DictReader(path.open()))


def header(out: str) -> list:
    """The table's header line (the line after the '# GPU, world ...' line)."""
    lines = out.splitlines()
    return lines[next(i for i, ln in enumerate(lines) if ln.startswith("# ")) + 1].split()


def test_a_chain_verifies_at_world_1(kernels_built: None, tmp_path: Path) -> None:
    out, rows = probe(tmp_path, "--chain", "1,4")
    ops = [r for r in rows if r["op"] != "probe"]
    assert {r["chain"] for r in ops} == {"1", "4"} and all(r["wrong"] == "0" for r in ops)
    assert header(out)[-1] == "chain"


def test_two_ranks_share_the_gpu_and_verify(kernels_built: None, tmp_path: Path) -> None:
    out, rows = probe(tmp_path, "--nproc", "2")
    ops = [r for r in rows if r["op"] != "probe"]
    assert ops and all(r["wrong"] == "0" and r["ranks"] == "2" for r in ops)
    assert all(float(r["call_p50"]) >= float(r["call_p50_rank0"]) for r in ops)
    assert "world 2: 2 ranks share this GPU, MPS " in out
