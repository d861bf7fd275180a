"""The ``epbench-ll`` backend: epbench's low-latency dispatch/combine kernels (csrc/ll_*.cu).

Low-latency mode only (contract in base.py). Dispatch: each token crosses NVLink once per
destination rank that holds one of its experts, into a staging area there, with the slot of every
(token, expert) pair computed by the source itself (no layout pass, no host synchronisation, the
routing weights travel along); the receiver then copies each staged row into its experts' padded
slots locally. Combine: the expert side sums each token's experts on this rank with those weights
in fp32 and pushes one bf16 partial row per (token, rank) back to the source, which adds the
partials in fp32 (one extra bf16 rounding per partial, as in hierarchical combines). One device
region per rank (ll_buffers.cu), exported and mapped with the normal mode's IPC code (buffers.cu)
in the constructor. The kernels keep their epochs in device memory, so a captured CUDA graph of
either call can be replayed (``supports_cuda_graphs``).

The grid is ``num_sms`` blocks (at most the GPU's SM count: the receive phases need every block
resident) of ``warps`` warps; ``combine_chunk`` 2|4 picks combine's work-unit chunk (1 or 2 KiB of a
row); ``ll_sync`` grid|token picks how both kernels synchronise (grid-wide handshakes, or per-token
flags and per-block epochs: notes/LATENCY.md, round 3); ``combine_order`` source|rotated the order of
the combine's pushes (the same bytes either way, csrc/ll_combine.cu ``push_unit``); ``dispatch_units``
row|chunk|auto what one peer unit of the token-sync dispatch sends (csrc/ll_common.cuh, LlDispatchUnits);
``combine_release`` unit|batch how the token-sync combine releases its pushes' flags (LlCombineRelease);
``dispatch_place`` stage|slot|inline|line|line128|auto where the token-sync dispatch puts a peer's row (LlDispatchPlace).
All are backend options (epbench/options.py: defaults 16, auto, auto, rotated, auto, batch and auto;
env EPBENCH_LL_WARPS / EPBENCH_LL_COMBINE_CHUNK / EPBENCH_LL_SYNC / EPBENCH_LL_COMBINE_ORDER /
EPBENCH_LL_DISPATCH_UNITS / EPBENCH_LL_COMBINE_RELEASE / EPBENCH_LL_DISPATCH_PLACE).

GPU-checked on 4 x H200 (tests/gpu/ll_worker.py, tests/gpu/test_epbench_ll.py); history and
figures in notes/KERNELS.md, "Low-latency mode".
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Any, Dict, Optional

import torch

from epbench import cuda_lib, options
from epbench.backends.base import LowLatencyMode
from epbench.contract import DispatchInput, LowLatencyOutput, RankSetup
from epbench.backends.epbench_kernels import intranode_reason
from epbench.backends.kernel_common import release_collective, wait_then_check

MAX_STAGED_IDS = 48 * 1024 // 4  # max_tokens_per_rank x topk the dispatch kernel stages (ll_buffers.cu)
SYNCS = {"grid": 0, "token": 1}  # option ll_sync -> enum LlSync (csrc/ll_common.cuh)
ORDERS = {"source": 0, "rotated": 1}  # option combine_order -> enum LlCombineOrder (csrc/ll_common.cuh)
UNITS = {"row": 0, "chunk": 1}  # option dispatch_units -> enum LlDispatchUnits (csrc/ll_common.cuh)
PLACES = {"stage": 0, "slot": 1, "inline": 2, "line": 3, "line128": 4}  # option dispatch_place -> enum LlDispatchPlace (csrc/ll_common.cuh)
RELEASES = {"unit": 0, "batch": 1}  # option combine_release -> enum LlCombineRelease (csrc/ll_common.cuh)
TOKEN_SMEM_LIMIT = 200 * 1024  # ep_ll_set_sync's limit on the token dispatch's shared memory


def token_smem_bytes(tokens: int, topk: int, num_experts: int) -> int:
    """Shared memory of the token-sync dispatch at ``tokens`` tokens (ll_token_smem_bytes in
    csrc/ll_common.cuh): the staged ids (tokens x topk int32) and, per chunk of 32 tokens and global
    expert, the mask of the chunk's tokens routed to it, plus a totals row ((ceil(tokens / 32) + 1) x
    num_experts int32)."""
    return 4 * (tokens * topk + ((tokens + 31) // 32 + 1) * num_experts)


@dataclass
class _Handle:
    """What ll_combine needs from the matching ll_dispatch."""

    num_tokens: int
    topk_idx: torch.Tensor
    topk_weights: torch.Tensor
    out: torch.Tensor  # rows [0, T) of the combine output buffer


AUTO_CHUNK_MAX_TOKENS = 64
AUTO_UNITS_MAX_TOKENS = options.LL_AUTO_CHUNK_UNITS_MAX_TOKENS


def dispatch_units_for(units: str, max_tokens: int) -> str:
    """The dispatch units actually used (recorded in the rows): ``auto`` picks chunk up to
    AUTO_UNITS_MAX_TOKENS tokens per rank (the buffers' size, the same on every rank, so every rank
    picks alike), else row. Measured (4 x H200, 2026-11-27, notes/LATENCY-NEXT.md, graph p50):
    chunk 11.9 against row 13.0 us at 1 token on 4 ranks, 11.4 against 13.2 on 2 ranks, 12.3
    against 14.2 at 8 tokens on 2 ranks (13.8 against 13.4 on 4); at 32 / 128 / 256 tokens on 4
    ranks chunk was 2.6 / 1.3 / 2.7 us slower."""
    if units != "auto":
        return units
    return "chunk" if max_tokens <= AUTO_UNITS_MAX_TOKENS else "row"


AUTO_INLINE_MAX_TOKENS = 16


def dispatch_place_for(place: str, max_tokens: int) -> str:
    """The dispatch placement actually used (recorded in the rows): ``auto`` picks inline up to
    AUTO_INLINE_MAX_TOKENS tokens per rank (the buffers' size, the same on every rank, so every rank
    picks alike), else stage. Measured (graph p50, same calls, notes/LATENCY-NEXT.md): 4 x H200
    (2026-11-27, buffer of 256 tokens, row units) inline 11.7-11.8 against 12.1-12.2 us at 1 token,
    12.7 against 14.4-14.6 at 8, equal at 32, 43 against 22.5 at 128 and 64 against 34 at 256 (every
    4 bytes travel in 8); 2 x H200 (buffers of 8 and 128) 0.4-1.0 us faster at 1-8 tokens, 0.2-0.6
    slower at 32-128."""
    if place != "auto":
        return place
    return "inline" if max_tokens <= AUTO_INLINE_MAX_TOKENS else "stage"


def combine_chunk_for(chunk: int, max_tokens: int) -> int:
    """The combine chunk actually used (the one recorded in the rows): ``chunk`` 0 (auto) picks 2
    (1 KiB units; all 8 rows of a top-8 token loaded in one batch) up to AUTO_CHUNK_MAX_TOKENS tokens
    per rank, else 4 (2 KiB). Measured (1 x H100, world 1, in-graph per call, 2026-11-25,
    notes/LATENCY.md round 5): at 1 / 32 tokens 2 took 3.83 / 5.16 us against 4.98 / 5.68 for 4
    (32 SMs); at 128 tokens 4 was faster (11.0 / 7.65 us against 12.0 / 7.82 at 32 / 132 SMs)."""
    if chunk:
        return chunk
    return 2 if max_tokens <= AUTO_CHUNK_MAX_TOKENS else 4


class EpbenchLowLatencyBackend(LowLatencyMode):
    name = "epbench-ll"
    uses_sms = True
    host_free_calls = True  # the calls capture into graphs: nothing waits on the host
    modes = ("low_latency",)
    supports_cuda_graphs = True

    @classmethod
    def unavailable_reason(cls, setup: RankSetup) -> Optional[str]:
        if setup.max_tokens_per_rank * setup.topk > MAX_STAGED_IDS:
            return intranode_reason(setup) or \
                f"tokens_per_rank x topk > {MAX_STAGED_IDS} (low-latency batches only)"
        return intranode_reason(setup)

    @classmethod
    def chain_reason(cls, setup: RankSetup) -> Optional[str]:
        """A chain of dispatches is sound at world 1 only: with peers, a source rewrites a receiver's
        stage / tmap for call n + 1 only after its combine n (csrc/ll_dispatch.cu, buffer reuse), and a
        receiver that sees a later epoch treats it as "nothing for me in n", so back-to-back
        dispatches would race, and a rank that fell behind would skip work."""
        if setup.world > 1:
            return ("back-to-back calls without a combine between are only sound at world 1 "
                    "(the kernels reuse their peers' buffers after each combine)")
        return super().chain_reason(setup)

    def __init__(self, setup: RankSetup, *, warps: Optional[int] = None, combine_chunk: Optional[int] = None,
                 ll_sync: Optional[str] = None, combine_order: Optional[str] = None,
                 dispatch_units: Optional[str] = None, combine_release: Optional[str] = None,
                 dispatch_place: Optional[str] = None) -> None:
        reason = self.unavailable_reason(setup)
        if reason:
            raise RuntimeError(f"epbench-ll backend unavailable: {reason}")
        self.s = setup
        given = (("warps", warps), ("combine_chunk", combine_chunk), ("ll_sync", ll_sync),
                 ("combine_order", combine_order), ("dispatch_units", dispatch_units),
                 ("combine_release", combine_release), ("dispatch_place", dispatch_place))
        resolved = options.resolve(self.name, {k: v for k, v in given if v is not None})
        self.warps, self.combine_chunk, self.ll_sync = resolved["warps"], resolved["combine_chunk"], resolved["ll_sync"]
        self.combine_order, self.dispatch_units = resolved["combine_order"], resolved["dispatch_units"]
        self.combine_release, self.dispatch_place = resolved["combine_release"], resolved["dispatch_place"]
        self.combine_chunk = combine_chunk_for(self.combine_chunk, setup.max_tokens_per_rank)
        self.dispatch_units = dispatch_units_for(self.dispatch_units, setup.max_tokens_per_rank)
        need = token_smem_bytes(setup.max_tokens_per_rank, setup.topk, setup.world * setup.experts_per_rank)
        if self.ll_sync == "auto":  # the one recorded in the rows (effective_config)
            self.ll_sync = "token" if need <= TOKEN_SMEM_LIMIT else "grid"
        if self.ll_sync == "token" and self.dispatch_place in ("line", "line128") and self.dispatch_units == "chunk":
            raise RuntimeError(f"epbench-ll dispatch_place {self.dispatch_place} sends whole rows: it needs dispatch_units row "
                               f"(auto picks chunk up to {AUTO_UNITS_MAX_TOKENS} tokens per rank)")
        if self.ll_sync == "token":
            if need > TOKEN_SMEM_LIMIT:
                raise RuntimeError(f"epbench-ll ll_sync token: {need} bytes of shared memory for the ids and "
                                   f"per-32-token expert counts, more than {TOKEN_SMEM_LIMIT} (use ll_sync grid)")
        self._lib = cuda_lib.load()
        self.device = torch.device("cuda", setup.device.index if setup.device.index is not None
                                   else torch.cuda.current_device())
        self.fp8 = setup.dispatch_dtype == "fp8"
        cfg = cuda_lib.EpConfig(setup.rank, setup.world, self.device.index, setup.hidden,
                                setup.max_tokens_per_rank, setup.topk, setup.experts_per_rank,
                                int(self.fp8), float(setup.timeout_s))
        self._ctx = ctypes.c_void_p()
        cuda_lib.check(self._lib.ep_ll_create(ctypes.byref(cfg), ctypes.byref(self._ctx)), "ep_ll_create")
        self._ep = ctypes.c_void_p(self._lib.ep_ll_base(self._ctx))  # IPC, peers, timeout record
        cuda_lib.check(self._lib.ep_ll_set_sync(self._ctx, SYNCS[self.ll_sync]), "ep_ll_set_sync")
        self.use_combine_order(self.combine_order)
        self.use_dispatch_units(self.dispatch_units)
        self.use_dispatch_place(self.dispatch_place)
        self.use_combine_release(self.combine_release)
        self._open_peers()
        self._views()
        self._timed_out = ctypes.c_int.from_address(self._lib.ep_error_flag_ptr(self._ep))
        self._x_dtype = torch.float8_e4m3fn if self.fp8 else torch.bfloat16

    def _open_peers(self) -> None:
        cuda_lib.open_peers(self._lib, self._ep, self.s.world)

    def _region(self, which: int) -> torch.Tensor:
        return cuda_lib.region_tensor(self._lib.ep_ll_region, self._ctx, which, self.device)

    def _views(self) -> None:
        s = self.s
        e, c, h = s.experts_per_rank, s.world * s.max_tokens_per_rank, s.hidden
        x_dtype = torch.float8_e4m3fn if self.fp8 else torch.bfloat16
        self.x = self._region(cuda_lib.LL_X).view(x_dtype).view(e, c, h)
        self.x_scales = (self._region(cuda_lib.LL_SCALES).view(torch.float32).view(e, c, h // 128)
                         if self.fp8 else None)
        self.src_pair = self._region(cuda_lib.LL_PAIR).view(torch.int32).view(e, c)
        self.counts = self._region(cuda_lib.LL_COUNTS).view(torch.int64)
        self.src_counts = self._region(cuda_lib.LL_SRC_COUNTS).view(torch.int32).view(e, s.world)
        self.combine_in = self._region(cuda_lib.LL_COMBINE_IN).view(torch.bfloat16).view(e, c, h)
        self.out = self._region(cuda_lib.LL_OUT).view(torch.bfloat16).view(s.max_tokens_per_rank, h)
        self.epochs = self._region(cuda_lib.LL_EPOCHS).view(torch.int32)

    def _check_input(self, inp: DispatchInput) -> None:
        cuda_lib.check_dispatch_input(inp, self.s, self._x_dtype, self.fp8)

    def _stream(self) -> int:
        return torch.cuda.current_stream(self.device).cuda_stream

    # ---- low-latency mode ----
    def ll_dispatch(self, inp: DispatchInput, num_sms: int) -> LowLatencyOutput:
        self._check_input(inp)
        t = inp.num_tokens
        rc = self._lib.ep_ll_dispatch(self._ctx, inp.x.data_ptr(), inp.x_scales.data_ptr() if self.fp8 else None,
                                      inp.topk_idx.data_ptr(), inp.topk_weights.data_ptr(), t, num_sms, self.warps,
                                      self._stream())
        if rc:
            cuda_lib.check(rc, "ll_dispatch")
        if self._timed_out.value:
            self._raise_if_timed_out()
        handle = _Handle(t, inp.topk_idx, inp.topk_weights, self.out[:t])
        return LowLatencyOutput(self.x, self.x_scales, self.counts, self.src_counts, self.src_pair,
                                self.s.max_tokens_per_rank, handle)

    def effective_config(self) -> Dict[str, Any]:
        return {"warps": self.warps, "combine_chunk": self.combine_chunk, "ll_sync": self.ll_sync,
                "combine_order": self.combine_order,
                "dispatch_units": self.dispatch_units if self.ll_sync == "token" else "row",
                "dispatch_place": self.dispatch_place if self.ll_sync == "token" else "stage",
                "combine_release": self.combine_release if self.ll_sync == "token" else "grid"}

    def use_combine_order(self, order: str) -> None:
        """The order of later combine launches and captures (option combine_order); a graph captured
        before keeps its own. Both orders give bit-identical outputs (csrc/ll_combine.cu, push_unit)."""
        cuda_lib.check(self._lib.ep_ll_set_combine_order(self._ctx, ORDERS[order]), "ep_ll_set_combine_order")
        self.combine_order = order

    def use_dispatch_units(self, units: str) -> None:
        """What a peer unit of later token-sync dispatches sends (option dispatch_units: row | chunk |
        auto); a graph captured before keeps its own. Every rank must switch before the same call (a
        rank whose peers send the other kind stops with an error). The same bytes land either way."""
        units = dispatch_units_for(units, self.s.max_tokens_per_rank)
        cuda_lib.check(self._lib.ep_ll_set_dispatch_units(self._ctx, UNITS[units]), "ep_ll_set_dispatch_units")
        self.dispatch_units = units

    def use_dispatch_place(self, place: str) -> None:
        """Where later token-sync dispatches put a peer's row on the receiver (option dispatch_place: stage | slot |
        inline | line | line128 | auto; csrc/ll_common.cuh, LlDispatchPlace). Every rank must switch before the
        same call; line and line128 need row units at the launch."""
        place = dispatch_place_for(place, self.s.max_tokens_per_rank)
        cuda_lib.check(self._lib.ep_ll_set_dispatch_place(self._ctx, PLACES[place]), "ep_ll_set_dispatch_place")
        self.dispatch_place = place

    def use_combine_release(self, release: str) -> None:
        """How later token-sync combines release their pushes' flags (option combine_release: unit |
        batch); a graph captured before keeps its own. The same flags and outputs either way."""
        cuda_lib.check(self._lib.ep_ll_set_combine_release(self._ctx, RELEASES[release]), "ep_ll_set_combine_release")
        self.combine_release = release

    def ll_combine_input(self, out: LowLatencyOutput) -> torch.Tensor:
        return self.combine_in

    def ll_combine(self, out: LowLatencyOutput, num_sms: int) -> torch.Tensor:
        h: _Handle = out.handle
        rc = self._lib.ep_ll_combine(self._ctx, h.topk_idx.data_ptr(), h.num_tokens, num_sms, self.warps,
                                     self.combine_chunk, self._stream())
        if rc:
            cuda_lib.check(rc, "ll_combine")
        if self._timed_out.value:
            self._raise_if_timed_out()
        return h.out

    def set_probe(self, stamps: Optional[torch.Tensor]) -> None:
        """Measuring aid (epbench/llprobe.py): later launches and captures store per-block phase
        stamps into ``stamps`` (int64 [num_sms, 8] on this device; None: off)."""
        ptr = stamps.data_ptr() if stamps is not None else None
        cuda_lib.check(self._lib.ep_ll_set_probe(self._ctx, ptr), "ep_ll_set_probe")

    def set_probe_skip(self, bits: int) -> None:
        """Measuring aid (epbench/llprobe.py, SKIPS): later token dispatches leave out the parts in
        ``bits`` (LlProbeSkip, csrc/ll_common.cuh: 1 the own rows, 2 the receive copies, 4 the scales and
        tmap / tw stores beside a peer row, 8 the fence before a peer row's flag); their outputs are then
        wrong. 0: nothing left out."""
        cuda_lib.check(self._lib.ep_ll_set_probe_skip(self._ctx, int(bits)), "ep_ll_set_probe_skip")

    def probe_kernel(self, mode: int, num_sms: int) -> None:
        """One launch of the fixed-cost probe kernel (csrc/api.h, ep_ll_probe) on the current stream."""
        cuda_lib.check(self._lib.ep_ll_probe(self._ctx, mode, num_sms, self.warps, self._stream()), "ep_ll_probe")

    # ---- normal mode: not implemented by these kernels ----

    # ---- errors, poison, release ----
    def _raise_if_timed_out(self) -> None:
        cuda_lib.raise_if_timed_out(self._lib, self._ep, self.s.timeout_s)

    def check_errors(self) -> None:
        """Waits for this rank's queued kernels, then raises if any of them timed out on a peer."""
        wait_then_check(self.device, self._raise_if_timed_out)

    def poison(self) -> None:
        self.x.view(torch.uint8).fill_(0xFF)
        if self.x_scales is not None:
            self.x_scales.fill_(float("nan"))
        self.src_pair.fill_(-1)
        self.counts.fill_(-1)
        self.src_counts.fill_(-1)
        self.out.fill_(float("nan"))

    def close(self) -> None:
        """Collective: every rank must call it (peers may still write into this rank's region)."""
        if self._ctx:
            release_collective(self.device, self.s.world,
                               lambda: cuda_lib.check(self._lib.ep_ll_destroy(self._ctx), "ep_ll_destroy"))
            self._ctx = ctypes.c_void_p()
