"""make baselines' logic (tools/baselines.py), with git, pip and the import check replaced by a
recording runner."""

import json
import os
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tools"))

import baselines  # noqa: E402
from epbench import provenance  # noqa: E402
from epbench.backends import deepep_v2_env  # noqa: E402
from epbench.errors import UserError  # noqa: E402


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


@pytest.mark.parametrize("argv, line", [
    (["build", "--flavor", "nope"], "baselines: error: baseline flavor 'nope': unknown"),
    (["carry", "--src", "/x", "--submodule", "fmt"], "baselines: error: --submodule 'fmt': expected PATH=REPO"),
    (["build", "--bogus"], "baselines: error: unrecognized arguments: --bogus"),
    (["rebuild"], "baselines: error: argument cmd: invalid choice: 'rebuild'"),
])
def test_bad_input_is_one_line_and_exit_2(argv, line, capsys):
    assert baselines.main(argv) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.startswith(line) and err.count("\n") == 1


def test_status_names_the_stamped_flavor(tmp_path, monkeypatch):
    monkeypatch.setattr(provenance, "baselines_stamp_path", lambda: tmp_path / baselines.STAMP)
    (tmp_path / baselines.STAMP).write_text(json.dumps({"flavor": "v1", "commit": "abc"}))
    assert any("flavor v1 at abc" in ln for ln in baselines.status())


def test_makefile_targets_call_the_tool():
    text = (REPO / "Makefile").read_text()
    assert "baselines-carry:" in text and "tools/baselines.py carry" in text
    assert "tools/baselines.py build" in text and "tools/baselines.py status" in text
    assert '--nccl "$(NCCL_CARRY)"' in text


def git(*args, cwd):
    subprocess.run(["git", "-c", "user.email=t@t", "-c", "user.name=t", *args], cwd=cwd, check=True,
                   capture_output=True)


def test_carry_source_adds_the_pinned_submodule(tmp_path, monkeypatch):
    sub = tmp_path / "fmt"
    sub.mkdir()
    (sub / "fmt.h").write_text("fmt at the pinned commit")
    git("init", "-q", cwd=sub)
    git("add", ".", cwd=sub)
    git("commit", "-qm", "fmt", cwd=sub)
    sub_commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=sub, capture_output=True,
                                text=True).stdout.strip()
    src = tmp_path / "DeepEP"
    src.mkdir()
    (src / "setup.py").write_text("v2")
    git("init", "-q", cwd=src)
    git("add", ".", cwd=src)
    git("update-index", "--add", "--cacheinfo", f"160000,{sub_commit},third-party/fmt", cwd=src)
    git("commit", "-qm", "v2", cwd=src)
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=src, capture_output=True, text=True).stdout.strip()
    monkeypatch.setitem(baselines.FLAVORS, "v2", baselines.Flavor("v2", commit, "main", "ElasticBuffer", "", True))
    out = tmp_path / "out" / "src.tar.gz"
    fl = baselines.FLAVORS["v2"]
    note = baselines.carry_source(fl, str(src), out, {})
    assert "submodule third-party/fmt" in note and "SUBMODULE_SRC" in note  # not checked out in src
    note = baselines.carry_source(fl, str(src), out, {"third-party/fmt": str(sub)})
    assert note.startswith(f"wrote {out}") and "with third-party/fmt" in note
    with tarfile.open(out) as tar:
        names = tar.getnames()
        assert tar.extractfile("./.epbench-commit").read().decode().strip() == commit
        assert tar.extractfile("./third-party/fmt/fmt.h").read() == b"fmt at the pinned commit"
    assert "./setup.py" in names
    # a flavor that needs no submodule (hybrid-ep: nccl is multinode-only) carries without it
    monkeypatch.setitem(baselines.FLAVORS, "hybrid-ep",
                        baselines.Flavor("hybrid-ep", commit, "hybrid-ep", "HybridEPBuffer", ""))
    note = baselines.carry_source(baselines.FLAVORS["hybrid-ep"], str(src), out, {})
    assert note.startswith(f"wrote {out}") and "left out third-party/fmt" in note
    with tarfile.open(out) as tar:
        assert "./third-party/fmt/fmt.h" not in tar.getnames()


def fake_nccl_wheel(path, version="2.32.3"):
    from tests.test_nccl_prune import entry, fatbin

    with zipfile.ZipFile(path, "w") as z:
        z.writestr(f"nvidia_nccl_cu13-{version}.dist-info/METADATA", f"Name: nvidia-nccl-cu13\nVersion: {version}\n")
        z.writestr("nvidia/nccl/include/nccl.h", "nccl.h")
        z.writestr("nvidia/nccl/include/nccl_device/gin.h", "gin.h")
        z.writestr("nvidia/nccl/lib/libnccl.so.2",
                   b"\x7fELF" + fatbin(entry(2, 90, b"N" * 64), entry(2, 100, b"B" * 4096)))
    return path


def test_nccl_carry_round_trip(tmp_path):
    out = tmp_path / ".whl" / baselines.NCCL_CARRY
    note = baselines.carry_nccl(fake_nccl_wheel(tmp_path / "nccl.whl"), out, 90)
    assert note.startswith(f"wrote {out} (NCCL 2.32.3 for sm_90") and "zeroed" in note
    got = baselines.unpack_nccl(out, tmp_path / "venv" / baselines.NCCL_PREFIX)
    root = tmp_path / "venv" / baselines.NCCL_PREFIX
    assert got == {"root": str(root), "version": "2.32.3", "preload": str(root / "lib" / "libnccl.so.2")}
    lib = (root / "lib" / "libnccl.so.2").read_bytes()
    assert b"N" * 64 in lib and b"B" * 4096 not in lib
    assert (root / "include" / "nccl_device" / "gin.h").read_text() == "gin.h"
    # torch's own preload (nvidia/nccl/lib on sys.path) is pointed at the same file
    shim = root / deepep_v2_env.TORCH_SHIM
    assert (shim / "nvidia" / "nccl" / "lib" / "libnccl.so.2").resolve() == (root / "lib" / "libnccl.so.2").resolve()
    env = deepep_v2_env.preload_env(got["preload"], {"PYTHONPATH": "/x", "LD_PRELOAD": "/y.so"})
    assert env == {"LD_PRELOAD": f"{got['preload']} /y.so", "PYTHONPATH": f"{shim}{os.pathsep}/x"}
    old = baselines.carry_nccl(fake_nccl_wheel(tmp_path / "old.whl", "2.28.9"), tmp_path / "old.tar.xz", 90)
    assert old.startswith("wrote")
    assert "needs >= 2.30.4" in baselines.unpack_nccl(tmp_path / "old.tar.xz", tmp_path / "p2")
    assert "does not exist" in baselines.unpack_nccl(tmp_path / "none.tar.xz", tmp_path / "p3")
    assert "cannot make the NCCL carry" in baselines.carry_nccl(tmp_path / "old.tar.xz", out, 90)  # not a zip
    with zipfile.ZipFile(tmp_path / "other.whl", "w") as z:
        z.writestr("other-1.0.dist-info/METADATA", "Version: 1.0\n")
    assert "not an NCCL wheel" in baselines.carry_nccl(tmp_path / "other.whl", out, 90)


def test_v2_build_with_an_nccl_carry_links_it_and_imports_under_preload(tmp_path, monkeypatch):
    carry = tmp_path / "nccl.tar.xz"
    baselines.carry_nccl(fake_nccl_wheel(tmp_path / "nccl.whl"), carry, 90)
    envs = []

    class EnvRecorder(Recorder):
        def __call__(self, cmd, cwd, env):
            envs.append((" ".join(cmd), dict(env)))
            return super().__call__(cmd, cwd, env)

    note = baselines.build("v2", str(git_checkout(tmp_path)), run=EnvRecorder(), env={"LIBRARY_PATH": "/x"},
                           stamp_dir=tmp_path, nccl_carry=str(carry))
    root = tmp_path / baselines.NCCL_PREFIX
    assert note.startswith("v2: installed deep_ep")
    pip_env = next(e for c, e in envs if "pip install" in c)
    assert pip_env["EP_NCCL_ROOT_DIR"] == str(root)
    assert pip_env["LIBRARY_PATH"] == os.pathsep.join([str(root / "lib"), "/x"])
    assert "LD_PRELOAD" not in pip_env
    check_env = next(e for c, e in envs if "import deep_ep" in c)
    assert check_env["LD_PRELOAD"] == str(root / "lib" / "libnccl.so.2")
    stamp = json.loads((tmp_path / baselines.STAMP).read_text())
    assert stamp["nccl"]["version"] == "2.32.3"
    # the launcher preloads it into deepep-v2's job only, and puts the environment back after
    monkeypatch.setattr(provenance, "baselines_stamp_path", lambda: tmp_path / baselines.STAMP)
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    assert deepep_v2_env.job_env(["reference"]) == {}
    with deepep_v2_env.job_environment(["deepep-v2"]) as extra:
        assert os.environ["LD_PRELOAD"] == extra["LD_PRELOAD"] == stamp["nccl"]["preload"]
    assert "LD_PRELOAD" not in os.environ
    assert "2.32.3" in baselines.v2_nccl_status() and ">= 2.30.4, enough" in baselines.v2_nccl_status()
    v1 = baselines.build("v1", str(tmp_path / "DeepEP"), run=Recorder(), env={}, stamp_dir=tmp_path,
                         nccl_carry=str(carry))
    assert "NCCL_CARRY is for the v2 flavor" in v1


def test_v2_status_reports_torchs_nccl_without_a_carry(tmp_path, monkeypatch):
    import torch

    monkeypatch.setattr(provenance, "baselines_stamp_path", lambda: tmp_path / baselines.STAMP)
    monkeypatch.setattr(torch.cuda.nccl, "version", lambda: (2, 28, 9))
    line = baselines.v2_nccl_status()
    assert "2.28.9 (torch's own): < 2.30.4, too old" in line


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


def _cxx_runner(answers):
    """A fake compiler: -print-file-name=<name> prints answers[name] (GCC prints the bare name
    when it finds no such file)."""
    def run(cmd, cwd, env):
        name = cmd[-1].split("=", 1)[1]
        return subprocess.CompletedProcess(cmd, 0, answers.get(name, name) + "\n", "")
    return run


def test_libstdcxx_shim_only_where_the_compiler_would_link_the_static_runtime(tmp_path):
    so6 = tmp_path / "sys" / "libstdc++.so.6.0.33"
    so6.parent.mkdir()
    so6.write_text("elf")
    # the compiler has its libstdc++.so: nothing to do
    found = _cxx_runner({"libstdc++.so": "/usr/lib/gcc/x/13/libstdc++.so", "libstdc++.so.6": str(so6)})
    assert baselines.libstdcxx_link_dir({}, tmp_path / "a", found) is None
    assert not (tmp_path / "a").exists()
    # it has none (it would take libstdc++.a): a folder whose libstdc++.so is the shared runtime
    missing = _cxx_runner({"libstdc++.so.6": str(so6)})
    shim = baselines.libstdcxx_link_dir({}, tmp_path / "b", missing)
    assert shim == str(tmp_path / "b")
    assert (tmp_path / "b" / "libstdc++.so").resolve() == so6.resolve()
    # no compiler at all
    def absent(cmd, cwd, env):
        raise FileNotFoundError(cmd[0])
    assert baselines.libstdcxx_link_dir({}, tmp_path / "c", absent) is None


def test_build_env_puts_the_shim_first_on_the_link_line(tmp_path, monkeypatch):
    monkeypatch.setattr(baselines, "libstdcxx_link_dir", lambda env, shadow, run=None: "/shim")
    env = baselines.build_env({"PATH": "", "LDFLAGS": "-L/other"})
    assert env["LDFLAGS"] == "-L/shim -L/other" and env[baselines.LIBSTDCXX_SHIM_ENV] == "/shim"
    monkeypatch.setattr(baselines, "libstdcxx_link_dir", lambda env, shadow, run=None: None)
    assert "LDFLAGS" not in baselines.build_env({"PATH": ""})


def test_static_cxx_runtime_names_the_modules_without_libstdcxx(tmp_path):
    needed = {"/site/deep_ep_cpp.so": " (NEEDED) Shared library: [libstdc++.so.6]\n",
              "/site/hybrid_ep_cpp.so": " (NEEDED) Shared library: [libc.so.6]\n"}

    def run(cmd, cwd, env):
        if cmd[0] == "readelf":
            return subprocess.CompletedProcess(cmd, 0, needed[cmd[-1]], "")
        return subprocess.CompletedProcess(cmd, 0, "\n".join(needed) + "\n", "")
    assert baselines.static_cxx_runtime("/venv/bin/python", run, {}) == ["hybrid_ep_cpp.so"]
    needed["/site/hybrid_ep_cpp.so"] += " (NEEDED) Shared library: [libstdc++.so.6]\n"
    assert baselines.static_cxx_runtime("/venv/bin/python", run, {}) == []
