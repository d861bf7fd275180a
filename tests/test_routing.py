import pytest
import torch

from support import scenario_dict
from epbench import routing
from epbench.routing import RankRouting, expert_load, expert_probabilities, route_rank, traffic
from epbench.scenario import Routing, parse

E = 32  # experts in the skew tests
KINDS = {
    "uniform": Routing(kind="uniform", seed=3),
    "zipf": Routing(kind="zipf", seed=3, zipf_exponent=1.2),
    "hot": Routing(kind="hot", seed=3, hot_fraction=0.125, hot_multiplier=4.0),
}


def load_ratio(r: Routing):
    """Per-expert load over mean load, for 4 ranks x 2048 tokens, top-4 of 32 experts."""
    rs = [route_rank(r, 2048, 4, E, rank) for rank in range(4)]
    load = expert_load(rs, E).double()
    assert int(load.sum()) == 4 * 2048 * 4
    return load / load.mean()


@pytest.mark.parametrize("kind", KINDS)
def test_deterministic_per_seed_and_rank(kind):
    r = KINDS[kind]
    a, b = route_rank(r, 64, 4, E, 1), route_rank(r, 64, 4, E, 1)
    assert torch.equal(a.topk_idx, b.topk_idx)
    assert torch.equal(a.topk_weights, b.topk_weights)
    other_rank = route_rank(r, 64, 4, E, 2)
    assert not torch.equal(a.topk_idx, other_rank.topk_idx)
    assert not torch.equal(a.topk_weights, other_rank.topk_weights)
    other_seed = route_rank(Routing(kind=kind, seed=4, zipf_exponent=r.zipf_exponent,
                                    hot_fraction=r.hot_fraction,
                                    hot_multiplier=r.hot_multiplier), 64, 4, E, 1)
    assert not torch.equal(a.topk_idx, other_seed.topk_idx)


def test_route_all_matches_route_rank_per_rank():
    s = parse(scenario_dict())
    all_ranks = routing.route_all(s)
    assert len(all_ranks) == s.world
    for rank, rr in enumerate(all_ranks):
        want = route_rank(s.routing, s.model.tokens_per_rank, s.model.topk, s.num_experts, rank)
        assert torch.equal(rr.topk_idx, want.topk_idx)
        assert rr.num_tokens == s.model.tokens_per_rank


@pytest.mark.parametrize("kind", KINDS)
def test_rows_are_distinct_valid_experts_with_normalised_weights(kind):
    rr = route_rank(KINDS[kind], 500, 8, E, 0)
    assert rr.topk_idx.shape == (500, 8) and rr.topk_idx.dtype == torch.int64
    assert int(rr.topk_idx.min()) >= 0 and int(rr.topk_idx.max()) < E
    srt = rr.topk_idx.sort(dim=1).values
    assert bool((srt[:, 1:] != srt[:, :-1]).all()), "an expert repeats within a row"
    w = rr.topk_weights
    assert w.dtype == torch.float32 and w.shape == (500, 8)
    assert bool((w > 0).all())
    assert torch.allclose(w.sum(dim=1), torch.ones(500), atol=1e-6)


def test_topk_equal_to_all_experts_picks_each_once():
    rr = route_rank(KINDS["zipf"], 10, 8, 8, 0)
    assert torch.equal(rr.topk_idx.sort(dim=1).values, torch.arange(8).expand(10, 8))


@pytest.mark.parametrize("kind", KINDS)
def test_probabilities_sum_to_one(kind):
    p = expert_probabilities(KINDS[kind], E)
    assert p.shape == (E,)
    assert abs(float(p.sum()) - 1.0) < 1e-12
    assert bool((p > 0).all())


def test_uniform_load_is_flat():
    ratio = load_ratio(KINDS["uniform"])
    assert float(ratio.max()) < 1.25 and float(ratio.min()) > 0.75


def test_zipf_skews_the_load():
    ratio = load_ratio(KINDS["zipf"])
    assert float(ratio.max()) > 3.0
    assert float(ratio.min()) < 0.5
    # the most likely expert is the most loaded one
    p = expert_probabilities(KINDS["zipf"], E)
    assert int(ratio.argmax()) == int(p.argmax())


def test_hot_experts_get_a_multiple_of_the_average():
    r = KINDS["hot"]
    p = expert_probabilities(r, E)
    n_hot = round(r.hot_fraction * E)
    hot = p.topk(n_hot).indices
    assert torch.allclose(p[hot], torch.full((n_hot,), r.hot_multiplier / E, dtype=p.dtype))
    ratio = load_ratio(r)
    cold = torch.ones(E, dtype=torch.bool)
    cold[hot] = False
    assert float(ratio[hot].min()) > 2.0
    assert float(ratio[cold].max()) < 1.0


def test_dest_mask_and_copy_weights_by_hand():
    idx = torch.tensor([[0, 1], [1, 5], [4, 7]])  # 2 experts per rank, 4 ranks
    w = torch.tensor([[0.25, 0.75], [0.5, 0.5], [0.1, 0.9]])
    mask = routing.dest_mask(idx, 2, 4)
    assert mask.tolist() == [[True, False, False, False],
                             [True, False, True, False],
                             [False, False, True, True]]
    cw = routing.copy_weights(idx, w, 2, 4)
    assert torch.allclose(cw, torch.tensor([[1.0, 0, 0, 0], [0.5, 0, 0.5, 0], [0, 0, 0.1, 0.9]]))


def test_dest_mask_empty():
    assert routing.dest_mask(torch.zeros(0, 2, dtype=torch.int64), 2, 4).shape == (0, 4)


# Two nodes of two ranks, one expert per rank (expert e lives on rank e; node = rank // 2).
#   rank 0: t0 -> ranks 1, 2   t1 -> ranks 0, 3   t2 -> ranks 2, 3
#   rank 1: t0 -> ranks 0, 1
#   rank 2: t0 -> ranks 3, 0
#   rank 3: t0 -> ranks 3, 1
HAND = [[[1, 2], [0, 3], [2, 3]], [[0, 1]], [[3, 0]], [[3, 1]]]


def hand_routings():
    out = []
    for rows in HAND:
        idx = torch.tensor(rows, dtype=torch.int64)
        out.append(RankRouting(idx, torch.full(idx.shape, 0.5)))
    return out


TOTAL = [[1, 1, 2, 2],
         [1, 1, 0, 0],
         [1, 0, 0, 1],
         [0, 1, 0, 1]]


def test_traffic_flat_by_hand():
    t = traffic(hand_routings(), experts_per_rank=1, gpus_per_node=2, hierarchical=False)
    assert t.total.tolist() == TOTAL
    # copies to the other rank of the same node; the own copy never leaves the GPU
    assert t.nvlink.tolist() == [[0, 1, 0, 0],
                                 [1, 0, 0, 0],
                                 [0, 0, 0, 1],
                                 [0, 0, 0, 0]]
    # every copy to the other node goes straight over the NIC
    assert t.nic.tolist() == [[0, 0, 2, 2],
                              [0, 0, 0, 0],
                              [1, 0, 0, 0],
                              [0, 1, 0, 0]]


def test_traffic_hierarchical_by_hand():
    t = traffic(hand_routings(), experts_per_rank=1, gpus_per_node=2, hierarchical=True)
    assert t.total.tolist() == TOTAL
    # rank 0's three tokens all need node 1: each crosses once, to rank 2 (same local rank),
    # which forwards t1 and t2 to rank 3 over NVLink.
    assert t.nic.tolist() == [[0, 0, 3, 0],
                              [0, 0, 0, 0],
                              [1, 0, 0, 0],
                              [0, 1, 0, 0]]
    assert t.nvlink.tolist() == [[0, 1, 0, 0],
                                 [1, 0, 0, 0],
                                 [0, 0, 0, 3],
                                 [0, 0, 0, 0]]


def test_traffic_on_one_node_has_no_nic_and_hierarchy_changes_nothing():
    s = parse(scenario_dict())
    rs = routing.route_all(s)
    flat = traffic(rs, s.model.experts_per_rank, 4, hierarchical=False)
    hier = traffic(rs, s.model.experts_per_rank, 4, hierarchical=True)
    assert int(flat.nic.sum()) == 0
    assert torch.equal(flat.nvlink, hier.nvlink) and torch.equal(flat.total, hier.total)
    # what goes over NVLink is every copy but the own one
    assert torch.equal(flat.nvlink, flat.total - torch.diag(flat.total.diagonal()))
    # each rank sends each token to at least one rank, at most topk ranks
    sent = flat.total.sum(dim=1)
    assert bool((sent >= s.model.tokens_per_rank).all())
    assert bool((sent <= s.model.tokens_per_rank * s.model.topk).all())


def test_combine_bytes_are_dispatch_bytes_transposed():
    from epbench import metrics
    from epbench.routing import Traffic

    t = traffic(hand_routings(), experts_per_rank=1, gpus_per_node=2, hierarchical=True)
    tt = Traffic(t.total.t(), t.nvlink.t(), t.nic.t())
    combine = metrics.rank_bytes(t, "combine", 10)
    as_dispatch = metrics.rank_bytes(tt, "dispatch", 10)
    assert torch.equal(combine["nvlink"], as_dispatch["nvlink"])
    assert torch.equal(combine["nic"], as_dispatch["nic"])
    # by hand: combine's NIC bytes leaving rank 2 are the 3 rows it returns to rank 0
    assert combine["nic"].tolist() == [10, 10, 30, 0]
