"""Routing tables in plain PyTorch: which tokens go to which rank, and DeepEP's channel bookkeeping."""

from typing import Optional, Tuple

import torch

from ...hosts import RdmaRanks


def dispatch_layout(topk_idx: torch.Tensor, num_experts: int, num_ranks: int, rdma_ranks: Optional[RdmaRanks]
                    ) -> Tuple[torch.Tensor, Optional[torch.Tensor], torch.Tensor, torch.Tensor]:
    """Returns ``(num_tokens_per_rank[R], num_tokens_per_rdma_rank or None, num_tokens_per_expert[E],
    is_token_in_rank[N, R])``; ``num_tokens_per_rdma_rank`` counts by ``rdma_ranks`` (None: there are none). A
    token that lists an expert twice counts twice for that expert."""
    num_tokens = topk_idx.size(0)
    experts_per_rank = num_experts // num_ranks
    valid = topk_idx >= 0
    num_tokens_per_expert = torch.bincount(topk_idx[valid], minlength=num_experts).to(torch.int32)
    target_rank = torch.where(valid, topk_idx // experts_per_rank, torch.full_like(topk_idx, num_ranks))
    # One spare column absorbs the "no expert" entries.
    hits = torch.zeros((num_tokens, num_ranks + 1), dtype=torch.bool, device=topk_idx.device)
    hits.scatter_(1, target_rank, True)
    is_token_in_rank = hits[:, :num_ranks].contiguous()
    num_tokens_per_rank = is_token_in_rank.sum(0, dtype=torch.int32)
    num_tokens_per_rdma_rank = None if rdma_ranks is None else rdma_ranks.token_counts(is_token_in_rank)
    return num_tokens_per_rank, num_tokens_per_rdma_rank, num_tokens_per_expert, is_token_in_rank


def channel_layout(is_token_in_rank: torch.Tensor, num_channels: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """DeepEP's per-channel tables for the sending rank.

    Tokens are split into ``num_channels`` contiguous ranges of ``ceil(N / C)``. Returns
    ``channel_prefix_matrix[R, C]`` (tokens sent to each rank from channels ``0..c``, inclusive)
    and ``send_head[N, R]`` (a token's position in its channel's stream to a rank, or -1).
    """
    num_tokens, num_ranks = is_token_in_rank.shape
    device = is_token_in_rank.device
    tokens_per_channel = (num_tokens + num_channels - 1) // num_channels
    bounds = torch.clamp(torch.arange(num_channels + 1, device=device) * tokens_per_channel, max=num_tokens)
    running = torch.zeros((num_tokens + 1, num_ranks), dtype=torch.int32, device=device)
    running[1:] = is_token_in_rank.to(torch.int32).cumsum(0)
    channel_prefix_matrix = running[bounds[1:]].t().contiguous()
    if num_tokens == 0:
        return channel_prefix_matrix, torch.empty((0, num_ranks), dtype=torch.int32, device=device)
    channel_of_token = torch.arange(num_tokens, device=device) // tokens_per_channel
    before_channel = running[bounds[channel_of_token]]
    send_head = torch.where(is_token_in_rank, running[1:] - 1 - before_channel, torch.full_like(before_channel, -1))
    return channel_prefix_matrix, send_head.contiguous()


def rank_matrix(rank_prefix_matrix: torch.Tensor) -> torch.Tensor:
    """Undo the prefix over source ranks: ``[i, j]`` = tokens rank ``i`` sends to rank ``j``."""
    counts = rank_prefix_matrix.clone()
    counts[1:] -= rank_prefix_matrix[:-1]
    return counts
