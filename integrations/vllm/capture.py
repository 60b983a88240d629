"""Whether a uccl backend's dispatch/combine can be captured in a CUDA graph today."""

from typing import Optional

from .backends import UCCL_HIGH_THROUGHPUT, UCCL_LOW_LATENCY

OPERATIONS = {
    UCCL_HIGH_THROUGHPUT: ("get_dispatch_layout", "dispatch", "combine"),
    UCCL_LOW_LATENCY: ("low_latency_dispatch", "low_latency_combine"),
}


def capture_blocker(backend: str) -> Optional[str]:
    """None if every operation of ``backend`` would run natively on a GPU, else why not.

    Operations on the reference engine synchronise the host (they read counts back to size
    their collectives), which CUDA graph capture forbids.
    """
    import torch

    from uccl_ep_plugin import engines

    mode = engines.requested_mode()
    choice = engines.choose(mode, torch.device("cuda")) if mode != "native" else None
    for operation in OPERATIONS[backend]:
        if choice is None:
            break
        if choice.by_operation[operation] == "reference":
            why = choice.reasons.get(operation) or f"{engines.ENGINE_ENV}={mode}"
            return f"{operation} runs on the reference engine ({why}), which synchronises the host"
    return None
