"""The stall guard (epbench/stall.py): a rank whose main thread sits in a wait on its peers past the
limit gets its one line from the guard's thread; a wait that ends in time, or no wait at all, never."""

from __future__ import annotations

import threading
import time

from epbench import stall


def guard(limit: float):
    said = []
    fired = threading.Event()

    def on_stall(line: str) -> None:
        said.append(line)
        fired.set()

    return stall.Guard(limit, on_stall, poll_s=0.01), said, fired


def test_a_wait_past_the_limit_is_said_once_with_where_it_stuck():
    g, said, fired = guard(0.1)
    with g.region("a timed call"):
        with g.region("a device synchronize"):  # nested: the outermost region names the wait
            assert fired.wait(5)
            time.sleep(0.1)
    g.close()
    assert len(said) == 1 and said[0].startswith("a timed call made no progress for 0 s (limit 0.1 s")


def test_waits_within_the_limit_and_time_outside_a_region_are_not_stalls():
    g, said, _ = guard(0.2)
    for _ in range(5):
        with g.region("a timed call"):
            time.sleep(0.05)
        time.sleep(0.1)  # outside any region: compiling, writing rows
    time.sleep(0.3)
    g.close()
    assert said == [] and g.stalled_for() is None


def test_the_limit_lets_the_ranks_own_timeouts_speak_first():
    assert stall.limit_for(10, 30) == 30 + stall.GRACE_S
    assert stall.limit_for(300, 10) == 300 + stall.GRACE_S


def test_without_a_started_guard_regions_cost_nothing_and_say_nothing():
    stall.stop()
    with stall.region("a timed call"):
        pass
    said = []
    stall.start(0.05, said.append)
    try:
        with stall.region("the wait for the timed calls"):
            deadline = time.monotonic() + 5
            while not said and time.monotonic() < deadline:
                time.sleep(0.01)
    finally:
        stall.stop()
    assert len(said) == 1 and said[0].startswith("the wait for the timed calls made no progress")


def test_a_loops_first_call_is_not_guarded_the_next_ones_are():
    """A library may compile on its first call (Hybrid-EP's nvcc, 8-11 s a point): no stall there."""
    import torch

    from epbench.timing import Timer

    said = []
    stall.start(0.05, said.append)
    try:
        timer = Timer(torch.device("cpu"), 2)
        timer.time(0, lambda: time.sleep(0.3))
        assert said == []
        timer.time(1, lambda: time.sleep(1.0))
    finally:
        stall.stop()
    assert len(said) == 1 and said[0].startswith("a timed call made no progress")


def test_a_backlog_still_moving_is_no_stall():
    """The wait for the timed calls is one region per call: ten calls ending 30 ms apart against a
    0.1 s limit are progress, not a stall (a review's demonstration)."""
    import torch

    from epbench.timing import Timer

    said = []
    stall.start(0.1, said.append)
    try:
        timer = Timer(torch.device("cpu"), 1)
        timer.cuda = True  # the event path, with events that end one after another
        t0 = time.monotonic()

        class Ev:
            def __init__(self, at):
                self.at = at

            def synchronize(self):
                time.sleep(max(0.0, t0 + self.at - time.monotonic()))

            def elapsed_time(self, end):
                return 0.001

        timer.events = [(Ev(0.0), Ev(0.03 * (i + 1))) for i in range(10)]
        assert timer.samples_us(0) == [1.0] * 10  # took 0.3 s, no wait on one call over 0.03 s
    finally:
        stall.stop()
    assert said == []
