"""The one way epbench times a call: per-iteration device events on GPUs (recorded on the
current stream, so the host may run ahead), the wall clock on CPUs (gloo calls block)."""

from __future__ import annotations

import time
from typing import Any, Callable, List

import torch


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
