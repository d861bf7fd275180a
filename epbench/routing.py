"""Routing: which experts each token goes to, and the traffic that follows from it.

Everything here is deterministic per (seed, rank) and computed on the CPU, so every rank can
rebuild every other rank's routing (verification and metrics need the whole picture).

Expert ``e`` lives on rank ``e // experts_per_rank``; rank ``r`` lives on node
``r // gpus_per_node``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Sequence, Tuple

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


# -- the routing distribution, without routing every rank (epbench predict on large worlds) ---

@dataclass(frozen=True)
class ReachStats:
    """What one token reaches, for a topology: every token of every rank is an independent draw
    of the same distribution (route_rank), so these per-token figures give every rank's counts.

    ``rank_reach[d]`` / ``node_reach[m]``: probability that a token reaches rank d / node m.
    The variances are of per-token counts: ``in_node_var[s]`` of the ranks of s's node other
    than s that it reaches; ``off_node_var[m]`` of the ranks outside node m; ``other_nodes_var[m]``
    of the nodes other than m; ``nodes_var`` of the nodes, m's own included.
    """

    rank_reach: torch.Tensor  # [world] float64
    node_reach: torch.Tensor  # [nodes] float64
    in_node_var: torch.Tensor  # [world] float64
    off_node_var: torch.Tensor  # [nodes] float64
    other_nodes_var: torch.Tensor  # [nodes] float64
    nodes_var: float
    samples: int


def _reached_sets(vals: torch.Tensor, owner: torch.Tensor,
                  topk: int) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The sets (ranks or nodes) each sampled token reaches, from vals [n, L] (its smallest
    arrival times, in order) and owner [n, L] (the set of each arrival): (set [n, topk], first
    [n, topk]: the column does not repeat an earlier set of its row, tau [n, topk]: the topk-th
    arrival outside that set; inf where its outside holds fewer than topk experts, so the set
    is always reached)."""
    reached = owner[:, :topk]
    first = torch.ones_like(reached, dtype=torch.bool)
    for i in range(1, topk):
        first[:, i] = (reached[:, :i] != reached[:, i:i + 1]).all(dim=1)
    enough = (owner[:, None, :] != reached[:, :, None]).cumsum(dim=2) >= topk  # [n, topk, L]
    tau = vals.gather(1, enough.to(torch.int8).argmax(dim=2))
    return reached, first, torch.where(enough[:, :, -1], tau, torch.inf)


def _first_arrivals(p: torch.Tensor, n: int, longest: int,
                    g: torch.Generator) -> Tuple[torch.Tensor, torch.Tensor]:
    """The first ``longest`` arrivals of n tokens' exponential races over experts of
    probability p: (times [n, longest], experts [n, longest]), in order. A rate-1 Poisson
    process whose marks are drawn from p holds one rate-p_e process per expert, so the first
    time each mark appears is that expert's Exp(p_e) arrival: a few marks per wanted expert
    cost far less than an arrival for every expert. Rows whose marks hold too few distinct
    experts (a few heavy experts repeating) draw every expert's arrival instead."""
    num = p.numel()
    marks_per_row = min(2 * longest, num) if longest < num else 0
    times = torch.empty(n, longest, dtype=torch.float64)
    experts = torch.empty(n, longest, dtype=torch.int64)
    short = torch.ones(n, dtype=torch.bool)
    if marks_per_row:
        cdf = p.cumsum(0)
        marks = torch.searchsorted(cdf, torch.rand(n, marks_per_row, dtype=torch.float64,
                                                       generator=g) * cdf[-1]).clamp_(max=num - 1)
        at = torch.empty(n, marks_per_row, dtype=torch.float64).exponential_(generator=g).cumsum(1)
        by_expert, order = marks.sort(dim=1, stable=True)
        first = torch.ones_like(marks, dtype=torch.bool)
        first[:, 1:] = by_expert[:, 1:] != by_expert[:, :-1]
        position = torch.where(first, order, marks_per_row)  # later repeats sort last
        kept = position.sort(dim=1).values[:, :longest]
        short = kept[:, -1] >= marks_per_row
        keep = kept.clamp(max=marks_per_row - 1)
        times, experts = at.gather(1, keep), marks.gather(1, keep)
    if bool(short.any()):
        race = torch.empty(int(short.sum()), num, dtype=torch.float64).exponential_(generator=g) / p
        vals, idx = race.topk(longest, dim=1, largest=False, sorted=True)
        times[short], experts[short] = vals, idx
    return times, experts


def reach_stats(routing: Routing, num_experts: int, topk: int, experts_per_rank: int,
                gpus_per_node: int, samples: int = 4096, chunk: int = 512) -> ReachStats:
    """Reach probabilities and count variances from ``samples`` tokens drawn as route_rank draws
    them (the exponential race: expert e arrives at Exp(1) / p_e, the first topk arrivals are
    the token's experts; the same law as Gumbel-top-k).

    The probabilities are Rao-Blackwellised: a set A of experts (a rank's, a node's) is missed
    when the topk-th arrival outside A, tau_A, comes before any of A's, which given the other
    arrivals has probability exp(-p_A * tau_A). Averaging that over the samples (instead of
    counting misses) leaves a relative error of about 0.35 / sqrt(samples), whatever the world
    size. Memory: one chunk of tokens x experts at a time."""
    world = num_experts // experts_per_rank
    nodes = world // gpus_per_node
    p = expert_probabilities(routing, num_experts)
    rank_of = torch.arange(num_experts) // experts_per_rank
    rank_mass = torch.zeros(world, dtype=torch.float64).index_add_(0, rank_of, p)
    node_mass = rank_mass.view(nodes, gpus_per_node).sum(dim=1)
    node_of = torch.arange(world) // gpus_per_node
    longest = min(num_experts, topk + gpus_per_node * experts_per_rank)  # enough to skip a node
    g = _generator(routing.seed, 3)
    tau_k = []
    miss_rank = torch.zeros(world, dtype=torch.float64)  # sum of exp(-m tau_A) - exp(-m tau_k)
    miss_node = torch.zeros(nodes, dtype=torch.float64)
    sums = {k: torch.zeros(nodes, dtype=torch.float64) for k in ("off", "off2", "oth", "oth2")}
    sum_c_h = torch.zeros(world, dtype=torch.float64)  # sum of c_node(s) * h_s
    sum_h = torch.zeros(world, dtype=torch.float64)
    sum_c2 = torch.zeros(nodes, dtype=torch.float64)
    sum_c = torch.zeros(nodes, dtype=torch.float64)
    sum_n = sum_n2 = 0.0
    for start in range(0, samples, chunk):
        n = min(chunk, samples - start)
        vals, experts = _first_arrivals(p, n, longest, g)
        ranks = rank_of[experts]
        tau = vals[:, topk - 1:topk]
        tau_k.append(tau[:, 0])
        by_rank = _reached_sets(vals[:, :topk + experts_per_rank],
                                ranks[:, :topk + experts_per_rank], topk)
        by_node = _reached_sets(vals, node_of[ranks], topk)
        for (reached, first, tau_a), mass, miss in ((by_rank, rank_mass, miss_rank),
                                                   (by_node, node_mass, miss_node)):
            term = torch.exp(-mass[reached] * tau_a) - torch.exp(-mass[reached] * tau)
            miss.index_add_(0, reached.flatten(), torch.where(first, term, 0.0).flatten())
        reached, hit = by_rank[0], by_rank[1].double()  # hit: once per distinct rank reached
        c = torch.zeros(n, nodes, dtype=torch.float64).scatter_add_(1, node_of[reached], hit)
        reach_nodes = (c > 0).double()
        r_all, n_all = c.sum(dim=1, keepdim=True), reach_nodes.sum(dim=1, keepdim=True)
        for key, v in (("off", r_all - c), ("oth", n_all - reach_nodes)):
            sums[key] += v.sum(dim=0)
            sums[key + "2"] += v.pow(2).sum(dim=0)
        sum_c += c.sum(dim=0)
        sum_c2 += c.pow(2).sum(dim=0)
        sum_c_h.index_add_(0, reached.flatten(), (c.gather(1, node_of[reached]) * hit).flatten())
        sum_h.index_add_(0, reached.flatten(), hit.flatten())
        sum_n += float(n_all.sum())
        sum_n2 += float(n_all.pow(2).sum())
    tau_k = torch.cat(tau_k)

    def reach(mass: torch.Tensor, miss: torch.Tensor) -> torch.Tensor:
        base = torch.cat([torch.exp(-part[:, None] * tau_k[None, :]).sum(dim=1)
                          for part in mass.split(1024)])
        return (1.0 - (base + miss) / samples).clamp_(0.0, 1.0)

    def var(s1: torch.Tensor, s2: torch.Tensor) -> torch.Tensor:
        return (s2 / samples - (s1 / samples).pow(2)).clamp_(min=0.0)

    own = sum_c[node_of] - sum_h  # sum over tokens of (c_node(s) - h_s)
    own2 = sum_c2[node_of] - 2 * sum_c_h + sum_h  # h is 0 or 1: h^2 = h
    return ReachStats(reach(rank_mass, miss_rank), reach(node_mass, miss_node), var(own, own2),
                      var(sums["off"], sums["off2"]), var(sums["oth"], sums["oth2"]),
                      max(sum_n2 / samples - (sum_n / samples) ** 2, 0.0), samples)
