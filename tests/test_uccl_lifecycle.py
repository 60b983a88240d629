"""initialize_uccl / destroy_uccl (UCCL-EP's proxy lifecycle) between CPU processes: the proxies they
start move bytes between the ranks' scratch buffers, stop without leaking, and reject bad arguments."""

import os
import time
import warnings

import pytest
import torch

from tests.multiprocess import run_ranks
from tests.process_resources import fds_and_threads, settled_fds_and_threads
from tests.transport_exchange import rdma_devices, skip_without
from uccl_ep_plugin import _C, destroy_uccl, initialize_uccl, notices
from uccl_ep_plugin.proxies import MODULE_LOADING_ENV, _warn_lazy_loading, proxy_cpus

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


def _assert_nothing_left(before, what: str) -> None:
    """No more descriptors or threads than ``before`` (fewer is possible: a forked rank may close descriptors it
    inherited)."""
    after = settled_fds_and_threads(before)
    assert after[0] <= before[0] and after[1] <= before[1], \
        f"{what} left a thread or descriptor behind: (fds, threads) {before} before, {after} after"


def _exchange_body(rank: int, num_ranks: int, group, transport: str) -> None:
    import torch.distributed as dist
    os.environ["UCCL_EP_PROXY_TRANSPORT"] = transport
    if transport == "verbs":   # rank r on the r-th RDMA device (round robin)
        devices = rdma_devices()
        os.environ["UCCL_IB_HCA"] = devices[rank % len(devices)]
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
        assert stats["quiets_on_gpu"] == 0, stats    # host memory: the thread waited
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
        _assert_nothing_left(before, "destroy_uccl")


@pytest.mark.parametrize("transport", ["tcp", "verbs"])
def test_initialize_uccl_moves_bytes_and_destroy_uccl_leaks_nothing(transport):
    """Over tcp, and over verbs where RDMA devices exist (tests/soft_roce runs it in its guest)."""
    if transport == "verbs":
        skip_without("verbs", 0)
    run_ranks(2, _exchange_body, transport=transport)


def _one_rank_fails_body(rank: int, num_ranks: int, group, transport: str) -> None:
    """The last rank cannot start its proxy (tcp: an interface that does not exist; verbs: a GID index past the
    table): it raises its own error, every other rank an error naming it, and nobody waits for anybody."""
    import torch.distributed as dist
    os.environ["UCCL_EP_PROXY_TRANSPORT"] = transport
    failing = rank == num_ranks - 1
    if transport == "verbs":
        os.environ["UCCL_IB_HCA"] = rdma_devices()[rank % len(rdma_devices())]
        if failing:
            os.environ["UCCL_IB_GID_INDEX"] = "4000"
    elif failing:
        os.environ["UCCL_SOCKET_IFNAME"] = "nosuchif9"
    own = "GID index 4000" if transport == "verbs" else "nosuchif9"
    before = fds_and_threads()
    scratch = torch.zeros(SCRATCH, dtype=torch.uint8)
    started = time.monotonic()
    with pytest.raises(RuntimeError) as raised:
        initialize_uccl(scratch, SCRATCH, rank, num_ranks, group)
    message = str(raised.value)
    if failing:
        assert own in message, message
    else:
        assert f"rank {num_ranks - 1}: " in message and own in message and "could not start" in message, message
    assert time.monotonic() - started < 20, "a rank waited for the one that failed"
    _assert_nothing_left(before, "a proxy that could not start")
    dist.barrier(group=group)
    os.environ.pop("UCCL_SOCKET_IFNAME", None)
    os.environ.pop("UCCL_IB_GID_INDEX", None)
    proxies, workers = initialize_uccl(scratch, SCRATCH, rank, num_ranks, group)   # nothing was left registered
    destroy_uccl(proxies, workers)


@pytest.mark.parametrize("transport", ["tcp", "verbs"])
@pytest.mark.parametrize("num_ranks", [2, 3])
def test_a_rank_whose_proxy_cannot_start_fails_every_rank(transport, num_ranks):
    if transport == "verbs":
        skip_without("verbs", 0)
    run_ranks(num_ranks, _one_rank_fails_body, transport=transport)


def _drain_body(rank: int, num_ranks: int, group) -> None:
    import torch.distributed as dist
    os.environ["UCCL_EP_TRANSPORT_REORDER"] = "3"          # the window holds the writes ...
    os.environ["UCCL_EP_TRANSPORT_REORDER_HOLD_US"] = "300000"   # ... for 300 ms
    scratch = torch.full((SCRATCH,), 0xEE, dtype=torch.uint8)
    scratch[:SLICE] = _pattern(rank)
    proxies, workers = initialize_uccl(scratch, SCRATCH, rank, num_ranks, group, num_experts=8 * num_ranks)
    threads = proxies[0]
    assert threads.proxy.idle, "a proxy that was given nothing is idle"
    peer = 1 - rank
    threads.fifos[0].push(_C.HostFifo.WRITE, peer, length_bytes=SLICE, local_offset=0, remote_offset=(1 + rank) * SLICE)
    _wait(lambda: threads.proxy.transport_outstanding == 1, "the write to be posted")
    assert not threads.proxy.idle, "a write held by the transport must keep the proxy busy"
    started = time.monotonic()
    threads.drain(timeout_s=10.0)
    assert threads.proxy.idle and time.monotonic() - started > 0.1, "drain returned before the held write completed"
    dist.barrier(group=group)
    assert torch.equal(scratch[(1 + peer) * SLICE:(2 + peer) * SLICE], _pattern(peer)), "the peer's write did not land"
    dist.barrier(group=group)
    destroy_uccl(proxies, workers)


def test_drain_waits_for_every_pushed_write():
    """ProxyThreads.drain (what Buffer.destroy runs before its barrier) returns only once the writes pushed so far
    completed, here held 300 ms by reorder injection."""
    run_ranks(2, _drain_body)


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


# ---------------------------------------------------------------------------------------- CPU affinity
@pytest.mark.parametrize("text,rank0,rank1", [("", [], []), ("0-3,8", [0, 1, 2, 3, 8], [0, 1, 2, 3, 8]),
                                              ("0-1;2-3", [0, 1], [2, 3]), (" 5 ;6", [5], [6]), ("2-2", [2], [2])])
def test_proxy_cpus_reads_one_list_or_one_per_local_rank(monkeypatch, text, rank0, rank1):
    monkeypatch.setenv("UCCL_EP_PROXY_CPUS", text)
    assert proxy_cpus(0) == rank0 and proxy_cpus(1) == rank1
    if ";" in text:
        assert proxy_cpus(2) == rank0, "more ranks than lists: the lists repeat"


@pytest.mark.parametrize("text", ["3-1", "a", "1-2-3", "0,,1", "-1"])
def test_proxy_cpus_names_the_setting_when_malformed(monkeypatch, text):
    monkeypatch.setenv("UCCL_EP_PROXY_CPUS", text)
    with pytest.raises(ValueError, match="UCCL_EP_PROXY_CPUS"):
        proxy_cpus(0)


# ---------------------------------------------------------------------------------------- module loading
@pytest.mark.parametrize("setting,warns", [(None, True), ("LAZY", True), ("EAGER", False), (" eager", False)])
def test_stand_in_transports_warn_unless_kernels_load_eagerly(monkeypatch, setting, warns):
    monkeypatch.setattr(notices, "_given", set())   # each case as in a fresh process (the warning is given once)
    if setting is None:
        monkeypatch.delenv(MODULE_LOADING_ENV, raising=False)
    else:
        monkeypatch.setenv(MODULE_LOADING_ENV, setting)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _warn_lazy_loading("tcp")
    messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert bool(messages) == warns
    if warns:
        assert "tcp" in messages[0] and f"{MODULE_LOADING_ENV}=EAGER" in messages[0]


def _proxy_threads_cpus():
    """{thread name: its allowed CPU list} of this process's proxy threads."""
    found = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as comm:
                name = comm.read().strip()
            if not name.startswith("uccl-ep-proxy"):
                continue
            with open(f"/proc/self/task/{tid}/status") as status:
                allowed = next(line.split(":", 1)[1].strip() for line in status if line.startswith("Cpus_allowed_list"))
        except (OSError, StopIteration):
            continue     # a thread that exited meanwhile
        found[name] = allowed
    return found


def _affinity_body(rank: int, num_ranks: int, group) -> None:
    import torch.distributed as dist
    os.environ["UCCL_EP_PROXY_CPUS"] = "0;1"      # rank 0 on CPU 0, rank 1 on CPU 1
    os.environ["UCCL_EP_PROXY_THREADS"] = "2"
    scratch = torch.zeros(SCRATCH, dtype=torch.uint8)
    proxies, workers = initialize_uccl(scratch, SCRATCH, rank, num_ranks, group)
    try:
        _wait(lambda: len(_proxy_threads_cpus()) == 2, "both proxy threads to start")
        assert _proxy_threads_cpus() == {"uccl-ep-proxy0": str(rank), "uccl-ep-proxy1": str(rank)}
    finally:
        dist.barrier(group=group)
        destroy_uccl(proxies, workers)
    os.environ["UCCL_EP_PROXY_CPUS"] = "100000"
    with pytest.raises(ValueError, match="not a CPU this process may run on"):
        initialize_uccl(scratch, SCRATCH, rank, num_ranks, group)


@pytest.mark.skipif(not {0, 1} <= os.sched_getaffinity(0), reason="needs CPUs 0 and 1")
def test_proxy_threads_run_on_the_cpus_of_their_rank():
    run_ranks(2, _affinity_body)


def test_quiet_on_gpu_setting(monkeypatch):
    from uccl_ep_plugin.proxies import QUIET_ON_GPU_ENV, _flag_setting
    assert _C.ProxyConfig().quiet_on_gpu is True
    monkeypatch.delenv(QUIET_ON_GPU_ENV, raising=False)
    assert _flag_setting(QUIET_ON_GPU_ENV, True) is True
    for text, expected in (("0", False), ("off", False), ("1", True), (" Yes ", True)):
        monkeypatch.setenv(QUIET_ON_GPU_ENV, text)
        assert _flag_setting(QUIET_ON_GPU_ENV, True) is expected
    monkeypatch.setenv(QUIET_ON_GPU_ENV, "maybe")
    with pytest.raises(ValueError, match="UCCL_EP_PROXY_QUIET_ON_GPU='maybe'"):
        _flag_setting(QUIET_ON_GPU_ENV, True)


def test_ranks_must_send_counter_adds_the_same_way():
    from uccl_ep_plugin.proxies import _require_same_counter_adds
    _require_same_counter_adds(0, [True, True])
    _require_same_counter_adds(1, [False, False, False])
    with pytest.raises(ValueError, match=r"rank 2: ranks \[0, 2\] would send .* ranks \[1\] as immediates"):
        _require_same_counter_adds(2, [True, False, True])


def _refused_start_body(rank: int, num_ranks: int, group, envs, error, match) -> None:
    """initialize_uccl with ``envs[rank]`` set raises ``error`` matching ``match`` and leaves nothing behind."""
    os.environ.update(envs[rank])
    before = fds_and_threads()
    scratch = torch.zeros(SCRATCH, dtype=torch.uint8)
    with pytest.raises(error, match=match):
        initialize_uccl(scratch, SCRATCH, rank, num_ranks, group)
    _assert_nothing_left(before, "the refused start")


def test_verbs_ranks_that_disagree_on_native_atomics_are_refused():
    """Over verbs (soft-RoCE in tests/soft_roce's guest) a rank with UCCL_IB_NATIVE_ATOMICS=0 beside one with 1: every
    rank raises before any request, and nothing is left behind."""
    skip_without("verbs", 0)
    devices = rdma_devices()
    envs = [{"UCCL_EP_PROXY_TRANSPORT": "verbs", "UCCL_IB_HCA": devices[rank % len(devices)],
             "UCCL_IB_NATIVE_ATOMICS": "1" if rank == 0 else "0"} for rank in range(2)]
    run_ranks(2, _refused_start_body, envs=envs, error=ValueError,
              match="every rank must use the same UCCL_IB_NATIVE_ATOMICS")


def test_verbs_without_an_rdma_device_says_what_to_do():
    """UCCL_EP_PROXY_TRANSPORT=verbs on a host without RDMA devices: each rank raises naming the alternative, before
    any exchange, and leaves nothing behind."""
    if "verbs_transport" not in _C.build_info()["features"]:
        pytest.skip("the extension was built without the verbs transport")
    if rdma_devices():
        pytest.skip("this host has RDMA devices")
    run_ranks(2, _refused_start_body, envs=[{"UCCL_EP_PROXY_TRANSPORT": "verbs"}] * 2, error=RuntimeError,
              match="no RDMA device found.*UCCL_EP_PROXY_TRANSPORT=tcp")
