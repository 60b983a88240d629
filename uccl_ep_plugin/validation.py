"""Argument checks shared by every engine: each raises TypeError/ValueError naming the argument,
before any communication starts."""

from typing import Iterable, Optional, Sequence

import torch

from .dispatch_config import MAX_TOPK

FP8_DTYPE = torch.float8_e4m3fn
TOPK_IDX_DTYPE = torch.int64


def check_tensor(name: str, tensor, dtypes: Iterable[torch.dtype], dim: Optional[int] = None,
                 shape: Optional[Sequence[Optional[int]]] = None, contiguous: bool = True) -> torch.Tensor:
    """``tensor`` is a tensor of one of ``dtypes`` with ``dim`` dimensions; ``shape`` entries that are
    not None must match."""
    dtypes = tuple(dtypes)
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dtype not in dtypes:
        expected = " or ".join(str(d) for d in dtypes)
        raise TypeError(f"{name} must have dtype {expected}, got {tensor.dtype}")
    if shape is not None:
        dim = len(shape)
    if dim is not None and tensor.dim() != dim:
        raise ValueError(f"{name} must have {dim} dimensions, got shape {tuple(tensor.shape)}")
    if shape is not None:
        for axis, (got, want) in enumerate(zip(tensor.shape, shape)):
            if want is not None and got != want:
                expected = tuple("*" if s is None else s for s in shape)
                raise ValueError(f"{name} must have shape {expected}, got {tuple(tensor.shape)} (dimension {axis})")
    if contiguous and not tensor.is_contiguous():
        raise ValueError(f"{name} must be contiguous")
    return tensor


def check_same_device(device: torch.device, **tensors) -> None:
    for name, tensor in tensors.items():
        if tensor is not None and tensor.device != device:
            raise ValueError(f"{name} is on {tensor.device}, but this Buffer works on {device}")


def check_int(name: str, value, minimum: Optional[int] = None) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be at least {minimum}, got {value}")
    return value


def check_hidden(name: str, hidden: int, element_size: int, multiple_of: int = 1) -> None:
    """Rows must be a whole number of 16-byte vectors; quantised formats need whole scale groups."""
    if hidden <= 0:
        raise ValueError(f"{name}: hidden size must be positive, got {hidden}")
    if (hidden * element_size) % 16 != 0:
        raise ValueError(f"{name}: hidden size {hidden} is not allowed: a row of {hidden * element_size} bytes "
                         "is not a multiple of 16 bytes")
    if hidden % multiple_of != 0:
        raise ValueError(f"{name}: hidden size {hidden} is not allowed: this format needs a multiple of {multiple_of}")


def check_num_experts(num_experts: int, num_ranks: int, name: str = "num_experts") -> int:
    check_int(name, num_experts, minimum=1)
    if num_experts % num_ranks != 0:
        raise ValueError(f"{name}={num_experts} is not divisible by the number of ranks ({num_ranks})")
    return num_experts


def check_topk_idx(topk_idx, num_experts: int, name: str = "topk_idx",
                   num_tokens: Optional[int] = None, check_values: bool = True) -> torch.Tensor:
    """``[num_tokens, num_topk]`` int64 with entries in ``[-1, num_experts)``.

    Reading the values of a GPU tensor syncs the host, which the native kernels must not do (and a
    CUDA graph cannot capture): they pass ``check_values=False`` and treat entries outside the range as -1.
    """
    check_tensor(name, topk_idx, (TOPK_IDX_DTYPE,), shape=(num_tokens, None))
    if topk_idx.size(1) > MAX_TOPK:
        raise ValueError(f"{name}: top-k of {topk_idx.size(1)} exceeds the supported maximum of {MAX_TOPK}")
    if check_values and topk_idx.numel() > 0:
        low, high = int(topk_idx.min()), int(topk_idx.max())
        if low < -1 or high >= num_experts:
            bad = low if low < -1 else high
            raise ValueError(f"{name} holds expert {bad}, outside [-1, {num_experts}) for num_experts={num_experts}")
    return topk_idx


def check_topk_weights(topk_weights, topk_idx: torch.Tensor, name: str = "topk_weights") -> torch.Tensor:
    return check_tensor(name, topk_weights, (torch.float32,), shape=tuple(topk_idx.shape))


def check_flag_pair(async_finish: bool, return_recv_hook: bool) -> None:
    if async_finish and return_recv_hook:
        raise ValueError("async_finish and return_recv_hook cannot both be set: with a hook the call only "
                         "issues the sends and hook() receives")


def check_stream_flags(previous_event, async_finish: bool, allocate_on_comm_stream: bool) -> None:
    if allocate_on_comm_stream and (previous_event is None or not async_finish):
        raise ValueError("allocate_on_comm_stream=True requires previous_event and async_finish=True "
                         "(the outputs then belong to the communication stream)")
