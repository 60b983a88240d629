"""Normal (high-throughput) dispatch and combine in plain PyTorch over the group.

Received rows are grouped by source rank in rank order and, within a source, in token
order, exactly as the native kernels deliver them.
"""

from typing import List, NamedTuple, Optional, Sequence, Tuple

import torch

from .collectives import GroupComm
from .layout import channel_layout, rank_matrix
from .rows import pack_rows, row_spec, unpack_rows


class DispatchResult(NamedTuple):
    recv_x: torch.Tensor
    recv_x_scales: Optional[torch.Tensor]
    recv_topk_idx: Optional[torch.Tensor]
    recv_topk_weights: Optional[torch.Tensor]
    num_recv_tokens_per_expert_list: List[int]
    handle: Tuple[torch.Tensor, ...]


def _routed_pairs(is_token_in_rank: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """(destination rank, token) of every routed copy, ordered by rank then token."""
    pairs = torch.nonzero(is_token_in_rank.t())
    return pairs[:, 0], pairs[:, 1]


def _pad_rows(tensor: torch.Tensor, num_rows: int, fill) -> torch.Tensor:
    if tensor.size(0) == num_rows:
        return tensor
    padded = torch.full((num_rows,) + tuple(tensor.shape[1:]), fill, dtype=tensor.dtype, device=tensor.device)
    padded[:tensor.size(0)] = tensor
    return padded


class LayoutTables(NamedTuple):
    counts: torch.Tensor                 # [R, R] on the host: tokens rank i sends to rank j
    rank_prefix_matrix: torch.Tensor
    channel_prefix_matrix: torch.Tensor
    recv_channel_prefix_matrix: torch.Tensor
    send_head: torch.Tensor
    num_recv_tokens_per_expert_list: List[int]
    extra: Optional[torch.Tensor] = None   # [R, n] on the host: every rank's ``extra`` integers, where given


def exchange_layout(comm: GroupComm, is_token_in_rank: torch.Tensor, num_tokens_per_rank: torch.Tensor,
                    num_tokens_per_expert: torch.Tensor, expert_alignment: int, num_worst_tokens: int,
                    num_channels: int, extra: Optional[torch.Tensor] = None) -> LayoutTables:
    """A fresh dispatch's tables of the handle and its count list (empty with ``num_worst_tokens``), from one
    gather of every rank's layout over ``comm`` (with ``extra``, integers of the caller's that every rank needs)."""
    rank, num_ranks, device = comm.rank, comm.num_ranks, comm.device
    sent_per_rank = is_token_in_rank.sum(0, dtype=torch.int64)
    if not torch.equal(sent_per_rank, num_tokens_per_rank.to(torch.int64)):   # before any communication
        raise ValueError("num_tokens_per_rank does not match is_token_in_rank: "
                         f"{num_tokens_per_rank.tolist()} vs {sent_per_rank.tolist()}")
    channel_prefix_matrix, send_head = channel_layout(is_token_in_rank, num_channels)
    num_experts = num_tokens_per_expert.numel()
    local_experts = num_experts // num_ranks
    parts = [num_tokens_per_rank, channel_prefix_matrix.flatten(), num_tokens_per_expert]
    meta = torch.cat([part.to(torch.int64) for part in parts + ([] if extra is None else [extra])])
    gathered = comm.all_gather_ints(meta, "dispatch: exchange layout")
    counts = gathered[:, :num_ranks]
    # Every rank knows every rank's count, so all of them stop together instead of some waiting.
    received_by_rank = counts.sum(0)
    if num_worst_tokens > 0 and int(received_by_rank.max()) > num_worst_tokens:
        worst = int(received_by_rank.argmax())
        raise RuntimeError(f"uccl_ep_plugin: dispatch on rank {rank}: rank {worst} would receive "
                           f"{int(received_by_rank[worst])} tokens, more than num_worst_tokens={num_worst_tokens}")
    rank_prefix_matrix = counts.cumsum(0).to(torch.int32).to(device)
    start = num_ranks
    sent_by_channel = gathered[:, start:start + num_ranks * num_channels].view(num_ranks, num_ranks,
                                                                               num_channels)[:, rank]
    start += num_ranks * num_channels
    recv_channel_prefix_matrix = torch.zeros((num_ranks, num_channels), dtype=torch.int32)
    recv_channel_prefix_matrix[:, 1:] = sent_by_channel[:, :-1]
    per_expert = gathered[:, start:start + num_experts].view(num_ranks, num_experts)
    received = per_expert[:, rank * local_experts:(rank + 1) * local_experts].sum(0)
    aligned = (received + expert_alignment - 1) // expert_alignment * expert_alignment
    return LayoutTables(counts, rank_prefix_matrix, channel_prefix_matrix, recv_channel_prefix_matrix.to(device),
                        send_head, [] if num_worst_tokens > 0 else aligned.tolist(),
                        None if extra is None else gathered[:, start + num_experts:])


def dispatch(comm: GroupComm, x: torch.Tensor, x_scales: Optional[torch.Tensor], *,
             is_token_in_rank: torch.Tensor, num_tokens_per_rank: Optional[torch.Tensor],
             num_tokens_per_expert: Optional[torch.Tensor], topk_idx: Optional[torch.Tensor],
             topk_weights: Optional[torch.Tensor], expert_alignment: int, num_worst_tokens: int,
             num_channels: int, cached_handle: Optional[Sequence[torch.Tensor]]) -> DispatchResult:
    rank, num_ranks, device = comm.rank, comm.num_ranks, comm.device
    num_recv_tokens_per_expert_list: List[int] = []
    if cached_handle is not None:
        rank_prefix_matrix, channel_prefix_matrix, recv_channel_prefix_matrix, cached_src_idx, _, send_head = cached_handle
        counts = rank_matrix(rank_prefix_matrix.cpu())
        num_rows_out = cached_src_idx.size(0)
    else:
        tables = exchange_layout(comm, is_token_in_rank, num_tokens_per_rank, num_tokens_per_expert,
                                 expert_alignment, num_worst_tokens, num_channels)
        counts, rank_prefix_matrix, channel_prefix_matrix, recv_channel_prefix_matrix, send_head = tables[:5]
        num_recv_tokens_per_expert_list = tables[5]
        num_rows_out = None

    recv_counts = counts[:, rank].tolist()
    send_counts = counts[rank, :].tolist()
    num_recv = sum(recv_counts)
    if cached_handle is None:
        num_rows_out = num_worst_tokens if num_worst_tokens > 0 else num_recv
    if num_recv > num_rows_out:
        raise RuntimeError(f"uccl_ep_plugin: rank {rank} dispatch receives {num_recv} tokens, more than the "
                           f"{num_rows_out} rows allowed (num_worst_tokens or the cached handle)")

    dst_rank, token = _routed_pairs(is_token_in_rank)
    payload = [x.view(torch.uint8)[token]]
    if x_scales is not None:
        payload.append(x_scales[token])
    if topk_idx is not None:
        local_experts = num_tokens_per_expert.numel() // num_ranks
        local = topk_idx[token] - dst_rank[:, None] * local_experts
        keep = (topk_idx[token] >= 0) & (local >= 0) & (local < local_experts)
        payload.append(torch.where(keep, local, torch.full_like(local, -1)))
        payload.append(torch.where(keep, topk_weights[token], torch.zeros_like(topk_weights[token])))
    payload.append(token.to(torch.int32))
    specs = [row_spec(p) for p in payload]
    recv_rows = comm.start_row_exchange(pack_rows(payload, token.numel(), device), send_counts, recv_counts,
                                        "dispatch: exchange rows").finish()
    fields = unpack_rows(recv_rows, specs)

    recv_x = _pad_rows(fields.pop(0), num_rows_out, 0).view(x.dtype)
    recv_x_scales = _pad_rows(fields.pop(0), num_rows_out, 0) if x_scales is not None else None
    recv_topk_idx = recv_topk_weights = None
    if topk_idx is not None:
        recv_topk_idx = _pad_rows(fields.pop(0), num_rows_out, -1)
        recv_topk_weights = _pad_rows(fields.pop(0), num_rows_out, 0)
    recv_src_idx = _pad_rows(fields.pop(0).reshape(-1), num_rows_out, -1)
    if cached_handle is not None:
        recv_src_idx = cached_src_idx
    handle = (rank_prefix_matrix, channel_prefix_matrix, recv_channel_prefix_matrix, recv_src_idx,
              is_token_in_rank, send_head)
    return DispatchResult(recv_x, recv_x_scales, recv_topk_idx, recv_topk_weights,
                          num_recv_tokens_per_expert_list, handle)


def combine(comm: GroupComm, x: torch.Tensor, handle: Sequence[torch.Tensor], topk_weights: Optional[torch.Tensor],
            biases: Sequence[torch.Tensor]) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Sum every token's copies (no weights applied) back on its source rank, then add the biases."""
    rank, device = comm.rank, comm.device
    rank_prefix_matrix, _, _, _, is_token_in_rank, _ = handle
    counts = rank_matrix(rank_prefix_matrix.cpu())
    send_counts = counts[:, rank].tolist()
    recv_counts = counts[rank, :].tolist()
    num_valid = sum(send_counts)

    payload = [x[:num_valid].view(torch.uint8)]
    if topk_weights is not None:
        payload.append(topk_weights[:num_valid])
    specs = [(torch.uint8, tuple(payload[0].shape[1:]))] + [row_spec(p) for p in payload[1:]]
    recv_rows = comm.start_row_exchange(pack_rows(payload, num_valid, device), send_counts, recv_counts,
                                        "combine: exchange rows").finish()
    fields = unpack_rows(recv_rows, specs)

    _, token = _routed_pairs(is_token_in_rank)
    num_tokens, hidden = is_token_in_rank.size(0), x.size(1)
    summed = torch.zeros((num_tokens, hidden), dtype=torch.float32, device=device)
    combined_topk_weights = None
    if topk_weights is not None:
        combined_topk_weights = torch.zeros((num_tokens, topk_weights.size(1)), dtype=torch.float32, device=device)
    # One source rank at a time, in rank order: each token appears at most once per rank, so every float sum
    # is 0 + rank 0's copy + rank 1's copy + ..., one defined order (an index_add_ over all ranks at once
    # adds with atomics on GPUs, in no fixed order, and three or more terms then round differently).
    rows = list(zip(token.split(recv_counts), fields[0].split(recv_counts),
                    fields[1].split(recv_counts) if topk_weights is not None else [None] * len(recv_counts)))
    for rank_token, rank_x, rank_weights in rows:
        summed.index_add_(0, rank_token, rank_x.view(x.dtype).float())
        if rank_weights is not None:
            combined_topk_weights.index_add_(0, rank_token, rank_weights)
    for bias in biases:
        summed += bias.float()
    return summed.to(x.dtype), combined_topk_weights
