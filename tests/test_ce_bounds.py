"""combine_rows ce's chunk bounds (csrc/buffers.cu ep_ce_bounds, what the push and both combine_ce kernels read):
every chunk count gives that many chunks covering the rows once, growing chunks grow 1.5x from max_tokens / 16.
The function makes no CUDA call; the test runs wherever the kernels library is built (skipped elsewhere)."""

import ctypes

import pytest

from epbench import cuda_lib

K = 32  # csrc/common.cuh kCeChunks


@pytest.fixture(scope="module")
def bounds():
    try:
        lib = cuda_lib.load()
    except RuntimeError as e:
        pytest.skip(str(e))

    def get(tokens: int, chunks: int, grow: bool = False) -> list:
        out = (ctypes.c_int * (K + 1))()
        assert lib.ep_ce_bounds(tokens, chunks, int(grow), out) == 0
        return list(out)

    return get


def sizes(b: list) -> list:
    return [b[i + 1] - b[i] for i in range(K) if b[i + 1] > b[i]]


@pytest.mark.parametrize("tokens", [1, 2, 15, 16, 17, 100, 4095, 4096])
@pytest.mark.parametrize("chunks", [4, 5, 6, 8, 16, 32])
def test_even_chunks_cover_every_row_once(bounds, tokens: int, chunks: int) -> None:
    b = bounds(tokens, chunks)
    assert b[0] == 0 and b[K] == tokens and all(x <= y for x, y in zip(b, b[1:]))
    rows = -(-tokens // chunks)  # ceil
    assert sizes(b) == [min(rows, tokens - i * rows) for i in range(-(-tokens // rows))]


def test_4096_tokens_in_32_chunks_of_128(bounds) -> None:
    assert sizes(bounds(4096, 32)) == [128] * 32


def test_growing_chunks(bounds) -> None:
    assert sizes(bounds(4096, 0, grow=True)) == [256, 384, 576, 864, 1296, 720]
    for tokens in (1, 17, 4095, 100000):
        b = bounds(tokens, 0, grow=True)
        s = sizes(b)
        assert sum(s) == tokens and b[K] == tokens and len(s) <= K
        assert all(s[i + 1] >= s[i] for i in range(len(s) - 2))  # growing, but for the last (the rest)


def test_bad_arguments_are_refused(bounds) -> None:
    lib = cuda_lib.load()
    out = (ctypes.c_int * (K + 1))()
    assert lib.ep_ce_bounds(-1, 4, 0, out) != 0 and lib.ep_ce_bounds(100, 0, 0, out) != 0
    assert bounds(0, 4) == [0] * (K + 1)


def test_pull_auto_picks_bulk_where_it_measured_faster(bounds) -> None:
    """pull_kernel auto (csrc/buffers.cu ep_pull_auto), rank-major only: the bulk pull at 2 ranks at every SM count
    and at 3-4 ranks below 8 SMs; the tma kernel elsewhere, at 1 rank, at 5+ ranks and with the expert-major layout."""
    lib = cuda_lib.load()
    assert [lib.ep_pull_auto(w, 4, 0) for w in (1, 2, 3, 4, 5, 8)] == [0, 1, 1, 1, 0, 0]
    assert [lib.ep_pull_auto(2, s, 0) for s in (1, 4, 8, 15, 16, 24, 132)] == [1] * 7
    assert [lib.ep_pull_auto(4, s, 0) for s in (1, 4, 7, 8, 16, 132)] == [1, 1, 1, 0, 0, 0]
    assert lib.ep_pull_auto(3, 7, 0) == 1 and lib.ep_pull_auto(3, 8, 0) == 0
    assert lib.ep_pull_auto(4, 4, 128) == 0 and lib.ep_pull_auto(2, 16, 16) == 0
