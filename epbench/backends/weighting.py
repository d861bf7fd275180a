"""The weighting a caller adds for a library whose combine sums a token's returned rows without
weights (DeepEP V1 / V2, Hybrid-EP, FlashInfer): each row times ``w(t, d)``, the sum of the
token's weights for the experts of the rank that returned it.

Two forms, because torch's ``mul`` of bf16 rows by an fp32 factor into a bf16 output does not
run as one pass: its common dtype is fp32, so it writes an fp32 temporary the size of the rows
and copies that into the output (for DeepSeek-V3's shape at 4 ranks: ~420 MB written and read
again beside the 210 MB of rows, ~450 us on an H200 against ~100 us for one bf16 pass; measured
as the whole gap between the call and kernel modes' combine of ``deepep``, 2026-11-26).

exact (untimed use: kernel mode folds the weights into the expert output, as an fp32 GEMM
    epilogue would): fp32 product, one bf16 rounding.
fast (inside a timed call: what a user writes, ``rows * w.to(rows.dtype)``): the factor rounded
    to bf16 first, then one bf16 pass, so one rounding more (``EXTRA_ROUNDINGS``).
"""

from __future__ import annotations

import torch

EXTRA_ROUNDINGS = {True: 0, False: 1}  # exact -> bf16 roundings added beyond the contract's two


def weigh_rows(rows: torch.Tensor, factor: torch.Tensor, out: torch.Tensor, exact: bool) -> torch.Tensor:
    """``out = rows * factor``; ``factor`` [n, 1] (any float dtype), ``rows`` and ``out`` [n, hidden]."""
    torch.mul(rows, factor if exact else factor.to(rows.dtype), out=out)
    return out
