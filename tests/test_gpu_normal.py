"""The native normal-mode engine (dispatch/combine over CUDA-IPC-mapped NVLink buffers) against the
reference engine on 2 GPUs, or on UCCL_EP_TEST_RANKS GPUs (4 or 8 on a larger machine; each case's
per-rank token counts repeat): every output element, padding included, must be equal bit for bit.

Each case draws fresh random inputs (never all zero) and fills the caching allocator with a poison
pattern first, so an output row the native kernels forget to write cannot pass by being zero.
"""

import os
import re
import time
from dataclasses import dataclass
from typing import Optional, Tuple

import pytest
import torch
import torch.distributed as dist

from tests.multiprocess import environment, needs_feature, needs_gpus, rank_device, run_ranks
from uccl_ep_plugin.platform_config.loader import AUTO_ATOMIC_KEY as AGGRESSIVE_ATOMIC_KEY

FEATURE = "normal_nvlink"
TIMEOUT_ENV = "UCCL_EP_TIMEOUT_SECONDS"
ENGINE_ENV = "UCCL_EP_ENGINE"
COPY_ENV = "UCCL_EP_NORMAL_COPY"
COMBINE_CHUNKS_ENV = "UCCL_EP_NORMAL_COMBINE_CHUNKS"
PULL_CHUNKS_ENV = "UCCL_EP_NORMAL_PULL_CHUNKS"
SM_PULL_ENV = "UCCL_EP_NORMAL_SM_PULL_PERCENT"
SM_PUSH_ENV = "UCCL_EP_NORMAL_SM_PUSH_PERCENT"
OWN_ROWS_ENV = "UCCL_EP_NORMAL_OWN_ROWS"
DISPATCH_ROWS_ENV = "UCCL_EP_NORMAL_DISPATCH_ROWS"
LAUNCH_THREAD_ENV = "UCCL_EP_NORMAL_LAUNCH_THREAD"
HOST_COUNTS = "_uccl_ep_host_counts"   # where the native engine keeps the counts the copy engines need
NATIVE_NVL_BYTES = 1 << 30
MISSING_PEER_TIMEOUT_S = 3.0
RANKS = int(os.environ.get("UCCL_EP_TEST_RANKS", "2"))


pytestmark = [pytest.mark.gpu, needs_gpus(RANKS), needs_feature(FEATURE)]


@dataclass(frozen=True)
class Case:
    name: str
    hidden: int
    num_topk: int
    num_experts: int
    tokens: Tuple[int, ...]       # tokens of ranks 0, 1, ..., repeated over the ranks
    fp8: bool = False
    expert_alignment: int = 1
    num_biases: int = 0
    combine_weights: bool = True
    num_sms: int = 20
    combine_sms: Tuple[int, ...] = ()   # each rank's combine SMs, repeated over the ranks; () = num_sms

    def num_tokens(self, rank: int) -> int:
        return self.tokens[rank % len(self.tokens)]

    def combine_num_sms(self, rank: int) -> int:
        return self.combine_sms[rank % len(self.combine_sms)] if self.combine_sms else self.num_sms

    def worst_tokens(self) -> int:
        """A num_worst_tokens no rank's receive exceeds: every rank sends it every token."""
        return RANKS * max(self.tokens)


CASES = (
    Case("bf16_h2048_k1_e8", 2048, 1, 8, (128, 100)),
    Case("bf16_h4096_k2_e64_one_token", 4096, 2, 64, (300, 1), num_biases=1),
    # 16 SMs: auto has a copy engine copy rank 0's own rows (59 MB), the SMs rank 1's.
    Case("bf16_h7168_k8_e256_large", 7168, 8, 256, (4096 + 17, 513), num_biases=2, num_sms=16),
    Case("fp8_h7168_k9_e288_empty_rank", 7168, 9, 288, (777, 0), fp8=True, combine_weights=False),
    Case("fp8_h2048_k8_e64_align16", 2048, 8, 64, (1, 64), fp8=True, expert_alignment=16, num_sms=8),
    Case("bf16_h4096_k9_e288_align16", 4096, 9, 288, (0, 200), expert_alignment=16, num_biases=2),
    # Each rank combines with its own SMs, so with its own chunk count (12 at 8 SMs, 6 at 24).
    Case("bf16_h4096_k8_e64_combine_sms_differ", 4096, 8, 64, (2000, 1500), combine_sms=(8, 24)),
    # No tokens anywhere, after dispatches that left a recv_x ready: no rank receives a row.
    Case("bf16_h2048_k2_e16_no_tokens", 2048, 2, 16, (0,)),
)


def _make_buffer(group, engine: str, num_nvl_bytes: int, copy_mode: str = "engine"):
    import uccl_ep_plugin as ep
    with environment(ENGINE_ENV, engine), environment(COPY_ENV, copy_mode):
        buffer = ep.Buffer(group, num_nvl_bytes=num_nvl_bytes, explicitly_destroy=True)
    if engine == "native":
        for operation in ("dispatch", "combine"):
            assert buffer.engine_by_operation[operation] == "native", buffer.engine_by_operation
            assert operation not in buffer.engine_reasons, buffer.engine_reasons
    return buffer


def _poison_allocator(device: torch.device) -> None:
    """Later torch.empty calls reuse these bytes, so unwritten outputs hold 0xA5 patterns, not zeros."""
    junk = torch.empty(512 << 20, dtype=torch.uint8, device=device)
    junk.fill_(0xA5)
    del junk


def _inputs(case: Case, rank: int, seed: int, device: torch.device):
    gen = torch.Generator().manual_seed(seed * 1000003 + rank)
    n = case.num_tokens(rank)
    x = torch.randn((n, case.hidden), generator=gen) + 0.25
    scores = torch.rand((n, case.num_experts), generator=gen)
    topk_idx = torch.topk(scores, case.num_topk, dim=1).indices
    topk_idx[torch.rand((n, case.num_topk), generator=gen) < 0.15] = -1
    topk_weights = torch.rand((n, case.num_topk), generator=gen) + 0.1
    if case.fp8:
        data = x.clamp(-400, 400).to(torch.float8_e4m3fn)
        scales = torch.rand((n, case.hidden // 128), generator=gen) + 0.5
        x_in = (data.to(device), scales.to(device))
    else:
        x_in = x.to(torch.bfloat16).to(device)
    return x_in, topk_idx.to(device), topk_weights.to(device), gen


def _bits(tensor: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """The raw bytes, so fp8/bf16 compare exactly (and NaN payloads too)."""
    if tensor is None:
        return None
    return tensor.contiguous().view(torch.uint8).cpu()


def _assert_equal(got, expected, what: str) -> None:
    if expected is None or got is None:
        assert got is None and expected is None, f"{what}: one engine returned None"
        return
    if isinstance(expected, (tuple, list)) and not isinstance(expected, torch.Tensor):
        assert len(got) == len(expected), f"{what}: lengths differ"
        for i, (g, e) in enumerate(zip(got, expected)):
            _assert_equal(g, e, f"{what}[{i}]")
        return
    assert got.dtype == expected.dtype, f"{what}: dtype {got.dtype} != {expected.dtype}"
    assert tuple(got.shape) == tuple(expected.shape), f"{what}: shape {tuple(got.shape)} != {tuple(expected.shape)}"
    g, e = _bits(got), _bits(expected)
    if not torch.equal(g, e):
        diff = (g != e).nonzero()
        raise AssertionError(f"{what}: {diff.size(0)} bytes differ, first at {diff[0].tolist()}")


def _dispatch(buffer, x, layout, topk_idx, topk_weights, case: Case, num_worst_tokens: int = 0):
    import uccl_ep_plugin as ep
    per_rank, _, per_expert, in_rank = layout
    return buffer.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                           num_tokens_per_expert=per_expert, topk_idx=topk_idx, topk_weights=topk_weights,
                           expert_alignment=case.expert_alignment, num_worst_tokens=num_worst_tokens,
                           config=ep.Config(num_sms=case.num_sms))


def _combine(buffer, x, handle, topk_weights, biases, case: Case, rank: int):
    import uccl_ep_plugin as ep
    bias = None if not biases else (biases[0] if len(biases) == 1 else tuple(biases))
    return buffer.combine(x, handle, topk_weights=topk_weights, bias=bias,
                          config=ep.Config(num_sms=case.combine_num_sms(rank)))


def _run_case(native, reference, case: Case, rank: int, seed: int, device: torch.device,
              num_worst_tokens: int = 0, copy_mode: str = "engine") -> None:
    import uccl_ep_plugin as ep
    tag = f"{case.name} (seed {seed}, worst {num_worst_tokens}, {copy_mode} copies)"
    x, topk_idx, topk_weights, gen = _inputs(case, rank, seed, device)
    layout = reference.get_dispatch_layout(topk_idx, case.num_experts)[:4]

    copy_engine = native._native.normal.copy_engine
    results = {}
    for name, buffer in (("reference", reference), ("native", native)):
        _poison_allocator(device)
        own_by_engine = copy_engine.own_rows_by_engine()
        results[name] = _dispatch(buffer, x, layout, topk_idx, topk_weights, case, num_worst_tokens)
        buffer.synchronize()   # also raises a failure the kernels recorded, which names the cause of wrong outputs
    fresh_own_by_engine = copy_engine.own_rows_by_engine() - own_by_engine
    got, want = results["native"], results["reference"]
    for index, what in enumerate(("recv_x", "recv_topk_idx", "recv_topk_weights")):
        _assert_equal(got[index], want[index], f"{tag}: {what}")
    assert got[3] == want[3], f"{tag}: num_recv_tokens_per_expert_list {got[3]} != {want[3]}"
    _assert_equal(tuple(got[4]), tuple(want[4]), f"{tag}: handle")
    # The copy engines serve exactly the dispatches whose counts reached the host (and their combines), where the
    # copy mode has them do so (auto: by the ranks and the SMs).
    from uccl_ep_plugin import _C
    by_copy_engine = hasattr(got[4][0], HOST_COUNTS)
    expected = num_worst_tokens == 0 and _C.normal_dispatch_by_copy_engine(
        _C.NormalRowPath.__members__[copy_mode], dist.get_world_size(), case.num_sms)
    assert by_copy_engine == expected, f"{tag}: copy engines {by_copy_engine}"

    # Cached dispatch: the handle reused, only x moves (fresh values). Where the copy engines carry it, its own
    # rows go the way its fresh dispatch's did (the handle keeps which tokens the rank keeps).
    x2 = _inputs(case, rank, seed + 500, device)[0]
    cached = {}
    for name, buffer, handle in (("reference", reference, want[4]), ("native", native, got[4])):
        _poison_allocator(device)
        own_by_engine = copy_engine.own_rows_by_engine()
        cached[name] = buffer.dispatch(x2, handle=handle, config=ep.Config(num_sms=case.num_sms))
        buffer.synchronize()
    _assert_equal(cached["native"][0], cached["reference"][0], f"{tag}: cached recv_x")
    cached_by_copy_engine = by_copy_engine and _C.normal_cached_dispatch_by_copy_engine(
        _C.NormalRowPath.__members__[copy_mode], dist.get_world_size(), case.num_sms)
    cached_own_by_engine = copy_engine.own_rows_by_engine() - own_by_engine
    assert cached_own_by_engine == (fresh_own_by_engine if cached_by_copy_engine else 0), \
        f"{tag}: own rows by copy engine in {cached_own_by_engine} cached, {fresh_own_by_engine} fresh dispatches"

    # Combine fresh expert outputs, with and without weights, with the case's biases.
    rows = want[0][0].size(0) if case.fp8 else want[0].size(0)
    expert_out = (torch.randn((rows, case.hidden), generator=gen) + 0.5).to(torch.bfloat16).to(device)
    weights = (torch.rand((rows, case.num_topk), generator=gen) + 0.1).to(device)
    biases = [(torch.randn((case.num_tokens(rank), case.hidden), generator=gen)).to(torch.bfloat16).to(device)
              for _ in range(case.num_biases)]
    for use_weights in ((True, False) if case.combine_weights else (False,)):
        combined = {}
        for name, buffer, handle in (("reference", reference, want[4]), ("native", native, got[4])):
            _poison_allocator(device)
            combined[name] = _combine(buffer, expert_out, handle, weights if use_weights else None, biases, case,
                                      rank)
            buffer.synchronize()
        _assert_equal(combined["native"][:2], combined["reference"][:2],
                      f"{tag}: combine ({'with' if use_weights else 'without'} topk_weights)")


def _compare_body(rank: int, num_ranks: int, group, copy_mode: str, combine_chunks: str, pull_chunks: str,
                  sm_pull: str, sm_push: str, own_rows: str, dispatch_rows: str) -> None:
    device = rank_device(rank)
    torch.cuda.set_device(device)
    with environment(COMBINE_CHUNKS_ENV, combine_chunks), environment(PULL_CHUNKS_ENV, pull_chunks), \
            environment(SM_PULL_ENV, sm_pull), environment(SM_PUSH_ENV, sm_push), \
            environment(OWN_ROWS_ENV, own_rows), environment(DISPATCH_ROWS_ENV, dispatch_rows):
        native = _make_buffer(group, "native", NATIVE_NVL_BYTES, copy_mode)
    reference = _make_buffer(group, "reference", 0)
    engine = native._native.normal
    try:
        for seed, case in enumerate(CASES):
            _run_case(native, reference, case, rank, seed, device, copy_mode=copy_mode)
        # num_worst_tokens: outputs padded to that many rows, no count list.
        for seed, case in enumerate(CASES[:2], start=100):
            _run_case(native, reference, case, rank, seed, device, num_worst_tokens=case.worst_tokens() + 5,
                      copy_mode=copy_mode)
        # Pushed where a rank keeps out few tokens (the cases with many experts per rank), pulled elsewhere.
        pushed = engine.copy_engine.blocks_pushed()
        assert (pushed > 0) == (dispatch_rows == "push"), f"{pushed} blocks pushed with {DISPATCH_ROWS_ENV}={dispatch_rows!r}"
    finally:
        native.destroy()
        reference.destroy()


def _rows_for_combine(recv_x):
    """What an expert hands back: the received rows as bf16 (fp8 rows dequantized with their scales)."""
    if isinstance(recv_x, tuple):
        data, scales = recv_x
        return (data.float() * scales.repeat_interleave(128, dim=1)).to(torch.bfloat16)
    return recv_x


def _graph_body(rank: int, num_ranks: int, group, fp8: bool) -> None:
    """dispatch + combine with num_worst_tokens captured in a CUDA graph, replayed on new x (bf16, or fp8 with its
    scales): equal to the same calls run eagerly, and to the reference engine."""
    device = rank_device(rank)
    torch.cuda.set_device(device)
    case = Case(f"graph_{'fp8' if fp8 else 'bf16'}_h4096_k8_e64", 4096, 8, 64, (257, 190), fp8=fp8)
    worst = case.worst_tokens()
    native = _make_buffer(group, "native", NATIVE_NVL_BYTES)
    reference = _make_buffer(group, "reference", 0)
    try:
        x, topk_idx, topk_weights, _ = _inputs(case, rank, 7, device)
        layout = native.get_dispatch_layout(topk_idx, case.num_experts)[:4]
        static_x = tuple(t.clone() for t in x) if fp8 else x.clone()

        def step():
            recv_x, recv_idx, recv_weights, _, handle, _ = _dispatch(native, static_x, layout, topk_idx,
                                                                     topk_weights, case, worst)
            combined_x, combined_weights, _ = _combine(native, _rows_for_combine(recv_x), handle, recv_weights, [],
                                                       case, rank)
            return recv_x, recv_idx, recv_weights, tuple(handle), combined_x, combined_weights

        step()   # warm up outside the capture (allocator, lazy init)
        torch.cuda.synchronize(device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = step()
        torch.cuda.synchronize(device)
        for replay in range(3):
            fresh = _inputs(case, rank, 100 + replay, device)[0]   # new rows (and scales), same routing
            for target, source in zip(static_x if fp8 else (static_x,), fresh if fp8 else (fresh,)):
                target.copy_(source)
            graph.replay()
            torch.cuda.synchronize(device)
            eager = step()
            torch.cuda.synchronize(device)
            _assert_equal(captured, eager, f"graph replay {replay} vs eager")
            want = _dispatch(reference, static_x, layout, topk_idx, topk_weights, case, worst)
            want_combined = _combine(reference, _rows_for_combine(want[0]), want[4], want[2], [], case, rank)
            torch.cuda.synchronize(device)
            _assert_equal(captured[:3], want[:3], f"graph replay {replay} dispatch vs reference")
            _assert_equal(captured[3], tuple(want[4]), f"graph replay {replay} handle vs reference")
            _assert_equal(captured[4:], want_combined[:2], f"graph replay {replay} combine vs reference")
        del graph
    finally:
        native.destroy()
        reference.destroy()


def _plain_calls(native, reference, rank: int, device: torch.device) -> None:
    """Without any stream flag a call sees every op queued before it on the caller's stream (fp8 scales given
    column-major, as DeepGEMM makes them, so the call copies them first), and the caller's next op sees its
    outputs."""
    case = Case("plain_fp8_h2048_k8_e64", 2048, 8, 64, (500, 333), fp8=True)
    (data, scales), topk_idx, topk_weights, gen = _inputs(case, rank, 12, device)
    layout = reference.get_dispatch_layout(topk_idx, case.num_experts)[:4]
    want = _dispatch(reference, (data, scales), layout, topk_idx, topk_weights, case)
    torch.cuda.synchronize(device)
    column_major = torch.full((scales.size(1), scales.size(0)), float("nan"), device=device).t()
    torch.cuda._sleep(50_000_000)
    column_major.copy_(scales)
    got = _dispatch(native, (data, column_major), layout, topk_idx, topk_weights, case)
    received = tuple(tensor.clone() for tensor in got[0])   # on the caller's stream, right after the call
    _assert_equal(received, want[0], "plain call: recv_x and its scales")

    rows = want[0][0].size(0)
    expert_out = (torch.randn((rows, case.hidden), generator=gen) + 0.5).to(torch.bfloat16).to(device)
    want_combined = reference.combine(expert_out, want[4], topk_weights=want[2])
    torch.cuda.synchronize(device)
    staged = torch.full_like(expert_out, float("nan"))
    torch.cuda._sleep(50_000_000)
    staged.copy_(expert_out)
    combined = native.combine(staged, got[4], topk_weights=got[2])
    _assert_equal((combined[0].clone(), combined[1].clone()), want_combined[:2], "plain call: combine")


def _streams_body(rank: int, num_ranks: int, group) -> None:
    """DeepEP's stream semantics: with previous_event the communication stream waits for that event (x is
    written behind a long sleep on the compute stream, after a poisoned fill), with async_finish the call
    returns an event the caller waits on, with allocate_on_comm_stream the outputs come from that stream; then
    plain calls (_plain_calls)."""
    device = rank_device(rank)
    torch.cuda.set_device(device)
    case = Case("streams_bf16_h4096_k8_e64", 4096, 8, 64, (300, 211), num_biases=1)
    native = _make_buffer(group, "native", NATIVE_NVL_BYTES)
    reference = _make_buffer(group, "reference", 0)
    try:
        x_values, topk_idx, topk_weights, gen = _inputs(case, rank, 11, device)
        layout = reference.get_dispatch_layout(topk_idx, case.num_experts)[:4]
        per_rank, _, per_expert, in_rank = layout
        want = _dispatch(reference, x_values, layout, topk_idx, topk_weights, case)
        torch.cuda.synchronize(device)

        x = torch.full_like(x_values, float("nan"))
        torch.cuda._sleep(50_000_000)   # tens of ms on the compute stream before x holds its values
        x.copy_(x_values)
        got = native.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                              num_tokens_per_expert=per_expert, topk_idx=topk_idx, topk_weights=topk_weights,
                              previous_event=native.capture(), async_finish=True, allocate_on_comm_stream=True)
        assert got[5].event is not None, "async_finish=True returned no event"
        got[5].current_stream_wait()
        for index, what in enumerate(("recv_x", "recv_topk_idx", "recv_topk_weights")):
            _assert_equal(got[index], want[index], f"streams: {what}")

        rows = want[0].size(0)
        expert_out = (torch.randn((rows, case.hidden), generator=gen) + 0.5).to(torch.bfloat16).to(device)
        bias = torch.randn((case.num_tokens(rank), case.hidden), generator=gen).to(torch.bfloat16).to(device)
        want_combined = reference.combine(expert_out, want[4], topk_weights=want[2], bias=bias)
        torch.cuda.synchronize(device)
        staged = torch.full_like(expert_out, float("nan"))
        torch.cuda._sleep(50_000_000)
        staged.copy_(expert_out)
        combined = native.combine(staged, got[4], topk_weights=got[2], bias=bias, previous_event=native.capture(),
                                  async_finish=True, allocate_on_comm_stream=True)
        combined[2].current_stream_wait()
        _assert_equal(combined[:2], want_combined[:2], "streams: combine")
        _plain_calls(native, reference, rank, device)
    finally:
        torch.cuda.synchronize(device)
        native.destroy()
        reference.destroy()


def _back_to_back_body(rank: int, num_ranks: int, group, launch_thread: str) -> None:
    """Calls queued back to back with no host sync (the launcher's thread still queuing the last one's copies
    when the next call comes), each call's outputs cloned on the caller's stream right after it: every clone
    equals the reference engine's result. Then the Buffer is destroyed with the last calls' work in flight."""
    import uccl_ep_plugin as ep
    device = rank_device(rank)
    torch.cuda.set_device(device)
    # 8 SMs: at 4 ranks and more auto dispatches by sends there, the SM path with 20.
    cases = (Case("b2b_bf16_h4096_k8_e64", 4096, 8, 64, (1500, 900)),
             Case("b2b_fp8_h7168_k8_e256", 7168, 8, 256, (700, 1100), fp8=True),
             Case("b2b_bf16_h7168_k8_e256_8sms", 7168, 8, 256, (1200, 1300), num_sms=8))
    with environment(LAUNCH_THREAD_ENV, launch_thread):
        native = _make_buffer(group, "native", NATIVE_NVL_BYTES)
    reference = _make_buffer(group, "reference", 0)
    steps = []
    for seed in range(6):
        case = cases[seed % len(cases)]
        x, topk_idx, topk_weights, gen = _inputs(case, rank, 300 + seed, device)
        x2 = _inputs(case, rank, 400 + seed, device)[0]
        layout = reference.get_dispatch_layout(topk_idx, case.num_experts)[:4]
        want = _dispatch(reference, x, layout, topk_idx, topk_weights, case)
        rows = want[0][0].size(0) if case.fp8 else want[0].size(0)
        expert_out = (torch.randn((rows, case.hidden), generator=gen) + 0.5).to(torch.bfloat16).to(device)
        want_cached = reference.dispatch(x2, handle=want[4], config=ep.Config(num_sms=case.num_sms))[0]
        want_combined = _combine(reference, expert_out, want[4], want[2], [], case, rank)[:2]
        steps.append((case, x, x2, topk_idx, topk_weights, layout, expert_out, want[:3], want_cached, want_combined))
    torch.cuda.synchronize(device)
    dist.barrier(group)
    clones = []
    try:
        _poison_allocator(device)
        for case, x, x2, topk_idx, topk_weights, layout, expert_out, *_ in steps:
            got = _dispatch(native, x, layout, topk_idx, topk_weights, case)
            received = [t.clone() if isinstance(t, torch.Tensor) else tuple(u.clone() for u in t) for t in got[:3]]
            cached = native.dispatch(x2, handle=got[4], config=ep.Config(num_sms=case.num_sms))[0]
            cached = cached.clone() if isinstance(cached, torch.Tensor) else tuple(u.clone() for u in cached)
            combined = _combine(native, expert_out, got[4], got[2], [], case, rank)
            clones.append((received, cached, (combined[0].clone(), combined[1].clone())))
        torch.cuda.synchronize(device)
        for step, ((*_, want, want_cached, want_combined), (received, cached, combined)) in enumerate(
                zip(steps, clones)):
            _assert_equal(received, want, f"back to back {step}: dispatch")
            _assert_equal(cached, want_cached, f"back to back {step}: cached dispatch")
            _assert_equal(combined, want_combined, f"back to back {step}: combine")
        # Work still in flight: destroy() waits for the launch thread, then frees.
        for case, x, _, topk_idx, topk_weights, layout, expert_out, *_ in steps[:2]:
            got = _dispatch(native, x, layout, topk_idx, topk_weights, case)
            _combine(native, expert_out, got[4], got[2], [], case, rank)
    finally:
        native.destroy()
        reference.destroy()
    torch.cuda.synchronize(device)


def _failed_allocation_body(rank: int, num_ranks: int, group, copy_mode: str) -> None:
    """Rank 0 runs out of device memory for its outputs once its dispatch read the counts (torch's allocator is
    capped just above what it holds: the handle's small block still fits, the rows' do not): its dispatch raises,
    but it still ends the exchange, so the other ranks' dispatch completes and is right; then a fresh dispatch and
    combine on every rank match the reference."""
    device = rank_device(rank)
    torch.cuda.set_device(device)
    # Rows of tens of MB: no block the allocator keeps cached can hold them under the cap.
    case = Case("failed_allocation_bf16_h7168_k4_e16", 7168, 4, 16, (3000, 2500))
    with environment(TIMEOUT_ENV, "20"):   # a broken exchange fails fast instead of hanging the peers
        native = _make_buffer(group, "native", NATIVE_NVL_BYTES, copy_mode)
    reference = _make_buffer(group, "reference", 0)
    try:
        x, topk_idx, topk_weights, _ = _inputs(case, rank, 23, device)
        layout = reference.get_dispatch_layout(topk_idx, case.num_experts)[:4]
        want = _dispatch(reference, x, layout, topk_idx, topk_weights, case)
        torch.cuda.synchronize(device)
        if rank == 0:
            torch.cuda.empty_cache()
            total = torch.cuda.get_device_properties(device).total_memory
            torch.cuda.set_per_process_memory_fraction((torch.cuda.memory_reserved(device) + (3 << 20)) / total, device)
            try:
                with pytest.raises(RuntimeError, match="could not allocate an output tensor"):
                    _dispatch(native, x, layout, topk_idx, topk_weights, case)
            finally:
                torch.cuda.set_per_process_memory_fraction(1.0, device)
        else:
            got = _dispatch(native, x, layout, topk_idx, topk_weights, case)
            for index, what in enumerate(("recv_x", "recv_topk_idx", "recv_topk_weights")):
                _assert_equal(got[index], want[index], f"peer of the failed allocation: {what}")
        torch.cuda.synchronize(device)
        _run_case(native, reference, case, rank, 29, device, copy_mode=copy_mode)
    finally:
        torch.cuda.synchronize(device)
        native.destroy()
        reference.destroy()


def _short_timeout_setup(rank: int, group, copy_mode: str = "engine"):
    """(device, a gloo group to meet on after a failure, a native Buffer with MISSING_PEER_TIMEOUT_S)."""
    device = rank_device(rank)
    torch.cuda.set_device(device)
    side = dist.new_group(backend="gloo")
    with environment(TIMEOUT_ENV, str(MISSING_PEER_TIMEOUT_S)):
        native = _make_buffer(group, "native", 64 << 20, copy_mode)
    return device, side, native


def _missing_peer_body(rank: int, num_ranks: int, group) -> None:
    """Only rank 0 calls dispatch: it raises CommTimeoutError naming itself, the phase and a missing rank."""
    from uccl_ep_plugin import CommTimeoutError
    device, side, native = _short_timeout_setup(rank, group)
    case = Case("timeout_bf16_h2048_k2_e8", 2048, 2, 8, (64, 64))
    failure = None
    if rank == 0:
        x, topk_idx, topk_weights, _ = _inputs(case, rank, 3, device)
        layout = native.get_dispatch_layout(topk_idx, case.num_experts)[:4]
        start = time.monotonic()
        try:
            _dispatch(native, x, layout, topk_idx, topk_weights, case)
            torch.cuda.synchronize(device)
            failure = "dispatch with its peers absent raised nothing"
        except CommTimeoutError as error:
            elapsed = time.monotonic() - start
            message = str(error)
            for needed in ("rank 0", "dispatch", "notify"):
                if needed not in message:
                    failure = f"the CommTimeoutError does not mention {needed!r}: {message}"
            if not re.search(r"waiting for rank [1-9]", message):
                failure = f"the CommTimeoutError names no missing rank: {message}"
            if not MISSING_PEER_TIMEOUT_S * 0.9 <= elapsed <= MISSING_PEER_TIMEOUT_S + 5:
                failure = f"CommTimeoutError after {elapsed:.1f} s, expected about {MISSING_PEER_TIMEOUT_S:g} s"
    dist.barrier(group=side)
    native.destroy()
    assert failure is None, failure


def _missing_gather_body(rank: int, num_ranks: int, group, copy_mode: str) -> None:
    """Rank 1 takes part in the notify only, so rank 0's pulls wait on chunk words that never rise (with sends:
    rank 0's send kernel waits for rank 1's rows): rank 0's work still ends within the timeout, and its next call
    raises CommTimeoutError naming the receive and rank 1."""
    from uccl_ep_plugin import CommTimeoutError
    device, side, native = _short_timeout_setup(rank, group, copy_mode)
    case = Case("gather_bf16_h2048_k2_e8", 2048, 2, 8, (64, 64))
    failure = None
    x, topk_idx, topk_weights, _ = _inputs(case, rank, 5, device)
    layout = native.get_dispatch_layout(topk_idx, case.num_experts)[:4]
    if rank == 0:
        start = time.monotonic()
        _dispatch(native, x, layout, topk_idx, topk_weights, case)
        torch.cuda.synchronize(device)
        elapsed = time.monotonic() - start
        if not MISSING_PEER_TIMEOUT_S * 0.9 <= elapsed <= MISSING_PEER_TIMEOUT_S + 5:
            failure = (f"the dispatch's streams drained after {elapsed:.1f} s, "
                       f"expected about {MISSING_PEER_TIMEOUT_S:g} s")
        try:
            _dispatch(native, x, layout, topk_idx, topk_weights, case)
            failure = failure or "the call after a dispatch whose rows never came raised nothing"
        except CommTimeoutError as error:
            message = str(error)
            for needed in ("rank 0", "receiving rows", "waiting for rank 1"):
                if needed not in message:
                    failure = failure or f"the CommTimeoutError does not mention {needed!r}: {message}"
    else:
        # The notify exchange alone, as the dispatch would launch it (the same settings), then nothing.
        engine = native._native.normal
        num_tokens_per_rank, _, num_tokens_per_expert, is_token_in_rank = layout
        num_tokens, num_channels = case.num_tokens(rank), case.num_sms // 2
        local_experts = case.num_experts // num_ranks
        def ints(*shape):
            return torch.empty(shape, dtype=torch.int32, device=device)
        send_pos, send_head = ints(num_tokens, num_ranks), ints(num_tokens, num_ranks)
        channel_prefix_matrix, recv_channel_prefix_matrix = ints(num_ranks, num_channels), ints(num_ranks, num_channels)
        counts = ints(num_ranks * num_ranks + local_experts)   # rank_prefix_matrix, then the tokens per local expert
        args = engine._C.NormalLayoutNotifyArgs(
            engine.region, is_token_in_rank.data_ptr(), num_tokens, num_tokens_per_rank.data_ptr(),
            num_tokens_per_expert.data_ptr(), num_channels, local_experts, case.expert_alignment, 0,
            send_pos.data_ptr(), channel_prefix_matrix.data_ptr(), send_head.data_ptr(), counts.data_ptr(),
            recv_channel_prefix_matrix.data_ptr(), counts.data_ptr() + 4 * num_ranks * num_ranks)
        if copy_mode == "sends":   # as if sends followed
            args.sends = True
        else:   # as if a gather followed
            args.pull_chunks = engine.copy_engine.pull_chunks(case.num_sms // 2)
        engine._C.normal_layout_and_notify(args, torch.cuda.current_stream(device).cuda_stream)
        torch.cuda.synchronize(device)
    dist.barrier(group=side)
    native.destroy()
    assert failure is None, failure


@dataclass(frozen=True)
class DispatchSettings:
    """What a rank's dispatch must share with the other ranks'."""
    num_sms: int = 20
    copy_mode: str = "engine"
    pull_chunks: int = 3
    worst_tokens: bool = False
    sm_push_percent: int = 0
    dispatch_rows: str = "pull"

    def describe(self) -> str:
        """As the error names them."""
        num_channels = self.num_sms // 2
        if self.copy_mode == "sm" or self.worst_tokens:
            rows = "rows moved by SMs"
        elif self.copy_mode == "sends":
            rows = "rows sent by every SM and copied out by copy engines"
        else:
            how = "pushed where they can be, else pulled" if self.dispatch_rows == "push" else "pulled"
            rows = f"rows {how} by copy engines in {min(self.pull_chunks, num_channels)} pieces"
        push = 0 if self.worst_tokens else self.sm_push_percent
        return (f"{num_channels} channels (config.num_sms {self.num_sms}), {rows}, "
                f"{push}% of the combine's rows stored by SMs")


# The last rank's settings, one differing from the others' (DispatchSettings()) each.
DIFFERENT_SETTINGS = {"num_sms": DispatchSettings(num_sms=8), "copy_mode": DispatchSettings(copy_mode="sm"),
                      "sends": DispatchSettings(copy_mode="sends"),
                      "pull_chunks": DispatchSettings(pull_chunks=1),
                      "num_worst_tokens": DispatchSettings(worst_tokens=True),
                      "sm_push_percent": DispatchSettings(sm_push_percent=25),
                      "dispatch_rows": DispatchSettings(dispatch_rows="push")}


def _settings_differ_body(rank: int, num_ranks: int, group, setting: str) -> None:
    """The last rank dispatches with one setting changed: every rank raises ValueError naming a rank whose settings
    differ and both settings, at once (no timeout)."""
    usual, changed = DispatchSettings(), DIFFERENT_SETTINGS[setting]
    mine, others = (changed, usual) if rank == num_ranks - 1 else (usual, changed)
    with environment(PULL_CHUNKS_ENV, str(mine.pull_chunks)), environment(SM_PUSH_ENV, str(mine.sm_push_percent)), \
            environment(DISPATCH_ROWS_ENV, mine.dispatch_rows):
        device, side, native = _short_timeout_setup(rank, group, mine.copy_mode)
    case = Case(f"settings_{setting}", 2048, 2, 8, (64, 64), num_sms=mine.num_sms)
    x, topk_idx, topk_weights, _ = _inputs(case, rank, 9, device)
    layout = native.get_dispatch_layout(topk_idx, case.num_experts)[:4]
    worst = case.worst_tokens() if mine.worst_tokens else 0
    failure = None
    start = time.monotonic()
    try:
        _dispatch(native, x, layout, topk_idx, topk_weights, case, worst)
        torch.cuda.synchronize(device)
        # A dispatch with num_worst_tokens leaves the host before its notify ends: the next call raises.
        _dispatch(native, x, layout, topk_idx, topk_weights, case, worst)
        failure = "dispatches with different settings raised nothing"
    except ValueError as error:
        elapsed, message = time.monotonic() - start, str(error)
        others_rank = rf"rank {num_ranks - 1}" if mine is usual else r"rank \d+"
        if not re.search(rf"^rank {rank}: .*{others_rank} dispatches with {re.escape(others.describe())}, "
                         rf"this rank with {re.escape(mine.describe())};", message):
            failure = f"the error does not name the ranks and both settings: {message}"
        if elapsed >= MISSING_PEER_TIMEOUT_S:
            failure = f"the difference was found after {elapsed:.1f} s, by a timeout ({message})"
    dist.barrier(group=side)
    native.destroy()
    assert failure is None, failure


# The copy engines with their default settings (the own rows by whichever auto picks: see the large case),
# with 7 combine and 5 pull chunks (rows per chunk then rarely divide evenly, and pull chunks group channels
# unevenly), 30% of the pulled rows copied and 30% of the pushed rows stored by SMs and the own rows always by SMs,
# and with one chunk each, no pulled rows copied by SMs, every pushed row stored by SMs (no combine chunk at all) and
# the own rows by copy engine where few tokens break their runs (the cases with many experts per rank; by SMs in the
# others); and auto, which at 4 ranks and more moves the cached dispatches of copy-engine handles by SM stores; and
# sends (every SM sends rows, copy engines copy them out), with the combine's defaults and with 7 chunks and 30% of
# the rows stored by SMs.
@pytest.mark.parametrize("copy_mode,combine_chunks,pull_chunks,sm_pull,sm_push,own_rows,dispatch_rows",
                         [("engine", "", "", "", "", "", ""), ("engine", "7", "5", "30", "30", "sm", ""),
                          ("engine", "1", "1", "0", "100", "engine", ""), ("sm", "", "", "", "", "", ""),
                          ("engine", "", "", "", "", "", "push"), ("engine", "7", "5", "30", "30", "sm", "push"),
                          ("auto", "", "", "", "", "", ""), ("sends", "", "", "", "", "", ""),
                          ("sends", "7", "", "", "30", "", "")],
                         ids=["engine", "engine-7-5-chunks-30-sm-own-rows-sm",
                              "engine-1-1-chunks-no-sm-pulls-sm-pushes-own-rows-engine", "sm", "engine-push",
                              "engine-push-7-5-chunks-30-sm-own-rows-sm", "auto", "sends",
                              "sends-7-combine-chunks-30-sm-pushes"])
def test_native_normal_matches_reference(copy_mode, combine_chunks, pull_chunks, sm_pull, sm_push, own_rows,
                                         dispatch_rows):
    run_ranks(RANKS, _compare_body, backend="nccl", copy_mode=copy_mode, combine_chunks=combine_chunks,
              pull_chunks=pull_chunks, sm_pull=sm_pull, sm_push=sm_push, own_rows=own_rows,
              dispatch_rows=dispatch_rows)


def test_native_normal_with_aggressive_atomics_matches_reference():
    """The kernels' flags as relaxed accesses between explicit fences (AMD's default), on both row paths."""
    with environment(AGGRESSIVE_ATOMIC_KEY, "1"):   # the spawned ranks inherit it
        for copy_mode in ("engine", "sm"):
            run_ranks(RANKS, _compare_body, backend="nccl", copy_mode=copy_mode, combine_chunks="", pull_chunks="",
                      sm_pull="", sm_push="", own_rows="", dispatch_rows="")


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_native_normal_cuda_graph_with_worst_tokens(fp8):
    run_ranks(RANKS, _graph_body, backend="nccl", fp8=fp8)


def test_native_normal_stream_semantics():
    run_ranks(RANKS, _streams_body, backend="nccl")


@pytest.mark.parametrize("launch_thread", ["on", "off"])
def test_native_normal_back_to_back_without_sync(launch_thread):
    run_ranks(RANKS, _back_to_back_body, backend="nccl", launch_thread=launch_thread)


@pytest.mark.parametrize("copy_mode", ["engine", "sends"])
def test_native_normal_failed_allocation_ends_the_exchange(copy_mode):
    run_ranks(RANKS, _failed_allocation_body, backend="nccl", copy_mode=copy_mode)


def test_native_normal_missing_peer_raises():
    run_ranks(RANKS, _missing_peer_body, backend="nccl")


@pytest.mark.parametrize("setting", list(DIFFERENT_SETTINGS))
def test_native_normal_different_dispatch_settings_raise(setting):
    run_ranks(RANKS, _settings_differ_body, backend="nccl", setting=setting)


@pytest.mark.parametrize("copy_mode", ["engine", "sends"])
def test_native_normal_missing_gather_drains(copy_mode):
    run_ranks(RANKS, _missing_gather_body, backend="nccl", copy_mode=copy_mode)
