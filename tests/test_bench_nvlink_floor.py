"""The NVLink floor ``uccl-ep bench`` prints beside each native normal-mode figure: the busier way's bytes of the
slowest rank over the copy bandwidth the machine measured. The arithmetic, and that measure() takes the slowest
rank's bytes and reports a floor only for the native engine; the bandwidth measurement itself needs GPUs
(tests/test_gpu_bench_nvlink.py)."""

import pytest
import torch

from tests.multiprocess import run_ranks
from uccl_ep_plugin.benchmark import nvlink, runner
from uccl_ep_plugin.benchmark.case import Case
from uccl_ep_plugin.benchmark.report import table
from uccl_ep_plugin.benchmark.workloads import Workload

WORKLOAD = Workload("normal", tokens=4096, hidden=7168, topk=8, experts=256)


def test_busier_way_bytes_and_floor():
    # EP4, bf16: about 0.9 of 4096 tokens to each of 3 peers is 11059 rows of 14336 bytes, 158.5 MB; at 450 GB/s
    # each way that is 352 us, the floor the issue quotes.
    rows = round(3 * 0.9 * 4096)
    assert nvlink.busier_way_bytes(rows, rows - 100, 7168, "bf16") == rows * 14336
    assert nvlink.busier_way_bytes(rows - 100, rows, 7168, "bf16") == rows * 14336   # the other way is busier
    assert nvlink.floor_us([rows * 14336], 450.0) == pytest.approx(352.3, abs=0.1)
    # fp8 rows carry one float scale per 128 elements: 7168 + 224 bytes.
    assert nvlink.row_bytes(7168, "fp8") == 7392
    assert nvlink.floor_us([1e9, 3e9, 2e9], 500.0) == pytest.approx(6000.0)   # the slowest rank sets it


def _measure_body(rank, num_ranks, group, engine, copy_gbps):
    # Rank r's NVLink carries (r + 1) GB the busier way: the slowest rank's 2 GB at 400 GB/s is 5000 us.
    case = Case("normal", "dispatch", "bf16", WORKLOAD, run=lambda: None, check=lambda: True, bytes_per_rank=1.0,
                engine=engine, capturable=False, nvlink_bytes=(rank + 1) * 1e9)
    options = runner.BenchOptions(num_ranks=num_ranks, device="cpu", normal=WORKLOAD, low_latency=None, warmup=1,
                                  iters=2, seed=0, device_name="cpu", commit="test")
    result = runner.measure(case, options, rank, group, torch.device("cpu"), lambda _: None, copy_gbps)
    # Every case carries its slowest rank's pure-Python loop, so host figures can be read against it.
    assert result["host_loop_us"] > 0 and "host loop" in table([result])
    if engine == "native" and copy_gbps:
        assert result["nvlink_floor_us"] == pytest.approx(5000.0) and result["copy_gbps"] == copy_gbps
        assert "NVLink floor" in table([result]) and "5000.0 us" in table([result])
    else:
        assert result["nvlink_floor_us"] is None and "NVLink floor" not in table([result])


@pytest.mark.parametrize("engine,copy_gbps", [("native", 400.0), ("reference", 400.0), ("native", None)])
def test_measure_reports_the_slowest_ranks_floor_for_the_native_engine_only(engine, copy_gbps):
    run_ranks(2, _measure_body, engine=engine, copy_gbps=copy_gbps)
