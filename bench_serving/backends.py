"""What selects each all-to-all backend on each engine's server command line.

A backend is named as the engine names it (vLLM's ``--all2all-backend`` values, SGLang's
``--moe-a2a-backend`` values) and runs with expert parallelism over ``parallel`` ranks; ``tp`` names the
baseline without expert parallelism (tensor parallelism over ``baseline_tp`` ranks). Names are passed to the
engine as they are: the engine's own check refuses one it does not know, and that run's row says so.
"""

from dataclasses import dataclass
from typing import List, Tuple

from .server import SGLANG_SERVER, VLLM_SERVER

ENGINES = ("vllm", "sglang")
BASELINE = "tp"
#: The backends a run compares when none are named.
DEFAULT_BACKENDS = {"vllm": ("uccl_high_throughput", "deepep_high_throughput", "allgather_reducescatter"),
                    "sglang": ("uccl", "deepep", "none")}
SERVER_MODULES = {"vllm": VLLM_SERVER, "sglang": SGLANG_SERVER}


@dataclass(frozen=True)
class Backend:
    engine: str
    name: str   # as rows and files name it (the baseline's with its size: tp2)
    #: Server arguments that select it (besides the model and the user's own arguments).
    args: Tuple[str, ...]


def backend(engine: str, name: str, parallel: int, baseline_tp: int) -> Backend:
    """The server arguments of backend ``name`` on ``engine`` with ``parallel`` expert-parallel ranks."""
    if engine not in ENGINES:
        raise ValueError(f"engine {engine!r}: expected one of {', '.join(ENGINES)}")
    if name == BASELINE:
        tp = ("--tensor-parallel-size", str(baseline_tp)) if engine == "vllm" else ("--tp-size", str(baseline_tp))
        return Backend(engine, f"{BASELINE}{baseline_tp}", tp)
    if engine == "vllm":
        return Backend(engine, name, ("--data-parallel-size", str(parallel), "--enable-expert-parallel",
                                      "--all2all-backend", name))
    return Backend(engine, name, ("--tp-size", str(parallel), "--ep-size", str(parallel), "--moe-a2a-backend", name))


def backends(engine: str, names: List[str], parallel: int, baseline_tp: int) -> List[Backend]:
    return [backend(engine, name, parallel, baseline_tp) for name in names]
