"""A moved hook point or an unsupported SGLang release is reported by name before anything is hooked."""

import pytest

import uccl_ep_plugin.integrations.sglang as plugin
from uccl_ep_plugin.integrations.sglang import hook_points


def test_installed_version_is_supported():
    assert hook_points.check_sglang_compatibility() in hook_points.SUPPORTED_SGLANG_VERSIONS


def test_missing_function_is_named(monkeypatch):
    import sglang.srt.layers.moe.utils as moe_utils

    monkeypatch.delattr(moe_utils, "initialize_moe_config")
    with pytest.raises(hook_points.SglangHookPointMissing) as info:
        hook_points.check_sglang_compatibility()
    message = str(info.value)
    assert "sglang.srt.layers.moe.utils.initialize_moe_config" in message and "0.5.23" in message


def test_missing_method_is_named(monkeypatch):
    from sglang.srt.server_args import ServerArgs

    monkeypatch.delattr(ServerArgs, "resolve_once")
    with pytest.raises(hook_points.SglangHookPointMissing, match=r"ServerArgs\.resolve_once"):
        hook_points.check_sglang_compatibility()


def test_dispatcher_global_no_longer_read_is_named(monkeypatch):
    import sglang.srt.layers.moe.token_dispatcher.deepep as deepep

    def init_without_config(self):
        self.num_sms = 20

    monkeypatch.setattr(deepep.DeepEPConfig, "__init__", init_without_config)
    with pytest.raises(hook_points.SglangHookPointMissing) as info:
        hook_points.check_sglang_compatibility()
    assert "sglang.srt.layers.moe.token_dispatcher.deepep.Config" in str(info.value)


def test_unsupported_version_is_named(monkeypatch):
    monkeypatch.setattr(hook_points, "installed_sglang_version", lambda: "0.6.0")
    monkeypatch.delenv(hook_points.ALLOW_UNTESTED_ENV, raising=False)
    with pytest.raises(hook_points.UnsupportedSglangVersion, match=r"0\.6\.0.*0\.5\.23"):
        hook_points.check_sglang_compatibility()
    monkeypatch.setenv(hook_points.ALLOW_UNTESTED_ENV, "1")
    hook_points.check_sglang_compatibility()


def test_register_installs_nothing_on_drift(monkeypatch):
    import sglang.srt.layers.moe.utils as moe_utils
    from sglang.srt.plugins.hook_registry import HookRegistry

    monkeypatch.setattr(plugin, "_registered", False)
    monkeypatch.delattr(moe_utils.MoeA2ABackend, "_missing_")   # Enum's inherited one remains
    before = {target: list(hooks) for target, hooks in HookRegistry._hooks.items()}
    with pytest.raises(hook_points.SglangHookPointMissing, match="MoeA2ABackend._missing_"):
        plugin.register()
    assert {target: list(hooks) for target, hooks in HookRegistry._hooks.items() if hooks} == \
        {target: hooks for target, hooks in before.items() if hooks}
