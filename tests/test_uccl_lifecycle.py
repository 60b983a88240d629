"""initialize_uccl / destroy_uccl (UCCL-EP's proxy lifecycle) between CPU processes: the proxies they
start move bytes between the ranks' scratch buffers, stop without leaking, and reject bad arguments."""

import time

import pytest
import torch

from tests.multiprocess import run_ranks
from tests.process_resources import fds_and_threads, settled_fds_and_threads
from uccl_ep_plugin import _C, destroy_uccl, initialize_uccl

SCRATCH = 1 << 16
SLICE = 4096


def _pattern(rank: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(100 + rank)
    return torch.randint(1, 256, (SLICE,), dtype=torch.uint8, generator=generator)


def _wait(predicate, what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.001)


def _exchange_body(rank: int, num_ranks: int, group) -> None:
    import torch.distributed as dist
    before = fds_and_threads()
    for attempt in range(2):   # started again after destroy_uccl: nothing left behind blocks it
        scratch = torch.full((SCRATCH,), 0xEE, dtype=torch.uint8)     # poisoned receive slices
        scratch[:SLICE] = _pattern(rank)
        proxies, workers = initialize_uccl(scratch, SCRATCH, rank, num_ranks, group, num_experts=8 * num_ranks)
        assert workers is None and len(proxies) == 1
        with pytest.raises(RuntimeError, match="already run on cpu"):
            initialize_uccl(scratch, SCRATCH, rank, num_ranks, group)
        fifo = proxies[0].fifos[0]
        for peer in range(num_ranks):
            if peer != rank:
                fifo.push(_C.HostFifo.WRITE, peer, length_bytes=SLICE, local_offset=0,
                          remote_offset=(1 + rank) * SLICE)
        fifo.push(_C.HostFifo.QUIET)
        _wait(lambda: proxies[0].stats()["quiets"] == 1, "the quiet after the writes")
        proxies[0].check()
        stats = proxies[0].stats()
        assert stats["execute_ns"] > 0 and stats["quiet_wait_ns"] > 0, stats
        dist.barrier(group=group)      # every rank's writes have completed
        for peer in range(num_ranks):
            got = scratch[(1 + peer) * SLICE:(2 + peer) * SLICE]
            if peer == rank:
                assert bool((got == 0xEE).all()), "a slice nobody wrote changed"
            else:
                assert torch.equal(got, _pattern(peer)), f"attempt {attempt}: rank {peer}'s bytes did not land"
        dist.barrier(group=group)      # no peer still sends when the proxies stop
        destroy_uccl(proxies, workers)
        destroy_uccl(proxies, workers)     # idempotent
        assert not proxies[0].running
        assert settled_fds_and_threads(before) == before, "destroy_uccl left a thread or descriptor behind"


def test_initialize_uccl_moves_bytes_and_destroy_uccl_leaks_nothing():
    run_ranks(2, _exchange_body)


def _bad_arguments_body(rank: int, num_ranks: int, group) -> None:
    scratch = torch.zeros(SCRATCH, dtype=torch.uint8)
    cases = [
        (dict(scratch_nbytes=SCRATCH + 1), ValueError, "scratch_nbytes=65537 exceeds"),
        (dict(scratch_nbytes=0), ValueError, "scratch_nbytes must be a positive int"),
        (dict(rank=rank + 1), ValueError, "do not match the group"),
        (dict(num_ranks=num_ranks + 1), ValueError, "do not match the group"),
        (dict(num_experts=3), ValueError, "num_experts=3 is not a multiple of num_ranks=2"),
        (dict(num_experts=-1), ValueError, "num_experts must be a non-negative int"),
        (dict(scratch=scratch[::2]), ValueError, "contiguous"),
        (dict(scratch="buffer"), TypeError, "scratch must be a tensor"),
    ]
    for change, error, message in cases:
        arguments = dict(scratch=scratch, scratch_nbytes=SCRATCH, rank=rank, num_ranks=num_ranks, group=group)
        arguments.update(change)
        with pytest.raises(error, match=message):
            initialize_uccl(**arguments)


def test_initialize_uccl_names_the_bad_argument():
    run_ranks(2, _bad_arguments_body)
