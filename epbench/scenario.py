"""Scenario files: YAML in, validated frozen objects out.

Every rule violation raises UserError with one line: ``<file>: <key>: <rule>, got <value>``.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, Optional, Tuple

import yaml

from epbench.errors import UserError

DTYPES = ("bf16", "fp8")
ROUTINGS = ("uniform", "zipf", "hot")
# normal: throughput dispatch/combine (rows grouped per destination rank). low_latency: decode-sized
# batches received straight into per-expert padded buffers (epbench/backends/base.py,
# LowLatencyOutput); the padding per source rank is model.tokens_per_rank.
MODES = ("normal", "low_latency")
DEVICES = ("auto", "cuda", "cpu")
FP8_BLOCK = 128  # elements per fp32 scale in fp8 dispatch


@dataclass(frozen=True)
class Model:
    hidden: int
    tokens_per_rank: int
    topk: int
    experts_per_rank: int
    dispatch_dtype: str = "bf16"
    combine_dtype: str = "bf16"


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


@dataclass(frozen=True)
class Scenario:
    name: str
    model: Model
    topology: Topology
    routing: Routing = field(default_factory=Routing)
    bench: Bench = field(default_factory=Bench)
    description: str = ""
    mode: str = "normal"
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
        if nproc < 1:
            raise UserError(f"--nproc: must be at least 1, got {nproc}")
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


def _coerce(value: Any, tp: Any, where: str) -> Any:
    origin = typing.get_origin(tp)
    if origin is tuple:
        inner = typing.get_args(tp)[0]
        if not isinstance(value, list) or not value:
            raise UserError(f"{where}: must be a non-empty list, got {value!r}")
        return tuple(_coerce(v, inner, where) for v in value)
    ok = {
        int: isinstance(value, int) and not isinstance(value, bool),
        float: isinstance(value, (int, float)) and not isinstance(value, bool),
        str: isinstance(value, str),
        bool: isinstance(value, bool),
    }[tp]
    if not ok:
        raise UserError(f"{where}: must be {_type_name(tp)}, got {value!r}")
    return float(value) if tp is float else value


def _build(cls: Any, data: Any, where: str) -> Any:
    if not isinstance(data, dict):
        raise UserError(f"{where}: must be a mapping, got {data!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.name != "source"}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise UserError(f"{where}.{unknown[0]}: unknown key (known: {', '.join(fields)})")
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
        else:
            kwargs[name] = _coerce(data[name], tp, key)
    return cls(**kwargs)


def _check(s: Scenario) -> None:
    """Rules across fields; each failure names the key."""
    m, t, r, b = s.model, s.topology, s.routing, s.bench

    def need(cond: bool, key: str, rule: str, value: Any) -> None:
        if not cond:
            raise UserError(f"{key}: {rule}, got {value!r}")

    for key in ("hidden", "tokens_per_rank", "topk", "experts_per_rank"):
        need(getattr(m, key) > 0, f"model.{key}", "must be positive", getattr(m, key))
    need(m.hidden % 8 == 0, "model.hidden", "must be a multiple of 8 elements (16 bytes)", m.hidden)
    need(m.dispatch_dtype in DTYPES, "model.dispatch_dtype", f"must be one of {', '.join(DTYPES)}",
         m.dispatch_dtype)
    need(m.combine_dtype == "bf16", "model.combine_dtype", "must be bf16", m.combine_dtype)
    if m.dispatch_dtype == "fp8":
        need(m.hidden % FP8_BLOCK == 0, "model.hidden",
             f"must be a multiple of {FP8_BLOCK} for fp8 dispatch", m.hidden)
    need(t.nodes > 0, "topology.nodes", "must be positive", t.nodes)
    need(t.gpus_per_node > 0, "topology.gpus_per_node", "must be positive", t.gpus_per_node)
    need(t.nvlink_gbps > 0, "topology.nvlink_gbps", "must be positive", t.nvlink_gbps)
    need(t.nic_gbps >= 0, "topology.nic_gbps", "must be zero or positive", t.nic_gbps)
    need(m.topk <= s.num_experts, "model.topk",
         f"must not exceed the total number of experts ({s.num_experts} = "
         f"{s.world} ranks x {m.experts_per_rank})", m.topk)
    need(r.kind in ROUTINGS, "routing.kind", f"must be one of {', '.join(ROUTINGS)}", r.kind)
    need(r.zipf_exponent >= 0, "routing.zipf_exponent", "must be zero or positive", r.zipf_exponent)
    need(0 < r.hot_fraction < 1, "routing.hot_fraction", "must lie strictly between 0 and 1",
         r.hot_fraction)
    need(r.hot_multiplier >= 1, "routing.hot_multiplier", "must be at least 1", r.hot_multiplier)
    need(r.hot_fraction * r.hot_multiplier < 1, "routing.hot_multiplier",
         "times hot_fraction must stay below 1 (the hot experts cannot take all the load)",
         r.hot_multiplier)
    need(b.warmup >= 0, "bench.warmup", "must be zero or positive", b.warmup)
    need(b.iters > 0, "bench.iters", "must be positive", b.iters)
    need(all(n > 0 for n in b.sms), "bench.sms", "must all be positive", list(b.sms))
    need(b.timeout_s > 0, "bench.timeout_s", "must be positive", b.timeout_s)
    need(0 < b.control_timeout_s <= MAX_CONTROL_TIMEOUT_S, "bench.control_timeout_s",
         f"must be positive and at most {MAX_CONTROL_TIMEOUT_S:g} s", b.control_timeout_s)
    need(b.device in DEVICES, "bench.device", f"must be one of {', '.join(DEVICES)}", b.device)
    need(s.mode in MODES, "mode", f"must be one of {', '.join(MODES)}", s.mode)


def parse(data: Any, source: str = "<scenario>") -> Scenario:
    """Validate a scenario mapping (as loaded from YAML)."""
    try:
        if isinstance(data, dict) and "name" not in data:
            data = {**data, "name": Path(source).stem}
        s = _build(Scenario, data, "scenario")
        _check(s)
    except UserError as e:
        msg = str(e)
        msg = msg[len("scenario."):] if msg.startswith("scenario.") else msg
        raise UserError(f"{source}: {msg}") from None
    return dataclasses.replace(s, source=source)


def load(path: "str | Path") -> Scenario:
    p = Path(path)
    if not p.is_file():
        raise UserError(f"{p}: no such scenario file")
    try:
        data = yaml.safe_load(p.read_text())
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        raise UserError(f"{p}: malformed YAML{where}: {getattr(e, 'problem', None) or e}") from None
    return parse(data, str(p))


def check_fits(s: Scenario, available: int, what: str) -> None:
    """A scenario needing more ranks than the host can give stops here."""
    if s.world > available:
        raise UserError(
            f"{s.source}: topology: needs {s.world} ranks ({s.topology.nodes} nodes x "
            f"{s.topology.gpus_per_node}) but {what} has {available}; use --nproc to run the "
            f"shape on fewer ranks")


def maybe_int_list(text: Optional[str], option: str) -> Optional[Tuple[int, ...]]:
    """Parses '4,8,16' from the command line."""
    if text is None:
        return None
    try:
        vals = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise UserError(f"{option}: must be a comma-separated list of integers, got {text!r}") from None
    if not vals or any(v <= 0 for v in vals):
        raise UserError(f"{option}: must list positive integers, got {text!r}")
    return vals
