"""The ``symm-mem`` backend: torch's own ``torch.distributed._symmetric_memory`` all-to-all
(``all_to_all_vdev``; NVSHMEM from the torch wheel), what torchtitan-style training uses without
any extra install. Only its launch pre-checks exist so far: the data path (index_select per
destination, ``all_to_all_vdev`` of payload and metadata, weighted ``index_add_`` at the source on
combine) is not written yet, so the backend says so instead of running."""

from __future__ import annotations

from typing import Optional

import torch

from epbench.backends.base import Backend, DispatchInput, DispatchOutput, RankSetup


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


def limits_reason(world: int, nvshmem_available: bool, device_type: str) -> Optional[str]:
    """What torch's symmetric-memory all-to-all cannot run, known before launch."""
    if device_type != "cuda":
        return "needs CUDA GPUs"
    if world < 2:
        return "needs world > 1 (torch refuses one rank: global_ranks.size() > 1)"
    if not nvshmem_available:
        return "torch's NVSHMEM is not usable here (symm_mem.is_nvshmem_available() is False)"
    return None


class SymmMemBackend(PrecheckOnly):
    name = "symm-mem"

    @classmethod
    def unavailable_reason(cls, setup: RankSetup) -> Optional[str]:
        try:
            import torch.distributed._symmetric_memory as symm_mem
            available = bool(symm_mem.is_nvshmem_available())
        except Exception as e:
            return f"torch.distributed._symmetric_memory not importable ({e})"
        reason = limits_reason(setup.world, available,
                               setup.device.type if torch.cuda.is_available() else "cpu")
        return reason or "data path not written yet (issue 23): only the pre-checks exist"
