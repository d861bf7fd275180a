"""Process launch: re-executing under torchrun, and joining the process group inside it."""

from __future__ import annotations

import datetime
import os
import sys
from dataclasses import dataclass
from typing import List, Optional

# NVLink multicast can take a shared NVSwitch host down; it stays off in every process we start.
SAFE_ENV = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}


def apply_safe_env() -> None:
    os.environ.update(SAFE_ENV)


def under_torchrun() -> bool:
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))


def torchrun_args(args: List[str], nproc_per_node: int, nnodes: int = 1,
                  node_rank: Optional[int] = None, rdzv_endpoint: Optional[str] = None,
                  rdzv_timeout_s: Optional[int] = None) -> List[str]:
    """torchrun's own arguments for re-running ``epbench <args>`` on every rank."""
    cmd = [f"--nproc-per-node={nproc_per_node}"]
    if nnodes > 1 or rdzv_endpoint:
        cmd += [f"--nnodes={nnodes}", "--rdzv-backend=c10d", f"--rdzv-endpoint={rdzv_endpoint}"]
        if node_rank is not None:
            cmd.append(f"--node-rank={node_rank}")
        if rdzv_timeout_s is not None:
            cmd.append(f"--rdzv-conf=join_timeout={rdzv_timeout_s}")
    else:
        cmd.append("--standalone")
    return cmd + ["-m", "epbench", *args]


def relaunch(torchrun: List[str], device: str) -> int:
    """Runs torchrun in this process; returns the first failed rank's exit code (0 if none).
    torchrun's own failure report is replaced by one line: the ranks already said why."""
    import logging

    from torch.distributed import run as trun
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous import RendezvousError

    os.environ.update(SAFE_ENV)
    if device == "cpu":
        os.environ.setdefault("OMP_NUM_THREADS", "1")  # several ranks share a few cores
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    try:
        trun.run(trun.parse_args(torchrun))
    except ChildFailedError as e:
        rank, failure = e.get_first_failure()
        code = failure.exitcode if failure.exitcode and failure.exitcode > 0 else 1
        print(f"epbench: rank {rank} exited with code {failure.exitcode}", file=sys.stderr)
        return code
    except RendezvousError as e:
        # the other nodes never came (wrong endpoint, a node not started, a firewall)
        from torch.distributed.elastic.rendezvous import RendezvousTimeoutError

        where = next((a.split("=", 1)[1] for a in torchrun if a.startswith("--rdzv-endpoint=")), "?")
        why = ("not every node joined in time (start the same command on every node; "
               "--rdzv-timeout waits longer)" if isinstance(e, RendezvousTimeoutError)
               else f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else 'no detail'}")
        print(f"epbench: error: the nodes could not meet at the rendezvous {where}: {why}",
              file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    return 0


@dataclass
class Comm:
    """This process's place in the job, and the one cross-rank sync the timing loop uses."""

    rank: int
    world: int
    local_rank: int
    device: "object"  # torch.device

    def sync(self) -> None:
        """Align ranks before a timed call. On GPUs a one-element NCCL all-reduce queued on the
        stream lines the ranks' streams up without a host round trip; on CPUs, a barrier."""
        import torch.distributed as dist

        if self.device.type == "cuda":
            dist.all_reduce(self._one)
        else:
            dist.barrier()

    def init_sync(self) -> None:
        import torch

        if self.device.type == "cuda":
            self._one = torch.ones(1, device=self.device)


def init_distributed(device: str, timeout_s: float = 600.0) -> Comm:
    import torch
    import torch.distributed as dist

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ["LOCAL_RANK"])
    if device == "cuda":
        torch.cuda.set_device(local_rank)
        dev = torch.device("cuda", local_rank)
        backend = "nccl"
    else:
        dev = torch.device("cpu")
        torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
        backend = "gloo"
    if not dist.is_initialized():
        kwargs = {"device_id": dev} if device == "cuda" else {}
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s), **kwargs)
    comm = Comm(rank, world, local_rank, dev)
    comm.init_sync()
    return comm
