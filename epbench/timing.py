"""The one way epbench times a call: per-iteration device events on GPUs, the wall clock on CPUs
(gloo calls block).

On GPUs each timed call is preceded by a short device-side sleep (``lead_us()``, 150 us), then the
cross-rank alignment (``align``: on NCCL with one rank per GPU a one-element-per-peer all-to-all on
the stream, which no rank leaves before every rank has entered it), then the start event: while
the GPU sleeps, the host queues the alignment and the call itself, so the interval between the two
events is the call's device time and never the host's launch cost. Without it a call shorter than
its own Python/launch overhead (the low-latency kernels at a few tokens) is timed as GPU idle time
waiting for the host. The alignment comes after the sleep because a sleep counts clock cycles, and
idle GPUs run at different clocks: aligning first and sleeping second let ranks start up to ~40 us
apart (measured, 2026-11-21), which a call that waits for its peers then shows as its own time.

The sleep covers the host's usual cost; a host that is occasionally slower (a garbage
collection, a page fault, another process) would still leave the GPU idle inside the timed region,
which shows as a rare 100 us-1 ms sample. So for graph replays (calls that never wait for the device on
the host; plain launches are not gated, since a backend's call may wait) the stream also waits on a host
gate (``HostGate``:
``cuStreamWaitValue32`` on a flag in pinned host memory) that the host opens only once the end
event is queued: the timed region then never contains host time, however late the host is. Where
the alignment stays on the stream the gate comes before it, so a rank whose host is late holds
every rank at the alignment, before any timer starts; with the gate after the alignment, the late
rank's peers left the alignment and started their timers while it still waited, and its lateness
landed in their timed regions (2 x H200, 2026-11-26, 1 token per rank, epbench-ll graph replays:
p99 104-164 us against p50 12-76 with the gate after a ring all-reduce; p99 within 1.13 x p50 with
the gate before an all-to-all; notes/LATENCY-NEXT.md). Where the alignment waits on the host
(gloo, ranks sharing a GPU) the gate comes after it: a gate before a host-side wait would hold the
GPU until the watchdog. A watchdog opens a gate left closed for 2 s (a call that did wait for the
device) and says so. Where the driver call is not available the gate is off, and the run says so
in a note.

Diagnostic switches (epbench/options.py ``DIAGNOSTICS``, read once per process) change this for
an experiment: EPBENCH_HOST_LEAD_US sets the sleep, EPBENCH_HOST_GATE=0 turns the gate off,
EPBENCH_GATE_LAUNCHES=1 gates the plain launches of backends whose calls never wait on the host too
(their timed iterations only: a first call may load its kernels; driver.py),
EPBENCH_GATE_FIRST=0 closes the gate after the alignment, and EPBENCH_ALIGN=allreduce makes the
alignment a one-element ring all-reduce (launch.Comm.sync; the last two give the method used
before 2026-11-26). The run's timing note (``method``) gives the sleep and the gate's state in
force and names every switch that is set."""

from __future__ import annotations

import contextlib
import ctypes
import threading
import time
from typing import Any, Callable, List, Optional

import torch

from epbench import cudart, options, stall

_lead_us: Optional[float] = None
_cycles_per_us: Optional[float] = None


def lead_us() -> float:
    """The device sleep before each timed call, in us (> the host's cost to queue one call):
    switch host_lead_us (EPBENCH_HOST_LEAD_US, default 150), read once per process."""
    global _lead_us
    if _lead_us is None:
        _lead_us = options.diagnostic("host_lead_us")
    return _lead_us


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


_gate_first: Optional[bool] = None


def gate_first() -> bool:
    """Switch gate_first (EPBENCH_GATE_FIRST, default 1): the host gate before the alignment; read
    once per process."""
    global _gate_first
    if _gate_first is None:
        _gate_first = bool(options.diagnostic("gate_first"))
    return _gate_first


def host_lead() -> None:
    """Queues ``lead_us()`` of device sleep on the current stream (GPUs only)."""
    torch.cuda._sleep(int(lead_us() * _sleep_cycles_per_us()))


WAIT_VALUE_GEQ = 0x0  # CU_STREAM_WAIT_VALUE_GEQ: (int32)(*addr - value) >= 0, wrap-safe


class HostGate:
    """A stream wait on a 32-bit flag in pinned host memory: ``close()`` queues "wait until the
    flag reaches n + 1" on the current stream, ``open()`` (after the host has queued the timed
    work) stores n + 1. ``driver``: libcuda (tests pass a fake); ``status`` says whether the gate
    is on, or why not (then close/open do nothing): switch host_gate 0 (EPBENCH_HOST_GATE=0) keeps
    it off without touching the driver."""

    def __init__(self, driver: Any = None, alloc: Optional[Callable[[], torch.Tensor]] = None,
                 stream: Optional[Callable[[], Any]] = None) -> None:
        self.n = 0
        self.flag: Optional[torch.Tensor] = None
        self.status = "off"
        self.lock = threading.Lock()
        self.closed_at: Optional[float] = None
        self.forced = 0
        self.watchdog: Optional[threading.Thread] = None
        self.stream = stream or torch.cuda.current_stream
        if not options.diagnostic("host_gate"):
            self.status = f"off (env {options.DIAGNOSTICS['host_gate'].env}=0)"
            return
        try:
            self.driver = cudart.driver(driver)
            self.wait = cudart.stream_wait_value32(self.driver)
            # pinned host memory is mapped at the same address on the device (unified addressing)
            self.flag = (alloc or (lambda: torch.zeros(1, dtype=torch.int32, pin_memory=True)))()
            self._close(self.stream())  # a first round trip proves the wait works here
            self._store()
            self.stream().synchronize()
            self.status = "on"
        except Exception as e:  # no driver symbol, an old driver, no pinned memory: sleep only
            self.flag = None
            self.status = f"off ({str(e).splitlines()[0][:120] if str(e) else type(e).__name__})"

    WATCHDOG_S = 2.0  # a gate closed this long is opened by the watchdog (the call synchronised)

    def _watch(self) -> None:
        """Opens a gate left closed for WATCHDOG_S: a timed call that waits for the device on the
        host would otherwise wait for a gate that only its own return opens. Counted in ``forced``."""
        while True:
            time.sleep(self.WATCHDOG_S / 4)
            closed_at = self.closed_at
            if closed_at is not None and time.monotonic() - closed_at > self.WATCHDOG_S:
                with self.lock:
                    if self.closed_at is closed_at:
                        self.forced += 1
                        self._store()

    def _store(self) -> None:
        self.n = (self.n + 1) & 0xFFFFFFFF
        self.flag[0] = self.n - (1 << 32) if self.n >= 1 << 31 else self.n  # the same 32 bits
        self.closed_at = None

    def _close(self, stream: Any) -> None:
        rc = self.wait(ctypes.c_void_p(stream.cuda_stream), ctypes.c_uint64(self.flag.data_ptr()),
                       ctypes.c_uint32((self.n + 1) & 0xFFFFFFFF), WAIT_VALUE_GEQ)
        if rc != 0:
            raise RuntimeError(f"cuStreamWaitValue32 returned CUresult {rc}")

    def close(self) -> None:
        if self.flag is not None:
            with self.lock:
                self._close(self.stream())
                self.closed_at = time.monotonic()
            if self.watchdog is None:
                self.watchdog = threading.Thread(target=self._watch, name="epbench-gate", daemon=True)
                self.watchdog.start()

    def open(self) -> None:
        if self.flag is not None:
            with self.lock:
                if self.closed_at is not None:
                    self._store()

    def describe(self) -> str:
        forced = f"; opened by its watchdog {self.forced} time(s): a timed call waited for the device" \
            if self.forced else ""
        return self.status + forced


_gate: Optional[HostGate] = None


def host_gate() -> HostGate:
    """The process's one gate (GPUs only), created on first use."""
    global _gate
    if _gate is None:
        _gate = HostGate()
    return _gate


def gated_launches() -> str:
    """The note's words for switch gate_launches: which plain launches the gate also holds."""
    return ("; plain launches of epbench and epbench-ll in their timed iterations"
            if options.diagnostic("gate_launches") else "")


def method() -> str:
    """How timed calls are isolated from the host on this process's GPU, for a run's notes: the
    sleep and the gate in force, and every diagnostic switch set."""
    switches = options.diagnostics_set()
    return (f"timing: per-call device events after a {lead_us():g} us device sleep; host gate "
            f"(graph replays{gated_launches()}) {host_gate().describe()}"
            + (f"; diagnostic switches set: {', '.join(switches)}" if switches else ""))


_last_end: Optional[Any] = None  # the end event of this process's last timed call (GPUs)


def last_end(forget: bool = False) -> Optional[Any]:
    """The end event of the last call any Timer timed in this process (None if none since the last
    ``forget``): where a timing loop's calls ended, whatever the loop did after them (overlap.py)."""
    global _last_end
    ev = _last_end
    if forget:
        _last_end = None
    return ev


class Timer:
    """Per-iteration device events on GPUs, the wall clock on CPUs (gloo calls are blocking)."""

    def __init__(self, device: torch.device, n: int) -> None:
        self.cuda = device.type == "cuda"
        self.n = n
        if self.cuda:
            self.events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                           for _ in range(n)]
        self.wall: List[float] = []

    def time(self, i: int, fn: Callable[[], Any], align: Optional[Callable[[], None]] = None,
             gated: bool = False, align_on_stream: bool = False) -> Any:
        """Times ``fn``; ``align`` (the cross-rank sync) runs just before, outside the timed region.
        ``gated``: ``fn`` never waits for the device on the host (a graph replay), so the stream
        may also wait on the host gate: closed after ``align`` (which may synchronise), or before
        it under switch gate_first where ``align_on_stream`` says it never waits on the host."""
        # a loop's first call may compile (Hybrid-EP's nvcc, FlashInfer's JIT): not guarded
        with stall.region("a timed call") if i else contextlib.nullcontext():
            return self._time(i, fn, align, gated, align_on_stream)

    def _time(self, i: int, fn: Callable[[], Any], align: Optional[Callable[[], None]],
              gated: bool, align_on_stream: bool) -> Any:
        global _last_end
        if self.cuda:
            start, end = self.events[i]
            host_lead()
            gate = host_gate() if gated else None
            first = gate is not None and align_on_stream and gate_first()
            if first:
                gate.close()
            if align is not None:
                align()
            if gate is not None and not first:
                gate.close()
            try:
                start.record()
                out = fn()
                end.record()
                _last_end = end
            finally:  # never leave the stream waiting on a flag nobody will set
                if gate is not None:
                    gate.open()
            return out
        if align is not None:
            align()
        t0 = time.perf_counter()
        out = fn()
        self.wall.append((time.perf_counter() - t0) * 1e6)
        return out

    def samples_us(self, skip: int) -> List[float]:
        if self.cuda:
            # each end event (its start is earlier on the same stream), not the device: work queued on
            # other streams, the GEMMs beside an overlap point, must not end the loop it is measured over
            for _, e in self.events[skip:]:  # one region per call: a backlog still moving is no stall
                with stall.region("the wait for a timed call's end"):
                    e.synchronize()
            return [s.elapsed_time(e) * 1e3 for s, e in self.events[skip:]]
        return self.wall[skip:]
