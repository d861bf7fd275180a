"""Process launch: re-executing under torchrun, and joining the process group inside it."""

from __future__ import annotations

import datetime
import os
import shutil
import subprocess
import sys
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator, List, Optional

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


def device_index(local_rank: int, device_count: int) -> int:
    """The GPU a rank runs on: its local rank, wrapped round when ranks outnumber the GPUs
    (several ranks then share one GPU, through the same code path)."""
    return local_rank % device_count if device_count > 0 else 0


def ranks_per_gpu(local_world: int, device_count: int) -> int:
    """How many of this host's ranks share the busiest GPU (1: each rank has its own)."""
    if device_count <= 0:
        return 1
    return -(-local_world // device_count)


def process_group_backend(device: str, shared: bool) -> str:
    """NCCL on GPUs, except where ranks share a GPU (NCCL refuses two ranks on one device):
    gloo then carries the bootstrap, gathers and barriers; the data still moves through the
    backends' own kernels and CUDA IPC."""
    return "nccl" if device == "cuda" and not shared else "gloo"


def mps_pipe_dir() -> str:
    return os.environ.get("CUDA_MPS_PIPE_DIRECTORY") or "/tmp/nvidia-mps"


def mps_active() -> bool:
    """True when an MPS control daemon serves this process's pipe folder (its ``control``
    socket exists): the ranks' kernels then run side by side instead of time-slicing."""
    return os.path.exists(os.path.join(mps_pipe_dir(), "control"))


MPS_ENV = ("CUDA_MPS_PIPE_DIRECTORY", "CUDA_MPS_LOG_DIRECTORY")


@contextmanager
def private_mps() -> Iterator[str]:
    """An MPS control daemon of this run's own (private pipe and log folders, which the ranks
    inherit), stopped at exit: ranks sharing a GPU then run side by side instead of taking
    turns. Yields the pipe folder. An MPS daemon already serving this process is used as is."""
    from epbench.errors import UserError

    if mps_active():
        yield mps_pipe_dir()
        return
    exe = shutil.which("nvidia-cuda-mps-control")
    if exe is None:
        raise UserError("--mps: nvidia-cuda-mps-control not found (it comes with the NVIDIA driver)")
    dirs = {k: tempfile.mkdtemp(prefix=f"epbench-mps-{k.split('_')[2].lower()}-") for k in MPS_ENV}
    before = {k: os.environ.get(k) for k in MPS_ENV}
    os.environ.update(dirs)
    try:
        r = subprocess.run([exe, "-d"], capture_output=True, text=True, timeout=60)
        if r.returncode != 0:
            why = (r.stderr or r.stdout).strip().splitlines()
            raise UserError(f"--mps: `nvidia-cuda-mps-control -d` failed (exit {r.returncode}"
                            f"{': ' + why[0] if why else ''}); starting MPS may need root")
        try:
            yield dirs["CUDA_MPS_PIPE_DIRECTORY"]
        finally:
            subprocess.run([exe], input="quit\n", capture_output=True, text=True, timeout=60)
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        for d in dirs.values():
            shutil.rmtree(d, ignore_errors=True)


@dataclass
class Comm:
    """This process's place in the job, and the one cross-rank sync the timing loop uses."""

    rank: int
    world: int
    local_rank: int
    device: "object"  # torch.device
    ranks_per_gpu: int = 1  # >1: ranks share GPUs (the process group then runs over gloo)

    @property
    def shared(self) -> bool:
        return self.ranks_per_gpu > 1

    @property
    def collective_device(self) -> "object":
        """Where tensors handed to torch.distributed live: the GPU under NCCL, else the CPU."""
        import torch

        return self.device if self.device.type == "cuda" and not self.shared else torch.device("cpu")

    def sync(self) -> None:
        """Align ranks before a timed call. On GPUs a one-element NCCL all-reduce queued on the
        stream lines the ranks' streams up without a host round trip; where ranks share a GPU
        (gloo), each rank empties its stream and then meets the others at a barrier; on CPUs,
        a barrier."""
        import torch
        import torch.distributed as dist

        if self.device.type == "cuda" and not self.shared:
            dist.all_reduce(self._one)
            return
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        dist.barrier()

    def init_sync(self) -> None:
        import torch

        if self.device.type == "cuda" and not self.shared:
            self._one = torch.ones(1, device=self.device)


def init_distributed(device: str, timeout_s: float = 600.0) -> Comm:
    import torch
    import torch.distributed as dist

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ["LOCAL_RANK"])
    per_gpu = 1
    if device == "cuda":
        count = torch.cuda.device_count()
        per_gpu = ranks_per_gpu(int(os.environ.get("LOCAL_WORLD_SIZE", world)), count)
        dev = torch.device("cuda", device_index(local_rank, count))
        torch.cuda.set_device(dev)
    else:
        dev = torch.device("cpu")
        torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
    backend = process_group_backend(device, per_gpu > 1)
    if not dist.is_initialized():
        kwargs = {"device_id": dev} if backend == "nccl" else {}
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s), **kwargs)
    comm = Comm(rank, world, local_rank, dev, per_gpu)
    comm.init_sync()
    return comm
