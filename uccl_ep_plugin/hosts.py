"""Which host each rank of a group is on, and the RDMA ranks normal mode's layout counts tokens for.

A host is a machine (hostname and boot id), or a slice of one where ``UCCL_EP_GPUS_PER_NODE`` cuts it into
hosts of that many GPUs, so one machine can stand for several. Every rank computes its own host; the ranks
exchange them through the group, and a rank whose setting is bad makes every rank raise.
"""

import os
import socket
from typing import List, Optional, Sequence, Tuple

import torch

from .dispatch_config import NVL_PEERS_PER_NODE

GPUS_PER_NODE_ENV = "UCCL_EP_GPUS_PER_NODE"


def gpus_per_node() -> int:
    """UCCL_EP_GPUS_PER_NODE: how many GPUs of a machine make one host (0 where unset: the whole machine)."""
    text = os.environ.get(GPUS_PER_NODE_ENV, "").strip()
    if not text:
        return 0
    if not text.isdigit() or int(text) < 1:
        raise ValueError(f"{GPUS_PER_NODE_ENV}={text!r}: expected a positive number of GPUs")
    return int(text)


def host_id(slot: int, logical: bool = True) -> str:
    """The host of the rank in ``slot`` of its machine (its GPU's index; on CPU, its process's rank): the machine
    (its hostname with the boot id, which tells two machines with one hostname apart: containers often share
    names), cut into hosts of UCCL_EP_GPUS_PER_NODE slots where that is set (slot i is in host i // N) unless
    ``logical`` is False (then the machine itself)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as boot:
            machine = f"{socket.gethostname()}/{boot.read().strip()}"
    except OSError:
        machine = socket.gethostname()
    per_node = gpus_per_node() if logical else 0
    return f"{machine}/{slot // per_node}" if per_node else machine


def host_or_error(slot: int, rank: int, logical: bool = True) -> Tuple[Optional[str], Optional[str]]:
    """``(host, None)``, or ``(None, reason)`` naming ``rank``: what a rank contributes to the exchange of hosts
    (machines where ``logical`` is False)."""
    try:
        return host_id(slot, logical), None
    except ValueError as error:
        return None, f"rank {rank}: {error}"


def hosts_of(gathered: Sequence[Tuple[Optional[str], Optional[str]]]) -> List[str]:
    """Every rank's host from the gathered :func:`host_or_error` pairs; raises the first rank's reason, the same on
    every rank (none waits for a rank that stopped)."""
    bad = next((why for _, why in gathered if why is not None), None)
    if bad is not None:
        raise ValueError(bad)
    return [host for host, _ in gathered]


class RdmaRanks:
    """The ranks' RDMA ranks: the hosts in the order of their first rank, or, where one machine holds more than
    NVL_PEERS_PER_NODE ranks, DeepEP's groups of that many ranks (``num_tokens_per_rdma_rank`` counts the tokens
    sent to each)."""

    def __init__(self, of_rank: Sequence[int], device: torch.device) -> None:
        self.count = max(of_rank) + 1
        self.of_rank = torch.tensor(list(of_rank), dtype=torch.int64, device=device)

    @classmethod
    def of_hosts(cls, hosts: Sequence[str], device: torch.device) -> Optional["RdmaRanks"]:
        """None where every rank is on one host with at most NVL_PEERS_PER_NODE ranks (no RDMA rank to count)."""
        order = list(dict.fromkeys(hosts))
        if len(order) > 1:
            return cls([order.index(host) for host in hosts], device)
        if len(hosts) > NVL_PEERS_PER_NODE:
            return cls([rank // NVL_PEERS_PER_NODE for rank in range(len(hosts))], device)
        return None

    def token_counts(self, is_token_in_rank: torch.Tensor) -> torch.Tensor:
        """``[count]`` int32: the tokens sent to at least one rank of each RDMA rank."""
        per_rank = is_token_in_rank.to(torch.int32)
        per_host = torch.zeros((per_rank.size(0), self.count), dtype=torch.int32, device=per_rank.device)
        per_host.index_add_(1, self.of_rank, per_rank)
        return (per_host > 0).sum(0, dtype=torch.int32)
