"""`python -m fault_epbench ARGS` is `python -m epbench ARGS` with the backends of
tests/fault_backends.py registered, in the launcher and in every rank it starts: this module adds
them to epbench's registry and has torchrun start the ranks with this module, which then runs
epbench's rank entry (epbench.rank) with the same registry, so epbench itself knows no test backend. ``env()``: what the command's environment needs (this
folder on PYTHONPATH, and where the misbehaving rank leaves its mark)."""

from __future__ import annotations

import os
import sys
from typing import Dict, List

REGISTRY = {"test-hang": "fault_backends:HangingBackend",
            "test-abort": "fault_backends:AbortingBackend",
            "test-stuck": "fault_backends:StuckBackend",
            "test-late-sender": "fault_backends:LateSenderBackend"}


def command() -> List[str]:
    return [sys.executable, "-m", "fault_epbench"]


def env(mark: str) -> Dict[str, str]:
    here = os.path.dirname(os.path.abspath(__file__))
    return {"PYTHONPATH": os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH")) if p),
            "EPBENCH_TEST_MARK": mark}


def main() -> None:
    import functools
    import runpy

    from epbench import backend_names, launch  # light, as epbench's own __main__ imports first

    backend_names.REGISTRY.update(REGISTRY)
    if launch.under_torchrun():  # a rank the launcher below started: PLAN JOB
        runpy.run_module("epbench.rank", run_name="__main__", alter_sys=True)
        return
    launch.torchrun_args = functools.partial(launch.torchrun_args, module="fault_epbench")
    runpy.run_module("epbench", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
