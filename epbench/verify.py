"""Checks a backend's outputs against what the routing says they must be.

dispatch: bit-exact. Every received row, its scales (fp8, mxfp8), expert ids and weights must
equal the source's, in (source rank, token index) order; the row count and the per-expert counts
must match (a backend that delivers a per-expert routing map instead of top-k positions is
compared per row as the set of its local experts and their weights). A quantized payload is compared with the reference quantizer's output (also when the
backend quantizes on the way, ``quantize: fused``) and, dequantized, must lie within the format's
error of the bf16 source. Expert-major layout: each local expert's segment holds its rows in
(source, token) order at an offset that is the padded running sum of the counts. combine: each returned token must be within COMBINE_RTOL of
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

from dataclasses import dataclass, replace
from typing import Callable, Dict, Optional, Tuple

import torch

from epbench import options
from epbench.contract import (BF16_ROUNDING, COMBINE_ROUNDINGS, DispatchInput, DispatchOutput,
                              LowLatencyOutput, ll_slots)
from epbench.inputs import dequantize, expert_factor, expert_output
from epbench.layout import ExpertMajor, expert_of_slot, segment_offsets, segment_sort
from epbench.mxfp8 import error_bound
from epbench.routing import copy_weights, dest_mask

COMBINE_RTOL = COMBINE_ROUNDINGS * BF16_ROUNDING  # 2^-7; a backend that rounds more says so
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


def quantization_error_rows(x: torch.Tensor, scales: torch.Tensor, source: torch.Tensor) -> int:
    """Rows whose dequantized values stray from the bf16 source by more than the format allows:
    ``max(2^-4 |x|, s * 2^-10)`` per element (half an e4m3 ulp where x / s is normal, half the
    subnormal step below; s the element's scale), plus 2^-20 relative slack for fp8's fp32
    division by a scale that is not a power of two. NaN (poison) counts as wrong."""
    if source.shape[0] == 0:
        return 0
    got = dequantize(x, scales)
    if scales.dtype == torch.uint8:
        bound = error_bound(source, scales)
    else:
        per_elem = scales.repeat_interleave(x.shape[1] // scales.shape[1], dim=1)
        bound = torch.maximum(source.float().abs() * 2.0**-4, per_elem * 2.0**-10)
    bound = bound + source.float().abs() * 2.0**-20
    ok = (got - source.float()).abs() <= bound
    return int((~ok.all(dim=1)).sum())


def _check_payload(res: CheckResult, got_x: torch.Tensor, got_scales: Optional[torch.Tensor],
                   inp: DispatchInput, want: torch.Tensor, source: Optional[torch.Tensor], what: str) -> None:
    """Rows ``want`` of ``inp`` against received rows: bit-exact payload and scales, and (where
    ``source`` holds the bf16 rows a quantized payload came from) within the format's error."""
    res.add(_bad_rows(got_x, inp.x[want]), f"{what}: payload differs")
    if inp.x_scales is not None:
        res.add(_bad_rows(got_scales, inp.x_scales[want]), f"{what}: scales differ")
        if source is not None:
            res.add(quantization_error_rows(got_x, got_scales, source[want]),
                    f"{what}: dequantized rows beyond the format's error of the bf16 source")


def check_segments(table: ExpertMajor, x: torch.Tensor, scales: Optional[torch.Tensor], rank: int,
                   world: int, experts_per_rank: int, input_of: Callable[[int], DispatchInput],
                   source_of: Optional[Callable[[int], torch.Tensor]] = None) -> CheckResult:
    """Expert-major layout (epbench/layout.py): segment e holds, bit-exact, the rows of every
    token whose top-k contains local expert e, by (source rank, token); offsets are the padded
    running sums. Padding is not read."""
    res = CheckResult()
    lo = rank * experts_per_rank
    inputs = [input_of(s) for s in range(world)]
    sources = [source_of(s) if source_of is not None else None for s in range(world)]
    dev = x.device
    want_counts = torch.zeros(experts_per_rank, dtype=torch.int64, device=dev)
    for s, inp in enumerate(inputs):
        for e in range(experts_per_rank):
            want_counts[e] += int((inp.topk_idx == lo + e).any(dim=1).sum()) if inp.num_tokens else 0
    want_off, want_total = segment_offsets(want_counts, table.align)
    got_counts = table.counts.to(device=dev, dtype=torch.int64)
    got_off = table.offsets.to(device=dev, dtype=torch.int64)
    res.add(int((got_counts != want_counts).sum()),
            f"segment counts {got_counts.tolist()} != {want_counts.tolist()}")
    res.add(int((got_off != want_off).sum()), f"segment offsets {got_off.tolist()} != {want_off.tolist()}")
    res.add(int(int(table.num_slots) != int(want_total)),
            f"{int(table.num_slots)} slots in use, expected {int(want_total)}")
    for e in range(experts_per_rank):
        start, n = int(want_off[e]), int(want_counts[e])
        for s, inp in enumerate(inputs):
            rows = (inp.topk_idx == lo + e).any(dim=1).nonzero().flatten() if inp.num_tokens else \
                inp.topk_idx.new_zeros(0)
            k = min(int(rows.numel()), max(x.shape[0] - start, 0), n)
            if k:
                sl = slice(start, start + k)
                _check_payload(res, x[sl], scales[sl] if scales is not None else None, inp, rows[:k],
                               sources[s], f"expert {e}, rows from rank {s}")
            start, n = start + int(rows.numel()), n - int(rows.numel())
    return res


def local_routing_map(topk_idx: torch.Tensor, topk_weights: torch.Tensor, rank: int,
                      experts_per_rank: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Rows' routing restricted to this rank, order-free: bool ``[T, experts_per_rank]`` (True
    where the row's top-k holds local expert e) and float32 ``[T, experts_per_rank]`` (that
    expert's weight as sent, 0 elsewhere). Expert ids are distinct within a row."""
    t = topk_idx.shape[0]
    local = topk_idx - rank * experts_per_rank
    col = torch.where((local >= 0) & (local < experts_per_rank), local,
                      torch.full_like(local, experts_per_rank))  # other ranks' experts: a spare column
    hit = torch.zeros(t, experts_per_rank + 1, dtype=torch.bool, device=topk_idx.device)
    hit.scatter_(1, col, True)
    w = torch.zeros(t, experts_per_rank + 1, dtype=torch.float32, device=topk_idx.device)
    w.scatter_(1, col, topk_weights.float())
    return hit[:, :experts_per_rank], w[:, :experts_per_rank]


def _check_routing(res: CheckResult, got_idx: torch.Tensor, got_w: torch.Tensor, want_idx: torch.Tensor,
                   want_w: torch.Tensor, what: str) -> None:
    """Received ids (or map) and weights against the wanted ones, row by row; a received tensor of
    another shape makes every compared row wrong."""
    for got, want, name in ((got_idx, want_idx, "expert ids"), (got_w, want_w, "weights")):
        if got.shape != want.shape:
            res.add(int(want.shape[0]), f"{what}: {name} of shape {tuple(got.shape)} {got.dtype}, "
                                        f"expected {tuple(want.shape)} {want.dtype}")
        else:
            res.add(_bad_rows(got, want), f"{what}: {name} differ")


def in_source_order(out: DispatchOutput) -> DispatchOutput:
    """``out`` in the contract's order, from the rows' own keys (``row_key`` / ``slot_key``, see
    DispatchOutput); a backend that delivers the contract's order sets none and comes back as is.
    Rank-major: the rows [0, num_recv) that hold a row (key >= 0), sorted by key. Expert-major:
    each segment's slots sorted by ``slot_key`` (padding behind), the per-row routing by
    ``row_key``. Only the comparison sees this order; the backend's calls never make it."""
    if out.row_key is None:
        return out
    n = int(out.num_recv)
    key = out.row_key[:n].to(torch.int64)
    held = (key >= 0).nonzero().flatten()
    rows = held[torch.argsort(key[held], stable=True)]
    x, scales = out.x, out.x_scales
    if out.expert_major is None:
        x, scales = x[rows], scales[rows] if scales is not None else None
    elif out.slot_key is not None:
        slots = segment_sort(out.slot_key, out.expert_major)
        x, scales = x[slots], scales[slots] if scales is not None else None
    return replace(out, x=x, x_scales=scales, topk_idx=out.topk_idx[rows], topk_weights=out.topk_weights[rows],
                   num_recv=int(rows.numel()), row_key=None, slot_key=None)


def check_dispatch(out: DispatchOutput, rank: int, world: int, experts_per_rank: int,
                   input_of: Callable[[int], DispatchInput],
                   local_expert_ids: bool = False,
                   source_of: Optional[Callable[[int], torch.Tensor]] = None,
                   routing_map: bool = False) -> CheckResult:
    """``input_of(s)`` rebuilds source rank s's dispatch input on this rank's device, as the
    receivers must get it (quantized where the dispatch quantizes).

    ``local_expert_ids`` (a backend's ``receives_local_expert_ids``): each received expert id
    must be the local index (id - rank * experts_per_rank) where the expert lives on this rank
    and -1 elsewhere, and each weight the sent weight there and 0 elsewhere; still bit-exact.
    ``routing_map`` (a backend's ``routing_as_map``): ``out.topk_idx`` / ``out.topk_weights``
    are per local expert (``local_routing_map``): each row's set of this rank's experts and their
    weights must equal the source's, bit-exact, in any top-k order.
    ``source_of(s)``: source s's bf16 rows before quantization; given, every quantized row
    received is also checked to dequantize within the format's error of its source row.
    ``out.expert_major`` set: payload and scales are checked per expert segment
    (``check_segments``); ids, weights and counts as below, one row per (source, token).
    Rows in a backend's own order are first put in the contract's (``in_source_order``)."""
    res = CheckResult()
    out = in_source_order(out)
    em = out.expert_major
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
            if em is None:
                _check_payload(res, out.x[sl], out.x_scales[sl] if out.x_scales is not None else None,
                               inp, want, source_of(s) if source_of is not None else None,
                               f"rows from rank {s}")
            want_idx, want_w = inp.topk_idx[want], inp.topk_weights[want]
            if routing_map:
                want_idx, want_w = local_routing_map(want_idx, want_w, rank, experts_per_rank)
            elif local_expert_ids:
                mine = hit[:k]
                want_idx = torch.where(mine, local[:k], torch.full_like(want_idx, -1))
                want_w = torch.where(mine, want_w, torch.zeros_like(want_w))
            _check_routing(res, out.topk_idx[sl], out.topk_weights[sl], want_idx, want_w,
                           f"rows from rank {s}")
        offset += n
    res.add(abs(got_n - offset), f"received {got_n} rows, expected {offset}")
    # a backend may report the counts from the host (DeepEP returns them as a Python list)
    got_counts = out.expert_counts.to(device=expected_counts.device, dtype=torch.int64)
    res.add(int((got_counts != expected_counts).sum()),
            f"expert counts {got_counts.tolist()} != {expected_counts.tolist()}")
    if em is not None:
        seg = check_segments(em, out.x, out.x_scales, rank, world, experts_per_rank, input_of, source_of)
        res.add(seg.wrong, seg.first_problem)
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


def _compare_combine(got: torch.Tensor, want_of: Callable[[], torch.Tensor], t: int, h: int,
                     roundings: int = COMBINE_ROUNDINGS) -> CheckResult:
    """Shared by both modes: shape first, then every element within ``roundings`` bf16 roundings
    (COMBINE_RTOL for the usual two) of ``want_of()``."""
    res = CheckResult()
    if tuple(got.shape) != (t, h):
        res.add(max(t, 1), f"combine returned shape {tuple(got.shape)}, expected {(t, h)}")
        return res
    want = want_of()
    ok = torch.isclose(got.float(), want, rtol=roundings * BF16_ROUNDING, atol=COMBINE_ATOL)
    bad = int((~ok.all(dim=1)).sum()) if t else 0
    if bad:
        row = int((~ok.all(dim=1)).nonzero()[0])
        col = int((~ok[row]).nonzero()[0])
        res.add(bad, f"token {row}: got {float(got[row, col])} at column {col}, "
                     f"expected {float(want[row, col])}")
    return res


def check_combine(got: torch.Tensor, inp: DispatchInput, world: int,
                  experts_per_rank: int, roundings: int = COMBINE_ROUNDINGS) -> CheckResult:
    return _compare_combine(got, lambda: expected_combine(inp, world, experts_per_rank),
                            inp.num_tokens, inp.x.shape[1], roundings)


# ---- low-latency mode ----

_factors: Dict[Tuple[int, int, torch.device], torch.Tensor] = {}
_fill_sync: Optional[bool] = None  # switch fill_sync (EPBENCH_FILL_SYNC), read on first use


def ll_expert_factors(first_expert: int, n: int, device: torch.device) -> torch.Tensor:
    """float32 [n]: the stand-in factor of global experts first_expert .. first_expert + n - 1.
    Made once per (first_expert, n, device) and then the same tensor every call (callers must not
    write into it): building it copies a host list to the device, which on a GPU synchronises the
    host with the stream, and the stand-in expert runs between every timed dispatch and combine
    (a synchronisation there takes the next call's host lead away). Diagnostic switch fill_sync
    (EPBENCH_FILL_SYNC=1) builds it anew every call, as before the cache."""
    global _fill_sync
    if _fill_sync is None:
        _fill_sync = bool(options.diagnostic("fill_sync"))
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    key = (first_expert, n, device)
    f = None if _fill_sync else _factors.get(key)
    if f is None:
        f = torch.tensor([expert_factor(first_expert + i) for i in range(n)], dtype=torch.float32, device=device)
        if not _fill_sync:
            _factors[key] = f
    return f


def ll_expert_output(x: torch.Tensor, scales: "torch.Tensor | None", first_expert: int) -> torch.Tensor:
    """bf16 [E, C, hidden]: every slot of a low-latency receive buffer through its stand-in
    expert (padding included: it costs no host synchronisation to skip nothing)."""
    e, c, h = x.shape
    flat = dequantize(x.reshape(e * c, h), scales.reshape(e * c, -1) if scales is not None else None)
    f = ll_expert_factors(first_expert, e, x.device)
    return (flat.view(e, c, h) * f.view(e, 1, 1)).to(torch.bfloat16)


def em_expert_output(x: torch.Tensor, scales: "torch.Tensor | None", table: ExpertMajor,
                     first_expert: int) -> torch.Tensor:
    """bf16 [slots, hidden]: every slot of an expert-major buffer through the stand-in expert
    of its segment (global expert ``first_expert + e``, factor ``expert_factor``), padding
    included (reading the slot count would be a host synchronisation)."""
    e = expert_of_slot(table, x.shape[0])
    f = ll_expert_factors(first_expert, table.counts.shape[0], x.device)[e]
    return (dequantize(x, scales) * f.unsqueeze(1)).to(torch.bfloat16)


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


def check_ll_combine(got: torch.Tensor, inp: DispatchInput, roundings: int = COMBINE_ROUNDINGS) -> CheckResult:
    return _compare_combine(got, lambda: expected_ll_combine(inp), inp.num_tokens, inp.x.shape[1], roundings)
