"""The checks against outputs built by hand from the reference semantics (backends/base.py):
a world of 3 ranks, 2 experts each, seen from rank 1; no process group needed."""

import pytest
import torch

from epbench.contract import DispatchInput, DispatchOutput
from epbench.inputs import dispatch_input, expert_factor, make_tokens
from epbench.routing import route_rank
from epbench.scenario import Routing
from epbench.verify import check_combine, check_dispatch, expected_combine

WORLD, EPR, TOPK, HIDDEN, ME = 3, 2, 2, 128, 1
TOKENS = (5, 7, 4)  # ranks may hold different numbers of tokens
CPU = torch.device("cpu")


def inputs_of(dtype: str):
    out = []
    for s, t in enumerate(TOKENS):
        r = route_rank(Routing(seed=5), t, TOPK, WORLD * EPR, s)
        out.append(dispatch_input(make_tokens(t, HIDDEN, 5, s, 1, CPU), r, dtype, CPU))
    return out


def hand_dispatch(ins, capacity: int = 32) -> DispatchOutput:
    """What rank ME must receive, spelled out with loops: by source rank, then token index."""
    picked = [(s, t) for s, inp in enumerate(ins) for t in range(inp.num_tokens)
              if any(int(e) // EPR == ME for e in inp.topk_idx[t])]
    fp8 = ins[0].x_scales is not None
    x = torch.full((capacity, HIDDEN), float("nan")).to(ins[0].x.dtype)
    scales = torch.full((capacity, HIDDEN // 128), float("nan")) if fp8 else None
    idx = torch.full((capacity, TOPK), -1, dtype=torch.int64)
    w = torch.full((capacity, TOPK), float("nan"))
    counts = torch.zeros(EPR, dtype=torch.int32)
    for row, (s, t) in enumerate(picked):
        x[row] = ins[s].x[t]
        if fp8:
            scales[row] = ins[s].x_scales[t]
        idx[row] = ins[s].topk_idx[t]
        w[row] = ins[s].topk_weights[t]
        for e in ins[s].topk_idx[t].tolist():
            if e // EPR == ME:
                counts[e % EPR] += 1
    return DispatchOutput(x, scales, idx, w, counts, len(picked))


def dispatch_wrong(out, ins) -> int:
    return check_dispatch(out, ME, WORLD, EPR, lambda s: ins[s]).wrong


@pytest.fixture(params=["bf16", "fp8"])
def case(request):
    ins = inputs_of(request.param)
    out = hand_dispatch(ins)
    assert out.num_recv > 0
    return ins, out


def test_correct_dispatch_passes(case):
    ins, out = case
    res = check_dispatch(out, ME, WORLD, EPR, lambda s: ins[s])
    assert res.wrong == 0, res.first_problem
    assert res.first_problem == ""


def test_one_flipped_byte_is_one_wrong_row(case):
    ins, out = case
    out.x[out.num_recv - 1].view(torch.uint8)[3] ^= 0x01
    res = check_dispatch(out, ME, WORLD, EPR, lambda s: ins[s])
    assert res.wrong == 1
    assert "payload" in res.first_problem


def test_swapped_rows_are_wrong(case):
    ins, out = case
    assert out.num_recv >= 2
    out.x[[0, 1]] = out.x[[1, 0]]
    assert dispatch_wrong(out, ins) == 2


def test_wrong_expert_id_and_weight(case):
    ins, out = case
    out.topk_idx[0, 0] += 1
    assert dispatch_wrong(out, ins) >= 1
    out = hand_dispatch(ins)
    out.topk_weights[0, 1] = out.topk_weights[0, 1] * 1.0001
    assert dispatch_wrong(out, ins) == 1


def test_wrong_counts(case):
    ins, out = case
    out.expert_counts[0] += 1
    res = check_dispatch(out, ME, WORLD, EPR, lambda s: ins[s])
    assert res.wrong == 1 and "expert counts" in res.first_problem
    out = hand_dispatch(ins)
    out.num_recv -= 1  # the last row goes missing
    assert dispatch_wrong(out, ins) >= 1


def test_fp8_scales_are_checked():
    ins = inputs_of("fp8")
    out = hand_dispatch(ins)
    out.x_scales[0, 0] *= 2
    res = check_dispatch(out, ME, WORLD, EPR, lambda s: ins[s])
    assert res.wrong == 1 and "scales" in res.first_problem


def test_nan_poison_left_in_place_is_caught(case):
    ins, out = case
    n = out.num_recv
    out.x[:n] = float("nan")  # as if the backend never wrote the rows
    assert dispatch_wrong(out, ins) == n


def test_nan_from_the_source_matches_bit_for_bit():
    """A NaN that was sent is received as that NaN: bits compare, not values."""
    ins = inputs_of("bf16")
    out = hand_dispatch(ins)
    s, t = next((s, t) for s, inp in enumerate(ins) for t in range(inp.num_tokens)
                if any(int(e) // EPR == ME for e in inp.topk_idx[t]))
    ins[s].x[t, 0] = float("nan")
    out = hand_dispatch(ins)
    assert dispatch_wrong(out, ins) == 0


def hand_combine(inp: DispatchInput) -> torch.Tensor:
    """Each token: sum over the ranks d that hold one of its experts of
    (its weights on d) * (expert on d's output for it), in fp32, rounded once to bf16."""
    xs = inp.x.float() if inp.x_scales is None else (
        inp.x.float().view(inp.num_tokens, -1, 128) * inp.x_scales.unsqueeze(2)
    ).view(inp.num_tokens, HIDDEN)
    out = torch.zeros(inp.num_tokens, HIDDEN)
    for t in range(inp.num_tokens):
        for d in range(WORLD):
            w = sum(float(wt) for e, wt in zip(inp.topk_idx[t].tolist(), inp.topk_weights[t])
                    if e // EPR == d)
            if any(e // EPR == d for e in inp.topk_idx[t].tolist()):
                y = (xs[t] * expert_factor(d)).to(torch.bfloat16).float()
                out[t] += w * y
    return out.to(torch.bfloat16)


def test_expected_combine_matches_the_hand_sum(case):
    ins, _ = case
    want = hand_combine(ins[ME])
    got = expected_combine(ins[ME], WORLD, EPR)
    assert torch.allclose(got.to(torch.bfloat16).float(), want.float(), rtol=2**-7, atol=1e-6)


def test_correct_combine_passes(case):
    ins, _ = case
    res = check_combine(hand_combine(ins[ME]), ins[ME], WORLD, EPR)
    assert res.wrong == 0, res.first_problem


def test_combine_off_by_one_percent_in_one_row_fails(case):
    ins, _ = case
    got = hand_combine(ins[ME])
    got[2] = (got[2].float() * 1.01).to(torch.bfloat16)
    res = check_combine(got, ins[ME], WORLD, EPR)
    assert res.wrong == 1 and res.first_problem.startswith("token 2:")


def test_combine_nan_poison_and_zeros_fail(case):
    ins, _ = case
    got = hand_combine(ins[ME])
    got[0, 5] = float("nan")
    assert check_combine(got, ins[ME], WORLD, EPR).wrong == 1
    zeros = torch.zeros_like(got)
    assert check_combine(zeros, ins[ME], WORLD, EPR).wrong == ins[ME].num_tokens


def test_combine_missing_a_copy_fails():
    """Dropping one destination's contribution must be noticed."""
    ins = inputs_of("bf16")
    inp = ins[ME]
    t = next(t for t in range(inp.num_tokens)
             if len({int(e) // EPR for e in inp.topk_idx[t]}) == 2)
    got = hand_combine(inp)
    d = int(inp.topk_idx[t, 0]) // EPR
    w = float(inp.topk_weights[t, 0])
    got[t] = (got[t].float() - w * (inp.x[t].float() * expert_factor(d))).to(torch.bfloat16)
    assert check_combine(got, inp, WORLD, EPR).wrong == 1


def test_combine_wrong_shape(case):
    ins, _ = case
    got = hand_combine(ins[ME])[:-1]
    assert check_combine(got, ins[ME], WORLD, EPR).wrong >= 1


# ---- issue 26: quantized payloads and the expert-major layout ----

def test_quantization_error_rows_flags_rows_off_the_source():
    from epbench.mxfp8 import quantize
    from epbench.verify import quantization_error_rows

    x = make_tokens(6, 64, 5, 0, 3, CPU)
    q, s = quantize(x)
    assert quantization_error_rows(q, s, x) == 0
    q.view(torch.uint8)[2, 7] ^= 0x08  # one element off by a few ulps
    assert quantization_error_rows(q, s, x) == 1
    f8 = inputs_of("fp8")[0]
    assert quantization_error_rows(f8.x, f8.x_scales, make_tokens(5, HIDDEN, 5, 0, 1, CPU)) == 0


def test_expert_major_segments_are_checked():
    from epbench.layout import expert_major
    from epbench.verify import check_segments

    ins = inputs_of("bf16")
    out = hand_dispatch(ins)
    n = int(out.num_recv)
    table, sm = expert_major(out.topk_idx[:n], ME, EPR, 16)
    x = torch.full((64, HIDDEN), float("nan")).to(torch.bfloat16)
    x[sm.slot] = out.x[sm.row]
    assert check_segments(table, x, None, ME, WORLD, EPR, lambda s: ins[s]).wrong == 0
    bad = x.clone()
    bad[int(sm.slot[-1])] += 1
    assert check_segments(table, bad, None, ME, WORLD, EPR, lambda s: ins[s]).wrong == 1
    table.offsets = table.offsets + 1  # unaligned
    assert check_segments(table, x, None, ME, WORLD, EPR, lambda s: ins[s]).wrong >= 1


# ---- the per-expert (map) form: routing delivered as a map over local experts ----

def hand_map_dispatch(ins) -> DispatchOutput:
    """The same rows as ``hand_dispatch``, with the routing as Hybrid-EP delivers it, built with
    loops: per row a bool over rank ME's experts and the weight of each (0 elsewhere)."""
    out = hand_dispatch(ins)
    n = out.num_recv
    hit = torch.zeros(32, EPR, dtype=torch.bool)
    w = torch.full((32, EPR), float("nan"))
    w[:n] = 0.0
    picked = [(s, t) for s, inp in enumerate(ins) for t in range(inp.num_tokens)
              if any(int(e) // EPR == ME for e in inp.topk_idx[t])]
    for row, (s, t) in enumerate(picked):
        for k, e in enumerate(ins[s].topk_idx[t].tolist()):
            if e // EPR == ME:
                hit[row, e % EPR] = True
                w[row, e % EPR] = ins[s].topk_weights[t, k]
    return DispatchOutput(out.x, out.x_scales, hit, w, out.expert_counts, n)


def map_wrong(out, ins):
    return check_dispatch(out, ME, WORLD, EPR, lambda s: ins[s], routing_map=True)


@pytest.fixture(params=["bf16", "fp8"])
def map_case(request):
    ins = inputs_of(request.param)
    return ins, hand_map_dispatch(ins)


def test_map_form_passes_whatever_the_top_k_order(map_case):
    ins, out = map_case
    assert map_wrong(out, ins).wrong == 0
    flipped = [DispatchInput(i.x, i.x_scales, i.topk_idx.flip(1), i.topk_weights.flip(1)) for i in ins]
    res = map_wrong(out, flipped)  # the same sets in another top-k order
    assert res.wrong == 0, res.first_problem


def _local_row(out) -> int:
    """A received row with exactly one of rank ME's experts (so a move to the other is wrong)."""
    rows = (out.topk_idx[: out.num_recv].sum(dim=1) == 1).nonzero().flatten()
    assert rows.numel() > 0
    return int(rows[0])


def test_map_form_catches_a_wrong_expert(map_case):
    ins, out = map_case
    r = _local_row(out)
    e = int(out.topk_idx[r].nonzero()[0])
    out.topk_idx[r, e], out.topk_idx[r, 1 - e] = False, True
    out.topk_weights[r, [e, 1 - e]] = out.topk_weights[r, [1 - e, e]]  # the weight moves along
    res = map_wrong(out, ins)
    assert res.wrong == 2 and "expert ids differ" in res.first_problem  # its ids and its weights


def test_map_form_catches_a_wrong_weight(map_case):
    ins, out = map_case
    r = _local_row(out)
    e = int(out.topk_idx[r].nonzero()[0])
    out.topk_weights[r, e] = torch.nextafter(out.topk_weights[r, e], torch.tensor(2.0))
    res = map_wrong(out, ins)
    assert res.wrong == 1 and "weights differ" in res.first_problem


def test_map_form_catches_a_wrong_or_missing_row(map_case):
    ins, out = map_case
    n = out.num_recv
    out.x[[0, 1]] = out.x[[1, 0]]  # two rows swapped (routing left in place)
    assert map_wrong(out, ins).wrong >= 2
    out.x[[0, 1]] = out.x[[1, 0]]
    out.num_recv = n - 1  # the last row missing
    res = map_wrong(out, ins)
    assert res.wrong == 1 and res.first_problem == f"received {n - 1} rows, expected {n}"


def test_map_form_rejects_top_k_positions_and_vice_versa(case, map_case):
    ins, out = case
    assert map_wrong(out, ins).wrong == out.num_recv * 2  # positions where a map is expected
    ins, mout = map_case
    assert dispatch_wrong(mout, ins) == mout.num_recv * 2  # a map where positions are expected


# ---- the stand-in expert between the timed calls: its factors are made once ----

def _counting_tensor(monkeypatch):
    """Counts torch.tensor calls (the host-to-device copy that synchronises on a GPU) from here on."""
    made = []
    real = torch.tensor

    def tensor(*args, **kwargs):
        made.append(kwargs.get("device"))
        return real(*args, **kwargs)

    monkeypatch.setattr(torch, "tensor", tensor)
    return made


def test_expert_factors_are_made_once_per_expert_range_and_device(monkeypatch):
    from epbench import verify

    monkeypatch.setattr(verify, "_factors", {})
    monkeypatch.setattr(verify, "_fill_sync", False)
    made = _counting_tensor(monkeypatch)
    first = verify.ll_expert_factors(4, 3, CPU)
    assert first.tolist() == [expert_factor(4), expert_factor(5), expert_factor(6)]
    assert verify.ll_expert_factors(4, 3, CPU) is first and verify.ll_expert_factors(4, 3, "cpu") is first
    assert len(made) == 1
    assert verify.ll_expert_factors(0, 3, CPU) is not first and len(made) == 2  # another range: its own


def test_fill_paths_copy_no_factor_from_the_host_after_the_first_call(monkeypatch):
    """ll_expert_output (low latency) and em_expert_output (expert-major) run between every timed
    dispatch and combine: after the first call they build no tensor from host values (on a GPU each
    would be a pageable copy that synchronises the host); EPBENCH_FILL_SYNC=1 brings that back."""
    from epbench import verify
    from epbench.layout import ExpertMajor

    x, scales = torch.randn(2, 6, HIDDEN).to(torch.float8_e4m3fn), torch.rand(2, 6, HIDDEN // 128)
    table = ExpertMajor(torch.tensor([3, 2]), torch.tensor([0, 4]), 8, 4)
    for sync, per_call in ((False, 0), (True, 1)):
        monkeypatch.setattr(verify, "_factors", {})
        monkeypatch.setattr(verify, "_fill_sync", sync)
        made = _counting_tensor(monkeypatch)
        ll = [verify.ll_expert_output(x, scales, 2) for _ in range(3)]
        em = [verify.em_expert_output(x[0], scales[0], table, 4) for _ in range(3)]
        assert len(made) == 2 + 4 * per_call  # one per expert range on the first call (+ one a later call)
        assert all(torch.equal(y, ll[0]) for y in ll) and all(torch.equal(y, em[0]) for y in em)
        monkeypatch.undo()


def test_fill_sync_switch_is_read_from_the_environment(monkeypatch):
    from epbench import verify

    monkeypatch.setattr(verify, "_factors", {})
    monkeypatch.setattr(verify, "_fill_sync", None)
    monkeypatch.setenv("EPBENCH_FILL_SYNC", "1")
    a = verify.ll_expert_factors(0, 4, CPU)
    assert verify._fill_sync is True
    assert verify.ll_expert_factors(0, 4, CPU) is not a and verify._factors == {}
