"""GPU checks of the epbench kernels: torchrun starts tests/gpu/ep_worker.py on 2..4 GPUs,
which checks every edge case against epbench.verify and a missing peer against the timeout."""

from __future__ import annotations

import pytest
from gpu_launch import GPUS, ROOT, needs_gpus, torchrun

torch = pytest.importorskip("torch")

WORKER = ROOT / "tests" / "gpu" / "ep_worker.py"

pytestmark = needs_gpus(2)


@pytest.fixture(scope="module")
def built() -> None:
    from epbench import cuda_lib

    try:
        cuda_lib.load()
    except RuntimeError as e:
        pytest.skip(str(e))


@pytest.mark.parametrize("nproc", sorted({2, min(GPUS, 4)}) if GPUS >= 2 else [2])
def test_kernels_match_verification(built: None, nproc: int) -> None:
    r = torchrun(WORKER, nproc, "check", *(["--quick"] if nproc == 2 else []))
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-6000:]
    assert "PASS" in r.stdout



def test_non_default_options_match_verification(built: None) -> None:
    """The defaults (lean_dyn, grid notify, 2 KiB x 2 combine) run in the test above; the options kept beside
    them (lean at 8 / 3 SMs, staged notify, 3 stages of 4 KiB, 32 dispatch warps) must stay correct."""
    r = torchrun(WORKER, 2, "check", "--quick", "--notify", "staged", "--combine-stages", "3",
                 "--combine-chunk", "4096", "--impls", "lean:16:8,lean:16:3,lean:32:5,lean_dyn:32:3")
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-6000:]
    assert "PASS" in r.stdout
