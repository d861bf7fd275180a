"""ctypes loader for the NVSHMEM groundwork library (csrc/nvshmem/ -> epbench/_lib/libepbench_nvshmem.so).

Groundwork for multi-node dispatch/combine (issue #5): NVSHMEM bootstrap over a unique id that
torch.distributed carries from rank 0 to every rank, and an all-to-all put-with-signal ping
(csrc/nvshmem/api_nvshmem.h). Nothing in the CLI uses it yet; tests/gpu/nvshmem_worker.py does.
"""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Any, Dict, List, Optional

LIB_PATH = Path(__file__).resolve().parent / "_lib" / "libepbench_nvshmem.so"
NOT_BUILT = "NVSHMEM library not built: run `make build` (it needs nvcc and the nvidia-nvshmem-cu13 wheel)"
UID_CAP = 256  # bytes offered to epn_get_uniqueid (nvshmemx_uniqueid_t is 128 in NVSHMEM 3.x)

_lib: Optional[ctypes.CDLL] = None


def signatures() -> Dict[str, List[Any]]:
    """ctypes argument types of every int-returning function of csrc/nvshmem/api_nvshmem.h."""
    vp, i, ip = ctypes.c_void_p, ctypes.c_int, ctypes.POINTER(ctypes.c_int)
    return {
        "epn_uniqueid_size": [],
        "epn_versions": [ip, ip],
        "epn_get_uniqueid": [vp, i],
        "epn_init": [ctypes.c_char_p, i, i, i, i],
        "epn_my_pe": [],
        "epn_n_pes": [],
        "epn_ping": [i, ctypes.c_double, ctypes.POINTER(ctypes.c_double)],
        "epn_finalize": [],
    }


def _declare(lib: ctypes.CDLL) -> None:
    lib.epn_last_error.restype = ctypes.c_char_p
    lib.epn_last_error.argtypes = []
    for name, args in signatures().items():
        fn = getattr(lib, name)
        fn.argtypes = args
        fn.restype = ctypes.c_int


def find_home() -> Optional[str]:
    """The NVSHMEM folder (include/, lib/) of the nvidia-nvshmem wheel as this Python sees it, the
    way csrc/Makefile finds NVSHMEM_HOME; None if absent. nvidia.nvshmem is a namespace package
    (no __init__.py, so no __file__): its folders are in the spec's search locations."""
    import importlib.util
    import os

    try:
        spec = importlib.util.find_spec("nvidia.nvshmem")
    except (ImportError, ValueError):
        return None
    for p in (spec.submodule_search_locations or []) if spec else []:
        if os.path.isfile(os.path.join(p, "include", "nvshmem.h")):
            return str(p)
    return None


def _version(v: int) -> str:
    return f"{v // 10000}.{v // 100 % 100}.{v % 100}"


def _mapped_nvshmem_host() -> List[str]:
    """Paths of every libnvshmem_host this process has mapped (Linux; [] elsewhere)."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return []
    return sorted({line.split()[-1] for line in maps.splitlines() if "libnvshmem_host" in line})


def load() -> ctypes.CDLL:
    """The loaded library; RuntimeError with a one-line reason when it is missing or broken, or
    when the process resolved a libnvshmem_host other than the one it was built against (the
    first copy loaded wins by soname: torch may bring its own)."""
    global _lib
    if _lib is None:
        if not LIB_PATH.exists():
            raise RuntimeError(f"{NOT_BUILT} ({LIB_PATH} is missing)")
        try:
            lib = ctypes.CDLL(str(LIB_PATH))
        except OSError as e:
            raise RuntimeError(f"cannot load {LIB_PATH}: {e}; rebuild with `make build`") from e
        _declare(lib)
        built, loaded = ctypes.c_int(), ctypes.c_int()
        check(lib.epn_versions(ctypes.byref(built), ctypes.byref(loaded)), "epn_versions", lib)
        if built.value != loaded.value:
            raise RuntimeError(f"{LIB_PATH.name} was built against NVSHMEM {_version(built.value)} but this "
                               f"process uses libnvshmem_host {_version(loaded.value)} "
                               f"({', '.join(_mapped_nvshmem_host()) or 'path unknown'})")
        _lib = lib
    return _lib


def check(rc: int, what: str, lib: Optional[ctypes.CDLL] = None) -> None:
    """Raises RuntimeError carrying the library's message when an API call failed."""
    if rc < 0:
        msg = (lib or load()).epn_last_error().decode(errors="replace")
        raise RuntimeError(f"epbench NVSHMEM: {what} failed: {msg}")


def bootstrap(rank: int, world: int, device: int, group: Any = None) -> ctypes.CDLL:
    """Initialises NVSHMEM on every rank (collective over torch.distributed, which must already be
    initialised): rank 0 makes the unique id, torch.distributed broadcasts its bytes, then every
    rank calls epn_init (cudaSetDevice(device), NVSHMEM init, symmetric buffers). Returns the library."""
    import torch
    import torch.distributed as dist

    lib = load()
    if torch.cuda.is_available():
        torch.cuda.set_device(device)  # NCCL's broadcast of the id goes through the current device
    uid = b""
    if rank == 0:
        buf = ctypes.create_string_buffer(UID_CAP)
        n = lib.epn_get_uniqueid(buf, UID_CAP)
        check(n, "epn_get_uniqueid")
        uid = buf.raw[:n]
    if world > 1:
        box = [uid]
        dist.broadcast_object_list(box, src=0, group=group)
        uid = box[0]
    check(lib.epn_init(uid, len(uid), rank, world, device), "epn_init")
    return lib


def ping(iters: int, timeout_s: float = 10.0) -> float:
    """Median microseconds of `iters` all-to-all put-with-signal rounds (collective); RuntimeError
    naming the PE that never signalled or sent wrong bytes."""
    lib = load()
    us = ctypes.c_double()
    check(lib.epn_ping(iters, timeout_s, ctypes.byref(us)), "epn_ping")
    return us.value


def finalize() -> None:
    """Frees the symmetric buffers and finalizes NVSHMEM (collective; a no-op if never initialised)."""
    check(load().epn_finalize(), "epn_finalize")
