"""The low-latency probe on one GPU (`epbench probe`, epbench/llprobe.py): a chain at world 1 and
ranks sharing the GPU must verify (exit 0, every row's `wrong` 0), print the columns they add and
write a results folder (results.csv, samples.csv) that `epbench report` prints again. Both runs start
as the session's tests begin (gpu_launch.EARLY_RUNS), each on a GPU of its own where the host has two
(gpu_launch.GpuRuns); nothing here checks a time against a figure, only the relation of two times of
the same run."""

from __future__ import annotations

import csv
import subprocess
import sys
from pathlib import Path
from typing import Iterator, Optional

import pytest
from epbench.llprobe import SKIPS
from gpu_launch import EARLY_RUNS, GPUS, ROOT, GpuRuns, needs_gpus, safe_env, shares_gpus

pytestmark = shares_gpus()

QUICK = ["--tokens", "1,32", "--sms", "16", "--warmup", "2", "--iters", "5"]
VERIFIED = ["--variants", "grid,token"]
RUNS = {"chain": [*VERIFIED, "--chain", "1,4"], "2 ranks": [*VERIFIED, "--nproc", "2"]}
# one GPU per rank: only where the host has 2; with the token dispatches that leave parts out (llprobe.SKIPS)
# and with the tuned ones (llprobe.TUNED), verified
SPREAD = {"2 ranks spread": ["--variants", "grid,token,token-noown,token-norecv,token-peers,token-nofence,"
                                           "token-line", "--nproc", "2", "--spread"]}


def probe_command(args: list):
    return lambda folder: [sys.executable, "-m", "epbench", "probe", *QUICK, "--csv", str(folder / "p.csv"),
                           "--results", str(folder / "r"), *args]


def _runs(base: Path) -> Optional[GpuRuns]:
    """None where the kernels are not built (the tests skip at kernels_built)."""
    from epbench import cuda_lib

    try:
        cuda_lib.load()
    except (RuntimeError, AttributeError):
        return None
    runs = dict(RUNS, **(SPREAD if GPUS >= 2 else {}))
    return GpuRuns(base, {name: probe_command(a) for name, a in runs.items()}, gpus={n: 2 for n in SPREAD if n in runs})


EARLY_RUNS.add(__file__, _runs, "runs")


@pytest.fixture(scope="module")
def runs(kernels_built: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[GpuRuns]:
    with EARLY_RUNS.set_of(__file__, tmp_path_factory) as runs:
        yield runs


def probe(runs: GpuRuns, name: str) -> tuple:
    r, folder = runs.get(name)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    (run,) = list((folder / "r").iterdir())
    assert (run / "results.csv").is_file() and (run / "samples.csv").is_file()
    again = subprocess.run([sys.executable, "-m", "epbench", "report", str(run)], cwd=ROOT, env=safe_env(),
                           capture_output=True, text=True, timeout=120)
    assert again.returncode == 0 and "call" in again.stdout, again.stdout + again.stderr
    return r.stdout, list(csv.DictReader((folder / "p.csv").open()))


def header(out: str) -> list:
    """The table's header line (the line after the '# GPU, world ...' line)."""
    lines = out.splitlines()
    return lines[next(i for i, ln in enumerate(lines) if ln.startswith("# ")) + 1].split()


def test_a_chain_verifies_at_world_1(kernels_built: None, runs: GpuRuns) -> None:
    out, rows = probe(runs, "chain")
    ops = [r for r in rows if r["op"] != "probe"]
    assert {r["chain"] for r in ops} == {"1", "4"} and all(r["wrong"] == "0" for r in ops)
    assert header(out)[-1] == "chain"
    assert not [r for r in rows if r["variant"].startswith("ping")]  # world 1: no peer to ping


def test_two_ranks_share_the_gpu_and_verify(kernels_built: None, runs: GpuRuns) -> None:
    out, rows = probe(runs, "2 ranks")
    ops = [r for r in rows if r["op"] != "probe"]
    assert ops and all(r["wrong"] == "0" and r["ranks"] == "2" for r in ops)
    assert all(float(r["call_p50"]) >= float(r["call_p50_rank0"]) for r in ops)
    assert "world 2: 2 ranks share this GPU, MPS " in out
    pings(rows)


def pings(rows: list) -> None:
    """With several ranks: a `ping` and a `ping-combine` row per SM count, their flags issued within their span."""
    got = [r for r in rows if r["op"] == "probe" and r["variant"].startswith("ping")]
    assert sorted(r["variant"] for r in got) == ["ping", "ping-combine"], got
    assert all(0 <= float(r["a_p50"]) <= float(r["span_p50"]) and float(r["span_p50"]) > 0 for r in got)


@pytest.mark.parametrize("name", [pytest.param(n, marks=needs_gpus(2, "one GPU per rank")) for n in SPREAD])
def test_spread_ranks_cross_the_link_and_verify(kernels_built: None, runs: GpuRuns, name: str) -> None:
    """--spread: every row verified on both GPUs, the slowest rank's row with each rank's own span."""
    out, rows = probe(runs, name)
    skipping = [r for r in rows if r["variant"] in SKIPS]
    ops = [r for r in rows if r["op"] != "probe" and r not in skipping]
    assert ops and all(r["wrong"] == "0" and r["ranks"] == "2" for r in ops)
    # the dispatches with parts left out: one unverified dispatch row each per tokens, timed like the rest
    assert len(skipping) == 8 and all(r["op"] == "dispatch" and r["wrong"] == "" for r in skipping)
    assert all(float(r["call_p50"]) > 0 and float(r["span_p50"]) > 0 for r in skipping)
    assert all(float(r["call_p50"]) >= float(r[f"call_p50_rank{r['slow_rank']}"]) - 1e-9 for r in ops)
    assert all(float(r["span_p50_rank0"]) > 0 and float(r["wait_p50_rank1"]) >= 0 for r in ops)
    assert "world 2: one GPU per rank" in out and "MPS" not in out.splitlines()[0]
    pings(rows)
