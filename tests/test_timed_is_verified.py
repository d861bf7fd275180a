"""What is timed is what is verified: backends that skip work in their timed calls are caught.

Each fake below moves tokens at world 1 without any process group (every expert lives on rank 0,
so dispatch hands every token back in order and combine weighs each row by the sum of its
weights). The honest one passes; the cheats keep private copies of earlier outputs, so poisoning
their buffers alone would not expose them: only checking the timed calls' own outputs and a
verification run on the very tensors the timed calls used can."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Dict

import pytest
import torch

from epbench.backends.base import NormalMode
from epbench.contract import DispatchInput, DispatchOutput, RankSetup
from epbench.driver import Draw, Inputs, Point, PointRecord, measure_point, timing_draws
from epbench.inputs import fill_in_place, rotated_routing
from epbench.metrics import pair_traffic
from epbench.routing import route_all, traffic
from epbench.scenario import parse
from support import scenario_dict

CPU = torch.device("cpu")


class Loopback(NormalMode):
    """An honest world-1 backend: the received rows are the sent rows, in order."""

    name = "loopback"

    def __init__(self, setup: RankSetup) -> None:
        self.s = setup
        t, h = setup.max_tokens_per_rank, setup.hidden
        self.recv = torch.empty(t, h, dtype=torch.bfloat16)
        self.y = torch.empty(t, h, dtype=torch.bfloat16)
        self.out = torch.empty(t, h, dtype=torch.bfloat16)

    def dispatch(self, inp: DispatchInput, num_sms: int) -> DispatchOutput:
        n = inp.num_tokens
        self.recv[:n].copy_(inp.x)
        e = self.s.experts_per_rank
        counts = torch.zeros(e, dtype=torch.int64).scatter_add_(0, inp.topk_idx.flatten(),
                                                                torch.ones(inp.topk_idx.numel(), dtype=torch.int64))
        return DispatchOutput(self.recv[:n], None, inp.topk_idx.clone(), inp.topk_weights.clone(), counts, n)

    def combine_input(self, out: DispatchOutput) -> torch.Tensor:
        return self.y[: out.num_recv]

    def combine(self, out: DispatchOutput, num_sms: int) -> torch.Tensor:
        n = out.num_recv
        w = out.topk_weights.sum(dim=1, keepdim=True)  # every expert is on rank 0
        self.out[:n].copy_((self.y[:n].float() * w).to(torch.bfloat16))
        return self.out[:n]

    def poison(self) -> None:
        for t in (self.recv, self.y, self.out):
            t.fill_(float("nan"))


class Memoising(Loopback):
    """Hands back a private copy of its earlier output whenever it gets an input object it has seen."""

    name = "memo"

    def __init__(self, setup: RankSetup) -> None:
        super().__init__(setup)
        self.seen: Dict[int, DispatchOutput] = {}

    def dispatch(self, inp: DispatchInput, num_sms: int) -> DispatchOutput:
        if id(inp) in self.seen:
            old = self.seen[id(inp)]
            self.recv[: old.num_recv].copy_(old.x)
            return DispatchOutput(self.recv[: old.num_recv], None, old.topk_idx, old.topk_weights,
                                  old.expert_counts, old.num_recv)
        out = super().dispatch(inp, num_sms)
        self.seen[id(inp)] = DispatchOutput(out.x.clone(), None, out.topk_idx, out.topk_weights,
                                            out.expert_counts, out.num_recv)
        return out


class Lazy(Loopback):
    """Does the work once, then replays a private copy of that first output (dispatch) or result
    (combine) on every later call."""

    name = "lazy"

    def __init__(self, setup: RankSetup, op: str = "dispatch") -> None:
        super().__init__(setup)
        self.op, self.first = op, None

    def dispatch(self, inp: DispatchInput, num_sms: int) -> DispatchOutput:
        if self.op != "dispatch":
            return super().dispatch(inp, num_sms)
        if self.first is None:
            out = super().dispatch(inp, num_sms)
            self.first = DispatchOutput(out.x.clone(), None, out.topk_idx, out.topk_weights, out.expert_counts,
                                        out.num_recv)
        f = self.first
        self.recv[: f.num_recv].copy_(f.x)
        return DispatchOutput(self.recv[: f.num_recv], None, f.topk_idx, f.topk_weights, f.expert_counts, f.num_recv)

    def combine(self, out: DispatchOutput, num_sms: int) -> torch.Tensor:
        if self.op != "combine":
            return super().combine(out, num_sms)
        if self.first is None:
            self.first = super().combine(out, num_sms).clone()
        self.out[: self.first.shape[0]].copy_(self.first)
        return self.out[: self.first.shape[0]]


def scenario(tokens: int = 16):
    return parse(scenario_dict(model={"hidden": 128, "tokens_per_rank": tokens, "topk": 2, "experts_per_rank": 4},
                               topology={"name": "one", "nodes": 1, "gpus_per_node": 1}), "<test>")


def comm():
    return SimpleNamespace(rank=0, world=1, device=CPU, sync=lambda: None)


def setup_of(s) -> RankSetup:
    m = s.model
    return RankSetup(rank=0, world=1, gpus_per_node=1, device=CPU, hidden=m.hidden,
                     max_tokens_per_rank=m.tokens_per_rank, topk=m.topk, experts_per_rank=m.experts_per_rank,
                     dispatch_dtype=m.dispatch_dtype)


def measure(be: NormalMode, input_sets: int, iters: int = 3) -> PointRecord:
    s = scenario()
    rec = PointRecord(0)
    measure_point(Point(be, s, route_all(s), 0, comm(), input_sets), 1, iters, 7, None, rec)
    return rec


@pytest.mark.parametrize("input_sets", [1, 4])
def test_an_honest_backend_passes(input_sets):
    rec = measure(Loopback(setup_of(scenario())), input_sets)
    assert rec.wrong == {"dispatch": 0, "combine": 0}, rec.problem
    assert len(rec.samples_us["dispatch"]) == 3


@pytest.mark.parametrize("input_sets", [1, 4])
def test_a_backend_that_returns_its_output_for_a_repeated_input_is_caught(input_sets):
    rec = measure(Memoising(setup_of(scenario())), input_sets)
    assert rec.wrong["dispatch"] > 0 and "verification run" in rec.problem["dispatch"]
    assert rec.wrong["combine"] > 0  # combined from the stale rows


@pytest.mark.parametrize("op", ["dispatch", "combine"])
@pytest.mark.parametrize("input_sets", [1, 4])
def test_a_backend_that_skips_work_after_its_first_call_is_caught(op, input_sets):
    rec = measure(Lazy(setup_of(scenario()), op), input_sets)
    assert rec.wrong[op] > 0 and "verification run" in rec.problem[op]
    if input_sets > 1:  # warmup 1 + iters 3: the last timed call ran on set 3, the first on set 0
        assert "last timed call" in rec.problem[op]


def test_the_last_timed_call_is_checked_on_its_own():
    """A backend that is right only when poisoned first (the verification run) is caught by the
    check of its last timed call."""

    class RightOnlyWhenPoisoned(Loopback):
        poisoned = False

        def poison(self) -> None:
            super().poison()
            self.poisoned = True

        def dispatch(self, inp, num_sms):
            out = super().dispatch(inp, num_sms)
            if not self.poisoned:
                out.x[0].zero_()
            return out

    rec = measure(RightOnlyWhenPoisoned(setup_of(scenario())), 4)
    assert rec.wrong["dispatch"] >= 1 and rec.problem["dispatch"].startswith("last timed call")


def test_timed_calls_rotate_through_their_input_sets():
    seen = []

    class Watching(Loopback):
        def dispatch(self, inp, num_sms):
            seen.append((id(inp), inp.x[0, 0].item(), tuple(inp.topk_idx[0].tolist())))
            return super().dispatch(inp, num_sms)

    measure(Watching(setup_of(scenario())), 3, iters=5)
    timed = seen[:6]  # warmup 1 + iters 5; then the verification run
    assert len({obj for obj, _, _ in timed}) == 3 and timed[0][0] == timed[3][0]
    assert len({v for _, v, _ in timed[:3]}) == 3  # other values
    assert seen[-1][0] == timed[0][0] and seen[-1][1] != timed[0][1]  # same tensors, fresh values


def test_rotated_sets_keep_every_byte_count_and_change_every_routes_token():
    s = parse(scenario_dict(model={"hidden": 128, "tokens_per_rank": 64, "topk": 4, "experts_per_rank": 4}), "<t>")
    base = route_all(s)
    moved = [rotated_routing(r, s.routing.seed, rank, 2) for rank, r in enumerate(base)]
    for hier in (False, True):
        a, b = traffic(base, 4, 2, hier), traffic(moved, 4, 2, hier)
        assert torch.equal(a.total, b.total) and torch.equal(a.nvlink, b.nvlink) and torch.equal(a.nic, b.nic)
    pa, pb = pair_traffic(base, 4, 4), pair_traffic(moved, 4, 4)
    assert torch.equal(pa.total, pb.total) and torch.equal(pa.nvlink, pb.nvlink)
    assert not torch.equal(base[0].topk_idx, moved[0].topk_idx)
    assert rotated_routing(base[0], s.routing.seed, 0, 0) is base[0]
    draws = timing_draws(3, reuses_layout=False)
    assert [d.rotation for d in draws] == [0, 1, 2] and len({d.salt for d in draws}) == 3
    assert all(d.salt <= 0 for d in draws)  # never a verification salt (1, 2, ...)
    assert [d.rotation for d in timing_draws(3, reuses_layout=True)] == [0, 0, 0]
    inputs = Inputs(s, base, CPU)
    a, b = inputs.caller(1, Draw(0, 1)), inputs.caller(1, Draw(-1, 1))
    assert torch.equal(a.topk_idx, b.topk_idx) and not torch.equal(a.x, b.x)
    fill_in_place(a, b)
    assert torch.equal(a.x, b.x)
