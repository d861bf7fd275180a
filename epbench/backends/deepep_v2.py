"""The ``deepep-v2`` backend: DeepEP V2's ``ElasticBuffer`` (DeepEP main, pinned in
tools/baselines.py), called as its tests/elastic/test_ep.py calls it. Optional: skipped with a
note when ``deep_ep.ElasticBuffer`` cannot be imported (``make baselines DEEPEP_FLAVOR=v2``).

dispatch
    ``ElasticBuffer.dispatch(x | (x, sf), topk_idx=, topk_weights=, num_experts=,
    num_max_tokens_per_rank=, expert_alignment=1, num_sms=, do_cpu_sync=True)``: the whole call, its
    host wait for the received count included. ``topk_idx`` must be ``deep_ep.topk_idx_t`` (int64
    unless V2 was built with EP_NUM_TOPK_IDX_BITS=32). ``sf`` is opaque to V2, one 4-byte pack per
    element: float32 per 128 values (epbench's fp8 scales as they are), or four UE8M0 bytes per
    int32 (epbench's mxfp8 scales, one byte per 32 values, viewed as int32: hidden % 128). Received
    ``topk_idx`` holds local expert ids and -1 for other ranks' experts
    (``receives_local_expert_ids``; V2 leaves the weights at those -1 positions as sent, and the adapter
    zeroes them as a caller must); the per-expert counts are padded to ``expert_alignment`` (1
    here, so exact).

World and GPUs: V2 talks through an NCCL communicator (torch's, or its own built over the group),
and NCCL refuses two ranks on one GPU, so ranks sharing a GPU cannot run it. At world 1 V2 skips
NCCL Gin (``num_ranks > 1`` only) and its kernels copy within the GPU; above 1 rank it asserts that
Gin (GPU-initiated RDMA) is available unless ``EP_DISABLE_GIN=1`` (its README's switch, read when
the buffer is built, csrc/kernels/backend/nccl.cu). The option ``gin`` (auto: off where the whole
world is one node, every peer on NVLink; on across nodes) sets it for the buffer's construction and
every row records what ran (``gin`` in the options column).

Row order: V2 does not promise epbench's (source rank, source token) order; its handle says where
each row came from (``recv_src_metadata[:, 0]`` = ``source rank * num_max_tokens_per_rank + token``),
and every call (timed and verified alike) returns V2's own order with that column as the rows'
``row_key``; the verification sorts by it (verify.in_source_order). In expert_major V2 fills each
segment in arrival order (an atomic counter per expert) and names, per received row, the slot of
each of its top-k positions (``recv_src_metadata[:, 2:]``, -1 where the expert lives elsewhere):
every call spells out each row's routing from those slots (the local expert is the segment the
slot lies in, the weight that slot's) and gives each slot its row's key (``slot_key``, -1 on
padding), a few small device ops a user feeding a grouped GEMM needs as well.

combine
    ``ElasticBuffer.combine(y, handle, num_sms=)`` sums the copies of a token without weights
    (``topk_weights``, when given, are only carried back), so each
    received row is first scaled by ``w(t, d)``, the sum of its received weights on this rank, as
    a V2 user would (inside the timed call), exactly as for V1 (epbench/backends/deepep.py).
    expert_major: V2 takes the expanded slots back (``x`` of ``num_expanded_tokens`` rows, as its
    tests/elastic/test_ep.py does) and sums each token's slots; each slot is first scaled by its own
    weight, so a token comes back as ``sum_k w[t, k] * y_{e_k}(t)``, one term per expert.

Call modes (rows' ``call_mode``):

call
    the above: the whole call as a model's forward pass makes it.
kernel
    V2's cached path, as its tests/elastic/test_ep.py times it ("cached dispatch") and its README's
    decoding example calls it: one full dispatch per input set outside the timed region
    (``prepare_input``; the input sets keep the routing, ``reuses_layout``), and the timed dispatch
    is ``ElasticBuffer.dispatch(x | (x, sf), handle=, num_sms=)``: no ``topk_idx`` / weights, no count
    exchange, no host wait (V2 forbids ``do_cpu_sync`` with a handle). Rows land in the slots the
    handle recorded, so the layout call's row keys, weights (zeroed at other ranks' experts) and
    counts hold for them; the received local ids are the cached call's own. expert_major: the cached
    expanding dispatch (``handle=`` of a full ``do_expand`` dispatch, ``do_expand=True``), which V2's
    test checks bit for bit against the uncached one but does not time (it times the uncached
    expanding dispatch, with its host wait by default); the segment table and per-slot routing are
    the layout call's. In both layouts the weighting by ``w(t, d)`` is folded into the expert output
    outside the timed region (``prepare_combine``) and the timed combine is ``ElasticBuffer.combine``
    alone.

As V2's test runs it: the buffer's defaults for ``allow_hybrid_mode``, ``allow_multiple_reduction``
and ``deterministic``; ``prefer_overlap_with_compute`` off (the option ``prefer_overlap``; it changes
only the SM count V2 picks itself, which epbench never asks for, and the channels per SM across
nodes); the QP count left to V2 (RDMA only). Otherwise: the SM count is the point's (its test
leaves it to ``get_theoretical_num_sms``: at least 64 SMs with ``prefer_overlap_with_compute`` off);
scales stay row-major (its expanding dispatch asks for TMA-aligned column-major ones); combine
carries no weights back and adds no bias (its test passes ``topk_weights`` and 0, 1 or 2 biases);
and the timing: its test reports per-kernel durations from the profiler, the dispatch kernel and
its copy epilogue apart (likewise combine and its reduce epilogue), each call after an L2 flush, a
10 ms sleep and a barrier, while epbench times the whole call, every kernel and host step of it,
with events.
"""

from __future__ import annotations

import contextlib
import importlib
import os
from dataclasses import dataclass, replace
from typing import Any, Dict, Optional, Tuple

import torch
import torch.distributed as dist

from epbench.backends.base import KernelLayouts, NormalMode
from epbench.backends.deepep_v2_env import MIN_NCCL, version_tuple
from epbench.backends.weighting import EXTRA_ROUNDINGS, weigh_rows
from epbench.contract import DispatchInput, DispatchOutput, RankSetup
from epbench.layout import ExpertMajor, expert_of_slot, slot_capacity
from epbench.scenario import FP8_BLOCK

MIN_TORCH = (2, 10)


def _import_deep_ep() -> Any:
    return importlib.import_module("deep_ep")


def limits_reason(world: int, hidden: int, dtype: str, torch_version: str,
                  nccl_version: Optional[Tuple[int, ...]], ranks_per_gpu: int = 1) -> Optional[str]:
    """What V2 cannot run, known before launch (None: nothing known)."""
    need = ".".join(map(str, MIN_NCCL))
    if version_tuple(torch_version) < MIN_TORCH:
        return f"needs torch >= 2.10 (have {torch_version})"
    if ranks_per_gpu > 1:
        return (f"needs {world} GPUs, one per rank: NCCL, which V2 communicates through, refuses "
                f"{ranks_per_gpu} ranks on one GPU")
    if nccl_version is None:
        return f"needs NCCL >= {need} at run time (torch reports no NCCL)"
    if tuple(nccl_version) < MIN_NCCL:
        have = ".".join(map(str, nccl_version))
        return (f"needs NCCL >= {need} at run time (this job loads {have}): build V2 with its own "
                f"(make baselines DEEPEP_FLAVOR=v2 NCCL_CARRY=...) and run it through epbench's launcher")
    if dtype in ("fp8", "mxfp8") and hidden % FP8_BLOCK:
        return f"{dtype} dispatch needs hidden % {FP8_BLOCK} == 0 (hidden {hidden}: 4-byte scale packs)"
    if hidden % 8:
        return f"hidden {hidden} must be a multiple of 8 (rows move in 16-byte units)"
    return None


def slot_keys(slots: torch.Tensor, src_key: torch.Tensor, num_slots: int) -> torch.Tensor:
    """int64 [num_slots]: the key of the row each slot holds, -1 where no row names the slot
    (padding). ``slots`` [rows, topk]: the slot of each received row's top-k positions (-1: not
    here), ``src_key`` [rows] that row's key."""
    key = torch.full((num_slots,), -1, dtype=torch.int64, device=slots.device)
    named = slots >= 0
    key[slots[named].to(torch.int64)] = src_key.to(torch.int64).unsqueeze(1).expand_as(slots)[named]
    return key


def expanded_routing(slots: torch.Tensor, slot_weights: torch.Tensor, table: ExpertMajor,
                     num_slots: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Each received row's routing as the expanded layout holds it: per top-k position the local
    expert whose segment holds its slot (int64, -1 where the expert lives elsewhere) and the
    weight stored with that slot (float32, 0 there)."""
    named = slots >= 0
    safe = slots.clamp(min=0).to(torch.int64)
    expert = expert_of_slot(table, num_slots)
    ids = torch.where(named, expert[safe], torch.full_like(safe, -1))
    w = torch.where(named, slot_weights[safe], torch.zeros((), dtype=slot_weights.dtype, device=slots.device))
    return ids, w


def gin_setting(asked: str, world: int, gpus_per_node: int) -> str:
    """"on" or "off": what V2's Gin backend is set to. auto: off where the whole world is one node
    (every peer is reached over NVLink), on across nodes; at world 1 V2 never uses it (off)."""
    if world == 1:
        return "off"
    if asked == "auto":
        return "off" if world <= gpus_per_node else "on"
    return asked


@contextlib.contextmanager
def _env(name: str, value: Optional[str]):
    """``name`` set to ``value`` (None: left as it is) while the block runs, then restored."""
    from epbench.launch import restore_env

    before = {name: os.environ.get(name)}
    if value is not None:
        os.environ[name] = value
    try:
        yield
    finally:
        restore_env(before)


_NO_ROWS = torch.empty(0)  # a kept layout's rows: dropped, the cached calls bring their own


@dataclass
class _Handle:
    v2_handle: Any
    rows: int  # rows combine hands to V2: received tokens, or in expert_major the slots in use
    # V2's order: [num_recv, topk] received weights, or in expert_major [slots] one per slot
    recv_topk_weights: torch.Tensor

    def row_weights(self) -> torch.Tensor:
        """[rows, 1] in V2's order: the factor each row's expert output is scaled by."""
        w = self.recv_topk_weights
        return w[: self.rows].unsqueeze(1) if w.dim() == 1 else w[: self.rows].sum(dim=1, keepdim=True)


class DeepEPV2Backend(KernelLayouts, NormalMode):
    name = "deepep-v2"
    uses_sms = True
    sms_beyond = ("its dispatch copy epilogue and combine reduce epilogue run on every SM of the GPU whatever "
                  "--sms says (ElasticBuffer launches both with the device's SM count); the SMs column counts "
                  "its main kernels")
    receives_local_expert_ids = True
    call_modes = ("call", "kernel")
    dtypes = ("bf16", "fp8", "mxfp8")
    layouts = ("rank_major", "expert_major")

    @classmethod
    def unavailable_reason(cls, setup: RankSetup) -> Optional[str]:
        try:
            deep_ep = _import_deep_ep()
            deep_ep.ElasticBuffer
        except Exception as e:
            detail = " ".join(str(e).split()) or type(e).__name__
            return f"deep_ep.ElasticBuffer not importable ({detail}); build: make baselines DEEPEP_FLAVOR=v2"
        if setup.device.type != "cuda" or not torch.cuda.is_available():
            return "needs CUDA GPUs"
        from epbench.provenance import runtime_nccl_version

        nccl = runtime_nccl_version()  # the loaded library's, not torch's compile-time version
        per_gpu = -(-setup.gpus_per_node // max(1, torch.cuda.device_count()))
        return limits_reason(setup.world, setup.hidden, setup.dispatch_dtype, torch.__version__, nccl, per_gpu)

    def __init__(self, setup: RankSetup, *, group: Optional[Any] = None, gin: str = "auto",
                 prefer_overlap: str = "off") -> None:
        self.s = setup
        self.gin = gin_setting(gin, setup.world, setup.gpus_per_node)
        self.prefer_overlap = prefer_overlap
        self.deep_ep = _import_deep_ep()
        self.fp8 = setup.dispatch_dtype in ("fp8", "mxfp8")
        self.mx = setup.dispatch_dtype == "mxfp8"
        self.idx_dtype = getattr(self.deep_ep, "topk_idx_t", torch.int64)
        self.group = group if group is not None else dist.group.WORLD
        # explicitly_destroy: the buffer (and its NCCL window) goes in close(), while the process
        # group still exists, not whenever the garbage collector gets to it
        with _env("EP_DISABLE_GIN", "1" if self.gin == "off" else None):
            self.buffer = self.deep_ep.ElasticBuffer(
                self.group, num_max_tokens_per_rank=setup.max_tokens_per_rank, hidden=setup.hidden,
                num_topk=setup.topk, use_fp8_dispatch=self.fp8,
                prefer_overlap_with_compute=prefer_overlap == "on", explicitly_destroy=True)
        self.expert_major = setup.layout == "expert_major"
        self.align = setup.align if self.expert_major else 1
        cap = (slot_capacity(setup.world, setup.max_tokens_per_rank, setup.topk, setup.experts_per_rank,
                             setup.align) if self.expert_major else setup.world * setup.max_tokens_per_rank)
        self.combine_in = torch.empty(cap, setup.hidden, dtype=torch.bfloat16, device=setup.device)
        self.combine_scaled = torch.empty_like(self.combine_in)
        # kernel mode: id of a prepared input -> its full dispatch's output, rows dropped (the
        # routing, keys and V2's handle the cached calls reuse)
        self._layouts: Dict[int, DispatchOutput] = {}

    def prepare_input(self, inp: DispatchInput, num_sms: int) -> DispatchInput:
        """Kernel mode: one full dispatch of this input set, outside the timed region, whose handle
        the timed (cached) calls reuse (made at the point's SM count, as V2's test makes it)."""
        if self.kernel:
            out = self._full_dispatch(inp, num_sms)
            self._layouts[id(inp)] = replace(out, x=_NO_ROWS, x_scales=None)
        return inp

    def _payload(self, inp: DispatchInput) -> Any:
        if not self.fp8:
            return inp.x
        # mxfp8: four one-byte UE8M0 scales per int32 pack
        return inp.x, inp.x_scales.view(torch.int32) if self.mx else inp.x_scales

    def _received(self, recv_x: Any) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        if not self.fp8:
            return recv_x, None
        recv_x, recv_scales = recv_x
        return recv_x, recv_scales.view(torch.uint8) if self.mx else recv_scales

    def dispatch(self, inp: DispatchInput, num_sms: int) -> DispatchOutput:
        if not self.kernel:
            return self._full_dispatch(inp, num_sms)
        lay = self._layouts.get(id(inp))
        if lay is None:
            raise RuntimeError("deepep-v2 kernel mode: dispatch of an input prepare_input never saw")
        recv_x, recv_idx, _, _, _ = self.buffer.dispatch(self._payload(inp), handle=lay.handle.v2_handle,
                                                         num_sms=num_sms, do_expand=self.expert_major)
        x, scales = self._received(recv_x)
        if self.expert_major:  # the expanding call returns no ids: the layout's per-slot routing
            return replace(lay, x=x, x_scales=scales)
        return replace(lay, x=x, x_scales=scales, topk_idx=recv_idx)

    def _full_dispatch(self, inp: DispatchInput, num_sms: int) -> DispatchOutput:
        idx = inp.topk_idx if inp.topk_idx.dtype == self.idx_dtype else inp.topk_idx.to(self.idx_dtype)
        recv_x, recv_idx, recv_w, handle, _ = self.buffer.dispatch(
            self._payload(inp), topk_idx=idx, topk_weights=inp.topk_weights,
            num_experts=self.s.num_experts, num_max_tokens_per_rank=self.s.max_tokens_per_rank,
            expert_alignment=self.align, num_sms=num_sms, do_cpu_sync=True, do_expand=self.expert_major)
        recv_x, recv_scales = self._received(recv_x)
        if self.expert_major:
            return self._expanded_output(recv_x, recv_scales, recv_w, handle)
        n = int(handle.num_recv_tokens)
        counts = torch.tensor(handle.num_recv_tokens_per_expert_list, dtype=torch.int64)
        # V2 leaves the weights of other ranks' experts as sent (its own test masks them before
        # comparing): zero them, as a caller must before weighing the expert outputs
        recv_w = torch.where(recv_idx >= 0, recv_w, torch.zeros((), dtype=recv_w.dtype, device=recv_w.device))
        return DispatchOutput(recv_x, recv_scales, recv_idx, recv_w, counts, n, _Handle(handle, n, recv_w),
                              row_key=handle.recv_src_metadata[:n, 0])

    def _expanded_output(self, recv_x: torch.Tensor, recv_scales: Optional[torch.Tensor],
                         slot_w: torch.Tensor, handle: Any) -> DispatchOutput:
        n, num_slots = int(handle.num_recv_tokens), int(handle.num_expanded_tokens)
        counts = handle.num_unaligned_recv_tokens_per_expert.to(torch.int64)
        offsets = handle.psum_num_recv_tokens_per_expert.to(torch.int64) - counts
        table = ExpertMajor(counts, offsets, num_slots, self.align)
        meta = handle.recv_src_metadata[:n]
        slots = meta[:, 2:]
        ids, w = expanded_routing(slots, slot_w, table, num_slots)
        return DispatchOutput(recv_x, recv_scales, ids, w, counts, n, _Handle(handle, num_slots, slot_w), table,
                              row_key=meta[:, 0], slot_key=slot_keys(slots, meta[:, 0], num_slots))

    def combine_input(self, out: DispatchOutput) -> torch.Tensor:
        return self.combine_in[: out.handle.rows]

    def _scaled_rows(self, h: _Handle, exact: bool) -> torch.Tensor:
        """Rows [0, h.rows) of ``combine_in``, each times its weight (the sum of a received row's
        weights, or one slot's own), into ``combine_scaled`` (epbench/backends/weighting.py)."""
        return weigh_rows(self.combine_in[: h.rows], h.row_weights(), self.combine_scaled[: h.rows], exact)

    def prepare_combine(self, out: DispatchOutput) -> None:
        """Kernel mode: the weights folded into the expert output, outside the timed region."""
        if self.kernel:
            self._scaled_rows(out.handle, exact=True)

    def combine(self, out: DispatchOutput, num_sms: int) -> torch.Tensor:
        h: _Handle = out.handle
        # V2 sums the copies without weights: scale each row first (kernel mode: done by
        # prepare_combine, untimed)
        y = self.combine_scaled[: h.rows] if self.kernel else self._scaled_rows(h, exact=False)
        combined, _, _ = self.buffer.combine(y, h.v2_handle, num_sms=num_sms)
        return combined

    def combine_roundings(self) -> int:
        """expert_major: V2 reduces a token's expanded slots on the receiver and again at the
        source (``allow_multiple_reduction``, on by default: "if disabled, only one reduction
        will be done ... for best precision", deep_ep/buffers/elastic.py), one bf16 rounding more
        than the two of the contract: three (2 ranks, em-2gpu fp8: 22 of ~8,200 tokens off by
        up to 0.80 % against the two-rounding limit of 0.78 %)."""
        # call mode: one more, the one-pass weighting (epbench/backends/weighting.py)
        return (3 if self.expert_major else super().combine_roundings()) + EXTRA_ROUNDINGS[self.kernel]

    def effective_config(self) -> Dict[str, Any]:
        return {"gin": self.gin, "prefer_overlap": self.prefer_overlap}

    def poison(self) -> None:
        self.combine_in.fill_(float("nan"))
        self.combine_scaled.fill_(float("nan"))

    def close(self) -> None:
        self._layouts.clear()
        if self.buffer is not None:
            self.buffer.destroy()
        self.buffer = None
