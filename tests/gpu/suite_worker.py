"""Several kernel checks in one launch, started by torchrun: one process start, one CUDA context and
one process group for all of them, instead of one launch per test.

    torchrun --nproc_per_node 2 tests/gpu/suite_worker.py "ep:defaults=--quick" \
        "ep:mxfp8=--mxfp8 --impls lean:16:3" "ll:check-grid=check --sync grid --quick" ...

Each argument is KIND:NAME=FLAGS: kind ep runs tests/gpu/ep_worker.py's check with those flags (the
normal-mode kernels), kind ll runs tests/gpu/ll_worker.py's check or orders (the low-latency
kernels). Each suite ends with one line, `suite NAME world=W: PASS` or `suite NAME world=W: FAIL: n
failed: <the failed cases>`; after every suite, the missing peer (a rank skips a dispatch: the others
must raise naming it) once per kind and ll_sync used: `missing peer world=W: PASS` (ep) and
`missing peer world=W ll_sync=S: PASS` (ll). It comes last because it leaves a kernel that gave up.
A test reads its suite's line and its missing peer's. Exit code 0 only if every check passed.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from pathlib import Path
from typing import List, Tuple

import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import ep_worker  # noqa: E402
import ll_worker  # noqa: E402

from epbench.launch import init_distributed  # noqa: E402

KINDS = {"ep": (lambda flags: ep_worker.parser().parse_args(["check", *flags]), ep_worker.check_cases),
         "ll": (lambda flags: ll_worker.parser().parse_args(flags), ll_worker.check_suite)}


def parse_spec(spec: str) -> Tuple[str, str, argparse.Namespace]:
    """'KIND:NAME=FLAGS' -> (kind, name, the flags parsed as that kind's worker parses them)."""
    head, sep, flags = spec.partition("=")
    kind, colon, name = head.partition(":")
    if not sep or not colon or not name or kind not in KINDS:
        raise SystemExit(f"a suite is KIND:NAME=FLAGS with KIND one of {sorted(KINDS)}, got {spec!r}")
    args = KINDS[kind][0](shlex.split(flags))
    if kind == "ll" and args.mode not in ("check", "orders", "lines"):
        raise SystemExit(f"suite {name}: ll flags start with check, orders or lines, got {args.mode}")
    return kind, name, args


def suite_line(name: str, world: int, failed: List[str]) -> str:
    verdict = "PASS" if not failed else f"FAIL: {len(failed)} failed: " + "; ".join(failed[:20])
    return f"suite {name} world={world}: {verdict}"


def main() -> int:
    specs = [parse_spec(s) for s in sys.argv[1:]]  # every spec checked before the GPUs are touched
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    device = init_distributed("cuda").device
    failures = 0
    try:
        ep_used, ll_syncs = False, []
        for kind, name, args in specs:
            failed = KINDS[kind][1](args, rank, world, device)
            failures += len(failed)
            ep_used |= kind == "ep"
            if kind == "ll" and args.mode == "check" and args.sync not in ll_syncs:
                ll_syncs.append(args.sync)
            if rank == 0:
                print(suite_line(name, world, failed), flush=True)
        missing = [("", lambda: ep_worker.check_timeout(rank, world, device))] if ep_used else []
        missing += [(f" ll_sync={s}", lambda s=s: ll_worker.check_timeout(rank, world, device, s)) for s in ll_syncs]
        for label, check in missing:
            bad = check()
            failures += bad
            if rank == 0:
                print(f"missing peer world={world}{label}: {'PASS' if not bad else 'FAIL'}", flush=True)
    finally:
        dist.destroy_process_group()
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
