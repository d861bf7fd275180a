"""The probe's table arithmetic (epbench/llprobe.py); the GPU part runs on the device machine."""

from __future__ import annotations

import csv

import pytest

from epbench import llprobe


def _block(start: int, *marks: int) -> list:
    # LlStamp order: start, staged, sent, released, waited, received, end, (unused)
    return [start, *marks, 0]


def test_parts_add_up_to_the_span_over_the_whole_grid() -> None:
    blocks = [_block(1000, 1500, 3000, 3200, 5000, 6000, 7000),
              _block(1400, 1600, 2500, 4000, 5100, 6500, 6800)]
    p = llprobe.call_parts(blocks)
    # first start 1000; then the last block past each boundary: 1600, 3000, 4000, 5100, 6500, 7000
    assert p["stage"] == pytest.approx(0.6)
    assert p["send"] == pytest.approx(1.4)
    assert p["release"] == pytest.approx(1.0)
    assert p["wait"] == pytest.approx(1.1)
    assert p["receive"] == pytest.approx(1.4)
    assert p["finish"] == pytest.approx(0.5)
    assert p["span"] == pytest.approx(6.0)
    assert sum(p[k] for k in llprobe.PARTS) == pytest.approx(p["span"])
    assert p["skew"] == pytest.approx(0.4)


def test_probe_parts_use_start_sent_and_end() -> None:
    blocks = [_block(0, 0, 800, 0, 0, 0, 2000), _block(300, 0, 1100, 0, 0, 0, 1500)]
    assert llprobe.probe_parts(blocks) == {"span": pytest.approx(2.0), "a": pytest.approx(1.1)}


def test_percentile_interpolates_and_summary_reports_outside_the_stamps() -> None:
    assert llprobe.percentile([4.0, 1.0, 3.0, 2.0], 50) == pytest.approx(2.5)
    assert llprobe.percentile([1.0, 2.0], 100) == 2.0
    per_call = [{"span": 5.0, "a": 1.0}, {"span": 6.0, "a": 2.0}, {"span": 7.0, "a": 3.0}]
    row = llprobe.summarize(per_call, [8.0, 9.0, 100.0])
    assert row["call_p50"] == 9.0 and row["call_max"] == 100.0
    assert row["span_p50"] == 6.0 and row["a_p99"] == pytest.approx(2.98)
    assert row["outside_p50"] == 3.0  # per call: 3, 3, 93


def test_table_and_csv(tmp_path) -> None:
    rows = [{"sms": 32, "op": "dispatch", "tokens": 1, "variant": "default", "wrong": 0, "call_p50": 4.5,
             "span_p50": float("nan")},
            {"sms": 32, "op": "probe", "tokens": "", "variant": "timer", "wrong": "", "a_p50": 32.0,
             "timer_step_ns": 32}]
    text = llprobe.format_table(rows).splitlines()
    assert len(text) == 3 and "call" in text[0] and "4.50" in text[1] and "32.00" in text[2]
    path = tmp_path / "p.csv"
    llprobe.write_csv(rows, str(path))
    got = list(csv.DictReader(path.open()))
    assert got[1]["timer_step_ns"] == "32" and got[0]["call_p50"] == "4.5"


def test_unknown_variant_is_one_line_and_exit_2(capsys) -> None:
    assert llprobe.main(["--variants", "default,nope"]) == 2
    assert "nope" in capsys.readouterr().err
