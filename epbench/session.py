"""The rank side of every verb, the one measurement engine: one job of a plan inside torchrun:
join the group, run what the verb's points measure (its hook: ``measurement``), and (rank 0)
record into the results folder; print too where no launcher waits (torchrun started by hand)."""

from __future__ import annotations

import dataclasses
import os
import sys
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch
import torch.distributed as dist
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from epbench import launch, metrics, provenance, stall
from epbench.driver import RunOptions, measure
from epbench.errors import first_line
from epbench.console import wide_console
from epbench.report import print_run
from epbench.results import RunWriter, new_run_dir
from epbench.plan import Plan
from epbench.scenario import Scenario


def _points(opts: RunOptions) -> int:
    from epbench.backends import load_backend

    classes = [load_backend(b)[0] for b in opts.backends]
    per_size = sum(len(opts.sms) if c is not None and c.uses_sms else 1 for c in classes)
    return per_size * len(opts.tokens or (0,))


def scenario_digest(s: Scenario, opts: RunOptions) -> str:
    """What every rank must agree on: the scenario's content (not its file name) and the options."""
    import hashlib
    import json

    data = dataclasses.asdict(s)
    data.pop("source", None)
    blob = json.dumps([data, dataclasses.asdict(opts)], sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def check_same_scenario(s: Scenario, opts: RunOptions) -> None:
    """Nodes started by hand each read their own scenario file: a difference stops the job with
    one line on every rank instead of a hang or a silently mixed measurement."""
    from epbench.errors import UserError

    mine = scenario_digest(s, opts)
    everyone: List[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    odd = [r for r, d in enumerate(everyone) if d != everyone[0]]
    if odd:
        raise UserError(f"{s.source}: the scenario or options differ across ranks (rank 0: "
                        f"{everyone[0]}, rank {odd[0]}: {everyone[odd[0]]}); start every node with "
                        f"the same file and options")


def measure_ceilings(s: Scenario, opts: RunOptions, comm: Any,
                     on_note: Any) -> Optional[Dict[str, Any]]:
    """Ceilings for this scenario's bytes, measured once per run before the backends (GPU only):
    copy engines, and plain SM stores at each swept SM count."""
    if comm.device.type != "cuda":
        on_note("ceilings: measured on CUDA GPUs only (the % of ceiling column stays empty)")
        return None
    if not opts.ceilings:
        on_note("ceilings: skipped (--no-ceilings)")
        return None
    functional = metrics.functional_reason(comm.world, comm.ranks_per_gpu)
    if functional is not None:
        on_note(f"ceilings: not measured ({functional})")
        return None
    if s.topology.nodes > 1 and not s.topology.virtual_nodes:
        # the ceiling kernels map every rank's buffer with CUDA IPC, which does not cross nodes
        on_note(f"ceilings: measured inside one node only (this run spans {s.topology.nodes} nodes; "
                f"`epbench ceiling` on one node measures that node's)")
        return None
    if opts.tokens and s.model.tokens_per_rank not in opts.tokens:
        on_note("ceilings: measured for the scenario's own tokens_per_rank, which --tokens leaves out")
        return None
    if s.mode == "low_latency":  # what the bound lines under the table compare against
        on_note(f"ceilings: for the {s.model.tokens_per_rank}-token batch, one row per token and rank (what "
                f"epbench-ll sends; a backend sending one per token and expert moves more)")
    from epbench import ceiling
    from epbench.routing import all_on_nvlink, route_all, traffic

    swept = dataclasses.replace(s, bench=dataclasses.replace(s.bench, sms=opts.sms))
    tr = traffic(route_all(s), s.model.experts_per_rank, s.topology.gpus_per_node, False)
    if s.topology.virtual_nodes:  # the inter-node copies cross NVLink too: the ceiling covers them
        tr = all_on_nvlink(tr)
    limits = ceiling.every_ranks_limits(comm)
    try:
        found = ceiling.measure_ceilings(swept, tr, comm, opts.warmup, opts.iters,
                                         ceiling.rates_of(limits))
    except Exception as e:
        raise RuntimeError(f"ceiling measurement failed ({e}); run again with --no-ceilings "
                           f"to skip it") from e
    if all(v is None for c in found for v in c.sm_store_us.values()):
        on_note(f"ceilings: {ceiling.sm_store_absent('cuda')}")
    return {c.op: c for c in found}


def sharing(comm: Any) -> Dict[str, Any]:
    """What meta.json records about how ranks sat on GPUs: the reason the run is functional
    (None: its traffic crossed links), ranks per GPU, and whether MPS served the ranks."""
    out: Dict[str, Any] = {"functional": metrics.functional_reason(comm.world, comm.ranks_per_gpu),
                           "ranks_per_gpu": comm.ranks_per_gpu}
    if comm.device.type == "cuda":
        out["mps"] = "on" if launch.mps_active() else "off"
    return out


def sharing_notes(comm: Any) -> List[str]:
    """One line on GPU sharing and MPS, one on what a functional run leaves out."""
    info = sharing(comm)
    notes = []
    if comm.shared:
        turns = ("" if info.get("mps") == "on" else
                 ": without it the ranks take turns on the GPU, and the times include the turns")
        notes.append(f"ranks share GPUs: {comm.ranks_per_gpu} per GPU (device = local rank modulo "
                     f"the GPU count, process group over gloo); MPS {info.get('mps')}{turns}")
    if info["functional"]:
        notes.append(f"functional run ({info['functional']}): the kernels are verified as on "
                     f"separate GPUs; bus bandwidth, link %, ceilings and % of ceiling are not given")
    return notes


CEILINGS_CACHE = ".ceilings.pkl"  # measured by the first job of a run, read by the others


def _ceilings(s: Scenario, opts: RunOptions, comm: Any, on_note: Any,
              run_dir: Optional[Path]) -> Optional[Dict[str, Any]]:
    """The run's ceilings: measured once per run folder. Later jobs of the same run (one per
    backend, on the same host) read what the first measured; only rank 0 uses them."""
    import pickle

    cache = run_dir / CEILINGS_CACHE if run_dir is not None else None
    if cache is not None and cache.is_file():
        return pickle.loads(cache.read_bytes()) if comm.rank == 0 else None
    found = measure_ceilings(s, opts, comm, on_note)
    if cache is not None and comm.rank == 0:
        cache.write_bytes(pickle.dumps(found))
    return found


class Job:
    """One job of a plan on this rank, as the measurement of its verb sees it: the scenario (at the
    world size torchrun gave), the job's options, the process group, and rank 0's results folder
    and notes. The engine (run_worker) makes it, hands it to the verb's measurement
    (``measurement``), and finishes it: the folder's status, the table where no launcher waits,
    the process group."""

    def __init__(self, p: Plan, opts: Any, comm: Any, device: str, launched: bool) -> None:
        self.plan, self.options, self.comm, self.device, self.launched = p, opts, comm, device, launched
        self.scenario = p.scenario if comm.world == p.scenario.world else p.scenario.with_world(comm.world)
        self.writer: Optional[RunWriter] = None
        self.notes: List[str] = []
        self.console = wide_console()

    @property
    def rank0(self) -> bool:
        return self.comm.rank == 0

    @property
    def launcher_finishes(self) -> bool:
        """The launcher writes the run's final status (run and sweep: one job per backend;
        overlap: one per python its backends need), each job continuing the folder."""
        return self.launched and self.plan.verb in ("run", "sweep", "overlap")

    def note(self, text: str) -> None:
        """A line for meta.json's notes (rank 0's; each once)."""
        if self.rank0 and text not in self.notes:
            self.notes.append(text)

    def meta(self, **extra: Any) -> Dict[str, Any]:
        """What meta.json records of this job: provenance, the scenario, world, options, ``extra``."""
        meta: Dict[str, Any] = provenance.collect(list(self.plan.argv), self.device)
        meta.update(scenario=dataclasses.asdict(self.scenario), world=self.comm.world,
                    options=dataclasses.asdict(self.options), **extra)
        return meta

    def backend_runtime(self, meta: Dict[str, Any]) -> Dict[str, Dict[str, Any]]:
        """What ran each backend of this job, for meta.json's ``backend_runtime`` (``meta``:
        Job.meta): its python (another venv's, where the job needs a DeepEP flavor:
        epbench/flavors.py), the NCCL and LD_PRELOAD it loaded (one job may preload another NCCL:
        backends/deepep_v2_env.py) and that python's baselines build."""
        return {b: {"python": sys.executable, "nccl": meta.get("nccl"),
                    "ld_preload": os.environ.get("LD_PRELOAD"), "baselines": meta.get("baselines")}
                for b in self.options.backends}

    def open(self, meta: Dict[str, Any]) -> Optional[RunWriter]:
        """Rank 0: the run folder (the plan's, or a new one) with ``meta`` (Job.meta) in
        meta.json. Other ranks: None."""
        if not self.rank0:
            return None
        tokens = getattr(self.options, "tokens", None) if self.plan.verb in ("run", "sweep") else None
        self.writer = RunWriter(self.plan.run_dir or new_run_dir(self.plan.results, self.scenario, tokens),
                                meta, append=self.launcher_finishes)
        return self.writer

    def gather(self, obj: Any) -> Optional[List[Any]]:
        """Every rank's ``obj`` on rank 0, in rank order (None on the other ranks)."""
        got: Optional[List[Any]] = [None] * self.comm.world if self.rank0 else None
        dist.gather_object(obj, got, dst=0)
        return got

    def rank0_count(self, n: int) -> int:
        """Rank 0's ``n`` (a count of wrong rows it summed from the gathers), on every rank."""
        flag = torch.tensor([n], dtype=torch.int64, device=self.comm.collective_device)
        dist.broadcast(flag, src=0)
        return int(flag.item())

    def record(self, rows: List[Dict[str, Any]], samples: List[Dict[str, Any]]) -> None:
        """Rank 0: rows and samples (gathered already) into the run folder."""
        if self.writer is not None:
            self.writer.add(rows, samples)

    def record_variants(self, backend: str, variants: List[Dict[str, Any]]) -> None:
        """Rank 0: how each point of ``backend`` is timed (driver.point_variants), into meta.json
        before its points are, so that the launcher can record every point a failed job lost."""
        if self.writer is not None:
            self.writer.variants(backend, variants)

    def fail(self, e: BaseException) -> None:
        """What the folder records of a measurement that raised ``e``."""
        if self.writer is None:
            return
        if self.launcher_finishes:
            self.writer.note(self.notes)
        else:
            self.writer.finish("timeout" if launch.is_timeout(e) else "failed", notes=self.notes,
                               error=first_line(e))

    def finish(self, wrong: int) -> None:
        """The folder's notes, wrong rows and (where no launcher does it) the status complete."""
        if self.writer is None:
            return
        if self.launcher_finishes:
            self.writer.note(self.notes, wrong)
        else:
            self.writer.finish("complete", notes=self.notes, wrong=wrong)


Show = Callable[[Path], None]  # prints a finished run folder (rank 0, where no launcher waits)


def measurement(verb: str) -> Callable[[Job], int]:
    """What a point of ``verb`` measures, as a function of a Job returning its wrong rows (summed
    over ranks, on every rank): plain / low-latency / chain points and ceilings (run, sweep),
    beside a GEMM (overlap), the low-latency kernels' parts (probe), ceilings alone (ceiling)."""
    if verb in ("run", "sweep"):
        return measure_points
    if verb == "overlap":
        from epbench import overlap

        return overlap.measure
    if verb == "probe":
        from epbench import llprobe

        return llprobe.measure
    from epbench import ceiling

    return ceiling.measure_job


def run_worker(p: Plan, opts: Any, launched: bool = True, show: Optional[Show] = None,
               on_stall: Optional[Callable[[BaseException], None]] = None) -> int:
    """The one engine: job ``opts`` of plan ``p`` on this rank (its backends: the job's). It
    joins the process group, runs the verb's measurement, records how it ended and leaves the
    group. ``launched``: started by epbench's launcher, which prints the table afterwards;
    otherwise (torchrun started by hand) rank 0 shows the finished folder with ``show`` (None:
    the run table). ``on_stall``: given, a guard thread hands it a timeout error when the rank
    sits in a wait on its peers past the ranks' timeouts (epbench/stall.py)."""
    device = p.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    comm = (launch.init_distributed(device, p.control_timeout_s) if p.control_timeout_s is not None
            else launch.init_distributed(device))
    job = Job(p, opts, comm, device, launched)
    if on_stall is not None:
        stall.start(stall.limit_for(comm.control_timeout_s, p.scenario.bench.timeout_s),
                    lambda line: on_stall(stall_error(comm, line)))
    try:
        wrong = _measure(job)
    except Exception as e:
        if launch.is_timeout(e):
            raise comm.timeout_error(e) from e
        raise
    finally:
        stall.stop()
    if job.writer is not None and not launched:
        (show or (lambda d: show_run(d, job.console, p.columns)))(job.writer.dir)
    comm.arrive("final barrier")
    dist.barrier()
    dist.destroy_process_group()
    return 1 if wrong and not launched else 0  # launched: the launcher says where


def stall_error(comm: launch.Comm, line: str) -> BaseException:
    """The stall guard's error: who did not reach the last wait (as any control timeout says), and
    where this rank sat."""
    from epbench.errors import ControlTimeout

    # a short look only: torch's NCCL watchdog may abort this rank a few seconds after its own timeout
    return ControlTimeout(f"{comm.timeout_error(RuntimeError(line), stall.NAMING_GRACE_S)}; {line}")


def _measure(job: Job) -> int:
    try:
        wrong = measurement(job.plan.verb)(job)
    except BaseException as e:
        job.fail(e)
        raise
    job.finish(wrong)
    return wrong


def measure_points(job: Job) -> int:
    """run and sweep: the scenario's ceilings, then every (backend, SM count, batch size) point
    through the driver, with a progress bar; rank 0 records each point as it is measured."""
    s, opts, comm, p = job.scenario, job.options, job.comm, job.plan
    comm.arrive("scenario check")
    check_same_scenario(s, opts)
    if job.rank0:
        meta = job.meta(control_timeout_s=comm.control_timeout_s, **sharing(comm))
        meta["backend_runtime"] = job.backend_runtime(meta)
        job.open(meta)
    # drawn only between points (auto_refresh off): rich's refresh thread would take rank 0's GIL
    # ten times a second, in the middle of timed calls, and make rank 0's host late for them
    progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                        TimeElapsedColumn(), console=job.console, transient=True, auto_refresh=False,
                        disable=not (job.rank0 and opts.progress))
    task = progress.add_task(f"{s.name}: measuring", total=_points(opts))

    def advance(label: str) -> None:
        if job.rank0:
            progress.update(task, advance=1, description=f"{s.name}: {label}", refresh=True)

    for note in sharing_notes(comm):
        job.note(note)
    comm.arrive("ceilings")
    ceilings = _ceilings(s, opts, comm, job.note, p.run_dir if job.launched else None)
    with progress:
        return measure(s, opts, comm, job.record, job.note, advance, ceilings, job.record_variants)


def show_run(run_dir: Path, console: Any, columns: Optional[Sequence[str]] = None) -> None:
    """The run's table (``columns``: its columns, None: the default ones), a line per backend
    whose points were not measured (print_run), and the folder, as it is (a '[' in the path
    the user chose is text, not rich markup: escaped)."""
    from rich.markup import escape

    from epbench.results import load_run

    meta, df = load_run(run_dir)
    print_run(df, meta, console, columns, run_dir=run_dir)
    console.print(f"results: {escape(str(run_dir))}", highlight=False)


def show_unmeasured(run_dir: Path, console: Any) -> None:
    """A line per backend and reason whose points were not measured (skipped, or lost with a job
    that failed)."""
    from epbench.report import unmeasured_lines

    for line in unmeasured_lines(run_dir):
        console.print(line, highlight=False)
