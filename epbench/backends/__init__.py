"""Backends by name. Each is imported only when asked for, so a missing optional dependency
(the compiled kernels, DeepEP) costs nothing until someone selects that backend."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Optional, Tuple, Type

from epbench.errors import UserError

if TYPE_CHECKING:  # importing base pulls in torch; name checks must stay cheap
    from epbench.backends.base import Backend

from epbench.backend_names import REGISTRY  # noqa: F401 (the registry is looked up here too)


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
