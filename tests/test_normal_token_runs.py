"""The copy-engine dispatch copies a rank's rows to itself in runs of consecutive tokens, worked out on the host
from the tokens the notify found it does not keep (``normal_token_runs``): on random masks the runs cover exactly the
kept tokens, in order, each at its received row. Host arithmetic only, but it needs an extension built with the
native normal mode (a CUDA build; no GPU is used)."""

import random

import pytest

try:
    from uccl_ep_plugin import _C
except ImportError:
    _C = None

pytestmark = pytest.mark.skipif(_C is None or not hasattr(_C, "normal_token_runs"),
                                reason="needs an extension built with the native normal mode")


def _rows_by_token(runs):
    rows = {}
    for token, row, count in runs:
        assert count > 0, f"empty run {(token, row, count)}"
        for i in range(count):
            assert token + i not in rows, f"token {token + i} in two runs"
            rows[token + i] = row + i
    return rows


@pytest.mark.parametrize("keep_share", [0.0, 0.3, 0.9, 0.997, 1.0])
def test_runs_cover_the_kept_tokens(keep_share):
    rng = random.Random(int(keep_share * 1000))
    for num_tokens in (0, 1, 2, 17, 4096 + 17):
        kept = [rng.random() < keep_share for _ in range(num_tokens)]
        gaps = [token for token, keep in enumerate(kept) if not keep]
        runs = _C.normal_token_runs(gaps, num_tokens)
        want = {}
        for token in range(num_tokens):
            if kept[token]:
                want[token] = len(want)   # received rows keep the tokens' order
        assert _rows_by_token(runs) == want
        assert [run[0] for run in runs] == sorted(run[0] for run in runs)
        # Runs are maximal: a run never ends where the next one starts.
        for (token, _, count), (next_token, _, _) in zip(runs, runs[1:]):
            assert token + count < next_token

