"""Numerics of the 10-bit LogFMT combine payload, emulated in float32.

Per 128-channel group of a bf16 row: if every magnitude is below 1 and the group is not
constant, each magnitude is stored as a 9-bit index on a log scale between the group's
smallest (clipped to 2^-32 of the largest) and largest magnitude, plus a sign bit; index 0
means zero. Other groups travel as bf16 unchanged.
"""

import torch

CHANNELS_PER_GROUP = 128
NUM_LEVELS = 1 << 9           # 9 magnitude bits
MIN_CLIP_LOG2 = 32.0          # smallest magnitude kept: max * 2^-32


def logfmt_roundtrip(x: torch.Tensor) -> torch.Tensor:
    """Encode then decode ``x`` (bf16 ``[..., H]``, H a multiple of 128); returns float32."""
    values = x.float().unflatten(-1, (-1, CHANNELS_PER_GROUP))
    magnitude = values.abs()
    log_max = torch.log2(magnitude.amax(dim=-1, keepdim=True))
    log_min = torch.maximum(torch.log2(magnitude.amin(dim=-1, keepdim=True)), log_max - MIN_CLIP_LOG2)
    cast = (log_max < 0) & (log_min < log_max)
    step = torch.where(cast, (log_max - log_min) / (NUM_LEVELS - 2), torch.ones_like(log_max))
    # Round to nearest in the linear domain: the cut between two levels sits at their arithmetic mean.
    rounding = 2.0 - torch.log2((1.0 + torch.exp2(step)) * 0.5) / step
    level = torch.floor(torch.clamp(torch.log2(magnitude) / step + (rounding - log_min / step), min=0))
    level = torch.clamp(level, max=NUM_LEVELS - 1)
    decoded = torch.where(level == 0, torch.zeros_like(level), torch.exp2((level - 1) * step + log_min))
    decoded = torch.copysign(decoded, values)
    return torch.where(cast, decoded, values).flatten(-2)
