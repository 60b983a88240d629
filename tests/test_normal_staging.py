"""The copy-engine path's staging size, which decides on the host whether that path serves a dispatch and its
combine: ``normal_staging_most_bytes`` equals the fullest rank's staging worked out here from the per-block
area sizes, on random counts. Host arithmetic only, but it needs an extension built with the native normal
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
