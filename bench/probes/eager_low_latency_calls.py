"""Probe: one eager low-latency call at a time, as a serving engine's decode step makes them without CUDA graphs.

Each call follows a device sync and a barrier; CUDA events around it give the time a caller's stream spends on it
(the host's time until the kernel is launched, then the kernel), and the host clock the time until the call
returned. Also the dispatch with its receive hook, and a dispatch + combine pair issued back to back (the kernels'
time once the host runs ahead). ``--packages`` names the modules whose ``Buffer``s are timed: this package, and any
with DeepEP's API installed beside it (e.g. ``deep_ep``). Several packages run in the same processes, each with its
own Buffer, their calls taking turns: the host of a process on the lent machines can run twice as fast as another's,
so only figures taken in one process compare. One process per GPU over NCCL; ``--ranks 1`` times the host path
alone, with no peer to wait for. Results: docs/PERFORMANCE.md.

    python bench/probes/eager_low_latency_calls.py --ranks 2 --packages uccl_ep_plugin,deep_ep
"""

import argparse
import importlib
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))  # bench/probes/ -> root

from uccl_ep_plugin.local_port import free_local_port  # noqa: E402


def _timed_alone(calls, group, iterations: int, warmup: int = 10):
    """Median (events us, host us) of each of ``calls`` run alone: a sync and a barrier before each, the calls
    taking turns (in reverse order every other round, so that none always follows another)."""
    samples = [([], []) for _ in calls]
    for i in range(warmup + iterations):
        turns = list(zip(calls, samples))
        for call, (events, host) in (turns if i % 2 == 0 else reversed(turns)):
            torch.cuda.synchronize()
            dist.barrier(group)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            began = time.perf_counter()
            call()
            returned = time.perf_counter()
            end.record()
            torch.cuda.synchronize()
            if i >= warmup:
                events.append(start.elapsed_time(end) * 1e3)
                host.append((returned - began) * 1e6)
    return [(statistics.median(events), statistics.median(host)) for events, host in samples]


def _host_speed(tokens: int, hidden: int, iterations: int = 200) -> float:
    """Median host us of a torch.empty of the dispatch's input size (no kernel): how fast this process's host
    path runs at all."""
    times = []
    for _ in range(iterations):
        began = time.perf_counter()
        torch.empty(tokens, hidden, dtype=torch.bfloat16, device="cuda")
        times.append((time.perf_counter() - began) * 1e6)
    return statistics.median(times)


def _back_to_back(calls, group, iterations: int, warmup: int = 10, rounds: int = 3):
    """Events us per call over ``iterations`` calls issued with no wait between them, for each of ``calls``: the
    median of ``rounds`` rounds, the calls taking turns."""
    per_call = [[] for _ in calls]
    for _ in range(rounds):
        for call, figures in zip(calls, per_call):
            for _ in range(warmup):
                call()
            torch.cuda.synchronize()
            dist.barrier(group)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(iterations):
                call()
            end.record()
            torch.cuda.synchronize()
            figures.append(start.elapsed_time(end) * 1e3 / iterations)
    return [(statistics.median(figures), None) for figures in per_call]


class _Calls:
    """One package's Buffer and the calls timed on it, on inputs shared by every package."""

    def __init__(self, package: str, group, inputs: dict, args: argparse.Namespace, num_ranks: int):
        Buffer = importlib.import_module(package).Buffer
        tokens, hidden, experts = args.tokens, args.hidden, args.experts
        self.buffer = Buffer(group, num_rdma_bytes=Buffer.get_low_latency_rdma_size_hint(tokens, hidden, num_ranks,
                                                                                         experts),
                             low_latency_mode=True, num_qps_per_rank=experts // num_ranks, explicitly_destroy=True)
        self.inputs, self.args, self.handle = inputs, args, None

    def dispatch(self):
        x, topk_idx = self.inputs["x"], self.inputs["topk_idx"]
        self.handle = self.buffer.low_latency_dispatch(x, topk_idx, self.args.tokens, self.args.experts,
                                                       use_fp8=True)[2]

    def dispatch_and_hook(self):
        x, topk_idx = self.inputs["x"], self.inputs["topk_idx"]
        returned = self.buffer.low_latency_dispatch(x, topk_idx, self.args.tokens, self.args.experts, use_fp8=True,
                                                    return_recv_hook=True)
        returned[4]()
        self.handle = returned[2]

    def combine(self):
        self.buffer.low_latency_combine(self.inputs["expert_out"], self.inputs["topk_idx"],
                                        self.inputs["topk_weights"], self.handle)

    def both(self):
        self.dispatch()
        self.combine()


def _rank(rank: int, num_ranks: int, port: int, args: argparse.Namespace) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=num_ranks, device_id=torch.device("cuda", rank))
    group = dist.new_group(list(range(num_ranks)))
    tokens, hidden, experts = args.tokens, args.hidden, args.experts
    generator = torch.Generator(device="cuda").manual_seed(100 + rank)
    inputs = dict(x=torch.randn(tokens, hidden, dtype=torch.bfloat16, device="cuda", generator=generator),
                  topk_idx=torch.topk(torch.rand(tokens, experts, device="cuda", generator=generator), args.topk,
                                      dim=-1).indices,
                  topk_weights=torch.rand(tokens, args.topk, device="cuda", generator=generator),
                  expert_out=torch.randn(experts // num_ranks, num_ranks * tokens, hidden, dtype=torch.bfloat16,
                                         device="cuda", generator=generator))
    packages = args.packages.split(",")
    timed = []
    try:
        for package in packages:
            timed.append(_Calls(package, group, inputs, args, num_ranks))
        rows = [("dispatch", _timed_alone([c.dispatch for c in timed], group, args.iters)),
                ("dispatch send + hook", _timed_alone([c.dispatch_and_hook for c in timed], group, args.iters))]
        for calls in timed:
            calls.dispatch()
        rows.append(("combine", _timed_alone([c.combine for c in timed], group, args.iters)))
        rows.append(("dispatch + combine, back to back", _back_to_back([c.both for c in timed], group, args.iters)))
        if rank == 0:
            speed = _host_speed(tokens, hidden)
            print(f"{num_ranks} rank(s), {tokens} tokens, H {hidden}, {experts} experts, top-{args.topk}, fp8 "
                  f"dispatch (median us, rank 0); this process's host speed: torch.empty {speed:.1f} us (processes "
                  "on one host can differ up to 2x: compare packages in one run)")
            print("| call | " + " | ".join(f"{p} events | {p} host" for p in packages) + " |")
            print("|---|" + "---|---|" * len(packages))
            for name, figures in rows:
                cells = [f"{events:.1f} | {'' if host is None else f'{host:.1f}'}" for events, host in figures]
                print(f"| {name} | " + " | ".join(cells) + " |")
    finally:
        for calls in timed:
            calls.buffer.destroy()
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=None, help="processes, one per GPU (default: every GPU)")
    parser.add_argument("--packages", default="uccl_ep_plugin",
                        help="comma-separated modules whose Buffers are timed in the same processes, in turn")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--hidden", type=int, default=7168)
    parser.add_argument("--experts", type=int, default=288)
    parser.add_argument("--topk", type=int, default=8)
    parser.add_argument("--iters", type=int, default=50)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("this probe needs a CUDA GPU")
    num_ranks = args.ranks or torch.cuda.device_count()
    mp.spawn(_rank, args=(num_ranks, free_local_port(), args), nprocs=num_ranks)


if __name__ == "__main__":
    main()
