"""Both transports over GPU memory (cuda-copy, and tcp staged through pinned host memory) in the same 2-GPU
exchange (tests/gpu_transport_exchange.py): writes with and without immediates, and signed 64-bit atomic adds
from both ranks, with and without reorder injection."""

import pytest

from tests.gpu_transport_exchange import KINDS, atomics_body, exchange_body, skip_without
from tests.multiprocess import run_ranks


@pytest.mark.gpu
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("reorder_seed,env_seed", [(-1, None), (12345, None), (-1, 99)],
                         ids=["in-order", "reorder", "reorder-env"])
def test_writes_and_immediates(kind, reorder_seed, env_seed):
    skip_without(kind, gpus=2)
    run_ranks(2, exchange_body, backend="nccl", kind=kind, reorder_seed=reorder_seed, env_seed=env_seed)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("reorder_seed", [-1, 7], ids=["in-order", "reorder"])
def test_atomics_from_both_ranks(kind, reorder_seed):
    skip_without(kind, gpus=2)
    run_ranks(2, atomics_body, backend="nccl", kind=kind, reorder_seed=reorder_seed)
