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


def test_non_default_variants_match_verification(kernels_built: None) -> None:
    """The defaults (grid notify, tma combine) run in the test above; the variants they replaced (v4 staged
    notify, v1 pull combine) stay selectable and must stay correct."""
    r = torchrun(WORKER, 4, "check", "--quick", "--notify", "staged", "--combine-impl", "pull",
                 "--impls", "lean:16:8,lean:16:3")
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-6000:]
    assert "PASS" in r.stdout


def test_v13_v14_variants_match_verification(kernels_built: None) -> None:
    """v13-v14 knobs (kept selectable): ownbulk (own rows by bulk stores), pull (receivers bulk-copy their
    rows from the sources' registered dispatch_x) and split (own rows by their own warps), at 1, 3 and 8 SMs."""
    r = torchrun(WORKER, 4, "check", "--quick", "--impls",
                 "ownbulk:16:8,pull:16:8,pull:16:3,pull:16:1,split:16:8,split:2:3,split:32:1")
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-6000:]
    assert "PASS" in r.stdout
