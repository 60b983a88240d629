"""``uccl-ep bench`` settles a case (``Case.settle``: for low-latency cases ``Buffer.synchronize``, the GPU and
the proxy's last writes) before every collective of its own, and never lets a call run between the settle and
the collective: on one machine a collective's kernel holds up the proxy copies a peer still waits for."""

import torch
import torch.distributed as dist

from tests.multiprocess import run_ranks
from uccl_ep_plugin.benchmark import runner
from uccl_ep_plugin.benchmark.case import Case
from uccl_ep_plugin.benchmark.workloads import Workload

WORKLOAD = Workload("low_latency", tokens=8, hidden=256, topk=2, experts=8)


def _recording(events, name, function):
    def wrapper(*args, **kwargs):
        events.append(name)
        return function(*args, **kwargs)
    return wrapper


def _body(rank, num_ranks, group):
    events = []
    dist.barrier = _recording(events, "collective", dist.barrier)
    dist.all_gather = _recording(events, "collective", dist.all_gather)

    def check() -> bool:
        events.append("check")
        return True

    case = Case("low_latency", "dispatch", "bf16", WORKLOAD, run=lambda: events.append("run"), check=check,
                bytes_per_rank=1.0, engine="reference", prepare=lambda: events.append("prepare"),
                finish=lambda: events.append("finish"), settle=lambda: events.append("settle"))
    options = runner.BenchOptions(num_ranks=num_ranks, device="cpu", normal=None, low_latency=WORKLOAD, warmup=1,
                                  iters=2, seed=0, device_name="cpu", commit="test")
    result = runner.measure(case, options, rank, group, torch.device("cpu"), report=lambda _: None)
    assert result["correct"]
    assert events.count("run") == 3 and events.count("check") == 1
    collectives = [i for i, event in enumerate(events) if event == "collective"]
    assert collectives, "the bench issued no collective: this test checks nothing"
    for i in collectives:
        work = [event for event in events[:i] if event != "collective"]
        assert work and work[-1] == "settle", f"rank {rank}: a collective after {work[-1:]} without a settle: {events}"


def test_bench_settles_before_each_collective():
    run_ranks(2, _body)


def _low_latency_body(rank, num_ranks, group):
    from uccl_ep_plugin import Buffer
    buffer = Buffer(group, num_rdma_bytes=Buffer.get_low_latency_rdma_size_hint(WORKLOAD.tokens, WORKLOAD.hidden,
                                                                                num_ranks, WORKLOAD.experts),
                    low_latency_mode=True, explicitly_destroy=True)
    cases = runner.low_latency_cases(buffer, WORKLOAD, rank, num_ranks, 0, group, torch.device("cpu"))
    assert cases and all(case.settle == buffer.synchronize for case in cases), \
        "every low-latency case settles through its Buffer (the GPU and the proxy's last writes)"
    buffer.destroy()


def test_low_latency_cases_settle_through_the_buffer():
    run_ranks(2, _low_latency_body)
