"""Multi-rank worker for the low-latency kernels (backend epbench-ll), started by torchrun.

    torchrun --nproc_per_node 4 tests/gpu/ll_worker.py check|orders|lines [--quick] [--sync grid|token]

check: each case runs the kernels and the NCCL reference's low-latency path on the same inputs: both
must pass epbench.verify's low-latency checks (bit-exact dispatch per (expert, slot), combine
within its tolerance) and agree with each other; fresh random inputs and poisoned outputs
each time, twice per case (buffers and flags reused), then once more through CUDA-graph replays
(captured once, replayed twice with new token values). Last, a deliberately missing peer must
raise naming it, not hang. orders: each case's combine in both push orders (backend option
combine_order) and, with token sync, after a dispatch of chunk peer units (option dispatch_units), with
batched flag releases (option combine_release) and with peer rows put straight into their first slot or sent as
inline words or tagged lines (option dispatch_place), launched and through graph replays: every
output verified and every combine bit-equal. lines (token sync): many line dispatches, each after an inline one and
with fresh token values, every one verified (a torn line shows the previous call's bytes). Exit code 0 only if every check passed. The GPU tests run several of these in one
launch through tests/gpu/suite_worker.py.
"""

from __future__ import annotations

import argparse
import os
import sys
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, List, Sequence

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from ep_worker import expect_missing_peer  # noqa: E402

from epbench.launch import init_distributed  # noqa: E402
from epbench.contract import DispatchInput, RankSetup  # noqa: E402
from epbench.backends.epbench_ll import EpbenchLowLatencyBackend  # noqa: E402
from epbench.backends.reference import ReferenceBackend  # noqa: E402
from epbench.driver import PointCalls, graph_calls, launch_calls  # noqa: E402
from epbench.inputs import dispatch_input, make_tokens  # noqa: E402
from epbench.routing import RankRouting, route_rank  # noqa: E402
from epbench.scenario import Routing  # noqa: E402
from epbench.verify import COMBINE_RTOL, check_ll_combine, check_ll_dispatch, ll_expert_output  # noqa: E402


@dataclass
class Case:
    name: str
    hidden: int
    tokens: Sequence[int]  # per rank (cycled when shorter than the world)
    topk: int
    experts_per_rank: int
    dtype: str = "bf16"
    routing: str = "uniform"  # uniform | zipf | hot | expert0 (every token picks expert 0)


def rank_routing(case: Case, rank: int, world: int, seed: int) -> RankRouting:
    t = case.tokens[rank % len(case.tokens)]
    n = world * case.experts_per_rank
    if case.routing == "expert0":
        g = torch.Generator().manual_seed(seed * 131 + rank)
        rest = [torch.randperm(n - 1, generator=g)[: case.topk - 1] + 1 for _ in range(t)]
        idx = torch.stack([torch.cat([torch.zeros(1, dtype=torch.int64), r]) for r in rest]) if t else \
            torch.empty(0, case.topk, dtype=torch.int64)
        w = torch.rand(t, case.topk, generator=g) + 0.5
        return RankRouting(idx.to(torch.int64), (w / w.sum(dim=1, keepdim=True)).float())
    return route_rank(Routing(kind=case.routing, seed=seed), t, case.topk, n, rank)


CASES: List[Case] = [
    Case("dsv3 fp8 T=128", 7168, [128], 8, 64, "fp8"),
    Case("dsv3 bf16 T=128", 7168, [128], 8, 64, "bf16"),
    Case("zipf bf16", 4096, [96], 8, 16, "bf16", "zipf"),
    Case("hot fp8", 4096, [96], 8, 16, "fp8", "hot"),
    Case("uneven tokens fp8", 2048, [33, 7, 64, 1], 6, 8, "fp8"),
    Case("rank with 0 tokens", 2048, [32, 0, 17, 0], 4, 4),
    Case("all ranks 0 tokens", 2048, [0], 4, 4, "fp8"),
    Case("T=1 bf16", 7168, [1], 8, 64),
    Case("T=1 fp8", 7168, [1], 8, 64, "fp8"),
    Case("every token to expert 0", 2048, [100], 8, 8, "bf16", "expert0"),
    Case("every token to expert 0 fp8", 2048, [100], 8, 8, "fp8", "expert0"),
    Case("top-1, one expert", 2048, [64], 1, 4, "bf16", "expert0"),
    Case("T=256 fp8", 7168, [256], 8, 64, "fp8"),
]
QUICK = {"dsv3 fp8 T=128", "rank with 0 tokens", "T=1 bf16", "every token to expert 0"}
# mode lines: the shapes where 128-byte lines tore on 2 x H200 (hidden 2048 bf16 at 4 SMs, notes/LATENCY-NEXT.md),
# and the DeepSeek-V3 one
LINE_CASES: List[Case] = [
    Case("lines bf16", 2048, [64], 4, 4),
    Case("lines top-1, one expert", 2048, [64], 1, 4, "bf16", "expert0"),
    Case("lines dsv3 fp8", 7168, [32], 8, 64, "fp8"),
]
LINE_CALLS = 40  # of each line size, each after an inline call, each pair with fresh token values


def setup_of(case: Case, rank: int, world: int, device: torch.device, timeout_s: float = 10.0) -> RankSetup:
    return RankSetup(rank=rank, world=world, gpus_per_node=world, device=device, hidden=case.hidden,
                     max_tokens_per_rank=max(max(case.tokens), 1), topk=case.topk,
                     experts_per_rank=case.experts_per_rank, dispatch_dtype=case.dtype, timeout_s=timeout_s,
                     mode="low_latency")


def all_sum(v: int, device: torch.device) -> int:
    on = device if dist.get_backend() == "nccl" else "cpu"  # gloo: ranks share a GPU
    t = torch.tensor([v], dtype=torch.int64, device=on)
    dist.all_reduce(t)
    return int(t.item())


def one_call(be, calls: PointCalls, own: DispatchInput, rank: int, world: int, e: int,
             input_of: Callable[[int], DispatchInput]):
    """Poison, dispatch, check, stand-in experts, combine, check; returns (dispatch, combine, result)."""
    calls.load(own)
    be.poison()
    be.ll_combine_input(None).fill_(float("nan"))
    torch.cuda.synchronize()  # the poison done before any peer's dispatch may write this rank's x (slot placement)
    dist.barrier()
    out = calls.dispatch()
    torch.cuda.synchronize()
    if hasattr(be, "check_errors"):
        be.check_errors()
    d = check_ll_dispatch(out, rank, world, e, input_of)
    be.ll_combine_input(out).copy_(ll_expert_output(out.x, out.x_scales, rank * e))
    dist.barrier()
    got = calls.combine(out).clone()
    torch.cuda.synchronize()
    if hasattr(be, "check_errors"):
        be.check_errors()
    return d, check_ll_combine(got, own), got


def run_case(case: Case, rank: int, world: int, device: torch.device, sms: int, sync: str) -> List[str]:
    """Problems found on this rank (empty: all good)."""
    problems: List[str] = []
    kernels = EpbenchLowLatencyBackend(setup_of(case, rank, world, device), ll_sync=sync)
    reference = ReferenceBackend(setup_of(case, rank, world, device))
    for rep in range(2):
        salt = zlib.crc32(f"{case.name}/{rep}".encode()) % 10000
        routings = [rank_routing(case, r, world, seed=salt) for r in range(world)]

        def input_of(r: int) -> DispatchInput:
            x = make_tokens(routings[r].num_tokens, case.hidden, 7, r, salt, device)
            return dispatch_input(x, routings[r], case.dtype, device)

        own = input_of(rank)
        results = {}
        for label, be in (("kernels", kernels), ("reference", reference)):
            d, c, got = one_call(be, launch_calls(be, own, sms, rank), own, rank, world, case.experts_per_rank, input_of)
            results[label] = got
            for what, r in (("dispatch", d), ("combine", c)):
                if r.wrong:
                    problems.append(f"{label} {what} rep {rep}: {r.wrong} wrong ({r.first_problem})")
        if not torch.allclose(results["kernels"].float(), results["reference"].float(), rtol=2 * COMBINE_RTOL,
                              atol=1e-6):
            problems.append(f"rep {rep}: kernels' combine differs from the reference's")
        if rep == 1:  # the same call through CUDA-graph replays, twice with new token values
            calls = graph_calls(kernels, own, sms, rank)
            for g in range(2):
                gsalt = salt + 1 + g
                fresh = [dispatch_input(make_tokens(routings[r].num_tokens, case.hidden, 7, r, gsalt, device),
                                        routings[r], case.dtype, device) for r in range(world)]
                d, c, _ = one_call(kernels, calls, fresh[rank], rank, world, case.experts_per_rank,
                                   lambda r: fresh[r])
                for what, r in (("dispatch", d), ("combine", c)):
                    if r.wrong:
                        problems.append(f"graph replay {g} {what}: {r.wrong} wrong ({r.first_problem})")
    kernels.close()
    return problems


def run_orders(case: Case, rank: int, world: int, device: torch.device, sms: int, sync: str) -> List[str]:
    """The combine in both push orders on the same inputs, and (token sync) the dispatch with chunk
    peer units (option dispatch_units), slot, inline and line placement (dispatch_place) and the batched
    release (combine_release): each verified, and every combine output bit-equal (csrc/ll_combine.cu,
    push_unit: only the order of independent pushes differs; chunk units and every placement land the same
    bytes in the same places, tmap / tw included)."""
    problems: List[str] = []
    kernels = EpbenchLowLatencyBackend(setup_of(case, rank, world, device), ll_sync=sync)
    salt = zlib.crc32(f"{case.name}/orders".encode()) % 10000
    routings = [rank_routing(case, r, world, seed=salt) for r in range(world)]
    inputs = [dispatch_input(make_tokens(routings[r].num_tokens, case.hidden, 7, r, salt, device), routings[r],
                             case.dtype, device) for r in range(world)]
    got = {}
    configs = [("source", "row", "unit", "stage"), ("rotated", "row", "unit", "stage")] + (
        [("rotated", "chunk", "unit", "stage"), ("rotated", "row", "batch", "stage"),
         ("rotated", "row", "batch", "slot"), ("rotated", "chunk", "unit", "slot"),
         ("rotated", "row", "batch", "inline"), ("rotated", "chunk", "unit", "inline"),
         ("rotated", "row", "batch", "line"), ("rotated", "row", "unit", "line"),
         ("rotated", "row", "batch", "line128")] if sync == "token" else [])
    for order, units, release, place in configs:
        kernels.use_combine_order(order)  # before the graphs below are captured: they keep it
        kernels.use_dispatch_units(units)  # every rank switches before the same call
        kernels.use_dispatch_place(place)  # likewise
        kernels.use_combine_release(release)
        for how, calls in (("launch", launch_calls(kernels, inputs[rank], sms, rank)),
                           ("graph", graph_calls(kernels, inputs[rank], sms, rank))):
            d, c, got[order, units, release, place, how] = one_call(
                kernels, calls, inputs[rank], rank, world, case.experts_per_rank, lambda r: inputs[r])
            for what, r in (("dispatch", d), ("combine", c)):
                if r.wrong:
                    problems.append(f"{order} {units} {release} {place} {how} {what}: {r.wrong} wrong "
                                    f"({r.first_problem})")
    bits = {k: v.view(torch.int16) for k, v in got.items()}
    first = bits["source", "row", "unit", "stage", "launch"]
    for key, b in bits.items():
        if not torch.equal(b, first):
            rows = int((b != first).any(dim=1).sum())
            problems.append(f"{' '.join(key)}: {rows} combine rows differ in their bits from source row launch")
    kernels.close()
    return problems


def run_lines(case: Case, rank: int, world: int, device: torch.device, sms: int, sync: str) -> List[str]:
    """dispatch_place line and line128, LINE_CALLS times each, in turn, each after an inline call with the same
    fresh token values (so a line read before all of it landed shows older bytes): every dispatch and combine
    verified. 128-byte lines without line128's second load failed this on 2 x H200 (the first 64 bytes of a line
    stale beside a current tag); token sync."""
    problems: List[str] = []
    if sync != "token":
        return problems
    kernels = EpbenchLowLatencyBackend(setup_of(case, rank, world, device), ll_sync="token", dispatch_units="row")
    routings = [rank_routing(case, r, world, seed=5) for r in range(world)]
    wrong = {"inline": 0, "line": 0, "line128": 0}
    for n in range(2 * LINE_CALLS):
        i, line = n // 2, ("line", "line128")[n % 2]
        inputs = [dispatch_input(make_tokens(routings[r].num_tokens, case.hidden, 7, r, 100 + n, device), routings[r],
                                 case.dtype, device) for r in range(world)]
        for place in ("inline", line):
            kernels.use_dispatch_place(place)  # every rank switches before the same call
            d, c, _ = one_call(kernels, launch_calls(kernels, inputs[rank], sms, rank), inputs[rank], rank, world,
                               case.experts_per_rank, lambda r: inputs[r])
            for what, r in (("dispatch", d), ("combine", c)):
                if r.wrong:
                    wrong[place] += r.wrong
                    if len(problems) < 3:
                        problems.append(f"call {i} {place} {what}: {r.wrong} wrong ({r.first_problem})")
    if any(wrong.values()):
        problems.append(f"wrong rows in {LINE_CALLS} calls each: {wrong}")
    kernels.close()
    return problems


def check_timeout(rank: int, world: int, device: torch.device, sync: str) -> int:
    """Rank world-1 skips a dispatch: every other rank must raise naming it, within the timeout."""
    case = Case("timeout", 2048, [16], 4, 4)
    be = EpbenchLowLatencyBackend(setup_of(case, rank, world, device, timeout_s=1.0), ll_sync=sync)
    routing = rank_routing(case, rank, world, seed=1)
    inp = dispatch_input(make_tokens(16, 2048, 7, rank, 1, device), routing, "bf16", device)
    return expect_missing_peer(be, lambda: be.ll_dispatch(inp, 4), rank, world, device)


def check_units_mismatch(rank: int, world: int, device: torch.device, sync: str) -> int:
    """Token sync: rank 0 dispatches with chunk peer units, the others with row units (hidden 2048 bf16: 2
    chunks a row); then rank 0 with slot placement, the others with stage; then rank 0 with inline placement, the
    others with stage; then rank 0 with line and then line128 placement, the others with stage (row units on every
    rank). Each
    time every rank must raise at once naming the options (the T word's kind bits), never copy what it did not wait for or from where nothing
    was put, and never wait out the timeout (10 s here; the check allows 5)."""
    import time

    if sync != "token":
        return 0
    case = Case("units mismatch", 2048, [16], 4, 4)
    failures = 0
    for what, mine, others in (("dispatch_units", "chunk", "row"), ("dispatch_place", "slot", "stage"),
                               ("dispatch_place", "inline", "stage"), ("dispatch_place", "line", "stage"),
                               ("dispatch_place", "line128", "stage")):
        chosen = {what: mine if rank == 0 else others}
        if mine in ("line", "line128"):  # lines carry whole rows (16 tokens: auto would pick chunk): row units on
            chosen["dispatch_units"] = "row"  # every rank, so only the placement differs
        be = EpbenchLowLatencyBackend(setup_of(case, rank, world, device, timeout_s=10.0), ll_sync="token", **chosen)
        routing = rank_routing(case, rank, world, seed=1)
        inp = dispatch_input(make_tokens(16, 2048, 7, rank, 1, device), routing, "bf16", device)
        dist.barrier()
        t0 = time.time()
        try:
            be.ll_dispatch(inp, 4)
            torch.cuda.synchronize()
            be.check_errors()
            ok, msg = False, "no error raised"
        except RuntimeError as e:
            msg = str(e)
            other = "dispatch_place" if what != "dispatch_place" else "dispatch_units"
            ok = "disagrees" in msg and what in msg and other not in msg and time.time() - t0 < 5.0
        if rank == 0 or not ok:
            print(f"{'ok  ' if ok else 'FAIL'} [rank {rank}] {what} mismatch -> {msg!r} after "
                  f"{time.time() - t0:.1f} s", flush=True)
        dist.barrier()
        be.close()
        failures += all_sum(int(not ok), device)
    return failures


def check_suite(args: argparse.Namespace, rank: int, world: int, device: torch.device) -> List[str]:
    """Every case of ``args.mode`` (check, orders or lines: LINE_CASES) at each SM count; returns the failed ones as
    'case sms=N' (the same list on every rank)."""
    failed: List[str] = []
    run = {"check": run_case, "orders": run_orders, "lines": run_lines}[args.mode]
    for case in (LINE_CASES if args.mode == "lines" else CASES):
        if args.quick and case.name not in QUICK:
            continue
        for sms in [int(s) for s in args.sms.split(",")]:
            try:
                problems = run(case, rank, world, device, sms, args.sync)
            except RuntimeError as e:
                problems = [f"raised: {e}"]
            bad = all_sum(int(bool(problems)), device)
            if bad:
                failed.append(f"{case.name} sms={sms}")
            if rank == 0 or problems:
                print(f"{'FAIL' if bad else 'ok  '} [rank {rank}] {case.name:<30} sms={sms:<3} "
                      f"{'; '.join(problems)}", flush=True)
    return failed


def run_check(args: argparse.Namespace, rank: int, world: int, device: torch.device) -> int:
    failures = len(check_suite(args, rank, world, device))
    if args.mode == "check":
        failures += check_timeout(rank, world, device, args.sync)
        failures += check_units_mismatch(rank, world, device, args.sync)
    if rank == 0:
        print(f"{args.mode} world={world} ll_sync={args.sync}: {'PASS' if failures == 0 else f'{failures} FAILURES'}",
              flush=True)
    return failures


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["check", "orders", "lines"])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--sync", choices=["grid", "token"], default="grid", help="backend option ll_sync")
    ap.add_argument("--sms", default="4,32", help="grid sizes to check (blocks; <= the GPU's SM count)")
    return ap


def main() -> int:
    args = parser().parse_args()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    # one GPU per rank where the host has enough, else ranks share them (gloo process group)
    device = init_distributed("cuda").device
    try:
        failures = run_check(args, rank, world, device)
    finally:
        dist.destroy_process_group()
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
