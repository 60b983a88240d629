"""The native engine: operations backed by the compiled kernels of ``uccl_ep_plugin._C``.

It reports, per operation, why it cannot serve (no GPU, not built, not implemented yet, peers
it cannot map), so the Buffer can fall back visibly instead of silently.
"""

from typing import Callable, Dict, Optional

import torch

from ...hosts import RdmaRanks
from .low_latency import COMBINE_ENV, NativeLowLatency, combine_mode
from .normal import NativeNormal
from .peers import (FORCE_PROXY_ENV, first_reason, force_proxy, map_peer_buffer, ranks_on_other_hosts,
                    same_on_every_rank)
from ...platform_config import resolve_config
from ...platform_config.loader import AUTO_ATOMIC_KEY
from ...proxies import (TRANSPORT_ENV, TRANSPORT_FEATURES, cross_host_reason, no_rdma_device_reason, proxy_transport,
                        transport_named)
from .proxy_path import ProxyPath
from .torch_tensors import use_torch_shim

# operation -> build feature it needs
IMPLEMENTED = {"get_dispatch_layout": "dispatch_layout", "dispatch": "normal_nvlink", "combine": "normal_nvlink",
               "low_latency_dispatch": "low_latency_nvlink", "low_latency_combine": "low_latency_nvlink"}
LOW_LATENCY_OPERATIONS = ("low_latency_dispatch", "low_latency_combine")
NORMAL_OPERATIONS = ("dispatch", "combine")


def _load_extension():
    from ... import _C  # noqa: WPS433 (imported lazily: the reference engine works without it)
    return _C


def _platform_mismatch(info) -> Optional[str]:
    """Why a build of _C cannot serve this torch's GPUs (AMD code with a CUDA torch, or the reverse), or None."""
    torch_on_rocm = getattr(torch.version, "hip", None) is not None
    if info.get("hip") and not torch_on_rocm:
        return "this build of uccl_ep_plugin._C is for AMD GPUs (HIP) and torch is not a ROCm build"
    if info.get("cuda") and torch_on_rocm:
        return ("this build of uccl_ep_plugin._C is for NVIDIA GPUs (CUDA) and torch is a ROCm build: rebuild it with "
                "UCCL_EP_HIP=1")
    return None


def unvalidated_reason() -> Optional[str]:
    """Why ``auto`` does not pick the native engine where it could run but has not been validated (the HIP build:
    it compiles in CI but has never run on an AMD GPU), or None."""
    try:
        info = _load_extension().build_info()
    except ImportError:
        return None
    if info.get("hip"):
        return ("the native kernels compile for AMD GPUs but have not been validated on one yet; "
                "UCCL_EP_ENGINE=native tries them")
    return None


def aggressive_atomics() -> bool:
    """How the kernels publish and poll flags (csrc/common/portability.h, publish_flag): as relaxed accesses
    between explicit fences where UCCL_EP_ENABLE_AGGRESSIVE_ATOMIC resolves to 1 in the platform config (its
    default: 1 with a ROCm torch, else 0), else as release stores and acquire loads."""
    return bool(resolve_config().values[AUTO_ATOMIC_KEY])


def unsupported_reason(operation: str, device: torch.device) -> Optional[str]:
    """None if the native engine can run ``operation`` on ``device``, else the reason it cannot."""
    if device.type != "cuda":
        return f"the native engine needs a CUDA device, this Buffer runs on {device.type}"
    feature = IMPLEMENTED.get(operation)
    if feature is None:
        return "no native kernel yet"
    try:
        extension = _load_extension()
    except ImportError as error:
        return f"the native extension is not importable ({error})"
    info = extension.build_info()
    features = info.get("features", [])
    if feature not in features:
        return f"this build of uccl_ep_plugin._C was compiled without GPU code ({feature} missing)"
    mismatch = _platform_mismatch(info)
    if mismatch is not None:
        return mismatch
    shim_problem = use_torch_shim(extension)
    if shim_problem is not None:
        return shim_problem
    if operation in LOW_LATENCY_OPERATIONS and force_proxy():
        proxy_feature = TRANSPORT_FEATURES[proxy_transport()]
        if proxy_feature not in features:
            return (f"{FORCE_PROXY_ENV}=1 sends through the CPU proxy over {TRANSPORT_ENV}={proxy_transport()}, "
                    f"and this build has no {proxy_feature}")
        if proxy_transport() == "verbs":
            missing = no_rdma_device_reason(extension)
            if missing is not None:
                return f"{FORCE_PROXY_ENV}=1 with {TRANSPORT_ENV}=verbs: {missing}"
    return None


class NativeEngine:
    name = "native"

    def __init__(self, num_ranks: int, device: torch.device, rdma_ranks: Optional[RdmaRanks]) -> None:
        self._C = _load_extension()
        shim_problem = use_torch_shim(self._C)   # the operations' outputs are allocated by the extension
        if shim_problem is not None:
            raise RuntimeError(shim_problem)
        self.num_ranks = num_ranks
        self.device = device
        self.rdma_ranks = rdma_ranks   # the layout's num_tokens_per_rdma_rank counts by them
        self.aggressive_atomics = aggressive_atomics()
        self.low_latency: Optional[NativeLowLatency] = None
        self.normal: Optional[NativeNormal] = None
        self._checked_layouts = self._C.CheckedCalls()   # get_dispatch_layout's kinds of call that passed the checks
        # Before any of our kernels spins on a peer or the proxy (see _C.load_kernels).
        with torch.cuda.device(device):
            self._C.load_kernels()

    def setup_normal(self, group, rank: int, num_bytes: int, timeout_s: float) -> Dict[str, str]:
        """Map every rank's ``num_nvl_bytes`` buffer (collective). Returns ``{operation: reason}`` for the
        normal-mode operations that cannot run natively after all (the same on every rank)."""
        if num_bytes <= self._C.NORMAL_CONTROL_BYTES:
            return dict.fromkeys(NORMAL_OPERATIONS, f"num_nvl_bytes={num_bytes} leaves no room for rows (the native "
                                                    f"normal mode needs more than {self._C.NORMAL_CONTROL_BYTES})")
        max_ranks = min(self._C.NORMAL_MAX_RANKS, self._C.NORMAL_MAX_COMBINE_RANKS)
        if self.num_ranks > max_ranks:
            return dict.fromkeys(NORMAL_OPERATIONS, f"the native normal mode serves at most {max_ranks} ranks "
                                                    f"(a combine sums a token's rows with one warp lane per rank)")
        with torch.cuda.device(self.device):
            peer_buffer, reason = map_peer_buffer(self._C, group, rank, self.device, num_bytes)
            if peer_buffer is None:
                return dict.fromkeys(NORMAL_OPERATIONS, reason)
            self.normal = NativeNormal(self._C, peer_buffer, rank, self.num_ranks, self.device, timeout_s,
                                       self.aggressive_atomics)
        # The operations themselves (the extension makes the Buffer's device current for its calls).
        self.dispatch = self.normal.dispatch
        self.combine = self.normal.combine
        return {}

    @property
    def normal_buffer(self) -> Optional[torch.Tensor]:
        return None if self.normal is None else self.normal.peer_buffer.tensor

    @property
    def maps_peer_memory(self) -> bool:
        """Whether peers map this rank's buffers (then all ranks must finish before any frees them)."""
        return self.low_latency is not None or self.normal is not None

    def drain_proxy(self, timeout_s: float) -> None:
        """After a device synchronize: wait until the proxy has carried out what the kernels pushed (writes
        and release counts go out after the kernels finish), so no peer closes its transport under them and no
        collective this rank issues next holds them up (Buffer.synchronize)."""
        proxy_path = None if self.low_latency is None else self.low_latency.proxy_path
        if proxy_path is not None:
            proxy_path.threads.drain(timeout_s)

    def check(self) -> None:
        """Raise the first failure a kernel or the proxy recorded (else the next call of that mode raises it)."""
        for mode in (self.low_latency, self.normal):
            if mode is not None:
                mode.check()

    def setup_low_latency(self, group, rank: int, num_bytes: int, timeout_s: float) -> Dict[str, str]:
        """Map the low-latency buffers of this host's ranks (collective); ranks on other hosts (logical hosts of this
        machine too), or every peer with UCCL_EP_FORCE_PROXY=1, are reached through the CPU proxies. Returns
        ``{operation: reason}`` for the operations that cannot run natively after all (the same on every rank)."""
        prereduce = same_on_every_rank(group, COMBINE_ENV, combine_mode()) == "prereduce"
        with torch.cuda.device(self.device):
            # cuda-copy named: the logical hosts UCCL_EP_GPUS_PER_NODE cuts this machine into reach each other
            # through the proxies' copy engines, which write into every rank's buffer: the whole machine is mapped,
            # and the kernels still send to the other logical hosts through the proxies.
            machine_wide = transport_named() and proxy_transport() == "cuda-copy"
            peer_buffer, reason = map_peer_buffer(self._C, group, rank, self.device, num_bytes, other_hosts=True,
                                                  logical_hosts=not machine_wide)
            if peer_buffer is None:
                return dict.fromkeys(LOW_LATENCY_OPERATIONS, reason)
            remote = (ranks_on_other_hosts(group, rank, self.device) if machine_wide else peer_buffer.remote_ranks)
            if force_proxy():   # every peer as if on another host
                remote = [peer for peer in range(self.num_ranks) if peer != rank]
            reason = first_reason(group, cross_host_reason(self._C) if peer_buffer.remote_ranks else None)
            if reason is not None:
                peer_buffer.release()
                return dict.fromkeys(LOW_LATENCY_OPERATIONS, reason)
            proxy_path = None
            if remote:
                try:   # every rank raises together when a proxy cannot start (proxies.ProxyThreads)
                    proxy_path = ProxyPath(self._C, group, rank, self.num_ranks, self.device, peer_buffer, remote,
                                           timeout_s)
                except BaseException as error:
                    peer_buffer.release()
                    # verbs chosen for the user (not named) and not starting: the reference engine serves instead.
                    if peer_buffer.remote_ranks and not transport_named() and isinstance(error, Exception):
                        return dict.fromkeys(LOW_LATENCY_OPERATIONS, (
                            f"the verbs transport, chosen for the ranks on other hosts because this host has an RDMA "
                            f"device, could not start ({error}); check the RDMA setup with `uccl-ep doctor`, or set "
                            f"{TRANSPORT_ENV}=tcp with UCCL_SOCKET_IFNAME"))
                    raise
            self.low_latency = NativeLowLatency(self._C, peer_buffer, rank, self.num_ranks, self.device, timeout_s,
                                                torch.cuda.get_device_properties(self.device).multi_processor_count,
                                                self.aggressive_atomics, proxy_path, prereduce)
        # The operations themselves, not wrappers: a call from the Buffer goes straight to them (the extension
        # makes the Buffer's device current for its own calls).
        self.low_latency_dispatch = self.low_latency.low_latency_dispatch
        self.low_latency_combine = self.low_latency.low_latency_combine
        return {}

    @property
    def low_latency_buffer(self) -> Optional[torch.Tensor]:
        return None if self.low_latency is None else self.low_latency.peer_buffer.tensor

    def get_dispatch_layout(self, topk_idx: torch.Tensor, num_experts: int, stream: int, check: Callable[[], None]):
        """``check``: the caller's argument checks, which the extension runs only for a new kind of call."""
        num_tokens_per_rank, num_tokens_per_expert, is_token_in_rank = self._C.get_dispatch_layout(
            (topk_idx,), (num_experts,), self.num_ranks, stream, self.device.index, self._checked_layouts, check)
        per_rdma_rank = None
        if self.rdma_ranks is not None:   # torch ops reading the kernel's output: on its stream
            with torch.cuda.stream(torch.cuda.ExternalStream(stream, device=self.device)):
                per_rdma_rank = self.rdma_ranks.token_counts(is_token_in_rank)
        return num_tokens_per_rank, per_rdma_rank, num_tokens_per_expert, is_token_in_rank

    def destroy(self) -> None:
        if self.normal is not None:
            with torch.cuda.device(self.device):
                self.normal.destroy()
            self.normal = None
        if self.low_latency is not None:
            with torch.cuda.device(self.device):
                self.low_latency.destroy()
            self.low_latency = None
        self._C = None
