"""Per-peer counts of what a Buffer sent and received, kept on its device.

Opt-in (``UCCL_EP_TRAFFIC_COUNTERS=1``) because each call adds a few small kernels. The counts
accumulate on the device without a host sync, so they also work inside CUDA graphs; reading
them (:meth:`TrafficCounters.snapshot`) syncs. Entries for other ranks are what crossed ranks.
"""

import os
from typing import Dict, List, Optional

import torch

TRAFFIC_ENV = "UCCL_EP_TRAFFIC_COUNTERS"
#: Normal mode counts token rows (one per token and destination rank); low-latency mode counts
#: (token, expert) pairs, one message each.
KINDS = ("dispatch_rows_sent", "dispatch_rows_received",
         "low_latency_pairs_sent", "low_latency_pairs_received")


def enabled_by_env() -> bool:
    raw = os.environ.get(TRAFFIC_ENV, "").strip().lower()
    if raw in ("", "0", "false", "no", "off"):
        return False
    if raw in ("1", "true", "yes", "on"):
        return True
    raise ValueError(f"{TRAFFIC_ENV}={raw!r} is not a flag (use 1 or 0)")


class TrafficCounters:
    def __init__(self, rank: int, num_ranks: int, device: torch.device) -> None:
        self.rank = rank
        self.num_ranks = num_ranks
        self._counts = torch.zeros(len(KINDS), num_ranks, dtype=torch.int64, device=device)
        self._calls = dict.fromkeys(("dispatch", "low_latency_dispatch"), 0)

    def _add(self, kind: str, per_rank: torch.Tensor) -> None:
        self._counts[KINDS.index(kind)] += per_rank.to(torch.int64)

    def add_dispatch(self, is_token_in_rank: torch.Tensor, rank_prefix_matrix: torch.Tensor) -> None:
        """``rank_prefix_matrix[i, j]``: rows ranks ``0..i`` send to rank ``j`` (DeepEP's handle[0])."""
        self._calls["dispatch"] += 1
        self._add("dispatch_rows_sent", is_token_in_rank.sum(0))
        to_me = rank_prefix_matrix[:, self.rank].to(torch.int64)
        self._add("dispatch_rows_received", torch.diff(to_me, prepend=to_me.new_zeros(1)))

    def add_low_latency_dispatch(self, topk_idx: torch.Tensor, num_experts: int,
                                 layout_range: torch.Tensor, masked_ranks: Optional[torch.Tensor]) -> None:
        """``layout_range[e, r]`` holds ``(begin << 32) | count`` of source rank ``r``'s rows for local expert ``e``."""
        self._calls["low_latency_dispatch"] += 1
        experts_per_rank = num_experts // self.num_ranks
        valid = (topk_idx >= 0) & (topk_idx < num_experts)
        destination = torch.where(valid, topk_idx // experts_per_rank, self.num_ranks).flatten()
        if masked_ranks is not None:   # nothing is sent to a masked rank
            masked = torch.cat([masked_ranks, masked_ranks.new_ones(1)])
            destination = torch.where(masked[destination], self.num_ranks, destination)
        sent = torch.zeros(self.num_ranks + 1, dtype=torch.int64, device=topk_idx.device)
        sent.scatter_add_(0, destination, torch.ones_like(destination))
        self._add("low_latency_pairs_sent", sent[:self.num_ranks])
        self._add("low_latency_pairs_received", (layout_range & 0xFFFFFFFF).sum(0))

    def snapshot(self) -> Dict[str, object]:
        counts: List[List[int]] = self._counts.cpu().tolist()
        result: Dict[str, object] = {"rank": self.rank, "calls": dict(self._calls)}
        for kind, per_rank in zip(KINDS, counts):
            result[kind] = per_rank
        result["crossed_ranks"] = sum(value for per_rank in counts
                                      for peer, value in enumerate(per_rank) if peer != self.rank)
        return result

    def reset(self) -> None:
        self._counts.zero_()
        self._calls = dict.fromkeys(self._calls, 0)
