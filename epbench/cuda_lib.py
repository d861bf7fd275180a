"""ctypes loader for epbench's compiled kernels (csrc/ -> epbench/_lib/libepbench_ep.so).

The library is plain CUDA C++ with an extern "C" API (csrc/api.h): device pointers go in as
``tensor.data_ptr()`` and the stream as ``torch.cuda.current_stream().cuda_stream``.
"""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Any, Dict, List, Optional

LIB_PATH = Path(__file__).resolve().parent / "_lib" / "libepbench_ep.so"
NOT_BUILT = "kernels not built: run `make build`"

# Region ids (enum ep_region_id in csrc/api.h).
RECV_X, RECV_SCALES, RECV_IDX, RECV_W, COMBINE_IN, OUT, NUM_RECV, EXPERT_COUNTS, DEBUG_STAMPS, DISPATCH_X = range(10)
# ep_set_option keys (enum ep_option) and notify variants (enum ep_notify_impl).
OPT_DEBUG_STAMPS, OPT_NOTIFY_IMPL, OPT_COMBINE_IMPL, OPT_COMBINE_STAGES, OPT_COMBINE_CHUNK = 0, 1, 2, 3, 4
OPT_EXCLUSIVE_SMS, OPT_SPLIT_OWN_WARPS = 5, 6
COMBINE_CHUNKS = (1024, 2048, 4096)
NOTIFY_IMPLS = {"direct": 0, "staged": 1, "grid": 2}
# Combine variants (enum ep_combine_impl): register pull (v1) or bulk-copy pull (v11).
COMBINE_IMPLS = {"pull": 0, "tma": 1}
# Indices of the debug stamps (enum EpStamp in csrc/common.cuh).
STAMPS = ["notify_start", "counted", "published", "slots", "peers_seen", "notify_end", "data_start",
          "data_last", "data_end", "block_counted", "data_first", "sm_mask0", "sm_mask1", "sm_mask2"]
# Dispatch implementations (enum ep_dispatch_impl).
DISPATCH_IMPLS = {"reg": 0, "tma": 1, "pipe": 2, "lean": 3, "dmaj": 4, "dmaj-norot": 5, "spread": 6,
                  "owntma": 7, "spreadtma": 8, "notify-only": 9, "lean-dyn": 10,
                  "ownbulk": 11, "pull": 12, "split": 13}
# Who writes a rank's rows to itself (enum ep_own_copy, ep_set_own_copy; v9, lean and spread only).
OWN_COPY_MODES = {"off": 0, "side": 1, "side-in": 2}
# NVLink micro-benchmark modes (ep_bench_link, csrc/bench.cu).
LINK_BENCH_MODES = {"store": 0, "load": 1, "split": 2, "interleave": 3, "push": 4, "pull": 5, "split-real": 6,
                    "interleave-real": 7, "push-fan": 8, "push-row": 9, "push-fan-row": 10,
                    "push-fan-row-meta": 11, "reduce-local": 12, "push-spread": 13, "push-spread-meta": 14,
                    "push-fan-row-meta-self": 15, "push-spread-meta-self": 16,
                    "tma-pull": 17, "tma-push": 18, "tma-pull-16k": 19, "tma-push-16k": 20,
                    "push-reduce": 21, "store-local": 22, "copy-local": 23}
# Phases a timed-out wait reports (enum EpPhase in csrc/common.cuh).
PHASES = {1: "notify (count exchange)", 2: "dispatch (waiting for rows)",
          3: "combine (waiting for peer ready)", 4: "combine (waiting for peers to finish pulling)",
          5: "low-latency dispatch (waiting for an expert's rows)",
          6: "low-latency combine (waiting for expert outputs)"}
# Low-latency regions (enum ep_ll_region_id in csrc/api.h).
LL_X, LL_SCALES, LL_PAIR, LL_COUNTS, LL_SRC_COUNTS, LL_COMBINE_IN, LL_OUT, LL_EPOCHS = range(8)


class EpConfig(ctypes.Structure):
    _fields_ = [
        ("rank", ctypes.c_int),
        ("world", ctypes.c_int),
        ("device", ctypes.c_int),
        ("hidden", ctypes.c_int),
        ("max_tokens", ctypes.c_int),
        ("topk", ctypes.c_int),
        ("experts_per_rank", ctypes.c_int),
        ("fp8", ctypes.c_int),
        ("timeout_s", ctypes.c_double),
    ]


_lib: Optional[ctypes.CDLL] = None


def signatures() -> Dict[str, List[Any]]:
    """ctypes argument types of every int-returning function of csrc/api.h that Python calls."""
    vp, i, ull = ctypes.c_void_p, ctypes.c_int, ctypes.c_ulonglong
    ip = ctypes.POINTER(ctypes.c_int)
    return {
        "ep_create": [ctypes.POINTER(EpConfig), ctypes.POINTER(vp)],
        "ep_ipc_handle": [vp, ctypes.c_char_p],
        "ep_open_peers": [vp, ctypes.c_char_p],
        "ep_region": [vp, i, ctypes.POINTER(ull), ctypes.POINTER(ull)],
        "ep_dispatch": [vp, vp, vp, vp, vp, i, i, i, i, i, i, vp],
        "ep_combine": [vp, vp, vp, vp, i, i, i, i, vp],
        "ep_poll_error": [vp, ip, ip, ip],
        "ep_set_option": [vp, i, i],
        "ep_set_own_copy": [vp, i, i],
        "ep_destroy": [vp],
        "ep_bench_link": [vp, i, i, i, ctypes.c_longlong, vp],
        "ep_ll_create": [ctypes.POINTER(EpConfig), ctypes.POINTER(vp)],
        "ep_ll_region": [vp, i, ctypes.POINTER(ull), ctypes.POINTER(ull)],
        "ep_ll_dispatch": [vp, vp, vp, vp, vp, i, i, i, vp],
        "ep_ll_combine": [vp, vp, i, i, i, vp],
        "ep_ll_destroy": [vp],
    }


def _declare(lib: ctypes.CDLL) -> None:
    vp = ctypes.c_void_p
    lib.ep_last_error.restype = ctypes.c_char_p
    lib.ep_last_error.argtypes = []
    lib.ep_ll_base.argtypes = [vp]
    lib.ep_ll_base.restype = vp
    lib.ep_error_flag_ptr.argtypes = [vp]
    lib.ep_error_flag_ptr.restype = vp
    for name, args in signatures().items():
        fn = getattr(lib, name)
        fn.argtypes = args
        fn.restype = ctypes.c_int


def open_library(path: Path, not_built: str, declare: Any) -> ctypes.CDLL:
    """Opens one of epbench's compiled libraries and declares its functions (``declare(lib)``);
    RuntimeError with a one-line reason when it is missing or cannot be loaded."""
    if not path.exists():
        raise RuntimeError(f"{not_built} ({path} is missing)")
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as e:
        raise RuntimeError(f"cannot load {path}: {e}; rebuild with `make build`") from e
    declare(lib)
    return lib


def load() -> ctypes.CDLL:
    """The loaded library; RuntimeError with a one-line reason when it is missing or broken."""
    global _lib
    if _lib is None:
        _lib = open_library(LIB_PATH, NOT_BUILT, _declare)
    return _lib


def check(rc: int, what: str) -> None:
    """Raises RuntimeError carrying the library's message when an API call failed."""
    if rc != 0:
        msg = load().ep_last_error().decode(errors="replace")
        raise RuntimeError(f"epbench kernels: {what} failed: {msg}")


def open_peers(lib: ctypes.CDLL, ctx: ctypes.c_void_p, world: int) -> None:
    """Exports this rank's region, swaps the IPC handles with every rank over torch.distributed
    and maps every peer's region (collective: every rank calls it)."""
    import torch.distributed as dist

    handle = ctypes.create_string_buffer(64)
    check(lib.ep_ipc_handle(ctx, handle), "ep_ipc_handle")
    handles = [handle.raw]
    if world > 1:
        handles = [b""] * world
        dist.all_gather_object(handles, handle.raw)
    check(lib.ep_open_peers(ctx, b"".join(handles)), "ep_open_peers")


class _DeviceBytes:
    """Exposes a raw device pointer to torch.as_tensor (no copy, no ownership)."""

    def __init__(self, ptr: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {
            "shape": (nbytes,), "typestr": "|u1", "data": (ptr, False), "version": 3, "strides": None,
        }


def region_tensor(getter: Any, ctx: ctypes.c_void_p, which: int, device: Any) -> Any:
    """A uint8 tensor over one region of the library's device memory (``getter`` is
    ep_region or ep_ll_region); it does not own the memory."""
    import torch

    ptr, nbytes = ctypes.c_ulonglong(), ctypes.c_ulonglong()
    check(getter(ctx, which, ctypes.byref(ptr), ctypes.byref(nbytes)), getter.__name__)
    if nbytes.value == 0:
        return torch.empty(0, dtype=torch.uint8, device=device)
    return torch.as_tensor(_DeviceBytes(ptr.value, nbytes.value), device=device)


def raise_if_timed_out(lib: ctypes.CDLL, ctx: ctypes.c_void_p, timeout_s: float,
                       poll: Any = None, phases: Optional[Dict[int, str]] = None) -> None:
    """Reads the host-mapped timeout record (no synchronisation) and raises naming the rank,
    the peer it waited for and the phase, if any kernel gave up. ``poll`` (default
    lib.ep_poll_error) and ``phases`` let the NVSHMEM library's kernels share this."""
    rank, peer, phase = ctypes.c_int(), ctypes.c_int(), ctypes.c_int()
    if (poll or lib.ep_poll_error)(ctx, ctypes.byref(rank), ctypes.byref(peer), ctypes.byref(phase)):
        what = (phases or PHASES).get(phase.value, f"phase {phase.value}")
        from epbench.errors import KernelTimeout

        raise KernelTimeout(f"epbench kernels: rank {rank.value} gave up after {timeout_s:g} s "
                           f"waiting for rank {peer.value} in {what}")


def check_dispatch_input(inp: Any, setup: Any, x_dtype: Any, fp8: bool) -> None:
    """What the kernels need of a dispatch input (shapes, dtypes, contiguity, 16-byte alignment);
    ValueError naming the first thing wrong."""
    import torch

    s, x = setup, inp.x
    if x.dtype != x_dtype or x.dim() != 2 or x.shape[1] != s.hidden:
        raise ValueError(f"x must be {x_dtype} [T, {s.hidden}], got {x.dtype} {list(x.shape)}")
    if x.shape[0] > s.max_tokens_per_rank:
        raise ValueError(f"{x.shape[0]} tokens > max_tokens_per_rank {s.max_tokens_per_rank}")
    if not (x.is_contiguous() and inp.topk_idx.is_contiguous() and inp.topk_weights.is_contiguous()):
        raise ValueError("x, topk_idx and topk_weights must be contiguous")
    if x.data_ptr() % 16:
        raise ValueError("x must be 16-byte aligned")
    if inp.topk_idx.dtype != torch.int64 or inp.topk_weights.dtype != torch.float32:
        raise ValueError("topk_idx must be int64 and topk_weights float32")
    if fp8 and (inp.x_scales is None or inp.x_scales.dtype != torch.float32
                or not inp.x_scales.is_contiguous()):
        raise ValueError("fp8 dispatch needs contiguous float32 x_scales [T, hidden / 128]")
