"""The reference backend: dispatch/combine in plain PyTorch over torch.distributed.

On GPUs with NCCL this is the NCCL all-to-all baseline every other backend is compared with;
on CPUs it runs over gloo. It is timed as a user would call it: the layout (which token goes
where), the exchange of counts, a host synchronisation to learn the split sizes, the gathers
and the ``all_to_all_single`` calls with uneven splits. Output buffers are allocated once.

mxfp8 / ``quantize: fused``: the rows are cast by the torch reference quantizer inside the timed
dispatch, on the sender (the link carries quantized rows). ``layout: expert_major``: after the
exchange the received rows are gathered (index_select) into per-expert segments padded to
``align`` rows; combine weighs and sums each token's expert outputs per received row straight
from the segments, sends one bf16 row per (token, rank) back and the source adds them.

Call modes (rows' ``call_mode``): ``call`` is the above; ``kernel`` is NCCL with the splits known:
the copies and splits of each input set are found once, outside the timed region (counts
exchanged, host wait), and the timed dispatch is the packing, the gather and one uneven
``all_to_all_single``; combine is the same in both.

Low-latency mode: the same user-level path, one row per (token, expert) pair. The source
sorts its pairs by expert (which groups them by destination rank), sends them with one uneven
``all_to_all_single`` after a count exchange and a host synchronisation, and the receiver
scatters them into the per-expert padded buffer (base.ll_slots gives every row's place).
Combine sends the expert outputs back in the same order and the source reduces them in fp32.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional

import torch
import torch.distributed as dist

from epbench.backends.base import KernelLayouts, LowLatencyMode, NormalMode
from epbench.contract import DispatchInput, DispatchOutput, LowLatencyOutput, RankSetup, ll_slots
from epbench.inputs import quantize
from epbench.layout import SlotMap, expert_major, local_expert_counts, slot_capacity
from epbench.metrics import row_bytes
from epbench.routing import copy_weights, dest_mask


@dataclass
class _Split:
    """Which token goes where, and how many rows each rank sends and receives."""

    send_splits: List[int]
    recv_splits: List[int]
    token_of_copy: torch.Tensor  # [copies sent] source token index, ordered by (dest, token)
    dest_of_copy: torch.Tensor  # [copies sent] destination rank
    dense_row: torch.Tensor  # [copies sent] token * world + dest: the copy's row in combine's [T, world, H]


@dataclass
class _Layout:
    split: _Split
    topk_idx: torch.Tensor
    topk_weights: torch.Tensor
    num_recv: int
    slots: Optional[SlotMap] = None  # expert_major: where each (received row, expert) pair went


@dataclass
class _LowLatencyLayout:
    send_splits: List[int]
    recv_splits: List[int]
    order: torch.Tensor  # [pairs] pair index (t * topk + k) of each sent row, by (expert, token)
    dest_slot: torch.Tensor  # [rows received] flat index into [E * C] of each received row
    topk_weights: torch.Tensor
    num_tokens: int


def _words(col: torch.Tensor) -> torch.Tensor:
    """A byte-column slice of packed rows viewed as the widest integers its offset and width
    allow: a byte-typed gather moves one byte per element."""
    for dtype, size in ((torch.int64, 8), (torch.int32, 4), (torch.int16, 2)):
        if col.storage_offset() % size == 0 and col.shape[1] % size == 0:
            return col.view(dtype)
    return col


def typed_payload(dtype: str, scales: torch.Tensor, x: torch.Tensor):
    """Byte columns of packed rows as the dispatch dtype's (scales, x) tensors (bf16: no scales)."""
    if dtype == "bf16":
        return None, x.view(torch.bfloat16)
    return scales.view(torch.float32 if dtype == "fp8" else torch.uint8), x.view(torch.float8_e4m3fn)


class ReferenceBackend(KernelLayouts, NormalMode, LowLatencyMode):
    name = "reference"
    uses_sms = False
    modes = ("normal", "low_latency")
    dtypes = ("bf16", "fp8", "mxfp8")
    quantize_modes = ("before", "fused")
    layouts = ("rank_major", "expert_major")
    call_modes = ("call", "kernel")
    # dispatch and combine (normal mode) as named steps, one method each, in the order they run: a
    # caller may wrap the methods to time each step (tools/fidelity_phases.py). A step that the
    # call mode or layout does not take is not called (layout: call mode only; quantize: fused;
    # permute and reduce: expert_major).
    PHASES = {
        "dispatch": (("layout", "_split"), ("quantize", "_quantize"), ("pack", "_pack"), ("gather", "_gather"),
                     ("all_to_all", "_exchange"), ("counts", "_counts"), ("permute", "_permute")),
        "combine": (("reduce", "_reduce_local"), ("all_to_all", "_send_back"), ("scatter", "_scatter"),
                    ("weights", "_copy_weights"), ("weighted_sum", "_weighted_sum")),
    }

    @classmethod
    def unavailable_reason(cls, setup: RankSetup) -> Optional[str]:
        """GPU tensors need NCCL; where ranks share a GPU the process group is gloo (NCCL refuses
        two ranks on one device), and a gloo all-to-all of GPU tensors would measure host
        staging, not the NCCL baseline."""
        if (setup.device.type == "cuda" and dist.is_available() and dist.is_initialized()
                and dist.get_backend() != "nccl"):
            return (f"the NCCL baseline needs one GPU per rank (this run's process group is "
                    f"{dist.get_backend()}: ranks share a GPU)")
        return None

    def __init__(self, setup: RankSetup) -> None:
        self.s = setup
        self._layouts: Dict[int, _Split] = {}  # id of a prepared input -> its splits (kernel mode)
        if setup.mode == "low_latency":
            self.call_modes = ("call",)  # the per-pair path has no cached form
            self._init_low_latency(setup)
            return
        cap = setup.world * setup.max_tokens_per_rank
        h, k = setup.hidden, setup.topk
        # One packed row per token copy, so that one all_to_all moves everything:
        # [expert ids int64 x k | weights f32 x k | scales (fp8: f32, mxfp8: E8M0 bytes) | payload | pad]
        self.meta_bytes = 12 * k
        self.x_bytes = 2 * h if setup.dispatch_dtype == "bf16" else h
        self.scale_bytes = row_bytes(setup.dispatch_dtype, h) - self.x_bytes
        used = self.meta_bytes + self.scale_bytes + self.x_bytes
        self.row = (used + 15) // 16 * 16  # keeps every field's view aligned
        dev = setup.device
        self.send = torch.zeros(setup.max_tokens_per_rank, self.row, dtype=torch.uint8, device=dev)
        self.send_rows = torch.empty(cap, self.row, dtype=torch.uint8, device=dev)
        self.recv = torch.empty(cap, self.row, dtype=torch.uint8, device=dev)
        self.combine_back = torch.empty(cap, 2 * h, dtype=torch.uint8, device=dev)
        # combine's returned copies by (token, source rank), zero where a token sent none
        self.dense = torch.empty(setup.max_tokens_per_rank * setup.world, h, dtype=torch.bfloat16, device=dev)
        self.out = torch.empty(setup.max_tokens_per_rank, h, dtype=torch.bfloat16, device=dev)
        self.recv_counts = torch.empty(setup.world, dtype=torch.int64, device=dev)
        self.expert_major = setup.layout == "expert_major"
        if self.expert_major:  # received rows permuted into per-expert segments (epbench/layout.py)
            slots = slot_capacity(setup.world, setup.max_tokens_per_rank, k, setup.experts_per_rank,
                                  setup.align)
            self.em_x = torch.empty(slots, self.x_bytes, dtype=torch.uint8, device=dev)
            self.em_scales = torch.empty(slots, self.scale_bytes, dtype=torch.uint8, device=dev)
            self.em_stage = torch.empty(slots, self.x_bytes, dtype=torch.uint8, device=dev)
            self.recv_acc = torch.empty(cap, h, dtype=torch.float32, device=dev)
            self.recv_back = torch.empty(cap, h, dtype=torch.bfloat16, device=dev)
            self.combine_in = torch.empty(slots, h, dtype=torch.bfloat16, device=dev)
        else:
            self.combine_in = torch.empty(cap, h, dtype=torch.bfloat16, device=dev)

    def _typed(self, scales: torch.Tensor, x: torch.Tensor):
        return typed_payload(self.s.dispatch_dtype, scales, x)

    def _fields(self, rows: torch.Tensor):
        """Typed views (ids, weights, scales, x) of packed rows."""
        k = self.s.topk
        m, sc = self.meta_bytes, self.scale_bytes
        ids = rows[:, : 8 * k].view(torch.int64)
        weights = rows[:, 8 * k: m].view(torch.float32)
        return (ids, weights) + self._typed(rows[:, m: m + sc], rows[:, m + sc: m + sc + self.x_bytes])

    def _quantize(self, inp: DispatchInput) -> DispatchInput:
        """quantize: fused on the reference is the separate torch cast, inside the timed call,
        on the sender: the link carries the quantized rows, as with a fused kernel."""
        return DispatchInput(*quantize(inp.x, self.s.dispatch_dtype), inp.topk_idx, inp.topk_weights)

    def prepare_input(self, inp: DispatchInput, num_sms: int) -> DispatchInput:
        """Kernel mode: this input set's copies and splits, counts exchanged once, untimed."""
        if self.kernel:
            self._layouts[id(inp)] = self._split(inp)
        return inp

    def _split(self, inp: DispatchInput) -> "_Split":
        """Which token goes where: the copies by (destination, token), and the send / receive
        splits, for which the ranks exchange their counts and the host waits for them."""
        s = self.s
        mask = dest_mask(inp.topk_idx, s.experts_per_rank, s.world)
        send_counts = mask.sum(dim=0)
        dist.all_to_all_single(self.recv_counts, send_counts)
        counts = torch.cat([send_counts, self.recv_counts]).tolist()  # the one host wait
        send, recv = counts[: s.world], counts[s.world:]
        # the copies sorted by (dest, token); their number is known now, so no second wait
        dest_of_copy, token_of_copy = torch.nonzero_static(mask.t(), size=sum(send)).unbind(1)
        return _Split(send, recv, token_of_copy, dest_of_copy, token_of_copy * s.world + dest_of_copy)

    def dispatch(self, inp: DispatchInput, num_sms: int) -> DispatchOutput:
        # kernel mode: the splits of this input set are known (NCCL with splits known, as an
        # all-to-all token dispatcher with a fixed routing has them); call mode: found here, the
        # host synchronisation every user pays included
        split = self._layouts[id(inp)] if self.kernel else self._split(inp)
        if self.s.quantize == "fused":
            inp = self._quantize(inp)
        rows = self._gather(self._pack(inp), split)
        recv = self._exchange(rows, split)
        ids, weights, scales, x = self._fields(recv)
        layout = _Layout(split, inp.topk_idx, inp.topk_weights, recv.shape[0])
        if self.expert_major:  # its segment table holds the per-expert counts
            return self._permute(recv, ids, weights, layout)
        return DispatchOutput(x, scales, ids, weights, self._counts(ids), layout.num_recv, layout)

    def _pack(self, inp: DispatchInput) -> torch.Tensor:
        """One packed row per token: its ids, weights, scales and payload copied in."""
        packed = self.send[: inp.num_tokens]
        ids, weights, scales, x = self._fields(packed)
        ids.copy_(inp.topk_idx)
        weights.copy_(inp.topk_weights)
        if scales is not None:
            scales.copy_(inp.x_scales)
        x.copy_(inp.x)
        return packed

    def _gather(self, packed: torch.Tensor, split: _Split) -> torch.Tensor:
        """One row per (token, destination), by destination: whole rows gathered as 8-byte words
        (a byte-typed gather moves one byte per element)."""
        rows = self.send_rows[: split.token_of_copy.numel()]
        torch.index_select(packed.view(torch.int64), 0, split.token_of_copy, out=rows.view(torch.int64))
        return rows

    def _exchange(self, rows: torch.Tensor, split: _Split) -> torch.Tensor:
        recv = self.recv[: sum(split.recv_splits)]
        dist.all_to_all_single(recv, rows, split.recv_splits, split.send_splits)
        return recv

    def _counts(self, ids: torch.Tensor) -> torch.Tensor:
        """Received rows per local expert, on the device (no host read: epbench/layout.py)."""
        return local_expert_counts(ids, self.s.rank, self.s.experts_per_rank)

    def _permute(self, recv: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                 layout: "_Layout") -> DispatchOutput:
        """Rank-major received rows -> expert segments: one gather per field (index_select),
        plus a scatter to the padded slots where align > 1."""
        s = self.s
        table, slots = expert_major(ids, s.rank, s.experts_per_rank, s.align)
        m, sc = self.meta_bytes, self.scale_bytes
        pairs = slots.row.numel()
        for col, buf in ((recv[:, m + sc: m + sc + self.x_bytes], self.em_x),
                         (recv[:, m: m + sc], self.em_scales)):
            if not col.shape[1]:
                continue
            src = _words(col)
            dst = buf.view(src.dtype)
            if s.align == 1:  # slots are 0 .. pairs - 1 in order
                torch.index_select(src, 0, slots.row, out=dst[:pairs])
            else:
                stage = self.em_stage.view(-1)[: pairs * col.shape[1]].view(src.dtype).view(pairs, -1)
                torch.index_select(src, 0, slots.row, out=stage)
                dst.index_copy_(0, slots.slot, stage)
        scales, x = self._typed(self.em_scales, self.em_x)
        layout.slots = slots
        return DispatchOutput(x, scales, ids, weights, table.counts, layout.num_recv, layout, table)

    def combine_input(self, out: DispatchOutput) -> torch.Tensor:
        if self.expert_major:
            return self.combine_in[: int(out.expert_major.num_slots)]
        return self.combine_in[: out.handle.num_recv]

    def _reduce_local(self, out: DispatchOutput) -> torch.Tensor:
        """Expert-major combine, receiver side: each valid slot's expert output times the token's
        weight for that expert, summed per received row in fp32 straight from the segments,
        rounded once to bf16 for the way back."""
        lay, sl = out.handle, out.handle.slots
        w = out.topk_weights[sl.row, sl.k]
        acc = self.recv_acc[: lay.num_recv].zero_()
        acc.index_add_(0, sl.row, self.combine_in.index_select(0, sl.slot).float().mul_(w.unsqueeze(1)))
        back = self.recv_back[: lay.num_recv]
        back.copy_(acc)
        return back

    def combine(self, out: DispatchOutput, num_sms: int) -> torch.Tensor:
        """The copies come back into a dense [T, world, H] (zero where a token sent no copy), then
        one batched [1, world] x [world, H] product per token: out[t] = sum_d w(t, d) y_d(t), the
        products and their sum in fp32, one bf16 rounding at the end; w(t, d) is rounded to bf16
        (<= 2^-8 relative per term): two roundings, as the contract allows. Expert-major: the
        weights were applied per expert on the receiver, so a plain sum over ranks. Two passes over the
        copies (scatter, product) instead of an fp32 copy of them weighted in place and atomically
        added (that form took 1945 us beside 889 us for dispatch on 4 x H200, DeepSeek-V3 shape,
        2026-11-26)."""
        lay = out.handle
        t = lay.topk_idx.shape[0]
        y = self._reduce_local(out) if self.expert_major else self.combine_in[: lay.num_recv]
        sent = self._send_back(y, lay.split)
        dense = self._scatter(sent, lay.split, t)
        return self._weighted_sum(self._copy_weights(lay), dense)

    def _send_back(self, y: torch.Tensor, split: _Split) -> torch.Tensor:
        sent = self.combine_back[: split.token_of_copy.numel()]
        dist.all_to_all_single(sent, y.view(torch.uint8), split.send_splits, split.recv_splits)
        return sent

    def _scatter(self, sent: torch.Tensor, split: _Split, t: int) -> torch.Tensor:
        dense = self.dense[: t * self.s.world].zero_()
        dense.index_copy_(0, split.dense_row, sent.view(torch.bfloat16))
        return dense

    def _copy_weights(self, lay: _Layout) -> Optional[torch.Tensor]:
        """[T, 1, world] bf16: w(t, d), each token's weights summed per destination rank; None in
        expert-major, whose receivers applied the weights."""
        if self.expert_major:
            return None
        s = self.s
        w = copy_weights(lay.topk_idx, lay.topk_weights, s.experts_per_rank, s.world)
        return w.to(torch.bfloat16).unsqueeze(1)

    def _weighted_sum(self, w: Optional[torch.Tensor], dense: torch.Tensor) -> torch.Tensor:
        t = dense.shape[0] // self.s.world
        out_rows = self.out[:t]
        per_token = dense.view(t, self.s.world, self.s.hidden)
        if w is None:  # a plain sum over the ranks (fp32 accumulation, one rounding)
            torch.sum(per_token, dim=1, out=out_rows)
        else:
            torch.bmm(w, per_token, out=out_rows.unsqueeze(1))
        return out_rows

    # ---- low-latency mode ----
    def _init_low_latency(self, setup: RankSetup) -> None:
        e, w, tm, h = setup.experts_per_rank, setup.world, setup.max_tokens_per_rank, setup.hidden
        cap, pairs = w * tm, setup.max_tokens_per_rank * setup.topk
        # Packed pair row: [pair id int32 | pad to 16 bytes | fp8 scales (fp8 only) | payload | pad]
        self.meta_bytes = 16
        self.x_bytes = h if setup.dispatch_dtype == "fp8" else 2 * h
        self.scale_bytes = row_bytes(setup.dispatch_dtype, h) - self.x_bytes
        self.row = (self.meta_bytes + self.scale_bytes + self.x_bytes + 15) // 16 * 16
        dev = setup.device
        self.ll_tokens = torch.zeros(tm, self.row, dtype=torch.uint8, device=dev)
        self.ll_send = torch.empty(pairs, self.row, dtype=torch.uint8, device=dev)
        self.ll_recv = torch.empty(w * pairs, self.row, dtype=torch.uint8, device=dev)  # all sources, worst case
        x_dtype = torch.float8_e4m3fn if setup.dispatch_dtype == "fp8" else torch.bfloat16
        self.ll_x = torch.empty(e, cap, h, dtype=x_dtype, device=dev)
        self.ll_scales = (torch.empty(e, cap, h // 128, dtype=torch.float32, device=dev)
                          if self.scale_bytes else None)
        self.ll_pair = torch.empty(e, cap, dtype=torch.int32, device=dev)
        self.ll_recv_counts = torch.empty(w, e, dtype=torch.int64, device=dev)
        self.ll_y = torch.empty(e, cap, h, dtype=torch.bfloat16, device=dev)
        self.ll_y_send = torch.empty(w * pairs, h, dtype=torch.bfloat16, device=dev)
        self.ll_y_back = torch.empty(pairs, h, dtype=torch.bfloat16, device=dev)
        self.ll_acc = torch.empty(tm, h, dtype=torch.float32, device=dev)
        self.ll_out = torch.empty(tm, h, dtype=torch.bfloat16, device=dev)

    def _ll_fields(self, rows: torch.Tensor):
        """Typed views (pair id, scales, x) of packed low-latency rows."""
        m, sc = self.meta_bytes, self.scale_bytes
        pair = rows[:, :4].view(torch.int32).view(-1)
        scales = rows[:, m: m + sc].view(torch.float32) if sc else None
        x = rows[:, m + sc: m + sc + self.x_bytes]
        x = x.view(torch.float8_e4m3fn) if self.s.dispatch_dtype == "fp8" else x.view(torch.bfloat16)
        return pair, scales, x

    def ll_dispatch(self, inp: DispatchInput, num_sms: int) -> LowLatencyOutput:
        s = self.s
        e, w, tm, k = s.experts_per_rank, s.world, s.max_tokens_per_rank, s.topk
        t = inp.num_tokens
        _, per_expert = ll_slots(inp.topk_idx, s.num_experts)
        counts = torch.empty_like(self.ll_recv_counts)
        dist.all_to_all_single(counts, per_expert.view(w, e))
        self.ll_recv_counts.copy_(counts)  # [source, local expert]
        send_splits = per_expert.view(w, e).sum(dim=1).tolist()
        recv_splits = counts.sum(dim=1).tolist()  # the host synchronisation every user pays
        n_recv = sum(recv_splits)
        packed = self.ll_tokens[:t]
        _, scales, x = self._ll_fields(packed)
        if scales is not None:
            scales.copy_(inp.x_scales)
        x.copy_(inp.x)
        flat_e = inp.topk_idx.flatten()
        order = torch.argsort(flat_e, stable=True)  # by expert, so by destination rank
        rows = self.ll_send[: order.numel()]
        torch.index_select(packed.view(torch.int64), 0, order // k, out=rows.view(torch.int64))
        self._ll_fields(rows)[0].copy_(order.to(torch.int32))
        recv = self.ll_recv[:n_recv]
        dist.all_to_all_single(recv, rows, recv_splits, send_splits)
        # Received rows come by (source, local expert, j): their place in [E, C] follows from the counts.
        sizes = counts.flatten()
        src, le = torch.meshgrid(torch.arange(w, device=sizes.device), torch.arange(e, device=sizes.device),
                                 indexing="ij")
        group_base = (le * (w * tm) + src * tm).flatten()
        group_start = torch.cumsum(sizes, 0) - sizes
        dest_slot = (torch.repeat_interleave(group_base - group_start, sizes, output_size=n_recv)
                     + torch.arange(n_recv, device=sizes.device))
        # Moved as 4-byte words (every field is a multiple of 4 bytes): fp8 has no index_copy.
        words = recv.view(torch.int32)
        m, sc = self.meta_bytes // 4, self.scale_bytes // 4
        self.ll_pair.view(-1).index_copy_(0, dest_slot, words[:, 0])
        if sc:
            self.ll_scales.view(-1, sc).index_copy_(0, dest_slot, words[:, m: m + sc].view(torch.float32))
        self.ll_x.view(-1, s.hidden).view(torch.int32).index_copy_(0, dest_slot, words[:, m + sc: m + sc + self.x_bytes // 4])
        src_counts = self.ll_recv_counts.t()
        layout = _LowLatencyLayout(send_splits, recv_splits, order, dest_slot, inp.topk_weights, t)
        return LowLatencyOutput(self.ll_x, self.ll_scales, src_counts.sum(dim=1), src_counts, self.ll_pair,
                                tm, layout)

    def ll_combine_input(self, out: LowLatencyOutput) -> torch.Tensor:
        return self.ll_y

    def ll_combine(self, out: LowLatencyOutput, num_sms: int) -> torch.Tensor:
        lay: _LowLatencyLayout = out.handle
        h, t = self.s.hidden, lay.num_tokens
        n_recv = lay.dest_slot.numel()
        y = self.ll_y_send[:n_recv]
        torch.index_select(self.ll_y.view(-1, h), 0, lay.dest_slot, out=y)
        back = self.ll_y_back[: lay.order.numel()]
        dist.all_to_all_single(back.view(torch.uint8), y.view(torch.uint8), lay.send_splits, lay.recv_splits)
        w_sent = lay.topk_weights.flatten()[lay.order]
        acc = self.ll_acc[:t].zero_()
        acc.index_add_(0, lay.order // self.s.topk, back.float().mul_(w_sent.unsqueeze(1)))
        out_rows = self.ll_out[:t]
        out_rows.copy_(acc)
        return out_rows

    def poison(self) -> None:
        if self.s.mode == "low_latency":
            self.ll_x.view(torch.uint8).fill_(0xFF)
            if self.ll_scales is not None:
                self.ll_scales.fill_(float("nan"))
            self.ll_pair.fill_(-1)
            self.ll_y_back.fill_(float("nan"))
            self.ll_out.fill_(float("nan"))
            return
        self.recv.fill_(0xFF)
        if self.expert_major:
            self.em_x.fill_(0xFF)
            self.em_scales.fill_(0xFF)
            self.recv_acc.fill_(float("nan"))
            self.recv_back.fill_(float("nan"))
        self.combine_back.fill_(0xFF)
        self.dense.fill_(float("nan"))
        self.out.fill_(float("nan"))
