"""Builds the external baselines (DeepEP and its branches) into the venv at pinned commits.

DeepEP V1, DeepEP V2 (main) and Hybrid-EP (the hybrid-ep branch) all install as the Python
package ``deep_ep``, so one venv holds one *flavor* at a time; V2's and Hybrid-EP's packages keep
V1's ``Buffer`` beside their own class, so the ``deepep`` backend runs with any of them. No
third-party source lives in this repository: a flavor is a commit string, built from a checkout
given by path (``DEEPEP_SRC``) or cloned when the hosting site can be reached.

Every failure is a one-line note naming the step; ``build`` returns 0 all the same, so that
``make run`` and ``make test`` never depend on a baseline building. What was built is written to
``<venv>/epbench-baselines.json`` and recorded in every result's meta.json (``versions``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence

REPO_URL = "https://github.com/deepseek-ai/DeepEP.git"
STAMP = "epbench-baselines.json"


@dataclass(frozen=True)
class Flavor:
    name: str
    commit: str  # pinned; a checkout at another commit is refused
    branch: str
    provides: str  # the class the flavor's own backend needs from deep_ep
    needs: str  # what the build and run need, for the README and the notes
    submodules: bool = False  # main vendors fmt as a git submodule


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
    from epbench.errors import UserError

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


def cccl_include(env: Dict[str, str]) -> Optional[str]:
    """The CUDA toolkit's include/cccl folder (CUDA 13 and later), or None."""
    import shutil

    roots = [env.get("CUDA_HOME"), env.get("CUDA_PATH")]
    nvcc = shutil.which("nvcc", path=env.get("PATH"))
    if nvcc:
        roots.append(str(Path(nvcc).resolve().parent.parent))
    for root in filter(None, roots):
        folder = Path(root) / "include" / "cccl"
        if (folder / "cuda" / "std").is_dir():
            return str(folder)
    return None


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


def _folder(venv_python: str, stamp_dir: Optional[Path]) -> Path:
    """Where the build stamp and logs go: the venv of ``venv_python`` (not resolved: a venv's
    python is a link to the base interpreter, and versions() reads sys.prefix)."""
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
          stamp_dir: Optional[Path] = None) -> str:
    """Builds one flavor; returns one line (what was installed, or the step that failed)."""
    fl = flavor(name)
    env = build_env(dict(os.environ) if env is None else env)
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
    p = run([venv_python, "-c", check], None, env)
    if p.returncode:
        return f"{fl.name}: built, but import deep_ep.{fl.provides} failed: {_tail(p)}"
    stale = _folder(venv_python, stamp_dir) / f"epbench-baselines-{fl.name}.log"
    if stale.exists():
        stale.unlink()  # an earlier failure's log would contradict this build
    stamp = {"flavor": fl.name, "commit": fl.commit, "branch": fl.branch,
             "version": (p.stdout or "").strip(), "source": src or REPO_URL,
             "torch_cuda_arch_list": env.get("TORCH_CUDA_ARCH_LIST"),
             "nvshmem_dir": env.get("NVSHMEM_DIR")}
    folder = _folder(venv_python, stamp_dir)
    try:
        (folder / STAMP).write_text(json.dumps(stamp, indent=1) + "\n")
    except OSError as e:
        return f"{fl.name}: installed deep_ep {stamp['version']}, but cannot record it: {e}"
    return f"{fl.name}: installed deep_ep {stamp['version']} at {fl.commit[:12]}"


def stamp_path() -> Path:
    return Path(sys.prefix) / STAMP


def versions() -> Dict[str, object]:
    """What the baselines in this environment are, for meta.json: the build stamp (flavor,
    commit) and the versions the packages report. Never raises."""
    import importlib.metadata as md

    out: Dict[str, object] = {}
    try:
        out["deep_ep_build"] = json.loads(stamp_path().read_text())
    except (OSError, ValueError):
        pass
    for dist in ("deep_ep", "nvidia-nvshmem-cu13", "nvidia-nccl-cu13"):
        try:
            out[dist] = md.version(dist)
        except md.PackageNotFoundError:
            pass
    return out


def status() -> List[str]:
    lines = []
    v = versions()
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
    return lines


def main(argv: Optional[List[str]] = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m epbench.baselines")
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build")
    b.add_argument("--flavor", default=os.environ.get("DEEPEP_FLAVOR", "v1"))
    b.add_argument("--src", default=None, help="a DeepEP checkout (default: $HYBRID_EP_SRC for "
                   "hybrid-ep, else $DEEPEP_SRC; neither: clone)")
    sub.add_parser("status")
    args = ap.parse_args(argv)
    if args.cmd == "status":
        print("\n".join(status()))
        return 0
    from epbench.errors import UserError

    try:
        src = args.src or (args.flavor == "hybrid-ep" and os.environ.get("HYBRID_EP_SRC")) \
            or os.environ.get("DEEPEP_SRC") or None
        print(build(args.flavor, src))
    except UserError as e:
        print(e)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
