"""The interface every dispatch/combine implementation fills in (the data it takes and returns,
and what it must compute: epbench/contract.py).

The driver (epbench/driver.py) owns timing, verification and recording; a backend only
moves tokens. One backend object lives per rank for one (scenario, world): its constructor
allocates every buffer it will ever need, so nothing is allocated inside the timed region.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, ClassVar, Dict, Optional, Tuple

import torch

from epbench.contract import COMBINE_ROUNDINGS, DispatchInput, DispatchOutput, LowLatencyOutput, RankSetup


class Backend(ABC):
    name: ClassVar[str]
    uses_sms: ClassVar[bool] = False  # True when num_sms changes what runs
    hierarchical: ClassVar[bool] = False  # True: one NIC copy per destination node
    # True: the received ``topk_idx`` holds local expert indices (global id minus
    # rank * experts_per_rank) for this rank's experts and -1 for the others, whose weights are
    # 0 (DeepEP's layout). Verification then compares against that masked form; False: the
    # full global ids and weights, as sent (the contract above).
    receives_local_expert_ids: ClassVar[bool] = False
    # True: the received routing is a per-expert map, not top-k positions: ``topk_idx`` is bool
    # ``[capacity, experts_per_rank]`` (True where the row's top-k holds that local expert) and
    # ``topk_weights`` float32 ``[capacity, experts_per_rank]`` (that expert's weight, 0 elsewhere),
    # Hybrid-EP's layout. Verification then compares, per row, the set of local experts and their
    # weights (order-free), still bit-exact.
    routing_as_map: ClassVar[bool] = False
    # True: the backend keeps a layout made from the routing across calls (a cached handle), so
    # the driver's rotating input sets keep the routing and change only the token values.
    reuses_layout: ClassVar[bool] = False
    # the ways this backend can be called (bench.call_modes): "call" as a model's forward pass
    # calls it; "kernel" its library's fastest path as the library's own benchmark times it
    # (e.g. a cached layout); the driver picks one with use_call_mode before a point
    call_modes: ClassVar[Tuple[str, ...]] = ("call",)
    modes: ClassVar[Tuple[str, ...]] = ("normal",)  # scenario modes this backend implements
    # True: the low-latency calls allocate nothing, never wait on the host and keep their
    # per-call state (epochs) on the device, so a captured CUDA graph of them can be replayed.
    supports_cuda_graphs: ClassVar[bool] = False
    # True: dispatch and combine never wait for the device on the host in either mode, so the timer
    # may gate their plain launches as it gates graph replays (diagnostic switch gate_launches)
    host_free_calls: ClassVar[bool] = False
    # payload features this backend implements (scenario model.dispatch_dtype / quantize / layout)
    dtypes: ClassVar[Tuple[str, ...]] = ("bf16", "fp8")
    quantize_modes: ClassVar[Tuple[str, ...]] = ("before",)
    layouts: ClassVar[Tuple[str, ...]] = ("rank_major",)
    # where the library runs kernels on more SMs than the point's --sms: one line for the run's notes
    # (driver.py, overlap.py), so that its SMs column is read as what it is
    sms_beyond: ClassVar[Optional[str]] = None

    @classmethod
    def unavailable_reason(cls, setup: RankSetup) -> Optional[str]:
        """None when this backend can run here, else one line saying why not."""
        return None

    @classmethod
    def chain_reason(cls, setup: RankSetup) -> Optional[str]:
        """None when K back-to-back calls of one op (K dispatches, then K combines, with no other
        call between) may be captured into one CUDA graph and replayed here, each call doing its
        full work; else one line saying why not (the driver then times no ``chain`` rows)."""
        return None if cls.supports_cuda_graphs else "its calls cannot be captured in a CUDA graph"

    def combine_roundings(self) -> int:
        """How many times this backend's combine path rounds to bf16 between the expert outputs and
        the result: verification allows that many roundings (epbench.verify.BF16_ROUNDING each).
        Two by default: the weighted rows the caller or backend makes, and the result."""
        return COMBINE_ROUNDINGS

    @abstractmethod
    def __init__(self, setup: RankSetup) -> None: ...

    def effective_config(self) -> Dict[str, Any]:
        """The options this backend ran with, after any clamp or fallback of its kernels (epbench/options.py
        names them); read after the last call of a point and written into its rows. Empty: no options."""
        return {}

    def use_call_mode(self, mode: str) -> None:
        """Switches how the next points are called (one of ``call_modes``); before a point's inputs
        are prepared, never inside one."""
        if mode not in self.call_modes:
            raise ValueError(f"{self.name}: no call mode {mode!r} (it has {', '.join(self.call_modes)})")

    def poison(self) -> None:
        """Fill every output buffer the backend owns with garbage (NaN / 0xFF). Nothing else: the
        call after it must be the same call the timed loop makes (no switch to another path)."""

    def close(self) -> None:
        """Release buffers and peer mappings."""


class KernelLayouts:
    """The ``kernel`` call mode of a baseline whose fastest path reuses a layout made from the routing (a
    cached handle, known splits): ``prepare_input`` makes it once per input set, untimed, into
    ``_layouts`` (keyed by the input's id); ``kernel`` says which mode the next points run. Mixed in
    before the backend's mode class."""

    kernel = False

    def use_call_mode(self, mode: str) -> None:
        super().use_call_mode(mode)  # type: ignore[misc]
        self.kernel = self.reuses_layout = mode == "kernel"
        self._layouts: Dict[int, Any] = {}


class NormalMode(Backend):
    """A backend of the scenario mode ``normal``: dispatch and combine (epbench/contract.py)."""

    modes: ClassVar[Tuple[str, ...]] = ("normal",)

    @abstractmethod
    def dispatch(self, inp: DispatchInput, num_sms: int) -> DispatchOutput: ...


    def prepare_combine(self, out: DispatchOutput) -> None:
        """Runs after the caller filled ``combine_input(out)``, outside the timed region: work a model
        does elsewhere (e.g. the routing weights folded into the expert's output) in a call mode
        that leaves it out of combine. Nothing by default."""

    def prepare_input(self, inp: DispatchInput, num_sms: int) -> DispatchInput:
        """The input to time ``dispatch`` with at ``num_sms``, prepared outside the timed region (once
        per input set of a point; a kernel mode may make its cached layout here).
        A backend whose kernel reads the tokens from its own registered buffer copies them there
        (as the caller fills ``combine_input`` for combine); the default is ``inp`` itself."""
        return inp

    @abstractmethod
    def combine_input(self, out: DispatchOutput) -> torch.Tensor:
        """A writable bf16 [capacity, hidden] tensor the caller fills before combine."""

    @abstractmethod
    def combine(self, out: DispatchOutput, num_sms: int) -> torch.Tensor:
        """Returns bf16 [T, hidden] for the T tokens of the matching dispatch."""


class LowLatencyMode(Backend):
    """A backend of the scenario mode ``low_latency``: ll_dispatch and ll_combine (epbench/contract.py).
    A backend with both modes derives from both classes and lists both in ``modes``."""

    modes: ClassVar[Tuple[str, ...]] = ("low_latency",)

    @abstractmethod
    def ll_dispatch(self, inp: DispatchInput, num_sms: int) -> LowLatencyOutput:
        """Low-latency dispatch (epbench/contract.py)."""

    @abstractmethod
    def ll_combine_input(self, out: LowLatencyOutput) -> torch.Tensor:
        """A writable bf16 [E, C, hidden] tensor the caller fills before ll_combine."""

    @abstractmethod
    def ll_combine(self, out: LowLatencyOutput, num_sms: int) -> torch.Tensor:
        """Returns bf16 [T, hidden] for the T tokens of the matching ll_dispatch."""
