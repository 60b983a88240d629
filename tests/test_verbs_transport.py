"""The verbs transport (csrc/transport/verbs_transport.*) against a real verbs provider: in CI, soft-RoCE (two
rxe devices over a veth pair) inside the qemu guest of tests/soft_roce/guest.sh, which tests/soft_roce/run_tests.sh
starts. Outside such a guest (no RDMA device) only the error of a host without one runs.

The multi-rank exchange with immediates and atomics is tests/test_transport_exchange.py's (kind "verbs"); here:
argument errors, requests to itself, four ranks, a wrong device or GID index, and what a host without RDMA says.
"""

import pytest
import torch

from tests.multiprocess import run_ranks
from tests.transport_exchange import (POISON, assert_local_requests, assert_requests_checked, exchange_body,
                                      rdma_devices, skip_without)
from uccl_ep_plugin import _C

pytestmark = pytest.mark.skipif("verbs_transport" not in _C.build_info()["features"],
                                reason="the extension was built without the verbs transport (no rdma-core headers)")


def _one_rank(region, **kwargs):
    transport = _C.VerbsTransport(0, 1, region.data_ptr(), region.numel(), device=rdma_devices()[0], **kwargs)
    transport.connect([transport.listen_address()])
    return transport


def test_without_an_rdma_device_the_error_says_what_to_do():
    if rdma_devices():
        pytest.skip("this host has RDMA devices")
    region = torch.zeros(4096, dtype=torch.uint8)
    with pytest.raises(RuntimeError, match="no RDMA device found.*UCCL_EP_PROXY_TRANSPORT=tcp"):
        _C.VerbsTransport(0, 1, region.data_ptr(), region.numel())


def test_bad_arguments_name_the_argument():
    skip_without("verbs", gpus=0)
    region = torch.full((4096,), POISON, dtype=torch.uint8)
    transport = _one_rank(region)
    assert transport.device_name == rdma_devices()[0] and transport.port == 1 and transport.gid_index >= 0
    assert_requests_checked(transport, 4096)
    transport.close()


@pytest.mark.parametrize("reorder_seed", [-1, 5], ids=["in-order", "reorder"])
def test_requests_to_itself(reorder_seed):
    skip_without("verbs", gpus=0)
    region = torch.full((1 << 16,), POISON, dtype=torch.uint8)
    assert_local_requests(region, lambda: _one_rank(region, reorder_seed=reorder_seed))


def test_unknown_device_is_named_with_the_ones_there_are():
    skip_without("verbs", gpus=0)
    region = torch.zeros(4096, dtype=torch.uint8)
    with pytest.raises(RuntimeError, match=f"no RDMA device named 'nosuch9'.*{rdma_devices()[0]}"):
        _C.VerbsTransport(0, 1, region.data_ptr(), region.numel(), device="nosuch9")


def test_wrong_gid_index_is_refused():
    skip_without("verbs", gpus=0)
    region = torch.zeros(4096, dtype=torch.uint8)
    with pytest.raises(RuntimeError, match="GID index 4000 .UCCL_IB_GID_INDEX."):
        _C.VerbsTransport(0, 1, region.data_ptr(), region.numel(), device=rdma_devices()[0], gid_index=4000)


def test_four_ranks_exchange_with_reordering():
    skip_without("verbs", gpus=0)
    run_ranks(4, exchange_body, kind="verbs", reorder_seed=2024, env_seed=None)
