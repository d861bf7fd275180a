"""Backends that misbehave on purpose, for the fault tests (registered by tests/fault_epbench.py, in
the run's processes only; never part of epbench itself). Rank FAULT_RANK misbehaves at its first
dispatch; it first writes its pid to EPBENCH_TEST_MARK (when set), so a test knows when and whom."""

from __future__ import annotations

import os
import time

from epbench.backends.epbench_kernels import EpbenchBackend
from epbench.backends.reference import ReferenceBackend

FAULT_RANK = 1


def _mark(rank: int) -> bool:
    if rank != FAULT_RANK:
        return False
    mark = os.environ.get("EPBENCH_TEST_MARK")
    if mark:
        with open(mark, "w") as f:
            f.write(f"{os.getpid()} {time.time()}\n")
    return True


class HangingBackend(ReferenceBackend):
    """Rank 1 stops answering at its first dispatch (sleeps for ever)."""

    name = "test-hang"

    def dispatch(self, inp, num_sms):
        if _mark(self.s.rank):
            while True:
                time.sleep(60)
        return super().dispatch(inp, num_sms)


class StuckBackend(ReferenceBackend):
    """Every rank stops inside its second dispatch (a loop's first call is not guarded: a library may
    compile there), as a main thread blocked in a CUDA wait on a peer whose collective never ends (no
    control-plane wait is pending, so only the stall guard can end it: epbench/stall.py)."""

    name = "test-stuck"
    _calls = 0

    def dispatch(self, inp, num_sms):
        StuckBackend._calls += 1
        if StuckBackend._calls >= 2:
            _mark(self.s.rank)
            while True:
                time.sleep(60)
        return super().dispatch(inp, num_sms)


class AbortingBackend(ReferenceBackend):
    """Rank 1 aborts its process at its first dispatch (as a device assert or a segfault in a
    third-party library would)."""

    name = "test-abort"

    def dispatch(self, inp, num_sms):
        if _mark(self.s.rank):
            os.abort()
        return super().dispatch(inp, num_sms)


class LateSenderBackend(EpbenchBackend):
    """epbench's kernels, with rank 1 sending late at its first dispatch: it sleeps past the
    kernel timeout first, so its peers' kernels give up waiting for it (GPU test)."""

    name = "test-late-sender"
    _late = True

    def dispatch(self, inp, num_sms):
        if LateSenderBackend._late and _mark(self.s.rank):
            LateSenderBackend._late = False
            time.sleep(self.s.timeout_s + 2.0)
        return super().dispatch(inp, num_sms)
