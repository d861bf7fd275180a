"""Multi-rank worker for the epbench kernels, started by torchrun (one process per GPU).

    torchrun --nproc_per_node 4 tests/gpu/ep_worker.py check [--quick] [--own-rows ce]
    torchrun --nproc_per_node 4 tests/gpu/ep_worker.py bench [--sms 8,16,24,32] [--out DIR]
    torchrun --nproc_per_node 4 tests/gpu/ep_worker.py trace --own-rows all --ce-share 75 --sms 4 [--with-combine]

check: every edge case of the backend interface against epbench.verify (bit-exact dispatch,
combine within its tolerance), fresh random inputs and poisoned outputs each time, both
dispatch implementations, then a deliberate missing peer that must raise, not hang. --own-rows ce: the
backend's own_rows=ce (own rows by the copy engine, token-indexed, padding keyed -1) on the cases it serves
(rank-major, quantize before), each also checked row by row against epbench/layout.py own_first_keys.
bench: the h200x4 and DeepSeek-V3 shapes, bf16 and fp8, dispatch variants x SM counts;
median of the per-call CUDA-event times, slowest rank; prints a table last.
trace: one shape's dispatch (and combine) calls under torch.profiler: every kernel and copy per stream, median
start and duration per rank (where the call's time goes beside its copies).
Exit code 0 only if every check passed. The GPU tests run several checks in one launch through
tests/gpu/suite_worker.py.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List, Sequence

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from epbench.launch import init_distributed  # noqa: E402
from epbench.contract import DispatchInput, RankSetup  # noqa: E402
from epbench.backends.epbench_kernels import EpbenchBackend  # noqa: E402
from epbench import cuda_lib  # noqa: E402
from epbench.inputs import dispatch_input, expert_output, make_tokens, wire_input  # noqa: E402
from epbench.layout import by_source_keys, own_first_keys  # noqa: E402
from epbench.metrics import row_bytes  # noqa: E402
from epbench.routing import RankRouting, dest_mask, route_rank  # noqa: E402
from epbench.scenario import Routing  # noqa: E402
from epbench.verify import check_combine, check_dispatch, check_ll_combine, em_expert_output  # noqa: E402


@dataclass
class Case:
    name: str
    hidden: int
    tokens: Sequence[int]  # per rank (cycled when shorter than the world)
    topk: int
    experts_per_rank: int
    dtype: str = "bf16"
    routing: str = "uniform"  # uniform | zipf | hot | own | one
    quantize: str = "before"  # fused (mxfp8): bf16 rows in, the kernel casts them on the way
    spread: bool = False  # every 32-element block scaled by its own 2^k, k in [-140, 100): bf16 subnormals to huge
    align: int = 0  # >= 1: expert-major receive layout with segments padded to align rows (epbench/layout.py)


def rank_routing(case: Case, rank: int, world: int, seed: int) -> RankRouting:
    t = case.tokens[rank % len(case.tokens)]
    e = case.experts_per_rank
    if case.routing in ("own", "one"):
        g = torch.Generator().manual_seed(seed * 131 + rank)
        target = rank if case.routing == "own" else 0
        idx = torch.stack([torch.randperm(e, generator=g)[: case.topk] for _ in range(t)]) if t else \
            torch.empty(0, case.topk, dtype=torch.int64)
        idx = (idx + target * e).to(torch.int64)
        w = torch.rand(t, case.topk, generator=g) + 0.5
        return RankRouting(idx, (w / w.sum(dim=1, keepdim=True)).float())
    return route_rank(Routing(kind=case.routing, seed=seed), t, case.topk, world * e, rank)


def make_setup(case: Case, rank: int, world: int, device: torch.device, timeout_s: float = 10.0) -> RankSetup:
    return RankSetup(rank=rank, world=world, gpus_per_node=world, device=device, hidden=case.hidden,
                     max_tokens_per_rank=max(max(case.tokens), 1), topk=case.topk,
                     experts_per_rank=case.experts_per_rank, dispatch_dtype=case.dtype, timeout_s=timeout_s,
                     quantize=case.quantize, layout="expert_major" if case.align else "rank_major",
                     align=case.align or 1)


def all_sum(v: int, device: torch.device) -> int:
    on = device if dist.get_backend() == "nccl" else "cpu"  # gloo: ranks share a GPU
    t = torch.tensor([v], dtype=torch.int64, device=on)
    dist.all_reduce(t)
    return int(t.item())


def check_case(be: EpbenchBackend, case: Case, rank: int, world: int, device: torch.device, salt: int,
               sms: int) -> Dict[str, object]:
    routings = [rank_routing(case, r, world, seed=salt) for r in range(world)]

    def source_of(r: int) -> torch.Tensor:
        x = make_tokens(routings[r].num_tokens, case.hidden, 7, r, salt, device)
        if not case.spread:
            return x
        t, blocks = x.shape[0], case.hidden // 32
        k = torch.randint(-140, 100, (t, blocks, 1), generator=torch.Generator().manual_seed(salt * 8 + r))
        scaled = x.double().view(t, blocks, 32) * torch.pow(2.0, k.double()).to(device)
        return scaled.view(t, case.hidden).to(torch.bfloat16)

    def sent_by(r: int) -> DispatchInput:  # what rank r hands to dispatch
        return dispatch_input(source_of(r), routings[r], case.dtype, device, case.quantize)

    def input_of(r: int) -> DispatchInput:  # what the receivers must get from rank r (bit-exact)
        return wire_input(sent_by(r), case.dtype)

    own = sent_by(rank)
    be.poison()
    be.combine_input(None).fill_(float("nan"))
    dist.barrier()
    out = be.dispatch(own, sms)
    be.check_errors()
    d = check_dispatch(out, rank, world, case.experts_per_rank, input_of,
                       source_of=source_of if case.dtype != "bf16" else None)
    n = int(out.num_recv)
    if getattr(be, "own_rows", "sm") == "ce":  # the exact layout: own rows by token index, padding -1, the peers packed after
        want = own_first_keys([dest_mask(r.topk_idx, case.experts_per_rank, world) for r in routings], rank)
        got = out.row_key[:n].cpu() if n == want.numel() else None
        wrong = int(want.numel()) if got is None else int((got != want).sum())
        d.add(wrong, f"own_rows ce: row keys or num_recv ({n}) differ from layout.own_first_keys ({want.numel()})")
    if getattr(be, "own_rows", "sm") == "all":  # every source's rows by token index at source x max_tokens
        want = by_source_keys([dest_mask(r.topk_idx, case.experts_per_rank, world) for r in routings], rank,
                              be.s.max_tokens_per_rank)
        got = out.row_key[:n].cpu() if n == want.numel() else None
        wrong = int(want.numel()) if got is None else int((got != want).sum())
        d.add(wrong, f"own_rows all: row keys or num_recv ({n}) differ from layout.by_source_keys ({want.numel()})")
    y = be.combine_input(out)
    em = out.expert_major
    if em is not None:  # one stand-in expert per local expert, every valid slot filled (padding stays NaN)
        used = int(em.num_slots)
        scales = out.x_scales[:used] if out.x_scales is not None else None
        y[:used].copy_(em_expert_output(out.x[:used], scales, em, rank * case.experts_per_rank))
    else:
        scales = out.x_scales[:n] if out.x_scales is not None else None
        y[:n].copy_(expert_output(out.x[:n], scales, rank))
    dist.barrier()
    got = be.combine(out, sms).clone()
    be.check_errors()
    c = (check_ll_combine(got, wire_input(own, case.dtype)) if em is not None
         else check_combine(got, wire_input(own, case.dtype), world, case.experts_per_rank))
    return {"dispatch_wrong": d.wrong, "combine_wrong": c.wrong,
            "problem": d.first_problem or c.first_problem, "num_recv": n}


CHECK_CASES: List[Case] = [
    Case("uniform bf16 h2048", 2048, [512, 300, 1, 777], 8, 4),
    Case("uniform fp8 h2048", 2048, [512, 300, 1, 777], 8, 4, "fp8"),
    Case("zipf bf16 h4096", 4096, [1000], 8, 16, "bf16", "zipf"),
    Case("hot fp8 h4096", 4096, [1000], 8, 16, "fp8", "hot"),
    Case("T=4095 bf16 h7168 e64", 7168, [4095], 8, 64),
    Case("T=1 bf16", 2048, [1], 8, 4),
    Case("rank with 0 tokens", 2048, [64, 0, 100, 0], 6, 4),
    Case("all ranks 0 tokens", 2048, [0], 4, 4),
    Case("own rank only", 2048, [333], 4, 8, "bf16", "own"),
    Case("every token to rank 0", 3072, [257], 8, 8, "bf16", "one"),
    Case("every token to rank 0 fp8", 3072, [257], 8, 8, "fp8", "one"),
    Case("h200x4 bf16 h8192", 8192, [4096], 8, 2),
    Case("h200x4 fp8 h8192", 8192, [4096], 8, 2, "fp8"),
    Case("fp8 h7168 e64", 7168, [4096, 1000], 8, 64, "fp8"),
    # mxfp8 (issue 26): scales of one E8M0 byte per 32 elements, handed in (before) or cast in the kernel
    # (fused); h2080: 65 scale bytes per row (byte copies, the scale rows padded to 80)
    Case("mxfp8 uniform h2048", 2048, [512, 300, 1, 777], 8, 4, "mxfp8"),
    Case("mxfp8 fused uniform h2048", 2048, [512, 300, 1, 777], 8, 4, "mxfp8", quantize="fused"),
    Case("mxfp8 zipf h4096", 4096, [1000], 8, 16, "mxfp8", "zipf"),
    Case("mxfp8 fused zipf h4096", 4096, [1000], 8, 16, "mxfp8", "zipf", "fused"),
    Case("mxfp8 fused hot h8192", 8192, [1000], 8, 16, "mxfp8", "hot", "fused"),
    Case("mxfp8 hot h2080", 2080, [600], 8, 16, "mxfp8", "hot"),
    Case("mxfp8 fused h2080", 2080, [600, 5], 8, 16, "mxfp8", "uniform", "fused"),
    Case("mxfp8 fused 0 tokens", 2048, [64, 0, 100, 0], 6, 4, "mxfp8", "uniform", "fused"),
    Case("mxfp8 0 tokens", 2048, [64, 0, 100, 0], 6, 4, "mxfp8"),
    Case("mxfp8 fused T=4095 h7168", 7168, [4095], 8, 64, "mxfp8", "uniform", "fused"),
    Case("mxfp8 T=4095 h7168", 7168, [4095, 17], 8, 64, "mxfp8"),
    Case("mxfp8 fused to rank 0 h3072", 3072, [257], 8, 8, "mxfp8", "one", "fused"),
    Case("mxfp8 fused spread scales", 4096, [300, 0, 41], 8, 16, "mxfp8", "zipf", "fused", spread=True),
    Case("mxfp8 spread scales", 4096, [300, 0, 41], 8, 16, "mxfp8", "zipf", spread=True),
]
# expert-major layout (issue 26): align 1 and 128 x bf16 / fp8 / mxfp8 before and fused, uniform / zipf / hot
# routing, a rank with 0 tokens, 4095 tokens, hidden 2048 and 8192; every expert on one rank (own), every token to
# rank 0 (one)
EXPERT_MAJOR: List[Case] = [
    Case(f"em{a} {d}{' fused' if q == 'fused' else ''} {r} h{h}", h, tok, 8, e, d, r, q, align=a)
    for a in (1, 128)
    for d, q in (("bf16", "before"), ("fp8", "before"), ("mxfp8", "before"), ("mxfp8", "fused"))
    for r, h, tok, e in (("uniform", 2048, [512, 0, 300, 1], 4), ("zipf", 8192, [1000, 77], 16),
                         ("hot", 2048, [4095, 3], 16))
] + [
    Case("em16 bf16 own rank", 2048, [333], 4, 8, "bf16", "own", align=16),
    Case("em1 fp8 every token to rank 0", 3072, [257], 8, 8, "fp8", "one", align=1),
    Case("em128 bf16 all ranks 0 tokens", 2048, [0], 4, 4, align=128),
    Case("em1 bf16 T=4095 h7168 e64", 7168, [4095], 8, 64, align=1),
]
CHECK_CASES += EXPERT_MAJOR
QUICK = {"uniform bf16 h2048", "uniform fp8 h2048", "rank with 0 tokens", "T=1 bf16", "every token to rank 0",
         "own rank only", "fp8 h7168 e64", "mxfp8 uniform h2048", "mxfp8 fused uniform h2048",
         "mxfp8 fused h2080", "mxfp8 fused 0 tokens", "mxfp8 fused spread scales"}
MXFP8 = {c.name for c in CHECK_CASES if c.dtype == "mxfp8" and not c.align}
EM = {c.name for c in EXPERT_MAJOR}


def set_impl(be: EpbenchBackend, name: str, warps: int) -> None:
    be.dispatch_impl, be.dispatch_warps = name, warps


def check_cases(args: argparse.Namespace, rank: int, world: int, device: torch.device) -> List[str]:
    """Every case the check flags in ``args`` select, each implementation twice; returns the failed
    ones as 'case impl:warps sms=N' (the same list on every rank)."""
    failed: List[str] = []
    lines = []
    cases = [c for c in CHECK_CASES if (not args.quick or c.name in QUICK) and (not args.mxfp8 or c.name in MXFP8)
             and (c.name in EM) == bool(args.expert_major)]
    # a case routes each token to topk distinct experts: a world too small for that has no such routing
    cases = [c for c in cases if c.topk <= world * c.experts_per_rank]
    if args.own_rows != "sm":  # what a copy can serve: rank-major rows, quantized before (if at all)
        cases = [c for c in cases if not c.align and c.quantize == "before"]
    if args.fused_stores is not None:  # the option changes the fused cast's stores only
        cases = [c for c in cases if c.quantize == "fused"]
    if args.em_push is not None or args.em_sms is not None:  # the options serve the expert-major layout only
        cases = [c for c in cases if c.align]
    impls = [(v.split(":")[0], int(v.split(":")[1]), int(v.split(":")[2])) for v in args.impls.split(",")]
    if args.combine_rows == "ce":  # ranks with other token counts: the ones holding more must stop at once
        uneven = [c for c in cases if len({c.tokens[r % len(c.tokens)] for r in range(world)}) > 1]
        cases = [c for c in cases if c not in uneven]
        failed += [f"{c.name} uneven tokens" for c in uneven if not check_uneven_stop(args, c, rank, world, device,
                                                                                       impls[0][2])]
    for case in cases:
        be = EpbenchBackend(make_setup(case, rank, world, device), own_rows=args.own_rows,
                            fused_stores=args.fused_stores, em_push=args.em_push, em_sms=args.em_sms,
                            combine_rows=args.combine_rows, ce_chunks=args.ce_chunks, ce_streams=args.ce_streams,
                            ce_share=args.ce_share, ce_chunking=args.ce_chunking, pull_kernel=args.pull_kernel,
                            # the tma kernel's shape, given to the constructor: pull_kernel auto then takes tma
                            combine_warps=args.combine_warps, combine_stages=args.combine_stages,
                            combine_chunk=args.combine_chunk)
        if args.notify:
            be.notify_impl = args.notify.split(",")[0]
        for impl, warps, sms in impls:
            set_impl(be, impl, warps)
            for rep in range(2):  # twice: the second call reuses buffers and flags
                salt = zlib.crc32(f"{case.name}/{impl}/{sms}/{rep}".encode()) % 10000
                try:
                    r = check_case(be, case, rank, world, device, salt, sms)
                except RuntimeError as e:
                    r = {"dispatch_wrong": -1, "combine_wrong": -1, "problem": str(e), "num_recv": -1}
                bad = all_sum(int(r["dispatch_wrong"] != 0) + int(r["combine_wrong"] != 0), device)
                if bad:
                    failed.append(f"{case.name} {impl}:{warps} sms={sms} rep {rep}")
                if rank == 0 and (bad or rep == 0):
                    lines.append(f"{'FAIL' if bad else 'ok  '} {case.name:<28} {impl}:{warps} sms={sms:<3} "
                                 f"recv={r['num_recv']} d_wrong={r['dispatch_wrong']} c_wrong={r['combine_wrong']} "
                                 f"{r['problem']}")
        be.close()
        if rank == 0:
            print("\n".join(lines[-3:]), flush=True)
    return failed


def check_uneven_stop(args: argparse.Namespace, case: Case, rank: int, world: int, device: torch.device,
                      sms: int) -> bool:
    """combine_rows ce with token counts that differ between ranks: a rank that holds more tokens than some peer must
    raise at once naming a peer that holds fewer (phase 10, csrc/combine.cu), and every other rank's call must verify
    (its peers pushed at least its rows). True on every rank when that holds everywhere."""
    be = EpbenchBackend(make_setup(case, rank, world, device), own_rows=args.own_rows, combine_rows="ce",
                        ce_chunks=args.ce_chunks, ce_streams=args.ce_streams, ce_share=args.ce_share,
                        ce_chunking=args.ce_chunking)
    counts = [case.tokens[r % len(case.tokens)] for r in range(world)]
    must_stop = any(t < counts[rank] for t in counts)
    try:
        r = check_case(be, case, rank, world, device, 17, sms)
        ok = not must_stop and r["dispatch_wrong"] == 0 and r["combine_wrong"] == 0
        what = "no error raised" if must_stop else f"d_wrong={r['dispatch_wrong']} c_wrong={r['combine_wrong']}"
    except RuntimeError as e:
        what = str(e)
        ok = must_stop and "stopped at once" in what and "same token count" in what
    dist.barrier()
    be.close()
    bad = all_sum(int(not ok), device)
    if rank == 0 or not ok:
        print(f"{'ok  ' if ok else 'FAIL'} {case.name:<28} uneven tokens {counts} under combine_rows ce, rank {rank}: "
              f"{what}", flush=True)
    return bad == 0


def run_check(args: argparse.Namespace, rank: int, world: int, device: torch.device) -> int:
    failures = len(check_cases(args, rank, world, device))
    failures += check_timeout(rank, world, device)
    if rank == 0:
        print(f"check world={world}: {'PASS' if failures == 0 else f'{failures} FAILURES'}", flush=True)
    return failures


def expect_missing_peer(be, start: Callable[[], object], rank: int, world: int, device: torch.device) -> int:
    """Rank world-1 skips the call: every other rank runs ``start()`` (a dispatch of ``be``) and must
    raise naming rank world-1 within the backend's timeout. Closes ``be``; returns the failures."""
    ok = True
    if rank != world - 1:
        t0 = time.time()
        try:
            start()
            be.check_errors()
            ok, msg = False, "no error raised"
        except RuntimeError as e:
            msg = str(e)
            ok = f"waiting for rank {world - 1}" in msg and f"rank {rank} " in msg
        if rank == 0:
            print(f"{'ok  ' if ok else 'FAIL'} missing peer -> {msg!r} after {time.time() - t0:.1f} s", flush=True)
    dist.barrier()
    be.close()
    return all_sum(int(not ok), device)


def check_timeout(rank: int, world: int, device: torch.device) -> int:
    """Rank world-1 skips a dispatch: every other rank must raise naming it, within the timeout."""
    case = Case("timeout", 2048, [16], 4, 4)
    be = EpbenchBackend(make_setup(case, rank, world, device, timeout_s=1.0))
    routing = rank_routing(case, rank, world, seed=1)
    inp = dispatch_input(make_tokens(16, 2048, 7, rank, 1, device), routing, "bf16", device)
    return expect_missing_peer(be, lambda: be.dispatch(inp, 4), rank, world, device)


# ---------------------------------------------------------------- bench
SHAPES = [
    Case("h200x4", 8192, [4096], 8, 2),
    Case("dsv3", 7168, [4096], 8, 64),
]


def remote_rows(routing: RankRouting, rank: int, world: int, e: int) -> int:
    mask = dest_mask(routing.topk_idx, e, world)
    mask[:, rank] = False
    return int(mask.sum())


def time_calls(be: EpbenchBackend, inp: DispatchInput, sms: int, warmup: int, iters: int,
               one: torch.Tensor, do_combine: bool, presleep: int = 0) -> Dict[str, float]:
    """presleep > 0 queues a spin of that many cycles before each start event, so the host has
    enqueued the call before the GPU reaches the event: the time is then GPU work alone."""
    n = warmup + iters
    ev = [[torch.cuda.Event(enable_timing=True) for _ in range(4)] for _ in range(n)]
    host: Dict[str, List[float]] = {"dispatch": [], "combine": []}
    for i in range(n):
        dist.all_reduce(one)
        if presleep:
            torch.cuda._sleep(presleep)
        ev[i][0].record()
        h0 = time.perf_counter()
        out = be.dispatch(inp, sms)
        host["dispatch"].append((time.perf_counter() - h0) * 1e6)
        ev[i][1].record()
        if do_combine:
            dist.all_reduce(one)
            if presleep:
                torch.cuda._sleep(presleep)
            ev[i][2].record()
            h0 = time.perf_counter()
            be.combine(out, sms)
            host["combine"].append((time.perf_counter() - h0) * 1e6)
            ev[i][3].record()
    torch.cuda.synchronize()
    be.check_errors()
    res = {"dispatch": statistics.median(ev[i][0].elapsed_time(ev[i][1]) * 1e3 for i in range(warmup, n)),
           "host_dispatch": statistics.median(host["dispatch"][warmup:])}
    if do_combine:
        res["combine"] = statistics.median(ev[i][2].elapsed_time(ev[i][3]) * 1e3 for i in range(warmup, n))
        res["host_combine"] = statistics.median(host["combine"][warmup:])
    return res


def stamp_phases(be: EpbenchBackend, inp: DispatchInput, sms: int, n: int, one: torch.Tensor,
                 device: torch.device) -> str:
    """n extra calls with the debug stamps on (GPU-only: a spin before each), median of each phase
    per rank in us; start = this rank's notify start minus the earliest rank's (same-host
    %globaltimer, assumed common)."""
    names = ["block_counted", "counted", "published", "slots", "peers_seen", "notify_end", "data_start",
             "data_first", "data_last", "data_end"]
    be.set_debug_stamps(True)
    per: List[List[float]] = []
    for _ in range(n):
        dist.all_reduce(one)
        torch.cuda._sleep(200000)
        be.dispatch(inp, sms)
        torch.cuda.synchronize()
        st = be.debug_stamps()
        t = torch.tensor([st["notify_start"]] + [st[k] for k in names], dtype=torch.int64, device=device)
        allt = [torch.empty_like(t) for _ in range(dist.get_world_size())]
        dist.all_gather(allt, t)
        start0 = min(int(a[0]) for a in allt)
        prev, row = int(t[0]), [(int(t[0]) - start0) / 1e3]
        for i in range(1, len(t)):
            cur = int(t[i]) if int(t[i]) >= prev else prev  # stamps a variant does not write
            row.append((cur - prev) / 1e3)
            prev = cur
        sms_used = sum(bin(st[f"sm_mask{i}"] & (2 ** 64 - 1)).count("1") for i in range(3))
        per.append(row + [float(sms_used)])
    be.set_debug_stamps(False)
    med = [statistics.median(r[i] for r in per) for i in range(len(per[0]))]
    allm = [torch.zeros(len(med), dtype=torch.float64, device=device) for _ in range(dist.get_world_size())]
    dist.all_gather(allm, torch.tensor(med, dtype=torch.float64, device=device))
    cols = ["start"] + names + ["distinct_sms"]
    return " | ".join(f"{c}=" + ",".join(f"{float(m[i]):.1f}" for m in allm) for i, c in enumerate(cols))


def run_bench(args: argparse.Namespace, rank: int, world: int, device: torch.device) -> int:
    sms_list = [int(s) for s in args.sms.split(",")]
    variants = [v.split(":") for v in args.variants.split(",")]
    one = torch.ones(1, device=device)
    rows: List[Dict[str, object]] = []
    stamp_lines: List[str] = []
    notify_impls = args.notify.split(",") if args.notify else [None]
    for shape in SHAPES:
        for dtype in ("bf16", "fp8"):
            case = Case(shape.name, shape.hidden, shape.tokens, shape.topk, shape.experts_per_rank, dtype)
            # --combine-variants shape the tma kernel: pull_kernel tma unless --pull-kernel says otherwise (the rows
            # then name the kernel that ran)
            be = EpbenchBackend(make_setup(case, rank, world, device), own_rows=args.own_rows,
                                pull_kernel=args.pull_kernel or "tma")
            routing = rank_routing(case, rank, world, seed=3)
            x = make_tokens(routing.num_tokens, case.hidden, 7, rank, 99, device)
            inp = dispatch_input(x, routing, dtype, device)
            be.combine_in.copy_(torch.randn(be.combine_in.shape, device=device).to(torch.bfloat16))
            d_bytes = remote_rows(routing, rank, world, case.experts_per_rank) * row_bytes(dtype, case.hidden)
            c_bytes = remote_rows(routing, rank, world, case.experts_per_rank) * 2 * case.hidden
            for v, nimpl in [(v, n) for n in notify_impls for v in variants]:
                if nimpl is not None:
                    be.notify_impl = nimpl
                impl, warps = v[0], int(v[1])
                set_impl(be, impl, warps)
                vinp = inp
                for sms in sms_list:
                    # combine depends on neither dtype nor dispatch variant: time it with the first variant
                    do_combine = dtype == "bf16" and v is variants[0] and nimpl == notify_impls[0]
                    t = time_calls(be, vinp, sms, args.warmup, args.iters, one, False, args.presleep)
                    for cv in args.combine_variants.split(",") if do_combine else []:
                        parts = cv.split(":")  # warps[:stages[:chunk]]; warps 0: by SM count
                        be.combine_warps = int(parts[0])
                        be.combine_stages = int(parts[1]) if len(parts) > 1 else 2
                        be.combine_chunk = int(parts[2]) if len(parts) > 2 else 2048
                        tc = time_calls(be, vinp, sms, args.warmup, args.iters, one, True, args.presleep)
                        ran = be.effective_config().get("combine_impl", "tma")
                        name = cv if ran == "tma" else f"{ran} ({cv} not used)"  # the kernel that ran
                        t[f"combine {name}"], t[f"host_combine {name}"] = tc["combine"], tc["host_combine"]
                    label = ":".join(v) + ("" if len(notify_impls) == 1 else f"/{nimpl}")
                    if args.stamps:
                        line = stamp_phases(be, vinp, sms, args.stamps, one, device)
                        stamp_lines.append(f"{shape.name} {dtype} {label} sms={sms}: {line}")
                    for op in [o for o in t if o == "dispatch" or o.startswith("combine")]:
                        us = t[op]
                        nbytes = d_bytes if op == "dispatch" else c_bytes
                        host_us = t[f"host_{op}"]
                        op, cv = (op.split(" ") + [""])[:2]
                        stats = torch.tensor([us, -nbytes / us / 1e3, host_us], dtype=torch.float64,
                                             device=device)
                        dist.all_reduce(stats, op=dist.ReduceOp.MAX)  # slowest time, lowest busbw
                        rows.append({"shape": shape.name, "dtype": dtype if op == "dispatch" else "bf16",
                                     "op": op, "variant": label if op == "dispatch" else cv,
                                     "sms": sms, "time_us": round(float(stats[0]), 1),
                                     "busbw_gbps": round(-float(stats[1]), 1), "host_us": round(float(stats[2]), 1)})
            be.close()
    if rank == 0:
        if args.out:
            Path(args.out).mkdir(parents=True, exist_ok=True)
            (Path(args.out) / f"bench_world{world}{'_gpuonly' if args.presleep else ''}.json").write_text(json.dumps(rows, indent=1))
        if stamp_lines:
            print("per-phase GPU time (us, median; one value per rank; start = skew vs earliest rank)")
            print("\n".join(stamp_lines))
        print(f"{'shape':<7} {'op':<8} {'dtype':<5} {'variant':<14} {'sms':>4} {'time_us':>9} {'busbw_gbps':>10} "
              f"{'host_us':>8}")
        for r in rows:
            print(f"{r['shape']:<7} {r['op']:<8} {r['dtype']:<5} {r['variant']:<14} {r['sms']:>4} "
                  f"{r['time_us']:>9} {r['busbw_gbps']:>10} {r['host_us']:>8}")
    return 0


# ---------------------------------------------------------------- trace
def _call_activities(trace: dict) -> List[List[tuple]]:
    """The GPU activities of each profiled call, from a kineto chrome trace: a call starts where a spin kernel
    (torch.cuda._sleep, queued just before it) ends and stops at the next NCCL kernel (the all-reduce queued before
    the next call's spin); each activity is (name, stream, start - call start, duration), times in us."""
    acts = sorted((e for e in trace.get("traceEvents", []) if e.get("ph") == "X"
                   and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")), key=lambda e: e["ts"])
    calls: List[List[tuple]] = []
    t0 = None
    for e in acts:
        name = e["name"]
        if "spin" in name or "sleep" in name.lower():
            t0 = e["ts"] + e["dur"]
            calls.append([])
        elif name.startswith("nccl"):
            t0 = None
        elif t0 is not None:
            short = name.replace("(anonymous namespace)::", "").split("(")[0].split("<")[0].replace("void ", "").strip()
            if e["cat"] != "kernel":
                short = name
            calls[-1].append((short, int(e.get("args", {}).get("stream", -1)), e["ts"] - t0, e["dur"]))
    return [c for c in calls if c]


def _median_timeline(calls: List[List[tuple]]) -> List[tuple]:
    """Per activity (name, stream, n-th of that name on that stream in its call): median start and duration over
    the calls, sorted by start; streams renumbered 0, 1, ... by first appearance."""
    keyed: Dict[tuple, List[tuple]] = {}
    for c in calls:
        seen: Dict[tuple, int] = {}
        for name, stream, start, dur in c:
            k = (name, stream)
            seen[k] = seen.get(k, 0) + 1
            keyed.setdefault((name, stream, seen[k]), []).append((start, dur))
    rows = [(k[0], k[1], statistics.median(v[0] for v in vals), statistics.median(v[1] for v in vals), len(vals))
            for k, vals in keyed.items()]
    rows.sort(key=lambda r: r[2])
    order: Dict[int, int] = {}
    for r in rows:
        order.setdefault(r[1], len(order))
    return [(name, order[stream], start, dur, n) for name, stream, start, dur, n in rows]


def run_trace(args: argparse.Namespace, rank: int, world: int, device: torch.device) -> int:
    """trace: every GPU activity (kernel, copy) of the dispatch call, and of the combine with --with-combine, on
    each stream, from torch.profiler: median start from the call's start and duration over --iters calls, per
    rank. Each call follows an all-reduce and a GPU spin (--presleep), so the host has queued it before it starts
    and the times are the GPU's. With --out, each rank's chrome trace is kept there."""
    from torch.profiler import ProfilerActivity, profile
    shape = {c.name: c for c in SHAPES}[args.shape]
    case = Case(shape.name, shape.hidden, shape.tokens, shape.topk, shape.experts_per_rank, "bf16")
    if case.topk > world * case.experts_per_rank:  # one line, not a routing traceback from every rank
        if rank == 0:
            print(f"trace --shape {args.shape}: top-k {case.topk} needs {case.topk} experts, {world} ranks x "
                  f"{case.experts_per_rank} give {world * case.experts_per_rank}: more ranks or another shape",
                  file=sys.stderr, flush=True)
        return 1
    extra = {k: v for k, v in (("combine_rows", args.combine_rows), ("ce_share", args.ce_share),
                               ("ce_chunks", args.ce_chunks), ("ce_streams", args.ce_streams),
                               ("ce_chunking", args.ce_chunking), ("pull_kernel", args.pull_kernel)) if v is not None}
    one = torch.ones(1, device=device)
    lines: List[str] = []
    for sms in [int(s) for s in args.sms.split(",")]:
        be = EpbenchBackend(make_setup(case, rank, world, device), own_rows=args.own_rows, **extra)
        routing = rank_routing(case, rank, world, seed=3)
        inp = dispatch_input(make_tokens(routing.num_tokens, case.hidden, 7, rank, 99, device), routing, "bf16",
                             device)
        be.combine_in.copy_(torch.randn(be.combine_in.shape, device=device).to(torch.bfloat16))
        timed = time_calls(be, inp, sms, args.warmup, args.iters, one, args.with_combine, args.presleep or 200000)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(args.iters):
                dist.all_reduce(one)
                torch.cuda._sleep(args.presleep or 200000)
                out = be.dispatch(inp, sms)
                if args.with_combine:
                    be.combine(out, sms)
            dist.all_reduce(one)
            torch.cuda.synchronize()
        waits = bulk_waits(be, inp, sms, one, args) if args.with_combine else ""
        be.check_errors()
        be.close()
        path = Path(args.out or "/tmp") / f"trace_{args.shape}_{args.own_rows}_sms{sms}_rank{rank}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(path))
        timeline = _median_timeline(_call_activities(json.loads(path.read_text())))
        if not args.out:
            path.unlink()
        mine = [f"rank {rank} sms={sms} {args.own_rows} {extra}: dispatch {timed['dispatch']:.1f} us"
                + (f", combine {timed['combine']:.1f} us" if args.with_combine else "") + " (events, median)"]
        mine += [f"  stream {s} {start:8.1f} +{dur:7.1f} -> {start + dur:8.1f}  {name} (x{n})"
                 for name, s, start, dur, n in timeline] + ([waits] if waits else [])
        gathered: List[List[str]] = [[] for _ in range(world)]
        dist.all_gather_object(gathered, mine)
        lines += [ln for g in gathered for ln in g]
    if rank == 0:
        print("\n".join(lines), flush=True)
    return 0


def bulk_waits(be: EpbenchBackend, inp: object, sms: int, one: torch.Tensor, args: argparse.Namespace) -> str:
    """trace --with-combine where the combine ran its bulk kernel (pull_kernel bulk, or combine_rows ce at 3-4
    ranks): with debug stamps on, --iters more calls, each warp's clock64 cycles waiting (loaders: for a free stage
    and, ce, a chunk flag; summers: for a full stage), working (loaders: issuing a unit's copies; summers: summing,
    storing and freeing a stage), finding holders, and starting, over its cycles in all, summed over warps
    (csrc/common.cuh kStampCb*); "" where another kernel ran."""
    if be.effective_config().get("combine_impl") not in ("bulk", "ce") or (be.s.world < 3 and be.combine_rows == "ce"):
        return ""
    before = be.combine(be.dispatch(inp, sms), sms).clone()
    lines = [bulk_waits_one(be, inp, sms, one, args, skip) for skip in args.cb_skip.split(",")]
    if args.cb_skip != "none":  # the aid off again: the same combine as before it, bit for bit
        same = torch.equal(be.combine(be.dispatch(inp, sms), sms), before)
        lines.append(f"  after the measuring aid: combine {'bit-equal to' if same else 'DIFFERENT FROM'} the one before")
    return "\n".join(lines)


def bulk_waits_one(be: EpbenchBackend, inp: object, sms: int, one: torch.Tensor, args: argparse.Namespace,
                   skip: str) -> str:
    """bulk_waits' counters over --iters stamped calls with the summers leaving out `skip` (cuda_lib.CB_SKIP: none,
    or the measuring aid's stores / smem / reads, whose outputs are not written), and those calls' combine, timed with
    events (median; the counting instantiation, so comparable among these lines only)."""
    be.set_debug_stamps(True)
    be.set_cb_skip(skip)
    sums = {k: 0 for k in cuda_lib.STAMPS if k.startswith("cb_")}  # the bulk kernel's counters (csrc/common.cuh)
    times, written = [], 0
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
    for _ in range(args.iters):
        dist.all_reduce(one)
        out = be.dispatch(inp, sms)
        out.handle.out.zero_()
        dist.all_reduce(one)
        ev[0].record()
        res = be.combine(out, sms)
        ev[1].record()
        torch.cuda.synchronize()
        times.append(1000.0 * ev[0].elapsed_time(ev[1]))
        written += int(res.count_nonzero())
        st = be.debug_stamps()
        for k in sums:
            sums[k] += st[k]
    be.set_cb_skip("none")
    be.set_debug_stamps(False)
    pct = lambda part, whole: 100.0 * sums[part] / sums[whole] if sums[whole] else float("nan")
    every = sums["cb_loader_busy"] + sums["cb_summer_busy"]
    flag = " or a chunk flag" if be.combine_rows == "ce" else ""
    left = {"none": "", "stores": " the summers storing nothing,", "reads": " the summers reading nothing,",
            "smem": " the summers summing register words, no shared memory read, nothing stored,"}[skip]
    seen = ""
    if skip != "none":
        seen = f"; outputs {'left unwritten' if written == 0 else f'WRITTEN ({written} elements)'}"
    if skip in ("stores", "smem"):
        seen += f", sums folded {sums['cb_fold']:#x}"
    return (f"  stamped combine,{left} {statistics.median(times):.1f} us (median of {args.iters}, events){seen}\n"
            f"  bulk kernel waits ({args.iters} calls, stamps on): loaders {pct('cb_loader_wait', 'cb_loader_busy'):.1f} % "
            f"of their cycles waiting for a free stage{flag}, summers {pct('cb_summer_wait', 'cb_summer_busy'):.1f} % "
            f"for a full one; {sums['cb_units'] / args.iters:.0f} units a call\n"
            f"  bulk kernel work: loaders issuing copies {pct('cb_loader_issue', 'cb_loader_busy'):.1f} %, finding "
            f"holders {pct('cb_loader_prep', 'cb_loader_busy'):.1f} %; summers summing and storing "
            f"{pct('cb_summer_sum', 'cb_summer_busy'):.1f} %, finding holders and weights "
            f"{pct('cb_summer_prep', 'cb_summer_busy'):.1f} %; every warp's start ({'token check' if be.combine_rows == 'ce' else 'ready handshake'}, block barrier) "
            f"{100.0 * sums['cb_ready'] / every if every else float('nan'):.1f} % of all cycles")


def cb_skips(text: str) -> str:
    """--cb-skip: a comma list of cuda_lib.CB_SKIP's names."""
    bad = [w for w in text.split(",") if w not in cuda_lib.CB_SKIP]
    if bad:
        raise argparse.ArgumentTypeError(f"{','.join(bad)}: not one of {', '.join(cuda_lib.CB_SKIP)}")
    return text


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["check", "bench", "trace"])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--mxfp8", action="store_true", help="check: the mxfp8 cases only (with --quick: the quick ones)")
    ap.add_argument("--expert-major", action="store_true", help="check: the expert-major layout cases (only those)")
    ap.add_argument("--impls", default="lean:16:8,lean:32:5,lean:16:3,lean_dyn:16:8,lean_dyn:16:24,lean_dyn:32:3,"
                    "lean_dyn:16:1", help="check: dispatch implementations as impl:warps:sms")
    ap.add_argument("--sms", default="8,16,24,32")
    ap.add_argument("--variants", default="lean_dyn:16,lean:16", help="bench: dispatch implementations impl:warps")
    ap.add_argument("--combine-variants", default="0",
                    help="bench: combine variants as warps[:stages[:chunk]] (0 = by SM count, 16:2:2048, ...)")
    ap.add_argument("--combine-warps", type=int, default=None, help="check: combine warps (0: by SM count)")
    ap.add_argument("--combine-stages", type=int, default=None, help="check: tma combine stages per warp")
    ap.add_argument("--combine-chunk", type=int, default=None, help="check: tma combine bytes per holder and stage")
    ap.add_argument("--notify", default=None,
                    help="notify kernel variants to bench (grid,staged), check: the first (default: the backend's)")
    ap.add_argument("--stamps", type=int, default=0, help="extra calls with per-phase debug stamps (0: none)")
    ap.add_argument("--own-rows", default="sm", choices=["sm", "ce", "all"],
                    help="the backend's own_rows: sm (kernels store own rows), ce (copy engine) or all (copy "
                         "engines move every row); ce and all check the rank-major, quantize-before cases only")
    ap.add_argument("--combine-rows", default=None, choices=["pull", "ce"],
                    help="the backend's combine_rows (default: the backend's); ce needs --own-rows all and checks the "
                         "cases whose ranks hold the same token count, the others for the stop they must make")
    ap.add_argument("--ce-chunks", type=int, default=None, choices=[4, 5, 6, 8, 16, 32],
                    help="combine_rows ce: the backend's ce_chunks (default: the backend's)")
    ap.add_argument("--cb-skip", default="none", type=cb_skips,
                    help="trace --with-combine, bulk kernel: stamped runs each leaving out none / the summers' stores "
                         "/ their reads / their shared-memory reads and stores (comma list of none, stores, reads, "
                         "smem; a measuring aid: outputs unwritten)")
    ap.add_argument("--pull-kernel", default=None, choices=["auto", "tma", "bulk"],
                    help="the backend's pull_kernel (default: the backend's)")
    ap.add_argument("--ce-chunking", default=None, choices=["even", "grow"],
                    help="combine_rows ce: the backend's ce_chunking (default: the backend's)")
    ap.add_argument("--ce-streams", type=int, default=None, choices=[1, 2, 4],
                    help="combine_rows ce: the backend's ce_streams (default: the backend's)")
    ap.add_argument("--ce-share", type=int, default=None, choices=[25, 50, 75, 100],
                    help="own_rows all: the backend's ce_share (default: the backend's)")
    ap.add_argument("--fused-stores", type=int, default=None, choices=[8, 16],
                    help="the backend's fused_stores (default: the backend's; check: given, the fused cases only)")
    ap.add_argument("--em-sms", type=int, default=None,
                    help="the backend's em_sms (default: the backend's; check: given, the expert-major cases only)")
    ap.add_argument("--em-push", default=None, choices=["auto", "receiver", "sender", "wide"],
                    help="the backend's em_push (default: the backend's; check: given, the expert-major cases only)")
    ap.add_argument("--presleep", type=int, default=0, help="GPU spin cycles before each timed call")
    ap.add_argument("--shape", default="dsv3", choices=[c.name for c in SHAPES], help="trace: the shape")
    ap.add_argument("--with-combine", action="store_true", help="trace: the combine calls too")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--out", default=os.environ.get("OUT", ""))
    return ap


def main() -> int:
    args = parser().parse_args()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    # one GPU per rank where the host has enough, else ranks share them (gloo process group)
    device = init_distributed("cuda").device
    try:
        run = {"check": run_check, "bench": run_bench, "trace": run_trace}[args.mode]
        failures = run(args, rank, world, device)
    finally:
        dist.destroy_process_group()
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
