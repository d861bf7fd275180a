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
(RECV_X, RECV_SCALES, RECV_IDX, RECV_W, COMBINE_IN, OUT, NUM_RECV, EXPERT_COUNTS, DEBUG_STAMPS, EM_OFFSETS,
 EM_NUM_SLOTS, RECV_KEY, COMBINE_STAGE) = range(13)
# ep_config.own_rows: who stores a rank's own rows (backend option own_rows)
OWN_ROWS = {"sm": 0, "ce": 1, "all": 2}
# ep_config.combine_ce: who moves the peers' rows in combine (backend option combine_rows; ce needs own_rows all)
COMBINE_ROWS = {"pull": 0, "ce": 1}
# ep_config.em_push (expert-major): who writes a row into its further experts' slots (backend option em_push)
EM_PUSH = {"receiver": 0, "sender": 1, "wide": 2, "auto": 3}
# ep_config.quantize_fused for quantize fused: the bytes each lane stores per step (backend option fused_stores)
FUSED_STORES = {8: 1, 16: 2}
# ep_set_option keys (enum ep_option).
OPT_DEBUG_STAMPS, OPT_NOTIFY_IMPL, OPT_COMBINE_STAGES, OPT_COMBINE_CHUNK, OPT_EM_SMS = 0, 1, 3, 4, 5
OPT_CE_CHUNKS, OPT_CE_STREAMS = 6, 7  # combine_rows ce only
OPT_CE_SHARE = 8  # own_rows all only
OPT_CE_GROW = 9  # combine_rows ce only: 1 for growing chunks (epbench.ce_chunking grow)
OPT_PULL_KERNEL = 10  # combine_rows pull only: 1 the loading / summing warps (epbench.pull_kernel bulk), 2 auto
OPT_CB_SKIP = 11  # measuring aid, debug stamps on only: what the bulk kernel's summers leave out (CB_SKIP)
# csrc/common.cuh kCbSkip*: no stores; no reads, sums or stores; sums of register words, no shared-memory reads
CB_SKIP = {"none": 0, "stores": 1, "reads": 2, "smem": 4}
# Notify, combine and dispatch implementations (enums ep_notify_impl, ep_combine_impl, ep_dispatch_impl);
# direct is never asked for: it runs as the recorded fallback of the other two.
NOTIFY_IMPLS = {"direct": 0, "staged": 1, "grid": 2}
COMBINE_IMPLS = {"tma": 1, "ce": 2, "bulk": 3}
DISPATCH_IMPLS = {"lean": 3, "lean_dyn": 10}
# Indices of the debug stamps (enum EpStamp in csrc/common.cuh).
STAMPS = ["notify_start", "counted", "published", "slots", "peers_seen", "notify_end", "data_start",
          "data_last", "data_end", "block_counted", "data_first", "sm_mask0", "sm_mask1", "sm_mask2",
          # [14..24] the combine's bulk kernel (csrc/common.cuh kStampCb*): clock64 cycles summed over its warps
          "cb_loader_wait", "cb_summer_wait", "cb_loader_busy", "cb_summer_busy", "cb_units",
          "cb_loader_prep", "cb_summer_prep", "cb_loader_issue", "cb_summer_sum", "cb_ready",
          "cb_fold"]


class EpEffective(ctypes.Structure):
    """struct ep_effective (csrc/api.h): what the last dispatch / combine launched."""

    _fields_ = [(name, ctypes.c_int) for name in (
        "dispatch_impl", "dispatch_warps", "dispatch_sms", "notify_impl", "notify_blocks", "combine_impl",
        "combine_warps", "combine_sms", "combine_stages", "combine_chunk", "dispatch_scale_block",
        "dispatch_fused", "dispatch_em_push", "combine_em_wide", "em_sms")]

# ep_effective.dispatch_scale_block -> the scenario's dispatch_dtype
SCALE_BLOCK_DTYPES = {0: "bf16", 128: "fp8", 32: "mxfp8"}


def decode_effective(eff: EpEffective) -> Dict[str, Any]:
    """The struct as option names and values (epbench/options.py); a code no name maps to stays a number."""
    def name(table: Dict[str, int], code: int) -> Any:
        return next((k for k, v in table.items() if v == code), code)

    return {"dispatch_impl": name(DISPATCH_IMPLS, eff.dispatch_impl), "dispatch_warps": eff.dispatch_warps,
            "notify_impl": name(NOTIFY_IMPLS, eff.notify_impl), "notify_blocks": eff.notify_blocks,
            "combine_impl": name(COMBINE_IMPLS, eff.combine_impl), "combine_warps": eff.combine_warps,
            "combine_stages": eff.combine_stages, "combine_chunk": eff.combine_chunk,
            "dispatch_dtype": SCALE_BLOCK_DTYPES.get(eff.dispatch_scale_block, eff.dispatch_scale_block),
            "quantize": "fused" if eff.dispatch_fused else "before",
            **({"fused_stores": 16 if eff.dispatch_fused == 2 else 8} if eff.dispatch_fused else {})}


# Phases a timed-out wait reports (enum EpPhase in csrc/common.cuh).
PHASES = {1: "notify (count exchange)", 2: "dispatch (waiting for rows)",
          3: "combine (waiting for peer ready)", 4: "combine (waiting for peers to finish pulling)",
          5: "low-latency dispatch (waiting for an expert's rows)",
          6: "low-latency combine (waiting for expert outputs)",
          7: "low-latency dispatch: that rank sent other peer units (dispatch_units must be the same on every rank)",
          8: "low-latency dispatch: that rank put its rows elsewhere (dispatch_place must be the same on every rank)",
          9: "combine (waiting for rows a peer's copy engine pushed)",
          10: "combine: that rank holds fewer tokens than this one (combine_rows ce needs the same token count on "
              "every rank)"}
MISMATCH_PHASES = (7, 8, 10)  # reported at once, not after a wait: the record names a configuration fault
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
        ("mxfp8", ctypes.c_int),
        ("quantize_fused", ctypes.c_int),
        ("align", ctypes.c_int),  # 0: rank-major; >= 1: expert-major segments padded to this many rows
        ("own_rows", ctypes.c_int),  # OWN_ROWS: 0 sm (default), 1 ce (own rows by token index, copied by the caller),
                                     # 2 all (every source's rows by token index; peers' copied by ep_dispatch)
        ("em_push", ctypes.c_int),  # EM_PUSH: expert-major, 0 the receiver copies a row into its further slots,
                                    # 1 the sender stores every slot, 2 the receiver copies by TMA
        ("combine_ce", ctypes.c_int),  # COMBINE_ROWS: 0 pull (the combine kernel reads peers' rows over the link),
                                       # 1 ce (each holder's copy engine pushes them into a staging buffer)
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
        "ep_dispatch": [vp, vp, vp, vp, vp, i, i, i, i, i, vp],
        "ep_combine": [vp, vp, vp, vp, i, i, i, i, vp],
        "ep_poll_error": [vp, ip, ip, ip],
        "ep_set_option": [vp, i, i],
        "ep_effective_config": [vp, ctypes.POINTER(EpEffective)],
        "ep_destroy": [vp],
        "ep_ll_create": [ctypes.POINTER(EpConfig), ctypes.POINTER(vp)],
        "ep_ll_region": [vp, i, ctypes.POINTER(ull), ctypes.POINTER(ull)],
        "ep_ll_dispatch": [vp, vp, vp, vp, vp, i, i, i, vp],
        "ep_ll_combine": [vp, vp, i, i, i, i, vp],
        "ep_ll_destroy": [vp],
        "ep_ll_set_sync": [vp, i],
        "ep_ll_set_combine_order": [vp, i],
        "ep_ll_set_dispatch_units": [vp, i],
        "ep_ll_set_dispatch_place": [vp, i],
        "ep_ll_set_combine_release": [vp, i],
        "ep_ll_set_probe": [vp, vp],
        "ep_ll_set_probe_skip": [vp, i],
        "ep_ll_probe": [vp, i, i, i, vp],
        # csrc/ceiling.cu (not in api.h): the plain SM-store ceiling kernel, the local-sum one
        # and the SM memory rates
        "ep_store_ceiling": [ctypes.POINTER(ull), ctypes.POINTER(ctypes.c_longlong), i, vp, i, i,
                             vp],
        "ep_sum_ceiling": [vp, vp, i, ctypes.c_longlong, i, i, i, vp],
        "ep_sm_mem": [i, vp, vp, i, i, i, i, i, vp],  # python -m epbench.smmem
        "ep_ce_bounds": [i, i, i, vp],  # combine_rows ce's chunk bounds (tests/test_ce_bounds.py)
        "ep_pull_auto": [i, i, i],  # pull_kernel auto's choice for a call (tests/test_ce_bounds.py)
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
    try:
        declare(lib)
    except AttributeError as e:  # a library built from older sources lacks a function declared here
        raise RuntimeError(f"{path} is out of date ({e}); rebuild with `make build`") from e
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

        if phase.value in MISMATCH_PHASES and phases is None:
            raise KernelTimeout(f"epbench kernels: rank {rank.value} stopped at once, rank {peer.value} "
                                f"disagrees: {what}")
        raise KernelTimeout(f"epbench kernels: rank {rank.value} gave up after {timeout_s:g} s "
                           f"waiting for rank {peer.value} in {what}")


def check_dispatch_input(inp: Any, setup: Any, x_dtype: Any, fp8: bool, mxfp8: bool = False) -> None:
    """What the kernels need of a dispatch input (shapes, dtypes, contiguity, 16-byte alignment);
    ValueError naming the first thing wrong. ``fp8`` / ``mxfp8``: x_scales must come with x (float32
    per 128 elements / E8M0 bytes per 32); neither for bf16 rows, also those of a fused cast."""
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
    want = (x.shape[0], s.hidden // 32)
    if mxfp8 and (inp.x_scales is None or inp.x_scales.dtype != torch.uint8
                  or tuple(inp.x_scales.shape) != want or not inp.x_scales.is_contiguous()):
        raise ValueError(f"mxfp8 dispatch needs contiguous uint8 x_scales {list(want)}")
