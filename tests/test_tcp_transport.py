"""The tcp transport (csrc/transport/tcp_transport.*): data, atomics and immediates between 2 and 4
processes with and without reorder injection, argument and peer-side bounds checks, peers that
close or stop answering, interface selection, and no leaked threads or sockets.

The staging a device region goes through (pinned host memory, tcp_staging.h) runs here too, without a
GPU: `_stage_host_region=True` stages a host region the same way, with CPU copies, through a staging
small enough that writes stream through its chunks. tests/test_gpu_tcp_device_memory.py runs it on GPUs.

Multi-rank data tests run one process per rank (tests/multiprocess.py, gloo for bootstrapping);
the failure tests run several transports inside this process, connected from Python threads
(connect() releases the GIL), or against a fake peer speaking the handshake by hand.
"""

import gc
import os
import socket
import struct
import threading
import time

import pytest
import torch

from tests.immediates import collect_immediates
from tests.multiprocess import run_ranks
from tests.process_resources import fds_and_threads, settled_fds_and_threads
from uccl_ep_plugin import _C

SLICE = 1 << 18          # bytes each source writes to each destination
CHUNKS = 48              # writes per (source, destination)
COUNTERS = 8             # int64 counters every rank adds to on every rank
ADDS_PER_COUNTER = 6
IMM_EVERY = 3            # chunks i with i % IMM_EVERY == 0 carry the immediate i
# The smallest staging: a 16 KiB receive arena and 8 send chunks of 6 KiB (48 KiB, less than a large write).
STAGED = dict(_stage_host_region=True, staging_bytes=1 << 16)


# ---------------------------------------------------------------------------------------- layout helpers
def _layout(num_ranks):
    recv_base = 0
    counter_base = num_ranks * SLICE
    send_base = counter_base + COUNTERS * 8
    total = send_base + num_ranks * SLICE
    return recv_base, counter_base, send_base, total


def _pattern(src, dst):
    gen = torch.Generator().manual_seed(1000 * src + dst + 7)
    return torch.randint(0, 256, (SLICE,), dtype=torch.uint8, generator=gen)


def _chunks(src, dst):
    """(start, length) of the CHUNKS writes from src to dst: a random partition of the slice."""
    gen = torch.Generator().manual_seed(5000 + 1000 * src + dst)
    cuts = torch.randperm(SLICE - 1, generator=gen)[:CHUNKS - 1].add(1).sort().values.tolist()
    bounds = [0] + cuts + [SLICE]
    return [(bounds[i], bounds[i + 1] - bounds[i]) for i in range(CHUNKS)]


def _add_value(src, k):
    return (src + 1) * (k + 3) * (-1 if k % 2 else 1) * 1_000_003


# ---------------------------------------------------------------------------------------- multi-process body
def _exchange_body(rank, num_ranks, group, reorder_seed, env_seed, staged):
    import torch.distributed as dist

    if env_seed is not None:
        os.environ["UCCL_EP_TRANSPORT_REORDER"] = str(env_seed)
    recv_base, counter_base, send_base, total = _layout(num_ranks)
    region = torch.zeros(total, dtype=torch.uint8)
    for dst in range(num_ranks):
        region[send_base + dst * SLICE: send_base + (dst + 1) * SLICE] = _pattern(rank, dst)
    transport = _C.TcpTransport(rank, num_ranks, region.data_ptr(), total, reorder_seed=reorder_seed, timeout_s=20.0,
                                **(STAGED if staged else {}))
    assert transport.staging_bytes == (STAGED["staging_bytes"] if staged else None)
    expect_reorder = reorder_seed >= 0 or env_seed is not None
    assert (transport.reorder_seed is not None) == expect_reorder

    addresses = [None] * num_ranks
    dist.all_gather_object(addresses, transport.listen_address(), group=group)
    transport.connect(addresses)

    expected = {dst: _pattern(rank, dst) for dst in range(num_ranks)}  # what we send
    incoming = {src: _pattern(src, rank) for src in range(num_ranks)}  # what we must receive
    incoming_chunks = {src: _chunks(src, rank) for src in range(num_ranks)}
    del expected

    # Post every write and atomic, peers interleaved (ourselves included: a local copy).
    posted = []
    chunks = {dst: _chunks(rank, dst) for dst in range(num_ranks)}
    for i in range(CHUNKS):
        for step in range(num_ranks):
            dst = (rank + step) % num_ranks
            start, length = chunks[dst][i]
            imm = i if i % IMM_EVERY == 0 else None
            posted.append(transport.write(dst, send_base + dst * SLICE + start, recv_base + rank * SLICE + start,
                                          length, imm=imm))
            if i < ADDS_PER_COUNTER:
                for k in range(COUNTERS):
                    posted.append(transport.atomic_add(dst, counter_base + 8 * k, _add_value(rank, k)))

    # Immediates: each after its bytes (checked the moment it is seen), each exactly once.
    wanted = {(src, i) for src in range(num_ranks) for i in range(0, CHUNKS, IMM_EVERY)}

    def bytes_landed(src, imm):
        start, length = incoming_chunks[src][imm]
        landed = region[recv_base + src * SLICE + start: recv_base + src * SLICE + start + length]
        assert torch.equal(landed, incoming[src][start:start + length]), \
            f"rank {rank}: immediate {imm} from {src} arrived before its bytes"

    seen = collect_immediates(transport, rank, wanted, 20.0, bytes_landed)

    transport.quiet()
    assert transport.outstanding() == 0
    completed = transport.poll_completions()
    assert sorted(completed) == sorted(posted), f"rank {rank}: completions differ from the posted ids"
    dist.barrier(group=group)

    for src in range(num_ranks):
        landed = region[recv_base + src * SLICE: recv_base + (src + 1) * SLICE]
        assert torch.equal(landed, incoming[src]), f"rank {rank}: bytes from rank {src} wrong"
    counters = region[counter_base: counter_base + 8 * COUNTERS].view(torch.int64).tolist()
    for k in range(COUNTERS):
        want = sum(ADDS_PER_COUNTER * _add_value(src, k) for src in range(num_ranks))
        assert counters[k] == want, f"rank {rank}: counter {k} is {counters[k]}, expected {want}"
    assert transport.poll_immediates() == [], f"rank {rank}: extra immediates"
    assert transport.rejected_requests() == 0

    # Order of immediates per source: FIFO without reordering; shuffled (somewhere) with it.
    out_of_order = sum(1 for src in range(num_ranks) if seen[src] != sorted(seen[src]))
    if not expect_reorder:
        assert out_of_order == 0, f"rank {rank}: immediates out of order without reorder injection: {seen}"
    flag = torch.tensor([out_of_order], dtype=torch.int64)
    dist.all_reduce(flag, group=group)
    if expect_reorder:
        assert flag.item() > 0, "reorder injection did not reorder any stream of immediates"

    dist.barrier(group=group)
    transport.close()


@pytest.mark.parametrize("num_ranks,reorder_seed,env_seed,staged", [
    (2, -1, None, False), (4, 12345, None, False), (2, -1, 99, False), (2, -1, None, True), (4, 12345, None, True),
], ids=["2ranks", "4ranks-reorder", "2ranks-reorder-env", "2ranks-staged", "4ranks-reorder-staged"])
def test_exchange(num_ranks, reorder_seed, env_seed, staged):
    run_ranks(num_ranks, _exchange_body, reorder_seed=reorder_seed, env_seed=env_seed, staged=staged)


# ---------------------------------------------------------------------------------------- in-process helpers
def _mesh(num_ranks, size=1 << 16, **kwargs):
    bufs = [torch.zeros(size, dtype=torch.uint8) for _ in range(num_ranks)]
    transports = [_C.TcpTransport(r, num_ranks, bufs[r].data_ptr(), size, **kwargs) for r in range(num_ranks)]
    addresses = [t.listen_address() for t in transports]
    errors = []

    def connect(t):
        try:
            t.connect(addresses)
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=connect, args=(t,)) for t in transports]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    if errors:
        raise errors[0]
    return transports, bufs






@pytest.fixture(autouse=True)
def _no_transport_env(monkeypatch):
    for name in ("UCCL_SOCKET_IFNAME", "UCCL_EP_TRANSPORT_REORDER", "UCCL_EP_TRANSPORT_REORDER_WINDOW",
                 "UCCL_EP_TRANSPORT_REORDER_HOLD_US"):
        monkeypatch.delenv(name, raising=False)


# ---------------------------------------------------------------------------------------- arguments
def test_bad_arguments_name_the_argument():
    (a, b), (buf_a, _) = _mesh(2, size=4096)
    try:
        cases = [
            (lambda: a.write(2, 0, 0, 8), "peer"),
            (lambda: a.write(-1, 0, 0, 8), "peer"),
            (lambda: a.write(1, 5000, 0, 8), "local_offset"),
            (lambda: a.write(1, 4000, 0, 200), "length"),
            (lambda: a.write(1, 0, 5000, 8), "remote_offset"),
            (lambda: a.write(1, 0, 4090, 8), "remote_offset"),
            (lambda: a.write(1, -1, 0, 8), "local_offset"),
            (lambda: a.write(1, 0, -8, 8), "remote_offset"),
            (lambda: a.write(1, 0, 0, -1), "length"),
            (lambda: a.write(1, 0, 0, 8, imm=1 << 32), "imm"),
            (lambda: a.write(1, 0, 0, 8, imm=-1), "imm"),
            (lambda: a.atomic_add(1, 12, 1), "remote_offset"),
            (lambda: a.atomic_add(1, 4096, 1), "remote_offset"),
            (lambda: a.atomic_add(1, -8, 1), "remote_offset"),
            (lambda: a.connect(["127.0.0.1:1", "127.0.0.1:2"]), "connect"),
        ]
        for call, name in cases[:-1]:
            with pytest.raises(ValueError, match=name):
                call()
        with pytest.raises(RuntimeError, match="twice"):
            cases[-1][0]()
        assert a.outstanding() == 0
        a.write(1, 0, 4088, 8)
        a.atomic_add(1, 4088, 3)
        a.quiet()
    finally:
        a.close()
        b.close()

    buf = torch.zeros(64, dtype=torch.uint8)
    for kwargs, name in [(dict(rank=2, num_ranks=2), "rank"), (dict(rank=0, num_ranks=0), "num_ranks"),
                         (dict(rank=0, num_ranks=1, region_bytes=-1), "region_bytes"),
                         (dict(rank=0, num_ranks=1, region_ptr=0, region_bytes=64), "region_ptr"),
                         (dict(rank=0, num_ranks=1, timeout_s=0.0), "timeout_s"),
                         (dict(rank=0, num_ranks=1, reorder_seed=-2), "reorder_seed"),
                         (dict(rank=0, num_ranks=1, listen_port=70000), "listen_port")]:
        full = dict(region_ptr=buf.data_ptr(), region_bytes=64)
        full.update(kwargs)
        with pytest.raises(ValueError, match=name):
            _C.TcpTransport(**full)
    single = _C.TcpTransport(0, 1, buf.data_ptr(), 64)
    with pytest.raises(RuntimeError, match="before connect"):
        single.write(0, 0, 8, 8)
    with pytest.raises(ValueError, match="addresses"):
        single.connect(["localhost"])
    single.close()


def test_peer_rejects_out_of_bounds_request():
    """A request that passes the sender's checks but not the receiver's is reported back to the sender."""
    (a, b), _ = _mesh(2, size=4096)
    try:
        a._write_unchecked(1, 0, 4000, 200, imm=5)
        with pytest.raises(RuntimeError, match=r"peer 1 rejected request 0: rank 1 refused a write of 200 bytes "
                                               r"at remote_offset 4000"):
            a.quiet()
        assert b.rejected_requests() == 1
        assert b.poll_immediates() == []
        assert a.outstanding() == 0
        # The connection survives a rejected request.
        ok = a.write(1, 0, 0, 16, imm=6)
        a.quiet()
        assert a.poll_completions() == [ok]
        assert b.poll_immediates() == [(0, 6)]
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("staging", [{}, STAGED], ids=["host", "staged"])
def test_local_writes_and_atomics(staging):
    (t,), (buf,) = _mesh(1, size=1024, **staging)
    buf[:100] = torch.arange(100, dtype=torch.uint8)
    ids = [t.write(0, 0, 200, 100, imm=9), t.atomic_add(0, 512, -7), t.write(0, 0, 0, 0, imm=10)]
    t.quiet()
    assert sorted(t.poll_completions()) == ids
    assert torch.equal(buf[200:300], buf[:100])
    assert buf[512:520].view(torch.int64).item() == -7
    assert t.poll_immediates() == [(0, 9), (0, 10)]
    t.close()


def test_staging_settings(monkeypatch):
    buf = torch.zeros(1 << 16, dtype=torch.uint8)
    host = _C.TcpTransport(0, 1, buf.data_ptr(), buf.numel())
    assert host.staging_bytes is None and host.region_is_host_memory
    host.close()
    staged = _C.TcpTransport(0, 1, buf.data_ptr(), buf.numel(), _stage_host_region=True)
    assert staged.staging_bytes == 64 << 20 and staged.region_is_host_memory
    staged.close()
    monkeypatch.setenv("UCCL_EP_TCP_STAGING_BYTES", str(1 << 17))
    staged = _C.TcpTransport(0, 1, buf.data_ptr(), buf.numel(), _stage_host_region=True)
    assert staged.staging_bytes == 1 << 17
    staged.close()
    staged = _C.TcpTransport(0, 1, buf.data_ptr(), buf.numel(), _stage_host_region=True, staging_bytes=1 << 18)
    assert staged.staging_bytes == 1 << 18, "the argument wins over the environment"
    staged.close()
    monkeypatch.setenv("UCCL_EP_TCP_STAGING_BYTES", "lots")
    with pytest.raises(ValueError, match="UCCL_EP_TCP_STAGING_BYTES=lots"):
        _C.TcpTransport(0, 1, buf.data_ptr(), buf.numel(), _stage_host_region=True)
    monkeypatch.delenv("UCCL_EP_TCP_STAGING_BYTES")
    for kwargs, name in [(dict(staging_bytes=(1 << 16) - 1), "staging_bytes"), (dict(staging_bytes=0), "staging_bytes"),
                         (dict(staging_bytes=-1), "staging_bytes"), (dict(device=-1), "device"),
                         (dict(device=0), "device must be -1")]:
        with pytest.raises(ValueError, match=name):
            _C.TcpTransport(0, 1, buf.data_ptr(), buf.numel(), _stage_host_region=True, **kwargs)


def test_device_region_needs_gpu_support():
    """A device region needs a build with CUDA and a GPU whose memory the region is."""
    buf = torch.zeros(64, dtype=torch.uint8)
    if "tcp_device_memory" not in _C.build_info()["features"]:
        with pytest.raises(ValueError, match=r"device=0 needs GPU support, and this build has none"):
            _C.TcpTransport(0, 1, buf.data_ptr(), 64, device=0)
    elif not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match=r"tcp transport rank 0: device=0 but no GPU can be used"):
            _C.TcpTransport(0, 1, buf.data_ptr(), 64, device=0)
    else:
        with pytest.raises(ValueError, match=r"region_ptr is host memory, not memory of device=0"):
            _C.TcpTransport(0, 1, buf.data_ptr(), 64, device=0)


# ---------------------------------------------------------------------------------------- failures
def test_peer_closing_early_fails_quiet_naming_the_peer(monkeypatch):
    # Hold every request in the reorder window, so they are certainly outstanding when the peer leaves.
    monkeypatch.setenv("UCCL_EP_TRANSPORT_REORDER_WINDOW", "100000")
    monkeypatch.setenv("UCCL_EP_TRANSPORT_REORDER_HOLD_US", str(10 ** 9))
    (a, b, c), _ = _mesh(3, reorder_seed=3, timeout_s=5.0)
    try:
        for i in range(5):
            a.write(1, 0, 64 * i, 64)
        a.write(2, 0, 0, 64)
        b.close()
        start = time.monotonic()
        with pytest.raises(RuntimeError, match=r"rank 0: peer 1 closed its transport with 5 of our requests"):
            a.quiet()
        assert time.monotonic() - start < 5.0
        a.quiet()  # peer 2's request completed; the error was reported once
        with pytest.raises(RuntimeError, match="cannot post to peer 1"):
            a.write(1, 0, 0, 8)
        c.write(0, 0, 0, 8)  # the survivors still talk
        c.quiet()
    finally:
        for t in (a, b, c):
            t.close()


def _fake_peer(region_bytes=1 << 16):
    """A rank-1 peer that completes the handshake by hand and then never answers."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(4)
    state = {}

    def serve():
        conn, _ = listener.accept()
        hello = conn.recv(32, socket.MSG_WAITALL)
        state["hello"] = struct.unpack("<HBBIQQQ", hello)
        conn.sendall(struct.pack("<HBBIQQQ", 0xEC75, 1, 0, 1, 1, region_bytes, 2))
        state["conn"] = conn

    thread = threading.Thread(target=serve)
    thread.start()
    return listener, thread, state


def test_unresponsive_then_vanished_peer():
    listener, thread, state = _fake_peer()
    buf = torch.zeros(1 << 16, dtype=torch.uint8)
    t = _C.TcpTransport(0, 2, buf.data_ptr(), buf.numel(), timeout_s=1.0)
    try:
        t.connect([t.listen_address(), "127.0.0.1:%d" % listener.getsockname()[1]])
        thread.join()
        assert state["hello"][:3] == (0xEC75, 1, 0) and state["hello"][4:] == (0, 1 << 16, 2)
        t.write(1, 0, 0, 128, imm=1)
        t.atomic_add(1, 8, 1)
        start = time.monotonic()
        with pytest.raises(RuntimeError, match=r"rank 0: quiet\(\) timed out after 1.0 s with 2 requests "
                                               r"outstanding to peer 1"):
            t.quiet()
        assert 0.9 < time.monotonic() - start < 3.0
        assert not t.fence()    # tcp orders nothing on a device: a QUIET waits for the acknowledgements
        # Both frames went out; the peer never acknowledged them.
        assert t.oldest_outstanding() == ("peer 1: 2 unacknowledged, 0 frames held in the reorder window, "
                                          "0 queued to send (0 staged, 0 bytes of the first sent)")
        conn = state["conn"]
        conn.setblocking(False)
        try:
            while conn.recv(1 << 16):  # drain what it was sent, so closing sends a FIN, not a reset
                pass
        except BlockingIOError:
            pass
        conn.close()
        with pytest.raises(RuntimeError, match="peer 1 closed the connection without saying goodbye"):
            t.quiet()
        with pytest.raises(RuntimeError, match="cannot post to peer 1"):
            t.write(1, 0, 0, 8)
        assert t.oldest_outstanding() == ""   # the lost requests were abandoned with the connection
    finally:
        t.close()
        listener.close()


def test_connection_errors():
    buf = torch.zeros(64, dtype=torch.uint8)
    closed = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    closed.bind(("127.0.0.1", 0))
    dead_port = closed.getsockname()[1]
    closed.close()
    t = _C.TcpTransport(0, 2, buf.data_ptr(), 64, timeout_s=2.0)
    with pytest.raises(RuntimeError, match=r"rank 0: connect to peer 1 at 127.0.0.1:%d failed: Connection refused"
                       % dead_port):
        t.connect([t.listen_address(), "127.0.0.1:%d" % dead_port])
    t.close()

    # A lower rank that never dials in: the wait is bounded and names it.
    t = _C.TcpTransport(1, 2, buf.data_ptr(), 64, timeout_s=0.3)
    with pytest.raises(RuntimeError, match=r"timed out after 0.3 s waiting for connections from ranks \[0\]"):
        t.connect(["127.0.0.1:%d" % dead_port, t.listen_address()])
    t.close()

    # A port that is taken.
    taken = _C.TcpTransport(0, 1, buf.data_ptr(), 64)
    port = int(taken.listen_address().rsplit(":", 1)[1])
    with pytest.raises(RuntimeError, match="port is in use"):
        _C.TcpTransport(0, 1, buf.data_ptr(), 64, listen_port=port)
    taken.close()


def test_socket_ifname(monkeypatch):
    buf = torch.zeros(64, dtype=torch.uint8)
    monkeypatch.setenv("UCCL_SOCKET_IFNAME", "lo")
    t = _C.TcpTransport(0, 1, buf.data_ptr(), 64)
    ip, port = t.listen_address().rsplit(":", 1)
    assert ip == "127.0.0.1"
    # The kernel's table shows the listener bound to 127.0.0.1 (0100007F), not to every address.
    with open("/proc/net/tcp") as table:
        listeners = [line.split()[1] for line in table.readlines()[1:] if line.split()[3] == "0A"]
    assert "0100007F:%04X" % int(port) in listeners
    assert "00000000:%04X" % int(port) not in listeners
    t.close()

    monkeypatch.setenv("UCCL_SOCKET_IFNAME", "nosuchif0")
    with pytest.raises(RuntimeError, match=r"UCCL_SOCKET_IFNAME=nosuchif0 names no interface with an IPv4 address "
                                           r"\(interfaces with one: .*lo 127.0.0.1"):
        _C.TcpTransport(0, 1, buf.data_ptr(), 64)


@pytest.mark.parametrize("staging", [{}, STAGED], ids=["host", "staged"])
def test_close_leaks_no_threads_or_sockets(staging):
    # Warm up first: torch may start its own worker threads on first use.
    (warm,), _ = _mesh(1, size=1 << 20)
    warm.close()
    del warm
    gc.collect()
    before = fds_and_threads()
    (a, b, c), bufs = _mesh(3, size=1 << 20, reorder_seed=1, **staging)
    during = settled_fds_and_threads((before[0] + 3 * 4, before[1] + 3))
    assert during == (before[0] + 3 * 4, before[1] + 3), "one I/O thread, 2 sockets, an epoll and an eventfd each"
    for t in (a, b, c):
        for peer in range(3):
            t.write(peer, 0, 0, 1 << 20, imm=1)
            t.atomic_add(peer, 8, 1)
    for t in (a, b, c):
        t.quiet()
    for t in (a, b, c):
        t.close()
        t.close()  # idempotent
    assert settled_fds_and_threads(before) == before

    # The destructor does the same, even for a transport that never connected or failed to.
    (a, b), _ = _mesh(2, **staging)
    a.write(1, 0, 0, 64)
    lone = _C.TcpTransport(0, 2, bufs[0].data_ptr(), 64, timeout_s=0.5, **staging)
    with pytest.raises(RuntimeError):
        lone.connect([lone.listen_address(), "127.0.0.1:1"])
    del a, b, lone
    gc.collect()
    assert settled_fds_and_threads(before) == before


def test_reorder_window_releases_without_quiet():
    """Held requests go out by themselves after the hold time: a proxy that never calls quiet()
    (its peer waits on the data instead) does not deadlock."""
    (a, b), (buf_a, buf_b) = _mesh(2, reorder_seed=11)
    try:
        buf_a[:64] = 42
        ids = [a.write(1, 0, 64 * i, 64, imm=i) for i in range(3)]  # fewer than the window holds
        deadline = time.monotonic() + 5.0
        got = []
        while len(got) < 3 and time.monotonic() < deadline:
            got += b.poll_immediates()
            time.sleep(0.001)
        assert sorted(imm for _, imm in got) == [0, 1, 2]
        assert bool((buf_b[:192] == 42).all())
        done = []
        while len(done) < 3 and time.monotonic() < deadline:
            done += a.poll_completions()
        assert sorted(done) == ids
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("staging", [{}, STAGED], ids=["host", "staged"])
def test_concurrent_posters_and_large_writes(staging):
    """Threads posting to every peer at once, large writes (the sender meets a full socket buffer;
    staged, each write is 20 times the send staging and every connection waits for chunks), with
    reordering: every byte and count arrives."""
    part = 1 << 20  # parts 0-2: data from rank 0-2; part 3: counters; part 4: what we send
    (ts, bufs) = _mesh(3, size=5 * part, reorder_seed=5, **staging)
    for r, buf in enumerate(bufs):
        buf[4 * part:] = r + 1

    errors = []

    def run(t):
        try:
            for peer in range(3):
                t.write(peer, 4 * part, t.rank * part, part, imm=t.rank)
                for _ in range(50):
                    t.atomic_add(peer, 3 * part + 8 * t.rank, 2)
            t.quiet()
        except Exception as exc:  # noqa: BLE001 - re-raised below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(t,)) for t in ts]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    try:
        assert not errors, errors
        for r, buf in enumerate(bufs):
            for src in range(3):
                assert bool((buf[src * part:(src + 1) * part] == src + 1).all())
                assert buf[3 * part + 8 * src: 3 * part + 8 * src + 8].view(torch.int64).item() == 100
            assert sorted(ts[r].poll_immediates()) == [(0, 0), (1, 1), (2, 2)]
            assert len(ts[r].poll_completions()) == 3 * 51
    finally:
        for t in ts:
            t.close()
