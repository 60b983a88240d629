"""CPU proxy threads over one rank's communication memory, and UCCL-EP's ``initialize_uccl`` /
``destroy_uccl`` that start and stop them.

A :class:`ProxyThreads` owns the command FIFOs producers push into, and a ``_C.Proxy`` whose threads
pop the commands and execute them through a transport to the other ranks' memory. Starting one is
collective over the group (the transports exchange their listen addresses through it); stopping is
local. The Buffer starts its own when its low-latency kernels have peers to reach through a proxy;
``initialize_uccl`` starts them over a scratch buffer the caller owns, as UCCL-EP's scripts do.

Settings: UCCL_EP_PROXY_THREADS (threads, default 1), UCCL_EP_PROXY_FIFOS (FIFOs, default 1),
UCCL_EP_PROXY_TRANSPORT (``cuda-copy``, ``tcp`` or ``verbs``: the Buffer's proxy path, and ``initialize_uccl``'s
where it names ``verbs``), UCCL_EP_PROXY_CPUS
(the CPUs the threads run on), UCCL_EP_PROXY_QUIET_ON_GPU (default 1: a QUIET becomes a fence between the
transport's streams where the transport can order them on the device, cuda-copy; 0: the proxy thread waits
for the completions), the platform config's in-flight limits and adaptive sleep, and UCCL_SOCKET_IFNAME for
tcp.
"""

import atexit
import os
import re
import threading
import time
from typing import Dict, List, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist

from .notices import warn_once
from .platform_config import resolve_config
from .platform_config.detect import gpu_pci_address, nearest_rdma_device

THREADS_ENV = "UCCL_EP_PROXY_THREADS"
FIFOS_ENV = "UCCL_EP_PROXY_FIFOS"
TRANSPORT_ENV = "UCCL_EP_PROXY_TRANSPORT"
CPUS_ENV = "UCCL_EP_PROXY_CPUS"
QUIET_ON_GPU_ENV = "UCCL_EP_PROXY_QUIET_ON_GPU"
FIFO_CAPACITY = 1024
MODULE_LOADING_ENV = "CUDA_MODULE_LOADING"
# transport name -> the build feature it needs
TRANSPORT_FEATURES = {"cuda-copy": "cuda_copy_transport", "tcp": "tcp_device_memory", "verbs": "verbs_transport"}


def eager_module_loading() -> bool:
    """Whether CUDA loads every kernel at start-up (CUDA_MODULE_LOADING=EAGER) instead of at its first launch."""
    return os.environ.get(MODULE_LOADING_ENV, "").strip().upper() == "EAGER"


def _warn_lazy_loading(transport: str) -> None:
    # Both stand-in transports copy GPU memory through the CUDA runtime from the proxy thread. A kernel
    # launched for the first time while a low-latency kernel waits on the proxy is loaded then, the load
    # waits for the running kernels, and the proxy's copies wait behind it (seen on 2x H200 with tcp: every
    # run stopped at the first dispatch). A NIC moves the bytes without the runtime.
    if not eager_module_loading():
        warn_once(f"the {transport} proxy transport copies GPU memory through the CUDA runtime; with lazy module "
                  f"loading a kernel's first launch while a low-latency call waits on the proxy can hold those copies "
                  f"until the timeout. Set {MODULE_LOADING_ENV}=EAGER before CUDA starts.")


def transport_named() -> bool:
    """Whether UCCL_EP_PROXY_TRANSPORT is set (else the proxies' transport is chosen: proxy_transport)."""
    return bool(os.environ.get(TRANSPORT_ENV, "").strip())


def proxy_transport(cross_host: bool = False) -> str:
    """The transport named by UCCL_EP_PROXY_TRANSPORT; when unset, verbs for proxies that reach ranks on other hosts
    (``cross_host``, where cross_host_reason found an RDMA device), else cuda-copy."""
    name = os.environ.get(TRANSPORT_ENV, "").strip().lower() or ("verbs" if cross_host else "cuda-copy")
    if name not in TRANSPORT_FEATURES:
        raise ValueError(f"{TRANSPORT_ENV}={name!r}: expected one of {sorted(TRANSPORT_FEATURES)}")
    return name


def cross_host_reason(extension) -> Optional[str]:
    """Why the native low-latency kernels cannot reach ranks on other hosts through the proxies here, or None. They
    go over verbs (an RDMA NIC: named in UCCL_EP_PROXY_TRANSPORT, or chosen when it is unset and this host has an
    RDMA device), or tcp on the interface UCCL_SOCKET_IFNAME names (loopback cannot reach another host); cuda-copy
    needs one host."""
    named = os.environ.get(TRANSPORT_ENV, "").strip().lower()
    if named in ("verbs", ""):
        missing = no_rdma_device_reason(extension)
        if named or missing is None:
            return missing
        return (f"ranks on other hosts are reached through the CPU proxies over an RDMA NIC, but {missing}; or set "
                f"{TRANSPORT_ENV}=tcp with UCCL_SOCKET_IFNAME")
    if named == "tcp":
        if not os.environ.get("UCCL_SOCKET_IFNAME", "").strip():
            return (f"{TRANSPORT_ENV}=tcp across hosts needs UCCL_SOCKET_IFNAME (the interface the hosts reach each "
                    f"other on; the default, loopback, reaches this host only)")
        return None
    return (f"{TRANSPORT_ENV}={named} reaches this host only; ranks on other hosts are reached through the CPU proxies "
            f"over an RDMA NIC ({TRANSPORT_ENV}=verbs, or unset where the host has one) or sockets "
            f"({TRANSPORT_ENV}=tcp with UCCL_SOCKET_IFNAME)")


def no_rdma_device_reason(extension) -> Optional[str]:
    """Why the verbs transport cannot open an RDMA device here (libibverbs missing, no device), or None."""
    if not extension.verbs_available():
        return "libibverbs.so.1 cannot be loaded (install rdma-core's libibverbs and the NIC's provider)"
    if not extension.verbs_devices():
        return ("this host has no RDMA device (`uccl-ep doctor` lists them); use UCCL_EP_PROXY_TRANSPORT=tcp or "
                "cuda-copy")
    return None


def verbs_settings(platform) -> dict:
    """The verbs transport's settings from a resolved platform config (its files, with the environment over them)."""
    values = platform.values
    return dict(gid_index=values["UCCL_IB_GID_INDEX"], service_level=values["UCCL_IB_SL"],
                traffic_class=values["UCCL_IB_TC"], qps_per_peer=values["UCCL_IB_QPS_PER_PEER"])


def verbs_device(gpu: Optional[int]) -> str:
    """The RDMA device the verbs transport of the rank on GPU ``gpu`` opens: "" where UCCL_IB_HCA is set (the
    transport reads it) or no GPU is known (then it takes the first device), else the device nearest to the GPU
    in the PCIe tree."""
    if gpu is None or os.environ.get("UCCL_IB_HCA", "").strip():
        return ""
    props = torch.cuda.get_device_properties(gpu)
    return nearest_rdma_device(gpu_pci_address(props.pci_domain_id, props.pci_bus_id, props.pci_device_id)) or ""


def proxy_cpus(local_rank: int) -> List[int]:
    """The CPUs for the proxy threads of the rank on GPU ``local_rank``, from UCCL_EP_PROXY_CPUS: a CPU list
    such as ``0-3,8`` (thread t runs on the t-th CPU, cycling), or one list per local rank separated by
    ``;`` (``0-3;4-7``: rank 0 takes the first, rank 1 the second, and so on, cycling). Empty: any CPU."""
    text = os.environ.get(CPUS_ENV, "").strip()
    if not text:
        return []
    groups = [group.strip() for group in text.split(";")]
    group = groups[local_rank % len(groups)]
    cpus: List[int] = []
    for part in group.split(","):
        match = re.fullmatch(r"(\d+)(?:-(\d+))?", part.strip())
        first = int(match.group(1)) if match else -1
        last = int(match.group(2) or first) if match else -1
        if not match or last < first:
            raise ValueError(f"{CPUS_ENV}={text!r}: {part.strip()!r} is not a CPU or a range of CPUs (like 0-3)")
        cpus.extend(range(first, last + 1))
    return cpus


def _positive_setting(name: str, default: int) -> int:
    text = os.environ.get(name, "").strip()
    if not text:
        return default
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"{name}={text!r} is not an integer") from None
    if value < 1:
        raise ValueError(f"{name}={value} must be at least 1")
    return value


def _flag_setting(name: str, default: bool) -> bool:
    text = os.environ.get(name, "").strip().lower()
    if not text:
        return default
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{name}={text!r} is not a switch (1/0, true/false, yes/no, on/off)")


def _load_extension():
    from . import _C  # noqa: WPS433 (imported lazily: the reference engine works without it)
    return _C


def _require_same_counter_adds(rank: int, native_by_rank: Sequence[bool]) -> None:
    """Every rank sends counter adds the same way (a NIC's atomic and a host atomic on one word are not atomic with
    each other); else a ValueError on every rank naming the ranks of each way."""
    if len(set(native_by_rank)) > 1:
        native = [r for r, n in enumerate(native_by_rank) if n]
        emulated = [r for r, n in enumerate(native_by_rank) if not n]
        raise ValueError(f"rank {rank}: ranks {native} would send counter adds as the NIC's atomics and ranks "
                         f"{emulated} as immediates; every rank must use the same UCCL_IB_NATIVE_ATOMICS, reorder "
                         f"injection setting and kind of NIC")


class ProxyThreads:
    """The FIFOs and proxy threads of one rank. Collective: every rank of ``group`` constructs one.

    ``memory`` is the region the commands' offsets refer to, on ``device``: a tensor (host or device
    memory, over tcp and verbs), or a PeerMemory whose peers are open (over cuda-copy,
    ``transport="cuda-copy"``). A rank that cannot start its proxy raises its error, every other rank a
    RuntimeError naming it (nobody waits for it). FIFOs
    are pinned and mapped into the device for device memory (kernels push; ``device_views``), host
    FIFOs otherwise (``fifos``, with ``push``). ``ordering``: where the region keeps the counters and
    count flags the receiving proxy applies immediates to (``num_counters``, ``counters_offset``,
    ``flags_offset``); none by default."""

    def __init__(self, group, rank: int, num_ranks: int, memory, device: torch.device, *, transport: str,
                 low_latency: bool, timeout_s: float, extension=None,
                 ordering: Optional[Dict[str, int]] = None) -> None:
        extension = extension or _load_extension()
        platform = resolve_config()
        config = extension.ProxyConfig.from_environ(platform.as_environ())
        for key, value in (ordering or {}).items():   # the counter layout of the region (ProxyConfig's keys)
            setattr(config, key, value)
        config.low_latency = low_latency
        config.timeout_s = timeout_s
        config.cpu_affinity = proxy_cpus(device.index if device.type == "cuda" else rank)
        config.quiet_on_gpu = _flag_setting(QUIET_ON_GPU_ENV, True)
        self.num_threads = _positive_setting(THREADS_ENV, 1)
        self.num_fifos = _positive_setting(FIFOS_ENV, 1)
        self.transport = transport
        self.rank = rank
        self.proxy = None
        if device.type == "cuda":
            _warn_lazy_loading(transport)
            self.mapped_fifos = extension.MappedFifos(self.num_fifos, FIFO_CAPACITY, device.index)
            fifos = self.mapped_fifos
        else:
            self.mapped_fifos = None
            fifos = self.fifos = [extension.HostFifo(FIFO_CAPACITY) for _ in range(self.num_fifos)]
        options = dict(num_threads=self.num_threads, config=config, transport_timeout_s=timeout_s)
        try:
            failure = None
            try:
                self.proxy = self._make_proxy(extension, rank, num_ranks, memory, device, fifos, platform, options)
            except Exception as error:   # every rank hears of it below instead of waiting for this one
                failure = error
            records = [None] * num_ranks
            mine = (None, None, f"{type(failure).__name__}: {failure}") if failure else \
                (self.proxy.listen_address(), self.proxy.native_atomics, None)
            dist.all_gather_object(records, mine, group=group)
            if failure is not None:
                try:
                    raise failure
                finally:
                    del failure   # the traceback holds this frame: no cycle keeping the group alive until exit
            failed = {peer: why for peer, (_, _, why) in enumerate(records) if why is not None}
            if failed:
                raise RuntimeError(f"rank {rank}: the {transport} proxies could not start: " +
                                   "; ".join(f"rank {peer}: {why}" for peer, why in failed.items()))
            _require_same_counter_adds(rank, [native for _, native, _ in records])
            self.proxy.connect([address for address, _, _ in records])
            dist.barrier(group=group)   # verbs: every queue pair can receive before any request is posted
            self.proxy.start()
        except BaseException:
            self.close()
            raise

    def _make_proxy(self, extension, rank: int, num_ranks: int, memory, device: torch.device, fifos, platform,
                    options: dict):
        transport = self.transport
        if transport == "cuda-copy":
            return extension.Proxy.over_cuda_copy(rank, num_ranks, memory, fifos, **options)
        gpu = device.index if device.type == "cuda" else None
        region = (memory.data_ptr(), memory.numel() * memory.element_size())
        if transport == "tcp":
            return extension.Proxy(rank, num_ranks, *region, fifos, device=gpu, **options)
        if transport == "verbs":
            nearest_to = gpu if gpu is not None else (torch.cuda.current_device() if torch.cuda.is_available()
                                                      else None)   # the rank's GPU picks the NIC
            return extension.Proxy.over_verbs(rank, num_ranks, *region, fifos, device=verbs_device(nearest_to),
                                              gpu=-1 if gpu is None else gpu, **verbs_settings(platform), **options)
        raise ValueError(f"transport={transport!r}: expected one of {sorted(TRANSPORT_FEATURES)}")

    @property
    def device_views(self) -> int:
        """Address of the device array of FIFO views the kernels push into."""
        return self.mapped_fifos.device_views

    def check(self) -> None:
        """Raise what the proxy recorded (a command it could not execute, a transport failure)."""
        if self.proxy is not None:
            self.proxy.check()

    def drain(self, timeout_s: float) -> None:
        """Wait until the proxy has executed every command pushed so far and every request it posted has
        completed; call it once the producers stopped (after a device synchronize), before the transports
        close. Raises the proxy's failure, or CommTimeoutError naming the rank after ``timeout_s``."""
        if self.proxy is None:
            return
        deadline = time.monotonic() + timeout_s
        while not self.proxy.idle:
            self.proxy.check()
            if time.monotonic() > deadline:
                from .engines.reference.collectives import CommTimeoutError  # here: the engines import this module
                raise CommTimeoutError(
                    f"rank {self.rank}: the proxy did not finish its pushed commands within {timeout_s:g} s "
                    f"({self.proxy.inflight_requests} requests in flight, the {self.transport} transport holds "
                    f"{self.proxy.transport_outstanding})")
            time.sleep(0.0005)

    def stats(self) -> Dict:
        return {} if self.proxy is None else self.proxy.stats()

    @property
    def running(self) -> bool:
        return self.proxy is not None

    def close(self) -> None:
        """Stop the threads, close the transport, free the FIFOs (idempotent)."""
        if self.proxy is not None:
            self.proxy.close()
            self.proxy = None
        if self.mapped_fifos is not None:
            self.mapped_fifos.release()
            self.mapped_fifos = None


# ----------------------------------------------------------------------------- initialize_uccl / destroy_uccl
_started_lock = threading.Lock()
_started: Dict[str, ProxyThreads] = {}     # device -> the proxies initialize_uccl started there


def _scratch_region(scratch: Union[torch.Tensor, int], scratch_nbytes: int) -> torch.Tensor:
    """The first ``scratch_nbytes`` bytes of ``scratch`` (a tensor, or the address of CUDA memory on the
    current device) as a uint8 tensor."""
    if isinstance(scratch_nbytes, bool) or not isinstance(scratch_nbytes, int) or scratch_nbytes <= 0:
        raise ValueError(f"scratch_nbytes must be a positive int, got {scratch_nbytes!r}")
    if isinstance(scratch, torch.Tensor):
        if not scratch.is_contiguous():
            raise ValueError("scratch must be a contiguous tensor")
        available = scratch.numel() * scratch.element_size()
        if scratch_nbytes > available:
            raise ValueError(f"scratch_nbytes={scratch_nbytes} exceeds the {available} bytes of scratch")
        return scratch.view(-1).view(torch.uint8)[:scratch_nbytes]
    if isinstance(scratch, bool) or not isinstance(scratch, int) or scratch <= 0:
        raise TypeError(f"scratch must be a tensor or the address of CUDA memory, got {type(scratch).__name__}")
    if not torch.cuda.is_available():
        raise ValueError("scratch is an address, which must be CUDA memory, and no CUDA device is visible")
    from .engines.native.peers import device_bytes  # noqa: WPS433 (that package imports this module)
    return device_bytes(None, scratch, scratch_nbytes, torch.device("cuda", torch.cuda.current_device()))


def initialize_uccl(scratch: Union[torch.Tensor, int], scratch_nbytes: int, rank: int, num_ranks: int, group,
                    num_experts: int = 0, is_intranode: Optional[bool] = None, use_normal_mode: bool = False,
                    ) -> Tuple[List[ProxyThreads], None]:
    """Start this rank's CPU proxy threads over ``scratch`` (collective over ``group``); returns
    ``(proxies, workers)`` for :func:`destroy_uccl`. The transport is tcp (listening on
    UCCL_SOCKET_IFNAME's address, else loopback), or verbs where UCCL_EP_PROXY_TRANSPORT=verbs; command
    offsets are relative to ``scratch``.
    ``num_experts`` and ``is_intranode`` are accepted for UCCL-EP's signature and checked;
    ``use_normal_mode`` picks the normal-mode in-flight limit (UCCL_IB_MAX_INFLIGHT_NORMAL)."""
    if group is None:
        group = dist.group.WORLD
    if rank != dist.get_rank(group) or num_ranks != dist.get_world_size(group):
        raise ValueError(f"rank={rank}, num_ranks={num_ranks} do not match the group "
                         f"(rank {dist.get_rank(group)} of {dist.get_world_size(group)})")
    if isinstance(num_experts, bool) or not isinstance(num_experts, int) or num_experts < 0:
        raise ValueError(f"num_experts must be a non-negative int, got {num_experts!r}")
    if num_experts and num_experts % num_ranks:
        raise ValueError(f"num_experts={num_experts} is not a multiple of num_ranks={num_ranks}")
    region = _scratch_region(scratch, scratch_nbytes)
    key = str(region.device)
    with _started_lock:
        if key in _started:
            raise RuntimeError(f"initialize_uccl: proxies already run on {key}; call destroy_uccl first")
    from .buffer import timeout_seconds   # noqa: WPS433 (the buffer module imports this one)
    transport = "verbs" if proxy_transport() == "verbs" else "tcp"   # cuda-copy needs a Buffer's mapped memory
    proxies = ProxyThreads(group, rank, num_ranks, region, region.device, transport=transport,
                           low_latency=not use_normal_mode, timeout_s=timeout_seconds())
    proxies.scratch = region   # the memory stays alive while its proxies run
    with _started_lock:
        _started[key] = proxies
    return [proxies], None


def destroy_uccl(proxies: Sequence[ProxyThreads], workers=None) -> None:
    """Stop what :func:`initialize_uccl` started (local, idempotent): threads joined, sockets closed,
    pinned FIFOs freed."""
    for proxy_threads in proxies:
        proxy_threads.close()
        with _started_lock:
            for key in [k for k, v in _started.items() if v is proxy_threads]:
                del _started[key]


@atexit.register
def _stop_at_exit() -> None:
    with _started_lock:
        running = list(_started.values())
    destroy_uccl(running)
