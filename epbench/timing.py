"""The one way epbench times a call: per-iteration device events on GPUs, the wall clock on CPUs
(gloo calls block).

On GPUs each timed call is preceded by a short device-side sleep (``HOST_LEAD_US``), then the
cross-rank alignment (``align``: a one-element all-reduce on the stream), then the start event:
while the GPU sleeps, the host queues the alignment and the call itself, so the interval between
the two events is the call's device time and never the host's launch cost. Without it a call
shorter than its own Python/launch overhead (the low-latency kernels at a few tokens) is timed as
GPU idle time waiting for the host. The alignment comes after the sleep because a sleep counts
clock cycles, and idle GPUs run at different clocks: aligning first and sleeping second let
ranks start up to ~40 us apart (measured, 2026-11-21), which a call that waits for its peers
then shows as its own time."""

from __future__ import annotations

import time
from typing import Any, Callable, List, Optional

import torch

HOST_LEAD_US = 150.0  # device sleep before each timed call (> the host's cost to queue one call)
_cycles_per_us: Optional[float] = None


def _sleep_cycles_per_us() -> float:
    """GPU clock cycles of ``torch.cuda._sleep`` per microsecond, measured once per process."""
    global _cycles_per_us
    if _cycles_per_us is None:
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        n = 2_000_000
        torch.cuda._sleep(n)  # warm
        a.record()
        torch.cuda._sleep(n)
        b.record()
        b.synchronize()
        _cycles_per_us = n / max(a.elapsed_time(b) * 1e3, 1.0)
    return _cycles_per_us


def host_lead() -> None:
    """Queues ``HOST_LEAD_US`` of device sleep on the current stream (GPUs only)."""
    torch.cuda._sleep(int(HOST_LEAD_US * _sleep_cycles_per_us()))


class Timer:
    """Per-iteration device events on GPUs, the wall clock on CPUs (gloo calls are blocking)."""

    def __init__(self, device: torch.device, n: int) -> None:
        self.cuda = device.type == "cuda"
        self.n = n
        if self.cuda:
            self.events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                           for _ in range(n)]
        self.wall: List[float] = []

    def time(self, i: int, fn: Callable[[], Any], align: Optional[Callable[[], None]] = None) -> Any:
        """Times ``fn``; ``align`` (the cross-rank sync) runs just before, outside the timed region."""
        if self.cuda:
            start, end = self.events[i]
            host_lead()
            if align is not None:
                align()
            start.record()
            out = fn()
            end.record()
            return out
        if align is not None:
            align()
        t0 = time.perf_counter()
        out = fn()
        self.wall.append((time.perf_counter() - t0) * 1e6)
        return out

    def samples_us(self, skip: int) -> List[float]:
        if self.cuda:
            torch.cuda.synchronize()
            return [s.elapsed_time(e) * 1e3 for s, e in self.events[skip:]]
        return self.wall[skip:]
