"""The transports alone (``uccl-ep bench --mode transport``): two endpoints of one transport in this process,
rank 0 posting to rank 1 over host memory, with no proxy and no GPU.

Per transport (tcp always; verbs where the build has it and the host has an RDMA device: with two devices the
endpoints use one each, else both the first):

* write latency: one write with an immediate, from its post until rank 1 sees the immediate (the bytes are
  there by then), for a few sizes; the median of many.
* write bandwidth: a batch of writes of one size, from the first post until ``quiet()`` returns.
* atomic adds: a batch of adds to one counter, from the first post until ``quiet()``; adds per second.

Every row is checked: the bytes that landed, each immediate once, the counter's sum. On soft-RoCE (an emulated
NIC) the figures only show that the harness works.
"""

import statistics
import sys
import threading
import time
from typing import Callable, Dict, List, Optional, Tuple

import torch

from ..platform_config.detect import detect_rdma_devices
from .report import table, write_json

LATENCY_SIZES = (8, 4096, 65536)
BANDWIDTH_SIZES = (65536, 1 << 20)
REGION_BYTES = 16 << 20        # each endpoint's region: the source half, then the destination half
TIMEOUT_S = 30.0
COLUMNS = (("transport", "transport", "{}"), ("devices", "devices", "{}"), ("op", "op", "{}"),
           ("bytes", "bytes", "{}"), ("count", "count", "{}"), ("median_us", "median us", "{:.2f}"),
           ("p90_us", "p90 us", "{:.2f}"), ("gbps", "GB/s", "{:.3f}"), ("mops", "M ops/s", "{:.4f}"),
           ("correct", "correct", "{}"))


def _extension():
    from .. import _C   # noqa: WPS433 (the benchmark needs the extension; the reference engine does not)
    return _C


def available_transports() -> List[Tuple[str, Optional[str]]]:
    """(transport, why it is left out or None) for tcp and verbs."""
    extension = _extension()
    features = extension.build_info()["features"]
    rows = [("tcp", None if "tcp_transport" in features else "the build has no tcp transport")]
    if "verbs_transport" not in features:
        rows.append(("verbs", "the build has no verbs transport (rdma-core's headers were missing)"))
    elif not extension.verbs_available():
        rows.append(("verbs", "libibverbs.so.1 cannot be loaded"))
    elif not _rdma_devices():
        rows.append(("verbs", "no RDMA device on this host"))
    else:
        rows.append(("verbs", None))
    return rows


def _rdma_devices() -> List[str]:
    return [name for name, _ in detect_rdma_devices()]


class _Pair:
    """Two endpoints of ``transport``, each over its own poisoned host region, connected to each other."""

    def __init__(self, transport: str) -> None:
        extension = _extension()
        self.regions = [torch.full((REGION_BYTES,), 0x5A, dtype=torch.uint8) for _ in range(2)]
        self.regions[0][:REGION_BYTES // 2] = torch.randint(0, 256, (REGION_BYTES // 2,), dtype=torch.uint8,
                                                            generator=torch.Generator().manual_seed(1))
        if transport == "tcp":
            self.devices = "-"
            make = lambda rank: extension.TcpTransport(rank, 2, self.regions[rank].data_ptr(), REGION_BYTES,  # noqa: E731
                                                       timeout_s=TIMEOUT_S)
        else:
            devices = _rdma_devices()
            names = [devices[rank % len(devices)] for rank in range(2)]
            self.devices = ",".join(names)
            make = lambda rank: extension.VerbsTransport(rank, 2, self.regions[rank].data_ptr(),  # noqa: E731
                                                         REGION_BYTES, device=names[rank], timeout_s=TIMEOUT_S)
        self.ends = [make(0), make(1)]
        addresses = [end.listen_address() for end in self.ends]
        threads = [threading.Thread(target=end.connect, args=(addresses,)) for end in self.ends]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()

    def close(self) -> None:
        for end in self.ends:
            end.close()


def _wait_for_immediate(receiver, imm: int, deadline: float) -> bool:
    while time.monotonic() < deadline:
        events = receiver.poll_immediates()
        if events:
            return events == [(0, imm)]
    return False


def _latency(pair: _Pair, size: int, count: int) -> Dict:
    sender, receiver = pair.ends
    source, destination = pair.regions[0], pair.regions[1]
    half = REGION_BYTES // 2
    times, correct = [], True
    for i in range(count):
        begin = time.perf_counter()
        sender.write(1, 0, half, size, imm=i)
        correct &= _wait_for_immediate(receiver, i, time.monotonic() + TIMEOUT_S)
        times.append(time.perf_counter() - begin)
    sender.quiet()
    sender.poll_completions()
    correct &= bool(torch.equal(destination[half:half + size], source[:size]))
    times_us = sorted(t * 1e6 for t in times)
    return {"op": "write latency", "bytes": size, "count": count, "median_us": statistics.median(times_us),
            "p90_us": times_us[int(0.9 * (len(times_us) - 1))], "correct": correct}


def _bandwidth(pair: _Pair, size: int, count: int) -> Dict:
    sender = pair.ends[0]
    source, destination = pair.regions[0], pair.regions[1]
    half = REGION_BYTES // 2
    slots = half // size
    begin = time.perf_counter()
    for i in range(count):
        offset = (i % slots) * size
        sender.write(1, offset, half + offset, size)
    sender.quiet()
    seconds = time.perf_counter() - begin
    correct = len(sender.poll_completions()) == count
    written = min(count, slots) * size
    correct &= bool(torch.equal(destination[half:half + written], source[:written]))
    return {"op": "write bandwidth", "bytes": size, "count": count, "median_us": seconds / count * 1e6,
            "gbps": count * size / seconds / 1e9, "correct": correct}


def _atomics(pair: _Pair, count: int) -> Dict:
    sender = pair.ends[0]
    counter = pair.regions[1][REGION_BYTES - 8:].view(torch.int64)
    start = int(counter.item())
    begin = time.perf_counter()
    for i in range(count):
        sender.atomic_add(1, REGION_BYTES - 8, i + 1)
    sender.quiet()
    seconds = time.perf_counter() - begin
    correct = len(sender.poll_completions()) == count and int(counter.item()) == start + count * (count + 1) // 2
    return {"op": "atomic add", "bytes": 8, "count": count, "median_us": seconds / count * 1e6,
            "mops": count / seconds / 1e6, "correct": correct}


def run_transport_benchmark(commit: str, iterations: int, report: Callable[[Dict], None]) -> List[Dict]:
    """Every case of every available transport; ``iterations`` scales the counts (latency: that many round
    trips per size; bandwidth: 4x that many writes; atomics: 10x)."""
    results = []
    for transport, reason in available_transports():
        if reason is not None:
            print(f"uccl-ep bench --mode transport: {transport} left out: {reason}", file=sys.stderr, flush=True)
            continue
        pair = _Pair(transport)
        try:
            rows = [_latency(pair, size, iterations) for size in LATENCY_SIZES]
            rows += [_bandwidth(pair, size, 4 * iterations) for size in BANDWIDTH_SIZES]
            rows.append(_atomics(pair, 10 * iterations))
        finally:
            pair.close()
        for row in rows:
            row.update(transport=transport, devices=pair.devices, commit=commit)
            report(row)
            results.append(row)
    return results


def run_from_cli(json_path: Optional[str], commit: str, iterations: Optional[int]) -> int:
    """``uccl-ep bench --mode transport``: 0 if every row is correct, 1 if not."""
    def progress(row: Dict) -> None:
        print(f"{row['transport']} {row['op']} {row['bytes']} B: {row['median_us']:.2f} us, "
              f"{'ok' if row['correct'] else 'WRONG'}", file=sys.stderr, flush=True)

    results = run_transport_benchmark(commit, iterations or 200, progress)
    print(table(results, COLUMNS))
    wrong = [r for r in results if not r["correct"]]
    print(f"{len(results)} cases, {'all results correct' if not wrong else f'{len(wrong)} WRONG'} (bytes, "
          "immediates and counters checked)")
    if json_path:
        write_json(results, json_path)
        print(f"wrote {json_path}")
    return 0 if not wrong else 1
