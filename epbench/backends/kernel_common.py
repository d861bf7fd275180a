"""What the three compiled-kernel backends (epbench, epbench-ll, epbench-hier) share: the caller's
CUDA stream as a raw handle, the collective release of a kernel context, and the poisoning of the
normal-mode output buffers. Each backend keeps its own ctypes calls; these take them as arguments."""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist

from epbench import stall


def raw_stream_getter(device: torch.device) -> Callable[[], int]:
    """A cheap callable returning the current CUDA stream of ``device`` as an integer handle (the
    private torch fast path when it exists: it is read on every timed call)."""
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    index = device.index
    if raw is not None:
        return lambda: raw(index)
    return lambda: torch.cuda.current_stream(device).cuda_stream


def wait_then_check(device: torch.device, raise_if_timed_out: Callable[[], None]) -> None:
    """A backend's ``check_errors``: waits for the kernels queued on the current stream (where every call of
    the timing loop queues them), not for the device: work on other streams, such as the GEMMs queued beside
    an overlap point, must not end the loop measured beside it. Then raises if any of them timed out."""
    with stall.region("the wait for a backend's kernels"):
        torch.cuda.current_stream(device).synchronize()
    raise_if_timed_out()


def release_collective(device: torch.device, world: int, destroy: Callable[[], None]) -> None:
    """Collective: waits for this rank's kernels, then for every rank (peers may still write into
    this rank's buffers), then ``destroy()``."""
    torch.cuda.synchronize(device)
    if world > 1 and dist.is_available() and dist.is_initialized():
        dist.barrier()
    destroy()


def poison_dispatch_outputs(be: Any) -> None:
    """Fills a normal-mode backend's receive buffers, counts and combine output with garbage."""
    be.recv_x.view(torch.uint8).fill_(0xFF)
    if be.recv_scales is not None:
        be.recv_scales.view(torch.uint8).fill_(0xFF)  # f32: NaN; mxfp8: the NaN scale byte
    be.recv_idx.fill_(-1)
    be.recv_w.fill_(float("nan"))
    be.expert_counts.fill_(-1)
    be.num_recv.fill_(-1)
    be.out.fill_(float("nan"))
