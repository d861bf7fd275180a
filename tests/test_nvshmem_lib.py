"""The host side of epbench/nvshmem_lib.py without NVSHMEM or a GPU: the ctypes signatures against
csrc/nvshmem/api_nvshmem.h, the one-line errors, and bootstrap's hand-off of the unique id."""

from __future__ import annotations

import ctypes
import re
from pathlib import Path

import pytest

from epbench import nvshmem_lib

HEADER = Path(__file__).resolve().parents[1] / "csrc" / "nvshmem" / "api_nvshmem.h"


def test_ctypes_signatures_match_the_header():
    text = re.sub(r"//[^\n]*|/\*.*?\*/", "", HEADER.read_text(), flags=re.S)
    declared = {}
    for name, params in re.findall(r"\bint\s+(ep[nh]_\w+)\s*\(([^;{]*)\)\s*;", text):
        params = params.strip()
        declared[name] = 0 if params in ("", "void") else params.count(",") + 1
    assert declared == {name: len(args) for name, args in nvshmem_lib.signatures().items()}
    assert "const char* epn_last_error(void);" in text


def test_missing_library_is_one_line(monkeypatch, tmp_path):
    monkeypatch.setattr(nvshmem_lib, "_lib", None)
    monkeypatch.setattr(nvshmem_lib, "LIB_PATH", tmp_path / "libepbench_nvshmem.so")
    with pytest.raises(RuntimeError, match=r"NVSHMEM library not built: run `make build`") as e:
        nvshmem_lib.load()
    assert "\n" not in str(e.value)


class FakeLib:
    """Stands in for libepbench_nvshmem.so: versions as given, records epn_init's arguments."""

    def __init__(self, built=30405, loaded=30405):
        self.built, self.loaded, self.init_args = built, loaded, None

    def epn_versions(self, built, loaded):
        built._obj.value, loaded._obj.value = self.built, self.loaded
        return 0

    def epn_get_uniqueid(self, buf, cap):
        ctypes.memmove(buf, b"U" * 128, 128)
        return 128

    def epn_init(self, uid, size, rank, world, device):
        self.init_args = (uid, size, rank, world, device)
        return 0

    def epn_last_error(self):
        return b"boom"


def test_a_different_nvshmem_host_library_is_refused(monkeypatch, tmp_path):
    lib_path = tmp_path / "libepbench_nvshmem.so"
    lib_path.write_bytes(b"")
    fake = FakeLib(built=30405, loaded=30324)
    monkeypatch.setattr(nvshmem_lib, "_lib", None)
    monkeypatch.setattr(nvshmem_lib, "LIB_PATH", lib_path)
    monkeypatch.setattr(nvshmem_lib.ctypes, "CDLL", lambda path: fake)
    monkeypatch.setattr(nvshmem_lib, "_declare", lambda lib: None)
    want = r"built against NVSHMEM 3\.4\.5 but this process uses libnvshmem_host 3\.3\.24"
    with pytest.raises(RuntimeError, match=want):
        nvshmem_lib.load()
    assert nvshmem_lib._lib is None


def test_bootstrap_alone_passes_its_own_id(monkeypatch):
    fake = FakeLib()
    monkeypatch.setattr(nvshmem_lib, "load", lambda: fake)
    assert nvshmem_lib.bootstrap(rank=0, world=1, device=0) is fake
    assert fake.init_args == (b"U" * 128, 128, 0, 1, 0)


def test_a_failed_call_carries_the_library_message(monkeypatch):
    monkeypatch.setattr(nvshmem_lib, "load", lambda: FakeLib())
    with pytest.raises(RuntimeError, match="epbench NVSHMEM: epn_ping failed: boom"):
        nvshmem_lib.check(-1, "epn_ping")
    nvshmem_lib.check(128, "epn_get_uniqueid")  # a size is not a failure


def test_a_failed_start_is_one_startup_error_naming_the_rank(monkeypatch):
    class Refusing(FakeLib):
        def epn_init(self, uid, size, rank, world, device):
            return -1

    monkeypatch.setattr(nvshmem_lib, "load", lambda: Refusing())
    with pytest.raises(nvshmem_lib.StartupError) as e:
        nvshmem_lib.bootstrap(rank=0, world=1, device=0)
    msg = str(e.value)
    assert msg.startswith("NVSHMEM could not start on rank 0: epbench NVSHMEM: epn_init failed: boom")
    assert "NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME" in msg and "\n" not in msg
    assert e.value.exit_code == 1
