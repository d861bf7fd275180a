"""The host side of the epbench-hier backend without a GPU: the SM split, the guards that keep
ranks in step (one combine per dispatch, the same chunk everywhere, epochs kept only when enqueued)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from epbench.backends import epbench_hier as hier
from epbench.contract import DispatchOutput


class FakeLib:
    def __init__(self, rc: int = 0) -> None:
        self.rc, self.calls = rc, []

    def eph_combine(self, *args):
        self.calls.append(("combine", args[-2]))
        return self.rc

    def eph_dispatch(self, *args):
        self.calls.append(("dispatch", args[-2]))
        return self.rc

    def epn_last_error(self):
        return b"bad argument"


def bare_backend(lib: FakeLib, epoch: int = 1) -> hier.EpbenchHierBackend:
    be = hier.EpbenchHierBackend.__new__(hier.EpbenchHierBackend)  # no GPU: skip the constructor
    be._lib, be._ctx, be._epoch, be.nodes, be.send_share, be.chunk = lib, None, epoch, 2, 0.5, 4
    be._stream, be._timed_out = (lambda: 0), SimpleNamespace(value=0)
    be.s = SimpleNamespace(world=4, timeout_s=1.0)
    return be


def test_send_blocks_split():
    assert hier.send_blocks(8, 1, 0.5) == 0  # one node: nothing goes to the network
    assert hier.send_blocks(8, 2, 0.5) == 4
    assert hier.send_blocks(2, 2, 0.9) == 1 and hier.send_blocks(4, 2, 0.01) == 1  # at least one each


def test_a_dispatch_is_combined_once():
    lib = FakeLib()
    be = bare_backend(lib)
    idx, w = torch.zeros(3, 2, dtype=torch.int64), torch.ones(3, 2)
    out = DispatchOutput(None, None, None, None, None, 0, hier._Handle(3, idx, w, 1, torch.zeros(3, 8)))
    be.combine(out, 8)
    with pytest.raises(RuntimeError, match="already combined"):
        be.combine(out, 8)
    assert lib.calls == [("combine", 1)]


def test_the_chunk_must_match_on_every_rank(monkeypatch):
    be = bare_backend(FakeLib())
    monkeypatch.setattr(hier.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(hier.dist, "all_gather_object", lambda out, v: out.__setitem__(slice(None), [4, 4, 8, 4]))
    with pytest.raises(ValueError, match=r"option chunk \(EPBENCH_HIER_CHUNK\) differs between ranks \(\[4, 4, 8, 4\]\)"):
        be._check_same_chunk()
    monkeypatch.setattr(hier.dist, "all_gather_object", lambda out, v: out.__setitem__(slice(None), [4] * 4))
    be._check_same_chunk()


def test_a_refused_dispatch_keeps_the_epoch(monkeypatch):
    lib = FakeLib(rc=-1)
    be = bare_backend(lib, epoch=5)
    be.fp8, be._checked, be._x_dtype = False, None, torch.bfloat16
    monkeypatch.setattr(hier.cuda_lib, "check_dispatch_input", lambda *a: None)
    monkeypatch.setattr(hier.nvshmem_lib, "load", lambda: lib)
    x = torch.zeros(2, 8, dtype=torch.bfloat16)
    inp = SimpleNamespace(x=x, x_scales=None, topk_idx=torch.zeros(2, 2, dtype=torch.int64),
                          topk_weights=torch.ones(2, 2))
    with pytest.raises(RuntimeError, match="eph_dispatch failed: bad argument"):
        be.dispatch(inp, 8)
    assert be._epoch == 5 and lib.calls == [("dispatch", 6)]
