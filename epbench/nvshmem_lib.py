"""ctypes loader for the NVSHMEM groundwork library (csrc/nvshmem/ -> epbench/_lib/libepbench_nvshmem.so).

Multi-node dispatch/combine (issue #5): NVSHMEM bootstrap over a unique id that torch.distributed
carries from rank 0 to every rank, an all-to-all put-with-signal ping, and the hierarchical
dispatch/combine kernels (eph_*, csrc/nvshmem/hier_*.cu) that the ``epbench-hier`` backend drives
(csrc/nvshmem/api_nvshmem.h).
"""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Any, Dict, List, Optional

from epbench.errors import StartupError

LIB_PATH = Path(__file__).resolve().parent / "_lib" / "libepbench_nvshmem.so"
NOT_BUILT = "NVSHMEM library not built: run `make build` (it needs nvcc and the nvidia-nvshmem-cu13 wheel)"
STARTUP_HINT = ("NVSHMEM_DEBUG=INFO says more; check NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME (on one host: lo) "
                "and NVSHMEM_SYMMETRIC_SIZE")
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
        "eph_create": [ctypes.POINTER(EphConfig), ctypes.POINTER(vp)],
        "eph_region": [vp, i, ctypes.POINTER(ctypes.c_ulonglong), ctypes.POINTER(ctypes.c_ulonglong)],
        "eph_dispatch": [vp, vp, vp, vp, vp, i, i, i, i, ctypes.c_longlong, vp],
        "eph_combine": [vp, vp, vp, vp, i, i, i, ctypes.c_longlong, vp],
        "eph_poll_error": [vp, ip, ip, ip],
        "eph_destroy": [vp],
    }


class EphConfig(ctypes.Structure):
    """EphConfig of csrc/nvshmem/api_nvshmem.h."""

    _fields_ = [(name, ctypes.c_int) for name in ("rank", "world", "gpus_per_node", "device", "hidden",
                                                   "max_tokens", "topk", "experts_per_rank", "fp8")] + \
        [("timeout_s", ctypes.c_double), ("transport", ctypes.c_int)]


# Regions of a hierarchical context (enum EPH_* of the header).
EPH_RECV_X, EPH_RECV_SCALES, EPH_RECV_IDX, EPH_RECV_W, EPH_COMBINE_IN, EPH_NUM_RECV, EPH_EXPERT_COUNTS = range(7)
# Phases a hierarchical kernel reports when it gives up waiting (enum HierPhase of csrc/nvshmem/hier_common.cuh).
PHASES = {11: "hierarchical count exchange", 12: "hierarchical dispatch (waiting for a chunk from the rail peer)",
          13: "hierarchical dispatch (waiting for a GPU of this node to finish forwarding)",
          14: "hierarchical combine (waiting for a GPU of this node to be ready)",
          15: "hierarchical combine (waiting for a partial sum from another node)"}


def _declare(lib: ctypes.CDLL) -> None:
    lib.epn_last_error.restype = ctypes.c_char_p
    lib.epn_last_error.argtypes = []
    lib.eph_symmetric_bytes.restype = ctypes.c_longlong
    lib.eph_symmetric_bytes.argtypes = [ctypes.POINTER(EphConfig)]
    lib.eph_error_flag_ptr.restype = ctypes.c_void_p
    lib.eph_error_flag_ptr.argtypes = [ctypes.c_void_p]
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
        from epbench.cuda_lib import open_library

        lib = open_library(LIB_PATH, NOT_BUILT, _declare)
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
    try:
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
    except RuntimeError as e:
        raise StartupError(f"NVSHMEM could not start on rank {rank}: {e} ({STARTUP_HINT})") from e
    return lib


_initialised: Optional[tuple] = None  # (rank, world, device) once this process has initialised NVSHMEM
HEAP_MARGIN = 256 << 20  # NVSHMEM's own symmetric allocations (the ping's buffers, internal state)


def ensure_initialised(rank: int, world: int, device: int, heap_bytes: int) -> ctypes.CDLL:
    """Initialises NVSHMEM once per process (collective), with a symmetric heap of at least
    ``heap_bytes`` plus a margin: NVSHMEM_SYMMETRIC_SIZE is set here unless the user set it (then
    theirs is used as given). Later calls with the same (rank, world, device) reuse it; NVSHMEM is
    left initialised until the process ends (finalize is collective, and a rank that failed would
    hang its peers in it)."""
    import os

    global _initialised
    want = (rank, world, device)
    if _initialised is not None:
        if _initialised != want:
            raise RuntimeError(f"epbench NVSHMEM: already initialised as rank/world/device {_initialised}, "
                               f"asked for {want}")
        return load()
    if "NVSHMEM_SYMMETRIC_SIZE" not in os.environ:
        os.environ["NVSHMEM_SYMMETRIC_SIZE"] = str(max(1 << 30, heap_bytes + HEAP_MARGIN))
    os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")  # never NVLink multicast
    lib = bootstrap(rank, world, device)
    _initialised = want
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
    global _initialised
    check(load().epn_finalize(), "epn_finalize")
    _initialised = None
