"""Faults end in one line and a truthful record: a rank that stops answering, Ctrl-C / SIGTERM to
the launcher (also while the ranks start), the launcher killed outright (its ranks die with it),
a rank killed outright, a backend that aborts its processes. Real 2-rank CPU runs
with backends that misbehave on purpose (tests/fault_backends.py, registered by
tests/fault_epbench.py); small control timeouts."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pandas as pd
import pytest

import fault_epbench
from epbench import launch
from support import REPO

CONTROL_TIMEOUT = 5


def start(tmp_path: Path, backends: str) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "EPBENCH_DEBUG")}
    env.update(fault_epbench.env(str(tmp_path / "mark")))
    return subprocess.Popen(
        fault_epbench.command() + ["run", "scenarios/smoke.yaml", "--nproc", "2",
         "--backends", backends, "--control-timeout", str(CONTROL_TIMEOUT),
         "--call-modes", "call",  # one point per backend: the faults are the point here
         "--results", str(tmp_path / "r")],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_for_mark(tmp_path: Path, p: subprocess.Popen) -> tuple:
    """(pid, time) of the rank that misbehaves, once it does."""
    mark = tmp_path / "mark"
    deadline = time.monotonic() + 120
    while not (mark.is_file() and mark.read_text().endswith("\n")):
        assert p.poll() is None and time.monotonic() < deadline, p.communicate()
        time.sleep(0.1)
    pid, at = mark.read_text().split()
    return int(pid), float(at)


def run_folder(tmp_path: Path) -> Path:
    (d,) = list((tmp_path / "r").iterdir())
    return d


def processes_of(folder: Path) -> list:
    """Processes whose command line names the run folder (the ranks get its plan.json)."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and str(folder) in (proc / "cmdline").read_bytes().decode(errors="replace"):
                found.append(int(proc.name))
        except OSError:
            pass
    return found


def ranks_of(tmp_path: Path, p: subprocess.Popen) -> list:
    """The run's processes other than the launcher ``p`` (their command lines name the results
    folder), zombies left out."""
    return [pid for pid in processes_of(tmp_path / "r") if pid != p.pid
            and launch.process_start(pid) is not None]


def wait_for_ranks(tmp_path: Path, p: subprocess.Popen) -> None:
    deadline = time.monotonic() + 60
    while not ranks_of(tmp_path, p):
        assert p.poll() is None and time.monotonic() < deadline, p.communicate()
        time.sleep(0.01)


def seconds_until_gone(tmp_path: Path, p: subprocess.Popen, limit: float = 10) -> float:
    start = time.monotonic()
    while ranks_of(tmp_path, p) and time.monotonic() - start < limit:
        time.sleep(0.05)
    return time.monotonic() - start


def one_error_line(err: str) -> str:
    assert "Traceback" not in err, err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1, err
    return lines[0]


def test_a_rank_that_stops_answering_ends_the_run_within_the_timeout(tmp_path):
    p = start(tmp_path, "test-hang")
    _, hung_at = wait_for_mark(tmp_path, p)
    out, err = p.communicate(timeout=CONTROL_TIMEOUT + 60)
    assert time.time() - hung_at < CONTROL_TIMEOUT + 10
    assert p.returncode == 1
    line = one_error_line(err)
    assert line.startswith("epbench: error: test-hang: ") and "rank 1 did not reach" in line
    assert f"within {CONTROL_TIMEOUT} s" in line and "timed calls" in line
    d = run_folder(tmp_path)
    meta = json.loads((d / "meta.json").read_text())
    assert meta["status"] == "timeout" and "rank 1 did not reach" in meta["error"]
    rows = pd.read_csv(d / "results.csv")
    assert set(rows["status"]) == {"timeout: " + line.split("test-hang: ", 1)[1]}
    assert set(rows["call_mode"]) == {"call"} and set(rows["rank"]) == {1}  # the point, and who failed
    assert not processes_of(d)


def test_ranks_stuck_where_no_collective_times_out_end_by_their_stall_guard(tmp_path):
    """A main thread blocked in a wait that no control-plane timeout covers (on GPUs: a CUDA wait on
    an NCCL collective of a stopped peer, which torch's watchdog would end with SIGABRT 7 s after
    its own timeout) is ended by the rank's stall guard: one line, status timeout."""
    from epbench import stall

    p = start(tmp_path, "test-stuck")
    _, stuck_at = wait_for_mark(tmp_path, p)
    limit = stall.limit_for(CONTROL_TIMEOUT, 10.0)  # smoke.yaml keeps bench.timeout_s at 10
    out, err = p.communicate(timeout=limit + 60)
    assert time.time() - stuck_at < limit + 10
    assert p.returncode == 1
    line = one_error_line(err)
    assert line.startswith("epbench: error: test-stuck: ") and "a timed call made no progress for" in line
    assert f"within {CONTROL_TIMEOUT} s" in line
    d = run_folder(tmp_path)
    meta = json.loads((d / "meta.json").read_text())
    assert meta["status"] == "timeout" and "made no progress" in meta["error"]
    assert not processes_of(d)


@pytest.mark.parametrize("sig,code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_interrupt_stops_every_rank_and_keeps_the_rows(tmp_path, sig, code):
    p = start(tmp_path, "reference,test-hang")
    wait_for_mark(tmp_path, p)  # the reference rows are written; the second job hangs
    d = run_folder(tmp_path)
    p.send_signal(sig)
    sent = time.monotonic()
    out, err = p.communicate(timeout=30)
    assert time.monotonic() - sent < 5  # torchrun alone gives its ranks 30 s
    assert p.returncode == code
    line = one_error_line(err)
    assert f"interrupted ({sig.name})" in line and "4 measured rows kept" in line
    meta = json.loads((d / "meta.json").read_text())
    assert meta["status"] == "interrupted"
    from epbench.results import load_run, load_unmeasured

    _, df = load_run(d)
    assert list(df["backend"].unique()) == ["reference"] and len(df) == 4 and df["time_us"].notna().all()
    lost = load_unmeasured(d)  # the hanging job's points, lost to the signal
    assert set(lost["backend"]) == {"test-hang"} and (lost["status"] == f"interrupted: {sig.name} before it was measured").all()
    assert not processes_of(d)


@pytest.mark.parametrize("delay", [0.1, 0.3])
def test_interrupt_while_the_ranks_start_is_one_line(tmp_path, delay):
    """Ctrl-C while the ranks import torch or meet: no KeyboardInterrupt tracebacks from them,
    no C++ abort on their way out."""
    p = start(tmp_path, "reference")
    wait_for_ranks(tmp_path, p)
    time.sleep(delay)
    p.send_signal(signal.SIGINT)
    sent = time.monotonic()
    out, err = p.communicate(timeout=30)
    assert time.monotonic() - sent < 5 and p.returncode == 130
    assert "interrupted (SIGINT)" in one_error_line(err)
    assert seconds_until_gone(tmp_path, p) < 1


def test_ranks_die_quietly_with_a_launcher_killed_in_their_start_up(tmp_path):
    p = start(tmp_path, "reference")
    wait_for_ranks(tmp_path, p)
    time.sleep(0.2)
    p.kill()
    assert seconds_until_gone(tmp_path, p) < 5
    out, err = p.communicate(timeout=30)  # the ranks shared these pipes: they closed with them
    assert not err.strip() and "Traceback" not in out


def test_ranks_die_quietly_with_a_launcher_killed_mid_run_which_reads_abandoned(tmp_path):
    from rich.console import Console

    from epbench.report import print_run
    from epbench.results import load_run

    p = start(tmp_path, "test-hang")
    wait_for_mark(tmp_path, p)
    d = run_folder(tmp_path)
    p.kill()
    assert seconds_until_gone(tmp_path, p) < 5
    out, err = p.communicate(timeout=30)
    assert not err.strip() and "Traceback" not in out
    meta, df = load_run(d)
    assert meta["status"] == "running" and meta["launcher"]["pid"] == p.pid
    console = Console(record=True, width=200)
    print_run(df, meta, console)
    assert "run status: abandoned" in console.export_text()


def test_a_rank_killed_outright_fails_its_backend_only(tmp_path):
    p = start(tmp_path, "test-hang,reference")
    pid, _ = wait_for_mark(tmp_path, p)
    os.kill(pid, signal.SIGKILL)
    out, err = p.communicate(timeout=120)
    assert p.returncode == 1
    line = one_error_line(err)
    assert line == "epbench: error: test-hang: rank 1 was killed by SIGKILL"
    d = run_folder(tmp_path)
    meta = json.loads((d / "meta.json").read_text())
    assert meta["status"] == "failed" and meta["error"] == "test-hang: rank 1 was killed by SIGKILL"
    rows = pd.read_csv(d / "results.csv")
    assert (rows[rows["backend"] == "reference"]["status"] == "ok").sum() == 4
    lost = rows[rows["backend"] == "test-hang"]
    assert set(lost["status"]) == {"failed: rank 1 was killed by SIGKILL"}
    assert list(lost["op"]) == ["dispatch", "combine"] and set(lost["call_mode"]) == {"call"}
    assert set(lost["rank"]) == {1}
    assert set(pd.read_csv(d / "results.csv", dtype=str)["world"].dropna()) == {"2"}  # not 2.0 beside the gaps
    assert "test-hang: failed: rank 1 was killed by SIGKILL" in out  # the table says it too
    assert not processes_of(d)


def test_a_backend_that_aborts_loses_only_its_own_points(tmp_path):
    p = start(tmp_path, "reference,test-abort")
    out, err = p.communicate(timeout=180)
    assert p.returncode == 1
    assert one_error_line(err) == "epbench: error: test-abort: rank 1 was killed by SIGABRT"
    d = run_folder(tmp_path)
    from epbench.results import load_run, load_unmeasured

    meta, df = load_run(d)
    assert meta["status"] == "failed" and meta["options"]["backends"] == ["reference", "test-abort"]
    assert list(df["backend"].unique()) == ["reference"] and len(df) == 4 and df["wrong"].sum() == 0
    left = load_unmeasured(d)
    assert list(left["op"]) == ["dispatch", "combine"]
    assert set(left["status"]) == {"failed: rank 1 was killed by SIGABRT"}
    assert not processes_of(d)


def test_deepep_v1_hidden_limits_are_checked_before_launch():
    """DeepEP V1's intranode dispatch asserts on the device for rows that do not fit its TMA
    staging (hidden 8192 bf16 killed a whole run on 2 x H200): the pre-check skips them."""
    from epbench.backends.deepep import hidden_reason

    for hidden, dtype in ((7168, "bf16"), (4096, "bf16"), (8176, "bf16"), (8192, "fp8"), (16352, "fp8")):
        assert hidden_reason(hidden, dtype) is None
    assert "above hidden 8176" in hidden_reason(8192, "bf16")
    assert "above hidden 16352" in hidden_reason(16384, "fp8")
    assert "16-byte units" in hidden_reason(8184, "bf16")


def test_kernel_timeout_must_be_finite_and_bounded_before_the_kernels():
    import torch

    from epbench.contract import RankSetup

    def setup(t):
        return RankSetup(rank=0, world=2, gpus_per_node=2, device=torch.device("cpu"), hidden=256,
                         max_tokens_per_rank=8, topk=2, experts_per_rank=2, dispatch_dtype="bf16",
                         timeout_s=t)

    assert setup(10.0).timeout_s == 10.0
    for bad in (float("inf"), float("nan"), 0.0, -1.0, 1e12):
        with pytest.raises(ValueError, match="timeout_s"):
            setup(bad)


def test_control_timeout_is_checked_like_any_option(tmp_path):
    from support import assert_one_line_error, epbench_here

    assert_one_line_error(epbench_here("run", "scenarios/smoke.yaml", "--control-timeout", "0",
                                       "--results", str(tmp_path)), "--control-timeout")


def test_a_stopped_rank_ends_the_run_within_the_timeout_and_is_not_blamed_as_killed(tmp_path):
    """SIGSTOP: the rank answers nothing, SIGTERM included, until torchrun's SIGKILL. The run ends
    within the control timeout and the launcher's shutdown grace (torch's agent alone waited a
    fixed 30 s: launch.stop_with_grace), and its line says what the others saw, not that torchrun
    killed the rank it had to stop."""
    p = start(tmp_path, "test-hang")
    pid, hung_at = wait_for_mark(tmp_path, p)
    os.kill(pid, signal.SIGSTOP)
    out, err = p.communicate(timeout=CONTROL_TIMEOUT + 60)
    assert time.time() - hung_at < CONTROL_TIMEOUT + 10
    assert p.returncode == 1
    line = one_error_line(err)
    assert "rank 1 did not reach" in line and "SIGKILL" not in line, line
    d = run_folder(tmp_path)
    meta = json.loads((d / "meta.json").read_text())
    assert meta["status"] == "timeout" and "rank 1 did not reach" in meta["error"]
    assert not processes_of(d)
