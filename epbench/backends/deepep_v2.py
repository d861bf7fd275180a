"""The ``deepep-v2`` backend: DeepEP V2's ``ElasticBuffer`` (DeepEP main, pinned in
epbench/baselines.py), called as its tests/elastic/test_ep.py calls it. Optional: skipped with a
note when ``deep_ep.ElasticBuffer`` cannot be imported (``make baselines DEEPEP_FLAVOR=v2``).

dispatch
    ``ElasticBuffer.dispatch(x | (x, sf), topk_idx=, topk_weights=, num_experts=,
    num_max_tokens_per_rank=, expert_alignment=1, num_sms=, do_cpu_sync=True)``: the whole call, its
    host wait for the received count included. ``topk_idx`` must be ``deep_ep.topk_idx_t`` (int64
    unless V2 was built with EP_NUM_TOPK_IDX_BITS=32). ``sf`` is opaque to V2, one 4-byte pack per
    element: float32 per 128 values (epbench's fp8 scales as they are), or four UE8M0 bytes per
    int32 (epbench's mxfp8 scales, one byte per 32 values, viewed as int32: hidden % 128). Received
    ``topk_idx`` holds local expert ids and -1 for other ranks' experts
    (``receives_local_expert_ids``); the per-expert counts are padded to ``expert_alignment`` (1
    here, so exact).

World and GPUs: V2 talks through an NCCL communicator (torch's, or its own built over the group),
and NCCL refuses two ranks on one GPU, so ranks sharing a GPU cannot run it. At world 1 V2 skips
NCCL Gin (``num_ranks > 1`` only) and its kernels copy within the GPU; above 1 rank it asserts that
Gin is available (``EP_DISABLE_GIN=1`` lifts that where every peer is on NVLink).

Row order: V2 does not promise epbench's (source rank, source token) order; its handle says where
each row came from (``recv_src_metadata[:, 0]`` = ``source rank * num_max_tokens_per_rank + token``).
The timed calls return V2's own order. The verified call (the one after ``poison``) returns the
rows sorted by that key, and combine puts the expert output back into V2's order before calling
V2, so the check sees exactly what V2 delivered, relabelled.

combine
    ``ElasticBuffer.combine(y, handle, num_sms=)`` sums the copies of a token without weights
    (``topk_weights``, when given, are only carried back), so each
    received row is first scaled by ``w(t, d)``, the sum of its received weights on this rank, as
    a V2 user would (inside the timed call), exactly as for V1 (epbench/backends/deepep.py).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Optional, Tuple

import torch
import torch.distributed as dist

from epbench.backends.base import Backend, DispatchInput, DispatchOutput, RankSetup
from epbench.baselines import MIN_NCCL, version_tuple
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


def sort_key_order(src_key: torch.Tensor) -> torch.Tensor:
    """The permutation that sorts received rows by (source rank, source token): V2's key is
    ``rank * num_max_tokens_per_rank + token``, unique per received row."""
    return torch.argsort(src_key.to(torch.int64), stable=True)


@dataclass
class _Handle:
    v2_handle: Any
    num_recv: int
    recv_topk_weights: torch.Tensor  # [num_recv, topk], V2's order
    order: Optional[torch.Tensor]  # set on the verified call: epbench row i = V2 row order[i]


class DeepEPV2Backend(Backend):
    name = "deepep-v2"
    uses_sms = True
    receives_local_expert_ids = True
    dtypes = ("bf16", "fp8", "mxfp8")

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
        from epbench.baselines import runtime_nccl_version

        nccl = runtime_nccl_version()  # the loaded library's, not torch's compile-time version
        per_gpu = -(-setup.gpus_per_node // max(1, torch.cuda.device_count()))
        return limits_reason(setup.world, setup.hidden, setup.dispatch_dtype, torch.__version__, nccl, per_gpu)

    def __init__(self, setup: RankSetup, *, group: Optional[Any] = None) -> None:
        self.s = setup
        self.deep_ep = _import_deep_ep()
        self.fp8 = setup.dispatch_dtype in ("fp8", "mxfp8")
        self.mx = setup.dispatch_dtype == "mxfp8"
        self.idx_dtype = getattr(self.deep_ep, "topk_idx_t", torch.int64)
        self.group = group if group is not None else dist.group.WORLD
        # explicitly_destroy: the buffer (and its NCCL window) goes in close(), while the process
        # group still exists, not whenever the garbage collector gets to it
        self.buffer = self.deep_ep.ElasticBuffer(
            self.group, num_max_tokens_per_rank=setup.max_tokens_per_rank, hidden=setup.hidden,
            num_topk=setup.topk, use_fp8_dispatch=self.fp8, explicitly_destroy=True)
        cap = setup.world * setup.max_tokens_per_rank
        self.combine_in = torch.empty(cap, setup.hidden, dtype=torch.bfloat16, device=setup.device)
        self.combine_scaled = torch.empty_like(self.combine_in)
        self._ordered_next = False

    def dispatch(self, inp: DispatchInput, num_sms: int) -> DispatchOutput:
        if self.fp8:  # mxfp8: four one-byte UE8M0 scales per int32 pack
            x = (inp.x, inp.x_scales.view(torch.int32) if self.mx else inp.x_scales)
        else:
            x = inp.x
        idx = inp.topk_idx if inp.topk_idx.dtype == self.idx_dtype else inp.topk_idx.to(self.idx_dtype)
        recv_x, recv_idx, recv_w, handle, _ = self.buffer.dispatch(
            x, topk_idx=idx, topk_weights=inp.topk_weights,
            num_experts=self.s.num_experts, num_max_tokens_per_rank=self.s.max_tokens_per_rank,
            expert_alignment=1, num_sms=num_sms, do_cpu_sync=True)
        recv_scales = None
        if self.fp8:
            recv_x, recv_scales = recv_x
            recv_scales = recv_scales.view(torch.uint8) if self.mx else recv_scales
        n = int(handle.num_recv_tokens)
        counts = torch.tensor(handle.num_recv_tokens_per_expert_list, dtype=torch.int64)
        order = None
        if self._ordered_next:  # the verified call: relabel rows into epbench's order
            self._ordered_next = False
            order = sort_key_order(handle.recv_src_metadata[:n, 0])
            recv_x, recv_idx, recv_w = recv_x[:n][order], recv_idx[:n][order], recv_w[:n][order]
            recv_scales = recv_scales[:n][order] if recv_scales is not None else None
        return DispatchOutput(recv_x, recv_scales, recv_idx, recv_w, counts, n,
                              _Handle(handle, n, recv_w, order))

    def combine_input(self, out: DispatchOutput) -> torch.Tensor:
        return self.combine_in[: out.handle.num_recv]

    def combine(self, out: DispatchOutput, num_sms: int) -> torch.Tensor:
        h: _Handle = out.handle
        n = h.num_recv
        y = self.combine_scaled[:n]
        if h.order is None:
            torch.mul(self.combine_in[:n], h.recv_topk_weights.sum(dim=1, keepdim=True), out=y)
        else:  # back into V2's order: V2 row order[i] is epbench row i
            w = out.topk_weights[:n].sum(dim=1, keepdim=True)
            y[h.order] = (self.combine_in[:n] * w).to(y.dtype)
        combined, _, _ = self.buffer.combine(y, h.v2_handle, num_sms=num_sms)
        return combined

    def poison(self) -> None:
        self.combine_in.fill_(float("nan"))
        self.combine_scaled.fill_(float("nan"))
        self._ordered_next = True

    def close(self) -> None:
        if self.buffer is not None:
            self.buffer.destroy()
        self.buffer = None
