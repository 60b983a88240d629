"""Normal-mode dispatch and combine across hosts in two hops.

A token crosses to each host that needs it once, to the rank there with the sender's own local index (its
rail), which forwards it inside that host through an intranode Buffer (NVLink kernels on GPUs). The combine
sums inside each host first; only the hosts' partial sums cross back, and the source rank adds them in host
order.

The rail hop is an all-to-all over the rail's group (the collective backend: NCCL or gloo), or writes through a
transport of the CPU proxies (rail.py). Received rows come out grouped by source rank in rank order, in token order
within a source, as from every other path: the forward hop delivers them by forwarding rank, then by source
host, and one gather puts them in rank order.
"""

import time
from contextlib import contextmanager
from typing import Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from .rail import CollectiveRail, DeviceRail, TransportRail, transport_rail_bytes
from .reference.collectives import GroupComm
from .reference.normal import DispatchResult, exchange_layout
from .reference.rows import pack_rows, row_spec, segment_ids, unpack_rows

ROUTE_ATTRIBUTE = "_uccl_ep_rail_route"   # kept on the handle's rank_prefix_matrix: it travels with the handle


def rail_rdma_bytes(num_hosts: int, gpus_per_host: int, num_tokens: int, hidden: int, num_topk: int) -> int:
    """num_rdma_bytes for the hop between hosts over a proxies' transport (verbs, tcp, cuda-copy): all of a rank's
    ``num_tokens`` tokens to every host at worst, each as a bf16 dispatch row (the widest: the row, which of the
    host's ranks take it, its index, its experts and weights) or a combine row (the partial sum and its weights):
    every exchange in one piece per host. A smaller region serves too, in more pieces."""
    dispatch_row = 2 * hidden + gpus_per_host + 4 + (8 + 4) * num_topk
    combine_row = 2 * hidden + 4 * num_topk
    return transport_rail_bytes(num_hosts, num_tokens, max(dispatch_row, combine_row))


def even_hosts(hosts: Sequence[str]) -> Tuple[int, int]:
    """``(number of hosts, ranks per host)`` where every host holds the same number of consecutive ranks, else a
    ValueError naming every host with its ranks."""
    order = list(dict.fromkeys(hosts))
    per_host = len(hosts) // len(order)
    if per_host * len(order) == len(hosts) and all(host == order[rank // per_host] for rank, host in enumerate(hosts)):
        return len(order), per_host
    listed = "; ".join(f"{host}: {hosts.count(host)} GPUs (ranks "
                       f"{', '.join(str(rank) for rank, theirs in enumerate(hosts) if theirs == host)})"
                       for host in order)
    raise ValueError(f"normal mode across hosts needs the same number of GPUs on every host, as consecutive "
                     f"ranks; the group has {listed}")


class HopTimes:
    """Where the last dispatch or combine spent its time, hop by hop, for the bench (off unless ``enabled``): CUDA
    events on the caller's stream (read once the call's work is done) or, on CPU ranks, the host's clock; with the
    bytes the rail sent to other hosts and the transport writes it took."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.enabled = False
        self.reset()

    def reset(self) -> None:
        self._spans: Dict[str, List[Tuple[object, object]]] = {}
        self.rail_bytes = self.rail_writes = 0

    def _now(self):
        if self.device.type != "cuda":
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    @contextmanager
    def span(self, hop: str):
        if not self.enabled:
            yield
            return
        begin = self._now()
        yield
        self._spans.setdefault(hop, []).append((begin, self._now()))

    def last(self) -> Dict[str, float]:
        """``rail_s`` and ``forward_s`` (seconds in each hop), ``rail_bytes`` and ``rail_writes`` of the last call."""
        def seconds(begin, end) -> float:
            return begin.elapsed_time(end) / 1e3 if self.device.type == "cuda" else end - begin

        spent = {hop: sum(seconds(*span) for span in spans) for hop, spans in self._spans.items()}
        return dict(rail_s=spent.get("rail", 0.0), forward_s=spent.get("forward", 0.0),
                    rail_bytes=float(self.rail_bytes), rail_writes=float(self.rail_writes))


class RailRoute(NamedTuple):
    """What one dispatch sent along its rail, for its cached dispatches and its combine."""
    send_tokens: torch.Tensor     # this rank's tokens sent, by destination host, in token order within one
    send_counts: List[int]        # tokens sent to each host
    recv_counts: List[int]        # tokens received from each host (and forwarded inside this one)
    inner_handle: Tuple           # the forward hop's handle, of this host's Buffer
    order: torch.Tensor           # received row k in rank order is row order[k] of the forward hop
    num_rows: int                 # rows of this rank's outputs (num_worst_tokens, else the rows received)


class TwoLevel:
    """The two hops for one rank of ``everyone`` (the group's timed collectives, the reference engine's). ``hosts``:
    every rank's host (even: :func:`even_hosts`); ``make_inner(group)`` makes the Buffer over one host's ranks.
    Collective: every rank of the group makes one, in the same order. An operation's ``check`` is None: the Buffer
    ran the checks (``Buffer._checked_by``)."""

    name = "two_level"

    def __init__(self, everyone: GroupComm, hosts: Sequence[str], make_inner: Callable[[dist.ProcessGroup], object],
                 rail_transport: Optional[str] = None, num_rdma_bytes: int = 0, extension=None) -> None:
        self.num_hosts, self.per_host = even_hosts(hosts)
        self.host, self.local = divmod(everyone.rank, self.per_host)
        self.everyone = everyone
        self.device = device = everyone.device
        timeout_s = everyone.timeout_s
        ranks = dist.get_process_group_ranks(everyone.group)
        # Each rank makes its own two groups only (local synchronisation): the group may be part of a larger world.
        host_group = dist.new_group([ranks[self.host * self.per_host + g] for g in range(self.per_host)],
                                    use_local_synchronization=True)
        rail_group = dist.new_group([ranks[h * self.per_host + self.local] for h in range(self.num_hosts)],
                                    use_local_synchronization=True)
        # The rail: a collective, or (rail_transport: verbs, tcp, cuda-copy) a proxies' transport over
        # num_rdma_bytes, driven by the GPU on GPU ranks and by the host on CPU ranks.
        if rail_transport is None:
            self.rail = CollectiveRail(GroupComm(rail_group, self.host, self.num_hosts, device, timeout_s))
        else:
            rail_kind = DeviceRail if device.type == "cuda" else TransportRail
            self.rail = rail_kind(rail_group, self.host, self.num_hosts, device, num_rdma_bytes, rail_transport,
                                  timeout_s, extension)
        self.within_host = GroupComm(host_group, self.local, self.per_host, device, timeout_s)
        self.hops = HopTimes(device)
        try:
            self.inner = make_inner(host_group)
        except BaseException:
            self.rail.close()
            raise

    def destroy(self) -> None:
        """Destroy the host's Buffer with every rank of the group (as Buffer.destroy()), and close the rail."""
        inner, self.inner = self.inner, None
        if inner is not None:
            inner.destroy()
        self.rail.close(wait_for_peers=True)

    def release(self) -> None:
        """Free the host's Buffer and the rail without waiting for the peers (garbage collection, a failed
        construction)."""
        inner, self.inner = self.inner, None
        if inner is not None:
            inner._release()
        self.rail.close()

    # ------------------------------------------------------------------ dispatch
    def dispatch(self, x: torch.Tensor, x_scales: Optional[torch.Tensor], *, is_token_in_rank: torch.Tensor,
                 num_tokens_per_rank: Optional[torch.Tensor], num_tokens_per_expert: Optional[torch.Tensor],
                 topk_idx: Optional[torch.Tensor], topk_weights: Optional[torch.Tensor], expert_alignment: int,
                 num_worst_tokens: int, num_channels: int, cached_handle: Optional[Sequence[torch.Tensor]],
                 stream: int = 0, check=None) -> DispatchResult:
        self.hops.reset()
        if cached_handle is not None:
            route = getattr(cached_handle[0], ROUTE_ATTRIBUTE)
            rows = self._rail(self._payload(x, x_scales, route.send_tokens), route.send_counts, route.recv_counts,
                              "dispatch across hosts")
            with self.hops.span("forward"):
                recv = self.inner.dispatch(self._x(rows, x.dtype, x_scales), handle=route.inner_handle)[0]
            recv_x, recv_scales = recv if x_scales is not None else (recv, None)
            return DispatchResult(self._in_rank_order(recv_x, route, 0), self._in_rank_order(recv_scales, route, 0),
                                  None, None, [], tuple(cached_handle))

        ranks_per_host = is_token_in_rank.reshape(-1, self.num_hosts, self.per_host)
        to_host = ranks_per_host.any(-1)
        # The layout's one gather also tells every rank how many tokens each rank sends to each host: the rail's
        # counts, and what each rank of this host gets along its rail, with no collective and no sync of their own.
        tables = exchange_layout(self.everyone, is_token_in_rank, num_tokens_per_rank, num_tokens_per_expert,
                                 expert_alignment, num_worst_tokens, num_channels, extra=to_host.sum(0))
        to_hosts = tables.extra.view(self.num_hosts, self.per_host, self.num_hosts)   # [host, local, to host]
        send_counts = to_hosts[self.host, self.local].tolist()
        rail_counts = to_hosts[:, :, self.host].t()    # [local rank here, source host]: rows along each rail
        dst_host, send_tokens = torch.nonzero_static(to_host.t(), size=sum(send_counts)).unbind(1)
        # Past the rail a token needs: which ranks of its new host take it, its experts there (numbered from
        # the host's first), and its index on the source rank.
        payload = self._payload(x, x_scales, send_tokens)
        payload += [ranks_per_host[send_tokens, dst_host], send_tokens.to(torch.int32)]
        experts_here = num_tokens_per_expert.numel() // self.num_hosts
        if topk_idx is not None:
            sent_idx = topk_idx[send_tokens]
            local = sent_idx - dst_host[:, None] * experts_here
            here = (sent_idx >= 0) & (local >= 0) & (local < experts_here)
            payload += [torch.where(here, local, torch.full_like(local, -1)), topk_weights[send_tokens]]
        recv_counts = rail_counts[self.local].tolist()
        rows = self._rail(payload, send_counts, recv_counts, "dispatch across hosts")
        forwarded = self._x(rows, x.dtype, x_scales)
        count = 2 if x_scales is not None else 1
        in_rank, source_token = rows[count], rows[count + 1]
        f_idx, f_weights = (rows[count + 2], rows[count + 3]) if topk_idx is not None else (None, None)
        per_expert = torch.zeros(experts_here + 1, dtype=torch.int64, device=self.device)   # [0]: no expert here
        if f_idx is not None:   # a scatter, not a bincount: no sync for the largest index
            per_expert.scatter_add_(0, f_idx.flatten() + 1, torch.ones_like(f_idx).flatten())
        per_expert = per_expert[1:].to(torch.int32)
        with self.hops.span("forward"):
            recv, recv_idx, recv_weights, _, inner_handle, _ = self.inner.dispatch(
                forwarded, num_tokens_per_rank=in_rank.sum(0, dtype=torch.int32), is_token_in_rank=in_rank,
                num_tokens_per_expert=per_expert, topk_idx=f_idx, topk_weights=f_weights,
                num_worst_tokens=num_worst_tokens)
        recv_x, recv_scales = recv if x_scales is not None else (recv, None)

        order, sources = self._rank_order(inner_handle, rail_counts, source_token,
                                          None if num_worst_tokens else recv_x.size(0))
        route = RailRoute(send_tokens, send_counts, recv_counts, tuple(inner_handle), order, recv_x.size(0))
        recv_src_idx = self._in_rank_order(sources, route, -1)
        rank_prefix_matrix = tables.rank_prefix_matrix
        setattr(rank_prefix_matrix, ROUTE_ATTRIBUTE, route)
        handle = (rank_prefix_matrix, tables.channel_prefix_matrix, tables.recv_channel_prefix_matrix, recv_src_idx,
                  is_token_in_rank, tables.send_head)
        return DispatchResult(
            self._in_rank_order(recv_x, route, 0), self._in_rank_order(recv_scales, route, 0),
            self._in_rank_order(recv_idx, route, -1), self._in_rank_order(recv_weights, route, 0),
            tables.num_recv_tokens_per_expert_list, handle)

    @staticmethod
    def _payload(x: torch.Tensor, x_scales: Optional[torch.Tensor], tokens: torch.Tensor) -> List[torch.Tensor]:
        return [x.view(torch.uint8)[tokens]] + ([] if x_scales is None else [x_scales[tokens]])

    @staticmethod
    def _x(rows: List[torch.Tensor], dtype: torch.dtype, x_scales: Optional[torch.Tensor]):
        return (rows[0].view(dtype), rows[1]) if x_scales is not None else rows[0].view(dtype)

    def _rail(self, payload: List[torch.Tensor], send_counts: List[int], recv_counts: List[int],
              phase: str) -> List[torch.Tensor]:
        """Each host's block of ``payload``'s rows (``send_counts``) to the rail's rank on that host; the blocks
        received (``recv_counts``), by host."""
        specs = [row_spec(p) for p in payload]
        packed = pack_rows(payload, payload[0].size(0), self.device, self.rail.row_align)
        writes = self.rail.writes
        with self.hops.span("rail"):
            rows = self.rail.exchange(packed, send_counts, recv_counts, phase)
        self.hops.rail_bytes += (sum(send_counts) - send_counts[self.host]) * packed.size(1)
        self.hops.rail_writes += self.rail.writes - writes
        return unpack_rows(rows, specs)

    def _rank_order(self, inner_handle, rail_counts: torch.Tensor, source_token: torch.Tensor,
                    num_rows: Optional[int]) -> Tuple[torch.Tensor, torch.Tensor]:
        """``(order, sources)``: the forward hop's rows in rank order, and each forward-hop row's token index on
        its source rank. The forward hop delivers rows by forwarding rank g, each block in g's own order: by
        source host h, then token (``rail_counts[g, h]`` of them); their source rank is h * per_host + g.
        ``num_rows``: the rows the forward hop delivered, where the caller knows it (else read on the device)."""
        # Built on the rows' device, not on the host: there the searches and gathers over every received row each
        # open an OpenMP region over a pool as large as the machine, in every rank's process at once, and the
        # pools' spinning threads stretch each region to milliseconds or tens of them (of a GPU dispatch's ~1).
        padded = torch.full((int(rail_counts.sum(1).max()),), -1, dtype=torch.int64, device=self.device)
        padded[:source_token.numel()] = source_token
        tokens = self.within_host.all_gather_rows(padded, "dispatch across hosts: forwarded tokens")
        # The forward hop's rows from forwarding rank g end at its rank_prefix_matrix[g][local] (inclusive prefix).
        forwarder = segment_ids(inner_handle[0][:, self.local], num_rows)
        position = inner_handle[3][:forwarder.numel()].to(torch.int64)    # row in the forwarder's input
        host = torch.searchsorted(rail_counts.cumsum(1).to(self.device)[forwarder], position.unsqueeze(1),
                                  right=True).squeeze(1)
        order = torch.sort(host * self.per_host + forwarder, stable=True).indices
        sources = tokens[forwarder, position].to(torch.int32)
        return order, sources

    def _in_rank_order(self, rows: Optional[torch.Tensor], route: RailRoute, fill) -> Optional[torch.Tensor]:
        """The forward hop's valid rows in rank order, padded with ``fill`` to the outputs' size."""
        if rows is None:
            return None
        if route.num_rows == route.order.numel():   # no padding (no num_worst_tokens): one gather, no fill
            return rows[route.order]
        out = torch.full((route.num_rows,) + tuple(rows.shape[1:]), fill, dtype=rows.dtype, device=rows.device)
        out[:route.order.numel()] = rows[route.order]
        return out

    # ------------------------------------------------------------------ combine
    def combine(self, x: torch.Tensor, handle: Sequence[torch.Tensor], topk_weights: Optional[torch.Tensor],
                biases: Sequence[torch.Tensor], num_channels: int = 0, stream: int = 0, check=None
                ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Sum every token's copies inside each host, then across hosts on its source rank; add the biases."""
        self.hops.reset()
        route = getattr(handle[0], ROUTE_ATTRIBUTE)
        inner_rows = route.inner_handle[3].size(0)
        num_valid = route.order.numel()
        inner_x = x.new_zeros((inner_rows, x.size(1)))
        inner_x[route.order] = x[:num_valid]
        inner_weights = None
        if topk_weights is not None:
            inner_weights = topk_weights.new_zeros((inner_rows, topk_weights.size(1)))
            inner_weights[route.order] = topk_weights[:num_valid]
        with self.hops.span("forward"):
            partial, partial_weights, _ = self.inner.combine(inner_x, route.inner_handle, inner_weights)
        payload = [partial] + ([] if partial_weights is None else [partial_weights])
        rows = self._rail(payload, route.recv_counts, route.send_counts, "combine across hosts")
        num_tokens = handle[4].size(0)
        summed = torch.zeros((num_tokens, x.size(1)), dtype=torch.float32, device=x.device)
        weights = None if topk_weights is None else torch.zeros((num_tokens, topk_weights.size(1)),
                                                                dtype=torch.float32, device=x.device)
        # One host at a time, in host order: each token comes at most once per host, so every sum has one order.
        for index, tokens in enumerate(route.send_tokens.split(route.send_counts)):
            start = sum(route.send_counts[:index])
            summed.index_add_(0, tokens, rows[0][start:start + tokens.numel()].float())
            if weights is not None:
                weights.index_add_(0, tokens, rows[1][start:start + tokens.numel()])
        for bias in biases:
            summed += bias.float()
        return summed.to(x.dtype), weights
