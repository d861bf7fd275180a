"""Every bad input ends in exit 2 and one line of at most 200 characters, with no traceback,
within 5 s and under 200 MB.

Scenario files are checked in one `epbench validate` process over all of them (each file's one
line is found by its name); a representative few, and every bad command-line value, go through
`epbench run` in a process of their own. CPU time and peak memory come from os.wait4 on the child
(CPU time rather than wall time: the limit must hold on a loaded CI machine too; a hang is caught by
a wall-clock limit of 30 s)."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Tuple

import pytest
import yaml

from support import REPO, scenario_dict

MAX_LINE = 240  # one terminal line, with the file path before it and every backend named in it
MAX_SECONDS = 5.0  # CPU seconds
MAX_WALL = 30.0
MAX_MB = 200


def _yaml(**sections) -> str:
    return yaml.safe_dump(scenario_dict(**sections), sort_keys=False)


def _base_with(extra: str) -> str:
    return _yaml() + extra


def _anchor_bomb() -> str:
    """The 'billion laughs': nine levels of nine aliases each, under a kilobyte."""
    lines = ['a0: &a0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    for i in range(1, 10):
        lines.append(f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 9) + "]")
    return "\n".join(lines) + "\nmodel: *a9\n"


# name: (file contents, str or bytes, or a callable writing the file; text the line must contain)
FILES: Dict[str, Tuple[object, str]] = {
    "latin1": (b"description: caf\xe9\n", "not UTF-8"),
    "utf16": ("model: {}\n".encode("utf-16"), "not UTF-8"),
    "deep-list": ("a: " + "[" * 10_000 + "]" * 10_000 + "\n", "nested more than"),
    "deep-map": ("a: " + "{a: " * 10_000 + "1" + "}" * 10_000 + "\n", "nested more than"),
    "deep-block": ("".join("  " * i + "a:\n" for i in range(500)), "nested more than"),
    "bomb": (_anchor_bomb(), "expands to more than"),
    "self-alias": ("a: &a [1, *a]\n", "refers to a node that contains it"),
    "long-line": (None, "larger than 1 MiB"),  # written by _write: 80 MB on one line
    "big-comments": (("#" * 100 + "\n") * 20_000 + _yaml(), "larger than 1 MiB"),
    "int-5000-digits": (_base_with("").replace("hidden: 256", "hidden: " + "9" * 5000),
                        "unreadable YAML value"),
    "mixed-keys-top": (_base_with("1: 2\n"), "keys must be names"),
    "mixed-keys-model": (_yaml().replace("  hidden: 256", "  hidden: 256\n  7: x"),
                         "model: keys must be names"),
    "null-key": (_base_with("~: 1\n"), "keys must be names"),
    "timeout-inf": (_yaml(bench={"timeout_s": float("inf")}), "bench.timeout_s: must be a finite"),
    "nvlink-inf": (_yaml(topology={"nvlink_gbps": float("inf")}), "topology.nvlink_gbps: must be a finite"),
    "hot-nan": (_yaml(routing={"kind": "hot", "hot_multiplier": float("nan")}), "must be a finite"),
    "timeout-huge": (_yaml(bench={"timeout_s": 1e9}), "bench.timeout_s: must be positive and at most"),
    "hidden-1e9": (_yaml(model={"hidden": 1_000_000_000}), "model.hidden: must be positive and at most"),
    "hidden-text-1e9": (_base_with("").replace("hidden: 256", "hidden: 1e9"), "model.hidden: must be an integer"),
    "iters-1e15": (_yaml(bench={"iters": 10**15}), "bench.iters: must be positive and at most"),
    "tokens-huge": (_yaml(model={"tokens_per_rank": 10**12}), "model.tokens_per_rank"),
    "experts-huge": (_yaml(model={"experts_per_rank": 10**9}), "model.experts_per_rank"),
    "memory-huge": (_yaml(model={"hidden": 131072, "tokens_per_rank": 1 << 20},
                          topology={"gpus_per_node": 64}), "no GPU or host has that"),
    "sms-huge": (_yaml(bench={"sms": [8, 10**9]}), "bench.sms"),
    "sms-too-many": (_yaml(bench={"sms": list(range(1, 101))}), "at most 64 values"),
    "name-slash": (_yaml(name="a/b"), "name: must be a file-name token"),
    "name-nul": (_yaml(name="a\0b"), "name: must be a file-name token"),
    "name-300": (_yaml(name="n" * 300), "name: must be a file-name token"),
    "name-dotdot": (_yaml(name=".."), "name: must be a file-name token"),
    "unknown-field": (_yaml(bench={"iterations": 5}), "bench.iterations: unknown key"),
    "unknown-long-key": (_yaml(model={"k" * 10_000: 1}), "unknown key"),
    "key-newline": (_yaml(model={"a\nb": 1}), "unknown key"),
    "wrong-type": (_yaml(model={"hidden": "large"}), "model.hidden: must be an integer"),
    "bool-as-int": (_yaml(model={"tokens_per_rank": True}), "must be an integer"),
    "sms-not-list": (_yaml(bench={"sms": 4}), "bench.sms: must be a non-empty list"),
    "negative-tokens": (_yaml(model={"tokens_per_rank": -4}), "must be positive"),
    "zero-iters": (_yaml(bench={"iters": 0}), "bench.iters: must be positive"),
    "empty-backends": (_yaml(bench={"backends": []}), "bench.backends: must be a non-empty list"),
    "unknown-backend": (_yaml(bench={"backends": ["reference", "nccl"]}), "unknown backend 'nccl'"),
    "backend-twice": (_yaml(bench={"backends": ["reference", "reference"]}), "listed twice"),
    "huge-string": (_yaml(model={"dispatch_dtype": "x" * 100_000}), "model.dispatch_dtype"),
    "model-is-list": (_yaml(model=list(range(1000))), "model: must be a mapping"),
    "a-list": ("- 1\n- 2\n", "must be a mapping"),
    "empty-file": ("", "must be a mapping"),
    "malformed": ("model:\n  hidden: [256,\n", "malformed YAML"),
    "tab-indent": ("model:\n\thidden: 256\n", "malformed YAML"),
    "key-twice": (_yaml().replace("  topk: 4\n", "  topk: 4\n  topk: 2\n"),
                  "key topk appears twice in one mapping (lines 5 and 6)"),
    "key-twice-flow": (_base_with("routing: {seed: 1, seed: 2}\n"), "key seed appears twice"),
    "sms-twice": (_yaml(bench={"sms": [8, 16, 8]}), "bench.sms: 8 is listed twice"),
    "timeout-1e308": (_yaml().replace("iters: 2", "iters: 2\n  timeout_s: 1.0e308"),
                      "bench.timeout_s: must be positive and at most 3600 seconds, got 1e+308"),
}


def _write(folder: Path, name: str, data: object) -> Path:
    p = folder / f"{name}.yaml"
    if name == "long-line":
        with open(p, "w") as f:
            f.write("description: ")
            chunk = "x" * (1 << 20)
            for _ in range(80):
                f.write(chunk)
            f.write("\n")
    elif isinstance(data, bytes):
        p.write_bytes(data)
    else:
        p.write_text(data)
    return p


@dataclass
class Child:
    code: int
    out: str
    err: str
    seconds: float
    peak_mb: float


# The child is started by a small Python process and measured there: a child forked straight from
# pytest (which may hold torch) would count the parent's pages in its peak resident memory.
MEASURE = """
import resource, subprocess, sys
try:
    code = subprocess.run([sys.executable, "-m", "epbench", *sys.argv[3:]], timeout=float(sys.argv[2])).returncode
except subprocess.TimeoutExpired:
    code = -9
u = resource.getrusage(resource.RUSAGE_CHILDREN)
with open(sys.argv[1], "w") as f:
    f.write(f"{u.ru_maxrss} {u.ru_utime + u.ru_stime}")
sys.exit(code if code >= 0 else 128 - code)
"""


def run_measured(*args: str, timeout: float = MAX_WALL) -> Child:
    """``python -m epbench ARGS`` with its exit code, output, CPU time and peak resident memory."""
    import tempfile

    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "EPBENCH_DEBUG")}
    with tempfile.NamedTemporaryFile("r") as usage:
        p = subprocess.run([sys.executable, "-c", MEASURE, usage.name, str(timeout), *map(str, args)],
                           cwd=REPO, env=env, capture_output=True, text=True, stdin=subprocess.DEVNULL,
                           timeout=timeout + 30)
        peak_kb, cpu_s = usage.read().split()
    return Child(p.returncode, p.stdout, p.stderr, float(cpu_s), int(peak_kb) / 1024)


def assert_cheap(c: Child) -> None:
    assert c.seconds < MAX_SECONDS, f"took {c.seconds:.1f} CPU s"
    assert c.peak_mb < MAX_MB, f"peak {c.peak_mb:.0f} MB"
    assert "Traceback" not in c.out + c.err, c.out + c.err


def assert_one_line(c: Child, *needles: str) -> str:
    assert c.code == 2, f"exit {c.code}\n{c.out}\n{c.err}"
    assert_cheap(c)
    lines = (c.out + c.err).strip().splitlines()
    assert len(lines) == 1, lines
    assert len(lines[0]) <= MAX_LINE, lines[0]
    for n in needles:
        assert n in lines[0], f"{n!r} not in {lines[0]!r}"
    return lines[0]


@pytest.fixture(scope="module")
def bad_files(tmp_path_factory) -> Dict[str, Path]:
    folder = tmp_path_factory.mktemp("bad")
    return {name: _write(folder, name, data) for name, (data, _) in FILES.items()}


def test_there_are_at_least_thirty_bad_inputs():
    assert len(FILES) + len(BAD_OPTIONS) >= 30


def test_validate_reports_every_bad_file_on_its_own_line(bad_files, tmp_path):
    """One process checks every file (and a missing file, a folder and a good file): exit 2, one
    line per bad file, in order, each naming its file and the rule."""
    missing, folder = tmp_path / "missing.yaml", tmp_path
    paths: List[Path] = list(bad_files.values()) + [missing, folder, REPO / "scenarios/smoke.yaml"]
    c = run_measured("validate", *paths)
    assert c.code == 2
    assert_cheap(c)
    assert c.out.startswith("ok ") and len(c.out.strip().splitlines()) == 1, c.out
    lines = c.err.strip().splitlines()
    assert len(lines) == len(paths) - 1, c.err
    needles = [needle for _, needle in FILES.values()] + ["no such scenario file", "is a folder"]
    for path, line, needle in zip(paths, lines, needles):
        assert line.startswith(f"invalid {path}: "), line
        assert needle in line, f"{needle!r} not in {line!r}"
        assert len(line) <= MAX_LINE, line


@pytest.mark.parametrize("name", ["latin1", "deep-map", "bomb", "long-line", "mixed-keys-model",
                                  "name-nul", "unknown-long-key"])
def test_run_stops_a_bad_file_with_one_line(bad_files, name, tmp_path):
    """The same files through `epbench run`: the one-line error path of the command itself."""
    c = run_measured("run", bad_files[name], "--results", tmp_path / "res")
    line = assert_one_line(c, str(bad_files[name]), FILES[name][1])
    assert line.startswith("epbench: error: ")
    assert not (tmp_path / "res").exists()


SMOKE = "scenarios/smoke.yaml"
BAD_OPTIONS = {
    "sms-zero": (("--sms", "0"), "--sms: must list positive"),
    "sms-huge": (("--sms", "8," + "9" * 30), "--sms: must be at most 1024"),
    "sms-5000-digits": (("--sms", "9" * 5000), "--sms: must be a comma-separated"),
    "tokens-text": (("--tokens", "1,x"), "--tokens: must be a comma-separated"),
    "tokens-huge": (("--tokens", "1," + "1" * 20), "--tokens: must be at most"),
    "iters-text": (("--iters", "abc"), "--iters"),
    "iters-huge": (("--iters", str(10**15)), "--iters: must be positive and at most"),
    "backends-empty": (("--backends", ","), "--backends: must name at least one"),
    "backends-unknown": (("--backends", "reference,nccl"), "unknown backend 'nccl'"),
    "nproc-huge": (("--nproc", "100000"), "--nproc: must be 1 to 64"),
    "sms-twice": (("--sms", "8,8"), "--sms: 8 is listed twice"),
    "no-such-option": (("--bogus",), "No such option: --bogus"),
}


@pytest.mark.parametrize("case", BAD_OPTIONS)
def test_bad_command_line_values(case, tmp_path):
    args, needle = BAD_OPTIONS[case]
    c = run_measured("run", SMOKE, *args, "--results", tmp_path / "res")
    assert_one_line(c, needle)
    assert not (tmp_path / "res").exists()


def test_a_run_folder_given_twice_is_refused(tmp_path):
    taken = tmp_path / "taken"
    taken.mkdir()
    assert_one_line(run_measured("run", SMOKE, "--run-dir", taken), str(taken), "exists already")
    assert list(taken.iterdir()) == []


def test_results_root_that_is_a_file(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    assert_one_line(run_measured("run", SMOKE, "--results", f), str(f), "not a folder")


def test_a_shape_larger_than_host_memory_stops_before_launch(write_scenario, tmp_path):
    """Within the static caps but beyond this host's memory: check_fits refuses it at launch."""
    path = write_scenario("big", scenario_dict(model={"hidden": 131072, "tokens_per_rank": 1 << 19},
                                               bench={"device": "cpu"}))
    c = run_measured("run", path, "--results", tmp_path / "res")
    assert c.code == 2 and "Traceback" not in c.err, c.err
    line = c.err.strip()
    assert "GiB per rank" in line and "this host's memory" in line and len(line.splitlines()) == 1
    assert not (tmp_path / "res").exists()


# -- results folders with bad content, write errors (issue 35): in-process, no subprocess --------

def _rows(scale=1.0):
    return [{"scenario": "s", "backend": "epbench", "op": op, "sms": sms, "rank": r, "world": 2,
             "time_us": 500.0 * scale + r, "algbw_gbps": 300.0, "busbw_nvlink_gbps": 250.0 / scale,
             "nvlink_bytes": 125_000_000, "wrong": 0, "problem": ""}
            for sms in (8, 16) for op in ("dispatch", "combine") for r in range(2)]  # two SM counts: a curve


@pytest.fixture
def mixed_root(tmp_path):
    """results/ with two good runs and three bad ones: two tables appended into one results.csv,
    a meta.json whose scenario is a number, and tables without a meta.json."""
    import json

    from epbench.results import RunWriter

    root = tmp_path / "results"
    made = {}
    for name in ("a_good", "b_appended", "c_scenario5", "d_nometa", "e_good"):
        w = RunWriter(root / name, {"device": "cuda", "world": 2, "scenario": dict(
            scenario_dict(topology={"gpus_per_node": 2}), name="s")})
        w.add(_rows(2.0 if name == "e_good" else 1.0), [])
        w.finish("complete")
        made[name] = root / name
    csv = made["b_appended"] / "results.csv"
    csv.write_text(csv.read_text() * 2)
    meta = json.loads((made["c_scenario5"] / "meta.json").read_text())
    (made["c_scenario5"] / "meta.json").write_text(json.dumps(dict(meta, scenario=5)))
    (made["d_nometa"] / "meta.json").unlink()
    return root, made


def _three_warnings(err, made):
    lines = err.strip().splitlines()
    assert len(lines) == 3 and all(ln.startswith("epbench: warning: skipped: ") for ln in lines), err
    for line, name, needle in zip(lines, ("b_appended", "c_scenario5", "d_nometa"),
                                  ("holds text where a number belongs", "scenario must be an object",
                                   "no meta.json")):
        assert str(made[name]) in line and needle in line, line


@pytest.mark.parametrize("command", ["report", "plot"])
def test_one_bad_run_never_hides_the_others(mixed_root, command, monkeypatch, capsys):
    from inproc import epbench_here

    root, made = mixed_root
    r = epbench_here(monkeypatch, capsys, command, root)
    assert r.code == 0 and "Traceback" not in r.both, r.both
    _three_warnings(r.err, made)
    if command == "report":
        assert [ln for ln in r.out.splitlines() if ln.startswith(str(root))] == [
            str(made["a_good"]), str(made["e_good"])]
    else:
        assert r.out.count("wrote ") == 6  # bandwidth_vs_sms, per_rank and expert_load of both good runs


def test_compare_names_the_bad_run_in_one_line(mixed_root, monkeypatch, capsys):
    from inproc import epbench_here

    _, made = mixed_root
    for bad, needle in (("b_appended", "column sms holds text"), ("c_scenario5", "scenario must be an object")):
        r = epbench_here(monkeypatch, capsys, "compare", made["a_good"], made[bad])
        assert r.code == 2 and len(r.err.strip().splitlines()) == 1, r.both
        assert str(made[bad]) in r.err and needle in r.err
    r = epbench_here(monkeypatch, capsys, "compare", made["a_good"], made["e_good"])
    assert r.code == 0 and "0.500" in r.out, r.both


def test_a_read_only_results_folder_stops_the_run_before_it_starts(tmp_path, monkeypatch, capsys):
    """What a read-only file system does to the write probe (chmod would stop no root in CI)."""
    import errno

    from epbench import results
    from inproc import epbench_here

    def read_only(*_args, **_kwargs):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS))

    monkeypatch.setattr(results.os, "open", read_only)
    r = epbench_here(monkeypatch, capsys, "run", SMOKE, "--device", "cpu", "--results", tmp_path / "ro")
    assert r.code == 2 and r.out == "", r.both
    assert r.err.strip() == f"epbench: error: {tmp_path / 'ro'}: cannot write there (Read-only file system)"


def test_a_rank_whose_error_file_cannot_be_written_says_its_line_itself(tmp_path, monkeypatch, capsys):
    """A full disk takes the rank's error file too: the line goes to stderr instead of a traceback."""
    import errno

    from epbench import launch, plan, rank
    from epbench.errors import UserError

    def full(*_args, **_kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def boom(*_args, **_kwargs):
        raise UserError("/r/samples.csv: cannot write (No space left on device)")

    monkeypatch.setattr(launch, "write_rank_error", full)
    monkeypatch.setattr(plan, "read", lambda path: None)
    monkeypatch.setattr(rank, "run_plan", boom)
    for k, v in (("RANK", "0"), ("WORLD_SIZE", "2"), ("LOCAL_RANK", "0"), (launch.LAUNCHER_ENV, "1:1")):
        monkeypatch.setenv(k, v)
    assert rank.run([str(tmp_path / "plan.json"), "0"]) == 2
    assert capsys.readouterr().err == ("epbench: error: [rank 0] /r/samples.csv: cannot write "
                                       "(No space left on device)\n")


@pytest.mark.parametrize("verb", ["run", "overlap"])
@pytest.mark.parametrize("where", [".", "sub", "sub/deeper"])
def test_results_inside_a_run_folder_is_refused(verb, where, tmp_path):
    """report and plot stop at a run folder: a run written inside one (at any depth) would never
    be found. One line, nothing written into the run."""
    from support import assert_one_line_error, epbench_here

    run = tmp_path / "20261128T000000Z_smoke_w2"
    run.mkdir()
    (run / "meta.json").write_text("{}")
    inside = (run / where) if where != "." else run
    r = epbench_here(verb, SMOKE, "--nproc", "2", "--backends", "reference", "--call-modes", "kernel",
                     "--results", inside)
    line = assert_one_line_error(r, str(inside), "a new run there would be hidden from report and plot")
    assert ("is a run folder (it holds meta.json)" if where == "." else f"is inside the run folder {run}") in line
    assert sorted(p.name for p in run.iterdir()) == ["meta.json"]


def test_a_run_dir_inside_a_run_folder_is_refused(tmp_path):
    from support import assert_one_line_error, epbench_here

    run = tmp_path / "run"
    run.mkdir()
    (run / "meta.json").write_text("{}")
    r = epbench_here("run", SMOKE, "--run-dir", run / "new")
    assert_one_line_error(r, f"{run}: is a run folder (it holds meta.json)")
    assert not (run / "new").exists()
