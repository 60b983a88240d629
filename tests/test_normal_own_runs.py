"""The copy-engine dispatch copies a rank's rows to itself in runs of consecutive tokens, worked out on the host
from the tokens the notify found it does not keep (``normal_own_runs``): on random masks the runs cover exactly the
kept tokens, in order, each at its received row. Host arithmetic only, but it needs an extension built with the
native normal mode (a CUDA build; no GPU is used)."""

import random

import pytest

try:
    from uccl_ep_plugin import _C
except ImportError:
    _C = None

pytestmark = pytest.mark.skipif(_C is None or not hasattr(_C, "normal_own_runs"),
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
        runs = _C.normal_own_runs(gaps, num_tokens)
        want = {}
        for token in range(num_tokens):
            if kept[token]:
                want[token] = len(want)   # received rows keep the tokens' order
        assert _rows_by_token(runs) == want
        assert [run[0] for run in runs] == sorted(run[0] for run in runs)
        # Runs are maximal: a run never ends where the next one starts.
        for (token, _, count), (next_token, _, _) in zip(runs, runs[1:]):
            assert token + count < next_token


def test_own_rows_by_engine_modes():
    per_sm = _C.NORMAL_OWN_ROWS_ENGINE_BYTES_PER_SM
    for num_sms in (1, 8, 24):
        for own_bytes in (0, per_sm * num_sms - 1, per_sm * num_sms, 10 * per_sm * num_sms):
            assert _C.normal_own_rows_by_engine(_C.NormalOwnRows.engine, own_bytes, num_sms)
            assert not _C.normal_own_rows_by_engine(_C.NormalOwnRows.sm, own_bytes, num_sms)
            assert (_C.normal_own_rows_by_engine(_C.NormalOwnRows.auto, own_bytes, num_sms) ==
                    (own_bytes >= per_sm * num_sms))


# The measured crossovers on 2x H200 (4096 tokens, hidden 7168): the copy engine won for bf16 at 8-16 SMs and for
# fp8 at 8, the SMs at the other counts measured.
@pytest.mark.parametrize("row_bytes,engine_sms,sm_sms", [(7168 * 2, (8, 12, 16), (20, 24)), (7168, (8,), (12, 16, 20, 24))])
def test_own_rows_auto_follows_the_measured_crossover(row_bytes, engine_sms, sm_sms):
    own_bytes = 4096 * row_bytes
    for num_sms in engine_sms:
        assert _C.normal_own_rows_by_engine(_C.NormalOwnRows.auto, own_bytes, num_sms), num_sms
    for num_sms in sm_sms:
        assert not _C.normal_own_rows_by_engine(_C.NormalOwnRows.auto, own_bytes, num_sms), num_sms
