"""The whole pipeline on GPUs: `epbench run` with the NCCL reference and the epbench kernels,
bf16 and fp8, uniform and skewed routing, every point verified (marker gpu; skipped without a
CUDA GPU). On a 1-GPU host the 2 ranks share it: a functional run, the reference skipped."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from epbench.results import load_run

torch = pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parents[1]
GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0

WORLD = max(2, min(GPUS, 4))  # ranks share the GPU on a 1-GPU host
SHARED = WORLD > GPUS

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(GPUS < 1, reason="needs a CUDA GPU")]

SCENARIO = """
model: {{hidden: {hidden}, tokens_per_rank: 1000, topk: 6, experts_per_rank: 8, dispatch_dtype: {dtype}}}
topology: {{nodes: 1, gpus_per_node: {world}}}
routing: {{kind: {routing}, seed: 3}}
bench: {{warmup: 2, iters: 5, backends: [reference, epbench], sms: [4, 12], device: cuda}}
"""


# The ceilings (copy engine, SM stores) depend on neither dtype nor routing: the first run measures
# them, the others skip them.
@pytest.mark.parametrize("dtype,routing,hidden,ceilings", [("bf16", "uniform", 2048, True),
                                                           ("fp8", "zipf", 4096, False),
                                                           ("bf16", "hot", 7168, False)])
def test_run_verifies_both_backends(tmp_path: Path, dtype: str, routing: str, hidden: int, ceilings: bool) -> None:
    world = WORLD
    path = tmp_path / f"gpu-{dtype}-{routing}.yaml"
    path.write_text(SCENARIO.format(hidden=hidden, dtype=dtype, routing=routing, world=world))
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    r = subprocess.run([sys.executable, "-m", "epbench", "run", str(path), "--results", str(tmp_path / "r"),
                        *([] if ceilings else ["--no-ceilings"])],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    (run,) = list((tmp_path / "r").iterdir())
    df = load_run(run)[1]  # measured rows (skipped / failed ones aside)
    assert set(df["backend"]) == {"epbench"} | (set() if SHARED else {"reference"})
    assert sorted(set(df[df["backend"] == "epbench"]["sms"])) == [4, 12]
    # ops x ranks x (reference in its two call modes + epbench at 2 SM counts)
    assert len(df) == 2 * world * ((0 if SHARED else 2) + 2)
    assert int(df["wrong"].sum()) == 0
    if SHARED:  # functional: no bus bandwidth for traffic that stayed in one GPU
        assert df["busbw_nvlink_gbps"].isna().all() and df["functional"].notna().all()
    else:
        assert (df["busbw_nvlink_gbps"] > 0).all() and df["functional"].isna().all()


def test_corrupted_kernel_output_fails(tmp_path: Path) -> None:
    path = tmp_path / "gpu-fault.yaml"
    path.write_text(SCENARIO.format(hidden=2048, dtype="bf16", routing="uniform", world=2))
    r = subprocess.run([sys.executable, "-m", "epbench", "run", str(path), "--backends", "epbench",
                        "--inject-fault", "dispatch", "--no-ceilings", "--results", str(tmp_path / "r")],
                       cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode != 0
    assert "VERIFICATION FAILED" in r.stdout
