"""Multi-rank worker for the hierarchical kernels (backend epbench-hier), started by torchrun.

    torchrun --nproc_per_node 4 tests/gpu/hier_worker.py check [--gpus-per-node 2] [--transport auto|put|direct] [--quick]
    torchrun --nproc_per_node 4 tests/gpu/hier_worker.py "hier:g2-auto=--gpus-per-node 2 --transport auto" \
        "hier:g1-put-quick=--gpus-per-node 1 --transport put --quick" ...

check: the intranode edge cases (tests/gpu/ep_worker.py's CHECK_CASES) plus every token to one
node and HIER_CASES (below), as virtual nodes of --gpus-per-node GPUs, against epbench.verify (bit-exact dispatch,
combine within its tolerance), twice each with fresh inputs and poisoned outputs, at two SM
counts and two shares of sending blocks, over the given transport between nodes (put: NVSHMEM
put-with-signal, the network path; direct: in-place stores where NVLink reaches; auto: put for
dispatch, direct for combine); then a missing peer
that must raise naming it, not hang.

Suites (the GPU tests, tests/gpu/test_epbench_hier.py, through gpu_launch.SuiteLaunches): each argument
hier:NAME=FLAGS is one check's case list with those check flags, run in turn in one process (one
NVSHMEM start, one process group), with a backend made and closed per case as in check. One process
serves every gpus_per_node: NVSHMEM starts once per (rank, world, device) (nvshmem_lib.ensure_initialised)
and gpus_per_node is only the context's (eph_create: node, local rank, peer pointers, buffer sizes,
all freed by eph_destroy). Each suite ends with tests/gpu/suite_worker.py's line, `suite NAME world=W:
PASS` or `... FAIL: n failed: <the failed cases>`; after every suite, the missing peer once per
gpus_per_node used: `missing peer world=W gpus_per_node=G: PASS`. It is one check per gpus_per_node,
not per suite: it uses the default transport whatever the suite's, and the ranks give up in the count
exchange, which every transport does by put-with-signal before any row moves; it comes last because
it leaves kernels that gave up.
Exit code 0 only if every check passed.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import time
import zlib
from dataclasses import replace
from pathlib import Path
from typing import List, Tuple

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from ep_worker import (CHECK_CASES, QUICK, Case, all_sum, check_case, expect_missing_peer,  # noqa: E402
                       make_setup, rank_routing)

from epbench.launch import init_distributed  # noqa: E402
from epbench.backends.epbench_hier import EpbenchHierBackend  # noqa: E402
from epbench.inputs import dispatch_input, make_tokens  # noqa: E402

# (num_sms, share of sending blocks): few and many blocks, both splits
POINTS = [(4, 0.5), (24, 0.25)]
HEAP = 6 << 30  # symmetric heap for the largest case (h8192, 4096 tokens, 4 ranks) with room
# beside ep_worker's cases: fp8 with ranks of 0 tokens (empty scale tensors, data_ptr() 0), which eph_dispatch
# refused on those ranks until 2026-11-26 (the others then timed out in the count exchange); in --quick too
HIER_CASES = [Case("fp8 rank with 0 tokens", 2048, [64, 0, 100, 0], 6, 4, "fp8")]
KIND = "hier"  # the kind of this worker's suite arguments (KIND:NAME=FLAGS, as tests/gpu/suite_worker.py's)


def suite_line(name: str, world: int, failed: List[str]) -> str:
    """tests/gpu/suite_worker.py's suite line, which gpu_launch.SuiteLaunches reads (written out here:
    importing suite_worker would add ll_worker and pandas, about a second, to every rank's start)."""
    verdict = "PASS" if not failed else f"FAIL: {len(failed)} failed: " + "; ".join(failed[:20])
    return f"suite {name} world={world}: {verdict}"


def hier_setup(case: Case, rank: int, world: int, g: int, device: torch.device, timeout_s: float = 10.0):
    """make_setup's RankSetup with g GPUs per (virtual) node."""
    return replace(make_setup(case, rank, world, device, timeout_s), gpus_per_node=g)


def cases_of(args: argparse.Namespace) -> List[Case]:
    """The cases check runs with these flags: ep_worker's that the backend takes (--quick: the quick
    ones), then HIER_CASES."""
    cases = [c for c in CHECK_CASES if (not args.quick or c.name in QUICK)
             and c.dtype in EpbenchHierBackend.dtypes and c.quantize in EpbenchHierBackend.quantize_modes]
    return cases + HIER_CASES


def check_cases(args: argparse.Namespace, rank: int, world: int, device: torch.device) -> List[str]:
    """Every case of ``args`` at each point, twice; returns the failed ones as 'case sms=N share=S
    rep R' (the same list on every rank)."""
    g = args.gpus_per_node
    failed: List[str] = []
    for case in cases_of(args):
        be = EpbenchHierBackend(hier_setup(case, rank, world, g, device), transport=args.transport)
        lines = []
        for sms, share in POINTS:
            be.send_share = share
            for rep in range(2):  # twice: the second call reuses buffers and signals
                salt = zlib.crc32(f"{case.name}/{sms}/{share}/{rep}".encode()) % 10000
                try:
                    r = check_case(be, case, rank, world, device, salt, sms)
                except RuntimeError as e:
                    r = {"dispatch_wrong": -1, "combine_wrong": -1, "problem": str(e), "num_recv": -1}
                bad = all_sum(int(r["dispatch_wrong"] != 0) + int(r["combine_wrong"] != 0), device)
                if bad:
                    failed.append(f"{case.name} sms={sms} share={share} rep {rep}")
                others = other_problems(r["problem"], world) if bad else ""
                if rank == 0 and (bad or rep == 0):
                    lines.append(f"{'FAIL' if bad else 'ok  '} {case.name:<28} sms={sms:<3} share={share} "
                                 f"recv={r['num_recv']} d_wrong={r['dispatch_wrong']} "
                                 f"c_wrong={r['combine_wrong']} {r['problem']}{others}")
        be.close()
        if rank == 0:
            print("\n".join(lines), flush=True)
    return failed


def run_check(args: argparse.Namespace, rank: int, world: int, device: torch.device) -> int:
    g = args.gpus_per_node
    failures = len(check_cases(args, rank, world, device))
    failures += check_timeout(rank, world, g, device)
    if rank == 0:
        print(f"hier check world={world} gpus_per_node={g} transport={args.transport}: "
              f"{'PASS' if failures == 0 else f'{failures} FAILURES'}", flush=True)
    return failures


def other_problems(mine: object, world: int) -> str:
    """Collective (every rank, after a failed check): the other ranks' first problems where they differ
    from rank 0's, for rank 0's line. A rank whose call was refused on the host (an error before any
    launch) shows up only here: the rest just time out waiting for it."""
    problems: List[object] = [None] * world
    dist.all_gather_object(problems, mine)
    return "".join(f" | rank {s}: {p}" for s, p in enumerate(problems) if s and p and p != problems[0])


def check_timeout(rank: int, world: int, g: int, device: torch.device) -> int:
    """Rank world-1 skips a dispatch: every other rank must raise naming it, within the timeout."""
    case = Case("timeout", 2048, [16], 4, 4)
    be = EpbenchHierBackend(hier_setup(case, rank, world, g, device, timeout_s=1.0))
    inp = dispatch_input(make_tokens(16, 2048, 7, rank, 1, device), rank_routing(case, rank, world, seed=1),
                         "bf16", device)
    return expect_missing_peer(be, lambda: be.dispatch(inp, 4), rank, world, device)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["check"])
    ap.add_argument("--gpus-per-node", type=int, default=2)
    ap.add_argument("--transport", choices=["auto", "put", "direct"], default="auto")
    ap.add_argument("--quick", action="store_true")
    return ap


def parse_spec(spec: str) -> Tuple[str, argparse.Namespace]:
    """'hier:NAME=FLAGS' -> (name, FLAGS parsed as check's flags)."""
    head, sep, flags = spec.partition("=")
    kind, colon, name = head.partition(":")
    if not sep or not colon or not name or kind != KIND:
        raise SystemExit(f"a suite is {KIND}:NAME=FLAGS (FLAGS: check's options), got {spec!r}")
    return name, parser().parse_args(["check", *shlex.split(flags)])


def seconds_since_start() -> float:
    """Seconds since this process started (Linux /proc; 0.0 elsewhere): the launch's start-up."""
    try:
        with open("/proc/self/stat") as f:
            started = int(f.read().rpartition(")")[2].split()[19]) / os.sysconf("SC_CLK_TCK")
        with open("/proc/uptime") as f:
            return float(f.read().split()[0]) - started
    except (OSError, ValueError, IndexError):
        return 0.0


def run_suites(specs: List[Tuple[str, argparse.Namespace]], rank: int, world: int, device: torch.device) -> int:
    """Each suite's cases, its line; then the missing peer once per gpus_per_node (see the top)."""
    failures, per_node = 0, []
    if rank == 0:
        print(f"hier suites world={world}: {len(specs)} suites, started in {seconds_since_start():.1f} s", flush=True)
    for i, (name, args) in enumerate(specs):
        t0 = time.monotonic()
        failed = check_cases(args, rank, world, device)
        failures += len(failed)
        if args.gpus_per_node not in per_node:
            per_node.append(args.gpus_per_node)
        if rank == 0:  # the timing line first: a test's section is its lines up to its suite line
            print(f"({name}: {len(cases_of(args))} cases in {time.monotonic() - t0:.1f} s"
                  f"{', NVSHMEM start included' if i == 0 else ''})", flush=True)
            print(suite_line(name, world, failed), flush=True)
    for g in per_node:
        t0 = time.monotonic()
        bad = check_timeout(rank, world, g, device)
        failures += bad
        if rank == 0:
            print(f"(missing peer with {g} GPUs per node: {time.monotonic() - t0:.1f} s)", flush=True)
            print(f"missing peer world={world} gpus_per_node={g}: {'PASS' if not bad else 'FAIL'}", flush=True)
    return failures


def main() -> int:
    argv = sys.argv[1:]
    single = argv[:1] == ["check"] or not argv  # no argument: check's usage message
    # every argument checked before the GPUs are touched
    specs = [("check", parser().parse_args(argv))] if single else [parse_spec(s) for s in argv]
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    for name, args in specs:
        if world % args.gpus_per_node:
            print(f"{name}: world {world} is not a multiple of --gpus-per-node {args.gpus_per_node}", file=sys.stderr)
            return 2
    os.environ.setdefault("NVSHMEM_SYMMETRIC_SIZE", str(HEAP))
    # one GPU per rank where the host has enough, else ranks share them (gloo process group)
    device = init_distributed("cuda").device
    try:
        failures = run_check(specs[0][1], rank, world, device) if single else run_suites(specs, rank, world, device)
    finally:
        dist.destroy_process_group()
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
