"""Expert-major layout arithmetic (epbench/layout.py), its byte columns (epbench/metrics.py) and
the scenario rules for layout and align."""

import pytest
import torch

from epbench import layout, metrics, scenario
from epbench.contract import DispatchInput, DispatchOutput
from epbench.errors import UserError
from epbench.routing import RankRouting, dest_mask, route_rank
from epbench.scenario import Routing
from epbench.verify import check_dispatch
from support import scenario_dict

# received rows of rank 1 (experts 3, 4, 5 of a world with 3 experts per rank), by (source, token)
IDS = torch.tensor([[3, 0], [5, 4], [1, 5], [4, 3], [5, 8]])


def test_segments_counts_offsets_and_slots():
    table, sm = layout.expert_major(IDS, rank=1, experts_per_rank=3, align=1)
    assert table.counts.tolist() == [2, 2, 3] and table.offsets.tolist() == [0, 2, 4]
    assert int(table.num_slots) == 7
    # expert 3: rows 0, 3; expert 4: rows 1, 3; expert 5: rows 1, 2, 4 (row order within each)
    assert sm.row.tolist() == [0, 3, 1, 3, 1, 2, 4]
    assert sm.k.tolist() == [0, 1, 1, 0, 0, 1, 0]
    assert sm.slot.tolist() == list(range(7))


def test_padding_to_align():
    table, sm = layout.expert_major(IDS, rank=1, experts_per_rank=3, align=16)
    assert table.offsets.tolist() == [0, 16, 32] and int(table.num_slots) == 48
    assert sm.slot.tolist() == [0, 1, 16, 17, 32, 33, 34]
    assert int(layout.padding_rows(table.counts, 16)) == 48 - 7
    assert layout.expert_of_slot(table, 48).tolist() == [0] * 16 + [1] * 16 + [2] * 16


def test_empty_segments_and_no_rows():
    table, sm = layout.expert_major(IDS, rank=2, experts_per_rank=3, align=128)
    assert table.counts.tolist() == [0, 0, 1] and table.offsets.tolist() == [0, 0, 0]
    assert int(table.num_slots) == 128 and sm.slot.tolist() == [0] and sm.row.tolist() == [4]
    assert layout.expert_of_slot(table, 3).tolist() == [2, 2, 2]  # the empty ones own no slot
    table, sm = layout.expert_major(torch.zeros(0, 2, dtype=torch.int64), 0, 3, 128)
    assert table.counts.tolist() == [0, 0, 0] and int(table.num_slots) == 0 and sm.row.numel() == 0


def test_segment_offsets_are_aligned_running_sums():
    counts = torch.tensor([5, 0, 17, 128, 1])
    for align in (1, 16, 128):
        off, total = layout.segment_offsets(counts, align)
        padded = [(c + align - 1) // align * align for c in counts.tolist()]
        assert off.tolist() == [sum(padded[:i]) for i in range(5)] and int(total) == sum(padded)
        assert all(o % align == 0 for o in off.tolist())


def test_slot_capacity_covers_the_worst_case():
    # every token of 2 sources on both local experts, each segment one row short of a multiple
    assert layout.slot_capacity(2, 10, 8, 2, 128) == 2 * 10 * 2 + 2 * 127


def test_mxfp8_row_bytes():
    assert metrics.mxfp8_row_bytes(7168) == 7168 + 224 == metrics.row_bytes("mxfp8", 7168)
    assert metrics.row_bytes("mxfp8", 64) == 66


def test_expert_major_rows_count_local_copies_and_padding():
    # world 2, 2 experts per rank; rank 0 sends token 0 to experts 0, 1 (rank 0 twice), 2;
    # token 1 to 2, 3 (rank 1 twice); rank 1 sends token 0 to 1, 3
    rs = [RankRouting(torch.tensor([[0, 1, 2], [2, 3, 0]]), torch.ones(2, 3) / 3),
          RankRouting(torch.tensor([[1, 3, 0]]), torch.ones(1, 3) / 3)]
    got = metrics.expert_major_rows(rs, 2, 16)
    # rank 0: pairs 0:{r0t0, r0t1, r1t0} 1:{r0t0, r1t0} = 5, rows (token, rank) = 3 -> 2 copies
    # rank 1: pairs 2:{r0t0, r0t1} 3:{r0t1, r1t0} = 4, rows 3 -> 1 copy
    assert got["local_copy"].tolist() == [2, 1]
    assert got["padding"].tolist() == [(16 - 3) + (16 - 2), (16 - 2) + (16 - 2)]
    cols = metrics.expert_major_columns(got, 1, metrics.row_bytes("mxfp8", 64))
    assert cols == {"local_copy_bytes": 66, "padding_rows": 28}
    assert metrics.expert_major_columns(None, 0, 10) == {"local_copy_bytes": None, "padding_rows": None}


def test_scenario_layout_fields():
    s = scenario.parse(scenario_dict(model={"layout": "expert_major", "align": 128}))
    assert (s.model.layout, s.model.align) == ("expert_major", 128)
    d = scenario.parse(scenario_dict()).model
    assert (d.quantize, d.layout, d.align) == ("before", "rank_major", 1)


@pytest.mark.parametrize("model,mode,needle", [
    ({"layout": "by_expert"}, "normal", "model.layout: must be one of rank_major, expert_major"),
    ({"layout": "expert_major", "align": 64}, "normal", "model.align: must be one of 1, 16, 128"),
    ({"align": 16}, "normal", "model.align: only applies with layout: expert_major"),
    ({"layout": "expert_major"}, "low_latency", "model.layout: must be rank_major in low_latency"),
])
def test_scenario_layout_rules(model, mode, needle):
    with pytest.raises(UserError, match=needle):
        scenario.parse(scenario_dict(model=model, mode=mode))


def test_kernel_slot_rule_matches_the_layout():
    """csrc's expert-major placement, replayed in Python: slot(t, k) on the owner of g = topk_idx[t, k] is
    em_base[g] (segment start + rows of g from earlier sources, notify.cu em_segments) + t's ordinal among the
    source's tokens routed to g (em_ordinal_kernel). Every (received row, local expert) pair must land where
    epbench.layout.expert_major puts it, and the slots fit slot_capacity (csrc/buffers.cu)."""
    from epbench.layout import expert_major, segment_offsets, slot_capacity

    world, e_loc, topk, align = 3, 4, 3, 16
    g = torch.Generator().manual_seed(5)
    tokens = [7, 0, 40]
    idx = [torch.stack([torch.randperm(world * e_loc, generator=g)[:topk] for _ in range(t)]) if t
           else torch.empty(0, topk, dtype=torch.int64) for t in tokens]
    counts = torch.stack([torch.bincount(i.flatten(), minlength=world * e_loc) for i in idx])  # [source, g]
    for d in range(world):
        experts = slice(d * e_loc, (d + 1) * e_loc)
        offsets, _ = segment_offsets(counts[:, experts].sum(0), align)
        got = {}
        for s in range(world):
            em_base = offsets + counts[:s, experts].sum(0)
            seen = torch.zeros(world * e_loc, dtype=torch.int64)
            for t in range(tokens[s]):
                for k in range(topk):
                    e = int(idx[s][t, k])
                    if e // e_loc == d:
                        got[(s, t, e - d * e_loc)] = int(em_base[e - d * e_loc] + seen[e])
                seen[idx[s][t]] += 1
        received = [(s, t) for s in range(world) for t in range(tokens[s]) if bool((idx[s][t] // e_loc == d).any())]
        ids = torch.stack([idx[s][t] for s, t in received]) if received else torch.empty(0, topk, dtype=torch.int64)
        _, sm = expert_major(ids, d, e_loc, align)
        want = {(*received[int(r)], int(ids[r, k]) - d * e_loc): int(slot)
                for r, k, slot in zip(sm.row, sm.k, sm.slot)}
        assert got == want
        assert max(want.values(), default=0) < slot_capacity(world, max(tokens), topk, e_loc, align)


def test_local_expert_counts_match_bincount_and_never_read_back():
    from epbench.layout import local_expert_counts

    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, 32, (300, 6), generator=g)  # 4 ranks x 8 experts
    for rank in range(4):
        local = ids.flatten() - rank * 8
        want = torch.bincount(local[(local >= 0) & (local < 8)], minlength=8)
        got = local_expert_counts(ids, rank, 8)
        assert torch.equal(got, want) and got.dtype == torch.int64
    assert torch.equal(local_expert_counts(ids[:0], 1, 8), torch.zeros(8, dtype=torch.int64))
    # no host read: the function's code never calls bincount / item / tolist (CUDA's bincount reads the max back)
    import inspect

    for fn in (layout.local_expert_counts, layout.device_histogram, layout.histogram_keys):
        src = inspect.getsource(fn).split('"""')[-1]
        assert not any(word in src for word in ("bincount", ".item(", ".tolist(", "nonzero"))


def test_device_histogram_counts_only_what_it_keeps_and_spreads_the_rest():
    """Stale bytes (any int64), negative ids and ids past the bins are not counted, and go to many
    bins, not one (one bin made every such value's atomic add wait for the one before)."""
    g = torch.Generator().manual_seed(7)
    values = torch.cat([torch.randint(0, 16, (500,), generator=g),
                        torch.randint(-(2 ** 62), 2 ** 62, (300,), generator=g),
                        torch.tensor([-1, 16, 17, 2 ** 63 - 1, -(2 ** 63)])])
    keep = torch.rand(values.shape, generator=g) < 0.7
    for mask in (None, keep):
        ok = (values >= 0) & (values < 16) if mask is None else mask & (values >= 0) & (values < 16)
        want = torch.bincount(values[ok], minlength=16)
        assert torch.equal(layout.device_histogram(values, 16, None if mask is None else ok), want)
    # where the values not counted land: SPREAD_BINS bins by position, even where they are all alike
    same = torch.full((5000,), -1, dtype=torch.int64)
    keys = layout.histogram_keys(same, 16)
    assert keys.min() >= 16 and keys.unique().numel() == layout.SPREAD_BINS
    assert torch.equal(layout.histogram_keys(values, 16)[:500], values[:500])  # counted values keep their bin
    assert torch.equal(layout.device_histogram(values.view(5, -1) if values.numel() % 5 == 0 else values, 16),
                       torch.bincount(values[(values >= 0) & (values < 16)], minlength=16))


# ---- own rows first (the epbench backend's own_rows=ce) ----

def _own_first_buffers(inputs, rank, experts_per_rank, shift_own=True):
    """What rank ``rank``'s receive buffer holds with the own rows first, built from the offsets every source
    computes (layout.own_first_offsets), as the kernels and the copy engine fill it: its own x, ids and weights
    verbatim at rows [0, T), each peer's routed rows packed at that peer's offset; every other row poisoned.
    ``shift_own=False`` places the peers as if the own rows were packed (the sm layout's offsets): wrong."""
    world = len(inputs)
    dests = [dest_mask(inp.topk_idx, experts_per_rank, world) for inp in inputs]
    keys = layout.own_first_keys(dests, rank)
    n, h, k = int(keys.numel()), inputs[0].x.shape[1], inputs[0].topk_idx.shape[1]
    x = torch.full((n + 3, h), float("nan"), dtype=torch.bfloat16)
    idx = torch.full((n + 3, k), -7, dtype=torch.int64)
    w = torch.full((n + 3, k), float("nan"))
    t_own = inputs[rank].num_tokens
    x[:t_own], idx[:t_own], w[:t_own] = inputs[rank].x, inputs[rank].topk_idx, inputs[rank].topk_weights
    for s, inp in enumerate(inputs):
        if s == rank:
            continue
        base = int(layout.own_first_offsets(dests, s)[rank]) - (0 if shift_own else t_own)
        rows = dests[s][:, rank].nonzero().flatten()
        x[base: base + rows.numel()] = inp.x[rows]
        idx[base: base + rows.numel()] = inp.topk_idx[rows]
        w[base: base + rows.numel()] = inp.topk_weights[rows]
    counts = torch.zeros(experts_per_rank, dtype=torch.int64)
    for inp in inputs:
        local = inp.topk_idx - rank * experts_per_rank
        counts += torch.bincount(local[(local >= 0) & (local < experts_per_rank)], minlength=experts_per_rank)
    return DispatchOutput(x, None, idx, w, counts, torch.tensor(n), row_key=keys)


def _inputs(tokens, world, experts_per_rank, topk, seed):
    out = []
    for r, t in enumerate(tokens):
        rt = route_rank(Routing(kind="uniform", seed=seed), t, topk, world * experts_per_rank, r)
        g = torch.Generator().manual_seed(seed * 10 + r)
        out.append(DispatchInput(torch.randn(t, 64, generator=g).to(torch.bfloat16), None, rt.topk_idx,
                                 rt.topk_weights))
    return out


def test_own_rows_first_offsets_and_keys_by_hand():
    # rank 0: t0 -> ranks 0, 1; t1 -> 1; t2 -> 0. rank 1: t0 -> 0, 1; t1 -> 0
    dests = [torch.tensor([[1, 1], [0, 1], [1, 0]], dtype=torch.bool), torch.tensor([[1, 1], [1, 0]], dtype=torch.bool)]
    assert layout.own_first_offsets(dests, 0).tolist() == [0, 2]  # rank 1's own 2 rows first
    assert layout.own_first_offsets(dests, 1).tolist() == [3, 0]
    one = 1 << layout.KEY_SHIFT
    assert layout.own_first_keys(dests, 0).tolist() == [0, -1, 2, one, one + 1]  # t1 of rank 0: padding
    assert layout.own_first_keys(dests, 1).tolist() == [one, -1, 0, 1]


def test_own_rows_first_counts_only_other_sources_before_me():
    # 3 ranks, every token everywhere: rank 2's rows on rank 1 follow rank 1's own 4 and rank 0's 5
    dests = [torch.ones(t, 3, dtype=torch.bool) for t in (5, 4, 3)]
    assert layout.own_first_offsets(dests, 2).tolist() == [4 + 5, 5 + 4, 0]
    assert layout.own_first_offsets(dests, 0).tolist() == [0, 4, 3]
    assert layout.own_first_keys(dests, 1).numel() == 4 + 5 + 3  # num_recv = T_1 + every peer's rows


@pytest.mark.parametrize("tokens", [(40, 0, 17), (1, 33), (0, 0), (25, 25, 25, 25)])
def test_own_rows_first_layout_verifies_in_source_order(tokens):
    """The layout with its padding, put in the contract's order by row_key (verify.in_source_order), passes the
    bit-exact dispatch check on every rank; peers placed at the sm layout's offsets do not."""
    world, e = len(tokens), 4
    inputs = _inputs(tokens, world, e, topk=3, seed=sum(tokens) + world)
    for rank in range(world):
        out = _own_first_buffers(inputs, rank, e)
        assert int(out.num_recv) == tokens[rank] + sum(
            int(dest_mask(inputs[s].topk_idx, e, world)[:, rank].sum()) for s in range(world) if s != rank)
        res = check_dispatch(out, rank, world, e, lambda s: inputs[s])
        assert res.wrong == 0, res.first_problem
        if tokens[rank] and any(t for s, t in enumerate(tokens) if s != rank):
            bad = check_dispatch(_own_first_buffers(inputs, rank, e, shift_own=False), rank, world, e,
                                 lambda s: inputs[s])
            assert bad.wrong > 0


def test_by_source_keys_of_own_rows_all_by_hand():
    """own_rows all: source s's token t at row s * max_tokens + t on every rank; -1 where t is not routed
    there or past the source's tokens."""
    dests = [torch.tensor([[1, 1], [0, 1], [1, 0]], dtype=torch.bool), torch.tensor([[1, 1], [1, 0]], dtype=torch.bool)]
    one = 1 << layout.KEY_SHIFT
    assert layout.by_source_keys(dests, 0, 3).tolist() == [0, -1, 2, one, one + 1, -1]
    assert layout.by_source_keys(dests, 1, 4).tolist() == [0, 1, -1, -1, one, -1, -1, -1]
    assert layout.by_source_keys([torch.zeros(0, 2, dtype=torch.bool)] * 2, 0, 2).tolist() == [-1] * 4
