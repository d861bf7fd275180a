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
    keys = {name: EpbenchBackend.__dict__[name].key for name in
            ("notify_impl", "combine_impl", "combine_stages", "combine_chunk", "exclusive_sms",
             "split_own_warps")}
    assert keys == {"notify_impl": cuda_lib.OPT_NOTIFY_IMPL, "combine_impl": cuda_lib.OPT_COMBINE_IMPL,
                    "combine_stages": cuda_lib.OPT_COMBINE_STAGES, "combine_chunk": cuda_lib.OPT_COMBINE_CHUNK,
                    "exclusive_sms": cuda_lib.OPT_EXCLUSIVE_SMS, "split_own_warps": cuda_lib.OPT_SPLIT_OWN_WARPS}
