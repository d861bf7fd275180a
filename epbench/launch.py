"""Process launch: torchrun started in this process for the ranks, and joining the process group
inside it."""

from __future__ import annotations

import datetime
import os
import re
import shutil
import subprocess
import sys
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Set, Tuple

# NVLink multicast can take a shared NVSwitch host down; it stays off in every process we start.
SAFE_ENV = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}


# A rank stopped by SIGSTOP (2 x H200, 2026-11-26 19:05 and 19:53 UTC): its peer's NCCL watchdog saw the
# collective time out after --control-timeout, logged "First PG on this rank to signal dumping" and then
# waited before tearing the rank down, so the run had not ended 40 s later, with the dump itself off too.
# torch's watchdog waits TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC (15 000 by default) for the flight recorder's
# dump and sleeps four times that before it throws (torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp):
# 60 s. No dump and a 500 ms wait: the teardown starts ~2 s after the timeout.
FAULT_ENV = {"TORCH_NCCL_DUMP_ON_TIMEOUT": "0", "TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC": "500"}


def apply_safe_env() -> None:
    os.environ.update(SAFE_ENV)


def apply_rank_env() -> None:
    """The environment the ranks inherit: SAFE_ENV always, FAULT_ENV and the rest unless set already."""
    os.environ.update(SAFE_ENV)
    for k, v in FAULT_ENV.items():  # the user's own setting wins
        os.environ.setdefault(k, v)
    # several ranks share the cores; torchrun would set 1 itself, with a warning per launch
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("PYTHONUNBUFFERED", "1")


def under_torchrun() -> bool:
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))


def torchrun_args(args: List[str], nproc_per_node: int, nnodes: int = 1,
                  node_rank: Optional[int] = None, rdzv_endpoint: Optional[str] = None,
                  rdzv_timeout_s: Optional[int] = None, module: str = "epbench.rank",
                  python: Optional[str] = None) -> List[str]:
    """torchrun's arguments for running ``python -m <module> <args>`` on every rank (epbench.rank:
    the ranks' entry point, whose arguments name a plan and a job); ``python``: that interpreter
    instead of torchrun's own (another venv's: epbench/flavors.py)."""
    cmd = [f"--nproc-per-node={nproc_per_node}"]
    if nnodes > 1 or rdzv_endpoint:
        cmd += [f"--nnodes={nnodes}", "--rdzv-backend=c10d", f"--rdzv-endpoint={rdzv_endpoint}"]
        if node_rank is not None:
            cmd.append(f"--node-rank={node_rank}")
        if rdzv_timeout_s is not None:
            cmd.append(f"--rdzv-conf=join_timeout={rdzv_timeout_s}")
    else:
        cmd.append("--standalone")
    if python is not None:
        return cmd + ["--no-python", python, "-m", module, *args]
    return cmd + ["-m", module, *args]


SIGNAL_EXIT = {"SIGINT": 130, "SIGTERM": 143}  # the shell's convention: 128 + signal number
LAUNCHER_ENV = "EPBENCH_LAUNCHER"  # "<pid>:<start>" of the epbench process that started the ranks
SHUTDOWN_GRACE_S = 2  # how long torchrun waits for a rank it stopped before it kills the rank


def process_start(pid: int) -> Optional[str]:
    """When ``pid`` started (clock ticks since boot, as /proc says); None: no such process, or a
    zombie (it has exited). With the pid, it names one process: pids are reused, start times not."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()  # the name before ")" may hold spaces
    except (OSError, IndexError):
        return None
    return None if fields[0] in ("Z", "X") else fields[19]


def _boot_id() -> Optional[str]:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return None


def launcher_record() -> Dict[str, object]:
    """What meta.json keeps of the process that launched this rank (epbench's launcher; torchrun
    where it was started by hand; this process outside torchrun), so that a reader can tell a
    run still going from one whose launcher vanished (see launcher_gone)."""
    import socket

    pid, _, start = os.environ.get(LAUNCHER_ENV, "").partition(":")
    if not pid:
        pid = str(os.getppid() if under_torchrun() else os.getpid())
        start = process_start(int(pid)) or ""
    return {"pid": int(pid), "start": start, "host": socket.gethostname(), "boot_id": _boot_id()}


def launcher_gone(record: object) -> Optional[bool]:
    """True when the launcher ``record`` names has exited (read on its host: no such process, a
    zombie, another process under its pid, or the host rebooted since); False while it runs;
    None where this cannot be told (another host, or no record)."""
    import socket

    if not isinstance(record, dict) or record.get("host") != socket.gethostname():
        return None
    try:
        pid = int(record["pid"])
    except (KeyError, TypeError, ValueError):
        return None
    if record.get("boot_id") and _boot_id() and record["boot_id"] != _boot_id():
        return True
    start = process_start(pid)
    return start is None or (bool(record.get("start")) and start != str(record["start"]))


def guard_rank() -> None:
    """The first thing a rank does, before its heavy imports: it dies with its launcher, at once
    and without a word. PR_SET_PDEATHSIG kills it when the thread that started it ends; a thread
    waits on the launcher named in LAUNCHER_ENV too (the parent may be another process, or the
    launcher may have died before the death signal was set). SIGINT gets its default action back
    (the launcher stops ranks with SIGTERM; a Ctrl-C reaching a rank some other way ends it
    quietly too, instead of a KeyboardInterrupt traceback from wherever its imports were)."""
    import signal
    import threading

    signal.signal(signal.SIGINT, signal.SIG_DFL)
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1: PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass  # not Linux: the thread below still watches
    pid, _, start = os.environ.get(LAUNCHER_ENV, "").partition(":")
    if pid.isdigit():
        threading.Thread(target=_exit_with, args=(int(pid), start), daemon=True,
                         name="epbench-launcher-watch").start()


def _exit_with(pid: int, start: str) -> None:
    """Blocks until process ``pid`` (started at ``start``) exits, then ends this process."""
    import select
    import time

    try:
        fd: Optional[int] = os.pidfd_open(pid)  # readable once the process has exited
    except ProcessLookupError:
        os._exit(1)
    except (OSError, AttributeError):  # before Linux 5.3 / Python 3.9: look twice a second
        fd = None
    if start and process_start(pid) != start:
        os._exit(1)  # it was gone already, and its pid reused
    if fd is not None:
        select.select([fd], [], [])
    while process_start(pid) is not None:
        time.sleep(0.5)
    os._exit(1)


def leave(code: object) -> None:
    """Ends a rank or a launcher with ``code`` (a SystemExit's) without Python's and C++'s
    teardown. In a rank, the destructors of threads that torch.distributed and gloo leave
    running can abort the process on the way out ("terminate called without an active
    exception"), turning a clean exit or a one-line error into a crash report; in the launcher,
    tearing torch down took 2-5 s after the last line on a loaded 2-core host."""
    if code is not None and not isinstance(code, int):
        print(code, file=sys.stderr)
        code = 1
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code or 0)
ERROR_FILE = ".error-rank{}"  # a rank's one error line, for the launcher to report


@dataclass
class Outcome:
    """How one torchrun job ended: status is complete, failed, timeout or interrupted; ``line``
    says why (None when complete); ``code`` is the exit code the launcher passes on."""

    status: str
    code: int = 0
    line: Optional[str] = None


def _signal_name(code: int) -> str:
    import signal

    try:
        return signal.Signals(-code).name
    except ValueError:
        return f"signal {-code}"


def memory_cgroups(cgroups: str = "/proc/self/cgroup", root: str = "/sys/fs/cgroup") -> List[Tuple[str, str]]:
    """This process's memory cgroup folders, each with its version ("v2" or "v1"), as /proc names
    them ([] where it cannot be read: another OS). The ranks it starts join the same cgroup."""
    try:
        with open(cgroups) as f:
            lines = [ln.strip().split(":", 2) for ln in f if ln.count(":") >= 2]
    except OSError:
        return []
    return ([(os.path.join(root, path.lstrip("/")), "v2") for hier, ctl, path in lines if hier == "0" and ctl == ""]
            + [(os.path.join(root, "memory", path.lstrip("/")), "v1") for _hier, ctl, path in lines
               if "memory" in ctl.split(",")])


def oom_kills(cgroups: str = "/proc/self/cgroup", root: str = "/sys/fs/cgroup") -> Optional[int]:
    """How many processes the kernel's out-of-memory killer has killed in this process's memory
    cgroup (the ranks it starts join it), its descendants included: cgroup v2's memory.events, else
    v1's memory.oom_control (both count ``oom_kill``, Linux 4.13 on). None where neither can be read
    (another OS, the cgroup not mounted where /proc names it)."""
    for folder, version in memory_cgroups(cgroups, root):
        try:
            with open(os.path.join(folder, "memory.events" if version == "v2" else "memory.oom_control")) as f:
                counts = dict(ln.split(None, 1) for ln in f if len(ln.split()) == 2)
            return int(counts["oom_kill"])
        except (OSError, KeyError, ValueError):
            continue
    return None


def cgroup_memory_room(cgroups: str = "/proc/self/cgroup", root: str = "/sys/fs/cgroup") -> Optional[int]:
    """Bytes this process's memory cgroup still lets it and its ranks take: its limit less its usage
    (v2 memory.max - memory.current, v1 memory.limit_in_bytes - memory.usage_in_bytes); None where
    there is no limit ("max", or v1's near-2**63 "unlimited") or it cannot be read. A container's limit
    is not in /proc/meminfo's MemAvailable, and its OOM killer acts on it."""
    names = {"v2": ("memory.max", "memory.current"), "v1": ("memory.limit_in_bytes", "memory.usage_in_bytes")}
    for folder, version in memory_cgroups(cgroups, root):
        try:
            limit_file, usage_file = (os.path.join(folder, n) for n in names[version])
            with open(limit_file) as f:
                limit = f.read().strip()
            with open(usage_file) as f:
                usage = int(f.read().strip())
        except (OSError, ValueError):
            continue
        if limit == "max" or not limit.isdigit() or int(limit) >= 1 << 60:
            return None
        return max(0, int(limit) - usage)
    return None


OOM_WHY = "the kernel's out-of-memory killer: memory ran out"


def killed_line(rank: object, code: int, oom_before: Optional[int], oom_after: Optional[int]) -> str:
    """What a job's line says of a rank killed by signal ``-code``: SIGKILL while the out-of-memory
    killer's count (oom_kills, read before the job and after) rose was, as far as can be told, its
    work; where the count cannot be read, nothing is added."""
    why = ""
    if code == -9 and oom_before is not None and oom_after is not None and oom_after > oom_before:
        why = f" ({OOM_WHY})"
    return f"rank {rank} was killed by {_signal_name(code)}{why}"


# The rank a job's line (run_job's, or a rank's own "[rank R] ..." from fail in rank.py) blames: the
# one killed or exiting, the one rank that did not reach the others; else the rank that said the line
_BLAMED = re.compile(r"(?:\[rank \d+\] )?rank (\d+) (?:was killed by|exited with code|did not reach)")
_SEVERAL = re.compile(r"(?:ranks [\d, ]+|a rank) did not reach")
_SAID_BY = re.compile(r"\[rank (\d+)\] ")


def blamed_rank(line: str) -> Optional[int]:
    """The one rank a job's failure ``line`` names as its cause; None where it names several, or
    none (a rendezvous that failed)."""
    found = _BLAMED.match(line)
    if found:
        return int(found.group(1))
    if _SEVERAL.search(line):
        return None
    found = _SAID_BY.match(line)
    return int(found.group(1)) if found else None


def write_rank_error(folder: Path, rank: int, status: str, line: str) -> None:
    """A rank's fatal error, kept for the launcher (which prints one line for the whole job)."""
    import json
    import threading
    import time

    path = folder / ERROR_FILE.format(rank)
    # a name per writer: the stall guard's thread and the main thread may both end the rank at once
    tmp = path.with_name(f"{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    tmp.write_text(json.dumps({"status": status, "line": line, "time": time.time()}))
    os.replace(tmp, path)


# What a rank says when a peer went away first (gloo, NCCL, sockets): an echo, never the cause
ECHOES = re.compile(r"connection closed by peer|connection reset by peer|remote worker crash|broken pipe|"
                    r"communicator was aborted|remote process exited", re.I)


def first_rank_error(folder: Path) -> Optional[Dict[str, object]]:
    """The earliest error a rank wrote into ``folder`` that is not an echo of a peer's exit (the files
    are removed). A rank that gives up (a timeout) closes its connections before its own line is written,
    so a peer's "connection closed" can come earlier; the echo is said only where nothing else was."""
    import json

    found = []
    for path in folder.glob(ERROR_FILE.format("*")):
        try:
            found.append(json.loads(path.read_text()))
        except (OSError, ValueError):
            pass
        path.unlink(missing_ok=True)
    return min(found, key=lambda e: (bool(ECHOES.search(str(e["line"]))), e["time"])) if found else None


def raise_on_signals() -> None:
    """SIGINT and SIGTERM raise torchrun's SignalException in the launcher, also between jobs
    and while torchrun's workers run (run_job keeps torchrun from installing its own). The
    exception asks torchrun to stop the ranks with SIGTERM whichever signal came: a rank ends at
    once on SIGTERM, even inside its imports or a C++ wait; ``received`` keeps the real one."""
    import signal

    from torch.distributed.elastic.multiprocessing.api import SignalException

    def handler(signum: int, _frame: object) -> None:
        e = SignalException(f"received {signal.Signals(signum).name}", signal.SIGTERM)
        e.received = signal.Signals(signum)
        raise e

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, handler)


_started_ranks = False  # run_job ran in this process: it is a launcher


def started_ranks() -> bool:
    return _started_ranks


def signal_of(e: BaseException) -> Optional[str]:
    """The signal's name where ``e`` is raise_on_signals' exception, else None."""
    sig = getattr(e, "received", None)
    return sig.name if sig is not None else None


TORCHRUN_SIGNALS = "SIGHUP,SIGQUIT"  # the signals torchrun itself handles; SIGINT and SIGTERM are ours


def grace_flags(parser: Any) -> List[str]:
    """torchrun flags this torch's torchrun takes (an unknown one stops it with a usage error; 2.11
    lacks --shutdown-timeout): --shutdown-timeout, its grace between SIGTERM and SIGKILL for the
    ranks (30 s by default); --signals-to-handle without SIGINT and SIGTERM, since torchrun's launcher
    writes that flag's value over TORCHELASTIC_SIGNALS_TO_HANDLE and its own handler would then stop
    the ranks with the SIGINT received, a KeyboardInterrupt traceback in a rank still importing
    (raise_on_signals stops them with SIGTERM instead)."""
    known = {o for action in getattr(parser, "_actions", ()) for o in action.option_strings}
    flags = [f"--shutdown-timeout={SHUTDOWN_GRACE_S}"] if "--shutdown-timeout" in known else []
    if "--signals-to-handle" in known:
        flags.append(f"--signals-to-handle={TORCHRUN_SIGNALS}")
    return flags


_stopped_by_launcher: Set[int] = set()  # local ranks still running when torchrun stopped the job


def stop_with_grace() -> None:
    """Makes torchrun stop a failed job's other ranks with the launcher's grace (SHUTDOWN_GRACE_S,
    as --shutdown-timeout asks) instead of a fixed 30 s: when a rank fails, torch's process context
    closes the rest from its poll with close()'s default timeout, which --shutdown-timeout does not
    reach (torch 2.11-2.13, torch/distributed/elastic/multiprocessing/api.py), so a rank that ignores
    SIGTERM (stopped by SIGSTOP, stuck in the driver) kept the job alive 30 s after the others had
    failed (measured: 42 s after a SIGSTOP with --control-timeout 10). Also notes which ranks were
    still running at that moment: a SIGKILL they get afterwards is torchrun's, not the job's cause.
    Where torch's process context is not shaped as read, nothing changes."""
    import inspect

    try:
        from torch.distributed.elastic.multiprocessing.api import PContext
    except ImportError:
        return
    close = PContext.__dict__.get("close")
    if close is None or getattr(close, "_epbench", False) or \
            list(inspect.signature(close).parameters) != ["self", "death_sig", "timeout"]:
        return

    def graceful_close(self: Any, death_sig: Any = None, timeout: int = 30) -> None:
        for local, handler in (getattr(self, "subprocess_handlers", None) or {}).items():
            proc = getattr(handler, "proc", None)
            if proc is not None and proc.poll() is None:
                _stopped_by_launcher.add(local)
        close(self, death_sig, min(timeout, SHUTDOWN_GRACE_S))

    graceful_close._epbench = True  # type: ignore[attr-defined]
    PContext.close = graceful_close


def run_job(torchrun: List[str], device: str, error_dir: Optional[Path] = None) -> Outcome:
    """Runs torchrun in this process and says how the job ended. torchrun's own failure report
    is replaced by one line: the ranks' own (from ``error_dir``), or which rank died and how."""
    import logging

    from torch.distributed import run as trun
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous import RendezvousError

    apply_rank_env()
    global _started_ranks
    _started_ranks = True
    os.environ[LAUNCHER_ENV] = f"{os.getpid()}:{process_start(os.getpid()) or ''}"
    # torchrun handles these two itself otherwise, and passes SIGINT on to the ranks
    os.environ["TORCHELASTIC_SIGNALS_TO_HANDLE"] = TORCHRUN_SIGNALS
    for name in ["torch.distributed.elastic", *logging.root.manager.loggerDict]:
        if name.startswith("torch.distributed.elastic"):  # the modules set their own levels
            logging.getLogger(name).setLevel(logging.CRITICAL)
    raise_on_signals()
    stop_with_grace()
    _stopped_by_launcher.clear()
    oom_before = oom_kills()
    try:
        trun.run(trun.parse_args([*grace_flags(trun.get_args_parser()), *torchrun]))
    except ChildFailedError as e:
        said = first_rank_error(error_dir) if error_dir is not None else None
        # A rank killed by a signal (an abort, a segfault, SIGKILL) is the cause: the others
        # only saw their connections to it close. SIGTERM is how torchrun stops the rest, and
        # SIGKILL after its grace for a rank still running when it stopped the job (one that
        # ignored SIGTERM): neither is the cause.
        killed = sorted((f.timestamp, r, f.exitcode) for r, f in e.failures.items()
                        if f.exitcode < 0 and f.exitcode != -15 and f.local_rank not in _stopped_by_launcher)
        if killed:
            _, rank, code = killed[0]
            return Outcome("failed", 1, killed_line(rank, code, oom_before, oom_kills()))
        if said:
            return Outcome(str(said["status"]), 1, str(said["line"]))
        own = sorted((f.timestamp, r) for r, f in e.failures.items() if f.local_rank not in _stopped_by_launcher)
        rank, failure = (own[0][1], e.failures[own[0][1]]) if own else e.get_first_failure()
        code = failure.exitcode
        line = (killed_line(rank, code, oom_before, oom_kills()) if code < 0
                else f"rank {rank} exited with code {code}")
        return Outcome("failed", code if code > 0 else 1, line)
    except SignalException as e:
        sig = getattr(e, "received", e.sigval)
        return Outcome("interrupted", SIGNAL_EXIT.get(sig.name, 128 + int(sig)), f"interrupted ({sig.name})")
    except RendezvousError as e:
        # the other nodes never came (wrong endpoint, a node not started, a firewall)
        from torch.distributed.elastic.rendezvous import RendezvousTimeoutError

        where = next((a.split("=", 1)[1] for a in torchrun if a.startswith("--rdzv-endpoint=")), "?")
        why = ("not every node joined in time (start the same command on every node; "
               "--rdzv-timeout waits longer)" if isinstance(e, RendezvousTimeoutError)
               else f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else 'no detail'}")
        return Outcome("failed", 1, f"the nodes could not meet at the rendezvous {where}: {why}")
    finally:
        raise_on_signals()
    if error_dir is not None:
        first_rank_error(error_dir)  # a rank that failed after the others finished cleanly
    return Outcome("complete")


def relaunch(torchrun: List[str], device: str) -> int:
    """Runs torchrun in this process; returns its exit code after one line for a failure."""
    out = run_job(torchrun, device)
    if out.line:
        print(f"epbench: error: {out.line}", file=sys.stderr)
    return out.code


def device_index(local_rank: int, device_count: int) -> int:
    """The GPU a rank runs on: its local rank, wrapped round when ranks outnumber the GPUs
    (several ranks then share one GPU, through the same code path)."""
    return local_rank % device_count if device_count > 0 else 0


def ranks_per_gpu(local_world: int, device_count: int) -> int:
    """How many of this host's ranks share the busiest GPU (1: each rank has its own)."""
    if device_count <= 0:
        return 1
    return -(-local_world // device_count)


def process_group_backend(device: str, shared: bool) -> str:
    """NCCL on GPUs, except where ranks share a GPU (NCCL refuses two ranks on one device):
    gloo then carries the bootstrap, gathers and barriers; the data still moves through the
    backends' own kernels and CUDA IPC."""
    return "nccl" if device == "cuda" and not shared else "gloo"


def mps_pipe_dir() -> str:
    return os.environ.get("CUDA_MPS_PIPE_DIRECTORY") or "/tmp/nvidia-mps"


def mps_active() -> bool:
    """True when an MPS control daemon serves this process's pipe folder (its ``control``
    socket accepts a connection: a daemon that was just told to quit can leave the file behind,
    seen on one H100 where such a run was recorded as MPS on): the ranks' kernels then run side
    by side instead of time-slicing."""
    import socket

    path = os.path.join(mps_pipe_dir(), "control")
    if not os.path.exists(path):
        return False
    if _daemon_alive(os.path.join(mps_pipe_dir(), "nvidia-cuda-mps-control.pid")):
        # its pid file names a live process (a quit daemon's file can outlive it). The socket test
        # alone said "off" on an H100 while the daemon's log showed both ranks as its clients
        # (2026-11-25): a connection without credentials is not always accepted.
        return True
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(1.0)
            s.connect(path)
        return True
    except OSError:
        return False


def _daemon_alive(pid_file: str) -> bool:
    try:
        with open(pid_file) as f:
            pid = int(f.read().strip())
    except (OSError, ValueError):
        return False
    return pid > 0 and os.path.exists(f"/proc/{pid}")


def shares_gpus() -> bool:
    """True in a rank whose GPU other ranks share: the process group is gloo on GPUs only then."""
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and dist.get_backend() != "nccl"


MPS_ENV = ("CUDA_MPS_PIPE_DIRECTORY", "CUDA_MPS_LOG_DIRECTORY")


def restore_env(before: Dict[str, Optional[str]]) -> None:
    """Puts os.environ's variables back to ``before`` (None: unset)."""
    for k, v in before.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@contextmanager
def environment(extra: Dict[str, str]) -> Iterator[Dict[str, str]]:
    """``extra`` set in os.environ (which torchrun's workers inherit) while the block runs; the
    variables it touched are put back after it."""
    before = {k: os.environ.get(k) for k in extra}
    os.environ.update(extra)
    try:
        yield extra
    finally:
        restore_env(before)


@contextmanager
def private_mps() -> Iterator[str]:
    """An MPS control daemon of this run's own (private pipe and log folders, which the ranks
    inherit), stopped at exit: ranks sharing a GPU then run side by side instead of taking
    turns. Yields the pipe folder. An MPS daemon already serving this process is used as is."""
    from epbench.errors import UserError

    if mps_active():
        yield mps_pipe_dir()
        return
    exe = shutil.which("nvidia-cuda-mps-control")
    if exe is None:
        raise UserError("--mps: nvidia-cuda-mps-control not found (it comes with the NVIDIA driver)")
    dirs = {k: tempfile.mkdtemp(prefix=f"epbench-mps-{k.split('_')[2].lower()}-") for k in MPS_ENV}
    before = {k: os.environ.get(k) for k in MPS_ENV}
    os.environ.update(dirs)
    try:
        r = subprocess.run([exe, "-d"], capture_output=True, text=True, timeout=60)
        if r.returncode != 0:
            why = (r.stderr or r.stdout).strip().splitlines()
            raise UserError(f"--mps: `nvidia-cuda-mps-control -d` failed (exit {r.returncode}"
                            f"{': ' + why[0] if why else ''}); starting MPS may need root")
        try:
            yield dirs["CUDA_MPS_PIPE_DIRECTORY"]
        finally:
            try:
                subprocess.run([exe], input="quit\n", capture_output=True, text=True, timeout=15)
            except subprocess.TimeoutExpired:
                # the daemon waits for its clients to go; one still open (a CUDA context of this
                # process, seen with `python -m epbench.llprobe --mps`) ends with this process
                print("note: MPS daemon asked to quit; it stops once this process exits", file=sys.stderr)
    finally:
        restore_env(before)
        for d in dirs.values():
            shutil.rmtree(d, ignore_errors=True)


@dataclass
class Comm:
    """This process's place in the job, and the one cross-rank sync the timing loop uses."""

    rank: int
    world: int
    local_rank: int
    device: "object"  # torch.device
    ranks_per_gpu: int = 1  # >1: ranks share GPUs (the process group then runs over gloo)
    control_timeout_s: float = 300.0  # barriers and gathers give up after this long
    _a2a: Optional[tuple] = None  # (out, in) of the alignment under switch align=alltoall
    _arrived: int = 0  # how many control-plane waits this rank has reached
    _phase: str = "start"

    @property
    def shared(self) -> bool:
        return self.ranks_per_gpu > 1

    @property
    def collective_device(self) -> "object":
        """Where tensors handed to torch.distributed live: the GPU under NCCL, else the CPU."""
        import torch

        return self.device if self.device.type == "cuda" and not self.shared else torch.device("cpu")

    @property
    def sync_on_stream(self) -> bool:
        """True where ``sync`` only queues work on the stream (NCCL, one rank per GPU) and never
        waits on the host."""
        return self.device.type == "cuda" and not self.shared

    def sync(self) -> None:
        """Align ranks before a timed call. On GPUs a one-element-per-peer NCCL all-to-all queued
        on the stream lines the ranks' streams up without a host round trip and releases every
        rank at once (switch align=allreduce: a one-element ring all-reduce, which releases them
        in ring order); where ranks share a GPU
        (gloo), each rank empties its stream and then meets the others at a barrier; on CPUs,
        a barrier."""
        import torch
        import torch.distributed as dist

        if self.device.type == "cuda" and not self.shared:
            if self._a2a is not None:  # align=alltoall (the default): every rank waits for every other
                dist.all_to_all_single(*self._a2a)
            else:
                dist.all_reduce(self._one)
            return
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        dist.barrier()
        if self.device.type == "cuda":
            # the synchronize drained the host lead the timer queued before this call: queue it
            # again, so that the timed call still starts after the host has queued it (timing.py)
            from epbench.timing import host_lead

            host_lead()

    def arrive(self, phase: str) -> None:
        """Marks this rank as having reached the wait named ``phase`` (in the job's store), so
        that a timeout can name the ranks that never came. Cheap: once per point, never inside
        the timed loop."""
        self._arrived += 1
        self._phase = phase
        store = _store()
        if store is not None:
            store.set(f"epbench/arrived/{self.rank}", str(self._arrived))

    def timeout_error(self, cause: BaseException, grace_s: Optional[float] = None) -> "Exception":
        """The error for a control-plane wait that gave up: names the ranks that never reached
        this rank's last wait. Ranks that reached it and timed out too say so in the store; the
        others are given a moment to do so (``grace_s``, default GAVE_UP_GRACE_S), then named."""
        import time

        from epbench.errors import ControlTimeout

        store = _store()
        missing: List[int] = []
        if store is not None:
            try:
                store.set(f"epbench/gave-up/{self.rank}", str(self._arrived))
                deadline = time.monotonic() + (GAVE_UP_GRACE_S if grace_s is None else grace_s)
                while True:
                    missing = [r for r in range(self.world) if not self._reached(store, r)]
                    if not missing or time.monotonic() > deadline:
                        break
                    time.sleep(0.1)
            except Exception:  # the store went away with its host: say what we know
                missing = []
        who = (f"rank{'s' if len(missing) > 1 else ''} {', '.join(map(str, missing))}" if missing
               else "a rank")
        return ControlTimeout(f"{who} did not reach the others in '{self._phase}' within "
                              f"{self.control_timeout_s:g} s (--control-timeout)")

    def _reached(self, store: "object", rank: int) -> bool:
        """True when ``rank`` waits where this rank does (it gave up there too) or got further."""
        gave_up, arrived = f"epbench/gave-up/{rank}", f"epbench/arrived/{rank}"
        return ((store.check([gave_up]) and int(store.get(gave_up)) >= self._arrived)
                or (store.check([arrived]) and int(store.get(arrived)) > self._arrived))

    def init_sync(self) -> None:
        import torch

        if self.device.type == "cuda" and not self.shared:
            self._one = torch.ones(1, device=self.device)
            from epbench import options

            self.use_align(options.diagnostic("align"))

    def use_align(self, kind: str) -> None:
        """Makes ``sync`` the NCCL alignment ``kind`` (alltoall or allreduce; GPUs with one rank each
        only, elsewhere the barrier stays) and runs it once, untimed and ungated: NCCL connects a
        collective's channels on its first call, which may wait on the host; that must not happen
        behind a closed host gate (timing.py)."""
        import torch

        if self.device.type != "cuda" or self.shared:
            return
        self._a2a = ((torch.empty(self.world, device=self.device), torch.ones(self.world, device=self.device))
                     if kind == "alltoall" else None)
        self.sync()
        torch.cuda.synchronize(self.device)

    @property
    def align_kind(self) -> str:
        """The NCCL alignment ``sync`` runs (GPUs, one rank each), or "barrier"."""
        if self.device.type != "cuda" or self.shared:
            return "barrier"
        return "alltoall" if self._a2a is not None else "allreduce"


GAVE_UP_GRACE_S = 2.0  # how long a rank that timed out waits to hear which others did too


def _store() -> Optional["object"]:
    from torch.distributed import distributed_c10d

    try:
        return distributed_c10d._get_default_store()
    except (RuntimeError, ValueError):
        return None


def is_timeout(e: BaseException) -> bool:
    """A torch.distributed wait that gave up (gloo and the store raise RuntimeError subclasses
    whose text says so)."""
    text = str(e).lower()
    return isinstance(e, RuntimeError) and ("timed out" in text or "timeout" in text)


def init_distributed(device: str, timeout_s: float = 300.0) -> Comm:
    """Joins the process group; every barrier and gather (and the bootstrap) gives up after
    ``timeout_s``."""
    import torch
    import torch.distributed as dist

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ["LOCAL_RANK"])
    per_gpu = 1
    if device == "cuda":
        count = torch.cuda.device_count()
        per_gpu = ranks_per_gpu(int(os.environ.get("LOCAL_WORLD_SIZE", world)), count)
        dev = torch.device("cuda", device_index(local_rank, count))
        torch.cuda.set_device(dev)
    else:
        dev = torch.device("cpu")
        torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
    backend = process_group_backend(device, per_gpu > 1)
    if not dist.is_initialized():
        kwargs = {"device_id": dev} if backend == "nccl" else {}
        try:
            dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s), **kwargs)
        except RuntimeError as e:
            if not is_timeout(e):
                raise
            from epbench.errors import ControlTimeout

            raise ControlTimeout(f"not every rank joined the process group within {timeout_s:g} s "
                                 f"(--control-timeout)") from e
    comm = Comm(rank, world, local_rank, dev, per_gpu, timeout_s)
    comm.init_sync()
    return comm
