"""``--all2all-backend uccl_*`` through vLLM's own parser and config validation (no GPU needed)."""

import pytest

from uccl_ep_plugin.integrations.vllm import UCCL_BACKENDS, register

register()


def serve_parser():
    """The parser ``vllm serve`` builds (ServeSubcommand.subparser_init calls make_arg_parser)."""
    from vllm.entrypoints.common.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    return make_arg_parser(FlexibleArgumentParser(prog="vllm serve"))


@pytest.mark.parametrize("backend", UCCL_BACKENDS)
def test_serve_parser_and_engine_args_accept(backend):
    from vllm.engine.arg_utils import EngineArgs

    args = serve_parser().parse_args(["some/model", "--enable-expert-parallel", "--data-parallel-size", "2",
                                      "--all2all-backend", backend])
    engine_args = EngineArgs.from_cli_args(args)
    assert engine_args.all2all_backend == backend


def test_serve_parser_still_rejects_unknown_backend(capsys):
    with pytest.raises(SystemExit):
        serve_parser().parse_args(["m", "--all2all-backend", "uccl_bogus"])
    assert "uccl_high_throughput" in capsys.readouterr().err


@pytest.mark.parametrize("backend,batched", [("uccl_high_throughput", False), ("uccl_low_latency", True)])
def test_parallel_config_validates_and_reads_like_deepep(backend, batched):
    from vllm.config.parallel import ParallelConfig

    config = ParallelConfig(all2all_backend=backend, enable_expert_parallel=True, data_parallel_size=2,
                            tensor_parallel_size=2)
    assert config.all2all_backend == backend
    assert config.use_all2all and config.use_sequence_parallel_moe
    assert config.use_batched_dp_moe is batched


def test_parallel_config_rejects_unknown_backend():
    import pydantic
    from vllm.config.parallel import ParallelConfig

    with pytest.raises(pydantic.ValidationError):
        ParallelConfig(all2all_backend="uccl_bogus")


def cudagraph_mode_for(backend):
    from vllm.config.compilation import CompilationConfig, CompilationMode, CUDAGraphMode

    config = CompilationConfig(mode=CompilationMode.VLLM_COMPILE, cudagraph_mode=CUDAGraphMode.PIECEWISE)
    config.set_splitting_ops_for_v1(all2all_backend=backend, data_parallel_size=2)
    return config.cudagraph_mode


@pytest.mark.parametrize("backend", UCCL_BACKENDS)
def test_cuda_graphs_off_while_reference_engine_serves(backend, monkeypatch):
    from uccl_ep_plugin import engines
    from vllm.config.compilation import CUDAGraphMode

    monkeypatch.setenv(engines.ENGINE_ENV, "reference")
    assert cudagraph_mode_for(backend) == CUDAGraphMode.NONE


@pytest.mark.parametrize("backend", UCCL_BACKENDS)
def test_cuda_graphs_kept_only_where_native_engine_serves_every_operation(backend, monkeypatch):
    """Where every operation runs natively, CUDA graphs follow vLLM's own choice for the DeepEP twin (it
    turns them off for the high-throughput twin, whose dispatch reads its counts on the host, as ours
    does); otherwise they are off."""
    import torch
    from uccl_ep_plugin import engines
    from uccl_ep_plugin.integrations.vllm.backends import twin
    from uccl_ep_plugin.integrations.vllm.capture import OPERATIONS
    from vllm.config.compilation import CUDAGraphMode

    monkeypatch.setenv(engines.ENGINE_ENV, "auto")
    choice = engines.choose("auto", torch.device("cuda"))
    all_native = all(choice.by_operation[operation] == "native" for operation in OPERATIONS[backend])
    assert cudagraph_mode_for(backend) == (cudagraph_mode_for(twin(backend)) if all_native else CUDAGraphMode.NONE)


def test_other_backends_untouched():
    from vllm.config.compilation import CompilationConfig, CompilationMode, CUDAGraphMode
    from vllm.config.parallel import ParallelConfig

    config = CompilationConfig(mode=CompilationMode.VLLM_COMPILE, cudagraph_mode=CUDAGraphMode.PIECEWISE)
    config.set_splitting_ops_for_v1(all2all_backend="deepep_low_latency", data_parallel_size=2)
    assert config.cudagraph_mode == CUDAGraphMode.PIECEWISE
    assert not ParallelConfig(all2all_backend="allgather_reducescatter", enable_expert_parallel=True,
                              data_parallel_size=2).use_batched_dp_moe


@pytest.mark.parametrize("backend,ht,ll", [("uccl_high_throughput", True, False), ("uccl_low_latency", False, True),
                                           ("deepep_high_throughput", True, False), ("naive", False, False)])
def test_fused_moe_parallel_config_predicates(backend, ht, ll):
    from vllm.model_executor.layers.fused_moe.config import FusedMoEParallelConfig

    config = FusedMoEParallelConfig(tp_size=1, pcp_size=1, dp_size=2, ep_size=2, tp_rank=0, pcp_rank=0, dp_rank=0,
                                    ep_rank=0, sp_size=1, use_ep=True, all2all_backend=backend, enable_eplb=False)
    assert (config.use_deepep_ht_kernels, config.use_deepep_ll_kernels) == (ht, ll)
    assert config.use_batched_activation_format is ll
