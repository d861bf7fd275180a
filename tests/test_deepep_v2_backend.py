"""deepep-v2 against a fake ``deep_ep.ElasticBuffer`` at world 1 (one process, no group needed):
the fake follows V2's documented semantics (deep_ep/buffers/elastic.py, tests/elastic/test_ep.py):
received rows in an order of its own (here reversed) with ``recv_src_metadata[:, 0]`` = source
rank * num_max_tokens_per_rank + token, local expert ids, per-expert counts (padded to
``expert_alignment``) as a host list, and a combine that sums copies without weights. With
``do_expand`` (expert_major) the fake builds V2's expanding layout as dispatch_copy_epilogue.cuh does:
a slot per (token, local expert) from one counter per expert starting at the expert's padded offset,
so rows land in arrival order (here the reversed one); the slots in ``recv_src_metadata[:, 2:]``, one
weight per slot, ``psum_num_recv_tokens_per_expert`` = start + rows, the unpadded rows in
``num_unaligned_recv_tokens_per_expert``, padding left as garbage (NaN bytes); its combine sums each
token's slots. Also the launch pre-checks."""

import types

import pytest

import torch

from epbench.backends import REGISTRY
from epbench.backends import deepep_v2
from epbench.backends.base import DispatchInput, RankSetup
from epbench.inputs import expert_output, quantize
from epbench.layout import ExpertMajor
from epbench.verify import check_combine, check_dispatch, check_ll_combine, em_expert_output


class FakeHandle:
    pass


def garbage(rows, like):
    """NaN bytes of ``like``'s dtype and row shape: what V2 leaves in padding it does not zero."""
    shape = (rows,) + tuple(like.shape[1:])
    n = torch.Size(shape).numel() * like.element_size()
    return torch.full((n,), 0xFF, dtype=torch.uint8).view(like.dtype).view(shape)


def expand(h, x, sf, topk_idx, topk_weights, num_experts, align, perm):
    """V2's expanding layout at world 1 (every expert local): received row r is token perm[r]."""
    t, k = topk_idx.shape
    counts = torch.bincount(topk_idx.flatten(), minlength=num_experts)
    padded = (counts + align - 1) // align * align
    nxt = torch.cumsum(padded, 0) - padded  # the per-expert counters, from each segment's start
    total = int(padded.sum())
    slots = torch.full((t, k), -1, dtype=torch.int32)
    rx, rw = garbage(total, x), garbage(total, topk_weights[:, :1]).flatten()
    rsf = garbage(total, sf) if sf is not None else None
    for r, tok in enumerate(perm.tolist()):
        for j in range(k):
            e = int(topk_idx[tok, j])
            slot = int(nxt[e])
            nxt[e] += 1
            slots[r, j] = slot
            rx[slot], rw[slot] = x[tok], topk_weights[tok, j]
            if sf is not None:
                rsf[slot] = sf[tok]
    h.recv_src_metadata[:, 2:] = slots
    h.psum_num_recv_tokens_per_expert = nxt.to(torch.int32)  # after the counters: start + rows
    h.num_unaligned_recv_tokens_per_expert = counts.to(torch.int32)
    h.num_expanded_tokens = total
    return (rx, rsf) if sf is not None else rx, None, rw


class FakeElasticBuffer:
    """V2's signatures at the pinned commit (deep_ep/buffers/elastic.py) and the checks its C++
    side makes on the arguments (csrc/elastic/buffer.hpp)."""

    destroyed = 0

    def __init__(self, group, num_bytes=None, num_cpu_bytes=0, num_max_tokens_per_rank=0, hidden=0,
                 num_topk=0, use_fp8_dispatch=False, deterministic=False, allow_hybrid_mode=True,
                 allow_multiple_reduction=True, prefer_overlap_with_compute=True, sl_idx=3,
                 num_allocated_qps=0, num_cpu_timeout_secs=300, num_gpu_timeout_secs=100,
                 explicitly_destroy=False):
        self.tmax, self.explicitly_destroy = num_max_tokens_per_rank, explicitly_destroy

    def dispatch(self, x, topk_idx=None, topk_weights=None, cumulative_local_expert_recv_stats=None,
                 num_experts=None, num_max_tokens_per_rank=None, expert_alignment=None, num_sms=0,
                 num_qps=0, previous_event=None, previous_event_before_epilogue=None,
                 async_with_compute_stream=False, allocate_on_comm_stream=False, handle=None,
                 do_handle_copy=True, do_cpu_sync=None, do_expand=False, do_zero_padding=False,
                 use_tma_aligned_col_major_sf=False):
        x, sf = x if isinstance(x, tuple) else (x, None)
        t = topk_idx.shape[0]
        assert num_sms > 0 and t <= num_max_tokens_per_rank and x.is_contiguous()
        assert not do_zero_padding or do_expand
        assert not use_tma_aligned_col_major_sf  # the adapter reads row-major scales
        assert topk_idx.dtype == FAKE_TOPK_IDX_T and topk_weights.dtype == torch.float32
        if sf is not None:
            assert sf.element_size() == 4 and sf.shape[0] == t  # FP32 or packed UE8M0 x 4
        perm = torch.arange(t - 1, -1, -1)  # V2 promises no order
        h = FakeHandle()
        h.num_recv_tokens = t
        key = perm.to(torch.int32)  # rank 0: source rank * num_max_tokens_per_rank + token
        h.recv_src_metadata = torch.cat([key[:, None], key[:, None], topk_idx[perm].to(torch.int32)], dim=1)
        counts = torch.bincount(topk_idx.flatten(), minlength=num_experts)
        h.num_recv_tokens_per_expert_list = ((counts + expert_alignment - 1) // expert_alignment
                                             * expert_alignment).tolist()
        h.perm, h.do_expand = perm, do_expand
        if do_expand:
            recv_x, recv_idx, recv_w = expand(h, x, sf, topk_idx, topk_weights, num_experts,
                                              expert_alignment, perm)
            return recv_x, recv_idx, recv_w, h, None
        recv_x = (x[perm], sf[perm]) if sf is not None else x[perm]
        return recv_x, topk_idx[perm], topk_weights[perm], h, None

    def combine(self, x, handle, topk_weights=None, bias=None, num_sms=0, num_qps=0,
                previous_event=None, previous_event_before_epilogue=None,
                async_with_compute_stream=False, allocate_on_comm_stream=False):
        assert x.dtype == torch.bfloat16 and x.is_contiguous()
        if handle.do_expand:  # each token's slots summed, no weights applied
            slots = handle.recv_src_metadata[:, 2:].to(torch.int64)
            out = torch.zeros(handle.perm.numel(), x.shape[1], dtype=torch.float32)
            for r, tok in enumerate(handle.perm.tolist()):
                for slot in slots[r][slots[r] >= 0].tolist():
                    out[tok] += x[slot].float()
            return out.to(torch.bfloat16), None, None
        out = torch.zeros(x.shape, dtype=torch.float32)
        out[handle.perm] = x.float()  # the copies summed, no weights applied
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
def test_verified_call_is_reordered_and_passes_the_checks(monkeypatch, dtype):
    be, inp = make_backend(monkeypatch, dtype=dtype)
    be.poison()  # the driver poisons before the verified call
    out = be.dispatch(inp, 8)
    if dtype == "mxfp8":  # the packs come back as epbench's one byte per 32 values
        assert out.x_scales.dtype == torch.uint8 and out.x_scales.shape == inp.x_scales.shape
    assert check_dispatch(out, 0, 1, 4, lambda s: inp, local_expert_ids=True).wrong == 0
    be.combine_input(out).copy_(expert_output(out.x[: out.num_recv], out.x_scales, 0))
    assert check_combine(be.combine(out, 8), inp, 1, 4).wrong == 0
    before = FakeElasticBuffer.destroyed
    be.close()
    assert FakeElasticBuffer.destroyed == before + 1


def test_timed_calls_keep_v2_order_and_still_combine_right(monkeypatch):
    be, inp = make_backend(monkeypatch)
    out = be.dispatch(inp, 8)  # no poison: V2's own (reversed) order
    assert torch.equal(out.x[0], inp.x[-1])
    assert check_dispatch(out, 0, 1, 4, lambda s: inp, local_expert_ids=True).wrong > 0
    be.combine_input(out).copy_(expert_output(out.x[: out.num_recv], None, 0))
    assert check_combine(be.combine(out, 8), inp, 1, 4).wrong == 0


def test_limits():
    ok = deepep_v2.limits_reason(2, 7168, "bf16", "2.11.0+cu130", (2, 30, 4))
    assert ok is None
    assert "NCCL >= 2.30.4" in deepep_v2.limits_reason(2, 7168, "bf16", "2.11.0+cu130", (2, 28, 9))
    assert "torch >= 2.10" in deepep_v2.limits_reason(2, 7168, "bf16", "2.9.1", (2, 30, 4))
    assert "hidden % 128" in deepep_v2.limits_reason(2, 7000, "fp8", "2.11.0", (2, 31, 0))
    assert "hidden % 128" in deepep_v2.limits_reason(2, 7072, "mxfp8", "2.11.0", (2, 31, 0))
    shared = deepep_v2.limits_reason(2, 7168, "bf16", "2.11.0", (2, 32, 3), ranks_per_gpu=2)
    assert shared.startswith("needs 2 GPUs, one per rank") and "\n" not in shared


def test_order_key():
    assert deepep_v2.sort_key_order(torch.tensor([7, 0, 3])).tolist() == [1, 2, 0]


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
def test_expert_major_verified_call_passes_the_checks(monkeypatch, dtype, align):
    be, inp = em_backend(monkeypatch, dtype, align)
    be.poison()
    out = be.dispatch(inp, 8)
    table = out.expert_major
    assert table.counts.tolist() == [4, 2, 0, 3, 3]
    assert table.offsets.tolist() == [0, 4, 4 + -(-2 // align) * align, 4 + -(-2 // align) * align,
                                      4 + -(-2 // align) * align + -(-3 // align) * align]
    assert int(table.num_slots) == out.x.shape[0]
    assert check_dispatch(out, 0, 1, 5, lambda s: inp, local_expert_ids=True).wrong == 0
    assert check_ll_combine(em_combine(be, out), inp).wrong == 0


def test_expert_major_timed_call_keeps_v2_order_and_still_combines_right(monkeypatch):
    be, inp = em_backend(monkeypatch)
    out = be.dispatch(inp, 8)  # no poison: V2's arrival order within segments, V2's per-slot form
    assert torch.equal(out.x[0], inp.x[3])  # expert 0's last token arrived first
    assert out.topk_weights.dim() == 1  # one weight per slot, as V2 returns it
    assert check_dispatch(out, 0, 1, 5, lambda s: inp, local_expert_ids=True).wrong > 0
    assert check_ll_combine(em_combine(be, out), inp).wrong == 0


def test_expert_major_misplaced_row_is_caught(monkeypatch):
    """The relabelling follows V2's slots: a row V2 put in the wrong segment stays wrong."""
    be, inp = em_backend(monkeypatch)
    real = FakeElasticBuffer.dispatch

    def swapped(self, x, **kw):
        recv_x, idx, w, h, ev = real(self, x, **kw)
        s = h.recv_src_metadata[:, 2:]
        a, b = s[0, 0].item(), s[0, 1].item()  # one token's two slots, two segments: swap the names
        s[0, 0], s[0, 1] = b, a
        return recv_x, idx, w, h, ev

    monkeypatch.setattr(FakeElasticBuffer, "dispatch", swapped)
    be.poison()
    out = be.dispatch(inp, 8)
    assert check_dispatch(out, 0, 1, 5, lambda s: inp, local_expert_ids=True).wrong > 0


def test_segment_order_sorts_within_segments_only():
    table = ExpertMajor(torch.tensor([2, 1]), torch.tensor([0, 4]), 8, 4)
    slots = torch.tensor([[1, 4], [0, -1]])  # row 0 (key 9): slots 1 and 4; row 1 (key 3): slot 0
    order = deepep_v2.segment_order(slots, torch.tensor([9, 3]), table, 8)
    assert order.tolist() == [0, 1, 2, 3, 4, 5, 6, 7]  # already sorted: nothing moves
    order = deepep_v2.segment_order(slots, torch.tensor([3, 9]), table, 8)
    assert order.tolist() == [1, 0, 2, 3, 4, 5, 6, 7]  # segment 0 swapped, padding and segment 1 stay
