"""Where a number came from: host, versions, topology, command line, commit."""

from __future__ import annotations

import datetime
import json
import os
import platform
import re
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional

from epbench import launch

PACKAGE = Path(__file__).resolve().parent
BUILD_INFO = "_build_info.json"  # in the package, written by `make build` (git-ignored)
BASELINES_STAMP = "epbench-baselines.json"  # in the venv, written by `make baselines` (tools/baselines.py)
ENV_PREFIXES = ("NCCL_", "TORCH_NCCL_", "NVSHMEM_", "TORCH_SYMM_MEM", "CUDA_VISIBLE_DEVICES", "EPBENCH_",
                "OMP_NUM_THREADS")


def _run(cmd: List[str], cwd: Optional[Path] = None) -> Optional[str]:
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=20, cwd=cwd)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def _is_epbench_project(top: Path) -> bool:
    try:
        text = (top / "pyproject.toml").read_text()
    except OSError:
        return False
    return re.search(r'^\[project\][^\[]*^name\s*=\s*"epbench"', text, re.M | re.S) is not None


def checkout_commit(package: Path = PACKAGE) -> Optional[str]:
    """HEAD of the git checkout that holds this package, "+dirty" when tracked files differ
    from it; None unless that checkout is epbench's own: its top holds epbench's pyproject.toml,
    the package is <top>/epbench and tracked there. (A copy of the package inside some other
    repository would otherwise record that repository's commit.)"""
    top = _run(["git", "rev-parse", "--show-toplevel"], cwd=package)
    if top is None or Path(top).resolve() / "epbench" != package.resolve():
        return None
    if not _is_epbench_project(Path(top)):
        return None
    if _run(["git", "ls-files", "--error-unmatch", "epbench/provenance.py"], cwd=top) is None:
        return None
    commit = _run(["git", "rev-parse", "HEAD"], cwd=top)
    if commit and _run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=top):
        commit += "+dirty"
    return commit


def stamped_commit(path: Path) -> Optional[str]:
    """The commit `make build` stamped into the package, where it ran in epbench's checkout."""
    try:
        commit = json.loads(path.read_text()).get("git_commit")
    except (OSError, ValueError, AttributeError):
        return None
    return commit if isinstance(commit, str) and commit else None


def git_commit(package: Path = PACKAGE) -> Dict[str, str]:
    """epbench's own commit and where it came from: the checkout the package runs from, else the
    stamp written at build time, else unknown."""
    commit = checkout_commit(package)
    stamped = stamped_commit(package / BUILD_INFO)
    if commit:
        out = {"git_commit": commit, "git_commit_from": "checkout"}
        if commit.endswith("+dirty") and stamped and stamped != commit:
            # a dirty tree with another commit stamped: a copy of that commit laid over an older
            # checkout (how the GPU host gets it), so both are named
            out["git_commit_stamped"] = stamped
        return out
    commit = stamped
    if commit:
        return {"git_commit": commit, "git_commit_from": f"build stamp {BUILD_INFO}"}
    return {"git_commit": "unknown", "git_commit_from": "no epbench checkout and no build stamp"}


def _unknown_here(commit: str, package: Path) -> bool:
    """True when the checkout holding ``package`` has no commit ``commit`` (a +dirty suffix aside)."""
    sha = commit.split("+", 1)[0]
    return _run(["git", "cat-file", "-e", f"{sha}^{{commit}}"], cwd=package) is None


def stamp(package: Path = PACKAGE) -> str:
    """Writes the checkout's commit into the package for copies that travel without .git; outside
    a checkout an existing stamp is kept (it names the checkout the copy came from)."""
    path = package / BUILD_INFO
    commit = checkout_commit(package)
    old = stamped_commit(path)
    if commit is None:
        return (f"not in epbench's git checkout: kept the build stamp {old}" if old else
                "not in epbench's git checkout and no build stamp: meta.json will say unknown")
    if commit.endswith("+dirty") and old and _unknown_here(old, package):
        # a stamp made in a newer checkout and carried over an older one (the GPU hosts' copies
        # keep a stale .git): the stale HEAD would be a wrong name, so the stamp stays
        return f"kept the build stamp {old}: a commit this checkout ({commit}) does not hold"
    path.write_text(json.dumps({"git_commit": commit,
                                "stamped_utc": datetime.datetime.now(
                                    datetime.timezone.utc).isoformat()}) + "\n")
    return f"stamped {commit} into {path.name}"


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


def baselines_stamp_path() -> Path:
    return Path(sys.prefix) / BASELINES_STAMP


def baselines_build() -> Dict[str, Any]:
    """The build stamp of the DeepEP flavor `make baselines` installed in this environment
    (flavor, commit, its private NCCL where it has one); {} where none was built."""
    try:
        stamp = json.loads(baselines_stamp_path().read_text())
    except (OSError, ValueError):
        return {}
    return stamp if isinstance(stamp, dict) else {}


def baseline_versions() -> Dict[str, object]:
    """What the baselines in this environment are, for meta.json: the build stamp (flavor,
    commit) and the versions the packages report. Never raises."""
    import importlib.metadata as md

    out: Dict[str, object] = {}
    build = baselines_build()
    if build:
        out["deep_ep_build"] = build
    for dist in ("deep_ep", "nvidia-nvshmem-cu13", "nvidia-nccl-cu13", "flashinfer-python", "apache-tvm-ffi", "uccl"):
        try:
            out[dist] = md.version(dist)
        except md.PackageNotFoundError:
            pass
    return out


def loaded_nccl(maps: str = "/proc/self/maps") -> "tuple[List[str], Optional[tuple[int, ...]]]":
    """The NCCL libraries mapped into this process and the version the first one reports at run
    time (ncclGetVersion). torch.cuda.nccl.version() is the version torch was compiled against,
    which stays 2.28.9 when another libnccl is preloaded (seen on one H100, 2026-11-25)."""
    import ctypes

    paths: List[str] = []
    try:
        with open(maps) as f:
            for line in f:
                path = line.split()[-1] if line.strip() else ""
                if "/libnccl.so" in path and path not in paths:
                    paths.append(path)
    except OSError:
        return [], None
    if not paths:
        return [], None
    try:
        code = ctypes.c_int()
        if ctypes.CDLL(paths[0]).ncclGetVersion(ctypes.byref(code)) != 0:
            return paths, None
    except (OSError, AttributeError):
        return paths, None
    v = code.value  # >= 2.9: major * 10000 + minor * 100 + patch
    return paths, (v // 10000, v // 100 % 100, v % 100)


def runtime_nccl_version() -> Optional["tuple[int, ...]"]:
    """The NCCL version this process runs (the loaded library's own answer; a job may preload
    its own, epbench/backends/deepep_v2_env.py), else torch's."""
    version = loaded_nccl()[1]
    if version is not None:
        return version
    try:
        import torch

        return tuple(torch.cuda.nccl.version())
    except Exception:
        return None


PYTHON_PACKAGES = ("numpy", "pandas")  # besides torch, what epbench computes and writes with


def package_versions() -> Dict[str, str]:
    """epbench's own version and numpy's and pandas' (as installed; "not installed" where one is
    missing), for meta.json. Never raises; imports neither numpy nor pandas."""
    import importlib.metadata as md

    from epbench import __version__

    out = {"epbench": __version__}
    for dist in PYTHON_PACKAGES:
        try:
            out[dist] = md.version(dist)
        except md.PackageNotFoundError:
            out[dist] = "not installed"
    return out


def collect(argv: List[str], device: str) -> Dict[str, Any]:
    """What produced a result (a run's meta.json, ceiling's and predict's files): when, the
    command line, epbench's commit and version, host, platform, the versions of python, torch,
    numpy and pandas, the device, the EPBENCH_ / NCCL_ ... environment and the baselines."""
    import torch

    info: Dict[str, Any] = {
        "started_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(),
        "argv": argv,
        **git_commit(),
        "host": socket.gethostname(),
        "launcher": launch.launcher_record(),  # whether a run left "running" is still going
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        **package_versions(),
        "device": device,
        "env": {k: v for k, v in os.environ.items() if k.startswith(ENV_PREFIXES)},
        "baselines": baseline_versions(),  # external libraries' versions and pinned commits
    }
    if device == "cuda":
        info["cuda"] = torch.version.cuda
        nccl = runtime_nccl_version()  # what runs (a job may preload its own), not torch's build
        info["nccl"] = ".".join(map(str, nccl)) if nccl else "unknown"
        info.update(nvml_info())
        topo = _run(["nvidia-smi", "topo", "-m"])
        info["topology"] = re.sub(r"\x1b\[[0-9;]*m", "", topo) if topo else "skipped: nvidia-smi unavailable"
    return info


if __name__ == "__main__":  # `make build`: python -m epbench.provenance --stamp
    if sys.argv[1:] != ["--stamp"]:
        sys.exit("usage: python -m epbench.provenance --stamp")
    print(stamp())
