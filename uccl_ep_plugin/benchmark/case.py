"""A measured operation of the benchmark."""

from typing import Callable, Dict, Optional, Tuple

from .workloads import Workload


class Case:
    """A measured operation: ``run()`` does one call, ``check()`` verifies the last call's outputs.

    ``prepare()`` (before the iteration's barrier) and ``finish()`` (after the timed region) run untimed in
    every iteration: the halves of a split operation (send, then receive through the hook) use them for
    the half that is not measured. ``bytes_per_rank`` None: no bandwidth is reported. ``capturable``
    False: run() waits for the GPU (a dispatch that reads its counts on the host), so it is timed eagerly
    instead of replayed from a CUDA graph. ``settle()`` runs before each of the bench's own collectives:
    it waits until this rank's part of the calls so far is done (default: a device synchronize; a Buffer's
    ``synchronize`` also waits for its proxy). ``nvlink_bytes``: what this rank's NVLink carries the busier way
    in one call (the NVLink floor's numerator), or None.
    """

    def __init__(self, mode: str, op: str, dtype: str, workload: Workload, run: Callable[[], None],
                 check: Callable[[], bool], bytes_per_rank: Optional[float], engine: str,
                 prepare: Optional[Callable[[], None]] = None, finish: Optional[Callable[[], None]] = None,
                 kernels: Tuple[str, ...] = (), capturable: bool = True,
                 settle: Optional[Callable[[], None]] = None, kernel_launch: int = 0,
                 count_wait: Optional[Callable[[], float]] = None, nvlink_bytes: Optional[float] = None,
                 path: Optional[str] = None, hops: Optional[Callable[[], Dict[str, float]]] = None) -> None:
        self.mode, self.op, self.dtype, self.workload = mode, op, dtype, workload
        self.run, self.check, self.bytes_per_rank, self.engine = run, check, bytes_per_rank, engine
        self.prepare, self.finish = prepare, finish
        self.kernels = kernels    # names of the native kernels that run() launches, for the kernel timing
        self.kernel_launch = kernel_launch   # which of an iteration's launches of each is run()'s (0: the first)
        self.count_wait = count_wait   # seconds the last run() waited on the host for the peers' counts, or None
        self.capturable = capturable
        self.settle = settle
        self.nvlink_bytes = nvlink_bytes
        self.path = path   # what carried the rows, where the engine alone does not say (the two hops' rail)
        self.hops = hops   # the two hops' figures of the last run() (HopTimes.last), once its work is done

    @property
    def label(self) -> str:
        return f"{self.mode} {self.op} {self.dtype}"
