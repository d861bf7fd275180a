"""epbench/flavors.py: each DeepEP flavor's backend runs from the venv `make baselines` recorded for
it, with this checkout's epbench, and the run records which python ran it."""

from __future__ import annotations

import dataclasses

import json
import os
import sys
from pathlib import Path

import pytest

from epbench import flavors, launch, provenance
from epbench.backends import deepep_v2_env
from support import fake_venv


def test_a_job_needs_the_one_flavor_of_its_backends():
    assert flavors.flavor_of(["deepep"]) == "v1"
    assert flavors.flavor_of(["deepep-v2"]) == "v2"
    assert flavors.flavor_of(["hybrid-ep"]) == "hybrid-ep"
    assert flavors.flavor_of(["epbench", "reference"]) is None
    assert flavors.flavor_of(["deepep", "deepep-v2"]) is None  # no venv holds two: runs here
    assert flavors.flavor_of(["deepep", "epbench"]) == "v1"


def test_record_keeps_every_flavor_and_survives_a_bad_file(tmp_path):
    reg = tmp_path / "venvs.json"
    assert flavors.recorded(reg) == {}
    flavors.record("v1", "/a/bin/python", reg)
    flavors.record("v2", "/b/bin/python", reg)
    flavors.record("v1", "/c/bin/python", reg)  # rebuilt elsewhere: the newest wins
    assert flavors.recorded(reg) == {"v1": "/c/bin/python", "v2": "/b/bin/python"}
    reg.write_text("{not json")
    assert flavors.recorded(reg) == {}


def test_the_registry_file_can_be_named_by_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv(flavors.REGISTRY_ENV, str(tmp_path / "r.json"))
    flavors.record("hybrid-ep", "/h/bin/python")
    assert json.loads((tmp_path / "r.json").read_text()) == {"hybrid-ep": "/h/bin/python"}


def test_a_job_runs_from_the_venv_that_holds_its_flavor(tmp_path, monkeypatch):
    reg = tmp_path / "venvs.json"
    v2 = fake_venv(tmp_path / "venv-v2", "v2")
    v1 = fake_venv(tmp_path / "venv-v1", "v1")
    flavors.record("v2", v2, reg)
    flavors.record("v1", v1, reg)
    monkeypatch.setattr(provenance, "baselines_build", lambda: {"flavor": "v1"})
    assert flavors.job_python(["deepep-v2"], reg) == v2
    assert flavors.job_python(["deepep"], reg) is None  # this environment holds v1
    assert flavors.job_python(["epbench"], reg) is None
    assert flavors.job_python(["hybrid-ep"], reg) is None  # none recorded: runs here, skips with its reason
    monkeypatch.setattr(provenance, "baselines_build", lambda: {})
    assert flavors.job_python(["deepep"], reg) == v1
    (tmp_path / "venv-v2" / provenance.BASELINES_STAMP).write_text(json.dumps({"flavor": "hybrid-ep"}))
    assert flavors.job_python(["deepep-v2"], reg) is None  # that venv was rebuilt with another flavor


def test_overlap_runs_each_flavors_backends_in_a_job_of_their_own():
    """overlap's jobs: the backends that need no DeepEP flavor share one, each flavor's go apart,
    in the order the backends first come."""
    from epbench.launcher import jobs_by_flavor

    assert jobs_by_flavor(("epbench", "deepep", "deepep-v2", "hybrid-ep")) == (
        ("epbench",), ("deepep",), ("deepep-v2",), ("hybrid-ep",))
    assert jobs_by_flavor(("deepep", "epbench", "hybrid-ep", "reference")) == (
        ("deepep",), ("epbench", "reference"), ("hybrid-ep",))
    assert jobs_by_flavor(("epbench", "reference", "symm-mem")) == (("epbench", "reference", "symm-mem"),)
    assert jobs_by_flavor(()) == ((),)


def test_overlap_starts_each_flavors_job_from_its_venv(tmp_path, monkeypatch):
    """`epbench overlap` with DeepEP flavors recorded: one torchrun job per python, each from its
    venv, every job on the one plan of the one run folder; the copy calibration in one job only,
    the first that needs no flavor. The jobs are faked (they write nothing: the folder, holding only its plan, goes)."""
    import torch
    import typer

    from epbench import cli, plan
    from support import SCENARIOS

    reg = tmp_path / "venvs.json"
    v1, v2 = fake_venv(tmp_path / "venv-v1", "v1"), fake_venv(tmp_path / "venv-v2", "v2")
    flavors.record("v1", v1, reg)
    flavors.record("v2", v2, reg)
    monkeypatch.setenv(flavors.REGISTRY_ENV, str(reg))
    monkeypatch.setattr(provenance, "baselines_build", lambda: {})  # this venv holds no flavor
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(cli, "resolve_device", lambda *args, **kwargs: "cuda")
    started = []

    def fake_job(torchrun, device, error_dir=None):
        python = torchrun[torchrun.index("--no-python") + 1] if "--no-python" in torchrun else None
        started.append((plan.read(Path(torchrun[-2])), int(torchrun[-1]), python, error_dir))
        return launch.Outcome("complete")

    monkeypatch.setattr(launch, "run_job", fake_job)
    smoke = SCENARIOS / "smoke.yaml"
    monkeypatch.setattr(cli.sys, "argv", ["epbench", "overlap", str(smoke)])
    with pytest.raises(typer.Exit):
        cli.overlap(smoke, nproc=2, sms="4,8", backends="deepep,epbench,deepep-v2,reference",
                    gemm="8,8,8", iters=2, warmup=1, results=tmp_path / "res", run_dir=None)
    assert [(job, python) for _, job, python, _ in started] == [(0, v1), (1, None), (2, v2)]
    p = started[0][0]
    assert p.jobs == (("deepep",), ("epbench", "reference"), ("deepep-v2",))
    assert len({folder for *_, folder in started}) == 1  # one run folder for every job
    assert [(p.job_options(j).backends, p.job_options(j).calibrate) for j in range(3)] == [
        (("deepep",), False), (("epbench", "reference"), True), (("deepep-v2",), False)]
    # the copy rows from this venv's job (its torch runs the GEMM beside them), the first job where all need a flavor
    assert dataclasses.replace(p, jobs=(("deepep",), ("deepep-v2",))).calibration_job() == 0


def test_torchrun_runs_the_ranks_with_the_jobs_python():
    args = launch.torchrun_args(["plan.json", "2"], 4, python="/v/bin/python")
    assert args[-6:] == ["--no-python", "/v/bin/python", "-m", "epbench.rank", "plan.json", "2"]
    assert launch.torchrun_args(["plan.json", "0"], 4)[-4:] == ["-m", "epbench.rank", "plan.json", "0"]


def test_a_job_from_another_venv_imports_this_checkouts_epbench(monkeypatch):
    monkeypatch.setenv("PYTHONPATH", "/elsewhere")
    with flavors.job_environment("/v/bin/python") as extra:
        assert os.environ["PYTHONPATH"] == os.pathsep.join([str(flavors.CHECKOUT), "/elsewhere"])
        assert extra == {"PYTHONPATH": os.environ["PYTHONPATH"]}
    assert os.environ["PYTHONPATH"] == "/elsewhere"
    with flavors.job_environment(None) as extra:
        assert extra == {} and os.environ["PYTHONPATH"] == "/elsewhere"


def test_v2s_private_nccl_comes_from_the_venv_that_runs_its_job(tmp_path, monkeypatch):
    lib = tmp_path / "venv-v2" / "epbench-nccl" / "lib" / "libnccl.so.2"
    lib.parent.mkdir(parents=True)
    lib.write_text("")
    v2 = fake_venv(tmp_path / "venv-v2", "v2", nccl={"preload": str(lib), "version": "2.30.4"})
    monkeypatch.setattr(provenance, "baselines_build", lambda: {})  # this venv: no V2
    assert deepep_v2_env.job_env(["deepep-v2"]) == {}
    assert deepep_v2_env.job_env(["deepep-v2"], v2)["LD_PRELOAD"].split()[0] == str(lib)
    assert deepep_v2_env.job_env(["reference"], v2) == {}


@pytest.mark.xdist_group("cpu-run")
def test_a_run_records_which_python_ran_each_backend(tmp_path):
    """End to end on CPU: deepep's job starts from the recorded "v1 venv" (a link to this
    python; deep_ep is not installed there either, so its points are skipped with the reason),
    the reference's from this one, and meta.json names both."""
    from support import epbench

    import subprocess

    root = tmp_path / "venv-v1"  # a real venv that sees this one's packages (torch, yaml) through a .pth
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True)
    v1 = str(root / "bin" / "python")
    site = subprocess.run([v1, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    Path(site, "this-venv.pth").write_text("".join(f"{p}\n" for p in sys.path if p and Path(p).is_dir()))
    (root / provenance.BASELINES_STAMP).write_text(json.dumps({"flavor": "v1", "commit": "c0ffee"}))
    reg = tmp_path / "venvs.json"
    flavors.record("v1", v1, reg)
    r = epbench("run", "scenarios/smoke.yaml", "--device", "cpu", "--backends", "reference,deepep", "--nproc", "2",
                "--iters", "2", "--results", str(tmp_path / "r"), env={flavors.REGISTRY_ENV: str(reg)})
    assert r.code == 0, r.both
    (run,) = list((tmp_path / "r").iterdir())
    runtime = json.loads((run / "meta.json").read_text())["backend_runtime"]
    assert runtime["deepep"]["python"] == v1
    assert runtime["reference"]["python"] != v1
    assert "deep_ep" in r.both  # the skip reason is still said
