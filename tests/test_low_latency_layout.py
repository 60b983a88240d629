"""The low-latency region's byte layout (dispatch_config.LowLatencyLayout) against the kernel's rules
(low_latency.h), and the properties the proxy path relies on: 16-byte units, no overlapping areas."""

import pytest

from uccl_ep_plugin.dispatch_config import LowLatencyLayout, low_latency_layout, low_latency_rdma_size_hint

SHAPES = [(128, 7168, 2, 288), (1, 2048, 2, 16), (7, 2560, 4, 12), (256, 8192, 8, 256), (3, 4096, 2, 6)]


def _extension_or_skip():
    from uccl_ep_plugin import _C
    if not hasattr(_C, "low_latency_flags_per_source"):
        pytest.skip("built without CUDA: no low-latency kernels")
    return _C


@pytest.mark.parametrize("shape", SHAPES)
def test_padding_rules_match_the_kernels(shape):
    extension = _extension_or_skip()
    layout = LowLatencyLayout(*shape)
    assert layout.flags_per_source == extension.low_latency_flags_per_source(layout.local_experts)
    assert layout.index_per_source == extension.low_latency_index_per_source(layout.local_experts,
                                                                             layout.num_max_dispatch_tokens_per_rank)
    assert layout.dispatch_msg_bytes == extension.low_latency_dispatch_msg_bytes(layout.hidden)
    assert layout.combine_msg_bytes == extension.low_latency_combine_msg_bytes(layout.hidden)


@pytest.mark.parametrize("shape", SHAPES)
def test_areas_are_16_byte_units_and_do_not_overlap(shape):
    layout = LowLatencyLayout(*shape)
    for half in (0, 1):
        starts = [layout.signal_offset(half), layout.counters_offset(half), layout.release_offset(half),
                  layout.send_offset(half), layout.recv_offset(half), layout.outbox_offset(half)]
        assert starts == sorted(starts) and len(set(starts)) == len(starts)
        assert all(start % 16 == 0 for start in starts)
        assert layout.release_offset(half) + 16 * layout.num_ranks <= layout.send_offset(half)
        assert layout.outbox_offset(half) + layout.num_ranks * layout.outbox_peer_bytes <= (half + 1) * layout.half_bytes
    # One peer's outbox: data rows, the dispatch index, the flags, the release count, in order.
    positions = [layout.outbox_index_pos, layout.outbox_flags_pos, layout.outbox_release_pos, layout.outbox_peer_bytes]
    assert positions == sorted(positions) and all(p % 16 == 0 for p in positions)
    assert layout.outbox_flags_pos >= layout.outbox_index_pos + 4 * layout.index_per_source
    assert layout.flags_per_source % 2 == 0 and layout.index_per_source % 4 == 0   # whole 16-byte units
    assert low_latency_rdma_size_hint(*shape) >= layout.total_bytes


@pytest.mark.parametrize("shape", SHAPES)
def test_the_shared_layout_of_a_shape_is_one_instance_with_the_same_offsets(shape):
    shared, fresh = low_latency_layout(*shape), LowLatencyLayout(*shape)
    assert low_latency_layout(*shape) is shared and shared == fresh
    for half in (0, 1):
        for offset in ("signal_offset", "counters_offset", "release_offset", "send_offset", "recv_offset",
                       "outbox_offset"):
            assert getattr(shared, offset)(half) == getattr(fresh, offset)(half), (offset, half)
    assert shared.total_bytes == fresh.total_bytes and shared.outbox_peer_bytes == fresh.outbox_peer_bytes
