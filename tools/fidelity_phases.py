"""A backend's dispatch and combine, phase by phase: the `reference` backend beside NCCL's bare
all-to-all and the `symm-mem` backend beside torch's bare all_to_all_vdev (tools/fidelity_calls.py
runs this after the bare call, so that the fidelity check says where the backend's time goes).

The check's figure for those libraries is one bare call; the backend does more around it. This
times the backend's own code on the same shape, step by step: each method that the backend's
``PHASES`` names is wrapped so that a mark (a device event on GPUs, the wall clock on CPUs) is taken
as it returns; the call's first mark is taken where epbench's timer takes its start event (after
the device sleep and the ranks' alignment, epbench/timing.py). A phase's time is its mark minus the
one before. Device work queued between two wrapped methods would count in the next phase; the
methods hold all of it (epbench/backends/reference.py, epbench/backends/symm_mem.py).

Each call mode runs as epbench's driver builds its points (``driver.Point``: the same inputs,
rotating input sets, the kernel mode's splits prepared once per set, the stand-in expert between
the calls): first ``warmup + iters`` calls unmarked, timed whole by the driver's own loop and
checked as it checks them, then as many marked. The unmarked whole call is what the phases are
held against: their sum on the same rank should come close to it.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Dict, List, Optional, Tuple

OPS = ("dispatch", "combine")
MODES = ("kernel", "call")
END = "end of call"  # the mark taken when the call returns (not a phase)


class PhaseClock:
    """Marks taken inside timed calls: per call, the op and a list of (phase, mark)."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda
        self.calls: List[Tuple[str, List[Tuple[str, Any]]]] = []
        self._open: Optional[List[Tuple[str, Any]]] = None

    def _now(self) -> Any:
        if self.cuda:
            import torch

            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    def mark(self, phase: str) -> None:
        """The end of ``phase``; outside a timed call (the kernel mode's splits, made while its
        inputs are prepared) nothing is taken."""
        if self._open is not None:
            self._open.append((phase, self._now()))

    def time(self, op: str, fn: Callable[[], Any], align: Callable[[], None]) -> Any:
        """Runs ``fn`` as epbench's timer runs a call (device sleep, alignment, then the start)."""
        if self.cuda:
            from epbench.timing import host_lead

            host_lead()
        align()
        self._open = [("start", self._now())]
        try:
            return fn()
        finally:
            self._open.append((END, self._now()))
            self.calls.append((op, self._open))
            self._open = None

    def phases_us(self, op: str, skip: int) -> List[Dict[str, float]]:
        """Per call of ``op`` after the first ``skip``: {phase: us}, in the order the phases ran."""
        if self.cuda:
            import torch

            torch.cuda.synchronize()
        out = []
        for marks in [m for o, m in self.calls if o == op][skip:]:
            got: Dict[str, float] = {}
            for (_, a), (phase, b) in zip(marks, marks[1:]):
                if phase != END:
                    got[phase] = got.get(phase, 0.0) + self._us(a, b)
            out.append(got)
        return out

    def _us(self, a: Any, b: Any) -> float:
        return a.elapsed_time(b) * 1e3 if self.cuda else (b - a) * 1e6

    def unmarked_share(self, op: str, skip: int) -> List[float]:
        """Per call of ``op`` after the first ``skip``: the share of the call after its last phase
        (work no phase holds; ~0 where the phases cover the call)."""
        if self.cuda:
            import torch

            torch.cuda.synchronize()
        out = []
        for marks in [m for o, m in self.calls if o == op][skip:]:
            whole = self._us(marks[0][1], marks[-1][1])
            out.append(self._us(marks[-2][1], marks[-1][1]) / whole if whole > 0 else 0.0)
        return out


def instrument(be: Any, clock: PhaseClock) -> None:
    """Wraps the backend object's phase methods (``be.PHASES``) so that each marks its end."""
    for steps in be.PHASES.values():
        for phase, method in steps:
            setattr(be, method, _marked(getattr(be, method), clock, phase))


def _marked(fn: Callable[..., Any], clock: PhaseClock, phase: str) -> Callable[..., Any]:
    def call(*args: Any, **kwargs: Any) -> Any:
        out = fn(*args, **kwargs)
        clock.mark(phase)
        return out

    return call


def _marked_loop(point: Any, comm: Any, clock: PhaseClock, warmup: int, iters: int) -> None:
    """The driver's loop (driver._time_pair) with the clock in place of its timers."""
    calls, sets = point.calls, point.sets
    for i in range(warmup + iters):
        if len(sets) > 1 or i == 0:
            calls.load(sets[i % len(sets)])
        out = clock.time("dispatch", calls.dispatch, comm.sync)
        calls.fill(out)
        clock.time("combine", lambda: calls.combine(out), comm.sync)


def measure(comm: Any, s: Any, warmup: int, iters: int, input_sets: int,
            modes: Tuple[str, ...] = MODES, make: Optional[Callable[[Any], Any]] = None) -> Dict[str, Any]:
    """This rank's figures per call mode: ``whole_us`` {op: samples} of the unmarked calls,
    ``wrong`` {op: rows} of their check, ``order`` {op: phases}, ``phases_us`` {op: {phase:
    samples}} and ``unmarked_share`` {op: per call, the share after the last phase} of the marked
    calls. ``make``: the backend from this rank's setup (default: the reference)."""
    from epbench.driver import Point, rank_setup
    from epbench.routing import route_all

    if make is None:
        from epbench.backends.reference import ReferenceBackend as make
    be = make(rank_setup(s, comm))
    clock = PhaseClock(comm.device.type == "cuda")
    instrument(be, clock)
    routings = route_all(s)
    out: Dict[str, Any] = {}
    try:
        for mode in modes:
            be.use_call_mode(mode)
            point = Point(be, s, routings, 0, comm, input_sets)
            whole = point.time(warmup, iters)
            checked = dict(zip(OPS, point.check_last()))
            clock.calls.clear()
            _marked_loop(point, comm, clock, warmup, iters)
            rec: Dict[str, Any] = {"whole_us": whole, "wrong": {op: int(c.wrong) for op, c in checked.items()},
                                   "order": {}, "phases_us": {}}
            for op in OPS:
                calls = clock.phases_us(op, warmup)
                order = list(calls[0]) if calls else []
                rec["order"][op] = order
                rec["phases_us"][op] = {ph: [c.get(ph, 0.0) for c in calls] for ph in order}
            rec["unmarked_share"] = {op: clock.unmarked_share(op, warmup) for op in OPS}
            out[mode] = rec
    finally:
        be.close()
    return out


def gather(everyone: List[Dict[str, Any]]) -> Dict[str, Any]:
    """Every rank's ``measure`` -> per mode: ``order`` (rank 0's), and ``whole_us``, ``wrong``,
    ``phases_us``, ``unmarked_share`` keyed by rank (as strings, as JSON keeps them)."""
    out: Dict[str, Any] = {}
    for rank, mine in enumerate(everyone):
        for mode, rec in mine.items():
            m = out.setdefault(mode, {"order": rec["order"], "whole_us": {op: {} for op in OPS},
                                      "wrong": {op: {} for op in OPS}, "phases_us": {op: {} for op in OPS},
                                      "unmarked_share": {op: {} for op in OPS}})
            for op in OPS:
                m["whole_us"][op][str(rank)] = rec["whole_us"][op]
                m["unmarked_share"][op][str(rank)] = rec["unmarked_share"][op]
                m["wrong"][op][str(rank)] = rec["wrong"][op]
                for ph, samples in rec["phases_us"][op].items():
                    m["phases_us"][op].setdefault(ph, {})[str(rank)] = samples
    return out
