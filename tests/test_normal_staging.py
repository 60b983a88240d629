"""The copy-engine path's staging size, which decides on the host whether that path serves a dispatch and its
combine: ``normal_staging_most_bytes`` equals the fullest rank's staging worked out here from the per-block
area sizes, on random counts; likewise where pushed and sent rows lie and whether sent rows fit. Host arithmetic only, but it needs an extension built with the native normal
mode (a CUDA build; no GPU is used)."""

import random

import pytest

try:
    from uccl_ep_plugin import _C
except ImportError:
    _C = None

pytestmark = pytest.mark.skipif(_C is None or not hasattr(_C, "normal_staging_most_bytes"),
                                reason="needs an extension built with the native normal mode")


def _prefix(sent):
    """rank_prefix_matrix flattened: [i][j] = rows ranks 0..i send to rank j."""
    num_ranks = len(sent)
    return [sum(sent[k][j] for k in range(i + 1)) for i in range(num_ranks) for j in range(num_ranks)]


def _fullest(kind, sent, x_row_bytes, scale_row_bytes, num_topk):
    def block(rows):
        if kind == _C.NormalStaging.DISPATCH:
            return _C.normal_dispatch_area_bytes(rows, x_row_bytes, scale_row_bytes, num_topk)
        return _C.normal_combine_area_bytes(rows, x_row_bytes, num_topk)
    return max(sum(block(sent[owner][peer]) for peer in range(len(sent)) if peer != owner)
               for owner in range(len(sent)))


@pytest.mark.parametrize("num_ranks", [1, 2, 4, 8])
@pytest.mark.parametrize("kind", ["DISPATCH", "COMBINE"])
def test_fullest_staging(num_ranks, kind):
    rng = random.Random(num_ranks * 7 + len(kind))
    kind = getattr(_C.NormalStaging, kind)
    for _ in range(20):
        sent = [[rng.choice([0, 1, rng.randrange(5000)]) for _ in range(num_ranks)] for _ in range(num_ranks)]
        x_row_bytes, scale_row_bytes = rng.choice([4096, 14336, 7168]), rng.choice([0, 224])
        num_topk = rng.randrange(10)
        got = _C.normal_staging_most_bytes(kind, _prefix(sent), num_ranks, x_row_bytes, scale_row_bytes, num_topk)
        assert got == _fullest(kind, sent, x_row_bytes, scale_row_bytes, num_topk), (sent, x_row_bytes, num_topk)


@pytest.mark.parametrize("num_ranks", [1, 2, 4, 8])
def test_landing_lies_past_the_staging_and_the_notify(num_ranks):
    """Pushed dispatch rows land where no other write of the exchange goes: past every rank's staging and
    past the notify's slots, 16-byte aligned."""
    rng = random.Random(num_ranks)
    for _ in range(20):
        sent = [[rng.choice([0, 1, rng.randrange(5000)]) for _ in range(num_ranks)] for _ in range(num_ranks)]
        x_row_bytes, scale_row_bytes, num_topk = rng.choice([(14336, 0, 8), (7168, 224, 9), (4096, 0, 1)])
        notify_bytes = rng.choice([0, 4096, 1 << 30])
        offset = _C.normal_landing_offset(_prefix(sent), num_ranks, x_row_bytes, scale_row_bytes, num_topk,
                                          notify_bytes)
        staging = _fullest(_C.NormalStaging.DISPATCH, sent, x_row_bytes, scale_row_bytes, num_topk)
        assert offset % 16 == 0
        assert max(staging, notify_bytes) <= offset < max(staging, notify_bytes) + 16


def test_push_decision():
    """A source pushes a peer's rows only when asked, when the landing fits, when it sends some, and when at
    most NORMAL_MAX_GAPS of its tokens stay out of them (they are then few runs of x)."""
    most = _C.NORMAL_MAX_GAPS
    assert _C.normal_pushes_rows(True, True, 4096, 4096 - most)
    assert not _C.normal_pushes_rows(True, True, 4096, 4096 - most - 1)
    assert _C.normal_pushes_rows(True, True, 1, 1)
    assert not _C.normal_pushes_rows(True, True, 0, 0)
    assert not _C.normal_pushes_rows(False, True, 4096, 4096)
    assert not _C.normal_pushes_rows(True, False, 4096, 4096)


@pytest.mark.parametrize("num_ranks", [1, 2, 4, 8])
def test_sent_rows_lie_past_the_notify_and_fit_exactly(num_ranks):
    """Rows sent by SMs (UCCL_EP_NORMAL_COPY=sends) lie past the notify's slots, 16-byte aligned, as one dispatch
    area of all a rank receives: they fit exactly when the fullest receiver's area ends within the data area."""
    rng = random.Random(100 + num_ranks)
    for _ in range(20):
        num_channels, num_local_experts = rng.randrange(1, 70), rng.randrange(1, 40)
        offset = _C.normal_sends_offset(num_ranks, num_channels, num_local_experts)
        notify_bytes = 4 * ((num_ranks * 4 + 15) // 16 * 4 + num_ranks * (num_ranks + num_channels +
                                                                          num_local_experts + 1))
        assert offset % 16 == 0 and notify_bytes <= offset < notify_bytes + 16
        sent = [[rng.choice([0, 1, rng.randrange(5000)]) for _ in range(num_ranks)] for _ in range(num_ranks)]
        x_row_bytes, scale_row_bytes, num_topk = rng.choice([(14336, 0, 8), (7168, 224, 9), (4096, 0, 1)])
        fullest = max(_C.normal_dispatch_area_bytes(sum(sent[src][dst] for src in range(num_ranks)), x_row_bytes,
                                                    scale_row_bytes, num_topk) for dst in range(num_ranks))
        prefix = _prefix(sent)
        fits = [_C.normal_sends_fit(prefix, num_ranks, offset, x_row_bytes, scale_row_bytes, num_topk, data_bytes)
                for data_bytes in (offset + fullest, offset + fullest - 1)]
        assert fits == [True, False]
