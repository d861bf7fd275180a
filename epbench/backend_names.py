"""The backends' names and where each lives (module:Class), with no import of any of them: the
scenario checks names against it without torch, and epbench/backends imports a backend only when
it is asked for."""

from __future__ import annotations

from typing import Dict

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
