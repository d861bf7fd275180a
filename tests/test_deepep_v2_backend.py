"""deepep-v2 against a fake ``deep_ep.ElasticBuffer`` at world 1 (one process, no group needed):
the fake follows V2's documented semantics (deep_ep/buffers/elastic.py, tests/elastic/test_ep.py):
received rows in an order of its own (here reversed) with ``recv_src_metadata[:, 0]`` = source
rank * num_max_tokens_per_rank + token, local expert ids, per-expert counts as a host list, and a
combine that sums copies without weights. Also the launch pre-checks."""

import types

import pytest

import torch

from epbench.backends import REGISTRY
from epbench.backends import deepep_v2
from epbench.backends.base import DispatchInput, RankSetup
from epbench.inputs import expert_output, quantize
from epbench.verify import check_combine, check_dispatch


class FakeHandle:
    pass


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
        assert topk_idx.dtype == FAKE_TOPK_IDX_T and topk_weights.dtype == torch.float32
        if sf is not None:
            assert sf.element_size() == 4 and sf.shape[0] == t  # FP32 or packed UE8M0 x 4
        perm = torch.arange(t - 1, -1, -1)  # V2 promises no order
        h = FakeHandle()
        h.num_recv_tokens = t
        key = perm.to(torch.int32)  # rank 0: source rank * num_max_tokens_per_rank + token
        h.recv_src_metadata = torch.cat([key[:, None], key[:, None], topk_idx[perm].to(torch.int32)], dim=1)
        h.num_recv_tokens_per_expert_list = torch.bincount(topk_idx.flatten(), minlength=num_experts).tolist()
        h.perm = perm
        recv_x = (x[perm], sf[perm]) if sf is not None else x[perm]
        return recv_x, topk_idx[perm], topk_weights[perm], h, None

    def combine(self, x, handle, topk_weights=None, bias=None, num_sms=0, num_qps=0,
                previous_event=None, previous_event_before_epilogue=None,
                async_with_compute_stream=False, allocate_on_comm_stream=False):
        out = torch.zeros(x.shape, dtype=torch.float32)
        out[handle.perm] = x.float()  # the copies summed, no weights applied
        return out.to(torch.bfloat16), None, None

    def destroy(self):
        assert self.explicitly_destroy
        FakeElasticBuffer.destroyed += 1


FAKE_TOPK_IDX_T = torch.int64


def make_backend(monkeypatch, t=6, hidden=256, experts=4, topk=2, dtype="bf16"):
    fake = types.SimpleNamespace(ElasticBuffer=FakeElasticBuffer, topk_idx_t=FAKE_TOPK_IDX_T)
    monkeypatch.setattr(deepep_v2, "_import_deep_ep", lambda: fake)
    setup = RankSetup(rank=0, world=1, gpus_per_node=1, device=torch.device("cpu"), hidden=hidden,
                      max_tokens_per_rank=t, topk=topk, experts_per_rank=experts, dispatch_dtype=dtype)
    be = deepep_v2.DeepEPV2Backend(setup, group=object())
    g = torch.Generator().manual_seed(0)
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
