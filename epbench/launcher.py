"""The launcher side of a run: the plan written into the run folder, one torchrun job per entry of
``plan.jobs`` (each rank runs ``python -m epbench.rank PLAN JOB``), then the final status in
meta.json, one line for the first failure and the table. run and sweep start one job per backend,
overlap one per python its backends need (jobs_by_flavor); probe and ceiling their plan's one job
(start_one). The ranks' side: rank.py, session.py."""

from __future__ import annotations

import contextlib
import dataclasses
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from epbench import flavors, launch
from epbench import plan as plans
from epbench.backends import deepep_v2_env
from epbench.console import wide_console
from epbench.plan import Plan
from epbench.session import CEILINGS_CACHE, show_run


def jobs_of(backends: Tuple[str, ...], nnodes: int) -> Tuple[Tuple[str, ...], ...]:
    """One job per backend: a backend that kills its processes costs only its own points. Across
    nodes one job for all backends keeps the nodes in step (one rendezvous)."""
    return (tuple(backends),) if nnodes > 1 else tuple((b,) for b in backends)


def jobs_by_flavor(backends: Sequence[str]) -> Tuple[Tuple[str, ...], ...]:
    """overlap: one job per python its backends need (epbench/flavors.py): the backends that need
    no DeepEP flavor together, each flavor's apart, in the order the backends first come. Fewer
    jobs than run's one per backend: every overlap job times its GEMM alone and makes its green
    contexts before its first point."""
    groups: Dict[Optional[str], List[str]] = {}
    for b in backends:
        groups.setdefault(flavors.flavor_of((b,)), []).append(b)
    return tuple(tuple(g) for g in groups.values()) or ((),)


def job_command(p: Plan, plan_path: Path, job: int, python: Optional[str] = None) -> List[str]:
    """torchrun's arguments for job ``job`` of the plan in ``plan_path``, its ranks run by
    ``python`` where given (a flavor's venv: epbench/flavors.py)."""
    return launch.torchrun_args([str(plan_path), str(job)],
                                p.ranks_per_node or p.scenario.topology.ranks_per_host,
                                p.nnodes, p.node_rank, p.rdzv_endpoint, p.rdzv_timeout_s, python=python)


Show = Callable[[Path], Any]  # prints a finished run folder (the table, and what the verb adds)


def start(p: Plan, show: Optional[Show] = None) -> int:
    """run, sweep and overlap: the plan into its run folder, the jobs (beside a private MPS daemon
    where the plan asks for one); ``show``: how the finished folder is printed (None: the run
    table, session.show_run). Returns the exit code."""
    path = plans.write(p, p.run_dir)
    with launch.private_mps() if p.mps and p.device == "cuda" else contextlib.nullcontext():
        return launch_run(p, path, show)


def start_one(p: Plan) -> int:
    """probe and ceiling: the plan's one job (beside a private MPS daemon where the plan asks for
    one), one line for a failure; returns the exit code. The plan goes into the run folder
    (probe) or a temporary one (ceiling writes no results); a run folder that holds nothing else
    afterwards is removed."""
    folder = p.run_dir or Path(tempfile.mkdtemp(prefix=f"epbench-{p.verb}-"))
    job = p.jobs[0] if p.jobs else ()
    python = flavors.job_python(job)  # a DeepEP flavor's venv where the job needs one flavor
    try:
        with launch.private_mps() if p.mps and p.device == "cuda" else contextlib.nullcontext(), \
                flavors.job_environment(python), deepep_v2_env.job_environment(job, python):
            out = launch.run_job(job_command(p, plans.write(p, folder), 0, python), p.device, folder)
    finally:
        if p.run_dir is None:
            shutil.rmtree(folder, ignore_errors=True)
        else:
            _drop_if_empty(folder)
    if out.line:
        print(f"epbench: error: {out.line}", file=sys.stderr)
    return out.code


def _signal_of(line: Optional[str]) -> str:
    """SIGINT from launch.run_job's "interrupted (SIGINT)"."""
    text = line or ""
    return text[text.find("(") + 1:text.rfind(")")] if "(" in text else "a signal"


def _claim_for_lost_points(p: Plan) -> None:
    """meta.json for a run whose job ended before its rank 0 wrote one (a rank killed, or the run
    interrupted, while the ranks started): what the ranks would have recorded of its provenance,
    scenario and options, written by the launcher, so that the points the run lost are recorded
    (launch_run) and the folder is no longer removed as empty. Its status is set by finish_run. run
    and sweep on one node only: an overlap run's record names its GEMM, which its ranks work out, and
    nodes that never met at the rendezvous started no point."""
    from epbench import provenance
    from epbench.results import RunWriter

    meta = provenance.collect(list(p.argv), p.device)
    meta.update(scenario=dataclasses.asdict(p.scenario), world=p.scenario.world,
                options=dataclasses.asdict(p.options), recorded_by="launcher (no rank wrote meta.json)")
    RunWriter(p.run_dir, meta)


def _drop_if_empty(run_dir: Path) -> None:
    """Removes a run folder in which no job wrote anything: its plan alone records no run."""
    if run_dir.is_dir() and all(f.name == plans.PLAN for f in run_dir.iterdir()):
        (run_dir / plans.PLAN).unlink(missing_ok=True)
        run_dir.rmdir()


def job_points(opts: Any, backend: str, tokens_per_rank: int) -> List[tuple]:
    """(SM count, tokens per rank) of every point a job of ``backend`` would measure (``opts``:
    RunOptions, or OverlapOptions, which measure the scenario's own tokens per rank)."""
    from epbench.backends import load_backend

    cls = load_backend(backend)[0]
    sms = opts.sms if cls is not None and cls.uses_sms else (0,)
    return [(n, t) for t in (getattr(opts, "tokens", None) or (tokens_per_rank,)) for n in sms]


def verification_failure(run_dir: Path) -> Optional[launch.Outcome]:
    """The run's outcome where rows failed verification: which backend, op and SM count, how
    many rows (an overlap run: how many wrong, its table says where), and the folder (None:
    every row verified)."""
    from epbench.report import wrong_rows
    from epbench.results import load_run

    meta, df = load_run(run_dir)
    if meta.get("verb") == "overlap":  # its wrong counts communication rows and GEMM elements
        where = f"{meta['wrong']} wrong (see the table)" if meta.get("wrong") else None
    else:
        where = wrong_rows(df)
    return launch.Outcome("failed", 1, f"verification failed: {where}; results: {run_dir}") if where else None


def launch_run(p: Plan, plan_path: Path, show: Optional[Show] = None) -> int:
    """The plan's jobs into its run folder (a backend that aborts its processes loses only its
    own job's points, which get ``failed: <reason>`` rows), then the final status in meta.json,
    one line for the first failure and the table (``show``: see start). Returns the exit code:
    130 / 143 after SIGINT / SIGTERM (the rows measured so far are kept)."""
    from epbench import results

    s, opts, run_dir = p.scenario, p.options, p.run_dir
    first: Optional[launch.Outcome] = None
    for i, job in enumerate(p.jobs):
        python = flavors.job_python(job)  # the venv that holds the job's DeepEP flavor, if not this one
        # that checkout's epbench first; V2's own NCCL, for its job only
        with flavors.job_environment(python), deepep_v2_env.job_environment(job, python):
            out = launch.run_job(job_command(p, plan_path, i, python), p.device, run_dir)
        if out.status == "complete":
            continue
        interrupted = out.status == "interrupted"
        if interrupted:
            first = out
            reason = f"interrupted: {_signal_of(out.line)} before it was measured"
        else:
            first = first or launch.Outcome(out.status, out.code, f"{','.join(job)}: {out.line}")
            reason = f"{out.status}: {out.line}"
        if not (run_dir / results.META).is_file() and p.verb in ("run", "sweep") and p.nnodes == 1:
            _claim_for_lost_points(p)  # the job died before its rank 0 wrote anything
        if (run_dir / results.META).is_file():
            # the job's own points it left out; after an interrupt, also those of every job not started
            for backend in [b for later in p.jobs[i:] for b in later] if interrupted else job:
                done = results.measured_points(run_dir, backend)
                left = [pt for pt in job_points(opts, backend, s.model.tokens_per_rank) if pt not in done]
                results.add_rows(run_dir, results.unmeasured_rows(s.name, backend, left, reason))
        if interrupted:
            break
    (run_dir / CEILINGS_CACHE).unlink(missing_ok=True)
    if first is None and (run_dir / results.META).is_file():
        first = verification_failure(run_dir)
    if not (run_dir / results.META).is_file():  # no job got as far as writing anything
        _drop_if_empty(run_dir)
        if first is None and p.nnodes > 1:  # rank 0 is on another node: that node records the run
            print("this node's ranks finished; the node that holds rank 0 writes the results")
            return 0
        if first is not None:
            print(f"epbench: error: {first.line}", file=sys.stderr)
        return first.code if first is not None else 1
    options = dict(dataclasses.asdict(opts), backends=list(opts.backends))
    meta = results.finish_run(run_dir, first.status if first else "complete",
                              first.line if first else None, options=options)
    if first is not None and first.status == "interrupted":
        kept = len(results.load_run(run_dir)[1])  # measured rows only
        print(f"epbench: {first.line}: {kept} measured rows kept in {run_dir}", file=sys.stderr)
        return first.code
    if show is not None:
        show(run_dir)
    else:
        show_run(run_dir, wide_console(), p.columns)
    if first is not None:
        print(f"epbench: error: {first.line}", file=sys.stderr)
        return first.code or 1
    return 1 if meta.get("wrong") else 0
