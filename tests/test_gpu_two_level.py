"""Normal mode across hosts in two hops on GPUs: the ranks of one machine split into logical hosts, the rail hop
over NCCL and the forward hop through the native intranode Buffer of each host, against the reference engine
(tests/test_two_level.py's body, there on CPU ranks)."""

import os

import pytest

from tests.multiprocess import needs_feature, needs_gpus, run_ranks
from tests.test_two_level import two_hops_body

RANKS = int(os.environ.get("UCCL_EP_TEST_RANKS", "2"))
# hosts of 1 GPU each, and (with 4 or more) of 2
SPLITS = [1] + ([2] if RANKS >= 4 else [])

pytestmark = [pytest.mark.gpu, needs_gpus(RANKS)]


@pytest.mark.parametrize("per_host", SPLITS, ids=lambda n: f"{n}-per-host")
@pytest.mark.parametrize("use_fp8", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize("num_worst_tokens", [0, 160], ids=["exact", "worst-tokens"])
def test_two_hops_on_gpus_match_the_reference(per_host, use_fp8, num_worst_tokens):
    run_ranks(RANKS, two_hops_body, backend="nccl", per_host=per_host, use_fp8=use_fp8,
              num_worst_tokens=num_worst_tokens, num_nvl_bytes=1 << 26)


@pytest.mark.parametrize("rail", [
    pytest.param("tcp", marks=needs_feature("tcp_device_memory")),
    pytest.param("cuda-copy", marks=needs_feature("cuda_copy_transport"))])
@pytest.mark.parametrize("per_host", SPLITS, ids=lambda n: f"{n}-per-host")
@pytest.mark.parametrize("reorder_seed", [None, 3], ids=["in-order", "reordered"])
def test_two_hops_over_a_transport_on_gpus_match_the_reference(rail, per_host, reorder_seed):
    """The hop between hosts through a proxies' transport over a region in GPU memory: tcp, or cuda-copy (copy
    engines into the other logical hosts' regions, mapped with CUDA IPC: one machine stands for several)."""
    run_ranks(RANKS, two_hops_body, backend="nccl", per_host=per_host, use_fp8=True, num_worst_tokens=0,
              num_nvl_bytes=1 << 26, rail=rail, reorder_seed=reorder_seed)


@pytest.mark.parametrize("rail", [
    pytest.param("tcp", marks=needs_feature("tcp_device_memory")),
    pytest.param("cuda-copy", marks=needs_feature("cuda_copy_transport"))])
def test_two_hops_in_pieces_over_a_transport_on_gpus(rail):
    """A rail region of a few rows per slot in GPU memory: the copies into and out of it finish before a write reads
    them or a give-back lets the peer overwrite them."""
    run_ranks(RANKS, two_hops_body, backend="nccl", per_host=1, use_fp8=True, num_worst_tokens=0,
              num_nvl_bytes=1 << 26, rail=rail, reorder_seed=7, rail_bytes=8192)
