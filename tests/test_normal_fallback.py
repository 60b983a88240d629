"""A normal-mode dispatch the native engine cannot fit in num_nvl_bytes is served by the reference engine,
with one warning, and the handle it returns keeps its cached dispatches and combines on the reference engine.

Runs on CPU ranks: a stand-in native engine (it raises ExchangeTooLarge, as the real one does on every
rank before moving any row, and fails the test if asked to serve a reference handle) takes the Buffer's
native slot; the results are compared with a Buffer served by the reference engine throughout.
"""

import warnings

import torch

from tests.multiprocess import run_ranks
from uccl_ep_plugin.engines.native.normal import ExchangeTooLarge

NUM_EXPERTS = 8
HIDDEN = 64


class _TooSmallNative:
    name = "native"

    def __init__(self):
        self.dispatch_calls = 0

    def dispatch(self, *args, **kwargs):
        self.dispatch_calls += 1
        if kwargs.get("cached_handle") is not None:
            raise AssertionError("a cached dispatch with a reference handle reached the native engine")
        raise ExchangeTooLarge("dispatch of up to 40 rows to one rank needs 999999 bytes of num_nvl_bytes")

    def combine(self, *args, **kwargs):
        raise AssertionError("a combine with a reference handle reached the native engine")


def _round_trip(buffer, x, topk_idx, topk_weights):
    layout = buffer.get_dispatch_layout(topk_idx, NUM_EXPERTS)
    recv_x, recv_idx, recv_weights, counts, handle, _ = buffer.dispatch(
        x, num_tokens_per_rank=layout[0], is_token_in_rank=layout[3], num_tokens_per_expert=layout[2],
        topk_idx=topk_idx, topk_weights=topk_weights)
    cached_x = buffer.dispatch(x * 2, handle=handle)[0]
    combined, combined_weights, _ = buffer.combine(recv_x, handle, topk_weights=recv_weights)
    return recv_x, recv_idx, counts, cached_x, combined, combined_weights, handle


def _body(rank, num_ranks, group):
    import uccl_ep_plugin as ep

    gen = torch.Generator().manual_seed(7 + rank)
    x = torch.randn((20 + 7 * rank, HIDDEN), generator=gen).to(torch.bfloat16)
    topk_idx = torch.stack([torch.randperm(NUM_EXPERTS, generator=gen)[:3] for _ in range(x.size(0))])
    topk_idx[torch.rand(topk_idx.shape, generator=gen) < 0.2] = -1
    topk_weights = torch.rand(topk_idx.shape, generator=gen)

    expected = _round_trip(ep.Buffer(group, num_nvl_bytes=1 << 20), x, topk_idx, topk_weights)

    buffer = ep.Buffer(group, num_nvl_bytes=1 << 20)
    native = _TooSmallNative()
    buffer._native = native
    buffer.engine_by_operation.update(dispatch="native", combine="native")
    buffer.engine_reasons.pop("dispatch", None)
    buffer.engine_reasons.pop("combine", None)
    buffer._serve()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = _round_trip(buffer, x, topk_idx, topk_weights)
        _round_trip(buffer, x, topk_idx, topk_weights)
    fallbacks = [w for w in caught if "the reference engine (slow) serves" in str(w.message)]
    assert len(fallbacks) == 1, [str(w.message) for w in caught]
    assert "999999 bytes of num_nvl_bytes" in str(fallbacks[0].message)
    assert native.dispatch_calls == 2, "each new dispatch asks the native engine first"
    assert got[-1].served_by == "reference" and expected[-1].served_by == "reference"
    for name, a, b in zip(("recv_x", "recv_topk_idx", "counts", "cached recv_x", "combined", "combined weights"),
                          got[:-1], expected[:-1]):
        if isinstance(a, torch.Tensor):
            assert torch.equal(a, b), f"rank {rank}: {name} differs from the reference engine's"
        else:
            assert a == b, f"rank {rank}: {name} differs from the reference engine's"


def test_dispatch_that_does_not_fit_falls_back_to_the_reference_engine():
    run_ranks(2, _body)
