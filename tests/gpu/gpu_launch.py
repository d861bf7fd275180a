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
    """The module marks of a GPU test: the `gpu` marker, and a skip below n CUDA GPUs."""
    return [pytest.mark.gpu,
            pytest.mark.skipif(GPUS < n, reason=f"needs >= {n} CUDA GPUs{f' ({why})' if why else ''}")]


def safe_env() -> dict:
    env = dict(os.environ, **SAFE_ENV)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env


def torchrun(worker: Path, nproc: int, *args: str, timeout: int = 900) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           str(worker), *args]
    return subprocess.run(cmd, env=safe_env(), cwd=ROOT, capture_output=True, text=True, timeout=timeout)
