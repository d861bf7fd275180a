"""GPU checks of the hierarchical kernels (backend epbench-hier, issue #5) on virtual nodes of this
host: one torchrun launch of tests/gpu/hier_worker.py runs every configuration below in turn (every
edge case against epbench.verify, a backend per case), then a missing peer against the timeout once
per gpus_per_node (the check does not depend on the transport), in one process group with one
NVSHMEM start (gpus_per_node is per backend, not per NVSHMEM start); each test reads its own
configuration's line, so a failure names its failed cases. Then the whole pipeline through `epbench
run` on the 2 x 2 virtual-node scenario with the NCCL reference beside it, every point verified, and a
bootstrap that cannot start: these two runs start as the session's tests begin (gpu_launch.EARLY_RUNS,
gpu_launch.GpuRuns)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Iterator, Optional

import pytest
from epbench.results import load_run
from gpu_launch import EARLY_RUNS, GPUS, ROOT, GpuRuns, SuiteLaunches, mps_on, needs_nvshmem_gpus, shared

torch = pytest.importorskip("torch")

WORKER = ROOT / "tests" / "gpu" / "hier_worker.py"
WORLD = 4
# (gpus_per_node, transport, quick): every case over the default transport on 2 x 2, the quick ones
# over each forced transport on 2 x 2 and on 4 x 1
CONFIGS = [(2, "auto", False), (2, "put", True), (2, "direct", True), (1, "put", True), (1, "direct", True)]

pytestmark = needs_nvshmem_gpus(4)  # 2 virtual nodes x 2


@pytest.fixture(scope="module")
def built() -> None:
    from epbench import nvshmem_lib

    if not nvshmem_lib.LIB_PATH.exists():  # loading it here would pull libnvshmem_host into pytest
        pytest.skip(f"{nvshmem_lib.NOT_BUILT} ({nvshmem_lib.LIB_PATH} is missing)")


def epbench_run(*args: str):
    return lambda folder: [sys.executable, "-m", "epbench", "run", "scenarios/h200x2x2-virtual.yaml", *args,
                           "--results", str(folder / "r")]


# a bootstrap that cannot start: no such network interface for NVSHMEM's unique-id socket
NO_SUCH_IF = {"NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME": "epbench-no-such-if"}
RUNS = {"virtual": epbench_run("--backends", "reference,epbench-hier", "--sms", "16"),
        "startup failure": lambda folder: ["env", *(f"{k}={v}" for k, v in NO_SUCH_IF.items()),
                                           *epbench_run("--backends", "epbench-hier", "--sms", "8",
                                                        "--no-ceilings")(folder)]}


def _runs(base: Path) -> Optional[GpuRuns]:
    from epbench import nvshmem_lib

    if not nvshmem_lib.LIB_PATH.exists() or (GPUS < WORLD and not mps_on()):
        return None
    # side by side where the pool has room (the failing bootstrap ends in seconds); a hang of it fails in 300 s
    return GpuRuns(base, RUNS, gpus={name: min(WORLD, GPUS) for name in RUNS}, per_gpu=2, timeout=600,
                   timeouts={"startup failure": 300})


EARLY_RUNS.add(__file__, _runs, "runs")


@pytest.fixture(scope="module")
def runs(built: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[GpuRuns]:
    with EARLY_RUNS.set_of(__file__, tmp_path_factory) as started:
        yield started


def suite_name(gpus_per_node: int, transport: str, quick: bool) -> str:
    return f"g{gpus_per_node}-{transport}{'-quick' if quick else ''}"


@pytest.fixture(scope="module")
def hier_suites(built: None) -> SuiteLaunches:
    """The launch of every configuration, run once for this module's tests (it takes about the
    start-up of one launch plus the cases of all five; the worker prints each suite's seconds)."""
    launches = SuiteLaunches(WORKER)
    for g, transport, quick in CONFIGS:
        launches.add(WORLD, "hier", suite_name(g, transport, quick),
                     ["--gpus-per-node", str(g), "--transport", transport, *(["--quick"] if quick else [])])
    launches.launch(WORLD)
    return launches


@pytest.mark.parametrize("gpus_per_node,transport,quick", CONFIGS)
def test_hier_kernels_match_verification(hier_suites: SuiteLaunches, gpus_per_node: int, transport: str,
                                         quick: bool) -> None:
    name = suite_name(gpus_per_node, transport, quick)
    out = hier_suites.assert_passed(WORLD, f"suite {name} world={WORLD}",
                                    f"missing peer world={WORLD} gpus_per_node={gpus_per_node}")
    print("\n".join(out.splitlines()[-2:]))  # the suite's time and its line


def test_virtual_scenario_runs_verified(runs: GpuRuns) -> None:
    r, folder = runs.get("virtual")
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    (run,) = list((folder / "r").iterdir())
    df = load_run(run)[1]  # measured rows (skipped / failed ones aside)
    # the NCCL reference needs a GPU per rank: skipped where the 4 ranks share GPUs
    assert set(df["backend"]) == {"epbench-hier"} | (set() if shared(4) else {"reference"})
    assert int(df["wrong"].sum()) == 0
    hier = df[df["backend"] == "epbench-hier"]
    assert (hier["nic_bytes"] > 0).all() and hier["nic_virtual"].all()


def test_nvshmem_startup_failure_is_one_line(runs: GpuRuns) -> None:
    """A bootstrap that cannot start (no such network interface for NVSHMEM's unique-id socket) ends
    the run with one epbench line naming NVSHMEM, not a hang or a bare exit."""
    r, _ = runs.get("startup failure")
    out = r.stdout + r.stderr
    assert r.returncode == 1, out[-4000:]
    assert "Traceback" not in out, out[-4000:]
    lines = [ln for ln in out.splitlines() if ln.startswith("epbench: error:") and "NVSHMEM could not start" in ln]
    assert lines, out[-4000:]
    print(lines[0])
