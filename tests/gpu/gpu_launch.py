"""Shared by the GPU tests: run a worker script under torchrun on this host's GPUs, with the
environment every GPU run here must have (no NVLink multicast anywhere, unbuffered output)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import pytest

ROOT = Path(__file__).resolve().parents[2]
SAFE_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1",
            "PYTHONUNBUFFERED": "1"}


def gpu_count() -> int:
    try:
        import torch
    except ImportError:
        return 0
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


GPUS = gpu_count()


def needs_gpus(n: int, why: str = "") -> List[pytest.MarkDecorator]:
    """The marks of a test about separate GPUs: the `gpu` marker, and a skip below n CUDA GPUs."""
    return [pytest.mark.gpu,
            pytest.mark.skipif(GPUS < n, reason=f"needs >= {n} CUDA GPUs{f' ({why})' if why else ''}")]


def shares_gpus() -> List[pytest.MarkDecorator]:
    """The marks of a multi-rank test that runs on any GPU count: where ranks outnumber the GPUs
    they share them (epbench.launch), through the same kernels, buffers and checks."""
    return [pytest.mark.gpu, pytest.mark.skipif(GPUS < 1, reason="needs a CUDA GPU")]


def mps_on() -> bool:
    from epbench.launch import mps_active

    return mps_active()


def needs_nvshmem_gpus(n: int) -> List[pytest.MarkDecorator]:
    """NVSHMEM PEs: n GPUs, or fewer shared under MPS (without MPS NVSHMEM's support for several
    PEs per GPU is limited, and epbench-hier says so and skips)."""
    return [pytest.mark.gpu, pytest.mark.skipif(
        GPUS < n and not (GPUS >= 1 and mps_on()),
        reason=f"needs >= {n} CUDA GPUs, or MPS to put {n} NVSHMEM PEs on fewer")]


def world(most: int = 4) -> int:
    """Ranks for a shared-or-separate test: one per GPU up to ``most``, and 2 on a 1-GPU host."""
    return max(2, min(GPUS, most))


def shared(nproc: int) -> bool:
    """True where ``nproc`` ranks outnumber this host's GPUs (they share them)."""
    return nproc > GPUS


def visible(indices) -> str:
    """CUDA_VISIBLE_DEVICES for a child that should see these of this process's GPUs (0 .. GPUS-1),
    through this process's own CUDA_VISIBLE_DEVICES where one is set (CUDA_VISIBLE_DEVICES=2,3: index 0
    is GPU 2)."""
    mine = [d for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    return ",".join(mine[i] if i < len(mine) else str(i) for i in indices)


def flavor_reachable(backend: str) -> bool:
    """Whether `epbench run --backends <backend>` from this checkout reaches the DeepEP flavor it needs:
    installed in this environment, or built into a venv `make baselines VENV=...` recorded (epbench/flavors.py;
    the launcher then starts that backend's job from there)."""
    from epbench import flavors, provenance

    need = flavors.BACKEND_FLAVOR[backend]
    return provenance.baselines_build().get("flavor") == need or flavors.job_python((backend,)) is not None


def safe_env() -> dict:
    env = dict(os.environ, **SAFE_ENV)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env


def descendants(pid: int) -> List[int]:
    """Every live process below ``pid`` (Linux /proc), children before grandchildren."""
    parent: Dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parent[int(entry)] = int(f.read().rpartition(")")[2].split()[1])
            except (OSError, ValueError, IndexError):
                pass
    found, todo = [], [pid]
    while todo:
        top = todo.pop(0)
        kids = [c for c, pp in parent.items() if pp == top]
        found += kids
        todo += kids
    return found


def kill_tree(pid: int) -> None:
    """SIGKILL to ``pid`` and every process below it (torchrun puts each rank in a session of its
    own, so its process group does not reach them)."""
    for each in [pid, *descendants(pid)]:
        try:
            os.kill(each, signal.SIGKILL)
        except ProcessLookupError:
            pass


def start_torchrun(worker: Path, nproc: int, *args: str, gpus: Optional[str] = None) -> subprocess.Popen:
    """The worker under torchrun, started; ``gpus``: the CUDA_VISIBLE_DEVICES it sees (all: None)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           str(worker), *args]
    env = dict(safe_env(), **({"CUDA_VISIBLE_DEVICES": gpus} if gpus is not None else {}))
    return subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish(p: subprocess.Popen, timeout: int) -> subprocess.CompletedProcess:
    """Waits for a launch. Past ``timeout`` s, or when the test is stopped (pytest-timeout, Ctrl-C),
    the whole launch is killed, torchrun and every rank: ranks left behind would hold the GPUs for
    the tests after. A launch that timed out returns what it had printed and says so."""
    try:
        out, err = p.communicate(timeout=timeout)
    except BaseException as e:
        kill_tree(p.pid)
        out, err = p.communicate()
        if not isinstance(e, subprocess.TimeoutExpired):
            raise
        err += f"\n(gpu_launch: killed after {timeout} s)"
    return subprocess.CompletedProcess(p.args, p.returncode, out, err)


def torchrun(worker: Path, nproc: int, *args: str, timeout: int = 900) -> subprocess.CompletedProcess:
    return finish(start_torchrun(worker, nproc, *args), timeout)


def waves(worlds: Sequence[int], gpus: int) -> List[List[Tuple[int, Optional[str]]]]:
    """Launches of these world sizes that can run side by side, each on GPUs of its own: lists of
    (world, its CUDA_VISIBLE_DEVICES), biggest worlds first. A world with more ranks than the host
    has GPUs takes them all (its ranks share them). 4 GPUs: [4], [3 on 0-2, 1 on 3], [2]."""
    left, out = sorted(set(worlds), reverse=True), []
    while left:
        wave, free = [], max(gpus, 1)
        for w in list(left):
            need = min(w, max(gpus, 1))
            if need <= free:
                first = max(gpus, 1) - free
                wave.append((w, None if w >= gpus else visible(range(first, first + w))))
                free -= need
                left.remove(w)
        out.append(wave)
    return out


class SuiteLaunches:
    """The kernel checks of several test modules, one torchrun launch per world size: each module
    adds its suites at import (``add``), and the first test that reads a suite of a world starts
    tests/gpu/suite_worker.py with every suite of that world, in one process group (one process
    start, one CUDA context, one NCCL and IPC set-up instead of one per test); worlds that fit on
    separate GPUs of this host run side by side (``waves``: on 4 GPUs, 3 ranks beside 1). The launch
    is kept for the other tests of that world; each reads its own suite's line, so a failure names
    the test's suite and its failed cases."""

    def __init__(self, worker: Path, timeout: int = 420) -> None:
        self.worker, self.timeout = worker, timeout
        self.suites: Dict[int, Dict[str, Tuple[str, Sequence[str], Callable[[], bool]]]] = {}
        self.done: Dict[int, subprocess.CompletedProcess] = {}

    def add(self, world: int, kind: str, name: str, flags: Sequence[str],
            when: Callable[[], bool] = lambda: True) -> None:
        """Suite ``name`` of ``kind`` (ep | ll, see suite_worker.py) on ``world`` ranks; left out of
        the launch where ``when()`` is False (its tests skip for that reason themselves)."""
        self.suites.setdefault(world, {})[name] = (kind, list(flags), when)

    def launch(self, world: int) -> subprocess.CompletedProcess:
        """The world's launch, run with the others of its wave (``waves``) side by side."""
        if world not in self.done:
            import shlex
            from concurrent.futures import ThreadPoolExecutor

            wave = next(w for w in waves(list(self.suites), GPUS) if world in [n for n, _ in w])
            started: List[Tuple[int, subprocess.Popen]] = []
            pool = ThreadPoolExecutor(len(wave))
            try:
                for nproc, gpus in wave:
                    specs = [f"{kind}:{name}={shlex.join(flags)}"
                             for name, (kind, flags, when) in self.suites[nproc].items() if when()]
                    started.append((nproc, start_torchrun(self.worker, nproc, *specs, gpus=gpus)))
                waiting = [(nproc, pool.submit(finish, p, self.timeout)) for nproc, p in started]
                for nproc, result in waiting:
                    self.done[nproc] = result.result()
            except BaseException as e:  # stopped from outside: no rank left, no test of the wave relaunches
                for _, p in started:
                    kill_tree(p.pid)
                for nproc, _ in wave:
                    self.done.setdefault(nproc, subprocess.CompletedProcess([], -1, "", f"launch stopped: {e!r}"))
                raise
            finally:
                pool.shutdown(wait=False)  # after the kill above: the waits end with their launches
        return self.done[world]

    def assert_passed(self, world: int, *lines: str) -> str:
        """Each of ``lines`` (e.g. 'suite mxfp8 world=3') was printed with PASS by the world's
        launch; returns what the launch printed for the first of them (its lines since the suite
        before it). A failure shows that suite's lines, or the launch's last ones where the line
        never came (the launch crashed or was killed before it)."""
        r = self.launch(world)
        printed = r.stdout.splitlines()
        how = f"\n(launch of {self.worker.name} on {world} ranks, exit {r.returncode})\n"
        sections = []
        for line in lines:
            at = next((i for i in reversed(range(len(printed))) if printed[i].startswith(line + ": ")), None)
            assert at is not None, f"{line}: never reported{how}{r.stdout[-6000:]}\n{r.stderr[-4000:]}"
            start = next((i + 1 for i in reversed(range(at)) if printed[i].startswith("suite ")), 0)
            section = "\n".join(printed[start:at + 1])
            assert printed[at].endswith(": PASS"), f"{printed[at]}{how}{section[-6000:]}\n{r.stderr[-4000:]}"
            sections.append(section)
        return sections[0] if sections else ""


def ll_kernels_built() -> bool:
    """The low-latency kernels are in the built library (an older build lacks them)."""
    from epbench import cuda_lib

    try:
        cuda_lib.load().ep_ll_create
    except (RuntimeError, AttributeError):
        return False
    return True


KERNEL_SUITES = SuiteLaunches(ROOT / "tests" / "gpu" / "suite_worker.py")


class HostGpus:
    """This host's GPUs as every run set (GpuRuns) sees them together: how many runs each GPU holds,
    at most ``cap`` from all sets at once, so that sets started together (gpu_launch.EARLY_RUNS) do
    not pile up on one GPU beside the tests that launch on their own (the kernel suites, whose
    missing-peer checks wait 1 s). Requests are served first fit, but one that has waited ``patience``
    s for the pool (its own set had room for it) holds back every request made after it until it
    fits: a run needing every GPU is not starved by the one-GPU runs of sets started after it. A set's
    own ``per_gpu`` still bounds its own runs on a GPU."""

    def __init__(self, gpus: int, cap: int, patience: float = 15.0) -> None:
        import itertools
        import threading

        self.gpus, self.cap, self.patience = max(gpus, 1), max(cap, 1), patience
        self.held = {g: 0 for g in range(self.gpus)}
        self.waiting: Dict[object, Tuple[int, float]] = {}  # request -> (its order, when first made)
        self._order = itertools.count()
        self._lock = threading.Lock()

    def take(self, request: object, need: int, allowed: Dict[int, int]) -> Optional[List[int]]:
        """``need`` distinct GPUs for ``request`` (any hashable, the same on every try), among those
        its set still has room on (``allowed``: GPU -> the set's room), those with the most room
        first; None (and the request keeps its place) where they are not free now."""
        import time

        with self._lock:
            now = time.monotonic()
            order, since = self.waiting.setdefault(request, (next(self._order), now))
            if sum(1 for g in allowed.values() if g > 0) < need:  # its own set's room stops it, not the pool:
                self.waiting[request] = (order, now)               # it holds nothing back (yet)
            held_back = any(o < order and now - t >= self.patience for o, t in self.waiting.values())
            free = sorted((g for g in self.held if self.held[g] < self.cap and allowed.get(g, 0) > 0),
                          key=lambda g: (self.held[g], -allowed[g], g))
            if held_back or need > len(free):
                return None
            mine = sorted(free[:need])
            for g in mine:
                self.held[g] += 1
            del self.waiting[request]
            return mine

    def give(self, gpus: Sequence[int]) -> None:
        with self._lock:
            for g in gpus:
                self.held[g] -= 1

    def forget(self, requests) -> None:
        """Requests that will not be made again (their set stopped)."""
        with self._lock:
            for r in requests:
                self.waiting.pop(r, None)


_HOST: List[HostGpus] = []
STARTED: List["GpuRuns"] = []  # every set this process started, early or at its module's first test


def wait_for_every_run() -> None:
    """Until every run of every set started so far has ended: for a test that needs a GPU to itself (its own
    MPS daemon), early-started sets and the ones a module started alike."""
    for runs in list(STARTED):
        runs.wait()


def host_pool() -> HostGpus:
    """The one pool of this process's GPUs (cap: EPBENCH_GPU_TESTS_PER_GPU runs a GPU, default 3)."""
    if not _HOST:
        _HOST.append(HostGpus(GPUS, int(os.environ.get("EPBENCH_GPU_TESTS_PER_GPU", "3"))))
    return _HOST[0]


class GpuRuns:
    """Independent runs of one module, each needing some GPUs of this host but no particular ones
    (each sees only the GPUs it is given, through CUDA_VISIBLE_DEVICES): the first test that reads one
    starts them all in a thread, as many side by side as there are free GPUs for, so that on 4 GPUs
    four one-GPU runs take about the time of the longest instead of their sum. A run starts as soon as
    its count is free (first fit, in the order given); a test waits for its own run only, so a per-test
    timeout (pytest-timeout) bounds one run's wait, and a run past ``timeout`` s (``timeouts``: a run's own
    limit) is killed and fails its own test alone, as does a run whose command cannot start. For checks of what a run verifies and prints, never of how fast it was (the runs
    beside it share the host's CPUs). ``runs`` maps a name to a function of the run's own folder (for
    --results, scenario files) giving its command line; ``gpus`` a name to its GPU count (default 1; a
    count above this host's is refused: leave such a run out, its test skips); ``env`` is added to
    safe_env(). ``per_gpu`` runs of this set may share one GPU at a time (default 1), each still on
    distinct GPUs of its own count, those with the most room first. Every set of this process shares one
    pool (``host_pool()``: a cap on the runs a GPU holds from all sets together), so runs of other sets
    may be on the same GPU: these runs only verify (the GPU time-slices between them, so their times mean
    nothing), and a test that needs a GPU to itself (its own MPS daemon) first calls wait_for_every_run().
    ``host_gpus`` given (tests of this scheduler) gives the set a pool of its own. ``close()`` (the module fixture's teardown) stops what is still running."""

    def __init__(self, base: Path, runs: Dict[str, Callable[[Path], List[str]]],
                 env: Optional[Dict[str, str]] = None, timeout: int = 600,
                 gpus: Optional[Dict[str, int]] = None, host_gpus: Optional[int] = None,
                 per_gpu: int = 1, pool: Optional[HostGpus] = None,
                 timeouts: Optional[Dict[str, int]] = None) -> None:
        import threading

        self.base, self.runs, self.env, self.timeout = base, runs, env or {}, timeout
        self.timeouts = dict(timeouts or {})  # a run's own limit where it has one (else ``timeout``)
        self.per_gpu = max(per_gpu, 1)
        if pool is None:
            pool = host_pool() if host_gpus is None else HostGpus(host_gpus, self.per_gpu)
        self.pool = pool
        self.host_gpus = pool.gpus if host_gpus is None else max(host_gpus, 1)
        if self.host_gpus > pool.gpus:
            raise ValueError(f"a set of {self.host_gpus} GPUs on a pool of {pool.gpus}")
        self.need = {name: (gpus or {}).get(name, 1) for name in runs}
        too_many = {n: k for n, k in self.need.items() if not 1 <= k <= self.host_gpus}
        if too_many:
            raise ValueError(f"runs needing more GPUs than this host's {self.host_gpus}: {too_many}")
        self.done: Dict[str, Tuple[subprocess.CompletedProcess, Path]] = {}
        self._finished = {name: threading.Event() for name in runs}
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def start(self) -> "GpuRuns":
        """Starts the runs in the background (once; ``get`` does it too)."""
        if self._thread is None:
            import atexit
            import threading

            STARTED.append(self)
            self._thread = threading.Thread(target=self._run_all, name="gpu-runs", daemon=True)
            self._thread.start()
            atexit.register(self.close)  # an interrupted session leaves no run behind
        return self

    def get(self, name: str) -> Tuple[subprocess.CompletedProcess, Path]:
        """(the finished run, its folder), once this run has ended; the first call starts them all."""
        self.start()
        self._finished[name].wait()
        return self.done[name]

    def wait(self) -> None:
        """Until every run has ended (started or not: a set never started has nothing running)."""
        if self._thread is not None:
            for event in self._finished.values():
                event.wait()

    def __enter__(self) -> "GpuRuns":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Kills the runs still going and ends the thread; runs not finished read as stopped."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=60)

    def _folder(self, name: str) -> Path:
        return self.base / name.replace("/", "-")

    def _end(self, name: str, result: subprocess.CompletedProcess) -> None:
        self.done[name] = (result, self._folder(name))
        self._finished[name].set()

    def _run_all(self) -> None:
        import time

        todo = list(self.runs)
        room = {gpu: self.per_gpu for gpu in range(self.host_gpus)}  # runs each GPU may still take
        running: Dict[str, Tuple[subprocess.Popen, List[int], float, List[str]]] = {}
        why = "runs stopped before this one ended (the module's end or an interrupted session)"
        try:
            while (todo or running) and not self._stop.is_set():
                for name in list(todo):
                    mine = self.pool.take((id(self), name), self.need[name], room)
                    if mine is None:
                        continue
                    todo.remove(name)
                    try:
                        folder = self._folder(name)
                        folder.mkdir(parents=True, exist_ok=True)
                        cmd = self.runs[name](folder)
                        env = dict(safe_env(), **self.env, CUDA_VISIBLE_DEVICES=visible(mine))
                        with open(folder / "stdout.txt", "w") as out, open(folder / "stderr.txt", "w") as err:
                            p = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=err, text=True)
                    except Exception as e:  # noqa: BLE001 - this run could not start: its test reads why
                        self.pool.give(mine)
                        self._end(name, subprocess.CompletedProcess([], -1, "", f"run could not start: {e!r}"))
                        continue
                    for g in mine:
                        room[g] -= 1
                    running[name] = (p, mine, time.monotonic(), cmd)
                for name, (p, mine, start, cmd) in list(running.items()):
                    limit = self.timeouts.get(name, self.timeout)
                    late = time.monotonic() - start > limit
                    if p.poll() is None and not late:
                        continue
                    if late and p.poll() is None:
                        kill_tree(p.pid)
                        p.wait()
                    folder = self._folder(name)
                    err = (folder / "stderr.txt").read_text(errors="replace") + (
                        f"\n(killed after {limit} s)" if late else "")
                    out = (folder / "stdout.txt").read_text(errors="replace")
                    self._end(name, subprocess.CompletedProcess(cmd, p.returncode, out, err))
                    del running[name]
                    self.pool.give(mine)
                    for g in mine:
                        room[g] += 1
                time.sleep(0.2)
        except BaseException as e:  # noqa: BLE001 - this thread's own failure: every waiting test reads it
            why = f"runs stopped: {e!r}"
        finally:  # nothing left running, every waiting test released, the pool's GPUs given back
            for p, mine, *_ in running.values():
                kill_tree(p.pid)
                self.pool.give(mine)
            self.pool.forget((id(self), name) for name in todo)
            for name in self.runs:
                if name not in self.done:
                    self._end(name, subprocess.CompletedProcess([], -1, "", why))


class EarlyRuns:
    """Run sets that start as the session's tests begin, not at their module's first test: a module
    whose runs take long but need the GPUs little (Hybrid-EP's jobs compile with nvcc as they start;
    the low-latency pipeline runs are short jobs mostly starting up) registers a maker and the name of
    the fixture that hands its set to its tests at import (``add``); tests/gpu/conftest.py starts the
    sets that a selected test uses once collection ends (``start``), and the module's fixture takes its
    set (``take``, once: a second setup of that fixture makes a new set) and closes it at the module's
    end. Their runs then go beside the tests of the modules before them, which only verify too; a test
    that needs a GPU to itself (MPS) first waits for every run (wait_for_every_run). EPBENCH_GPU_TESTS_EARLY=0 turns
    this off (each set then starts at its module's first test, as before)."""

    def __init__(self) -> None:
        self.makers: Dict[str, Tuple[Callable[[Path], Optional[GpuRuns]], str]] = {}
        self.started: Dict[str, GpuRuns] = {}
        self.every: List[GpuRuns] = []

    @staticmethod
    def _key(module_file) -> str:
        return str(Path(module_file).resolve())

    def add(self, module_file: str, make: Callable[[Path], Optional[GpuRuns]], fixture: str) -> None:
        """``make(base folder)`` gives the module's set, or None where it would skip (not built);
        ``fixture``: the fixture its tests take the set from."""
        self.makers[self._key(module_file)] = (make, fixture)

    def start(self, tests: Sequence[Tuple[str, Sequence[str]]], base: Path) -> List[str]:
        """Starts the sets used by these tests ((module file, fixture names) each); returns the
        modules whose set started. A maker that fails leaves its module to make its own set."""
        used = {self._key(m) for m, names in tests if self.makers.get(self._key(m), (None, ""))[1] in names}
        for f in sorted(used - set(self.started)):
            try:
                runs = self.makers[f][0](base / Path(f).stem)
            except Exception as e:  # noqa: BLE001 - the module's fixture makes its set later and reports it
                print(f"gpu_launch: early runs of {Path(f).name} not started: {e!r}")
                continue
            if runs is not None:
                self.started[f] = runs.start()
                self.every.append(runs)
        return sorted(self.started)

    def take(self, module_file: str) -> Optional[GpuRuns]:
        return self.started.pop(self._key(module_file), None)

    def set_of(self, module_file: str, tmp_path_factory: Any) -> Optional[GpuRuns]:
        """The module's set for its fixture: the one started early (``take``), else a new one from its maker
        (EPBENCH_GPU_TESTS_EARLY=0, or the early start not done), in a fresh folder; None where the maker
        says the module would skip."""
        early = self.take(module_file)
        if early is not None:
            return early
        return self.makers[self._key(module_file)][0](tmp_path_factory.mktemp(Path(module_file).stem))

    def wait(self) -> None:
        for runs in self.every:
            runs.wait()


EARLY_RUNS = EarlyRuns()
