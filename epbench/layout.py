"""Expert-major receive layout: what a grouped GEMM consumes.

A receiving rank holds, for each of its local experts ``e = 0 .. E-1`` in order, one segment of
rows: the tokens routed to that expert, by source rank, then token index (the rank-major order
filtered to the expert). Segment ``e`` starts at ``offsets[e]`` and holds ``counts[e]`` rows,
followed by padding up to a multiple of ``align`` rows; offsets are multiples of ``align``.
Padding rows are not written (their content is unspecified) and no one reads them back.

A token that picks several experts of one rank crosses the link once (one row per (token,
destination rank), as in the rank-major layout); the receiver makes the further copies
locally. Combine reads each expert's output rows straight from this layout, weighs them by
the token's weight for that expert and reduces them into one row per (token, rank) that goes
back: no separate unpermute pass.

Low-latency mode is already per expert (each expert's buffer padded to T_max rows per source
rank, one row per (token, expert) pair on the link): this layout is the normal-mode,
dense counterpart, with the link still carrying one row per (token, rank).

Own rows first (the epbench backend's ``own_rows=ce``, rank-major only): a receiving rank's
buffer starts with its own ``T`` tokens by index (row ``t`` = token ``t``, copied there by the
copy engine whether or not the token is routed to the rank; a row whose token is not is
padding), then every other source's rows, packed, in rank order. ``row_key`` (see
epbench/contract.py ``DispatchOutput``) tells them apart: ``source << KEY_SHIFT | token``,
-1 for padding. ``own_first_offsets`` and ``own_first_keys`` are the arithmetic the notify
kernel does (csrc/notify.cu), for tests to compare with.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence, Tuple, Union

import torch

@dataclass
class ExpertMajor:
    """The segment table of one receiving rank (tensors on the receiver's device)."""

    counts: torch.Tensor  # [E] int64: valid rows per local expert
    offsets: torch.Tensor  # [E] int64: first slot of each expert's segment
    num_slots: Union[int, torch.Tensor]  # slots in use, padding of the last segment included
    align: int


def round_up(n: torch.Tensor, align: int) -> torch.Tensor:
    return (n + align - 1) // align * align


def segment_offsets(counts: torch.Tensor, align: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """(offsets [E], total slots) of segments of ``counts`` rows each, padded to ``align``."""
    padded = round_up(counts.to(torch.int64), align)
    ends = torch.cumsum(padded, 0)
    return ends - padded, ends[-1] if ends.numel() else torch.zeros((), dtype=torch.int64)


def padding_rows(counts: torch.Tensor, align: int) -> torch.Tensor:
    """Padding rows a rank's segments need: sum of round_up(count, align) - count (int64)."""
    c = counts.to(torch.int64)
    return (round_up(c, align) - c).sum()


def slot_capacity(world: int, max_tokens_per_rank: int, topk: int, experts_per_rank: int,
                  align: int) -> int:
    """Slots a receive buffer needs at most: every source's tokens once per local expert they
    can pick (min(topk, E) each), plus the largest padding (align - 1 per expert)."""
    return world * max_tokens_per_rank * min(topk, experts_per_rank) + experts_per_rank * (align - 1)


@dataclass
class SlotMap:
    """Where each valid (received row, local expert) pair goes, in slot order."""

    row: torch.Tensor  # [pairs] int64: rank-major received row
    k: torch.Tensor  # [pairs] int64: position of the expert in that row's top-k
    slot: torch.Tensor  # [pairs] int64: slot in the expert-major buffer


# Bins that the values a histogram does not count are spread over, by their position: sent to one bin,
# every such value's atomic add went to one address and they ran one after another (the counts step
# of the reference and symm-mem dispatch took 51-111 us at 2-4 ranks, most of the values being other
# ranks' experts; notes/LATENCY-NEXT.md, "Counts without one hot bin"). By position, not by value: rows
# never written may all hold the same bytes.
SPREAD_BINS = 1024  # a power of two


def histogram_keys(values: torch.Tensor, bins: int, keep: Optional[torch.Tensor] = None) -> torch.Tensor:
    """int64 [values.numel()]: each value's bin for device_histogram: the value where counted, else
    bins + (its position mod SPREAD_BINS)."""
    v = values.flatten()
    keep = ((v >= 0) & (v < bins)) if keep is None else keep.flatten()
    spread = torch.arange(v.numel(), device=v.device) & (SPREAD_BINS - 1)
    return torch.where(keep, v, bins + spread)


def device_histogram(values: torch.Tensor, bins: int, keep: Optional[torch.Tensor] = None) -> torch.Tensor:
    """int64 [bins]: how many of ``values`` (any shape, int64) fall in each of 0 .. bins - 1, counting
    only those where ``keep`` (same shape, True only where the value is in range; default: every
    value in range). On the device with no host read (torch.bincount on a GPU reads the largest value
    back to size its bins): a scatter-add into fixed bins, the values not counted spread over
    SPREAD_BINS extra bins (histogram_keys)."""
    key = histogram_keys(values, bins, keep)
    counts = torch.zeros(bins + SPREAD_BINS, dtype=torch.int64, device=key.device)
    return counts.scatter_add_(0, key, torch.ones_like(key))[:bins]


def local_expert_counts(topk_idx: torch.Tensor, rank: int, experts_per_rank: int) -> torch.Tensor:
    """int64 [experts_per_rank]: how many of the ids ``topk_idx`` (any shape, global expert ids)
    name each of rank ``rank``'s experts; other ranks' experts are not counted. Stays on the
    device (device_histogram)."""
    return device_histogram(topk_idx - rank * experts_per_rank, experts_per_rank)


def expert_major(topk_idx: torch.Tensor, rank: int, experts_per_rank: int,
                 align: int) -> Tuple[ExpertMajor, SlotMap]:
    """The segment table and slot map for rank-major received rows with global expert ids
    ``topk_idx`` [rows, topk] (int64). Reads the pair count on the host (one synchronisation)."""
    e_loc = experts_per_rank
    rows, k = topk_idx.shape
    local = (topk_idx - rank * e_loc).flatten()
    hit = (local >= 0) & (local < e_loc)
    key = torch.where(hit, local, torch.full_like(local, e_loc))  # other ranks' experts sort last
    counts = torch.bincount(key, minlength=e_loc + 1)[:e_loc]
    offsets, total = segment_offsets(counts, align)
    pairs = int(counts.sum())
    order = torch.argsort(key, stable=True)[:pairs]  # by local expert, then row (= source, token)
    e = key[order]
    starts = torch.cumsum(counts, 0) - counts
    j = torch.arange(pairs, device=topk_idx.device) - starts[e]
    table = ExpertMajor(counts, offsets, total, align)
    return table, SlotMap(order // k, order % k, offsets[e] + j)


def expert_of_slot(table: ExpertMajor, num_slots: int) -> torch.Tensor:
    """int64 [num_slots]: the local expert whose segment (padding included) holds each slot."""
    slots = torch.arange(num_slots, device=table.offsets.device)
    return (torch.searchsorted(table.offsets, slots, right=True) - 1).clamp_(min=0)


def segment_sort(slot_key: torch.Tensor, table: ExpertMajor) -> torch.Tensor:
    """The permutation that puts each segment's slots in the order of their keys: slot i of the
    result is slot ``order[i]`` of the buffer. Keyless slots (-1: padding) go behind the keyed ones
    of their segment; no slot changes segment."""
    n = int(slot_key.shape[0])
    key = slot_key.to(torch.int64)
    key = torch.where(key < 0, torch.full_like(key, torch.iinfo(torch.int64).max), key)
    by_key = torch.argsort(key, stable=True)
    segment = expert_of_slot(table, n).to(key.device)
    return by_key[torch.argsort(segment[by_key], stable=True)]


# ---- own rows first (own_rows=ce) ----
KEY_SHIFT = 32  # row_key = source rank << KEY_SHIFT | source token (csrc recv_key); tokens stay below 2^31


def own_first_offsets(dests: Sequence[torch.Tensor], rank: int) -> torch.Tensor:
    """int64 ``[world]``: the first row of ``rank``'s tokens in each rank d's receive buffer with the own rows
    first; ``dests[s]`` is source s's ``[T_s, world]`` destination mask (epbench.routing.dest_mask). 0 on
    ``rank`` itself (its own row t is row t); elsewhere d's own ``T_d`` rows, then the rows that ranks before
    ``rank`` other than d send to d."""
    world = len(dests)
    sent = torch.stack([m.sum(dim=0).to(torch.int64).cpu() if m.numel() else torch.zeros(world, dtype=torch.int64)
                        for m in dests])  # [s, d]: rows s sends to d
    base = torch.zeros(world, dtype=torch.int64)
    for d in range(world):
        if d != rank:
            base[d] = dests[d].shape[0] + sum(int(sent[s, d]) for s in range(rank) if s != d)
    return base


def own_first_keys(dests: Sequence[torch.Tensor], rank: int) -> torch.Tensor:
    """int64 ``[num_recv]``: the row keys of ``rank``'s receive buffer with the own rows first (num_recv =
    ``T_rank`` + the rows every other source sends it): its own tokens by index (-1 where a token is not routed
    to ``rank``), then each other source's tokens routed to ``rank``, in rank and token order."""
    own = dests[rank][:, rank].cpu() if dests[rank].numel() else torch.zeros(0, dtype=torch.bool)
    t = torch.arange(own.shape[0], dtype=torch.int64)
    keys = [torch.where(own, (rank << KEY_SHIFT) | t, torch.full_like(t, -1))]
    for s, m in enumerate(dests):
        if s != rank and m.numel():
            keys.append((s << KEY_SHIFT) | m[:, rank].cpu().nonzero().flatten().to(torch.int64))
    return torch.cat(keys)


def by_source_keys(dests: Sequence[torch.Tensor], rank: int, max_tokens: int) -> torch.Tensor:
    """int64 ``[world * max_tokens]``: the row keys of ``rank``'s receive buffer under own_rows all (csrc
    notify.cu / dispatch.cu): source s's token t at row s * max_tokens + t, keyed s << KEY_SHIFT | t where t is
    routed to ``rank``, else -1 (a row copied but not routed there, or past the source's T)."""
    keys = torch.full((len(dests) * max_tokens,), -1, dtype=torch.int64)
    for s, m in enumerate(dests):
        if m.numel():
            t = m[:, rank].cpu().nonzero().flatten().to(torch.int64)
            keys[s * max_tokens + t] = (s << KEY_SHIFT) | t
    return keys
