"""The one-GPU probes' harness (bench/probes/*_alone.py): ranks as processes that all use GPU 0, joined by a gloo
group (NCCL takes one rank per GPU), each running the probe's body, which hands its figures to the parent."""

import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from uccl_ep_plugin.buffer import DEVICE_ENV
from uccl_ep_plugin.local_port import free_local_port


def _rank(rank: int, num_ranks: int, port: int, body, args, results) -> None:
    os.environ[DEVICE_ENV] = "cuda"     # a gloo group alone would put the Buffer on the CPU
    torch.cuda.set_device(0)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=num_ranks)
    try:
        body(rank, num_ranks, dist.group.WORLD, args, results)
    finally:
        dist.destroy_process_group()


def run_ranks_on_one_gpu(body, num_ranks: int, args) -> list:
    """Runs ``body(rank, num_ranks, group, args, results)`` on ``num_ranks`` processes sharing GPU 0 and returns
    what they put into ``results`` (a queue), in order. Exits naming a failed rank's error (printed above)."""
    if not torch.cuda.is_available():
        raise SystemExit("this probe needs a CUDA GPU")
    context = mp.get_context("spawn")
    results = context.SimpleQueue()
    port = free_local_port()
    processes = [context.Process(target=_rank, args=(rank, num_ranks, port, body, args, results))
                 for rank in range(num_ranks)]
    for process in processes:
        process.start()
    for process in processes:
        process.join()
    if any(process.exitcode != 0 for process in processes):
        raise SystemExit("a rank failed (its error is above)")
    gathered = []
    while not results.empty():
        gathered.append(results.get())
    return gathered
