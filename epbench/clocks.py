"""The rank's GPU clock and power while a phase runs, sampled through NVML.

Why: beside any kernel that moves bytes (epbench's, a baseline's, or the plain copy kernel of the
overlap calibration) the GEMM keeps 83-92 % of its confined speed; if the GPU lowers its SM clock
when both run (a power cap), the GEMM loses that share whatever the communication does. Reading the
clock while each phase runs tells the two apart.

A ``Watch`` samples one GPU from a background thread every ``PERIOD_S`` while a ``with
watch.phase() as reading:`` block runs; the reading then holds

- ``sm_mhz``: the median SM clock of the samples (``nvmlDeviceGetClockInfo``, NVML_CLOCK_SM);
- ``power_w``: the mean board power of the samples (``nvmlDeviceGetPowerUsage``; NVML averages
  it over a window of its own, so it lags a short phase);
- ``reasons``: every clock-limiting reason seen in any sample (``nvmlDeviceGetCurrentClocksEventReasons``,
  named by ``REASONS``), the GPU idle reason left out;
- ``samples``: how many samples it holds (0: none, and the figures are None).

The NVML calls go through ctypes, which releases the GIL while the driver answers, and both sides
of every comparison (alone and beside) run with the sampler on.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Dict, Iterator, List, Optional, Tuple

PERIOD_S = 0.005
NVML_CLOCK_SM = 1
REASONS = {  # NVML's clocks-event reason bits (nvml.h, nvmlClocksEventReason*)
    0x1: "idle", 0x2: "app-clocks", 0x4: "sw-power-cap", 0x8: "hw-slowdown", 0x10: "sync-boost",
    0x20: "sw-thermal", 0x40: "hw-thermal", 0x80: "hw-power-brake", 0x100: "display-clocks",
}
IDLE = 0x1


def reason_names(mask: int) -> List[str]:
    """The names of the bits set in ``mask`` (idle left out), lowest bit first; unknown bits as hex."""
    names = [name for bit, name in sorted(REASONS.items()) if mask & bit and bit != IDLE]
    rest = mask & ~sum(REASONS)
    return names + ([hex(rest)] if rest else [])


@dataclass
class Reading:
    """What the samples of one phase say (see the module's docstring)."""

    mhz: List[float] = field(default_factory=list)
    watts: List[float] = field(default_factory=list)
    mask: int = 0

    @property
    def samples(self) -> int:
        return len(self.mhz)

    @property
    def sm_mhz(self) -> Optional[float]:
        from epbench import metrics

        return metrics.median(self.mhz) if self.mhz else None

    @property
    def power_w(self) -> Optional[float]:
        return sum(self.watts) / len(self.watts) if self.watts else None

    @property
    def reasons(self) -> Optional[str]:
        return ",".join(reason_names(self.mask)) if self.mhz else None

    def fields(self, prefix: str) -> Dict[str, Any]:
        """The reading as result columns: ``{prefix}_sm_mhz``, ``_power_w``, ``_clock_reasons``."""
        return {f"{prefix}_sm_mhz": self.sm_mhz, f"{prefix}_power_w": self.power_w,
                f"{prefix}_clock_reasons": self.reasons}


def clock_kept_pct(alone_mhz: Optional[float], beside_mhz: Optional[float]) -> Optional[float]:
    """100 x the SM clock beside over the clock alone; None when either is missing."""
    if not alone_mhz or not beside_mhz:
        return None
    return 100.0 * beside_mhz / alone_mhz


class Watch:
    """Samples one NVML device (``handle``) during each ``phase()``; ``nvml`` is pynvml or a test's stand-in."""

    def __init__(self, nvml: Any, handle: Any, period_s: float = PERIOD_S) -> None:
        self.nvml, self.handle, self.period_s = nvml, handle, period_s
        get = getattr(nvml, "nvmlDeviceGetCurrentClocksEventReasons", None)
        self._reasons = get or getattr(nvml, "nvmlDeviceGetCurrentClocksThrottleReasons", None)

    def sample(self, into: Reading) -> None:
        """One sample appended to ``into``; a value NVML refuses is left out (the others are kept)."""
        n = self.nvml
        try:
            into.mhz.append(float(n.nvmlDeviceGetClockInfo(self.handle, NVML_CLOCK_SM)))
        except n.NVMLError:
            return
        try:
            into.watts.append(n.nvmlDeviceGetPowerUsage(self.handle) / 1000.0)
        except n.NVMLError:
            pass
        if self._reasons is not None:
            try:
                into.mask |= int(self._reasons(self.handle))
            except n.NVMLError:
                pass

    def power_limit_w(self) -> Optional[float]:
        try:
            return self.nvml.nvmlDeviceGetEnforcedPowerLimit(self.handle) / 1000.0
        except Exception:  # NVML refuses it on some boards
            return None

    @contextmanager
    def phase(self) -> Iterator[Reading]:
        reading = Reading()
        stop = threading.Event()

        def run() -> None:
            while True:
                self.sample(reading)
                if stop.wait(self.period_s):
                    break

        t = threading.Thread(target=run, name="epbench-clocks", daemon=True)
        t.start()
        try:
            yield reading
        finally:
            stop.set()
            t.join()


class NoWatch:
    """Where NVML cannot be read: phases yield empty readings (their figures None)."""

    @contextmanager
    def phase(self) -> Iterator[Reading]:
        yield Reading()

    def power_limit_w(self) -> Optional[float]:
        return None


def open_watch(device_index: int, *, nvml: Any = None, identity: Any = None) -> Tuple[Any, Optional[str]]:
    """(Watch, None) for torch's CUDA device ``device_index``, or (NoWatch(), why not)."""
    from epbench import counters

    try:
        ident = identity or counters.torch_identity(device_index)
    except Exception as e:  # no driver
        return NoWatch(), f"clocks: not read (no CUDA device {device_index}: {e})"
    if nvml is None:
        nvml, why = counters._import_nvml()
        if nvml is None:
            return NoWatch(), f"clocks: not read ({why})"
    handle, why = counters.nvml_handle(nvml, ident)
    if handle is None:
        return NoWatch(), f"clocks: not read ({why})"
    return Watch(nvml, handle), None
