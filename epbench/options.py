"""Backend options: every tuning knob of a backend, typed, validated with the scenario and recorded.

A scenario sets them under ``backend_options`` (backend name -> key -> value); ``--option
[backend.]key=value`` on run / sweep overrides one (a bare key names the one backend that has it).
An environment variable may set an option too (``env`` below); what was asked for is resolved once
per backend (given > environment > default) and handed to the backend's constructor, and what ran
(after the kernels' clamps and fallbacks) goes into every results row (columns ``impl``, ``options``).
Defaults are the measured winners (notes/KERNELS.md, notes/NVSHMEM.md). No torch here: the CLI
validates before anything heavy is imported.

``DIAGNOSTICS`` are the timing harness's own switches (no backend's), typed and checked the same way
but set only by their environment variable, for one experiment at a time; a run that has one set
names it in its timing note (epbench/timing.py ``method``), and meta.json's ``env`` keeps it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from epbench.errors import UserError


@dataclass(frozen=True)
class Option:
    kind: type  # int, float or str
    default: Any
    doc: str
    choices: Optional[Sequence[Any]] = None
    low: Optional[float] = None  # inclusive bounds for numbers (open for float when open_range)
    high: Optional[float] = None
    open_range: bool = False
    env: Optional[str] = None
    aliases: Tuple[Tuple[str, str], ...] = ()  # old spellings accepted for a str value

    def parse(self, value: Any, where: str) -> Any:
        """``value`` (from YAML, or a string from the command line or environment) as this option's type."""
        v = value
        if isinstance(v, str) and self.kind is not str:
            try:
                v = self.kind(v.strip())
            except ValueError:
                raise UserError(f"{where}: must be {self._describe()}, got {value!r}") from None
        if self.kind is str and isinstance(v, str):
            v = dict(self.aliases).get(v, v)
        ok = (isinstance(v, self.kind) or (self.kind is float and isinstance(v, int))) and not isinstance(v, bool)
        if ok and self.choices is not None:
            ok = v in self.choices
        if ok and self.low is not None:
            ok = v > self.low if self.open_range else v >= self.low
        if ok and self.high is not None:
            ok = v < self.high if self.open_range else v <= self.high
        if not ok:
            raise UserError(f"{where}: must be {self._describe()}, got {value!r}")
        return float(v) if self.kind is float else v

    def _describe(self) -> str:
        if self.choices is not None:
            return "one of " + ", ".join(map(str, self.choices))
        kind = {int: "an integer", float: "a number", str: "a string"}[self.kind]
        if self.low is not None and self.high is not None:
            return f"{kind} in {'(' if self.open_range else '['}{self.low:g}, {self.high:g}{')' if self.open_range else ']'}"
        return kind


# backend name -> option name -> Option. The backends' constructors take these as keyword arguments.
SCHEMAS: Dict[str, Dict[str, Option]] = {
    "epbench": {
        "dispatch_impl": Option(str, "lean_dyn", "lean_dyn: tokens handed to warps by a counter (won at 16-24 SMs, "
                                "notes/KERNELS.md); lean: static stride (won at 32 SMs)", choices=("lean_dyn", "lean"),
                                env="EPBENCH_DISPATCH_IMPL", aliases=(("lean-dyn", "lean_dyn"),)),
        "dispatch_warps": Option(int, 16, "warps per dispatch block", low=1, high=32, env="EPBENCH_DISPATCH_WARPS"),
        "notify_impl": Option(str, "grid", "notify kernel: grid (num_sms blocks) or staged (one block; "
                              "won at 24 SMs once, notes/KERNELS.md)", choices=("grid", "staged"), env="EPBENCH_NOTIFY_IMPL"),
        "combine_warps": Option(int, 0, "warps per combine block, at most as many as the stages fit "
                                "(0: clamp(128 / num_sms, 8, 16), as measured)", low=0, high=16, env="EPBENCH_COMBINE_WARPS"),
        "combine_stages": Option(int, 2, "stages per combine warp", low=2, high=4, env="EPBENCH_COMBINE_STAGES"),
        "combine_chunk": Option(int, 2048, "bytes per holder and stage of the combine",
                                choices=(1024, 2048, 4096), env="EPBENCH_COMBINE_CHUNK"),
        "own_rows": Option(str, "sm", "who moves a rank's own rows in dispatch: sm (the dispatch kernel stores them "
                           "beside the peers' rows, packed) or ce (the copy engine copies x, scales, ids and weights "
                           "to rows [0, T) of the receive buffer, token by token, tokens not routed to the rank "
                           "left as padding; peers' rows after them; notes/LATENCY-NEXT.md section 3, Plan A) or all "
                           "(every source's rows by token index at source x max_tokens, the peers' copied by copy "
                           "engines after the notify kernel, a small kernel writing the rows' keys: no SM moves a "
                           "row, so the SM count changes little; Plan C); ce and all: rank_major and quantize "
                           "before only", choices=("sm", "ce", "all"),
                           env="EPBENCH_OWN_ROWS"),
        "combine_rows": Option(str, "pull", "who moves the peers' rows in combine: pull (the combine kernel's SMs "
                               "read every holder's row over the link with bulk copies) or ce (each holder's copy "
                               "engine pushes its rows of a source into that source's staging buffer in 16 chunks, "
                               "each followed by a flag, and the source's SMs sum its own and the staged rows, all "
                               "local: issue 34 target 3, Plan B'); ce needs own_rows all (its rows by token index) "
                               "and the same token count on every rank", choices=("pull", "ce"),
                               env="EPBENCH_COMBINE_ROWS"),
        "ce_chunks": Option(int, 16, "combine_rows ce only: a holder pushes a source's rows in chunks of "
                            "max_tokens / ce_chunks rows, each followed by its flag (fewer: less per-chunk overhead, "
                            "a later first chunk); every rank must use the same. Not given, 16 at 2 ranks and 4 at "
                            "3 or more, where every chunk and flag of a holder share one copy stream (4 x H200, "
                            "dsv3x4, 4 SMs: 752 us with 4, 782 with 6, 801 with 5)",
                            choices=(4, 5, 6, 8, 16, 32), env="EPBENCH_CE_CHUNKS"),
        "pull_kernel": Option(str, "auto", "combine_rows pull only: tma (each warp issues its own bulk copies of the "
                              "holders' rows and sums them) or bulk (7 loading warps a SM, each with 3 summing warps, "
                              "2 stages of every holder's 3.5 KiB piece, 4 stages at 2 ranks: the copy-engine combine's "
                              "sum, pulling over the link; the rank-major layout at 4 ranks or fewer) or auto (bulk at 2 "
                              "ranks and at 3-4 ranks below 8 SMs, where it measured faster, else tma; tma wherever combine_warps, "
                              "combine_stages or combine_chunk is given; rows record what ran as combine_impl)",
                              choices=("auto", "tma", "bulk"), env="EPBENCH_PULL_KERNEL"),
        "ce_chunking": Option(str, "even", "combine_rows ce only: even (ce_chunks chunks of one size) or grow (the "
                              "first chunk max_tokens / 16 rows, each next 1.5x the one before, the last the rest: "
                              "the source's sum starts after a small first chunk and the copies stay ahead of it); "
                              "every rank must use the same; grow with ce_chunks given is refused",
                              choices=("even", "grow"), env="EPBENCH_CE_CHUNKING"),
        "ce_streams": Option(int, 2, "combine_rows ce only: the copy streams the chunks alternate over (one stream's "
                             "flag write and next copy overlapping another's copy): at 2 ranks ce_streams a peer, at "
                             "3 or more ce_streams in all, each chunk's copies to every peer on one of them in ring "
                             "order. Not given, 2 at 2 ranks and 1 at 3 or more",
                             choices=(1, 2, 4),
                             env="EPBENCH_CE_STREAMS"),
        "ce_share": Option(int, 100, "own_rows all only: percent of a rank's x rows the copy engines move into "
                           "each peer; the rest go at the same time by plain SM stores on the dispatch's SMs "
                           "(scales, ids and weights always by copy engine): the two engines share the links",
                           choices=(25, 50, 75, 100), env="EPBENCH_CE_SHARE"),
        "fused_stores": Option(int, 16, "quantize fused only: the bytes a lane of the dispatch kernel stores per "
                               "step, 16 (two adjacent bf16 vectors cast together; 2 x H200, 2 ranks, dsv3x4-mxfp8: "
                               "270 us at 8 SMs where 8 took 395; notes/KERNELS.md) or 8 (one vector cast per "
                               "store, the earlier kernel); the bytes that arrive are the same", choices=(8, 16),
                               env="EPBENCH_FUSED_STORES"),
        "em_push": Option(str, "auto", "layout expert_major only: who writes a row into the slots of a rank's "
                          "further experts of its token: receiver (a row crosses to each rank once, into its first "
                          "expert's slot; the receiver's dispatch blocks copy it into the others once every row has "
                          "landed) or sender (the sending warp stores it into every slot: the link carries it once "
                          "per (token, expert), no copy pass; at most 16 dispatch warps) or wide (as receiver, its "
                          "copy pass loading 8 KiB a warp before storing, the next row's slots read ahead, and the "
                          "combine's reduce pass loading 4 vectors a lane for rows of one slot; at most 16 dispatch "
                          "warps; 4 x H200: dispatch 6 %, combine 8-11 % faster than receiver, notes/KERNELS.md) "
                          "or auto (wide up to 16 dispatch warps, else receiver's copy pass with wide's reduce "
                          "pass; rows record what ran)",
                          choices=("auto", "receiver", "sender", "wide"), env="EPBENCH_EM_PUSH"),
        "em_sms": Option(int, 0, "layout expert_major only: blocks of the receiver's expansion (dispatch: a row into "
                         "its further experts' slots) and of the combine's reduce pass, each run as a kernel of its "
                         "own after the transfer (at most 16 dispatch warps), and of the dispatch's ordinal pass "
                         "before it where larger than --sms; 0: inside the dispatch kernel and on "
                         "the combine's blocks, within --sms. DeepEP V2 runs its copy and reduce epilogues on every "
                         "SM (132 on an H100 / H200): set it to the GPU's SM count to compare like for like; the SMs "
                         "column then counts the transfer's blocks only; with em_push sender (no expansion) it places the reduce pass "
                         "only", low=0, high=1024, env="EPBENCH_EM_SMS"),
    },
    "epbench-ll": {
        "warps": Option(int, 16, "warps per block of both low-latency kernels", low=1, high=16,
                        env="EPBENCH_LL_WARPS"),
        "combine_chunk": Option(int, 0, "16-byte vectors per lane and combine work unit (4: 2 KiB of a row, "
                                "2: 1 KiB; 0: auto, 2 up to 64 tokens per rank, else 4; rows record the one "
                                "used)", choices=(0, 2, 4), env="EPBENCH_LL_COMBINE_CHUNK"),
        "ll_sync": Option(str, "auto", "how both kernels synchronise: token (per-token flags, per-block epochs; "
                          "notes/LATENCY.md), grid (a grid-wide release / wait / finish through block "
                          "counters), auto (token where its shared memory fits, else grid; rows record "
                          "the one used)", choices=("auto", "grid", "token"), env="EPBENCH_LL_SYNC"),
        "combine_order": Option(str, "rotated", "order of the combine's pushes: rotated (destination-minor "
                                "from rank + 1 on, as the dispatch sends) or source (destination-major, every rank "
                                "pushes to the lowest rank first: 4.2-16 us slower at 4 ranks, 128-256 tokens, "
                                "notes/LATENCY-NEXT.md); outputs bit-identical", choices=("source", "rotated"), env="EPBENCH_LL_COMBINE_ORDER"),
        "dispatch_units": Option(str, "auto", "what one peer unit of the token-sync dispatch sends: row (a whole row "
                                 "per token and peer, one warp and flag), chunk (one warp and flag per 2 KiB chunk "
                                 "of the row) or auto (chunk up to 16 tokens per rank, else row: 4 x H200, chunk "
                                 "1.1-1.8 us faster at 1 token, 1.3-2.7 us slower at 32-256 tokens on 4 ranks; "
                                 "notes/LATENCY-NEXT.md); the same bytes land either way; rows record the one used "
                                 "(row under ll_sync grid, which ignores it)", choices=("auto", "row", "chunk"),
                                 env="EPBENCH_LL_DISPATCH_UNITS"),
        "dispatch_place": Option(str, "auto", "where the token-sync dispatch puts a peer's row on the receiver: stage "
                                 "(a staging row, copied by the receiver into each of its experts' slots), slot (the "
                                 "slot of the token's first expert there, so only its other experts' slots are copied; "
                                 "2 x H200: no faster than stage) or inline (a staging row whose every 4 bytes travel beside the "
                                 "call's epoch, read as they land: no fence, no flag, twice the bytes on the link; 2 x H200: "
                                 "0.4-1 us faster at 1-8 tokens, 0.2-0.3 slower at 128; 4 x H200: 0.4-1.8 faster at 1-8, "
                                 "equal at 32, twice as slow at 128-256; notes/LATENCY-NEXT.md) or auto (inline up to 16 "
                                 "tokens per rank, the buffers' size, else stage); the same outputs, valid until this rank's "
                                 "combine (slot) or its next dispatch; every rank must agree (a mismatch stops at once); rows "
                                 "record the one used (stage under ll_sync grid, which ignores it); line: inline's "
                                 "slot, weight and scale words, the row in 64-byte lines of 56 bytes and an epoch "
                                 "tag (14 % more bytes, no fence, no flag; relies on a 64-byte line landing and "
                                 "being read whole, which the PTX model does not promise: 128-byte lines tore on 2 x "
                                 "H200; row units only; 2 x H200: 0.3-1.5 us faster at 32-256 tokens, slower at 1-8; "
                                 "4 x H200: 0.5 faster at 128, 0.7 slower at 256; notes/LATENCY-NEXT.md); line128: "
                                 "the same in 128-byte lines of 120 bytes and the tag (7 % more bytes), each batch "
                                 "loaded once more after its tags were seen (the cure for the tear, in the repro); "
                                 "row units only; 4 x H200: 0.2-0.3 us faster than line at 128 tokens, 0.6-0.8 at 256",
                                 choices=("auto", "stage", "slot", "inline", "line", "line128"), env="EPBENCH_LL_DISPATCH_PLACE"),
        "combine_release": Option(str, "batch", "how the token-sync combine releases its pushes' flags: unit (a "
                                  "release store after every 2 KiB push, the next push after its fence) or batch (up "
                                  "to 2 pushes, then one fence and their flags: 4 x H200, 1.5-1.8 us faster at 128-256 "
                                  "tokens on 4 ranks, within 0.3 us at 1-32; notes/LATENCY-NEXT.md); the same flags "
                                  "and outputs; rows record the one used (grid under ll_sync grid, which releases "
                                  "once per grid)", choices=("unit", "batch"), env="EPBENCH_LL_COMBINE_RELEASE"),
    },
    "epbench-hier": {
        "send_share": Option(float, 0.5, "share of the num_sms blocks that send", low=0.0, high=1.0,
                             open_range=True, env="EPBENCH_HIER_SEND_SHARE"),
        "chunk": Option(int, 4, "rows per put and per signal", low=1, high=1024, env="EPBENCH_HIER_CHUNK"),
        "transport": Option(str, "auto", "how rows reach a rail peer NVLink cannot reach",
                            choices=("auto", "put", "direct"), env="EPBENCH_HIER_TRANSPORT"),
    },
    "deepep": {
        "max_sms": Option(int, None, "SMs the DeepEP buffer is sized for (unset: the GPU's, rounded down to even)",
                          low=2, high=1024, env="EPBENCH_DEEPEP_MAX_SMS"),
        "chunks": Option(str, "search", "NVL chunk sizes: search (as DeepEP's test_intranode does, per SM count: "
                         "dispatch 4..32 step 2, combine 1..16, fastest on the slowest rank; rows record the "
                         "winners) or default (DeepEP's get_dispatch_config / get_combine_config tables)",
                         choices=("search", "default"), env="EPBENCH_DEEPEP_CHUNKS"),
    },
    "deepep-v2": {
        "gin": Option(str, "auto", "V2's NCCL Gin (GPU-initiated RDMA) backend: auto = off where the whole world is "
                      "one node (every peer on NVLink; V2 refuses to start without RDMA NICs otherwise), on "
                      "across nodes; off sets V2's EP_DISABLE_GIN=1, on leaves Gin required",
                      choices=("auto", "on", "off"), env="EPBENCH_DEEPEP_V2_GIN"),
        "prefer_overlap": Option(str, "off", "V2's prefer_overlap_with_compute, set when its buffer is built: off as "
                                 "its tests/elastic/test_ep.py benchmarks (the library's default is on); changes the "
                                 "channels per SM across nodes and the SM count V2 would pick itself, nothing within "
                                 "one node at the swept SM counts", choices=("off", "on"),
                                 env="EPBENCH_DEEPEP_V2_PREFER_OVERLAP"),
    },
}


# name -> switch; docs/measurements.md lists them ("Diagnostic switches").
DIAGNOSTICS: Dict[str, Option] = {
    "host_lead_us": Option(float, 150.0, "device sleep before each timed call, in us (the host queues the call "
                           "meanwhile; epbench/timing.py)", low=1.0, high=10_000.0, env="EPBENCH_HOST_LEAD_US"),
    "host_gate": Option(int, 1, "1: graph replays also wait on the host gate (epbench/timing.py HostGate); "
                        "0: the device sleep only", choices=(0, 1), env="EPBENCH_HOST_GATE"),
    "fill_sync": Option(int, 0, "1: the untimed stand-in expert between dispatch and combine rebuilds its factor "
                        "tensor from host memory each call, a host synchronisation (epbench/verify.py "
                        "ll_expert_factors, as before the factors were cached); 0: cached",
                        choices=(0, 1), env="EPBENCH_FILL_SYNC"),
    "gate_first": Option(int, 1, "1: a gated call's stream waits on the host gate BEFORE the cross-rank "
                         "alignment (where the alignment stays on the stream: NCCL, one rank per GPU), so "
                         "ranks leave it together only once every host has queued its call; 0: after it, "
                         "the default before 2026-11-26 (epbench/timing.py)", choices=(0, 1), env="EPBENCH_GATE_FIRST"),
    "gate_launches": Option(int, 0, "1: the plain launches (not only the graph replays) of a backend whose calls "
                            "never wait for the device on the host (epbench, epbench-ll) also wait on the host "
                            "gate in their timed iterations; 0: graph replays only (epbench/timing.py)",
                            choices=(0, 1), env="EPBENCH_GATE_LAUNCHES"),
    "align": Option(str, "alltoall", "the cross-rank alignment before each timed call on GPUs (NCCL, one "
                    "rank per GPU): alltoall (one element per peer: every rank waits for every other) or "
                    "allreduce (one element; the ring releases ranks in ring order; the default before "
                    "2026-11-26, and `overlap`'s unless set: an all-to-all's blocks wait for SMs a GEMM holds)", choices=("allreduce", "alltoall"), env="EPBENCH_ALIGN"),
}


def diagnostic(name: str, environ: Optional[Mapping[str, str]] = None) -> Any:
    """The value of switch ``name`` in force: its environment variable's (checked), else the default."""
    opt = DIAGNOSTICS[name]
    raw = (os.environ if environ is None else environ).get(opt.env)
    return opt.default if raw is None else opt.parse(raw, opt.env)


def diagnostic_is_set(name: str, environ: Optional[Mapping[str, str]] = None) -> bool:
    """True where switch ``name``'s environment variable is set (a command may then not pick its own)."""
    return (os.environ if environ is None else environ).get(DIAGNOSTICS[name].env) is not None


def diagnostics_set(environ: Optional[Mapping[str, str]] = None) -> List[str]:
    """``VARIABLE=value`` of every diagnostic switch whose environment variable is set, for a run's notes."""
    environ = os.environ if environ is None else environ
    shown = (lambda v: v if isinstance(v, str) else f"{v:g}")
    return [f"{opt.env}={shown(diagnostic(name, environ))}" for name, opt in DIAGNOSTICS.items()
            if environ.get(opt.env) is not None]


LL_AUTO_CHUNK_UNITS_MAX_TOKENS = 16  # epbench-ll dispatch_units auto: chunk up to this many tokens per rank
LL_LINE_PLACES = ("line", "line128")  # epbench-ll dispatch_place values that carry whole rows (row units only)


def check_ll_lines(backend_options: Mapping[str, Mapping[str, Any]], tokens: Sequence[int], where: str,
                   environ: Optional[Mapping[str, str]] = None,
                   fix: str = "add --option epbench-ll.dispatch_units=row") -> None:
    """epbench-ll's dispatch_place line / line128 send whole rows: under token sync (ll_sync token or auto) they
    need row units, so dispatch_units chunk, or auto at a point of up to LL_AUTO_CHUNK_UNITS_MAX_TOKENS tokens per
    rank (each point's buffer is its token count), is refused in one line (UserError) before any rank starts;
    ``fix`` says how the command in ``where`` asks for row units."""
    r = resolve("epbench-ll", backend_options.get("epbench-ll") or {}, environ)
    if r["dispatch_place"] not in LL_LINE_PLACES or r["ll_sync"] == "grid":
        return
    small = [t for t in tokens if t <= LL_AUTO_CHUNK_UNITS_MAX_TOKENS]
    if r["dispatch_units"] == "chunk" or (r["dispatch_units"] == "auto" and small):
        why = ("dispatch_units chunk" if r["dispatch_units"] == "chunk" else
               f"dispatch_units auto picks chunk up to {LL_AUTO_CHUNK_UNITS_MAX_TOKENS} tokens per rank, and the run "
               f"has {small[0]}")
        raise UserError(f"{where}: epbench-ll.dispatch_place={r['dispatch_place']} sends whole rows and needs row "
                        f"units ({why}): {fix}")


def check_payload(backend_options: Mapping[str, Mapping[str, Any]], layout: str, quantize: str, where: str,
                  environ: Optional[Mapping[str, str]] = None, world: Optional[int] = None) -> None:
    """Options the scenario's payload rules out, refused in one line (UserError): epbench's own_rows=ce copies
    rows as they are, so it can neither place them per expert (layout expert_major) nor quantize them on the
    way (quantize fused); fused_stores=16 asked for (given or by its environment variable: the default, 16,
    is ignored by other payloads) changes the fused cast's stores, so it needs quantize fused; em_push sender or wide
    and em_sms > 0 need the expert-major layout and at most 16 dispatch warps; the push's options (ce_chunks,
    ce_chunking, ce_streams) need combine_rows ce, and ce_chunks cannot be given with ce_chunking grow;
    pull_kernel tma needs combine_rows pull; bulk needs it too, the rank-major layout and (``world`` where known) at
    most 4 ranks, and none of the tma kernel's knobs.
    ``backend_options`` as validated; the environment counts as for ``resolve``."""
    given = backend_options.get("epbench") or {}
    resolved = resolve("epbench", given, environ)
    stores_env = SCHEMAS["epbench"]["fused_stores"].env
    asked = "fused_stores" in given or (environ if environ is not None else os.environ).get(stores_env) is not None
    if asked and resolved["fused_stores"] != 8 and quantize != "fused":  # the default serves every payload
        raise UserError(f"{where}: epbench.fused_stores={resolved['fused_stores']} needs model.quantize fused (got "
                        f"{quantize}): it changes the stores of the cast fused into the dispatch kernel")
    if resolved["em_push"] not in ("auto", "receiver") and layout != "expert_major":
        raise UserError(f"{where}: epbench.em_push={resolved['em_push']} needs model.layout expert_major (got "
                        f"{layout}): it says who fills the slots of a token's further experts on a rank")
    if resolved["em_sms"] > 0 and layout != "expert_major":
        raise UserError(f"{where}: epbench.em_sms={resolved['em_sms']} needs model.layout expert_major (got "
                        f"{layout}): it places the expert-major expansion and reduce passes")
    if resolved["em_sms"] > 0 and resolved["dispatch_warps"] > 16:
        raise UserError(f"{where}: epbench.em_sms={resolved['em_sms']} runs with at most 16 dispatch warps (got "
                        f"dispatch_warps {resolved['dispatch_warps']})")
    if resolved["em_push"] in ("sender", "wide") and resolved["dispatch_warps"] > 16:
        raise UserError(f"{where}: epbench.em_push={resolved['em_push']} runs with at most 16 dispatch warps (got "
                        f"dispatch_warps {resolved['dispatch_warps']})")
    own = resolved["own_rows"]
    env = environ if environ is not None else os.environ
    for key in ("ce_chunks", "ce_chunking", "ce_streams"):
        if (key in given or env.get(SCHEMAS["epbench"][key].env) is not None) and resolved["combine_rows"] != "ce":
            raise UserError(f"{where}: epbench.{key}={resolved[key]} needs epbench.combine_rows=ce (got "
                            f"{resolved['combine_rows']}): it shapes the copy engines' push of the combine's rows")
    if (resolved["ce_chunking"] == "grow" and resolved["combine_rows"] == "ce"
            and ("ce_chunks" in given or env.get(SCHEMAS["epbench"]["ce_chunks"].env) is not None)):
        raise UserError(f"{where}: epbench.ce_chunks={resolved['ce_chunks']} with epbench.ce_chunking=grow: growing "
                        f"chunks have their own sizes; give one of the two")
    if resolved["pull_kernel"] in ("tma", "bulk") and resolved["combine_rows"] != "pull":
        raise UserError(f"{where}: epbench.pull_kernel={resolved['pull_kernel']} needs epbench.combine_rows=pull (got "
                        f"{resolved['combine_rows']}): it names the pull's kernel")
    if resolved["pull_kernel"] == "bulk":
        why = (f"model.layout {layout} (it takes rank_major rows)" if layout != "rank_major"
               else f"world {world} (it takes at most 4 ranks)" if world is not None and world > 4 else None)
        if why:
            raise UserError(f"{where}: epbench.pull_kernel=bulk cannot run with {why}")
        for key in PULL_TMA_KNOBS:
            if key in given or env.get(SCHEMAS["epbench"][key].env) is not None:
                raise UserError(f"{where}: epbench.{key}={resolved[key]} shapes the tma pull kernel; pull_kernel=bulk "
                                f"has its own (7 loading warps a SM, 3 summing warps each, 2 stages of 3.5 KiB pieces, 4 at 2 ranks)")
    if ("ce_share" in given or env.get(SCHEMAS["epbench"]["ce_share"].env) is not None) and own != "all":
        raise UserError(f"{where}: epbench.ce_share={resolved['ce_share']} needs epbench.own_rows=all (got {own}): it "
                        f"splits the copy engines' dispatch rows with the SMs")
    if resolved["combine_rows"] == "ce" and own != "all":
        raise UserError(f"{where}: epbench.combine_rows=ce needs epbench.own_rows=all (got {own}): the copy engine "
                        f"pushes a holder's rows of a source as one range, which only that layout gives")
    if own == "sm":
        return
    if layout != "rank_major":
        raise UserError(f"{where}: epbench.own_rows={own} needs model.layout rank_major (got {layout}): the copy "
                        f"engine copies the rows as they are, one per token, not into expert segments")
    if quantize != "before":
        raise UserError(f"{where}: epbench.own_rows={own} needs model.quantize before (got {quantize}): the copy "
                        f"engine cannot quantize the rows")


def _schema(backend: str, where: str) -> Dict[str, Option]:
    if backend not in SCHEMAS:
        known = ", ".join(SCHEMAS)
        raise UserError(f"{where}: backend {backend!r} takes no options (backends with options: {known})")
    return SCHEMAS[backend]


def validate(data: Any, where: str = "backend_options") -> Dict[str, Dict[str, Any]]:
    """A scenario's ``backend_options`` mapping, checked and typed: {backend: {key: value}}."""
    if data is None:
        return {}
    if not isinstance(data, Mapping):
        raise UserError(f"{where}: must be a mapping of backend -> options, got {data!r}")
    out: Dict[str, Dict[str, Any]] = {}
    for backend, opts in data.items():
        schema = _schema(backend, f"{where}.{backend}")
        if not isinstance(opts, Mapping):
            raise UserError(f"{where}.{backend}: must be a mapping of option -> value, got {opts!r}")
        out[backend] = {}
        for key, value in opts.items():
            if key not in schema:
                raise UserError(f"{where}.{backend}.{key}: unknown option (known: {', '.join(schema)})")
            out[backend][key] = schema[key].parse(value, f"{where}.{backend}.{key}")
    return out


def parse_cli(items: Sequence[str]) -> Dict[str, Dict[str, Any]]:
    """``--option`` values, ``[backend.]key=value`` each, as a validated mapping. A key given twice
    (bare or qualified) is refused, as ``--sms 4,4`` is: with different values the last would win
    unseen, with the same one it says nothing."""
    out: Dict[str, Dict[str, Any]] = {}
    for item in items:
        name, eq, value = item.partition("=")
        if not eq or not name.strip():
            raise UserError(f"--option: must be [backend.]key=value, got {item!r}")
        backend, dot, key = name.strip().rpartition(".")
        if not dot:
            owners = [b for b, schema in SCHEMAS.items() if key in schema]
            if len(owners) != 1:
                where = "no backend has it" if not owners else f"{', '.join(owners)} have it: write backend.{key}"
                raise UserError(f"--option {item}: option {key!r} is ambiguous or unknown ({where})")
            backend = owners[0]
        given = out.setdefault(backend, {})
        if key in given:
            values = "" if given[key].strip() == value.strip() else f" ({given[key].strip()}, then {value.strip()})"
            raise UserError(f"--option: {backend}.{key} is listed twice{values}; give it once")
        given[key] = value
    return validate(out, "--option")


def merge(base: Mapping[str, Mapping[str, Any]], over: Mapping[str, Mapping[str, Any]]) -> Dict[str, Dict[str, Any]]:
    merged = {b: dict(v) for b, v in base.items()}
    for b, v in over.items():
        merged.setdefault(b, {}).update(v)
    return merged


CE_CHUNKS_WIDE = 4  # epbench.ce_chunks where it is not given, at 3 or more ranks (one push stream)
CE_STREAMS_WIDE = 1  # epbench.ce_streams where it is not given, at 3 or more ranks


def _by_world(key: str, wide: int, world: int, resolved: Mapping[str, Any], given: Mapping[str, Any],
              environ: Optional[Mapping[str, str]]) -> int:
    """epbench option ``key`` as the kernels take it: what was given (option or environment variable), else its
    default at 2 ranks and ``wide`` at 3 or more."""
    environ = os.environ if environ is None else environ
    if key in given or environ.get(SCHEMAS["epbench"][key].env) is not None or world <= 2:
        return resolved[key]
    return wide


def ce_chunks_for(world: int, resolved: Mapping[str, Any], given: Mapping[str, Any],
                  environ: Optional[Mapping[str, str]] = None) -> int:
    """epbench.ce_chunks by world: its default at 2 ranks, CE_CHUNKS_WIDE at 3 or more, unless given."""
    return _by_world("ce_chunks", CE_CHUNKS_WIDE, world, resolved, given, environ)


CE_CHUNKS_MAX = 32  # csrc/common.cuh kCeChunks


def ce_chunks_made(max_tokens: int, chunks: int) -> int:
    """The even chunks csrc/buffers.cu ep_ce_bounds makes of a rank's max_tokens rows when asked for ``chunks``:
    rows = ceil(T / chunks) a chunk, so ceil(T / rows) chunks (fewer than asked where T is not a multiple: 25 for
    T = 100 and 32 asked), none for T = 0, at most CE_CHUNKS_MAX."""
    if max_tokens <= 0:
        return 0
    rows = max(1, -(-max_tokens // chunks))
    return min(CE_CHUNKS_MAX, -(-max_tokens // rows))


def ce_streams_for(world: int, resolved: Mapping[str, Any], given: Mapping[str, Any],
                   environ: Optional[Mapping[str, str]] = None) -> int:
    """epbench.ce_streams by world: its default at 2 ranks, CE_STREAMS_WIDE at 3 or more, unless given."""
    return _by_world("ce_streams", CE_STREAMS_WIDE, world, resolved, given, environ)


PULL_TMA_KNOBS = ("combine_warps", "combine_stages", "combine_chunk")  # the tma pull kernel's shape


def pull_kernel_code(resolved: Mapping[str, Any], given: Mapping[str, Any],
                     environ: Optional[Mapping[str, str]] = None) -> int:
    """epbench.pull_kernel as the library takes it (csrc/api.h EP_OPT_PULL_KERNEL): tma 0, bulk 1, auto 2 (the
    library's ep_pull_auto picks per call), except auto with a tma knob given (option or environment variable): 0."""
    environ = os.environ if environ is None else environ
    kernel = resolved["pull_kernel"]
    if kernel == "auto" and any(k in given or environ.get(SCHEMAS["epbench"][k].env) is not None
                                for k in PULL_TMA_KNOBS):
        return 0
    return {"tma": 0, "bulk": 1, "auto": 2}[kernel]


def resolve(backend: str, given: Optional[Mapping[str, Any]] = None,
            environ: Optional[Mapping[str, str]] = None) -> Dict[str, Any]:
    """Every option of ``backend``: given, else its environment variable, else the default."""
    environ = os.environ if environ is None else environ
    given = given or {}
    out: Dict[str, Any] = {}
    for key, opt in SCHEMAS.get(backend, {}).items():
        if key in given:
            out[key] = given[key]
        elif opt.env and environ.get(opt.env) is not None:
            out[key] = opt.parse(environ[opt.env], opt.env)
        else:
            out[key] = opt.default
    return out
