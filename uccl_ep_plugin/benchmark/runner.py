"""One benchmark rank: builds Buffers, times each case, checks its outputs, reports figures to rank 0."""

import os
import statistics
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from ..buffer import Buffer
from ..engines import ENGINE_ENV
from ..engines.native.normal import exchange_bytes
from ..engines.native.peers import force_proxy
from ..engines.rail import rail_transport
from ..engines.two_level import rail_rdma_bytes
from ..hosts import gpus_per_node
from ..proxies import proxy_transport
from . import baselines, host_speed, nvlink
from .case import Case
from .workloads import Workload, low_latency_bytes, normal_bytes, per_token_fp8, routing


@dataclass
class BenchOptions:
    num_ranks: int
    device: str                      # "cuda" or "cpu"
    normal: Optional[Workload]
    low_latency: Optional[Workload]
    warmup: int
    iters: int
    seed: int
    device_name: str
    commit: str
    num_sms: int = Buffer.num_sms
    baselines: bool = True           # normal mode: also time the NCCL paths SGLang/vLLM users fall back to
    extra: Dict[str, str] = field(default_factory=dict)


def _close(got: torch.Tensor, expected: torch.Tensor, rel: float) -> bool:
    scale = expected.abs().amax().clamp(min=1e-6)
    return bool(((got.float() - expected.float()).abs().amax() <= rel * scale).item())


def _settle(case: Case, device: torch.device) -> None:
    """Before a collective of the bench: this rank's part of the calls so far is done. On one machine the
    proxy path's copies do not run while a collective's kernel waits, and the peer cannot join before it has
    them (KERNEL_NOTES.md, the proxy path), so the bench never issues one with kernels or proxy writes
    outstanding."""
    if case.settle is not None:
        case.settle()
    elif device.type == "cuda":
        torch.cuda.synchronize(device)


def _barrier(case: Case, group, device: torch.device) -> None:
    _settle(case, device)
    dist.barrier(group)


@dataclass
class _EagerTimes:
    """Eager calls, each alone (the GPU idle and the ranks together before it): per-iteration seconds (on GPUs,
    CUDA events around the call; on CPU the call's whole time), and on GPUs the host's seconds until the call
    returned, and the same less its wait for the peers' counts (where ``case.count_wait`` tells it)."""
    samples: List[float]
    host: List[float]
    host_beyond_wait: List[float]
    hops: List[Dict[str, float]]   # the two hops' figures of each call (case.hops)


_HOP_KEYS = ("rail_s", "forward_s", "rail_bytes", "rail_writes")   # HopTimes.last's, in this order


def _timed_eager(case: Case, options: BenchOptions, group, device: torch.device) -> _EagerTimes:
    times = _EagerTimes([], [], [], [])
    on_gpu = device.type == "cuda"
    for i in range(options.warmup + options.iters):
        if case.prepare is not None:
            case.prepare()
        _barrier(case, group, device)
        if on_gpu:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize(device)
            start.record()
        begin = time.perf_counter()
        case.run()
        returned = time.perf_counter() - begin
        if on_gpu:
            end.record()
            end.synchronize()
        if case.finish is not None:
            case.finish()
        if i < options.warmup:
            continue
        times.samples.append(start.elapsed_time(end) / 1e3 if on_gpu else returned)
        if case.hops is not None:
            times.hops.append(case.hops())
        if on_gpu:
            times.host.append(returned)
            if case.count_wait is not None:
                times.host_beyond_wait.append(returned - case.count_wait())
    return times


def _host_back_to_back(case: Case, options: BenchOptions, group, device: torch.device) -> List[float]:
    """On GPUs, the host's seconds until ``run()`` returns when calls are issued back to back with no wait between
    (the host's cost per call when it runs ahead; a dispatch that reads its counts still waits for them)."""
    if device.type != "cuda":
        return []
    _barrier(case, group, device)
    seconds = []
    for _ in range(options.warmup + options.iters):
        if case.prepare is not None:
            case.prepare()
        begin = time.perf_counter()
        case.run()
        seconds.append(time.perf_counter() - begin)
        if case.finish is not None:
            case.finish()
    _settle(case, device)
    return seconds[options.warmup:]


class _CapturedCase:
    """The case's steps captured as CUDA graphs (in step order, so each graph sees the state the previous
    one left), replayed back to back: the host runs ahead of the GPUs, as when a serving engine replays its
    decode graph, so the ranks' kernels meet in lockstep and the figures hold no host overhead or skew."""

    def __init__(self, case: Case, device: torch.device) -> None:
        self.steps = []
        for step in (case.prepare, case.run, case.finish):
            if step is None:
                self.steps.append(None)
                continue
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                step()
            self.steps.append(graph)
        torch.cuda.synchronize(device)

    def replay(self, iters: int) -> List[float]:
        """Seconds of each iteration's measured step, timed with events between the replays."""
        prepare, run, finish = self.steps
        events = []
        for _ in range(iters):
            if prepare is not None:
                prepare.replay()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            run.replay()
            end.record()
            if finish is not None:
                finish.replay()
            events.append((start, end))
        torch.cuda.synchronize()
        return [start.elapsed_time(end) / 1e3 for start, end in events]


def _timed(case: Case, options: BenchOptions, group,
           device: torch.device) -> Tuple[List[float], str, _EagerTimes]:
    """Per-iteration seconds, how they were taken (CUDA-graph replays for the native engine's calls that never
    sync the host, else eager calls with a barrier before each), and the eager calls' times (for a replayed case,
    those of the eager pass that warms it up: kernels loaded, buffers in use)."""
    eager = _timed_eager(case, options, group, device)
    if device.type != "cuda" or case.engine != "native" or not case.capturable:
        return eager.samples, "eager", eager
    _barrier(case, group, device)
    captured = _CapturedCase(case, device)
    _barrier(case, group, device)
    captured.replay(options.warmup)
    _barrier(case, group, device)
    return captured.replay(options.iters), "cuda-graph", eager


def _kernel_name(profiler_name: str) -> str:
    """``low_latency::combine`` from ``void uccl_ep::kernels::low_latency::combine<false>(uccl_ep::...)``,
    ``normal_kernels::dispatch_send`` from ``void uccl_ep::normal_kernels::dispatch_send(...)``."""
    name = profiler_name.split("(")[0].split("<")[0].split(" ")[-1]
    return name.removeprefix("uccl_ep::").removeprefix("kernels::")


_L2_FLUSH_BYTES = 256 * 10 ** 6   # DeepEP's flush: more than any GPU's L2
_HEAD_START_GEMMS = 32            # about 10 ms on an H200: the host queues the timed calls before the GPU runs them


def _kernel_seconds(case: Case, options: BenchOptions, group,
                    device: torch.device) -> Optional[Dict[str, float]]:
    """Median GPU seconds of each kernel in ``case.kernels`` over ``options.iters`` calls; None when the engine
    launched none of them (the reference engine's NCCL kernels are not counted).

    Taken as DeepEP's tests take theirs (``bench_kineto`` with ``barrier_comm_profiling``): a GEMM (the host
    runs ahead of the GPU) and a one-element all-reduce (the ranks' GPUs leave it together), then the calls
    back to back, eagerly, under the profiler. Launch gaps and host work are excluded; a kernel's wait for
    its peer is included."""
    if device.type != "cuda" or not case.kernels:
        return None
    from torch.profiler import ProfilerActivity, profile
    token = torch.ones(1, device=device)
    with profile(activities=[ProfilerActivity.CUDA]) as profiler:
        _settle(case, device)    # the all-reduce is a collective: nothing of ours outstanding
        head_start = _OverlapCompute(device)
        for _ in range(_HEAD_START_GEMMS):
            head_start.run()
        dist.all_reduce(token, group=group)
        for _ in range(options.iters):
            _run_steps(case)
        _settle(case, device)
    durations: Dict[str, List[Tuple[float, float]]] = {name: [] for name in case.kernels}
    for event in profiler.events():
        name = _kernel_name(event.name)
        if event.device_type.name == "CUDA" and name in durations:
            durations[name].append((event.time_range.start, event.device_time_total))
    if not all(durations.values()):
        return None
    seconds = {}
    for name, launches in durations.items():
        # Each iteration launches a kernel the same number of times (a hooked operation: its send, then its
        # receive); run()'s is the case's kernel_launch-th.
        in_order = [duration for _, duration in sorted(launches)]
        per_iteration = max(1, len(in_order) // options.iters)
        seconds[name] = statistics.median(in_order[case.kernel_launch::per_iteration]) / 1e6
    return seconds


# DeepEP's eager procedure times waiting, not kernels, when a rank's Python host falls behind: the kernels then
# wait for that rank's later launches. A step whose kernels take this many times its graph replay (launch gap
# included) gets no kernel figure, only a note with the raw value.
_KERNEL_OVER_GRAPH = 1.5


def _trusted_kernel_us(kernel_us: Dict[str, float], median_us: float,
                       timing: str) -> Tuple[Optional[Dict[str, float]], Optional[str]]:
    """``(kernel_us or None, note or None)`` for a case's per-kernel times."""
    total = sum(kernel_us.values())
    if timing == "cuda-graph" and total > _KERNEL_OVER_GRAPH * median_us:
        return None, (f"kernel time not reported: DeepEP's eager procedure gave {total:.1f} us against "
                      f"{median_us:.1f} us per graph replay (a rank's host fell behind and the kernels waited "
                      "for its launches)")
    return kernel_us or None, None


def _run_steps(case: Case) -> None:
    for step in (case.prepare, case.run, case.finish):
        if step is not None:
            step()


def _back_to_back_seconds(case: Case, options: BenchOptions, group, device: torch.device) -> Optional[List[float]]:
    """Per-call seconds timed as DeepEP's tests time the normal mode (``tests/utils.py`` ``bench``): L2 flushed
    once, then the calls issued back to back with CUDA events around each and no wait between, so the host
    prepares a call while the GPU still runs the previous one. The first call is dropped, as there. None on
    CPU (every call completes before it returns)."""
    if device.type != "cuda":
        return None
    _barrier(case, group, device)
    for _ in range(options.warmup):
        _run_steps(case)
    torch.empty(_L2_FLUSH_BYTES // 4, dtype=torch.int32, device=device).zero_()
    events = []
    for _ in range(options.iters + 1):
        if case.prepare is not None:
            case.prepare()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        case.run()
        end.record()
        if case.finish is not None:
            case.finish()
        events.append((start, end))
    _settle(case, device)
    return [start.elapsed_time(end) / 1e3 for start, end in events[1:]]


def num_cases(options: BenchOptions) -> int:
    """Cases the run measures (normal mode: ours, on GPUs also with num_worst_tokens, then the NCCL baselines;
    low_latency_cases), for progress output."""
    total = 0
    if options.normal is not None:
        total += 4 + (3 if options.device == "cuda" else 0) + (baselines.NUM_CASES if options.baselines else 0)
    if options.low_latency is not None:
        total += 7
    return total


def normal_cases(buffer: Buffer, workload: Workload, rank: int, num_ranks: int, seed: int, group,
                 device: torch.device) -> List[Case]:
    x, topk_idx, topk_weights = (t.to(device) for t in routing(workload, rank, seed))
    per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk_idx, workload.experts)
    expected_recv = per_rank.clone()
    dist.all_reduce(expected_recv, group=group)
    copies = in_rank.sum(1, keepdim=True).float()
    x_fp8, scales = per_token_fp8(x)
    state: Dict[Tuple[str, int], object] = {}   # by operation and num_worst_tokens

    def dispatch(payload, num_worst_tokens: int = 0) -> Callable[[], None]:
        def run() -> None:
            state[("dispatch", num_worst_tokens)] = buffer.dispatch(
                payload, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                topk_idx=topk_idx, topk_weights=topk_weights, num_worst_tokens=num_worst_tokens)
        return run

    def check_dispatch(fp8: bool, num_worst_tokens: int = 0) -> Callable[[], bool]:
        def check() -> bool:
            recv_x, _, _, _, handle, _ = state[("dispatch", num_worst_tokens)]
            rows = (recv_x[0].float() * recv_x[1].repeat_interleave(128, dim=1)) if fp8 else recv_x.float()
            if rows.size(0) != (num_worst_tokens or int(expected_recv[rank])):
                return False
            combined, _, _ = buffer.combine(rows.to(torch.bfloat16), handle)
            reference = (x_fp8.float() * scales.repeat_interleave(128, dim=1)) if fp8 else x.float()
            return _close(combined, reference * copies, 2e-2)
        return check

    def combine(num_worst_tokens: int = 0) -> Tuple[Callable[[], None], Callable[[], bool]]:
        """A combine of the rows of one bf16 dispatch (made here, once), and its check."""
        dispatch(x, num_worst_tokens)()
        recv_x, _, recv_topk_weights, _, handle, _ = state[("dispatch", num_worst_tokens)]

        def run() -> None:
            state[("combine", num_worst_tokens)] = buffer.combine(recv_x, handle, recv_topk_weights)

        def check() -> bool:
            combined, _, _ = state[("combine", num_worst_tokens)]
            return _close(combined, x.float() * copies, 2e-2)
        return run, check

    def cached() -> Tuple[Callable[[], None], Callable[[], bool]]:
        """A dispatch of x again through the handle of combine()'s dispatch (its layout reused), and its check: the
        same rows."""
        recv_x, _, _, _, handle, _ = state[("dispatch", 0)]

        def run() -> None:
            state[("cached", 0)] = buffer.dispatch(x, handle=handle)

        def check() -> bool:
            return torch.equal(state[("cached", 0)][0], recv_x)
        return run, check

    def drop(key: Tuple[str, int]) -> Callable[[], None]:
        """A case's prepare(): frees the last call's outputs before the next call is timed, so that a call's host
        time is its own (a caller frees its old outputs when it likes, not inside the next call)."""
        return lambda: state.pop(key, None)

    def served_by(num_worst_tokens: int) -> str:
        """The engine that served that dispatch (one the native engine cannot fit goes to the reference)."""
        handle = state[("dispatch", num_worst_tokens)][4]
        return getattr(handle, "served_by", None) or buffer.engine_by_operation["dispatch"]

    run_combine, check_combine = combine()
    run_cached, check_cached = cached()

    num_recv = int(expected_recv[rank])
    own = int(per_rank[rank])
    sent, received = int(per_rank.sum()) - own, num_recv - own   # rows that cross NVLink each way

    def over_nvlink(dtype: str) -> float:
        return nvlink.busier_way_bytes(sent, received, workload.hidden, dtype)

    engine = served_by(0)
    # The two hops name their rail: the group's collectives (nccl, gloo) or a proxies' transport (verbs, tcp,
    # cuda-copy), and time each hop of every call.
    two_level = buffer._two_level
    path = hops = None
    if two_level is not None:
        path = f"rail-{two_level.rail.label}"
        two_level.hops.enabled = True
        hops = two_level.hops.last
    # The native dispatch's wait for its peers' counts, to tell the host's own time from it.
    native = buffer._native.normal if engine == "native" else None
    # Dispatch reads its counts on the host (as DeepEP's does), so normal mode is timed eagerly, end to end.
    # Kernel times only where SMs move every row (the copy engines' time is no kernel's).
    by_sm = native is not None and two_level is None and not native.dispatch_by_copy_engine(Buffer.num_sms)
    eager_path = cached_path = combine_path = path
    if native is not None and two_level is None:
        combine_path = "nvlink-sm" if by_sm else "nvlink-ce"
        # A dispatch by sends: SMs store the rows, copy engines copy them out; its combine goes by copy engines.
        eager_path = "nvlink-sends" if native.rows_by_sends(Buffer.num_sms) and not by_sm else combine_path
        cached_path = eager_path if native.cached_dispatch_by_copy_engine(Buffer.num_sms) else "nvlink-sm"
    dispatch_kernels = ("normal_kernels::layout_and_notify", "normal_kernels::dispatch_by_channels") if by_sm else ()
    combine_kernels = ("normal_kernels::combine_by_channels",) if by_sm else ()
    count_wait = None if native is None else lambda: native.copy_engine.last_count_wait_ns() / 1e9
    cases = [
        Case("normal", "dispatch", "fp8", workload, dispatch((x_fp8, scales)), check_dispatch(True),
             normal_bytes(num_recv, workload.hidden, "fp8"), engine, prepare=drop(("dispatch", 0)),
             kernels=dispatch_kernels, capturable=False, count_wait=count_wait, nvlink_bytes=over_nvlink("fp8"),
             path=eager_path, hops=hops),
        Case("normal", "dispatch", "bf16", workload, dispatch(x), check_dispatch(False),
             normal_bytes(num_recv, workload.hidden, "bf16"), engine, prepare=drop(("dispatch", 0)),
             kernels=dispatch_kernels, capturable=False, count_wait=count_wait, nvlink_bytes=over_nvlink("bf16"),
             path=eager_path, hops=hops),
        Case("normal", "dispatch (cached)", "bf16", workload, run_cached, check_cached,
             normal_bytes(num_recv, workload.hidden, "bf16"), engine, prepare=drop(("cached", 0)), capturable=False,
             nvlink_bytes=over_nvlink("bf16"), path=cached_path, hops=hops),
        Case("normal", "combine", "bf16", workload, run_combine, check_combine,
             normal_bytes(num_recv, workload.hidden, "bf16"), engine, prepare=drop(("combine", 0)),
             kernels=combine_kernels, capturable=False, nvlink_bytes=over_nvlink("bf16"), path=combine_path,
             hops=hops),
    ]
    if device.type == "cuda":
        # With num_worst_tokens (outputs padded to every token of every rank) nothing reads counts on the host, so
        # the native engine's calls are captured in CUDA graphs and timed by replay, as a serving engine runs them.
        worst = worst_tokens(workload, num_ranks)
        run_worst_combine, check_worst_combine = combine(worst)
        worst_engine = served_by(worst)
        cases += [
            Case("normal", "dispatch (num_worst_tokens)", "fp8", workload, dispatch((x_fp8, scales), worst),
                 check_dispatch(True, worst), normal_bytes(num_recv, workload.hidden, "fp8"), worst_engine,
                 nvlink_bytes=over_nvlink("fp8"), path=path, hops=hops),
            Case("normal", "dispatch (num_worst_tokens)", "bf16", workload, dispatch(x, worst),
                 check_dispatch(False, worst), normal_bytes(num_recv, workload.hidden, "bf16"), worst_engine,
                 nvlink_bytes=over_nvlink("bf16"), path=path, hops=hops),
            Case("normal", "combine (num_worst_tokens)", "bf16", workload, run_worst_combine, check_worst_combine,
                 normal_bytes(num_recv, workload.hidden, "bf16"), worst_engine, nvlink_bytes=over_nvlink("bf16"),
                 path=path, hops=hops),
        ]
    return cases


class _OverlapCompute:
    """Compute standing between a hook's send and receive halves: one bf16 GEMM of about 0.3 ms on an H200,
    far longer than the data takes to land. Nothing on CPU, where the eager timing has a barrier anyway."""

    SIZE = 4096

    def __init__(self, device: torch.device) -> None:
        self.operands = None
        if device.type == "cuda":
            self.operands = [torch.randn(self.SIZE, self.SIZE, dtype=torch.bfloat16, device=device) for _ in range(3)]

    def run(self) -> None:
        if self.operands is not None:
            a, b, out = self.operands
            torch.matmul(a, b, out=out)

    def after(self, step: Callable[[], None]) -> Callable[[], None]:
        def step_then_compute() -> None:
            step()
            self.run()
        return step_then_compute

    def then(self, step: Callable[[], None]) -> Callable[[], None]:
        def compute_then_step() -> None:
            self.run()
            step()
        return compute_then_step


def low_latency_cases(buffer: Buffer, workload: Workload, rank: int, num_ranks: int, seed: int, group,
                      device: torch.device) -> List[Case]:
    x, topk_idx, topk_weights = (t.to(device) for t in routing(workload, rank, seed, drop_entries=10))
    valid = topk_idx >= 0
    num_selections = int(valid.sum())
    local_experts = workload.experts // num_ranks
    expected_count = torch.bincount(topk_idx[valid], minlength=workload.experts).to(torch.int64)
    dist.all_reduce(expected_count, group=group)
    expected_count = expected_count[rank * local_experts:(rank + 1) * local_experts].cpu()
    # An identity "expert": the combined row must be x times the sum of its valid weights.
    expected = x.float() * (topk_weights * valid).sum(1, keepdim=True)
    state: Dict[str, object] = {}

    def run_dispatch() -> None:
        state["dispatch"] = buffer.low_latency_dispatch(x, topk_idx, workload.tokens, workload.experts,
                                                        use_fp8=True)

    def expert_outputs() -> torch.Tensor:
        (data, scales), _, _, _, _ = state["dispatch"]
        return (data.float() * scales.repeat_interleave(128, dim=-1)).to(torch.bfloat16)

    def run_combine() -> None:
        _, _, handle, _, _ = state["dispatch"]
        state["combine"] = buffer.low_latency_combine(state["outputs"], topk_idx, topk_weights, handle)

    def run_both() -> None:
        run_dispatch()
        run_combine()

    # The hook split: the send half returns a hook, the receive half calls it. A timed send covers the call
    # until its kernels finish on this rank's stream; a timed receive covers the hook only. Between them runs
    # the compute the hook exists to overlap (a GEMM on GPUs, as in DeepEP's test), so by the time the hook
    # is timed every rank's data has landed: the receive figure is the hook's own work (with the reference
    # engine, the rest of the collective it started in the send).
    overlap = _OverlapCompute(device)

    def send_dispatch() -> None:
        state["pending dispatch"] = buffer.low_latency_dispatch(x, topk_idx, workload.tokens, workload.experts,
                                                                use_fp8=True, return_recv_hook=True)

    def receive_dispatch() -> None:
        dispatched = state.pop("pending dispatch")
        dispatched[4]()
        state["dispatch"] = dispatched

    def send_combine() -> None:
        _, _, handle, _, _ = state["dispatch"]
        state["pending combine"] = buffer.low_latency_combine(state["outputs"], topk_idx, topk_weights, handle,
                                                              return_recv_hook=True)

    def receive_combine() -> None:
        combined = state.pop("pending combine")
        combined[2]()
        state["combine"] = combined

    def check() -> bool:
        combined, _, _ = state["combine"]
        return _close(combined, expected, 5e-2)

    def check_dispatch() -> bool:
        """The last dispatch's counts, and its rows combined back (untimed) through the identity expert."""
        _, count, handle, _, _ = state["dispatch"]
        if not torch.equal(count.cpu().to(torch.int64), expected_count):
            return False
        combined, _, _ = buffer.low_latency_combine(expert_outputs(), topk_idx, topk_weights, handle)
        return _close(combined, expected, 5e-2)

    # The expert outputs are made once: the routing, hence the packed layout, is the same every call.
    run_dispatch()
    state["outputs"] = expert_outputs()
    run_combine()
    engine = buffer.engine_by_operation
    dispatch_bytes = low_latency_bytes(num_selections, workload.hidden, "dispatch", "fp8")
    combine_bytes = low_latency_bytes(num_selections, workload.hidden, "combine", "bf16")
    dispatch_engine, combine_engine = engine["low_latency_dispatch"], engine["low_latency_combine"]

    def case(*args, **kwargs) -> Case:   # each settles through the Buffer: the GPU and the proxy's last writes
        return Case("low_latency", *args, settle=buffer.synchronize, **kwargs)

    # Native kernel names: one kernel per operation, launched twice with a hook (send, then receive).
    dispatch_kernel, combine_kernel = ("low_latency::dispatch",), ("low_latency::combine",)
    return [
        case("dispatch", "fp8", workload, run_dispatch, check_dispatch, dispatch_bytes,
             dispatch_engine, kernels=dispatch_kernel),
        case("dispatch-send", "fp8", workload, send_dispatch, check_dispatch, None, dispatch_engine,
             finish=overlap.then(receive_dispatch), kernels=dispatch_kernel),
        case("dispatch-recv", "fp8", workload, receive_dispatch, check_dispatch, None,
             dispatch_engine, prepare=overlap.after(send_dispatch), kernels=dispatch_kernel, kernel_launch=1),
        case("combine", "bf16", workload, run_combine, check, combine_bytes, combine_engine,
             kernels=combine_kernel),
        case("combine-send", "bf16", workload, send_combine, check, None, combine_engine,
             finish=overlap.then(receive_combine), kernels=combine_kernel),
        case("combine-recv", "bf16", workload, receive_combine, check, None, combine_engine,
             prepare=overlap.after(send_combine), kernels=combine_kernel, kernel_launch=1),
        case("dispatch+combine", "fp8", workload, run_both, check, dispatch_bytes + combine_bytes,
             dispatch_engine, kernels=dispatch_kernel + combine_kernel),
    ]


def _gather_floats(values: List[float], group, device: torch.device) -> torch.Tensor:
    local = torch.tensor(values, dtype=torch.float64, device=device)
    gathered = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, local, group=group)
    return torch.stack(gathered).cpu()


def measure(case: Case, options: BenchOptions, rank: int, group, device: torch.device, report,
            copy_gbps: Optional[float] = None) -> Dict:
    """One case's figures (the slowest rank's); with ``copy_gbps`` (this machine's NVLink copy bandwidth) and the
    case's ``nvlink_bytes``, also its NVLink floor."""
    samples, timing, eager = _timed(case, options, group, device)
    host_lone, host_beyond_wait = eager.host, eager.host_beyond_wait
    host_back_to_back = _host_back_to_back(case, options, group, device)
    host = ([statistics.median(values) if values else 0.0 for values in (host_lone, host_beyond_wait,
                                                                         host_back_to_back)]
            if host_lone else [0.0, 0.0, 0.0])
    kernels = _kernel_seconds(case, options, group, device)
    back_to_back = _back_to_back_seconds(case, options, group, device) if timing == "eager" else None
    correct = case.check()
    _settle(case, device)
    host_loop_us = float(_gather_floats([host_speed.python_loop_us()], group, device).amax())
    kernel_names = sorted(kernels) if kernels is not None else []
    hops = [statistics.median(call[key] for call in eager.hops) if eager.hops else 0.0 for key in _HOP_KEYS]
    extra = ([case.bytes_per_rank or 0.0, float(correct)] + host + [kernels[name] for name in kernel_names] +
             (back_to_back or []) + hops + [case.nvlink_bytes or 0.0])
    per_rank = _gather_floats(samples + extra, group, device)

    def slowest(first: int, count: int) -> List[float]:   # the slowest rank's value of each
        return per_rank[:, first:first + count].amax(0).tolist()

    n = len(samples)
    median_s = statistics.median(slowest(0, n))     # the slowest rank sets each step
    mean_bytes = float(per_rank[:, n].mean())
    all_correct = bool(per_rank[:, n + 1].min() > 0.5)
    host_s, host_beyond_wait_s, host_back_to_back_s = slowest(n + 2, 3) if host_lone else (None, None, None)
    if not host_beyond_wait:
        host_beyond_wait_s = None
    kernel_us = dict(zip(kernel_names, (value * 1e6 for value in slowest(n + 5, len(kernel_names)))))
    back_to_back_s = (statistics.median(slowest(n + 5 + len(kernel_names), len(back_to_back)))
                      if back_to_back else None)
    rail_s, forward_s = slowest(n + 5 + len(kernel_names) + len(back_to_back or []), 2)
    rail_bytes, rail_writes = per_rank[:, -3:-1].mean(0).tolist()
    floor = (nvlink.floor_us(per_rank[:, -1].tolist(), copy_gbps)
             if copy_gbps and case.nvlink_bytes is not None and case.engine == "native" else None)
    workload = case.workload
    kernel_us, kernel_note = _trusted_kernel_us(kernel_us, median_s * 1e6, timing)

    def bandwidth(seconds: Optional[float]) -> Optional[float]:
        return None if case.bytes_per_rank is None or seconds is None else mean_bytes / seconds / 1e9

    result = {"mode": case.mode, "op": case.op, "dtype": case.dtype, "engine": case.engine,
              "path": _path_name(case, device), "ranks": options.num_ranks, "tokens": workload.tokens,
              "hidden": workload.hidden, "topk": workload.topk, "experts": workload.experts,
              "num_sms": options.num_sms if case.mode == "normal" else None,
              "median_us": median_s * 1e6, "timing": timing,
              "kernel_us": sum(kernel_us.values()) if kernel_us else None,
              "kernel_us_each": kernel_us,
              "host_us": None if host_s is None else host_s * 1e6,
              "host_beyond_count_wait_us": None if host_beyond_wait_s is None else host_beyond_wait_s * 1e6,
              "host_back_to_back_us": None if host_back_to_back_s is None else host_back_to_back_s * 1e6,
              # The slowest rank's pure-Python loop: what the host figures above scale with (host_speed.py).
              "host_loop_us": host_loop_us,
              "back_to_back_us": None if back_to_back_s is None else back_to_back_s * 1e6,
              "gbps": bandwidth(median_s),
              "back_to_back_gbps": bandwidth(back_to_back_s),
              "nvlink_floor_us": floor, "copy_gbps": copy_gbps if floor is not None else None,
              # The two hops: time in the hop between hosts and in the forward hop inside the host (the slowest
              # rank's), what the rail carried to other hosts per rank and second, and its transport writes.
              "rail_us": rail_s * 1e6 if eager.hops else None,
              "forward_us": forward_s * 1e6 if eager.hops else None,
              "rail_gbps": rail_bytes / rail_s / 1e9 if eager.hops and rail_s > 0 else None,
              "rail_writes": rail_writes if eager.hops else None,
              "correct": all_correct, "iters": options.iters, "device": options.device_name, "commit": options.commit}
    if case.mode == "normal" and case.engine == "native":
        # The normal mode's switches this run set (UCCL_EP_NORMAL_*), so A/B runs say which side they are.
        result["settings"] = {name: value for name, value in sorted(os.environ.items())
                              if name.startswith("UCCL_EP_NORMAL_")}
    if kernel_note is not None:
        result["kernel_note"] = kernel_note
    if rank == 0:
        report(result)
    return result


def _path_name(case: Case, device: torch.device) -> str:
    if case.path is not None:
        return case.path
    if case.engine == "native":
        if case.mode == "low_latency" and force_proxy():
            return f"proxy:{proxy_transport()}"
        if case.mode == "normal":
            # The eager cases name their path (normal_cases); SMs move every row with num_worst_tokens (the
            # capturable cases).
            return "nvlink-sm" if case.capturable else "nvlink-ce"
        return "nvlink"
    return "nccl" if device.type == "cuda" else "gloo"   # the reference engine, the baselines


def worst_tokens(workload: Workload, num_ranks: int) -> int:
    """The num_worst_tokens of the bench's graph-replayed normal-mode cases: every token of every rank."""
    return workload.tokens * num_ranks


def _native_normal_bytes(workload: Workload, num_ranks: int, device: torch.device) -> int:
    """Room for the native normal mode's whole exchange at this workload, or 0 where this build has no native normal
    mode. Without counts on the host (the num_worst_tokens cases, on GPUs) a rank receives at most num_worst_tokens
    rows and, for all any rank knows, sent up to num_ranks times that; else every token of every rank to one rank."""
    try:
        from .. import _C  # noqa: WPS433 (a CPU-only install has no extension)
    except ImportError:
        return 0
    if "normal_nvlink" not in _C.build_info().get("features", []):
        return 0
    rows = num_ranks * workload.tokens
    if device.type == "cuda":
        rows = num_ranks * worst_tokens(workload, num_ranks)
    return exchange_bytes(_C, rows, workload.hidden, workload.topk)


def _rail_bytes(workload: Workload, num_ranks: int) -> int:
    """num_rdma_bytes for the hop between hosts where the ranks are cut into hosts and UCCL_EP_PROXY_TRANSPORT names
    a transport for it (verbs, tcp, cuda-copy); else 0 (the group's collectives carry it, or there is one host)."""
    per_node = gpus_per_node()
    if rail_transport() is None or not per_node or per_node >= num_ranks:
        return 0
    return rail_rdma_bytes(num_ranks // per_node, per_node, workload.tokens, workload.hidden, workload.topk)


def _nvlink_copy_gbps(group, rank: int, num_ranks: int, device: torch.device, note) -> Optional[float]:
    """This machine's NVLink copy bandwidth for the normal-mode floor (GPUs and peers of one host only), or None.
    Ranks cut into several logical hosts (UCCL_EP_GPUS_PER_NODE) run normal mode over two hops, which has no floor
    here: its hop between hosts is not NVLink."""
    per_node = gpus_per_node()
    if device.type != "cuda" or num_ranks < 2 or (per_node and per_node < num_ranks):
        return None
    from .. import _C  # noqa: WPS433 (a CPU-only install has no extension)
    gbps = nvlink.measure_copy_gbps(_C, group, rank, num_ranks, device)
    if rank == 0:
        note(f"NVLink copy bandwidth: {gbps:.1f} GB/s per rank each way (every rank to every peer at once); each "
             f"normal-mode floor is the busier way's bytes over it")
    return gbps


def run_rank(rank: int, options: BenchOptions, port: int, results_queue) -> None:
    """Entry point of one spawned rank."""
    if options.device == "cuda":
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
        backend = "nccl"
    else:
        if "OMP_NUM_THREADS" not in os.environ:
            # The ranks share the cores: one thread each (by call: torch, imported already, read the variable then).
            torch.set_num_threads(1)
        device, backend = torch.device("cpu"), "gloo"
    os.environ.setdefault(ENGINE_ENV, "auto")
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=options.num_ranks)
    group = dist.group.WORLD
    results: List[Dict] = []

    def report(result: Dict) -> None:
        results_queue.put(("progress", result))

    def note(text: str) -> None:
        results_queue.put(("note", text))

    try:
        Buffer.set_num_sms(options.num_sms)
        if options.normal is not None:
            w, r = options.normal, options.num_ranks
            hidden_bytes = w.hidden * 2
            native_bytes = _native_normal_bytes(w, r, device)
            nvl_bytes = max(Buffer.get_dispatch_config(r).get_nvl_buffer_size_hint(hidden_bytes, r),
                            Buffer.get_combine_config(r).get_nvl_buffer_size_hint(hidden_bytes, r), native_bytes)
            copy_gbps = _nvlink_copy_gbps(group, rank, r, device, note) if native_bytes else None
            buffer = Buffer(group, num_nvl_bytes=nvl_bytes, num_rdma_bytes=_rail_bytes(w, r), explicitly_destroy=True)
            for case in normal_cases(buffer, w, rank, r, options.seed, group, device):
                results.append(measure(case, options, rank, group, device, report, copy_gbps))
            buffer.destroy()
            for case in (baselines.baseline_cases(w, rank, r, options.seed, group, device) if options.baselines
                         else ()):
                results.append(measure(case, options, rank, group, device, report))
        if options.low_latency is not None:
            w = options.low_latency
            rdma_bytes = Buffer.get_low_latency_rdma_size_hint(w.tokens, w.hidden, options.num_ranks, w.experts)
            buffer = Buffer(group, num_rdma_bytes=rdma_bytes, low_latency_mode=True, explicitly_destroy=True)
            for case in low_latency_cases(buffer, w, rank, options.num_ranks, options.seed, group, device):
                results.append(measure(case, options, rank, group, device, report))
            buffer.destroy()
        if rank == 0:
            results_queue.put(("done", results))
    except BaseException as error:  # noqa: B902 - the parent reports which rank failed and why
        results_queue.put(("error", f"rank {rank}: {type(error).__name__}: {error}"))
        raise
    finally:
        dist.destroy_process_group()
