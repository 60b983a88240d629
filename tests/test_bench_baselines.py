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
        outputs[(case.op, case.dtype)] = case
    # Each check reads what its case produced: corrupt the output tensors the closures hold and the checks fail.
    for (op, dtype), case in outputs.items():
        cells = [c.cell_contents for c in case.run.__closure__ or () if isinstance(c.cell_contents, torch.Tensor)]
        written = [t for t in cells if t.numel() > 0]
        for tensor in written:
            tensor.mul_(-1).add_(1)
        assert not case.check(), f"rank {rank}: {op} {dtype} still passes with its tensors corrupted"


def test_baselines_run_and_check_on_gloo():
    run_ranks(2, _body)


def test_case_count_follows_modes_and_baselines():
    from uccl_ep_plugin.benchmark.runner import BenchOptions, num_cases
    low_latency = Workload("low_latency", tokens=8, hidden=256, topk=2, experts=8)

    def options(normal, ll, with_baselines, device="cpu"):
        return BenchOptions(num_ranks=2, device=device, normal=normal, low_latency=ll, warmup=0, iters=1, seed=0,
                            device_name=device, commit="test", baselines=with_baselines)

    assert num_cases(options(WORKLOAD, None, True)) == 4 + baselines.NUM_CASES
    assert num_cases(options(WORKLOAD, None, False)) == 4
    assert num_cases(options(WORKLOAD, low_latency, False)) == 4 + 7
    assert num_cases(options(None, low_latency, True)) == 7
    # On GPUs normal mode is also timed with num_worst_tokens (fp8 and bf16 dispatch, combine), replayed from graphs.
    assert num_cases(options(WORKLOAD, None, False, "cuda")) == 7


def test_report_shows_kernel_host_and_back_to_back_times():
    from uccl_ep_plugin.benchmark.report import progress_line, table
    result = dict(mode="normal", op="dispatch", dtype="bf16", engine="native", path="nvlink-ce", ranks=2, tokens=8,
                  hidden=256, topk=2, experts=8, median_us=412.5, kernel_us=None, host_us=288.25, gbps=1.5,
                  correct=True)
    assert progress_line(1, 3, result) == "[1/3] normal dispatch bf16: 412.5 us (host 288.2 us), 1.50 GB/s, ok"
    both = dict(result, kernel_us=250.0)
    assert "(kernels 250.0 us, host 288.2 us)" in progress_line(1, 3, both)
    assert progress_line(2, 3, dict(result, host_us=None, correct=False)).endswith("412.5 us, 1.50 GB/s, WRONG")
    header, _, row = table([result]).splitlines()
    # Columns with no value in any row are left out; times carry their unit.
    assert header.split()[-4:] == ["median", "host", "GB/s", "correct"] and "kernel" not in header
    assert row.split()[-6:] == ["412.5", "us", "288.2", "us", "1.50", "True"]
    assert "412.5 us" in table([result, dict(result, host_us=None)]) and " - " in table([result, dict(result, host_us=None)])
    assert "12.5 ms" in table([dict(result, median_us=12_500.0)])
    # The host's time per call when calls go back to back.
    hosted = dict(result, host_back_to_back_us=95.0)
    assert "(host 288.2 us, host back to back 95.0 us)" in progress_line(1, 3, hosted)
    header, _, row = table([hosted]).splitlines()
    assert "host b2b" in header and row.split()[-6:-2] == ["288.2", "us", "95.0", "us"]
    # DeepEP's timing (calls back to back) beside ours, with its bandwidth.
    timed_both = dict(result, back_to_back_us=300.0, back_to_back_gbps=2.06)
    assert "(host 288.2 us, back to back 300.0 us)" in progress_line(1, 3, timed_both)
    header, _, row = table([timed_both]).splitlines()
    assert "b2b GB/s" in header and row.split()[-5:-1] == ["1.50", "300.0", "us", "2.06"]
