"""Performance ``Config`` (DeepEP-compatible), its per-rank-count tables and buffer size hints.

The size hints are this library's own: they describe the buffers the engines need, so
callers that size buffers from them (SGLang, vLLM, DeepEP's tests) always get enough.
"""

import os
from dataclasses import dataclass
from functools import cached_property, lru_cache

BUFFER_ALIGNMENT_BYTES = 128
NVL_PEERS_PER_NODE = 8           # ranks per NVLink domain assumed by the rdma-rank split
MAX_TOPK = 32                    # top-k supported by every operation
MAX_SCALES_PER_TOKEN = 128       # fp8 scale columns reserved per token in normal-mode queues


def _align_up(value: int, alignment: int) -> int:
    return (value + alignment - 1) // alignment * alignment


class Config:
    """Tuning of the normal (high-throughput) kernels.

    Arguments (DeepEP's, same order and defaults):
        num_sms: SMs used by the kernels; two per channel, so it must be even.
        num_max_nvl_chunked_send_tokens / num_max_nvl_chunked_recv_tokens: tokens a sender
            pushes per chunk / slots in each receiving queue, for NVLink peers.
        num_max_rdma_chunked_send_tokens / num_max_rdma_chunked_recv_tokens: the same for
            peers reached through a NIC.
    """

    def __init__(self, num_sms: int = 20,
                 num_max_nvl_chunked_send_tokens: int = 6,
                 num_max_nvl_chunked_recv_tokens: int = 256,
                 num_max_rdma_chunked_send_tokens: int = 6,
                 num_max_rdma_chunked_recv_tokens: int = 256) -> None:
        for name, value in (("num_sms", num_sms),
                            ("num_max_nvl_chunked_send_tokens", num_max_nvl_chunked_send_tokens),
                            ("num_max_nvl_chunked_recv_tokens", num_max_nvl_chunked_recv_tokens),
                            ("num_max_rdma_chunked_send_tokens", num_max_rdma_chunked_send_tokens),
                            ("num_max_rdma_chunked_recv_tokens", num_max_rdma_chunked_recv_tokens)):
            if not isinstance(value, int) or isinstance(value, bool):
                raise TypeError(f"Config: {name} must be an int, got {type(value).__name__}")
        if num_sms <= 0 or num_sms % 2 != 0:
            raise ValueError(f"Config: num_sms must be a positive even number, got {num_sms}")
        if not 0 < num_max_nvl_chunked_send_tokens < num_max_nvl_chunked_recv_tokens:
            raise ValueError("Config: need 0 < num_max_nvl_chunked_send_tokens < num_max_nvl_chunked_recv_tokens, "
                             f"got {num_max_nvl_chunked_send_tokens} and {num_max_nvl_chunked_recv_tokens}")
        if num_max_rdma_chunked_send_tokens <= 0 or num_max_rdma_chunked_recv_tokens <= 0:
            raise ValueError("Config: RDMA chunk sizes must be positive, got "
                             f"{num_max_rdma_chunked_send_tokens} and {num_max_rdma_chunked_recv_tokens}")
        # Receiving queues hold whole send chunks, and a sender must always find half the queue free.
        rdma_recv = _align_up(num_max_rdma_chunked_recv_tokens, num_max_rdma_chunked_send_tokens)
        if num_max_rdma_chunked_send_tokens > rdma_recv // 2:
            raise ValueError("Config: num_max_rdma_chunked_send_tokens must be at most half of "
                             f"num_max_rdma_chunked_recv_tokens, got {num_max_rdma_chunked_send_tokens} and {rdma_recv}")
        self.num_sms = num_sms
        self.num_max_nvl_chunked_send_tokens = num_max_nvl_chunked_send_tokens
        self.num_max_nvl_chunked_recv_tokens = num_max_nvl_chunked_recv_tokens
        self.num_max_rdma_chunked_send_tokens = num_max_rdma_chunked_send_tokens
        self.num_max_rdma_chunked_recv_tokens = rdma_recv

    @property
    def num_channels(self) -> int:
        return self.num_sms // 2

    def _queue_bytes(self, hidden_bytes: int, num_peers: int, num_slots: int) -> int:
        # Per channel and peer: head/tail/start/end counters, then per slot the row,
        # its source index, top-k ids and weights, and fp8 scales.
        per_slot = hidden_bytes + 4 + MAX_TOPK * (8 + 4) + MAX_SCALES_PER_TOKEN * 4
        per_queue = 4 * 4 + num_slots * per_slot
        return self.num_channels * num_peers * per_queue

    def get_nvl_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        """Bytes of the NVLink buffer needed for rows of ``hidden_bytes`` among ``num_ranks`` ranks."""
        _check_positive("hidden_bytes", hidden_bytes)
        _check_positive("num_ranks", num_ranks)
        num_nvl_peers = min(num_ranks, NVL_PEERS_PER_NODE)
        num_bytes = num_ranks * num_ranks * 4 + 4096  # rank prefix matrix and per-expert counts
        num_bytes += self._queue_bytes(hidden_bytes, num_nvl_peers, self.num_max_nvl_chunked_recv_tokens)
        return _align_up(num_bytes, BUFFER_ALIGNMENT_BYTES)

    def get_rdma_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        """Bytes of the NIC-registered buffer for normal mode; 0 when all ranks share one node. A node holds
        UCCL_EP_GPUS_PER_NODE ranks where that cuts machines into hosts, else torchrun's LOCAL_WORLD_SIZE, else
        8 (DeepEP's assumption)."""
        _check_positive("hidden_bytes", hidden_bytes)
        _check_positive("num_ranks", num_ranks)
        per_node = _ranks_per_node()
        if num_ranks <= per_node:
            return 0
        num_rdma_peers = (num_ranks + per_node - 1) // per_node
        # Send and receive queues per peer node.
        num_bytes = 2 * self._queue_bytes(hidden_bytes, num_rdma_peers, self.num_max_rdma_chunked_recv_tokens)
        return _align_up(num_bytes, BUFFER_ALIGNMENT_BYTES)

    def __repr__(self) -> str:
        return (f"Config(num_sms={self.num_sms}, num_max_nvl_chunked_send_tokens={self.num_max_nvl_chunked_send_tokens}, "
                f"num_max_nvl_chunked_recv_tokens={self.num_max_nvl_chunked_recv_tokens}, "
                f"num_max_rdma_chunked_send_tokens={self.num_max_rdma_chunked_send_tokens}, "
                f"num_max_rdma_chunked_recv_tokens={self.num_max_rdma_chunked_recv_tokens})")


def _ranks_per_node() -> int:
    from .hosts import gpus_per_node   # hosts.py reads this module's constants

    local = os.environ.get("LOCAL_WORLD_SIZE", "").strip()
    return gpus_per_node() or (int(local) if local.isdigit() and int(local) > 0 else NVL_PEERS_PER_NODE)


def _check_positive(name: str, value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


# Default chunking until the native kernels are tuned (their issue records the sweep): NVLink queues of
# 256 slots filled in chunks of 8; NIC queues grow with the number of peer nodes so each stays busy.
def _default_config(num_sms: int, num_ranks: int, nvl_send: int) -> Config:
    _check_positive("num_ranks", num_ranks)
    num_nodes = (num_ranks + NVL_PEERS_PER_NODE - 1) // NVL_PEERS_PER_NODE
    rdma_recv = 128 if num_nodes <= 2 else 256
    return Config(num_sms, nvl_send, 256, 8, rdma_recv)


def dispatch_config(num_sms: int, num_ranks: int) -> Config:
    return _default_config(num_sms, num_ranks, nvl_send=8)


def combine_config(num_sms: int, num_ranks: int) -> Config:
    return _default_config(num_sms, num_ranks, nvl_send=4)


@dataclass(frozen=True)
class LowLatencyLayout:
    """Byte layout of the low-latency region: two alternating halves, each with a signal
    area (a 64-bit flag per (source rank, local expert): epoch and row count; counters; release
    counts), a send area, a receive area and an outbox per peer (what is sent to a peer reached
    through the CPU proxy, staged in the layout of its block there).

    The send area is large enough for the combine payload of every local expert, so
    ``get_next_low_latency_combine_buffer`` can hand out a ``[El, R*T, H]`` bf16 view of it.

    Sizes are computed once per instance, and ``low_latency_layout`` keeps one instance per shape:
    every low-latency call reads several offsets, each of which sums most of them.
    """

    num_max_dispatch_tokens_per_rank: int
    hidden: int
    num_ranks: int
    num_experts: int

    @cached_property
    def dispatch_msg_bytes(self) -> int:
        # 16-byte header (source token), then the larger of a bf16 row and an fp8 row with its scales.
        num_scales = (self.hidden + 127) // 128
        return 16 + max(2 * self.hidden, self.hidden + 4 * num_scales)

    @cached_property
    def combine_msg_bytes(self) -> int:
        # The bf16 row, then an 8-byte LogFMT header per 128 channels, in whole 16-byte units.
        num_groups = (self.hidden + 127) // 128
        return _align_up(2 * self.hidden + 8 * num_groups, 16)

    @cached_property
    def local_experts(self) -> int:
        return self.num_experts // self.num_ranks

    # A proxy moves whole 16-byte units, so each source's flags and index entries are padded to them
    # (low_latency.h has the same rules).
    @cached_property
    def flags_per_source(self) -> int:
        return _align_up(self.local_experts, 2)

    @cached_property
    def index_per_source(self) -> int:
        return _align_up(self.local_experts * self.num_max_dispatch_tokens_per_rank, 4)

    @cached_property
    def _counters_start(self) -> int:
        # After the flags [source][flags_per_source]: this rank's own int32 counters: rows sent per expert,
        # then per peer the units and the rows staged for it (the proxy path).
        return 8 * self.num_ranks * self.flags_per_source

    @cached_property
    def _release_start(self) -> int:
        return _align_up(self._counters_start + 4 * self.num_experts + 8 * self.num_ranks, 16)

    @cached_property
    def signal_bytes(self) -> int:
        # Then, per rank (16 bytes each), how many uses of this half it has finished reading.
        return _align_up(self._release_start + 16 * self.num_ranks, BUFFER_ALIGNMENT_BYTES)

    def counters_offset(self, buffer_idx: int) -> int:
        return self.signal_offset(buffer_idx) + self._counters_start

    def release_offset(self, buffer_idx: int) -> int:
        return self.signal_offset(buffer_idx) + self._release_start

    def recv_offset(self, buffer_idx: int) -> int:
        return self.send_offset(buffer_idx) + self.send_bytes

    def outbox_offset(self, buffer_idx: int) -> int:
        return self.recv_offset(buffer_idx) + self.recv_bytes

    @cached_property
    def send_bytes(self) -> int:
        t, e = self.num_max_dispatch_tokens_per_rank, self.num_experts
        return _align_up(max(t * self.dispatch_msg_bytes, e * t * self.combine_msg_bytes), BUFFER_ALIGNMENT_BYTES)

    @cached_property
    def _combine_rows_per_source(self) -> int:
        # At most min(top-k, local experts) rows per token; the top-k is not known here: its largest value.
        return self.num_max_dispatch_tokens_per_rank * min(MAX_TOPK, self.local_experts)

    @cached_property
    def recv_bytes(self) -> int:
        # Dispatch: a message per (source rank, token) and the row index [source][index_per_source].
        # Combine: per source rank a block of the rows its experts return (the pre-reduced combine puts a
        # two-row slot per token there, then that rank's routing records: csrc/kernels/low_latency.h).
        t, r = self.num_max_dispatch_tokens_per_rank, self.num_ranks
        dispatch = r * t * self.dispatch_msg_bytes + 4 * r * self.index_per_source
        combine = r * self._combine_rows_per_source * self.combine_msg_bytes
        return _align_up(max(dispatch, combine), BUFFER_ALIGNMENT_BYTES)

    # The outbox for one peer (the proxy path): what this rank sends it, in the layout of its block there.
    @cached_property
    def outbox_index_pos(self) -> int:
        return _align_up(self.num_max_dispatch_tokens_per_rank * self.dispatch_msg_bytes, 16)

    @cached_property
    def outbox_flags_pos(self) -> int:
        dispatch = self.outbox_index_pos + 4 * self.index_per_source
        return _align_up(max(dispatch, self._combine_rows_per_source * self.combine_msg_bytes), 16)

    @cached_property
    def outbox_release_pos(self) -> int:
        return self.outbox_flags_pos + 8 * self.flags_per_source

    @cached_property
    def outbox_peer_bytes(self) -> int:
        return self.outbox_release_pos + 16

    @cached_property
    def outbox_bytes(self) -> int:
        return _align_up(self.num_ranks * self.outbox_peer_bytes, BUFFER_ALIGNMENT_BYTES)

    @cached_property
    def half_bytes(self) -> int:
        return self.signal_bytes + self.send_bytes + self.recv_bytes + self.outbox_bytes

    @cached_property
    def total_bytes(self) -> int:
        return 2 * self.half_bytes

    def signal_offset(self, buffer_idx: int) -> int:
        return buffer_idx * self.half_bytes

    def send_offset(self, buffer_idx: int) -> int:
        return buffer_idx * self.half_bytes + self.signal_bytes


@lru_cache(maxsize=64)
def low_latency_layout(num_max_dispatch_tokens_per_rank: int, hidden: int, num_ranks: int,
                       num_experts: int) -> LowLatencyLayout:
    return LowLatencyLayout(num_max_dispatch_tokens_per_rank, hidden, num_ranks, num_experts)


def low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank: int, hidden: int, num_ranks: int,
                               num_experts: int) -> int:
    for name, value in (("num_max_dispatch_tokens_per_rank", num_max_dispatch_tokens_per_rank), ("hidden", hidden),
                        ("num_ranks", num_ranks), ("num_experts", num_experts)):
        _check_positive(name, value)
    layout = low_latency_layout(num_max_dispatch_tokens_per_rank, hidden, num_ranks, num_experts)
    return _align_up(layout.total_bytes, BUFFER_ALIGNMENT_BYTES)
