"""Native low-latency dispatch and combine: kernels that store straight into the peers'
IPC-mapped buffers (csrc/kernels/low_latency.cu describes the protocol).

No call syncs the host, so a dispatch+combine can be captured in a CUDA graph. A kernel that
waits too long for a peer records the failure in host-mapped memory and exits; the next
low-latency call (or hook) raises it as CommTimeoutError. With enable_shrink the silent peer
is masked instead.
"""

import functools
import weakref
from typing import Optional

import torch

from ...dispatch_config import low_latency_layout
from ..reference.collectives import CommTimeoutError
from .settings import mode_setting

_PHASE_NAMES = {1: "low_latency_dispatch (receive)", 2: "low_latency_combine (receive)",
                3: "low_latency_dispatch (send)", 4: "low_latency_combine (send)",
                5: "telling the peers a buffer half was read",
                6: "low_latency_combine (send, pre-reduced)"}
_SEND_PHASES = (3, 4)
_RECORDS_PHASE = 6
_TIMEOUT, _TOO_MANY_ROWS, _PROXY_STALLED = 1, 2, 3
COMBINE_ENV = "UCCL_EP_LOW_LATENCY_COMBINE"   # how the combine returns rows: "direct" or "prereduce"


def combine_mode() -> str:
    """COMBINE_ENV: "direct" (the default: each expert's rank sends every received row back, and its send waits
    for no peer, as DeepEP's) or "prereduce" (where it fits, the expert's rank first sums each token's rows over
    its experts, so a token crosses once per rank: fewer bytes, but the send waits for every peer's routing, so a
    rank whose peers start their combine later waits for them). Every rank must use the same."""
    return mode_setting(COMBINE_ENV, ("direct", "prereduce"))


def _ptr(tensor: Optional[torch.Tensor]) -> int:
    return 0 if tensor is None else tensor.data_ptr()


def dispatch_positions(topk_idx: torch.Tensor, num_experts: int, rank: int, num_ranks: int,
                       masked_ranks: Optional[torch.Tensor]) -> torch.Tensor:
    """The dispatch kernel's record of combine positions, computed with torch, ``[2, N, K]``. Plane 0: an
    entry's place in its expert's rank's block is the number of entries choosing a smaller expert of that
    rank plus the entries before it choosing the same expert, i.e. its index in the entries sorted stably
    by expert, less the index of that rank's first entry. Plane 1: its slot, the entries before it choosing
    the same expert. -1 for entries with no expert or on a masked rank (all of them when this rank is
    masked)."""
    flat = topk_idx.reshape(-1)
    valid = (flat >= 0) & (flat < num_experts)
    local_experts = num_experts // num_ranks
    owner = torch.where(valid, flat, num_experts) // local_experts
    if masked_ranks is not None:
        masked = masked_ranks.to(torch.bool)
        valid &= (masked[owner.clamp(max=num_ranks - 1)] | masked[rank]).logical_not()
    expert = torch.where(valid, flat, num_experts)      # entries without one sort last
    order = torch.argsort(expert, stable=True)
    sorted_index = torch.empty_like(order)
    sorted_index[order] = torch.arange(order.numel(), device=order.device)
    first_of_expert = torch.cumsum(torch.bincount(expert, minlength=num_experts + 1), 0)
    first_of_expert = torch.cat([first_of_expert.new_zeros(1), first_of_expert[:-1]])
    first_of_owner = first_of_expert[torch.clamp(owner * local_experts, max=num_experts)]
    positions = torch.where(valid, sorted_index - first_of_owner, -1)
    slots = torch.where(valid, sorted_index - first_of_expert[expert], -1)
    return torch.stack([positions, slots]).to(torch.int32).view((2,) + tuple(topk_idx.shape))


class NativeLowLatency:
    """``num_sms``: the device's SMs; ``proxy_path``: a ProxyPath for the peers reached through the CPU proxy, or
    None (all mapped); ``prereduce``: the combine pre-reduces where it fits (combine_mode)."""

    def __init__(self, extension, peer_buffer, rank: int, num_ranks: int, device: torch.device,
                 timeout_s: float, num_sms: int, aggressive_atomics: bool, proxy_path=None,
                 prereduce: bool = False) -> None:
        self._C = extension
        self.peer_buffer = peer_buffer
        self.proxy_path = proxy_path
        self.rank = rank
        self.num_ranks = num_ranks
        self.device = device
        self.timeout_s = timeout_s
        self.aggressive_atomics = aggressive_atomics
        self.state = extension.LowLatencyState(device.index)
        # The operations are the extension's (no Python of the engine per call): its launchers, one per sizes and
        # buffer half, get their regions from _region; the hooks check the proxy path first and raise a recorded
        # failure as check() does. Weak methods, so that the extension's object keeps no destroyed engine alive.
        self._operations = extension.LowLatencyOperations(
            self.state, device.index, prereduce, num_sms, None if proxy_path is None else proxy_path.check,
            weakref.WeakMethod(self._raise_failure), weakref.WeakMethod(self._region),
            functools.partial(dispatch_positions, rank=rank, num_ranks=num_ranks))
        # (call, masked_ranks, buffer_idx, check): ``call`` is the Buffer operation's arguments in the order of
        # buffer.py's tuple; ``check(call)`` (the Buffer's checks) runs only for a kind of call not seen pass. Each
        # allocates its outputs on the current stream and launches there (the Buffer makes its communication stream
        # current for async_finish); a hook launches on the stream its operation used, as DeepEP's do. dispatch
        # returns the reference engine's LowLatencyDispatchResult items as a plain tuple, combine (combined, hook).
        self.low_latency_dispatch = self._operations.dispatch
        self.low_latency_combine = self._operations.combine

    # ------------------------------------------------------------------ state and errors
    def check(self) -> None:
        """Raise the first failure a kernel (or the proxy) recorded (reads host memory; no sync)."""
        if self.proxy_path is not None:
            self.proxy_path.check()
        code, phase, peer, detail = self.state.status()
        if code == 0:
            return
        where = _PHASE_NAMES.get(phase, f"phase {phase}")
        if code == _TIMEOUT:
            if phase == _RECORDS_PHASE:
                what = f"for the routing of its tokens (its combine has not started; token {detail})"
            elif phase in _SEND_PHASES:
                what = ("to finish reading this buffer half (is it more than two low-latency calls behind: "
                        "at most two results may be alive?)")
            else:
                what = f"({'expert' if phase == 2 else 'local expert'} {detail})"
            raise CommTimeoutError(
                f"rank {self.rank}: {where} timed out after {self.timeout_s:g} s waiting for rank {peer} {what}; "
                "the low-latency buffers are now stale: call clean_low_latency_buffer on every rank before using "
                "them again")
        if code == _TOO_MANY_ROWS:
            raise ValueError(
                f"rank {self.rank}: low_latency_dispatch: topk_idx names expert {detail} more often than "
                "num_max_dispatch_tokens_per_rank allows, or a token names that expert's rank more than "
                "min(num_topk, local experts) times (an expert repeated within a token?)")
        if code == _PROXY_STALLED:
            raise CommTimeoutError(
                f"rank {self.rank}: {where}: the proxy FIFO for rank {peer} stayed full for {self.timeout_s:g} s "
                "(the proxy threads stopped or are stuck)")
        raise RuntimeError(f"rank {self.rank}: low-latency kernel failed with code {code} in {where}")

    def clean(self) -> None:
        """Zero this rank's flags and control words (collective: the Buffer barriers around it)."""
        self.peer_buffer.tensor.zero_()
        self.state.reset()

    def destroy(self) -> None:
        if self.proxy_path is not None:     # its transport reads the buffer: closed first
            self.proxy_path.close()
            self.proxy_path = None
        self._operations.clear()
        if self.state is not None:
            self.state.release()
            self.state = None
        if self.peer_buffer is not None:
            self.peer_buffer.release()
            self.peer_buffer = None

    def _region(self, num_max_tokens: int, hidden: int, num_experts: int, buffer_idx: int,
                masked_ranks: Optional[torch.Tensor]):
        """The LowLatencyRegion of one half for these sizes, for the extension's launcher of them: made once, not
        per call, and only for sizes that passed the caller's checks (the extension runs them first)."""
        layout = low_latency_layout(num_max_tokens, hidden, self.num_ranks, num_experts)
        proxy = dict()
        if self.proxy_path is not None:
            if layout.dispatch_msg_bytes % 16:
                raise ValueError(f"hidden={layout.hidden}: the proxy path moves 16-byte units, so hidden must be a "
                                 "multiple of 8")
            proxy = dict(via_proxy=self.proxy_path.via_proxy.data_ptr(), fifos=self.proxy_path.fifo_views,
                         num_fifos=self.proxy_path.num_fifos, outbox_offset=layout.outbox_offset(buffer_idx),
                         other_half_outbox_offset=layout.outbox_offset(1 - buffer_idx),
                         outbox_peer_bytes=layout.outbox_peer_bytes, outbox_index_pos=layout.outbox_index_pos,
                         outbox_flags_pos=layout.outbox_flags_pos, outbox_release_pos=layout.outbox_release_pos)
        return self._C.LowLatencyRegion(
            peer_bases=self.peer_buffer.peer_bases, signal_offset=layout.signal_offset(buffer_idx),
            counters_offset=layout.counters_offset(buffer_idx), release_offset=layout.release_offset(buffer_idx),
            recv_offset=layout.recv_offset(buffer_idx), control=self.state.control(buffer_idx),
            other_half_control=self.state.control(1 - buffer_idx),
            other_half_release_offset=layout.release_offset(1 - buffer_idx),
            masked=_ptr(masked_ranks), status=self.state.status_device,
            timeout_ns=int(self.timeout_s * 1e9), rank=self.rank, num_ranks=self.num_ranks,
            aggressive_atomics=self.aggressive_atomics, **proxy)

    def _raise_failure(self, code: int) -> None:
        """An operation or a hook found a failure recorded before it (code != 0): raise it."""
        self.check()
        raise RuntimeError(f"rank {self.rank}: low-latency call refused with code {code}, but no failure is recorded")
