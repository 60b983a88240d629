"""The Buffer on CUDA tensors, over an NCCL group and over a gloo group: the native layout kernel
against the reference layout, and normal and low-latency round trips through the reference engine."""

import pytest
import torch
import torch.distributed as dist

from tests.multiprocess import environment, needs_gpus, rank_device, run_ranks

pytestmark = [pytest.mark.gpu, needs_gpus(2)]


def _routing(rank: int, seed: int, num_tokens: int, hidden: int, num_experts: int, num_topk: int, device):
    gen = torch.Generator().manual_seed(seed * 7919 + rank)
    x = torch.randn((num_tokens, hidden), generator=gen).to(torch.bfloat16)
    topk_idx = torch.topk(torch.rand((num_tokens, num_experts), generator=gen), num_topk, dim=1).indices
    topk_idx[torch.rand((num_tokens, num_topk), generator=gen) < 0.1] = -1
    weights = torch.rand((num_tokens, num_topk), generator=gen) + 0.1
    return x.to(device), topk_idx.to(device), weights.to(device)


def _assert_close(got, expected, rel, what):
    assert got.shape == expected.shape, f"{what}: shape {tuple(got.shape)} != {tuple(expected.shape)}"
    if expected.numel() == 0:
        return
    scale = expected.abs().amax().clamp(min=1e-6)
    err = (got.float() - expected.float()).abs().amax()
    assert err <= rel * scale, f"{what}: max error {err.item():.4g} > {rel} x {scale.item():.4g}"


def _body(rank, num_ranks, group):
    import os

    import uccl_ep_plugin as ep
    from uccl_ep_plugin.engines.reference.layout import dispatch_layout

    device = rank_device(rank)
    torch.cuda.set_device(device)
    # On a gloo group (vLLM builds its Buffer on the CPU group) CUDA tensors are staged through the host.
    os.environ["UCCL_EP_DEVICE"] = "cuda"
    num_tokens_limit, hidden, num_experts = 96, 1024, 32
    # Sizes or engines that differ between the ranks raise on every rank (over this group, before any mapping).
    with pytest.raises(ValueError, match="num_nvl_bytes must be the same on every rank"):
        ep.Buffer(group, num_nvl_bytes=(1 << 24) + (rank << 20))
    if "dispatch_layout" in ep.build_info()["features"]:   # else auto chooses the reference engine too
        with environment("UCCL_EP_ENGINE", "reference" if rank == 1 else "auto"), pytest.raises(
                ValueError, match="the engine of each operation"):
            ep.Buffer(group, num_nvl_bytes=1 << 24)
    buffer = ep.Buffer(group, num_nvl_bytes=1 << 24, low_latency_mode=True, explicitly_destroy=True,
                       num_rdma_bytes=ep.Buffer.get_low_latency_rdma_size_hint(num_tokens_limit, hidden, num_ranks,
                                                                             num_experts))
    assert buffer.device == device
    if "dispatch_layout" in ep.build_info()["features"]:
        assert buffer.engine_by_operation["get_dispatch_layout"] == "native"
    for seed, num_tokens, num_topk in ((1, 96, 8), (2, 1, 3), (3, 0, 5), (4, 77, 1)):
        x, topk_idx, weights = _routing(rank, seed, num_tokens, hidden, num_experts, num_topk, device)
        per_rank, per_rdma, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk_idx, num_experts)
        expected = dispatch_layout(topk_idx.cpu(), num_experts, num_ranks, None)
        assert per_rdma is None and expected[1] is None
        for got, want, name in zip((per_rank, per_expert, in_rank), (expected[0], expected[2], expected[3]),
                                   ("num_tokens_per_rank", "num_tokens_per_expert", "is_token_in_rank")):
            assert got.device == device and torch.equal(got.cpu(), want), f"seed {seed}: {name} differs"

        recv_total = per_rank.clone()
        dist.all_reduce(recv_total, group=group)
        recv_x, recv_idx, recv_w, counts, handle, event = buffer.dispatch(
            x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
            topk_idx=topk_idx, topk_weights=weights, async_finish=True)
        event.current_stream_wait()
        assert recv_x.device == device and recv_x.size(0) == int(recv_total[rank])
        combined, combined_w, _ = buffer.combine(recv_x, handle, recv_w)
        _assert_close(combined, x.float() * in_rank.sum(1, keepdim=True), 1e-2, f"seed {seed}: combine")
        kept = torch.where(topk_idx >= 0, weights, torch.zeros_like(weights))
        _assert_close(combined_w, kept, 1e-6, f"seed {seed}: combined topk weights")

        (data, scales), count, ll_handle, _, hook = buffer.low_latency_dispatch(
            x, topk_idx, num_tokens_limit, num_experts, use_fp8=True, return_recv_hook=True)
        hook()
        expert_out = (data.float() * scales.repeat_interleave(128, dim=-1)).to(torch.bfloat16)
        out = torch.full((num_tokens, hidden), float("nan"), dtype=torch.bfloat16, device=device)
        result, event, _ = buffer.low_latency_combine(expert_out, topk_idx, weights, ll_handle, out=out,
                                                      async_finish=True)
        event.current_stream_wait()
        assert result.data_ptr() == out.data_ptr()
        _assert_close(result, x.float() * kept.sum(1, keepdim=True), 6e-2, f"seed {seed}: low-latency combine")
    torch.cuda.synchronize(device)
    buffer.destroy()


@pytest.mark.parametrize("backend", ["nccl", "gloo"])
def test_reference_engine_on_gpu_tensors_matches_semantics(backend):
    run_ranks(2, _body, backend=backend)
