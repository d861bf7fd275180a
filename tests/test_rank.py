"""rank.py, the ranks' entry point: a plan it cannot read is one line and exit 2 (on stderr, or in
the plan's folder where a launcher waits for it); each verb reaches the one engine (session.py)
and its measurement there; and torchrun
started by hand still runs `epbench run` (each process then a rank that plans for itself)."""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import subprocess
import sys

import pytest

from epbench import launch, plan, rank, scenario
from epbench.driver import RunOptions
from support import REPO, SCENARIOS

SMOKE = str(SCENARIOS / "smoke.yaml")


def rank_process(*args: str, launcher: bool = False) -> subprocess.CompletedProcess:
    """``python -m epbench.rank ARGS`` as torchrun would start rank 0 of 1 (with a launcher
    waiting for its error file, or none)."""
    env = {k: v for k, v in os.environ.items() if k not in ("EPBENCH_DEBUG", launch.LAUNCHER_ENV)}
    env.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    if launcher:
        env[launch.LAUNCHER_ENV] = f"{os.getpid()}:{launch.process_start(os.getpid())}"
    return subprocess.run([sys.executable, "-m", "epbench.rank", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("content, says", [(None, "cannot read the plan"), ("{", "not JSON"),
                                           ('{"format": 1, "verb": "run"}', "scenario: missing")])
def test_a_plan_it_cannot_read_is_one_line_and_exit_2(tmp_path, content, says):
    path = tmp_path / "plan.json"
    if content is not None:
        path.write_text(content)
    r = rank_process(str(path), "0")
    assert r.returncode == 2 and r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"epbench: error: [rank 0] {path}: ") and says in lines[0]


def test_bad_arguments_are_the_usage_line():
    r = rank_process("plan.json")
    assert r.returncode == 2 and r.stderr.strip() == f"epbench: error: [rank 0] {rank.USAGE}"


def test_under_a_launcher_the_line_goes_to_the_plans_folder(tmp_path):
    path = tmp_path / "plan.json"
    path.write_text("[]")
    r = rank_process(str(path), "0", launcher=True)
    assert r.returncode == 2 and r.stderr == "" and r.stdout == ""
    said = launch.first_rank_error(tmp_path)
    assert said["status"] == "failed" and said["line"].startswith(f"[rank 0] {path}: not a plan")


def test_a_peers_closed_connection_is_not_said_before_the_cause(tmp_path):
    """A rank that timed out closes its sockets before writing its line: the peers' 'connection closed'
    lines can be earlier, yet the run names the stopped rank."""
    launch.write_rank_error(tmp_path, 0, "failed", "[rank 0] RuntimeError: [pair.cc:553] Connection closed by peer "
                            "[127.0.0.1]:21713. This is typically caused by a remote worker crashing.")
    launch.write_rank_error(tmp_path, 1, "timeout", "[rank 1] rank 3 did not reach the others in 'timed calls'")
    said = launch.first_rank_error(tmp_path)
    assert said["status"] == "timeout" and "rank 3 did not reach" in said["line"]
    assert not list(tmp_path.glob(".error-rank*"))
    launch.write_rank_error(tmp_path, 2, "failed", "[rank 2] RuntimeError: Connection reset by peer")
    assert "reset by peer" in launch.first_rank_error(tmp_path)["line"]  # nothing else was said


def test_each_verb_reaches_the_one_engine_and_its_measurement(monkeypatch, tmp_path):
    from epbench import ceiling, overlap, session

    seen = []
    monkeypatch.setattr(session, "run_worker",
                        lambda p, opts, launched, show, on_stall=None: seen.append((p.verb, opts, launched, show)) or 0)
    s = scenario.load(SMOKE)
    run_opts = RunOptions(("reference", "epbench"), (4,), 1, 2)
    base = plan.Plan(verb="run", scenario=s, options=run_opts, device="cpu", argv=("run",),
                     results=tmp_path, run_dir=tmp_path, jobs=(("reference",), ("epbench",)))
    assert rank.run_plan(base, 1) == 0
    assert seen.pop() == ("run", dataclasses.replace(run_opts, backends=("epbench",)), True, None)
    gemm = overlap.GemmSpec("square", 8, 8, 8)
    ov = dataclasses.replace(base, verb="overlap", options=overlap.OverlapOptions(("reference",), (4,), 1, 2, gemm),
                             jobs=(("reference",),))
    assert rank.run_plan(ov, 0, launched=False, show=print) == 0 and seen.pop() == ("overlap", ov.options, False, print)
    ce = dataclasses.replace(base, verb="ceiling", options=RunOptions((), (4,), 3, 5), jobs=((),))
    assert rank.run_plan(ce, 0) == 0 and seen.pop() == ("ceiling", ce.options, True, None)
    assert session.measurement("run") is session.measurement("sweep") is session.measure_points
    assert session.measurement("overlap") is overlap.measure
    assert session.measurement("ceiling") is ceiling.measure_job


@pytest.mark.slow
def test_torchrun_started_by_hand_runs_epbench_run(tmp_path):
    """Each process torchrun starts parses `epbench run` itself and is one rank; rank 0 writes
    the run folder (its meta.json complete) and prints the table with the chosen columns."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "EPBENCH_DEBUG")}
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                        "-m", "epbench", "run", "scenarios/smoke.yaml", "--device", "cpu", "--backends",
                        "reference", "--call-modes", "call", "--columns", "op,backend,time",
                        "--results", str(tmp_path / "r")],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, p.stdout + p.stderr
    (d,) = list((tmp_path / "r").iterdir())
    meta = json.loads((d / "meta.json").read_text())
    assert meta["status"] == "complete" and meta["world"] == 2 and meta["argv"][0] == "run"
    assert not (d / plan.PLAN).exists()  # no launcher: nothing was planned for other processes
    header = next(ln for ln in p.stdout.splitlines() if "op" in ln and "backend" in ln)
    assert "time us" in header and "algbw" not in header


TWO_NODES = """
model: {hidden: 256, tokens_per_rank: 16, topk: 4, experts_per_rank: 4}
topology: {nodes: 2, gpus_per_node: 2}
bench: {warmup: 1, iters: 2, backends: [reference], device: cpu, call_modes: [call]}
"""


@pytest.mark.slow
def test_two_nodes_on_one_host_each_read_their_own_plan(tmp_path, write_scenario):
    """Every node's launcher plans into its own results folder (not shared); its ranks read that
    plan. The node that holds rank 0 records the run; the other says so and exits 0 as well."""
    path = write_scenario("two-nodes", TWO_NODES)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "EPBENCH_DEBUG")}
    nodes = [subprocess.Popen([sys.executable, "-m", "epbench", "run", str(path), "--nnodes", "2",
                               "--node-rank", str(n), "--rdzv-endpoint", f"127.0.0.1:{port}",
                               "--rdzv-timeout", "60", "--results", str(tmp_path / f"node{n}")],
                              cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for n in (0, 1)]
    outs = [n.communicate(timeout=240) for n in nodes]
    assert [n.returncode for n in nodes] == [0, 0], outs
    runs = [d for n in (0, 1) for d in (tmp_path / f"node{n}").iterdir()]
    assert len(runs) == 1, runs  # one node recorded the run, the other left no folder behind
    meta = json.loads((runs[0] / "meta.json").read_text())
    assert meta["status"] == "complete" and meta["world"] == 4 and meta["options"]["backends"] == ["reference"]
    assert plan.read(runs[0] / plan.PLAN).nnodes == 2
