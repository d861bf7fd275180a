"""The ranks' entry point: epbench's launcher has torchrun start ``python -m epbench.rank PLAN JOB``
on every rank. It reads the plan the launcher wrote (plan.py) and runs job JOB of it through the
one engine (session.py), whatever its verb. No command line is parsed again.

A rank dies with its launcher (launch.guard_rank, before the heavy imports). Its error is one line:
left in the plan's folder for the launcher, which prints one line for the whole job, or printed
where no launcher waits; the exit code is the CLI's (2: a user's mistake, 1: anything else)."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path
from typing import Any, List, Optional

USAGE = "usage: python -m epbench.rank PLAN JOB (started by epbench's launcher under torchrun)"


def main(argv: Optional[List[str]] = None) -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)  # a SIGINT before guard_rank ends it quietly too
    from epbench import launch

    launch.guard_rank()  # before the heavy imports: a signal during them ends the rank quietly
    launch.apply_safe_env()
    launch.leave(run(sys.argv[1:] if argv is None else argv))


def run(args: List[str]) -> int:
    """Runs ``PLAN JOB``; returns the exit code (an error said in one line)."""
    from epbench import plan as plans
    from epbench.errors import (ControlTimeout, KernelTimeout, StartupError, UserError,
                                VerificationFailed)

    folder = Path(args[0]).parent if args else None
    try:
        if len(args) != 2 or not args[1].isdigit():
            raise UserError(USAGE)
        return run_plan(plans.read(Path(args[0])), int(args[1]), on_stall=lambda e: stalled(e, folder))
    except (UserError, VerificationFailed, StartupError) as e:
        return fail(e, "failed", e.exit_code, folder)
    except (ControlTimeout, KernelTimeout) as e:
        return fail(e, "timeout", 1, folder)
    except Exception as e:
        return fail(e, "failed", 1, folder)


def run_plan(p: Any, job: int = 0, launched: bool = True, show: Any = None,
             on_stall: Any = None) -> int:
    """Job ``job`` of plan ``p`` on this rank, through the one engine (session.run_worker);
    returns its exit code. ``launched``: epbench's launcher started this rank (else torchrun was
    started by hand, and rank 0 shows the finished folder with ``show``: see session.run_worker).
    ``on_stall``: what the rank's stall guard does with its timeout error (epbench/stall.py)."""
    from epbench.session import run_worker

    return run_worker(p, p.job_options(job), launched, show, on_stall)


def stalled(e: BaseException, folder: Optional[Path]) -> None:
    """The stall guard's end of a rank (called from its thread): the one line, as for any
    timeout, then the process ends at once (its main thread is stuck where no exception reaches)."""
    from epbench import stall

    try:
        fail(e, "timeout", 1, folder)
    finally:
        stall.exit_now()


def fail(e: BaseException, status: str, code: int, folder: Optional[Path]) -> int:
    """One line for ``e`` (a traceback too with --debug): into ``folder`` where a launcher waits
    for it, else on stderr. Returns ``code``."""
    import traceback

    from epbench import launch
    from epbench.errors import one_line

    if os.environ.get("EPBENCH_DEBUG"):
        traceback.print_exc()
    rank = os.environ.get("RANK", "?")
    line = f"[rank {rank}] {one_line(e)}"
    if folder is not None and rank.isdigit() and os.environ.get(launch.LAUNCHER_ENV):
        try:
            launch.write_rank_error(folder, int(rank), status, line)
            return code
        except OSError:  # the folder takes no more (a full disk): the line goes straight out
            pass
    print(f"epbench: error: {line}", file=sys.stderr, flush=True)
    return code


if __name__ == "__main__":
    main()
