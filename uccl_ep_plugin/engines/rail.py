"""The rail hop of normal mode across hosts: each rank's rows to the ranks with its own local index on every host.

Three ways behind one ``exchange``: :class:`CollectiveRail`, an all-to-all over the rail's torch.distributed group
(NCCL, gloo); on GPU ranks :class:`DeviceRail`, where a kernel hands the CPU proxies the writes into the other hosts'
regions of ``num_rdma_bytes`` (verbs, tcp, or cuda-copy between the logical hosts of one machine) and copies out
what lands, with no host wait; on CPU ranks :class:`TransportRail`, where the host drives a transport itself: writes
with immediates (the rows left to come) to each rail peer, a slot at a time. Neither transport way runs a host
collective, and unordered delivery is fine for both.
"""

import itertools
import os
from typing import List, Optional

import torch
import torch.distributed as dist

from .reference.collectives import CommTimeoutError, GroupComm, wait_until

_GIVEN_BACK = 1 << 30  # an empty write's immediate: our rows are read out of its slot (row counts stay below)
_ALIGN = 64
_DEVICE_ROW_ALIGN = 16     # the GPU-driven rail moves rows in 16-byte units
# The GPU-driven rail's control area (csrc/kernels/rail.h's layout): two 16-byte words per host (a freed word and
# its staged value), the ordering layout's one counter, then two 8-byte count flags per host.
_WORD_BYTES_PER_HOST, _COUNTER_BYTES, _FLAG_BYTES_PER_HOST = 32, 16, 16


def rail_control_bytes(num_hosts: int) -> int:
    """The bytes a GPU-driven rail of ``num_hosts`` keeps for its control words at the start of its region."""
    used = (_WORD_BYTES_PER_HOST + _FLAG_BYTES_PER_HOST) * num_hosts + _COUNTER_BYTES
    return -(-used // 256) * 256


def transport_rail_bytes(num_hosts: int, rows: int, row_bytes: int) -> int:
    """num_rdma_bytes in which a rail over a transport of ``num_hosts`` hosts carries ``rows`` rows of ``row_bytes``
    from one rank to each host in one piece (a send and a receive slot per host, and the control words of the
    GPU-driven rail)."""
    width = -(-row_bytes // _DEVICE_ROW_ALIGN) * _DEVICE_ROW_ALIGN
    return rail_control_bytes(num_hosts) + 2 * num_hosts * _ALIGN * -(-rows * width // _ALIGN)


class CollectiveRail:
    name = "collective"
    writes = 0      # no transport writes: the collective carries the rows
    region = None   # nor a region of num_rdma_bytes
    row_align = 1   # rows of any width

    def __init__(self, comm: GroupComm) -> None:
        self.comm = comm
        self.label = str(dist.get_backend(comm.group)).lower()   # what carries the rows: nccl, gloo

    def exchange(self, rows: torch.Tensor, send_counts: List[int], recv_counts: List[int], phase: str) -> torch.Tensor:
        """Each host's block of ``rows`` (uint8 ``[M, W]``, by host, ``send_counts`` rows each) to the rail's rank
        there; the blocks received, by host (``recv_counts`` rows each: the layout told every rank)."""
        return self.comm.start_row_exchange(rows, send_counts, recv_counts, f"{phase}: rail rows").finish()

    def close(self, wait_for_peers: bool = False) -> None:
        pass


class DeviceRail:
    """The rail of GPU ranks over a proxies' transport, driven by the GPU: each exchange is one kernel, which copies
    each host's rows into this rank's send slot for it, hands the proxy the write into that host's receive slot (with
    an immediate) and a count flag announcing it, which the receiving proxy releases once the write has landed, and
    copies every source's rows out as their flags are released, freeing its slot with a write back
    (csrc/kernels/rail.h). A block larger than a slot goes in pieces. Over a NIC the host only launches
    the kernel (no host wait, no host copy); over the stand-in transports it also waits for it (``settles``). A
    failed wait on the device (a silent peer) is raised by the next exchange, or by :meth:`check`, naming the rank,
    the phase and what was awaited."""

    name = "device"
    row_align = _DEVICE_ROW_ALIGN

    def __init__(self, group: dist.ProcessGroup, host: int, num_hosts: int, device: torch.device, num_bytes: int,
                 transport: str, timeout_s: float, extension) -> None:
        from ..proxies import ProxyThreads

        self.group, self.host, self.num_hosts, self.num_bytes, self.timeout_s = group, host, num_hosts, num_bytes, \
            timeout_s
        self.label = transport
        # The stand-in transports (cuda-copy, tcp) move GPU memory through the CUDA runtime from the proxy's
        # threads, and a kernel of the caller's that waits meanwhile (a collective's) or a blocking runtime call
        # holds those copies while the peer's rail kernel waits for them (KERNEL_NOTES.md, the proxy path's "Late
        # delivery"). Over them an exchange returns only once its kernel is done and the proxy has delivered its
        # last writes. A NIC moves the bytes without the runtime: over verbs the exchanges stay asynchronous.
        self.settles = transport != "verbs"
        self.writes = 0                      # transport writes asked of the proxy (rows, counts, freed slots)
        self._phases = {}                    # exchange number -> its phase, for a failure's message
        self.region = self.peer_buffer = self.threads = self.native = None
        sizes = [None] * num_hosts
        dist.all_gather_object(sizes, num_bytes, group=group)
        differ = _sizes_differ(sizes)
        if differ:   # the slots' places must agree on both ends: every rank raises alike
            raise ValueError(differ)
        if num_bytes < transport_rail_bytes(num_hosts, 1, _DEVICE_ROW_ALIGN):
            raise ValueError(_no_room(num_bytes, num_hosts, transport))
        try:
            self.region, memory, self.peer_buffer = _rail_region(extension, transport, group, host, num_bytes, device)
            ordering = dict(num_counters=1, counters_offset=extension.rail_counters_offset(num_hosts),
                            flags_offset=extension.rail_flags_offset(num_hosts))
            self.threads = ProxyThreads(group, host, num_hosts, memory, device, transport=transport,
                                        low_latency=False, timeout_s=timeout_s, extension=extension,
                                        ordering=ordering)
            self.native = extension.DeviceRail(self.region.data_ptr(), num_bytes, host, num_hosts,
                                               self.threads.device_views, self.threads.num_fifos, timeout_s,
                                               device.index)
        except BaseException:
            self.close()
            raise

    def exchange(self, rows: torch.Tensor, send_counts: List[int], recv_counts: List[int], phase: str) -> torch.Tensor:
        self.check()
        width = rows.size(1)
        if width > self.native.slot_bytes:   # the same on every rank: all of them raise before any write
            needed = transport_rail_bytes(self.num_hosts, 1, width)
            raise ValueError(f"rank {dist.get_rank()}: {phase}: a row of {width} bytes needs num_rdma_bytes >= "
                             f"{needed} to cross hosts; the Buffer has {self.num_bytes}")
        rows = rows.contiguous()
        received = torch.empty((sum(recv_counts), width), dtype=torch.uint8, device=rows.device)
        number = self.native.exchanges + 1
        self._phases[number] = phase
        self._phases.pop(number - 8, None)   # a failure is raised within a few exchanges
        stream = torch.cuda.current_stream(rows.device)
        self.writes += self.native.exchange(rows.data_ptr(), received.data_ptr(), width, send_counts, recv_counts,
                                            stream.cuda_stream)
        if self.settles:
            stream.synchronize()
            self.threads.drain(self.timeout_s)
            self.check()
        return received

    def check(self) -> None:
        """Raise what the proxy or the rail's kernels recorded: a failed command or transport, or a wait that timed
        out (CommTimeoutError) or found a count it did not expect."""
        if self.threads is not None:
            self.threads.check()
        failure = self.native.failure() if self.native is not None else None
        if failure is None:
            return
        phase = self._phases.get(failure["exchange"], "an exchange across hosts")
        peer, expected, seen = failure["peer"], failure["expected"], failure["seen"]
        where = f"rank {dist.get_rank()}: {phase} (rail over {self.label}, GPU-driven)"
        if failure["what"] == "bad_count":
            raise RuntimeError(f"{where}: host {peer}'s count flag announced {seen} writes for a piece of {expected}")
        awaited = {
            "freed": f"host {peer} to free its slot for this rank's piece {expected + 1} (it freed up to piece {seen})",
            "arrived": f"piece {expected} of host {peer}'s rows (its count flag was not released: the rows or the "
                       "flag did not land)",
            "fifo_full": f"the proxy to take commands for host {peer} (its FIFO stayed full)",
        }.get(failure["what"], f"host {peer}")
        raise CommTimeoutError(f"uccl_ep_plugin: {where}: timed out after {self.timeout_s:g}s waiting for {awaited}")

    def close(self, wait_for_peers: bool = False) -> None:
        """Stop the rail (idempotent). ``wait_for_peers`` (a collective close, as Buffer.destroy()): every rank's
        proxy has delivered its last writes before any rank closes its transport."""
        if self.native is not None:
            self.native.release()   # waits for the device: the kernels pushed their last commands
            self.native = None
        if self.threads is not None:
            try:
                if wait_for_peers:
                    self.threads.drain(self.timeout_s)
                    dist.barrier(group=self.group)
            finally:
                self.threads.close()
                self.threads = None
        self.region = None
        if self.peer_buffer is not None:   # after the proxy, whose transport copies into it
            self.peer_buffer.release()
            self.peer_buffer = None


class TransportRail:
    """The rail of CPU ranks over a proxies' transport (tcp, verbs), driven by the host. This rank's region (host
    memory) holds one send slot and one receive slot per host. Every
    message is a write with an immediate: a piece of rows (at most a slot) announcing how many rows are left with it,
    and an empty write that gives a slot back once its rows are read (no atomics: EFA's SRD has none). A block larger
    than a slot goes piece by piece, each after the receiver gave the slot back, so a region far smaller than a whole
    dispatch serves it."""

    name = "transport"
    row_align = 1

    def __init__(self, group: dist.ProcessGroup, host: int, num_hosts: int, device: torch.device, num_bytes: int,
                 transport: str, timeout_s: float, extension) -> None:
        self.host, self.num_hosts, self.num_bytes, self.timeout_s = host, num_hosts, num_bytes, timeout_s
        self.label = transport
        self.slot_bytes = num_bytes // (2 * num_hosts) // _ALIGN * _ALIGN
        if self.slot_bytes <= 0:
            raise ValueError(_no_room(num_bytes, num_hosts, transport))
        self.region = self.transport = None
        try:
            self.region, self.transport = _open_transport(extension, transport, host, num_hosts, num_bytes, timeout_s)
            mine = (self.transport.listen_address(), None, num_bytes)
        except Exception as error:   # every rail peer hears of it instead of waiting for this one
            mine = (None, f"rank {dist.get_rank()}: {type(error).__name__}: {error}", num_bytes)
        records = [None] * num_hosts
        dist.all_gather_object(records, mine, group=group)
        failure = next((why for _, why, _ in records if why is not None), None)
        if failure is None:   # the pieces' size is the slot's: both ends must agree on it
            failure = _sizes_differ([size for _, _, size in records])
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
            for host, count in pieces.items():   # staged in the send slot, then written
                offset = self.slot_bytes * host
                self.region[offset:offset + count * width].view(count, width).copy_(
                    rows[start[host]:start[host] + count])
                self.transport.write(host, self.slot_bytes * host, self._slot(self.host), count * width,
                                     imm=left[host])
                left[host] -= count
                start[host] += count
                self.sent[host] += 1
                self.writes += 1
                if left[host] == 0:
                    unsent.discard(host)
            for source in arrivals:   # read every piece out, then give the slots back
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
            for source in arrivals:   # that host may write into our slot for it again
                self.transport.write(source, 0, 0, 0, imm=_GIVEN_BACK)
                self.writes += 1
        # Hand every request to the device before the caller moves on: a transport driven by its caller (verbs)
        # may still hold our last piece or give-back (reorder injection, in-flight limits), and a peer
        # would wait for it while this rank waits elsewhere.
        self.transport.quiet()
        self.transport.poll_completions()
        return received

    def _wait(self, ready, phase: str, expected: str) -> None:
        def polled() -> bool:
            self._poll()
            return ready()

        wait_until(polled, self.timeout_s, dist.get_rank(), phase, f"{expected} (rail transport)")

    def close(self, wait_for_peers: bool = False) -> None:
        if self.transport is not None:
            self.transport.close()
            self.transport = None
        self.region = None


def _sizes_differ(sizes: List[int]) -> Optional[str]:
    """What is wrong where the ranks of a rail gave different num_rdma_bytes (``sizes``, by host), else None."""
    if len(set(sizes)) <= 1:
        return None
    return "num_rdma_bytes differs between the ranks of a rail: " + ", ".join(
        f"host {h}: {size}" for h, size in enumerate(sizes))


def _no_room(num_bytes: int, num_hosts: int, transport: str) -> str:
    return (f"num_rdma_bytes={num_bytes} leaves no room for normal mode's rows across {num_hosts} hosts over the "
            f"{transport} transport")


def _awaited(incomplete, unsent) -> str:
    """What an exchange waits for, in words: rows still to come, slots still to be given back."""
    parts = ([f"the rows of host(s) {', '.join(map(str, sorted(incomplete)))}"] if incomplete else []) + \
        ([f"host(s) {', '.join(map(str, sorted(unsent)))} to give back a slot for more rows"] if unsent else [])
    return " and ".join(parts)


def _rail_region(extension, transport: str, group, rank: int, num_bytes: int, device: torch.device):
    """``(region, memory, peer_buffer)`` of a GPU rank: its zeroed region of ``num_bytes`` (collective over the rail's
    ``group``), what the proxies' transport is built on (the CUDA IPC mapping over cuda-copy, else the region), and
    that mapping (None but over cuda-copy)."""
    from .native.peers import map_peer_buffer

    if transport == "cuda-copy":   # logical hosts of one machine: the rail's ranks map each other's regions
        peer_buffer, reason = map_peer_buffer(extension, group, rank, device, num_bytes, logical_hosts=False)
        if peer_buffer is None:
            raise RuntimeError(f"the cuda-copy transport carries the hop between the logical hosts of one machine "
                               f"only: {reason}")
        return peer_buffer.tensor, peer_buffer.memory, peer_buffer
    region = torch.zeros(num_bytes, dtype=torch.uint8, device=device)
    return region, region, None


def _open_transport(extension, transport: str, rank: int, num_ranks: int, num_bytes: int, timeout_s: float):
    """``(region, transport)`` of a CPU rank: its region of ``num_bytes`` in host memory and the transport over it."""
    from ..platform_config import resolve_config
    from ..proxies import verbs_device, verbs_settings

    region = torch.zeros(num_bytes, dtype=torch.uint8)
    if transport == "tcp":
        return region, extension.TcpTransport(rank, num_ranks, region.data_ptr(), region.numel(), timeout_s=timeout_s)
    if transport == "verbs":
        return region, extension.VerbsTransport(rank, num_ranks, region.data_ptr(), region.numel(),
                                                device=verbs_device(None), gpu=-1, timeout_s=timeout_s,
                                                **verbs_settings(resolve_config()))
    raise ValueError(f"the rail of CPU ranks runs over tcp or verbs, not {transport!r}")


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
    features = [TRANSPORT_FEATURES[transport], "device_rail"] if device.type == "cuda" else [f"{transport}_transport"]
    missing = [feature for feature in features if feature not in extension.build_info()["features"]]
    if missing:
        return f"this build has no {missing[0]}"
    if num_bytes <= 0:
        return (f"UCCL_EP_PROXY_TRANSPORT={transport} carries normal mode across hosts in num_rdma_bytes, "
                f"which is 0")
    # cuda-copy reaches only the logical hosts of this machine: its own mapping says so if a peer is on another.
    return None if transport == "cuda-copy" else cross_host_reason(extension)
