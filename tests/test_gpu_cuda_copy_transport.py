"""The cuda-copy transport (csrc/transport/cuda_copy_transport.*) on one GPU: argument errors, local writes
and atomics, close() and leaks. The 2-GPU exchange (copy-engine writes between CUDA IPC mapped buffers,
system-scope atomic adds, immediates over the tcp control transport, reorder injection) is in
tests/test_transport_exchange.py.
"""

import gc

import pytest
import torch

from tests.transport_exchange import (POISON, REORDER_ENV, assert_local_requests, assert_requests_checked, settle,
                                          skip_without)
from tests.process_resources import fds_and_threads, settled_fds_and_threads
from uccl_ep_plugin import _C


@pytest.fixture(autouse=True)
def _needs_transport_and_gpu():
    skip_without("cuda-copy", gpus=1)


# ---------------------------------------------------------------------------------------- one GPU, one rank
@pytest.fixture(autouse=True)
def _no_transport_env(monkeypatch):
    for name in ("UCCL_SOCKET_IFNAME", REORDER_ENV, "UCCL_EP_TRANSPORT_REORDER_WINDOW",
                 "UCCL_EP_TRANSPORT_REORDER_HOLD_US"):
        monkeypatch.delenv(name, raising=False)


def _local_memory(num_bytes):
    """A PeerMemory that mapped its single rank (itself), and a poisoned uint8 tensor over it."""
    from uccl_ep_plugin.engines.native.peers import _DeviceBytes

    memory = _C.PeerMemory(num_bytes, 0)
    memory.open_peers([memory.ipc_handle()], 0)
    region = torch.as_tensor(_DeviceBytes(memory, memory.local_base, num_bytes), device=torch.device("cuda", 0))
    region.fill_(POISON)
    torch.cuda.synchronize()
    return memory, region


def _local_transport(memory, **kwargs):
    transport = _C.CudaCopyTransport(0, 1, memory, **kwargs)
    transport.connect([transport.listen_address()])
    return transport


@pytest.mark.gpu
def test_bad_arguments_name_the_argument():
    size = 4096
    memory, _ = _local_memory(size)
    transport = _C.CudaCopyTransport(0, 1, memory)
    with pytest.raises(RuntimeError, match="before connect"):
        transport.write(0, 0, 0, 8)
    with pytest.raises(ValueError, match="addresses"):
        transport.connect([transport.listen_address()] * 2)
    with pytest.raises(ValueError, match=r"addresses\[0\]"):
        transport.connect(["127.0.0.1:1"])
    transport.connect([transport.listen_address()])
    try:
        assert_requests_checked(transport, size)
    finally:
        transport.close()

    bad_constructions = [({"rank": 1, "num_ranks": 1}, "rank"), ({"rank": 0, "num_ranks": 0}, "num_ranks"),
                         ({"rank": 0, "num_ranks": 2}, "num_ranks"),
                         ({"rank": 0, "num_ranks": 1, "timeout_s": 0.0}, "timeout_s"),
                         ({"rank": 0, "num_ranks": 1, "reorder_seed": -2}, "reorder_seed")]
    for kwargs, name in bad_constructions:
        with pytest.raises(ValueError, match=name):
            _C.CudaCopyTransport(peer_memory=memory, **kwargs)
    unmapped = _C.PeerMemory(size, 0)
    with pytest.raises(RuntimeError, match="open_peers"):
        _C.CudaCopyTransport(0, 1, unmapped)
    unmapped.release()
    memory.release()


@pytest.mark.gpu
@pytest.mark.parametrize("reorder_seed", [-1, 3], ids=["in-order", "reorder"])
def test_local_writes_and_atomics(reorder_seed):
    memory, region = _local_memory(1 << 16)
    assert_local_requests(region, lambda: _local_transport(memory, reorder_seed=reorder_seed))
    memory.release()


@pytest.mark.gpu
def test_close_leaks_no_threads_or_fds():
    memory, _ = _local_memory(1 << 20)

    def use(transport):
        for i in range(64):
            transport.write(0, 0, 1 << 19, 1 << 18, imm=i)
            transport.atomic_add(0, (900 << 10) + 8 * i, 1)
        transport.quiet()
        assert len(transport.poll_completions()) == 128
        assert len(transport.poll_immediates()) == 64

    # Warm up first: the CUDA runtime and torch may start threads or open files on first use.
    warm = _local_transport(memory, reorder_seed=1)
    use(warm)
    warm.close()
    del warm
    gc.collect()
    before = fds_and_threads()

    transport = _local_transport(memory, reorder_seed=1)
    during = settled_fds_and_threads((before[0] + 2, before[1] + 1))
    assert during[1] == before[1] + 1, "one thread: the control transport's I/O thread"
    use(transport)
    transport.close()
    transport.close()
    assert settled_fds_and_threads(before) == before

    # The destructor does the same, connected or not.
    connected = _local_transport(memory)
    use(connected)
    unconnected = _C.CudaCopyTransport(0, 1, memory)
    del connected, unconnected
    gc.collect()
    assert settled_fds_and_threads(before) == before
    memory.release()


@pytest.mark.gpu
@pytest.mark.parametrize("reorder_seed", [-1, 3], ids=["in-order", "reorder"])
def test_fence(reorder_seed):
    """fence() orders on the device while only plain writes are unfinished; an atomic add or a write with an
    immediate that has not been retired yet makes it refuse (the proxy then waits instead). Writes around a
    fence land, later ones over earlier ones."""
    memory, region = _local_memory(1 << 16)
    region[:2048] = torch.arange(2048, device=region.device).remainder(251).to(torch.uint8)
    settle(region)
    transport = _local_transport(memory, reorder_seed=reorder_seed)
    assert transport.fence()                    # nothing posted yet
    transport.write(0, 0, 8192, 2048)
    assert transport.fence()
    transport.write(0, 1024, 8192, 1024)        # over the first half of the earlier write
    transport.atomic_add(0, 16384, 5)
    assert not transport.fence()
    transport.quiet()
    transport.poll_completions()
    assert transport.fence()
    transport.write(0, 0, 12288, 16, imm=4)
    assert not transport.fence()
    transport.quiet()
    transport.poll_completions()
    assert transport.fence()
    assert torch.equal(region[8192:9216], region[1024:2048])
    assert torch.equal(region[9216:10240], region[1024:2048])
    assert torch.equal(region[12288:12304], region[:16])
    transport.close()
    with pytest.raises(RuntimeError, match="after close"):
        transport.fence()
    memory.release()
