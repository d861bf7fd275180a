"""GPU checks of the epbench kernels: torchrun starts tests/gpu/ep_worker.py on 2 and 4 ranks,
which checks every edge case against epbench.verify and a missing peer against the timeout. Ranks
share the GPUs where they outnumber them (quick case lists then: the ranks take turns)."""

from __future__ import annotations

import pytest
from gpu_launch import ROOT, shared, shares_gpus, torchrun

torch = pytest.importorskip("torch")

WORKER = ROOT / "tests" / "gpu" / "ep_worker.py"

pytestmark = shares_gpus()


@pytest.mark.parametrize("nproc", [2, 4])
def test_kernels_match_verification(kernels_built: None, nproc: int) -> None:
    r = torchrun(WORKER, nproc, "check", *(["--quick"] if nproc == 2 or shared(nproc) else []))
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-6000:]
    assert "PASS" in r.stdout


def test_non_default_options_match_verification(kernels_built: None) -> None:
    """The defaults (lean_dyn, grid notify, 2 KiB x 2 combine) run in the test above; the options kept beside
    them (lean at 8 / 3 SMs, staged notify, 3 stages of 4 KiB, 32 dispatch warps) must stay correct."""
    r = torchrun(WORKER, 2, "check", "--quick", "--notify", "staged", "--combine-stages", "3",
                 "--combine-chunk", "4096", "--impls", "lean:16:8,lean:16:3,lean:32:5,lean_dyn:32:3")
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-6000:]
    assert "PASS" in r.stdout
