"""The low-latency kernels' protocol through the proxy, played by the host: calls back to back, with no
barrier between them, while the transport delivers late and out of order (reorder injection).

Each call on a buffer half is what a low-latency kernel does for its proxy peers (KERNEL_NOTES.md, "Low-latency
through the proxy"): push write(release count: the uses of each half this rank has read) to every peer, wait
until every peer has finished reading this half's previous use (its release count in this rank's half), stage the
rows and a flag word (epoch << 32 | rows) in the outbox for each peer, push write(rows), QUIET, write(flag); then
wait for every peer's flag of this epoch, check the rows it announces and count the use. The halves alternate as
eager calls use them, or one half is used again and again as a replayed CUDA graph does. Host memory stands in
for GPU memory in CI; on 2 GPUs the same runs over cuda-copy and over tcp with device memory.
"""

import itertools
import time

import pytest
import torch

from tests.multiprocess import needs_gpus, run_ranks
from tests.proxy_regions import proxy_over
from tests.transport_exchange import settle
from uccl_ep_plugin import _C

WRITE, QUIET = 1, 4
ROW = 64                 # bytes per row
MAX_ROWS = 8             # rows a rank sends one peer per call at most (0 happens too)
WORD = 16                # a flag or release slot: one int64, padded to the 16-byte units the proxy moves
WAIT_S = 20.0


class HalfLayout:
    """Offsets in a rank's region of half ``h``: flags [src], release counts [reader], rows [src], then the
    outbox per peer (rows, flag slot, release slot)."""

    def __init__(self, num_ranks: int) -> None:
        self.num_ranks = num_ranks
        self.flags = 0
        self.release = WORD * num_ranks
        self.rows = 2 * WORD * num_ranks
        self.outbox = self.rows + num_ranks * MAX_ROWS * ROW
        self.outbox_peer = MAX_ROWS * ROW + 2 * WORD
        self.half = self.outbox + num_ranks * self.outbox_peer

    def at(self, half: int, offset: int) -> int:
        return half * self.half + offset

    def box(self, half: int, peer: int) -> int:
        return self.at(half, self.outbox + peer * self.outbox_peer)


def _num_rows(call: int, src: int, dst: int) -> int:
    return (7 * call + 3 * src + 5 * dst) % (MAX_ROWS + 1)


def _rows(call: int, src: int, dst: int, n: int) -> torch.Tensor:
    """n rows of int64 words tagging (call, src, dst, row)."""
    tag = (call + 1) << 32 | src << 24 | dst << 16
    return torch.arange(n, dtype=torch.int64).add_(tag).unsqueeze(1).expand(n, ROW // 8).reshape(-1)


def _protocol_body(rank, num_ranks, group, transport, reorder_seed, calls, same_half, quiet=True, wait_s=WAIT_S):
    import os

    import torch.distributed as dist
    from uccl_ep_plugin.platform_config import resolve_config

    # A window of 2 held for up to 5 ms: a write can pass the one before it and land long after it.
    os.environ["UCCL_EP_TRANSPORT_REORDER_WINDOW"] = "2"
    os.environ["UCCL_EP_TRANSPORT_REORDER_HOLD_US"] = "5000"

    L = HalfLayout(num_ranks)
    config = _C.ProxyConfig.from_environ(resolve_config().as_environ())
    config.low_latency = True
    config.timeout_s = wait_s
    region, fifos, proxy, owned = proxy_over(transport, rank, num_ranks, group, 2 * L.half, config, reorder_seed)
    words = region.view(torch.int64)
    addresses = [None] * num_ranks
    dist.all_gather_object(addresses, proxy.listen_address(), group=group)
    proxy.connect(addresses)
    proxy.start()
    peers = [p for p in range(num_ranks) if p != rank]
    uses = [0, 0]

    def wait_word(offset: int, ready, what: str) -> int:
        deadline = time.monotonic() + wait_s
        while True:
            value = int(words[offset // 8].item())
            if ready(value):
                return value
            proxy.check()
            assert time.monotonic() < deadline, (f"rank {rank}: {what} never came (last word {value:#x}); FIFOs taken/pushed "
                                                 f"{[(f.taken, f.pushed) for f in fifos]}, proxy {proxy.stats()}")
            time.sleep(0.0002)

    def store(offset: int, values: torch.Tensor) -> None:
        region[offset:offset + values.numel() * 8] = values.contiguous().view(torch.uint8).to(region.device)

    for call in range(calls):
        half = 0 if same_half else call % 2
        epoch = uses[half] + 1
        where = f"call {call} (half {half}, epoch {epoch})"
        # This rank's counts of both halves go out before it waits for the peers' counts, so no two ranks wait
        # on each other.
        for h, p in itertools.product((0, 1), peers):
            store(L.box(h, p) + MAX_ROWS * ROW + WORD, torch.tensor([uses[h]], dtype=torch.int64))
        settle(region)
        for h, p in itertools.product((0, 1), peers):
            fifos[p % len(fifos)].push(WRITE, p, length_bytes=WORD, local_offset=L.box(h, p) + MAX_ROWS * ROW + WORD,
                                       remote_offset=L.at(h, L.release + rank * WORD))
        for p in peers:
            wait_word(L.at(half, L.release + p * WORD), lambda v: v + 1 >= epoch,
                      f"{where}: rank {p}'s release of the previous use")
        for p in peers:
            n = _num_rows(call, rank, p)
            box = L.box(half, p)
            store(box, _rows(call, rank, p, n))
            store(box + MAX_ROWS * ROW, torch.tensor([epoch << 32 | n], dtype=torch.int64))
        settle(region)
        for p in peers:
            box = L.box(half, p)
            fifo = fifos[p % len(fifos)]
            fifo.push(WRITE, p, length_bytes=_num_rows(call, rank, p) * ROW, local_offset=box,
                      remote_offset=L.at(half, L.rows + rank * MAX_ROWS * ROW))
            if quiet:
                fifo.push(QUIET)
            fifo.push(WRITE, p, length_bytes=WORD, local_offset=box + MAX_ROWS * ROW,
                      remote_offset=L.at(half, L.flags + rank * WORD))
        for p in peers:
            flag = wait_word(L.at(half, L.flags + p * WORD), lambda v: v >> 32 == epoch, f"{where}: rank {p}'s flag")
            n = flag & 0xFFFFFFFF
            assert n == _num_rows(call, p, rank), f"rank {rank}: {where}: rank {p}'s flag announces {n} rows"
            start = L.at(half, L.rows + p * MAX_ROWS * ROW)
            got = region[start:start + n * ROW].view(torch.int64).cpu()
            assert torch.equal(got, _rows(call, p, rank, n)), f"rank {rank}: {where}: rows from rank {p} differ"
        uses[half] = epoch
    # The last release counts may still be in flight (held by the reorder window): no rank closes before
    # every rank's requests are acknowledged.
    deadline = time.monotonic() + wait_s
    while not proxy.idle:
        proxy.check()
        assert time.monotonic() < deadline, f"rank {rank}: requests still in flight after the last call"
        time.sleep(0.001)
    dist.barrier(group=group)
    proxy.close()
    for resource in owned:
        resource.release()


@pytest.mark.parametrize("num_ranks,reorder_seed,same_half", [(2, -1, False), (2, 7, False), (2, 7, True),
                                                              (3, 7, False)],
                         ids=["2-in-order", "2-reorder", "2-reorder-one-half", "3-reorder"])
def test_calls_back_to_back_over_tcp(num_ranks, reorder_seed, same_half):
    run_ranks(num_ranks, _protocol_body, transport="tcp", reorder_seed=reorder_seed, calls=60, same_half=same_half)


def test_without_the_quiet_reordering_is_detected():
    """The proof that the test above can fail: without the QUIET between rows and flag, reorder injection lets
    a flag land before its rows, and the reader finds rows that differ."""
    with pytest.raises(AssertionError, match="rows from rank"):
        run_ranks(2, _protocol_body, transport="tcp", reorder_seed=7, calls=60, same_half=False, quiet=False,
                  wait_s=3.0)


@pytest.mark.gpu
@needs_gpus(2)
@pytest.mark.parametrize("transport", ["cuda-copy", "tcp-device"])
@pytest.mark.parametrize("reorder_seed", [-1, 7], ids=["in-order", "reorder"])
def test_calls_back_to_back_on_gpus(transport, reorder_seed):
    run_ranks(2, _protocol_body, backend="nccl", transport=transport, reorder_seed=reorder_seed, calls=40,
              same_half=False)
