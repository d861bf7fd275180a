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


@pytest.mark.parametrize("nproc", [1, 3])
def test_mxfp8_before_and_fused_match_verification(kernels_built: None, nproc: int) -> None:
    """mxfp8 (issue 26): E8M0 scales handed in and the cast fused into both dispatch kernels, bit-exact against
    epbench/mxfp8.py over uniform / zipf / hot routing, ranks with 0 tokens, 4095 tokens, hidden 2048 .. 8192,
    65 scale bytes per row (h2080) and blocks at every scale; 3 ranks share the GPUs of a smaller host."""
    impls = "lean_dyn:16:8,lean:16:3" if shared(nproc) else "lean_dyn:16:8,lean:16:3,lean:32:5,lean_dyn:32:16"
    r = torchrun(WORKER, nproc, "check", "--mxfp8", "--impls", impls)
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-6000:]
    assert "PASS" in r.stdout and "mxfp8 fused" in r.stdout


@pytest.mark.parametrize("nproc", [1, 2, 3])
def test_expert_major_matches_verification(kernels_built: None, nproc: int) -> None:
    """Expert-major layout (issue 26): align 1 / 16 / 128 x bf16, fp8, mxfp8 before and fused; uniform, zipf and hot
    routing, ranks with 0 tokens, 4095 tokens, hidden 2048 .. 8192: segments bit-exact, counts and offsets as
    epbench/layout.py, and the per-expert weighted combine; both dispatch kernels, outputs poisoned before each."""
    impls = "lean_dyn:16:8,lean:16:3" if shared(nproc) else "lean_dyn:16:8,lean:16:3,lean_dyn:32:16"
    r = torchrun(WORKER, nproc, "check", "--expert-major", "--impls", impls)
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-6000:]
    assert "PASS" in r.stdout and "em128 mxfp8 fused" in r.stdout
