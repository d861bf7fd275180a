"""epbench/clocks.py: NVML clock and power samples per phase, and the overlap table of them."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pandas as pd
import pytest

from epbench import clocks
from epbench import overlap as ov


class FakeNvml:
    """Answers the calls a Watch makes from scripted values (each call takes the next one; the last repeats)."""

    class NVMLError(Exception):
        pass

    def __init__(self, mhz, watts, masks, *, refuse_power=False, old_name=False):
        self.mhz, self.watts, self.masks = list(mhz), list(watts), list(masks)
        self.refuse_power = refuse_power
        self.lock = threading.Lock()
        if old_name:
            self.nvmlDeviceGetCurrentClocksThrottleReasons = self._mask
        else:
            self.nvmlDeviceGetCurrentClocksEventReasons = self._mask

    @staticmethod
    def _next(values):
        return values.pop(0) if len(values) > 1 else values[0]

    def nvmlDeviceGetClockInfo(self, handle, kind):
        assert handle == "h" and kind == clocks.NVML_CLOCK_SM
        with self.lock:
            return self._next(self.mhz)

    def nvmlDeviceGetPowerUsage(self, handle):
        if self.refuse_power:
            raise self.NVMLError("not supported")
        with self.lock:
            return self._next(self.watts)

    def _mask(self, handle):
        with self.lock:
            return self._next(self.masks)

    def nvmlDeviceGetEnforcedPowerLimit(self, handle):
        return 700_000


def test_a_phase_holds_the_median_clock_mean_power_and_every_reason_seen():
    nvml = FakeNvml([1980, 1700, 1750], [500_000, 700_000], [0x1, 0x4, 0x4 | 0x20])
    watch = clocks.Watch(nvml, "h", period_s=0.001)
    r = clocks.Reading()
    for _ in range(3):
        watch.sample(r)
    assert r.samples == 3 and r.sm_mhz == 1750.0
    assert r.power_w == pytest.approx((500 + 700 + 700) / 3)
    assert r.reasons == "sw-power-cap,sw-thermal"  # idle left out, every sample's bits
    assert r.fields("pair") == {"pair_sm_mhz": 1750.0, "pair_power_w": r.power_w, "pair_clock_reasons": r.reasons}
    assert watch.power_limit_w() == 700.0


def test_the_sampler_runs_while_the_phase_runs_and_stops_after():
    nvml = FakeNvml([1500], [600_000], [0])
    watch = clocks.Watch(nvml, "h", period_s=0.001)
    with watch.phase() as r:
        time.sleep(0.05)
    n = r.samples
    assert n >= 5 and r.sm_mhz == 1500.0 and r.reasons == ""
    time.sleep(0.02)
    assert r.samples == n  # stopped with the phase
    assert not [t for t in threading.enumerate() if t.name == "epbench-clocks"]


def test_refused_values_are_left_out_and_the_older_reason_call_is_used():
    nvml = FakeNvml([1800], [0], [0x8], refuse_power=True, old_name=True)
    r = clocks.Reading()
    clocks.Watch(nvml, "h").sample(r)
    assert r.sm_mhz == 1800.0 and r.power_w is None and r.reasons == "hw-slowdown"


def test_no_nvml_gives_empty_readings_and_one_reason(monkeypatch):
    from epbench import counters

    monkeypatch.setattr(counters, "_import_nvml", lambda: (None, "no NVML: nvidia-ml-py is not installed"))
    watch, why = clocks.open_watch(0, identity=counters.GpuIdentity("0000:18:00.0", None))
    assert isinstance(watch, clocks.NoWatch) and why == "clocks: not read (no NVML: nvidia-ml-py is not installed)"
    with watch.phase() as r:
        pass
    assert r.samples == 0 and r.fields("x") == {"x_sm_mhz": None, "x_power_w": None, "x_clock_reasons": None}
    assert clocks.clock_kept_pct(None, 1500.0) is None and clocks.clock_kept_pct(2000.0, 1500.0) == 75.0


def test_unknown_reason_bits_are_named_in_hex():
    assert clocks.reason_names(0x1 | 0x4 | 0x1000) == ["sw-power-cap", "0x1000"]


class ScriptedWatch:
    """A watch whose phases read, in order, the clocks given."""

    def __init__(self, mhz):
        self.mhz = list(mhz)

    def phase(self):
        import contextlib

        @contextlib.contextmanager
        def cm():
            r = clocks.Reading()
            r.mhz.append(self.mhz.pop(0))
            yield r

        return cm()


def test_a_point_records_the_gemm_clock_alone_and_beside(monkeypatch):
    """The point's phases in order: the communication alone, the GEMM in its partition alone, the pair;
    the clock kept is the pair's over the confined GEMM's."""
    import torch

    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(ov, "comm_loop_alone", lambda lp: (lp(), 500.0))
    monkeypatch.setattr(ov, "set_carveout", lambda n: None)
    monkeypatch.setattr(ov, "time_gemm", lambda gemm, n, part: 100.0)
    win = ov.Window([(0.0, 100.0 * i + 100.0) for i in range(10)], 5.0, 800.0, {"dispatch": [1.0], "combine": [1.0]})
    monkeypatch.setattr(ov, "concurrent", lambda gemm, n, part, lp: win)
    opts = ov.OverlapOptions(("epbench",), (8,), 1, 1, ov.parse_gemm(None))
    loop = lambda: {"dispatch": [1.0], "combine": [1.0]}  # noqa: E731
    timed = []

    def time_gemm(gemm, n, part):
        timed.append(n)
        return (100.0, 120.0, 110.0)[len(timed) - 1]  # the burst, the loop before the pair, the window after it

    monkeypatch.setattr(ov, "time_gemm", time_gemm)
    row, _ = ov._Point(SimpleNamespace(flops=1e9), 90.0, SimpleNamespace(sms=120, want=120), 132, opts,
                       watch=ScriptedWatch([1900.0, 1980.0, 1700.0, 1683.0, 1780.0])).measure(loop)
    assert (row["comm_alone_sm_mhz"], row["gemm_confined_sm_mhz"], row["gemm_before_sm_mhz"], row["pair_sm_mhz"],
            row["gemm_window_sm_mhz"]) == (1900.0, 1980.0, 1700.0, 1683.0, 1780.0)
    assert row["gemm_clock_kept_pct"] == pytest.approx(100.0 * 1683.0 / 1780.0)  # the pair against the window
    # the window: as many GEMMs as the pair ran, its time the window's reference
    assert timed[0] == ov.OverlapOptions.gemm_iters and timed[2] == row["gemm_count"] and row["gemm_window_us"] == 110.0
    assert row["gemm_kept_of_window_pct"] == pytest.approx(ov.kept_pct(110.0, row["gemm_beside_us"]))
    # before the pair: as many GEMMs as the pair was sized for; around = the mean of before and after
    assert timed[1] == ov.gemm_loop_count(500.0, 100.0) and row["gemm_before_us"] == 120.0
    assert row["gemm_kept_of_around_pct"] == pytest.approx(ov.kept_pct(115.0, row["gemm_beside_us"]))
    # no partition (ranks share a GPU): the burst's clock is the all-SM GEMM's reading
    timed.clear()
    all_reading = clocks.Reading(mhz=[1950.0])
    row, _ = ov._Point(SimpleNamespace(flops=1e9), 90.0, None, 132, opts,
                       watch=ScriptedWatch([1900.0, 1960.0, 1755.0, 1950.0]),
                       gemm_all_reading=all_reading).measure(loop)
    assert row["gemm_confined_sm_mhz"] == 1950.0 and row["gemm_clock_kept_pct"] == pytest.approx(90.0)
    assert timed == [ov.gemm_loop_count(500.0, 90.0), row["gemm_count"]]


def test_the_clock_table_shows_the_rank_whose_clock_fell_most_and_is_absent_without_clocks():
    from rich.console import Console

    from epbench.report import overlap_clock_table

    df = pd.DataFrame([{"backend": "epbench", "call_mode": "call", "sms": 8, "rank": r, "gemm_confined_sm_mhz": 1965.0,
                        "gemm_window_sm_mhz": 1980.0, "pair_sm_mhz": mhz, "gemm_clock_kept_pct": 100.0 * mhz / 1980.0,
                        "gemm_kept_of_window_pct": 91.5, "gemm_window_power_w": 650.0,
                        "pair_power_w": 699.0, "power_limit_w": 700.0, "pair_clock_reasons": why}
                       for r, mhz, why in ((0, 1900.0, ""), (1, 1683.0, "sw-power-cap"))])
    console = Console(width=120, record=True)
    console.print(overlap_clock_table(df))
    text = console.export_text()
    assert "1683" in text and "85.0" in text and "sw-power-cap" in text and "1900" not in text
    assert overlap_clock_table(df.drop(columns=["gemm_clock_kept_pct"])) is None
    assert overlap_clock_table(df.assign(gemm_clock_kept_pct=None)) is None
