"""The figures of the fidelity check (tools/fidelity.py) for the libraries that have no benchmark of
an MoE dispatch of their own: the plainest call of each, timed alone, on the scenario's shape.

``--library reference`` (NCCL)
    One ``torch.distributed.all_to_all_single`` of bytes (uint8 tensors) per op, with the scenario's
    per-pair split sizes: dispatch sends ``copies(s -> d) x row bytes`` of the dispatch dtype (fp8:
    the values and their float32 scales, as epbench counts a row, epbench/metrics.py), combine sends
    the same copies back as bf16 rows. Then the `reference` backend's own calls, phase by phase, in
    both call modes (tools/fidelity_phases.py): what it adds around that all-to-all.
``--library symm-mem``
    ``torch.ops.symm_mem.all_to_all_vdev`` (rank-major) of the same copies, from symmetric buffers
    allocated once as epbench's adapter allocates them (``TorchSymm``, epbench/backends/symm_mem.py),
    rows of the same bytes padded to the op's per-block unit (``row_unit``: every block's piece
    whole and 16-byte aligned) in inputs of at least ``VDEV_MIN_INPUT`` bytes, the splits written
    into their symmetric tensor once; combine: the way back, bf16 rows. Then the `symm-mem`
    backend's own calls, phase by phase, in both call modes, as for the reference.
``--library flashinfer``
    ``MoeAlltoAll.dispatch`` of the rows (fp8: and their scales), the top-k ids (int32) and weights
    (float32), with the library's own sanitising of the ids past each source's count, and
    ``MoeAlltoAll.combine`` of rows already in its workspace (``payload_in_workspace``): the stand-in
    expert writes them between the calls, outside the timed region. Workspace and mapping as
    epbench's adapter makes them (epbench/backends/flashinfer_a2a.py), sized for these payloads;
    without the source-token payload, the weighting and the counts the adapter adds.

The copies are those of the scenario's routing (epbench/routing.py), the rank's own included.
Nothing else is in a timed call: no packing, no count exchange, no host wait.

Timing is epbench's own (epbench/timing.py, and the alignment of epbench/launch.py's ``Comm``): per
call a short device sleep, a one-element all-reduce to line the ranks up, then events around the
call; ``warmup`` untimed and ``iters`` timed calls, dispatch and combine alternating. Rank 0 writes
every rank's samples (us) as JSON to ``--out``; tools/fidelity_parse.py reads them.

    python tools/fidelity_calls.py --library reference --scenario S.yaml --warmup 5 --iters 30 --out f.json

Runs its ranks with torch.multiprocessing (MASTER_ADDR / MASTER_PORT from the environment,
127.0.0.1 and 29500 where unset); ``--device cpu`` runs them over gloo (the reference only: a
check of the tool).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

REPO = Path(__file__).resolve().parent.parent
TOOLS = Path(__file__).resolve().parent
for _p in (str(REPO), str(TOOLS)):
    if _p not in sys.path:
        sys.path.insert(0, _p)

OPS = ("dispatch", "combine")
LIBRARIES = ("reference", "symm-mem", "flashinfer")
PHASED = ("reference", "symm-mem")  # whose epbench backend is then timed phase by phase (tools/fidelity_phases.py)
INVALID_EXPERT = -1  # the id flashinfer writes into the slots past each source's count


@dataclass
class Calls:
    """One library's two calls on this rank: ``dispatch()``, then ``fill(out)`` (untimed: the
    stand-in expert), then ``combine(out)``."""

    dispatch: Callable[[], Any]
    combine: Callable[[Any], Any]
    variant: Dict[str, str]  # op -> what is called, in words
    sent_bytes: Dict[str, int]  # op -> bytes this rank sends per call
    fill: Callable[[Any], None] = lambda out: None
    close: Callable[[], None] = lambda: None
    info: Dict[str, Any] = field(default_factory=dict)


def split_bytes(total: Any, rank: int, row: int, op: str) -> "tuple[List[int], List[int]]":
    """(input splits, output splits) in bytes for ``rank``: dispatch sends row ``rank`` of the
    copy matrix and receives its column; combine the reverse."""
    world = int(total.shape[0])
    send = [int(total[rank, d]) * row for d in range(world)]
    recv = [int(total[s, rank]) * row for s in range(world)]
    return (send, recv) if op == "dispatch" else (recv, send)


def nccl_calls(comm: Any, s: Any, total: Any) -> Calls:
    import torch
    import torch.distributed as dist

    from epbench.metrics import row_bytes

    m = s.model
    rows = {"dispatch": row_bytes(m.dispatch_dtype, m.hidden), "combine": row_bytes(m.combine_dtype, m.hidden)}
    run: Dict[str, Callable[[], Any]] = {}
    sent: Dict[str, int] = {}
    for op, row in rows.items():
        send, recv = split_bytes(total, comm.rank, row, op)
        inp = torch.randint(0, 256, (sum(send),), dtype=torch.uint8, device=comm.device)
        out = torch.empty(sum(recv), dtype=torch.uint8, device=comm.device)
        run[op] = (lambda o=out, i=inp, r=recv, sd=send: dist.all_to_all_single(o, i, r, sd))
        sent[op] = sum(send)
    return Calls(run["dispatch"], lambda out: run["combine"](), {op: "all_to_all_single" for op in OPS}, sent)


def symm_calls(comm: Any, s: Any, total: Any, symm: Any = None, dispatch_row: Optional[int] = None) -> Calls:
    """``symm``: the adapter's ``TorchSymm`` (tests pass a fake of torch's ops); ``dispatch_row``: the
    dispatch rows' stride in bytes instead of the padded row bytes (``row_stride_reason``)."""
    import torch

    from epbench.backends.symm_mem import SymmMemBackend, TorchSymm, row_unit, vdev_rows
    from epbench.driver import rank_setup
    from epbench.metrics import row_bytes

    m, w, me, dev = s.model, comm.world, comm.rank, comm.device
    unit = row_unit(w)
    rows = {op: -(-row_bytes(dt, m.hidden) // unit) * unit
            for op, dt in (("dispatch", m.dispatch_dtype), ("combine", m.combine_dtype))}
    if dispatch_row is not None:
        rows["dispatch"] = dispatch_row
    # symmetric tensors have one shape on every rank: the most any rank sends or receives
    most_sent = max(int(total[r].sum()) for r in range(w))
    most_recv = max(int(total[:, r].sum()) for r in range(w))
    shapes = {op: (vdev_rows(a, rows[op]), b) for op, (a, b) in
              (("dispatch", (most_sent, most_recv)), ("combine", (most_recv, most_sent)))}
    if symm is None:  # NVSHMEM sizes its heap once: room for the backend's buffers too (its phases run next)
        symm = TorchSymm(dev, sum((a + b) * rows[op] for op, (a, b) in shapes.items())
                         + SymmMemBackend.heap_bytes(rank_setup(s, comm)))
    splits = {"dispatch": total[me], "combine": total[:, me]}
    run: Dict[str, Callable[[], Any]] = {}
    for op in OPS:
        n_in, n_out = shapes[op]
        inp = symm.empty((n_in, rows[op]), torch.uint8, dev)
        out = symm.empty((n_out, rows[op]), torch.uint8, dev)
        in_splits = symm.empty((w,), torch.int64, dev)
        out_so = symm.empty((2, w), torch.int64, dev)
        inp.copy_(torch.randint(0, 256, inp.shape, dtype=torch.uint8, device=dev))
        in_splits.copy_(splits[op].to(device=dev, dtype=torch.int64))
        run[op] = (lambda i=inp, o=out, sp=in_splits, so=out_so: symm.all_to_all_vdev(i, o, sp, so))
    symm.barrier()  # every rank's buffers exist before the first exchange
    sent = {op: int(splits[op].sum()) * rows[op] for op in OPS}
    return Calls(run["dispatch"], lambda out: run["combine"](), {op: "all_to_all_vdev" for op in OPS}, sent,
                 close=symm.barrier, info={"row_bytes": rows})


def flashinfer_calls(comm: Any, s: Any, total: Any, lib: Any = None, group: Any = None) -> Calls:
    """``lib``: the library's names as epbench's adapter imports them (tests pass a fake)."""
    import torch
    import torch.distributed as dist

    from epbench.backends import flashinfer_a2a
    from epbench.driver import Inputs, timing_draws
    from epbench.routing import route_all

    m, w, me, dev = s.model, comm.world, comm.rank, comm.device
    lib = lib if lib is not None else flashinfer_a2a.import_library()
    group = group if group is not None else dist.group.WORLD
    inp = Inputs(s, route_all(s), dev).caller(me, timing_draws(1, False)[0])
    ids = inp.topk_idx.to(torch.int32)
    if m.dispatch_dtype == "bf16":
        payloads = [inp.x]
    else:  # bytes: the library copies them as they are
        payloads = [inp.x.view(torch.uint8), inp.x_scales.view(torch.uint8) if m.dispatch_dtype == "mxfp8"
                    else inp.x_scales]
    payloads += [ids, inp.topk_weights]
    ids_at = len(payloads) - 2
    per_token = sum(p[0].numel() * p.element_size() for p in payloads)
    t_max, h = m.tokens_per_rank, m.hidden
    mapping = lib.Mapping(world_size=w, rank=me, gpus_per_node=s.topology.gpus_per_node, tp_size=w, moe_ep_size=w)
    size = lib.workspace_size(w, t_max, per_token, h * 2)
    with warnings.catch_warnings():  # 0.7.1 deprecated the class for moe_ep's, which wraps it
        warnings.simplefilter("ignore", DeprecationWarning)
        a2a = lib.MoeAlltoAll(mapping, t_max, m.topk, w * m.experts_per_rank, workspace_size_per_rank=size,
                              mnnvl_config=lib.MnnvlConfig(comm_backend=lib.TorchDistBackend(group)))
    expert_rows = torch.randn(w * t_max, h, device=dev).to(torch.bfloat16)
    state: Dict[str, Any] = {}

    def dispatch() -> Any:
        return a2a.dispatch(ids, payloads, t_max, invalid_token_expert_id=INVALID_EXPERT,
                            expert_id_payload_index=ids_at)

    def fill(out: Any) -> None:
        ws = a2a.get_combine_payload_tensor_in_workspace(t_max, h, torch.bfloat16)
        ws.view(-1, h).copy_(expert_rows)
        state["ws"] = ws

    def combine(out: Any) -> Any:
        return a2a.combine(state["ws"], t_max, payload_in_workspace=True)

    def close() -> None:
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        a2a._reset_workspace()  # as the adapter: the mapped memory goes before the process group

    copies = int(total[me].sum())
    return Calls(dispatch, combine, {"dispatch": "MoeAlltoAll.dispatch", "combine": "MoeAlltoAll.combine"},
                 {"dispatch": copies * per_token, "combine": copies * 2 * h}, fill=fill, close=close,
                 info={"payload_bytes_per_token": per_token, "workspace_bytes_per_rank": size})


def phased_backend(library: str) -> Any:
    """The epbench backend class whose phases follow ``library``'s bare call."""
    if library == "symm-mem":
        from epbench.backends.symm_mem import SymmMemBackend
        return SymmMemBackend
    from epbench.backends.reference import ReferenceBackend
    return ReferenceBackend


def time_calls(comm: Any, calls: Calls, warmup: int, iters: int) -> Dict[str, List[float]]:
    """epbench's timer around each call, dispatch and combine alternating."""
    from epbench.timing import Timer

    n = warmup + iters
    timers = {op: Timer(comm.device, n) for op in OPS}
    for i in range(n):
        out = timers["dispatch"].time(i, calls.dispatch, align=comm.sync)
        calls.fill(out)
        timers["combine"].time(i, lambda: calls.combine(out), align=comm.sync)
    return {op: timers[op].samples_us(warmup) for op in OPS}


def row_stride_reason(row: int, s: Any) -> Optional[str]:
    """Why ``row`` cannot be the symm-mem dispatch rows' stride (None: it can): it must hold the row's
    bytes and split exactly into torch's per-block pieces; it need not keep them 16-byte aligned,
    which is what a stride such as 14432 (the adapter's before 2026-11-26) is there to time."""
    from epbench.backends.symm_mem import row_unit
    from epbench.metrics import row_bytes

    need, split = row_bytes(s.model.dispatch_dtype, s.model.hidden), row_unit(s.world) // 16
    if row < need or row % split:
        return f"--dispatch-row {row}: must be at least {need} (the row's bytes) and a multiple of {split}"
    return None


def unavailable(library: str, world: int, topk: int, device: str) -> Optional[str]:
    """Why ``library`` cannot run here (None: nothing known): the adapter's own limits, checked
    before any rank starts."""
    import torch

    cuda = device == "cuda" and torch.cuda.is_available()
    if library == "symm-mem":
        from epbench.backends import symm_mem

        try:
            import torch.distributed._symmetric_memory as sm
            nvshmem = bool(sm.is_nvshmem_available())
        except Exception:  # noqa: BLE001 - a torch without it: not usable, said by limits_reason
            nvshmem = False
        return symm_mem.limits_reason(world, nvshmem, "cuda" if cuda else "cpu")
    if library == "flashinfer":
        from epbench.backends import flashinfer_a2a

        try:
            flashinfer_a2a.import_library()
        except Exception as e:  # noqa: BLE001 - ImportError, or a dependency failing to load
            return f"flashinfer not importable ({' '.join(str(e).split()) or type(e).__name__})"
        return flashinfer_a2a.limits_reason(world, topk, torch.cuda.get_device_capability(0) if cuda else None)
    return None


def _rank(local_rank: int, world: int, args: argparse.Namespace) -> None:
    os.environ.update(RANK=str(local_rank), LOCAL_RANK=str(local_rank), WORLD_SIZE=str(world),
                      LOCAL_WORLD_SIZE=str(world))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29500")
    import torch
    import torch.distributed as dist

    import fidelity_phases
    from epbench import launch, routing, scenario
    from epbench.metrics import median

    launch.apply_safe_env()
    s = scenario.load(args.scenario)
    comm = launch.init_distributed(args.device, timeout_s=args.control_timeout)
    m = s.model
    total = routing.traffic(routing.route_all(s), m.experts_per_rank, s.topology.gpus_per_node, False).total
    build = {"reference": nccl_calls, "symm-mem": symm_calls, "flashinfer": flashinfer_calls}[args.library]
    calls = (symm_calls(comm, s, total, dispatch_row=args.dispatch_row) if args.library == "symm-mem"
             else build(comm, s, total))
    samples = time_calls(comm, calls, args.warmup, args.iters)
    calls.close()
    variant = calls.variant
    mine: Dict[str, Any] = {"rank": comm.rank, "samples": samples, "bytes": calls.sent_bytes, "info": calls.info}
    del calls  # its buffers (symmetric memory, a mapped workspace) go while the process group is there
    sets = args.input_sets or s.bench.input_sets[0]
    if args.library in PHASED:
        mine["phases"] = fidelity_phases.measure(comm, s, args.warmup, args.iters, sets,
                                                 make=phased_backend(args.library))
    everyone: List[Any] = [None] * world
    dist.all_gather_object(everyone, mine)
    if comm.rank == 0:
        data = {"library": args.library, "variant": variant, "scenario": s.name, "world": world,
                "dtype": m.dispatch_dtype, "hidden": m.hidden, "warmup": args.warmup, "iters": args.iters,
                "device": args.device, "torch": torch.__version__,
                "nccl": ".".join(map(str, torch.cuda.nccl.version())) if args.device == "cuda" else None,
                "samples_us": {op: {str(e["rank"]): e["samples"][op] for e in everyone} for op in OPS},
                "bytes": {op: {str(e["rank"]): e["bytes"][op] for e in everyone} for op in OPS},
                "info": {str(e["rank"]): e["info"] for e in everyone}}
        if args.library in PHASED:
            data["input_sets"] = sets
            data["phases"] = fidelity_phases.gather([e["phases"] for e in everyone])
        Path(args.out).write_text(json.dumps(data, indent=1) + "\n")
        for op in OPS:
            worst = max(median(v) for v in data["samples_us"][op].values())
            print(f"[{args.library}] {op} ({variant[op]}): slowest rank's median {worst:.1f} us "
                  f"over {args.iters} calls", flush=True)
    dist.barrier()
    dist.destroy_process_group()


def main(argv: "List[str] | None" = None) -> int:
    ap = argparse.ArgumentParser(prog="python tools/fidelity_calls.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--library", choices=LIBRARIES, default="reference")
    ap.add_argument("--scenario", required=True, help="scenario YAML (its world is the rank count)")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--input-sets", type=int, default=None,
                    help="the backend's phases (reference, symm-mem): input sets the calls rotate over "
                         "(default: the scenario's first)")
    ap.add_argument("--dispatch-row", type=int, default=None,
                    help="symm-mem: the dispatch rows' stride in bytes (default: the row's bytes padded to "
                         "row_unit); e.g. 14432 at DeepSeek-V3's shape, the adapter's stride before "
                         "2026-11-26, to time its misaligned per-block pieces alone")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--control-timeout", type=float, default=300.0)
    ap.add_argument("--out", required=True, help="JSON file for the samples")
    args = ap.parse_args(argv)
    import torch.multiprocessing as mp

    from epbench import scenario

    s = scenario.load(args.scenario)
    world = s.world
    why = unavailable(args.library, world, s.model.topk, args.device)
    if args.dispatch_row is not None:
        why = why or ("--dispatch-row is for symm-mem" if args.library != "symm-mem"
                      else row_stride_reason(args.dispatch_row, s))
    if why:
        print(f"fidelity_calls: {args.library} not run: {why}", file=sys.stderr)
        return 2
    mp.spawn(_rank, args=(world, args), nprocs=world)
    return 0


if __name__ == "__main__":
    sys.exit(main())
