"""Low-latency mode on CPUs: the scenario key and the --tokens axis, the layout contract
(base.ll_slots), its verification against hand-built outputs (and corrupted ones), the
reference backend's low-latency path in a real 3-process gloo group, and the CLI sweep of
scenarios/smoke-ll.yaml over 4 gloo ranks."""

import dataclasses
import json
from pathlib import Path

import pandas as pd
import pytest
import torch

from support import assert_one_line_error, epbench_here, run_cli, scenario_dict

from epbench.contract import DispatchInput, LowLatencyOutput, ll_slots
from epbench.errors import UserError
from epbench.inputs import expert_factor
from epbench.scenario import parse
from epbench.verify import check_ll_combine, check_ll_dispatch, ll_expert_output

SMOKE_LL = "scenarios/smoke-ll.yaml"


# -- scenario and options ------------------------------------------------------------------------

def test_mode_low_latency_parses():
    s = parse(scenario_dict(mode="low_latency"), "x.yaml")
    assert s.mode == "low_latency"
    assert s.with_tokens(3).model.tokens_per_rank == 3
    assert s.with_tokens(3).mode == "low_latency"


def test_unknown_mode_names_both(write_scenario, tmp_path):
    path = write_scenario("mode", scenario_dict(mode="fast"))
    assert_one_line_error(epbench_here("run", path, "--results", tmp_path), "mode", "normal, low_latency")


@pytest.mark.parametrize("args, needles", [
    (("run", SMOKE_LL, "--tokens", "0"), ("--tokens", "positive")),
    (("sweep", SMOKE_LL, "--tokens", "1,x"), ("--tokens", "1,x")),
    (("sweep", SMOKE_LL), ("--sms", "--tokens")),
], ids=["tokens-zero", "tokens-text", "sweep-needs-an-axis"])
def test_bad_tokens_options(args, needles, tmp_path):
    assert_one_line_error(epbench_here(*args, "--results", tmp_path / "res"), *needles)
    assert not (tmp_path / "res").exists()


def test_line_placements_without_row_units_are_refused_before_any_rank_starts(tmp_path):
    """dispatch_place line / line128 carry whole rows: chunk units, or auto at a point of up to 16 tokens per rank,
    stop `run` in one line (exit 2) naming the fix; row units, larger points or ll_sync grid pass."""
    from epbench import options

    ok = [({"dispatch_place": "line", "dispatch_units": "row"}, [1, 8]),
          ({"dispatch_place": "line128"}, [17, 128]),
          ({"dispatch_place": "line", "ll_sync": "grid"}, [1]),
          ({"dispatch_place": "inline", "dispatch_units": "chunk"}, [1])]
    for given, tokens in ok:
        options.check_ll_lines({"epbench-ll": given}, tokens, "s.yaml", environ={})
    for given, tokens, needle in [({"dispatch_place": "line"}, [128, 8], "has 8"),
                                  ({"dispatch_place": "line128", "dispatch_units": "chunk"}, [256], "units chunk")]:
        with pytest.raises(UserError, match=needle):
            options.check_ll_lines({"epbench-ll": given}, tokens, "s.yaml", environ={})
    with pytest.raises(UserError, match="dispatch_place=line sends whole rows"):
        options.check_ll_lines({}, [4], "s.yaml", environ={"EPBENCH_LL_DISPATCH_PLACE": "line"})
    r = epbench_here("run", SMOKE_LL, "--backends", "epbench-ll", "--tokens", "1", "--option",
                     "epbench-ll.dispatch_place=line", "--results", tmp_path / "res")
    assert_one_line_error(r, "dispatch_place=line", "--option epbench-ll.dispatch_units=row")
    assert not (tmp_path / "res").exists()


@pytest.mark.parametrize("value", ["1", "-1", "1025", "x"])
@pytest.mark.parametrize("verb", ["run", "sweep"])
def test_bad_graph_chain_is_one_line(verb, value, tmp_path):
    r = epbench_here(verb, SMOKE_LL, "--tokens", "1", "--graph-chain", value, "--results", tmp_path / "res")
    assert_one_line_error(r, "--graph-chain", *(["0 (off) or 2 to 1024"] if value != "x" else []))
    assert not (tmp_path / "res").exists()


def test_graph_chain_reaches_the_ranks_and_the_options(monkeypatch, tmp_path):
    """--graph-chain K goes into RunOptions (the meta.json options are RunOptions) in the plan
    the ranks read; no value: the default, 0: off."""
    import typer

    from epbench import cli, launcher, plan, scenario

    seen = {}

    def fake_start(p):
        seen["plan"] = p
        return 0

    monkeypatch.setattr(launcher, "start", fake_start)
    for given, want in ((None, scenario.GRAPH_CHAIN), (0, 0), (16, 16)):
        with pytest.raises(typer.Exit):
            cli._launch("sweep", Path(SMOKE_LL), backends="reference", device="cpu",
                        results=tmp_path / f"r{want}", no_ceilings=True, tokens="1", graph_chain=given)
        p = seen["plan"]
        assert p.options.graph_chain == want
        assert plan.read(plan.write(p, p.run_dir)).job_options(0).graph_chain == want
    assert scenario.GRAPH_CHAIN == 8


# -- the placement ------------------------------------------------------------------------------

def test_ll_slots_by_hand():
    idx = torch.tensor([[0, 3], [3, 1], [0, 1], [2, 3]])
    j, counts = ll_slots(idx, 5)
    # expert 0: tokens 0, 2; expert 1: tokens 1, 2; expert 2: token 3; expert 3: tokens 0, 1, 3
    assert j.tolist() == [[0, 0], [1, 0], [1, 1], [0, 2]]
    assert counts.tolist() == [2, 2, 1, 3, 0]
    j0, c0 = ll_slots(torch.empty(0, 2, dtype=torch.int64), 5)
    assert j0.shape == (0, 2) and c0.tolist() == [0] * 5


# -- verification against hand-built outputs ----------------------------------------------------

WORLD, E, TOPK, H, TM = 2, 2, 2, 128, 3


def _inputs(dtype: str = "bf16"):
    """Two sources: rank 0 has 3 tokens, rank 1 has 2 (experts 0..3, rank r owns 2r, 2r + 1)."""
    idx = [torch.tensor([[0, 1], [3, 0], [1, 2]]), torch.tensor([[2, 0], [0, 3]])]
    out = []
    for s, ids in enumerate(idx):
        g = torch.Generator().manual_seed(s)
        x = torch.randn(ids.shape[0], H, generator=g).to(torch.bfloat16)
        w = torch.rand(ids.shape[0], TOPK, generator=g) + 0.5
        if dtype == "fp8":
            from epbench.inputs import quantize_fp8

            q, sc = quantize_fp8(x)
            out.append(DispatchInput(q, sc, ids, w))
        else:
            out.append(DispatchInput(x, None, ids, w))
    return out


def _hand_output(rank: int, ins) -> LowLatencyOutput:
    """What rank `rank` must receive, written by loops (independent of ll_slots)."""
    dt = ins[0].x.dtype
    x = torch.full((E, WORLD * TM, H), float("nan"), dtype=torch.float32).to(dt)
    scales = torch.full((E, WORLD * TM, H // 128), float("nan")) if ins[0].x_scales is not None else None
    pair = torch.full((E, WORLD * TM), -1, dtype=torch.int32)
    src_counts = torch.zeros(E, WORLD, dtype=torch.int64)
    for s, inp in enumerate(ins):
        for t in range(inp.num_tokens):
            for k in range(TOPK):
                e = int(inp.topk_idx[t, k])
                if e // E != rank:
                    continue
                le = e % E
                j = int(src_counts[le, s])
                x[le, s * TM + j] = inp.x[t]
                if scales is not None:
                    scales[le, s * TM + j] = inp.x_scales[t]
                pair[le, s * TM + j] = t * TOPK + k
                src_counts[le, s] += 1
    return LowLatencyOutput(x, scales, src_counts.sum(dim=1), src_counts, pair, TM)


@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
def test_check_ll_dispatch_accepts_the_contract(dtype):
    ins = _inputs(dtype)
    for rank in range(WORLD):
        out = _hand_output(rank, ins)
        r = check_ll_dispatch(out, rank, WORLD, E, lambda s: ins[s])
        assert r.wrong == 0, r.first_problem
    # rank 0, expert 0: source 0 tokens 0, 1 -> slots 0, 1; source 1 tokens 0, 1 -> slots 3, 4
    assert _hand_output(0, ins).src_counts.tolist() == [[2, 2], [2, 0]]


def _corrupt(kind: str, out: LowLatencyOutput) -> None:
    if kind == "payload":
        out.x[0, 3].view(torch.uint8)[5] ^= 1
    elif kind == "slot":  # two rows of one expert swapped
        out.x[0, [0, 1]] = out.x[0, [1, 0]].clone()
    elif kind == "pair":
        out.src_pair[1, 0] += 1
    elif kind == "src_counts":
        out.src_counts[1, 1] = 1
    elif kind == "counts":
        out.counts[0] = 3
    elif kind == "scales":
        out.x_scales[0, 0, 0] *= 2


@pytest.mark.parametrize("kind", ["payload", "slot", "pair", "src_counts", "counts", "scales"])
def test_check_ll_dispatch_catches(kind):
    ins = _inputs("fp8" if kind == "scales" else "bf16")
    out = _hand_output(0, ins)
    _corrupt(kind, out)
    r = check_ll_dispatch(out, 0, WORLD, E, lambda s: ins[s])
    assert r.wrong > 0 and r.first_problem


def test_padding_is_not_checked():
    ins = _inputs()
    out = _hand_output(0, ins)
    out.x[1, 5].fill_(7)  # expert 1 got no row from source 1: slot 3.. are padding
    out.src_pair[1, 5] = 99
    assert check_ll_dispatch(out, 0, WORLD, E, lambda s: ins[s]).wrong == 0


def test_ll_combine_formula_is_per_expert():
    ins = _inputs()
    inp = ins[0]
    # by hand: sum over k of w * bf16(x * factor(expert)), fp32, then bf16
    want = torch.zeros(inp.num_tokens, H)
    for t in range(inp.num_tokens):
        for k in range(TOPK):
            e = int(inp.topk_idx[t, k])
            want[t] += float(inp.topk_weights[t, k]) * (inp.x[t].float() * expert_factor(e)).to(torch.bfloat16).float()
    got = want.to(torch.bfloat16)
    assert check_ll_combine(got, inp).wrong == 0
    bad = got.clone()
    bad[1, 7] *= 1.1
    r = check_ll_combine(bad, inp)
    assert r.wrong == 1 and "token 1" in r.first_problem
    # the per-rank weighting of normal mode differs whenever one rank holds two of a token's experts
    per_rank = torch.zeros_like(want)
    for t in range(inp.num_tokens):
        for d in range(WORLD):
            w = sum(float(inp.topk_weights[t, k]) for k in range(TOPK) if int(inp.topk_idx[t, k]) // E == d)
            if w:
                per_rank[t] += w * (inp.x[t].float() * expert_factor(d)).to(torch.bfloat16).float()
    assert check_ll_combine(per_rank.to(torch.bfloat16), inp).wrong > 0
    assert check_ll_combine(got[:2], inp).wrong > 0  # wrong shape


def test_ll_expert_output_uses_global_expert_factors():
    x = torch.ones(2, 3, H, dtype=torch.bfloat16)
    y = ll_expert_output(x, None, first_expert=6)
    assert float(y[0, 0, 0]) == expert_factor(6) and float(y[1, 2, 5]) == expert_factor(7)


# -- the reference backend in a real 3-process gloo group --------------------------------------

R_WORLD, R_EPR, R_TOPK, R_HIDDEN, R_MAX = 3, 2, 3, 128, 9
R_TOKENS = {"bf16": (6, 9, 0), "fp8": (0, 9, 1)}


def _r_inputs(dtype, salt):
    from epbench.inputs import dispatch_input, make_tokens
    from epbench.routing import route_rank
    from epbench.scenario import Routing

    out = []
    for s, t in enumerate(R_TOKENS[dtype]):
        r = route_rank(Routing(seed=5), t, R_TOPK, R_WORLD * R_EPR, s)
        out.append(dispatch_input(make_tokens(t, R_HIDDEN, 5, s, salt, torch.device("cpu")),
                                  r, dtype, torch.device("cpu")))
    return out


def _worker(rank: int, store: str, out_dir: str) -> None:
    import torch.distributed as dist

    from epbench.contract import RankSetup
    from epbench.backends.reference import ReferenceBackend

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=R_WORLD)
    report = {}
    try:
        for dtype in ("bf16", "fp8"):
            setup = RankSetup(rank=rank, world=R_WORLD, gpus_per_node=R_WORLD, device=torch.device("cpu"),
                              hidden=R_HIDDEN, max_tokens_per_rank=R_MAX, topk=R_TOPK,
                              experts_per_rank=R_EPR, dispatch_dtype=dtype, mode="low_latency")
            be = ReferenceBackend(setup)
            res = []
            for salt in (1, 2):  # twice: buffers are reused between calls
                ins = _r_inputs(dtype, salt)
                be.poison()
                out = be.ll_dispatch(ins[rank], 0)
                d = check_ll_dispatch(out, rank, R_WORLD, R_EPR, lambda s: ins[s])
                be.ll_combine_input(out).copy_(ll_expert_output(out.x, out.x_scales, rank * R_EPR))
                got = be.ll_combine(out, 0)
                c = check_ll_combine(got, ins[rank])
                res.append({"d": d.wrong, "c": c.wrong, "p": d.first_problem + c.first_problem,
                            "counts": out.counts.tolist(), "shape": list(out.x.shape)})
            report[dtype] = res
    finally:
        dist.destroy_process_group()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(report))


@pytest.fixture(scope="module")
def reference_ll(tmp_path_factory):
    import torch.multiprocessing as mp

    d = tmp_path_factory.mktemp("ll_ref")
    mp.spawn(_worker, args=(str(d / "store"), str(d)), nprocs=R_WORLD, join=True)
    return [json.loads((d / f"rank{r}.json").read_text()) for r in range(R_WORLD)]


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
def test_reference_low_latency_matches_the_contract(reference_ll, dtype):
    for rank, rep in enumerate(reference_ll):
        for it in rep[dtype]:
            assert it["d"] == 0 and it["c"] == 0, f"rank {rank}: {it['p']}"
            assert it["shape"] == [R_EPR, R_WORLD * R_MAX, R_HIDDEN]
    total = sum(sum(rep[dtype][0]["counts"]) for rep in reference_ll)
    assert total == sum(R_TOKENS[dtype]) * R_TOPK  # every (token, expert) pair arrived once


# -- the CLI: 4 gloo ranks, a --tokens sweep, one results folder -------------------------------

@pytest.fixture(scope="module")
def ll_sweep(tmp_path_factory):
    return run_cli(tmp_path_factory.mktemp("ll"), "sweep", SMOKE_LL, "--tokens", "1,4", "--graph-chain", "4")


@pytest.mark.slow
def test_smoke_ll_sweep(ll_sweep):
    r = ll_sweep.result
    assert r.code == 0, r.both
    df = ll_sweep.rows()
    assert sorted(df["tokens_per_rank"].unique()) == [1, 4]
    assert set(df["backend"]) == {"reference"}
    assert set(df["mode"]) == {"low_latency"} and set(df["timing"]) == {"launch"}
    assert set(df["chain"]) == {1}  # no graphs on CPUs: every sample is one call
    assert len(df) == 2 * 2 * 4  # token counts x ops x ranks
    assert (df["wrong"] == 0).all()
    assert (df["time_us_p99"] >= df["time_us"]).all()
    samples = ll_sweep.samples()
    assert len(samples) == 2 * 2 * 4 * 5 and set(samples["tokens_per_rank"]) == {1, 4}
    meta = ll_sweep.meta()
    assert meta["status"] == "complete" and meta["scenario"]["mode"] == "low_latency"
    assert meta["options"]["graph_chain"] == 4
    assert any(n.startswith("backend epbench-ll skipped") for n in meta["notes"]), meta["notes"]
    for line in ("p50 us", "p99 us", "timing"):
        assert line in r.out
    # pairs, not token copies: the algorithm bytes of rank 0's dispatch at 4 tokens
    from epbench import metrics
    from epbench.routing import route_all
    from epbench.scenario import load

    s = load(SMOKE_LL).with_tokens(4)
    tr = metrics.pair_traffic(route_all(s), s.model.experts_per_rank, 4)
    want = metrics.rank_bytes(tr, "dispatch", metrics.row_bytes("bf16", s.model.hidden))["algo"]
    got = df[(df["op"] == "dispatch") & (df["tokens_per_rank"] == 4)].sort_values("rank")
    assert got["algo_bytes"].tolist() == want.tolist()
    assert int(want.sum()) == 4 * 4 * s.model.topk * 2 * s.model.hidden  # ranks x tokens x topk x row


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["dispatch", "combine"])
def test_smoke_ll_corruption_is_caught(fault, write_scenario, tmp_path):
    data = scenario_dict(mode="low_latency", model={"dispatch_dtype": "fp8", "tokens_per_rank": 4})
    path = write_scenario("ll-fp8", data)
    run = run_cli(tmp_path / "r", "run", str(path), "--inject-fault", fault, "--nproc", "2")  # 2 ranks: cheaper
    assert run.result.code == 1, run.result.both
    assert "VERIFICATION FAILED" in run.result.out
    df = run.rows()
    assert int(df[df["op"] == fault]["wrong"].sum()) > 0
    assert int(df[df["op"] != fault]["wrong"].sum()) == 0


def test_pair_traffic_counts_pairs():
    from epbench import metrics
    from epbench.routing import RankRouting

    rr = [RankRouting(torch.tensor([[0, 1], [2, 3]]), torch.full((2, 2), 0.5)),
          RankRouting(torch.tensor([[1, 3]]), torch.full((1, 2), 0.5))]
    tr = metrics.pair_traffic(rr, 2, 2)
    assert tr.total.tolist() == [[2, 2], [1, 1]]
    assert tr.nvlink.tolist() == [[0, 2], [1, 0]]
    assert int(tr.nic.sum()) == 0


def test_low_latency_table_and_unchanged_normal_table():
    from epbench.report import results_table

    base = {"scenario": "x", "backend": "reference", "sms": 0, "world": 2, "wrong": 0, "problem": "",
            "algbw_gbps": 1.0, "busbw_nvlink_gbps": 0.5, "busbw_nic_gbps": None}
    rows = [dict(base, op=op, rank=r, tokens_per_rank=t, time_us=10.0 + r, time_us_p99=20.0 + r,
                 mode="low_latency", timing="launch") for op in ("dispatch", "combine") for r in (0, 1)
            for t in (1, 8)]
    table = results_table(pd.DataFrame(rows))
    headers = [c.header for c in table.columns]
    assert headers[:7] == ["tokens", "op", "backend", "SMs", "timing", "p50 us", "p99 us"]
    assert table.row_count == 4
    p99 = table.columns[headers.index("p99 us")]._cells
    assert p99 == ["21.0"] * 4  # the slowest rank's p99
    normal = [dict(base, op=op, rank=r, tokens_per_rank=8, time_us=10.0) for op in ("dispatch", "combine")
              for r in (0, 1)]
    headers = [c.header for c in results_table(pd.DataFrame(normal)).columns]
    assert headers[0] == "op" and "tokens" not in headers and "p99 us" not in headers


# -- epbench-ll option ll_sync and the token dispatch's shared memory ------------------------------

def test_ll_sync_option_parses_and_defaults():
    from epbench import options

    assert options.validate({"epbench-ll": {"ll_sync": "token"}}) == {"epbench-ll": {"ll_sync": "token"}}
    assert options.parse_cli(["ll_sync=token"]) == {"epbench-ll": {"ll_sync": "token"}}
    assert options.resolve("epbench-ll", {}, environ={})["ll_sync"] == "auto"
    assert options.resolve("epbench-ll", {}, environ={"EPBENCH_LL_SYNC": "token"})["ll_sync"] == "token"
    with pytest.raises(UserError, match="ll_sync: must be one of auto, grid, token, got 'fast'"):
        options.validate({"epbench-ll": {"ll_sync": "fast"}})


def test_token_smem_bytes_by_hand_and_as_the_kernels_limit_it():
    from pathlib import Path

    ll = pytest.importorskip("epbench.backends.epbench_ll")
    # ids (T x topk) + (ceil(T / 32) + 1) x num_experts prefix / totals words, 4 bytes each
    assert ll.token_smem_bytes(128, 8, 256) == 4 * (128 * 8 + 5 * 256)
    assert ll.token_smem_bytes(33, 6, 32) == 4 * (33 * 6 + 3 * 32)
    assert ll.token_smem_bytes(0, 8, 64) == 4 * 64  # the totals row alone
    assert ll.token_smem_bytes(1536, 8, 2048) > ll.TOKEN_SMEM_LIMIT  # refused: ll_sync grid serves it
    csrc = Path(__file__).resolve().parents[1] / "csrc"
    assert "const size_t limit = 200 * 1024;" in (csrc / "ll_buffers.cu").read_text()
    assert ll.TOKEN_SMEM_LIMIT == 200 * 1024
    assert ("((size_t)tokens * topk + (size_t)((tokens + 31) / 32 + 1) * num_experts) * sizeof(int)"
            in (csrc / "ll_common.cuh").read_text())
    assert ll.SYNCS == {"grid": 0, "token": 1}  # enum LlSync
    assert "enum LlSync { kLlSyncGrid = 0, kLlSyncToken = 1 };" in (csrc / "ll_common.cuh").read_text()


def test_combine_chunk_auto_picks_by_tokens_per_rank():
    ll = pytest.importorskip("epbench.backends.epbench_ll")
    from epbench import options

    assert options.resolve("epbench-ll", {})["combine_chunk"] == 0  # auto unless asked
    assert [ll.combine_chunk_for(0, t) for t in (1, 32, 64, 65, 128)] == [2, 2, 2, 4, 4]
    assert ll.combine_chunk_for(4, 1) == 4 and ll.combine_chunk_for(2, 128) == 2  # asked: kept


# -- epbench-ll option combine_order (csrc/ll_combine.cu push_unit) --------------------------------

def test_combine_order_option_parses_defaults_and_matches_the_kernels_enum():
    from pathlib import Path

    from epbench import options

    ll = pytest.importorskip("epbench.backends.epbench_ll")
    assert options.resolve("epbench-ll", {}, environ={})["combine_order"] == "rotated"  # measured faster
    assert options.parse_cli(["combine_order=source"]) == {"epbench-ll": {"combine_order": "source"}}
    env = {"EPBENCH_LL_COMBINE_ORDER": "source"}
    assert options.resolve("epbench-ll", {}, environ=env)["combine_order"] == "source"
    with pytest.raises(UserError, match="combine_order: must be one of source, rotated, got 'rank'"):
        options.validate({"epbench-ll": {"combine_order": "rank"}})
    assert ll.ORDERS == {"source": 0, "rotated": 1}
    header = (Path(__file__).resolve().parents[1] / "csrc" / "ll_common.cuh").read_text()
    assert "enum LlCombineOrder { kLlOrderSource = 0, kLlOrderRotated = 1 };" in header


def _push_units(order, tokens, me, with_self, nch):
    """csrc/ll_combine.cu's push_unit_count / push_unit, step by step: the (rank, token, chunk) of
    every unit index a warp may hold, None where the rotated order names no unit."""
    world = len(tokens)
    pushed = [0 if (s == me and not with_self) else t for s, t in enumerate(tokens)]
    prefix = [sum(pushed[:s]) for s in range(world + 1)]
    np_ = world if with_self else world - 1
    if order == "source":
        out = []
        for u in range(prefix[world] * nch):
            st, c = divmod(u, nch)
            s = next(r for r in range(world) if st < prefix[r + 1])
            out.append((s, st - prefix[s], c))
        return out
    tmax = max([pushed[(me + 1 + i) % world] for i in range(np_)], default=0)
    out = []
    for u in range(np_ * tmax * nch):
        k, i = divmod(u, np_)
        s = (me + 1 + i) % world
        t, c = divmod(k, nch)
        out.append((s, t, c) if t < pushed[s] else None)
    return out


@pytest.mark.parametrize("with_self", [False, True])  # the token kernel pushes to peers, the grid kernel to all
@pytest.mark.parametrize("tokens", [(3, 3, 3, 3), (5, 0, 2, 7), (0, 0, 0, 0), (4,), (1, 6)])
def test_both_push_orders_name_every_unit_once_and_rotated_takes_turns(tokens, with_self):
    nch = 2
    for me in range(len(tokens)):
        src = _push_units("source", tokens, me, with_self, nch)
        rot = _push_units("rotated", tokens, me, with_self, nch)
        named = [u for u in rot if u is not None]
        assert len(set(named)) == len(named) and sorted(named) == sorted(src)  # the same units, once each
        assert all(s != me for s, _, _ in src) or with_self
        peers = [(me + 1 + i) % len(tokens) for i in range(len(tokens) - (0 if with_self else 1))]
        if len(set(tokens)) == 1 and tokens[0] and peers:  # even batches: each run of np units goes to every rank once
            assert [u[0] for u in rot[: len(peers)]] == peers
            assert src[0][0] == min(peers)  # source order: the lowest rank first


def test_backend_sets_the_combine_order_and_records_it(monkeypatch):
    import ctypes

    ll = pytest.importorskip("epbench.backends.epbench_ll")
    from epbench import cuda_lib
    from epbench.contract import RankSetup

    error_word = ctypes.c_int(0)
    calls, units_set, releases, places = [], [], [], []

    class Lib:
        def ep_ll_create(self, cfg, out):
            return 0

        def ep_ll_base(self, ctx):
            return 1

        def ep_ll_set_sync(self, ctx, sync):
            return 0

        def ep_ll_set_combine_order(self, ctx, order):
            calls.append(order)
            return 0

        def ep_ll_set_dispatch_units(self, ctx, units):
            units_set.append(units)
            return 0

        def ep_ll_set_dispatch_place(self, ctx, place):
            places.append(place)
            return 0

        def ep_ll_set_combine_release(self, ctx, release):
            releases.append(release)
            return 0

        def ep_error_flag_ptr(self, ep):
            return ctypes.addressof(error_word)

    monkeypatch.setattr(cuda_lib, "load", Lib)
    monkeypatch.setattr(ll.EpbenchLowLatencyBackend, "_open_peers", lambda self: None)
    monkeypatch.setattr(ll.EpbenchLowLatencyBackend, "_views", lambda self: None)
    monkeypatch.setattr(ll.EpbenchLowLatencyBackend, "unavailable_reason", classmethod(lambda cls, s: None))
    setup = RankSetup(rank=0, world=1, gpus_per_node=1, device=torch.device("cuda", 0), hidden=128,
                      max_tokens_per_rank=4, topk=2, experts_per_rank=2, dispatch_dtype="bf16", mode="low_latency")
    for var in ("EPBENCH_LL_COMBINE_ORDER", "EPBENCH_LL_DISPATCH_UNITS", "EPBENCH_LL_COMBINE_RELEASE",
                "EPBENCH_LL_DISPATCH_PLACE", "EPBENCH_LL_DISPATCH_STAGE"):
        monkeypatch.delenv(var, raising=False)  # every backend below takes the defaults
    assert ll.EpbenchLowLatencyBackend(setup).effective_config()["combine_order"] == "rotated"
    be = ll.EpbenchLowLatencyBackend(setup, combine_order="source")
    assert be.effective_config()["combine_order"] == "source" and calls == [1, 0]
    be.use_combine_order("rotated")
    assert be.effective_config()["combine_order"] == "rotated" and calls == [1, 0, 1]
    # dispatch_units: auto picks chunk at these 4 tokens per rank; set in the kernels and recorded where the
    # token dispatch runs
    assert units_set == [1, 1] and be.effective_config()["dispatch_units"] == ("chunk" if be.ll_sync == "token" else "row")
    row = ll.EpbenchLowLatencyBackend(setup, ll_sync="token", dispatch_units="row")
    assert units_set[-1] == 0 and row.effective_config()["dispatch_units"] == "row"
    token = ll.EpbenchLowLatencyBackend(setup, ll_sync="token", dispatch_units="chunk")
    assert units_set[-1] == 1 and token.effective_config()["dispatch_units"] == "chunk"
    grid = ll.EpbenchLowLatencyBackend(setup, ll_sync="grid", dispatch_units="chunk")
    assert grid.effective_config()["dispatch_units"] == "row"  # the grid dispatch has no peer units
    token.use_dispatch_units("row")
    assert units_set[-1] == 0 and token.effective_config()["dispatch_units"] == "row"
    token.use_dispatch_units("auto")  # 4 tokens per rank: chunk
    assert units_set[-1] == 1 and token.effective_config()["dispatch_units"] == "chunk"
    # combine_release: batch by default, unit set in the kernels; the grid combine releases once per grid
    assert set(releases) == {1} and token.effective_config()["combine_release"] == "batch"
    single = ll.EpbenchLowLatencyBackend(setup, ll_sync="token", combine_release="unit")
    assert releases[-1] == 0 and single.effective_config()["combine_release"] == "unit"
    assert grid.effective_config()["combine_release"] == "grid"
    single.use_combine_release("batch")
    assert releases[-1] == 1 and single.effective_config()["combine_release"] == "batch"
    # dispatch_place: auto by default, inline at these 4 tokens per rank; slot set in the kernels and recorded where
    # the token dispatch runs
    assert set(places) == {2} and token.effective_config()["dispatch_place"] == "inline"
    slotted = ll.EpbenchLowLatencyBackend(setup, ll_sync="token", dispatch_place="slot")
    assert places[-1] == 1 and slotted.effective_config()["dispatch_place"] == "slot"
    assert ll.EpbenchLowLatencyBackend(setup, ll_sync="grid", dispatch_place="slot").effective_config()[
        "dispatch_place"] == "stage"  # the grid dispatch always stages
    slotted.use_dispatch_place("stage")
    assert places[-1] == 0 and slotted.effective_config()["dispatch_place"] == "stage"
    slotted.use_dispatch_place("auto")  # 4 tokens per rank: inline
    assert places[-1] == 2 and slotted.effective_config()["dispatch_place"] == "inline"
    big = ll.EpbenchLowLatencyBackend(dataclasses.replace(setup, max_tokens_per_rank=17), ll_sync="token")
    assert places[-1] == 0 and big.effective_config()["dispatch_place"] == "stage"  # a buffer above 16 tokens
    # dispatch_place line sends whole rows: row units (set, or auto above 16 tokens), never chunk
    lined = ll.EpbenchLowLatencyBackend(big.s, ll_sync="token", dispatch_place="line")
    assert places[-1] == 3 and lined.effective_config()["dispatch_place"] == "line"
    assert lined.effective_config()["dispatch_units"] == "row"
    with pytest.raises(RuntimeError, match="dispatch_place line sends whole rows: it needs dispatch_units row"):
        ll.EpbenchLowLatencyBackend(setup, ll_sync="token", dispatch_place="line")  # 4 tokens: auto picks chunk
    assert ll.EpbenchLowLatencyBackend(setup, ll_sync="grid", dispatch_place="line").effective_config()[
        "dispatch_place"] == "stage"  # the grid dispatch ignores the placement
    lined128 = ll.EpbenchLowLatencyBackend(big.s, ll_sync="token", dispatch_place="line128")
    assert places[-1] == 4 and lined128.effective_config()["dispatch_place"] == "line128"
    with pytest.raises(RuntimeError, match="dispatch_place line128 sends whole rows: it needs dispatch_units row"):
        ll.EpbenchLowLatencyBackend(setup, ll_sync="token", dispatch_place="line128")


def test_dispatch_units_option_parses_and_matches_the_kernels_enum():
    from pathlib import Path

    from epbench import options

    ll = pytest.importorskip("epbench.backends.epbench_ll")
    assert options.resolve("epbench-ll", {}, environ={})["dispatch_units"] == "auto"
    assert [ll.dispatch_units_for("auto", t) for t in (1, 16, 17, 128)] == ["chunk", "chunk", "row", "row"]
    assert ll.dispatch_units_for("row", 1) == "row" and ll.dispatch_units_for("chunk", 256) == "chunk"
    assert options.resolve("epbench-ll", {}, environ={"EPBENCH_LL_DISPATCH_UNITS": "chunk"})["dispatch_units"] == "chunk"
    with pytest.raises(UserError, match="dispatch_units: must be one of auto, row, chunk, got 'half'"):
        options.validate({"epbench-ll": {"dispatch_units": "half"}})
    assert ll.UNITS == {"row": 0, "chunk": 1} and ll.RELEASES == {"unit": 0, "batch": 1}
    header = (Path(__file__).resolve().parents[1] / "csrc" / "ll_common.cuh").read_text()
    assert "enum LlDispatchUnits { kLlUnitsRow = 0, kLlUnitsChunk = 1 };" in header
    assert "enum LlCombineRelease { kLlReleaseUnit = 0, kLlReleaseBatch = 1 };" in header
    assert options.resolve("epbench-ll", {}, environ={})["combine_release"] == "batch"
    assert options.resolve("epbench-ll", {}, environ={})["dispatch_place"] == "auto"
    assert [ll.dispatch_place_for("auto", t) for t in (1, 16, 17, 128)] == ["inline", "inline", "stage", "stage"]
    assert ll.dispatch_place_for("slot", 1) == "slot" and ll.dispatch_place_for("inline", 256) == "inline"
    assert ll.PLACES == {"stage": 0, "slot": 1, "inline": 2, "line": 3, "line128": 4}
    assert ("enum LlDispatchPlace { kLlPlaceStage = 0, kLlPlaceSlot = 1, kLlPlaceInline = 2, kLlPlaceLine = 3, "
            "kLlPlaceLine128 = 4 };" in header)
    with pytest.raises(UserError, match="dispatch_place: must be one of auto, stage, slot, inline, line, line128, "
                                        "got 'peer'"):
        options.validate({"epbench-ll": {"dispatch_place": "peer"}})
    with pytest.raises(UserError, match="combine_release: must be one of unit, batch, got 'all'"):
        options.validate({"epbench-ll": {"combine_release": "all"}})


def _line_parts(row: bytes, line_bytes: int, tag: int):
    """csrc/ll_dispatch.cu load_line_parts<line_bytes> over every pass: {(line, part j): (lo, hi)} as 8-byte
    little-endian words; with P = line_bytes / 16 parts a line and payload = line_bytes - 8, part j < P - 1 holds
    payload bytes [payload L + 16 j, + 16), part P - 1 the 8 bytes at payload L + 16 (P - 1) and the tag."""
    R, out, parts, payload = len(row), {}, line_bytes // 16, line_bytes - 8
    word = lambda off: int.from_bytes(row[off:off + 8], "little") if off < R else 0  # noqa: E731
    for L in range((R + payload - 1) // payload):
        for j in range(parts):
            off = payload * L + 16 * j
            out[L, j] = (word(off), tag if j == parts - 1 else word(off + 8))
    return out


@pytest.mark.parametrize("line_bytes", [64, 128])
@pytest.mark.parametrize("row_bytes", [16, 48, 56, 64, 112, 128, 240, 2048, 7168, 7184, 14336, 16384])
def test_line_placement_carries_every_byte_of_the_row_once(row_bytes, line_bytes):
    """dispatch_place line (64-byte lines) and line128: the sender's parts, written back as receive_line stores
    them (8-byte stores at payload L + 16 j, the second only for j < P - 1, neither past the row), give back the row
    exactly; every line carries its tag in its last part; each size's rows fit the lline region."""
    import random

    root = Path(__file__).resolve().parents[1] / "csrc"
    header = (root / "ll_common.cuh").read_text()
    assert ("static constexpr int kParts = kBytes / 16;" in header and "static constexpr int kPayload = kBytes - 8;"
            in header and "static constexpr bool kReread = kBytes == 128;" in header
            and "kLlLineMark = 0x4c494e45u;" in header)
    parts_per_line, payload = line_bytes // 16, line_bytes - 8
    rng = random.Random(row_bytes)
    row = bytes(rng.randrange(256) for _ in range(row_bytes))
    lines = (row_bytes + payload - 1) // payload
    tag = (7 << 32) | 0x4C494E45
    parts = _line_parts(row, line_bytes, tag)
    got = bytearray(row_bytes)
    written = [0] * row_bytes
    for (L, j), (lo, hi) in parts.items():
        off = payload * L + 16 * j
        last = j == parts_per_line - 1
        for value, at, ok in ((lo, off, off < row_bytes), (hi, off + 8, not last and off + 8 < row_bytes)):
            if ok:
                got[at:at + 8] = value.to_bytes(8, "little")
                for b in range(at, at + 8):
                    written[b] += 1
    assert bytes(got) == row and written == [1] * row_bytes
    assert all(parts[L, parts_per_line - 1][1] == tag for L in range(lines))
    # lane l of pass q of a batch from line L0 holds line L0 + (32 / P) q + l / P: a sender's batches of 8 passes
    # and the receive units' batches of 4 (nxr = lines / batch rounded up) each reach every line once
    per_pass = 32 // parts_per_line
    for per_batch in (per_pass * 8, per_pass * 4):
        reached = [L0 + per_pass * q + lane // parts_per_line for L0 in range(0, lines, per_batch)
                   for q in range(per_batch // per_pass) for lane in range(0, 32, parts_per_line)]
        assert sorted(L for L in reached if L < lines) == list(range(lines))
    # ll_buffers.cu: lstage rows hold inline words only; lline rows are as long as the larger size needs, each
    # size's rows Lc x kWords words apart (the row fits), zeroed at creation
    src = (root / "ll_buffers.cu").read_text()
    assert "lp.lrow_words = lp.lrow_head + 4 * (p.row_bytes / 16);" in src
    assert "lp.lline_words = std::max(lp.line_count * 8, lp.line128_count * 16);" in src
    assert "const size_t lline_bytes = (size_t)p.world * lp.t_max * lp.lline_words * sizeof(unsigned long long);" in src
    assert "cudaMemset(r + lp.off_lline, 0, lline_bytes)" in src
    assert lines * line_bytes <= 8 * max((row_bytes + 55) // 56 * 8, (row_bytes + 119) // 120 * 16)


def _dispatch_units(T, world, me, nx, ng, pnx):
    """csrc/ll_dispatch.cu's token-dispatch unit map, step by step: unit u -> ('own', t, chunk, group)
    or ('peer', t, d, chunk)."""
    own_units = nx * ng
    per_token = own_units + (world - 1) * pnx
    out = []
    for u in range(T * per_token):
        t, r = divmod(u, per_token)
        if r < own_units:
            out.append(("own", t, r // ng, r % ng))
        else:
            pr = r - own_units
            out.append(("peer", t, (me + 1 + pr % (world - 1)) % world, pr // (world - 1)))
    return out


@pytest.mark.parametrize("world, T", [(2, 3), (4, 5), (3, 1)])
def test_chunk_units_send_every_chunk_of_every_row_to_every_peer_once(world, T):
    nx, ng = 4, 2
    for me in range(world):
        row = [u for u in _dispatch_units(T, world, me, nx, ng, 1) if u[0] == "peer"]
        chunk = [u for u in _dispatch_units(T, world, me, nx, ng, nx) if u[0] == "peer"]
        assert sorted(u[1:3] for u in row) == sorted((t, d) for t in range(T) for d in range(world) if d != me)
        assert all(u[3] == 0 for u in row)
        want = sorted((t, d, c) for t in range(T) for d in range(world) if d != me for c in range(nx))
        assert sorted(u[1:] for u in chunk) == want and len(set(chunk)) == len(chunk)
        first = chunk[: world - 1]  # a token's first peer units go to every peer once (peer-minor)
        assert sorted(u[2] for u in first) == sorted(d for d in range(world) if d != me)
        own = [u for u in _dispatch_units(T, world, me, nx, ng, nx) if u[0] == "own"]
        assert len(own) == T * nx * ng  # the own rows' units are those of row units
