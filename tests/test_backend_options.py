"""The epbench backend's ep_set_option knobs (_Option): validated, passed to the library, read back."""

from __future__ import annotations

from typing import List, Tuple

import pytest

pytest.importorskip("torch")

from epbench import cuda_lib  # noqa: E402
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
        "dispatch_dtype": "mxfp8", "quantize": "fused"}
    assert cuda_lib.decode_effective(cuda_lib.EpEffective(dispatch_impl=99))["dispatch_impl"] == 99


def test_effective_config_reads_the_library_struct() -> None:
    class Lib:
        def ep_effective_config(self, ctx: object, out: object) -> int:
            eff = out._obj  # ctypes.byref
            eff.dispatch_impl, eff.dispatch_warps = cuda_lib.DISPATCH_IMPLS["lean_dyn"], 16
            eff.notify_impl, eff.combine_impl, eff.combine_warps = cuda_lib.NOTIFY_IMPLS["grid"], 1, 12
            eff.combine_stages, eff.combine_chunk = 2, 2048
            return 0

    be = object.__new__(EpbenchBackend)
    be._lib, be._ctx = Lib(), "ctx"
    got = be.effective_config()
    assert got["dispatch_impl"] == "lean_dyn" and got["combine_warps"] == 12 and got["notify_impl"] == "grid"


def test_auto_combine_warps_rule_keeps_rank_major_and_gives_expert_major_16() -> None:
    be = object.__new__(EpbenchBackend)
    be.combine_warps, be.em_align = 0, 0
    assert [be._combine_warps_for(n) for n in (8, 16, 32)] == [16, 8, 8]  # rank-major: the measured rule
    be.em_align = 128
    assert [be._combine_warps_for(n) for n in (8, 16, 32)] == [16, 16, 16]
    be.combine_warps = 12  # an explicit value wins in both layouts
    assert be._combine_warps_for(32) == 12
