"""The torch computation of low-latency combine positions and slots (used by the native engine when a
handle lost the dispatch kernel's record) against the rule written out entry by entry."""

import pytest
import torch

from uccl_ep_plugin.engines.native.low_latency import dispatch_positions


def positions_by_rule(topk_idx, num_experts, rank, num_ranks, masked):
    """An entry's place in its expert's rank's block: entries choosing a smaller expert of that rank,
    then earlier entries choosing the same expert (its slot, the second plane); -1 without an expert or
    for a masked rank."""
    local = num_experts // num_ranks
    entries = topk_idx.reshape(-1).tolist()
    skipped = [e < 0 or e >= num_experts or masked[e // local] or masked[rank] for e in entries]
    positions, slots = [], []
    for i, expert in enumerate(entries):
        if skipped[i]:
            positions.append(-1)
            slots.append(-1)
            continue
        owner = expert // local
        smaller = sum(1 for j, e in enumerate(entries) if not skipped[j] and e // local == owner and e < expert)
        earlier = sum(1 for j in range(i) if not skipped[j] and entries[j] == expert)
        positions.append(smaller + earlier)
        slots.append(earlier)
    return torch.tensor([positions, slots], dtype=torch.int32).view((2,) + tuple(topk_idx.shape))


@pytest.mark.parametrize("seed", range(6))
def test_positions_follow_the_rule(seed):
    gen = torch.Generator().manual_seed(seed)
    num_ranks = [1, 2, 4, 8, 2, 4][seed]
    num_experts = num_ranks * int(torch.randint(1, 9, (1,), generator=gen))
    tokens, topk = int(torch.randint(0, 40, (1,), generator=gen)), int(torch.randint(1, 9, (1,), generator=gen))
    topk_idx = torch.randint(-1, num_experts, (tokens, topk), generator=gen)   # -1 entries and repeats
    masked = torch.rand(num_ranks, generator=gen) < 0.3 if seed % 2 else torch.zeros(num_ranks, dtype=torch.bool)
    rank = seed % num_ranks
    got = dispatch_positions(topk_idx, num_experts, rank, num_ranks, masked if seed % 2 else None)
    want = positions_by_rule(topk_idx, num_experts, rank, num_ranks, masked.tolist())
    assert torch.equal(got, want)


def test_positions_of_a_masked_rank_are_all_unused():
    topk_idx = torch.tensor([[0, 3], [2, 1]])
    masked = torch.tensor([False, True])
    assert torch.equal(dispatch_positions(topk_idx, 4, 1, 2, masked), torch.full((2, 2, 2), -1, dtype=torch.int32))
