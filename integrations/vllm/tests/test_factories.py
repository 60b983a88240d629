"""vLLM's own factories build the uccl classes (2 spawned ranks over gloo; stand-ins in _ranks.py)."""

import pytest

import _scenarios
from _ranks import run_ranks

EXPECTED = {
    "uccl_high_throughput": ("UcclHTAll2AllManager", "UcclHTPrepareAndFinalize", "Standard", 2048),
    "uccl_low_latency": ("UcclLLAll2AllManager", "UcclLLPrepareAndFinalize", "BatchedExperts", 2048),
}


@pytest.mark.parametrize("backend", sorted(EXPECTED))
def test_communicator_and_prepare_finalize_factories(backend):
    manager, prepare_finalize, activation_format, rounded = EXPECTED[backend]
    for result in run_ranks(_scenarios.factories, backend):
        assert result["manager"] == manager
        assert result["prepare_finalize"] == prepare_finalize
        assert result["activation_format"] == activation_format
        assert result["buffer"] == "uccl_ep_plugin.buffer.Buffer"
        assert result["buffer_engine"] == "reference"
        assert result["rounded_hidden"] == rounded
        engine_lines = [line for line in result["log"] if "Buffer uses the" in line]
        assert engine_lines and "reference engine on cpu" in engine_lines[0]
        assert "because the native engine needs a CUDA device" in engine_lines[0]


def test_no_global_deep_ep_module():
    import sys

    from uccl_ep_plugin.integrations.vllm import prepare_finalize

    had_deep_ep = "deep_ep" in sys.modules          # a real DeepEP, if this environment has one
    names = prepare_finalize.bound_names()
    assert ("deep_ep" in sys.modules) == had_deep_ep
    uccl_class = names["DeepEPHTPrepareAndFinalize"]
    vllm_class = next(k for k in uccl_class.__mro__ if k.__name__ == "DeepEPHTPrepareAndFinalize")
    module = sys.modules[vllm_class.__module__]
    assert module.__name__.startswith("uccl_ep_plugin.integrations.vllm.bound.")
    assert module.deep_ep.__name__ == "uccl_ep_plugin"
