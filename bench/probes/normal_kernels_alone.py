"""Probe: the kernel time of the normal mode's local kernels with every rank on ONE GPU.

Where only one GPU is at hand, ranks can still share it (CUDA IPC and the copy engines work within a device): the
processes' kernels then run in turns (time slices), so end-to-end figures mean nothing, but a kernel that touches
only its own rank's memory runs alone within a slice: its **minimum** over the profiled calls is its time on that
GPU, and the medians, which include the other ranks' slices, are printed only to show that. Such kernels: the
copy-engine dispatch's gather, and ``receive_own_rows``, whose last block also waits for the copies of the call
(so its figure is its own work or those copies, whichever ends later). Each call runs between ``synchronize()`` and a
barrier, under ``torch.profiler``. Results: docs/PERFORMANCE.md (session 37), docs/KERNEL_NOTES.md ("The gather's
latency").

    python bench/probes/normal_kernels_alone.py --ranks 2 --num-sms 24 8
"""

import argparse
import collections
import os
import statistics
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))  # bench/probes/ -> root

from ranks_on_one_gpu import run_ranks_on_one_gpu  # noqa: E402
from uccl_ep_plugin.benchmark.workloads import Workload, per_token_fp8, routing  # noqa: E402

KERNELS = ("gather_for_peers", "receive_own_rows")   # the local ones: their minimum is their time


def _kernel_times(call, group, calls: int):
    """{kernel name: [device us per call]} of ``calls`` calls, each between a synchronize and a barrier."""
    from torch.profiler import ProfilerActivity, profile
    times = collections.defaultdict(list)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            torch.cuda.synchronize()
            dist.barrier(group)
            call()
            torch.cuda.synchronize()
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            name = next((kernel for kernel in KERNELS if kernel in event.name), None)
            if name is not None:
                times[name].append(event.device_time_total)
    return times


def _rank(rank: int, num_ranks: int, group, args: argparse.Namespace, results) -> None:
    import uccl_ep_plugin as ep
    workload = Workload("normal", args.tokens, args.hidden, args.topk, args.experts)
    buffer = ep.Buffer(group, num_nvl_bytes=args.nvl_bytes, explicitly_destroy=True)
    try:
        x, topk_idx, topk_weights = (t.cuda() for t in routing(workload, rank, seed=1))
        x_fp8 = per_token_fp8(x)
        per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk_idx, args.experts)
        layout = dict(num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                      topk_idx=topk_idx, topk_weights=topk_weights)
        for num_sms in args.num_sms:
            config = ep.Config(num_sms=num_sms)
            handle = buffer.dispatch(x, config=config, **layout)[4]
            operations = {"fp8 dispatch": lambda: buffer.dispatch(x_fp8, config=config, **layout),
                          "bf16 dispatch": lambda: buffer.dispatch(x, config=config, **layout),
                          "cached bf16": lambda: buffer.dispatch(x, handle=handle, config=config)}
            for name, call in operations.items():
                for _ in range(3):   # warm up
                    call()
                times = _kernel_times(call, group, args.calls)
                if rank == 0:
                    results.put((num_sms, name, {kernel: (min(t), statistics.median(t), len(t))
                                                 for kernel, t in times.items()}))
                    print(f"[probe] {num_sms} SMs, {name}: done", flush=True)
    finally:
        buffer.destroy()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--num-sms", type=int, nargs="+", default=[24, 8])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=7168)
    parser.add_argument("--topk", type=int, default=8)
    parser.add_argument("--experts", type=int, default=256)
    parser.add_argument("--calls", type=int, default=30, help="profiled calls per operation")
    parser.add_argument("--nvl-bytes", type=int, default=1 << 30)
    args = parser.parse_args()
    results = run_ranks_on_one_gpu(_rank, args.ranks, args)
    print(f"\n{args.ranks} ranks on one GPU ({torch.cuda.get_device_name(0)}), {args.tokens} tokens, H {args.hidden}, "
          f"top-{args.topk} of {args.experts} experts; rank 0's kernels, us over {args.calls} calls\n")
    print("| SMs | operation | kernel | min (its time) | median (with other ranks' slices) |")
    print("|---|---|---|---|---|")
    for num_sms, name, kernels in results:
        for kernel, (fastest, median, count) in sorted(kernels.items()):
            print(f"| {num_sms} | {name} | `{kernel}` | {fastest:.1f} | {median:.1f} (n {count}) |")


if __name__ == "__main__":
    main()
