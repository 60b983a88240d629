"""Buffer.destroy releases every engine even when its wait for the peers fails: the error reaches the
caller, and nothing (buffers, IPC mappings, proxy threads) is left behind. A failure a kernel recorded is raised by
Buffer.synchronize, but not by destroy, which still waits in the peers' barrier."""

import pytest

from tests.multiprocess import run_ranks
from uccl_ep_plugin import Buffer
from uccl_ep_plugin.engines.reference.collectives import CommTimeoutError


class _MappedEngine:
    """Stands in for a native engine whose buffers the peers map."""
    maps_peer_memory = True

    def __init__(self, recorded: str = "") -> None:
        self.destroyed = False
        self.recorded = recorded

    def drain_proxy(self, timeout_s: float) -> None:
        pass

    def check(self) -> None:
        if self.recorded:
            raise CommTimeoutError(self.recorded)

    def destroy(self) -> None:
        self.destroyed = True


def _body(rank, num_ranks, group, failing_step):
    buffer = Buffer(group, num_nvl_bytes=1 << 20, explicitly_destroy=True)
    engine = buffer._native = _MappedEngine()
    reference = buffer._reference
    released = []
    reference.destroy = lambda: released.append("reference")

    def fail(*_):
        raise CommTimeoutError(f"rank {rank}: injected failure in {failing_step}")
    if failing_step == "device work":
        buffer._finish_device_work = fail
    else:
        reference.barrier = fail
    with pytest.raises(CommTimeoutError, match="injected failure"):
        buffer.destroy()
    assert engine.destroyed and released == ["reference"], f"rank {rank}: an engine was not released"
    with pytest.raises(RuntimeError, match="destroyed"):
        buffer.get_comm_stream()


@pytest.mark.parametrize("failing_step", ["device work", "barrier"])
def test_destroy_releases_everything_when_the_wait_fails(failing_step):
    run_ranks(2, _body, failing_step=failing_step)


def _recorded_failure_body(rank, num_ranks, group):
    buffer = Buffer(group, num_nvl_bytes=1 << 20, explicitly_destroy=True)
    engine = buffer._native = _MappedEngine(recorded=f"rank {rank}: a kernel timed out waiting for a peer")
    with pytest.raises(CommTimeoutError, match=f"rank {rank}: a kernel timed out"):
        buffer.synchronize()
    buffer.destroy()   # every rank reaches the barrier: no raise, no hang
    assert engine.destroyed


def test_synchronize_raises_a_recorded_failure_and_destroy_does_not():
    run_ranks(2, _recorded_failure_body)
