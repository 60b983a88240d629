"""The multi-rank test harness (tests/reference_checks.py) when a rank dies inside a section: its record still says
what it saw and where it ended, and the group's failure names the rank and the signal."""

import os
import re
import signal

import pytest

from tests.reference_checks import ENDED_INSIDE, assert_section, run_sections


def _body(rank: int, num_ranks: int, group, rec) -> None:
    with rec.section("before"):
        rec.expect(rank != 0, "rank 0 notes a failure before the abort")
    with rec.section("dies"):
        if rank == 1:
            # As a C++ thread's std::terminate or the OOM killer ends a process: no Python cleanup, no final record
            # (SIGKILL rather than an abort, which could leave a core file behind).
            os.kill(os.getpid(), signal.SIGKILL)
    with rec.section("after"):
        rec.expect(True, "never fails")


@pytest.fixture(scope="module")
def results():
    return run_sections(2, _body, deadline_s=60.0)


def test_the_group_failure_names_the_rank_and_its_signal(results):
    assert results.crash is not None and "rank 1 was killed by SIGKILL" in results.crash


def test_a_killed_rank_keeps_what_it_recorded_before(results):
    assert results.per_rank[1]["before"] == []
    with pytest.raises(AssertionError, match="rank 1 never ran section 'after'"):
        assert_section(results, "after")


def test_the_section_a_rank_died_in_fails_for_that_rank(results):
    assert results.per_rank[1]["dies"] == [ENDED_INSIDE]
    with pytest.raises(AssertionError, match=re.escape(f"rank 1: {ENDED_INSIDE}")):
        assert_section(results, "dies")


def test_failures_recorded_by_a_surviving_rank_are_reported(results):
    assert results.per_rank[0]["dies"] == [] and results.per_rank[0]["after"] == []
    with pytest.raises(AssertionError, match="rank 0: rank 0 notes a failure before the abort"):
        assert_section(results, "before")
