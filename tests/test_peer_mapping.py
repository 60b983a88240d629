"""The collective decision of whether the ranks can map each other's low-latency buffers with CUDA
IPC: every rank must reach the same answer, and a failed attempt must release what it allocated.
The extension is replaced by a stand-in, so the decision logic runs on CPU ranks over gloo."""

import torch

from tests.multiprocess import run_ranks
from uccl_ep_plugin.engines.native import peers


class _FakePeerMemory:
    """Records what map_peer_buffer does with the buffer; open_peers fails on the ranks told to."""

    released = []

    def __init__(self, num_bytes, device, fail_open):
        self.num_bytes, self.device, self.fail_open = num_bytes, device, fail_open
        self.handles = None

    def ipc_handle(self):
        return b"handle-of-%d" % self.device

    def open_peers(self, handles, rank):
        self.handles = handles
        if self.fail_open:
            raise RuntimeError("CUDA error cudaErrorPeerAccessUnsupported (stand-in)")

    def release(self):
        _FakePeerMemory.released.append(self.device)


class _FakeExtension:
    def __init__(self, fail_open):
        self.fail_open = fail_open
        self.created = []

    def PeerMemory(self, num_bytes, device):  # noqa: N802 - the extension's class name
        memory = _FakePeerMemory(num_bytes, device, self.fail_open)
        self.created.append(memory)
        return memory


def _open_fails_on_rank_1(rank, num_ranks, group):
    extension = _FakeExtension(fail_open=rank == 1)
    buffer, reason = peers.map_peer_buffer(extension, group, rank, torch.device("cuda", rank), 1 << 20)
    assert buffer is None
    assert reason.startswith("rank 1 could not map its peers' buffers with CUDA IPC"), reason
    assert "cudaErrorPeerAccessUnsupported" in reason
    (memory,) = extension.created
    assert memory.handles == [b"handle-of-%d" % r for r in range(num_ranks)]   # exchanged through the group
    assert _FakePeerMemory.released == [rank], "the failed attempt must free this rank's buffer"


def _ranks_on_two_hosts(rank, num_ranks, group):
    peers._host_id = lambda: f"host-{rank // 2}"   # ranks 0-1 on one host, 2 on another
    extension = _FakeExtension(fail_open=False)
    buffer, reason = peers.map_peer_buffer(extension, group, rank, torch.device("cuda", 0), 1 << 20)
    assert buffer is None and extension.created == [], "nothing is allocated when a peer is on another host"
    expected = "rank 2 is on another host" if rank < 2 else "rank 0 is on another host"
    assert reason.startswith(expected), reason


def test_failed_ipc_open_on_one_rank_falls_back_on_every_rank():
    run_ranks(2, _open_fails_on_rank_1)


def test_peers_on_another_host_are_not_mapped():
    run_ranks(3, _ranks_on_two_hosts)
