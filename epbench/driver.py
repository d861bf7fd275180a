"""The one driver every backend goes through, on every rank:

scenario -> routing -> backend -> timed samples + verification -> metrics rows -> results folder.

Each (backend, SM count) point is timed (dispatch and combine alternate, as in a model: the
stand-in expert's output is written between them, outside the timed region). The timed calls
rotate through ``input_sets`` sets of inputs (different token values, and the same routes handed
to other tokens, so no byte count changes; loaded outside the timed region), so that no cache
of a previous identical call can make a call look fast. What is timed is what is checked: the
last timed iteration's outputs are checked against its own input set, and then one more run of
the very same calls (same closure, same graph, same input tensors, now holding fresh token
values) is checked with poisoned outputs. Rank 0 gathers the samples, turns them into rows
(epbench/metrics.py) and writes them before the next point starts.

``--tokens`` repeats everything per batch size (one backend object per size: the padding of
low-latency buffers is the batch size). In low-latency mode each point is timed up to three
times for a backend that supports CUDA graphs: plain launches, replays of one captured graph per
op holding one call (``graph``: what a standalone call costs, graph launch included), and replays
of one graph per op holding ``graph_chain`` back-to-back calls (``chain``: the per-call cost inside
a bigger graph, as in a decode step's); rows say which in ``timing`` (and K in ``chain``), and
each way is verified on its own.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, replace
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from epbench import counters as hw
from epbench import metrics, options, stall
from epbench.metrics import OPS, PointRecord, point_rows
from epbench.backends import load_backend
from epbench.backends.base import Backend
from epbench.contract import DispatchInput, DispatchOutput, LowLatencyOutput, RankSetup
from epbench.inputs import (dispatch_input, expert_output, fill_in_place, make_tokens, rotated_routing,
                            wire_input)
from epbench.launch import Comm
from epbench.results import unmeasured_rows
from epbench import timing
from epbench.timing import Timer
from epbench.routing import RankRouting, route_all, traffic
from epbench.scenario import GRAPH_CHAIN, Scenario
from epbench.verify import (CheckResult, check_combine, check_dispatch, check_ll_combine, check_ll_dispatch,
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
    # each point is timed once per entry: its timed calls rotate through that many input sets
    # (1: the same tensors with the same values every call); None: the scenario's bench.input_sets
    input_sets: Optional[Tuple[int, ...]] = None
    call_modes: Optional[Tuple[str, ...]] = None  # None: the scenario's bench.call_modes


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


def _fill_ll_expert_output(be: Backend, out: LowLatencyOutput, rank: int) -> None:
    """Every slot through the stand-in experts (padding too: reading the counts would be a host
    synchronisation before each timed call; the experts' factors are made once,
    verify.ll_expert_factors)."""
    e = out.x.shape[0]
    be.ll_combine_input(out).copy_(ll_expert_output(out.x, out.x_scales, rank * e))


def _check_backend_errors(be: Backend) -> None:
    check = getattr(be, "check_errors", None)
    if check is not None:
        check()


def _synchronize(comm: Comm) -> None:
    if comm.device.type == "cuda":
        with stall.region("a device synchronize"):
            torch.cuda.synchronize()


# ---- the inputs of a point ----

@dataclass(frozen=True)
class Draw:
    """One set of dispatch inputs, rebuilt identically on any rank: token values drawn from
    ``salt``; the scenario's routing (``rotation`` 0) or its tokens permuted
    (inputs.rotated_routing), which leaves every byte count unchanged."""

    salt: int
    rotation: int = 0


def timing_draws(input_sets: int, reuses_layout: bool) -> List[Draw]:
    """The sets the timed calls rotate through (iteration i uses set i mod n). Timing salts are 0,
    -1, -2, ...: never a verification's (1, 2, ...). A backend that reuses a layout keeps the routing."""
    return [Draw(TIMING_SALT - k, 0 if reuses_layout else k) for k in range(input_sets)]


class Inputs:
    """Every rank's inputs for any draw, rebuilt locally from (seed, rank, salt, rotation)."""

    def __init__(self, s: Scenario, routings: List[RankRouting], device: torch.device) -> None:
        self.s, self.routings, self.device = s, routings, device

    def routing(self, rank: int, d: Draw) -> RankRouting:
        return rotated_routing(self.routings[rank], self.s.routing.seed, rank, d.rotation)

    def source(self, rank: int, d: Draw) -> torch.Tensor:
        """bf16 rows before any quantization."""
        m = self.s.model
        return make_tokens(self.routings[rank].num_tokens, m.hidden, self.s.routing.seed, rank, d.salt, self.device)

    def caller(self, rank: int, d: Draw) -> DispatchInput:
        """What the caller hands to dispatch."""
        m = self.s.model
        return dispatch_input(self.source(rank, d), self.routing(rank, d), m.dispatch_dtype, self.device, m.quantize)

    def wire(self, rank: int, d: Draw) -> DispatchInput:
        """What the receivers must get."""
        return wire_input(self.caller(rank, d), self.s.model.dispatch_dtype)


# ---- the calls of a point and their checks ----

@dataclass
class PointCalls:
    """The two calls of one point as timed: plain calls or graph replays. ``load(inp)`` puts an
    input set in front of the next dispatch: a plain call is then made on ``inp``'s own tensors, a
    graph copies them into the tensors it was captured with. ``fill`` is the stand-in expert."""

    dispatch: Callable[[], Any]
    combine: Callable[[Any], Any]
    load: Callable[[DispatchInput], None]
    fill: Callable[[Any], None]
    gated: bool = False  # graph replays never wait for the device: the timer may gate them
    per_replay: int = 1  # calls of each op one dispatch() / combine() runs (a graph chain: K)
    gate_warmup: bool = True  # False: gated in the timed iterations only (plain launches: a first call
    # may load its kernels, which can wait on the host)


def _plain_calls(first: DispatchInput, dispatch: Callable[[DispatchInput], Any], combine: Callable[[Any], Any],
                 fill: Callable[[Any], None]) -> PointCalls:
    """Plain calls: each dispatch runs on the input set loaded last, through its own tensors."""
    state = {"inp": first}

    def load(inp: DispatchInput) -> None:
        state["inp"] = inp

    return PointCalls(lambda: dispatch(state["inp"]), combine, load, fill)


def _gate_launches(be: Backend, calls: PointCalls) -> PointCalls:
    """Switch gate_launches: plain launches of a backend whose calls never wait on the host are gated in
    their timed iterations, as graph replays are in all of theirs."""
    if be.host_free_calls and options.diagnostic("gate_launches"):
        calls.gated, calls.gate_warmup = True, False
    return calls


def normal_calls(be: Backend, first: DispatchInput, sms: int, rank: int) -> PointCalls:
    def fill(out: DispatchOutput) -> None:
        _fill_expert_output(be, out, rank)
        be.prepare_combine(out)

    return _gate_launches(be, _plain_calls(first, lambda inp: be.dispatch(inp, sms),
                                           lambda out: be.combine(out, sms), fill))


def launch_calls(be: Backend, first: DispatchInput, sms: int, rank: int) -> PointCalls:
    return _gate_launches(be, _plain_calls(first, lambda inp: be.ll_dispatch(inp, sms),
                                           lambda out: be.ll_combine(out, sms),
                                           lambda out: _fill_ll_expert_output(be, out, rank)))


def graph_calls(be: Backend, first: DispatchInput, sms: int, rank: int, chain: int = 1) -> PointCalls:
    """Captures ``chain`` back-to-back ll_dispatch calls into one CUDA graph and as many
    ll_combine calls into another (nothing runs while capturing); every call replays one of them on
    the current stream. Each captured call does its full work on the same inputs and outputs, so
    what a replay leaves is the last call's output. The graphs own their input tensors: ``load``
    copies an input set into them."""
    static = DispatchInput(first.x.clone(), first.x_scales.clone() if first.x_scales is not None else None,
                           first.topk_idx.clone(), first.topk_weights.clone())
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

    return PointCalls(dispatch, combine, lambda inp: fill_in_place(static, inp),
                      lambda o: _fill_ll_expert_output(be, o, rank), gated=True, per_replay=chain)


def ll_calls(be: Backend, first: DispatchInput, sms: int, rank: int, how: str, chain: int) -> PointCalls:
    """The calls one low-latency timing mode times and verifies."""
    if how == "launch":
        return launch_calls(be, first, sms, rank)
    return graph_calls(be, first, sms, rank, chain if how == "chain" else 1)


@dataclass
class Checks:
    """How one mode's outputs are checked against a draw."""

    dispatch: Callable[[Any, Draw], CheckResult]
    combine: Callable[[torch.Tensor, Any, Draw], CheckResult]
    first_row: Callable[[Any], Any]  # where --inject-fault flips a received row (None: no row)


def normal_checks(be: Backend, s: Scenario, inputs: Inputs, comm: Comm) -> Checks:
    m = s.model

    def dispatch(out: DispatchOutput, d: Draw) -> CheckResult:
        return check_dispatch(out, comm.rank, comm.world, m.experts_per_rank, lambda r: inputs.wire(r, d),
                              local_expert_ids=be.receives_local_expert_ids, routing_map=be.routing_as_map,
                              source_of=(lambda r: inputs.source(r, d)) if m.dispatch_dtype != "bf16" else None)

    def combine(got: torch.Tensor, out: DispatchOutput, d: Draw) -> CheckResult:
        wire = inputs.wire(comm.rank, d)
        # expert-major: one stand-in expert per expert (as in low-latency mode), so the sum is per expert
        roundings = be.combine_roundings()  # bf16 roundings the backend's combine path makes
        if out.expert_major is not None:
            return check_ll_combine(got, wire, roundings)
        return check_combine(got, wire, comm.world, m.experts_per_rank, roundings)

    return Checks(dispatch, combine, _first_received_row)


def ll_checks(s: Scenario, inputs: Inputs, comm: Comm) -> Checks:
    m = s.model
    return Checks(lambda out, d: check_ll_dispatch(out, comm.rank, comm.world, m.experts_per_rank,
                                                   lambda r: inputs.caller(r, d)),
                  lambda got, out, d: check_ll_combine(got, inputs.caller(comm.rank, d)),
                  _first_valid_slot)


def snapshot(out: Any) -> Any:
    """A copy of a dispatch output's tensors (device copies only, no host wait): the backend's
    buffers are overwritten by its next calls, and the timed output is checked after the loop."""
    if not dataclasses.is_dataclass(out):
        return out.clone() if isinstance(out, torch.Tensor) else out
    kept = {}
    for f in dataclasses.fields(out):
        if f.name == "handle":
            continue
        v = getattr(out, f.name)
        kept[f.name] = v.clone() if isinstance(v, torch.Tensor) else snapshot(v) if dataclasses.is_dataclass(v) else v
    return replace(out, **kept)


def backend_notes(name: str, be: Any) -> List[str]:
    """The run's notes a backend (class or instance: an option may set it) brings with it: where it runs
    kernels on more SMs than the point's --sms (``Backend.sms_beyond``)."""
    beyond = getattr(be, "sms_beyond", None)
    return [f"backend {name}: {beyond}"] if beyond else []


@dataclass
class LastTimed:
    """The last timed iteration: its input set, its dispatch output (a copy) and combine output."""

    draw_index: int
    out: Any
    got: torch.Tensor


def _time_pair(comm: Comm, warmup: int, iters: int, calls: PointCalls,
               sets: List[DispatchInput], expert_each: bool = True) -> Tuple[Dict[str, List[float]], LastTimed]:
    """The timing loop of both modes: dispatch and combine alternate as in a model, each call
    preceded by the cross-rank sync; iteration i runs on input set i mod len(sets), loaded before
    the sync, and the stand-in expert's output is written between the calls: all outside the
    timed region. The last iteration's outputs are kept for checking.

    ``expert_each`` False (overlap): the stand-in expert runs after the first and the last dispatch
    only. Its kernels (a dequantize and scale over the whole receive buffer, on every SM) are no
    part of the communication, yet between the calls they ran beside the GEMM an overlap point
    measures; the combine calls between reduce the first iteration's expert output (their time does
    not depend on the values), and the last one, the one checked, its own dispatch's."""
    n = warmup + iters
    timers = {op: Timer(comm.device, n) for op in OPS}
    on_stream = bool(getattr(comm, "sync_on_stream", False))
    last: Optional[LastTimed] = None
    for i in range(n):
        if len(sets) > 1 or i == 0:  # one set: loaded once, the same tensors every call
            calls.load(sets[i % len(sets)])
        gated = calls.gated and (calls.gate_warmup or i >= max(warmup, 1))  # a first launch may load kernels
        out = timers["dispatch"].time(i, calls.dispatch, align=comm.sync, gated=gated,
                                      align_on_stream=on_stream)
        kept = snapshot(out) if i == n - 1 else None
        if expert_each or i in (0, n - 1):
            calls.fill(out)
        got = timers["combine"].time(i, lambda: calls.combine(out), align=comm.sync, gated=gated,
                                    align_on_stream=on_stream)
        if kept is not None:
            last = LastTimed((n - 1) % len(sets), kept, got)
    samples = {op: [t / calls.per_replay for t in timer.samples_us(warmup)] for op, timer in timers.items()}
    return samples, last


class Point:
    """One (backend, SM count, timing mode) point: its input sets, its calls and their checks.
    ``time`` runs the timed loop; ``verify`` checks the last timed iteration, then loads a fresh
    draw into input set 0's own tensors and checks one more run of the very same calls."""

    def __init__(self, be: Backend, s: Scenario, routings: List[RankRouting], sms: int, comm: Comm,
                 input_sets: int, how: str = "normal", chain: int = 1) -> None:
        self.be, self.comm, self.sms = be, comm, sms
        self.inputs = Inputs(s, routings, comm.device)
        self.draws = timing_draws(input_sets, be.reuses_layout)
        low_latency = how in ("launch", "graph", "chain")
        raw = [self.inputs.caller(comm.rank, d) for d in self.draws]
        if low_latency:
            self.sets = raw
            self.calls = ll_calls(be, raw[0], sms, comm.rank, how, chain)
            self.checks = ll_checks(s, self.inputs, comm)
        else:  # prepared outside the timed region, once per set
            self.sets = [be.prepare_input(inp, sms) for inp in raw]
            self.calls = normal_calls(be, self.sets[0], sms, comm.rank)
            self.checks = normal_checks(be, s, self.inputs, comm)
        self.low_latency = low_latency
        self.last: Optional[LastTimed] = None

    def time(self, warmup: int, iters: int, expert_each: bool = True) -> Dict[str, List[float]]:
        samples, self.last = _time_pair(self.comm, warmup, iters, self.calls, self.sets, expert_each)
        _check_backend_errors(self.be)
        return samples

    def count(self, cnt: hw.Counters, n: int, rec: PointRecord) -> None:
        """Untimed pass: the bytes the hardware saw leave this GPU during each op, summed over n
        calls on input set 0. Each call is fenced by device synchronisations so that the readings
        bracket it; the cross-rank sync happens before a reading, so its own few bytes are not
        counted."""
        totals: Dict[str, Dict[str, int]] = {op: {} for op in OPS}

        def add(op: str, before: Dict[str, int]) -> None:
            _synchronize(self.comm)
            for k, v in hw.delta(before, cnt.read()).items():
                totals[op][k] = totals[op].get(k, 0) + v

        self.calls.load(self.sets[0])
        for _ in range(n):
            self.comm.sync()
            _synchronize(self.comm)
            before = cnt.read()
            out = self.calls.dispatch()
            add("dispatch", before)
            self.calls.fill(out)
            self.comm.sync()
            _synchronize(self.comm)
            before = cnt.read()
            self.calls.combine(out)
            add("combine", before)
        _check_backend_errors(self.be)
        rec.counted, rec.counted_iters = totals, n
        rec.link_capacity_gbps = cnt.link_capacity_gbps

    def check_last(self) -> Tuple[CheckResult, CheckResult]:
        """The last timed iteration's outputs against its own input set."""
        last = self.last
        if last is None:
            return CheckResult(), CheckResult()
        d = self.draws[last.draw_index]
        return self.checks.dispatch(last.out, d), self.checks.combine(last.got, last.out, d)

    def verification_run(self, fresh: Draw, inject_fault: Optional[str]) -> Tuple[CheckResult, CheckResult]:
        be, comm, calls = self.be, self.comm, self.calls
        new = self.inputs.caller(comm.rank, fresh)
        # copy_ converts to the prepared form's dtypes; the routing is set 0's, so a layout a
        # backend prepared for set 0 still holds
        fill_in_place(self.sets[0], new)
        calls.load(self.sets[0])
        be.poison()
        comm.sync()
        out = calls.dispatch()
        _synchronize(comm)
        _check_backend_errors(be)
        where = self.checks.first_row(out) if inject_fault == "dispatch" else None
        if where is not None:
            out.x[where].view(torch.uint8).bitwise_xor_(0x5A)
        d = self.checks.dispatch(out, fresh)
        if where is not None:  # restore the row so that combine is checked on its own
            out.x[where].view(torch.uint8).bitwise_xor_(0x5A)
        calls.fill(out)
        comm.sync()
        got = calls.combine(out)
        _synchronize(comm)
        _check_backend_errors(be)
        if inject_fault == "combine" and got.shape[0] > 0:
            got[0].fill_(1234.0)
        return d, self.checks.combine(got, out, fresh)


def _first_received_row(out: DispatchOutput) -> Optional[int]:
    """A valid row of the dispatch output (a host read: only used by --inject-fault): the first
    row that holds one, or in the expert-major layout the first row of the first non-empty segment."""
    if out.expert_major is None:
        if out.row_key is not None:
            held = (out.row_key[: int(out.num_recv)] >= 0).nonzero().flatten()
            return int(held[0]) if held.numel() else None
        return 0 if int(out.num_recv) > 0 else None
    counts = out.expert_major.counts.tolist()
    e = next((i for i, c in enumerate(counts) if c > 0), None)
    return int(out.expert_major.offsets[e]) if e is not None else None


def _first_valid_slot(out: LowLatencyOutput) -> Optional[Tuple[int, int]]:
    """(expert, slot) of one received row, or None when nothing arrived (a host read: only
    used by --inject-fault)."""
    src = out.src_counts.cpu()
    for e in range(src.shape[0]):
        for s in range(src.shape[1]):
            if int(src[e, s]) > 0:
                return e, s * out.max_tokens_per_rank
    return None


def measure_point(point: Point, warmup: int, iters: int, salt: int, inject_fault: Optional[str],
                  rec: PointRecord, cnt: Optional[hw.Counters] = None, counted_iters: int = 0) -> None:
    """Times the point, checks its last timed iteration, reads the counters (where given), then
    checks a verification run of the same calls on the same tensors. rec.wrong counts the wrong
    rows of both checks; rec.problem names the first problem of each, and which run had it."""
    rec.samples_us = point.time(warmup, iters)
    finish_point(point, salt, inject_fault, rec, cnt, counted_iters)


def finish_point(point: Point, salt: int, inject_fault: Optional[str], rec: PointRecord,
                 cnt: Optional[hw.Counters] = None, counted_iters: int = 0) -> None:
    """Everything after the timed loop (see measure_point)."""
    timed = point.check_last()
    if cnt is not None:
        point.count(cnt, counted_iters, rec)
    fresh = Draw(salt)
    verified = point.verification_run(fresh, inject_fault)
    rec.wrong, rec.problem = {}, {}
    for op, t, v in zip(OPS, timed, verified):
        rec.wrong[op] = t.wrong + v.wrong
        rec.problem[op] = "; ".join(f"{what}: {r.first_problem}" for what, r in
                                    (("last timed call", t), ("verification run", v)) if r.first_problem)


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


def call_modes_of(be: Any, asked: Tuple[str, ...]) -> Tuple[str, ...]:
    """The call modes a backend's points are timed in: the asked ones it has (``be``: the backend as
    built, for the mode it was built for; or its class, before it is built), and "call" for a backend
    that has only that way (how a model calls it)."""
    have = tuple(m for m in asked if m in be.call_modes)
    return have or ("call",)


def runs_as_normal(be_cls: Optional[type], mode: str) -> bool:
    """True for a normal-mode-only backend in a low-latency run: it then times its normal path on
    the same batch (rows labelled timing "normal"), beside the low-latency kernels."""
    return (mode == "low_latency" and be_cls is not None and "normal" in be_cls.modes
            and "low_latency" not in be_cls.modes)


def mode_reason(be_cls: Optional[type], mode: str) -> Optional[str]:
    """Why ``be_cls`` is skipped in a run of ``mode`` (None: it runs, a normal-mode backend in a
    low-latency run by its normal path, runs_as_normal): the ranks' rule, and the launcher's
    before it starts them (cli.unrunnable_reason)."""
    if be_cls is None or mode in be_cls.modes or runs_as_normal(be_cls, mode):
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


OnVariants = Callable[[str, List[Dict[str, Any]]], None]  # (backend, its point_variants)


def point_variants(variants: List[Tuple[str, str, int]], low_latency: bool) -> List[Dict[str, Any]]:
    """The ways each (SM count, batch size) point of a backend is timed, (call mode, timing, input
    sets) each, as the columns of its rows name them (timing: low-latency rows only)."""
    return [dict(call_mode=c, input_sets=n, **({"timing": h} if low_latency else {})) for c, h, n in variants]


def measure(s: Scenario, opts: RunOptions, comm: Comm,
            on_point: Callable[[List[Dict[str, Any]], List[Dict[str, Any]]], None],
            on_note: Callable[[str], None],
            advance: Callable[[str], None],
            ceilings: Optional[Dict[str, Any]] = None,
            on_variants: Optional[OnVariants] = None) -> int:
    """Runs every point on every rank, for each batch size of ``opts.tokens``. Rank 0's
    callbacks receive rows; returns the number of wrong rows summed over ranks and points.
    ``ceilings`` were measured for the scenario's own batch size; rows of others get none.
    ``on_variants`` (rank 0) hears the variants of each backend's points before they are timed
    (point_variants), so that a job that dies mid-point can have every point it lost recorded."""
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
        total_wrong += _measure_size(sized, replace(opts, input_sets=opts.input_sets or s.bench.input_sets), comm, on_point, on_note, advance, own_ceilings, cnt,
                                     salt, functional, on_variants)
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
                  salt: List[int], functional: Optional[str] = None,
                  on_variants: Optional[OnVariants] = None) -> int:
    """Every backend and SM count at one batch size; ``salt[0]`` advances per verified point.
    ``functional``: why no byte crosses a link in this run (its rows then carry no link figures)."""
    m = s.model
    low_latency = s.mode == "low_latency"
    routings = route_all(s)
    device = comm.device.type
    setup = rank_setup(s, comm)
    em_rows = (metrics.expert_major_rows(routings, m.experts_per_rank, m.align)
               if m.layout == "expert_major" else None)
    total_wrong = 0
    for name in opts.backends:
        be_cls, reason = load_backend(name)
        as_normal = runs_as_normal(be_cls, s.mode)
        be_setup = replace(setup, mode="normal") if as_normal else setup
        comm.arrive(f"{name}: availability check")
        reason = _first_reason(reason or mode_reason(be_cls, s.mode)
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
        timings, no_chain = timings_of(be_cls, be_setup, device, as_normal, opts.graph_chain)

        def variants_of(has_modes: Any) -> List[Tuple[str, str, int]]:
            return [(c, h, n) for c in call_modes_of(has_modes, opts.call_modes or s.bench.call_modes)
                    for h in timings for n in opts.input_sets]

        # the class's variants first, so that a job dying while it builds the backend (its buffers: a CPU
        # rank's peak) has them recorded; then the instance's, which may have fewer call modes
        if on_variants is not None and comm.rank == 0:
            on_variants(name, point_variants(variants_of(be_cls), low_latency))
        be = be_cls(be_setup, **s.backend_options.get(name, {}))
        for note in backend_notes(name, be):
            on_note(note)
        ll_path = low_latency and not as_normal  # this backend's own low-latency calls
        if ll_path:
            tr = metrics.pair_traffic(routings, m.experts_per_rank, s.topology.gpus_per_node)
        else:
            tr = traffic(routings, m.experts_per_rank, s.topology.gpus_per_node, be_cls.hierarchical)
        if no_chain:
            on_note(f"backend {name}: no chain rows ({no_chain})")
        variants = variants_of(be)
        if on_variants is not None and comm.rank == 0:
            on_variants(name, point_variants(variants, low_latency))
        try:
            for sms in sms_list:
                for mode, how, sets in variants:
                    comm.arrive(f"{name} sms={sms or 'auto'}: timed calls")
                    be.use_call_mode(mode)
                    rec = PointRecord(comm.rank, timing=how, input_sets=sets, call_mode=mode)
                    point = Point(be, s, routings, sms, comm, sets, how if ll_path else "normal",
                                  opts.graph_chain)
                    rec.chain = point.calls.per_replay
                    counting = cnt is not None and not low_latency
                    measure_point(point, opts.warmup, opts.iters, salt[0], opts.inject_fault, rec,
                                  cnt if counting else None, min(COUNTED_ITERS, opts.iters))
                    del point  # its input sets and graphs go before the next point's are made
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
