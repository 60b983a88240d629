"""The extension allocates the native operations' outputs with torch's own allocator, and reads their tensor
arguments, through torch's C shim (csrc/python/torch_tensors.h). On the CPU: the tensors it makes have the asked
shapes, strides, dtypes and views, nothing else holds them, and they are torch's to free; the arguments it reads
are described as torch sees them, nothing keeps a reference, and an operation's checks run once per kind of call."""

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


def test_a_storage_block_returns_only_its_views():
    """Outputs of one dtype made as views of one block: the block itself is not returned, and its memory lives as
    long as a view does."""
    made = _C.torch_shim_tensors([((6,), DTYPES[torch.int64], None), (40, DTYPES[torch.int32]),
                                  (1, (4,), (1,), 0), None, (1, (3, 8), (8, 1), 8)], CPU, 0)
    alone, first, nothing, second = made
    assert alone.shape == (6,) and nothing is None
    assert first.shape == (4,) and second.shape == (3, 8) and second.stride() == (8, 1)
    assert second.data_ptr() == first.data_ptr() + 8 * 4
    second.copy_(torch.arange(24, dtype=torch.int32).view(3, 8))
    first.fill_(-1)
    assert second.flatten().tolist() == list(range(24))   # the views do not overlap
    assert _holders(first) == 1   # the other view, nothing else (the block's own handle is gone)
    del made, second
    assert _holders(first) == 0 and first.tolist() == [-1] * 4


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_views_of_another_dtype_share_one_block(device):
    """Outputs of several dtypes from one allocation: each view has its own dtype, offset (counted in its dtype's
    elements) and strides, and the views of one dtype in a row reuse one typed base (no handle leaks either way).
    On CUDA too: the low-latency dispatch makes its outputs so."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    u8, f32, i32, i64 = (DTYPES[t] for t in (torch.uint8, torch.float32, torch.int32, torch.int64))
    made = _C.torch_shim_tensors([(72, u8), (0, (2, 4), (4, 1), 0), (0, (2, 3), (1, 2), 4, f32),
                                  (0, (2,), (1,), 5, i64), (0, (2,), (1,), 14, i32), (0, (4,), (1,), 64)],
                                 DEVICES[device], 0)
    head, column_major, wide, narrow, tail = made   # the block itself is not returned
    assert (head.dtype, column_major.dtype, wide.dtype, narrow.dtype, tail.dtype) == \
        (torch.uint8, torch.float32, torch.int64, torch.int32, torch.uint8)
    base = head.data_ptr()
    assert column_major.data_ptr() == base + 16 and column_major.stride() == (1, 2)
    assert wide.data_ptr() == base + 40 and narrow.data_ptr() == base + 56 and tail.data_ptr() == base + 64
    values = torch.arange(6, dtype=torch.float32)
    column_major.copy_(values.view(3, 2).t())
    wide.copy_(torch.tensor([-1, 2 ** 40]))
    narrow.fill_(-5)
    assert column_major.t().flatten().tolist() == values.tolist()   # column-major, as the fp8 scales are
    assert wide.tolist() == [-1, 2 ** 40] and narrow.tolist() == [-5, -5]
    head.fill_(1)
    tail.fill_(9)
    assert column_major.t().flatten().tolist() == values.tolist() and narrow.tolist() == [-5, -5]  # no overlaps
    assert _holders(head) == 4   # the other four views, and no typed base left behind
    del made, column_major, wide, narrow, tail
    assert _holders(head) == 0 and head.flatten().tolist() == [1] * 8


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


@pytest.mark.gpu
def test_the_current_stream_is_torchs():
    """The operations launch where torch's own kernels would: on the stream current on their device, also inside
    a ``torch.cuda.stream`` context and while another device is current."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    last = torch.cuda.device_count() - 1
    assert _C.torch_shim_current_stream(0) == torch.cuda.current_stream(0).cuda_stream
    side = torch.cuda.Stream(last)
    with torch.cuda.device(last), torch.cuda.stream(side):
        assert _C.torch_shim_current_stream(last) == side.cuda_stream
        if last != 0:
            assert _C.torch_shim_current_stream(0) == torch.cuda.current_stream(0).cuda_stream
    assert _C.torch_shim_current_stream(last) == torch.cuda.current_stream(last).cuda_stream != side.cuda_stream


def test_out_of_memory_raises_in_words():
    with pytest.raises(RuntimeError, match="torch could not allocate an output tensor"):
        _C.torch_shim_tensors([((1 << 62,), DTYPES[torch.uint8], None)], CPU, 0)


def test_a_torch_without_the_converter_gets_a_reason(monkeypatch):
    """The native engine then serves nothing (the Buffer falls back with this reason); nothing raises."""
    import uccl_ep_plugin.engines.native.torch_tensors as torch_tensors
    monkeypatch.setattr(torch._C, "_aoti", object(), raising=False)
    reason = torch_tensors.use_torch_shim(_C)
    assert "alloc_tensors_by_stealing_from_void_ptrs" in reason and torch.__version__ in reason


class Checks:
    """An operation's checks as the extension calls them: counted; raise ``error`` when set."""

    def __init__(self) -> None:
        self.runs = 0
        self.error = None

    def __call__(self) -> None:
        self.runs += 1
        if self.error is not None:
            raise self.error


def test_arguments_are_described_as_torch_sees_them():
    base = torch.arange(60, dtype=torch.float32).view(3, 20)
    view = base[1:, 2:12:2]   # an offset and a stride
    scalar = torch.tensor(5, dtype=torch.int64)
    half = torch.zeros(4, dtype=torch.float16)   # a dtype no operation takes
    holders = [_holders(tensor) for tensor in (view, scalar, half)]
    described = _C.torch_shim_arguments((view, None, scalar, half), (3,), _C.CheckedCalls(), Checks())
    assert described[0] == (view.data_ptr(), DTYPES[torch.float32], CPU, -1, [2, 5], [20, 2])
    assert described[1] is None
    assert described[2] == (scalar.data_ptr(), DTYPES[torch.int64], CPU, -1, [], [])
    assert described[3][1] == -1 and described[3][4] == [4]
    assert [_holders(tensor) for tensor in (view, scalar, half)] == holders   # no handle kept


def test_checks_run_once_per_kind_of_call():
    checked, checks = _C.CheckedCalls(), Checks()
    x, y = torch.zeros((4, 8), dtype=torch.bfloat16), torch.zeros(4, dtype=torch.int32)

    def call(*tensors, values=(1, 0)):
        _C.torch_shim_arguments(tensors, values, checked, checks)
        return checks.runs

    assert call(x, y) == 1 and call(x.clone(), y.clone()) == 1 and len(checked) == 1
    assert call(x, None) == 2                                   # presence
    assert call(x.float(), y) == 3                              # dtype
    assert call(x[:3], y) == 4                                  # size
    assert call(torch.zeros((8, 4), dtype=torch.bfloat16).t(), y) == 5   # strides (same sizes)
    assert call(x, y, values=(2, 0)) == 6                       # a value
    assert call(x, y, values=(1, 0, 0)) == 7                    # the number of values
    assert call(x, y, values=(True, 0)) == 8                    # a bool is not the int of its value
    assert call(x, y, values=(True, 0)) == 8
    assert call(x, y) == 8 and len(checked) == 8


def test_a_refused_call_stays_refused():
    """What the checks raise propagates, and such a call is never remembered as checked."""
    checked, checks = _C.CheckedCalls(), Checks()
    x = torch.zeros((4, 8), dtype=torch.bfloat16)
    checks.error = ValueError("x must have shape (5, *), got (4, 8) (dimension 0)")
    for _ in range(2):
        with pytest.raises(ValueError, match="x must have shape"):
            _C.torch_shim_arguments((x,), (), checked, checks)
    assert checks.runs == 2 and len(checked) == 0


@pytest.mark.parametrize("tensors, values", [(([1, 2],), ()), ((torch.zeros(2),), (None,)),
                                             ((torch.zeros(2),), (1.0,)), ((torch.zeros(2),), (1 << 70,))],
                         ids=["list for a tensor", "None value", "float value", "huge value"])
def test_what_is_not_a_tensor_an_int_or_a_bool_always_meets_the_checks(tensors, values):
    """The checks name such an argument; should they let it pass, the extension refuses it all the same."""
    checked, checks = _C.CheckedCalls(), Checks()
    checks.error = TypeError("named by the checks")
    with pytest.raises(TypeError, match="named by the checks"):
        _C.torch_shim_arguments(tensors, values, checked, checks)
    checks.error = None
    with pytest.raises(TypeError, match="not what its operation takes"):
        _C.torch_shim_arguments(tensors, values, checked, checks)
    assert checks.runs == 2 and len(checked) == 0


def test_tensors_of_many_dimensions_are_checked_every_time():
    checked, checks = _C.CheckedCalls(), Checks()
    deep = torch.zeros([1] * 9)
    for _ in range(2):
        (described,) = _C.torch_shim_arguments((deep,), (), checked, checks)
    assert checks.runs == 2 and len(checked) == 0 and described[4] == [1] * 8
