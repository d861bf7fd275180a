"""The bulk combine kernel's measuring aid (EP_OPT_CB_SKIP, honoured only with debug stamps on): `ep_worker.py trace
--with-combine --cb-skip none,stores,reads,smem` times the kernel with its summers' stores left out, with their reads
too, and with their sums made of register words (no shared memory read). The aid must leave out exactly what it names (no output written, the sums still computed), and nothing of it
may outlive it: the next combine bit-equal to the one before it (marker gpu; ranks share GPUs where they outnumber
them)."""

from __future__ import annotations

import re
from pathlib import Path

from gpu_launch import shares_gpus, torchrun, world

WORKER = Path(__file__).resolve().parent / "ep_worker.py"
pytestmark = shares_gpus()


def test_bulk_kernel_measuring_aid_leaves_out_what_it_names(kernels_built: None) -> None:
    n = world(4)
    r = torchrun(WORKER, n, "trace", "--with-combine", "--pull-kernel", "bulk", "--sms", "2", "--warmup", "1",
                 "--iters", "3", "--cb-skip", "none,stores,reads,smem", timeout=300)
    out = r.stdout
    assert r.returncode == 0, out[-3000:] + r.stderr[-3000:]
    assert out.count("stamped combine, ") == 4 * n  # one line per rank and mode
    assert out.count("the summers storing nothing") == n and out.count("the summers reading nothing") == n
    assert out.count("outputs left unwritten") == 3 * n and "WRITTEN" not in out
    assert len(re.findall(r"sums folded 0x", out)) == 2 * n  # stores and smem
    folds = re.findall(r"storing nothing, .*sums folded (0x[0-9a-f]+)", out)
    assert len(folds) == n and all(int(f, 16) != 0 for f in folds)  # the stage's sums computed, not dropped
    assert out.count("bit-equal to the one before") == n and "DIFFERENT FROM" not in out
