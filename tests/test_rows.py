"""Row packing of the reference engine: pack_rows / unpack_rows round trips, including receives of a
single row whose packed width is not a multiple of the widest dtype (vLLM's one-token dummy batch)."""

import pytest
import torch

from uccl_ep_plugin.engines.reference.rows import pack_rows, row_spec, unpack_rows


@pytest.mark.parametrize("align", [1, 16], ids=["unpadded", "rows-of-16-bytes"])
@pytest.mark.parametrize("num_rows", [0, 1, 2, 7])
@pytest.mark.parametrize("hidden", [256, 258])
def test_round_trip_with_odd_widths(num_rows, hidden, align):
    gen = torch.Generator().manual_seed(num_rows * 1000 + hidden)
    tensors = [torch.randn((num_rows, hidden), generator=gen).to(torch.bfloat16),   # 2 * hidden bytes
               torch.randint(-1, 9, (num_rows, 2), generator=gen),                   # int64, after 2*hidden bytes
               torch.rand((num_rows, 2), generator=gen),                             # float32: rows of 540 bytes
               torch.randint(0, 100, (num_rows,), generator=gen).to(torch.int32)]
    packed = pack_rows(tensors, num_rows, torch.device("cpu"), align)
    width = 2 * hidden + 8 * 2 + 4 * 2 + 4
    assert packed.size(1) == -(-width // align) * align   # padded to the alignment, no more
    for start in range(min(num_rows, 2)):   # a slice that starts at an odd row too
        sliced = packed[start:]
        back = unpack_rows(sliced, [row_spec(t) for t in tensors])
        for original, got in zip(tensors, back):
            assert got.dtype == original.dtype and torch.equal(got, original[start:])


def test_empty_tensors_with_any_strides_pack():
    """Zero rows (a rank that received nothing), with the zero strides an expand() leaves."""
    expanded = torch.zeros((0, 1)).expand(0, 5)
    packed = pack_rows([expanded, torch.empty((0, 3), dtype=torch.int64)], 0, torch.device("cpu"))
    assert packed.shape == (0, 5 * 4 + 3 * 8)
    weights, ids = unpack_rows(packed, [(torch.float32, (5,)), (torch.int64, (3,))])
    assert weights.shape == (0, 5) and ids.shape == (0, 3) and weights.stride(-1) == 1
