"""The software bf16 and fp8 e4m3 conversions of csrc/common/portability.h (what the kernels use on AMD GPUs, where
ROCm has no conversion instructions for them) give torch's bits: round to nearest even over every binade, the
subnormals, ties and the edges of the range; fp8 saturates at +-448 as CUDA's __NV_SATFINITE does."""

import math

import pytest
import torch

from uccl_ep_plugin import _C


def _values(seed: int, count: int, low_exp: int, high_exp: int) -> torch.Tensor:
    """Random floats of both signs spread over the binades 2^low_exp .. 2^high_exp."""
    generator = torch.Generator().manual_seed(seed)
    mantissa = torch.rand(count, generator=generator) + 1.0
    exponent = torch.randint(low_exp, high_exp + 1, (count,), generator=generator).float()
    sign = torch.where(torch.rand(count, generator=generator) < 0.5, -1.0, 1.0)
    return sign * mantissa * torch.pow(2.0, exponent)


def _fp8_ties() -> torch.Tensor:
    """Values halfway between neighbouring e4m3 numbers (normal and subnormal), and the numbers themselves."""
    codes = torch.arange(0, 0x7F, dtype=torch.uint8)
    grid = codes.view(torch.float8_e4m3fn).float()
    halfway = (grid[:-1] + grid[1:]) / 2
    return torch.cat([grid, halfway, -grid, -halfway])


def _fp8_bits(values: torch.Tensor) -> list:
    return _C.float_to_fp8_e4m3_bits(values.tolist())


def test_fp8_e4m3_matches_torch_within_the_range():
    values = torch.cat([_values(1, 20000, -12, 8), _fp8_ties(), torch.tensor([0.0, -0.0, 448.0, -448.0, 2.0 ** -9,
                                                                             2.0 ** -10, 2.0 ** -6])])
    values = values[values.abs() <= 448]
    want = values.to(torch.float8_e4m3fn).view(torch.uint8).tolist()
    got = _fp8_bits(values)
    wrong = [(v, g, w) for v, g, w in zip(values.tolist(), got, want) if g != w]
    assert not wrong, f"{len(wrong)} of {len(want)} values differ, e.g. (value, ours, torch's) {wrong[:5]}"


def test_fp8_e4m3_saturates_and_keeps_nan():
    assert _fp8_bits(torch.tensor([449.0, 465.0, 1e6, math.inf])) == [0x7E] * 4
    assert _fp8_bits(torch.tensor([-449.0, -1e6, -math.inf])) == [0xFE] * 3
    assert _fp8_bits(torch.tensor([math.nan])) == [0x7F]


@pytest.mark.parametrize("low_exp,high_exp", [(-140, -120), (-30, 30), (100, 127)],
                         ids=["subnormal-and-small", "middle", "large"])
def test_bf16_matches_torch(low_exp, high_exp):
    values = _values(2, 20000, low_exp, high_exp)
    ties = (values.view(torch.int32) & ~0xFFFF | 0x8000).view(torch.float32)   # exactly halfway between two bf16s
    values = torch.cat([values, ties, torch.tensor([0.0, -0.0, math.inf, -math.inf, 3.3895314e38])])
    want = values.to(torch.bfloat16).view(torch.int16).tolist()
    got = [b - 0x10000 if b >= 0x8000 else b for b in _C.float_to_bf16_bits(values.tolist())]
    wrong = [(v, g, w) for v, g, w in zip(values.tolist(), got, want) if g != w]
    assert not wrong, f"{len(wrong)} of {len(want)} values differ, e.g. (value, ours, torch's) {wrong[:5]}"
    assert _C.float_to_bf16_bits([math.nan]) == [0x7FC0]
