"""Tests of ``uccl-ep config show`` and ``uccl-ep doctor`` (CPU only, fake sysfs)."""

import argparse
import json
import sys
import types

import pytest

from uccl_ep_plugin.cli import config_cmd, doctor
from uccl_ep_plugin.platform_config import CONFIG_ENV_VAR, SCHEMA, resolve_config
from uccl_ep_plugin.platform_config import loader as loader_module

DOCTOR_KEYS = {"python", "torch", "gpus", "peer_access", "rdma", "verbs", "gpu_nics", "peer_memory", "dmabuf",
               "gpu_dmabuf", "build", "engine", "config"}


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch):
    for key in list(SCHEMA) + [CONFIG_ENV_VAR, doctor.ENGINE_ENV_VAR]:
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setattr(loader_module, "_gpu_is_amd", lambda: False)


def _own_parser_main(argv):
    parser = argparse.ArgumentParser(prog="uccl-ep")
    subparsers = parser.add_subparsers(dest="command")
    subparsers.required = True
    doctor.register(subparsers)
    config_cmd.register(subparsers)
    args = parser.parse_args(argv)
    return int(args.handler(args) or 0)


def _main_entry():
    """The real ``uccl-ep`` entry point, or an equivalent parser if ``bench`` is absent."""
    try:
        from uccl_ep_plugin.cli.main import main
        return main
    except ImportError:
        return _own_parser_main


def run_cli(argv, capsys):
    code = _main_entry()(argv)
    out, err = capsys.readouterr()
    return code, out, err


def fake_root(tmp_path, devices=(), modules=()):
    ib = tmp_path / "sys" / "class" / "infiniband"
    ib.mkdir(parents=True)
    for name in devices:
        (ib / name).mkdir()
    for name in modules:
        (tmp_path / "sys" / "module" / name).mkdir(parents=True)
    return str(tmp_path)


def test_register_functions_add_subcommands_with_handlers():
    parser = argparse.ArgumentParser()
    subparsers = parser.add_subparsers(dest="command")
    config_cmd.register(subparsers)
    doctor.register(subparsers)
    args = parser.parse_args(["config", "show", "--platform", "efa", "--json"])
    assert args.handler is config_cmd.run_show
    assert (args.platform, args.config, args.json) == ("efa", None, True)
    args = parser.parse_args(["doctor", "--json"])
    assert args.handler is doctor.run and args.json is True


# --------------------------------------------------------------------------- config show


def test_config_show_table_lists_every_key_value_and_source(tmp_path, capsys):
    root = fake_root(tmp_path, devices=("bnxt_re0", "bnxt_re1"))
    code, out, err = run_cli(["config", "show", "--root", root], capsys)
    assert code == 0 and err == ""
    rows = {}
    for line in out.splitlines():
        parts = line.split(None, 2)
        if parts and parts[0] in SCHEMA:
            rows[parts[0]] = (parts[1], parts[2])
    assert set(rows) == set(SCHEMA)
    assert rows["UCCL_IB_MAX_INFLIGHT_BYTES"] == ("1572864", "broadcom-thor2.yaml (auto-detected)")
    assert rows["UCCL_IB_MAX_INFLIGHT_NORMAL"] == ("1", "broadcom-thor2.yaml (auto-detected)")
    assert rows["UCCL_IB_SL"] == ("3", "default.yaml")
    assert rows["UCCL_SOCKET_IFNAME"] == ("null", "default.yaml")
    assert rows["UCCL_EP_ENABLE_AGGRESSIVE_ATOMIC"] == ("0", "auto (GPU vendor)")
    assert "RDMA devices: bnxt_re0 (broadcom-thor2), bnxt_re1 (broadcom-thor2)" in out
    assert "Platform: broadcom-thor2" in out


def test_config_show_platform_and_environment(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("UCCL_IB_GID_INDEX", "3")
    code, out, _ = run_cli(["config", "show", "--platform", "efa", "--root", str(tmp_path)],
                           capsys)
    assert code == 0
    lines = {line.split()[0]: line.split(None, 2)[1:] for line in out.splitlines()
             if line.split() and line.split()[0] in SCHEMA}
    assert lines["UCCL_IB_SL"] == ["8", "efa.yaml"]
    assert lines["UCCL_IB_TC"] == ["0", "efa.yaml"]
    assert lines["UCCL_IB_GID_INDEX"] == ["3", "environment"]
    assert "RDMA devices: none found" in out


def test_config_show_config_file(tmp_path, capsys):
    path = tmp_path / "site.yaml"
    path.write_text("platform: lab\nUCCL_IB_TC: 41\n")
    code, out, _ = run_cli(["config", "show", "--config", str(path), "--json",
                            "--root", str(tmp_path)], capsys)
    assert code == 0
    data = json.loads(out)
    assert data["values"]["UCCL_IB_TC"] == 41
    assert data["sources"]["UCCL_IB_TC"] == str(path)
    assert data["platform"] == "lab"


def test_config_show_json_matches_resolve_config(tmp_path, capsys):
    root = fake_root(tmp_path, devices=("rdmap0s6", "mlx5_0"))
    code, out, _ = run_cli(["config", "show", "--json", "--root", root], capsys)
    assert code == 0
    data = json.loads(out)
    expected = resolve_config(environ={}, root=root)
    assert data["values"] == expected.values
    assert data["sources"] == expected.sources
    assert data["platform"] == "efa"
    assert data["values"]["UCCL_IB_SL"] == 8
    assert data["sources"]["UCCL_IB_SL"] == "efa.yaml (auto-detected)"
    assert data["rdma_devices"] == [{"name": "mlx5_0", "platform": "nvidia-connectx"},
                                    {"name": "rdmap0s6", "platform": "efa"}]
    assert data["environ"] == expected.as_environ()


def test_config_show_unknown_platform_exits_2(tmp_path, capsys):
    code, out, err = run_cli(["config", "show", "--platform", "nosuch",
                              "--root", str(tmp_path)], capsys)
    assert code == 2
    assert out == ""
    assert len(err.strip().splitlines()) == 1
    assert "nosuch" in err


def test_config_show_bad_environment_exits_2(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("UCCL_IB_TC", "lots")
    code, _, err = run_cli(["config", "show", "--root", str(tmp_path)], capsys)
    assert code == 2
    assert "environment" in err and "UCCL_IB_TC" in err
    assert len(err.strip().splitlines()) == 1


def test_config_show_malformed_file_exits_2_on_one_line(tmp_path, capsys):
    path = tmp_path / "broken.yaml"
    path.write_text("UCCL_IB_SL: [1,\n  2\nfoo: {\n")
    code, _, err = run_cli(["config", "show", "--config", str(path),
                            "--root", str(tmp_path)], capsys)
    assert code == 2
    assert str(path) in err
    assert len(err.strip().splitlines()) == 1


# --------------------------------------------------------------------------- doctor


def test_doctor_json_has_every_section_and_does_not_crash(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv(doctor.ENGINE_ENV_VAR, "uccl")
    root = fake_root(tmp_path, devices=("ionic_0",), modules=("nvidia_peermem",))
    code, out, _ = run_cli(["doctor", "--json", "--root", root], capsys)
    assert code == 0
    data = json.loads(out)
    assert set(data) == DOCTOR_KEYS
    assert data["python"]["version"] == "%d.%d.%d" % sys.version_info[:3]
    assert data["rdma"]["devices"][0]["name"] == "ionic_0"
    assert data["rdma"]["devices"][0]["platform"] == "amd-pollara"
    assert data["rdma"]["platform"] == "amd-pollara"
    assert data["peer_memory"]["modules"] == {
        "nvidia_peermem": True, "efa_nv_peermem": False, "ib_peer_mem": False}
    assert data["engine"] == {"UCCL_EP_ENGINE": "uccl"}
    assert data["config"]["values"]["UCCL_IB_MAX_INFLIGHT_BYTES"] == 2097152
    assert data["config"]["platform"] == "amd-pollara"
    assert isinstance(data["dmabuf"]["possible"], bool)
    assert "heuristic" in data["dmabuf"]["note"]


def test_doctor_text_output_has_sections(tmp_path, capsys):
    code, out, _ = run_cli(["doctor", "--root", fake_root(tmp_path)], capsys)
    assert code == 0
    for title in ("== Python ==", "== torch ==", "== GPUs ==", "== GPU peer access ==",
                  "== RDMA NICs ==", "== GPU memory registration ==", "== Build ==",
                  "== Engine ==", "== Resolved config =="):
        assert title in out
    assert "UCCL_EP_ENGINE=auto" in out
    assert "UCCL_IB_MAX_INFLIGHT_LOW_LATENCY" in out


def test_doctor_reports_config_error_instead_of_failing(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("UCCL_IB_SL", "bogus")
    code, out, _ = run_cli(["doctor", "--json", "--root", str(tmp_path)], capsys)
    assert code == 0
    data = json.loads(out)
    assert "UCCL_IB_SL" in data["config"]["error"]
    code, out, _ = run_cli(["doctor", "--root", str(tmp_path)], capsys)
    assert code == 0 and "UCCL_IB_SL" in out


def test_probe_engine_default_and_value():
    assert doctor.probe_engine({}) == {"UCCL_EP_ENGINE": "auto"}
    assert doctor.probe_engine({"UCCL_EP_ENGINE": "nccl"}) == {"UCCL_EP_ENGINE": "nccl"}


@pytest.mark.parametrize("release, possible", [
    ("5.15.0-1051-aws", True), ("5.12.0", True), ("6.8.0-45-generic", True),
    ("5.11.22", False), ("4.18.0-513.el8.x86_64", False), ("weird", False),
])
def test_probe_dmabuf_kernel_heuristic(release, possible):
    result = doctor.probe_dmabuf(release)
    assert result["possible"] is possible
    assert result["kernel"] == release


def test_probe_peer_memory_with_fake_root(tmp_path):
    root = fake_root(tmp_path, modules=("efa_nv_peermem", "ib_peer_mem"))
    result = doctor.probe_peer_memory(root)
    assert result["modules"] == {"nvidia_peermem": False, "efa_nv_peermem": True,
                                 "ib_peer_mem": True}
    assert result["any_loaded"] is True
    assert doctor.probe_peer_memory(str(tmp_path / "empty"))["any_loaded"] is False


def test_probe_rdma_reports_driver_and_unknown_devices(tmp_path):
    root = fake_root(tmp_path, devices=("mlx5_0", "rxe0"))
    drivers = tmp_path / "drivers" / "mlx5_core"
    drivers.mkdir(parents=True)
    device = tmp_path / "sys" / "class" / "infiniband" / "mlx5_0" / "device"
    device.mkdir()
    (device / "driver").symlink_to(drivers)
    result = doctor.probe_rdma(root)
    assert result["devices"] == [
        {"name": "mlx5_0", "platform": "nvidia-connectx", "driver": "mlx5_core"},
        {"name": "rxe0", "platform": None, "driver": None},
    ]
    assert result["platform"] == "nvidia-connectx"
    assert doctor.probe_rdma(str(tmp_path / "none")) == {"devices": [], "platform": None}


def test_probe_build_uses_build_info(monkeypatch):
    fake = types.ModuleType("uccl_ep_plugin.build_info")
    fake.build_info = lambda: {"version": "9.9", "cuda": True, "cuda_archs": ["90"],
                               "hip": False, "verbs": True, "features": ["ll"]}
    monkeypatch.setitem(sys.modules, "uccl_ep_plugin.build_info", fake)
    assert doctor.probe_build() == {"version": "9.9", "cuda": True, "cuda_archs": ["90"],
                                    "hip": False, "verbs": True, "features": ["ll"]}


def test_probe_build_reports_import_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "uccl_ep_plugin.build_info", None)
    result = doctor.probe_build()
    assert set(result) == {"error"}
    assert "build_info" in result["error"]


def test_probe_build_reports_failing_call(monkeypatch):
    fake = types.ModuleType("uccl_ep_plugin.build_info")

    def broken():
        raise RuntimeError("extension not compiled")

    fake.build_info = broken
    monkeypatch.setitem(sys.modules, "uccl_ep_plugin.build_info", fake)
    assert "extension not compiled" in doctor.probe_build()["error"]


# --------------------------------------------------------------------------- fake torch


def make_fake_torch(count=2, peer=lambda a, b: True, hip=None, available=True):
    props = [types.SimpleNamespace(pci_domain_id=0, pci_bus_id=0x18 + i, pci_device_id=0)
             for i in range(count)]
    cuda = types.SimpleNamespace(
        is_available=lambda: available,
        device_count=lambda: count,
        get_device_name=lambda i: "Fake GPU %d" % i,
        get_device_capability=lambda i: (9, 0),
        can_device_access_peer=peer,
        get_device_properties=lambda i: props[i],
    )
    return types.SimpleNamespace(__version__="9.0.0", cuda=cuda,
                                 version=types.SimpleNamespace(cuda="12.8", hip=hip))


def test_probe_gpus_with_fake_torch():
    result = doctor.probe_gpus(make_fake_torch(count=2))
    assert result == {"count": 2, "devices": [
        {"index": 0, "name": "Fake GPU 0", "capability": "9.0"},
        {"index": 1, "name": "Fake GPU 1", "capability": "9.0"}]}
    assert doctor.probe_gpus(make_fake_torch(available=False)) == {"count": 0, "devices": []}


def test_probe_gpus_on_this_machine_does_not_crash():
    result = doctor.probe_gpus()
    assert result["count"] == len(result["devices"])


def test_probe_gpus_and_torch_survive_broken_torch():
    def boom():
        raise RuntimeError("driver too old")

    broken = make_fake_torch()
    broken.cuda.is_available = boom
    result = doctor.probe_gpus(broken)
    assert result["count"] == 0 and "driver too old" in result["error"]
    assert "driver too old" in doctor.probe_peer_access(broken)["error"]
    assert doctor.probe_torch(make_fake_torch()) == {"version": "9.0.0", "cuda": "12.8",
                                                     "hip": None}


def test_probe_peer_access_without_pynvml(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import fails
    fake = make_fake_torch(count=3, peer=lambda a, b: (a, b) != (2, 0))
    pairs = doctor.probe_peer_access(fake)["pairs"]
    assert len(pairs) == 6
    table = {(p["src"], p["dst"]): p for p in pairs}
    assert table[(0, 1)]["peer_access"] is True
    assert table[(2, 0)]["peer_access"] is False
    assert all(p["nvlink"] == "unknown (pynvml not installed)" for p in pairs)


def test_probe_peer_access_with_fake_pynvml(monkeypatch):
    nvml = types.ModuleType("pynvml")
    nvml.NVML_P2P_CAPS_INDEX_NVLINK = 3
    nvml.NVML_P2P_STATUS_OK = 0
    calls = []
    nvml.nvmlInit = lambda: calls.append("init")
    nvml.nvmlShutdown = lambda: calls.append("shutdown")
    nvml.nvmlDeviceGetHandleByPciBusId = lambda bus: "h-" + bus

    def p2p(a, b, index):
        assert index == 3
        linked = {"h-00000000:18:00.0", "h-00000000:19:00.0"}
        return 0 if a in linked and b in linked else 5

    nvml.nvmlDeviceGetP2PStatus = p2p
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    pairs = doctor.probe_peer_access(make_fake_torch(count=3))["pairs"]
    table = {(p["src"], p["dst"]): p["nvlink"] for p in pairs}
    assert table[(0, 1)] is True and table[(1, 0)] is True
    assert table[(0, 2)] is False and table[(2, 1)] is False
    assert calls == ["init", "shutdown"]


def test_probe_peer_access_single_gpu():
    result = doctor.probe_peer_access(make_fake_torch(count=1))
    assert result["pairs"] == []


def test_collect_with_fake_torch_renders(tmp_path):
    root = fake_root(tmp_path, devices=("rdmap0",))
    report = doctor.collect(root=root, environ={}, torch_module=make_fake_torch(count=2))
    assert set(report) == DOCTOR_KEYS
    assert report["config"]["values"]["UCCL_IB_SL"] == 8
    text = doctor.render(report)
    assert "[1] Fake GPU 1 (compute capability 9.0)" in text
    assert "GPU 0 -> GPU 1: peer access yes" in text
    assert "rdmap0: platform efa" in text
    # Without PCIe paths under the fake root each GPU falls back to the first device; UCCL_IB_HCA names one.
    assert "GPU 1 (0000:19:00.0) uses rdmap0 (nearest in the PCIe tree)" in text
    report = doctor.collect(root=root, environ={"UCCL_IB_HCA": "rdmap9"}, torch_module=make_fake_torch(count=1))
    assert report["gpu_nics"]["gpus"] == [{"gpu": 0, "pci": "0000:18:00.0", "device": "rdmap9", "why": "UCCL_IB_HCA"}]


def test_build_and_gpus_are_told_apart(tmp_path):
    """A CUDA build on a machine without GPUs: what the build targets, and that no GPU is visible."""
    report = doctor.collect(root=fake_root(tmp_path, devices=()), environ={},
                            torch_module=make_fake_torch(available=False))
    report["build"] = {"version": "9.9", "cuda": True, "cuda_archs": ["90", "100"], "cuda_runtime_version": 13000,
                       "hip": False, "verbs": False, "features": ["normal_nvlink"], "compiler": "gcc 12"}
    text = doctor.render(report)
    assert "GPUs visible: none" in text
    assert "built with CUDA for sm_90, sm_100 (runtime 13000, linked statically)" in text
    assert "verbs transport: not built" in text and "cuda: True" not in text


def test_gpu_dmabuf_export_per_gpu(tmp_path, monkeypatch):
    """Which GPUs' drivers export DMA-BUF (the extension asks the driver), or why that is unknown."""
    from uccl_ep_plugin import _C
    monkeypatch.delattr(_C, "gpu_exports_dmabuf", raising=False)
    assert doctor.probe_gpu_dmabuf(make_fake_torch(count=2)) == {"gpus": {}, "note": "this build has no GPU support"}
    monkeypatch.setattr(_C, "gpu_exports_dmabuf", lambda device: device == 0, raising=False)
    assert doctor.probe_gpu_dmabuf(make_fake_torch(count=0))["note"] == "no GPU"
    report = doctor.collect(root=fake_root(tmp_path), environ={}, torch_module=make_fake_torch(count=2))
    assert report["gpu_dmabuf"] == {"gpus": {0: True, 1: False}}
    text = doctor.render(report)
    assert "GPU 0's driver exports DMA-BUF: yes" in text and "GPU 1's driver exports DMA-BUF: no" in text
