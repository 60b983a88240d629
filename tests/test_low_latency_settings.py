"""The low-latency combine's mode (UCCL_EP_LOW_LATENCY_COMBINE) and the check that every rank chose the same."""

import pytest
import torch.distributed as dist

from tests.multiprocess import run_ranks
from uccl_ep_plugin.engines.native.low_latency import COMBINE_ENV, combine_mode
from uccl_ep_plugin.engines.native.peers import same_on_every_rank


@pytest.mark.parametrize("value,expected", [(None, "direct"), ("", "direct"), ("direct", "direct"),
                                            (" PreReduce ", "prereduce"), ("prereduce", "prereduce")])
def test_combine_mode(monkeypatch, value, expected):
    if value is None:
        monkeypatch.delenv(COMBINE_ENV, raising=False)
    else:
        monkeypatch.setenv(COMBINE_ENV, value)
    assert combine_mode() == expected


def test_combine_mode_rejects_unknown(monkeypatch):
    monkeypatch.setenv(COMBINE_ENV, "pre-reduce")
    with pytest.raises(ValueError, match=rf"{COMBINE_ENV}='pre-reduce': expected one of direct, prereduce"):
        combine_mode()


def _agree_body(rank: int, num_ranks: int, group, values) -> None:
    mine = values[rank]
    if len(set(values)) == 1:
        assert same_on_every_rank(group, COMBINE_ENV, mine) == mine
        return
    expected = f"{COMBINE_ENV} must be the same on every rank; the ranks have 0: 'direct', 1: 'prereduce'"
    with pytest.raises(ValueError) as raised:
        same_on_every_rank(group, COMBINE_ENV, mine)
    assert str(raised.value) == expected, str(raised.value)
    dist.barrier(group)   # every rank raised, and every rank is still in step


@pytest.mark.parametrize("values", [("prereduce", "prereduce"), ("direct", "prereduce")], ids=["same", "differ"])
def test_every_rank_must_choose_the_same(values):
    run_ranks(2, _agree_body, values=values)
