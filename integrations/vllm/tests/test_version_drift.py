"""A vLLM that moved a patch point, or an unsupported version, stops register() with a named error."""

import pytest

import uccl_ep_plugin.integrations.vllm as plugin
from uccl_ep_plugin.integrations.vllm import VllmPatchError, patches_0_33, versions


@pytest.fixture
def fresh(monkeypatch):
    monkeypatch.setattr(plugin, "_registered", False)


@pytest.mark.parametrize("module,owner,attribute,dotted", [
    ("vllm.distributed.device_communicators.cuda_communicator", "CudaCommunicator", "__init__",
     "vllm.distributed.device_communicators.cuda_communicator:CudaCommunicator.__init__"),
    ("vllm.model_executor.layers.fused_moe.config", "FusedMoEParallelConfig", "use_deepep_ht_kernels",
     "vllm.model_executor.layers.fused_moe.config:FusedMoEParallelConfig.use_deepep_ht_kernels"),
    ("vllm.distributed.device_communicators.all2all", None, "DeepEPLLAll2AllManager",
     "vllm.distributed.device_communicators.all2all:DeepEPLLAll2AllManager"),
])
def test_missing_patch_point_is_named(fresh, monkeypatch, module, owner, attribute, dotted):
    import importlib

    target = importlib.import_module(module)
    if owner is not None:
        target = getattr(target, owner)
    monkeypatch.delattr(target, attribute)
    with pytest.raises(VllmPatchError) as error:
        plugin.register()
    assert dotted in str(error.value)


def test_factory_that_stops_reading_the_names_is_named(fresh, monkeypatch):
    from vllm.model_executor.layers.fused_moe import all2all_utils

    monkeypatch.setattr(all2all_utils, "maybe_make_prepare_finalize", lambda *a, **k: None)
    with pytest.raises(VllmPatchError) as error:
        plugin.register()
    assert "all2all_utils:maybe_make_prepare_finalize" in str(error.value)
    assert "DeepEPHTPrepareAndFinalize" in str(error.value)


def test_missing_bound_module_is_named(fresh, monkeypatch):
    moved = dict(patches_0_33.BOUND_MODULES)
    moved["vllm.model_executor.layers.fused_moe.prepare_finalize.deepep_ht"] = ("DeepEPHTPrepareAndFinalizeV2",)
    monkeypatch.setattr(patches_0_33, "BOUND_MODULES", moved)
    with pytest.raises(VllmPatchError) as error:
        plugin.register()
    assert "deepep_ht:DeepEPHTPrepareAndFinalizeV2 does not exist" in str(error.value)


def test_unsupported_version_names_supported_ones(fresh, monkeypatch):
    monkeypatch.setattr(versions, "installed_version", lambda: "0.99.0")
    monkeypatch.delenv(versions.ALLOW_UNTESTED_ENV, raising=False)
    with pytest.raises(VllmPatchError) as error:
        plugin.register()
    assert "vLLM 0.99.0 on the cpu platform is not supported" in str(error.value)
    assert "0.32.0 (cpu), 0.33.0 (any platform)" in str(error.value)


def test_release_parsing():
    assert versions.release("0.33.0+cpu") == "0.33.0"
    assert versions.release("0.33.0rc1.dev5+g12") == "0.33.0"


def test_register_is_idempotent():
    plugin.register()
    plugin.register()
    from vllm.config.parallel import ParallelConfig
    import typing
    args = typing.get_args(ParallelConfig.__dataclass_fields__["all2all_backend"].type)
    assert args.count("uccl_high_throughput") == 1
