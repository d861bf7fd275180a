"""A rank's guard against waiting forever on a peer that stopped answering (stopped by SIGSTOP, hung
in its driver): the main thread marks the regions where it may block on peers' GPU work (a timed call,
the wait for the timed calls' end events, a device synchronize), and a daemon thread ends the rank
with one line when the main thread has sat in one region for longer than the limit.

A loop's first call is left out (epbench/timing.py): a library may compile its kernels there on first use
(Hybrid-EP's nvcc, 8-11 s a point; FlashInfer's JIT, ~3 min once), which is no stall.

Why a thread of its own: where the stuck work is an NCCL collective (the ``reference`` backend's
all_to_all, a barrier), the main thread is blocked inside CUDA and never sees an exception; torch's
NCCL watchdog times the collective out after --control-timeout and then aborts the process (SIGABRT)
about 7 s later, after ~50 lines of its own report (2 x H200, 2026-11-26 20:06 UTC: the run's line was
then "rank 0 was killed by SIGABRT", the consequence, not the cause). The guard's limit is the larger
of --control-timeout and the kernels' own peer timeout (bench.timeout_s), plus GRACE_S, so that the
more precise lines of either still come first where they can, and before the watchdog's abort.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from contextlib import contextmanager
from typing import Callable, Iterator, Optional, Tuple

GRACE_S = 2.0  # beyond the larger of the two timeouts the ranks already keep
POLL_S = 0.1
NAMING_GRACE_S = 0.3  # how long the guard's line waits to learn which peers gave up too


class Guard:
    """One per rank process. ``region(what)`` marks a wait on peers; ``on_stall(line)`` is called
    once, from the guard's thread, when one lasted longer than ``limit_s``."""

    def __init__(self, limit_s: float, on_stall: Callable[[str], None], poll_s: float = POLL_S) -> None:
        self.limit_s = limit_s
        self.on_stall = on_stall
        self.poll_s = poll_s
        self._lock = threading.Lock()
        self._since: Optional[float] = None  # when the outermost open region was entered
        self._what = ""
        self._depth = 0
        self._fired = False
        self._thread = threading.Thread(target=self._watch, name="epbench-stall-guard", daemon=True)
        self._thread.start()

    @contextmanager
    def region(self, what: str) -> Iterator[None]:
        with self._lock:
            if self._depth == 0:
                self._since, self._what = time.monotonic(), what
            self._depth += 1
        try:
            yield
        finally:
            with self._lock:
                self._depth -= 1
                if self._depth == 0:
                    self._since = None

    def _open(self) -> Tuple[Optional[float], str]:
        """(seconds the open region has lasted or None, its name), read together."""
        with self._lock:
            return (None if self._since is None else time.monotonic() - self._since), self._what

    def stalled_for(self) -> Optional[float]:
        """Seconds the open region has lasted (None: none open)."""
        return self._open()[0]

    def close(self) -> None:
        """The guard's thread stops at its next look, having said nothing more."""
        self._fired = True

    def _watch(self) -> None:
        while not self._fired:
            time.sleep(self.poll_s)
            took, what = self._open()
            if took is not None and took > self.limit_s:
                self._fired = True
                self.on_stall(f"{what} made no progress for {took:.0f} s (limit {self.limit_s:g} s: the "
                              f"larger of --control-timeout and bench.timeout_s, + {GRACE_S:g})")


_guard: Optional[Guard] = None


def limit_for(control_timeout_s: float, kernel_timeout_s: float) -> float:
    return max(control_timeout_s, kernel_timeout_s) + GRACE_S


def start(limit_s: float, on_stall: Callable[[str], None]) -> Guard:
    """Starts this process's guard (again: a new limit and action)."""
    stop()
    global _guard
    _guard = Guard(limit_s, on_stall)
    return _guard


def stop() -> None:
    global _guard
    if _guard is not None:
        _guard.close()
    _guard = None


@contextmanager
def region(what: str) -> Iterator[None]:
    """A wait on peers' work, guarded where this process started a guard (else nothing)."""
    g = _guard
    if g is None:
        yield
        return
    with g.region(what):
        yield


def exit_now() -> None:
    """Ends this process at once (after flushing), without waiting for the stuck main thread or
    torch's teardown: what a rank does once its guard said its line."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(1)
