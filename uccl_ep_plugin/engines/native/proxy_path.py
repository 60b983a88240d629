"""The proxy path of the native low-latency kernels: peers they do not map (another host, or every
peer with UCCL_EP_FORCE_PROXY=1) get what the kernels stage for them through a CPU proxy.

The kernels stage a peer's share of a phase in an outbox of their own buffer, laid out like the
peer's block, and the unit that completes the phase pushes 16-byte commands (write the data, quiet,
write the count flags) into FIFOs in pinned mapped host memory. Proxy threads execute them through a
transport chosen by UCCL_EP_PROXY_TRANSPORT: ``cuda-copy`` (default: the copy engines over CUDA IPC
mappings) or ``tcp`` (sockets, GPU memory staged through pinned host memory), the stand-in for a NIC.
"""

from typing import List

import torch

from ...proxies import ProxyThreads, proxy_transport


class ProxyPath:
    """The proxy of one rank's low-latency buffer. Collective: every rank of the group constructs it."""

    def __init__(self, extension, group, rank: int, num_ranks: int, device: torch.device, peer_buffer,
                 remote_ranks: List[int], timeout_s: float) -> None:
        transport = proxy_transport(cross_host=bool(peer_buffer.remote_ranks))
        memory = peer_buffer.memory if transport == "cuda-copy" else peer_buffer.tensor
        self.threads = ProxyThreads(group, rank, num_ranks, memory, device, transport=transport, low_latency=True,
                                    timeout_s=timeout_s, extension=extension)
        remote = torch.zeros(num_ranks, dtype=torch.uint8)
        remote[remote_ranks] = 1
        self.via_proxy = remote.to(device)

    @property
    def num_fifos(self) -> int:
        return self.threads.num_fifos

    @property
    def fifo_views(self) -> int:
        return self.threads.device_views

    def check(self) -> None:
        """Raise what the proxy recorded (a command it could not execute, a transport failure)."""
        self.threads.check()

    def close(self) -> None:
        """Stop the threads, close the transport, free the FIFOs (idempotent)."""
        self.threads.close()
