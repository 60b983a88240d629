"""The exchange the transports are tested with (cuda-copy and tcp over GPU memory on 2 GPUs; tcp over host
memory between CPU processes, which runs the same checks in CI): every rank writes random-sized, unaligned pieces of its source area into its slice of every rank's region (itself
included), some with immediates, and adds signed 64-bit values to every rank's counters; then each rank
checks its region byte for byte, each immediate against its bytes, the completions and the ordering.
assert_requests_checked is the one-rank check of bad request arguments both transports share.

Every region is poisoned first (POISON), so bytes that never landed, or landed elsewhere, show. Bodies run
one process per rank (tests/multiprocess.py: NCCL for the GPU kinds, gloo for tcp-host); ``kind`` names the
transport and memory: "cuda-copy" (regions mapped with CUDA IPC), "tcp" (a tensor on the GPU, staged through
pinned host memory) or "tcp-host" (a tensor in host memory).
"""

import os
import random

import pytest
import torch

from tests.immediates import collect_immediates
from tests.multiprocess import has_gpus_for, rank_device
from uccl_ep_plugin import _C
from uccl_ep_plugin.platform_config.detect import detect_rdma_devices

REORDER_ENV = "UCCL_EP_TRANSPORT_REORDER"
POISON = 0x5A
# Divides the sizes below: the soft-RoCE guest (a software-emulated CPU) runs the same exchange smaller.
SCALE = int(os.environ.get("UCCL_EP_TEST_TRANSPORT_SCALE", "1"))
STAGING = 1 << 20        # tcp's staging: a 256 KiB receive arena and 768 KiB to send from
SEND_BYTES = (8 << 20) // SCALE    # the source area of every rank's region, at offset 0
SLICE = (32 << 20) // SCALE        # the receive area each source owns in every rank's region
WRITES = 96              # writes per (source, destination), while they fit in the slice
IMM_EVERY = 2            # writes i with i % IMM_EVERY == 0 carry the immediate i
COUNTERS = 8             # int64 counters every rank adds to on every rank
ADDS_PER_COUNTER = 150   # adds per (source, destination, counter)
TIMEOUT_S = 60.0
GPU_KINDS = ("cuda-copy", "tcp")
FEATURES = {"cuda-copy": "cuda_copy_transport", "tcp": "tcp_device_memory", "tcp-host": "tcp_transport",
            "verbs": "verbs_transport"}
VERBS_DEVICES_ENV = "UCCL_EP_TEST_VERBS_DEVICES"   # comma-separated: rank r uses entry r % count


def rdma_devices():
    """The RDMA devices the verbs kind uses, from VERBS_DEVICES_ENV, else every device of this host."""
    named = [d for d in os.environ.get(VERBS_DEVICES_ENV, "").split(",") if d]
    return named or [name for name, _ in detect_rdma_devices()]


def skip_without(kind, gpus):
    """Skip unless the extension has transport ``kind`` and ``gpus`` GPUs are visible (or any GPU, where ranks may
    share one); the verbs kind needs an RDMA device (tests/soft_roce/guest.sh makes two)."""
    if FEATURES[kind] not in _C.build_info()["features"]:
        pytest.skip(f"the extension was built without {FEATURES[kind]}")
    if kind == "verbs" and not rdma_devices():
        pytest.skip("no RDMA device here (tests/soft_roce/guest.sh runs the tests with two soft-RoCE devices)")
    if not has_gpus_for(gpus):
        pytest.skip(f"needs {gpus} CUDA GPU(s)")


# ---------------------------------------------------------------------------------------- layout and plans
def layout(num_ranks):
    recv_base = SEND_BYTES
    counter_base = recv_base + num_ranks * SLICE
    total = counter_base + COUNTERS * 8
    return recv_base, counter_base, total


def source(rank):
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
        return rng.randint(257, (256 << 10) // SCALE)
    return rng.randint((256 << 10) // SCALE, (3 << 20) // SCALE)


def plan(src, dst):
    """(local_offset, offset in src's slice at dst, length) of src's writes to dst: random sizes (0 included,
    several times tcp's staging) and unaligned offsets; destinations never overlap, and the gaps between them
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


def settle(region):
    """Waits for torch's stores into a GPU region: the transports copy on streams of their own."""
    if region.is_cuda:
        torch.cuda.synchronize(region.device)


def _expected_slice(source_bytes, writes, device):
    expected = torch.full((SLICE,), POISON, dtype=torch.uint8, device=device)
    for local_offset, offset, length in writes:
        expected[offset:offset + length] = source_bytes[local_offset:local_offset + length]
    return expected


def initial_counter(k):
    return 1_000_000_007 * (k + 1)


def _add_value(src, j, k):
    """Positive and negative, some past 32 bits, so a lost carry or sign shows."""
    magnitude = (src + 1) * 7919 + j * 104_729 + k * 31 + ((j % 5) << 33)
    return -magnitude if (src + j + k) % 3 == 0 else magnitude


def _out_of_order(order):
    return any(a > b for a, b in zip(order, order[1:]))


# ---------------------------------------------------------------------------------------- transports
def assert_requests_checked(transport, size):
    """A transport of one rank, connected, over a region of ``size`` bytes: every bad request argument is
    refused with a ValueError naming it, before anything is posted; good ones then complete."""
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


def assert_local_requests(region, open_transport):
    """Writes (with immediates, one empty) and atomic adds of a one-rank transport to its own ``region``
    (poisoned, 64 KiB): each lands where it should and nowhere else; close() is idempotent and later
    requests are refused. ``open_transport()`` returns the transport, connected, once the region is ready."""
    region[:1000] = torch.arange(1000, dtype=torch.int64, device=region.device).remainder(251).to(torch.uint8)
    counter = region[8192:8200].view(torch.int64)
    counter.fill_(initial_counter(0))
    settle(region)
    transport = open_transport()
    ids = [transport.write(0, 0, 4096, 1000, imm=9), transport.atomic_add(0, 8192, -7),
           transport.atomic_add(0, 8192, -7), transport.write(0, 0, 0, 0, imm=10), transport.write(0, 1, 6001, 999)]
    transport.quiet()
    assert sorted(transport.poll_completions()) == ids
    assert sorted(transport.poll_immediates()) == [(0, 9), (0, 10)]
    assert torch.equal(region[4096:5096], region[:1000])
    assert torch.equal(region[6001:7000], region[1:1000])
    assert region[5096:6001].eq(POISON).all() and region[7000:8192].eq(POISON).all()
    assert counter.item() == initial_counter(0) - 14
    transport.close()
    transport.close()  # idempotent
    with pytest.raises(RuntimeError, match="after close"):
        transport.write(0, 0, 0, 8)
    with pytest.raises(RuntimeError, match="after close"):
        transport.quiet()


def _set_reorder_env(env_seed):
    if env_seed is None:
        os.environ.pop(REORDER_ENV, None)
    else:
        os.environ[REORDER_ENV] = str(env_seed)


class _Endpoint:
    """This rank's poisoned region and its transport of ``kind``, connected to every rank's."""

    def __init__(self, kind, rank, num_ranks, group, num_bytes, reorder_seed):
        import torch.distributed as dist

        self.kind, self.group, self.buffer = kind, group, None
        if kind == "tcp-host":
            self.region = torch.full((num_bytes,), POISON, dtype=torch.uint8)
            self.transport = _C.TcpTransport(rank, num_ranks, self.region.data_ptr(), self.region.numel(),
                                             reorder_seed=reorder_seed, timeout_s=TIMEOUT_S)
        elif kind == "verbs":
            devices = rdma_devices()
            self.region = torch.full((num_bytes,), POISON, dtype=torch.uint8)
            self.transport = _C.VerbsTransport(rank, num_ranks, self.region.data_ptr(), self.region.numel(),
                                               device=devices[rank % len(devices)], reorder_seed=reorder_seed,
                                               timeout_s=TIMEOUT_S)
        elif kind == "cuda-copy":
            from uccl_ep_plugin.engines.native.peers import map_peer_buffer

            self.buffer, reason = map_peer_buffer(_C, group, rank, rank_device(rank), num_bytes)
            assert self.buffer is not None, reason
            self.region = self.buffer.tensor
            self.region.fill_(POISON)
            settle(self.region)  # the region is prepared before any peer can write to it
            self.transport = _C.CudaCopyTransport(rank, num_ranks, self.buffer.memory, reorder_seed=reorder_seed,
                                                  timeout_s=TIMEOUT_S)
        else:
            self.region = torch.full((num_bytes,), POISON, dtype=torch.uint8, device=rank_device(rank))
            settle(self.region)
            self.transport = _C.TcpTransport(rank, num_ranks, self.region.data_ptr(), self.region.numel(),
                                             reorder_seed=reorder_seed, timeout_s=TIMEOUT_S, device=rank_device(rank).index,
                                             staging_bytes=STAGING)
            assert self.transport.staging_bytes == STAGING and not self.transport.region_is_host_memory
        addresses = [None] * num_ranks
        dist.all_gather_object(addresses, self.transport.listen_address(), group=group)
        self.transport.connect(addresses)
        dist.barrier(group=group)   # verbs: every queue pair can receive before any request is posted

    def finish(self):
        import torch.distributed as dist

        dist.barrier(group=self.group)
        self.transport.close()
        dist.barrier(group=self.group)  # no peer writes into a region that is going away
        if self.buffer is not None:
            self.buffer.release()


def _sum_over_ranks(value, group, device):
    import torch.distributed as dist

    total = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(total, group=group)
    return total.item()


# ---------------------------------------------------------------------------------------- writes and immediates
def exchange_body(rank, num_ranks, group, kind, reorder_seed, env_seed):
    import torch.distributed as dist

    _set_reorder_env(env_seed)
    recv_base, _, total = layout(num_ranks)
    end = _Endpoint(kind, rank, num_ranks, group, total, reorder_seed)
    region, transport = end.region, end.transport
    region[:SEND_BYTES] = source(rank).to(region.device)
    settle(region)
    expect_reorder = reorder_seed >= 0 or env_seed is not None
    assert (transport.reorder_seed is not None) == expect_reorder

    sources = {src: source(src).to(region.device) for src in range(num_ranks)}
    outgoing = {dst: plan(rank, dst) for dst in range(num_ranks)}
    incoming = {src: plan(src, rank) for src in range(num_ranks)}
    if kind == "tcp":
        assert any(length > STAGING for writes in outgoing.values() for _, _, length in writes), \
            "no write outgrows the staging"

    # Post every write, peers interleaved (ourselves included: a local copy).
    posted = []
    data_only = {dst: [] for dst in range(num_ranks)}  # ids of writes without an immediate, in posting order
    for i in range(max(len(writes) for writes in outgoing.values())):
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
    if kind in ("tcp", "tcp-host"):
        assert transport.rejected_requests() == 0

    # Order: FIFO per peer without reorder injection; with it, both the writes (completions of those
    # without an immediate) and the immediates are shuffled somewhere.
    position = {request: n for n, request in enumerate(completed)}
    writes_shuffled = sum(_out_of_order([position[r] for r in ids]) for ids in data_only.values())
    imms_shuffled = sum(_out_of_order(imms) for imms in seen.values())
    if not expect_reorder:
        assert writes_shuffled == 0, f"rank {rank}: writes completed out of order without reorder injection"
        assert imms_shuffled == 0, f"rank {rank}: immediates out of order without reorder injection: {seen}"
    writes_shuffled = _sum_over_ranks(writes_shuffled, group, region.device)
    imms_shuffled = _sum_over_ranks(imms_shuffled, group, region.device)
    if expect_reorder:
        assert writes_shuffled > 0, "reorder injection did not reorder the writes to any peer"
        assert imms_shuffled > 0, "reorder injection did not reorder the immediates from any peer"
    end.finish()


# ---------------------------------------------------------------------------------------- atomics
def atomics_body(rank, num_ranks, group, kind, reorder_seed):
    import torch.distributed as dist

    _set_reorder_env(None)
    _, counter_base, total = layout(num_ranks)
    end = _Endpoint(kind, rank, num_ranks, group, total, reorder_seed)
    counters = end.region[counter_base:counter_base + 8 * COUNTERS].view(torch.int64)
    counters.copy_(torch.tensor([initial_counter(k) for k in range(COUNTERS)], dtype=torch.int64))
    settle(end.region)
    dist.barrier(group=group)      # every rank's counters are set before any add arrives
    transport = end.transport

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
        want = initial_counter(k) + sum(_add_value(src, j, k) for src in range(num_ranks)
                                        for j in range(ADDS_PER_COUNTER))
        assert value == want, f"rank {rank}: counter {k} is {value}, expected {want}"
    end.finish()
