"""A peer that never arrives makes the waiting rank raise CommTimeoutError naming its rank and the
phase, within the configured timeout, instead of hanging."""

import os
import time

import pytest
import torch

from tests.multiprocess import run_ranks

TIMEOUT_S = 2.0


def _skipping_peer(rank, num_ranks, group, operation):
    import uccl_ep_plugin as ep

    os.environ["UCCL_EP_TIMEOUT_SECONDS"] = str(TIMEOUT_S)
    hidden, num_experts, num_tokens = 256, 8, 16
    buffer = ep.Buffer(group, num_nvl_bytes=1 << 20, low_latency_mode=True,
                       num_rdma_bytes=ep.Buffer.get_low_latency_rdma_size_hint(num_tokens, hidden, num_ranks,
                                                                             num_experts))
    x = torch.randn(num_tokens, hidden).to(torch.bfloat16)
    topk_idx = torch.randint(0, num_experts, (num_tokens, 2))
    if rank == 1:
        # Rank 1 never makes the call; it only waits long enough for rank 0 to give up.
        time.sleep(TIMEOUT_S * 3)
        return
    start = time.monotonic()
    with pytest.raises(ep.CommTimeoutError) as error:
        if operation == "dispatch":
            per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk_idx, num_experts)
            buffer.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                            num_tokens_per_expert=per_expert)
        else:
            buffer.low_latency_dispatch(x, topk_idx, num_tokens, num_experts)
    elapsed = time.monotonic() - start
    message = str(error.value)
    assert "rank 0" in message and f"{operation}: exchange" in message, message
    assert TIMEOUT_S <= elapsed < TIMEOUT_S + 2.0, f"raised after {elapsed:.1f}s"


@pytest.mark.parametrize("operation", ["dispatch", "low_latency_dispatch"])
def test_missing_peer_raises_with_rank_and_phase(operation):
    run_ranks(2, _skipping_peer, operation=operation)
