"""Which engine serves each operation, and the reason given when the native engine cannot."""

import pytest
import torch

from uccl_ep_plugin import engines
from uccl_ep_plugin.engines.native import LOW_LATENCY_OPERATIONS
from tests.fake_extension import FakeExtension


def test_cpu_device_uses_the_reference_engine_with_a_reason():
    choice = engines.choose("auto", torch.device("cpu"))
    assert set(choice.by_operation.values()) == {"reference"}
    assert all("CUDA device" in choice.reasons[op] for op in engines.OPERATIONS)




@pytest.mark.parametrize("transport", ["cuda-copy", "tcp"])
def test_force_proxy_needs_the_proxy_transport(monkeypatch, transport):
    """UCCL_EP_FORCE_PROXY=1 sends the low-latency kernels' traffic through the CPU proxy: native where
    the build has the chosen transport, the reference engine (with the reason) where it has not."""
    from uccl_ep_plugin.engines import native
    feature = native.TRANSPORT_FEATURES[transport]
    monkeypatch.setenv("UCCL_EP_FORCE_PROXY", "1")
    monkeypatch.setenv("UCCL_EP_PROXY_TRANSPORT", transport)
    other_features = [f for f in native.TRANSPORT_FEATURES.values() if f != feature]
    base = ["dispatch_layout", "low_latency_nvlink"]
    monkeypatch.setattr(native, "_load_extension", lambda: FakeExtension(base + other_features))
    choice = engines.choose("auto", torch.device("cuda"))
    for operation in LOW_LATENCY_OPERATIONS:
        assert choice.by_operation[operation] == "reference"
        assert "UCCL_EP_FORCE_PROXY=1" in choice.reasons[operation]
        assert feature in choice.reasons[operation]
    monkeypatch.setattr(native, "_load_extension", lambda: FakeExtension(base + [feature]))
    choice = engines.choose("auto", torch.device("cuda"))
    assert all(choice.by_operation[op] == "native" for op in LOW_LATENCY_OPERATIONS)
    monkeypatch.setenv("UCCL_EP_FORCE_PROXY", "0")
    monkeypatch.setattr(native, "_load_extension", lambda: FakeExtension(base))
    choice = engines.choose("auto", torch.device("cuda"))
    assert all(choice.by_operation[op] == "native" for op in LOW_LATENCY_OPERATIONS)


@pytest.mark.parametrize("library,devices,expected", [(False, [], "libibverbs.so.1 cannot be loaded"),
                                                      (True, [], "this host has no RDMA device"),
                                                      (True, [{"name": "mlx5_0"}], None)])
def test_force_proxy_over_verbs_needs_an_rdma_device(monkeypatch, library, devices, expected):
    """Over verbs the proxies register the GPU buffers with a NIC: without libibverbs or an RDMA device the reference
    engine serves, and the reason says which is missing and names the transports that need neither."""
    from uccl_ep_plugin.engines import native
    monkeypatch.setenv("UCCL_EP_FORCE_PROXY", "1")
    monkeypatch.setenv("UCCL_EP_PROXY_TRANSPORT", "verbs")
    features = ["dispatch_layout", "low_latency_nvlink"] + list(native.TRANSPORT_FEATURES.values())
    extension = FakeExtension(features)
    extension.verbs_available = lambda: library
    extension.verbs_devices = lambda: devices
    monkeypatch.setattr(native, "_load_extension", lambda: extension)
    choice = engines.choose("auto", torch.device("cuda"))
    for operation in LOW_LATENCY_OPERATIONS:
        if expected is None:
            assert choice.by_operation[operation] == "native"
            continue
        assert choice.by_operation[operation] == "reference"
        assert expected in choice.reasons[operation]
        assert "UCCL_EP_PROXY_TRANSPORT=verbs" in choice.reasons[operation]


def test_unknown_proxy_transport_is_named(monkeypatch):
    from uccl_ep_plugin.proxies import proxy_transport
    monkeypatch.setenv("UCCL_EP_PROXY_TRANSPORT", "carrier-pigeon")
    with pytest.raises(ValueError, match="UCCL_EP_PROXY_TRANSPORT='carrier-pigeon'"):
        proxy_transport()


def test_reference_mode_gives_no_native_reasons():
    choice = engines.choose("reference", torch.device("cuda"))
    assert set(choice.by_operation.values()) == {"reference"} and choice.reasons == {}


class _BuiltFor(FakeExtension):
    """A fake extension built for CUDA or for HIP, with every native feature."""

    def __init__(self, platform):
        super().__init__(["dispatch_layout", "normal_nvlink", "low_latency_nvlink"])
        self.platform = platform

    def build_info(self):
        return {"features": self.features, "cuda": self.platform == "cuda", "hip": self.platform == "hip"}


@pytest.mark.parametrize("build,torch_hip", [("cuda", "6.2.0"), ("hip", None)], ids=["cuda-build-rocm-torch",
                                                                                       "hip-build-cuda-torch"])
def test_a_build_for_the_other_gpu_vendor_is_refused_with_the_reason(monkeypatch, build, torch_hip):
    from uccl_ep_plugin.engines import native
    monkeypatch.setattr(native, "_load_extension", lambda: _BuiltFor(build))
    monkeypatch.setattr(torch.version, "hip", torch_hip, raising=False)
    choice = engines.choose("auto", torch.device("cuda"))
    assert set(choice.by_operation.values()) == {"reference"}
    wanted = "rebuild it with UCCL_EP_HIP=1" if build == "cuda" else "is for AMD GPUs (HIP) and torch is not a ROCm"
    assert all(wanted in choice.reasons[op] for op in engines.OPERATIONS), choice.reasons


def test_the_hip_build_serves_only_when_asked(monkeypatch):
    """On ROCm torch a HIP build could run natively, but its kernels have not been validated on an AMD GPU: auto
    picks the reference engine and says how to try them; UCCL_EP_ENGINE=native uses them."""
    from uccl_ep_plugin.engines import native
    monkeypatch.setattr(native, "_load_extension", lambda: _BuiltFor("hip"))
    monkeypatch.setattr(native, "use_torch_shim", lambda extension: None)
    monkeypatch.setattr(torch.version, "hip", "6.2.0", raising=False)
    auto = engines.choose("auto", torch.device("cuda"))
    assert set(auto.by_operation.values()) == {"reference"}
    assert all("not been validated" in auto.reasons[op] and "UCCL_EP_ENGINE=native" in auto.reasons[op]
               for op in engines.OPERATIONS)
    explicit = engines.choose("native", torch.device("cuda"))
    assert set(explicit.by_operation.values()) == {"native"} and not explicit.reasons
    monkeypatch.setattr(native, "_load_extension", lambda: _BuiltFor("cuda"))
    monkeypatch.setattr(torch.version, "hip", None, raising=False)
    cuda = engines.choose("auto", torch.device("cuda"))
    assert set(cuda.by_operation.values()) == {"native"} and not cuda.reasons
