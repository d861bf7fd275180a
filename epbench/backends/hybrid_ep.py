"""The ``hybrid-ep`` backend: NVIDIA's Hybrid-EP (DeepEP's hybrid-ep branch, pinned in
epbench/baselines.py; ``HybridEPBuffer``). Only the launch pre-checks exist so far.

Why the data path is not there yet: ``HybridEPBuffer.dispatch`` returns, per received row, the
token, ``dispatched_probs`` over this rank's experts and a ``local_expert_routing_map``
(``[rows, experts_per_rank]`` bool) - not the top-k positions. epbench's dispatch check compares the
received ``topk_idx`` / ``topk_weights`` per top-k position, which cannot be rebuilt from a map
without the source's routing; the check needs a per-expert (set) form first (epbench/verify.py)."""

from __future__ import annotations

import importlib
from typing import Optional

import torch

from epbench.backends.base import Backend, DispatchInput, DispatchOutput, RankSetup

FP8_HIDDEN_MULTIPLE = 512  # Hybrid-EP's FP8 path
BF16_HIDDEN_MULTIPLE = 16


class PrecheckOnly(Backend):
    """A baseline whose launch pre-checks exist but whose data path does not: its
    ``unavailable_reason`` always names a reason, so the driver never constructs it."""

    def __init__(self, setup: RankSetup) -> None:
        raise NotImplementedError(f"{self.name}: data path not written yet")

    def dispatch(self, inp: DispatchInput, num_sms: int) -> DispatchOutput:
        raise NotImplementedError

    def combine_input(self, out: DispatchOutput) -> torch.Tensor:
        raise NotImplementedError

    def combine(self, out: DispatchOutput, num_sms: int) -> torch.Tensor:
        raise NotImplementedError


def limits_reason(hidden: int, dtype: str, device_type: str) -> Optional[str]:
    if device_type != "cuda":
        return "needs CUDA GPUs"
    if dtype == "fp8" and hidden % FP8_HIDDEN_MULTIPLE:
        return f"fp8 needs hidden % {FP8_HIDDEN_MULTIPLE} == 0 (hidden {hidden})"
    if hidden % BF16_HIDDEN_MULTIPLE:
        return f"needs hidden % {BF16_HIDDEN_MULTIPLE} == 0 (hidden {hidden})"
    return None


class HybridEPBackend(PrecheckOnly):
    name = "hybrid-ep"

    @classmethod
    def unavailable_reason(cls, setup: RankSetup) -> Optional[str]:
        try:
            importlib.import_module("deep_ep").HybridEPBuffer
        except Exception as e:
            detail = " ".join(str(e).split()) or type(e).__name__
            return (f"deep_ep.HybridEPBuffer not importable ({detail}); build: "
                    f"make baselines DEEPEP_FLAVOR=hybrid-ep")
        reason = limits_reason(setup.hidden, setup.dispatch_dtype,
                               setup.device.type if torch.cuda.is_available() else "cpu")
        return reason or "data path not written yet (issue 23): verify needs a per-expert form"
