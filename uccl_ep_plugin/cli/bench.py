"""``uccl-ep bench``: dispatch/combine figures on N local ranks (GPUs over NCCL, or CPU processes over gloo)."""

import argparse
import os
import platform
import subprocess
import sys
import time
from typing import Optional

import torch
import torch.multiprocessing as mp

from ..benchmark import channel, transport
from ..benchmark.report import print_summary, progress_line, write_json
from ..benchmark.runner import BenchOptions, num_cases, run_rank
from ..benchmark.workloads import Workload
from ..engines.native.peers import FORCE_PROXY_ENV, force_proxy
from ..hosts import GPUS_PER_NODE_ENV
from ..local_port import free_local_port
from ..proxies import MODULE_LOADING_ENV, eager_module_loading


def register(subparsers) -> None:
    parser = subparsers.add_parser("bench", help="benchmark dispatch/combine (normal and low-latency modes)",
                                   description="Spawns local ranks and measures DeepEP-style dispatch/combine "
                                               "figures; every case is checked for correctness.")
    parser.add_argument("--ranks", type=int, default=None,
                        help="number of local ranks (default: the GPU count, or 2 on CPU)")
    parser.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto",
                        help="cuda: one rank per GPU over NCCL; cpu: processes over gloo (default: cuda if present)")
    parser.add_argument("--mode", choices=("all", "normal", "low_latency", "channel", "transport"), default="all",
                        help="channel: the GPU->CPU command FIFOs alone on the current GPU; transport: latency and "
                             "bandwidth of writes, immediates and atomics per transport (tcp; verbs with an RDMA "
                             "device), host memory; neither is part of all")
    parser.add_argument("--tokens", type=int, default=4096, help="normal mode: tokens per rank")
    parser.add_argument("--hidden", type=int, default=7168)
    parser.add_argument("--topk", type=int, default=8)
    parser.add_argument("--experts", type=int, default=256, help="normal mode: experts")
    parser.add_argument("--ll-tokens", type=int, default=128, help="low-latency mode: tokens per rank")
    parser.add_argument("--ll-experts", type=int, default=288, help="low-latency mode: experts")
    parser.add_argument("--num-sms", type=int, default=24, help="SMs for normal-mode kernels (even)")
    parser.add_argument("--gpus-per-node", type=int, default=None,
                        help="cut the local ranks into hosts of this many (UCCL_EP_GPUS_PER_NODE): normal mode then "
                             "runs its two hops across them, and the low-latency mode its cross-host path where "
                             "UCCL_EP_PROXY_TRANSPORT names one")
    parser.add_argument("--warmup", type=int, default=None, help="untimed iterations (default 5 GPU, 1 CPU)")
    parser.add_argument("--iters", type=int, default=None, help="timed iterations (default 50 GPU, 5 CPU)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--no-baselines", dest="baselines", action="store_false",
                        help="normal mode: skip the NCCL all_gather/reduce_scatter/all_to_all_single cases "
                             "(for sweeps of our own settings)")
    parser.add_argument("--json", metavar="FILE", help="write the figures as a JSON list to FILE")
    parser.set_defaults(handler=run)


def _commit() -> str:
    """The source commit: $UCCL_EP_BENCH_COMMIT (for copies of a tree without .git), else git, else the version."""
    if os.environ.get("UCCL_EP_BENCH_COMMIT"):
        return os.environ["UCCL_EP_BENCH_COMMIT"]
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        return subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=here, capture_output=True, text=True,
                              timeout=10, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        from .. import __version__
        return f"release {__version__}"


def _device_name(device: str, num_ranks: int) -> str:
    if device == "cuda":
        return f"{num_ranks}x {torch.cuda.get_device_name(0)}"
    return f"cpu ({os.cpu_count()} cores, {platform.machine()})"


def argument_problem(args: argparse.Namespace, num_ranks: int) -> Optional[str]:
    """The first argument that cannot work, in one line naming it and the rule; None if all can."""
    rules = [("--ranks", args.ranks is None or args.ranks >= 1, "must be at least 1"),
             ("--tokens", args.tokens >= 1, "must be at least 1"),
             ("--ll-tokens", args.ll_tokens >= 1, "must be at least 1"),
             ("--hidden", args.hidden >= 128 and args.hidden % 128 == 0,
              "must be a positive multiple of 128 (the fp8 cases scale each 128 channels)"),
             ("--topk", 1 <= args.topk <= min(args.experts, args.ll_experts),
              "must be in 1..the number of experts"),
             ("--experts", args.experts >= 1 and args.experts % num_ranks == 0,
              f"must be a positive multiple of the {num_ranks} ranks"),
             ("--ll-experts", args.ll_experts >= 1 and args.ll_experts % num_ranks == 0,
              f"must be a positive multiple of the {num_ranks} ranks"),
             ("--num-sms", args.num_sms >= 2 and args.num_sms % 2 == 0, "must be an even number of at least 2"),
             ("--gpus-per-node", args.gpus_per_node is None or (args.gpus_per_node >= 1 and
                                                                num_ranks % args.gpus_per_node == 0),
              f"must divide the {num_ranks} ranks"),
             ("--warmup", args.warmup is None or args.warmup >= 0, "must be at least 0"),
             ("--iters", args.iters is None or args.iters >= 1, "must be at least 1")]
    for name, ok, rule in rules:
        if not ok:
            return f"{name} {getattr(args, name[2:].replace('-', '_'))} {rule}"
    return None


def run(args: argparse.Namespace) -> int:
    if args.ranks is not None and args.ranks < 1:
        print(f"uccl-ep bench: --ranks {args.ranks} must be at least 1", file=sys.stderr)
        return 2
    if args.mode == "channel":
        return channel.run_from_cli(args.device, args.json, _commit())
    if args.mode == "transport":
        return transport.run_from_cli(args.json, _commit(), args.iters)
    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() and torch.cuda.device_count() > 0 else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        print("uccl-ep bench: --device cuda but no CUDA GPU is visible", file=sys.stderr)
        return 2
    num_ranks = args.ranks if args.ranks is not None else (torch.cuda.device_count() if device == "cuda" else 2)
    if device == "cuda" and num_ranks > torch.cuda.device_count():
        print(f"uccl-ep bench: --ranks {num_ranks} but only {torch.cuda.device_count()} GPUs", file=sys.stderr)
        return 2
    problem = argument_problem(args, num_ranks)
    if problem is not None:
        print(f"uccl-ep bench: {problem}", file=sys.stderr)
        return 2
    on_gpu = device == "cuda"
    if args.gpus_per_node is not None:   # the spawned ranks inherit it
        os.environ[GPUS_PER_NODE_ENV] = str(args.gpus_per_node)
    if on_gpu and force_proxy() and not eager_module_loading():
        # The ranks inherit it; it must be set before their CUDA starts (proxies.py says why).
        os.environ[MODULE_LOADING_ENV] = "EAGER"
        print(f"uccl-ep bench: {FORCE_PROXY_ENV}=1 on GPUs: the ranks run with {MODULE_LOADING_ENV}=EAGER",
              file=sys.stderr, flush=True)
    options = BenchOptions(
        num_ranks=num_ranks, device=device,
        normal=Workload("normal", args.tokens, args.hidden, args.topk, args.experts) if args.mode != "low_latency" else None,
        low_latency=(Workload("low_latency", args.ll_tokens, args.hidden, args.topk, args.ll_experts)
                     if args.mode != "normal" else None),
        warmup=args.warmup if args.warmup is not None else (5 if on_gpu else 1),
        iters=args.iters if args.iters is not None else (50 if on_gpu else 5),
        seed=args.seed, device_name=_device_name(device, num_ranks), commit=_commit(), num_sms=args.num_sms,
        baselines=args.baselines)
    total = num_cases(options)
    hosts = "" if args.gpus_per_node is None else f" as {num_ranks // args.gpus_per_node} hosts"
    print(f"uccl-ep bench: {num_ranks} ranks{hosts} on {options.device_name}, {total} cases, "
          f"{options.warmup} warm-up + {options.iters} timed iterations each", file=sys.stderr, flush=True)

    context = mp.get_context("spawn")
    queue = context.SimpleQueue()
    port = free_local_port()
    processes = [context.Process(target=run_rank, args=(rank, options, port, queue)) for rank in range(num_ranks)]
    for process in processes:
        process.start()
    results, error, done, started = [], None, False, time.monotonic()
    while not done and error is None:
        while queue.empty():
            if all(not p.is_alive() for p in processes) and queue.empty():
                error = error or "all ranks exited before reporting results"
                break
            time.sleep(0.05)
        if error is not None:
            break
        kind, payload = queue.get()
        if kind == "progress":
            results.append(payload)
            print(progress_line(len(results), total, payload) + f"  ({time.monotonic() - started:.0f}s)",
                  file=sys.stderr, flush=True)
        elif kind == "note":
            print(payload, file=sys.stderr, flush=True)
        elif kind == "error":
            error = payload
        else:
            done = True
    for process in processes:
        process.join(timeout=30 if error is None else 5)
        if process.is_alive():
            process.kill()
    if error is not None:
        print(f"uccl-ep bench failed: {error}", file=sys.stderr)
        return 1
    print_summary(results)
    if args.json:
        write_json(results, args.json)
        print(f"wrote {args.json}")
    return 0 if all(r["correct"] for r in results) else 1
