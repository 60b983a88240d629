"""The rail hop of normal mode across hosts: each rank's rows to the ranks with its own local index on every host.

Two ways behind one ``exchange``: :class:`CollectiveRail`, an all-to-all over the rail's torch.distributed group
(NCCL, gloo), and :class:`TransportRail`, writes through a transport of the CPU proxies (verbs, tcp, or cuda-copy
between the logical hosts of one machine) into a
region of ``num_rdma_bytes``: one write with an immediate (the row count) to each rail peer, so no host collective
runs and unordered delivery is fine (the immediate comes after its bytes). The host drives the transport here;
the rows still stage through this rank's region.
"""

import os
from typing import List, Optional, Tuple

import torch
import torch.distributed as dist

from .reference.collectives import GroupComm, wait_until

RailRows = Tuple[torch.Tensor, List[int]]
_TOO_LARGE = 1 << 31   # an immediate's flag: the rows did not fit; the rest of it is their count
_GIVEN_BACK = 1 << 30  # the immediate of an empty write: the sender has read our rows out of its slot
_ALIGN = 64


def transport_rail_bytes(num_hosts: int, rows: int, row_bytes: int) -> int:
    """num_rdma_bytes in which a TransportRail of ``num_hosts`` hosts carries ``rows`` rows of ``row_bytes`` from one
    rank to each host (a send and a receive slot per host)."""
    return 2 * num_hosts * _ALIGN * -(-rows * row_bytes // _ALIGN)


class CollectiveRail:
    name = "collective"
    writes = 0   # no transport writes: the collective carries the rows

    def __init__(self, comm: GroupComm) -> None:
        self.comm = comm
        self.label = str(dist.get_backend(comm.group)).lower()   # what carries the rows: nccl, gloo

    def exchange(self, rows: torch.Tensor, send_counts: List[int], recv_counts: Optional[List[int]],
                 phase: str) -> RailRows:
        """Each host's block of ``rows`` (uint8 ``[M, W]``, by host) to the rail's rank there; the blocks received,
        by host, with their row counts (``recv_counts`` where the caller knows them already)."""
        if recv_counts is None:
            recv_counts = self.comm.exchange_counts(send_counts, f"{phase}: rail counts")
        received = self.comm.start_row_exchange(rows, send_counts, recv_counts, f"{phase}: rail rows").finish()
        return received, recv_counts

    def close(self) -> None:
        pass


class TransportRail:
    """The rail over a proxies' transport. This rank's region holds one send slot and one receive slot per host. Every
    message is a write with an immediate: the rows with their count, and an empty write that gives a slot back
    once its rows are read (no atomics: EFA's SRD has none)."""

    name = "transport"

    def __init__(self, group: dist.ProcessGroup, host: int, num_hosts: int, device: torch.device, num_bytes: int,
                 transport: str, timeout_s: float, extension) -> None:
        self.host, self.num_hosts, self.num_bytes, self.timeout_s = host, num_hosts, num_bytes, timeout_s
        self.label = transport
        self.slot_bytes = num_bytes // (2 * num_hosts) // _ALIGN * _ALIGN
        if self.slot_bytes <= 0:
            raise ValueError(f"num_rdma_bytes={num_bytes} leaves no room for normal mode's rows across hosts over "
                             f"the {transport} transport")
        self.region = self.transport = self.peer_buffer = None
        try:
            self.region, self.transport, self.peer_buffer = _open_transport(extension, transport, group, host,
                                                                            num_hosts, num_bytes, device, timeout_s)
            mine = (self.transport.listen_address(), None)
        except Exception as error:   # every rail peer hears of it instead of waiting for this one
            mine = (None, f"rank {dist.get_rank()}: {type(error).__name__}: {error}")
        records = [None] * num_hosts
        dist.all_gather_object(records, mine, group=group)
        failure = next((why for _, why in records if why is not None), None)
        if failure is not None:
            self.close()
            raise RuntimeError(f"the {transport} transport of normal mode across hosts could not start: {failure}")
        self.transport.connect([address for address, _ in records])
        dist.barrier(group=group)   # verbs: every queue pair can receive before any request is posted
        self.writes = 0                      # transport writes issued (rows and give-backs), for the bench
        self.returned = [0] * num_hosts      # slots each host gave back (exchanges it finished reading)
        self.arrived: List[List[int]] = [[] for _ in range(num_hosts)]   # row immediates not yet taken
        self.finished = 0

    def _slot(self, host: int) -> int:
        """Where host ``host``'s rows land here (the send slots come first)."""
        return self.slot_bytes * (self.num_hosts + host)

    def _poll(self) -> None:
        for source, imm in self.transport.poll_immediates():
            if imm == _GIVEN_BACK:
                self.returned[source] += 1
            else:
                self.arrived[source].append(imm)

    def exchange(self, rows: torch.Tensor, send_counts: List[int], recv_counts: Optional[List[int]],
                 phase: str) -> RailRows:
        width = rows.size(1)
        blocks = [count * width for count in send_counts]
        fits = max(blocks, default=0) <= self.slot_bytes
        self._wait(lambda: min(self.returned) >= self.finished, phase,
                   "every host to give back its slot of the previous exchange")
        if fits and rows.numel() > 0:
            self.region[:rows.numel()].copy_(rows.reshape(-1))
            if self.region.is_cuda:
                torch.cuda.current_stream(self.region.device).synchronize()   # the transport reads it next
        offset = 0
        for host, (count, length) in enumerate(zip(send_counts, blocks)):
            self.transport.write(host, offset, self._slot(self.host), length if fits else 0,
                                 imm=count if fits else _TOO_LARGE | count)
            self.writes += 1
            offset += length if fits else 0
        self._wait(lambda: all(self.arrived), phase, "the rows of every host")
        counts = [imms.pop(0) for imms in self.arrived]
        self.transport.quiet()   # our writes are done: the send area is free again
        too_large = [count & ~_TOO_LARGE for count in counts if count & _TOO_LARGE]
        if not fits or too_large:
            rows_needed = max(too_large + [max(send_counts, default=0)])
            needed = transport_rail_bytes(self.num_hosts, rows_needed, width)
            raise ValueError(f"rank {dist.get_rank()}: {phase}: {rows_needed} rows of {width} bytes from one rank to "
                             f"one host need num_rdma_bytes >= {needed}; the Buffer has {self.num_bytes}")
        received = torch.cat([self.region[self._slot(source):self._slot(source) + count * width].view(count, width)
                              for source, count in enumerate(counts)])
        for host in range(self.num_hosts):   # that host may write into our slot for it again
            self.transport.write(host, 0, 0, 0, imm=_GIVEN_BACK)
            self.writes += 1
        self.transport.poll_completions()
        self.finished += 1
        return received, counts

    def _wait(self, ready, phase: str, expected: str) -> None:
        def polled() -> bool:
            self._poll()
            return ready()

        wait_until(polled, self.timeout_s, dist.get_rank(), phase, f"{expected} (rail transport)")

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()
            self.transport = None
        self.region = None
        if self.peer_buffer is not None:   # after the transport, which copies into it
            self.peer_buffer.release()
            self.peer_buffer = None


def _open_transport(extension, transport: str, group, rank: int, num_ranks: int, num_bytes: int,
                    device: torch.device, timeout_s: float):
    """``(region, transport, peer_buffer)``: this rank's region of ``num_bytes`` and the transport over it (collective
    over the rail's ``group``); ``peer_buffer`` the CUDA IPC mapping that is the region over cuda-copy, else None."""
    from ..platform_config import resolve_config
    from ..proxies import verbs_device, verbs_settings
    from .native.peers import map_peer_buffer

    gpu = device.index if device.type == "cuda" else None
    if transport == "cuda-copy":   # logical hosts of one machine: the rail's ranks map each other's regions
        peer_buffer, reason = map_peer_buffer(extension, group, rank, device, num_bytes, logical_hosts=False)
        if peer_buffer is None:
            raise RuntimeError(f"the cuda-copy transport carries the hop between the logical hosts of one machine "
                               f"only: {reason}")
        try:
            return peer_buffer.tensor, extension.CudaCopyTransport(rank, num_ranks, peer_buffer.memory,
                                                                   timeout_s=timeout_s), peer_buffer
        except BaseException:
            peer_buffer.release()
            raise
    region = torch.zeros(num_bytes, dtype=torch.uint8, device=device)
    if transport == "tcp":
        return region, extension.TcpTransport(rank, num_ranks, region.data_ptr(), region.numel(),
                                              timeout_s=timeout_s, device=gpu), None
    if transport == "verbs":
        return region, extension.VerbsTransport(rank, num_ranks, region.data_ptr(), region.numel(),
                                                device=verbs_device(gpu), gpu=-1 if gpu is None else gpu,
                                                timeout_s=timeout_s, **verbs_settings(resolve_config())), None
    raise ValueError(f"the rail of normal mode across hosts runs over cuda-copy, tcp or verbs, not {transport!r}")


def rail_transport() -> Optional[str]:
    """The transport UCCL_EP_PROXY_TRANSPORT names for the rail (cuda-copy, tcp, verbs), or None: the collective
    rail."""
    named = os.environ.get("UCCL_EP_PROXY_TRANSPORT", "").strip().lower()
    return named if named in ("cuda-copy", "tcp", "verbs") else None


def rail_setup_reason(extension, transport: str, num_bytes: int, device: torch.device) -> Optional[str]:
    """Why this rank cannot run the rail over ``transport`` with its region on ``device``, or None."""
    from ..proxies import TRANSPORT_FEATURES, cross_host_reason

    if extension is None:
        return "the native extension (with its transports) is not importable"
    if transport == "cuda-copy" and device.type != "cuda":
        return "the cuda-copy transport moves GPU memory, and these ranks run on the CPU"
    feature = TRANSPORT_FEATURES[transport] if device.type == "cuda" else f"{transport}_transport"
    if feature not in extension.build_info()["features"]:
        return f"this build has no {feature}"
    if num_bytes <= 0:
        return (f"UCCL_EP_PROXY_TRANSPORT={transport} carries normal mode across hosts in num_rdma_bytes, "
                f"which is 0")
    # cuda-copy reaches only the logical hosts of this machine: its own mapping says so if a peer is on another.
    return None if transport == "cuda-copy" else cross_host_reason(extension)
