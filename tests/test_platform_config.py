"""Tests of the platform config files, their validation, detection and layering."""

import json

import pytest

from uccl_ep_plugin.platform_config import (
    CONFIG_ENV_VAR, PLATFORM_PRIORITY, SCHEMA, ConfigError, available_platforms, config_dir,
    detect_platform, detect_rdma_devices, detected_platforms, load_file, resolve_config)
from uccl_ep_plugin.platform_config import loader as loader_module
from uccl_ep_plugin.platform_config.schema import check_value, parse_string

_REAL_GPU_IS_AMD = loader_module._gpu_is_amd

PLATFORMS = ["amd-pollara", "broadcom-thor2", "efa", "nvidia-connectx"]

DEFAULTS = {
    "UCCL_SOCKET_IFNAME": None,
    "UCCL_IB_GID_INDEX": -1,
    "UCCL_IB_MAX_INFLIGHT_BYTES": None,
    "UCCL_IB_MAX_INFLIGHT_NORMAL": 8,
    "UCCL_IB_MAX_INFLIGHT_LOW_LATENCY": 32,
    "UCCL_IB_SL": 3,
    "UCCL_IB_TC": 104,
    "UCCL_IB_QPS_PER_PEER": 1,
    "UCCL_EP_ENABLE_AGGRESSIVE_ATOMIC": None,
    "UCCL_RDMA_ADAPTIVE_SLEEP": 0,
    "UCCL_IB_NATIVE_ATOMICS": 1,
}

# The values each platform changes relative to the defaults.
PLATFORM_CHANGES = {
    "efa": {"UCCL_IB_SL": 8, "UCCL_IB_TC": 0},
    "broadcom-thor2": {"UCCL_IB_MAX_INFLIGHT_BYTES": 1572864, "UCCL_IB_MAX_INFLIGHT_NORMAL": 1},
    "amd-pollara": {"UCCL_IB_MAX_INFLIGHT_BYTES": 2097152, "UCCL_IB_MAX_INFLIGHT_NORMAL": 1},
    "nvidia-connectx": {},
}

DEVICE_FOR = {
    "efa": "rdmap16s27",
    "broadcom-thor2": "bnxt_re0",
    "amd-pollara": "ionic_0",
    "nvidia-connectx": "mlx5_0",
}


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch):
    """No UCCL_* variable of the developer's shell may leak into a test."""
    for key in list(SCHEMA) + [CONFIG_ENV_VAR]:
        monkeypatch.delenv(key, raising=False)
    # Pin the GPU vendor so results do not depend on the installed torch.
    monkeypatch.setattr(loader_module, "_gpu_is_amd", lambda: False)


def fake_sysfs(root, *device_names):
    ib = root / "sys" / "class" / "infiniband"
    ib.mkdir(parents=True, exist_ok=True)
    for name in device_names:
        (ib / name).mkdir()
    return str(root)


def write(path, text):
    path.write_text(text)
    return str(path)


# --------------------------------------------------------------------------- shipped files


def test_available_platforms_lists_exactly_the_shipped_files():
    assert available_platforms() == PLATFORMS


def test_config_dir_holds_every_file():
    folder = config_dir()
    names = sorted(entry.name for entry in folder.iterdir() if entry.name.endswith(".yaml"))
    assert names == sorted(["default.yaml"] + [p + ".yaml" for p in PLATFORMS])


def test_default_file_sets_every_key_with_documented_defaults():
    label, platform, settings = load_file("default")
    assert label == "default.yaml"
    assert platform is None
    assert settings == DEFAULTS


@pytest.mark.parametrize("name", PLATFORMS)
def test_every_platform_file_loads_and_names_itself(name):
    label, platform, settings = load_file(name)
    assert label == name + ".yaml"
    assert platform == name
    assert set(settings) <= set(SCHEMA)
    # The file's own `platform:` line must match its file name.
    text = config_dir().joinpath(name + ".yaml").read_text()
    assert "platform: %s\n" % name in text
    # Only the keys the platform changes are listed.
    assert settings == PLATFORM_CHANGES[name]


def test_every_non_default_value_has_a_comment():
    for name in PLATFORMS:
        lines = config_dir().joinpath(name + ".yaml").read_text().splitlines()
        for index, line in enumerate(lines):
            if line.startswith("UCCL_"):
                assert index > 0 and lines[index - 1].startswith("#"), (name, line)


# --------------------------------------------------------------------------- resolution


def test_defaults_only_without_nics(tmp_path):
    cfg = resolve_config(environ={}, root=str(tmp_path))
    expected = dict(DEFAULTS, UCCL_EP_ENABLE_AGGRESSIVE_ATOMIC=0)
    assert cfg.values == expected
    assert list(cfg.values) == list(SCHEMA)
    assert cfg.platform is None
    assert cfg.detected_platform is None
    assert cfg.files == ["default.yaml"]
    for key in SCHEMA:
        if key == "UCCL_EP_ENABLE_AGGRESSIVE_ATOMIC":
            assert cfg.sources[key] == "auto (GPU vendor)"
        else:
            assert cfg.sources[key] == "default.yaml"


def test_aggressive_atomic_auto_is_1_on_amd(tmp_path, monkeypatch):
    monkeypatch.setattr(loader_module, "_gpu_is_amd", lambda: True)
    cfg = resolve_config(environ={}, root=str(tmp_path))
    assert cfg.values["UCCL_EP_ENABLE_AGGRESSIVE_ATOMIC"] == 1
    assert cfg.sources["UCCL_EP_ENABLE_AGGRESSIVE_ATOMIC"] == "auto (GPU vendor)"


def test_aggressive_atomic_explicit_value_beats_auto(tmp_path, monkeypatch):
    monkeypatch.setattr(loader_module, "_gpu_is_amd", lambda: True)
    cfg = resolve_config(environ={"UCCL_EP_ENABLE_AGGRESSIVE_ATOMIC": "0"}, root=str(tmp_path))
    assert cfg.values["UCCL_EP_ENABLE_AGGRESSIVE_ATOMIC"] == 0
    assert cfg.sources["UCCL_EP_ENABLE_AGGRESSIVE_ATOMIC"] == "environment"


def test_gpu_vendor_follows_torch_version_hip(monkeypatch):
    import torch
    monkeypatch.setattr(torch.version, "hip", "6.2.0", raising=False)
    assert _REAL_GPU_IS_AMD() is True
    monkeypatch.setattr(torch.version, "hip", None, raising=False)
    assert _REAL_GPU_IS_AMD() is False


@pytest.mark.parametrize("name", PLATFORMS)
def test_each_platform_values(name, tmp_path):
    cfg = resolve_config(platform=name, environ={}, root=str(tmp_path))
    expected = dict(DEFAULTS, UCCL_EP_ENABLE_AGGRESSIVE_ATOMIC=0)
    expected.update(PLATFORM_CHANGES[name])
    assert cfg.values == expected
    assert cfg.platform == name
    for key in SCHEMA:
        if key in PLATFORM_CHANGES[name]:
            assert cfg.sources[key] == name + ".yaml"
        elif key != "UCCL_EP_ENABLE_AGGRESSIVE_ATOMIC":
            assert cfg.sources[key] == "default.yaml"


def test_platform_seed_values_explicitly():
    efa = resolve_config(platform="efa", environ={}, root="/nonexistent-root")
    assert (efa.values["UCCL_IB_SL"], efa.values["UCCL_IB_TC"]) == (8, 0)
    thor = resolve_config(platform="broadcom-thor2", environ={}, root="/nonexistent-root")
    assert thor.values["UCCL_IB_MAX_INFLIGHT_BYTES"] == 1572864
    assert thor.values["UCCL_IB_MAX_INFLIGHT_NORMAL"] == 1
    pollara = resolve_config(platform="amd-pollara", environ={}, root="/nonexistent-root")
    assert pollara.values["UCCL_IB_MAX_INFLIGHT_BYTES"] == 2097152
    assert pollara.values["UCCL_IB_MAX_INFLIGHT_NORMAL"] == 1
    cx = resolve_config(platform="nvidia-connectx", environ={}, root="/nonexistent-root")
    assert (cx.values["UCCL_IB_SL"], cx.values["UCCL_IB_TC"]) == (3, 104)


def test_precedence_every_level(tmp_path):
    # Detected: efa (sets SL and TC). Chosen: broadcom-thor2 (bytes, normal) plus a user
    # file that also sets TC. Environment: NORMAL and LOW_LATENCY. Argument: LOW_LATENCY.
    root = fake_sysfs(tmp_path / "root", "rdmap0s6")
    user = write(tmp_path / "mine.yaml", "UCCL_IB_TC: 96\nUCCL_IB_MAX_INFLIGHT_NORMAL: 2\n")
    environ = {"UCCL_IB_MAX_INFLIGHT_NORMAL": "4", "UCCL_IB_MAX_INFLIGHT_LOW_LATENCY": "64"}
    cfg = resolve_config(platform="broadcom-thor2", config_file=user,
                         overrides={"UCCL_IB_MAX_INFLIGHT_LOW_LATENCY": 16},
                         environ=environ, root=root)
    v, s = cfg.values, cfg.sources
    # argument beats environment
    assert v["UCCL_IB_MAX_INFLIGHT_LOW_LATENCY"] == 16
    assert s["UCCL_IB_MAX_INFLIGHT_LOW_LATENCY"] == "argument"
    # environment beats the chosen files
    assert v["UCCL_IB_MAX_INFLIGHT_NORMAL"] == 4
    assert s["UCCL_IB_MAX_INFLIGHT_NORMAL"] == "environment"
    # the chosen user file beats the detected platform
    assert v["UCCL_IB_TC"] == 96
    assert s["UCCL_IB_TC"] == user
    # the chosen platform file beats the defaults
    assert v["UCCL_IB_MAX_INFLIGHT_BYTES"] == 1572864
    assert s["UCCL_IB_MAX_INFLIGHT_BYTES"] == "broadcom-thor2.yaml"
    # the detected platform beats the defaults
    assert v["UCCL_IB_SL"] == 8
    assert s["UCCL_IB_SL"] == "efa.yaml (auto-detected)"
    # the defaults fill the rest
    assert v["UCCL_IB_GID_INDEX"] == -1
    assert s["UCCL_IB_GID_INDEX"] == "default.yaml"
    assert cfg.platform == "broadcom-thor2"
    assert cfg.detected_platform == "efa"
    assert cfg.files == ["default.yaml", "efa.yaml", "broadcom-thor2.yaml", user]


def test_chosen_platform_beats_detected_platform(tmp_path):
    root = fake_sysfs(tmp_path, "rdmap0")
    cfg = resolve_config(platform="nvidia-connectx", environ={}, root=root)
    # nvidia-connectx sets nothing, so efa's detected values stay.
    assert cfg.values["UCCL_IB_SL"] == 8
    assert cfg.platform == "nvidia-connectx"
    cfg = resolve_config(platform="amd-pollara", environ={}, root=fake_sysfs(tmp_path / "b",
                                                                             "bnxt_re0"))
    assert cfg.values["UCCL_IB_MAX_INFLIGHT_BYTES"] == 2097152
    assert cfg.sources["UCCL_IB_MAX_INFLIGHT_BYTES"] == "amd-pollara.yaml"


@pytest.mark.parametrize("name", PLATFORMS)
def test_detected_platform_file_is_applied(name, tmp_path):
    root = fake_sysfs(tmp_path, DEVICE_FOR[name])
    cfg = resolve_config(environ={}, root=root)
    assert cfg.platform == name
    assert cfg.detected_platform == name
    assert cfg.rdma_devices == [(DEVICE_FOR[name], name)]
    for key, value in PLATFORM_CHANGES[name].items():
        assert cfg.values[key] == value
        assert cfg.sources[key] == "%s.yaml (auto-detected)" % name


def test_environment_beats_detected_and_default(tmp_path):
    root = fake_sysfs(tmp_path, "rdmap0")
    cfg = resolve_config(environ={"UCCL_IB_SL": "5", "UCCL_SOCKET_IFNAME": "ens5",
                                  "UCCL_RDMA_ADAPTIVE_SLEEP": "1"}, root=root)
    assert cfg.values["UCCL_IB_SL"] == 5
    assert cfg.values["UCCL_SOCKET_IFNAME"] == "ens5"
    assert cfg.values["UCCL_RDMA_ADAPTIVE_SLEEP"] == 1
    for key in ("UCCL_IB_SL", "UCCL_SOCKET_IFNAME", "UCCL_RDMA_ADAPTIVE_SLEEP"):
        assert cfg.sources[key] == "environment"
    assert cfg.values["UCCL_IB_TC"] == 0  # still from detected efa


def test_environ_defaults_to_os_environ(tmp_path, monkeypatch):
    monkeypatch.setenv("UCCL_IB_GID_INDEX", "3")
    cfg = resolve_config(root=str(tmp_path))
    assert cfg.values["UCCL_IB_GID_INDEX"] == 3
    assert cfg.sources["UCCL_IB_GID_INDEX"] == "environment"


def test_empty_environment_value_is_ignored(tmp_path):
    cfg = resolve_config(environ={"UCCL_IB_SL": "", "UCCL_IB_TC": "  "}, root=str(tmp_path))
    assert cfg.values["UCCL_IB_SL"] == 3
    assert cfg.sources["UCCL_IB_TC"] == "default.yaml"


def test_environment_parsing_by_type(tmp_path):
    cfg = resolve_config(environ={
        "UCCL_IB_TC": " 0x68 ",
        "UCCL_IB_MAX_INFLIGHT_BYTES": "none",
        "UCCL_EP_ENABLE_AGGRESSIVE_ATOMIC": "true",
        "UCCL_IB_GID_INDEX": "-1",
    }, root=str(tmp_path))
    assert cfg.values["UCCL_IB_TC"] == 104
    assert cfg.values["UCCL_IB_MAX_INFLIGHT_BYTES"] is None
    assert cfg.sources["UCCL_IB_MAX_INFLIGHT_BYTES"] == "environment"
    assert cfg.values["UCCL_EP_ENABLE_AGGRESSIVE_ATOMIC"] == 1


def test_environment_null_clears_platform_value(tmp_path):
    cfg = resolve_config(platform="amd-pollara",
                         environ={"UCCL_IB_MAX_INFLIGHT_BYTES": "unlimited"}, root=str(tmp_path))
    assert cfg.values["UCCL_IB_MAX_INFLIGHT_BYTES"] is None
    assert "UCCL_IB_MAX_INFLIGHT_BYTES" not in cfg.as_environ()


def test_uccl_ep_config_env_names_a_platform(tmp_path):
    cfg = resolve_config(environ={CONFIG_ENV_VAR: "efa"}, root=str(tmp_path))
    assert cfg.platform == "efa"
    assert cfg.values["UCCL_IB_SL"] == 8
    assert cfg.sources["UCCL_IB_SL"] == "efa.yaml (UCCL_EP_CONFIG)"


def test_uccl_ep_config_env_gives_a_path(tmp_path):
    path = write(tmp_path / "site.yaml", "platform: my-cluster\nUCCL_IB_GID_INDEX: 3\n")
    cfg = resolve_config(environ={CONFIG_ENV_VAR: path}, root=str(tmp_path))
    assert cfg.values["UCCL_IB_GID_INDEX"] == 3
    assert cfg.sources["UCCL_IB_GID_INDEX"] == path + " (UCCL_EP_CONFIG)"
    assert cfg.platform == "my-cluster"


def test_explicit_choice_ignores_uccl_ep_config(tmp_path):
    cfg = resolve_config(platform="broadcom-thor2", environ={CONFIG_ENV_VAR: "efa"},
                         root=str(tmp_path))
    assert cfg.platform == "broadcom-thor2"
    assert cfg.values["UCCL_IB_SL"] == 3


def test_platform_argument_accepts_a_path_and_config_file_a_name(tmp_path):
    path = write(tmp_path / "x.yaml", "UCCL_IB_SL: 1\n")
    cfg = resolve_config(platform=path, environ={}, root=str(tmp_path))
    assert cfg.values["UCCL_IB_SL"] == 1
    assert cfg.sources["UCCL_IB_SL"] == path
    cfg = resolve_config(config_file="efa", environ={}, root=str(tmp_path))
    assert cfg.values["UCCL_IB_SL"] == 8
    assert cfg.platform == "efa"


def test_user_file_without_platform_label_keeps_detected_platform(tmp_path):
    root = fake_sysfs(tmp_path / "root", "ionic_0")
    path = write(tmp_path / "tune.yaml", "UCCL_IB_MAX_INFLIGHT_NORMAL: 2\n")
    cfg = resolve_config(config_file=path, environ={}, root=root)
    assert cfg.platform == "amd-pollara"
    assert cfg.values["UCCL_IB_MAX_INFLIGHT_NORMAL"] == 2
    assert cfg.values["UCCL_IB_MAX_INFLIGHT_BYTES"] == 2097152


def test_empty_user_file_changes_nothing(tmp_path):
    path = write(tmp_path / "empty.yaml", "# nothing here\n")
    cfg = resolve_config(config_file=path, environ={}, root=str(tmp_path))
    assert cfg.values == dict(DEFAULTS, UCCL_EP_ENABLE_AGGRESSIVE_ATOMIC=0)


def test_overrides_accept_strings_and_booleans(tmp_path):
    cfg = resolve_config(overrides={"UCCL_IB_SL": "7", "UCCL_RDMA_ADAPTIVE_SLEEP": True,
                                    "UCCL_SOCKET_IFNAME": "eth1"},
                         environ={"UCCL_IB_SL": "5"}, root=str(tmp_path))
    assert cfg.values["UCCL_IB_SL"] == 7
    assert cfg.values["UCCL_RDMA_ADAPTIVE_SLEEP"] == 1
    assert cfg.values["UCCL_SOCKET_IFNAME"] == "eth1"
    assert cfg.sources["UCCL_IB_SL"] == "argument"


def test_as_environ(tmp_path):
    cfg = resolve_config(platform="broadcom-thor2", overrides={"UCCL_SOCKET_IFNAME": "eth0"},
                         environ={}, root=str(tmp_path))
    env = cfg.as_environ()
    assert env == {
        "UCCL_SOCKET_IFNAME": "eth0",
        "UCCL_IB_GID_INDEX": "-1",
        "UCCL_IB_MAX_INFLIGHT_BYTES": "1572864",
        "UCCL_IB_MAX_INFLIGHT_NORMAL": "1",
        "UCCL_IB_MAX_INFLIGHT_LOW_LATENCY": "32",
        "UCCL_IB_SL": "3",
        "UCCL_IB_TC": "104",
        "UCCL_IB_QPS_PER_PEER": "1",
        "UCCL_EP_ENABLE_AGGRESSIVE_ATOMIC": "0",
        "UCCL_RDMA_ADAPTIVE_SLEEP": "0",
        "UCCL_IB_NATIVE_ATOMICS": "1",
    }
    assert all(isinstance(value, str) for value in env.values())
    defaults_env = resolve_config(environ={}, root=str(tmp_path)).as_environ()
    assert "UCCL_SOCKET_IFNAME" not in defaults_env
    assert "UCCL_IB_MAX_INFLIGHT_BYTES" not in defaults_env


def test_as_environ_round_trips_through_the_environment(tmp_path):
    cfg = resolve_config(platform="efa", environ={}, root=str(tmp_path))
    again = resolve_config(environ=cfg.as_environ(), root=str(tmp_path))
    assert again.values == cfg.values
    assert set(again.sources[k] for k in cfg.as_environ()) == {"environment"}


def test_to_dict_is_json_serialisable(tmp_path):
    root = fake_sysfs(tmp_path, "mlx5_0", "mlx5_1")
    data = json.loads(json.dumps(resolve_config(environ={}, root=root).to_dict()))
    assert data["platform"] == "nvidia-connectx"
    assert data["rdma_devices"] == [{"name": "mlx5_0", "platform": "nvidia-connectx"},
                                    {"name": "mlx5_1", "platform": "nvidia-connectx"}]
    assert data["values"]["UCCL_IB_TC"] == 104
    assert data["environ"]["UCCL_IB_TC"] == "104"


# --------------------------------------------------------------------------- detection


@pytest.mark.parametrize("name", PLATFORMS)
def test_detect_each_nic_kind(name, tmp_path):
    root = fake_sysfs(tmp_path, DEVICE_FOR[name])
    assert detect_platform(root) == name
    assert detect_rdma_devices(root) == [(DEVICE_FOR[name], name)]


def test_detect_none_without_sysfs_folder(tmp_path):
    assert detect_platform(str(tmp_path)) is None
    assert detect_rdma_devices(str(tmp_path)) == []


def test_detect_none_with_empty_or_unknown_devices(tmp_path):
    root = fake_sysfs(tmp_path)
    assert detect_platform(root) is None
    fake_sysfs(tmp_path, "rxe0", "irdma1")
    assert detect_platform(root) is None
    assert detect_rdma_devices(root) == [("irdma1", None), ("rxe0", None)]


def test_detect_many_devices_of_one_kind(tmp_path):
    root = fake_sysfs(tmp_path, *["bnxt_re%d" % i for i in range(8)])
    assert detect_platform(root) == "broadcom-thor2"
    assert len(detect_rdma_devices(root)) == 8


@pytest.mark.parametrize("devices, expected", [
    (("mlx5_0", "bnxt_re0", "bnxt_re1"), "broadcom-thor2"),
    (("mlx5_0", "ionic_0"), "amd-pollara"),
    (("ionic_0", "bnxt_re0"), "amd-pollara"),
    (("rdmap0", "mlx5_0", "ionic_0", "bnxt_re0"), "efa"),
    (("mlx5_0", "rxe0"), "nvidia-connectx"),
])
def test_detect_mixed_uses_fixed_priority_and_reports_all(devices, expected, tmp_path):
    root = fake_sysfs(tmp_path, *devices)
    assert detect_platform(root) == expected
    found = detect_rdma_devices(root)
    assert [name for name, _ in found] == sorted(devices)
    assert detected_platforms(root)[0] == expected
    kinds = set(p for _, p in found if p)
    assert set(detected_platforms(root)) == kinds


def test_priority_order_is_documented():
    assert PLATFORM_PRIORITY == ("efa", "amd-pollara", "broadcom-thor2", "nvidia-connectx")
    assert sorted(PLATFORM_PRIORITY) == PLATFORMS


def test_detect_reads_real_root_without_crashing():
    result = detect_rdma_devices("/")
    assert isinstance(result, list)


# --------------------------------------------------------------------------- errors


def test_config_error_is_a_value_error():
    assert issubclass(ConfigError, ValueError)


def _error(path_text, tmp_path, name="bad.yaml"):
    path = write(tmp_path / name, path_text)
    with pytest.raises(ConfigError) as info:
        resolve_config(config_file=path, environ={}, root=str(tmp_path))
    return path, str(info.value)


def test_unknown_key_names_file_and_key(tmp_path):
    path, message = _error("UCCL_IB_SLL: 3\n", tmp_path)
    assert path in message and "UCCL_IB_SLL" in message and "unknown key" in message


@pytest.mark.parametrize("text, key", [
    ("UCCL_IB_SL: three\n", "UCCL_IB_SL"),
    ("UCCL_IB_TC: 1.5\n", "UCCL_IB_TC"),
    ("UCCL_IB_GID_INDEX: true\n", "UCCL_IB_GID_INDEX"),
    ("UCCL_SOCKET_IFNAME: 5\n", "UCCL_SOCKET_IFNAME"),
    ("UCCL_SOCKET_IFNAME: ''\n", "UCCL_SOCKET_IFNAME"),
    ("UCCL_IB_MAX_INFLIGHT_NORMAL: [1, 2]\n", "UCCL_IB_MAX_INFLIGHT_NORMAL"),
    ("UCCL_IB_MAX_INFLIGHT_NORMAL: null\n", "UCCL_IB_MAX_INFLIGHT_NORMAL"),
    ("UCCL_RDMA_ADAPTIVE_SLEEP: 'yes please'\n", "UCCL_RDMA_ADAPTIVE_SLEEP"),
    ("platform: 7\n", "platform"),
])
def test_wrong_type_names_file_and_key(text, key, tmp_path):
    path, message = _error(text, tmp_path)
    assert path in message and key in message


@pytest.mark.parametrize("text, key", [
    ("UCCL_IB_SL: 16\n", "UCCL_IB_SL"),
    ("UCCL_IB_SL: -1\n", "UCCL_IB_SL"),
    ("UCCL_IB_TC: 256\n", "UCCL_IB_TC"),
    ("UCCL_IB_GID_INDEX: -2\n", "UCCL_IB_GID_INDEX"),
    ("UCCL_IB_MAX_INFLIGHT_NORMAL: 0\n", "UCCL_IB_MAX_INFLIGHT_NORMAL"),
    ("UCCL_IB_MAX_INFLIGHT_LOW_LATENCY: -4\n", "UCCL_IB_MAX_INFLIGHT_LOW_LATENCY"),
    ("UCCL_IB_MAX_INFLIGHT_BYTES: 0\n", "UCCL_IB_MAX_INFLIGHT_BYTES"),
    ("UCCL_EP_ENABLE_AGGRESSIVE_ATOMIC: 2\n", "UCCL_EP_ENABLE_AGGRESSIVE_ATOMIC"),
])
def test_out_of_range_names_file_and_key(text, key, tmp_path):
    path, message = _error(text, tmp_path)
    assert path in message and key in message


def test_boundary_values_are_accepted(tmp_path):
    path = write(tmp_path / "edge.yaml",
                 "UCCL_IB_SL: 15\nUCCL_IB_TC: 255\nUCCL_IB_GID_INDEX: -1\n"
                 "UCCL_IB_MAX_INFLIGHT_BYTES: 1\nUCCL_IB_MAX_INFLIGHT_NORMAL: 1\n")
    cfg = resolve_config(config_file=path, environ={}, root=str(tmp_path))
    assert (cfg.values["UCCL_IB_SL"], cfg.values["UCCL_IB_TC"]) == (15, 255)
    assert cfg.values["UCCL_IB_MAX_INFLIGHT_BYTES"] == 1


def test_malformed_yaml_names_file(tmp_path):
    path, message = _error("UCCL_IB_SL: [3\n", tmp_path)
    assert path in message and "malformed YAML" in message


def test_duplicate_key_is_rejected(tmp_path):
    path, message = _error("UCCL_IB_SL: 3\nUCCL_IB_SL: 4\n", tmp_path)
    assert path in message and "UCCL_IB_SL" in message


@pytest.mark.parametrize("text", ["- UCCL_IB_SL\n- 3\n", "just a string\n", "42\n"])
def test_non_mapping_document_names_file(text, tmp_path):
    path, message = _error(text, tmp_path)
    assert path in message and "mapping" in message


def test_missing_file_names_path(tmp_path):
    missing = str(tmp_path / "nope.yaml")
    with pytest.raises(ConfigError) as info:
        resolve_config(config_file=missing, environ={}, root=str(tmp_path))
    assert missing in str(info.value)


def test_unknown_platform_name(tmp_path):
    with pytest.raises(ConfigError) as info:
        resolve_config(platform="infinipath", environ={}, root=str(tmp_path))
    message = str(info.value)
    assert "infinipath" in message and "platform" in message
    for name in PLATFORMS:
        assert name in message


def test_unknown_platform_from_uccl_ep_config(tmp_path):
    with pytest.raises(ConfigError) as info:
        resolve_config(environ={CONFIG_ENV_VAR: "cray"}, root=str(tmp_path))
    assert CONFIG_ENV_VAR in str(info.value) and "cray" in str(info.value)


@pytest.mark.parametrize("key, raw", [
    ("UCCL_IB_SL", "abc"),
    ("UCCL_IB_SL", "99"),
    ("UCCL_IB_TC", "1.0"),
    ("UCCL_IB_MAX_INFLIGHT_NORMAL", "0"),
    ("UCCL_IB_MAX_INFLIGHT_NORMAL", "none"),
    ("UCCL_RDMA_ADAPTIVE_SLEEP", "2"),
    ("UCCL_EP_ENABLE_AGGRESSIVE_ATOMIC", "maybe"),
])
def test_bad_environment_value_names_variable(key, raw, tmp_path):
    with pytest.raises(ConfigError) as info:
        resolve_config(environ={key: raw}, root=str(tmp_path))
    message = str(info.value)
    assert message.startswith("environment: ")
    assert key in message


def test_bad_override_names_argument_and_key(tmp_path):
    with pytest.raises(ConfigError) as info:
        resolve_config(overrides={"UCCL_IB_TC": 300}, environ={}, root=str(tmp_path))
    assert str(info.value).startswith("argument: ") and "UCCL_IB_TC" in str(info.value)
    with pytest.raises(ConfigError) as info:
        resolve_config(overrides={"UCCL_NOPE": 1}, environ={}, root=str(tmp_path))
    assert "argument" in str(info.value) and "UCCL_NOPE" in str(info.value)
    with pytest.raises(ConfigError) as info:
        resolve_config(overrides={"UCCL_IB_SL": "x"}, environ={}, root=str(tmp_path))
    assert "argument" in str(info.value) and "UCCL_IB_SL" in str(info.value)


def test_shipped_file_errors_name_the_shipped_file(tmp_path, monkeypatch):
    # A broken shipped platform file is reported by its file name.
    folder = tmp_path / "configs"
    folder.mkdir()
    for entry in config_dir().iterdir():
        if entry.name.endswith(".yaml"):
            (folder / entry.name).write_text(entry.read_text())
    (folder / "efa.yaml").write_text("platform: efa\nUCCL_IB_SL: 20\n")
    monkeypatch.setattr(loader_module, "config_dir", lambda: folder)
    with pytest.raises(ConfigError) as info:
        resolve_config(platform="efa", environ={}, root=str(tmp_path))
    assert "efa.yaml" in str(info.value) and "UCCL_IB_SL" in str(info.value)
    # and a defaults file missing a key is refused
    (folder / "default.yaml").write_text("UCCL_IB_SL: 3\n")
    with pytest.raises(ConfigError) as info:
        resolve_config(environ={}, root=str(tmp_path))
    assert "default.yaml" in str(info.value)


def test_schema_helpers_directly():
    assert check_value("UCCL_RDMA_ADAPTIVE_SLEEP", False, "x") == 0
    assert parse_string("UCCL_RDMA_ADAPTIVE_SLEEP", "on", "environment") == 1
    assert parse_string("UCCL_EP_ENABLE_AGGRESSIVE_ATOMIC", "auto", "environment") is None
    assert parse_string("UCCL_SOCKET_IFNAME", " eth0 ", "environment") == "eth0"
    with pytest.raises(ConfigError):
        check_value("UCCL_IB_SL", 3.0, "x")


def test_config_dir_falls_back_to_repository_folder():
    import importlib.util
    from pathlib import Path
    folder = config_dir()
    assert folder.joinpath("default.yaml").is_file()
    try:
        installed = importlib.util.find_spec("uccl_ep_plugin.configs") is not None
    except ImportError:
        installed = False
    if not installed:  # running from a source checkout: the repository's configs/
        repo_configs = Path(loader_module.__file__).resolve().parents[2] / "configs"
        assert Path(str(folder)) == repo_configs
