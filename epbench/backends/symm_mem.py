"""The ``symm-mem`` backend: torch's own ``torch.distributed._symmetric_memory`` all-to-all
(NVSHMEM from the torch wheel), what torchtitan-style training uses without any extra install.
Driven as a user calls it; in call mode every step below is inside the timed call.

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
    scales | payload | padding], each field gathered (``index_select`` as 8-byte words) from the
    caller's tensors straight into its columns of the symmetric send buffer, by destination. Which
    token goes where is found on the device (``nonzero_static`` with room for every (token, rank)
    pair; rows past the copies are never sent) and the per-expert counts by ``scatter_add_``:
    nothing in the call waits on the host, as torch's op (splits on the device) allows. Combine
    sends the rows back the same way (the splits it received are the splits it sends), gathers each
    token's returned rows into a dense [T, world, hidden] (a row a token did not send reads a zero row
    kept after the receive buffer's rows) and sums them with one batched product per token,
    w(t, d) in bf16, fp32 accumulation, one bf16 rounding (two roundings, as the reference).
expert_major (``all_to_all_vdev_2d``, ``major_align = align``)
    One row per (token, expert) pair, [scales | payload | padding], ordered by global expert (which
    is (destination rank, local expert)), straight into segments a grouped GEMM reads. A token that
    picks several experts of one rank crosses the link once per expert, as torch's layout has it.
    The per-(source, token) ids and weights epbench's contract returns come by a second
    ``all_to_all_vdev`` of metadata rows. Combine: ``all_to_all_vdev_2d_offset`` with the dispatch's
    splits and offsets sends each expert's output rows back; the source gathers them into a dense
    [T, topk, hidden] and sums ``weight * y`` per token by the same batched product.

Row strides (``row_unit``): ``all_to_all_vdev`` splits each peer's bytes into ``blocks / world``
equal pieces, one per block, asserts on the device that they are whole, and each block copies its
piece with NVSHMEM's threadgroup memcpy, whose loads are only as wide as the piece's start address
is aligned (16, 8, 4, 2 or 1 bytes, for the whole piece). Every row is therefore padded to 16 bytes
times every per-peer block count torch may pick, so that any row count gives whole pieces starting
16-byte aligned (a 14432-byte row, 16-byte padded, left most pieces 2- or 4-byte aligned:
notes/SYMM-MEM.md). torch picks the block count from the input tensor's bytes (older: 8, 16, 32 or
64; newer: one per 64 KiB rounded up to the world, at most 64 within a node, 16 across; or
``TORCH_SYMMMEM_NBLOCKS``, which ``limits_reason`` refuses); from 4 MiB up both give their
largest, so every input buffer is at least that (``vdev_rows``).

Call modes (rows' ``call_mode``): ``call`` is the above; ``kernel`` makes the layout (the mask, the
copies, the splits and each returned row's place) once per input set outside the timed call, as the
reference's kernel mode does; the timed dispatch is the gather, the exchange (torch's op still
exchanges the splits itself) and the counts; combine is the same in both.

Dispatch and combine are named steps, one method each (``PHASES``), so that tools/fidelity_phases.py
can time each step as it does the reference's.

Where torch's layout differs from epbench's (``epbench/layout.py``): an expert with no rows takes
``align`` rows (at least one) of padding in torch, none in epbench. The adapter reports torch's
offsets as they are; verification counts such a segment table as wrong.

Known limits, from torch's kernels as read (``LIMITS``), become skipped rows before launch.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import torch

from epbench.backends.base import KernelLayouts, NormalMode
from epbench.backends.reference import typed_payload
from epbench.contract import DispatchInput, DispatchOutput, RankSetup
from epbench.layout import ExpertMajor, device_histogram, round_up
from epbench.metrics import row_bytes
from epbench.routing import copy_weights, dest_mask

# torch's kernels (nvshmem_extension.cu): the 2d dispatch prefix-sums one warp of source ranks per
# expert, one tile of 32 threads per expert in a 512-thread block; the 2d_offset way back swaps
# the roles (ranks per tile, experts per warp). Splits of all (rank, expert) pairs fit one block.
MAX_WORLD_2D = 32
MAX_EXPERTS_2D = 512 // 32
MAX_WORLD_2D_OFFSET = 512 // 32
MAX_EXPERTS_2D_OFFSET = 32
# all_to_all_vdev's block counts (module docstring); each peer gets blocks / world of them (at least 1)
VDEV_BLOCKS = (8, 16, 32, 64)
VDEV_MIN_INPUT = 4 << 20  # input bytes from which both of torch's block counts are their largest
ALIGNED_LOAD = 16  # bytes: NVSHMEM's widest load in its threadgroup memcpy
HEAP_MARGIN = 256 << 20


def row_unit(world: int) -> int:
    """Bytes an ``all_to_all_vdev`` row is padded to: 16 times every per-peer block count torch may
    use at this world size, so that each block's piece of a peer's rows is whole and starts 16-byte
    aligned whatever the row count."""
    per_peer = 1
    for n in VDEV_BLOCKS:
        b = max(n // world, 1)
        per_peer = per_peer * b // math.gcd(per_peer, b)
    return ALIGNED_LOAD * per_peer


def vdev_rows(rows: int, row: int) -> int:
    """Rows to allocate for an ``all_to_all_vdev`` input that sends up to ``rows`` rows of ``row``
    bytes: at least ``VDEV_MIN_INPUT`` bytes, where torch's block count is the one ``row_unit``
    pads for (a smaller input may get, say, 3 blocks per peer and fail torch's exact-split assert)."""
    return max(rows, -(-VDEV_MIN_INPUT // row))


def limits_reason(world: int, nvshmem_available: bool, device_type: str, layout: str = "rank_major",
                  experts_per_rank: int = 1) -> Optional[str]:
    """What torch's symmetric-memory all-to-all cannot run, known before launch."""
    if device_type != "cuda":
        return "needs CUDA GPUs"
    if world < 2:
        return "needs world > 1 (torch refuses one rank: global_ranks.size() > 1)"
    if not nvshmem_available:
        return "torch's NVSHMEM is not usable here (symm_mem.is_nvshmem_available() is False)"
    if os.environ.get("TORCH_SYMMMEM_NBLOCKS"):
        return (f"TORCH_SYMMMEM_NBLOCKS={os.environ['TORCH_SYMMMEM_NBLOCKS']} is set: torch's all_to_all_vdev "
                f"would launch that many blocks, not a count the rows are padded for (row_unit); unset it")
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


def _words(src: torch.Tensor, col: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Byte rows ``src`` and the byte columns ``col`` of packed rows (the same width), viewed as
    the widest integers both allow: a byte-typed gather moves one byte per element."""
    for dtype, size in ((torch.int64, 8), (torch.int32, 4), (torch.int16, 2)):
        if all(t.shape[1] % size == 0 and t.storage_offset() % size == 0 and t.stride(0) % size == 0
               for t in (src, col)):
            return src.view(dtype), col.view(dtype)
    return src, col


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """[rows, ...] as [rows, bytes per row] uint8 (contiguous rows)."""
    return t.contiguous().view(t.shape[0], -1).view(torch.uint8)


@dataclass
class _Layout:
    """Which token goes where, found from the routing alone (kernel mode: once per input set)."""

    token_of_copy: torch.Tensor  # [T * world] source token of each sent row, by (destination, token);
    #                              past the copies: token 0, in rows that are never sent
    splits: torch.Tensor  # [world] int64: rows to each rank
    back_row: Optional[torch.Tensor] = None  # rank-major: [T * world] the row of copy (t, d) in combine's
    #                                          receive buffer, or its zero row where t sent none to d
    pair_token: Optional[torch.Tensor] = None  # expert_major: [T * topk] token of each sent pair row
    pair_splits: Optional[torch.Tensor] = None  # [world * E] pairs per (rank, local expert)
    pair_back: Optional[torch.Tensor] = None  # [T * topk]: the row of pair t * topk + k in combine's receive buffer


@dataclass
class _Handle:
    layout: _Layout
    topk_idx: torch.Tensor  # the source's routing, for the weights on the way back
    topk_weights: torch.Tensor


class SymmMemBackend(KernelLayouts, NormalMode):
    name = "symm-mem"
    dtypes = ("bf16", "fp8", "mxfp8")
    layouts = ("rank_major", "expert_major")
    call_modes = ("call", "kernel")
    # dispatch and combine as named steps, one method each, in the order they run (a caller may wrap
    # the methods to time each step: tools/fidelity_phases.py). layout: call mode only; counts:
    # rank-major; pair_gather, pair_all_to_all, segments: expert-major (after the metadata exchange).
    PHASES = {
        "dispatch": (("layout", "_layout"), ("gather", "_gather"), ("all_to_all", "_exchange"),
                     ("counts", "_counts"), ("pair_gather", "_gather_pairs"),
                     ("pair_all_to_all", "_exchange_pairs"), ("segments", "_segments")),
        "combine": (("all_to_all", "_send_back"), ("gather", "_gather_back"), ("weights", "_copy_weights"),
                    ("weighted_sum", "_weighted_sum")),
    }

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

    @staticmethod
    def symmetric_shapes(setup: RankSetup) -> List[Tuple[str, Tuple[int, int], int]]:
        """(name, (rows, row bytes), element bytes) of every large symmetric buffer, in allocation order."""
        w, e, tm, k, h = setup.world, setup.experts_per_rank, setup.max_tokens_per_rank, setup.topk, setup.hidden
        em = setup.layout == "expert_major"
        unit = row_unit(w)
        x_bytes = 2 * h if setup.dispatch_dtype == "bf16" else h
        scale_bytes = row_bytes(setup.dispatch_dtype, h) - x_bytes
        row = round_up(12 * k + (0 if em else scale_bytes + x_bytes), unit)
        cap = w * tm  # (token, rank) rows one rank can receive
        shapes = [("send", (vdev_rows(tm * w, row), row), 1), ("recv", (cap, row), 1)]
        if em:
            pair_row = round_up(scale_bytes + x_bytes, 16)
            slots = w * tm * k + e * max(setup.align, 1)  # every pair of every source, plus each expert's padding
            return shapes + [("send2d", (tm * k, pair_row), 1), ("recv2d", (slots, pair_row), 1),
                             ("combine_in", (slots, 2 * h), 2), ("back2d", (tm * k, 2 * h), 2)]
        back_row = round_up(2 * h, unit)  # combine's rows: bf16, padded like dispatch's
        return shapes + [("combine_in", (vdev_rows(cap, back_row), back_row), 2),
                         ("back", (tm * w + 1, back_row), 2)]  # + the zero row

    @classmethod
    def heap_bytes(cls, setup: RankSetup) -> int:
        return sum(rows * row for _, (rows, row), _ in cls.symmetric_shapes(setup))

    def __init__(self, setup: RankSetup, *, symm: Any = None) -> None:
        self.s = setup
        w, e, tm, k, h = setup.world, setup.experts_per_rank, setup.max_tokens_per_rank, setup.topk, setup.hidden
        self.expert_major = setup.layout == "expert_major"
        self._layouts: Dict[int, _Layout] = {}  # id of a prepared input -> its layout (kernel mode)
        self.x_bytes = 2 * h if setup.dispatch_dtype == "bf16" else h
        self.scale_bytes = row_bytes(setup.dispatch_dtype, h) - self.x_bytes
        self.meta_bytes = 12 * k
        shapes = self.symmetric_shapes(setup)
        self._symm = symm if symm is not None else TorchSymm(setup.device, self.heap_bytes(setup))
        m, dev, i64 = self._symm, setup.device, torch.int64
        for name, (rows, row), size in shapes:
            dtype = torch.uint8 if size == 1 else torch.bfloat16
            setattr(self, name, m.empty((rows, row // size), dtype, dev))
        cap = w * tm
        self.splits = m.empty((w,), i64, dev)
        self.recv_so = m.empty((2, w), i64, dev)
        if self.expert_major:
            self.splits2d = m.empty((w * e,), i64, dev)
            self.recv2d_so = m.empty((2, w * e), i64, dev)
            self.back2d_in_so = m.empty((2, w * e), i64, dev)
            self.back2d_so = m.empty((2, w * e), i64, dev)
            self.dense = torch.empty(tm * k, h, dtype=torch.bfloat16, device=dev)
        else:
            self.back_splits = m.empty((w,), i64, dev)
            self.back_so = m.empty((2, w), i64, dev)
            self.zero_row = tm * w  # back's last row: what a (token, rank) pair that sent nothing reads
            self.back[self.zero_row].zero_()
            self.dense = torch.empty(tm * w, self.back.shape[1], dtype=torch.bfloat16, device=dev)
        self.out = torch.empty(tm, h, dtype=torch.bfloat16, device=dev)
        self.row_ids = torch.arange(cap, device=dev)
        m.barrier()  # every rank's buffers exist before the first exchange

    def prepare_input(self, inp: DispatchInput, num_sms: int) -> DispatchInput:
        """Kernel mode: this input set's layout, made once, untimed."""
        if self.kernel:
            self._layouts[id(inp)] = self._layout(inp)
        return inp

    # ---- packed rows ----
    def _meta(self, rows: torch.Tensor):
        k = self.s.topk
        return rows[:, : 8 * k].view(torch.int64), rows[:, 8 * k: self.meta_bytes].view(torch.float32)

    def _payload(self, rows: torch.Tensor, start: int):
        """(scales, x) views of the payload columns that begin at byte ``start``."""
        sc = self.scale_bytes
        return typed_payload(self.s.dispatch_dtype, rows[:, start: start + sc],
                             rows[:, start + sc: start + sc + self.x_bytes])

    def _fields(self, inp: DispatchInput, rows: torch.Tensor, meta: bool, payload_at: Optional[int]):
        """(source bytes, destination byte columns) of each field a row carries."""
        out = []
        if meta:
            k = self.s.topk
            out += [(_bytes(inp.topk_idx), rows[:, : 8 * k]),
                    (_bytes(inp.topk_weights), rows[:, 8 * k: self.meta_bytes])]
        if payload_at is not None:
            sc = self.scale_bytes
            if sc:
                out.append((_bytes(inp.x_scales), rows[:, payload_at: payload_at + sc]))
            out.append((_bytes(inp.x), rows[:, payload_at + sc: payload_at + sc + self.x_bytes]))
        return out

    @staticmethod
    def _gather_into(fields, index: torch.Tensor) -> None:
        for src, col in fields:
            a, b = _words(src, col)
            torch.index_select(a, 0, index, out=b)

    # ---- dispatch ----
    def dispatch(self, inp: DispatchInput, num_sms: int) -> DispatchOutput:
        lay = self._layouts[id(inp)] if self.kernel else self._layout(inp)
        self._gather(inp, lay)
        num_recv = self._exchange(lay)
        ids, weights = self._meta(self.recv)
        handle = _Handle(lay, inp.topk_idx, inp.topk_weights)
        if self.expert_major:
            self._gather_pairs(inp, lay)
            self._exchange_pairs(lay)
            table = self._segments()
            scales, x = self._payload(self.recv2d, 0)
            return DispatchOutput(x, scales, ids, weights, table.counts, num_recv, handle, table)
        counts = self._counts(ids, num_recv)
        scales, x = self._payload(self.recv, self.meta_bytes)
        return DispatchOutput(x, scales, ids, weights, counts, num_recv, handle)

    def _layout(self, inp: DispatchInput) -> _Layout:
        """Which token goes where, on the device: the copies by (destination, token) with room for
        every (token, rank) pair (no host read of how many), the splits, and where each copy comes
        back in combine (copies return by destination, then token)."""
        s = self.s
        t, w = inp.num_tokens, s.world
        mask = dest_mask(inp.topk_idx, s.experts_per_rank, w)
        token_of_copy = torch.nonzero_static(mask.t(), size=t * w, fill_value=0)[:, 1].contiguous()
        splits = mask.sum(dim=0)
        lay = _Layout(token_of_copy, splits)
        if not self.expert_major:
            place = torch.cumsum(mask, dim=0) - 1 + (torch.cumsum(splits, 0) - splits)
            lay.back_row = torch.where(mask, place, self.zero_row).flatten()
        else:
            flat = inp.topk_idx.flatten()
            order = torch.argsort(flat, stable=True)  # by global expert = (rank, local expert), then token
            lay.pair_token = order // s.topk
            lay.pair_splits = device_histogram(flat, w * s.experts_per_rank)
            rows = torch.arange(order.numel(), device=order.device)
            lay.pair_back = torch.empty_like(order).scatter_(0, order, rows)  # pair -> its row, order's inverse
        return lay

    def _gather(self, inp: DispatchInput, lay: _Layout) -> None:
        """One row per (token, destination), by destination, each field gathered once from the
        caller's tensors into its columns of the symmetric send buffer (expert-major: the ids and
        weights only; its payload travels per pair)."""
        rows = self.send[: lay.token_of_copy.numel()]
        self._gather_into(self._fields(inp, rows, True, None if self.expert_major else self.meta_bytes),
                          lay.token_of_copy)

    def _exchange(self, lay: _Layout) -> torch.Tensor:
        """torch's op (its own split exchange, then the rows); returns the received row count, on the device."""
        self.splits.copy_(lay.splits)
        self._symm.all_to_all_vdev(self.send, self.recv, self.splits, self.recv_so)
        return self.recv_so[0].sum()

    def _counts(self, ids: torch.Tensor, num_recv: torch.Tensor) -> torch.Tensor:
        """Received rows per local expert, on the device."""
        s = self.s
        local = ids - s.rank * s.experts_per_rank
        valid = (self.row_ids < num_recv).unsqueeze(1)  # rows past num_recv hold stale bytes
        return device_histogram(local, s.experts_per_rank, valid & (local >= 0) & (local < s.experts_per_rank))

    def _gather_pairs(self, inp: DispatchInput, lay: _Layout) -> None:
        """Expert-major: one payload row per (token, expert) pair, by global expert."""
        rows = self.send2d[: lay.pair_token.numel()]
        self._gather_into(self._fields(inp, rows, False, 0), lay.pair_token)

    def _exchange_pairs(self, lay: _Layout) -> None:
        self.splits2d.copy_(lay.pair_splits)
        self._symm.all_to_all_vdev_2d(self.send2d, self.recv2d, self.splits2d, self.recv2d_so, self.s.align)

    def _segments(self) -> ExpertMajor:
        """Expert-major: the segment table, from torch's output splits and offsets."""
        s = self.s
        e, w = s.experts_per_rank, s.world
        counts = self.recv2d_so[0].view(e, w).sum(dim=1)
        offsets = self.recv2d_so[1].view(e, w)[:, 0].contiguous()
        last = torch.clamp(round_up(counts[-1], s.align), min=s.align)  # torch pads an empty expert too
        return ExpertMajor(counts, offsets, offsets[-1] + last, s.align)

    # ---- combine ----
    def combine_input(self, out: DispatchOutput) -> torch.Tensor:
        if self.expert_major:
            return self.combine_in  # the whole buffer: the row count stays on the device
        return self.combine_in[: self.s.world * self.s.max_tokens_per_rank, : self.s.hidden]

    def combine(self, out: DispatchOutput, num_sms: int) -> torch.Tensor:
        lay = out.handle
        back = self._send_back(lay)
        dense = self._gather_back(back, lay)
        return self._weighted_sum(self._copy_weights(lay), dense)

    def _send_back(self, lay: _Handle) -> torch.Tensor:
        """The rows back to their sources: the splits this rank received are the ones it sends."""
        if self.expert_major:
            self.back2d_in_so.copy_(self.recv2d_so)
            self._symm.all_to_all_vdev_2d_offset(self.combine_in, self.back2d, self.back2d_in_so, self.back2d_so)
            return self.back2d
        self.back_splits.copy_(self.recv_so[0])
        self._symm.all_to_all_vdev(self.combine_in, self.back, self.back_splits, self.back_so)
        return self.back

    def _gather_back(self, back: torch.Tensor, lay: _Handle) -> torch.Tensor:
        """Each token's returned rows side by side: [T * world] rows (expert-major: [T * topk]), a
        (token, rank) pair that sent nothing reading the zero row; as 8-byte words."""
        index = lay.layout.pair_back if self.expert_major else lay.layout.back_row
        dense = self.dense[: index.numel()]
        a, b = _words(back.view(torch.uint8), dense.view(torch.uint8))
        torch.index_select(a, 0, index, out=b)
        return dense

    def _copy_weights(self, lay: _Handle) -> torch.Tensor:
        """[T, 1, n] bf16: rank-major w(t, d), each token's weights summed per destination rank;
        expert-major each pair's weight."""
        s = self.s
        if self.expert_major:
            w = lay.topk_weights
        else:
            w = copy_weights(lay.topk_idx, lay.topk_weights, s.experts_per_rank, s.world)
        return w.to(torch.bfloat16).unsqueeze(1)

    def _weighted_sum(self, w: torch.Tensor, dense: torch.Tensor) -> torch.Tensor:
        """out[t] = sum over n of w[t, n] y[t, n]: one batched [1, n] x [n, H] product per token,
        fp32 accumulation, one bf16 rounding (w rounded to bf16 first: two roundings, the contract's)."""
        t, n = w.shape[0], w.shape[2]
        out_rows = self.out[:t]
        per_token = dense.view(t, n, -1)[:, :, : self.s.hidden]
        torch.bmm(w, per_token, out=out_rows.unsqueeze(1))
        return out_rows

    def poison(self) -> None:
        self.recv.fill_(0xFF)
        if self.expert_major:
            self.recv2d.fill_(0xFF)
            self.back2d.fill_(float("nan"))
        else:
            self.back[: self.zero_row].fill_(float("nan"))  # the zero row is a constant, not an output
        self.out.fill_(float("nan"))

    def close(self) -> None:
        self._symm.barrier()  # no rank frees a buffer a peer may still read
        for name in ("send", "recv", "combine_in", "back", "send2d", "recv2d", "back2d"):
            if hasattr(self, name):
                delattr(self, name)
