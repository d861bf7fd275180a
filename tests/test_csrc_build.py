"""CI has nvcc but no GPU: compile every kernel in csrc/ for sm_90 and fail if one does not.
Skipped only where nvcc is missing and CI is not set."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

CSRC = Path(__file__).resolve().parents[1] / "csrc"
KERNELS = sorted(p.name for p in CSRC.glob("*.cu"))


def _nvcc() -> str:
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        if os.environ.get("CI"):
            pytest.fail("CI is set but nvcc is not on PATH: the kernels cannot be checked")
        pytest.skip("nvcc not found")
    return nvcc


def test_every_role_has_its_file() -> None:
    for name in ("common.cuh", "api.h", "buffers.cu", "notify.cu", "dispatch.cu", "combine.cu", "Makefile"):
        assert (CSRC / name).exists(), name


# One build folder for the module: each kernel is compiled once, by the Makefile's own rule (its flags
# are the release build's: sm_90 code and compute_90 PTX, -O3, -Wall, ptxas spill warnings), and
# `make check` then finds those objects up to date instead of compiling every kernel a second time.
# The tests that use it share a worker (conftest.SHARED), so that the folder is there for all of them.
@pytest.fixture(scope="module")
def build_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("csrc-build")


def _make(build: Path, *targets: str) -> subprocess.CompletedProcess:
    return subprocess.run(["make", "-s", "-C", str(CSRC), f"BUILD={build}", "NVSHMEM_HOME=", *targets],
                          capture_output=True, text=True)


@pytest.mark.parametrize("source", KERNELS)
def test_kernel_compiles_for_sm90(source: str, build_dir: Path) -> None:
    _nvcc()
    obj = build_dir / (Path(source).stem + ".o")
    r = _make(build_dir, str(obj))
    assert r.returncode == 0, f"{source} does not compile:\n{r.stderr[-4000:]}"
    assert obj.stat().st_size > 0


def test_makefile_check_target(build_dir: Path) -> None:
    """`make check` without NVSHMEM (NVSHMEM_HOME empty): the kernels, and one line saying csrc/nvshmem
    was skipped. In this module's build folder: the objects test_kernel_compiles_for_sm90 just
    compiled are up to date (a kernel it has not compiled is compiled here; the NVSHMEM half is
    tests/test_nvshmem_build.py's)."""
    _nvcc()
    r = _make(build_dir, "check")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    assert "skipping csrc/nvshmem" in r.stdout
