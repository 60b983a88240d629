"""Communication handles: plain tuples (as DeepEP returns them) tagged with the Buffer that made them.

Code that unpacks or indexes a handle keeps working; the tag lets a Buffer refuse a handle
produced by another Buffer, and take its own without checking the items again (they were checked
when it was built). A handle rebuilt by the caller as a plain tuple loses the tag and is checked
by shape instead.

Each Buffer makes its handles from its own subclass of each kind (:meth:`owned_by`), which carries the tag:
a handle is then built as fast as a tuple (a constructor in Python, setting the tag per handle, took four times
as long), and "made by this Buffer" is one identity test of its class.
"""

from typing import Any, Optional


class _TaggedHandle(tuple):
    owner_id: Optional[int] = None

    @classmethod
    def owned_by(cls, owner_id: int) -> type:
        """The subclass whose handles carry ``owner_id``, the tag of the Buffer that makes them."""
        return type(cls.__name__, (cls,), {"owner_id": owner_id, "__module__": cls.__module__})


class NormalHandle(_TaggedHandle):
    """``(rank_prefix_matrix, channel_prefix_matrix, recv_channel_prefix_matrix, recv_src_idx,
    is_token_in_rank, send_head)``, the layout of one normal-mode dispatch.

    - ``rank_prefix_matrix[i, j]``: tokens sent to rank ``j`` by ranks ``0..i`` (int32 ``[R, R]``).
    - ``channel_prefix_matrix[j, c]``: tokens this rank sends to rank ``j`` from channels ``0..c`` (int32 ``[R, C]``).
    - ``recv_channel_prefix_matrix[i, c]``: offset of channel ``c``'s rows inside the block received from rank ``i``.
    - ``recv_src_idx[k]``: index of received row ``k`` in its source rank's ``x`` (int32).
    - ``is_token_in_rank[n, j]``: whether token ``n`` of this rank went to rank ``j`` (bool ``[N, R]``).
    - ``send_head[n, j]``: position of token ``n`` in channel ``c(n)``'s stream to rank ``j``, ``-1`` if not sent.

    ``served_by`` (an attribute, not an item): the engine that made it ("native" or "reference"); a cached
    dispatch or a combine with it goes to the same engine. None on a handle rebuilt as a plain tuple.
    """

    served_by: Optional[str] = None


class LowLatencyHandle(_TaggedHandle):
    """``(src_info, layout_range, num_max_dispatch_tokens_per_rank, hidden, num_experts)``.

    - ``src_info[e, k]``: source token index of packed row ``k`` of local expert ``e`` (int32 ``[El, R*T]``).
    - ``layout_range[e, i]``: ``begin << 32 | count`` of the rows local expert ``e`` got from rank ``i`` (int64 ``[El, R]``).

    ``positions`` (an attribute, not an item): the native engine's record of where each (token, top-k)
    entry's combined row will land and of its slot among its expert's rows (int32 ``[2, N, K]``); None from
    the reference engine or on a handle rebuilt as a plain tuple.
    """

    positions: Optional[Any] = None


def owner_of(handle: Any) -> Optional[int]:
    return getattr(handle, "owner_id", None)
