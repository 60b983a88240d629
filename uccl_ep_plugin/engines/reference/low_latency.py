"""Low-latency dispatch and combine in plain PyTorch over the group.

Each (token, top-k slot) whose expert is valid and not on a masked rank becomes one row.
A rank's rows for one destination are ordered by expert, then token, then top-k slot;
the receiver packs them per local expert, sources in rank order. Combine sends the rows
back in the same order, so the source can weight them without ids on the wire.
"""

from typing import Callable, NamedTuple, Optional, Tuple

import torch

from .collectives import GroupComm, PendingExchange, run_once
from .logfmt import logfmt_roundtrip
from .quantize import CHANNELS_PER_SCALE, SCALES_PER_UE8M0_WORD, pack_ue8m0, quantize_fp8
from .rows import pack_rows, row_spec, segment_ids, unpack_rows


class LowLatencyDispatchResult(NamedTuple):
    recv_x: torch.Tensor
    recv_x_scales: Optional[torch.Tensor]
    recv_count: torch.Tensor
    src_info: torch.Tensor
    layout_range: torch.Tensor
    hidden: int   # x's: the handle's item, here for a caller that reads no tensor attribute (torch-function modes)
    hook: Optional[Callable[[], None]]
    # Native engine only: where each (token, top-k) entry's combined row lands in its expert's rank
    # (int32 [N, K], -1 for entries not sent). The reference engine finds rows through src_info.
    positions: Optional[torch.Tensor] = None


def _routed_pairs(topk_idx: torch.Tensor, local_experts: int, masked_ranks: Optional[torch.Tensor]
                  ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(token, expert, flat top-k position) of each routed row, ordered by expert then token then slot."""
    num_tokens, num_topk = topk_idx.shape
    flat = topk_idx.reshape(-1)
    keep = flat >= 0
    if masked_ranks is not None:
        keep &= ~masked_ranks[torch.clamp(flat, min=0) // local_experts]
    position = torch.nonzero(keep).reshape(-1)
    expert = flat[position]
    order = torch.sort(expert, stable=True).indices
    position, expert = position[order], expert[order]
    return position // num_topk, expert, position


def _add_wait_cost(stats: Optional[torch.Tensor], exchange: PendingExchange, masked: Optional[torch.Tensor]) -> None:
    if stats is None:
        return
    cost = torch.full_like(stats, exchange.waited_ns)
    if masked is not None:
        cost[masked.to(stats.device)] = 0
    stats.add_(cost)


def low_latency_dispatch(comm: GroupComm, x: torch.Tensor, topk_idx: torch.Tensor, num_max_tokens: int,
                         num_experts: int, *, use_fp8: bool, round_scale: bool, use_ue8m0: bool,
                         masked_ranks: Optional[torch.Tensor], cumulative_local_expert_recv_stats: Optional[torch.Tensor],
                         dispatch_wait_recv_cost_stats: Optional[torch.Tensor],
                         return_recv_hook: bool) -> LowLatencyDispatchResult:
    rank, num_ranks, device = comm.rank, comm.num_ranks, comm.device
    local_experts = num_experts // num_ranks
    hidden = x.size(1)
    slots = num_ranks * num_max_tokens

    token, expert, _ = _routed_pairs(topk_idx, local_experts, masked_ranks)
    rows_per_expert = torch.bincount(expert, minlength=num_experts)
    send_counts = rows_per_expert.view(num_ranks, local_experts).sum(1).tolist()
    gathered = comm.all_gather_ints(rows_per_expert, "low_latency_dispatch: exchange counts")
    from_source = gathered[:, rank * local_experts:(rank + 1) * local_experts]     # [source, local expert]
    recv_counts = from_source.sum(1).tolist()

    if use_fp8:
        x_fp8, scales = quantize_fp8(x, round_scale)
        payload = [x_fp8.view(torch.uint8)[token], scales[token]]
    else:
        payload = [x.view(torch.uint8)[token]]
    payload += [(expert % local_experts).to(torch.int32), token.to(torch.int32)]
    specs = [row_spec(p) for p in payload]
    exchange = comm.start_row_exchange(pack_rows(payload, token.numel(), device), send_counts, recv_counts,
                                       "low_latency_dispatch: exchange rows")

    # Layout is known from the counts alone; masked sources contribute nothing.
    kept = from_source.clone()
    if masked_ranks is not None:
        kept[masked_ranks.cpu()] = 0
    begin = kept.cumsum(0) - kept                                                   # [source, local expert]
    layout_range = ((begin << 32) | kept).t().contiguous().to(device)
    recv_count = kept.sum(0).to(torch.int32).to(device)

    # Rows past each expert's count are left unset, as in the native kernels.
    recv_x = torch.empty((local_experts, slots, hidden), dtype=torch.float8_e4m3fn if use_fp8 else torch.bfloat16,
                         device=device)
    recv_x_scales = None
    if use_fp8:
        num_scales = hidden // CHANNELS_PER_SCALE
        if use_ue8m0:
            num_scales //= SCALES_PER_UE8M0_WORD
        # Column-major in the last two dimensions, as TMA-based GEMMs read them.
        recv_x_scales = torch.empty((local_experts, num_scales, slots), dtype=torch.int32 if use_ue8m0 else torch.float32,
                                    device=device).transpose(1, 2)
    src_info = torch.full((local_experts, slots), -1, dtype=torch.int32, device=device)

    def receive() -> None:
        fields = unpack_rows(exchange.finish(), specs)
        row_local_expert, row_token = fields[-2].reshape(-1).long(), fields[-1].reshape(-1)
        row_source = segment_ids(torch.tensor(recv_counts, device=device).cumsum(0))
        group_sizes = from_source.flatten().to(device)                              # (source, local expert) groups
        group_start = group_sizes.cumsum(0) - group_sizes
        group = row_source * local_experts + row_local_expert
        slot = begin.to(device)[row_source, row_local_expert] + torch.arange(row_token.numel(), device=device) - group_start[group]
        if masked_ranks is not None:
            keep = ~masked_ranks[row_source]
            row_local_expert, row_token, slot = row_local_expert[keep], row_token[keep], slot[keep]
            fields = [f[keep] for f in fields]
        recv_x.view(torch.uint8).view(local_experts, slots, -1)[row_local_expert, slot] = fields[0]
        if recv_x_scales is not None:
            row_scales = pack_ue8m0(fields[1]) if use_ue8m0 else fields[1]
            recv_x_scales[row_local_expert, slot] = row_scales
        src_info[row_local_expert, slot] = row_token
        if cumulative_local_expert_recv_stats is not None:
            cumulative_local_expert_recv_stats.add_(recv_count)
        _add_wait_cost(dispatch_wait_recv_cost_stats, exchange, masked_ranks)

    hook = run_once(receive)
    if not return_recv_hook:
        hook()
        hook = None
    return LowLatencyDispatchResult(recv_x, recv_x_scales, recv_count, src_info, layout_range, hidden, hook)


def low_latency_combine(comm: GroupComm, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                        layout_range: torch.Tensor, *, use_logfmt: bool, masked_ranks: Optional[torch.Tensor],
                        out: Optional[torch.Tensor], combine_wait_recv_cost_stats: Optional[torch.Tensor],
                        return_recv_hook: bool) -> Tuple[torch.Tensor, Optional[Callable[[], None]]]:
    rank, num_ranks, device = comm.rank, comm.num_ranks, comm.device
    local_experts, slots, hidden = x.shape

    # Rows to return: per source rank, per local expert, the packed slots in order.
    ranges = layout_range.cpu()
    begin, count = (ranges >> 32).t(), (ranges & 0xFFFFFFFF).t()                     # [source, local expert]
    if masked_ranks is not None:
        count = count.clone()
        count[masked_ranks.cpu()] = 0
    group_sizes = count.flatten()
    group_base = (torch.arange(local_experts) * slots).unsqueeze(0) + begin
    group_end = group_sizes.cumsum(0)
    group_start = group_end - group_sizes
    row_group = segment_ids(group_end)
    rows_index = (group_base.flatten()[row_group] + torch.arange(row_group.numel()) - group_start[row_group]).to(device)
    rows = x.reshape(local_experts * slots, hidden)[rows_index]
    payload = [logfmt_roundtrip(rows) if use_logfmt else rows]
    specs = [row_spec(payload[0])]
    send_counts = count.sum(1).tolist()
    recv_counts = comm.exchange_counts(send_counts, "low_latency_combine: exchange counts")
    exchange = comm.start_row_exchange(pack_rows(payload, rows.size(0), device), send_counts, recv_counts,
                                       "low_latency_combine: exchange rows")

    num_tokens = topk_idx.size(0)
    combined = out if out is not None else torch.empty((num_tokens, hidden), dtype=torch.bfloat16, device=device)
    token, expert, position = _routed_pairs(topk_idx, local_experts, masked_ranks)
    expected = torch.bincount(expert // local_experts, minlength=num_ranks).tolist()

    def receive() -> None:
        (returned,) = unpack_rows(exchange.finish(), specs)
        keep = torch.ones(token.numel(), dtype=torch.bool, device=device)
        for peer in range(num_ranks):
            if recv_counts[peer] == expected[peer]:
                continue
            if recv_counts[peer] != 0:
                raise ValueError(f"low_latency_combine on rank {rank}: rank {peer} returned {recv_counts[peer]} rows "
                                 f"but this rank dispatched {expected[peer]}; topk_idx must be the one passed to "
                                 "low_latency_dispatch")
            keep &= (expert // local_experts) != peer                               # that peer masked this rank
        weights = topk_weights.reshape(-1)[position[keep]].unsqueeze(1)
        summed = torch.zeros((num_tokens, hidden), dtype=torch.float32, device=device)
        summed.index_add_(0, token[keep], returned.float() * weights)
        combined.copy_(summed)
        _add_wait_cost(combine_wait_recv_cost_stats, exchange, masked_ranks)

    hook = run_once(receive)
    if not return_recv_hook:
        hook()
        hook = None
    return combined, hook
