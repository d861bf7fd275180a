"""The GPU tests' terminal plugin (tests/gpu/conftest.py ImmediateReports), on CPU: with -v each gpu
test's line ends with its time and the session's time so far, and a failed gpu test's report is
printed the moment it fails, before the summary (a run killed from outside keeps both)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

GPU_CONFTEST = Path(__file__).resolve().parent / "gpu" / "conftest.py"

TESTS = '''
import pytest

@pytest.mark.gpu
def test_quick():
    pass

@pytest.mark.gpu
def test_broken():
    assert 1 == 2, "the marked failure"

def test_not_gpu():
    pass
'''


def test_each_gpu_test_line_has_its_time_and_failures_print_at_once(tmp_path):
    (tmp_path / "conftest.py").write_text(GPU_CONFTEST.read_text())
    (tmp_path / "gpu_launch.py").write_text((GPU_CONFTEST.parent / "gpu_launch.py").read_text())  # its imports
    (tmp_path / "test_x.py").write_text(TESTS)
    r = subprocess.run([sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", "-p", "no:randomly",
                        str(tmp_path)], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    out = r.stdout
    assert r.returncode == 1, out
    quick = next(line for line in out.splitlines() if "test_quick PASSED" in line)
    assert re.search(r"\d+\.\d s, at \d+ s$", quick), quick
    plain = next(line for line in out.splitlines() if "test_not_gpu PASSED" in line)
    assert " s, at " not in plain  # only gpu tests
    immediate = out.index("FAILED: test_x.py::test_broken")
    assert immediate < out.index("short test summary") and "the marked failure" in out[immediate:]
