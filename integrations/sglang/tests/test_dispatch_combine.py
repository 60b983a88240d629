"""Dispatch + combine through SGLang's own DeepEP dispatcher classes with ``--moe-a2a-backend uccl``.

Two spawned processes join a gloo group; each runs what an SGLang scheduler runs at start-up
(``load_plugins``, ``prepare_server_args``, ``publish(role="scheduler")``,
``initialize_moe_config``), builds ``MaybeTboDeepEPDispatcher`` (the class SGLang's
``create_moe_dispatcher`` returns for deepep) and drives dispatch -> stand-in experts ->
combine, comparing with a locally computed result. The Buffer is uccl_ep_plugin's, on the
reference engine over gloo.

Stand-ins (the smallest pieces SGLang's classes need that only exist on GPUs):
  1. ``torch.cuda.get_device_properties`` returns an object with ``multi_processor_count``:
     ``DeepEPBuffer.get_deepep_buffer`` reads the GPU's SM count to warn about too few
     communication SMs.
  2. ``deep_gemm_wrapper.ENABLE_JIT_DEEPGEMM = True``: normal-mode ``combine_a`` raises
     NotImplementedError unless DeepGEMM (or AITER/NPU) runs the experts; on GPUs DeepGEMM is
     what runs them. With bf16 dispatch it only changes ``expert_alignment`` to 128.
  3. The communication group is ``torch.distributed``'s WORLD gloo group, standing in for
     ``get_parallel().tp_group.device_group`` (SGLang's parallel state is not initialised).
  4. The experts: each local expert ``e`` multiplies its rows by ``e + 1``.
"""

import os
import traceback
from types import SimpleNamespace

import pytest

from launch_args import BASE_ARGS
from uccl_ep_plugin.local_port import free_local_port

WORLD = 2
HIDDEN = 256
TOPK = 4
NUM_EXPERTS = 8
TOKENS = (13, 7)            # tokens per rank: ranks send different amounts


def _install_gpu_stand_ins():
    import torch

    from sglang.srt.layers import deep_gemm_wrapper

    torch.cuda.get_device_properties = lambda *a, **k: SimpleNamespace(multi_processor_count=132)  # stand-in 1
    deep_gemm_wrapper.ENABLE_JIT_DEEPGEMM = True                                                     # stand-in 2


def _routing(rank, num_tokens):
    import torch

    gen = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(num_tokens, HIDDEN, generator=gen).bfloat16()
    logits = torch.rand(num_tokens, NUM_EXPERTS, generator=gen)
    weights, ids = torch.topk(logits.softmax(-1), TOPK)
    ids = ids.to(torch.int32)
    ids[0, -1] = -1                              # a padded slot, as SGLang marks them
    weights[0, -1] = 0.0
    return x, weights.float(), ids, logits


def _expected(x, weights, ids):
    import torch

    factor = ((ids.to(torch.float32) + 1) * weights * (ids >= 0)).sum(-1, keepdim=True)
    return x.float() * factor


def _experts_normal(output, rank, num_local):
    """Stand-in 4 on a normal-mode dispatch: sum of weight * (global expert + 1) * row per local expert."""
    import torch

    ids, weights = output.topk_ids, output.topk_weights
    global_ids = torch.where(ids >= 0, ids + rank * num_local, torch.full_like(ids, -1))
    factor = ((global_ids.to(torch.float32) + 1) * weights * (global_ids >= 0)).sum(-1, keepdim=True)
    return (output.hidden_states.float() * factor).bfloat16()


def _experts_low_latency(output, rank, num_local):
    """Stand-in 4 on a low-latency dispatch: rows of local expert e times (global e + 1)."""
    hidden = output.hidden_states.float().clone()
    for e in range(num_local):
        count = int(output.masked_m[e])
        hidden[e, :count] *= rank * num_local + e + 1
        hidden[e, count:] = 0
    return hidden.bfloat16()


def _run_rank(rank, port, mode, results):
    try:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), UCCL_EP_TIMEOUT_SECONDS="120")
        os.environ.pop("UCCL_EP_CONFIG", None)
        import torch
        import torch.distributed as dist

        dist.init_process_group("gloo", rank=rank, world_size=WORLD)

        # What an SGLang scheduler process does at start-up.
        from sglang.srt.plugins import load_plugins
        from sglang.srt.runtime_context import publish
        from sglang.srt.server_args import prepare_server_args

        load_plugins()
        server_args = prepare_server_args(BASE_ARGS + ["--moe-a2a-backend", "uccl", "--deepep-mode", mode,
                                                       "--deepep-dispatcher-output-dtype", "bf16"])
        publish(server_args, role="scheduler")
        from sglang.srt.layers.moe.utils import get_deepep_mode, get_moe_a2a_backend, initialize_moe_config

        initialize_moe_config()
        _install_gpu_stand_ins()

        import uccl_ep_plugin
        from sglang.srt.batch_overlap.two_batch_overlap import MaybeTboDeepEPDispatcher
        from sglang.srt.layers.dp_attention import set_is_extend_in_batch
        from sglang.srt.layers.moe.token_dispatcher import deepep
        from sglang.srt.layers.moe.token_dispatcher.base import DispatchOutputFormat
        from sglang.srt.layers.moe.topk import StandardTopKOutput

        assert get_moe_a2a_backend().is_deepep()
        assert deepep.Buffer is uccl_ep_plugin.Buffer and deepep.Config is uccl_ep_plugin.Config
        num_local = NUM_EXPERTS // WORLD
        dispatcher = MaybeTboDeepEPDispatcher(
            runner_backend=None, group=dist.group.WORLD, router_topk=TOPK, permute_fusion=True,   # stand-in 3
            num_experts=NUM_EXPERTS, num_local_experts=num_local, hidden_size=HIDDEN,
            params_dtype=torch.bfloat16, deepep_mode=get_deepep_mode(), async_finish=True, return_recv_hook=True)
        assert all(type(inner) is deepep.DeepEPDispatcher for inner in dispatcher._inners)

        # auto: prefill (extend) batches take the normal kernels, decode batches low-latency ones.
        phases = {"normal": [True], "low_latency": [False], "auto": [True, False, True]}[mode]
        formats = []
        for step, is_extend in enumerate(phases):
            set_is_extend_in_batch(is_extend)
            x, weights, ids, logits = _routing(rank + 10 * step, TOKENS[rank])
            output = dispatcher.dispatch(hidden_states=x, topk_output=StandardTopKOutput(weights, ids, logits))
            formats.append(output.format.name)
            if output.format == DispatchOutputFormat.DEEPEP_NORMAL:
                combine_input = deepep.DeepEPNormalCombineInput(
                    _experts_normal(output, rank, num_local), output.topk_ids, output.topk_weights)
            else:
                assert output.format == DispatchOutputFormat.DEEPEP_LL
                combine_input = deepep.DeepEPLLCombineInput(
                    _experts_low_latency(output, rank, num_local), output.topk_ids, output.topk_weights)
            combined = dispatcher.combine(combine_input=combine_input)
            torch.testing.assert_close(combined.float(), _expected(x, weights, ids), rtol=2e-2, atol=2e-2)

        buffer = deepep.DeepEPBuffer._state().buffer
        assert isinstance(buffer, uccl_ep_plugin.Buffer)
        results.put((rank, "ok", {"formats": formats, "engine": buffer.engine,
                                  "low_latency_mode": buffer.low_latency_mode}))
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:
        results.put((rank, "error", traceback.format_exc()))


@pytest.mark.timeout(600)
@pytest.mark.parametrize("mode", ["normal", "low_latency", "auto"])
def test_dispatch_combine_through_sglang_dispatcher(mode):
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    port = free_local_port()
    procs = [ctx.Process(target=_run_rank, args=(rank, port, mode, results)) for rank in range(WORLD)]
    for proc in procs:
        proc.start()
    outcomes = {}
    try:
        for _ in range(WORLD):
            rank, status, detail = results.get(timeout=540)
            outcomes[rank] = (status, detail)
    finally:
        for proc in procs:
            proc.join(timeout=60)
            if proc.is_alive():
                proc.kill()
    errors = {rank: detail for rank, (status, detail) in outcomes.items() if status != "ok"}
    assert not errors, "\n".join(f"rank {rank}:\n{text}" for rank, text in errors.items())
    expected_formats = {"normal": ["DEEPEP_NORMAL"], "low_latency": ["DEEPEP_LL"],
                        "auto": ["DEEPEP_NORMAL", "DEEPEP_LL", "DEEPEP_NORMAL"]}[mode]
    for rank, (_, detail) in outcomes.items():
        assert detail["formats"] == expected_formats, (rank, detail)
        assert detail["engine"] == "reference", (rank, detail)
        assert detail["low_latency_mode"] == (mode != "normal"), (rank, detail)
