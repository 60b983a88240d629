"""A device buffer every rank of the group maps with CUDA IPC, set up through the group.

All ranks call :func:`map_peer_buffer` together. It returns the mapped buffer, or the reason
the ranks cannot map each other (another host where that is not allowed, a failed IPC open on any
rank); every rank gets the same answer, because the decision is taken on gathered facts. Where
ranks on other hosts are allowed, each rank maps the buffers of its own host only and learns which
ranks it must reach through the CPU proxies.
"""

import os
from typing import List, Optional, Tuple

import torch
import torch.distributed as dist

from ...hosts import host_or_error, hosts_of

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


def _all_gather(group, value) -> List:
    gathered = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, value, group=group)
    return gathered


def same_on_every_rank(group, setting: str, mine: str) -> str:
    """``mine``, once every rank of ``group`` has the same value of ``setting`` (collective); else every rank raises,
    naming each rank's value."""
    values = _all_gather(group, mine)
    if any(value != mine for value in values):
        raise ValueError(f"{setting} must be the same on every rank; the ranks have "
                         + ", ".join(f"{rank}: {value!r}" for rank, value in enumerate(values)))
    return mine


def first_reason(group, mine: Optional[str]) -> Optional[str]:
    """The first rank's reason not to go on, or None where no rank has one: every rank decides the same."""
    return next((reason for reason in _all_gather(group, mine) if reason is not None), None)


class PeerBuffer:
    def __init__(self, memory, tensor: torch.Tensor, remote_ranks: List[int]) -> None:
        self.memory = memory
        self.tensor = tensor                 # uint8 view of this rank's buffer
        self.peer_bases = memory.peer_bases  # device array of every rank's base, as mapped here (0: another host)
        self.remote_ranks = remote_ranks     # the ranks on other hosts, not mapped

    def release(self) -> None:
        self.tensor = None
        if self.memory is not None:
            self.memory.release()
            self.memory = None


def ranks_on_other_hosts(group, rank: int, device: torch.device, logical_hosts: bool = True) -> List[int]:
    """The ranks of ``group`` on other hosts than this rank (other machines where ``logical_hosts`` is False).
    Collective."""
    hosts = hosts_of(_all_gather(group, host_or_error(device.index, rank, logical_hosts)))
    return [peer for peer, host in enumerate(hosts) if host != hosts[rank]]


def map_peer_buffer(extension, group, rank: int, device: torch.device, num_bytes: int, other_hosts: bool = False,
                    logical_hosts: bool = True) -> Tuple[Optional[PeerBuffer], Optional[str]]:
    """``(buffer, None)`` when every rank mapped the buffers of every other rank of its host, else ``(None,
    reason)``. Ranks on other hosts are a reason unless ``other_hosts``; then they stay unmapped
    (``buffer.remote_ranks``). ``logical_hosts`` False: the logical hosts UCCL_EP_GPUS_PER_NODE cuts a machine into
    count as one (the cuda-copy transport between them)."""
    remote = ranks_on_other_hosts(group, rank, device, logical_hosts)
    if remote and not other_hosts:
        return None, f"rank {remote[0]} is on another host, beyond NVLink"
    memory = extension.PeerMemory(num_bytes, device.index)
    handles = _all_gather(group, memory.ipc_handle())
    failure = None
    try:
        # Another host's handle cannot be opened here: an empty one leaves that rank unmapped.
        memory.open_peers([b"" if peer in remote else handle for peer, handle in enumerate(handles)], rank)
    except (RuntimeError, ValueError) as error:
        failure = f"rank {rank} could not map its peers' buffers with CUDA IPC ({error})"
    failure = first_reason(group, failure)
    if failure is not None:
        memory.release()
        return None, failure
    tensor = device_bytes(memory, memory.local_base, num_bytes, device)
    return PeerBuffer(memory, tensor, remote), None
