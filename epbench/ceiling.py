"""Ceilings: how fast the scenario's own bytes could move on this machine, measured in the run.

For each operation, rank r must send ``bytes_to[r][d]`` over NVLink to each peer d (dispatch:
row r of ``routing.Traffic.nvlink`` x row bytes; combine: column r, the same copies going back).
Two ideal transfers of exactly those bytes:

copy engines
    every rank issues asynchronous peer copies to every destination, all ranks at once
    (after the same cross-rank sync the driver uses): each destination's bytes in ``k``
    contiguous pieces, each piece on a stream of its own (``k`` = 1, 2 and 4), or every
    destination's bytes whole on one stream in ring order (RING); the fastest is the ceiling
    (a GPU's copy engine runs its peer copies one at a time, notes/LATENCY-NEXT.md). A
    rank's time per iteration runs from an event before the copies to one after the last; a
    ceiling time is the max over ranks of each rank's median -- the same rule as an operation's
    time.
plain SM stores
    the same bytes written by a kernel with plain 16-byte stores into peer memory at a given SM
    count (``ep_store_ceiling`` in csrc/ceiling.cu: no layout, no flags). It needs the built
    kernels library (or another provider plugged in through ``set_sm_store_provider``); without
    either it is reported as not measured, with the reason, never estimated.

Nominal limits come from the hardware: NVLink = active links x the per-link rate of the link
generation NVML reports; NIC = the sum of the active InfiniBand port rates of the nearest NIC.
The ideal time is bytes / rate. A result's percent of ceiling is ceiling time / its time.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from epbench import metrics
from epbench.cudart import Cudart
from epbench.errors import UserError
from epbench.routing import Traffic
from epbench.scenario import cpu_ranks
from epbench.timing import Timer

OPS = ("dispatch", "combine")

# Per-link rate in GB/s, one direction, by the value nvmlDeviceGetNvLinkVersion returns
# (nvmlNvlinkVersion_t: 1 = 1.0, 2 = 2.0, 3 = 2.2, 4 = 3.0, 5 = 3.1, 6 = 4.0, 7 = 5.0).
# 4.0 and 5.0 are the raw signalling rates (2 lanes x 106.25 / 212.5 Gb/s); earlier ones are
# the published per-direction link rates (P100 20, V100 and A100 25 GB/s).
NVLINK_VERSIONS: Dict[int, Tuple[str, Optional[float]]] = {
    1: ("1.0", 20.0), 2: ("2.0", 25.0), 3: ("2.2", 25.0), 4: ("3.0", 25.0), 5: ("3.1", 25.0),
    6: ("4.0", 26.5625), 7: ("5.0", 53.125), 8: ("6.0", None),
}
NVML_NVLINK_MAX_LINKS = 18  # older bindings lack the constant; newer ones say 36


# -- arithmetic ----------------------------------------------------------------------------

def ideal_time_us(nbytes: float, gbps: Optional[float]) -> Optional[float]:
    """Microseconds to move ``nbytes`` at ``gbps`` (10^9 bytes/s); None without a rate."""
    if gbps is None or not gbps > 0:
        return None
    return nbytes / (gbps * metrics.GB) * 1e6


def percent_of_ceiling(time_us: Optional[float], ceiling_us: Optional[float]) -> Optional[float]:
    """How close a result comes to the ceiling for the same bytes: 100 x ceiling / time
    (the ratio of the bandwidths). None when either time is missing."""
    if time_us is None or ceiling_us is None or not time_us > 0 or ceiling_us < 0:
        return None
    return 100.0 * ceiling_us / time_us


def bytes_to_peers(tr: Traffic, op: str, rank: int, row: int) -> List[int]:
    """Bytes rank ``rank`` sends over NVLink to each rank in ``op`` (0 to itself)."""
    if op == "dispatch":
        copies = tr.nvlink[rank]
    elif op == "combine":
        copies = tr.nvlink[:, rank]
    else:
        raise ValueError(f"unknown op {op!r}")
    return [int(c) * row for c in copies]


def op_row_bytes(s: Any, op: str) -> int:
    m = s.model
    return metrics.row_bytes(m.dispatch_dtype if op == "dispatch" else m.combine_dtype, m.hidden)


def byte_plan(s: Any, tr: Traffic) -> Dict[str, List[List[int]]]:
    """op -> [rank][destination] NVLink bytes for the whole job."""
    return {op: [bytes_to_peers(tr, op, r, op_row_bytes(s, op)) for r in range(s.world)]
            for op in OPS}


# -- nominal limits ------------------------------------------------------------------------

@dataclass(frozen=True)
class NvlinkLimit:
    links: int
    version: Optional[str]  # "4.0"
    nvml_version: Optional[int]  # what NVML returned
    per_link_gbps: Optional[float]

    @property
    def gbps(self) -> Optional[float]:
        return self.links * self.per_link_gbps if self.per_link_gbps is not None else None

    def describe(self) -> str:
        if self.per_link_gbps is None:
            return (f"{self.links} active links, NVLink version {self.version or '?'} "
                    f"(NVML {self.nvml_version}): per-link rate unknown")
        return (f"{self.links} active links x {self.per_link_gbps:g} GB/s "
                f"(NVLink {self.version}, NVML version {self.nvml_version}) = {self.gbps:.0f} GB/s "
                f"per direction")


def nvlink_limit(nvml: Any, handle: Any) -> Tuple[Optional[NvlinkLimit], Optional[str]]:
    """Active links (nvmlDeviceGetNvLinkState per link) and their generation's rate."""
    max_links = int(getattr(nvml, "NVML_NVLINK_MAX_LINKS", NVML_NVLINK_MAX_LINKS))
    active: List[int] = []
    for link in range(max_links):
        try:
            if nvml.nvmlDeviceGetNvLinkState(handle, link) == getattr(nvml, "NVML_FEATURE_ENABLED", 1):
                active.append(link)
        except nvml.NVMLError:
            continue  # past the last link, or not supported
    if not active:
        return None, "no active NVLink links"
    try:
        raw = int(nvml.nvmlDeviceGetNvLinkVersion(handle, active[0]))
    except nvml.NVMLError as e:
        return NvlinkLimit(len(active), None, None, None), f"NVLink version unreadable: {e}"
    version, rate = NVLINK_VERSIONS.get(raw, (None, None))
    return NvlinkLimit(len(active), version, raw, rate), None


def parse_ib_rate(text: str) -> Optional[float]:
    """'400 Gb/sec (4X NDR)' -> 400.0 (Gb/s)."""
    m = re.match(r"\s*([0-9.]+)\s*Gb/sec", text)
    return float(m.group(1)) if m else None


def nic_limit_gbps(nic: Optional[str], sysfs: Path) -> Optional[float]:
    """GB/s (bytes) of the NIC's ports whose ``state`` is ACTIVE (every port when the state
    file is missing); None when no rate is readable."""
    if nic is None:
        return None
    total = None
    for port in sorted((sysfs / "class/infiniband" / nic / "ports").glob("*")):
        state = port / "state"
        if state.is_file() and "ACTIVE" not in state.read_text():
            continue
        try:
            gbit = parse_ib_rate((port / "rate").read_text())
        except OSError:
            gbit = None
        if gbit is not None:
            total = (total or 0.0) + gbit / 8
    return total


@dataclass(frozen=True)
class Limits:
    nvlink: Optional[NvlinkLimit]
    nic_gbps: Optional[float]
    nic: Optional[str]
    notes: Tuple[str, ...]


def read_limits(device_index: Optional[int], sysfs: Path = Path("/sys")) -> Limits:
    """This rank's nominal limits from NVML and sysfs (anything unreadable is None + a note)."""
    from epbench import counters

    notes: List[str] = []
    nv = None
    ident = counters.GpuIdentity()
    if device_index is None:
        notes.append("NVLink limit: no CUDA device")
    else:
        try:
            ident = counters.torch_identity(device_index)
        except Exception as e:
            notes.append(f"NVLink limit: no CUDA device {device_index}: {e}")
        nvml, why = counters._import_nvml()
        if why:
            notes.append(f"NVLink limit: {why}")
        else:
            try:
                handle, why = counters.nvml_handle(nvml, ident)
                if handle is not None:
                    nv, why = nvlink_limit(nvml, handle)
                if why:
                    notes.append(f"NVLink limit: {why}")
            finally:
                nvml.nvmlShutdown()
    nic, how = counters.nearest_nic(ident.pci_bus_id, sysfs)
    if nic is None:
        notes.append(f"NIC limit: {how}")
    return Limits(nv, nic_limit_gbps(nic, sysfs), nic, tuple(notes))


# -- measured ceilings (CUDA) --------------------------------------------------------------

# (dst: peer rank -> device pointer where this rank's bytes go in that peer's buffer, mapped here;
#  nbytes: peer rank -> bytes; source tensor, sms, comm, warmup, iters) -> per-iteration microseconds
SmStoreProvider = Callable[[Dict[int, int], Dict[int, int], Any, int, Any, int, int], List[float]]
_sm_store_provider: Optional[SmStoreProvider] = None


def sm_store_absent(device: str) -> str:
    """Why the plain SM-store ceiling has no figure: a CPU run, or a GPU host whose kernels library is not built."""
    why = ("it needs CUDA GPUs" if device != "cuda"
           else "its kernel (ep_store_ceiling) is in the kernels library, which is not built here: `make build`")
    return f"plain SM-store ceiling: not measured ({why})"


def set_sm_store_provider(fn: Optional[SmStoreProvider]) -> None:
    """Plugs in the SM-store measurement: ``fn(dst, nbytes, source, sms, comm, warmup, iters)``
    writes ``nbytes[d]`` bytes from ``source`` to ``dst[d]`` with plain stores on ``sms`` SMs,
    and returns each timed iteration's microseconds."""
    global _sm_store_provider
    _sm_store_provider = fn


STORE_THREADS = 512  # threads per block of the store-ceiling kernel (one block per SM), as in bench.cu


def _ceiling_kernel(name: str) -> Optional[Callable[..., int]]:
    """A ceiling kernel's launcher from the kernels library (declared in cuda_lib.signatures()), or None when the
    library is not built."""
    try:
        from epbench import cuda_lib

        return getattr(cuda_lib.load(), name)
    except (RuntimeError, OSError, AttributeError):
        return None


def _timed_launches(launch: Callable[[Any], int], name: str, comm: Any, warmup: int, iters: int) -> List[float]:
    """``launch(stream)`` timed warmup + iters times on the current stream, every rank aligned before each;
    each timed iteration's microseconds."""
    import ctypes

    import torch

    from epbench import cuda_lib

    stream = ctypes.c_void_p(torch.cuda.current_stream(comm.device).cuda_stream)
    timer = Timer(comm.device, warmup + iters)
    for i in range(warmup + iters):
        cuda_lib.check(timer.time(i, lambda: launch(stream), align=comm.sync), name)
    return timer.samples_us(warmup)


# (destination pointers by peer, bytes by peer, source pointer, sms) -> launch(stream) -> return code
StoreLauncher = Callable[[Dict[int, int], Dict[int, int], int, int], Callable[[Any], int]]


def kernel_store_launcher() -> Optional[StoreLauncher]:
    """The csrc store kernel (ep_store_ceiling) bound to its destinations: ``launcher(dst, nbytes, src_ptr, sms)``
    gives ``launch(stream)``; None when the kernels library is not built."""
    fn = _ceiling_kernel("ep_store_ceiling")
    if fn is None:
        return None
    import ctypes

    def bind(dst: Dict[int, int], nbytes: Dict[int, int], src_ptr: int, sms: int) -> Callable[[Any], int]:
        peers = sorted(dst)
        ptrs = (ctypes.c_ulonglong * max(len(peers), 1))(*[dst[d] for d in peers])
        sizes = (ctypes.c_longlong * max(len(peers), 1))(*[nbytes[d] for d in peers])
        return lambda stream: fn(ptrs, sizes, len(peers), src_ptr, int(sms), STORE_THREADS, stream)

    return bind


def kernel_store_provider() -> Optional[SmStoreProvider]:
    """The csrc store kernel as a provider, or None when the kernels library is not built."""
    bind = kernel_store_launcher()
    if bind is None:
        return None

    def store_samples_us(dst: Dict[int, int], nbytes: Dict[int, int], source: Any, sms: int,
                         comm: Any, warmup: int, iters: int) -> List[float]:
        return _timed_launches(bind(dst, nbytes, source.data_ptr(), sms), "ep_store_ceiling", comm, warmup, iters)

    return store_samples_us


# (out tensor, source tensor, tokens, rows, hidden, sms, threads, comm, warmup, iters) -> per-iteration microseconds
SumProvider = Callable[[Any, Any, int, int, int, int, int, Any, int, int], List[float]]
# the local-sum kernel's register shapes (csrc/ceiling.cu): 512 threads with 128 KiB of loads in flight per SM (64
# for tokens of more than 2 rows), 256 with twice the vectors a lane; and its bulk-copy shape (7 loading warps a SM,
# each with 3 summing warps, TMA bulk copies into shared memory) for tokens of at most BULK_SUM_MAX_ROWS rows. The
# ceiling is the fastest. One H200 (python -m epbench.smmem, 2026-11-27), 4 SMs, us for 2 / 3 / 4 rows a token:
# registers 432 / 871 / 933, bulk copies with one summer a loader 498 / 570 / 654, with three 464 / 542 / 619;
# tokens of at most 2 rows take stages of 2 pieces, 4 a pair, since 702c866 (2 rows: 462 at 4 SMs, 235 at 8).
SUM_THREADS = (512, 256)
BULK_SUM_THREADS = 896  # csrc/ceiling.cu kBsThreads
BULK_SUM_MAX_ROWS = 4


def sum_shapes(rows_per_token: int) -> Tuple[int, ...]:
    """The local-sum shapes (threads) for tokens of at most ``rows_per_token`` rows."""
    return SUM_THREADS + ((BULK_SUM_THREADS,) if rows_per_token <= BULK_SUM_MAX_ROWS else ())


def kernel_sum_provider() -> Optional[SumProvider]:
    """The csrc local-sum kernel (ep_sum_ceiling) as a provider, or None when the kernels library is not built."""
    fn = _ceiling_kernel("ep_sum_ceiling")
    if fn is None:
        return None

    def sum_samples_us(out: Any, src: Any, tokens: int, rows: int, hidden: int, sms: int, threads: int,
                       comm: Any, warmup: int, iters: int) -> List[float]:
        return _timed_launches(lambda stream: fn(out.data_ptr(), src.data_ptr(), tokens, rows, hidden, int(sms),
                                                 int(threads), stream), "ep_sum_ceiling", comm, warmup, iters)

    return sum_samples_us


def sum_rows(tr: Traffic, rank: int) -> int:
    """Rows a rank's combine sums for its own tokens: its (token, rank) copies, its own rank's included (the
    routing's total matrix, row ``rank``); each token's rows become one output row."""
    return int(tr.total[rank].sum())


def recv_offsets(plan: List[List[int]], dest: int) -> List[int]:
    """Where each source's bytes land in ``dest``'s receive buffer (sources in rank order)."""
    offs, at = [], 0
    for src in range(len(plan)):
        offs.append(at)
        at += plan[src][dest]
    return offs


class PeerBuffers:
    """One receive buffer per rank (cudaMalloc), mapped into every other rank's own device
    context through CUDA IPC. ``peers[d]`` is rank d's buffer as a device pointer here.

    Why not torch: a receive buffer shared with ``torch.multiprocessing.reductions`` is opened
    by torch in the *owner's* device context; peer copies into it (``copy_`` or
    ``cudaMemcpyAsync``) measured 36 GB/s per rank on the H200 host with NVML counting no NVLink
    TX at all, i.e. staged, not a peer copy. Here every rank opens its peers' handles in its own
    device's context (as DeepEP does), so the copy engine can write over NVLink."""

    def __init__(self, nbytes: int, comm: Any, rt: Any, dist: Any) -> None:
        self.rt, self.dist = rt, dist
        rt.set_device(comm.device.index)
        self.local = rt.malloc(max(nbytes, 16))
        self.peers: Dict[int, int] = {}
        try:
            shared: List[Any] = [None] * comm.world
            dist.all_gather_object(shared, (rt.ipc_handle(self.local), comm.device.index))
            for r, (handle, device) in enumerate(shared):
                if r != comm.rank:
                    rt.enable_peer_access(device)
                    self.peers[r] = rt.ipc_open(handle)
        finally:
            dist.barrier()

    def close(self) -> None:
        """Every rank unmaps its peers before any owner frees its buffer."""
        for ptr in self.peers.values():
            self.rt.ipc_close(ptr)
        self.peers.clear()
        self.dist.barrier()
        self.rt.free(self.local)


CE_SPLITS = (1, 2, 4)  # streams per destination measured for the copy-engine ceiling
# ... and RING: every destination's bytes on one stream, in ring order (me + 1, me + 2, ...). A GPU's copy engine
# runs its peer copies one at a time whatever the streams (notes/LATENCY-NEXT.md, "a trace"); in ring order each
# destination receives from one source at a time while the ranks keep step.
RING = "ring"


def split_pieces(nbytes: int, k: int, align: int = 16) -> List[Tuple[int, int]]:
    """(offset, length) of k contiguous pieces covering nbytes, each offset a multiple of align (the
    last piece takes the remainder; fewer pieces when nbytes is small, none of length 0)."""
    step = -(-nbytes // k)
    step = -(-step // align) * align
    return [(o, min(step, nbytes - o)) for o in range(0, nbytes, step)] if nbytes > 0 else []


def ring_dests(plan: List[List[int]], me: int) -> List[int]:
    """The destinations rank ``me`` sends bytes to, in ring order: me + 1, me + 2, ... (mod world)."""
    world = len(plan)
    return [d for d in ((me + i) % world for i in range(1, world)) if plan[me][d] > 0]


def copy_engine_samples_us(plan: List[List[int]], comm: Any, bufs: PeerBuffers, source: Any,
                           warmup: int, iters: int, split: Any = 1) -> List[float]:
    """This rank's per-iteration time for async peer copies to every destination: each destination's bytes in
    ``split`` contiguous pieces, one stream per piece, all queued at once; or (``split`` RING) each destination's
    bytes whole, one after another on one stream, in ring order."""
    import torch

    me = comm.rank
    rt = bufs.rt
    dests = ring_dests(plan, me)
    dst = {d: bufs.peers[d] + recv_offsets(plan, d)[me] for d in dests}
    ring = split == RING
    pieces = [(d, off, n) for d in dests for off, n in split_pieces(plan[me][d], 1 if ring else split)]
    streams = [torch.cuda.Stream(device=comm.device) for _ in (pieces[:1] if ring else pieces)]
    main = torch.cuda.current_stream(comm.device)

    def copies() -> None:
        for st in streams:
            st.wait_stream(main)
        for i, (d, off, n) in enumerate(pieces):
            rt.memcpy_async(dst[d] + off, source.data_ptr() + off, n, streams[0 if ring else i].cuda_stream)
        for st in streams:
            main.wait_stream(st)

    timer = Timer(comm.device, warmup + iters)
    for i in range(warmup + iters):
        timer.time(i, copies, align=comm.sync)
    return timer.samples_us(warmup)


CE_SM_SHARES = (0.25, 0.5, 0.75)  # the copy engines' share of each destination's bytes, copy engine + SM stores


def ce_share_bytes(nbytes: int, share: float, align: int = 16) -> int:
    """The copy engine's part of a destination's bytes: share x nbytes, rounded down to align."""
    return int(nbytes * share) // align * align


def ce_and_store_samples_us(plan: List[List[int]], comm: Any, bufs: PeerBuffers, source: Any,
                            bind: StoreLauncher, sms: int, share: float, warmup: int, iters: int) -> List[float]:
    """This rank's per-iteration time when the copy engines (one stream, the destinations in ring order, as the
    own_rows=all dispatch queues them) move the first ``share`` of each destination's bytes and the store kernel
    on ``sms`` SMs the rest, all at once: what a dispatch or combine that splits its rows between the two engines
    cannot beat."""
    import torch

    me, rt = comm.rank, bufs.rt
    dests = ring_dests(plan, me)
    dst = {d: bufs.peers[d] + recv_offsets(plan, d)[me] for d in dests}
    ce = {d: ce_share_bytes(plan[me][d], share) for d in dests}
    store = bind({d: dst[d] + ce[d] for d in dests}, {d: plan[me][d] - ce[d] for d in dests},
                 source.data_ptr(), sms)
    side = torch.cuda.Stream(device=comm.device)
    main = torch.cuda.current_stream(comm.device)

    def both(stream: Any) -> int:
        side.wait_stream(main)
        for d in dests:
            if ce[d] > 0:
                rt.memcpy_async(dst[d], source.data_ptr(), ce[d], side.cuda_stream)
        rc = store(stream)
        main.wait_stream(side)
        return rc

    return _timed_launches(both, "ep_store_ceiling", comm, warmup, iters)


@dataclass
class OpCeiling:
    op: str
    bytes_per_rank: List[int]  # NVLink bytes each rank sends
    copy_engine_us: Optional[float]  # max over ranks of the median, the fastest split; None on CPU
    sm_store_us: Dict[int, Optional[float]]  # by SM count; None = absent
    ideal_us: Optional[float]  # max over ranks of bytes / nominal NVLink rate (hardware)
    scenario_ideal_us: Optional[float] = None  # the same at the scenario's topology.nvlink_gbps
    # NVLink TX bytes NVML counted per copy-engine iteration, per rank (None: no counter)
    counted_per_iter: Optional[List[Optional[float]]] = None
    # copy-engine time (max over ranks of the median) by streams per destination (CE_SPLITS) and for RING
    copy_engine_by_split: Dict[Any, float] = field(default_factory=dict)
    # combine only: a kernel on that many SMs summing the rows of each rank's tokens, every row local (csrc
    # ceiling.cu ep_sum_ceiling, the fastest of its register and bulk-copy shapes): a reference for the combine's SM
    # side, not a bound (the register shapes alone were beaten by a pull with bulk copies at 4 ranks, 4 SMs)
    sm_sum_us: Dict[int, Optional[float]] = field(default_factory=dict)
    # copy engines and the store kernel at once, each a share of every destination's bytes: by SM count, the
    # fastest share's time (max over ranks of the median) and that share (CE_SM_SHARES)
    ce_sm_us: Dict[int, Optional[float]] = field(default_factory=dict)
    ce_sm_share: Dict[int, float] = field(default_factory=dict)

    @property
    def copy_engine_split(self) -> Any:
        """The streams per destination of the copy-engine ceiling (the fastest measured), or RING."""
        return min(self.copy_engine_by_split, key=self.copy_engine_by_split.get) if self.copy_engine_by_split else None

    def counted_vs_computed(self) -> Optional[float]:
        """The rank furthest from 1 of counted / computed bytes; None without counters."""
        pairs = [(n, b) for n, b in zip(self.counted_per_iter or [], self.bytes_per_rank)
                 if n is not None and b > 0]
        if not pairs:
            return None
        return max((n / b for n, b in pairs), key=lambda r: abs(r - 1.0))

    @property
    def max_bytes(self) -> int:
        return max(self.bytes_per_rank) if self.bytes_per_rank else 0

    @property
    def copy_engine_gbps(self) -> Optional[float]:
        return metrics.bandwidth_gbps(self.max_bytes, self.copy_engine_us) \
            if self.copy_engine_us is not None and self.max_bytes > 0 else None


def ideal_per_op(plan: Dict[str, List[List[int]]], rates: Sequence[Optional[float]]) -> Dict[str, Optional[float]]:
    """Max over ranks of (bytes a rank sends / that rank's nominal rate); None if any rank's
    rate is unknown."""
    out: Dict[str, Optional[float]] = {}
    for op, m in plan.items():
        times = [ideal_time_us(sum(row), rate) for row, rate in zip(m, rates)]
        out[op] = None if any(t is None for t in times) else max(times, default=0.0)
    return out


def measure_ceilings(s: Any, tr: Traffic, comm: Any, warmup: int, iters: int,
                     rates: Sequence[Optional[float]]) -> List[OpCeiling]:
    """On every rank (CUDA): copy-engine ceilings per op, and SM-store ceilings when a provider
    is plugged in. Returns the same list on every rank."""
    import torch
    import torch.distributed as dist

    from epbench import counters

    plan = byte_plan(s, tr)
    result = byte_ceilings(s, tr, rates)
    cnt, _ = counters.open_counters(comm.local_rank)
    rt = Cudart()  # epbench/cudart.py
    for c in result:
        m = plan[c.op]
        recv = max(sum(m[src][d] for src in range(comm.world)) for d in range(comm.world))
        send = max(max(row) for row in m)
        source = torch.randint(0, 255, (max(send, 16),), dtype=torch.uint8, device=comm.device)
        bufs = PeerBuffers(recv, comm, rt, dist)
        try:
            before = cnt.read() if cnt else {}
            samples = copy_engine_samples_us(m, comm, bufs, source, warmup, iters)
            tx = counters.delta(before, cnt.read() if cnt else {}).get("nvlink_tx")
            c.counted_per_iter = [None] * comm.world
            dist.all_gather_object(c.counted_per_iter,
                                   tx / (warmup + iters) if tx is not None else None)
            c.copy_engine_by_split[1] = _max_over_ranks(samples, comm)
            for k in CE_SPLITS[1:] + (RING,):
                c.copy_engine_by_split[k] = _max_over_ranks(
                    copy_engine_samples_us(m, comm, bufs, source, warmup, iters, split=k), comm)
            c.copy_engine_us = min(c.copy_engine_by_split.values())
            provider = _sm_store_provider or kernel_store_provider()
            if provider is not None:
                me = comm.rank
                dests = [d for d in range(comm.world) if d != me and m[me][d] > 0]
                dst = {d: bufs.peers[d] + recv_offsets(m, d)[me] for d in dests}
                nbytes = {d: m[me][d] for d in dests}
                for sms in c.sm_store_us:
                    c.sm_store_us[sms] = _max_over_ranks(
                        provider(dst, nbytes, source, sms, comm, warmup, iters), comm)
            bind = kernel_store_launcher() if _sm_store_provider is None else None
            if bind is not None:
                for sms in c.sm_store_us:
                    by_share = {f: _max_over_ranks(ce_and_store_samples_us(m, comm, bufs, source, bind, sms, f,
                                                                           warmup, iters), comm)
                                for f in CE_SM_SHARES}
                    c.ce_sm_share[sms] = min(by_share, key=by_share.get)
                    c.ce_sm_us[sms] = by_share[c.ce_sm_share[sms]]
            summer = kernel_sum_provider() if c.op == "combine" else None
            if summer is not None:
                c.sm_sum_us = measure_sums(summer, s, tr, comm, warmup, iters, list(c.sm_store_us))
        finally:
            torch.cuda.synchronize()
            dist.barrier()  # no rank still copies into a buffer that is about to go
            bufs.close()
    if cnt:
        cnt.close()
    return result


def measure_sums(summer: SumProvider, s: Any, tr: Traffic, comm: Any, warmup: int, iters: int,
                 sms_list: List[int]) -> Dict[int, Optional[float]]:
    """The local-sum ceiling at each SM count: this rank's tokens, each summing its share of sum_rows rows (bf16
    rows of the model's hidden size, normal random values), max over ranks of the median; the faster of the
    kernel's shapes (sum_shapes)."""
    import torch

    tokens, hidden = s.model.tokens_per_rank, s.model.hidden
    rows = sum_rows(tr, comm.rank)
    per_token = -(-rows // tokens) if tokens else 0
    shapes = sum_shapes(_max_int_over_ranks(per_token, comm))  # every rank times the same shapes (collectives)
    src = torch.randn(max(per_token, 1), max(tokens, 1), hidden, device=comm.device, dtype=torch.bfloat16)
    out = torch.empty(max(tokens, 1), hidden, device=comm.device, dtype=torch.bfloat16)
    try:
        return {sms: min(_max_over_ranks(summer(out, src, tokens, rows, hidden, sms, threads, comm, warmup, iters),
                                         comm) for threads in shapes)
                for sms in sms_list}
    finally:
        del src, out


def _max_int_over_ranks(value: int, comm: Any) -> int:
    import torch.distributed as dist

    vals: List[Any] = [None] * comm.world
    dist.all_gather_object(vals, int(value))
    return max(vals)


def _max_over_ranks(samples_us: List[float], comm: Any) -> float:
    import torch.distributed as dist

    meds: List[Any] = [None] * comm.world
    dist.all_gather_object(meds, metrics.median(samples_us))
    return max(meds)


def byte_ceilings(s: Any, tr: Traffic, rates: Sequence[Optional[float]]) -> List[OpCeiling]:
    """The part that needs no GPU: bytes per rank and the nominal ideal times."""
    plan = byte_plan(s, tr)
    ideal = ideal_per_op(plan, rates)
    return [OpCeiling(op, [sum(row) for row in plan[op]], None, {k: None for k in s.bench.sms},
                      ideal[op], ideal_time_us(max(sum(r) for r in plan[op]), s.topology.nvlink_gbps))
            for op in OPS]


# -- output --------------------------------------------------------------------------------

def ceiling_table(ceilings: List[OpCeiling], title: str):
    from epbench.console import number, table

    cols = ("op", "MB per rank", "copy engine us", "copy engine GB/s", "copy engine us by streams",
            "SM stores us", "copy engine + SM stores us", "SM local sum us", "nominal ideal us", "nominal GB/s",
            "scenario ideal us", "NVML TX / computed")
    t = table(title, "bytes = NVLink bytes a rank sends (max over ranks); times in us "
              "(max over ranks of the median); GB/s = bytes / time; copy engine = the fastest of "
              "1, 2 and 4 streams per destination (each a piece of its bytes) and ring (one stream, the "
              "destinations one after another from rank + 1 on); by streams: each one's time; NVML TX / "
              "computed = NVLink bytes NVML counted per copy-engine iteration of one stream per destination "
              "over the bytes asked for (the rank furthest from 1); copy engine + SM stores = both at once, "
              "the copy engines a share of every destination's bytes on one stream in ring order (the fastest "
              "of 25, 50, 75 %, in brackets), the store kernel the rest; "
              "SM local sum = a kernel on that many SMs summing each token's rows (combine), every row already "
              "local, the fastest of three kernel shapes (two with register loads, one with TMA bulk copies for "
              "tokens of up to 4 rows): a reference for a combine that sums on those SMs, not a bound",
              [(c, "left" if c == "op" else "right") for c in cols])
    for c in ceilings:
        sm = [f"{k}: {number(v)}" for k, v in c.sm_store_us.items() if v is not None]
        by = [f"{k}: {number(v)}" for k, v in c.copy_engine_by_split.items()]
        sums = [f"{k}: {number(v)}" for k, v in c.sm_sum_us.items() if v is not None]
        both = [f"{k}: {number(v)} ({c.ce_sm_share[k]:.0%})" for k, v in c.ce_sm_us.items() if v is not None]
        t.add_row(c.op, number(c.max_bytes / 1e6), number(c.copy_engine_us), number(c.copy_engine_gbps),
                  ", ".join(by) if by else "-",
                  ", ".join(sm) if sm else "-",
                  ", ".join(both) if both else "-",
                  ", ".join(sums) if sums else "-",
                  number(c.ideal_us),
                  number(metrics.bandwidth_gbps(c.max_bytes, c.ideal_us) if c.ideal_us else None),
                  number(c.scenario_ideal_us), _ratio(c.counted_vs_computed()))
    return t


def _ratio(r: Optional[float]) -> str:
    if r is None:
        return "-"
    flag = " [bold red]!>10%[/]" if abs(r - 1.0) > 0.10 else ""
    return f"{r:.3f}{flag}"


def print_ceilings(s: Any, ceilings: List[OpCeiling], limits: Limits, device: str,
                   console: Any, no_links: str = "") -> None:
    """The table and its notes; ``no_links``: why the scenario's own NVLink rate means nothing
    (scenario.cpu_ranks), said in place of it and of the scenario ideal."""
    console.print(ceiling_table(ceilings, f"{s.name}: ceilings on {s.world} ranks ({device})"))
    console.print(f"NVLink nominal: {limits.nvlink.describe() if limits.nvlink else 'unknown'}; "
                  + (f"scenario says {s.topology.nvlink_gbps:g} GB/s" if not no_links else
                     "scenario: no NVLink (CPU ranks)"))
    console.print("NIC nominal: " + (f"{limits.nic} {limits.nic_gbps:g} GB/s" if limits.nic_gbps
                                     else "none"))
    for n in limits.notes:
        console.print(f"note: {n}")
    if no_links:
        console.print(f"note: scenario ideal: none ({no_links})")
    if device != "cuda":
        console.print("note: copy-engine ceilings need CUDA GPUs; only the byte counts and nominal "
                      "limits are shown")
    if not any(v is not None for c in ceilings for v in c.sm_store_us.values()):
        console.print(f"note: {sm_store_absent(device)}")


def rates_of(limits: Sequence[Limits]) -> List[Optional[float]]:
    return [lim.nvlink.gbps if lim.nvlink else None for lim in limits]


def nic_lines(s: Any, tr: Traffic, limits: Limits) -> List[str]:
    """A scenario of several nodes: each op's NIC-tier bytes (the copies between nodes, the most any rank
    sends) and their ideal time at the scenario's topology.nic_gbps and at this host's NIC, one line each;
    none for one node. Nothing here is measured: ceilings are measured inside one node."""
    if s.topology.nodes < 2:
        return []
    tier = "NIC (virtual: over NVLink)" if s.topology.virtual_nodes else "NIC"
    lines = []
    for op in OPS:
        copies = tr.nic if op == "dispatch" else tr.nic.t()
        most = max(int(row.sum()) for row in copies) * op_row_bytes(s, op)
        ideal = [f"{how} {ideal_time_us(most, rate):.1f} us at {rate:g} GB/s"
                 for how, rate in (("scenario", s.topology.nic_gbps or None), (limits.nic or "host", limits.nic_gbps))
                 if ideal_time_us(most, rate) is not None]
        lines.append(f"{tier} bytes ({s.topology.nodes} nodes): {op} {most / 1e6:.3f} MB per rank (max over ranks)"
                     + (f"; ideal: {', '.join(ideal)}" if ideal else "; no NIC rate: no ideal time"))
    return lines


def run_local(s: Any, console: Any, csv: Optional[Path] = None, argv: Sequence[str] = ()) -> int:
    """Without GPUs: byte counts and whatever nominal limits this host reports (with ``csv``: those figures into
    that file too); a scenario of several nodes: its NIC tier's bytes too (nic_lines). A scenario of CPU ranks (scenario.cpu_ranks) gets no scenario ideal: its NVLink rate describes nothing."""
    from epbench.routing import route_all, traffic

    if csv is not None:
        check_csv_path(csv)
    tr = traffic(route_all(s), s.model.experts_per_rank, s.topology.gpus_per_node, False)
    limits = read_limits(None)
    ceilings = byte_ceilings(s, tr, rates_of([limits] * s.world))
    no_links = cpu_ranks(s)
    if no_links:
        for c in ceilings:
            c.scenario_ideal_us = None
    print_ceilings(s, ceilings, limits, "cpu", console, no_links)
    for line in nic_lines(s, tr, limits):  # a multi-node scenario's other tier (the table's bytes: NVLink)
        console.print(line, highlight=False)
    if csv is not None:
        _record(csv, s, ceilings, argv, "cpu", {})
        console.print(f"figures: {csv}")
    return 0


def _record(csv: Path, s: Any, ceilings: List[OpCeiling], argv: Sequence[str], device: str,
            extra: Dict[str, Any]) -> None:
    from epbench import provenance

    info = provenance.collect(list(argv), device)
    write_csv(csv, figure_rows(s, ceilings, info.get("git_commit", "unknown")),
              {**info, "scenario": s.to_dict(), **extra}, overwrite=False)


def every_ranks_limits(comm: Any) -> List[Limits]:
    """Each rank's nominal limits (read_limits on its own GPU), on every rank, in rank order."""
    import torch.distributed as dist

    limits: List[Any] = [None] * comm.world
    dist.all_gather_object(limits, read_limits(comm.local_rank))
    return limits


CSV_COLUMNS = ("scenario", "world", "op", "figure", "sms", "streams", "ce_fraction", "time_us", "bytes_per_rank",
               "gbps", "git_commit")


def figure_rows(s: Any, ceilings: List[OpCeiling], commit: str) -> List[Dict[str, Any]]:
    """Every figure of the ceilings, one row each (``epbench ceiling --csv``): copy engines by streams per
    destination, SM stores, copy engines + SM stores (ce_fraction: the copy engines' part of the bytes, 0-1) and
    the local sum by SM count, the nominal and the scenario's ideal times. bytes_per_rank = the op's NVLink bytes a
    rank sends (none for the local sum, which reads other bytes); gbps = those bytes / time, none for the local sum
    and none where no rank sends a byte over a link."""
    rows: List[Dict[str, Any]] = []

    def add(c: OpCeiling, figure: str, time_us: Optional[float], sms: Optional[int] = None,
            streams: Optional[int] = None, share: Optional[float] = None, link: bool = True) -> None:
        if time_us is None:
            return
        rows.append({"scenario": s.name, "world": s.world, "op": c.op, "figure": figure, "sms": sms,
                     "streams": streams, "ce_fraction": share, "time_us": time_us,
                     "bytes_per_rank": c.max_bytes if link else None,
                     "gbps": metrics.bandwidth_gbps(c.max_bytes, time_us)
                     if link and c.max_bytes > 0 and time_us > 0 else None,
                     "git_commit": commit})

    for c in ceilings:
        for k, t in c.copy_engine_by_split.items():
            add(c, "copy_engine_ring" if k == RING else "copy_engine", t, streams=1 if k == RING else k)
        for sms, t in c.sm_store_us.items():
            add(c, "sm_stores", t, sms=sms)
        for sms, t in c.ce_sm_us.items():
            add(c, "copy_engine_and_sm_stores", t, sms=sms, share=c.ce_sm_share.get(sms))
        for sms, t in c.sm_sum_us.items():
            add(c, "sm_local_sum", t, sms=sms, link=False)
        add(c, "nominal_ideal", c.ideal_us)
        add(c, "scenario_ideal", c.scenario_ideal_us)
    return rows


def provenance_path(path: Path) -> Path:
    """Where ``--csv path`` records what produced its figures: the same name + .json."""
    return path.with_name(path.name + ".json")


def check_csv_path(path: Path) -> None:
    """Refuses a ``--csv`` file, or its .json beside it, that exists already (before anything is measured, and
    again when they are written), as predict's --json and plot refuse theirs."""
    from epbench.results import refuse_existing

    for p in (path, provenance_path(path)):
        refuse_existing(p, "--csv")


def write_csv(path: Path, rows: List[Dict[str, Any]], provenance: Dict[str, Any],
              columns: Sequence[str] = CSV_COLUMNS, overwrite: bool = True) -> None:
    """The rows into ``path`` (``columns``, CSV_COLUMNS unless given) and what produced them into the same name +
    .json; each whole or not at all (a UserError naming the file it could not write). ``overwrite`` False
    (``epbench ceiling --csv``): both must be new files, none that exists is touched, and neither is kept
    without the other."""
    import csv
    import io
    import json

    from epbench.results import write_new
    from epbench.results import _atomic_write

    text = io.StringIO()
    w = csv.DictWriter(text, fieldnames=list(columns), lineterminator="\n")
    w.writeheader()
    for r in rows:
        w.writerow({k: "" if r.get(k) is None else r[k] for k in columns})
    meta = json.dumps(provenance, indent=1, default=str) + "\n"
    if overwrite:
        _atomic_write(path, text.getvalue())
        _atomic_write(provenance_path(path), meta)
        return
    check_csv_path(path)
    write_new(path, text.getvalue(), "--csv")
    try:
        write_new(provenance_path(path), meta, "--csv")
    except UserError:
        path.unlink(missing_ok=True)  # figures without what produced them: neither is kept
        raise


def measure_job(job: Any) -> int:
    """``epbench ceiling``'s one job (session.Job) on this rank (CUDA): every rank's nominal
    limits, the measured ceilings, and rank 0 prints them (no results folder; with --csv also into
    that file, provenance beside it). Returns 0: a ceiling has no rows to verify."""
    from epbench.routing import route_all, traffic

    s, opts, comm = job.scenario, job.options, job.comm
    tr = traffic(route_all(s), s.model.experts_per_rank, s.topology.gpus_per_node, False)
    limits = every_ranks_limits(comm)
    ceilings = measure_ceilings(s, tr, comm, opts.warmup, opts.iters, rates_of(limits))
    if job.rank0:
        print_ceilings(s, ceilings, limits[0], "cuda", job.console)
        if job.plan.csv is not None:
            _record(job.plan.csv, s, ceilings, job.plan.argv, "cuda", {"warmup": opts.warmup, "iters": opts.iters})
            job.console.print(f"figures: {job.plan.csv}")
    return 0
