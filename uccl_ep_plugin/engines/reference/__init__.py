"""The reference engine: every Buffer operation in plain PyTorch over the Buffer's group.

It runs on any device and any process group (gloo on CPU, NCCL on GPU), is the oracle the
native kernels are tested against, and serves wherever the native engine cannot.
"""

from typing import Optional

import torch
import torch.distributed as dist

from ...hosts import RdmaRanks
from . import layout, low_latency, normal
from .collectives import CommTimeoutError, GroupComm

__all__ = ["ReferenceEngine", "CommTimeoutError"]


class ReferenceEngine:
    name = "reference"

    def __init__(self, group: dist.ProcessGroup, rank: int, num_ranks: int, device: torch.device,
                 timeout_s: float, rdma_ranks: Optional[RdmaRanks]) -> None:
        self.comm = GroupComm(group, rank, num_ranks, device, timeout_s)
        self.rdma_ranks = rdma_ranks

    # `stream` is where the native kernels launch; the reference runs on the current stream. num_channels
    # sizes the native kernels' grid only. `check` is None: the Buffer ran the checks (Buffer._checked_by).
    def get_dispatch_layout(self, topk_idx: torch.Tensor, num_experts: int, stream: int, check=None):
        return layout.dispatch_layout(topk_idx, num_experts, self.comm.num_ranks, self.rdma_ranks)

    def dispatch(self, x, x_scales, *, stream: int, check=None, **kwargs) -> normal.DispatchResult:
        return normal.dispatch(self.comm, x, x_scales, **kwargs)

    def combine(self, x, handle, topk_weights, biases, num_channels, stream: int, check=None):
        return normal.combine(self.comm, x, handle, topk_weights, biases)

    # `call`: the Buffer operation's arguments in the order of buffer.py's tuple; `check(call)`: the Buffer's
    # checks of it, run first on every call (they also read topk_idx's values). The buffer half (buffer_idx), the
    # handle's src_info/sizes and the call's flags as its signature (async_finish, zero_copy, x as given) matter
    # to the native engine only: the reference orders rows deterministically and moves them through the group,
    # not the registered buffer.
    def low_latency_dispatch(self, call, masked_ranks, buffer_idx, check):
        check(call)
        (x, topk_idx, num_max_tokens, num_experts, cumulative_local_expert_recv_stats, dispatch_wait_recv_cost_stats,
         use_fp8, round_scale, use_ue8m0, _, return_recv_hook) = call
        return low_latency.low_latency_dispatch(
            self.comm, x, topk_idx, num_max_tokens, num_experts, use_fp8=use_fp8, round_scale=round_scale,
            use_ue8m0=use_ue8m0, masked_ranks=masked_ranks,
            cumulative_local_expert_recv_stats=cumulative_local_expert_recv_stats,
            dispatch_wait_recv_cost_stats=dispatch_wait_recv_cost_stats, return_recv_hook=return_recv_hook)

    def low_latency_combine(self, call, masked_ranks, buffer_idx, check):
        check(call)
        (x, topk_idx, topk_weights, _, layout_range, _, _, _, _, use_logfmt, _, _, return_recv_hook, out,
         combine_wait_recv_cost_stats, _) = call
        return low_latency.low_latency_combine(
            self.comm, x, topk_idx, topk_weights, layout_range, use_logfmt=use_logfmt, masked_ranks=masked_ranks,
            out=out, combine_wait_recv_cost_stats=combine_wait_recv_cost_stats, return_recv_hook=return_recv_hook)

    def barrier(self, phase: str) -> None:
        self.comm.barrier(phase)

    def destroy(self) -> None:
        self.comm = None
