"""deepep-v2 against a fake ``deep_ep.ElasticBuffer`` at world 1 (one process, no group needed):
the fake follows V2's documented semantics (deep_ep/buffers/elastic.py, tests/elastic/test_ep.py):
received rows in an order of its own (here reversed) with ``recv_src_metadata[:, 0]`` = source
rank * num_max_tokens_per_rank + token, local expert ids, per-expert counts as a host list, and a
combine that sums copies without weights. Also the launch pre-checks."""

import types

import torch

from epbench.backends import REGISTRY
from epbench.backends import deepep_v2
from epbench.backends.base import DispatchInput, RankSetup
from epbench.inputs import expert_output
from epbench.verify import check_combine, check_dispatch


class FakeHandle:
    pass


class FakeElasticBuffer:
    def __init__(self, group, num_max_tokens_per_rank=0, hidden=0, num_topk=0, use_fp8_dispatch=False):
        self.tmax = num_max_tokens_per_rank

    def dispatch(self, x, topk_idx, topk_weights, num_experts, num_max_tokens_per_rank,
                 expert_alignment, num_sms, do_cpu_sync):
        t = topk_idx.shape[0]
        perm = torch.arange(t - 1, -1, -1)  # V2 promises no order
        h = FakeHandle()
        h.num_recv_tokens = t
        h.recv_src_metadata = torch.stack([perm, perm], dim=1).to(torch.int32)  # rank 0: key = token
        h.num_recv_tokens_per_expert_list = torch.bincount(topk_idx.flatten(), minlength=num_experts).tolist()
        h.perm = perm
        return x[perm], topk_idx[perm], topk_weights[perm], h, None

    def combine(self, y, handle, num_sms=0):
        out = torch.zeros(y.shape, dtype=torch.float32)
        out[handle.perm] = y.float()
        return out.to(torch.bfloat16), None, None


def make_backend(monkeypatch, t=6, hidden=64, experts=4, topk=2):
    fake = types.SimpleNamespace(ElasticBuffer=FakeElasticBuffer)
    monkeypatch.setattr(deepep_v2, "_import_deep_ep", lambda: fake)
    setup = RankSetup(rank=0, world=1, gpus_per_node=1, device=torch.device("cpu"), hidden=hidden,
                      max_tokens_per_rank=t, topk=topk, experts_per_rank=experts, dispatch_dtype="bf16")
    be = deepep_v2.DeepEPV2Backend(setup, group=object())
    g = torch.Generator().manual_seed(0)
    idx = torch.stack([torch.randperm(experts, generator=g)[:topk] for _ in range(t)])
    inp = DispatchInput(torch.randn(t, hidden, generator=g).to(torch.bfloat16), None, idx,
                        torch.rand(t, topk, generator=g))
    return be, inp


def test_registered():
    assert REGISTRY["deepep-v2"].endswith(":DeepEPV2Backend")


def test_verified_call_is_reordered_and_passes_the_checks(monkeypatch):
    be, inp = make_backend(monkeypatch)
    be.poison()  # the driver poisons before the verified call
    out = be.dispatch(inp, 8)
    assert check_dispatch(out, 0, 1, 4, lambda s: inp, local_expert_ids=True).wrong == 0
    be.combine_input(out).copy_(expert_output(out.x[: out.num_recv], None, 0))
    assert check_combine(be.combine(out, 8), inp, 1, 4).wrong == 0


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


def test_order_key():
    assert deepep_v2.sort_key_order(torch.tensor([7, 0, 3])).tolist() == [1, 2, 0]
