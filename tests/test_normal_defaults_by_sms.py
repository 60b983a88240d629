"""Defaults the native normal mode picks by the SMs a call uses: what copies a rank's own dispatch rows
(``normal_own_rows_by_engine``) and how many pieces a combine pushes each block in (``normal_combine_chunks``).
Host arithmetic only, but it needs an extension built with the native normal mode (a CUDA build; no GPU is used)."""

import pytest

try:
    from uccl_ep_plugin import _C
except ImportError:
    _C = None

pytestmark = pytest.mark.skipif(_C is None or not hasattr(_C, "normal_combine_chunks"),
                                reason="needs an extension built with the native normal mode")


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


def test_combine_chunks_follow_the_sms_unless_set():
    by_sms = _C.NORMAL_COMBINE_CHUNKS   # the default setting
    assert by_sms == 0
    few, many = _C.normal_combine_chunks(by_sms, 8), _C.normal_combine_chunks(by_sms, 24)
    assert few > many >= 1, (few, many)   # fewer SMs: more, smaller pieces, so the sums start sooner
    assert [_C.normal_combine_chunks(by_sms, sms) for sms in range(1, 65)] == sorted(
        (_C.normal_combine_chunks(by_sms, sms) for sms in range(1, 65)), reverse=True)
    for setting in (1, 5, 63):
        assert {_C.normal_combine_chunks(setting, sms) for sms in (1, 8, 24, 132)} == {setting}
