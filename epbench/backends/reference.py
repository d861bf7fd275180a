"""The reference backend: dispatch/combine in plain PyTorch over torch.distributed.

On GPUs with NCCL this is the NCCL all-to-all baseline every other backend is compared with;
on CPUs it runs over gloo. It is timed as a user would call it: the layout (which token goes
where), the exchange of counts, a host synchronisation to learn the split sizes, the gathers
and the ``all_to_all_single`` calls with uneven splits. Output buffers are allocated once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List

import torch
import torch.distributed as dist

from epbench.backends.base import Backend, DispatchInput, DispatchOutput, RankSetup
from epbench.metrics import row_bytes
from epbench.routing import copy_weights, dest_mask


@dataclass
class _Layout:
    send_splits: List[int]
    recv_splits: List[int]
    token_of_copy: torch.Tensor  # [copies sent] source token index, ordered by (dest, token)
    dest_of_copy: torch.Tensor  # [copies sent] destination rank
    topk_idx: torch.Tensor
    topk_weights: torch.Tensor
    num_recv: int


class ReferenceBackend(Backend):
    name = "reference"
    uses_sms = False

    def __init__(self, setup: RankSetup) -> None:
        self.s = setup
        cap = setup.world * setup.max_tokens_per_rank
        h, k = setup.hidden, setup.topk
        # One packed row per token copy, so that one all_to_all moves everything:
        # [expert ids int64 x k | weights f32 x k | fp8 scales f32 (fp8 only) | payload | pad]
        self.meta_bytes = 12 * k
        self.x_bytes = h if setup.dispatch_dtype == "fp8" else 2 * h
        self.scale_bytes = row_bytes(setup.dispatch_dtype, h) - self.x_bytes
        used = self.meta_bytes + self.scale_bytes + self.x_bytes
        self.row = (used + 15) // 16 * 16  # keeps every field's view aligned
        dev = setup.device
        self.send = torch.zeros(setup.max_tokens_per_rank, self.row, dtype=torch.uint8, device=dev)
        self.send_rows = torch.empty(cap, self.row, dtype=torch.uint8, device=dev)
        self.recv = torch.empty(cap, self.row, dtype=torch.uint8, device=dev)
        self.combine_in = torch.empty(cap, h, dtype=torch.bfloat16, device=dev)
        self.combine_back = torch.empty(cap, 2 * h, dtype=torch.uint8, device=dev)
        self.acc = torch.empty(setup.max_tokens_per_rank, h, dtype=torch.float32, device=dev)
        self.out = torch.empty(setup.max_tokens_per_rank, h, dtype=torch.bfloat16, device=dev)
        self.recv_counts = torch.empty(setup.world, dtype=torch.int64, device=dev)

    def _fields(self, rows: torch.Tensor):
        """Typed views (ids, weights, scales, x) of packed rows."""
        k = self.s.topk
        m, sc = self.meta_bytes, self.scale_bytes
        ids = rows[:, : 8 * k].view(torch.int64)
        weights = rows[:, 8 * k: m].view(torch.float32)
        scales = rows[:, m: m + sc].view(torch.float32) if sc else None
        x = rows[:, m + sc: m + sc + self.x_bytes]
        x = x.view(torch.float8_e4m3fn) if self.s.dispatch_dtype == "fp8" else x.view(torch.bfloat16)
        return ids, weights, scales, x

    def dispatch(self, inp: DispatchInput, num_sms: int) -> DispatchOutput:
        s = self.s
        t = inp.num_tokens
        mask = dest_mask(inp.topk_idx, s.experts_per_rank, s.world)
        dest_of_copy, token_of_copy = mask.t().nonzero(as_tuple=True)  # sorted by (dest, token)
        send_counts = mask.sum(dim=0)
        dist.all_to_all_single(self.recv_counts, send_counts)
        send_splits = send_counts.tolist()
        recv_splits = self.recv_counts.tolist()  # the host synchronisation every user pays
        n = sum(recv_splits)
        packed = self.send[:t]
        ids, weights, scales, x = self._fields(packed)
        ids.copy_(inp.topk_idx)
        weights.copy_(inp.topk_weights)
        if scales is not None:
            scales.copy_(inp.x_scales)
        x.copy_(inp.x)
        rows = self.send_rows[: token_of_copy.numel()]
        # Gather whole rows as 8-byte words: a byte-typed gather moves one byte per element.
        torch.index_select(packed.view(torch.int64), 0, token_of_copy, out=rows.view(torch.int64))
        recv = self.recv[:n]
        dist.all_to_all_single(recv, rows, recv_splits, send_splits)
        ids, weights, scales, x = self._fields(recv)
        local = ids - s.rank * s.experts_per_rank
        hit = (local >= 0) & (local < s.experts_per_rank)
        other = s.experts_per_rank  # one extra bin for experts of other ranks (no boolean gather)
        counts = torch.bincount(torch.where(hit, local, other).flatten(), minlength=other + 1)[:other]
        layout = _Layout(send_splits, recv_splits, token_of_copy, dest_of_copy,
                         inp.topk_idx, inp.topk_weights, n)
        return DispatchOutput(x, scales, ids, weights, counts, n, layout)

    def combine_input(self, out: DispatchOutput) -> torch.Tensor:
        return self.combine_in[: out.handle.num_recv]

    def combine(self, out: DispatchOutput, num_sms: int) -> torch.Tensor:
        s, lay = self.s, out.handle
        t = lay.topk_idx.shape[0]
        sent = self.combine_back[: lay.token_of_copy.numel()]
        y = self.combine_in[: lay.num_recv].view(torch.uint8)
        dist.all_to_all_single(sent, y, lay.send_splits, lay.recv_splits)
        w = copy_weights(lay.topk_idx, lay.topk_weights, s.experts_per_rank, s.world)
        w_copy = w[lay.token_of_copy, lay.dest_of_copy]
        acc = self.acc[:t].zero_()
        acc.index_add_(0, lay.token_of_copy, sent.view(torch.bfloat16).float().mul_(w_copy.unsqueeze(1)))
        out_rows = self.out[:t]
        out_rows.copy_(acc)
        return out_rows

    def poison(self) -> None:
        self.recv.fill_(0xFF)
        self.combine_back.fill_(0xFF)
        self.out.fill_(float("nan"))
