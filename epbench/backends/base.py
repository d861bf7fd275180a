"""The interface every dispatch/combine implementation fills in.

The driver (epbench/driver.py) owns timing, verification and recording; a backend only
moves tokens. One backend object lives per rank for one (scenario, world): its constructor
allocates every buffer it will ever need, so nothing is allocated inside the timed region.

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

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar, Dict, Optional, Tuple, Union

import torch


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
    backend-owned buffers that the next ll_dispatch overwrites; counts stay on the device."""

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


class Backend(ABC):
    name: ClassVar[str]
    uses_sms: ClassVar[bool] = False  # True when num_sms changes what runs
    hierarchical: ClassVar[bool] = False  # True: one NIC copy per destination node
    # True: the received ``topk_idx`` holds local expert indices (global id minus
    # rank * experts_per_rank) for this rank's experts and -1 for the others, whose weights are
    # 0 (DeepEP's layout). Verification then compares against that masked form; False: the
    # full global ids and weights, as sent (the contract above).
    receives_local_expert_ids: ClassVar[bool] = False
    # True: the received routing is a per-expert map, not top-k positions: ``topk_idx`` is bool
    # ``[capacity, experts_per_rank]`` (True where the row's top-k holds that local expert) and
    # ``topk_weights`` float32 ``[capacity, experts_per_rank]`` (that expert's weight, 0 elsewhere),
    # Hybrid-EP's layout. Verification then compares, per row, the set of local experts and their
    # weights (order-free), still bit-exact.
    routing_as_map: ClassVar[bool] = False
    # True: the backend keeps a layout made from the routing across calls (a cached handle), so
    # the driver's rotating input sets keep the routing and change only the token values.
    reuses_layout: ClassVar[bool] = False
    # the ways this backend can be called (bench.call_modes): "call" as a model's forward pass
    # calls it; "kernel" its library's fastest path as the library's own benchmark times it
    # (e.g. a cached layout); the driver picks one with use_call_mode before a point
    call_modes: ClassVar[Tuple[str, ...]] = ("call",)
    modes: ClassVar[Tuple[str, ...]] = ("normal",)  # scenario modes this backend implements
    # True: the low-latency calls allocate nothing, never wait on the host and keep their
    # per-call state (epochs) on the device, so a captured CUDA graph of them can be replayed.
    supports_cuda_graphs: ClassVar[bool] = False
    # payload features this backend implements (scenario model.dispatch_dtype / quantize / layout)
    dtypes: ClassVar[Tuple[str, ...]] = ("bf16", "fp8")
    quantize_modes: ClassVar[Tuple[str, ...]] = ("before",)
    layouts: ClassVar[Tuple[str, ...]] = ("rank_major",)

    @classmethod
    def unavailable_reason(cls, setup: RankSetup) -> Optional[str]:
        """None when this backend can run here, else one line saying why not."""
        return None

    @classmethod
    def chain_reason(cls, setup: RankSetup) -> Optional[str]:
        """None when K back-to-back calls of one op (K dispatches, then K combines, with no other
        call between) may be captured into one CUDA graph and replayed here, each call doing its
        full work; else one line saying why not (the driver then times no ``chain`` rows)."""
        return None if cls.supports_cuda_graphs else "its calls cannot be captured in a CUDA graph"

    def combine_roundings(self) -> int:
        """How many times this backend's combine path rounds to bf16 between the expert outputs and
        the result: verification allows that many roundings (epbench.verify.BF16_ROUNDING each).
        Two by default: the weighted rows the caller or backend makes, and the result."""
        from epbench.verify import COMBINE_ROUNDINGS

        return COMBINE_ROUNDINGS

    @abstractmethod
    def __init__(self, setup: RankSetup) -> None: ...

    @abstractmethod
    def dispatch(self, inp: DispatchInput, num_sms: int) -> DispatchOutput: ...

    def effective_config(self) -> Dict[str, Any]:
        """The options this backend ran with, after any clamp or fallback of its kernels (epbench/options.py
        names them); read after the last call of a point and written into its rows. Empty: no options."""
        return {}

    def use_call_mode(self, mode: str) -> None:
        """Switches how the next points are called (one of ``call_modes``); before a point's inputs
        are prepared, never inside one."""
        if mode not in self.call_modes:
            raise ValueError(f"{self.name}: no call mode {mode!r} (it has {', '.join(self.call_modes)})")

    def prepare_combine(self, out: DispatchOutput) -> None:
        """Runs after the caller filled ``combine_input(out)``, outside the timed region: work a model
        does elsewhere (e.g. the routing weights folded into the expert's output) in a call mode
        that leaves it out of combine. Nothing by default."""

    def prepare_input(self, inp: DispatchInput, num_sms: int) -> DispatchInput:
        """The input to time ``dispatch`` with at ``num_sms``, prepared outside the timed region (once
        per input set of a point; a kernel mode may make its cached layout here).
        A backend whose kernel reads the tokens from its own registered buffer copies them there
        (as the caller fills ``combine_input`` for combine); the default is ``inp`` itself."""
        return inp

    @abstractmethod
    def combine_input(self, out: DispatchOutput) -> torch.Tensor:
        """A writable bf16 [capacity, hidden] tensor the caller fills before combine."""

    @abstractmethod
    def combine(self, out: DispatchOutput, num_sms: int) -> torch.Tensor:
        """Returns bf16 [T, hidden] for the T tokens of the matching dispatch."""

    def ll_dispatch(self, inp: DispatchInput, num_sms: int) -> LowLatencyOutput:
        """Low-latency dispatch (contract above); only where ``"low_latency" in modes``."""
        raise NotImplementedError(f"{self.name}: no low_latency mode")

    def ll_combine_input(self, out: LowLatencyOutput) -> torch.Tensor:
        """A writable bf16 [E, C, hidden] tensor the caller fills before ll_combine."""
        raise NotImplementedError(f"{self.name}: no low_latency mode")

    def ll_combine(self, out: LowLatencyOutput, num_sms: int) -> torch.Tensor:
        """Returns bf16 [T, hidden] for the T tokens of the matching ll_dispatch."""
        raise NotImplementedError(f"{self.name}: no low_latency mode")

    def poison(self) -> None:
        """Fill every output buffer the backend owns with garbage (NaN / 0xFF). Nothing else: the
        call after it must be the same call the timed loop makes (no switch to another path)."""

    def close(self) -> None:
        """Release buffers and peer mappings."""
