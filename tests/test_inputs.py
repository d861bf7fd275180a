import pytest
import torch

from epbench import inputs
from epbench.routing import RankRouting

CPU = torch.device("cpu")


def test_tokens_are_deterministic_per_seed_rank_salt():
    a = inputs.make_tokens(32, 256, seed=1, rank=2, salt=3, device=CPU)
    assert a.dtype == torch.bfloat16 and a.shape == (32, 256)
    assert torch.equal(a, inputs.make_tokens(32, 256, 1, 2, 3, CPU))
    for other in ((2, 2, 3), (1, 1, 3), (1, 2, 4)):
        assert not torch.equal(a, inputs.make_tokens(32, 256, *other, CPU))


def test_tokens_are_random_never_zero():
    x = inputs.make_tokens(64, 512, 0, 0, 0, CPU).float()
    assert int((x == 0).sum()) == 0
    assert 0.8 < float(x.std()) < 1.2 and abs(float(x.mean())) < 0.05


def test_fp8_quantize_round_trip():
    x = inputs.make_tokens(8, 384, 0, 0, 0, CPU)
    q, s = inputs.quantize_fp8(x)
    assert q.dtype == torch.float8_e4m3fn and q.shape == (8, 384)
    assert s.dtype == torch.float32 and s.shape == (8, 3)
    assert float(q.float().abs().max()) <= inputs.FP8_MAX
    # the largest element of each 128-block maps to the largest e4m3 value
    assert torch.allclose(q.float().view(8, 3, 128).abs().amax(dim=2), torch.full((8, 3), 448.0))
    back = inputs.dequantize(q, s)
    err = (back - x.float()).abs()
    block_max = x.float().view(8, 3, 128).abs().amax(dim=2, keepdim=True).expand(8, 3, 128)
    # e4m3: 3 mantissa bits -> relative error <= 2^-4; tiny values hit the subnormal floor
    assert bool((err <= 2**-4 * x.float().abs() + 2**-9 * block_max.reshape(8, 384)).all())


def test_dequantize_bf16_is_exact():
    x = inputs.make_tokens(4, 128, 0, 0, 0, CPU)
    assert torch.equal(inputs.dequantize(x, None), x.float())


def test_dispatch_input_by_dtype():
    x = inputs.make_tokens(4, 128, 0, 0, 0, CPU)
    r = RankRouting(torch.tensor([[0, 1]] * 4), torch.full((4, 2), 0.5))
    bf = inputs.dispatch_input(x, r, "bf16", CPU)
    assert bf.x_scales is None and torch.equal(bf.x, x) and bf.num_tokens == 4
    f8 = inputs.dispatch_input(x, r, "fp8", CPU)
    assert f8.x.dtype == torch.float8_e4m3fn and f8.x_scales.shape == (4, 1)
    assert torch.equal(f8.topk_idx, r.topk_idx)


def test_expert_factor_differs_by_rank():
    factors = [inputs.expert_factor(r) for r in range(8)]
    assert len(set(factors)) == 8
    assert min(factors) == 0.25 and max(factors) == 2.0


@pytest.mark.parametrize("rank", [0, 3])
def test_expert_output_scales_the_rows(rank):
    x = inputs.make_tokens(4, 128, 0, 0, 0, CPU)
    y = inputs.expert_output(x, None, rank)
    assert y.dtype == torch.bfloat16
    assert torch.equal(y, (x.float() * inputs.expert_factor(rank)).to(torch.bfloat16))
