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
    also sees the gpu tests outside this folder (tests/test_gpu_cli.py)."""

    def __init__(self, config):
        import time

        self.config, self.started = config, time.monotonic()

    @pytest.hookimpl(trylast=True)  # after the terminal's own PASSED / FAILED for the test
    def pytest_runtest_logreport(self, report):
        if "gpu" not in report.keywords:
            return
        reporter = self.config.pluginmanager.get_plugin("terminalreporter")
        if reporter is None:  # an xdist worker: the controller gets the report and prints it
            return
        if report.when == "call" and self.config.getoption("verbose") > 0:
            import time  # each test's time on its line, as it ends: a run stopped from outside keeps them

            reporter.write(f" {report.duration:.1f} s, at {time.monotonic() - self.started:.0f} s")
        if not report.failed:
            return
        what = "FAILED" if report.when == "call" else f"ERROR at {report.when}"
        text = str(report.longrepr) if report.longrepr is not None else "(no report)"
        reporter.ensure_newline()
        reporter.write_sep("-", f"{what}: {report.nodeid}")
        reporter.write_line(("..." if len(text) > REPORT_TAIL else "") + text[-REPORT_TAIL:])
        reporter.write_sep("-")


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs CUDA GPUs (skipped without them)")
    if not config.pluginmanager.has_plugin("epbench-immediate-reports"):
        config.pluginmanager.register(ImmediateReports(config), "epbench-immediate-reports")


def pytest_collection_finish(session):
    """Starts the run sets of the selected modules that start early (gpu_launch.EARLY_RUNS) on a GPU
    host, once the tests to run are known (not for --collect-only, nor in pytest-xdist's workers: each
    collects every test and would start every set again; their modules make their own at first use)."""
    if session.config.option.collectonly or not session.items or hasattr(session.config, "workerinput"):
        return
    from gpu_launch import EARLY_RUNS, GPUS

    if GPUS >= 1:
        EARLY_RUNS.start({str(item.path) for item in session.items if item.get_closest_marker("gpu")})


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
