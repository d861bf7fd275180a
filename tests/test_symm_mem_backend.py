from epbench.backends import REGISTRY
from epbench.backends.symm_mem import limits_reason


def test_registered_and_limits():
    assert "symm-mem" in REGISTRY
    assert "world > 1" in limits_reason(1, True, "cuda")
    assert "NVSHMEM" in limits_reason(2, False, "cuda")
    assert limits_reason(2, True, "cpu") == "needs CUDA GPUs"
    assert limits_reason(2, True, "cuda") is None
