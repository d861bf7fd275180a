"""Builds the external baselines (DeepEP and its branches) into the venv at pinned commits.

DeepEP V1, DeepEP V2 (main) and Hybrid-EP (the hybrid-ep branch) all install as the Python
package ``deep_ep``, so one venv holds one *flavor* at a time; V2's and Hybrid-EP's packages keep
V1's ``Buffer`` beside their own class, so the ``deepep`` backend runs with any of them. No
third-party source lives in this repository: a flavor is a commit string, built from a checkout
given by path (``DEEPEP_SRC``) or cloned when the hosting site can be reached.

Every failure is a one-line note naming the step; ``build`` returns 0 all the same, so that
``make run`` and ``make test`` never depend on a baseline building. What was built is written to
``<venv>/epbench-baselines.json`` and recorded in every result's meta.json (``baselines``; read at
run time by epbench/provenance.py).

    python tools/baselines.py build --flavor v2 --src /tmp/deepep --nccl .whl/nccl.tar.xz
    python tools/baselines.py carry --flavor v2 --src ~/DeepEP --nccl-wheel nvidia_nccl_cu13-*.whl
    python tools/baselines.py status

Run by ``make baselines``, ``make baselines-carry`` and ``make baselines-status``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence

REPO = Path(__file__).resolve().parent.parent
TOOLS = Path(__file__).resolve().parent
for _p in (str(REPO), str(TOOLS)):
    if _p not in sys.path:
        sys.path.insert(0, _p)

import nccl_prune  # noqa: E402
import toolcli  # noqa: E402
from epbench import flavors, provenance  # noqa: E402
from epbench.backends.deepep_v2_env import MIN_NCCL, TORCH_SHIM, preload_env, v2_nccl, version_tuple  # noqa: E402
from epbench.errors import UserError  # noqa: E402

REPO_URL = "https://github.com/deepseek-ai/DeepEP.git"
STAMP = provenance.BASELINES_STAMP


@dataclass(frozen=True)
class Flavor:
    name: str
    commit: str  # pinned; a checkout at another commit is refused
    branch: str
    provides: str  # the class the flavor's own backend needs from deep_ep
    needs: str  # what the build and run need, for the README and the notes
    submodules: bool = False  # main vendors fmt as a git submodule; hybrid-ep's nccl one is multinode-only


FLAVORS: Dict[str, Flavor] = {f.name: f for f in (
    # The last commit of main before V2 (2026-02-03): V1 alone; NVSHMEM optional (intranode only
    # without it).
    Flavor("v1", "567632dd59810d77b3cc05553df953cc0f779799", "main",
           "Buffer", "nvcc, sm_90; NVSHMEM (pip wheel) for the internode kernels, optional"),
    Flavor("v2", "dd758caf451848bd150e1046af3d0a73e5fff38d", "main",
           "ElasticBuffer", "NCCL >= 2.30.4 at build and run time, NVSHMEM, torch >= 2.10",
           submodules=True),
    Flavor("hybrid-ep", "94a9f8f6b146c07d97ec58f67cd6d303296d6098", "hybrid-ep",
           "HybridEPBuffer", "nvcc, TORCH_CUDA_ARCH_LIST (9.0 here); NVSHMEM for V1's part"),
)}


def flavor(name: str) -> Flavor:
    if name not in FLAVORS:
        raise UserError(f"baseline flavor {name!r}: unknown (known: {', '.join(FLAVORS)})")
    return FLAVORS[name]


Runner = Callable[[Sequence[str], Optional[Path], Dict[str, str]], "subprocess.CompletedProcess[str]"]


def _run(cmd: Sequence[str], cwd: Optional[Path], env: Dict[str, str]) -> "subprocess.CompletedProcess[str]":
    return subprocess.run(list(cmd), cwd=cwd, env=env, capture_output=True, text=True)


def _tail(p: "subprocess.CompletedProcess[str]") -> str:
    lines = [ln for ln in (p.stderr or p.stdout or "").strip().splitlines() if ln.strip()]
    return lines[-1].strip()[:200] if lines else f"exit {p.returncode}"


def build_env(base: Dict[str, str]) -> Dict[str, str]:
    env = dict(base)
    env.setdefault("TORCH_CUDA_ARCH_LIST", "9.0")
    from epbench.nvshmem_lib import find_home

    home = find_home()
    if home and "NVSHMEM_DIR" not in env:
        env["NVSHMEM_DIR"] = nvshmem_link_home(Path(home), Path(sys.prefix) / "epbench-nvshmem")
    shim = libstdcxx_link_dir(env, Path(sys.prefix) / "epbench-libstdcxx")
    if shim:
        # -L before the compiler's own folders: the extension then needs libstdc++.so.6
        env["LDFLAGS"] = " ".join(p for p in (f"-L{shim}", env.get("LDFLAGS")) if p)
        env[LIBSTDCXX_SHIM_ENV] = shim  # recorded in the build stamp
    cccl = cccl_include(env)
    if cccl:
        # CUDA 13 keeps libcu++ (cuda/std/...) under include/cccl, which nvcc adds by itself but
        # the host compiler does not; NVSHMEM's headers include it from DeepEP's .cpp files
        env["CPLUS_INCLUDE_PATH"] = os.pathsep.join(p for p in (cccl, env.get("CPLUS_INCLUDE_PATH")) if p)
    return env


def nvshmem_link_home(home: Path, shadow: Path) -> str:
    """An NVSHMEM folder DeepEP's setup.py can link against. The pip wheel ships only the
    versioned ``libnvshmem_host.so.3``, and DeepEP links ``-l:libnvshmem_host.so``: then a folder
    of links (include/, and lib/ with every file plus the unversioned name) stands in for the
    wheel's, which is never modified. Returns ``home`` itself where nothing is missing or the
    links cannot be made."""
    lib = home / "lib"
    if (lib / "libnvshmem_host.so").exists() or not (lib / "libnvshmem_host.so.3").exists():
        return str(home)
    try:
        (shadow / "lib").mkdir(parents=True, exist_ok=True)
        links = {shadow / "include": home / "include", shadow / "lib" / "libnvshmem_host.so": lib / "libnvshmem_host.so.3"}
        links.update({shadow / "lib" / f.name: f for f in lib.iterdir()})
        for link, target in links.items():
            if link.is_symlink() or link.exists():
                link.unlink()
            link.symlink_to(target)
    except OSError:
        return str(home)
    return str(shadow)


LIBSTDCXX_SHIM_ENV = "EPBENCH_LIBSTDCXX_SHIM"
LIBSTDCXX_CANDIDATES = ("/usr/lib/x86_64-linux-gnu/libstdc++.so.6", "/usr/lib64/libstdc++.so.6",
                        "/lib/x86_64-linux-gnu/libstdc++.so.6")


def libstdcxx_link_dir(env: Dict[str, str], shadow: Path, run: Runner = None) -> Optional[str]:
    """A folder whose ``libstdc++.so`` links to the host's ``libstdc++.so.6``, made only where the
    C++ compiler finds no ``libstdc++.so`` of its own (a GCC whose -dev package left out the
    unversioned link): it then links ``libstdc++.a`` into the extension, and a second, static C++
    runtime in a process that already has torch's shared one breaks the locale machinery (seen on
    the GPU host, 2026-11-25: Hybrid-EP died with SIGSEGV inside std::ostream::_M_insert<long>,
    formatting an int in HybridEPBuffer's constructor; its own test crashed the same way). None
    where nothing is missing, or no compiler or shared library is found."""
    run = run or _run
    cxx = env.get("CXX") or "c++"
    try:
        p = run([cxx, "-print-file-name=libstdc++.so"], None, env)
    except OSError:
        return None
    if p.returncode or os.path.isabs((p.stdout or "").strip()):
        return None  # no compiler, or it links the shared runtime already
    p = run([cxx, "-print-file-name=libstdc++.so.6"], None, env)
    found = (p.stdout or "").strip()
    targets = ([found] if os.path.isabs(found) else []) + list(LIBSTDCXX_CANDIDATES)
    target = next((t for t in targets if Path(t).exists()), None)
    if target is None:
        return None
    try:
        shadow.mkdir(parents=True, exist_ok=True)
        link = shadow / "libstdc++.so"
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(Path(target).resolve())
    except OSError:
        return None
    return str(shadow)


def cccl_include(env: Dict[str, str]) -> Optional[str]:
    """The CUDA toolkit's include/cccl folder (CUDA 13 and later), or None."""
    roots = [env.get("CUDA_HOME"), env.get("CUDA_PATH")]
    nvcc = shutil.which("nvcc", path=env.get("PATH"))
    if nvcc:
        roots.append(str(Path(nvcc).resolve().parent.parent))
    for root in filter(None, roots):
        folder = Path(root) / "include" / "cccl"
        if (folder / "cuda" / "std").is_dir():
            return str(folder)
    return None


# --- V2's NCCL: DeepEP main needs NCCL >= 2.30.4 (its Gin device API) at build and run time, where
# torch may bring an older one (epbench/backends/deepep_v2_env.py, which preloads it at run time).
# ``carry_nccl`` packs the NCCL wheel's library, pruned to one GPU architecture (tools/nccl_prune.py),
# and headers (V2's JIT kernels include nccl_device.h at run time) into one tarball; ``build --nccl``
# unpacks it into the venv, builds V2 against it, and records it in the stamp, which the launcher
# reads to preload that library into the deepep-v2 jobs only.

NCCL_PREFIX = "epbench-nccl"  # in the venv: lib/libnccl.so.2, include/, epbench-nccl.json
NCCL_STAMP = "epbench-nccl.json"
NCCL_CARRY = "nccl.tar.xz"


def carry_nccl(wheel: Path, out: Path, arch: int) -> str:
    """Writes ``out`` (a .tar.xz): ``nccl/lib/libnccl.so.2`` pruned for sm_``arch``,
    ``nccl/include/``, and ``nccl/epbench-nccl.json`` (version, arch). Returns one line."""
    import tarfile
    import zipfile

    try:
        with zipfile.ZipFile(wheel) as z, tempfile.TemporaryDirectory(prefix="epbench-nccl-") as tmp:
            root = Path(tmp) / "nccl"
            names = z.namelist()
            meta = next((n for n in names if n.endswith(".dist-info/METADATA")), None)
            lib = "nvidia/nccl/lib/libnccl.so.2"
            if meta is None or lib not in names:
                return f"{wheel}: not an NCCL wheel (no {lib})"
            version = next((ln.split(":", 1)[1].strip() for ln in z.read(meta).decode().splitlines()
                            if ln.startswith("Version:")), "unknown")
            for n in names:
                if n.startswith("nvidia/nccl/include/") and not n.endswith("/"):
                    dest = root / n[len("nvidia/nccl/"):]
                    dest.parent.mkdir(parents=True, exist_ok=True)
                    dest.write_bytes(z.read(n))
            (root / "lib").mkdir(parents=True)
            whole = Path(tmp) / "libnccl.so.2.whole"
            with z.open(lib) as f_in, open(whole, "wb") as f_out:
                shutil.copyfileobj(f_in, f_out, 1 << 24)
            stats = nccl_prune.prune_file(whole, root / "lib" / "libnccl.so.2", arch)
            whole.unlink()
            (root / NCCL_STAMP).write_text(json.dumps(
                {"version": version, "arch": arch, "wheel": wheel.name, "pruned": stats.line(arch)}) + "\n")
            out.parent.mkdir(parents=True, exist_ok=True)
            with tarfile.open(out, "w:xz") as tar:
                tar.add(root, arcname="nccl")
    except (OSError, zipfile.BadZipFile) as e:
        return f"{wheel}: cannot make the NCCL carry: {e}"
    return f"wrote {out} (NCCL {version} for sm_{arch}, {out.stat().st_size / 2**20:.1f} MiB; {stats.line(arch)})"


def unpack_nccl(carry: Path, prefix: Path) -> "Dict[str, str] | str":
    """Unpacks a ``carry_nccl`` tarball into ``prefix`` (replacing what was there); returns
    {root, version, preload} or one line naming what is wrong."""
    import tarfile

    if not carry.is_file():
        return f"NCCL carry {carry} does not exist (make baselines-carry NCCL_WHEEL=... writes it)"
    try:
        if prefix.exists():
            shutil.rmtree(prefix)
        prefix.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix="epbench-nccl-", dir=prefix.parent) as tmp:
            with tarfile.open(carry, "r:*") as tar:
                tar.extractall(tmp, filter="data")
            shutil.move(str(Path(tmp) / "nccl"), str(prefix))
        info = json.loads((prefix / NCCL_STAMP).read_text())
    except (OSError, ValueError, tarfile.TarError) as e:
        return f"unpacking the NCCL carry {carry} failed: {e}"
    version = str(info.get("version"))
    if version_tuple(version) < MIN_NCCL:
        return f"the NCCL carry holds {version}; V2 needs >= {'.'.join(map(str, MIN_NCCL))}"
    try:
        make_torch_shim(prefix)
    except OSError as e:
        return f"linking the NCCL carry for torch's preload failed: {e}"
    return {"root": str(prefix), "version": version, "preload": str(prefix / "lib" / "libnccl.so.2")}


def nccl_build_env(root: str, env: Dict[str, str]) -> Dict[str, str]:
    """What V2's setup.py needs to build against the NCCL in ``root``: EP_NCCL_ROOT_DIR (its
    find_nccl_root; setup.py also writes it into deep_ep/envs.py, so the JIT finds the headers at
    run time) and the linker's search path (setup.py links ``-l:libnccl.so.2`` without ``-L``)."""
    lib = str(Path(root) / "lib")
    return {"EP_NCCL_ROOT_DIR": root,
            "LIBRARY_PATH": os.pathsep.join(p for p in (lib, env.get("LIBRARY_PATH")) if p)}


def make_torch_shim(prefix: Path) -> None:
    """torch's import preloads ``nvidia/nccl/lib/libnccl.so.*`` from the first sys.path entry
    that has one, by full path: with only LD_PRELOAD, torch's own copy is then loaded beside the
    private one (V2's import refuses two NCCL runtimes; seen on one H100, 2026-11-25). A folder
    that holds that path as a link to the private library, put first on PYTHONPATH, makes torch's
    preload name the same file (loaded once)."""
    lib = prefix / TORCH_SHIM / "nvidia" / "nccl" / "lib"
    lib.mkdir(parents=True, exist_ok=True)
    link = lib / "libnccl.so.2"
    if link.is_symlink() or link.exists():
        link.unlink()
    link.symlink_to(prefix / "lib" / "libnccl.so.2")


def v2_nccl_status() -> str:
    """Which NCCL V2 would load in an epbench run, and whether it is new enough."""
    need = ".".join(map(str, MIN_NCCL))
    nccl = v2_nccl()
    if nccl:
        have, where = str(nccl.get("version")), f"{nccl['preload']}, preloaded into deepep-v2 jobs"
    else:
        try:
            import torch

            have, where = ".".join(map(str, torch.cuda.nccl.version())), "torch's own"
        except Exception as e:
            return f"  v2 NCCL at run time: unknown (torch reports none: {' '.join(str(e).split())[:80]})"
    ok = version_tuple(have) >= MIN_NCCL
    return (f"  v2 NCCL at run time: {have} ({where}): {'>=' if ok else '<'} {need}, "
            f"{'enough' if ok else 'too old (make baselines-carry NCCL_WHEEL=..., then make baselines NCCL_CARRY=...)'}")


def source_checkout(fl: Flavor, src: Optional[str], workdir: Path, run: Runner,
                    env: Dict[str, str]) -> "tuple[Optional[Path], str]":
    """(folder at the pinned commit, '') or (None, one-line note). A given path must be a git
    checkout holding the commit (it is checked out in a scratch worktree, never modified) or an
    unpacked tarball of exactly that commit (``git archive``: a ``.epbench-commit`` file says so)."""
    if src:
        path = Path(src).expanduser()
        if not path.is_dir():
            return None, f"{fl.name}: source {src} does not exist (set DEEPEP_SRC to a DeepEP checkout)"
        stamp = path / ".epbench-commit"
        if stamp.is_file():
            got = stamp.read_text().strip()
            if got != fl.commit:
                return None, f"{fl.name}: {src} holds commit {got}, pinned is {fl.commit}"
            return path, ""
        if not (path / ".git").exists():
            return None, f"{fl.name}: {src} is neither a git checkout nor an epbench source tarball"
        if run(["git", "-C", str(path), "cat-file", "-e", f"{fl.commit}^{{commit}}"], None, env).returncode:
            return None, (f"{fl.name}: {src} lacks the pinned commit {fl.commit} "
                          f"(git -C {src} fetch origin {fl.branch})")
        # a local clone (hard links, no network) leaves the user's checkout untouched
        dest = workdir / "src"
        for cmd in (["git", "clone", "--quiet", "--no-checkout", str(path), str(dest)],
                    ["git", "-C", str(dest), "checkout", "--quiet", fl.commit]):
            p = run(cmd, None, env)
            if p.returncode:
                return None, f"{fl.name}: {' '.join(cmd[:3])} of {src} failed: {_tail(p)}"
    else:
        dest = workdir / "src"
        p = run(["git", "clone", "--quiet", "--branch", fl.branch, REPO_URL, str(dest)], None, env)
        if p.returncode:
            return None, (f"{fl.name}: cannot clone {REPO_URL} ({_tail(p)}); offline, give a "
                          f"checkout: DEEPEP_SRC=/path/to/DeepEP make baselines")
        p = run(["git", "-C", str(dest), "checkout", "--quiet", fl.commit], None, env)
        if p.returncode:
            return None, f"{fl.name}: checkout of {fl.commit} failed: {_tail(p)}"
    if fl.submodules:
        p = run(["git", "-C", str(dest), "submodule", "update", "--init", "--recursive"], None, env)
        if p.returncode:
            return None, f"{fl.name}: git submodule update failed (fmt): {_tail(p)}"
    return dest, ""


def carry_source(fl: Flavor, src: str, out: Path, submodule_srcs: Dict[str, str],
                 run: Runner = _run) -> str:
    """Writes ``out`` (a .tar.gz): the flavor's pinned commit from the git repository ``src``
    (a checkout or a bare clone), its submodules at the commits it pins (each from
    ``submodule_srcs[path]``, else ``src/path``), and ``.epbench-commit``. Returns one line."""
    env = dict(os.environ)
    p = run(["git", "-C", src, "ls-tree", "-r", fl.commit], None, env)
    if p.returncode:
        return f"{fl.name}: {src} lacks the pinned commit {fl.commit} ({_tail(p)})"
    # a submodule is a tree entry of mode 160000: "<mode> commit <sha>\t<path>"
    subs = [(ln.split("\t", 1)[1], ln.split()[2]) for ln in (p.stdout or "").splitlines()
            if ln.startswith("160000 ")]
    # a flavor whose intranode build needs none of its submodules carries none (hybrid-ep's
    # third-party/nccl is read only by its multinode build)
    left_out = [] if fl.submodules else [path for path, _ in subs]
    subs = subs if fl.submodules else []
    with tempfile.TemporaryDirectory(prefix="epbench-carry-") as tmp:
        tar = Path(tmp) / "src.tar"
        parts = [(src, fl.commit, "")] + [
            (submodule_srcs.get(path, os.path.join(src, path)), commit, f"{path}/") for path, commit in subs]
        for repo, commit, prefix in parts:
            cmd = ["git", "-C", repo, "archive", "--format=tar", f"--output={tar}.part"]
            p = run(cmd + ([f"--prefix={prefix}"] if prefix else []) + [commit], None, env)
            if p.returncode:
                what = f"submodule {prefix[:-1]} at {commit[:12]} from {repo}" if prefix else f"{src}"
                return (f"{fl.name}: git archive of {what} failed ({_tail(p)})"
                        + ("; give its checkout: SUBMODULE_SRC=<path>=<git repo>" if prefix else ""))
            p = run(["tar", "-xf", f"{tar}.part", "-C", tmp], None, env)
            if p.returncode:
                return f"{fl.name}: unpacking the archive of {prefix or src} failed ({_tail(p)})"
            os.unlink(f"{tar}.part")
        Path(tmp, ".epbench-commit").write_text(fl.commit + "\n")
        out.parent.mkdir(parents=True, exist_ok=True)
        p = run(["tar", "-czf", str(out.absolute()), "-C", tmp, "."], None, env)
        if p.returncode:
            return f"{fl.name}: writing {out} failed ({_tail(p)})"
    extra = f" with {', '.join(path for path, _ in subs)}" if subs else ""
    extra += f"; left out {', '.join(left_out)} (not read by the intranode build)" if left_out else ""
    return f"wrote {out} ({fl.name} at {fl.commit[:12]}{extra}, {out.stat().st_size / 2**20:.1f} MiB)"


def _folder(venv_python: str, stamp_dir: Optional[Path]) -> Path:
    """Where the build stamp and logs go: the venv of ``venv_python`` (not resolved: a venv's
    python is a link to the base interpreter, and epbench/provenance.py reads the stamp from sys.prefix)."""
    return stamp_dir if stamp_dir is not None else Path(venv_python).absolute().parent.parent


def _keep_log(p: Any, venv_python: str, name: str, stamp_dir: Optional[Path]) -> Optional[Path]:
    """The whole build output beside the stamp, so the one-line note can point at the compiler's
    own error; None where it cannot be written."""
    folder = _folder(venv_python, stamp_dir)
    path = folder / f"epbench-baselines-{name}.log"
    try:
        path.write_text((p.stdout or "") + (p.stderr or ""))
    except OSError:
        return None
    return path


def build(name: str, src: Optional[str], venv_python: str = sys.executable,
          run: Runner = _run, env: Optional[Dict[str, str]] = None,
          stamp_dir: Optional[Path] = None, nccl_carry: Optional[str] = None,
          registry: Optional[Path] = None) -> str:
    """Builds one flavor; returns one line (what was installed, or the step that failed).
    ``nccl_carry`` (v2): a tarball from ``carry_nccl``, unpacked into the venv and built against.
    A venv that got its flavor is recorded in ``registry`` (epbench/flavors.py), so a run from
    any venv starts that flavor's backend from it."""
    fl = flavor(name)
    env = build_env(dict(os.environ) if env is None else env)
    nccl: Dict[str, str] = {}
    if nccl_carry:
        if fl.name != "v2":
            return f"{fl.name}: NCCL_CARRY is for the v2 flavor only"
        got = unpack_nccl(Path(nccl_carry), _folder(venv_python, stamp_dir) / NCCL_PREFIX)
        if isinstance(got, str):
            return f"{fl.name}: {got}"
        nccl = got
        env.update(nccl_build_env(nccl["root"], env))
    with tempfile.TemporaryDirectory(prefix="epbench-baseline-") as tmp:
        path, note = source_checkout(fl, src, Path(tmp), run, env)
        if path is None:
            return note
        p = run([venv_python, "-m", "pip", "install", "--no-build-isolation", "--no-deps", str(path)],
                None, env)
        if p.returncode:
            log = _keep_log(p, venv_python, fl.name, stamp_dir)
            return f"{fl.name}: pip install (the CUDA build) failed: {_tail(p)}" + (f" (full log: {log})" if log else "")
    check = (f"import deep_ep, importlib.metadata as m; deep_ep.{fl.provides}; "
             f"print(getattr(deep_ep, '__version__', None) or m.version('deep_ep'))")
    check_env = dict(env, **preload_env(nccl["preload"], env)) if nccl else env
    p = run([venv_python, "-c", check], None, check_env)
    if p.returncode:
        return f"{fl.name}: built, but import deep_ep.{fl.provides} failed: {_tail(p)}"
    stale = _folder(venv_python, stamp_dir) / f"epbench-baselines-{fl.name}.log"
    if stale.exists():
        stale.unlink()  # an earlier failure's log would contradict this build
    stamp = {"flavor": fl.name, "commit": fl.commit, "branch": fl.branch,
             "version": (p.stdout or "").strip(), "source": src or REPO_URL,
             "torch_cuda_arch_list": env.get("TORCH_CUDA_ARCH_LIST"),
             "nvshmem_dir": env.get("NVSHMEM_DIR"),
             "libstdcxx_shim": env.get(LIBSTDCXX_SHIM_ENV)}
    if nccl:
        stamp["nccl"] = nccl  # root, version, preload: what deepep-v2 jobs load (deepep_v2_env.job_env)
    static = static_cxx_runtime(venv_python, run, env)
    if static:
        stamp["static_cxx_runtime"] = static  # libstdcxx_link_dir's warning, not a failure
    folder = _folder(venv_python, stamp_dir)
    try:
        (folder / STAMP).write_text(json.dumps(stamp, indent=1) + "\n")
    except OSError as e:
        return f"{fl.name}: installed deep_ep {stamp['version']}, but cannot record it: {e}"
    warn = (f"; warning: {', '.join(static)} carry a static C++ runtime (libstdc++.a), which "
            f"crashed Hybrid-EP beside torch's shared one") if static else ""
    if stamp_dir is None:  # a real venv: runs from any venv of this checkout start its jobs there
        try:
            flavors.record(fl.name, venv_python, registry)
        except OSError as e:
            warn += f"; warning: cannot record the venv for later runs ({e})"
    return f"{fl.name}: installed deep_ep {stamp['version']} at {fl.commit[:12]}{warn}"


EXTENSIONS = ("deep_ep_cpp", "hybrid_ep_cpp")  # the compiled modules the flavors install


def static_cxx_runtime(venv_python: str, run: Runner, env: Dict[str, str]) -> List[str]:
    """The installed extension modules that do not load libstdc++.so.6 (no DT_NEEDED entry:
    ``readelf -d``), i.e. that had libstdc++.a linked in; [] where all do or readelf is missing."""
    find = ("import importlib.util as u\n"
            f"for m in {EXTENSIONS!r}:\n"
            "    s = u.find_spec(m)\n"
            "    print(s.origin) if s and s.origin else None")
    p = run([venv_python, "-c", find], None, env)
    out = []
    for path in (p.stdout or "").split():
        try:
            d = run(["readelf", "-d", path], None, env)
        except OSError:
            return []
        if d.returncode == 0 and "libstdc++.so" not in (d.stdout or ""):
            out.append(Path(path).name)
    return out


def status() -> List[str]:
    lines = []
    v = provenance.baseline_versions()
    build_info = v.get("deep_ep_build")
    if isinstance(build_info, dict):
        lines.append(f"deep_ep: flavor {build_info.get('flavor')} at {build_info.get('commit')} "
                     f"(version {build_info.get('version')})")
    elif "deep_ep" in v:
        lines.append(f"deep_ep {v['deep_ep']}: installed by hand (no build stamp, commit unknown)")
    else:
        lines.append("deep_ep: not installed (make baselines [DEEPEP_SRC=/path/to/DeepEP])")
    for fl in FLAVORS.values():
        lines.append(f"  {fl.name}: pinned {fl.commit} ({fl.branch}); needs {fl.needs}")
    venvs = flavors.recorded()
    for name, python in sorted(venvs.items()):
        held = flavors.stamp_of(python).get("flavor")
        state = "ok" if held == name else f"its venv now holds {held or 'no flavor'}: not used"
        lines.append(f"  runs start {name}'s backend from {python} ({state})")
    if not venvs:
        lines.append("  no venv recorded per flavor: every backend runs in this venv "
                     "(make baselines VENV=<venv> DEEPEP_FLAVOR=<flavor> records one)")
    lines.append(v2_nccl_status())
    return lines


def parse_args(argv: Optional[List[str]]) -> argparse.Namespace:
    ap = toolcli.Parser("baselines", prog="python tools/baselines.py", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build")
    b.add_argument("--flavor", default=os.environ.get("DEEPEP_FLAVOR", "v1"))
    b.add_argument("--src", default=None, help="a DeepEP checkout (default: $HYBRID_EP_SRC for "
                   "hybrid-ep, else $DEEPEP_SRC; neither: clone)")
    b.add_argument("--nccl", default=os.environ.get("NCCL_CARRY") or None,
                   help="v2: an NCCL carry (.tar.xz from `carry --nccl-wheel`) to build and run with")
    c = sub.add_parser("carry", help="write the source (and NCCL) tarballs for a host without network")
    c.add_argument("--flavor", default=os.environ.get("DEEPEP_FLAVOR", "v1"))
    c.add_argument("--src", required=True, help="a DeepEP git repository holding the pinned commit")
    c.add_argument("--out", default=".whl", help="folder for the tarballs (default .whl)")
    c.add_argument("--submodule", action="append", default=[], metavar="PATH=REPO",
                   help="a git repository for a submodule (default: SRC/PATH)")
    c.add_argument("--nccl-wheel", default=None, help="v2: an nvidia-nccl-cu13 wheel to prune and pack")
    c.add_argument("--arch", type=int, default=90, help="the GPU architecture the NCCL carry keeps (90: H100/H200)")
    sub.add_parser("status")
    return ap.parse_args(argv)


def main(argv: Optional[List[str]] = None) -> int:
    return toolcli.run("baselines", parse_args, command, argv)


def command(args: argparse.Namespace) -> int:
    if args.cmd == "status":
        print("\n".join(status()))
        return 0
    if args.cmd == "carry":
        return carry(args)
    src = args.src or (args.flavor == "hybrid-ep" and os.environ.get("HYBRID_EP_SRC")) \
        or os.environ.get("DEEPEP_SRC") or None
    print(build(args.flavor, src, nccl_carry=args.nccl))
    return 0


def carry(args: Any) -> int:
    """``carry``: the flavor's source tarball, and for v2 with a wheel the NCCL tarball. Unlike
    ``build`` this runs where the user prepares a carry, so a failure is exit code 1."""
    fl = flavor(args.flavor)
    subs = {}
    for item in args.submodule:
        if "=" not in item:
            raise UserError(f"--submodule {item!r}: expected PATH=REPO")
        path, repo = item.split("=", 1)
        subs[path.strip("/")] = repo
    out = Path(args.out)
    lines = [carry_source(fl, args.src, out / f"deepep-{fl.name}-src.tar.gz", subs)]
    if args.nccl_wheel:
        if fl.name != "v2":
            raise UserError("--nccl-wheel: only the v2 flavor needs its own NCCL")
        lines.append(carry_nccl(Path(args.nccl_wheel), out / NCCL_CARRY, args.arch))
    print("\n".join(lines))
    return 0 if all(ln.startswith("wrote ") for ln in lines) else 1


if __name__ == "__main__":
    sys.exit(main())
