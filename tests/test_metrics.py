import math

import pandas as pd
import pytest
import torch

from support import scenario_dict
from epbench import metrics
from epbench.routing import RankRouting, Traffic, route_all, traffic
from epbench.metrics import PointRecord, counter_reference_bytes, measured_columns, summarize
from epbench.scenario import parse


@pytest.mark.parametrize("dtype, hidden, nbytes", [
    ("bf16", 8192, 16384),
    ("bf16", 7168, 14336),
    ("fp8", 8192, 8192 + 4 * 64),  # e4m3 payload + one fp32 scale per 128 elements
    ("fp8", 7168, 7168 + 4 * 56),
    ("fp8", 128, 132),
])
def test_row_bytes(dtype, hidden, nbytes):
    assert metrics.row_bytes(dtype, hidden) == nbytes


def test_row_bytes_unknown_dtype():
    with pytest.raises(ValueError):
        metrics.row_bytes("fp16", 128)


HAND = Traffic(total=torch.tensor([[1, 2, 0], [3, 4, 5], [0, 6, 7]]),
               nvlink=torch.tensor([[0, 2, 0], [3, 0, 5], [0, 6, 0]]),
               nic=torch.tensor([[0, 0, 0], [0, 0, 1], [2, 0, 0]]))


def test_rank_bytes_dispatch_by_hand():
    b = metrics.rank_bytes(HAND, "dispatch", 100)
    assert b["algo"].tolist() == [400, 1200, 1200]  # received copies (columns), own included
    assert b["nvlink"].tolist() == [200, 800, 600]  # sent copies (rows)
    assert b["nic"].tolist() == [0, 100, 200]


def test_rank_bytes_combine_by_hand():
    b = metrics.rank_bytes(HAND, "combine", 100)
    assert b["algo"].tolist() == [400, 1200, 1200]  # the same rows go back
    assert b["nvlink"].tolist() == [300, 800, 500]  # the copies flow backwards: columns
    assert b["nic"].tolist() == [200, 0, 100]


def test_rank_bytes_unknown_op():
    with pytest.raises(ValueError):
        metrics.rank_bytes(HAND, "gather", 1)


def test_bandwidth_gbps():
    assert metrics.bandwidth_gbps(1e9, 1e6) == pytest.approx(1.0)
    assert metrics.bandwidth_gbps(16384 * 4096, 500.0) == pytest.approx(134.217728)
    assert metrics.bandwidth_gbps(1e9, 0.0) is None
    assert metrics.bandwidth_gbps(1e9, None) is None
    assert metrics.bandwidth_gbps(1e9, float("nan")) is None


def test_median():
    assert metrics.median([3, 1, 2]) == 2
    assert metrics.median([4, 1, 3, 2]) == 2.5
    assert metrics.median([7.0]) == 7.0


def test_busbw_over_algbw_is_nccl_ratio_for_a_full_all_to_all():
    """topk = all experts: every token reaches every rank, the case nccl-tests' (n-1)/n covers."""
    s = parse(scenario_dict(model={"topk": 16, "experts_per_rank": 4}))
    t = traffic(route_all(s), 4, 4, hierarchical=False)
    b = metrics.rank_bytes(t, "dispatch", metrics.row_bytes("bf16", s.model.hidden))
    ratio = (b["nvlink"].double() / b["algo"].double())
    assert torch.allclose(ratio, torch.full((4,), 3 / 4, dtype=torch.float64))


def test_busbw_over_algbw_is_smaller_for_sparse_routing():
    s = parse(scenario_dict(model={"topk": 2, "experts_per_rank": 4}))
    t = traffic(route_all(s), 4, 4, hierarchical=False)
    b = metrics.rank_bytes(t, "dispatch", 2)
    assert float(b["nvlink"].sum()) / float(b["algo"].sum()) < 3 / 4


def test_own_rows_and_padding_count_as_local_copies_only():
    """epbench's own_rows=ce leaves a padding row for every own token not routed to its own rank: the byte counts
    come from the routing, so a rank's own copies are in algbw (received) and never in busbw (nothing left the
    GPU), and a token that skips its own rank adds nothing anywhere."""
    world, e = 2, 4
    skip = RankRouting(torch.tensor([[4, 5], [0, 4]]), torch.full((2, 2), 0.5))  # rank 0: t0 only to rank 1
    peer = RankRouting(torch.tensor([[4, 6], [5, 7]]), torch.full((2, 2), 0.5))  # rank 1: both own, none to 0
    t = traffic([skip, peer], e, world, hierarchical=False)
    b = metrics.rank_bytes(t, "dispatch", 10)
    assert b["algo"].tolist() == [10, 40]  # rank 0 receives its own t1; rank 1 both of 0's and its own 2
    assert b["nvlink"].tolist() == [20, 0]  # only rank 0's two rows to rank 1 cross a link
    assert metrics.rank_bytes(t, "combine", 10)["nvlink"].tolist() == [0, 20]


def rows(op, times, algbw, wrong=(0, 0, 0), nic=None):
    return [{"scenario": "s", "backend": "reference", "op": op, "sms": 0, "rank": r, "world": 3,
             "time_us": t, "algbw_gbps": a, "busbw_nvlink_gbps": a / 2,
             "busbw_nic_gbps": nic, "wrong": w}
            for r, (t, a, w) in enumerate(zip(times, algbw, wrong))]


def test_summarize_max_time_and_spread_over_ranks():
    df = pd.DataFrame(rows("dispatch", [10.0, 30.0, 20.0], [1.0, 2.0, 6.0], wrong=(0, 2, 1))
                      + rows("combine", [5.0, 4.0, 6.0], [3.0, 3.0, 3.0]))
    s = metrics.summarize(df).set_index("op")
    d, c = s.loc["dispatch"], s.loc["combine"]
    assert d["time_us"] == 30.0 and d["slowest_rank"] == 1
    assert c["time_us"] == 6.0 and c["slowest_rank"] == 2
    assert (d["algbw_gbps_min"], d["algbw_gbps_median"], d["algbw_gbps_max"]) == (1.0, 2.0, 6.0)
    assert (d["busbw_nvlink_gbps_min"], d["busbw_nvlink_gbps_max"]) == (0.5, 3.0)
    assert d["wrong"] == 3 and c["wrong"] == 0
    assert d["world"] == 3
    assert d["busbw_nic_gbps_median"] is None or math.isnan(d["busbw_nic_gbps_median"])
    assert list(s.index) == ["dispatch", "combine"]  # first-seen order


def test_summarize_keeps_points_apart():
    a = rows("dispatch", [1.0, 1.0, 1.0], [1.0, 1.0, 1.0])
    b = [dict(r, sms=8, time_us=2.0) for r in a]
    s = metrics.summarize(pd.DataFrame(a + b))
    assert len(s) == 2
    assert sorted(s["time_us"]) == [1.0, 2.0]


def test_summarize_empty():
    assert metrics.summarize(pd.DataFrame()).empty


# ---- row columns (metrics.point_rows and its helpers) ----

def test_measured_columns_agree_within_ten_percent():
    rec = PointRecord(rank=0, counted={"dispatch": {"nvlink_tx": 10 * 1050}}, counted_iters=10)
    cols = measured_columns(rec, "dispatch", nvlink_bytes=1000, nic_bytes=None, time_us=1.0)
    assert cols["nvlink_bytes_measured"] == 1050
    assert math.isclose(cols["nvlink_counter_ratio"], 1.05)
    assert cols["nvlink_counter_mismatch"] is False
    assert math.isclose(cols["busbw_nvlink_measured_gbps"], 1050 / 1e-6 / 1e9)
    assert cols["nic_bytes_measured"] is None and cols["nic_counter_mismatch"] is None


def test_measured_columns_flag_a_disagreement():
    rec = PointRecord(rank=0, counted={"combine": {"nvlink_tx": 5 * 1200}}, counted_iters=5)
    cols = measured_columns(rec, "combine", nvlink_bytes=1000, nic_bytes=None, time_us=2.0)
    assert cols["nvlink_counter_mismatch"] is True


def test_missing_counter_is_empty_not_zero():
    rec = PointRecord(rank=0)
    cols = measured_columns(rec, "dispatch", nvlink_bytes=1000, nic_bytes=500, time_us=2.0)
    assert all(v is None for v in cols.values())


def test_link_columns_from_raw_counters():
    # 10 calls of 1 ms: 2.0 GB of payload and 2.5 GB on the wire out, 2.6 GB in, on 400 GB/s links
    rec = PointRecord(rank=0, counted={"combine": {"nvlink_tx": 10 * 2_000_000_000,
                                                   "nvlink_raw_tx": 10 * 2_500_000_000,
                                                   "nvlink_raw_rx": 10 * 2_600_000_000}},
                      counted_iters=10, link_capacity_gbps=400.0)
    cols = measured_columns(rec, "combine", nvlink_bytes=2_000_000_000, nic_bytes=None, time_us=1e4)
    assert math.isclose(cols["nvlink_efficiency"], 0.8)
    assert cols["nvlink_raw_rx_bytes_measured"] == 2_600_000_000
    # the busier direction (in: 2.6 GB / 10 ms = 260 GB/s) over 400 GB/s
    assert math.isclose(cols["nvlink_link_use_pct"], 65.0)


def test_link_use_needs_the_capacity_and_a_raw_counter():
    rec = PointRecord(rank=0, counted={"dispatch": {"nvlink_tx": 10, "nvlink_raw_tx": 20}},
                      counted_iters=1)
    cols = measured_columns(rec, "dispatch", nvlink_bytes=10, nic_bytes=None, time_us=1.0)
    assert cols["nvlink_link_use_pct"] is None and cols["nvlink_efficiency"] == 0.5
    rec = PointRecord(rank=0, counted={"dispatch": {"nvlink_tx": 10}}, counted_iters=1,
                      link_capacity_gbps=478.0)
    cols = measured_columns(rec, "dispatch", nvlink_bytes=10, nic_bytes=None, time_us=1.0)
    assert cols["nvlink_link_use_pct"] is None and cols["nvlink_efficiency"] is None


def _row(rank, t, measured, mismatch):
    return {"scenario": "s", "backend": "b", "op": "dispatch", "sms": 8, "rank": rank, "world": 2,
            "time_us": t, "wrong": 0, "algbw_gbps": 1.0, "busbw_nvlink_gbps": 1.0,
            "busbw_nic_gbps": None, "busbw_nvlink_measured_gbps": measured,
            "nvlink_counter_mismatch": mismatch}


def test_summary_carries_the_counter_flag():
    import pandas as pd

    df = pd.DataFrame([_row(0, 10.0, 1.0, False), _row(1, 12.0, 0.5, True)])
    (row,) = summarize(df).to_dict("records")
    assert row["nvlink_counter_mismatch"] is True
    assert row["busbw_nvlink_measured_gbps_min"] == 0.5
    df = pd.DataFrame([_row(0, 10.0, None, None), _row(1, 12.0, None, None)])
    (row,) = summarize(df).to_dict("records")
    assert row["nvlink_counter_mismatch"] is None and row["busbw_nvlink_measured_gbps_min"] is None


def test_virtual_nodes_compare_the_nvlink_counter_with_both_tiers():
    assert counter_reference_bytes(False, 300, 100) == (300, 100)
    assert counter_reference_bytes(False, 300, None) == (300, None)
    # 2 virtual nodes x 2 GPUs: the inter-node bytes also cross NVLink, no NIC counter applies
    assert counter_reference_bytes(True, 300, 100) == (400, None)


def test_functional_reason_names_why_nothing_crossed_a_link():
    assert metrics.functional_reason(4, 1) is None
    assert metrics.functional_reason(1, 1) == "one rank: nothing crosses a link"
    assert metrics.functional_reason(4, 4).startswith("4 ranks share each GPU")


def _point(functional, ceilings=None):
    from types import SimpleNamespace

    s = parse(scenario_dict(topology={"nodes": 1, "gpus_per_node": 2}))
    recs = [PointRecord(rank=r, samples_us={"dispatch": [10.0, 12.0], "combine": [20.0]},
                        wrong={"dispatch": 0, "combine": 0}, problem={"dispatch": "", "combine": ""},
                        counted={op: {"nvlink_tx": 1000, "nvlink_raw_tx": 1200} for op in metrics.OPS},
                        counted_iters=1, link_capacity_gbps=450.0) for r in range(2)]
    tr = traffic(route_all(s), s.model.experts_per_rank, s.topology.gpus_per_node, False)
    be = SimpleNamespace(name="epbench")
    return metrics.point_rows(s, be, 8, recs, tr, "cuda", ceilings, functional)[0]


def test_functional_rows_carry_the_reason_and_no_link_figure():
    from types import SimpleNamespace

    ceil = {op: SimpleNamespace(copy_engine_us=5.0, sm_store_us={8: 6.0}) for op in metrics.OPS}
    real = _point(None, ceil)
    assert all(r["functional"] is None and r["busbw_nvlink_gbps"] > 0 for r in real)
    assert all(r["ceiling_sm_store_us"] == 6.0 and r["nvlink_link_use_pct"] is not None for r in real)
    why = "2 ranks share each GPU: their traffic stays in one GPU's memory"
    rows = _point(why, ceil)
    assert all(r["functional"] == why for r in rows)
    link_cols = [k for k in rows[0] if k.startswith(("busbw_", "ceiling_", "nvlink_link", "nvlink_eff",
                                                     "nvlink_bytes_measured", "nvlink_raw"))]
    assert link_cols and all(r[k] is None for r in rows for k in link_cols)  # empty, never zero
    assert all(r["algbw_gbps"] > 0 and r["wrong"] == 0 for r in rows)  # the time and check remain
    summary = summarize(pd.DataFrame(rows))
    assert summary["pct_of_copy_engine_ceiling"].isna().all()
    assert summary["busbw_nvlink_gbps_max"].isna().all()


def test_low_latency_rows_and_samples_carry_the_chain_length():
    """A chain row says K (calls per sample) in every row and sample; other low-latency rows say 1;
    summarize keeps K beside the timing, normal-mode rows have no chain column."""
    from types import SimpleNamespace

    s = parse(scenario_dict(mode="low_latency", topology={"nodes": 1, "gpus_per_node": 2}))
    tr = metrics.pair_traffic(route_all(s), s.model.experts_per_rank, s.topology.gpus_per_node)
    be = SimpleNamespace(name="epbench-ll")

    def rows_of(timing, chain):
        recs = [PointRecord(rank=r, samples_us={"dispatch": [1.0, 2.0], "combine": [3.0]}, timing=timing,
                            chain=chain, wrong={"dispatch": 0, "combine": 0},
                            problem={"dispatch": "", "combine": ""}) for r in range(2)]
        return metrics.point_rows(s, be, 8, recs, tr, "cuda", None, "one rank")

    rows, samples = rows_of("chain", 8)
    assert {(r["timing"], r["chain"]) for r in rows} == {("chain", 8)}
    assert {(x["timing"], x["chain"]) for x in samples} == {("chain", 8)}
    graph, _ = rows_of("graph", 1)
    assert {r["chain"] for r in graph} == {1}
    summary = summarize(pd.DataFrame(rows + graph))
    assert sorted(zip(summary["timing"], summary["chain"])) == [("chain", 8)] * 2 + [("graph", 1)] * 2
    assert "chain" not in _point(None)[0]


def test_printed_bandwidths_equal_hand_counted_bytes_over_the_median_time():
    """Rows built from a routing written out by hand; every expected byte is counted here, not by
    the functions under test. World 2, experts 0-1 on rank 0 and 2-3 on rank 1, bf16 rows of
    hidden 64 = 128 bytes.
    rank 0: t0 -> {0, 1} (rank 0), t1 -> {0, 2} (ranks 0, 1), t2 -> {2, 3} (rank 1)
    rank 1: t0 -> {0, 3} (ranks 0, 1), t1 -> {1, 0} (rank 0), t2 -> {0, 2} (ranks 0, 1)
    dispatch, bytes leaving over NVLink: rank 0 sends t1, t2 = 2 rows = 256; rank 1 sends t0, t1,
    t2 = 3 rows = 384. Combine sends the received rows back: rank 0 returns rank 1's 3 rows (384),
    rank 1 returns rank 0's 2 (256). Rows each rank handles (algbw): rank 0 gets its t0, t1 and
    rank 1's three = 5 rows = 640; rank 1 gets rank 0's t1, t2 and its own t0, t2 = 4 rows = 512."""
    from epbench.routing import RankRouting

    s = parse(scenario_dict(model={"hidden": 64, "tokens_per_rank": 3, "topk": 2, "experts_per_rank": 2},
                            topology={"name": "two", "nodes": 1, "gpus_per_node": 2}))
    w = torch.full((3, 2), 0.5)
    routings = [RankRouting(torch.tensor([[0, 1], [0, 2], [2, 3]]), w),
                RankRouting(torch.tensor([[0, 3], [1, 0], [0, 2]]), w)]
    samples = [{"dispatch": [10.0, 40.0, 20.0], "combine": [8.0, 8.0, 8.0]},    # medians 20, 8 us
               {"dispatch": [60.0, 60.0, 10.0], "combine": [16.0, 4.0, 16.0]}]  # medians 60, 16 us
    recs = [metrics.PointRecord(r, samples_us=samples[r], wrong={"dispatch": 0, "combine": 0},
                                problem={"dispatch": "", "combine": ""}) for r in range(2)]

    class Named:
        name = "hand"

    rows, _ = metrics.point_rows(s, Named, 8, recs, traffic(routings, 2, 2, False), "cuda")
    got = {(r["op"], r["rank"]): r for r in rows}
    want = {("dispatch", 0): (20.0, 640, 256), ("dispatch", 1): (60.0, 512, 384),
            ("combine", 0): (8.0, 640, 384), ("combine", 1): (16.0, 512, 256)}
    for key, (t_us, algo, nvlink) in want.items():
        r = got[key]
        assert r["time_us"] == t_us and r["algo_bytes"] == algo and r["nvlink_bytes"] == nvlink
        assert math.isclose(r["busbw_nvlink_gbps"], nvlink / (t_us * 1e-6) / 1e9), key
        assert math.isclose(r["algbw_gbps"], algo / (t_us * 1e-6) / 1e9), key
    assert math.isclose(got[("dispatch", 0)]["busbw_nvlink_gbps"], 0.0128)  # 256 B in 20 us
    assert math.isclose(got[("combine", 0)]["busbw_nvlink_gbps"], 0.048)  # 384 B in 8 us


def test_a_rank_that_sends_nothing_over_the_link_has_no_bus_bandwidth():
    """World 2, hidden 64 bf16 (128-byte rows), experts 0-1 on rank 0: every token of both ranks goes to
    rank 0's experts. Dispatch: rank 0 keeps its rows (0 bytes over NVLink), rank 1 sends its 2 rows
    (256). Combine returns them: rank 0 sends 256, rank 1 nothing. The rank with 0 link bytes gets an
    empty busbw (its time is real, its bus bandwidth means nothing), the other its bytes over its time,
    and the point's summary is that rank's figure, not 0."""
    from epbench.routing import RankRouting

    s = parse(scenario_dict(model={"hidden": 64, "tokens_per_rank": 2, "topk": 1, "experts_per_rank": 2},
                            topology={"name": "two", "nodes": 1, "gpus_per_node": 2}))
    w = torch.ones((2, 1))
    routings = [RankRouting(torch.tensor([[0], [1]]), w), RankRouting(torch.tensor([[1], [0]]), w)]
    recs = [metrics.PointRecord(r, samples_us={"dispatch": [2.0], "combine": [4.0]},
                                wrong={"dispatch": 0, "combine": 0}, problem={"dispatch": "", "combine": ""})
            for r in range(2)]

    class Named:
        name = "hand"

    rows, _ = metrics.point_rows(s, Named, 8, recs, traffic(routings, 2, 2, False), "cuda")
    got = {(r["op"], r["rank"]): r for r in rows}
    assert got[("dispatch", 0)]["nvlink_bytes"] == 0 and got[("dispatch", 0)]["busbw_nvlink_gbps"] is None
    assert got[("combine", 1)]["nvlink_bytes"] == 0 and got[("combine", 1)]["busbw_nvlink_gbps"] is None
    assert got[("dispatch", 1)]["busbw_nvlink_gbps"] == pytest.approx(256 / 2e-6 / 1e9)
    assert got[("combine", 0)]["busbw_nvlink_gbps"] == pytest.approx(256 / 4e-6 / 1e9)
    summary = summarize(pd.DataFrame(rows)).set_index("op")
    for op in ("dispatch", "combine"):
        assert summary.loc[op].filter(like="busbw_nvlink").dropna().gt(0).all()


def test_cpu_ranks_file_no_link_bytes_and_no_bus_bandwidth():
    """gloo moves CPU ranks' rows through host memory: no NVLink or NIC bytes and no bus bandwidth (empty,
    never a figure a reader takes for a link's speed); algbw (bytes received / time) stays."""
    from types import SimpleNamespace

    s = parse(scenario_dict(topology={"nodes": 2, "gpus_per_node": 1}))
    recs = [PointRecord(rank=r, samples_us={"dispatch": [10.0, 12.0], "combine": [20.0]},
                        wrong={"dispatch": 0, "combine": 0}, problem={"dispatch": "", "combine": ""}) for r in range(2)]
    tr = traffic(route_all(s), s.model.experts_per_rank, s.topology.gpus_per_node, False)
    be = SimpleNamespace(name="reference")
    cpu = metrics.point_rows(s, be, 0, recs, tr, "cpu")[0]
    for col in ("nvlink_bytes", "nic_bytes", "busbw_nvlink_gbps", "busbw_nic_gbps"):
        assert all(r[col] is None for r in cpu), col
    assert all(r["algbw_gbps"] > 0 and r["algo_bytes"] > 0 for r in cpu)
    gpu = metrics.point_rows(s, be, 0, recs, tr, "cuda")[0]
    assert any(r["busbw_nic_gbps"] for r in gpu) and all(r["nic_bytes"] is not None for r in gpu)
