"""``--moe-a2a-backend uccl`` through SGLang's own parser and argument resolution (no launch)."""

import argparse

import pytest

from launch_args import BASE_ARGS


def _parse(extra):
    from sglang.srt.server_args import prepare_server_args

    # What sglang.launch_server does with sys.argv[1:] before run_server resolves it.
    return prepare_server_args(BASE_ARGS + extra)


def test_parser_lists_uccl(sglang_plugins_loaded):
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    backend = next(a for a in parser._actions if "--moe-a2a-backend" in a.option_strings)
    assert "uccl" in backend.choices and "deepep" in backend.choices
    assert any("--uccl-ep-config" in a.option_strings for a in parser._actions)


@pytest.mark.parametrize("mode", ["normal", "low_latency", "auto"])
def test_uccl_passes_parser_and_resolves_to_deepep_path(sglang_plugins_loaded, mode, monkeypatch):
    monkeypatch.delenv("UCCL_EP_CONFIG", raising=False)
    server_args = _parse(["--moe-a2a-backend", "uccl", "--deepep-mode", mode])
    assert server_args.moe_a2a_backend == "uccl"
    server_args.resolve_once()
    assert server_args.moe_a2a_backend == "deepep"
    assert server_args._uccl_ep_selected is True
    assert server_args.deepep_mode == mode


def test_deepep_config_is_kept(sglang_plugins_loaded, monkeypatch):
    monkeypatch.delenv("UCCL_EP_CONFIG", raising=False)
    tuned = '{"normal_dispatch": {"num_sms": 24}, "normal_combine": {"num_sms": 24}}'
    server_args = _parse(["--moe-a2a-backend", "uccl", "--deepep-config", tuned])
    server_args.resolve_once()
    assert server_args.deepep_config == tuned


def test_uccl_mark_travels_to_spawned_processes(sglang_plugins_loaded, monkeypatch):
    import pickle

    from uccl_ep_plugin.integrations.sglang.selection import record_selects_uccl

    monkeypatch.delenv("UCCL_EP_CONFIG", raising=False)
    server_args = _parse(["--moe-a2a-backend", "uccl"])
    server_args.resolve_once()
    copy = pickle.loads(pickle.dumps(server_args))   # how SGLang hands the record to schedulers
    assert copy.moe_a2a_backend == "deepep" and record_selects_uccl(copy)


def test_deepep_is_left_alone(sglang_plugins_loaded):
    from uccl_ep_plugin.integrations.sglang.selection import record_selects_uccl

    server_args = _parse(["--moe-a2a-backend", "deepep"])
    server_args.resolve_once()
    assert server_args.moe_a2a_backend == "deepep" and not record_selects_uccl(server_args)


def test_unknown_backend_still_rejected(sglang_plugins_loaded, capsys):
    with pytest.raises(SystemExit):
        _parse(["--moe-a2a-backend", "not_a_backend"])
    assert "invalid choice" in capsys.readouterr().err


def test_enum_converts_uccl(sglang_plugins_loaded):
    from sglang.srt.layers.moe.utils import MoeA2ABackend

    assert MoeA2ABackend("uccl") is MoeA2ABackend.DEEPEP
    assert MoeA2ABackend("deepep") is MoeA2ABackend.DEEPEP
    with pytest.raises(ValueError):
        MoeA2ABackend("not_a_backend")


def test_platform_flag_selects_config(sglang_plugins_loaded, monkeypatch):
    import os

    monkeypatch.setenv("UCCL_EP_CONFIG", "")
    server_args = _parse(["--moe-a2a-backend", "uccl", "--uccl-ep-config", "efa"])
    server_args.resolve_once()
    assert os.environ["UCCL_EP_CONFIG"] == "efa"   # inherited by the scheduler processes


@pytest.mark.parametrize("how", ["flag", "env"])
def test_bad_platform_config_stops_startup_naming_file_and_key(sglang_plugins_loaded, monkeypatch, tmp_path, how):
    from uccl_ep_plugin.platform_config import ConfigError

    bad = tmp_path / "bad-platform.yaml"
    bad.write_text("UCCL_IB_SL: 99\n")
    monkeypatch.setenv("UCCL_EP_CONFIG", str(bad) if how == "env" else "")
    extra = ["--uccl-ep-config", str(bad)] if how == "flag" else []
    server_args = _parse(["--moe-a2a-backend", "uccl"] + extra)
    with pytest.raises(ConfigError) as info:
        server_args.resolve_once()
    assert str(bad) in str(info.value) and "UCCL_IB_SL" in str(info.value)


def test_bad_platform_config_ignored_without_uccl(sglang_plugins_loaded, monkeypatch, tmp_path):
    bad = tmp_path / "bad-platform.yaml"
    bad.write_text("NOT_A_KEY: 1\n")
    monkeypatch.setenv("UCCL_EP_CONFIG", str(bad))
    _parse(["--moe-a2a-backend", "deepep"]).resolve_once()
