"""The figures each library's own benchmark prints, read back from its output (tools/fidelity.py).

Every parser takes the text a script wrote to stdout and returns ``Figure`` records; none of them
raises on a line it does not know (the scripts print much else: their correctness checks,
warnings, the NCCL banner). The formats are those of the pinned commits (tools/baselines.py):

- DeepEP V1, tests/test_intranode.py (567632d): rank 0 prints one ``[tuning]`` line per NVL chunk
  size it tries (``chunk default`` = the library's own config for that SM count), then a ``Best``
  line that closes the block and names its dtype (dispatch: FP8 first, then BF16; combine after).
  Each time is ``bench()`` of tests/utils.py: rank 0's own events, the mean of 49 of 50
  back-to-back calls after 50 warm-up calls and one L2 flush, with the cached handle.
- DeepEP V2, tests/elastic/test_ep.py (dd758ca): every rank prints one line per timed variant
  (``*`` dispatch, ``-`` expanded dispatch, ``#`` cached dispatch, ``@`` combine, ``+`` reduced
  combine), each with two kernel times from the profiler (``bench_kineto``: the mean over 30 calls,
  each after an L2 flush, a 10 ms device sleep and a barrier); a ``> Testing with k=v, ...`` line
  names the mode the lines below it belong to.
- Hybrid-EP, tests/test_hybrid_ep.py (94a9f8f): rank 0 prints, per dtype, the API times
  (``bench()``: per-rank mean of 49 back-to-back calls with the cached handle) as average, min and
  max over ranks, then the kernel times from the profiler (30 back-to-back calls) the same way.
- NCCL, torch symm-mem, FlashInfer: tools/fidelity_calls.py writes its per-rank samples of each
  library's plainest call as JSON, and for NCCL and symm-mem also those of epbench's backend's
  phases (`reference`, `symm-mem`).
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field
from statistics import mean, median
from typing import Any, Dict, List, Optional, Tuple

# how the epbench figure that a library's figure is compared with is taken (tools/fidelity.py)
STATS = ("mean", "p50")
RANKS = ("rank 0", "slowest", "rank avg")


@dataclass
class Figure:
    library: str  # v1 | v2 | hybrid-ep | reference | symm-mem | flashinfer
    dtype: str  # the dispatch dtype of the block it came from: bf16 | fp8
    op: str  # dispatch | combine
    sms: Optional[int]  # None: the library picks its own SM use (NCCL)
    us: float
    stat: str  # mean | p50 (of one rank's timed calls)
    ranks: str  # rank 0 | slowest | rank avg: which rank's (or ranks') statistic
    variant: str  # what was timed, in words
    # primary (the ratio's denominator) | alt (shown beside it) | extra; a backend's phases
    # (tools/fidelity_phases.py): whole (its unmarked call) | phase (one step of it)
    role: str = "extra"
    detail: Dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> Dict[str, Any]:
        return asdict(self)


def _num(text: str) -> Optional[float]:
    try:
        return float(text)
    except ValueError:
        return None


# ---- DeepEP V1 -------------------------------------------------------------------------------

V1_TRY = re.compile(r"\[tuning\] SMs (?P<sms>\d+), NVL chunk (?P<chunk>\d+|default): "
                    r"(?P<gbs>\S+) GB/s \(NVL\), (?P<us>[\d.]+) us\s*$")
V1_BEST_DISPATCH = re.compile(r"\[tuning\] Best dispatch \((?P<dtype>FP8|BF16)\): SMs (?P<sms>\d+), "
                              r"NVL chunk (?P<chunk>\d+), (?P<gbs>\S+) GB/s \(NVL\), t: (?P<us>[\d.]+) us")
V1_BEST_COMBINE = re.compile(r"\[tuning\] Best combine: SMs (?P<sms>\d+), NVL chunk (?P<chunk>\d+): "
                             r"(?P<gbs>\S+) GB/s \(NVL\), t: (?P<us>[\d.]+) us")
V1_STAT = ("mean", "rank 0")  # bench(): rank 0's mean of 49 back-to-back calls


def parse_v1(text: str) -> List[Figure]:
    """Per (dtype, op, SM count): the default config's time (primary: the config epbench's
    ``deepep`` backend calls with), the best chunk size's (alt) and every other chunk's (extra).
    Combine is timed once per SM count, after the BF16 dispatch: its dtype is bf16."""
    out: List[Figure] = []
    tries: List[Dict[str, str]] = []

    def close(dtype: str, op: str, best: Dict[str, str]) -> None:
        for t in tries:
            default = t["chunk"] == "default"
            out.append(Figure("v1", dtype, op, int(t["sms"]), float(t["us"]), *V1_STAT,
                              variant="default config" if default else f"chunk {t['chunk']}",
                              role="primary" if default else "extra",
                              detail={"chunk": t["chunk"], "gbps": _num(t["gbs"])}))
        out.append(Figure("v1", dtype, op, int(best["sms"]), float(best["us"]), *V1_STAT,
                          variant=f"best: chunk {best['chunk']}", role="alt",
                          detail={"chunk": int(best["chunk"]), "gbps": _num(best["gbs"]),
                                  "chunks_tried": len([t for t in tries if t["chunk"] != "default"])}))
        tries.clear()

    for line in text.splitlines():
        m = V1_TRY.search(line)
        if m:
            tries.append(m.groupdict())
            continue
        m = V1_BEST_DISPATCH.search(line)
        if m:
            close(m["dtype"].lower(), "dispatch", m.groupdict())
            continue
        m = V1_BEST_COMBINE.search(line)
        if m:
            close("bf16", "combine", m.groupdict())
    return out


# ---- DeepEP V2 -------------------------------------------------------------------------------

V2_MODE = re.compile(r"> Testing with (?P<modes>.*?)(?: \.\.\.)?\s*$")
V2_LINE = re.compile(r"[*\-#@+] EP:\s*(?P<rank>\d+)/(?P<world>\d+) \| (?P<kind>[a-z ]+): .*?, "
                     r"(?P<us>[\d.]+) us, (?P<bytes>\d+) bytes \| (?:copy|reduce): \S+ GB/s, "
                     r"(?P<us2>[\d.]+) us")
V2_KINDS = ("dispatch", "expanded dispatch", "cached dispatch", "combine", "reduced combine")
# the mode of test_ep.py's enumerate_ep_modes that epbench's deepep-v2 backend calls (rank-major):
# a copied handle, no expert padding, no bias, no previous event, synchronous, no comm-stream
# allocation; use_fp8_dispatch follows the scenario's dtype
V2_MODE_KEYS = ("do_handle_copy", "expert_alignment", "use_fp8_dispatch", "num_bias",
                "with_previous_event", "async_with_compute_stream", "allocate_on_comm_stream")
V2_ADAPTER_MODE = {"do_handle_copy": 1, "expert_alignment": 1, "num_bias": 0, "with_previous_event": 0,
                   "async_with_compute_stream": 0, "allocate_on_comm_stream": 0}


def v2_modes(dtypes: List[str]) -> List[Tuple[int, ...]]:
    """The mode tuples (test_ep.py's order) that match the adapter, one per dispatch dtype."""
    return [tuple(int(dt == "fp8") if k == "use_fp8_dispatch" else V2_ADAPTER_MODE[k] for k in V2_MODE_KEYS)
            for dt in dtypes]


def parse_v2(text: str, sms: int) -> List[Figure]:
    """Per (mode, variant): the slowest rank's sum of the two kernels the test profiles (the
    communication kernel and its copy / reduce epilogue), each a mean over 30 calls. Primary: the
    non-cached dispatch and the combine of the adapter's mode; alt: the cached dispatch there."""
    out: List[Figure] = []
    mode: Dict[str, int] = {}
    per: Dict[Tuple[Tuple[Tuple[str, int], ...], str], Dict[int, Dict[str, Any]]] = {}
    order: List[Tuple[Tuple[Tuple[str, int], ...], str]] = []
    for line in text.splitlines():
        m = V2_MODE.search(line)
        if m:
            mode = {k: int(v) for k, v in re.findall(r"(\w+)=(-?\d+)", m["modes"])}
            continue
        m = V2_LINE.search(line)
        if m and m["kind"] in V2_KINDS:
            key = (tuple(sorted(mode.items())), m["kind"])
            if key not in per:
                per[key] = {}
                order.append(key)
            per[key][int(m["rank"])] = {"kernel_us": float(m["us"]), "epilogue_us": float(m["us2"]),
                                        "bytes": int(m["bytes"]), "world": int(m["world"])}
    for key in order:
        mode_items, kind = key
        md = dict(mode_items)
        ranks = per[key]
        slow = max(ranks, key=lambda r: ranks[r]["kernel_us"] + ranks[r]["epilogue_us"])
        us = ranks[slow]["kernel_us"] + ranks[slow]["epilogue_us"]
        adapter = all(md.get(k) == v for k, v in V2_ADAPTER_MODE.items())
        role = "extra"
        if adapter and kind in ("dispatch", "combine"):
            role = "primary"
        elif adapter and kind == "cached dispatch":
            role = "alt"
        op = "combine" if "combine" in kind else "dispatch"
        out.append(Figure("v2", "fp8" if md.get("use_fp8_dispatch") else "bf16", op, sms, us,
                          "mean", "slowest", variant=f"{kind} kernels", role=role,
                          detail={"mode": md, "slowest_rank": slow,
                                  "ranks": {str(r): v for r, v in sorted(ranks.items())}}))
    return out


# ---- Hybrid-EP -------------------------------------------------------------------------------

HEP_SECTION = re.compile(r"=== (?P<what>Torch API|Kernel) Benchmark \((?P<dtype>BF16|FP8), (?P<world>\d+) ranks\) ===")
HEP_API = re.compile(r"^(?P<label>[^:]+?):\s+(?P<gbs>\S+) GB/s \(NVL\), t: (?P<avg>[\d.]+) us "
                     r"\[min=(?P<min>[\d.]+), max=(?P<max>[\d.]+)\]")
HEP_KERNEL = re.compile(r"^(?P<label>.+?)\(NVL\):\s+(?P<gbs>\S+) GB/s, avg_t=(?P<avg>[\d.]+) us "
                        r"\[min=(?P<min>[\d.]+), max=(?P<max>[\d.]+)\]")


def _hep_variant(label: str) -> Tuple[str, str]:
    """(op, variant) of a label: 'dispatch (BF16)', 'combine', 'dispatch+permute (FP8)',
    'fused combine+unpermute kernel ' ..."""
    plain = re.sub(r"\s*\((?:BF16|FP8)\)", "", label).strip()
    op = "combine" if plain.startswith(("combine", "fused combine")) else "dispatch"
    return op, plain


def parse_hybrid_ep(text: str, sms: int) -> List[Figure]:
    """Per (dtype, op): the API time (primary: the slowest rank's mean, ``max=``) and the kernel
    time from the profiler (alt, the slowest rank's); permute and fused variants as extras. The
    script prints the average over ranks as its headline; it is kept in ``detail``."""
    out: List[Figure] = []
    what, dtype = "", ""
    for line in text.splitlines():
        m = HEP_SECTION.search(line)
        if m or "=== " in line:  # another section (a correctness check) ends the figures
            what, dtype = (m["what"], m["dtype"].lower()) if m else ("", "")
            continue
        if not what:
            continue
        m = HEP_API.search(line) if what == "Torch API" else HEP_KERNEL.search(line)
        if not m or "(RDMA)" in line:
            continue
        op, variant = _hep_variant(m["label"])
        plain = variant in ("dispatch", "combine", "dispatch kernel", "combine kernel")
        role = "extra"
        if plain:
            role = "primary" if what == "Torch API" else "alt"
        kind = "API, cached handle" if what == "Torch API" else "kernel only"
        out.append(Figure("hybrid-ep", dtype, op, sms, float(m["max"]), "mean", "slowest",
                          variant=kind if plain else f"{variant}: {kind}", role=role,
                          detail={"avg_over_ranks_us": float(m["avg"]), "min_over_ranks_us": float(m["min"]),
                                  "max_over_ranks_us": float(m["max"]), "gbps_at_avg": _num(m["gbs"])}))
    return out


# ---- NCCL, symm-mem, FlashInfer (tools/fidelity_calls.py) --------------------------------------

def parse_calls(text: str) -> List[Figure]:
    """The timer's JSON: per op, every rank's samples of the library's plainest call. Primary: the
    slowest rank's median (as epbench's time column); alt: the slowest rank's mean. The backend's
    phases follow (``parse_phases``)."""
    try:
        data = json.loads(text)
    except ValueError:
        return []
    if not isinstance(data, dict):
        return []
    library = data.get("library", "reference")
    dtype = data.get("dtype", "bf16")
    out: List[Figure] = []
    for op in ("dispatch", "combine"):
        ranks = (data.get("samples_us") or {}).get(op) or {}
        per = {int(r): s for r, s in ranks.items() if s}
        if not per:
            continue
        variant = (data.get("variant") or {}).get(op, "all_to_all_single")
        p50 = {r: median(s) for r, s in per.items()}
        avg = {r: mean(s) for r, s in per.items()}
        detail = {"bytes_per_rank": (data.get("bytes") or {}).get(op), "iters": data.get("iters"),
                  "warmup": data.get("warmup")}
        slow = max(p50, key=p50.get)
        out.append(Figure(library, dtype, op, None, p50[slow], "p50", "slowest", variant=variant, role="primary",
                          detail=dict(detail, slowest_rank=slow, p50_us={str(r): v for r, v in sorted(p50.items())})))
        slow = max(avg, key=avg.get)
        out.append(Figure(library, dtype, op, None, avg[slow], "mean", "slowest", variant=variant, role="alt",
                          detail=dict(detail, slowest_rank=slow, mean_us={str(r): v for r, v in sorted(avg.items())})))
    return out + parse_phases(data.get("phases") or {}, library, dtype)


def parse_phases(phases: Dict[str, Any], library: str, dtype: str) -> List[Figure]:
    """Per call mode and op: the rank whose unmarked call is slowest (by median), its whole call
    (role ``whole``; the sum of its phases' medians in ``detail``) and the median of each phase
    on that rank (role ``phase``, in the order they ran; the largest over the ranks in ``detail``)."""
    out: List[Figure] = []
    for mode, rec in phases.items():
        for op in ("dispatch", "combine"):
            whole = {int(r): median(s) for r, s in ((rec.get("whole_us") or {}).get(op) or {}).items() if s}
            if not whole:
                continue
            slow = max(whole, key=whole.get)
            per_phase = (rec.get("phases_us") or {}).get(op) or {}
            order = [ph for ph in (rec.get("order") or {}).get(op, []) if per_phase.get(ph, {}).get(str(slow))]
            mine = {ph: median(per_phase[ph][str(slow)]) for ph in order}
            wrong = (rec.get("wrong") or {}).get(op) or {}
            out.append(Figure(library, dtype, op, None, whole[slow], "p50", "slowest",
                              variant=f"{mode} mode: whole call", role="whole",
                              detail={"mode": mode, "rank": slow, "sum_of_phases_us": sum(mine.values()),
                                      "p50_us": {str(r): v for r, v in sorted(whole.items())},
                                      "wrong": sum(int(v) for v in wrong.values())}))
            for i, ph in enumerate(order):
                out.append(Figure(library, dtype, op, None, mine[ph], "p50", "slowest",
                                  variant=f"{mode} mode: {ph}", role="phase",
                                  detail={"mode": mode, "phase": ph, "order": i, "rank": slow,
                                          "max_over_ranks_us": max(median(s) for s in per_phase[ph].values() if s)}))
    return out
