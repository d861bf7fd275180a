"""Multi-node launch: the flags torchrun gets, and startup failures as one clear line."""

from __future__ import annotations

import os

import socket
import sys

from epbench.launch import torchrun_args
from support import epbench, epbench_here


def test_single_node_is_standalone_and_multi_node_uses_c10d():
    one = torchrun_args(["r/plan.json", "0"], 4)
    assert "--standalone" in one and one[-4:] == ["-m", "epbench.rank", "r/plan.json", "0"]
    many = torchrun_args(["r/plan.json", "0"], 8, nnodes=4, node_rank=2, rdzv_endpoint="h:1",
                         rdzv_timeout_s=30)
    assert {"--nnodes=4", "--rdzv-backend=c10d", "--rdzv-endpoint=h:1", "--node-rank=2",
            "--rdzv-conf=join_timeout=30"} <= set(many)
    assert "--standalone" not in many
    probe = torchrun_args(["--tokens", "1"], 2, module="epbench.llprobe")
    assert probe[-4:] == ["-m", "epbench.llprobe", "--tokens", "1"] and "--nproc-per-node=2" in probe


TWO_NODES = """
model: {hidden: 256, tokens_per_rank: 16, topk: 4, experts_per_rank: 4}
topology: {nodes: 2, gpus_per_node: 2}
bench: {warmup: 1, iters: 2, backends: [reference], device: cpu}
"""


def test_a_node_left_alone_stops_with_one_line(tmp_path, write_scenario):
    path = write_scenario("two-nodes", TWO_NODES)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    r = epbench("run", path, "--nnodes", "2", "--node-rank", "0", "--rdzv-endpoint",
                f"127.0.0.1:{port}", "--rdzv-timeout", "2", "--results", tmp_path / "r")
    assert r.code == 1
    lines = [ln for ln in r.err.splitlines() if ln.strip()]
    assert lines == [lines[0]] and "could not meet at the rendezvous" in lines[0]
    assert not (tmp_path / "r").exists() or not any((tmp_path / "r").iterdir())  # nothing half-made


def test_multi_node_flags_are_checked_before_anything_starts(write_scenario):
    path = write_scenario("two-nodes", TWO_NODES)
    for args, needle in ((["--nnodes", "2"], "--rdzv-endpoint"),
                         (["--nnodes", "3", "--rdzv-endpoint", "h:1"], "describes 2 node(s)"),
                         (["--nnodes", "2", "--rdzv-endpoint", "h:1", "--rdzv-timeout", "0"],
                          "--rdzv-timeout"),
                         (["--nnodes", "-1", "--rdzv-endpoint", "h:1"], "--nnodes: must be at least 1"),
                         (["--nnodes", "0"], "--nnodes: must be at least 1"),
                         (["--nnodes", "2", "--node-rank", "2", "--rdzv-endpoint", "h:1"],
                          "--node-rank: must be 0 to 1 (--nnodes 2), got 2"),
                         (["--node-rank", "-3"], "--node-rank: must be 0 to 0"),
                         (["--nnodes", "2", "--node-rank", "0", "--rdzv-endpoint", "127.0.0.1"],
                          "--rdzv-endpoint: give HOST:PORT"),
                         (["--nnodes", "2", "--node-rank", "0", "--rdzv-endpoint", "127.0.0.1:70000"],
                          "a port 1-65535"),
                         (["--nnodes", "2", "--node-rank", "0", "--rdzv-endpoint", "no-such-host.invalid:29500"],
                          "--rdzv-endpoint: cannot look up host 'no-such-host.invalid'")):
        r = epbench_here("run", path, *args)
        assert r.code == 2 and needle in r.err and len(r.err.strip().splitlines()) == 1


# ---- ranks sharing GPUs ----

def test_device_index_wraps_round_the_gpus():
    from epbench.launch import device_index

    assert [device_index(r, 4) for r in range(4)] == [0, 1, 2, 3]  # one GPU per rank
    assert [device_index(r, 1) for r in range(4)] == [0, 0, 0, 0]  # four ranks on one GPU
    assert [device_index(r, 2) for r in range(4)] == [0, 1, 0, 1]
    assert device_index(3, 0) == 0


def test_process_group_is_gloo_wherever_ranks_share_a_gpu():
    from epbench.launch import process_group_backend, ranks_per_gpu

    assert ranks_per_gpu(4, 4) == 1 and ranks_per_gpu(8, 8) == 1 and ranks_per_gpu(2, 8) == 1
    assert ranks_per_gpu(4, 1) == 4 and ranks_per_gpu(3, 2) == 2 and ranks_per_gpu(4, 0) == 1
    assert process_group_backend("cuda", shared=False) == "nccl"
    assert process_group_backend("cuda", shared=True) == "gloo"  # NCCL refuses two ranks on one GPU
    assert process_group_backend("cpu", shared=False) == "gloo"


def test_shared_comm_puts_collectives_on_the_host():
    import torch

    from epbench.launch import Comm

    gpu = torch.device("cuda", 0)
    assert Comm(0, 4, 0, gpu, ranks_per_gpu=4).collective_device == torch.device("cpu")
    assert Comm(0, 4, 0, gpu).collective_device == gpu and not Comm(0, 4, 0, gpu).shared


def test_alignment_kind_is_a_barrier_off_nccl_and_use_align_leaves_it():
    import torch

    from epbench.launch import Comm

    cpu = Comm(0, 2, 0, torch.device("cpu"))
    cpu.use_align("alltoall")  # gloo: the barrier stays, nothing is queued
    assert cpu.align_kind == "barrier" and cpu._a2a is None
    shared = Comm(0, 4, 0, torch.device("cuda", 0), ranks_per_gpu=4)
    shared.use_align("alltoall")
    assert shared.align_kind == "barrier"
    assert Comm(0, 2, 0, torch.device("cuda", 0)).align_kind == "allreduce"  # before init_sync: no all-to-all


def test_mps_is_on_only_where_its_control_socket_is(monkeypatch, tmp_path):
    from epbench.launch import mps_active

    import socket

    monkeypatch.setenv("CUDA_MPS_PIPE_DIRECTORY", str(tmp_path))
    assert not mps_active()
    (tmp_path / "control").touch()
    assert not mps_active()  # a file left behind by a daemon that quit: nobody answers
    pid_file = tmp_path / "nvidia-cuda-mps-control.pid"
    pid_file.write_text("999999999\n")  # its pid file too, naming no live process
    assert not mps_active()
    pid_file.write_text(f"{os.getpid()}\n")  # a live daemon's pid (this process stands in)
    assert mps_active()
    pid_file.unlink()
    (tmp_path / "control").unlink()
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:
        listener.bind(str(tmp_path / "control"))
        listener.listen(1)
        assert mps_active()


def test_private_mps_daemon_starts_serves_the_ranks_and_stops(monkeypatch, tmp_path):
    """A stand-in nvidia-cuda-mps-control: `-d` creates the control socket in the pipe folder it
    is given, `quit` on stdin is logged. The run's environment points at private folders while
    the daemon runs (the ranks inherit them), and is restored after."""
    import os
    import stat

    from epbench import launch

    log = tmp_path / "calls"
    exe = tmp_path / "bin" / "nvidia-cuda-mps-control"
    exe.parent.mkdir()
    # bound under another name and renamed once listening: the shell loop below must not see the
    # socket between bind and listen (a connection then is refused; seen once in CI under load)
    listen = ("import os, socket, sys, time; s = socket.socket(socket.AF_UNIX); s.bind(sys.argv[1] + '.tmp'); "
              "s.listen(4); os.rename(sys.argv[1] + '.tmp', sys.argv[1]); time.sleep(60)")
    pid = tmp_path / "pid"
    exe.write_text(f'#!/bin/sh\nif [ "$1" = "-d" ]; then "{sys.executable}" -c "{listen}" '
                   f'"$CUDA_MPS_PIPE_DIRECTORY/control" > /dev/null 2>&1 & echo $! > {pid}; '
                   f'while [ ! -S "$CUDA_MPS_PIPE_DIRECTORY/control" ]; do sleep 0.05; done; '
                   f'echo start >> {log}; else cat >> {log}; kill $(cat {pid}); fi\n')
    exe.chmod(exe.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{exe.parent}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("CUDA_MPS_PIPE_DIRECTORY", str(tmp_path / "none"))
    monkeypatch.delenv("CUDA_MPS_LOG_DIRECTORY", raising=False)
    with launch.private_mps() as pipe:
        assert os.environ["CUDA_MPS_PIPE_DIRECTORY"] == pipe != str(tmp_path / "none")
        assert launch.mps_active()
    assert log.read_text().split() == ["start", "quit"]
    assert os.environ["CUDA_MPS_PIPE_DIRECTORY"] == str(tmp_path / "none")
    assert "CUDA_MPS_LOG_DIRECTORY" not in os.environ and not os.path.exists(pipe)


def test_private_mps_without_the_control_program_is_one_clear_error(monkeypatch, tmp_path):
    import pytest

    from epbench import launch
    from epbench.errors import UserError

    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setenv("CUDA_MPS_PIPE_DIRECTORY", str(tmp_path / "none"))
    with pytest.raises(UserError, match="nvidia-cuda-mps-control not found"):
        with launch.private_mps():
            pass


# ---- ranks die with their launcher ----

def test_launcher_gone_tells_a_live_process_from_a_dead_or_reused_pid_on_its_own_host():
    from epbench.launch import launcher_gone, launcher_record

    me = launcher_record()
    assert me["pid"] == os.getpid() and launcher_gone(me) is False
    assert launcher_gone(dict(me, start="1")) is True  # the pid now names another process
    assert launcher_gone(dict(me, boot_id="rebooted-since")) is True
    assert launcher_gone(dict(me, host=me["host"] + "-elsewhere")) is None
    assert launcher_gone(None) is None


def test_a_rank_dies_with_its_launcher_even_when_that_is_not_its_parent():
    import subprocess
    import time

    from epbench.launch import LAUNCHER_ENV, process_start

    launcher = subprocess.Popen(["sleep", "60"])
    env = dict(os.environ, **{LAUNCHER_ENV: f"{launcher.pid}:{process_start(launcher.pid)}"})
    rank = subprocess.Popen([sys.executable, "-c", "import time; from epbench import launch; "
                             "launch.guard_rank(); print('guarded', flush=True); time.sleep(60)"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert rank.stdout.readline() == "guarded\n"
    launcher.kill()
    launcher.wait()
    start = time.monotonic()
    out, err = rank.communicate(timeout=10)
    assert time.monotonic() - start < 2 and rank.returncode == 1 and not err


def test_the_shutdown_grace_flag_only_where_torchrun_takes_it():
    """torch 2.11's torchrun has no --shutdown-timeout and stops with a usage error on it (seen on
    the GPU hosts): the flag goes only to a torchrun whose parser lists it."""
    import argparse

    from torch.distributed import run as trun

    from epbench.launch import SHUTDOWN_GRACE_S, grace_flags

    old = argparse.ArgumentParser()
    old.add_argument("--nproc-per-node")
    assert grace_flags(old) == []
    new = argparse.ArgumentParser()
    new.add_argument("--shutdown-timeout", type=int)
    assert grace_flags(new) == [f"--shutdown-timeout={SHUTDOWN_GRACE_S}"]
    # torchrun's launcher writes --signals-to-handle over TORCHELASTIC_SIGNALS_TO_HANDLE: without the
    # flag its default (SIGINT included) came back and the ranks got the SIGINT (a KeyboardInterrupt
    # traceback from a rank still importing, seen 1 in 25 times)
    new.add_argument("--signals-to-handle")
    assert grace_flags(new)[-1] == "--signals-to-handle=SIGHUP,SIGQUIT"
    trun.parse_args([*grace_flags(trun.get_args_parser()), "--standalone", "-m", "epbench"])  # this torch takes it


def test_ranks_start_without_nccls_timeout_dump_unless_the_user_asks(monkeypatch):
    """A rank stopped by SIGSTOP kept its peer's NCCL watchdog dumping for over 30 s (2 x H200, 2026-11-26)."""
    import os

    from epbench import launch

    monkeypatch.delenv("TORCH_NCCL_DUMP_ON_TIMEOUT", raising=False)
    monkeypatch.delenv("TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC", raising=False)
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "1")
    launch.apply_rank_env()
    assert os.environ["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "0" and os.environ["NCCL_NVLS_ENABLE"] == "0"
    # the watchdog sleeps 4 x this after a timeout before it ends the rank (60 s by torch's default)
    assert int(os.environ["TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC"]) <= 1000
    monkeypatch.setenv("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")
    launch.apply_rank_env()
    assert os.environ["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"  # the user's own setting wins


def test_the_out_of_memory_killers_count_is_read_from_this_processs_cgroup(tmp_path):
    """cgroup v2's memory.events, else v1's memory.oom_control; None where neither is readable."""
    from epbench.launch import oom_kills

    root = tmp_path / "cg"
    (root / "box" / "job").mkdir(parents=True)
    (root / "box" / "job" / "memory.events").write_text("low 0\nhigh 0\nmax 3\noom 2\noom_kill 2\n")
    v2 = tmp_path / "v2"
    v2.write_text("0::/box/job\n")
    assert oom_kills(str(v2), str(root)) == 2
    (root / "memory" / "m").mkdir(parents=True)
    (root / "memory" / "m" / "memory.oom_control").write_text("oom_kill_disable 0\nunder_oom 0\noom_kill 5\n")
    v1 = tmp_path / "v1"
    v1.write_text("9:cpu,cpuacct:/c\n4:memory:/m\n0::/\n")  # v1 memory beside an empty v2 hierarchy
    assert oom_kills(str(v1), str(root)) == 5
    (root / "box" / "job" / "memory.events").write_text("oom 1\n")  # a kernel before 4.13
    assert oom_kills(str(v2), str(root)) is None
    assert oom_kills(str(tmp_path / "none"), str(root)) is None
    v2.write_text("0::/gone\n")
    assert oom_kills(str(v2), str(root)) is None


def test_the_room_a_memory_cgroup_leaves_is_its_limit_less_its_usage(tmp_path):
    """v2 memory.max - memory.current, v1 limit_in_bytes - usage_in_bytes; no limit ("max", v1's
    unlimited) or nothing readable: None; never below 0."""
    from epbench.launch import cgroup_memory_room

    root = tmp_path / "cg"
    (root / "box").mkdir(parents=True)
    (root / "box" / "memory.max").write_text("8589934592\n")
    (root / "box" / "memory.current").write_text("2147483648\n")
    v2 = tmp_path / "v2"
    v2.write_text("0::/box\n")
    assert cgroup_memory_room(str(v2), str(root)) == 6 << 30
    (root / "box" / "memory.current").write_text(str(9 << 30))
    assert cgroup_memory_room(str(v2), str(root)) == 0
    (root / "box" / "memory.max").write_text("max\n")
    assert cgroup_memory_room(str(v2), str(root)) is None
    (root / "memory" / "m").mkdir(parents=True)
    (root / "memory" / "m" / "memory.limit_in_bytes").write_text(str(4 << 30))
    (root / "memory" / "m" / "memory.usage_in_bytes").write_text(str(1 << 30))
    v1 = tmp_path / "v1"
    v1.write_text("4:memory:/m\n0::/\n")
    assert cgroup_memory_room(str(v1), str(root)) == 3 << 30
    (root / "memory" / "m" / "memory.limit_in_bytes").write_text("9223372036854771712")  # v1's unlimited
    assert cgroup_memory_room(str(v1), str(root)) is None
    assert cgroup_memory_room(str(tmp_path / "none"), str(root)) is None


def test_the_host_memory_a_cpu_run_may_take_is_held_to_its_cgroup(monkeypatch):
    from epbench import cli, launch

    monkeypatch.setattr(cli, "_kib_field", lambda path, key: 64 << 30)
    monkeypatch.setattr(launch, "cgroup_memory_room", lambda: 10 << 30)
    assert cli._host_memory() == 10 << 30
    monkeypatch.setattr(launch, "cgroup_memory_room", lambda: None)
    assert cli._host_memory() == 64 << 30


def test_a_rank_killed_while_the_out_of_memory_killer_acted_says_so():
    from epbench.launch import killed_line

    assert killed_line(1, -9, 0, 1) == ("rank 1 was killed by SIGKILL (the kernel's out-of-memory "
                                        "killer: memory ran out)")
    assert killed_line(1, -9, 1, 1) == "rank 1 was killed by SIGKILL"
    assert killed_line(1, -9, None, 3) == killed_line(1, -9, 0, None) == "rank 1 was killed by SIGKILL"
    assert killed_line(2, -6, 0, 1) == "rank 2 was killed by SIGABRT"  # the OOM killer sends SIGKILL only


def test_the_rank_a_failure_line_blames():
    from epbench.launch import blamed_rank

    assert blamed_rank("rank 3 was killed by SIGKILL") == 3
    assert blamed_rank("rank 2 exited with code 1") == 2
    assert blamed_rank("[rank 0] rank 3 did not reach the others in 'x' within 8 s (--control-timeout)") == 3
    assert blamed_rank("[rank 1] rank 3 did not reach the others in 'x' within 8 s; a timed call made no "
                       "progress for 12 s") == 3
    assert blamed_rank("[rank 0] ranks 2, 3 did not reach the others in 'x' within 8 s") is None
    assert blamed_rank("[rank 0] a rank did not reach the others in 'x' within 8 s") is None
    assert blamed_rank("[rank 1] RuntimeError: boom") == 1
    assert blamed_rank("the nodes could not meet at the rendezvous h:1: why") is None
