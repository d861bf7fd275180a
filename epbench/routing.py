"""Routing: which experts each token goes to, and the traffic that follows from it.

Everything here is deterministic per (seed, rank) and computed on the CPU, so every rank can
rebuild every other rank's routing (verification and metrics need the whole picture).

Expert ``e`` lives on rank ``e // experts_per_rank``; rank ``r`` lives on node
``r // gpus_per_node``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Sequence

import torch

from epbench.scenario import Routing, Scenario

_GOLDEN = 0x9E3779B97F4A7C15


def _generator(seed: int, *salt: int) -> torch.Generator:
    h = (seed * _GOLDEN) & 0xFFFFFFFFFFFFFFFF
    for s in salt:
        h = ((h ^ (s + 0x632BE59BD9B4E019)) * _GOLDEN) & 0xFFFFFFFFFFFFFFFF
    return torch.Generator().manual_seed(h & 0x7FFFFFFFFFFFFFFF)


@dataclass(frozen=True)
class RankRouting:
    topk_idx: torch.Tensor  # [T, topk] int64 global expert ids, distinct within a row
    topk_weights: torch.Tensor  # [T, topk] float32, positive, each row sums to 1

    @property
    def num_tokens(self) -> int:
        return int(self.topk_idx.shape[0])


def expert_probabilities(routing: Routing, num_experts: int) -> torch.Tensor:
    """Probability of picking each expert in one draw (before 'without replacement')."""
    order = torch.randperm(num_experts, generator=_generator(routing.seed, 1))
    p = torch.empty(num_experts, dtype=torch.float64)
    if routing.kind == "uniform":
        p.fill_(1.0 / num_experts)
    elif routing.kind == "zipf":
        ranks = torch.arange(1, num_experts + 1, dtype=torch.float64)
        p[order] = ranks.pow(-routing.zipf_exponent)
    elif routing.kind == "hot":
        n_hot = max(1, round(routing.hot_fraction * num_experts))
        p_hot = min(routing.hot_multiplier / num_experts, 1.0 / n_hot)
        p.fill_((1.0 - n_hot * p_hot) / max(num_experts - n_hot, 1))
        p[order[:n_hot]] = p_hot
    else:  # validated earlier; kept for direct callers
        raise ValueError(f"unknown routing kind {routing.kind!r}")
    return p / p.sum()


def route_rank(routing: Routing, num_tokens: int, topk: int, num_experts: int,
               rank: int) -> RankRouting:
    """Top-k without replacement by the Gumbel-top-k trick: the k largest of
    log p_e + Gumbel noise are a draw of k distinct experts, each next pick proportional to p."""
    g = _generator(routing.seed, 2, rank)
    logp = expert_probabilities(routing, num_experts).log().float()
    u = torch.rand(num_tokens, num_experts, generator=g).clamp_(1e-12, 1.0 - 1e-7)
    keys = logp - torch.log(-torch.log(u))
    idx = keys.topk(topk, dim=1).indices.to(torch.int64)
    w = torch.rand(num_tokens, topk, generator=g) + 0.5
    return RankRouting(idx, (w / w.sum(dim=1, keepdim=True)).float())


def route_all(s: Scenario) -> List[RankRouting]:
    """Every rank's routing for the scenario (cheap: indices only)."""
    m = s.model
    return [route_rank(s.routing, m.tokens_per_rank, m.topk, s.num_experts, r)
            for r in range(s.world)]


def dest_mask(topk_idx: torch.Tensor, experts_per_rank: int, world: int) -> torch.Tensor:
    """[T, world] bool: token t goes to rank d (one copy per destination rank)."""
    mask = torch.zeros(topk_idx.shape[0], world, dtype=torch.bool, device=topk_idx.device)
    if topk_idx.numel():
        mask.scatter_(1, topk_idx // experts_per_rank, True)
    return mask


def copy_weights(topk_idx: torch.Tensor, topk_weights: torch.Tensor, experts_per_rank: int,
                 world: int) -> torch.Tensor:
    """[T, world] float32: w(t, d) = sum of t's weights whose experts live on rank d."""
    w = torch.zeros(topk_idx.shape[0], world, dtype=torch.float32, device=topk_idx.device)
    if topk_idx.numel():
        w.scatter_add_(1, topk_idx // experts_per_rank, topk_weights.float())
    return w


def expert_load(routings: Sequence[RankRouting], num_experts: int) -> torch.Tensor:
    """[num_experts] int64: how many (token, expert) pairs each expert receives."""
    load = torch.zeros(num_experts, dtype=torch.int64)
    for r in routings:
        load += torch.bincount(r.topk_idx.flatten().cpu(), minlength=num_experts)
    return load


@dataclass(frozen=True)
class Traffic:
    """Token copies sent from rank i to rank j, per tier, for dispatch ([world, world] int64).

    ``total`` counts the logical copies, the rank's own included (the algorithm's view).
    ``nvlink`` counts copies that leave GPU i over NVLink towards GPU j; ``nic`` those that
    leave over the network. Combine moves the same copies backwards: its matrices are the
    transposes.
    """

    total: torch.Tensor
    nvlink: torch.Tensor
    nic: torch.Tensor


def traffic(routings: Sequence[RankRouting], experts_per_rank: int, gpus_per_node: int,
            hierarchical: bool) -> Traffic:
    """Flat: every copy goes straight to its destination rank; copies between nodes are NIC
    traffic. Hierarchical: a token crosses the network once per destination node, to the GPU
    with its own local rank there (same rail), which forwards it over NVLink to the other
    GPUs of that node that need it."""
    world = len(routings)
    nodes = world // gpus_per_node
    total = torch.zeros(world, world, dtype=torch.int64)
    nvlink = torch.zeros_like(total)
    nic = torch.zeros_like(total)
    node_of = torch.arange(world) // gpus_per_node
    for s, r in enumerate(routings):
        mask = dest_mask(r.topk_idx.cpu(), experts_per_rank, world)
        per_dest = mask.sum(dim=0)
        total[s] = per_dest
        same = node_of == node_of[s]
        remote = per_dest.clone()
        remote[s] = 0  # the rank's own copy never leaves the GPU
        nvlink[s] += torch.where(same, remote, 0)
        if not hierarchical:
            nic[s] += torch.where(same, 0, remote)
            continue
        per_node = mask.view(-1, nodes, gpus_per_node).any(dim=2)  # [T, nodes]
        local = s % gpus_per_node
        for m in range(nodes):
            if m == int(node_of[s]):
                continue
            relay = m * gpus_per_node + local
            nic[s, relay] += int(per_node[:, m].sum())
            for d in range(m * gpus_per_node, (m + 1) * gpus_per_node):
                if d != relay:
                    nvlink[relay, d] += int(mask[:, d].sum())
    return Traffic(total, nvlink, nic)


def all_on_nvlink(tr: Traffic) -> Traffic:
    """The same copies with the network tier moved onto NVLink: what virtual nodes do (both tiers
    share the GPUs' NVLink ports), so the NVLink ceiling must cover every copy that leaves a GPU."""
    return Traffic(tr.total, tr.nvlink + tr.nic, torch.zeros_like(tr.nic))
