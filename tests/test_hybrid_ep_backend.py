"""The hybrid-ep backend against a fake ``HybridEPBuffer`` that implements the semantics documented
by Hybrid-EP's own code and tests (deep_ep/hybrid_ep_buffer.py, csrc/hybrid_ep and
tests/test_hybrid_ep.py with its TorchRef in tests/utils.py, hybrid-ep branch 94a9f8f): index
routing becomes a routing map and probabilities over all experts; an uncached call all-gathers the
maps and runs the metadata pass, whose handle says where each of a rank's tokens lands on every
rank (``sparse_to_dense_map``) and carries the per-call config (block counts copied from the
buffer config at that moment); a rank receives, by (source rank, token), every token routed to
one of its experts; a call with a handle moves the rows through it without a metadata pass, and
without a host wait when the count is given; combine adds the rows coming back without weights.
Ranks are threads of one process; the backend is checked through the driver's own Point /
measure_point (timed calls, the last one checked, then a verification run)."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple

import pytest
import torch

from epbench.backends import REGISTRY
from epbench.backends.hybrid_ep import HybridEPBackend, limits_reason
from epbench.driver import Point, PointRecord, call_modes_of, measure_point
from epbench.inputs import dispatch_input, make_tokens
from epbench.routing import route_all
from epbench.scenario import parse
from support import scenario_dict
from test_symm_mem_backend import CPU, FakeWorld, ThreadComm
from test_symm_mem_backend import run_ranks as symm_run_ranks, setup_of

DEFAULT_BLOCKS = 24  # the library's dispatch / combine block count within one NVLink domain
PREPROCESSING_BLOCKS = 108  # its metadata kernel's default grid (config.cuh:365)
FAKE_SMS = 132  # the fake GPU's SM count: permute / unpermute grids are sm_count * 16 by default


# -- the fake HybridEPBuffer --------------------------------------------------------------------

@dataclass
class Trace:
    """What one rank's fake buffer was asked to do."""

    calls: List[str] = field(default_factory=list)  # "dispatch", "dispatch(handle)", "combine", ...
    preprocess: int = 0  # metadata passes (routing map all-gather + scan)
    host_waits: int = 0  # stream synchronisations the library makes
    blocks: List[Tuple[str, int]] = field(default_factory=list)  # (kernel, grid) of every launch


class FakeGroup:
    def __init__(self, rank: int, world: int) -> None:
        self._rank, self._world = rank, world

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._world


class _BufferConfig:
    """The fields of its BufferConfig the adapter touches (read-write, as in its pybind module)."""

    def __init__(self, dispatch: int, combine: int, preprocessing: int) -> None:
        self.num_of_blocks_dispatch_api = dispatch
        self.num_of_blocks_combine_api = combine
        self.num_of_blocks_preprocessing_api = preprocessing


class _Config:
    """Its per-call HybridEpConfigInstance (the fields this fake and the adapter read)."""

    def __init__(self, dispatch: int, combine: int, preprocessing: int, permute: int, unpermute: int) -> None:
        self.num_of_blocks_dispatch_api = dispatch
        self.num_of_blocks_combine_api = combine
        self.num_of_blocks_preprocessing_api = preprocessing
        self.num_of_blocks_permute = permute
        self.num_of_blocks_unpermute = unpermute
        self.pad_multiple = 1


class _Configurer:
    def __init__(self, buffer_config: _BufferConfig, permute: int, unpermute: int, fixed: bool) -> None:
        self.buffer_config = buffer_config
        self._permute, self._unpermute = permute, unpermute
        # fault "sms_fixed": a library that took the counts once and ignores later writes
        self._fixed = _BufferConfig(buffer_config.num_of_blocks_dispatch_api,
                                    buffer_config.num_of_blocks_combine_api,
                                    buffer_config.num_of_blocks_preprocessing_api) if fixed else None

    def get_default_config(self) -> _Config:
        """Block counts copied from the buffer config at this moment (config.cuh:412-414)."""
        b = self._fixed or self.buffer_config
        return _Config(b.num_of_blocks_dispatch_api, b.num_of_blocks_combine_api,
                       b.num_of_blocks_preprocessing_api, self._permute, self._unpermute)


def fake_buffer_class(world_state: FakeWorld, trace: Trace, fault: Optional[str] = None) -> type:
    """``fault``: "cached_stale_rows" (a call with a handle returns the rows its handle's uncached
    call moved, not the ones handed in), "cached_swapped_rows" (a call with a handle puts received
    rows 0 and 1 in each other's place), "sms_fixed" (block counts written into the buffer config
    after construction are ignored)."""

    class FakeHybridEPBuffer:
        def __init__(self, group: Any, hidden_dim: int, max_num_of_tokens_per_rank: int,
                     num_local_experts: int, use_fp8: bool = False,
                     num_sms_dispatch_api: Optional[int] = None, num_sms_combine_api: Optional[int] = None,
                     num_sms_preprocessing_api: Optional[int] = None, num_blocks_permute: Optional[int] = None,
                     num_blocks_unpermute: Optional[int] = None) -> None:
            self.group = group
            self.rank, self.group_size = group.rank(), group.size()
            self.local_rank = self.rank  # one NVLink domain: every rank reaches every other
            self.hidden, self.max_tokens = hidden_dim, max_num_of_tokens_per_rank
            self.experts, self.fp8 = num_local_experts, use_fp8
            assert hidden_dim % (512 if use_fp8 else 16) == 0
            buffer_config = _BufferConfig(num_sms_dispatch_api or DEFAULT_BLOCKS, num_sms_combine_api or DEFAULT_BLOCKS,
                                          num_sms_preprocessing_api or PREPROCESSING_BLOCKS)
            self.configurer = _Configurer(buffer_config, num_blocks_permute or FAKE_SMS * 16,
                                          num_blocks_unpermute or FAKE_SMS * 16, fault == "sms_fixed")
            self._moved: Dict[int, Any] = {}  # id of a handle's sparse_to_dense_map -> what its uncached call moved

        @property
        def capacity(self) -> int:
            return self.group_size * self.max_tokens

        def _check_payload(self, hidden: torch.Tensor, scaling_factor: Optional[torch.Tensor]) -> None:
            t = hidden.shape[0]
            assert hidden.dtype == (torch.uint8 if self.fp8 else torch.bfloat16)
            assert hidden.shape[1] == self.hidden and t <= self.max_tokens
            if self.fp8:
                assert scaling_factor.dtype == torch.float32 and scaling_factor.shape == (t, self.hidden // 128)

        def _to_map(self, topk_idx: torch.Tensor, topk_weights: torch.Tensor, num_of_experts: int):
            """Its indices_to_map: the routing map and the probabilities over all experts."""
            assert num_of_experts == self.experts * self.group_size
            t = topk_idx.shape[0]
            routing = torch.zeros(t, num_of_experts, dtype=torch.bool).scatter(1, topk_idx, True)
            probs = torch.zeros(t, num_of_experts).scatter(1, topk_idx, topk_weights)
            return routing, probs

        def _preprocess(self, routing_map: torch.Tensor, permute: bool, pad_multiple: Optional[int]):
            """metadata_preprocessing: the maps all-gathered; where each of this rank's tokens lands on
            every rank, the rows this rank receives and their local experts; permute: each (row, local
            expert)'s slot, the counts, the padded counts. Buffers sized for the most rows hold stale
            values past the received count, as the library's do."""
            trace.preprocess += 1
            config = self.configurer.get_default_config()
            config.pad_multiple = pad_multiple if pad_multiple else 1
            trace.blocks.append(("preprocessing", config.num_of_blocks_preprocessing_api))
            me, world, epr = self.rank, self.group_size, self.experts
            out: Dict[str, Any] = {}

            def compute(maps: List[torch.Tensor]) -> None:
                goes = [m.view(m.shape[0], world, epr).any(dim=2) for m in maps]  # [T_s, world]
                s2d = torch.full((maps[me].shape[0], world), -1, dtype=torch.int32)
                for d in range(world):
                    before = sum(int(goes[s][:, d].sum()) for s in range(me))
                    mine = goes[me][:, d].nonzero().flatten()
                    s2d[mine, d] = before + torch.arange(mine.numel(), dtype=torch.int32)
                local = [maps[s][goes[s][:, me]][:, me * epr:(me + 1) * epr] for s in range(world)]
                out.update(s2d=s2d, local=torch.cat(local))

            world_state.collective(me, routing_map.clone(), compute)
            n = out["local"].shape[0]
            local_map = torch.ones(self.capacity, epr, dtype=torch.bool)  # stale past n
            local_map[:n] = out["local"]
            head = (out["s2d"], "rdma_to_attn_map", "attn_to_rdma_map", torch.tensor([n], dtype=torch.int32))
            if not permute:
                return head + (local_map, routing_map.shape[0], config), None
            pad = config.pad_multiple
            per_expert = out["local"].sum(dim=0).to(torch.int32)
            padded = (per_expert.to(torch.int64) + pad - 1) // pad * pad
            starts = torch.cumsum(padded, 0) - padded
            slot_of = torch.full((self.capacity, epr), 7, dtype=torch.int32)  # stale past n
            slot_of[:n] = -1
            for e in range(epr):
                rows = out["local"][:, e].nonzero().flatten()
                slot_of[rows, e] = (starts[e] + torch.arange(rows.numel())).to(torch.int32)
            # its local_expert_routing_map is not filled on this path: on 1 x H100 (2026-11-25) an
            # adapter that read it saw every row's experts differ; the map lives in dense_to_expert_map
            unfilled = torch.zeros_like(local_map)
            return head + (unfilled, "dense_chunk_layout", slot_of, per_expert, routing_map.shape[0], config,
                           torch.zeros(1, dtype=torch.int32)), padded

        def _move(self, hidden: torch.Tensor, probs: Optional[torch.Tensor], scales: Optional[torch.Tensor],
                  handle: tuple, config: _Config, cached: bool):
            """The dispatch kernel: every rank's rows placed where its sparse_to_dense_map says."""
            trace.blocks.append(("dispatch", config.num_of_blocks_dispatch_api))
            s2d, n = handle[0], int(handle[3][0])
            me = self.rank
            out: Dict[str, Any] = {}

            def compute(posted: List[Any]) -> None:
                x = torch.zeros(n, self.hidden, dtype=hidden.dtype)
                p = torch.zeros(n, self.experts * self.group_size) if probs is not None else None
                sc = torch.zeros(n, self.hidden // 128) if scales is not None else None
                for h, pr, sf, m in posted:
                    sel = (m[:, me] >= 0).nonzero().flatten()
                    at = m[sel, me].long()
                    x[at] = h[sel]
                    if p is not None:
                        p[at] = pr[sel]
                    if sc is not None:
                        sc[at] = sf[sel]
                out.update(x=x, p=p, s=sc)

            world_state.collective(me, (hidden.clone(), probs, scales, s2d), compute)
            x, p, sc = out["x"], out["p"], out["s"]
            if not cached:
                self._moved[id(s2d)] = (x.clone(), p, sc)
            elif fault == "cached_stale_rows":
                x, p, sc = self._moved[id(s2d)]
            elif fault == "cached_swapped_rows" and n >= 2:
                for t in (x, p, sc):
                    if t is not None:
                        t[[0, 1]] = t[[1, 0]].clone()
            return x, p, sc

        def dispatch(self, hidden: torch.Tensor, scaling_factor: Optional[torch.Tensor] = None,
                     topk_idx: Optional[torch.Tensor] = None, topk_weights: Optional[torch.Tensor] = None,
                     num_of_experts: Optional[int] = None, probs: Optional[torch.Tensor] = None,
                     routing_map: Optional[torch.Tensor] = None, num_dispatched_tokens_tensor: Any = None,
                     num_dispatched_tokens: Optional[int] = None, handle: Optional[tuple] = None):
            if routing_map is None:
                assert num_of_experts is not None, "The number of experts should be provided on index-based routing."
                if topk_idx is not None:
                    routing_map, probs = self._to_map(topk_idx, topk_weights, num_of_experts)
            assert handle is not None or routing_map is not None, "The handle and routing_map should not be both None"
            self._check_payload(hidden, scaling_factor)
            cached = handle is not None
            if not cached:
                handle, _ = self._preprocess(routing_map, False, None)
            else:
                assert len(handle) == 7 and handle[5] == hidden.shape[0]
            if num_dispatched_tokens is None:
                trace.host_waits += 1  # it synchronises the stream for the pinned count
            trace.calls.append("dispatch(handle)" if cached else "dispatch")
            x, p, sc = self._move(hidden, probs, scaling_factor, handle, handle[6], cached)
            return x, p, sc, handle

        def combine(self, hidden: torch.Tensor, probs: Optional[torch.Tensor] = None, handle: Any = None):
            assert handle is not None, "The handle is necessary for combine."
            assert hidden.dtype == torch.bfloat16 and probs is None and hidden.is_contiguous()
            assert hidden.shape == (int(handle[3][0]), self.hidden)
            trace.calls.append("combine")
            trace.blocks.append(("combine", handle[6].num_of_blocks_combine_api))
            return self._combine_rows(hidden, handle[0], handle[5]), None

        def _combine_rows(self, rows: torch.Tensor, s2d: torch.Tensor, num_tokens: int) -> torch.Tensor:
            """Each of this rank's tokens: the rows every rank sends back for it, added without
            weights (fp32, one bf16 rounding), found through its sparse_to_dense_map."""
            out = {}

            def compute(posted: List[torch.Tensor]) -> None:
                acc = torch.zeros(num_tokens, self.hidden, dtype=torch.float32)
                for d, y in enumerate(posted):
                    sel = (s2d[:, d] >= 0).nonzero().flatten()
                    acc.index_add_(0, sel, y[s2d[sel, d].long()].float())
                out["y"] = acc.to(torch.bfloat16)

            world_state.collective(self.rank, rows.clone(), compute)
            return out["y"]

        def dispatch_with_permute(self, *, hidden: torch.Tensor, topk_idx: Optional[torch.Tensor] = None,
                                  topk_weights: Optional[torch.Tensor] = None,
                                  num_of_experts_per_rank: Optional[int] = None, num_of_experts: Optional[int] = None,
                                  use_fp8: Optional[bool] = None, routing_map: Optional[torch.Tensor] = None,
                                  probs: Optional[torch.Tensor] = None, scaling_factor: Optional[torch.Tensor] = None,
                                  num_permuted_tokens: Optional[int] = None, pad_multiple: Optional[int] = None,
                                  handle: Optional[tuple] = None, non_blocking: bool = False,
                                  fuse_permute_dispatch: bool = False):
            """Its TorchRef with enable_permute: each local expert's received rows in received
            order, each segment padded with zero rows (zero probability, zero scales) to a multiple
            of pad_multiple; probabilities one per slot. Blocking mode: the metadata pass waits and
            the padded counts are on the host. With a handle: no metadata pass, so no wait; the
            permuted row count must be given (the handle tuple does not hold it), and no padded
            counts come back (a handle made from the tuple has none)."""
            assert not non_blocking and not fuse_permute_dispatch
            if routing_map is None and topk_idx is not None:
                assert num_of_experts is not None
                routing_map, probs = self._to_map(topk_idx, topk_weights, num_of_experts)
            self._check_payload(hidden, scaling_factor)
            cached = handle is not None
            if not cached:
                assert num_of_experts_per_rank == self.experts
                handle, padded = self._preprocess(routing_map, True, pad_multiple)
                trace.host_waits += 1  # the blocking metadata pass synchronises (executor.cu:166-176)
                if num_permuted_tokens is None:
                    num_permuted_tokens = int(padded.sum())
            else:
                assert len(handle) == 11 and handle[8] == hidden.shape[0]
                assert num_permuted_tokens is not None, "HandleImpl.num_permuted_tokens is an int64"
                padded = None
            config = handle[9]
            assert (pad_multiple if pad_multiple else 1) == config.pad_multiple
            trace.calls.append("dispatch_with_permute(handle)" if cached else "dispatch_with_permute")
            rows_x, rows_p, rows_s = self._move(hidden, probs, scaling_factor, handle, config, cached)
            trace.blocks.append(("permute", config.num_of_blocks_permute))
            slot_of, n = handle[6], int(handle[3][0])
            r, e = (slot_of[:n] >= 0).nonzero(as_tuple=True)
            at = slot_of[r, e].long()
            x = torch.zeros(num_permuted_tokens, self.hidden, dtype=hidden.dtype)
            x[at] = rows_x[r]
            p = None
            if rows_p is not None:
                p = torch.zeros(num_permuted_tokens)
                p[at] = rows_p[r, self.local_rank * self.experts + e]
            sc = None
            if rows_s is not None:
                sc = torch.zeros(num_permuted_tokens, self.hidden // 128)
                sc[at] = rows_s[r]
            return x, p, sc, padded, handle

        def combine_with_unpermute(self, *, hidden: torch.Tensor, probs: Optional[torch.Tensor] = None,
                                   handle: Any = None, pad_multiple: Optional[int] = None,
                                   fuse_unpermute_combine: bool = False):
            """Its unpermute (each received row: the sum of its experts' rows, fp32, one bf16
            rounding; padding never read), then combine."""
            assert handle is not None and not fuse_unpermute_combine
            assert hidden.dtype == torch.bfloat16 and probs is None
            config = handle[9]
            assert (pad_multiple if pad_multiple else 1) == config.pad_multiple
            trace.calls.append("combine_with_unpermute")
            trace.blocks += [("unpermute", config.num_of_blocks_unpermute), ("combine", config.num_of_blocks_combine_api)]
            slot_of, n = handle[6], int(handle[3][0])
            r, e = (slot_of[:n] >= 0).nonzero(as_tuple=True)
            at = slot_of[r, e].long()
            assert hidden.shape[1] == self.hidden and (at.numel() == 0 or hidden.shape[0] > int(at.max()))
            rows = torch.zeros(n, self.hidden, dtype=torch.float32).index_add_(0, r, hidden[at].float())
            return self._combine_rows(rows.to(torch.bfloat16), handle[0], handle[8]), None

    return FakeHybridEPBuffer


# -- running points through the driver ------------------------------------------------------------

def run_ranks(world: int, fn: Callable[[int, FakeWorld], Any]) -> List[Any]:
    """``fn(rank, world_state)`` on one thread per rank (symm-mem's runner; its fake is unused)."""
    return symm_run_ranks(world, lambda rank, symm: fn(rank, symm.world_state))


def scenario(world: int, dtype: str = "bf16", hidden: int = 256, topk: int = 4, experts: int = 4,
             tokens: int = 24, align: Optional[int] = None):
    """``align`` given: the expert_major layout with that alignment."""
    model = {"hidden": hidden, "tokens_per_rank": tokens, "topk": topk, "experts_per_rank": experts,
             "dispatch_dtype": dtype}
    if align is not None:
        model.update(layout="expert_major", align=align)
    return parse(scenario_dict(model=model, topology={"name": "fake", "nodes": 1, "gpus_per_node": world},
                               bench={"backends": ["hybrid-ep"], "sms": [8]}), "<test>")


def make_backend(s, rank: int, state: FakeWorld, trace: Trace, fault: Optional[str] = None) -> HybridEPBackend:
    return HybridEPBackend(setup_of(s, rank), buffer_class=fake_buffer_class(state, trace, fault),
                           group=FakeGroup(rank, s.world))


def run_points(s, inject: Optional[str] = None, mode: str = "call", sms: Tuple[int, ...] = (8,),
               fault: Optional[str] = None) -> List[List[PointRecord]]:
    """Per rank, one record per SM count, each point made, timed and verified as driver.measure does
    (one backend object for all of them; warmup 1, iters 2, 2 input sets). Each record carries the
    fake's trace of that point."""
    routings = route_all(s)

    def fn(rank: int, state: FakeWorld) -> List[PointRecord]:
        comm = ThreadComm(rank, s.world, state.barrier)
        trace = Trace()
        be = make_backend(s, rank, state, trace, fault)
        recs = []
        try:
            for n in sms:
                before = len(trace.calls), trace.preprocess, trace.host_waits, len(trace.blocks)
                be.use_call_mode(mode)
                rec = PointRecord(rank, call_mode=mode)
                measure_point(Point(be, s, routings, n, comm, input_sets=2), 1, 2, 3, inject, rec)
                rec.config = be.effective_config()
                rec.trace = Trace(trace.calls[before[0]:], trace.preprocess - before[1],
                                  trace.host_waits - before[2], trace.blocks[before[3]:])
                recs.append(rec)
        finally:
            be.close()
        return recs

    return run_ranks(s.world, fn)


def run_point(s, **kw) -> List[PointRecord]:
    """One point: each rank's record."""
    return [recs[0] for recs in run_points(s, **kw)]


def clean(rec: PointRecord) -> bool:
    return rec.wrong == {"dispatch": 0, "combine": 0}


# -- both call modes verify clean -----------------------------------------------------------------

RANK_MAJOR = [(1, "bf16", 256), (2, "bf16", 256), (3, "fp8", 512), (4, "bf16", 128)]


@pytest.mark.parametrize("mode", ["call", "kernel"])
@pytest.mark.parametrize("world, dtype, hidden", RANK_MAJOR)
def test_verifies_clean_against_the_fake(world, dtype, hidden, mode):
    for rec in run_point(scenario(world, dtype, hidden), mode=mode):
        assert clean(rec), rec.problem
        assert len(rec.samples_us["dispatch"]) == 2
        assert rec.config == {"num_sms_dispatch": 8, "num_sms_combine": 8,
                              "num_blocks_preprocessing": PREPROCESSING_BLOCKS}


EXPERT_MAJOR = [(1, "bf16", 256, 1), (2, "bf16", 256, 16), (3, "fp8", 512, 16), (2, "fp8", 512, 128),
                (4, "bf16", 128, 1)]
# expert_major combine rounds to bf16 three times: the adapter's weighting of each slot, the library's
# unpermute output (one row per received token, summed in fp32), its combine's final row; each at most
# half a bf16 ulp, 2^-8 relative. The backend says so (combine_roundings 3), and verification allows it.


@pytest.mark.parametrize("mode", ["call", "kernel"])
@pytest.mark.parametrize("world, dtype, hidden, align", EXPERT_MAJOR)
def test_expert_major_verifies_clean_against_the_fake(world, dtype, hidden, align, mode):
    for rec in run_point(scenario(world, dtype, hidden, align=align), mode=mode):
        assert clean(rec), rec.problem
        assert rec.config == {"num_sms_dispatch": 8, "num_sms_combine": 8,
                              "num_blocks_preprocessing": PREPROCESSING_BLOCKS,
                              "num_blocks_permute": FAKE_SMS * 16, "num_blocks_unpermute": FAKE_SMS * 16}


# -- what each mode times ---------------------------------------------------------------------------

@pytest.mark.parametrize("align", [None, 16])
def test_call_mode_times_the_whole_call(align):
    """Every dispatch is uncached: a metadata pass and a host wait each (3 timed + the verification run)."""
    name = "dispatch_with_permute" if align else "dispatch"
    for rec in run_point(scenario(2, align=align), mode="call"):
        assert clean(rec), rec.problem
        assert rec.trace.calls == [name, "combine_with_unpermute" if align else "combine"] * 4
        assert rec.trace.preprocess == rec.trace.host_waits == 4


@pytest.mark.parametrize("align", [None, 16])
def test_kernel_mode_times_the_cached_calls(align):
    """Kernel mode: one uncached call per input set before the timed loop (the metadata pass and the
    host wait there); every timed dispatch and the verification run's go through that set's handle,
    with no metadata pass and no host wait; combine is the library call on rows already weighted."""
    name = "dispatch_with_permute" if align else "dispatch"
    combine = "combine_with_unpermute" if align else "combine"
    for rec in run_point(scenario(2, align=align), mode="kernel"):
        assert clean(rec), rec.problem
        assert rec.trace.calls == [name] * 2 + [f"{name}(handle)", combine] * 4  # 2 sets; 3 timed + 1
        assert rec.trace.preprocess == rec.trace.host_waits == 2


def test_mode_selection():
    s = scenario(1)
    trace = Trace()

    def fn(rank: int, state: FakeWorld):
        be = make_backend(s, rank, state, trace)
        assert HybridEPBackend.call_modes == ("call", "kernel") and HybridEPBackend.uses_sms
        assert call_modes_of(be, ("call", "kernel")) == ("call", "kernel")
        assert not be.reuses_layout and not be.kernel  # a new backend is called as a model calls it
        be.use_call_mode("kernel")
        assert be.reuses_layout  # the driver's input sets then keep the routing
        x = make_tokens(s.model.tokens_per_rank, s.model.hidden, 1, 0, 0, CPU)
        inp = dispatch_input(x, route_all(s)[0], "bf16", CPU)
        with pytest.raises(RuntimeError, match="prepare_input never saw"):
            be.dispatch(inp, 8)
        be.prepare_input(inp, 8)
        with pytest.raises(ValueError, match="the handle holds 8 blocks"):
            be.dispatch(inp, 16)
        be.use_call_mode("call")  # forgets the layouts
        assert not be.reuses_layout and not be._layouts
        with pytest.raises(ValueError, match="no call mode"):
            be.use_call_mode("fastest")
        be.close()

    run_ranks(1, fn)


# -- a fake that mis-handles the cached handle is caught ------------------------------------------

@pytest.mark.parametrize("align", [None, 16])
@pytest.mark.parametrize("fault", ["cached_stale_rows", "cached_swapped_rows"])
def test_a_fake_that_mishandles_the_cached_handle_is_caught(fault, align):
    """Only the calls with a handle misbehave: call mode verifies clean, kernel mode does not. Stale
    rows (what the layout call moved) pass the last timed call's check, whose set kept its values,
    and are caught by the verification run's fresh values; swapped rows by both."""
    s = scenario(2, align=align)
    assert all(clean(r) for r in run_point(s, mode="call", fault=fault))
    recs = run_point(s, mode="kernel", fault=fault)
    assert all(r.wrong["dispatch"] > 0 for r in recs), [r.problem for r in recs]
    where = "verification run" if fault == "cached_stale_rows" else "last timed call"
    assert all(where in r.problem["dispatch"] for r in recs), [r.problem for r in recs]


# -- the SM sweep ---------------------------------------------------------------------------------

@pytest.mark.parametrize("mode", ["call", "kernel"])
@pytest.mark.parametrize("align", [None, 16])
def test_each_point_runs_and_records_its_sm_count(mode, align):
    """One backend object through points at 8, then 16 blocks: every dispatch and combine kernel of a
    point ran with its count (the metadata kernel keeps the library's own grid), and each point's
    rows record it."""
    s = scenario(2, align=align)
    for recs in run_points(s, mode=mode, sms=(8, 16)):
        for sms, rec in zip((8, 16), recs):
            assert clean(rec), rec.problem
            assert rec.config["num_sms_dispatch"] == rec.config["num_sms_combine"] == sms
            ran = {(k, b) for k, b in rec.trace.blocks if k in ("dispatch", "combine")}
            assert ran == {("dispatch", sms), ("combine", sms)}
            assert {b for k, b in rec.trace.blocks if k == "preprocessing"} == {PREPROCESSING_BLOCKS}


def test_rows_record_what_ran_not_what_was_asked():
    """A library that ignored the written counts: the rows say so (24, its default), from the handle's config."""
    for recs in run_points(scenario(2), sms=(8,), fault="sms_fixed"):
        rec = recs[0]
        assert clean(rec), rec.problem
        assert rec.config["num_sms_dispatch"] == rec.config["num_sms_combine"] == DEFAULT_BLOCKS


def test_sm_count_bounds():
    s = scenario(1)

    def fn(rank: int, state: FakeWorld):
        be = make_backend(s, rank, state, Trace())
        be.max_sms = 16  # as read from the GPU on CUDA
        x = make_tokens(s.model.tokens_per_rank, s.model.hidden, 1, 0, 0, CPU)
        inp = dispatch_input(x, route_all(s)[0], "bf16", CPU)
        for bad in (0, 17):
            with pytest.raises(ValueError, match="blocks per kernel"):
                be.dispatch(inp, bad)
        assert be.dispatch(inp, 16).num_recv > 0
        be.close()

    run_ranks(1, fn)


# -- expert_major details -------------------------------------------------------------------------

def test_expert_major_combine_needs_its_third_rounding(monkeypatch):
    """Why the backend declares three roundings: allowed only epbench's usual two, some token of this
    fake (error up to 2.2 x 2^-8) is counted wrong; rank_major stays at two."""
    s = scenario(2, "bf16", 256, align=16)
    assert all(clean(r) for r in run_point(s))
    monkeypatch.setattr(HybridEPBackend, "combine_roundings", lambda self: 2)
    recs = run_point(s)
    assert all(r.wrong["dispatch"] == 0 for r in recs)
    assert sum(r.wrong["combine"] for r in recs) > 0
    monkeypatch.undo()
    be = HybridEPBackend.__new__(HybridEPBackend)
    be.expert_major, be.kernel = False, True
    assert be.combine_roundings() == 2
    be.kernel = False  # call mode weighs in one bf16 pass: one rounding more
    assert be.combine_roundings() == 3
    be.expert_major = True
    assert be.combine_roundings() == 4


def test_expert_major_segments_are_the_librarys_padded_ones():
    """Counts, offsets and slots come from the library's outputs: an expert with no rows takes no
    padding (unlike torch's 2d all-to-all), so the table matches epbench's layout as it is."""
    s = scenario(2, "bf16", 256, topk=1, experts=4, tokens=6, align=16)
    routings = route_all(s)

    def fn(rank: int, state: FakeWorld):
        be = make_backend(s, rank, state, Trace())
        x = make_tokens(routings[rank].num_tokens, s.model.hidden, s.routing.seed, rank, 0, CPU)
        out = be.dispatch(dispatch_input(x, routings[rank], "bf16", CPU), 8)
        em = out.expert_major
        return em.counts.tolist(), em.offsets.tolist(), int(em.num_slots), out.x.shape[0]

    tables = run_ranks(s.world, fn)
    for counts, offsets, slots, rows in tables:
        padded = [(c + 15) // 16 * 16 for c in counts]
        assert offsets == [sum(padded[:e]) for e in range(len(counts))]
        assert slots == rows == sum(padded)
    assert any(0 in counts for counts, *_ in tables)  # the case this test is about occurs


# -- faults in the library's outputs --------------------------------------------------------------

@pytest.mark.parametrize("mode", ["call", "kernel"])
@pytest.mark.parametrize("align", [None, 16])
def test_driver_fault_injection_is_caught(align, mode):
    s = scenario(2, align=align)
    assert all(r.wrong["dispatch"] == 1 for r in run_point(s, inject="dispatch", mode=mode))
    assert all(r.wrong["combine"] == 1 for r in run_point(s, inject="combine", mode=mode))


def test_a_wrong_expert_or_weight_in_the_librarys_output_is_caught(monkeypatch):
    """The library's map or probabilities corrupted on their way out: verify must see it."""
    s = scenario(2)
    real = fake_buffer_class

    def corrupting(world_state, trace, fault=None):
        cls = real(world_state, trace, fault)

        class Corrupt(cls):
            def dispatch(self, *a, **k):
                x, probs, scales, handle = super().dispatch(*a, **k)
                if self.rank == 0:
                    handle[4][0] = ~handle[4][0]  # row 0's set of local experts
                else:
                    probs[0] = probs[0] * 0.5  # row 0's weights (combine sees them too)
                return x, probs, scales, handle

        return Corrupt

    monkeypatch.setattr(sys.modules[__name__], "fake_buffer_class", corrupting)
    r0, r1 = run_point(s)
    assert r0.wrong["dispatch"] >= 1 and "expert ids differ" in r0.problem["dispatch"]
    assert r1.wrong["dispatch"] >= 1 and "weights differ" in r1.problem["dispatch"]
    assert r1.wrong["combine"] >= 1 or r0.wrong["combine"] >= 1  # a halved weight reaches a token


def test_a_wrong_slot_probability_or_padded_count_is_caught(monkeypatch):
    """expert_major: a permuted probability or the padded counts corrupted on their way out."""
    s = scenario(2, align=16)
    real = fake_buffer_class

    def corrupting(world_state, trace, fault=None):
        cls = real(world_state, trace, fault)

        class Corrupt(cls):
            def dispatch_with_permute(self, **k):
                x, probs, scales, padded, handle = super().dispatch_with_permute(**k)
                if self.rank == 0:
                    padded = padded.clone()
                    padded[0] += 16  # the library's padded count: every later offset moves
                else:
                    probs[int(handle[6][0][handle[6][0] >= 0][0])] *= 0.5  # row 0's first expert
                return x, probs, scales, padded, handle

        return Corrupt

    monkeypatch.setattr(sys.modules[__name__], "fake_buffer_class", corrupting)
    r0, r1 = run_point(s)
    assert r0.wrong["dispatch"] >= 1 and "segment offsets" in r0.problem["dispatch"]
    assert r1.wrong["dispatch"] >= 1 and "weights differ" in r1.problem["dispatch"]
    assert r0.wrong["combine"] + r1.wrong["combine"] >= 1  # the halved weight reaches a token


def test_registered_and_limits():
    assert "hybrid-ep" in REGISTRY
    assert HybridEPBackend.routing_as_map
    assert "hidden % 512" in limits_reason(7168 + 128, "fp8", "cuda")
    assert limits_reason(7168, "fp8", "cuda") is None
    assert "hidden % 16" in limits_reason(7176, "bf16", "cuda")
    assert limits_reason(7168, "bf16", "cuda") is None
    assert limits_reason(7168, "bf16", "cpu") == "needs CUDA GPUs"
