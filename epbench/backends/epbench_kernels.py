"""The ``epbench`` backend: epbench's own intranode dispatch/combine kernels (csrc/).

One device region per rank holds every buffer (sized for the worst case: all tokens of all
ranks routed to one rank); it is exported with one CUDA IPC handle, the handles are swapped
with ``all_gather_object`` and every peer's region is mapped once, in the constructor.
``dispatch`` launches the notify kernel (count exchange, slots, and the barrier that makes
buffer reuse safe) and the dispatch kernel; ``combine`` launches the pull-and-reduce kernel.
Nothing is allocated and nothing waits on the host inside either call; ``num_recv`` and
``expert_counts`` stay on the device.

Tuning knobs other than the SM count are constructor arguments, with the environment as the
default (values chosen by measurement, notes/KERNELS.md):
  EPBENCH_DISPATCH_IMPL   lean | lean-dyn | ownbulk | pull | split | owntma | spreadtma | spread | dmaj | dmaj-norot | reg |
                          pipe | tma  (register paths or TMA bulk-copy path; dmaj: destination-major, v7; spread:
                          (token, destination) pairs, v9; owntma / spreadtma: lean / spread for the remote rows, a
                          TMA ring for the own-rank rows, v10-v11; all slower than lean, notes/KERNELS.md; lean-dyn:
                          lean with tokens handed to warps by a counter, v12; v13, both slower than lean-dyn:
                          ownbulk: own-rank rows by bulk stores from shared memory; pull: receivers bulk-copy their
                          rows from the sources' registered ``dispatch_x``, which ``prepare_input`` fills untimed;
                          v14 split: lean-dyn for the remote rows, the own-rank rows by EPBENCH_SPLIT_OWN_WARPS
                          separate warps of each block)
  EPBENCH_OWN_COPY        off | side | side-in  (v9, lean / spread only: rows to my own rank copied by a
                          side-stream kernel of EPBENCH_OWN_BLOCKS blocks, outside num_sms (side) or taken from it
                          (side-in); off = the data kernel writes them, as before)
  EPBENCH_OWN_BLOCKS      blocks of that side kernel
  EPBENCH_SPLIT_OWN_WARPS warps per block that copy the own-rank rows in the split dispatch (1..31, default 4)
  EPBENCH_DISPATCH_WARPS  warps per dispatch block (1..32)
  EPBENCH_TMA_STAGES      row buffers per warp in the TMA path
  EPBENCH_COMBINE_WARPS   warps per combine block (1..16; tma: at most as many as the stages fit in shared memory;
                          0 = by SM count: pull 16, tma clamp(128 / num_sms, 8, 16), v12)
  EPBENCH_COMBINE_IMPL    tma | pull  (bulk-copy loads into per-warp shared-memory stages, v11-v12; or register
                          loads from the holders, v1)
  EPBENCH_COMBINE_STAGES  stages per warp of the tma combine (2..4)
  EPBENCH_COMBINE_CHUNK   bytes per holder and stage of the tma combine (1024 | 2048 | 4096; v12)
  EPBENCH_EXCLUSIVE_SMS   1: the lean dispatch and pull combine kernels reserve over half an SM's shared memory,
                          so that no two of their blocks share an SM (v12; measured: blocks never shared an SM
                          without it either)
  EPBENCH_NOTIFY_IMPL     staged | direct | grid (layout kernel variant: v4 one block; v1-v3; v12 the
                          staged kernel on up to num_sms blocks)
Debug only: ``set_debug_stamps(True)`` makes the kernels store %globaltimer per phase, read with
``debug_stamps()`` after a synchronize (cuda_lib.STAMPS names them); off by default.
"""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass
from typing import Any, Dict, Optional, Sequence, Union

import torch

from epbench import cuda_lib
from epbench.backends.base import Backend, DispatchInput, DispatchOutput, RankSetup
from epbench.backends.kernel_common import poison_dispatch_outputs, raw_stream_getter, release_collective

# Chosen by measurement (notes/KERNELS.md): v1-v3: pipe, reg:32 and tma:2:6 were within 1-2% of reg:16
# for bf16 and tma was worse for fp8; v5: lean (reg with every per-token load issued first) was faster
# than reg at all 8 measured points, by 0.3-1.2%. v12: the grid notify was faster than staged at 8-32 SMs
# (-14 to -38 us per dispatch); the tma combine with 2 KiB chunks x 2 stages (12 warps fit) beat pull at
# 8 SMs (h200x4 637 vs ~708 us, dsv3 520 vs 578) and matched it at 16-32 SMs with 8 warps per block;
# lean-dyn (tokens handed out by a counter) beat lean at 16 and 24 SMs by 5-10 us (blocks on different SMs
# move data at different rates: at 32 SMs the first static block finished after ~360 us, the last ~576) and
# was within 1% elsewhere.
DEFAULTS: Dict[str, Any] = {
    "dispatch_impl": "lean-dyn",
    "dispatch_warps": 16,
    "tma_stages": 3,
    "combine_warps": 0,
    "combine_impl": "tma",
    "combine_stages": 2,
    "combine_chunk": 2048,
    "exclusive_sms": 0,
    "notify_impl": "grid",
    "own_copy": "off",
    "own_blocks": 2,
    "split_own_warps": 4,
}
MAX_WORLD = 8
MAX_TOPK = 32
NOTIFY_SMEM_BYTES = 227 * 1024


def _knob(name: str, given: Optional[Any]) -> Any:
    if given is not None:
        return given
    env = os.environ.get(f"EPBENCH_{name.upper()}")
    if env is None:
        return DEFAULTS[name]
    return env if isinstance(DEFAULTS[name], str) else int(env)


class _Option:
    """A backend knob that lives in the C context (ep_set_option): assigning validates the value (a name of
    ``allowed`` when it is a dict of name -> code, else one of the allowed ints), passes it to the library
    and keeps it for reading back."""

    def __init__(self, key: int, allowed: Union[Dict[str, int], Sequence[int]]) -> None:
        self.key, self.allowed = key, allowed

    def __set_name__(self, owner: type, name: str) -> None:
        self.name, self.slot = name, "_opt_" + name

    def __get__(self, obj: Any, objtype: Optional[type] = None) -> Any:
        return self if obj is None else getattr(obj, self.slot)

    def __set__(self, obj: Any, value: Any) -> None:
        named = isinstance(self.allowed, dict)
        if not named:
            value = int(value)
        if value not in self.allowed:
            raise ValueError(f"{self.name} must be one of {list(self.allowed)}, got {value!r}")
        code = self.allowed[value] if named else value
        cuda_lib.check(obj._lib.ep_set_option(obj._ctx, self.key, code), "ep_set_option")
        setattr(obj, self.slot, value)


@dataclass
class _Handle:
    """What combine needs from the matching dispatch (the layout itself stays on the device)."""

    num_tokens: int
    topk_idx: torch.Tensor
    topk_weights: torch.Tensor
    epoch: int
    out: torch.Tensor  # rows [0, T) of the combine output buffer


def intranode_reason(setup: RankSetup) -> Optional[str]:
    """Why epbench's intranode kernels (normal or low-latency) cannot run for ``setup``, or None."""
    if setup.device.type != "cuda" or not torch.cuda.is_available():
        return "needs CUDA GPUs"
    if setup.world > MAX_WORLD:
        return f"intranode kernels handle at most {MAX_WORLD} ranks (world {setup.world})"
    if setup.world > setup.gpus_per_node:
        return "intranode only: every rank must be in one NVLink domain (nodes > 1)"
    if torch.cuda.get_device_capability(setup.device)[0] < 9:
        return "needs compute capability 9.0 or newer (kernels are built for sm_90)"
    if setup.topk > MAX_TOPK:
        return f"topk {setup.topk} > {MAX_TOPK}"
    multiple = 128 if setup.dispatch_dtype == "fp8" else 8
    if setup.hidden % multiple:
        return f"hidden {setup.hidden} must be a multiple of {multiple}"
    try:
        cuda_lib.load()
    except RuntimeError as e:
        return str(e)
    return None


class EpbenchBackend(Backend):
    name = "epbench"
    uses_sms = True

    @classmethod
    def unavailable_reason(cls, setup: RankSetup) -> Optional[str]:
        if setup.num_experts * 4 > NOTIFY_SMEM_BYTES:
            return intranode_reason(setup) or \
                f"{setup.num_experts} experts exceed the notify kernel's shared memory"
        return intranode_reason(setup)

    def __init__(self, setup: RankSetup, *, dispatch_impl: Optional[str] = None,
                 dispatch_warps: Optional[int] = None, tma_stages: Optional[int] = None,
                 combine_warps: Optional[int] = None, notify_impl: Optional[str] = None,
                 own_copy: Optional[str] = None, own_blocks: Optional[int] = None,
                 combine_impl: Optional[str] = None, combine_stages: Optional[int] = None,
                 combine_chunk: Optional[int] = None, exclusive_sms: Optional[int] = None,
                 split_own_warps: Optional[int] = None) -> None:
        reason = self.unavailable_reason(setup)
        if reason:
            raise RuntimeError(f"epbench backend unavailable: {reason}")
        self.s = setup
        self.dispatch_impl = _knob("dispatch_impl", dispatch_impl)
        self.dispatch_warps = _knob("dispatch_warps", dispatch_warps)
        self.tma_stages = _knob("tma_stages", tma_stages)
        self.combine_warps = _knob("combine_warps", combine_warps)
        if not 0 <= self.combine_warps <= 16:
            raise ValueError(f"combine_warps must be 0 (by SM count) or 1..16, got {self.combine_warps!r}")
        self._lib = cuda_lib.load()
        self.device = torch.device("cuda", setup.device.index if setup.device.index is not None
                                   else torch.cuda.current_device())
        self.fp8 = setup.dispatch_dtype == "fp8"
        cfg = cuda_lib.EpConfig(setup.rank, setup.world, self.device.index, setup.hidden,
                                setup.max_tokens_per_rank, setup.topk, setup.experts_per_rank,
                                int(self.fp8), float(setup.timeout_s))
        self._ctx = ctypes.c_void_p()
        cuda_lib.check(self._lib.ep_create(ctypes.byref(cfg), ctypes.byref(self._ctx)), "ep_create")
        self._open_peers()
        self._views()
        self.notify_impl = _knob("notify_impl", notify_impl)
        self.combine_impl = _knob("combine_impl", combine_impl)
        self.combine_stages = _knob("combine_stages", combine_stages)
        self.combine_chunk = _knob("combine_chunk", combine_chunk)
        self.exclusive_sms = _knob("exclusive_sms", exclusive_sms)
        self.split_own_warps = _knob("split_own_warps", split_own_warps)
        self._own_blocks = _knob("own_blocks", own_blocks)
        self.own_copy = _knob("own_copy", own_copy)
        # The timeout record's flag word, read without a function call on every dispatch/combine.
        self._timed_out = ctypes.c_int.from_address(self._lib.ep_error_flag_ptr(self._ctx))
        self._stream = raw_stream_getter(self.device)
        self._x_dtype = torch.float8_e4m3fn if self.fp8 else torch.bfloat16
        self._dispatch_epoch = 0
        self._combine_epoch = 0
        self._checked: Optional[tuple] = None  # tensors of the last input that passed _check_input
        self._out_ptr = self.out.data_ptr()
        self._out_t, self._out_view = setup.max_tokens_per_rank, self.out

    # ---- set-up ----
    def _open_peers(self) -> None:
        cuda_lib.open_peers(self._lib, self._ctx, self.s.world)

    def _region(self, which: int) -> torch.Tensor:
        return cuda_lib.region_tensor(self._lib.ep_region, self._ctx, which, self.device)

    def _views(self) -> None:
        s = self.s
        cap, h, k = s.world * s.max_tokens_per_rank, s.hidden, s.topk
        x_dtype = torch.float8_e4m3fn if self.fp8 else torch.bfloat16
        self.recv_x = self._region(cuda_lib.RECV_X).view(x_dtype).view(cap, h)
        self.recv_scales = (self._region(cuda_lib.RECV_SCALES).view(torch.float32).view(cap, h // 128)
                            if self.fp8 else None)
        self.recv_idx = self._region(cuda_lib.RECV_IDX).view(torch.int64).view(cap, k)
        self.recv_w = self._region(cuda_lib.RECV_W).view(torch.float32).view(cap, k)
        self.combine_in = self._region(cuda_lib.COMBINE_IN).view(torch.bfloat16).view(cap, h)
        self.out = self._region(cuda_lib.OUT).view(torch.bfloat16).view(s.max_tokens_per_rank, h)
        self.num_recv = self._region(cuda_lib.NUM_RECV).view(torch.int64).view(())
        self.expert_counts = self._region(cuda_lib.EXPERT_COUNTS).view(torch.int64)
        self.dispatch_x = self._region(cuda_lib.DISPATCH_X).view(x_dtype).view(s.max_tokens_per_rank, h)

    def prepare_input(self, inp: DispatchInput) -> DispatchInput:
        """pull reads the tokens from peers' registered dispatch_x: put them there (untimed, like the
        combine input); the other kernels read x where it is."""
        if self._impl != "pull" or inp.x.data_ptr() == self.dispatch_x.data_ptr():
            return inp
        t = inp.x.shape[0]
        self.dispatch_x[:t].copy_(inp.x)
        return DispatchInput(self.dispatch_x[:t], inp.x_scales, inp.topk_idx, inp.topk_weights)

    # ---- the two operations ----
    # Both run on the host while the GPU may already wait for them (the timed region starts at
    # the previous event), so they do as little Python as possible: measured 35 us per call in v1.
    @property
    def dispatch_impl(self) -> str:
        return self._impl

    @dispatch_impl.setter
    def dispatch_impl(self, value: str) -> None:
        if value not in cuda_lib.DISPATCH_IMPLS:
            raise ValueError(f"dispatch_impl must be one of {list(cuda_lib.DISPATCH_IMPLS)}, got {value!r}")
        self._impl = value
        self._impl_code = cuda_lib.DISPATCH_IMPLS[value]

    # Knobs set with ep_set_option (one descriptor each, see _Option).
    notify_impl = _Option(cuda_lib.OPT_NOTIFY_IMPL, cuda_lib.NOTIFY_IMPLS)
    combine_impl = _Option(cuda_lib.OPT_COMBINE_IMPL, cuda_lib.COMBINE_IMPLS)
    combine_stages = _Option(cuda_lib.OPT_COMBINE_STAGES, (2, 3, 4))
    combine_chunk = _Option(cuda_lib.OPT_COMBINE_CHUNK, cuda_lib.COMBINE_CHUNKS)
    exclusive_sms = _Option(cuda_lib.OPT_EXCLUSIVE_SMS, (0, 1))
    split_own_warps = _Option(cuda_lib.OPT_SPLIT_OWN_WARPS, range(1, 32))

    @property
    def own_copy(self) -> str:
        return self._own

    @own_copy.setter
    def own_copy(self, value: str) -> None:
        if value not in cuda_lib.OWN_COPY_MODES:
            raise ValueError(f"own_copy must be one of {list(cuda_lib.OWN_COPY_MODES)}, got {value!r}")
        cuda_lib.check(self._lib.ep_set_own_copy(self._ctx, cuda_lib.OWN_COPY_MODES[value], int(self._own_blocks)),
                       "ep_set_own_copy")
        self._own = value

    @property
    def own_blocks(self) -> int:
        return self._own_blocks

    @own_blocks.setter
    def own_blocks(self, value: int) -> None:
        cuda_lib.check(self._lib.ep_set_own_copy(self._ctx, cuda_lib.OWN_COPY_MODES[self._own], int(value)),
                       "ep_set_own_copy")
        self._own_blocks = int(value)

    def set_debug_stamps(self, on: bool) -> None:
        """Debug aid: per-phase %globaltimer stamps of the next calls (costs a few stores)."""
        cuda_lib.check(self._lib.ep_set_option(self._ctx, cuda_lib.OPT_DEBUG_STAMPS, int(on)), "ep_set_option")

    def debug_stamps(self) -> Dict[str, int]:
        """The stamps of the last call (ns, this GPU's %globaltimer); synchronize first."""
        raw = self._region(cuda_lib.DEBUG_STAMPS).view(torch.int64).cpu().tolist()
        return dict(zip(cuda_lib.STAMPS, raw))

    def _check_input(self, inp: DispatchInput) -> None:
        cuda_lib.check_dispatch_input(inp, self.s, self._x_dtype, self.fp8)

    def dispatch(self, inp: DispatchInput, num_sms: int) -> DispatchOutput:
        x, idx, w = inp.x, inp.topk_idx, inp.topk_weights
        c = self._checked
        if c is None or c[0] is not x or c[1] is not idx or c[2] is not w or c[3] is not inp.x_scales:
            self._check_input(inp)
            self._checked = (x, idx, w, inp.x_scales)
        t = x.shape[0]
        if t != self._out_t:
            self._out_t, self._out_view = t, self.out[:t]
        if self._own != "off" and self._impl not in ("lean", "spread"):
            raise ValueError(f"own_copy={self._own!r} needs dispatch_impl lean or spread (got {self._impl!r}; "
                             "the other kernels write the own-rank rows themselves)")
        x_ptr = x.data_ptr()
        if self._impl == "pull":  # the kernel reads peers' dispatch_x: every rank passes its region, even for 0 rows
            self.prepare_input(inp)  # a no-op when prepared; else copied here, inside the call (correct, slower)
            x_ptr = self.dispatch_x.data_ptr()
        self._dispatch_epoch += 1
        rc = self._lib.ep_dispatch(
            self._ctx, x_ptr, inp.x_scales.data_ptr() if self.fp8 else None, idx.data_ptr(),
            w.data_ptr(), t, num_sms, self._impl_code, self.dispatch_warps, self.tma_stages,
            self._dispatch_epoch, self._stream())
        if rc:
            cuda_lib.check(rc, "dispatch")
        if self._timed_out.value:
            self._raise_if_timed_out()
        handle = _Handle(t, idx, w, self._dispatch_epoch, self._out_view)
        return DispatchOutput(self.recv_x, self.recv_scales, self.recv_idx, self.recv_w,
                              self.expert_counts, self.num_recv, handle)

    def _combine_warps_for(self, num_sms: int) -> int:
        """combine_warps, or with 0 the measured rule (notes/KERNELS.md v12): the tma combine is bound by
        its warps' own reductions at 8 SMs (12 warps fit: fastest) and by the fabric from 16 SMs on, where
        more than ~128 warps in the grid only adds load traffic (16 warps at 32 SMs: +3%)."""
        if self.combine_warps:
            return self.combine_warps
        if self.combine_impl != "tma":
            return 16
        return max(8, min(16, 128 // max(1, num_sms)))

    def combine_input(self, out: DispatchOutput) -> torch.Tensor:
        return self.combine_in

    def combine(self, out: DispatchOutput, num_sms: int) -> torch.Tensor:
        h: _Handle = out.handle
        if h.epoch != self._dispatch_epoch:
            raise RuntimeError("epbench combine must follow its own dispatch (another dispatch ran since)")
        self._combine_epoch += 1
        rc = self._lib.ep_combine(self._ctx, self._out_ptr, h.topk_idx.data_ptr(), h.topk_weights.data_ptr(),
                                  h.num_tokens, num_sms, self._combine_warps_for(num_sms), self._combine_epoch,
                                  self._stream())
        if rc:
            cuda_lib.check(rc, "combine")
        if self._timed_out.value:
            self._raise_if_timed_out()
        return h.out

    # ---- errors, poison, release ----
    def _raise_if_timed_out(self) -> None:
        cuda_lib.raise_if_timed_out(self._lib, self._ctx, self.s.timeout_s)

    def check_errors(self) -> None:
        """Waits for this rank's queued kernels, then raises if any of them timed out on a peer."""
        torch.cuda.synchronize(self.device)
        self._raise_if_timed_out()

    def poison(self) -> None:
        poison_dispatch_outputs(self)

    def close(self) -> None:
        """Collective: every rank must call it (peers may still write into this rank's region)."""
        if self._ctx:
            release_collective(self.device, self.s.world,
                               lambda: cuda_lib.check(self._lib.ep_destroy(self._ctx), "ep_destroy"))
            self._ctx = ctypes.c_void_p()
