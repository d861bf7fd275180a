"""``epbench overlap``: what dispatch/combine cost the computation running beside them, and back.

Why: a backend's SM count matters because the other SMs run the expert GEMMs at the same time.
For each backend and SM count k, one run measures on every rank:

1. dispatch and combine alone (the driver's own timing loop, ``driver.Point.time``);
2. the GEMM alone on all SMs;
3. the GEMM confined to the SMs left: a CUDA green context of ``total - k`` SMs (as many as the
   driver grants: its count is read back with ``cuCtxGetDevResource`` and recorded), with cuBLAS
   told its SM count (``torch._C._set_sm_carveout_experimental``: otherwise it plans persistent
   kernels for every SM and the GEMM loses far more than its SMs);
4. both at once: the GEMM loop on the green context's stream and the communication loop (the
   same ``Point.time``) on a side stream of the primary context, launched with k blocks; both
   streams start at one event. The GEMM loop is sized to outlast the communication loop, so
   every communication call runs beside a GEMM.

The communication loops (1 and 4) write the stand-in expert's output after their first and last
dispatch only (``driver._time_pair``, ``expert_each`` False; ``EXPERT_IN_LOOP`` in meta.json): its
kernels dequantize and scale the whole receive buffer on every SM, and beside the GEMM they shared its
SMs and HBM between the calls (until 2026-11-27 they ran after every dispatch; what that cost the GEMM
is not yet measured apart: notes/OVERLAP.md).

Partitions. The GEMM's SMs are disjoint from nothing by construction: the communication runs in
the primary context, which may place its k blocks anywhere (the issue's "give the communication
the primary context and confine only the GEMM"). A GEMM kernel fills its SMs' shared memory, so
the k blocks in practice run on the SMs the green context leaves free. Two green contexts are
never made: torch builds each from the whole device, so a k-SM one and a (total-k)-SM one would
overlap instead of splitting the GPU.

Figures per point (``kept`` = 100 x alone time / time beside; 100 = no slowdown):

- ``gemm_kept_pct``: the GEMM's time alone on all SMs over its time per GEMM beside the
  communication loop (GEMMs wholly inside that loop); ``gemm_kept_of_confined_pct`` the same
  against the GEMM alone in its partition (what interference costs beyond the SMs taken);
  ``gemm_kept_in_calls_pct`` the kept % while a call ran, derived (``kept_in_calls_pct``);
  ``gemm_kept_of_window_pct`` against the GEMM alone in its partition for as many GEMMs as the pair
  ran, right after it (``gemm_window_us``), ``gemm_kept_of_around_pct`` against the mean of that and
  the same GEMM loop right before the pair (``gemm_before_us``; the pair sits between the two, each
  as long as it): the confined figure above times a 20-GEMM burst, which
  on 4 x H200 ran at the idle GPU's 1965-1980 MHz where the pair windows (90-190 ms) ran at
  1515-1875 under the power cap (2026-11-27), so the burst is no like-for-like reference.
- the SM clock, power and clock-limit reasons of each phase (``clocks.py``, NVML every 5 ms):
  ``gemm_confined_*``, ``gemm_before_*``, ``gemm_window_*``, ``comm_alone_*``, ``pair_*``, ``gemm_all_*``;
  ``gemm_clock_kept_pct`` = the pair's SM clock over the window's.
- ``dispatch_kept_pct`` / ``combine_kept_pct`` / ``comm_kept_pct`` (their sum): the driver's
  median alone over the median beside.
- ``comm_busy_pct``: the share of the loop's span in which a communication call ran (the timing
  loop sleeps ``timing.lead_us()`` before each call); the GEMM kept above is over that span.
- the pair: the same work (``gemm_count`` GEMMs and the communication loop) ``sum_us`` = one after
  the other alone, ``max_us`` = perfectly hidden, ``pair_us`` = as measured together (from the
  start event to the end of both). ``exposed_us = pair_us - gemm_count x gemm_all_us``: how much
  longer the GEMMs took to finish because the communication ran beside them.

A calibration row (backend ``copy``) does the same with a plain copy kernel of k blocks
(csrc/ceiling.cu's store kernel into a local buffer, the scenario's dispatch bytes), so the
interference a communication kernel causes can be told apart from what any k-block copy causes.
Across links (world > 1, a GPU per rank) a second one (backend ``copy-link``) runs the same kernel
into the peers' buffers (ceiling.PeerBuffers): each rank's dispatch bytes for each peer, over the
link, without the dispatch's layout, flags or local rows; each receiver checks the bytes it got.
The launcher starts one job per python the backends need (launcher.jobs_by_flavor: a DeepEP
flavor's backend from its own venv), all into one run folder; the first job measures the copy rows
(``OverlapOptions.calibrate``), so the folder holds them once per SM count.

Checks: the communication keeps its normal verification (``driver.finish_point`` after the
point: the last timed call's outputs, and a verification run of the same calls); the GEMM's output from inside the concurrent window (its buffer poisoned before) is
compared with the GEMM's output alone, so a broken concurrent schedule cannot pass.

Pitfalls avoided here: a GEMM launched on an ordinary stream while a green context is current is
not confined, so it goes to the context's own stream; epbench's kernels library changes the
current CUDA context, so no backend call happens between ``set_context`` and ``pop_context``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

from epbench import cudart
from epbench.errors import UserError

OPS = ("dispatch", "combine")
SQUARE_DEFAULT = "8192,8192,8192"
EXPERT_INTERMEDIATE = 2048  # DeepSeek-V3's moe_intermediate_size, unless --gemm experts:N
CARVEOUT_API = "torch._C._set_sm_carveout_experimental"
PARTITION = "GEMM: green context of the SMs left; communication: primary context, k blocks"
LINK_COPY = "copy-link"  # the calibration across the links (metrics.CALIBRATIONS)
SHARED_GPU_NOTE = ("ranks share a GPU: the interference measured is SMs and HBM only "
                   "(no link is crossed)")
GEMM_LOOP_MARGIN = 1.5  # the GEMM loop is sized to this many times the communication loop alone
GEMM_LOOP_MAX = 4000
GEMM_RTOL = 2e-2  # bf16 outputs of differently scheduled GEMMs differ by rounding only


# -- arithmetic (no GPU) ------------------------------------------------------------------------

def kept_pct(alone_us: Optional[float], beside_us: Optional[float]) -> Optional[float]:
    """100 x alone / beside: the share of its own speed a kernel keeps; None if either is missing."""
    if alone_us is None or beside_us is None or not alone_us > 0 or not beside_us > 0:
        return None
    return 100.0 * alone_us / beside_us


def pair_figures(gemm_total_us: float, comm_total_us: float, pair_us: float) -> Dict[str, float]:
    """The same work three ways: ``sum_us`` (one after the other, each alone on all the SMs it
    had), ``max_us`` (perfectly overlapped), ``pair_us`` (as measured together). ``exposed_us``
    = pair - GEMM alone: the communication's cost to the GEMMs' finishing time;
    ``hidden_pct`` = the share of the communication that overlap hid (100 = pair equals max,
    0 = pair equals sum)."""
    s, m = gemm_total_us + comm_total_us, max(gemm_total_us, comm_total_us)
    hidden = 100.0 * (s - pair_us) / (s - m) if s > m else None
    return {"sum_us": s, "max_us": m, "pair_us": pair_us, "exposed_us": pair_us - gemm_total_us,
            "hidden_pct": hidden}


def kept_in_calls_pct(all_us: float, confined_us: float, beside_us: float,
                      busy: Optional[float]) -> Optional[float]:
    """The GEMM's kept % while a communication call ran, derived from its rate over the whole
    loop (``beside_us`` per GEMM) on the assumption that between calls (``100 - busy`` % of the
    loop, where the timing loop sleeps) it ran as fast as alone in its partition:
    rate_loop = d x rate_calls + (1 - d) x rate_confined, d = busy / 100. None without a busy
    share or when the figures contradict the assumption (a negative rate)."""
    if busy is None or not busy > 0 or not (all_us > 0 and confined_us > 0 and beside_us > 0):
        return None
    d = busy / 100.0
    rate = (1.0 / beside_us - (1.0 - d) / confined_us) / d
    return 100.0 * rate * all_us if rate > 0 else None


def inside(spans: Sequence[Tuple[float, float]], lo: float, hi: float) -> List[Tuple[float, float]]:
    """The (start, end) spans that lie wholly within [lo, hi]."""
    return [(a, b) for a, b in spans if a >= lo and b <= hi]


def gemm_loop_count(comm_loop_us: float, gemm_us: float) -> int:
    """GEMMs enough to outlast the communication loop (which slows down beside them)."""
    if not gemm_us > 0:
        raise ValueError("GEMM time must be positive")
    return max(3, min(GEMM_LOOP_MAX, math.ceil(GEMM_LOOP_MARGIN * comm_loop_us / gemm_us) + 2))


EXPERT_IN_LOOP = "after each loop's first and last dispatch"  # driver._time_pair, expert_each False
# The cross-rank alignment before each timed call of an overlap loop (launch.Comm.sync), unless switch
# align (EPBENCH_ALIGN) is set: a one-element NCCL all-reduce. `run`'s default, a one-element-per-peer
# all-to-all, launches blocks that wait for SMs the GEMM holds: on 4 x H200 at 4 ranks and 8 or 12 SMs
# (12 SMs left free beside a 120-SM GEMM) the loop's gaps grew from 0.4 to 2.8 ms an iteration beside
# the GEMM, 0.6 with the all-reduce; 2 ranks (one peer) and 16 SMs (20 free) never showed it
# (2026-11-27, notes/OVERLAP.md).
OVERLAP_ALIGN = "allreduce"
PAIR_TRIES = 3  # pair windows at most per point: the GEMM loop regrown while it ended before the communication


def regrown_count(n: int, gemm_end_us: float, comm_end_us: float) -> int:
    """A GEMM loop long enough to cover a communication loop that ran ``comm_end_us`` where ``n``
    GEMMs ended at ``gemm_end_us``: the loop sized from the communication's span alone falls short
    where its calls slow down beside the GEMMs by more than the margin (DeepEP V2's call-mode combine
    took 1.8x its alone time beside an 8192^3 GEMM on 2 x H200)."""
    if not gemm_end_us > 0:
        raise ValueError("GEMM loop end must be positive")
    return min(GEMM_LOOP_MAX, max(n + 1, math.ceil(n * GEMM_LOOP_MARGIN * comm_end_us / gemm_end_us) + 2))


LATE_START_FRACTION = 0.1  # a communication loop starting later than this share of the pair is flagged


def schedule_problem(gemm_count: int, covered: bool, comm_start_us: float, pair_us: float) -> Optional[str]:
    """Why a point's pair window does not measure overlap, or None: the GEMM loop hit its cap (the
    communication loop alone took far longer than its calls: a first-call cost such as a library
    compiling its kernels), the communication loop started late (the host was still queueing
    GEMMs), or the GEMMs ended before it (it ran partly alone)."""
    said = []
    if gemm_count >= GEMM_LOOP_MAX:
        said.append(f"GEMM loop at its cap of {GEMM_LOOP_MAX}: the communication loop alone outlasted that many GEMMs")
    if pair_us > 0 and comm_start_us > max(1000.0, LATE_START_FRACTION * pair_us):
        said.append(f"the communication loop started {comm_start_us / 1e3:.1f} ms into the pair window "
                    f"(the host was still queueing GEMMs)")
    if not covered:
        said.append("the GEMM loop ended before the communication loop")
    return "; ".join(said) or None


def busy_pct(op_us: Iterable[float], calls: int, span_us: float) -> Optional[float]:
    """Share of a loop's span spent inside its calls (mean call time x calls / span)."""
    op_us = list(op_us)
    if not op_us or not span_us > 0:
        return None
    return min(100.0, 100.0 * sum(op_us) / len(op_us) * calls / span_us)


@dataclass(frozen=True)
class GemmSpec:
    """``square``: one M x N x K bf16 GEMM; ``experts``: the rank's local experts' GEMMs, each
    routed-token-count x hidden x ``intermediate``."""

    kind: str  # "square" | "experts"
    m: int = 0
    n: int = 0
    k: int = 0
    intermediate: int = EXPERT_INTERMEDIATE

    def describe(self) -> str:
        if self.kind == "square":
            return f"bf16 {self.m}x{self.n}x{self.k}"
        return f"bf16 experts x hidden x {self.intermediate}"


def parse_gemm(text: Optional[str]) -> GemmSpec:
    """``M,N,K``, ``experts`` or ``experts:INTERMEDIATE``; UserError otherwise."""
    text = (text or SQUARE_DEFAULT).strip()
    if text == "experts" or text.startswith("experts:"):
        inter = text.split(":", 1)[1] if ":" in text else str(EXPERT_INTERMEDIATE)
        if not inter.isdigit() or int(inter) < 1:
            raise UserError(f"--gemm: experts:N needs a positive intermediate size, got {text!r}")
        return GemmSpec("experts", intermediate=int(inter))
    parts = [p.strip() for p in text.split(",")]
    if len(parts) != 3 or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise UserError(f"--gemm: give M,N,K (three positive integers), experts or experts:N; "
                        f"got {text!r}")
    m, n, k = map(int, parts)
    return GemmSpec("square", m, n, k)


def check_sms(sms: Sequence[int], total: int, min_gemm: int = 1) -> None:
    """The communication's k and the GEMM's total - k must both be at least one SM."""
    for k in sms:
        if k < 1 or total - k < min_gemm:
            raise UserError(f"--sms: {k} leaves the GEMM {total - k} of {total} SMs; give "
                            f"counts between 1 and {total - min_gemm}")


# -- rows ----------------------------------------------------------------------------------------

def point_row(base: Dict[str, Any], gemm: Dict[str, Any], alone: Dict[str, float],
              beside: Dict[str, float]) -> Dict[str, Any]:
    """One rank's figures for one (backend, SMs) point from its raw times. ``gemm`` holds
    ``gemm_all_us``, ``gemm_confined_us``, ``gemm_beside_us``, ``gemm_count``, ``pair_us``;
    ``alone``/``beside`` map each communication op (and ``loop``: the loop's span) to us."""
    ops = [op for op in alone if op != "loop"]
    comm_alone = sum(alone[op] for op in ops)
    comm_beside = sum(beside[op] for op in ops)
    row = dict(base, **gemm)
    for op in ops:
        row[f"{op}_alone_us"] = alone[op]
        row[f"{op}_beside_us"] = beside[op]
        row[f"{op}_kept_pct"] = kept_pct(alone[op], beside[op])
    row.update(comm_alone_us=comm_alone, comm_beside_us=comm_beside,
               comm_kept_pct=kept_pct(comm_alone, comm_beside),
               gemm_kept_pct=kept_pct(gemm["gemm_all_us"], gemm["gemm_beside_us"]),
               gemm_kept_of_confined_pct=kept_pct(gemm["gemm_confined_us"], gemm["gemm_beside_us"]),
               gemm_kept_in_calls_pct=kept_in_calls_pct(gemm["gemm_all_us"], gemm["gemm_confined_us"],
                                                        gemm["gemm_beside_us"],
                                                        gemm.get("comm_busy_pct")),
               comm_loop_alone_us=alone["loop"], comm_loop_beside_us=beside["loop"])
    row.update(pair_figures(gemm["gemm_count"] * gemm["gemm_all_us"], alone["loop"], gemm["pair_us"]))
    return row


# -- GPU pieces ---------------------------------------------------------------------------------

def set_carveout(n: Optional[int]) -> Optional[str]:
    """Tells cuBLAS to leave ``n`` SMs out of its plans (None: none); returns the API used, or
    None when this torch has none (recorded with the result)."""
    import torch

    fn = getattr(torch._C, "_set_sm_carveout_experimental", None)
    if fn is None:
        return None
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fn(n)
    return CARVEOUT_API


class Partition:
    """A green context of ``want`` SMs for the GEMM, its stream and the driver's count."""

    def __init__(self, want: int, device_index: int) -> None:
        import torch
        from torch.cuda import green_contexts as gc

        if not getattr(gc, "SUPPORTED", False):
            raise RuntimeError("this torch was built without CUDA green context support")
        self.want = want
        self.ctx = gc.GreenContext.create(num_sms=want, device_id=device_index)
        s = self.ctx.Stream()  # torch 2.11 returns a torch.Stream; torch.cuda.stream() wants this
        self.stream = s if isinstance(s, torch.cuda.Stream) else torch.cuda.Stream(
            stream_id=s.stream_id, device_index=s.device_index, device_type=s.device_type)
        self.ctx.set_context()
        try:
            self.sms = cudart.current_context_sms()
        finally:
            self.ctx.pop_context()
        self.device = torch.device("cuda", device_index)

    def run(self, fn: Callable[[], Any]) -> Any:
        """``fn`` with the green context current and its stream the current stream. Nothing of
        epbench's kernels library may run here (it switches the current context)."""
        import torch

        self.ctx.set_context()
        try:
            with torch.cuda.stream(self.stream):
                return fn()
        finally:
            self.ctx.pop_context()


def disjoint_partition(free: int, device_index: int) -> Partition:
    """The largest green context the driver grants within ``free`` SMs. The driver rounds a
    request up to its SM-group size (H100: 124 asked, 128 given), which would let the GEMM's
    partition overlap the communication's SMs; asking again for less keeps them disjoint."""
    want = free
    while True:
        p = Partition(want, device_index)
        if p.sms <= free or want <= 1:
            return p
        want -= p.sms - free


class Gemm:
    """The computation beside the communication, writing into one preallocated output that
    the check poisons first (a launch that never ran cannot leave a correct result behind)."""

    def __init__(self, spec: GemmSpec, device: Any, hidden: int,
                 expert_tokens: Optional[Sequence[int]] = None) -> None:
        import torch

        g = torch.Generator(device=device).manual_seed(1234)
        bf = torch.bfloat16
        self.spec = spec
        if spec.kind == "square":
            self.a = torch.randn(spec.m, spec.k, device=device, dtype=bf, generator=g)
            self.b = torch.randn(spec.k, spec.n, device=device, dtype=bf, generator=g)
            self.out = torch.empty(spec.m, spec.n, device=device, dtype=bf)
            self.flops = 2.0 * spec.m * spec.n * spec.k
            self.groups: List[Tuple[int, int, int]] = []  # (expert, first row, end row)
        else:
            counts = [int(c) for c in (expert_tokens or [])]
            rows = sum(counts)
            if rows == 0:
                raise UserError("--gemm experts: no token is routed to this rank's experts")
            self.a = torch.randn(rows, hidden, device=device, dtype=bf, generator=g)
            self.b = torch.randn(max(len(counts), 1), hidden, spec.intermediate, device=device,
                                 dtype=bf, generator=g) / math.sqrt(hidden)
            self.out = torch.empty(rows, spec.intermediate, device=device, dtype=bf)
            offs = [0]
            for c in counts:
                offs.append(offs[-1] + c)
            self.groups = [(e, offs[e], offs[e + 1]) for e in range(len(counts)) if counts[e]]
            self.flops = 2.0 * sum(counts) * hidden * spec.intermediate
            self.offs = torch.tensor(offs[1:], dtype=torch.int32, device=device)
            self.grouped = grouped_mm_works(self)
        self.impl = "torch.mm" if spec.kind == "square" else \
            ("torch._grouped_mm" if self.grouped else "torch.mm per expert")

    @property
    def launches(self) -> int:
        """Kernels one call queues (the host's share of the loop's lead)."""
        if self.spec.kind == "square":
            return 1
        return 2 if self.grouped else max(1, len(self.groups))

    def __call__(self) -> None:
        import torch

        if self.spec.kind == "square":
            torch.mm(self.a, self.b, out=self.out)
        elif self.grouped:  # one grouped GEMM (what MoE layers launch), then into the poisoned output
            self.out.copy_(torch._grouped_mm(self.a, self.b, offs=self.offs))
        else:
            self.per_expert()

    def per_expert(self) -> None:
        """One torch.mm per expert: where torch._grouped_mm is missing or refuses the shapes. Its
        launches may outpace the GPU's work (about 10 us of host per expert), so the loop can be host-bound."""
        import torch

        for e, lo, hi in self.groups:
            torch.mm(self.a[lo:hi], self.b[e], out=self.out[lo:hi])

    def poison(self) -> None:
        self.out.fill_(float("nan"))

    def wrong(self, reference: Any) -> int:
        """Elements of the output beyond rounding of the reference (NaN counts as wrong)."""
        return elements_off(self.out, reference)


def elements_off(out: Any, reference: Any) -> int:
    """Elements of ``out`` beyond rounding of ``reference`` (GEMM_RTOL; NaN, a poisoned element, counts)."""
    ref = reference.float()
    tol = GEMM_RTOL * (ref.abs() + ref.abs().max().clamp(min=1e-6) * 1e-2)
    return int((~((out.float() - ref).abs() <= tol)).sum().item())


def expert_tokens(routings: Sequence[Any], rank: int, experts_per_rank: int) -> List[int]:
    """Routed token count of each of ``rank``'s experts, every source rank included."""
    import torch

    n = len(routings) * experts_per_rank
    ids = torch.cat([r.topk_idx.flatten() for r in routings])
    counts = torch.bincount(ids, minlength=n)
    return [int(c) for c in counts[rank * experts_per_rank:(rank + 1) * experts_per_rank]]


LAUNCH_US = 10.0  # host time to queue one GEMM kernel, generously


def lead(gemm: Gemm, n: int) -> None:
    """Device sleep on the current stream long enough for the host to queue ``n`` GEMMs, so
    that the loop's start and its per-GEMM times are the device's, not the host's."""
    from epbench import timing

    sleeps = math.ceil(n * gemm.launches * LAUNCH_US / timing.lead_us())
    for _ in range(max(2, min(2000, sleeps))):
        timing.host_lead()


def grouped_mm_works(gemm: Gemm) -> bool:
    """Whether torch._grouped_mm serves this experts GEMM (it exists, takes the shapes and agrees with one
    torch.mm per expert); checked once, untimed."""
    import torch

    fn = getattr(torch, "_grouped_mm", None)
    if fn is None:
        return False
    try:
        got = fn(gemm.a, gemm.b, offs=gemm.offs)
    except (RuntimeError, TypeError, ValueError, NotImplementedError):
        return False
    gemm.per_expert()
    return got.shape == gemm.out.shape and elements_off(got, gemm.out) == 0


def gemm_loop(gemm: Gemm, n: int, part: Optional[Partition], go: Any) -> List[Any]:
    """Queues ``n`` GEMMs back to back (in ``part``'s green context when given, else on a fresh
    stream of the primary context), starting once ``go`` fires. Returns n + 1 timing events of
    the primary context: the loop's start and the end of each GEMM.

    The events are recorded by an otherwise idle primary-context stream that waits for a marker
    after each GEMM: an event may only be recorded on a stream of its own context, while waiting
    on another context's event is allowed, so every timestamp can be compared with the
    communication's."""
    import torch

    marks: List[Any] = []

    def queue() -> None:
        torch.cuda.current_stream().wait_event(go)
        for i in range(n + 1):
            if i:
                gemm()
            marks.append(torch.cuda.Event())
            marks[-1].record()

    if part is not None:
        part.run(queue)
    else:
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            queue()
    observer = torch.cuda.Stream()
    stamps = [torch.cuda.Event(enable_timing=True) for _ in marks]
    with torch.cuda.stream(observer):
        for mark, stamp in zip(marks, stamps):
            observer.wait_event(mark)
            stamp.record()
    return stamps


def spans_us(stamps: Sequence[Any], origin: Any) -> List[Tuple[float, float]]:
    """(start, end) of each call in microseconds since ``origin``, from consecutive events."""
    t = [origin.elapsed_time(e) * 1e3 for e in stamps]
    return list(zip(t[:-1], t[1:]))


def time_gemm(gemm: Gemm, n: int, part: Optional[Partition]) -> float:
    """Median microseconds per GEMM, alone (on all SMs, or in ``part``)."""
    import torch

    from epbench import metrics

    go = torch.cuda.Event(enable_timing=True)
    lead(gemm, n)
    go.record()
    stamps = gemm_loop(gemm, n, part, go)
    torch.cuda.synchronize()
    return metrics.median([b - a for a, b in spans_us(stamps, go)])


@dataclass
class Window:
    """What one concurrent run measured on this rank (times since the common start)."""

    gemm_spans: List[Tuple[float, float]]
    comm_start: float
    comm_end: float
    comm_samples: Dict[str, List[float]]

    @property
    def gemm_end(self) -> float:
        return self.gemm_spans[-1][1]

    @property
    def covered(self) -> bool:
        """Whether the GEMM loop ran until the communication loop's last call had ended."""
        return self.gemm_end >= self.comm_end

    def gemm_beside_us(self) -> Tuple[float, bool]:
        """Median GEMM inside the communication loop (all GEMMs if none fits), and whether the
        GEMM loop covered the whole communication loop."""
        from epbench import metrics

        spans = inside(self.gemm_spans, self.comm_start, self.comm_end) or self.gemm_spans
        return metrics.median([b - a for a, b in spans]), self.covered

    @property
    def pair_us(self) -> float:
        return max(self.gemm_end, self.comm_end)


def concurrent(gemm: Gemm, n: int, part: Optional[Partition],
               comm_loop: Callable[[], Dict[str, List[float]]]) -> Window:
    """The GEMM loop (in ``part``) and the communication loop (primary context, side stream)
    from one start event; the GEMM's output is poisoned first."""
    import torch

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    go = torch.cuda.Event(enable_timing=True)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with torch.cuda.stream(side):
        gemm.poison()
        lead(gemm, n)
        go.record()
    stamps = gemm_loop(gemm, n, part, go)
    from epbench import timing

    timing.last_end(forget=True)
    with torch.cuda.stream(side):
        start.record()
        samples = comm_loop()
        end.record()
    torch.cuda.synchronize()
    # the loop ends where its last timed call ended: what it does after (reading its events, a check)
    # is no part of what the GEMMs must cover
    last = timing.last_end(forget=True) or end
    return Window(spans_us(stamps, go), go.elapsed_time(start) * 1e3, go.elapsed_time(last) * 1e3,
                  samples)


def comm_loop_alone(comm_loop: Callable[[], Dict[str, List[float]]]) -> Tuple[Dict[str, List[float]], float]:
    """The communication loop on its own: its samples and its span in microseconds."""
    import torch

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    samples = comm_loop()
    end.record()
    torch.cuda.synchronize()
    return samples, start.elapsed_time(end) * 1e3


# -- one rank under torchrun -------------------------------------------------------------------

@dataclass(frozen=True)
class OverlapOptions:
    backends: Tuple[str, ...]
    sms: Tuple[int, ...]
    warmup: int
    iters: int
    gemm: GemmSpec
    gemm_iters: int = 20  # GEMMs per alone measurement
    calibrate: bool = True  # the copy rows too (a run's first job: Plan.job_options)


def all_ranks(comm: Any) -> Callable[[bool], bool]:
    """``everyone(ok)``: True when every rank of ``comm`` passed True (a MIN all-reduce, so every
    rank must call it at the same point)."""
    import torch
    import torch.distributed as dist

    def everyone(ok: bool) -> bool:
        flag = torch.tensor([int(bool(ok))], dtype=torch.int64, device=comm.collective_device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        return bool(flag.item())

    return everyone


def gpu_shared(comm: Any) -> bool:
    """True when another rank of this job runs on the same GPU."""
    import socket

    import torch
    import torch.distributed as dist

    props = torch.cuda.get_device_properties(comm.device)
    me = (socket.gethostname(), str(getattr(props, "uuid", comm.device.index)))
    everyone: List[Any] = [None] * comm.world
    dist.all_gather_object(everyone, me)
    return len(set(everyone)) < len(everyone)


def _samples(backend: str, sms: int, rank: int, phase: str, samples: Dict[str, List[float]],
             call_mode: Optional[str] = None) -> List[Dict[str, Any]]:
    return [{"backend": backend, "call_mode": call_mode, "sms": sms, "rank": rank, "phase": phase, "op": op,
             "iter": i, "time_us": t} for op, ts in samples.items() for i, t in enumerate(ts)]


class _Point:
    """Measures one (backend or copy, SMs) point on this rank; ``loop`` is the communication
    loop (the driver's timing loop, or the copy kernel's)."""

    def __init__(self, gemm: Gemm, gemm_all_us: float, part: Optional[Partition], total: int,
                 opts: OverlapOptions, everyone: Callable[[bool], bool] = lambda ok: ok,
                 watch: Any = None, gemm_all_reading: Any = None) -> None:
        """``everyone(ok)``: True when ``ok`` holds on every rank (a collective: each rank asks it);
        ``watch``: a clocks.Watch sampling this GPU in each phase (None: clocks.NoWatch);
        ``gemm_all_reading``: its reading of the GEMM alone on all SMs (the clock alone without a partition)."""
        from epbench import clocks

        self.gemm, self.gemm_all_us, self.part, self.total, self.opts = gemm, gemm_all_us, part, total, opts
        self.everyone = everyone
        self.watch = watch if watch is not None else clocks.NoWatch()
        self.gemm_all_reading = gemm_all_reading or clocks.Reading()
        self.pair_reading = clocks.Reading()  # the last pair window's (pair())

    def pair(self, n: int, loop: Callable[[], Dict[str, List[float]]]) -> Tuple[int, "Window", int]:
        """The pair window, redone with a longer GEMM loop (every rank together, since the
        communication loop is collective) while the GEMMs ended before the communication on any
        rank: (GEMMs, window, windows run)."""
        for tries in range(1, PAIR_TRIES + 1):
            with self.watch.phase() as self.pair_reading:
                win = concurrent(self.gemm, n, self.part, loop)
            if self.everyone(win.covered or n >= GEMM_LOOP_MAX) or tries == PAIR_TRIES:
                return n, win, tries
            n = regrown_count(n, win.gemm_end, win.comm_end)
        raise AssertionError("unreachable")

    def measure(self, loop: Callable[[], Dict[str, List[float]]]) -> Tuple[Dict[str, Any], Dict[str, Any]]:
        import torch

        from epbench import clocks, metrics

        loop()  # untimed: a first call's cost (a library compiling its kernels, lazy loading) stays out
        torch.cuda.synchronize()
        with self.watch.phase() as comm_reading:
            alone_samples, alone_span = comm_loop_alone(loop)
        carveout = self.total - self.part.sms if self.part is not None else None
        api = set_carveout(carveout)
        try:
            confined_reading = self.gemm_all_reading
            confined = self.gemm_all_us
            if self.part is not None:
                with self.watch.phase() as confined_reading:
                    confined = time_gemm(self.gemm, self.opts.gemm_iters, self.part)
            n0 = gemm_loop_count(alone_span, confined)
            # the GEMM alone as long as the pair will run, right before it and again right after it (as many
            # GEMMs as the pair ran): the power cap's state is that of a long busy window, where the burst
            # above ran at the idle GPU's clock (clocks.py); the pair sits between the two
            with self.watch.phase() as before_reading:
                before = time_gemm(self.gemm, n0, self.part)
            n, win, tries = self.pair(n0, loop)
            with self.watch.phase() as window_reading:
                window = time_gemm(self.gemm, n, self.part)
        finally:
            set_carveout(None)
        beside_us, covered = win.gemm_beside_us()
        ops = list(alone_samples)
        calls = self.opts.warmup + self.opts.iters
        per_iter = [sum(v) for v in zip(*(win.comm_samples[op] for op in ops))]
        gemm = {"gemm_all_us": self.gemm_all_us, "gemm_confined_us": confined,
                "gemm_beside_us": beside_us, "gemm_count": n, "pair_us": win.pair_us,
                "gemm_covered": covered, "pair_tries": tries,
                "schedule_problem": schedule_problem(n, covered, win.comm_start, win.pair_us),
                "gemm_all_tflops": self.gemm.flops / self.gemm_all_us / 1e6,
                "gemm_beside_tflops": self.gemm.flops / beside_us / 1e6,
                "comm_busy_pct": busy_pct(per_iter, calls, win.comm_end - win.comm_start),
                "gemm_sms": self.part.sms if self.part is not None else self.total,
                "gemm_sms_wanted": self.part.want if self.part is not None else self.total,
                "sm_carveout": carveout, "carveout_api": api if carveout is not None else None,
                "gemm_window_us": window, "gemm_kept_of_window_pct": kept_pct(window, beside_us),
                "gemm_before_us": before, "gemm_kept_of_around_pct": kept_pct((before + window) / 2, beside_us),
                **before_reading.fields("gemm_before"),
                **confined_reading.fields("gemm_confined"), **comm_reading.fields("comm_alone"),
                **window_reading.fields("gemm_window"), **self.pair_reading.fields("pair"),
                "gemm_clock_kept_pct": clocks.clock_kept_pct(window_reading.sm_mhz, self.pair_reading.sm_mhz)}
        alone = {op: metrics.median(alone_samples[op]) for op in ops}
        alone["loop"] = alone_span
        beside = {op: metrics.median(win.comm_samples[op]) for op in ops}
        beside["loop"] = win.comm_end - win.comm_start
        raw = {"alone": alone_samples, "beside": win.comm_samples}
        return point_row({}, gemm, alone, beside), raw


def copy_loop(comm: Any, sms: int, nbytes: int, opts: OverlapOptions):
    """The calibration: csrc/ceiling.cu's store kernel copying ``nbytes`` into a local buffer
    with ``sms`` blocks, through the ceilings' timing; None when the kernels are not built.
    Returns (loop, check) where check() counts wrong bytes of the last copy."""
    import torch

    from epbench import ceiling

    provider = ceiling.kernel_store_provider()
    if provider is None:
        return None, None
    nbytes = max(16, nbytes // 16 * 16)
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=comm.device)
    dst = torch.empty_like(src)

    def loop() -> Dict[str, List[float]]:
        dst.fill_(0)
        return {"copy": provider({0: dst.data_ptr()}, {0: nbytes}, src, sms, comm, opts.warmup,
                                 opts.iters)}

    def check() -> int:
        return int((dst != src).sum().item())

    return loop, check


def link_plan(plan: List[List[int]]) -> List[List[int]]:
    """The dispatch's link bytes [source][destination] as the store kernel moves them: whole 16-byte
    vectors, nothing to a rank itself."""
    return [[0 if s == d else b // 16 * 16 for d, b in enumerate(row)] for s, row in enumerate(plan)]


def pattern(rank: int, nbytes: int, device: Any) -> Any:
    """The bytes rank ``rank`` sends in the link calibration, which every receiver can rebuild."""
    import torch

    return ((torch.arange(nbytes, device=device, dtype=torch.int64) * 7 + rank * 13 + 1) % 251).to(torch.uint8)


def link_copy_loop(comm: Any, sms: int, plan: List[List[int]], opts: OverlapOptions):
    """The calibration across the links: csrc/ceiling.cu's store kernel writing this rank's bytes for
    each peer (``plan``: link_plan of the dispatch) into that peer's buffer with ``sms`` blocks. Every
    rank calls it together (the buffers are opened through CUDA IPC). Returns (loop, check, close), or
    three None when the kernels are not built: check() counts the bytes this rank received wrong in
    the last copy, close() frees the buffers (every rank together)."""
    import torch
    import torch.distributed as dist

    from epbench import ceiling
    from epbench.cudart import Cudart

    provider = ceiling.kernel_store_provider()
    if provider is None:
        return None, None, None
    me, rt = comm.rank, Cudart()
    recv = sum(plan[src][me] for src in range(comm.world))
    bufs = ceiling.PeerBuffers(recv, comm, rt, dist)
    source = pattern(me, max(max(plan[me]), 16), comm.device)
    dst = {d: bufs.peers[d] + ceiling.recv_offsets(plan, d)[me] for d in bufs.peers if plan[me][d] > 0}
    nbytes = {d: plan[me][d] for d in dst}
    got = torch.empty(max(recv, 16), dtype=torch.uint8, device=comm.device)
    zeros = torch.zeros_like(source)

    def loop() -> Dict[str, List[float]]:
        # each sender clears its own regions first, in its stream's order (no host wait: the GEMMs beside are
        # queued), so the check reads the last loop's bytes only; the clearing copy (one iteration's bytes, by
        # the copy engine) is outside the timed calls but inside the loop's span
        stream = torch.cuda.current_stream(comm.device).cuda_stream
        for d, n in nbytes.items():
            rt.memcpy_async(dst[d], zeros.data_ptr(), n, stream)
        return {"copy": provider(dst, nbytes, source, sms, comm, opts.warmup, opts.iters)}

    def check() -> int:
        torch.cuda.synchronize(comm.device)
        dist.barrier()  # every sender's last copy has ended
        rt.memcpy_async(got.data_ptr(), bufs.local, recv, torch.cuda.current_stream(comm.device).cuda_stream)
        torch.cuda.synchronize(comm.device)
        offs = ceiling.recv_offsets(plan, me)
        return sum(int((got[offs[src]:offs[src] + plan[src][me]] != pattern(src, plan[src][me], comm.device)).sum())
                   for src in range(comm.world) if plan[src][me] > 0)

    def close() -> None:
        torch.cuda.synchronize(comm.device)
        dist.barrier()
        bufs.close()

    return loop, check, close


def measure(job: Any) -> int:
    """The overlap points of one job (session.Job) on this rank: the GEMM alone, then for each
    backend and SM count, and for the copy calibration (where the job's options ask for it), the
    point's figures (``_Point``) and its checks; rank 0 records each point's rows. Returns the
    wrong rows and GEMM elements summed over ranks (on every rank)."""
    import torch

    from epbench import clocks, driver, options
    from epbench.backends import load_backend
    from epbench.routing import route_all

    s, opts, comm = job.scenario, job.options, job.comm
    if s.mode != "normal":
        raise UserError(f"{s.source}: mode: overlap measures normal mode only (not {s.mode})")
    total = torch.cuda.get_device_properties(comm.device).multi_processor_count
    check_sms(opts.sms, total)
    m = s.model
    switches = options.diagnostics_set()  # the device sleep before each call (timing.lead_us) may be one
    if switches:
        job.note(f"timing: diagnostic switches set: {', '.join(switches)}")
    shared = gpu_shared(comm)
    if shared:
        job.note(SHARED_GPU_NOTE)
    elif comm.world == 1:
        job.note("one rank: dispatch and combine copy within the GPU, so the interference "
                 "measured is SMs and HBM only (no link is crossed)")
    if not options.diagnostic_is_set("align"):
        comm.use_align(OVERLAP_ALIGN)
    if comm.align_kind != "barrier":
        job.note(f"alignment before each timed call: NCCL {comm.align_kind} (a few bytes)"
                 + ("" if comm.align_kind == "allreduce" else ": its blocks may wait for SMs the GEMM holds"))
    routings = route_all(s)
    gemm = Gemm(opts.gemm, comm.device, m.hidden,
                expert_tokens(routings, comm.rank, m.experts_per_rank)
                if opts.gemm.kind == "experts" else None)
    set_carveout(None)
    gemm()
    watch, why = clocks.open_watch(comm.device.index)
    if why:
        job.note(why)
    with watch.phase() as all_reading:
        gemm_all = time_gemm(gemm, opts.gemm_iters, None)
    reference = gemm.out.clone()
    parts = {k: disjoint_partition(total - k, comm.device.index) for k in opts.sms}
    for k, p in parts.items():
        if p.sms > total - k:
            job.note(f"{k} SMs: the driver gave the GEMM's green context {p.sms} SMs "
                     f"(asked {total - k}): the partitions overlap by {p.sms - (total - k)}")
    if job.rank0:
        meta = job.meta(verb="overlap",
                        overlap={"gemm": opts.gemm.describe(), "gemm_impl": gemm.impl, "gemm_flops": gemm.flops,
                                 "total_sms": total, "partition": PARTITION,
                                 "carveout_api": CARVEOUT_API, "shared_gpu": shared,
                                 "green_context_sms": {k: p.sms for k, p in parts.items()},
                                 "stand_in_expert": EXPERT_IN_LOOP, "alignment": comm.align_kind})
        meta["backend_runtime"] = job.backend_runtime(meta)
        job.open(meta)
    base = {"scenario": s.name, "rank": comm.rank, "world": comm.world,
            "device": torch.cuda.get_device_name(comm.device), "gemm": opts.gemm.describe(), "gemm_impl": gemm.impl,
            "gemm_flops": gemm.flops, "total_sms": total, "shared_gpu": shared,
            "tokens_per_rank": m.tokens_per_rank, "hidden": m.hidden, **all_reading.fields("gemm_all"),
            "power_limit_w": watch.power_limit_w()}
    setup = driver.rank_setup(s, comm)
    wrong_total, salt = 0, 1
    everyone = all_ranks(comm)

    def new_point(part: Optional[Partition]) -> _Point:
        return _Point(gemm, gemm_all, part, total, opts, everyone, watch, all_reading)

    def record(backend: str, sms: int, row: Dict[str, Any], raw: Dict[str, Dict[str, List[float]]]) -> int:
        gathered = job.gather((dict(base, backend=backend, sms=sms, **row), raw))
        if gathered is None:
            return 0
        rows = [r for r, _ in gathered]
        job.record(rows, [x for r, raw_r in gathered for phase, smp in raw_r.items()
                          for x in _samples(backend, sms, r["rank"], phase, smp, r.get("call_mode"))])
        return sum(int(r.get("wrong") or 0) + int(r.get("gemm_wrong") or 0) for r in rows)

    for name in opts.backends:
        be_cls, reason = load_backend(name)
        reason = driver._first_reason(reason or driver.mode_reason(be_cls, s.mode)
                                      or be_cls.unavailable_reason(setup))
        if reason:
            job.note(f"backend {name} skipped: {reason}")
            continue
        be = be_cls(setup, **s.backend_options.get(name, {}))
        for note in driver.backend_notes(name, be):
            job.note(note)
        try:
            for mode, sms in ((c, n) for c in driver.call_modes_of(be, s.bench.call_modes)
                              for n in (opts.sms if be_cls.uses_sms else (0,))):
                be.use_call_mode(mode)  # before the point's inputs are prepared (kernel: a cached layout)
                point = new_point(parts.get(sms))
                calls = driver.Point(be, s, routings, sms, comm, s.bench.input_sets[0])
                row, raw = point.measure(lambda: calls.time(opts.warmup, opts.iters, expert_each=False))
                row["gemm_wrong"] = gemm.wrong(reference)
                rec = driver.PointRecord(comm.rank, input_sets=s.bench.input_sets[0])
                driver.finish_point(calls, salt, None, rec)
                salt += 1
                row.update(wrong=sum(rec.wrong.values()), call_mode=mode,
                           problem="; ".join(p for p in (*rec.problem.values(), row.get("schedule_problem")) if p)
                           or None)
                wrong_total += record(name, sms, row, raw)
        finally:
            be.close()
    if opts.calibrate:
        wrong_total += _calibrate(job, gemm, reference, parts, routings, record, new_point)
    return job.rank0_count(wrong_total)


def _calibrate(job: Any, gemm: Gemm, reference: Any, parts: Dict[int, Partition],
               routings: Sequence[Any], record: Callable[..., int],
               new_point: Callable[[Optional[Partition]], _Point]) -> int:
    """The copy rows at every SM count (``record`` and ``new_point``: measure's); returns the wrong ones."""
    from epbench import ceiling, metrics
    from epbench.routing import traffic

    s, opts, comm, m = job.scenario, job.options, job.comm, job.scenario.model
    tr = traffic(routings, m.experts_per_rank, s.topology.gpus_per_node, False)
    row_b = metrics.row_bytes(m.dispatch_dtype, m.hidden)
    copy_bytes = int(metrics.rank_bytes(tr, "dispatch", row_b)["algo"][comm.rank])
    wrong = 0
    for sms in opts.sms:
        loop, check = copy_loop(comm, sms, copy_bytes, opts)
        if loop is None:
            job.note("copy calibration: absent (the kernels library is not built: make build)")
            return wrong
        row, raw = new_point(parts[sms]).measure(loop)
        row.update(gemm_wrong=gemm.wrong(reference), wrong=check(), copy_bytes=copy_bytes,
                   problem=row.get("schedule_problem"))
        wrong += record("copy", sms, row, raw)
    if comm.world == 1 or gpu_shared(comm):
        return wrong  # no link to cross (the run's note says so)
    if s.topology.nodes > 1 and not s.topology.virtual_nodes:  # CUDA IPC does not cross nodes
        job.note(f"copy-link calibration: within one node only (this run spans {s.topology.nodes} nodes)")
        return wrong
    from epbench.routing import all_on_nvlink

    # virtual nodes: the copies between them cross NVLink too
    plan = link_plan(ceiling.byte_plan(s, all_on_nvlink(tr) if s.topology.virtual_nodes else tr)["dispatch"])
    for sms in opts.sms:
        loop, check, close = link_copy_loop(comm, sms, plan, opts)
        if loop is None:
            break
        try:
            row, raw = new_point(parts[sms]).measure(loop)
            row.update(gemm_wrong=gemm.wrong(reference), wrong=check(), copy_bytes=sum(plan[comm.rank]),
                       problem=row.get("schedule_problem"))
        finally:
            close()
        wrong += record(LINK_COPY, sms, row, raw)
    return wrong
