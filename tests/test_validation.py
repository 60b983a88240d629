"""Bad input raises TypeError (wrong type or dtype), ValueError (wrong shape or value) or RuntimeError
(wrong state) naming the argument, before any communication.

Most cases run on a one-rank gloo group; the cases where the group size matters run on two ranks,
and there rank 0 alone also makes every bad call of the catalogue before both ranks run valid
collectives: a bad call that had communicated before raising would leave the ranks out of step.
"""

import os

import pytest
import torch
import torch.distributed as dist

from tests.multiprocess import environment
from tests.reference_checks import (SectionCache, assert_section, generator, random_bf16, random_topk_idx,
                                    random_weights)

FP8 = torch.float8_e4m3fn
N, H, K, T = 5, 256, 2, 8            # tokens, hidden, top-k, num_max_dispatch_tokens_per_rank


class Context:
    """Valid inputs and buffers for ``num_ranks`` ranks; each case breaks one thing."""

    def __init__(self, rank: int, num_ranks: int, group) -> None:
        from uccl_ep_plugin import Buffer
        self.rank, self.num_ranks, self.group = rank, num_ranks, group
        self.E = 4 * num_ranks
        self.El = 4
        gen = generator(31, rank)
        self.x = random_bf16(gen, (N, H), 0.25, 2.0)
        self.topk_idx = random_topk_idx(gen, N, self.E, K, 0.1)
        self.topk_weights = random_weights(gen, N, K)
        self.x_fp8 = (torch.randn((N, H), generator=gen) * 32).to(FP8)
        self.scales = torch.rand((N, H // 128), generator=gen) + 0.5
        self.ll_size = Buffer.get_low_latency_rdma_size_hint(T, H, num_ranks, self.E)
        self.nb = Buffer(group)
        self.nb2 = Buffer(group)
        self.lb = Buffer(group, 0, self.ll_size, low_latency_mode=True)
        self.lb2 = Buffer(group, 0, self.ll_size, low_latency_mode=True)
        self.shrink = Buffer(group, 0, self.ll_size, low_latency_mode=True, enable_shrink=True)
        self.small = Buffer(group, 0, self.ll_size - 128, low_latency_mode=True)
        self.normal_with_rdma = Buffer(group, 0, self.ll_size)
        # Made here, by every rank: creating a Buffer is a collective (the ranks compare their sizes).
        self.destroyed_normal = Buffer(group, explicitly_destroy=True)
        self.destroyed_ll = Buffer(group, 0, self.ll_size, low_latency_mode=True, explicitly_destroy=True)
        self.destroyed_normal.destroy()
        self.destroyed_ll.destroy()
        self.layout = self.nb.get_dispatch_layout(self.topk_idx, self.E)
        # Collectives, run by every rank while building the context.
        self.dispatched = self.nb.dispatch(self.x, **self.layout_kwargs(), topk_idx=self.topk_idx,
                                           topk_weights=self.topk_weights)
        self.handle = self.dispatched[4]
        self.recv_x = self.dispatched[0]
        layout2 = self.nb2.get_dispatch_layout(self.topk_idx, self.E)
        self.handle2 = self.nb2.dispatch(self.x, num_tokens_per_rank=layout2[0], is_token_in_rank=layout2[3],
                                         num_tokens_per_expert=layout2[2])[4]
        self.ll = self.lb.low_latency_dispatch(self.x, self.topk_idx, T, self.E, use_fp8=False)
        self.ll2 = self.lb2.low_latency_dispatch(self.x, self.topk_idx, T, self.E, use_fp8=False)
        self.ll_x = self.ll[0]

    def layout_kwargs(self, **overrides) -> dict:
        kwargs = {"num_tokens_per_rank": self.layout[0], "is_token_in_rank": self.layout[3],
                  "num_tokens_per_expert": self.layout[2]}
        kwargs.update(overrides)
        return kwargs

    def dispatch(self, x=None, **overrides):
        kwargs = {"topk_idx": self.topk_idx, "topk_weights": self.topk_weights}
        kwargs.update(self.layout_kwargs())
        kwargs.update(overrides)
        return self.nb.dispatch(self.x if x is None else x, **kwargs)

    def ll_dispatch(self, x=None, topk_idx=None, buffer=None, **kwargs):
        buffer = buffer or self.lb
        return buffer.low_latency_dispatch(self.x if x is None else x, self.topk_idx if topk_idx is None else topk_idx,
                                           kwargs.pop("num_max", T), kwargs.pop("num_experts", self.E), **kwargs)

    def ll_combine(self, x=None, topk_idx=None, topk_weights=None, handle=None, buffer=None, **kwargs):
        buffer = buffer or self.lb
        return buffer.low_latency_combine(self.ll_x if x is None else x,
                                          self.topk_idx if topk_idx is None else topk_idx,
                                          self.topk_weights if topk_weights is None else topk_weights,
                                          self.ll[2] if handle is None else handle, **kwargs)

    def with_value(self, tensor: torch.Tensor, value: int) -> torch.Tensor:
        changed = tensor.clone()
        changed[N // 2, 0] = value
        return changed

    def handle_for_other_rank_count(self) -> tuple:
        r = self.num_ranks + 1
        h = self.handle
        return (torch.zeros((r, r), dtype=torch.int32), torch.zeros((r, h[1].size(1)), dtype=torch.int32),
                torch.zeros((r, h[2].size(1)), dtype=torch.int32), h[3], torch.zeros((N, r), dtype=torch.bool),
                torch.zeros((N, r), dtype=torch.int32))

    def destroyed(self, low_latency: bool = False):
        return self.destroyed_ll if low_latency else self.destroyed_normal


def _new_buffer(**kwargs):
    from uccl_ep_plugin import Buffer
    return Buffer(**kwargs)


def _config(**kwargs):
    from uccl_ep_plugin import Config
    return Config(**kwargs)


def _set_num_sms(value):
    from uccl_ep_plugin import Buffer
    return Buffer.set_num_sms(value)


def _ll_hint(*args):
    from uccl_ep_plugin import Buffer
    return Buffer.get_low_latency_rdma_size_hint(*args)


# (name, exception, text the message must contain, call). Every call is local and must raise before
# communicating; `c` is a Context.
CASES = [
    # ---- dtypes
    ("dispatch_x_float32", TypeError, "x", lambda c: c.dispatch(c.x.float())),
    ("dispatch_topk_idx_int32", TypeError, "topk_idx", lambda c: c.dispatch(topk_idx=c.topk_idx.int())),
    ("dispatch_topk_weights_float64", TypeError, "topk_weights",
     lambda c: c.dispatch(topk_weights=c.topk_weights.double())),
    ("dispatch_scales_float16", TypeError, "scales", lambda c: c.dispatch((c.x_fp8, c.scales.half()))),
    ("dispatch_fp8_data_bf16", TypeError, "x[0]", lambda c: c.dispatch((c.x, c.scales))),
    ("dispatch_num_tokens_per_rank_int64", TypeError, "num_tokens_per_rank",
     lambda c: c.dispatch(num_tokens_per_rank=c.layout[0].long())),
    ("dispatch_is_token_in_rank_int", TypeError, "is_token_in_rank",
     lambda c: c.dispatch(is_token_in_rank=c.layout[3].int())),
    ("dispatch_num_tokens_per_expert_int64", TypeError, "num_tokens_per_expert",
     lambda c: c.dispatch(num_tokens_per_expert=c.layout[2].long())),
    ("layout_topk_idx_int32", TypeError, "topk_idx", lambda c: c.nb.get_dispatch_layout(c.topk_idx.int(), c.E)),
    ("layout_num_experts_float", TypeError, "num_experts", lambda c: c.nb.get_dispatch_layout(c.topk_idx, float(c.E))),
    ("combine_x_float32", TypeError, "x", lambda c: c.nb.combine(c.recv_x.float(), c.handle)),
    ("combine_topk_weights_float64", TypeError, "topk_weights",
     lambda c: c.nb.combine(c.recv_x, c.handle, topk_weights=c.dispatched[2].double())),
    ("combine_bias_float32", TypeError, "bias", lambda c: c.nb.combine(c.recv_x, c.handle, bias=c.x.float())),
    ("ll_dispatch_x_float32", TypeError, "x", lambda c: c.ll_dispatch(c.x.float())),
    ("ll_dispatch_topk_idx_int32", TypeError, "topk_idx", lambda c: c.ll_dispatch(topk_idx=c.topk_idx.int())),
    ("ll_dispatch_cumulative_stats_int64", TypeError, "cumulative_local_expert_recv_stats",
     lambda c: c.ll_dispatch(cumulative_local_expert_recv_stats=torch.zeros(c.El, dtype=torch.int64))),
    ("ll_dispatch_wait_stats_int32", TypeError, "dispatch_wait_recv_cost_stats",
     lambda c: c.ll_dispatch(dispatch_wait_recv_cost_stats=torch.zeros(c.num_ranks, dtype=torch.int32))),
    ("ll_combine_x_float32", TypeError, "x", lambda c: c.ll_combine(c.ll_x.float())),
    ("ll_combine_topk_weights_float64", TypeError, "topk_weights",
     lambda c: c.ll_combine(topk_weights=c.topk_weights.double())),
    ("ll_combine_out_float32", TypeError, "out", lambda c: c.ll_combine(out=torch.zeros(N, H))),
    ("ll_combine_wait_stats_int32", TypeError, "combine_wait_recv_cost_stats",
     lambda c: c.ll_combine(combine_wait_recv_cost_stats=torch.zeros(c.num_ranks, dtype=torch.int32))),
    ("query_mask_status_int64", TypeError, "mask_status",
     lambda c: c.shrink.low_latency_query_mask_buffer(torch.zeros(c.num_ranks, dtype=torch.int64))),
    ("config_wrong_type", TypeError, "config", lambda c: c.dispatch(config={"num_sms": 20})),
    ("previous_event_wrong_type", TypeError, "previous_event",
     lambda c: c.dispatch(previous_event=object(), async_finish=True)),
    ("buffer_num_rdma_bytes_float", TypeError, "num_rdma_bytes",
     lambda c: _new_buffer(group=c.group, num_rdma_bytes=1.5)),
    ("config_num_sms_float", TypeError, "num_sms", lambda c: _config(num_sms=20.0)),
    ("buffer_low_latency_without_rdma_bytes", ValueError, "get_low_latency_rdma_size_hint",
     lambda c: _new_buffer(group=c.group, low_latency_mode=True)),
    # ---- shapes
    ("dispatch_x_1d", ValueError, "x", lambda c: c.dispatch(c.x[0])),
    ("dispatch_x_tuple_of_three", ValueError, "x", lambda c: c.dispatch((c.x_fp8, c.scales, c.scales))),
    ("dispatch_scales_rows", ValueError, "scales", lambda c: c.dispatch((c.x_fp8, c.scales[:-1]))),
    ("dispatch_topk_idx_rows", ValueError, "topk_idx", lambda c: c.dispatch(topk_idx=c.topk_idx[:-1],
                                                                            topk_weights=c.topk_weights[:-1])),
    ("dispatch_topk_idx_3d", ValueError, "topk_idx", lambda c: c.dispatch(topk_idx=c.topk_idx.unsqueeze(0))),
    ("dispatch_topk_weights_shape", ValueError, "topk_weights",
     lambda c: c.dispatch(topk_weights=torch.ones(N, K + 1))),
    ("dispatch_is_token_in_rank_rows", ValueError, "is_token_in_rank",
     lambda c: c.dispatch(is_token_in_rank=c.layout[3][:-1])),
    ("dispatch_num_tokens_per_rank_for_more_ranks", ValueError, "num_tokens_per_rank",
     lambda c: c.dispatch(num_tokens_per_rank=torch.cat([c.layout[0], c.layout[0][:1]]))),
    ("dispatch_is_token_in_rank_for_more_ranks", ValueError, "is_token_in_rank",
     lambda c: c.dispatch(is_token_in_rank=torch.cat([c.layout[3], c.layout[3][:, :1]], dim=1))),
    ("dispatch_layout_inconsistent", ValueError, "num_tokens_per_rank",
     lambda c: c.dispatch(num_tokens_per_rank=c.layout[0] + 1)),
    ("dispatch_layout_missing", ValueError, "num_tokens_per_rank", lambda c: c.nb.dispatch(c.x)),
    ("dispatch_topk_idx_without_weights", ValueError, "topk_weights", lambda c: c.dispatch(topk_weights=None)),
    ("dispatch_cached_with_topk_idx", ValueError, "topk_idx",
     lambda c: c.nb.dispatch(c.x, handle=c.handle, topk_idx=c.topk_idx, topk_weights=c.topk_weights)),
    ("dispatch_cached_token_count", ValueError, "handle", lambda c: c.nb.dispatch(c.x[:-1], handle=c.handle)),
    ("combine_x_rows", ValueError, "x", lambda c: c.nb.combine(c.recv_x[:-1] if c.recv_x.size(0) else
                                                               torch.zeros(1, H, dtype=torch.bfloat16), c.handle)),
    ("combine_topk_weights_rows", ValueError, "topk_weights",
     lambda c: c.nb.combine(c.recv_x, c.handle, topk_weights=torch.ones(c.recv_x.size(0) + 1, K))),
    ("combine_bias_shape", ValueError, "bias", lambda c: c.nb.combine(c.recv_x, c.handle, bias=c.x[:, :128])),
    ("combine_three_biases", ValueError, "bias", lambda c: c.nb.combine(c.recv_x, c.handle, bias=(c.x, c.x, c.x))),
    ("ll_dispatch_topk_idx_rows", ValueError, "topk_idx", lambda c: c.ll_dispatch(topk_idx=c.topk_idx[:-1])),
    ("ll_dispatch_cumulative_stats_shape", ValueError, "cumulative_local_expert_recv_stats",
     lambda c: c.ll_dispatch(cumulative_local_expert_recv_stats=torch.zeros(c.El + 1, dtype=torch.int32))),
    ("ll_dispatch_wait_stats_for_more_ranks", ValueError, "dispatch_wait_recv_cost_stats",
     lambda c: c.ll_dispatch(dispatch_wait_recv_cost_stats=torch.zeros(c.num_ranks + 1, dtype=torch.int64))),
    ("ll_combine_x_shape", ValueError, "x", lambda c: c.ll_combine(c.ll_x[:, :-1])),
    ("ll_combine_topk_weights_shape", ValueError, "topk_weights",
     lambda c: c.ll_combine(topk_weights=c.topk_weights[:, :1])),
    ("ll_combine_out_shape", ValueError, "out",
     lambda c: c.ll_combine(out=torch.zeros(N + 1, H, dtype=torch.bfloat16))),
    ("ll_combine_more_tokens_than_max", ValueError, "topk_idx",
     lambda c: c.ll_combine(topk_idx=torch.zeros(T + 1, K, dtype=torch.int64), topk_weights=torch.ones(T + 1, K))),
    ("query_mask_status_for_more_ranks", ValueError, "mask_status",
     lambda c: c.shrink.low_latency_query_mask_buffer(torch.zeros(c.num_ranks + 1, dtype=torch.int32))),
    # ---- hidden sizes
    ("dispatch_bf16_row_not_16_bytes", ValueError, "hidden",
     lambda c: c.dispatch(random_bf16(generator(1), (N, 100), 0.5, 1.0))),
    ("dispatch_fp8_hidden_not_128", ValueError, "hidden",
     lambda c: c.dispatch((torch.ones(N, 192).to(FP8), torch.ones(N, 2)))),
    ("ll_dispatch_bf16_row_not_16_bytes", ValueError, "hidden",
     lambda c: c.ll_dispatch(random_bf16(generator(2), (N, 100), 0.5, 1.0), use_fp8=False)),
    ("ll_dispatch_fp8_hidden_not_128", ValueError, "hidden",
     lambda c: c.ll_dispatch(random_bf16(generator(3), (N, 192), 0.5, 1.0), use_fp8=True)),
    ("ll_dispatch_ue8m0_hidden_not_512", ValueError, "hidden",
     lambda c: c.ll_dispatch(random_bf16(generator(4), (N, 384), 0.5, 1.0), use_fp8=True, round_scale=True,
                             use_ue8m0=True)),
    ("combine_bf16_row_not_16_bytes", ValueError, "hidden",
     lambda c: c.nb.combine(torch.ones(c.recv_x.size(0), 100, dtype=torch.bfloat16), c.handle)),
    # ---- values
    ("layout_topk_idx_too_large", ValueError, "topk_idx",
     lambda c: c.nb.get_dispatch_layout(c.with_value(c.topk_idx, c.E), c.E)),
    ("layout_topk_idx_below_minus_one", ValueError, "topk_idx",
     lambda c: c.nb.get_dispatch_layout(c.with_value(c.topk_idx, -2), c.E)),
    ("layout_topk_over_32", ValueError, "topk_idx",
     lambda c: c.nb.get_dispatch_layout(torch.full((N, 33), -1, dtype=torch.int64), c.E)),
    ("layout_num_experts_zero", ValueError, "num_experts", lambda c: c.nb.get_dispatch_layout(c.topk_idx, 0)),
    ("dispatch_topk_idx_too_large", ValueError, "topk_idx",
     lambda c: c.dispatch(topk_idx=c.with_value(c.topk_idx, c.E))),
    ("dispatch_topk_idx_below_minus_one", ValueError, "topk_idx",
     lambda c: c.dispatch(topk_idx=c.with_value(c.topk_idx, -2))),
    ("dispatch_expert_alignment_zero", ValueError, "expert_alignment", lambda c: c.dispatch(expert_alignment=0)),
    ("dispatch_num_worst_tokens_negative", ValueError, "num_worst_tokens", lambda c: c.dispatch(num_worst_tokens=-1)),
    ("dispatch_num_worst_tokens_without_topk", ValueError, "num_worst_tokens",
     lambda c: c.dispatch(topk_idx=None, topk_weights=None, num_worst_tokens=64)),
    ("dispatch_allocate_on_comm_stream_alone", ValueError, "allocate_on_comm_stream",
     lambda c: c.dispatch(allocate_on_comm_stream=True)),
    ("ll_dispatch_topk_idx_too_large", ValueError, "topk_idx",
     lambda c: c.ll_dispatch(topk_idx=c.with_value(c.topk_idx, c.E))),
    ("ll_dispatch_topk_idx_below_minus_one", ValueError, "topk_idx",
     lambda c: c.ll_dispatch(topk_idx=c.with_value(c.topk_idx, -2))),
    ("ll_dispatch_more_tokens_than_max", ValueError, "num_max_dispatch_tokens_per_rank",
     lambda c: c.ll_dispatch(random_bf16(generator(5), (T + 1, H), 0.5, 1.0),
                             topk_idx=torch.zeros(T + 1, K, dtype=torch.int64))),
    ("ll_dispatch_ue8m0_without_round_scale", ValueError, "round_scale",
     lambda c: c.ll_dispatch(use_fp8=True, round_scale=False, use_ue8m0=True)),
    ("ll_dispatch_async_and_hook", ValueError, "return_recv_hook",
     lambda c: c.ll_dispatch(async_finish=True, return_recv_hook=True)),
    ("ll_combine_async_and_hook", ValueError, "return_recv_hook",
     lambda c: c.ll_combine(async_finish=True, return_recv_hook=True)),
    ("ll_combine_topk_idx_too_large", ValueError, "topk_idx",
     lambda c: c.ll_combine(topk_idx=c.with_value(c.topk_idx, c.E))),
    ("ll_combine_zero_copy_and_logfmt", ValueError, "use_logfmt",
     lambda c: c.ll_combine(zero_copy=True, use_logfmt=True)),
    ("ll_dispatch_num_rdma_bytes_too_small", ValueError, "num_rdma_bytes", lambda c: c.ll_dispatch(buffer=c.small)),
    ("ll_clean_num_rdma_bytes_too_small", ValueError, "num_rdma_bytes",
     lambda c: c.small.clean_low_latency_buffer(T, H, c.E)),
    ("mask_rank_out_of_range", ValueError, "rank_to_mask",
     lambda c: c.shrink.low_latency_update_mask_buffer(c.num_ranks, True)),
    ("buffer_num_nvl_bytes_negative", ValueError, "num_nvl_bytes",
     lambda c: _new_buffer(group=c.group, num_nvl_bytes=-1)),
    ("buffer_without_group_or_comm", ValueError, "group", lambda c: _new_buffer(group=None)),
    ("buffer_num_qps_per_rank_zero", ValueError, "num_qps_per_rank",
     lambda c: _new_buffer(group=c.group, num_qps_per_rank=0)),
    ("set_num_sms_odd", ValueError, "new_num_sms", lambda c: _set_num_sms(3)),
    ("config_num_sms_odd", ValueError, "num_sms", lambda c: _config(num_sms=3)),
    ("ll_size_hint_zero_tokens", ValueError, "num_max_dispatch_tokens_per_rank", lambda c: _ll_hint(0, H, 2, 8)),
    ("local_buffer_offset_misaligned", ValueError, "offset",
     lambda c: c.lb.get_local_buffer_tensor(torch.int32, offset=2, use_rdma_buffer=True)),
    # ---- handles from another Buffer or for another group size
    ("dispatch_handle_from_other_buffer", ValueError, "handle", lambda c: c.nb.dispatch(c.x, handle=c.handle2)),
    ("combine_handle_from_other_buffer", ValueError, "handle", lambda c: c.nb.combine(c.recv_x, c.handle2)),
    ("ll_combine_handle_from_other_buffer", ValueError, "handle", lambda c: c.ll_combine(handle=c.ll2[2])),
    ("ll_next_buffer_handle_from_other_buffer", ValueError, "handle",
     lambda c: c.lb.get_next_low_latency_combine_buffer(c.ll2[2])),
    ("dispatch_handle_for_more_ranks", ValueError, "handle",
     lambda c: c.nb.dispatch(c.x, handle=c.handle_for_other_rank_count())),
    ("combine_handle_for_more_ranks", ValueError, "handle",
     lambda c: c.nb.combine(c.recv_x, c.handle_for_other_rank_count())),
    ("combine_handle_wrong_length", ValueError, "handle", lambda c: c.nb.combine(c.recv_x, tuple(c.handle)[:5])),
    ("ll_combine_handle_wrong_length", ValueError, "handle", lambda c: c.ll_combine(handle=tuple(c.ll[2])[:4])),
    # ---- state
    ("ll_dispatch_on_normal_buffer", RuntimeError, "low_latency_mode",
     lambda c: c.ll_dispatch(buffer=c.normal_with_rdma)),
    ("ll_combine_on_normal_buffer", RuntimeError, "low_latency_mode",
     lambda c: c.ll_combine(buffer=c.normal_with_rdma)),
    ("ll_next_buffer_on_normal_buffer", RuntimeError, "low_latency_mode",
     lambda c: c.normal_with_rdma.get_next_low_latency_combine_buffer(c.ll[2])),
    ("mask_update_without_enable_shrink", RuntimeError, "enable_shrink",
     lambda c: c.lb.low_latency_update_mask_buffer(0, True)),
    ("destroy_without_explicitly_destroy", RuntimeError, "explicitly_destroy", lambda c: c.nb.destroy()),
    ("dispatch_after_destroy", RuntimeError, "destroy", lambda c: c.destroyed().dispatch(c.x, **c.layout_kwargs())),
    ("layout_after_destroy", RuntimeError, "destroy", lambda c: c.destroyed().get_dispatch_layout(c.topk_idx, c.E)),
    ("combine_after_destroy", RuntimeError, "destroy", lambda c: c.destroyed().combine(c.recv_x, c.handle)),
    ("ll_dispatch_after_destroy", RuntimeError, "destroy", lambda c: c.ll_dispatch(buffer=c.destroyed(True))),
    ("local_buffer_after_destroy", RuntimeError, "destroy",
     lambda c: c.destroyed(True).get_local_buffer_tensor(torch.uint8, use_rdma_buffer=True)),
]

# Cases whose call is itself a collective when it does not raise: they only run where every rank makes them.
SYMMETRIC_ONLY = [
    ("ll_clean_on_normal_buffer", RuntimeError, "low_latency_mode",
     lambda c: c.normal_with_rdma.clean_low_latency_buffer(T, H, c.E)),
]

# Cases that need more than one rank.
MULTI_RANK_CASES = [
    ("layout_num_experts_not_divisible", ValueError, "num_experts",
     lambda c: c.nb.get_dispatch_layout(torch.zeros(N, K, dtype=torch.int64), c.num_ranks * 2 + 1)),
    ("dispatch_num_tokens_per_expert_not_divisible", ValueError, "num_tokens_per_expert",
     lambda c: c.dispatch(topk_idx=None, topk_weights=None,
                          num_tokens_per_expert=torch.zeros(c.E + 1, dtype=torch.int32))),
    ("ll_dispatch_num_experts_not_divisible", ValueError, "num_experts",
     lambda c: c.ll_dispatch(topk_idx=torch.zeros(N, K, dtype=torch.int64), num_experts=c.E + 1)),
    ("ll_clean_num_experts_not_divisible", ValueError, "num_experts",
     lambda c: c.lb.clean_low_latency_buffer(T, H, c.E + 1)),
    ("dispatch_num_tokens_per_rank_for_fewer_ranks", ValueError, "num_tokens_per_rank",
     lambda c: c.dispatch(num_tokens_per_rank=c.layout[0][:-1])),
    ("dispatch_is_token_in_rank_for_fewer_ranks", ValueError, "is_token_in_rank",
     lambda c: c.dispatch(is_token_in_rank=c.layout[3][:, :-1])),
    ("ll_dispatch_wait_stats_for_fewer_ranks", ValueError, "dispatch_wait_recv_cost_stats",
     lambda c: c.ll_dispatch(dispatch_wait_recv_cost_stats=torch.zeros(c.num_ranks - 1, dtype=torch.int64))),
    ("dispatch_handle_from_single_rank_group", ValueError, "handle",
     lambda c: c.nb.dispatch(c.x, handle=tuple(c.single_rank_handle))),
    ("combine_handle_from_single_rank_group", ValueError, "handle",
     lambda c: c.nb.combine(c.recv_x, tuple(c.single_rank_handle))),
    ("combine_tagged_handle_from_single_rank_group", ValueError, "handle",
     lambda c: c.nb.combine(c.recv_x, c.single_rank_handle)),
]


# Buffers whose settings differ between the ranks: (what the error names, Buffer arguments, UCCL_EP_ENGINE).
def _differing_buffers(rank: int, ll_size: int):
    return (("num_nvl_bytes", {"num_nvl_bytes": (rank + 1) << 20}, "auto"),
            ("num_rdma_bytes", {"num_rdma_bytes": ll_size + 128 * rank}, "auto"),
            ("low_latency_mode", {"num_rdma_bytes": ll_size, "low_latency_mode": rank == 0}, "auto"),
            ("the engine", {}, "native" if rank == 1 else "auto"))


def _run_case(rec, ctx, name, exception, match, call):
    with rec.section(name):
        with rec.raises(exception, match, name):
            call(ctx)


def _single_rank_body(rank, num_ranks, group, rec):
    ctx = Context(rank, num_ranks, group)
    for case in CASES + SYMMETRIC_ONLY:
        _run_case(rec, ctx, *case)


def _two_rank_body(rank, num_ranks, group, rec):
    from uccl_ep_plugin import Buffer
    os.environ["UCCL_EP_TIMEOUT_SECONDS"] = "10"
    ctx = Context(rank, num_ranks, group)
    # A one-rank group per rank (every rank creates every group), and a handle made on it.
    own_group = [dist.new_group([r]) for r in range(num_ranks)][rank]
    single = Buffer(own_group)
    layout = single.get_dispatch_layout(ctx.topk_idx, ctx.E)
    ctx.single_rank_handle = single.dispatch(ctx.x, num_tokens_per_rank=layout[0], is_token_in_rank=layout[3],
                                             num_tokens_per_expert=layout[2])[4]
    for case in MULTI_RANK_CASES:
        _run_case(rec, ctx, *case)

    for setting, per_rank, engine in _differing_buffers(rank, ctx.ll_size):
        with rec.section(f"buffer_{setting.split()[-1]}_differs"):
            # A collective: every rank must raise, naming the setting, rather than corrupt or wait.
            with environment("UCCL_EP_ENGINE", engine), rec.raises(ValueError, setting,
                                                                   f"rank {rank}: Buffer with {per_rank}, {engine}"):
                Buffer(group, **per_rank)

    with rec.section("raises_before_communication"):
        # Rank 0 alone makes every bad call; then both ranks run valid collectives and check them.
        if rank == 0:
            for name, exception, match, call in CASES + MULTI_RANK_CASES:
                with rec.raises(exception, match, f"rank 0 alone: {name}"):
                    call(ctx)
        again = ctx.dispatch()
        rec.equal(again[0], ctx.recv_x, "a valid dispatch after the bad calls")
        rec.equal(again[4][3], ctx.handle[3], "recv_src_idx of a valid dispatch after the bad calls")
        ll = ctx.ll_dispatch(use_fp8=False)
        rec.equal(ll[1], ctx.ll[1], "a valid low-latency dispatch after the bad calls")
        combined = ctx.nb.combine(ctx.recv_x, ctx.handle)[0]
        count = ctx.layout[3].sum(1, keepdim=True).float()
        rec.close(combined, ctx.x.float() * count, "a valid combine after the bad calls", 2.0 ** -6, 0.0)


_SINGLE = SectionCache(_single_rank_body)
_TWO = SectionCache(_two_rank_body)


@pytest.mark.parametrize("case", [c[0] for c in CASES + SYMMETRIC_ONLY])
def test_single_rank_validation(case):
    assert_section(_SINGLE.get(1), case)


@pytest.mark.parametrize("case", [c[0] for c in MULTI_RANK_CASES] + ["raises_before_communication"] +
                         [f"buffer_{s[0].split()[-1]}_differs" for s in _differing_buffers(0, 0)])
def test_two_rank_validation(case):
    assert_section(_TWO.get(2), case)


def test_case_names_are_unique():
    names = [c[0] for c in CASES + SYMMETRIC_ONLY + MULTI_RANK_CASES]
    assert len(names) == len(set(names))
