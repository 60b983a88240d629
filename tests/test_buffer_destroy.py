"""Buffer.destroy releases every engine even when its wait for the peers fails: the error reaches the
caller, and nothing (buffers, IPC mappings, proxy threads) is left behind."""

import pytest

from tests.multiprocess import run_ranks
from uccl_ep_plugin import Buffer
from uccl_ep_plugin.engines.reference.collectives import CommTimeoutError


class _MappedEngine:
    """Stands in for a native engine whose buffers the peers map."""
    maps_peer_memory = True

    def __init__(self) -> None:
        self.destroyed = False

    def drain_proxy(self, timeout_s: float) -> None:
        pass

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
    if failing_step == "synchronize":
        buffer.synchronize = fail
    else:
        reference.barrier = fail
    with pytest.raises(CommTimeoutError, match="injected failure"):
        buffer.destroy()
    assert engine.destroyed and released == ["reference"], f"rank {rank}: an engine was not released"
    with pytest.raises(RuntimeError, match="destroyed"):
        buffer.get_comm_stream()


@pytest.mark.parametrize("failing_step", ["synchronize", "barrier"])
def test_destroy_releases_everything_when_the_wait_fails(failing_step):
    run_ranks(2, _body, failing_step=failing_step)
