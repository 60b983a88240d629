"""Run a test body on N local ranks joined by a gloo group (CPU) or an NCCL group (one GPU per rank),
and collect each rank's failure.

``UCCL_EP_TEST_SHARE_GPU=1`` lets the multi-rank GPU tests run where fewer GPUs than ranks are visible:
rank r uses GPU r % count, and the group is gloo (NCCL takes one rank per GPU). The ranks then time-share
a GPU, so this checks correctness (CUDA IPC, copy engines and flags between processes), never speed.
"""

import os
import signal
import traceback
from contextlib import contextmanager
from typing import Any, Callable, Dict, Optional

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from uccl_ep_plugin.buffer import DEVICE_ENV
from uccl_ep_plugin.local_port import free_local_port

SHARE_GPU_ENV = "UCCL_EP_TEST_SHARE_GPU"


def ranks_share_gpus() -> bool:
    return os.environ.get(SHARE_GPU_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def gpu_count() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def has_gpus_for(num_ranks: int) -> bool:
    """One GPU per rank, or any GPU when the ranks may share them."""
    return gpu_count() >= (1 if ranks_share_gpus() else num_ranks)


def needs_gpus(num_ranks: int):
    """Skip mark for tests that run ``num_ranks`` ranks on GPUs."""
    return pytest.mark.skipif(not has_gpus_for(num_ranks),
                              reason=f"needs {num_ranks} CUDA GPUs (or any GPU with {SHARE_GPU_ENV}=1)")


def has_feature(feature: str) -> bool:
    """Whether the extension is built, with ``feature`` in its build_info."""
    try:
        from uccl_ep_plugin import build_info
        return feature in build_info().get("features", [])
    except ImportError:
        return False


def needs_feature(feature: str):
    """Skip mark for tests that need ``feature`` in the extension's build_info (skipped too where it is not built)."""
    return pytest.mark.skipif(not has_feature(feature), reason=f"this build has no {feature}")


def rank_device(rank: int) -> torch.device:
    return torch.device("cuda", rank % gpu_count())


@contextmanager
def environment(name: str, value: str):
    """``os.environ[name] = value`` inside the block, restored after (rank bodies have no monkeypatch)."""
    previous = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = previous


def _worker(rank: int, num_ranks: int, port: int, backend: str, body: Callable, kwargs: Dict[str, Any],
            errors) -> None:
    # The spawned ranks share the machine's cores: one intra-op thread each (the environment variable is
    # read too late, torch is already imported by then).
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    if backend == "nccl":
        torch.cuda.set_device(rank_device(rank))
        if ranks_share_gpus():
            backend = "gloo"
            os.environ[DEVICE_ENV] = "cuda"   # a gloo group alone would put the Buffer on the CPU
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=num_ranks)
    try:
        body(rank, num_ranks, dist.group.WORLD, **kwargs)
    except BaseException:  # noqa: B902 - every failure is reported to the parent
        errors.put((rank, traceback.format_exc()))
        raise
    finally:
        dist.destroy_process_group()


def _exit_text(exitcode: Optional[int]) -> str:
    """How a rank's process ended, for a failure message (a negative code is the signal that killed it)."""
    if exitcode is None:
        return "was still running after the join's timeout (killed)"
    if exitcode < 0:
        try:
            return f"was killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"was killed by signal {-exitcode}"
    return f"exited with code {exitcode}"


def run_ranks(num_ranks: int, body: Callable, backend: str = "gloo", **kwargs) -> None:
    """Run ``body(rank, num_ranks, group, **kwargs)`` on ``num_ranks`` processes; re-raise the first failure (in
    the order they happened: a rank's own error comes before the timeouts it causes in its peers), with the end of
    every later one."""
    # spawn by default (CUDA cannot be forked); UCCL_EP_TEST_START_METHOD=fork spares each rank importing torch
    # again, which takes half a minute in the software-emulated soft-RoCE guest (tests/soft_roce/guest.sh).
    context = mp.get_context(os.environ.get("UCCL_EP_TEST_START_METHOD", "spawn"))
    errors = context.SimpleQueue()
    port = free_local_port()
    processes = [context.Process(target=_worker, args=(rank, num_ranks, port, backend, body, kwargs, errors))
                 for rank in range(num_ranks)]
    for process in processes:
        process.start()
    for process in processes:
        process.join(timeout=600)
        if process.is_alive():
            process.kill()
    failures = []
    while not errors.empty():
        failures.append(errors.get())
    if failures:
        rank, text = failures[0]
        later = "".join(f"\n\nrank {r} failed after it:\n" + "\n".join(t.strip().splitlines()[-3:])
                        for r, t in failures[1:])
        raise AssertionError(f"rank {rank} failed:\n{text}{later}")
    bad = [f"rank {rank} {_exit_text(process.exitcode)}" for rank, process in enumerate(processes)
           if process.exitcode != 0]
    if bad:
        raise AssertionError("; ".join(bad))
