"""Both transports over GPU memory (cuda-copy, and tcp staged through pinned host memory) in the same 2-GPU
exchange (tests/gpu_transport_exchange.py): writes with and without immediates, and signed 64-bit atomic adds
from both ranks, with and without reorder injection."""

import pytest
import torch

from tests.gpu_transport_exchange import KINDS, atomics_body, exchange_body
from tests.multiprocess import run_ranks
from uccl_ep_plugin import _C

FEATURES = {"cuda-copy": "cuda_copy_transport", "tcp": "tcp_device_memory"}


def _require(kind):
    if FEATURES[kind] not in _C.build_info()["features"]:
        pytest.skip(f"the extension was built without {FEATURES[kind]}")
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA GPUs")


@pytest.mark.gpu
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("reorder_seed,env_seed", [(-1, None), (12345, None), (-1, 99)],
                         ids=["in-order", "reorder", "reorder-env"])
def test_writes_and_immediates(kind, reorder_seed, env_seed):
    _require(kind)
    run_ranks(2, exchange_body, backend="nccl", kind=kind, reorder_seed=reorder_seed, env_seed=env_seed)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("reorder_seed", [-1, 7], ids=["in-order", "reorder"])
def test_atomics_from_both_ranks(kind, reorder_seed):
    _require(kind)
    run_ranks(2, atomics_body, backend="nccl", kind=kind, reorder_seed=reorder_seed)
