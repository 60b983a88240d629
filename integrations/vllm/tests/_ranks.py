"""Helpers for tests that run vLLM's code in 2 spawned ranks over gloo (CPU, reference engine).

Stand-ins (each replaces the smallest CUDA-only piece; see README "Stand-ins in tests"):

* ``PyNcclCommunicator`` -> ``_NoNccl``: ``CudaCommunicator.__init__`` builds a pynccl
  communicator for groups of more than one rank; NCCL needs a GPU. The stand-in records its
  arguments and does nothing; all2all selection, the code under test, is untouched.
* vLLM's platform is its CPU platform (``VLLM_TARGET_DEVICE=cpu``); ``CudaCommunicator`` is
  constructed directly on vLLM's EP group, with ``device=cpu``, as GroupCoordinator would on GPUs.
"""

import os
import traceback
from typing import Callable

import torch.multiprocessing as mp

from uccl_ep_plugin.local_port import free_local_port

# vLLM resolves its platform once, on first use: pick the CPU platform before anything imports vLLM.
os.environ["VLLM_TARGET_DEVICE"] = "cpu"
WORLD = 2


def _entry(rank: int, port: int, body: Callable, args: tuple, results) -> None:
    try:
        results.put((rank, "ok", body(rank, port, *args)))
    except BaseException:  # report to the parent rather than hang the peer
        results.put((rank, "error", traceback.format_exc()))


def run_ranks(body: Callable, *args, timeout: float = 240.0):
    """Run ``body(rank, port, *args)`` in WORLD spawned processes; return the results by rank."""
    context = mp.get_context("spawn")
    results = context.Queue()
    port = free_local_port()
    processes = [context.Process(target=_entry, args=(rank, port, body, args, results)) for rank in range(WORLD)]
    for process in processes:
        process.start()
    collected = {}
    try:
        for _ in range(WORLD):
            rank, status, value = results.get(timeout=timeout)
            if status != "ok":
                raise AssertionError(f"rank {rank} failed:\n{value}")
            collected[rank] = value
    finally:
        for process in processes:
            process.join(timeout=10)
            if process.is_alive():
                process.kill()
    return [collected[rank] for rank in range(WORLD)]


class _NoNccl:
    """Stand-in for vLLM's PyNcclCommunicator on a machine without GPUs."""

    disabled = True

    def __init__(self, group=None, device=None, **kwargs):
        self.group, self.device = group, device


def vllm_ep_setup(rank: int, port: int, backend: str):
    """Register the plugin, enter a VllmConfig with ``backend`` and EP over DP=2, initialise vLLM's
    distributed state on gloo and build vLLM's CudaCommunicator for the EP group.

    Returns ``(communicator, config_context)``; the caller keeps the context open while it works.
    """
    # external_launcher is vLLM's torchrun mode: it reads the rank from the environment torchrun sets.
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD))
    os.environ.setdefault("VLLM_DEEPEP_BUFFER_SIZE_MB", "1")
    import torch

    from uccl_ep_plugin.integrations.vllm import register
    register()

    from vllm.config import ParallelConfig, VllmConfig, set_current_vllm_config
    from vllm.distributed import parallel_state
    from vllm.distributed.device_communicators import cuda_communicator, pynccl

    parallel = ParallelConfig(all2all_backend=backend, enable_expert_parallel=True, data_parallel_size=WORLD,
                              data_parallel_rank=rank, distributed_executor_backend="external_launcher")
    context = set_current_vllm_config(VllmConfig(parallel_config=parallel))
    context.__enter__()
    parallel_state.init_distributed_environment(world_size=WORLD, rank=rank, local_rank=rank, backend="gloo",
                                                distributed_init_method=f"tcp://127.0.0.1:{port}")
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
    ep = parallel_state.get_ep_group()
    pynccl.PyNcclCommunicator = _NoNccl           # stand-in, see module docstring
    communicator = cuda_communicator.CudaCommunicator(
        cpu_group=ep.cpu_group, device=torch.device("cpu"), device_group=ep.device_group,
        unique_name=ep.unique_name, use_all2all=True)
    return communicator, context
