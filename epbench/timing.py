"""The one way epbench times a call: per-iteration device events on GPUs, the wall clock on CPUs
(gloo calls block).

On GPUs each timed call is preceded by a short device-side sleep (``HOST_LEAD_US``) queued before
the start event: while the GPU sleeps, the host queues the call itself, so the interval between
the two events is the call's device time and never the host's launch cost. Without it a call
shorter than its own Python/launch overhead (the low-latency kernels at a few tokens) is timed as
GPU idle time waiting for the host. The sleep follows the cross-rank sync, and every rank sleeps
equally long, so the ranks still start the timed call together."""

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

    def time(self, i: int, fn: Callable[[], Any]) -> Any:
        if self.cuda:
            start, end = self.events[i]
            host_lead()
            start.record()
            out = fn()
            end.record()
            return out
        t0 = time.perf_counter()
        out = fn()
        self.wall.append((time.perf_counter() - t0) * 1e6)
        return out

    def samples_us(self, skip: int) -> List[float]:
        if self.cuda:
            torch.cuda.synchronize()
            return [s.elapsed_time(e) * 1e3 for s, e in self.events[skip:]]
        return self.wall[skip:]
