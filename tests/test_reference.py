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
# issue 26: (dtype, quantize, layout, align, routing, tokens per rank)
CASES = [("mxfp8", "before", "rank_major", 1, "uniform", (7, 0, 5)),
         ("mxfp8", "fused", "rank_major", 1, "zipf", (3, 9, 1)),
         ("fp8", "fused", "rank_major", 1, "hot", (5, 7, 0)),
         ("bf16", "before", "expert_major", 1, "zipf", (9, 0, 3)),
         ("fp8", "before", "expert_major", 128, "uniform", (0, 5, 9)),
         ("mxfp8", "fused", "expert_major", 128, "hot", (7, 3, 0)),
         ("mxfp8", "before", "expert_major", 1, "uniform", (1, 9, 5))]


def _case_inputs(case, salt):
    """(what each rank hands to dispatch, what its receivers must get, its bf16 rows)."""
    from epbench.inputs import dispatch_input, make_tokens, wire_input
    from epbench.routing import route_rank
    from epbench.scenario import Routing

    dtype, quantize, _, _, kind, tokens = case
    out = []
    for s, t in enumerate(tokens):
        r = route_rank(Routing(kind=kind, seed=13, hot_fraction=0.2, hot_multiplier=3.0), t, TOPK,
                       WORLD * EPR, s)
        x = make_tokens(t, HIDDEN, 13, s, salt, torch.device("cpu"))
        inp = dispatch_input(x, r, dtype, torch.device("cpu"), quantize)
        out.append((inp, wire_input(inp, dtype), x))
    return out


def _run_case(rank, case):
    """One issue-26 case on this rank: verify.py's checks plus an independent loop over the
    expert segments; a corrupted segment row must be caught."""
    from epbench.contract import RankSetup
    from epbench.backends.reference import ReferenceBackend
    from epbench.inputs import expert_output
    from epbench.verify import check_combine, check_dispatch, check_ll_combine, em_expert_output

    dtype, quantize, lay, align, _, _ = case
    setup = RankSetup(rank=rank, world=WORLD, gpus_per_node=WORLD, device=torch.device("cpu"),
                      hidden=HIDDEN, max_tokens_per_rank=MAX_TOKENS, topk=TOPK, experts_per_rank=EPR,
                      dispatch_dtype=dtype, quantize=quantize, layout=lay, align=align)
    be = ReferenceBackend(setup)
    r = {}
    for salt in (1, 2):
        ins = _case_inputs(case, salt)
        be.poison()
        out = be.dispatch(ins[rank][0], 0)
        d = check_dispatch(out, rank, WORLD, EPR, lambda s: ins[s][1], source_of=lambda s: ins[s][2])
        em = out.expert_major
        segs_ok = True
        if em is not None:  # by loops: expert e's rows, (source, token) order, from its offset
            for e in range(EPR):
                want = [ins[s][1].x[t].view(torch.uint8) for s in range(WORLD)
                        for t in range(ins[s][1].num_tokens) if rank * EPR + e in ins[s][1].topk_idx[t].tolist()]
                off = int(em.offsets[e])
                segs_ok &= off % align == 0 and int(em.counts[e]) == len(want) and all(
                    torch.equal(out.x[off + i].view(torch.uint8), w) for i, w in enumerate(want))
            y = be.combine_input(out)
            y.copy_(em_expert_output(out.x[: y.shape[0]], out.x_scales[: y.shape[0]]
                                     if out.x_scales is not None else None, em, rank * EPR))
        else:
            n = int(out.num_recv)
            be.combine_input(out)[:n].copy_(expert_output(out.x[:n], out.x_scales[:n]
                                                          if out.x_scales is not None else None, rank))
        got = be.combine(out, 0)
        wire = ins[rank][1]
        c = check_ll_combine(got, wire) if em is not None else check_combine(got, wire, WORLD, EPR)
        corrupt = 0
        if em is not None and int(em.counts.sum()):
            e = next(i for i in range(EPR) if int(em.counts[i]))
            out.x[int(em.offsets[e])].view(torch.uint8).bitwise_xor_(0x11)
            corrupt = check_dispatch(out, rank, WORLD, EPR, lambda s: ins[s][1]).wrong
        r[f"salt{salt}"] = {"dispatch_wrong": d.wrong, "problem": d.first_problem, "segments_ok": bool(segs_ok),
                            "combine_wrong": c.wrong, "combine_problem": c.first_problem,
                            "combine_shape": list(got.shape), "corrupt_wrong": corrupt,
                            "pairs": int(em.counts.sum()) if em is not None else None}
    be.close()
    return r


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

    from epbench.contract import RankSetup
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
        for i, case in enumerate(CASES):
            report[f"case{i}"] = _run_case(rank, case)
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


@pytest.mark.slow
@pytest.mark.parametrize("i", range(len(CASES)), ids=["-".join(map(str, c[:4])) + "-" + c[4] for c in CASES])
def test_quantized_and_expert_major_cases(reports, i):
    """mxfp8 / fused / expert-major (issue 26): bit-exact against the reference quantizer, within
    the format's error of the bf16 rows, segments in order at aligned offsets, combine right."""
    case = CASES[i]
    for rank, rep in enumerate(reports):
        for salt in ("salt1", "salt2"):
            r = rep[f"case{i}"][salt]
            assert r["dispatch_wrong"] == 0, r["problem"]
            assert r["segments_ok"]
            assert r["combine_wrong"] == 0, r["combine_problem"]
            assert r["combine_shape"] == [case[5][rank], HIDDEN]
            if r["pairs"]:
                assert r["corrupt_wrong"] >= 1
    if case[2] == "expert_major":
        assert sum(rep[f"case{i}"]["salt1"]["pairs"] for rep in reports) > 0


def test_kernel_mode_knows_its_splits_and_verifies(tmp_path):
    """Kernel mode (NCCL with the splits known): the splits are found once per input set in
    prepare_input, the timed dispatches exchange no counts, and both checks pass; call mode finds
    them in every dispatch. One gloo rank in this process."""
    import torch.distributed as dist

    from epbench.backends.reference import ReferenceBackend
    from epbench.driver import Point, PointRecord, measure_point, rank_setup
    from epbench.launch import Comm
    from epbench.routing import route_all
    from epbench.scenario import parse
    from support import scenario_dict

    s = parse(scenario_dict(topology={"name": "one", "nodes": 1, "gpus_per_node": 1}), "<t>")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        comm = Comm(0, 1, 0, torch.device("cpu"))
        for mode, splits_found in (("call", 3 + 1), ("kernel", 2)):
            be = ReferenceBackend(rank_setup(s, comm))
            be.use_call_mode(mode)
            found = []
            real = be._split
            be._split = lambda inp: found.append(1) or real(inp)
            rec = PointRecord(0)
            measure_point(Point(be, s, route_all(s), 0, comm, input_sets=2), 1, 2, 5, None, rec)
            assert rec.wrong == {"dispatch": 0, "combine": 0}, (mode, rec.problem)
            # call: one per dispatch (3 timed + the verification run); kernel: one per input set
            # (2), none in a timed call nor in the verification run (set 0's, refilled)
            assert len(found) == splits_found, mode
            assert be.reuses_layout == (mode == "kernel")
    finally:
        dist.destroy_process_group()
