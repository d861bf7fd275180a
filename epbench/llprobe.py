"""Where the low-latency kernels' fixed cost goes (issue 24; notes/LATENCY.md).

    python -m epbench.llprobe --tokens 1,32,128 --sms 32,132

World 1 on one GPU (no link crossed), DeepSeek-V3 decode shape by default (hidden 7168, top-8,
fp8 dispatch, bf16 combine). Every call is a CUDA-graph replay timed with device events exactly as
the driver times it (epbench.timing.Timer: a device sleep first, so the host's launch is never
timed). Per replay, each block's thread 0 also stores %globaltimer at the kernels' phase
boundaries (csrc/ll_common.cuh, LlStamp); a part's time is the step between two boundaries taken
over the whole grid (the first block to start, then the last block to pass each boundary), so the
parts add up to the kernel's span and `call - span` is what the stamps cannot see: the graph
launch, block dispatch before the first stamp and the drain after the last.

Rows:
- probe kernels (csrc/api.h, ep_ll_probe) of the same grid: `empty` (launch floor), `sync` and
  `sync-old` (the grid-wide release / wait / finish handshake alone, new and pre-issue-24 code),
  `chase` (16 dependent global loads by one thread per block: span / 16 ~ one memory round trip),
  `fence` (16 x store + fence.acq_rel.sys), `timer` (the smallest step of %globaltimer, ns);
- dispatch and combine per tokens x variant, each verified once (#wrong) before it is timed:
  `grid` (ll_sync grid, the grid-wide handshakes); `token` (ll_sync token: per-token flags, no
  grid-wide step; its stamps mark warp 0's progress, there being no block barrier to stamp);
  `old` (grid with every pre-issue-24 sync piece back, LL_VARIANT_* = 7); `fence-all` (grid with
  only the per-thread fences back); `warps4` / `warps8` (grid with 4 / 8 warps per block);
  `token-warps4` (token with 4). fence-all, warps8 and token-warps4 only when asked for.

Prints one table, a line per row as it is measured (us; p50 unless marked), and writes every number to $OUT/ll_probe.csv when OUT is
set (or --csv).
"""

from __future__ import annotations

import argparse
import csv
import os
import statistics
import sys
from typing import Dict, List, Optional, Sequence

PARTS = ["stage", "send", "release", "wait", "receive", "finish"]  # LlStamp 1..6 (after kLlStart)
PROBE_MODES = {"empty": (0, 0), "sync": (1, 0), "sync-old": (1, 7), "chase": (2, 0), "fence": (3, 0),
               "timer": (4, 0)}
# name -> (LL_VARIANT_* bits, warps per block or None for the backend's default, option ll_sync)
VARIANTS = {"grid": (0, None, "grid"), "token": (0, None, "token"), "old": (7, None, "grid"),
            "fence-all": (1, None, "grid"), "warps4": (0, 4, "grid"), "warps8": (0, 8, "grid"),
            "token-warps4": (0, 4, "token")}
DEFAULT_VARIANTS = "grid,token,old,warps4"
STAMPS_PER_BLOCK = 8


def percentile(xs: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) by linear interpolation between closest ranks."""
    s = sorted(xs)
    if not s:
        return float("nan")
    pos = (len(s) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def call_parts(blocks: Sequence[Sequence[int]]) -> Dict[str, float]:
    """One call's parts in us from its per-block stamps (ns; [block][LlStamp]): boundary 0 is the
    first block's start, boundary i the last block to pass stamp i; part i = boundary i - boundary
    i - 1, so the parts add up to `span` (first start to last end). `skew`: last start - first."""
    starts = [b[0] for b in blocks]
    bound = [min(starts)] + [max(b[i] for b in blocks) for i in range(1, len(PARTS) + 1)]
    out = {name: (bound[i + 1] - bound[i]) / 1e3 for i, name in enumerate(PARTS)}
    out["span"] = (bound[-1] - bound[0]) / 1e3
    out["skew"] = (max(starts) - min(starts)) / 1e3
    return out


def probe_parts(blocks: Sequence[Sequence[int]]) -> Dict[str, float]:
    """A probe kernel's span and part A (start to stamp 2, ``sent``), in us, over the grid."""
    b0 = min(b[0] for b in blocks)
    return {"span": (max(b[6] for b in blocks) - b0) / 1e3, "a": (max(b[2] for b in blocks) - b0) / 1e3}


def summarize(per_call: Sequence[Dict[str, float]], call_us: Sequence[float]) -> Dict[str, float]:
    """p50 / p99 of every part over the calls, the event-timed call (p50, p99, max) and
    `outside` = p50 of (call - span) per call."""
    row: Dict[str, float] = {"call_p50": percentile(call_us, 50), "call_p99": percentile(call_us, 99),
                             "call_max": max(call_us) if call_us else float("nan")}
    keys = per_call[0].keys() if per_call else []
    for k in keys:
        vals = [c[k] for c in per_call]
        row[f"{k}_p50"] = percentile(vals, 50)
        row[f"{k}_p99"] = percentile(vals, 99)
    if per_call and "span" in per_call[0]:
        row["outside_p50"] = percentile([t - c["span"] for t, c in zip(call_us, per_call)], 50)
    return row


def format_table(rows: List[Dict[str, object]]) -> str:
    """The compact table the probe prints: one line per row, us, p50 unless marked."""
    cols = ["sms", "op", "tokens", "variant", "wrong", "call_p50", "call_p99", "call_max", "outside_p50",
            "span_p50"] + [f"{p}_p50" for p in ["skew"] + PARTS] + ["a_p50"]
    head = {"call_p50": "call", "call_p99": "p99", "call_max": "max", "outside_p50": "outside",
            "span_p50": "span", "a_p50": "partA"}
    names = [head.get(c, c.replace("_p50", "")) for c in cols]

    def cell(v: object) -> str:
        if v is None or v == "":
            return "-"
        if isinstance(v, float):
            return "-" if v != v else f"{v:.2f}"
        return str(v)

    lines = [" ".join(f"{n:>7}" for n in names)]
    for r in rows:
        lines.append(" ".join(f"{cell(r.get(c)):>7}" for c in cols))
    return "\n".join(lines)


def write_csv(rows: List[Dict[str, object]], path: str) -> None:
    keys: List[str] = []
    for r in rows:
        keys += [k for k in r if k not in keys]
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        w.writerows(rows)


def _int_list(s: str) -> List[int]:
    return [int(v) for v in s.split(",") if v.strip()]


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m epbench.llprobe", description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", default="1,32,128", help="tokens per call (comma list)")
    ap.add_argument("--sms", default="32,132", help="blocks per kernel (comma list)")
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--experts-per-rank", type=int, default=64,
                    help="64: the shape of `epbench sweep scenarios/dsv3x4-ll.yaml --nproc 1`")
    ap.add_argument("--dtype", choices=["fp8", "bf16"], default="fp8")
    ap.add_argument("--variants", default=DEFAULT_VARIANTS, help=f"subset of {','.join(VARIANTS)}")
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--iters", type=int, default=500)
    ap.add_argument("--csv", default=None, help="default: $OUT/ll_probe.csv when OUT is set")
    args = ap.parse_args(argv)
    variants = [v for v in args.variants.split(",") if v]
    bad = [v for v in variants if v not in VARIANTS]
    if bad:
        print(f"--variants: unknown {bad}; choose from {list(VARIANTS)}", file=sys.stderr)
        return 2
    rows = run(_int_list(args.tokens), _int_list(args.sms), variants, args)
    path = args.csv or (os.path.join(os.environ["OUT"], "ll_probe.csv") if os.environ.get("OUT") else None)
    if path:
        write_csv(rows, path)
        print(f"wrote {path}")
    return 0 if all(not r.get("wrong") for r in rows) else 1


def run(tokens: List[int], sms_list: List[int], variants: List[str], args: argparse.Namespace) -> List[Dict[str, object]]:
    import torch

    from epbench.backends.base import RankSetup
    from epbench.backends.epbench_ll import EpbenchLowLatencyBackend
    from epbench.driver import graph_calls
    from epbench.inputs import dispatch_input, make_tokens
    from epbench.routing import route_rank
    from epbench.scenario import Routing
    from epbench.timing import Timer
    from epbench.verify import check_ll_combine, check_ll_dispatch, ll_expert_output

    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    setup = RankSetup(rank=0, world=1, gpus_per_node=1, device=dev, hidden=args.hidden,
                      max_tokens_per_rank=max(tokens), topk=args.topk, experts_per_rank=args.experts_per_rank,
                      dispatch_dtype=args.dtype, timeout_s=5.0, mode="low_latency")
    # one backend per ll_sync (the two keep different flags and epochs; the sync is fixed per backend)
    backends = {sync: EpbenchLowLatencyBackend(setup, ll_sync=sync)
                for sync in dict.fromkeys(VARIANTS[v][2] for v in ["grid"] + variants)}
    be = backends["grid"]
    default_warps = be.warps
    n = args.warmup + args.iters
    rows: List[Dict[str, object]] = []
    print(f"# {torch.cuda.get_device_name(dev)}, world 1, hidden {args.hidden}, top-{args.topk} of "
          f"{args.experts_per_rank} experts, {args.dtype} dispatch, {args.iters} graph replays after "
          f"{args.warmup}, {default_warps} warps unless named", flush=True)
    print(format_table([]), flush=True)

    def timed(calls: List, stamps: torch.Tensor, parts) -> List[Dict[str, float]]:
        """Times each callable of `calls` n times in turn; per callable: (event us, parts per call)."""
        timers = [Timer(dev, n) for _ in calls]
        hist = [torch.empty((n,) + tuple(stamps.shape), dtype=torch.int64, device=dev) for _ in calls]
        for i in range(n):
            for j, fn in enumerate(calls):
                timers[j].time(i, fn)
                hist[j][i].copy_(stamps)  # queued after the end event: not timed
        out = []
        for j in range(len(calls)):
            us = timers[j].samples_us(args.warmup)
            h = hist[j][args.warmup:].cpu().tolist()
            out.append(summarize([parts(b) for b in h], us))
        return out

    for sms in sms_list:
        stamps = torch.zeros(sms, STAMPS_PER_BLOCK, dtype=torch.int64, device=dev)
        for name, (mode, variant) in PROBE_MODES.items():
            be.warps = default_warps
            be.set_probe(stamps, variant)
            g = torch.cuda.CUDAGraph()
            torch.cuda.synchronize()
            with torch.cuda.graph(g):
                be.probe_kernel(mode, sms)
            (res,) = timed([g.replay], stamps, probe_parts)
            row: Dict[str, object] = {"sms": sms, "op": "probe", "tokens": "", "variant": name, "wrong": ""}
            row.update(res)
            if name == "timer":
                row["timer_step_ns"] = int(stamps[0, 7])
                row["a_p50"] = float(row["timer_step_ns"])  # shown in the partA column (ns)
            rows.append(row)
            print(format_table([row]).splitlines()[-1], flush=True)
        for t in tokens:
            routing = route_rank(Routing(kind="uniform", seed=0), t, args.topk, args.experts_per_rank, 0)
            for vname in variants:
                bits, warps, sync = VARIANTS[vname]
                be = backends[sync]
                be.warps = warps or default_warps
                be.set_probe(stamps, bits)
                x = make_tokens(t, args.hidden, 0, 0, sms * 1000 + t, dev)
                inp = dispatch_input(x, routing, args.dtype, dev)
                calls = graph_calls(be, inp, sms)
                be.poison()
                out = calls.dispatch()
                torch.cuda.synchronize()
                be.check_errors()
                d = check_ll_dispatch(out, 0, 1, args.experts_per_rank, lambda s: inp)
                be.ll_combine_input(out).copy_(ll_expert_output(out.x, out.x_scales, 0))
                got = calls.combine(out)
                torch.cuda.synchronize()
                be.check_errors()
                c = check_ll_combine(got, inp)
                # y stays as filled: the timed combines read real expert outputs, never zeros
                res_d, res_c = timed([calls.dispatch, lambda: calls.combine(out)], stamps, call_parts)
                be.check_errors()
                for op, res, wrong in (("dispatch", res_d, d.wrong), ("combine", res_c, c.wrong)):
                    row = {"sms": sms, "op": op, "tokens": t, "variant": vname, "wrong": wrong}
                    row.update(res)
                    rows.append(row)
                    print(format_table([row]).splitlines()[-1], flush=True)
        for b in backends.values():
            b.set_probe(None, 0)
            b.warps = default_warps
        be = backends["grid"]
    for b in backends.values():
        b.close()
    return rows


if __name__ == "__main__":
    sys.exit(main())
