"""deepep-v2 against a fake ``deep_ep.ElasticBuffer`` at worlds 1-4 (ranks are threads of one
process, as in tests/test_symm_mem_backend.py): the fake follows V2's documented semantics
(deep_ep/buffers/elastic.py, tests/elastic/test_ep.py): each rank receives the tokens of every
source that picked one of its experts, in an order of its own (here the reverse of (source,
token)) with ``recv_src_metadata[:, 0]`` = source rank * num_max_tokens_per_rank + token, local
expert ids (-1 for other ranks' experts, whose weights stay as sent: V2's own test masks them), per-expert counts (padded to
``expert_alignment``) as a host list, and a combine that sums a token's copies without weights.
With ``do_expand`` (expert_major) the fake builds V2's expanding layout as
dispatch_copy_epilogue.cuh does: a slot per (received token, local expert) from one counter per
expert starting at the expert's padded offset, so rows land in arrival order; the slots in
``recv_src_metadata[:, 2:]`` (-1 where the expert is elsewhere), one weight per slot,
``psum_num_recv_tokens_per_expert`` = start + rows, the unpadded rows in
``num_unaligned_recv_tokens_per_expert``, padding left as garbage (NaN bytes); its combine sums
each token's slots. A dispatch with ``handle=`` (the cached path, deep_ep/buffers/elastic.py and
csrc/elastic/buffer.hpp) takes no ``topk_idx`` and no host sync, routes by the handle's own copy of
the top-k ids, puts the rows in the slots the handle recorded (same order, same expanded slots; the
handle's metadata is not rewritten), returns the received local ids unless expanding, weights only
when given, and the handle itself. Every output is a fresh NaN-filled buffer, so nothing stale can
pass. Also the launch pre-checks."""

import os
import sys
import types
from typing import Any, List, Optional

import pytest

import torch

from epbench import options
from epbench.backends import REGISTRY
from epbench.backends import deepep_v2
from epbench.contract import DispatchInput, RankSetup
from epbench.driver import Point, PointRecord, measure_point
from epbench.inputs import expert_output, quantize
from epbench.layout import ExpertMajor, segment_sort
from epbench.routing import route_all
from epbench.scenario import parse
from epbench.verify import check_combine, check_dispatch, check_ll_combine, em_expert_output
from support import scenario_dict
from test_symm_mem_backend import FakeWorld, ThreadComm, run_ranks


class FakeHandle:
    pass


class FakeGroup:
    """What the fake buffer gets instead of a process group: the threads' shared world."""

    def __init__(self, state: Optional[FakeWorld], rank: int) -> None:
        self.state, self.rank = state, rank


def garbage(rows, like):
    """NaN bytes of ``like``'s dtype and row shape: what V2 leaves in buffers it does not write."""
    shape = (rows,) + tuple(like.shape[1:])
    n = torch.Size(shape).numel() * like.element_size()
    return torch.full((n,), 0xFF, dtype=torch.uint8).view(like.dtype).view(shape)


def expand(h, rows, x, sf, local_idx, weights, experts, align):
    """V2's expanding layout: received row r (source row ``rows[r]``) gets a slot per local expert
    of its top-k, from one counter per expert starting at the expert's padded offset."""
    k = local_idx.shape[1]
    counts = torch.bincount(local_idx[local_idx >= 0].flatten(), minlength=experts)
    padded = (counts + align - 1) // align * align
    nxt = torch.cumsum(padded, 0) - padded
    total = int(padded.sum())
    slots = torch.full((len(rows), k), -1, dtype=torch.int32)
    rx, rw = garbage(total, x), garbage(total, weights[:, :1]).flatten()
    rsf = garbage(total, sf) if sf is not None else None
    for r in range(len(rows)):
        for j in range(k):
            e = int(local_idx[r, j])
            if e < 0:
                continue
            slot = int(nxt[e])
            nxt[e] += 1
            slots[r, j] = slot
            rx[slot], rw[slot] = x[r], weights[r, j]
            if sf is not None:
                rsf[slot] = sf[r]
    h.recv_src_metadata[:, 2:] = slots
    h.psum_num_recv_tokens_per_expert = nxt.to(torch.int32)  # after the counters: start + rows
    h.num_unaligned_recv_tokens_per_expert = counts.to(torch.int32)
    h.num_expanded_tokens = total
    return (rx, rsf) if sf is not None else rx, None, rw


class FakeElasticBuffer:
    """V2's signatures at the pinned commit (deep_ep/buffers/elastic.py) and the checks its C++
    side makes on the arguments (csrc/elastic/buffer.hpp). ``cached_fault`` makes the cached path
    misbehave: "stale" returns the rows its handle's full dispatch received (the values of then),
    "reorder" puts the rows in an order of its own instead of the handle's slots."""

    destroyed = 0
    cached_fault: Optional[str] = None
    calls = {"full": 0, "cached": 0}

    def __init__(self, group, num_bytes=None, num_cpu_bytes=0, num_max_tokens_per_rank=0, hidden=0,
                 num_topk=0, use_fp8_dispatch=False, deterministic=False, allow_hybrid_mode=True,
                 allow_multiple_reduction=True, prefer_overlap_with_compute=True, sl_idx=3,
                 num_allocated_qps=0, num_cpu_timeout_secs=300, num_gpu_timeout_secs=100,
                 explicitly_destroy=False):
        self.tmax, self.explicitly_destroy = num_max_tokens_per_rank, explicitly_destroy
        self.prefer_overlap_with_compute = prefer_overlap_with_compute
        fake = group if isinstance(group, FakeGroup) else FakeGroup(None, 0)
        self.state, self.rank = fake.state, fake.rank
        self.world = fake.state.world if fake.state is not None else 1

    def _collective(self, args: Any, compute) -> None:
        if self.state is None:
            compute([args])
        else:
            self.state.collective(self.rank, args, compute)

    def dispatch(self, x, topk_idx=None, topk_weights=None, cumulative_local_expert_recv_stats=None,
                 num_experts=None, num_max_tokens_per_rank=None, expert_alignment=None, num_sms=0,
                 num_qps=0, previous_event=None, previous_event_before_epilogue=None,
                 async_with_compute_stream=False, allocate_on_comm_stream=False, handle=None,
                 do_handle_copy=True, do_cpu_sync=None, do_expand=False, do_zero_padding=False,
                 use_tma_aligned_col_major_sf=False):
        x, sf = x if isinstance(x, tuple) else (x, None)
        assert num_sms > 0 and x.is_contiguous()
        assert not do_zero_padding or do_expand
        assert not use_tma_aligned_col_major_sf  # the adapter reads row-major scales
        if handle is not None:
            return self._cached(x, sf, topk_weights, num_experts, num_max_tokens_per_rank, expert_alignment,
                                handle, do_cpu_sync, do_expand, do_zero_padding)
        FakeElasticBuffer.calls["full"] += 1
        t = topk_idx.shape[0]
        assert t <= num_max_tokens_per_rank
        assert topk_idx.dtype == FAKE_TOPK_IDX_T and topk_weights.dtype == torch.float32
        if sf is not None:
            assert sf.element_size() == 4 and sf.shape[0] == t  # FP32 or packed UE8M0 x 4
        e = num_experts // self.world
        got: List[Any] = []

        def compute(posted):  # this rank's rows: every source's tokens that picked one of its experts
            rows = [(src, tok) for src, (_, _, idx, _) in enumerate(posted)
                    for tok in range(idx.shape[0]) if bool((idx[tok] // e == self.rank).any())]
            rows.reverse()  # V2 promises no order
            got.extend([rows, [p[0] for p in posted], [p[1] for p in posted], [p[2] for p in posted],
                        [p[3] for p in posted]])

        self._collective((x, sf, topk_idx, topk_weights), compute)
        rows, xs, sfs, idxs, ws = got
        n = len(rows)
        pick = lambda ts: torch.stack([ts[s_][t_] for s_, t_ in rows]) if rows else ts[0][:0]  # noqa: E731
        rx, ridx, rw = pick(xs), pick(idxs), pick(ws)
        rsf = pick(sfs) if sf is not None else None
        local = self._local(ridx, e)
        # the weights of other ranks' experts stay as sent (V2's tests/elastic/test_ep.py masks
        # them out before comparing): only the ids say which positions are this rank's
        h = FakeHandle()
        h.num_recv_tokens = n
        key = torch.tensor([s_ * self.tmax + t_ for s_, t_ in rows], dtype=torch.int32)
        h.recv_src_metadata = torch.cat([key[:, None], key[:, None], local.to(torch.int32)], dim=1)
        counts = torch.bincount(local[local >= 0].flatten(), minlength=e)
        h.num_recv_tokens_per_expert_list = ((counts + expert_alignment - 1) // expert_alignment
                                             * expert_alignment).tolist()
        h.rows, h.do_expand, h.tokens = rows, do_expand, t
        h.topk_idx = topk_idx.clone() if do_handle_copy else topk_idx
        h.num_experts, h.expert_alignment, h.num_max_tokens_per_rank = num_experts, expert_alignment, \
            num_max_tokens_per_rank
        h.num_sms = num_sms
        h.first_rows = (rx.clone(), rsf.clone() if rsf is not None else None)  # what "stale" hands back
        if do_expand:
            recv_x, recv_idx, recv_w = expand(h, rows, rx, rsf, local, rw, e, expert_alignment)
            return recv_x, recv_idx, recv_w, h, None
        out_x = garbage(n, x)
        out_x.copy_(rx)
        return ((out_x, rsf) if sf is not None else out_x), local, rw, h, None

    def _local(self, ids, e):
        mine = ids // e == self.rank
        return torch.where(mine, ids - self.rank * e, torch.full_like(ids, -1))

    def _cached(self, x, sf, topk_weights, num_experts, num_max_tokens_per_rank, expert_alignment, h, do_cpu_sync,
                do_expand, do_zero_padding):
        """The cached path: the handle's routing and slots, this call's payload; no ids given, no
        host sync; the handle comes back as it was."""
        FakeElasticBuffer.calls["cached"] += 1
        assert do_cpu_sync is None or not do_cpu_sync, "Cannot do CPU sync with cached handle"
        given = (num_experts or h.num_experts, expert_alignment or h.expert_alignment,
                 num_max_tokens_per_rank or h.num_max_tokens_per_rank)
        assert given == (h.num_experts, h.expert_alignment, h.num_max_tokens_per_rank)
        assert do_expand == h.do_expand  # V2 reads do_expand from the call, not the handle
        assert x.shape[0] == h.tokens and (sf is None or sf.shape[0] == h.tokens)
        e = h.num_experts // self.world
        got: List[Any] = []

        def compute(posted):  # each source's payload and its handle's ids, picked by this handle's rows
            got.extend([[p[0] for p in posted], [p[1] for p in posted], [p[2] for p in posted],
                        [p[3] for p in posted]])

        self._collective((x, sf, h.topk_idx, topk_weights), compute)
        xs, sfs, idxs, ws = got
        rows = list(h.rows)
        if FakeElasticBuffer.cached_fault == "reorder":
            rows.reverse()
        pick = lambda ts: torch.stack([ts[s_][t_] for s_, t_ in rows]) if rows else ts[0][:0]  # noqa: E731
        rx, rsf = pick(xs), pick(sfs) if sf is not None else None
        if FakeElasticBuffer.cached_fault == "stale":
            rx, rsf = h.first_rows
        local = self._local(pick(idxs), e)
        rw = pick(ws) if topk_weights is not None else None
        if do_expand:
            slots = h.recv_src_metadata[:, 2:].to(torch.int64)
            out_x = garbage(h.num_expanded_tokens, x)
            out_sf = garbage(h.num_expanded_tokens, sf) if sf is not None else None
            out_w = garbage(h.num_expanded_tokens, topk_weights[:, :1]).flatten() if rw is not None else None
            for r in range(len(rows)):
                for j in range(slots.shape[1]):
                    slot = int(slots[r, j])
                    if slot < 0:
                        continue
                    out_x[slot] = rx[r]
                    if out_sf is not None:
                        out_sf[slot] = rsf[r]
                    if out_w is not None:
                        out_w[slot] = rw[r, j]
            if do_zero_padding:
                named = torch.zeros(h.num_expanded_tokens, dtype=torch.bool)
                named[slots[slots >= 0]] = True
                out_x.view(torch.uint8).view(h.num_expanded_tokens, -1)[~named] = 0
            return ((out_x, out_sf) if sf is not None else out_x), None, out_w, h, None
        out_x = garbage(len(rows), x)
        out_x.copy_(rx)
        return ((out_x, rsf) if sf is not None else out_x), local, rw, h, None

    def combine(self, x, handle, topk_weights=None, bias=None, num_sms=0, num_qps=0,
                previous_event=None, previous_event_before_epilogue=None,
                async_with_compute_stream=False, allocate_on_comm_stream=False):
        assert x.dtype == torch.bfloat16 and x.is_contiguous()
        if handle.do_expand:  # each received token's slots summed first, no weights applied
            slots = handle.recv_src_metadata[:, 2:].to(torch.int64)
            per_row = torch.stack([x[sl[sl >= 0]].float().sum(dim=0) for sl in slots]) if len(slots) else \
                torch.zeros(0, x.shape[1])
        else:
            per_row = x[: len(handle.rows)].float()
        out = torch.zeros(handle.tokens, x.shape[1], dtype=torch.float32)

        def compute(posted):  # the copies of each of this rank's tokens, summed, no weights applied
            for rows, y in posted:
                for r, (src, tok) in enumerate(rows):
                    if src == self.rank:
                        out[tok] += y[r]

        self._collective((handle.rows, per_row), compute)
        return out.to(torch.bfloat16), None, None

    def destroy(self):
        assert self.explicitly_destroy
        FakeElasticBuffer.destroyed += 1


FAKE_TOPK_IDX_T = torch.int64


def make_backend(monkeypatch, t=6, hidden=256, experts=4, topk=2, dtype="bf16", layout="rank_major",
                 align=1, idx=None):
    fake = types.SimpleNamespace(ElasticBuffer=FakeElasticBuffer, topk_idx_t=FAKE_TOPK_IDX_T)
    monkeypatch.setattr(deepep_v2, "_import_deep_ep", lambda: fake)
    setup = RankSetup(rank=0, world=1, gpus_per_node=1, device=torch.device("cpu"), hidden=hidden,
                      max_tokens_per_rank=t, topk=topk, experts_per_rank=experts, dispatch_dtype=dtype,
                      layout=layout, align=align)
    be = deepep_v2.DeepEPV2Backend(setup, group=object())
    g = torch.Generator().manual_seed(0)
    if idx is None:
        idx = torch.stack([torch.randperm(experts, generator=g)[:topk] for _ in range(t)]).to(torch.int32)
    x = torch.randn(t, hidden, generator=g).to(torch.bfloat16)
    inp = DispatchInput(*quantize(x, dtype), idx, torch.rand(t, topk, generator=g))
    return be, inp


def test_registered():
    assert REGISTRY["deepep-v2"].endswith(":DeepEPV2Backend")


@pytest.mark.parametrize("dtype", ["bf16", "fp8", "mxfp8"])
def test_every_call_passes_the_checks_in_v2_order(monkeypatch, dtype):
    """No poison, no switch: the call returns V2's own (reversed) order with each row's key, and
    the verification sorts by the key; the same call poisoned first gives the same."""
    be, inp = make_backend(monkeypatch, dtype=dtype)
    for poisoned in (False, True):
        if poisoned:
            be.poison()
        out = be.dispatch(inp, 8)
        assert torch.equal(out.x[0].view(torch.uint8), inp.x[-1].view(torch.uint8))  # V2's order kept
        if dtype == "mxfp8":  # the packs come back as epbench's one byte per 32 values
            assert out.x_scales.dtype == torch.uint8 and out.x_scales.shape == inp.x_scales.shape
        assert check_dispatch(out, 0, 1, 4, lambda s: inp, local_expert_ids=True).wrong == 0
        be.combine_input(out).copy_(expert_output(out.x[: out.num_recv], out.x_scales, 0))
        assert check_combine(be.combine(out, 8), inp, 1, 4).wrong == 0
    before = FakeElasticBuffer.destroyed
    be.close()
    assert FakeElasticBuffer.destroyed == before + 1


def test_without_the_keys_the_rows_are_out_of_order(monkeypatch):
    from dataclasses import replace

    be, inp = make_backend(monkeypatch)
    out = be.dispatch(inp, 8)
    assert check_dispatch(replace(out, row_key=None), 0, 1, 4, lambda s: inp, local_expert_ids=True).wrong > 0


def test_limits():
    ok = deepep_v2.limits_reason(2, 7168, "bf16", "2.11.0+cu130", (2, 30, 4))
    assert ok is None
    assert "NCCL >= 2.30.4" in deepep_v2.limits_reason(2, 7168, "bf16", "2.11.0+cu130", (2, 28, 9))
    assert "torch >= 2.10" in deepep_v2.limits_reason(2, 7168, "bf16", "2.9.1", (2, 30, 4))
    assert "hidden % 128" in deepep_v2.limits_reason(2, 7000, "fp8", "2.11.0", (2, 31, 0))
    assert "hidden % 128" in deepep_v2.limits_reason(2, 7072, "mxfp8", "2.11.0", (2, 31, 0))
    shared = deepep_v2.limits_reason(2, 7168, "bf16", "2.11.0", (2, 32, 3), ranks_per_gpu=2)
    assert shared.startswith("needs 2 GPUs, one per rank") and "\n" not in shared


# expert 2 gets no token (an empty segment takes no slot); expert 0 gets four (two segments' worth at align 2)
EM_IDX = torch.tensor([[0, 3], [1, 0], [3, 0], [0, 4], [4, 1], [3, 4]], dtype=torch.int32)


def em_backend(monkeypatch, dtype="bf16", align=4):
    return make_backend(monkeypatch, experts=5, dtype=dtype, layout="expert_major", align=align, idx=EM_IDX)


def em_combine(be, out):
    """What the driver does: every slot through its segment's stand-in expert, then combine."""
    rows = out.x.shape[0]
    be.combine_input(out).copy_(em_expert_output(out.x[:rows], out.x_scales, out.expert_major, 0))
    return be.combine(out, 8)


@pytest.mark.parametrize("dtype", ["bf16", "fp8", "mxfp8"])
@pytest.mark.parametrize("align", [1, 2, 4])
def test_expert_major_call_passes_the_checks(monkeypatch, dtype, align):
    be, inp = em_backend(monkeypatch, dtype, align)
    out = be.dispatch(inp, 8)  # no poison: V2's arrival order within segments, keys beside
    table = out.expert_major
    assert table.counts.tolist() == [4, 2, 0, 3, 3]
    assert table.offsets.tolist() == [0, 4, 4 + -(-2 // align) * align, 4 + -(-2 // align) * align,
                                      4 + -(-2 // align) * align + -(-3 // align) * align]
    assert int(table.num_slots) == out.x.shape[0]
    assert torch.equal(out.x[0].view(torch.uint8), inp.x[3].view(torch.uint8))  # expert 0's last token arrived first
    assert out.topk_weights.shape == inp.topk_weights.shape  # the routing spelled out per row
    assert check_dispatch(out, 0, 1, 5, lambda s: inp, local_expert_ids=True).wrong == 0
    assert check_ll_combine(em_combine(be, out), inp).wrong == 0


def test_expert_major_misplaced_row_is_caught(monkeypatch):
    """The keys follow V2's slots: a row V2 put in the wrong segment stays wrong."""
    be, inp = em_backend(monkeypatch)
    real = FakeElasticBuffer.dispatch

    def swapped(self, x, **kw):
        recv_x, idx, w, h, ev = real(self, x, **kw)
        s = h.recv_src_metadata[:, 2:]
        r = int((s >= 0).sum(dim=1).argmax())  # a token with two slots, two segments: swap the names
        a, b = [int(v) for v in s[r][s[r] >= 0][:2]]
        cols = (s[r] >= 0).nonzero().flatten()[:2]
        s[r, cols[0]], s[r, cols[1]] = b, a
        return recv_x, idx, w, h, ev

    monkeypatch.setattr(FakeElasticBuffer, "dispatch", swapped)
    out = be.dispatch(inp, 8)
    assert check_dispatch(out, 0, 1, 5, lambda s: inp, local_expert_ids=True).wrong > 0


def test_slot_keys_and_segment_sort():
    table = ExpertMajor(torch.tensor([2, 1]), torch.tensor([0, 4]), 8, 4)
    slots = torch.tensor([[1, 4], [0, -1]])  # row 0: slots 1 and 4; row 1: slot 0
    key = deepep_v2.slot_keys(slots, torch.tensor([9, 3]), 8)
    assert key.tolist() == [3, 9, -1, -1, 9, -1, -1, -1]
    assert segment_sort(key, table).tolist() == [0, 1, 2, 3, 4, 5, 6, 7]  # already sorted: nothing moves
    key = deepep_v2.slot_keys(slots, torch.tensor([3, 9]), 8)
    assert segment_sort(key, table).tolist() == [1, 0, 2, 3, 4, 5, 6, 7]  # segment 0 swapped, padding and segment 1 stay


# -- worlds 2-4 through the driver's own point: timed calls, their check, the verification run --

def v2_scenario(world: int, dtype: str = "bf16", layout: str = "rank_major", align: int = 1):
    model = {"hidden": 256, "tokens_per_rank": 12, "topk": min(4, 3 * world), "experts_per_rank": 3,
             "dispatch_dtype": dtype}
    if layout != "rank_major":
        model.update(layout=layout, align=align)
    return parse(scenario_dict(model=model, topology={"name": "fake", "nodes": 1, "gpus_per_node": world},
                               bench={"backends": ["deepep-v2"], "sms": [4]}), "<test>")


def run_v2_points(monkeypatch, s, inject: Optional[str] = None, mode: str = "call",
                  input_sets: int = 2) -> List[PointRecord]:
    """One point of the driver (warmup 1, 2 timed iterations, then the verification run) on
    every rank; each record's ``config`` is the backend's effective_config() after it, as in
    epbench.driver.measure."""
    fake = types.SimpleNamespace(ElasticBuffer=FakeElasticBuffer, topk_idx_t=FAKE_TOPK_IDX_T)
    monkeypatch.setattr(deepep_v2, "_import_deep_ep", lambda: fake)
    routings = route_all(s)

    def fn(rank: int, symm) -> PointRecord:
        state = symm.world_state
        m = s.model
        setup = RankSetup(rank=rank, world=s.world, gpus_per_node=s.world, device=torch.device("cpu"),
                          hidden=m.hidden, max_tokens_per_rank=m.tokens_per_rank, topk=m.topk,
                          experts_per_rank=m.experts_per_rank, dispatch_dtype=m.dispatch_dtype,
                          layout=m.layout, align=m.align)
        be = deepep_v2.DeepEPV2Backend(setup, group=FakeGroup(state, rank), **s.backend_options.get("deepep-v2", {}))
        be.use_call_mode(mode)
        rec = PointRecord(rank, call_mode=mode)
        measure_point(Point(be, s, routings, 4, ThreadComm(rank, s.world, state.barrier), input_sets=input_sets),
                      1, 2, 3, inject, rec)
        rec.config = be.effective_config()
        be.close()
        return rec

    return run_ranks(s.world, fn)


@pytest.mark.parametrize("world, dtype, layout, align", [(2, "bf16", "rank_major", 1), (3, "fp8", "rank_major", 1),
                                                         (4, "mxfp8", "rank_major", 1), (2, "bf16", "expert_major", 16),
                                                         (4, "fp8", "expert_major", 1)])
def test_worlds_2_to_4_verify_clean(monkeypatch, world, dtype, layout, align):
    for rec in run_v2_points(monkeypatch, v2_scenario(world, dtype, layout, align)):
        assert rec.wrong == {"dispatch": 0, "combine": 0}, rec.problem


def test_worlds_above_1_catch_an_injected_fault(monkeypatch):
    recs = run_v2_points(monkeypatch, v2_scenario(3), inject="dispatch")
    assert all(r.wrong["dispatch"] == 1 and "verification run" in r.problem["dispatch"] for r in recs)


def test_gin_is_off_within_one_node_and_the_rows_say_so(monkeypatch):
    seen = []

    class Watching(FakeElasticBuffer):
        def __init__(self, group, **kw):
            seen.append(os.environ.get("EP_DISABLE_GIN"))
            super().__init__(group, **kw)

    fake = types.SimpleNamespace(ElasticBuffer=Watching, topk_idx_t=FAKE_TOPK_IDX_T)
    monkeypatch.setattr(deepep_v2, "_import_deep_ep", lambda: fake)
    monkeypatch.delenv("EP_DISABLE_GIN", raising=False)
    setup = RankSetup(rank=0, world=4, gpus_per_node=4, device=torch.device("cpu"), hidden=256,
                      max_tokens_per_rank=4, topk=2, experts_per_rank=2, dispatch_dtype="bf16")
    be = deepep_v2.DeepEPV2Backend(setup, group=object())
    assert seen == ["1"] and be.effective_config()["gin"] == "off"
    assert "EP_DISABLE_GIN" not in os.environ  # set for the buffer's construction only
    deepep_v2.DeepEPV2Backend(setup, group=object(), gin="on")
    assert seen[-1] is None
    assert deepep_v2.gin_setting("auto", 16, 8) == "on" and deepep_v2.gin_setting("on", 1, 1) == "off"


def test_expert_major_combine_is_allowed_its_extra_rounding(monkeypatch):
    rank_major, _ = make_backend(monkeypatch)
    em, _ = em_backend(monkeypatch)
    # call mode weighs the rows in one bf16 pass (epbench/backends/weighting.py): one more each
    assert rank_major.combine_roundings() == 3 and em.combine_roundings() == 4
    rank_major.use_call_mode("kernel")
    em.use_call_mode("kernel")
    assert rank_major.combine_roundings() == 2 and em.combine_roundings() == 3


# -- kernel mode: V2's cached handle, timed as its tests/elastic/test_ep.py times it -----------

@pytest.fixture
def count_calls(monkeypatch):
    monkeypatch.setattr(FakeElasticBuffer, "calls", {"full": 0, "cached": 0})
    return FakeElasticBuffer.calls


def test_call_modes_and_the_switch(monkeypatch):
    be, inp = make_backend(monkeypatch)
    assert deepep_v2.DeepEPV2Backend.call_modes == ("call", "kernel")
    assert not be.kernel and not be.reuses_layout
    be.use_call_mode("kernel")
    assert be.kernel and be.reuses_layout  # the driver's input sets then keep the routing
    with pytest.raises(RuntimeError, match="prepare_input never saw"):
        be.dispatch(inp, 8)
    be.use_call_mode("call")
    assert not be.kernel and not be.reuses_layout
    with pytest.raises(ValueError, match="no call mode"):
        be.use_call_mode("fastest")


@pytest.mark.parametrize("world, dtype, layout, align", [
    (1, "bf16", "rank_major", 1), (2, "fp8", "rank_major", 1), (3, "mxfp8", "rank_major", 1),
    (4, "bf16", "rank_major", 1), (1, "fp8", "expert_major", 128), (2, "mxfp8", "expert_major", 16),
    (3, "bf16", "expert_major", 1), (4, "fp8", "expert_major", 16)])
def test_kernel_mode_verifies_clean_through_the_driver(monkeypatch, count_calls, world, dtype, layout, align):
    """One full dispatch per input set before the timed loop; every timed dispatch and the
    verification run's (fresh values in set 0's tensors, same routing) are cached calls."""
    recs = run_v2_points(monkeypatch, v2_scenario(world, dtype, layout, align), mode="kernel")
    for rec in recs:
        assert rec.wrong == {"dispatch": 0, "combine": 0}, rec.problem
    assert count_calls == {"full": 2 * world, "cached": (1 + 2 + 1) * world}


@pytest.mark.parametrize("fault", ["stale", "reorder"])
@pytest.mark.parametrize("layout, align", [("rank_major", 1), ("expert_major", 16)])
def test_kernel_mode_catches_a_mishandled_handle(monkeypatch, fault, layout, align):
    """"stale": the cached call hands back the rows of the full dispatch its handle came from (right
    for the timed calls, whose layout was made from their own values: the verification run's fresh
    values catch it); "reorder": rows in other slots than the handle's (both checks catch it)."""
    monkeypatch.setattr(FakeElasticBuffer, "cached_fault", fault)
    recs = run_v2_points(monkeypatch, v2_scenario(2, "fp8", layout, align), mode="kernel")
    for rec in recs:
        assert rec.wrong["dispatch"] > 0 and "verification run" in rec.problem["dispatch"], (fault, rec.problem)
        if fault == "reorder":
            assert "last timed call" in rec.problem["dispatch"]


def test_kernel_mode_catches_an_injected_fault(monkeypatch):
    recs = run_v2_points(monkeypatch, v2_scenario(3), inject="combine", mode="kernel")
    assert all(r.wrong == {"dispatch": 0, "combine": 1} for r in recs), [r.problem for r in recs]


@pytest.mark.parametrize("layout", ["rank_major", "expert_major"])
def test_kernel_mode_weighs_outside_the_timed_combine(monkeypatch, layout):
    """prepare_combine (untimed) scales the rows; combine then reads only the scaled rows, so the
    expert output can be overwritten after it without changing the result. In call mode the
    scaling is combine's own, and the overwrite shows."""
    make = em_backend if layout == "expert_major" else make_backend
    for mode in ("call", "kernel"):
        be, inp = make(monkeypatch)
        be.use_call_mode(mode)
        inp = be.prepare_input(inp, 8)
        out = be.dispatch(inp, 8)
        rows = out.x.shape[0] if layout == "expert_major" else out.num_recv
        y = (em_expert_output(out.x[:rows], out.x_scales, out.expert_major, 0) if layout == "expert_major"
             else expert_output(out.x[:rows], out.x_scales, 0))
        be.combine_input(out)[:rows].copy_(y)
        be.prepare_combine(out)
        be.combine_input(out).fill_(float("nan"))
        got = be.combine(out, 8)
        check = check_ll_combine(got, inp) if layout == "expert_major" else check_combine(got, inp, 1, 4)
        assert (check.wrong == 0) == (mode == "kernel"), (mode, check.first_problem)


def test_kernel_mode_rows_record_the_options(monkeypatch):
    data = scenario_dict(model={"hidden": 256, "tokens_per_rank": 12, "topk": 4, "experts_per_rank": 3},
                         topology={"name": "fake", "nodes": 1, "gpus_per_node": 2},
                         bench={"backends": ["deepep-v2"], "sms": [4]})
    data["backend_options"] = {"deepep-v2": {"prefer_overlap": "on"}}
    s = parse(data, "<test>")
    built = []

    class Watching(FakeElasticBuffer):
        def __init__(self, group, **kw):
            built.append(kw["prefer_overlap_with_compute"])
            super().__init__(group, **kw)

    monkeypatch.setattr(sys.modules[__name__], "FakeElasticBuffer", Watching)
    recs = run_v2_points(monkeypatch, s, mode="kernel")
    assert built == [True, True]
    assert all(r.config == {"gin": "off", "prefer_overlap": "on"} and r.call_mode == "kernel" for r in recs)
    assert options.resolve("deepep-v2", {}, {})["prefer_overlap"] == "off"  # as V2's own test runs
    be, _ = make_backend(monkeypatch)
    assert be.buffer.prefer_overlap_with_compute is False
