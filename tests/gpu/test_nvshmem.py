"""GPU check of the NVSHMEM groundwork (multi-node, issue #5): torchrun starts
tests/gpu/nvshmem_worker.py on up to 4 GPUs of this host; NVSHMEM bootstraps over a unique id
broadcast by torch.distributed, then every PE puts 4 KiB into every other PE with
put-with-signal and checks what it got. PASS and the median round time, or the failing rank."""

from __future__ import annotations

import pytest
from gpu_launch import GPUS, ROOT, needs_gpus, torchrun

torch = pytest.importorskip("torch")

WORKER = ROOT / "tests" / "gpu" / "nvshmem_worker.py"

pytestmark = needs_gpus(2, "the worker puts one NVSHMEM PE on each GPU")


@pytest.fixture(scope="module")
def built() -> None:
    from epbench import nvshmem_lib

    # Only the file: loading it would pull libnvshmem_host into this process (the worker loads
    # it, and refuses a mismatched NVSHMEM with a one-line reason).
    if not nvshmem_lib.LIB_PATH.exists():
        pytest.skip(f"{nvshmem_lib.NOT_BUILT} ({nvshmem_lib.LIB_PATH} is missing)")


def test_nvshmem_ping_all_to_all(built: None) -> None:
    nproc = min(GPUS, 4)
    r = torchrun(WORKER, nproc, "--iters", "200", "--timeout", "10", timeout=300)
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-6000:]
    assert f"PASS nvshmem ping world={nproc}" in r.stdout, r.stdout[-4000:]
    print(r.stdout.strip().splitlines()[-1])
