"""The epbench backend's ep_set_option knobs (_Option): validated, passed to the library, read back."""

from __future__ import annotations

from typing import List, Tuple

import pytest

pytest.importorskip("torch")

from epbench import cuda_lib, options  # noqa: E402
from epbench.errors import UserError  # noqa: E402
from epbench.backends.epbench_kernels import EpbenchBackend, _Option  # noqa: E402


class _Lib:
    def __init__(self, rc: int = 0) -> None:
        self.calls: List[Tuple[object, int, int]] = []
        self.rc = rc

    def ep_set_option(self, ctx: object, key: int, value: int) -> int:
        self.calls.append((ctx, key, value))
        return self.rc


class _Owner:
    named = _Option(7, {"a": 0, "b": 5})
    number = _Option(9, (2, 3, 4))

    def __init__(self, lib: _Lib) -> None:
        self._lib, self._ctx = lib, "ctx"


def test_named_option_passes_its_code_and_reads_back_the_name() -> None:
    o = _Owner(_Lib())
    o.named = "b"
    assert o.named == "b"
    assert o._lib.calls == [("ctx", 7, 5)]


def test_numeric_option_takes_int_like_values() -> None:
    o = _Owner(_Lib())
    o.number = "3"
    assert o.number == 3 and isinstance(o.number, int)
    assert o._lib.calls == [("ctx", 9, 3)]


@pytest.mark.parametrize("attr,value", [("named", "c"), ("number", 5)])
def test_bad_value_is_refused_before_the_library_is_called(attr: str, value: object) -> None:
    o = _Owner(_Lib())
    with pytest.raises(ValueError, match=f"{attr} must be one of"):
        setattr(o, attr, value)
    assert o._lib.calls == []


def test_library_error_is_raised_and_the_old_value_kept() -> None:
    o = _Owner(_Lib())
    o.number = 2
    o._lib.rc = 1
    with pytest.raises(RuntimeError):  # the library's message, or "not built" where it cannot load
        o.number = 4
    assert o.number == 2


def test_backend_knobs_map_to_the_c_option_keys() -> None:
    keys = {name: EpbenchBackend.__dict__[name].key for name in ("notify_impl", "combine_stages", "combine_chunk")}
    assert keys == {"notify_impl": cuda_lib.OPT_NOTIFY_IMPL, "combine_stages": cuda_lib.OPT_COMBINE_STAGES,
                    "combine_chunk": cuda_lib.OPT_COMBINE_CHUNK}
    # direct runs only as the recorded fallback: it cannot be asked for
    assert set(EpbenchBackend.__dict__["notify_impl"].allowed) == {"grid", "staged"}


def test_effective_config_is_decoded_into_option_names() -> None:
    """The struct the launcher fills (here by hand, as a fake library would) reads back as names; a fallback
    shows as what ran."""
    eff = cuda_lib.EpEffective(dispatch_impl=cuda_lib.DISPATCH_IMPLS["lean"], dispatch_warps=32, dispatch_sms=8,
                               notify_impl=cuda_lib.NOTIFY_IMPLS["direct"], notify_blocks=1,
                               combine_impl=cuda_lib.COMBINE_IMPLS["tma"], combine_warps=6, combine_sms=8,
                               combine_stages=3, combine_chunk=4096, dispatch_scale_block=32, dispatch_fused=1)
    assert cuda_lib.decode_effective(eff) == {
        "dispatch_impl": "lean", "dispatch_warps": 32, "notify_impl": "direct", "notify_blocks": 1,
        "combine_impl": "tma", "combine_warps": 6, "combine_stages": 3, "combine_chunk": 4096,
        "dispatch_dtype": "mxfp8", "quantize": "fused", "fused_stores": 8}
    eff.dispatch_fused = 2  # fused_stores 16
    assert cuda_lib.decode_effective(eff)["fused_stores"] == 16
    eff.dispatch_fused = 0  # quantize before: no fused_stores key
    assert "fused_stores" not in cuda_lib.decode_effective(eff)
    assert cuda_lib.decode_effective(cuda_lib.EpEffective(dispatch_impl=99))["dispatch_impl"] == 99


def test_effective_config_reads_the_library_struct() -> None:
    class Lib:
        def ep_effective_config(self, ctx: object, out: object) -> int:
            eff = out._obj  # ctypes.byref
            eff.dispatch_impl, eff.dispatch_warps = cuda_lib.DISPATCH_IMPLS["lean_dyn"], 16
            eff.notify_impl, eff.combine_impl, eff.combine_warps = cuda_lib.NOTIFY_IMPLS["grid"], 1, 12
            eff.combine_stages, eff.combine_chunk = 2, 2048
            eff.dispatch_em_push, eff.combine_em_wide, eff.em_sms = self.em_push, self.em_wide, 132
            return 0

    be = object.__new__(EpbenchBackend)
    be._lib, be._ctx, be.em_align = Lib(), "ctx", 0
    be._lib.em_push, be._lib.em_wide = 0, 0
    got = be.effective_config()
    assert got["dispatch_impl"] == "lean_dyn" and got["combine_warps"] == 12 and got["notify_impl"] == "grid"
    assert "em_push" not in got  # rank-major: no such choice
    be.em_align = 128  # expert-major: em_push as the library says it ran (an older build runs receiver, says 0)
    assert be.effective_config()["em_push"] == "receiver"
    be._lib.em_push = 1
    assert be.effective_config()["em_push"] == "sender"
    be._lib.em_push = 2
    assert be.effective_config()["em_push"] == "wide"
    assert be.effective_config()["em_reduce"] == "batched"
    be._lib.em_wide = 1  # em_push wide or auto: the combine's reduce pass ran wide
    assert be.effective_config()["em_reduce"] == "wide"
    assert be.effective_config()["em_sms"] == 132  # the expansion and reduce passes' blocks, as the library says


def test_em_push_sender_needs_expert_major_and_at_most_16_warps() -> None:
    assert options.resolve("epbench", {}, environ={})["em_push"] == "auto"
    # auto is the default for every layout: rank-major ignores it, any dispatch_warps takes it
    options.check_payload({}, "rank_major", "before", "s.yaml", environ={})
    options.check_payload({"epbench": {"dispatch_warps": 32}}, "expert_major", "before", "s.yaml", environ={})
    with pytest.raises(UserError, match=r"em_push=wide needs model\.layout expert_major"):
        options.check_payload({"epbench": {"em_push": "wide"}}, "rank_major", "before", "s.yaml", environ={})
    assert options.parse_cli(["em_push=sender"]) == {"epbench": {"em_push": "sender"}}
    options.check_payload({"epbench": {"em_push": "sender"}}, "expert_major", "before", "s.yaml", environ={})
    options.check_payload({"epbench": {"em_push": "receiver"}}, "rank_major", "before", "s.yaml", environ={})
    with pytest.raises(UserError, match=r"^s.yaml: epbench\.em_push=sender needs model\.layout expert_major \(got "
                                        r"rank_major\)"):
        options.check_payload({"epbench": {"em_push": "sender"}}, "rank_major", "before", "s.yaml", environ={})
    with pytest.raises(UserError, match=r"em_push=sender runs with at most 16 dispatch warps \(got dispatch_warps 24\)"):
        options.check_payload({"epbench": {"em_push": "sender", "dispatch_warps": 24}}, "expert_major", "fused",
                              "s.yaml", environ={})
    with pytest.raises(UserError, match="em_push"):  # the environment counts as given
        options.check_payload({}, "rank_major", "before", "s.yaml", environ={"EPBENCH_EM_PUSH": "sender"})
    # wide (the receiver's wide passes): the same two rules
    options.check_payload({"epbench": {"em_push": "wide"}}, "expert_major", "before", "s.yaml", environ={})
    with pytest.raises(UserError, match=r"em_push=wide needs model\.layout expert_major"):
        options.check_payload({"epbench": {"em_push": "wide"}}, "rank_major", "before", "s.yaml", environ={})
    with pytest.raises(UserError, match=r"em_push=wide runs with at most 16 dispatch warps"):
        options.check_payload({"epbench": {"em_push": "wide", "dispatch_warps": 32}}, "expert_major", "before",
                              "s.yaml", environ={})
    with pytest.raises(UserError, match=r"em_push: must be one of auto, receiver, sender, wide, got .both."):
        options.parse_cli(["em_push=both"])


def test_auto_combine_warps_rule_keeps_rank_major_and_gives_expert_major_16() -> None:
    be = object.__new__(EpbenchBackend)
    be.combine_warps, be.em_align = 0, 0
    assert [be._combine_warps_for(n) for n in (8, 16, 32)] == [16, 8, 8]  # rank-major: the measured rule
    be.em_align = 128
    assert [be._combine_warps_for(n) for n in (8, 16, 32)] == [16, 16, 16]
    be.combine_warps = 12  # an explicit value wins in both layouts
    assert be._combine_warps_for(32) == 12


# ---- own_rows (sm | ce): the Python side, with a fake library and a fake side stream ----

class _Events:
    """Stands in for _OwnRowsCopy and the library: one list of what happened, in order; copies run at once."""

    def __init__(self) -> None:
        self.log: List[str] = []

    def fork(self, pairs: object) -> None:
        self.log.append("fork")
        for dst, src in pairs:
            if src is not None:
                dst.copy_(src)
                self.log.append(f"copy {tuple(src.shape)}")

    def join(self) -> None:
        self.log.append("join")

    def ep_dispatch(self, ctx: object, *args: object) -> int:
        self.log.append(f"ep_dispatch T={args[4]}")  # ctx, x, scales, ids, weights, T, ...
        return 0


def _fake_backend(own_rows: str, t_max: int = 8, h: int = 16, k: int = 4, scales: bool = True):
    import torch

    ev = _Events()
    be = object.__new__(EpbenchBackend)
    be._lib, be._ctx, be._stream, be._impl_code, be.dispatch_warps = ev, "ctx", (lambda: 0), 10, 16
    be._timed_out = type("Flag", (), {"value": 0})()
    be._check_input = lambda inp: None
    be._checked, be._dispatch_epoch, be._scales_in = None, 0, scales
    cap = 2 * t_max
    be.recv_x = torch.full((cap, h), -1.0)
    be.recv_scales = torch.full((cap, h // 8), -1.0) if scales else None
    be.recv_idx, be.recv_w = torch.full((cap, k), -1, dtype=torch.int64), torch.full((cap, k), -1.0)
    be.out = torch.zeros(t_max, h)
    be._out_t, be._out_view = t_max, be.out
    be.expert_counts, be.num_recv, be.em_table = torch.zeros(4, dtype=torch.int64), torch.zeros(()), None
    be.own_rows = own_rows
    be.recv_key = torch.zeros(cap, dtype=torch.int64) if own_rows == "ce" else None
    be._own_copy = ev if own_rows == "ce" else None
    be._own_t, be._own_dst = -1, ()
    return be, ev


def _input(t: int, h: int = 16, k: int = 4, scales: bool = True):
    import torch

    from epbench.contract import DispatchInput

    return DispatchInput(torch.randn(t, h), torch.rand(t, h // 8) if scales else None,
                         torch.randint(0, 8, (t, k)), torch.rand(t, k))


@pytest.mark.parametrize("scales", [True, False])
def test_own_rows_ce_copies_before_the_notify_and_joins_after(scales: bool) -> None:
    be, ev = _fake_backend("ce", scales=scales)
    inp = _input(5, scales=scales)
    out = be.dispatch(inp, 8)
    copies = [f"copy {tuple(a.shape)}" for a in (inp.x, inp.x_scales, inp.topk_idx, inp.topk_weights) if a is not None]
    assert ev.log == ["fork", *copies, "ep_dispatch T=5", "join"]
    assert be.recv_x[:5].equal(inp.x) and be.recv_idx[:5].equal(inp.topk_idx) and be.recv_w[:5].equal(inp.topk_weights)
    assert (be.recv_x[5:] == -1).all() and (be.recv_idx[5:] == -1).all()  # only rows [0, T): the peers' follow
    if scales:
        assert be.recv_scales[:5].equal(inp.x_scales)
    assert out.row_key is be.recv_key and out.x is be.recv_x
    ev.log.clear()
    be.dispatch(_input(0, scales=scales), 8)  # nothing to copy: no fork, no join
    assert ev.log == ["ep_dispatch T=0"]


def test_own_rows_sm_path_is_the_plain_call() -> None:
    be, ev = _fake_backend("sm")
    out = be.dispatch(_input(5), 8)
    assert ev.log == ["ep_dispatch T=5"] and out.row_key is None


def test_own_rows_ce_joins_even_when_the_launch_fails() -> None:
    be, ev = _fake_backend("ce")
    ev.ep_dispatch = lambda *a: 1
    be._lib.ep_last_error = lambda: b"boom"
    with pytest.raises(RuntimeError):
        be.dispatch(_input(3), 8)
    assert ev.log[0] == "fork" and ev.log[-1] == "join"


def test_own_rows_is_reported_by_effective_config() -> None:
    class Lib:
        def ep_effective_config(self, ctx: object, out: object) -> int:
            out._obj.dispatch_warps, out._obj.combine_warps = 16, 12
            return 0

    be = object.__new__(EpbenchBackend)
    be._lib, be._ctx, be.own_rows = Lib(), "ctx", "ce"
    assert be.effective_config()["own_rows"] == "ce"
    be.own_rows = "sm"
    assert be.effective_config()["own_rows"] == "sm"


def test_own_rows_ce_poison_makes_unwritten_keys_rows_nobody_sent() -> None:
    import torch

    be, _ = _fake_backend("ce")
    be.recv_scales = None
    be.recv_x, be.recv_idx, be.recv_w = torch.zeros(4, 8), torch.zeros(4, 2, dtype=torch.int64), torch.zeros(4, 2)
    be.combine_in = torch.zeros(4, 8)
    be.poison()
    assert (be.recv_key == torch.iinfo(torch.int64).max).all()  # kept by in_source_order: counted wrong, not padding


def test_own_rows_ce_with_expert_major_is_refused_by_the_constructor_options(monkeypatch) -> None:
    from epbench.backends.epbench_kernels import resolve_options
    from epbench.contract import RankSetup
    from epbench.errors import UserError

    import torch

    monkeypatch.delenv("EPBENCH_OWN_ROWS", raising=False)
    setup = RankSetup(0, 2, 2, torch.device("cpu"), 64, 8, 2, 2, "bf16", layout="expert_major", align=16)
    with pytest.raises(UserError, match="epbench backend: epbench.own_rows=ce needs model.layout rank_major"):
        resolve_options("epbench", {"own_rows": "ce"}, setup)
    assert resolve_options("epbench", {}, setup)["own_rows"] == "sm"
    monkeypatch.setenv("EPBENCH_OWN_ROWS", "ce")
    with pytest.raises(UserError, match="own_rows=ce"):
        resolve_options("epbench", {}, setup)


def test_the_constructor_options_refuse_a_tma_knob_beside_the_bulk_pull(monkeypatch) -> None:
    """What the CLI refuses, the backend's own options refuse too (the GPU workers build backends directly)."""
    from epbench.backends.epbench_kernels import resolve_options
    from epbench.contract import RankSetup

    import torch

    for key in ("EPBENCH_PULL_KERNEL", "EPBENCH_COMBINE_STAGES", "EPBENCH_COMBINE_WARPS", "EPBENCH_COMBINE_CHUNK"):
        monkeypatch.delenv(key, raising=False)
    setup = RankSetup(0, 2, 2, torch.device("cpu"), 64, 8, 2, 2, "bf16")
    with pytest.raises(UserError, match="epbench backend: epbench.combine_warps=8 shapes the tma pull kernel"):
        resolve_options("epbench", {"pull_kernel": "bulk", "combine_warps": 8}, setup)
    assert resolve_options("epbench", {"pull_kernel": "tma", "combine_warps": 8}, setup)["combine_warps"] == 8


def test_em_sms_needs_expert_major_and_at_most_16_warps() -> None:
    assert options.resolve("epbench", {}, environ={})["em_sms"] == 0  # the passes inside the k blocks
    options.check_payload({"epbench": {"em_sms": 132}}, "expert_major", "before", "s.yaml", environ={})
    with pytest.raises(UserError, match=r"^s.yaml: epbench\.em_sms=132 needs model\.layout expert_major \(got "
                                        r"rank_major\)"):
        options.check_payload({"epbench": {"em_sms": 132}}, "rank_major", "before", "s.yaml", environ={})
    with pytest.raises(UserError, match=r"em_sms=64 runs with at most 16 dispatch warps \(got dispatch_warps 32\)"):
        options.check_payload({"epbench": {"em_sms": 64, "dispatch_warps": 32}}, "expert_major", "before",
                              "s.yaml", environ={})
    with pytest.raises(UserError, match="em_sms"):  # out of range: one line
        options.parse_cli(["em_sms=2000"])
