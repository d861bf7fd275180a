"""The fused mxfp8 cast of csrc/dispatch.cu (mxfp8_cast, gather_scales and the stores after them; and
fused_stores 16's mxfp8_cast_pair, gather_scales16 and 16-byte stores),
replayed step by step on the CPU: lanes of 8 bf16, blocks of 4 lanes, the xor-shuffle amax, the integer
exponent rule, 2^-e built from its bits, pairs of elements per cvt, and lane 0's 8-byte store of the
warp's 8 scale bytes into a row padded to 16 bytes. The receiver's bytes must equal epbench/mxfp8.py's
bit for bit, over random rows at every scale and the edge values of the rule."""

from __future__ import annotations

import torch

from epbench import mxfp8
from epbench.contract import RankSetup
from epbench.backends.epbench_kernels import EpbenchBackend
from epbench.contract import DispatchInput
from epbench import cuda_lib

import pytest

M32 = 0xFFFFFFFF


def _f32(bits: torch.Tensor) -> torch.Tensor:
    """float32 whose bits are the low 32 bits of int64 ``bits``."""
    b = bits & M32
    return torch.where(b >= 1 << 31, b - (1 << 32), b).to(torch.int32).view(torch.float32)


def _vmaxu2(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.maximum(a & 0xFFFF, b & 0xFFFF) | (torch.maximum(a >> 16, b >> 16) << 16)


def _shfl_down(v: torch.Tensor, delta: int) -> torch.Tensor:
    """__shfl_down_sync over the last dim (32 lanes): lanes past the end keep their own value."""
    out = v.clone()
    out[..., :32 - delta] = v[..., delta:]
    return out


def _e4m3_pair(f0: torch.Tensor, f1: torch.Tensor) -> torch.Tensor:
    """__nv_cvt_float2_to_fp8x2(float2(f0, f1), satfinite, e4m3): f0 in the low byte, round to nearest even."""
    lo = f0.to(torch.float8_e4m3fn).view(torch.uint8).to(torch.int64)
    hi = f1.to(torch.float8_e4m3fn).view(torch.uint8).to(torch.int64)
    return lo | (hi << 8)


def kernel_receive(x: torch.Tensor) -> tuple:
    """What the fused kernel leaves in the receiver's buffers for bf16 rows ``x`` [T, hidden]: (e4m3 bytes
    [T, hidden], scale rows [T, stride] with stride = hidden / 32 rounded up to 16, the padding included)."""
    t, h = x.shape
    v = h // 8  # 16-byte vectors per row
    lanes = (v + 31) // 32 * 32  # the last warp chunk's lanes past v hold garbage and store nothing
    bits = torch.randint(0, 1 << 16, (t, lanes, 8), dtype=torch.int64)
    bits[:, :v] = x.view(torch.int16).to(torch.int64).view(t, v, 8) & 0xFFFF
    w = bits[..., 0::2] | (bits[..., 1::2] << 16)  # [t, lanes, 4] words, element 2k in the low half
    mask = 0x7FFF7FFF
    m2 = _vmaxu2(_vmaxu2(w[..., 0] & mask, w[..., 1] & mask), _vmaxu2(w[..., 2] & mask, w[..., 3] & mask))
    m = torch.maximum(m2 & 0xFFFF, m2 >> 16)
    for off in (1, 2):  # __shfl_xor_sync
        partner = torch.arange(lanes) ^ off
        m = torch.maximum(m, m[:, partner])
    field = (m >> 7) & 0xFF
    e = (field - 135 + ((m & 0x7F) > 0x60).to(torch.int64)).clamp(-127, 127)
    inv = _f32((127 - e) << 23)
    q = []
    for hh in range(2):
        a, b = w[..., 2 * hh], w[..., 2 * hh + 1]
        lo = _e4m3_pair(_f32(a << 16) * inv, _f32(a & 0xFFFF0000) * inv)
        hi = _e4m3_pair(_f32(b << 16) * inv, _f32(b & 0xFFFF0000) * inv)
        q.append(lo | (hi << 16))
    nan = field == 0xFF
    q = [torch.where(nan, torch.full_like(qq, 0x7F7F7F7F), qq) for qq in q]
    s = torch.where(nan, torch.full_like(e, 0xFF), e + 127)
    # st_v2 of (q0, q1) at byte i * 8 of the row, lanes i < v only
    words = torch.stack(q, dim=2)[:, :v]  # [t, v, 2]
    shifts = torch.arange(4) * 8
    elems = ((words.unsqueeze(3) >> shifts) & 0xFF).reshape(t, h).to(torch.uint8)
    # gather_scales per warp chunk of 32 lanes, then lane 0's 8-byte store at scale byte i0 / 4
    ns = h // 32
    stride = (ns + 15) // 16 * 16
    srow = torch.full((t, stride), 0xAB, dtype=torch.uint8)
    for i0 in range(0, v, 32):
        c = s[:, i0:i0 + 32]
        c = c | (_shfl_down(c, 4) << 8)
        c = (c | (_shfl_down(c, 8) << 16)) & M32
        z, hi_word = c[:, 0], c[:, 16]
        eight = torch.stack([(z >> k) & 0xFF for k in (0, 8, 16, 24)]
                            + [(hi_word >> k) & 0xFF for k in (0, 8, 16, 24)], dim=1)
        at = i0 // 4
        assert at % 8 == 0 and at + 8 <= stride  # 8-byte aligned and inside the padded row
        srow[:, at:at + 8] = eight.to(torch.uint8)
    return elems, srow


def kernel_receive_wide(x: torch.Tensor) -> tuple:
    """The same for fused_stores 16 (mxfp8_cast_pair, gather_scales16): in each step of 64 vectors lane L
    holds vectors g0 + 2L and g0 + 2L + 1, lanes 2b and 2b + 1 share a block (one xor-shuffle), each lane
    stores its 16 e4m3 bytes at byte 8 (g0 + 2L) and lane 0 the step's 16 scale bytes at byte g0 / 4."""
    t, h = x.shape
    v = h // 8
    steps = (v + 63) // 64
    bits = torch.randint(0, 1 << 16, (t, steps * 64, 8), dtype=torch.int64)  # past v: garbage, never stored
    bits[:, :v] = x.view(torch.int16).to(torch.int64).view(t, v, 8) & 0xFFFF
    w = bits[..., 0::2] | (bits[..., 1::2] << 16)  # [t, vectors, 4] words
    mask = 0x7FFF7FFF
    m2 = _vmaxu2(_vmaxu2(w[..., 0] & mask, w[..., 1] & mask), _vmaxu2(w[..., 2] & mask, w[..., 3] & mask))
    mv = torch.maximum(m2 & 0xFFFF, m2 >> 16)  # per vector
    elems = torch.zeros(t, h, dtype=torch.uint8)
    ns = h // 32
    stride = (ns + 15) // 16 * 16
    srow = torch.full((t, stride), 0xAB, dtype=torch.uint8)
    lanes = torch.arange(32)
    for g0 in range(0, steps * 64, 64):
        va, vb = g0 + 2 * lanes, g0 + 2 * lanes + 1  # the lane's two vectors
        m = torch.maximum(mv[:, va], mv[:, vb])  # [t, 32]
        m = torch.maximum(m, m[:, lanes ^ 1])  # __shfl_xor_sync(.., 1)
        field = (m >> 7) & 0xFF
        e = (field - 135 + ((m & 0x7F) > 0x60).to(torch.int64)).clamp(-127, 127)
        inv = _f32((127 - e) << 23)
        nan = field == 0xFF
        out = []
        for vec in (va, vb):
            for hh in range(2):
                a, b = w[:, vec, 2 * hh], w[:, vec, 2 * hh + 1]
                lo = _e4m3_pair(_f32(a << 16) * inv, _f32(a & 0xFFFF0000) * inv)
                hi = _e4m3_pair(_f32(b << 16) * inv, _f32(b & 0xFFFF0000) * inv)
                out.append(torch.where(nan, torch.full_like(lo, 0x7F7F7F7F), lo | (hi << 16)))
        words = torch.stack(out, dim=2)  # [t, 32, 4]: the lane's 16-byte store
        sixteen = ((words.unsqueeze(3) >> (torch.arange(4) * 8)) & 0xFF).reshape(t, 32, 16).to(torch.uint8)
        for lane in range(32):
            i = g0 + 2 * lane
            if i < v:  # st_v4 at byte 8 i
                elems[:, 8 * i:8 * i + 16] = sixteen[:, lane]
        sc = torch.where(nan, torch.full_like(e, 0xFF), e + 127)
        c = sc | (_shfl_down(sc, 2) << 8)
        c = (c | (_shfl_down(c, 4) << 16)) & M32
        if g0 < v:
            at = g0 // 4
            assert at % 16 == 0 and at + 16 <= stride  # 16-byte aligned and inside the padded row
            srow[:, at:at + 16] = torch.stack([(c[:, ln] >> k) & 0xFF for ln in (0, 8, 16, 24) for k in (0, 8, 16, 24)],
                                              dim=1).to(torch.uint8)
    return elems, srow


def _edge_rows(hidden: int) -> torch.Tensor:
    """bf16 rows whose blocks hit the rule's edges: zeros, signed zeros, bf16 subnormals, amax mantissas
    0x60 / 0x61 at every exponent, the largest finite bf16, inf, NaN, and tiny elements beside huge ones."""
    g = torch.Generator().manual_seed(7)
    blocks = []
    for field in list(range(0, 255, 3)) + [1, 2, 8, 9, 126, 127, 128, 253, 254]:
        for mant in (0x00, 0x5F, 0x60, 0x61, 0x7F):
            amax = (field << 7) | mant
            other = torch.randint(0, amax + 1, (32,), generator=g)
            other[torch.randint(0, 32, (1,), generator=g)] = amax
            sign = torch.randint(0, 2, (32,), generator=g) << 15
            blocks.append(other | sign)
    special = [[0] * 32, [0x8000] * 32, [1] * 32, [0x7F7F] + [1] * 31, [0x7F80] + [0x3F80] * 31,
               [0xFF80] + [0x3F80] * 31, [0x7FC0] + [0x3F80] * 31, [0x7F81] + [0] * 31,
               [0x4040] + [0x0001, 0x8001, 0x0080, 0x8080] * 7 + [0, 0, 0],  # 3.0 beside fp32-underflowing products
               [0x0001] * 16 + [0x007F] * 16]
    blocks += [torch.tensor(b, dtype=torch.int64) for b in special]
    flat = torch.cat(blocks)
    per_row = hidden
    pad = (-flat.numel()) % per_row
    flat = torch.cat([flat, torch.zeros(pad, dtype=torch.int64)])
    u = flat.view(-1, per_row)
    return torch.where(u >= 1 << 15, u - (1 << 16), u).to(torch.int16).view(torch.bfloat16)


def _random_rows(t: int, hidden: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, hidden, generator=g)
    # every block at its own scale, 2^-140 .. 2^126 (bf16 subnormals to near the top of the range)
    scale = torch.pow(2.0, torch.randint(-140, 127, (t, hidden // 32, 1), generator=g).double())
    return (x.double().view(t, hidden // 32, 32) * scale).view(t, hidden).clamp(-3e38, 3e38).to(torch.bfloat16)


@pytest.mark.parametrize("hidden", [32, 96, 2048, 2080, 7168])
def test_kernel_cast_matches_the_reference_quantizer(hidden: int) -> None:
    for x in (_random_rows(7, hidden, hidden), _edge_rows(hidden)):
        q, s = mxfp8.quantize(x)
        for receive in (kernel_receive, kernel_receive_wide):  # fused_stores 8 and 16
            elems, srow = receive(x)
            assert torch.equal(elems, q.view(torch.uint8)), receive.__name__
            assert torch.equal(srow[:, :hidden // 32], s), receive.__name__


def test_edge_rows_reach_every_branch() -> None:
    """The edge set is not vacuous: NaN scales, clamped-low and rounded-up exponents all occur."""
    _, s = mxfp8.quantize(_edge_rows(2048))
    assert (s == 0xFF).any() and (s == 0).any() and ((s > 0) & (s < 0xFF)).sum() > 100


def _setup(dtype: str, quantize: str, hidden: int = 2048) -> RankSetup:
    return RankSetup(rank=0, world=1, gpus_per_node=1, device=torch.device("cpu"), hidden=hidden,
                     max_tokens_per_rank=8, topk=2, experts_per_rank=4, dispatch_dtype=dtype,
                     quantize=quantize)


def test_fused_cast_is_offered_for_mxfp8_only() -> None:
    assert "mxfp8" in EpbenchBackend.dtypes and "fused" in EpbenchBackend.quantize_modes
    reason = EpbenchBackend.unavailable_reason(_setup("fp8", "fused"))
    assert reason is not None and "mxfp8 only" in reason
    # mxfp8 itself is refused here only for the missing GPU, not for the payload
    assert "mxfp8" not in (EpbenchBackend.unavailable_reason(_setup("mxfp8", "fused")) or "")


def test_mxfp8_input_needs_byte_scales_per_32() -> None:
    s = _setup("mxfp8", "before")
    x = torch.zeros(4, 2048, dtype=torch.float8_e4m3fn)
    idx, w = torch.zeros(4, 2, dtype=torch.int64), torch.zeros(4, 2)
    good = DispatchInput(x, torch.zeros(4, 64, dtype=torch.uint8), idx, w)
    cuda_lib.check_dispatch_input(good, s, torch.float8_e4m3fn, False, True)
    for bad in (None, torch.zeros(4, 16, dtype=torch.float32), torch.zeros(4, 65, dtype=torch.uint8),
                torch.zeros(64, 4, dtype=torch.uint8).t()):
        with pytest.raises(ValueError, match="mxfp8 dispatch needs"):
            cuda_lib.check_dispatch_input(DispatchInput(x, bad, idx, w), s, torch.float8_e4m3fn, False, True)
    # fused: bf16 rows and no scales
    cuda_lib.check_dispatch_input(DispatchInput(x.to(torch.bfloat16), None, idx, w), s, torch.bfloat16,
                                  False, False)


@pytest.mark.parametrize("ku", [4, 8])
def test_fused_stores_16_steps_place_every_vector_and_scale_once(ku: int) -> None:
    """dispatch.cu's lean_rows with kFused 2, step by step as written (v0 += 32 kU; buf[u] holds vector
    v0 + 64 (u >> 1) + 2 lane + (u & 1); the pair (2m, 2m + 1) is cast together; lane l stores 16 bytes at
    int4 index i >> 1 for i = v0 + 64 m + 2 l < V; lane 0 the scale bytes of blocks (v0 + 64 m) / 4 ..
    + 15): for every hidden that is a multiple of 32 up to 8192, each vector's 8 bytes land once at byte
    8 i, both vectors of a lane's pair lie in one 32-element block with its partner lane's, and each scale
    byte j < num_scales comes from block j, inside the 16-aligned stride."""
    for hidden in range(32, 8192 + 1, 32):
        v, ns = hidden // 8, hidden // 32
        stride = (ns + 15) // 16 * 16
        placed, scales = {}, {}
        for v0 in range(0, v, 32 * ku):
            held = {(lane, u): v0 + (u >> 1) * 64 + 2 * lane + (u & 1) for lane in range(32) for u in range(ku)}
            for m in range(ku // 2):
                g0 = v0 + 64 * m
                block = {}
                for lane in range(32):
                    mine = [held[lane, 2 * m], held[lane, 2 * m + 1], held[lane ^ 1, 2 * m], held[lane ^ 1, 2 * m + 1]]
                    if all(i < v for i in mine):  # a lane and its xor-1 partner: one block
                        assert len({i // 4 for i in mine}) == 1, (hidden, ku, lane)
                        block[lane] = mine[0] // 4
                    else:
                        assert all(i >= v for i in mine)  # both out of range, never half
                for lane in range(32):
                    i = g0 + 2 * lane
                    assert i == held[lane, 2 * m] and i + 1 == held[lane, 2 * m + 1]
                    if i < v:
                        assert 16 * (i >> 1) == 8 * i and 8 * i + 16 <= hidden and (i, i + 1) not in placed.values()
                        placed[8 * i] = (i, i + 1)
                if g0 < v:
                    at = g0 >> 2
                    assert at % 16 == 0 and at + 16 <= stride
                    for k in range(16):  # byte k of lane 0's store: block k's byte, from lane 2k
                        if at + k < ns:
                            scales[at + k] = block[2 * k]
        assert sorted(placed) == [8 * i for i in range(0, v, 2)]
        assert scales == {j: j for j in range(ns)}
