"""Bytes and bandwidths: every formula epbench reports, derived once.

Row bytes
    A dispatched token row carries ``hidden`` elements: bf16 -> ``2 * hidden`` bytes; fp8
    (e4m3, one fp32 scale per 128 elements) -> ``hidden + 4 * hidden / 128`` bytes. Combine
    rows are bf16. Expert ids and weights (12 bytes per top-k slot) are metadata and are not
    counted: the payload dominates (0.6% of a bf16 row at hidden 8192, top-8).

Time
    Per iteration, device events around the call (wall clock on CPU); warm-up excluded. A
    rank's time is the median of its iterations; the operation's time is the max over ranks.

Algorithm bandwidth (per rank r)
    ``algbw_r = recv_rows_r * row_bytes / time_r`` where ``recv_rows_r`` is the number of
    token copies rank r receives in dispatch (its own tokens included). Combine sends exactly
    those rows back, so the same row count applies to both operations. This is DeepEP's and
    Hybrid-EP's "logical"/"algorithm" bandwidth.

Bus bandwidth per tier (per rank r)
    ``busbw_tier_r = bytes leaving GPU r over that tier / time_r``. For dispatch the bytes
    are the row sums of the tier's copy matrix (routing.Traffic) times row bytes; for combine,
    the column sums (the same copies flow back). The rank's own copy never leaves the GPU.
    Both counts come from the routing (token copies), never from a backend's buffers: how a
    backend moves the rank's own rows (SM stores, or the copy engine with epbench's
    ``own_rows=ce``) and the padding rows its layout leaves (row_key -1) change neither. Own
    rows are local bytes either way: in algbw, never in busbw.

Low-latency mode
    One row per (token, expert) pair instead of one per (token, destination rank): a token
    with three experts on rank d crosses the link three times (the receiver gets it straight
    in each expert's buffer). ``pair_traffic`` counts pairs; the formulas above are unchanged.
    The headline is latency: p50 and p99 of the per-iteration times (``time_us``,
    ``time_us_p99``), each the max over ranks. Chain rows (``timing`` "chain", ``chain`` = K):
    one iteration replays a graph of K back-to-back calls, and its sample is the replay's time
    / K, so their p50 and p99 are of per-replay means, and a row's time is the per-call cost
    inside a graph, without the graph launch and timing events a standalone call pays.

Functional runs
    With one rank, or several ranks on one GPU, no byte crosses a link: the kernels, buffers,
    flags and checks are the same, but the time is that of copies inside one GPU (and, without
    MPS, of processes taking turns on it). Rows carry the reason in ``functional``; their bus
    bandwidths, counter figures and ceilings stay empty, never zero.

Relation to nccl-tests
    nccl-tests' all-to-all reports ``busbw = algbw * (n - 1) / n``: with n ranks exchanging
    equal blocks, (n-1)/n of what a rank receives crossed a link. Here the ratio is whatever
    the routing makes it: ``busbw / algbw = remote copies / all copies``, equal to (n-1)/n only
    for a uniform all-to-all where each token reaches every rank.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import torch

from epbench import counters as hw
from epbench.layout import round_up
from epbench.routing import Traffic, dest_mask, expert_load
from epbench.scenario import Scenario, mxfp8_row_bytes, row_bytes  # noqa: F401  (row sizes live with the dtypes)

GB = 1e9  # bandwidths are in GB/s (10^9 bytes per second), as NVLink and NIC rates are quoted
OPS = ("dispatch", "combine")


def rank_bytes(t: Traffic, op: str, row: int) -> Dict[str, torch.Tensor]:
    """Per-rank byte counts for one operation: 'algo' (received/returned logical bytes),
    'nvlink' and 'nic' (bytes leaving each GPU over that tier)."""
    if op == "dispatch":
        return {"algo": t.total.sum(dim=0) * row,
                "nvlink": t.nvlink.sum(dim=1) * row,
                "nic": t.nic.sum(dim=1) * row}
    if op == "combine":
        return {"algo": t.total.sum(dim=0) * row,
                "nvlink": t.nvlink.sum(dim=0) * row,
                "nic": t.nic.sum(dim=0) * row}
    raise ValueError(f"unknown op {op!r}")


def pair_traffic(routings, experts_per_rank: int, gpus_per_node: int) -> Traffic:
    """Low-latency traffic: (token, expert) pairs sent from rank i to rank j, flat (no relay)."""
    world = len(routings)
    total = torch.zeros(world, world, dtype=torch.int64)
    for s, r in enumerate(routings):
        dest = r.topk_idx.flatten().cpu() // experts_per_rank
        total[s] = torch.zeros(world, dtype=torch.int64).scatter_add_(0, dest, torch.ones_like(dest))
    node_of = torch.arange(world) // gpus_per_node
    remote = total * (1 - torch.eye(world, dtype=torch.int64))
    same = node_of.unsqueeze(1) == node_of.unsqueeze(0)
    return Traffic(total, torch.where(same, remote, 0), torch.where(same, 0, remote))


def percentile(values, q: float) -> float:
    """Nearest-rank percentile (q in 0..100) of a non-empty sequence: an observed value."""
    v = sorted(values)
    rank = max(1, -(-len(v) * q // 100))  # ceil(n * q / 100)
    return float(v[int(rank) - 1])


def interpolated_percentile(values, q: float) -> float:
    """The q-th percentile (0..100) by linear interpolation between the closest ranks (NaN for no
    values): `epbench probe`'s figures, which summarise parts of a call rather than pick one
    observed call."""
    v = sorted(values)
    if not v:
        return float("nan")
    pos = (len(v) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (pos - lo)


def bandwidth_gbps(nbytes: float, time_us: float) -> Optional[float]:
    """GB/s from bytes and microseconds; None when time is missing or zero."""
    if time_us is None or not time_us > 0:
        return None
    return nbytes / (time_us * 1e-6) / GB


def median(values) -> float:
    v = sorted(values)
    n = len(v)
    return float(v[n // 2]) if n % 2 else 0.5 * (v[n // 2 - 1] + v[n // 2])


def summarize(df):
    """Per (scenario, backend, op, sms): time = max over ranks of each rank's median; the
    bandwidths' min / median / max over ranks; the slowest rank; wrong rows summed."""
    import pandas as pd

    if df.empty:
        return df
    # a --tokens sweep and low-latency timing kinds are further keys where the rows carry them
    keys = ["scenario", "backend", "op", "sms"] + [k for k in ("tokens_per_rank", "timing", "input_sets",
                                                              "call_mode") if k in df]
    out = []
    for key, g in df.groupby(keys, sort=False, dropna=False):
        slow = g.loc[g["time_us"].idxmax()]
        row = dict(zip(keys, key))
        row.update(world=int(g["world"].iloc[0]), time_us=float(g["time_us"].max()),
                   slowest_rank=int(slow["rank"]), wrong=int(g["wrong"].sum()))
        if "impl" in g:  # the kernel the library says ran (every rank's, "a/b" where ranks differed)
            impls = sorted(set(g["impl"].dropna().astype(str)))
            row["impl"] = "/".join(impls) if impls else None
        if "time_us_p99" in g:
            row["time_us_p99"] = float(pd.to_numeric(g["time_us_p99"], errors="coerce").max())
        if "chain" in g:  # one K per (point, timing): calls per sample, shown with chain rows
            k = pd.to_numeric(g["chain"], errors="coerce").max()
            row["chain"] = int(k) if k == k else None
        for flag in ("nvlink_counter_mismatch", "nic_counter_mismatch"):
            vals = g[flag].dropna() if flag in g else []
            row[flag] = bool(pd.Series(vals, dtype=object).astype(bool).any()) if len(vals) else None
        for col in ("algbw_gbps", "busbw_nvlink_gbps", "busbw_nic_gbps",
                    "busbw_nvlink_measured_gbps", "busbw_nic_measured_gbps",
                    "nvlink_link_use_pct", "nvlink_efficiency"):
            vals = pd.to_numeric(g[col], errors="coerce").dropna() if col in g else pd.Series([], dtype=float)
            for stat in ("min", "median", "max"):
                row[f"{col}_{stat}"] = float(getattr(vals, stat)()) if len(vals) else None
        for kind in ("copy_engine", "sm_store"):
            col = f"ceiling_{kind}_us"
            ceil = pd.to_numeric(g[col], errors="coerce").max() if col in g else float("nan")
            # percent of ceiling = ceiling time / the op's time: 100 = as fast as the ideal copy
            row[f"pct_of_{kind}_ceiling"] = (100.0 * float(ceil) / row["time_us"]
                                             if ceil == ceil and row["time_us"] > 0 else None)
        out.append(row)
    return pd.DataFrame(out)


@dataclass
class PointRecord:
    """One rank's raw outcome for one (backend, sms) point."""

    rank: int
    samples_us: Dict[str, List[float]] = field(default_factory=dict)
    config: Dict[str, Any] = field(default_factory=dict)  # the backend's effective_config() after the point
    wrong: Dict[str, int] = field(default_factory=dict)
    problem: Dict[str, str] = field(default_factory=dict)
    counted: Dict[str, Dict[str, int]] = field(default_factory=dict)  # op -> counter -> bytes
    counted_iters: int = 0
    link_capacity_gbps: Optional[float] = None  # the GPU's raw NVLink rate per direction
    timing: str = "launch"  # low-latency mode: "launch" | "graph" | "chain" (| "normal")
    chain: int = 1  # calls of each op per timed sample (a chain row's K)
    input_sets: int = 1  # input sets the timed calls rotated through (1: the same inputs each call)
    call_mode: str = "call"  # "call" | "kernel" (scenario bench.call_modes)


def functional_reason(world: int, ranks_per_gpu: int) -> Optional[str]:
    """Why a run moved no byte over a link (None when it did): one rank, or ranks sharing a GPU.
    Such a run checks the kernels; its times are not link speed, so no bus bandwidth, link
    use or ceiling is given for it."""
    if world == 1:
        return "one rank: nothing crosses a link"
    if ranks_per_gpu > 1:
        return f"{ranks_per_gpu} ranks share each GPU: their traffic stays in one GPU's memory"
    return None


def counter_reference_bytes(virtual_nodes: bool, nvlink_bytes: int,
                            nic_bytes: Optional[int]) -> Tuple[int, Optional[int]]:
    """What each tier's hardware counter should see per call. With virtual nodes the "NIC" tier
    travels over NVLink too, so the GPU's NVLink counters count both tiers and no NIC counter
    applies."""
    if virtual_nodes:
        return nvlink_bytes + (nic_bytes or 0), None
    return nvlink_bytes, nic_bytes


def measured_columns(rec: PointRecord, op: str, nvlink_bytes: int, nic_bytes: Optional[int],
                     time_us: float) -> Dict[str, Any]:
    """Counter-measured bytes per call beside the computed ones; empty (None) where no counter
    was read, never zero. A disagreement of more than 10% is flagged."""
    cols: Dict[str, Any] = {}
    for tier, computed in (("nvlink", nvlink_bytes), ("nic", nic_bytes)):
        got = rec.counted.get(op, {}).get(f"{tier}_tx") if computed is not None else None
        per_call = got / rec.counted_iters if got is not None and rec.counted_iters else None
        cols[f"{tier}_bytes_measured"] = per_call
        cols[f"busbw_{tier}_measured_gbps"] = (bandwidth_gbps(per_call, time_us)
                                               if per_call is not None else None)
        cols[f"{tier}_counter_ratio"] = (per_call / computed if per_call is not None and computed
                                         else None)
        cols[f"{tier}_counter_mismatch"] = hw.disagrees(per_call, computed)
    cols.update(link_columns(rec, op, time_us))
    return cols


def link_columns(rec: PointRecord, op: str, time_us: float) -> Dict[str, Any]:
    """What the links carried, protocol included (NVML's raw counters), per call: the payload's
    share of it (link efficiency) and the busier direction's rate as a percentage of the links'
    raw capacity (100 = every link busy the whole call). None where a counter was not read."""
    counted = rec.counted.get(op, {})
    n = rec.counted_iters

    def per_call(key: str) -> Optional[float]:
        return counted[key] / n if key in counted and n else None

    raw_tx, raw_rx, tx = per_call("nvlink_raw_tx"), per_call("nvlink_raw_rx"), per_call("nvlink_tx")
    busier = max((b for b in (raw_tx, raw_rx) if b is not None), default=None)
    busier_gbps = bandwidth_gbps(busier, time_us) if busier is not None else None
    cap = rec.link_capacity_gbps
    return {"nvlink_raw_tx_bytes_measured": raw_tx, "nvlink_raw_rx_bytes_measured": raw_rx,
            "nvlink_capacity_gbps": cap,
            # payload / (payload + protocol) on the way out
            "nvlink_efficiency": tx / raw_tx if tx is not None and raw_tx else None,
            # busier direction's raw bytes / time / (links x per-link rate)
            "nvlink_link_use_pct": (100.0 * busier_gbps / cap if busier_gbps is not None and cap
                                    else None)}


def ceiling_columns(c: Any, sms: int) -> Dict[str, Any]:
    """The op's ceilings measured in this run (epbench/ceiling.py): copy engines, and plain SM
    stores at this point's SM count (None where not measured, e.g. NCCL's own SM choice)."""
    return {"ceiling_copy_engine_us": c.copy_engine_us if c is not None else None,
            "ceiling_copy_engine_streams": getattr(c, "copy_engine_split", None) if c is not None else None,
            "ceiling_sm_store_us": c.sm_store_us.get(sms) if c is not None and sms else None,
            # combine: the local sum of its rows on this many SMs (None for dispatch or where not measured)
            "ceiling_sm_sum_us": getattr(c, "sm_sum_us", {}).get(sms) if c is not None and sms else None,
            # copy engines and SM stores at once on this many SMs, the fastest share, and that share (0-1)
            "ceiling_ce_sm_us": getattr(c, "ce_sm_us", {}).get(sms) if c is not None and sms else None,
            "ceiling_ce_sm_share": getattr(c, "ce_sm_share", {}).get(sms) if c is not None and sms else None}


def point_rows(s: Scenario, be_cls: type, sms: int, records: List[PointRecord], tr: Traffic,
               device: str, ceilings: Optional[Dict[str, Any]] = None,
               functional: Optional[str] = None,
               expert_major_rows: Optional[Dict[str, torch.Tensor]] = None
               ) -> Tuple[List[Dict[str, Any]], List[Dict[str, Any]]]:
    """Rank 0: raw samples -> one row per (op, rank) with bytes and bandwidths. In a functional
    run (``functional`` says why) the link figures stay empty: nothing crossed a link. Nor on CPU
    ranks (``device`` "cpu"): gloo moves their rows through host memory, so they have no link
    bytes either, only algbw (bytes received / time)."""
    m, topo = s.model, s.topology
    on_gpus = device != "cpu"
    over_links = functional is None and on_gpus
    rows, samples = [], []
    for op in OPS:
        dtype = m.dispatch_dtype if op == "dispatch" else m.combine_dtype
        nbytes = rank_bytes(tr, op, row_bytes(dtype, m.hidden))
        for rec in records:
            r = rec.rank
            ts = rec.samples_us[op]
            t_med = median(ts)
            has_nic = topo.nodes > 1 and on_gpus
            measured = measured_columns(rec, op, *counter_reference_bytes(
                topo.virtual_nodes, int(nbytes["nvlink"][r]), int(nbytes["nic"][r]) if has_nic else None), t_med)
            rows.append({
                "scenario": s.name, "backend": be_cls.name, "op": op, "sms": sms, "rank": r,
                "node": r // topo.gpus_per_node, "world": s.world, "nodes": topo.nodes,
                "nic_virtual": topo.virtual_nodes,  # inter-node bytes went over NVLink
                "device": device, "dtype": dtype, "hidden": m.hidden,
                "tokens_per_rank": m.tokens_per_rank, "topk": m.topk,
                "experts_per_rank": m.experts_per_rank, "routing": s.routing.kind,
                "iters": len(ts), "input_sets": rec.input_sets, "call_mode": rec.call_mode, "time_us": t_med, "time_us_min": min(ts),
                "time_us_max": max(ts), "time_us_mean": sum(ts) / len(ts),
                "algo_bytes": int(nbytes["algo"][r]), "nvlink_bytes": int(nbytes["nvlink"][r]) if on_gpus else None,
                "nic_bytes": int(nbytes["nic"][r]) if has_nic else None,
                "algbw_gbps": bandwidth_gbps(int(nbytes["algo"][r]), t_med),
                # a rank that sent no byte over a tier has no bus bandwidth there (empty, not 0)
                "busbw_nvlink_gbps": (bandwidth_gbps(int(nbytes["nvlink"][r]), t_med)
                                      if over_links and int(nbytes["nvlink"][r]) > 0 else None),
                "busbw_nic_gbps": (bandwidth_gbps(int(nbytes["nic"][r]), t_med)
                                   if has_nic and over_links and int(nbytes["nic"][r]) > 0 else None),
                **{k: v if over_links else None for k, v in measured.items()},
                **ceiling_columns((ceilings or {}).get(op) if over_links else None, sms),
                "functional": functional,
                "quantize": m.quantize, "layout": m.layout, "align": m.align,
                **expert_major_columns(expert_major_rows, r, row_bytes(dtype, m.hidden)),
                "wrong": rec.wrong[op], "problem": rec.problem[op],
                "impl": rec.config.get(f"{op}_impl"),
                "options": json.dumps(rec.config, sort_keys=True) if rec.config else None,
            })
            if s.mode == "low_latency":  # latency first: the tail matters for decode
                rows[-1].update(mode=s.mode, timing=rec.timing, chain=rec.chain,
                                time_us_p99=percentile(ts, 99))
            extra = {"timing": rec.timing, "chain": rec.chain} if s.mode == "low_latency" else {}
            extra.update(input_sets=rec.input_sets, call_mode=rec.call_mode)
            samples += [{"backend": be_cls.name, "op": op, "sms": sms, "rank": r, "iter": i,
                         "time_us": t, "tokens_per_rank": m.tokens_per_rank, **extra}
                        for i, t in enumerate(ts)]
    return rows, samples


# ---- MXFP8 rows and the expert-major layout (issue 26) ----

def expert_major_rows(routings, experts_per_rank: int, align: int) -> Dict[str, torch.Tensor]:
    """Per receiving rank (int64 [world]): the rows the expert-major layout adds on the
    receiver, none of which crosses a link.

    ``local_copy``: a token with ``n_d`` of its experts on rank d crosses the link once (one
    row per (token, destination rank), as counted by routing.Traffic) and is written ``n_d``
    times into d's expert segments: ``n_d - 1`` receiver-local copies. Summed over the tokens
    d receives: (token, expert) pairs for d's experts minus (token, d) rows. Combine reads
    the same ``n_d`` expert-output rows and reduces them into the one row that goes back.

    ``padding``: segment e of ``c_e`` rows is padded to ``round_up(c_e, align)``: the sum of
    ``round_up(c_e, align) - c_e`` over d's experts. Padding is buffer space only (nothing
    writes or reads it), so it adds rows to the grouped GEMM, not bytes to the links.

    Link bytes, algbw and busbw are left as in the rank-major layout (same rows on the
    wire), so both layouts and NCCL compare on the same bytes; these columns sit beside them."""
    world = len(routings)
    pairs = expert_load(routings, world * experts_per_rank).view(world, experts_per_rank)
    copies = torch.zeros(world, dtype=torch.int64)
    for r in routings:
        copies += dest_mask(r.topk_idx.cpu(), experts_per_rank, world).sum(dim=0)
    return {"local_copy": pairs.sum(dim=1) - copies,
            "padding": (round_up(pairs, align) - pairs).sum(dim=1)}


def expert_major_columns(extra: Optional[Dict[str, torch.Tensor]], rank: int,
                         row: int) -> Dict[str, Optional[int]]:
    """The result columns of one rank: local copies in bytes (the op's row size) and padding
    in rows; None in the rank-major layout, where neither exists."""
    if extra is None:
        return {"local_copy_bytes": None, "padding_rows": None}
    return {"local_copy_bytes": int(extra["local_copy"][rank]) * row,
            "padding_rows": int(extra["padding"][rank])}


# overlap's calibration rows (epbench/overlap.py): a plain copy kernel into a local buffer, and into the peers' buffers
CALIBRATIONS = ("copy", "copy-link")


def summarize_overlap(df: Any) -> Any:
    """An overlap run's rows: one line per (backend, call mode, sms): the worst rank (lowest kept, longest pair),
    wrong summed; the backends in the order measured, the calibration copies last (whichever job measured them).
    ``label`` names the line: the backend, with its call mode where the run timed it in more than one."""
    import pandas as pd

    keys = ["backend", "call_mode", "sms"] if "call_mode" in df.columns else ["backend", "sms"]
    worst_low = [c for c in df.columns
                 if c.endswith("_pct") and c != "comm_busy_pct" or c == "gemm_sms"]
    worst_high = [c for c in ("pair_us", "sum_us", "max_us", "exposed_us", "comm_busy_pct") if c in df]
    agg: Dict[str, Any] = {c: "min" for c in worst_low}
    agg.update({c: "max" for c in worst_high})
    for c in ("wrong", "gemm_wrong"):
        if c in df:
            agg[c] = "sum"
    out = df.groupby(keys, sort=False, dropna=False).agg(agg).reset_index()
    out = out if isinstance(out, pd.DataFrame) else pd.DataFrame(out)
    out["label"] = overlap_labels(out)
    copy = out["backend"].isin(CALIBRATIONS)
    return pd.concat([out[~copy], out[copy]], ignore_index=True)


def overlap_labels(summary: Any) -> List[str]:
    """Each summary line's name: its backend, and its call mode where that backend has lines in more than one."""
    if "call_mode" not in summary.columns:
        return [str(b) for b in summary["backend"]]
    modes = summary.groupby("backend", sort=False)["call_mode"].nunique()
    return [f"{b} ({m})" if modes.get(b, 0) > 1 and isinstance(m, str) else str(b)
            for b, m in zip(summary["backend"], summary["call_mode"])]
