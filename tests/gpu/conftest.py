"""Registers the gpu marker for these tests even where pyproject's marker list is not loaded, holds
the fixtures several GPU test modules share, and prints a failed test's report the moment it fails
and, with -v, each test's time and the session's time so far on its line."""

import pytest

REPORT_TAIL = 3000  # characters of a failure's report printed at once


class ImmediateReports:
    """Prints a failed or errored phase (setup, call or teardown) of a gpu test, the last
    REPORT_TAIL characters of its report, the moment it ends, besides pytest's summary at the end: a
    run stopped from outside (a time-limited machine, a command's timeout) still shows why the
    tests that had failed did. Registered as a plugin, not as this conftest's hook, so that it
    also sees gpu tests outside this folder."""

    def __init__(self, config):
        import time

        self.config, self.started, self.setup = config, time.monotonic(), {}

    @pytest.hookimpl(trylast=True)  # after the terminal's own PASSED / FAILED for the test
    def pytest_runtest_logreport(self, report):
        if "gpu" not in report.keywords:
            return
        reporter = self.config.pluginmanager.get_plugin("terminalreporter")
        if reporter is None:  # an xdist worker: the controller gets the report and prints it
            return
        if report.when == "setup":  # a module fixture's launch counts for the test that waited for it
            self.setup[report.nodeid] = report.duration
        if report.when == "call" and self.config.getoption("verbose") > 0:
            import time  # each test's time on its line, as it ends: a run stopped from outside keeps them

            took = report.duration + self.setup.pop(report.nodeid, 0.0)
            reporter.write(f" {took:.1f} s, at {time.monotonic() - self.started:.0f} s")
        if not report.failed:
            return
        what = "FAILED" if report.when == "call" else f"ERROR at {report.when}"
        text = str(report.longrepr) if report.longrepr is not None else "(no report)"
        reporter.ensure_newline()
        reporter.write_sep("-", f"{what}: {report.nodeid}")
        reporter.write_line(("..." if len(text) > REPORT_TAIL else "") + text[-REPORT_TAIL:])
        reporter.write_sep("-")


def _stop_on_sigterm(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs CUDA GPUs (skipped without them)")
    import signal
    import threading

    # An outer `timeout` or a machine's end sends SIGTERM: as Ctrl-C, so that the fixtures' teardown
    # and atexit stop the GPU runs still going (gpu_launch.GpuRuns) instead of leaving them behind.
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _stop_on_sigterm)
    if not config.pluginmanager.has_plugin("epbench-immediate-reports"):
        config.pluginmanager.register(ImmediateReports(config), "epbench-immediate-reports")


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook, which reads the groups
def pytest_collection_modifyitems(config, items):
    """Under pytest-xdist (make test's --dist loadgroup) every gpu test goes to one worker: they share
    the host's GPUs through gpu_launch's schedulers, which each process keeps for itself."""
    for item in items:
        if item.get_closest_marker("gpu") is not None and item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group("gpu"))


def pytest_collection_finish(session):
    """Starts the run sets the selected tests use, of the modules that start them early
    (gpu_launch.EARLY_RUNS), on a GPU host once the tests to run are known; not for --collect-only,
    --setup-plan or --setup-only, not in pytest-xdist's workers, not with EPBENCH_GPU_TESTS_EARLY=0."""
    import os
    import sys

    option = session.config.option
    if (option.collectonly or getattr(option, "setupplan", False) or getattr(option, "setuponly", False)
            or not session.items or hasattr(session.config, "workerinput")
            or os.environ.get("EPBENCH_GPU_TESTS_EARLY", "1") == "0"):
        return
    launch = sys.modules.get("gpu_launch")  # imported by the gpu test modules collected
    if launch is None or launch.GPUS < 1:
        return
    tests = [(str(item.path), tuple(getattr(item, "fixturenames", ())))
             for item in session.items if item.get_closest_marker("gpu")]
    launch.EARLY_RUNS.start(tests, session.config._tmp_path_factory.mktemp("early-runs"))


@pytest.fixture(scope="session")
def kernels_built() -> None:
    """Skips (with the reason) where the epbench kernels are not built; an error in one line where
    the library is older than the functions epbench/cuda_lib.py declares (cuda_lib.load raises
    AttributeError then, not its RuntimeError; every test that uses this fixture errors at setup)."""
    from epbench import cuda_lib

    try:
        cuda_lib.load()
    except RuntimeError as e:
        pytest.skip(str(e))
    except AttributeError as e:
        pytest.fail(f"the built epbench library is older than epbench/cuda_lib.py ({e}): run make build",
                    pytrace=False)
