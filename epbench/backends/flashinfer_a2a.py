"""The ``flashinfer`` backend: TensorRT-LLM's MoE all-to-all as FlashInfer ships it
(``flashinfer.comm.trtllm_moe_alltoall.MoeAlltoAll``, flashinfer-python 0.7.2.post1; optional:
skipped with a note where ``import flashinfer`` fails). Its kernels are compiled on first use
(FlashInfer's JIT: nvcc on the GPU host, cached under ~/.cache/flashinfer).

The library's contract (its docstrings and kernels, csrc/.../moeAlltoAllKernels.cu):

dispatch
    ``MoeAlltoAll.dispatch(ids, payloads, T_max, invalid_token_expert_id=-1,
    expert_id_payload_index=i)``: ``ids`` int32 ``[T, topk]`` global expert ids, rank ``r`` owning
    experts ``[r * E, (r + 1) * E)``; every payload (any dtype, ``[T, *]``) of a token is written
    once to each rank holding one of its experts, into that rank's workspace block of its source:
    the receiver gets ``[world, T_max, *]`` views, source ``s``'s rows at ``[s, 0:count_s]`` in the
    order the senders' atomics gave them (not token order). ``invalid_token_expert_id`` rewrites
    the ids of the slots past each source's count to -1 (its sanitize kernel), which is how a
    caller tells the rows apart from padding. One block per token; no SM count to set.

    The payloads sent here: the row (bf16, or fp8 / mxfp8 as bytes), its scales (float32 per 128,
    or UE8M0 bytes per 32), the top-k ids (int32), the weights (float32), and the source token's
    index (int32, 4 bytes a row: without it a receiver cannot put rows in epbench's order, which
    the verification needs; sent on every call so that the timed calls are the verified ones).

combine
    The caller writes each received row's output into the workspace view
    (``get_combine_payload_tensor_in_workspace``, ``[world, T_max, hidden]``, same slots) and calls
    ``combine(view, T_max, payload_in_workspace=True)``: each source reads back, per token, the
    rows of the ranks it sent it to and sums them in fp32, without weights. epbench's combine
    returns ``sum_d w(t, d) * y_d``, so the rows are scaled by ``w(t, d)`` (the received weights
    whose experts are on this rank) on their way into the workspace, inside the timed call, as a
    user would (or inside the expert).

What every call returns (timed and verified alike): the library's padded layout as it is,
``num_recv`` = every slot (``world * T_max``; the stand-in expert writes all of them outside the
timed region, padding included, which combine never reads), each slot's ``row_key`` (source rank
* T_max + source token, from the slot's block and the token-index payload; -1 on padding) and the
per-expert counts (device scatter-adds, no host wait), as a caller that feeds a grouped GEMM needs
them. The verification sorts the rows by their keys itself (verify.in_source_order).

Call modes: ``call`` is all of the above inside the timed calls. ``kernel`` is the library's two calls
as its own use times them (tools/fidelity_calls.py times them bare): the per-expert counts of an input
set come from one untimed dispatch of it (they depend on the routing only, not on the slot order),
the keys are still made from every call's token-index payload (the slot order changes from call to
call), and the weights are folded into the workspace rows outside the timed combine (exact, as an
fp32 GEMM epilogue would). The per-call bookkeeping of both modes uses constants made once (slot
bases, a global-to-local expert table), a few small kernels in all.

Workspace: one per rank, sized by the library's formula for T_max tokens of the payloads above
(``moe_a2a_get_workspace_size_per_rank``), mapped into every rank with cuMem handles: FABRIC
handles where the GPU is in an NVLink fabric, else POSIX file descriptors passed over a Unix
socket (one host), through a torch.distributed group (``TorchDistBackend``). Limits from its
kernels: top-k in {1, 2, 4, 6, 8, 10, 12, 14, 16, 18, 22}, at most 64 ranks, sm_90 or newer."""

from __future__ import annotations

import importlib
import warnings
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist

from epbench.backends.base import KernelLayouts, NormalMode
from epbench.backends.weighting import EXTRA_ROUNDINGS, weigh_rows
from epbench.contract import DispatchInput, DispatchOutput, RankSetup

TOPK_COMPILED = (1, 2, 4, 6, 8, 10, 12, 14, 16, 18, 22)  # SWITCH_TOP_K in its kernels
MAX_RANKS = 64  # kMaxRanks
INVALID_EXPERT = -1
MIN_CAPABILITY = (9, 0)  # its dispatch / combine synchronise with sm_90 instructions


def limits_reason(world: int, topk: int, capability: Optional[tuple]) -> Optional[str]:
    """What the library cannot run, known before launch (None: nothing known)."""
    if capability is None:
        return "needs CUDA GPUs"
    if tuple(capability) < MIN_CAPABILITY:
        return f"needs sm_90 or newer (this GPU is sm_{capability[0]}{capability[1]})"
    if topk not in TOPK_COMPILED:
        return f"top-k {topk}: its kernels are compiled for top-k in {', '.join(map(str, TOPK_COMPILED))}"
    if world > MAX_RANKS:
        return f"at most {MAX_RANKS} ranks (world {world})"
    return None


def import_library() -> Any:
    """The four names the backend uses, from the installed package."""
    a2a = importlib.import_module("flashinfer.comm.trtllm_moe_alltoall")
    mnnvl = importlib.import_module("flashinfer.comm.mnnvl")
    mapping = importlib.import_module("flashinfer.comm.mapping")
    return SimpleNamespace(MoeAlltoAll=a2a.MoeAlltoAll, workspace_size=a2a.moe_a2a_get_workspace_size_per_rank,
                           Mapping=mapping.Mapping, MnnvlConfig=mnnvl.MnnvlConfig,
                           TorchDistBackend=mnnvl.TorchDistBackend)


def payload_bytes(setup: RankSetup) -> int:
    """Bytes per token of the dispatch payloads listed in the module docstring."""
    row = setup.hidden * (2 if setup.dispatch_dtype == "bf16" else 1)
    scales = {"bf16": 0, "fp8": setup.hidden // 128 * 4, "mxfp8": setup.hidden // 32}[setup.dispatch_dtype]
    return row + scales + setup.topk * 4 + setup.topk * 4 + 4


@dataclass
class _Handle:
    num_recv: int
    ids: torch.Tensor  # [world * T_max, topk] int32, the library's slots (-1 on padding)
    weights: torch.Tensor  # [world * T_max, topk] float32, the library's slots
    # [world * T_max * topk] int64: each slot's local expert, experts_per_rank if none (kernel mode: made
    # by prepare_combine, outside the timed dispatch)
    local: Optional[torch.Tensor] = None


class FlashInferBackend(KernelLayouts, NormalMode):
    name = "flashinfer"
    dtypes = ("bf16", "fp8", "mxfp8")
    call_modes = ("call", "kernel")

    @classmethod
    def unavailable_reason(cls, setup: RankSetup) -> Optional[str]:
        try:
            import_library()
        except Exception as e:  # ImportError, or a dependency failing to load
            detail = " ".join(str(e).split()) or type(e).__name__
            return f"flashinfer not importable ({detail}); install: make baselines-wheels, then baselines-install"
        cuda = setup.device.type == "cuda" and torch.cuda.is_available()
        return limits_reason(setup.world, setup.topk,
                             torch.cuda.get_device_capability(setup.device) if cuda else None)

    def __init__(self, setup: RankSetup, *, library: Any = None, group: Any = None) -> None:
        self.s = setup
        lib = library if library is not None else import_library()
        group = group if group is not None else dist.group.WORLD
        mapping = lib.Mapping(world_size=setup.world, rank=setup.rank, gpus_per_node=setup.gpus_per_node,
                              tp_size=setup.world, moe_ep_size=setup.world)
        size = lib.workspace_size(setup.world, setup.max_tokens_per_rank, payload_bytes(setup), setup.hidden * 2)
        with warnings.catch_warnings():  # 0.7.1 deprecated the class for moe_ep's, which wraps it
            warnings.simplefilter("ignore", DeprecationWarning)
            self.a2a = lib.MoeAlltoAll(mapping, setup.max_tokens_per_rank, setup.topk, setup.num_experts,
                                       workspace_size_per_rank=size,
                                       mnnvl_config=lib.MnnvlConfig(comm_backend=lib.TorchDistBackend(group)))
        self.t_max = setup.max_tokens_per_rank
        cap = setup.world * self.t_max
        dev, e = setup.device, setup.experts_per_rank
        self.combine_in = torch.empty(cap, setup.hidden, dtype=torch.bfloat16, device=dev)
        # made once, so that each call's keys and counts are a few small kernels
        self._slot_base = torch.arange(cap, device=dev) // self.t_max * self.t_max  # source * T_max
        self._no_key = torch.full((cap,), -1, dtype=torch.int64, device=dev)
        # global expert id + 1 -> local expert, e for another rank's expert or padding (id -1)
        self._local_of = torch.full((setup.num_experts + 1,), e, dtype=torch.int64, device=dev)
        self._local_of[1 + setup.rank * e: 1 + (setup.rank + 1) * e] = torch.arange(e, device=dev)
        self._ones = torch.ones(cap * setup.topk, dtype=torch.int64, device=dev)
        self._ws: Optional[torch.Tensor] = None  # kernel mode: the workspace view prepare_combine filled

    def prepare_input(self, inp: DispatchInput, num_sms: int) -> DispatchInput:
        """The router's output as the library takes it (int32 ids), made once per point, and the
        source token indices that travel as the last payload."""
        t = inp.num_tokens
        self._token_index = torch.arange(t, dtype=torch.int32, device=inp.x.device).view(t, 1)
        prepared = DispatchInput(inp.x, inp.x_scales, inp.topk_idx.to(torch.int32), inp.topk_weights)
        if self.kernel:  # the counts of this input set, from one untimed round (every rank makes it)
            self._layouts[id(prepared)] = self._dispatch(prepared, None).expert_counts.clone()
            # the library refuses a dispatch before the last one's combine ("dispatch called twice
            # without combine"): this round ends with one, its result unused
            ws = self.a2a.get_combine_payload_tensor_in_workspace(self.t_max, self.s.hidden, torch.bfloat16)
            self.a2a.combine(ws, self.t_max, payload_in_workspace=True)
        return prepared

    def _payloads(self, inp: DispatchInput) -> List[torch.Tensor]:
        if self.s.dispatch_dtype == "bf16":
            rows = [inp.x]
        else:  # bytes both ways: the library copies them as they are
            rows = [inp.x.view(torch.uint8), inp.x_scales.view(torch.uint8) if self.s.dispatch_dtype == "mxfp8"
                    else inp.x_scales]
        return rows + [inp.topk_idx, inp.topk_weights, self._token_index]

    def dispatch(self, inp: DispatchInput, num_sms: int) -> DispatchOutput:
        if not self.kernel:
            return self._dispatch(inp, None)
        counts = self._layouts.get(id(inp))
        if counts is None:
            raise RuntimeError("flashinfer kernel mode: dispatch of an input prepare_input never saw")
        return self._dispatch(inp, counts)

    def _dispatch(self, inp: DispatchInput, counts: Optional[torch.Tensor]) -> DispatchOutput:
        """The library's dispatch and the keys; the per-expert counts too unless ``counts`` is given."""
        payloads = self._payloads(inp)
        ids_at = len(payloads) - 3
        recv = self.a2a.dispatch(inp.topk_idx, payloads, self.t_max, invalid_token_expert_id=INVALID_EXPERT,
                                 expert_id_payload_index=ids_at)
        cap = self.s.world * self.t_max
        flat = [r.reshape(cap, -1) for r in recv]
        x = flat[0] if self.s.dispatch_dtype == "bf16" else flat[0].view(torch.float8_e4m3fn)
        scales = None if self.s.dispatch_dtype == "bf16" else flat[1]
        ids, weights, token = flat[ids_at], flat[ids_at + 1], flat[ids_at + 2]
        # key = source * T_max + source token; -1 on padding (the library set its ids to -1)
        key = torch.where(ids[:, 0] != INVALID_EXPERT, self._slot_base + token.flatten(), self._no_key)
        local = None
        if counts is None:
            local = self._local_experts(ids)
            counts = self._expert_counts(local)
        return DispatchOutput(x, scales, ids, weights, counts, cap, _Handle(cap, ids, weights, local), row_key=key)

    def _local_experts(self, ids: torch.Tensor) -> torch.Tensor:
        """Each slot's local expert (flat), experts_per_rank for another rank's expert or padding."""
        return torch.index_select(self._local_of, 0, (ids + 1).flatten())

    def _expert_counts(self, local: torch.Tensor) -> torch.Tensor:
        """Received rows per local expert (int64 [E]): one scatter-add on the device, no host wait;
        padding and other ranks' experts land in a spare bucket E."""
        e = self.s.experts_per_rank
        counts = torch.zeros(e + 1, dtype=torch.int64, device=local.device)
        return counts.scatter_add_(0, local, self._ones[: local.numel()])[:e]

    def combine_input(self, out: DispatchOutput) -> torch.Tensor:
        return self.combine_in[: out.handle.num_recv]

    def _weighted_into_workspace(self, h: _Handle, exact: bool) -> torch.Tensor:
        """Each received row times w(t, me), the sum of its weights for this rank's experts, written
        into the library's workspace view; padding slots (never mine) get 0."""
        local = h.local if h.local is not None else self._local_experts(h.ids)
        mine = (local < self.s.experts_per_rank).view(h.ids.shape)
        w = torch.where(mine, h.weights, 0.0).sum(dim=1, keepdim=True)
        ws = self.a2a.get_combine_payload_tensor_in_workspace(self.t_max, self.s.hidden, torch.bfloat16)
        weigh_rows(self.combine_in, w, ws.view(-1, self.s.hidden), exact=exact)
        return ws

    def prepare_combine(self, out: DispatchOutput) -> None:
        """Kernel mode: the weights folded into the workspace rows, outside the timed region."""
        if self.kernel:
            self._ws = self._weighted_into_workspace(out.handle, exact=True)

    def combine(self, out: DispatchOutput, num_sms: int) -> torch.Tensor:
        # the library sums a token's rows without weights: call mode weighs them here, timed (a
        # user's one bf16 pass); kernel mode took them from prepare_combine
        ws = self._ws if self.kernel else self._weighted_into_workspace(out.handle, exact=False)
        return self.a2a.combine(ws, self.t_max, payload_in_workspace=True)

    def combine_roundings(self) -> int:
        # call mode weighs the rows in one bf16 pass (epbench/backends/weighting.py)
        return super().combine_roundings() + EXTRA_ROUNDINGS[self.kernel]

    def effective_config(self) -> Dict[str, Any]:
        return {"runtime_max_tokens_per_rank": self.t_max}

    def poison(self) -> None:
        self.combine_in.fill_(float("nan"))

    def close(self) -> None:
        if self.a2a is not None:
            if self.s.device.type == "cuda":
                torch.cuda.synchronize(self.s.device)
            # drops the library's class-wide workspace cache entry, so the mapped memory goes with
            # this object and a later backend builds its own over its own group
            self.a2a._reset_workspace()
        self.a2a = None
