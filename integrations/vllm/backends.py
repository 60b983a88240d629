"""The two backend names this plugin adds to ``--all2all-backend`` and the DeepEP backend each one mirrors.

A uccl backend moves tokens exactly like its DeepEP twin (same buffer API, same activation
format), so everywhere vLLM asks "is this DeepEP high-throughput/low-latency?" the answer
for the uccl name is the twin's answer. Only the objects that own the buffer differ.
"""

from typing import Any, Optional

UCCL_HIGH_THROUGHPUT = "uccl_high_throughput"
UCCL_LOW_LATENCY = "uccl_low_latency"

#: uccl backend -> the DeepEP backend whose semantics (and vLLM classes) it reuses.
DEEPEP_TWIN = {
    UCCL_HIGH_THROUGHPUT: "deepep_high_throughput",
    UCCL_LOW_LATENCY: "deepep_low_latency",
}
UCCL_BACKENDS = tuple(DEEPEP_TWIN)


def is_uccl(backend: Optional[str]) -> bool:
    return backend in DEEPEP_TWIN


def twin(backend: Optional[str]) -> Optional[str]:
    """The DeepEP name for a uccl backend; any other name unchanged."""
    return DEEPEP_TWIN.get(backend, backend)


class DeepEPView:
    """Read-only view of a config object whose ``all2all_backend`` reads as its DeepEP twin.

    vLLM's predicates (properties such as ``use_deepep_ht_kernels``) are evaluated on this
    view, so they keep their own logic and only the backend name is translated.
    """

    __slots__ = ("_target",)

    def __init__(self, target: Any) -> None:
        object.__setattr__(self, "_target", target)

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._target, name)
        return twin(value) if name == "all2all_backend" else value

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("DeepEPView is read-only")
