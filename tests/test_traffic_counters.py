"""``Buffer.traffic_counters()``: per-peer counts equal what the routing sends, on 3 CPU ranks."""

import os

import torch
import torch.distributed as dist

from tests.multiprocess import run_ranks
from tests.reference_checks import generator, quiet_rank, random_bf16, random_topk_idx
from uccl_ep_plugin import Buffer

NUM_EXPERTS = 12


def _routing(rank: int, num_tokens: int, num_topk: int = 3) -> torch.Tensor:
    return random_topk_idx(generator(4242, rank), num_tokens, NUM_EXPERTS, num_topk, drop_probability=0.2)


def _all_routings(num_ranks: int, tokens):
    return [_routing(r, tokens[r]) for r in range(num_ranks)]


def _counters_body(rank: int, num_ranks: int, group) -> None:
    quiet_rank()
    os.environ["UCCL_EP_TRAFFIC_COUNTERS"] = "1"
    tokens = [5 + 3 * r for r in range(num_ranks)]
    routings = _all_routings(num_ranks, tokens)
    per_rank = NUM_EXPERTS // num_ranks
    gen = generator(99, rank)

    # Normal mode, twice (the counts accumulate).
    buffer = Buffer(group, num_nvl_bytes=1 << 20)
    topk_idx = routings[rank]
    x = random_bf16(gen, (tokens[rank], 256), 0.5, 2.0)
    weights = torch.rand(topk_idx.shape, generator=gen) + 0.1
    for _ in range(2):
        layout = buffer.get_dispatch_layout(topk_idx, NUM_EXPERTS)
        buffer.dispatch(x, num_tokens_per_rank=layout[0], is_token_in_rank=layout[3],
                        num_tokens_per_expert=layout[2], topk_idx=topk_idx, topk_weights=weights)
    counts = buffer.traffic_counters()

    def rows_to(source: int, destination: int) -> int:
        dest_rank = torch.where(routings[source] >= 0, routings[source] // per_rank, -1)
        return int((dest_rank == destination).any(dim=1).sum())

    assert counts["calls"]["dispatch"] == 2
    assert counts["dispatch_rows_sent"] == [2 * rows_to(rank, d) for d in range(num_ranks)], counts
    assert counts["dispatch_rows_received"] == [2 * rows_to(s, rank) for s in range(num_ranks)], counts
    assert counts["crossed_ranks"] > 0
    assert counts["low_latency_pairs_sent"] == [0] * num_ranks

    # Low-latency mode.
    ll_buffer = Buffer(group, num_rdma_bytes=Buffer.get_low_latency_rdma_size_hint(16, 256, num_ranks, NUM_EXPERTS),
                       low_latency_mode=True)
    ll_buffer.low_latency_dispatch(x, topk_idx, 16, NUM_EXPERTS, use_fp8=False)
    counts = ll_buffer.traffic_counters()

    def pairs_to(source: int, destination: int) -> int:
        return int(((routings[source] >= 0) & (routings[source] // per_rank == destination)).sum())

    assert counts["low_latency_pairs_sent"] == [pairs_to(rank, d) for d in range(num_ranks)], counts
    assert counts["low_latency_pairs_received"] == [pairs_to(s, rank) for s in range(num_ranks)], counts
    ll_buffer.traffic_counters()   # reading twice does not change them
    assert ll_buffer.traffic_counters()["low_latency_pairs_sent"] == counts["low_latency_pairs_sent"]
    dist.barrier(group)


def _disabled_body(rank: int, num_ranks: int, group) -> None:
    quiet_rank()
    os.environ.pop("UCCL_EP_TRAFFIC_COUNTERS", None)
    assert Buffer(group).traffic_counters() is None
    os.environ["UCCL_EP_TRAFFIC_COUNTERS"] = "maybe"
    try:
        Buffer(group)
    except ValueError as error:
        assert "UCCL_EP_TRAFFIC_COUNTERS" in str(error)
    else:
        raise AssertionError("a bad UCCL_EP_TRAFFIC_COUNTERS value was accepted")


def test_counters_match_routing():
    run_ranks(3, _counters_body)


def test_counters_off_by_default_and_flag_checked():
    run_ranks(2, _disabled_body)
