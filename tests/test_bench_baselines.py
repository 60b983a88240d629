"""The NCCL-path baselines of ``uccl-ep bench`` (all_gather / reduce_scatter, all_to_all_single), run on 2
gloo ranks: every case passes its check after one call, and fails it when its output is corrupted."""

import torch

from tests.multiprocess import run_ranks
from uccl_ep_plugin.benchmark import baselines
from uccl_ep_plugin.benchmark.workloads import Workload

WORKLOAD = Workload("normal", tokens=48, hidden=256, topk=4, experts=8)


def _body(rank, num_ranks, group):
    cases = baselines.baseline_cases(WORKLOAD, rank, num_ranks, seed=3, group=group, device=torch.device("cpu"))
    assert len(cases) == baselines.NUM_CASES
    outputs = {}
    for case in cases:
        case.run()
        assert case.check(), f"rank {rank}: {case.op} fails its check"
        assert case.bytes_per_rank > 0
        outputs[case.op] = case
    # Each check reads what its case produced: corrupt the output tensors the closures hold and the checks fail.
    for op, case in outputs.items():
        cells = [c.cell_contents for c in case.run.__closure__ or () if isinstance(c.cell_contents, torch.Tensor)]
        written = [t for t in cells if t.numel() > 0]
        for tensor in written:
            tensor.mul_(-1).add_(1)
        assert not case.check(), f"rank {rank}: {op} still passes with its tensors corrupted"


def test_baselines_run_and_check_on_gloo():
    run_ranks(2, _body)


def test_case_count_follows_modes_and_baselines():
    from uccl_ep_plugin.benchmark.runner import BenchOptions, num_cases
    low_latency = Workload("low_latency", tokens=8, hidden=256, topk=2, experts=8)

    def options(normal, ll, with_baselines):
        return BenchOptions(num_ranks=2, device="cpu", normal=normal, low_latency=ll, warmup=0, iters=1, seed=0,
                            device_name="cpu", commit="test", baselines=with_baselines)

    assert num_cases(options(WORKLOAD, None, True)) == 3 + baselines.NUM_CASES
    assert num_cases(options(WORKLOAD, None, False)) == 3
    assert num_cases(options(WORKLOAD, low_latency, False)) == 3 + 7
    assert num_cases(options(None, low_latency, True)) == 7
