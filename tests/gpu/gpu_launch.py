"""Shared by the GPU tests: run a worker script under torchrun on this host's GPUs, with the
environment every GPU run here must have (no NVLink multicast anywhere, unbuffered output)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import List

import pytest

ROOT = Path(__file__).resolve().parents[2]
SAFE_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1",
            "PYTHONUNBUFFERED": "1"}


def gpu_count() -> int:
    try:
        import torch
    except ImportError:
        return 0
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


GPUS = gpu_count()


def needs_gpus(n: int, why: str = "") -> List[pytest.MarkDecorator]:
    """The marks of a test about separate GPUs: the `gpu` marker, and a skip below n CUDA GPUs."""
    return [pytest.mark.gpu,
            pytest.mark.skipif(GPUS < n, reason=f"needs >= {n} CUDA GPUs{f' ({why})' if why else ''}")]


def shares_gpus() -> List[pytest.MarkDecorator]:
    """The marks of a multi-rank test that runs on any GPU count: where ranks outnumber the GPUs
    they share them (epbench.launch), through the same kernels, buffers and checks."""
    return [pytest.mark.gpu, pytest.mark.skipif(GPUS < 1, reason="needs a CUDA GPU")]


def mps_on() -> bool:
    from epbench.launch import mps_active

    return mps_active()


def needs_nvshmem_gpus(n: int) -> List[pytest.MarkDecorator]:
    """NVSHMEM PEs: n GPUs, or fewer shared under MPS (without MPS NVSHMEM's support for several
    PEs per GPU is limited, and epbench-hier says so and skips)."""
    return [pytest.mark.gpu, pytest.mark.skipif(
        GPUS < n and not (GPUS >= 1 and mps_on()),
        reason=f"needs >= {n} CUDA GPUs, or MPS to put {n} NVSHMEM PEs on fewer")]


def world(most: int = 4) -> int:
    """Ranks for a shared-or-separate test: one per GPU up to ``most``, and 2 on a 1-GPU host."""
    return max(2, min(GPUS, most))


def shared(nproc: int) -> bool:
    """True where ``nproc`` ranks outnumber this host's GPUs (they share them)."""
    return nproc > GPUS


def safe_env() -> dict:
    env = dict(os.environ, **SAFE_ENV)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env


def torchrun(worker: Path, nproc: int, *args: str, timeout: int = 900) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           str(worker), *args]
    return subprocess.run(cmd, env=safe_env(), cwd=ROOT, capture_output=True, text=True, timeout=timeout)
