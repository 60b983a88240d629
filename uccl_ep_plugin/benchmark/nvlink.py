"""The NVLink floor of a normal-mode operation: the bytes a rank moves over its NVLink the busier way (sent to its
peers, or received from them) divided by the copy bandwidth this machine measured, every rank pushing to every
peer at once. An operation cannot finish faster; the bench prints it beside each normal-mode figure."""

import statistics

import torch
import torch.distributed as dist

from .workloads import FP8_BYTES_PER_ELEMENT

COPY_BYTES_PER_PEER = 64 << 20
COPY_REPEATS = 5


def row_bytes(hidden: int, dtype: str) -> float:
    """Bytes of one token's row on the wire: bf16, or fp8 with its share of the scales."""
    return hidden * (FP8_BYTES_PER_ELEMENT if dtype == "fp8" else 2)


def busier_way_bytes(rows_sent_to_peers: int, rows_received_from_peers: int, hidden: int, dtype: str) -> float:
    """What a rank's NVLink carries the busier way in one dispatch (a combine sends back what the dispatch brought,
    so it carries the same with the ways swapped)."""
    return max(rows_sent_to_peers, rows_received_from_peers) * row_bytes(hidden, dtype)


def floor_us(busier_way_bytes_per_rank, copy_gbps: float) -> float:
    """The slowest rank's time at the measured bandwidth, in microseconds."""
    return max(busier_way_bytes_per_rank) / (copy_gbps * 1e9) * 1e6


def measure_copy_gbps(extension, group, rank: int, num_ranks: int, device: torch.device,
                      bytes_per_peer: int = COPY_BYTES_PER_PEER) -> float:
    """GB/s a rank pushes over NVLink each way while every rank copies ``bytes_per_peer`` into every peer's mapped
    buffer at once with the copy engines (one stream per peer): the slowest rank's median over a few repeats.
    Collective."""
    from ..engines.native.peers import map_peer_buffer  # noqa: WPS433 (needs the GPU extension)

    peer_buffer, reason = map_peer_buffer(extension, group, rank, device, bytes_per_peer * num_ranks)
    if peer_buffer is None:
        raise RuntimeError(f"the NVLink copy bandwidth cannot be measured: {reason}")
    try:
        source = torch.empty(bytes_per_peer, dtype=torch.uint8, device=device).fill_(rank + 1)
        peers = [peer for peer in range(num_ranks) if peer != rank]
        # This rank's slot in each peer's buffer, as mapped here (addresses: torch would place them on the peer).
        targets = [peer_buffer.memory.peer_base(peer) + rank * bytes_per_peer for peer in peers]
        streams = [torch.cuda.Stream(device) for _ in peers]
        seconds = []
        for _ in range(COPY_REPEATS):
            torch.cuda.synchronize(device)
            dist.barrier(group=group)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for stream, target in zip(streams, targets):
                stream.wait_event(start)
                extension.copy_async(target, source.data_ptr(), bytes_per_peer, stream.cuda_stream)
            for stream in streams:
                torch.cuda.current_stream(device).wait_stream(stream)
            end.record()
            end.synchronize()
            seconds.append(start.elapsed_time(end) / 1e3)
        mine = torch.tensor([statistics.median(seconds)], dtype=torch.float64, device=device)
        dist.all_reduce(mine, op=dist.ReduceOp.MAX, group=group)
        torch.cuda.synchronize(device)
        dist.barrier(group=group)   # no peer still copies into this buffer when it goes
        return bytes_per_peer * len(peers) / float(mine) / 1e9
    finally:
        peer_buffer.release()
