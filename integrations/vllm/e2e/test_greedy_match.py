"""The comparison rule of the end-to-end test: divergence allowed only at an exact top-2 tie."""

import pytest

from completions import Completion
from greedy_match import compare


def stream(tokens, tops=None):
    return Completion(list(tokens), tops if tops is not None else [{t: -1.0, 999: -2.0} for t in tokens])


def test_identical_streams():
    report = compare([stream([1, 2, 3])], [stream([1, 2, 3], [])])
    assert (report.tokens_compared, report.tokens_equal, report.divergences) == (3, 3, [])


def test_divergence_at_exact_tie_is_allowed_and_stops_the_comparison():
    tops = [{1: -1.0, 7: -3.0}, {2: -0.5, 5: -0.5}, {3: -1.0, 4: -2.0}]
    report = compare([stream([1, 2, 3], tops)], [stream([1, 5, 9], [])])
    assert report.tokens_compared == 2 and report.tokens_equal == 1
    assert len(report.ties) == 1 and report.mismatches == []


@pytest.mark.parametrize("candidate_token,second_logprob", [(5, -0.5000001), (6, -0.5)])
def test_near_tie_or_token_outside_top2_is_a_mismatch(candidate_token, second_logprob):
    tops = [{2: -0.5, 5: second_logprob}]
    report = compare([stream([2], tops)], [stream([candidate_token], [])])
    assert len(report.mismatches) == 1 and report.ties == []


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="reference has 1 completions, candidate 2"):
        compare([stream([1])], [stream([1]), stream([1])])
    with pytest.raises(ValueError, match="no top logprobs"):
        compare([stream([1], [])], [stream([1])])
