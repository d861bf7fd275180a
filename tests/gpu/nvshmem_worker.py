"""NVSHMEM groundwork check (multi-node, issue #5), started by torchrun:

    torchrun --standalone --nproc_per_node 4 tests/gpu/nvshmem_worker.py [--iters 200] [--timeout 10]

Each rank: torch.distributed (gloo) carries rank 0's NVSHMEM unique id to every rank
(epbench.nvshmem_lib.bootstrap), NVSHMEM initialises over it, then warm-up and timed rounds of the
ping (csrc/nvshmem/nvshmem_boot.cu: each PE puts a 4 KiB block into every other PE with
put-with-signal, waits for every peer's signal with a timeout and checks the bytes). Rank 0 prints
`PASS nvshmem ping ...` with the median round time of every rank, or a rank prints `FAIL ...`
with the reason (a peer that never signalled, wrong bytes). Exit code 0 only on PASS.
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from epbench import nvshmem_lib  # noqa: E402


def run(args: argparse.Namespace, rank: int, world: int, local_rank: int) -> int:
    lib = nvshmem_lib.bootstrap(rank, world, local_rank)
    try:
        if lib.epn_my_pe() != rank or lib.epn_n_pes() != world:
            raise RuntimeError(f"NVSHMEM PE {lib.epn_my_pe()} of {lib.epn_n_pes()}, expected {rank} of {world}")
        nvshmem_lib.ping(args.warmup, args.timeout)
        us = nvshmem_lib.ping(args.iters, args.timeout)
    finally:
        nvshmem_lib.finalize()
    medians = [0.0] * world
    dist.all_gather_object(medians, us)
    if rank == 0:
        per_rank = " ".join(f"{m:.1f}" for m in medians)
        median = sorted(medians)[world // 2]
        print(f"PASS nvshmem ping world={world} block=4KiB iters={args.iters}: median {median:.1f} us "
              f"(per rank: {per_rank})", flush=True)
    return 0


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--timeout", type=float, default=10.0, help="seconds a PE waits for a peer's signal")
    args = ap.parse_args()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    if not torch.cuda.is_available() or local_rank >= torch.cuda.device_count():
        print(f"FAIL [rank {rank}] no CUDA device {local_rank}", flush=True)
        return 1
    dist.init_process_group("gloo")
    try:
        return run(args, rank, world, local_rank)
    except Exception as e:  # one line per failing rank; torchrun stops the others
        print(f"FAIL [rank {rank}] {e}", flush=True)
        traceback.print_exc()
        return 1
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
