"""The ``deepep`` backend: DeepEP's V1 high-throughput intranode kernels (``deep_ep.Buffer``),
driven the way a model would call them, as a baseline beside the reference and epbench
backends. Optional: it is skipped with a note when ``import deep_ep`` fails.

What one timed call contains:

dispatch
    ``Buffer.get_dispatch_layout`` (per-rank / per-expert counts, ``is_token_in_rank``) and
    ``Buffer.dispatch`` with the config for the point's SM count. DeepEP waits on the host for
    the received counts inside ``dispatch`` (its ``num_recv_tokens_per_expert_list`` is a Python
    list); that wait is part of its cost and is timed as such.

combine
    DeepEP's combine adds the returned copies *without* weights, while epbench's combine returns
    ``sum_d w(t, d) * y_d``. Each received row is therefore first scaled by the sum of its
    received (masked) weights, which is exactly ``w(t, d)``, then ``Buffer.combine`` runs. A
    DeepEP user has to do the same scaling, so it is inside the timed call.

Call modes (rows' ``call_mode``):

call
    the above: the whole call as a model's forward pass makes it.
kernel
    DeepEP's fastest path as its own benchmark (tests/test_intranode.py) times it: the layout
    (``get_dispatch_layout`` and a full dispatch) is made once per input set, outside the timed
    region (``prepare_input``; the input sets keep the routing, ``reuses_layout``), and the timed
    dispatch is DeepEP's cached dispatch (``handle=``: rows and scales only, no count exchange, no
    host wait); the expert ids, weights and counts of the rows are the layout call's, for the same
    routing. The weighting by ``w(t, d)`` is folded into the expert output (``prepare_combine``,
    untimed, as a model can do in its down-projection) and the timed combine is ``Buffer.combine``
    alone.

Semantic difference kept as DeepEP has it: the received ``topk_idx`` holds local expert indices
(-1 for experts of other ranks, whose weights are 0); ``receives_local_expert_ids`` tells the
verification to expect that form (epbench/verify.py).

Chunk sizes (option ``chunks``): DeepEP's own benchmark (tests/test_intranode.py) searches, per SM
count, how many tokens a channel sends per step through the NVL ring: 4..32 step 2 for dispatch,
1..16 for combine, ring of 256 tokens, and keeps the fastest; its ``get_*_config`` tables hold one
such winner per rank count. With ``chunks: search`` (the default) the backend does the same search
at the first point of each SM count, outside any timed region, on that point's first input set:
each candidate timed over back-to-back cached calls with device events, the slowest rank's time
decides (all ranks pick the same), in both call modes. The winners go into every row's ``config``;
``chunks: default`` keeps DeepEP's table.

SM count: DeepEP runs ``num_sms / 2`` channels (2 SMs per channel: one sends, one receives), so
the count must be even. It is a class-wide setting (``Buffer.set_num_sms``) and a field of the
``Config`` passed to each call; both are host-side, set only when the point's count changes.
The NVL buffer is sized once, in the constructor, for the largest SM count this backend accepts
(the GPU's SM count rounded down to even, or ``max_sms`` / EPBENCH_DEEPEP_MAX_SMS), since
DeepEP's buffer size hint grows with the number of channels.

DeepEP allocates its output tensors on every call (from PyTorch's caching allocator), so
``poison`` can only poison the buffers this class owns; stale outputs of DeepEP itself cannot be
pre-poisoned.
"""

from __future__ import annotations

import importlib
import os
import time
from dataclasses import dataclass
from typing import Any, Dict, Optional, Tuple

import torch
import torch.distributed as dist

from epbench.backends.base import KernelLayouts, NormalMode
from epbench.backends.weighting import EXTRA_ROUNDINGS, weigh_rows
from epbench.contract import DispatchInput, DispatchOutput, RankSetup
from epbench.scenario import FP8_BLOCK

MAX_INTRANODE_RANKS = 8  # DeepEP's NUM_MAX_NVL_PEERS
# The chunk-size search of DeepEP's tests/test_intranode.py: tokens a channel sends per step, with
# a ring of NVL_RING_TOKENS tokens per channel (the buffer size hint does not depend on the chunk).
DISPATCH_CHUNKS = tuple(range(4, 33, 2))
COMBINE_CHUNKS = tuple(range(1, 17))
NVL_RING_TOKENS = 256
RDMA_CHUNK, RDMA_RING = 6, 128  # unused within one node; DeepEP's tables' values
TUNE_WARMUP, TUNE_ITERS = 3, 10
# DeepEP V1's intranode dispatch copies each received row in two halves through one warp's
# 8 KiB TMA staging buffer, followed by an 8-byte mbarrier, and asserts on the device that the
# row is a whole, even number of 16-byte units that fits (csrc/kernels/legacy/intranode.cu,
# kNumTMABytesPerWarp): a bf16 row of hidden 8192 (16 KiB) does not.
TMA_BYTES_PER_WARP = 8192
MBARRIER_BYTES = 8


def hidden_reason(hidden: int, dtype: str) -> Optional[str]:
    """Why DeepEP V1's intranode dispatch cannot take rows of ``hidden`` elements (None: it can)."""
    row = hidden * (1 if dtype == "fp8" else 2)
    if row % 32:
        return f"hidden {hidden} ({dtype}): a row of {row} bytes is not an even number of 16-byte units"
    if row // 2 + MBARRIER_BYTES > TMA_BYTES_PER_WARP:
        elem = 1 if dtype == "fp8" else 2
        limit = 2 * (TMA_BYTES_PER_WARP - MBARRIER_BYTES) // elem
        limit -= limit % (32 // elem)
        return (f"hidden {hidden} ({dtype}): DeepEP's intranode dispatch stages half a row in "
                f"{TMA_BYTES_PER_WARP} bytes per warp and asserts on the device above hidden {limit}")
    return None


def _import_deep_ep() -> Any:
    return importlib.import_module("deep_ep")


class WeightedCombineRows:
    """For a library whose combine adds the returned copies without weights (DeepEP V1, Hybrid-EP):
    ``combine_in`` is what the caller fills, ``combine_scaled`` those rows scaled by ``w(t, d)``, the
    sum of each row's received weights. The handle of a dispatch output carries ``num_recv``."""

    combine_in: torch.Tensor
    combine_scaled: torch.Tensor

    def _allocate_combine_rows(self, setup: RankSetup, rows: Optional[int] = None) -> None:
        """``rows``: the most rows combine takes (default: every token of every rank, once)."""
        cap = rows if rows is not None else setup.world * setup.max_tokens_per_rank
        self.combine_in = torch.empty(cap, setup.hidden, dtype=torch.bfloat16, device=setup.device)
        self.combine_scaled = torch.empty_like(self.combine_in)

    def combine_input(self, out: DispatchOutput) -> torch.Tensor:
        return self.combine_in[: out.handle.num_recv]

    def scaled_rows(self, n: int, weights: torch.Tensor, exact: bool) -> torch.Tensor:
        """Rows [0, n) of ``combine_in``, each times the sum of its row of ``weights`` [n, *]
        (epbench/backends/weighting.py: ``exact`` for untimed use, else the one-pass form a user
        writes, one bf16 rounding more: ``weighting_roundings``)."""
        return weigh_rows(self.combine_in[:n], weights.sum(dim=1, keepdim=True), self.combine_scaled[:n], exact)


    def poison(self) -> None:
        self.combine_in.fill_(float("nan"))
        self.combine_scaled.fill_(float("nan"))


@dataclass
class _Handle:
    """What combine needs from the matching dispatch."""

    deep_ep_handle: Any  # DeepEP's own layout tuple
    num_recv: int
    recv_topk_weights: torch.Tensor  # [num_recv, topk] float32, 0 for other ranks' experts


@dataclass
class _Layout:
    """What a full dispatch of one input set returned, for the cached (kernel-mode) calls."""

    deep_ep_handle: Any
    recv_topk_idx: torch.Tensor
    recv_topk_weights: torch.Tensor
    counts: torch.Tensor
    num_recv: int


class DeepEPBackend(KernelLayouts, WeightedCombineRows, NormalMode):
    name = "deepep"
    uses_sms = True
    receives_local_expert_ids = True
    call_modes = ("call", "kernel")

    @classmethod
    def unavailable_reason(cls, setup: RankSetup) -> Optional[str]:
        try:
            deep_ep = _import_deep_ep()
        except Exception as e:  # ImportError, or a broken build failing to load its extension
            detail = " ".join(str(e).split()) or type(e).__name__
            return f"deep_ep is not installed (import deep_ep failed: {detail})"
        if setup.device.type != "cuda" or not torch.cuda.is_available():
            return "needs CUDA GPUs"
        if setup.world > MAX_INTRANODE_RANKS or setup.world > setup.gpus_per_node:
            return (f"intranode only: at most {MAX_INTRANODE_RANKS} ranks on one node "
                    f"(world {setup.world}, {setup.gpus_per_node} GPUs per node)")
        if setup.dispatch_dtype == "fp8" and setup.hidden % FP8_BLOCK:
            return f"fp8 dispatch needs hidden % {FP8_BLOCK} == 0 (hidden {setup.hidden})"
        if setup.hidden % 8:
            # DeepEP copies rows in 16-byte units: hidden * 2 bytes (bf16) must divide by 16.
            return f"hidden {setup.hidden} must be a multiple of 8 (rows move in 16-byte units)"
        shape = hidden_reason(setup.hidden, setup.dispatch_dtype)
        if shape is not None:
            return shape
        try:
            deep_ep.Buffer.get_dispatch_config(setup.world)
            deep_ep.Buffer.get_combine_config(setup.world)
        except (AssertionError, KeyError) as e:
            detail = " ".join(str(e).split())
            return f"DeepEP has no config for {setup.world} ranks" + (f" ({detail})" if detail else "")
        return None

    def __init__(self, setup: RankSetup, *, max_sms: Optional[int] = None, chunks: str = "search",
                 group: Optional[Any] = None) -> None:
        if chunks not in ("search", "default"):
            raise ValueError(f"deepep: chunks must be search or default, got {chunks!r}")
        self.s = setup
        self.chunks = chunks
        self._tuned: Dict[int, Dict[str, Any]] = {}  # SM count -> the search's record
        self._point_sms: Optional[int] = None
        self.deep_ep = _import_deep_ep()
        self.fp8 = setup.dispatch_dtype == "fp8"
        self.group = group if group is not None else dist.group.WORLD
        if max_sms is None and os.environ.get("EPBENCH_DEEPEP_MAX_SMS"):
            max_sms = int(os.environ["EPBENCH_DEEPEP_MAX_SMS"])
        if max_sms is None:
            max_sms = (torch.cuda.get_device_properties(setup.device).multi_processor_count
                       if setup.device.type == "cuda" else 2)
        self.max_sms = max(2, max_sms - max_sms % 2)
        self._configs: Dict[int, Tuple[Any, Any]] = {}
        # Worst case for the NVL buffer: the most channels, and bf16 rows (combine is always
        # bf16; an fp8 row with its scales, hidden + hidden / 32 bytes, is smaller). DeepEP's
        # hint already adds room for the top-k ids, weights and up to 128 scales per row.
        hidden_bytes = setup.hidden * 2
        dispatch_cfg, combine_cfg = self._configs_for(self.max_sms)
        num_nvl_bytes = max(cfg.get_nvl_buffer_size_hint(hidden_bytes, setup.world)
                            for cfg in (dispatch_cfg, combine_cfg))
        self.buffer = self.deep_ep.Buffer(self.group, num_nvl_bytes, 0)
        self._allocate_combine_rows(setup)
        self._layouts: Dict[int, _Layout] = {}  # id of a prepared input -> its layout (kernel mode)

    def prepare_input(self, inp: DispatchInput, num_sms: int) -> DispatchInput:
        """The chunk search at the first point of an SM count (``chunks: search``); kernel mode: one
        full dispatch of this input set, outside the timed region, whose handle the timed (cached)
        calls reuse."""
        self._point_sms = num_sms
        if self.chunks == "search" and num_sms not in self._tuned:
            self._search_chunks(inp, num_sms)
        if self.kernel:
            out = self._full_dispatch(inp, num_sms)  # DeepEP's handle holds per-channel prefixes
            self._layouts[id(inp)] = _Layout(out.handle.deep_ep_handle, out.topk_idx, out.topk_weights,
                                             out.expert_counts, int(out.num_recv))
        return inp

    def _configs_for(self, num_sms: int) -> Tuple[Any, Any]:
        """(dispatch config, combine config) for this SM count; sets DeepEP's class-wide count
        when it differs (a host-side attribute; configs are cached per count)."""
        if num_sms % 2 or num_sms <= 0:
            raise ValueError(f"deepep: the SM count must be even and positive (DeepEP runs one "
                             f"channel per 2 SMs), got {num_sms}")
        if num_sms > self.max_sms:
            raise ValueError(f"deepep: {num_sms} SMs exceed the {self.max_sms} the buffer was "
                             f"sized for (set EPBENCH_DEEPEP_MAX_SMS)")
        Buffer = self.deep_ep.Buffer
        if Buffer.num_sms != num_sms:
            Buffer.set_num_sms(num_sms)
        cfgs = self._configs.get(num_sms)
        if cfgs is None:
            cfgs = (Buffer.get_dispatch_config(self.s.world), Buffer.get_combine_config(self.s.world))
            self._configs[num_sms] = cfgs
        return cfgs

    def _config(self, num_sms: int, chunk: int) -> Any:
        return self.deep_ep.Config(num_sms, chunk, NVL_RING_TOKENS, RDMA_CHUNK, RDMA_RING)

    def _time_candidates(self, fn: Any, configs: Tuple[Any, ...]) -> torch.Tensor:
        """Mean time of ``fn(config)`` per candidate over back-to-back calls (as DeepEP's bench
        does), the slowest rank's: every rank gets the same tensor, so all pick the same winner."""
        dev = self.s.device
        times = torch.zeros(len(configs), dtype=torch.float64, device=dev)
        for i, cfg in enumerate(configs):
            for _ in range(TUNE_WARMUP):
                fn(cfg)
            if dev.type == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(TUNE_ITERS):
                    fn(cfg)
                end.record()
                end.synchronize()
                times[i] = start.elapsed_time(end) * 1e3 / TUNE_ITERS
            else:
                t0 = time.perf_counter()
                for _ in range(TUNE_ITERS):
                    fn(cfg)
                times[i] = (time.perf_counter() - t0) * 1e6 / TUNE_ITERS
        dist.all_reduce(times, op=dist.ReduceOp.MAX, group=self.group)
        return times.cpu()

    def _search_chunks(self, inp: DispatchInput, num_sms: int) -> None:
        """DeepEP's chunk search for this SM count on ``inp`` (untimed): cached dispatches over
        DISPATCH_CHUNKS, then combines of the received rows over COMBINE_CHUNKS; the winners
        replace the table's configs for this count."""
        out = self._full_dispatch(inp, num_sms)
        handle = out.handle.deep_ep_handle
        x = (inp.x, inp.x_scales) if self.fp8 else inp.x
        d_cfgs = tuple(self._config(num_sms, c) for c in DISPATCH_CHUNKS)
        d_times = self._time_candidates(lambda cfg: self.buffer.dispatch(x, handle=handle, config=cfg), d_cfgs)
        rows = self.combine_in[: out.handle.num_recv]
        rows.copy_(out.x)  # any values: the search times the moving, not the sum
        c_cfgs = tuple(self._config(num_sms, c) for c in COMBINE_CHUNKS)
        c_times = self._time_candidates(lambda cfg: self.buffer.combine(rows, handle, config=cfg), c_cfgs)
        d_best, c_best = int(torch.argmin(d_times)), int(torch.argmin(c_times))
        self._configs[num_sms] = (d_cfgs[d_best], c_cfgs[c_best])
        self._tuned[num_sms] = {
            "nvl_chunk_dispatch": DISPATCH_CHUNKS[d_best], "nvl_chunk_combine": COMBINE_CHUNKS[c_best],
            "search_dispatch_us": {c: round(float(t), 2) for c, t in zip(DISPATCH_CHUNKS, d_times)},
            "search_combine_us": {c: round(float(t), 2) for c, t in zip(COMBINE_CHUNKS, c_times)}}

    def effective_config(self) -> Dict[str, Any]:
        """The chunk sizes the last point ran with and how they were chosen."""
        n = self._point_sms
        if n is None:
            return {}
        rec: Dict[str, Any] = {"num_sms": n, "chunks": self.chunks}
        if n in self._tuned:
            rec.update(self._tuned[n])
        elif n in self._configs:
            d, c = self._configs[n]
            rec.update(nvl_chunk_dispatch=int(d.num_max_nvl_chunked_send_tokens),
                       nvl_chunk_combine=int(c.num_max_nvl_chunked_send_tokens))
        return rec

    def dispatch(self, inp: DispatchInput, num_sms: int) -> DispatchOutput:
        if not self.kernel:
            return self._full_dispatch(inp, num_sms)
        lay = self._layouts.get(id(inp))
        if lay is None:
            raise RuntimeError("deepep kernel mode: dispatch of an input prepare_input never saw")
        config, _ = self._configs_for(num_sms)
        x = (inp.x, inp.x_scales) if self.fp8 else inp.x
        recv_x, _, _, _, _, _ = self.buffer.dispatch(x, handle=lay.deep_ep_handle, config=config)
        recv_scales = None
        if self.fp8:
            recv_x, recv_scales = recv_x
        return DispatchOutput(recv_x, recv_scales, lay.recv_topk_idx, lay.recv_topk_weights, lay.counts,
                              lay.num_recv, _Handle(lay.deep_ep_handle, lay.num_recv, lay.recv_topk_weights))

    def _full_dispatch(self, inp: DispatchInput, num_sms: int) -> DispatchOutput:
        config, _ = self._configs_for(num_sms)
        buf = self.buffer
        per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(inp.topk_idx,
                                                                      self.s.num_experts)
        x = (inp.x, inp.x_scales) if self.fp8 else inp.x
        recv_x, recv_idx, recv_w, counts, handle, _ = buf.dispatch(
            x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
            num_tokens_per_expert=per_expert, topk_idx=inp.topk_idx,
            topk_weights=inp.topk_weights, config=config)
        recv_scales = None
        if self.fp8:
            recv_x, recv_scales = recv_x
        num_recv = int(recv_x.shape[0])
        # The counts are already on the host (DeepEP waited for them); a CPU tensor keeps a
        # host-to-device copy out of the timed call.
        expert_counts = torch.tensor(counts, dtype=torch.int64)
        return DispatchOutput(recv_x, recv_scales, recv_idx, recv_w, expert_counts, num_recv,
                              _Handle(handle, num_recv, recv_w))

    def prepare_combine(self, out: DispatchOutput) -> None:
        """Kernel mode: the weights folded into the expert output, outside the timed region."""
        if self.kernel:
            h: _Handle = out.handle
            self.scaled_rows(h.num_recv, h.recv_topk_weights, exact=True)

    def combine_roundings(self) -> int:
        # call mode weighs the rows in one bf16 pass (epbench/backends/weighting.py)
        return super().combine_roundings() + EXTRA_ROUNDINGS[self.kernel]

    def combine(self, out: DispatchOutput, num_sms: int) -> torch.Tensor:
        _, config = self._configs_for(num_sms)
        h: _Handle = out.handle
        # DeepEP sums the copies without weights: scale row r by w(t, d), the sum of its masked
        # received weights (kernel mode: done by prepare_combine, untimed)
        y = (self.combine_scaled[: h.num_recv] if self.kernel
             else self.scaled_rows(h.num_recv, h.recv_topk_weights, exact=False))
        combined, _, _ = self.buffer.combine(y, h.deep_ep_handle, config=config)
        return combined

    def close(self) -> None:
        # DeepEP frees its NVL buffer (and syncs peers) when the Buffer object goes away; every
        # rank closes at the same point of the driver.
        self.buffer = None
        self._configs.clear()
        self._tuned.clear()
        self._layouts.clear()
