"""``Buffer``: DeepEP 1.2.1's expert-parallel communication buffer, backed by our engines.

Every public method keeps DeepEP's name, parameters, defaults and return tuple. Arguments
are checked here, before any communication, so both engines see only valid input.
"""

import functools
import itertools
import os
from typing import Callable, Dict, List, Optional, Tuple, Union

import torch
import torch.distributed as dist

from . import engines
from .dispatch_config import (Config, LowLatencyLayout, combine_config, dispatch_config, low_latency_layout,
                              low_latency_rdma_size_hint)
from .engines.native import LOW_LATENCY_OPERATIONS, NORMAL_OPERATIONS, NativeEngine
from .engines.native.normal import ExchangeTooLarge
from .engines.reference import ReferenceEngine
from .engines.native.peers import first_reason
from .engines.rail import rail_setup_reason, rail_transport
from .engines.two_level import TwoLevel, even_hosts
from .event_overlap import NO_EVENT, EventHandle, EventOverlap
from .handles import LowLatencyHandle, NormalHandle, owner_of
from .hosts import RdmaRanks, host_or_error, hosts_of
from .notices import warn_once
from .streams import CommStream, StreamScope, current_stream_reader
from .traffic import TrafficCounters, enabled_by_env as traffic_enabled_by_env
from .validation import (FP8_DTYPE, check_flag_pair, check_hidden, check_int, check_num_experts,
                         check_same_device, check_stream_flags, check_tensor, check_topk_idx, check_topk_weights)

TIMEOUT_ENV = "UCCL_EP_TIMEOUT_SECONDS"
DEVICE_ENV = "UCCL_EP_DEVICE"
DEFAULT_TIMEOUT_S = 100.0
_owner_ids = itertools.count(1)
_DESTROYED = "this Buffer was destroyed"

XType = Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]


def _low_latency_mode_needed(operation: str) -> RuntimeError:
    return RuntimeError(f"{operation} needs Buffer(low_latency_mode=True)")


def _without_torch_function(operation):
    """Run a Buffer operation with torch-function handling off. A mode such as torch.set_default_device's
    (DeepEP's tests and many scripts set one) routes every torch call made in Python, down to ``.shape`` and
    ``.data_ptr()``, through a Python handler: several microseconds each, and an operation makes dozens. Every
    tensor an operation makes names its device, so the handling changes nothing it does. Without a mode there is
    nothing to turn off, and the context would cost a sixth of a low-latency call's Python."""
    @functools.wraps(operation)
    def without(*args, **kwargs):
        if not _torch_function_mode_on():
            return operation(*args, **kwargs)
        with torch._C.DisableTorchFunction():
            return operation(*args, **kwargs)
    return without


# torch's own test of whether a mode is on; where a torch lacks it, the context is always entered.
_torch_function_mode_on = getattr(torch._C, "_is_torch_function_mode_enabled", lambda: True)


def _then_once(hook: Optional[Callable[[], None]], action: Callable[[], None]) -> Optional[Callable[[], None]]:
    """Run ``action`` now if there is no receive hook, else once, right after the hook's first call."""
    if hook is None:
        action()
        return None
    done = []

    def wrapped() -> None:
        hook()
        if not done:
            done.append(True)
            action()
    return wrapped


def _resolve_group(group: Optional[dist.ProcessGroup], comm) -> dist.ProcessGroup:
    if group is not None:
        return group
    if comm is None:
        raise ValueError("Buffer: either 'group' or 'comm' must be provided")
    # An mpi4py communicator: the engines talk through torch.distributed, so use its world group.
    if not dist.is_initialized():
        raise ValueError("Buffer: comm was given but torch.distributed is not initialized; "
                         "initialize it (init_process_group) or pass group")
    if dist.get_world_size() != comm.Get_size() or dist.get_rank() != comm.Get_rank():
        raise ValueError(f"Buffer: comm has size {comm.Get_size()} and rank {comm.Get_rank()}, but the "
                         f"torch.distributed world has size {dist.get_world_size()} and rank {dist.get_rank()}")
    return dist.group.WORLD


def group_device(group: dist.ProcessGroup) -> torch.device:
    """The device a Buffer on ``group`` works on: UCCL_EP_DEVICE if set, else CUDA (the current device) for NCCL
    groups and the CPU for gloo-only groups."""
    override = os.environ.get(DEVICE_ENV, "").strip().lower()
    if override:
        if override not in ("cpu", "cuda"):
            raise ValueError(f"{DEVICE_ENV}={override!r} must be 'cpu' or 'cuda'")
        kind = override
    else:
        backend = str(dist.get_backend(group)).lower()
        kind = "cuda" if "nccl" in backend and torch.cuda.is_available() else "cpu"
    if kind == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _hosts_with_same_settings(group: dist.ProcessGroup, host: Tuple[Optional[str], Optional[str]],
                              **settings) -> List[str]:
    """A collective: every rank's host (``host`` is this rank's :func:`hosts.host_or_error`), after raising the
    same ValueError on every rank when one of ``settings`` differs between them or a rank's host is an error.
    The engines size and place every exchange from their own rank's values (a native rank writes into its
    peers' buffers by its own num_nvl_bytes), and ranks that chose different engines would wait in
    different collectives: a difference would corrupt memory or leave the ranks waiting."""
    if dist.get_world_size(group) == 1:
        return hosts_of([host])
    gathered = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, (host, settings), group=group)
    for name, value in gathered[0][1].items():
        differing = [rank for rank, (_, theirs) in enumerate(gathered) if theirs[name] != value]
        if differing:
            raise ValueError(f"Buffer: {name} must be the same on every rank of the group; rank 0 has {value!r}, "
                             f"rank {differing[0]} has {gathered[differing[0]][1][name]!r}")
    return hosts_of([theirs for theirs, _ in gathered])


def timeout_seconds() -> float:
    """UCCL_EP_TIMEOUT_SECONDS: how long any wait for a peer may last."""
    raw = os.environ.get(TIMEOUT_ENV, "")
    try:
        value = float(raw) if raw else DEFAULT_TIMEOUT_S
    except ValueError:
        raise ValueError(f"{TIMEOUT_ENV}={raw!r} is not a number of seconds") from None
    if value <= 0:
        raise ValueError(f"{TIMEOUT_ENV} must be positive, got {value}")
    return value


class Buffer:
    """The expert-parallel communication buffer: dispatch/combine in normal (high-throughput) and
    low-latency modes over the ranks of ``group``.

    Attributes:
        num_sms: SMs used by normal-mode kernels (class-wide, see :meth:`set_num_sms`).
        rank, group_size, group: this rank, the number of ranks and the group.
        num_nvl_bytes, num_rdma_bytes: sizes of the NVLink and NIC-registered buffers.
        engine: ``"native"``, ``"reference"`` or ``"mixed"``; ``engine_by_operation`` gives each operation's
            (``"two_level"``: normal mode across hosts, engines/two_level.py), and ``engine_reasons`` why the
            native engine does not serve an operation (for logs).
    """

    num_sms: int = 20

    def __init__(self, group: Optional[dist.ProcessGroup], num_nvl_bytes: int = 0, num_rdma_bytes: int = 0,
                 low_latency_mode: bool = False, num_qps_per_rank: int = 24,
                 allow_nvlink_for_low_latency_mode: bool = True, allow_mnnvl: bool = False, use_fabric: bool = False,
                 explicitly_destroy: bool = False, enable_shrink: bool = False, comm=None) -> None:
        # What _release frees, so that it also serves a Buffer whose construction failed part way.
        self._destroyed = False
        self._reference = self._native = self._two_level = None
        self._serving = {}
        check_int("num_nvl_bytes", num_nvl_bytes, minimum=0)
        check_int("num_rdma_bytes", num_rdma_bytes, minimum=0)
        check_int("num_qps_per_rank", num_qps_per_rank, minimum=1)
        if low_latency_mode and num_rdma_bytes == 0:
            raise ValueError("low_latency_mode=True needs num_rdma_bytes > 0 (the low-latency buffers live there): "
                             "pass Buffer.get_low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank, hidden, "
                             "num_ranks, num_experts)")
        self.group = _resolve_group(group, comm)
        self.rank = dist.get_rank(self.group)
        self.group_size = dist.get_world_size(self.group)
        self.num_nvl_bytes = num_nvl_bytes
        self.num_rdma_bytes = num_rdma_bytes
        self.low_latency_mode = low_latency_mode
        self.num_qps_per_rank = num_qps_per_rank
        self.allow_nvlink_for_low_latency_mode = allow_nvlink_for_low_latency_mode
        self.allow_mnnvl = allow_mnnvl
        self.use_fabric = use_fabric
        self.explicitly_destroy = explicitly_destroy
        self.enable_shrink = enable_shrink
        self.device = group_device(self.group)
        self._current_stream = current_stream_reader(self.device)
        try:
            choice = engines.choose(engines.requested_mode(), self.device)
            engine_by_operation = choice.by_operation
        except (ValueError, RuntimeError) as error:   # raised after the comparison: the other ranks wait in it
            choice, engine_by_operation = error, f"none ({error})"
        slot = self.device.index if self.device.type == "cuda" else dist.get_rank()
        hosts = _hosts_with_same_settings(self.group, host_or_error(slot, self.rank), num_nvl_bytes=num_nvl_bytes,
                                          num_rdma_bytes=num_rdma_bytes, low_latency_mode=low_latency_mode,
                                          **{"the engine of each operation (UCCL_EP_ENGINE and the build choose it)":
                                             engine_by_operation})
        if isinstance(choice, Exception):
            raise choice
        self._owner_id = next(_owner_ids)
        self._normal_handle = NormalHandle.owned_by(self._owner_id)
        self._low_latency_handle = LowLatencyHandle.owned_by(self._owner_id)

        try:
            self._set_up_engines(choice, num_nvl_bytes, num_rdma_bytes, low_latency_mode, hosts)
            self._comm = CommStream(self.device) if self.device.type == "cuda" else None
            native_normal_buffer = None if self._native is None else self._native.normal_buffer
            if self._two_level is not None:   # across hosts the NVLink buffer is the host's Buffer's
                native_normal_buffer = self._two_level.inner._nvl_buffer
            self._nvl_buffer = (native_normal_buffer if native_normal_buffer is not None
                                else torch.empty(num_nvl_bytes, dtype=torch.uint8, device=self.device))
            # num_rdma_bytes: low-latency mode's buffer, else across hosts the rail's region (over a transport), else
            # a buffer of our own.
            rdma_buffer = None if self._native is None else self._native.low_latency_buffer
            if rdma_buffer is None and self._two_level is not None:
                rdma_buffer = self._two_level.rail.region
            self._rdma_buffer = (rdma_buffer if rdma_buffer is not None
                                 else torch.empty(num_rdma_bytes, dtype=torch.uint8, device=self.device))
            self._low_latency_buffer_idx = 0
            self._mask = torch.zeros(self.group_size, dtype=torch.bool, device=self.device) if enable_shrink else None
            self._default_configs: Dict[Tuple[Callable[[int], Config], int], Config] = {}
            self._traffic = (TrafficCounters(self.rank, self.group_size, self.device) if traffic_enabled_by_env()
                             else None)
        except BaseException:
            self._release()   # what was made so far (mapped peer memory, proxies) does not wait for the GC
            raise
        self._warned_normal_fallback = False

    def _set_up_engines(self, choice: engines.EngineChoice, num_nvl_bytes: int, num_rdma_bytes: int,
                        low_latency_mode: bool, hosts: List[str]) -> None:
        """The reference engine, the native engine with its buffers mapped where it serves, and across hosts the
        two-hop normal mode."""
        timeout_s = timeout_seconds()
        rdma_ranks = RdmaRanks.of_hosts(hosts, self.device)
        # The reference engine also provides the timed barriers, so it is always there.
        self._reference = ReferenceEngine(self.group, self.rank, self.group_size, self.device, timeout_s, rdma_ranks)
        self._native = (NativeEngine(self.group_size, self.device, rdma_ranks)
                        if self.device.type == "cuda" and
                        any(engine == "native" and op not in choice.reasons
                            for op, engine in choice.by_operation.items()) else None)
        if self._native is not None and self._all_native(choice, NORMAL_OPERATIONS):
            self._mark_unserved(choice, self._native.setup_normal(self.group, self.rank, num_nvl_bytes, timeout_s))
        if self._native is not None and low_latency_mode and num_rdma_bytes > 0 and self._all_native(
                choice, LOW_LATENCY_OPERATIONS):
            self._mark_unserved(choice, self._native.setup_low_latency(self.group, self.rank, num_rdma_bytes,
                                                                       timeout_s))
        if len(set(hosts)) > 1 and choice.mode != "reference":
            self._set_up_two_level(choice, hosts, num_nvl_bytes, num_rdma_bytes)
        self.engine_by_operation = dict(choice.by_operation)
        self.engine = choice.summary
        self.engine_reasons = choice.reasons
        self._serve()
        fallback = {op: why for op, why in choice.reasons.items() if choice.by_operation[op] == "reference"}
        if fallback:
            by_reason = {}
            for op, why in fallback.items():
                by_reason.setdefault(why, []).append(op)
            warn_once("the reference engine (plain PyTorch collectives, slow) serves "
                      + "; ".join(f"{', '.join(ops)} because {why}" for why, ops in by_reason.items()))

    def _set_up_two_level(self, choice: engines.EngineChoice, hosts: List[str], num_nvl_bytes: int,
                          num_rdma_bytes: int) -> None:
        """Ranks on several hosts: dispatch and combine cross to each host once and are forwarded inside it by a
        Buffer over that host's ranks (engines/two_level.py); uneven hosts make those calls raise, naming them.
        The hop between hosts goes through the transport UCCL_EP_PROXY_TRANSPORT names (verbs, tcp, or cuda-copy
        between logical hosts of one machine) in ``num_rdma_bytes`` of its own, else over the group's collectives."""
        choice.by_operation.update(dict.fromkeys(NORMAL_OPERATIONS, TwoLevel.name))
        for operation in NORMAL_OPERATIONS:
            choice.reasons.pop(operation, None)
        try:
            even_hosts(hosts)
        except ValueError as error:   # every rank has the same hosts: all raise alike at the call
            choice.reasons.update(dict.fromkeys(NORMAL_OPERATIONS, str(error)))
            return
        rail, extension = rail_transport(), None
        if rail is not None:
            try:
                from . import _C as extension
            except ImportError:
                pass
            reason = first_reason(self.group, rail_setup_reason(extension, rail, num_rdma_bytes, self.device))
            if reason is not None:
                warn_once(f"normal mode across hosts: the hop between hosts runs over the group's collectives, not "
                          f"{rail}: {reason}")
                rail = None
        self._two_level = TwoLevel(self._reference.comm, hosts,
                                   lambda host_group: Buffer(host_group, num_nvl_bytes=num_nvl_bytes,
                                                             explicitly_destroy=True),
                                   rail_transport=rail, num_rdma_bytes=num_rdma_bytes, extension=extension)

    @staticmethod
    def _all_native(choice: engines.EngineChoice, operations) -> bool:
        return all(choice.by_operation[op] == "native" and op not in choice.reasons for op in operations)

    @staticmethod
    def _mark_unserved(choice: engines.EngineChoice, reasons: dict) -> None:
        """Record why the native engine cannot serve some operations after all: they fall back to the
        reference engine, or with UCCL_EP_ENGINE=native stay native and raise when called."""
        for op, why in reasons.items():
            choice.reasons[op] = why
            if choice.mode != "native":
                choice.by_operation[op] = "reference"

    # ------------------------------------------------------------------ lifecycle and queries
    def destroy(self) -> None:
        """Release the buffers, streams and engine resources (requires ``explicitly_destroy=True``)."""
        if not self.explicitly_destroy:
            raise RuntimeError("Buffer.destroy() requires Buffer(explicitly_destroy=True); otherwise resources are "
                               "released when the Buffer is garbage-collected")
        try:
            if self._two_level is not None:
                self._two_level.destroy()   # its host's Buffer, destroyed together as this one is
            if self._native is not None and self._native.maps_peer_memory:
                # Peers map this rank's buffers: all of them finish with them before anyone frees theirs.
                self._finish_device_work()
                self._reference.barrier("destroy")
        finally:
            self._release()   # also when a peer failed (its error still reaches the caller): nothing leaks

    def synchronize(self) -> None:
        """Wait until this rank's GPU work has finished and its CPU proxy has carried out every write the
        kernels handed it (the proxy path's last writes go out after the kernels end).

        Not in DeepEP's API. Call it before a collective of your own (an NCCL barrier or all-gather) that
        follows low-latency calls through the proxy, when peers on one machine stand in for nodes
        (``UCCL_EP_FORCE_PROXY=1`` with the cuda-copy or tcp transport): the proxy moves bytes with CUDA
        copies, and a copy issued while the collective's kernel waits for the peer does not run, while the
        peer cannot join before it has those bytes. Raises CommTimeoutError naming the rank if the proxy
        does not finish within the configured timeout, and raises the failure a finished kernel or the proxy
        recorded (a timeout waiting for a peer, too many rows), which otherwise surfaces at the next call: the
        outputs of the call that failed are not valid."""
        self._finish_device_work()
        if self._native is not None:
            self._native.check()

    def _finish_device_work(self) -> None:
        """The device and proxy half of :meth:`synchronize`, raising no recorded failure: destroy() and the cleaning
        after a failure go on with their barriers, which every peer waits in."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        if self._native is not None:
            self._native.drain_proxy(timeout_seconds())

    def _native_low_latency(self):
        return None if self._native is None else self._native.low_latency

    def _release(self) -> None:
        if self._destroyed:
            return
        if self._two_level is not None:
            self._two_level.release()
        for engine in (self._reference, self._native):
            if engine is not None:
                engine.destroy()
        self._reference = self._native = self._two_level = None
        self._serving = {}
        self._nvl_buffer = self._rdma_buffer = self._mask = self._traffic = None
        self._comm = None
        self._destroyed = True

    def __del__(self) -> None:
        if not getattr(self, "explicitly_destroy", True):
            self._release()

    def _check_alive(self) -> None:
        if self._destroyed:
            raise RuntimeError(_DESTROYED)

    @staticmethod
    def is_sm90_compiled() -> bool:
        try:
            from .build_info import build_info
            return "90" in [str(arch).rstrip("a") for arch in build_info().get("cuda_archs", [])]
        except ImportError:
            return False

    @staticmethod
    def set_num_sms(new_num_sms: int) -> None:
        """Set the SMs used by normal-mode kernels (an even number)."""
        check_int("new_num_sms", new_num_sms, minimum=2)
        if new_num_sms % 2 != 0:
            raise ValueError(f"new_num_sms must be even, got {new_num_sms}")
        Buffer.num_sms = new_num_sms

    @staticmethod
    def capture() -> EventOverlap:
        """An event on the current stream (complete at once on CPU)."""
        return EventOverlap(EventHandle())

    @staticmethod
    def get_low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank: int, hidden: int, num_ranks: int,
                                       num_experts: int) -> int:
        """Bytes of ``num_rdma_bytes`` that low-latency mode needs for these sizes."""
        return low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank, hidden, num_ranks, num_experts)

    @staticmethod
    def get_dispatch_config(num_ranks: int) -> Config:
        return dispatch_config(Buffer.num_sms, num_ranks)

    @staticmethod
    def get_combine_config(num_ranks: int) -> Config:
        return combine_config(Buffer.num_sms, num_ranks)

    def get_comm_stream(self):
        """The stream normal-mode communication runs on (a CPU stream object on CPU)."""
        self._check_alive()
        return self._comm.stream if self._comm is not None else torch.cpu.current_stream()

    def get_local_buffer_tensor(self, dtype: torch.dtype, size: Optional[torch.Size] = None, offset: int = 0,
                                use_rdma_buffer: bool = False) -> torch.Tensor:
        """The raw NVLink (or NIC-registered) buffer as ``dtype``, from byte ``offset``, optionally shaped ``size``."""
        self._check_alive()
        raw = self._rdma_buffer if use_rdma_buffer else self._nvl_buffer
        check_int("offset", offset, minimum=0)
        element = torch.empty((), dtype=dtype).element_size()
        if offset % element != 0 or offset > raw.numel():
            raise ValueError(f"offset {offset} must be a multiple of {element} within the {raw.numel()}-byte buffer")
        tensor = raw[offset:offset + (raw.numel() - offset) // element * element].view(dtype)
        if size is None:
            return tensor
        size = torch.Size(size)
        if size.numel() > tensor.numel():
            raise ValueError(f"size {tuple(size)} needs {size.numel()} elements, the buffer holds {tensor.numel()}")
        return tensor[:size.numel()].view(size)

    def traffic_counters(self) -> Optional[dict]:
        """Per-peer rows/pairs this Buffer sent and received since it was made (reads them back: syncs), or None
        unless ``UCCL_EP_TRAFFIC_COUNTERS=1`` was set when it was made. ``crossed_ranks`` sums the other ranks'
        entries."""
        self._check_alive()
        return None if self._traffic is None else self._traffic.snapshot()

    # ------------------------------------------------------------------ engine routing
    def _engine_for(self, operation: str):
        """The engine serving ``operation`` on this live Buffer (the low-latency calls read the table themselves:
        a call frame is a good part of their Python when cold)."""
        return self._serving.get(operation) or self._unserved(operation)

    def _serve(self) -> None:
        """Fill the table of the engines that serve an operation without raising (emptied by destroy())."""
        self._serving = {}
        for operation, served_by in self.engine_by_operation.items():
            if operation in LOW_LATENCY_OPERATIONS and not self.low_latency_mode:
                continue
            if served_by == TwoLevel.name:
                engine = self._two_level   # None between uneven hosts
            elif served_by == "native":
                engine = None if operation in self.engine_reasons else self._native
            else:
                engine = self._reference
            if engine is not None:
                self._serving[operation] = engine

    def _unserved(self, operation: str):
        """Raise why no engine serves ``operation`` here."""
        self._check_alive()
        if operation in LOW_LATENCY_OPERATIONS and not self.low_latency_mode:
            raise _low_latency_mode_needed(operation)
        reason = self.engine_reasons.get(operation, "no engine was set up for it")
        if self.engine_by_operation[operation] == TwoLevel.name:
            raise ValueError(reason)
        raise RuntimeError(f"{engines.ENGINE_ENV}=native, but {operation} cannot run natively: {reason}")

    def _engine_serving(self, handle, engine):
        """The engine for a call with ``handle``: the one that made it, where the handle says."""
        return self._reference if getattr(handle, "served_by", None) == self._reference.name else engine

    def _warn_normal_fallback(self, error: Exception) -> None:
        if not self._warned_normal_fallback:
            self._warned_normal_fallback = True
            warn_once(f"{error}; the reference engine (slow) serves such dispatches and their combines")

    def _scope(self, previous_event, async_finish: bool, allocate_on_comm_stream: bool,
               use_comm_stream: bool = True) -> StreamScope:
        check_stream_flags(previous_event, async_finish, allocate_on_comm_stream)
        if previous_event is not None and not isinstance(previous_event, EventOverlap):
            raise TypeError(f"previous_event must be an EventOverlap, got {type(previous_event).__name__}")
        # The traffic counters run torch ops on the call's results: on the communication stream, in its order.
        return StreamScope(self._comm if use_comm_stream else None, self.device, previous_event, async_finish,
                           allocate_on_comm_stream or self._traffic is not None)

    def _checked_by(self, engine, check: Callable[[], None]) -> Optional[Callable[[], None]]:
        """Where an operation's argument checks (``check``: they raise, naming a bad argument) run: the native
        engine's extension runs them only for a kind of call it has not seen pass (its signature: the tensors'
        dtypes, devices, sizes and strides, and the other values they read); for the other engines they run here,
        on every call (the reference engine's also read topk_idx's values). Returns what the engine's ``check``
        parameter gets: the checks, or None once they ran here."""
        if engine is self._native:
            return check
        check()
        return None

    def _check_owner(self, handle, name: str = "handle") -> None:
        owner = owner_of(handle)
        if owner is not None and owner != self._owner_id:
            raise ValueError(f"{name} was produced by a different Buffer; pass the handle returned by this Buffer")

    # ------------------------------------------------------------------ normal mode
    def _plain_call(self, engine, previous_event, async_finish, allocate_on_comm_stream) -> bool:
        """Whether a normal-mode call runs straight on the caller's stream: the native engine's, with no event to
        wait for or to return and no traffic counters. The caller sees DeepEP's order (there the communication
        stream waits for the caller's stream, and the caller's stream for it before the call returns) without
        the two waits."""
        return (engine is self._native and previous_event is None and async_finish is False and
                allocate_on_comm_stream is False and self._traffic is None)

    @_without_torch_function
    def get_dispatch_layout(self, topk_idx: torch.Tensor, num_experts: int,
                            previous_event: Optional[EventOverlap] = None, async_finish: bool = False,
                            allocate_on_comm_stream: bool = False
                            ) -> Tuple[torch.Tensor, Optional[torch.Tensor], torch.Tensor, torch.Tensor, EventOverlap]:
        """Routing tables for ``topk_idx`` (``[N, K]`` int64, -1 = no expert).

        Returns ``(num_tokens_per_rank [R] int32, num_tokens_per_rdma_rank [hosts] int32 or None within a
        node, num_tokens_per_expert [E] int32, is_token_in_rank [N, R] bool, event)``. ``num_tokens_per_rdma_rank``
        counts the tokens sent to each host (any number of GPUs each; UCCL_EP_GPUS_PER_NODE can cut a machine into
        hosts), or, where one machine holds more than 8 ranks, to each group of 8 as in DeepEP.
        """
        engine = self._engine_for("get_dispatch_layout")

        def check() -> None:
            check_num_experts(num_experts, self.group_size)
            self._check_topk_idx(engine, topk_idx, num_experts)
            check_same_device(self.device, topk_idx=topk_idx)
        check = self._checked_by(engine, check)
        if self._plain_call(engine, previous_event, async_finish, allocate_on_comm_stream):
            return engine.get_dispatch_layout(topk_idx, num_experts, self._current_stream(), check) + (NO_EVENT,)
        with self._scope(previous_event, async_finish, allocate_on_comm_stream) as scope:
            per_rank, per_rdma_rank, per_expert, in_rank = engine.get_dispatch_layout(topk_idx, num_experts,
                                                                                      scope.launch_stream, check)
        event = scope.finish((per_rank, per_rdma_rank, per_expert, in_rank), inputs=(topk_idx,))
        return per_rank, per_rdma_rank, per_expert, in_rank, event

    @_without_torch_function
    def dispatch(self, x: XType, handle: Optional[Tuple] = None,
                 num_tokens_per_rank: Optional[torch.Tensor] = None,
                 num_tokens_per_rdma_rank: Optional[torch.Tensor] = None,
                 is_token_in_rank: Optional[torch.Tensor] = None, num_tokens_per_expert: Optional[torch.Tensor] = None,
                 topk_idx: Optional[torch.Tensor] = None, topk_weights: Optional[torch.Tensor] = None,
                 expert_alignment: int = 1, num_worst_tokens: int = 0, config: Optional[Config] = None,
                 previous_event: Optional[EventOverlap] = None, async_finish: bool = False,
                 allocate_on_comm_stream: bool = False
                 ) -> Tuple[XType, Optional[torch.Tensor], Optional[torch.Tensor], List[int], Tuple, EventOverlap]:
        """Send each token to the ranks in ``is_token_in_rank``.

        ``x`` is bf16 ``[N, H]`` or ``(fp8_e4m3 [N, H], scales [N, S] float32/int32)``. Without ``handle`` the
        layout (from :meth:`get_dispatch_layout`) is required and ``topk_idx``/``topk_weights`` (``[N, K]``
        int64/float32) travel too, as local expert ids (-1 where the expert lives elsewhere). With ``handle``
        the previous layout is reused (cached dispatch) and only ``x`` moves.

        Returns ``(recv_x, recv_topk_idx, recv_topk_weights, num_recv_tokens_per_expert_list, handle, event)``;
        received rows are grouped by source rank in rank order. ``num_worst_tokens > 0`` gives outputs of that
        many rows (padding has topk_idx -1) and an empty count list.
        """
        engine = self._engine_for("dispatch")
        cached = None
        if handle is not None:
            cached = self._check_normal_handle(handle)
            is_token_in_rank = cached[4]
            engine = self._engine_serving(handle, engine)

        def check() -> None:
            self._check_dispatch(engine, x, cached, num_tokens_per_rank, is_token_in_rank, num_tokens_per_expert,
                                 topk_idx, topk_weights, expert_alignment, num_worst_tokens)
        check = self._checked_by(engine, check)
        x_data, x_scales = x if type(x) is tuple and len(x) == 2 else (x, None)
        if isinstance(x_scales, torch.Tensor) and not x_scales.is_contiguous():   # e.g. column-major (DeepGEMM's)
            x_scales = x_scales.contiguous()
        config = self._check_config(config, self.get_dispatch_config)
        result = None
        if self._plain_call(engine, previous_event, async_finish, allocate_on_comm_stream):
            try:
                result = engine.dispatch(x_data, x_scales, is_token_in_rank=is_token_in_rank,
                                         num_tokens_per_rank=num_tokens_per_rank,
                                         num_tokens_per_expert=num_tokens_per_expert, topk_idx=topk_idx,
                                         topk_weights=topk_weights, expert_alignment=expert_alignment,
                                         num_worst_tokens=num_worst_tokens, num_channels=config.num_channels,
                                         cached_handle=cached, stream=self._current_stream(), check=check)
                event = NO_EVENT
            except ExchangeTooLarge as error:
                # Every rank raises alike, before any row moved: the reference engine serves this call.
                self._warn_normal_fallback(error)
                engine, check = self._reference, None
        if result is None:
            arguments = dict(is_token_in_rank=is_token_in_rank, num_tokens_per_rank=num_tokens_per_rank,
                             num_tokens_per_expert=num_tokens_per_expert, topk_idx=topk_idx, topk_weights=topk_weights,
                             expert_alignment=expert_alignment, num_worst_tokens=num_worst_tokens,
                             num_channels=config.num_channels, cached_handle=cached)
            result, engine, event = self._dispatch_in_scope(engine, x_data, x_scales, arguments, check,
                                                            previous_event, async_finish, allocate_on_comm_stream)
        recv_x = (result.recv_x, result.recv_x_scales) if x_scales is not None else result.recv_x
        if cached is not None:
            return recv_x, None, None, None, None, event
        new_handle = self._normal_handle(result.handle)
        new_handle.served_by = engine.name
        return (recv_x, result.recv_topk_idx, result.recv_topk_weights, result.num_recv_tokens_per_expert_list,
                new_handle, event)

    def _dispatch_in_scope(self, engine, x_data, x_scales, arguments, check, previous_event, async_finish,
                           allocate_on_comm_stream):
        """A dispatch on the communication stream (DeepEP's stream discipline): ``(result, engine, event)``;
        ``check`` as from :meth:`_checked_by`."""
        with self._scope(previous_event, async_finish, allocate_on_comm_stream) as scope:
            arguments["stream"] = scope.launch_stream
            try:
                result = engine.dispatch(x_data, x_scales, **arguments, check=check)
            except ExchangeTooLarge as error:
                # Every rank raises alike, before any row moved: the reference engine serves this call.
                self._warn_normal_fallback(error)
                engine = self._reference
                result = engine.dispatch(x_data, x_scales, **arguments)
            if self._traffic is not None:
                self._traffic.add_dispatch(arguments["is_token_in_rank"], result.handle[0])
        outputs = (result.recv_x, result.recv_x_scales, result.recv_topk_idx, result.recv_topk_weights) + result.handle
        event = scope.finish(outputs, inputs=(x_data, x_scales, arguments["topk_idx"], arguments["topk_weights"],
                                              arguments["num_tokens_per_rank"], arguments["is_token_in_rank"],
                                              arguments["num_tokens_per_expert"]))
        return result, engine, event

    def _check_dispatch(self, engine, x, cached, num_tokens_per_rank, is_token_in_rank, num_tokens_per_expert,
                        topk_idx, topk_weights, expert_alignment, num_worst_tokens) -> None:
        """``cached``: the checked handle's items for a cached dispatch, else None."""
        x_data, _ = self._check_dispatch_x(x)
        num_tokens = x_data.size(0)
        check_int("expert_alignment", expert_alignment, minimum=1)
        check_int("num_worst_tokens", num_worst_tokens, minimum=0)
        if cached is not None:
            if topk_idx is not None or topk_weights is not None:
                raise ValueError("topk_idx and topk_weights must be None for a cached dispatch (handle given)")
            if cached[4].size(0) != num_tokens:
                raise ValueError(f"x has {num_tokens} tokens but the handle was made for {cached[4].size(0)}")
            return
        r = self.group_size
        if num_tokens_per_rank is None or is_token_in_rank is None or num_tokens_per_expert is None:
            raise ValueError("dispatch without handle needs num_tokens_per_rank, is_token_in_rank and "
                             "num_tokens_per_expert (from get_dispatch_layout)")
        check_tensor("num_tokens_per_rank", num_tokens_per_rank, (torch.int32,), shape=(r,))
        check_tensor("is_token_in_rank", is_token_in_rank, (torch.bool,), shape=(num_tokens, r))
        check_tensor("num_tokens_per_expert", num_tokens_per_expert, (torch.int32,), dim=1)
        num_experts = check_num_experts(num_tokens_per_expert.numel(), r, name="num_tokens_per_expert's length")
        if (topk_idx is None) != (topk_weights is None):
            raise ValueError("topk_idx and topk_weights must be given together")
        if topk_idx is not None:
            self._check_topk_idx(engine, topk_idx, num_experts, num_tokens)
            check_topk_weights(topk_weights, topk_idx)
        elif num_worst_tokens > 0:
            raise ValueError("num_worst_tokens > 0 requires topk_idx and topk_weights")
        check_same_device(self.device, num_tokens_per_rank=num_tokens_per_rank, is_token_in_rank=is_token_in_rank,
                          num_tokens_per_expert=num_tokens_per_expert, topk_idx=topk_idx, topk_weights=topk_weights)

    @_without_torch_function
    def combine(self, x: torch.Tensor, handle: Tuple, topk_weights: Optional[torch.Tensor] = None,
                bias: Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor], None] = None,
                config: Optional[Config] = None, previous_event: Optional[EventOverlap] = None,
                async_finish: bool = False, allocate_on_comm_stream: bool = False
                ) -> Tuple[torch.Tensor, Optional[torch.Tensor], EventOverlap]:
        """Sum each token's copies (weights not applied) back on its source rank and add ``bias`` (0, 1 or 2
        bf16 ``[N, H]`` tensors). ``x`` is bf16 ``[num_recv_rows, H]`` in the order dispatch returned.

        Returns ``(combined_x [N, H], combined_topk_weights [N, K] or None, event)``.
        """
        engine = self._engine_serving(handle, self._engine_for("combine"))
        parts = self._check_normal_handle(handle)

        def check() -> None:
            check_tensor("x", x, (torch.bfloat16,), shape=(parts[3].size(0), None))
            check_hidden("x", x.size(1), x.element_size())
            if topk_weights is not None:
                check_tensor("topk_weights", topk_weights, (torch.float32,), shape=(parts[3].size(0), None))
            self._check_bias(bias, parts[4].size(0), x.size(1))
            check_same_device(self.device, x=x, topk_weights=topk_weights)
        check = self._checked_by(engine, check)
        biases = [] if bias is None else list(bias) if type(bias) is tuple else [bias]
        config = self._check_config(config, self.get_combine_config)
        if self._plain_call(engine, previous_event, async_finish, allocate_on_comm_stream):
            combined_x, combined_topk_weights = engine.combine(x, parts, topk_weights, biases, config.num_channels,
                                                               self._current_stream(), check)
            return combined_x, combined_topk_weights, NO_EVENT
        with self._scope(previous_event, async_finish, allocate_on_comm_stream) as scope:
            combined_x, combined_topk_weights = engine.combine(x, parts, topk_weights, biases,
                                                               num_channels=config.num_channels,
                                                               stream=scope.launch_stream, check=check)
        event = scope.finish((combined_x, combined_topk_weights), inputs=(x, topk_weights) + tuple(biases))
        return combined_x, combined_topk_weights, event

    def internode_dispatch(self, x: XType, handle: Optional[Tuple] = None,
                           num_tokens_per_rank: Optional[torch.Tensor] = None,
                           num_tokens_per_rdma_rank: Optional[torch.Tensor] = None,
                           is_token_in_rank: Optional[torch.Tensor] = None,
                           num_tokens_per_expert: Optional[torch.Tensor] = None,
                           topk_idx: Optional[torch.Tensor] = None, topk_weights: Optional[torch.Tensor] = None,
                           expert_alignment: int = 1, num_worst_tokens: int = 0, config: Optional[Config] = None,
                           previous_event: Optional[EventOverlap] = None, async_finish: bool = False,
                           allocate_on_comm_stream: bool = False):
        """Same as :meth:`dispatch`; the engine picks the path by topology, so this is kept for DeepEP callers."""
        return self.dispatch(x, handle, num_tokens_per_rank, num_tokens_per_rdma_rank, is_token_in_rank,
                             num_tokens_per_expert, topk_idx, topk_weights, expert_alignment, num_worst_tokens,
                             config, previous_event, async_finish, allocate_on_comm_stream)

    def internode_combine(self, x: torch.Tensor, handle: Union[tuple, list], topk_weights: Optional[torch.Tensor] = None,
                          bias: Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor], None] = None,
                          config: Optional[Config] = None, previous_event: Optional[EventOverlap] = None,
                          async_finish: bool = False, allocate_on_comm_stream: bool = False):
        """Same as :meth:`combine` (see :meth:`internode_dispatch`)."""
        return self.combine(x, handle, topk_weights, bias, config, previous_event, async_finish,
                            allocate_on_comm_stream)

    # ------------------------------------------------------------------ low-latency mode
    def clean_low_latency_buffer(self, num_max_dispatch_tokens_per_rank: int, hidden: int, num_experts: int) -> None:
        """Zero the low-latency signal areas (needed after normal-mode use of the same memory); all ranks call it."""
        self._require_low_latency_mode("clean_low_latency_buffer")
        layout = self._check_low_latency_sizes(num_max_dispatch_tokens_per_rank, hidden, num_experts)
        native = self._native_low_latency()
        if native is not None:
            # No peer (nor its proxy) may still be storing into this rank's buffer while it is zeroed.
            self._finish_device_work()
            self._reference.barrier("clean_low_latency_buffer: before cleaning")
            native.clean()
        else:
            for idx in (0, 1):
                start = layout.signal_offset(idx)
                self._rdma_buffer[start:start + layout.signal_bytes].zero_()
        self._reference.barrier("clean_low_latency_buffer")

    # The two low-latency operations go without _without_torch_function: on the native engine they make no torch
    # call in Python (hidden comes back from the engine), and the wrapper would be a fifth of their Python. On
    # other paths a torch-function mode sees their calls, which changes nothing they do (their tensors name their
    # device).
    def low_latency_dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor, num_max_dispatch_tokens_per_rank: int,
                             num_experts: int, cumulative_local_expert_recv_stats: Optional[torch.Tensor] = None,
                             dispatch_wait_recv_cost_stats: Optional[torch.Tensor] = None, use_fp8: bool = True,
                             round_scale: bool = False, use_ue8m0: bool = False, async_finish: bool = False,
                             return_recv_hook: bool = False
                             ) -> Tuple[XType, torch.Tensor, Tuple, EventOverlap, Optional[Callable[[], None]]]:
        """Send each (token, expert) pair straight to the expert's rank, packed per local expert.

        ``x`` bf16 ``[N <= T, H]``; ``topk_idx`` int64 ``[N, K]`` (-1 skipped). Returns ``(recv_x, recv_count
        [El] int32, handle, event, hook)`` where ``recv_x`` is ``[El, R*T, H]`` bf16, or with ``use_fp8`` a tuple
        of fp8 data and scales (float32 ``[El, R*T, H/128]``, or with ``use_ue8m0`` int32 ``[El, R*T, H/512]``,
        column-major in the last two dimensions). Only the first ``recv_count[e]`` rows of expert ``e`` are valid.
        With ``return_recv_hook`` the call only sends; ``hook()`` receives.
        """
        # _engine_for inlined, as in low_latency_combine: when cold, each Python frame costs about a microsecond.
        engine = self._serving.get("low_latency_dispatch") or self._unserved("low_latency_dispatch")
        # The engines take the call's arguments as one tuple in this order (a call with a dozen keywords cost a
        # sixth of this method's Python), and the checks as a function of that tuple: the native engine runs them
        # only for a kind of call it has not seen pass, the others on every call.
        call = (x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts, cumulative_local_expert_recv_stats,
                dispatch_wait_recv_cost_stats, use_fp8, round_scale, use_ue8m0, async_finish, return_recv_hook)
        # On the caller's stream unless async_finish asks for an event to overlap with: the same order for the
        # caller as DeepEP's comm stream plus two stream waits, without those waits (fewer launches and graph
        # nodes, and no stream of this process waiting on a kernel that waits for a proxy's copies).
        scope = self._scope(None, True, False, use_comm_stream=True) if async_finish else None
        operation = (engine.low_latency_dispatch if self._traffic is None
                     else self._counted_low_latency_dispatch(engine.low_latency_dispatch))
        arguments = (call, self._mask, self._low_latency_buffer_idx, self._check_low_latency_dispatch)
        # The engine's LowLatencyDispatchResult, unpacked.
        recv_x, recv_x_scales, recv_count, src_info, layout_range, hidden, hook, positions = (
            operation(*arguments) if scope is None else scope.run(operation, *arguments))
        self._low_latency_buffer_idx ^= 1
        handle = self._low_latency_handle((src_info, layout_range, num_max_dispatch_tokens_per_rank, hidden,
                                           num_experts))
        handle.positions = positions
        event = NO_EVENT
        if async_finish:
            outputs = (recv_x, recv_x_scales, recv_count, src_info, layout_range, positions)
            event = scope.finish(outputs, (x, topk_idx) + outputs)
        return (recv_x, recv_x_scales) if use_fp8 else recv_x, recv_count, handle, event, hook

    def _counted_low_latency_dispatch(self, operation):
        """``operation`` (an engine's low_latency_dispatch) that also adds the dispatch to the traffic counters
        once its rows are in: as it returns (on the stream it ran on), or right after its hook's first call."""
        traffic, mask = self._traffic, self._mask

        def counted(call, *rest):
            recv_x, recv_x_scales, recv_count, src_info, layout_range, hidden, hook, positions = operation(call, *rest)
            hook = _then_once(hook, lambda: traffic.add_low_latency_dispatch(call[1], call[3], layout_range, mask))
            return recv_x, recv_x_scales, recv_count, src_info, layout_range, hidden, hook, positions
        return counted

    def _check_low_latency_dispatch(self, call) -> None:
        """The checks of a low-latency dispatch's ``call`` tuple; they raise, naming a bad argument."""
        (x, topk_idx, num_tokens_limit, num_experts, cumulative_local_expert_recv_stats, dispatch_wait_recv_cost_stats,
         use_fp8, round_scale, use_ue8m0, async_finish, return_recv_hook) = call
        engine = self._serving["low_latency_dispatch"]
        check_flag_pair(async_finish, return_recv_hook)
        check_int("num_max_dispatch_tokens_per_rank", num_tokens_limit, minimum=1)
        check_tensor("x", x, (torch.bfloat16,), dim=2)
        if x.size(0) > num_tokens_limit:
            raise ValueError(f"x has {x.size(0)} tokens, more than num_max_dispatch_tokens_per_rank={num_tokens_limit}")
        if use_ue8m0 and not round_scale:
            raise ValueError("use_ue8m0=True requires round_scale=True (UE8M0 scales are powers of two)")
        if use_ue8m0 and not use_fp8:
            raise ValueError("use_ue8m0=True requires use_fp8=True")
        check_hidden("x", x.size(1), x.element_size(), multiple_of=512 if use_ue8m0 else 128 if use_fp8 else 1)
        check_num_experts(num_experts, self.group_size)
        self._check_topk_idx(engine, topk_idx, num_experts, x.size(0))
        local_experts = num_experts // self.group_size
        if cumulative_local_expert_recv_stats is not None:
            check_tensor("cumulative_local_expert_recv_stats", cumulative_local_expert_recv_stats, (torch.int32,),
                         shape=(local_experts,))
        if dispatch_wait_recv_cost_stats is not None:
            check_tensor("dispatch_wait_recv_cost_stats", dispatch_wait_recv_cost_stats, (torch.int64,),
                         shape=(self.group_size,))
        self._check_low_latency_sizes(num_tokens_limit, x.size(1), num_experts)
        check_same_device(self.device, x=x, topk_idx=topk_idx,
                          cumulative_local_expert_recv_stats=cumulative_local_expert_recv_stats,
                          dispatch_wait_recv_cost_stats=dispatch_wait_recv_cost_stats)

    def low_latency_combine(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, handle: tuple,
                            use_logfmt: bool = False, zero_copy: bool = False, async_finish: bool = False,
                            return_recv_hook: bool = False, out: Optional[torch.Tensor] = None,
                            combine_wait_recv_cost_stats: Optional[torch.Tensor] = None
                            ) -> Tuple[torch.Tensor, EventOverlap, Optional[Callable[[], None]]]:
        """Return each expert output to its token's rank and reduce with ``topk_weights``.

        ``x`` bf16 ``[El, R*T, H]`` (ignored with ``zero_copy``: the data is already in
        :meth:`get_next_low_latency_combine_buffer`); ``topk_idx``/``topk_weights`` are the dispatch's.
        Returns ``(combined_x [N, H] bf16 (``out`` if given), event, hook)``.
        """
        engine = self._serving.get("low_latency_combine") or self._unserved("low_latency_combine")
        src_info, layout_range, num_tokens_limit, hidden, num_experts = self._check_low_latency_handle(handle)
        x_given = x
        if zero_copy:
            x = self._low_latency_combine_view(num_tokens_limit, hidden, num_experts)
        positions = getattr(handle, "positions", None)
        # As in dispatch, one tuple: this call's arguments (x: what the kernel reads, with zero_copy the buffer's
        # own view), the handle's items, and the dispatch's record of positions.
        call = (x, topk_idx, topk_weights, src_info, layout_range, num_tokens_limit, hidden, num_experts, positions,
                use_logfmt, zero_copy, async_finish, return_recv_hook, out, combine_wait_recv_cost_stats, x_given)
        scope = self._scope(None, True, False, use_comm_stream=True) if async_finish else None
        arguments = (call, self._mask, self._low_latency_buffer_idx, self._check_low_latency_combine)
        combined, hook = (engine.low_latency_combine(*arguments) if scope is None
                          else scope.run(engine.low_latency_combine, *arguments))
        self._low_latency_buffer_idx ^= 1
        event = NO_EVENT
        if async_finish:
            event = scope.finish((combined,), (x, topk_idx, topk_weights, src_info, layout_range, combined, positions))
        return combined, event, hook

    def _check_low_latency_combine(self, call) -> None:
        """The checks of a low-latency combine's ``call`` tuple (the handle's were made before it was built)."""
        (_, topk_idx, topk_weights, src_info, _, num_tokens_limit, hidden, num_experts, _, use_logfmt, zero_copy,
         async_finish, return_recv_hook, out, combine_wait_recv_cost_stats, x) = call
        engine = self._serving["low_latency_combine"]
        check_flag_pair(async_finish, return_recv_hook)
        local_experts, slots = src_info.shape
        check_tensor("x", x, (torch.bfloat16,), shape=(local_experts, slots, hidden))
        self._check_topk_idx(engine, topk_idx, num_experts)
        if topk_idx.size(0) > num_tokens_limit:
            raise ValueError(f"topk_idx has {topk_idx.size(0)} tokens, more than num_max_dispatch_tokens_per_rank="
                             f"{num_tokens_limit}")
        check_topk_weights(topk_weights, topk_idx)
        if zero_copy and use_logfmt:
            raise ValueError("zero_copy and use_logfmt cannot both be set")
        if use_logfmt:
            check_hidden("x", hidden, 2, multiple_of=128)
        if out is not None:
            check_tensor("out", out, (torch.bfloat16,), shape=(topk_idx.size(0), hidden))
        if combine_wait_recv_cost_stats is not None:
            check_tensor("combine_wait_recv_cost_stats", combine_wait_recv_cost_stats, (torch.int64,),
                         shape=(self.group_size,))
        check_same_device(self.device, x=x, topk_idx=topk_idx, topk_weights=topk_weights, out=out,
                          combine_wait_recv_cost_stats=combine_wait_recv_cost_stats)

    def get_next_low_latency_combine_buffer(self, handle: object) -> torch.Tensor:
        """A bf16 ``[El, R*T, H]`` view of the registered buffer the next combine sends from (for zero_copy)."""
        self._require_low_latency_mode("get_next_low_latency_combine_buffer")
        _, _, num_tokens_limit, hidden, num_experts = self._check_low_latency_handle(handle)
        return self._low_latency_combine_view(num_tokens_limit, hidden, num_experts)

    def _low_latency_combine_view(self, num_tokens_limit: int, hidden: int, num_experts: int) -> torch.Tensor:
        layout = self._check_low_latency_sizes(num_tokens_limit, hidden, num_experts)
        local_experts = num_experts // self.group_size
        slots = self.group_size * num_tokens_limit
        start = layout.send_offset(self._low_latency_buffer_idx)
        num_bytes = local_experts * slots * hidden * 2
        return self._rdma_buffer[start:start + num_bytes].view(torch.bfloat16).view(local_experts, slots, hidden)

    def low_latency_update_mask_buffer(self, rank_to_mask: int, mask: bool = False) -> None:
        """Mask (``mask=True``) or unmask a rank: low-latency calls stop sending to and waiting for it."""
        self._require_shrink("low_latency_update_mask_buffer")
        check_int("rank_to_mask", rank_to_mask, minimum=0)
        if rank_to_mask >= self.group_size:
            raise ValueError(f"rank_to_mask={rank_to_mask} is not a rank of this group of {self.group_size}")
        self._mask[rank_to_mask] = bool(mask)

    def low_latency_query_mask_buffer(self, mask_status: torch.Tensor) -> None:
        """Write each rank's mask (1 masked, 0 not) into ``mask_status`` (int32 ``[R]``)."""
        self._require_shrink("low_latency_query_mask_buffer")
        check_tensor("mask_status", mask_status, (torch.int32,), shape=(self.group_size,))
        mask_status.copy_(self._mask.to(torch.int32))

    def low_latency_clean_mask_buffer(self) -> None:
        """Unmask every rank."""
        self._require_shrink("low_latency_clean_mask_buffer")
        self._mask.zero_()

    # ------------------------------------------------------------------ checks
    def _require_low_latency_mode(self, operation: str) -> None:
        self._check_alive()
        if not self.low_latency_mode:
            raise _low_latency_mode_needed(operation)

    def _require_shrink(self, operation: str) -> None:
        self._check_alive()
        if not self.enable_shrink:
            raise RuntimeError(f"{operation} needs Buffer(enable_shrink=True)")

    def _check_low_latency_sizes(self, num_tokens_limit: int, hidden: int, num_experts: int) -> LowLatencyLayout:
        check_int("num_max_dispatch_tokens_per_rank", num_tokens_limit, minimum=1)
        check_int("hidden", hidden, minimum=1)
        check_num_experts(num_experts, self.group_size)
        needed = low_latency_rdma_size_hint(num_tokens_limit, hidden, self.group_size, num_experts)
        if self.num_rdma_bytes < needed:
            raise ValueError(f"num_rdma_bytes={self.num_rdma_bytes} is too small for low-latency mode with "
                             f"T={num_tokens_limit}, H={hidden}, R={self.group_size}, E={num_experts}: need {needed} "
                             "(Buffer.get_low_latency_rdma_size_hint)")
        return low_latency_layout(num_tokens_limit, hidden, self.group_size, num_experts)

    def _check_dispatch_x(self, x: XType) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        if isinstance(x, tuple):
            if len(x) != 2:
                raise ValueError(f"x as a tuple must be (fp8 data, scales), got {len(x)} items")
            data, scales = x
            check_tensor("x[0]", data, (FP8_DTYPE,), dim=2)
            check_hidden("x[0]", data.size(1), 1, multiple_of=128)
            check_tensor("x[1] (scales)", scales, (torch.float32, torch.int32), shape=(data.size(0), None),
                         contiguous=False)
            check_same_device(self.device, x=data, scales=scales)
            return data, scales
        check_tensor("x", x, (torch.bfloat16,), dim=2)
        check_hidden("x", x.size(1), x.element_size())
        check_same_device(self.device, x=x)
        return x, None

    def _check_topk_idx(self, engine, topk_idx: torch.Tensor, num_experts: int,
                        num_tokens: Optional[int] = None) -> None:
        # The native kernels never sync the host, so they skip the value check (it reads the GPU tensor
        # back) and treat out-of-range entries as -1; the reference engine syncs anyway.
        check_topk_idx(topk_idx, num_experts, num_tokens=num_tokens, check_values=engine is not self._native)

    def _check_config(self, config: Optional[Config], default: Callable[[int], Config]) -> Config:
        if config is None:
            # Built once per (kind, set_num_sms value): the calls only read it, and building it is not free.
            key = (default, Buffer.num_sms)
            if key not in self._default_configs:
                self._default_configs[key] = default(self.group_size)
            return self._default_configs[key]
        if not isinstance(config, Config):
            raise TypeError(f"config must be a uccl_ep_plugin.Config, got {type(config).__name__}")
        return config

    def _check_bias(self, bias, num_tokens: int, hidden: int) -> None:
        if bias is None:
            return
        biases = list(bias) if isinstance(bias, tuple) else [bias]
        if len(biases) > 2:
            raise ValueError(f"bias must be a tensor or a tuple of at most 2 tensors, got {len(biases)}")
        for i, b in enumerate(biases):
            check_tensor(f"bias[{i}]", b, (torch.bfloat16,), shape=(num_tokens, hidden))
            check_same_device(self.device, **{f"bias[{i}]": b})

    def _check_normal_handle(self, handle) -> Tuple[torch.Tensor, ...]:
        if type(handle) is self._normal_handle:   # this Buffer's dispatch made it: its items were checked then
            return tuple(handle)
        self._check_owner(handle)
        if not isinstance(handle, (tuple, list)) or len(handle) != 6:
            raise ValueError("handle must be the 6-tuple returned by dispatch (rank_prefix_matrix, "
                             "channel_prefix_matrix, recv_channel_prefix_matrix, recv_src_idx, is_token_in_rank, "
                             "send_head)")
        r = self.group_size
        rank_prefix_matrix, channel_prefix_matrix, recv_channel_prefix_matrix, recv_src_idx, in_rank, send_head = handle
        check_tensor("handle[0] (rank_prefix_matrix)", rank_prefix_matrix, (torch.int32,), shape=(r, r))
        check_tensor("handle[1] (channel_prefix_matrix)", channel_prefix_matrix, (torch.int32,), shape=(r, None))
        check_tensor("handle[2] (recv_channel_prefix_matrix)", recv_channel_prefix_matrix, (torch.int32,),
                     shape=(r, None))
        check_tensor("handle[3] (recv_src_idx)", recv_src_idx, (torch.int32,), dim=1)
        check_tensor("handle[4] (is_token_in_rank)", in_rank, (torch.bool,), shape=(None, r))
        check_tensor("handle[5] (send_head)", send_head, (torch.int32,), shape=(in_rank.size(0), r))
        check_same_device(self.device, handle=rank_prefix_matrix)
        return tuple(handle)

    def _check_low_latency_handle(self, handle) -> Tuple:
        if type(handle) is self._low_latency_handle:   # as for the normal handle: checked when made
            return handle
        self._check_owner(handle)
        if not isinstance(handle, (tuple, list)) or len(handle) != 5:
            raise ValueError("handle must be the 5-tuple returned by low_latency_dispatch (src_info, layout_range, "
                             "num_max_dispatch_tokens_per_rank, hidden, num_experts)")
        src_info, layout_range, num_tokens_limit, hidden, num_experts = handle
        check_num_experts(num_experts, self.group_size, name="handle[4] (num_experts)")
        local_experts = num_experts // self.group_size
        check_tensor("handle[0] (src_info)", src_info, (torch.int32,),
                     shape=(local_experts, self.group_size * num_tokens_limit))
        check_tensor("handle[1] (layout_range)", layout_range, (torch.int64,), shape=(local_experts, self.group_size))
        return src_info, layout_range, num_tokens_limit, hidden, num_experts
