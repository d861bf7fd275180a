"""The data contract between the driver, the verification and every backend: what dispatch and
combine take and return (the types below), and what they must compute.

Semantics shared by all backends (the verification in epbench/verify.py checks them):

dispatch
    Each rank holds ``x`` (``[T, hidden]``; bf16, or fp8 e4m3 with ``x_scales``
    ``[T, hidden // 128]`` float32, or mxfp8: e4m3 with ``x_scales`` ``[T, hidden // 32]`` uint8
    E8M0 bytes, epbench/mxfp8.py; with ``quantize: fused`` ``x`` is bf16 and the receivers get the
    quantized rows), ``topk_idx`` (``[T, topk]`` int64 global expert ids;
    rank ``r`` owns experts ``[r * experts_per_rank, (r + 1) * experts_per_rank)``) and
    ``topk_weights`` (``[T, topk]`` float32). A token goes once to every rank that holds at
    least one of its experts. The receiver gets rows ``[0, num_recv)`` of a buffer ordered by
    (source rank, source token index), each with the token's full ``topk_idx`` and
    ``topk_weights`` as sent, plus ``expert_counts[e]`` = number of received rows whose
    ``topk_idx`` contains local expert ``e``.

combine
    The receiver fills ``combine_input(out)[:num_recv]`` (bf16, one row per received row,
    same order). Token ``t`` of source rank ``s`` comes back as
    ``sum over ranks d holding t:  w(t, d) * y_d[row of t on d]`` with
    ``w(t, d) = sum of t's topk_weights whose experts live on d``, accumulated in fp32,
    returned as bf16 ``[T, hidden]``.

Low-latency mode (scenario ``mode: low_latency``; a backend lists it in ``modes``)
    For decode-sized batches. ``T_max`` = ``RankSetup.max_tokens_per_rank`` is the padding per
    source rank, ``E`` = ``experts_per_rank``, ``C = world * T_max``.

ll_dispatch
    Input as for dispatch. Every (token, expert) pair is one row: token ``t`` of source ``s``
    lands once per expert of its top-k, straight into that expert's padded buffer, at a place
    fixed by the routing alone (the source can compute it, no layout pass):
    ``x[e, s * T_max + j]`` on the rank owning global expert ``s_e = rank * E + e``, where
    ``j`` = number of tokens ``t' < t`` of source ``s`` whose top-k contains that expert
    (``ll_slots``). The receiver gets ``LowLatencyOutput``: ``x`` ``[E, C, hidden]`` (+ fp8
    ``x_scales`` ``[E, C, hidden // 128]``), ``src_counts[e, s]`` = rows of source ``s`` for
    expert ``e`` (valid slots ``j < src_counts[e, s]``; the rest is padding, unspecified),
    ``counts[e]`` = sum over sources, and ``src_pair[e, s * T_max + j] = t * topk + k`` (the
    source token and the position ``k`` of the expert in its top-k; the source rank is the
    slot's block, ``slot // T_max``). Counts may stay on the device: nothing waits on the host.

ll_combine
    The caller fills ``ll_combine_input(out)`` (bf16 ``[E, C, hidden]``, the valid slots) with
    each expert's output ``y_e`` for each row it received. Token ``t`` of this rank comes back as
    ``sum over k < topk:  topk_weights[t, k] * y_{topk_idx[t, k]}(t)``: one term per EXPERT (not
    per rank as in normal mode), accumulated in fp32, returned as bf16 ``[T, hidden]``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Tuple, Union

import torch

BF16_ROUNDING = 2.0**-8  # relative error of one bf16 rounding (half an ulp of 8 significant bits)
COMBINE_ROUNDINGS = 2  # the backend's bf16 rows (weighted) and its bf16 result

MAX_KERNEL_TIMEOUT_S = 86400.0  # one day: far below what fits in 64-bit nanoseconds


@dataclass(frozen=True)
class RankSetup:
    """What a backend needs to size and place its buffers on one rank."""

    rank: int
    world: int
    gpus_per_node: int
    device: torch.device
    hidden: int
    max_tokens_per_rank: int  # the largest T any rank will pass to dispatch
    topk: int
    experts_per_rank: int
    dispatch_dtype: str  # "bf16" | "fp8" | "mxfp8"
    timeout_s: float = 10.0  # a kernel waiting on a peer gives up after this long
    mode: str = "normal"  # "normal" | "low_latency": which buffers the backend allocates
    quantize: str = "before"  # "fused": dispatch gets bf16 rows and delivers dispatch_dtype rows
    layout: str = "rank_major"  # "expert_major": x / x_scales grouped by local expert (layout.py)
    align: int = 1  # expert_major: rows per segment rounded up to a multiple of this

    def __post_init__(self) -> None:
        # The kernels turn this into integer nanoseconds: inf, nan or a huge value would not fit.
        if not 0 < self.timeout_s <= MAX_KERNEL_TIMEOUT_S:
            raise ValueError(f"timeout_s must be positive and at most {MAX_KERNEL_TIMEOUT_S:g} s, "
                             f"got {self.timeout_s!r}")

    @property
    def local_rank(self) -> int:
        return self.rank % self.gpus_per_node

    @property
    def node(self) -> int:
        return self.rank // self.gpus_per_node

    @property
    def num_experts(self) -> int:
        return self.world * self.experts_per_rank


@dataclass
class DispatchInput:
    x: torch.Tensor  # [T, hidden] bf16 or float8_e4m3fn
    x_scales: Optional[torch.Tensor]  # [T, hidden // 128] float32 (fp8 only)
    topk_idx: torch.Tensor  # [T, topk] int64, global expert ids
    topk_weights: torch.Tensor  # [T, topk] float32

    @property
    def num_tokens(self) -> int:
        return int(self.x.shape[0])


@dataclass
class DispatchOutput:
    """Rows [0, num_recv) are valid; tensors may be views of backend-owned buffers that the
    next dispatch overwrites. ``num_recv`` may be a device tensor so that nothing waits on the
    host inside the timed region; the driver reads it with ``int()`` afterwards."""

    x: torch.Tensor  # [capacity, hidden]
    x_scales: Optional[torch.Tensor]  # [capacity, hidden // 128] float32 (fp8 only)
    topk_idx: torch.Tensor  # [capacity, topk] int64
    topk_weights: torch.Tensor  # [capacity, topk] float32
    expert_counts: torch.Tensor  # [experts_per_rank] integer
    num_recv: Union[int, torch.Tensor]
    handle: Any = None  # backend-private layout kept for combine
    # layout expert_major: x / x_scales hold the segments of this epbench.layout.ExpertMajor
    # table (topk_idx / topk_weights stay one row per (source, token) received, as above)
    expert_major: Any = None
    # A backend whose library delivers rows in an order of its own says where each came from,
    # and verify.in_source_order puts them in the contract's order for comparison (every call
    # returns the same form: the timed calls are the verified ones). row_key [num_recv] int64:
    # ``source rank * K + source token`` for any K above every token index, -1 for a slot that
    # holds no row (padding, which is then left out). expert_major: slot_key [slots] int64, the
    # key of the row each slot holds (-1: padding); each segment is compared sorted by it.
    row_key: Optional[torch.Tensor] = None
    slot_key: Optional[torch.Tensor] = None


@dataclass
class LowLatencyOutput:
    """What ll_dispatch returns (layout in the module docstring). Tensors may be views of
    backend-owned buffers that the next ll_dispatch overwrites (epbench-ll with dispatch_place slot:
    that the peers may overwrite once this rank's ll_combine has run); counts stay on the device."""

    x: torch.Tensor  # [E, C, hidden] bf16 or float8_e4m3fn, C = world * T_max
    x_scales: Optional[torch.Tensor]  # [E, C, hidden // 128] float32 (fp8 only)
    counts: torch.Tensor  # [E] integer: valid rows per local expert
    src_counts: torch.Tensor  # [E, world] integer: valid rows per (local expert, source rank)
    src_pair: torch.Tensor  # [E, C] integer: t * topk + k of the row's source token
    max_tokens_per_rank: int  # T_max: slot s * T_max + j holds source s's j-th row
    handle: Any = None  # backend-private state kept for ll_combine


def ll_slots(topk_idx: torch.Tensor, num_experts: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """The low-latency placement, computed by the source alone: ``j[t, k]`` = number of tokens
    before t whose top-k contains ``topk_idx[t, k]`` (int64 ``[T, topk]``), and the pairs per
    global expert (int64 ``[num_experts]``). Expert ids must be valid and distinct within a row.
    No host synchronisation (no bincount, no boolean indexing)."""
    e = topk_idx.flatten()
    ones = torch.ones_like(e)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=e.device).scatter_add_(0, e, ones)
    if e.numel() == 0:
        return torch.zeros_like(topk_idx), counts
    order = torch.argsort(e, stable=True)  # by expert, then by (token, k): token order per expert
    starts = torch.cumsum(counts, 0) - counts
    j = torch.empty_like(e)
    j[order] = torch.arange(e.numel(), device=e.device) - starts[e[order]]
    return j.view_as(topk_idx), counts
