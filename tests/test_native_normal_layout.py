"""CPU checks of the native normal mode's host-side pieces: send positions, the data-area byte layout,
and which build feature the engine choice asks for."""

import pytest
import torch

from uccl_ep_plugin import engines
from uccl_ep_plugin.engines import native
from uccl_ep_plugin.engines.native.normal import send_positions
from uccl_ep_plugin.engines.reference.normal import _routed_pairs


def test_send_positions_follow_the_reference_row_order():
    gen = torch.Generator().manual_seed(5)
    for num_tokens, num_ranks in ((0, 2), (1, 3), (37, 4)):
        in_rank = torch.rand((num_tokens, num_ranks), generator=gen) < 0.5
        positions = send_positions(in_rank)
        assert positions.dtype == torch.int32 and tuple(positions.shape) == (num_tokens, num_ranks)
        assert torch.equal(positions < 0, ~in_rank)
        dst_rank, token = _routed_pairs(in_rank)
        for rank in range(num_ranks):
            # The reference sends a rank's tokens in token order: position k is the k-th of them.
            sent = token[dst_rank == rank]
            assert torch.equal(positions[sent, rank], torch.arange(sent.numel(), dtype=torch.int32))


def _extension_with_normal():
    try:
        from uccl_ep_plugin import _C
    except ImportError:
        pytest.skip("the native extension is not built")
    if "normal_nvlink" not in _C.build_info()["features"]:
        pytest.skip("this build has no normal_nvlink (CPU-only build)")
    return _C


def test_data_area_fields_are_16_byte_aligned_arrays():
    ext = _extension_with_normal()
    # 3 rows of 32 x bytes, 8 scale bytes, 2 top-k: 96 + 32 (24) + 48 + 32 (24) + 16 (12)
    assert ext.normal_dispatch_area_bytes(3, 32, 8, 2) == 96 + 32 + 48 + 32 + 16
    assert ext.normal_dispatch_area_bytes(0, 14336, 224, 9) == 0
    # 3 rows of 32 bytes, 2 weights each: 96 + 32 (24)
    assert ext.normal_combine_area_bytes(3, 32, 2) == 96 + 32
    assert ext.normal_notify_slot_ints(2, 10, 144) == 156
    assert ext.NORMAL_CONTROL_BYTES == 2 * 8 * ext.NORMAL_MAX_RANKS


class _FakeExtension:
    def __init__(self, features):
        self.features = features

    def build_info(self):
        return {"features": self.features}


def test_normal_mode_needs_the_normal_nvlink_feature(monkeypatch):
    monkeypatch.setattr(native, "_load_extension", lambda: _FakeExtension(["dispatch_layout", "low_latency_nvlink"]))
    choice = engines.choose("auto", torch.device("cuda"))
    for operation in native.NORMAL_OPERATIONS:
        assert choice.by_operation[operation] == "reference"
        assert "normal_nvlink" in choice.reasons[operation]
    monkeypatch.setattr(native, "_load_extension", lambda: _FakeExtension(["normal_nvlink"]))
    choice = engines.choose("auto", torch.device("cuda"))
    assert all(choice.by_operation[op] == "native" and op not in choice.reasons for op in native.NORMAL_OPERATIONS)
