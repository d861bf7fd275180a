"""Backends by name. Each is imported only when asked for, so a missing optional dependency
(the compiled kernels, DeepEP) costs nothing until someone selects that backend."""

from __future__ import annotations

import importlib
import os
from typing import TYPE_CHECKING, Dict, Optional, Tuple, Type

from epbench.errors import UserError

if TYPE_CHECKING:  # importing base pulls in torch; name checks must stay cheap
    from epbench.backends.base import Backend

REGISTRY: Dict[str, str] = {
    "reference": "epbench.backends.reference:ReferenceBackend",
    "epbench": "epbench.backends.epbench_kernels:EpbenchBackend",
    "deepep": "epbench.backends.deepep:DeepEPBackend",
    "epbench-ll": "epbench.backends.epbench_ll:EpbenchLowLatencyBackend",
    "epbench-hier": "epbench.backends.epbench_hier:EpbenchHierBackend",
    "deepep-v2": "epbench.backends.deepep_v2:DeepEPV2Backend",
    "hybrid-ep": "epbench.backends.hybrid_ep:HybridEPBackend",
    "symm-mem": "epbench.backends.symm_mem:SymmMemBackend",
    "flashinfer": "epbench.backends.flashinfer_a2a:FlashInferBackend",
}
# Tests only: backends that hang or abort on purpose (tests/fault_backends.py), as
# "name=module:Class,..."; never set in normal use.
REGISTRY.update(dict(item.split("=", 1) for item in
                     os.environ.get("EPBENCH_TEST_BACKENDS", "").split(",") if "=" in item))


def backend_class(name: str) -> Type["Backend"]:
    if name not in REGISTRY:
        raise UserError(f"backend {name!r}: unknown (known: {', '.join(REGISTRY)})")
    module, cls = REGISTRY[name].split(":")
    return getattr(importlib.import_module(module), cls)


def load_backend(name: str) -> Tuple[Optional[Type["Backend"]], Optional[str]]:
    """(class, None), or (None, why it cannot be imported here)."""
    try:
        return backend_class(name), None
    except ImportError as e:
        return None, f"cannot import: {e}"
