"""The collective decision of whether the ranks can map each other's low-latency buffers with CUDA
IPC: every rank must reach the same answer, and a failed attempt must release what it allocated.
The extension is replaced by a stand-in, so the decision logic runs on CPU ranks over gloo."""

import pytest
import torch

from tests.multiprocess import run_ranks
from uccl_ep_plugin import hosts
from uccl_ep_plugin.engines.native import peers


class _FakePeerMemory:
    """Records what map_peer_buffer does with the buffer; open_peers fails on the ranks told to."""

    released = []
    local_base = peer_bases = 0

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
    hosts.host_id = lambda slot, logical=True: f"host-{rank // 2}"   # ranks 0-1 on one host, 2 on another
    extension = _FakeExtension(fail_open=False)
    buffer, reason = peers.map_peer_buffer(extension, group, rank, torch.device("cuda", 0), 1 << 20)
    assert buffer is None and extension.created == [], "nothing is allocated when a peer is on another host"
    expected = "rank 2 is on another host" if rank < 2 else "rank 0 is on another host"
    assert reason.startswith(expected), reason


def _ranks_on_two_hosts_map_their_own(rank, num_ranks, group, logical_hosts=True):
    """Where other hosts are allowed, a rank maps its own host's buffers only and learns which ranks are remote; with
    ``logical_hosts`` False the two logical hosts are one machine, and every buffer is mapped (cuda-copy between
    them)."""
    import os
    os.environ["UCCL_EP_GPUS_PER_NODE"] = "2"    # GPUs 0-1 one host, 2-3 the other
    peers.device_bytes = lambda owner, address, num_bytes, device: torch.empty(num_bytes, dtype=torch.uint8)
    extension = _FakeExtension(fail_open=False)
    buffer, reason = peers.map_peer_buffer(extension, group, rank, torch.device("cuda", rank), 1 << 20,
                                           other_hosts=True, logical_hosts=logical_hosts)
    assert reason is None and buffer is not None
    mine = rank // 2 if logical_hosts else 0
    assert buffer.remote_ranks == [peer for peer in range(num_ranks) if peer // 2 != mine and logical_hosts]
    (memory,) = extension.created
    assert memory.handles == [b"handle-of-%d" % peer if peer // 2 == mine or not logical_hosts else b""
                              for peer in range(num_ranks)]


def _reasons_of_some_ranks(rank, num_ranks, group):
    mine = f"rank {rank} says no" if rank in (1, 2) else None
    assert peers.first_reason(group, mine) == "rank 1 says no"
    assert peers.first_reason(group, None) is None


def _bad_gpus_per_node_on_rank_1(rank, num_ranks, group):
    import os
    if rank == 1:
        os.environ["UCCL_EP_GPUS_PER_NODE"] = "zero"
    with pytest.raises(ValueError, match="rank 1: UCCL_EP_GPUS_PER_NODE='zero'"):
        peers.map_peer_buffer(_FakeExtension(fail_open=False), group, rank, torch.device("cuda", rank), 1 << 20)


def test_a_bad_gpus_per_node_on_one_rank_fails_every_rank():
    run_ranks(2, _bad_gpus_per_node_on_rank_1)


def test_failed_ipc_open_on_one_rank_falls_back_on_every_rank():
    run_ranks(2, _open_fails_on_rank_1)


def test_peers_on_another_host_are_not_mapped():
    run_ranks(3, _ranks_on_two_hosts)


@pytest.mark.parametrize("logical_hosts", [True, False], ids=["logical-hosts", "whole-machine"])
def test_ranks_on_two_hosts_map_only_their_own_host(logical_hosts):
    run_ranks(4, _ranks_on_two_hosts_map_their_own, logical_hosts=logical_hosts)


def test_every_rank_takes_the_first_ranks_reason():
    run_ranks(3, _reasons_of_some_ranks)


def test_gpus_per_node_cuts_a_machine_into_hosts(monkeypatch):
    monkeypatch.delenv(hosts.GPUS_PER_NODE_ENV, raising=False)
    machine = hosts.host_id(0)
    assert machine.startswith(__import__("socket").gethostname()) and hosts.host_id(7) == machine
    monkeypatch.setenv(hosts.GPUS_PER_NODE_ENV, "4")
    assert [hosts.host_id(i) for i in range(8)] == [f"{machine}/0"] * 4 + [f"{machine}/1"] * 4
    # The machine behind its logical hosts (the cuda-copy transport maps across them).
    assert [hosts.host_id(i, logical=False) for i in range(8)] == [machine] * 8
    for bad in ("0", "two", "-1"):
        monkeypatch.setenv(hosts.GPUS_PER_NODE_ENV, bad)
        with pytest.raises(ValueError, match=f"UCCL_EP_GPUS_PER_NODE='{bad}'"):
            hosts.host_id(0)


class _Verbs:
    def __init__(self, library, devices):
        self.verbs_available = lambda: library
        self.verbs_devices = lambda: devices


@pytest.mark.parametrize("transport,ifname,library,devices,expected", [
    ("", "", True, [{"name": "mlx5_0"}], None),
    ("", "", True, [], "this host has no RDMA device"),
    ("", "", False, [], "libibverbs.so.1 cannot be loaded"),
    ("cuda-copy", "", True, [{"name": "mlx5_0"}], "UCCL_EP_PROXY_TRANSPORT=cuda-copy reaches this host only"),
    ("tcp", "", True, [], "needs UCCL_SOCKET_IFNAME"),
    ("tcp", "eth0", False, [], None),
    ("verbs", "", False, [], "libibverbs.so.1 cannot be loaded"),
    ("verbs", "", True, [], "this host has no RDMA device"),
    ("verbs", "", True, [{"name": "mlx5_0"}], None),
])
def test_which_transport_reaches_other_hosts(monkeypatch, transport, ifname, library, devices, expected):
    """Ranks on other hosts need verbs with an RDMA device (named, or unset where the host has one) or tcp on a
    routable interface; without one the reference engine serves and the reason says what to set."""
    from uccl_ep_plugin.proxies import cross_host_reason
    monkeypatch.setenv("UCCL_EP_PROXY_TRANSPORT", transport)
    monkeypatch.setenv("UCCL_SOCKET_IFNAME", ifname)
    reason = cross_host_reason(_Verbs(library, devices))
    if expected is None:
        assert reason is None
    else:
        assert expected in reason, reason


@pytest.mark.parametrize("named,cross_host,expected", [("", False, "cuda-copy"), ("", True, "verbs"),
                                                       ("tcp", True, "tcp"), ("cuda-copy", False, "cuda-copy")])
def test_unset_transport_is_verbs_across_hosts(monkeypatch, named, cross_host, expected):
    """With UCCL_EP_PROXY_TRANSPORT unset, proxies that reach other hosts use verbs (cross_host_reason has found an
    RDMA device by then), the others cuda-copy; a named transport is kept."""
    from uccl_ep_plugin.proxies import proxy_transport, transport_named
    monkeypatch.setenv("UCCL_EP_PROXY_TRANSPORT", named)
    assert proxy_transport(cross_host=cross_host) == expected
    assert transport_named() == bool(named)
