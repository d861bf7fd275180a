"""The reference MXFP8 quantizer (epbench/mxfp8.py) on known vectors, its error bound, its wire
packing, and the scenario rules for mxfp8."""

import pytest
import torch

from epbench import mxfp8, scenario
from epbench.errors import UserError
from epbench.inputs import make_tokens
from support import scenario_dict

CPU = torch.device("cpu")


def block(*head, fill=0.0):
    """One bf16 row of one 32-element block: ``head`` then ``fill``."""
    vals = list(head) + [fill] * (32 - len(head))
    return torch.tensor([vals], dtype=torch.bfloat16)


def q_of(x):
    q, s = mxfp8.quantize(x)
    return q.float()[0], int(s[0, 0])


def test_zeros_get_the_smallest_scale_and_zero_elements():
    q, s = q_of(block())
    assert s == 0 and bool((q == 0).all())
    assert bool((mxfp8.dequantize(*mxfp8.quantize(block())) == 0).all())


@pytest.mark.parametrize("k", [-100, -10, -1, 0, 1, 8, 20, 100])
def test_powers_of_two_are_exact(k):
    x = block(2.0**k, -(2.0**(k - 3)), 2.0**(k - 1))
    q, s = q_of(x)
    assert s == 127 + k - 8  # amax 2^k -> 256 * 2^(k - 8)
    assert q[0] == 256 and q[1] == -32 and q[2] == 128
    assert torch.equal(mxfp8.dequantize(*mxfp8.quantize(x)), x.float())


def test_scale_is_rounded_up_so_nothing_saturates():
    # amax 448 = 1.75 * 2^8 -> scale 2^0, 448 exactly; 450 = 1.7578 * 2^8 -> scale 2^1 (225 -> 224);
    # the OCP floor rule would give 2^0 and clip 450 to 448
    assert q_of(block(448.0))[1] == 127 and q_of(block(448.0))[0][0] == 448
    q, s = q_of(block(450.0, 3.0))
    assert s == 128 and q[0] == 224 and q[1] == 1.5
    for amax in (1.0, 1.5, 1.75, 1.78125, 3.0e38, -7.0e-30):
        q, s = mxfp8.quantize(block(amax))
        assert float(q.float().abs().max()) <= mxfp8.E4M3_MAX
        v = abs(float(block(amax)[0, 0]))
        e = int(s[0, 0]) - 127
        assert v / 2.0**e <= 448 < v / 2.0**(e - 1)  # the smallest such power of two


def test_round_to_nearest_even_on_ties():
    # scale 2^0 (amax 256): e4m3 spacing is 0.125 in [1, 2), 2^-9 below 2^-6 (subnormals)
    q, s = q_of(block(256.0, 1.0625, 1.1875, -1.0625, 1.3125, 2.0**-10, 3 * 2.0**-10, 2.0**-11))
    assert s == 127
    assert q[1:5].tolist() == [1.0, 1.25, -1.0, 1.25]
    assert q[5:8].tolist() == [0.0, 2.0**-8, 0.0]  # ties to the even subnormal, then underflow


def test_subnormal_inputs_and_negative_values():
    tiny = 2.0**-133  # a bf16 subnormal
    q, s = q_of(block(tiny, -tiny))
    assert s == 0  # scale 2^-127: tiny / 2^-127 = 2^-6, the smallest e4m3 normal
    assert q[0] == 2.0**-6 and q[1] == -(2.0**-6)
    q, s = q_of(block(-3.0, 2.0))
    assert q[0] == -384 and q[1] == 256  # amax from |x|: -3 sets the scale


def test_non_finite_blocks_are_nan():
    x = torch.cat([block(float("inf"), 1.0), block(float("nan")), block(1.0)], dim=1)
    q, s = mxfp8.quantize(x)
    assert s[0].tolist()[:2] == [mxfp8.SCALE_NAN] * 2
    assert bool((q.view(torch.uint8)[0, :64] == mxfp8.ELEMENT_NAN).all())
    d = mxfp8.dequantize(q, s)
    assert bool(d[0, :64].isnan().all()) and not bool(d[0, 64:].isnan().any())


def test_round_trip_within_the_format_bound():
    for scale in (1.0, 1e-3, 1e4):
        x = (make_tokens(16, 256, 0, 0, 0, CPU).float() * scale).to(torch.bfloat16)
        x[3, :32] *= 1e-6  # a block far below the others
        q, s = mxfp8.quantize(x)
        assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.uint8 and s.shape == (16, 8)
        err = (mxfp8.dequantize(q, s) - x.float()).abs()
        assert bool((err <= mxfp8.error_bound(x, s)).all())
        rel = err.sum() / x.float().abs().sum()
        assert 0 < float(rel) < 2.0**-4


def test_the_bound_catches_a_wrong_scale():
    x = make_tokens(4, 64, 0, 0, 1, CPU)
    q, s = mxfp8.quantize(x)
    err = (mxfp8.dequantize(q, s + 1) - x.float()).abs()
    assert not bool((err <= mxfp8.error_bound(x, s)).all())


def test_wire_rows_pack_elements_then_scales():
    x = make_tokens(5, 96, 0, 0, 2, CPU)
    q, s = mxfp8.quantize(x)
    rows = mxfp8.pack_rows(q, s)
    assert rows.dtype == torch.uint8 and rows.shape == (5, 96 + 3)
    q2, s2 = mxfp8.unpack_rows(rows, 96)
    assert torch.equal(q2.view(torch.uint8), q.view(torch.uint8)) and torch.equal(s2, s)
    with pytest.raises(ValueError):
        mxfp8.unpack_rows(rows, 64)
    with pytest.raises(ValueError):
        mxfp8.quantize(x.float())


def test_scenario_accepts_mxfp8_and_rejects_hidden_not_multiple_of_32():
    ok = scenario.parse(scenario_dict(model={"hidden": 96, "dispatch_dtype": "mxfp8", "quantize": "fused"}))
    assert ok.model.dispatch_dtype == "mxfp8" and ok.model.quantize == "fused"
    with pytest.raises(UserError, match="model.hidden: must be a multiple of 32 for mxfp8"):
        scenario.parse(scenario_dict(model={"hidden": 200, "dispatch_dtype": "mxfp8"}))


@pytest.mark.parametrize("model,mode,needle", [
    ({"quantize": "fused"}, "normal", "model.quantize: fused needs a quantized dispatch_dtype"),
    ({"quantize": "later"}, "normal", "model.quantize: must be one of before, fused"),
    ({"dispatch_dtype": "mxfp8"}, "low_latency", "model.dispatch_dtype: mxfp8 is not implemented in low_latency"),
    ({"dispatch_dtype": "fp8", "quantize": "fused"}, "low_latency", "model.quantize: fused is not implemented"),
])
def test_scenario_quantize_rules(model, mode, needle):
    with pytest.raises(UserError, match=needle):
        scenario.parse(scenario_dict(model=model, mode=mode))
