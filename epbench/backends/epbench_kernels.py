"""The ``epbench`` backend: epbench's own intranode dispatch/combine kernels (csrc/).

One device region per rank holds every buffer (sized for the worst case: all tokens of all
ranks routed to one rank); it is exported with one CUDA IPC handle, the handles are swapped
with ``all_gather_object`` and every peer's region is mapped once, in the constructor.
``dispatch`` launches the notify kernel (count exchange, slots, and the barrier that makes
buffer reuse safe) and the dispatch kernel; ``combine`` launches the pull-and-reduce kernel.
Nothing is allocated and nothing waits on the host inside either call; ``num_recv`` and
``expert_counts`` stay on the device.

Tuning knobs other than the SM count are backend options (epbench/options.py, ``SCHEMAS["epbench"]``:
dispatch_impl lean_dyn | lean, dispatch_warps, notify_impl grid | staged, combine_warps, combine_stages,
combine_chunk, own_rows sm | ce | all, combine_rows pull | ce, fused_stores 8 | 16), given to the constructor; the driver resolves them from the scenario, ``--option`` and
the environment. ``effective_config()`` reads back what the library launched (csrc/api.h ep_effective),
after the combine's clamp of its warps to the stages that fit and the notify's fallback to ``direct``.
Payloads: bf16, fp8 (f32 scale per 128 elements) and mxfp8 (E8M0 byte per 32, epbench/mxfp8.py), the
quantized ones handed in by the caller (``quantize: before``); mxfp8 also ``quantize: fused``: the caller
hands bf16 rows and the dispatch kernel casts them in registers on the way (csrc/dispatch.cu, mxfp8_cast),
so the link carries mxfp8 rows and the receivers get e4m3 ``x`` and uint8 ``x_scales`` [rows, hidden / 32]
(a view of a buffer whose rows are padded to 16 bytes). ``fused_stores=16`` (the default): each lane casts two
adjacent vectors and stores 16 bytes; 8 casts one vector per 8-byte store (twice the store instructions; the
same bytes arrive).
``layout: expert_major`` (``align``): ``x`` / ``x_scales`` / ``combine_input`` hold per-expert segments
(epbench/layout.py), filled by the dispatch kernel itself (one row per (token, rank) on the link, the extra
copies made by the receiver in the same kernel); combine sums each row's experts on the receiver inside the
combine kernel (csrc/dispatch.cu, combine.cu; notes/KERNELS.md, expert-major). The segment table stays on
the device (``DispatchOutput.expert_major``).
``own_rows=ce`` (default ``sm``; rank-major and quantize before only, epbench/options.py check_payload): a rank's
own rows are not stored by the dispatch kernel's SMs. Its receive buffer starts with its own tokens by index, rows
[0, T) = x, x_scales, topk_idx and topk_weights as handed in, copied by the copy engine (``copy_`` of contiguous
tensors on one device is a cudaMemcpyAsync) on a side stream forked from the caller's stream before the notify
kernel and joined after the dispatch kernel (events: graph-capturable); the peers' packed rows follow (the notify
kernel shifts its offsets by T). A token not routed to its own rank leaves a padding row, marked -1 in ``row_key``
(``DispatchOutput.row_key``: source rank << 32 | source token, written by the kernels; epbench/layout.py
own_first_keys), and ``num_recv`` = T + the peers' rows. Combine reads token t's own row at row t.
Notes: notes/LATENCY-NEXT.md section 3 (Plan A).
``own_rows=all`` (same limits): every source s's rows by token index at rows [s x max_tokens, s x max_tokens + T_s)
of every rank's buffer; after the notify kernel ep_dispatch copies x (and scales) with the copy engine, into the
peers on one stream in ring order and into my own segment on another, while a small kernel stores ids, weights and
every row's key (-1 where the token is not routed there); a one-block kernel then signals completion: no SM moves
a row. ``num_recv`` = world x max_tokens (epbench/layout.py by_source_keys).
Notes: notes/LATENCY-NEXT.md (Plan C).
``combine_rows=ce`` (needs ``own_rows=all``; default ``pull``): a holder's rows of source s are then one range, which
its copy engine pushes into s's staging buffer inside ``combine`` (16 chunks, each followed by a flag written by
a stream memory operation); s's combine kernel sums its own rows and the staged ones from local memory only.
Every rank must pass the same token count (a rank holding fewer than a peer stops at once, naming it).
Notes: notes/LATENCY-NEXT.md (Plan B').
Debug only: ``set_debug_stamps(True)`` makes the kernels store %globaltimer per phase, read with
``debug_stamps()`` after a synchronize (cuda_lib.STAMPS names them); off by default.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Any, Dict, Optional, Sequence, Union

import torch

from epbench import cuda_lib, options
from epbench.backends.base import NormalMode
from epbench.contract import DispatchInput, DispatchOutput, RankSetup
from epbench.backends.kernel_common import (poison_dispatch_outputs, raw_stream_getter, release_collective,
                                            wait_then_check)
from epbench.layout import ExpertMajor, slot_capacity

MAX_WORLD = 8
EM_PUSH_NAME = {v: k for k, v in cuda_lib.EM_PUSH.items()}  # what ep_effective.dispatch_em_push says ran
MAX_TOPK = 32
NOTIFY_SMEM_BYTES = 227 * 1024


class _Option:
    """A backend option that lives in the C context (ep_set_option): assigning validates the value (a name of
    ``allowed`` when it is a dict of name -> code, else one of the allowed ints), passes it to the library
    and keeps it for reading back."""

    def __init__(self, key: int, allowed: Union[Dict[str, int], Sequence[int]]) -> None:
        self.key, self.allowed = key, allowed

    def __set_name__(self, owner: type, name: str) -> None:
        self.name, self.slot = name, "_opt_" + name

    def __get__(self, obj: Any, objtype: Optional[type] = None) -> Any:
        return self if obj is None else getattr(obj, self.slot)

    def __set__(self, obj: Any, value: Any) -> None:
        named = isinstance(self.allowed, dict)
        if not named:
            value = int(value)
        if value not in self.allowed:
            raise ValueError(f"{self.name} must be one of {list(self.allowed)}, got {value!r}")
        code = self.allowed[value] if named else value
        cuda_lib.check(obj._lib.ep_set_option(obj._ctx, self.key, code), "ep_set_option")
        setattr(obj, self.slot, value)


@dataclass
class _Handle:
    """What combine needs from the matching dispatch (the layout itself stays on the device)."""

    num_tokens: int
    topk_idx: torch.Tensor
    topk_weights: torch.Tensor
    epoch: int
    out: torch.Tensor  # rows [0, T) of the combine output buffer


def resolve_options(key: str, given: Dict[str, Any], setup: RankSetup) -> Dict[str, Any]:
    """Every option of schema ``key`` (given > environment > default), each given value parsed; UserError for a
    bad value or for own_rows=ce / fused_stores=16 with a payload they cannot serve (options.check_payload)."""
    schema = options.SCHEMAS[key]
    resolved = {k: schema[k].parse(v, k) if k in given else v for k, v in options.resolve(key, given).items()}
    asked = {k: resolved[k] for k in ("own_rows", "combine_rows", "pull_kernel", "ce_chunks", "ce_chunking",
                                      "ce_streams", "ce_share", "fused_stores", "em_push", "em_sms", "dispatch_warps",
                                      *options.PULL_TMA_KNOBS) if k in given}
    options.check_payload({"epbench": asked}, setup.layout, setup.quantize, "epbench backend", world=setup.world)
    return resolved


class _OwnRowsCopy:
    """own_rows ce: copies on a side stream between two events of the caller's stream. ``fork`` records the
    caller's current stream, makes the side stream wait for it and queues each (destination, source) copy there
    (``copy_`` of contiguous tensors of one dtype on one device is a cudaMemcpyAsync: the copy engine; a pair
    with a None source is skipped); ``join`` makes the caller's stream wait for the copies. Both are legal while
    a graph is being captured (the side stream joins the capture through the event)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.side = torch.cuda.Stream(device)
        self.forked, self.done = torch.cuda.Event(), torch.cuda.Event()
        self.caller: Optional[torch.cuda.Stream] = None

    def fork(self, pairs: Any) -> None:
        self.caller = torch.cuda.current_stream(self.device)
        self.forked.record(self.caller)
        self.side.wait_event(self.forked)
        with torch.cuda.stream(self.side):
            for dst, src in pairs:
                if src is not None:
                    dst.copy_(src)
        self.done.record(self.side)

    def join(self) -> None:
        self.caller.wait_event(self.done)


def intranode_reason(setup: RankSetup) -> Optional[str]:
    """Why epbench's intranode kernels (normal or low-latency) cannot run for ``setup``, or None."""
    if setup.device.type != "cuda" or not torch.cuda.is_available():
        return "needs CUDA GPUs"
    if setup.world > MAX_WORLD:
        return f"intranode kernels handle at most {MAX_WORLD} ranks (world {setup.world})"
    if setup.world > setup.gpus_per_node:
        return "intranode only: every rank must be in one NVLink domain (nodes > 1)"
    if torch.cuda.get_device_capability(setup.device)[0] < 9:
        return "needs compute capability 9.0 or newer (kernels are built for sm_90)"
    if setup.topk > MAX_TOPK:
        return f"topk {setup.topk} > {MAX_TOPK}"
    multiple = {"fp8": 128, "mxfp8": 32}.get(setup.dispatch_dtype, 8)
    if setup.hidden % multiple:
        return f"hidden {setup.hidden} must be a multiple of {multiple}"
    try:
        cuda_lib.load()
    except RuntimeError as e:
        return str(e)
    return None


class EpbenchBackend(NormalMode):
    name = "epbench"
    options_key = "epbench"  # the option schema (options.SCHEMAS), kept by subclasses of other names
    uses_sms = True
    host_free_calls = True  # nothing waits on the host inside either call (above)
    dtypes = ("bf16", "fp8", "mxfp8")
    quantize_modes = ("before", "fused")  # fused: mxfp8 only (unavailable_reason)
    layouts = ("rank_major", "expert_major")
    own_rows = "sm"  # backend option own_rows (set per instance; the module docstring says what ce changes)
    combine_rows = "pull"  # backend option combine_rows (set per instance; the module docstring says what ce changes)
    pull_kernel = "auto"  # backend option pull_kernel (set per instance): combine_rows pull's kernel
    combine_stage: Optional[torch.Tensor] = None  # combine_rows ce: the staging buffer (set per instance)
    em_align = 0  # expert-major segments' alignment, 0 rank-major (set per instance from the scenario)

    @classmethod
    def unavailable_reason(cls, setup: RankSetup) -> Optional[str]:
        if setup.quantize == "fused" and setup.dispatch_dtype != "mxfp8":
            return f"quantize fused is implemented for mxfp8 only (dispatch_dtype {setup.dispatch_dtype})"
        if setup.num_experts * 4 > NOTIFY_SMEM_BYTES:
            return intranode_reason(setup) or \
                f"{setup.num_experts} experts exceed the notify kernel's shared memory"
        return intranode_reason(setup)

    def __init__(self, setup: RankSetup, *, dispatch_impl: Optional[str] = None,
                 dispatch_warps: Optional[int] = None, notify_impl: Optional[str] = None,
                 combine_warps: Optional[int] = None, combine_stages: Optional[int] = None,
                 combine_chunk: Optional[int] = None, own_rows: Optional[str] = None,
                 fused_stores: Optional[int] = None, em_push: Optional[str] = None,
                 em_sms: Optional[int] = None, combine_rows: Optional[str] = None, ce_chunks: Optional[int] = None,
                 ce_streams: Optional[int] = None, ce_share: Optional[int] = None,
                 ce_chunking: Optional[str] = None, pull_kernel: Optional[str] = None) -> None:
        reason = self.unavailable_reason(setup)
        if reason:
            raise RuntimeError(f"epbench backend unavailable: {reason}")
        self.s = setup
        given = {k: v for k, v in (("dispatch_impl", dispatch_impl), ("dispatch_warps", dispatch_warps),
                                   ("notify_impl", notify_impl), ("combine_warps", combine_warps),
                                   ("combine_stages", combine_stages), ("combine_chunk", combine_chunk),
                                   ("own_rows", own_rows), ("fused_stores", fused_stores), ("em_push", em_push),
                                   ("em_sms", em_sms), ("combine_rows", combine_rows), ("ce_chunks", ce_chunks),
                                   ("ce_streams", ce_streams), ("ce_share", ce_share), ("ce_chunking", ce_chunking),
                                   ("pull_kernel", pull_kernel))
                 if v is not None}
        resolved = resolve_options(self.options_key, given, setup)
        self.own_rows = resolved["own_rows"]
        self.combine_rows = resolved["combine_rows"]
        # combine_rows ce only; ce_chunks and ce_streams by world where not given (options.ce_chunks_for, _streams_for)
        self.ce_chunks = options.ce_chunks_for(setup.world, resolved, given)
        self.ce_chunks_made = options.ce_chunks_made(setup.max_tokens_per_rank, self.ce_chunks)  # of the buffer's rows
        self.ce_streams = options.ce_streams_for(setup.world, resolved, given)
        self.ce_chunking = resolved["ce_chunking"]
        self.pull_kernel = resolved["pull_kernel"]
        self.ce_share = resolved["ce_share"]  # own_rows all only
        self.fused_stores = resolved["fused_stores"]  # quantize fused only (ignored otherwise)
        self.em_push = resolved["em_push"]  # expert-major only (check_payload refuses it elsewhere)
        self.em_sms = resolved["em_sms"]  # expert-major only, likewise
        self.dispatch_impl = resolved["dispatch_impl"]
        self.dispatch_warps = resolved["dispatch_warps"]
        self.combine_warps = resolved["combine_warps"]
        self._lib = cuda_lib.load()
        self.device = torch.device("cuda", setup.device.index if setup.device.index is not None
                                   else torch.cuda.current_device())
        self.fp8 = setup.dispatch_dtype == "fp8"
        self.mxfp8 = setup.dispatch_dtype == "mxfp8"
        self.fused = setup.quantize == "fused"
        self.em_align = setup.align if setup.layout == "expert_major" else 0  # 0: rank-major
        cfg = cuda_lib.EpConfig(setup.rank, setup.world, self.device.index, setup.hidden,
                                setup.max_tokens_per_rank, setup.topk, setup.experts_per_rank,
                                int(self.fp8), float(setup.timeout_s), int(self.mxfp8),
                                cuda_lib.FUSED_STORES[self.fused_stores] if self.fused else 0,
                                self.em_align, cuda_lib.OWN_ROWS[self.own_rows],
                                cuda_lib.EM_PUSH[self.em_push] if self.em_align else 0,
                                cuda_lib.COMBINE_ROWS[self.combine_rows])
        self._ctx = ctypes.c_void_p()
        cuda_lib.check(self._lib.ep_create(ctypes.byref(cfg), ctypes.byref(self._ctx)), "ep_create")
        self._open_peers()
        self._views()
        self.notify_impl = resolved["notify_impl"]
        self.combine_stages = resolved["combine_stages"]
        self.combine_chunk = resolved["combine_chunk"]
        pull = options.pull_kernel_code(resolved, given)  # 1 bulk: csrc/combine.cu combine_ce_bulk_kernel<true>
        if self.combine_rows == "pull" and pull:  # 2 auto: ep_pull_auto per call; combine_impl records what ran
            cuda_lib.check(self._lib.ep_set_option(self._ctx, cuda_lib.OPT_PULL_KERNEL, pull), "ep_set_option")
        if self.combine_rows == "ce":  # the push's shape (csrc/combine.cu push_rows_by_ce)
            cuda_lib.check(self._lib.ep_set_option(self._ctx, cuda_lib.OPT_CE_CHUNKS, self.ce_chunks), "ep_set_option")
            cuda_lib.check(self._lib.ep_set_option(self._ctx, cuda_lib.OPT_CE_STREAMS, self.ce_streams), "ep_set_option")
            cuda_lib.check(self._lib.ep_set_option(self._ctx, cuda_lib.OPT_CE_GROW, int(self.ce_chunking == "grow")),
                           "ep_set_option")
        if self.own_rows == "all":  # the copy engines' share of the dispatch's x rows (csrc/dispatch.cu ce_tail_kernel)
            cuda_lib.check(self._lib.ep_set_option(self._ctx, cuda_lib.OPT_CE_SHARE, self.ce_share), "ep_set_option")
        if self.em_align and self.em_sms:  # the expansion and phase R in kernels of their own (csrc/dispatch.cu)
            cuda_lib.check(self._lib.ep_set_option(self._ctx, cuda_lib.OPT_EM_SMS, self.em_sms), "ep_set_option")
            self.sms_beyond = (f"em_sms={self.em_sms}: its expert-major expansion and reduce passes run on "
                               f"{self.em_sms} blocks of their own after the transfer's --sms blocks (and the "
                               f"ordinal pass before it, where em_sms is the larger)")
        # The timeout record's flag word, read without a function call on every dispatch/combine.
        self._timed_out = ctypes.c_int.from_address(self._lib.ep_error_flag_ptr(self._ctx))
        self._stream = raw_stream_getter(self.device)
        self._x_dtype = torch.float8_e4m3fn if (self.fp8 or self.mxfp8) and not self.fused else torch.bfloat16
        self._scales_in = (self.fp8 or self.mxfp8) and not self.fused  # the caller hands x_scales
        self._dispatch_epoch = 0
        self._combine_epoch = 0
        self._checked: Optional[tuple] = None  # tensors of the last input that passed _check_input
        self._out_ptr = self.out.data_ptr()
        self._out_t, self._out_view = setup.max_tokens_per_rank, self.out
        # own_rows ce: the caller's copy of its own rows (own_rows all: ep_dispatch copies them itself)
        self._own_copy: Optional[_OwnRowsCopy] = _OwnRowsCopy(self.device) if self.own_rows == "ce" else None
        self._own_t, self._own_dst = -1, ()  # own_rows ce: rows [0, T) of each receive buffer, made once per T

    # ---- set-up ----
    def _open_peers(self) -> None:
        cuda_lib.open_peers(self._lib, self._ctx, self.s.world)

    def _region(self, which: int) -> torch.Tensor:
        return cuda_lib.region_tensor(self._lib.ep_region, self._ctx, which, self.device)

    def _views(self) -> None:
        s = self.s
        cap, h, k = s.world * s.max_tokens_per_rank, s.hidden, s.topk
        # rows of x, scales and combine_in: slots of the expert segments in the expert-major layout
        rows = slot_capacity(s.world, s.max_tokens_per_rank, k, s.experts_per_rank, self.em_align) \
            if self.em_align else cap
        x_dtype = torch.float8_e4m3fn if self.fp8 or self.mxfp8 else torch.bfloat16
        self.recv_x = self._region(cuda_lib.RECV_X).view(x_dtype).view(rows, h)
        self.recv_scales = None
        if self.fp8:
            self.recv_scales = self._region(cuda_lib.RECV_SCALES).view(torch.float32).view(rows, h // 128)
        elif self.mxfp8:  # rows padded to 16 bytes by the library (csrc/buffers.cu scale_stride)
            self.recv_scales = self._region(cuda_lib.RECV_SCALES).view(rows, -1)[:, :h // 32]
        self.recv_idx = self._region(cuda_lib.RECV_IDX).view(torch.int64).view(cap, k)
        self.recv_w = self._region(cuda_lib.RECV_W).view(torch.float32).view(cap, k)
        self.combine_in = self._region(cuda_lib.COMBINE_IN).view(torch.bfloat16).view(rows, h)
        # own_rows ce: each row's source rank << 32 | source token, -1 for padding (None with own_rows sm)
        self.recv_key = self._region(cuda_lib.RECV_KEY).view(torch.int64).view(cap) if self.own_rows != "sm" else None
        # combine_rows ce: the peers' rows of my tokens as their copy engines pushed them (poisoned with the outputs)
        self.combine_stage = (self._region(cuda_lib.COMBINE_STAGE).view(torch.bfloat16).view(cap, h)
                              if self.combine_rows == "ce" else None)

        self.out = self._region(cuda_lib.OUT).view(torch.bfloat16).view(s.max_tokens_per_rank, h)
        self.num_recv = self._region(cuda_lib.NUM_RECV).view(torch.int64).view(())
        self.expert_counts = self._region(cuda_lib.EXPERT_COUNTS).view(torch.int64)
        self.em_table: Optional[ExpertMajor] = None  # the segment table, on the device
        if self.em_align:
            self.em_table = ExpertMajor(self.expert_counts, self._region(cuda_lib.EM_OFFSETS).view(torch.int64),
                                        self._region(cuda_lib.EM_NUM_SLOTS).view(torch.int64).view(()),
                                        self.em_align)

    # ---- the two operations ----
    # Both run on the host while the GPU may already wait for them (the timed region starts at
    # the previous event), so they do as little Python as possible: measured 35 us per call in v1.
    @property
    def dispatch_impl(self) -> str:
        return self._impl

    @dispatch_impl.setter
    def dispatch_impl(self, value: str) -> None:
        value = dict(options.SCHEMAS[self.options_key]["dispatch_impl"].aliases).get(value, value)
        if value not in cuda_lib.DISPATCH_IMPLS:
            raise ValueError(f"dispatch_impl must be one of {list(cuda_lib.DISPATCH_IMPLS)}, got {value!r}")
        self._impl = value
        self._impl_code = cuda_lib.DISPATCH_IMPLS[value]

    # Options set with ep_set_option (one descriptor each, see _Option; direct is a fallback, not a choice).
    notify_impl = _Option(cuda_lib.OPT_NOTIFY_IMPL, {k: cuda_lib.NOTIFY_IMPLS[k] for k in ("grid", "staged")})
    combine_stages = _Option(cuda_lib.OPT_COMBINE_STAGES, (2, 3, 4))
    combine_chunk = _Option(cuda_lib.OPT_COMBINE_CHUNK, (1024, 2048, 4096))

    def effective_config(self) -> Dict[str, Any]:
        """What the library launched last (csrc/api.h ep_effective), as option names; before any call, the
        resolved options."""
        eff = cuda_lib.EpEffective()
        cuda_lib.check(self._lib.ep_effective_config(self._ctx, ctypes.byref(eff)), "ep_effective_config")
        if eff.dispatch_warps == 0 and eff.combine_warps == 0:
            return {"dispatch_impl": self._impl, "dispatch_warps": self.dispatch_warps,
                    "notify_impl": self.notify_impl, "combine_warps": self.combine_warps,
                    "combine_stages": self.combine_stages, "combine_chunk": self.combine_chunk,
                    "dispatch_dtype": self.s.dispatch_dtype, "quantize": self.s.quantize, "own_rows": self.own_rows,
                    "combine_rows": self.combine_rows, **self._ce_config(),
                    **({"fused_stores": self.fused_stores} if self.fused else {}),
                    **({"em_push": self.em_push, "em_sms": self.em_sms} if self.em_align else {})}
        # own_rows: fixed at ep_create, no fallback; em_push: as the library says it ran (an older build runs receiver)
        return {**cuda_lib.decode_effective(eff), "own_rows": self.own_rows, "combine_rows": self.combine_rows,
                **self._ce_config(),
                **({"em_push": EM_PUSH_NAME.get(eff.dispatch_em_push, str(eff.dispatch_em_push)),
                    "em_reduce": "wide" if eff.combine_em_wide else "batched", "em_sms": eff.em_sms}
                   if self.em_align else {})}

    def _ce_config(self) -> Dict[str, int]:
        """own_rows all: the copy engines' share of the dispatch's rows; combine_rows ce: the push's chunking, its
        chunks where even (asked, and made of the buffer's max_tokens rows: fewer where they do not divide) and its
        streams (a peer's at 2 ranks, in all at 3 or more) (all fixed at construction). The pull's kernel
        (pull_kernel) is the library's own record, combine_impl tma or bulk."""
        ce = self.combine_rows == "ce"
        even = ce and self.ce_chunking == "even"
        return {**({"ce_share": self.ce_share} if self.own_rows == "all" else {}),
                **({"ce_chunking": self.ce_chunking} if ce else {}),
                **({"ce_chunks": self.ce_chunks,
                    "ce_chunks_made": self.ce_chunks_made} if even else {}),
                **({"ce_streams": self.ce_streams} if ce else {})}

    def set_debug_stamps(self, on: bool) -> None:
        """Debug aid: per-phase %globaltimer stamps of the next calls (costs a few stores)."""
        cuda_lib.check(self._lib.ep_set_option(self._ctx, cuda_lib.OPT_DEBUG_STAMPS, int(on)), "ep_set_option")

    def set_cb_skip(self, what: str) -> None:
        """Measuring aid (debug stamps on only): the bulk kernel's summers leave out their stores ("stores"), their
        shared-memory reads and stores, summing register words instead ("smem"), or their reads, sums and stores
        ("reads"); "none" restores them (cuda_lib.CB_SKIP). Outputs are not written meanwhile: never verify."""
        cuda_lib.check(self._lib.ep_set_option(self._ctx, cuda_lib.OPT_CB_SKIP, cuda_lib.CB_SKIP[what]),
                       "ep_set_option")

    def debug_stamps(self) -> Dict[str, int]:
        """The stamps of the last call (ns, this GPU's %globaltimer); synchronize first."""
        raw = self._region(cuda_lib.DEBUG_STAMPS).view(torch.int64).cpu().tolist()
        return dict(zip(cuda_lib.STAMPS, raw))

    def _check_input(self, inp: DispatchInput) -> None:
        cuda_lib.check_dispatch_input(inp, self.s, self._x_dtype, self.fp8 and self._scales_in,
                                      self.mxfp8 and self._scales_in)

    def dispatch(self, inp: DispatchInput, num_sms: int) -> DispatchOutput:
        x, idx, w = inp.x, inp.topk_idx, inp.topk_weights
        c = self._checked
        if c is None or c[0] is not x or c[1] is not idx or c[2] is not w or c[3] is not inp.x_scales:
            self._check_input(inp)
            self._checked = (x, idx, w, inp.x_scales)
        t = x.shape[0]
        if t != self._out_t:
            self._out_t, self._out_view = t, self.out[:t]
        x_ptr = x.data_ptr()
        self._dispatch_epoch += 1
        own = self._own_copy
        if own is not None and t:  # before the notify kernel, on the side stream
            own.fork(zip(self._own_rows_dst(t), (x, inp.x_scales, idx, w)))
        rc = self._lib.ep_dispatch(
            self._ctx, x_ptr, inp.x_scales.data_ptr() if self._scales_in else None, idx.data_ptr(),
            w.data_ptr(), t, num_sms, self._impl_code, self.dispatch_warps, self._dispatch_epoch, self._stream())
        if own is not None and t:
            own.join()  # also after a failed launch: the side stream never stays forked
        if rc:
            cuda_lib.check(rc, "dispatch")
        if self._timed_out.value:
            self._raise_if_timed_out()
        handle = _Handle(t, idx, w, self._dispatch_epoch, self._out_view)
        return DispatchOutput(self.recv_x, self.recv_scales, self.recv_idx, self.recv_w,
                              self.expert_counts, self.num_recv, handle, self.em_table, row_key=self.recv_key)

    def _own_rows_dst(self, t: int) -> tuple:
        """own_rows ce: rows [0, t) of recv_x, recv_scales (None without scales), recv_idx and recv_w, in the
        order of the dispatch input's x, x_scales, topk_idx, topk_weights (views made once per t)."""
        if t != self._own_t:
            rows = slice(0, t)
            scales = self.recv_scales[rows] if self._scales_in else None
            self._own_t, self._own_dst = t, (self.recv_x[rows], scales, self.recv_idx[rows], self.recv_w[rows])
        return self._own_dst

    def _combine_warps_for(self, num_sms: int) -> int:
        """combine_warps, or with 0 the measured rule (notes/KERNELS.md): the combine is bound by
        its warps' own reductions at 8 SMs (12 warps fit: fastest) and by the fabric from 16 SMs on, where
        more than ~128 warps in the grid only adds load traffic (16 warps at 32 SMs: +3%)."""
        if self.combine_warps:
            return self.combine_warps
        if self.em_align:  # expert-major: phase R's loads are bound by the warps in flight (KERNELS.md H2)
            return 16
        return max(8, min(16, 128 // max(1, num_sms)))

    def combine_input(self, out: DispatchOutput) -> torch.Tensor:
        return self.combine_in

    def combine(self, out: DispatchOutput, num_sms: int) -> torch.Tensor:
        h: _Handle = out.handle
        if h.epoch != self._dispatch_epoch:
            raise RuntimeError("epbench combine must follow its own dispatch (another dispatch ran since)")
        self._combine_epoch += 1
        rc = self._lib.ep_combine(self._ctx, self._out_ptr, h.topk_idx.data_ptr(), h.topk_weights.data_ptr(),
                                  h.num_tokens, num_sms, self._combine_warps_for(num_sms), self._combine_epoch,
                                  self._stream())
        if rc:
            cuda_lib.check(rc, "combine")
        if self._timed_out.value:
            self._raise_if_timed_out()
        return h.out

    # ---- errors, poison, release ----
    def _raise_if_timed_out(self) -> None:
        cuda_lib.raise_if_timed_out(self._lib, self._ctx, self.s.timeout_s)

    def check_errors(self) -> None:
        """Waits for this rank's queued kernels, then raises if any of them timed out on a peer."""
        wait_then_check(self.device, self._raise_if_timed_out)

    def poison(self) -> None:
        poison_dispatch_outputs(self)
        if self.recv_key is not None:  # a key no kernel wrote reads as a row nobody sent, never as padding
            self.recv_key.fill_(torch.iinfo(torch.int64).max)
        if self.combine_stage is not None:  # a staged row summed before its copy landed reads as NaN
            self.combine_stage.fill_(float("nan"))
        if self.em_table is not None:
            self.em_table.offsets.fill_(-1)
            self.em_table.num_slots.fill_(-1)

    def close(self) -> None:
        """Collective: every rank must call it (peers may still write into this rank's region)."""
        if self._ctx:
            release_collective(self.device, self.s.world,
                               lambda: cuda_lib.check(self._lib.ep_destroy(self._ctx), "ep_destroy"))
            self._ctx = ctypes.c_void_p()
