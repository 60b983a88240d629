"""The public API matches DeepEP 1.2.1: names, parameter order and defaults (``inspect.signature``),
static methods, exports, and the arity and contents of every returned tuple and handle."""

import inspect

import pytest
import torch

import uccl_ep_plugin
from uccl_ep_plugin import Buffer, Config, EventOverlap
from tests.reference_checks import (SectionCache, assert_section, generator, random_bf16, random_topk_idx,
                                    random_weights)

REQUIRED = inspect.Parameter.empty

_DISPATCH = [("x", REQUIRED), ("handle", None), ("num_tokens_per_rank", None), ("num_tokens_per_rdma_rank", None),
             ("is_token_in_rank", None), ("num_tokens_per_expert", None), ("topk_idx", None), ("topk_weights", None),
             ("expert_alignment", 1), ("num_worst_tokens", 0), ("config", None), ("previous_event", None),
             ("async_finish", False), ("allocate_on_comm_stream", False)]
_COMBINE = [("x", REQUIRED), ("handle", REQUIRED), ("topk_weights", None), ("bias", None), ("config", None),
            ("previous_event", None), ("async_finish", False), ("allocate_on_comm_stream", False)]

# Methods called on an instance: parameters after ``self``.
BUFFER_METHODS = {
    "__init__": [("group", REQUIRED), ("num_nvl_bytes", 0), ("num_rdma_bytes", 0), ("low_latency_mode", False),
                 ("num_qps_per_rank", 24), ("allow_nvlink_for_low_latency_mode", True), ("allow_mnnvl", False),
                 ("use_fabric", False), ("explicitly_destroy", False), ("enable_shrink", False), ("comm", None)],
    "destroy": [],
    "get_comm_stream": [],
    "get_local_buffer_tensor": [("dtype", REQUIRED), ("size", None), ("offset", 0), ("use_rdma_buffer", False)],
    "get_dispatch_layout": [("topk_idx", REQUIRED), ("num_experts", REQUIRED), ("previous_event", None),
                            ("async_finish", False), ("allocate_on_comm_stream", False)],
    "dispatch": _DISPATCH,
    "combine": _COMBINE,
    "internode_dispatch": _DISPATCH,
    "internode_combine": _COMBINE,
    "clean_low_latency_buffer": [("num_max_dispatch_tokens_per_rank", REQUIRED), ("hidden", REQUIRED),
                                 ("num_experts", REQUIRED)],
    "low_latency_dispatch": [("x", REQUIRED), ("topk_idx", REQUIRED), ("num_max_dispatch_tokens_per_rank", REQUIRED),
                             ("num_experts", REQUIRED), ("cumulative_local_expert_recv_stats", None),
                             ("dispatch_wait_recv_cost_stats", None), ("use_fp8", True), ("round_scale", False),
                             ("use_ue8m0", False), ("async_finish", False), ("return_recv_hook", False)],
    "low_latency_combine": [("x", REQUIRED), ("topk_idx", REQUIRED), ("topk_weights", REQUIRED), ("handle", REQUIRED),
                            ("use_logfmt", False), ("zero_copy", False), ("async_finish", False),
                            ("return_recv_hook", False), ("out", None), ("combine_wait_recv_cost_stats", None)],
    "get_next_low_latency_combine_buffer": [("handle", REQUIRED)],
    "low_latency_update_mask_buffer": [("rank_to_mask", REQUIRED), ("mask", False)],
    "low_latency_query_mask_buffer": [("mask_status", REQUIRED)],
    "low_latency_clean_mask_buffer": [],
}

BUFFER_STATIC_METHODS = {
    "is_sm90_compiled": [],
    "set_num_sms": [("new_num_sms", REQUIRED)],
    "capture": [],
    "get_low_latency_rdma_size_hint": [("num_max_dispatch_tokens_per_rank", REQUIRED), ("hidden", REQUIRED),
                                       ("num_ranks", REQUIRED), ("num_experts", REQUIRED)],
    "get_dispatch_config": [("num_ranks", REQUIRED)],
    "get_combine_config": [("num_ranks", REQUIRED)],
}

CONFIG_METHODS = {
    "__init__": [("num_sms", 20), ("num_max_nvl_chunked_send_tokens", 6), ("num_max_nvl_chunked_recv_tokens", 256),
                 ("num_max_rdma_chunked_send_tokens", 6), ("num_max_rdma_chunked_recv_tokens", 256)],
    "get_nvl_buffer_size_hint": [("hidden_bytes", REQUIRED), ("num_ranks", REQUIRED)],
    "get_rdma_buffer_size_hint": [("hidden_bytes", REQUIRED), ("num_ranks", REQUIRED)],
}

EVENT_OVERLAP_METHODS = {
    "__init__": [("event", None), ("extra_tensors", None)],
    "current_stream_wait": [],
    "__enter__": [],
    "__exit__": [("exc_type", REQUIRED), ("exc_val", REQUIRED), ("exc_tb", REQUIRED)],
}


def _parameters(function, skip_self: bool):
    params = list(inspect.signature(function).parameters.values())
    if skip_self:
        assert params and params[0].name == "self", f"first parameter of {function} is not self"
        params = params[1:]
    for p in params:
        assert p.kind == inspect.Parameter.POSITIONAL_OR_KEYWORD, \
            f"{function.__qualname__}: {p.name} is {p.kind.description}, DeepEP's can be passed by position or name"
    return [(p.name, p.default) for p in params]


def _assert_same(got, expected, what):
    assert [n for n, _ in got] == [n for n, _ in expected], f"{what}: parameter names/order {got} != {expected}"
    for (name, default), (_, want) in zip(got, expected):
        assert default == want and type(default) is type(want), \
            f"{what}: default of {name} is {default!r}, DeepEP's is {want!r}"


@pytest.mark.parametrize("name", sorted(BUFFER_METHODS))
def test_buffer_method_signature(name):
    member = inspect.getattr_static(Buffer, name)
    assert inspect.isfunction(member), f"Buffer.{name} must be a plain method, got {type(member).__name__}"
    _assert_same(_parameters(getattr(Buffer, name), skip_self=True), BUFFER_METHODS[name], f"Buffer.{name}")


@pytest.mark.parametrize("name", sorted(BUFFER_STATIC_METHODS))
def test_buffer_static_method_signature(name):
    member = inspect.getattr_static(Buffer, name)
    assert isinstance(member, staticmethod), f"Buffer.{name} must be a staticmethod, got {type(member).__name__}"
    _assert_same(_parameters(getattr(Buffer, name), skip_self=False), BUFFER_STATIC_METHODS[name], f"Buffer.{name}")


@pytest.mark.parametrize("name", sorted(CONFIG_METHODS))
def test_config_signature(name):
    _assert_same(_parameters(getattr(Config, name), skip_self=True), CONFIG_METHODS[name], f"Config.{name}")


@pytest.mark.parametrize("name", sorted(EVENT_OVERLAP_METHODS))
def test_event_overlap_signature(name):
    _assert_same(_parameters(getattr(EventOverlap, name), skip_self=True), EVENT_OVERLAP_METHODS[name],
                 f"EventOverlap.{name}")


def test_module_exports():
    assert uccl_ep_plugin.topk_idx_t is torch.int64
    for name in ("Buffer", "Config", "EventOverlap", "topk_idx_t"):
        assert name in uccl_ep_plugin.__all__, f"{name} missing from uccl_ep_plugin.__all__"
    assert Buffer.num_sms == 20 and type(Buffer.__dict__["num_sms"]) is int


def test_static_methods_return_deepep_types():
    assert isinstance(Buffer.is_sm90_compiled(), bool)
    assert isinstance(Buffer.capture(), EventOverlap)
    hint = Buffer.get_low_latency_rdma_size_hint(128, 7168, 16, 256)
    assert isinstance(hint, int) and hint > 0
    # The hint grows with every argument.
    assert Buffer.get_low_latency_rdma_size_hint(256, 7168, 16, 256) > hint
    assert Buffer.get_low_latency_rdma_size_hint(128, 7168 * 2, 16, 256) > hint
    assert Buffer.get_low_latency_rdma_size_hint(128, 7168, 16, 512) > hint
    for num_ranks in (2, 4, 8, 16):
        for getter in (Buffer.get_dispatch_config, Buffer.get_combine_config):
            config = getter(num_ranks)
            assert isinstance(config, Config)
            assert config.num_sms == Buffer.num_sms
            nvl = config.get_nvl_buffer_size_hint(7168 * 2, num_ranks)
            rdma = config.get_rdma_buffer_size_hint(7168 * 2, num_ranks)
            assert isinstance(nvl, int) and nvl > 0
            assert isinstance(rdma, int) and (rdma == 0) == (num_ranks <= 8)


def test_the_rdma_hint_counts_the_gpus_of_a_node(monkeypatch):
    """Nodes of fewer than 8 GPUs (UCCL_EP_GPUS_PER_NODE, else torchrun's LOCAL_WORLD_SIZE) get a region for the
    hop between them, as large as DeepEP's recipe gives for as many nodes of 8."""
    config = Buffer.get_dispatch_config(8)
    monkeypatch.setenv("UCCL_EP_GPUS_PER_NODE", "8")   # the project's own setting comes first
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    two_nodes_of_8 = config.get_rdma_buffer_size_hint(7168 * 2, 16)
    assert two_nodes_of_8 > 0 and config.get_rdma_buffer_size_hint(7168 * 2, 8) == 0
    monkeypatch.delenv("UCCL_EP_GPUS_PER_NODE")
    assert config.get_rdma_buffer_size_hint(7168 * 2, 8) == two_nodes_of_8
    assert config.get_rdma_buffer_size_hint(7168 * 2, 4) == 0
    monkeypatch.setenv("UCCL_EP_GPUS_PER_NODE", "1")
    assert config.get_rdma_buffer_size_hint(7168 * 2, 2) == two_nodes_of_8
    assert config.get_rdma_buffer_size_hint(7168 * 2, 1) == 0


def test_config_defaults_and_event_overlap():
    config = Config()
    # Like DeepEP's Config, the RDMA receive queue is rounded up to whole send chunks: 256 -> 258 for chunks of 6.
    assert (config.num_sms, config.num_max_nvl_chunked_send_tokens, config.num_max_nvl_chunked_recv_tokens,
            config.num_max_rdma_chunked_send_tokens, config.num_max_rdma_chunked_recv_tokens) == (20, 6, 256, 6, 258)
    extra = (torch.ones(2),)
    overlap = EventOverlap(None, extra)
    assert overlap.event is None and overlap.extra_tensors is extra
    with overlap as entered:
        assert entered is overlap


# ---------------------------------------------------------------------------------------- returned tuples
N_TOKENS, HIDDEN, TOPK, T_MAX = 9, 256, 3, 12
RETURN_SECTIONS = ["layout_tuple", "dispatch_tuple", "normal_handle", "fp8_dispatch_tuple", "cached_dispatch_tuple",
                   "combine_tuple", "ll_dispatch_tuple", "ll_handle", "ll_combine_tuple", "ll_hook_tuples",
                   "ll_combine_buffer"]


def _returns_body(rank, num_ranks, group, rec):
    e = 4 * num_ranks
    el = e // num_ranks
    gen = generator(404, rank)
    x = random_bf16(gen, (N_TOKENS, HIDDEN), 0.25, 2.0)
    topk_idx = random_topk_idx(gen, N_TOKENS, e, TOPK, 0.2)
    topk_weights = random_weights(gen, N_TOKENS, TOPK)
    buffer = Buffer(group)
    num_channels = Buffer.get_dispatch_config(num_ranks).num_sms // 2

    def expect_tensor(value, dtype, shape, what):
        if rec.expect(isinstance(value, torch.Tensor), f"{what}: got {type(value).__name__}, expected a tensor"):
            rec.equal(value.dtype, dtype, f"{what} dtype")
            rec.equal(tuple(value.shape), tuple(shape), f"{what} shape")

    with rec.section("layout_tuple"):
        layout = buffer.get_dispatch_layout(topk_idx, e)
        rec.expect(type(layout) is tuple and len(layout) == 5, f"get_dispatch_layout returns {len(layout)} items")
        expect_tensor(layout[0], torch.int32, (num_ranks,), "num_tokens_per_rank")
        rec.expect(layout[1] is None, "num_tokens_per_rdma_rank within one node must be None")
        expect_tensor(layout[2], torch.int32, (e,), "num_tokens_per_expert")
        expect_tensor(layout[3], torch.bool, (N_TOKENS, num_ranks), "is_token_in_rank")
        rec.expect(isinstance(layout[4], EventOverlap), "layout event must be an EventOverlap")

    with rec.section("dispatch_tuple"):
        result = buffer.dispatch(x, num_tokens_per_rank=layout[0], is_token_in_rank=layout[3],
                                 num_tokens_per_expert=layout[2], topk_idx=topk_idx, topk_weights=topk_weights)
        rec.expect(type(result) is tuple and len(result) == 6, f"dispatch returns {len(result)} items")
        recv = result[0].size(0)
        expect_tensor(result[0], torch.bfloat16, (recv, HIDDEN), "recv_x")
        expect_tensor(result[1], uccl_ep_plugin.topk_idx_t, (recv, TOPK), "recv_topk_idx")
        expect_tensor(result[2], torch.float32, (recv, TOPK), "recv_topk_weights")
        rec.expect(type(result[3]) is list and len(result[3]) == el and all(type(v) is int for v in result[3]),
                   f"num_recv_tokens_per_expert_list must be a list of {el} ints, got {result[3]!r}")
        rec.expect(isinstance(result[4], tuple), "handle must be a tuple")
        rec.expect(isinstance(result[5], EventOverlap), "dispatch event must be an EventOverlap")

    with rec.section("normal_handle"):
        handle = result[4]
        rec.equal(len(handle), 6, "normal handle length")
        expect_tensor(handle[0], torch.int32, (num_ranks, num_ranks), "rank_prefix_matrix")
        expect_tensor(handle[1], torch.int32, (num_ranks, num_channels), "channel_prefix_matrix")
        expect_tensor(handle[2], torch.int32, (num_ranks, num_channels), "recv_channel_prefix_matrix")
        expect_tensor(handle[3], torch.int32, (recv,), "recv_src_idx")
        expect_tensor(handle[4], torch.bool, (N_TOKENS, num_ranks), "is_token_in_rank")
        expect_tensor(handle[5], torch.int32, (N_TOKENS, num_ranks), "send_head")
        a, b, c, d, f, g = handle                                   # unpacks like DeepEP's plain tuple
        rec.expect(handle[0] is a and handle[5] is g, "handle indexing and unpacking agree")

    with rec.section("fp8_dispatch_tuple"):
        x_fp8 = (torch.randn((N_TOKENS, HIDDEN), generator=gen) * 16).to(torch.float8_e4m3fn)
        scales = torch.rand((N_TOKENS, HIDDEN // 128), generator=gen) + 0.5
        fp8 = buffer.dispatch((x_fp8, scales), num_tokens_per_rank=layout[0], is_token_in_rank=layout[3],
                              num_tokens_per_expert=layout[2], topk_idx=topk_idx, topk_weights=topk_weights)
        rec.equal(len(fp8), 6, "fp8 dispatch tuple length")
        if rec.expect(type(fp8[0]) is tuple and len(fp8[0]) == 2, "fp8 recv_x must be a (data, scales) tuple"):
            expect_tensor(fp8[0][0], torch.float8_e4m3fn, (recv, HIDDEN), "fp8 recv_x data")
            expect_tensor(fp8[0][1], torch.float32, (recv, HIDDEN // 128), "fp8 recv_x scales")

    with rec.section("cached_dispatch_tuple"):
        cached = buffer.dispatch(x, handle=handle)
        rec.expect(type(cached) is tuple and len(cached) == 6, f"cached dispatch returns {len(cached)} items")
        expect_tensor(cached[0], torch.bfloat16, (recv, HIDDEN), "cached recv_x")
        rec.expect(cached[1:5] == (None, None, None, None), f"cached dispatch slots 1-4 must be None: {cached[1:5]}")
        rec.expect(isinstance(cached[5], EventOverlap), "cached dispatch event must be an EventOverlap")

    with rec.section("combine_tuple"):
        combined = buffer.combine(result[0], handle, topk_weights=result[2])
        rec.expect(type(combined) is tuple and len(combined) == 3, f"combine returns {len(combined)} items")
        expect_tensor(combined[0], torch.bfloat16, (N_TOKENS, HIDDEN), "combined_x")
        expect_tensor(combined[1], torch.float32, (N_TOKENS, TOPK), "combined_topk_weights")
        rec.expect(isinstance(combined[2], EventOverlap), "combine event must be an EventOverlap")
        rec.expect(buffer.combine(result[0], handle)[1] is None, "combined_topk_weights without weights is None")

    ll_buffer = Buffer(group, 0, Buffer.get_low_latency_rdma_size_hint(T_MAX, HIDDEN, num_ranks, e),
                       low_latency_mode=True, num_qps_per_rank=el)
    slots = num_ranks * T_MAX
    with rec.section("ll_dispatch_tuple"):
        ll = ll_buffer.low_latency_dispatch(x, topk_idx, T_MAX, e)            # use_fp8=True by default
        rec.expect(type(ll) is tuple and len(ll) == 5, f"low_latency_dispatch returns {len(ll)} items")
        if rec.expect(type(ll[0]) is tuple and len(ll[0]) == 2, "default (fp8) recv_x must be a (data, scales) tuple"):
            expect_tensor(ll[0][0], torch.float8_e4m3fn, (el, slots, HIDDEN), "packed_recv_x")
            expect_tensor(ll[0][1], torch.float32, (el, slots, HIDDEN // 128), "packed_recv_x scales")
        expect_tensor(ll[1], torch.int32, (el,), "packed_recv_count")
        rec.expect(isinstance(ll[3], EventOverlap), "low-latency dispatch event must be an EventOverlap")
        rec.expect(ll[4] is None, "hook must be None without return_recv_hook")
        bf16 = ll_buffer.low_latency_dispatch(x, topk_idx, T_MAX, e, use_fp8=False)
        expect_tensor(bf16[0], torch.bfloat16, (el, slots, HIDDEN), "bf16 packed_recv_x")

    with rec.section("ll_handle"):
        ll_handle = ll[2]
        rec.expect(isinstance(ll_handle, tuple) and len(ll_handle) == 5, "low-latency handle must be a 5-tuple")
        expect_tensor(ll_handle[0], torch.int32, (el, slots), "src_info")
        expect_tensor(ll_handle[1], torch.int64, (el, num_ranks), "layout_range")
        rec.equal(tuple(ll_handle[2:]), (T_MAX, HIDDEN, e), "handle's num_max_dispatch_tokens_per_rank, hidden, "
                                                           "num_experts")
        rec.expect(all(type(v) is int for v in ll_handle[2:]), "handle sizes must be Python ints")

    with rec.section("ll_combine_tuple"):
        out = ll_buffer.low_latency_combine(bf16[0], topk_idx, topk_weights, bf16[2])
        rec.expect(type(out) is tuple and len(out) == 3, f"low_latency_combine returns {len(out)} items")
        expect_tensor(out[0], torch.bfloat16, (N_TOKENS, HIDDEN), "combined_x")
        rec.expect(isinstance(out[1], EventOverlap), "low-latency combine event must be an EventOverlap")
        rec.expect(out[2] is None, "combine hook must be None without return_recv_hook")

    with rec.section("ll_hook_tuples"):
        hooked = ll_buffer.low_latency_dispatch(x, topk_idx, T_MAX, e, use_fp8=False, return_recv_hook=True)
        rec.equal(len(hooked), 5, "dispatch with hook tuple length")
        rec.expect(callable(hooked[4]), "dispatch hook must be callable")
        if callable(hooked[4]):
            rec.expect(hooked[4]() is None, "hook() returns None")
        hooked_combine = ll_buffer.low_latency_combine(hooked[0], topk_idx, topk_weights, hooked[2],
                                                       return_recv_hook=True)
        rec.equal(len(hooked_combine), 3, "combine with hook tuple length")
        rec.expect(callable(hooked_combine[2]), "combine hook must be callable")
        if callable(hooked_combine[2]):
            hooked_combine[2]()

    with rec.section("ll_combine_buffer"):
        view = ll_buffer.get_next_low_latency_combine_buffer(bf16[2])
        expect_tensor(view, torch.bfloat16, (el, slots, HIDDEN), "get_next_low_latency_combine_buffer")
        raw = ll_buffer.get_local_buffer_tensor(torch.uint8, use_rdma_buffer=True)
        expect_tensor(raw, torch.uint8, (ll_buffer.num_rdma_bytes,), "get_local_buffer_tensor(uint8, rdma)")
        shaped = ll_buffer.get_local_buffer_tensor(torch.bfloat16, torch.Size([4, 8]), offset=128, use_rdma_buffer=True)
        expect_tensor(shaped, torch.bfloat16, (4, 8), "get_local_buffer_tensor with size")
        rec.equal(shaped.data_ptr(), raw.data_ptr() + 128, "get_local_buffer_tensor offset is in bytes")


_RETURNS = SectionCache(_returns_body)


@pytest.mark.parametrize("section", RETURN_SECTIONS)
def test_returned_tuples(section):
    assert_section(_RETURNS.get(2), section)
