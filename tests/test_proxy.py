"""The CPU proxy (csrc/proxy/): immediate encoding, the receiver-side ordering layer, and proxies
driven through host-memory FIFOs over the tcp transport between 2 and 4 processes, with and
without reorder injection, including the negative proof that without the ordering layer an
unordered transport lets a count flag (or a counter value) be seen too early. Where RDMA devices
exist (tests/soft_roce runs these in a guest with two soft-RoCE devices) the same exchange and the
negative proof run over verbs, with counter adds as the NIC's atomics and as immediates. On 2 GPUs
the same exchange runs over cuda-copy and over tcp with device memory.

Multi-rank tests run one process per rank (tests/multiprocess.py, gloo for bootstrapping). Host
memory stands in for device memory: each rank's region is a torch uint8 tensor (tcp-staged: staged
through host memory as a device region is).
"""

import os
import random
import threading
import time

import pytest
import torch

from tests.multiprocess import needs_gpus, run_ranks
from tests.proxy_regions import proxy_over
from tests.process_resources import fds_and_threads, settled_fds_and_threads
from tests.transport_exchange import settle, skip_without
from uccl_ep_plugin import _C

WRITE, WRITE_WITH_COUNT, ATOMIC_ADD, QUIET, BARRIER = 1, 2, 3, 4, 5
FLAG_BUFFER, FLAG_COUNT = 1, 2
KIND_LANDED, KIND_ADD, KIND_COUNT, KIND_CONTROL = 0, 1, 2, 3

# ---------------------------------------------------------------------------------------- layout
ROW = 64            # bytes per low-latency token row
EXPERTS = 3         # low-latency experts (counters 0..EXPERTS-1 also index flags)
MAX_TOKENS = 12     # token rows per (src, dst, buffer, expert) at most
SLICE = 1 << 15     # bulk bytes per (src, dst)
CHUNKS = 16         # bulk writes per (src, dst)
ADD_COUNTERS = 2    # per-source add counters on every rank: counter src * ADD_COUNTERS + c
ADDS = 12           # adds per (src, dst, counter) per iteration: 1, 2, 4, ..., 2048 (sum 4095)
FULL = (1 << ADDS) - 1


class Layout:
    def __init__(self, num_ranks):
        r = num_ranks
        self.num_counters = max(EXPERTS, r * ADD_COUNTERS)
        off = 0

        def take(nbytes):
            nonlocal off
            start = off
            off += (nbytes + 63) // 64 * 64
            return start

        self.ll_recv = take(2 * EXPERTS * r * MAX_TOKENS * ROW)    # [buffer][expert][src][token][ROW]
        self.ll_send = take(r * 2 * EXPERTS * MAX_TOKENS * ROW)    # [dst][buffer][expert][token][ROW]
        self.bulk_recv = take(r * SLICE)                           # [src][SLICE]
        self.bulk_send = take(r * SLICE)                           # [dst][SLICE]
        self.counters = take(8 * self.num_counters)
        self.flags = take(8 * 2 * self.num_counters * r)           # [buffer][counter][src]
        self.total = off
        self.num_ranks = r

    def ll_recv_at(self, b, e, src, t):
        return self.ll_recv + (((b * EXPERTS + e) * self.num_ranks + src) * MAX_TOKENS + t) * ROW

    def ll_send_at(self, dst, b, e, t):
        return self.ll_send + (((dst * 2 + b) * EXPERTS + e) * MAX_TOKENS + t) * ROW


def _ntokens(it, src, dst, b, e):
    return random.Random(f"n{it}/{src}/{dst}/{b}/{e}").randint(1, MAX_TOKENS)


def _rows(it, src, dst, b, e, n):
    """The n token rows src sends dst: int64 words tagging (iteration, src, dst, buffer, expert, token)."""
    tag = (it + 1) << 40 | src << 32 | dst << 24 | e << 16 | b << 12
    words = torch.arange(n, dtype=torch.int64).add_(tag).unsqueeze(1).expand(n, ROW // 8)
    return words.contiguous().view(torch.uint8).reshape(-1)


def _bulk(it, src, dst):
    gen = torch.Generator().manual_seed(7919 * it + 1000 * src + dst + 3)
    return torch.randint(0, 256, (SLICE,), dtype=torch.uint8, generator=gen)


def _bulk_chunks(src, dst):
    rng = random.Random(f"c{src}/{dst}")
    cuts = sorted(rng.sample(range(1, SLICE // 16), CHUNKS - 1))
    bounds = [0] + [c * 16 for c in cuts] + [SLICE]
    return [(bounds[i], bounds[i + 1] - bounds[i]) for i in range(CHUNKS)]


def _in_sequence(value):
    """Adds of 1, 2, 4, ..., 2**(ADDS-1) applied in sequence only ever show FULL * k + 2**j - 1."""
    rest = value % FULL
    return value >= 0 and (rest + 1) & rest == 0


# ---------------------------------------------------------------------------------------- checker
class Checker(threading.Thread):
    """Watches this rank's region while the run is in flight: whenever a count flag is set, all the
    rows it announces must be there; every add counter must be a prefix sum of its sequence."""

    def __init__(self, region, layout, rank, it):
        super().__init__(daemon=True)
        self.region, self.layout, self.rank, self.it = region, layout, rank, it
        self.stop = threading.Event()
        self.violations = []
        self.checks = 0
        L = layout
        self.flags = region[L.flags:L.flags + 8 * 2 * L.num_counters * L.num_ranks].view(torch.int64).view(
            2, L.num_counters, L.num_ranks)
        self.counters = region[L.counters:L.counters + 8 * L.num_counters].view(torch.int64)
        self.expected = {}
        for b in range(2):
            for e in range(EXPERTS):
                for src in range(L.num_ranks):
                    n = _ntokens(it, src, rank, b, e)
                    self.expected[(b, e, src)] = (n, _rows(it, src, rank, b, e, n))

    def run(self):
        L = self.layout
        while not self.stop.is_set() and len(self.violations) < 50:
            flags = self.flags.clone()       # flags first, rows after: x86 keeps loads in order
            for b, e, src in (flags[:, :EXPERTS, :] != 0).nonzero().tolist():
                n, rows = self.expected[(b, e, src)]
                flag = flags[b, e, src].item()
                start = L.ll_recv_at(b, e, src, 0)
                if flag != -(n + 1) or not torch.equal(self.region[start:start + n * ROW].cpu(), rows):
                    self.violations.append(f"flag {flag} of (buffer {b}, expert {e}, src {src}) visible "
                                           f"before its {n} rows landed")
            counters = self.counters.clone().tolist()
            for src in range(L.num_ranks):
                for c in range(ADD_COUNTERS):
                    v = counters[src * ADD_COUNTERS + c]
                    if not _in_sequence(v):
                        self.violations.append(f"counter {src * ADD_COUNTERS + c} observed out of sequence: {v}")
            self.checks += 1
            time.sleep(0)


# ---------------------------------------------------------------------------------------- multi-process body
def _proxy_body(rank, num_ranks, group, reorder_seed, ordering, iterations, hold_us, result_path, byte_limit,
                spread=True, reorder_window=None, low_latency=False, transport="tcp", native_atomics=None,
                qps_per_peer=1):
    import torch.distributed as dist
    from uccl_ep_plugin.platform_config import resolve_config

    if hold_us is not None:
        os.environ["UCCL_EP_TRANSPORT_REORDER_HOLD_US"] = str(hold_us)
    if reorder_window is not None:
        os.environ["UCCL_EP_TRANSPORT_REORDER_WINDOW"] = str(reorder_window)
    os.environ["UCCL_IB_QPS_PER_PEER"] = str(qps_per_peer)   # verbs only
    L = Layout(num_ranks)
    config = _C.ProxyConfig.from_environ(resolve_config().as_environ())
    config.adaptive_sleep = True
    config.num_counters = L.num_counters
    config.counters_offset = L.counters
    config.flags_offset = L.flags
    config.token_bytes = ROW
    config.ordering = ordering
    config.low_latency = low_latency
    config.timeout_s = 30.0
    if byte_limit:
        config.max_inflight_bytes = byte_limit
    if native_atomics is not None:
        config.native_atomics = native_atomics
    region, fifos, proxy, owned = proxy_over(transport, rank, num_ranks, group, L.total, config, reorder_seed)
    assert (proxy.reorder_seed is not None) == (reorder_seed >= 0)
    addresses = [None] * num_ranks
    dist.all_gather_object(addresses, proxy.listen_address(), group=group)
    proxy.connect(addresses)
    dist.barrier(group=group)   # verbs: every queue pair can receive before any request is posted
    proxy.start()

    violations = [0, 0]  # flags seen before their rows, counters seen out of sequence
    for it in range(iterations):
        # Sources for this iteration.
        for dst in range(num_ranks):
            region[L.bulk_send + dst * SLICE:L.bulk_send + (dst + 1) * SLICE] = _bulk(it, rank, dst).to(region.device)
            for b in range(2):
                for e in range(EXPERTS):
                    n = _ntokens(it, rank, dst, b, e)
                    start = L.ll_send_at(dst, b, e, 0)
                    region[start:start + n * ROW] = _rows(it, rank, dst, b, e, n).to(region.device)
        settle(region)
        dist.barrier(group=group)
        checker = Checker(region, L, rank, it)
        checker.start()

        rng = random.Random(f"push{it}/{rank}")
        k = 0
        # Low-latency: per (dst, buffer, expert) the token rows in groups of 1..3 (one
        # write-landed immediate each), then the count flag: spread over the FIFOs (so only the
        # ordering layer keeps a flag behind its rows), or all on one FIFO (posted in order).
        for b in range(2):
            for dst in rng.sample(range(num_ranks), num_ranks):
                for e in range(EXPERTS):
                    n = _ntokens(it, rank, dst, b, e)
                    t = 0
                    if not spread:
                        k = dst + b + e
                    while t < n:
                        g = min(n - t, rng.randint(1, 3))
                        fifos[k % 3].push(WRITE_WITH_COUNT, dst, length_bytes=g * ROW,
                                          local_offset=L.ll_send_at(dst, b, e, t),
                                          remote_offset=L.ll_recv_at(b, e, rank, t), counter_index=e, flags=b)
                        k += spread
                        t += g
                    fifos[k % 3].push(ATOMIC_ADD, dst, counter_index=e, value=n, flags=b | FLAG_COUNT)
                    k += spread
        # Normal mode: bulk chunks on any FIFO; the adds of one counter on one FIFO, in order
        # (1, 2, 4, ...), interleaved with the chunks.
        chunks = {dst: _bulk_chunks(rank, dst) for dst in range(num_ranks)}
        for i in range(max(CHUNKS, ADDS)):
            for dst in range(num_ranks):
                if i < CHUNKS:
                    start, length = chunks[dst][i]
                    fifos[(i + dst) % 3].push(WRITE, dst, length_bytes=length,
                                              local_offset=L.bulk_send + dst * SLICE + start,
                                              remote_offset=L.bulk_recv + rank * SLICE + start)
                if i < ADDS:
                    for c in range(ADD_COUNTERS):
                        fifos[c % 3].push(ATOMIC_ADD, dst, counter_index=rank * ADD_COUNTERS + c, value=1 << i)
        for f in fifos[1:]:
            f.push(QUIET)
        deadline = time.monotonic() + 30
        while any(f.taken != f.pushed for f in fifos):
            proxy.check()
            assert time.monotonic() < deadline, (f"rank {rank}: the proxy did not take every command "
                                                 f"({[(f.taken, f.pushed) for f in fifos]} taken of pushed per FIFO; "
                                                 f"transport outstanding {proxy.transport_outstanding}; "
                                                 f"stats {proxy.stats()})")
            time.sleep(0.001)
        fifos[0].push(BARRIER)
        proxy.wait_barriers(it + 1, timeout_s=30)
        checker.stop.set()
        checker.join()
        assert checker.checks > 0
        violations[0] += sum(1 for v in checker.violations if v.startswith("flag"))
        violations[1] += sum(1 for v in checker.violations if v.startswith("counter"))
        if ordering:
            assert not checker.violations, f"rank {rank}: {checker.violations[:3]}"

        # After the barrier: every byte and every counter exact, every flag released.
        for src in range(num_ranks):
            got = region[L.bulk_recv + src * SLICE:L.bulk_recv + (src + 1) * SLICE]
            assert torch.equal(got.cpu(), _bulk(it, src, rank)), f"rank {rank}: bulk bytes from {src} wrong"
            for b in range(2):
                for e in range(EXPERTS):
                    n = _ntokens(it, src, rank, b, e)
                    start = L.ll_recv_at(b, e, src, 0)
                    assert torch.equal(region[start:start + n * ROW].cpu(), _rows(it, src, rank, b, e, n)), \
                        f"rank {rank}: rows of (buffer {b}, expert {e}) from {src} wrong"
                    assert proxy.flag(b, e, src) == -(n + 1), f"rank {rank}: flag ({b}, {e}, {src})"
            for c in range(ADD_COUNTERS):
                assert proxy.counter(src * ADD_COUNTERS + c) == FULL * (it + 1), \
                    f"rank {rank}: counter {src * ADD_COUNTERS + c} is {proxy.counter(src * ADD_COUNTERS + c)}"
        # The barrier waited for what the quiets wait for; their FIFOs' threads mark them done soon.
        deadline = time.monotonic() + 10
        while proxy.quiets_done < 2 * (it + 1):
            assert time.monotonic() < deadline, f"rank {rank}: {proxy.quiets_done} quiets done"
            time.sleep(0.001)
        assert proxy.quiets_done == 2 * (it + 1)
        dist.barrier(group=group)
        # Our own barrier arrivals may still await their acknowledgements when the barrier is
        # done (it waits for the arrivals it receives, not for the ones it sent): let them settle.
        deadline = time.monotonic() + 10
        while proxy.inflight_requests or proxy.transport_outstanding:
            assert time.monotonic() < deadline, (f"rank {rank}: requests still in flight after the barrier "
                                                 f"(proxy {proxy.inflight_requests}, transport "
                                                 f"{proxy.transport_outstanding}, stats {proxy.stats()})")
            time.sleep(0.001)
        # Reset what receivers consume (rows, flags, bulk) for the next iteration.
        region[L.ll_recv:L.ll_recv + 2 * EXPERTS * num_ranks * MAX_TOKENS * ROW] = 0
        region[L.bulk_recv:L.bulk_recv + num_ranks * SLICE] = 0
        region[L.flags:L.flags + 8 * 2 * L.num_counters * num_ranks] = 0
        settle(region)
        dist.barrier(group=group)

    stats = proxy.stats()
    limit = config.max_inflight_low_latency if low_latency else config.max_inflight_normal
    assert stats["inflight_peak"] <= limit + num_ranks, stats  # + barrier arrivals
    # Plain counter adds go as the NIC's atomics exactly where they are ordered and allowed (verbs, one RC queue pair
    # per peer, without reorder injection), else as immediates the receiving proxies apply.
    native = transport == "verbs" and config.native_atomics and reorder_seed < 0 and qps_per_peer == 1
    assert (stats["native_adds"] > 0) == native, stats
    assert (stats["ordering"]["adds_applied"] > 0) == (not native), stats
    held = torch.tensor([stats["ordering"]["adds_held_peak"] + stats["ordering"]["flags_held_peak"],
                         violations[0], violations[1], stats["flow_stalls"]], dtype=torch.int64)
    dist.all_reduce(held, group=group)
    if ordering and reorder_seed >= 0:
        assert held[0].item() > 0, "reorder injection never made the ordering layer hold anything"
    if byte_limit:
        assert held[3].item() > 0, "the in-flight limits never held a command back"
    proxy.close()
    for resource in owned:
        resource.release()
    if result_path and rank == 0:
        with open(result_path, "w") as f:
            f.write(f"{held[1].item()} {held[2].item()}")


@pytest.mark.gpu
@needs_gpus(2)
@pytest.mark.parametrize("reorder_seed", [-1, 7])
def test_proxy_exchange_over_cuda_copy(reorder_seed):
    """The same exchange with every region in GPU memory: the copy engines move the bytes, and the
    ordering layer applies adds and count flags to device memory."""
    if "cuda_copy_transport" not in _C.build_info()["features"]:
        pytest.skip("built without CUDA")
    run_ranks(2, _proxy_body, reorder_seed=reorder_seed, ordering=True, iterations=2, result_path=None,
              hold_us=None, byte_limit=None, transport="cuda-copy")


@pytest.mark.gpu
@needs_gpus(2)
@pytest.mark.parametrize("reorder_seed", [-1, 7])
def test_proxy_exchange_over_tcp_device_memory(reorder_seed):
    """The same exchange with every region in GPU memory over tcp: writes staged through pinned host
    memory, atomics and the ordering layer's adds and count flags applied by kernels."""
    if "tcp_device_memory" not in _C.build_info()["features"]:
        pytest.skip("built without CUDA")
    run_ranks(2, _proxy_body, reorder_seed=reorder_seed, ordering=True, iterations=2, result_path=None,
              hold_us=None, byte_limit=None, transport="tcp-device")


@pytest.mark.parametrize("num_ranks,reorder_seed,extra", [
    (2, -1, {}),
    (2, -1, dict(native_atomics=False)),
    (2, 7, dict(byte_limit=4096)),
    (4, 12345, dict(reorder_window=4, hold_us=20000, low_latency=True)),
    (2, -1, dict(qps_per_peer=3)),
], ids=["2ranks-native-atomics", "2ranks-emulated-atomics", "2ranks-reorder-bytelimit", "4ranks-reorder",
        "2ranks-3-qps"])
def test_proxy_exchange_over_verbs(num_ranks, reorder_seed, extra):
    """The exchange over RDMA (a real verbs provider: tests/soft_roce runs it in a guest with two soft-RoCE
    devices): counter adds as the NIC's atomics, or as immediates when the config says so, reorder injection
    makes the transport unordered, or several queue pairs per peer let an add overtake a write."""
    skip_without("verbs", 0)
    kwargs = dict(hold_us=None, byte_limit=None)
    kwargs.update(extra)
    run_ranks(num_ranks, _proxy_body, reorder_seed=reorder_seed, ordering=True, iterations=2, result_path=None,
              transport="verbs", **kwargs)


# The reorder settings under which the negative proof below sees violations without the ordering layer.
AGGRESSIVE = dict(reorder_window=4, hold_us=20000, low_latency=True)


@pytest.mark.parametrize("num_ranks,reorder_seed,extra", [
    (2, -1, {}),
    (2, 7, dict(byte_limit=4096)),
    (2, 1, dict(AGGRESSIVE, spread=False)),
    (4, 12345, AGGRESSIVE),
    (2, 7, dict(transport="tcp-staged")),
], ids=["2ranks", "2ranks-reorder-bytelimit", "2ranks-reorder-as-negative-proof", "4ranks-reorder",
        "2ranks-reorder-staged"])
def test_proxy_exchange(num_ranks, reorder_seed, extra):
    kwargs = dict(hold_us=None, byte_limit=None)
    kwargs.update(extra)
    run_ranks(num_ranks, _proxy_body, reorder_seed=reorder_seed, ordering=True, iterations=2, result_path=None,
              **kwargs)


@pytest.mark.parametrize("transport", ["tcp", "verbs"])
def test_without_ordering_reordering_is_detected(tmp_path, transport):
    """The negative proof. Each flag is posted on the FIFO of its rows, after them, and the ordering
    layer is off. Over tcp's in-order connections (or verbs' reliable-connected queue pairs) the checker
    sees nothing wrong; with reorder injection it sees a flag before its rows (or a counter out of
    sequence) for some seed."""
    if transport == "verbs":
        skip_without("verbs", 0)
    path = tmp_path / "control"
    run_ranks(2, _proxy_body, reorder_seed=-1, ordering=False, iterations=1, result_path=str(path),
              byte_limit=None, spread=False, transport=transport, **AGGRESSIVE)
    assert path.read_text() == "0 0", f"violations without reordering: {path.read_text()}"
    found = []
    for seed in (1, 2, 3):
        path = tmp_path / f"violations-{seed}"
        run_ranks(2, _proxy_body, reorder_seed=seed, ordering=False, iterations=1, result_path=str(path),
                  byte_limit=None, spread=False, transport=transport, **AGGRESSIVE)
        flags, counters = map(int, path.read_text().split())
        found.append((seed, flags, counters))
        if flags or counters:
            break
    assert any(flags or counters for _, flags, counters in found), \
        f"no violation detected without the ordering layer: {found}"


# ---------------------------------------------------------------------------------------- immediates
def test_immediate_round_trip():
    rng = random.Random(5)
    layout = _C.IMMEDIATE_LAYOUT
    assert layout["max_counters"] == 2048 and layout["max_window"] == 8
    for kind in range(4):
        for buffer in (0, 1):
            for seq in range(16):
                for counter in (0, 1, 2047, rng.randrange(2048)):
                    if kind == KIND_ADD:
                        values = (-8192, -1, 0, 1, 8191, rng.randint(-8192, 8191))
                    else:
                        values = (0, 1, 16383, rng.randint(0, 16383))
                    for value in values:
                        imm = _C.encode_immediate(kind, buffer, seq, counter, value)
                        assert 0 <= imm < 1 << 32
                        d = _C.decode_immediate(imm)
                        assert (d["kind"], d["buffer"], d["seq"], d["counter"], d["value"]) == \
                            (kind, buffer, seq, counter, value)
    # The documented bit positions.
    assert _C.encode_immediate(KIND_CONTROL) == 3 << 30
    assert _C.encode_immediate(KIND_LANDED, buffer=1) == 1 << 29
    assert _C.encode_immediate(KIND_LANDED, seq=1) == 1 << 25
    assert _C.encode_immediate(KIND_LANDED, counter=1) == 1 << 14
    assert _C.encode_immediate(KIND_ADD, value=-1) == 1 << 30 | 0x3FFF


@pytest.mark.parametrize("kwargs,name", [
    (dict(kind=4), "kind"), (dict(kind=0, buffer=2), "buffer"), (dict(kind=1, seq=16), "seq"),
    (dict(kind=0, counter=2048), "counter"), (dict(kind=0, value=16384), "value"),
    (dict(kind=0, value=-1), "value"), (dict(kind=1, value=8192), "value"), (dict(kind=1, value=-8193), "value"),
])
def test_immediate_limits_name_the_argument(kwargs, name):
    with pytest.raises(ValueError, match=name):
        _C.encode_immediate(**kwargs)


# ---------------------------------------------------------------------------------------- ordering layer
def _ordering(num_ranks=2, num_counters=4, window=8, enabled=True):
    buf = torch.zeros(8 * num_counters + 8 * 2 * num_counters * num_ranks, dtype=torch.uint8)
    o = _C.ReceiverOrdering(buf.data_ptr(), buf.numel(), num_ranks, num_counters, 0, 8 * num_counters,
                            window=window, enabled=enabled)
    counters = buf[:8 * num_counters].view(torch.int64)
    flags = buf[8 * num_counters:].view(torch.int64).view(2, num_counters, num_ranks)
    return o, buf, counters, flags


def test_ordering_applies_adds_in_sequence():
    o, _, counters, _ = _ordering()
    add = lambda seq, value, counter=1: _C.encode_immediate(KIND_ADD, seq=seq, counter=counter, value=value)  # noqa
    o.on_immediate(0, add(2, 4))
    o.on_immediate(0, add(1, 2))
    assert counters[1].item() == 0, "adds ahead of sequence 0 must be held"
    o.on_immediate(1, add(0, 100))          # another source: its own window
    assert counters[1].item() == 100
    o.on_immediate(0, add(0, 1))
    assert counters[1].item() == 107
    assert o.stats()["adds_held_peak"] == 2 and o.stats()["adds_held_now"] == 0
    # Wrap-around of the 4-bit sequence number: 3 .. 20 (mod 16), delivered in reverse per window.
    total = 107
    for base in (3, 11):
        for seq in reversed(range(base, base + 8)):
            o.on_immediate(0, add(seq % 16, -1))
        total -= 8
        assert counters[1].item() == total


def test_ordering_reports_out_of_window_and_duplicates():
    o, _, _, _ = _ordering(window=4)
    o.on_immediate(1, _C.encode_immediate(KIND_ADD, seq=3, counter=2, value=1))
    with pytest.raises(RuntimeError, match=r"source rank 1, counter 2: sequence 4 is outside the window"):
        o.on_immediate(1, _C.encode_immediate(KIND_ADD, seq=4, counter=2, value=1))
    with pytest.raises(RuntimeError, match=r"source rank 1, counter 2: sequence 3 arrived twice"):
        o.on_immediate(1, _C.encode_immediate(KIND_ADD, seq=3, counter=2, value=1))
    with pytest.raises(RuntimeError, match="counter beyond num_counters"):
        o.on_immediate(0, _C.encode_immediate(KIND_ADD, seq=0, counter=4, value=1))
    with pytest.raises(RuntimeError, match="source rank 5"):
        o.on_immediate(5, _C.encode_immediate(KIND_ADD, seq=0, counter=0, value=1))


def test_ordering_holds_count_flag_until_rows_landed():
    o, _, _, flags = _ordering()
    o.on_immediate(1, _C.encode_immediate(KIND_COUNT, buffer=1, counter=3, value=5))
    assert flags[1, 3, 1].item() == 0
    o.on_immediate(1, _C.encode_immediate(KIND_LANDED, buffer=1, counter=3, value=2))
    o.on_immediate(0, _C.encode_immediate(KIND_LANDED, buffer=1, counter=3, value=3))  # other source
    o.on_immediate(1, _C.encode_immediate(KIND_LANDED, buffer=0, counter=3, value=3))  # other buffer
    assert flags[1, 3, 1].item() == 0
    o.on_immediate(1, _C.encode_immediate(KIND_LANDED, buffer=1, counter=3, value=3))
    assert flags[1, 3, 1].item() == -6
    # Rows first, then the flag: released at once; a zero-row flag too.
    o.on_immediate(0, _C.encode_immediate(KIND_COUNT, buffer=1, counter=3, value=3))
    assert flags[1, 3, 0].item() == -4
    o.on_immediate(0, _C.encode_immediate(KIND_COUNT, buffer=0, counter=0, value=0))
    assert flags[0, 0, 0].item() == -1
    o.on_immediate(0, _C.encode_immediate(KIND_COUNT, buffer=0, counter=1, value=2))
    with pytest.raises(RuntimeError, match="still held"):
        o.on_immediate(0, _C.encode_immediate(KIND_COUNT, buffer=0, counter=1, value=2))
    s = o.stats()
    assert s["flags_released"] == 3 and s["flags_held_now"] == 1 and s["flags_released_late"] == 1


def test_ordering_switched_off_applies_in_arrival_order():
    o, _, counters, flags = _ordering(enabled=False)
    o.on_immediate(0, _C.encode_immediate(KIND_ADD, seq=5, counter=0, value=7))
    assert counters[0].item() == 7
    o.on_immediate(0, _C.encode_immediate(KIND_COUNT, buffer=0, counter=0, value=4))
    assert flags[0, 0, 0].item() == -5, "without ordering the flag is visible before its rows"


def test_ordering_bad_layout_names_the_setting():
    buf = torch.zeros(64, dtype=torch.uint8)
    with pytest.raises(ValueError, match="counters_offset"):
        _C.ReceiverOrdering(buf.data_ptr(), 64, 1, 4, 4, 32)
    with pytest.raises(ValueError, match="flags_offset"):
        _C.ReceiverOrdering(buf.data_ptr(), 64, 2, 4, 0, 32)
    with pytest.raises(ValueError, match="window"):
        _C.ReceiverOrdering(buf.data_ptr(), 64, 1, 1, 0, 8, window=9)
    with pytest.raises(ValueError, match="num_counters"):
        _C.ReceiverOrdering(buf.data_ptr(), 64, 1, 4096, 0, 8)


# ---------------------------------------------------------------------------------------- single rank




def _single(fifos, size=1 << 16, num_threads=2, **settings):
    region = torch.zeros(size, dtype=torch.uint8)
    config = _C.ProxyConfig()
    config.num_counters = 4
    config.counters_offset = size - 128
    config.flags_offset = size - 96
    config.adaptive_sleep = True
    for key, value in settings.items():
        setattr(config, key, value)
    proxy = _C.Proxy(0, 1, region.data_ptr(), size, fifos, num_threads=num_threads, config=config)
    proxy.connect([proxy.listen_address()])
    return proxy, region


@pytest.fixture(autouse=True)
def _no_transport_env(monkeypatch):
    for name in ("UCCL_SOCKET_IFNAME", "UCCL_EP_TRANSPORT_REORDER", "UCCL_EP_TRANSPORT_REORDER_WINDOW",
                 "UCCL_EP_TRANSPORT_REORDER_HOLD_US"):
        monkeypatch.delenv(name, raising=False)


@pytest.mark.parametrize("push,why", [
    (dict(kind=9, dst_rank=0, length_bytes=16), "unknown command kind 9"),
    (dict(kind=WRITE, dst_rank=3, length_bytes=16), "destination rank 3 is out of range"),
    (dict(kind=WRITE, dst_rank=0, length_bytes=256, local_offset=(1 << 16) - 128), "outside the local region"),
    (dict(kind=WRITE, dst_rank=0, length_bytes=256, remote_offset=1 << 20), "remote_offset"),
    (dict(kind=ATOMIC_ADD, dst_rank=0, counter_index=9, value=1), "counter_index 9 is out of range"),
    (dict(kind=ATOMIC_ADD, dst_rank=0, counter_index=1, value=9000), "does not fit an immediate"),
    (dict(kind=WRITE_WITH_COUNT, dst_rank=0, length_bytes=16, flags=4), "unknown flags 4"),
])
def test_bad_command_is_reported(push, why):
    fifo = _C.HostFifo(16)
    proxy, _ = _single([fifo])
    proxy.start()
    try:
        fifo.push(WRITE, 0, length_bytes=64, local_offset=0, remote_offset=1024)   # a good one first
        fifo.push(**push)
        fifo.push(WRITE, 0, length_bytes=64, local_offset=0, remote_offset=2048)   # not executed
        deadline = time.monotonic() + 10
        while proxy.error() is None:
            assert time.monotonic() < deadline, "the bad command was not reported"
            time.sleep(0.002)
        error = proxy.error()
        assert why in error, error
        assert "proxy rank 0, peer " in error and "command #1 of FIFO 0" in error and "{kind=" in error, error
        with pytest.raises(RuntimeError, match="command #1"):
            proxy.check()
        with pytest.raises(RuntimeError, match="command #1"):
            proxy.stop()
    finally:
        with pytest.raises(RuntimeError):
            proxy.close()


def test_quiet_barrier_and_stop_leak_nothing():
    # Torch starts its worker threads on its first parallel operation: let that happen before counting.
    torch.ones(1 << 20).sum()
    pattern = torch.arange(4096, dtype=torch.int64).remainder(251).to(torch.uint8)
    before = fds_and_threads()
    fifos = [_C.HostFifo(64) for _ in range(3)]
    proxy, region = _single(fifos, num_threads=3, max_inflight_bytes=256, cpu_affinity=[0])
    region[:4096] = pattern
    # Everything is queued before the threads start, so a thread finds several writes at once and the
    # byte limit (two writes) must hold some back: the flow-stall count below cannot depend on timing.
    for i in range(32):
        fifos[i % 3].push(WRITE, 0, length_bytes=128, local_offset=128 * i, remote_offset=8192 + 128 * i)
        fifos[1].push(ATOMIC_ADD, 0, counter_index=2, value=i)
    fifos[2].push(WRITE_WITH_COUNT, 0, length_bytes=64, local_offset=0, remote_offset=16384, counter_index=1,
                  flags=FLAG_BUFFER)
    fifos[0].push(ATOMIC_ADD, 0, counter_index=1, value=1, flags=FLAG_BUFFER | FLAG_COUNT)
    for f in fifos[1:]:
        f.push(QUIET)
    proxy.start()
    assert fds_and_threads()[1] > before[1]
    while any(f.taken != f.pushed for f in fifos):
        time.sleep(0.001)
    fifos[0].push(BARRIER)
    proxy.wait_barriers(1, timeout_s=10)
    deadline = time.monotonic() + 10
    while proxy.quiets_done < 2 and time.monotonic() < deadline:
        time.sleep(0.001)
    assert torch.equal(region[8192:8192 + 4096], region[:4096])
    assert proxy.counter(2) == sum(range(32))
    assert proxy.flag(1, 1, 0) == -2
    assert proxy.quiets_done == 2 and proxy.barriers_done == 1
    stats = proxy.stats()
    assert stats["flow_stalls"] > 0 and stats["inflight_peak"] <= 8 + 1, stats
    proxy.stop()
    proxy.close()
    proxy.close()  # idempotent
    del proxy
    assert settled_fds_and_threads(before) == before


def test_config_from_environ_and_bad_arguments():
    config = _C.ProxyConfig.from_environ({"UCCL_IB_MAX_INFLIGHT_BYTES": "1048576", "UCCL_IB_MAX_INFLIGHT_NORMAL": "3",
                                          "UCCL_IB_MAX_INFLIGHT_LOW_LATENCY": "5", "UCCL_RDMA_ADAPTIVE_SLEEP": "1"})
    assert (config.max_inflight_bytes, config.max_inflight_normal, config.max_inflight_low_latency,
            config.adaptive_sleep) == (1048576, 3, 5, True)
    assert _C.ProxyConfig.from_environ({}).max_inflight_bytes is None
    with pytest.raises(ValueError, match="UCCL_IB_MAX_INFLIGHT_NORMAL"):
        _C.ProxyConfig.from_environ({"UCCL_IB_MAX_INFLIGHT_NORMAL": "0"})
    with pytest.raises(ValueError, match="UCCL_RDMA_ADAPTIVE_SLEEP"):
        _C.ProxyConfig.from_environ({"UCCL_RDMA_ADAPTIVE_SLEEP": "maybe"})

    fifo = _C.HostFifo(8)
    for kwargs, name in [(dict(kind=0), "kind"), (dict(kind=1, dst_rank=4096), "dst_rank"),
                         (dict(kind=1, length_bytes=17), "length_bytes"), (dict(kind=1, local_offset=8), "local_offset"),
                         (dict(kind=1, remote_offset=-16), "remote_offset"), (dict(kind=1, flags=16), "flags"),
                         (dict(kind=3, value=1 << 23), "value"), (dict(kind=1, value=1), "value"),
                         (dict(kind=1, counter_index=1 << 20), "counter_index")]:
        with pytest.raises(ValueError, match=name):
            fifo.push(**kwargs)
    with pytest.raises(ValueError, match="capacity"):
        _C.HostFifo(12)
    region = torch.zeros(4096, dtype=torch.uint8)
    with pytest.raises(ValueError, match="num_threads"):
        _C.Proxy(0, 1, region.data_ptr(), 4096, [fifo], num_threads=0)
    with pytest.raises(ValueError, match="fifos"):
        _C.Proxy(0, 1, region.data_ptr(), 4096, [], num_threads=1)
    with pytest.raises(ValueError, match="fifos"):
        _C.Proxy(0, 1, region.data_ptr(), 4096, [fifo, fifo], num_threads=1)
    config = _C.ProxyConfig()
    config.cpu_affinity = [100000]
    with pytest.raises(ValueError, match="cpu_affinity"):
        _C.Proxy(0, 1, region.data_ptr(), 4096, [fifo], config=config)
    config = _C.ProxyConfig()
    config.num_counters = 4
    config.counters_offset = 4096
    with pytest.raises(ValueError, match="counters_offset"):
        _C.Proxy(0, 1, region.data_ptr(), 4096, [fifo], config=config)
    config = _C.ProxyConfig()
    config.token_bytes = 24
    with pytest.raises(ValueError, match="token_bytes"):
        _C.Proxy(0, 1, region.data_ptr(), 4096, [fifo], config=config)
    with pytest.raises(ValueError, match="max_inflight_bytes"):
        config.max_inflight_bytes = 0
    assert "proxy" in _C.build_info()["features"]


# ---------------------------------------------------------------------------------------- a peer that dies
def _dying_peer_body(rank, num_ranks, group, timeout_s):
    import torch.distributed as dist
    region = torch.zeros(1 << 16, dtype=torch.uint8)
    fifos = [_C.HostFifo(64)]
    config = _C.ProxyConfig()
    config.timeout_s = timeout_s
    proxy = _C.Proxy(rank, num_ranks, region.data_ptr(), region.numel(), fifos, config=config,
                     transport_timeout_s=timeout_s)
    addresses = [None] * num_ranks
    dist.all_gather_object(addresses, proxy.listen_address(), group=group)
    proxy.connect(addresses)
    proxy.start()
    dist.barrier(group=group)
    if rank == 1:
        os._exit(0)    # dies without closing anything: its sockets are torn down by the kernel
    time.sleep(0.5)
    start = time.monotonic()
    fifos[0].push(WRITE, 1, length_bytes=256, local_offset=0, remote_offset=0)
    fifos[0].push(BARRIER)
    with pytest.raises(RuntimeError) as error:
        proxy.wait_barriers(1, timeout_s=timeout_s + 10)
    elapsed = time.monotonic() - start
    assert elapsed < timeout_s + 10, f"the survivor waited {elapsed:.1f} s"
    message = str(error.value)
    assert "rank 0" in message and ("rank 1" in message or "peer 1" in message), message
    with pytest.raises(RuntimeError):   # the stored error is raised again, and the threads are joined
        proxy.close()


def test_survivor_raises_when_a_peer_dies():
    """Rank 1 exits after connecting (exit code 0, so only rank 0's checks decide); rank 0's next write and
    barrier fail within the timeout with an error naming both ranks, instead of hanging."""
    run_ranks(2, _dying_peer_body, timeout_s=5.0)
