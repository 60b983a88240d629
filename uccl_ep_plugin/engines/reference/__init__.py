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
    # sizes the native kernels' grid only.
    def get_dispatch_layout(self, topk_idx: torch.Tensor, num_experts: int, stream: int):
        return layout.dispatch_layout(topk_idx, num_experts, self.comm.num_ranks, self.rdma_ranks)

    def dispatch(self, x, x_scales, *, stream: int, **kwargs) -> normal.DispatchResult:
        return normal.dispatch(self.comm, x, x_scales, **kwargs)

    def combine(self, x, handle, topk_weights, biases, num_channels, stream: int):
        return normal.combine(self.comm, x, handle, topk_weights, biases)

    # The buffer half (buffer_idx), the handle's src_info/sizes and the call's flags as its signature
    # (async_finish, zero_copy, x as given) matter to the native engine only: the reference orders rows
    # deterministically and moves them through the group, not the registered buffer.
    def low_latency_dispatch(self, x, topk_idx, num_max_tokens, num_experts, *, buffer_idx, async_finish, **kwargs):
        return low_latency.low_latency_dispatch(self.comm, x, topk_idx, num_max_tokens, num_experts, **kwargs)

    def low_latency_combine(self, x, topk_idx, topk_weights, layout_range, *, src_info, num_max_tokens, hidden,
                            num_experts, buffer_idx, positions, zero_copy, async_finish, x_given, **kwargs):
        return low_latency.low_latency_combine(self.comm, x, topk_idx, topk_weights, layout_range, **kwargs)

    def barrier(self, phase: str) -> None:
        self.comm.barrier(phase)

    def destroy(self) -> None:
        self.comm = None
