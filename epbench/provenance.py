"""Where a number came from: host, versions, topology, command line, commit."""

from __future__ import annotations

import datetime
import os
import platform
import re
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional

from epbench import baselines

REPO = Path(__file__).resolve().parent.parent
ENV_PREFIXES = ("NCCL_", "NVSHMEM_", "TORCH_SYMM_MEM", "CUDA_VISIBLE_DEVICES", "EPBENCH_",
                "OMP_NUM_THREADS")


def _run(cmd: List[str], cwd: Optional[Path] = None) -> Optional[str]:
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=20, cwd=cwd)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def git_commit() -> Optional[str]:
    commit = _run(["git", "rev-parse", "HEAD"], cwd=REPO) or os.environ.get("EPBENCH_GIT_COMMIT")
    if commit and _run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO):
        commit += "+dirty"
    return commit


def nvml_info() -> Dict[str, Any]:
    try:
        import pynvml
    except ImportError:
        return {"nvml": "skipped: nvidia-ml-py is not installed"}
    try:
        pynvml.nvmlInit()
    except Exception as e:  # no driver, no GPU
        return {"nvml": f"skipped: {e}"}
    try:
        def text(v: Any) -> str:
            return v.decode() if isinstance(v, bytes) else str(v)

        n = pynvml.nvmlDeviceGetCount()
        return {"driver": text(pynvml.nvmlSystemGetDriverVersion()),
                "gpus": [text(pynvml.nvmlDeviceGetName(pynvml.nvmlDeviceGetHandleByIndex(i)))
                         for i in range(n)]}
    finally:
        pynvml.nvmlShutdown()


def collect(argv: List[str], device: str) -> Dict[str, Any]:
    import torch

    info: Dict[str, Any] = {
        "started_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(),
        "argv": argv,
        "git_commit": git_commit(),
        "host": socket.gethostname(),
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "device": device,
        "env": {k: v for k, v in os.environ.items() if k.startswith(ENV_PREFIXES)},
        "baselines": baselines.versions(),  # external libraries' versions and pinned commits
    }
    if device == "cuda":
        info["cuda"] = torch.version.cuda
        try:
            info["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        except Exception as e:
            info["nccl"] = f"unknown ({e})"
        info.update(nvml_info())
        topo = _run(["nvidia-smi", "topo", "-m"])
        info["topology"] = re.sub(r"\x1b\[[0-9;]*m", "", topo) if topo else "skipped: nvidia-smi unavailable"
    return info
