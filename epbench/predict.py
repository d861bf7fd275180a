"""``epbench predict``: expected dispatch/combine time and bandwidth for a topology that cannot
run here (several nodes over a network), from the scenario's routing and the link rates,
calibrated by an intranode run that did run here. Everything it prints is PREDICTED.

The model
=========

Bytes per rank and tier
    The scenario's routing (routing.route_all, deterministic per seed) gives the copy matrices
    of routing.traffic for two algorithms (above EXACT_MAX_RANKS ranks the per-rank counts are
    drawn from the routing distribution instead: sampled_copies):

    - hierarchical (what epbench's internode kernels are built to do, as in DeepEP and
      Hybrid-EP): a token crosses the network once per destination node, to the GPU with the
      same local rank there, which forwards it over NVLink to the GPUs of that node that hold
      its experts;
    - flat (the NCCL all-to-all way): every copy goes straight to its destination rank, so a
      token crosses the network once per destination *rank* on another node.

    For rank r and tier k (NVLink, NIC) with row bytes R (metrics.row_bytes):
    ``tx_k[r]`` = bytes leaving GPU r over tier k (the metrics.rank_bytes convention: dispatch =
    row sums of the tier's matrix, combine = column sums) and ``rx_k[r]`` = bytes arriving at
    GPU r over tier k (the other sums). A link carries each direction at its nominal rate
    independently, so the busier direction is the one that takes time:
    ``bytes_k[r] = max(tx_k[r], rx_k[r])``. (For routings where every rank sends and receives
    alike, tx = rx; with hot experts the receiving side of a hot rank is the busier one.)

Time per tier
    ``t_k[r] = bytes_k[r] / (eff_k * rate_k)``: rate_k the scenario's nominal per-GPU, one-
    direction rate (topology.nvlink_gbps, topology.nic_gbps, GB/s = 1e9 bytes/s), eff_k the
    fraction of it that is reached (below).

Time per rank and per op
    The hierarchical kernels pipeline the tiers: tokens are forwarded over NVLink in chunks
    while later chunks are still on the network (DeepEP's and Hybrid-EP's internode kernels
    are built that way, and so is the epbench design in issue 5). When the pipeline works,
    the busier tier sets the time:
    ``t_overlap[r] = max_k t_k[r] + overhead`` (the prediction; a lower bound).
    Without overlap (store and forward: all network traffic, then all forwarding) the tiers add:
    ``t_serial[r] = sum_k t_k[r] + overhead`` (the upper bound; shown beside it).
    The op's time is that of the slowest rank, as in metrics.summarize:
    ``T = max_r t[r]``. The limiting tier is the argmax of t_k at the slowest rank.
    Virtual nodes (one host) are the exception: their "NIC" copies travel over the same NVLink
    ports, so the two tiers share one link: ``t[r] = (bytes_nvlink[r] + bytes_nic[r]) /
    (eff_nvlink * nvlink rate) + overhead``.

Bandwidths (as metrics.py defines them, on the predicted per-rank time)
    algbw[r] = rows rank r receives (own included) * R / t[r];
    busbw_k[r] = tx_k[r] / t[r];
    DeepEP-convention RDMA bandwidth[r] = (token, destination node) pairs of rank r's tokens,
    *its own node included*, * R / t[r]. DeepEP's test_internode.py and Hybrid-EP's tests count
    their "RDMA" bytes this way (Hybrid-EP: "to align with DeepEP, we do not set the local node
    map to zeros"), so their published RDMA figures compare with this column, not with busbw
    NIC, which counts only bytes that really leave the node (4/3 less on 4 nodes when every
    token reaches every node).

Efficiencies and overhead
    NVLink: ``eff_nvlink[op] = max_r bytes_nvlink[r] / ((time_op - overhead) * nominal)``,
    from one measured intranode point: ``time_op`` = slowest rank's median time of that op,
    ``bytes_nvlink[r] = max(tx, rx)`` as above (tx from the run's results.csv, rx rebuilt from
    the scenario in its meta.json; tx alone where that cannot be rebuilt), nominal = that run's
    topology.nvlink_gbps. With overhead 0 and a routing where every rank sends and receives
    alike, this is the measured NVLink bus bandwidth over the nominal rate: a whole-call
    efficiency that includes the call's fixed costs (layout, metadata exchange, launch) in
    proportion to the bytes. With it, the model reproduces the calibration run's time exactly
    (same bytes, same measure). ``--overhead-us`` states a fixed per-call cost instead:
    it is taken out of the measured time before the efficiency is computed and added back to
    every prediction, so the calibration run is still reproduced. One intranode shape cannot
    separate the two, so the default is 0 and the output says so.
    The point: ``--calibrate PATH`` (a results folder or a folder of them), else the measured
    points shipped in epbench/data/calibration.csv (made by measured_points from such folders,
    one row per run, backend, SM count and op; notes/PREDICT.md), else none (then 100% of
    nominal, said as "uncalibrated"). A run qualifies
    when it ran on CUDA GPUs on one real node (no virtual nodes), holds the backend (at --sms
    if given), every rank's rows of the point verified (wrong 0), and its dispatch dtype is the
    scenario's. Among those, a run with the scenario's routing kind, then its hidden size, then
    its experts per rank is preferred; then the newest. Within the run, the SM count with the
    smallest dispatch + combine time is taken ("best"), unless --sms names one.
    NIC: ``--nic-efficiency`` (default 1.0 = 100% of nominal), never taken from anything
    measured here: this host has no NIC. The flat alternative uses the same efficiencies, so
    hierarchical and flat differ only in the bytes they move.

What the model leaves out: latency per message and per hop (small against the milliseconds of
these shapes), congestion in the network fabric (assumed non-blocking, rail-optimised), the
forwarding GPU's SMs that compete with its own sends, and NIC efficiency, which is assumed.
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from epbench import metrics
from epbench.console import number
from epbench.errors import UserError
from epbench.routing import (RankRouting, ReachStats, Traffic, dest_mask, reach_stats,
                             route_all, traffic)
from epbench.scenario import Scenario, cpu_ranks

OPS = ("dispatch", "combine")
ALGORITHMS = ("hierarchical", "flat")
DEFAULT_NIC_EFFICIENCY = 1.0
# the measured points shipped with epbench (reviewed; notes/PREDICT.md says how to regenerate)
# Per-rank copies: counted from every rank's routing up to this many ranks (fast there),
# drawn from the routing distribution above it (docs/predict.md: time, memory, error)
EXACT_MAX_RANKS = 64
METHODS = ("auto", "exact", "sampled")
REACH_SAMPLES = 4096  # tokens sampled for the reach probabilities and variances
# measured against the exact method on 8 to 64 ranks (docs/predict.md)
SAMPLED_ERROR = ("against the exact count on 8-64 ranks (uniform, zipf, hot): op time within 1%, "
                 "mean copies per rank within 1.5%")
CALIBRATION_TABLE = Path(__file__).resolve().parent / "data" / "calibration.csv"


# -- calibration -----------------------------------------------------------------------------

@dataclass(frozen=True)
class Calibration:
    """NVLink efficiency per op (fraction of nominal) and the per-call overhead, with where
    they came from. ``source`` None: uncalibrated (efficiency 1.0)."""

    nvlink_efficiency: Dict[str, float]
    overhead_us: float = 0.0
    source: Optional[str] = None
    scenario: str = ""
    backend: str = ""
    sms: Optional[int] = None
    dtype: str = ""
    nominal_nvlink_gbps: Optional[float] = None
    measured_time_us: Dict[str, float] = field(default_factory=dict)
    measured_busbw_gbps: Dict[str, float] = field(default_factory=dict)
    why_none: str = ""  # uncalibrated: where it looked

    def describe(self) -> str:
        if self.source is None:
            return (f"calibration: none ({self.why_none or 'no measured run given'}), "
                    f"uncalibrated: 100% of nominal NVLink rate; "
                    f"per-call overhead {self.overhead_us:g} us")
        eff = " / ".join(f"{op} {100 * self.nvlink_efficiency[op]:.1f}%" for op in OPS)
        bus = " / ".join(f"{self.measured_busbw_gbps[op]:.1f}" for op in OPS)
        t = " / ".join(f"{self.measured_time_us[op]:.0f}" for op in OPS)
        sms = f"{self.sms} SMs" if self.sms else "SMs auto"
        return (f"calibration: {self.source} (MEASURED: {self.scenario}, backend {self.backend}, "
                f"{sms}, {self.dtype} dispatch): dispatch / combine {t} us, NVLink busbw {bus} "
                f"GB/s of {self.nominal_nvlink_gbps:g} nominal -> NVLink efficiency {eff}; "
                f"per-call overhead {self.overhead_us:g} us"
                f"{' (0: fixed costs are inside the efficiency)' if not self.overhead_us else ''}")


def uncalibrated(overhead_us: float = 0.0, why_none: str = "") -> Calibration:
    return Calibration({op: 1.0 for op in OPS}, overhead_us, why_none=why_none)


# EPBENCH_* variables recorded in meta.json that do not change the kernels
NOT_KNOBS = {"EPBENCH_GIT_COMMIT", "EPBENCH_DEBUG"}
# One measured point: a run's backend at one SM count, one op (the slowest rank's median time).
POINT_COLUMNS = ("run", "started_utc", "hardware", "scenario", "routing", "hidden",
                 "experts_per_rank", "dispatch_dtype", "nvlink_gbps", "backend", "sms", "op",
                 "time_us", "nvlink_bytes", "busbw_gbps")


def _hardware(meta: Dict[str, Any]) -> str:
    gpus = meta.get("gpus") or []
    if gpus and len(set(gpus)) == 1:
        return f"{len(gpus)} x {gpus[0]}"
    return ", ".join(gpus) or "unknown"


def measured_points(run: Path) -> Tuple[List[Dict[str, Any]], str]:
    """The points of one results folder that may calibrate the NVLink tier: (points, '') or
    ([], why not). A point qualifies when its run ran on CUDA GPUs on one real node without
    tuning knobs and every rank's rows of both ops at that SM count verified. ``nvlink_bytes``
    is the busiest rank and direction (see _Busiest)."""
    from epbench.results import load_run

    meta, df = load_run(run)
    sc = meta.get("scenario") or {}
    topo, model = sc.get("topology") or {}, sc.get("model") or {}
    if meta.get("device") != "cuda":
        return [], "not a CUDA run"
    if topo.get("nodes", 1) != 1 or topo.get("virtual_nodes"):
        return [], "not an intranode run"
    knobs = sorted(f"{k}={v}" for k, v in (meta.get("env") or {}).items()
                   if k.startswith("EPBENCH_") and k not in NOT_KNOBS)
    if knobs:  # an experiment with non-default kernels, not what a user gets
        return [], f"run with tuning knobs set ({', '.join(knobs)})"
    if df.empty or "backend" not in df:
        return [], "no measured points"
    need = {"backend", "op", "sms", "rank", "time_us", "nvlink_bytes", "wrong"}
    if not need <= set(df.columns):
        return [], f"results.csv lacks {', '.join(sorted(need - set(df.columns)))}"
    nominal = float(topo.get("nvlink_gbps") or 0.0)
    if not nominal > 0:
        return [], "no nominal NVLink rate in meta.json"
    common = {"run": run.name, "started_utc": str(meta.get("started_utc") or ""),
              "hardware": _hardware(meta), "scenario": sc.get("name", run.name),
              "routing": (sc.get("routing") or {}).get("kind", ""),
              "hidden": model.get("hidden"), "experts_per_rank": model.get("experts_per_rank"),
              "dispatch_dtype": model.get("dispatch_dtype", "bf16"), "nvlink_gbps": nominal,
              "source": _shown(run)}
    busiest = _Busiest(sc)
    points = []
    for (backend, n), g in df.groupby(["backend", "sms"]):
        ops = {op: g[g["op"] == op] for op in OPS}
        if any(o.empty for o in ops.values()) or int(g["wrong"].fillna(1).sum()) != 0:
            continue
        resolved = busiest.bytes(g)
        for op, o in ops.items():
            time_us = float(o["time_us"].max())  # the slowest rank's median
            slow_bytes = float(o.loc[o["time_us"].idxmax(), "nvlink_bytes"])
            points.append({**common, "backend": str(backend), "sms": int(n), "op": op,
                           "time_us": time_us,
                           "nvlink_bytes": resolved.get(op) or float(o["nvlink_bytes"].max()),
                           "busbw_gbps": metrics.bandwidth_gbps(slow_bytes, time_us)})
    if not points:
        return [], "no verified point with both ops"
    return points, ""


class _Busiest:
    """max over ranks of max(tx, rx) NVLink bytes per op in a calibration run, rebuilt from its
    meta.json scenario (results.csv holds only tx). Empty where the scenario cannot be rebuilt
    or its tx bytes disagree with the file's; the caller then uses the file's tx bytes."""

    def __init__(self, sc: Dict[str, Any]):
        self.sc, self.tiers = sc, None

    def _rebuild(self) -> Optional[Tuple[int, Dict[str, Dict[str, torch.Tensor]]]]:
        from epbench import scenario as scenario_mod

        try:
            rs = scenario_mod.parse({k: v for k, v in self.sc.items() if k != "source"},
                                    "meta.json")
        except UserError:
            return None
        if rs.topology.nodes != 1:
            return None
        tr = traffic(route_all(rs), rs.model.experts_per_rank, rs.topology.gpus_per_node, False)
        return rs.world, {op: tier_bytes(tr, op, metrics.row_bytes(
            rs.model.dispatch_dtype if op == "dispatch" else rs.model.combine_dtype,
            rs.model.hidden)) for op in OPS}

    def bytes(self, rows) -> Dict[str, float]:
        if self.tiers is None:
            self.tiers = self._rebuild() or (0, {})
        world, tiers = self.tiers
        if not tiers or set(rows["rank"].astype(int)) != set(range(world)):
            return {}
        out = {}
        for op in OPS:
            b = tiers[op]
            mine = rows[rows["op"] == op]
            if any(int(b["nvlink_tx"][int(r.rank)]) != int(r.nvlink_bytes)
                   for r in mine.itertuples()):
                return {}
            out[op] = float(torch.maximum(b["nvlink_tx"], b["nvlink_rx"]).max())
        return out


def _choose(points: List[Dict[str, Any]], s: Scenario, backend: str, sms: Optional[int],
            overhead_us: float) -> Optional[Calibration]:
    """The calibration from the qualifying points of the scenario's dispatch dtype and the
    backend (at --sms if given): a run with the scenario's routing kind, then its hidden size,
    then its experts per rank is preferred, then the newest; within it the SM count with the
    smallest dispatch + combine time unless --sms names one. None: no point fits."""
    runs: Dict[str, Dict[int, Dict[str, Dict[str, Any]]]] = {}
    for p in points:
        if (p["backend"] == backend and p["dispatch_dtype"] == s.model.dispatch_dtype
                and (sms is None or p["sms"] == sms)):
            runs.setdefault(p["source"], {}).setdefault(p["sms"], {})[p["op"]] = p
    runs = {src: {n: ops for n, ops in by_sms.items() if set(ops) == set(OPS)}
            for src, by_sms in runs.items()}
    runs = {src: by_sms for src, by_sms in runs.items() if by_sms}
    if not runs:
        return None

    def prefer(src: str):
        p = next(iter(next(iter(runs[src].values())).values()))
        return (p["routing"] == s.routing.kind, p["hidden"] == s.model.hidden,
                p["experts_per_rank"] == s.model.experts_per_rank, p["started_utc"], p["run"])

    best = runs[max(runs, key=prefer)]
    n = sms if sms is not None else min(sorted(best),
                                        key=lambda k: sum(p["time_us"] for p in best[k].values()))
    point = best[n]
    eff = {}
    for op, p in point.items():
        if not p["time_us"] > overhead_us:
            raise UserError(f"--overhead-us: {overhead_us:g} is not below the measured {op} "
                            f"time of {p['time_us']:.0f} us in {p['source']}")
        # eff = max_r max(tx_r, rx_r) / ((time - overhead) * nominal)
        eff[op] = metrics.bandwidth_gbps(p["nvlink_bytes"], p["time_us"] - overhead_us) / \
            p["nvlink_gbps"]
        if not eff[op] > 0:
            raise UserError(f"{p['source']}: {op} at {n} SMs moved no NVLink bytes; "
                            f"it cannot calibrate the NVLink tier")
    first = point[OPS[0]]
    return Calibration({op: eff[op] for op in OPS}, overhead_us, first["source"],
                       first["scenario"], backend, n or None, s.model.dispatch_dtype,
                       first["nvlink_gbps"], {op: point[op]["time_us"] for op in OPS},
                       {op: point[op]["busbw_gbps"] for op in OPS})


def _wanted(s: Scenario, backend: str, sms: Optional[int]) -> str:
    return (f"verified CUDA intranode run of backend {backend}"
            f"{f' at {sms} SMs' if sms is not None else ''} with "
            f"{s.model.dispatch_dtype} dispatch")


def calibrate(paths: Sequence[Path], s: Scenario, backend: str = "epbench",
              sms: Optional[int] = None, overhead_us: float = 0.0) -> Calibration:
    """The calibration point from results folders (--calibrate; see the module docstring)."""
    from epbench.results import find_runs

    where = ", ".join(_shown(Path(p)) for p in paths)
    try:
        runs = find_runs(list(paths))
    except UserError as e:
        raise UserError(f"--calibrate: {e}") from None
    points, why = [], []
    for run in runs:
        found, reason = measured_points(run)
        points += found
        if reason:
            why.append(f"{run.name}: {reason}")
        elif _choose(found, s, backend, sms, overhead_us) is None:
            why.append(f"{run.name}: no {_wanted(s, backend, sms)}")
    calib = _choose(points, s, backend, sms, overhead_us)
    if calib is None:
        raise UserError(f"--calibrate {where}: holds no {_wanted(s, backend, sms)}; "
                        f"{'; '.join(why[:3])}")
    return calib


def _shown(path: Path) -> str:
    """A path as a person would type it: relative to the working folder when inside it."""
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


def write_points(points: List[Dict[str, Any]], path: Path) -> None:
    """The calibration table: one CSV row per point (floats written so they read back exact)."""
    import csv

    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, POINT_COLUMNS, extrasaction="ignore", lineterminator="\n")
        w.writeheader()
        for p in points:
            w.writerow({k: repr(v) if isinstance(v, float) else v for k, v in p.items()})


def read_points(path: Path = CALIBRATION_TABLE) -> List[Dict[str, Any]]:
    import csv

    ints, floats = ("hidden", "experts_per_rank", "sms"), ("nvlink_gbps", "time_us",
                                                           "nvlink_bytes", "busbw_gbps")
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    for r in rows:
        r.update({k: int(r[k]) for k in ints}, **{k: float(r[k]) for k in floats})
        r["source"] = (f"{path.parent.name}/{path.name}: {r['run']} ({r['hardware']}, "
                       f"{r['started_utc'][:10]})")
    return rows


def default_calibration(s: Scenario, backend: str = "epbench", sms: Optional[int] = None,
                        overhead_us: float = 0.0,
                        table: Path = CALIBRATION_TABLE) -> Calibration:
    """The points shipped in epbench/data/calibration.csv if any fits, else uncalibrated."""
    calib = _choose(read_points(table), s, backend, sms, overhead_us)
    if calib is None:
        return uncalibrated(overhead_us, f"{table.parent.name}/{table.name} holds no "
                                         f"{_wanted(s, backend, sms)}")
    return calib


# -- the model -------------------------------------------------------------------------------

@dataclass
class OpPrediction:
    algorithm: str
    op: str
    time_us: float  # tiers overlapped (the prediction)
    serial_time_us: float  # tiers one after the other (the upper bound)
    slowest_rank: int
    limiting_tier: str  # nvlink | nic (at the slowest rank, overlapped)
    rank_time_us: List[float]
    rank_serial_time_us: List[float]
    algo_bytes: List[int]
    nvlink_tx_bytes: List[int]
    nvlink_rx_bytes: List[int]
    nic_tx_bytes: List[int]
    nic_rx_bytes: List[int]
    node_copy_bytes: List[int]  # DeepEP's RDMA convention: per destination node, own included
    algbw_gbps: List[float]
    busbw_nvlink_gbps: List[float]
    busbw_nic_gbps: List[float]
    rdma_deepep_gbps: List[float]

    def stats(self, key: str) -> Dict[str, float]:
        vals = sorted(getattr(self, key))
        return {"slowest": getattr(self, key)[self.slowest_rank], "min": vals[0],
                "median": metrics.median(vals), "max": vals[-1]}


@dataclass
class Prediction:
    scenario: str
    source: str
    world: int
    nodes: int
    gpus_per_node: int
    virtual_nodes: bool
    nvlink_gbps: float
    nic_gbps: float
    nic_efficiency: float
    calibration: Calibration
    ops: List[OpPrediction]
    method: str = "exact"  # how the per-rank copies were found: exact | sampled
    method_note: str = ""  # with its expected error against the exact method
    scenario_spec: Dict[str, Any] = field(default_factory=dict)  # the scenario as parsed

    def get(self, algorithm: str, op: str) -> OpPrediction:
        return next(p for p in self.ops if p.algorithm == algorithm and p.op == op)


Copies = Dict[str, torch.Tensor]  # per rank, dispatch direction: see rank_copies


def rank_copies(tr: Traffic, pairs: torch.Tensor) -> Copies:
    """[world] copies per rank for dispatch: leaving (tx) and arriving (rx) over each tier,
    received in all (``algo``, own included) and (token, destination node) pairs (``pairs``)."""
    return {"nvlink_tx": tr.nvlink.sum(dim=1), "nvlink_rx": tr.nvlink.sum(dim=0),
            "nic_tx": tr.nic.sum(dim=1), "nic_rx": tr.nic.sum(dim=0),
            "algo": tr.total.sum(dim=0), "pairs": pairs}


def op_bytes(copies: Copies, op: str, row: int) -> Dict[str, torch.Tensor]:
    """Per rank: bytes leaving (tx) and arriving (rx) over each tier, and algorithm bytes.
    Combine moves the dispatch copies backwards: its tx is dispatch's rx and the other way."""
    swap = {"tx": "rx", "rx": "tx"} if op == "combine" else {"tx": "tx", "rx": "rx"}
    out = {f"{tier}_{d}": copies[f"{tier}_{swap[d]}"] * row
           for tier in ("nvlink", "nic") for d in ("tx", "rx")}
    out["algo"] = copies["algo"] * row
    return out


def tier_bytes(tr: Traffic, op: str, row: int) -> Dict[str, torch.Tensor]:
    return op_bytes(rank_copies(tr, torch.zeros(0)), op, row)


def node_copies(routings: Sequence[RankRouting], experts_per_rank: int,
                gpus_per_node: int) -> torch.Tensor:
    """[world]: (token, destination node) pairs of each rank's tokens, its own node included."""
    world = len(routings)
    nodes = world // gpus_per_node
    return torch.tensor([int(dest_mask(r.topk_idx.cpu(), experts_per_rank, world)
                             .view(-1, nodes, gpus_per_node).any(dim=2).sum())
                         for r in routings], dtype=torch.int64)


def sampled_copies(s: Scenario, reach: ReachStats, hierarchical: bool,
                   gen: torch.Generator) -> Copies:
    """Copies per rank drawn from their distribution instead of routing every rank.

    Each count is a sum over independent tokens (n of them) of a per-token count of mean mu and
    variance v (ReachStats), so it is drawn as round(n mu + sqrt(n v) Z), Z standard normal, one
    Z per rank and count. For rank s of node m (local index l), dispatch direction, with
    q_d = P(a token reaches rank d), Q_m = P(it reaches node m), c_m = ranks of m it reaches:

    - NVLink tx: its own tokens to the other ranks of m (T tokens, c_m - h_s); hierarchical adds
      the tokens it forwards for the same-rail ranks of the other nodes: T * nodes tokens;
    - NVLink rx: copies of d from ranks of m (flat: T (g - 1) tokens, Bernoulli q_d),
      hierarchical also those forwarded to it: every rank of another local index,
      T (world - nodes) tokens;
    - NIC tx: flat: ranks outside m (T tokens); hierarchical: nodes other than m (T tokens);
    - NIC rx: flat: T (world - g) tokens, Bernoulli q_d; hierarchical: one copy per token of
      the same-rail ranks of the other nodes that reaches m: T (nodes - 1) tokens, Bernoulli Q_m;
    - algo: T world tokens, Bernoulli q_d; pairs: T tokens, nodes reached.

    The counts of one rank are drawn independently of each other (the exact counts are weakly
    correlated): docs/predict.md gives the error this leaves against the exact method."""
    t, tokens = s.topology, s.model.tokens_per_rank
    world, gpus, nodes = s.world, t.gpus_per_node, t.nodes
    node_of = torch.arange(world) // gpus
    q, big_q = reach.rank_reach, reach.node_reach
    in_node = q.view(nodes, gpus).sum(dim=1)
    bern_q, bern_big_q = q * (1 - q), big_q * (1 - big_q)

    def draw(n: float, mean: torch.Tensor, var: torch.Tensor) -> torch.Tensor:
        z = torch.randn(world, dtype=torch.float64, generator=gen)
        return (n * mean + (n * var).sqrt() * z).round().clamp(min=0).to(torch.int64)

    own = (in_node[node_of] - q, reach.in_node_var)  # other ranks of my node, per token
    if hierarchical:
        nvlink_tx = draw(tokens * nodes, *own)
        nvlink_rx = draw(tokens * (world - nodes), q, bern_q)
        nic_tx = draw(tokens, (big_q.sum() - big_q)[node_of], reach.other_nodes_var[node_of])
        nic_rx = draw(tokens * (nodes - 1), big_q[node_of], bern_big_q[node_of])
    else:
        nvlink_tx = draw(tokens, *own)
        nvlink_rx = draw(tokens * (gpus - 1), q, bern_q)
        nic_tx = draw(tokens, (q.sum() - in_node)[node_of], reach.off_node_var[node_of])
        nic_rx = draw(tokens * (world - gpus), q, bern_q)
    pairs_mean = torch.full((world,), float(big_q.sum()), dtype=torch.float64)
    return {"nvlink_tx": nvlink_tx, "nvlink_rx": nvlink_rx, "nic_tx": nic_tx, "nic_rx": nic_rx,
            "algo": draw(tokens * world, q, bern_q),
            "pairs": draw(tokens, pairs_mean, torch.full_like(pairs_mean, reach.nodes_var))}


def _gbps(nbytes: float, time_us: float) -> float:
    return metrics.bandwidth_gbps(nbytes, time_us) or 0.0


def predict_op(s: Scenario, copies: Copies, algorithm: str, op: str, calib: Calibration,
               nic_efficiency: float) -> OpPrediction:
    t = s.topology
    dtype = s.model.dispatch_dtype if op == "dispatch" else s.model.combine_dtype
    row = metrics.row_bytes(dtype, s.model.hidden)
    b = op_bytes(copies, op, row)
    nvl_rate = calib.nvlink_efficiency[op] * t.nvlink_gbps * metrics.GB  # bytes/s reached
    nic_rate = nic_efficiency * t.nic_gbps * metrics.GB
    per_rank, serial, limits = [], [], []
    ints = {k: [int(v) for v in b[k]] for k in b}
    for r in range(s.world):
        nvl = max(ints["nvlink_tx"][r], ints["nvlink_rx"][r])  # the busier direction
        nic = max(ints["nic_tx"][r], ints["nic_rx"][r])
        t_nvl = nvl / nvl_rate * 1e6  # us = bytes / (eff * rate)
        if t.virtual_nodes:  # both tiers on the same NVLink ports
            t_nic, t_nvl = 0.0, (nvl + nic) / nvl_rate * 1e6
        elif nic:
            if not nic_rate > 0:
                raise UserError(f"{s.source}: topology.nic_gbps: must be positive to predict "
                                f"traffic between nodes, got {t.nic_gbps:g}")
            t_nic = nic / nic_rate * 1e6
        else:
            t_nic = 0.0
        per_rank.append(max(t_nvl, t_nic) + calib.overhead_us)  # tiers overlap
        serial.append(t_nvl + t_nic + calib.overhead_us)  # tiers one after the other
        limits.append("nic" if t_nic > t_nvl else "nvlink")
    slow = max(range(s.world), key=lambda r: per_rank[r])  # op time = the slowest rank's
    pair_bytes = [int(p) * row for p in copies["pairs"]]
    return OpPrediction(
        algorithm, op, per_rank[slow], max(serial), slow, limits[slow], per_rank, serial,
        ints["algo"], ints["nvlink_tx"], ints["nvlink_rx"], ints["nic_tx"], ints["nic_rx"],
        pair_bytes,
        [_gbps(ints["algo"][r], per_rank[r]) for r in range(s.world)],  # algbw = received / t
        [_gbps(ints["nvlink_tx"][r], per_rank[r]) for r in range(s.world)],  # busbw = leaving / t
        [_gbps(ints["nic_tx"][r], per_rank[r]) for r in range(s.world)],
        [_gbps(pair_bytes[r], per_rank[r]) for r in range(s.world)])


def choose_method(s: Scenario, method: str = "auto") -> str:
    if method not in METHODS:
        raise UserError(f"--method: must be one of {', '.join(METHODS)}, got {method!r}")
    if method != "auto":
        return method
    return "exact" if s.world <= EXACT_MAX_RANKS else "sampled"


def method_note(method: str, samples: int = REACH_SAMPLES) -> str:
    if method == "exact":
        return "exact: every rank's routing drawn, copies counted"
    return (f"sampled: per-rank copies drawn from the routing distribution ({samples} sampled "
            f"tokens); {SAMPLED_ERROR}")


def check_scenario(s: Scenario) -> None:
    """Refuses a scenario with no link to predict: one rank (nothing leaves the GPU) or ranks
    that are CPU processes (scenario.cpu_ranks): a time at its nominal link rates would be a
    figure of nothing."""
    if s.world == 1:
        raise UserError(f"{s.source}: one rank: nothing crosses a link, so there is nothing to "
                        f"predict; give topology.nodes x topology.gpus_per_node two or more ranks")
    why = cpu_ranks(s)
    if why:
        raise UserError(f"{s.source}: {why}, so there is nothing to predict; set bench.device "
                        f"to auto or cuda for a scenario of GPUs")


def predict(s: Scenario, calib: Calibration, nic_efficiency: float = DEFAULT_NIC_EFFICIENCY,
            method: str = "auto") -> Prediction:
    """``method``: exact (route every rank, count), sampled (draw per-rank counts from the
    routing distribution: time and memory independent of the per-rank routing) or auto (exact
    up to EXACT_MAX_RANKS ranks). A scenario check_scenario refuses is a UserError."""
    check_scenario(s)
    if not 0 < nic_efficiency <= 1:
        raise UserError(f"--nic-efficiency: must lie in (0, 1], got {nic_efficiency:g}")
    if calib.overhead_us < 0:
        raise UserError(f"--overhead-us: must be zero or positive, got {calib.overhead_us:g}")
    t = s.topology
    if t.nodes > 1 and not t.virtual_nodes and not t.nic_gbps > 0:
        raise UserError(f"{s.source}: topology.nic_gbps: must be positive to predict "
                        f"{t.nodes} nodes, got {t.nic_gbps:g}")
    method = choose_method(s, method)
    m = s.model
    if method == "exact":
        routings = route_all(s)
        pairs = node_copies(routings, m.experts_per_rank, t.gpus_per_node)
        copies = {a: rank_copies(traffic(routings, m.experts_per_rank, t.gpus_per_node,
                                         hierarchical=a == "hierarchical"), pairs)
                  for a in ALGORITHMS}
    else:
        reach = reach_stats(s.routing, s.num_experts, m.topk, m.experts_per_rank,
                            t.gpus_per_node, REACH_SAMPLES)
        gen = torch.Generator().manual_seed(s.routing.seed)
        copies = {a: sampled_copies(s, reach, a == "hierarchical", gen) for a in ALGORITHMS}
    ops = [predict_op(s, copies[a], a, op, calib, nic_efficiency)
           for a in ALGORITHMS for op in OPS]
    return Prediction(s.name, s.source, s.world, t.nodes, t.gpus_per_node, t.virtual_nodes,
                      t.nvlink_gbps, t.nic_gbps, nic_efficiency, calib, ops, method,
                      method_note(method), s.to_dict())


# -- output ----------------------------------------------------------------------------------

def _spread(p: OpPrediction, key: str) -> str:
    """slowest rank's value, then min / median / max over ranks where they differ by 5%+."""
    st = p.stats(key)
    if st["max"] == 0:
        return "-"
    text = number(st["slowest"])
    if st["max"] - st["min"] >= 0.05 * max(st["median"], 1e-9):
        text += f" ({number(st['min'])} / {number(st['median'])} / {number(st['max'])})"
    return text


def nic_line(pred: Prediction) -> str:
    if pred.nodes == 1:
        return "NIC: none (one node)"
    if pred.virtual_nodes:
        return "NIC: virtual nodes: the inter-node tier shares NVLink (NVLink efficiency applies)"
    assumed = " (the default)" if pred.nic_efficiency == DEFAULT_NIC_EFFICIENCY else ""
    return (f"NIC efficiency: {100 * pred.nic_efficiency:g}% of {pred.nic_gbps:g} GB/s nominal "
            f"per GPU{assumed}: ASSUMED (--nic-efficiency), nothing measured; this host has no NIC")


def print_prediction(pred: Prediction, console) -> None:
    from epbench.console import table as new_table

    title = (f"PREDICTED: {pred.scenario} on {pred.world} ranks ({pred.nodes} "
             f"{'virtual ' if pred.virtual_nodes else ''}nodes x {pred.gpus_per_node}), "
             f"NVLink {pred.nvlink_gbps:g} GB/s, NIC {pred.nic_gbps:g} GB/s per GPU")
    caption = ("PREDICTED, not measured. GB/s; value of the slowest rank, (min / median / max over "
               "ranks) where they differ. time: tiers overlapped (the prediction); serial: tiers one "
               "after the other (upper bound). RDMA (DeepEP conv.): per destination node, own node "
               "included, as DeepEP and Hybrid-EP count it")
    table = new_table(title, caption, (
        ("algorithm", "left"), ("op", "left"), ("time us", "right"), ("serial us", "right"),
        ("algbw", "right"), ("NVLink busbw", "right"),
        ("NIC busbw (virtual)" if pred.virtual_nodes else "NIC busbw", "right"),
        ("RDMA (DeepEP conv.)", "right"), ("limit", "left"), ("slow rank", "right")))
    for p in pred.ops:
        table.add_row(p.algorithm, p.op, number(p.time_us), number(p.serial_time_us),
                      _spread(p, "algbw_gbps"), _spread(p, "busbw_nvlink_gbps"),
                      _spread(p, "busbw_nic_gbps"),
                      _spread(p, "rdma_deepep_gbps") if pred.nodes > 1 else "-",
                      "NIC" if p.limiting_tier == "nic" else "NVLink", str(p.slowest_rank))
    console.print(table)
    console.print(pred.calibration.describe(), highlight=False, soft_wrap=True)
    console.print(nic_line(pred), highlight=False, soft_wrap=True)
    console.print(f"per-rank copies: {pred.method_note}", highlight=False, soft_wrap=True)


def to_dict(pred: Prediction) -> Dict[str, Any]:
    d = asdict(pred)
    d["predicted"] = True
    d["summary"] = [{"algorithm": p.algorithm, "op": p.op, "time_us": p.time_us,
                     "serial_time_us": p.serial_time_us, "slowest_rank": p.slowest_rank,
                     "limiting_tier": p.limiting_tier,
                     **{f"{k}_{stat}": v for k in ("algbw_gbps", "busbw_nvlink_gbps",
                                                   "busbw_nic_gbps", "rdma_deepep_gbps")
                        for stat, v in p.stats(k).items()}}
                    for p in pred.ops]
    return d


def write_json(pred: Prediction, path: Path, argv: Optional[Sequence[str]] = None) -> None:
    """The prediction and, under ``provenance``, what produced it (provenance.collect, as a
    run's meta.json: commit, versions, host, command line ``argv``, by default this process's).
    Never overwrites a file and never writes into a results folder; a file it could not finish
    is removed, and what stopped it is one line (UserError)."""
    from epbench import provenance
    from epbench.results import write_new

    check_json_path(path)
    d = to_dict(pred)
    d["provenance"] = provenance.collect(list(sys.argv[1:] if argv is None else argv), "cpu")
    d["provenance"].pop("launcher", None)  # tells a run left "running" from a live one: none here
    write_new(path, json.dumps(d, indent=2, default=str) + "\n", "--json")


def check_json_path(path: Path) -> None:
    """Refuses a --json file that exists, sits in a results folder, or whose folder is missing or
    cannot be written (before anything is computed, and again when it is written): the table is
    not printed and then followed by an error."""
    from epbench.results import check_writable, is_run_dir, refuse_existing

    refuse_existing(path, "--json")
    if not path.parent.is_dir():  # the words write_new would have said, after the prediction
        why = "Not a directory" if path.parent.exists() else "No such file or directory"
        raise UserError(f"--json {path}: {why} ({path.parent} is not a folder; it is not created)")
    if is_run_dir(path.parent):
        raise UserError(f"--json {path}: {path.parent} is a results folder; predictions stay "
                        f"out of measured results")
    try:
        check_writable(path.parent)
    except UserError as e:
        raise UserError(f"--json {path}: {e}") from None
