"""Fidelity check (docs/fidelity.md): does each baseline run as fast in epbench
as in its authors' own benchmark, on the same machine and shape?

For each library: (1) its own benchmark, unmodified, on the shape, from the library's own venv
and source tree, its figures read from what it prints (tools/fidelity_parse.py); (2) epbench's
adapter for it through the normal CLI (``python -m epbench run``) in the same venv, on the same
shape and SM counts, its rows read back with epbench's own reader (epbench/results.py); (3) one
table side by side, the ratio epbench / own taken on the same statistic, flagged above 1.10.
Everything raw (commands, logs, parsed figures, the epbench results folders) goes into
``<results>/<time>_fidelity_<scenario>_w<world>/``, fidelity.json first; ``--report FOLDER...``
prints one table from earlier checks.

    python tools/fidelity.py --scenario scenarios/dsv3x4.yaml --sms 8,16,24,32 \\
        --venv v1=/tmp/venv-v1 --src v1=/tmp/deepep-v1 --venv v2=/tmp/venv-v2 --src v2=/tmp/deepep-v2 \\
        --venv hybrid-ep=/tmp/venv-hep --src hybrid-ep=/tmp/deepep-hep

Libraries: ``v1`` (DeepEP V1, backend deepep), ``v2`` (DeepEP V2, backend deepep-v2),
``hybrid-ep``, and three without an MoE benchmark of their own, whose plainest call
tools/fidelity_calls.py times alone: ``reference`` (NCCL; with the reference backend's phases),
``symm-mem`` (torch's all_to_all_vdev; with the symm-mem backend's phases) and ``flashinfer``
(MoeAlltoAll). Exit code 0: every library that could run ran, verified, within 10 %; 1: a run
failed, a row was wrong or a ratio is flagged; 2: bad input (one line).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

REPO = Path(__file__).resolve().parent.parent
TOOLS = Path(__file__).resolve().parent
for _p in (str(REPO), str(TOOLS)):
    if _p not in sys.path:
        sys.path.insert(0, _p)

import yaml  # noqa: E402

import baselines  # noqa: E402
import fidelity_parse as fp  # noqa: E402
import toolcli  # noqa: E402
from epbench import scenario  # noqa: E402
from epbench.backends.deepep_v2_env import preload_env  # noqa: E402
from epbench.errors import UserError  # noqa: E402

FLAG_RATIO = 1.10  # STYLE.md: a difference over 10 % is found and said
OPS = ("dispatch", "combine")
DTYPES = ("bf16", "fp8")  # what the libraries' own benchmarks time (no mxfp8 there)
# variables that would make a library's init_dist read the job as several nodes (its WORLD_SIZE /
# RANK mean nodes and node rank) or point it at another job's rendezvous
SCRUB_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK",
             "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID")


@dataclass(frozen=True)
class Library:
    name: str
    backend: str  # epbench's backend for it
    flavor: Optional[str]  # tools/baselines.py flavor whose venv and source it needs (None: none)
    script: Optional[str]  # its own benchmark, relative to the source tree
    sms: str  # how SM counts reach it: "sweep" (--sms) or "none"
    min_world: int = 1  # ranks it needs
    # python code that exits 0 where the venv can run the library (None: nothing to check), and
    # what the not-run line says otherwise ({venv}: the venv)
    probe: Optional[str] = None
    missing: str = ""


PROBE_SYMM = ("import sys, torch.distributed._symmetric_memory as m; "
              "sys.exit(0 if m.is_nvshmem_available() else 1)")
PROBE_FLASHINFER = "import importlib.util, sys; sys.exit(importlib.util.find_spec('flashinfer') is None)"
LIBRARIES: Dict[str, Library] = {lib.name: lib for lib in (
    Library("reference", "reference", None, None, "none"),
    Library("v1", "deepep", "v1", "tests/test_intranode.py", "sweep"),
    Library("v2", "deepep-v2", "v2", "tests/elastic/test_ep.py", "sweep"),
    Library("hybrid-ep", "hybrid-ep", "hybrid-ep", "tests/test_hybrid_ep.py", "sweep"),
    Library("symm-mem", "symm-mem", None, None, "none", min_world=2, probe=PROBE_SYMM,
            missing="torch's NVSHMEM is not usable in {venv} (symm_mem.is_nvshmem_available() is False)"),
    Library("flashinfer", "flashinfer", None, None, "none", probe=PROBE_FLASHINFER,
            missing="flashinfer is not installed in {venv}: make baselines-wheels, then make baselines-install "
                    "WHEELS=.whl/flashinfer-deps and WHEELS=.whl/flashinfer"),
)}
CALLS_TIMED = ("reference", "symm-mem", "flashinfer")  # their figure: tools/fidelity_calls.py
PHASED = ("reference", "symm-mem")  # ... followed by their epbench backend, phase by phase
PHASE_TITLES = {"reference": "reference (NCCL)", "symm-mem": "symm-mem (torch all_to_all_vdev)"}
ALIASES = {"deepep": "v1", "deepep-v2": "v2", "nccl": "reference", "hep": "hybrid-ep"}


# ---- input --------------------------------------------------------------------------------------

def library_names(text: str) -> List[str]:
    names = []
    for raw in (t.strip() for t in text.split(",")):
        if not raw:
            continue
        name = ALIASES.get(raw, raw)
        if name not in LIBRARIES:
            raise UserError(f"--libraries: unknown library {raw!r} (known: {', '.join(LIBRARIES)}; "
                            f"also {', '.join(f'{a}={n}' for a, n in ALIASES.items())})")
        if name in names:
            raise UserError(f"--libraries: {raw!r} is listed twice")
        names.append(name)
    if not names:
        raise UserError("--libraries: name at least one library")
    return names


def pairs(items: Sequence[str], option: str) -> Dict[str, str]:
    """``--venv v1=/tmp/venv-v1`` (repeatable, or several separated by spaces) -> {v1: path}."""
    out: Dict[str, str] = {}
    for item in (t for i in items for t in i.split()):
        if "=" not in item:
            raise UserError(f"{option} {item!r}: expected LIBRARY=PATH, e.g. v1=/tmp/venv-v1")
        key, path = item.split("=", 1)
        name = ALIASES.get(key.strip(), key.strip())
        if name not in LIBRARIES:
            raise UserError(f"{option} {item!r}: unknown library {key!r} (known: {', '.join(LIBRARIES)})")
        if not path:
            raise UserError(f"{option} {item!r}: no path after '='")
        out[name] = path
    return out


@dataclass(frozen=True)
class Shape:
    hidden: int
    tokens: int
    topk: int
    experts: int  # all experts, over the world
    world: int

    @property
    def experts_per_rank(self) -> int:
        return self.experts // self.world


def gpu_count(timeout: float = 30.0) -> int:
    """GPUs that nvidia-smi lists, no more than CUDA_VISIBLE_DEVICES names (0 where nvidia-smi is
    missing or fails)."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return 0
    try:
        p = subprocess.run([exe, "-L"], capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired):
        return 0
    listed = sum(1 for ln in p.stdout.splitlines() if ln.startswith("GPU ")) if p.returncode == 0 else 0
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        listed = min(listed, len([d for d in visible.split(",") if d.strip()]))
    return listed


def shape_of(s: scenario.Scenario, args: argparse.Namespace, gpus: int) -> Tuple[Shape, List[str]]:
    """The shape: the scenario's, each value overridden by its option; the world defaults to the
    scenario's, cut to the GPUs there are (one rank per GPU: NCCL and DeepEP V2 refuse more).
    The experts stay all of the model's (256 for DeepSeek-V3), spread over the world."""
    notes = []
    m = s.model
    world = args.world
    if world is None:
        world = s.world
        if args.device == "cuda" and 0 < gpus < world:
            notes.append(f"world {gpus} (this host's GPUs), not the scenario's {s.world}: one rank per GPU")
            world = gpus
    elif world < 1:
        raise UserError(f"--world: must be positive, got {world}")
    elif args.device == "cuda" and gpus and world > gpus:
        raise UserError(f"--world {world}: this host has {gpus} GPUs (one rank per GPU)")
    experts = args.experts if args.experts is not None else s.num_experts
    sh = Shape(args.hidden or m.hidden, args.tokens or m.tokens_per_rank, args.topk or m.topk, experts, world)
    if min(sh.hidden, sh.tokens, sh.topk, sh.experts) < 1:
        raise UserError(f"shape: hidden, tokens, topk and experts must be positive, got {sh}")
    if sh.experts % world:
        raise UserError(f"--experts {sh.experts}: must be a multiple of the world ({world})")
    if sh.topk > sh.experts:
        raise UserError(f"--topk {sh.topk}: more than the {sh.experts} experts")
    return sh, notes


def scenario_data(s: scenario.Scenario, sh: Shape, dtype: str, sms: Sequence[int], warmup: int,
                  iters: int, device: str) -> Dict[str, Any]:
    """The scenario file both sides run: the shape on one node, one rank per GPU."""
    return {
        "name": s.name,
        "description": f"fidelity check: {s.name} shape, hidden {sh.hidden}, {sh.tokens} tokens/rank, "
                       f"top-{sh.topk} of {sh.experts} experts, {sh.world} ranks, {dtype}",
        "model": {"hidden": sh.hidden, "tokens_per_rank": sh.tokens, "topk": sh.topk,
                  "experts_per_rank": sh.experts_per_rank, "dispatch_dtype": dtype},
        "topology": {"name": f"{sh.world} GPUs of one node", "nodes": 1, "gpus_per_node": sh.world,
                     "nvlink_gbps": s.topology.nvlink_gbps},
        "routing": {"kind": s.routing.kind, "seed": s.routing.seed, "zipf_exponent": s.routing.zipf_exponent,
                    "hot_fraction": s.routing.hot_fraction, "hot_multiplier": s.routing.hot_multiplier},
        "bench": {"warmup": warmup, "iters": iters, "backends": ["reference"], "sms": list(sms),
                  "device": device, "timeout_s": s.bench.timeout_s},
    }


# ---- the libraries' venvs and sources -----------------------------------------------------------

@dataclass
class Target:
    """One library as it will run: its venv's python, its build stamp, its test folder."""

    lib: Library
    python: Optional[str] = None
    venv: Optional[str] = None
    stamp: Dict[str, Any] = field(default_factory=dict)
    src: Optional[str] = None
    src_kind: str = ""  # "tarball" (an unpacked carry) | "git"
    not_run: Optional[str] = None  # why it does not run (one line)


def read_stamp(venv: Path) -> Dict[str, Any]:
    try:
        data = json.loads((venv / baselines.STAMP).read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def venv_python(venv: Path) -> Optional[Path]:
    for name in ("python", "python3"):
        p = venv / "bin" / name
        if p.exists():
            return p
    return None


def _given_path(option: str, name: str, path: Optional[str], if_present: bool,
                there: Callable[[Path], bool]) -> Tuple[Optional[str], str]:
    """(path, "") where it was given and is there, (None, "") where none was given; a given path
    that is not there is bad input, unless ``if_present``: then (None, why) and the defaults apply."""
    if path is None or there(Path(path).expanduser()):
        return path, ""
    if not if_present:
        raise UserError(f"{option} {name}={path}: no such folder")
    return None, f"{path} does not exist"


def resolve(lib: Library, venvs: Dict[str, str], srcs: Dict[str, str], if_present: bool,
            run_git: Callable[[List[str]], int]) -> Target:
    """Where ``lib`` runs from, or why it does not (``not_run``, one line). A path given but absent,
    or a venv without a python, is bad input (a UserError), unless ``if_present``: then an absent
    path counts as not given (the defaults below apply). A venv that holds no build of the library's
    flavor, or a source at another commit, leaves the library not run: the others still run."""
    t = Target(lib)
    own_prefix = Path(sys.prefix)
    given, missing = _given_path("--venv", lib.name, venvs.get(lib.name), if_present, Path.exists)
    if given is None:
        if lib.flavor is not None and read_stamp(own_prefix).get("flavor") != lib.flavor:
            t.not_run = (f"no venv ({missing or 'none given'}; --venv {lib.name}=PATH: a venv built by "
                         f"make baselines DEEPEP_FLAVOR={lib.flavor})")
            return t
        # this tool's own environment: the reference runs anywhere, a flavor where it was built here
        venv, t.python = own_prefix, sys.executable
    else:
        venv = Path(given).expanduser()
        py = venv_python(venv)
        if py is None:
            raise UserError(f"--venv {lib.name}={venv}: not a virtual environment (no bin/python)")
        t.python = str(py.absolute())
    t.venv = str(venv.absolute())
    if lib.flavor is None:
        return t
    t.stamp = read_stamp(venv)
    got = t.stamp.get("flavor")
    if got != lib.flavor:
        held = f"holds flavor {got}" if got else f"has no DeepEP build ({baselines.STAMP})"
        t.not_run = f"venv {venv} {held}: make baselines VENV={venv} DEEPEP_FLAVOR={lib.flavor}"
        return t
    src, missing = _given_path("--src", lib.name, srcs.get(lib.name), if_present, Path.is_dir)
    if src is None:
        built_from = str(t.stamp.get("source") or "")
        if not (built_from and Path(built_from).is_dir()):
            t.not_run = (f"no source ({missing or 'none given'}; --src {lib.name}=PATH: a DeepEP checkout "
                         f"or an unpacked make baselines-carry tarball)")
            return t
        src = built_from  # the source the venv was built from (make baselines DEEPEP_SRC=...)
    path = Path(src).expanduser()
    pin = baselines.FLAVORS[lib.flavor].commit
    stamp_file = path / ".epbench-commit"
    if stamp_file.is_file():
        got = stamp_file.read_text().strip()
        if got != pin:
            t.not_run = f"source {src} holds commit {got[:12]}, {lib.name} is pinned at {pin[:12]}"
            return t
        if not (path / lib.script).is_file():
            t.not_run = f"source {src} has no {lib.script}"
            return t
        t.src_kind = "tarball"
    elif run_git(["git", "-C", str(path), "cat-file", "-e", f"{pin}^{{commit}}"]) == 0:
        t.src_kind = "git"
    else:
        t.not_run = (f"source {src} is neither an unpacked make baselines-carry tarball (.epbench-commit) "
                     f"nor a git repository holding {pin[:12]}")
        return t
    t.src = str(path.absolute())
    return t


def tests_folder(t: Target, dest: Path, run: "Runner", timeout: float) -> Tuple[Optional[Path], str]:
    """The source tree whose tests/ holds the library's script at the pinned commit: the unpacked
    tarball itself, or tests/ taken out of the git repository at the pin into ``dest`` (the
    repository is never modified)."""
    if t.src_kind == "tarball":
        return Path(t.src), ""
    pin = baselines.FLAVORS[t.lib.flavor].commit
    dest.mkdir(parents=True, exist_ok=True)
    tar = dest / "tests.tar"
    r = run(Step(f"{t.lib.name}: tests/ at {pin[:12]}", ["git", "-C", t.src, "archive", "--format=tar",
                                                          f"--output={tar}", pin, "tests"]), timeout)
    if r.returncode != 0:
        return None, f"git archive of tests/ at {pin[:12]} from {t.src} failed: {r.last_line()}"
    r = run(Step(f"{t.lib.name}: unpack tests/", ["tar", "-xf", str(tar), "-C", str(dest)]), timeout)
    if r.returncode != 0:
        return None, f"unpacking tests/ failed: {r.last_line()}"
    tar.unlink(missing_ok=True)
    if not (dest / t.lib.script).is_file():
        return None, f"{t.lib.script} is not in {t.src} at {pin[:12]}"
    return dest, ""


# ---- commands -----------------------------------------------------------------------------------

@dataclass
class Step:
    label: str
    cmd: List[str]
    env: Dict[str, str] = field(default_factory=dict)  # added to the tool's environment
    cwd: Optional[str] = None
    sms: Optional[int] = None  # the SM count of a one-count step (v2, hybrid-ep)
    dtype: Optional[str] = None
    out_json: Optional[str] = None  # a step that writes its figures to a file (the NCCL timer)
    results: Optional[str] = None  # an epbench step's --results folder

    def shown(self) -> str:
        env = " ".join(f"{k}={v}" for k, v in sorted(self.env.items()) if k not in ("PYTHONPATH", "LD_PRELOAD"))
        return (env + " " if env else "") + " ".join(self.cmd)


@dataclass
class Ctx:
    """What every library's steps are made from."""

    shape: Shape
    sms: Tuple[int, ...]
    dtypes: Tuple[str, ...]
    scenario_files: Dict[str, str]  # dtype -> the scenario YAML both sides run
    out: Path
    warmup: int
    iters: int
    device: str = "cuda"
    input_sets: Optional[int] = None
    port: Callable[[], int] = field(default=lambda: free_port())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _their_shape_args(sh: Shape) -> List[str]:
    return ["--num-processes", str(sh.world), "--num-tokens", str(sh.tokens), "--hidden", str(sh.hidden),
            "--num-topk", str(sh.topk), "--num-experts", str(sh.experts)]


def v2_env(stamp: Dict[str, Any]) -> Dict[str, str]:
    """V2 within one node without RDMA NICs needs Gin off (its EP_DISABLE_GIN=1), and the NCCL it
    was built against where that is a private one (the venv's stamp; tools/baselines.py)."""
    env = {"EP_DISABLE_GIN": "1"}
    nccl = stamp.get("nccl") if isinstance(stamp.get("nccl"), dict) else None
    if nccl and Path(str(nccl.get("preload"))).is_file():
        env.update(preload_env(str(nccl["preload"]), dict(os.environ)))
    return env


def own_steps(t: Target, tests_root: Optional[Path], ctx: Ctx) -> List[Step]:
    """The library's own benchmark, as commands: one for all SM counts (v1), one per SM count
    (v2, hybrid-ep), one per dtype (reference, symm-mem, flashinfer: tools/fidelity_calls.py)."""
    sh, lib = ctx.shape, t.lib
    rendezvous = {"MASTER_ADDR": "127.0.0.1"}
    if lib.name in CALLS_TIMED:
        what = {"reference": "NCCL all_to_all_single and the reference's phases",
                "symm-mem": "torch all_to_all_vdev and the symm-mem backend's phases",
                "flashinfer": "MoeAlltoAll dispatch / combine"}[lib.name]
        steps = []
        for dt in ctx.dtypes:
            out = str(ctx.out / "own" / f"{lib.name}-{dt}.json")
            cmd = [t.python, str(TOOLS / "fidelity_calls.py"), "--library", lib.name, "--scenario",
                   ctx.scenario_files[dt], "--warmup", str(ctx.warmup), "--iters", str(ctx.iters),
                   "--device", ctx.device, "--out", out]
            if ctx.input_sets is not None and lib.name in PHASED:
                cmd += ["--input-sets", str(ctx.input_sets)]
            steps.append(Step(f"{lib.name}: {what} ({dt})", cmd, env=dict(rendezvous, MASTER_PORT=str(ctx.port())),
                              cwd=str(REPO), dtype=dt, out_json=out))
        return steps
    assert tests_root is not None
    if lib.name == "v1":
        return [Step("v1: tests/test_intranode.py's test_main per SM count",
                     [t.python, str(TOOLS / "fidelity_own.py"), "v1", "--tests", str(tests_root / "tests"),
                      "--sms", ",".join(map(str, ctx.sms)), "--"] + _their_shape_args(sh),
                     env=dict(rendezvous, MASTER_PORT=str(ctx.port())), cwd=str(ctx.out))]
    if lib.name == "v2":
        modes = [",".join(map(str, m)) for m in fp.v2_modes(list(ctx.dtypes))]
        return [Step(f"v2: tests/elastic/test_ep.py at {n} SMs",
                     [t.python, str(TOOLS / "fidelity_own.py"), "v2", "--tests", str(tests_root / "tests" / "elastic")]
                     + [a for m in modes for a in ("--mode", m)] + ["--"] + _their_shape_args(sh)
                     + ["--num-sms", str(n)],
                     env=dict(v2_env(t.stamp), **rendezvous, MASTER_PORT=str(ctx.port())), cwd=str(ctx.out), sms=n)
                for n in ctx.sms]
    # hybrid-ep: its script as it is; the shape and SM counts through its environment variables
    return [Step(f"hybrid-ep: tests/test_hybrid_ep.py at {n} SMs",
                 [t.python, str(tests_root / "tests" / "test_hybrid_ep.py"), "--num-processes", str(sh.world)],
                 env=dict(rendezvous, MASTER_PORT=str(ctx.port()), HIDDEN_DIM=str(sh.hidden),
                          MAX_NUM_OF_TOKENS_PER_RANK=str(sh.tokens), NUM_TOKENS_PER_RANK=str(sh.tokens),
                          NUM_LOCAL_EXPERTS=str(sh.experts_per_rank), TOPK=str(sh.topk),
                          NUM_SMS_DISPATCH=str(n), NUM_SMS_COMBINE=str(n)),
                 cwd=str(ctx.out), sms=n)
            for n in ctx.sms]


def epbench_steps(t: Target, ctx: Ctx) -> List[Step]:
    """epbench's adapter for the library, through the normal CLI, per dtype (and per SM count
    where the backend takes its count as an option): each into a fresh --results folder."""
    lib = t.lib
    steps = []
    for dt in ctx.dtypes:
        base = [t.python, "-m", "epbench", "run", ctx.scenario_files[dt], "--backends", lib.backend,
                "--call-modes", "kernel,call", "--warmup", str(ctx.warmup), "--iters", str(ctx.iters),
                "--no-ceilings", "--device", ctx.device]
        if ctx.input_sets is not None:
            base += ["--input-sets", str(ctx.input_sets)]
        folder = ctx.out / "epbench" / lib.name / dt
        if lib.sms == "sweep":
            steps.append(Step(f"{lib.name}: epbench {lib.backend} ({dt})",
                              base + ["--sms", ",".join(map(str, ctx.sms)), "--results", str(folder)],
                              cwd=str(REPO), dtype=dt, results=str(folder)))
        else:
            steps.append(Step(f"{lib.name}: epbench {lib.backend} ({dt})", base + ["--results", str(folder)],
                              cwd=str(REPO), dtype=dt, results=str(folder)))
    return steps


# ---- running ------------------------------------------------------------------------------------

@dataclass
class Done:
    returncode: Optional[int]  # None: killed at the timeout
    stdout: str
    stderr: str
    seconds: float
    log: str = ""

    def last_line(self) -> str:
        if self.returncode is None:
            return "timed out"
        for text in (self.stderr, self.stdout):
            lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
            if lines:
                return lines[-1][:200]
        return f"exit {self.returncode}"

    @property
    def ok(self) -> bool:
        return self.returncode == 0


Runner = Callable[[Step, float], Done]


def step_env(step: Step) -> Dict[str, str]:
    from epbench.launch import SAFE_ENV

    env = {k: v for k, v in os.environ.items() if k not in SCRUB_ENV}
    env.update(SAFE_ENV)  # NVLink multicast stays off, as in every process epbench starts
    env.update(step.env)
    return env


def log_paths(step: Step, log_dir: Path) -> Tuple[Path, Path]:
    """Where a step's stdout and stderr go (named after its label)."""
    stem = "".join(c if c.isalnum() or c in "-_." else "-" for c in step.label)[:80]
    return log_dir / f"{stem}.out", log_dir / f"{stem}.err"


def run_step(step: Step, timeout: float, log_dir: Optional[Path] = None) -> Done:
    """Runs ``step`` in its own process group, output to log files; at ``timeout`` seconds the
    whole group (the spawned ranks too) gets SIGTERM, then SIGKILL 10 s later."""
    log_dir = log_dir or Path(".")
    log_dir.mkdir(parents=True, exist_ok=True)
    out_path, err_path = log_paths(step, log_dir)
    t0 = time.monotonic()
    with open(out_path, "w") as out, open(err_path, "w") as err:
        try:
            p = subprocess.Popen(step.cmd, stdout=out, stderr=err, stdin=subprocess.DEVNULL, cwd=step.cwd,
                                 env=step_env(step), start_new_session=True)
        except OSError as e:
            err.write(f"cannot start {step.cmd[0]}: {e}\n")
            err.flush()
            return Done(127, "", f"cannot start {step.cmd[0]}: {e}", 0.0, str(out_path))
        try:
            code: Optional[int] = p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            code = None
            for sig, grace in ((signal.SIGTERM, 10), (signal.SIGKILL, 10)):
                try:
                    os.killpg(p.pid, sig)
                except ProcessLookupError:
                    break
                try:
                    p.wait(timeout=grace)
                    break
                except subprocess.TimeoutExpired:
                    continue
    return Done(code, out_path.read_text(errors="replace"), err_path.read_text(errors="replace"),
                time.monotonic() - t0, str(out_path))


# ---- one library --------------------------------------------------------------------------------

@dataclass
class Outcome:
    target: Target
    status: str = "not run"  # not run | ran | failed
    lines: List[str] = field(default_factory=list)  # what went wrong or was skipped, one line each
    figures: List[fp.Figure] = field(default_factory=list)
    steps: List[Dict[str, Any]] = field(default_factory=list)
    runs: List[Dict[str, Any]] = field(default_factory=list)  # epbench results folders read
    frames: Dict[Tuple[str, Optional[int]], Any] = field(default_factory=dict)  # (dtype, sms) -> rows


def parse_step(lib: Library, step: Step, done: Done) -> List[fp.Figure]:
    if lib.name in CALLS_TIMED:
        try:
            return fp.parse_calls(Path(step.out_json).read_text())
        except OSError:
            return []
    if lib.name == "v1":
        return fp.parse_v1(done.stdout)
    if lib.name == "v2":
        return fp.parse_v2(done.stdout, step.sms)
    return fp.parse_hybrid_ep(done.stdout, step.sms)


def _record(o: Outcome, step: Step, done: Done, what: str) -> None:
    o.steps.append({"what": what, "label": step.label, "shell": step.shown(), "command": step.cmd, "env": step.env,
                    "cwd": step.cwd, "returncode": done.returncode, "seconds": round(done.seconds, 1),
                    "log": done.log, "last_line": done.last_line()})


def read_epbench(o: Outcome, step: Step, done: Done) -> None:
    """The rows of the run folder(s) under the step's --results, with epbench's reader."""
    from epbench import results

    warned: List[str] = []
    folder = Path(step.results)
    try:
        runs = results.load_runs([folder], warned.append) if folder.exists() else []
    except UserError as e:
        runs = []
        warned.append(str(e))
    o.lines += [f"epbench {o.target.lib.backend} ({step.label}): {w}" for w in warned]
    if not runs:
        o.lines.append(f"epbench {o.target.lib.backend} ({step.label}): no results "
                       f"(exit {done.returncode}: {done.last_line()}; log {done.log})")
        o.status = "failed"
        return
    for path, meta, df in runs:
        unmeasured = results.load_unmeasured(path)
        reasons = sorted({str(s) for s in unmeasured.get("status", [])}) if len(unmeasured) else []
        o.runs.append({"folder": str(path), "status": meta.get("status"), "git_commit": meta.get("git_commit"),
                       "torch": meta.get("torch"), "baselines": meta.get("baselines"),
                       "backend_runtime": meta.get("backend_runtime"), "notes": meta.get("notes"),
                       "unmeasured": reasons, "rows": int(len(df))})
        for why in reasons:  # skipped or failed points: the check did not check them
            o.lines.append(f"epbench {o.target.lib.backend} ({step.label}): {why}")
            o.status = "failed"
        if df.empty:
            continue
        df = df[df["backend"] == o.target.lib.backend]
        if step.sms is not None or o.target.lib.sms == "none":
            o.frames[(step.dtype, step.sms)] = df
        else:
            for n, g in df.groupby("sms"):
                o.frames[(step.dtype, int(n))] = g
    if done.returncode != 0:
        o.status = "failed"
        what = "timed out" if done.returncode is None else f"exited {done.returncode}: {done.last_line()}"
        o.lines.append(f"epbench {o.target.lib.backend} ({step.label}) {what} (log {done.log}); "
                       f"the rows it wrote are shown")


def run_library(t: Target, ctx: Ctx, run: Runner, timeout: float, say: Callable[[str], None]) -> Outcome:
    def started(step: Step) -> None:
        say(f"{step.label} (log {log_paths(step, ctx.out / 'logs')[0]}) ...")

    o = Outcome(t)
    if t.not_run:
        o.lines.append(f"not run: {t.not_run}")
        return o
    o.status = "ran"
    tests_root = None
    if t.lib.flavor is not None:
        tests_root, why = tests_folder(t, ctx.out / "src" / t.lib.name, run, timeout)
        if tests_root is None:
            o.status = "failed"
            o.lines.append(f"own benchmark not run: {why}")
    if tests_root is not None or t.lib.flavor is None:
        for step in own_steps(t, tests_root, ctx):
            started(step)
            done = run(step, timeout)
            _record(o, step, done, "own")
            got = parse_step(t.lib, step, done)
            o.figures += got
            if not done.ok:
                o.status = "failed"
                why = "timed out" if done.returncode is None else f"exit {done.returncode}: {done.last_line()}"
                o.lines.append(f"own benchmark ({step.label}) failed ({why}; log {done.log})")
            elif not got:
                o.status = "failed"
                o.lines.append(f"own benchmark ({step.label}) printed no figure the parser knows (log {done.log})")
            say(f"  {done.seconds:.0f} s, {len(got)} figures" + ("" if done.ok else f", {done.last_line()}"))
    for step in epbench_steps(t, ctx):
        started(step)
        done = run(step, timeout)
        _record(o, step, done, "epbench")
        before = len(o.lines)
        read_epbench(o, step, done)
        say(f"  {done.seconds:.0f} s" + (f"; {o.lines[-1]}" if len(o.lines) > before else ""))
    return o


# ---- the table ----------------------------------------------------------------------------------

def epbench_value(df: Any, stat: str, ranks: str) -> Optional[float]:
    """epbench's figure taken as the library's: ``stat`` of each rank's timed calls (p50: the
    time_us column; mean: time_us_mean), over ``ranks`` (rank 0, the slowest, their average)."""
    import pandas as pd

    if df is None or len(df) == 0:
        return None
    col = "time_us" if stat == "p50" else "time_us_mean"
    if col not in df:
        return None
    per = pd.to_numeric(df[col], errors="coerce").groupby(df["rank"]).first().dropna()
    if per.empty:
        return None
    if ranks == "rank 0":
        return float(per.loc[0]) if 0 in per.index else None
    return float(per.max() if ranks == "slowest" else per.mean())


def rows_of(df: Any, op: str, mode: str) -> Any:
    """The rows of one op and call mode (rows without a call_mode column are call rows); None
    where there are none."""
    if df is None or len(df) == 0:
        return None
    called = df["call_mode"].fillna("call") if "call_mode" in df else "call"
    part = df[(df["op"] == op) & (called == mode)]
    return part if len(part) else None


def _pick(figs: List[fp.Figure], lib: str, dtype: str, op: str, sms: Optional[int], role: str) -> Optional[fp.Figure]:
    want = [f for f in figs if f.library == lib and f.op == op and f.sms == sms and f.role == role]
    exact = [f for f in want if f.dtype == dtype]
    if exact:
        return exact[-1]
    # combine moves bf16 whatever the dispatch dtype; a library that times it once (V1, after
    # its BF16 dispatch) has it under bf16 only
    return next((f for f in reversed(want) if op == "combine" and f.dtype == "bf16"), None)


def table_rows(outcomes: List[Outcome], ctx: Ctx) -> List[Dict[str, Any]]:
    rows = []
    for o in outcomes:
        if o.status == "not run":
            continue
        lib = o.target.lib
        for dt in ctx.dtypes:
            for n in (ctx.sms if lib.sms != "none" else (None,)):
                for op in OPS:
                    own = _pick(o.figures, lib.name, dt, op, n, "primary")
                    alt = _pick(o.figures, lib.name, dt, op, n, "alt")
                    df = o.frames.get((dt, n))
                    modes = {}
                    for mode in ("kernel", "call"):
                        modes[mode] = rows_of(df, op, mode)
                    basis = "kernel" if modes["kernel"] is not None else ("call" if modes["call"] is not None else None)
                    matched = epbench_value(modes[basis], own.stat, own.ranks) if own and basis else None
                    ratio = matched / own.us if matched is not None and own and own.us > 0 else None
                    row = {"library": lib.name, "backend": lib.backend, "dtype": dt, "op": op, "sms": n,
                           "own_us": own.us if own else None,
                           "own_stat": f"{own.stat}, {own.ranks}" if own else None,
                           "own_variant": own.variant if own else None,
                           "alt_us": alt.us if alt else None, "alt_variant": alt.variant if alt else None,
                           "alt_stat": f"{alt.stat}, {alt.ranks}" if alt else None,
                           "ratio_basis": basis, "epbench_matched_us": matched, "ratio": ratio,
                           "flagged": bool(ratio is not None and ratio > FLAG_RATIO)}
                    for mode in ("kernel", "call"):
                        part = modes[mode]
                        row[f"{mode}_p50_us"] = epbench_value(part, "p50", "slowest")
                        row[f"{mode}_mean_us"] = epbench_value(part, "mean", "slowest")
                        row[f"{mode}_wrong"] = int(part["wrong"].fillna(0).sum()) if part is not None and "wrong" in part else None
                    rows.append(row)
    return rows


def phase_rows(outcomes: List[Outcome]) -> List[Dict[str, Any]]:
    """The reference's and symm-mem's calls phase by phase (tools/fidelity_phases.py), per dtype, call mode
    and op: each phase's median on the rank whose unmarked whole call is slowest, and its share of
    that call; then the sum of those phases, the whole call unmarked, this check's epbench run in
    that mode (the slowest rank's median) and the bare all-to-all of the same bytes."""
    rows: List[Dict[str, Any]] = []
    for o in outcomes:
        lib = o.target.lib.name
        for whole in (f for f in o.figures if f.role == "whole"):
            mode, dt, op = whole.detail["mode"], whole.dtype, whole.op
            base = {"library": lib, "dtype": dt, "mode": mode, "op": op, "rank": whole.detail["rank"]}

            def row(kind: str, what: str, us: Optional[float], **more: Any) -> Dict[str, Any]:
                share = us / whole.us if us is not None and whole.us > 0 else None
                return dict(base, kind=kind, what=what, us=us, share_of_whole=share, **more)

            phases = sorted((f for f in o.figures if f.role == "phase" and f.dtype == dt and f.op == op
                             and f.detail["mode"] == mode), key=lambda f: f.detail["order"])
            rows += [row("phase", f.detail["phase"], f.us, max_over_ranks_us=f.detail["max_over_ranks_us"])
                     for f in phases]
            rows.append(row("sum", "sum of the phases", whole.detail["sum_of_phases_us"]))
            rows.append(row("whole", "whole call, unmarked", whole.us, wrong=whole.detail.get("wrong")))
            ran = epbench_value(rows_of(o.frames.get((dt, None)), op, mode), "p50", "slowest")
            rows.append(row("epbench", f"epbench run, {mode} rows", ran))
            bare = _pick(o.figures, lib, dt, op, None, "primary")
            if bare is not None:
                rows.append(row("bare", f"bare {bare.variant}", bare.us))
    return rows


def print_phases(rows: List[Dict[str, Any]], console: Any) -> None:
    for lib in dict.fromkeys(r["library"] for r in rows):  # one table per library, in the order they ran
        print_library_phases([r for r in rows if r["library"] == lib], PHASE_TITLES.get(lib, lib), console)


def print_library_phases(rows: List[Dict[str, Any]], title: str, console: Any) -> None:
    from rich.table import Table

    from epbench.console import number

    t = Table(title=f"{title}: where its calls' time goes, phase by phase")
    for name, justify in (("dtype", "left"), ("mode", "left"), ("op", "left"), ("phase", "left"),
                          ("us", "right"), ("of whole", "right"), ("max over ranks", "right")):
        t.add_column(name, justify=justify)
    for r in rows:
        share = "-" if r["share_of_whole"] is None else f"{100 * r['share_of_whole']:.0f} %"
        what = r["what"] if r["kind"] == "phase" else f"[italic]{r['what']}[/]"
        wrong = f" [bold red]#wrong {r['wrong']}[/]" if r.get("wrong") else ""
        t.add_row(r["dtype"], r["mode"], r["op"], what + wrong, number(r["us"]), share,
                  number(r.get("max_over_ranks_us")) if r["kind"] == "phase" else "")
    t.caption = ("phases: medians on the rank whose unmarked whole call is slowest (rank in fidelity.json), "
                 "each step's end marked by a device event (tools/fidelity_phases.py); whole call: the same "
                 "calls unmarked, timed and checked as epbench does; epbench run: this check's rows of that "
                 "call mode; bare: one call of the same bytes alone")
    console.print(t)


def print_table(rows: List[Dict[str, Any]], lines: List[str], console: Any) -> None:
    """The side-by-side table, then ``lines`` (notes, and what did not run or failed)."""
    from epbench.console import number, table

    if not rows:  # nothing measured: the lines say why
        for line in lines or ["nothing was measured"]:
            console.print(line, highlight=False, markup=False)
        return
    t = table("fidelity: each library's own figure beside epbench's, same shape and machine",
              f"epbench/own: epbench's figure taken the library's way (the same statistic and rank), "
              f"from its kernel-mode rows, else its call-mode rows '(call)'; '!' above {FLAG_RATIO:.2f}. "
              f"kernel / call: the slowest rank's median / mean over epbench's timed calls. "
              f"How each figure is measured: docs/fidelity.md",
              (("library", "left"), ("dtype", "left"), ("op", "left"), ("SMs", "right"),
               ("own us", "right"), ("own: what (statistic)", "left"), ("own alt", "left"),
               ("kernel p50 / mean", "right"), ("call p50", "right"), ("epbench/own", "right"),
               ("#wrong k/c", "right")))
    for r in rows:
        ratio = "-"
        if r["ratio"] is not None:
            ratio = f"{r['ratio']:.2f}" + (" (call)" if r["ratio_basis"] == "call" else "")
            ratio = f"[bold red]{ratio} ![/]" if r["flagged"] else ratio
        wrong = "/".join("-" if r[f"{m}_wrong"] is None else str(r[f"{m}_wrong"]) for m in ("kernel", "call"))
        if any(r[f"{m}_wrong"] for m in ("kernel", "call")):
            wrong = f"[bold red]{wrong}[/]"
        alt = "-"
        if r["alt_us"] is not None:
            what = "" if r["alt_variant"] == r["own_variant"] else f" {r['alt_variant']}"
            alt = f"{number(r['alt_us'])}{what} ({r['alt_stat']})"
        t.add_row(r["library"], r["dtype"], r["op"], "auto" if r["sms"] is None else str(r["sms"]),
                  number(r["own_us"]), f"{r['own_variant']} ({r['own_stat']})" if r["own_variant"] else "-",
                  alt, f"{number(r['kernel_p50_us'])} / {number(r['kernel_mean_us'])}", number(r["call_p50_us"]),
                  ratio, wrong)
    console.print(t)
    for line in lines:
        console.print(line, highlight=False, markup=False)


def outcome_lines(notes: List[str], libraries: Dict[str, Dict[str, Any]]) -> List[str]:
    return [f"note: {n}" for n in notes] + [f"{name}: {ln}" for name, rec in libraries.items() for ln in rec["lines"]]


def verdict(rows: List[Dict[str, Any]], libraries: Dict[str, Dict[str, Any]],
            phases: Sequence[Dict[str, Any]] = ()) -> int:
    """1 where a run failed, a row was wrong (the phase timer of the reference and symm-mem checks
    their calls too) or a ratio is flagged; else 0."""
    bad = any(rec["status"] == "failed" for rec in libraries.values()) or any(r["flagged"] for r in rows) \
        or any(r["kernel_wrong"] or r["call_wrong"] for r in rows) or any(r.get("wrong") for r in phases)
    return 1 if bad else 0


def report(paths: List[str], console: Any) -> int:
    """``--report``: one table from the fidelity.json of earlier checks (one library per check, say,
    where a command may only run so long), read only from those files."""
    rows: List[Dict[str, Any]] = []
    phases: List[Dict[str, Any]] = []
    lines: List[str] = []
    libraries: Dict[str, Dict[str, Any]] = {}
    for p in paths:
        path = Path(p) / "fidelity.json" if Path(p).is_dir() else Path(p)
        try:
            rec = json.loads(path.read_text())
            rows += rec["table"]
            phases += rec.get("phases") or []
            lines += outcome_lines(rec["notes"], rec["libraries"])
            libraries.update({f"{path}:{k}": v for k, v in rec["libraries"].items()})
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise UserError(f"--report {p}: not a fidelity check's folder or fidelity.json ({type(e).__name__}: {e})") from None
        lines.append(f"from {path}: {rec.get('scenario')}, shape {rec.get('shape')}, {rec.get('started_utc')}")
    print_phases(phases, console)
    print_table(rows, lines, console)
    return verdict(rows, libraries, phases)


# ---- main ---------------------------------------------------------------------------------------

def parse_args(argv: Optional[List[str]]) -> argparse.Namespace:
    ap = toolcli.Parser("fidelity", prog="python tools/fidelity.py", description=__doc__.split("\n\n")[0],
                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scenario", default=str(REPO / "scenarios" / "dsv3x4.yaml"),
                    help="scenario whose shape is checked (default scenarios/dsv3x4.yaml)")
    ap.add_argument("--libraries", default=",".join(LIBRARIES),
                    help="comma-separated, of: %(default)s (the default: all)")
    ap.add_argument("--venv", action="append", default=[], metavar="LIB=PATH",
                    help="the venv a library runs from (repeatable); default: this tool's venv where its "
                         "build stamp names the library's flavor (the reference: always)")
    ap.add_argument("--src", action="append", default=[], metavar="LIB=PATH",
                    help="the library's source: an unpacked make baselines-carry tarball or a git repository "
                         "holding the pinned commit (repeatable); default: the folder the venv was built from")
    ap.add_argument("--if-present", action="store_true",
                    help="a --venv / --src path that does not exist counts as not given (the defaults apply; "
                         "a library left without one is not run) instead of stopping with exit 2")
    ap.add_argument("--sms", default=None, help="comma-separated SM counts (default: the scenario's)")
    ap.add_argument("--dtypes", default=None, help="dispatch dtypes, bf16 and/or fp8 (default: the scenario's)")
    ap.add_argument("--hidden", type=int, default=None)
    ap.add_argument("--tokens", type=int, default=None, help="tokens per rank")
    ap.add_argument("--topk", type=int, default=None)
    ap.add_argument("--experts", type=int, default=None, help="all experts (default: the scenario's, over its world)")
    ap.add_argument("--world", type=int, default=None, help="ranks, one per GPU (default: the scenario's, at most the GPUs)")
    ap.add_argument("--warmup", type=int, default=None, help="epbench's and the NCCL timer's (default: the scenario's)")
    ap.add_argument("--iters", type=int, default=None, help="epbench's and the NCCL timer's (default: the scenario's)")
    ap.add_argument("--input-sets", type=int, default=None, help="passed to epbench run (default: the scenario's)")
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds per command (default %(default)s)")
    ap.add_argument("--results", default="results", help="folder that receives the check's folder")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                    help="cpu: the reference over gloo only (a check of this tool)")
    ap.add_argument("--report", nargs="+", metavar="FOLDER", default=None,
                    help="run nothing: one table from earlier checks' folders (or their fidelity.json)")
    return ap.parse_args(argv)


def _int_list(text: str, option: str) -> Tuple[int, ...]:
    vals = scenario.maybe_int_list(text, option, scenario.MAX_SMS)
    assert vals is not None
    return vals


def prepare(args: argparse.Namespace, gpus: int, run_git: Callable[[List[str]], int]):
    """Everything checked before anything runs: (scenario, shape, notes, targets, sms, dtypes,
    warmup, iters, the scenario data per dtype). Bad input is a UserError. ``run_git`` runs a
    command and returns its exit code: git, and the libraries' probes in their venvs."""
    s = scenario.load(args.scenario)
    if s.mode != "normal":
        raise UserError(f"{args.scenario}: the fidelity check times the normal (throughput) mode only")
    if s.model.layout != "rank_major":
        raise UserError(f"{args.scenario}: layout {s.model.layout}: the check covers rank_major (the libraries' "
                        f"own benchmarks' main path)")
    names = library_names(args.libraries)
    venvs, srcs = pairs(args.venv, "--venv"), pairs(args.src, "--src")
    sh, notes = shape_of(s, args, gpus)
    sms = _int_list(args.sms, "--sms") if args.sms else tuple(s.bench.sms)
    if "v1" in names and any(n % 2 for n in sms):
        raise UserError(f"--sms {','.join(map(str, sms))}: DeepEP V1 runs num_sms / 2 channels; SM counts must be even")
    dtypes = tuple(d.strip() for d in args.dtypes.split(",") if d.strip()) if args.dtypes else (s.model.dispatch_dtype,)
    bad = [d for d in dtypes if d not in DTYPES]
    if bad or not dtypes or len(set(dtypes)) != len(dtypes):
        raise UserError(f"--dtypes {args.dtypes or s.model.dispatch_dtype}: the libraries' own benchmarks time "
                        f"{' and '.join(DTYPES)} dispatch (each once)")
    warmup = s.bench.warmup if args.warmup is None else args.warmup
    iters = s.bench.iters if args.iters is None else args.iters
    if warmup < 0 or iters < 1 or args.timeout <= 0:
        raise UserError("--warmup must be >= 0, --iters >= 1, --timeout > 0")
    if args.input_sets is not None and not 1 <= args.input_sets <= scenario.MAX_INPUT_SETS:
        raise UserError(f"--input-sets: must be 1 to {scenario.MAX_INPUT_SETS}, got {args.input_sets}")
    data = {dt: scenario_data(s, sh, dt, sms, warmup, iters, args.device) for dt in dtypes}
    for dt, d in data.items():  # the shape as epbench validates it: bad input stops here
        scenario.parse(d, f"{args.scenario} with the checked shape ({dt})")
    targets = [resolve(LIBRARIES[n], venvs, srcs, args.if_present, run_git) for n in names]
    for t in targets:
        if t.not_run is None and args.device == "cpu" and t.lib.name != "reference":
            t.not_run = "needs CUDA GPUs (--device cpu runs the reference only)"
        elif t.not_run is None and args.device == "cuda" and gpus == 0:
            t.not_run = "no GPU on this host (nvidia-smi -L lists none)"
        elif t.not_run is None and sh.world < t.lib.min_world:
            t.not_run = f"needs {t.lib.min_world} ranks or more (world {sh.world}: one rank per GPU)"
        elif t.not_run is None and t.lib.probe and run_git([t.python, "-c", t.lib.probe]) != 0:
            t.not_run = t.lib.missing.format(venv=t.venv)
    return s, sh, notes, targets, sms, dtypes, warmup, iters, data


def _git_rc(cmd: List[str]) -> int:
    try:
        return subprocess.run(cmd, capture_output=True, timeout=60).returncode
    except (OSError, subprocess.TimeoutExpired):
        return 1


def check(args: argparse.Namespace, gpus: int, run: Optional[Runner] = None,
          run_git: Callable[[List[str]], int] = _git_rc, console: Any = None,
          say: Optional[Callable[[str], None]] = None) -> int:
    from epbench import provenance, results
    from epbench.console import wide_console

    console = console or wide_console()
    say = say or (lambda text: console.print(text, highlight=False, markup=False))
    s, sh, notes, targets, sms, dtypes, warmup, iters, data = prepare(args, gpus, run_git)
    out = results.new_run_dir(Path(args.results), f"fidelity_{s.name}_w{sh.world}")
    (out / "own").mkdir()
    files = {}
    for dt in dtypes:
        path = out / f"scenario-{dt}.yaml"
        path.write_text(yaml.safe_dump(data[dt], sort_keys=False))
        files[dt] = str(path)
    ctx = Ctx(sh, sms, dtypes, files, out, warmup, iters, args.device, args.input_sets)
    runner = run or (lambda step, timeout: run_step(step, timeout, out / "logs"))
    started = datetime.datetime.now(datetime.timezone.utc).isoformat()
    say(f"fidelity check into {out}: hidden {sh.hidden}, {sh.tokens} tokens/rank, top-{sh.topk} of "
        f"{sh.experts} experts, {sh.world} ranks, {'/'.join(dtypes)}, SMs {','.join(map(str, sms))}")
    for line in notes:
        say(f"note: {line}")
    outcomes = [run_library(t, ctx, runner, args.timeout, say) for t in targets]
    rows = table_rows(outcomes, ctx)
    record = {
        "started_utc": started, "finished_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(),
        "argv": sys.argv, "epbench": provenance.git_commit(), "host": socket.gethostname(), "gpus": gpus,
        "scenario": args.scenario, "shape": sh.__dict__, "sms": list(sms), "dtypes": list(dtypes),
        "warmup": warmup, "iters": iters, "input_sets": args.input_sets, "device": args.device,
        "timeout_s": args.timeout, "notes": notes, "flag_ratio": FLAG_RATIO,
        "libraries": {o.target.lib.name: {
            "status": o.status, "lines": o.lines, "backend": o.target.lib.backend, "venv": o.target.venv,
            "python": o.target.python, "build_stamp": o.target.stamp, "source": o.target.src,
            "source_kind": o.target.src_kind,
            "pinned_commit": baselines.FLAVORS[o.target.lib.flavor].commit if o.target.lib.flavor else None,
            "steps": o.steps, "figures": [f.to_dict() for f in o.figures], "epbench_runs": o.runs,
        } for o in outcomes},
        "table": rows,
        "phases": phase_rows(outcomes),
    }
    (out / "fidelity.json").write_text(json.dumps(record, indent=1, default=str) + "\n")
    print_phases(record["phases"], console)
    print_table(rows, outcome_lines(notes, record["libraries"]), console)
    say(f"raw: {out / 'fidelity.json'}")
    return verdict(rows, record["libraries"], record["phases"])


def main(argv: Optional[List[str]] = None) -> int:
    return toolcli.run("fidelity", parse_args, command, argv)


def command(args: argparse.Namespace) -> int:
    if args.report:
        from epbench.console import wide_console

        return report(args.report, wide_console())
    return check(args, gpu_count() if args.device == "cuda" else 0)


if __name__ == "__main__":
    sys.exit(main())
