"""The NVLink copy bandwidth behind the bench's normal-mode floor (uccl_ep_plugin/benchmark/nvlink.py), measured
on real GPUs: every rank pushes into every peer's mapped buffer at once."""

import pytest
import torch
import torch.distributed as dist

from tests.multiprocess import needs_feature, needs_gpus, rank_device, ranks_share_gpus, run_ranks
from uccl_ep_plugin.benchmark import nvlink


pytestmark = [pytest.mark.gpu, needs_gpus(2), needs_feature("normal_nvlink"),
              pytest.mark.skipif(ranks_share_gpus(), reason="one time-shared GPU has no NVLink to measure")]


def _body(rank, num_ranks, group):
    from uccl_ep_plugin import _C
    device = rank_device(rank)
    torch.cuda.set_device(device)
    gbps = nvlink.measure_copy_gbps(_C, group, rank, num_ranks, device, bytes_per_peer=16 << 20)
    every = [None] * num_ranks
    dist.all_gather_object(every, gbps, group=group)
    assert len(set(every)) == 1, f"the ranks disagree on the bandwidth: {every}"
    # NVLink between H100/H200s: hundreds of GB/s; PCIe would be tens. Either way within these bounds.
    assert 5.0 < gbps < 5000.0, gbps


def test_nvlink_copy_bandwidth_is_measured_alike_on_every_rank():
    run_ranks(2, _body, backend="nccl")
