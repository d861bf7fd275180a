"""launcher.py: the plan written where the ranks read it, the jobs that name it, what is left of a
folder no job wrote into; and what the overlap and ceiling commands plan (CUDA-only verbs, their
launch checked here with the jobs faked)."""

from __future__ import annotations

from pathlib import Path

import pytest

from epbench import launch, launcher, plan, scenario
from epbench.driver import RunOptions
from support import SCENARIOS

SMOKE = str(SCENARIOS / "smoke.yaml")


@pytest.fixture
def jobs(monkeypatch):
    """The torchrun jobs the launcher starts (faked: each ends as ``jobs.outcome``)."""
    class Jobs(list):
        outcome = launch.Outcome("complete")

    started = Jobs()

    def fake_job(torchrun, device, error_dir=None):
        started.append((torchrun, device, error_dir))
        return started.outcome

    monkeypatch.setattr(launch, "run_job", fake_job)
    return started


def test_the_launcher_starts_ranks_on_the_plan_in_the_run_folder(tmp_path, jobs):
    """One torchrun job per backend, each naming the run folder's plan.json and its job."""
    p = plan.Plan(verb="run", scenario=scenario.load(SMOKE), options=RunOptions(("reference", "epbench"), (4,), 1, 2),
                  device="cpu", argv=("run",), results=tmp_path, run_dir=tmp_path / "run",
                  jobs=(("reference",), ("epbench",)))
    (tmp_path / "run").mkdir()
    assert launcher.start(p) == 1  # no job wrote anything (the fake ones): no results
    path = str(tmp_path / "run" / plan.PLAN)
    assert [(t[-4:], d) for t, _, d in jobs] == [(["-m", "epbench.rank", path, str(j)], tmp_path / "run")
                                                 for j in (0, 1)]
    assert not (tmp_path / "run").exists()  # a folder holding only its plan is no run


def test_overlap_and_ceiling_start_their_jobs_on_their_plan(tmp_path, monkeypatch, jobs):
    import torch
    import typer

    from epbench import cli

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(cli, "resolve_device", lambda *args, **kwargs: "cuda")
    monkeypatch.setattr(cli.sys, "argv", ["epbench", "overlap", SMOKE])
    jobs.outcome = launch.Outcome("failed", 1, "rank 1 exited with code 3")
    with pytest.raises(typer.Exit) as e:
        cli.overlap(Path(SMOKE), nproc=2, sms="4,8", backends="reference", gemm="experts:64", iters=2,
                    warmup=1, results=tmp_path / "res", run_dir=None)
    assert e.value.exit_code == 1
    (torchrun, device, folder), = jobs
    assert device == "cuda" and "--nproc-per-node=2" in torchrun and torchrun[-2:] == [str(folder / plan.PLAN), "0"]
    assert folder.parent == tmp_path / "res" and not folder.exists()  # nothing but its plan: removed
    jobs.clear()
    with pytest.raises(typer.Exit):
        cli.ceiling(Path(SMOKE), nproc=2, iters=3, warmup=1, device="cuda")
    (torchrun, device, folder), = jobs
    assert "--nproc-per-node=2" in torchrun and not folder.exists()  # a temporary folder


def test_start_one_hands_the_ranks_their_plan(tmp_path, monkeypatch, capsys):
    """The plan the ranks read is the one the command made; a failure is the launcher's one line."""
    seen = {}

    def fake_job(torchrun, device, error_dir=None):
        seen["plan"] = plan.read(Path(torchrun[-2]))
        return launch.Outcome("failed", 1, "[rank 0] overlap: needs CUDA")

    monkeypatch.setattr(launch, "run_job", fake_job)
    p = plan.Plan(verb="ceiling", scenario=scenario.load(SMOKE), options=RunOptions((), (4,), 1, 2),
                  device="cuda", argv=("ceiling", SMOKE), ranks_per_node=4)
    assert launcher.start_one(p) == 1
    assert seen["plan"] == p
    assert capsys.readouterr().err == "epbench: error: [rank 0] overlap: needs CUDA\n"


def _overlap_plan(tmp_path):
    """An overlap plan of three jobs (reference; deepep; deepep-v2) into tmp_path/run."""
    from epbench.overlap import GemmSpec, OverlapOptions

    opts = OverlapOptions(("reference", "deepep", "deepep-v2"), (4,), 1, 2, GemmSpec("square", 8, 8, 8))
    (tmp_path / "run").mkdir()
    return plan.Plan(verb="overlap", scenario=scenario.load(SMOKE), options=opts, device="cpu",
                     argv=("overlap",), results=tmp_path, run_dir=tmp_path / "run",
                     jobs=launcher.jobs_by_flavor(opts.backends))


def _rank0_writes(run: Path, backend: str, wrong: int = 0) -> None:
    """What rank 0 of an overlap job leaves in the folder: meta.json, its backend's row, its wrong."""
    from epbench.results import RunWriter

    w = RunWriter(run, {"verb": "overlap", "scenario": {"name": "s"}, "world": 2,
                                  "overlap": {"gemm": "bf16 8x8x8"}}, append=True)
    w.add([{"backend": backend, "sms": 0, "rank": 0, "tokens_per_rank": 64, "wrong": wrong}], [])
    w.note([], wrong)


def test_an_interrupt_stops_the_overlap_jobs_left(tmp_path, monkeypatch, capsys):
    from epbench.results import load_run

    p, started = _overlap_plan(tmp_path), []

    def fake_job(torchrun, device, error_dir=None):
        started.append(int(torchrun[-1]))
        if started[-1] == 0:
            _rank0_writes(p.run_dir, "reference")
            return launch.Outcome("complete")
        return launch.Outcome("interrupted", 130, "interrupted (SIGINT)")

    monkeypatch.setattr(launch, "run_job", fake_job)
    shown = []
    assert launcher.start(p, shown.append) == 130
    assert started == [0, 1] and shown == []  # deepep-v2's job never started; no table
    meta, df = load_run(p.run_dir)
    assert meta["status"] == "interrupted" and list(df["backend"]) == ["reference"]
    assert capsys.readouterr().err == f"epbench: interrupted (SIGINT): 1 measured rows kept in {p.run_dir}\n"


def test_wrong_overlap_rows_fail_the_run_after_its_table(tmp_path, monkeypatch, capsys):
    """Every job ran, one counted wrong rows or GEMM elements: the table, then the line, status failed."""
    from epbench.results import load_run

    p = _overlap_plan(tmp_path)

    def fake_job(torchrun, device, error_dir=None):
        job = int(torchrun[-1])
        _rank0_writes(p.run_dir, p.jobs[job][0], wrong=3 if job == 1 else 0)
        return launch.Outcome("complete")

    monkeypatch.setattr(launch, "run_job", fake_job)
    shown = []
    assert launcher.start(p, shown.append) == 1
    line = f"verification failed: 3 wrong (see the table); results: {p.run_dir}"
    assert shown == [p.run_dir] and capsys.readouterr().err == f"epbench: error: {line}\n"
    meta, df = load_run(p.run_dir)
    assert meta["status"] == "failed" and meta["error"] == line and meta["wrong"] == 3
    assert list(df["backend"]) == ["reference", "deepep", "deepep-v2"]


def _run_plan(tmp_path, backends=("reference", "epbench")):
    opts = RunOptions(tuple(backends), (4,), 1, 2)
    (tmp_path / "run").mkdir()
    return plan.Plan(verb="run", scenario=scenario.load(SMOKE), options=opts, device="cpu", argv=("run", SMOKE),
                     results=tmp_path, run_dir=tmp_path / "run", jobs=launcher.jobs_of(opts.backends, 1))


def test_a_job_killed_before_rank_0_wrote_anything_still_leaves_a_record(tmp_path, monkeypatch, capsys):
    """A rank killed while the ranks start: the launcher writes meta.json itself, the job's every
    point gets a failed row naming the kill, the next job still runs, and the status is failed."""
    from epbench.results import load_run, load_unmeasured

    p, started = _run_plan(tmp_path), []

    def fake_job(torchrun, device, error_dir=None):
        started.append(int(torchrun[-1]))
        if started[-1] == 0:
            return launch.Outcome("failed", 1, "rank 1 was killed by SIGKILL")
        return launch.Outcome("complete")

    monkeypatch.setattr(launch, "run_job", fake_job)
    assert launcher.start(p, lambda d: None) == 1
    assert started == [0, 1]
    meta, df = load_run(p.run_dir)
    assert meta["status"] == "failed" and "killed by SIGKILL" in meta["error"] and df.empty
    assert meta["scenario"]["name"] == "smoke" and meta["argv"] == ["run", SMOKE] and "torch" in meta
    lost = load_unmeasured(p.run_dir)
    assert set(lost["backend"]) == {"reference"} and list(lost["op"]) == ["dispatch", "combine"]
    assert (lost["status"] == "failed: rank 1 was killed by SIGKILL").all() and (lost["rank"] == 1).all()
    assert "epbench: error: reference: rank 1 was killed by SIGKILL" in capsys.readouterr().err


def test_an_interrupt_records_the_points_it_lost(tmp_path, monkeypatch, capsys):
    """Ctrl-C in the second of three jobs: the first job's rows stay, the second's points and the
    third's (never started) are recorded as lost to the signal; 130, and the measured rows counted."""
    from epbench.results import RunWriter, load_run, load_unmeasured

    p, started = _run_plan(tmp_path, ("reference", "epbench", "symm-mem")), []

    def fake_job(torchrun, device, error_dir=None):
        started.append(int(torchrun[-1]))
        if started[-1] == 0:
            w = RunWriter(p.run_dir, {"scenario": {"name": "smoke"}}, append=True)
            w.add([{"scenario": "smoke", "backend": "reference", "op": op, "sms": 0, "rank": 0,
                    "tokens_per_rank": 64, "time_us": 5.0, "world": 4, "wrong": 0} for op in ("dispatch", "combine")], [])
            return launch.Outcome("complete")
        return launch.Outcome("interrupted", 130, "interrupted (SIGINT)")

    monkeypatch.setattr(launch, "run_job", fake_job)
    assert launcher.start(p, lambda d: None) == 130
    assert started == [0, 1]
    meta, df = load_run(p.run_dir)
    assert meta["status"] == "interrupted" and list(df["backend"]) == ["reference", "reference"]
    lost = load_unmeasured(p.run_dir)
    assert list(dict.fromkeys(lost["backend"])) == ["epbench", "symm-mem"]
    assert (lost["status"] == "interrupted: SIGINT before it was measured").all()
    assert capsys.readouterr().err == f"epbench: interrupted (SIGINT): 2 measured rows kept in {p.run_dir}\n"
