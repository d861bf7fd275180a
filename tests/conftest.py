"""Fixtures: scenario files in tmp_path, and the real 4-process smoke run, started once per
session and reused by every test that reads it."""

import os
from pathlib import Path
from typing import Any

import pytest
import yaml

from support import Run, run_cli

# The commands these tests start size their tables from COLUMNS when it is set (epbench/console.py);
# a parallel runner's workers set it to 80, which folds lines the tests read whole. The tests that
# want a width pass it themselves.
os.environ.pop("COLUMNS", None)
os.environ.pop("LINES", None)
# Two workers share two cores (CI): torch's CPU ops in a worker, and in the commands the tests
# start, take one thread each, as the launcher already gives every rank it starts.
os.environ.setdefault("OMP_NUM_THREADS", "1")


# Fixtures that make something costly once per worker (real runs, spawned gloo groups, kernel
# objects, a clone) and the tests that read it.
SHARED = ("smoke_run", "reports", "reference_ll", "build_dir", "nvshmem_build", "clone")


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook, which reads the groups
def pytest_collection_modifyitems(config, items):
    """The tests that read one of the SHARED fixtures go to one worker under ``--dist loadgroup``
    (make test), so that it is made once, not once on each worker that runs one of them."""
    for item in items:
        used = getattr(item, "fixturenames", ())
        shared = next((name for name in SHARED if name in used), None)
        if shared is not None:
            item.add_marker(pytest.mark.xdist_group(shared))


@pytest.fixture
def write_scenario(tmp_path):
    """write_scenario(name, data) -> path of a YAML file (data: a mapping or raw text)."""

    def write(name: str, data: Any) -> Path:
        p = tmp_path / f"{name}.yaml"
        p.write_text(data if isinstance(data, str) else yaml.safe_dump(data, sort_keys=False))
        return p

    return write


@pytest.fixture(scope="session")
def results_root(tmp_path_factory) -> Path:
    """Every multi-process run of the session writes here (never into the repo's results/)."""
    return tmp_path_factory.mktemp("results")


@pytest.fixture(scope="session")
def smoke_run(results_root) -> Run:
    """`epbench run scenarios/smoke.yaml`: the real 4-process gloo run, once per session."""
    return run_cli(results_root, "run", "scenarios/smoke.yaml")


@pytest.fixture(autouse=True)
def _close_figures():
    """Figures a test kept open to inspect (tests/test_plot.py drawn_figures replaces the closing save) are
    closed after it, so that a test process never holds 20 of them (matplotlib's warning)."""
    yield
    import sys

    plt = sys.modules.get("matplotlib.pyplot")
    if plt is not None:
        plt.close("all")
