"""The deepep backend against a fake ``deep_ep`` module (DeepEP itself is not installed where the
tests run): the fake implements DeepEP V1's documented intranode semantics in plain torch over a
gloo group (local expert ids with -1 and zeroed weights for other ranks' experts, rows ordered
by source rank then token, combine that sums copies WITHOUT weights), so the backend's bridging
and epbench's verification are checked end to end. Also: the masked mode of check_dispatch,
and the skip when deep_ep is missing (one CLI run)."""

from __future__ import annotations

import multiprocessing as mp
import socket
import sys
import types
from typing import Any, Dict, List, Optional

import pytest
import torch
import torch.distributed as dist

from epbench.backends import REGISTRY, backend_class
from epbench.contract import DispatchOutput, RankSetup
from epbench.driver import Point, PointRecord, measure_point
from epbench.inputs import dispatch_input, make_tokens
from epbench.launch import Comm
from epbench.routing import route_all, route_rank
from epbench.scenario import Routing, parse
from epbench.verify import check_dispatch
from support import run_cli, scenario_dict

CPU = torch.device("cpu")


# -- the fake deep_ep ------------------------------------------------------------------------

def make_fake_deep_ep(fault: Optional[str] = None) -> types.ModuleType:
    """A fresh fake ``deep_ep`` (class state included). ``fault`` makes it misbehave:
    "drop_weight": one received weight of a local expert is 0; "swap_rows": received rows 0 and
    1 change places; "global_ids": received ids stay global; "weighted_combine": combine applies
    the weights itself (so a backend that also does ends up applying them twice)."""
    mod = types.ModuleType("deep_ep")
    mod.calls = {"set_num_sms": [], "buffers": [], "dispatch_sms": [], "combine_sms": [], "cached": 0}

    class Config:
        def __init__(self, num_sms: int, nvl_send: int, nvl_recv: int, rdma_send: int,
                     rdma_recv: int) -> None:
            self.num_sms = num_sms
            self.num_max_nvl_chunked_send_tokens = nvl_send
            self.num_max_nvl_chunked_recv_tokens = nvl_recv

        def get_nvl_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
            per_row = hidden_bytes + 128 * (8 + 4 + 4) + 8  # ids, weights, scales, source meta
            return (self.num_sms // 2) * num_ranks * self.num_max_nvl_chunked_recv_tokens * per_row

    class Buffer:
        num_sms = 20

        def __init__(self, group: Any, num_nvl_bytes: int = 0, num_rdma_bytes: int = 0) -> None:
            self.group = group
            self.rank, self.size = group.rank(), group.size()
            mod.calls["buffers"].append((num_nvl_bytes, num_rdma_bytes))

        @staticmethod
        def set_num_sms(n: int) -> None:
            assert n % 2 == 0, "The SM count must be even"
            mod.calls["set_num_sms"].append(n)
            Buffer.num_sms = n

        @staticmethod
        def get_dispatch_config(num_ranks: int) -> Config:
            assert num_ranks in (1, 2, 4, 8), f"Unsupported number of EP ranks: {num_ranks}"
            return Config(Buffer.num_sms, 6, 256, 6, 128)

        @staticmethod
        def get_combine_config(num_ranks: int) -> Config:
            assert num_ranks in (1, 2, 4, 8), f"Unsupported number of EP ranks: {num_ranks}"
            return Config(Buffer.num_sms, 4, 256, 6, 128)

        def _gather(self, obj: Any) -> List[Any]:
            out: List[Any] = [None] * self.size
            dist.all_gather_object(out, obj, group=self.group)
            return out

        def get_dispatch_layout(self, topk_idx: torch.Tensor, num_experts: int):
            epr = num_experts // self.size
            in_rank = torch.zeros(topk_idx.shape[0], self.size, dtype=torch.bool)
            valid = topk_idx >= 0
            rows = torch.arange(topk_idx.shape[0]).unsqueeze(1).expand_as(topk_idx)
            in_rank[rows[valid], topk_idx[valid] // epr] = True
            per_rank = in_rank.sum(dim=0).to(torch.int32)
            per_expert = torch.bincount(topk_idx[valid], minlength=num_experts).to(torch.int32)
            return per_rank, None, per_expert, in_rank, None

        def dispatch(self, x, handle=None, num_tokens_per_rank=None, num_tokens_per_rdma_rank=None,
                     is_token_in_rank=None, num_tokens_per_expert=None, topk_idx=None,
                     topk_weights=None, expert_alignment=1, config=None, previous_event=None,
                     async_finish=False, allocate_on_comm_stream=False):
            assert config is not None and config.num_sms == Buffer.num_sms
            mod.calls["dispatch_sms"].append(config.num_sms)
            mod.calls.setdefault("dispatch_chunk", []).append(config.num_max_nvl_chunked_send_tokens)
            x, scales = x if isinstance(x, tuple) else (x, None)
            assert x.dtype in (torch.bfloat16, torch.float8_e4m3fn)
            if handle is not None:  # cached mode: the layout's rows again, payload only (deep_ep/buffer.py)
                assert topk_idx is None and topk_weights is None and num_tokens_per_rank is None
                mod.calls["cached"] += 1
                src_rank, src_tok, num_tokens, in_rank, channels = handle
                assert channels == config.num_sms // 2, "a handle is made for one channel count"
                every = self._gather((x.view(torch.uint8), scales, in_rank))
                xs = [sx[sin[:, self.rank].nonzero().flatten()] for sx, _, sin in every]
                recv_x = torch.cat(xs).view(x.dtype)
                if scales is not None:
                    recv_s = torch.cat([ssc[sin[:, self.rank].nonzero().flatten()] for _, ssc, sin in every])
                    return (recv_x, recv_s), None, None, None, None, None
                return recv_x, None, None, None, None, None
            num_experts = int(num_tokens_per_expert.numel())
            epr, me = num_experts // self.size, self.rank
            # fp8 tensors do not survive all_gather_object's pickling: move their bytes
            every = self._gather((x.view(torch.uint8), scales, topk_idx, topk_weights,
                                  is_token_in_rank))
            xs, ss, ids, ws, src_rank, src_tok = [], [], [], [], [], []
            for s, (sx, ssc, sidx, sw, sin) in enumerate(every):
                rows = sin[:, me].nonzero().flatten()
                xs.append(sx[rows])
                if ssc is not None:
                    ss.append(ssc[rows])
                local = sidx[rows] - me * epr
                hit = (local >= 0) & (local < epr)
                ids.append(torch.where(hit, local, torch.full_like(local, -1)))
                ws.append(torch.where(hit, sw[rows], torch.zeros_like(sw[rows])))
                src_rank.append(torch.full_like(rows, s))
                src_tok.append(rows)
            recv_x, recv_idx, recv_w = torch.cat(xs).view(x.dtype), torch.cat(ids), torch.cat(ws)
            recv_s = torch.cat(ss) if scales is not None else None
            src_rank, src_tok = torch.cat(src_rank), torch.cat(src_tok)
            if fault == "drop_weight":
                r, c = (recv_idx >= 0).nonzero()[0].tolist()
                recv_w[r, c] = 0.0
            elif fault == "swap_rows" and recv_x.shape[0] >= 2:
                # rows land in the wrong places while the layout kept for combine does not know
                for t in (recv_x, recv_idx, recv_w):
                    t[[0, 1]] = t[[1, 0]].clone()
            elif fault == "global_ids":
                recv_idx = torch.where(recv_idx >= 0, recv_idx + me * epr, recv_idx)
            counts = [int((recv_idx == e).sum()) for e in range(epr)]
            handle = (src_rank, src_tok, int(x.shape[0]), is_token_in_rank, config.num_sms // 2)
            out_x = (recv_x, recv_s) if scales is not None else recv_x
            return out_x, recv_idx, recv_w, counts, handle, None

        def combine(self, x, handle, topk_weights=None, config=None, previous_event=None,
                    async_finish=False, allocate_on_comm_stream=False):
            assert config is not None and config.num_sms == Buffer.num_sms
            assert x.dtype == torch.bfloat16 and x.is_contiguous()
            mod.calls["combine_sms"].append(config.num_sms)
            mod.calls.setdefault("combine_chunk", []).append(config.num_max_nvl_chunked_send_tokens)
            src_rank, src_tok, num_tokens = handle[:3]
            assert x.shape[0] == src_rank.shape[0]
            extra = None
            if fault == "weighted_combine":
                extra = mod.last_weights  # what a weighting combine would multiply by
            every = self._gather((x, src_rank, src_tok, extra))
            acc = torch.zeros(num_tokens, x.shape[1], dtype=torch.float32)
            for y, sr, st, w in every:
                mine = (sr == self.rank).nonzero().flatten()
                rows = y[mine].float()
                if w is not None:
                    rows = rows * w[mine].sum(dim=1, keepdim=True)
                acc.index_add_(0, st[mine], rows)
            return acc.to(torch.bfloat16), None, None

    if fault == "weighted_combine":
        real_dispatch = Buffer.dispatch

        def remembering_dispatch(self, *args, **kwargs):
            res = real_dispatch(self, *args, **kwargs)
            mod.last_weights = res[2]
            return res

        Buffer.dispatch = remembering_dispatch

    mod.Buffer, mod.Config = Buffer, Config
    return mod


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def gloo_world1():
    assert not dist.is_initialized()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0,
                            world_size=1)
    try:
        yield Comm(0, 1, 0, CPU)
    finally:
        dist.destroy_process_group()


def install_fake(monkeypatch, fault: Optional[str] = None) -> types.ModuleType:
    fake = make_fake_deep_ep(fault)
    monkeypatch.setitem(sys.modules, "deep_ep", fake)
    return fake


def scenario(world: int, dtype: str = "bf16", hidden: int = 256, tokens: int = 24):
    return parse(scenario_dict(
        model={"hidden": hidden, "tokens_per_rank": tokens, "topk": 4, "experts_per_rank": 4,
               "dispatch_dtype": dtype},
        topology={"name": "fake", "nodes": 1, "gpus_per_node": world},
        bench={"backends": ["deepep"], "sms": [4]}), "<test>")


def setup_of(s, rank: int, device=CPU) -> RankSetup:
    m = s.model
    return RankSetup(rank=rank, world=s.world, gpus_per_node=s.topology.gpus_per_node,
                     device=device, hidden=m.hidden, max_tokens_per_rank=m.tokens_per_rank,
                     topk=m.topk, experts_per_rank=m.experts_per_rank,
                     dispatch_dtype=m.dispatch_dtype)


def run_point(s, comm: Comm, sms: int = 4, inject: Optional[str] = None, mode: str = "call") -> PointRecord:
    """Times a few iterations, then verifies one point, as epbench.driver.measure does."""
    from epbench.backends.deepep import DeepEPBackend

    be = DeepEPBackend(setup_of(s, comm.rank), max_sms=8, chunks="default")
    be.use_call_mode(mode)
    try:
        rec = PointRecord(comm.rank)
        measure_point(Point(be, s, route_all(s), sms, comm, input_sets=2), 1, 2, 7, inject, rec)
        return rec
    finally:
        be.close()


# -- one rank, in process ----------------------------------------------------------------------

def test_registered():
    assert REGISTRY["deepep"] == "epbench.backends.deepep:DeepEPBackend"
    cls = backend_class("deepep")  # importable without deep_ep
    assert cls.name == "deepep" and cls.uses_sms and cls.receives_local_expert_ids


@pytest.mark.parametrize("mode", ["call", "kernel"])
@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
def test_correct_fake_verifies_clean(monkeypatch, gloo_world1, dtype, mode):
    fake = install_fake(monkeypatch)
    rec = run_point(scenario(1, dtype), gloo_world1, mode=mode)
    assert rec.wrong == {"dispatch": 0, "combine": 0}, rec.problem
    assert len(rec.samples_us["dispatch"]) == 2
    # every call went through DeepEP with the point's SM count in its config
    assert set(fake.calls["dispatch_sms"]) == {4} and set(fake.calls["combine_sms"]) == {4}


# Kernel mode has no swap_rows-combine case: the fake swaps rows in its full dispatch only, the
# cached rows stay in place and every weight sum is 1 at world 1, so combine is right there
# (dispatch is still caught: the ids no longer match the rows).
@pytest.mark.parametrize("fault, op, mode", [(f, o, m) for m in ("call", "kernel")
                                             for f, o in (("drop_weight", "dispatch"), ("drop_weight", "combine"),
                                                          ("swap_rows", "dispatch"), ("swap_rows", "combine"))
                                             if (f, o, m) != ("swap_rows", "combine", "kernel")])
def test_faulty_fake_is_caught(monkeypatch, gloo_world1, fault, op, mode):
    install_fake(monkeypatch, fault)
    rec = run_point(scenario(1), gloo_world1, mode=mode)
    assert rec.wrong[op] > 0, (fault, rec.problem)
    assert rec.problem[op]


def test_kernel_mode_times_cached_dispatches_and_an_unweighted_combine(monkeypatch, gloo_world1):
    """Kernel mode: one full dispatch per input set before the timed loop, every other dispatch
    cached (the verification run's values go into set 0's tensors, whose layout holds: same
    routing); combine gets rows already weighted."""
    from epbench.backends.deepep import DeepEPBackend

    fake = install_fake(monkeypatch)
    be = DeepEPBackend(setup_of(scenario(1), 0), max_sms=8, chunks="default")
    assert DeepEPBackend.call_modes == ("call", "kernel") and not be.reuses_layout
    be.use_call_mode("kernel")
    assert be.reuses_layout  # the driver's input sets then keep the routing
    rec = PointRecord(0)
    measure_point(Point(be, scenario(1), route_all(scenario(1)), 4, gloo_world1, input_sets=2), 1, 2, 7, None, rec)
    assert rec.wrong == {"dispatch": 0, "combine": 0}, rec.problem
    full = len(fake.calls["dispatch_sms"]) - fake.calls["cached"]
    assert full == 2 and fake.calls["cached"] == 3 + 1  # 2 sets; 3 timed + the verification run
    with pytest.raises(ValueError, match="no call mode"):
        be.use_call_mode("fastest")
    be.close()


@pytest.mark.parametrize("mode", ["call", "kernel"])
def test_chunk_search_as_deepeps_test_and_the_winner_used_and_recorded(monkeypatch, gloo_world1, mode):
    """chunks: search times every chunk size of DeepEP's test_intranode search once per SM count,
    before the point's timed calls; the timed calls and the verification run use the fastest and
    the row's config names it with every candidate's time."""
    from epbench.backends import deepep as mod_

    fake = install_fake(monkeypatch)
    s = scenario(1)
    be = mod_.DeepEPBackend(setup_of(s, 0), max_sms=8)
    assert be.chunks == "search"
    be.use_call_mode(mode)
    rec = PointRecord(0)
    measure_point(Point(be, s, route_all(s), 4, gloo_world1, input_sets=2), 1, 2, 7, None, rec)
    assert rec.wrong == {"dispatch": 0, "combine": 0}, rec.problem
    cfg = be.effective_config()
    assert cfg["num_sms"] == 4 and cfg["chunks"] == "search"
    d, c = cfg["search_dispatch_us"], cfg["search_combine_us"]
    assert tuple(d) == mod_.DISPATCH_CHUNKS == tuple(range(4, 33, 2))
    assert tuple(c) == mod_.COMBINE_CHUNKS == tuple(range(1, 17))
    # the winners are the fastest (recorded rounded to 0.01 us: a tie there may name either of the tied sizes)
    assert d[cfg["nvl_chunk_dispatch"]] == min(d.values()) and c[cfg["nvl_chunk_combine"]] == min(c.values())
    tries = len(mod_.DISPATCH_CHUNKS) * (mod_.TUNE_WARMUP + mod_.TUNE_ITERS)
    # after the search, every dispatch (layouts, timed, verification) and combine used the winners
    assert set(fake.calls["dispatch_chunk"][1 + tries:]) == {cfg["nvl_chunk_dispatch"]}
    ctries = len(mod_.COMBINE_CHUNKS) * (mod_.TUNE_WARMUP + mod_.TUNE_ITERS)
    assert set(fake.calls["combine_chunk"][ctries:]) == {cfg["nvl_chunk_combine"]}
    # a second point at the same SM count does not search again
    n = len(fake.calls["dispatch_chunk"])
    measure_point(Point(be, s, route_all(s), 4, gloo_world1, input_sets=1), 1, 1, 7, None, PointRecord(0))
    assert len(fake.calls["dispatch_chunk"]) - n < 6
    be.close()


def test_driver_fault_injection_is_caught(monkeypatch, gloo_world1):
    install_fake(monkeypatch)
    s = scenario(1)
    assert run_point(s, gloo_world1, inject="dispatch").wrong["dispatch"] == 1
    assert run_point(s, gloo_world1, inject="combine").wrong["combine"] == 1


def test_buffers_sized_once_and_sms_set_only_on_change(monkeypatch, gloo_world1):
    from epbench.backends.deepep import DeepEPBackend

    fake = install_fake(monkeypatch)
    s = scenario(1)
    be = DeepEPBackend(setup_of(s, 0), max_sms=9, chunks="default")  # rounded down to an even count
    assert be.max_sms == 8
    hint = max(cfg.get_nvl_buffer_size_hint(2 * s.model.hidden, 1)
               for cfg in (fake.Config(8, 6, 256, 6, 128), fake.Config(8, 4, 256, 6, 128)))
    assert fake.calls["buffers"] == [(hint, 0)]
    x = make_tokens(s.model.tokens_per_rank, s.model.hidden, 1, 0, 0, CPU)
    inp = dispatch_input(x, route_all(s)[0], "bf16", CPU)
    fake.calls["set_num_sms"].clear()
    for sms in (4, 4, 6, 6):
        out = be.dispatch(inp, sms)
        be.combine_input(out).fill_(1.0)
        be.combine(out, sms)
    assert fake.calls["set_num_sms"] == [4, 6]
    assert fake.calls["buffers"] == [(hint, 0)]  # no new Buffer per point
    with pytest.raises(ValueError, match="even"):
        be.dispatch(inp, 3)
    with pytest.raises(ValueError, match="sized for"):
        be.dispatch(inp, 10)
    be.close()


def test_combine_input_is_a_slice_of_one_buffer(monkeypatch, gloo_world1):
    from epbench.backends.deepep import DeepEPBackend

    install_fake(monkeypatch)
    s = scenario(1)
    be = DeepEPBackend(setup_of(s, 0), max_sms=4, chunks="default")
    x = make_tokens(s.model.tokens_per_rank, s.model.hidden, 1, 0, 0, CPU)
    out = be.dispatch(dispatch_input(x, route_all(s)[0], "bf16", CPU), 4)
    y = be.combine_input(out)
    assert y.dtype == torch.bfloat16 and tuple(y.shape) == (out.num_recv, s.model.hidden)
    assert y.data_ptr() == be.combine_in.data_ptr()
    be.close()


def test_unavailable_without_deep_ep(monkeypatch):
    from epbench.backends.deepep import DeepEPBackend

    monkeypatch.setitem(sys.modules, "deep_ep", None)  # makes `import deep_ep` fail
    reason = DeepEPBackend.unavailable_reason(setup_of(scenario(2), 0))
    assert reason.startswith("deep_ep is not installed (import deep_ep failed: ")
    assert "\n" not in reason


def test_unavailable_reasons_with_deep_ep(monkeypatch):
    from epbench.backends.deepep import DeepEPBackend

    install_fake(monkeypatch)
    assert DeepEPBackend.unavailable_reason(setup_of(scenario(2), 0)) == "needs CUDA GPUs"


# -- two ranks: other ranks' experts show up as -1 / 0 -------------------------------------

CASES_2 = [("fp8", None), ("bf16", None), ("bf16", "global_ids"), ("bf16", "weighted_combine")]


def _two_rank_worker(rank: int, port: int, q) -> None:
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=2)
        try:
            for dtype, fault in CASES_2:
                sys.modules["deep_ep"] = make_fake_deep_ep(fault)
                rec = run_point(scenario(2, dtype), Comm(rank, 2, rank, CPU))
                q.put((rank, dtype, fault, rec.wrong, rec.problem))
        finally:
            dist.destroy_process_group()
    except BaseException as e:  # reported to the parent instead of a silent exit
        q.put((rank, None, None, None, repr(e)))


def test_two_ranks():
    """Two gloo ranks in spawned processes, where other ranks' experts exist: a correct fake
    verifies clean (fp8 and bf16); a fake that keeps global ids is caught on rank 1 (on rank 0
    local and global ids coincide); a fake whose combine applies the weights itself is caught
    (the backend's scaling then counts twice). With one rank every w(t, d) is 1, so only here
    does the weight scaling in combine make a difference."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_two_rank_worker, args=(r, port, q)) for r in (0, 1)]
    for p in procs:
        p.start()
    got: Dict[Any, Any] = {}
    try:
        for _ in range(2 * len(CASES_2)):
            rank, dtype, fault, wrong, problem = q.get(timeout=180)
            assert wrong is not None, (rank, problem)
            got[(rank, dtype, fault)] = (wrong, problem)
    finally:
        for p in procs:
            p.join(timeout=30)
    for rank in (0, 1):
        for dtype in ("fp8", "bf16"):
            wrong, problem = got[(rank, dtype, None)]
            assert wrong == {"dispatch": 0, "combine": 0}, (rank, dtype, problem)
    assert got[(1, "bf16", "global_ids")][0]["dispatch"] > 0
    for rank in (0, 1):
        assert got[(rank, "bf16", "weighted_combine")][0]["combine"] > 0


# -- check_dispatch in masked mode, by hand -----------------------------------------------------

WORLD, EPR, TOPK, HIDDEN, ME = 3, 2, 2, 128, 1
TOKENS = (5, 7, 4)


def masked_case():
    ins = []
    for s, t in enumerate(TOKENS):
        r = route_rank(Routing(seed=5), t, TOPK, WORLD * EPR, s)
        ins.append(dispatch_input(make_tokens(t, HIDDEN, 5, s, 1, CPU), r, "bf16", CPU))
    rows = [(s, t) for s, inp in enumerate(ins) for t in range(inp.num_tokens)
            if any(int(e) // EPR == ME for e in inp.topk_idx[t])]
    cap = 32
    x = torch.full((cap, HIDDEN), float("nan")).to(torch.bfloat16)
    idx = torch.full((cap, TOPK), -7, dtype=torch.int64)
    w = torch.full((cap, TOPK), float("nan"))
    counts = torch.zeros(EPR, dtype=torch.int32)
    for row, (s, t) in enumerate(rows):
        x[row] = ins[s].x[t]
        for k in range(TOPK):
            e = int(ins[s].topk_idx[t, k])
            if e // EPR == ME:
                idx[row, k], w[row, k] = e - ME * EPR, ins[s].topk_weights[t, k]
                counts[e - ME * EPR] += 1
            else:
                idx[row, k], w[row, k] = -1, 0.0
    # the check must see some masked entries, else it proves nothing
    assert bool((idx[: len(rows)] == -1).any())
    return ins, DispatchOutput(x, None, idx, w, counts, len(rows))


def _masked_wrong(out, ins) -> int:
    return check_dispatch(out, ME, WORLD, EPR, lambda s: ins[s], local_expert_ids=True).wrong


def test_masked_dispatch_passes_and_global_mode_rejects_it():
    ins, out = masked_case()
    assert _masked_wrong(out, ins) == 0
    assert check_dispatch(out, ME, WORLD, EPR, lambda s: ins[s]).wrong > 0


def test_masked_dispatch_catches_a_wrong_id():
    ins, out = masked_case()
    r, c = (out.topk_idx[: out.num_recv] >= 0).nonzero()[0].tolist()
    out.topk_idx[r, c] = 1 - out.topk_idx[r, c]  # the other local expert
    assert _masked_wrong(out, ins) >= 1


def test_masked_dispatch_catches_an_unmasked_entry():
    ins, out = masked_case()
    r, c = (out.topk_idx[: out.num_recv] == -1).nonzero()[0].tolist()
    out.topk_weights[r, c] = 0.25  # weight kept for another rank's expert
    assert _masked_wrong(out, ins) == 1
    ins, out = masked_case()
    out.topk_idx[r, c] = int(ins[0].topk_idx.max())  # a global id where -1 belongs
    assert _masked_wrong(out, ins) >= 1


def test_masked_dispatch_catches_a_wrong_count():
    ins, out = masked_case()
    out.expert_counts[0] += 1
    assert _masked_wrong(out, ins) == 1


# -- the CLI without deep_ep ---------------------------------------------------------------------

def test_cli_skips_deepep_with_a_note(tmp_path):
    run = run_cli(tmp_path, "run", "scenarios/smoke.yaml", "--backends", "reference,deepep",
                  "--nproc", "2")  # 2 ranks: the note does not depend on the world size
    r = run.result
    assert r.code == 0, r.both
    notes = [n for n in run.meta().get("notes", []) if n.startswith("backend deepep skipped")]
    assert len(notes) == 1, run.meta().get("notes")
    # no deep_ep here, and a CPU run: either reason is a one-line note
    assert "deep_ep is not installed" in notes[0] or "needs CUDA GPUs" in notes[0], notes[0]
    assert any("backend deepep skipped" in ln for ln in r.out.splitlines())
    assert set(run.rows()["backend"]) == {"reference"}
    rows = run.all_rows()
    skipped = rows[rows["backend"] == "deepep"]["status"]  # one row per op: skipped, and why
    assert len(skipped) == 2 and skipped.str.startswith("skipped: ").all()


def test_weighting_forms():
    """The one-pass form rounds the factor to bf16 first (one rounding more, within the extra
    rounding the call mode declares); the exact form is the fp32 product rounded once."""
    from epbench.backends.weighting import EXTRA_ROUNDINGS, weigh_rows
    from epbench.contract import BF16_ROUNDING

    g = torch.Generator().manual_seed(3)
    rows = torch.randn(64, 32, generator=g).to(torch.bfloat16)
    factor = torch.rand(64, 1, generator=g, dtype=torch.float32) * 3 + 0.01
    want = rows.float() * factor
    exact = weigh_rows(rows, factor, torch.empty_like(rows), exact=True)
    fast = weigh_rows(rows, factor, torch.empty_like(rows), exact=False)
    assert torch.equal(exact, want.to(torch.bfloat16))
    rel = ((fast.float() - want).abs() / want.abs().clamp_min(1e-30)).max().item()
    assert rel <= (1 + EXTRA_ROUNDINGS[False]) * BF16_ROUNDING
    assert not torch.equal(fast, exact)  # the forms differ somewhere: the extra rounding is real
