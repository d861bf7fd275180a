"""The ``hybrid-ep`` backend: NVIDIA's Hybrid-EP (DeepEP's hybrid-ep branch, pinned in
tools/baselines.py; ``deep_ep.HybridEPBuffer``, deep_ep/hybrid_ep_buffer.py there), driven the
way its own tests drive it (tests/test_hybrid_ep.py): one buffer per rank, index-based routing.
File:line references below are to the pinned commit (94a9f8f).

Call modes (rows' ``call_mode``):

call
    as a model step calls it with fresh routing.

    dispatch: ``HybridEPBuffer.dispatch(hidden, scaling_factor, topk_idx, topk_weights,
    num_of_experts)`` without a handle: the routing map and probabilities are built from the top-k
    (its ``indices_to_map``), the per-call config is made (``update_template_config``), the
    routing map is all-gathered over the group, the metadata kernel runs, the host waits for the
    received row count (the library synchronises the stream itself, hybrid_ep_buffer.py:233-235),
    then the rows and probabilities move and are copied out of its NVLink buffer into fresh tensors
    (executor.cu:354-383). FP8 rows go as bytes (``uint8``, as its tests pass them) with the
    caller-made scales (float32 per 128 columns); they come back as bytes and are read as e4m3.

    combine: ``HybridEPBuffer.combine(hidden, probs=None, handle)`` adds the rows coming back from
    each rank without weights (its tests scale each row by its number of local experts and divide
    the sum by top-k). epbench's combine returns ``sum_d w(t, d) * y_d``, so each received row is
    first scaled by the sum of its received weights, ``w(t, d)``; a user of the library does the
    same (or scales inside the expert), so it is inside the timed call, as for ``deepep``.
kernel
    Hybrid-EP's fastest path as its own benchmark times it (tests/test_hybrid_ep.py:311-384: one
    uncached call per input to make the handle, then the timed calls reuse it). Per input set,
    outside the timed region (``prepare_input``; the input sets keep the routing,
    ``reuses_layout``): the probabilities over all experts are built from the top-k, and one
    uncached call (routing map, all-gather, metadata kernel, host wait) makes the handle and tells
    the received row count. The timed dispatch is ``dispatch(hidden, scaling_factor, probs,
    handle=, num_dispatched_tokens=)``: no routing map, no metadata, and with the count given no
    stream synchronisation (hybrid_ep_buffer.py:233); what remains is the library call itself
    (its dispatch kernel between two device-side syncs, and the copy out of its NVLink buffer).
    Its own benchmark passes the handle but not the count, so its timed "API" figure still holds
    the routing map and a host wait. The rows and their probabilities move in the timed call (its
    forward dispatch, as in call mode and in its benchmark) and are verified from it; the per-row
    map of local experts and the counts are the layout call's (the cached call moves none of
    them; same routing). The weighting by ``w(t, d)`` is folded into the expert output
    (``prepare_combine``, untimed, as a model can do in its down-projection) and the timed combine
    is ``combine(hidden, probs=None, handle)`` alone (probs are for the backward pass).

Semantic difference kept as the library has it: it delivers, per received row, in (source rank,
source token) order: the token, the probabilities over the experts of its NVLink domain
(``[rows, experts_per_rank * ranks_per_domain]``, this rank's block at ``local_rank *
experts_per_rank``) and, in the handle, ``local_expert_routing_map`` (bool ``[rows,
experts_per_rank]``): the routing as a map over local experts, not top-k positions.
``routing_as_map`` tells the verification to compare that form (epbench/verify.py,
``local_routing_map``).

expert_major (``dispatch_with_permute`` / ``combine_with_unpermute``, ``pad_multiple = align``)
    The same exchange, then the library's permute: one row per (received row, local expert), each
    expert's rows in received (source rank, token) order, each expert's segment padded with zero
    rows up to a multiple of ``pad_multiple`` (an expert with no rows gets none), as its
    TorchRef (tests/utils.py, ``permute`` and the padding after it) checks bit for bit. In its
    default blocking mode the metadata pass waits for the stream and sums the padded counts on the
    host, so the permuted row count is exact. Translated for epbench: the segments' counts are its
    ``tokens_per_expert`` (handle), their offsets the running sum of the padded counts it returns,
    the slots in use the permuted row count; the per-row map comes from its ``dense_to_expert_map``
    (the slot of each (row, local expert), -1 where the row does not pick that expert; this path
    leaves ``local_expert_routing_map`` unfilled), and the per-row weights are read back from the
    permuted probabilities (one per slot) through it: a gather over ``[rows, experts_per_rank]``,
    inside the timed call in call mode. Combine: the library's unpermute adds each received row's
    expert rows without weights (fp32, one bf16 rounding), then combine adds the ranks' rows; so
    each slot is first scaled by its own probability (the permuted probabilities), giving
    ``sum_k w[t, k] * y_{e_k}(t)``. That is three bf16 roundings (the weighting, the unpermute's
    output, combine's result), one more than the usual two: ``combine_roundings`` says 3 for this
    layout and verification allows that (up to 2.2 x 2^-8 relative was seen on the CPU fake,
    tests/test_hybrid_ep_backend.py).

    Kernel mode: the same cached path as its benchmark's ``dispatch_with_permute(..., handle=,
    num_permuted_tokens=)`` (tests/test_hybrid_ep.py:322-328, 375): with a handle there is no
    metadata pass and so no host wait (the wait sits in its blocking metadata pass,
    executor.cu:166-176); the dispatch kernel and the permute kernel run. The per-row map, weights,
    counts and segment table are the layout call's; the timed call's permuted probabilities scale
    the slots in ``prepare_combine`` (untimed), and the timed combine is ``combine_with_unpermute``.

SM counts: why the option ``sms`` changed almost nothing (4 x H200, dsv3x4: 190 / 151 GB/s bus at
8 blocks, 181 / 146 at 24), and how the sweep is honoured now.

- The count did reach the kernels. ``num_sms_dispatch_api`` / ``num_sms_combine_api``
  (hybrid_ep_buffer.py:44-45) go into the ``Configurer`` (hybrid_ep_buffer.py:85-97), which keeps
  them in its ``buffer_config`` (config.cuh:366-367, 379-380; default 24 in one NVLink domain).
  Every uncached call copies them into a fresh per-call config (``get_default_config``,
  config.cuh:412-414, called from ``update_template_config``, hybrid_ep_buffer.py:135); the config
  is stored in the handle, and dispatch and combine run with the handle's config
  (hybrid_ep.cu:171, 221). The JIT instantiates each kernel with the count as its template
  ``NUM_OF_BLOCKS`` (jit/compiler.cu:233 dispatch, 255 combine; part of each kernel's cache key,
  376 and 431), and that is the grid: hybrid_ep_backend.cuh:5733/5736 (dispatch), 5854/5857
  (combine). Nothing caps or overrides it afterwards (``adjust_template``, config.cuh:465-560,
  changes stages only; ``update_buffer`` grows buffers, not block counts, intranode.cu:134-158).
- Its kernels barely need more blocks on this host. A dispatch block is one TMA load warp and
  three TMA store warps (hybrid_ep_backend.cuh:5685-5686); Hybrid-EP's own test on the same 4 x
  H200 host (2026-11-21, hidden 7168, 64 experts per rank, bf16) measured kernel-only 280 -> 305
  GB/s bus for dispatch and 288 -> 302 for combine from 8 to 16 SMs, and its whole API call 212
  -> 218 / 233 -> 243: +3-9 %, about the host's +-5 % noise at the call level.
- Most of the call-mode time does not depend on the count: the routing map built from the top-k,
  the all-gather of that map through torch.distributed (the Python buffer turns the library's own
  all-gather kernel off, hybrid_ep_buffer.py:52 and 109, so executor.cu:39-44 calls
  ``all_gather_into_tensor``), the metadata kernel with its own fixed grid
  (``num_sms_preprocessing_api``, default 108 blocks, config.cuh:365; jit/compiler.cu:211), the
  host wait, and the copies through its NVLink buffer (the received rows and probabilities copied
  out after dispatch, executor.cu:354-383; combine's input copied in first, executor.cu:415-427),
  each sized by the data. expert_major adds the permute and unpermute kernels, whose grids are
  ``sm_count * 16`` blocks unless set (config.cuh:449-452).
- And the ``--sms`` sweep itself was not applied: ``uses_sms`` was False, so each run had one
  point at the buffer's fixed count whatever ``--sms`` said.

Now ``uses_sms`` is True: before each point's uncached calls the point's count is written into
the ``Configurer``'s ``buffer_config`` (``num_of_blocks_dispatch_api`` and
``num_of_blocks_combine_api``, read-write fields the library's own Python writes the same way,
hybrid_ep_buffer.py:147), so the next per-call config, and the handle it makes, carry it; no
buffer memory depends on those two counts (intranode.cu:134-187), so one buffer serves every
count. The first call at a new count JIT-compiles its kernels (in the warmup or, in kernel mode,
in ``prepare_input``). Each row records what the last dispatch's handle config says the kernels
ran with (``effective_config``: the dispatch and combine blocks, the metadata kernel's blocks,
and for expert_major the permute / unpermute grids). A count above the GPU's SM count is refused,
as the library asserts at construction (config.cuh:371-372).

World size: nothing in the library needs a peer for a world of 1 (its rank detection,
``ExtendedMemoryAllocator.detect_accessible_ranks``, counts the calling rank; one node). Ranks
sharing one GPU are not refused either: without fabric memory it maps peers' buffers with CUDA IPC
handles (``cudaIpcOpenMemHandle``, accessible when the host name matches), exchanged by an
``all_gather`` of CUDA tensors over the group, which gloo also serves; DeepEP V1 maps its buffers
the same way and ran with 2 ranks sharing one H100.

The library allocates its outputs on every call (PyTorch's caching allocator), so ``poison`` can
only poison the buffers this class owns."""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Dict, Optional, Tuple

import torch
import torch.distributed as dist

from epbench.backends.base import KernelLayouts, NormalMode
from epbench.backends.weighting import EXTRA_ROUNDINGS
from epbench.contract import DispatchInput, DispatchOutput, RankSetup
from epbench.backends.deepep import WeightedCombineRows
from epbench.layout import ExpertMajor, slot_capacity

FP8_HIDDEN_MULTIPLE = 512  # Hybrid-EP's FP8 path
BF16_HIDDEN_MULTIPLE = 16
# where a handle keeps its per-call config (HybridEpConfigInstance): the last field of the tuple
CONFIG_FIELD = {False: 6, True: 9}  # by expert_major


def limits_reason(hidden: int, dtype: str, device_type: str) -> Optional[str]:
    if device_type != "cuda":
        return "needs CUDA GPUs"
    if dtype == "fp8" and hidden % FP8_HIDDEN_MULTIPLE:
        return f"fp8 needs hidden % {FP8_HIDDEN_MULTIPLE} == 0 (hidden {hidden})"
    if hidden % BF16_HIDDEN_MULTIPLE:
        return f"needs hidden % {BF16_HIDDEN_MULTIPLE} == 0 (hidden {hidden})"
    return None


def _import_buffer_class() -> Any:
    return importlib.import_module("deep_ep").HybridEPBuffer


@dataclass
class _Handle:
    """What combine needs from the matching dispatch."""

    library_handle: Any  # Hybrid-EP's handle tuple
    rows: int  # rows combine takes: received rows (rank_major) or permuted slots (expert_major)
    # float32 [rows, *]: each row going back is scaled by the sum of its row here; rank_major: the
    # received weights [rows, experts_per_rank]; expert_major: each slot's probability [rows, 1]
    weights: torch.Tensor


@dataclass
class _Layout:
    """What the uncached call on one input set made, for the cached (kernel-mode) calls (its
    received rows are not kept)."""

    routing: torch.Tensor  # bool [rows, experts_per_rank]: each received row's local experts
    weights: torch.Tensor  # float32 [rows, experts_per_rank]
    counts: torch.Tensor  # rows per local expert
    num_recv: int
    handle: _Handle  # the library's handle, and the rows combine takes
    table: Optional[ExpertMajor]  # expert_major: the segments
    probs: torch.Tensor  # float32 [tokens, experts]: the probabilities the timed calls hand in
    sms: int  # the block counts its handle's config holds


class HybridEPBackend(KernelLayouts, WeightedCombineRows, NormalMode):
    name = "hybrid-ep"
    uses_sms = True
    routing_as_map = True
    call_modes = ("call", "kernel")
    dtypes = ("bf16", "fp8")
    layouts = ("rank_major", "expert_major")

    @classmethod
    def unavailable_reason(cls, setup: RankSetup) -> Optional[str]:
        try:
            _import_buffer_class()
        except Exception as e:  # ImportError, or a broken build failing to load its extension
            detail = " ".join(str(e).split()) or type(e).__name__
            return (f"deep_ep.HybridEPBuffer not importable ({detail}); build: "
                    f"make baselines DEEPEP_FLAVOR=hybrid-ep")
        return limits_reason(setup.hidden, setup.dispatch_dtype,
                             setup.device.type if torch.cuda.is_available() else "cpu")

    def __init__(self, setup: RankSetup, *, buffer_class: Any = None, group: Any = None) -> None:
        self.s = setup
        self.fp8 = setup.dispatch_dtype == "fp8"
        self.expert_major = setup.layout == "expert_major"
        buffer_class = buffer_class if buffer_class is not None else _import_buffer_class()
        # built with the library's block counts; each point writes its own (_use_sms)
        self.buffer = buffer_class(group if group is not None else dist.group.WORLD,
                                   hidden_dim=setup.hidden,
                                   max_num_of_tokens_per_rank=setup.max_tokens_per_rank,
                                   num_local_experts=setup.experts_per_rank, use_fp8=self.fp8)
        # the library asserts its block counts fit the GPU (config.cuh:371-372)
        self.max_sms = (torch.cuda.get_device_properties(setup.device).multi_processor_count
                        if setup.device.type == "cuda" else None)
        self._sms: Optional[int] = None  # the counts last written into the buffer config
        self._ran: Any = None  # the per-call config of the last dispatch's handle: what ran
        # this rank's block of the per-domain probabilities the dispatch returns
        first = self.buffer.local_rank * setup.experts_per_rank
        self._mine = slice(first, first + setup.experts_per_rank)
        self._allocate_combine_rows(setup, slot_capacity(
            setup.world, setup.max_tokens_per_rank, setup.topk, setup.experts_per_rank, setup.align)
            if self.expert_major else None)
        self._layouts: Dict[int, _Layout] = {}  # id of a prepared input -> its layout (kernel mode)

    def combine_roundings(self) -> int:
        # expert_major: the library's unpermute returns bf16 rows between the weighting and combine
        # call mode: one more, the one-pass weighting (epbench/backends/weighting.py)
        return (3 if self.expert_major else super().combine_roundings()) + EXTRA_ROUNDINGS[self.kernel]

    def _use_sms(self, num_sms: int) -> None:
        """Makes the next uncached call's config (and the handle it returns) carry ``num_sms``
        dispatch and combine blocks: the library copies them from its buffer config into every
        per-call config (config.cuh:412-414)."""
        if num_sms == self._sms:
            return
        if num_sms <= 0 or (self.max_sms is not None and num_sms > self.max_sms):
            most = " (the GPU's SM count)" if self.max_sms is not None else ""
            raise ValueError(f"hybrid-ep: {num_sms} blocks per kernel; the count must be 1 to "
                             f"{self.max_sms if self.max_sms is not None else 'any'}{most}")
        cfg = self.buffer.configurer.buffer_config
        cfg.num_of_blocks_dispatch_api = num_sms
        cfg.num_of_blocks_combine_api = num_sms
        self._sms = num_sms

    def effective_config(self) -> Dict[str, Any]:
        """The block counts the last dispatch's handle config holds (its combine runs with the same
        config): what the kernels ran with, whatever was asked."""
        cfg = self._ran if self._ran is not None else self.buffer.configurer.buffer_config
        out = {"num_sms_dispatch": int(cfg.num_of_blocks_dispatch_api),
               "num_sms_combine": int(cfg.num_of_blocks_combine_api),
               "num_blocks_preprocessing": int(cfg.num_of_blocks_preprocessing_api)}
        if self.expert_major and self._ran is not None:
            out.update(num_blocks_permute=int(cfg.num_of_blocks_permute),
                       num_blocks_unpermute=int(cfg.num_of_blocks_unpermute))
        return out

    def _payload(self, inp: DispatchInput) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """FP8 rows travel as bytes, with the caller's scales."""
        return (inp.x.view(torch.uint8), inp.x_scales) if self.fp8 else (inp.x, None)

    def prepare_input(self, inp: DispatchInput, num_sms: int) -> DispatchInput:
        """Kernel mode: one uncached call on this input set, outside the timed region; the timed
        calls reuse its handle (and so its block counts) and hand in these probabilities."""
        if self.kernel:
            out = self._uncached(inp, num_sms)
            probs = torch.zeros(inp.num_tokens, self.s.num_experts, dtype=torch.float32, device=inp.x.device)
            probs.scatter_(1, inp.topk_idx.long(), inp.topk_weights.float())
            self._layouts[id(inp)] = _Layout(out.topk_idx, out.topk_weights, out.expert_counts, int(out.num_recv),
                                             out.handle, out.expert_major, probs, num_sms)
        return inp

    def dispatch(self, inp: DispatchInput, num_sms: int) -> DispatchOutput:
        if not self.kernel:
            return self._uncached(inp, num_sms)
        lay = self._layouts.get(id(inp))
        if lay is None:
            raise RuntimeError("hybrid-ep kernel mode: dispatch of an input prepare_input never saw")
        if lay.sms != num_sms:
            raise ValueError(f"hybrid-ep kernel mode: the handle holds {lay.sms} blocks, the point asks {num_sms}")
        return self._cached(inp, lay)

    def _uncached(self, inp: DispatchInput, num_sms: int) -> DispatchOutput:
        self._use_sms(num_sms)
        x, scales = self._payload(inp)
        if self.expert_major:
            return self._dispatch_permuted(x, scales, inp)
        recv_x, probs, recv_scales, handle = self.buffer.dispatch(
            hidden=x, scaling_factor=scales, topk_idx=inp.topk_idx,
            topk_weights=inp.topk_weights, num_of_experts=self.s.num_experts)
        self._ran = handle[CONFIG_FIELD[False]]
        n = int(recv_x.shape[0])  # the library already waited for the count on the host
        routing = handle[4][:n]  # local_expert_routing_map
        weights = probs[:n, self._mine]
        counts = routing.sum(dim=0)
        return DispatchOutput(self._received(recv_x), recv_scales if self.fp8 else None, routing,
                              weights, counts, n, _Handle(handle, n, weights))

    def _dispatch_permuted(self, x: torch.Tensor, scales: Optional[torch.Tensor],
                           inp: DispatchInput) -> DispatchOutput:
        s = self.s
        recv_x, slot_probs, recv_scales, padded, handle = self.buffer.dispatch_with_permute(
            hidden=x, scaling_factor=scales, topk_idx=inp.topk_idx, topk_weights=inp.topk_weights,
            num_of_experts=s.num_experts, num_of_experts_per_rank=s.experts_per_rank,
            pad_multiple=s.align)
        self._ran = handle[CONFIG_FIELD[True]]
        n = int(handle[3])  # num_dispatched_tokens_tensor, pinned: the metadata pass waited for it
        slot_of = handle[6][:n]  # dense_to_expert_map: slot of (row, local expert), -1: not picked
        # the per-row routing from the same map: this path leaves local_expert_routing_map (handle[4])
        # unfilled (1 x H100, 2026-11-25: reading it, every row's experts differed)
        routing = slot_of >= 0
        weights = torch.where(slot_of >= 0, slot_probs[slot_of.clamp(min=0).long()], 0.0)
        counts = handle[7]  # tokens_per_expert: rows per local expert, before padding
        slots = int(recv_x.shape[0])  # the permuted row count, padding included
        padded = padded.to(s.device, non_blocking=True)  # padded rows per expert, pinned
        table = ExpertMajor(counts, torch.cumsum(padded, 0) - padded, slots, s.align)
        return DispatchOutput(self._received(recv_x), recv_scales if self.fp8 else None, routing,
                              weights, counts, n, _Handle(handle, slots, slot_probs.unsqueeze(1)), table)

    def _cached(self, inp: DispatchInput, lay: _Layout) -> DispatchOutput:
        """The timed kernel-mode call: rows (and probabilities, scales) moved through the layout's
        handle; no routing map, no metadata pass, no host wait."""
        x, scales = self._payload(inp)
        handle, rows = lay.handle.library_handle, lay.handle.rows
        self._ran = handle[CONFIG_FIELD[self.expert_major]]
        if self.expert_major:
            recv_x, slot_probs, recv_scales, _, _ = self.buffer.dispatch_with_permute(
                hidden=x, scaling_factor=scales, probs=lay.probs, handle=handle,
                num_permuted_tokens=rows, pad_multiple=self.s.align)
            return DispatchOutput(self._received(recv_x), recv_scales if self.fp8 else None, lay.routing,
                                  lay.weights, lay.counts, lay.num_recv,
                                  _Handle(handle, rows, slot_probs.unsqueeze(1)), lay.table)
        recv_x, probs, recv_scales, _ = self.buffer.dispatch(
            hidden=x, scaling_factor=scales, probs=lay.probs, num_of_experts=self.s.num_experts,
            handle=handle, num_dispatched_tokens=rows)
        weights = probs[:rows, self._mine]  # moved by this call (same routing: the layout call's values)
        return DispatchOutput(self._received(recv_x), recv_scales if self.fp8 else None, lay.routing,
                              weights, lay.counts, lay.num_recv, _Handle(handle, rows, weights))

    def _received(self, recv_x: torch.Tensor) -> torch.Tensor:
        """FP8 rows travel as bytes; read them as e4m3 again."""
        return recv_x.view(torch.float8_e4m3fn) if self.fp8 else recv_x

    def combine_input(self, out: DispatchOutput) -> torch.Tensor:
        return self.combine_in[: out.handle.rows]

    def prepare_combine(self, out: DispatchOutput) -> None:
        """Kernel mode: the weights folded into the expert output, outside the timed region."""
        if self.kernel:
            h: _Handle = out.handle
            self.scaled_rows(h.rows, h.weights, exact=True)

    def combine(self, out: DispatchOutput, num_sms: int) -> torch.Tensor:
        h: _Handle = out.handle
        # Hybrid-EP sums the copies without weights: scale each row by its weight (rank_major:
        # w(t, d), the sum of its received weights; expert_major: its slot's probability); kernel
        # mode: done by prepare_combine, untimed. The block count is the handle config's.
        y = self.combine_scaled[: h.rows] if self.kernel else self.scaled_rows(h.rows, h.weights, exact=False)
        if self.expert_major:
            combined, _ = self.buffer.combine_with_unpermute(hidden=y, probs=None, handle=h.library_handle,
                                                             pad_multiple=self.s.align)
        else:
            combined, _ = self.buffer.combine(hidden=y, probs=None, handle=h.library_handle)
        return combined

    def close(self) -> None:
        # the library frees its buffers when the object goes away; every rank closes together
        self.buffer = None
        self._layouts.clear()
        self._ran = None
