"""The NCCL figure of the fidelity check (tools/fidelity.py): no NCCL benchmark of an MoE
all-to-all exists, so this times the plainest call there is, alone.

Per rank and op, one ``torch.distributed.all_to_all_single`` of bytes (uint8 tensors), with the
scenario's per-pair split sizes: dispatch sends ``copies(s -> d) x row bytes`` of the dispatch
dtype (fp8: the values and their float32 scales, as epbench counts a row, epbench/metrics.py),
combine sends the same copies back as bf16 rows. The copies are those of the scenario's routing
(epbench/routing.py), the rank's own copies included. Nothing else is in the timed region: no
packing, no count exchange, no host wait.

Timing is epbench's own (epbench/timing.py, and the alignment of epbench/launch.py's ``Comm``):
per call a short device sleep, a one-element all-reduce to line the ranks up, then events around
the call; ``warmup`` untimed and ``iters`` timed calls, dispatch and combine alternating. Rank 0
writes every rank's samples (us) as JSON to ``--out``; tools/fidelity_parse.py reads them.

    python tools/fidelity_nccl.py --scenario S.yaml --warmup 5 --iters 30 --out nccl.json

Runs its ranks with torch.multiprocessing (MASTER_ADDR / MASTER_PORT from the environment,
127.0.0.1 and 29500 where unset); ``--device cpu`` runs them over gloo (a check of the tool).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any, Dict, List

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


def split_bytes(total: Any, rank: int, row: int, op: str) -> "tuple[List[int], List[int]]":
    """(input splits, output splits) in bytes for ``rank``: dispatch sends row ``rank`` of the
    copy matrix and receives its column; combine the reverse."""
    world = int(total.shape[0])
    send = [int(total[rank, d]) * row for d in range(world)]
    recv = [int(total[s, rank]) * row for s in range(world)]
    return (send, recv) if op == "dispatch" else (recv, send)


def _rank(local_rank: int, world: int, args: argparse.Namespace) -> None:
    os.environ.update(RANK=str(local_rank), LOCAL_RANK=str(local_rank), WORLD_SIZE=str(world),
                      LOCAL_WORLD_SIZE=str(world))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29500")
    import torch
    import torch.distributed as dist

    from epbench import launch, routing, scenario
    from epbench.metrics import median, row_bytes
    from epbench.timing import Timer

    launch.apply_safe_env()
    s = scenario.load(args.scenario)
    comm = launch.init_distributed(args.device, timeout_s=args.control_timeout)
    m = s.model
    total = routing.traffic(routing.route_all(s), m.experts_per_rank, s.topology.gpus_per_node, False).total
    rows = {"dispatch": row_bytes(m.dispatch_dtype, m.hidden), "combine": row_bytes(m.combine_dtype, m.hidden)}
    calls: Dict[str, Any] = {}
    sent: Dict[str, int] = {}
    for op, row in rows.items():
        send, recv = split_bytes(total, comm.rank, row, op)
        inp = torch.randint(0, 256, (sum(send),), dtype=torch.uint8, device=comm.device)
        out = torch.empty(sum(recv), dtype=torch.uint8, device=comm.device)
        calls[op] = (lambda o=out, i=inp, r=recv, sd=send: dist.all_to_all_single(o, i, r, sd))
        sent[op] = sum(send)
    n = args.warmup + args.iters
    timers = {op: Timer(comm.device, n) for op in rows}
    for i in range(n):
        for op in rows:
            timers[op].time(i, calls[op], align=comm.sync)
    mine = {op: timers[op].samples_us(args.warmup) for op in rows}
    everyone: List[Any] = [None] * world
    dist.all_gather_object(everyone, {"rank": comm.rank, "samples": mine, "bytes": sent})
    if comm.rank == 0:
        data = {"scenario": s.name, "world": world, "dtype": m.dispatch_dtype, "hidden": m.hidden,
                "warmup": args.warmup, "iters": args.iters, "device": args.device,
                "nccl": ".".join(map(str, torch.cuda.nccl.version())) if args.device == "cuda" else None,
                "torch": torch.__version__,
                "samples_us": {op: {str(e["rank"]): e["samples"][op] for e in everyone} for op in rows},
                "bytes": {op: {str(e["rank"]): e["bytes"][op] for e in everyone} for op in rows}}
        Path(args.out).write_text(json.dumps(data, indent=1) + "\n")
        for op in rows:
            worst = max(median(v) for v in data["samples_us"][op].values())
            print(f"[nccl] {op}: slowest rank's median {worst:.1f} us over {args.iters} calls", flush=True)
    dist.barrier()
    dist.destroy_process_group()


def main(argv: "List[str] | None" = None) -> int:
    ap = argparse.ArgumentParser(prog="python tools/fidelity_nccl.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--scenario", required=True, help="scenario YAML (its world is the rank count)")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--control-timeout", type=float, default=300.0)
    ap.add_argument("--out", required=True, help="JSON file for the samples")
    args = ap.parse_args(argv)
    import torch.multiprocessing as mp

    from epbench import scenario

    world = scenario.load(args.scenario).world
    mp.spawn(_rank, args=(world, args), nprocs=world)
    return 0


if __name__ == "__main__":
    sys.exit(main())
