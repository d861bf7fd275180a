"""DeepEP V2's own NCCL at run time. V2 needs NCCL >= 2.30.4 (its Gin device API) where torch may
bring an older one (2.28.9 with torch 2.11); tools/baselines.py can build it against a private
NCCL unpacked into the venv and names that library in the build stamp. The launcher then preloads
it into the deepep-v2 jobs only (``job_env``), so every other backend keeps torch's own NCCL.
Preloading, not replacing torch's file: the host's torch install stays untouched, and the NCCL
behind the reference rows does not change with a baseline's build.

No torch here: the launcher reads this before any job starts, and the build tool on a host
without torch."""

from __future__ import annotations

import os
from pathlib import Path
from typing import ContextManager, Dict, Optional, Sequence

from epbench import flavors, launch, provenance

MIN_NCCL = (2, 30, 4)
BACKEND = "deepep-v2"
TORCH_SHIM = "torch-shim"  # <prefix>/torch-shim/nvidia/nccl/lib/libnccl.so.2 -> <prefix>/lib/libnccl.so.2


def version_tuple(text: str) -> "tuple[int, ...]":
    """``"2.30.4"`` or ``"2.11.0+cu130"`` -> (2, 30, 4) / (2, 11, 0): the leading numeric parts."""
    parts = []
    for piece in text.split("+")[0].split("."):
        digits = "".join(ch for ch in piece if ch.isdigit())
        if not digits:
            break
        parts.append(int(digits))
    return tuple(parts)


def preload_env(library: str, env: Dict[str, str]) -> Dict[str, str]:
    """The variables that make a process load ``library`` as its NCCL: LD_PRELOAD, and the torch
    shim beside it (tools/baselines.py's make_torch_shim) first on PYTHONPATH, so that torch's own
    preload names the same file."""
    out = {"LD_PRELOAD": " ".join(p for p in (library, env.get("LD_PRELOAD")) if p)}
    shim = Path(library).parents[1] / TORCH_SHIM
    if shim.is_dir():
        out["PYTHONPATH"] = os.pathsep.join(p for p in (str(shim), env.get("PYTHONPATH")) if p)
    return out


def v2_nccl(python: Optional[str] = None) -> Optional[Dict[str, str]]:
    """The NCCL the installed V2 was built against (from the stamp of this environment, or of the
    venv of ``python``), where it is a private one that still exists."""
    stamp = provenance.baselines_build() if python is None else flavors.stamp_of(python)
    nccl = stamp.get("nccl") if stamp.get("flavor") == "v2" else None
    return nccl if isinstance(nccl, dict) and Path(str(nccl.get("preload"))).is_file() else None


def job_env(backends: Sequence[str], python: Optional[str] = None) -> Dict[str, str]:
    """Environment for the torchrun job that runs ``backends`` (with ``python``'s venv, else
    this one): V2's private NCCL preloaded where deepep-v2 is among them and was built against
    one; nothing otherwise."""
    nccl = v2_nccl(python) if BACKEND in backends else None
    return preload_env(nccl["preload"], dict(os.environ)) if nccl else {}


def job_environment(backends: Sequence[str], python: Optional[str] = None) -> ContextManager[Dict[str, str]]:
    """``job_env(backends, python)`` set in os.environ (which torchrun's workers inherit) while
    the job runs; the launcher's own environment is restored after it."""
    return launch.environment(job_env(backends, python))
