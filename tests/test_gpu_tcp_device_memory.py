"""The tcp transport over GPU memory (csrc/transport/tcp_transport.*, tcp_staging.h): writes staged through
pinned host memory between 2 GPUs, larger than the staging; immediates only after their bytes; atomic adds
applied by kernels, exact from both ranks; with and without reorder injection; argument errors, writes
between two transports on one GPU, and close() leaking nothing (threads, fds, pinned memory).

Multi-rank tests run one process per GPU (tests/multiprocess.py, NCCL for bootstrapping); each region is a
uint8 tensor on the rank's GPU, poisoned with a non-zero pattern first, so bytes that never landed (or
landed twice, elsewhere) show.
"""

import gc
import os
import random
import threading
import time

import pytest
import torch

from tests.immediates import collect_immediates
from tests.multiprocess import run_ranks
from tests.process_resources import fds_and_threads, settled_fds_and_threads
from uccl_ep_plugin import _C

FEATURE = "tcp_device_memory"
REORDER_ENV = "UCCL_EP_TRANSPORT_REORDER"

POISON = 0x5A
STAGING = 1 << 20        # the staging of every transport: a 256 KiB receive arena and 768 KiB to send from
SEND_BYTES = 8 << 20     # the source area of every rank's region, at offset 0
SLICE = 32 << 20         # the receive area each source owns in every rank's region
WRITES = 96              # writes per (source, destination), while they fit in the slice
IMM_EVERY = 2            # writes i with i % IMM_EVERY == 0 carry the immediate i
COUNTERS = 8             # int64 counters every rank adds to on every rank
ADDS_PER_COUNTER = 150   # adds per (source, destination, counter)
TIMEOUT_S = 60.0


def _has_feature():
    return FEATURE in _C.build_info()["features"]


def _gpus():
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


needs_feature = pytest.mark.skipif(not _has_feature(), reason=f"the extension was built without {FEATURE}")
needs_one_gpu = pytest.mark.skipif(_gpus() < 1, reason="needs a CUDA GPU")
needs_two_gpus = pytest.mark.skipif(_gpus() < 2, reason="needs 2 CUDA GPUs")


# ---------------------------------------------------------------------------------------- layout and plans
def _layout(num_ranks):
    recv_base = SEND_BYTES
    counter_base = recv_base + num_ranks * SLICE
    total = counter_base + COUNTERS * 8
    return recv_base, counter_base, total


def _source(rank):
    """The bytes rank sends from (its region's first SEND_BYTES), on the CPU."""
    gen = torch.Generator().manual_seed(100 + rank)
    return torch.randint(0, 256, (SEND_BYTES,), dtype=torch.uint8, generator=gen)


def _random_length(rng):
    kind = rng.random()
    if kind < 0.15:
        return 0
    if kind < 0.45:
        return rng.randint(1, 256)
    if kind < 0.8:
        return rng.randint(257, 256 << 10)
    return rng.randint(256 << 10, 3 << 20)


def _plan(src, dst):
    """(local_offset, offset in src's slice at dst, length) of src's writes to dst: random sizes (0 included,
    several times the staging) and unaligned offsets; destinations never overlap, and the gaps between them
    stay poisoned."""
    rng = random.Random(7919 * src + dst + 1)
    writes = []
    cursor = 0
    while len(writes) < WRITES:
        length = _random_length(rng)
        gap = rng.randrange(0, 4096)
        if cursor + gap + length > SLICE:
            break
        cursor += gap
        writes.append((rng.randrange(0, SEND_BYTES - length + 1), cursor, length))
        cursor += length
    return writes


def _expected_slice(source, plan, device):
    expected = torch.full((SLICE,), POISON, dtype=torch.uint8, device=device)
    for local_offset, offset, length in plan:
        expected[offset:offset + length] = source[local_offset:local_offset + length]
    return expected


def _initial_counter(k):
    return 1_000_000_007 * (k + 1)


def _add_value(src, j, k):
    """Positive and negative, some past 32 bits, so a lost carry or sign shows."""
    magnitude = (src + 1) * 7919 + j * 104_729 + k * 31 + ((j % 5) << 33)
    return -magnitude if (src + j + k) % 3 == 0 else magnitude


def _out_of_order(order):
    return any(a > b for a, b in zip(order, order[1:]))


# ---------------------------------------------------------------------------------------- multi-process helpers
def _set_reorder_env(env_seed):
    if env_seed is None:
        os.environ.pop(REORDER_ENV, None)
    else:
        os.environ[REORDER_ENV] = str(env_seed)


def _region(rank, num_bytes):
    return torch.full((num_bytes,), POISON, dtype=torch.uint8, device=torch.device("cuda", rank))


def _connect(rank, num_ranks, group, region, reorder_seed):
    import torch.distributed as dist

    torch.cuda.synchronize()  # the region is prepared before any peer can write to it
    transport = _C.TcpTransport(rank, num_ranks, region.data_ptr(), region.numel(), reorder_seed=reorder_seed,
                                timeout_s=TIMEOUT_S, device=rank, staging_bytes=STAGING)
    assert transport.staging_bytes == STAGING and not transport.region_is_host_memory
    addresses = [None] * num_ranks
    dist.all_gather_object(addresses, transport.listen_address(), group=group)
    transport.connect(addresses)
    return transport


def _finish(transport, group):
    import torch.distributed as dist

    dist.barrier(group=group)
    transport.close()
    dist.barrier(group=group)  # no peer writes into a region that is going away


def _sum_over_ranks(value, group):
    import torch.distributed as dist

    total = torch.tensor([value], dtype=torch.int64, device="cuda")
    dist.all_reduce(total, group=group)
    return total.item()


# ---------------------------------------------------------------------------------------- writes and immediates
def _exchange_body(rank, num_ranks, group, reorder_seed, env_seed):
    import torch.distributed as dist

    _set_reorder_env(env_seed)
    recv_base, _, total = _layout(num_ranks)
    region = _region(rank, total)
    region[:SEND_BYTES] = _source(rank).cuda()
    transport = _connect(rank, num_ranks, group, region, reorder_seed)
    expect_reorder = reorder_seed >= 0 or env_seed is not None
    assert (transport.reorder_seed is not None) == expect_reorder

    sources = {src: _source(src).cuda() for src in range(num_ranks)}
    outgoing = {dst: _plan(rank, dst) for dst in range(num_ranks)}
    incoming = {src: _plan(src, rank) for src in range(num_ranks)}
    assert any(length > STAGING for plan in outgoing.values() for _, _, length in plan), "no write outgrows the staging"

    # Post every write, peers interleaved (ourselves included: a local copy).
    posted = []
    data_only = {dst: [] for dst in range(num_ranks)}  # ids of writes without an immediate, in posting order
    for i in range(max(len(plan) for plan in outgoing.values())):
        for step in range(num_ranks):
            dst = (rank + step) % num_ranks
            if i >= len(outgoing[dst]):
                continue
            local_offset, offset, length = outgoing[dst][i]
            imm = i if i % IMM_EVERY == 0 else None
            request = transport.write(dst, local_offset, recv_base + rank * SLICE + offset, length, imm=imm)
            posted.append(request)
            if imm is None:
                data_only[dst].append(request)

    # Immediates: each exactly once, each after its bytes (checked the moment it is seen).
    wanted = {(src, i) for src in range(num_ranks) for i in range(0, len(incoming[src]), IMM_EVERY)}
    got = set()
    seen = {src: [] for src in range(num_ranks)}  # immediates per source, in arrival order
    completed = []
    deadline = time.monotonic() + TIMEOUT_S
    while got != wanted:
        assert time.monotonic() < deadline, f"rank {rank}: immediates missing: {sorted(wanted - got)[:10]}"
        completed += transport.poll_completions()
        events = transport.poll_immediates()
        if not events:
            time.sleep(0.0005)
        for src, imm in events:
            assert (src, imm) in wanted, f"rank {rank}: unexpected immediate {(src, imm)}"
            assert (src, imm) not in got, f"rank {rank}: immediate {(src, imm)} delivered twice"
            got.add((src, imm))
            seen[src].append(imm)
            local_offset, offset, length = incoming[src][imm]
            start = recv_base + src * SLICE + offset
            assert torch.equal(region[start:start + length], sources[src][local_offset:local_offset + length]), \
                f"rank {rank}: immediate {imm} from {src} arrived before its {length} bytes"

    transport.quiet()
    assert transport.outstanding() == 0
    completed += transport.poll_completions()
    assert sorted(completed) == sorted(posted), f"rank {rank}: completions differ from the posted ids"
    dist.barrier(group=group)

    for src in range(num_ranks):
        landed = region[recv_base + src * SLICE: recv_base + (src + 1) * SLICE]
        assert torch.equal(landed, _expected_slice(sources[src], incoming[src], region.device)), \
            f"rank {rank}: the slice of rank {src} differs (missing, misplaced or stray bytes)"
    assert torch.equal(region[:SEND_BYTES], sources[rank]), f"rank {rank}: its source area changed"
    assert transport.poll_immediates() == [], f"rank {rank}: extra immediates"
    assert transport.rejected_requests() == 0

    # Order: FIFO per peer without reorder injection (one connection per peer; local copies complete as
    # they are posted); with it, both the writes (completions of those without an immediate) and the
    # immediates are shuffled somewhere.
    position = {request: n for n, request in enumerate(completed)}
    writes_shuffled = sum(_out_of_order([position[r] for r in ids]) for ids in data_only.values())
    imms_shuffled = sum(_out_of_order(imms) for imms in seen.values())
    if not expect_reorder:
        assert writes_shuffled == 0, f"rank {rank}: writes completed out of order without reorder injection"
        assert imms_shuffled == 0, f"rank {rank}: immediates out of order without reorder injection: {seen}"
    writes_shuffled = _sum_over_ranks(writes_shuffled, group)
    imms_shuffled = _sum_over_ranks(imms_shuffled, group)
    if expect_reorder:
        assert writes_shuffled > 0, "reorder injection did not reorder the writes to any peer"
        assert imms_shuffled > 0, "reorder injection did not reorder the immediates from any peer"

    _finish(transport, group)


@pytest.mark.gpu
@needs_feature
@needs_two_gpus
@pytest.mark.parametrize("reorder_seed,env_seed", [(-1, None), (12345, None), (-1, 99)],
                         ids=["in-order", "reorder", "reorder-env"])
def test_writes_and_immediates(reorder_seed, env_seed):
    run_ranks(2, _exchange_body, backend="nccl", reorder_seed=reorder_seed, env_seed=env_seed)


# ---------------------------------------------------------------------------------------- atomics
def _atomics_body(rank, num_ranks, group, reorder_seed):
    import torch.distributed as dist

    _set_reorder_env(None)
    _, counter_base, total = _layout(num_ranks)
    region = _region(rank, total)
    counters = region[counter_base:counter_base + 8 * COUNTERS].view(torch.int64)
    counters.copy_(torch.tensor([_initial_counter(k) for k in range(COUNTERS)], dtype=torch.int64))
    transport = _connect(rank, num_ranks, group, region, reorder_seed)

    posted = []
    for j in range(ADDS_PER_COUNTER):
        for step in range(num_ranks):
            dst = (rank + step) % num_ranks
            for k in range(COUNTERS):
                posted.append(transport.atomic_add(dst, counter_base + 8 * k, _add_value(rank, j, k)))
    transport.quiet()
    assert transport.outstanding() == 0
    assert sorted(transport.poll_completions()) == sorted(posted)
    dist.barrier(group=group)

    for k, value in enumerate(counters.tolist()):
        want = _initial_counter(k) + sum(_add_value(src, j, k) for src in range(num_ranks)
                                         for j in range(ADDS_PER_COUNTER))
        assert value == want, f"rank {rank}: counter {k} is {value}, expected {want}"
    _finish(transport, group)


@pytest.mark.gpu
@needs_feature
@needs_two_gpus
@pytest.mark.parametrize("reorder_seed", [-1, 7], ids=["in-order", "reorder"])
def test_atomics_from_both_ranks(reorder_seed):
    run_ranks(2, _atomics_body, backend="nccl", reorder_seed=reorder_seed)


# ---------------------------------------------------------------------------------------- one GPU
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
@needs_feature
@needs_one_gpu
def test_bad_arguments_name_the_argument():
    size = 4096
    region = _region(0, size)
    host = torch.zeros(size, dtype=torch.uint8)
    construction = [
        (dict(region_ptr=host.data_ptr()), r"region_ptr is host memory, not memory of device=0"),
        (dict(device=_gpus()), r"device must be in \[0, %d\)" % _gpus()),
        (dict(device=-1), "device"),
        (dict(staging_bytes=1000), "staging_bytes"),
        (dict(rank=1), "rank"),
        (dict(timeout_s=0.0), "timeout_s"),
        (dict(reorder_seed=-2), "reorder_seed"),
    ]
    if _gpus() >= 2:
        construction.append((dict(device=1), r"region_ptr is memory of device 0, not memory of device=1"))
    for kwargs, message in construction:
        full = dict(rank=0, num_ranks=1, region_ptr=region.data_ptr(), region_bytes=size, device=0)
        full.update(kwargs)
        with pytest.raises(ValueError, match=message):
            _C.TcpTransport(**full)

    (transport,) = _mesh([region])
    try:
        cases = [
            (lambda: transport.write(1, 0, 0, 8), "peer"),
            (lambda: transport.write(-1, 0, 0, 8), "peer"),
            (lambda: transport.write(0, size + 8, 0, 8), "local_offset"),
            (lambda: transport.write(0, size - 4, 0, 8), "local_offset"),
            (lambda: transport.write(0, 0, size + 8, 8), "remote_offset"),
            (lambda: transport.write(0, 0, size - 4, 8), "remote_offset"),
            (lambda: transport.write(0, -1, 0, 8), "local_offset"),
            (lambda: transport.write(0, 0, -8, 8), "remote_offset"),
            (lambda: transport.write(0, 0, 0, -1), "length"),
            (lambda: transport.write(0, 0, 0, 8, imm=1 << 32), "imm"),
            (lambda: transport.atomic_add(1, 8, 1), "peer"),
            (lambda: transport.atomic_add(0, 12, 1), "remote_offset"),
            (lambda: transport.atomic_add(0, size, 1), "remote_offset"),
            (lambda: transport.atomic_add(0, -8, 1), "remote_offset"),
        ]
        for call, name in cases:
            with pytest.raises(ValueError, match=name):
                call()
        assert transport.outstanding() == 0
        transport.write(0, 0, size - 8, 8)
        transport.atomic_add(0, size - 8, 3)
        transport.quiet()
        assert len(transport.poll_completions()) == 2
    finally:
        transport.close()


@pytest.mark.gpu
@needs_feature
@needs_one_gpu
@pytest.mark.parametrize("reorder_seed", [-1, 3], ids=["in-order", "reorder"])
def test_local_writes_and_atomics(reorder_seed):
    region = _region(0, 1 << 16)
    region[:1000] = torch.arange(1000, dtype=torch.int64, device=region.device).remainder(251).to(torch.uint8)
    counter = region[8192:8200].view(torch.int64)
    counter.fill_(_initial_counter(0))
    (transport,) = _mesh([region], reorder_seed=reorder_seed)
    ids = [transport.write(0, 0, 4096, 1000, imm=9), transport.atomic_add(0, 8192, -7),
           transport.atomic_add(0, 8192, -7), transport.write(0, 0, 0, 0, imm=10), transport.write(0, 1, 6001, 999)]
    transport.quiet()
    assert sorted(transport.poll_completions()) == ids
    assert sorted(transport.poll_immediates()) == [(0, 9), (0, 10)]
    assert torch.equal(region[4096:5096], region[:1000])
    assert torch.equal(region[6001:7000], region[1:1000])
    assert region[5096:6001].eq(POISON).all() and region[7000:8192].eq(POISON).all()
    assert counter.item() == _initial_counter(0) - 14
    transport.close()
    transport.close()  # idempotent
    with pytest.raises(RuntimeError, match="after close"):
        transport.write(0, 0, 0, 8)
    with pytest.raises(RuntimeError, match="after close"):
        transport.quiet()


@pytest.mark.gpu
@needs_feature
@needs_one_gpu
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
@needs_feature
@needs_one_gpu
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
