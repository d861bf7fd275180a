"""Shared by the GPU tests: run a worker script under torchrun on this host's GPUs, with the
environment every GPU run here must have (no NVLink multicast anywhere, unbuffered output)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Callable, Dict, List, Sequence, Tuple

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


def descendants(pid: int) -> List[int]:
    """Every live process below ``pid`` (Linux /proc), children before grandchildren."""
    parent: Dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parent[int(entry)] = int(f.read().rpartition(")")[2].split()[1])
            except (OSError, ValueError, IndexError):
                pass
    found, todo = [], [pid]
    while todo:
        top = todo.pop(0)
        kids = [c for c, pp in parent.items() if pp == top]
        found += kids
        todo += kids
    return found


def kill_tree(pid: int) -> None:
    """SIGKILL to ``pid`` and every process below it (torchrun puts each rank in a session of its
    own, so its process group does not reach them)."""
    for each in [pid, *descendants(pid)]:
        try:
            os.kill(each, signal.SIGKILL)
        except ProcessLookupError:
            pass


def torchrun(worker: Path, nproc: int, *args: str, timeout: int = 900) -> subprocess.CompletedProcess:
    """The worker under torchrun. Past ``timeout`` s, or when the test is stopped (pytest-timeout,
    Ctrl-C), the whole launch is killed, torchrun and every rank: ranks left behind would hold the
    GPUs for the tests after. A launch that timed out returns what it had printed and says so."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           str(worker), *args]
    p = subprocess.Popen(cmd, env=safe_env(), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = p.communicate(timeout=timeout)
    except BaseException as e:
        kill_tree(p.pid)
        out, err = p.communicate()
        if not isinstance(e, subprocess.TimeoutExpired):
            raise
        err += f"\n(gpu_launch: killed after {timeout} s)"
    return subprocess.CompletedProcess(cmd, p.returncode, out, err)


class SuiteLaunches:
    """The kernel checks of several test modules, one torchrun launch per world size: each module
    adds its suites at import (``add``), and the first test that reads a suite of a world starts
    tests/gpu/suite_worker.py with every suite of that world, in one process group (one process
    start, one CUDA context, one NCCL and IPC set-up instead of one per test). The launch is kept
    for the other tests of that world; each reads its own suite's line, so a failure names the
    test's suite and its failed cases."""

    def __init__(self, worker: Path, timeout: int = 420) -> None:
        self.worker, self.timeout = worker, timeout
        self.suites: Dict[int, Dict[str, Tuple[str, Sequence[str], Callable[[], bool]]]] = {}
        self.done: Dict[int, subprocess.CompletedProcess] = {}

    def add(self, world: int, kind: str, name: str, flags: Sequence[str],
            when: Callable[[], bool] = lambda: True) -> None:
        """Suite ``name`` of ``kind`` (ep | ll, see suite_worker.py) on ``world`` ranks; left out of
        the launch where ``when()`` is False (its tests skip for that reason themselves)."""
        self.suites.setdefault(world, {})[name] = (kind, list(flags), when)

    def launch(self, world: int) -> subprocess.CompletedProcess:
        if world not in self.done:
            specs = [f"{kind}:{name}={' '.join(flags)}" for name, (kind, flags, when) in self.suites[world].items()
                     if when()]
            try:
                self.done[world] = torchrun(self.worker, world, *specs, timeout=self.timeout)
            except BaseException as e:  # stopped from outside: the other tests of this world do not relaunch
                self.done[world] = subprocess.CompletedProcess([], -1, "", f"launch stopped: {e!r}")
                raise
        return self.done[world]

    def assert_passed(self, world: int, *lines: str) -> str:
        """Each of ``lines`` (e.g. 'suite mxfp8 world=3') was printed with PASS by the world's
        launch; returns what the launch printed for the first of them (its lines since the suite
        before it). A failure shows that suite's lines, or the launch's last ones where the line
        never came (the launch crashed or was killed before it)."""
        r = self.launch(world)
        printed = r.stdout.splitlines()
        how = f"\n(launch of {self.worker.name} on {world} ranks, exit {r.returncode})\n"
        sections = []
        for line in lines:
            at = next((i for i in reversed(range(len(printed))) if printed[i].startswith(line + ": ")), None)
            assert at is not None, f"{line}: never reported{how}{r.stdout[-6000:]}\n{r.stderr[-4000:]}"
            start = next((i + 1 for i in reversed(range(at)) if printed[i].startswith("suite ")), 0)
            section = "\n".join(printed[start:at + 1])
            assert printed[at].endswith(": PASS"), f"{printed[at]}{how}{section[-6000:]}\n{r.stderr[-4000:]}"
            sections.append(section)
        return sections[0] if sections else ""


def ll_kernels_built() -> bool:
    """The low-latency kernels are in the built library (an older build lacks them)."""
    from epbench import cuda_lib

    try:
        cuda_lib.load().ep_ll_create
    except (RuntimeError, AttributeError):
        return False
    return True


KERNEL_SUITES = SuiteLaunches(ROOT / "tests" / "gpu" / "suite_worker.py")
