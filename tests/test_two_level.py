"""Normal mode across hosts in two hops (engines/two_level.py), against the reference engine's single hop, on CPU
ranks cut into hosts: random tokens, uneven token counts, a rank with none, experts nobody picks, bf16 and fp8,
num_worst_tokens, the cached dispatch and the combine with weights and a bias."""

import os

import pytest
import torch
import torch.distributed as dist

from tests.multiprocess import has_feature, needs_feature, run_ranks
from tests.reference_checks import random_bf16, random_topk_idx, random_weights
from uccl_ep_plugin import Buffer
from uccl_ep_plugin.buffer import group_device
from uccl_ep_plugin.engines.reference import ReferenceEngine
from uccl_ep_plugin.engines.reference.collectives import GroupComm
from uccl_ep_plugin.engines.two_level import TwoLevel, even_hosts

CPU = torch.device("cpu")
H, K = 256, 3
RAIL_BYTES = 1 << 20   # the transport rail's region: room for every case here


def _extension():
    from uccl_ep_plugin import _C
    return _C


def _inputs(gen, rank, num_ranks, use_fp8, device=CPU):
    num_tokens = [29, 41, 13, 0, 22, 35][rank % 6]
    num_experts = 4 * num_ranks
    topk_idx = random_topk_idx(gen, num_tokens, num_experts, K, 0.2, unpicked=[1, num_experts - 2])
    x = random_bf16(gen, (num_tokens, H), 0.25, 2.0)
    scales = None
    if use_fp8:
        scales = torch.rand((num_tokens, H // 128), generator=gen) + 0.5
        x = (x.float() / scales.repeat_interleave(128, 1)).to(torch.float8_e4m3fn)
    to = (lambda t: None if t is None else t.to(device))
    return to(x), to(scales), to(topk_idx), to(random_weights(gen, num_tokens, K)), num_experts


def _equal(got, expected, what):
    if expected is None:
        assert got is None, f"{what}: expected None"
        return
    assert got.dtype == expected.dtype and got.shape == expected.shape, \
        f"{what}: {got.dtype} {tuple(got.shape)} against {expected.dtype} {tuple(expected.shape)}"
    assert torch.equal(got.view(torch.uint8) if got.dtype == torch.float8_e4m3fn else got,
                       expected.view(torch.uint8) if expected.dtype == torch.float8_e4m3fn else expected), what


def two_hops_body(rank, num_ranks, group, per_host, use_fp8, num_worst_tokens, num_nvl_bytes=0, rail=None,
                  reorder_seed=None, rail_bytes=RAIL_BYTES):
    """Also the GPU test's body (test_gpu_two_level.py): there the forward hop's Buffer is the native one. ``rail``:
    None (the collective rail) or a transport (cuda-copy, tcp, verbs), delivering out of order with ``reorder_seed``,
    in a region of ``rail_bytes``."""
    device = group_device(group)   # where the Buffers below work
    hosts = [f"host-{r // per_host}" for r in range(num_ranks)]
    reference = ReferenceEngine(group, rank, num_ranks, device, 60.0, None)
    if reorder_seed is not None:
        os.environ["UCCL_EP_TRANSPORT_REORDER"] = str(reorder_seed + rank)
    if rail == "verbs":   # rank r on RDMA device r % count, as the transport tests do
        devices = _verbs_devices()
        os.environ["UCCL_IB_HCA"] = devices[rank % len(devices)]
    two_level = TwoLevel(reference.comm, hosts,
                         lambda host_group: Buffer(host_group, num_nvl_bytes=num_nvl_bytes, explicitly_destroy=True),
                         rail_transport=rail, num_rdma_bytes=rail_bytes, extension=_extension() if rail else None)
    gen = torch.Generator().manual_seed(7000 + 31 * rank + num_ranks)
    x, scales, topk_idx, topk_weights, num_experts = _inputs(gen, rank, num_ranks, use_fp8, device)
    per_rank, _, per_expert, in_rank = reference.get_dispatch_layout(topk_idx, num_experts, 0)
    arguments = dict(is_token_in_rank=in_rank, num_tokens_per_rank=per_rank, num_tokens_per_expert=per_expert,
                     topk_idx=topk_idx, topk_weights=topk_weights, expert_alignment=4,
                     num_worst_tokens=num_worst_tokens, num_channels=4, cached_handle=None)
    expected = reference.dispatch(x, scales, stream=0, **arguments)
    got = two_level.dispatch(x, scales, **arguments)
    for field in ("recv_x", "recv_x_scales", "recv_topk_idx", "recv_topk_weights"):
        _equal(getattr(got, field), getattr(expected, field), f"rank {rank}: {field}")
    assert got.num_recv_tokens_per_expert_list == expected.num_recv_tokens_per_expert_list
    for index, name in enumerate(("rank_prefix_matrix", "channel_prefix_matrix", "recv_channel_prefix_matrix",
                                  "recv_src_idx", "is_token_in_rank", "send_head")):
        _equal(got.handle[index], expected.handle[index], f"rank {rank}: handle[{index}] ({name})")

    # A cached dispatch of new rows moves them along the same routes.
    x2, scales2, _, _, _ = _inputs(torch.Generator().manual_seed(9000 + rank), rank, num_ranks, use_fp8, device)
    cached = dict(arguments, cached_handle=got.handle)
    again = two_level.dispatch(x2, scales2, **cached)
    reference_again = reference.dispatch(x2, scales2, stream=0, **dict(arguments, cached_handle=expected.handle))
    _equal(again.recv_x, reference_again.recv_x, f"rank {rank}: cached recv_x")
    _equal(again.recv_x_scales, reference_again.recv_x_scales, f"rank {rank}: cached recv_x_scales")

    # The combine: rows summed inside each host first (bf16 partial sums), so within bf16 rounding.
    num_rows = expected.recv_x.size(0)
    rows = random_bf16(gen, (num_rows, H), 0.25, 2.0).to(device)
    weights = random_weights(gen, num_rows, K).to(device)
    bias = random_bf16(gen, (x.size(0), H), 0.25, 2.0).to(device)
    combined, combined_weights = two_level.combine(rows, got.handle, weights, [bias])
    reference_combined, reference_weights = reference.combine(rows, expected.handle, weights, [bias], 4, 0)
    torch.testing.assert_close(combined.float(), reference_combined.float(), rtol=2e-2, atol=4e-2)
    torch.testing.assert_close(combined_weights, reference_weights, rtol=1e-5, atol=1e-5)
    two_level.destroy()


@pytest.mark.parametrize("num_ranks, per_host", [(4, 2), (4, 1), (6, 3), (6, 2)], ids=lambda v: str(v))
@pytest.mark.parametrize("use_fp8", [False, True], ids=["bf16", "fp8"])
def test_two_hops_match_the_reference(num_ranks, per_host, use_fp8):
    run_ranks(num_ranks, two_hops_body, per_host=per_host, use_fp8=use_fp8, num_worst_tokens=0)


def test_two_hops_with_worst_tokens():
    run_ranks(4, two_hops_body, per_host=2, use_fp8=False, num_worst_tokens=96)



@needs_feature("tcp_transport")
@pytest.mark.parametrize("num_ranks, per_host", [(4, 2), (6, 3), (6, 2)], ids=lambda v: str(v))
@pytest.mark.parametrize("reorder_seed", [None, 11], ids=["in-order", "reordered"])
def test_two_hops_over_the_tcp_transport(num_ranks, per_host, reorder_seed):
    """The rail as writes with immediates through the proxies' tcp transport, delivered in order and out of order."""
    run_ranks(num_ranks, two_hops_body, per_host=per_host, use_fp8=num_ranks == 6, num_worst_tokens=0, rail="tcp",
              reorder_seed=reorder_seed)


def _verbs_devices():
    from tests.transport_exchange import rdma_devices
    return rdma_devices() if has_feature("verbs_transport") else []


@pytest.mark.skipif(not _verbs_devices(), reason="no RDMA device (tests/soft_roce/run_tests.sh runs it on soft-RoCE)")
def test_two_hops_over_verbs():
    """Against a real verbs provider (soft-RoCE in CI's guest), out of order."""
    run_ranks(4, two_hops_body, per_host=2, use_fp8=True, num_worst_tokens=0, rail="verbs", reorder_seed=5)


def _rail_too_small_body(rank, num_ranks, group):
    # Four slots of 512 bytes: a bf16 row of 256 values with its routing does not fit one.
    two_level = TwoLevel(GroupComm(group, rank, num_ranks, CPU, 60.0), ["a", "a", "b", "b"],
                         lambda host_group: Buffer(host_group, explicitly_destroy=True),
                         rail_transport="tcp", num_rdma_bytes=2048, extension=_extension())
    x, _, topk_idx, topk_weights, num_experts = _inputs(torch.Generator().manual_seed(rank), rank, num_ranks, False)
    per_rank, _, per_expert, in_rank = ReferenceEngine(group, rank, num_ranks, CPU, 60.0, None).get_dispatch_layout(
        topk_idx, num_experts, 0)
    # Every rank raises before any write (a rank with no tokens too), naming the size.
    with pytest.raises(ValueError, match=r"a row of \d+ bytes needs num_rdma_bytes >= \d+ to cross hosts; "
                                         r"the Buffer has 2048"):
        two_level.dispatch(x, None, is_token_in_rank=in_rank, num_tokens_per_rank=per_rank,
                           num_tokens_per_expert=per_expert, topk_idx=topk_idx, topk_weights=topk_weights,
                           expert_alignment=1, num_worst_tokens=0, num_channels=4, cached_handle=None)
    two_level.release()


@needs_feature("tcp_transport")
def test_a_rail_region_too_small_names_the_size_on_every_rank():
    run_ranks(4, _rail_too_small_body)


def test_uneven_hosts_are_named():
    assert even_hosts(["a", "a", "b", "b"]) == (2, 2)
    assert even_hosts(["a", "b", "c"]) == (3, 1)
    with pytest.raises(ValueError, match=r"a: 3 GPUs \(ranks 0, 1, 2\); b: 1 GPUs \(ranks 3\)"):
        even_hosts(["a", "a", "a", "b"])
    with pytest.raises(ValueError, match=r"a: 2 GPUs \(ranks 0, 2\); b: 2 GPUs \(ranks 1, 3\)"):
        even_hosts(["a", "b", "a", "b"])


@needs_feature("tcp_transport")
@pytest.mark.parametrize("num_ranks, per_host", [(4, 2), (6, 2)], ids=lambda v: str(v))
def test_two_hops_over_tcp_in_pieces(num_ranks, per_host):
    """A rail region of a few rows per slot: each block crosses in pieces, each after its slot is given back, out
    of order."""
    run_ranks(num_ranks, two_hops_body, per_host=per_host, use_fp8=num_ranks == 6, num_worst_tokens=0, rail="tcp",
              reorder_seed=3, rail_bytes=8192)


def _rail_pieces_body(rank, num_ranks, group, reorder_seed):
    from uccl_ep_plugin.engines.rail import TransportRail
    if reorder_seed is not None:
        os.environ["UCCL_EP_TRANSPORT_REORDER"] = str(reorder_seed + rank)
    width, slot_rows = 40, 3
    rail = TransportRail(group, rank, num_ranks, CPU, 2 * num_ranks * 128, "tcp", 20.0, _extension())
    assert rail.slot_bytes // width == slot_rows

    def block(source, host, step):   # what ``source`` sends ``host`` in exchange ``step``: random, seeded by all 3
        count = (7 * source + 5 * host + 3 * step) % 11 if (source + host + step) % 4 else 0
        gen = torch.Generator().manual_seed(1000 * step + 100 * source + host)
        return torch.randint(0, 256, (count, width), generator=gen, dtype=torch.uint8)

    for step in range(6):   # back to back: a host may start the next exchange before the others finish this one
        blocks = [block(rank, host, step) for host in range(num_ranks)]
        expected = [block(source, rank, step) for source in range(num_ranks)]
        received = rail.exchange(torch.cat(blocks), [b.size(0) for b in blocks], [b.size(0) for b in expected],
                                 f"exchange {step}")
        assert torch.equal(received, torch.cat(expected)), f"rank {rank}, exchange {step}"
    assert rail.writes > 2 * num_ranks * 6   # some blocks went in more than one piece
    dist.barrier(group=group)
    rail.close()


@needs_feature("tcp_transport")
@pytest.mark.parametrize("reorder_seed", [None, 17], ids=["in-order", "reordered"])
def test_a_transport_rail_sends_blocks_larger_than_a_slot_in_pieces(reorder_seed):
    """Blocks of 0 to 10 rows through slots of 3, six exchanges back to back: every row arrives once, in order."""
    run_ranks(3, _rail_pieces_body, reorder_seed=reorder_seed)


def test_the_device_rails_control_area_is_sized_alike_in_python_and_the_extension():
    """The Buffer sizes num_rdma_bytes in Python; the GPU-driven rail lays its region out in C++: the control
    area (freed words, the ordering layer's counter and count flags) must agree, and hold the flags."""
    from uccl_ep_plugin.engines.rail import rail_control_bytes
    native = _extension()
    for num_hosts in (1, 2, 3, 5, 8, 64):
        assert rail_control_bytes(num_hosts) == native.rail_control_bytes(num_hosts), num_hosts
        flags = native.rail_flags_offset(num_hosts)
        assert native.rail_counters_offset(num_hosts) + 8 <= flags
        assert flags % 8 == 0 and flags + 2 * 8 * num_hosts <= rail_control_bytes(num_hosts), num_hosts


def _unequal_rail_bytes_body(rank, num_ranks, group):
    from uccl_ep_plugin.engines.rail import TransportRail
    with pytest.raises(RuntimeError, match=r"num_rdma_bytes differs between the ranks of a rail: host 0: 4096, "
                                           r"host 1: 8192"):
        TransportRail(group, rank, num_ranks, CPU, 4096 * (rank + 1), "tcp", 20.0, _extension())


@needs_feature("tcp_transport")
def test_rail_ranks_with_different_num_rdma_bytes_fail_to_start_on_every_rank():
    run_ranks(2, _unequal_rail_bytes_body)


def _buffer_across_hosts_body(rank, num_ranks, group, rail):
    os.environ["UCCL_EP_GPUS_PER_NODE"] = "2"    # CPU ranks 0-1 one host, 2-3 the other
    if rail == "tcp":
        os.environ.update(UCCL_EP_PROXY_TRANSPORT="tcp", UCCL_SOCKET_IFNAME="lo")
    # DeepEP's recipe sizes the region of the hop between hosts (the hint counts UCCL_EP_GPUS_PER_NODE).
    config = Buffer.get_dispatch_config(num_ranks)
    buffer = Buffer(group, num_nvl_bytes=1 << 16, num_rdma_bytes=config.get_rdma_buffer_size_hint(2 * H, num_ranks),
                    explicitly_destroy=True)
    assert buffer.engine_by_operation["dispatch"] == buffer.engine_by_operation["combine"] == "two_level"
    assert buffer._two_level.rail.name == ("transport" if rail == "tcp" else "collective")
    # One NVLink buffer per rank: the host's Buffer's, not a second one of the same size; and over a transport one
    # region of num_rdma_bytes: the rail's.
    assert buffer.get_local_buffer_tensor(torch.uint8).data_ptr() == \
        buffer._two_level.inner.get_local_buffer_tensor(torch.uint8).data_ptr()
    if rail == "tcp":
        assert buffer.get_local_buffer_tensor(torch.uint8, use_rdma_buffer=True).data_ptr() == \
            buffer._two_level.rail.region.data_ptr()
    reference = ReferenceEngine(group, rank, num_ranks, CPU, 60.0, None)
    gen = torch.Generator().manual_seed(500 + rank)
    x, scales, topk_idx, topk_weights, num_experts = _inputs(gen, rank, num_ranks, use_fp8=True)
    per_rank, per_rdma_rank, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk_idx, num_experts)
    assert per_rdma_rank.numel() == 2
    expected = reference.dispatch(x, scales, stream=0, is_token_in_rank=in_rank, num_tokens_per_rank=per_rank,
                                  num_tokens_per_expert=per_expert, topk_idx=topk_idx, topk_weights=topk_weights,
                                  expert_alignment=1, num_worst_tokens=0,
                                  num_channels=buffer.get_dispatch_config(num_ranks).num_sms // 2, cached_handle=None)
    (recv_x, recv_scales), recv_idx, recv_weights, per_expert_list, handle, event = buffer.dispatch(
        (x, scales), num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_rdma_rank, is_token_in_rank=in_rank,
        num_tokens_per_expert=per_expert, topk_idx=topk_idx, topk_weights=topk_weights, async_finish=True)
    event.current_stream_wait()
    _equal(recv_x, expected.recv_x, f"rank {rank}: recv_x")
    _equal(recv_scales, expected.recv_x_scales, f"rank {rank}: recv_x_scales")
    _equal(recv_idx, expected.recv_topk_idx, f"rank {rank}: recv_topk_idx")
    _equal(recv_weights, expected.recv_topk_weights, f"rank {rank}: recv_topk_weights")
    assert per_expert_list == expected.num_recv_tokens_per_expert_list
    (cached_x, _), *_ = buffer.dispatch((x, scales), handle=handle)
    _equal(cached_x, expected.recv_x, f"rank {rank}: cached recv_x")
    rows = random_bf16(gen, (recv_x.size(0), H), 0.25, 2.0)
    combined, combined_weights, _ = buffer.combine(rows, handle, recv_weights)
    reference_combined, reference_weights = reference.combine(rows, expected.handle, recv_weights, [], 4, 0)
    torch.testing.assert_close(combined.float(), reference_combined.float(), rtol=2e-2, atol=4e-2)
    torch.testing.assert_close(combined_weights, reference_weights, rtol=1e-5, atol=1e-5)
    buffer.destroy()


@pytest.mark.parametrize("rail", [None, pytest.param("tcp", marks=needs_feature("tcp_transport"))], ids=["collective", "tcp"])
def test_buffer_across_hosts_serves_dispatch_and_combine_in_two_hops(rail):
    """UCCL_EP_PROXY_TRANSPORT=tcp (with the interface UCCL_SOCKET_IFNAME names) carries the hop between hosts."""
    run_ranks(4, _buffer_across_hosts_body, rail=rail)


def _unusable_rail_transport_body(rank, num_ranks, group, transport, why):
    os.environ.update(UCCL_EP_GPUS_PER_NODE="1", UCCL_EP_PROXY_TRANSPORT=transport)
    os.environ.pop("UCCL_SOCKET_IFNAME", None)
    with pytest.warns(RuntimeWarning, match=f"not {transport}: .*{why}"):
        buffer = Buffer(group, num_rdma_bytes=RAIL_BYTES, explicitly_destroy=True)
    assert buffer._two_level.rail.name == "collective"
    buffer.destroy()


@needs_feature("tcp_transport")
@pytest.mark.parametrize("transport,why", [("tcp", "UCCL_SOCKET_IFNAME"), ("cuda-copy", "moves GPU memory")])
def test_a_rail_transport_that_cannot_reach_other_hosts_falls_back_to_collectives(transport, why):
    """tcp without an interface that reaches other hosts, and cuda-copy on CPU ranks: the group's collectives carry
    the hop between hosts, with a warning that says why."""
    run_ranks(2, _unusable_rail_transport_body, transport=transport, why=why)


def _uneven_hosts_body(rank, num_ranks, group):
    import os
    os.environ["UCCL_EP_GPUS_PER_NODE"] = "2"    # ranks 0-1 one host, rank 2 alone on another
    buffer = Buffer(group, explicitly_destroy=True)
    gen = torch.Generator().manual_seed(rank)
    x, _, topk_idx, topk_weights, num_experts = _inputs(gen, rank, num_ranks, use_fp8=False)
    per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk_idx, num_experts)
    with pytest.raises(ValueError, match=r"2 GPUs \(ranks 0, 1\); .*1 GPUs \(ranks 2\)"):
        buffer.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                        topk_idx=topk_idx, topk_weights=topk_weights)
    buffer.destroy()


def test_uneven_hosts_make_dispatch_raise_naming_them():
    run_ranks(3, _uneven_hosts_body)


def _too_many_for_worst_tokens_body(rank, num_ranks, group):
    two_level = TwoLevel(GroupComm(group, rank, num_ranks, CPU, 60.0), ["a", "a", "b", "b"],
                         lambda host_group: Buffer(host_group, explicitly_destroy=True))
    x, _, topk_idx, topk_weights, num_experts = _inputs(torch.Generator().manual_seed(rank), rank, num_ranks, False)
    per_rank, _, per_expert, in_rank = ReferenceEngine(group, rank, num_ranks, CPU, 60.0, None).get_dispatch_layout(
        topk_idx, num_experts, 0)
    # Every rank learns every count in the first exchange and raises there, before a row crosses a host.
    with pytest.raises(RuntimeError, match="more than num_worst_tokens=8"):
        two_level.dispatch(x, None, is_token_in_rank=in_rank, num_tokens_per_rank=per_rank,
                           num_tokens_per_expert=per_expert, topk_idx=topk_idx, topk_weights=topk_weights,
                           expert_alignment=1, num_worst_tokens=8, num_channels=4, cached_handle=None)
    two_level.destroy()


def test_too_many_tokens_for_num_worst_tokens_raise_on_every_rank():
    run_ranks(4, _too_many_for_worst_tokens_body)


def _without_topk_body(rank, num_ranks, group):
    reference = ReferenceEngine(group, rank, num_ranks, CPU, 60.0, None)
    two_level = TwoLevel(reference.comm, ["a", "a", "b", "b"],
                         lambda host_group: Buffer(host_group, explicitly_destroy=True))
    gen = torch.Generator().manual_seed(300 + rank)
    x, _, topk_idx, _, num_experts = _inputs(gen, rank, num_ranks, use_fp8=False)
    per_rank, _, per_expert, in_rank = reference.get_dispatch_layout(topk_idx, num_experts, 0)
    # The routing alone (DeepEP allows a dispatch without top-k): no experts, no weights, past either hop.
    arguments = dict(is_token_in_rank=in_rank, num_tokens_per_rank=per_rank, num_tokens_per_expert=per_expert,
                     topk_idx=None, topk_weights=None, expert_alignment=1, num_worst_tokens=0, num_channels=4,
                     cached_handle=None)
    got = two_level.dispatch(x, None, **arguments)
    expected = reference.dispatch(x, None, stream=0, **arguments)
    _equal(got.recv_x, expected.recv_x, f"rank {rank}: recv_x")
    assert got.recv_topk_idx is None and got.recv_topk_weights is None
    _equal(got.handle[3], expected.handle[3], f"rank {rank}: recv_src_idx")
    rows = random_bf16(gen, (got.recv_x.size(0), H), 0.25, 2.0)
    combined, weights = two_level.combine(rows, got.handle, None, [])
    reference_combined, reference_weights = reference.combine(rows, expected.handle, None, [], 4, 0)
    assert weights is None and reference_weights is None
    torch.testing.assert_close(combined.float(), reference_combined.float(), rtol=2e-2, atol=4e-2)
    two_level.destroy()


def test_two_hops_without_topk():
    run_ranks(4, _without_topk_body)


def _collectives_body(rank, num_ranks, group):
    reference = ReferenceEngine(group, rank, num_ranks, CPU, 60.0, None)
    two_level = TwoLevel(reference.comm, ["a", "a", "b", "b"],
                         lambda host_group: Buffer(host_group, explicitly_destroy=True))
    x, scales, topk_idx, topk_weights, num_experts = _inputs(torch.Generator().manual_seed(rank), rank, num_ranks,
                                                             use_fp8=True)
    per_rank, _, per_expert, in_rank = reference.get_dispatch_layout(topk_idx, num_experts, 0)
    # The collectives of the two hops themselves: the host's Buffer (the native engine on GPUs) is left out.
    calls = []
    for name in ("all_gather", "all_to_all_single", "all_reduce", "all_gather_into_tensor", "broadcast", "barrier"):
        def counted(*args, _collective=getattr(dist, name), _name=name, **kwargs):
            calls.append(_name)
            return _collective(*args, **kwargs)
        setattr(dist, name, counted)
    for operation in ("dispatch", "combine"):
        def uncounted(*args, _operation=getattr(two_level.inner, operation), **kwargs):
            before = len(calls)
            try:
                return _operation(*args, **kwargs)
            finally:
                del calls[before:]
        setattr(two_level.inner, operation, uncounted)
    got = two_level.dispatch(x, scales, is_token_in_rank=in_rank, num_tokens_per_rank=per_rank,
                             num_tokens_per_expert=per_expert, topk_idx=topk_idx, topk_weights=topk_weights,
                             expert_alignment=1, num_worst_tokens=0, num_channels=4, cached_handle=None)
    # One gather of the layout (with the rail's counts), the rows along the rail, the forwarded rows' source tokens.
    assert calls == ["all_gather", "all_to_all_single", "all_gather"], calls
    calls.clear()
    two_level.dispatch(x, scales, is_token_in_rank=in_rank, num_tokens_per_rank=per_rank,
                       num_tokens_per_expert=per_expert, topk_idx=None, topk_weights=None, expert_alignment=1,
                       num_worst_tokens=0, num_channels=4, cached_handle=got.handle)
    assert calls == ["all_to_all_single"], calls   # a cached dispatch: the rows alone
    calls.clear()
    rows = random_bf16(torch.Generator().manual_seed(rank), (got.recv_x.size(0), H), 0.25, 2.0)
    two_level.combine(rows, got.handle, got.recv_topk_weights, [])
    assert calls == ["all_to_all_single"], calls   # the partial sums alone
    two_level.destroy()


def test_the_two_hops_run_three_collectives_per_dispatch_and_one_per_combine():
    """A change that adds a collective (each one a host wait on NCCL) to the two hops fails here."""
    run_ranks(4, _collectives_body)


def _release_body(rank, num_ranks, group):
    import os
    os.environ["UCCL_EP_GPUS_PER_NODE"] = "1"
    destroyed = Buffer(group, explicitly_destroy=True)
    inner = destroyed._two_level.inner
    destroyed.destroy()
    assert inner._destroyed and destroyed._two_level is None
    collected = Buffer(group)                    # released when garbage-collected, without its peers
    inner = collected._two_level.inner
    del collected
    import gc
    gc.collect()
    assert inner._destroyed


def test_the_hosts_buffer_goes_with_the_buffer():
    run_ranks(2, _release_body)


def _silent_rail_peer_body(rank, num_ranks, group):
    from uccl_ep_plugin.engines.rail import TransportRail
    from uccl_ep_plugin.engines.reference import CommTimeoutError
    rail = TransportRail(group, rank, num_ranks, CPU, RAIL_BYTES, "tcp", 2.0, _extension())
    if rank == 0:   # rank 1 never sends its rows
        with pytest.raises(CommTimeoutError, match=r"rank 0 timed out after 2s in phase 'dispatch across hosts' "
                                                   r"waiting for the rows of host\(s\) 1 \(rail transport\)"):
            rail.exchange(torch.ones((3, 64), dtype=torch.uint8), [1, 2], [1, 4], "dispatch across hosts")
    dist.barrier(group=group)
    rail.close()


def _unexpected_rows_body(rank, num_ranks, group):
    from uccl_ep_plugin.engines.rail import TransportRail
    rail = TransportRail(group, rank, num_ranks, CPU, RAIL_BYTES, "tcp", 20.0, _extension())
    rows = torch.arange(4 * 16, dtype=torch.uint8).view(4, 16)
    if rank == 0:   # expects 3 rows from host 1, which sends 2
        with pytest.raises(RuntimeError, match=r"host 1 announced 2 rows left after 0 of the 3 expected"):
            rail.exchange(rows, [2, 2], [2, 3], "combine across hosts")
    else:
        assert torch.equal(rail.exchange(rows, [2, 2], [2, 2], "combine across hosts"),
                           torch.cat([rows[2:], rows[2:]]))
    dist.barrier(group=group)
    rail.close()


@needs_feature("tcp_transport")
def test_rows_a_rail_peer_did_not_announce_raise_naming_it():
    run_ranks(2, _unexpected_rows_body)


@needs_feature("tcp_transport")
def test_a_silent_rail_peer_times_out_naming_the_phase():
    run_ranks(2, _silent_rail_peer_body)
