"""MXFP8 (OCP Microscaling Formats v1.0, element type E4M3): the reference quantizer.

Format
    Every block of 32 consecutive elements of a row shares one E8M0 scale: a power of two
    ``2^(b - 127)`` stored as its biased exponent byte ``b`` (0 .. 254; 255 is NaN). Each element
    is an e4m3 byte (``torch.float8_e4m3fn``: max finite 448, min normal 2^-6, subnormal spacing
    2^-9). On the wire a row is ``hidden`` element bytes followed by ``hidden / 32`` scale bytes
    (``pack_rows``).

Scale rule (the one epbench uses, chosen so that nothing saturates)
    The block's absolute maximum ``amax`` is taken in bf16 (exact). The scale exponent is the
    smallest ``e`` with ``amax / 2^e <= 448``, the rule TransformerEngine uses (the scale is
    rounded up), not the OCP spec's ``floor(log2(amax)) - 8``, which lets amax / scale reach
    [448, 512) and clips those values to 448 (up to 12.5% error on the largest element).
    With ``amax = 1.m * 2^E`` (E the unbiased float exponent, m the mantissa bits):
    ``448 = 1.75 * 2^8``, so ``e = E - 8`` when ``1.m <= 1.75`` and ``E - 7`` otherwise. From the
    bf16 bits ``u`` of amax: ``E = ((u >> 7) & 0xFF) - 127`` and ``1.m > 1.75`` iff
    ``(u & 0x7F) > 0x60``: integer arithmetic only, no log2 and no division, so a CUDA kernel
    gets the same byte from the same bf16 inputs. ``e`` is clamped to [-127, 127]: raising a
    scale never makes a quotient overflow, and a block whose amax is zero or tiny (a bf16
    subnormal has exponent field 0) gets byte 0 (scale 2^-127).

Elements
    ``q = e4m3_rne(float32(x) * 2^-e)``: the multiplication by a power of two is exact in fp32
    (every finite quotient is <= 448; one that would underflow fp32's normal range is far below
    e4m3's smallest subnormal and rounds to a signed zero either way) and the cast rounds to
    nearest, ties to even, as ``__nv_cvt_float_to_fp8(v, __NV_SATFINITE, __NV_E4M3)`` does
    (saturation never triggers: |v| <= 448).

Error bound (dequantized ``x' = q * 2^e`` against the bf16 source x)
    ``|x' - x| <= max(2^-4 * |x|, 2^(e - 10))``: half an e4m3 ulp (3 mantissa bits) relative
    where ``x / 2^e`` is normal, half the subnormal spacing 2^-9 below that.

NaN and infinity
    A block holding a NaN or an infinity (bf16 exponent field 0xFF in its amax) gets scale byte
    0xFF (E8M0 NaN) and every element byte 0x7F (e4m3 NaN); it dequantizes to NaN throughout.
"""

from __future__ import annotations

from typing import Tuple

import torch

from epbench.scenario import MXFP8_BLOCK as BLOCK  # elements per E8M0 scale

E4M3_MAX = 448.0
SCALE_BIAS = 127
SCALE_NAN = 0xFF
ELEMENT_NAN = 0x7F


def _check(x: torch.Tensor) -> None:
    if x.dtype != torch.bfloat16 or x.dim() != 2 or x.shape[1] % BLOCK:
        raise ValueError(f"mxfp8 quantizes bf16 [rows, hidden] with hidden % {BLOCK} == 0, "
                         f"got {x.dtype} {tuple(x.shape)}")


def scale_exponents(x: torch.Tensor) -> torch.Tensor:
    """int32 [rows, hidden / 32]: the biased scale byte of each block as an integer (0 .. 255)."""
    _check(x)
    t, h = x.shape
    amax = x.view(t, h // BLOCK, BLOCK).abs().amax(dim=2)
    u = amax.view(torch.int16).to(torch.int32) & 0xFFFF
    field = (u >> 7) & 0xFF
    e = field - SCALE_BIAS - 8 + ((u & 0x7F) > 0x60).to(torch.int32)
    byte = e.clamp(-SCALE_BIAS, SCALE_BIAS) + SCALE_BIAS
    return torch.where(field == 0xFF, torch.full_like(byte, SCALE_NAN), byte)


def _pow2(exponent: torch.Tensor) -> torch.Tensor:
    """float32 2^exponent for integer exponents in [-126, 127], built from its bits (exact)."""
    return ((exponent + 127) << 23).to(torch.int32).view(torch.float32)


def quantize(x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """bf16 [T, hidden] -> (e4m3 [T, hidden], uint8 scale bytes [T, hidden / 32])."""
    byte = scale_exponents(x)
    t, h = x.shape
    finite = byte != SCALE_NAN
    # 2^-e with e = byte - 127 in [-127, 127]: -e in [-127, 127]; 2^127 and 2^-126 .. are exact,
    # and -e = -127 cannot occur (e = 127 would need amax >= 2^134, beyond bf16)
    inv = _pow2(torch.where(finite, SCALE_BIAS - byte, torch.zeros_like(byte)))
    v = x.float().view(t, h // BLOCK, BLOCK) * inv.unsqueeze(2)
    q = v.to(torch.float8_e4m3fn).view(torch.uint8)
    q = torch.where(finite.unsqueeze(2), q, torch.full_like(q, ELEMENT_NAN))
    return q.view(t, h).view(torch.float8_e4m3fn), byte.to(torch.uint8)


def scales_float(scales: torch.Tensor) -> torch.Tensor:
    """float32 value of each E8M0 scale byte (byte 255: NaN)."""
    b = scales.to(torch.int32)
    # bytes 1 .. 254 are the fp32 exponent field itself; byte 0 (2^-127) is an fp32 subnormal
    val = torch.where(b == 0, torch.full_like(b, 1 << 22), b << 23).view(torch.float32)
    return torch.where(b == SCALE_NAN, torch.full_like(val, float("nan")), val)


def dequantize(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """float32 [T, hidden] from e4m3 elements and their scale bytes."""
    t, h = q.shape
    return (q.float().view(t, h // BLOCK, BLOCK) * scales_float(scales).unsqueeze(2)).view(t, h)


def error_bound(x: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """float32 [T, hidden]: the largest |dequantized - x| the format allows per element."""
    t, h = x.shape
    floor = scales_float(scales) * 2.0**-10
    rel = x.float().abs() * 2.0**-4
    return torch.maximum(rel.view(t, h // BLOCK, BLOCK), floor.unsqueeze(2)).view(t, h)


def pack_rows(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """uint8 [T, hidden + hidden / 32]: the wire rows (elements, then scale bytes)."""
    return torch.cat([q.view(torch.uint8), scales.view(torch.uint8)], dim=1)


def unpack_rows(rows: torch.Tensor, hidden: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 [T, hidden], uint8 [T, hidden / 32]) views of packed wire rows."""
    want = hidden + hidden // BLOCK  # metrics.mxfp8_row_bytes
    if rows.shape[1] != want:
        raise ValueError(f"wire rows of hidden {hidden} are {want} bytes, got {rows.shape[1]}")
    return rows[:, :hidden].view(torch.float8_e4m3fn), rows[:, hidden:]
