"""Scenario files: YAML in, validated frozen objects out.

Every rule violation raises UserError with one line: ``<file>: <key>: <rule>, got <value>``.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import stat
import reprlib
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, Optional, Tuple

import yaml

from epbench import options
from epbench.errors import UserError

DTYPES = ("bf16", "fp8", "mxfp8")
ROUTINGS = ("uniform", "zipf", "hot")
# normal: throughput dispatch/combine (rows grouped per destination rank). low_latency: decode-sized
# batches received straight into per-expert padded buffers (epbench/backends/base.py,
# LowLatencyOutput); the padding per source rank is model.tokens_per_rank.
MODES = ("normal", "low_latency")
DEVICES = ("auto", "cuda", "cpu")
FP8_BLOCK = 128  # elements per fp32 scale in fp8 dispatch
MXFP8_BLOCK = 32  # elements per E8M0 scale in mxfp8 dispatch (epbench/mxfp8.py)
# before: the caller hands quantized rows; fused: bf16 rows in, quantized rows out at the receiver
QUANTIZE = ("before", "fused")
# rank_major: received rows by (source rank, token); expert_major: grouped by local expert
# (epbench/layout.py), each segment padded to a multiple of model.align rows
LAYOUTS = ("rank_major", "expert_major")
ALIGNS = (1, 16, 128)

# What a scenario file may be. Real ones are a few hundred bytes, three levels deep and under a
# hundred YAML nodes; the limits stop hostile or broken files (an 80 MB line, nesting 10,000 deep,
# an anchor bomb whose aliases expand to billions of nodes) before they cost time or memory.
MAX_FILE_BYTES = 1 << 20
MAX_DEPTH = 32
MAX_NODES = 10_000  # counted with every alias expanded
NAME = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,99}")  # a plain file-name token: it names the run folder
# Caps on counts and times: beyond them a run would not finish or its numbers would mean nothing.
# Shapes (hidden, tokens) are bounded by memory instead: MAX_RANK_BYTES here, check_fits before a launch.
MAX_ITERS = 100_000
MAX_TIMEOUT_S = 3600.0  # the kernels turn it into nanoseconds (unsigned 64-bit)
MAX_SMS = 1024
MAX_LIST = 64  # SM counts, backends, tokens in one sweep
CALL_MODES = ("call", "kernel")  # bench.call_modes default and the modes there are
INPUT_SETS = 4  # bench.input_sets default: input sets the timed calls rotate through
MAX_INPUT_SETS = 16
GRAPH_CHAIN = 8  # run / sweep --graph-chain default: low-latency calls per op chained in one graph
MAX_GRAPH_CHAIN = 1024
MAX_NODES_PER_JOB = 1024
MAX_GPUS_PER_NODE = 64
MAX_GBPS = 1e5
MAX_RANK_BYTES = 1 << 40  # 1 TiB: more than any one GPU or host holds
# Shapes far beyond any model's (DeepSeek-V3: hidden 7168, 256 experts, top-8), still generous.
MAX_SHAPE = {"hidden": 1 << 17, "tokens_per_rank": 1 << 20, "topk": 1024, "experts_per_rank": 4096}

_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxlist, _REPR.maxdict, _REPR.maxstring, _REPR.maxother = 3, 4, 4, 60, 60
_REPR.maxlong = 40


def shown(value: Any, limit: int = 80) -> str:
    """A value as an error message echoes it: bounded in time and length whatever it is (a
    shared-structure bomb, an 80 MB string, a 4000-digit integer)."""
    try:
        text = _REPR.repr(value)
    except (ValueError, RecursionError):
        text = f"<{type(value).__name__}>"
    return text if len(text) <= limit else text[:limit - 3] + "..."


def cut(text: str, limit: int = 80) -> str:
    """Message text (a parser's complaint, a key) on one printable line of at most ``limit``."""
    text = text[:2 * limit]
    if not text.isprintable():
        text = repr(text)[1:-1]
    return text if len(text) <= limit else text[:limit - 3] + "..."


@dataclass(frozen=True)
class Model:
    hidden: int
    tokens_per_rank: int
    topk: int
    experts_per_rank: int
    dispatch_dtype: str = "bf16"
    combine_dtype: str = "bf16"
    quantize: str = "before"
    layout: str = "rank_major"
    align: int = 1


@dataclass(frozen=True)
class Topology:
    nodes: int
    gpus_per_node: int
    name: str = ""
    nvlink_gbps: float = 450.0  # nominal per-GPU NVLink bandwidth, one direction
    nic_gbps: float = 0.0  # nominal per-GPU NIC bandwidth, one direction (0: none)
    # Virtual nodes: all `nodes x gpus_per_node` ranks run on one host and the inter-node tier
    # travels over NVLink. Its bytes are still counted as the NIC tier, labelled virtual.
    virtual_nodes: bool = False

    @property
    def world(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def ranks_per_host(self) -> int:
        return self.world if self.virtual_nodes else self.gpus_per_node


@dataclass(frozen=True)
class Routing:
    kind: str = "uniform"
    seed: int = 0
    zipf_exponent: float = 1.0  # zipf: expert i (in a seeded random order) gets weight 1/(i+1)^s
    hot_fraction: float = 0.05  # hot: this fraction of experts ...
    hot_multiplier: float = 4.0  # ... is picked this many times as often as the average


MAX_CONTROL_TIMEOUT_S = 86400.0


@dataclass(frozen=True)
class Bench:
    warmup: int = 5
    iters: int = 20
    backends: Tuple[str, ...] = ("reference", "epbench")
    sms: Tuple[int, ...] = (16,)
    timeout_s: float = 10.0
    device: str = "auto"
    control_timeout_s: float = 300.0  # barriers, gathers and the bootstrap between ranks
    # each point is timed once per entry, its timed calls rotating through that many input sets
    # (other token values, the same routes on other tokens); 1: the same inputs every call
    input_sets: Tuple[int, ...] = (INPUT_SETS,)
    # how each baseline is called (rows' call_mode): "call" as a model's forward pass calls it,
    # "kernel" its fastest path as its own benchmark times it; a backend with one way gets "call"
    call_modes: Tuple[str, ...] = CALL_MODES


@dataclass(frozen=True)
class Scenario:
    name: str
    model: Model
    topology: Topology
    routing: Routing = field(default_factory=Routing)
    bench: Bench = field(default_factory=Bench)
    description: str = ""
    mode: str = "normal"
    # backend -> option -> value (epbench/options.py); validated and typed by parse()
    backend_options: Dict[str, Dict[str, Any]] = field(default_factory=dict)
    source: str = ""  # the file it came from

    @property
    def world(self) -> int:
        return self.topology.world

    @property
    def num_experts(self) -> int:
        return self.world * self.model.experts_per_rank

    def with_world(self, nproc: int) -> "Scenario":
        """The same shape on ``nproc`` ranks of one node (for ``--nproc``)."""
        if nproc == self.world:
            return self
        if not 1 <= nproc <= MAX_GPUS_PER_NODE:
            raise UserError(f"--nproc: must be 1 to {MAX_GPUS_PER_NODE}, got {shown(nproc)}")
        if self.model.topk > nproc * self.model.experts_per_rank:
            raise UserError(
                f"--nproc {nproc}: topk {self.model.topk} exceeds the "
                f"{nproc * self.model.experts_per_rank} experts of {nproc} ranks")
        topo = dataclasses.replace(self.topology, nodes=1, gpus_per_node=nproc, virtual_nodes=False,
                                   name=f"{self.topology.name} (on {nproc} ranks)".strip())
        return dataclasses.replace(self, topology=topo)

    def with_tokens(self, tokens_per_rank: int) -> "Scenario":
        """The same scenario with another batch size (for ``--tokens``)."""
        if tokens_per_rank == self.model.tokens_per_rank:
            return self
        if tokens_per_rank < 1:
            raise UserError(f"--tokens: must be positive, got {tokens_per_rank}")
        return dataclasses.replace(self, model=dataclasses.replace(self.model, tokens_per_rank=tokens_per_rank))

    def to_dict(self) -> Dict[str, Any]:
        return dataclasses.asdict(self)


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is tuple:
        return f"a list of {_type_name(typing.get_args(tp)[0])}"
    return {int: "an integer", float: "a number", str: "a string", bool: "true/false"}.get(tp, str(tp))


def _known(key: str, fields: Any) -> str:
    """The closest known key, else the list of them, in at most ~70 characters."""
    import difflib

    close = difflib.get_close_matches(key[:100], list(fields), n=1)
    return f"did you mean {close[0]}?" if close else cut(f"known: {', '.join(fields)}", 70)


def _key_text(key: str) -> str:
    return cut(key, 16)


def _coerce(value: Any, tp: Any, where: str) -> Any:
    origin = typing.get_origin(tp)
    if origin is tuple:
        inner = typing.get_args(tp)[0]
        if not isinstance(value, list) or not value:
            raise UserError(f"{where}: must be a non-empty list, got {shown(value)}")
        if len(value) > MAX_LIST:
            raise UserError(f"{where}: must list at most {MAX_LIST} values, got {len(value)}")
        return tuple(_coerce(v, inner, where) for v in value)
    ok = {
        int: isinstance(value, int) and not isinstance(value, bool),
        float: isinstance(value, (int, float)) and not isinstance(value, bool),
        str: isinstance(value, str),
        bool: isinstance(value, bool),
    }[tp]
    if not ok:
        raise UserError(f"{where}: must be {_type_name(tp)}, got {shown(value)}")
    if tp is float and not math.isfinite(value):
        raise UserError(f"{where}: must be a finite number, got {shown(value)}")
    return float(value) if tp is float else value


def _build(cls: Any, data: Any, where: str) -> Any:
    if not isinstance(data, dict):
        raise UserError(f"{where}: must be a mapping, got {shown(data)}")
    odd = [k for k in data if not isinstance(k, str)]
    if odd:
        raise UserError(f"{where}: keys must be names (strings), got {shown(odd[0])}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.name != "source"}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise UserError(f"{where}.{_key_text(unknown[0])}: unknown key ({_known(unknown[0], fields)})")
    kwargs = {}
    for name, f in fields.items():
        key = f"{where}.{name}"
        if name not in data:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise UserError(f"{key}: missing required key")
            continue
        tp = hints[name]
        if dataclasses.is_dataclass(tp):
            kwargs[name] = _build(tp, data[name], key)
        elif name == "backend_options":
            kwargs[name] = options.validate(data[name], key)
        else:
            kwargs[name] = _coerce(data[name], tp, key)
    return cls(**kwargs)


def _check(s: Scenario) -> None:
    """Rules across fields; each failure names the key."""
    m, t, r, b = s.model, s.topology, s.routing, s.bench

    def need(cond: bool, key: str, rule: str, value: Any) -> None:
        if not cond:
            raise UserError(f"{key}: {rule}, got {shown(value)}")

    if NAME.fullmatch(s.name) is None:
        raise UserError(f"name: must be a file-name token (A-Z a-z 0-9 . _ -, at most 100, no "
                        f"leading '.'), got {shown(s.name, 40)}")

    for key, top in MAX_SHAPE.items():
        need(0 < getattr(m, key) <= top, f"model.{key}", f"must be positive and at most {top}",
             getattr(m, key))
    need(m.hidden % 8 == 0, "model.hidden", "must be a multiple of 8 elements (16 bytes)", m.hidden)
    need(m.dispatch_dtype in DTYPES, "model.dispatch_dtype", f"must be one of {', '.join(DTYPES)}",
         m.dispatch_dtype)
    need(m.combine_dtype == "bf16", "model.combine_dtype", "must be bf16", m.combine_dtype)
    if m.dispatch_dtype == "fp8":
        need(m.hidden % FP8_BLOCK == 0, "model.hidden",
             f"must be a multiple of {FP8_BLOCK} for fp8 dispatch", m.hidden)
    _check_payload(m, s.mode, need)
    # the file's own backend options only: the environment is weighed where a run starts (cli)
    options.check_payload(s.backend_options, m.layout, m.quantize, "backend_options", environ={})
    need(0 < t.nodes <= MAX_NODES_PER_JOB, "topology.nodes", f"must be positive and at most {MAX_NODES_PER_JOB}",
         t.nodes)
    need(0 < t.gpus_per_node <= MAX_GPUS_PER_NODE, "topology.gpus_per_node",
         f"must be positive and at most {MAX_GPUS_PER_NODE}", t.gpus_per_node)
    need(0 < t.nvlink_gbps <= MAX_GBPS, "topology.nvlink_gbps", f"must be positive and at most {MAX_GBPS:.0f}",
         t.nvlink_gbps)
    need(0 <= t.nic_gbps <= MAX_GBPS, "topology.nic_gbps", f"must be zero or positive and at most {MAX_GBPS:.0f}", t.nic_gbps)
    need(m.topk <= s.num_experts, "model.topk",
         f"must not exceed the total number of experts ({s.num_experts} = "
         f"{s.world} ranks x {m.experts_per_rank})", m.topk)
    need(r.kind in ROUTINGS, "routing.kind", f"must be one of {', '.join(ROUTINGS)}", r.kind)
    need(0 <= r.zipf_exponent <= 100, "routing.zipf_exponent", "must be zero or positive and at most 100", r.zipf_exponent)
    need(0 < r.hot_fraction < 1, "routing.hot_fraction", "must lie strictly between 0 and 1",
         r.hot_fraction)
    need(r.hot_multiplier >= 1, "routing.hot_multiplier", "must be at least 1", r.hot_multiplier)
    need(r.hot_fraction * r.hot_multiplier < 1, "routing.hot_multiplier",
         "times hot_fraction must stay below 1 (the hot experts cannot take all the load)",
         r.hot_multiplier)
    need(0 <= b.warmup <= MAX_ITERS, "bench.warmup", f"must be zero or positive and at most {MAX_ITERS}",
         b.warmup)
    need(0 < b.iters <= MAX_ITERS, "bench.iters", f"must be positive and at most {MAX_ITERS}", b.iters)
    need(all(0 < n <= MAX_SMS for n in b.sms), "bench.sms", f"must all be positive and at most {MAX_SMS}",
         list(b.sms))
    need(len(b.input_sets) > 0 and all(0 < n <= MAX_INPUT_SETS for n in b.input_sets), "bench.input_sets",
         f"must list positive counts of at most {MAX_INPUT_SETS}", list(b.input_sets))
    _once_each(b.input_sets, "bench.input_sets")
    _once_each(b.sms, "bench.sms")
    need(len(b.call_modes) > 0 and all(c in CALL_MODES for c in b.call_modes), "bench.call_modes",
         f"must list some of {', '.join(CALL_MODES)}", list(b.call_modes))
    _once_each(b.call_modes, "bench.call_modes")
    need(0 < b.timeout_s <= MAX_TIMEOUT_S, "bench.timeout_s",
         f"must be positive and at most {MAX_TIMEOUT_S:.0f} seconds", b.timeout_s)
    need(0 < b.control_timeout_s <= MAX_CONTROL_TIMEOUT_S, "bench.control_timeout_s",
         f"must be positive and at most {MAX_CONTROL_TIMEOUT_S:.0f} seconds", b.control_timeout_s)
    need(b.device in DEVICES, "bench.device", f"must be one of {', '.join(DEVICES)}", b.device)
    check_backends(b.backends, "bench.backends")
    need(s.mode in MODES, "mode", f"must be one of {', '.join(MODES)}", s.mode)
    draws = m.tokens_per_rank * s.num_experts * 4  # routing: one fp32 draw per (token, expert)
    if draws > MAX_RANK_BYTES:
        raise UserError(f"model.experts_per_rank: routing needs {draws / 2**30:.0f} GiB ({m.tokens_per_rank} "
                        f"tokens x {s.num_experts} experts x 4 bytes); no host has that")
    need_bytes = min_bytes_per_rank(s)
    if need_bytes > MAX_RANK_BYTES:
        raise UserError(f"model: needs at least {need_bytes / 2**30:.0f} GiB per rank (hidden {m.hidden} x "
                        f"{m.tokens_per_rank} tokens x {s.world} ranks); no GPU or host has that")


def _shape(m: Model) -> str:
    return f"hidden {m.hidden}, tokens_per_rank {m.tokens_per_rank}, topk {m.topk}"


def check_backends(names: Tuple[str, ...], key: str) -> None:
    from epbench.backend_names import REGISTRY  # a name table only: no torch

    for n in names:
        if n not in REGISTRY:
            raise UserError(f"{key}: unknown backend {shown(n, 40)} (known: {', '.join(REGISTRY)})")
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise UserError(f"{key}: {twice[0]} is listed twice")


def min_bytes_per_rank(s: Scenario, tokens_per_rank: Optional[int] = None) -> int:
    """A lower bound on the memory one rank needs for its buffers: its own tokens, the rows it may
    receive (every rank's tokens in normal mode; the padded ``[experts_per_rank, world x tokens,
    hidden]`` buffer in low-latency mode) and the combined output, in bf16. The real need is
    higher (layouts, staging, the backends' own buffers); this bound only refuses what can
    never fit."""
    m = s.model
    tokens = tokens_per_rank or m.tokens_per_rank
    row = 2 * m.hidden
    received = s.world * tokens * row
    if s.mode == "low_latency":
        received *= m.experts_per_rank
    return tokens * row * 2 + received


def row_bytes(dtype: str, hidden: int) -> int:
    """Bytes of one dispatched (or combined) row of ``dtype`` on the wire, its scales included."""
    if dtype == "bf16":
        return 2 * hidden
    if dtype == "fp8":
        return hidden + 4 * (hidden // FP8_BLOCK)
    if dtype == "mxfp8":
        return mxfp8_row_bytes(hidden)
    raise ValueError(f"unknown dtype {dtype!r}")


def mxfp8_row_bytes(hidden: int) -> int:
    """Bytes of one mxfp8 row on the wire: ``hidden + hidden / 32``.

    Each element is one e4m3 byte (``hidden`` bytes) and each block of 32 consecutive elements
    shares one E8M0 scale byte (``hidden / 32`` bytes); the layout is epbench/mxfp8.py's
    ``pack_rows``. At hidden 7168: 7168 + 224 = 7392 bytes, 0.516 of the bf16 row (14336) and
    the same as the fp8 row with one fp32 scale per 128 elements (7168 + 4 * 56): both spend
    1/32 byte per element on scales. Expert ids and weights are not counted, as for bf16."""
    return hidden + hidden // MXFP8_BLOCK


def received_per_token(s: Scenario) -> Tuple[float, float]:
    """How much of one source token a rank receives: (rows, pairs), the chance that its top-k
    holds one of the rank's experts and the number of them it holds. Uniform routing draws k of
    the N experts without replacement, each pick as likely on any expert, so a row arrives unless
    all k picks miss the rank's E experts, 1 - C(N - E, k) / C(N, k), and k E / N picks land there
    on average (for large batches the count stays close to its mean); any other routing may put a
    token's every pick on one rank: 1 row and min(k, E) pairs."""
    m = s.model
    n, e, k = s.num_experts, m.experts_per_rank, m.topk
    if s.routing.kind != "uniform":
        return 1.0, float(min(k, e))
    miss = 1.0
    for i in range(k):  # C(N - E, k) / C(N, k) as a product: picks i of k all miss the rank
        miss *= max(n - e - i, 0) / (n - i)
    return 1.0 - miss, k * e / n


def cpu_rank_bytes(s: Scenario, tokens_per_rank: Optional[int] = None) -> int:
    """Peak bytes one CPU rank touches for a run of ``s``, beyond an idle rank's (the interpreter,
    torch and the process group: check_fits' ``base_bytes``). On CPUs only the reference backend
    runs (every other needs CUDA), so this follows its buffers (epbench/backends/reference.py) and
    the driver's point around them (epbench/driver.py Point): input sets, the copy of the last
    timed output, the stand-in expert's fp32 rows and the checks' fp32 rows (epbench/verify.py).
    torch.empty's pages cost nothing until written: a buffer counts whole where something writes
    it whole (be.poison() does before every verification run), else as far as rows arrive
    (``received_per_token``). Measured 2026-11-28 (CPU host, ``--device cpu --backends reference
    --iters 2 --warmup 0``, each rank's VmHWM less an idle rank's at ``--tokens 8``): dsv3x4 on 2
    ranks at 512 / 2048 / 8192 tokens grew 1.15 / 1.08 / 1.02 times this (small batches leave
    freed heap behind), its fp8, mxfp8 fused (1 input set), mxfp8 expert-major (align 128) and
    4-rank variants at 1024-2048 tokens 0.95-1.09 times, dsv3x4-ll at 128 tokens 1.04 times."""
    m = s.model
    t = tokens_per_rank or m.tokens_per_rank
    w, h, k, e = s.world, m.hidden, m.topk, m.experts_per_rank
    share, picks = received_per_token(s)
    sets = max(s.bench.input_sets)  # Point holds one point's input sets at a time (del point)
    bf16, f32 = 2 * h, 4 * h  # bytes of one row of hidden values
    payload = row_bytes(m.dispatch_dtype, h)  # one received row: elements and scales
    x_bytes = bf16 if m.dispatch_dtype == "bf16" else h  # its elements alone
    meta = 12 * k  # topk ids (int64) and weights (fp32) of one token
    given = (bf16 if m.quantize == "fused" else payload) + meta  # one token as the caller hands it
    inputs = sets * t * given  # the input sets the timed calls rotate through (driver.Point)
    # the checks of this rank's combine (verify._compare_combine, both modes): the expected rows,
    # the returned rows as fp32, torch.isclose's allowed and actual errors and one temporary of
    # theirs (5 fp32 rows a token) and its 3 boolean masks (3 bytes an element); beside them two
    # more inputs: verification_run's fresh draw and the one the check rebuilds
    check = t * (5 * f32 + 3 * h) + 2 * t * given
    got = int(w * t * picks)  # (token, local expert) pairs received from all sources
    if s.mode == "low_latency":
        slots = e * w * t  # per local expert, every source's tokens (padding, reference.py)
        pairs = t * k  # (token, expert) rows this rank sends
        row = (16 + payload + 15) // 16 * 16  # packed pair row: id, pad, scales, elements
        backend = (t * row + pairs * row  # ll_tokens, ll_send
                   + got * row  # ll_recv, written as far as rows arrive
                   + slots * (payload + 4)  # ll_x, ll_scales and ll_pair: poisoned whole
                   + slots * bf16  # ll_y: the stand-in expert writes every slot
                   + got * bf16 + pairs * bf16  # ll_y_send (as far as received), ll_y_back
                   + t * (f32 + bf16))  # ll_acc, ll_out
        kept = slots * (payload + 4)  # driver.snapshot: x, scales and pair ids of every slot
        # the stand-in expert (verify.ll_expert_output): every slot dequantized to fp32, scaled
        # (a second fp32 copy) and rounded to bf16, all three alive at once; verification_run's
        # fresh draw beside them
        expert = slots * (2 * f32 + bf16) + t * given
        return int(backend + inputs + kept + max(expert, check))
    cap = w * t  # rows a receive buffer holds: one per source token
    recv = int(cap * share)  # rows received
    packed = (meta + payload + 15) // 16 * 16  # reference.py's packed row
    backend = (t * packed + int(t * w * share) * packed  # send, send_rows (one copy per destination)
               + cap * packed  # recv: poisoned whole
               + cap * bf16  # combine_back: poisoned whole
               + w * t * bf16 + t * bf16)  # dense [T x world, H] and out: poisoned whole
    rows, kept = recv, recv * payload  # what the stand-in expert reads and writes; driver.snapshot's x
    if m.layout == "expert_major":
        slots = w * t * min(k, e) + e * (m.align - 1)  # layout.slot_capacity
        rows = got + e * (m.align - 1)  # slots in use: the pairs, each segment padded
        backend += (slots * payload  # em_x and em_scales: poisoned whole
                    + (got * x_bytes if m.align > 1 else 0)  # em_stage: the padded scatter's staging
                    + cap * (f32 + bf16))  # recv_acc, recv_back: poisoned whole
        kept = slots * payload  # driver.snapshot copies em_x and em_scales whole
    backend += rows * bf16  # combine_in: the stand-in expert's output
    kept += recv * meta  # driver.snapshot: the received rows' ids and weights
    # the stand-in expert (inputs.expert_output, verify.em_expert_output): its rows dequantized
    # to fp32 and scaled, a second fp32 copy, before the bf16 rounding; verification_run's fresh
    # draw beside them
    expert = rows * 2 * f32 + t * given
    return int(backend + inputs + kept + max(expert, check))


def _name_from_file(source: str) -> str:
    """The file's stem as a run name, with characters a folder name should not carry replaced."""
    name = re.sub(r"[^A-Za-z0-9._-]", "_", Path(source).stem).lstrip(".")[:100]
    return name or "scenario"


def _check_payload(m: Model, mode: str, need: Any) -> None:
    """dtype, quantize, layout and align (issue 26)."""
    if m.dispatch_dtype == "mxfp8":
        need(m.hidden % MXFP8_BLOCK == 0, "model.hidden",
             f"must be a multiple of {MXFP8_BLOCK} for mxfp8 dispatch", m.hidden)
    need(m.quantize in QUANTIZE, "model.quantize", f"must be one of {', '.join(QUANTIZE)}", m.quantize)
    need(m.quantize == "before" or m.dispatch_dtype != "bf16", "model.quantize",
         "fused needs a quantized dispatch_dtype (fp8 or mxfp8)", m.quantize)
    need(m.layout in LAYOUTS, "model.layout", f"must be one of {', '.join(LAYOUTS)}", m.layout)
    need(m.align in ALIGNS, "model.align", f"must be one of {', '.join(map(str, ALIGNS))}", m.align)
    need(m.align == 1 or m.layout == "expert_major", "model.align",
         "only applies with layout: expert_major", m.align)
    if mode == "low_latency":  # low latency already receives per expert (epbench/layout.py)
        need(m.layout == "rank_major", "model.layout", "must be rank_major in low_latency mode", m.layout)
        need(m.dispatch_dtype != "mxfp8", "model.dispatch_dtype",
             "mxfp8 is not implemented in low_latency mode yet", m.dispatch_dtype)
        need(m.quantize == "before", "model.quantize",
             "fused is not implemented in low_latency mode yet", m.quantize)


def parse(data: Any, source: str = "<scenario>") -> Scenario:
    """Validate a scenario mapping (as loaded from YAML)."""
    try:
        if isinstance(data, dict) and "name" not in data:
            data = {**data, "name": _name_from_file(source)}
        s = _build(Scenario, data, "scenario")
        _check(s)
    except UserError as e:
        msg = str(e)
        msg = msg[len("scenario."):] if msg.startswith("scenario.") else msg
        raise UserError(f"{source}: {msg}") from None
    return dataclasses.replace(s, source=source)


def short_path(path: "str | Path", limit: int = 120) -> str:
    """A path as a message shows it: printable, and its tail when it is very long."""
    text = str(path)
    if not text.isprintable():
        text = repr(text)[1:-1]
    return text if len(text) <= limit else "..." + text[-(limit - 3):]


class _Loader(yaml.SafeLoader):
    """PyYAML's safe loader with a depth limit while composing (deep nesting would end in a
    RecursionError), a size limit on the composed tree with every alias expanded (anchors make
    a small file describe an exponentially large one; PyYAML shares the objects, but any walk
    or print of them would run for ever), no key written twice in one mapping (PyYAML keeps the
    last silently), and YAML 1.2 floats (``1e3``, ``1.0e308``: strings to YAML 1.1)."""

    def compose_mapping_node(self, anchor):
        node = super().compose_mapping_node(anchor)
        _check_duplicate_keys(node)
        return node

    def compose_document(self):
        self._depth = 0
        node = super().compose_document()
        _check_expanded(node)
        return node

    def compose_node(self, parent, index):
        self._depth += 1
        if self._depth > MAX_DEPTH:
            mark = self.peek_event().start_mark
            raise _TooBig(f"nested more than {MAX_DEPTH} levels deep at line {mark.line + 1}")
        try:
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1


class _TooBig(Exception):
    pass


# Floats with an exponent as YAML 1.2 writes them (no dot needed, the exponent's sign optional);
# YAML 1.1's own float rule (PyYAML's) still takes every other spelling.
_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+$"),
    list("-+0123456789."))

MERGE_TAG = "tag:yaml.org,2002:merge"


class _DuplicateKey(Exception):
    pass


def _check_duplicate_keys(node: yaml.MappingNode) -> None:
    """A key written twice in one mapping (a merge ``<<`` may still be overridden)."""
    seen: Dict[Tuple[str, str], int] = {}
    for key, _value in node.value:
        if not isinstance(key, yaml.ScalarNode) or key.tag == MERGE_TAG:
            continue
        line = key.start_mark.line + 1
        if (key.tag, key.value) in seen:
            raise _DuplicateKey(f"key {cut(key.value, 40)} appears twice in one mapping (lines "
                                f"{seen[(key.tag, key.value)]} and {line}); the second would "
                                f"silently replace the first")
        seen[(key.tag, key.value)] = line


def _children(node: yaml.Node) -> list:
    if isinstance(node, yaml.MappingNode):
        return [n for pair in node.value for n in pair]
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    return []


def _check_expanded(root: Optional[yaml.Node]) -> None:
    """Counts the nodes and depth of the tree with aliases expanded, without expanding them:
    each distinct node is visited once (iteratively) and its totals are remembered."""
    if root is None:
        return
    totals: Dict[int, Tuple[int, int]] = {}  # id(node) -> (nodes, depth) below and including it
    open_ids = set()  # nodes whose children are being counted: meeting one again is a cycle
    stack = [(root, False)]
    while stack:
        node, children_done = stack.pop()
        key = id(node)
        if children_done:
            kids = [totals[id(k)] for k in _children(node)]
            count = 1 + sum(c for c, _ in kids)
            depth = 1 + max((d for _, d in kids), default=0)
            open_ids.discard(key)
            if count > MAX_NODES:
                raise _TooBig(f"expands to more than {MAX_NODES} values (anchors and aliases "
                              f"repeating each other)")
            if depth > MAX_DEPTH:
                raise _TooBig(f"nested more than {MAX_DEPTH} levels deep (through aliases)")
            totals[key] = (count, depth)
        elif key not in totals:
            if key in open_ids:
                raise _TooBig("an alias refers to a node that contains it")
            open_ids.add(key)
            stack.append((node, True))
            stack.extend((k, False) for k in _children(node))


def _file_kind(mode: int) -> str:
    for test, name in ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "not a plain file"


def load(path: "str | Path") -> Scenario:
    p = Path(path)
    where = short_path(p)
    try:
        if p.is_dir():
            raise UserError(f"{where}: is a folder, not a scenario file")
        # without O_NONBLOCK, opening a FIFO waits for a writer for ever
        fd = os.open(p, os.O_RDONLY | os.O_NONBLOCK)
        with open(fd, "rb") as f:
            kind = os.fstat(fd).st_mode
            if not stat.S_ISREG(kind):
                raise UserError(f"{where}: not a regular file ({_file_kind(kind)}); a scenario is a "
                                f"YAML file")
            raw = f.read(MAX_FILE_BYTES + 1)
    except FileNotFoundError:
        raise UserError(f"{where}: no such scenario file") from None
    except OSError as e:
        raise UserError(f"{where}: cannot read ({e.strerror or type(e).__name__})") from None
    if len(raw) > MAX_FILE_BYTES:
        raise UserError(f"{where}: larger than {MAX_FILE_BYTES >> 20} MiB; not a scenario file")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw[:e.start].count(b"\n") + 1
        raise UserError(f"{where}: not UTF-8 text (byte 0x{raw[e.start]:02x} on line {line})") from None
    try:
        data = yaml.load(text, Loader=_Loader)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f" at line {mark.line + 1}" if mark is not None else ""
        why = str(getattr(e, "problem", None) or e).splitlines()[0]
        raise UserError(f"{where}: malformed YAML{at}: {cut(why)}") from None
    except _TooBig as e:
        raise UserError(f"{where}: {e}; not a scenario file") from None
    except _DuplicateKey as e:
        raise UserError(f"{where}: {e}") from None
    except (ValueError, RecursionError, MemoryError) as e:  # e.g. an integer of 5000 digits
        raise UserError(f"{where}: unreadable YAML value ({cut(str(e))})") from None
    return parse(data, where)


def cpu_ranks(s: Any) -> str:
    """Why the scenario's link figures mean nothing: its ranks are CPU processes (bench.device
    cpu, as in scenarios/smoke.yaml: gloo over the host's memory), so no byte crosses NVLink or
    a NIC and its topology.nvlink_gbps is only the default; "" where it describes GPUs (auto or
    cuda), real or hypothetical."""
    if s.bench.device != "cpu":
        return ""
    return "bench.device: cpu: the scenario's ranks are CPU processes over gloo, which cross no NVLink or NIC"


def check_fits(s: Scenario, available: int, what: str, bytes_per_rank: Optional[int] = None,
               tokens_per_rank: Optional[int] = None, device: str = "cuda", base_bytes: int = 0) -> None:
    """A scenario needing more ranks than the host can give, or more memory per rank than each
    rank has (``bytes_per_rank``: the device's memory, or the host's share for CPU ranks), stops
    here, before anything is launched. GPU ranks are held to the lower bound min_bytes_per_rank;
    CPU ranks, where the kernel's OOM killer and not an allocation error would stop a rank that
    runs out, to cpu_rank_bytes plus ``base_bytes``, an idle rank's own (the caller's measure of
    an interpreter with torch loaded)."""
    if s.world > available:
        raise UserError(
            f"{s.source}: topology: needs {s.world} ranks ({s.topology.nodes} nodes x "
            f"{s.topology.gpus_per_node}) but {what} has {available}; use --nproc to run the "
            f"shape on fewer ranks")
    if bytes_per_rank is None:
        return
    if device == "cpu":
        need = base_bytes + cpu_rank_bytes(s, tokens_per_rank)
        if need > bytes_per_rank:
            tokens = tokens_per_rank or s.model.tokens_per_rank
            raise UserError(f"{s.source}: model: needs about {need / 2**30:.3g} GiB per CPU rank (hidden "
                            f"{s.model.hidden}, tokens_per_rank {tokens}, topk {s.model.topk}, {s.world} "
                            f"ranks, {max(s.bench.input_sets)} input sets) but {what} has "
                            f"{bytes_per_rank / 2**30:.3g} GiB per rank; use fewer --tokens, --nproc or --input-sets")
        return
    need = min_bytes_per_rank(s, tokens_per_rank)
    if need > bytes_per_rank:
        shape = _shape(s.model) if tokens_per_rank is None else f"tokens_per_rank {tokens_per_rank}"
        raise UserError(f"{s.source}: model: needs at least {need / 2**30:.3g} GiB per rank "
                        f"({shape}, {s.world} ranks) but {what} has {bytes_per_rank / 2**30:.3g} GiB "
                        f"per rank")


def maybe_int_list(text: Optional[str], option: str,
                   upper: Optional[int] = None) -> Optional[Tuple[int, ...]]:
    """Parses '4,8,16' from the command line."""
    if text is None:
        return None
    try:
        vals = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise UserError(f"{option}: must be a comma-separated list of integers, got {shown(text)}") from None
    if not vals or any(v <= 0 for v in vals):
        raise UserError(f"{option}: must list positive integers, got {shown(text)}")
    if len(vals) > MAX_LIST:
        raise UserError(f"{option}: must list at most {MAX_LIST} values, got {len(vals)}")
    if upper is not None and max(vals) > upper:
        raise UserError(f"{option}: must be at most {upper}, got {shown(max(vals))}")
    _once_each(vals, option)
    return vals


def call_mode_list(text: Optional[str], option: str) -> Optional[Tuple[str, ...]]:
    """Parses 'call,kernel' from the command line (None: not given)."""
    if text is None:
        return None
    vals = tuple(v.strip() for v in text.split(",") if v.strip())
    bad = [v for v in vals if v not in CALL_MODES]
    if not vals or bad:
        raise UserError(f"{option}: must list some of {', '.join(CALL_MODES)}, got {shown(text)}")
    _once_each(vals, option)
    return vals


def _once_each(values: Tuple[Any, ...], key: str) -> None:
    """A value listed twice would measure the same point twice, into duplicate rows."""
    twice = [v for i, v in enumerate(values) if v in values[:i]]
    if twice:
        raise UserError(f"{key}: {shown(twice[0])} is listed twice")
