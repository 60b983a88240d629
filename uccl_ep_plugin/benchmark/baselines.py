"""The NCCL paths SGLang and vLLM users fall back to without an expert-parallel library, timed in the same
run as our engine, on the same tokens and routing:

- vLLM's default all2all backend: dispatch all-gathers every rank's hidden states, combine reduce-scatters
  the expert outputs of all tokens (each rank returns a partial sum for every token). The all_gather also
  for fp8 rows with their scales, as bytes: the payload of our fp8 dispatch.
- all_to_all_single: each token goes to every rank holding one of its experts (DeepEP's is_token_in_rank),
  and combine sends the rows back and adds them up per token.

GB/s uses the same formula as our cases (bytes of the rows a rank receives, or sends back for combine).
"""

from typing import Callable, Dict, List

import torch
import torch.distributed as dist

from .case import Case
from .workloads import Workload, normal_bytes, per_token_fp8, routing

ENGINE = "baseline"
# The same collectives under the names torch >= 2.13 gives them (the old names warn there); older torch has only
# the old ones.
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _close(got: torch.Tensor, expected: torch.Tensor, rel: float) -> bool:
    scale = expected.float().abs().amax().clamp(min=1e-6)
    return bool(((got.float() - expected.float()).abs().amax() <= rel * scale).item())


def baseline_cases(workload: Workload, rank: int, num_ranks: int, seed: int, group,
                   device: torch.device) -> List[Case]:
    """all_gather dispatch (bf16 and fp8), reduce_scatter combine, all_to_all_single dispatch and combine."""
    inputs = [routing(workload, r, seed) for r in range(num_ranks)]     # every rank's tokens, to check with
    x, topk_idx, _ = (t.to(device) for t in inputs[rank])
    tokens, hidden = x.shape
    local_experts = workload.experts // num_ranks

    # vLLM's default: all_gather / reduce_scatter over every token of every rank.
    gathered = torch.empty((num_ranks * tokens, hidden), dtype=x.dtype, device=device)
    everyone = torch.cat([x_r for x_r, _, _ in inputs]).to(device)

    def all_gather() -> None:
        _ALL_GATHER(gathered, x, group=group)

    def fp8_bytes(x_r: torch.Tensor) -> torch.Tensor:
        values, scales = per_token_fp8(x_r)
        return torch.cat([values.view(torch.uint8), scales.view(torch.uint8)], 1)

    x_fp8 = fp8_bytes(x)
    gathered_fp8 = torch.empty((num_ranks * tokens, x_fp8.size(1)), dtype=torch.uint8, device=device)

    def all_gather_fp8() -> None:
        _ALL_GATHER(gathered_fp8, x_fp8, group=group)

    partial = torch.empty_like(gathered)
    partial.copy_(everyone)
    reduced = torch.empty_like(x)

    def reduce_scatter() -> None:
        _REDUCE_SCATTER(reduced, partial, group=group)

    # all_to_all_single: the token copies each rank sends each rank, in destination order.
    def in_rank(idx: torch.Tensor) -> torch.Tensor:
        owners = torch.where(idx >= 0, idx // local_experts, num_ranks)
        return torch.stack([(owners == r).any(1) for r in range(num_ranks)], 1)

    mine = in_rank(topk_idx)
    send_rows = torch.cat([torch.nonzero(mine[:, r]).flatten() for r in range(num_ranks)])
    send_counts = mine.sum(0).tolist()
    recv_counts = [int(in_rank(idx.to(device))[:, rank].sum()) for _, idx, _ in inputs]
    to_send = x[send_rows]
    received = torch.empty((sum(recv_counts), hidden), dtype=x.dtype, device=device)
    returned = torch.empty_like(to_send)
    combined = torch.empty((tokens, hidden), dtype=torch.float32, device=device)

    def a2a_dispatch() -> None:
        dist.all_to_all_single(received, to_send, recv_counts, send_counts, group=group)

    def a2a_combine() -> None:
        dist.all_to_all_single(returned, received, send_counts, recv_counts, group=group)
        combined.zero_().index_add_(0, send_rows, returned.float())

    def expected_received() -> torch.Tensor:
        rows = [x_r.to(device)[in_rank(idx.to(device))[:, rank]] for x_r, idx, _ in inputs]
        return torch.cat(rows)

    copies = mine.sum(1, keepdim=True).float()
    checks: Dict[str, Callable[[], bool]] = {
        "all_gather": lambda: torch.equal(gathered, everyone),
        "all_gather_fp8": lambda: torch.equal(gathered_fp8,
                                              torch.cat([fp8_bytes(x_r.to(device)) for x_r, _, _ in inputs])),
        "reduce_scatter": lambda: _close(reduced, x.float() * num_ranks, 2e-2),
        "a2a_dispatch": lambda: torch.equal(received, expected_received()),
        "a2a_combine": lambda: _close(combined, x.float() * copies, 1e-2),
    }
    a2a_dispatch()      # combine sends back what one dispatch received
    all_rows = num_ranks * tokens
    return [
        Case("normal", "dispatch (all_gather)", "bf16", workload, all_gather, checks["all_gather"],
                  normal_bytes(all_rows, hidden, "bf16"), ENGINE),
        Case("normal", "dispatch (all_gather)", "fp8", workload, all_gather_fp8, checks["all_gather_fp8"],
                  normal_bytes(all_rows, hidden, "fp8"), ENGINE),
        Case("normal", "combine (reduce_scatter)", "bf16", workload, reduce_scatter, checks["reduce_scatter"],
                  normal_bytes(all_rows, hidden, "bf16"), ENGINE),
        Case("normal", "dispatch (all_to_all_single)", "bf16", workload, a2a_dispatch, checks["a2a_dispatch"],
                  normal_bytes(sum(recv_counts), hidden, "bf16"), ENGINE),
        Case("normal", "combine (all_to_all_single)", "bf16", workload, a2a_combine, checks["a2a_combine"],
                  normal_bytes(sum(recv_counts), hidden, "bf16"), ENGINE),
    ]


NUM_CASES = 5
