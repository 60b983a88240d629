"""Hosts of a group's ranks, and num_tokens_per_rdma_rank counted by them (any number of GPUs per host)."""

import os

import pytest
import torch

from tests.multiprocess import run_ranks
from tests.reference_checks import random_topk_idx
from uccl_ep_plugin import Buffer, hosts
from uccl_ep_plugin.hosts import RdmaRanks

CPU = torch.device("cpu")


def _expected_counts(is_token_in_rank: torch.Tensor, of_rank) -> list:
    """Tokens sent to at least one rank of each RDMA rank, one token at a time."""
    counts = [0] * (max(of_rank) + 1)
    for row in is_token_in_rank.tolist():
        for group in {of_rank[r] for r, sent in enumerate(row) if sent}:
            counts[group] += 1
    return counts


@pytest.mark.parametrize("host_of_rank, expected", [
    (["a"] * 8, None),                                   # one host of at most 8 ranks: no RDMA rank
    (["a"] * 16, [0] * 8 + [1] * 8),                     # one machine of 16 ranks: DeepEP's groups of 8
    (["a", "a", "b", "b", "c", "c"], [0, 0, 1, 1, 2, 2]),
    (["b", "a", "b", "a"], [0, 1, 0, 1]),                # hosts numbered by their first rank
    (["a", "a", "a", "b"], [0, 0, 0, 1]),                # uneven hosts still count
    (["a", "b"], [0, 1]),
])
def test_rdma_ranks_of_hosts(host_of_rank, expected):
    rdma_ranks = RdmaRanks.of_hosts(host_of_rank, CPU)
    if expected is None:
        assert rdma_ranks is None
        return
    assert rdma_ranks.of_rank.tolist() == expected and rdma_ranks.count == max(expected) + 1
    gen = torch.Generator().manual_seed(len(host_of_rank))
    is_token_in_rank = torch.rand((97, len(host_of_rank)), generator=gen) < 0.3
    is_token_in_rank[5] = False                          # a token sent nowhere
    counts = rdma_ranks.token_counts(is_token_in_rank)
    assert counts.dtype == torch.int32
    assert counts.tolist() == _expected_counts(is_token_in_rank, expected)


def _layout_on_logical_hosts(rank, num_ranks, group, per_node):
    os.environ[hosts.GPUS_PER_NODE_ENV] = str(per_node)
    num_experts = 8 * num_ranks
    gen = torch.Generator().manual_seed(100 + rank)
    topk_idx = random_topk_idx(gen, 64, num_experts, 4, 0.2)
    buffer = Buffer(group, explicitly_destroy=True)
    per_rank, per_rdma_rank, _, in_rank, _ = buffer.get_dispatch_layout(topk_idx, num_experts)
    of_rank = [r // per_node for r in range(num_ranks)]
    assert per_rdma_rank is not None and per_rdma_rank.dtype == torch.int32
    assert per_rdma_rank.tolist() == _expected_counts(in_rank, of_rank)
    assert int(per_rdma_rank.sum()) >= int((in_rank.any(1)).sum()) > 0
    buffer.destroy()


@pytest.mark.parametrize("num_ranks, per_node", [(4, 2), (3, 2), (4, 1)])
def test_layout_counts_tokens_per_host(num_ranks, per_node):
    """UCCL_EP_GPUS_PER_NODE cuts the machine into hosts (on CPU, of consecutive ranks): the layout then counts the
    tokens for each host, including a host with fewer ranks than the others."""
    run_ranks(num_ranks, _layout_on_logical_hosts, per_node=per_node)


def _bad_gpus_per_node_on_rank_1(rank, num_ranks, group):
    if rank == 1:
        os.environ[hosts.GPUS_PER_NODE_ENV] = "half"
    with pytest.raises(ValueError, match="rank 1: UCCL_EP_GPUS_PER_NODE='half'"):
        Buffer(group)


def test_a_bad_gpus_per_node_on_one_rank_fails_every_buffer():
    run_ranks(2, _bad_gpus_per_node_on_rank_1)
