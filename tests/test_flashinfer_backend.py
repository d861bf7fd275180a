"""The flashinfer backend against a fake ``MoeAlltoAll`` that implements the semantics FlashInfer
documents (flashinfer/comm/trtllm_moe_alltoall.py, 0.7.2.post1, and its kernels): a token's
payloads land once on each rank holding one of its experts, in that rank's block of the source
(``[world, T_max, *]``), in an order of the senders' choosing (the fake shuffles it), with the ids of
the slots past each source's count set to the invalid id; combine reads back, per token, the rows
of the ranks it went to from their workspace views and sums them in fp32 without weights. Ranks are
threads of one process; the backend is checked through the driver's own time / verify functions."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, List, Optional

import pytest
import torch

from epbench.backends import REGISTRY, backend_class
from epbench.backends.flashinfer_a2a import FlashInferBackend, limits_reason, payload_bytes
from epbench.driver import Point, PointRecord, measure_point
from epbench.routing import route_all
from epbench.scenario import parse
from support import scenario_dict
from test_symm_mem_backend import FakeWorld, ThreadComm
from test_symm_mem_backend import run_ranks as symm_run_ranks, setup_of

GARBAGE = 77  # what the fake leaves in padding slots (the backend must not deliver them)


def slot_order(src: int, dst: int, n: int, call: int) -> torch.Tensor:
    """The slot each of source src's n rows for dst takes: a permutation both sides can compute."""
    g = torch.Generator().manual_seed(1000 * call + 31 * src + dst)
    return torch.randperm(n, generator=g)


def fake_library(state: FakeWorld, calls: List[str], corrupt: Optional[str] = None) -> Any:
    class FakeMoeAlltoAll:
        def __init__(self, mapping, max_num_tokens, top_k, num_experts, workspace_size_per_rank=None,
                     hidden_size=None, mnnvl_config=None) -> None:
            self.rank, self.world = mapping.moe_ep_rank, mapping.moe_ep_size
            self.t_max, self.topk, self.experts = max_num_tokens, top_k, num_experts
            self.per_rank = num_experts // self.world
            assert workspace_size_per_rank > 0 and mnnvl_config.comm_backend.group is not None
            self.calls = 0
            self.ws: Optional[torch.Tensor] = None
            self.phase = "idle"  # the library's phase: a dispatch must be followed by a combine

        def _phase(self, want: str, what: str) -> None:
            # the library asserts the order of its calls (MoeAlltoAll._state.phase)
            assert self.phase == want, what

        def dispatch(self, token_selected_experts, input_payloads, runtime_max_tokens_per_rank,
                     invalid_token_expert_id=None, expert_id_payload_index=None):
            calls.append("dispatch")
            self._phase("idle", "dispatch called twice without combine")
            self.phase = "dispatched"
            ids = token_selected_experts
            assert ids.dtype == torch.int32 and ids.shape[1] == self.topk
            assert runtime_max_tokens_per_rank <= self.t_max and 1 <= len(input_payloads) <= 6
            self.calls += 1
            self.local_tokens = ids.shape[0]
            targets = [(ids.to(torch.int64) // self.per_rank == d).any(dim=1).nonzero().flatten()
                       for d in range(self.world)]
            out: List[torch.Tensor] = []

            def compute(posted):
                for p, pay in enumerate(input_payloads):
                    buf = torch.full((self.world, runtime_max_tokens_per_rank, *pay.shape[1:]), GARBAGE,
                                     dtype=pay.dtype)
                    for s, (pays, tg) in enumerate(posted):
                        rows = tg[self.rank]
                        buf[s, slot_order(s, self.rank, rows.numel(), self.calls)] = pays[p][rows]
                        if p == expert_id_payload_index and invalid_token_expert_id is not None:
                            buf[s, rows.numel():] = invalid_token_expert_id
                    out.append(buf)

            state.collective(self.rank, ([q.clone() for q in input_payloads], targets), compute)
            self.targets = targets  # where each of this rank's tokens went, for combine
            self.ws = torch.full((self.world, runtime_max_tokens_per_rank, 0), 0.0)
            if corrupt == "weights" and self.rank == 0:
                out[expert_id_payload_index + 1][0, 0, 0] *= 0.5
            return out

        def get_combine_payload_tensor_in_workspace(self, runtime_max_tokens_per_rank, hidden_size, dtype):
            self._phase("dispatched", "get_combine_payload_tensor_in_workspace called before successful dispatch")
            self.ws = torch.full((self.world, runtime_max_tokens_per_rank, hidden_size), float("nan"), dtype=dtype)
            return self.ws

        def combine(self, payload, runtime_max_tokens_per_rank, payload_in_workspace=False):
            calls.append("combine")
            self._phase("dispatched", "combine called before successful dispatch")
            self.phase = "idle"
            assert payload_in_workspace and payload is self.ws
            acc = torch.zeros(self.local_tokens, payload.shape[-1])

            def compute(posted):
                for d, ws in enumerate(posted):
                    rows = self.targets[d]
                    slots = slot_order(self.rank, d, rows.numel(), self.calls)
                    acc[rows] += ws[self.rank, slots].float()

            state.collective(self.rank, payload.clone(), compute)
            return acc.to(torch.bfloat16)

        def _reset_workspace(self):
            calls.append("reset")

    class Mapping:
        def __init__(self, world_size, rank, gpus_per_node, tp_size, moe_ep_size):
            assert tp_size == moe_ep_size == world_size
            self.moe_ep_rank, self.moe_ep_size = rank, moe_ep_size

    return SimpleNamespace(MoeAlltoAll=FakeMoeAlltoAll, Mapping=Mapping,
                           workspace_size=lambda world, t, dispatch_bytes, combine_bytes:
                           world * t * (dispatch_bytes + combine_bytes),
                           MnnvlConfig=lambda comm_backend: SimpleNamespace(comm_backend=comm_backend),
                           TorchDistBackend=lambda group: SimpleNamespace(group=group))


def scenario(world: int, dtype: str = "bf16", hidden: int = 256, topk: int = 4, experts: int = 4,
             tokens: int = 24):
    model = {"hidden": hidden, "tokens_per_rank": tokens, "topk": topk, "experts_per_rank": experts,
             "dispatch_dtype": dtype}
    return parse(scenario_dict(model=model, topology={"name": "fake", "nodes": 1, "gpus_per_node": world},
                               bench={"backends": ["flashinfer"], "sms": [4]}), "<test>")


def run_points(s, inject: Optional[str] = None, corrupt: Optional[str] = None, mode: str = "call") -> List[PointRecord]:
    routings = route_all(s)

    def fn(rank: int, state: FakeWorld) -> PointRecord:
        calls: List[str] = []
        comm = ThreadComm(rank, s.world, state.barrier)
        be = FlashInferBackend(setup_of(s, rank), library=fake_library(state, calls, corrupt), group=object())
        be.use_call_mode(mode)
        rec = PointRecord(rank)
        measure_point(Point(be, s, routings, 0, comm, input_sets=2), 1, 2, 3, inject, rec)
        be.close()
        rec.calls = calls
        return rec

    return symm_run_ranks(s.world, lambda rank, symm: fn(rank, symm.world_state))


@pytest.mark.parametrize("world, dtype, hidden", [(1, "bf16", 256), (2, "bf16", 256), (3, "fp8", 512),
                                                  (4, "mxfp8", 256), (4, "bf16", 128)])
def test_verifies_clean_against_the_fake(world, dtype, hidden):
    for rec in run_points(scenario(world, dtype, hidden)):
        assert rec.wrong == {"dispatch": 0, "combine": 0}, rec.problem
        assert len(rec.samples_us["dispatch"]) == 2
        assert rec.calls[:2] == ["dispatch", "combine"] and rec.calls[-1] == "reset"


@pytest.mark.parametrize("world, dtype", [(1, "bf16"), (3, "fp8"), (4, "mxfp8")])
def test_kernel_mode_verifies_clean_and_times_only_the_librarys_calls(world, dtype, monkeypatch):
    """Kernel mode: the counts come from prepare_input's untimed call and the weights from
    prepare_combine (exact), so no timed call counts or weighs; the keys are still every call's."""
    from epbench.backends import flashinfer_a2a

    seen = {"counts": 0, "weigh_fast": 0}
    counts, weigh = FlashInferBackend._expert_counts, flashinfer_a2a.weigh_rows

    def counting(self, local):
        seen["counts"] += 1
        return counts(self, local)

    def weighing(rows, factor, out, exact):
        seen["weigh_fast"] += not exact
        return weigh(rows, factor, out, exact)

    monkeypatch.setattr(FlashInferBackend, "_expert_counts", counting)
    monkeypatch.setattr(flashinfer_a2a, "weigh_rows", weighing)
    recs = run_points(scenario(world, dtype), mode="kernel")
    for rec in recs:
        assert rec.wrong == {"dispatch": 0, "combine": 0}, rec.problem
    assert seen["weigh_fast"] == 0
    # one untimed call per input set (2) per rank, none in the warmup, timed or verification calls
    assert seen["counts"] == 2 * world
    assert recs[0].calls.count("dispatch") == 2 + 1 + 2 + 1  # prepare x2, warmup, 2 timed, verification
    assert recs[0].calls.count("combine") == recs[0].calls.count("dispatch")  # each round closed


def test_kernel_mode_refuses_an_input_it_did_not_prepare():
    s = scenario(1)
    state = FakeWorld(1)
    be = FlashInferBackend(setup_of(s, 0), library=fake_library(state, []), group=object())
    be.use_call_mode("kernel")
    from epbench.driver import Draw, Inputs

    inp = Inputs(s, route_all(s), torch.device("cpu")).caller(0, Draw(1))
    with pytest.raises(RuntimeError, match="never saw"):
        be.dispatch(inp, 0)


@pytest.mark.parametrize("mode", ["call", "kernel"])
def test_driver_fault_injection_is_caught(mode):
    s = scenario(2)
    assert all(r.wrong["dispatch"] == 1 for r in run_points(s, inject="dispatch", mode=mode))
    assert all(r.wrong["combine"] == 1 for r in run_points(s, inject="combine", mode=mode))


@pytest.mark.parametrize("mode", ["call", "kernel"])
def test_a_wrong_weight_from_the_library_is_caught(mode):
    r0, _ = run_points(scenario(2), corrupt="weights", mode=mode)
    assert r0.wrong["dispatch"] >= 1 and "weights differ" in r0.problem["dispatch"]


def test_without_the_keys_the_shuffled_rows_would_fail(monkeypatch):
    """The fake really shuffles: rows compared in the library's own order (keys that only drop the
    padding) must be seen by the verification."""
    from dataclasses import replace

    plain = FlashInferBackend.dispatch

    def library_order(self, inp, num_sms):
        out = plain(self, inp, num_sms)
        slot = torch.arange(out.row_key.shape[0])
        return replace(out, row_key=torch.where(out.row_key >= 0, slot, torch.full_like(slot, -1)))

    monkeypatch.setattr(FlashInferBackend, "dispatch", library_order)
    recs = run_points(scenario(2, tokens=24))
    assert any(r.wrong["dispatch"] > 0 for r in recs)


def test_every_call_returns_keys_and_counts_without_poison():
    """The timed path is the verified path: two plain calls in a row, never poisoned, each check
    clean (counts included), and the calls leave no switch behind."""
    from epbench.verify import check_dispatch
    from epbench.driver import Draw, Inputs

    s = scenario(3, "fp8", 512)
    routings = route_all(s)

    def fn(rank: int, state: FakeWorld):
        be = FlashInferBackend(setup_of(s, rank), library=fake_library(state, []), group=object())
        inputs = Inputs(s, routings, torch.device("cpu"))
        wrong = []
        for salt in (5, 6):
            out = be.dispatch(be.prepare_input(inputs.caller(rank, Draw(salt)), 0), 0)
            assert out.row_key is not None and int(out.expert_counts.sum()) > 0
            wrong.append(check_dispatch(out, rank, s.world, s.model.experts_per_rank,
                                        lambda r: inputs.wire(r, Draw(salt)),
                                        source_of=lambda r: inputs.source(r, Draw(salt))).wrong)
            be.combine(out, 0)  # the library takes no second dispatch before a combine
        be.close()
        return wrong

    assert symm_run_ranks(s.world, lambda rank, symm: fn(rank, symm.world_state)) == [[0, 0]] * 3


def test_registered_limits_and_sizes():
    assert backend_class("flashinfer") is FlashInferBackend and "flashinfer" in REGISTRY
    assert limits_reason(8, 8, (9, 0)) is None
    assert "top-k 3" in limits_reason(8, 3, (9, 0))
    assert "at most 64 ranks" in limits_reason(72, 8, (9, 0))
    assert "sm_90" in limits_reason(8, 8, (8, 0))
    assert limits_reason(8, 8, None) == "needs CUDA GPUs"
    s = setup_of(scenario(2, "fp8", 512, topk=8), 0)
    assert payload_bytes(s) == 512 + 512 // 128 * 4 + 8 * 4 * 2 + 4
