"""vLLM's own plugin loader finds and runs the uccl entry point."""

import importlib.metadata

import pytest


def test_entry_point_is_declared():
    names = {ep.name: ep.value for ep in importlib.metadata.entry_points(group="vllm.general_plugins")}
    assert names.get("uccl") == "uccl_ep_plugin.integrations.vllm:register"


def test_vllm_loader_discovers_and_runs_register(monkeypatch):
    import vllm.plugins as plugins
    from vllm.config.parallel import ParallelConfig

    monkeypatch.setenv("VLLM_PLUGINS", "uccl")
    found = plugins.load_plugins_by_group(plugins.DEFAULT_PLUGINS_GROUP)
    assert set(found) == {"uccl"}
    from uccl_ep_plugin.integrations.vllm import register
    assert found["uccl"] is register
    monkeypatch.setattr(plugins, "plugins_loaded", False)
    plugins.load_general_plugins()
    assert "uccl_high_throughput" in str(ParallelConfig.__dataclass_fields__["all2all_backend"].type)


def test_allowlist_without_uccl_skips_it(monkeypatch):
    import vllm.plugins as plugins

    monkeypatch.setenv("VLLM_PLUGINS", "someone_else")
    assert "uccl" not in plugins.load_plugins_by_group(plugins.DEFAULT_PLUGINS_GROUP)


def test_bad_platform_config_stops_registration(tmp_path, monkeypatch):
    import uccl_ep_plugin.integrations.vllm as plugin
    from uccl_ep_plugin.platform_config import ConfigError

    bad = tmp_path / "broken.yaml"
    bad.write_text("UCCL_NO_SUCH_KEY: 1\n")
    monkeypatch.setenv("UCCL_EP_CONFIG", str(bad))
    monkeypatch.setattr(plugin, "_registered", False)
    with pytest.raises(ConfigError) as error:
        plugin.register()
    assert str(bad) in str(error.value) and "UCCL_NO_SUCH_KEY" in str(error.value)
