"""One job inside torchrun: join the group, measure, and (rank 0) record and print."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Dict, List, Optional

import torch.distributed as dist
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from epbench import launch, provenance
from epbench.driver import RunOptions, measure
from epbench.console import wide_console
from epbench.report import print_run
from epbench.results import RunWriter, new_run_dir
from epbench.scenario import Scenario


def _points(opts: RunOptions) -> int:
    from epbench.backends import load_backend

    classes = [load_backend(b)[0] for b in opts.backends]
    return sum(len(opts.sms) if c is not None and c.uses_sms else 1 for c in classes)


def run_worker(s: Scenario, opts: RunOptions, device: str, run_dir: Optional[Path],
               results_root: Path, argv: List[str]) -> int:
    if device == "auto":
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    comm = launch.init_distributed(device)
    if comm.world != s.world:
        s = s.with_world(comm.world)  # started by hand under torchrun with another size
    console = wide_console()
    rank0 = comm.rank == 0
    writer: Optional[RunWriter] = None
    notes: List[str] = []
    if rank0:
        meta: Dict[str, Any] = provenance.collect(argv, device)
        meta.update(scenario=dataclasses.asdict(s), world=comm.world,
                    options=dataclasses.asdict(opts))
        writer = RunWriter(run_dir or new_run_dir(results_root, s.name), meta)
    progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                        TimeElapsedColumn(), console=console, transient=True,
                        disable=not (rank0 and opts.progress))
    task = progress.add_task(f"{s.name}: measuring", total=_points(opts))

    def on_point(rows, samples) -> None:
        writer.add(rows, samples)

    def on_note(note: str) -> None:
        if rank0 and note not in notes:
            notes.append(note)

    def advance(label: str) -> None:
        if rank0:
            progress.update(task, advance=1, description=f"{s.name}: {label}")

    try:
        with progress:
            wrong = measure(s, opts, comm, on_point, on_note, advance)
    except BaseException as e:
        if writer is not None:
            writer.finish(f"failed: {type(e).__name__}: {e}", notes=notes)
        raise
    if writer is not None:
        writer.finish("complete", notes=notes, wrong=wrong)
        import pandas as pd

        print_run(pd.DataFrame(writer.rows), writer.meta, console)
        console.print(f"results: {writer.dir}")
    dist.barrier()
    dist.destroy_process_group()
    return 1 if wrong else 0
