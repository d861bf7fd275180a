"""The ``epbench-hier`` backend: epbench's hierarchical dispatch/combine (csrc/nvshmem/hier_*.cu).

For ``nodes x gpus_per_node`` ranks: a token crosses the network at most once per destination
node, to the GPU with its own local rank there (same rail), which forwards it over NVLink to the
GPUs of that node holding its experts; combine sums inside the node first and sends one bf16
partial per (token, node) back, where the source adds them (one extra bf16 rounding per remote
node, inside verify.py's tolerance). The network tier is NVSHMEM put-with-signal (its unique id
bootstrapped over torch.distributed), so the same kernels run across real nodes (IB / RoCE) and
on virtual nodes of one host, where NVSHMEM carries that tier over NVLink (labelled virtual).
Semantics, buffers and no-host-sync rules as in base.py: every buffer is in NVSHMEM's symmetric
heap or device memory allocated once in the constructor.

Backend options (epbench/options.py: scenario ``backend_options: {epbench-hier: {...}}``, ``--option``,
constructor arguments, or the environment variable named; defaults chosen by measurement, notes/NVSHMEM.md):
  send_share (EPBENCH_HIER_SEND_SHARE)  share of the num_sms blocks that send rows (dispatch) or partials (combine)
                           to other nodes; the rest forward over NVLink / finish tokens (default 0.5)
  chunk (EPBENCH_HIER_CHUNK)       rows per put and per signal (default 4)
  transport (EPBENCH_HIER_TRANSPORT)   how rows (dispatch) and partials (combine) reach a rail peer that NVLink
                           reaches (virtual nodes, one NVLink domain): put = pack locally, then NVSHMEM
                           put-with-signal (the only way over a real network); direct = SM stores in place,
                           then an NVSHMEM signal; auto (default) = put for dispatch, direct for combine
                           (the fastest mix measured). A peer NVLink does not reach always gets put.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist

from epbench import cuda_lib, nvshmem_lib, options
from epbench.launch import mps_active, shares_gpus
from epbench.backends.base import NormalMode
from epbench.contract import DispatchInput, DispatchOutput, RankSetup
from epbench.backends.kernel_common import (poison_dispatch_outputs, raw_stream_getter, release_collective,
                                            wait_then_check)

MAX_GPUS_PER_NODE = 8
MAX_NODES = 16
MAX_TOPK = 32
DEFAULT_SEND_SHARE = 0.5
DEFAULT_CHUNK = 4
TRANSPORTS = ("auto", "put", "direct")  # EphConfig.transport 0, 1, 2


def shares_gpus_without_mps() -> bool:
    return shares_gpus() and not mps_active()


@dataclass
class _Handle:
    num_tokens: int
    topk_idx: torch.Tensor
    topk_weights: torch.Tensor
    epoch: int
    out: torch.Tensor
    combined: bool = False


def send_blocks(num_sms: int, nodes: int, share: float) -> int:
    """Blocks of ``num_sms`` that feed the network tier: none on one node, else at least one and
    at least one left for the NVLink tier."""
    if nodes <= 1:
        return 0
    return min(num_sms - 1, max(1, round(num_sms * share)))


def _config(setup: RankSetup, device: int, transport: str) -> nvshmem_lib.EphConfig:
    return nvshmem_lib.EphConfig(setup.rank, setup.world, setup.gpus_per_node, device, setup.hidden,
                                 setup.max_tokens_per_rank, setup.topk, setup.experts_per_rank,
                                 int(setup.dispatch_dtype == "fp8"), float(setup.timeout_s),
                                 TRANSPORTS.index(transport))


class EpbenchHierBackend(NormalMode):
    name = "epbench-hier"
    uses_sms = True
    hierarchical = True

    @classmethod
    def unavailable_reason(cls, setup: RankSetup) -> Optional[str]:
        if setup.device.type != "cuda" or not torch.cuda.is_available():
            return "needs CUDA GPUs"
        if torch.cuda.get_device_capability(setup.device)[0] < 9:
            return "needs compute capability 9.0 or newer (kernels are built for sm_90)"
        if setup.gpus_per_node > MAX_GPUS_PER_NODE or setup.world % setup.gpus_per_node:
            return f"needs nodes x gpus_per_node ranks with at most {MAX_GPUS_PER_NODE} GPUs per node"
        if setup.world // setup.gpus_per_node > MAX_NODES:
            return f"at most {MAX_NODES} nodes"
        if setup.topk > MAX_TOPK:
            return f"topk {setup.topk} > {MAX_TOPK}"
        multiple = 128 if setup.dispatch_dtype == "fp8" else 8
        if setup.hidden % multiple:
            return f"hidden {setup.hidden} must be a multiple of {multiple}"
        if shares_gpus_without_mps():
            return ("ranks share a GPU and no MPS daemon serves them: NVSHMEM's support for several "
                    "PEs per GPU is limited without MPS (start nvidia-cuda-mps-control -d)")
        try:
            nvshmem_lib.load()
        except RuntimeError as e:
            return str(e)
        return None

    def effective_config(self) -> Dict[str, Any]:
        return {"send_share": self.send_share, "chunk": self.chunk, "transport": self.transport}

    def __init__(self, setup: RankSetup, *, send_share: Optional[float] = None,
                 chunk: Optional[int] = None, transport: Optional[str] = None) -> None:
        reason = self.unavailable_reason(setup)
        if reason:
            raise RuntimeError(f"epbench-hier backend unavailable: {reason}")
        self.s = setup
        given = {k: v for k, v in (("send_share", send_share), ("chunk", chunk), ("transport", transport))
                 if v is not None}
        resolved = options.resolve(self.name, given)
        self.send_share, self.chunk = float(resolved["send_share"]), int(resolved["chunk"])
        self.transport = resolved["transport"]
        if not 0.0 < self.send_share < 1.0 or not 1 <= self.chunk <= 1024:
            raise ValueError(f"send_share must be in (0, 1) and chunk in 1..1024, got {self.send_share} and {self.chunk}")
        if self.transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {', '.join(TRANSPORTS)}, got {self.transport!r}")
        self._check_same_chunk()
        self.nodes = setup.world // setup.gpus_per_node
        self.device = torch.device("cuda", setup.device.index if setup.device.index is not None
                                   else torch.cuda.current_device())
        self.fp8 = setup.dispatch_dtype == "fp8"
        self._x_dtype = torch.float8_e4m3fn if self.fp8 else torch.bfloat16
        lib = nvshmem_lib.load()
        cfg = _config(setup, self.device.index, self.transport)
        heap = lib.eph_symmetric_bytes(ctypes.byref(cfg))
        nvshmem_lib.check(-1 if heap < 0 else 0, "eph_symmetric_bytes")
        self._lib = nvshmem_lib.ensure_initialised(setup.rank, setup.world, self.device.index, heap)
        self._ctx = ctypes.c_void_p()
        nvshmem_lib.check(self._lib.eph_create(ctypes.byref(cfg), ctypes.byref(self._ctx)), "eph_create")
        self._views()
        self._timed_out = ctypes.c_int.from_address(self._lib.eph_error_flag_ptr(self._ctx))
        self._stream = raw_stream_getter(self.device)
        self._epoch = 0
        self._checked: Optional[tuple] = None

    def _check_same_chunk(self) -> None:
        """Every rank must use the same chunk (senders and receivers count signals in chunks); the
        environment may differ between nodes, so it is compared once, here."""
        if self.s.world > 1 and dist.is_available() and dist.is_initialized():
            chunks: List[Any] = [None] * self.s.world
            dist.all_gather_object(chunks, self.chunk)
            if len(set(chunks)) > 1:
                raise ValueError(f"option chunk (EPBENCH_HIER_CHUNK) differs between ranks ({chunks}): set it the same on every node")

    def _region(self, which: int) -> torch.Tensor:
        return cuda_lib.region_tensor(self._lib.eph_region, self._ctx, which, self.device)

    def _views(self) -> None:
        s, L = self.s, nvshmem_lib
        cap, h, k = s.world * s.max_tokens_per_rank, s.hidden, s.topk
        self.recv_x = self._region(L.EPH_RECV_X).view(self._x_dtype).view(cap, h)
        self.recv_scales = (self._region(L.EPH_RECV_SCALES).view(torch.float32).view(cap, h // 128)
                            if self.fp8 else None)
        self.recv_idx = self._region(L.EPH_RECV_IDX).view(torch.int64).view(cap, k)
        self.recv_w = self._region(L.EPH_RECV_W).view(torch.float32).view(cap, k)
        self.combine_in = self._region(L.EPH_COMBINE_IN).view(torch.bfloat16).view(cap, h)
        self.num_recv = self._region(L.EPH_NUM_RECV).view(torch.int64).view(())
        self.expert_counts = self._region(L.EPH_EXPERT_COUNTS).view(torch.int64)
        self.out = torch.empty(s.max_tokens_per_rank, h, dtype=torch.bfloat16, device=self.device)

    def dispatch(self, inp: DispatchInput, num_sms: int) -> DispatchOutput:
        x, idx, w = inp.x, inp.topk_idx, inp.topk_weights
        c = self._checked
        if c is None or c[0] is not x or c[1] is not idx or c[2] is not w or c[3] is not inp.x_scales:
            cuda_lib.check_dispatch_input(inp, self.s, self._x_dtype, self.fp8)
            self._checked = (x, idx, w, inp.x_scales)
        t = x.shape[0]
        epoch = self._epoch + 1  # kept only once enqueued: every rank's epochs must stay in step
        rc = self._lib.eph_dispatch(self._ctx, x.data_ptr(), inp.x_scales.data_ptr() if self.fp8 else None,
                                    idx.data_ptr(), w.data_ptr(), t, num_sms,
                                    send_blocks(num_sms, self.nodes, self.send_share), self.chunk, epoch,
                                    self._stream())
        if rc:
            nvshmem_lib.check(rc, "eph_dispatch")
        self._epoch = epoch
        if self._timed_out.value:
            self._raise_if_timed_out()
        handle = _Handle(t, idx, w, self._epoch, self.out[:t])
        return DispatchOutput(self.recv_x, self.recv_scales, self.recv_idx, self.recv_w,
                              self.expert_counts, self.num_recv, handle)

    def combine_input(self, out: DispatchOutput) -> torch.Tensor:
        return self.combine_in

    def combine(self, out: DispatchOutput, num_sms: int) -> torch.Tensor:
        h: _Handle = out.handle
        if h.epoch != self._epoch:
            raise RuntimeError("epbench-hier combine must follow its own dispatch (another dispatch ran since)")
        if h.combined:  # its flags and signals already hold this epoch: a second combine would not wait
            raise RuntimeError("epbench-hier: this dispatch was already combined; dispatch again first")
        h.combined = True
        rc = self._lib.eph_combine(self._ctx, h.out.data_ptr(), h.topk_idx.data_ptr(), h.topk_weights.data_ptr(),
                                   h.num_tokens, num_sms, send_blocks(num_sms, self.nodes, self.send_share),
                                   h.epoch, self._stream())
        if rc:
            nvshmem_lib.check(rc, "eph_combine")
        if self._timed_out.value:
            self._raise_if_timed_out()
        return h.out

    def _raise_if_timed_out(self) -> None:
        cuda_lib.raise_if_timed_out(self._lib, self._ctx, self.s.timeout_s, poll=self._lib.eph_poll_error,
                                    phases=nvshmem_lib.PHASES)

    def check_errors(self) -> None:
        """Waits for this rank's queued kernels, then raises if any of them timed out on a peer."""
        wait_then_check(self.device, self._raise_if_timed_out)

    def poison(self) -> None:
        poison_dispatch_outputs(self)

    def close(self) -> None:
        """Collective: every rank must call it (peers may still write into this rank's buffers)."""
        if self._ctx:
            release_collective(self.device, self.s.world,
                               lambda: nvshmem_lib.check(self._lib.eph_destroy(self._ctx), "eph_destroy"))
            self._ctx = ctypes.c_void_p()
