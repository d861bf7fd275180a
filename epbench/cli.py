"""The epbench command line. Each command parses options and calls one function."""

from __future__ import annotations

import inspect
import os
import sys
import traceback
from pathlib import Path
from typing import Annotated, List, Optional, Tuple

import typer
from rich.markup import escape

try:  # typer >= 0.24 carries its own copy of click
    from typer._click import exceptions as click_errors
except ImportError:  # pragma: no cover - older typer on plain click
    from click import exceptions as click_errors


from epbench import launch, scenario
from epbench.console import wide_console
from epbench.errors import StartupError, UserError, VerificationFailed


def _flag_without_placeholder() -> None:
    """typer's rich help prints a type placeholder (``<bool>``) after every flag, --help included;
    a flag takes no value, so it gets none."""
    from typer.core import TyperOption

    shown = getattr(TyperOption, "display_type_rich", None)
    if shown is None or getattr(shown, "epbench_quiet", False):
        return  # typer before 0.28 has no such hook (and prints no placeholder there)

    def display_type_rich(self, ctx):
        return None if self.is_flag else shown(self, ctx)

    display_type_rich.epbench_quiet = True
    TyperOption.display_type_rich = display_type_rich


_flag_without_placeholder()

app = typer.Typer(add_completion=False, pretty_exceptions_enable=False, no_args_is_help=True,
                  help="Benchmark MoE expert-parallel dispatch/combine and characterise its bandwidth.\n\n"
                       "Start with `epbench run` (the scenarios that fit this host) or "
                       "`epbench run scenarios/smoke.yaml` (CPU, seconds).")
console = wide_console()
err = wide_console(stderr=True)

SCENARIOS = Path(__file__).resolve().parent.parent / "scenarios"


def _given_path(value: object) -> Path:
    """A path argument or option as typed. An empty string is refused (a usage error: one line,
    exit 2): Path('') is '.', so `--results ''` would write into the current folder, `--json ''`
    name it and `report ''` read it, none of which was asked for."""
    if isinstance(value, Path):  # a default
        return value
    if str(value) == "":
        raise typer.BadParameter("must name a file or folder, got an empty string")
    return Path(str(value))


def path_argument(**kw):
    """typer.Argument of a path: an empty string refused (_given_path)."""
    return typer.Argument(parser=_given_path, **kw)


def path_option(*names: str, **kw):
    """typer.Option of a path: an empty string refused (_given_path), <path> in the help as before."""
    return typer.Option(*names, parser=_given_path, metavar="<path>", **kw)


ScenarioArg = Annotated[Optional[Path], path_argument(
    help="Scenario YAML. Default: the shipped scenario that fits this host.", show_default=False)]
NprocOpt = Annotated[Optional[int], typer.Option("--nproc", help="Run the scenario's shape on this many ranks (one node).")]
BackendsOpt = Annotated[Optional[str], typer.Option("--backends", help="Comma-separated backends (default: the scenario's).")]
SmsOpt = Annotated[Optional[str], typer.Option("--sms", help="Comma-separated SM counts, e.g. 8,16,24.")]
TokensOpt = Annotated[Optional[str], typer.Option("--tokens", help="Comma-separated tokens per rank, e.g. 1,8,32,128,256 (default: the scenario's).")]
ItersOpt = Annotated[Optional[int], typer.Option("--iters", help="Timed iterations per point.")]
WarmupOpt = Annotated[Optional[int], typer.Option("--warmup", help="Untimed iterations per point.")]
DeviceOpt = Annotated[Optional[str], typer.Option("--device", help="auto | cuda | cpu (default: the scenario's).")]
ResultsOpt = Annotated[Path, path_option("--results", help="Folder that receives the run folder.")]
NnodesOpt = Annotated[Optional[int], typer.Option("--nnodes", help="Nodes (multi-node runs; passed to torchrun).")]
NodeRankOpt = Annotated[Optional[int], typer.Option("--node-rank", help="This node's rank (passed to torchrun).")]
RdzvOpt = Annotated[Optional[str], typer.Option("--rdzv-endpoint", help="HOST:PORT of the rendezvous (passed to torchrun).")]
RdzvTimeoutOpt = Annotated[Optional[int], typer.Option("--rdzv-timeout", help="Seconds to wait for every node to join (multi-node; torchrun's default otherwise).")]
RunDirOpt = Annotated[Optional[Path], path_option("--run-dir", hidden=True)]
ControlTimeoutOpt = Annotated[Optional[float], typer.Option("--control-timeout", help="Seconds the ranks wait for each other at a barrier, gather or start-up before stopping with one line naming the missing ranks (default: the scenario's bench.control_timeout_s, 300).")]
MpsOpt = Annotated[bool, typer.Option("--mps/--no-mps", help="Start a private MPS daemon for the run (ranks sharing a GPU then run side by side; needs root).")]
InputSetsOpt = Annotated[Optional[str], typer.Option("--input-sets", help=f"Input sets the timed calls rotate through (other token values, the same routes on other tokens), e.g. 4; 1 = the same inputs every call; a list (1,4) times each point once per entry, side by side. Default: the scenario's bench.input_sets ({scenario.INPUT_SETS}).", show_default=False)]
CallModesOpt = Annotated[Optional[str], typer.Option("--call-modes", help="How baselines are called, each timed on its own rows (column call_mode): call (as a model's forward pass calls it: layout, count exchange, host waits, the weighting a user adds) and/or kernel (the library's fastest path as its own benchmark times it, e.g. DeepEP's cached handle); a backend with one way runs call only. Default: the scenario's bench.call_modes (call,kernel).", show_default=False)]
GraphChainOpt = Annotated[Optional[int], typer.Option("--graph-chain", help=f"Low-latency runs on a GPU: also time K back-to-back calls per op captured in one CUDA graph (rows 'graph xK': the per-call cost inside a graph, as in a decode step's), 0 = off; default {scenario.GRAPH_CHAIN}.", show_default=False)]
NoCeilOpt = Annotated[bool, typer.Option("--no-ceilings", help="Skip measuring the copy-engine and SM-store ceilings (GPU runs).")]
OptionOpt = Annotated[Optional[List[str]], typer.Option(
    "--option", help="A backend option, key=value or backend.key=value (repeatable; docs/backends.md).")]
WideOpt = Annotated[bool, typer.Option("--wide", help="Table with every column (spread over ranks, NVML, NIC, ceilings, slowest rank); the columns that tell rows apart (tokens, call, inputs) are shown wherever they vary.")]
ColumnsOpt = Annotated[Optional[str], typer.Option("--columns", help="Table columns by key, e.g. op,backend,sms,time,busbw (keys: tokens, op, backend, kernel, sms, call, timing, inputs, time, p99, algbw, busbw, link, nvml, nic, ceiling, slow_rank, wrong; each once, not with --wide; timing and p99 apply to low-latency rows only).")]
FaultOpt = Annotated[Optional[str], typer.Option("--inject-fault", hidden=True,
                                                 help="dispatch | combine: corrupt one output row (tests the checks).")]


def version_text() -> str:
    """epbench's version, commit and the kernel build this copy finds (one line each)."""
    from epbench import __version__, cuda_lib, nvshmem_lib, provenance

    commit = provenance.git_commit()

    def built(path: Path) -> str:
        return f"built ({short(path)})" if path.exists() else "not built (`make build` on a GPU host)"

    def short(path: Path) -> str:
        return str(path.relative_to(Path.cwd())) if path.is_relative_to(Path.cwd()) else str(path)

    return (f"epbench {__version__}\ncommit: {commit['git_commit']} ({commit['git_commit_from']})\n"
            f"kernels: {built(cuda_lib.LIB_PATH)}\nNVSHMEM groundwork: {built(nvshmem_lib.LIB_PATH)}")


def _version(value: bool) -> None:
    if value:
        console.print(version_text(), markup=False, highlight=False)
        raise typer.Exit(0)


@app.callback()
def _root(debug: Annotated[bool, typer.Option("--debug", help="Show full tracebacks.")] = False,
          version: Annotated[bool, typer.Option("--version", is_eager=True, callback=_version,
                                                help="Print version, commit and the kernel build found, and exit.")] = False) -> None:
    if debug:
        os.environ["EPBENCH_DEBUG"] = "1"


# The shipped scenarios `epbench run` runs without a path, by the number of GPUs on the host.
DEFAULTS = {0: ("smoke",), 1: ("dsv3x4-1gpu",), 2: ("dsv3x2", "h8192x2", "dsv3x2x1-virtual"),
            4: ("h200x4",), 8: ("h100x8",)}


def default_names(gpus: int) -> Tuple[str, ...]:
    """The default scenarios of a host with ``gpus`` GPUs: those of the largest count it reaches."""
    return DEFAULTS[max(n for n in DEFAULTS if n <= max(gpus, 0))]


def default_scenarios() -> List[Path]:
    """The shipped scenarios that match this host (DEFAULTS), announced in one line."""
    import torch

    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    paths = [SCENARIOS / f"{name}.yaml" for name in default_names(n)]
    shown = ", ".join(str(p.relative_to(Path.cwd())) if p.is_relative_to(Path.cwd()) else str(p)
                      for p in paths)
    console.print(f"no scenario given: running {shown} ({n} CUDA GPU{'s' if n != 1 else ''} found)")
    return paths


def default_scenario() -> Path:
    return default_scenarios()[0]


def share_note(ranks: int, gpus: int) -> str:
    return (f"note: {ranks} ranks on {gpus} GPU{'s' if gpus != 1 else ''}: ranks share GPUs, so this "
            f"is a functional run (the kernels are verified; nothing crosses a link, so no bus "
            f"bandwidth, link % or ceiling is given)")


def resolve_device(s: scenario.Scenario, device: Optional[str], share: bool = True) -> str:
    """The device a run uses. More ranks than GPUs on the host: the ranks share the GPUs (a
    functional run, said in one loud line) where ``share`` allows it, else one clear error."""
    import torch

    want = device or s.bench.device
    if want not in scenario.DEVICES:
        raise UserError(f"--device: must be one of {', '.join(scenario.DEVICES)}, got {want!r}")
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if want == "auto":
        want = "cuda" if gpus else "cpu"
    if want == "cuda":
        per_host = s.topology.ranks_per_host
        key = "topology.virtual_nodes" if s.topology.virtual_nodes else "topology.gpus_per_node"
        if gpus < per_host and not (share and gpus):
            raise UserError(f"{s.source}: {key}: needs {per_host} GPUs on this host but it has "
                            f"{gpus}; use --nproc N to run the shape on fewer ranks"
                            f"{' or --device cpu' if not gpus else ''}")
        if gpus < per_host:
            console.print(f"[bold yellow]{share_note(per_host, gpus)}[/]", highlight=False)
    return want


def _prepare(path: Optional[Path], nproc: Optional[int], backends: Optional[str],
             sms: Optional[str], iters: Optional[int], warmup: Optional[int],
             option: Optional[List[str]] = None, input_sets: Optional[str] = None,
             call_modes: Optional[str] = None):
    import dataclasses

    from epbench import options

    s = scenario.load(path or default_scenario())
    sets = scenario.maybe_int_list(input_sets, "--input-sets", scenario.MAX_INPUT_SETS)
    if sets:
        s = dataclasses.replace(s, bench=dataclasses.replace(s.bench, input_sets=sets))
    modes = scenario.call_mode_list(call_modes, "--call-modes")
    if modes:
        s = dataclasses.replace(s, bench=dataclasses.replace(s.bench, call_modes=modes))
    if option:
        s = dataclasses.replace(s, backend_options=options.merge(s.backend_options, options.parse_cli(option)))
    options.diagnostics_set()  # a diagnostic switch set to a bad value stops the run here, in one line
    if nproc is not None:
        s = s.with_world(nproc)
    names = s.bench.backends
    if backends is not None:
        names = tuple(b.strip() for b in backends.split(",") if b.strip())
        if not names:
            raise UserError(f"--backends: must name at least one backend, got {scenario.shown(backends)}")
        scenario.check_backends(names, "--backends")
    if "epbench" in names:  # with --option and the environment (EPBENCH_OWN_ROWS) weighed in
        options.check_payload(s.backend_options, s.model.layout, s.model.quantize, s.source, world=s.world)
    sms_list = scenario.maybe_int_list(sms, "--sms", scenario.MAX_SMS) or s.bench.sms
    for opt, v, rule in (("--iters", iters, "positive"), ("--warmup", warmup, "zero or positive")):
        if v is not None and not (1 if opt == "--iters" else 0) <= v <= scenario.MAX_ITERS:
            raise UserError(f"{opt}: must be {rule} and at most {scenario.MAX_ITERS}, got {v}")
    from epbench.driver import RunOptions  # torch comes in only once the input is known good

    opts = RunOptions(backends=names, sms=sms_list,
                      warmup=s.bench.warmup if warmup is None else warmup,
                      iters=s.bench.iters if iters is None else iters)
    return s, opts


def check_memory(s: scenario.Scenario, device: str, tokens: Optional[tuple]) -> None:
    """Refuses a shape whose buffers cannot fit in one rank's memory (the device's, or the
    host's share for CPU ranks) before anything is launched."""
    per_host = s.topology.ranks_per_host
    if device == "cuda":
        import torch

        gpus = torch.cuda.device_count()
        per_gpu = -(-per_host // max(gpus, 1))  # ranks sharing one GPU
        have = min(torch.cuda.get_device_properties(i).total_memory for i in range(gpus)) // per_gpu
        what = "each GPU of this host" if per_gpu == 1 else f"each GPU shared by {per_gpu} ranks"
    else:
        # what the host can still give (MemAvailable: free memory and the caches the kernel can
        # drop, less what other processes and this launcher already hold), not its total: CPU
        # ranks that outgrow it are killed by the OOM killer, not refused
        have = _host_memory() // per_host
        what = f"this host's memory available to {per_host} CPU ranks"
    scenario.check_fits(s, s.world, what, have, max(tokens) if tokens else None, device,
                        _own_resident_bytes())


def _kib_field(path: str, key: str) -> Optional[int]:
    """Bytes of the ``key:`` line (in kB) of a /proc file, None where it cannot be read."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _host_memory() -> int:
    """Bytes of memory available to new processes (MemAvailable, else the physical total), no more
    than this process's memory cgroup still allows (a container's limit, which MemAvailable does
    not show and whose OOM killer acts first)."""
    got = _kib_field("/proc/meminfo", "MemAvailable")
    host = got if got is not None else os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    room = launch.cgroup_memory_room()
    return host if room is None else min(host, room)


def _own_resident_bytes() -> int:
    """This process's resident bytes (VmRSS), 0 where unknown: by the memory check it has
    imported torch and the driver, as every rank does before its first tensor, so it stands
    for what an idle rank holds (a rank adds its process group, a few tens of MB more)."""
    return _kib_field("/proc/self/status", "VmRSS") or 0


def check_graph_chain(k: Optional[int]) -> int:
    """--graph-chain K: 0 (no chain rows) or 2..MAX_GRAPH_CHAIN calls per graph (1 would repeat the
    graph rows); None: the default."""
    if k is None:
        return scenario.GRAPH_CHAIN
    if k != 0 and not 2 <= k <= scenario.MAX_GRAPH_CHAIN:
        raise UserError(f"--graph-chain: must be 0 (off) or 2 to {scenario.MAX_GRAPH_CHAIN} calls per graph "
                        f"(1 is the graph rows), got {k}")
    return k


def _launch(command: str, path: Optional[Path], **given) -> None:
    """run and sweep: the plan of the launch, then its jobs (or, in a process that torchrun
    started by hand, this rank's part of it)."""
    p = _plan(command, path, **given)
    if launch.under_torchrun():  # torchrun started by hand: this process is one of the ranks
        from epbench.rank import run_plan

        raise typer.Exit(run_plan(p, 0, launched=False))
    from epbench.launcher import start

    raise typer.Exit(start(p))


def check_endpoint(endpoint: str) -> None:
    """--rdzv-endpoint is HOST:PORT with a host this machine can look up (torchrun given a name that
    resolves nowhere prints pages of C++ frames and waits out its timeouts)."""
    import socket

    host, _, port = endpoint.rpartition(":")
    host = host.strip("[]")  # [IPv6]:PORT
    if not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise UserError(f"--rdzv-endpoint: give HOST:PORT (a port 1-65535), got {endpoint!r}")
    try:
        socket.getaddrinfo(host, int(port))
    except (socket.gaierror, UnicodeError) as e:
        raise UserError(f"--rdzv-endpoint: cannot look up host {host!r} "
                        f"({getattr(e, 'strerror', None) or type(e).__name__})") from None


def _plan(command: str, path: Optional[Path], *, nproc=None, backends=None, sms=None, iters=None,
          warmup=None, device=None, results: Path = Path("results"), nnodes=None, node_rank=None,
          rdzv_endpoint=None, run_dir=None, inject_fault=None, no_ceilings: bool = False,
          tokens: Optional[str] = None, rdzv_timeout: Optional[int] = None, mps: bool = False,
          option: Optional[List[str]] = None, control_timeout: Optional[float] = None,
          graph_chain: Optional[int] = None, input_sets: Optional[str] = None,
          call_modes: Optional[str] = None, columns: Optional[Tuple[str, ...]] = None):
    """The checked options of run / sweep as a plan (epbench/plan.py); its run folder is claimed
    here (torchrun started by hand: rank 0 makes one). UserError for anything wrong."""
    import dataclasses

    from epbench.plan import Plan

    launch.apply_safe_env()
    by_hand = launch.under_torchrun()
    if path is None and by_hand:
        raise UserError("a scenario file is required under torchrun")
    token_list = scenario.maybe_int_list(tokens, "--tokens", scenario.MAX_SHAPE["tokens_per_rank"])
    chain = check_graph_chain(graph_chain)
    if not by_hand:  # cheap checks of the output folders before torch comes in
        from epbench.results import check_new_run_dir

        check_new_run_dir(results, run_dir)
    path = path or default_scenario()
    s, opts = _prepare(path, nproc, backends, sms, iters, warmup, option, input_sets, call_modes)
    if inject_fault not in (None, "dispatch", "combine"):
        raise UserError(f"--inject-fault: must be dispatch or combine, got {scenario.shown(inject_fault)}")
    opts = dataclasses.replace(opts, inject_fault=inject_fault, ceilings=not no_ceilings,
                               tokens=token_list, graph_chain=chain)
    if "epbench-ll" in opts.backends and s.mode == "low_latency":
        from epbench import options

        options.check_ll_lines(s.backend_options, token_list or [s.model.tokens_per_rank], s.source)
    if control_timeout is None:
        control_timeout = s.bench.control_timeout_s
    if not 0 < control_timeout <= scenario.MAX_CONTROL_TIMEOUT_S:
        raise UserError(f"--control-timeout: must be positive and at most "
                        f"{scenario.MAX_CONTROL_TIMEOUT_S:g} s, got {control_timeout:g}")
    common = dict(verb=command, scenario=s, options=opts, results=results,
                  control_timeout_s=float(control_timeout), argv=tuple(sys.argv[1:]), columns=columns)
    if by_hand:
        return Plan(device=device or s.bench.device, run_dir=run_dir, jobs=(opts.backends,), **common)
    dev = resolve_device(s, device)
    if backends is not None:
        check_named_backends(s, opts.backends, dev)
    check_memory(s, dev, opts.tokens)
    nodes = 1 if nnodes is None else nnodes
    if nodes < 1:
        raise UserError(f"--nnodes: must be at least 1, got {nnodes}")
    if node_rank is not None and not 0 <= node_rank < nodes:
        raise UserError(f"--node-rank: must be 0 to {nodes - 1} (--nnodes {nodes}), got {node_rank}")
    if nodes > 1 and not rdzv_endpoint:
        raise UserError("--nnodes: a multi-node run needs --rdzv-endpoint HOST:PORT (the same on every node)")
    if nodes > 1 and nodes != s.topology.nodes:
        raise UserError(f"--nnodes {nodes}: {s.source} describes {s.topology.nodes} node(s)")
    if rdzv_timeout is not None and rdzv_timeout < 1:
        raise UserError(f"--rdzv-timeout: must be at least 1 second, got {rdzv_timeout}")
    if s.topology.nodes > 1 and nodes == 1 and not s.topology.virtual_nodes:
        raise UserError(f"{s.source}: topology.nodes: this scenario spans {s.topology.nodes} nodes; "
                        f"start it on every node with --nnodes {s.topology.nodes} --node-rank N "
                        f"--rdzv-endpoint HOST:PORT, or use --nproc to run its shape on one node")
    if rdzv_endpoint:
        check_endpoint(rdzv_endpoint)
    for note in ineffective_options(s, opts, dev, mps=mps, graph_chain=graph_chain, sms=sms, option=option):
        _warn(note)
    from epbench.launcher import jobs_of
    from epbench.results import claim_run_dir, new_run_dir

    run_dir = claim_run_dir(run_dir) if run_dir else new_run_dir(results, s, opts.tokens)
    return Plan(device=dev, run_dir=run_dir, jobs=jobs_of(opts.backends, nodes), nnodes=nodes,
                node_rank=node_rank, rdzv_endpoint=rdzv_endpoint, rdzv_timeout_s=rdzv_timeout,
                mps=mps, **common)


def unrunnable_reason(s: scenario.Scenario, name: str, device: str) -> Optional[str]:
    """Why backend ``name`` would be skipped on every rank of this run (words that follow its
    name), by the ranks' own rule: a scenario mode it does not implement (driver.mode_reason) or,
    on CPU ranks, its unavailable_reason
    there, the same call with the same setup as on a rank. None where it may run; where its class
    cannot be imported here; for a DeepEP flavor's availability (its job runs from the flavor's
    own venv, whose libraries this process lacks); and on GPUs, which the ranks judge."""
    import dataclasses
    from types import SimpleNamespace

    from epbench import driver, flavors
    from epbench.backends import load_backend

    be_cls, _ = load_backend(name)
    if be_cls is None:
        return None
    why = driver.mode_reason(be_cls, s.mode)
    if why is None and device == "cpu" and name not in flavors.BACKEND_FLAVOR:
        import torch

        setup = driver.rank_setup(s, SimpleNamespace(rank=0, world=s.world, device=torch.device("cpu")))
        as_normal = driver.runs_as_normal(be_cls, s.mode)
        why = be_cls.unavailable_reason(dataclasses.replace(setup, mode="normal") if as_normal else setup)
        why = why and f"cannot run on CPU ranks: {why}"
    return why


def check_named_backends(s: scenario.Scenario, names: Tuple[str, ...], device: str) -> None:
    """--backends of which none can run this scenario (unrunnable_reason) would start the ranks to
    measure nothing, exit 0 and leave a complete run of skip rows: refused before launch, naming each
    and why. Where one of them can run, the others are left to the ranks (their skip rows stay)."""
    reasons = []
    for name in names:
        why = unrunnable_reason(s, name, device)
        if why is None:
            return
        reasons.append(f"{name} {why}")
    raise UserError(f"--backends: nothing would be measured in {s.source} ({s.mode} mode): {'; '.join(reasons)}")


def ineffective_options(s: scenario.Scenario, opts, device: str, *, mps: bool = False,
                        graph_chain: Optional[int] = None, sms: Optional[str] = None,
                        option: Optional[List[str]] = None) -> List[str]:
    """Options given that change nothing in this run, one note each (the run goes on: they are valid,
    only idle here): --mps with CPU ranks, --graph-chain outside a low-latency run on GPUs, --sms where
    no backend of the run takes an SM count, an --option for a backend the run does not include."""
    from epbench.backends import load_backend
    from epbench import options as backend_options

    notes = []
    if mps and device != "cuda":
        notes.append("--mps: no effect: the ranks run on the CPU (MPS shares a GPU between ranks)")
    if graph_chain and (s.mode != "low_latency" or device != "cuda"):
        notes.append(f"--graph-chain {graph_chain}: no effect: chain rows are timed in low-latency runs on GPUs "
                     f"(this run: {s.mode} mode, {device})")
    if sms is not None and not any(getattr(load_backend(b)[0], "uses_sms", True) for b in opts.backends):
        notes.append(f"--sms {sms}: no effect: no backend of this run ({', '.join(opts.backends)}) takes an SM "
                     f"count; each point is timed once, at auto")
    for backend, given in backend_options.parse_cli(option or ()).items():
        if backend not in opts.backends:
            keys = ", ".join(f"{backend}.{k}" for k in given)
            notes.append(f"--option {keys}: no effect: {backend} is not among this run's backends "
                         f"({', '.join(opts.backends)})")
    return notes


def _plan_options(params: dict) -> dict:
    """run / sweep's own parameters as _plan's keywords (the names are the same), --wide and
    --columns made one column choice."""
    given = {k: v for k, v in params.items() if k not in ("path", "wide", "columns")}
    given["columns"] = _table_choice(params["wide"], params["columns"])
    return given


def _table_choice(wide: bool, columns: Optional[str]) -> Optional[Tuple[str, ...]]:
    """--wide / --columns of run and sweep, checked (they change what is printed, never what is
    measured); None: the default table."""
    if not wide and columns is None:
        return None  # epbench.report (pandas, torch) is not imported before input is checked
    from epbench.report import parse_columns

    return parse_columns(columns, wide)


@app.command()
def run(path: ScenarioArg = None, nproc: NprocOpt = None, backends: BackendsOpt = None,
        sms: SmsOpt = None, iters: ItersOpt = None, warmup: WarmupOpt = None,
        device: DeviceOpt = None, results: ResultsOpt = Path("results"), nnodes: NnodesOpt = None,
        node_rank: NodeRankOpt = None, rdzv_endpoint: RdzvOpt = None, run_dir: RunDirOpt = None,
        inject_fault: FaultOpt = None, no_ceilings: NoCeilOpt = False, tokens: TokensOpt = None,
        rdzv_timeout: RdzvTimeoutOpt = None, mps: MpsOpt = False,
        option: OptionOpt = None, control_timeout: ControlTimeoutOpt = None, wide: WideOpt = False,
        columns: ColumnsOpt = None, graph_chain: GraphChainOpt = None,
        input_sets: InputSetsOpt = None, call_modes: CallModesOpt = None) -> None:
    """Measure a scenario once at its own settings (or a few --sms / --tokens values) and print
    one table. Without a path: each shipped scenario that fits this host.

    run or sweep: both measure the same points and write one results folder; sweep requires
    --sms and/or --tokens, shows a progress bar and is meant for long series (plot them with
    `epbench plot`). Use run for a first look or a check, sweep to chart a curve.

    Example: epbench run scenarios/smoke.yaml --device cpu"""
    given = _plan_options(locals())
    paths = [path] if path is not None or launch.under_torchrun() else default_scenarios()
    worst = 0
    for p in paths:
        try:
            _launch("run", p, **given)
        except typer.Exit as e:
            worst = worst or e.exit_code
    raise typer.Exit(worst)


@app.command()
def sweep(path: Annotated[Path, path_argument(help="Scenario YAML.")],
          sms: Annotated[Optional[str], typer.Option("--sms", help="Comma-separated SM counts, e.g. 4,8,16,24,32.")] = None,
          tokens: TokensOpt = None,
          nproc: NprocOpt = None, backends: BackendsOpt = None, iters: ItersOpt = None,
          warmup: WarmupOpt = None, device: DeviceOpt = None,
          results: ResultsOpt = Path("results"), nnodes: NnodesOpt = None,
          node_rank: NodeRankOpt = None, rdzv_endpoint: RdzvOpt = None,
          run_dir: RunDirOpt = None, inject_fault: FaultOpt = None,
          no_ceilings: NoCeilOpt = False, rdzv_timeout: RdzvTimeoutOpt = None,
          mps: MpsOpt = False, option: OptionOpt = None, control_timeout: ControlTimeoutOpt = None,
          wide: WideOpt = False,
          columns: ColumnsOpt = None, graph_chain: GraphChainOpt = None,
          input_sets: InputSetsOpt = None, call_modes: CallModesOpt = None) -> None:
    """Measure a series: the scenario at each SM count and/or tokens per rank (one of them is
    required), with a progress bar; one results folder for all, ready for `epbench plot`.

    Example: epbench sweep scenarios/dsv3x4-1gpu.yaml --sms 8,16,24,32"""
    given = _plan_options(locals())
    if sms is None and tokens is None:
        raise UserError("sweep: give --sms (SM counts) and/or --tokens (tokens per rank)")
    _launch("sweep", path, **given)


@app.command()
def overlap(path: Annotated[Path, path_argument(help="Scenario YAML.")], nproc: NprocOpt = None,
            sms: Annotated[Optional[str], typer.Option("--sms", help="SM counts for the communication, e.g. 4,8,16,32 (the GEMM gets the rest).")] = None,
            backends: BackendsOpt = None,
            gemm: Annotated[Optional[str], typer.Option("--gemm", help="M,N,K (default 8192,8192,8192), or experts[:INTERMEDIATE] for the rank's expert GEMMs.")] = None,
            iters: ItersOpt = None, warmup: WarmupOpt = None, call_modes: CallModesOpt = None,
            option: OptionOpt = None,
            results: ResultsOpt = Path("results"), run_dir: RunDirOpt = None) -> None:
    """What dispatch/combine cost a GEMM running beside them on the other SMs, and back (CUDA).
    Each DeepEP flavor's backends run in their own job, from the venv `make baselines` recorded
    for it; the others together in one job; all into one results folder. Baselines run in each
    asked call mode (a line each where there are several).

    Example: epbench overlap scenarios/dsv3x4.yaml --nproc 1 --sms 8,16,32"""
    import dataclasses

    import torch

    from epbench import overlap as ov
    from epbench.plan import Plan

    launch.apply_safe_env()
    spec = ov.parse_gemm(gemm)
    s, opts = _prepare(path, nproc, backends, sms, iters, warmup, option, call_modes=call_modes)
    if s.mode != "normal":  # as the ranks would say, but before any starts
        raise UserError(f"{s.source}: mode: overlap measures normal mode only (not {s.mode})")
    if backends is not None:
        check_named_backends(s, opts.backends, "cuda")
    if not launch.under_torchrun():  # cheap checks of the output folders, as run's
        from epbench.results import check_new_run_dir

        check_new_run_dir(results, run_dir)
    o = ov.OverlapOptions(opts.backends, opts.sms, opts.warmup, opts.iters, spec)
    p = Plan(verb="overlap", scenario=s, options=o, device="cuda", argv=tuple(sys.argv[1:]),
             results=results, run_dir=run_dir, jobs=(o.backends,))
    if launch.under_torchrun():  # torchrun started by hand: this process is one rank of one job
        from epbench.rank import run_plan

        raise typer.Exit(run_plan(p, 0, launched=False, show=show_overlap))
    if not torch.cuda.is_available():
        raise UserError("overlap: needs a CUDA GPU (the GEMM is confined with a CUDA green context); none found")
    resolve_device(s, "cuda")
    from epbench.launcher import jobs_by_flavor, start
    from epbench.results import claim_run_dir, new_run_dir

    p = dataclasses.replace(p, run_dir=claim_run_dir(run_dir) if run_dir else new_run_dir(results, s, opts.tokens),
                            jobs=jobs_by_flavor(o.backends))
    raise typer.Exit(start(p, show_overlap))


def _start_one(p, show=None) -> None:
    """probe and ceiling: the plan's one job (in a process that torchrun started by hand, this
    rank's part of it), then ``show(run folder)`` where the run completed (None: nothing to show,
    the ranks printed it)."""
    if launch.under_torchrun():  # torchrun started by hand: this process is one of the ranks
        from epbench.rank import run_plan

        raise typer.Exit(run_plan(p, 0, launched=False, show=show))
    from epbench.launcher import start_one

    code = start_one(p)
    meta = _completed(p.run_dir) if show is not None and p.run_dir is not None else None
    if meta is not None:
        show(p.run_dir)
        if meta.get("wrong"):
            err.print(f"epbench: error: verification failed: {meta['wrong']} wrong (see the table); "
                      f"results: {p.run_dir}", markup=False, highlight=False, soft_wrap=True)
            code = code or 1
    raise typer.Exit(code)


def _completed(run_dir: Path) -> Optional[dict]:
    """meta.json of the run in ``run_dir`` where it finished measuring (its rows may still hold
    wrong ones), else None."""
    import json

    from epbench.results import META

    try:
        meta = json.loads((run_dir / META).read_text())
    except (OSError, ValueError):
        return None
    return meta if isinstance(meta, dict) and meta.get("status") == "complete" else None


def show_overlap(run_dir: Path) -> None:
    """An overlap run's table and notes, its plot (drawn here), a line per backend whose points
    were not measured, and the folder."""
    from epbench.plot import overlap_plot
    from epbench.report import print_run
    from epbench.results import load_run
    from epbench.session import show_unmeasured

    meta, df = load_run(run_dir)
    print_run(df, meta, console)
    console.print(f"plot: {overlap_plot(run_dir, loaded=(meta, df))}")
    show_unmeasured(run_dir, console)
    console.print(f"results: {run_dir}")


PROBE_TOKENS_HELP = ("Tokens per call (comma list); the buffers, and epbench-ll's auto options, are sized once for "
                     "the largest.")


@app.command()
def probe(tokens: Annotated[str, typer.Option("--tokens", help=PROBE_TOKENS_HELP)] = "1,32,128",
          sms: Annotated[str, typer.Option("--sms", help="Blocks per kernel (comma list).")] = "32,132",
          hidden: Annotated[int, typer.Option("--hidden", help="Hidden size.")] = 7168,
          topk: Annotated[int, typer.Option("--topk", help="Experts per token.")] = 8,
          experts_per_rank: Annotated[int, typer.Option("--experts-per-rank", help="Routed experts on each rank (64: the shape of `epbench sweep scenarios/dsv3x4-ll.yaml --nproc 1`).")] = 64,
          dtype: Annotated[str, typer.Option("--dtype", help="Dispatch dtype: fp8 | bf16.")] = "fp8",
          variants: Annotated[Optional[str], typer.Option("--variants", help="Kernel variants to time (comma list; default: epbench/llprobe.py's DEFAULT_VARIANTS; an unknown name lists every one).", show_default=False)] = None,
          warmup: Annotated[int, typer.Option("--warmup", help="Untimed graph replays per row.")] = 50,
          iters: Annotated[int, typer.Option("--iters", help="Timed graph replays per row.")] = 500,
          chain: Annotated[str, typer.Option("--chain", help="Calls per graph replay (comma list); call = replay / K.")] = "1",
          nproc: Annotated[int, typer.Option("--nproc", help="Ranks: sharing the first visible GPU, or one GPU each with --spread.")] = 1,
          spread: Annotated[bool, typer.Option("--spread", help="Each rank on a GPU of its own (the first --nproc visible): the calls cross the links; parts per rank on its own clock, the slowest rank's shown.")] = False,
          mps: Annotated[bool, typer.Option("--mps", help="Start a private MPS daemon for the ranks (as `epbench run --mps`).")] = False,
          csv: Annotated[Optional[Path], path_option("--csv", help="Also write the rows to this CSV file (the probe's column order).")] = None,
          results: ResultsOpt = Path("results"), run_dir: RunDirOpt = None) -> None:
    """Where the low-latency kernels' fixed cost goes: each part of a dispatch / combine call
    from per-block timer stamps, beside probe kernels, per SM count, tokens and variant (CUDA;
    notes/LATENCY.md). One results folder; the table is printed a row at a time.

    Example: epbench probe --tokens 1,32,128 --sms 32,132 --chain 1,8"""
    import dataclasses

    from epbench import llprobe
    from epbench.plan import Plan

    launch.apply_safe_env()
    o = llprobe.probe_options(tokens, sms, hidden, topk, experts_per_rank, dtype,
                              variants or llprobe.DEFAULT_VARIANTS, warmup, iters, chain, nproc, spread)
    if spread and mps:
        raise UserError("--mps is for ranks sharing one GPU; --spread gives each rank its own")
    s = llprobe.probe_scenario(o, nproc)
    p = Plan(verb="probe", scenario=s, options=o, device="cuda", argv=tuple(sys.argv[1:]),
             results=results, run_dir=run_dir, mps=mps, ranks_per_node=nproc)

    def show(folder: Path) -> None:
        if csv is not None:
            console.print(f"wrote {llprobe.write_csv(folder, csv)}", highlight=False)
        console.print(f"results: {folder}", highlight=False)

    if launch.under_torchrun():
        _start_one(p, show)
    import torch

    from epbench.results import check_new_run_dir, claim_run_dir, new_run_dir

    if not torch.cuda.is_available():
        raise UserError("probe: needs a CUDA GPU (the kernels are timed by CUDA-graph replays); none found")
    if spread and torch.cuda.device_count() < nproc:
        raise UserError(f"--spread: --nproc {nproc} needs {nproc} visible GPUs, {torch.cuda.device_count()} visible")
    check_new_run_dir(results, run_dir)
    p = dataclasses.replace(p, run_dir=claim_run_dir(run_dir) if run_dir else new_run_dir(results, s))
    if spread:  # rank i on visible GPU i
        _start_one(p, show)
    before = {"CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES")}
    os.environ["CUDA_VISIBLE_DEVICES"] = llprobe.one_gpu(before["CUDA_VISIBLE_DEVICES"])
    try:  # every rank on the first visible GPU
        _start_one(p, show)
    finally:
        launch.restore_env(before)


@app.command()
def validate(paths: Annotated[List[Path], path_argument(help="Scenario YAML files.")]) -> None:
    """Check scenario files; one line per file (every file is checked, bad ones on stderr).

    Example: epbench validate scenarios/*.yaml"""
    bad = 0
    for p in paths:
        try:
            s = scenario.load(p)
        except UserError as e:
            err.print(f"invalid {e}", markup=False, highlight=False, soft_wrap=True)
            bad += 1
            continue
        m = s.model
        console.print(f"[green]ok[/] {escape(str(s.source))}: {s.world} ranks ({s.topology.nodes}x{s.topology.gpus_per_node}"
                      f"{', virtual nodes' if s.topology.virtual_nodes else ''}), "
                      f"hidden {m.hidden}, {m.tokens_per_rank} tokens/rank, top-{m.topk}, "
                      f"{m.experts_per_rank} experts/rank, {m.dispatch_dtype}, {s.routing.kind} routing",
                      highlight=False)
    if bad:
        raise typer.Exit(2)


def _warn(text: str) -> None:
    err.print(f"epbench: warning: {text}", markup=False, highlight=False, soft_wrap=True)


ForceOpt = Annotated[bool, typer.Option("--force", help="Overwrite output files that exist.")]


def _said_after(failed: List[UserError], done: int, verb: str, tail: str = "") -> None:
    """The runs of a report or plot that could not be shown: each a warning where others were done,
    else the first as the error (the count of the others beside it)."""
    if failed and not done:
        more = f" ({len(failed) - 1} more run(s) could not be {verb} either)" if len(failed) > 1 else ""
        raise UserError(f"{failed[0]}{more}{tail}")
    for e in failed:
        _warn(str(e))


@app.command()
def report(run_dirs: Annotated[List[Path], path_argument(help="Results folders (or folders of them, searched recursively).")],
           per_rank: Annotated[bool, typer.Option("--per-rank", help="Also list every rank's time and bandwidths.")] = False,
           wide: WideOpt = False, columns: ColumnsOpt = None) -> None:
    """Print the table of one or more results folders.

    Example: epbench report results --wide"""
    from epbench.report import parse_columns, print_per_rank, print_run
    from epbench.results import load_runs

    chosen = parse_columns(columns, wide)
    failed: List[UserError] = []
    shown = 0
    for d, meta, df in load_runs(run_dirs, _warn):
        console.print(f"[bold]{escape(str(d))}[/]")
        try:
            print_run(df, meta, console, chosen, run_dir=d)
        except UserError as e:  # one run that lost its results.csv: said below, the others still shown
            failed.append(e)
            continue
        shown += 1
        if per_rank and meta.get("verb") in ("overlap", "probe"):  # their rows are not per (op, rank)
            console.print(f"per rank: none for an `epbench {meta['verb']}` run (its table above)", highlight=False)
        elif per_rank:
            print_per_rank(df, console, meta)
    _said_after(failed, shown, "shown")


@app.command()
def plot(paths: Annotated[List[Path], path_argument(help="Results folders (or folders of them, searched recursively).")],
         out: Annotated[Optional[Path], path_option("--out", help="Folder that receives one subfolder per run, <out>/<run folder name>/ (the runs' PNGs share file names; default: <run>/plots); with --together, the folder for its one PNG.")] = None,
         force: ForceOpt = False,
         together: Annotated[bool, typer.Option("--together", help="One bandwidth-vs-SMs figure of all the "
                                                "runs given (same scenario, ranks and transport; a line per "
                                                "backend and run, refused where no run set an SM count), e.g. "
                                                "one run per DeepEP flavor; into --out (default: the first "
                                                "run's plots folder).")] = False) -> None:
    """Draw bandwidth-vs-SMs (runs of two or more SM counts, with the link limit and ceiling),
    per-rank, latency-vs-tokens (any --tokens sweep) and expert-load (at the largest token count
    measured) PNGs from results folders, each naming its run and commit; a run that failed
    verification is said in one line and marked red in every figure.

    Example: epbench plot results/20261125T013216Z_dsv3x4_w1"""
    from epbench.plot import PlotsKept, plot_run, plot_together
    from epbench.results import check_writable, load_runs

    if out is not None:  # a folder that takes no file stops the command before anything is drawn
        check_writable(out)
    if together:
        runs = list(load_runs(paths, _warn))
        folder = out or (runs[0][0] / "plots" if runs else Path("."))
        png = plot_together(runs, folder / "bandwidth_vs_sms_together.png", force)
        console.print(f"wrote {escape(str(png))}", highlight=False)
        return
    failed: List[UserError] = []
    wrote = 0
    runs = load_runs(paths, _warn)
    if out is not None:  # <out>/<run folder name>/: two runs of one name would overwrite each other there
        runs = list(runs)
        seen: dict = {}
        for d, _, _ in runs:
            if d.name in seen:
                raise UserError(f"--out {out}: runs {seen[d.name]} and {d} share the folder name {d.name!r}, "
                                f"whose plots would land in one subfolder; plot them into separate --out folders")
            seen[d.name] = d
    for d, meta, df in runs:
        try:
            written = plot_run(d, (out / d.name) if out else None, force=force, loaded=(meta, df),
                               warn=_warn)
        except PlotsKept as e:  # kept as they are: news, not a failure
            _warn(str(e))
            continue
        except UserError as e:  # said below: a warning beside plots written, else the error
            failed.append(e)
            continue
        wrote += len(written)
        for png in written:
            console.print(f"wrote {escape(str(png))}", highlight=False)
    _said_after(failed, wrote, "plotted", "; nothing was written")


@app.command()
def ceiling(path: Annotated[Path, path_argument(help="Scenario YAML.")], nproc: NprocOpt = None,
            sms: SmsOpt = None, iters: ItersOpt = None, warmup: WarmupOpt = None, device: DeviceOpt = None,
            csv_out: Annotated[Optional[Path], path_option("--csv", help="Also write every measured figure into this CSV file, one per row, and what produced them (commit, versions, GPUs, the scenario) into the same name + .json (without GPUs: the nominal figures).")] = None) -> None:
    """Ceilings for the scenario's own bytes: copy-engine peer copies measured on the GPUs,
    nominal NVLink / NIC limits from the hardware. Measuring needs as many CUDA GPUs as the
    scenario has ranks per node (or --nproc N); on a host without GPUs, --device cpu prints
    only the byte counts and nominal limits (exit 0), for multi-node scenarios too (the NIC
    tier's bytes in one line per op).

    Example: epbench ceiling scenarios/smoke.yaml --device cpu  (or --sms 4,8 on GPUs)"""
    import dataclasses

    from epbench import ceiling as ce

    launch.apply_safe_env()
    s = scenario.load(path)
    if nproc is not None:
        s = s.with_world(nproc)
    if s.world == 1:  # a link ceiling of bytes that never leave the GPU would be a figure of nothing
        raise UserError(f"{s.source}: one rank: nothing crosses a link, so there is no ceiling to measure; "
                        f"use --nproc N with N >= 2")
    sms_list = scenario.maybe_int_list(sms, "--sms", scenario.MAX_SMS)
    if sms_list:  # the SM counts of the store, copy engine + store and local-sum ceilings
        s = dataclasses.replace(s, bench=dataclasses.replace(s.bench, sms=sms_list))
    for opt, v, low in (("--iters", iters, 1), ("--warmup", warmup, 0)):
        if v is not None and v < low:
            raise UserError(f"{opt}: must be at least {low}, got {v}")
    n_iters = s.bench.iters if iters is None else iters
    n_warmup = s.bench.warmup if warmup is None else warmup
    if csv_out is not None:  # before anything is measured: a folder that can take the file
        from epbench.results import check_writable

        if csv_out.is_dir():
            raise UserError(f"--csv: {csv_out} is a folder; give a file name")
        if not csv_out.parent.is_dir():
            raise UserError(f"--csv: {csv_out.parent} is not a folder")
        check_writable(csv_out.parent)
        csv_out = csv_out.resolve()
        ce.check_csv_path(csv_out)  # FILE and FILE.json are new files: refused before anything is measured
    from epbench.driver import RunOptions
    from epbench.plan import Plan

    p = Plan(verb="ceiling", scenario=s, options=RunOptions((), s.bench.sms, n_warmup, n_iters),
             device="cuda", argv=tuple(sys.argv[1:]), ranks_per_node=s.topology.gpus_per_node, csv=csv_out)
    if not launch.under_torchrun():
        if resolve_device(s, device, share=False) != "cuda":  # byte counts and nominal limits: any node count
            raise typer.Exit(ce.run_local(s, console, csv_out, sys.argv[1:]))
        if s.topology.nodes > 1:
            raise UserError(f"{s.source}: topology.nodes: ceilings are measured inside one node; "
                            f"use --nproc N to run the shape on N GPUs of this node")
    _start_one(p)


@app.command()
def compare(a: Annotated[Path, path_argument(help="Results folder A (the baseline).")],
            b: Annotated[Path, path_argument(help="Results folder B.")],
            plot_out: Annotated[Optional[str], typer.Option("--plot", help="Also draw both runs' bandwidth vs SMs into this PNG (a folder: a file named after both runs in it).")] = None,
            force: ForceOpt = False,
            wide: Annotated[bool, typer.Option("--wide", help="Adds the scenario column (shown anyway where the two runs' scenarios differ).")] = False) -> None:
    """Two results folders side by side: matching (scenario, backend, op, SMs) rows and ratios
    B/A (none where the runs measured different shapes or a point failed verification), and a
    warning for each shape, setting, hardware or software difference.

    Example: epbench compare results/RUN_A results/RUN_B"""
    from epbench.compare import print_compare

    png = None
    if plot_out == "":  # '' would be the current folder (as for a path option: _given_path)
        raise UserError("--plot: must name a file or folder, got an empty string")
    if plot_out is not None:  # a file that exists stops the command before anything is printed
        from epbench.plot import compare_output, compare_plot, output_path, why_no_compare_plot

        png = output_path(compare_output(plot_out, a, b), force)
    print_compare(a, b, console, wide)
    if png is not None:
        why = why_no_compare_plot(a, b)
        if why:
            _warn(f"--plot: nothing drawn: {why}")
        else:
            console.print(f"wrote {escape(str(compare_plot(a, b, png, force)))}", highlight=False)


@app.command()
def predict(path: Annotated[Path, path_argument(help="Scenario YAML (any topology; nothing runs).")],
            calibrate: Annotated[Optional[Path], path_option("--calibrate", help="Intranode results folder (or a folder of them) that sets the NVLink efficiency. Default: the best matching point in epbench/data/calibration.csv, else none.")] = None,
            backends: Annotated[Optional[str], typer.Option("--backends", help="Backend whose measured efficiency calibrates the model (one name; default epbench).")] = None,
            old_backend: Annotated[Optional[str], typer.Option("--backend", hidden=True)] = None,
            sms: Annotated[Optional[int], typer.Option("--sms", help="Calibrate from this SM count (default: the run's fastest).")] = None,
            nic_efficiency: Annotated[float, typer.Option("--nic-efficiency", help="Fraction of the nominal NIC rate reached (assumed; nothing here measures a NIC).")] = 1.0,
            overhead_us: Annotated[float, typer.Option("--overhead-us", help="Fixed per-call cost taken out of the calibration time and added to each prediction.")] = 0.0,
            json_out: Annotated[Optional[Path], path_option("--json", help="Also write the numbers to this new file (never overwritten).")] = None,
            method: Annotated[str, typer.Option("--method", help="Per-rank copies: exact (route every rank), sampled (from the routing distribution), auto (exact up to 64 ranks).")] = "auto") -> None:
    """PREDICTED dispatch/combine time and bandwidths for a topology from its routing bytes and
    link rates, calibrated by a measured intranode run (epbench/predict.py). CPU only.

    Example: epbench predict scenarios/h100x32.yaml"""
    from epbench import predict as model

    if old_backend is not None:
        _warn("predict: --backend is now --backends (the old spelling still works)")
    backend = _one_backend(backends if backends is not None else old_backend)
    s = scenario.load(path)
    model.check_scenario(s)  # one rank or CPU ranks: refused before any calibration is read
    if sms is not None and sms < 1:
        raise UserError(f"--sms: must be positive, got {sms}")
    if json_out is not None:
        model.check_json_path(json_out)  # a refused file costs no prediction
    if calibrate is not None:
        calib = model.calibrate([calibrate], s, backend, sms, overhead_us)
    else:
        calib = model.default_calibration(s, backend, sms, overhead_us)
    pred = model.predict(s, calib, nic_efficiency, method)
    model.print_prediction(pred, console)
    if json_out is not None:
        model.write_json(pred, json_out)
        console.print(f"wrote {json_out}")


def _fail(e: BaseException, code: int) -> None:
    """One line for an error (a traceback too with --debug); in a rank of torchrun started by
    hand it names the rank."""
    from epbench.errors import one_line

    if os.environ.get("EPBENCH_DEBUG"):
        traceback.print_exc()
    where = f"[rank {os.environ['RANK']}] " if launch.under_torchrun() else ""
    err.print(f"epbench: error: {where}{one_line(e)}", markup=False, highlight=False, soft_wrap=True)
    sys.exit(code)


def _one_backend(names: Optional[str]) -> str:
    """predict calibrates from one backend's measurement: --backends takes exactly one name."""
    if names is None:
        return "epbench"
    picked = [b.strip() for b in names.split(",") if b.strip()]
    if len(picked) != 1:
        raise UserError(f"--backends: predict calibrates from one backend, got {scenario.shown(names)}")
    scenario.check_backends(tuple(picked), "--backends")  # as run refuses it, before anything is read
    return picked[0]


def _flowed(doc: str) -> str:
    """A command's docstring as its help: each paragraph (blank-line separated) one line, which the
    terminal then wraps at its own width (Rich keeps a docstring's line breaks, which at 80 columns
    broke sentences in the middle)."""
    return "\n\n".join(" ".join(p.split()) for p in inspect.cleandoc(doc).split("\n\n"))


for _command in app.registered_commands:
    if _command.help is None and _command.callback is not None and _command.callback.__doc__:
        _command.help = _flowed(_command.callback.__doc__)


def main() -> None:
    try:
        _main()
    except SystemExit as e:
        if launch.under_torchrun() or launch.started_ranks():
            launch.leave(e.code)
        raise


class _Interrupted(BaseException):
    """Ctrl-C outside a run's launcher. Not a KeyboardInterrupt: typer >= 0.29 turns that into a
    silent exit 130 (older ones into Abort); a BaseException, so no ``except Exception`` eats it."""


def _on_sigint(_signum: int, _frame: object) -> None:
    raise _Interrupted()


def _main() -> None:
    import signal

    from epbench.errors import ControlTimeout, KernelTimeout

    launch.apply_safe_env()
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:  # not where SIGINT is ignored
        signal.signal(signal.SIGINT, _on_sigint)  # a run's launcher sets its own (raise_on_signals)
    try:
        sys.exit(app(standalone_mode=False))
    except _Interrupted:  # predict, plot, report, compare, ceiling on CPU: one line, as a run says it
        err.print("epbench: interrupted (SIGINT)", markup=False, highlight=False)
        sys.exit(launch.SIGNAL_EXIT["SIGINT"])
    except click_errors.UsageError as e:  # a mistyped option or value: one line, not click's framed box
        if isinstance(e, getattr(click_errors, "NoArgsIsHelpError", ())):
            console.print(e.ctx.get_help() if e.ctx else str(e))
            sys.exit(e.exit_code)
        cmd = f"{e.ctx.info_name}: " if e.ctx and e.ctx.parent else ""
        err.print(f"epbench: error: {cmd}{' '.join(e.format_message().split())}", markup=False,
                  highlight=False, soft_wrap=True)
        sys.exit(e.exit_code)
    except typer.Abort:  # Ctrl-C outside a run (click turns KeyboardInterrupt into Abort)
        err.print("epbench: interrupted", markup=False, highlight=False)
        sys.exit(130)
    except (UserError, VerificationFailed, StartupError) as e:
        _fail(e, e.exit_code)
    except (ControlTimeout, KernelTimeout) as e:
        _fail(e, 1)
    except Exception as e:
        sig = launch.signal_of(e)
        if sig is not None:  # Ctrl-C / SIGTERM while the launcher wrote the last status or table
            err.print(f"epbench: interrupted ({sig})", markup=False, highlight=False)
            sys.exit(launch.SIGNAL_EXIT[sig])
        if not launch.under_torchrun():
            raise  # the launcher's own bugs keep their traceback
        _fail(e, 1)
