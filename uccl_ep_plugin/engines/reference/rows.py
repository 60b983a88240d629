"""Packing several per-row tensors into one byte matrix, so one all-to-all moves them all."""

from typing import List, Optional, Sequence, Tuple

import torch

RowSpec = Tuple[torch.dtype, Tuple[int, ...]]


def pack_rows(tensors: Sequence[torch.Tensor], num_rows: int, device: torch.device, align: int = 1) -> torch.Tensor:
    """Concatenate the bytes of each row of every tensor (all with ``num_rows`` rows), each row padded at its end to
    a multiple of ``align`` bytes (unpack_rows ignores the padding)."""
    parts = [_byte_rows(t, num_rows) for t in tensors]
    width = sum(part.size(1) for part in parts)
    padding = -width % align
    if padding:   # in the same concatenation: no extra copy
        parts.append(torch.empty((num_rows, padding), dtype=torch.uint8, device=device))
    if not parts:
        return torch.empty((num_rows, 0), dtype=torch.uint8, device=device)
    return torch.cat(parts, dim=1)


def _byte_rows(tensor: torch.Tensor, num_rows: int) -> torch.Tensor:
    width = _row_numel(tensor.shape[1:]) * tensor.element_size()
    if tensor.numel() == 0:   # any strides: view() to bytes would reject some of them
        return torch.empty((num_rows, width), dtype=torch.uint8, device=tensor.device)
    return tensor.contiguous().reshape(num_rows, -1).view(torch.uint8)


def _row_numel(shape: Sequence[int]) -> int:
    numel = 1
    for s in shape:
        numel *= s
    return numel


def row_spec(tensor: torch.Tensor) -> RowSpec:
    return tensor.dtype, tuple(tensor.shape[1:])


def unpack_rows(rows: torch.Tensor, specs: Sequence[RowSpec]) -> List[torch.Tensor]:
    """Inverse of :func:`pack_rows` given each tensor's dtype and per-row shape."""
    out, offset = [], 0
    num_rows = rows.size(0)
    for dtype, shape in specs:
        width = _row_numel(shape) * dtype.itemsize
        # A fresh buffer, not .contiguous(): a one-row slice counts as contiguous and keeps its row stride
        # and offset, which view() to a wider dtype rejects unless they happen to be multiples of its size.
        values = torch.empty((num_rows,) + tuple(shape), dtype=dtype, device=rows.device)
        if values.numel() > 0:
            values.view(num_rows, -1).view(torch.uint8).copy_(rows[:, offset:offset + width])
        out.append(values)
        offset += width
    return out


def segment_ids(ends: torch.Tensor, total: Optional[int] = None) -> torch.Tensor:
    """For rows laid out as consecutive segments that end at ``ends`` (the inclusive prefix sum of their sizes), the
    segment index of each row; ``total``, the last end, where the caller knows it (it spares a GPU caller a sync).

    (``repeat_interleave(arange(len(sizes)), sizes)`` computed by a search, which is much faster.)
    """
    if total is None:
        total = int(ends[-1]) if ends.numel() else 0
    return torch.searchsorted(ends, torch.arange(total, dtype=ends.dtype, device=ends.device), right=True)
