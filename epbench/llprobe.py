"""``epbench probe``: where the low-latency kernels' fixed cost goes (issue 24; notes/LATENCY.md).

    epbench probe --tokens 1,32,128 --sms 32,132

World 1 on one GPU (no link crossed), DeepSeek-V3 decode shape by default (hidden 7168, top-8,
fp8 dispatch, bf16 combine). Every call is a CUDA-graph replay timed with device events exactly as
the driver times it (epbench.timing.Timer: a device sleep first, so the host's launch is never
timed). Per replay, each block's thread 0 also stores %globaltimer at the kernels' phase
boundaries (csrc/ll_common.cuh, LlStamp); a part's time is the step between two boundaries taken
over the whole grid (the first block to start, then the last block to pass each boundary), so the
parts add up to the kernel's span and `call - span` is what the stamps cannot see: the graph
launch, block dispatch before the first stamp and the drain after the last.

Rows:
- probe kernels (csrc/api.h, ep_ll_probe) of the same grid: `empty` (launch floor), `sync` (the
  grid-wide release / wait / finish handshake alone),
  `chase` (16 dependent global loads by one thread per block: span / 16 ~ one memory round trip),
  `fence` (16 x store + fence.acq_rel.sys), `timer` (the smallest step of %globaltimer, ns);
  with several ranks also `ping` and `ping-combine`: the least a decode call across the links does (with
  --spread; ranks sharing one GPU ping within its memory), one row each way and the wait for its proof
  (warp 0 of block b sends one row from every load in flight to peer me + 1 + b, a flag behind a
  system-scope fence, then waits for peer me - 1 - b's flag: no ids, no counts, no copy into expert
  slots; left out, with a line saying so, where the grid has fewer blocks than peers); `ping` with the
  dispatch's row (hidden bytes in fp8, hidden x 2 in bf16), `ping-combine` with the combine's (hidden x 2); `partA` is the flag issued, the rest of the span the wait;
- dispatch and combine per tokens x variant, each verified once (#wrong) before it is timed:
  `grid` (ll_sync grid, the grid-wide handshakes); `token` (ll_sync token: per-token flags, no
  grid-wide step; its stamps mark warp 0's progress, there being no block barrier to stamp: its
  `sent` and `released` stamps are consecutive instructions, so a long `release` there is thread 0's
  stamp store waiting to issue behind the SM's stores to peers, i.e. the links draining what the push
  put in flight (4 x H200, 2026-11-27: notes/LATENCY-NEXT.md); `waited` is warp 0 having every
  source's token count (T word));
  `warps4` / `warps8` (grid with 4 / 8 warps per block); `token-warps4` (token with 4). warps8 and
  token-warps4 only when asked for;
- token dispatches with parts left out, to split its time (only when asked for; a dispatch row each,
  `wrong` empty: their outputs are wrong by design, so they are timed unverified, on a backend of their
  own that never runs a combine, each replay after every rank's previous one as always):
  `token-noown` (no own-row units), `token-norecv` (each flag waited for, no receive copy),
  `token-peers` (only the peer rows, their flags and the count words: no own rows, no scales or tmap /
  tw entries, no receive copy), `token-nofence` (each peer row's flag stored without the release fence that
  orders the row before it: what those fences cost the send; a receiver may copy a row before it lands) and
  `token-peers-nofence` (both).

Prints one table, a line per row as it is measured (us; p50 unless marked), and records every
number in a results folder (meta.json, results.csv: one line per row, samples.csv: every rank's
per-call times; `epbench report` prints the table again); `--csv PATH` also writes the rows there
in the probe's column order.

`--chain K` (a comma list, default 1): each graph holds K back-to-back calls of its op (probe
kernels too), and `call` is the event pair over one replay divided by K, so the ~4 us that the
event pair costs by itself is spread over K calls. Every call of a chain overwrites the stamp
buffer, so the parts are those of the LAST call of the chain; `outside` (call - span) is then what
one call costs beyond its stamps inside a graph (the gap to the previous kernel and the drain),
the event pair mostly excluded. Verification replays the chained graph once: every call of it
writes the same outputs from the same inputs. A chain is refused with --nproc > 1: a source
writes a peer's stage for dispatch n + 1 only after its combine n (the buffer-reuse argument in
csrc/ll_dispatch.cu), so back-to-back dispatches of several ranks would overwrite rows a peer is
still reading.

`--nproc N` (default 1): N ranks share the first visible GPU, started under torchrun by epbench's
launcher (gloo control plane, as `epbench run --nproc N` on one GPU); `--mps` starts a
private MPS daemon for them as `epbench run --mps` does, and the header says whether MPS was on
(epbench.launch.mps_active). Each rank dispatches its own T tokens routed over all N x
experts-per-rank experts (epbench.routing.route_rank per rank, as the driver routes a real world
size) and verifies what it received and combined (`wrong`: summed over ranks). Each timed call is
preceded by the driver's alignment (Comm.sync through Timer: each rank empties its stream, meets
the others at a barrier, then queues the device sleep again), so rank i's call n meets the other
ranks' call n. Rank 0 prints the row: `call` (p50, p99, max) are the samples of the slowest rank
(highest p50; column `slow`); the parts come from every rank's blocks together. %globaltimer is one
clock per GPU, so the stamps of different processes on one GPU compare directly: boundary 0 is the
first block of any rank, each later boundary the last block of any rank to pass it. Skew between
ranks therefore shows in three places: `rskew` (the last rank's first block start minus the first
rank's: how far the barrier and the device sleep left the ranks apart), `skew` (every block's
spread, rskew included), and `wait`/`span`, since a rank that starts early waits there for its
peers' counts and flags. The extra columns (chain; ranks, slow, rskew) are printed only when a
chain > 1 or several ranks are asked for; the CSV always has chain and ranks.

`--spread` (with --nproc N >= 2): each rank on a GPU of its own (the first N visible), so the calls
cross the links as `epbench run` on N GPUs does. %globaltimer is then one clock per GPU, with
offsets between GPUs far larger than a call, so no stamp is compared across ranks: each rank's
parts come from its own blocks on its own clock (boundary 0 its own first block), the row shows
the slowest rank's (highest call p50; `slow`), `rskew` is not measured ("-"), and the CSV adds
every rank's span and wait p50 (`span_p50_rank<r>`, `wait_p50_rank<r>`): a rank whose peers start
late shows it as a longer wait than theirs.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

from epbench.errors import UserError
from epbench.metrics import interpolated_percentile as percentile

PARTS = ["stage", "send", "release", "wait", "receive", "finish"]  # LlStamp 1..6 (after kLlStart)
PROBE_MODES = {"empty": 0, "sync": 1, "chase": 2, "fence": 3, "timer": 4}  # name -> ep_ll_probe mode
PING_MODES = {"ping": 5, "ping-combine": 6}  # with several ranks only (a block for each peer)
# name -> (warps per block or None for the backend's default, option ll_sync)
VARIANTS = {"grid": (None, "grid"), "token": (None, "token"), "warps4": (4, "grid"), "warps8": (8, "grid"),
            "token-warps4": (4, "token"), "token-noown": (None, "token"), "token-norecv": (None, "token"),
            "token-peers": (None, "token"), "token-nofence": (None, "token"),
            "token-peers-nofence": (None, "token"), "token-line": (None, "token"), "token-line128": (None, "token")}
# token-sync calls with other epbench-ll options (csrc/ll_common.cuh, LlDispatchPlace): verified like `token`, on
# the token backend switched to these options for their rows only (line sends whole rows)
TUNED = {"token-line": {"dispatch_place": "line", "dispatch_units": "row"},
         "token-line128": {"dispatch_place": "line128", "dispatch_units": "row"}}
TUNABLE = ("dispatch_units", "dispatch_place")  # the options TUNED may set, in the order set


def tuned_options(variant: str, token: Dict[str, Any]) -> List[Tuple[str, Any]]:
    """The token backend's TUNABLE options, in the order to set them, for `variant`'s rows: TUNED's values for a
    tuned variant, else the backend's own (`token`: its effective_config), so no row inherits a tuned one's."""
    return [(k, TUNED.get(variant, {}).get(k, token[k])) for k in TUNABLE]


def tuned_label(variant: str, cfg: Dict[str, Any]) -> str:
    """How the header names a tuned variant's options."""
    return " ".join(f"{k} {cfg.get(k)}" for k in TUNED[variant])
# token dispatches with parts left out (LlProbeSkip, csrc/ll_common.cuh: 1 own rows, 2 receive copies, 4 the scales
# and tmap / tw stores beside a peer row, 8 the fence before a peer row's flag): timed alone, on a backend of their
# own, never verified
SKIPS = {"token-noown": 1, "token-norecv": 2, "token-peers": 7, "token-nofence": 8, "token-peers-nofence": 15}
DEFAULT_VARIANTS = "grid,token,warps4"
STAMPS_PER_BLOCK = 8


def call_parts(blocks: Sequence[Sequence[int]]) -> Dict[str, float]:
    """One call's parts in us from its per-block stamps (ns; [block][LlStamp]): boundary 0 is the
    first block's start, boundary i the last block to pass stamp i; part i = boundary i - boundary
    i - 1, so the parts add up to `span` (first start to last end). `skew`: last start - first."""
    starts = [b[0] for b in blocks]
    bound = [min(starts)] + [max(b[i] for b in blocks) for i in range(1, len(PARTS) + 1)]
    out = {name: (bound[i + 1] - bound[i]) / 1e3 for i, name in enumerate(PARTS)}
    out["span"] = (bound[-1] - bound[0]) / 1e3
    out["skew"] = (max(starts) - min(starts)) / 1e3
    return out


def probe_parts(blocks: Sequence[Sequence[int]]) -> Dict[str, float]:
    """A probe kernel's span and part A (start to stamp 2, ``sent``), in us, over the grid."""
    b0 = min(b[0] for b in blocks)
    return {"span": (max(b[6] for b in blocks) - b0) / 1e3, "a": (max(b[2] for b in blocks) - b0) / 1e3}


def summarize(per_call: Sequence[Dict[str, float]], call_us: Sequence[float]) -> Dict[str, float]:
    """p50 / p99 of every part over the calls, the event-timed call (p50, p99, max) and
    `outside` = p50 of (call - span) per call."""
    row: Dict[str, float] = {"call_p50": percentile(call_us, 50), "call_p99": percentile(call_us, 99),
                             "call_max": max(call_us) if call_us else float("nan")}
    keys = per_call[0].keys() if per_call else []
    for k in keys:
        vals = [c[k] for c in per_call]
        row[f"{k}_p50"] = percentile(vals, 50)
        row[f"{k}_p99"] = percentile(vals, 99)
    if per_call and "span" in per_call[0]:
        row["outside_p50"] = percentile([t - c["span"] for t, c in zip(call_us, per_call)], 50)
    return row


def per_call_us(samples_us: Sequence[float], chain: int) -> List[float]:
    """One call's time from the event pair around a replay of a chain of ``chain`` calls."""
    return [t / chain for t in samples_us]


def merge_ranks(rank_hist: Sequence[Sequence[Sequence[Sequence[int]]]]) -> List[List[Sequence[int]]]:
    """Per call, every rank's blocks in one grid ([rank][call][block][LlStamp] -> [call][block]):
    on one GPU the stamps of all ranks are read from one clock."""
    calls = len(rank_hist[0]) if rank_hist else 0
    if any(len(h) != calls for h in rank_hist):
        raise ValueError("every rank must have stamps for the same number of calls")
    return [[b for h in rank_hist for b in h[i]] for i in range(calls)]


def rank_skew_us(rank_blocks: Sequence[Sequence[Sequence[int]]]) -> float:
    """One call's skew between ranks ([rank][block][LlStamp]), in us: the last rank's first block
    start minus the first rank's."""
    firsts = [min(b[0] for b in blocks) for blocks in rank_blocks]
    return (max(firsts) - min(firsts)) / 1e3


def summarize_ranks(rank_hist: Sequence[Sequence[Sequence[Sequence[int]]]],
                    rank_us: Sequence[Sequence[float]], parts) -> Dict[str, float]:
    """summarize() of a row measured on every rank: the parts of every rank's blocks together,
    the call times of the slowest rank (highest p50: ``slow_rank``), each rank's p50 and, with
    several ranks, the p50 and p99 of the skew between ranks. ``outside`` is then the slowest
    rank's call minus the span of all ranks together: it can be negative when the ranks start
    further apart than the slowest rank's own call lasts beyond its stamps."""
    p50s = [percentile(us, 50) for us in rank_us]
    slow = max(range(len(p50s)), key=lambda r: p50s[r])
    row = summarize([parts(blocks) for blocks in merge_ranks(rank_hist)], rank_us[slow])
    row["ranks"] = len(rank_us)
    if len(rank_us) > 1:
        skews = [rank_skew_us([h[i] for h in rank_hist]) for i in range(len(rank_hist[0]))]
        row.update({"slow_rank": slow, "rank_skew_p50": percentile(skews, 50),
                    "rank_skew_p99": percentile(skews, 99)})
        row.update({f"call_p50_rank{r}": v for r, v in enumerate(p50s)})
    return row


def summarize_spread(rank_hist: Sequence[Sequence[Sequence[Sequence[int]]]],
                     rank_us: Sequence[Sequence[float]], parts) -> Dict[str, float]:
    """summarize() of a row measured with one GPU per rank: each rank's parts from its own blocks
    only (the GPUs' clocks are not one clock), the row's figures those of the slowest rank
    (highest call p50: ``slow_rank``), then each rank's call, span and wait p50 (wait only for
    the kernels' parts: the probe kernels have none)."""
    p50s = [percentile(us, 50) for us in rank_us]
    slow = max(range(len(p50s)), key=lambda r: p50s[r])
    own = [summarize([parts(blocks) for blocks in hist], us) for hist, us in zip(rank_hist, rank_us)]
    row = dict(own[slow], ranks=len(rank_us), slow_rank=slow)
    for r, (v, o) in enumerate(zip(p50s, own)):
        row[f"call_p50_rank{r}"] = v
        row.update({f"{k}_p50_rank{r}": o[f"{k}_p50"] for k in ("span", "wait") if f"{k}_p50" in o})
    return row


def extra_columns(chains: Sequence[int], world: int) -> List[str]:
    """The columns appended to the table: chain when a chain > 1 is asked for, the ranks' with
    several ranks (the default table keeps its columns)."""
    return (["chain"] if any(c != 1 for c in chains) else []) + \
        (["ranks", "slow_rank", "rank_skew_p50"] if world > 1 else [])


def format_table(rows: List[Dict[str, object]], extra: Sequence[str] = ()) -> str:
    """The compact table the probe prints: one line per row, us, p50 unless marked; ``extra``
    columns (extra_columns) at the end."""
    cols = ["sms", "op", "tokens", "variant", "wrong", "call_p50", "call_p99", "call_max", "outside_p50",
            "span_p50"] + [f"{p}_p50" for p in ["skew"] + PARTS] + ["a_p50"] + list(extra)
    head = {"call_p50": "call", "call_p99": "p99", "call_max": "max", "outside_p50": "outside",
            "span_p50": "span", "a_p50": "partA", "slow_rank": "slow", "rank_skew_p50": "rskew"}
    names = [head.get(c, c.replace("_p50", "")) for c in cols]

    def cell(v: object) -> str:
        if v is None or v == "":
            return "-"
        if isinstance(v, float):
            return "-" if v != v else f"{v:.2f}"
        return str(v)

    lines = [" ".join(f"{n:>7}" for n in names)]
    for r in rows:
        lines.append(" ".join(f"{cell(r.get(c)):>7}" for c in cols))
    return "\n".join(lines)


def column_order(keys: Sequence[str]) -> List[str]:
    """results.csv's columns in the probe's order: those of the first rows first, then the ones
    added later (chain, several ranks) after them."""
    later = [k for k in keys if k in ("chain", "ranks", "slow_rank") or
             k.startswith(("rank_skew_", "call_p50_rank", "span_p50_rank", "wait_p50_rank"))]
    return [k for k in keys if k not in later] + later


def write_csv(run_dir: Path, path: Path) -> Path:
    """The rows of the probe run in ``run_dir`` (its results.csv) into ``path``, in the probe's
    column order (column_order); returns ``path``."""
    import pandas as pd

    from epbench.results import RESULTS

    df = pd.read_csv(run_dir / RESULTS, dtype=str, keep_default_na=False)  # the cells as written
    df = df.drop(columns=[c for c in ("status",) if c in df])
    try:
        df[column_order(list(df.columns))].to_csv(path, index=False)
    except OSError as e:
        raise UserError(f"--csv: {path}: cannot write ({e.strerror or type(e).__name__})") from None
    return path


def table_rows(df: Any) -> List[Dict[str, object]]:
    """results.csv's rows as the table takes them: gaps as None, whole numbers as integers."""
    rows = []
    for r in df.to_dict("records"):
        rows.append({k: None if isinstance(v, float) and v != v else
                     int(v) if k in WHOLE and isinstance(v, float) else v for k, v in r.items()})
    return rows


WHOLE = ("sms", "tokens", "wrong", "chain", "ranks", "slow_rank", "timer_step_ns")


def one_gpu(visible: Optional[str]) -> str:
    """CUDA_VISIBLE_DEVICES for ranks that share one GPU: the first of those visible now."""
    return (visible or "0").split(",")[0].strip() or "0"


# -- what a probe run measures ------------------------------------------------------------------

@dataclass(frozen=True)
class ProbeOptions:
    tokens: Tuple[int, ...] = (1, 32, 128)
    sms: Tuple[int, ...] = (32, 132)
    hidden: int = 7168
    topk: int = 8
    experts_per_rank: int = 64
    dtype: str = "fp8"
    variants: Tuple[str, ...] = tuple(DEFAULT_VARIANTS.split(","))
    warmup: int = 50
    iters: int = 500
    chain: Tuple[int, ...] = (1,)
    spread: bool = False  # one GPU per rank (--spread)


def probe_options(tokens: str, sms: str, hidden: int, topk: int, experts_per_rank: int, dtype: str,
                  variants: str, warmup: int, iters: int, chain: str, nproc: int,
                  spread: bool = False) -> ProbeOptions:
    """``epbench probe``'s options, checked; UserError (one line) for the first one wrong."""
    from epbench import options, scenario

    bad = [v for v in variants.split(",") if v and v not in VARIANTS]
    if bad:
        raise UserError(f"--variants: unknown {bad}; choose from {list(VARIANTS)}")
    chains = scenario.maybe_int_list(chain, "--chain")
    if nproc < 1:
        raise UserError(f"--nproc: must be at least 1, got {nproc}")
    if spread and nproc < 2:
        raise UserError(f"--spread puts each rank on a GPU of its own: needs --nproc 2 or more, got {nproc}")
    if nproc > 1 and max(chains) > 1:
        raise UserError("--chain > 1 needs --nproc 1: with several ranks a dispatch may overwrite a peer's "
                        "rows only after a combine (csrc/ll_dispatch.cu, buffer reuse)")
    if dtype not in ("fp8", "bf16"):
        raise UserError(f"--dtype: must be fp8 or bf16, got {scenario.shown(dtype)}")
    for opt, v, low in (("--warmup", warmup, 0), ("--iters", iters, 1)):
        if not low <= v <= scenario.MAX_ITERS:
            raise UserError(f"{opt}: must be at least {low} and at most {scenario.MAX_ITERS}, got {v}")
    token_list = scenario.maybe_int_list(tokens, "--tokens", scenario.MAX_SHAPE["tokens_per_rank"])
    # the probe's token-sync backend takes its other options from the environment, sized (auto resolved) at the
    # largest token count: a line placement there that would get chunk units is refused here, before any rank starts
    if token_list and any(VARIANTS[v][1] == "token" for v in variants.split(",") if v):
        options.check_ll_lines({"epbench-ll": {"ll_sync": "token"}}, [max(token_list)], "epbench probe",
                               fix="set EPBENCH_LL_DISPATCH_UNITS=row")
    return ProbeOptions(tokens=token_list,
                        sms=scenario.maybe_int_list(sms, "--sms", scenario.MAX_SMS), hidden=hidden, topk=topk,
                        experts_per_rank=experts_per_rank, dtype=dtype,
                        variants=tuple(v for v in variants.split(",") if v), warmup=warmup, iters=iters,
                        chain=chains, spread=spread)


def probe_scenario(o: ProbeOptions, nproc: int) -> Any:
    """The shape the probe runs, as a scenario (validated like a scenario file; recorded in
    meta.json): ``nproc`` ranks on one GPU, uniform routing (seed 0), low-latency mode."""
    from epbench.scenario import parse

    return parse({"name": "probe", "mode": "low_latency",
                  "description": "epbench probe: the low-latency kernels' parts",
                  "model": {"hidden": o.hidden, "tokens_per_rank": max(o.tokens), "topk": o.topk,
                            "experts_per_rank": o.experts_per_rank, "dispatch_dtype": o.dtype},
                  "topology": {"nodes": 1, "gpus_per_node": nproc},
                  "routing": {"kind": "uniform", "seed": 0},
                  "bench": {"warmup": o.warmup, "iters": o.iters, "backends": ["epbench-ll"],
                            "sms": list(o.sms), "device": "cuda"}}, "epbench probe")


def header_line(info: Dict[str, Any]) -> str:
    """The line above the table: the GPU, the ranks (and MPS), the shape and the timing."""
    world = int(info.get("world") or 1)
    where = "world 1" if world == 1 else f"world {world}: {world} ranks share this GPU"
    if info.get("spread"):
        where = (f"world {world}: one GPU per rank (each rank's parts on its own clock, the slowest rank's "
                 f"shown)")
    if info.get("mps"):
        where += f", MPS {info['mps']}"
    chains = list(info.get("chains") or [1])
    chained = "" if chains == [1] else \
        f", chains {','.join(map(str, chains))} (call = replay / chain; stamps of the chain's last call)"
    kernels = info.get("kernels") or {}  # what the options in force made of the kernels (EPBENCH_LL_*)
    cfg = kernels.get("token") or kernels.get("grid") or {}
    if cfg:
        chained += f", combine order {cfg.get('combine_order')}"
    if "token" in kernels:
        tk = kernels["token"]
        chained += (f", token dispatch units {tk.get('dispatch_units')}, place {tk.get('dispatch_place', 'stage')}, "
                    f"release {tk.get('combine_release')}")
        if info.get("sized_tokens"):  # one backend for every token count: `run` sizes (and resolves auto) per point
            chained += f" (resolved once, at {info['sized_tokens']} tokens, for every row)"
    for v in kernels:
        if v in TUNED:
            chained += f", {v}: {tuned_label(v, kernels[v])}"
    return (f"# {info.get('device', '?')}, {where}, hidden {info.get('hidden')}, top-{info.get('topk')} of "
            f"{info.get('experts')} experts, {info.get('dtype')} dispatch, {info.get('iters')} graph replays "
            f"after {info.get('warmup')}, {info.get('warps')} warps unless named{chained}")


class _Ranks:
    """This process's place among the ranks sharing the GPU; at world 1 no call is aligned and
    nothing is gathered through the process group."""

    def __init__(self, job: Any) -> None:
        self.job, self.comm = job, job.comm
        self.rank, self.world = job.comm.rank, job.comm.world

    @property
    def align(self):
        """The driver's cross-rank alignment before a timed call (None at world 1)."""
        return self.comm.sync if self.world > 1 else None

    def sync(self) -> None:
        if self.world > 1:
            self.comm.sync()

    def gather(self, obj: object) -> Optional[List[object]]:
        """Every rank's ``obj`` on rank 0 (rank order); None on the other ranks."""
        return [obj] if self.world == 1 else self.job.gather(obj)


def capture(fn, chain: int):
    """A CUDA graph of ``chain`` back-to-back calls of ``fn`` (nothing runs while capturing), and
    what the last call returned."""
    import torch

    g = torch.cuda.CUDAGraph()
    torch.cuda.synchronize()
    out = None
    with torch.cuda.graph(g):
        for _ in range(chain):
            out = fn()
    torch.cuda.synchronize()
    return g, out


def measure(job: Any) -> int:
    """Every row of one probe job (session.Job) on this rank: probe kernels, then dispatch and
    combine per tokens x variant x chain, each verified before it is timed (the SKIPS variants: a
    dispatch alone, unverified by design; `wrong` empty). Rank 0 prints each
    row as it is measured and records it (its samples: every rank's per-call times). Returns the
    wrong rows summed over ranks (on every rank)."""
    import torch

    from epbench import launch
    from epbench.contract import RankSetup
    from epbench.backends.epbench_ll import EpbenchLowLatencyBackend
    from epbench.inputs import dispatch_input, make_tokens
    from epbench.routing import route_rank
    from epbench.scenario import Routing
    from epbench.timing import Timer
    from epbench.verify import check_ll_combine, check_ll_dispatch, ll_expert_output

    o, comm = job.options, job.comm
    ranks = _Ranks(job)
    if o.spread and torch.cuda.device_count() < ranks.world:
        raise UserError(f"--spread: {ranks.world} ranks need {ranks.world} visible GPUs, "
                        f"{torch.cuda.device_count()} visible")
    if not o.spread and torch.cuda.device_count() != 1:
        raise UserError("probe ranks must share one GPU: start them with --nproc N "
                        "(or make one GPU visible to torchrun's ranks), or give --spread for one GPU per rank")
    dev = comm.device
    tokens, sms_list, variants, chains = list(o.tokens), list(o.sms), list(o.variants), list(o.chain)
    epr = o.experts_per_rank
    setup = RankSetup(rank=ranks.rank, world=ranks.world, gpus_per_node=ranks.world, device=dev,
                      hidden=o.hidden, max_tokens_per_rank=max(tokens), topk=o.topk, experts_per_rank=epr,
                      dispatch_dtype=o.dtype, timeout_s=5.0, mode="low_latency")
    # one backend per ll_sync (the two keep different flags and epochs; the sync is fixed per backend)
    backends = {sync: EpbenchLowLatencyBackend(setup, ll_sync=sync)
                for sync in dict.fromkeys(VARIANTS[v][1] for v in ["grid"] + variants if v not in SKIPS)}
    kernels = {sync: b.effective_config() for sync, b in backends.items()}
    for v in variants:
        if v in TUNED:  # what the tuned rows ran with
            kernels[v] = dict(kernels["token"], **TUNED[v])
    if any(v in SKIPS for v in variants):  # its own flags and epochs: no verified call follows a skipping one
        backends["skip"] = EpbenchLowLatencyBackend(setup, ll_sync="token")
        kernels.setdefault("token", backends["skip"].effective_config())  # what the skipping rows ran with
    be = backends["grid"]
    default_warps = be.warps
    n = o.warmup + o.iters
    extra = extra_columns(chains, ranks.world)
    lead = ranks.rank == 0
    wrong_total = 0

    if lead:
        info = {"device": torch.cuda.get_device_name(dev), "world": ranks.world, "hidden": o.hidden,
                "topk": o.topk, "experts": epr * ranks.world, "dtype": o.dtype, "iters": o.iters,
                "warmup": o.warmup, "warps": default_warps, "chains": chains, "spread": o.spread,
                "kernels": kernels, "sized_tokens": max(o.tokens),
                "mps": ("on" if launch.mps_active() else "off") if (ranks.world > 1 and not o.spread) or job.plan.mps
                else None}
        job.open(job.meta(verb="probe", probe=info))
        print(header_line(info), flush=True)
        print(format_table([], extra), flush=True)

    def show(row: Dict[str, object], rank_us: Sequence[Sequence[float]]) -> None:
        """Rank 0: the row printed and recorded, with every rank's per-call times as samples."""
        nonlocal wrong_total
        wrong_total += int(row["wrong"] or 0)
        print(format_table([row], extra).splitlines()[-1], flush=True)
        point = {k: row[k] for k in ("sms", "op", "tokens", "variant", "chain")}
        job.record([row], [dict(point, rank=r, iter=i, time_us=us) for r, per in enumerate(rank_us)
                           for i, us in enumerate(per)])

    def timed(graphs: List, stamps: torch.Tensor, parts, chain: int) -> List[Tuple[Dict[str, float], List]]:
        """Replays each graph of ``graphs`` n times in turn, each replay aligned across ranks; per
        graph on rank 0: the row's figures from every rank (summarize_ranks) and every rank's
        per-call times; [] elsewhere."""
        timers = [Timer(dev, n) for _ in graphs]
        hist = [torch.empty((n,) + tuple(stamps.shape), dtype=torch.int64, device=dev) for _ in graphs]
        for i in range(n):
            for j, g in enumerate(graphs):
                timers[j].time(i, g.replay, align=ranks.align)
                hist[j][i].copy_(stamps)  # queued after the end event: not timed
        out = []
        for j in range(len(graphs)):
            got = ranks.gather((per_call_us(timers[j].samples_us(o.warmup), chain), hist[j][o.warmup:].cpu()))
            if got is not None:
                rank_us = [us for us, _ in got]
                summary = summarize_spread if o.spread else summarize_ranks
                out.append((summary([h.tolist() for _, h in got], rank_us, parts), rank_us))
        return out

    def base(sms: int, op: str, t: object, variant: str, wrong: object, chain: int,
             res: Dict[str, float]) -> Dict[str, object]:
        """A row: its point, its figures, then chain (the CSV's earlier columns keep their places)."""
        return {"sms": sms, "op": op, "tokens": t, "variant": variant, "wrong": wrong, **res, "chain": chain}

    def input_of(t: int, salt: int, rank: int):
        """Rank ``rank``'s dispatch input: its own tokens, routed over every rank's experts."""
        routing = route_rank(Routing(kind="uniform", seed=0), t, o.topk, epr * ranks.world, rank)
        return dispatch_input(make_tokens(t, o.hidden, 0, rank, salt, dev), routing, o.dtype, dev)

    def skip_rows(sms: int, t: int, vname: str, stamps: torch.Tensor) -> None:
        """A token dispatch with the parts of SKIPS[vname] left out, timed alone per chain (no combine:
        its outputs are wrong by design; `wrong` empty)."""
        sb = backends["skip"]
        sb.set_probe(stamps)
        sb.set_probe_skip(SKIPS[vname])
        inp = input_of(t, sms * 1000 + t, ranks.rank)
        for chain in chains:
            g_d, _ = capture(lambda: sb.ll_dispatch(inp, sms), chain)
            for r, rank_us in timed([g_d], stamps, call_parts, chain):
                show(base(sms, "dispatch", t, vname, "", chain, r), rank_us)
            sb.check_errors()
        sb.set_probe_skip(0)
        sb.set_probe(None)

    for sms in sms_list:
        stamps = torch.zeros(sms, STAMPS_PER_BLOCK, dtype=torch.int64, device=dev)
        for chain in chains:
            pings = PING_MODES if 1 < ranks.world <= sms + 1 else {}
            if lead and ranks.world > sms + 1 and chain == chains[0]:
                print(f"# no ping rows at {sms} SMs: a ping needs a block for each of the {ranks.world - 1} peers",
                      flush=True)
            for name, mode in dict(PROBE_MODES, **pings).items():
                be.warps = default_warps
                be.set_probe(stamps)
                g, _ = capture(lambda: be.probe_kernel(mode, sms), chain)
                measured = timed([g], stamps, probe_parts, chain)
                be.check_errors()  # a ping that gave up waiting for a peer's flag stops here, naming it
                for res, rank_us in measured:
                    row = base(sms, "probe", "", name, "", chain, res)
                    if name == "timer":
                        row["timer_step_ns"] = int(stamps[0, 7])
                        row["a_p50"] = float(row["timer_step_ns"])  # shown in the partA column (ns)
                    show(row, rank_us)
        for t in tokens:
            for vname in variants:
                warps, sync = VARIANTS[vname]
                if vname in SKIPS:
                    skip_rows(sms, t, vname, stamps)
                    continue
                be = backends[sync]
                be.warps = warps or default_warps
                if sync == "token":  # every rank switches before the same rows (units first: line needs row)
                    for k, value in tuned_options(vname, kernels["token"]):
                        getattr(be, f"use_{k}")(value)
                be.set_probe(stamps)
                salt = sms * 1000 + t
                inp = input_of(t, salt, ranks.rank)
                for chain in chains:
                    g_d, out = capture(lambda: be.ll_dispatch(inp, sms), chain)
                    g_c, got = capture(lambda: be.ll_combine(out, sms), chain)
                    be.poison()
                    ranks.sync()
                    g_d.replay()
                    torch.cuda.synchronize()
                    be.check_errors()
                    d = check_ll_dispatch(out, ranks.rank, ranks.world, epr, lambda s: input_of(t, salt, s))
                    be.ll_combine_input(out).copy_(ll_expert_output(out.x, out.x_scales, ranks.rank * epr))
                    ranks.sync()
                    g_c.replay()
                    torch.cuda.synchronize()
                    be.check_errors()
                    c = check_ll_combine(got, inp)
                    wrong = ranks.gather((d.wrong, c.wrong))
                    # y stays as filled: the timed combines read real expert outputs, never zeros
                    res = timed([g_d, g_c], stamps, call_parts, chain)
                    be.check_errors()
                    for k, (op, (r, rank_us)) in enumerate(zip(("dispatch", "combine"), res)):
                        show(base(sms, op, t, vname, sum(w[k] for w in wrong), chain, r), rank_us)
        for b in backends.values():
            b.set_probe(None)
            b.warps = default_warps
        be = backends["grid"]
    for b in backends.values():
        b.close()
    return job.rank0_count(wrong_total)


if __name__ == "__main__":
    raise SystemExit("python -m epbench.llprobe is now `epbench probe` (the same options; see `epbench probe --help`)")
