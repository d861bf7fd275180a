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

from epbench.backends.base import Backend, DispatchInput, DispatchOutput, RankSetup
from epbench.backends.deepep import WeightedCombineRows

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
    num_recv: int
    weights: torch.Tensor  # [num_recv, experts_per_rank] float32, this rank's received weights


class HybridEPBackend(WeightedCombineRows, Backend):
    name = "hybrid-ep"
    routing_as_map = True
    dtypes = ("bf16", "fp8")

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
        self._allocate_combine_rows(setup)

    def effective_config(self) -> Dict[str, Any]:
        cfg = self.buffer.configurer.buffer_config
        return {"num_sms_dispatch": int(cfg.num_of_blocks_dispatch_api),
                "num_sms_combine": int(cfg.num_of_blocks_combine_api)}

    def dispatch(self, inp: DispatchInput, num_sms: int) -> DispatchOutput:
        x = inp.x.view(torch.uint8) if self.fp8 else inp.x
        recv_x, probs, recv_scales, handle = self.buffer.dispatch(
            hidden=x, scaling_factor=inp.x_scales if self.fp8 else None, topk_idx=inp.topk_idx,
            topk_weights=inp.topk_weights, num_of_experts=self.s.num_experts)
        if self.fp8:
            recv_x = recv_x.view(torch.float8_e4m3fn)
        else:
            recv_scales = None
        n = int(recv_x.shape[0])  # the library already waited for the count on the host
        routing = handle[4][:n]  # local_expert_routing_map
        weights = probs[:n, self._mine]
        counts = routing.sum(dim=0)
        return DispatchOutput(recv_x, recv_scales, routing, weights, counts, n,
                              _Handle(handle, n, weights))

    def combine(self, out: DispatchOutput, num_sms: int) -> torch.Tensor:
        h: _Handle = out.handle
        # Hybrid-EP sums the copies without weights: scale row r by w(t, d), the sum of its
        # received weights
        y = self.scaled_rows(h.num_recv, h.weights)
        combined, _ = self.buffer.combine(hidden=y, probs=None, handle=h.library_handle)
        return combined

    def close(self) -> None:
        # the library frees its buffers when the object goes away; every rank closes together
        self.buffer = None
