"""CI has nvcc but no GPU: compile and device-link csrc/nvshmem/ (relocatable NVSHMEM device code,
against the nvidia-nvshmem-cu13 wheel) for sm_90 through `make -C csrc nvshmem-check`, then load
the linked library in a CPU-only process. Skipped, with the reason, where nvcc or the wheel is
missing (`make build` installs the wheel only when pip can reach it); nvcc missing under CI fails."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from epbench import nvshmem_lib

ROOT = Path(__file__).resolve().parents[1]
CSRC = ROOT / "csrc"


@pytest.fixture(scope="module")
def nvshmem_build() -> Path:
    """The build folder of one `make nvshmem-check` (objects and the device-linked check library):
    csrc's own build folder, so objects that `make build` just compiled against the same NVSHMEM are
    reused (make rebuilds whatever is stale, and the NVSHMEM_HOME stamp forces a rebuild for another
    NVSHMEM)."""
    if shutil.which("nvcc") is None:
        if os.environ.get("CI"):
            pytest.fail("CI is set but nvcc is not on PATH: the NVSHMEM code cannot be checked")
        pytest.skip("nvcc not found")
    home = nvshmem_lib.find_home()
    if home is None:
        pytest.skip("NVSHMEM not found: the nvidia-nvshmem-cu13 wheel is not installed in this Python "
                    "(`make build` installs it when pip can reach the index)")
    build = CSRC / "build"
    r = subprocess.run(["make", "-s", "-C", str(CSRC), "nvshmem-check", f"NVSHMEM_HOME={home}"],
                       capture_output=True, text=True)
    assert r.returncode == 0, f"csrc/nvshmem does not build:\n{r.stdout[-2000:]}{r.stderr[-4000:]}"
    assert "compiles and device-links for sm_90" in r.stdout, r.stdout
    return build / "nvshmem"


def test_nvshmem_code_compiles_and_device_links_for_sm90(nvshmem_build: Path) -> None:
    assert (nvshmem_build / "nvshmem_boot.o").stat().st_size > 0
    assert (nvshmem_build / "libcheck.so").stat().st_size > 0


def test_linked_library_loads_without_a_gpu(nvshmem_build: Path) -> None:
    """In a child process (NVSHMEM stays out of pytest's): every API function is exported, the
    rpath finds libnvshmem_host without LD_LIBRARY_PATH, and it is the version compiled against."""
    code = textwrap.dedent(f"""
        import ctypes
        from epbench import nvshmem_lib
        lib = ctypes.CDLL({str(nvshmem_build / "libcheck.so")!r})
        nvshmem_lib._declare(lib)
        built, loaded = ctypes.c_int(), ctypes.c_int()
        assert lib.epn_versions(ctypes.byref(built), ctypes.byref(loaded)) == 0
        print(lib.epn_uniqueid_size(), built.value, loaded.value, lib.epn_my_pe())
    """)
    env = {k: v for k, v in os.environ.items() if k != "LD_LIBRARY_PATH"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    size, built, loaded, pe = map(int, r.stdout.split())
    assert size == 128  # nvshmemx_uniqueid_t in NVSHMEM 3.x
    assert built == loaded and built >= 30000, (built, loaded)
    assert pe == -1  # not initialised
