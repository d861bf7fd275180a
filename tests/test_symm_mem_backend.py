"""The symm-mem backend against a fake of torch's symmetric-memory all-to-all ops: the fake
implements the documented semantics of ``all_to_all_vdev``, ``all_to_all_vdev_2d`` (expert-major
output, ``major_align`` padding, an empty expert padded too) and ``all_to_all_vdev_2d_offset`` with
plain tensors, for 2-4 ranks simulated by threads of one process, and enforces the documented
constraints (symmetric buffers, int64 splits, same dtype and row stride, torch's size limits,
all_to_all_vdev's exact per-block split). The backend's routing translation and epbench's
verification are then checked end to end through the driver's own time / verify functions."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, Callable, List

import pytest
import torch

from epbench.backends import REGISTRY
from epbench.contract import RankSetup
from epbench.backends.symm_mem import SymmMemBackend, limits_reason, row_unit, vdev_rows
from epbench.layout import round_up
from epbench.driver import Inputs, Point, PointRecord, measure_point, timing_draws
from epbench.inputs import make_tokens
from epbench.launch import Comm
from epbench.routing import route_all
from epbench.scenario import parse
from support import scenario_dict

CPU = torch.device("cpu")
MiB = 1 << 20


# -- the fake ops ----------------------------------------------------------------------------

class FakeWorld:
    """The ranks' shared state: each collective posts its arguments, waits for all ranks, then
    each rank computes its own output by reading the peers' posted inputs, and waits again."""

    def __init__(self, world: int) -> None:
        self.world = world
        self.barrier = threading.Barrier(world, timeout=60)
        self.posted: List[Any] = [None] * world
        self.allocations: List[List[tuple]] = [[] for _ in range(world)]

    def collective(self, rank: int, args: Any, compute: Callable[[List[Any]], None]) -> None:
        self.posted[rank] = args
        self.barrier.wait()
        compute(list(self.posted))
        self.barrier.wait()


def torch_block_counts(size: int, world: int) -> tuple:
    """The blocks torch's all_to_all_vdev launches for an input of ``size`` bytes within a node:
    older torch by size thresholds, newer (get_a2a_nblocks) one per 64 KiB rounded up to the world,
    at most 64."""
    older = 8 if size < MiB else 16 if size < 2 * MiB else 32 if size < 4 * MiB else 64
    newer = min(-(-(-(-size // (64 << 10))) // world) * world, 64)
    return older, newer


def _exclusive(splits: torch.Tensor) -> torch.Tensor:
    return torch.cumsum(splits, 0) - splits


@dataclass
class FakeSymm:
    world_state: FakeWorld
    rank: int
    calls: List[str] = field(default_factory=list)
    _symm: List[torch.Tensor] = field(default_factory=list)

    @property
    def world(self) -> int:
        return self.world_state.world

    def empty(self, shape, dtype, device) -> torch.Tensor:
        t = torch.full(shape, 0x5A if dtype == torch.uint8 else -7, dtype=dtype, device=device)
        self._symm.append(t)
        self.world_state.allocations[self.rank].append((tuple(shape), dtype))
        return t

    def barrier(self) -> None:
        self.world_state.barrier.wait()

    def _check(self, inp, out, *splits) -> None:
        for t in (inp, out, *splits):
            assert any(t is s for s in self._symm), "argument is not a symmetric tensor from empty()"
            assert t.is_contiguous()
        for s in splits:
            assert s.dtype == torch.int64
        assert inp.dtype == out.dtype and inp.stride(0) == out.stride(0), "input / out dtype or row stride differ"

    def all_to_all_vdev(self, inp, out, in_splits, out_splits_offsets) -> None:
        self.calls.append("vdev")
        self._check(inp, out, in_splits, out_splits_offsets)
        w, me = self.world, self.rank
        assert tuple(in_splits.shape) == (w,) and tuple(out_splits_offsets.shape) == (2, w)
        stride = inp.stride(0) * inp.element_size()
        size = inp.numel() * inp.element_size()

        def compute(posted) -> None:
            pos = 0
            for src, (s_inp, s_splits) in enumerate(posted):
                n = int(s_splits[me])
                for blocks in torch_block_counts(size, w):
                    per_peer = max(blocks // w, 1)
                    assert n * stride % per_peer == 0, "torch's device assert: bytes per peer not split evenly"
                    assert n * stride // per_peer % 16 == 0, \
                        "a block's piece would start off 16 bytes: NVSHMEM would copy it with narrower loads"
                start = int(_exclusive(s_splits)[me])
                out[pos: pos + n] = s_inp[start: start + n]
                out_splits_offsets[0, src], out_splits_offsets[1, src] = n, pos
                pos += n
        self.world_state.collective(me, (inp, in_splits.clone()), compute)

    def all_to_all_vdev_2d(self, inp, out, in_splits, out_splits_offsets, major_align: int) -> None:
        self.calls.append("vdev_2d")
        self._check(inp, out, in_splits, out_splits_offsets)
        w, me = self.world, self.rank
        ne = in_splits.shape[0] // w
        assert ne <= 16 and w <= 32 and major_align > 0
        assert int(in_splits.sum()) <= inp.shape[0], "sum of splits is larger than input dim"

        def compute(posted) -> None:
            pos = 0
            for e in range(ne):
                seg = 0
                for src, (s_inp, s_splits) in enumerate(posted):
                    i = me * ne + e  # the source's chunk for (this rank, local expert e)
                    n, start = int(s_splits[i]), int(_exclusive(s_splits)[i])
                    out[pos + seg: pos + seg + n] = s_inp[start: start + n]
                    out_splits_offsets[0, e * w + src], out_splits_offsets[1, e * w + src] = n, pos + seg
                    seg += n
                pos += max((seg + major_align - 1) // major_align * major_align, major_align)
        self.world_state.collective(me, (inp, in_splits.clone()), compute)

    def all_to_all_vdev_2d_offset(self, inp, out, in_splits_offsets, out_splits_offsets) -> None:
        self.calls.append("vdev_2d_offset")
        self._check(inp, out, in_splits_offsets, out_splits_offsets)
        w, me = self.world, self.rank
        ne = in_splits_offsets.shape[1] // w
        assert w <= 16 and ne <= 32

        def compute(posted) -> None:
            pos = 0
            for src, (s_inp, s_so) in enumerate(posted):
                for e in range(ne):
                    i = e * w + me  # the source's chunk for (local expert e, this rank)
                    n, start = int(s_so[0, i]), int(s_so[1, i])
                    out[pos: pos + n] = s_inp[start: start + n]
                    out_splits_offsets[0, src * ne + e], out_splits_offsets[1, src * ne + e] = n, pos
                    pos += n
        self.world_state.collective(me, (inp, in_splits_offsets.clone()), compute)


def run_ranks(world: int, fn: Callable[[int, FakeSymm], Any]) -> List[Any]:
    state = FakeWorld(world)
    results: List[Any] = [None] * world
    errors: List[BaseException] = []

    def body(rank: int) -> None:
        try:
            results[rank] = fn(rank, FakeSymm(state, rank))
        except BaseException as e:  # noqa: BLE001 - re-raised below
            errors.append(e)
            state.barrier.abort()

    threads = [threading.Thread(target=body, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    if errors:
        raise errors[0]
    assert all(len(a) == len(state.allocations[0]) and a == state.allocations[0] for a in state.allocations), \
        "symmetric allocations differ between ranks"
    return results


# -- the fake against torch's documented examples ----------------------------------------------

def test_fake_2d_matches_torchs_documented_shuffle():
    """torch's docstring: world 2, 2 experts per rank; source rank 0 holds c0..c3, rank 1 d0..d3
    (chunk i for global expert i); rank 0 receives c0 d0 | c1 d1, each expert run padded."""
    def fn(rank: int, m: FakeSymm):
        inp = m.empty((8, 1), torch.float32, CPU)
        out = m.empty((32, 1), torch.float32, CPU)
        splits = m.empty((4,), torch.int64, CPU)
        so = m.empty((2, 4), torch.int64, CPU)
        splits.copy_(torch.tensor([1, 2, 1, 1]) if rank == 0 else torch.tensor([3, 0, 1, 1]))
        inp[:, 0] = torch.arange(8) + 100 * rank
        m.all_to_all_vdev_2d(inp, out, splits, so, major_align=4)
        return out[:, 0].tolist(), so.tolist()

    (out0, so0), (out1, so1) = run_ranks(2, fn)
    # rank 0: expert 0 from rank 0 (row 0), from rank 1 (rows 100-102); expert 1: row 1-2, nothing
    assert so0 == [[1, 3, 2, 0], [0, 1, 4, 6]]
    assert out0[:4] == [0, 100, 101, 102] and out0[4:6] == [1, 2]
    # rank 1: expert 0: row 3 from rank 0, row 103 from rank 1; expert 1: row 4, row 104
    assert so1 == [[1, 1, 1, 1], [0, 1, 4, 5]]
    assert [out1[0], out1[1], out1[4], out1[5]] == [3, 103, 4, 104]


# -- the backend through the driver -------------------------------------------------------------

class ThreadComm(Comm):
    """A Comm whose cross-rank sync is the fake world's barrier (threads, no process group)."""

    def __init__(self, rank: int, world: int, barrier: threading.Barrier) -> None:
        super().__init__(rank, world, 0, CPU)
        self._barrier = barrier

    def sync(self) -> None:
        self._barrier.wait()


def scenario(world: int, dtype: str = "bf16", layout: str = "rank_major", align: int = 1, topk: int = 4,
             experts: int = 4, tokens: int = 24, hidden: int = 256):
    model = {"hidden": hidden, "tokens_per_rank": tokens, "topk": topk, "experts_per_rank": experts,
             "dispatch_dtype": dtype}
    if layout != "rank_major":
        model.update(layout=layout, align=align)
    return parse(scenario_dict(model=model, topology={"name": "fake", "nodes": 1, "gpus_per_node": world},
                               bench={"backends": ["symm-mem"], "sms": [4]}), "<test>")


def setup_of(s, rank: int) -> RankSetup:
    m = s.model
    return RankSetup(rank=rank, world=s.world, gpus_per_node=s.topology.gpus_per_node, device=CPU,
                     hidden=m.hidden, max_tokens_per_rank=m.tokens_per_rank, topk=m.topk,
                     experts_per_rank=m.experts_per_rank, dispatch_dtype=m.dispatch_dtype,
                     layout=m.layout, align=m.align)


def run_points(s, inject: str = None, call_mode: str = "call") -> List[PointRecord]:
    routings = route_all(s)

    def fn(rank: int, m: FakeSymm) -> PointRecord:
        comm = ThreadComm(rank, s.world, m.world_state.barrier)
        be = SymmMemBackend(setup_of(s, rank), symm=m)
        be.use_call_mode(call_mode)
        rec = PointRecord(rank)
        measure_point(Point(be, s, routings, 4, comm, input_sets=2), 1, 2, 3, inject, rec)
        be.close()
        rec.calls = m.calls
        return rec

    return run_ranks(s.world, fn)


CASES = [(2, "bf16", "rank_major", 1), (3, "fp8", "rank_major", 1), (4, "mxfp8", "rank_major", 1),
         (2, "bf16", "expert_major", 1), (2, "fp8", "expert_major", 16), (4, "mxfp8", "expert_major", 16),
         (3, "bf16", "expert_major", 128)]


@pytest.mark.parametrize("call_mode", ["call", "kernel"])
@pytest.mark.parametrize("world, dtype, layout, align", CASES)
def test_verifies_clean_against_the_fake(world, dtype, layout, align, call_mode):
    recs = run_points(scenario(world, dtype, layout, align), call_mode=call_mode)
    for rec in recs:
        assert rec.wrong == {"dispatch": 0, "combine": 0}, rec.problem
        assert len(rec.samples_us["dispatch"]) == 2
        want = ["vdev", "vdev_2d", "vdev_2d_offset"] if layout == "expert_major" else ["vdev", "vdev"]
        assert rec.calls[:len(want)] == want  # dispatch's exchanges, then combine's


@pytest.mark.parametrize("layout, align", [("rank_major", 1), ("expert_major", 16)])
def test_driver_fault_injection_is_caught(layout, align):
    s = scenario(2, "bf16", layout, align)
    assert all(r.wrong["dispatch"] == 1 for r in run_points(s, inject="dispatch"))
    assert all(r.wrong["combine"] == 1 for r in run_points(s, inject="combine"))


def test_an_empty_expert_keeps_torchs_padding_and_is_reported():
    """torch pads an expert that receives nothing to align rows; epbench's layout gives it none:
    the adapter reports torch's offsets and verification counts the difference."""
    s = scenario(2, "bf16", "expert_major", 16, topk=1, experts=2, tokens=4)

    def fn(rank: int, m: FakeSymm):
        be = SymmMemBackend(setup_of(s, rank), symm=m)
        idx = torch.tensor([[0], [0], [2], [2]])  # local expert 1 of each rank gets nothing
        x = make_tokens(4, s.model.hidden, 0, rank, 0, CPU)
        from epbench.contract import DispatchInput
        out = be.dispatch(DispatchInput(x, None, idx, torch.ones(4, 1)), 4)
        return out.expert_major.counts.tolist(), out.expert_major.offsets.tolist(), int(out.expert_major.num_slots)

    for counts, offsets, slots in run_ranks(2, fn):
        assert counts == [4, 0] and offsets == [0, 16] and slots == 32


def test_row_unit_keeps_every_block_piece_whole_and_16_byte_aligned():
    """Each block copies rows x stride / (blocks per peer) bytes from piece j's start; a stride of 16
    x every per-peer block count keeps every piece whole and 16-byte aligned for any row count (the
    adapter's old 14432-byte rows at 4 ranks left pieces 2-byte aligned for odd row counts)."""
    assert row_unit(2) == 512 and row_unit(4) == 256 and row_unit(8) == 128
    for w in (2, 3, 4, 5, 6, 7, 8, 16):
        for blocks in (8, 16, 32, 64):
            assert row_unit(w) % (16 * max(blocks // w, 1)) == 0
    old_row, rows = 14432, 3613  # DeepSeek-V3's packed row before, an odd row count from one peer
    piece = old_row * rows // 16  # 16 blocks per peer at 4 ranks
    assert piece % 2 == 0 and piece % 4 != 0 and round_up(old_row, row_unit(4)) == 14592


def test_inputs_are_large_enough_for_torchs_largest_block_count():
    """Newer torch launches one block per 64 KiB of input (rounded up to the world): a small input
    could get 3 blocks per peer at 4 ranks, which no padding to powers of two divides."""
    assert torch_block_counts(9 * 64 << 10, 4) == (8, 12)  # 3 blocks per peer in newer torch
    for w in (2, 3, 4, 8):
        for row in (row_unit(w), 14592, 1 << 20):
            size = vdev_rows(10, row) * row
            assert size >= 4 * MiB and set(torch_block_counts(size, w)) == {64}
    assert vdev_rows(1 << 20, 14592) == 1 << 20


def test_a_block_count_set_in_the_environment_is_refused(monkeypatch):
    monkeypatch.setenv("TORCH_SYMMMEM_NBLOCKS", "24")
    assert "TORCH_SYMMMEM_NBLOCKS=24 is set" in limits_reason(4, True, "cuda")
    monkeypatch.delenv("TORCH_SYMMMEM_NBLOCKS")
    assert limits_reason(4, True, "cuda") is None


def test_registered_and_limits():
    assert "symm-mem" in REGISTRY
    assert "world > 1" in limits_reason(1, True, "cuda")
    assert "NVSHMEM" in limits_reason(2, False, "cuda")
    assert limits_reason(2, True, "cpu") == "needs CUDA GPUs"
    assert limits_reason(2, True, "cuda") is None
    assert limits_reason(2, True, "cuda", "expert_major", 16) is None
    assert "at most 16 experts per rank (128)" in limits_reason(2, True, "cuda", "expert_major", 128)
    assert "at most 16 ranks" in limits_reason(32, True, "cuda", "expert_major", 4)
    assert limits_reason(32, True, "cuda", "rank_major", 128) is None


# -- phases, call modes, no host reads ----------------------------------------------------------

@pytest.mark.parametrize("layout, align", [("rank_major", 1), ("expert_major", 16)])
def test_kernel_mode_makes_the_layout_once_per_input_set(layout, align, monkeypatch):
    s = scenario(2, "bf16", layout, align)
    made = []
    real = SymmMemBackend._layout
    monkeypatch.setattr(SymmMemBackend, "_layout", lambda self, inp: made.append(id(inp)) or real(self, inp))
    run_points(s, call_mode="kernel")
    assert len(made) == 2 * 2  # per rank, the point's two input sets, prepared outside the timed calls
    made.clear()
    run_points(s, call_mode="call")
    assert len(made) == 2 * (1 + 2 + 1)  # per rank, every dispatch: warm-up, timed, verification run


@pytest.mark.parametrize("layout, align", [("rank_major", 1), ("expert_major", 16)])
def test_dispatch_and_combine_read_nothing_back_to_the_host(layout, align, monkeypatch):
    """torch's op takes its splits on the device, so neither call waits on the host: no nonzero
    (its count), bincount (torch's CUDA one reads the values' min and max), item or tolist."""
    s = scenario(2, "mxfp8", layout, align)
    routings = route_all(s)

    def refuse(*a, **k):
        raise AssertionError("a host read inside a timed call")

    def fn(rank: int, m: FakeSymm):
        be = SymmMemBackend(setup_of(s, rank), symm=m)
        inp = Inputs(s, routings, CPU).caller(rank, timing_draws(1, False)[0])
        out = be.dispatch(inp, 4)
        be.combine_input(out).fill_(1.0)
        be.combine(out, 4)
        return True

    for name in ("nonzero", "bincount"):
        monkeypatch.setattr(torch, name, refuse)
    for name in ("item", "tolist", "nonzero", "bincount", "cpu"):
        monkeypatch.setattr(torch.Tensor, name, refuse)
    assert run_ranks(2, fn) == [True, True]
