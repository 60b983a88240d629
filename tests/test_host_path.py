"""The host path of the native operations: each crosses into the extension once and makes a fixed set of torch
operations, counted here on the CPU.

A one-rank gloo Buffer gets a native engine (low-latency or normal mode) whose extension is a recorder: it
answers like the real one (no failure recorded; a normal dispatch receives every token; the outputs come back
from the call, allocated by the extension as the real one does) and notes every call made into it. A
TorchDispatchMode counts the aten operations the operation's Python runs (the recorder's own allocations are
hidden from it). A change that adds a torch operation or a second extension call to these paths fails here,
however fast the machine; the timings themselves are measured on GPUs (``uccl-ep bench``). The extension's
own allocation mechanism is tested in test_torch_tensors.py (CPU) and by the GPU tests.
"""

from collections import Counter
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from tests.multiprocess import free_local_port
from uccl_ep_plugin.engines.native.torch_tensors import DTYPES, use_torch_shim

_C = pytest.importorskip("uccl_ep_plugin._C")

T, H, K, E = 8, 256, 2, 8


def _arguments(tensors, values, checked, check):
    """The arguments as the real launchers read them (no mode sees the reading)."""
    with _disable_current_modes(), torch._C.DisableTorchFunction():
        return _C.torch_shim_arguments(tensors, values, checked, check)


def _made_by_the_extension(*specs):
    """Tensors as the extension returns them: each spec (shape, dtype[, strides]) or None; no mode sees them."""
    with _disable_current_modes(), torch._C.DisableTorchFunction():
        return [None if spec is None else torch.empty_strided(spec[0], spec[2] if len(spec) > 2 else
                                                              torch.empty(spec[0]).stride(), dtype=spec[1])
                for spec in specs]


class RecordingExtension:
    """Stands in for uccl_ep_plugin._C where the native low-latency engine uses it; ``calls`` counts every call
    into it by name. Its operations read their tensor arguments and run the caller's checks as the real ones do:
    through the extension's own mechanism (``_C.torch_shim_arguments``, with a signature memo per operation), and
    ask the engine for a region once per sizes and buffer half."""

    LOW_LATENCY_SEND, LOW_LATENCY_RECV = 1, 2

    def __init__(self) -> None:
        self.calls = Counter()
        extension = self

        class State:
            status_device = 0x1000

            def control(self, half):
                extension.calls["LowLatencyState.control"] += 1
                return 0x2000 + 64 * half

            def status(self):
                extension.calls["LowLatencyState.status"] += 1
                return 0, 0, 0, 0

            def release(self):
                extension.calls["LowLatencyState.release"] += 1

        class Operations:   # the extension's LowLatencyOperations
            def __init__(self, state, device, prereduce, num_sms, before, on_failure, make_region, positions_for):
                extension.calls["LowLatencyOperations"] += 1
                self.make_region, self.positions_for = make_region, positions_for
                self.checked = {"dispatch": _C.CheckedCalls(), "combine": _C.CheckedCalls()}
                self.regions = {}

            def _launcher_for(self, num_max_tokens, hidden, num_experts, buffer_idx, masked_ranks, checks):
                """As the real one: the engine makes a region once per sizes and buffer half, after the checks."""
                key = (num_max_tokens, hidden, num_experts, buffer_idx, id(masked_ranks))
                if key not in self.regions:
                    checks()
                    self.regions[key] = self.make_region()(num_max_tokens, hidden, num_experts, buffer_idx,
                                                           masked_ranks)

            def dispatch(self, call, masked_ranks, buffer_idx, check):
                phases = extension.LOW_LATENCY_SEND | (0 if call[10] else extension.LOW_LATENCY_RECV)
                extension.calls[f"LowLatencyOperations.dispatch(phases={phases})"] += 1
                checks = lambda: check(call)   # noqa: E731
                x, topk_idx = _arguments((call[0], call[1], call[4], call[5]), call[2:4] + call[6:],
                                         self.checked["dispatch"], checks)[:2]
                (num_tokens, hidden), num_topk = x[4], topk_idx[4][1]
                num_max_tokens, num_experts, use_fp8 = call[2], call[3], call[6]
                self._launcher_for(num_max_tokens, hidden, num_experts, buffer_idx, masked_ranks, checks)
                slots, scales = num_max_tokens, hidden // 128
                recv_x, recv_scales, count, src_info, layout_range, positions = _made_by_the_extension(
                    ((num_experts, slots, hidden), torch.float8_e4m3fn if use_fp8 else torch.bfloat16),
                    ((num_experts, slots, scales), torch.float32, (scales * slots, 1, slots)) if use_fp8 else None,
                    ((num_experts,), torch.int32), ((num_experts, slots), torch.int32), ((num_experts, 1), torch.int64),
                    ((2, num_tokens, num_topk), torch.int32))
                hook = None if phases & extension.LOW_LATENCY_RECV else Hook(phases)
                return recv_x, recv_scales, count, src_info, layout_range, hidden, hook, positions

            def combine(self, call, masked_ranks, buffer_idx, check):
                phases = extension.LOW_LATENCY_SEND | (0 if call[12] else extension.LOW_LATENCY_RECV)
                extension.calls[f"LowLatencyOperations.combine(phases={phases})"] += 1
                checks = lambda: check(call)   # noqa: E731
                positions = call[8]
                if positions is None:
                    checks()
                    positions = self.positions_for(call[1], call[7], masked_ranks=masked_ranks)
                out = call[13]
                arguments = _arguments(call[:5] + (positions, out, call[14], call[15] if call[10] else None),
                                       call[5:8] + call[9:13], self.checked["combine"], checks)
                self._launcher_for(call[5], call[6], call[7], buffer_idx, masked_ranks, checks)
                num_tokens, hidden = arguments[1][4][0], call[6]
                combined = out if out is not None else _made_by_the_extension(((num_tokens, hidden),
                                                                               torch.bfloat16))[0]
                return combined, None if phases & extension.LOW_LATENCY_RECV else Hook(phases)

        class Hook:   # the extension's LowLatencyHook
            def __init__(self, phases):
                self.phases = phases
                extension.last_hook = self

            def __call__(self):
                extension.calls[f"LowLatencyHook(phases={self.phases})"] += 1

        self.LowLatencyOperations = Operations
        self.state = State()

    def LowLatencyRegion(self, **fields):  # noqa: N802 - the extension's name
        self.calls["LowLatencyRegion"] += 1
        return fields


class NormalRecordingExtension(RecordingExtension):
    """Also stands in where the native normal mode uses the extension. Its launcher's dispatch receives all of a
    one-rank dispatch's tokens. It reads its tensor arguments and runs the caller's checks as the real launcher
    does: through the extension's own mechanism (``_C.torch_shim_arguments``, with a signature memo per
    operation)."""

    NORMAL_CONTROL_BYTES = 4096
    NORMAL_SM_PUSH_PERCENT = NORMAL_SM_PULL_PERCENT = NORMAL_COMBINE_CHUNKS = 0
    NORMAL_PULL_CHUNKS, NORMAL_MAX_CHUNKS, NORMAL_MAX_COMBINE_RANKS = 3, 63, 32
    NormalOwnRows = SimpleNamespace(__members__={"auto": 0, "engine": 1, "sm": 2})
    NormalRowPath = SimpleNamespace(__members__={"auto": 0, "engine": 1, "sm": 2, "sends": 3})
    DONE = 0

    def __init__(self) -> None:
        super().__init__()
        extension = self

        class NormalLauncher:
            def __init__(self, *args):
                extension.calls["NormalLauncher"] += 1
                self.checked = {name: _C.CheckedCalls() for name in ("dispatch", "cached_dispatch", "combine")}

            def dispatch(self, tensors, values, num_channels, stream, check):
                extension.calls["NormalLauncher.dispatch"] += 1
                x, scales, topk_idx = _arguments(tensors, values, self.checked["dispatch"], check)[:3]
                num_tokens, hidden = x[4]
                num_topk = topk_idx[4][1]
                dtypes = {code: dtype for dtype, code in DTYPES.items()}
                ints = torch.int32
                outputs = _made_by_the_extension(
                    ((num_tokens, 1), ints), ((1, 1), ints), ((num_tokens, 1), ints), ((1, 1), ints), ((1, 1), ints),
                    ((num_tokens, hidden), dtypes[x[1]]),
                    None if scales is None else ((num_tokens, scales[4][1]), dtypes[scales[1]]),
                    ((num_tokens, num_topk), torch.int64), ((num_tokens, num_topk), torch.float32),
                    ((num_tokens,), ints))
                return extension.DONE, outputs, [num_tokens] * E, object(), ""

            def cached_dispatch(self, tensors, values, num_channels, host_counts, stream, check):
                extension.calls["NormalLauncher.cached_dispatch"] += 1
                x = _arguments(tensors, values, self.checked["cached_dispatch"], check)[0]
                return extension.DONE, _made_by_the_extension(((T, x[4][1]), torch.bfloat16), None)

            def combine(self, tensors, values, num_channels, host_counts, stream, check):
                extension.calls["NormalLauncher.combine"] += 1
                x, topk_weights = _arguments(tensors, values, self.checked["combine"], check)[:2]
                weights = None if topk_weights is None else ((T, topk_weights[4][1]), torch.float32)
                return extension.DONE, _made_by_the_extension(((T, x[4][1]), torch.bfloat16), weights)

        self.NormalLauncher = NormalLauncher

    def NormalRegion(self, **fields):  # noqa: N802 - the extension's name
        self.calls["NormalRegion"] += 1
        return fields

    def NormalCopyEngine(self, *args, **kwargs):  # noqa: N802 - the extension's name
        self.calls["NormalCopyEngine"] += 1
        return SimpleNamespace(release=lambda: None)

    def get_dispatch_layout(self, tensors, values, num_ranks, stream, device, checked, check):
        self.calls["get_dispatch_layout"] += 1
        (topk_idx,) = _arguments(tensors, values, checked, check)
        return _made_by_the_extension(((num_ranks,), torch.int32), ((values[0],), torch.int32),
                                      ((topk_idx[4][0], num_ranks), torch.bool))

    def CheckedCalls(self):  # noqa: N802 - the extension's name
        return _C.CheckedCalls()


class PeerBuffer:
    def __init__(self, num_bytes: int) -> None:
        self.tensor = torch.zeros(num_bytes, dtype=torch.uint8)
        self.peer_bases = 0x3000
        self.memory = SimpleNamespace(peer_base=lambda rank: 0x3000)

    def release(self) -> None:
        pass


class AtenOps(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func.overloadpacket.__name__)] += 1
        return func(*args, **(kwargs or {}))


@pytest.fixture(scope="module")
def group():
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_local_port()}", rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


@pytest.fixture
def native_buffer(group, monkeypatch):
    """A low-latency Buffer whose native engine's low-latency operations are the recorder's."""
    from uccl_ep_plugin import Buffer
    from uccl_ep_plugin.engines.native import NativeEngine
    from uccl_ep_plugin.engines.native import low_latency as native_low_latency

    assert use_torch_shim(_C) is None   # the recorder reads its arguments with the real mechanism
    size = Buffer.get_low_latency_rdma_size_hint(T, H, 1, E)
    buffer = Buffer(group, num_rdma_bytes=size, low_latency_mode=True, explicitly_destroy=True)
    extension = RecordingExtension()
    monkeypatch.setattr(extension, "LowLatencyState", lambda index: extension.state, raising=False)
    engine = NativeEngine.__new__(NativeEngine)   # no CUDA here: only its low-latency part, set up by hand
    engine.normal = None
    engine.low_latency = native_low_latency.NativeLowLatency(extension, PeerBuffer(size), 0, 1, torch.device("cpu"),
                                                             5.0, 4, False)
    engine.low_latency_dispatch = engine.low_latency.low_latency_dispatch
    engine.low_latency_combine = engine.low_latency.low_latency_combine
    buffer._native = engine
    for operation in ("low_latency_dispatch", "low_latency_combine"):
        buffer.engine_by_operation[operation] = "native"
        buffer.engine_reasons.pop(operation, None)
    buffer._serve()
    yield buffer, extension
    buffer._native = None   # its engine owns nothing real
    buffer.destroy()


def _inputs():
    generator = torch.Generator().manual_seed(7)
    x = torch.randn((T, H), generator=generator).bfloat16()
    topk_idx = torch.stack([torch.randperm(E, generator=generator)[:K] for _ in range(T)])
    topk_weights = torch.rand((T, K), generator=generator)
    expert_out = torch.randn((E, T, H), generator=generator).bfloat16()
    return x, topk_idx, topk_weights, expert_out


def _counted(extension: RecordingExtension, call):
    """The aten operations and extension calls ``call()`` makes (after two calls that built what is kept for
    each of the two buffer halves)."""
    call()
    call()
    extension.calls.clear()
    with AtenOps() as aten:
        result = call()
    return result, dict(aten.ops), dict(extension.calls)


@pytest.mark.parametrize("use_fp8", [True, False], ids=["fp8", "bf16"])
def test_low_latency_dispatch_is_one_extension_call(native_buffer, use_fp8):
    buffer, extension = native_buffer
    x, topk_idx, _, _ = _inputs()
    result, ops, calls = _counted(extension, lambda: buffer.low_latency_dispatch(x, topk_idx, T, E, use_fp8=use_fp8))
    assert calls == {"LowLatencyOperations.dispatch(phases=3)": 1}
    assert ops == {}   # the extension allocates the outputs
    recv_x = result[0][0] if use_fp8 else result[0]
    assert recv_x.shape == (E, T, H)
    if use_fp8:
        assert result[0][1].stride() == (T * H // 128, 1, T)   # column-major scales, as DeepEP's


def test_low_latency_hook_is_one_extension_call_each(native_buffer):
    buffer, extension = native_buffer
    x, topk_idx, _, _ = _inputs()
    _, _, calls = _counted(extension, lambda: buffer.low_latency_dispatch(x, topk_idx, T, E, return_recv_hook=True))
    assert calls == {"LowLatencyOperations.dispatch(phases=1)": 1}
    hook = buffer.low_latency_dispatch(x, topk_idx, T, E, return_recv_hook=True)[4]
    assert hook is extension.last_hook   # the extension's own object: no Python of ours around it
    extension.calls.clear()
    with AtenOps() as aten:
        hook()
    assert dict(extension.calls) == {"LowLatencyHook(phases=1)": 1}
    assert not aten.ops


def test_low_latency_combine_is_one_extension_call(native_buffer):
    buffer, extension = native_buffer
    x, topk_idx, topk_weights, expert_out = _inputs()
    handle = buffer.low_latency_dispatch(x, topk_idx, T, E, use_fp8=False)[2]
    _, ops, calls = _counted(extension, lambda: buffer.low_latency_combine(expert_out, topk_idx, topk_weights, handle))
    assert calls == {"LowLatencyOperations.combine(phases=3)": 1}
    assert ops == {}   # the extension allocates the combined rows
    out = torch.empty((T, H), dtype=torch.bfloat16)
    _, ops, calls = _counted(extension, lambda: buffer.low_latency_combine(expert_out, topk_idx, topk_weights, handle,
                                                                           out=out))
    assert calls == {"LowLatencyOperations.combine(phases=3)": 1}
    assert not ops


def test_checked_signature_still_refuses_bad_input(native_buffer):
    """The checks run once per kind of call; a call that differs in what they read is checked again."""
    buffer, _ = native_buffer
    x, topk_idx, _, _ = _inputs()
    buffer.low_latency_dispatch(x, topk_idx, T, E)
    with pytest.raises(TypeError, match="x must have dtype"):
        buffer.low_latency_dispatch(x.float(), topk_idx, T, E)
    with pytest.raises(ValueError, match="x must be contiguous"):
        buffer.low_latency_dispatch(torch.cat([x, x], 1)[:, ::2], topk_idx, T, E)
    with pytest.raises(ValueError, match="more than num_max_dispatch_tokens_per_rank"):
        buffer.low_latency_dispatch(torch.cat([x, x]), torch.cat([topk_idx, topk_idx]), T, E)
    with pytest.raises(TypeError, match="x must be a torch.Tensor"):
        buffer.low_latency_dispatch(x.tolist(), topk_idx, T, E)


def test_low_latency_checks_run_once_per_kind_of_call(native_buffer, monkeypatch):
    """Once both buffer halves have served a kind of call, the same call runs no checks; another dtype, or a
    zero-copy combine given a bad x, runs them again (and they still refuse)."""
    buffer, _ = native_buffer
    x, topk_idx, topk_weights, expert_out = _inputs()
    ran = Counter()
    for name in ("_check_low_latency_dispatch", "_check_low_latency_combine"):
        checks = getattr(buffer, name)
        monkeypatch.setattr(buffer, name, lambda *args, _checks=checks, _name=name: (ran.update([_name]),
                                                                                     _checks(*args))[1])
    for _ in range(2):   # both halves
        handle = buffer.low_latency_dispatch(x, topk_idx, T, E, use_fp8=False)[2]
        buffer.low_latency_combine(expert_out, topk_idx, topk_weights, handle)
        buffer.low_latency_combine(expert_out, topk_idx, topk_weights, handle, zero_copy=True)
    ran.clear()
    for _ in range(2):
        handle = buffer.low_latency_dispatch(x.clone(), topk_idx, T, E, use_fp8=False)[2]
        buffer.low_latency_combine(expert_out, topk_idx, topk_weights, handle)
        buffer.low_latency_combine(expert_out, topk_idx, topk_weights, handle, zero_copy=True)
    assert not ran
    buffer.low_latency_dispatch(x, topk_idx, T, E, use_fp8=True)
    assert ran == {"_check_low_latency_dispatch": 1}
    with pytest.raises(TypeError, match="x must have dtype"):
        buffer.low_latency_combine(expert_out.float(), topk_idx, topk_weights, handle, zero_copy=True)


def test_layout_checks_run_once_per_kind_of_call(normal_buffer, monkeypatch):
    buffer, _ = normal_buffer
    _, topk_idx, _, _ = _inputs()
    ran = Counter()
    checks = buffer._check_topk_idx
    monkeypatch.setattr(buffer, "_check_topk_idx", lambda *args: (ran.update(["checks"]), checks(*args))[1])
    buffer.get_dispatch_layout(topk_idx, E)
    buffer.get_dispatch_layout(topk_idx.clone(), E)
    assert ran == {"checks": 1}
    buffer.get_dispatch_layout(topk_idx, 2 * E)
    assert ran == {"checks": 2}
    with pytest.raises(TypeError, match="topk_idx must have dtype"):
        buffer.get_dispatch_layout(topk_idx.int(), E)
    with pytest.raises(ValueError, match="num_experts"):
        buffer.get_dispatch_layout(topk_idx, 0)


class TorchFunctions(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.calls += 1
        return func(*args, **(kwargs or {}))


def test_low_latency_operations_make_no_torch_call(native_buffer):
    """A torch-function mode (torch.set_default_device installs one) sees no torch call of a native low-latency
    dispatch, hook or combine of a kind already checked: each would cost a Python handler. Their calls into the
    extension and their outputs stay the same."""
    buffer, extension = native_buffer
    x, topk_idx, topk_weights, expert_out = _inputs()
    for _ in range(2):   # both buffer halves; the checks run (outside the mode)
        handle = buffer.low_latency_dispatch(x, topk_idx, T, E)[2]
        buffer.low_latency_combine(expert_out, topk_idx, topk_weights, handle)
    with TorchFunctions() as mode:
        result, ops, calls = _counted(extension, lambda: buffer.low_latency_dispatch(x, topk_idx, T, E,
                                                                                     return_recv_hook=True))
        result[4]()
        combined = buffer.low_latency_combine(expert_out, topk_idx, topk_weights, result[2])[0]
    assert mode.calls == 0
    assert calls == {"LowLatencyOperations.dispatch(phases=1)": 1}
    assert ops == {}
    assert result[2][3] == H and combined.shape == (T, H)


def test_normal_operations_bypass_torch_function_modes(normal_buffer):
    """The normal-mode operations turn a torch-function mode off for their own torch calls, the checks included."""
    buffer, extension = normal_buffer
    _, topk_idx, _, _ = _inputs()
    with TorchFunctions() as mode:
        result, _, calls = _counted(extension, lambda: buffer.get_dispatch_layout(topk_idx, E))
        buffer.get_dispatch_layout(topk_idx, 2 * E)   # a new kind of call: checked
    assert mode.calls == 0
    assert calls == {"get_dispatch_layout": 1}
    assert result[2].shape == (E,)


@pytest.fixture
def normal_buffer(group, monkeypatch):
    """A Buffer whose normal-mode operations run the native engine's Python over the recorder."""
    from uccl_ep_plugin import Buffer
    from uccl_ep_plugin.engines.native import NativeEngine
    from uccl_ep_plugin.engines.native.normal import NativeNormal

    assert use_torch_shim(_C) is None   # the recorder reads its arguments with the real mechanism
    size = 1 << 20
    buffer = Buffer(group, num_nvl_bytes=size, explicitly_destroy=True)
    extension = NormalRecordingExtension()
    monkeypatch.setattr(extension, "LowLatencyState", lambda index: extension.state, raising=False)
    engine = NativeEngine.__new__(NativeEngine)   # no CUDA here: only its normal part, set up by hand
    engine._C, engine.num_ranks, engine.device, engine.low_latency = extension, 1, torch.device("cpu"), None
    engine._checked_layouts = extension.CheckedCalls()
    engine.rdma_ranks = None   # one rank, one host
    engine.normal = NativeNormal(extension, PeerBuffer(size), 0, 1, torch.device("cpu"), 5.0, False)
    engine.dispatch, engine.combine = engine.normal.dispatch, engine.normal.combine
    buffer._native = engine
    for operation in ("get_dispatch_layout", "dispatch", "combine"):
        buffer.engine_by_operation[operation] = "native"
        buffer.engine_reasons.pop(operation, None)
    buffer._serve()
    yield buffer, extension
    buffer._native = None   # its engine owns nothing real
    buffer.destroy()


def _layout(buffer):
    x, topk_idx, topk_weights, _ = _inputs()
    per_rank = torch.tensor([T], dtype=torch.int32)
    per_expert = torch.full((E,), T * K // E, dtype=torch.int32)
    return x, topk_idx, topk_weights, dict(num_tokens_per_rank=per_rank, is_token_in_rank=torch.ones((T, 1), dtype=torch.bool),
                                           num_tokens_per_expert=per_expert, topk_idx=topk_idx, topk_weights=topk_weights)


def test_get_dispatch_layout_is_one_extension_call(normal_buffer):
    buffer, extension = normal_buffer
    _, topk_idx, _, _ = _inputs()
    result, ops, calls = _counted(extension, lambda: buffer.get_dispatch_layout(topk_idx, E))
    assert calls == {"get_dispatch_layout": 1}
    assert ops == {}   # the extension allocates num_tokens_per_rank, num_tokens_per_expert, is_token_in_rank
    assert result[1] is None and result[3].shape == (T, 1)


@pytest.mark.parametrize("use_fp8", [True, False], ids=["fp8", "bf16"])
def test_normal_dispatch_is_one_extension_call(normal_buffer, use_fp8):
    buffer, extension = normal_buffer
    x, _, _, layout = _layout(buffer)
    payload = (x.to(torch.float8_e4m3fn), torch.rand((T, H // 128))) if use_fp8 else x
    result, ops, calls = _counted(extension, lambda: buffer.dispatch(payload, **layout))
    assert calls == {"NormalLauncher.dispatch": 1}
    assert ops == {}   # the extension allocates the handle's tables and the outputs
    recv_x = result[0][0] if use_fp8 else result[0]
    assert recv_x.shape == (T, H) and result[3] == [T] * E


def test_cached_dispatch_and_combine_are_one_extension_call_each(normal_buffer):
    buffer, extension = normal_buffer
    x, _, _, layout = _layout(buffer)
    recv_x, _, recv_weights, _, handle, _ = buffer.dispatch(x, **layout)
    _, ops, calls = _counted(extension, lambda: buffer.dispatch(x, handle=handle))
    assert calls == {"NormalLauncher.cached_dispatch": 1}
    assert ops == {}
    _, ops, calls = _counted(extension, lambda: buffer.combine(recv_x, handle, recv_weights))
    assert calls == {"NormalLauncher.combine": 1}
    assert ops == {}
    combined, weights, _ = buffer.combine(recv_x, handle)
    assert combined.shape == (T, H) and weights is None


def test_normal_checks_run_once_per_kind_of_call(normal_buffer, monkeypatch):
    """A normal-mode call runs the Buffer's checks only when the extension has not seen its kind of call pass:
    the same call again runs none; another dtype, shape or stride runs them again."""
    buffer, _ = normal_buffer
    x, _, _, layout = _layout(buffer)
    ran = Counter()
    for name in ("_check_dispatch", "_check_bias"):
        checks = getattr(buffer, name)
        monkeypatch.setattr(buffer, name, lambda *args, _checks=checks, _name=name: (ran.update([_name]),
                                                                                     _checks(*args))[1])
    recv_x, _, _, _, handle, _ = buffer.dispatch(x, **layout)
    buffer.dispatch(x.clone(), **layout)
    assert ran == {"_check_dispatch": 1}
    buffer.dispatch((x.to(torch.float8_e4m3fn), torch.rand((T, H // 128))), **layout)
    buffer.dispatch((x.to(torch.float8_e4m3fn), torch.rand((H // 128, T)).t()), **layout)   # column-major scales
    assert ran == {"_check_dispatch": 2}   # the scales reach the extension contiguous either way
    buffer.dispatch(x, handle=handle)
    buffer.dispatch(x, handle=handle)
    assert ran == {"_check_dispatch": 3}
    buffer.combine(recv_x, handle)
    buffer.combine(recv_x, handle)
    buffer.combine(recv_x, handle, bias=recv_x)
    assert ran == {"_check_dispatch": 3, "_check_bias": 2}


def test_normal_checked_signature_still_refuses_bad_input(normal_buffer):
    buffer, _ = normal_buffer
    x, _, _, layout = _layout(buffer)
    recv_x, _, _, _, handle, _ = buffer.dispatch(x, **layout)
    with pytest.raises(TypeError, match="x must have dtype"):
        buffer.dispatch(x.float(), **layout)
    with pytest.raises(ValueError, match="is_token_in_rank must have shape"):
        buffer.dispatch(x, **{**layout, "is_token_in_rank": torch.ones((T + 1, 1), dtype=torch.bool)})
    with pytest.raises(ValueError, match="x has 16 tokens but the handle was made for 8"):
        buffer.dispatch(torch.cat([x, x]), handle=handle)
    with pytest.raises(ValueError, match="x must have shape"):
        buffer.combine(recv_x[1:], handle)
    with pytest.raises(ValueError, match=r"bias\[0\] must have shape"):
        buffer.combine(recv_x, handle, bias=recv_x[:, 1:].contiguous())
    with pytest.raises(ValueError, match="at most 2"):
        buffer.combine(recv_x, handle, bias=(recv_x, recv_x, recv_x))
    with pytest.raises(TypeError, match=r"bias\[0\] must be a torch.Tensor"):
        buffer.combine(recv_x, handle, bias=[recv_x])
    with pytest.raises(TypeError, match="x must be a torch.Tensor"):
        buffer.dispatch(x.tolist(), **layout)
    with pytest.raises(ValueError, match="x as a tuple must be"):
        buffer.dispatch((x, x, x), **layout)
    with pytest.raises(TypeError, match="expert_alignment must be an int"):
        buffer.dispatch(x, **layout, expert_alignment=1.0)
    with pytest.raises(ValueError, match="topk_idx and topk_weights must be None"):
        buffer.dispatch(x, handle=handle, topk_idx=layout["topk_idx"], topk_weights=layout["topk_weights"])


def test_kernels_take_the_flag_style_the_platform_config_resolves(monkeypatch):
    """UCCL_EP_ENABLE_AGGRESSIVE_ATOMIC reaches both modes' kernel arguments (auto: on only with a ROCm torch)."""
    from uccl_ep_plugin.engines.native import aggressive_atomics
    from uccl_ep_plugin.engines.native.low_latency import NativeLowLatency
    from uccl_ep_plugin.engines.native.normal import NativeNormal
    from uccl_ep_plugin.platform_config.loader import AUTO_ATOMIC_KEY

    monkeypatch.delenv("UCCL_EP_CONFIG", raising=False)
    monkeypatch.delenv(AUTO_ATOMIC_KEY, raising=False)
    assert aggressive_atomics() is (torch.version.hip is not None)
    for value, expected in (("1", True), ("0", False)):
        monkeypatch.setenv(AUTO_ATOMIC_KEY, value)
        assert aggressive_atomics() is expected
    extension = NormalRecordingExtension()
    monkeypatch.setattr(extension, "LowLatencyState", lambda index: extension.state, raising=False)
    for style in (True, False):
        normal = NativeNormal(extension, PeerBuffer(1 << 20), 0, 1, torch.device("cpu"), 5.0, style)
        assert normal.region["aggressive_atomics"] is style
        low_latency = NativeLowLatency(extension, PeerBuffer(1 << 20), 0, 1, torch.device("cpu"), 5.0, 4, style)
        assert low_latency._region(T, H, E, 0, None)["aggressive_atomics"] is style
