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


# -- driver calls --------------------------------------------------------------------------------

def _cuda_include() -> "str | None":
    import os
    import shutil

    roots = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"]
    nvcc = shutil.which("nvcc")
    if nvcc:
        roots.append(os.path.dirname(os.path.dirname(os.path.realpath(nvcc))))
    for root in roots:
        if root and os.path.exists(os.path.join(root, "include", "cuda.h")):
            return os.path.join(root, "include")
    return None


def test_dev_resource_offsets_match_the_installed_cuda_header(tmp_path):
    """The SM count is read from CUdevResource as bytes: its offset and the buffer's size must be
    those of the cuda.h the host has (CI has CUDA 13's), so a change of the struct fails here."""
    import shutil
    import subprocess

    inc, cc = _cuda_include(), shutil.which("cc") or shutil.which("gcc")
    if inc is None or cc is None:
        pytest.skip("no cuda.h or C compiler on this host")
    src = tmp_path / "off.c"
    src.write_text('#include <stddef.h>\n#include <stdio.h>\n#include <cuda.h>\n'
                   'int main(void) { printf("%zu %zu %d\\n", offsetof(CUdevResource, sm.smCount), '
                   'sizeof(CUdevResource), (int)CU_DEV_RESOURCE_TYPE_SM); return 0; }\n')
    exe = tmp_path / "off"
    subprocess.run([cc, f"-I{inc}", str(src), "-o", str(exe)], check=True, capture_output=True)
    offset, size, sm_type = map(int, subprocess.run([str(exe)], check=True, capture_output=True,
                                                   text=True).stdout.split())
    assert offset == cudart.CU_DEV_RESOURCE_SM_OFFSET
    assert size <= cudart.CU_DEV_RESOURCE_BYTES
    assert sm_type == cudart.CU_DEV_RESOURCE_TYPE_SM


class FakeDriver:
    """libcuda's two context calls: a current context whose SM resource holds ``sms``."""

    def __init__(self, sms: int, ctx: int = 0x1234, rc: int = 0) -> None:
        self.sms, self.ctx, self.rc = sms, ctx, rc

        def get_current(out):
            ctypes.cast(out, ctypes.POINTER(ctypes.c_void_p))[0] = self.ctx
            return 0

        def get_resource(ctx, buf, kind):
            assert ctx.value == self.ctx and kind == cudart.CU_DEV_RESOURCE_TYPE_SM
            ctypes.c_uint.from_buffer(buf, cudart.CU_DEV_RESOURCE_SM_OFFSET).value = self.sms
            return self.rc

        self.cuCtxGetCurrent = get_current
        self.cuCtxGetDevResource = get_resource


def test_current_context_sms_reads_the_sm_count_at_its_offset():
    assert cudart.current_context_sms(FakeDriver(66)) == 66
    with pytest.raises(RuntimeError, match="cuCtxGetDevResource failed"):
        cudart.current_context_sms(FakeDriver(66, rc=201))
    with pytest.raises(RuntimeError, match="cuCtxGetCurrent failed"):
        cudart.current_context_sms(FakeDriver(66, ctx=0))
