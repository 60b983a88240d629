"""The proxy path of the native low-latency kernels: peers they do not map (another host, or every
peer with UCCL_EP_FORCE_PROXY=1) get what the kernels stage for them through a CPU proxy.

The kernels stage a peer's share of a phase in an outbox of their own buffer, laid out like the
peer's block, and the unit that completes the phase pushes 16-byte commands (write the data, quiet,
write the count flags) into FIFOs in pinned mapped host memory. Proxy threads execute them through a
transport chosen by UCCL_EP_PROXY_TRANSPORT: ``cuda-copy`` (default: the copy engines over CUDA IPC
mappings) or ``tcp`` (sockets, GPU memory staged through pinned host memory), the stand-in for a NIC.
"""

import os
from typing import List

import torch
import torch.distributed as dist

from ...platform_config import resolve_config

THREADS_ENV = "UCCL_EP_PROXY_THREADS"
FIFOS_ENV = "UCCL_EP_PROXY_FIFOS"
TRANSPORT_ENV = "UCCL_EP_PROXY_TRANSPORT"
FIFO_CAPACITY = 1024
# transport name -> the build feature it needs
TRANSPORT_FEATURES = {"cuda-copy": "cuda_copy_transport", "tcp": "tcp_device_memory"}


def proxy_transport() -> str:
    """The transport named by UCCL_EP_PROXY_TRANSPORT (``cuda-copy`` when unset)."""
    name = os.environ.get(TRANSPORT_ENV, "").strip().lower() or "cuda-copy"
    if name not in TRANSPORT_FEATURES:
        raise ValueError(f"{TRANSPORT_ENV}={name!r}: expected one of {sorted(TRANSPORT_FEATURES)}")
    return name


def _positive_setting(name: str, default: int) -> int:
    text = os.environ.get(name, "").strip()
    if not text:
        return default
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"{name}={text!r} is not an integer") from None
    if value < 1:
        raise ValueError(f"{name}={value} must be at least 1")
    return value


class ProxyPath:
    """The proxy of one rank's low-latency buffer. Collective: every rank of the group constructs it."""

    def __init__(self, extension, group, rank: int, num_ranks: int, device: torch.device, peer_buffer,
                 remote_ranks: List[int], timeout_s: float) -> None:
        config = extension.ProxyConfig.from_environ(resolve_config().as_environ())
        config.low_latency = True
        config.timeout_s = timeout_s
        num_threads = _positive_setting(THREADS_ENV, 2)
        num_fifos = _positive_setting(FIFOS_ENV, 4)
        self.fifos = extension.MappedFifos(num_fifos, FIFO_CAPACITY, device.index)
        options = dict(num_threads=num_threads, config=config, transport_timeout_s=timeout_s)
        self.transport = proxy_transport()
        try:
            if self.transport == "cuda-copy":
                self.proxy = extension.Proxy.over_cuda_copy(rank, num_ranks, peer_buffer.memory, self.fifos,
                                                            **options)
            else:
                region = peer_buffer.tensor
                self.proxy = extension.Proxy(rank, num_ranks, region.data_ptr(), region.numel(), self.fifos,
                                             device=device.index, **options)
            addresses = [None] * num_ranks
            dist.all_gather_object(addresses, self.proxy.listen_address(), group=group)
            self.proxy.connect(addresses)
            self.proxy.start()
        except BaseException:
            self.fifos.release()
            raise
        remote = torch.zeros(num_ranks, dtype=torch.uint8)
        remote[remote_ranks] = 1
        self.via_proxy = remote.to(device)
        self.num_fifos = num_fifos

    def check(self) -> None:
        """Raise what the proxy recorded (a command it could not execute, a transport failure)."""
        self.proxy.check()

    def close(self) -> None:
        """Stop the threads, close the transport, free the FIFOs (idempotent)."""
        if self.proxy is not None:
            self.proxy.close()
            self.proxy = None
        if self.fifos is not None:
            self.fifos.release()
            self.fifos = None
