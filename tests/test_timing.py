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


# ---- the host gate (a stream wait on a pinned host flag), against a fake driver ----

class _FakeWait:
    def __init__(self, rc=0):
        self.calls, self.rc = [], rc
        self.restype = self.argtypes = None

    def __call__(self, stream, addr, value, flags):
        self.calls.append((stream.value, addr.value, value.value, flags))
        return self.rc


class _FakeDriver:
    def __init__(self, rc=0):
        self.cuStreamWaitValue32_v2 = _FakeWait(rc)


class _FakeStream:
    cuda_stream = 1234
    syncs = 0

    def synchronize(self):
        _FakeStream.syncs += 1


def _gate(rc=0):
    from epbench.timing import HostGate
    flag = torch.zeros(1, dtype=torch.int32)
    stream = _FakeStream()
    return HostGate(driver=_FakeDriver(rc), alloc=lambda: flag, stream=lambda: stream), flag


def test_host_gate_waits_for_the_value_the_next_open_stores():
    gate, flag = _gate()
    assert gate.status == "on"
    wait = gate.driver.cuStreamWaitValue32_v2
    for _ in range(3):
        gate.close()
        waited = wait.calls[-1][2]
        assert flag.item() == waited - 1  # closed: the flag is one short of the waited value
        gate.open()
        assert flag.item() == waited  # opened: the wait is satisfied
    assert all(c[0] == 1234 and c[1] == flag.data_ptr() and c[3] == 0 for c in wait.calls)


def test_host_gate_values_wrap_as_the_same_32_bits():
    gate, flag = _gate()
    gate.n = (1 << 31) - 1
    gate.close()
    waited = gate.driver.cuStreamWaitValue32_v2.calls[-1][2]
    gate.open()
    assert waited == 1 << 31 and flag.item() & 0xFFFFFFFF == waited
    gate.n = (1 << 32) - 1
    gate.close()
    gate.open()
    assert gate.driver.cuStreamWaitValue32_v2.calls[-1][2] == 0 and flag.item() == 0


def test_host_gate_that_fails_is_off_with_the_reason_and_does_nothing():
    gate, flag = _gate(rc=1)
    assert gate.status.startswith("off (cuStreamWaitValue32 returned CUresult 1")
    n = len(gate.driver.cuStreamWaitValue32_v2.calls)
    gate.close()
    gate.open()
    assert len(gate.driver.cuStreamWaitValue32_v2.calls) == n


def test_host_gate_watchdog_opens_a_gate_whose_call_waits_for_the_device():
    import time as _t
    gate, flag = _gate()
    gate.WATCHDOG_S = 0.2
    gate.close()
    waited = gate.driver.cuStreamWaitValue32_v2.calls[-1][2]
    deadline = _t.monotonic() + 5
    while flag.item() != waited and _t.monotonic() < deadline:
        _t.sleep(0.05)
    assert flag.item() == waited and gate.forced == 1
    assert "watchdog 1 time" in gate.describe()
    gate.open()  # the late open of the same call stores nothing more
    assert flag.item() == waited


# ---- diagnostic switches (epbench/options.py DIAGNOSTICS): the sleep and the gate ----

def test_diagnostic_switches_parse_check_and_name_themselves():
    import pytest

    from epbench import options
    from epbench.errors import UserError

    assert options.diagnostic("host_lead_us", {}) == 150.0
    assert options.diagnostic("host_lead_us", {"EPBENCH_HOST_LEAD_US": "600"}) == 600.0
    assert options.diagnostic("host_gate", {"EPBENCH_HOST_GATE": "0"}) == 0
    assert options.diagnostic("fill_sync", {}) == 0
    with pytest.raises(UserError, match="EPBENCH_HOST_GATE: must be one of 0, 1, got 'off'"):
        options.diagnostic("host_gate", {"EPBENCH_HOST_GATE": "off"})
    with pytest.raises(UserError, match="EPBENCH_HOST_LEAD_US: must be a number in"):
        options.diagnostic("host_lead_us", {"EPBENCH_HOST_LEAD_US": "0"})  # overlap.lead divides by it
    assert options.diagnostics_set({}) == []
    env = {"EPBENCH_FILL_SYNC": "1", "EPBENCH_HOST_LEAD_US": "600", "EPBENCH_OTHER": "x"}
    assert options.diagnostics_set(env) == ["EPBENCH_HOST_LEAD_US=600", "EPBENCH_FILL_SYNC=1"]
    assert options.diagnostic("align", {}) == "alltoall" and options.diagnostic("gate_first", {}) == 1
    assert options.diagnostics_set({"EPBENCH_ALIGN": "allreduce", "EPBENCH_GATE_FIRST": "0"}) == \
        ["EPBENCH_GATE_FIRST=0", "EPBENCH_ALIGN=allreduce"]
    with pytest.raises(UserError, match="EPBENCH_ALIGN: must be one of allreduce, alltoall, got 'ring'"):
        options.diagnostic("align", {"EPBENCH_ALIGN": "ring"})


def test_host_gate_switched_off_by_the_environment_never_touches_the_driver(monkeypatch):
    from epbench.timing import HostGate

    monkeypatch.setenv("EPBENCH_HOST_GATE", "0")
    driver, flag = _FakeDriver(), torch.zeros(1, dtype=torch.int32)
    gate = HostGate(driver=driver, alloc=lambda: flag, stream=lambda: _FakeStream())
    assert gate.status == "off (env EPBENCH_HOST_GATE=0)" and gate.flag is None
    gate.close()
    gate.open()
    assert driver.cuStreamWaitValue32_v2.calls == [] and flag.item() == 0


def test_timing_note_gives_the_sleep_and_gate_in_force_and_every_switch_set(monkeypatch):
    from types import SimpleNamespace

    from epbench import timing

    for var in ("EPBENCH_HOST_LEAD_US", "EPBENCH_HOST_GATE", "EPBENCH_FILL_SYNC"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(timing, "_gate", SimpleNamespace(describe=lambda: "on"))
    monkeypatch.setattr(timing, "_lead_us", None)
    assert timing.method() == ("timing: per-call device events after a 150 us device sleep; host gate "
                               "(graph replays) on")
    monkeypatch.setenv("EPBENCH_HOST_LEAD_US", "612.5")
    monkeypatch.setenv("EPBENCH_FILL_SYNC", "1")
    monkeypatch.setattr(timing, "_lead_us", None)
    note = timing.method()
    assert note.startswith("timing: per-call device events after a 612.5 us device sleep;")
    assert note.endswith("; diagnostic switches set: EPBENCH_HOST_LEAD_US=612.5, EPBENCH_FILL_SYNC=1")
    assert timing.lead_us() == 612.5


def test_a_bad_diagnostic_switch_stops_run_in_one_line(tmp_path):
    from support import assert_one_line_error, epbench_here

    r = epbench_here("run", "scenarios/smoke.yaml", "--device", "cpu", "--results", str(tmp_path),
                     env={"EPBENCH_HOST_LEAD_US": "fast"})
    assert_one_line_error(r, "EPBENCH_HOST_LEAD_US", "must be a number", "'fast'")
    assert not any(tmp_path.iterdir())  # stopped before a results folder was made


class _Recorder:
    """Stands in for events, the sleep and the gate of Timer's GPU path, recording their order."""

    def __init__(self):
        self.order = []

    def event(self, name):
        return type("Ev", (), {"record": lambda _self: self.order.append(name)})()


def _gpu_timer(monkeypatch, rec, gate_first):
    from types import SimpleNamespace

    from epbench import timing

    monkeypatch.setattr(timing, "host_lead", lambda: rec.order.append("sleep"))
    monkeypatch.setattr(timing, "_gate_first", None)
    monkeypatch.setenv("EPBENCH_GATE_FIRST", "1" if gate_first else "0")
    gate = SimpleNamespace(close=lambda: rec.order.append("gate closed"), open=lambda: rec.order.append("gate open"))
    monkeypatch.setattr(timing, "host_gate", lambda: gate)
    t = timing.Timer(torch.device("cpu"), 1)
    t.cuda, t.events = True, [(rec.event("start"), rec.event("end"))]
    return t


def test_the_gate_closes_before_an_alignment_on_the_stream_and_after_one_that_waits_on_the_host(
        monkeypatch):
    def timed(gate_first, on_stream, gated=True):
        rec = _Recorder()
        t = _gpu_timer(monkeypatch, rec, gate_first)
        t.time(0, lambda: rec.order.append("call"), align=lambda: rec.order.append("align"), gated=gated,
               align_on_stream=on_stream)
        return rec.order

    after = ["sleep", "align", "gate closed", "start", "call", "end", "gate open"]
    assert timed(False, True) == after  # switch gate_first=0
    assert timed(True, True) == ["sleep", "gate closed", "align", "start", "call", "end", "gate open"]  # the default
    assert timed(True, False) == after  # an alignment that waits on the host: never behind a closed gate
    assert timed(True, True, gated=False) == ["sleep", "align", "start", "call", "end"]


def test_only_nccl_with_one_rank_per_gpu_aligns_on_the_stream():
    from epbench.launch import Comm

    assert Comm(0, 2, 0, torch.device("cuda", 0)).sync_on_stream
    assert not Comm(0, 2, 0, torch.device("cuda", 0), ranks_per_gpu=2).sync_on_stream
    assert not Comm(0, 2, 0, torch.device("cpu")).sync_on_stream


def test_the_alignment_is_an_all_to_all_unless_switched_to_the_ring_all_reduce(monkeypatch):
    import torch.distributed as dist

    from epbench.launch import Comm

    calls = []
    monkeypatch.setattr(dist, "all_reduce", lambda t: calls.append(("all_reduce", t.numel())))
    monkeypatch.setattr(dist, "all_to_all_single", lambda out, inp: calls.append(("all_to_all", out.numel(), inp.numel())))
    monkeypatch.setattr(torch, "ones", lambda n, device=None: torch.zeros(n).add_(1))  # no CUDA here
    monkeypatch.setattr(torch, "empty", lambda n, device=None: torch.zeros(n))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: calls.append(("synchronize",)))
    for value, want in ((None, ("all_to_all", 4, 4)), ("allreduce", ("all_reduce", 1)), ("alltoall", ("all_to_all", 4, 4))):
        if value:
            monkeypatch.setenv("EPBENCH_ALIGN", value)
        comm = Comm(0, 4, 0, torch.device("cuda", 0))
        calls.clear()
        comm.init_sync()  # the first alignment runs here, untimed and waited for: no gate is closed yet
        assert calls == [want, ("synchronize",)]
        comm.sync()
        assert calls[-1] == want


def test_samples_wait_on_their_own_events_not_the_device(monkeypatch):
    """2 x H200, 2026-11-26: a device-wide synchronize at the end of the timing loop waited for the GEMMs
    queued beside an overlap point, so every communication loop seemed to end after the last GEMM."""
    waited = []

    class Ev:
        def __init__(self, name, t):
            self.name, self.t = name, t

        def synchronize(self):
            waited.append(self.name)

        def elapsed_time(self, other):
            return other.t - self.t

    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: waited.append("device"))
    t = Timer(torch.device("cpu"), 3)
    t.cuda = True
    t.events = [(Ev(f"s{i}", i), Ev(f"e{i}", i + 0.25)) for i in range(3)]
    assert t.samples_us(skip=1) == [250.0, 250.0]
    assert "device" not in waited and waited == ["e1", "e2"]


def test_kernel_backends_wait_on_their_stream_not_the_device_after_the_timing_loop(monkeypatch):
    """The same on the backends' side: epbench's check_errors (called right after each timing loop) waited
    for the whole device, GEMMs beside an overlap point included (1 x H200, 2026-11-26 19:21 UTC: the copy
    row's window was covered, epbench's never)."""
    from types import SimpleNamespace

    from epbench.backends import kernel_common

    done = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: done.append("device"))
    monkeypatch.setattr(torch.cuda, "current_stream",
                        lambda device=None: SimpleNamespace(synchronize=lambda: done.append(("stream", device))))
    kernel_common.wait_then_check("cuda:1", lambda: done.append("checked"))
    assert done == [("stream", "cuda:1"), "checked"]


def test_the_last_timed_calls_end_event_is_kept_for_the_overlap_window(monkeypatch):
    """overlap.concurrent ends the communication loop at its last timed call's end event, not at an event
    recorded after whatever the loop did next."""
    from epbench import timing

    rec = _Recorder()
    timing.last_end(forget=True)
    t = _gpu_timer(monkeypatch, rec, True)
    assert timing.last_end() is None
    t.time(0, lambda: None, gated=False)
    end = t.events[0][1]
    assert timing.last_end() is end and timing.last_end(forget=True) is end and timing.last_end() is None
