"""Collectives over the Buffer's torch.distributed group, with a deadline on every host wait.

A peer that never joins a collective makes the waiting rank raise ``CommTimeoutError``
naming the rank, the phase and what it waited for, instead of hanging.
"""

import time
from typing import Callable, List, Optional, Sequence

import torch
import torch.distributed as dist


class CommTimeoutError(TimeoutError):
    """A rank waited longer than the configured timeout for its peers."""


def wait_until(ready: Callable[[], bool], timeout_s: float, rank: int, phase: str, expected: str) -> None:
    """Poll ``ready()`` with a pause growing from 20 us to 1 ms until it is true; after ``timeout_s`` raise
    CommTimeoutError naming the rank, the phase and what it waited for."""
    deadline = time.monotonic() + timeout_s
    pause = 20e-6
    while not ready():
        if time.monotonic() > deadline:
            raise CommTimeoutError(f"uccl_ep_plugin: rank {rank} timed out after {timeout_s:g}s in phase '{phase}' "
                                   f"waiting for {expected}")
        time.sleep(pause)
        pause = min(pause * 2, 1e-3)


class GroupComm:
    def __init__(self, group: dist.ProcessGroup, rank: int, num_ranks: int, device: torch.device,
                 timeout_s: float) -> None:
        self.group = group
        self.rank = rank
        self.num_ranks = num_ranks
        self.device = device
        self.timeout_s = timeout_s
        # Gloo moves host memory only: CUDA tensors on a gloo group are staged through the host.
        backend = str(dist.get_backend(group)).lower()
        self.wire_device = device if device.type == "cpu" or "nccl" in backend else torch.device("cpu")

    def wait(self, work, phase: str, expected: str) -> None:
        """Block the host until ``work`` completes, or raise after ``timeout_s``."""
        wait_until(work.is_completed, self.timeout_s, self.rank, phase, expected)
        work.wait()

    def all_gather_ints(self, values: torch.Tensor, phase: str) -> torch.Tensor:
        """Gather a 1-D int tensor from every rank; returns ``[num_ranks, len]`` int64 on the host."""
        return self.all_gather_rows(values.to(torch.int64), phase, on_host=True)

    def all_gather_rows(self, values: torch.Tensor, phase: str, on_host: bool = False) -> torch.Tensor:
        """Gather a 1-D tensor from every rank; returns ``[num_ranks, len]`` on ``device`` (on the host with
        ``on_host``, which waits for it there). Otherwise over NCCL the stream waits for it, not the host (as for the
        rows of an exchange)."""
        values = values.to(self.wire_device).contiguous()
        gathered = torch.empty((self.num_ranks, values.numel()), dtype=values.dtype, device=self.wire_device)
        work = dist.all_gather(list(gathered.unbind(0)), values, group=self.group, async_op=True)
        if on_host or self.wire_device.type != "cuda":
            self.wait(work, phase, f"{values.numel()} values from each of {self.num_ranks} ranks")
        else:
            work.wait()
        return gathered.cpu() if on_host else gathered.to(self.device)

    def exchange_counts(self, send_counts: Sequence[int], phase: str) -> List[int]:
        """Tell every rank how many rows it will get from us; returns the rows we will get from each."""
        send = torch.tensor(list(send_counts), dtype=torch.int64, device=self.wire_device)
        recv = torch.empty_like(send)
        work = dist.all_to_all_single(recv, send, group=self.group, async_op=True)
        self.wait(work, phase, f"row counts from {self.num_ranks} ranks")
        return recv.cpu().tolist()

    def barrier(self, phase: str) -> None:
        token = torch.zeros(1, dtype=torch.int64, device=self.wire_device)
        work = dist.all_reduce(token, group=self.group, async_op=True)
        self.wait(work, phase, f"all {self.num_ranks} ranks to arrive")

    def start_row_exchange(self, send_rows: torch.Tensor, send_counts: Sequence[int], recv_counts: Sequence[int],
                           phase: str) -> "PendingExchange":
        """Start an all-to-all of byte rows; rows for rank ``i`` are the ``i``-th block of ``send_rows``."""
        recv_rows = torch.empty((sum(recv_counts), send_rows.size(1)), dtype=torch.uint8, device=self.wire_device)
        work = dist.all_to_all_single(recv_rows, send_rows.to(self.wire_device).contiguous(), list(recv_counts),
                                      list(send_counts), group=self.group, async_op=True)
        return PendingExchange(self, work, recv_rows, phase, sum(recv_counts))


class PendingExchange:
    """An all-to-all in flight; ``finish()`` returns the received rows."""

    def __init__(self, comm: GroupComm, work, recv_rows: torch.Tensor, phase: str, num_rows: int) -> None:
        self._comm = comm
        self._work = work
        self._recv_rows = recv_rows
        self._phase = phase
        self._num_rows = num_rows
        self.started = time.monotonic_ns()
        self.waited_ns = 0

    def finish(self) -> torch.Tensor:
        if self._work is not None:
            if self._comm.wire_device.type == "cuda":
                # The stream waits, not the host: later kernels are ordered after the exchange.
                self._work.wait()
            else:
                self._comm.wait(self._work, self._phase, f"{self._num_rows} rows from the other ranks")
            self.waited_ns = time.monotonic_ns() - self.started
            self._work = None
            self._recv_rows = self._recv_rows.to(self._comm.device)
        return self._recv_rows


def run_once(action: Callable[[], None]) -> Callable[[], None]:
    """A receive hook: does ``action`` on the first call, nothing on later calls."""
    done: List[bool] = [False]

    def hook() -> None:
        if not done[0]:
            done[0] = True
            action()

    return hook


def optional_cpu(tensor: Optional[torch.Tensor]) -> Optional[list]:
    return None if tensor is None else tensor.cpu().tolist()
