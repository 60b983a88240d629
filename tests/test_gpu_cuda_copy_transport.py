"""The cuda-copy transport (csrc/transport/cuda_copy_transport.*): copy engine writes between the CUDA IPC
mapped buffers of 2 GPUs, system-scope atomic adds, immediates and acknowledgements over a tcp control
transport, with and without reorder injection; argument errors, close() and leaks on one GPU.

Multi-rank tests run one process per GPU (tests/multiprocess.py, NCCL for bootstrapping: the buffers are
mapped with uccl_ep_plugin.engines.native.peers.map_peer_buffer, the addresses all-gathered). Every region
is poisoned with a non-zero pattern first, so bytes that never landed (or landed twice, elsewhere) show.
"""

import gc
import os
import random

import pytest
import torch

from tests.immediates import collect_immediates
from tests.multiprocess import run_ranks
from tests.process_resources import fds_and_threads, settled_fds_and_threads
from uccl_ep_plugin import _C

FEATURE = "cuda_copy_transport"
REORDER_ENV = "UCCL_EP_TRANSPORT_REORDER"

POISON = 0x5A
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
    """(local_offset, offset in src's slice at dst, length) of src's writes to dst: random sizes (0 included)
    and unaligned offsets; destinations never overlap, and the gaps between them stay poisoned."""
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


def _map(rank, group, num_bytes):
    """Every rank's buffer mapped into every rank (CUDA IPC), this rank's poisoned."""
    from uccl_ep_plugin.engines.native.peers import map_peer_buffer

    buffer, reason = map_peer_buffer(_C, group, rank, torch.device("cuda", rank), num_bytes)
    assert buffer is not None, reason
    buffer.tensor.fill_(POISON)
    return buffer


def _connect(rank, num_ranks, group, buffer, reorder_seed):
    import torch.distributed as dist

    torch.cuda.synchronize()  # the region is prepared before any peer can write to it
    transport = _C.CudaCopyTransport(rank, num_ranks, buffer.memory, reorder_seed=reorder_seed, timeout_s=TIMEOUT_S)
    addresses = [None] * num_ranks
    dist.all_gather_object(addresses, transport.listen_address(), group=group)
    transport.connect(addresses)
    return transport


def _finish(transport, buffer, group):
    import torch.distributed as dist

    dist.barrier(group=group)
    transport.close()
    dist.barrier(group=group)  # no peer copies into a buffer that is going away
    buffer.release()


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
    buffer = _map(rank, group, total)
    region = buffer.tensor
    region[:SEND_BYTES] = _source(rank).cuda()
    transport = _connect(rank, num_ranks, group, buffer, reorder_seed)
    expect_reorder = reorder_seed >= 0 or env_seed is not None
    assert (transport.reorder_seed is not None) == expect_reorder

    sources = {src: _source(src).cuda() for src in range(num_ranks)}
    outgoing = {dst: _plan(rank, dst) for dst in range(num_ranks)}
    incoming = {src: _plan(src, rank) for src in range(num_ranks)}

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
    completed = []

    def bytes_landed(src, imm):
        local_offset, offset, length = incoming[src][imm]
        start = recv_base + src * SLICE + offset
        assert torch.equal(region[start:start + length], sources[src][local_offset:local_offset + length]), \
            f"rank {rank}: immediate {imm} from {src} arrived before its {length} bytes"

    seen = collect_immediates(transport, rank, wanted, TIMEOUT_S, bytes_landed,
                              while_waiting=lambda: completed.extend(transport.poll_completions()))

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

    # Order: FIFO per peer without reorder injection; with it, both the copies (completions of writes
    # without an immediate) and the immediates are shuffled somewhere.
    position = {request: n for n, request in enumerate(completed)}
    copies_shuffled = sum(_out_of_order([position[r] for r in ids]) for ids in data_only.values())
    imms_shuffled = sum(_out_of_order(imms) for imms in seen.values())
    if not expect_reorder:
        assert copies_shuffled == 0, f"rank {rank}: copies completed out of order without reorder injection"
        assert imms_shuffled == 0, f"rank {rank}: immediates out of order without reorder injection: {seen}"
    copies_shuffled = _sum_over_ranks(copies_shuffled, group)
    imms_shuffled = _sum_over_ranks(imms_shuffled, group)
    if expect_reorder:
        assert copies_shuffled > 0, "reorder injection did not reorder the copies to any peer"
        assert imms_shuffled > 0, "reorder injection did not reorder the immediates from any peer"

    _finish(transport, buffer, group)


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
    buffer = _map(rank, group, total)
    counters = buffer.tensor[counter_base:counter_base + 8 * COUNTERS].view(torch.int64)
    counters.copy_(torch.tensor([_initial_counter(k) for k in range(COUNTERS)], dtype=torch.int64))
    transport = _connect(rank, num_ranks, group, buffer, reorder_seed)

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
    _finish(transport, buffer, group)


@pytest.mark.gpu
@needs_feature
@needs_two_gpus
@pytest.mark.parametrize("reorder_seed", [-1, 7], ids=["in-order", "reorder"])
def test_atomics_from_both_ranks(reorder_seed):
    run_ranks(2, _atomics_body, backend="nccl", reorder_seed=reorder_seed)


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
@needs_feature
@needs_one_gpu
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
@needs_feature
@needs_one_gpu
@pytest.mark.parametrize("reorder_seed", [-1, 3], ids=["in-order", "reorder"])
def test_local_writes_and_atomics(reorder_seed):
    memory, region = _local_memory(1 << 16)
    region[:1000] = torch.arange(1000, dtype=torch.int64, device=region.device).remainder(251).to(torch.uint8)
    counter = region[8192:8200].view(torch.int64)
    counter.fill_(_initial_counter(0))
    torch.cuda.synchronize()
    transport = _local_transport(memory, reorder_seed=reorder_seed)
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
    memory.release()


@pytest.mark.gpu
@needs_feature
@needs_one_gpu
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
