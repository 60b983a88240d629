"""Which engine serves each operation, and the reason given when the native engine cannot."""

import torch

from uccl_ep_plugin import engines
from uccl_ep_plugin.engines.native import LOW_LATENCY_OPERATIONS


def test_cpu_device_uses_the_reference_engine_with_a_reason():
    choice = engines.choose("auto", torch.device("cpu"))
    assert set(choice.by_operation.values()) == {"reference"}
    assert all("CUDA device" in choice.reasons[op] for op in engines.OPERATIONS)


def test_force_proxy_keeps_low_latency_off_the_nvlink_kernels(monkeypatch):
    monkeypatch.setenv("UCCL_EP_FORCE_PROXY", "1")
    choice = engines.choose("auto", torch.device("cuda"))
    for operation in LOW_LATENCY_OPERATIONS:
        assert choice.by_operation[operation] == "reference"
        assert "UCCL_EP_FORCE_PROXY=1" in choice.reasons[operation]
    monkeypatch.setenv("UCCL_EP_FORCE_PROXY", "0")
    choice = engines.choose("auto", torch.device("cuda"))
    assert all("UCCL_EP_FORCE_PROXY" not in choice.reasons.get(op, "") for op in LOW_LATENCY_OPERATIONS)


def test_reference_mode_gives_no_native_reasons():
    choice = engines.choose("reference", torch.device("cuda"))
    assert set(choice.by_operation.values()) == {"reference"} and choice.reasons == {}
