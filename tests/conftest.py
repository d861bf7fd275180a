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
