"""SGLang's own plugin loader finds and runs the ``uccl`` entry point."""

from sglang.srt.plugins import GENERAL_PLUGINS_GROUP, load_plugins_by_group


def test_loader_discovers_uccl_entry_point():
    import uccl_ep_plugin.integrations.sglang as plugin

    plugins = load_plugins_by_group(GENERAL_PLUGINS_GROUP)
    assert "uccl" in plugins, f"SGLang found {sorted(plugins)}"
    func, dist_name = plugins["uccl"]
    assert func is plugin.register
    assert dist_name == "uccl-ep-plugin"


def test_allowlist_keeps_uccl(monkeypatch):
    monkeypatch.setenv("SGLANG_PLUGINS", "uccl")
    assert "uccl" in load_plugins_by_group(GENERAL_PLUGINS_GROUP)
    monkeypatch.setenv("SGLANG_PLUGINS", "some_other_plugin")
    assert "uccl" not in load_plugins_by_group(GENERAL_PLUGINS_GROUP)


def test_load_plugins_applies_every_registry_hook(sglang_plugins_loaded):
    from sglang.srt.plugins.hook_registry import HookRegistry

    from uccl_ep_plugin.integrations.sglang.hook_points import HOOK_POINTS, REGISTRY_HOOK_TYPES

    for point in HOOK_POINTS:
        if point.how in REGISTRY_HOOK_TYPES:
            assert point.path in HookRegistry._patched, point.path
