"""The CUDA calls epbench makes itself, through ctypes: the runtime's from the libcudart that torch
already loaded (the copy-engine ceiling), and the few driver calls the runtime has no form for
(libcuda: the timer's host gate, a green context's SM count for overlap). One binding for every
module that needs one.

Why not NVIDIA's cuda-bindings (cuda-python): torch's CUDA wheels do not depend on it and the GPU
hosts have no network to install it; the handful of calls below need nothing more than ctypes.
Why not torch: see ceiling.PeerBuffers (an IPC buffer must be opened in the reader's own device
context for the copy engine to write over NVLink).
"""

from __future__ import annotations

import ctypes
from typing import Any, Callable, Dict, List, Optional, Tuple

MEMCPY_DEFAULT = 4  # cudaMemcpyDefault: direction from unified addressing
IPC_LAZY_ENABLE_PEER_ACCESS = 1  # cudaIpcMemLazyEnablePeerAccess
PEER_ALREADY_ENABLED = 704  # cudaErrorPeerAccessAlreadyEnabled
HANDLE_BYTES = 64  # sizeof(cudaIpcMemHandle_t)


class IpcHandle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_char * HANDLE_BYTES)]


def signatures() -> Dict[str, Tuple[Any, List[Any]]]:
    """name -> (restype, argtypes) of every runtime function epbench calls (cudaError_t = int)."""
    c, vp, i = ctypes, ctypes.c_void_p, ctypes.c_int
    return {
        "cudaSetDevice": (i, [i]),
        "cudaMalloc": (i, [c.POINTER(vp), c.c_size_t]),
        "cudaFree": (i, [vp]),
        "cudaIpcGetMemHandle": (i, [c.POINTER(IpcHandle), vp]),
        "cudaIpcOpenMemHandle": (i, [c.POINTER(vp), IpcHandle, c.c_uint]),
        "cudaIpcCloseMemHandle": (i, [vp]),
        "cudaDeviceEnablePeerAccess": (i, [i, c.c_uint]),
        "cudaMemcpyAsync": (i, [vp, vp, c.c_size_t, i, vp]),
        "cudaGetErrorString": (c.c_char_p, [i]),
        "cudaGetLastError": (i, []),
    }


def declare(lib: Any) -> Any:
    for name, (restype, argtypes) in signatures().items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = restype, argtypes
    return lib


class CudaError(RuntimeError):
    """A runtime call returned an error: ``code`` is the cudaError_t."""

    def __init__(self, what: str, code: int, text: str) -> None:
        super().__init__(f"{what}: {text} (cudaError {code})")
        self.code = code


def library_path(maps: str = "/proc/self/maps",
                 find: Callable[[str], Optional[str]] = None) -> str:
    """The libcudart mapped into this process (torch loads it with CUDA), else the one the
    loader finds; RuntimeError when there is none."""
    try:
        with open(maps) as f:
            for line in f:
                if "libcudart.so" in line:
                    return line.split()[-1]
    except OSError:
        pass
    if find is None:
        import ctypes.util

        find = ctypes.util.find_library
    found = find("cudart")
    if not found:
        raise RuntimeError("libcudart not found")
    return found


class Cudart:
    """The runtime calls, each raising CudaError with the runtime's message on failure.
    ``lib``: an already opened library (tests pass a fake); default: torch's libcudart."""

    def __init__(self, lib: Any = None) -> None:
        if lib is None:
            import torch

            torch.cuda.init()  # maps torch's libcudart into the process
            lib = ctypes.CDLL(library_path())
        self.lib = declare(lib)

    def check(self, rc: int, what: str) -> None:
        if rc != 0:
            text = self.lib.cudaGetErrorString(rc)
            raise CudaError(what, rc, text.decode(errors="replace") if text else "unknown error")

    def set_device(self, device: int) -> None:
        self.check(self.lib.cudaSetDevice(device), f"cudaSetDevice({device})")

    def malloc(self, nbytes: int) -> int:
        """A whole allocation of its own: an IPC handle always names an allocation's base."""
        ptr = ctypes.c_void_p()
        self.check(self.lib.cudaMalloc(ctypes.byref(ptr), nbytes), f"cudaMalloc({nbytes})")
        return int(ptr.value)

    def free(self, ptr: int) -> None:
        self.check(self.lib.cudaFree(ptr), "cudaFree")

    def ipc_handle(self, ptr: int) -> bytes:
        h = IpcHandle()
        self.check(self.lib.cudaIpcGetMemHandle(ctypes.byref(h), ptr), "cudaIpcGetMemHandle")
        return ctypes.string_at(ctypes.addressof(h), HANDLE_BYTES)

    def ipc_open(self, handle: bytes) -> int:
        """Maps a peer's allocation into the current device's context."""
        h = IpcHandle.from_buffer_copy(handle)
        ptr = ctypes.c_void_p()
        self.check(self.lib.cudaIpcOpenMemHandle(ctypes.byref(ptr), h,
                                                 IPC_LAZY_ENABLE_PEER_ACCESS),
                   "cudaIpcOpenMemHandle")
        return int(ptr.value)

    def ipc_close(self, ptr: int) -> None:
        self.check(self.lib.cudaIpcCloseMemHandle(ptr), "cudaIpcCloseMemHandle")

    def enable_peer_access(self, peer: int) -> None:
        """From the current device to ``peer``; already enabled is fine (and is cleared from
        the runtime's last-error slot, where torch would find it later)."""
        rc = self.lib.cudaDeviceEnablePeerAccess(peer, 0)
        if rc == PEER_ALREADY_ENABLED:
            self.lib.cudaGetLastError()
            return
        self.check(rc, f"cudaDeviceEnablePeerAccess({peer})")

    def memcpy_async(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        self.check(self.lib.cudaMemcpyAsync(dst, src, nbytes, MEMCPY_DEFAULT, stream),
                   "cudaMemcpyAsync")


# ---- driver API (libcuda) ----------------------------------------------------------------------

CU_DEV_RESOURCE_TYPE_SM = 1
# CUdevResource as a byte buffer: sizeof is 144 in CUDA 12.4-13.x (room to spare); smCount, the first
# field of its CUdevSmResource, follows the type (4 bytes) and 92 bytes of padding. Both checked
# against the installed cuda.h by tests/test_cudart.py.
CU_DEV_RESOURCE_BYTES = 256
CU_DEV_RESOURCE_SM_OFFSET = 96


def driver_signatures() -> Dict[str, Tuple[Any, List[Any]]]:
    """name -> (restype, argtypes) of the driver calls epbench makes (CUresult = int); the stream
    wait is looked up as its _v2 name first (stream_wait_value32)."""
    c, vp, i = ctypes, ctypes.c_void_p, ctypes.c_int
    return {
        "cuCtxGetCurrent": (i, [c.POINTER(vp)]),
        "cuCtxGetDevResource": (i, [vp, vp, i]),
    }


def driver(lib: Any = None) -> Any:
    """libcuda with the signatures above declared (``lib``: an opened one, tests pass a fake)."""
    lib = lib if lib is not None else ctypes.CDLL("libcuda.so.1")
    for name, (restype, argtypes) in driver_signatures().items():
        fn = getattr(lib, name, None)
        if fn is not None:
            fn.restype, fn.argtypes = restype, argtypes
    return lib


def stream_wait_value32(lib: Any) -> Any:
    """cuStreamWaitValue32 (its _v2 where the driver has it), declared: (stream, address, value, flags)."""
    fn = getattr(lib, "cuStreamWaitValue32_v2", None) or lib.cuStreamWaitValue32
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint]
    return fn


def current_context_sms(lib: Any = None) -> int:
    """The SM count of the current CUDA context as the driver reports it (a green context's
    partition while it is current)."""
    lib = driver(lib)
    ctx = ctypes.c_void_p()
    rc = lib.cuCtxGetCurrent(ctypes.byref(ctx))
    if rc != 0 or not ctx.value:
        raise RuntimeError(f"cuCtxGetCurrent failed (CUresult {rc})")
    buf = ctypes.create_string_buffer(CU_DEV_RESOURCE_BYTES)
    rc = lib.cuCtxGetDevResource(ctx, buf, CU_DEV_RESOURCE_TYPE_SM)
    if rc != 0:
        raise RuntimeError(f"cuCtxGetDevResource failed (CUresult {rc})")
    return ctypes.c_uint.from_buffer(buf, CU_DEV_RESOURCE_SM_OFFSET).value
