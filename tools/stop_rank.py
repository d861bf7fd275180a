"""A rank stopped (SIGSTOP) or killed (SIGKILL) in the middle of a run, by hand (never in CI: it waits for
the run's timeouts). Measures what a user sees: how long the other ranks take to end the run, the exit
code, the one line on stderr, the run's status in meta.json and the rows kept.

Starts `python -m epbench run SCENARIO --results DIR [ARGS...]`, waits until the first row is in the run
folder's results.csv (the run is measuring), sends the signal to the rank with the highest RANK (a
process `python -m epbench.rank <run>/plan.json <job>`, not torchrun's agent), then waits for the launcher
(--wait seconds at most). A stopped rank gets SIGCONT and SIGKILL afterwards, so nothing is left behind.

    python tools/stop_rank.py scenarios/dsv3x2.yaml --signal STOP -- --sms 8,16,24,32 --iters 20000 \\
        --control-timeout 10
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, Optional, Tuple

REPO = Path(__file__).resolve().parent.parent
SIGNALS = {"STOP": signal.SIGSTOP, "KILL": signal.SIGKILL}


def rank_processes(results: Path) -> Dict[int, int]:
    """RANK -> pid of every rank process of the run whose results go to ``results``."""
    out: Dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            args = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
            env = Path(f"/proc/{entry}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        text = [a.decode(errors="replace") for a in args]
        if "epbench.rank" not in text or not any(str(results) in a for a in text) or \
                any("torchrun" in a for a in text):
            continue
        for kv in env:
            if kv.startswith(b"RANK="):
                out[int(kv[5:])] = int(entry)
    return out


def first_row(results: Path) -> Optional[Path]:
    """The run folder once its results.csv holds a row, else None."""
    for csv in results.glob("*/results.csv"):
        if len(csv.read_text().splitlines()) > 1:
            return csv.parent
    return None


def alive(pid: int) -> bool:
    """Whether process ``pid`` still runs (a zombie, dead but not yet reaped by its parent, does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def measured_rows(path: Path) -> Tuple[int, int]:
    """(rows with a time, rows without one: points the run recorded as skipped or failed) of a results.csv."""
    import csv

    if not path.is_file():
        return 0, 0
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    timed = sum(1 for r in rows if (r.get("time_us") or "").strip())
    return timed, len(rows) - timed


def read(f) -> str:
    f.flush()
    f.seek(0)
    return f.read().strip()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog="after --: arguments of epbench run")
    ap.add_argument("scenario")
    ap.add_argument("--signal", choices=sorted(SIGNALS), default="STOP")
    ap.add_argument("--wait", type=float, default=120.0, help="seconds to wait for the run to end after the signal")
    ap.add_argument("--start-timeout", type=float, default=300.0, help="seconds to wait for the first row")
    argv = sys.argv[1:]
    cut = argv.index("--") if "--" in argv else len(argv)
    a = ap.parse_args(argv[:cut])
    extra = argv[cut + 1:]  # after --: more arguments of epbench run
    results = Path(tempfile.mkdtemp(prefix="epbench-stop-"))
    cmd = [sys.executable, "-m", "epbench", "run", a.scenario, "--results", str(results), *extra]
    # the run's output into files, never pipes: a talkative run (NCCL_DEBUG=INFO) would fill a pipe and block
    out_f, err_f = (open(results / name, "w+") for name in (".stdout", ".stderr"))
    p = subprocess.Popen(cmd, cwd=REPO, stdout=out_f, stderr=err_f, text=True, start_new_session=True)
    deadline = time.time() + a.start_timeout
    run_dir = None
    while time.time() < deadline and p.poll() is None and run_dir is None:
        run_dir = first_row(results)
        time.sleep(0.1)
    ranks = rank_processes(results)
    if run_dir is None or not ranks:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
        p.wait()
        print(f"no rank measuring within {a.start_timeout:.0f} s (exit {p.returncode}): {read(err_f)[-500:]}")
        return 1
    target = max(ranks)
    rows_before, _ = measured_rows(run_dir / "results.csv")
    peers = {pid for r, pid in ranks.items() if r != target}
    t0 = time.time()
    os.kill(ranks[target], SIGNALS[a.signal])
    # The signalled job ends when its other ranks are gone; the run may go on with its other backends'
    # jobs after that (each backend is a job of its own), so both times are said.
    took = job_took = None
    while time.time() - t0 < a.wait:
        if job_took is None and not any(alive(pid) for pid in peers):
            job_took = time.time() - t0
        if p.poll() is not None:
            took = time.time() - t0
            break
        time.sleep(0.05)
    if took is None:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()
    elif job_took is None:  # the run ended before a poll saw the job's ranks gone
        job_took = took
    err = read(err_f)
    for sig in (signal.SIGCONT, signal.SIGKILL):  # nothing of the run may stay behind
        for pid in rank_processes(results).values():
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
    meta = json.loads((run_dir / "meta.json").read_text()) if (run_dir / "meta.json").is_file() else {}
    rows_after, unmeasured = measured_rows(run_dir / "results.csv")
    lines = [ln for ln in err.splitlines() if ln.strip()]
    ended = f"ended {took:.1f} s after SIG{a.signal}" if took is not None else f"still running {a.wait:.0f} s after it"
    ended = (f"its job's other ranks gone {job_took:.1f} s after SIG{a.signal}" if job_took is not None else
             "its job's other ranks still there") + f"; the run {ended}"
    print(f"rank {target} (pid {ranks[target]}) got SIG{a.signal} with {rows_before} rows measured; {ended}; "
          f"exit {p.returncode}; status {meta.get('status')!r}; rows kept {rows_after} measured (+{unmeasured} "
          f"unmeasured); stderr lines {len(lines)}")
    for ln in lines[-3:]:
        print(f"  stderr: {ln[:300]}")
    print(f"  results: {run_dir}")
    return 0 if took is not None and len(lines) == 1 and rows_after >= rows_before else 1


if __name__ == "__main__":
    sys.exit(main())
