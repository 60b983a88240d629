"""A proxy over one rank's region, for each kind of memory and transport the proxy tests run on, and the
FIFOs to push its commands into."""

import os

import torch

from tests.multiprocess import rank_device
from uccl_ep_plugin import _C


class _MappedFifo:
    """One FIFO of a MappedFifos (host producers), with HostFifo's push/pushed/taken."""

    def __init__(self, fifos, index):
        self.fifos, self.index = fifos, index

    def push(self, kind, *args, **kwargs):
        self.fifos.push(self.index, kind, *args, **kwargs)

    @property
    def pushed(self):
        return self.fifos.pushed(self.index)

    @property
    def taken(self):
        return self.fifos.taken(self.index)


def proxy_over(transport, rank, num_ranks, group, num_bytes, config, reorder_seed):
    """(region tensor, the FIFOs to push into, proxy, what to close). tcp: a host tensor and HostFifos
    (tcp-staged: the host tensor staged as device memory is, through the smallest staging); verbs: a host
    tensor and HostFifos, over this host's RDMA devices (rank r uses the r-th, round robin); tcp-device:
    a tensor on this rank's GPU, staged, and FIFOs in mapped host memory; cuda-copy: this rank's GPU
    buffer mapped by every rank (CUDA IPC) and FIFOs in mapped host memory."""
    num_fifos = 3
    if transport == "verbs":
        from tests.transport_exchange import rdma_devices
        devices = rdma_devices()
        region = torch.zeros(num_bytes, dtype=torch.uint8)
        fifos = [_C.HostFifo(256) for _ in range(num_fifos)]
        proxy = _C.Proxy.over_verbs(rank, num_ranks, region.data_ptr(), num_bytes, fifos, num_threads=2, config=config,
                                    reorder_seed=reorder_seed, transport_timeout_s=30.0,
                                    device=devices[rank % len(devices)])
        return region, fifos, proxy, []
    if transport in ("tcp", "tcp-staged"):
        if transport == "tcp-staged":
            os.environ["UCCL_EP_TCP_STAGING_BYTES"] = str(1 << 16)
        region = torch.zeros(num_bytes, dtype=torch.uint8)
        fifos = [_C.HostFifo(256) for _ in range(num_fifos)]
        proxy = _C.Proxy(rank, num_ranks, region.data_ptr(), num_bytes, fifos, num_threads=2, config=config,
                         reorder_seed=reorder_seed, transport_timeout_s=30.0,
                         _stage_host_region=transport == "tcp-staged")
        return region, fifos, proxy, []
    device = rank_device(rank)
    torch.cuda.set_device(device)
    if transport == "tcp-device":
        region = torch.zeros(num_bytes, dtype=torch.uint8, device=device)
        mapped = _C.MappedFifos(num_fifos, 256, device.index, host_producers=True)
        proxy = _C.Proxy(rank, num_ranks, region.data_ptr(), num_bytes, mapped, num_threads=2, config=config,
                         reorder_seed=reorder_seed, transport_timeout_s=30.0, device=device.index)
        return region, [_MappedFifo(mapped, f) for f in range(num_fifos)], proxy, [mapped]
    from uccl_ep_plugin.engines.native.peers import map_peer_buffer
    buffer, reason = map_peer_buffer(_C, group, rank, device, num_bytes)
    assert buffer is not None, reason
    buffer.tensor.zero_()
    mapped = _C.MappedFifos(num_fifos, 256, device.index, host_producers=True)
    proxy = _C.Proxy.over_cuda_copy(rank, num_ranks, buffer.memory, mapped, num_threads=2, config=config,
                                    reorder_seed=reorder_seed, transport_timeout_s=30.0)
    return buffer.tensor, [_MappedFifo(mapped, f) for f in range(num_fifos)], proxy, [mapped, buffer]
