from epbench.backends import REGISTRY
from epbench.backends.hybrid_ep import limits_reason


def test_registered_and_limits():
    assert "hybrid-ep" in REGISTRY
    assert "hidden % 512" in limits_reason(7168 + 128, "fp8", "cuda")
    assert limits_reason(7168, "fp8", "cuda") is None
    assert "hidden % 16" in limits_reason(7176, "bf16", "cuda")
    assert limits_reason(7168, "bf16", "cuda") is None
