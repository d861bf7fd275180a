"""make baselines' logic, with git, pip and the import check replaced by a recording runner."""

import os
import json
import subprocess
from pathlib import Path

import pytest

from epbench import baselines
from epbench.errors import UserError


class Recorder:
    """Answers each command with the exit code of the first matching rule (default 0)."""

    def __init__(self, fail=(), stdout="1.2.1"):
        self.fail, self.stdout, self.calls = fail, stdout, []

    def __call__(self, cmd, cwd, env):
        self.calls.append(list(cmd))
        line = " ".join(cmd)
        rc = 1 if any(f in line for f in self.fail) else 0
        return subprocess.CompletedProcess(cmd, rc, stdout=self.stdout if not rc else "",
                                           stderr="boom: the last line\n" if rc else "")


def git_checkout(tmp_path):
    src = tmp_path / "DeepEP"
    (src / ".git").mkdir(parents=True)
    return src


def test_pins_are_full_commits():
    for fl in baselines.FLAVORS.values():
        assert len(fl.commit) == 40 and int(fl.commit, 16) >= 0


def test_unknown_flavor_is_a_user_error():
    with pytest.raises(UserError):
        baselines.flavor("v3")


def test_missing_source_path_is_one_line(tmp_path):
    run = Recorder()
    note = baselines.build("v1", str(tmp_path / "nope"), run=run, env={}, stamp_dir=tmp_path)
    assert "does not exist" in note and "\n" not in note
    assert run.calls == []


def test_build_from_checkout_pins_the_commit_and_stamps(tmp_path):
    src = git_checkout(tmp_path)
    run = Recorder()
    note = baselines.build("v1", str(src), venv_python="/venv/bin/python", run=run,
                           env={}, stamp_dir=tmp_path)
    commit = baselines.FLAVORS["v1"].commit
    assert note.startswith("v1: installed deep_ep 1.2.1")
    assert any(c[-2:] == ["--quiet", commit] and "checkout" in c for c in run.calls)
    pip = next(c for c in run.calls if "pip" in c)
    assert pip[:6] == ["/venv/bin/python", "-m", "pip", "install", "--no-build-isolation", "--no-deps"]
    stamp = json.loads((tmp_path / baselines.STAMP).read_text())
    assert stamp["commit"] == commit and stamp["flavor"] == "v1"
    assert stamp["torch_cuda_arch_list"] == "9.0"


def test_checkout_without_the_commit_says_how_to_fetch(tmp_path):
    src = git_checkout(tmp_path)
    note = baselines.build("hybrid-ep", str(src), run=Recorder(fail=("cat-file",)), env={},
                           stamp_dir=tmp_path)
    assert "lacks the pinned commit" in note and "fetch origin hybrid-ep" in note
    assert not (tmp_path / baselines.STAMP).exists()


def test_failed_build_is_a_note_naming_the_step(tmp_path):
    src = git_checkout(tmp_path)
    note = baselines.build("v1", str(src), run=Recorder(fail=("pip install",)), env={},
                           stamp_dir=tmp_path)
    log = tmp_path / "epbench-baselines-v1.log"
    assert note == f"v1: pip install (the CUDA build) failed: boom: the last line (full log: {log})"
    assert "boom: the last line" in log.read_text()


def test_failed_import_is_a_note(tmp_path):
    src = git_checkout(tmp_path)
    note = baselines.build("v2", str(src), run=Recorder(fail=("import deep_ep",)), env={},
                           stamp_dir=tmp_path)
    assert "import deep_ep.ElasticBuffer failed" in note
    assert not (tmp_path / baselines.STAMP).exists()


def test_v2_initialises_its_submodule(tmp_path):
    run = Recorder()
    baselines.build("v2", str(git_checkout(tmp_path)), run=run, env={}, stamp_dir=tmp_path)
    assert any("submodule" in c for c in run.calls)


def test_tarball_must_hold_the_pinned_commit(tmp_path):
    src = tmp_path / "unpacked"
    src.mkdir()
    (src / ".epbench-commit").write_text("0" * 40 + "\n")
    note = baselines.build("v1", str(src), run=Recorder(), env={}, stamp_dir=tmp_path)
    assert "holds commit 000" in note
    (src / ".epbench-commit").write_text(baselines.FLAVORS["v1"].commit)
    run = Recorder()
    assert "installed" in baselines.build("v1", str(src), run=run, env={}, stamp_dir=tmp_path)
    assert not any(c[0] == "git" for c in run.calls)  # nothing to check out


def test_no_network_clone_failure_names_the_offline_recipe(tmp_path):
    note = baselines.build("v1", None, run=Recorder(fail=("git clone",)), env={}, stamp_dir=tmp_path)
    assert "DEEPEP_SRC=/path/to/DeepEP make baselines" in note


def test_cli_exits_0_on_a_failed_build(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("DEEPEP_SRC", str(tmp_path / "absent"))
    assert baselines.main(["build"]) == 0
    assert "does not exist" in capsys.readouterr().out
    assert baselines.main(["build", "--flavor", "nope"]) == 2


def test_versions_reads_the_stamp(tmp_path, monkeypatch):
    monkeypatch.setattr(baselines, "stamp_path", lambda: tmp_path / baselines.STAMP)
    assert "deep_ep_build" not in baselines.versions()
    (tmp_path / baselines.STAMP).write_text(json.dumps({"flavor": "v1", "commit": "abc"}))
    assert baselines.versions()["deep_ep_build"]["commit"] == "abc"
    assert any("flavor v1 at abc" in ln for ln in baselines.status())


def test_makefile_carry_target_exists():
    text = (Path(__file__).resolve().parent.parent / "Makefile").read_text()
    assert "baselines-carry:" in text and "git -C \"$(DEEPEP_SRC)\" archive" in text


def test_cuda_13_cccl_headers_reach_the_host_compiler(tmp_path):
    (tmp_path / "include" / "cccl" / "cuda" / "std").mkdir(parents=True)
    env = baselines.build_env({"CUDA_HOME": str(tmp_path), "PATH": "", "CPLUS_INCLUDE_PATH": "/x"})
    assert env["CPLUS_INCLUDE_PATH"].split(os.pathsep) == [str(tmp_path / "include" / "cccl"), "/x"]
    assert "CPLUS_INCLUDE_PATH" not in baselines.build_env({"CUDA_HOME": str(tmp_path / "none"), "PATH": ""})


def test_nvshmem_wheel_without_the_unversioned_library_gets_a_folder_of_links(tmp_path):
    home = tmp_path / "nvshmem"
    (home / "include").mkdir(parents=True)
    (home / "lib").mkdir()
    (home / "lib" / "libnvshmem_host.so.3").write_text("host")
    (home / "lib" / "libnvshmem_device.a").write_text("device")
    got = Path(baselines.nvshmem_link_home(home, tmp_path / "shadow"))
    assert got == tmp_path / "shadow"
    assert (got / "lib" / "libnvshmem_host.so").read_text() == "host"
    assert (got / "lib" / "libnvshmem_device.a").read_text() == "device"
    assert (got / "include").resolve() == (home / "include").resolve()
    assert not (home / "lib" / "libnvshmem_host.so").exists()  # the wheel itself is left alone
    (home / "lib" / "libnvshmem_host.so").write_text("host")
    assert baselines.nvshmem_link_home(home, tmp_path / "shadow2") == str(home)
