"""The timer every measurement goes through (CPU path; the GPU path is exercised by the GPU tests)."""

import torch

from epbench.timing import Timer


def test_cpu_timer_keeps_samples_after_warmup():
    t = Timer(torch.device("cpu"), 4)
    for i in range(4):
        t.time(i, lambda: sum(range(1000)))
    samples = t.samples_us(skip=1)
    assert len(samples) == 3 and all(s > 0 for s in samples)


def test_align_runs_before_the_call_and_outside_the_timed_interval():
    import time

    order = []
    t = Timer(torch.device("cpu"), 2)
    for i in range(2):
        t.time(i, lambda: order.append("call"), align=lambda: (order.append("align"), time.sleep(0.05)))
    assert order == ["align", "call", "align", "call"]
    assert all(s < 40_000 for s in t.samples_us(skip=0))  # the 50 ms alignment is not in the samples
