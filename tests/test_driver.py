"""The driver's pieces that need no process group: the counter columns."""

import math

from epbench.driver import PointRecord, _measured_columns
from epbench.metrics import summarize


def test_measured_columns_agree_within_ten_percent():
    rec = PointRecord(rank=0, counted={"dispatch": {"nvlink_tx": 10 * 1050}}, counted_iters=10)
    cols = _measured_columns(rec, "dispatch", nvlink_bytes=1000, nic_bytes=None, time_us=1.0)
    assert cols["nvlink_bytes_measured"] == 1050
    assert math.isclose(cols["nvlink_counter_ratio"], 1.05)
    assert cols["nvlink_counter_mismatch"] is False
    assert math.isclose(cols["busbw_nvlink_measured_gbps"], 1050 / 1e-6 / 1e9)
    assert cols["nic_bytes_measured"] is None and cols["nic_counter_mismatch"] is None


def test_measured_columns_flag_a_disagreement():
    rec = PointRecord(rank=0, counted={"combine": {"nvlink_tx": 5 * 1200}}, counted_iters=5)
    cols = _measured_columns(rec, "combine", nvlink_bytes=1000, nic_bytes=None, time_us=2.0)
    assert cols["nvlink_counter_mismatch"] is True


def test_missing_counter_is_empty_not_zero():
    rec = PointRecord(rank=0)
    cols = _measured_columns(rec, "dispatch", nvlink_bytes=1000, nic_bytes=500, time_us=2.0)
    assert all(v is None for v in cols.values())


def test_link_columns_from_raw_counters():
    # 10 calls of 1 ms: 2.0 GB of payload and 2.5 GB on the wire out, 2.6 GB in, on 400 GB/s links
    rec = PointRecord(rank=0, counted={"combine": {"nvlink_tx": 10 * 2_000_000_000,
                                                   "nvlink_raw_tx": 10 * 2_500_000_000,
                                                   "nvlink_raw_rx": 10 * 2_600_000_000}},
                      counted_iters=10, link_capacity_gbps=400.0)
    cols = _measured_columns(rec, "combine", nvlink_bytes=2_000_000_000, nic_bytes=None, time_us=1e4)
    assert math.isclose(cols["nvlink_efficiency"], 0.8)
    assert cols["nvlink_raw_rx_bytes_measured"] == 2_600_000_000
    # the busier direction (in: 2.6 GB / 10 ms = 260 GB/s) over 400 GB/s
    assert math.isclose(cols["nvlink_link_use_pct"], 65.0)


def test_link_use_needs_the_capacity_and_a_raw_counter():
    rec = PointRecord(rank=0, counted={"dispatch": {"nvlink_tx": 10, "nvlink_raw_tx": 20}},
                      counted_iters=1)
    cols = _measured_columns(rec, "dispatch", nvlink_bytes=10, nic_bytes=None, time_us=1.0)
    assert cols["nvlink_link_use_pct"] is None and cols["nvlink_efficiency"] == 0.5
    rec = PointRecord(rank=0, counted={"dispatch": {"nvlink_tx": 10}}, counted_iters=1,
                      link_capacity_gbps=478.0)
    cols = _measured_columns(rec, "dispatch", nvlink_bytes=10, nic_bytes=None, time_us=1.0)
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


def test_a_normal_only_backend_runs_its_normal_path_in_a_low_latency_run():
    from epbench.driver import runs_as_normal

    class NormalOnly:
        modes = ("normal",)

    class Both:
        modes = ("normal", "low_latency")

    class LowLatencyOnly:
        modes = ("low_latency",)

    assert runs_as_normal(NormalOnly, "low_latency")
    assert not runs_as_normal(NormalOnly, "normal")
    assert not runs_as_normal(Both, "low_latency")  # has its own low-latency path
    assert not runs_as_normal(LowLatencyOnly, "low_latency")
    assert not runs_as_normal(None, "low_latency")


def test_virtual_nodes_compare_the_nvlink_counter_with_both_tiers():
    from epbench.driver import counter_reference_bytes

    assert counter_reference_bytes(False, 300, 100) == (300, 100)
    assert counter_reference_bytes(False, 300, None) == (300, None)
    # 2 virtual nodes x 2 GPUs: the inter-node bytes also cross NVLink, no NIC counter applies
    assert counter_reference_bytes(True, 300, 100) == (400, None)


def test_backends_without_mxfp8_or_expert_major_are_skipped_with_a_reason():
    from epbench import scenario as sc
    from epbench.backends import backend_class
    from epbench.driver import _payload_reason
    from support import scenario_dict

    m = sc.parse(scenario_dict(model={"dispatch_dtype": "mxfp8", "layout": "expert_major"})).model
    assert _payload_reason(backend_class("reference"), m) is None
    for name in ("epbench", "epbench-ll", "epbench-hier", "deepep"):
        try:
            cls = backend_class(name)
        except ImportError:
            continue
        assert _payload_reason(cls, m) == "does not implement dispatch_dtype mxfp8 (it implements: bf16, fp8)"
