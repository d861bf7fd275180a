"""GPU checks of the epbench kernels: torchrun starts tests/gpu/ep_worker.py on 2..4 GPUs,
which checks every edge case against epbench.verify and a missing peer against the timeout."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parents[2]
WORKER = ROOT / "tests" / "gpu" / "ep_worker.py"
GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(GPUS < 2, reason="needs >= 2 CUDA GPUs"),
]


def _torchrun(nproc: int, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1",
               NVSHMEM_DISABLE_NVLS="1", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           str(WORKER), *args]
    return subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=900)


@pytest.fixture(scope="module")
def built() -> None:
    from epbench import cuda_lib

    try:
        cuda_lib.load()
    except RuntimeError as e:
        pytest.skip(str(e))


@pytest.mark.parametrize("nproc", sorted({2, min(GPUS, 4)}) if GPUS >= 2 else [2])
def test_kernels_match_verification(built: None, nproc: int) -> None:
    r = _torchrun(nproc, "check", *(["--quick"] if nproc == 2 else []))
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-6000:]
    assert "PASS" in r.stdout
