"""cudart: the ctypes binding of the CUDA runtime, against a fake library (no GPU needed) and,
where one is installed, the real libcudart's symbol table."""

from __future__ import annotations

import ctypes
import ctypes.util
import glob

import pytest

from epbench import cudart


class FakeFn:
    def __init__(self, impl):
        self.impl, self.restype, self.argtypes = impl, None, None

    def __call__(self, *args):
        return self.impl(*args)


class FakeLib:
    """Every runtime function returns ``codes.get(name, 0)``; calls are recorded."""

    ERRORS = {2: b"out of memory", 217: b"peer access is not supported between these two devices"}

    def __init__(self, **codes):
        self.calls = []
        for name in cudart.signatures():
            setattr(self, name, FakeFn(self._impl(name, codes.get(name, 0))))
        self.cudaGetErrorString.impl = lambda rc: self.ERRORS.get(rc)

    def _impl(self, name, rc):
        def fn(*args):
            self.calls.append(name)
            if name == "cudaMalloc" and rc == 0:
                args[0]._obj.value = 0x7000
            if name == "cudaIpcGetMemHandle" and rc == 0:
                args[0]._obj.reserved = b"\x01" * cudart.HANDLE_BYTES
            return rc
        return fn


def test_every_function_is_declared_with_int_errors():
    lib = cudart.declare(FakeLib())
    for name, (restype, argtypes) in cudart.signatures().items():
        fn = getattr(lib, name)
        assert fn.argtypes == argtypes and fn.restype is restype
        assert name.startswith("cuda")
    assert lib.cudaGetErrorString.restype is ctypes.c_char_p
    assert ctypes.sizeof(cudart.IpcHandle) == 64  # sizeof(cudaIpcMemHandle_t)


def test_calls_that_succeed_return_what_the_runtime_wrote():
    rt = cudart.Cudart(FakeLib())
    assert rt.malloc(100) == 0x7000
    assert rt.ipc_handle(0x7000) == b"\x01" * 64
    rt.set_device(1)
    rt.memcpy_async(1, 2, 3, 0)
    assert rt.lib.calls == ["cudaMalloc", "cudaIpcGetMemHandle", "cudaSetDevice",
                            "cudaMemcpyAsync"]


def test_a_failed_call_raises_with_the_runtime_message_and_code():
    rt = cudart.Cudart(FakeLib(cudaMalloc=2, cudaFree=999))
    with pytest.raises(cudart.CudaError, match=r"cudaMalloc\(100\): out of memory") as e:
        rt.malloc(100)
    assert e.value.code == 2 and isinstance(e.value, RuntimeError)
    with pytest.raises(cudart.CudaError, match="cudaFree: unknown error"):
        rt.free(1)  # a code the runtime has no text for


def test_peer_access_already_enabled_is_fine_and_cleared():
    rt = cudart.Cudart(FakeLib(cudaDeviceEnablePeerAccess=cudart.PEER_ALREADY_ENABLED))
    rt.enable_peer_access(1)
    assert rt.lib.calls == ["cudaDeviceEnablePeerAccess", "cudaGetLastError"]
    rt = cudart.Cudart(FakeLib(cudaDeviceEnablePeerAccess=217))
    with pytest.raises(cudart.CudaError, match=r"cudaDeviceEnablePeerAccess\(3\): peer access"):
        rt.enable_peer_access(3)


def test_library_path_prefers_the_one_mapped_into_the_process(tmp_path):
    maps = tmp_path / "maps"
    maps.write_text("7f00-7f01 r-xp 0 08:01 1 /opt/torch/lib/libcudart.so.13\n")
    assert cudart.library_path(str(maps), find=lambda n: "other") == \
        "/opt/torch/lib/libcudart.so.13"
    maps.write_text("7f00-7f01 r-xp 0 08:01 1 /usr/lib/libc.so.6\n")
    assert cudart.library_path(str(maps), find=lambda n: "libcudart.so.12") == "libcudart.so.12"
    with pytest.raises(RuntimeError, match="libcudart not found"):
        cudart.library_path(str(tmp_path / "none"), find=lambda n: None)


def _installed_cudart():
    found = ctypes.util.find_library("cudart")
    return found or next(iter(sorted(glob.glob("/usr/local/cuda*/lib64/libcudart.so*"))), None)


@pytest.mark.skipif(_installed_cudart() is None, reason="no libcudart installed")
def test_the_real_library_has_every_declared_symbol():
    lib = cudart.declare(ctypes.CDLL(_installed_cudart()))  # loading needs no GPU
    assert lib.cudaGetErrorString(2)  # a static table lookup: no device touched
