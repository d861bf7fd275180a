"""The host-side helpers both kernel backends share (the kernels themselves need GPUs)."""

import ctypes
from pathlib import Path

import pytest

from epbench import cuda_lib


class FakeLib:
    """Stands in for the kernels library: records calls, returns 0 like the real API."""

    def __init__(self):
        self.opened = None

    def ep_ipc_handle(self, ctx, buf):
        ctypes.memmove(buf, b"H" * 64, 64)
        return 0

    def ep_open_peers(self, ctx, handles):
        self.opened = handles
        return 0


def test_open_peers_alone_passes_its_own_handle():
    lib = FakeLib()
    cuda_lib.open_peers(lib, ctypes.c_void_p(), world=1)
    assert lib.opened == b"H" * 64


def test_region_tensor_of_an_empty_region_is_empty():
    def ep_region(ctx, which, ptr, nbytes):
        return 0  # leaves ptr and nbytes at 0

    t = cuda_lib.region_tensor(ep_region, ctypes.c_void_p(), 3, "cpu")
    assert t.numel() == 0 and str(t.dtype) == "torch.uint8"


def test_region_tensor_reports_a_failed_call(monkeypatch):
    class Lib:
        @staticmethod
        def ep_last_error():
            return b"no such region"

    monkeypatch.setattr(cuda_lib, "load", lambda: Lib)

    def ep_region(ctx, which, ptr, nbytes):
        return -1

    with pytest.raises(RuntimeError, match="ep_region failed: no such region"):
        cuda_lib.region_tensor(ep_region, ctypes.c_void_p(), 99, "cpu")


def _error_record(rank: int, peer: int, phase: int):
    """A stand-in library whose timeout record holds (rank, peer, phase)."""
    class Lib:
        @staticmethod
        def ep_poll_error(ctx, r, p, ph):
            r._obj.value, p._obj.value, ph._obj.value = rank, peer, phase
            return 1

    return Lib


def test_a_timed_out_wait_names_rank_peer_and_phase():
    with pytest.raises(RuntimeError, match=r"rank 2 gave up after 10 s waiting for rank 1 in notify"):
        cuda_lib.raise_if_timed_out(_error_record(2, 1, 1), ctypes.c_void_p(), 10.0)


def test_ranks_with_other_dispatch_units_stop_at_once_naming_the_option():
    with pytest.raises(RuntimeError, match=r"rank 0 stopped at once, rank 3 disagrees: .*dispatch_units must be the same"):
        cuda_lib.raise_if_timed_out(_error_record(0, 3, 7), ctypes.c_void_p(), 10.0)
    with pytest.raises(RuntimeError, match=r"rank 1 stopped at once, rank 2 disagrees: .*dispatch_place must be the same"):
        cuda_lib.raise_if_timed_out(_error_record(1, 2, 8), ctypes.c_void_p(), 10.0)
    header = (Path(__file__).resolve().parents[1] / "csrc" / "ll_common.cuh").read_text()
    assert "kPhaseLlUnitsMismatch = 7, kPhaseLlPlaceMismatch = 8" in header and cuda_lib.MISMATCH_PHASES == (7, 8, 10)


def test_a_rank_holding_fewer_tokens_under_combine_rows_ce_stops_at_once_naming_it():
    """combine_rows ce: a holder pushes its own token count of rows; a source with more stops at once (phase 10,
    csrc/common.cuh), the wait for a pushed chunk (phase 9) is an ordinary timeout."""
    with pytest.raises(RuntimeError, match=r"rank 1 stopped at once, rank 0 disagrees: .*same token count on every rank"):
        cuda_lib.raise_if_timed_out(_error_record(1, 0, 10), ctypes.c_void_p(), 10.0)
    with pytest.raises(RuntimeError, match=r"rank 0 gave up after 10 s waiting for rank 1 in combine \(waiting for rows"):
        cuda_lib.raise_if_timed_out(_error_record(0, 1, 9), ctypes.c_void_p(), 10.0)
    header = (Path(__file__).resolve().parents[1] / "csrc" / "common.cuh").read_text()
    assert "kPhaseCombineStaged = 9, kPhaseCombineTokens = 10" in header


def test_no_timeout_raises_nothing():
    class Lib:
        @staticmethod
        def ep_poll_error(ctx, rank, peer, phase):
            return 0

    cuda_lib.raise_if_timed_out(Lib, ctypes.c_void_p(), 10.0)


def test_dispatch_input_check_accepts_good_input_and_names_bad():
    import torch

    from epbench.contract import DispatchInput, RankSetup

    setup = RankSetup(rank=0, world=2, gpus_per_node=2, device=torch.device("cpu"), hidden=256,
                      max_tokens_per_rank=8, topk=2, experts_per_rank=2, dispatch_dtype="bf16")
    good = DispatchInput(torch.randn(4, 256).bfloat16(), None, torch.zeros(4, 2, dtype=torch.int64),
                         torch.ones(4, 2))
    cuda_lib.check_dispatch_input(good, setup, torch.bfloat16, False)
    too_many = DispatchInput(torch.randn(9, 256).bfloat16(), None, torch.zeros(9, 2, dtype=torch.int64),
                             torch.ones(9, 2))
    with pytest.raises(ValueError, match="max_tokens_per_rank"):
        cuda_lib.check_dispatch_input(too_many, setup, torch.bfloat16, False)
    with pytest.raises(ValueError, match="x_scales"):
        cuda_lib.check_dispatch_input(good, setup, torch.bfloat16, True)
    bad_ids = DispatchInput(good.x, None, good.topk_idx.int(), good.topk_weights)
    with pytest.raises(ValueError, match="int64"):
        cuda_lib.check_dispatch_input(bad_ids, setup, torch.bfloat16, False)


def test_ctypes_signatures_match_the_c_api_header():
    """A parameter added to csrc/api.h but not to cuda_lib (or the reverse) shifts every later
    argument of that call on the GPU; catch it here, without a GPU."""
    import re
    from pathlib import Path

    from epbench.cuda_lib import signatures

    header = (Path(__file__).resolve().parents[1] / "csrc" / "api.h").read_text()
    header = re.sub(r"//[^\n]*|/\*.*?\*/", "", header, flags=re.S)
    declared = {}
    for name, params in re.findall(r"\bint\s+(ep_\w+)\s*\(([^;{]*)\)\s*;", header):
        params = params.strip()
        declared[name] = 0 if params in ("", "void") else params.count(",") + 1
    ceiling = (Path(__file__).resolve().parents[1] / "csrc" / "ceiling.cu").read_text()
    for name, params in re.findall(r'extern "C" int\s+(ep_\w+)\s*\(([^;{]*)\)\s*\{', ceiling):
        declared[name] = params.count(",") + 1  # defined there, not in api.h
    for name, argtypes in signatures().items():
        assert name in declared, f"{name} is not declared in csrc/api.h"
        assert declared[name] == len(argtypes), f"{name}: api.h has {declared[name]} parameters, cuda_lib {len(argtypes)}"


def test_python_enum_tables_match_the_c_api_header():
    """cuda_lib's name -> code tables are what the kernels receive; a value that drifts from
    csrc/api.h silently runs another variant on the GPU. Compare them here, without a GPU."""
    import re
    from pathlib import Path

    from epbench import cuda_lib

    header = (Path(__file__).resolve().parents[1] / "csrc" / "api.h").read_text()
    values = {name: int(v) for name, v in re.findall(r"\b(EP_[A-Z0-9_]+)\s*=\s*(\d+)", header)}

    def c_name(prefix: str, py_name: str) -> str:
        return prefix + py_name.upper().replace("-", "_")

    for name, code in cuda_lib.DISPATCH_IMPLS.items():
        assert values[c_name("EP_DISPATCH_", name)] == code, name
    for name, code in cuda_lib.NOTIFY_IMPLS.items():
        assert values[c_name("EP_NOTIFY_", name)] == code, name
    for name, code in cuda_lib.COMBINE_IMPLS.items():
        assert values[c_name("EP_COMBINE_", name)] == code, name
    for key in ("DEBUG_STAMPS", "NOTIFY_IMPL", "COMBINE_STAGES", "COMBINE_CHUNK", "EM_SMS", "CE_CHUNKS", "CE_STREAMS",
                "CE_SHARE", "CE_GROW", "PULL_KERNEL", "CB_SKIP"):
        assert values["EP_OPT_" + key] == getattr(cuda_lib, "OPT_" + key), key
    struct = re.search(r"typedef struct ep_effective \{(.*?)\} ep_effective;", header, re.S).group(1)
    assert [f for f, _ in cuda_lib.EpEffective._fields_] == re.findall(r"int (\w+);", struct)


def test_a_library_built_from_older_sources_is_one_line_saying_rebuild(tmp_path, monkeypatch):
    import ctypes

    import pytest

    from epbench import cuda_lib

    lib = tmp_path / "libold.so"
    lib.write_bytes(b"")

    class Old:
        def __getattr__(self, name):
            raise AttributeError(f"undefined symbol: {name}")

    monkeypatch.setattr(ctypes, "CDLL", lambda path: Old())
    with pytest.raises(RuntimeError, match=r"libold.so is out of date \(undefined symbol: ep_new\); rebuild with `make build`"):
        cuda_lib.open_library(lib, "not built", lambda lib: lib.ep_new)


def test_config_struct_and_region_ids_match_the_c_api_header():
    """EpConfig is handed to ep_create by address: a field missing on either side (own_rows came last) shifts
    every later one. The region ids name the buffers Python views, RECV_KEY (own_rows ce) included."""
    import re
    from pathlib import Path

    from epbench import cuda_lib

    header = (Path(__file__).resolve().parents[1] / "csrc" / "api.h").read_text()
    header = re.sub(r"//[^\n]*", "", header)
    struct = re.search(r"typedef struct ep_config \{(.*?)\} ep_config;", header, re.S).group(1)
    assert [f for f, _ in cuda_lib.EpConfig._fields_] == re.findall(r"(?:int|double) (\w+);", struct)
    values = {name: int(v) for name, v in re.findall(r"\b(EP_[A-Z0-9_]+)\s*=\s*(\d+)", header)}
    for name in ("RECV_X", "RECV_SCALES", "RECV_IDX", "RECV_W", "COMBINE_IN", "OUT", "NUM_RECV", "EXPERT_COUNTS",
                 "DEBUG_STAMPS", "EM_OFFSETS", "EM_NUM_SLOTS", "RECV_KEY", "COMBINE_STAGE"):
        assert values["EP_" + name] == getattr(cuda_lib, name), name
    assert cuda_lib.OWN_ROWS == {"sm": 0, "ce": 1, "all": 2}
    assert cuda_lib.COMBINE_ROWS == {"pull": 0, "ce": 1}
    assert "2 (all)" in (Path(__file__).resolve().parents[1] / "csrc" / "api.h").read_text()


def test_stamp_names_follow_the_c_enum() -> None:
    """cuda_lib.STAMPS names each index of csrc/common.cuh's EpStamp (kStampFooBar = n -> foo_bar at n; the SM mask
    spans three words), and fits in kNumStamps: a stamp added on one side only would print another's cycles."""
    import re
    from pathlib import Path

    from epbench import cuda_lib

    header = (Path(__file__).resolve().parents[1] / "csrc" / "common.cuh").read_text()
    body = re.search(r"enum EpStamp \{(.*?)\};", header, re.S).group(1)
    pairs = {name: int(v) for name, v in re.findall(r"\bkStamp(\w+) = (\d+)", body)}
    total = int(re.search(r"\bkNumStamps = (\d+)", body).group(1))
    assert len(cuda_lib.STAMPS) <= total
    snake = lambda camel: re.sub(r"(?<!^)([A-Z])", r"_\1", camel).lower()
    for name, index in pairs.items():
        want = "sm_mask0" if name == "SmMask" else snake(name)
        assert cuda_lib.STAMPS[index] == want, (name, index)
    assert pairs["CbFold"] == len(cuda_lib.STAMPS) - 1
    skips = dict(re.findall(r"\bkCbSkip(\w+) = (\d+)", header))
    assert {k: v for k, v in cuda_lib.CB_SKIP.items() if v} == {n.lower(): int(v) for n, v in skips.items()}
