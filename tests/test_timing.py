"""The timer every measurement goes through (CPU path; the GPU path is exercised by the GPU tests)."""

import torch

from epbench.timing import Timer


def test_cpu_timer_keeps_samples_after_warmup():
    t = Timer(torch.device("cpu"), 4)
    for i in range(4):
        t.time(i, lambda: sum(range(1000)))
    samples = t.samples_us(skip=1)
    assert len(samples) == 3 and all(s > 0 for s in samples)
