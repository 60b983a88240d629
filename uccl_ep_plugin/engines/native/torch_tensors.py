"""The extension allocates the native operations' outputs itself, with torch's allocator, and reads their
tensor arguments, through torch's C shim (csrc/python/torch_tensors.h): a tensor costs well under a
microsecond there, against several for a ``torch.empty`` call (or a handful of ``.data_ptr()``, ``.shape``,
``.dtype`` reads) from Python."""

import os
from typing import Optional

import torch

# The codes of csrc/python/torch_tensors.h's TensorDtype and TensorDevice.
DTYPES = {torch.bool: 0, torch.uint8: 1, torch.int32: 2, torch.int64: 3, torch.float32: 4, torch.bfloat16: 5,
          torch.float8_e4m3fn: 6}
DEVICES = {"cpu": 0, "cuda": 1}
# torch._C._aoti's converters: handles to tensors (the outputs), tensors to handles (the arguments).
_CONVERTERS = ("alloc_tensors_by_stealing_from_void_ptrs", "unsafe_alloc_void_ptrs_from_tensors")


def use_torch_shim(extension) -> Optional[str]:
    """Point the extension at torch's C shim (once per process). Returns None, or why this torch cannot serve."""
    aoti = getattr(torch._C, "_aoti", None)
    converters = [getattr(aoti, name, None) for name in _CONVERTERS]
    for name, converter in zip(_CONVERTERS, converters):
        if converter is None:
            return (f"torch {torch.__version__} has no torch._C._aoti.{name}, which the native engine passes "
                    "tensors between Python and C++ with (torch 2.11 and 2.13 have it)")
    lib = os.path.join(os.path.dirname(torch.__file__), "lib")
    # The GPU library's shim reads the current stream; torch's Python reader serves where it lacks that.
    gpu_library = next((os.path.join(lib, name) for name in ("libtorch_cuda.so", "libtorch_hip.so")
                        if os.path.exists(os.path.join(lib, name))), "")
    try:
        extension.use_torch_shim(os.path.join(lib, "libtorch_cpu.so"), *converters, torch.Tensor, gpu_library,
                                 getattr(torch._C, "_cuda_getCurrentRawStream", None))
    except RuntimeError as error:
        return str(error)
    return None
