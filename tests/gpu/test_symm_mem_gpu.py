"""The symm-mem backend (torch's NVSHMEM all-to-all) through `epbench run`, every point verified:
2 ranks on separate GPUs where the host has them; 2 ranks sharing GPU 0 under MPS only check the
one-line skip (torch's NVSHMEM refuses several processes per GPU, measured on one H100). rank_major on the shipped
DeepSeek-V3 shape (all_to_all_vdev); expert_major with 4 experts per rank (all_to_all_vdev_2d
takes at most 16), bf16 and fp8."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Dict, List

import pytest
import yaml
from epbench.results import load_run
from gpu_launch import EARLY_RUNS, GPUS, ROOT, safe_env, shares_gpus

torch = pytest.importorskip("torch")

pytestmark = shares_gpus()

QUICK = ["--sms", "16", "--iters", "5", "--warmup", "1", "--no-ceilings"]


@pytest.fixture(scope="module", autouse=True)
def nvshmem() -> None:
    import torch.distributed._symmetric_memory as symm_mem

    if not symm_mem.is_nvshmem_available():
        pytest.skip("torch's NVSHMEM is not usable here")


def expert_major_scenario(tmp_path: Path, dtype: str) -> Path:
    data = {"description": "2 ranks, expert-major, 4 experts per rank",
            "model": {"hidden": 7168, "tokens_per_rank": 2048, "topk": 4, "experts_per_rank": 4,
                      "dispatch_dtype": dtype, "layout": "expert_major", "align": 128},
            "topology": {"name": "2 ranks", "nodes": 1, "gpus_per_node": 2},
            "routing": {"kind": "uniform", "seed": 0},
            "bench": {"warmup": 1, "iters": 5, "backends": ["symm-mem"], "sms": [16], "device": "cuda"}}
    path = tmp_path / f"symm-em-{dtype}.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def run(tmp_path: Path, scenario: str, shared: bool) -> None:
    if shared:  # its own MPS daemon serves GPU 0: nothing of the early-started runs still beside it
        EARLY_RUNS.wait()
    env: Dict[str, str] = dict(safe_env(), **({"CUDA_VISIBLE_DEVICES": "0"} if shared else {}))
    extra: List[str] = ["--mps"] if shared else []
    results = tmp_path / "r"
    r = subprocess.run([sys.executable, "-m", "epbench", "run", scenario, "--nproc", "2", "--backends",
                        "symm-mem", *QUICK, *extra, "--results", str(results)],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
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


PLACES = [True] + ([False] if GPUS >= 2 else [])


@pytest.mark.parametrize("shared", PLACES, ids=lambda s: "shared-gpu-mps" if s else "separate-gpus")
def test_rank_major_dsv3_verifies(tmp_path: Path, shared: bool) -> None:
    run(tmp_path, "scenarios/dsv3x2.yaml", shared)


# Ranks sharing a GPU only get the skip line, which the dtype does not enter (SymmMemBackend.
# unavailable_reason): one dtype there; both where the ranks have a GPU each.
EXPERT_MAJOR = [pytest.param(True, "bf16", id="shared-gpu-mps-bf16")] + [
    pytest.param(False, dtype, id=f"separate-gpus-{dtype}") for dtype in ("bf16", "fp8") if False in PLACES]


@pytest.mark.parametrize("shared, dtype", EXPERT_MAJOR)
def test_expert_major_verifies(tmp_path: Path, shared: bool, dtype: str) -> None:
    run(tmp_path, str(expert_major_scenario(tmp_path, dtype)), shared)
