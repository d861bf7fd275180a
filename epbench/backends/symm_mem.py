"""The ``symm-mem`` backend: torch's own ``torch.distributed._symmetric_memory`` all-to-all
(NVSHMEM from the torch wheel), what torchtitan-style training uses without any extra install.
Driven as a user calls it; every step below is inside the timed call.

Torch's ops, as its sources and tests define them (all buffers from ``symm_mem.empty``, the
same shape on every rank, rendezvoused once):

``all_to_all_vdev(input, out, in_splits, out_splits_offsets)``
    ``input`` holds contiguous chunks of rows, one per destination rank in rank order, of
    ``in_splits[d]`` rows; ``out`` gets the chunks sent to this rank in source order, and
    ``out_splits_offsets`` ``[2, world]`` their row counts and (exclusive) starting rows.
``all_to_all_vdev_2d(input, out, in_splits, out_splits_offsets, major_align)``
    ``input`` chunks in (destination rank, local expert) order, ``in_splits[r * E + e]`` rows;
    ``out`` gets them expert-major: for each local expert, one chunk per source rank, in source
    order; each expert's run of rows is padded up to a multiple of ``major_align`` rows, and an
    expert that receives nothing still takes ``major_align`` rows (torch keeps grouped GEMMs
    free of empty groups). ``out_splits_offsets[:, e * world + s]``: rows and first row.
``all_to_all_vdev_2d_offset(input, out, in_splits_offsets, out_splits_offsets)``
    The way back: ``input`` chunks in (local expert, destination rank) order at the given
    offsets (padding is not sent); ``out`` gets them back in (source rank, expert) order, packed.

The ops move rows of bytes (the row stride), so any dtype travels; ``input`` and ``out`` must have
the same dtype and row stride.

rank_major (``all_to_all_vdev``)
    One packed row per (token, destination rank): [expert ids int64 x topk | weights f32 x topk |
    scales | payload | padding], gathered (index_select, after one host read of which tokens go
    where: ``nonzero``) into the symmetric send buffer. The counts per destination stay on the
    device: the received row count is a device tensor. Combine sends the rows back the same way
    (the splits it received are the splits it sends) and the source adds ``w(t, d) * y`` in fp32.
expert_major (``all_to_all_vdev_2d``, ``major_align = align``)
    One row per (token, expert) pair, [scales | payload | padding], ordered by global expert (which
    is (destination rank, local expert)), straight into segments a grouped GEMM reads. A token that
    picks several experts of one rank crosses the link once per expert, as torch's layout has it.
    The per-(source, token) ids and weights epbench's contract returns come by a second
    ``all_to_all_vdev`` of metadata rows. Combine: ``all_to_all_vdev_2d_offset`` with the dispatch's
    splits and offsets sends each expert's output rows back; the source adds ``weight * y`` per
    (token, expert) in fp32.

Where torch's layout differs from epbench's (``epbench/layout.py``): an expert with no rows takes
``align`` rows (at least one) of padding in torch, none in epbench. The adapter reports torch's
offsets as they are; verification counts such a segment table as wrong.

Known limits, from torch's kernels as read (``LIMITS``), become skipped rows before launch.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any, Optional, Tuple

import torch

from epbench.backends.base import NormalMode
from epbench.contract import DispatchInput, DispatchOutput, RankSetup
from epbench.backends.reference import typed_payload
from epbench.layout import ExpertMajor, round_up
from epbench.metrics import row_bytes
from epbench.routing import copy_weights, dest_mask

# torch's kernels (nvshmem_extension.cu): the 2d dispatch prefix-sums one warp of source ranks per
# expert, one tile of 32 threads per expert in a 512-thread block; the 2d_offset way back swaps
# the roles (ranks per tile, experts per warp). Splits of all (rank, expert) pairs fit one block.
MAX_WORLD_2D = 32
MAX_EXPERTS_2D = 512 // 32
MAX_WORLD_2D_OFFSET = 512 // 32
MAX_EXPERTS_2D_OFFSET = 32
# all_to_all_vdev splits each peer's bytes evenly over 8, 16, 32 or 64 blocks / world (at least 1)
# and asserts on the device that the split is exact: a row stride divisible by every such count
# keeps any row count exact.
VDEV_BLOCKS = (8, 16, 32, 64)
HEAP_MARGIN = 256 << 20


def row_unit(world: int) -> int:
    """Bytes a packed row is padded to: 16 (aligned typed views) and every per-peer block count
    ``all_to_all_vdev`` may use at this world size."""
    unit = 16
    for n in VDEV_BLOCKS:
        unit = unit * max(n // world, 1) // math.gcd(unit, max(n // world, 1))
    return unit


def limits_reason(world: int, nvshmem_available: bool, device_type: str, layout: str = "rank_major",
                  experts_per_rank: int = 1) -> Optional[str]:
    """What torch's symmetric-memory all-to-all cannot run, known before launch."""
    if device_type != "cuda":
        return "needs CUDA GPUs"
    if world < 2:
        return "needs world > 1 (torch refuses one rank: global_ranks.size() > 1)"
    if not nvshmem_available:
        return "torch's NVSHMEM is not usable here (symm_mem.is_nvshmem_available() is False)"
    if layout == "expert_major":
        if experts_per_rank > MAX_EXPERTS_2D:
            return (f"expert_major: torch's all_to_all_vdev_2d takes at most {MAX_EXPERTS_2D} experts per "
                    f"rank ({experts_per_rank})")
        if world > min(MAX_WORLD_2D, MAX_WORLD_2D_OFFSET):
            return (f"expert_major: torch's all_to_all_vdev_2d_offset (combine) takes at most "
                    f"{MAX_WORLD_2D_OFFSET} ranks ({world})")
    return None


class TorchSymm:
    """torch's symmetric memory on the default process group: the calls the backend makes."""

    def __init__(self, device: torch.device, heap_bytes: int) -> None:
        import torch.distributed as dist
        import torch.distributed._symmetric_memory as symm_mem

        self._dist, self._sm = dist, symm_mem
        # NVSHMEM reads its heap size once, when the first symmetric tensor is allocated.
        os.environ.setdefault("NVSHMEM_SYMMETRIC_SIZE", str(max(1 << 30, heap_bytes + HEAP_MARGIN)))
        os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")  # never NVLink multicast
        if symm_mem.get_backend(device) != "NVSHMEM":
            symm_mem.set_backend("NVSHMEM")
        self.group_name = dist.group.WORLD.group_name
        symm_mem.enable_symm_mem_for_group(self.group_name)

    def empty(self, shape: Tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        t = self._sm.empty(shape, dtype=dtype, device=device)
        self._sm.rendezvous(t, self.group_name)
        return t

    def barrier(self) -> None:
        self._dist.barrier()

    def all_to_all_vdev(self, inp, out, in_splits, out_splits_offsets) -> None:
        torch.ops.symm_mem.all_to_all_vdev(inp, out, in_splits, out_splits_offsets, self.group_name)

    def all_to_all_vdev_2d(self, inp, out, in_splits, out_splits_offsets, major_align: int) -> None:
        torch.ops.symm_mem.all_to_all_vdev_2d(inp, out, in_splits, out_splits_offsets, self.group_name,
                                              major_align=major_align)

    def all_to_all_vdev_2d_offset(self, inp, out, in_splits_offsets, out_splits_offsets) -> None:
        torch.ops.symm_mem.all_to_all_vdev_2d_offset(inp, out, in_splits_offsets, out_splits_offsets,
                                                     self.group_name)


@dataclass
class _Handle:
    topk_idx: torch.Tensor  # the source's routing, for the weights on the way back
    topk_weights: torch.Tensor
    token_of_copy: torch.Tensor  # [copies] source token of each sent (token, rank) row, by (rank, token)
    dest_of_copy: torch.Tensor
    pair_order: Optional[torch.Tensor] = None  # expert_major: t * topk + k of each sent pair row


class SymmMemBackend(NormalMode):
    name = "symm-mem"
    dtypes = ("bf16", "fp8", "mxfp8")
    layouts = ("rank_major", "expert_major")

    @classmethod
    def unavailable_reason(cls, setup: RankSetup) -> Optional[str]:
        try:
            import torch.distributed._symmetric_memory as symm_mem
            available = bool(symm_mem.is_nvshmem_available())
        except Exception as e:
            return f"torch.distributed._symmetric_memory not importable ({e})"
        reason = limits_reason(setup.world, available, setup.device.type if torch.cuda.is_available() else "cpu",
                               setup.layout, setup.experts_per_rank)
        from epbench.launch import shares_gpus
        if reason is None and shares_gpus():
            reason = ("needs one GPU per rank: torch's NVSHMEM refuses ranks sharing a GPU, with or without "
                      "MPS ('NVSHMEM API not supported with limited MPG runs', one H100, 2026-11-25)")
        return reason

    def __init__(self, setup: RankSetup, *, symm: Any = None) -> None:
        s = self.s = setup
        w, e, tm, k, h = setup.world, setup.experts_per_rank, setup.max_tokens_per_rank, setup.topk, setup.hidden
        self.expert_major = setup.layout == "expert_major"
        self.x_bytes = 2 * h if setup.dispatch_dtype == "bf16" else h
        self.scale_bytes = row_bytes(setup.dispatch_dtype, h) - self.x_bytes
        self.meta_bytes = 12 * k
        unit = row_unit(w)
        # rank_major rows carry everything; expert_major splits metadata and payload in two exchanges
        self.row = round_up(self.meta_bytes + (0 if self.expert_major else self.scale_bytes + self.x_bytes), unit)
        self.pair_row = round_up(self.scale_bytes + self.x_bytes, 16)
        cap = w * tm  # (token, rank) rows one rank can receive
        pairs = tm * k
        slots = w * pairs + e * max(setup.align, 1)  # every pair of every source, plus each expert's padding
        dev, u8, i64 = setup.device, torch.uint8, torch.int64
        sizes = [(tm * w, self.row), (cap, self.row)]
        if self.expert_major:
            sizes += [(pairs, self.pair_row), (slots, self.pair_row), (slots, 2 * h), (pairs, 2 * h)]
        else:
            sizes += [(cap, 2 * h), (tm * w, 2 * h)]
        self._symm = symm if symm is not None else TorchSymm(dev, sum(a * b for a, b in sizes))
        m = self._symm
        self.tokens = torch.zeros(tm, self.row, dtype=u8, device=dev)  # staging, not symmetric
        self.send = m.empty((tm * w, self.row), u8, dev)
        self.recv = m.empty((cap, self.row), u8, dev)
        self.splits = m.empty((w,), i64, dev)
        self.recv_so = m.empty((2, w), i64, dev)
        if not self.expert_major:
            self.combine_in = m.empty((cap, h), torch.bfloat16, dev)
            self.back = m.empty((tm * w, h), torch.bfloat16, dev)
            self.back_splits = m.empty((w,), i64, dev)
            self.back_so = m.empty((2, w), i64, dev)
        else:
            self.pair_tokens = torch.zeros(tm, self.pair_row, dtype=u8, device=dev)
            self.send2d = m.empty((pairs, self.pair_row), u8, dev)
            self.recv2d = m.empty((slots, self.pair_row), u8, dev)
            self.splits2d = m.empty((w * e,), i64, dev)
            self.recv2d_so = m.empty((2, w * e), i64, dev)
            self.combine_in = m.empty((slots, h), torch.bfloat16, dev)
            self.back2d = m.empty((pairs, h), torch.bfloat16, dev)
            self.back2d_in_so = m.empty((2, w * e), i64, dev)
            self.back2d_so = m.empty((2, w * e), i64, dev)
        self.acc = torch.empty(tm, h, dtype=torch.float32, device=dev)
        self.out = torch.empty(tm, h, dtype=torch.bfloat16, device=dev)
        self.row_ids = torch.arange(cap, device=dev)
        m.barrier()  # every rank's buffers exist before the first exchange

    # ---- packed rows ----
    def _meta(self, rows: torch.Tensor):
        k = self.s.topk
        return rows[:, : 8 * k].view(torch.int64), rows[:, 8 * k: self.meta_bytes].view(torch.float32)

    def _payload(self, rows: torch.Tensor, start: int):
        """(scales, x) views of the payload columns that begin at byte ``start``."""
        sc = self.scale_bytes
        return typed_payload(self.s.dispatch_dtype, rows[:, start: start + sc],
                             rows[:, start + sc: start + sc + self.x_bytes])

    def _pack(self, rows: torch.Tensor, start: int, inp: DispatchInput) -> None:
        scales, x = self._payload(rows, start)
        if scales is not None:
            scales.copy_(inp.x_scales)
        x.copy_(inp.x)

    # ---- dispatch ----
    def dispatch(self, inp: DispatchInput, num_sms: int) -> DispatchOutput:
        s = self.s
        t = inp.num_tokens
        mask = dest_mask(inp.topk_idx, s.experts_per_rank, s.world)
        dest_of_copy, token_of_copy = mask.t().nonzero(as_tuple=True)  # by (rank, token): a host read
        packed = self.tokens[:t]
        ids, weights = self._meta(packed)
        ids.copy_(inp.topk_idx)
        weights.copy_(inp.topk_weights)
        if not self.expert_major:
            self._pack(packed, self.meta_bytes, inp)
        torch.index_select(packed.view(torch.int64), 0, token_of_copy,
                           out=self.send[: token_of_copy.numel()].view(torch.int64))
        self.splits.copy_(mask.sum(dim=0))
        self._symm.all_to_all_vdev(self.send, self.recv, self.splits, self.recv_so)
        num_recv = self.recv_so[0].sum()
        ids, weights = self._meta(self.recv)
        handle = _Handle(inp.topk_idx, inp.topk_weights, token_of_copy, dest_of_copy)
        if self.expert_major:
            return self._dispatch_2d(inp, ids, weights, num_recv, handle)
        local = ids - s.rank * s.experts_per_rank
        valid = (self.row_ids < num_recv).unsqueeze(1)  # rows past num_recv hold stale bytes
        hit = valid & (local >= 0) & (local < s.experts_per_rank)
        other = s.experts_per_rank  # one extra bin for experts of other ranks (no boolean gather)
        counts = torch.bincount(torch.where(hit, local, other).flatten(), minlength=other + 1)[:other]
        scales, x = self._payload(self.recv, self.meta_bytes)
        return DispatchOutput(x, scales, ids, weights, counts, num_recv, handle)

    def _dispatch_2d(self, inp: DispatchInput, ids: torch.Tensor, weights: torch.Tensor,
                     num_recv: torch.Tensor, handle: _Handle) -> DispatchOutput:
        s = self.s
        t, k = inp.topk_idx.shape
        e, w = s.experts_per_rank, s.world
        flat = inp.topk_idx.flatten()
        order = torch.argsort(flat, stable=True)  # by global expert = (rank, local expert), then token
        packed = self.pair_tokens[:t]
        self._pack(packed, 0, inp)
        torch.index_select(packed.view(torch.int64), 0, order // k,
                           out=self.send2d[: order.numel()].view(torch.int64))
        self.splits2d.copy_(torch.bincount(flat, minlength=w * e))
        self._symm.all_to_all_vdev_2d(self.send2d, self.recv2d, self.splits2d, self.recv2d_so, s.align)
        per_source = self.recv2d_so[0].view(e, w)
        counts = per_source.sum(dim=1)
        offsets = self.recv2d_so[1].view(e, w)[:, 0].contiguous()
        last = torch.clamp(round_up(counts[-1], s.align), min=s.align)  # torch pads an empty expert too
        table = ExpertMajor(counts, offsets, offsets[-1] + last, s.align)
        handle.pair_order = order
        scales, x = self._payload(self.recv2d, 0)
        return DispatchOutput(x, scales, ids, weights, counts, num_recv, handle, table)

    # ---- combine ----
    def combine_input(self, out: DispatchOutput) -> torch.Tensor:
        return self.combine_in  # the whole buffer: the row count stays on the device

    def combine(self, out: DispatchOutput, num_sms: int) -> torch.Tensor:
        s, lay = self.s, out.handle
        t = lay.topk_idx.shape[0]
        acc = self.acc[:t].zero_()
        if self.expert_major:
            self.back2d_in_so.copy_(self.recv2d_so)
            self._symm.all_to_all_vdev_2d_offset(self.combine_in, self.back2d, self.back2d_in_so, self.back2d_so)
            order = lay.pair_order
            back = self.back2d[: order.numel()].float()
            w_pair = lay.topk_weights.flatten()[order]
            acc.index_add_(0, order // s.topk, back.mul_(w_pair.unsqueeze(1)))
        else:
            self.back_splits.copy_(self.recv_so[0])
            self._symm.all_to_all_vdev(self.combine_in, self.back, self.back_splits, self.back_so)
            n = lay.token_of_copy.numel()
            w = copy_weights(lay.topk_idx, lay.topk_weights, s.experts_per_rank, s.world)
            w_copy = w[lay.token_of_copy, lay.dest_of_copy]
            acc.index_add_(0, lay.token_of_copy, self.back[:n].float().mul_(w_copy.unsqueeze(1)))
        out_rows = self.out[:t]
        out_rows.copy_(acc)
        return out_rows

    def poison(self) -> None:
        self.recv.fill_(0xFF)
        if self.expert_major:
            self.recv2d.fill_(0xFF)
            self.back2d.fill_(float("nan"))
        else:
            self.back.fill_(float("nan"))
        self.out.fill_(float("nan"))

    def close(self) -> None:
        self._symm.barrier()  # no rank frees a buffer a peer may still read
        for name in ("send", "recv", "combine_in", "back", "send2d", "recv2d", "back2d"):
            if hasattr(self, name):
                delattr(self, name)
