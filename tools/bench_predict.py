"""Time and peak memory of `epbench predict` as the world grows (issue 35, item 7).

Each size is the h100x32 shape (hidden 8192, 4096 tokens per rank, top-8, 2 experts per rank,
uniform routing unless --routing) on N nodes x 64 GPUs, run as a user runs it
(`python -m epbench predict FILE`) in its own process; the peak resident memory is that process's
(os.wait4). Nothing is asserted: the numbers depend on the machine. Prints one row per size;
--json PATH also writes them (a new file).

    python tools/bench_predict.py                          # 256, 1024, 4096, 16384 ranks
    python tools/bench_predict.py --ranks 256 --method exact --timeout 600
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
GPUS_PER_NODE = 64


def scenario_file(folder: Path, ranks: int, routing: str) -> Path:
    base = yaml.safe_load((REPO / "scenarios" / "h100x32.yaml").read_text())
    base["topology"].update(nodes=ranks // GPUS_PER_NODE, gpus_per_node=GPUS_PER_NODE)
    base["model"]["hidden"] = 7168  # 8192 at 16384 ranks: more than a scenario may ask
    base["routing"]["kind"] = routing
    path = folder / f"bench{ranks}-{routing}.yaml"
    path.write_text(yaml.safe_dump(base))
    return path


def measure(path: Path, ranks: int, method: str, timeout_s: float) -> dict:
    """Wall seconds, peak RSS MiB and exit code of one `epbench predict`, killed at timeout_s."""
    cmd = [sys.executable, "-m", "epbench", "predict", str(path)]
    if method != "auto":  # the default; left out, the script also times epbench before --method
        cmd += ["--method", method]
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    timer = threading.Timer(timeout_s, proc.kill)
    timer.start()
    _, status, usage = os.wait4(proc.pid, 0)  # the child's own rusage: its peak memory
    wall = time.perf_counter() - start
    timed_out = not timer.is_alive()
    timer.cancel()
    proc.returncode = os.waitstatus_to_exitcode(status)
    return {"ranks": ranks, "method": method, "wall_s": wall,
            "peak_rss_mib": usage.ru_maxrss / 1024, "timed_out": timed_out,
            "exit_code": proc.returncode}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, nargs="+", default=[256, 1024, 4096, 16384])
    ap.add_argument("--method", default="auto", choices=("auto", "exact", "sampled"))
    ap.add_argument("--routing", default="uniform", choices=("uniform", "zipf", "hot"))
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per size")
    ap.add_argument("--json", type=Path, help="also write the rows to this new file")
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for ranks in args.ranks:
            if ranks % GPUS_PER_NODE:
                ap.error(f"--ranks: {ranks} is not a multiple of {GPUS_PER_NODE} GPUs per node")
            row = measure(scenario_file(Path(tmp), ranks, args.routing), ranks, args.method,
                          args.timeout)
            rows.append(row)
            state = "TIMED OUT" if row["timed_out"] else f"exit {row['exit_code']}"
            print(f"{ranks:6d} ranks  {args.routing:7s} {args.method:7s} {row['wall_s']:8.1f} s  "
                  f"{row['peak_rss_mib']:8.0f} MiB peak  {state}", flush=True)
    if args.json:
        with open(args.json, "x") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
