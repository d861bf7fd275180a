"""Token data for a run: random (never zeros), regenerable on any rank from (seed, rank, salt).

Expert outputs for combine are derived from what a rank received, scaled by a per-rank factor,
so that the source can predict every copy it gets back without another exchange.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from epbench import mxfp8
from epbench.contract import DispatchInput
from epbench.routing import RankRouting, _generator
from epbench.scenario import FP8_BLOCK

FP8_MAX = 448.0  # largest finite e4m3 value


def make_tokens(num_tokens: int, hidden: int, seed: int, rank: int, salt: int,
                device: torch.device) -> torch.Tensor:
    """bf16 [T, hidden], standard normal, from a generator seeded by (seed, rank, salt)."""
    seed64 = int(torch.randint(0, 2**62, (1,), generator=_generator(seed, 3, rank, salt)))
    g = torch.Generator(device=device).manual_seed(seed64)
    return torch.randn(num_tokens, hidden, generator=g, device=device).to(torch.bfloat16)


def quantize_fp8(x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """e4m3 payload [T, hidden] and one fp32 scale per 128 elements [T, hidden / 128]."""
    t, h = x.shape
    blocks = x.float().view(t, h // FP8_BLOCK, FP8_BLOCK)
    scales = blocks.abs().amax(dim=2).clamp_(min=1e-8) / FP8_MAX
    q = (blocks / scales.unsqueeze(2)).to(torch.float8_e4m3fn).view(t, h)
    return q, scales


def dequantize(x: torch.Tensor, scales: Optional[torch.Tensor]) -> torch.Tensor:
    """float32 values of a dispatched payload (the scales' dtype says the format: float32 per
    128 elements for fp8, uint8 E8M0 bytes per 32 for mxfp8)."""
    if scales is None:
        return x.float()
    if scales.dtype == torch.uint8:
        return mxfp8.dequantize(x, scales)
    t, h = x.shape
    return (x.float().view(t, h // FP8_BLOCK, FP8_BLOCK) * scales.unsqueeze(2)).view(t, h)


def quantize(x: torch.Tensor, dtype: str) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """bf16 rows -> (payload, scales) of ``dtype`` (bf16: the rows themselves, no scales)."""
    if dtype == "fp8":
        return quantize_fp8(x)
    if dtype == "mxfp8":
        return mxfp8.quantize(x)
    return x, None


def dispatch_input(x: torch.Tensor, routing: RankRouting, dtype: str, device: torch.device,
                   quantize_mode: str = "before") -> DispatchInput:
    """What the caller hands to dispatch: quantized rows (``before``) or the bf16 rows
    (``fused``: the backend quantizes on the way)."""
    idx = routing.topk_idx.to(device)
    w = routing.topk_weights.to(device)
    if quantize_mode == "fused":
        return DispatchInput(x, None, idx, w)
    return DispatchInput(*quantize(x, dtype), idx, w)


def wire_input(inp: DispatchInput, dtype: str) -> DispatchInput:
    """What the receivers must get from ``inp``: bf16 rows of a fused dispatch quantized by the
    reference quantizer, anything else as it is."""
    if inp.x_scales is not None or dtype == "bf16":
        return inp
    return DispatchInput(*quantize(inp.x, dtype), inp.topk_idx, inp.topk_weights)


def expert_factor(rank: int) -> float:
    """Rank d's stand-in expert multiplies every received row by this (0.25 .. 2.0)."""
    return (rank % 8 + 1) / 4.0


def expert_output(received: torch.Tensor, scales: Optional[torch.Tensor], rank: int) -> torch.Tensor:
    """bf16 rows the stand-in expert on ``rank`` returns for received rows."""
    return (dequantize(received, scales) * expert_factor(rank)).to(torch.bfloat16)


def rotated_routing(routing: RankRouting, seed: int, rank: int, rotation: int) -> RankRouting:
    """Input set ``rotation``'s routing on ``rank``: 0 is the scenario's; any other hands the same
    routes to other tokens (a permutation of the tokens drawn from (seed, rank, rotation)). Every
    count per rank, node and expert, and so every byte the formulas of epbench/metrics.py count,
    stays the same, while each token's destinations, and so every row's place, change."""
    if rotation == 0 or routing.num_tokens < 2:
        return routing
    perm = torch.randperm(routing.num_tokens, generator=_generator(seed, 4, rank, rotation))
    return RankRouting(routing.topk_idx[perm], routing.topk_weights[perm])


def fill_in_place(dst: DispatchInput, src: DispatchInput) -> None:
    """Copies ``src``'s values into ``dst``'s own tensors (same shapes and kinds), so that a call
    bound to ``dst``'s tensors sees the new values through the very objects it was timed with."""
    for name in ("x", "x_scales", "topk_idx", "topk_weights"):
        d, s = getattr(dst, name), getattr(src, name)
        if (d is None) != (s is None):
            raise ValueError(f"fill_in_place: {name} present on one side only")
        if d is not None:
            d.copy_(s)
