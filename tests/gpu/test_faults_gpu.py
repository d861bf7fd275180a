"""A kernel timeout on the GPU (issue 19): rank 1 sends late at its first dispatch (it sleeps past
``bench.timeout_s``; tests/fault_backends.py, run through tests/fault_epbench.py), so its peer's
kernel gives up waiting for it. The run ends with one line and meta.json says ``timeout``. Two ranks
share GPU 0, so any GPU host runs it."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import yaml
from gpu_launch import ROOT, safe_env, shares_gpus

pytestmark = shares_gpus()

SCENARIO = {
    "model": {"hidden": 1024, "tokens_per_rank": 64, "topk": 4, "experts_per_rank": 4},
    "topology": {"nodes": 1, "gpus_per_node": 2},
    "bench": {"warmup": 1, "iters": 3, "sms": [16], "device": "cuda", "backends": ["test-late-sender"],
              "timeout_s": 2.0, "control_timeout_s": 60.0},
}


def test_a_peer_that_never_sends_in_time_ends_with_a_kernel_timeout(kernels_built, tmp_path: Path):
    sys.path.insert(0, str(ROOT / "tests"))
    import fault_epbench

    path = tmp_path / "late.yaml"
    path.write_text(yaml.safe_dump(SCENARIO))
    env = dict(safe_env(), CUDA_VISIBLE_DEVICES="0", **fault_epbench.env(str(tmp_path / "mark")))
    env["PYTHONPATH"] = env["PYTHONPATH"] + ":" + str(ROOT)
    start = time.monotonic()
    r = subprocess.run(fault_epbench.command() + ["run", str(path), "--no-ceilings",
                                                  "--results", str(tmp_path / "r")],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert time.monotonic() - start < 120
    assert r.returncode == 1, r.stdout[-3000:] + r.stderr[-3000:]
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    assert "gave up after 2 s waiting for rank" in lines[0], lines[0]
    (run,) = list((tmp_path / "r").iterdir())
    meta = json.loads((run / "meta.json").read_text())
    assert meta["status"] == "timeout" and "gave up after 2 s" in meta["error"]
