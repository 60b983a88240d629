"""Probe: the kernel time of each low-latency launch (send and receive halves) with every rank on ONE GPU.

With ``return_recv_hook=True`` a dispatch or combine launches its send, and the hook its receive. Neither waits for
a peer's kernel of the same call: a send stores into the peers' buffers, whose previous use of that half each peer
released at its previous send, and a receive reads only its own rank's buffer, where the sends already put the rows.
So with every rank on one GPU the ranks can take turns at each half: one rank launches while the others wait at a
barrier, and the kernel has the GPU to itself (DeepEP's ``tests/test_low_latency.py`` prints the same kernels as
"send" and "recv" beside its hook figures). Rank 0's kernels under ``torch.profiler``, min and median over the calls.
Results: docs/PERFORMANCE.md.

    python bench/probes/low_latency_kernels_alone.py --ranks 2
"""

import argparse
import os
import statistics
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))  # bench/probes/ -> root

from ranks_on_one_gpu import run_ranks_on_one_gpu  # noqa: E402

OPERATIONS = ("dispatch", "combine")   # each launches one kernel of that name to send and one to receive


def _in_turn(launch, group, rank: int, num_ranks: int):
    """Each rank runs ``launch`` alone on the GPU, rank 0 first; returns what it returned."""
    returned = None
    for turn in range(num_ranks):
        if turn == rank:
            returned = launch()
            torch.cuda.synchronize()
        dist.barrier(group)
    return returned


def _rank(rank: int, num_ranks: int, group, args: argparse.Namespace, results) -> None:
    import uccl_ep_plugin as ep
    from torch.profiler import ProfilerActivity, profile
    rdma_bytes = ep.Buffer.get_low_latency_rdma_size_hint(args.tokens, args.hidden, num_ranks, args.experts)
    buffer = ep.Buffer(group, num_rdma_bytes=rdma_bytes, low_latency_mode=True,
                       num_qps_per_rank=args.experts // num_ranks, explicitly_destroy=True)
    try:
        generator = torch.Generator(device="cuda").manual_seed(100 + rank)
        x = torch.randn(args.tokens, args.hidden, dtype=torch.bfloat16, device="cuda", generator=generator)
        scores = torch.rand(args.tokens, args.experts, device="cuda", generator=generator)
        topk_idx = torch.topk(scores, args.topk, dim=-1).indices
        topk_weights = torch.rand(args.tokens, args.topk, device="cuda", generator=generator)
        expert_rows = torch.randn(args.experts // num_ranks, num_ranks * args.tokens, args.hidden,
                                  dtype=torch.bfloat16, device="cuda", generator=generator)

        def call() -> None:
            recv = _in_turn(lambda: buffer.low_latency_dispatch(x, topk_idx, args.tokens, args.experts,
                                                                use_fp8=True, return_recv_hook=True),
                            group, rank, num_ranks)
            _in_turn(recv[4], group, rank, num_ranks)
            combined = _in_turn(lambda: buffer.low_latency_combine(expert_rows, topk_idx, topk_weights, recv[2],
                                                                   return_recv_hook=True),
                                group, rank, num_ranks)
            _in_turn(combined[2], group, rank, num_ranks)

        for _ in range(5):   # warm up
            call()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(args.calls):
                call()
        if rank == 0:
            kernels = sorted((event for event in prof.events()
                              if event.device_type == torch.autograd.DeviceType.CUDA),
                             key=lambda event: event.time_range.start)
            for operation in OPERATIONS:
                launches = [event.device_time_total for event in kernels if operation in event.name]
                if len(launches) != 2 * args.calls:
                    raise RuntimeError(f"expected {2 * args.calls} {operation} kernels (send, receive), "
                                       f"got {len(launches)}")
                for half, times in (("send", launches[0::2]), ("receive", launches[1::2])):
                    results.put((operation, half, min(times), statistics.median(times)))
    finally:
        buffer.destroy()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--hidden", type=int, default=7168)
    parser.add_argument("--topk", type=int, default=8)
    parser.add_argument("--experts", type=int, default=288)
    parser.add_argument("--calls", type=int, default=40, help="profiled calls")
    args = parser.parse_args()
    results = run_ranks_on_one_gpu(_rank, args.ranks, args)
    print(f"\n{args.ranks} ranks on one GPU ({torch.cuda.get_device_name(0)}), {args.tokens} tokens, H {args.hidden}, "
          f"top-{args.topk} of {args.experts} experts, fp8 dispatch, bf16 combine; rank 0's kernels, us over "
          f"{args.calls} calls\n")
    print("| operation | half | min | median |")
    print("|---|---|---|---|")
    for operation, half, fastest, median in results:
        print(f"| {operation} | {half} | {fastest:.2f} | {median:.2f} |")


if __name__ == "__main__":
    main()
