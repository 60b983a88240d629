"""The rail hop of normal mode across hosts: each rank's rows to the ranks with its own local index on every host.

Two ways behind one ``exchange``: :class:`CollectiveRail`, an all-to-all over the rail's torch.distributed group
(NCCL, gloo), and :class:`TransportRail`, writes through a transport of the CPU proxies (verbs, tcp, or cuda-copy
between the logical hosts of one machine) into a
region of ``num_rdma_bytes``: writes with immediates (the rows left to come) to each rail peer, a slot at a time, so no
host collective runs and unordered delivery is fine (an immediate comes after its bytes). The host drives the
transport here; the rows still stage through this rank's region.
"""

import itertools
import os
from typing import List, Optional

import torch
import torch.distributed as dist

from .reference.collectives import GroupComm, wait_until

_GIVEN_BACK = 1 << 30  # an empty write's immediate: our rows are read out of its slot (row counts stay below)
_ALIGN = 64


def transport_rail_bytes(num_hosts: int, rows: int, row_bytes: int) -> int:
    """num_rdma_bytes in which a TransportRail of ``num_hosts`` hosts carries ``rows`` rows of ``row_bytes`` from one
    rank to each host (a send and a receive slot per host)."""
    return 2 * num_hosts * _ALIGN * -(-rows * row_bytes // _ALIGN)


class CollectiveRail:
    name = "collective"
    writes = 0      # no transport writes: the collective carries the rows
    region = None   # nor a region of num_rdma_bytes

    def __init__(self, comm: GroupComm) -> None:
        self.comm = comm
        self.label = str(dist.get_backend(comm.group)).lower()   # what carries the rows: nccl, gloo

    def exchange(self, rows: torch.Tensor, send_counts: List[int], recv_counts: List[int], phase: str) -> torch.Tensor:
        """Each host's block of ``rows`` (uint8 ``[M, W]``, by host, ``send_counts`` rows each) to the rail's rank
        there; the blocks received, by host (``recv_counts`` rows each: the layout told every rank)."""
        return self.comm.start_row_exchange(rows, send_counts, recv_counts, f"{phase}: rail rows").finish()

    def close(self) -> None:
        pass


class TransportRail:
    """The rail over a proxies' transport. This rank's region holds one send slot and one receive slot per host. Every
    message is a write with an immediate: a piece of rows (at most a slot) announcing how many rows are left with it,
    and an empty write that gives a slot back once its rows are read (no atomics: EFA's SRD has none). A block larger
    than a slot goes piece by piece, each after the receiver gave the slot back, so a region far smaller than a whole
    dispatch serves it."""

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
            mine = (self.transport.listen_address(), None, num_bytes)
        except Exception as error:   # every rail peer hears of it instead of waiting for this one
            mine = (None, f"rank {dist.get_rank()}: {type(error).__name__}: {error}", num_bytes)
        records = [None] * num_hosts
        dist.all_gather_object(records, mine, group=group)
        failure = next((why for _, why, _ in records if why is not None), None)
        sizes = [size for _, _, size in records]
        if failure is None and len(set(sizes)) > 1:   # the pieces' size is the slot's: both ends must agree on it
            failure = ("num_rdma_bytes differs between the ranks of a rail: " +
                       ", ".join(f"host {h}: {size}" for h, size in enumerate(sizes)))
        if failure is not None:
            self.close()
            raise RuntimeError(f"the {transport} transport of normal mode across hosts could not start: {failure}")
        self.transport.connect([address for address, _, _ in records])
        dist.barrier(group=group)   # verbs: every queue pair can receive before any request is posted
        self.writes = 0                      # transport writes issued (pieces and give-backs), for the bench
        self.sent = [0] * num_hosts          # pieces sent to each host
        self.returned = [0] * num_hosts      # of those, the ones whose slot the host gave back
        self.arrived: List[List[int]] = [[] for _ in range(num_hosts)]   # piece immediates not yet taken

    def _slot(self, host: int) -> int:
        """Where host ``host``'s rows land here (the send slots come first)."""
        return self.slot_bytes * (self.num_hosts + host)

    def _poll(self) -> None:
        for source, imm in self.transport.poll_immediates():
            if imm == _GIVEN_BACK:
                self.returned[source] += 1
            else:
                self.arrived[source].append(imm)

    def _sync(self) -> None:
        """The region's copies on the stream done before the transport reads it or a peer may overwrite it."""
        if self.region.is_cuda:
            torch.cuda.current_stream(self.region.device).synchronize()

    def exchange(self, rows: torch.Tensor, send_counts: List[int], recv_counts: List[int], phase: str) -> torch.Tensor:
        width = rows.size(1)
        cap = self.slot_bytes // max(width, 1)   # rows per piece; the same on every rank of the rail
        if cap == 0:   # the same on every rank: all of them raise before any write
            needed = transport_rail_bytes(self.num_hosts, 1, width)
            raise ValueError(f"rank {dist.get_rank()}: {phase}: a row of {width} bytes needs num_rdma_bytes >= "
                             f"{needed} to cross hosts; the Buffer has {self.num_bytes}")
        left = list(send_counts)                      # rows not yet sent to each host
        start = [0] + list(itertools.accumulate(send_counts))[:-1]
        unsent = set(range(self.num_hosts))           # hosts owed a piece (an empty block is one empty piece)
        # Each host's rows go straight to their place in the output, piece by piece.
        received = torch.empty((sum(recv_counts), width), dtype=torch.uint8, device=rows.device)
        place = [0] + list(itertools.accumulate(recv_counts))[:-1]
        taken = [0] * self.num_hosts
        incomplete = set(range(self.num_hosts))
        while unsent or incomplete:
            ready = [h for h in unsent if self.returned[h] == self.sent[h]]   # its slot there is free again
            arrivals = [s for s in incomplete if self.arrived[s]]
            if not ready and not arrivals:
                self._wait(lambda: any(self.returned[h] == self.sent[h] for h in unsent) or
                           any(self.arrived[s] for s in incomplete), phase, _awaited(incomplete, unsent))
                continue
            pieces = {host: min(cap, left[host]) for host in ready}
            for host, count in pieces.items():   # stage every piece, then one wait for the copies, then the writes
                offset = self.slot_bytes * host
                self.region[offset:offset + count * width].view(count, width).copy_(
                    rows[start[host]:start[host] + count])
            if pieces:
                self._sync()
            for host, count in pieces.items():
                self.transport.write(host, self.slot_bytes * host, self._slot(self.host), count * width,
                                     imm=left[host])
                left[host] -= count
                start[host] += count
                self.sent[host] += 1
                self.writes += 1
                if left[host] == 0:
                    unsent.discard(host)
            for source in arrivals:   # read every piece out, then one wait for the copies, then the give-backs
                remaining = self.arrived[source].pop(0)
                if remaining != recv_counts[source] - taken[source]:
                    raise RuntimeError(f"rank {dist.get_rank()}: {phase}: host {source} announced {remaining} rows "
                                       f"left after {taken[source]} of the {recv_counts[source]} expected "
                                       f"(rail transport)")
                count = min(cap, remaining)
                slot, at = self._slot(source), place[source] + taken[source]
                received[at:at + count] = self.region[slot:slot + count * width].view(count, width)
                taken[source] += count
                if taken[source] == recv_counts[source]:
                    incomplete.discard(source)
            if arrivals:
                self._sync()
                for source in arrivals:   # that host may write into our slot for it again
                    self.transport.write(source, 0, 0, 0, imm=_GIVEN_BACK)
                    self.writes += 1
        # Hand every request to the device before the caller moves on: a transport driven by its caller (verbs,
        # cuda-copy) may still hold our last piece or give-back (reorder injection, in-flight limits), and a peer
        # would wait for it while this rank waits elsewhere.
        self.transport.quiet()
        self.transport.poll_completions()
        return received

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


def _awaited(incomplete, unsent) -> str:
    """What an exchange waits for, in words: rows still to come, slots still to be given back."""
    parts = ([f"the rows of host(s) {', '.join(map(str, sorted(incomplete)))}"] if incomplete else []) + \
        ([f"host(s) {', '.join(map(str, sorted(unsent)))} to give back a slot for more rows"] if unsent else [])
    return " and ".join(parts)


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
