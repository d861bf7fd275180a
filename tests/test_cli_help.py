"""Every verb's help: no type placeholder after a flag, one example; --version; predict's
--backends with the old --backend still accepted."""

import re

import pytest
from typer.testing import CliRunner

from epbench import cli

VERBS = sorted(c.name or c.callback.__name__ for c in cli.app.registered_commands)


def invoke(*args):
    return CliRunner().invoke(cli.app, list(args), env={"COLUMNS": "100"})


def test_every_verb_is_listed():
    assert {"run", "sweep", "overlap", "probe", "validate", "report", "plot", "ceiling", "compare",
            "predict"} <= set(VERBS)


@pytest.mark.parametrize("verb", [None] + VERBS)
def test_help_has_no_bool_placeholder_and_an_example(verb):
    r = invoke(*([verb] if verb else []), "--help")
    assert r.exit_code == 0, r.output
    assert "<bool>" not in r.output
    if verb:
        assert re.search(rf"Example: epbench {verb} \S", r.output), r.output
    else:
        assert "epbench run scenarios/smoke.yaml" in r.output


def test_help_says_when_to_run_and_when_to_sweep():
    text = " ".join(invoke("run", "--help").output.split())
    assert "run or sweep" in text and "sweep requires --sms and/or --tokens" in text


def test_version_names_commit_and_kernel_build():
    r = invoke("--version")
    assert r.exit_code == 0, r.output
    lines = r.output.splitlines()
    assert re.fullmatch(r"epbench \d+\.\d+\.\d+", lines[0])
    assert lines[1].startswith("commit: ")
    assert re.match(r"kernels: (built \(.*libepbench_ep\.so\)|not built)", lines[2])


def test_predict_takes_backends_and_the_old_spelling_with_a_note():
    new = invoke("predict", "scenarios/h100x32.yaml", "--backends", "epbench")
    assert new.exit_code == 0, new.output
    old = invoke("predict", "scenarios/h100x32.yaml", "--backend", "epbench")
    assert old.exit_code == 0, old.output
    assert "--backend is now --backends" in old.output
    assert old.output.split("--backends (the old spelling still works)")[-1].strip() == new.output.strip()


def test_predict_backends_takes_one_name():
    r = invoke("predict", "scenarios/h100x32.yaml", "--backends", "epbench,deepep")
    assert isinstance(r.exception, cli.UserError)  # main() turns it into one line, exit 2
    assert "predict calibrates from one backend" in str(r.exception)
