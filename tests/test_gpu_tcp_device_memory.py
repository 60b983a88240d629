"""The tcp transport over GPU memory (csrc/transport/tcp_transport.*, tcp_staging.h) on one GPU: argument
errors, local writes and atomics, writes between two transports on one GPU, and close() leaking nothing
(threads, fds, pinned memory). The 2-GPU exchange is in tests/test_transport_exchange.py.
"""

import gc
import threading

import pytest
import torch

from tests.transport_exchange import (POISON, REORDER_ENV, STAGING, assert_local_requests,
                                          assert_requests_checked, skip_without)
from tests.immediates import collect_immediates
from tests.multiprocess import gpu_count
from tests.process_resources import fds_and_threads, settled_fds_and_threads
from uccl_ep_plugin import _C


@pytest.fixture(autouse=True)
def _needs_transport_and_gpu():
    skip_without("tcp", gpus=1)


# ---------------------------------------------------------------------------------------- one GPU
def _region(rank, num_bytes):
    return torch.full((num_bytes,), POISON, dtype=torch.uint8, device=torch.device("cuda", rank))


@pytest.fixture(autouse=True)
def _no_transport_env(monkeypatch):
    for name in ("UCCL_SOCKET_IFNAME", REORDER_ENV, "UCCL_EP_TRANSPORT_REORDER_WINDOW",
                 "UCCL_EP_TRANSPORT_REORDER_HOLD_US", "UCCL_EP_TCP_STAGING_BYTES"):
        monkeypatch.delenv(name, raising=False)


def _mesh(regions, **kwargs):
    """Transports of ranks 0..len(regions)-1 over the given tensors on GPU 0, connected from threads."""
    torch.cuda.synchronize()
    transports = [_C.TcpTransport(r, len(regions), t.data_ptr(), t.numel(), device=0, **kwargs)
                  for r, t in enumerate(regions)]
    addresses = [t.listen_address() for t in transports]
    threads = [threading.Thread(target=t.connect, args=(addresses,)) for t in transports]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert all(t.outstanding() == 0 for t in transports)
    return transports


def _rss_bytes():
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS in /proc/self/status")


@pytest.mark.gpu
def test_bad_arguments_name_the_argument():
    size = 4096
    region = _region(0, size)
    host = torch.zeros(size, dtype=torch.uint8)
    construction = [
        (dict(region_ptr=host.data_ptr()), r"region_ptr is host memory, not memory of device=0"),
        (dict(device=gpu_count()), r"device must be in \[0, %d\)" % gpu_count()),
        (dict(device=-1), "device"),
        (dict(staging_bytes=1000), "staging_bytes"),
        (dict(rank=1), "rank"),
        (dict(timeout_s=0.0), "timeout_s"),
        (dict(reorder_seed=-2), "reorder_seed"),
    ]
    if gpu_count() >= 2:
        construction.append((dict(device=1), r"region_ptr is memory of device 0, not memory of device=1"))
    for kwargs, message in construction:
        full = dict(rank=0, num_ranks=1, region_ptr=region.data_ptr(), region_bytes=size, device=0)
        full.update(kwargs)
        with pytest.raises(ValueError, match=message):
            _C.TcpTransport(**full)

    (transport,) = _mesh([region])
    try:
        assert_requests_checked(transport, size)
    finally:
        transport.close()


@pytest.mark.gpu
@pytest.mark.parametrize("reorder_seed", [-1, 3], ids=["in-order", "reorder"])
def test_local_writes_and_atomics(reorder_seed):
    region = _region(0, 1 << 16)
    assert_local_requests(region, lambda: _mesh([region], reorder_seed=reorder_seed)[0])


@pytest.mark.gpu
@pytest.mark.parametrize("reorder_seed", [-1, 5], ids=["in-order", "reorder"])
def test_two_ranks_on_one_gpu(reorder_seed):
    """Two transports in this process, both regions on GPU 0: every write crosses the staging twice (out
    of one region, into the other), 3 MiB writes through a 768 KiB send pool, and adds land exactly."""
    part = 3 << 20
    regions = [_region(0, 3 * part) for _ in range(2)]
    for r, region in enumerate(regions):
        region[2 * part:] = r + 1
        region[part:part + 8 * 2].view(torch.int64).zero_()
    transports = _mesh(regions, reorder_seed=reorder_seed, staging_bytes=STAGING)
    try:
        for t in transports:
            peer = 1 - t.rank
            t.write(peer, 2 * part, 0, part, imm=t.rank)
            for _ in range(50):
                t.atomic_add(peer, part + 8 * t.rank, 2)
        for t in transports:
            t.quiet()
        for r, (t, region) in enumerate(zip(transports, regions)):
            peer = 1 - r
            assert bool((region[:part] == peer + 1).all()), f"rank {r}: the bytes from rank {peer} differ"
            assert region[part + 8 * peer:part + 8 * peer + 8].view(torch.int64).item() == 100
            assert t.poll_immediates() == [(peer, peer)]
            assert len(t.poll_completions()) == 51
    finally:
        for t in transports:
            t.close()


@pytest.mark.gpu
def test_close_leaks_no_threads_fds_or_pinned_memory():
    regions = [_region(0, 1 << 20) for _ in range(2)]

    def use(transports):
        for t in transports:
            for i in range(32):
                t.write(1 - t.rank, 0, 1 << 19, 1 << 18, imm=i)
                t.atomic_add(1 - t.rank, (900 << 10) + 8 * i, 1)
        for t in transports:
            t.quiet()
            assert len(t.poll_completions()) == 64
        for t in transports:   # the peer's immediates: each rank's quiet covers only its own requests
            collect_immediates(t, t.rank, {(1 - t.rank, i) for i in range(32)}, 30.0, lambda src, imm: None)

    # Warm up first: the CUDA runtime and torch may start threads or open files on first use.
    warm = _mesh(regions)
    use(warm)
    for t in warm:
        t.close()
    del warm
    gc.collect()
    before = fds_and_threads()
    rss = _rss_bytes()

    staging = 256 << 20
    for _ in range(8):  # 2 GiB of pinned staging in all: kept, it would show in the resident set
        transports = _mesh(regions, reorder_seed=1, staging_bytes=staging)
        during = settled_fds_and_threads((before[0] + 2 * 3, before[1] + 2))
        assert during == (before[0] + 2 * 3, before[1] + 2), "one I/O thread, a socket, an epoll and an eventfd each"
        use(transports)
        for t in transports:
            t.close()
            t.close()
        assert settled_fds_and_threads(before) == before
    assert _rss_bytes() - rss < staging, "pinned staging stayed allocated after close()"

    # The destructor does the same, connected or not.
    connected = _mesh(regions)
    use(connected)
    unconnected = _C.TcpTransport(0, 1, regions[0].data_ptr(), regions[0].numel(), device=0)
    del connected, unconnected
    gc.collect()
    assert settled_fds_and_threads(before) == before
