"""The local-sum ceiling kernel (csrc/ceiling.cu ep_sum_ceiling) does all the work it is timed for: every token's
rows summed (1 to 5 rows a token, the counts spread as the ceiling spreads them), bit for bit the fp32 sum
from 0 in row order rounded to bf16, in both kernel shapes (marker gpu; one GPU, in this process)."""

from __future__ import annotations

import types

import pytest

torch = pytest.importorskip("torch")

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(GPUS < 1, reason="needs a CUDA GPU")]


@pytest.mark.parametrize("threads", [512, 256, 896])  # the kernel's shapes (ceiling.SUM_THREADS, BULK_SUM_THREADS)
@pytest.mark.parametrize("tokens,rows,hidden", [(37, 37, 2048), (100, 173, 7168), (64, 128, 8192), (50, 131, 2080),
                                                (20, 97, 7168)])
def test_local_sum_ceiling_sums_every_row_of_every_token(kernels_built: None, tokens: int, rows: int,
                                                         hidden: int, threads: int) -> None:
    from epbench import ceiling

    summer = ceiling.kernel_sum_provider()
    assert summer is not None
    dev = torch.device("cuda", 0)
    per_token = -(-rows // tokens)
    src = torch.randn(per_token, tokens, hidden, device=dev).to(torch.bfloat16)
    out = torch.full((tokens, hidden), float("nan"), device=dev, dtype=torch.bfloat16)
    comm = types.SimpleNamespace(device=dev, sync=None)
    if threads not in ceiling.sum_shapes(per_token):  # the bulk-copy shape refuses tokens of more than 4 rows
        with pytest.raises(RuntimeError, match="at most 4 rows"):
            summer(out, src, tokens, rows, hidden, 8, threads, comm, 1, 3)
        return
    times = summer(out, src, tokens, rows, hidden, 8, threads, comm, 1, 3)
    torch.cuda.synchronize()
    assert len(times) == 3 and all(t > 0 for t in times)
    base, extra = divmod(rows, tokens)
    want = torch.zeros(tokens, hidden, device=dev)
    for t in range(tokens):
        for j in range(base + (1 if t < extra else 0)):
            want[t] += src[j, t].float()
    assert torch.equal(out, want.to(torch.bfloat16))


def test_sm_memory_rates_do_all_their_work(kernels_built: None, tmp_path) -> None:
    """python -m epbench.smmem: every kernel's check passes (the load folds, the bulk-load folds, the stored
    positions, the sums bit for bit, the bulk reads' block folds) on shapes with a short last piece and tokens not a
    multiple of the warps, and the CSV with its provenance is written."""
    import csv
    import json

    from epbench import smmem

    out = tmp_path / "m.csv"
    assert smmem.main(["--sms", "1,3", "--rows", "1,3", "--hidden", "7424", "--tokens", "37", "--iters", "2",
                       "--warmup", "1", "--csv", str(out)]) == 0
    rows = list(csv.DictReader(out.open()))
    assert len(rows) == 2 * (1 + 2 * (4 + len(smmem.BULK_ISSUERS))) and all(r["check"] == "ok" for r in rows)
    assert {r["kernel"] for r in rows} == ({"load", "store", "sum", "bulk sum", "bulk read"}
                                           | {f"bulk {w}w" for w in smmem.BULK_ISSUERS})
    assert all(float(r["time_us"]) > 0 for r in rows)
    assert json.loads((tmp_path / "m.csv.json").read_text())["options"]["hidden"] == 7424
