"""The reference backend in a real 3-process gloo group (torch.multiprocessing, FileStore init).

One spawn runs every check (spawning costs seconds on a 2-core box); each rank writes what it
saw to a JSON file and the tests below read those files."""

import json
from pathlib import Path

import pytest
import torch

WORLD, EPR, TOPK, HIDDEN = 3, 2, 3, 128
# uneven token counts, one rank with none; TOPK is odd so that packed rows of 12-byte
# (id, weight) slots are not naturally 8-byte aligned
TOKENS = {"bf16": (6, 9, 0), "fp8": (0, 9, 5)}
MAX_TOKENS = 9


def _inputs(dtype, salt):
    from epbench.inputs import dispatch_input, make_tokens
    from epbench.routing import route_rank
    from epbench.scenario import Routing

    out = []
    for s, t in enumerate(TOKENS[dtype]):
        r = route_rank(Routing(seed=11), t, TOPK, WORLD * EPR, s)
        out.append(dispatch_input(make_tokens(t, HIDDEN, 11, s, salt, torch.device("cpu")),
                                  r, dtype, torch.device("cpu")))
    return out


def _worker(rank: int, store: str, out_dir: str) -> None:
    import torch.distributed as dist

    from epbench.backends.base import RankSetup
    from epbench.backends.reference import ReferenceBackend
    from epbench.inputs import expert_output
    from epbench.verify import check_combine, check_dispatch

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD)
    report = {}
    try:
        for dtype in ("bf16", "fp8"):
            setup = RankSetup(rank=rank, world=WORLD, gpus_per_node=WORLD,
                              device=torch.device("cpu"), hidden=HIDDEN,
                              max_tokens_per_rank=MAX_TOKENS, topk=TOPK, experts_per_rank=EPR,
                              dispatch_dtype=dtype)
            be = ReferenceBackend(setup)
            r = {}
            for it, salt in enumerate((1, 2)):  # twice: buffers are reused between calls
                ins = _inputs(dtype, salt)
                be.poison()
                out = be.dispatch(ins[rank], 0)
                n = int(out.num_recv)
                d = check_dispatch(out, rank, WORLD, EPR, lambda s: ins[s])
                # independent of verify.py: the rows in (source, token) order, by loops
                want = [ins[s].x[t].view(torch.uint8) for s in range(WORLD)
                        for t in range(TOKENS[dtype][s])
                        if any(int(e) // EPR == rank for e in ins[s].topk_idx[t])]
                same = (n == len(want) and all(
                    torch.equal(out.x[i].view(torch.uint8), w) for i, w in enumerate(want)))
                y = be.combine_input(out)
                scales = out.x_scales[:n] if out.x_scales is not None else None
                y[:n].copy_(expert_output(out.x[:n], scales, rank))
                got = be.combine(out, 0)
                c = check_combine(got, ins[rank], WORLD, EPR)
                # a wrong expert output on one rank must show up at the source as wrong combine
                if n:
                    y[:n].copy_(expert_output(out.x[:n], scales, rank))
                    if rank == 1:
                        y[0].mul_(3)
                bad = be.combine(out, 0)
                cb = check_combine(bad, ins[rank], WORLD, EPR)
                r[f"iter{it}"] = {
                    "num_recv": n, "dispatch_wrong": d.wrong, "problem": d.first_problem,
                    "rows_in_order": same, "counts": out.expert_counts.tolist(),
                    "combine_wrong": c.wrong, "combine_problem": c.first_problem,
                    "combine_shape": list(got.shape), "combine_corrupted_wrong": cb.wrong}
            be.close()
            report[dtype] = r
    finally:
        dist.destroy_process_group()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(report))


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    import torch.multiprocessing as mp

    d = tmp_path_factory.mktemp("reference")
    mp.spawn(_worker, args=(str(d / "store"), str(d)), nprocs=WORLD, join=True)
    return [json.loads((d / f"rank{r}.json").read_text()) for r in range(WORLD)]


def expected_recv(rank: int, dtype: str, salt: int) -> int:
    ins = _inputs(dtype, salt)
    return sum(int(((ins[s].topk_idx // EPR) == rank).any(dim=1).sum()) for s in range(WORLD))


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
def test_dispatch_delivers_the_routed_rows_in_order(reports, dtype):
    for rank, rep in enumerate(reports):
        for it, salt in ((0, 1), (1, 2)):
            r = rep[dtype][f"iter{it}"]
            assert r["num_recv"] == expected_recv(rank, dtype, salt)
            assert r["dispatch_wrong"] == 0, r["problem"]
            assert r["rows_in_order"]
    assert sum(rep[dtype]["iter0"]["num_recv"] for rep in reports) > 0


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
def test_expert_counts(reports, dtype):
    ins = _inputs(dtype, 2)
    for rank, rep in enumerate(reports):
        want = [sum(int((ins[s].topk_idx == rank * EPR + e).sum()) for s in range(WORLD))
                for e in range(EPR)]
        assert rep[dtype]["iter1"]["counts"] == want


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
def test_combine_returns_the_weighted_sum(reports, dtype):
    for rank, rep in enumerate(reports):
        for it in ("iter0", "iter1"):
            r = rep[dtype][it]
            assert r["combine_shape"] == [TOKENS[dtype][rank], HIDDEN]
            assert r["combine_wrong"] == 0, r["combine_problem"]


@pytest.mark.slow
def test_a_wrong_expert_output_is_caught_at_its_source(reports):
    """Rank 1 corrupts its first received row; exactly the source of that row sees it."""
    for dtype in ("bf16", "fp8"):
        wrong = [rep[dtype]["iter0"]["combine_corrupted_wrong"] for rep in reports]
        assert sum(wrong) == 1, wrong
    assert reports[2]["bf16"]["iter0"]["combine_corrupted_wrong"] == 0  # rank 2 sent nothing
    assert reports[0]["fp8"]["iter0"]["combine_corrupted_wrong"] == 0  # nor did rank 0 in fp8
