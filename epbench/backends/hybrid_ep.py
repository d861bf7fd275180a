"""The ``hybrid-ep`` backend: NVIDIA's Hybrid-EP (DeepEP's hybrid-ep branch, pinned in
epbench/baselines.py; ``deep_ep.HybridEPBuffer``, deep_ep/hybrid_ep_buffer.py there), driven the
way its own tests drive it (tests/test_hybrid_ep.py): one buffer per rank, index-based routing.

What one timed call contains:

dispatch
    ``HybridEPBuffer.dispatch(hidden, scaling_factor, topk_idx, topk_weights, num_of_experts)``
    without a cached handle, as a model step calls it with fresh routing: the routing map and
    probabilities are built from the top-k (its ``indices_to_map``), the metadata pass runs, the
    host waits for the received row count (the library synchronises the stream itself), then the
    rows move. FP8 rows go as bytes (``uint8``, as its tests pass them) with the caller-made
    scales (float32 per 128 columns); they come back as bytes and are read as e4m3 again.

    It delivers, per received row, in (source rank, source token) order: the token, the
    probabilities over the experts of its NVLink domain (``[rows, experts_per_rank *
    ranks_per_domain]``, this rank's block at ``local_rank * experts_per_rank``) and, in the
    handle, ``local_expert_routing_map`` (bool ``[rows, experts_per_rank]``): the routing as a map
    over local experts, not top-k positions. ``routing_as_map`` tells the verification to compare
    that form (epbench/verify.py, ``local_routing_map``).

combine
    ``HybridEPBuffer.combine(hidden, probs=None, handle)`` adds the rows coming back from each rank
    without weights (its tests scale each row by its number of local experts and divide the sum
    by top-k). epbench's combine returns ``sum_d w(t, d) * y_d``, so each received row is first
    scaled by the sum of its received weights, ``w(t, d)``; a user of the library does the same
    (or scales inside the expert), so it is inside the timed call, as for ``deepep``.

expert_major (``dispatch_with_permute`` / ``combine_with_unpermute``, ``pad_multiple = align``)
    The same exchange, then the library's permute: one row per (received row, local expert), each
    expert's rows in received (source rank, token) order, each expert's segment padded with zero
    rows up to a multiple of ``pad_multiple`` (an expert with no rows gets none), as its
    TorchRef (tests/utils.py, ``permute`` and the padding after it) checks bit for bit. In its
    default blocking mode the metadata pass waits for the stream and sums the padded counts on the
    host, so the permuted row count is exact. Translated for epbench: the segments' counts are its
    ``tokens_per_expert`` (handle), their offsets the running sum of the padded counts it returns,
    the slots in use the permuted row count; the per-row map is ``local_expert_routing_map`` as
    above, and the per-row weights are read back from the permuted probabilities (one per slot)
    through its ``dense_to_expert_map`` (the slot of each (row, local expert), -1 where the row
    does not pick that expert): a gather over ``[rows, experts_per_rank]``, inside the timed call.
    Combine: the library's unpermute adds each received row's expert rows without weights (fp32,
    one bf16 rounding), then combine adds the ranks' rows; so each slot is first scaled by its own
    probability (the permuted probabilities), giving ``sum_k w[t, k] * y_{e_k}(t)``. That is three
    bf16 roundings (the weighting, the unpermute's output, combine's result), one more than the
    usual two: ``combine_roundings`` says 3 for this layout and verification allows that (up to
    2.2 x 2^-8 relative was seen on the CPU fake, tests/test_hybrid_ep_backend.py).

SM counts: Hybrid-EP fixes its dispatch and combine block counts when the buffer is built
(``num_sms_dispatch_api`` / ``num_sms_combine_api``, default 24 each within one NVLink domain);
the backend builds one buffer with the library's defaults, or with the backend option ``sms``
(EPBENCH_HYBRID_EP_SMS) for both, so the SM sweep does not apply (``uses_sms`` False) and the
counts used are recorded with each row.

World size: nothing in the library needs a peer for a world of 1 (its rank detection,
``ExtendedMemoryAllocator.detect_accessible_ranks``, counts the calling rank; one node). Ranks
sharing one GPU are not refused either: without fabric memory it maps peers' buffers with CUDA IPC
handles (``cudaIpcOpenMemHandle``, accessible when the host name matches), exchanged by an
``all_gather`` of CUDA tensors over the group, which gloo also serves; DeepEP V1 maps its buffers
the same way and ran with 2 ranks sharing one H100. Not yet run on a GPU.

The library allocates its outputs on every call (PyTorch's caching allocator), so ``poison`` can
only poison the buffers this class owns."""

from __future__ import annotations

import importlib
import os
from dataclasses import dataclass
from typing import Any, Dict, Optional

import torch
import torch.distributed as dist

from epbench.backends.base import NormalMode
from epbench.contract import DispatchInput, DispatchOutput, RankSetup
from epbench.backends.deepep import WeightedCombineRows
from epbench.layout import ExpertMajor, slot_capacity

FP8_HIDDEN_MULTIPLE = 512  # Hybrid-EP's FP8 path
BF16_HIDDEN_MULTIPLE = 16
SMS_ENV = "EPBENCH_HYBRID_EP_SMS"  # the backend option sms (epbench/options.py)


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


class HybridEPBackend(WeightedCombineRows, NormalMode):
    name = "hybrid-ep"
    routing_as_map = True
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

    def __init__(self, setup: RankSetup, *, sms: Optional[int] = None, buffer_class: Any = None,
                 group: Any = None) -> None:
        self.s = setup
        self.fp8 = setup.dispatch_dtype == "fp8"
        self.expert_major = setup.layout == "expert_major"
        buffer_class = buffer_class if buffer_class is not None else _import_buffer_class()
        if sms is None and os.environ.get(SMS_ENV):
            sms = int(os.environ[SMS_ENV])
        self.buffer = buffer_class(group if group is not None else dist.group.WORLD,
                                   hidden_dim=setup.hidden,
                                   max_num_of_tokens_per_rank=setup.max_tokens_per_rank,
                                   num_local_experts=setup.experts_per_rank, use_fp8=self.fp8,
                                   num_sms_dispatch_api=sms, num_sms_combine_api=sms)
        # this rank's block of the per-domain probabilities the dispatch returns
        first = self.buffer.local_rank * setup.experts_per_rank
        self._mine = slice(first, first + setup.experts_per_rank)
        self._allocate_combine_rows(setup, slot_capacity(
            setup.world, setup.max_tokens_per_rank, setup.topk, setup.experts_per_rank, setup.align)
            if self.expert_major else None)

    def combine_roundings(self) -> int:
        # expert_major: the library's unpermute returns bf16 rows between the weighting and combine
        return 3 if self.expert_major else super().combine_roundings()

    def effective_config(self) -> Dict[str, Any]:
        cfg = self.buffer.configurer.buffer_config
        return {"num_sms_dispatch": int(cfg.num_of_blocks_dispatch_api),
                "num_sms_combine": int(cfg.num_of_blocks_combine_api)}

    def dispatch(self, inp: DispatchInput, num_sms: int) -> DispatchOutput:
        x = inp.x.view(torch.uint8) if self.fp8 else inp.x
        scales = inp.x_scales if self.fp8 else None
        if self.expert_major:
            return self._dispatch_permuted(x, scales, inp)
        recv_x, probs, recv_scales, handle = self.buffer.dispatch(
            hidden=x, scaling_factor=scales, topk_idx=inp.topk_idx,
            topk_weights=inp.topk_weights, num_of_experts=self.s.num_experts)
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

    def _received(self, recv_x: torch.Tensor) -> torch.Tensor:
        """FP8 rows travel as bytes; read them as e4m3 again."""
        return recv_x.view(torch.float8_e4m3fn) if self.fp8 else recv_x

    def combine_input(self, out: DispatchOutput) -> torch.Tensor:
        return self.combine_in[: out.handle.rows]

    def combine(self, out: DispatchOutput, num_sms: int) -> torch.Tensor:
        h: _Handle = out.handle
        # Hybrid-EP sums the copies without weights: scale each row by its weight (rank_major:
        # w(t, d), the sum of its received weights; expert_major: its slot's probability)
        y = self.scaled_rows(h.rows, h.weights)
        if self.expert_major:
            combined, _ = self.buffer.combine_with_unpermute(hidden=y, probs=None, handle=h.library_handle,
                                                             pad_multiple=self.s.align)
        else:
            combined, _ = self.buffer.combine(hidden=y, probs=None, handle=h.library_handle)
        return combined

    def close(self) -> None:
        # the library frees its buffers when the object goes away; every rank closes together
        self.buffer = None
