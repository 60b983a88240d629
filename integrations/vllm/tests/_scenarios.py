"""Bodies run in each of the 2 spawned ranks (see _ranks.run_ranks)."""

import torch

from _ranks import WORLD, vllm_ep_setup

NUM_EXPERTS = 8
TOPK = 2


def routed_tokens(rank: int, num_tokens: int, hidden: int):
    """Tokens, distinct top-k expert ids and weights exact in bf16, different on each rank."""
    generator = torch.Generator().manual_seed(1234 + rank)
    x = torch.randn(num_tokens, hidden, generator=generator).to(torch.bfloat16)
    scores = torch.rand(num_tokens, NUM_EXPERTS, generator=generator)
    topk_ids = torch.topk(scores, TOPK, dim=1).indices.to(torch.int64)
    topk_weights = torch.tensor([0.75, 0.25]).expand(num_tokens, TOPK).contiguous()
    return x, topk_ids, topk_weights


def expert_scale(global_expert: torch.Tensor) -> torch.Tensor:
    """Expert e multiplies its input by (e + 1) / 8 (exact in bf16)."""
    return (global_expert.to(torch.float32) + 1) / 8


def expected_output(x, topk_ids, topk_weights) -> torch.Tensor:
    scale = (topk_weights * expert_scale(topk_ids)).sum(dim=1, keepdim=True)
    return (x.to(torch.float32) * scale).to(torch.bfloat16)


def moe_config(all2all_manager, backend: str, hidden: int, max_num_tokens: int):
    from vllm.config import get_current_vllm_config
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation
    from vllm.model_executor.layers.fused_moe.config import (FusedMoEConfig, FusedMoEParallelConfig,
                                                             RoutingMethodType)

    parallel = FusedMoEParallelConfig.make(tp_size_=1, pcp_size_=1, dp_size_=WORLD, sp_size_=1,
                                           vllm_parallel_config=get_current_vllm_config().parallel_config)
    assert parallel.all2all_backend == backend and parallel.use_ep and parallel.ep_size == WORLD
    return FusedMoEConfig(
        num_experts=NUM_EXPERTS, experts_per_token=TOPK, hidden_dim=hidden, intermediate_size=hidden,
        num_local_experts=NUM_EXPERTS // WORLD, num_logical_experts=NUM_EXPERTS, activation=MoEActivation.SILU,
        device="cpu", routing_method=RoutingMethodType.Default, moe_parallel_config=parallel,
        in_dtype=torch.bfloat16, max_num_tokens=max_num_tokens)


def manager_and_prepare_finalize(rank: int, port: int, backend: str, hidden: int, max_num_tokens: int):
    from vllm.model_executor.layers.fused_moe import all2all_utils
    from vllm.model_executor.layers.fused_moe.config import FUSED_MOE_UNQUANTIZED_CONFIG

    communicator, _context = vllm_ep_setup(rank, port, backend)
    manager = communicator.all2all_manager
    moe = moe_config(manager, backend, hidden, max_num_tokens)
    prepare_finalize = all2all_utils.maybe_make_prepare_finalize(
        moe, FUSED_MOE_UNQUANTIZED_CONFIG, all2all_manager=manager)
    return manager, moe, prepare_finalize, FUSED_MOE_UNQUANTIZED_CONFIG


def factories(rank: int, port: int, backend: str):
    """Class names vLLM's own factories produce for ``backend``, plus the hidden-size rounding."""
    import logging

    from vllm.model_executor.layers.fused_moe import all2all_utils

    records = []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: records.append(record.getMessage())
    plugin_logger = logging.getLogger("vllm.uccl_ep_plugin")
    plugin_logger.addHandler(handler)
    plugin_logger.setLevel(logging.INFO)
    hidden = 2048
    manager, moe, prepare_finalize, _ = manager_and_prepare_finalize(rank, port, backend, hidden, 16)
    buffer = manager.get_handle({}) if backend == "uccl_high_throughput" else prepare_finalize.buffer
    rounded = all2all_utils.maybe_roundup_layer_hidden_size(2000, torch.bfloat16, moe.moe_parallel_config)
    return {
        "manager": type(manager).__name__,
        "prepare_finalize": type(prepare_finalize).__name__,
        "activation_format": prepare_finalize.activation_format.name,
        "buffer": f"{type(buffer).__module__}.{type(buffer).__name__}",
        "buffer_engine": buffer.engine,
        "rounded_hidden": rounded,
        "log": records,
    }


def high_throughput(rank: int, port: int, num_tokens: int = 24, hidden: int = 256):
    """Dispatch and combine through vLLM's DeepEP HT prepare/finalize (Standard format)."""
    from vllm.model_executor.layers.fused_moe.topk_weight_and_reduce import TopKWeightAndReduceNoOP

    manager, moe, prepare_finalize, quant_config = manager_and_prepare_finalize(
        rank, port, "uccl_high_throughput", hidden, num_tokens)
    x, topk_ids, topk_weights = routed_tokens(rank, num_tokens, hidden)
    expert_x, expert_x_scale, meta, expert_topk_ids, expert_topk_weights = prepare_finalize.prepare(
        x, topk_weights, topk_ids, NUM_EXPERTS, None, False, quant_config)
    assert expert_x_scale is None

    # The "experts": each received token times the weighted scales of the experts this rank holds.
    first = rank * moe.num_local_experts
    local = (expert_topk_ids >= first) & (expert_topk_ids < first + moe.num_local_experts)
    scale = (expert_topk_weights * expert_scale(expert_topk_ids) * local).sum(dim=1, keepdim=True)
    expert_out = (expert_x.to(torch.float32) * scale).to(torch.bfloat16)
    counts = meta.expert_num_tokens_cpu.tolist()
    assert counts == [int((expert_topk_ids == first + e).sum()) for e in range(moe.num_local_experts)]

    output = torch.empty_like(x)
    prepare_finalize.finalize(output, expert_out, topk_weights, topk_ids, False, TopKWeightAndReduceNoOP())
    torch.testing.assert_close(output, expected_output(x, topk_ids, topk_weights), rtol=2e-2, atol=2e-2)
    manager.destroy()
    return {"received": int(expert_x.size(0)), "per_expert": counts}


def low_latency(rank: int, port: int, num_tokens: int = 12, hidden: int = 2048):
    """Dispatch and combine through vLLM's DeepEP LL prepare/finalize (BatchedExperts format)."""
    from vllm.model_executor.layers.fused_moe.topk_weight_and_reduce import TopKWeightAndReduceDelegate

    manager, moe, prepare_finalize, quant_config = manager_and_prepare_finalize(
        rank, port, "uccl_low_latency", hidden, num_tokens)
    x, topk_ids, topk_weights = routed_tokens(rank, num_tokens, hidden)
    expert_x, expert_x_scale, meta, _, _ = prepare_finalize.prepare(
        x, topk_weights, topk_ids, NUM_EXPERTS, None, False, quant_config)
    assert expert_x_scale is None
    local_experts = moe.num_local_experts
    assert tuple(expert_x.shape) == (local_experts, WORLD * num_tokens, hidden)

    counts = meta.expert_num_tokens.tolist()
    expert_out = torch.zeros_like(expert_x)
    for e in range(local_experts):
        global_expert = torch.tensor(rank * local_experts + e)
        rows = expert_x[e, :counts[e]].to(torch.float32)
        expert_out[e, :counts[e]] = (rows * expert_scale(global_expert)).to(torch.bfloat16)

    output = torch.empty_like(x)
    prepare_finalize.finalize(output, expert_out, topk_weights, topk_ids, False, TopKWeightAndReduceDelegate())
    torch.testing.assert_close(output, expected_output(x, topk_ids, topk_weights), rtol=2e-2, atol=2e-2)
    manager.destroy()
    return {"per_expert": counts}
