"""plan.py: a launch written as plan.json reads back equal (scenario, options, paths, jobs), for
what the command line builds and for every verb's options; a file that is not a plan is one line."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from epbench import plan, scenario
from epbench.driver import RunOptions
from epbench.errors import UserError
from epbench.overlap import GemmSpec, OverlapOptions
from support import SCENARIOS

SMOKE = str(SCENARIOS / "smoke.yaml")


@pytest.mark.parametrize("path", sorted(SCENARIOS.glob("*.yaml")), ids=lambda p: p.stem)
def test_every_shipped_scenario_reads_back_from_its_dict(path):
    s = scenario.load(path)
    for shape in (s, s.with_world(max(1, -(-s.model.topk // s.model.experts_per_rank)))):
        data = json.loads(json.dumps(dataclasses.asdict(shape)))
        assert scenario.parse(data, data.pop("source")) == shape


def test_what_the_command_line_plans_reads_back_equal(tmp_path, monkeypatch):
    from epbench import cli

    monkeypatch.setattr(cli.sys, "argv", ["epbench", "sweep", SMOKE, "--option", "x=1"])
    p = cli._plan("sweep", Path(SMOKE), nproc=2, backends="reference,epbench", sms="4,8",
                  iters=3, warmup=0, device="cpu", results=tmp_path / "res", inject_fault="combine",
                  no_ceilings=True, tokens="1,16", option=["epbench.dispatch_impl=lean"],
                  control_timeout=12.5, graph_chain=0, input_sets="1,4", call_modes="call",
                  columns=("op", "time"))
    assert p.scenario.world == 2 and p.scenario.backend_options == {"epbench": {"dispatch_impl": "lean"}}
    assert p.jobs == (("reference",), ("epbench",)) and p.run_dir.parent == tmp_path / "res"
    assert p.argv == ("sweep", SMOKE, "--option", "x=1")
    back = plan.read(plan.write(p, p.run_dir))
    assert back == p
    assert back.job_options(1) == dataclasses.replace(p.options, backends=("epbench",))
    with pytest.raises(UserError, match="job 2: this plan has 2 job"):
        back.job_options(2)


def test_overlap_and_ceiling_plans_read_back_equal(tmp_path):
    s = scenario.load(SMOKE)
    for verb, opts in (("overlap", OverlapOptions(("reference",), (4, 8), 1, 2, GemmSpec("experts", intermediate=512))),
                       ("ceiling", RunOptions((), (4,), 1, 2))):
        p = plan.Plan(verb=verb, scenario=s, options=opts, device="cuda", argv=(verb, SMOKE),
                      results=tmp_path if verb == "overlap" else None, ranks_per_node=4,
                      csv=tmp_path / "c.csv" if verb == "ceiling" else None)
        assert plan.read(plan.write(p, tmp_path)) == p


def test_the_plan_holds_no_environment(tmp_path, monkeypatch):
    """A record of what ran, readable by anyone the run folder is shared with: the scenario,
    options, paths and the command line; no environment variable."""
    monkeypatch.setenv("EPBENCH_TEST_SECRET", "hunter2-do-not-record")
    p = plan.Plan(verb="run", scenario=scenario.load(SMOKE), options=RunOptions(("reference",), (4,), 1, 2),
                  device="cpu", argv=("run", SMOKE))
    text = plan.write(p, tmp_path).read_text()
    assert "hunter2" not in text
    assert set(json.loads(text)) == {f.name for f in dataclasses.fields(plan.Plan)} | {"format"}


def _good(tmp_path):
    p = plan.Plan(verb="run", scenario=scenario.load(SMOKE), options=RunOptions(("reference",), (4,), 1, 2),
                  device="cpu", argv=("run",), results=tmp_path, run_dir=tmp_path)
    return plan.to_dict(p)


@pytest.mark.parametrize("spoil, says", [
    (lambda d: "{", "not JSON"),
    (lambda d: [], "must be a mapping"),
    (lambda d: dict(d, format=99), "format 99"),
    (lambda d: dict(d, verb="dance"), "verb: must be one of"),
    (lambda d: dict(d, scenario=None), "scenario: missing"),
    (lambda d: dict(d, scenario=dict(d["scenario"], model={"hidden": 1})), "model.tokens_per_rank"),
    (lambda d: dict(d, options=dict(d["options"], sms="4")), "options.sms: must be a list"),
    (lambda d: dict(d, options=dict(d["options"], iters="2")), "options.iters: must be int"),
    (lambda d: dict(d, extra=1), "plan.extra: unknown key"),
    (lambda d: {k: v for k, v in d.items() if k != "device"}, "device"),
], ids=["not-json", "list", "format", "verb", "no-scenario", "bad-scenario", "sms-text", "iters-text",
        "unknown-key", "missing-key"])
def test_a_file_that_is_not_a_plan_is_one_line(tmp_path, spoil, says):
    data = spoil(_good(tmp_path))
    path = tmp_path / "plan.json"
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    with pytest.raises(UserError) as e:
        plan.read(path)
    assert str(path) in str(e.value) and says in str(e.value) and "\n" not in str(e.value)


def test_a_missing_plan_is_one_line(tmp_path):
    with pytest.raises(UserError, match="cannot read the plan"):
        plan.read(tmp_path / "nope" / "plan.json")
