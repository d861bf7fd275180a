"""Every command README shows is checked: the CPU-safe ones run, the others parse (the verb
exists and takes every option shown), and make targets exist. README stays a front page."""

import re
import shlex

import pytest
from typer.testing import CliRunner

from epbench import cli
from support import REPO

README = (REPO / "README.md").read_text()
RUNS = {"validate", "predict", "--version", "--help"}  # CPU-safe and fast: run for real


def commands(prefix):
    blocks = re.findall(r"```\n(.*?)```", README, re.S)
    lines = [ln.split("#")[0].strip() for b in blocks for ln in b.splitlines()]
    return [shlex.split(ln)[1:] for ln in lines if ln.startswith(prefix + " ")]


def invoke(args):
    return CliRunner().invoke(cli.app, args, env={"COLUMNS": "100"})


def test_readme_is_a_front_page():
    assert len(README.splitlines()) < 250
    for text in [README] + [p.read_text() for p in (REPO / "docs").glob("*.md")]:
        assert not re.search(r"\bissues? \d|#\d\b|/work/|\.\./shared", text, re.I)
    for link in re.findall(r"\]\(([^)#]+)\)", README):
        assert (REPO / link).exists(), link


@pytest.mark.parametrize("args", commands("epbench"), ids=" ".join)
def test_epbench_command_in_readme(args):
    verb = args[0]
    if verb in RUNS:
        r = invoke(args)
        assert r.exit_code == 0, r.output
        return
    help_text = invoke([verb, "--help"]).output
    assert "Usage" in help_text, f"no verb {verb}"
    for opt in (a for a in args if a.startswith("--")):
        assert opt in help_text, f"{verb} takes no {opt}"
    for path in (a for a in args[1:] if a.startswith("scenarios/")):
        assert (REPO / path).is_file(), path


@pytest.mark.parametrize("args", commands("make"), ids=" ".join)
def test_make_target_in_readme(args):
    targets = re.findall(r"^([\w-]+):", (REPO / "Makefile").read_text(), re.M)
    assert args[0] in targets


def test_every_backend_option_is_in_the_backends_doc():
    from epbench import options

    doc = (REPO / "docs" / "backends.md").read_text()
    for backend, schema in options.SCHEMAS.items():
        for key, opt in schema.items():
            assert f"| {backend} | `{key}` ({opt.env})" in doc, (backend, key)
