"""tests/gpu/ep_worker.py trace: how a kineto chrome trace becomes per-call timelines (no GPU needed)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent / "gpu"))

import ep_worker  # noqa: E402


def ev(name, cat, ts, dur, stream):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "args": {"stream": stream}}


def test_calls_split_at_spin_and_nccl_and_medians_per_stream():
    events = []
    for i, (k, copy) in enumerate([(10, 50), (12, 70), (14, 60)]):  # three calls, 1000 us apart
        base = i * 1000
        events += [ev("ncclDevKernel_AllReduce", "kernel", base, 5, 7),
                   ev("void at::cuda::(anonymous namespace)::spin_kernel(long)", "kernel", base + 10, 90, 7),
                   ev("void (anonymous namespace)::notify_kernel<1>(EpParams)", "kernel", base + 100 + 2, k, 7),
                   ev("Memcpy PtoP (Device -> Device)", "gpu_memcpy", base + 100 + 20, copy, 21),
                   ev("Memcpy PtoP (Device -> Device)", "gpu_memcpy", base + 100 + 20 + copy, 5, 21),
                   ev("ce_keys_kernel(EpParams, int, int)", "kernel", base + 100 + 95, 3, 7),
                   {"ph": "X", "cat": "cuda_runtime", "name": "cudaMemcpyAsync", "ts": base + 101, "dur": 1}]
    calls = ep_worker._call_activities({"traceEvents": events})
    assert len(calls) == 3 and all(len(c) == 4 for c in calls)  # the NCCL kernel and the host event left out
    assert calls[1][0] == ("notify_kernel", 7, 2, 12)
    rows = ep_worker._median_timeline(calls)
    assert [(r[0], r[1]) for r in rows] == [("notify_kernel", 0), ("Memcpy PtoP (Device -> Device)", 1),
                                            ("Memcpy PtoP (Device -> Device)", 1), ("ce_keys_kernel", 0)]
    assert rows[0][2:] == (2, 12, 3)  # median start, median duration, calls seen
    assert rows[1][3] == 60 and rows[2][2] == 80  # the second copy on the stream is its own row
