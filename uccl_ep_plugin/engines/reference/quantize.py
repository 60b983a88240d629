"""FP8 (e4m3) casting with one scale per 128 channels, the way the low-latency kernels cast."""

from typing import Tuple

import torch

FP8_MAX = 448.0
AMAX_FLOOR = 1e-4        # keeps all-zero groups finite
CHANNELS_PER_SCALE = 128
SCALES_PER_UE8M0_WORD = 4


def _pow2_ceil_exponent(value: torch.Tensor) -> torch.Tensor:
    """``ceil(log2(value))`` for positive floats, exact (no rounding of the logarithm)."""
    mantissa, exponent = torch.frexp(value)
    return torch.where(mantissa == 0.5, exponent - 1, exponent)


def quantize_fp8(x: torch.Tensor, round_scale: bool) -> Tuple[torch.Tensor, torch.Tensor]:
    """Returns ``(x_fp8 [N, H], scales [N, H/128] float32)`` with ``x ~= x_fp8 * scale`` per group."""
    num_tokens, hidden = x.shape
    groups = x.float().view(num_tokens, hidden // CHANNELS_PER_SCALE, CHANNELS_PER_SCALE)
    amax = groups.abs().amax(dim=-1).clamp(min=AMAX_FLOOR)
    if round_scale:
        exponent = _pow2_ceil_exponent(amax * (1.0 / FP8_MAX))
        one = torch.ones_like(amax)
        scale_inv = torch.ldexp(one, exponent)
        scale = torch.ldexp(one, -exponent)
    else:
        scale_inv = amax * (1.0 / FP8_MAX)
        scale = FP8_MAX / amax
    scaled = (groups * scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX)
    return scaled.view(num_tokens, hidden).to(torch.float8_e4m3fn), scale_inv


def pack_ue8m0(scales: torch.Tensor) -> torch.Tensor:
    """Power-of-two float32 scales ``[N, S]`` -> their exponent bytes, four per int32 (little end first): ``[N, S/4]``."""
    exponent_bytes = (scales.contiguous().view(torch.int32) >> 23) & 0xFF
    words = exponent_bytes.view(scales.size(0), scales.size(1) // SCALES_PER_UE8M0_WORD, SCALES_PER_UE8M0_WORD)
    shifts = torch.arange(SCALES_PER_UE8M0_WORD, device=scales.device, dtype=torch.int32) * 8
    return (words << shifts).sum(dim=-1, dtype=torch.int32)


def unpack_ue8m0(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_ue8m0`: int32 ``[..., S/4]`` -> float32 ``[..., S]``."""
    shifts = torch.arange(SCALES_PER_UE8M0_WORD, device=packed.device, dtype=torch.int32) * 8
    exponent_bytes = (packed.unsqueeze(-1) >> shifts) & 0xFF
    return (exponent_bytes.flatten(-2) << 23).view(torch.float32)


def dequantize_fp8(x_fp8: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``x_fp8 [..., H]`` times its per-128-channel ``scales [..., H/128]`` as float32."""
    values = x_fp8.float()
    return (values.unflatten(-1, (-1, CHANNELS_PER_SCALE)) * scales.unsqueeze(-1)).flatten(-2)
