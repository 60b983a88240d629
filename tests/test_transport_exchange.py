"""The transports in one exchange (tests/transport_exchange.py): writes with and without immediates, and signed
64-bit atomic adds from both ranks, with and without reorder injection. Over GPU memory on 2 GPUs (cuda-copy;
tcp staged through pinned host memory) and, in CI, over host memory between CPU processes (tcp-host; verbs over
two soft-RoCE devices inside tests/soft_roce/guest.sh)."""

import pytest

from tests.multiprocess import run_ranks
from tests.transport_exchange import GPU_KINDS, atomics_body, exchange_body, skip_without

KINDS = [pytest.param(kind, marks=pytest.mark.gpu) for kind in GPU_KINDS] + ["tcp-host", "verbs"]


def _run(body, kind, **kwargs):
    gpus = 0 if kind in ("tcp-host", "verbs") else 2
    skip_without(kind, gpus=gpus)
    run_ranks(2, body, backend="nccl" if gpus else "gloo", kind=kind, **kwargs)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("reorder_seed,env_seed", [(-1, None), (12345, None), (-1, 99)],
                         ids=["in-order", "reorder", "reorder-env"])
def test_writes_and_immediates(kind, reorder_seed, env_seed):
    _run(exchange_body, kind, reorder_seed=reorder_seed, env_seed=env_seed)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("reorder_seed", [-1, 7], ids=["in-order", "reorder"])
def test_atomics_from_both_ranks(kind, reorder_seed):
    _run(atomics_body, kind, reorder_seed=reorder_seed)
