import datetime as real_datetime
import errno
import json
import os
import re

import pandas as pd
import pytest

from epbench import results
from epbench.errors import UserError

ROW = {"scenario": "s", "backend": "reference", "op": "dispatch", "sms": 0, "rank": 0, "world": 1,
       "time_us": 12.5, "wrong": 0}
SAMPLE = {"backend": "reference", "op": "dispatch", "sms": 0, "rank": 0, "iter": 0, "time_us": 12.5}


def test_atomic_write_leaves_no_temporary_file(tmp_path):
    p = tmp_path / "a.json"
    results._atomic_write(p, "one\n")
    results._atomic_write(p, "two\n")
    assert p.read_text() == "two\n"
    assert [f.name for f in tmp_path.iterdir()] == ["a.json"]


def _fail_with(code):
    def boom(*_args, **_kwargs):
        raise OSError(code, os.strerror(code))

    return boom


def test_atomic_write_that_fails_keeps_the_old_file_and_no_temporary(tmp_path, monkeypatch):
    p = tmp_path / "results.csv"
    results._atomic_write(p, "old\n")
    monkeypatch.setattr(results.os, "replace", _fail_with(errno.ENOSPC))
    with pytest.raises(UserError, match=r"results.csv: cannot write \(No space left on device\)"):
        results._atomic_write(p, "new, half written\n")
    assert p.read_text() == "old\n"
    assert [f.name for f in tmp_path.iterdir()] == ["results.csv"]


class _FrozenClock:
    """Stands in for the datetime module: every call to now() returns the same second."""

    timezone = real_datetime.timezone

    class datetime:
        @staticmethod
        def now(tz=None):
            return real_datetime.datetime(2030, 1, 2, 3, 4, 5, tzinfo=tz)


def test_new_run_dir_in_the_same_second_never_reuses_a_name(tmp_path, monkeypatch):
    monkeypatch.setattr(results, "datetime", _FrozenClock)
    dirs = [results.new_run_dir(tmp_path / "res", "smoke") for _ in range(3)]
    assert [d.name for d in dirs] == ["20300102T030405Z_smoke", "20300102T030405Z_smoke-1",
                                      "20300102T030405Z_smoke-2"]
    assert all(d.is_dir() for d in dirs)


def test_new_run_dir_skips_a_folder_that_exists(tmp_path, monkeypatch):
    monkeypatch.setattr(results, "datetime", _FrozenClock)
    taken = tmp_path / "20300102T030405Z_smoke"
    taken.mkdir()
    (taken / "mine").write_text("keep")
    d = results.new_run_dir(tmp_path, "smoke")
    assert d != taken and d.name == "20300102T030405Z_smoke-1"
    assert (taken / "mine").read_text() == "keep"


def test_new_run_dir_uses_utc_time_and_scenario(tmp_path):
    d = results.new_run_dir(tmp_path, "h200x4")
    stamp, name = d.name.split("_", 1)
    assert name == "h200x4"
    real_datetime.datetime.strptime(stamp, "%Y%m%dT%H%M%SZ")


def test_run_writer_writes_meta_then_tables_after_each_point(tmp_path):
    d = tmp_path / "run"
    w = results.RunWriter(d, {"argv": ["run", "x.yaml"], "scenario": {"name": "s"}})
    meta = json.loads((d / "meta.json").read_text())
    assert meta["status"] == "running" and meta["argv"] == ["run", "x.yaml"]
    assert not (d / "results.csv").exists()

    w.add([ROW], [SAMPLE])
    # a run that dies now keeps its first point
    m, df = results.load_run(d)
    assert m["status"] == "running"
    assert len(df) == 1 and df["time_us"].iloc[0] == 12.5
    w.add([dict(ROW, op="combine")], [dict(SAMPLE, op="combine"), dict(SAMPLE, iter=1)])
    assert len(pd.read_csv(d / "results.csv")) == 2
    assert len(results.load_samples(d)) == 3

    w.finish("complete", wrong=0)
    m, _ = results.load_run(d)
    assert m["status"] == "complete" and m["wrong"] == 0 and "finished_utc" in m
    assert sorted(f.name for f in d.iterdir()) == ["meta.json", "results.csv", "samples.csv"]


def test_run_writer_refuses_a_folder_with_results(tmp_path):
    d = tmp_path / "run"
    w = results.RunWriter(d, {})
    w.add([ROW], [SAMPLE])
    before = (d / "results.csv").read_text()
    with pytest.raises(UserError, match="already holds results"):
        results.RunWriter(d, {})
    assert (d / "results.csv").read_text() == before
    assert json.loads((d / "meta.json").read_text())["status"] == "running"


def test_load_run_on_a_folder_that_is_not_a_run(tmp_path):
    (tmp_path / "notes.txt").write_text("hi")
    with pytest.raises(UserError, match="not a results folder"):
        results.load_run(tmp_path)


def test_load_run_with_broken_meta(tmp_path):
    (tmp_path / "meta.json").write_text("{not json")
    with pytest.raises(UserError, match="meta.json: not valid JSON"):
        results.load_run(tmp_path)


def test_load_run_without_points_is_empty(tmp_path):
    results.RunWriter(tmp_path / "r", {"scenario": {"name": "s"}, "world": 1})
    meta, df = results.load_run(tmp_path / "r")
    assert df.empty and meta["scenario"]["name"] == "s"
    assert results.load_samples(tmp_path / "r").empty


def test_find_runs(tmp_path):
    a = results.new_run_dir(tmp_path, "a")
    results.RunWriter(a, {"scenario": {"name": "a"}, "world": 1})
    b = tmp_path / "b_run"
    results.RunWriter(b, {"scenario": {"name": "b"}, "world": 1})
    (tmp_path / "stray").mkdir()
    assert results.find_runs([tmp_path]) == sorted([a, b])
    assert results.find_runs([a]) == [a]
    with pytest.raises(UserError, match="no readable results folders"):
        results.find_runs([tmp_path / "stray"])
    with pytest.raises(UserError, match="no such file or folder"):
        results.find_runs([tmp_path / "missing"])


def test_run_dir_names_differ_without_a_frozen_clock(tmp_path):
    names = {results.new_run_dir(tmp_path, "s").name for _ in range(5)}
    assert len(names) == 5
    assert len(os.listdir(tmp_path)) == 5


# -- reading a results root that holds broken runs ----------------------------------------------

def _run(path, rows=(ROW,)):
    w = results.RunWriter(path, {"scenario": {"name": path.name}})
    w.add([dict(r) for r in rows], [SAMPLE])
    w.finish("complete")
    return path


def test_find_runs_searches_every_depth_and_not_inside_runs(tmp_path):
    top = _run(tmp_path / "top")
    deep = _run(tmp_path / "a" / "b" / "c" / "deep")
    _run(top / "plots" / "not-searched")  # a run's own sub-folders are not searched
    (tmp_path / "a" / "link").symlink_to(tmp_path, target_is_directory=True)  # no loop
    assert results.find_runs([tmp_path]) == [deep, top]


@pytest.mark.parametrize("damage, needle", [
    (lambda d: (d / "meta.json").write_text('{"scenario": {"na'), "meta.json: not valid JSON"),
    (lambda d: (d / "meta.json").write_text("[1, 2]"), "not a JSON object"),
    (lambda d: (d / "meta.json").write_bytes(b"\xff\xfe{}"), "not UTF-8"),
    (lambda d: (d / "meta.json").write_text("[" * 100_000 + "]" * 100_000), "meta.json: unreadable"),
    (lambda d: (d / "results.csv").write_text((d / "results.csv").read_text()[:-9]), "truncated"),
    (lambda d: (d / "results.csv").write_text("backend,op\nreference\n"), "line 2 has 1 fields"),
    (lambda d: (d / "results.csv").write_text("backend,op\nreference,dispatch\n"), "lacks the column sms"),
    (lambda d: (d / "results.csv").write_text("scenario,backend,op,sms,rank,time_us,wrong\ns,ref,dispatch,0,0,1.5,0\n"),
     "a measured row lacks its world"),
    (lambda d: (d / "results.csv").write_text('a,b\n"x,1\n'), "truncated or corrupt"),
    (lambda d: (d / "results.csv").mkdir() if (d / "results.csv").unlink() is None else None,
     "results.csv"),
], ids=["meta-cut", "meta-list", "meta-binary", "meta-deep", "csv-cut", "csv-short-row",
        "csv-no-column", "csv-no-world", "csv-open-quote", "csv-a-folder"])
def test_a_broken_run_is_one_user_error_and_skipped_in_a_walk(tmp_path, damage, needle):
    good = _run(tmp_path / "root" / "good")
    bad = _run(tmp_path / "root" / "nested" / "bad")
    damage(bad)
    with pytest.raises(UserError, match=needle.replace("(", r"\(")) as e:
        results.load_run(bad)
    assert str(bad) in str(e.value) and "\n" not in str(e.value)
    warnings = []
    found = results.load_runs([tmp_path / "root"], warnings.append)
    assert [d for d, _, _ in found] == [good]
    assert len(warnings) == 1 and str(bad) in warnings[0] and needle.split(" (")[0] in warnings[0]
    with pytest.raises(UserError):  # named directly, it is an error, not a warning
        results.load_runs([bad], warnings.append)


def test_load_runs_bad_paths(tmp_path):
    f = tmp_path / "file.txt"
    f.write_text("x")
    with pytest.raises(UserError, match="a file, not a folder"):
        results.load_runs([f])
    with pytest.raises(UserError, match="no such file or folder"):
        results.load_runs([tmp_path / "missing"])


def test_a_run_folder_is_claimed_once(tmp_path):
    d = results.claim_run_dir(tmp_path / "deep" / "run")
    assert d.is_dir() and not any(d.iterdir())
    with pytest.raises(UserError, match="exists already"):
        results.claim_run_dir(d)
    with pytest.raises(UserError, match="exists already"):
        results.check_new_run_dir(tmp_path, d)
    results.RunWriter(d, {})  # the claimed, empty folder is the run's
    with pytest.raises(UserError, match="already holds results"):  # a second writer is refused
        results.RunWriter(d, {})
    (tmp_path / "f").write_text("x")
    with pytest.raises(UserError, match="not a folder"):
        results.check_new_run_dir(tmp_path / "f", None)
    with pytest.raises(UserError, match="not a folder"):
        results.new_run_dir(tmp_path / "f", "s")


def test_run_folder_names_world_and_what_changes_the_measurement(tmp_path):
    import dataclasses
    from pathlib import Path

    from epbench import scenario

    s = scenario.load(Path("scenarios/dsv3x4.yaml"))
    assert results.run_name(s) == "dsv3x4_w4"
    fp8 = dataclasses.replace(s, model=dataclasses.replace(s.model, dispatch_dtype="fp8"))
    assert results.run_name(fp8, (128,)) == "dsv3x4_w4_fp8_t128"
    assert results.run_name(s.with_world(2), (1, 8, 256)) == "dsv3x4_w2_t1-256"
    assert results.run_name(scenario.load(Path("scenarios/dsv3x4-fp8.yaml"))) == "dsv3x4-fp8_w4"
    assert results.run_name("a b/c") == "a-b-c"  # only file-system-safe characters
    d = results.new_run_dir(tmp_path, fp8, (128,))
    assert d.is_dir() and d.name.endswith("Z_dsv3x4_w4_fp8_t128")


def test_a_running_run_whose_launcher_is_gone_reads_abandoned():
    from epbench.launch import launcher_record
    from epbench.results import run_status

    me = launcher_record()
    assert run_status({"status": "running", "launcher": me}) == "running"
    assert run_status({"status": "running", "launcher": dict(me, start="1")}) == "abandoned"
    assert run_status({"status": "running", "launcher": dict(me, host="elsewhere")}) == "running"
    assert run_status({"status": "running"}) == "running"  # written before launchers were recorded
    assert run_status({"status": "failed", "launcher": dict(me, start="1")}) == "failed"


# -- write errors: a read-only folder, a disk that fills up mid-run (issue 35, item 2) -----------

def test_a_results_folder_that_cannot_be_written_is_refused_before_the_run(tmp_path, monkeypatch):
    """The probe file is what fails on a read-only file system (chmod stops no root)."""
    results.check_new_run_dir(tmp_path / "new" / "deeper", None)  # the nearest parent is probed
    assert list(tmp_path.iterdir()) == []
    monkeypatch.setattr(results.os, "open", _fail_with(errno.EROFS))
    with pytest.raises(UserError, match=r"ro: cannot write there \(Read-only file system\)"):
        results.check_new_run_dir(tmp_path / "ro", None)
    with pytest.raises(UserError, match=rf"{tmp_path}: cannot write there"):  # --run-dir's parent
        results.check_new_run_dir(tmp_path / "elsewhere", tmp_path / "run")


def test_creating_a_run_folder_on_a_read_only_file_system_is_one_user_error(tmp_path, monkeypatch):
    monkeypatch.setattr(results.os, "mkdir", _fail_with(errno.EROFS))
    with pytest.raises(UserError, match=r"cannot create \(Read-only file system\)"):
        results.new_run_dir(tmp_path, "s")
    with pytest.raises(UserError, match=r"cannot (create|hold results)"):
        results.RunWriter(tmp_path / "r", {})


def test_a_disk_that_fills_up_mid_run_ends_in_one_error_and_a_failed_record(tmp_path, monkeypatch):
    d = tmp_path / "run"
    w = results.RunWriter(d, {"scenario": {"name": "s"}}, append=False)
    w.add([ROW], [SAMPLE])
    real_replace = os.replace
    monkeypatch.setattr(results.os, "replace", lambda a, b: (_fail_with(errno.ENOSPC)() if
                                                             "samples" in str(b) else real_replace(a, b)))
    with pytest.raises(UserError, match=r"samples.csv: cannot write \(No space left on device\)") as first:
        w.add([dict(ROW, op="combine")], [dict(SAMPLE, op="combine")])
    assert w.failed is first.value
    monkeypatch.setattr(results.os, "replace", _fail_with(errno.ENOSPC))
    w.note(["on the way out"])  # the notes written while the error goes up do not replace it
    assert sorted(f.name for f in d.iterdir()) == ["meta.json", "results.csv", "samples.csv"]
    # the launcher's rows for the points left out cannot be written either: meta.json records the
    # failure where it can, and the line says so where it cannot
    monkeypatch.setattr(results.os, "replace", lambda a, b: (_fail_with(errno.ENOSPC)() if
                                                             "results" in str(b) else real_replace(a, b)))
    with pytest.raises(UserError, match="results.csv: cannot write"):
        results.add_rows(d, results.unmeasured_rows("s", "epbench", [(8, 16)], "failed: x"))
    meta = json.loads((d / "meta.json").read_text())
    assert meta["status"] == "failed" and "results.csv: cannot write" in meta["error"]
    monkeypatch.setattr(results.os, "replace", _fail_with(errno.ENOSPC))
    with pytest.raises(UserError) as e:
        results.finish_run(d, "failed", "reference: [rank 0] samples.csv: cannot write (No space left on device)")
    assert str(e.value).startswith("reference: [rank 0] samples.csv: cannot write")
    assert "meta.json: cannot write (No space left on device): its status was not recorded" in str(e.value)
    assert not [f for f in d.iterdir() if ".tmp" in f.name]


# -- readers: one bad run never hides the others (issue 35, item 1) ------------------------------

def _append_table(d):
    text = (d / "results.csv").read_text()
    (d / "results.csv").write_text(text + text)  # two tables appended: a header among the rows


@pytest.mark.parametrize("damage, needle", [
    (_append_table, "column sms holds text where a number belongs ('sms' in data row 2"),
    (lambda d: _edit_meta(d, scenario=5), "scenario must be an object, got 5"),
    (lambda d: _edit_meta(d, scenario={"name": ["x"]}), "scenario.name must be text"),
    (lambda d: _edit_meta(d, notes=[1]), "notes must be a list of text"),
    (lambda d: _edit_meta(d, world="4"), "world must be a whole number, got '4'"),
    (lambda d: _edit_meta(d, world=True), "world must be a whole number, got True"),
    (lambda d: (d / "results.csv").write_text((d / "results.csv").read_text().replace(",12.5,", ",fast,")),
     "column time_us holds text"),
    (lambda d: _edit_results(d, ",reference,", ",,"), "a measured row lacks its backend"),
    (lambda d: _edit_results(d, ",12.5,", ",nan,"), "a measured row lacks its time_us"),
    (lambda d: _edit_results(d, "dispatch,0,0,", "dispatch,0,inf,"),
     "column rank holds an infinite value where a whole number belongs"),
    (lambda d: _edit_results(d, "dispatch,0,", "dispatch,1e400,"), "column sms holds an infinite value"),
    (lambda d: _add_column(d, "time_us_min", "x"), "column time_us_min holds text"),
    (lambda d: _add_column(d, "input_sets", "four"), "column input_sets holds text"),
    # the readers int() these: a gap, 1e20 (astype int64: -9223372036854775808) or 2.5 is corrupt
    (lambda d: _add_column(d, "tokens_per_rank", ""), "a measured row lacks its tokens_per_rank"),
    (lambda d: _add_column(d, "tokens_per_rank", "1e20"), "column tokens_per_rank holds 1e+20 where a whole"),
    (lambda d: _edit_results(d, "dispatch,0,", "dispatch,1e20,"), "column sms holds 1e+20 where a whole"),
    (lambda d: _edit_results(d, "dispatch,0,", "dispatch,2.5,"), "column sms holds 2.5 where a whole"),
    # what every title and figure names: the scenario and its ranks
    (lambda d: (d / "meta.json").write_text("{}"), "meta.json: lacks scenario (corrupt"),
    (lambda d: _edit_meta(d, scenario={"model": {}}), "meta.json: lacks scenario.name (corrupt"),
], ids=["appended", "scenario-5", "name-list", "notes-numbers", "world-text", "world-bool", "time-text",
        "backend-empty", "time-nan", "rank-inf", "sms-1e400", "time-min-text", "input-sets-text",
        "tokens-nan", "tokens-1e20", "sms-1e20", "sms-fraction", "meta-empty", "scenario-unnamed"])
def test_fields_of_the_wrong_type_make_the_run_one_user_error(tmp_path, damage, needle):
    good = _run(tmp_path / "root" / "good")
    bad = _run(tmp_path / "root" / "bad")
    damage(bad)
    with pytest.raises(UserError, match=re.escape(needle)):
        results.load_run(bad)
    warnings = []
    assert [d for d, _, _ in results.load_runs([tmp_path / "root"], warnings.append)] == [good]
    assert len(warnings) == 1 and needle in warnings[0]


def _edit_results(d, old, new):
    text = (d / "results.csv").read_text()
    assert old in text
    (d / "results.csv").write_text(text.replace(old, new, 1))


def _add_column(d, name, value):
    head, row = (d / "results.csv").read_text().splitlines()
    (d / "results.csv").write_text(f"{head},{name}\n{row},{value}\n")


def _edit_meta(d, **fields):
    meta = json.loads((d / "meta.json").read_text())
    meta.update(fields)
    (d / "meta.json").write_text(json.dumps(meta))


def test_null_objects_and_lists_in_meta_read_as_absent(tmp_path):
    d = _run(tmp_path / "r")
    _edit_meta(d, options=None, notes=None, functional=None)
    meta, _ = results.load_run(d)
    assert "options" not in meta and "notes" not in meta and meta["functional"] is None


def test_numbers_read_as_numbers_and_keys_as_text(tmp_path):
    d = _run(tmp_path / "r", rows=(dict(ROW, backend=5), dict(ROW, op="combine", backend=5)))
    _, df = results.load_run(d)
    assert list(df["backend"]) == ["5", "5"] and df["sms"].dtype == "int64"


def test_a_folder_with_tables_but_no_meta_is_skipped_with_a_warning(tmp_path):
    good = _run(tmp_path / "good")
    orphan = _run(tmp_path / "orphan")
    (orphan / "meta.json").unlink()
    looped = _run(tmp_path / "looped")
    (looped / "meta.json").unlink()
    (looped / "meta.json").symlink_to("meta.json")
    warnings = []
    assert results.find_runs([tmp_path], warnings.append) == [good]
    assert warnings == [f"skipped: {looped / 'meta.json'}: not a readable file",
                        f"skipped: {orphan}: holds results.csv but no meta.json (not a complete results folder)"]
    (tmp_path / "empty").mkdir()  # an empty folder (a run still starting) is no news
    warnings.clear()
    results.find_runs([tmp_path], warnings.append)
    assert len(warnings) == 2


@pytest.mark.parametrize("link, needle", [("results.csv", "Too many levels of symbolic links"),
                                          ("gone.csv", "a symbolic link to nothing")])
def test_a_results_table_that_is_a_bad_link_is_no_silent_empty_run(tmp_path, link, needle):
    d = _run(tmp_path / "root" / "r")
    (d / "results.csv").unlink()
    (d / "results.csv").symlink_to(link)
    with pytest.raises(UserError, match=needle):
        results.load_run(d)
    warnings = []  # the walk found nothing else: its one reason is the error, said once
    with pytest.raises(UserError, match=needle):
        results.load_runs([tmp_path / "root"], warnings.append)
    assert warnings == []
    _run(tmp_path / "root" / "good")  # beside a readable run it is a warning
    assert len(results.load_runs([tmp_path / "root"], warnings.append)) == 1
    assert len(warnings) == 1 and needle in warnings[0]


# -- what a run records of itself: whole numbers, and the points a failed job lost -------------

def test_whole_number_columns_are_written_as_whole_numbers_beside_empty_cells(tmp_path):
    """pandas writes a column of ints that some rows leave empty as floats (rank 0.0, world 4.0):
    the writer keeps them whole, and a later job of the run (append) too."""
    d = tmp_path / "run"
    w = results.RunWriter(d, {"scenario": {"name": "s"}})
    w.add([dict(ROW, world=4, hidden=256, iters=5, input_sets=4, nic_virtual=False, tokens_per_rank=64,
                time_us=12.0)], [SAMPLE])
    w.add(results.unmeasured_rows("s", "epbench", [(4, 64)], "skipped: needs CUDA GPUs"), [])
    first = (d / "results.csv").read_text().splitlines()
    assert first[1] == "s,reference,dispatch,0,0,4,12.0,0,256,5,4,False,64,ok", first
    assert first[2].startswith("s,epbench,dispatch,4,,,,,"), first
    results.RunWriter(d, json.loads((d / "meta.json").read_text()), append=True).add(
        [dict(ROW, backend="other", rank=1, world=4, tokens_per_rank=64)], [])
    again = (d / "results.csv").read_text().splitlines()
    assert again[:3] == first[:3] and again[-1].startswith("s,other,dispatch,0,1,4,12.5,0,")
    _, df = results.load_run(d)
    assert list(df["rank"]) == [0, 1] and df["rank"].dtype == "int64" and list(df["time_us"]) == [12.0, 12.5]


def _lost_run(tmp_path, variants, measured, status):
    """A sweep over tokens 8-64 whose job died after ``measured`` variants of its first point, and
    the launcher's rows for the rest (launcher.launch_run)."""
    from epbench.launcher import job_points

    d = tmp_path / "run"
    w = results.RunWriter(d, {"scenario": {"name": "s"}})
    if variants is not None:
        w.variants("reference", variants)
    for v in (variants or [{}])[:measured]:
        w.add([dict(ROW, op=op, rank=r, tokens_per_rank=8, **v) for op in ("dispatch", "combine")
               for r in range(4)], [])
    opts = type("Opts", (), {"sms": (4,), "tokens": (8, 16, 32, 64)})()
    done = results.measured_points(d, "reference")
    left = [pt for pt in job_points(opts, "reference", 64) if pt not in done]
    results.add_rows(d, results.unmeasured_rows("s", "reference", left, status))
    return d, pd.read_csv(d / "results.csv")


def test_a_job_that_dies_mid_point_records_every_variant_it_lost(tmp_path):
    """Killed in the kernel-mode variant of its first point: that variant and every variant of the
    sizes still to come get rows, with their call mode and the rank that failed; the one measured
    keeps its rows alone; the closing line counts them."""
    from rich.console import Console

    from epbench.session import show_unmeasured

    variants = [{"call_mode": "call", "input_sets": 4}, {"call_mode": "kernel", "input_sets": 4}]
    d, df = _lost_run(tmp_path, variants, 1, "failed: rank 3 was killed by SIGKILL")
    lost = df[df["status"] != "ok"]
    assert list(zip(lost["tokens_per_rank"], lost["call_mode"], lost["op"]))[:4] == [
        (8, "kernel", "dispatch"), (8, "kernel", "combine"), (16, "call", "dispatch"), (16, "call", "combine")]
    assert len(lost) == 14 and set(lost["rank"]) == {3} and set(lost["input_sets"]) == {4}
    assert set(lost["status"]) == {"failed: rank 3 was killed by SIGKILL"}
    assert len(df[(df["status"] == "ok")]) == 8 and set(df[df["status"] == "ok"]["call_mode"]) == {"call"}
    console = Console(record=True, width=200)
    show_unmeasured(d, console)
    assert "reference: failed: rank 3 was killed by SIGKILL (7 points not measured)" in console.export_text()



def test_a_point_is_whole_once_every_recorded_variant_has_measured_rows(tmp_path):
    """measured_points: a point whose recorded variants all have measured rows is done; one with a variant
    missing (and no row saying why) is not, so the launcher records the missing variant."""
    variants = [{"call_mode": "call", "input_sets": 4}, {"call_mode": "kernel", "input_sets": 4}]
    w = results.RunWriter(tmp_path / "run", {"scenario": {"name": "s"}})
    w.variants("reference", variants)
    point = (int(ROW["sms"]), 8)

    def measure(v):
        w.add([dict(ROW, op=op, rank=r, tokens_per_rank=8, **v) for op in ("dispatch", "combine") for r in range(2)], [])

    measure(variants[0])
    assert point not in results.measured_points(tmp_path / "run", "reference")
    measure(variants[1])
    assert point in results.measured_points(tmp_path / "run", "reference")


def test_lost_rows_name_the_rank_a_timeout_blames_and_none_where_it_blames_several(tmp_path):
    _, df = _lost_run(tmp_path, [{"call_mode": "call", "input_sets": 1}], 0,
                      "timeout: [rank 0] rank 3 did not reach the others in 'x' within 8 s (--control-timeout)")
    assert len(df) == 8 and set(df["rank"]) == {3} and set(df["call_mode"]) == {"call"}
    _, df = _lost_run(tmp_path / "b", [{"call_mode": "call", "input_sets": 1}], 0,
                      "timeout: [rank 0] ranks 2, 3 did not reach the others in 'x' within 8 s")
    assert len(df) == 8 and df["rank"].isna().all()


def test_a_job_that_recorded_no_variants_gets_a_row_pair_per_point_as_before(tmp_path):
    """A job that died before it built its backend recorded no variants: one row per op of each
    point lost, the call mode left empty (it is not known)."""
    _, df = _lost_run(tmp_path, None, 0, "failed: [rank 1] boom")
    assert list(df["tokens_per_rank"]) == [8, 8, 16, 16, 32, 32, 64, 64]
    assert df["call_mode"].isna().all() if "call_mode" in df else True
    assert set(df["rank"]) == {1}


def test_world_comes_from_the_rows_where_meta_json_lost_it_and_is_otherwise_corrupt(tmp_path):
    d = _run(tmp_path / "r", rows=(dict(ROW, world=4),))
    meta, _ = results.load_run(d)
    assert meta["world"] == 4
    results.RunWriter(tmp_path / "empty", {"scenario": {"name": "s"}})  # nothing else says it
    with pytest.raises(UserError, match=r"empty/meta.json: lacks world \(corrupt"):
        results.load_run(tmp_path / "empty")


def test_tokens_absent_from_old_rows_are_the_scenarios_own(tmp_path):
    """A folder from before the column: the scenario's count (meta.json) stands in, never a gap."""
    d = _run(tmp_path / "r")
    _edit_meta(d, scenario={"name": "s", "model": {"tokens_per_rank": 128}})
    _, df = results.load_run(d)
    assert list(df["tokens_per_rank"]) == [128]
    _, df = results.load_run(_run(tmp_path / "plain"))  # no count anywhere: the readers show '-'
    assert "tokens_per_rank" not in df


def test_a_huge_whole_figure_outside_the_whole_columns_stays_a_float(tmp_path):
    """A hand-edited busbw of 1e300 is whole, but int64 would wrap it to -9223372036854775808: it is read as the
    number it is (the readers then print it in exponent form)."""
    w = results.RunWriter(tmp_path / "r", {"scenario": {"name": "s"}, "world": 1})
    w.add([{"scenario": "s", "backend": "reference", "op": op, "sms": 0, "rank": 0, "world": 1, "tokens_per_rank": 8,
            "time_us": 5.0, "wrong": 0, "busbw_nvlink_gbps": 1e300} for op in ("dispatch", "combine")], [])
    w.finish("complete")
    _, df = results.load_run(tmp_path / "r")
    assert (df["busbw_nvlink_gbps"] == 1e300).all() and df["sms"].dtype == "int64"
