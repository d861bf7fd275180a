"""The reference backend: dispatch/combine in plain PyTorch over torch.distributed.

On GPUs with NCCL this is the NCCL all-to-all baseline every other backend is compared with;
on CPUs it runs over gloo. It is timed as a user would call it: the layout (which token goes
where), the exchange of counts, a host synchronisation to learn the split sizes, the gathers
and the ``all_to_all_single`` calls with uneven splits. Output buffers are allocated once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

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
        self.payload_bytes = row_bytes(setup.dispatch_dtype, h)
        self.meta_bytes = k * 12  # int64 expert id + float32 weight per slot
        dev = setup.device
        self.recv_payload = torch.empty(cap, self.payload_bytes, dtype=torch.uint8, device=dev)
        self.recv_meta = torch.empty(cap, self.meta_bytes, dtype=torch.uint8, device=dev)
        self.combine_in = torch.empty(cap, h, dtype=torch.bfloat16, device=dev)
        self.combine_back = torch.empty(cap, 2 * h, dtype=torch.uint8, device=dev)
        self.acc = torch.empty(setup.max_tokens_per_rank, h, dtype=torch.float32, device=dev)
        self.out = torch.empty(setup.max_tokens_per_rank, h, dtype=torch.bfloat16, device=dev)
        self.recv_counts = torch.empty(setup.world, dtype=torch.int64, device=dev)

    def _payload(self, inp: DispatchInput) -> torch.Tensor:
        x = inp.x.view(torch.uint8)
        if inp.x_scales is None:
            return x
        return torch.cat([x, inp.x_scales.contiguous().view(torch.uint8)], dim=1)

    def dispatch(self, inp: DispatchInput, num_sms: int) -> DispatchOutput:
        s = self.s
        mask = dest_mask(inp.topk_idx, s.experts_per_rank, s.world)
        dest_of_copy, token_of_copy = mask.t().nonzero(as_tuple=True)  # sorted by (dest, token)
        send_counts = mask.sum(dim=0)
        dist.all_to_all_single(self.recv_counts, send_counts)
        send_splits = send_counts.tolist()
        recv_splits = self.recv_counts.tolist()  # the host synchronisation every user pays
        n = sum(recv_splits)
        payload = self._payload(inp).index_select(0, token_of_copy)
        meta = torch.cat([inp.topk_idx.view(torch.uint8).view(-1, 8 * s.topk),
                          inp.topk_weights.view(torch.uint8).view(-1, 4 * s.topk)], dim=1)
        meta = meta.index_select(0, token_of_copy)
        recv_payload, recv_meta = self.recv_payload[:n], self.recv_meta[:n]
        dist.all_to_all_single(recv_payload, payload, recv_splits, send_splits)
        dist.all_to_all_single(recv_meta, meta, recv_splits, send_splits)
        h, k = s.hidden, s.topk
        if s.dispatch_dtype == "fp8":
            x = recv_payload[:, :h].view(torch.float8_e4m3fn)
            scales: Optional[torch.Tensor] = recv_payload[:, h:].view(torch.float32)
        else:
            x, scales = recv_payload.view(torch.bfloat16), None
        topk_idx = recv_meta[:, :8 * k].view(torch.int64)
        topk_weights = recv_meta[:, 8 * k:].view(torch.float32)
        local = topk_idx - s.rank * s.experts_per_rank
        hit = (local >= 0) & (local < s.experts_per_rank)
        counts = torch.bincount(local[hit], minlength=s.experts_per_rank)
        layout = _Layout(send_splits, recv_splits, token_of_copy, dest_of_copy,
                         inp.topk_idx, inp.topk_weights, n)
        return DispatchOutput(x, scales, topk_idx, topk_weights, counts, n, layout)

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
        acc.index_add_(0, lay.token_of_copy, sent.view(torch.bfloat16).float() * w_copy.unsqueeze(1))
        out_rows = self.out[:t]
        out_rows.copy_(acc)
        return out_rows

    def poison(self) -> None:
        self.recv_payload.fill_(0xFF)
        self.recv_meta.fill_(0xFF)
        self.combine_back.fill_(0xFF)
        self.out.fill_(float("nan"))
