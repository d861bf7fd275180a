"""Ctrl-C / SIGTERM at random moments of a run, by hand (never in CI: it takes minutes).

Each try starts `python -m epbench run SCENARIO --device cpu --results DIR`, waits for the ranks
(children of the launcher), sleeps a random 0.05-1.5 s, sends SIGINT or SIGTERM to the launcher and
checks what a user sees: exactly one line on stderr, no traceback and no "terminate called", exit
130 / 143, the launcher gone within 5 s and no rank of the run alive 5 s later. Prints one line per
try and a summary; exits 1 when any try missed.

    python tools/interrupt_loop.py --tries 50
"""

from __future__ import annotations

import argparse
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
EXIT = {signal.SIGINT: 130, signal.SIGTERM: 143}


def alive(results: str) -> list:
    """pids of processes of this run (the launcher's command line names the results folder, the
    ranks' the plan.json inside it)."""
    out = subprocess.run(["pgrep", "-f", "--", results], capture_output=True, text=True)
    return out.stdout.split()


def one_try(scenario: str, results: str, rng: random.Random, max_delay: float) -> dict:
    p = subprocess.Popen([sys.executable, "-m", "epbench", "run", scenario, "--device", "cpu", "--results", results],
                         cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    deadline = time.time() + 60
    while time.time() < deadline and p.poll() is None:
        if subprocess.run(["pgrep", "-P", str(p.pid)], capture_output=True, text=True).stdout.split():
            break
        time.sleep(0.02)
    delay = rng.uniform(0.05, max_delay)
    time.sleep(delay)
    sig = rng.choice([signal.SIGINT, signal.SIGTERM])
    sent = time.time()
    p.send_signal(sig)
    _, err = p.communicate(timeout=60)
    gone = time.time() - sent
    left = alive(results)
    while left and time.time() - sent < 5:
        time.sleep(0.1)
        left = alive(results)
    lines = [ln for ln in err.splitlines() if ln.strip()]
    ok = (len(lines) == 1 and p.returncode == EXIT[sig] and gone < 5 and not left
          and "Traceback" not in err and "terminate called" not in err)
    return {"delay_s": round(delay, 2), "signal": sig.name, "code": p.returncode, "stderr_lines": len(lines),
            "exit_s": round(gone, 2), "ranks_left": len(left), "ok": ok, "first": lines[0] if lines else "",
            "stderr": err}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tries", type=int, default=50)
    ap.add_argument("--scenario", default="scenarios/smoke.yaml")
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--show", action="store_true", help="print the whole stderr of a try that missed")
    ap.add_argument("--max-delay", type=float, default=1.5, help="latest signal after the ranks appear, s")
    a = ap.parse_args()
    rng = random.Random(a.seed)
    results = tempfile.mkdtemp(prefix="epbench-interrupt-")
    tries = []
    for i in range(a.tries):
        t = one_try(a.scenario, results, rng, a.max_delay)
        tries.append(t)
        print(f"{i + 1:3d} {t['signal']:7s} after {t['delay_s']:.2f} s: exit {t['code']} in {t['exit_s']} s, "
              f"{t['stderr_lines']} stderr line(s), {t['ranks_left']} rank(s) left {'ok' if t['ok'] else 'MISS'}"
              f"  | {t['first']}", flush=True)
        if not t["ok"] and a.show:
            print(t["stderr"], flush=True)
    good = sum(t["ok"] for t in tries)
    print(f"{good}/{len(tries)} tries: one line, exit 130/143, launcher gone within 5 s, no rank left; "
          f"slowest exit {max(t['exit_s'] for t in tries)} s")
    return 0 if good == len(tries) else 1


if __name__ == "__main__":
    sys.exit(main())
