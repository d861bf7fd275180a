"""The one driver every backend goes through, on every rank:

scenario -> routing -> backend -> timed samples + verification -> metrics rows -> results folder.

Each (backend, SM count) point is timed (dispatch and combine alternate, as in a model: the
stand-in expert's output is written between them, outside the timed region), then verified
on fresh random inputs with poisoned outputs. Rank 0 gathers the samples, turns them into
rows (epbench/metrics.py) and writes them before the next point starts.

``--tokens`` repeats everything per batch size (one backend object per size: the padding of
low-latency buffers is the batch size). In low-latency mode each point is timed up to three
times for a backend that supports CUDA graphs: plain launches, replays of one captured graph per
op holding one call (``graph``: what a standalone call costs, graph launch included), and replays
of one graph per op holding ``graph_chain`` back-to-back calls (``chain``: the per-call cost inside
a bigger graph, as in a decode step's); rows say which in ``timing`` (and K in ``chain``), and
each way is verified on its own.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from epbench import counters as hw
from epbench import metrics
from epbench.metrics import OPS, PointRecord, point_rows
from epbench.backends import load_backend
from epbench.backends.base import Backend, DispatchInput, DispatchOutput, LowLatencyOutput, RankSetup
from epbench.inputs import dispatch_input, expert_output, make_tokens, wire_input
from epbench.launch import Comm
from epbench.results import unmeasured_rows
from epbench import timing
from epbench.timing import Timer
from epbench.routing import RankRouting, route_all, traffic
from epbench.scenario import GRAPH_CHAIN, Scenario
from epbench.verify import (check_combine, check_dispatch, check_ll_combine, check_ll_dispatch,
                            em_expert_output, ll_expert_output)

TIMING_SALT = 0  # token values used while timing; verification draws fresh ones per point
COUNTED_ITERS = 10  # calls per op in the untimed pass that reads the hardware counters


@dataclass(frozen=True)
class RunOptions:
    backends: Tuple[str, ...]
    sms: Tuple[int, ...]
    warmup: int
    iters: int
    inject_fault: Optional[str] = None  # "dispatch" | "combine": corrupt one output row
    progress: bool = True
    ceilings: bool = True  # measure copy-engine / SM-store ceilings before the backends (GPU)
    tokens: Optional[Tuple[int, ...]] = None  # batch sizes to sweep (None: the scenario's)
    graph_chain: int = GRAPH_CHAIN  # low-latency calls per op captured in one graph for the chain rows (0: none)


def _fill_expert_output(be: Backend, out: DispatchOutput, rank: int) -> None:
    """The stand-in expert writes its output for every received row. When the backend keeps
    the row count on the device, the whole buffer is filled instead of reading the count: a
    host synchronisation here would empty the stream before every timed call, and the next
    call's launch latency would then be timed as if a model waited on the host each time."""
    y = be.combine_input(out)
    if out.expert_major is not None:  # one stand-in expert per segment, every slot filled
        rows = min(y.shape[0], out.x.shape[0])
        scales = out.x_scales[:rows] if out.x_scales is not None else None
        first = rank * out.expert_major.counts.shape[0]
        y[:rows].copy_(em_expert_output(out.x[:rows], scales, out.expert_major, first))
        return
    if isinstance(out.num_recv, torch.Tensor):
        rows = min(y.shape[0], out.x.shape[0])
        x, scales = out.x[:rows], out.x_scales[:rows] if out.x_scales is not None else None
        y[:rows].copy_(expert_output(x, scales, rank))
        return
    n = int(out.num_recv)
    scales = out.x_scales[:n] if out.x_scales is not None else None
    y[:n].copy_(expert_output(out.x[:n], scales, rank))


def _check_backend_errors(be: Backend) -> None:
    check = getattr(be, "check_errors", None)
    if check is not None:
        check()


def _time_pair(comm: Comm, warmup: int, iters: int, dispatch: Callable[[], Any],
               fill: Callable[[Any], None], combine: Callable[[Any], Any],
               gated: bool = False) -> Dict[str, List[float]]:
    """The timing loop of both modes: dispatch and combine alternate as in a model, each call
    preceded by the cross-rank sync; the stand-in expert's output is written between them,
    outside the timed region. ``gated``: the calls never wait for the device (Timer.time)."""
    n = warmup + iters
    timers = {op: Timer(comm.device, n) for op in OPS}
    for i in range(n):
        out = timers["dispatch"].time(i, dispatch, align=comm.sync, gated=gated)
        fill(out)
        timers["combine"].time(i, lambda: combine(out), align=comm.sync, gated=gated)
    return {op: t.samples_us(warmup) for op, t in timers.items()}


def time_point(be: Backend, inp: DispatchInput, sms: int, comm: Comm, warmup: int,
               iters: int) -> Dict[str, List[float]]:
    inp = be.prepare_input(inp)
    samples = _time_pair(comm, warmup, iters, lambda: be.dispatch(inp, sms),
                         lambda out: _fill_expert_output(be, out, comm.rank),
                         lambda out: be.combine(out, sms))
    _check_backend_errors(be)
    return samples


def count_point(be: Backend, inp: DispatchInput, sms: int, comm: Comm, cnt: hw.Counters,
                n: int, rec: PointRecord) -> None:
    """Untimed pass: the bytes the hardware saw leave this GPU during each op, summed over n
    calls. Each call is fenced by device synchronisations so that the readings bracket it; the
    cross-rank sync happens before a reading, so its own few bytes are not counted."""
    inp = be.prepare_input(inp)
    totals: Dict[str, Dict[str, int]] = {op: {} for op in OPS}

    def fence() -> None:
        if comm.device.type == "cuda":
            torch.cuda.synchronize()

    def add(op: str, before: Dict[str, int]) -> None:
        fence()
        for k, v in hw.delta(before, cnt.read()).items():
            totals[op][k] = totals[op].get(k, 0) + v

    for _ in range(n):
        comm.sync()
        fence()
        before = cnt.read()
        out = be.dispatch(inp, sms)
        add("dispatch", before)
        _fill_expert_output(be, out, comm.rank)
        comm.sync()
        fence()
        before = cnt.read()
        be.combine(out, sms)
        add("combine", before)
    _check_backend_errors(be)
    rec.counted, rec.counted_iters = totals, n
    rec.link_capacity_gbps = cnt.link_capacity_gbps


def verify_point(be: Backend, s: Scenario, routings: List[RankRouting], sms: int, comm: Comm,
                 salt: int, inject_fault: Optional[str], rec: PointRecord) -> None:
    m = s.model

    def source_of(rank: int) -> torch.Tensor:
        return make_tokens(routings[rank].num_tokens, m.hidden, s.routing.seed, rank, salt, comm.device)

    def input_of(rank: int) -> DispatchInput:  # what the caller hands to dispatch
        return dispatch_input(source_of(rank), routings[rank], m.dispatch_dtype, comm.device, m.quantize)

    def wire_of(rank: int) -> DispatchInput:  # what the receivers must get
        return wire_input(input_of(rank), m.dispatch_dtype)

    own = input_of(comm.rank)
    be.poison()
    comm.sync()
    out = be.dispatch(own, sms)
    if comm.device.type == "cuda":
        torch.cuda.synchronize()
    _check_backend_errors(be)
    row0 = _first_received_row(out) if inject_fault == "dispatch" else None
    if row0 is not None:
        out.x[row0].view(torch.uint8).bitwise_xor_(0x5A)
    d = check_dispatch(out, comm.rank, comm.world, m.experts_per_rank, wire_of,
                       local_expert_ids=be.receives_local_expert_ids, routing_map=be.routing_as_map,
                       source_of=source_of if m.dispatch_dtype != "bf16" else None)
    if row0 is not None:  # restore the row so that combine is checked on its own
        out.x[row0].view(torch.uint8).bitwise_xor_(0x5A)
    _fill_expert_output(be, out, comm.rank)
    comm.sync()
    got = be.combine(out, sms)
    if comm.device.type == "cuda":
        torch.cuda.synchronize()
    _check_backend_errors(be)
    if inject_fault == "combine" and got.shape[0] > 0:
        got[0].fill_(1234.0)
    wire = wire_of(comm.rank)
    # expert-major: one stand-in expert per expert (as in low-latency mode), so the sum is per expert
    roundings = be.combine_roundings()  # bf16 roundings the backend's combine path makes
    c = (check_ll_combine(got, wire, roundings) if out.expert_major is not None
         else check_combine(got, wire, comm.world, m.experts_per_rank, roundings))
    rec.wrong = {"dispatch": d.wrong, "combine": c.wrong}
    rec.problem = {"dispatch": d.first_problem, "combine": c.first_problem}


def _first_received_row(out: DispatchOutput) -> Optional[int]:
    """A valid row of the dispatch output (a host read: only used by --inject-fault): row 0, or in
    the expert-major layout the first row of the first non-empty segment."""
    if out.expert_major is None:
        return 0 if int(out.num_recv) > 0 else None
    counts = out.expert_major.counts.tolist()
    e = next((i for i, c in enumerate(counts) if c > 0), None)
    return int(out.expert_major.offsets[e]) if e is not None else None


# ---- low-latency mode ----

@dataclass
class LowLatencyCalls:
    """The two calls of one low-latency point, as timed: plain launches or graph replays.
    ``load`` puts new token values in front of the next dispatch (same routing, same shapes)."""

    dispatch: Callable[[], LowLatencyOutput]
    combine: Callable[[LowLatencyOutput], torch.Tensor]
    load: Callable[[DispatchInput], None]
    gated: bool = False  # graph replays never wait for the device: the timer may gate them
    per_replay: int = 1  # calls of each op one dispatch() / combine() runs (a graph chain: K)


def launch_calls(be: Backend, inp: DispatchInput, sms: int) -> LowLatencyCalls:
    state = {"inp": inp}

    def load(new: DispatchInput) -> None:
        state["inp"] = new

    return LowLatencyCalls(lambda: be.ll_dispatch(state["inp"], sms),
                           lambda out: be.ll_combine(out, sms), load)


def graph_calls(be: Backend, inp: DispatchInput, sms: int, chain: int = 1) -> LowLatencyCalls:
    """Captures ``chain`` back-to-back ll_dispatch calls into one CUDA graph and as many
    ll_combine calls into another (nothing runs while capturing); every call replays one of them on
    the current stream. Each captured call does its full work on the same inputs and outputs, so
    what a replay leaves is the last call's output. The inputs are copied into tensors the graphs
    own, so ``load`` only copies."""
    static = DispatchInput(inp.x.clone(), inp.x_scales.clone() if inp.x_scales is not None else None,
                           inp.topk_idx.clone(), inp.topk_weights.clone())
    torch.cuda.synchronize()
    g_dispatch, g_combine = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
    with torch.cuda.graph(g_dispatch):
        for _ in range(chain):
            out = be.ll_dispatch(static, sms)
    with torch.cuda.graph(g_combine):
        for _ in range(chain):
            got = be.ll_combine(out, sms)
    torch.cuda.synchronize()

    def dispatch() -> LowLatencyOutput:
        g_dispatch.replay()
        return out

    def combine(_: LowLatencyOutput) -> torch.Tensor:
        g_combine.replay()
        return got

    def load(new: DispatchInput) -> None:
        static.x.copy_(new.x)
        if static.x_scales is not None:
            static.x_scales.copy_(new.x_scales)
        static.topk_idx.copy_(new.topk_idx)
        static.topk_weights.copy_(new.topk_weights)

    return LowLatencyCalls(dispatch, combine, load, gated=True, per_replay=chain)


def _fill_ll_expert_output(be: Backend, out: LowLatencyOutput, rank: int) -> None:
    """Every slot through the stand-in experts (padding too: reading the counts would be a host
    synchronisation before each timed call)."""
    e = out.x.shape[0]
    be.ll_combine_input(out).copy_(ll_expert_output(out.x, out.x_scales, rank * e))


def time_ll_point(be: Backend, calls: LowLatencyCalls, comm: Comm, warmup: int,
                  iters: int) -> Dict[str, List[float]]:
    """One sample per replay; a replay of a K-call chain gives the mean of its K calls:
    per-call time = (end event - start event) / K, so percentiles are of those means."""
    samples = _time_pair(comm, warmup, iters, calls.dispatch,
                         lambda out: _fill_ll_expert_output(be, out, comm.rank), calls.combine,
                         gated=calls.gated)
    _check_backend_errors(be)
    return {op: [t / calls.per_replay for t in ts] for op, ts in samples.items()}


def ll_calls(be: Backend, inp: DispatchInput, sms: int, timing: str, chain: int) -> LowLatencyCalls:
    """The calls one low-latency timing mode times and verifies."""
    if timing == "launch":
        return launch_calls(be, inp, sms)
    return graph_calls(be, inp, sms, chain if timing == "chain" else 1)


def timings_of(be_cls: type, setup: RankSetup, device: str, as_normal: bool,
               chain: int) -> Tuple[Tuple[str, ...], Optional[str]]:
    """How a backend's points are timed, and why it has no chain rows where it could have had
    them (None otherwise): "normal" for a normal-mode backend on a low-latency batch; plain
    "launch" (every backend, every mode); and, for a low-latency backend whose calls a CUDA graph
    can capture on a GPU, "graph" (one call per replay) and "chain" (``chain`` calls per replay,
    0: none) where the backend's chain_reason allows it."""
    if as_normal:
        return ("normal",), None
    if setup.mode != "low_latency" or device != "cuda" or not be_cls.supports_cuda_graphs:
        return ("launch",), None
    if chain == 0:
        return ("launch", "graph"), None
    reason = be_cls.chain_reason(setup)
    return (("launch", "graph"), reason) if reason else (("launch", "graph", "chain"), None)


def _first_valid_slot(out: LowLatencyOutput) -> Optional[Tuple[int, int]]:
    """(expert, slot) of one received row, or None when nothing arrived (a host read: only
    used by --inject-fault)."""
    src = out.src_counts.cpu()
    for e in range(src.shape[0]):
        for s in range(src.shape[1]):
            if int(src[e, s]) > 0:
                return e, s * out.max_tokens_per_rank
    return None


def verify_ll_point(be: Backend, calls: LowLatencyCalls, s: Scenario, routings: List[RankRouting],
                    comm: Comm, salt: int, inject_fault: Optional[str], rec: PointRecord) -> None:
    m = s.model

    def input_of(rank: int) -> DispatchInput:
        x = make_tokens(routings[rank].num_tokens, m.hidden, s.routing.seed, rank, salt, comm.device)
        return dispatch_input(x, routings[rank], m.dispatch_dtype, comm.device)

    own = input_of(comm.rank)
    calls.load(own)
    be.poison()
    comm.sync()
    out = calls.dispatch()
    if comm.device.type == "cuda":
        torch.cuda.synchronize()
    _check_backend_errors(be)
    where = _first_valid_slot(out) if inject_fault == "dispatch" else None
    if where is not None:
        out.x[where].view(torch.uint8).bitwise_xor_(0x5A)
    d = check_ll_dispatch(out, comm.rank, comm.world, m.experts_per_rank, input_of)
    if where is not None:  # restore the row so that combine is checked on its own
        out.x[where].view(torch.uint8).bitwise_xor_(0x5A)
    _fill_ll_expert_output(be, out, comm.rank)
    comm.sync()
    got = calls.combine(out)
    if comm.device.type == "cuda":
        torch.cuda.synchronize()
    _check_backend_errors(be)
    if inject_fault == "combine" and got.shape[0] > 0:
        got[0].fill_(1234.0)
    c = check_ll_combine(got, own)
    rec.wrong = {"dispatch": d.wrong, "combine": c.wrong}
    rec.problem = {"dispatch": d.first_problem, "combine": c.first_problem}


def rank_setup(s: Scenario, comm: Comm) -> RankSetup:
    """What a backend is built from on this rank: the scenario's shape and this rank's place."""
    m = s.model
    return RankSetup(rank=comm.rank, world=comm.world, gpus_per_node=s.topology.gpus_per_node,
                     device=comm.device, hidden=m.hidden, max_tokens_per_rank=m.tokens_per_rank,
                     topk=m.topk, experts_per_rank=m.experts_per_rank,
                     dispatch_dtype=m.dispatch_dtype, timeout_s=s.bench.timeout_s, mode=s.mode,
                     quantize=m.quantize, layout=m.layout, align=m.align)


def _first_reason(reason: Optional[str]) -> Optional[str]:
    """A backend runs only if it can run on every rank; returns the first rank's reason."""
    reasons: List[Optional[str]] = [None] * dist.get_world_size()
    dist.all_gather_object(reasons, reason)
    return next((f"rank {i}: {r}" for i, r in enumerate(reasons) if r), None)


def runs_as_normal(be_cls: Optional[type], mode: str) -> bool:
    """True for a normal-mode-only backend in a low-latency run: it then times its normal path on
    the same batch (rows labelled timing "normal"), beside the low-latency kernels."""
    return (mode == "low_latency" and be_cls is not None and "normal" in be_cls.modes
            and "low_latency" not in be_cls.modes)


def _mode_reason(be_cls: Optional[type], mode: str) -> Optional[str]:
    if be_cls is None or mode in be_cls.modes:
        return None
    return f"does not implement mode {mode} (it implements: {', '.join(be_cls.modes)})"


def _payload_reason(be_cls: Optional[type], m: Any) -> Optional[str]:
    """A backend that lacks the scenario's dispatch dtype, quantize mode or layout is skipped."""
    if be_cls is None:
        return None
    for key, value, known in (("dispatch_dtype", m.dispatch_dtype, be_cls.dtypes),
                              ("quantize", m.quantize, be_cls.quantize_modes),
                              ("layout", m.layout, be_cls.layouts)):
        if value not in known:
            return f"does not implement {key} {value} (it implements: {', '.join(known)})"
    return None


def measure(s: Scenario, opts: RunOptions, comm: Comm,
            on_point: Callable[[List[Dict[str, Any]], List[Dict[str, Any]]], None],
            on_note: Callable[[str], None],
            advance: Callable[[str], None],
            ceilings: Optional[Dict[str, Any]] = None) -> int:
    """Runs every point on every rank, for each batch size of ``opts.tokens``. Rank 0's
    callbacks receive rows; returns the number of wrong rows summed over ranks and points.
    ``ceilings`` were measured for the scenario's own batch size; rows of others get none."""
    functional = metrics.functional_reason(comm.world, comm.ranks_per_gpu)
    cnt: Optional[hw.Counters] = None
    if functional is not None:
        on_note(f"hardware counters: not read ({functional})")
    elif comm.device.type == "cuda" and s.mode == "normal":
        cnt, notes = hw.open_counters(comm.device.index)
        for note in notes:
            on_note(f"hardware counters: {note}")
    elif comm.device.type == "cuda":
        on_note("hardware counters: not read in low_latency mode (the NVML column stays empty)")
    else:
        on_note("hardware counters: not read on CPU runs (the NVML column stays empty)")
    if comm.device.type == "cuda":
        on_note(timing.method())
    total_wrong = 0
    salt = [1]
    for tokens in opts.tokens or (s.model.tokens_per_rank,):
        sized = s.with_tokens(tokens)
        own_ceilings = ceilings if tokens == s.model.tokens_per_rank else None
        total_wrong += _measure_size(sized, opts, comm, on_point, on_note, advance, own_ceilings, cnt,
                                     salt, functional)
    if cnt is not None:
        cnt.close()
    comm.arrive("end of measurement")
    flag = torch.tensor([total_wrong], dtype=torch.int64, device=comm.collective_device)
    dist.broadcast(flag, src=0)
    return int(flag.item())


def _measure_size(s: Scenario, opts: RunOptions, comm: Comm,
                  on_point: Callable[[List[Dict[str, Any]], List[Dict[str, Any]]], None],
                  on_note: Callable[[str], None], advance: Callable[[str], None],
                  ceilings: Optional[Dict[str, Any]], cnt: Optional[hw.Counters],
                  salt: List[int], functional: Optional[str] = None) -> int:
    """Every backend and SM count at one batch size; ``salt[0]`` advances per verified point.
    ``functional``: why no byte crosses a link in this run (its rows then carry no link figures)."""
    m = s.model
    low_latency = s.mode == "low_latency"
    routings = route_all(s)
    device = comm.device.type
    x = make_tokens(m.tokens_per_rank, m.hidden, s.routing.seed, comm.rank, TIMING_SALT, comm.device)
    inp = dispatch_input(x, routings[comm.rank], m.dispatch_dtype, comm.device, m.quantize)
    setup = rank_setup(s, comm)
    em_rows = (metrics.expert_major_rows(routings, m.experts_per_rank, m.align)
               if m.layout == "expert_major" else None)
    total_wrong = 0
    for name in opts.backends:
        be_cls, reason = load_backend(name)
        as_normal = runs_as_normal(be_cls, s.mode)
        be_setup = replace(setup, mode="normal") if as_normal else setup
        comm.arrive(f"{name}: availability check")
        reason = _first_reason(reason or (None if as_normal else _mode_reason(be_cls, s.mode))
                               or _payload_reason(be_cls, m) or be_cls.unavailable_reason(be_setup))
        sms_list = opts.sms if be_cls is not None and be_cls.uses_sms else (0,)
        if reason:
            on_note(f"backend {name} skipped: {reason}")
            if comm.rank == 0:
                on_point(unmeasured_rows(s.name, name, [(n, m.tokens_per_rank) for n in sms_list],
                                         f"skipped: {reason}"), [])
            for _ in sms_list:
                advance(f"{name}: skipped")
            continue
        be = be_cls(be_setup, **s.backend_options.get(name, {}))
        ll_path = low_latency and not as_normal  # this backend's own low-latency calls
        if ll_path:
            tr = metrics.pair_traffic(routings, m.experts_per_rank, s.topology.gpus_per_node)
        else:
            tr = traffic(routings, m.experts_per_rank, s.topology.gpus_per_node, be_cls.hierarchical)
        timings, no_chain = timings_of(be_cls, be_setup, device, as_normal, opts.graph_chain)
        if no_chain:
            on_note(f"backend {name}: no chain rows ({no_chain})")
        try:
            for sms in sms_list:
                for how in timings:
                    comm.arrive(f"{name} sms={sms or 'auto'}: timed calls")
                    rec = PointRecord(comm.rank, timing=how)
                    if ll_path:
                        calls = ll_calls(be, inp, sms, how, opts.graph_chain)
                        rec.chain = calls.per_replay
                        rec.samples_us = time_ll_point(be, calls, comm, opts.warmup, opts.iters)
                        verify_ll_point(be, calls, s, routings, comm, salt[0], opts.inject_fault, rec)
                    else:
                        rec.samples_us = time_point(be, inp, sms, comm, opts.warmup, opts.iters)
                        if cnt is not None and not low_latency:
                            count_point(be, inp, sms, comm, cnt, min(COUNTED_ITERS, opts.iters), rec)
                        verify_point(be, s, routings, sms, comm, salt[0], opts.inject_fault, rec)
                    rec.config = be.effective_config()
                    salt[0] += 1
                    comm.arrive(f"{name} sms={sms or 'auto'}: gather of results")
                    gathered: List[Any] = [None] * comm.world if comm.rank == 0 else None
                    dist.gather_object(rec, gathered, dst=0)
                    if comm.rank == 0:
                        rows, samples = point_rows(s, be_cls, sms, gathered, tr, device, ceilings,
                                                   functional, em_rows)
                        total_wrong += sum(r["wrong"] for r in rows)
                        on_point(rows, samples)
                advance(f"{name} sms={sms or 'auto'}" + (f" tokens={m.tokens_per_rank}" if opts.tokens else ""))
        finally:
            be.close()
    if comm.device.type == "cuda" and timing.host_gate().forced:  # rank 0's gate; the start note said 0
        on_note(timing.method())
    return total_wrong
