"""provenance: the commit in meta.json is epbench's own, whatever repository a copy sits in; the
baselines' build stamp and the NCCL this process loaded are read back, never raising."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from epbench import provenance
from support import REPO

pytestmark = pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")


def git(cwd: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True,
                          text=True).stdout.strip()


def recorded(tree: Path, call: str = "git_commit()") -> dict:
    """provenance.<call> run in a fresh interpreter that imports epbench from ``tree`` (a copy of
    this tree's package: a clone would run the code of its last commit)."""
    code = (f"import json, sys; sys.path.insert(0, {str(tree)!r}); "
            f"from epbench import provenance; "
            f"assert provenance.__file__.startswith({str(tree)!r}); "
            f"print(json.dumps(provenance.{call}))")
    out = subprocess.run([sys.executable, "-c", code], cwd=tree, check=True,
                         capture_output=True, text=True)
    return json.loads(out.stdout)


def copy_package(dest: Path) -> Path:
    """epbench/ and pyproject.toml of this tree, without .git and without a build stamp."""
    dest.mkdir(parents=True)
    shutil.copy(REPO / "pyproject.toml", dest)
    shutil.copytree(REPO / "epbench", dest / "epbench", ignore=shutil.ignore_patterns(
        "_lib", "__pycache__", provenance.BUILD_INFO))
    return dest


@pytest.fixture(scope="module")
def clone(tmp_path_factory) -> Path:
    """A fresh clone of this repository, top-level files and epbench/ checked out (sparse)."""
    if not (REPO / ".git").exists():
        pytest.skip("this tree is not a git checkout")
    dest = tmp_path_factory.mktemp("clone") / "epbench-clone"
    git(REPO.parent, "clone", "-q", "--sparse", str(REPO), str(dest))
    git(dest, "sparse-checkout", "set", "epbench")
    return dest


def test_fresh_clone_records_its_head(clone):
    assert provenance.git_commit(clone / "epbench") == {
        "git_commit": git(clone, "rev-parse", "HEAD"), "git_commit_from": "checkout"}


def test_a_changed_tracked_file_marks_the_commit_dirty(tmp_path, clone):
    work = tmp_path / "dirty"
    git(clone, "worktree", "add", "-q", "--detach", str(work))
    head = git(work, "rev-parse", "HEAD")
    with open(work / "pyproject.toml", "a") as f:
        f.write("\n# local change\n")
    assert provenance.git_commit(work / "epbench")["git_commit"] == head + "+dirty"
    assert "git_commit_stamped" not in provenance.git_commit(work / "epbench")
    # a newer commit's copy laid over this checkout (the GPU host): its stamp is named beside
    (work / "epbench" / provenance.BUILD_INFO).write_text(json.dumps({"git_commit": "f" * 40}))
    assert provenance.git_commit(work / "epbench")["git_commit_stamped"] == "f" * 40
    # make build there keeps that stamp (this checkout lacks its commit: a stale .git) ...
    assert "kept the build stamp" in provenance.stamp(work / "epbench")
    assert provenance.stamped_commit(work / "epbench" / provenance.BUILD_INFO) == "f" * 40
    # ... but re-stamps over one naming a commit it holds
    (work / "epbench" / provenance.BUILD_INFO).write_text(json.dumps({"git_commit": head}))
    assert provenance.stamp(work / "epbench").startswith(f"stamped {head}+dirty")
    (work / "epbench" / provenance.BUILD_INFO).unlink()
    (work / "untracked.txt").write_text("not part of the tree")  # untracked files do not count
    git(work, "checkout", "--", "pyproject.toml")
    assert provenance.git_commit(work / "epbench")["git_commit"] == head


def test_a_copy_inside_another_repository_does_not_record_its_commit(tmp_path):
    other = tmp_path / "other"
    other.mkdir()
    git(other, "init", "-q")
    (other / "pyproject.toml").write_text('[project]\nname = "someone-else"\n')
    git(other, "add", ".")
    git(other, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "other")
    outer = git(other, "rev-parse", "HEAD")
    copy = copy_package(other / "vendored" / "epbench-copy")
    assert recorded(copy) == {"git_commit": "unknown",
                              "git_commit_from": "no epbench checkout and no build stamp"}
    # the copy committed into that repository is still not epbench's checkout
    git(other, "add", ".")
    git(other, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "vendored")
    assert outer not in json.dumps(recorded(copy))
    assert recorded(copy)["git_commit"] == "unknown"


def test_the_build_stamp_travels_with_a_copy(tmp_path, clone):
    msg = provenance.stamp(clone / "epbench")  # what `make build` runs, in epbench's checkout
    head = git(clone, "rev-parse", "HEAD")
    assert msg.startswith(f"stamped {head}")
    other = tmp_path / "other"
    other.mkdir()
    git(other, "init", "-q")
    copy = copy_package(other / "copy")
    shutil.copy(clone / "epbench" / provenance.BUILD_INFO, copy / "epbench")
    assert recorded(copy) == {"git_commit": head,
                              "git_commit_from": f"build stamp {provenance.BUILD_INFO}"}
    assert "kept the build stamp" in recorded(copy, "stamp()")  # outside a checkout: kept
    assert git(REPO, "check-ignore", f"epbench/{provenance.BUILD_INFO}")  # never committed


def test_stamp_that_is_not_json_is_ignored(tmp_path):
    bad = tmp_path / "_build_info.json"
    bad.write_text("not json")
    assert provenance.stamped_commit(bad) is None
    bad.write_text('["a list"]')
    assert provenance.stamped_commit(bad) is None
    assert provenance.stamped_commit(tmp_path / "missing.json") is None


def test_baseline_versions_read_the_build_stamp(tmp_path, monkeypatch):
    stamp = tmp_path / provenance.BASELINES_STAMP
    monkeypatch.setattr(provenance, "baselines_stamp_path", lambda: stamp)
    assert provenance.baselines_build() == {} and "deep_ep_build" not in provenance.baseline_versions()
    stamp.write_text("not json")
    assert provenance.baselines_build() == {}
    stamp.write_text(json.dumps({"flavor": "v1", "commit": "abc"}))
    assert provenance.baseline_versions()["deep_ep_build"] == {"flavor": "v1", "commit": "abc"}


def test_loaded_nccl_lists_every_mapped_copy_and_never_raises(tmp_path):
    maps = tmp_path / "maps"
    maps.write_text("7f00-7f01 r-xp 0 08:01 1 /venv/epbench-nccl/lib/libnccl.so.2\n"
                    "7f01-7f02 r--p 0 08:01 1 /venv/epbench-nccl/lib/libnccl.so.2\n"
                    "7f02-7f03 r-xp 0 08:01 2 /site/nvidia/nccl/lib/libnccl.so.2\n"
                    "7f03-7f04 rw-p 0 00:00 0\n")
    paths, version = provenance.loaded_nccl(str(maps))
    assert paths == ["/venv/epbench-nccl/lib/libnccl.so.2", "/site/nvidia/nccl/lib/libnccl.so.2"]
    assert version is None  # the first path is not a loadable library here
    assert provenance.loaded_nccl(str(tmp_path / "none")) == ([], None)


def test_collect_names_epbench_numpy_and_pandas_versions(monkeypatch):
    """meta.json (and ceiling's and predict's files) name epbench's own version and the numpy and
    pandas that computed and wrote the numbers, beside python and torch."""
    import numpy
    import pandas

    from epbench import __version__

    info = provenance.collect(["run", "x.yaml"], "cpu")
    assert info["epbench"] == __version__
    assert info["numpy"] == numpy.__version__ and info["pandas"] == pandas.__version__
    assert info["torch"] and info["python"] and info["argv"] == ["run", "x.yaml"]
    # a package missing from the environment is said so, never an error
    monkeypatch.setattr(provenance, "PYTHON_PACKAGES", ("numpy", "epbench-no-such-dist"))
    assert provenance.package_versions()["epbench-no-such-dist"] == "not installed"
