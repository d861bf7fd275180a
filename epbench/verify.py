"""Checks a backend's outputs against what the routing says they must be.

dispatch: bit-exact. Every received row, its scales (fp8), expert ids and weights must equal
the source's, in (source rank, token index) order; the row count and the per-expert counts
must match. combine: each returned token must be within COMBINE_RTOL of
``sum_d w(t, d) * y_d(t)`` (fp32 accumulation, one bf16 rounding at the end, so the only
freedom is summation order plus that rounding: half a bf16 ulp is 2^-9 relative).

Low-latency mode (contract in epbench/backends/base.py): dispatch is bit-exact per (expert,
slot): every valid slot's payload, scales and source pair (t * topk + k) must equal the
source's, and the per-(expert, source) and per-expert counts must match; padding is not read.
The stand-in expert of global expert e multiplies its rows by ``expert_factor(e)``; combine
must be within COMBINE_RTOL of ``sum_k w[t, k] * y_{e_k}(t)`` (one term per expert).

Each check returns the number of wrong rows (counts that differ add their difference) and a
short description of the first problem.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from epbench.backends.base import DispatchInput, DispatchOutput, LowLatencyOutput, ll_slots
from epbench.inputs import dequantize, expert_factor, expert_output
from epbench.routing import copy_weights, dest_mask

COMBINE_RTOL = 2.0**-7
COMBINE_ATOL = 1e-6


@dataclass
class CheckResult:
    wrong: int = 0
    first_problem: str = ""

    def add(self, n: int, problem: str) -> None:
        if n and not self.first_problem:
            self.first_problem = problem
        self.wrong += n


def _bits(t: torch.Tensor) -> torch.Tensor:
    """Same-size integer view, so NaN poison and -0.0 compare by their bits."""
    dtype = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    return t.view(dtype)


def _bad_rows(got: torch.Tensor, want: torch.Tensor) -> int:
    if got.numel() == 0:
        return 0
    diff = _bits(got) != _bits(want)
    return int(diff.reshape(diff.shape[0], -1).any(dim=1).sum())


def check_dispatch(out: DispatchOutput, rank: int, world: int, experts_per_rank: int,
                   input_of: Callable[[int], DispatchInput],
                   local_expert_ids: bool = False) -> CheckResult:
    """``input_of(s)`` rebuilds source rank s's dispatch input on this rank's device.

    ``local_expert_ids`` (a backend's ``receives_local_expert_ids``): each received expert id
    must be the local index (id - rank * experts_per_rank) where the expert lives on this rank
    and -1 elsewhere, and each weight the sent weight there and 0 elsewhere; still bit-exact."""
    res = CheckResult()
    got_n = int(out.num_recv)
    offset = 0
    expected_counts = torch.zeros(experts_per_rank, dtype=torch.int64, device=out.x.device)
    lo = rank * experts_per_rank
    for s in range(world):
        inp = input_of(s)
        rows = dest_mask(inp.topk_idx, experts_per_rank, world)[:, rank].nonzero().flatten()
        n = int(rows.numel())
        local = inp.topk_idx[rows] - lo
        hit = (local >= 0) & (local < experts_per_rank)
        expected_counts += torch.bincount(local[hit], minlength=experts_per_rank)
        end = min(offset + n, got_n)
        k = max(end - offset, 0)
        if k:
            sl, want = slice(offset, end), rows[:k]
            res.add(_bad_rows(out.x[sl], inp.x[want]), f"rows from rank {s}: payload differs")
            if inp.x_scales is not None:
                res.add(_bad_rows(out.x_scales[sl], inp.x_scales[want]),
                        f"rows from rank {s}: fp8 scales differ")
            want_idx, want_w = inp.topk_idx[want], inp.topk_weights[want]
            if local_expert_ids:
                mine = hit[:k]
                want_idx = torch.where(mine, local[:k], torch.full_like(want_idx, -1))
                want_w = torch.where(mine, want_w, torch.zeros_like(want_w))
            res.add(_bad_rows(out.topk_idx[sl], want_idx),
                    f"rows from rank {s}: expert ids differ")
            res.add(_bad_rows(out.topk_weights[sl], want_w),
                    f"rows from rank {s}: weights differ")
        offset += n
    res.add(abs(got_n - offset), f"received {got_n} rows, expected {offset}")
    # a backend may report the counts from the host (DeepEP returns them as a Python list)
    got_counts = out.expert_counts.to(device=expected_counts.device, dtype=torch.int64)
    res.add(int((got_counts != expected_counts).sum()),
            f"expert counts {got_counts.tolist()} != {expected_counts.tolist()}")
    return res


def expected_combine(inp: DispatchInput, world: int, experts_per_rank: int) -> torch.Tensor:
    """fp32 [T, hidden]: what combine must return for this rank's own dispatch input."""
    mask = dest_mask(inp.topk_idx, experts_per_rank, world)
    w = copy_weights(inp.topk_idx, inp.topk_weights, experts_per_rank, world)
    acc = torch.zeros(inp.x.shape, dtype=torch.float32, device=inp.x.device)
    for d in range(world):
        if bool(mask[:, d].any()):
            acc += (w[:, d] * mask[:, d]).unsqueeze(1) * expert_output(inp.x, inp.x_scales, d).float()
    return acc


def _compare_combine(got: torch.Tensor, want_of: Callable[[], torch.Tensor], t: int, h: int) -> CheckResult:
    """Shared by both modes: shape first, then every element within COMBINE_RTOL of ``want_of()``."""
    res = CheckResult()
    if tuple(got.shape) != (t, h):
        res.add(max(t, 1), f"combine returned shape {tuple(got.shape)}, expected {(t, h)}")
        return res
    want = want_of()
    ok = torch.isclose(got.float(), want, rtol=COMBINE_RTOL, atol=COMBINE_ATOL)
    bad = int((~ok.all(dim=1)).sum()) if t else 0
    if bad:
        row = int((~ok.all(dim=1)).nonzero()[0])
        col = int((~ok[row]).nonzero()[0])
        res.add(bad, f"token {row}: got {float(got[row, col])} at column {col}, "
                     f"expected {float(want[row, col])}")
    return res


def check_combine(got: torch.Tensor, inp: DispatchInput, world: int,
                  experts_per_rank: int) -> CheckResult:
    return _compare_combine(got, lambda: expected_combine(inp, world, experts_per_rank),
                            inp.num_tokens, inp.x.shape[1])


# ---- low-latency mode ----

def ll_expert_factors(first_expert: int, n: int, device: torch.device) -> torch.Tensor:
    """float32 [n]: the stand-in factor of global experts first_expert .. first_expert + n - 1."""
    return torch.tensor([expert_factor(first_expert + i) for i in range(n)], dtype=torch.float32,
                        device=device)


def ll_expert_output(x: torch.Tensor, scales: "torch.Tensor | None", first_expert: int) -> torch.Tensor:
    """bf16 [E, C, hidden]: every slot of a low-latency receive buffer through its stand-in
    expert (padding included: it costs no host synchronisation to skip nothing)."""
    e, c, h = x.shape
    flat = dequantize(x.reshape(e * c, h), scales.reshape(e * c, -1) if scales is not None else None)
    f = ll_expert_factors(first_expert, e, x.device)
    return (flat.view(e, c, h) * f.view(e, 1, 1)).to(torch.bfloat16)


def check_ll_dispatch(out: LowLatencyOutput, rank: int, world: int, experts_per_rank: int,
                      input_of: Callable[[int], DispatchInput]) -> CheckResult:
    """``input_of(s)`` rebuilds source rank s's dispatch input on this rank's device."""
    res = CheckResult()
    e_loc, tm = experts_per_rank, out.max_tokens_per_rank
    lo = rank * e_loc
    dev = out.x.device
    want_src = torch.zeros(e_loc, world, dtype=torch.int64, device=dev)
    got_src = out.src_counts.to(device=dev, dtype=torch.int64)
    for s in range(world):
        inp = input_of(s)
        t, k = inp.topk_idx.shape
        if inp.topk_idx.numel() == 0:
            continue
        j, per_expert = ll_slots(inp.topk_idx, world * e_loc)
        want_src[:, s] = per_expert[lo: lo + e_loc]
        local = (inp.topk_idx - lo).flatten()
        mine = ((local >= 0) & (local < e_loc)).nonzero().flatten()  # pair ids p = t * topk + k
        if mine.numel() == 0:
            continue
        le, slot = local[mine], s * tm + j.flatten()[mine]
        tok = mine // k
        ok_slot = slot < (s + 1) * tm  # a row beyond T_max cannot exist; count it wrong below
        res.add(int((~ok_slot).sum()), f"source {s}: more than {tm} rows for one expert")
        le, slot, tok, pair = le[ok_slot], slot[ok_slot], tok[ok_slot], mine[ok_slot]
        res.add(_bad_rows(_bits(out.x)[le, slot], _bits(inp.x)[tok]), f"rows from rank {s}: payload differs")
        if inp.x_scales is not None:
            res.add(_bad_rows(out.x_scales[le, slot], inp.x_scales[tok]),
                    f"rows from rank {s}: fp8 scales differ")
        got_pair = out.src_pair[le, slot].to(torch.int64)
        res.add(int((got_pair != pair).sum()), f"rows from rank {s}: source token/k differs")
    bad = got_src != want_src
    res.add(int(bad.sum()), f"per-(expert, source) counts {got_src.tolist()} != {want_src.tolist()}")
    got_counts = out.counts.to(device=dev, dtype=torch.int64)
    res.add(int((got_counts != want_src.sum(dim=1)).sum()),
            f"expert counts {got_counts.tolist()} != {want_src.sum(dim=1).tolist()}")
    return res


def expected_ll_combine(inp: DispatchInput) -> torch.Tensor:
    """fp32 [T, hidden]: sum over the token's top-k experts of w * bf16(x * expert_factor(e))."""
    x = dequantize(inp.x, inp.x_scales)
    acc = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    if inp.topk_idx.numel() == 0:
        return acc
    f = ll_expert_factors(0, int(inp.topk_idx.max()) + 1, x.device)[inp.topk_idx]  # [T, topk]
    for k in range(inp.topk_idx.shape[1]):
        y = (x * f[:, k: k + 1]).to(torch.bfloat16).float()
        acc += inp.topk_weights[:, k: k + 1].float() * y
    return acc


def check_ll_combine(got: torch.Tensor, inp: DispatchInput) -> CheckResult:
    return _compare_combine(got, lambda: expected_ll_combine(inp), inp.num_tokens, inp.x.shape[1])
