"""Which Python runs a backend's job. Every DeepEP flavor installs as the package ``deep_ep``, so
one environment holds one flavor. ``make baselines VENV=<venv> DEEPEP_FLAVOR=<flavor>`` builds a
flavor into its own venv and records that venv in a registry (``_baseline_venvs.json`` beside this
package, git-ignored; $EPBENCH_BASELINE_VENVS names another file).
A run that asks for deepep, deepep-v2 and hybrid-ep then starts each backend's job from the venv
that holds its flavor (run and sweep: a job per backend; overlap: a job per flavor, the backends
that need none together: launcher.jobs_by_flavor): torchrun runs that venv's python for the ranks,
with this checkout's epbench first on PYTHONPATH, so every job runs the same epbench whatever the
venv has installed.
meta.json's ``backend_runtime`` records which python ran each backend, and that venv's build stamp.
Where this environment already holds the flavor, or no venv is recorded for it, the job runs
here, and a missing flavor skips its points with the reason, as before.

No torch here: the launcher reads this before any job starts; tools/baselines.py writes it."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import ContextManager, Dict, Optional, Sequence

from epbench import launch, provenance

BACKEND_FLAVOR = {"deepep": "v1", "deepep-v2": "v2", "hybrid-ep": "hybrid-ep"}  # tools/baselines.py FLAVORS
REGISTRY_ENV = "EPBENCH_BASELINE_VENVS"  # another registry file (a shared one, or a test's)
DEFAULT_REGISTRY = Path(__file__).resolve().parent / "_baseline_venvs.json"  # flavor -> the venv's python
CHECKOUT = Path(__file__).resolve().parents[1]  # the folder that holds this epbench package


def flavor_of(backends: Sequence[str]) -> Optional[str]:
    """The one DeepEP flavor a job of ``backends`` needs; None where it needs none (or several,
    which no venv holds at once: the job then runs here)."""
    needed = {BACKEND_FLAVOR[b] for b in backends if b in BACKEND_FLAVOR}
    return needed.pop() if len(needed) == 1 else None


def venv_of(python: str) -> Path:
    """The venv of ``python`` (not resolved: a venv's python links to the base interpreter)."""
    return Path(python).absolute().parent.parent


def stamp_of(python: str) -> Dict[str, object]:
    """The build stamp `make baselines` left in ``python``'s venv ({} where none)."""
    try:
        stamp = json.loads((venv_of(python) / provenance.BASELINES_STAMP).read_text())
    except (OSError, ValueError):
        return {}
    return stamp if isinstance(stamp, dict) else {}


def registry_path() -> Path:
    return Path(os.environ.get(REGISTRY_ENV) or DEFAULT_REGISTRY)


def recorded(registry: Optional[Path] = None) -> Dict[str, str]:
    """flavor -> python of every venv `make baselines` recorded ({} where none, or unreadable)."""
    registry = registry or registry_path()
    try:
        data = json.loads(registry.read_text())
    except (OSError, ValueError):
        return {}
    return {str(k): str(v) for k, v in data.items()} if isinstance(data, dict) else {}


def record(flavor: str, python: str, registry: Optional[Path] = None) -> None:
    """Records ``python`` (its venv just got ``flavor``) for later runs; raises OSError."""
    registry = registry or registry_path()
    data = recorded(registry)
    data[flavor] = str(Path(python).absolute())
    registry.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")


def job_python(backends: Sequence[str], registry: Optional[Path] = None) -> Optional[str]:
    """The python to run a job of ``backends`` with, where it is not this one: the recorded venv
    of the flavor the job needs, if this environment holds another flavor (or none) and that
    venv's stamp still says the flavor."""
    need = flavor_of(backends)
    if need is None or provenance.baselines_build().get("flavor") == need:
        return None
    python = recorded(registry).get(need)
    if not python or not os.access(python, os.X_OK) or stamp_of(python).get("flavor") != need:
        return None
    return None if venv_of(python) == Path(sys.prefix).absolute() else python


def job_environment(python: Optional[str]) -> ContextManager[Dict[str, str]]:
    """While a job runs from another venv's ``python``: this checkout first on PYTHONPATH (which
    torchrun's workers inherit); nothing otherwise. The launcher's environment is restored after."""
    extra: Dict[str, str] = {}
    if python is not None:
        extra["PYTHONPATH"] = os.pathsep.join(p for p in (str(CHECKOUT), os.environ.get("PYTHONPATH")) if p)
    return launch.environment(extra)
