"""A device buffer every rank of the group maps with CUDA IPC, set up through the group.

All ranks call :func:`map_peer_buffer` together. It returns the mapped buffer, or the reason
the ranks cannot map each other (another host, a failed IPC open on any rank); every rank gets
the same answer, because the decision is taken on gathered facts.
"""

import os
import socket
from typing import List, Optional, Tuple

import torch
import torch.distributed as dist

FORCE_PROXY_ENV = "UCCL_EP_FORCE_PROXY"


class _DeviceBytes:
    """Exposes ``num_bytes`` at ``address`` to torch (``__cuda_array_interface__``); the tensor keeps it alive."""

    def __init__(self, owner, address: int, num_bytes: int) -> None:
        self.owner = owner
        self.__cuda_array_interface__ = {"shape": (num_bytes,), "typestr": "|u1", "data": (address, False),
                                         "version": 3, "strides": None, "stream": None}


def device_bytes(owner, address: int, num_bytes: int, device: torch.device) -> torch.Tensor:
    """A uint8 tensor over ``num_bytes`` of CUDA memory at ``address`` (no copy); it keeps ``owner`` alive."""
    return torch.as_tensor(_DeviceBytes(owner, address, num_bytes), device=device)


def force_proxy() -> bool:
    return os.environ.get(FORCE_PROXY_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def _host_id() -> str:
    # The boot id tells two machines with one hostname apart (containers often share names).
    try:
        with open("/proc/sys/kernel/random/boot_id") as boot:
            return f"{socket.gethostname()}/{boot.read().strip()}"
    except OSError:
        return socket.gethostname()


def _all_gather(group, value) -> List:
    gathered = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, value, group=group)
    return gathered


class PeerBuffer:
    def __init__(self, memory, tensor: torch.Tensor) -> None:
        self.memory = memory
        self.tensor = tensor                 # uint8 view of this rank's buffer
        self.peer_bases = memory.peer_bases  # device array of every rank's base, as mapped here

    def release(self) -> None:
        self.tensor = None
        if self.memory is not None:
            self.memory.release()
            self.memory = None


def map_peer_buffer(extension, group, rank: int, device: torch.device, num_bytes: int
                    ) -> Tuple[Optional[PeerBuffer], Optional[str]]:
    """``(buffer, None)`` when every rank mapped every other's buffer, else ``(None, reason)``."""
    hosts = _all_gather(group, _host_id())
    other_hosts = [peer for peer, host in enumerate(hosts) if host != hosts[rank]]
    if other_hosts:
        return None, f"rank {other_hosts[0]} is on another host, beyond NVLink"
    memory = extension.PeerMemory(num_bytes, device.index)
    handles = _all_gather(group, memory.ipc_handle())
    failure = None
    try:
        memory.open_peers(handles, rank)
    except (RuntimeError, ValueError) as error:
        failure = f"rank {rank} could not map its peers' buffers with CUDA IPC ({error})"
    failures = [f for f in _all_gather(group, failure) if f is not None]
    if failures:
        memory.release()
        return None, failures[0]
    tensor = device_bytes(memory, memory.local_base, num_bytes, device)
    return PeerBuffer(memory, tensor), None
