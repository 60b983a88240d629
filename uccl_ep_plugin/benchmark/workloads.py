"""The benchmark workloads (DeepSeek-V3-like) and DeepEP's byte-counting formulas."""

from dataclasses import dataclass

import torch

FP8_BYTES_PER_ELEMENT = 1 + 4 / 128       # an fp8 element plus its share of one float scale per 128


@dataclass(frozen=True)
class Workload:
    mode: str           # "normal" or "low_latency"
    tokens: int         # tokens per rank (for low-latency: also num_max_dispatch_tokens_per_rank)
    hidden: int
    topk: int
    experts: int


def routing(workload: Workload, rank: int, seed: int, drop_entries: int = 0):
    """Random tokens and top-k routing for one rank; ``drop_entries`` top-k slots become -1."""
    generator = torch.Generator().manual_seed(seed * 1000003 + rank)
    x = torch.randn((workload.tokens, workload.hidden), generator=generator).to(torch.bfloat16)
    scores = torch.rand((workload.tokens, workload.experts), generator=generator) + 1e-3
    topk_idx = torch.topk(scores, workload.topk, dim=-1, sorted=False).indices
    topk_weights = torch.rand((workload.tokens, workload.topk), generator=generator) + 0.1
    for _ in range(min(drop_entries, workload.tokens * workload.topk)):
        t = int(torch.randint(workload.tokens, (1,), generator=generator))
        k = int(torch.randint(workload.topk, (1,), generator=generator))
        topk_idx[t, k] = -1
    return x, topk_idx, topk_weights


def per_token_fp8(x: torch.Tensor):
    """``x`` as DeepEP's fp8 dispatch takes it: e4m3 values and one float scale per 128 channels of a row."""
    groups = x.float().view(x.size(0), -1, 128)
    scales = groups.abs().amax(-1).clamp(min=1e-4) / 448.0
    return (groups / scales.unsqueeze(-1)).view_as(x).to(torch.float8_e4m3fn), scales


def normal_bytes(num_recv_rows: int, hidden: int, dtype: str) -> float:
    """Bytes of the rows a rank receives (dispatch) or sends back (combine); fp8 counts its scales."""
    per_element = FP8_BYTES_PER_ELEMENT if dtype == "fp8" else 2
    return num_recv_rows * hidden * per_element


def low_latency_bytes(num_selections: int, hidden: int, op: str, dtype: str) -> float:
    """Bytes per selected (token, expert) a rank sends: fp8 rows with scales and a 16-byte header, bf16 rows."""
    if op == "dispatch":
        row = hidden + hidden // 128 * 4 + 16 if dtype == "fp8" else 2 * hidden + 16
        return num_selections * row
    return num_selections * 2 * hidden
