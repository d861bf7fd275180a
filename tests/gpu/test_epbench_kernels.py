"""GPU checks of the epbench kernels (tests/gpu/ep_worker.py's check: every edge case against
epbench.verify, and a missing peer against the timeout) on 1, 2, 3 and 4 ranks. Each world size is
one launch (gpu_launch.KERNEL_SUITES: tests/gpu/suite_worker.py runs this module's suites of that
world and test_epbench_ll's in one process group; on 4 GPUs the 3-rank and 1-rank launches run side
by side on separate GPUs); each test reads its own suite's line and the launch's missing peer, so a
failure names the test's suite and its failed cases. Ranks share the GPUs where they outnumber them
(quick case lists then: the ranks take turns)."""

from __future__ import annotations

import pytest
from gpu_launch import KERNEL_SUITES, shared, shares_gpus

torch = pytest.importorskip("torch")

pytestmark = shares_gpus()

# The options kept beside the defaults (lean at 8 / 3 SMs, staged notify, 3 stages of 4 KiB, 32 dispatch warps)
OPTIONS = ["--quick", "--notify", "staged", "--combine-stages", "3", "--combine-chunk", "4096",
           "--impls", "lean:16:8,lean:16:3,lean:32:5,lean_dyn:32:3"]


def mxfp8_flags(nproc: int) -> list:
    return ["--mxfp8", "--impls", "lean_dyn:16:8,lean:16:3" if shared(nproc) else
            "lean_dyn:16:8,lean:16:3,lean:32:5,lean_dyn:32:16"]


def expert_major_flags(nproc: int) -> list:
    return ["--expert-major", "--impls", "lean_dyn:16:8,lean:16:3" if shared(nproc) else
            "lean_dyn:16:8,lean:16:3,lean_dyn:32:16"]


def own_rows_ce_flags(nproc: int, own: str = "ce") -> list:
    """own_rows=ce (or all) on every case it serves (rank-major; bf16, fp8, mxfp8 before), both dispatch kernels
    (all: the key kernel at those SM counts, whatever the impl)."""
    return ["--own-rows", own, *(["--quick"] if shared(nproc) else []), "--impls",
            "lean_dyn:16:8,lean:16:3" if shared(nproc) else "lean_dyn:16:8,lean:16:3,lean:32:5,lean_dyn:16:24"]


def fused_stores8_flags(nproc: int) -> list:
    """fused_stores=8 (the default is 16) on every fused mxfp8 case (rank-major and expert-major), both dispatch
    kernels and warps."""
    return ["--fused-stores", "8", "--impls", "lean_dyn:16:8,lean:16:3" if shared(nproc) else
            "lean_dyn:16:8,lean:16:3,lean:32:5,lean_dyn:32:16"]


def em_push_sender_flags(nproc: int) -> list:
    """em_push=sender (the senders store every slot of a row, no copy pass): every expert-major case, both
    dispatch kernels, 16 warps (the most it is built for), at 8 and 3 SMs (the SM count does not enter the
    slots a row goes to)."""
    return ["--expert-major", "--em-push", "sender", "--impls", "lean_dyn:16:8,lean:16:3"]


def em_push_receiver_flags(nproc: int) -> list:
    """em_push=receiver (the default before auto: the copy pass 2 KiB a warp at a time, the combine's reduce pass
    in fixed batches): every expert-major case, both dispatch kernels, 16 and 8 warps, at 8 and 3 SMs. The
    default (auto: wide up to 16 warps, receiver's copy pass above) is the expert-major suite's."""
    return ["--expert-major", "--em-push", "receiver", "--impls", "lean_dyn:16:8,lean:8:3"]


def em_sms_flags(nproc: int) -> list:
    """em_sms (the expansion and the combine's reduce pass in kernels of their own, on 64 blocks): every
    expert-major case, both dispatch kernels, 16 and 8 warps, the default em_push (the wide passes at these
    warps), 64 blocks at 8 and 3 dispatch SMs."""
    return ["--expert-major", "--em-sms", "64", "--impls", "lean_dyn:16:8,lean:8:3"]


# em_sms with the narrow copy pass on one block (fewer blocks than the transfer's), and with the sender (phase R on
# its own blocks, no expansion)
EM_SMS_NARROW = ["--expert-major", "--em-push", "receiver", "--em-sms", "1", "--impls", "lean_dyn:16:8"]
EM_SMS_SENDER = ["--expert-major", "--em-push", "sender", "--em-sms", "64", "--impls", "lean:16:3"]


# the one-block notify (staged) writes the own rows' slots and keys on its own path
OWN_ROWS_CE_STAGED = ["--own-rows", "ce", "--quick", "--notify", "staged", "--impls", "lean:16:8,lean_dyn:16:3"]
OWN_ROWS_ALL_STAGED = ["--own-rows", "all", "--quick", "--notify", "staged", "--impls", "lean:16:8"]


# pull_kernel bulk: the rank-major cases (bf16, fp8, mxfp8 dispatch; 1 and 4095 tokens, every token to one rank, all
# ranks 0 tokens) with the loading / summing warps pulling over the link, at 8 and 3 SMs
PULL_BULK = ["--pull-kernel", "bulk", "--impls", "lean:16:8,lean:16:3"]
# pull_kernel tma where auto takes bulk (below 8 SMs at 4 ranks, every SM count at 2): the tma kernel stays checked there
PULL_TMA = ["--pull-kernel", "tma", "--impls", "lean:16:3,lean:16:24"]


def combine_rows_ce_flags(nproc: int) -> list:
    """combine_rows=ce (with own_rows=all): every rank-major, quantize-before case whose ranks hold the same token
    count, at 8, 3 and (on GPUs of their own) 24 SMs; the cases with other counts for the stop they must make."""
    return ["--own-rows", "all", "--combine-rows", "ce", "--impls",
            "lean:16:8,lean:16:3" if shared(nproc) else "lean:16:8,lean:16:3,lean:16:24"]

def ce_share_flags(nproc: int) -> list:
    """own_rows=all with ce_share 75: the copy engines move the first 75 % of a rank's x rows, ce_tail_kernel the
    rest at once on the dispatch's SMs; every case own_rows=all serves, with combine_rows=ce on top (so the rows the
    SMs stored also feed the copy-engine combine), at 8, 3 and (GPUs of their own) 24 SMs."""
    return ["--own-rows", "all", "--ce-share", "75", "--combine-rows", "ce", "--impls",
            "lean:16:8,lean:16:3" if shared(nproc) else "lean:16:8,lean:16:3,lean:16:24"]


# world size -> the suites of this module its launch runs (name -> ep_worker check flags)
SUITES = {
    1: {"mxfp8": mxfp8_flags(1), "expert-major": expert_major_flags(1), "own-rows-ce": own_rows_ce_flags(1),
        "own-rows-all": own_rows_ce_flags(1, "all"), "combine-rows-ce": combine_rows_ce_flags(1),
        "ce-share": ce_share_flags(1), "fused-stores-8": fused_stores8_flags(1),
        "fused-stores-8-em": ["--expert-major", *fused_stores8_flags(1)],
        "em-push-sender": em_push_sender_flags(1), "em-push-receiver": em_push_receiver_flags(1),
        "em-sms": em_sms_flags(1), "pull-bulk": PULL_BULK},
    2: {"defaults": ["--quick"], "options": OPTIONS, "expert-major": expert_major_flags(2),
        "own-rows-ce": own_rows_ce_flags(2), "own-rows-ce-staged": OWN_ROWS_CE_STAGED,
        "own-rows-all": own_rows_ce_flags(2, "all"), "own-rows-all-staged": OWN_ROWS_ALL_STAGED,
        "combine-rows-ce": combine_rows_ce_flags(2), "ce-share": ce_share_flags(2),
        "ce-share-25": ["--own-rows", "all", "--ce-share", "25", "--quick", "--impls", "lean:16:8"],
        "combine-rows-ce-32x4": ["--own-rows", "all", "--combine-rows", "ce", "--ce-chunks", "32", "--ce-streams", "4",
                                 "--impls", "lean:16:8"],
        "combine-rows-ce-4x1": ["--own-rows", "all", "--combine-rows", "ce", "--ce-chunks", "4", "--ce-streams", "1",
                                "--impls", "lean:16:3"],
        "fused-stores-8": fused_stores8_flags(2), "em-push-sender": em_push_sender_flags(2),
        "em-push-receiver": em_push_receiver_flags(2), "em-sms": em_sms_flags(2),
        "em-sms-narrow": EM_SMS_NARROW, "em-sms-sender": EM_SMS_SENDER, "pull-bulk": PULL_BULK, "pull-tma": PULL_TMA},
    3: {"mxfp8": mxfp8_flags(3), "expert-major": expert_major_flags(3), "em-push-sender": em_push_sender_flags(3),
        "em-push-receiver": em_push_receiver_flags(3), "em-sms": em_sms_flags(3)},
    4: {"defaults": ["--quick"] if shared(4) else [], "own-rows-ce": own_rows_ce_flags(4),
        "own-rows-all": own_rows_ce_flags(4, "all"), "combine-rows-ce": combine_rows_ce_flags(4),
        "combine-rows-ce-grow": ["--own-rows", "all", "--combine-rows", "ce", "--ce-chunking", "grow", "--ce-streams", "2",
                                 "--impls", "lean:16:8"],
        "combine-rows-ce-6": ["--own-rows", "all", "--combine-rows", "ce", "--ce-chunks", "6", "--impls", "lean:16:4"],
        "pull-bulk": PULL_BULK, "pull-bulk-own-all": ["--own-rows", "all", *PULL_BULK], "pull-tma": PULL_TMA,
        "ce-share": ce_share_flags(4)},
}
for _world, _suites in SUITES.items():
    for _name, _flags in _suites.items():
        KERNEL_SUITES.add(_world, "ep", _name, _flags)


def assert_suite(nproc: int, suite: str) -> str:
    return KERNEL_SUITES.assert_passed(nproc, f"suite {suite} world={nproc}", f"missing peer world={nproc}")


@pytest.mark.parametrize("nproc", [2, 4])
def test_kernels_match_verification(kernels_built: None, nproc: int) -> None:
    """The defaults (lean_dyn, grid notify, 2 KiB x 2 combine): the quick cases on 2 ranks, every case
    on 4 (quick where they share GPUs)."""
    assert_suite(nproc, "defaults")


def test_non_default_options_match_verification(kernels_built: None) -> None:
    """The options kept beside the defaults must stay correct (2 ranks, quick cases)."""
    assert_suite(2, "options")


@pytest.mark.parametrize("nproc", [1, 3])
def test_mxfp8_before_and_fused_match_verification(kernels_built: None, nproc: int) -> None:
    """mxfp8 (issue 26): E8M0 scales handed in and the cast fused into both dispatch kernels, bit-exact against
    epbench/mxfp8.py over uniform / zipf / hot routing, ranks with 0 tokens, 4095 tokens, hidden 2048 .. 8192,
    65 scale bytes per row (h2080) and blocks at every scale; 3 ranks share the GPUs of a smaller host."""
    out = assert_suite(nproc, "mxfp8")
    assert "mxfp8 fused" in out


@pytest.mark.parametrize("nproc", [1, 2])
def test_fused_stores_8_match_verification(kernels_built: None, nproc: int) -> None:
    """fused_stores=8 (one vector cast per lane and 8-byte store; the default 16 runs in the mxfp8 and
    expert-major suites): every fused mxfp8 case bit-exact against epbench/mxfp8.py, hidden 2048 .. 8192 and
    h2080's padded scale rows; at world 1 also expert-major."""
    out = assert_suite(nproc, "fused-stores-8")
    assert "mxfp8 fused" in out
    if nproc == 1:
        assert "fused" in assert_suite(1, "fused-stores-8-em")


@pytest.mark.parametrize("nproc", [1, 2, 3])
def test_expert_major_matches_verification(kernels_built: None, nproc: int) -> None:
    """Expert-major layout (issue 26): align 1 / 16 / 128 x bf16, fp8, mxfp8 before and fused; uniform, zipf and hot
    routing, ranks with 0 tokens, 4095 tokens, hidden 2048 .. 8192: segments bit-exact, counts and offsets as
    epbench/layout.py, and the per-expert weighted combine; both dispatch kernels, outputs poisoned before each;
    em_push auto (the default): the wide passes at 16 warps, the receiver copy pass with the wide reduce at 32."""
    out = assert_suite(nproc, "expert-major")
    assert "em128 mxfp8 fused" in out


@pytest.mark.parametrize("nproc", [1, 2, 4])
def test_own_rows_ce_matches_verification(kernels_built: None, nproc: int) -> None:
    """own_rows=ce (issue 34 target 3, Plan A): own rows copied by the copy engine to their token index, padding
    keyed -1, the peers' rows after them; bit-exact through verify.in_source_order, row keys and num_recv exactly
    as epbench/layout.py own_first_keys, and the combine reading each own row at its token; bf16, fp8 and mxfp8
    before, a rank with 0 tokens, every token to one rank (the others' own segments all padding), 4095 tokens.
    On 1 rank every row is an own row (the kernels store none); on 2 ranks also with the one-block (staged)
    notify."""
    out = assert_suite(nproc, "own-rows-ce")
    assert "fp8" in out
    if nproc == 2:
        assert_suite(2, "own-rows-ce-staged")


@pytest.mark.parametrize("nproc", [1, 2, 4])
def test_own_rows_all_matches_verification(kernels_built: None, nproc: int) -> None:
    """own_rows=all (issue 34 target 3, Plan C): every source's rows by token index at source x max_tokens, the
    peers' copied by copy engines after the notify kernel, keyed by a small kernel; bit-exact through
    verify.in_source_order, row keys and num_recv exactly as epbench/layout.py by_source_keys, the combine
    reading each row at its token; the same cases as own_rows=ce; on 2 ranks also with the staged notify."""
    out = assert_suite(nproc, "own-rows-all")
    assert "fp8" in out
    if nproc == 2:
        assert_suite(2, "own-rows-all-staged")


@pytest.mark.parametrize("nproc", [1, 2, 4])
def test_ce_share_matches_verification(kernels_built: None, nproc: int) -> None:
    """own_rows=all, ce_share 75 (and 25 on 2 ranks): a rank's x rows split between its copy engines (the first
    share) and plain SM stores (the rest, at the same time); the dispatch bit-exact and the combine (ce) exactly as
    verification on every case, twice per buffer."""
    out = assert_suite(nproc, "ce-share")
    if nproc > 1:
        assert "T=4095" in out
    if nproc == 2:
        assert_suite(2, "ce-share-25")


@pytest.mark.parametrize("nproc", [1, 2, 4])
def test_combine_rows_ce_matches_verification(kernels_built: None, nproc: int) -> None:
    """combine_rows=ce (issue 34 target 3, Plan B'): each holder's copy engine pushes its rows of a source into the
    source's staging buffer in chunks with a flag each, the source sums its own and the staged rows locally; the
    combine exactly as verification on every case whose ranks hold the same token count (bf16, fp8, mxfp8
    dispatch; 1 and 4095 tokens, every token to one rank, all ranks 0 tokens), twice per buffer; a rank holding more
    tokens than a peer stops at once naming it while the others verify."""
    out = assert_suite(nproc, "combine-rows-ce")
    if nproc > 1:
        assert "T=4095" in out and "uneven tokens" in out
    if nproc == 2:  # the push's other shapes: 32 chunks on 4 streams a peer, 4 chunks on one
        assert_suite(2, "combine-rows-ce-32x4")
        assert_suite(2, "combine-rows-ce-4x1")
    if nproc == 4:  # growing chunks (ce_chunking grow: 4095 tokens in 6 chunks of 256, 384, ... rows) on 2 streams
        assert "T=4095" in assert_suite(4, "combine-rows-ce-grow")
        assert "T=4095" in assert_suite(4, "combine-rows-ce-6")  # 6 even chunks, the last one shorter


@pytest.mark.parametrize("nproc", [1, 2, 4])
def test_pull_bulk_matches_verification(kernels_built: None, nproc: int) -> None:
    """pull_kernel bulk (7 loading warps a SM with 3 summing warps each, pulling every holder's row over the link
    after the ready handshake): the combine exactly as verification on every rank-major case, twice per buffer; at 4
    ranks also with own_rows all (each holder's rows of a source at rows source * max_tokens + t)."""
    out = assert_suite(nproc, "pull-bulk")
    if nproc > 1:
        assert "T=4095" in out
    if nproc == 4:
        assert_suite(4, "pull-bulk-own-all")


@pytest.mark.parametrize("nproc", [2, 4])
def test_pull_tma_where_auto_takes_bulk(kernels_built: None, nproc: int) -> None:
    """pull_kernel tma at 3 and 24 SMs: where the default (auto) runs the bulk kernel (3-4 ranks below 8 SMs, 2 ranks
    at every count), the tma kernel, which a tma knob given still selects there, is checked exactly as verification."""
    assert "T=4095" in assert_suite(nproc, "pull-tma")


@pytest.mark.parametrize("nproc", [1, 2, 3])
def test_em_push_sender_matches_verification(kernels_built: None, nproc: int) -> None:
    """em_push=sender: the expert-major cases of test_expert_major_matches_verification (align 1 / 16 / 128,
    bf16, fp8, mxfp8 before and fused, every routing) with each row stored by its sender into every slot of it,
    no receiver copy pass: segments bit-exact and the weighted combine as before."""
    out = assert_suite(nproc, "em-push-sender")
    assert "em128 mxfp8 fused" in out


@pytest.mark.parametrize("nproc", [1, 2, 3])
def test_em_sms_matches_verification(kernels_built: None, nproc: int) -> None:
    """em_sms=64: the expansion in em_expand_kernel and phase R on 64 blocks of their own, after the transfer on
    8 or 3 blocks: segments bit-exact and the weighted combine as before."""
    out = assert_suite(nproc, "em-sms")
    assert "em128 mxfp8 fused" in out


def test_em_sms_narrow_and_sender_match_verification(kernels_built: None) -> None:
    """em_sms with the receiver's narrow copy pass on a single block, and with em_push sender (phase R alone on
    64 blocks), at world 2: segments bit-exact and the weighted combine as before."""
    assert "em128 mxfp8 fused" in assert_suite(2, "em-sms-narrow")
    assert "em128 mxfp8 fused" in assert_suite(2, "em-sms-sender")


@pytest.mark.parametrize("nproc", [1, 2, 3])
def test_em_push_receiver_matches_verification(kernels_built: None, nproc: int) -> None:
    """em_push=receiver: the same expert-major cases with the receiver's narrow copy pass (kEm 1) and the fixed
    reduce batches: segments bit-exact and the weighted combine as before."""
    out = assert_suite(nproc, "em-push-receiver")
    assert "em128 mxfp8 fused" in out
