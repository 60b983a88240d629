"""The extension allocates the native operations' outputs with torch's own allocator, through torch's C shim
(csrc/python/torch_tensors.h). On the CPU: the tensors it makes have the asked shapes, strides, dtypes and
views, nothing else holds them, and they are torch's to free."""

import sys

import pytest
import torch

from uccl_ep_plugin.engines.native.torch_tensors import DEVICES, DTYPES, use_torch_shim

_C = pytest.importorskip("uccl_ep_plugin._C")
CPU = DEVICES["cpu"]


@pytest.fixture(scope="module", autouse=True)
def shim():
    assert use_torch_shim(_C) is None


def _holders(tensor: torch.Tensor) -> int:
    """References to the tensor's storage besides the tensor itself (a leaked shim handle would be one)."""
    return torch._C._storage_Use_Count(tensor.untyped_storage()._cdata) - 2   # less the tensor and this lookup


@pytest.mark.parametrize("dtype", list(DTYPES), ids=str)
def test_each_dtype(dtype):
    (tensor,) = _C.torch_shim_tensors([((3, 5), DTYPES[dtype], None)], CPU, 0)
    assert tensor.dtype == dtype and tensor.shape == (3, 5) and tensor.stride() == (5, 1)
    assert tensor.device == torch.device("cpu") and _holders(tensor) == 0
    tensor.fill_(1)   # real memory, writable
    assert bool((tensor == 1).all())


def test_strides_views_and_none():
    made = _C.torch_shim_tensors([((40,), DTYPES[torch.int32], None), None,
                                  ((2, 7, 3), DTYPES[torch.float32], (21, 1, 7)),
                                  (0, (4, 5), (5, 1), 0), (0, (5, 4), (4, 1), 20), ((0, 9), DTYPES[torch.int64], None)],
                                 CPU, 0)
    block, nothing, column_major, first, second, empty = made
    assert nothing is None
    assert column_major.shape == (2, 7, 3) and column_major.stride() == (21, 1, 7)
    assert column_major.transpose(1, 2).is_contiguous()   # as torch.empty((2, 3, 7)).transpose(1, 2)
    block.copy_(torch.arange(40, dtype=torch.int32))
    assert first.tolist() == torch.arange(20).view(4, 5).tolist()
    assert second.tolist() == torch.arange(20, 40).view(5, 4).tolist()
    assert second.data_ptr() == block.data_ptr() + 20 * 4
    assert _holders(block) == 2   # the two views, nothing else
    del made, first, second
    assert _holders(block) == 0
    assert empty.shape == (0, 9) and empty.numel() == 0


def test_freed_when_dropped():
    """Only Python holds a returned tensor: dropping it frees it (its refcount is the usual one)."""
    (tensor,) = _C.torch_shim_tensors([((1 << 20,), DTYPES[torch.uint8], None)], CPU, 0)
    assert sys.getrefcount(tensor) == 2 and _holders(tensor) == 0


@pytest.mark.parametrize("entries, message", [
    ([((2, 2), DTYPES[torch.int32], (1,))], "strides"),
    ([((1, 1, 1, 1, 1), DTYPES[torch.int32], None)], "dimensions"),
    ([(3, (1,), (1,), 0)], "no such tensor"),
    ([None, (0, (1,), (1,), 0)], "no such tensor"),
    ([((1,), DTYPES[torch.int32], None)] * 13, "at most 12"),
])
def test_bad_requests_raise(entries, message):
    with pytest.raises((ValueError, RuntimeError), match=message):
        _C.torch_shim_tensors(entries, CPU, 0)


def test_out_of_memory_raises_in_words():
    with pytest.raises(RuntimeError, match="torch could not allocate an output tensor"):
        _C.torch_shim_tensors([((1 << 62,), DTYPES[torch.uint8], None)], CPU, 0)


def test_a_torch_without_the_converter_gets_a_reason(monkeypatch):
    """The native engine then serves nothing (the Buffer falls back with this reason); nothing raises."""
    import uccl_ep_plugin.engines.native.torch_tensors as torch_tensors
    monkeypatch.setattr(torch._C, "_aoti", object(), raising=False)
    reason = torch_tensors.use_torch_shim(_C)
    assert "alloc_tensors_by_stealing_from_void_ptrs" in reason and torch.__version__ in reason
