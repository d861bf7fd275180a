"""The symm-mem backend (torch's NVSHMEM all-to-all) through `epbench run`, every point verified:
2 ranks on separate GPUs where the host has them; 2 ranks sharing GPU 0 under MPS only check the
one-line skip (torch's NVSHMEM refuses several processes per GPU, measured on one H100). rank_major on the shipped
DeepSeek-V3 shape (all_to_all_vdev); expert_major with 4 experts per rank (all_to_all_vdev_2d
takes at most 16), bf16 and fp8. The runs on separate GPUs start as the session's tests begin
(gpu_launch.EARLY_RUNS, gpu_launch.GpuRuns); the MPS case waits until every such run has ended."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Callable, Dict, Iterator, List, Optional

import pytest
import yaml
from epbench.results import load_run
from gpu_launch import EARLY_RUNS, GPUS, ROOT, GpuRuns, safe_env, shares_gpus, wait_for_every_run

torch = pytest.importorskip("torch")

pytestmark = shares_gpus()

QUICK = ["--sms", "16", "--iters", "5", "--warmup", "1", "--no-ceilings"]


def nvshmem_available() -> bool:
    import torch.distributed._symmetric_memory as symm_mem

    return symm_mem.is_nvshmem_available()


@pytest.fixture(scope="module", autouse=True)
def nvshmem() -> None:
    if not nvshmem_available():
        pytest.skip("torch's NVSHMEM is not usable here")


def expert_major_scenario(folder: Path, dtype: str) -> Path:
    data = {"description": "2 ranks, expert-major, 4 experts per rank",
            "model": {"hidden": 7168, "tokens_per_rank": 2048, "topk": 4, "experts_per_rank": 4,
                      "dispatch_dtype": dtype, "layout": "expert_major", "align": 128},
            "topology": {"name": "2 ranks", "nodes": 1, "gpus_per_node": 2},
            "routing": {"kind": "uniform", "seed": 0},
            "bench": {"warmup": 1, "iters": 5, "backends": ["symm-mem"], "sms": [16], "device": "cuda"}}
    path = folder / f"symm-em-{dtype}.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def command(scenario: Callable[[Path], str], *extra: str) -> Callable[[Path], List[str]]:
    return lambda folder: [sys.executable, "-m", "epbench", "run", scenario(folder), "--nproc", "2", "--backends",
                           "symm-mem", *QUICK, *extra, "--results", str(folder / "r")]


RANK_MAJOR = lambda folder: "scenarios/dsv3x2.yaml"  # noqa: E731
EXPERT_MAJOR = {dtype: (lambda folder, d=dtype: str(expert_major_scenario(folder, d))) for dtype in ("bf16", "fp8")}
SEPARATE = {"rank-major": command(RANK_MAJOR), **{f"expert-major {d}": command(s) for d, s in EXPERT_MAJOR.items()}}


def _runs(base: Path) -> Optional[GpuRuns]:
    """The runs of 2 ranks on separate GPUs (one job of this set on a GPU at a time)."""
    if GPUS < 2 or not nvshmem_available():
        return None
    return GpuRuns(base, SEPARATE, gpus={name: 2 for name in SEPARATE})


EARLY_RUNS.add(__file__, _runs, "runs")


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Optional[GpuRuns]]:
    started = EARLY_RUNS.set_of(__file__, tmp_path_factory)
    yield started
    if started is not None:
        started.close()


def check(r: subprocess.CompletedProcess, results: Path, shared: bool) -> None:
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    (folder,) = list(results.iterdir())
    if shared:  # torch's NVSHMEM refuses ranks sharing a GPU (measured): a skipped row, nothing run
        assert "needs one GPU per rank" in r.stdout, r.stdout[-4000:]
        return
    df = load_run(folder)[1]  # measured rows: a skipped backend leaves none
    assert set(df["backend"]) == {"symm-mem"}, r.stdout[-4000:]
    assert int(df["wrong"].sum()) == 0, r.stdout[-4000:]
    assert set(df["op"]) == {"dispatch", "combine"}
    print(r.stdout.strip().splitlines()[-1])


def run_shared(tmp_path: Path, scenario: Callable[[Path], str]) -> None:
    """2 ranks sharing GPU 0 under MPS, run here once every run of this session's sets has ended (its own
    MPS daemon serves GPU 0: nothing else may be beside it)."""
    wait_for_every_run()
    env: Dict[str, str] = dict(safe_env(), CUDA_VISIBLE_DEVICES="0")
    r = subprocess.run(command(scenario, "--mps")(tmp_path), cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=600)
    check(r, tmp_path / "r", shared=True)


def run_separate(runs: Optional[GpuRuns], name: str) -> None:
    assert runs is not None
    r, folder = runs.get(name)
    check(r, folder / "r", shared=False)


SEPARATE_GPUS = pytest.mark.skipif(GPUS < 2, reason="needs >= 2 CUDA GPUs (one per rank)")


def test_rank_major_dsv3_verifies_shared_gpu_mps(tmp_path: Path) -> None:
    run_shared(tmp_path, RANK_MAJOR)


@SEPARATE_GPUS
def test_rank_major_dsv3_verifies_separate_gpus(runs: Optional[GpuRuns]) -> None:
    run_separate(runs, "rank-major")


def test_expert_major_verifies_shared_gpu_mps(tmp_path: Path) -> None:
    """Ranks sharing a GPU only get the skip line, which the dtype does not enter (SymmMemBackend.
    unavailable_reason): one dtype here; both where the ranks have a GPU each."""
    run_shared(tmp_path, EXPERT_MAJOR["bf16"])


@SEPARATE_GPUS
@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
def test_expert_major_verifies_separate_gpus(runs: Optional[GpuRuns], dtype: str) -> None:
    run_separate(runs, f"expert-major {dtype}")
